//! The virtual node's capacity, recomputed from watched lower state every time (never by
//! deltas, so nothing drifts and nothing is counted twice after a restart).
//!
//! * capacity = Σ allocatable of lower nodes that are Ready and schedulable;
//! * allocatable = capacity − requests of lower pods this node does not manage (its own
//!   pods are already counted by the upper scheduler against allocatable);
//! * the capacity shape ([`tensile_common::shape`]) = the lower nodes grouped by label values
//!   and taints, with each group's frontier of per-node free resources, so a scheduler can
//!   tell "fits in aggregate" from "fits on one node". When it is published is decided by
//!   [`ShapePublisher`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ResourceQuota};
use tensile_common::quantity::ResourceMap;
use tensile_common::quantity::parse_milli;
use tensile_common::shape::{self, Group, Shape, covers, usable};
use tokio::time::Instant;

use crate::model::trim::PodLoad;
use tensile_common::lower::identity::Identity;

/// How the capacity shape is formed.
#[derive(Clone, Debug, clap::Args)]
pub struct ShapeArgs {
    /// Lower node label keys the capacity shape groups nodes by (comma-separated). Stashed
    /// selectors on other keys make the multi-scheduler's filter pass the node unjudged;
    /// a key with a value per node (the hostname) would make the shape grow with the nodes.
    #[arg(long = "shape-label-keys", env = "TENSILE_SHAPE_LABEL_KEYS", value_delimiter = ',',
          default_values_t = shape::DEFAULT_LABEL_KEYS.map(String::from))]
    pub label_keys: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub capacity: ResourceMap,
    pub allocatable: ResourceMap,
    /// Lower nodes counted; under a namespace scope, served namespaces with a quota.
    pub usable_nodes: usize,
    /// Under a namespace scope: from the served namespaces' quotas, and the served namespaces
    /// whose quotas leave cpu, memory or pods unbounded (shown as no room of it).
    pub quotas: Option<Vec<String>>,
    pub os: Option<String>,
    pub arch: Option<String>,
    /// The node features every counted lower node declares ([`crate::decide::features::declared`]);
    /// none under a namespace scope, which reads no nodes.
    pub declared_features: Vec<String>,
}

fn allocatable(node: &Node) -> ResourceMap {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| ResourceMap::parse(a.iter().map(|(k, v)| (k, &v.0))).0)
        .unwrap_or_default()
}

/// What the unfinished lower pods request on each lower node, summed once per change of the
/// pods for both readers: every pod's (the shape charges each node with it) and the pods'
/// this node does not manage (the capacity: its own pods are counted by the upper scheduler).
/// Worked out again whole from the cache each time, never kept up by deltas.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeLoads {
    pub all: HashMap<String, ResourceMap>,
    pub foreign: HashMap<String, ResourceMap>,
}

impl NodeLoads {
    /// The sums over `pods`; a finished pod, or one bound to no node, holds nothing.
    pub fn of<'a>(pods: impl IntoIterator<Item = &'a PodLoad>, identity: &Identity) -> Self {
        fn charge(sums: &mut HashMap<String, ResourceMap>, node: &str, requests: &ResourceMap) {
            match sums.get_mut(node) {
                Some(sum) => sum.add(requests),
                None => {
                    sums.insert(node.to_owned(), requests.clone());
                }
            }
        }
        let mut out = NodeLoads::default();
        for pod in pods {
            let Some(node) = pod.node.as_deref().filter(|_| !pod.terminal) else {
                continue;
            };
            charge(&mut out.all, node, &pod.requests);
            if !identity.owns(&pod.metadata) {
                charge(&mut out.foreign, node, &pod.requests);
            }
        }
        out
    }
}

/// Computes the capacity from the lower nodes and what the lower pods request on each.
pub fn compute<'a>(nodes: impl IntoIterator<Item = &'a Node>, loads: &NodeLoads) -> Capacity {
    let mut out = Capacity::default();
    let mut foreign = ResourceMap::default();
    let mut used = Vec::new();
    for node in nodes {
        if !usable(node) {
            continue;
        }
        used.push(node);
        out.capacity.add(&allocatable(node));
        out.usable_nodes += 1;
        if out.os.is_none() {
            let labels = node.metadata.labels.as_ref();
            out.os = labels.and_then(|l| l.get("kubernetes.io/os")).cloned();
            out.arch = labels.and_then(|l| l.get("kubernetes.io/arch")).cloned();
        }
        if let Some(held) = loads
            .foreign
            .get(node.metadata.name.as_deref().unwrap_or_default())
        {
            foreign.add(held);
        }
    }
    out.allocatable = out.capacity.clone();
    out.allocatable.saturating_sub(&foreign);
    out.declared_features = crate::decide::features::declared(used);
    out
}

/// The resource a ResourceQuota `hard` key bounds the pods' requests of: `requests.<name>`
/// and the bare `cpu`, `memory`, `ephemeral-storage` are requests, `pods` the pod count;
/// limits, object counts and claims bound nothing a node shows.
fn quota_resource(key: &str) -> Option<&str> {
    match key {
        "pods" | "cpu" | "memory" | "ephemeral-storage" => Some(key),
        _ => key.strip_prefix("requests.").filter(|r| *r != "storage"),
    }
}

/// The room of the served namespaces `served`, from their unscoped ResourceQuotas and the load of every
/// unfinished pod in them: per namespace, the tightest `hard` of each resource, less what pods
/// this node does not manage request there (its own are counted upstream). A resource no
/// quota of a namespace bounds adds nothing of that namespace (its room is unknown, never
/// assumed); the namespaces that leave cpu, memory or pods unbounded are listed.
pub fn compute_from_quotas<'a>(
    served: &[String],
    quotas: impl IntoIterator<Item = &'a ResourceQuota>,
    pods: impl IntoIterator<Item = &'a PodLoad>,
    identity: &Identity,
) -> Capacity {
    let mut hard: BTreeMap<&str, ResourceMap> = BTreeMap::new();
    for quota in quotas {
        let ns = quota.metadata.namespace.as_deref().unwrap_or_default();
        let Some(ns) = served.iter().find(|s| *s == ns) else {
            continue;
        };
        // A scoped quota (BestEffort, Terminating, a priority class…) bounds only the pods
        // it matches, not the namespace's room.
        let spec = quota.spec.as_ref();
        if spec
            .is_some_and(|s| s.scopes.as_ref().is_some_and(|v| !v.is_empty()) || s.scope_selector.is_some())
        {
            continue;
        }
        let Some(limits) = spec.and_then(|s| s.hard.as_ref()) else {
            continue;
        };
        let room = hard.entry(ns.as_str()).or_default();
        for (key, value) in limits {
            let (Some(resource), Ok(v)) = (quota_resource(key), parse_milli(&value.0)) else {
                continue;
            };
            let tightest = room.0.get(resource).map_or(v, |have| (*have).min(v));
            room.0.insert(resource.to_owned(), tightest);
        }
    }
    let mut foreign: BTreeMap<&str, ResourceMap> = BTreeMap::new();
    for pod in pods {
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        if pod.terminal || identity.owns(&pod.metadata) || !hard.contains_key(ns) {
            continue;
        }
        if let Some((ns, _)) = hard.get_key_value(ns) {
            foreign.entry(ns).or_default().add(&pod.requests);
        }
    }
    let mut out = Capacity {
        quotas: Some(Vec::new()),
        ..Default::default()
    };
    for ns in served {
        let Some(room) = hard.get(ns.as_str()) else {
            out.quotas.get_or_insert_default().push(ns.clone());
            continue;
        };
        out.usable_nodes += 1;
        if ["cpu", "memory", "pods"].iter().any(|r| !room.0.contains_key(*r)) {
            out.quotas.get_or_insert_default().push(ns.clone());
        }
        out.capacity.add(room);
        let mut free = room.clone();
        if let Some(used) = foreign.get(ns.as_str()) {
            free.saturating_sub(used);
        }
        out.allocatable.add(&free);
    }
    out
}

/// Least time between two writes of the shape annotation: a busy lower cluster changes its
/// shape on every pod, and every Node watcher receives each write.
pub const SHAPE_MIN_INTERVAL: Duration = Duration::from_secs(5);
/// An unchanged shape is written again once its `at` is this old, so readers can tell a
/// quiet lower cluster from a virtual node that stopped publishing. The multi-scheduler's
/// `--shape-max-age` (15 min) allows three missed refreshes.
pub const SHAPE_REFRESH: Duration = Duration::from_secs(300);
/// Least time between two bumps of the shape generation label: each bump sends every
/// unschedulable pod of the upper scheduler back to its queue.
pub const GENERATION_MIN_INTERVAL: Duration = Duration::from_secs(10);
/// Least time between the write of a grown shape and the bump that announces it. The
/// upper scheduler retries its pods on the bump and asks the extender at once, which reads
/// Nodes from a watch of its own: in the same write, the retry could meet the extender
/// before its watch shows the shape, and fail with nothing left to wake the pod.
pub const BUMP_AFTER_SHAPE: Duration = Duration::from_secs(1);

/// True when `new` can hold some pod `old` could not: a group appeared, some frontier
/// vector of a group is covered by no vector of the same group before, or a group's
/// largest free amount of some resource grew.
pub fn grew(old: &Shape, new: &Shape) -> bool {
    let same_group = |a: &Group, b: &Group| a.labels == b.labels && a.taints == b.taints;
    new.groups.iter().any(|g| {
        let Some(before) = old.groups.iter().find(|o| same_group(o, g)) else {
            return g.count > 0;
        };
        let (Ok(now), Ok(then)) = (g.free_maps(), before.free_maps()) else {
            return true;
        };
        let (Ok(reach_now), Ok(reach_then)) = (reach(g, &now), reach(before, &then)) else {
            return true;
        };
        now.iter().any(|v| !then.iter().any(|t| covers(t, v))) || !covers(&reach_then, &reach_now)
    })
}

/// The largest free amount of each resource in a group: its published maximum when cut,
/// else the frontier's.
fn reach(group: &Group, frontier: &[ResourceMap]) -> Result<ResourceMap, tensile_common::quantity::Error> {
    if let Some(max) = group.max_map()? {
        return Ok(max);
    }
    let mut out = ResourceMap::default();
    for v in frontier {
        out.max_with(v);
    }
    Ok(out)
}

/// What one round writes of the shape: the annotation, the generation label, or both in
/// one patch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShapeWrite {
    pub annotation: bool,
    pub bump: bool,
    /// The annotation written shows a shape that grew: a bump is owed for it.
    pub grows: bool,
}

impl ShapeWrite {
    pub fn any(&self) -> bool {
        self.annotation || self.bump
    }
}

/// When the shape is written, apart from the API calls. The shape is compared without its
/// `at` with the one last written (or, before the first write, the one the Node shows), so
/// the annotation changes only when the lower nodes do, at most every
/// [`SHAPE_MIN_INTERVAL`], and otherwise every [`SHAPE_REFRESH`]. A shape that grew is
/// announced by a later bump of the generation label, at least [`BUMP_AFTER_SHAPE`] after
/// it and [`GENERATION_MIN_INTERVAL`] after the previous bump.
#[derive(Debug, Default)]
pub struct ShapePublisher {
    /// The last shape written, without its `at`, and when (wall clock of its `at`).
    last: Option<(Shape, jiff::Timestamp)>,
    last_write: Option<Instant>,
    last_bump: Option<Instant>,
    /// When the last grown shape not yet announced by a bump was written.
    grown_at: Option<Instant>,
    /// The generation label's value last written.
    generation: u64,
}

fn without_time(shape: &Shape) -> Shape {
    Shape {
        at: None,
        ..shape.clone()
    }
}

fn since(t: Option<Instant>, now: Instant, min: Duration) -> bool {
    t.is_none_or(|t| now.duration_since(t) >= min)
}

impl ShapePublisher {
    /// Whether a round at `now` could write anything: the annotation, not within
    /// [`SHAPE_MIN_INTERVAL`] of the last write, or an owed bump. Until then the shape is
    /// not worth working out (a growth it would show is noticed at the next round that may
    /// write).
    pub fn may_write(&self, now: Instant) -> bool {
        since(self.last_write, now, SHAPE_MIN_INTERVAL) || self.bump_due(now)
    }

    fn bump_due(&self, now: Instant) -> bool {
        self.grown_at
            .is_some_and(|g| now.duration_since(g) >= BUMP_AFTER_SHAPE)
            && since(self.last_bump, now, GENERATION_MIN_INTERVAL)
    }

    /// How long until an owed bump may be written (`None`: none owed).
    pub fn bump_due_in(&self, now: Instant) -> Option<Duration> {
        let grown = self.grown_at?;
        let at =
            (grown + BUMP_AFTER_SHAPE).max(self.last_bump.map_or(grown, |b| b + GENERATION_MIN_INTERVAL));
        Some(at.saturating_duration_since(now))
    }

    /// The decision for `computed` (whose `at` is now, `wall`), given what the upper Node
    /// shows (`published`), at monotonic time `now`.
    pub fn round(
        &mut self,
        computed: &Shape,
        published: Option<&Shape>,
        now: Instant,
        wall: jiff::Timestamp,
    ) -> ShapeWrite {
        let content = without_time(computed);
        let baseline = self.last.clone().or_else(|| {
            published.map(|p| {
                let at = p.at.as_deref().and_then(|t| t.parse().ok());
                (without_time(p), at.unwrap_or(jiff::Timestamp::UNIX_EPOCH))
            })
        });
        let (changed, stale, grows) = match &baseline {
            None => (true, true, false),
            Some((shape, at)) => {
                let refresh = jiff::SignedDuration::from_secs(SHAPE_REFRESH.as_secs() as i64);
                (
                    *shape != content,
                    wall.duration_since(*at) >= refresh,
                    grew(shape, &content),
                )
            }
        };
        let annotation = since(self.last_write, now, SHAPE_MIN_INTERVAL) && (changed || stale);
        ShapeWrite {
            annotation,
            bump: self.bump_due(now),
            grows: annotation && grows,
        }
    }

    /// The generation label's next value, past both the one the Node shows (`shown`) and
    /// the one last written (the watch may not show it yet).
    pub fn next_generation(&self, shown: Option<&str>) -> u64 {
        let shown = shown.and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        shown.max(self.generation) + 1
    }

    /// `write` was made at `now`: with `computed` as the annotation when it says so, and the
    /// generation label set to `bumped` if given.
    pub fn written(
        &mut self,
        write: ShapeWrite,
        computed: &Shape,
        bumped: Option<u64>,
        now: Instant,
        wall: jiff::Timestamp,
    ) {
        if let Some(generation) = bumped {
            self.generation = generation;
            self.last_bump = Some(now);
            self.grown_at = None;
        }
        if write.annotation {
            self.last = Some((without_time(computed), wall));
            self.last_write = Some(now);
        }
        if write.grows {
            self.grown_at = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tensile_common::names;

    fn node(name: &str, cpu: &str, ready: bool, unschedulable: bool) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
            "spec": {"unschedulable": unschedulable},
            "status": {
                "capacity": {"cpu": "64", "memory": "64Gi", "pods": "110"},
                "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110", "example.com/gpu": "2"},
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn pod(node: &str, cpu: &str, ours: bool, phase: &str) -> PodLoad {
        let labels = if ours {
            json!({names::MARK_CLUSTER: "c", names::MARK_NODE: "vn"})
        } else {
            json!({})
        };
        PodLoad::of(
            &serde_json::from_value(json!({
                "metadata": {"name": "p", "labels": labels},
                "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
                "status": {"phase": phase},
            }))
            .unwrap(),
        )
    }

    fn id() -> Identity {
        Identity {
            cluster_id: "c".into(),
            node: "vn".into(),
        }
    }

    fn quota(ns: &str, hard: serde_json::Value) -> ResourceQuota {
        serde_json::from_value(json!({"metadata": {"name": "q", "namespace": ns}, "spec": {"hard": hard}}))
            .unwrap()
    }

    fn in_namespace(ns: &str, mut pod: PodLoad) -> PodLoad {
        pod.metadata.namespace = Some(ns.into());
        pod
    }

    #[test]
    fn a_namespace_scope_shows_the_tightest_quota_less_foreign_pods_and_names_what_is_unbounded() {
        let served = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let quotas = [
            // Two quotas in a: the tighter of each resource holds; limits and counts bound
            // nothing a node shows.
            quota(
                "a",
                json!({"requests.cpu": "8", "requests.memory": "16Gi", "pods": "20", "limits.cpu": "1"}),
            ),
            quota(
                "a",
                json!({"cpu": "6", "count/configmaps": "3", "requests.nvidia.com/gpu": "2"}),
            ),
            // b bounds cpu only; c has no quota; d is not served.
            quota("b", json!({"requests.cpu": "2"})),
            // A scoped quota bounds only the pods it matches.
            serde_json::from_value(json!({"metadata": {"name": "be", "namespace": "a"},
                "spec": {"hard": {"pods": "0"}, "scopes": ["BestEffort"]}}))
            .unwrap(),
            quota("d", json!({"requests.cpu": "100"})),
        ];
        let pods = [
            in_namespace("a", pod("n1", "1", false, "Running")),
            in_namespace("a", pod("n1", "3", true, "Running")),
            in_namespace("a", pod("n1", "2", false, "Succeeded")),
            in_namespace("b", pod("n2", "5", false, "Running")),
            in_namespace("c", pod("n2", "1", false, "Running")),
        ];
        let cap = compute_from_quotas(&served, &quotas, &pods, &id());
        assert_eq!(cap.capacity.to_strings()["cpu"], "8", "6 in a, 2 in b");
        assert_eq!(cap.capacity.to_strings()["memory"], "17179869184");
        assert_eq!(cap.capacity.to_strings()["pods"], "20");
        assert_eq!(cap.capacity.to_strings()["nvidia.com/gpu"], "2");
        assert!(
            !cap.capacity.0.contains_key("limits.cpu") && !cap.capacity.0.contains_key("count/configmaps")
        );
        // a: 6 less the foreign running pod's 1 (ours and finished ones are not foreign);
        // b: 2 less 5, never below zero.
        assert_eq!(cap.allocatable.to_strings()["cpu"], "5");
        assert_eq!(cap.allocatable.to_strings()["pods"], "19");
        assert_eq!(cap.usable_nodes, 2);
        assert_eq!(cap.quotas, Some(vec!["b".to_owned(), "c".to_owned()]));
        let (status, reason, message) = crate::decide::node::room_condition_for_tests(&cap);
        assert_eq!((status, reason), ("True", "ServedNamespaceQuotas"));
        assert!(
            message.contains("b, c bound(s) no cpu, memory or pods"),
            "{message}"
        );

        let none = compute_from_quotas(&served, &[], &pods, &id());
        assert_eq!(none.usable_nodes, 0);
        assert!(none.allocatable.0.is_empty(), "no quota: no room, never assumed");
        assert_eq!(
            crate::decide::node::room_condition_for_tests(&none).1,
            "NoServedNamespaceQuota"
        );
    }

    #[test]
    fn capacity_counts_usable_allocatable_and_subtracts_only_foreign_pods() {
        let nodes = [
            node("a", "4", true, false),
            node("b", "8", true, false),
            node("down", "16", false, false),
            node("cordoned", "16", true, true),
        ];
        let pods = [
            pod("a", "1", false, "Running"),
            pod("b", "2", true, "Running"),
            pod("b", "3", false, "Succeeded"),
            pod("down", "5", false, "Running"),
            pod("", "7", false, "Pending"),
        ];
        let c = compute(&nodes, &NodeLoads::of(&pods, &id()));
        assert_eq!(c.usable_nodes, 2);
        assert_eq!(
            c.capacity.get("cpu"),
            12_000,
            "allocatable, not capacity, of usable nodes"
        );
        assert_eq!(
            c.capacity.get("example.com/gpu"),
            4_000,
            "extended resources carried"
        );
        assert_eq!(
            c.allocatable.get("cpu"),
            11_000,
            "foreign running pod subtracted, ours not"
        );
        assert_eq!(c.allocatable.get("pods"), 219_000);
        assert_eq!(c.os.as_deref(), Some("linux"));
    }

    #[test]
    fn the_same_state_gives_the_same_answer() {
        let nodes = [node("a", "4", true, false)];
        let pods = [pod("a", "1", false, "Running")];
        let loads = || NodeLoads::of(&pods, &id());
        assert_eq!(compute(&nodes, &loads()), compute(&nodes, &loads()));
    }

    fn shape_of(cpus: &[&str]) -> Shape {
        let nodes: Vec<Node> = cpus
            .iter()
            .enumerate()
            .map(|(i, c)| node(&format!("n{i}"), c, true, false))
            .collect();
        shape::build(&nodes, [], &[], shape::DEFAULT_GROUP_CAP, wall(0))
    }

    fn wall(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    #[test]
    fn a_shape_grows_when_a_bigger_node_or_a_new_group_appears_not_when_it_shrinks() {
        let small = shape_of(&["2", "2"]);
        assert!(grew(&small, &shape_of(&["2", "4"])), "a bigger node");
        assert!(!grew(&shape_of(&["2", "4"]), &small), "a node filled up");
        assert!(
            !grew(&small, &shape_of(&["2", "2", "2"])),
            "one more node of the same size"
        );
        let mut tainted = shape_of(&["2"]);
        tainted.groups[0].taints =
            vec![serde_json::from_value(json!({"key": "gpu", "effect": "NoSchedule"})).unwrap()];
        let mut both = small.clone();
        both.groups.extend(tainted.groups);
        assert!(grew(&small, &both), "a new group");
    }

    const WRITE: ShapeWrite = ShapeWrite {
        annotation: true,
        bump: false,
        grows: false,
    };

    #[test]
    fn the_shape_is_written_on_change_at_most_every_few_seconds_and_refreshed_rarely() {
        let t0 = Instant::now();
        let after = |s: u64| t0 + Duration::from_secs(s);
        let mut p = ShapePublisher::default();
        let a = shape_of(&["2", "2"]);
        let first = p.round(&a, None, t0, wall(0));
        assert_eq!(first, WRITE);
        p.written(first, &a, None, t0, wall(0));
        // The same content a second later, only `at` moved: nothing to write.
        let mut later = a.clone();
        later.at = Some(tensile_common::api::time(wall(1)));
        assert_eq!(
            p.round(&later, Some(&a), after(1), wall(1)),
            ShapeWrite::default()
        );
        // A change within the minimum interval waits (the shape need not even be worked
        // out); after it, it is written.
        let b = shape_of(&["2"]);
        assert!(!p.may_write(after(2)) && p.may_write(after(5)));
        assert!(!p.round(&b, Some(&a), after(2), wall(2)).annotation);
        let shrunk = p.round(&b, Some(&a), after(5), wall(5));
        assert_eq!(shrunk, WRITE, "a shrinking shape owes no bump");
        p.written(shrunk, &b, None, after(5), wall(5));
        assert_eq!(p.bump_due_in(after(5)), None);
        // Quiet: the next write is the refresh.
        let quiet = SHAPE_REFRESH.as_secs() as i64;
        assert!(!p.round(&b, Some(&b), after(5 + 60), wall(5 + 60)).annotation);
        assert!(
            p.round(&b, Some(&b), after(5 + quiet as u64), wall(5 + quiet))
                .annotation
        );
    }

    #[test]
    fn a_grown_shape_is_announced_by_a_later_bump_at_most_every_ten_seconds_and_never_lost() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut p = ShapePublisher::default();
        let (small, big, bigger) = (shape_of(&["2"]), shape_of(&["4"]), shape_of(&["8"]));
        let first = p.round(&small, None, t0, wall(0));
        p.written(first, &small, None, t0, wall(0));
        // It grows: the annotation alone, the bump owed for a second later.
        let grown = p.round(&big, None, at(5_000), wall(5));
        assert_eq!(
            grown,
            ShapeWrite {
                annotation: true,
                bump: false,
                grows: true
            }
        );
        p.written(grown, &big, None, at(5_000), wall(5));
        assert_eq!(p.bump_due_in(at(5_000)), Some(BUMP_AFTER_SHAPE));
        assert!(!p.may_write(at(5_500)) && !p.round(&big, None, at(5_500), wall(5)).any());
        assert!(
            p.may_write(at(6_000)),
            "the owed bump wakes a round within the interval"
        );
        let bump = p.round(&big, None, at(6_000), wall(6));
        assert_eq!(
            bump,
            ShapeWrite {
                annotation: false,
                bump: true,
                grows: false
            },
            "the label alone, the shape already written"
        );
        assert_eq!(p.next_generation(None), 1);
        p.written(bump, &big, Some(1), at(6_000), wall(6));
        assert_eq!(p.bump_due_in(at(6_000)), None);
        // Grows again 4 s later: written, and its bump waits for the ten seconds.
        let again = p.round(&bigger, None, at(11_000), wall(11));
        assert!(again.annotation && again.grows && !again.bump);
        p.written(again, &bigger, None, at(11_000), wall(11));
        assert_eq!(p.bump_due_in(at(11_000)), Some(Duration::from_secs(5)));
        assert!(!p.round(&bigger, None, at(15_000), wall(15)).any());
        let owed = p.round(&bigger, None, at(16_000), wall(16));
        assert!(owed.bump && !owed.annotation, "the bump still owed");
        assert_eq!(p.next_generation(Some("1")), 2);
        p.written(owed, &bigger, Some(2), at(16_000), wall(16));
        assert_eq!(
            p.round(&bigger, None, at(30_000), wall(30)),
            ShapeWrite::default()
        );
        assert_eq!(
            p.next_generation(Some("1")),
            3,
            "the watch lags behind our own write"
        );
        assert_eq!(p.next_generation(Some("7")), 8);
    }

    #[test]
    fn after_a_restart_an_unchanged_published_shape_is_left_alone() {
        let t0 = Instant::now();
        let a = shape_of(&["2", "4"]);
        let mut p = ShapePublisher::default();
        let mut now = a.clone();
        now.at = Some(tensile_common::api::time(wall(30)));
        assert_eq!(p.round(&now, Some(&a), t0, wall(30)), ShapeWrite::default());
        // A published first-form list is replaced by the current form.
        let old = Shape::decode(r#"[{"cpu":"4","memory":"8Gi","pods":"110"}]"#).unwrap();
        let mut p = ShapePublisher::default();
        assert!(p.round(&now, Some(&old), t0, wall(30)).annotation);
    }

    #[test]
    fn shape_label_keys_default_to_where_and_what_a_node_is_and_take_a_comma_list() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            shape: ShapeArgs,
        }
        use clap::Parser as _;
        let default = Cli::try_parse_from(["virtual-node"]).unwrap();
        assert_eq!(default.shape.label_keys, shape::DEFAULT_LABEL_KEYS);
        let given = Cli::try_parse_from([
            "virtual-node",
            "--shape-label-keys=example.com/pool,kubernetes.io/arch",
        ])
        .unwrap();
        assert_eq!(given.shape.label_keys, ["example.com/pool", "kubernetes.io/arch"]);
    }
}
