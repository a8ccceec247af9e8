//! A virtual node run inside the test process, so tests can crash and restart it at will,
//! and one run as its own process ([`VirtualNodeProcess`]), for signals.

use tensile_virtual_node::Args;

use crate::{TestCluster, free_port};

/// A virtual node running in process; dropping it is a crash (no clean-up runs).
pub struct VirtualNode {
    pub kubelet_port: u16,
    pub admin_addr: String,
    task: tokio::task::JoinHandle<Result<(), tensile_virtual_node::Error>>,
}

/// The options of a virtual node `name` for `upper` over `lower` in a test bed: every
/// default, plus a loopback node IP, free kubelet and admin ports and the upper
/// kubelet-client CA. Tests set further fields before [`VirtualNode::run`].
pub fn options(upper: &TestCluster, name: &str, lower: &TestCluster) -> anyhow::Result<Args> {
    let loopback = std::net::Ipv4Addr::LOCALHOST.into();
    let mut args = Args::new(name, loopback, Some(upper.kubeconfig()), lower.kubeconfig())?;
    args.kubelet.kubelet_port = free_port()?;
    args.kubelet.client_verify_ca = Some(upper.kubelet_client_ca_path().to_owned());
    args.admin.admin_addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, free_port()?));
    Ok(args)
}

impl VirtualNode {
    /// Starts a virtual node `name` for `upper` over `lower` with the test bed's [`options`].
    pub fn start(upper: &TestCluster, name: &str, lower: &TestCluster) -> anyhow::Result<Self> {
        Ok(Self::run(options(upper, name, lower)?))
    }

    /// Starts a virtual node with `args` (see [`options`]).
    pub fn run(args: Args) -> Self {
        // Not `run`: that would take SIGTERM and SIGINT away from the test process.
        let never = tensile_common::runtime::CancellationToken::new();
        VirtualNode {
            kubelet_port: args.kubelet.kubelet_port,
            admin_addr: args.admin.admin_addr.to_string(),
            task: tokio::spawn(tensile_virtual_node::run_until(args, never)),
        }
    }
}

impl Drop for VirtualNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The command line of a virtual node `name` for `upper` over `lower` in a test bed: the
/// flags an operator would pass for what [`options`] sets.
fn argv_for(
    upper: &TestCluster,
    name: &str,
    lower: &TestCluster,
    kubelet_port: u16,
    admin_addr: &str,
) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", upper.kubeconfig().display()),
        format!("--client-kubeconfig={}", lower.kubeconfig().display()),
        format!("--nodename={name}"),
        "--node-ip=127.0.0.1".into(),
        format!("--kubelet-port={kubelet_port}"),
        format!("--admin-addr={admin_addr}"),
        format!("--client-verify-ca={}", upper.kubelet_client_ca_path().display()),
    ]
}

/// The `virtual-node` binary as a child process, for tests that send it signals.
pub struct VirtualNodeProcess {
    pub service: crate::process::Service,
    pub admin_addr: String,
    pub kubelet_port: u16,
}

impl VirtualNodeProcess {
    /// Starts `virtual-node` as [`argv_for`] says, `extra` added (replacing a default of the
    /// same flag), logging to
    /// `<upper dir>/virtual-node-<log_name>.log`.
    pub fn start(
        upper: &TestCluster,
        name: &str,
        lower: &TestCluster,
        extra: &[&str],
        log_name: &str,
    ) -> anyhow::Result<Self> {
        let kubelet_port = free_port()?;
        let admin_addr = format!("127.0.0.1:{}", free_port()?);
        // A flag in `extra` replaces the default of the same name.
        let overridden = |flag: &String| {
            let name = flag.split('=').next().unwrap_or_default();
            extra.iter().any(|e| e.split('=').next() == Some(name))
        };
        let mut args: Vec<String> = argv_for(upper, name, lower, kubelet_port, &admin_addr)
            .into_iter()
            .filter(|f| !overridden(f))
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let program = crate::bins::suite_binary("virtual-node")?;
        let log = upper.dir().join(format!("virtual-node-{log_name}.log"));
        let _ = std::fs::remove_file(&log);
        let service =
            crate::process::Service::start(&format!("virtual-node {log_name}"), &program, &args, &log)?;
        Ok(Self {
            service,
            admin_addr,
            kubelet_port,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.service.pid()
    }

    /// Sends `signal` (`TERM`, `KILL`, `STOP`, `CONT`).
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid().ok_or_else(|| anyhow::anyhow!("not running"))?;
        crate::process::signal(pid, signal).map_err(anyhow::Error::msg)
    }

    /// Waits up to `within` for the process to exit.
    pub async fn exit_within(&mut self, within: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.service.exited() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// `GET /readyz` on the admin endpoint: status code and body (`None` when it does not
    /// answer).
    pub async fn readyz(&self) -> Option<(u16, String)> {
        admin_get(&self.admin_addr, "/readyz").await
    }

    pub fn log(&self) -> String {
        self.service.log_tail(20_000)
    }
}

/// A plain-HTTP GET on a daemon's admin endpoint: status code and body.
pub async fn admin_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let io = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        tcp.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let code = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Some((code, body))
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), io)
        .await
        .ok()
        .flatten()
}
