//! The node loop: registration, the Lease, and a status that tells the truth about the
//! lower cluster (capacity from watched state, Ready from a real probe). Each round performs
//! what [`crate::decide::node::Heartbeat::round`] decided and reports the outcome back; the
//! lower apiserver's health is shared with the pod controller ([`LowerHealth`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tensile_common::{kubeconfig, node_identity};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_common::cache::Cache;
use tensile_common::names;
use tensile_common::shape::{self, Shape};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::decide::capacity::{self, Capacity, NodeLoads, ShapePublisher};
use crate::decide::node::Health;
use crate::decide::node::Heartbeat;
use crate::decide::node::Observed;
use crate::decide::node::Periods;
use crate::decide::node::declared_features;
use crate::decide::node::metadata_patch;
use crate::decide::node::resources_patch;
use crate::decide::node::room_condition;
use crate::metrics::Metrics;
use crate::model::trim::PodLoad;
use tensile_common::lower::identity::Identity;

/// Whether the lower cluster answers, as the node loop last judged it (Ready), shared with
/// the pod controller and orphan collection: while it does not, no status comes up from the
/// stale cache and no deletion is sent below. When it answers again ([`Self::recoveries`]),
/// what waited is done at once instead of at each pod's next retry.
#[derive(Debug)]
pub struct LowerHealth(tokio::sync::watch::Sender<bool>);

impl Default for LowerHealth {
    /// Reachable until a probe says otherwise: the caches synced from it at start.
    fn default() -> Self {
        LowerHealth(tokio::sync::watch::Sender::new(true))
    }
}

impl LowerHealth {
    pub fn reachable(&self) -> bool {
        *self.0.borrow()
    }

    /// Records the node loop's latest verdict; only a change wakes [`Self::recoveries`].
    pub fn set(&self, reachable: bool) {
        self.0
            .send_if_modified(|now| std::mem::replace(now, reachable) != reachable);
    }

    /// Yields each time the lower cluster turns reachable again after it was not (never for
    /// the reachable start).
    pub fn recoveries(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.0.subscribe(), |mut rx| async move {
            loop {
                rx.changed().await.ok()?;
                if *rx.borrow_and_update() {
                    return Some(((), rx));
                }
            }
        })
    }
}

/// How long a round woken by a lower change waits for more changes to come with it.
const CHANGED_DEBOUNCE: Duration = Duration::from_millis(300);
/// Least time from one round's start to the start of a round woken by a lower change.
const CHANGED_ROUND_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Settings of the node loop.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub identity: Identity,
    pub node_ip: String,
    pub kubelet_port: u16,
    pub taint: bool,
    /// Label the node `kubernetes.io/role=agent`: not under a node identity, whose
    /// NodeRestriction refuses labels of `kubernetes.io/` a kubelet may not set.
    pub role_label: bool,
    /// The node may change its taints once registered: not under a node identity, whose
    /// NodeRestriction lets a node set them only when it registers.
    pub retaint: bool,
    pub extra_labels: BTreeMap<String, String>,
    /// How often the lower cluster is probed (and the loop runs without changes).
    pub probe_period: Duration,
    /// How often a lower cluster that does not answer is probed: its return is what the
    /// pods waiting on it (deletions, orphans) are released by.
    pub recovery_probe_period: Duration,
    /// A probe that takes longer failed.
    pub probe_timeout: Duration,
    /// Status is patched at least this often.
    pub status_period: Duration,
    pub lease_period: Duration,
    /// Lower node label keys the capacity shape groups nodes by.
    pub shape_label_keys: Vec<String>,
}

impl NodeSettings {
    pub fn new(identity: Identity, node_ip: String, kubelet_port: u16) -> Self {
        Self {
            identity,
            node_ip,
            kubelet_port,
            taint: true,
            role_label: true,
            retaint: true,
            extra_labels: BTreeMap::new(),
            probe_period: Duration::from_secs(5),
            recovery_probe_period: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(4),
            status_period: Duration::from_secs(60),
            lease_period: Duration::from_secs(10),
            shape_label_keys: shape::DEFAULT_LABEL_KEYS.map(String::from).to_vec(),
        }
    }
}

pub struct NodeLoop {
    /// The heartbeat's own client, built anew from `upper_source` after a failed heartbeat.
    pub upper: std::sync::Mutex<kube::Client>,
    pub upper_source: tensile_common::kubeconfig::ClientSource,
    pub lower: kube::Client,
    pub settings: NodeSettings,
    pub lower_nodes: Cache<Node>,
    /// The served namespaces' quotas, under a namespace scope (`served`).
    pub lower_quotas: Cache<k8s_openapi::api::core::v1::ResourceQuota>,
    pub served: tensile_common::cache::Namespaces,
    /// Every unfinished lower pod's load.
    pub lower_pods: Cache<PodLoad>,
    /// Woken when lower nodes or pods change.
    pub changed: Arc<Notify>,
    pub metrics: Arc<Metrics>,
    /// Watch of our own upper Node: when it vanishes, the node is registered again at once.
    pub upper_node: Cache<Node>,
    /// Set from each round's Ready verdict, for the pod controller.
    pub lower_health: Arc<LowerHealth>,
    /// The taint's difference from the settings was told (under a node identity).
    pub taint_told: std::sync::atomic::AtomicBool,
    /// The override rules in force: their placement part is published on the Node.
    pub overrides: crate::world::overrides::Current,
    /// The capacity and shape last worked out, and from what.
    pub worked_out: WorkedOut,
}

/// What the node loop works out from every lower node and pod, kept until one changes.
#[derive(Default)]
pub struct WorkedOut {
    loads: tensile_common::cache::Memo<Arc<NodeLoads>>,
    capacity: tensile_common::cache::Memo<Capacity>,
    shape: tensile_common::cache::Memo<Shape>,
}

/// When each condition of the node last changed (RFC 3339).
struct Since {
    ready: String,
    nodes_usable: String,
}

use tensile_common::api::now;

impl NodeLoop {
    fn name(&self) -> &str {
        &self.settings.identity.node
    }

    fn upper(&self) -> kube::Client {
        match self.upper.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After a heartbeat failed without an answer from the apiserver: a fresh client, so the
    /// next heartbeat does not wait on another dead pooled connection. True when it was
    /// unanswered.
    fn reconnect_after(&self, e: &kube::Error) -> bool {
        if matches!(e, kube::Error::Api(_)) {
            return false;
        }
        match self.upper_source.client() {
            Ok(fresh) => {
                if let Ok(mut c) = self.upper.lock() {
                    *c = fresh;
                }
            }
            Err(e) => tracing::warn!(node = self.name(), "a fresh upper client: {e}"),
        }
        true
    }

    async fn probe(&self) -> Result<String, String> {
        let req = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(self.settings.probe_timeout, self.lower.request_text(req)).await {
            Err(_) => Err(format!(
                "no answer within {} s",
                self.settings.probe_timeout.as_secs()
            )),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(body)) if body.trim() == "ok" => {
                let version =
                    tokio::time::timeout(self.settings.probe_timeout, self.lower.apiserver_version())
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .map(|v| v.git_version)
                        .unwrap_or_default();
                Ok(version)
            }
            Ok(Ok(body)) => Err(format!("readyz says {}", body.trim())),
        }
    }

    /// Whether the upper Node's Ready condition says True, as the watch last saw it.
    fn upstream_ready(&self) -> Option<bool> {
        let node = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()))?;
        let ready = node
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .find(|c| c.type_ == "Ready")?;
        Some(ready.status == "True")
    }

    /// The lower cluster's capacity, worked out again only after a lower node, pod or quota
    /// changed.
    fn capacity(&self) -> Capacity {
        let inputs = vec![
            self.lower_nodes.changes(),
            self.lower_pods.changes(),
            self.lower_quotas.changes(),
        ];
        self.worked_out.capacity.get(inputs, || self.work_out_capacity())
    }

    fn work_out_capacity(&self) -> Capacity {
        if let tensile_common::cache::Namespaces::Only(served) = &self.served {
            let pods = self.lower_pods.state();
            let quotas = self.lower_quotas.state();
            return capacity::compute_from_quotas(
                served,
                quotas.iter().map(|q| q.as_ref()),
                pods.iter().map(|p| p.as_ref()),
                &self.settings.identity,
            );
        }
        let nodes = self.lower_nodes.state();
        capacity::compute(nodes.iter().map(|n| n.as_ref()), &self.loads())
    }

    /// What the lower pods request on each lower node, summed again only after a lower pod
    /// changed (one walk over the pods for both the capacity and the shape).
    fn loads(&self) -> Arc<NodeLoads> {
        self.worked_out.loads.get(vec![self.lower_pods.changes()], || {
            let pods = self.lower_pods.state();
            Arc::new(NodeLoads::of(
                pods.iter().map(|p| p.as_ref()),
                &self.settings.identity,
            ))
        })
    }

    fn labels(&self, cap: &Capacity) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (
                names::VIRTUAL_NODE_TYPE_LABEL.to_owned(),
                names::VIRTUAL_NODE_TYPE_VALUE.to_owned(),
            ),
            ("kubernetes.io/hostname".to_owned(), self.name().to_owned()),
            (
                "kubernetes.io/os".to_owned(),
                cap.os.clone().unwrap_or_else(|| "linux".into()),
            ),
            (
                "kubernetes.io/arch".to_owned(),
                cap.arch.clone().unwrap_or_else(|| "amd64".into()),
            ),
        ]);
        if self.settings.role_label {
            labels.insert(
                "kubernetes.io/role".to_owned(),
                names::VIRTUAL_NODE_ROLE.to_owned(),
            );
        }
        labels.extend(self.settings.extra_labels.clone());
        labels
    }

    /// Under a namespace scope no lower node is seen, so no shape is published (the
    /// multi-scheduler then passes the node unjudged, `no_shape`); one left from a cluster
    /// scope is removed.
    async fn withdraw_shape(&self) {
        let shown = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()))
            .is_some_and(|n| {
                n.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(names::NODE_CAPACITY_SHAPE))
            });
        if !shown {
            return;
        }
        let patch = json!({"metadata": {"annotations": {names::NODE_CAPACITY_SHAPE: null}}});
        if let Err(e) = Api::<Node>::all(self.upper())
            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!(node = self.name(), "removing the capacity shape: {e}");
        }
    }

    /// Writes the capacity shape annotation and bumps the generation label when
    /// [`ShapePublisher`] says so (one merge patch of the Node's metadata).
    async fn publish_shape(&self, publisher: &mut ShapePublisher) {
        if self.served != tensile_common::cache::Namespaces::All {
            self.withdraw_shape().await;
            return;
        }
        if !publisher.may_write(Instant::now()) {
            return;
        }
        let wall = jiff::Timestamp::now();
        // Built again only after a lower node or pod changed; dated now either way.
        let inputs = vec![self.lower_nodes.changes(), self.lower_pods.changes()];
        let mut computed = self.worked_out.shape.get(inputs, || {
            let nodes = self.lower_nodes.state();
            let loads = self.loads();
            shape::build(
                nodes.iter().map(|n| n.as_ref()),
                loads.all.iter().map(|(node, held)| (node.as_str(), held)),
                &self.settings.shape_label_keys,
                shape::DEFAULT_GROUP_CAP,
                wall,
            )
        });
        computed.at = Some(tensile_common::api::time(wall));
        let upper = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()));
        let published = upper
            .as_ref()
            .and_then(|n| Shape::from_annotations(n.metadata.annotations.as_ref()))
            .and_then(Result::ok);
        let write = publisher.round(&computed, published.as_ref(), Instant::now(), wall);
        if !write.any() {
            return;
        }
        let mut meta = json!({"metadata": {}});
        if write.annotation {
            match computed.encode() {
                Ok(text) => {
                    meta["metadata"]["annotations"] = json!({names::NODE_CAPACITY_SHAPE: text});
                }
                Err(e) => {
                    tracing::warn!(node = self.name(), "encoding the capacity shape: {e}");
                    return;
                }
            }
        }
        let generation = write.bump.then(|| {
            let shown = upper
                .as_ref()
                .and_then(|n| n.metadata.labels.as_ref())
                .and_then(|l| l.get(names::NODE_SHAPE_GENERATION));
            publisher.next_generation(shown.map(String::as_str))
        });
        if let Some(g) = generation {
            meta["metadata"]["labels"] = json!({names::NODE_SHAPE_GENERATION: g.to_string()});
        }
        let nodes: Api<Node> = Api::all(self.upper());
        match nodes
            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&meta))
            .await
        {
            Ok(_) => {
                publisher.written(write, &computed, generation, Instant::now(), wall);
                if let Some(g) = generation {
                    tracing::debug!(
                        node = self.name(),
                        generation = g,
                        "announced a grown capacity shape"
                    );
                }
            }
            Err(e) => tracing::warn!(node = self.name(), "capacity shape annotation: {e}"),
        }
    }

    /// Brings the registered Node's labels and taint to the settings and what the lower
    /// cluster shows (os/arch learned later, a changed `--node-labels` or `--disable-taint`).
    async fn reconcile_metadata(&self, cap: &Capacity) {
        let Some(node) = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()))
        else {
            return;
        };
        if !self.settings.retaint {
            let has = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == names::VIRTUAL_NODE_TAINT));
            let told = self
                .taint_told
                .swap(has != self.settings.taint, std::sync::atomic::Ordering::Relaxed);
            if has != self.settings.taint && !told {
                let (is, fix) = if has {
                    (
                        "has",
                        format!(
                            "kubectl taint node {} {}-",
                            self.name(),
                            names::VIRTUAL_NODE_TAINT
                        ),
                    )
                } else {
                    (
                        "lacks",
                        format!(
                            "kubectl taint node {} {}={}:NoSchedule",
                            self.name(),
                            names::VIRTUAL_NODE_TAINT,
                            names::VIRTUAL_NODE_TAINT_VALUE
                        ),
                    )
                };
                tracing::warn!(
                    node = self.name(),
                    "the Node {is} the taint {} against the settings; under a node identity NodeRestriction lets a node set its taints only when it registers: `{fix}`",
                    names::VIRTUAL_NODE_TAINT
                );
            }
        }
        let taint = self.settings.retaint.then_some(self.settings.taint);
        let placement = self.overrides.get().placement().map(|p| p.encode());
        let Some(patch) = metadata_patch(
            &node,
            &self.labels(cap),
            &self.settings.extra_labels,
            placement.as_deref(),
            taint,
        ) else {
            return;
        };
        let nodes: Api<Node> = Api::all(self.upper());
        match nodes
            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::info!(
                node = self.name(),
                "node labels, taint and placement overrides brought up to date"
            ),
            // 409: the Node changed meanwhile (its taints are shared with the node
            // controller); the next round looks again.
            Err(e) => tracing::debug!(node = self.name(), "node labels and taint: {e}"),
        }
    }

    async fn create_node(&self, cap: &Capacity) -> Result<(), kube::Error> {
        let taints: Vec<Value> = if self.settings.taint {
            vec![
                json!({"key": names::VIRTUAL_NODE_TAINT, "value": names::VIRTUAL_NODE_TAINT_VALUE, "effect": "NoSchedule"}),
            ]
        } else {
            vec![]
        };
        let extra: Vec<&str> = self.settings.extra_labels.keys().map(String::as_str).collect();
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": self.name(), "labels": self.labels(cap),
                         "annotations": {names::NODE_EXTRA_LABELS: extra.join(",")}},
            "spec": {"taints": taints},
        }))
        .map_err(kube::Error::SerdeError)?;
        let api: Api<Node> = Api::all(self.upper());
        match api.create(&PostParams::default(), &node).await {
            Ok(_) => {
                tracing::info!(node = self.name(), "registered the virtual node");
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn status_body(
        &self,
        cap: &Capacity,
        health: &Health,
        since: &Since,
        started: &str,
        version: &str,
    ) -> Value {
        let now = now();
        let cond = |kind: &str, status: &str, reason: &str, message: &str, since: &str| {
            json!({"type": kind, "status": status, "reason": reason, "message": message,
                   "lastHeartbeatTime": now, "lastTransitionTime": since})
        };
        let shown = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()));
        let shown = shown.as_ref().and_then(|n| n.status.as_ref());
        let (usable, usable_reason, usable_message) = room_condition(cap, health.nodes_usable);
        json!({"status": {
            "capacity": resources_patch(&cap.capacity, shown.and_then(|s| s.capacity.as_ref())),
            "allocatable": resources_patch(&cap.allocatable, shown.and_then(|s| s.allocatable.as_ref())),
            "conditions": [
                cond("Ready", if health.ready { "True" } else { "False" }, health.reason, &health.message, &since.ready),
                cond(names::CONDITION_LOWER_NODES_USABLE, usable, usable_reason, &usable_message, &since.nodes_usable),
                cond("MemoryPressure", "False", "LowerClusterHasNoPressure", "memory pressure is handled by the lower cluster", started),
                cond("DiskPressure", "False", "LowerClusterHasNoPressure", "disk pressure is handled by the lower cluster", started),
                cond("PIDPressure", "False", "LowerClusterHasNoPressure", "PID pressure is handled by the lower cluster", started),
            ],
            "addresses": [{"type": "InternalIP", "address": self.settings.node_ip}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.settings.kubelet_port}},
            // The kubelet API takes WebSocket streams itself (crate::serve::streams), so an upper
            // apiserver of 1.36+ proxies a client's WebSocket to it rather than translating it
            // to SPDY; older apiservers drop the field and translate. The pod features are
            // what every usable lower node declares: the upper scheduler keeps a pod needing
            // another off this node.
            "declaredFeatures": declared_features(cap),
            "nodeInfo": {
                "machineID": self.settings.identity.cluster_id, "systemUUID": self.name(), "bootID": started,
                "kernelVersion": "", "osImage": "tensile virtual node",
                "containerRuntimeVersion": "tensile://lower-cluster", "kubeletVersion": version,
                "operatingSystem": cap.os.clone().unwrap_or_else(|| "linux".into()),
                "architecture": cap.arch.clone().unwrap_or_else(|| "amd64".into()),
            },
        }})
    }

    async fn renew_lease(&self) -> Result<(), kube::Error> {
        if self.renew_existing_lease().await? {
            return Ok(());
        }
        let leases: Api<Lease> = Api::namespaced(self.upper(), "kube-node-lease");
        let micro = tensile_common::api::now_micro();
        let node = Api::<Node>::all(self.upper()).get(self.name()).await?;
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {"name": self.name(), "namespace": "kube-node-lease",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name(),
                                              "uid": node.metadata.uid.unwrap_or_default()}]},
            "spec": {"holderIdentity": self.name(), "leaseDurationSeconds": 40, "renewTime": micro},
        }))
        .map_err(kube::Error::SerdeError)?;
        match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Keeps an already registered node's Lease renewed until `synced` completes (the caches
    /// listed): on a large lower cluster the first list can outlast the upper node-monitor
    /// grace, and a restart or failover would then flap the node NotReady. The Lease is
    /// renewed only while the lower apiserver answers its probe (a lower cluster that does not
    /// answer is not vouched for); a Lease that does not exist yet is left to registration,
    /// which waits for the caches.
    pub async fn beat_until(&self, synced: impl std::future::Future<Output = ()>) {
        tokio::pin!(synced);
        loop {
            if self.probe().await.is_ok() {
                match self.renew_existing_lease().await {
                    Ok(true) => tracing::debug!(node = self.name(), "lease renewed while the caches list"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(node = self.name(), "lease: {e}");
                        self.reconnect_after(&e);
                    }
                }
            }
            tokio::select! {
                _ = &mut synced => return,
                _ = tokio::time::sleep(self.settings.lease_period) => {}
            }
        }
    }

    /// Renews the node's Lease if it exists (`false` when it does not).
    async fn renew_existing_lease(&self) -> Result<bool, kube::Error> {
        let leases: Api<Lease> = Api::namespaced(self.upper(), "kube-node-lease");
        let renew = json!({"spec": {"renewTime": tensile_common::api::now_micro(),
                                    "holderIdentity": self.name(), "leaseDurationSeconds": 40}});
        match leases
            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&renew))
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Runs forever: probe, recompute, patch status on change or when due, renew the lease,
    /// and recreate the Node if someone deleted it.
    pub async fn run(self, stop: tensile_common::runtime::CancellationToken) {
        let started = now();
        let mut since = Since {
            ready: started.clone(),
            nodes_usable: started.clone(),
        };
        let mut was_usable = None;
        let mut version = String::new();
        let mut state = Heartbeat::default();
        loop {
            let round_started = Instant::now();
            let probe = match self.probe().await {
                Ok(v) => {
                    if !v.is_empty() && v != version {
                        let lower = format!("the lower cluster of node {}", self.name());
                        if let Some(warning) = tensile_common::versions::warning(&lower, &v) {
                            tracing::warn!(node = self.name(), "{warning}");
                        }
                        version = v;
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            };
            let seen = Observed {
                probe,
                capacity: self.capacity(),
                in_watch: self
                    .upper_node
                    .get(&kube::runtime::reflector::ObjectRef::new(self.name()))
                    .is_some(),
                upstream_ready: self.upstream_ready(),
                now: Instant::now(),
            };
            let periods = Periods {
                probe: self.settings.probe_period,
                status: self.settings.status_period,
                lease: self.settings.lease_period,
            };
            let round = state.round(&seen, &periods);
            let (health, cap) = (round.health, seen.capacity);
            let ready = health.ready;
            self.metrics.lower_ready.set(i64::from(health.ready));
            self.lower_health.set(health.ready);
            if was_usable.replace(health.nodes_usable) != Some(health.nodes_usable) {
                since.nodes_usable = now();
            }
            if round.ready_changed {
                since.ready = now();
                tracing::info!(
                    node = self.name(),
                    ready = health.ready,
                    reason = health.reason,
                    "{}",
                    health.message
                );
            }
            if round.deleted_upstream {
                tracing::warn!(
                    node = self.name(),
                    "the Node object was deleted; registering it again"
                );
            }
            if round.register {
                match self.create_node(&cap).await {
                    Ok(()) => state.registered = true,
                    Err(e) => tracing::warn!(node = self.name(), "registering the node failed: {e}"),
                }
            }
            // The shape goes before the status: a status change makes the upper scheduler
            // retry its pods, which should then meet the new shape.
            if state.registered {
                self.publish_shape(&mut state.shape).await;
                self.reconcile_metadata(&cap).await;
            }
            if state.registered && round.write_status {
                let nodes: Api<Node> = Api::all(self.upper());
                let body = self.status_body(&cap, &health, &since, &started, &version);
                match nodes
                    .patch_status(self.name(), &PatchParams::default(), &Patch::Strategic(&body))
                    .await
                {
                    Ok(_) => state.status_written(cap, health, Instant::now()),
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        tracing::warn!(
                            node = self.name(),
                            "the Node object was deleted; registering it again"
                        );
                        state.node_gone();
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(node = self.name(), "node status: {e}");
                        if self.reconnect_after(&e) {
                            state.heartbeat_failed();
                        }
                    }
                }
            }
            if state.registered && round.renew_lease {
                match self.renew_lease().await {
                    Ok(()) => state.lease_renewed(Instant::now()),
                    Err(e) => {
                        tracing::warn!(node = self.name(), "lease: {e}");
                        if self.reconnect_after(&e) {
                            state.heartbeat_failed();
                        }
                    }
                }
            }
            // Wake on lower changes (debounced, and a round at most every
            // CHANGED_ROUND_MIN_INTERVAL: under a stream of pod events each round works the
            // capacity out over every lower pod) or after the probe period, sooner while the
            // lower cluster does not answer; stop between rounds, never inside one.
            let idle = if ready {
                self.settings.probe_period
            } else {
                self.settings.recovery_probe_period
            };
            let next = state.sleep(
                Instant::now(),
                idle,
                self.settings.recovery_probe_period,
                &periods,
            );
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                _ = self.changed.notified() => {
                    let debounced = Instant::now() + CHANGED_DEBOUNCE;
                    let spaced = round_started + CHANGED_ROUND_MIN_INTERVAL;
                    tokio::time::sleep_until(debounced.max(spaced)).await
                }
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// Renews the node's client certificate at 80 % of its lifetime, asking with `asking` (the
/// configured credential); a request that fails is made again every 10 s. Past the
/// certificate's end without a new one, the node stops: a restart asks anew.
pub async fn renew(
    asking: kube::Client,
    node: String,
    credential: kubeconfig::NodeCredential,
    timeout: Duration,
) -> Option<String> {
    loop {
        let (_, current) = credential.current();
        // Slept an hour at most at a time, the wall clock read again after each: a
        // suspended machine or a clock that jumped renews late by an hour at most.
        let now = node_identity::now_seconds();
        if now < current.renew_at() {
            tokio::time::sleep(current.renew_in(now).min(Duration::from_secs(3600))).await;
            continue;
        }
        loop {
            match node_identity::request(&asking, &node, timeout).await {
                Ok(issued) => {
                    tracing::info!(
                        node,
                        not_after = issued.not_after,
                        "node client certificate renewed"
                    );
                    credential.replace(issued);
                    break;
                }
                Err(e) if node_identity::now_seconds() >= current.not_after => {
                    return Some(format!(
                        "the node's client certificate expired and no new one was issued: {e}"
                    ));
                }
                Err(e) => {
                    tracing::warn!(node, "renewing the node client certificate: {e}");
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_recovery_is_the_lower_cluster_turning_reachable_again() {
        use futures::{FutureExt as _, StreamExt as _};
        let health = LowerHealth::default();
        let recoveries = health.recoveries();
        let mut recoveries = std::pin::pin!(recoveries);
        health.set(true);
        assert!(health.reachable());
        assert_eq!(recoveries.next().now_or_never(), None, "reachable from the start");
        health.set(false);
        health.set(false);
        assert!(!health.reachable());
        assert_eq!(recoveries.next().now_or_never(), None, "an outage is no recovery");
        health.set(true);
        health.set(true);
        assert_eq!(recoveries.next().now_or_never(), Some(Some(())), "back");
        assert_eq!(recoveries.next().now_or_never(), None, "once");
        // Seen late, an outage and a return are still one recovery.
        health.set(false);
        health.set(true);
        assert_eq!(recoveries.next().now_or_never(), Some(Some(())));
    }
}
