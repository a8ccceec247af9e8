//! Rebalancing (`--rebalance`), pure: the pods of the virtual nodes, the nodes, the
//! exclusion records, what was moved before and the time in; which pods to evict now, and
//! which workloads are held back and why, out.
//!
//! When a lower cluster fails, its virtual node goes NotReady and the upper cluster moves
//! its pods to the others; when it recovers, nothing brings them back. A workload is moved
//! back when a constraint of its own is violated only because of where its pods happen to
//! be:
//!
//! - **topology spread** across virtual nodes (any `topologyKey` the virtual nodes carry,
//!   `ScheduleAnyway` included): the pods matching the constraint's selector in the
//!   workload's namespace are counted per domain of the Ready virtual nodes that match the
//!   pod's `nodeSelector` and required node affinity, and the largest count exceeds the
//!   smallest by more than `maxSkew` (the upper scheduler's skew);
//! - **preferred node affinity**: a pod runs on a virtual node whose preference weight is
//!   lower than another Ready node's (a workload that prefers cluster A returns to A),
//!   unless the move would break a spread constraint.
//!
//! For both, the target node must have been Ready for the stabilization window (a node
//! that flaps never pulls pods), must hold the pod by its capacity shape (the one fit
//! predicate, [`crate::fit`]: a move never lands a pod where it would be refused), and must
//! not be excluded for the workload by a record of the descheduler. Only pods of a
//! ReplicaSet, StatefulSet or ReplicationController move (their controller recreates them;
//! the upper scheduler places the replacement, steered by the same constraint).
//!
//! **Budget.** A workload moves only while fewer than `max_unavailable` of its pods are
//! unavailable (Pending, not Ready or being deleted), and only once the pod it moved last
//! is replaced by a Ready pod (created after the eviction), so a moved pod is replaced
//! before the next one goes; at most `max_owners` workloads are in flight at once and
//! `max_per_round` pods go per round; the eviction API enforces the workload's
//! PodDisruptionBudget. **No flapping.** A workload's episode ends when it is balanced, or
//! after as many moves as it has pods; then it is not moved again for the cool-down.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{Node, Pod, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use tensile_common::exclusion::Exclusions;

use crate::decide;
use crate::fit::{self, Take};

/// The controllers whose pods rebalancing moves: they recreate an evicted pod.
const MOVABLE: &[&str] = &["ReplicaSet", "StatefulSet", "ReplicationController"];

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
    /// The UIDs of the workload's pods when it was judged: none of them is the replacement.
    pub known: BTreeSet<String>,
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
        }
    }

    pub const LABELS: [&'static str; 7] = [
        "unavailable",
        "stabilizing",
        "cooling_down",
        "no_fit",
        "budget",
        "replacing",
        "disruption_budget",
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
        }
    }
}

/// What one round decides.
#[derive(Debug, Default)]
pub struct Plan {
    pub moves: Vec<Rebalance>,
    /// Workloads (UID, `Kind/name`) held back, and why.
    pub held: Vec<(String, String, Held)>,
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
}

/// How long a moved pod's replacement is awaited before the workload may move again
/// anyway (its controller may have been scaled down meanwhile).
const REPLACEMENT_TIMEOUT: SignedDuration = SignedDuration::from_secs(300);

/// What rebalancing remembers between rounds (in memory: a restart forgets cool-downs,
/// and the budget still holds since it is read from the pods).
#[derive(Debug, Default)]
pub struct Memory {
    episodes: HashMap<String, Episode>,
}

impl Memory {
    /// Records that a pod of `workload`, which had the pods `known`, was evicted at `now`.
    pub fn moved(&mut self, workload: &str, now: Timestamp, known: BTreeSet<String>) {
        let e = self.episodes.entry(workload.to_owned()).or_default();
        e.moves += 1;
        e.awaiting = Some((now, known));
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
    owner: String,
    pods: Vec<&'a Arc<Pod>>,
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

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
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
            tensile_common::fit::terms_match(Some(std::slice::from_ref(&t.preference)), Some(name), &labels)
        })
        .map(|t| t.weight)
        .sum()
}

/// Whether the upper scheduler may put the pod on `node` as far as the pod's own
/// `nodeSelector` and required node affinity go (not our exclusions, not taints).
fn eligible(pod: &Pod, node: &Node) -> bool {
    fit::matches_constraints(pod, node)
}

/// The pod counts per domain of one constraint, over the Ready virtual nodes the pod is
/// eligible for (a node without the key is no domain).
fn counts(
    c: &TopologySpreadConstraint,
    pod: &Pod,
    pods: &[&Arc<Pod>],
    nodes: &BTreeMap<String, Node>,
) -> BTreeMap<String, i32> {
    let namespace = pod.metadata.namespace.as_deref();
    let mut domains: BTreeMap<String, i32> = BTreeMap::new();
    let mut domain_of: BTreeMap<&str, String> = BTreeMap::new();
    for (name, node) in nodes {
        if !tensile_common::fit::is_ready(node) || !eligible(pod, node) {
            continue;
        }
        if let Some(value) = labels(node).get(&c.topology_key) {
            domains.entry(value.clone()).or_insert(0);
            domain_of.insert(name, value.clone());
        }
    }
    let empty = LabelSelector::default();
    let selector = c.label_selector.as_ref().unwrap_or(&empty);
    for p in pods.iter().copied() {
        if terminating(p) || p.metadata.namespace.as_deref() != namespace {
            continue;
        }
        let Some(domain) = node_of(p).and_then(|n| domain_of.get(n)) else {
            continue;
        };
        if tensile_common::fit::label_selector_matches(
            selector,
            p.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()),
        ) {
            *domains.entry(domain.clone()).or_insert(0) += 1;
        }
    }
    domains
}

fn skew(counts: &BTreeMap<String, i32>) -> i32 {
    let max = counts.values().copied().max().unwrap_or(0);
    let min = counts.values().copied().min().unwrap_or(0);
    max - min
}

fn constraints(pod: &Pod) -> &[TopologySpreadConstraint] {
    pod.spec
        .as_ref()
        .and_then(|s| s.topology_spread_constraints.as_deref())
        .unwrap_or_default()
}

/// A target node's readiness for pods moving to it.
enum Target {
    Ready(String),
    Stabilizing(String),
    NoFit,
}

/// The best node of `candidates` (in order of preference) to move `pod` to.
fn target<'a>(
    pod: &Pod,
    candidates: impl Iterator<Item = &'a String>,
    nodes: &BTreeMap<String, Node>,
    excluded: &BTreeSet<&str>,
    now: Timestamp,
    settings: &Settings,
    options: &tensile_common::fit::Options,
) -> Target {
    let window = SignedDuration::try_from(settings.stabilization).unwrap_or(SignedDuration::MAX);
    let mut stabilizing = None;
    for name in candidates {
        let Some(node) = nodes.get(name) else { continue };
        if excluded.contains(name.as_str()) || fit::takes(pod, node, options) != Take::Fits {
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
    stabilizing.map_or(Target::NoFit, Target::Stabilizing)
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
    all: &[&Arc<Pod>],
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
    let settle = |pod: &Arc<Pod>, candidates: Vec<String>, reason: &dyn Fn(&str) -> Reason| match target(
        pod,
        candidates.iter(),
        nodes,
        &excluded,
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
            known: w.pods.iter().filter_map(|p| p.metadata.uid.clone()).collect(),
        }),
        Target::Stabilizing(node) => Want::Held(Held::Stabilizing(node)),
        Target::NoFit => Want::Held(Held::NoFit),
    };

    // Spread: from the fullest domain to the emptiest.
    for c in constraints(model) {
        let counts = counts(c, model, all, nodes);
        let skew = skew(&counts);
        if skew <= c.max_skew {
            continue;
        }
        let min = counts.values().copied().min().unwrap_or(0);
        let max = counts.values().copied().max().unwrap_or(0);
        let domain_of = |node: &str| {
            nodes
                .get(node)
                .and_then(|n| labels(n).get(&c.topology_key).cloned())
        };
        let Some(pod) = w
            .pods
            .iter()
            .filter(|p| movable(p, pod_settings))
            .filter(|p| {
                node_of(p)
                    .and_then(domain_of)
                    .is_some_and(|d| counts.get(&d) == Some(&max))
            })
            .max_by_key(|p| p.metadata.name.clone())
        else {
            continue;
        };
        let candidates: Vec<String> = nodes
            .iter()
            .filter(|(_, n)| {
                labels(n)
                    .get(&c.topology_key)
                    .is_some_and(|d| counts.get(d) == Some(&min))
            })
            .map(|(name, _)| name.clone())
            .collect();
        let reason = Reason::Spread {
            key: c.topology_key.clone(),
            skew,
            max_skew: c.max_skew,
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
    let keeps_spread = |to: &String| {
        let Some(to_node) = nodes.get(to) else {
            return false;
        };
        constraints(model).iter().all(|c| {
            let mut counts = counts(c, model, all, nodes);
            let domain = |n: &Node| labels(n).get(&c.topology_key).cloned();
            if let Some(d) = node_of(pod).and_then(|n| nodes.get(n)).and_then(domain) {
                *counts.entry(d).or_insert(0) -= 1;
            }
            if let Some(d) = domain(to_node) {
                *counts.entry(d).or_insert(0) += 1;
            }
            skew(&counts) <= c.max_skew
        })
    };
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
                owner: format!("{kind}/{name}"),
                pods: Vec::new(),
            })
            .pods
            .push(pod);
    }
    memory.forget(now, &workloads.keys().map(String::as_str).collect());
    // Spread counts read the pods of the workload's namespace only.
    let mut by_namespace: HashMap<&str, Vec<&Arc<Pod>>> = HashMap::new();
    for pod in pods {
        by_namespace
            .entry(pod.metadata.namespace.as_deref().unwrap_or_default())
            .or_default()
            .push(pod);
    }
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
        let all = by_namespace.get(namespace).map_or(&[][..], Vec::as_slice);
        let want = judge_workload(w, all, nodes, exclusions, now, settings, &options, pod_settings);
        let episode = memory.episodes.get(&w.uid).cloned().unwrap_or_default();
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

    fn uids(pods: &[Arc<Pod>]) -> BTreeSet<String> {
        pods.iter().filter_map(|p| p.metadata.uid.clone()).collect()
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
        memory.moved("web-uid", at(55), uids(&on_b));

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
        memory.moved("web-uid", at(65), uids(&pods));

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
        memory.moved("web-uid", t("2024-05-01T10:00:10.700Z"), p.moves[0].known.clone());
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
        memory.moved(&first, at(0), uids(&pods));

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
}
