//! Rebalancing (`--rebalance`), pure: the pods of the virtual nodes, the nodes, the
//! exclusion records, what was moved before and the time in; which pods to evict now, which
//! refusals to remember, and which workloads are held back and why, out.
//!
//! When a lower cluster fails, its virtual node goes NotReady and the upper cluster moves
//! its pods to the others; when it recovers, nothing brings them back. A workload is moved
//! back when a constraint of its own is violated only because of where its pods happen to
//! be:
//!
//! - **topology spread** across virtual nodes (any `topologyKey` the virtual nodes carry,
//!   `ScheduleAnyway` included), with the skew kube-scheduler's PodTopologySpread computes
//!   ([`Spread`]): the largest count of matching pods in a domain, less the global minimum,
//!   exceeds `maxSkew`;
//! - **preferred node affinity**: a pod runs on a virtual node whose preference weight is
//!   lower than another Ready node's (a workload that prefers cluster A returns to A),
//!   unless the move would break a spread constraint.
//!
//! For both, the target node must have been Ready for the stabilization window (a node
//! that flaps never pulls pods), must hold the pod by its capacity shape (the one fit
//! predicate, [`crate::fit`]: a move never lands a pod where it would be refused), must
//! not be excluded for the workload by a record of the descheduler, and must not have
//! refused the workload after an earlier rebalance (below). Only pods of a ReplicaSet,
//! StatefulSet or ReplicationController move (their controller recreates them; the upper
//! scheduler places the replacement, steered by the same constraint).
//!
//! **Budget.** A workload moves only while fewer than `max_unavailable` of its pods are
//! unavailable (Pending, not Ready or being deleted), and only once the pod it moved last
//! is replaced by a Ready pod (created after the eviction), so a moved pod is replaced
//! before the next one goes; at most `max_owners` workloads are in flight at once and
//! `max_per_round` pods go per round; the eviction API enforces the workload's
//! PodDisruptionBudget. **No flapping.** A workload's episode ends when it is balanced, or
//! after as many moves as it has pods; then it is not moved again for the cool-down.
//!
//! **Refused after a rebalance.** The shape cannot see every reason a lower cluster refuses
//! a pod (an exhausted ResourceQuota, a LimitRange, Pod Security, an admission webhook).
//! When the replacement of a pod rebalancing moved is refused there, the refused-pod rules
//! exclude that node for the workload and move it back; rebalancing then remembers the
//! refusal in an exclusion record of its own ([`refusals_key`]), which outlives the
//! exclusion, the cool-down and a restart: the workload is not moved toward that node
//! again until the node turns Ready anew after the refusal, the workload's pod template
//! changes (a Deployment's new ReplicaSet is a workload of its own; a StatefulSet's new
//! revision has a record of its own), or [`REFUSAL_MEMORY`] has passed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{Node, Pod, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use tensile_common::exclusion::{Exclusions, Record};

use crate::decide;
use crate::fit::{self, Take};

/// The controllers whose pods rebalancing moves: they recreate an evicted pod.
const MOVABLE: &[&str] = &["ReplicaSet", "StatefulSet", "ReplicationController"];

/// How long a refusal after a rebalance is remembered at most: a lower cluster whose quota
/// was raised is tried again a day later at the latest, and the record of a workload that
/// is gone is swept.
pub const REFUSAL_MEMORY: SignedDuration = SignedDuration::from_hours(24);

/// The key of the exclusion record in which rebalancing remembers the refusals of workload
/// `uid` whose pods are of template revision `revision` (empty: the workload is its own
/// revision, as a ReplicaSet is): its `nodes` map each refusing virtual node to when the
/// refusal is forgotten, [`REFUSAL_MEMORY`] after it. No pod has that key, so the webhook
/// and the multi-scheduler never apply it; the refused-pod rules never write it.
pub fn refusals_key(uid: &str, revision: &str) -> String {
    if revision.is_empty() {
        format!("{uid}-rebalance")
    } else {
        format!("{uid}-rebalance-{revision}")
    }
}

/// The knobs, from the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pods of one workload that may be unavailable when one more is evicted.
    pub max_unavailable: u32,
    /// How long a virtual node must have been Ready before pods move to it.
    pub stabilization: Duration,
    /// How long a workload is left alone after an episode of moves.
    pub cooldown: Duration,
    /// Pods evicted per round (`0`: none).
    pub max_per_round: u32,
    /// Workloads with moves in flight at once.
    pub max_owners: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_unavailable: 1,
            stabilization: Duration::from_secs(60),
            cooldown: Duration::from_secs(300),
            max_per_round: 5,
            max_owners: 1,
        }
    }
}

/// Why a pod moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Its workload's pods are spread over `key` with a skew above `max_skew`.
    Spread { key: String, skew: i32, max_skew: i32 },
    /// It prefers `node` (weight `to`) over where it runs (weight `from`).
    Preferred { from: i32, to: i32 },
}

impl Reason {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Reason::Spread { .. } => "spread",
            Reason::Preferred { .. } => "preferred",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Spread { key, skew, max_skew } => {
                write!(
                    f,
                    "topology spread over {key} has skew {skew}, above maxSkew {max_skew}"
                )
            }
            Reason::Preferred { from, to } => write!(
                f,
                "its preferred node affinity weighs {to} there against {from} where it runs"
            ),
        }
    }
}

/// One pod to evict.
#[derive(Clone, Debug)]
pub struct Rebalance {
    pub pod: Arc<Pod>,
    /// The controller's UID.
    pub workload: String,
    /// `ReplicaSet/web-7d4b9`.
    pub owner: String,
    pub reason: Reason,
    /// The virtual node the pod should go to (or one of its domain).
    pub target: String,
    /// The nodes the replacement may land on (the target's domain, or the nodes it
    /// prefers as much): a refusal on one of them after the move is remembered.
    pub toward: BTreeSet<String>,
    /// The UIDs of the workload's pods when it was judged: none of them is the replacement.
    pub known: BTreeSet<String>,
}

/// A refusal after a rebalance to remember: the record of `key` ([`refusals_key`]) becomes
/// `record`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remember {
    pub key: String,
    pub record: Record,
    /// `Kind/name` of the workload.
    pub owner: String,
    /// The virtual node that refused it.
    pub node: String,
}

/// Why a workload that would move does not, this round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// `n` of its pods are unavailable: the last move is not replaced yet.
    Unavailable(u32),
    /// The target has not been Ready for the stabilization window yet.
    Stabilizing(String),
    /// It was rebalanced lately.
    CoolingDown,
    /// No target holds the pod by its capacity shape, or the records exclude it.
    NoFit,
    /// Enough workloads are in flight, or the round's cap is reached.
    Budget,
    /// The pod it moved last is not replaced by a Ready pod yet.
    Replacing,
    /// Its last eviction was refused (its PodDisruptionBudget allows none now).
    Disruption,
    /// The lower cluster of the node it would go to refused it after an earlier rebalance,
    /// and nothing changed since.
    RefusedBelow(String),
}

impl Held {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Held::Unavailable(_) => "unavailable",
            Held::Stabilizing(_) => "stabilizing",
            Held::CoolingDown => "cooling_down",
            Held::NoFit => "no_fit",
            Held::Budget => "budget",
            Held::Replacing => "replacing",
            Held::Disruption => "disruption_budget",
            Held::RefusedBelow(_) => "refused_below",
        }
    }

    pub const LABELS: [&'static str; 8] = [
        "unavailable",
        "stabilizing",
        "cooling_down",
        "no_fit",
        "budget",
        "replacing",
        "disruption_budget",
        "refused_below",
    ];
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Unavailable(n) => write!(f, "{n} of its pods are unavailable"),
            Held::Stabilizing(node) => write!(f, "{node} has not been Ready for the stabilization window"),
            Held::CoolingDown => write!(f, "it was rebalanced within the cool-down"),
            Held::NoFit => write!(f, "no node it should go to holds it by its capacity shape"),
            Held::Budget => write!(f, "the round's budget is spent"),
            Held::Replacing => write!(f, "the pod it moved last is not replaced by a Ready pod yet"),
            Held::Disruption => write!(f, "its PodDisruptionBudget refused the last eviction"),
            Held::RefusedBelow(node) => write!(
                f,
                "the lower cluster of {node} refused it after a rebalance, and neither {node} turned Ready anew nor its template changed since"
            ),
        }
    }
}

/// What one round decides.
#[derive(Debug, Default)]
pub struct Plan {
    pub moves: Vec<Rebalance>,
    /// Workloads (UID, `Kind/name`) held back, and why.
    pub held: Vec<(String, String, Held)>,
    /// Refusals after rebalances to write down.
    pub remember: Vec<Remember>,
}

/// A workload's current episode of moves.
#[derive(Clone, Debug, Default)]
struct Episode {
    moves: u32,
    cool_until: Option<Timestamp>,
    /// When its last pod was evicted, and the pods it had then, until a pod of it that is
    /// none of those and was created since is Ready.
    awaiting: Option<(Timestamp, BTreeSet<String>)>,
    /// Until when it is not tried: its last eviction was refused (a PodDisruptionBudget).
    refused_until: Option<Timestamp>,
    /// When its last pod was evicted, and the nodes its replacement may land on: a refusal
    /// on one of them since is one to remember.
    toward: Option<(Timestamp, BTreeSet<String>)>,
}

/// How long a moved pod's replacement is awaited before the workload may move again
/// anyway (its controller may have been scaled down meanwhile).
const REPLACEMENT_TIMEOUT: SignedDuration = SignedDuration::from_secs(300);

/// What rebalancing remembers between rounds, in memory: episodes and cool-downs (a
/// restart forgets them, and the budget still holds since it is read from the pods). The
/// refusals after rebalances are remembered in exclusion records instead.
#[derive(Debug, Default)]
pub struct Memory {
    episodes: HashMap<String, Episode>,
}

impl Memory {
    /// Records that the pod of move `m` was evicted at `now`.
    pub fn moved(&mut self, m: &Rebalance, now: Timestamp) {
        let e = self.episodes.entry(m.workload.clone()).or_default();
        e.moves += 1;
        e.awaiting = Some((now, m.known.clone()));
        e.toward = Some((now, m.toward.clone()));
        e.refused_until = None;
    }

    /// Records that the eviction of a pod of `workload` was refused (429: its
    /// PodDisruptionBudget allows none now): it is not tried again before `until`, and
    /// other workloads go meanwhile.
    pub fn refused(&mut self, workload: &str, until: Timestamp) {
        self.episodes
            .entry(workload.to_owned())
            .or_default()
            .refused_until = Some(until);
    }

    /// Forgets workloads that are gone, and those whose cool-down is over.
    fn forget(&mut self, now: Timestamp, live: &BTreeSet<&str>) {
        self.episodes
            .retain(|uid, e| live.contains(uid.as_str()) && e.cool_until.is_none_or(|until| until > now));
    }
}

struct Workload<'a> {
    uid: String,
    kind: String,
    name: String,
    owner: String,
    pods: Vec<&'a Arc<Pod>>,
}

impl Workload<'_> {
    /// Its pod template revision as its pods say (`controller-revision-hash`, the newest
    /// name when they differ mid-rollout); empty for a ReplicaSet, whose UID is its
    /// template's.
    fn revision(&self) -> String {
        if self.kind == "ReplicaSet" {
            return String::new();
        }
        self.pods
            .iter()
            .filter_map(|p| p.metadata.labels.as_ref()?.get("controller-revision-hash"))
            .max()
            .cloned()
            .unwrap_or_default()
    }

    fn refusals_key(&self) -> String {
        refusals_key(&self.uid, &self.revision())
    }
}

fn controller(pod: &Pod) -> Option<(&str, &str, &str)> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| (o.kind.as_str(), o.name.as_str(), o.uid.as_str()))
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

fn terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// A pod rebalancing may evict: available, and not protected (opted out, system-critical,
/// pinned to its node by a volume…).
fn movable(pod: &Pod, pod_settings: &decide::Settings) -> bool {
    available(pod) && decide::protected(pod, pod_settings).is_ok()
}

/// Running, Ready and not being deleted.
fn available(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    !terminating(pod)
        && status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

fn labels(node: &Node) -> &BTreeMap<String, String> {
    node.metadata.labels.as_ref().unwrap_or(&NO_LABELS)
}

fn pod_labels(pod: &Pod) -> &BTreeMap<String, String> {
    pod.metadata.labels.as_ref().unwrap_or(&NO_LABELS)
}

/// The pods of one namespace, indexed by label pair: a spread constraint's count reads the
/// pods its selector's `matchLabels` name, not every pod of the namespace, so a round costs
/// the pods of each workload rather than workloads times pods.
#[derive(Default)]
struct Namespace<'a> {
    pods: Vec<&'a Arc<Pod>>,
    /// Label key → value → the pods carrying that pair.
    by_label: HashMap<&'a str, HashMap<&'a str, Vec<&'a Arc<Pod>>>>,
}

impl<'a> Namespace<'a> {
    fn add(&mut self, pod: &'a Arc<Pod>) {
        self.pods.push(pod);
        for (k, v) in pod.metadata.labels.iter().flatten() {
            self.by_label
                .entry(k.as_str())
                .or_default()
                .entry(v.as_str())
                .or_default()
                .push(pod);
        }
    }

    /// The pods `selector` may select: those of its rarest `matchLabels` pair, or every
    /// pod when it has none.
    fn candidates(&self, selector: &LabelSelector) -> &[&'a Arc<Pod>] {
        let Some(pairs) = selector.match_labels.as_ref().filter(|m| !m.is_empty()) else {
            return &self.pods;
        };
        pairs
            .iter()
            .map(|(k, v)| {
                self.by_label
                    .get(k.as_str())
                    .and_then(|values| values.get(v.as_str()))
                    .map_or(&[][..], Vec::as_slice)
            })
            .min_by_key(|pods| pods.len())
            .unwrap_or(&self.pods)
    }
}

/// When the node turned Ready (`None`: it is not Ready).
fn ready_since(node: &Node) -> Option<Timestamp> {
    node.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| c.type_ == "Ready" && c.status == "True")
        .map(|c| c.last_transition_time.as_ref().map_or(Timestamp::MIN, |t| t.0))
}

/// The pod's preferred node affinity weight on `node`.
fn preference(pod: &Pod, node: &Node) -> i32 {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let labels = labels(node);
    pod.spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| na.preferred_during_scheduling_ignored_during_execution.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| {
            tensile_common::fit::terms_match(Some(std::slice::from_ref(&t.preference)), Some(name), labels)
        })
        .map(|t| t.weight)
        .sum()
}

fn constraints(pod: &Pod) -> &[TopologySpreadConstraint] {
    pod.spec
        .as_ref()
        .and_then(|s| s.topology_spread_constraints.as_deref())
        .unwrap_or_default()
}

/// The pods a spread constraint counts, as kube-scheduler's PodTopologySpread reads it for
/// `pod`: its `labelSelector`, with `matchLabelKeys` ANDed in (each key's value from the
/// pod's labels, a key the pod lacks ignored). `None` counts no pod: a missing selector
/// selects nothing, and an empty one (`{}`) counts nothing either unless `matchLabelKeys`
/// added a requirement (kube-scheduler counts no pod for an empty selector).
fn spread_selector(c: &TopologySpreadConstraint, pod: &Pod) -> Option<LabelSelector> {
    let mut selector = c.label_selector.clone()?;
    let labels = pod_labels(pod);
    for key in c.match_label_keys.iter().flatten() {
        if let Some(value) = labels.get(key) {
            selector
                .match_expressions
                .get_or_insert_default()
                .push(LabelSelectorRequirement {
                    key: key.clone(),
                    operator: "In".into(),
                    values: Some(vec![value.clone()]),
                });
        }
    }
    let empty = selector.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
        && selector.match_expressions.as_ref().is_none_or(Vec::is_empty);
    (!empty).then_some(selector)
}

/// One topology spread constraint of a workload, counted as kube-scheduler's
/// PodTopologySpread counts it for the workload's pod:
///
/// - **domains**: the values of `topologyKey` on the eligible nodes. A node is eligible
///   when it carries the keys of all the pod's constraints of the same `whenUnsatisfiable`;
///   with `nodeAffinityPolicy: Honor` (the default) when it matches the pod's
///   `nodeSelector` and required node affinity (`Ignore`: any node); with
///   `nodeTaintsPolicy: Honor` when the pod tolerates its `NoSchedule`/`NoExecute` taints
///   (`Ignore`, the default: taints do not matter). A virtual node that is not Ready is no
///   domain (kube-scheduler would count it under `Ignore`; a move never lands there, and
///   counting it would pull pods toward a failed cluster).
/// - **counts**: the pods of the namespace on each domain's nodes, not being deleted, that
///   [`spread_selector`] selects.
/// - **skew**: the largest count less the global minimum; the minimum is 0 while there are
///   fewer domains than `minDomains` (`DoNotSchedule` only; default 1).
struct Spread<'c> {
    c: &'c TopologySpreadConstraint,
    selector: Option<LabelSelector>,
    counts: BTreeMap<String, i32>,
    /// Eligible node name → its domain.
    domain_of: BTreeMap<String, String>,
}

impl<'c> Spread<'c> {
    fn new(
        c: &'c TopologySpreadConstraint,
        pod: &Pod,
        pods: &Namespace<'_>,
        nodes: &BTreeMap<String, Node>,
    ) -> Self {
        let siblings: Vec<&TopologySpreadConstraint> = constraints(pod)
            .iter()
            .filter(|o| o.when_unsatisfiable == c.when_unsatisfiable)
            .collect();
        let tolerations = pod
            .spec
            .as_ref()
            .and_then(|s| s.tolerations.as_deref())
            .unwrap_or_default();
        let mut counts: BTreeMap<String, i32> = BTreeMap::new();
        let mut domain_of = BTreeMap::new();
        for (name, node) in nodes {
            let labels = labels(node);
            let eligible = tensile_common::fit::is_ready(node)
                && siblings.iter().all(|o| labels.contains_key(&o.topology_key))
                && (c.node_affinity_policy.as_deref() == Some("Ignore")
                    || fit::matches_constraints(pod, node))
                && (c.node_taints_policy.as_deref() != Some("Honor")
                    || tensile_common::fit::untolerated_taint(node, tolerations).is_none());
            if let (true, Some(value)) = (eligible, labels.get(&c.topology_key)) {
                counts.entry(value.clone()).or_insert(0);
                domain_of.insert(name.clone(), value.clone());
            }
        }
        let selector = spread_selector(c, pod);
        if let Some(selector) = &selector {
            for p in pods.candidates(selector).iter().copied() {
                if terminating(p) {
                    continue;
                }
                let Some(domain) = node_of(p).and_then(|n| domain_of.get(n)) else {
                    continue;
                };
                if tensile_common::label_selector::matches(selector, pod_labels(p)) {
                    *counts.entry(domain.clone()).or_insert(0) += 1;
                }
            }
        }
        Spread {
            c,
            selector,
            counts,
            domain_of,
        }
    }

    /// Whether the constraint counts `pod` (moving a pod it does not count changes nothing).
    fn counts_pod(&self, pod: &Pod) -> bool {
        self.selector
            .as_ref()
            .is_some_and(|s| tensile_common::label_selector::matches(s, pod_labels(pod)))
    }

    /// The skew of `counts`, from kube-scheduler's global minimum.
    fn skew_of(&self, counts: &BTreeMap<String, i32>) -> i32 {
        let max = counts.values().copied().max().unwrap_or(0);
        let min_domains = if self.c.when_unsatisfiable == "DoNotSchedule" {
            self.c.min_domains.unwrap_or(1)
        } else {
            1
        };
        let min = if (counts.len() as i64) < i64::from(min_domains) {
            0
        } else {
            counts.values().copied().min().unwrap_or(0)
        };
        max - min
    }

    fn skew(&self) -> i32 {
        self.skew_of(&self.counts)
    }

    /// The skew after `pod` moved from where it runs to `to`.
    fn skew_after(&self, pod: &Pod, to: &str) -> i32 {
        if !self.counts_pod(pod) {
            return self.skew();
        }
        let mut counts = self.counts.clone();
        if let Some(d) = node_of(pod).and_then(|n| self.domain_of.get(n)) {
            *counts.entry(d.clone()).or_insert(0) -= 1;
        }
        if let Some(d) = self.domain_of.get(to) {
            *counts.entry(d.clone()).or_insert(0) += 1;
        }
        self.skew_of(&counts)
    }
}

/// A target node's readiness for pods moving to it.
enum Target {
    Ready(String),
    Stabilizing(String),
    /// Its lower cluster refused the workload after a rebalance.
    Refused(String),
    NoFit,
}

/// The best node of `candidates` (in order of preference) to move `pod` to.
#[allow(clippy::too_many_arguments)]
fn target<'a>(
    pod: &Pod,
    candidates: impl Iterator<Item = &'a String>,
    nodes: &BTreeMap<String, Node>,
    excluded: &BTreeSet<&str>,
    refused: &BTreeSet<&str>,
    now: Timestamp,
    settings: &Settings,
    options: &tensile_common::fit::Options,
) -> Target {
    let window = SignedDuration::try_from(settings.stabilization).unwrap_or(SignedDuration::MAX);
    let mut stabilizing = None;
    let mut refusing = None;
    for name in candidates {
        let Some(node) = nodes.get(name) else { continue };
        if excluded.contains(name.as_str()) || fit::takes(pod, node, options) != Take::Fits {
            continue;
        }
        if refused.contains(name.as_str()) {
            refusing = refusing.or_else(|| Some(name.clone()));
            continue;
        }
        match ready_since(node) {
            Some(since) if since.saturating_add(window).unwrap_or(Timestamp::MAX) <= now => {
                return Target::Ready(name.clone());
            }
            Some(_) => stabilizing = stabilizing.or_else(|| Some(name.clone())),
            None => {}
        }
    }
    match (stabilizing, refusing) {
        (Some(node), _) => Target::Stabilizing(node),
        (None, Some(node)) => Target::Refused(node),
        (None, None) => Target::NoFit,
    }
}

/// The nodes whose lower cluster refused the workload after a rebalance, as its record of
/// refusals says, and that have not turned Ready since.
fn refused_nodes<'a>(
    w: &Workload<'_>,
    nodes: &BTreeMap<String, Node>,
    exclusions: &'a Exclusions,
    now: Timestamp,
) -> BTreeSet<&'a str> {
    let Some(record) = exclusions.records.get(&w.refusals_key()) else {
        return BTreeSet::new();
    };
    record
        .active(now)
        .filter(|node| {
            let refused_at = record.nodes[*node]
                .saturating_sub(REFUSAL_MEMORY)
                .unwrap_or(Timestamp::MIN);
            nodes
                .get(*node)
                .and_then(ready_since)
                .is_none_or(|since| since <= refused_at)
        })
        .collect()
}

/// The refusal to remember for `w`, if a node it was moved toward was excluded for it
/// since the move (the refused-pod rules exclude a node when its lower cluster refused a
/// pod) and its record of refusals does not say so yet.
fn refusal_to_remember(
    w: &Workload<'_>,
    episode: &Episode,
    exclusions: &Exclusions,
    exclusion_ttl: Duration,
    now: Timestamp,
) -> Option<Remember> {
    let (moved, toward) = episode.toward.as_ref()?;
    let excluded = exclusions.records.get(&w.uid)?;
    let ttl = SignedDuration::try_from(exclusion_ttl).unwrap_or(SignedDuration::MAX);
    // Records keep whole seconds.
    let since = moved
        .round(
            jiff::TimestampRound::new()
                .smallest(jiff::Unit::Second)
                .mode(jiff::RoundMode::Trunc),
        )
        .unwrap_or(*moved);
    let (node, refused_at) = excluded
        .nodes
        .iter()
        .filter(|(node, _)| toward.contains(*node))
        .map(|(node, until)| (node, until.saturating_sub(ttl).unwrap_or(Timestamp::MIN)))
        .filter(|(_, at)| *at >= since)
        .max_by_key(|(_, at)| *at)?;
    let key = w.refusals_key();
    let forget_at = refused_at
        .saturating_add(REFUSAL_MEMORY)
        .unwrap_or(Timestamp::MAX);
    let mut record = match exclusions.records.get(&key) {
        Some(r) if !r.is_expired(now) => r.clone(),
        _ => Record {
            namespace: w
                .pods
                .first()
                .and_then(|p| p.metadata.namespace.clone())
                .unwrap_or_default(),
            kind: w.kind.clone(),
            name: w.name.clone(),
            nodes: BTreeMap::new(),
            moves: 0,
            expires: now,
            exhausted: None,
        },
    };
    if record.nodes.get(node).is_some_and(|until| *until >= forget_at) {
        return None;
    }
    record.nodes.retain(|_, until| *until > now);
    record.nodes.insert(node.clone(), forget_at);
    record.moves += 1;
    record.expires = record.nodes.values().copied().max().unwrap_or(now);
    Some(Remember {
        key,
        record,
        owner: w.owner.clone(),
        node: node.clone(),
    })
}

/// What one workload would do, before the budget.
enum Want {
    Nothing,
    Move(Rebalance),
    Held(Held),
}

#[allow(clippy::too_many_arguments)]
fn judge_workload(
    w: &Workload<'_>,
    all: &Namespace<'_>,
    nodes: &BTreeMap<String, Node>,
    exclusions: &Exclusions,
    now: Timestamp,
    settings: &Settings,
    options: &tensile_common::fit::Options,
    pod_settings: &decide::Settings,
) -> Want {
    let Some(model) = w.pods.iter().find(|p| available(p) && node_of(p).is_some()) else {
        return Want::Nothing;
    };
    let excluded: BTreeSet<&str> = exclusions
        .records
        .get(&w.uid)
        .map(|r| r.active(now).collect())
        .unwrap_or_default();
    let refused = refused_nodes(w, nodes, exclusions, now);
    let settle = |pod: &Arc<Pod>, candidates: Vec<String>, reason: &dyn Fn(&str) -> Reason| match target(
        pod,
        candidates.iter(),
        nodes,
        &excluded,
        &refused,
        now,
        settings,
        options,
    ) {
        Target::Ready(node) => Want::Move(Rebalance {
            pod: pod.clone(),
            workload: w.uid.clone(),
            owner: w.owner.clone(),
            reason: reason(&node),
            target: node,
            toward: candidates.iter().cloned().collect(),
            known: w.pods.iter().filter_map(|p| p.metadata.uid.clone()).collect(),
        }),
        Target::Stabilizing(node) => Want::Held(Held::Stabilizing(node)),
        Target::Refused(node) => Want::Held(Held::RefusedBelow(node)),
        Target::NoFit => Want::Held(Held::NoFit),
    };

    // Spread: a counted pod from a fullest domain to an emptiest one, when that lowers the
    // skew (with fewer domains than minDomains, no move can).
    let spreads: Vec<Spread<'_>> = constraints(model)
        .iter()
        .map(|c| Spread::new(c, model, all, nodes))
        .collect();
    for s in &spreads {
        let skew = s.skew();
        if skew <= s.c.max_skew {
            continue;
        }
        let min = s.counts.values().copied().min().unwrap_or(0);
        let max = s.counts.values().copied().max().unwrap_or(0);
        if min + 1 >= max {
            continue;
        }
        let Some(pod) = w
            .pods
            .iter()
            .filter(|p| movable(p, pod_settings) && s.counts_pod(p))
            .filter(|p| {
                node_of(p)
                    .and_then(|n| s.domain_of.get(n))
                    .is_some_and(|d| s.counts.get(d) == Some(&max))
            })
            .max_by_key(|p| p.metadata.name.clone())
        else {
            continue;
        };
        let candidates: Vec<String> = s
            .domain_of
            .iter()
            .filter(|(_, d)| s.counts.get(*d) == Some(&min))
            .map(|(name, _)| name.clone())
            .collect();
        let reason = Reason::Spread {
            key: s.c.topology_key.clone(),
            skew,
            max_skew: s.c.max_skew,
        };
        return settle(pod, candidates, &|_| reason.clone());
    }

    // Preferred node affinity: the pod on the least preferred node, to the most preferred
    // one, unless that breaks a spread constraint.
    let mut by_weight: Vec<(i32, &String)> = nodes
        .iter()
        .filter(|(_, n)| tensile_common::fit::is_ready(n))
        .map(|(name, n)| (preference(model, n), name))
        .collect();
    by_weight.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let Some(&(best, _)) = by_weight.first() else {
        return Want::Nothing;
    };
    let Some((from, pod)) = w
        .pods
        .iter()
        .filter(|p| movable(p, pod_settings))
        .filter_map(|p| Some((preference(p, nodes.get(node_of(p)?)?), p)))
        .min_by_key(|(weight, p)| (*weight, std::cmp::Reverse(p.metadata.name.clone())))
    else {
        return Want::Nothing;
    };
    if best <= from {
        return Want::Nothing;
    }
    let keeps_spread = |to: &String| spreads.iter().all(|s| s.skew_after(pod, to) <= s.c.max_skew);
    let candidates: Vec<String> = by_weight
        .iter()
        .filter(|(weight, name)| *weight > from && keeps_spread(name))
        .map(|(_, name)| (*name).clone())
        .collect();
    if candidates.is_empty() {
        return Want::Nothing;
    }
    settle(pod, candidates, &|node| Reason::Preferred {
        from,
        to: nodes.get(node).map_or(best, |n| preference(model, n)),
    })
}

#[allow(clippy::too_many_arguments)]
/// Decides one round. `pods` are the Running and Pending pods the suite is responsible for
/// (opted in, in served namespaces); `nodes` the virtual nodes.
pub fn plan(
    pods: &[Arc<Pod>],
    nodes: &BTreeMap<String, Node>,
    exclusions: &Exclusions,
    memory: &mut Memory,
    now: Timestamp,
    settings: &Settings,
    shape_max_age: Option<SignedDuration>,
    pod_settings: &decide::Settings,
) -> Plan {
    let options = tensile_common::fit::Options {
        now,
        max_age: shape_max_age,
    };
    let mut workloads: BTreeMap<String, Workload<'_>> = BTreeMap::new();
    for pod in pods {
        let Some((kind, name, uid)) = controller(pod) else {
            continue;
        };
        if !MOVABLE.contains(&kind) || !decide::responsible(pod, pod_settings) {
            continue;
        }
        if node_of(pod).is_some_and(|n| !nodes.contains_key(n)) {
            continue;
        }
        workloads
            .entry(uid.to_owned())
            .or_insert_with(|| Workload {
                uid: uid.to_owned(),
                kind: kind.to_owned(),
                name: name.to_owned(),
                owner: format!("{kind}/{name}"),
                pods: Vec::new(),
            })
            .pods
            .push(pod);
    }
    memory.forget(now, &workloads.keys().map(String::as_str).collect());
    // Spread counts read the pods of the workload's namespace only.
    let mut by_namespace: HashMap<&str, Namespace<'_>> = HashMap::new();
    for pod in pods {
        by_namespace
            .entry(pod.metadata.namespace.as_deref().unwrap_or_default())
            .or_default()
            .add(pod);
    }
    let no_pods = Namespace::default();
    let unavailable = |w: &Workload<'_>| w.pods.iter().filter(|p| !available(p)).count() as u32;
    // A moved pod counts as replaced once a pod of its workload is Ready that it did not
    // have at the move and that was created since (creation times have whole seconds); a
    // replacement never seen is given up on.
    for w in workloads.values() {
        if let Some(e) = memory.episodes.get_mut(&w.uid)
            && let Some((moved, known)) = &e.awaiting
        {
            let since = moved
                .round(
                    jiff::TimestampRound::new()
                        .smallest(jiff::Unit::Second)
                        .mode(jiff::RoundMode::Trunc),
                )
                .unwrap_or(*moved);
            let replaced = w.pods.iter().any(|p| {
                available(p)
                    && p.metadata.uid.as_ref().is_some_and(|u| !known.contains(u))
                    && p.metadata
                        .creation_timestamp
                        .as_ref()
                        .is_some_and(|c| c.0 >= since)
            });
            if replaced || now.duration_since(*moved) > REPLACEMENT_TIMEOUT {
                e.awaiting = None;
            }
        }
    }
    let mut in_flight = workloads
        .values()
        .filter(|w| {
            memory
                .episodes
                .get(&w.uid)
                .is_some_and(|e| e.awaiting.is_some() || (e.cool_until.is_none() && unavailable(w) > 0))
        })
        .count() as u32;
    let cooldown = SignedDuration::try_from(settings.cooldown).unwrap_or(SignedDuration::MAX);
    let mut plan = Plan::default();
    for w in workloads.values() {
        let namespace = w
            .pods
            .first()
            .and_then(|p| p.metadata.namespace.as_deref())
            .unwrap_or_default();
        let all = by_namespace.get(namespace).unwrap_or(&no_pods);
        let episode = memory.episodes.get(&w.uid).cloned().unwrap_or_default();
        // A node it was moved toward refused it since: remembered from this round on (and
        // written until the records show it).
        let remembered;
        let mut exclusions = exclusions;
        if let Some(r) = refusal_to_remember(w, &episode, exclusions, pod_settings.exclusion_ttl, now) {
            let mut with = exclusions.clone();
            with.records.insert(r.key.clone(), r.record.clone());
            remembered = with;
            exclusions = &remembered;
            plan.remember.push(r);
        }
        let want = judge_workload(w, all, nodes, exclusions, now, settings, &options, pod_settings);
        let cooling = episode.cool_until.is_some_and(|until| until > now);
        let m = match want {
            Want::Nothing => {
                // Balanced: an episode under way is over once its last move is replaced.
                if episode.moves > 0
                    && episode.cool_until.is_none()
                    && episode.awaiting.is_none()
                    && unavailable(w) == 0
                {
                    memory.episodes.insert(
                        w.uid.clone(),
                        Episode {
                            moves: episode.moves,
                            cool_until: Some(now.saturating_add(cooldown).unwrap_or(Timestamp::MAX)),
                            awaiting: None,
                            refused_until: None,
                            toward: episode.toward.clone(),
                        },
                    );
                }
                continue;
            }
            Want::Held(why) => {
                plan.held.push((w.uid.clone(), w.owner.clone(), why));
                continue;
            }
            Want::Move(m) => m,
        };
        if cooling {
            plan.held
                .push((w.uid.clone(), w.owner.clone(), Held::CoolingDown));
            continue;
        }
        if episode.awaiting.is_some() {
            plan.held.push((w.uid.clone(), w.owner.clone(), Held::Replacing));
            continue;
        }
        if episode.refused_until.is_some_and(|until| until > now) {
            plan.held.push((w.uid.clone(), w.owner.clone(), Held::Disruption));
            continue;
        }
        if episode.moves >= w.pods.len() as u32 && episode.moves > 0 {
            // As many moves as it has pods and still not balanced: stop for the cool-down.
            memory.episodes.insert(
                w.uid.clone(),
                Episode {
                    moves: episode.moves,
                    cool_until: Some(now.saturating_add(cooldown).unwrap_or(Timestamp::MAX)),
                    awaiting: None,
                    refused_until: None,
                    toward: episode.toward.clone(),
                },
            );
            plan.held
                .push((w.uid.clone(), w.owner.clone(), Held::CoolingDown));
            continue;
        }
        let down = unavailable(w);
        if down + 1 > settings.max_unavailable {
            plan.held
                .push((w.uid.clone(), w.owner.clone(), Held::Unavailable(down)));
            continue;
        }
        let flying = episode.moves > 0 && episode.cool_until.is_none() && down > 0;
        let room =
            plan.moves.len() < settings.max_per_round as usize && (flying || in_flight < settings.max_owners);
        if !room {
            plan.held.push((w.uid.clone(), w.owner.clone(), Held::Budget));
            continue;
        }
        if !flying {
            in_flight += 1;
        }
        if episode.cool_until.is_some() {
            // A new episode after the cool-down.
            memory.episodes.remove(&w.uid);
        }
        plan.moves.push(m);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tensile_common::names;

    const NOW: &str = "2024-05-01T10:00:00Z";

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn at(secs: i64) -> Timestamp {
        t(NOW) + SignedDuration::from_secs(secs)
    }

    /// A virtual node Ready since `ready_since` (`None`: not Ready) whose lower nodes have
    /// `cpu` free; its shape is as of `shape_at`.
    fn node(name: &str, ready_since: Option<Timestamp>, cpu: &str, shape_at: Timestamp) -> Node {
        let shape = json!({"v": 2, "at": shape_at.to_string(), "keys": [], "nodes": 2, "truncated": false,
            "groups": [{"count": 2, "truncated": false, "free": [{"cpu": cpu, "memory": "8Gi", "pods": "100"}]}]});
        let ready = match ready_since {
            Some(since) => {
                json!({"type": "Ready", "status": "True", "lastTransitionTime": since.to_string()})
            }
            None => json!({"type": "Ready", "status": "Unknown", "lastTransitionTime": NOW}),
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"type": "virtual-kubelet", "kubernetes.io/hostname": name},
                "annotations": {names::NODE_CAPACITY_SHAPE: shape.to_string()}},
            "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "value": "tensile", "effect": "NoSchedule"}]},
            "status": {"conditions": [ready]},
        }))
        .unwrap()
    }

    /// vn-a Ready for ten minutes, vn-b for an hour, both with room.
    fn roomy() -> BTreeMap<String, Node> {
        nodes(vec![
            node("vn-a", Some(at(-600)), "8", at(0)),
            node("vn-b", Some(at(-3600)), "8", at(0)),
        ])
    }

    fn nodes(list: Vec<Node>) -> BTreeMap<String, Node> {
        list.into_iter()
            .map(|n| (n.metadata.name.clone().unwrap(), n))
            .collect()
    }

    /// How a pod of the workload is doing.
    #[derive(Clone, Copy)]
    enum State {
        Running,
        Pending,
        Terminating,
    }

    /// Pod `i` of ReplicaSet `rs` (app=`rs`) on `node`, spread over hostnames (maxSkew 1,
    /// ScheduleAnyway) and preferring `prefers` when given.
    fn pod(rs: &str, i: usize, node: Option<&str>, state: State, prefers: Option<&str>) -> Arc<Pod> {
        let mut v = json!({
            "metadata": {"name": format!("{rs}-{i}"), "namespace": "shop", "uid": format!("{rs}-uid-{i}"),
                "resourceVersion": "1", "creationTimestamp": "2024-05-01T09:00:00Z",
                "labels": {"virtual-pod": "true", "app": rs},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs, "uid": format!("{rs}-uid"), "controller": true}]},
            "spec": {
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
                "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"app": rs}}}],
            },
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        if let Some(n) = node {
            v["spec"]["nodeName"] = json!(n);
        }
        if let Some(p) = prefers {
            v["spec"]["topologySpreadConstraints"] = json!([]);
            v["spec"]["affinity"] = json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [p]}]}}]}});
        }
        match state {
            State::Running => {}
            State::Pending => v["status"] = json!({"phase": "Pending"}),
            State::Terminating => v["metadata"]["deletionTimestamp"] = json!(NOW),
        }
        Arc::new(serde_json::from_value(v).unwrap())
    }

    /// `pod`, created at `at`.
    fn created(pod: Arc<Pod>, at: Timestamp) -> Arc<Pod> {
        let mut p = (*pod).clone();
        p.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at));
        Arc::new(p)
    }

    fn run(
        pods: &[Arc<Pod>],
        nodes: &BTreeMap<String, Node>,
        memory: &mut Memory,
        now: Timestamp,
        settings: &Settings,
    ) -> Plan {
        plan(
            pods,
            nodes,
            &Exclusions::default(),
            memory,
            now,
            settings,
            None,
            &decide::Settings::default(),
        )
    }

    fn held(plan: &Plan) -> Vec<Held> {
        plan.held.iter().map(|(_, _, h)| h.clone()).collect()
    }

    /// Applies the plan's moves as the cluster would: the evicted pods are replaced on
    /// their target, Running.
    fn moved_names(plan: &Plan) -> Vec<(String, String)> {
        plan.moves
            .iter()
            .map(|m| (m.pod.metadata.name.clone().unwrap(), m.target.clone()))
            .collect()
    }

    #[test]
    fn after_a_recovery_pods_go_back_one_at_a_time_each_replaced_first_then_the_workload_cools_down() {
        let settings = Settings::default();
        let mut memory = Memory::default();
        // vn-a came back 10 s ago; all four replicas run on vn-b.
        let n = |since: Timestamp| {
            nodes(vec![
                node("vn-a", Some(since), "8", at(0)),
                node("vn-b", Some(at(-3600)), "8", at(0)),
            ])
        };
        let on_b: Vec<Arc<Pod>> = (0..4)
            .map(|i| pod("web", i, Some("vn-b"), State::Running, None))
            .collect();
        let p = run(&on_b, &n(at(-10)), &mut memory, at(0), &settings);
        assert!(p.moves.is_empty());
        assert_eq!(held(&p), vec![Held::Stabilizing("vn-a".into())]);

        // A minute later: one pod goes, to vn-a, for the spread.
        let p = run(&on_b, &n(at(-10)), &mut memory, at(55), &settings);
        assert_eq!(moved_names(&p), vec![("web-3".to_owned(), "vn-a".to_owned())]);
        assert_eq!(
            p.moves[0].reason,
            Reason::Spread {
                key: "kubernetes.io/hostname".into(),
                skew: 4,
                max_skew: 1
            }
        );
        memory.moved(&p.moves[0], at(55));

        // The moved pod is gone before its controller made the replacement: nothing else
        // goes (the workload's pods look all Ready, but one is missing).
        let p = run(&on_b[..3], &n(at(-10)), &mut memory, at(56), &settings);
        assert!(p.moves.is_empty());
        assert_eq!(held(&p), vec![Held::Replacing]);

        // The moved pod terminates and its replacement waits: nothing else goes.
        let mut pods = on_b[..3].to_vec();
        pods.push(pod("web", 3, Some("vn-b"), State::Terminating, None));
        pods.push(pod("web", 4, None, State::Pending, None));
        let p = run(&pods, &n(at(-10)), &mut memory, at(60), &settings);
        assert!(p.moves.is_empty());
        assert_eq!(held(&p), vec![Held::Replacing]);

        // Replaced on vn-a and Ready: 3 against 1 is still a skew of 2; the next goes.
        let mut pods = on_b[..3].to_vec();
        pods.push(created(pod("web", 4, Some("vn-a"), State::Running, None), at(57)));
        let p = run(&pods, &n(at(-10)), &mut memory, at(65), &settings);
        assert_eq!(moved_names(&p), vec![("web-2".to_owned(), "vn-a".to_owned())]);
        memory.moved(&p.moves[0], at(65));

        // Two and two: balanced, nothing moves, and the cool-down starts.
        let balanced = vec![
            on_b[0].clone(),
            on_b[1].clone(),
            created(pod("web", 4, Some("vn-a"), State::Running, None), at(57)),
            created(pod("web", 5, Some("vn-a"), State::Running, None), at(67)),
        ];
        let p = run(&balanced, &n(at(-10)), &mut memory, at(70), &settings);
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");

        // vn-a fails and recovers again inside the cool-down: the workload is left alone.
        let p = run(&on_b, &n(at(100)), &mut memory, at(200), &settings);
        assert_eq!(held(&p), vec![Held::CoolingDown]);
        // After it, it moves again.
        let p = run(&on_b, &n(at(100)), &mut memory, at(400), &settings);
        assert_eq!(p.moves.len(), 1, "{p:?}");
    }

    #[test]
    fn a_pod_the_workload_had_at_the_move_never_counts_as_its_replacement() {
        let settings = Settings::default();
        let mut memory = Memory::default();
        let n = roomy();
        // Two pods on vn-b, one of them made in the same second as the move (the previous
        // move's replacement, say).
        let pods = vec![
            pod("web", 0, Some("vn-b"), State::Running, None),
            pod("web", 1, Some("vn-b"), State::Running, None),
            created(pod("web", 2, Some("vn-b"), State::Running, None), at(10)),
            created(pod("web", 3, Some("vn-b"), State::Running, None), at(10)),
        ];
        let p = run(&pods, &n, &mut memory, at(10), &settings);
        assert_eq!(p.moves.len(), 1);
        memory.moved(&p.moves[0], t("2024-05-01T10:00:10.700Z"));
        // The evicted pod is gone before its controller made the replacement: the pod made
        // at 10 s is not the replacement, though its creation time is not before the move's.
        let evicted = p.moves[0].pod.metadata.uid.clone();
        let left: Vec<Arc<Pod>> = pods
            .iter()
            .filter(|p| p.metadata.uid != evicted)
            .cloned()
            .collect();
        let p = run(&left, &n, &mut memory, at(11), &settings);
        assert!(p.moves.is_empty(), "{p:?}");
        assert_eq!(held(&p), vec![Held::Replacing]);
        // Its real replacement, Ready: the next may go.
        let mut with = left.clone();
        with.push(created(pod("web", 9, Some("vn-a"), State::Running, None), at(10)));
        let p = run(&with, &n, &mut memory, at(12), &settings);
        assert_eq!(p.moves.len(), 1, "{p:?}");
    }

    #[test]
    fn a_node_that_flaps_never_pulls_pods_and_a_node_not_ready_is_no_domain() {
        let settings = Settings::default();
        let mut memory = Memory::default();
        let on_b: Vec<Arc<Pod>> = (0..4)
            .map(|i| pod("web", i, Some("vn-b"), State::Running, None))
            .collect();
        // Ready for 30 s, then NotReady, then Ready for 30 s, … over ten minutes.
        for step in 0..20 {
            let now = at(step * 30);
            let a = if step % 2 == 0 {
                node("vn-a", Some(now - SignedDuration::from_secs(29)), "8", now)
            } else {
                node("vn-a", None, "8", now)
            };
            let n = nodes(vec![a, node("vn-b", Some(at(-3600)), "8", now)]);
            let p = run(&on_b, &n, &mut memory, now, &settings);
            assert!(p.moves.is_empty(), "step {step}: {p:?}");
        }
    }

    #[test]
    fn a_workload_that_prefers_a_node_returns_there_only_when_its_shape_holds_the_pod() {
        let settings = Settings::default();
        let mut memory = Memory::default();
        let pods = vec![pod("web", 0, Some("vn-b"), State::Running, Some("vn-a"))];
        // vn-a's lower nodes have less free than the pod asks: it stays.
        let small = nodes(vec![
            node("vn-a", Some(at(-600)), "500m", at(0)),
            node("vn-b", Some(at(-3600)), "8", at(0)),
        ]);
        let p = run(&pods, &small, &mut memory, at(0), &settings);
        assert!(p.moves.is_empty());
        assert_eq!(held(&p), vec![Held::NoFit]);
        // Room again: it goes.
        let roomy = roomy();
        let p = run(&pods, &roomy, &mut memory, at(0), &settings);
        assert_eq!(moved_names(&p), vec![("web-0".to_owned(), "vn-a".to_owned())]);
        assert_eq!(p.moves[0].reason, Reason::Preferred { from: 0, to: 100 });
        // Already on the preferred node: nothing.
        let there = vec![pod("web", 1, Some("vn-a"), State::Running, Some("vn-a"))];
        let p = run(&there, &roomy, &mut Memory::default(), at(0), &settings);
        assert!(p.moves.is_empty() && p.held.is_empty());
    }

    #[test]
    fn a_preference_never_breaks_the_spread_and_excluded_nodes_are_no_target() {
        let settings = Settings::default();
        let roomy = roomy();
        // Two pods spread one per node, both preferring vn-a: moving one would make a skew of 2.
        let mut pods = Vec::new();
        for (i, n) in ["vn-a", "vn-b"].iter().enumerate() {
            let mut v = serde_json::to_value(&*pod("web", i, Some(n), State::Running, Some("vn-a"))).unwrap();
            v["spec"]["topologySpreadConstraints"] = json!([{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"app": "web"}}}]);
            pods.push(Arc::new(serde_json::from_value::<Pod>(v).unwrap()));
        }
        let p = run(&pods, &roomy, &mut Memory::default(), at(0), &settings);
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");

        // The descheduler's record keeps the workload off vn-a: no move to it.
        let pods = vec![pod("web", 0, Some("vn-b"), State::Running, Some("vn-a"))];
        let mut ex = Exclusions::default();
        ex.records.insert(
            "web-uid".into(),
            tensile_common::exclusion::Record {
                namespace: "shop".into(),
                kind: "ReplicaSet".into(),
                name: "web".into(),
                nodes: [("vn-a".to_owned(), at(600))].into(),
                moves: 1,
                expires: at(600),
                exhausted: None,
            },
        );
        let p = plan(
            &pods,
            &roomy,
            &ex,
            &mut Memory::default(),
            at(0),
            &settings,
            None,
            &decide::Settings::default(),
        );
        assert!(p.moves.is_empty());
        assert_eq!(held(&p), vec![Held::NoFit]);
    }

    #[test]
    fn one_workload_at_a_time_by_default_and_protected_pods_stay() {
        let roomy = roomy();
        let mut pods: Vec<Arc<Pod>> = (0..2)
            .map(|i| pod("web", i, Some("vn-b"), State::Running, Some("vn-a")))
            .collect();
        pods.extend((0..2).map(|i| pod("api", i, Some("vn-b"), State::Running, Some("vn-a"))));
        let mut memory = Memory::default();
        let p = run(&pods, &roomy, &mut memory, at(0), &Settings::default());
        assert_eq!(p.moves.len(), 1, "{p:?}");
        assert_eq!(held(&p), vec![Held::Budget]);
        let first = p.moves[0].workload.clone();
        memory.moved(&p.moves[0], at(0));

        // While its replacement is not Ready, the other workload still waits.
        let mut pods2: Vec<Arc<Pod>> = pods
            .iter()
            .filter(|p| p.metadata.uid.as_deref() != p_uid(&pods, &first).as_deref())
            .cloned()
            .collect();
        let rs = first.trim_end_matches("-uid").to_owned();
        pods2.push(pod(&rs, 9, None, State::Pending, Some("vn-a")));
        let p = run(&pods2, &roomy, &mut memory, at(5), &Settings::default());
        assert!(p.moves.is_empty(), "{p:?}");

        // With two workloads allowed in flight, both go in one round.
        let settings = Settings {
            max_owners: 2,
            ..Settings::default()
        };
        let p = run(&pods, &roomy, &mut Memory::default(), at(0), &settings);
        assert_eq!(p.moves.len(), 2, "{p:?}");

        // A pod that opted out is never evicted.
        let mut v =
            serde_json::to_value(&*pod("web", 0, Some("vn-b"), State::Running, Some("vn-a"))).unwrap();
        v["metadata"]["annotations"] = json!({"tensile.io/deschedule": "false"});
        let p = run(
            &[Arc::new(serde_json::from_value::<Pod>(v).unwrap())],
            &roomy,
            &mut Memory::default(),
            at(0),
            &settings,
        );
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");
    }

    #[test]
    fn a_workload_whose_disruption_budget_refuses_lets_the_others_go_meanwhile() {
        let roomy = roomy();
        let mut pods: Vec<Arc<Pod>> = (0..2)
            .map(|i| pod("api", i, Some("vn-b"), State::Running, Some("vn-a")))
            .collect();
        pods.extend((0..2).map(|i| pod("web", i, Some("vn-b"), State::Running, Some("vn-a"))));
        let mut memory = Memory::default();
        let settings = Settings::default();
        let p = run(&pods, &roomy, &mut memory, at(0), &settings);
        assert_eq!(p.moves.len(), 1);
        let guarded = p.moves[0].workload.clone();
        assert_eq!(guarded, "api-uid");
        // Its eviction is refused (429): the next round moves the other workload.
        memory.refused(&guarded, at(30));
        let p = run(&pods, &roomy, &mut memory, at(2), &settings);
        assert_eq!(
            p.moves.iter().map(|m| m.workload.as_str()).collect::<Vec<_>>(),
            ["web-uid"]
        );
        assert!(held(&p).contains(&Held::Disruption), "{p:?}");
        // After the pause it is tried again.
        let p = run(&pods, &roomy, &mut memory, at(31), &settings);
        assert_eq!(p.moves[0].workload, "api-uid");
    }

    /// The UID of the pod the plan moved for `workload`.
    fn p_uid(pods: &[Arc<Pod>], workload: &str) -> Option<String> {
        let rs = workload.trim_end_matches("-uid");
        pods.iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.get("app").is_some_and(|a| a == rs))
            })
            .filter_map(|p| p.metadata.uid.clone())
            .max()
    }

    /// `pod` with `value` merged at the top level of its JSON (`spec`, `metadata` objects
    /// merged one level deep).
    fn patched<T: serde::Serialize + serde::de::DeserializeOwned>(object: &T, patch: serde_json::Value) -> T {
        let mut v = serde_json::to_value(object).unwrap();
        for (section, fields) in patch.as_object().unwrap() {
            let target = v[section.as_str()].as_object_mut().unwrap();
            for (k, f) in fields.as_object().unwrap() {
                target.insert(k.clone(), f.clone());
            }
        }
        serde_json::from_value(v).unwrap()
    }

    /// Pod `i` of ReplicaSet `rs` on `node` with the one spread constraint `c`.
    fn spread_pod(rs: &str, i: usize, node: &str, c: serde_json::Value) -> Arc<Pod> {
        let p = pod(rs, i, Some(node), State::Running, None);
        Arc::new(patched(&*p, json!({"spec": {"topologySpreadConstraints": [c]}})))
    }

    fn moves_of(pods: &[Arc<Pod>], nodes: &BTreeMap<String, Node>) -> Plan {
        run(pods, nodes, &mut Memory::default(), at(0), &Settings::default())
    }

    #[test]
    fn a_missing_or_empty_label_selector_counts_no_pod_as_kube_scheduler_does() {
        let roomy = roomy();
        let c = |extra: serde_json::Value| {
            let mut c = json!({"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            c
        };
        for (what, constraint, moves) in [
            ("no selector", c(json!({})), 0),
            ("an empty selector", c(json!({"labelSelector": {}})), 0),
            (
                "no selector, matchLabelKeys",
                c(json!({"matchLabelKeys": ["app"]})),
                0,
            ),
            (
                "an empty selector and matchLabelKeys",
                c(json!({"labelSelector": {}, "matchLabelKeys": ["app"]})),
                1,
            ),
            (
                "a selector",
                c(json!({"labelSelector": {"matchLabels": {"app": "web"}}})),
                1,
            ),
        ] {
            let pods: Vec<Arc<Pod>> = (0..2)
                .map(|i| spread_pod("web", i, "vn-b", constraint.clone()))
                .collect();
            let p = moves_of(&pods, &roomy);
            assert_eq!(p.moves.len(), moves, "{what}: {p:?}");
            assert!(p.held.is_empty(), "{what}: {p:?}");
        }
    }

    #[test]
    fn match_label_keys_and_the_selector_together_count_only_the_pods_of_the_same_template() {
        let roomy = roomy();
        let constraint = |keys: serde_json::Value| {
            json!({"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app": "web"}}, "matchLabelKeys": keys})
        };
        // Two pods of the new template on vn-b; two of an older one (another ReplicaSet,
        // same app) on vn-a.
        let pods = |keys: serde_json::Value| -> Vec<Arc<Pod>> {
            let mut out = Vec::new();
            for (rs, node, hash) in [("web-new", "vn-b", "new"), ("web-old", "vn-a", "old")] {
                for i in 0..2 {
                    let p = spread_pod(rs, i, node, constraint(keys.clone()));
                    let mut labels = p.metadata.labels.clone().unwrap();
                    labels.insert("app".into(), "web".into());
                    labels.insert("pod-template-hash".into(), hash.into());
                    out.push(Arc::new(patched(&*p, json!({"metadata": {"labels": labels}}))));
                }
            }
            out
        };
        // The selector alone counts all four: 2 and 2, balanced.
        let p = moves_of(&pods(json!([])), &roomy);
        assert!(p.moves.is_empty(), "{p:?}");
        // With the template hash ANDed in, each workload counts its own: 2 and 0.
        let p = moves_of(&pods(json!(["pod-template-hash"])), &roomy);
        assert_eq!(
            moved_names(&p),
            vec![("web-new-1".to_owned(), "vn-a".to_owned())],
            "{p:?}"
        );
    }

    #[test]
    fn min_domains_makes_the_global_minimum_zero_under_do_not_schedule_only() {
        let roomy = roomy();
        let pods = |when: &str, min_domains: Option<i32>| -> Vec<Arc<Pod>> {
            let mut c = json!({"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": when,
                "labelSelector": {"matchLabels": {"app": "web"}}});
            if let Some(m) = min_domains {
                c["minDomains"] = json!(m);
            }
            let mut out = vec![spread_pod("web", 0, "vn-a", c.clone())];
            out.extend((1..4).map(|i| spread_pod("web", i, "vn-b", c.clone())));
            out
        };
        // 1 and 3 with maxSkew 2: within it.
        assert!(moves_of(&pods("DoNotSchedule", None), &roomy).moves.is_empty());
        // Two domains, fewer than minDomains 3: the minimum counts as 0, the skew is 3.
        let p = moves_of(&pods("DoNotSchedule", Some(3)), &roomy);
        assert_eq!(p.moves.len(), 1, "{p:?}");
        assert_eq!(
            p.moves[0].reason,
            Reason::Spread {
                key: "kubernetes.io/hostname".into(),
                skew: 3,
                max_skew: 2
            }
        );
        // Two domains are enough for minDomains 2.
        assert!(moves_of(&pods("DoNotSchedule", Some(2)), &roomy).moves.is_empty());
        // minDomains means nothing to ScheduleAnyway.
        assert!(
            moves_of(&pods("ScheduleAnyway", Some(3)), &roomy)
                .moves
                .is_empty()
        );
        // 2 and 2 under minDomains 3: the skew (2) is within maxSkew 2; with maxSkew 1 it is
        // not, but no move lowers it.
        let even = |max_skew: i32| -> Vec<Arc<Pod>> {
            let c = json!({"maxSkew": max_skew, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                "minDomains": 3, "labelSelector": {"matchLabels": {"app": "web"}}});
            (0..4)
                .map(|i| spread_pod("web", i, if i < 2 { "vn-a" } else { "vn-b" }, c.clone()))
                .collect()
        };
        let p = moves_of(&even(1), &roomy);
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");
    }

    #[test]
    fn node_affinity_policy_honor_counts_only_the_nodes_the_pod_may_go_to_and_ignore_every_node() {
        // Only vn-b carries tier=b, which the pods select.
        let mut roomy = roomy();
        let b = patched(
            &roomy["vn-b"],
            json!({"metadata": {"labels": {"type": "virtual-kubelet",
            "kubernetes.io/hostname": "vn-b", "tier": "b"}}}),
        );
        roomy.insert("vn-b".into(), b);
        let pods = |policy: Option<&str>| -> Vec<Arc<Pod>> {
            let mut c = json!({"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app": "web"}}});
            if let Some(p) = policy {
                c["nodeAffinityPolicy"] = json!(p);
            }
            (0..2)
                .map(|i| {
                    Arc::new(patched(
                        &*spread_pod("web", i, "vn-b", c.clone()),
                        json!({"spec": {"nodeSelector": {"tier": "b"}}}),
                    ))
                })
                .collect()
        };
        // Honor (the default, and said): vn-b is the only domain, the skew is 0.
        for policy in [None, Some("Honor")] {
            let p = moves_of(&pods(policy), &roomy);
            assert!(p.moves.is_empty() && p.held.is_empty(), "{policy:?}: {p:?}");
        }
        // Ignore: vn-a is a domain too, with 0: the skew is 2, but the pod may not go there.
        let p = moves_of(&pods(Some("Ignore")), &roomy);
        assert!(p.moves.is_empty(), "{p:?}");
        assert_eq!(held(&p), vec![Held::NoFit]);
    }

    #[test]
    fn node_taints_policy_honor_leaves_out_the_nodes_whose_taints_the_pod_does_not_tolerate() {
        let mut roomy = roomy();
        let a = patched(
            &roomy["vn-a"],
            json!({"spec": {"taints": [
            {"key": "virtual-kubelet.io/provider", "value": "tensile", "effect": "NoSchedule"},
            {"key": "dedicated", "value": "batch", "effect": "NoSchedule"}]}}),
        );
        roomy.insert("vn-a".into(), a);
        let pods = |policy: Option<&str>| -> Vec<Arc<Pod>> {
            let mut c = json!({"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app": "web"}}});
            if let Some(p) = policy {
                c["nodeTaintsPolicy"] = json!(p);
            }
            (0..2).map(|i| spread_pod("web", i, "vn-b", c.clone())).collect()
        };
        // Ignore (the default, and said): vn-a counts, 0 against 2; no move lands there.
        for policy in [None, Some("Ignore")] {
            let p = moves_of(&pods(policy), &roomy);
            assert!(p.moves.is_empty(), "{policy:?}: {p:?}");
            assert_eq!(held(&p), vec![Held::NoFit], "{policy:?}");
        }
        // Honor: vn-a is no domain; nothing is violated.
        let p = moves_of(&pods(Some("Honor")), &roomy);
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");
    }

    #[test]
    fn a_node_without_the_key_of_another_constraint_of_the_same_kind_is_no_domain() {
        // Only vn-b carries a zone.
        let mut roomy = roomy();
        let b = patched(
            &roomy["vn-b"],
            json!({"metadata": {"labels": {"type": "virtual-kubelet",
            "kubernetes.io/hostname": "vn-b", "topology.kubernetes.io/zone": "z1"}}}),
        );
        roomy.insert("vn-b".into(), b);
        let pods = |zone_when: &str| -> Vec<Arc<Pod>> {
            let selector = json!({"matchLabels": {"app": "web"}});
            let cs = json!([
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector},
                {"maxSkew": 5, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": zone_when, "labelSelector": selector},
            ]);
            (0..2)
                .map(|i| {
                    Arc::new(patched(
                        &*pod("web", i, Some("vn-b"), State::Running, None),
                        json!({"spec": {"topologySpreadConstraints": cs}}),
                    ))
                })
                .collect()
        };
        // Both ScheduleAnyway: vn-a lacks the zone key, so it is no hostname domain either.
        let p = moves_of(&pods("ScheduleAnyway"), &roomy);
        assert!(p.moves.is_empty() && p.held.is_empty(), "{p:?}");
        // The zone constraint is DoNotSchedule: the hostname one (ScheduleAnyway) counts vn-a.
        let p = moves_of(&pods("DoNotSchedule"), &roomy);
        assert_eq!(
            moved_names(&p),
            vec![("web-1".to_owned(), "vn-a".to_owned())],
            "{p:?}"
        );
    }

    /// The exclusion record the refused-pod rules write when `node` refused a pod of
    /// `web` at `at` (the default exclusion TTL of 600 s).
    fn excluded(node: &str, at_: Timestamp) -> Exclusions {
        let until = at_ + SignedDuration::from_secs(600);
        let mut ex = Exclusions::default();
        ex.records.insert(
            "web-uid".into(),
            Record {
                namespace: "shop".into(),
                kind: "ReplicaSet".into(),
                name: "web".into(),
                nodes: [(node.to_owned(), until)].into(),
                moves: 1,
                expires: until,
                exhausted: None,
            },
        );
        ex
    }

    fn run_with(
        pods: &[Arc<Pod>],
        nodes: &BTreeMap<String, Node>,
        ex: &Exclusions,
        memory: &mut Memory,
        now: Timestamp,
    ) -> Plan {
        plan(
            pods,
            nodes,
            ex,
            memory,
            now,
            &Settings::default(),
            None,
            &decide::Settings::default(),
        )
    }

    #[test]
    fn a_workload_refused_below_after_a_rebalance_is_not_moved_there_again_until_something_changes() {
        let on_b: Vec<Arc<Pod>> = (0..2)
            .map(|i| pod("web", i, Some("vn-b"), State::Running, None))
            .collect();
        let n = |a_since: Timestamp| {
            nodes(vec![
                node("vn-a", Some(a_since), "8", at(0)),
                node("vn-b", Some(at(-3600)), "8", at(0)),
            ])
        };
        let mut memory = Memory::default();
        let p = run_with(&on_b, &n(at(-600)), &Exclusions::default(), &mut memory, at(0));
        assert_eq!(moved_names(&p), vec![("web-1".to_owned(), "vn-a".to_owned())]);
        memory.moved(&p.moves[0], at(0));
        // Its replacement is refused on vn-a; the refused-pod rules exclude vn-a and move it
        // back to vn-b, where it is Ready.
        let ex = excluded("vn-a", at(5));
        let mut pods = on_b[..1].to_vec();
        pods.push(created(pod("web", 3, Some("vn-b"), State::Running, None), at(6)));
        let p = run_with(&pods, &n(at(-600)), &ex, &mut memory, at(10));
        assert_eq!(held(&p), vec![Held::NoFit], "excluded for now");
        let [r] = &p.remember[..] else { panic!("{p:?}") };
        assert_eq!(r.key, "web-uid-rebalance");
        assert_eq!(r.node, "vn-a");
        assert_eq!(
            r.record.nodes,
            [("vn-a".to_owned(), at(5) + REFUSAL_MEMORY)].into()
        );
        assert_eq!(r.record.expires, at(5) + REFUSAL_MEMORY);
        assert_eq!(
            (r.record.kind.as_str(), r.record.name.as_str()),
            ("ReplicaSet", "web")
        );
        // Once the records show it, it is not written again.
        let mut ex = ex;
        ex.records.insert(r.key.clone(), r.record.clone());
        let p = run_with(&pods, &n(at(-600)), &ex, &mut memory, at(12));
        assert!(p.remember.is_empty(), "{p:?}");

        // The exclusion is over, the cool-down too, and the descheduler restarted: the
        // record still keeps the workload off vn-a.
        let later = at(5) + SignedDuration::from_hours(2);
        let p = run_with(&pods, &n(at(-600)), &ex, &mut Memory::default(), later);
        assert!(p.moves.is_empty(), "{p:?}");
        assert_eq!(held(&p), vec![Held::RefusedBelow("vn-a".into())]);
        assert!(
            Held::RefusedBelow("vn-a".into())
                .to_string()
                .contains("refused it after a rebalance")
        );

        // vn-a turns Ready anew (it failed and recovered): the workload may go again.
        let p = run_with(
            &pods,
            &n(later - SignedDuration::from_secs(120)),
            &ex,
            &mut Memory::default(),
            later,
        );
        assert_eq!(p.moves.len(), 1, "{p:?}");
        // And a day after the refusal, whatever happened.
        let p = run_with(
            &pods,
            &n(at(-600)),
            &ex,
            &mut Memory::default(),
            at(6) + REFUSAL_MEMORY,
        );
        assert_eq!(p.moves.len(), 1, "{p:?}");
    }

    #[test]
    fn a_refusal_on_a_node_the_workload_was_not_moved_toward_or_before_the_move_is_not_remembered() {
        let on_b: Vec<Arc<Pod>> = (0..2)
            .map(|i| pod("web", i, Some("vn-b"), State::Running, None))
            .collect();
        let n = roomy();
        let mut memory = Memory::default();
        let p = run_with(&on_b, &n, &Exclusions::default(), &mut memory, at(100));
        memory.moved(&p.moves[0], at(100));
        // Excluded before the move (the exclusion started at 90 s).
        let p = run_with(&on_b, &n, &excluded("vn-a", at(90)), &mut memory, at(110));
        assert!(p.remember.is_empty(), "{p:?}");
        // Another node.
        let p = run_with(&on_b, &n, &excluded("vn-c", at(105)), &mut memory, at(110));
        assert!(p.remember.is_empty(), "{p:?}");
        // Nothing is remembered without a move of rebalancing's own.
        let p = run_with(
            &on_b,
            &n,
            &excluded("vn-a", at(105)),
            &mut Memory::default(),
            at(110),
        );
        assert!(p.remember.is_empty(), "{p:?}");
    }

    #[test]
    fn a_statefulset_remembers_refusals_per_template_revision() {
        assert_eq!(refusals_key("uid-1", ""), "uid-1-rebalance");
        assert_eq!(
            refusals_key("uid-1", "web-5d8c7f9b6"),
            "uid-1-rebalance-web-5d8c7f9b6"
        );
        let sts = |rev: &str| {
            let p = pod("web", 0, Some("vn-b"), State::Running, None);
            let mut labels = p.metadata.labels.clone().unwrap();
            labels.insert("controller-revision-hash".into(), rev.into());
            let p: Pod = patched(
                &*p,
                json!({"metadata": {"labels": labels, "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "web-uid", "controller": true}]}}),
            );
            Arc::new(p)
        };
        let (one, two) = (sts("web-1"), sts("web-2"));
        let w = |p: &Arc<Pod>| {
            Workload {
                uid: "web-uid".into(),
                kind: "StatefulSet".into(),
                name: "web".into(),
                owner: "StatefulSet/web".into(),
                pods: vec![p],
            }
            .refusals_key()
        };
        assert_eq!(w(&one), "web-uid-rebalance-web-1");
        assert_eq!(w(&two), "web-uid-rebalance-web-2");
    }
}
