//! The local test bed: real Kubernetes control planes on loopback and simulated kubelets.
//!
//! A [`TestCluster`] is etcd (shared per process, one key prefix per cluster), a real
//! kube-apiserver and, when asked, kube-scheduler and kube-controller-manager, all on
//! 127.0.0.1 with certificates made in process. A [`NodeSimulator`] plays the kubelets:
//! it registers Nodes, keeps their Leases and status, runs the pods bound to them through
//! believable lifecycles and serves the kubelet API (`kubectl logs`) over TLS.
//!
//! Every child process is killed when its owner is dropped and, through PDEATHSIG, when the
//! test process dies. Logs land under `target/e2e-logs/<test>/<cluster>/`.

pub mod benches;
pub mod bins;
pub mod chart;
pub mod check;
pub mod cluster;
pub mod demo;
pub mod descheduler;
pub mod etcd;
pub mod failback;
pub mod fleet;
pub mod flood;
pub mod floor;
pub mod in_process;
pub mod kubectl;
pub mod multi_scheduler;
pub mod partition;
pub mod pki;
pub mod process;
pub mod proxy;
pub mod records;
pub mod rounds;
pub mod runner;
pub mod scale;
pub mod scene;
pub mod shared;
pub mod simulator;
pub mod stats;
pub mod streams;
pub mod testbed;
pub mod tls;
pub mod wait;

use std::path::{Path, PathBuf};

pub use bins::Binaries;
pub use cluster::{ClusterOptions, TestCluster};
pub use etcd::Etcd;
pub use simulator::{Behavior, NodeConfig, NodeSimulator, SimulatorOptions};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Binaries(#[from] bins::Error),
    #[error(transparent)]
    Process(#[from] process::Error),
    #[error(transparent)]
    Pki(#[from] pki::Error),
    #[error(transparent)]
    Tls(#[from] tls::Error),
    #[error("etcd: {0}")]
    Etcd(String),
    #[error("the bed's node address: {0}")]
    NodeAddress(String),
    #[error("cluster {cluster}: {message}")]
    Cluster { cluster: String, message: String },
    #[error("virtual node {name}: {message}")]
    VirtualNode { name: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Kubeconfig(#[from] tensile_common::kubeconfig::Error),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Demo(String),
    #[error("timed out after {secs} s waiting for {what}")]
    Timeout { what: String, secs: u64 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// The workspace's target directory (`CARGO_TARGET_DIR` when set).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// The running executable's name without cargo's hash suffix (`testbed-1a2b…` → `testbed`).
pub fn binary_name() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe
        .as_ref()
        .and_then(|p| p.file_stem())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "e2e".into());
    match stem.rsplit_once('-') {
        Some((base, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            base.to_owned()
        }
        _ => stem,
    }
}

/// A port that was free on 127.0.0.1 a moment ago.
/// The body of a test-bed binary's `main`: sets up logging (with `quiet` as the filter
/// unless the user chose one), runs `work` on a runtime, and turns its outcome into an exit
/// code, with errors printed behind `name:`.
pub fn main_of<F>(
    name: &str,
    log: &mut tensile_common::telemetry::LogArgs,
    quiet: &str,
    work: impl FnOnce() -> F,
) -> std::process::ExitCode
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    use std::process::ExitCode;
    if std::env::var_os("TENSILE_LOG").is_none() && log.level == "info" {
        log.level = quiet.into();
    }
    if let Err(e) = tensile_common::telemetry::init(log) {
        eprintln!("{name}: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
pub async fn wait_for_signal() -> anyhow::Result<()> {
    use anyhow::Context as _;
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// The bed's node address: the `InternalIP` of simulated and virtual nodes, where their kubelet
/// API listens. Not loopback, since the apiserver refuses to proxy `nodes/proxy` to a loopback
/// node address; `scripts/bed-net.sh` makes it once per machine (or `TENSILE_NODE_IP` names one).
pub fn node_ip() -> Result<std::net::IpAddr> {
    static NODE_IP: std::sync::OnceLock<std::result::Result<std::net::IpAddr, String>> =
        std::sync::OnceLock::new();
    NODE_IP
        .get_or_init(|| {
            let text = run_script("bed-net.sh", &[])?;
            text.parse()
                .map_err(|e| format!("scripts/bed-net.sh printed {text:?}, not an address: {e}"))
        })
        .clone()
        .map_err(Error::NodeAddress)
}

/// Runs `scripts/<name> ARGS…` of this repository, its messages passed on to stderr; what it
/// printed, trimmed, or why it failed.
pub(crate) fn run_script(name: &str, args: &[&str]) -> std::result::Result<String, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed ({}); its messages above say which step and how to fix it",
            script.display(),
            args.join(" "),
            out.status
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A port on 127.0.0.1 that nothing listens on now, for a server the caller starts soon.
///
/// It is taken below the kernel's ephemeral range (`ip_local_port_range`, 32768 and up by
/// default): a port from that range can be taken, between this answer and the server's bind,
/// by any outgoing connection (every API client makes them) or by a bind to port 0, and a
/// control-plane component that loses that race fails to start. Test processes running side
/// by side (`scripts/test.sh`) never hand out the same port: each holds a lock on a block of
/// ports (a file under the temporary directory, released when the process ends, however it
/// ends) and hands out each port of its blocks once.
pub fn free_port() -> Result<u16> {
    use std::sync::Mutex;
    const LOW: u32 = 10_000;
    const BLOCK: u32 = 500;
    struct Blocks {
        /// The lock files of the blocks this process holds.
        held: Vec<std::fs::File>,
        next: u32,
        end: u32,
    }
    static BLOCKS: Mutex<Blocks> = Mutex::new(Blocks {
        held: Vec::new(),
        next: 0,
        end: 0,
    });
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low <= LOW + BLOCK {
        // No room below the ephemeral range: let the kernel choose.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err("127.0.0.1:0"))?;
        return Ok(listener.local_addr().map_err(io_err("127.0.0.1:0"))?.port());
    }
    let blocks = (ephemeral_low - LOW) / BLOCK;
    let dir = std::env::temp_dir().join("tensile-ports");
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let mut mine = BLOCKS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        while mine.next < mine.end {
            let port = u16::try_from(mine.next).unwrap_or(u16::MAX);
            mine.next += 1;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
        // Another block: the first free one after an offset of this process's own, so that
        // processes started together rarely try the same lock first.
        let start = std::process::id().wrapping_mul(2_654_435_761) % blocks;
        let taken = (0..blocks).map(|i| (start + i) % blocks).find_map(|block| {
            let path = dir.join(format!("block-{block}"));
            let file = std::fs::File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .ok()?;
            file.try_lock().ok().map(|()| (block, file))
        });
        let Some((block, file)) = taken else {
            return Err(io_err("127.0.0.1")(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("every block of ports in {LOW}..{ephemeral_low} is held by another process"),
            )));
        };
        mine.held.push(file);
        mine.next = LOW + block * BLOCK;
        mine.end = mine.next + BLOCK;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| super::free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or(32_768);
        for port in ports {
            if ephemeral_low > 11_000 {
                assert!((10_000..ephemeral_low).contains(&port), "{port}");
            }
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
