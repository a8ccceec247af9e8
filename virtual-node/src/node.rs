//! The virtual Node: registration, Lease, and a status that tells the truth about the lower
//! cluster (capacity from watched state, Ready from a real probe).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_common::cache::Cache;
use tensile_common::names;
use tensile_common::shape::{self, Shape};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::capacity::{self, Capacity, ShapePublisher};
use crate::metrics::Metrics;
use crate::translate::Identity;
use crate::trim::PodLoad;

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

/// The Ready verdict of one round. `probe`: whether the lower apiserver answered; `failures`:
/// failed probes in a row, this one included; `was_ready`: the previous verdict; and how many
/// usable lower nodes the caches show. One failed probe may be a blip; two in a row are an
/// outage. Ready says only whether the lower cluster answers: a lower cluster whose nodes are
/// all cordoned or not Ready still runs its pods, so it is shown as no room (capacity and
/// allocatable zero) and a condition that says why, never as NotReady, which would make the
/// upper node lifecycle controller evict every pod of the node.
/// Under a namespace scope (`quotas`) the count is of served namespaces with a quota.
fn judge(
    probe: Result<(), String>,
    failures: u32,
    was_ready: bool,
    usable_nodes: usize,
    quotas: bool,
) -> Health {
    let nodes_usable = usable_nodes > 0;
    let places = match quotas {
        true => "served namespace(s) with a ResourceQuota",
        false => "usable node(s)",
    };
    match probe {
        Ok(()) => Health {
            ready: true,
            reason: "LowerClusterReady",
            message: format!("the lower cluster answers and has {usable_nodes} {places}"),
            nodes_usable,
        },
        Err(e) => Health {
            ready: failures < 2 && was_ready,
            reason: "LowerClusterUnreachable",
            message: format!("the lower cluster's apiserver does not answer: {e}"),
            nodes_usable,
        },
    }
}

/// The `tensile.io/LowerNodesUsable` condition: status, reason, message. Under a namespace
/// scope it says where the room shown comes from, and which served namespaces bound none.
fn room_condition(cap: &Capacity, usable: bool) -> (&'static str, &'static str, String) {
    match (&cap.quotas, usable) {
        (None, true) => (
            "True",
            "UsableLowerNodes",
            "the lower cluster has a Ready schedulable node".into(),
        ),
        (None, false) => (
            "False",
            "NoUsableLowerNodes",
            "no lower node is Ready and schedulable (cordoned or not Ready): the node offers no room until one is; its pods keep running below".into(),
        ),
        (Some(unbounded), true) => {
            let mut message = "the room shown is what the served namespaces' ResourceQuotas leave".to_owned();
            if !unbounded.is_empty() {
                message.push_str(&format!(
                    "; {} bound(s) no cpu, memory or pods, which adds no room of it",
                    unbounded.join(", ")
                ));
            }
            ("True", "ServedNamespaceQuotas", message)
        }
        (Some(_), false) => (
            "False",
            "NoServedNamespaceQuota",
            "no served namespace has a ResourceQuota: the node offers no room until one has (hard: requests.cpu, requests.memory, pods)".into(),
        ),
    }
}

/// [`room_condition`] as a round shows it (usable when some place counted).
#[cfg(test)]
pub(crate) fn room_condition_for_tests(cap: &Capacity) -> (&'static str, &'static str, String) {
    room_condition(cap, cap.usable_nodes > 0)
}

/// Whether node status is written this round: it changed since the last write, or is due
/// (the status period passed), or someone else rewrote Ready upstream (the node lifecycle
/// controller, after missed heartbeats): the true status is then asserted again, as a
/// kubelet does.
fn status_due(
    last_sent: Option<&(Capacity, Health)>,
    now: (&Capacity, &Health),
    due: bool,
    upstream_ready: Option<bool>,
) -> bool {
    let Some((cap, health)) = last_sent else {
        return true;
    };
    due || cap != now.0 || health != now.1 || upstream_ready.is_some_and(|ready| ready != now.1.ready)
}

/// Readiness of the lower cluster as the Ready condition shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Health {
    ready: bool,
    reason: &'static str,
    message: String,
    /// Some lower node is Ready and schedulable (the `tensile.io/LowerNodesUsable` condition).
    nodes_usable: bool,
}

/// What one round of the node loop sees.
struct Observed {
    /// Whether the lower apiserver answered.
    probe: Result<(), String>,
    capacity: Capacity,
    /// Whether the watch of the upper Node shows it.
    in_watch: bool,
    /// Ready as the upper Node shows it, when seen.
    upstream_ready: Option<bool>,
    now: Instant,
}

/// The node loop's periods, as its decisions read them.
struct Periods {
    probe: Duration,
    status: Duration,
    lease: Duration,
}

/// What one round of the node loop does, in order; registration, status and lease writes
/// happen only while the node is registered.
#[derive(Debug, PartialEq)]
struct Round {
    health: Health,
    /// Ready flipped this round (logged, and the transition time moves).
    ready_changed: bool,
    /// The Node was seen and is gone: someone deleted it.
    deleted_upstream: bool,
    register: bool,
    write_status: bool,
    renew_lease: bool,
}

/// The node loop's memory between rounds and its decisions, apart from the API calls: the
/// loop tells it what it saw and what its writes did.
#[derive(Default)]
struct Heartbeat {
    failures: u32,
    /// When the current run of failed probes began.
    failing_since: Option<Instant>,
    last_health: Option<Health>,
    /// What the last status write sent.
    last_sent: Option<(Capacity, Health)>,
    last_status: Option<Instant>,
    last_lease: Option<Instant>,
    registered: bool,
    /// Set once the Node shows in the watch; its absence afterwards means it was deleted.
    seen_in_watch: bool,
    /// When the capacity shape is written.
    shape: ShapePublisher,
}

impl Heartbeat {
    fn round(&mut self, seen: &Observed, periods: &Periods) -> Round {
        // Failed probes count as an outage only when they span a probe period: rounds also
        // run on watch events, and a broken watch wakes several at once.
        if seen.probe.is_ok() {
            self.failures = 0;
            self.failing_since = None;
        } else {
            let since = *self.failing_since.get_or_insert(seen.now);
            self.failures = if seen.now.duration_since(since) >= periods.probe {
                self.failures.saturating_add(1).max(2)
            } else {
                1
            };
        }
        let was_ready = self.last_health.as_ref().is_some_and(|h| h.ready);
        let health = judge(
            seen.probe.clone(),
            self.failures,
            was_ready,
            seen.capacity.usable_nodes,
            seen.capacity.quotas.is_some(),
        );
        let ready_changed = self.last_health.as_ref().map(|h| h.ready) != Some(health.ready);
        self.last_health = Some(health.clone());
        let mut deleted_upstream = false;
        if seen.in_watch {
            self.seen_in_watch = true;
        } else if self.registered && self.seen_in_watch {
            deleted_upstream = true;
            self.node_gone();
        }
        let write_status = status_due(
            self.last_sent.as_ref(),
            (&seen.capacity, &health),
            self.last_status
                .is_none_or(|t| seen.now.duration_since(t) >= periods.status),
            seen.upstream_ready,
        );
        let renew_lease = self
            .last_lease
            .is_none_or(|t| seen.now.duration_since(t) >= periods.lease);
        Round {
            health,
            ready_changed,
            deleted_upstream,
            register: !self.registered,
            write_status,
            renew_lease,
        }
    }

    /// The Node is gone upstream: it is registered again, with a full status and a lease.
    fn node_gone(&mut self) {
        self.registered = false;
        self.seen_in_watch = false;
        self.last_sent = None;
        self.last_lease = None;
        self.shape = ShapePublisher::default();
    }

    fn status_written(&mut self, capacity: Capacity, health: Health, at: Instant) {
        self.last_sent = Some((capacity, health));
        self.last_status = Some(at);
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
    pub overrides: crate::overrides::Current,
}

/// The merge patch that brings `node` to `labels` (every label the virtual node sets), with
/// `extra` the `--node-labels` among them, to the placement overrides `placement` (the
/// annotation's text; `None`: none published), and to the virtual-node taint present or
/// not; `None` when nothing differs; `taint` `None` leaves the taints alone. Labels of others are never touched; a `--node-labels` key no
/// longer given is removed. The patch carries the Node's resourceVersion when it rewrites
/// the taints (a list shared with the node controller), so it never overwrites a newer one.
pub fn metadata_patch(
    node: &Node,
    labels: &BTreeMap<String, String>,
    extra: &BTreeMap<String, String>,
    placement: Option<&str>,
    taint: Option<bool>,
) -> Option<Value> {
    let have = node.metadata.labels.clone().unwrap_or_default();
    let mut label_patch = serde_json::Map::new();
    for (k, v) in labels {
        if have.get(k) != Some(v) {
            label_patch.insert(k.clone(), json!(v));
        }
    }
    let recorded = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_EXTRA_LABELS))
        .cloned()
        .unwrap_or_default();
    for old in recorded.split(',').filter(|k| !k.is_empty()) {
        if !labels.contains_key(old) && have.contains_key(old) {
            label_patch.insert(old.to_owned(), Value::Null);
        }
    }
    let extra_keys = extra.keys().map(String::as_str).collect::<Vec<_>>().join(",");
    let mut patch = json!({});
    if !label_patch.is_empty() {
        patch["metadata"]["labels"] = Value::Object(label_patch);
    }
    if recorded != extra_keys {
        patch["metadata"]["annotations"][names::NODE_EXTRA_LABELS] = json!(extra_keys);
    }
    let published = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_PLACEMENT_OVERRIDES))
        .map(String::as_str);
    if published != placement {
        patch["metadata"]["annotations"][names::NODE_PLACEMENT_OVERRIDES] = json!(placement);
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let ours = |t: &k8s_openapi::api::core::v1::Taint| t.key == names::VIRTUAL_NODE_TAINT;
    let has = taints.iter().any(ours);
    if let Some(taint) = taint
        && has != taint
    {
        let mut wanted: Vec<Value> = taints
            .iter()
            .filter(|t| !ours(t))
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect();
        if taint {
            wanted.push(
                json!({"key": names::VIRTUAL_NODE_TAINT, "value": names::VIRTUAL_NODE_TAINT_VALUE,
                               "effect": "NoSchedule"}),
            );
        }
        patch["spec"] = json!({"taints": wanted});
        patch["metadata"]["resourceVersion"] = json!(node.metadata.resource_version);
    }
    (patch != json!({})).then_some(patch)
}

/// Resources every virtual node states, at zero when no lower node offers them, so that a
/// lower cluster without usable nodes shows no room instead of the last figures.
const STATED_RESOURCES: [&str; 3] = ["cpu", "memory", "pods"];

/// The node feature (`status.declaredFeatures`) by which a kubelet says it takes WebSocket
/// exec, attach and port-forward streams from the apiserver.
pub const EXTEND_WEBSOCKETS_TO_KUBELET: &str = "ExtendWebSocketsToKubelet";

/// The `capacity` or `allocatable` map of a status patch: `now`, the resources every node
/// states at zero when absent, and a removal (`null`) for each resource the Node shows that
/// no lower node offers any more (a strategic merge keeps keys a patch leaves out).
fn resources_patch(
    now: &tensile_common::quantity::ResourceMap,
    shown: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Value {
    let mut out: serde_json::Map<String, Value> =
        now.to_strings().into_iter().map(|(k, v)| (k, json!(v))).collect();
    for name in STATED_RESOURCES {
        out.entry(name).or_insert_with(|| json!("0"));
    }
    for name in shown.into_iter().flat_map(|m| m.keys()) {
        out.entry(name.clone()).or_insert(Value::Null);
    }
    Value::Object(out)
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
    /// next heartbeat does not wait on another dead pooled connection.
    fn reconnect_after(&self, e: &kube::Error) {
        if matches!(e, kube::Error::Api(_)) {
            return;
        }
        match self.upper_source.client() {
            Ok(fresh) => {
                if let Ok(mut c) = self.upper.lock() {
                    *c = fresh;
                }
            }
            Err(e) => tracing::warn!(node = self.name(), "a fresh upper client: {e}"),
        }
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

    fn capacity(&self) -> Capacity {
        let pods = self.lower_pods.state();
        if let tensile_common::cache::Namespaces::Only(served) = &self.served {
            let quotas = self.lower_quotas.state();
            return capacity::compute_from_quotas(
                served,
                quotas.iter().map(|q| q.as_ref()),
                pods.iter().map(|p| p.as_ref()),
                &self.settings.identity,
            );
        }
        let nodes = self.lower_nodes.state();
        capacity::compute(
            nodes.iter().map(|n| n.as_ref()),
            pods.iter().map(|p| p.as_ref()),
            &self.settings.identity,
        )
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

    /// Writes the capacity shape annotation when [`ShapePublisher`] says so, bumping the
    /// generation label in the same patch when the shape grew.
    async fn publish_shape(&self, publisher: &mut ShapePublisher) {
        if self.served != tensile_common::cache::Namespaces::All {
            self.withdraw_shape().await;
            return;
        }
        let wall = jiff::Timestamp::now();
        let computed = {
            let nodes = self.lower_nodes.state();
            let pods = self.lower_pods.state();
            shape::build(
                nodes.iter().map(|n| n.as_ref()),
                pods.iter()
                    .filter(|p| !p.terminal)
                    .filter_map(|p| Some((p.node.as_deref()?, &p.requests))),
                &self.settings.shape_label_keys,
                shape::DEFAULT_GROUP_CAP,
                wall,
            )
        };
        let upper = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()));
        let published = upper
            .as_ref()
            .and_then(|n| Shape::from_annotations(n.metadata.annotations.as_ref()))
            .and_then(Result::ok);
        let write = publisher.round(&computed, published.as_ref(), Instant::now(), wall);
        if !write.annotation {
            return;
        }
        let text = match computed.encode() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(node = self.name(), "encoding the capacity shape: {e}");
                return;
            }
        };
        let mut meta = json!({"metadata": {"annotations": {names::NODE_CAPACITY_SHAPE: text}}});
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
                publisher.written(&computed, generation, Instant::now(), wall);
                if let Some(g) = generation {
                    tracing::debug!(node = self.name(), generation = g, "the capacity shape grew");
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
            // The kubelet API takes WebSocket streams itself (crate::streams), so an upper
            // apiserver of 1.36+ proxies a client's WebSocket to it rather than translating it
            // to SPDY; older apiservers drop the field and translate.
            "declaredFeatures": [EXTEND_WEBSOCKETS_TO_KUBELET],
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
                        self.reconnect_after(&e);
                    }
                }
            }
            if state.registered && round.renew_lease {
                match self.renew_lease().await {
                    Ok(()) => state.last_lease = Some(Instant::now()),
                    Err(e) => {
                        tracing::warn!(node = self.name(), "lease: {e}");
                        self.reconnect_after(&e);
                    }
                }
            }
            // Wake on lower changes (debounced) or after the probe period, sooner while the
            // lower cluster does not answer; stop between rounds, never inside one.
            let next_probe = if ready {
                self.settings.probe_period
            } else {
                self.settings.recovery_probe_period
            };
            tokio::select! {
                _ = tokio::time::sleep(next_probe) => {}
                _ = self.changed.notified() => tokio::time::sleep(Duration::from_millis(300)).await,
                _ = stop.cancelled() => return,
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

    #[test]
    fn node_labels_and_taint_follow_the_settings_and_leave_others_alone() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "vn", "resourceVersion": "41",
                         "labels": {"kubernetes.io/os": "linux", "team": "a", "someone-else": "x"},
                         "annotations": {names::NODE_EXTRA_LABELS: "team"}},
            "spec": {"taints": [
                {"key": names::VIRTUAL_NODE_TAINT, "value": "tensile", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]}}))
        .unwrap();
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // Unchanged settings: nothing to write.
        let same = labels(&[("kubernetes.io/os", "linux"), ("team", "a")]);
        assert_eq!(
            metadata_patch(&node, &same, &labels(&[("team", "a")]), None, Some(true)),
            None
        );
        // --node-labels now zone=z1, os learned as windows, --disable-taint.
        let extra = labels(&[("zone", "z1")]);
        let wanted = labels(&[("kubernetes.io/os", "windows"), ("zone", "z1")]);
        let kept = metadata_patch(&node, &wanted, &extra, None, None).unwrap();
        assert!(kept.get("spec").is_none(), "taints left alone: {kept}");
        assert_eq!(kept["metadata"]["labels"]["zone"], "z1");
        let patch = metadata_patch(&node, &wanted, &extra, None, Some(false)).unwrap();
        assert_eq!(
            patch["metadata"]["labels"],
            json!({"kubernetes.io/os": "windows", "zone": "z1", "team": null})
        );
        assert_eq!(patch["metadata"]["annotations"][names::NODE_EXTRA_LABELS], "zone");
        assert_eq!(
            patch["spec"]["taints"],
            json!([{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]),
            "only our taint goes; the node controller's stays"
        );
        assert_eq!(patch["metadata"]["resourceVersion"], "41");
    }

    #[test]
    fn one_failed_probe_is_a_blip_and_two_in_a_row_are_an_outage() {
        let ready = judge(Ok(()), 0, false, 3, false);
        assert!(ready.ready);
        assert_eq!(ready.reason, "LowerClusterReady");
        let blip = judge(Err("timeout".into()), 1, true, 3, false);
        assert!(blip.ready, "one failure keeps a Ready node Ready");
        let outage = judge(Err("timeout".into()), 2, blip.ready, 3, false);
        assert!(!outage.ready);
        assert_eq!(outage.reason, "LowerClusterUnreachable");
        assert!(outage.message.contains("timeout"), "{}", outage.message);
        assert!(
            !judge(Err("refused".into()), 1, false, 3, false).ready,
            "a node not Ready stays so"
        );
    }

    #[test]
    fn a_lower_cluster_without_usable_nodes_stays_ready_and_says_it_has_no_room() {
        let h = judge(Ok(()), 0, true, 0, false);
        assert!(h.ready, "cordoned lower nodes still run their pods");
        assert!(!h.nodes_usable);
        assert!(judge(Ok(()), 0, true, 2, false).nodes_usable);
    }

    #[test]
    fn resources_no_lower_node_offers_are_zero_or_removed() {
        let shown: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity> = [
            ("cpu", "8"),
            ("memory", "16Gi"),
            ("pods", "220"),
            ("nvidia.com/gpu", "2"),
        ]
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_owned(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(v.into()),
            )
        })
        .collect();
        let none = tensile_common::quantity::ResourceMap::default();
        assert_eq!(
            resources_patch(&none, Some(&shown)),
            json!({"cpu": "0", "memory": "0", "pods": "0", "nvidia.com/gpu": null})
        );
        let pairs = [
            ("cpu".to_owned(), "4".to_owned()),
            ("pods".to_owned(), "110".to_owned()),
        ];
        let (some, _) = tensile_common::quantity::ResourceMap::parse(pairs.iter().map(|(k, v)| (k, v)));
        assert_eq!(
            resources_patch(&some, None),
            json!({"cpu": "4", "memory": "0", "pods": "110"})
        );
    }

    #[test]
    fn status_is_written_first_on_change_when_due_and_when_ready_was_rewritten_upstream() {
        let cap = Capacity::default();
        let ready = judge(Ok(()), 0, false, 1, false);
        let sent = (cap.clone(), ready.clone());
        assert!(
            status_due(None, (&cap, &ready), false, None),
            "the first round writes"
        );
        assert!(
            !status_due(Some(&sent), (&cap, &ready), false, Some(true)),
            "nothing changed"
        );
        assert!(
            status_due(Some(&sent), (&cap, &ready), true, Some(true)),
            "the period passed"
        );
        let outage = judge(Err("x".into()), 2, true, 1, false);
        assert!(
            status_due(Some(&sent), (&cap, &outage), false, Some(true)),
            "health changed"
        );
        assert!(
            status_due(Some(&sent), (&cap, &ready), false, Some(false)),
            "the node lifecycle controller marked it not Ready: assert Ready again"
        );
        assert!(
            !status_due(Some(&sent), (&cap, &ready), false, None),
            "an unseen upstream node is no reason to write"
        );
    }

    fn seen(probe: Result<(), String>, usable_nodes: usize, in_watch: bool, now: Instant) -> Observed {
        Observed {
            probe,
            capacity: Capacity {
                usable_nodes,
                ..Default::default()
            },
            in_watch,
            upstream_ready: in_watch.then_some(true),
            now,
        }
    }

    const STATUS: Duration = Duration::from_secs(60);
    const LEASE: Duration = Duration::from_secs(10);
    const PERIODS: Periods = Periods {
        probe: Duration::from_secs(5),
        status: STATUS,
        lease: LEASE,
    };

    /// A registered node whose first round wrote status and renewed its lease at `t0`.
    fn registered(t0: Instant) -> Heartbeat {
        let mut state = Heartbeat::default();
        let first = state.round(&seen(Ok(()), 3, false, t0), &PERIODS);
        assert!(first.register && first.write_status && first.renew_lease && first.ready_changed);
        state.registered = true;
        state.status_written(seen(Ok(()), 3, false, t0).capacity, first.health, t0);
        state.last_lease = Some(t0);
        state
    }

    #[test]
    fn a_quiet_ready_node_renews_its_lease_every_lease_period_and_its_status_every_status_period() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let quiet = state.round(&seen(Ok(()), 3, true, t0 + Duration::from_secs(5)), &PERIODS);
        assert!(!quiet.register && !quiet.write_status && !quiet.renew_lease && !quiet.ready_changed);
        let lease = state.round(&seen(Ok(()), 3, true, t0 + LEASE), &PERIODS);
        assert!(lease.renew_lease && !lease.write_status);
        let status = state.round(&seen(Ok(()), 3, true, t0 + STATUS), &PERIODS);
        assert!(status.write_status);
    }

    #[test]
    fn a_lower_outage_turns_the_node_not_ready_once_failed_probes_span_a_probe_period() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let t = t0 + Duration::from_secs(1);
        let blip = state.round(&seen(Err("timeout".into()), 3, true, t), &PERIODS);
        assert!(
            blip.health.ready && !blip.ready_changed,
            "one failed probe is a blip"
        );
        // Rounds woken by watch events a moment later: still the same blip.
        let soon = t + Duration::from_millis(300);
        for _ in 0..3 {
            let again = state.round(&seen(Err("timeout".into()), 3, true, soon), &PERIODS);
            assert!(
                again.health.ready,
                "failures within one probe period are one blip"
            );
        }
        let t = t + PERIODS.probe;
        let outage = state.round(&seen(Err("timeout".into()), 3, true, t), &PERIODS);
        assert!(!outage.health.ready && outage.ready_changed && outage.write_status);
        let back = state.round(&seen(Ok(()), 3, true, t), &PERIODS);
        assert!(
            back.health.ready && back.ready_changed,
            "one good probe is enough to come back"
        );
    }

    #[test]
    fn a_node_deleted_upstream_is_registered_again_with_a_full_status_and_lease() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let t = t0 + Duration::from_secs(1);
        assert!(!state.round(&seen(Ok(()), 3, true, t), &PERIODS).deleted_upstream);
        let gone = state.round(&seen(Ok(()), 3, false, t), &PERIODS);
        assert!(gone.deleted_upstream && gone.register && gone.write_status && gone.renew_lease);
        let again = state.round(&seen(Ok(()), 3, false, t), &PERIODS);
        assert!(
            !again.deleted_upstream,
            "reported once, not every round until the watch shows it"
        );
    }

    #[test]
    fn a_node_not_yet_in_the_watch_after_registering_is_not_taken_for_deleted() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let round = state.round(&seen(Ok(()), 3, false, t0 + Duration::from_secs(1)), &PERIODS);
        assert!(!round.deleted_upstream && !round.register);
    }
}
