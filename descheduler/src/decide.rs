//! The decision, pure: one upper pod, the virtual nodes, the exclusion records and the time
//! in; what to do with the pod out ([`Verdict`]). Nothing here calls the API, so every rule
//! is a unit test over built objects.
//!
//! A pod is a candidate when it is bound to a virtual node, Pending, not being deleted, and
//! its `tensile.io/LowerPodScheduled` condition has been False for one of the configured
//! reasons for at least the threshold (the condition's age, not the pod's). A candidate
//! moves unless a rule protects it; its workload's exclusion record gains the node that
//! refused it and every other virtual node whose capacity shape holds the pod on no lower
//! node (by `tensile_common::fit`), so the replacement is steered to one that fits; never
//! every node that would take it. A workload whose record already counts the maximum of moves is given up on,
//! once, with a warning.
//!
//! A pod the upper scheduler has not placed for the threshold while it carries exclusions
//! of ours is recreated without them once an excluded virtual node would take it again
//! ([`Release`]): no pod stays unplaced upstream because of an exclusion that no longer
//! holds.
//!
//! A pod the lower cluster is making room for (`tensile.io/LowerPodNominated=True`: its
//! scheduler preempted pods for it) is not refused while the nomination is younger than
//! [`NOMINATION_PROTECTS`].
//!
//! Only pods the suite is responsible for are judged: opted in with the webhook's label, in
//! a namespace the webhook serves. A lower create failure another cluster could resolve
//! (`tensile.io/LowerPodSynced=False`, reason `CreateFailed`) is a refusal like the lower
//! scheduler's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use tensile_common::exclusion::{Exclusions, Record};
use tensile_common::names;

use crate::fit;
use crate::job::{self, JobRisk};

/// `tensile.io/LowerPodSynced` reasons that another lower cluster could resolve: the lower
/// apiserver refused the create (quota, LimitRange, PodSecurity, an admission webhook).
/// Never `Conflict` (a lower object of that name is not ours) nor `StashNotTrusted` or
/// `InvalidPod` (no cluster would run it).
pub const CREATE_FAILURES: &[&str] = &["CreateFailed"];

/// How long the lower cluster making room for a pod protects it at most, from when the
/// upper pod first showed it (`tensile.io/LowerPodNominated`): victims of a preemption get
/// their grace period (30 s by default) and a new node a few minutes; cluster-autoscaler
/// gives up on a node that has not come up after 15 minutes (its default
/// `--max-node-provision-time`). A nomination older than this no longer protects the pod.
pub const NOMINATION_PROTECTS: Duration = Duration::from_secs(15 * 60);

/// Which bare pods are moved. Moving one means creating its replacement, the only reason
/// the descheduler may need `create` on pods: with `off` it needs none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BarePods {
    /// None.
    Off,
    /// Those with the `descheduler.alpha.kubernetes.io/evict` annotation.
    #[default]
    Annotated,
    /// Every one.
    All,
}

/// The rules' knobs, from the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long the lower refusal must have lasted.
    pub threshold: Duration,
    /// `LowerPodScheduled` reasons that make a pod a candidate.
    pub reasons: Vec<String>,
    /// Which bare pods are moved (each by creating its replacement).
    pub bare_pods: BarePods,
    /// Move pods of the `system-*-critical` priority classes too.
    pub evict_system_critical: bool,
    /// Nodes added to one workload's record before it is given up on.
    pub max_moves_per_owner: u32,
    /// How long a node stays excluded for a workload.
    pub exclusion_ttl: Duration,
    /// A capacity shape older than this fails open (`None`: any age is trusted).
    pub shape_max_age: Option<SignedDuration>,
    /// The label (key, value) that opts a pod in, as the webhook's `--pod-label`.
    pub pod_label: (String, String),
    /// Namespaces the webhook never serves, as its `--exclude-namespaces`.
    pub excluded_namespaces: BTreeSet<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            threshold: Duration::from_secs(60),
            reasons: vec!["Unschedulable".into()],
            bare_pods: BarePods::Annotated,
            evict_system_critical: false,
            max_moves_per_owner: 3,
            exclusion_ttl: Duration::from_secs(600),
            shape_max_age: Some(SignedDuration::from_mins(15)),
            pod_label: (
                names::VIRTUAL_POD_LABEL.to_owned(),
                names::VIRTUAL_POD_VALUE.to_owned(),
            ),
            excluded_namespaces: BTreeSet::from(["kube-system".to_owned()]),
        }
    }
}

/// What the decision reads besides the pod.
pub struct View<'a> {
    /// The virtual nodes (those matching `--node-selector`), by name.
    pub nodes: &'a BTreeMap<String, Node>,
    pub exclusions: &'a Exclusions,
    pub now: Timestamp,
}

/// The lower cluster's refusal, as the upper pod shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The virtual node whose lower cluster refused the pod.
    pub node: String,
    pub reason: String,
    /// The lower scheduler's message.
    pub message: String,
    pub since: Timestamp,
}

/// Whose pod it is: what recreates it, and the key of its exclusion record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A controller (ReplicaSet, StatefulSet, Job…) recreates the pod once it is evicted.
    Owned {
        api_version: String,
        kind: String,
        name: String,
        uid: String,
    },
    /// Nothing recreates it: the descheduler makes the replacement. `lineage` is the UID of
    /// the first pod of the line.
    Bare { lineage: String },
}

impl Workload {
    /// The key of the workload's exclusion record.
    pub fn key(&self) -> &str {
        match self {
            Workload::Owned { uid, .. } => uid,
            Workload::Bare { lineage } => lineage,
        }
    }

    /// `ReplicaSet/web-7d4b9`, or `Pod/<name>` for a bare pod.
    pub fn describe(&self, pod: &str) -> String {
        match self {
            Workload::Owned { kind, name, .. } => format!("{kind}/{name}"),
            Workload::Bare { .. } => format!("Pod/{pod}"),
        }
    }
}

/// Why a candidate stays where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// The virtual node is not Ready: taint eviction owns the pod, and the verdict may be stale.
    NodeNotReady,
    DaemonSet,
    Mirror,
    SystemCritical,
    /// `tensile.io/deschedule=false` or `descheduler.alpha.kubernetes.io/prefer-no-eviction`.
    OptedOut,
    /// Its volume was bound below this virtual node.
    VolumePinned,
    /// A bare pod that `--bare-pods` leaves alone.
    BarePod(BarePods),
    /// No other Ready virtual node would take it; why each one would not.
    NoOtherNode(Vec<String>),
    /// The workload was given up on and has not expired yet.
    Exhausted,
    /// Its Job tracks it by finalizer and does not ignore evictions: a move would count as a
    /// failure of the Job. The text says what to add to the Job.
    JobWouldFail(String),
}

impl Skip {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Skip::NodeNotReady => "node_not_ready",
            Skip::DaemonSet => "daemonset",
            Skip::Mirror => "mirror",
            Skip::SystemCritical => "system_critical",
            Skip::OptedOut => "opted_out",
            Skip::VolumePinned => "volume_pinned",
            Skip::BarePod(_) => "bare_pod",
            Skip::NoOtherNode(_) => "no_other_node",
            Skip::Exhausted => "exhausted",
            Skip::JobWouldFail(_) => "job_would_fail",
        }
    }
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::NodeNotReady => write!(f, "its virtual node is not Ready"),
            Skip::DaemonSet => write!(f, "it belongs to a DaemonSet"),
            Skip::Mirror => write!(f, "it is a mirror pod"),
            Skip::SystemCritical => write!(f, "it is system-critical"),
            Skip::OptedOut => write!(f, "it opted out"),
            Skip::VolumePinned => write!(f, "its volume pins it to its virtual node"),
            Skip::BarePod(BarePods::Off) => write!(
                f,
                "it is a bare pod and bare pods are not moved (--bare-pods=off)"
            ),
            Skip::BarePod(_) => write!(
                f,
                "it is a bare pod without {} (or --bare-pods=all)",
                names::DESCHEDULER_EVICT
            ),
            Skip::NoOtherNode(why) => write!(f, "no other virtual node would take it: {}", why.join("; ")),
            Skip::Exhausted => write!(f, "its workload was given up on"),
            Skip::JobWouldFail(why) => write!(f, "{why}"),
        }
    }
}

/// A move to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    pub refusal: Refusal,
    pub workload: Workload,
    /// The workload's record after the move.
    pub record: Record,
    /// Whether `record` differs from the stored one (a node was added or dropped).
    pub record_changed: bool,
    /// The virtual nodes the replacement may land on.
    pub targets: Vec<String>,
}

/// A workload given up on: it reached the maximum of moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GiveUp {
    pub refusal: Refusal,
    pub workload: Workload,
    /// The record marked exhausted.
    pub record: Record,
}

/// A pod the upper scheduler cannot place while an exclusion of ours keeps it off a virtual
/// node that would hold it now: it is recreated (evicted, or replaced for a bare pod)
/// without that exclusion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub workload: Workload,
    /// The excluded virtual nodes that would hold the pod now.
    pub freed: Vec<String>,
    /// The nodes the recreated pod still avoids: the record's, in force, less `freed`.
    pub excluded: Vec<String>,
    /// The record with `freed` taken out, when one of them was still in force there
    /// (`None`: the record needs no write).
    pub record: Option<Record>,
    /// Since when the upper scheduler has not placed the pod.
    pub since: Timestamp,
}

/// What to do with one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not the descheduler's concern (not on a virtual node, not Pending, not refused below).
    Ignore,
    /// Refused below, not for long enough yet: look again at `at`.
    WaitUntil(Timestamp),
    /// A candidate that stays, and why.
    Skip {
        node: String,
        why: Skip,
    },
    Move(Move),
    GiveUp(GiveUp),
    Release(Release),
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// The lower refusal the pod shows: `LowerPodScheduled=False` with one of `reasons`, or
/// `LowerPodSynced=False` with one of [`CREATE_FAILURES`].
pub fn refusal(pod: &Pod, reasons: &[String]) -> Option<Refusal> {
    let node = pod.spec.as_ref()?.node_name.clone()?;
    let conditions = pod.status.as_ref()?.conditions.as_deref().unwrap_or_default();
    let refused = |type_: &str, qualifies: &dyn Fn(&str) -> bool| {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .filter(|c| c.status == "False" && qualifies(c.reason.as_deref().unwrap_or_default()))
    };
    let c = refused(names::CONDITION_LOWER_SCHEDULED, &|r| {
        reasons.iter().any(|q| q == r)
    })
    .or_else(|| refused(names::CONDITION_LOWER_SYNCED, &|r| CREATE_FAILURES.contains(&r)))?;
    Some(Refusal {
        node,
        reason: c.reason.clone().unwrap_or_default(),
        message: c.message.clone().unwrap_or_default(),
        since: c
            .last_transition_time
            .as_ref()
            .map(|t| t.0)
            .unwrap_or(Timestamp::MAX),
    })
}

/// Until when the pod is being made room for below: the time of its
/// `tensile.io/LowerPodNominated=True` condition plus [`NOMINATION_PROTECTS`], when that is
/// still ahead of `now` (a condition without a time protects nothing: it could not be
/// bounded). Such a pod is not refused: the lower scheduler preempted pods for it and binds
/// it once they are gone.
pub fn made_room_until(pod: &Pod, now: Timestamp) -> Option<Timestamp> {
    let since = pod
        .status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == names::CONDITION_LOWER_NOMINATED && c.status == "True")?
        .last_transition_time
        .as_ref()?
        .0;
    Some(after(since, NOMINATION_PROTECTS)).filter(|until| *until > now)
}

/// Whether the suite is responsible for the pod: opted in with the webhook's label, in a
/// namespace the webhook serves. Other pods on a virtual node are never moved: their
/// replacements would get no exclusion, so moving them could only repeat.
pub fn responsible(pod: &Pod, settings: &Settings) -> bool {
    let (key, value) = &settings.pod_label;
    let opted_in = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .is_some_and(|v| v == value);
    let served = pod
        .metadata
        .namespace
        .as_ref()
        .is_none_or(|ns| !settings.excluded_namespaces.contains(ns));
    opted_in && served
}

/// A move of a pod that a Job tracks by finalizer goes ahead only when the Job ignores
/// evictions ([`crate::job`]); otherwise the pod stays, and the skip says what to add to the
/// Job. `job` is the pod's Job as read right now (`None`: unreadable). Pods not tracked by
/// finalizer (1.20 to 1.25, or any pod not of a Job) are not affected.
/// The same holds for recreating an unplaced pod ([`Release`]).
pub fn with_job(verdict: Verdict, pod: &Pod, job: Option<&Job>) -> Verdict {
    let (key, node) = match &verdict {
        Verdict::Move(m) => (m.workload.key(), m.refusal.node.clone()),
        Verdict::Release(r) => (r.workload.key(), r.freed.first().cloned().unwrap_or_default()),
        _ => return verdict,
    };
    if job::tracking_job(pod).is_none() {
        return verdict;
    }
    match job::judge(pod, job, key) {
        JobRisk::Ignored => verdict,
        JobRisk::WouldFail(why) => Verdict::Skip {
            node,
            why: Skip::JobWouldFail(why),
        },
    }
}

fn after(t: Timestamp, d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    t.saturating_add(d).unwrap_or(Timestamp::MAX)
}

fn before(t: Timestamp, d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    t.saturating_sub(d).unwrap_or(Timestamp::MIN)
}

/// The protections that hold whatever the nodes and records say.
pub(crate) fn protected(pod: &Pod, settings: &Settings) -> Result<Workload, Skip> {
    let meta = &pod.metadata;
    let controller = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    if controller.is_some_and(|o| o.kind == "DaemonSet") {
        return Err(Skip::DaemonSet);
    }
    if annotation(pod, "kubernetes.io/config.mirror").is_some() {
        return Err(Skip::Mirror);
    }
    let spec = pod.spec.as_ref();
    let critical = spec
        .and_then(|s| s.priority_class_name.as_deref())
        .is_some_and(|c| c == "system-cluster-critical" || c == "system-node-critical")
        || spec.and_then(|s| s.priority).is_some_and(|p| p >= 2_000_000_000);
    if critical && !settings.evict_system_critical {
        return Err(Skip::SystemCritical);
    }
    if annotation(pod, names::DESCHEDULE) == Some("false")
        || annotation(pod, names::DESCHEDULER_PREFER_NO_EVICTION).is_some()
    {
        return Err(Skip::OptedOut);
    }
    if tensile_common::pin::volume_pinned(pod) {
        return Err(Skip::VolumePinned);
    }
    match controller {
        Some(o) => Ok(Workload::Owned {
            api_version: o.api_version.clone(),
            kind: o.kind.clone(),
            name: o.name.clone(),
            uid: o.uid.clone(),
        }),
        None => {
            let opted_in = annotation(pod, names::DESCHEDULER_EVICT).is_some_and(|v| v != "false");
            let moved = match settings.bare_pods {
                BarePods::Off => false,
                BarePods::Annotated => opted_in,
                BarePods::All => true,
            };
            if !moved {
                return Err(Skip::BarePod(settings.bare_pods));
            }
            let lineage = annotation(pod, names::LINEAGE)
                .map(str::to_owned)
                .or_else(|| meta.uid.clone())
                .unwrap_or_default();
            Ok(Workload::Bare { lineage })
        }
    }
}

/// Decides what to do with `pod`.
pub fn judge(pod: &Pod, view: &View<'_>, settings: &Settings) -> Verdict {
    let pending = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
    if !pending || pod.metadata.deletion_timestamp.is_some() || !responsible(pod, settings) {
        return Verdict::Ignore;
    }
    if pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none() {
        return judge_unbound(pod, view, settings);
    }
    let Some(refusal) = refusal(pod, &settings.reasons) else {
        return Verdict::Ignore;
    };
    let Some(node) = view.nodes.get(&refusal.node) else {
        return Verdict::Ignore;
    };
    let due = after(refusal.since, settings.threshold);
    if view.now < due {
        return Verdict::WaitUntil(due);
    }
    if let Some(until) = made_room_until(pod, view.now) {
        return Verdict::WaitUntil(until);
    }
    let skip = |why| Verdict::Skip {
        node: refusal.node.clone(),
        why,
    };
    if !tensile_common::fit::is_ready(node) {
        return skip(Skip::NodeNotReady);
    }
    let workload = match protected(pod, settings) {
        Ok(w) => w,
        Err(why) => return skip(why),
    };

    let now = view.now;
    let stored = in_force(view, &workload);
    let mut nodes: BTreeMap<String, Timestamp> = stored
        .map(|r| r.active(now).map(|n| (n.to_owned(), r.nodes[n])).collect())
        .unwrap_or_default();
    let adds = !nodes.contains_key(&refusal.node);
    // A pod created after its workload's record excluded the node escaped the exclusion
    // (its template bypasses the webhook, or the webhook had not seen the record): moving
    // it again is the loop the bound is for, so it counts. A pod that was already there
    // when the node was excluded (a sibling of the first refused pod) moves once for free.
    let escaped = nodes.get(&refusal.node).is_some_and(|until| {
        let excluded_at = before(*until, settings.exclusion_ttl);
        pod.metadata
            .creation_timestamp
            .as_ref()
            .is_none_or(|created| created.0 >= excluded_at)
    });
    let counts = adds || escaped;
    let moves = stored.map_or(0, |r| r.moves);
    if counts && moves >= settings.max_moves_per_owner {
        return match stored {
            Some(r) if r.exhausted.is_some() => skip(Skip::Exhausted),
            _ => {
                let mut record = stored.cloned().unwrap_or_else(|| new_record(pod, &workload, now));
                record.exhausted = Some(now);
                Verdict::GiveUp(GiveUp {
                    refusal,
                    workload,
                    record,
                })
            }
        };
    }

    let options = tensile_common::fit::Options {
        now,
        max_age: settings.shape_max_age,
    };
    let mut refusals = Vec::new();
    // Virtual nodes the upper scheduler would still bind the pod to but whose shape says no
    // lower node holds it: the upper scheduler cannot know, so only an exclusion keeps the
    // replacement off them.
    let mut cannot_hold: Vec<&String> = Vec::new();
    let targets: BTreeSet<&String> = view
        .nodes
        .iter()
        .filter(|(name, _)| **name != refusal.node)
        .filter(|(name, n)| match fit::refuses(pod, n, &options) {
            None => true,
            Some(why) => {
                if matches!(why, fit::NotFit::Shape(_)) {
                    cannot_hold.push(name);
                }
                refusals.push(why.message().to_owned());
                false
            }
        })
        .map(|(name, _)| name)
        .collect();
    if targets.is_empty() {
        if refusals.is_empty() {
            refusals.push("there is no other virtual node".into());
        }
        return skip(Skip::NoOtherNode(refusals));
    }
    if adds {
        nodes.insert(refusal.node.clone(), after(now, settings.exclusion_ttl));
    }
    // Steer the replacement to a node that fits: exclude, besides the refusing node, every
    // node the shape rules out. Such an exclusion is not a move (no lower cluster refused).
    let mut steered = false;
    for name in cannot_hold {
        if !nodes.contains_key(name) {
            nodes.insert(name.clone(), after(now, settings.exclusion_ttl));
            steered = true;
        }
    }
    // Never exclude every node that would take the pod: the oldest exclusions of such
    // nodes go first (dropping any other exclusion would free no place for the pod).
    let mut dropped = false;
    while targets.iter().all(|t| nodes.contains_key(*t)) {
        let oldest = nodes
            .iter()
            .filter(|(n, _)| targets.contains(n))
            .min_by_key(|(_, until)| **until)
            .map(|(n, _)| n.clone());
        match oldest {
            Some(n) => {
                nodes.remove(&n);
                dropped = true;
            }
            None => break,
        }
    }
    let usable: Vec<String> = targets
        .iter()
        .filter(|t| !nodes.contains_key(**t))
        .map(|t| (*t).clone())
        .collect();
    let mut record = stored.cloned().unwrap_or_else(|| new_record(pod, &workload, now));
    let expires = nodes.values().copied().max().unwrap_or(now).max(record.expires);
    record.nodes = nodes;
    record.moves = moves + u32::from(counts);
    record.expires = expires;
    record.exhausted = None;
    Verdict::Move(Move {
        refusal,
        workload,
        record,
        record_changed: counts || dropped || steered || stored.is_none(),
        targets: usable,
    })
}

/// Since when the upper scheduler has found no node for the pod (`PodScheduled=False`,
/// reason `Unschedulable`).
pub fn unplaced_since(pod: &Pod) -> Option<Timestamp> {
    let conditions = pod.status.as_ref()?.conditions.as_deref()?;
    conditions
        .iter()
        .find(|c| c.type_ == "PodScheduled")
        .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .map(|c| c.last_transition_time.as_ref().map_or(Timestamp::MAX, |t| t.0))
}

/// An unbound pod: is an exclusion of ours what keeps it unplaced?
///
/// The exclusion sits in the pod's required node affinity, which cannot change, and the
/// pod may have been created long before it stops being right. So a pod the upper
/// scheduler has not placed for the threshold, carrying exclusions of ours, is recreated
/// when one of its excluded virtual nodes would take it now: the node's shape holds it
/// (the cluster freed up; the node is taken out of the record), or the node's exclusion is
/// no longer in force and its shape cannot say. A node the upper scheduler itself keeps the
/// pod off, or whose shape still holds the pod on no lower node, changes nothing: without
/// the exclusion the pod would wait there instead.
fn judge_unbound(pod: &Pod, view: &View<'_>, settings: &Settings) -> Verdict {
    let ours = fit::excluded_by_us(pod);
    if ours.is_empty() {
        return Verdict::Ignore;
    }
    let Some(since) = unplaced_since(pod) else {
        return Verdict::Ignore;
    };
    let due = after(since, settings.threshold);
    if view.now < due {
        return Verdict::WaitUntil(due);
    }
    // A protected pod is not recreated; one that opted out stays as it is.
    let Ok(workload) = protected(pod, settings) else {
        return Verdict::Ignore;
    };
    let now = view.now;
    let stored = in_force(view, &workload);
    let in_force: BTreeMap<&str, Timestamp> = stored
        .map(|r| r.active(now).map(|n| (n, r.nodes[n])).collect())
        .unwrap_or_default();
    let options = tensile_common::fit::Options {
        now,
        max_age: settings.shape_max_age,
    };
    let mut freed = Vec::new();
    let mut lifted = Vec::new();
    let mut due: Option<Timestamp> = None;
    for name in &ours {
        let Some(node) = view.nodes.get(name) else {
            continue;
        };
        let until = in_force.get(name.as_str()).copied();
        match (fit::takes(pod, node, &options), until) {
            (fit::Take::No(_), _) => {}
            (fit::Take::Fits, Some(_)) => {
                freed.push(name.clone());
                lifted.push(name.clone());
            }
            (fit::Take::Fits | fit::Take::Unknown, None) => freed.push(name.clone()),
            (fit::Take::Unknown, Some(until)) => due = Some(due.map_or(until, |d| d.min(until))),
        }
    }
    if freed.is_empty() {
        return due.map_or(Verdict::Ignore, Verdict::WaitUntil);
    }
    let record = (!lifted.is_empty()).then(|| {
        let mut record = stored.cloned().unwrap_or_else(|| new_record(pod, &workload, now));
        record
            .nodes
            .retain(|n, until| *until > now && !lifted.contains(n));
        record
    });
    let excluded = in_force
        .keys()
        .filter(|n| !freed.iter().any(|f| f == *n))
        .map(|n| (*n).to_owned())
        .collect();
    Verdict::Release(Release {
        workload,
        freed,
        excluded,
        record,
        since,
    })
}

/// The workload's exclusion record, unless it has expired.
fn in_force<'a>(view: &View<'a>, workload: &Workload) -> Option<&'a Record> {
    view.exclusions
        .records
        .get(workload.key())
        .filter(|r| !r.is_expired(view.now))
}

fn new_record(pod: &Pod, workload: &Workload, now: Timestamp) -> Record {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let (kind, name) = match workload {
        Workload::Owned { kind, name, .. } => (kind.clone(), name.clone()),
        Workload::Bare { .. } => ("Pod".to_owned(), pod.metadata.name.clone().unwrap_or_default()),
    };
    Record {
        namespace,
        kind,
        name,
        nodes: BTreeMap::new(),
        moves: 0,
        expires: now,
        exhausted: None,
    }
}

/// The per-round caps (`0`: no cap), and what this round has used of them.
#[derive(Clone, Debug, Default)]
pub struct Budget {
    pub total: u32,
    pub per_namespace: u32,
    pub per_node: u32,
    pub per_owner: u32,
    used_total: u32,
    used: BTreeMap<(u8, String), u32>,
}

impl Budget {
    pub fn new(total: u32, per_namespace: u32, per_node: u32, per_owner: u32) -> Self {
        Self {
            total,
            per_namespace,
            per_node,
            per_owner,
            ..Default::default()
        }
    }

    /// Takes one move for a pod of `namespace` on `node` of workload `owner`; `Err` names the
    /// cap that is reached (nothing is taken then).
    pub fn take(&mut self, namespace: &str, node: &str, owner: &str) -> Result<(), &'static str> {
        self.take_on(namespace, Some(node), owner)
    }

    /// As [`Budget::take`], for a pod bound to no node: the per-node cap does not apply.
    pub fn take_unbound(&mut self, namespace: &str, owner: &str) -> Result<(), &'static str> {
        self.take_on(namespace, None, owner)
    }

    fn take_on(&mut self, namespace: &str, node: Option<&str>, owner: &str) -> Result<(), &'static str> {
        let within = |cap: u32, used: u32| cap == 0 || used < cap;
        if !within(self.total, self.used_total) {
            return Err("--max-pods-to-evict-total");
        }
        let checks = [
            (
                0u8,
                Some(namespace),
                self.per_namespace,
                "--max-pods-to-evict-per-namespace",
            ),
            (1, node, self.per_node, "--max-pods-to-evict-per-node"),
            (2, Some(owner), self.per_owner, "--max-pods-to-evict-per-owner"),
        ];
        for (kind, key, cap, flag) in checks {
            let Some(key) = key else { continue };
            let used = self.used.get(&(kind, key.to_owned())).copied().unwrap_or(0);
            if !within(cap, used) {
                return Err(flag);
            }
        }
        self.used_total += 1;
        for (kind, key) in [(0u8, Some(namespace)), (1, node), (2, Some(owner))] {
            if let Some(key) = key {
                *self.used.entry((kind, key.to_owned())).or_insert(0) += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    const NOW: &str = "2024-05-01T10:00:00Z";

    fn node(name: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"type": "virtual-kubelet", "kubernetes.io/hostname": name}},
            "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "value": "tensile", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap()
    }

    fn nodes(names: &[&str]) -> BTreeMap<String, Node> {
        names.iter().map(|n| (n.to_string(), node(n))).collect()
    }

    /// A pod of ReplicaSet `web-1` on `vn-a`, refused below since `since`.
    fn refused(since: &str) -> serde_json::Value {
        json!({
            "metadata": {"name": "web-1-x", "namespace": "shop", "uid": "pod-uid",
                "labels": {"virtual-pod": "true"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-1", "uid": "rs-uid", "controller": true}]},
            "spec": {
                "nodeName": "vn-a",
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            },
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "tensile.io/LowerPodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/8 nodes are available: 8 Insufficient cpu.", "lastTransitionTime": since}]},
        })
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn judge_with(p: &Pod, names: &[&str], ex: &Exclusions, now: &str, settings: &Settings) -> Verdict {
        let nodes = nodes(names);
        let view = View {
            nodes: &nodes,
            exclusions: ex,
            now: t(now),
        };
        judge(p, &view, settings)
    }

    fn judged(p: &Pod) -> Verdict {
        judge_with(
            p,
            &["vn-a", "vn-b"],
            &Exclusions::default(),
            NOW,
            &Settings::default(),
        )
    }

    fn record(nodes: &[(&str, &str)], moves: u32, exhausted: bool) -> Exclusions {
        let nodes: BTreeMap<String, Timestamp> = nodes.iter().map(|(n, u)| (n.to_string(), t(u))).collect();
        let expires = nodes.values().copied().max().unwrap_or(t(NOW));
        let mut ex = Exclusions::default();
        ex.records.insert(
            "rs-uid".into(),
            Record {
                namespace: "shop".into(),
                kind: "ReplicaSet".into(),
                name: "web-1".into(),
                nodes,
                moves,
                expires,
                exhausted: exhausted.then(|| t(NOW)),
            },
        );
        ex
    }

    #[test]
    fn a_pod_refused_below_for_longer_than_the_threshold_moves_and_its_node_is_excluded() {
        let Verdict::Move(m) = judged(&pod(refused("2024-05-01T09:58:00Z"))) else {
            panic!("expected a move")
        };
        assert_eq!(m.refusal.node, "vn-a");
        assert_eq!(m.refusal.message, "0/8 nodes are available: 8 Insufficient cpu.");
        assert_eq!(m.workload.key(), "rs-uid");
        assert_eq!(m.workload.describe("web-1-x"), "ReplicaSet/web-1");
        assert_eq!(m.targets, vec!["vn-b"]);
        assert_eq!(m.record.moves, 1);
        assert_eq!(
            m.record.nodes["vn-a"],
            t("2024-05-01T10:10:00Z"),
            "excluded for the TTL"
        );
        assert!(m.record_changed);
    }

    #[test]
    fn a_refusal_younger_than_the_threshold_waits_for_it_whatever_the_pods_age() {
        assert_eq!(
            judged(&pod(refused("2024-05-01T09:59:30Z"))),
            Verdict::WaitUntil(t("2024-05-01T10:00:30Z"))
        );
    }

    #[test]
    fn a_pod_the_lower_cluster_makes_room_for_is_not_refused_until_the_nomination_is_too_old() {
        let nominated = |since: serde_json::Value| {
            let mut v = refused("2024-05-01T09:00:00Z");
            v["status"]["conditions"].as_array_mut().unwrap().push(json!(
                {"type": "tensile.io/LowerPodNominated", "status": "True", "reason": "Preempting",
                 "message": "the lower scheduler preempted pods on node low-2 for this pod", "lastTransitionTime": since}));
            pod(v)
        };
        // Refused for an hour, nominated for 2 minutes: it waits for the bound.
        assert_eq!(
            judged(&nominated(json!("2024-05-01T09:58:00Z"))),
            Verdict::WaitUntil(t("2024-05-01T10:13:00Z"))
        );
        // Nominated for the whole bound: it no longer protects, the pod moves.
        assert!(matches!(
            judged(&nominated(json!("2024-05-01T09:45:00Z"))),
            Verdict::Move(_)
        ));
        // A nomination without a time cannot be bounded, and protects nothing.
        assert!(matches!(judged(&nominated(json!(null))), Verdict::Move(_)));
        // Nor does one that ended (False).
        let mut v = serde_json::to_value(nominated(json!("2024-05-01T09:58:00Z"))).unwrap();
        v["status"]["conditions"][2]["status"] = json!("False");
        assert!(matches!(judged(&pod(v)), Verdict::Move(_)));
        // A refusal younger than the threshold waits for the threshold first.
        let mut v = serde_json::to_value(nominated(json!("2024-05-01T09:59:50Z"))).unwrap();
        v["status"]["conditions"][1]["lastTransitionTime"] = json!("2024-05-01T09:59:50Z");
        assert_eq!(judged(&pod(v)), Verdict::WaitUntil(t("2024-05-01T10:00:50Z")));
    }

    #[test]
    fn pods_that_are_running_deleted_or_refused_for_another_reason_are_not_candidates() {
        let mut v = refused("2024-05-01T09:00:00Z");
        v["status"]["phase"] = json!("Running");
        assert_eq!(judged(&pod(v)), Verdict::Ignore);
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["deletionTimestamp"] = json!(NOW);
        assert_eq!(judged(&pod(v)), Verdict::Ignore);
        let mut v = refused("2024-05-01T09:00:00Z");
        v["status"]["conditions"][1]["reason"] = json!("SchedulingGated");
        assert_eq!(judged(&pod(v)), Verdict::Ignore, "a lower queue holds it");
        let mut v = refused("2024-05-01T09:00:00Z");
        v["spec"]["nodeName"] = json!("real-node");
        assert_eq!(judged(&pod(v)), Verdict::Ignore, "not on a virtual node");
    }

    #[test]
    fn a_pod_on_a_node_that_is_not_ready_stays_for_taint_eviction() {
        let mut nodes = nodes(&["vn-a", "vn-b"]);
        if let Some(n) = nodes.get_mut("vn-a") {
            n.status =
                serde_json::from_value(json!({"conditions": [{"type": "Ready", "status": "Unknown"}]}))
                    .unwrap();
        }
        let ex = Exclusions::default();
        let view = View {
            nodes: &nodes,
            exclusions: &ex,
            now: t(NOW),
        };
        let v = judge(&pod(refused("2024-05-01T09:00:00Z")), &view, &Settings::default());
        assert!(
            matches!(
                v,
                Verdict::Skip {
                    why: Skip::NodeNotReady,
                    ..
                }
            ),
            "{v:?}"
        );
    }

    #[test]
    fn daemonset_mirror_critical_opted_out_and_volume_pinned_pods_never_move() {
        let cases: Vec<(serde_json::Value, Skip)> = vec![
            (
                json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "d", "controller": true}]}}),
                Skip::DaemonSet,
            ),
            (
                json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}}),
                Skip::Mirror,
            ),
            (
                json!({"spec": {"priorityClassName": "system-node-critical"}}),
                Skip::SystemCritical,
            ),
            (
                json!({"metadata": {"annotations": {"tensile.io/deschedule": "false"}}}),
                Skip::OptedOut,
            ),
            (
                json!({"metadata": {"annotations": {"descheduler.alpha.kubernetes.io/prefer-no-eviction": ""}}}),
                Skip::OptedOut,
            ),
            (
                json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vn-a"]}]}]}}}}}),
                Skip::VolumePinned,
            ),
        ];
        for (patch, want) in cases {
            let mut v = refused("2024-05-01T09:00:00Z");
            for (section, fields) in patch.as_object().unwrap() {
                for (k, val) in fields.as_object().unwrap() {
                    v[section][k] = val.clone();
                }
            }
            match judged(&pod(v)) {
                Verdict::Skip { why, .. } => assert_eq!(why, want),
                other => panic!("{want:?}: got {other:?}"),
            }
        }
    }

    #[test]
    fn a_bare_pod_moves_only_when_it_opts_in_or_the_flag_says_so() {
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["ownerReferences"] = json!(null);
        let bare = pod(v.clone());
        assert!(matches!(
            judged(&bare),
            Verdict::Skip {
                why: Skip::BarePod(BarePods::Annotated),
                ..
            }
        ));
        let settings = Settings {
            bare_pods: BarePods::All,
            ..Settings::default()
        };
        let Verdict::Move(m) = judge_with(&bare, &["vn-a", "vn-b"], &Exclusions::default(), NOW, &settings)
        else {
            panic!("the flag moves it")
        };
        assert_eq!(
            m.workload,
            Workload::Bare {
                lineage: "pod-uid".into()
            }
        );
        let mut annotated = v.clone();
        annotated["metadata"]["annotations"] = json!({"descheduler.alpha.kubernetes.io/evict": "true"});
        let off = Settings {
            bare_pods: BarePods::Off,
            ..Settings::default()
        };
        let skipped = judge_with(
            &pod(annotated),
            &["vn-a", "vn-b"],
            &Exclusions::default(),
            NOW,
            &off,
        );
        let Verdict::Skip { why, .. } = skipped else {
            panic!("off moves no bare pod, annotated or not: {skipped:?}")
        };
        assert_eq!(why, Skip::BarePod(BarePods::Off));
        assert_eq!(
            why.to_string(),
            "it is a bare pod and bare pods are not moved (--bare-pods=off)"
        );
        v["metadata"]["annotations"] =
            json!({"descheduler.alpha.kubernetes.io/evict": "true", "tensile.io/lineage": "first-uid"});
        let Verdict::Move(m) = judged(&pod(v)) else {
            panic!("the annotation moves it")
        };
        assert_eq!(
            m.workload.key(),
            "first-uid",
            "a line of replacements shares one record"
        );
    }

    #[test]
    fn a_pod_no_other_virtual_node_would_take_stays_and_says_why() {
        let p = pod(refused("2024-05-01T09:00:00Z"));
        match judge_with(&p, &["vn-a"], &Exclusions::default(), NOW, &Settings::default()) {
            Verdict::Skip {
                why: Skip::NoOtherNode(_),
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        let mut v = refused("2024-05-01T09:00:00Z");
        v["spec"]["nodeSelector"] = json!({"region": "eu"});
        match judged(&pod(v)) {
            Verdict::Skip {
                why: Skip::NoOtherNode(why),
                ..
            } => assert!(why[0].contains("nodeSelector"), "{why:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_second_pod_of_a_workload_already_kept_off_the_node_moves_without_counting_a_move() {
        // vn-a was excluded at 09:55 (until 10:05, TTL 10 min); this pod is older than that.
        let ex = record(&[("vn-a", "2024-05-01T10:05:00Z")], 1, false);
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["creationTimestamp"] = json!("2024-05-01T09:50:00Z");
        let Verdict::Move(m) = judge_with(&pod(v), &["vn-a", "vn-b"], &ex, NOW, &Settings::default()) else {
            panic!("moves")
        };
        assert_eq!(m.record.moves, 1);
        assert!(!m.record_changed, "nothing to write");
    }

    #[test]
    fn a_pod_that_escaped_its_workloads_exclusion_counts_every_move_until_it_is_given_up_on() {
        // A replacement created after vn-a was excluded (its template bypassed the webhook)
        // and refused by vn-a again: every such move counts, so the loop ends at the bound.
        let mut v = refused("2024-05-01T09:59:00Z");
        v["metadata"]["creationTimestamp"] = json!("2024-05-01T09:56:00Z");
        let escaped = pod(v);
        let mut moves = 1;
        let mut ex = record(&[("vn-a", "2024-05-01T10:05:00Z")], moves, false);
        loop {
            match judge_with(&escaped, &["vn-a", "vn-b"], &ex, NOW, &Settings::default()) {
                Verdict::Move(m) => {
                    assert_eq!(m.record.moves, moves + 1, "the move counts");
                    assert!(m.record_changed, "the count is written");
                    moves = m.record.moves;
                    ex.records.insert("rs-uid".into(), m.record);
                }
                Verdict::GiveUp(g) => {
                    assert_eq!(g.record.moves, 3, "given up at --max-moves-per-owner");
                    break;
                }
                other => panic!("{other:?}"),
            }
            assert!(moves <= 3, "the loop has a bound");
        }
    }

    #[test]
    fn pods_the_suite_does_not_serve_are_never_moved() {
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["labels"] = json!({"app": "web"});
        assert_eq!(judged(&pod(v)), Verdict::Ignore, "not opted in");
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["labels"] = json!({"virtual-pod": "false"});
        assert_eq!(judged(&pod(v)), Verdict::Ignore, "opted out by value");
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["namespace"] = json!("kube-system");
        assert_eq!(
            judged(&pod(v.clone())),
            Verdict::Ignore,
            "a namespace the webhook skips"
        );
        let settings = Settings {
            excluded_namespaces: BTreeSet::from(["tensile".to_owned()]),
            ..Settings::default()
        };
        let moved = judge_with(&pod(v), &["vn-a", "vn-b"], &Exclusions::default(), NOW, &settings);
        assert!(
            matches!(moved, Verdict::Move(_)),
            "kube-system served when the flag says so: {moved:?}"
        );
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["labels"] = json!({"tensile": "yes"});
        let settings = Settings {
            pod_label: ("tensile".into(), "yes".into()),
            ..Settings::default()
        };
        let moved = judge_with(&pod(v), &["vn-a", "vn-b"], &Exclusions::default(), NOW, &settings);
        assert!(matches!(moved, Verdict::Move(_)), "{moved:?}");
    }

    /// A pod whose lower create failed with `reason` since `since`.
    fn create_failed(reason: &str, since: &str) -> serde_json::Value {
        let mut v = refused(since);
        v["status"]["conditions"] = json!([
            {"type": "PodScheduled", "status": "True"},
            {"type": "tensile.io/LowerPodSynced", "status": "False", "reason": reason,
             "message": "lower cluster vn-a rejected the pod: pods \"web-1-x\" is forbidden: exceeded quota: compute, requested: cpu=3, used: cpu=8, limited: cpu=10",
             "lastTransitionTime": since}]);
        v
    }

    #[test]
    fn a_lower_create_failure_another_cluster_could_resolve_is_a_refusal_after_the_same_threshold() {
        let Verdict::Move(m) = judged(&pod(create_failed("CreateFailed", "2024-05-01T09:58:00Z"))) else {
            panic!("a create failure moves")
        };
        assert_eq!(m.refusal.node, "vn-a");
        assert_eq!(m.refusal.reason, "CreateFailed");
        assert!(
            m.refusal.message.contains("exceeded quota"),
            "{}",
            m.refusal.message
        );
        assert_eq!(m.targets, vec!["vn-b"]);
        assert_eq!(
            judged(&pod(create_failed("CreateFailed", "2024-05-01T09:59:30Z"))),
            Verdict::WaitUntil(t("2024-05-01T10:00:30Z")),
            "the threshold holds as for the lower scheduler's refusals"
        );
    }

    #[test]
    fn conflicts_untrusted_stashes_and_other_sync_failures_never_move() {
        for reason in [
            "Conflict",
            "StashNotTrusted",
            "InvalidPod",
            "ReferenceMissing",
            "DaemonSetPod",
        ] {
            assert_eq!(
                judged(&pod(create_failed(reason, "2024-05-01T09:00:00Z"))),
                Verdict::Ignore,
                "{reason}"
            );
        }
    }

    /// A pod of Job `batch` refused below, as `finalizer` or not (1.26+ or 1.20).
    fn job_pod(finalizer: bool) -> Pod {
        let mut v = refused("2024-05-01T09:00:00Z");
        v["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": "batch",
            "uid": "job-uid", "controller": true, "blockOwnerDeletion": true}]);
        v["spec"]["restartPolicy"] = json!("Never");
        if finalizer {
            v["metadata"]["finalizers"] = json!(["batch.kubernetes.io/job-tracking"]);
        }
        pod(v)
    }

    fn job(policy: serde_json::Value) -> Job {
        let mut v = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "batch", "namespace": "shop", "uid": "job-uid"},
            "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "c", "image": "busybox"}]}}}});
        if !policy.is_null() {
            v["spec"]["podFailurePolicy"] = policy;
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_job_pod_as_1_20_writes_it_moves_as_before() {
        let p = job_pod(false);
        let v = with_job(judged(&p), &p, None);
        let Verdict::Move(m) = v else {
            panic!("no tracking finalizer: a deleted Pending pod is no failure: {v:?}")
        };
        assert_eq!(m.workload.describe("x"), "Job/batch");
    }

    #[test]
    fn a_job_pod_tracked_by_finalizer_stays_unless_its_job_ignores_evictions() {
        let p = job_pod(true);
        let v = with_job(judged(&p), &p, Some(&job(json!(null))));
        let Verdict::Skip {
            why: Skip::JobWouldFail(why),
            node,
        } = v
        else {
            panic!("a move would fail the Job: {v:?}")
        };
        assert_eq!(node, "vn-a");
        assert!(
            why.contains("onPodConditions: [{type: DisruptionTarget}]"),
            "{why}"
        );
        let ignores = job(json!({"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}));
        assert!(matches!(
            with_job(judged(&p), &p, Some(&ignores)),
            Verdict::Move(_)
        ));
        assert!(
            matches!(with_job(judged(&p), &p, None), Verdict::Skip { .. }),
            "an unreadable Job keeps the pod"
        );
    }

    #[test]
    fn an_exclusion_that_would_leave_no_virtual_node_drops_the_oldest_instead() {
        // vn-b was excluded earlier; now vn-a refuses too: vn-b becomes usable again.
        let ex = record(&[("vn-b", "2024-05-01T10:03:00Z")], 1, false);
        let Verdict::Move(m) = judge_with(
            &pod(refused("2024-05-01T09:00:00Z")),
            &["vn-a", "vn-b"],
            &ex,
            NOW,
            &Settings::default(),
        ) else {
            panic!("moves")
        };
        assert_eq!(m.record.nodes.keys().collect::<Vec<_>>(), ["vn-a"]);
        assert_eq!(m.targets, vec!["vn-b"]);
        assert_eq!(m.record.moves, 2);
    }

    #[test]
    fn after_the_maximum_of_moves_the_workload_is_given_up_on_once_then_left_alone() {
        let ex = record(&[("vn-b", "2024-05-01T10:03:00Z")], 3, false);
        let p = pod(refused("2024-05-01T09:00:00Z"));
        let Verdict::GiveUp(g) = judge_with(&p, &["vn-a", "vn-b"], &ex, NOW, &Settings::default()) else {
            panic!("gives up")
        };
        assert_eq!(g.record.exhausted, Some(t(NOW)));
        let ex = record(&[("vn-b", "2024-05-01T10:03:00Z")], 3, true);
        assert!(matches!(
            judge_with(&p, &["vn-a", "vn-b"], &ex, NOW, &Settings::default()),
            Verdict::Skip {
                why: Skip::Exhausted,
                ..
            }
        ));
        // Once the record expires, the workload starts afresh.
        let Verdict::Move(m) = judge_with(
            &p,
            &["vn-a", "vn-b"],
            &ex,
            "2024-05-01T10:04:00Z",
            &Settings::default(),
        ) else {
            panic!("moves again after the TTL")
        };
        assert_eq!(m.record.moves, 1);
    }

    #[test]
    fn an_expired_exclusion_no_longer_counts() {
        let ex = record(&[("vn-a", "2024-05-01T09:30:00Z")], 1, false);
        let Verdict::Move(m) = judge_with(
            &pod(refused("2024-05-01T09:00:00Z")),
            &["vn-a", "vn-b"],
            &ex,
            NOW,
            &Settings::default(),
        ) else {
            panic!("moves")
        };
        assert_eq!(m.record.moves, 1, "a fresh record");
        assert!(m.record_changed);
    }

    #[test]
    fn round_caps_hold_per_namespace_node_owner_and_in_total() {
        let mut b = Budget::new(3, 0, 2, 1);
        assert_eq!(b.take("a", "vn-a", "rs1"), Ok(()));
        assert_eq!(b.take("a", "vn-a", "rs1"), Err("--max-pods-to-evict-per-owner"));
        assert_eq!(b.take("a", "vn-a", "rs2"), Ok(()));
        assert_eq!(b.take("b", "vn-a", "rs3"), Err("--max-pods-to-evict-per-node"));
        assert_eq!(b.take("b", "vn-b", "rs3"), Ok(()));
        assert_eq!(b.take("c", "vn-c", "rs4"), Err("--max-pods-to-evict-total"));
        let mut b = Budget::new(0, 1, 0, 0);
        assert_eq!(b.take("a", "x", "1"), Ok(()));
        assert_eq!(b.take("a", "y", "2"), Err("--max-pods-to-evict-per-namespace"));
    }

    /// A virtual node whose lower nodes each have `cpu` free.
    fn shaped(name: &str, cpu: &str) -> Node {
        let shape = json!({"v": 2, "at": NOW, "keys": [], "nodes": 2, "truncated": false,
            "groups": [{"count": 2, "truncated": false, "free": [{"cpu": cpu, "memory": "8Gi", "pods": "100"}]}]});
        let mut n = node(name);
        n.metadata.annotations = Some(BTreeMap::from([(
            names::NODE_CAPACITY_SHAPE.to_owned(),
            shape.to_string(),
        )]));
        n
    }

    fn judge_among(p: &Pod, nodes: Vec<Node>, ex: &Exclusions) -> Verdict {
        let nodes: BTreeMap<String, Node> = nodes
            .into_iter()
            .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
            .collect();
        let view = View {
            nodes: &nodes,
            exclusions: ex,
            now: t(NOW),
        };
        judge(p, &view, &Settings::default())
    }

    #[test]
    fn the_replacement_is_steered_to_the_node_that_fits_not_to_one_the_shape_rules_out() {
        // vn-a refused the 3-CPU pod; vn-c's lower nodes have 2 CPUs free, vn-b's have 8.
        let p = pod(refused("2024-05-01T09:58:00Z"));
        let Verdict::Move(m) = judge_among(
            &p,
            vec![shaped("vn-a", "8"), shaped("vn-b", "8"), shaped("vn-c", "2")],
            &Exclusions::default(),
        ) else {
            panic!("expected a move")
        };
        assert_eq!(m.targets, vec!["vn-b"]);
        let excluded: Vec<&str> = m.record.nodes.keys().map(String::as_str).collect();
        assert_eq!(
            excluded,
            vec!["vn-a", "vn-c"],
            "the replacement can only land on vn-b"
        );
        assert_eq!(m.record.moves, 1, "ruling vn-c out is not a move");
        assert!(m.record_changed);

        // A sibling refused by vn-a, there before the exclusion, adds nothing: the record stands.
        let mut sibling = refused("2024-05-01T09:58:00Z");
        sibling["metadata"]["creationTimestamp"] = json!("2024-05-01T09:50:00Z");
        let Verdict::Move(again) = judge_among(
            &pod(sibling),
            vec![shaped("vn-a", "8"), shaped("vn-b", "8"), shaped("vn-c", "2")],
            &record(
                &[("vn-a", "2024-05-01T10:09:00Z"), ("vn-c", "2024-05-01T10:09:00Z")],
                1,
                false,
            ),
        ) else {
            panic!("expected a move")
        };
        assert!(!again.record_changed);
        assert_eq!(again.record.moves, 1);
    }

    #[test]
    fn steering_never_excludes_every_node_that_fits() {
        // vn-b refused the workload before (excluded), vn-c cannot hold it by its shape, and
        // now vn-a refuses: vn-b's exclusion goes, vn-c's stays.
        let p = pod(refused("2024-05-01T09:58:00Z"));
        let Verdict::Move(m) = judge_among(
            &p,
            vec![shaped("vn-a", "8"), shaped("vn-b", "8"), shaped("vn-c", "2")],
            &record(&[("vn-b", "2024-05-01T10:05:00Z")], 1, false),
        ) else {
            panic!("expected a move")
        };
        let excluded: Vec<&str> = m.record.nodes.keys().map(String::as_str).collect();
        assert_eq!(excluded, vec!["vn-a", "vn-c"]);
        assert_eq!(m.targets, vec!["vn-b"]);

        // No node fits at all: nothing is excluded, the pod stays.
        let verdict = judge_among(
            &p,
            vec![shaped("vn-a", "8"), shaped("vn-c", "2")],
            &Exclusions::default(),
        );
        assert!(
            matches!(
                verdict,
                Verdict::Skip {
                    why: Skip::NoOtherNode(_),
                    ..
                }
            ),
            "{verdict:?}"
        );
    }

    /// A replacement of ReplicaSet `web-1` the webhook kept off `excluded`, which the upper
    /// scheduler has not placed since `since`.
    fn unplaced(excluded: &str, since: &str) -> Pod {
        let mut v = refused(since);
        v["spec"]["nodeName"] = serde_json::Value::Null;
        v["metadata"]["annotations"] = json!({"tensile.io/excluded-nodes": excluded});
        v["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": excluded.split(',').collect::<Vec<_>>()}]}]}}});
        v["status"] = json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node affinity.",
             "lastTransitionTime": since}]});
        pod(v)
    }

    #[test]
    fn an_unplaced_pod_kept_off_a_node_whose_cluster_freed_up_is_recreated_and_the_node_leaves_the_record() {
        // Excluded from vn-a until 10:09; vn-b is full upstream; vn-a's lower nodes now have 8 CPUs free.
        let p = unplaced("vn-a", "2024-05-01T09:58:00Z");
        let ex = record(&[("vn-a", "2024-05-01T10:09:00Z")], 1, false);
        let Verdict::Release(r) = judge_among(&p, vec![shaped("vn-a", "8"), shaped("vn-b", "8")], &ex) else {
            panic!("expected a release")
        };
        assert_eq!(r.workload.key(), "rs-uid");
        assert_eq!(r.freed, vec!["vn-a"]);
        assert!(r.excluded.is_empty());
        let record = r.record.expect("the record is written");
        assert!(record.nodes.is_empty(), "vn-a leaves the record: {record:?}");
        assert_eq!(record.moves, 1, "a release is not a move");
        assert_eq!(r.since, t("2024-05-01T09:58:00Z"));
    }

    #[test]
    fn an_unplaced_pod_stays_while_its_excluded_cluster_still_cannot_hold_it_and_after_the_ttl_too() {
        // vn-a's lower nodes have 2 CPUs free: without the exclusion the pod would only wait
        // on vn-a instead.
        let p = unplaced("vn-a", "2024-05-01T09:58:00Z");
        let nodes = || vec![shaped("vn-a", "2"), shaped("vn-b", "8")];
        let in_force = record(&[("vn-a", "2024-05-01T10:09:00Z")], 1, false);
        assert_eq!(judge_among(&p, nodes(), &in_force), Verdict::Ignore);
        let lapsed = record(&[("vn-a", "2024-05-01T09:59:00Z")], 1, false);
        assert_eq!(judge_among(&p, nodes(), &lapsed), Verdict::Ignore);
    }

    #[test]
    fn an_unplaced_pod_whose_exclusion_lapsed_is_recreated_even_where_the_shape_cannot_say() {
        // No shapes: vn-a's exclusion in force → wait for its end; lapsed → recreate, no write.
        let p = unplaced("vn-a", "2024-05-01T09:58:00Z");
        let in_force = record(&[("vn-a", "2024-05-01T10:09:00Z")], 1, false);
        assert_eq!(
            judge_with(&p, &["vn-a", "vn-b"], &in_force, NOW, &Settings::default()),
            Verdict::WaitUntil(t("2024-05-01T10:09:00Z"))
        );
        for ex in [
            record(&[("vn-a", "2024-05-01T09:59:00Z")], 1, false),
            Exclusions::default(),
        ] {
            let Verdict::Release(r) = judge_with(&p, &["vn-a", "vn-b"], &ex, NOW, &Settings::default())
            else {
                panic!("expected a release")
            };
            assert_eq!(r.freed, vec!["vn-a"]);
            assert_eq!(r.record, None, "nothing in force to lift");
        }
    }

    #[test]
    fn only_unplaced_pods_carrying_our_exclusion_for_the_threshold_on_a_node_that_would_take_them_are_recreated()
     {
        let ex = Exclusions::default();
        let settings = Settings::default();
        let judge = |p: &Pod| judge_with(p, &["vn-a", "vn-b"], &ex, NOW, &settings);
        // Unplaced for 30 s only: look again when the threshold is reached.
        assert_eq!(
            judge(&unplaced("vn-a", "2024-05-01T09:59:30Z")),
            Verdict::WaitUntil(t("2024-05-01T10:00:30Z"))
        );
        // No exclusion of ours: the pod is unplaced for reasons of its own.
        let mut v = serde_json::to_value(unplaced("vn-a", "2024-05-01T09:58:00Z")).unwrap();
        v["metadata"]["annotations"] = json!({});
        assert_eq!(judge(&pod(v)), Verdict::Ignore);
        // Not unplaced by the scheduler (gated, or just created).
        let mut v = serde_json::to_value(unplaced("vn-a", "2024-05-01T09:58:00Z")).unwrap();
        v["status"]["conditions"][0]["reason"] = json!("SchedulingGated");
        assert_eq!(judge(&pod(v)), Verdict::Ignore);
        // The excluded node is gone, or the upper scheduler keeps the pod off it anyway.
        assert_eq!(
            judge(&unplaced("vn-gone", "2024-05-01T09:58:00Z")),
            Verdict::Ignore
        );
        let mut cordoned = shaped("vn-a", "8");
        cordoned.spec.get_or_insert_default().unschedulable = Some(true);
        assert_eq!(
            judge_among(
                &unplaced("vn-a", "2024-05-01T09:58:00Z"),
                vec![cordoned, shaped("vn-b", "8")],
                &ex
            ),
            Verdict::Ignore
        );
        // Opted out: left as it is.
        let mut v = serde_json::to_value(unplaced("vn-a", "2024-05-01T09:58:00Z")).unwrap();
        v["metadata"]["annotations"]["tensile.io/deschedule"] = json!("false");
        assert_eq!(judge(&pod(v)), Verdict::Ignore);
        // Not the suite's: not opted in.
        let mut v = serde_json::to_value(unplaced("vn-a", "2024-05-01T09:58:00Z")).unwrap();
        v["metadata"]["labels"] = json!({});
        assert_eq!(judge(&pod(v)), Verdict::Ignore);
    }

    #[test]
    fn an_unplaced_pod_freed_from_one_node_keeps_avoiding_the_others_in_force() {
        // Excluded from vn-a (its cluster freed up) and vn-c (still too small), both in force.
        let p = unplaced("vn-a,vn-c", "2024-05-01T09:58:00Z");
        let ex = record(
            &[("vn-a", "2024-05-01T10:09:00Z"), ("vn-c", "2024-05-01T10:08:00Z")],
            2,
            false,
        );
        let Verdict::Release(r) = judge_among(
            &p,
            vec![shaped("vn-a", "8"), shaped("vn-b", "8"), shaped("vn-c", "2")],
            &ex,
        ) else {
            panic!("expected a release")
        };
        assert_eq!(r.freed, vec!["vn-a"]);
        assert_eq!(r.excluded, vec!["vn-c"]);
        let record = r.record.unwrap();
        assert_eq!(record.nodes.keys().collect::<Vec<_>>(), ["vn-c"]);
        assert_eq!(record.moves, 2);
    }

    #[test]
    fn a_job_pod_tracked_by_finalizer_is_not_recreated_unless_its_job_ignores_evictions() {
        let mut v = serde_json::to_value(unplaced("vn-a", "2024-05-01T09:58:00Z")).unwrap();
        v["metadata"]["finalizers"] = json!(["batch.kubernetes.io/job-tracking"]);
        v["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": "batch", "uid": "job-uid", "controller": true}]);
        let p = pod(v);
        let verdict = judge_with(
            &p,
            &["vn-a", "vn-b"],
            &Exclusions::default(),
            NOW,
            &Settings::default(),
        );
        assert!(matches!(verdict, Verdict::Release(_)), "{verdict:?}");
        let job: Job = serde_json::from_value(
            json!({"metadata": {"name": "batch", "uid": "job-uid"}, "spec": {"template": {}}}),
        )
        .unwrap();
        assert!(matches!(
            with_job(verdict, &p, Some(&job)),
            Verdict::Skip {
                why: Skip::JobWouldFail(_),
                ..
            }
        ));
    }

    #[test]
    fn an_unbound_pod_takes_no_per_node_budget() {
        let mut b = Budget::new(0, 0, 1, 0);
        assert_eq!(b.take("a", "vn-a", "1"), Ok(()));
        assert_eq!(b.take_unbound("a", "2"), Ok(()));
        assert_eq!(b.take_unbound("a", "3"), Ok(()));
        let mut b = Budget::new(0, 0, 0, 1);
        assert_eq!(b.take_unbound("a", "1"), Ok(()));
        assert_eq!(b.take_unbound("a", "1"), Err("--max-pods-to-evict-per-owner"));
    }
}
