//! Where the binaries come from.
//!
//! Control plane: `KUBE_BIN_DIR` (kube-apiserver, kube-scheduler, kube-controller-manager)
//! and `ETCD_BIN` select any set of binaries; without them, `scripts/kube-bins.sh` builds
//! v1.20.2 from Debian's source package once into the user's cache and reports where.
//!
//! The suite's own daemons (`virtual-node`, `webhook`, `descheduler`): `TENSILE_BIN_DIR`, or the
//! cargo profile directory the running executable was built into ([`suite_binary`]). `cargo test`
//! alone does not build them all (only packages with tests of their own get their binaries
//! built), so `make test` runs `cargo build --workspace --bins` first.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Build(String),
    #[error("{what}: {detail}")]
    Binary { what: String, detail: String },
}

/// A located set of control-plane binaries and the version they report.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub apiserver: PathBuf,
    pub scheduler: PathBuf,
    pub controller_manager: PathBuf,
    pub etcd: PathBuf,
    /// Minor version of the Kubernetes binaries (20 for v1.20.2).
    pub minor: u32,
    pub version: String,
}

impl Binaries {
    /// Locates (building if needed) the binaries; cached for the life of the process.
    pub fn get() -> Result<&'static Binaries, Error> {
        static BINS: OnceLock<Result<Binaries, String>> = OnceLock::new();
        BINS.get_or_init(|| Self::locate().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::Build(e.clone()))
    }

    fn locate() -> Result<Binaries, Error> {
        let dir = match std::env::var_os("KUBE_BIN_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => build()?,
        };
        let etcd = match std::env::var_os("ETCD_BIN") {
            Some(p) => PathBuf::from(p),
            None => which("etcd").ok_or_else(|| Error::Binary {
                what: "etcd".into(),
                detail:
                    "not on PATH and ETCD_BIN is unset; run `make kube-bins` (installs Debian's etcd-server) \
                         or set ETCD_BIN"
                        .into(),
            })?,
        };
        let apiserver = dir.join("kube-apiserver");
        let (version, minor) = version_of(&apiserver)?;
        Ok(Binaries {
            scheduler: existing(dir.join("kube-scheduler"))?,
            controller_manager: existing(dir.join("kube-controller-manager"))?,
            apiserver,
            etcd: existing(etcd)?,
            minor,
            version,
        })
    }
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

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// The repository's build script (the crate sits one level below the workspace root).
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kube-bins.sh")
}

fn build() -> Result<PathBuf, Error> {
    let script = build_script();
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Build(format!("cannot run {}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(Error::Build(format!(
            "{} failed ({}); its messages above say which step and how to fix it",
            script.display(),
            out.status
        )));
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok(PathBuf::from(dir))
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
fn version_of(binary: &Path) -> Result<(String, u32), Error> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| Error::Binary {
            what: binary.display().to_string(),
            detail: format!("cannot run it: {e}"),
        })?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    parse_version(&text).ok_or_else(|| Error::Binary {
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
            parse_version("Kubernetes v1.20.2\n"),
            Some(("v1.20.2".into(), 20))
        );
        assert_eq!(
            parse_version("Kubernetes v1.28.0-dirty"),
            Some(("v1.28.0-dirty".into(), 28))
        );
        assert_eq!(parse_version("etcd Version: 3.4"), None);
    }
}
