//! One real Kubernetes control plane on loopback.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};

use crate::pki::{self, Ca, CertKey};
use crate::process::Service;
use crate::{Binaries, Error, Etcd, Result, free_port, io_err};

/// Lifetime of the client certificates the controller-manager signs (a node identity's):
/// short, so that a test running one sees it renewed. The signer backdates a certificate's
/// start by 5 minutes and, for a certificate shorter than 8 hours, not its end: 3 minutes make
/// a certificate valid for 3 minutes from its issue and 8 in all, renewed at 80 % of that,
/// about 84 s after its issue.
pub const NODE_CERTIFICATE_SECONDS: u64 = 180;

/// How to start a [`TestCluster`].
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Cluster name: etcd key prefix, file and log names.
    pub name: String,
    /// Directory for the cluster's files (PKI, kubeconfigs) and process logs.
    pub dir: PathBuf,
    pub scheduler: bool,
    pub controller_manager: bool,
    /// kube-controller-manager `--node-monitor-grace-period` (a node without heartbeat for
    /// this long becomes Unknown).
    pub node_monitor_grace: Duration,
    /// kube-controller-manager `--node-monitor-period`.
    pub node_monitor_period: Duration,
    /// How long start-up may take before it fails with the failing process's log tail.
    pub ready_timeout: Duration,
    /// Record every write (create, update, patch, delete) with its user agent in
    /// `<dir>/audit.log` (see [`TestCluster::audited_writes`]).
    pub audit_writes: bool,
    /// With `audit_writes`: every call of these users (reads and watches too) is recorded,
    /// so a test can tell that an identity was never refused anything.
    pub audit_users: Vec<String>,
    /// The Kubernetes version it runs: `newest`, `oldest`, `1.MINOR` or `v1.MINOR.PATCH`
    /// (default: [`crate::bins::version_for`] its name).
    pub version: String,
    /// The kube-scheduler's and kube-controller-manager's client throttle
    /// (`--kube-api-qps`, `--kube-api-burst`); `None` keeps their defaults (50 and 100).
    /// Benchmarks raise it so a 50-qps queue in the test bed is not what they measure.
    pub kube_api_qps: Option<(u32, u32)>,
    /// kube-apiserver's `--feature-gates`, each `Name=true` or `Name=false`; empty keeps the
    /// version's defaults. An apiserver that does not know a gate refuses to start, and the
    /// start-up error carries its log.
    pub apiserver_feature_gates: Vec<String>,
}

impl ClusterOptions {
    /// Options for a cluster named `name` of test `test`, with scheduler and
    /// controller-manager; files and logs under `target/e2e-logs/<test>/<name>/`.
    pub fn new(test: &str, name: &str) -> Self {
        Self {
            name: name.to_owned(),
            dir: crate::target_dir().join("e2e-logs").join(test).join(name),
            scheduler: true,
            controller_manager: true,
            node_monitor_grace: Duration::from_secs(20),
            node_monitor_period: Duration::from_secs(2),
            ready_timeout: Duration::from_secs(90),
            audit_writes: false,
            audit_users: Vec::new(),
            kube_api_qps: None,
            version: crate::bins::version_for(name),
            apiserver_feature_gates: Vec::new(),
        }
    }

    /// Sets kube-apiserver's feature `gates` (`["ExtendWebSocketsToKubelet=false"]`).
    pub fn apiserver_feature_gates(mut self, gates: &[&str]) -> Self {
        self.apiserver_feature_gates = gates.iter().map(|&g| g.to_owned()).collect();
        self
    }

    /// Runs Kubernetes `version` instead of the default for its name.
    pub fn version(mut self, version: &str) -> Self {
        self.version = version.to_owned();
        self
    }

    /// Only etcd and the apiserver.
    pub fn apiserver_only(mut self) -> Self {
        self.scheduler = false;
        self.controller_manager = false;
        self
    }
}

/// One write an audited apiserver received (or, for [`ClusterOptions::audit_users`], any
/// call).
#[derive(Clone, Debug)]
pub struct AuditedWrite {
    pub user: String,
    pub user_agent: String,
    pub verb: String,
    pub uri: String,
    pub received: jiff::Timestamp,
    /// The HTTP status answered.
    pub code: u16,
}

/// A running cluster. Dropping it kills its processes (etcd is shared and stays).
pub struct TestCluster {
    name: String,
    dir: PathBuf,
    port: u16,
    kubeconfig: PathBuf,
    kubelet_client_ca_pem: String,
    kubelet_client_ca: PathBuf,
    apiserver: Mutex<Service>,
    /// The scheduler and controller-manager, restarted when they exit ([`supervise`]).
    others: Arc<Mutex<Vec<Service>>>,
    /// When [`TestCluster::stop_apiserver`] stopped the apiserver, until it starts again.
    stopped_at: Mutex<Option<Instant>>,
    ready_timeout: Duration,
    binaries: &'static Binaries,
    etcd: Arc<Etcd>,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("name", &self.name)
            .field("port", &self.port)
            .finish()
    }
}

impl TestCluster {
    /// Starts a cluster on the process-wide etcd.
    pub async fn start(options: ClusterOptions) -> Result<TestCluster> {
        let etcd = tokio::task::spawn_blocking(Etcd::shared)
            .await
            .map_err(|e| Error::Etcd(e.to_string()))??;
        Self::start_on(options, etcd).await
    }

    /// Starts a cluster on the given etcd.
    pub async fn start_on(options: ClusterOptions, etcd: Arc<Etcd>) -> Result<TestCluster> {
        let version = options.version.clone();
        let binaries = tokio::task::spawn_blocking(move || Binaries::of(&version))
            .await
            .map_err(|e| Error::Etcd(e.to_string()))??;
        let started = Instant::now();
        let dir = options.dir.clone();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir).map_err(io_err(&pki_dir))?;
        let files = Pki::generate(&pki_dir)?;
        let port = free_port()?;
        let kubeconfig = dir.join(format!("{}.kubeconfig", options.name));
        write(&kubeconfig, &files.kubeconfig(&options.name, port))?;
        let kubelet_client_ca = dir.join(format!("{}.kubelet-client-ca.crt", options.name));
        write(&kubelet_client_ca, &files.kubelet_client_ca)?;

        // Clusters of one process may share a name (two tests each with an "upper").
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("/{}-{seq}", options.name);
        let p = |f: &str| pki_dir.join(f).display().to_string();
        let mut apiserver_args = vec![
            format!("--etcd-servers={}", etcd.url()),
            format!("--etcd-prefix={prefix}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            "--endpoint-reconciler-type=none".into(),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            // As real clusters run: a kubelet's credential confined to its own Node, Lease
            // and what the pods bound to it use.
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-cluster-ip-range=10.0.0.0/24".into(),
            "--allow-privileged=true".into(),
            format!("--cert-dir={}", pki_dir.display()),
            "--profiling=false".into(),
            format!("--kubelet-client-certificate={}", p("kubelet-client.crt")),
            format!("--kubelet-client-key={}", p("kubelet-client.key")),
            "--kubelet-preferred-address-types=InternalIP".into(),
        ];
        if !options.apiserver_feature_gates.is_empty() {
            apiserver_args.push(format!(
                "--feature-gates={}",
                options.apiserver_feature_gates.join(",")
            ));
        }
        if options.audit_writes {
            let policy = dir.join("audit-policy.yaml");
            let users = match options.audit_users.as_slice() {
                [] => String::new(),
                users => format!("- level: Metadata\n  users: {}\n", serde_json::json!(users)),
            };
            write(
                &policy,
                &format!(
                    "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n{users}\
                     - level: Metadata\n  verbs: [create, update, patch, delete, deletecollection]\n\
                     - level: None\n"
                ),
            )?;
            apiserver_args.push(format!("--audit-policy-file={}", policy.display()));
            apiserver_args.push(format!("--audit-log-path={}", dir.join("audit.log").display()));
        }
        let apiserver = Service::start(
            "kube-apiserver",
            &binaries.apiserver,
            &apiserver_args,
            &dir.join("kube-apiserver.log"),
        )?;
        let cluster = TestCluster {
            name: options.name.clone(),
            dir: dir.clone(),
            port,
            kubeconfig: kubeconfig.clone(),
            kubelet_client_ca_pem: files.kubelet_client_ca.clone(),
            kubelet_client_ca,
            apiserver: Mutex::new(apiserver),
            others: Arc::new(Mutex::new(Vec::new())),
            stopped_at: Mutex::new(None),
            ready_timeout: options.ready_timeout,
            binaries,
            etcd,
        };
        cluster.wait_apiserver_ready().await?;
        crate::kubectl::register(&cluster.url(), &binaries.kubectl);

        let kc = kubeconfig.display().to_string();
        let throttle: Vec<String> = options
            .kube_api_qps
            .map(|(qps, burst)| {
                vec![
                    format!("--kube-api-qps={qps}"),
                    format!("--kube-api-burst={burst}"),
                ]
            })
            .unwrap_or_default();
        let mut others = Vec::new();
        if options.scheduler {
            let mut args = vec![
                format!("--kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
                "--leader-elect=false".into(),
            ];
            args.extend(throttle.iter().cloned());
            others.push(Service::start(
                "kube-scheduler",
                &binaries.scheduler,
                &args,
                &dir.join("kube-scheduler.log"),
            )?);
        }
        if options.controller_manager {
            let flex = dir.join("flexvolume");
            std::fs::create_dir_all(&flex).map_err(io_err(&flex))?;
            let mut args = vec![
                format!("--kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
                "--leader-elect=false".into(),
                format!("--service-account-private-key-file={}", p("sa.key")),
                format!("--root-ca-file={}", p("ca.crt")),
                format!("--flex-volume-plugin-dir={}", flex.display()),
                format!(
                    "--node-monitor-period={}s",
                    options.node_monitor_period.as_secs().max(1)
                ),
                format!(
                    "--node-monitor-grace-period={}s",
                    options.node_monitor_grace.as_secs().max(1)
                ),
                "--controllers=*,-bootstrapsigner,-tokencleaner".into(),
                // Certificates of approved requests, as every real cluster signs them; short
                // lived, so a node identity renews within a test.
                format!("--cluster-signing-cert-file={}", p("ca.crt")),
                format!("--cluster-signing-key-file={}", p("ca.key")),
                format!("--cluster-signing-duration={}s", NODE_CERTIFICATE_SECONDS),
            ];
            args.extend(throttle.iter().cloned());
            others.push(Service::start(
                "kube-controller-manager",
                &binaries.controller_manager,
                &args,
                &dir.join("kube-controller-manager.log"),
            )?);
        }
        *cluster.others.lock().map_err(|_| cluster.err("lock poisoned"))? = others;
        supervise(&cluster.name, &cluster.others);
        if options.controller_manager {
            cluster.wait_pods_admitted("default").await?;
        }
        tracing::info!(cluster = %cluster.name, secs = started.elapsed().as_secs_f64(), "cluster ready");
        Ok(cluster)
    }

    fn err(&self, message: impl Into<String>) -> Error {
        Error::Cluster {
            cluster: self.name.clone(),
            message: message.into(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Directory holding the cluster's files and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Admin kubeconfig (system:masters).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The apiserver's URL.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// PEM of the CA that signed the certificate the apiserver presents to kubelets.
    pub fn kubelet_client_ca_pem(&self) -> &str {
        &self.kubelet_client_ca_pem
    }

    /// File holding [`TestCluster::kubelet_client_ca_pem`].
    pub fn kubelet_client_ca_path(&self) -> &Path {
        &self.kubelet_client_ca
    }

    /// The Kubernetes version of the binaries (`v1.37.2`).
    pub fn version(&self) -> &str {
        &self.binaries.version
    }

    /// The minor of [`TestCluster::version`] (37 for `v1.37.2`).
    pub fn minor(&self) -> u32 {
        self.version()
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or_default()
    }

    /// A new admin client bound to the calling runtime.
    pub async fn client(&self) -> Result<kube::Client> {
        Ok(tensile_common::kubeconfig::client_from_file(&self.kubeconfig, &Default::default()).await?)
    }

    /// Runs real kubectl with this cluster's kubeconfig.
    pub async fn kubectl(&self, args: &[&str]) -> crate::kubectl::Output {
        crate::kubectl::run(&self.kubeconfig, args).await
    }

    /// PID of the etcd this cluster stores in (shared with the other clusters of the process).
    pub fn etcd_pid(&self) -> Option<u32> {
        self.etcd.pid()
    }

    /// PIDs of the cluster's own processes (not the shared etcd).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .apiserver
            .lock()
            .ok()
            .and_then(|s| s.pid())
            .into_iter()
            .collect();
        if let Ok(others) = self.others.lock() {
            pids.extend(others.iter().filter_map(Service::pid));
        }
        pids
    }

    /// Writes the apiserver recorded (with [`ClusterOptions::audit_writes`]): one per line
    /// of the audit log, as (user agent, verb, URI, when received).
    pub fn audited_writes(&self) -> Result<Vec<AuditedWrite>> {
        let path = self.dir.join("audit.log");
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        Ok(text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter_map(|e| {
                Some(AuditedWrite {
                    user: e["user"]["username"].as_str().unwrap_or_default().to_owned(),
                    user_agent: e["userAgent"].as_str()?.to_owned(),
                    verb: e["verb"].as_str()?.to_owned(),
                    uri: e["requestURI"].as_str()?.to_owned(),
                    received: e["requestReceivedTimestamp"].as_str()?.parse().ok()?,
                    code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
                })
            })
            .collect())
    }

    /// Sends `signal` (for example `SIGSTOP`, `SIGCONT`) to the apiserver.
    pub fn signal_apiserver(&self, signal: &str) -> Result<()> {
        let pid = self
            .apiserver
            .lock()
            .ok()
            .and_then(|s| s.pid())
            .ok_or_else(|| self.err("the apiserver is not running"))?;
        crate::process::signal(pid, signal).map_err(|e| self.err(&e))
    }

    /// Kills the apiserver; etcd keeps the data (outage tests).
    pub fn stop_apiserver(&self) {
        if let Ok(mut s) = self.apiserver.lock() {
            s.stop();
        }
        if let Ok(mut at) = self.stopped_at.lock() {
            at.get_or_insert_with(Instant::now);
        }
    }

    /// Starts the apiserver again on the same port and waits until it is ready. After an
    /// outage longer than a leader election's renew deadline, the scheduler and
    /// controller-manager start again too, as they do in a real control plane: there they
    /// elect a leader, cannot renew its lease while the apiserver is away, and exit, and the
    /// kubelet starts them afresh. (Kept running instead, with election off, their informers
    /// can stay behind the restarted apiserver: a 1.37 controller-manager was seen reading a
    /// lease version older than one it had written for minutes, keeping every node NotReady
    /// and tainted, and new pods unscheduled.)
    pub async fn start_apiserver(&self) -> Result<()> {
        self.apiserver
            .lock()
            .map_err(|_| self.err("lock poisoned"))?
            .restart()?;
        self.wait_apiserver_ready().await?;
        let stopped = self.stopped_at.lock().ok().and_then(|mut at| at.take());
        if stopped.is_some_and(|at| at.elapsed() >= LEADER_RENEW_DEADLINE) {
            let mut others = self.others.lock().map_err(|_| self.err("lock poisoned"))?;
            for service in others.iter_mut() {
                tracing::info!(cluster = %self.name, component = service.name(), "restarted after the apiserver outage");
                service.restart().map_err(|e| self.err(e.to_string()))?;
            }
        }
        Ok(())
    }

    fn apiserver_failure(&self) -> Option<String> {
        let mut s = self.apiserver.lock().ok()?;
        s.exited().map(|status| {
            format!(
                "kube-apiserver exited ({status}); log tail:\n{}",
                s.log_tail(4000)
            )
        })
    }

    fn log_tails(&self) -> String {
        let mut out = String::new();
        if let Ok(s) = self.apiserver.lock() {
            out.push_str(&format!("--- kube-apiserver ---\n{}\n", s.log_tail(3000)));
        }
        if let Ok(others) = self.others.lock() {
            for s in others.iter() {
                out.push_str(&format!("--- {} ---\n{}\n", s.name(), s.log_tail(2000)));
            }
        }
        out
    }

    async fn wait_apiserver_ready(&self) -> Result<()> {
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if let Some(failure) = self.apiserver_failure() {
                return Err(self.err(failure));
            }
            let last = match self.readyz().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if Instant::now() > deadline {
                return Err(self.err(format!(
                    "apiserver not ready after {} s (last: {last}); log tails:\n{}",
                    self.ready_timeout.as_secs(),
                    self.log_tails()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn readyz(&self) -> Result<(), String> {
        let client = self.client().await.map_err(|e| e.to_string())?;
        let req = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        let body = client.request_text(req).await.map_err(|e| e.to_string())?;
        if body.trim() == "ok" { Ok(()) } else { Err(body) }
    }

    /// Waits until a pod in `namespace` would be admitted (the namespace and its default
    /// ServiceAccount, with its token on older releases, exist): a server-side dry run.
    pub async fn wait_pods_admitted(&self, namespace: &str) -> Result<()> {
        let client = self.client().await?;
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        let probe: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "tensile-admission-probe"},
            "spec": {"containers": [{"name": "c", "image": "probe"}]}
        }))
        .map_err(|e| self.err(e.to_string()))?;
        let params = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            match pods.create(&params, &probe).await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(self.err(format!(
                        "pods in {namespace} not admitted after {} s: {e}; log tails:\n{}",
                        self.ready_timeout.as_secs(),
                        self.log_tails()
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Starts another kube-scheduler with `--config=<config>` (a KubeSchedulerConfiguration
    /// that names its own kubeconfig), logging to `<dir>/<log_name>.log`. Dropping the
    /// returned service stops it.
    pub fn start_scheduler(&self, config: &Path, log_name: &str) -> Result<Service> {
        let args = vec![
            format!("--config={}", config.display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
        ];
        Ok(Service::start(
            log_name,
            &self.binaries.scheduler,
            &args,
            &self.dir.join(format!("{log_name}.log")),
        )?)
    }

    /// Creates namespace `name` and waits until pods in it are admitted.
    pub async fn create_namespace(&self, name: &str) -> Result<()> {
        let client = self.client().await?;
        let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client);
        let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
            .map_err(|e| self.err(e.to_string()))?;
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        self.wait_pods_admitted(name).await
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        if let Ok(mut others) = self.others.lock() {
            others.clear();
        }
        self.stop_apiserver();
    }
}

/// How long a leader may fail to renew its lease before it gives up: kube-scheduler's and
/// kube-controller-manager's `--leader-elect-renew-deadline` default.
const LEADER_RENEW_DEADLINE: Duration = Duration::from_secs(10);

/// Restarts a scheduler or controller-manager of `cluster` that exits, once a second at most,
/// as the kubelet of a real control plane restarts its static pods: kube-scheduler exits on
/// purpose when its cache sees a pod move between nodes, which an apiserver killed mid-bind
/// can cause. Each restart is logged, and the component's log goes on in the same file. Ends
/// with the cluster.
fn supervise(cluster: &str, others: &Arc<Mutex<Vec<Service>>>) {
    let (cluster, others) = (cluster.to_owned(), Arc::downgrade(others));
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let Some(others) = others.upgrade() else { return };
            let Ok(mut others) = others.lock() else { return };
            for service in others.iter_mut() {
                if let Some(status) = service.exited() {
                    tracing::warn!(%cluster, component = service.name(), %status, "exited; restarting it");
                    if let Err(e) = service.restart() {
                        tracing::warn!(%cluster, component = service.name(), "restarting: {e}");
                    }
                }
            }
        }
    });
}

struct Pki {
    ca: String,
    admin: CertKey,
    kubelet_client_ca: String,
}

impl Pki {
    fn generate(dir: &Path) -> Result<Pki> {
        let ca = Ca::new("tensile-test-ca")?;
        let serving = ca.server(
            "kube-apiserver",
            &[
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
        )?;
        let admin = ca.client("tensile-admin", Some("system:masters"))?;
        let kubelet_ca = Ca::new("tensile-kubelet-client-ca")?;
        let kubelet_client = kubelet_ca.client("kube-apiserver-kubelet-client", Some("system:masters"))?;
        // What every kubelet of a kubeadm cluster holds: a certificate from the same CA for
        // its own node. It authenticates, and must not be enough to read another node's logs.
        let other_kubelet = kubelet_ca.client("system:node:some-other-node", Some("system:nodes"))?;
        // Two common names: the apiserver reads the last as the user; a kubelet must not
        // read another.
        let two_names = kubelet_ca.client_with_two_names("tensile-log-reader", "tensile-tenant")?;
        // Callers of a kubelet's API by certificate, whose rights tests grant: only
        // `nodes/pods`, and only `nodes/proxy`.
        let pod_lister = kubelet_ca.client("tensile-pod-lister", None)?;
        let proxy_only = kubelet_ca.client("tensile-proxy-only", None)?;
        let (sa_key, sa_pub) = pki::service_account_keys()?;
        for (file, content) in [
            ("ca.crt", ca.cert_pem()),
            // The controller-manager signs approved kubelet client certificates with it.
            ("ca.key", ca.key_pem()),
            ("apiserver.crt", serving.cert_pem.clone()),
            ("apiserver.key", serving.key_pem.clone()),
            ("kubelet-client.crt", kubelet_client.cert_pem.clone()),
            ("kubelet-client.key", kubelet_client.key_pem.clone()),
            ("other-kubelet.crt", other_kubelet.cert_pem.clone()),
            ("other-kubelet.key", other_kubelet.key_pem.clone()),
            ("two-names.crt", two_names.cert_pem.clone()),
            ("two-names.key", two_names.key_pem.clone()),
            ("pod-lister.crt", pod_lister.cert_pem.clone()),
            ("pod-lister.key", pod_lister.key_pem.clone()),
            ("proxy-only.crt", proxy_only.cert_pem.clone()),
            ("proxy-only.key", proxy_only.key_pem.clone()),
            ("sa.key", sa_key),
            ("sa.pub", sa_pub),
        ] {
            write(&dir.join(file), &content)?;
        }
        Ok(Pki {
            ca: ca.cert_pem(),
            admin,
            kubelet_client_ca: kubelet_ca.cert_pem(),
        })
    }

    fn kubeconfig(&self, name: &str, port: u16) -> String {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: {name}
  cluster:
    server: https://127.0.0.1:{port}
    certificate-authority-data: {ca}
users:
- name: {name}-admin
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: {name}
  context:
    cluster: {name}
    user: {name}-admin
current-context: {name}
",
            ca = b64(&self.ca),
            cert = b64(&self.admin.cert_pem),
            key = b64(&self.admin.key_pem),
        )
    }
}

fn write(path: &Path, content: &str) -> Result<()> {
    std::fs::write(path, content).map_err(io_err(path))
}
