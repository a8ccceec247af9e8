//! A virtual node run inside the test process, so tests can crash and restart it at will,
//! and one run as its own process ([`VirtualNodeProcess`]), for signals.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;
use tensile_common::node_identity;
use tensile_controller::approve;
use tensile_controller::resource::{LowerCluster, LowerClusterSpec};
use tensile_virtual_node::{Args, UpperIdentity};

use crate::chart::Access;
use crate::{TestCluster, free_port};

/// The namespace of the test virtual nodes' accounts.
const ACCOUNTS: &str = "tensile-e2e-nodes";
/// The lower namespace of the chart's lower account the test virtual nodes act as below.
const LOWER_ACCOUNTS: &str = "tensile-e2e-lower";
/// The release name the chart's grants are rendered under.
const RELEASE: &str = "e2e";

/// The clusters of the accounts [`options`] named, by account kubeconfig.
fn identities() -> &'static Mutex<HashMap<PathBuf, Access>> {
    static IDENTITIES: OnceLock<Mutex<HashMap<PathBuf, Access>>> = OnceLock::new();
    IDENTITIES.get_or_init(Mutex::default)
}

/// The lower clusters of the lower accounts [`options`] named, by account kubeconfig.
fn lower_identities() -> &'static Mutex<HashMap<PathBuf, Access>> {
    static IDENTITIES: OnceLock<Mutex<HashMap<PathBuf, Access>>> = OnceLock::new();
    IDENTITIES.get_or_init(Mutex::default)
}

/// Applies `file` on the cluster `access` reaches, again on a conflict (nodes started at once
/// apply the same shared objects at once).
async fn apply_shared(access: &Access, file: &Path, what: &str) -> anyhow::Result<()> {
    let file = file.display().to_string();
    let mut applied = access.kubectl(&["apply", "-f", &file]).await;
    for _ in 0..10 {
        if applied.ok {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        applied = access.kubectl(&["apply", "-f", &file]).await;
    }
    anyhow::ensure!(applied.ok, "applying {what}: {}", applied.stderr);
    Ok(())
}

/// Writes to `account` the kubeconfig of the lower account the chart renders for the lower
/// cluster `access` reaches (`--set target=lower`), with every option that widens it on
/// (Service reflection, namespace collection, node usage): the widest cluster-scope lower
/// identity an operator can install, and nothing of the lower admin's.
async fn lower_account(access: &Access, account: &Path) -> anyhow::Result<()> {
    let rendered = crate::chart::helm_with(
        access,
        &[
            "template",
            RELEASE,
            &crate::chart::chart_dir().display().to_string(),
            "-n",
            LOWER_ACCOUNTS,
            "--set",
            "target=lower",
            "--set",
            "virtualNodes.reflectServices=true",
            "--set",
            "virtualNodes.gcNamespaces=true",
            "--set",
            "lower.nodeStats=true",
        ],
    )
    .await?;
    anyhow::ensure!(rendered.ok, "helm template (lower): {}", rendered.stderr);
    let manifest = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {LOWER_ACCOUNTS}}}\n---\n{}",
        rendered.stdout
    );
    let file = access.dir.join(format!("{RELEASE}-lower.identity.yaml"));
    std::fs::write(&file, manifest)?;
    apply_shared(access, &file, "the chart's lower account").await?;
    crate::chart::service_account_kubeconfig_with(
        access,
        LOWER_ACCOUNTS,
        &format!("{RELEASE}-tensile-lower"),
        account,
    )
    .await?;
    Ok(())
}

/// Gives virtual node `node` of the upper cluster `access` reaches what the chart and the
/// cluster controller give one under a node identity: its account (kubeconfig written to
/// `account`) with its rights (ask for its certificate; its election), the chart's role of
/// what a node may not do bound to its user; and returns the approver of its certificate
/// requests, which judges them with the cluster controller's own rule as if a `LowerCluster`
/// of that name made the account.
async fn node_identity(
    access: &Access,
    node: &str,
    account: &Path,
) -> anyhow::Result<impl Future<Output = ()> + use<>> {
    let sa = format!("{RELEASE}-vn-{node}");
    let request = node_identity::request_name(node);
    let rendered = crate::chart::helm_with(
        access,
        &[
            "template",
            RELEASE,
            &crate::chart::chart_dir().display().to_string(),
            "--show-only",
            "templates/virtual-node.yaml",
            "--set",
            "virtualNodes.reflectServices=true",
        ],
    )
    .await?;
    anyhow::ensure!(rendered.ok, "helm template: {}", rendered.stderr);
    let shared = rendered
        .stdout
        .split("\n---")
        .find(|doc| doc.lines().any(|l| l.trim() == "kind: ClusterRole"))
        .ok_or_else(|| anyhow::anyhow!("the chart renders no virtual-node ClusterRole"))?
        .to_owned();
    let manifest = format!(
        "{shared}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {ACCOUNTS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: {sa}, namespace: {ACCOUNTS}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {sa}}}
rules:
- {{apiGroups: [certificates.k8s.io], resources: [certificatesigningrequests], verbs: [create]}}
- {{apiGroups: [certificates.k8s.io], resources: [certificatesigningrequests], resourceNames: [{request}], verbs: [get, delete]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {sa}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {sa}}}
subjects: [{{kind: ServiceAccount, name: {sa}, namespace: {ACCOUNTS}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {sa}-node}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {RELEASE}-tensile-virtual-node}}
subjects: [{{kind: User, apiGroup: rbac.authorization.k8s.io, name: system:node:{node}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: {sa}, namespace: kube-system}}
rules:
- {{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [create]}}
- {{apiGroups: [coordination.k8s.io], resources: [leases], resourceNames: [tensile-virtual-node-{node}], verbs: [get, update]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: {sa}, namespace: kube-system}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: {sa}}}
subjects: [{{kind: ServiceAccount, name: {sa}, namespace: {ACCOUNTS}}}]
"
    );
    let file = access.dir.join(format!("{sa}.identity.yaml"));
    std::fs::write(&file, manifest)?;
    apply_shared(access, &file, "the node's grants").await?;
    crate::chart::service_account_kubeconfig_with(access, ACCOUNTS, &sa, account).await?;

    let admin = tensile_common::kubeconfig::client_from_file(&access.kubeconfig, &Default::default()).await?;
    let settings = tensile_controller::plan::Settings {
        namespace: ACCOUNTS.to_owned(),
        prefix: RELEASE.to_owned(),
        shared_role: format!("{RELEASE}-tensile-virtual-node"),
        template: Default::default(),
        cluster_id: String::new(),
        disruption_budgets: false,
        node_identity: true,
    };
    let cluster = LowerCluster::new(node, LowerClusterSpec::default());
    Ok(async move {
        let api: Api<CertificateSigningRequest> = Api::all(admin);
        loop {
            if let Ok(Some(csr)) = api.get_opt(&request).await {
                let verdict = approve::decide(&settings, std::slice::from_ref(&cluster), &csr, None);
                approve::answer(&api, &csr, verdict).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
}

/// A virtual node running in process; dropping it is a crash (no clean-up runs).
pub struct VirtualNode {
    pub kubelet_port: u16,
    pub admin_addr: String,
    task: tokio::task::JoinHandle<Result<(), tensile_virtual_node::Error>>,
}

/// The options of a virtual node `name` for `upper` over `lower` in a test bed: every
/// default, plus the bed's node address ([`crate::node_ip`]), free kubelet and admin ports and the upper
/// kubelet-client CA. Tests set further fields before [`VirtualNode::run`].
/// The node acts upstream as the chart makes it act: as `system:node:<name>`, its account
/// holding what the chart's grants give ([`node_identity`]); below, as the chart's lower
/// account ([`lower_account`]).
pub fn options(upper: &TestCluster, name: &str, lower: &TestCluster) -> anyhow::Result<Args> {
    let node_ip = crate::node_ip()?;
    let account = upper.dir().join(format!("vn-{name}.account.kubeconfig"));
    let below = lower.dir().join(format!("vn-{name}.lower-account.kubeconfig"));
    let mut args = Args::new(name, node_ip, Some(&account), lower.kubeconfig())?;
    args.upper.identity = UpperIdentity::Node;
    args.lower.client_kubeconfig = below.clone();
    identities()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(account, Access::of(upper));
    lower_identities()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(below, Access::of(lower));
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

    /// Starts a virtual node with `args` (see [`options`]); one whose accounts [`options`]
    /// named gets them first, and its certificate requests are answered while it runs.
    pub fn run(args: Args) -> Self {
        let below = lower_identities()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&args.lower.client_kubeconfig)
            .cloned()
            .map(|access| (access, args.lower.client_kubeconfig.clone()));
        // Not `run`: that would take SIGTERM and SIGINT away from the test process.
        let never = tensile_common::runtime::CancellationToken::new();
        let account = args
            .upper
            .kubeconfig
            .clone()
            .filter(|_| args.upper.identity == UpperIdentity::Node)
            .and_then(|path| {
                let known = identities()
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get(&path)
                    .cloned();
                known.map(|access| (access, path))
            });
        let (kubelet_port, admin_addr) = (args.kubelet.kubelet_port, args.admin.admin_addr.to_string());
        let task = tokio::spawn(async move {
            if let Some((access, path)) = below {
                lower_account(&access, &path).await.map_err(|e| {
                    eprintln!("virtual node {}: the test's lower account: {e}", args.nodename);
                    tensile_virtual_node::Error::Flags(format!("the test's lower account: {e}"))
                })?;
            }
            let Some((access, path)) = account else {
                return tensile_virtual_node::run_until(args, never).await;
            };
            let node = args.nodename.clone();
            let approver = node_identity(&access, &node, &path).await.map_err(|e| {
                eprintln!("virtual node {node}: the test's node identity: {e}");
                tensile_virtual_node::Error::Flags(format!("the test's node identity: {e}"))
            })?;
            let ran = tokio::select! {
                ran = tensile_virtual_node::run_until(args, never) => ran,
                () = approver => Ok(()),
            };
            if let Err(e) = &ran {
                eprintln!("virtual node {node} stopped: {e}");
            }
            ran
        });
        VirtualNode {
            kubelet_port,
            admin_addr,
            task,
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
    node_ip: std::net::IpAddr,
) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", upper.kubeconfig().display()),
        format!("--client-kubeconfig={}", lower.kubeconfig().display()),
        format!("--nodename={name}"),
        format!("--node-ip={node_ip}"),
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
    /// Under a node identity: the approver of its certificate requests, ended on drop.
    approver: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for VirtualNodeProcess {
    fn drop(&mut self) {
        if let Some(approver) = self.approver.take() {
            approver.abort();
        }
    }
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
        let program = crate::bins::suite_binary("virtual-node")?;
        Self::start_binary(&program, upper, name, lower, extra, log_name)
    }

    /// [`Self::start`] with the `virtual-node` binary at `program` (another build, to
    /// compare two in one run).
    pub fn start_binary(
        program: &std::path::Path,
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
        let mut args: Vec<String> =
            argv_for(upper, name, lower, kubelet_port, &admin_addr, crate::node_ip()?)
                .into_iter()
                .filter(|f| !overridden(f))
                .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = upper.dir().join(format!("virtual-node-{log_name}.log"));
        let _ = std::fs::remove_file(&log);
        let service =
            crate::process::Service::start(&format!("virtual-node {log_name}"), program, &args, &log)?;
        Ok(Self {
            service,
            admin_addr,
            kubelet_port,
            approver: None,
        })
    }

    /// [`Self::start_binary`] acting as the chart makes a node act: upstream as
    /// `system:node:<name>` (`--upper-identity=node`, its account holding what the chart's
    /// grants give, its certificate requests approved while it runs), below as the chart's
    /// lower account.
    pub async fn start_as_node(
        program: &std::path::Path,
        upper: &TestCluster,
        name: &str,
        lower: &TestCluster,
        extra: &[&str],
        log_name: &str,
    ) -> anyhow::Result<Self> {
        let account = upper.dir().join(format!("vn-{name}.account.kubeconfig"));
        let below = lower.dir().join(format!("vn-{name}.lower-account.kubeconfig"));
        lower_account(&Access::of(lower), &below).await?;
        let approver = node_identity(&Access::of(upper), name, &account).await?;
        let identity = [
            format!("--kubeconfig={}", account.display()),
            format!("--client-kubeconfig={}", below.display()),
            "--upper-identity=node".to_owned(),
        ];
        let mut args: Vec<&str> = identity.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        let mut process = Self::start_binary(program, upper, name, lower, &args, log_name)?;
        process.approver = Some(tokio::spawn(approver));
        Ok(process)
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
