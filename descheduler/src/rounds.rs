//! The descheduling loop: a round reads the caches, asks [`crate::decide`] about every
//! pending pod, and performs what it says within the round's caps. A round runs when a pod
//! or node changes, when a refusal reaches the threshold, and every
//! `--descheduling-interval` regardless.
//!
//! The round's list of pods only sets the order: each pod is judged as the cache holds it
//! right before acting on it (earlier moves of the round take time: a record write waits
//! for its watch), and its eviction requires the resourceVersion it was judged at. A round
//! also ends every bare-pod pair that still has two pods ([`crate::pairs`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::Resource as _;
use kube::api::{Api, ListParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use tensile_common::cache::Cache;
use tensile_common::exclusion::Exclusions;
use tensile_common::runtime::{CancellationToken, CrashPoints};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::bare;
use crate::decide::{self, Budget, GiveUp, Move, Release, Settings, Skip, Verdict, Workload};
use crate::job;
use crate::metrics::{Metrics, NodeLabels, ReasonLabels, ResultLabels};
use crate::pairs::{self, PairStep};
use crate::rebalance;
use crate::store::{self, Store};
use tensile_common::evict::{self, Evicted};

/// The eviction caps (`0`: none), per `--descheduling-interval`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caps {
    pub total: u32,
    pub per_namespace: u32,
    pub per_node: u32,
    pub per_owner: u32,
}

/// The caps' window. Rounds run whenever pods or nodes change (the descheduler's own
/// evictions included), so caps per round would bound nothing over a minute; as
/// kubernetes-sigs/descheduler bounds evictions per descheduling cycle, the caps bound the
/// evictions of every round within one `--descheduling-interval`, counted from the
/// window's first eviction.
#[derive(Debug)]
pub(crate) struct Window {
    /// When its first eviction was made (`None`: none yet, and it stays open).
    opened: Option<Instant>,
    budget: Budget,
}

impl Window {
    fn new(caps: Caps) -> Self {
        Self {
            opened: None,
            budget: Budget::new(caps.total, caps.per_namespace, caps.per_node, caps.per_owner),
        }
    }

    /// Whether the window is still open at `now`.
    fn open(&self, now: Instant, interval: Duration) -> bool {
        self.opened
            .is_none_or(|opened| now.duration_since(opened) < interval)
    }

    /// Takes one eviction of pod of `namespace` on `node` (`None`: unbound) of workload
    /// `owner` from the window's budget; `Err`: which cap it reached.
    fn take(&mut self, namespace: &str, node: Option<&str>, owner: &str) -> Result<(), &'static str> {
        match node {
            Some(node) => self.budget.take(namespace, node, owner),
            None => self.budget.take_unbound(namespace, owner),
        }?;
        self.opened.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// When the window closes, on the wall clock whose time is `now` now.
    fn closes(&self, now: Timestamp, interval: Duration) -> Timestamp {
        let left = self
            .opened
            .map_or(Duration::ZERO, |opened| interval.saturating_sub(opened.elapsed()));
        now + jiff::SignedDuration::try_from(left).unwrap_or(jiff::SignedDuration::ZERO)
    }
}

/// Rebalancing's part of the state (`--rebalance`).
pub struct Rebalancing {
    /// Running pods that opted in.
    pub running: Cache<Pod>,
    pub settings: rebalance::Settings,
    memory: Mutex<rebalance::Memory>,
    /// Why each held workload was last logged as held (logged once until it changes).
    told: Mutex<HashMap<String, &'static str>>,
}

impl Rebalancing {
    pub fn new(running: Cache<Pod>, settings: rebalance::Settings) -> Self {
        Self {
            running,
            settings,
            memory: Mutex::default(),
            told: Mutex::default(),
        }
    }
}

/// Everything a round needs.
pub struct Descheduler {
    pub client: kube::Client,
    /// Pending pods that opted in.
    pub pods: Cache<Pod>,
    /// Bare pods' replacements (label `tensile.io/replaces`), in any phase.
    pub replacements: Cache<Pod>,
    pub nodes: Cache<Node>,
    pub store: Store,
    pub settings: Settings,
    pub caps: Caps,
    pub dry_run: bool,
    pub interval: Duration,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Woken by every pod and node event.
    pub changed: Arc<Notify>,
    pub(crate) backoff: Mutex<HashMap<String, (u32, Instant)>>,
    pub(crate) told: Mutex<HashSet<(String, &'static str)>>,
    /// Replacements (UIDs) whose original is gone: their pair is over for good.
    pub(crate) settled: Mutex<HashSet<String>>,
    /// The caps' window: when it opened, and what its rounds used (see [`Window`]).
    pub(crate) window: Mutex<Option<Window>>,
    /// Jobs read for their pods, by UID. What is judged of a Job, its `podFailurePolicy`,
    /// cannot change once the Job is created, so each is read once, not on every round.
    pub(crate) jobs: Mutex<HashMap<String, Arc<Job>>>,
    /// For tests: abort the process at this step of a bare-pod move.
    pub crash_at: CrashPoints<bare::Step>,
    /// `--rebalance`.
    pub rebalancing: Option<Rebalancing>,
}

/// First retry of a pod after an API error; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// How long a workload whose eviction was refused is left out of rebalancing, at least.
const REFUSED_PAUSE: Duration = Duration::from_secs(10);
/// Events arriving together are handled in one round.
const SETTLE: Duration = Duration::from_millis(300);

impl Descheduler {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: kube::Client,
        pods: Cache<Pod>,
        replacements: Cache<Pod>,
        nodes: Cache<Node>,
        store: Store,
        settings: Settings,
        caps: Caps,
        dry_run: bool,
        interval: Duration,
        metrics: Arc<Metrics>,
        recorder: Recorder,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            client,
            pods,
            replacements,
            nodes,
            store,
            settings,
            caps,
            dry_run,
            interval,
            metrics,
            recorder,
            changed,
            backoff: Mutex::default(),
            told: Mutex::default(),
            settled: Mutex::default(),
            window: Mutex::default(),
            jobs: Mutex::default(),
            crash_at: CrashPoints::default(),
            rebalancing: None,
        }
    }

    /// Runs rounds until `stop`; a round in progress is finished first.
    pub async fn run(self, stop: CancellationToken) {
        loop {
            let due = self.round().await;
            let wait = match due {
                Some(at) => {
                    let left = Timestamp::now().duration_until(at);
                    Duration::try_from(left)
                        .unwrap_or(Duration::ZERO)
                        .min(self.interval)
                        + Duration::from_millis(100)
                }
                None => self.interval,
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.changed.notified() => tokio::time::sleep(SETTLE).await,
            }
        }
    }

    /// One round; returns when the next refusal reaches the threshold, if one is waiting.
    pub async fn round(&self) -> Option<Timestamp> {
        let started = std::time::Instant::now();
        self.settle_pairs().await;
        let nodes: BTreeMap<String, Node> = self
            .nodes
            .state()
            .into_iter()
            .filter_map(|n| n.metadata.name.clone().map(|name| (name, (*n).clone())))
            .collect();
        if !self.dry_run
            && let Some(swept) = self.store.sweep_if_due(Timestamp::now()).await
        {
            match swept {
                Ok(s) => {
                    self.metrics.exclusions_swept.inc_by(s.records as u64);
                    if s.legacy {
                        tracing::info!("deleted the old exclusions ConfigMap: it held no record in force");
                    }
                }
                Err(e) => tracing::warn!("deleting expired exclusion records: {e}"),
            }
        }
        let mut exclusions: Exclusions = (*self.store.current()).clone();
        let mut pods = self.pods.state();
        // The longest-refused first.
        pods.sort_by_key(|p| decide::refusal(p, &self.settings.reasons).map(|r| r.since));
        self.forget_gone(&pods);

        let mut window = self
            .window
            .lock()
            .ok()
            .and_then(|mut w| w.take())
            .filter(|w| w.open(Instant::now(), self.interval))
            .unwrap_or_else(|| Window::new(self.caps));
        let mut due: Option<Timestamp> = None;
        let mut candidates: BTreeMap<String, i64> = nodes.keys().map(|n| (n.clone(), 0)).collect();
        let mut skipped: BTreeMap<&'static str, i64> = BTreeMap::new();
        for listed in &pods {
            // Judged as the cache holds it now, not as the round found it.
            let Some(pod) = self.current(listed) else {
                continue;
            };
            let now = Timestamp::now();
            let view = decide::View {
                nodes: &nodes,
                exclusions: &exclusions,
                now,
            };
            let mut verdict = decide::judge(&pod, &view, &self.settings);
            if let (Verdict::Move(_) | Verdict::Release(_), Some(job)) = (&verdict, job::tracking_job(&pod)) {
                let job = self.job(&pod, job).await;
                verdict = decide::with_job(verdict, &pod, job.as_deref());
            }
            match verdict {
                Verdict::Ignore => {}
                Verdict::WaitUntil(at) => due = Some(due.map_or(at, |d| d.min(at))),
                Verdict::Skip { node, why } => {
                    *candidates.entry(node.clone()).or_default() += 1;
                    *skipped.entry(why.label()).or_default() += 1;
                    if self.first_time(&pod, why.label()) {
                        tracing::info!(pod = %key(&pod), virtual_node = %node, "left in place: {why}");
                        if let (Skip::JobWouldFail(note), false) = (&why, self.dry_run) {
                            self.event(
                                pod.object_ref(&()),
                                EventType::Warning,
                                "JobPodNotMoved",
                                &format!("the lower cluster of {node} cannot place the pod, but it is not moved: {note}"),
                            )
                            .await;
                        }
                    }
                }
                Verdict::Move(m) => {
                    *candidates.entry(m.refusal.node.clone()).or_default() += 1;
                    if self.backing_off(&pod) {
                        continue;
                    }
                    let ns = pod.metadata.namespace.clone().unwrap_or_default();
                    if let Err(cap) = window.take(&ns, Some(&m.refusal.node), m.workload.key()) {
                        self.metrics
                            .moved("limited", &m.refusal.reason, &m.refusal.node, &ns);
                        tracing::debug!(pod = %key(&pod), "not moved in this interval: {cap} reached");
                        due = Some(
                            window
                                .closes(Timestamp::now(), self.interval)
                                .min(due.unwrap_or(Timestamp::MAX)),
                        );
                        continue;
                    }
                    self.perform(&pod, &m, &mut exclusions).await;
                }
                Verdict::GiveUp(g) => self.give_up(&pod, &g, &mut exclusions).await,
                Verdict::Release(r) => {
                    if self.backing_off(&pod) {
                        continue;
                    }
                    let ns = pod.metadata.namespace.clone().unwrap_or_default();
                    if let Err(cap) = window.take(&ns, None, r.workload.key()) {
                        self.released("limited");
                        tracing::debug!(pod = %key(&pod), "not recreated in this interval: {cap} reached");
                        due = Some(
                            window
                                .closes(Timestamp::now(), self.interval)
                                .min(due.unwrap_or(Timestamp::MAX)),
                        );
                        continue;
                    }
                    self.release(&pod, &r, &mut exclusions).await;
                }
            }
        }
        if let Ok(mut kept) = self.window.lock() {
            *kept = Some(window);
        }
        if let Some(r) = &self.rebalancing {
            self.rebalance(r, &pods, &nodes, &exclusions).await;
        }
        for (node, n) in candidates {
            self.metrics
                .candidates
                .get_or_create(&NodeLabels { virtual_node: node })
                .set(n);
        }
        for label in [
            "node_not_ready",
            "daemonset",
            "mirror",
            "system_critical",
            "opted_out",
            "volume_pinned",
            "bare_pod",
            "no_other_node",
            "exhausted",
            "job_would_fail",
        ] {
            self.metrics
                .skipped
                .get_or_create(&ReasonLabels { reason: label.into() })
                .set(skipped.get(label).copied().unwrap_or(0));
        }
        self.metrics
            .exclusions
            .set(exclusions.live(Timestamp::now()) as i64);
        self.metrics
            .exclusions_unreadable
            .set(exclusions.unreadable as i64);
        self.metrics
            .cycle_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.cycles.inc();
        due
    }

    /// Moves one pod: records the exclusion, then evicts it (owned) or replaces it (bare).
    async fn perform(&self, pod: &Pod, m: &Move, exclusions: &mut Exclusions) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let owner = m.workload.describe(&name);
        let node = &m.refusal.node;
        if self.dry_run {
            tracing::info!(
                pod = %format!("{ns}/{name}"), virtual_node = %node, targets = ?m.targets,
                "dry run: would move the pod ({owner}): the lower cluster cannot place it ({})",
                m.refusal.message
            );
            self.metrics.moved("dry_run", &m.refusal.reason, node, &ns);
            exclusions
                .records
                .insert(m.workload.key().to_owned(), m.record.clone());
            return;
        }
        if m.record_changed {
            match self.store.put(m.workload.key(), &m.record, exclusions).await {
                Ok(()) => {
                    self.metrics.exclusion_writes.get_or_create(&ok()).inc();
                    if let Workload::Owned { .. } = &m.workload {
                        self.event(
                            owner_ref(pod, &m.workload),
                            EventType::Normal,
                            "VirtualNodeExcluded",
                            &format!(
                                "replacements of {ns}/{name} avoid {} until the exclusion expires: the lower cluster of {node} could not place it",
                                m.record.nodes.keys().cloned().collect::<Vec<_>>().join(", ")
                            ),
                        )
                        .await;
                    }
                }
                Err(e @ store::Error::Changed(_)) => {
                    self.metrics.exclusion_writes.get_or_create(&changed()).inc();
                    self.metrics.moved("changed", &m.refusal.reason, node, &ns);
                    tracing::info!(pod = %format!("{ns}/{name}"), "not moved: {e}; judged again on the newer record");
                    return;
                }
                Err(e) => {
                    self.metrics.exclusion_writes.get_or_create(&failed()).inc();
                    self.failed(
                        pod,
                        &m.refusal.reason,
                        node,
                        &format!("recording the exclusion: {e}"),
                    )
                    .await;
                    return;
                }
            }
        }
        if let Workload::Bare { .. } = &m.workload {
            self.crash_at.reached(bare::Step::Recorded);
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let result = match &m.workload {
            Workload::Owned { .. } => evict::evict(&api, pod).await.map_err(|e| e.to_string()),
            Workload::Bare { .. } => {
                let excluded: Vec<String> = m.record.nodes.keys().cloned().collect();
                bare::replace(&api, pod, m.workload.key(), &excluded, self.crash_at)
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        match result {
            Ok(Evicted::Accepted) => {
                self.backoff_clear(pod);
                self.metrics.moved("success", &m.refusal.reason, node, &ns);
                let how = match &m.workload {
                    Workload::Owned { .. } => format!("evicted so {owner} recreates it elsewhere"),
                    Workload::Bare { .. } => "replaced by a copy that avoids it".to_owned(),
                };
                let note = format!(
                    "lower cluster of {node} cannot place the pod ({}); {how}",
                    m.refusal.message
                );
                tracing::info!(pod = %format!("{ns}/{name}"), virtual_node = %node, targets = ?m.targets, "descheduled: {note}");
                self.event(pod.object_ref(&()), EventType::Normal, "Descheduled", &note)
                    .await;
            }
            Ok(Evicted::Gone) => {
                tracing::debug!(pod = %format!("{ns}/{name}"), "already gone");
            }
            Ok(Evicted::Changed(why)) => {
                self.metrics.moved("changed", &m.refusal.reason, node, &ns);
                tracing::info!(pod = %format!("{ns}/{name}"), "not evicted: the pod changed since it was judged; judged again next round ({why})");
            }
            Ok(Evicted::Refused(why)) => {
                self.metrics.moved("limited", &m.refusal.reason, node, &ns);
                tracing::info!(pod = %format!("{ns}/{name}"), "eviction refused for now: {why}");
            }
            Err(e) => self.failed(pod, &m.refusal.reason, node, &e).await,
        }
    }

    /// Moves running pods back where their constraints want them (see [`crate::rebalance`]).
    async fn rebalance(
        &self,
        r: &Rebalancing,
        pending: &[Arc<Pod>],
        nodes: &BTreeMap<String, Node>,
        exclusions: &Exclusions,
    ) {
        // A pod changing phase may show in both caches for a moment: once each.
        let mut seen = HashSet::new();
        let pods: Vec<Arc<Pod>> = r
            .running
            .state()
            .into_iter()
            .chain(pending.iter().cloned())
            .filter(|p| seen.insert(p.metadata.uid.clone()))
            .collect();
        let now = Timestamp::now();
        let plan = match r.memory.lock() {
            Ok(mut memory) => rebalance::plan(
                &pods,
                nodes,
                exclusions,
                &mut memory,
                now,
                &r.settings,
                self.settings.shape_max_age,
                &self.settings,
            ),
            Err(_) => return,
        };
        let mut view = exclusions.clone();
        for m in &plan.remember {
            if self.dry_run {
                tracing::info!(workload = %m.owner, virtual_node = %m.node, "dry run: would remember that the lower cluster refused it after a rebalance");
                continue;
            }
            match self.store.put(&m.key, &m.record, &mut view).await {
                Ok(()) => {
                    tracing::info!(workload = %m.owner, virtual_node = %m.node, "the lower cluster refused it after a rebalance: not moved there again until the node turns Ready anew or the template changes")
                }
                Err(e) => {
                    tracing::warn!(workload = %m.owner, virtual_node = %m.node, "remembering a refusal after a rebalance: {e}")
                }
            }
        }
        let mut held: BTreeMap<&'static str, i64> = BTreeMap::new();
        if let Ok(mut told) = r.told.lock() {
            let now_held: HashSet<&str> = plan.held.iter().map(|(uid, _, _)| uid.as_str()).collect();
            told.retain(|uid, _| now_held.contains(uid.as_str()));
            for (uid, owner, why) in &plan.held {
                *held.entry(why.label()).or_default() += 1;
                if told.insert(uid.clone(), why.label()) != Some(why.label()) {
                    tracing::info!(workload = %owner, "not rebalanced for now: {why}");
                }
            }
        }
        for label in rebalance::Held::LABELS {
            self.metrics
                .rebalance_held
                .get_or_create(&ReasonLabels { reason: label.into() })
                .set(held.get(label).copied().unwrap_or(0));
        }
        for m in &plan.moves {
            let pod = &m.pod;
            let ns = pod.metadata.namespace.clone().unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            let from = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let note = format!(
                "{}: evicted from {from} so {} recreates it, toward {}",
                m.reason, m.owner, m.target
            );
            if self.dry_run {
                tracing::info!(pod = %format!("{ns}/{name}"), "dry run: would rebalance: {note}");
                self.metrics.rebalanced(m.reason.label(), "dry_run");
                continue;
            }
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            match evict::evict(&api, pod).await {
                Ok(Evicted::Accepted) => {
                    if let Ok(mut memory) = r.memory.lock() {
                        memory.moved(m, Timestamp::now());
                    }
                    self.metrics.rebalanced(m.reason.label(), "success");
                    tracing::info!(pod = %format!("{ns}/{name}"), "rebalanced: {note}");
                    self.event(pod.object_ref(&()), EventType::Normal, "Rebalanced", &note)
                        .await;
                }
                Ok(Evicted::Gone) => {}
                Ok(Evicted::Changed(why)) => {
                    self.metrics.rebalanced(m.reason.label(), "changed");
                    tracing::debug!(pod = %format!("{ns}/{name}"), "not rebalanced: it changed ({why})");
                }
                Ok(Evicted::Refused(why)) => {
                    // A PodDisruptionBudget (or the apiserver's throttle) says not now: the
                    // workload waits an interval, and others go meanwhile.
                    self.pause(r, &m.workload);
                    self.metrics.rebalanced(m.reason.label(), "limited");
                    tracing::info!(pod = %format!("{ns}/{name}"), "not rebalanced for now: {why}");
                }
                Err(e) => {
                    // As for a refusal: the workload waits an interval, others go meanwhile.
                    self.pause(r, &m.workload);
                    self.metrics.rebalanced(m.reason.label(), "error");
                    tracing::warn!(pod = %format!("{ns}/{name}"), "rebalancing: {e}");
                }
            }
        }
    }

    /// After a refused or failed eviction, `workload` is not tried for a round interval
    /// (at least [`REFUSED_PAUSE`]) from now, and other workloads go meanwhile.
    fn pause(&self, r: &Rebalancing, workload: &str) {
        let pause = self.interval.max(REFUSED_PAUSE);
        let now = Timestamp::now();
        let until = jiff::SignedDuration::try_from(pause)
            .ok()
            .and_then(|p| now.checked_add(p).ok())
            .unwrap_or(now);
        if let Ok(mut memory) = r.memory.lock() {
            memory.refused(workload, until);
        }
    }

    /// Recreates an unplaced pod without the exclusions that no longer hold: takes the
    /// nodes whose shape holds it again out of the record, then evicts the pod (its
    /// controller recreates it, and the webhook writes the record's current exclusion) or
    /// replaces it (a bare pod).
    async fn release(&self, pod: &Pod, r: &Release, exclusions: &mut Exclusions) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let owner = r.workload.describe(&name);
        let freed = r.freed.join(", ");
        let note = format!(
            "the upper scheduler has found no node for the pod since {}, and it avoids {freed}, which would take it now; recreated without that exclusion{}",
            r.since,
            match &r.workload {
                Workload::Owned { .. } => format!(" ({owner} recreates it)"),
                Workload::Bare { .. } => " (replaced by a copy)".to_owned(),
            }
        );
        if self.dry_run {
            tracing::info!(pod = %format!("{ns}/{name}"), "dry run: would recreate the pod: {note}");
            self.released("dry_run");
            return;
        }
        if let Some(record) = &r.record {
            match self.store.put(r.workload.key(), record, exclusions).await {
                Ok(()) => {
                    self.metrics.exclusion_writes.get_or_create(&ok()).inc();
                }
                Err(e @ store::Error::Changed(_)) => {
                    self.metrics.exclusion_writes.get_or_create(&changed()).inc();
                    self.released("changed");
                    tracing::info!(pod = %key(pod), "not recreated: {e}; judged again on the newer record");
                    return;
                }
                Err(e) => {
                    self.metrics.exclusion_writes.get_or_create(&failed()).inc();
                    self.released("error");
                    let retry = self.backoff_fail(pod);
                    tracing::warn!(pod = %key(pod), "lifting the exclusion of {freed} (retried in {retry:?}): {e}");
                    return;
                }
            }
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let result = match &r.workload {
            Workload::Owned { .. } => evict::evict(&api, pod).await,
            Workload::Bare { lineage } => bare::replace(&api, pod, lineage, &r.excluded, self.crash_at).await,
        };
        match result {
            Ok(Evicted::Accepted) => {
                self.backoff_clear(pod);
                self.released("success");
                tracing::info!(pod = %format!("{ns}/{name}"), "released: {note}");
                self.event(pod.object_ref(&()), EventType::Normal, "Released", &note)
                    .await;
            }
            Ok(Evicted::Gone) => tracing::debug!(pod = %format!("{ns}/{name}"), "already gone"),
            Ok(Evicted::Changed(why)) => {
                self.released("changed");
                tracing::info!(pod = %format!("{ns}/{name}"), "not recreated: the pod changed since it was judged ({why})");
            }
            Ok(Evicted::Refused(why)) => {
                self.released("limited");
                tracing::info!(pod = %format!("{ns}/{name}"), "eviction refused for now: {why}");
            }
            Err(e) => {
                self.released("error");
                let retry = self.backoff_fail(pod);
                tracing::warn!(pod = %key(pod), "recreating the pod failed (retried in {retry:?}): {e}");
            }
        }
    }

    fn released(&self, result: &str) {
        self.metrics
            .released
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
    }

    /// The pod as the cache holds it now (`None`: gone).
    fn current(&self, listed: &Pod) -> Option<Arc<Pod>> {
        let name = listed.metadata.name.as_deref()?;
        let mut reference = ObjectRef::<Pod>::new(name);
        if let Some(ns) = listed.metadata.namespace.as_deref() {
            reference = reference.within(ns);
        }
        self.pods.get(&reference)
    }

    /// The Job `name` of the pod's namespace, read now (`None` if it cannot be read: the pod
    /// then stays, and the next round reads it again).
    /// The pod's Job `name`: read once per Job (by its UID, the pod's controller), then
    /// remembered while pods of it wait.
    async fn job(&self, pod: &Pod, name: &str) -> Option<Arc<Job>> {
        let owner = controller_uid(pod);
        if let Some(uid) = owner
            && let Some(job) = self.jobs.lock().ok().and_then(|jobs| jobs.get(uid).cloned())
        {
            return Some(job);
        }
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Job> = Api::namespaced(self.client.clone(), ns);
        match api.get_opt(name).await {
            Ok(Some(job)) => {
                let job = Arc::new(job);
                if let Some(uid) = owner.filter(|uid| job.metadata.uid.as_deref() == Some(*uid))
                    && let Ok(mut jobs) = self.jobs.lock()
                {
                    jobs.insert(uid.to_owned(), job.clone());
                }
                Some(job)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(pod = %key(pod), "reading Job {ns}/{name}: {e}");
                None
            }
        }
    }

    /// Ends every bare-pod pair that still has two pods (see [`crate::pairs`]).
    async fn settle_pairs(&self) {
        let replacements = self.replacements.state();
        if let Ok(mut settled) = self.settled.lock() {
            let live: HashSet<&str> = replacements
                .iter()
                .filter_map(|p| p.metadata.uid.as_deref())
                .collect();
            settled.retain(|uid| live.contains(uid.as_str()));
        }
        for replacement in replacements {
            let uid = replacement.metadata.uid.clone().unwrap_or_default();
            if self.settled.lock().is_ok_and(|s| s.contains(&uid))
                || !decide::responsible(&replacement, &self.settings)
            {
                continue;
            }
            let original = match self.original(&replacement).await {
                Ok(original) => original,
                Err(e) => {
                    tracing::warn!(pod = %key(&replacement), "looking for the pod it replaces: {e}");
                    continue;
                }
            };
            let serves = |node: &str| {
                self.nodes
                    .get(&kube::runtime::reflector::ObjectRef::new(node))
                    .is_some()
            };
            if original.is_some() && !pairs::ours(original.as_ref(), &replacement, serves) {
                continue;
            }
            match pairs::settle(original.as_ref(), &replacement) {
                PairStep::Settled => {
                    if let Ok(mut s) = self.settled.lock() {
                        s.insert(uid);
                    }
                }
                PairStep::Wait => {}
                PairStep::EvictOriginal => {
                    if let Some(original) = &original {
                        self.end_pair(original, &replacement, false).await;
                    }
                }
                PairStep::RemoveReplacement => {
                    if let Some(original) = &original {
                        self.end_pair(&replacement, original, true).await;
                    }
                }
            }
        }
    }

    /// The pod `replacement` replaces, if a pod of that UID still exists.
    async fn original(&self, replacement: &Pod) -> Result<Option<Pod>, kube::Error> {
        let Some(old) = pairs::replaced_uid(replacement) else {
            return Ok(None);
        };
        let ns = replacement.metadata.namespace.as_deref().unwrap_or_default();
        let pending = self
            .pods
            .state()
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(old));
        if let Some(p) = pending {
            return Ok(Some((*p).clone()));
        }
        // Not Pending (it runs, or it is gone): look among the pods sharing its labels.
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let lp = ListParams::default().labels(&pairs::original_selector(replacement));
        let found = api.list(&lp).await?;
        Ok(found
            .items
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(old)))
    }

    /// Evicts `victim`, one pod of a pair, so that `keeper` is the only one left.
    async fn end_pair(&self, victim: &Pod, keeper: &Pod, victim_is_replacement: bool) {
        let (ns, name) = (
            victim.metadata.namespace.clone().unwrap_or_default(),
            victim.metadata.name.clone().unwrap_or_default(),
        );
        let keeper_name = keeper.metadata.name.clone().unwrap_or_default();
        let note = if victim_is_replacement {
            format!(
                "{keeper_name}, which this pod replaces, was placed below after all; this copy is removed so that the pod runs once"
            )
        } else {
            format!("its replacement {keeper_name} exists; the move is finished by evicting this pod")
        };
        if self.dry_run {
            tracing::info!(pod = %format!("{ns}/{name}"), "dry run: would evict: {note}");
            return;
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        match evict::evict(&api, victim).await {
            Ok(Evicted::Accepted) => {
                tracing::info!(pod = %format!("{ns}/{name}"), "evicted: {note}");
                let reason = if victim_is_replacement {
                    "ReplacementRemoved"
                } else {
                    "Descheduled"
                };
                self.event(victim.object_ref(&()), EventType::Normal, reason, &note)
                    .await;
            }
            Ok(other) => {
                tracing::info!(pod = %format!("{ns}/{name}"), "not evicted now ({other:?}); judged again next round")
            }
            Err(e) => tracing::warn!(pod = %format!("{ns}/{name}"), "evicting one pod of a pair: {e}"),
        }
    }

    async fn give_up(&self, pod: &Pod, g: &GiveUp, exclusions: &mut Exclusions) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let owner = g.workload.describe(&name);
        let note = format!(
            "stopped moving {owner}: it was moved {} times within the exclusion TTL and the lower cluster of {} still cannot place {ns}/{name} ({})",
            g.record.moves, g.refusal.node, g.refusal.message
        );
        if self.dry_run {
            exclusions
                .records
                .insert(g.workload.key().to_owned(), g.record.clone());
            tracing::warn!("dry run: would give up: {note}");
            self.metrics
                .gave_up
                .get_or_create(&ResultLabels {
                    result: "dry_run".into(),
                })
                .inc();
            return;
        }
        if let Err(e) = self.store.put(g.workload.key(), &g.record, exclusions).await {
            let result = match e {
                store::Error::Changed(_) => changed(),
                _ => failed(),
            };
            self.metrics.exclusion_writes.get_or_create(&result).inc();
            tracing::warn!(pod = %format!("{ns}/{name}"), "recording that {owner} was given up on: {e}");
            return;
        }
        self.metrics.exclusion_writes.get_or_create(&ok()).inc();
        self.metrics
            .gave_up
            .get_or_create(&ResultLabels {
                result: "warned".into(),
            })
            .inc();
        tracing::warn!(pod = %format!("{ns}/{name}"), "{note}");
        self.event(
            owner_ref(pod, &g.workload),
            EventType::Warning,
            "DeschedulingExhausted",
            &note,
        )
        .await;
    }

    async fn failed(&self, pod: &Pod, reason: &str, node: &str, error: &str) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        self.metrics.moved("error", reason, node, &ns);
        let retry = self.backoff_fail(pod);
        tracing::warn!(pod = %key(pod), "moving the pod failed (retried in {retry:?}): {error}");
        self.event(
            pod.object_ref(&()),
            EventType::Warning,
            "DescheduleFailed",
            &format!("moving the pod off {node} failed: {error}"),
        )
        .await;
    }

    async fn event(&self, reference: ObjectReference, type_: EventType, reason: &str, note: &str) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: "Descheduling".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &reference).await {
            tracing::debug!(object = reference.name.as_deref().unwrap_or_default(), %reason, "event not recorded: {e}");
        }
    }

    fn first_time(&self, pod: &Pod, label: &'static str) -> bool {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        self.told.lock().is_ok_and(|mut t| t.insert((uid, label)))
    }

    fn backing_off(&self, pod: &Pod) -> bool {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        self.backoff
            .lock()
            .is_ok_and(|b| b.get(uid).is_some_and(|(_, next)| Instant::now() < *next))
    }

    /// Records a failure; returns the delay before the next attempt.
    fn backoff_fail(&self, pod: &Pod) -> Duration {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let Ok(mut b) = self.backoff.lock() else {
            return FIRST_BACKOFF;
        };
        let failures = b.get(&uid).map_or(0, |(n, _)| *n);
        let delay = FIRST_BACKOFF
            .saturating_mul(1 << failures.min(6))
            .min(MAX_BACKOFF);
        b.insert(uid, (failures + 1, Instant::now() + delay));
        delay
    }

    fn backoff_clear(&self, pod: &Pod) {
        if let (Some(uid), Ok(mut b)) = (&pod.metadata.uid, self.backoff.lock()) {
            b.remove(uid);
        }
    }

    /// Forgets backoffs and logged skips of pods that are gone.
    fn forget_gone(&self, pods: &[Arc<Pod>]) {
        let live: HashSet<&str> = pods.iter().filter_map(|p| p.metadata.uid.as_deref()).collect();
        if let Ok(mut b) = self.backoff.lock() {
            b.retain(|uid, _| live.contains(uid.as_str()));
        }
        if let Ok(mut t) = self.told.lock() {
            t.retain(|(uid, _)| live.contains(uid.as_str()));
        }
        let owners: HashSet<&str> = pods.iter().filter_map(|p| controller_uid(p)).collect();
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.retain(|uid, _| owners.contains(uid.as_str()));
        }
    }
}

/// The UID of the pod's controller.
fn controller_uid(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.as_str())
}

fn ok() -> ResultLabels {
    ResultLabels {
        result: "success".into(),
    }
}

fn failed() -> ResultLabels {
    ResultLabels {
        result: "error".into(),
    }
}

fn changed() -> ResultLabels {
    ResultLabels {
        result: "changed".into(),
    }
}

fn key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The object events about the workload go to: its controller, or the pod itself.
fn owner_ref(pod: &Pod, workload: &Workload) -> ObjectReference {
    match workload {
        Workload::Owned {
            api_version,
            kind,
            name,
            uid,
        } => ObjectReference {
            api_version: Some(api_version.clone()),
            kind: Some(kind.clone()),
            name: Some(name.clone()),
            namespace: pod.metadata.namespace.clone(),
            uid: Some(uid.clone()),
            ..Default::default()
        },
        Workload::Bare { .. } => pod.object_ref(&()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(total: u32) -> Caps {
        Caps {
            total,
            ..Caps::default()
        }
    }

    /// Rounds every 300 ms for a minute (each eviction's watch events start one), the first
    /// refused pod at 5 s, under a total cap of 2 and a 30 s interval: 2 evictions at 5 s,
    /// the next 2 one interval later.
    #[tokio::test(start_paused = true)]
    async fn the_caps_bound_the_evictions_of_all_rounds_within_one_interval() {
        let interval = Duration::from_secs(30);
        let mut kept: Option<Window> = None;
        let mut evicted = Vec::new();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            let mut window = kept
                .take()
                .filter(|w| w.open(Instant::now(), interval))
                .unwrap_or_else(|| Window::new(caps(2)));
            if started.elapsed() >= Duration::from_secs(5) && window.take("shop", Some("vn-a"), "rs").is_ok()
            {
                evicted.push(started.elapsed().as_secs());
            }
            kept = Some(window);
            tokio::time::advance(Duration::from_millis(300)).await;
        }
        assert_eq!(evicted, vec![5, 5, 35, 35], "two at the start of each window");
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_opens_at_its_first_eviction_and_a_limited_pod_is_due_when_it_closes() {
        let interval = Duration::from_secs(30);
        let mut window = Window::new(caps(1));
        tokio::time::advance(Duration::from_secs(100)).await;
        assert!(
            window.open(Instant::now(), interval),
            "no eviction yet: still open"
        );
        window.take("shop", None, "rs").unwrap();
        assert_eq!(window.take("shop", None, "rs"), Err("--max-pods-to-evict-total"));
        tokio::time::advance(Duration::from_secs(10)).await;
        let now: Timestamp = "2024-05-01T10:00:00Z".parse().unwrap();
        assert_eq!(
            window.closes(now, interval),
            "2024-05-01T10:00:20Z".parse::<Timestamp>().unwrap()
        );
        assert!(window.open(Instant::now(), interval));
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            !window.open(Instant::now(), interval),
            "closed one interval after its first eviction"
        );
    }
}
