//! Where the binaries come from.
//!
//! Control plane: each cluster of the bed runs one Kubernetes version of the supported range
//! ([`version_for`]); `scripts/kube-bins.sh VERSION` builds that version's kube-apiserver,
//! kube-scheduler, kube-controller-manager and kubectl from the published Go modules once into
//! the user's cache and reports where. `KUBE_BIN_DIR` selects one directory of all four for every
//! cluster instead (no skew then); `ETCD_BIN` an etcd, which `scripts/kube-bins.sh --etcd` builds
//! otherwise.
//!
//! The suite's own daemons (`virtual-node`, `webhook`, `descheduler`): `TENSILE_BIN_DIR`, or the
//! cargo profile directory the running executable was built into ([`suite_binary`]). `cargo test`
//! alone does not build them all (only packages with tests of their own get their binaries
//! built), so `make test` runs `cargo build --workspace --bins` first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Build(String),
    #[error("{what}: {detail}")]
    Binary { what: String, detail: String },
}

/// The cluster of the default bed that runs the oldest supported version, so that every
/// scenario with two lower clusters crosses a version skew, as production does.
pub const SKEWED_CLUSTER: &str = "lower-b";

/// The version a cluster named `name` runs unless its options say otherwise: `KUBE_SKEW_VERSION`
/// (default `oldest`) for [`SKEWED_CLUSTER`], `KUBE_VERSION` (default `newest`) for every other.
/// A version is `newest`, `oldest`, `1.MINOR` or an exact `v1.MINOR.PATCH`
/// (`scripts/kube-bins.sh --versions` lists the supported range).
pub fn version_for(name: &str) -> String {
    let (var, default) = if name == SKEWED_CLUSTER {
        ("KUBE_SKEW_VERSION", "oldest")
    } else {
        ("KUBE_VERSION", "newest")
    };
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// A located set of control-plane binaries and the version they report.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub apiserver: PathBuf,
    pub scheduler: PathBuf,
    pub controller_manager: PathBuf,
    /// The kubectl of the same version.
    pub kubectl: PathBuf,
    pub version: String,
}

impl Binaries {
    /// Locates (building if needed) the binaries of `version` (see [`version_for`]); cached
    /// for the life of the process.
    pub fn of(version: &str) -> Result<&'static Binaries, Error> {
        static BINS: OnceLock<Mutex<HashMap<String, Result<&'static Binaries, String>>>> = OnceLock::new();
        let mut known = BINS
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| Error::Build("binary cache lock poisoned".into()))?;
        known
            .entry(version.to_owned())
            .or_insert_with(|| {
                Self::locate(version)
                    .map(|b| &*Box::leak(Box::new(b)))
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Build)
    }

    /// The binaries of the newest supported version (or `KUBE_VERSION`).
    pub fn newest() -> Result<&'static Binaries, Error> {
        Self::of(&version_for("upper"))
    }

    fn locate(version: &str) -> Result<Binaries, Error> {
        let dir = match std::env::var_os("KUBE_BIN_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => PathBuf::from(run_script(&[version])?),
        };
        let apiserver = dir.join("kube-apiserver");
        let version = version_of(&apiserver)?;
        Ok(Binaries {
            scheduler: existing(dir.join("kube-scheduler"))?,
            controller_manager: existing(dir.join("kube-controller-manager"))?,
            kubectl: existing(dir.join("kubectl"))?,
            apiserver,
            version,
        })
    }
}

/// The etcd binary: `ETCD_BIN`, or the one `scripts/kube-bins.sh --etcd` builds; cached for the
/// life of the process.
pub fn etcd() -> Result<PathBuf, Error> {
    static ETCD: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ETCD.get_or_init(|| {
        let path = match std::env::var_os("ETCD_BIN") {
            Some(p) => PathBuf::from(p),
            None => PathBuf::from(run_script(&["--etcd"]).map_err(|e| e.to_string())?),
        };
        existing(path).map_err(|e| e.to_string())
    })
    .clone()
    .map_err(Error::Build)
}

fn existing(p: PathBuf) -> Result<PathBuf, Error> {
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::Binary {
            what: p.display().to_string(),
            detail: "missing; run `make kube-bins` or fix KUBE_BIN_DIR / ETCD_BIN".into(),
        })
    }
}

/// Runs the build script with `args`; what it printed.
fn run_script(args: &[&str]) -> Result<String, Error> {
    crate::run_script("kube-bins.sh", args).map_err(Error::Build)
}

/// The suite's binary `name` (`virtual-node`, `webhook`, `descheduler`) as cargo built it: in
/// `TENSILE_BIN_DIR` when set, else in the profile directory of the running executable
/// (`target/debug/` for the `demo` binary and for tests, which run from `target/debug/deps/`).
pub fn suite_binary(name: &str) -> Result<PathBuf, Error> {
    let dirs: Vec<PathBuf> = match std::env::var_os("TENSILE_BIN_DIR") {
        Some(dir) => vec![PathBuf::from(dir)],
        None => {
            let exe_dir = std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf));
            let mut dirs: Vec<PathBuf> = exe_dir.iter().cloned().collect();
            if let Some(dir) = exe_dir.filter(|d| d.file_name().is_some_and(|n| n == "deps")) {
                dirs.extend(dir.parent().map(Path::to_path_buf));
            }
            dirs
        }
    };
    let package = format!("tensile-{name}");
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::Binary {
            what: name.to_owned(),
            detail: format!(
                "not found in {}; build it with `cargo build -p {package} --bin {name}` \
                 (same profile and target directory; `make test` builds every binary first) \
                 or set TENSILE_BIN_DIR",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        })
}

/// Runs `binary --version` and parses `Kubernetes v1.MINOR.PATCH`.
fn version_of(binary: &Path) -> Result<String, Error> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| Error::Binary {
            what: binary.display().to_string(),
            detail: format!("cannot run it: {e}"),
        })?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    parse_version(&text)
        .map(|(version, _)| version)
        .ok_or_else(|| Error::Binary {
            what: binary.display().to_string(),
            detail: format!("unexpected --version output {text:?}"),
        })
}

fn parse_version(text: &str) -> Option<(String, u32)> {
    let v = text.split_whitespace().find(|w| w.starts_with("v1."))?;
    let minor = v.trim_start_matches("v1.").split('.').next()?.parse().ok()?;
    Some((v.to_owned(), minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(
            parse_version("Kubernetes v1.37.2\n"),
            Some(("v1.37.2".into(), 37))
        );
        assert_eq!(
            parse_version("Kubernetes v1.28.0-dirty"),
            Some(("v1.28.0-dirty".into(), 28))
        );
        assert_eq!(parse_version("etcd Version: 3.4"), None);
    }
}
