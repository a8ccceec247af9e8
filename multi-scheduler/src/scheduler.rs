//! The standalone scheduler (`--mode=scheduler`): places pods with
//! `spec.schedulerName=<--scheduler-name>` on virtual nodes, one at a time, as
//! kube-scheduler does: a [`Queue`] with per-pod backoff, the decision of [`place`], the
//! Binding subresource with the pod's UID, `PodScheduled=False` plus a `FailedScheduling`
//! event when no node takes the pod, a `Scheduled` event when one does.
//!
//! A pod with inter-pod constraints (required pod affinity or anti-affinity, topology
//! spread with `DoNotSchedule`, host ports) is refused once, with the same condition and a
//! Warning event that say which and what to do: this scheduler does not see the pods those
//! need, and placing the pod anyway would silently break them.
//!
//! Between a bind and the shape that shows it, the pod's requests are held in a [`Ledger`]
//! (kube-scheduler's assume cache, for the shape): counted against the node's allocatable
//! until the watch shows the pod bound, and taken out of the node's shape until the shape
//! can reflect the pod, that is until the lower scheduler placed it (its
//! `tensile.io/LowerPodScheduled=True`, or the pod Running) and a changed shape has had time
//! to be published since, so two pods never get the same free space. A newer shape alone
//! frees nothing: the virtual node may not have created the lower pod when it computed it.
//!
//! `PodScheduled` is written as kube-scheduler writes it: its `lastTransitionTime` moves
//! only when its status changes, so a pod that waits with a changing message keeps the time
//! it became unschedulable, which the descheduler's release rule measures from.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, PodCondition};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tensile_common::cache::Cache;
use tensile_common::exclusion::Exclusions;
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::{is_terminal, pod_requests};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::context::{FactsCache, exclusions_for};
use crate::extender::Score;
use crate::metrics::Metrics;
use crate::place::{Candidate, Placement, place, refusal, unsupported_constraints};
use crate::queue::Queue;
use tensile_common::fit::Options;

/// How long a placed pod stays in the ledger at most: long enough for a virtual node's
/// retried lower create under a slow lower apiserver, bounded so that a pod whose placement
/// below is never reported (a virtual node that writes no `LowerPodScheduled`, a pod that
/// never runs) does not hold its node's space for good.
const ASSUMED_FOR: Duration = Duration::from_secs(120);
/// How long after the watch shows a pod placed below its virtual node's shape reflects it:
/// virtual-node writes a changed shape within 5 s (and 300 ms) of the change, and writes
/// nothing when the frontier did not change (identical lower nodes are one vector). Measured
/// on this process's monotonic clock from when it saw the placement, never by comparing a
/// shape's `at` with another process's clock.
const SHAPE_CATCH_UP: Duration = Duration::from_secs(6);

/// A pod placed by this scheduler that the caches may not reflect yet.
struct Placed {
    node: String,
    requests: ResourceMap,
    /// When it was bound.
    since: Instant,
    /// When the watch first showed it placed by the lower scheduler.
    below: Option<Instant>,
}

/// The assume ledger: the pods this scheduler placed whose requests the caches may not
/// show yet, by UID. Time comes in as an argument, so a test drives it with its own clock.
#[derive(Default)]
pub struct Ledger {
    placed: HashMap<String, Placed>,
}

impl Ledger {
    /// Holds `requests` on `node` for the pod `uid`, bound at `now`.
    pub fn assume(&mut self, uid: &str, node: &str, requests: ResourceMap, now: Instant) {
        let placed = Placed {
            node: node.to_owned(),
            requests,
            since: now,
            below: None,
        };
        self.placed.insert(uid.to_owned(), placed);
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.placed.contains_key(uid)
    }

    /// Brings the ledger up to the pods the watch shows at `now`: a pod gone or terminal
    /// leaves; a pod placed below starts its catch-up, and leaves once it has passed; any
    /// pod leaves [`ASSUMED_FOR`] after its bind. True when one left (its space is back).
    pub fn sync<'a>(&mut self, pods: impl IntoIterator<Item = &'a Pod>, now: Instant) -> bool {
        let pods: HashMap<&str, &Pod> = pods
            .into_iter()
            .filter_map(|p| p.metadata.uid.as_deref().map(|u| (u, p)))
            .collect();
        let before = self.placed.len();
        self.placed.retain(|uid, p| {
            let Some(pod) = pods.get(uid.as_str()).filter(|p| !is_terminal(p)) else {
                return false;
            };
            if placed_below(pod) {
                p.below.get_or_insert(now);
            }
            let caught_up = p.below.is_some_and(|b| now.duration_since(b) >= SHAPE_CATCH_UP);
            !caught_up && now.duration_since(p.since) < ASSUMED_FOR
        });
        self.placed.len() < before
    }

    /// How long until an entry leaves by time alone (`None`: the ledger is empty).
    pub fn next_release(&self, now: Instant) -> Option<Duration> {
        self.placed
            .values()
            .map(|p| {
                let expiry = p.since + ASSUMED_FOR;
                let at = p.below.map_or(expiry, |b| (b + SHAPE_CATCH_UP).min(expiry));
                at.saturating_duration_since(now)
            })
            .min()
    }

    /// The requests taken out of `node`'s shape: every pod placed there that the shape may
    /// not reflect yet.
    pub fn taken(&self, node: &str) -> Vec<ResourceMap> {
        self.placed
            .values()
            .filter(|p| p.node == node)
            .map(|p| p.requests.clone())
            .collect()
    }

    /// Requests per node of the pods placed whose binding the watch does not show yet
    /// (`bound`: the UIDs it shows bound).
    fn unbound<'a>(&'a self, bound: &'a HashSet<String>) -> impl Iterator<Item = (&'a str, &'a ResourceMap)> {
        self.placed
            .iter()
            .filter(|(uid, _)| !bound.contains(*uid))
            .map(|(_, p)| (p.node.as_str(), &p.requests))
    }
}

pub struct Scheduler {
    pub client: kube::Client,
    pub name: String,
    /// Every non-terminal pod of the cluster.
    pub pods: Cache<Pod>,
    /// The virtual nodes.
    pub nodes: Cache<Node>,
    pub exclusions: watch::Receiver<Arc<Exclusions>>,
    pub facts: FactsCache,
    pub score: Score,
    pub max_age: Option<jiff::SignedDuration>,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Woken on any pod, node or exclusion change.
    pub changed: Arc<Notify>,
}

fn key_of(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

impl Scheduler {
    fn is_ours(&self, pod: &Pod) -> bool {
        let spec = pod.spec.as_ref();
        spec.and_then(|s| s.scheduler_name.as_deref()) == Some(self.name.as_str())
            && node_of(pod).is_none()
            && pod.metadata.deletion_timestamp.is_none()
            && spec
                .and_then(|s| s.scheduling_gates.as_ref())
                .is_none_or(Vec::is_empty)
            && !is_terminal(pod)
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut queue = Queue::default();
        let mut placed = Ledger::default();
        // UIDs of pods refused for constraints this scheduler does not honour: those are
        // immutable, so the pods are told once and not tried again.
        let mut refused: HashSet<String> = HashSet::new();
        loop {
            let now = Instant::now();
            // Space the ledger gives back is a cluster change no watch reports.
            let wait = [queue.next_due(now), placed.next_release(now)]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(Duration::from_secs(60));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.changed.notified() => queue.cluster_changed(Instant::now()),
                _ = tokio::time::sleep(wait) => {}
            }
            self.sync(&mut queue, &mut placed, &mut refused);
            while let Some(key) = queue.pop(Instant::now()) {
                if stop.is_cancelled() {
                    return;
                }
                self.schedule_one(&key, &mut queue, &mut placed, &mut refused)
                    .await;
            }
            self.metrics.queue_pending.set(queue.len() as i64);
        }
    }

    /// Queues every pod that is ours and unbound, forgets the rest, and drops ledger entries
    /// the caches now reflect.
    fn sync(&self, queue: &mut Queue, placed: &mut Ledger, refused: &mut HashSet<String>) {
        let pods = self.pods.state();
        let mut ours = HashSet::new();
        let mut still_refused = HashSet::new();
        for pod in pods.iter().filter(|p| self.is_ours(p)) {
            let key = key_of(pod);
            if placed.contains(&uid(pod)) {
                continue;
            }
            if refused.contains(&uid(pod)) {
                still_refused.insert(uid(pod));
                continue;
            }
            let created = pod
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .unwrap_or_default();
            let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
            queue.add(&key, priority, created);
            ours.insert(key);
        }
        *refused = still_refused;
        let gone: Vec<String> = queue.keys().filter(|k| !ours.contains(*k)).cloned().collect();
        for key in gone {
            queue.remove(&key);
        }
        let now = Instant::now();
        if placed.sync(pods.iter().map(|p| p.as_ref()), now) {
            queue.cluster_changed(now);
        }
    }

    /// Requests per virtual node of the pods bound to it, with those just placed that the
    /// watch does not show bound yet.
    fn requested(&self, placed: &Ledger) -> HashMap<String, ResourceMap> {
        let mut out: HashMap<String, ResourceMap> = HashMap::new();
        let mut seen_bound = HashSet::new();
        for pod in self.pods.state() {
            let Some(node) = node_of(&pod) else { continue };
            seen_bound.insert(uid(&pod));
            if !is_terminal(&pod) {
                out.entry(node.to_owned()).or_default().add(&pod_requests(&pod));
            }
        }
        for (node, requests) in placed.unbound(&seen_bound) {
            out.entry(node.to_owned()).or_default().add(requests);
        }
        out
    }

    async fn schedule_one(
        &self,
        key: &str,
        queue: &mut Queue,
        placed: &mut Ledger,
        refused: &mut HashSet<String>,
    ) {
        let Some((ns, name)) = key.split_once('/') else {
            queue.remove(key);
            return;
        };
        let Some(pod) = self
            .pods
            .get(&ObjectRef::new(name).within(ns))
            .filter(|p| self.is_ours(p))
        else {
            queue.remove(key);
            return;
        };
        if let Some(constraints) = unsupported_constraints(&pod) {
            queue.remove(key);
            refused.insert(uid(&pod));
            self.metrics.bind("unsupported");
            let message = refusal(&self.name, &constraints);
            tracing::info!(pod = key, "{message}");
            self.unschedulable(&pod, &message).await;
            return;
        }
        let nodes = self.nodes.state();
        let requested = self.requested(placed);
        let candidates: Vec<Candidate<'_>> = nodes
            .iter()
            .map(|n| {
                let node_name = n.name_any();
                Candidate {
                    node: n.as_ref(),
                    facts: self.facts.facts(n),
                    requested: requested.get(&node_name).cloned().unwrap_or_default(),
                    taken: placed.taken(&node_name),
                }
            })
            .collect();
        let options = Options {
            now: jiff::Timestamp::now(),
            max_age: self.max_age,
        };
        let exclusions = self.exclusions.borrow().clone();
        let excluded = exclusions_for(&pod, &exclusions, options.now);
        let (placement, outcomes) = place(&pod, &candidates, &excluded, &options, self.score);
        self.metrics.outcomes(&outcomes);
        match placement {
            Placement::Node(node) => self.bind(&pod, &node, queue, placed).await,
            Placement::Unschedulable(message) => {
                queue.unschedulable(key, Instant::now());
                self.metrics.bind("unschedulable");
                tracing::info!(pod = key, "{message}");
                self.unschedulable(&pod, &message).await;
            }
        }
    }

    async fn bind(&self, pod: &Pod, node: &str, queue: &mut Queue, placed: &mut Ledger) {
        let key = key_of(pod);
        let ns = pod.namespace().unwrap_or_default();
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": pod.name_any(), "namespace": ns, "uid": uid(pod)},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        });
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let result = api
            .create_subresource::<serde_json::Value, serde_json::Value>(
                "binding",
                &pod.name_any(),
                &PostParams::default(),
                &binding,
            )
            .await;
        match result {
            Ok(_) => {
                queue.remove(&key);
                placed.assume(&uid(pod), node, pod_requests(pod), Instant::now());
                self.metrics.bind("success");
                tracing::info!(pod = key, node, "bound");
                let note = format!("Successfully assigned {key} to {node}");
                self.event(pod, EventType::Normal, "Scheduled", &note).await;
            }
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                // Bound by someone else, or gone: nothing left to do.
                queue.remove(&key);
                self.metrics.bind("conflict");
            }
            Err(e) => {
                queue.failed(&key, Instant::now());
                self.metrics.bind("error");
                tracing::warn!(pod = key, node, "binding failed: {e}");
                let note = format!("binding to {node} failed: {e}");
                self.event(pod, EventType::Warning, "FailedScheduling", &note)
                    .await;
            }
        }
    }

    /// `PodScheduled=False` (when it says something new) and a `FailedScheduling` event.
    async fn unschedulable(&self, pod: &Pod, message: &str) {
        let current = pod
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .find(|c| c.type_ == "PodScheduled");
        if let Some(patch) = unschedulable_patch(current, message, jiff::Timestamp::now()) {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
            if let Err(e) = api
                .patch_status(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
            {
                tracing::warn!(pod = key_of(pod), "PodScheduled condition: {e}");
            }
        }
        self.event(pod, EventType::Warning, "FailedScheduling", message)
            .await;
    }

    async fn event(&self, pod: &Pod, type_: EventType, reason: &str, note: &str) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note.into()),
            action: "Scheduling".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &pod.object_ref(&())).await {
            tracing::debug!(pod = key_of(pod), "event: {e}");
        }
    }
}

/// The status patch that makes `current` say `PodScheduled=False`, reason `Unschedulable`,
/// with `message`; `None` when it already says so. As kube-scheduler's `UpdatePodCondition`:
/// `lastTransitionTime` is `now` when the status changes (or there was no condition), and
/// stays what it was when only the reason or message changes.
fn unschedulable_patch(
    current: Option<&PodCondition>,
    message: &str,
    now: jiff::Timestamp,
) -> Option<serde_json::Value> {
    let unchanged = current.is_some_and(|c| {
        c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
            && c.message.as_deref() == Some(message)
    });
    if unchanged {
        return None;
    }
    let mut condition = json!({
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
        "lastProbeTime": null,
    });
    match current.filter(|c| c.status == "False") {
        // The field left out of the merge keeps what the pod has.
        Some(c) => {
            if let Some(t) = &c.last_transition_time {
                condition["lastTransitionTime"] = json!(tensile_common::api::time(t.0));
            }
        }
        None => condition["lastTransitionTime"] = json!(tensile_common::api::time(now)),
    }
    Some(json!({"status": {"conditions": [condition]}}))
}

/// Whether the lower scheduler has placed the pod, as its virtual node reports it: its
/// `tensile.io/LowerPodScheduled=True`, or the pod Running.
fn placed_below(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        || status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == tensile_common::names::CONDITION_LOWER_SCHEDULED && c.status == "True")
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::FactsCache;
    use crate::place::Candidate;
    use serde_json::Value;
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use tensile_common::exclusion::Exclusions;
    use tensile_common::names;
    use tensile_common::shape::{DEFAULT_GROUP_CAP, build};

    fn pod(uid: &str, status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": "vn-b", "containers": [{"name": "c", "resources": {"requests": {"cpu": "6"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    fn lower_scheduled() -> Value {
        json!({"phase": "Pending", "conditions": [{"type": names::CONDITION_LOWER_SCHEDULED, "status": "True"}]})
    }

    fn cpu(n: &str) -> ResourceMap {
        ResourceMap::parse([(&"cpu".to_owned(), &n.to_owned())]).0
    }

    /// vn-b over two identical 8-CPU lower nodes (one frontier vector), its shape computed
    /// at `at`.
    fn virtual_node(at: jiff::Timestamp) -> Node {
        let lower = |name: &str| -> Node {
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "status": {"allocatable": {"cpu": "8", "memory": "16Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True"}]},
            }))
            .unwrap()
        };
        let shape = build(&[lower("b0"), lower("b1")], [], &[], DEFAULT_GROUP_CAP, at)
            .encode()
            .unwrap();
        serde_json::from_value(json!({
            "metadata": {"name": "vn-b",
                         "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE},
                         "annotations": {names::NODE_CAPACITY_SHAPE: shape}},
            "status": {"allocatable": {"cpu": "16", "memory": "32Gi", "pods": "220"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap()
    }

    /// Where a 6-CPU pod goes, given the ledger and vn-b's shape computed at `at`.
    fn second_pod(ledger: &Ledger, at: jiff::Timestamp) -> crate::place::Placement {
        let node = virtual_node(at);
        let cache = FactsCache::default();
        let candidates = [Candidate {
            node: &node,
            facts: cache.facts(&node),
            requested: cpu("6"),
            taken: ledger.taken("vn-b"),
        }];
        let options = Options {
            now: at,
            max_age: None,
        };
        let new: Pod = serde_json::from_value(json!({
            "metadata": {"name": "second", "namespace": "ns"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "6"}}}]},
        }))
        .unwrap();
        place(&new, &candidates, &BTreeMap::new(), &options, Score::Binpack).0
    }

    #[tokio::test(start_paused = true)]
    async fn a_placed_pod_holds_its_space_through_newer_shapes_until_placed_below_and_caught_up() {
        let bound_at = jiff::Timestamp::now();
        let mut ledger = Ledger::default();
        ledger.assume("p1", "vn-b", cpu("6"), Instant::now());
        // The lower create is slow: shapes computed after the bind keep coming, none with
        // the pod in it, and the space stays taken.
        for seconds in [5, 10, 20] {
            tokio::time::advance(Duration::from_secs(5)).await;
            assert!(!ledger.sync([&pod("p1", json!({"phase": "Pending"}))], Instant::now()));
            let shape_at = bound_at + jiff::SignedDuration::from_secs(seconds);
            assert_eq!(
                second_pod(&ledger, shape_at),
                crate::place::Placement::Unschedulable(
                    "0/1 nodes are available: 1 no lower node fits cpu=6 (largest free 2).".into()
                ),
                "a shape {seconds} s after the bind, the lower pod not created yet"
            );
        }
        // The lower scheduler placed it: the shape catches up within SHAPE_CATCH_UP.
        assert!(!ledger.sync([&pod("p1", lower_scheduled())], Instant::now()));
        assert_eq!(ledger.taken("vn-b"), [cpu("6")]);
        assert_eq!(ledger.next_release(Instant::now()), Some(SHAPE_CATCH_UP));
        tokio::time::advance(SHAPE_CATCH_UP - Duration::from_millis(1)).await;
        assert!(!ledger.sync([&pod("p1", lower_scheduled())], Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            ledger.sync([&pod("p1", lower_scheduled())], Instant::now()),
            "released, so the waiting pods are tried again"
        );
        assert!(ledger.taken("vn-b").is_empty());
        assert_eq!(ledger.next_release(Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_never_placed_below_holds_its_space_until_the_expiry() {
        let mut ledger = Ledger::default();
        ledger.assume("p1", "vn-b", cpu("6"), Instant::now());
        let pending = pod("p1", json!({"phase": "Pending"}));
        assert_eq!(ledger.next_release(Instant::now()), Some(ASSUMED_FOR));
        tokio::time::advance(ASSUMED_FOR - Duration::from_secs(1)).await;
        assert!(!ledger.sync([&pending], Instant::now()));
        assert_eq!(ledger.next_release(Instant::now()), Some(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(ledger.sync([&pending], Instant::now()));
        assert!(!ledger.contains("p1"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_pod_counts_as_placed_below_and_a_gone_or_terminal_one_leaves_at_once() {
        let mut ledger = Ledger::default();
        for uid in ["running", "gone", "failed"] {
            ledger.assume(uid, "vn-b", cpu("1"), Instant::now());
        }
        let running = pod("running", json!({"phase": "Running"}));
        let failed = pod("failed", json!({"phase": "Failed"}));
        assert!(ledger.sync([&running, &failed], Instant::now()));
        assert!(ledger.contains("running") && !ledger.contains("gone") && !ledger.contains("failed"));
        tokio::time::advance(SHAPE_CATCH_UP).await;
        assert!(ledger.sync([&running], Instant::now()));
        assert!(!ledger.contains("running"));
    }

    #[test]
    fn podscheduled_moves_its_transition_time_only_when_its_status_changes() {
        let now: jiff::Timestamp = "2024-05-01T10:00:07Z".parse().unwrap();
        let condition = |status: &str, message: &str| -> PodCondition {
            serde_json::from_value(
                json!({"type": "PodScheduled", "status": status, "reason": "Unschedulable",
                                          "message": message, "lastTransitionTime": "2024-05-01T10:00:00Z"}),
            )
            .unwrap()
        };
        let written = |patch: Option<Value>| patch.unwrap()["status"]["conditions"][0].clone();
        let first = written(unschedulable_patch(
            None,
            "0/3 nodes are available: 3 Insufficient cpu.",
            now,
        ));
        assert_eq!(first["status"], "False");
        assert_eq!(
            first["lastTransitionTime"], "2024-05-01T10:00:07Z",
            "a new condition"
        );
        let old = condition("False", "0/3 nodes are available: 3 Insufficient cpu.");
        assert_eq!(
            unschedulable_patch(Some(&old), "0/3 nodes are available: 3 Insufficient cpu.", now),
            None,
            "nothing new: no write"
        );
        let churned = written(unschedulable_patch(
            Some(&old),
            "0/3 nodes are available: 1 Insufficient cpu, 2 no lower node fits cpu=20 (largest free 8).",
            now,
        ));
        assert_eq!(
            churned["lastTransitionTime"], "2024-05-01T10:00:00Z",
            "a new message, the same status"
        );
        assert!(churned["message"].as_str().unwrap().contains("largest free 8"));
        let was_true = condition("True", "");
        assert_eq!(
            written(unschedulable_patch(
                Some(&was_true),
                "0/1 nodes are available.",
                now
            ))["lastTransitionTime"],
            "2024-05-01T10:00:07Z",
            "True to False is a transition"
        );
    }

    /// The calls a fake apiserver received: method, path and JSON body.
    type Calls = Arc<Mutex<Vec<(String, String, Value)>>>;

    /// An upper apiserver that answers every call with `{}` and keeps what was sent.
    fn recording_client() -> (kube::Client, Calls) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let log = log.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = http_body_util::BodyExt::collect(body).await?.to_bytes();
                let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                log.lock()
                    .unwrap()
                    .push((parts.method.to_string(), parts.uri.path().to_owned(), value));
                let answer = http::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")));
                Ok::<_, tower::BoxError>(answer)
            }
        });
        (kube::Client::new(service, "default"), seen)
    }

    fn scheduler(client: kube::Client) -> Scheduler {
        let (_, exclusions) = watch::channel(Arc::new(Exclusions::default()));
        let recorder = Recorder::new(
            client.clone(),
            kube::runtime::events::Reporter {
                controller: "tensile-scheduler".into(),
                instance: None,
            },
        );
        Scheduler {
            client,
            name: "tensile-scheduler".into(),
            pods: tensile_common::cache::empty(),
            nodes: tensile_common::cache::empty(),
            exclusions,
            facts: FactsCache::default(),
            score: Score::Binpack,
            max_age: None,
            metrics: Arc::new(Metrics::new(&mut prometheus_client::registry::Registry::default())),
            recorder,
            changed: Arc::new(Notify::new()),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_message_is_written_with_the_transition_time_the_pod_has() {
        let (client, seen) = recording_client();
        let scheduler = scheduler(client);
        let waiting: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                       "message": "0/1 nodes are available: 1 Insufficient cpu.",
                                       "lastTransitionTime": "2024-05-01T10:00:00Z"}]},
        }))
        .unwrap();
        tokio::time::advance(Duration::from_secs(90)).await;
        scheduler
            .unschedulable(
                &waiting,
                "0/1 nodes are available: 1 no lower node fits cpu=20 (largest free 8).",
            )
            .await;
        scheduler
            .unschedulable(&waiting, "0/1 nodes are available: 1 Insufficient cpu.")
            .await;
        let seen = seen.lock().unwrap();
        let patches: Vec<&Value> = seen
            .iter()
            .filter(|(method, path, _)| method == "PATCH" && path == "/api/v1/namespaces/ns/pods/p/status")
            .map(|(_, _, body)| body)
            .collect();
        assert_eq!(
            patches.len(),
            1,
            "the unchanged message is not written again: {seen:?}"
        );
        let condition = &patches[0]["status"]["conditions"][0];
        assert_eq!(condition["lastTransitionTime"], "2024-05-01T10:00:00Z");
        assert!(condition["message"].as_str().unwrap().contains("largest free 8"));
        let events = seen
            .iter()
            .filter(|(_, path, _)| path.contains("/events"))
            .count();
        assert_eq!(
            events, 2,
            "a FailedScheduling event (or its series) each attempt: {seen:?}"
        );
    }
}
