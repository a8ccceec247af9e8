//! A kwok-style kubelet simulator: fake Nodes in a real cluster, and believable lifecycles
//! for the pods the real scheduler binds to them.
//!
//! * Nodes are created with the given capacity, allocatable, labels and taints, an
//!   `InternalIP` of the bed's node address ([`crate::node_ip`]) and the simulator's kubelet port in `daemonEndpoints`.
//! * Each node renews its Lease in `kube-node-lease` every 10 s and patches its status at
//!   least every minute; [`NodeSimulator::stop_heartbeat`] silences one node for failure tests.
//! * Pods bound to a simulated node go Pending → Running with a pod IP from the node's range;
//!   `restartPolicy: Never`/`OnFailure` pods complete, containers restart by their own
//!   restart policy and rules; the `tensile.io/sim` annotation ([`Behavior`]) chooses
//!   timings, failures and restarts. In-place resizes are allocated, deferred or refused as the
//!   cluster's kubelet decides them. Graceful deletion ends with a delete of grace 0 and a UID
//!   precondition, as a kubelet does.
//! * Each node has its own TLS kubelet endpoint serving `containerLogs`, `exec`, `attach`,
//!   `portForward`, and the node's `/stats/summary` and `/metrics/resource` (every running
//!   container uses exactly 10m of CPU and 16 MiB, the node 50m and 256 MiB more; see
//!   [`stats`]); [`NodeSimulator::kubelet_port`] serves every node's pods (over WebSocket and SPDY, as kubectl speaks them; see
//!   [`exec`] for what a simulated container can run).

mod behavior;
mod containers;
pub mod exec;
mod kubelet;
mod logs;
mod pods;
mod resize;
pub mod spdy;
pub mod stats;
mod streams;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_common::api::{now, now_micro};
use tensile_common::quantity::ResourceMap;
use tokio::task::JoinHandle;

pub use behavior::{AfterExit, Behavior, Restart, RestartPolicy, restart_on_exit};
pub use logs::{LogOptions, LogSource};

use crate::{Error, Result};

/// What a simulated node declares in `status.declaredFeatures` (NodeDeclaredFeatures: alpha
/// in 1.35, beta in 1.36, GA in 1.37): as a 1.37 kubelet with its default feature gates, the
/// features of the registry whose gates are on, sorted by name. Its API takes WebSocket
/// streams (the apiserver proxies them rather than translating them to SPDY), it resizes
/// pod-level resources and init containers in place, and it runs `RestartAllContainers`
/// rules. The registry's others (DRA node-allocatable resources and optional node operations,
/// memory-backed volume resize, user namespaces with the host network, bind mount options)
/// sit behind gates off by default. An apiserver older than 1.35 drops the field.
pub const DECLARED_FEATURES: &[&str] = &[
    "ExtendWebSocketsToKubelet",
    "InPlacePodLevelResourcesVerticalScaling",
    "InPlacePodVerticalScalingInitContainers",
    "RestartAllContainersOnContainerExits",
];

/// A simulated node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub name: String,
    pub capacity: BTreeMap<String, String>,
    /// Defaults to `capacity`.
    pub allocatable: Option<BTreeMap<String, String>>,
    pub labels: BTreeMap<String, String>,
    /// Taints as Kubernetes JSON (`{"key":…,"value":…,"effect":…}`).
    pub taints: Vec<serde_json::Value>,
    /// The kubelet runs the static CPU manager policy (`--cpu-manager-policy=static`).
    pub static_cpu_manager: bool,
}

impl NodeConfig {
    /// A node with 4 CPUs, 8 GiB of memory, 100 GiB of ephemeral storage and 110 pods.
    pub fn new(name: &str) -> Self {
        let capacity = [
            ("cpu", "4"),
            ("memory", "8Gi"),
            ("pods", "110"),
            ("ephemeral-storage", "100Gi"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        Self {
            name: name.to_owned(),
            capacity,
            allocatable: None,
            labels: BTreeMap::new(),
            taints: Vec::new(),
            static_cpu_manager: false,
        }
    }

    /// Sets one capacity entry (`cpu`, `memory`, `pods`, an extended resource…).
    pub fn resource(mut self, name: &str, quantity: &str) -> Self {
        self.capacity.insert(name.to_owned(), quantity.to_owned());
        self
    }

    pub fn allocatable(mut self, name: &str, quantity: &str) -> Self {
        self.allocatable
            .get_or_insert_with(|| self.capacity.clone())
            .insert(name.to_owned(), quantity.to_owned());
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        self.taints
            .push(json!({"key": key, "value": value, "effect": effect}));
        self
    }

    /// The node's kubelet runs the static CPU manager policy, under which it refuses to
    /// resize the CPU of a Guaranteed pod in place.
    pub fn static_cpu_manager(mut self) -> Self {
        self.static_cpu_manager = true;
        self
    }
}

/// Simulator settings.
#[derive(Clone, Debug)]
pub struct SimulatorOptions {
    /// Value of the `tensile.io/simulated-by` label on the simulator's nodes.
    pub name: String,
    /// CA whose client certificates the kubelet endpoint accepts (the apiserver's
    /// kubelet-client CA). `None` accepts any client: only for tests of the endpoint itself.
    pub kubelet_client_ca_pem: Option<String>,
    /// Lease renewal period (a kubelet's is 10 s).
    pub lease_renew: Duration,
    /// Status patch period without changes (a kubelet's is at most a minute).
    pub status_period: Duration,
    /// Writes to the apiserver in flight at once.
    pub write_concurrency: usize,
}

impl SimulatorOptions {
    pub fn new(name: &str, kubelet_client_ca_pem: Option<&str>) -> Self {
        Self {
            name: name.to_owned(),
            kubelet_client_ca_pem: kubelet_client_ca_pem.map(str::to_owned),
            lease_renew: Duration::from_secs(10),
            status_period: Duration::from_secs(60),
            write_concurrency: 64,
        }
    }
}

struct NodeState {
    index: u32,
    /// The node's own kubelet endpoint (its `/stats` and `/metrics` are the node's).
    kubelet_port: u16,
    config: NodeConfig,
    heartbeat: Arc<AtomicBool>,
    wake: Arc<tokio::sync::Notify>,
}

pub(crate) struct Inner {
    client: kube::Client,
    options: SimulatorOptions,
    kubelet_port: u16,
    /// Every node's `InternalIP`, where its kubelet endpoint listens.
    node_ip: std::net::IpAddr,
    server_config: Arc<rustls::ServerConfig>,
    kubelet_version: String,
    nodes: RwLock<HashMap<String, NodeState>>,
    /// Latest pod objects on simulated nodes, by (namespace, name), for the kubelet API.
    pods: RwLock<HashMap<(String, String), Pod>>,
    /// Pod IPs in use, per node: the last octet.
    ips: Mutex<HashMap<String, std::collections::BTreeSet<u8>>>,
    /// What the kubelet admitted of each running pod (by UID): its node and its requests.
    allocations: RwLock<HashMap<String, (String, ResourceMap)>>,
    /// Changed whenever an admitted pod leaves its node, so deferred resizes are tried again.
    freed: tokio::sync::watch::Sender<()>,
    /// Where the readiness probe of a pod is sent, by (namespace, name): the process a test
    /// runs for it ([`NodeSimulator::probe_at`]).
    pub(crate) probes: RwLock<HashMap<(String, String), String>>,
    writes: tokio::sync::Semaphore,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// `/stats/summary` requests answered, every node's together.
    pub(crate) summaries_served: std::sync::atomic::AtomicU64,
}

/// A running simulator. Dropping it stops every task (nodes and pods stay in the cluster).
pub struct NodeSimulator {
    inner: Arc<Inner>,
}

impl NodeSimulator {
    /// How many `/stats/summary` requests the simulated kubelets answered so far.
    pub fn summaries_served(&self) -> u64 {
        self.inner
            .summaries_served
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts the kubelet endpoint and the pod watch, then registers `nodes`.
    pub async fn start(
        client: kube::Client,
        options: SimulatorOptions,
        nodes: Vec<NodeConfig>,
    ) -> Result<Self> {
        let (listener, server_config) = kubelet::bind(options.kubelet_client_ca_pem.as_deref()).await?;
        let kubelet_port = listener
            .local_addr()
            .map_err(crate::io_err("kubelet listener"))?
            .port();
        let kubelet_version = client
            .apiserver_version()
            .await
            .map(|v| v.git_version)
            .unwrap_or_else(|_| "unknown".into());
        let inner = Arc::new(Inner {
            client,
            kubelet_port,
            node_ip: crate::node_ip()?,
            server_config: server_config.clone(),
            kubelet_version,
            writes: tokio::sync::Semaphore::new(options.write_concurrency.max(1)),
            options,
            nodes: RwLock::new(HashMap::new()),
            pods: RwLock::new(HashMap::new()),
            ips: Mutex::new(HashMap::new()),
            allocations: RwLock::new(HashMap::new()),
            freed: tokio::sync::watch::Sender::new(()),
            probes: RwLock::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
            summaries_served: Default::default(),
        });
        inner.track(tokio::spawn(kubelet::serve(
            listener,
            server_config,
            inner.clone(),
            None,
        )));
        let watch = pods::watch(inner.clone());
        inner.track(tokio::spawn(watch));
        let sim = NodeSimulator { inner };
        for node in nodes {
            sim.add_node(node).await?;
        }
        Ok(sim)
    }

    /// Port of the kubelet endpoint every simulated node advertises.
    pub fn kubelet_port(&self) -> u16 {
        self.inner.kubelet_port
    }

    /// Names of the simulated nodes.
    pub fn node_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .nodes
            .read()
            .map(|n| n.keys().cloned().collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Registers a node (creating it when absent) and starts its heartbeat.
    pub async fn add_node(&self, config: NodeConfig) -> Result<()> {
        let addr = std::net::SocketAddr::new(crate::node_ip()?, 0);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(crate::io_err(&addr.to_string()))?;
        let kubelet_port = listener
            .local_addr()
            .map_err(crate::io_err("kubelet listener"))?
            .port();
        let heartbeat = Arc::new(AtomicBool::new(true));
        let wake = Arc::new(tokio::sync::Notify::new());
        let index = {
            let mut nodes = self.inner.nodes.write().map_err(|_| poisoned())?;
            if nodes.contains_key(&config.name) {
                return Err(Error::Cluster {
                    cluster: self.inner.options.name.clone(),
                    message: format!("node {} is already simulated", config.name),
                });
            }
            let index = nodes.values().map(|n| n.index + 1).max().unwrap_or(0);
            nodes.insert(
                config.name.clone(),
                NodeState {
                    index,
                    kubelet_port,
                    config: config.clone(),
                    heartbeat: heartbeat.clone(),
                    wake: wake.clone(),
                },
            );
            index
        };
        self.inner.track(tokio::spawn(kubelet::serve(
            listener,
            self.inner.server_config.clone(),
            self.inner.clone(),
            Some(config.name.clone()),
        )));
        self.inner.register(&config, index).await?;
        let inner = self.inner.clone();
        let task = tokio::spawn(async move { inner.heartbeat(config.name.clone(), heartbeat, wake).await });
        self.inner.track(task);
        Ok(())
    }

    /// Sends the readiness probe of pod `namespace/name` to `addr` (`host:port`), where a
    /// process the test runs for the pod answers. A container with an HTTP readiness probe is
    /// Ready only while its probe succeeds there (kubelet's rules: one success, or
    /// `failureThreshold` failures in a row, every `periodSeconds`); without an address its
    /// probe fails, as a container that does not listen yet.
    pub fn probe_at(&self, namespace: &str, name: &str, addr: &str) -> Result<()> {
        self.inner
            .probes
            .write()
            .map_err(|_| poisoned())?
            .insert((namespace.to_owned(), name.to_owned()), addr.to_owned());
        Ok(())
    }

    /// Stops renewing the node's Lease and patching its status, as a dead kubelet would.
    pub fn stop_heartbeat(&self, node: &str) -> Result<()> {
        self.with_node(node, |n| n.heartbeat.store(false, Ordering::SeqCst))
    }

    /// Resumes the heartbeat and posts `Ready=True` at once (a Lease alone does not bring a
    /// node back).
    pub fn resume_heartbeat(&self, node: &str) -> Result<()> {
        self.with_node(node, |n| {
            n.heartbeat.store(true, Ordering::SeqCst);
            n.wake.notify_one();
        })
    }

    fn with_node(&self, node: &str, f: impl FnOnce(&NodeState)) -> Result<()> {
        let nodes = self.inner.nodes.read().map_err(|_| poisoned())?;
        let state = nodes.get(node).ok_or_else(|| Error::Cluster {
            cluster: self.inner.options.name.clone(),
            message: format!("node {node} is not simulated here"),
        })?;
        f(state);
        Ok(())
    }
}

impl Drop for NodeSimulator {
    fn drop(&mut self) {
        if let Ok(mut tasks) = self.inner.tasks.lock() {
            for t in tasks.drain(..) {
                t.abort();
            }
        }
    }
}

fn poisoned() -> Error {
    Error::Cluster {
        cluster: "simulator".into(),
        message: "state lock poisoned".into(),
    }
}

impl Inner {
    fn track(&self, task: JoinHandle<()>) {
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
    }

    pub(crate) fn is_simulated(&self, node: &str) -> bool {
        self.nodes.read().map(|n| n.contains_key(node)).unwrap_or(false)
    }

    fn node_kubelet_port(&self, node: &str) -> u16 {
        self.nodes
            .read()
            .ok()
            .and_then(|n| n.get(node).map(|n| n.kubelet_port))
            .unwrap_or(self.kubelet_port)
    }

    fn node_index(&self, node: &str) -> Option<u32> {
        self.nodes.read().ok()?.get(node).map(|n| n.index)
    }

    /// The simulated kubelets' minor version: the cluster's (1.`minor`).
    fn kubelet_minor(&self) -> u32 {
        self.kubelet_version
            .trim_start_matches('v')
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or(tensile_common::versions::NEWEST_MINOR)
    }

    /// The node's allocatable and whether its kubelet runs the static CPU manager policy.
    fn node_allocatable(&self, node: &str) -> Option<(ResourceMap, bool)> {
        let nodes = self.nodes.read().ok()?;
        let config = &nodes.get(node)?.config;
        let list = config.allocatable.as_ref().unwrap_or(&config.capacity);
        Some((ResourceMap::parse(list.iter()).0, config.static_cpu_manager))
    }

    /// The pod CIDR base of node `index`: 10.244.0.0/16 holds 256 nodes, then 10.245…
    fn pod_net(index: u32) -> (u8, u8) {
        let second = 244u32.saturating_add(index / 256).min(255) as u8;
        (second, (index % 256) as u8)
    }

    async fn register(&self, config: &NodeConfig, index: u32) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut labels = config.labels.clone();
        for (k, v) in [
            ("kubernetes.io/hostname", config.name.as_str()),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
            ("beta.kubernetes.io/os", "linux"),
            ("beta.kubernetes.io/arch", "amd64"),
            (tensile_common::names::SIM_MANAGED_BY, self.options.name.as_str()),
        ] {
            labels.entry(k.to_owned()).or_insert_with(|| v.to_owned());
        }
        let (b, c) = Self::pod_net(index);
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": config.name, "labels": labels},
            "spec": {"taints": config.taints, "podCIDR": format!("10.{b}.{c}.0/24")},
        }))
        .map_err(|e| Error::Cluster {
            cluster: self.options.name.clone(),
            message: format!("node {}: {e}", config.name),
        })?;
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        self.patch_node_status(config, true).await?;
        self.renew_lease(&config.name).await?;
        Ok(())
    }

    async fn patch_node_status(&self, config: &NodeConfig, transition: bool) -> Result<()> {
        let now = now();
        let cond = |kind: &str, status: &str, reason: &str, message: &str| {
            let mut c = json!({
                "type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": now,
            });
            if transition {
                c["lastTransitionTime"] = json!(now);
            }
            c
        };
        let allocatable = config
            .allocatable
            .clone()
            .unwrap_or_else(|| config.capacity.clone());
        let status = json!({"status": {
            "capacity": config.capacity,
            "allocatable": allocatable,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                cond("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.node_ip.to_string()}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.node_kubelet_port(&config.name)}},
            "declaredFeatures": DECLARED_FEATURES,
            "nodeInfo": {
                "machineID": config.name, "systemUUID": config.name, "bootID": self.options.name,
                "kernelVersion": "simulated", "osImage": "tensile node simulator",
                "containerRuntimeVersion": "simulated://1", "kubeletVersion": self.kubelet_version,
                "operatingSystem": "linux", "architecture": "amd64",
            },
        }});
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .patch_status(&config.name, &PatchParams::default(), &Patch::Strategic(status))
            .await?;
        Ok(())
    }

    async fn renew_lease(&self, node: &str) -> Result<()> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let renew = json!({"spec": {"renewTime": now_micro(), "holderIdentity": node}});
        match leases
            .patch(node, &PatchParams::default(), &Patch::Merge(&renew))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        let owner = Api::<Node>::all(self.client.clone()).get(node).await?;
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {
                "name": node, "namespace": "kube-node-lease",
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node,
                                     "uid": owner.metadata.uid.unwrap_or_default()}],
            },
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now_micro()},
        }))
        .map_err(|e| Error::Cluster {
            cluster: self.options.name.clone(),
            message: format!("lease {node}: {e}"),
        })?;
        match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Renews the node's lease and refreshes its status while its heartbeat is on.
    async fn heartbeat(self: Arc<Self>, node: String, on: Arc<AtomicBool>, wake: Arc<tokio::sync::Notify>) {
        let mut last_status = tokio::time::Instant::now();
        let mut was_on = true;
        // A lost apiserver is reported once, not at every beat of every node.
        let mut failing = false;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.options.lease_renew) => {}
                _ = wake.notified() => {}
            }
            let Some(config) = self
                .nodes
                .read()
                .ok()
                .and_then(|n| n.get(&node).map(|s| s.config.clone()))
            else {
                return;
            };
            if !on.load(Ordering::SeqCst) {
                was_on = false;
                continue;
            }
            let resumed = !was_on;
            was_on = true;
            let lease = self
                .renew_lease(&node)
                .await
                .err()
                .map(|e| format!("lease renewal failed: {e}"));
            let mut status = None;
            // After a beat that failed (the apiserver was away), the status goes at once, as a
            // kubelet's next sync finds its conditions overwritten by the node controller
            // (Ready Unknown) and writes them back, instead of waiting for the status period.
            if resumed || failing || last_status.elapsed() >= self.options.status_period {
                match self.patch_node_status(&config, resumed || failing).await {
                    Ok(()) => last_status = tokio::time::Instant::now(),
                    Err(e) => status = Some(format!("status patch failed: {e}")),
                }
            }
            match lease.or(status) {
                Some(problem) if !failing => {
                    tracing::warn!(%node, "{problem} (not repeated until the heartbeat works again)");
                    failing = true;
                }
                None if failing => {
                    tracing::info!(%node, "heartbeat works again");
                    failing = false;
                }
                _ => {}
            }
        }
    }
}
