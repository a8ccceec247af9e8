//! One etcd per process, shared by its clusters (each cluster has its own key prefix).
//!
//! Data lives on tmpfs (`/dev/shm`) when there is one: etcd 3.4 has no switch to skip
//! fsync, and fsync on a disk is what makes a local control plane slow. Directories left by
//! processes that died without cleaning up are removed by the next start.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::process::{Service, pid_alive};
use crate::{Error, free_port};

const DATA_PREFIX: &str = "tensile-e2e-etcd-";

#[derive(Debug)]
pub struct Etcd {
    service: std::sync::Mutex<Service>,
    url: String,
    data: PathBuf,
}

impl Etcd {
    /// The process-wide etcd, started on first use and killed when the process exits.
    pub fn shared() -> Result<Arc<Etcd>, Error> {
        static SHARED: OnceLock<Result<Arc<Etcd>, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let logs = crate::target_dir().join("e2e-logs").join(crate::binary_name());
                Etcd::start(&logs).map(Arc::new).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Etcd)
    }

    /// Starts a private etcd, logging under `log_dir`; it stops when the value is dropped.
    pub fn start(log_dir: &Path) -> Result<Etcd, Error> {
        let binary = crate::bins::etcd()?;
        sweep_stale_data();
        let root = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let mut last = String::new();
        for _attempt in 0..3 {
            let data = root.join(format!("{DATA_PREFIX}{}-{}", std::process::id(), unique()));
            let (client, peer) = (free_port()?, free_port()?);
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let args = vec![
                "--name=default".to_string(),
                format!("--data-dir={}", data.display()),
                format!("--listen-client-urls={url}"),
                format!("--advertise-client-urls={url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                "--snapshot-count=20000".into(),
                "--auto-compaction-mode=periodic".into(),
                "--auto-compaction-retention=5m".into(),
            ];
            let log = log_dir.join("etcd.log");
            let service = Service::start("etcd", &binary, &args, &log)?;
            let etcd = Etcd {
                service: std::sync::Mutex::new(service),
                url,
                data,
            };
            match etcd.wait_healthy(Duration::from_secs(30)) {
                Ok(()) => return Ok(etcd),
                Err(tail) => last = tail,
            }
        }
        Err(Error::Etcd(format!(
            "etcd did not become healthy; log tail:\n{last}"
        )))
    }

    /// The etcd process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.service.lock().ok().and_then(|s| s.pid())
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn wait_healthy(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let addr = self.url.trim_start_matches("http://").to_owned();
        loop {
            if let Ok(body) = http_get(&addr, "/health")
                && body.contains("\"health\":\"true\"")
            {
                return Ok(());
            }
            let mut service = self
                .service
                .lock()
                .map_err(|_| "etcd lock poisoned".to_string())?;
            if service.exited().is_some() || Instant::now() > deadline {
                return Err(service.log_tail(4000));
            }
            drop(service);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Ok(mut s) = self.service.lock() {
            s.stop();
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Removes data directories of etcds whose owning process no longer exists.
fn sweep_stale_data() {
    for root in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(DATA_PREFIX) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !pid_alive(pid) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}
