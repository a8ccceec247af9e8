//! Pod lifecycles on simulated nodes: one watch for every bound pod, one actor per pod UID.
//!
//! The actor is the only writer of its pod's status, so work on a pod is serialized; it
//! always sees the latest object through a `watch` channel and resumes correctly from any
//! status it finds (a simulator restarted mid-run picks its pods up where they are).
//!
//! Each container runs, exits and restarts on its own (its restart policy and rules,
//! [`super::behavior::restart_on_exit`]); the pod is Running while one runs or will start
//! again. Ready follows Running, except for a container with an HTTP readiness probe: the actor
//! runs that probe against the process a test runs for the pod
//! ([`super::NodeSimulator::probe_at`]) and the pod is Ready only while it succeeds, as a
//! kubelet would have it. A change of the spec's resources is decided as the kubelet of the
//! cluster's version decides an in-place resize ([`super::resize`]), the node's room counted
//! from what the actors of its other pods admitted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

use super::Inner;
use super::behavior::{AfterExit, Behavior, Restart, RestartPolicy, restart_on_exit};
use super::resize::{self, Allocation, Verdict};
use tensile_common::api::now;
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::pod_requests;

/// Watches pods bound to any node and hands the simulated ones to their actors.
pub(super) async fn watch(inner: Arc<Inner>) {
    let api: Api<Pod> = Api::all(inner.client.clone());
    let config = watcher::Config::default().fields("spec.nodeName!=");
    // Retried every second, not with kube's growing backoff: on loopback a retry is cheap,
    // and after an apiserver restart the simulated kubelets must act at once (a pod deleted
    // meanwhile would otherwise stay Terminating for up to a minute).
    let mut stream = watcher(api, config).boxed();
    let mut failing = false;
    let mut actors: HashMap<String, watch::Sender<Pod>> = HashMap::new();
    let mut seen_in_relist: HashSet<String> = HashSet::new();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => seen_in_relist.clear(),
            Ok(watcher::Event::InitApply(pod)) => {
                if let Some(uid) = pod.metadata.uid.clone() {
                    seen_in_relist.insert(uid);
                }
                apply(&inner, &mut actors, pod);
            }
            Ok(watcher::Event::InitDone) => {
                let gone: Vec<String> = actors
                    .keys()
                    .filter(|uid| !seen_in_relist.contains(*uid))
                    .cloned()
                    .collect();
                for uid in gone {
                    if let Some(tx) = actors.remove(&uid) {
                        forget(&inner, &tx.borrow());
                    }
                }
            }
            Ok(watcher::Event::Apply(pod)) => apply(&inner, &mut actors, pod),
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(uid) = &pod.metadata.uid {
                    actors.remove(uid);
                }
                forget(&inner, &pod);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!("pod watch: {e} (retrying every second)");
                    failing = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        }
        if failing {
            tracing::info!("pod watch works again");
            failing = false;
        }
        actors.retain(|_, tx| !tx.is_closed());
    }
}

fn key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

fn forget(inner: &Inner, pod: &Pod) {
    if let Ok(mut pods) = inner.pods.write() {
        let k = key(pod);
        if pods
            .get(&k)
            .map(|p| p.metadata.uid == pod.metadata.uid)
            .unwrap_or(false)
        {
            pods.remove(&k);
        }
    }
}

fn apply(inner: &Arc<Inner>, actors: &mut HashMap<String, watch::Sender<Pod>>, pod: Pod) {
    let Some(node) = node_of(&pod) else { return };
    if !inner.is_simulated(node) {
        return;
    }
    let Some(uid) = pod.metadata.uid.clone() else {
        return;
    };
    if let Ok(mut pods) = inner.pods.write() {
        pods.insert(key(&pod), pod.clone());
    }
    match actors.get(&uid) {
        Some(tx) if !tx.is_closed() => {
            let _ = tx.send(pod);
        }
        _ => {
            let (tx, rx) = watch::channel(pod);
            actors.insert(uid, tx);
            let task_inner = inner.clone();
            inner.track(tokio::spawn(
                async move { PodActor::new(task_inner, rx).run().await },
            ));
        }
    }
}

/// What interrupted a wait.
enum Wake {
    Elapsed,
    /// The spec changed (a resize), or a pod left the node while a resize waits for room.
    Changed,
    Deleting,
    Gone,
}

struct PodActor {
    inner: Arc<Inner>,
    rx: watch::Receiver<Pod>,
    namespace: String,
    name: String,
    uid: String,
    node: String,
    ip: Option<String>,
    /// The HTTP readiness probe of its containers, if one has any.
    probe: Option<Probe>,
    /// What the probe last concluded (false until its first success).
    probed_ready: bool,
    /// Probe failures in a row.
    failures: u32,
    /// `status.startTime`.
    start_time: String,
    /// The regular containers, in spec order.
    containers: Vec<Ctr>,
    /// Restarts of the init containers (they run again when every container restarts).
    init_restarts: u32,
    /// When every container restarts (a `RestartAllContainers` rule), until they run again.
    restarting_all: bool,
    /// What the kubelet admitted (`allocatedResources`) and what the containers run with
    /// (`resources`).
    allocated: Allocation,
    actuated: Allocation,
    /// The spec resources and generation last decided on.
    seen: (Option<i64>, Allocation),
    /// `PodResizePending`, and when a deferred resize is tried again.
    pending: Option<(Condition, Option<Instant>)>,
    /// `PodResizeInProgress`, and when the containers run with the allocation.
    in_progress: Option<(Condition, Instant)>,
    /// Wakes when a pod leaves a node (see [`Inner::freed`]).
    freed: watch::Receiver<()>,
}

/// A condition the kubelet keeps across status writes: a resize's.
#[derive(Clone, Debug)]
struct Condition {
    kind: &'static str,
    reason: &'static str,
    message: String,
    generation: i64,
    since: String,
}

/// One regular container's run.
#[derive(Clone, Debug)]
struct Ctr {
    name: String,
    state: State,
    last: Option<State>,
    restarts: u32,
    /// When its run ends, or when it starts again after a back-off.
    next: Option<Instant>,
}

/// A container's HTTP readiness probe, as the kubelet runs it.
#[derive(Clone, Debug)]
struct Probe {
    path: String,
    period: Duration,
    timeout: Duration,
    failure_threshold: u32,
}

impl Probe {
    /// The first HTTP readiness probe of `pod`'s containers.
    fn of(pod: &Pod) -> Option<Self> {
        let probe = pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .find_map(|c| c.readiness_probe.as_ref().filter(|p| p.http_get.is_some()))?;
        let secs = |s: Option<i32>, default: u64| Duration::from_secs(s.map_or(default, |s| s.max(1) as u64));
        Some(Self {
            path: probe
                .http_get
                .as_ref()
                .and_then(|h| h.path.clone())
                .unwrap_or_else(|| "/".into()),
            period: secs(probe.period_seconds, 10),
            timeout: secs(probe.timeout_seconds, 1),
            failure_threshold: probe.failure_threshold.map_or(3, |f| f.max(1) as u32),
        })
    }
}

/// One container's simulated state.
#[derive(Clone, Debug)]
enum State {
    Waiting {
        reason: &'static str,
    },
    Running {
        started: String,
    },
    Terminated {
        exit: i32,
        reason: String,
        started: String,
        finished: String,
    },
}

impl PodActor {
    fn new(inner: Arc<Inner>, rx: watch::Receiver<Pod>) -> Self {
        let pod = rx.borrow().clone();
        let (namespace, name) = key(&pod);
        Self {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            node: node_of(&pod).unwrap_or_default().to_owned(),
            rx,
            namespace,
            name,
            ip: None,
            probe: Probe::of(&pod),
            probed_ready: false,
            failures: 0,
            start_time: String::new(),
            containers: Vec::new(),
            init_restarts: 0,
            restarting_all: false,
            allocated: Allocation::default(),
            actuated: Allocation::default(),
            seen: (None, Allocation::default()),
            pending: None,
            in_progress: None,
            freed: inner.freed.subscribe(),
            inner,
        }
    }

    fn pod(&self) -> Pod {
        self.rx.borrow().clone()
    }

    fn deleting(&self) -> bool {
        self.rx.borrow().metadata.deletion_timestamp.is_some()
    }

    async fn run(mut self) {
        let outcome = self.lifecycle().await;
        if let Err(e) = outcome {
            tracing::warn!(pod = %format!("{}/{}", self.namespace, self.name), "simulated pod: {e}");
        }
        self.release();
        self.release_ip();
    }

    async fn lifecycle(&mut self) -> Result<(), kube::Error> {
        let pod = self.pod();
        if self.deleting() {
            return self.finish_deletion(&Behavior::default()).await;
        }
        let annotation = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(tensile_common::names::SIM_BEHAVIOR))
            .cloned()
            .unwrap_or_default();
        let behavior = match Behavior::parse(&annotation) {
            Ok(b) => b,
            Err(e) => {
                let message = format!("annotation {}: {e}", tensile_common::names::SIM_BEHAVIOR);
                self.write(json!({"phase": "Failed", "reason": "InvalidSimulation", "message": message}))
                    .await?;
                return self.until_deleted(&Behavior::default()).await;
            }
        };
        let policy = RestartPolicy::parse(pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()));
        let status = pod.status.clone().unwrap_or_default();
        let phase = status.phase.as_deref().unwrap_or("Pending");
        if phase == "Succeeded" || phase == "Failed" {
            return self.until_deleted(&behavior).await;
        }

        let run_for = behavior.run_for(policy);
        let ends = |from: Instant| run_for.map(|d| from + d);
        let spec = pod.spec.clone().unwrap_or_default();
        if phase == "Running" && status.pod_ip.is_some() {
            // Resuming after a simulator restart: keep the IP, the start time, and each
            // container's count and start.
            self.ip = status.pod_ip.clone();
            self.claim_ip();
            self.start_time = status.start_time.map(|t| t.0.to_string()).unwrap_or_else(now);
            let shown = status.container_statuses.unwrap_or_default();
            self.containers = spec
                .containers
                .iter()
                .map(|c| {
                    let seen = shown.iter().find(|s| s.name == c.name);
                    let started = seen
                        .and_then(|s| s.state.as_ref())
                        .and_then(|s| s.running.as_ref())
                        .and_then(|r| r.started_at.as_ref())
                        .map(|t| t.0.to_string())
                        .unwrap_or_else(now);
                    Ctr {
                        name: c.name.clone(),
                        state: State::Running { started },
                        last: None,
                        restarts: seen.map_or(0, |s| s.restart_count.max(0) as u32),
                        next: ends(Instant::now()),
                    }
                })
                .collect();
            self.admit(&pod);
        } else {
            match self.wait(behavior.start).await {
                Wake::Elapsed | Wake::Changed => {}
                Wake::Deleting => return self.finish_deletion(&behavior).await,
                Wake::Gone => return Ok(()),
            }
            if self.allocate_ip().is_none() {
                tracing::warn!(node = %self.node, "no free pod IP on the node; the pod stays Pending");
                return self.until_deleted(&behavior).await;
            }
            self.start_time = now();
            let started = Instant::now();
            self.containers = spec
                .containers
                .iter()
                .map(|c| Ctr {
                    name: c.name.clone(),
                    state: State::Running { started: now() },
                    last: None,
                    restarts: 0,
                    next: ends(started),
                })
                .collect();
            // Admitted with what the spec asks for now, which may already differ from what
            // the pod was bound with.
            let pod = self.pod();
            self.admit(&pod);
            self.write_status("Running").await?;
        }

        loop {
            let next = self
                .containers
                .iter()
                .filter_map(|c| c.next)
                .chain(self.in_progress.as_ref().map(|(_, at)| *at))
                .chain(self.pending.as_ref().and_then(|(_, at)| *at))
                .min();
            let wait = next.map_or(Duration::MAX, |at| at.saturating_duration_since(Instant::now()));
            let changed = match self.wait_running(wait).await {
                Wake::Elapsed => false,
                Wake::Changed => true,
                Wake::Deleting => return self.finish_deletion(&behavior).await,
                Wake::Gone => return Ok(()),
            };
            let now_at = Instant::now();
            let retry = self
                .pending
                .as_ref()
                .and_then(|(_, at)| *at)
                .is_some_and(|at| at <= now_at);
            if changed || retry {
                self.resize_decision(behavior.resize);
            }
            if self.in_progress.as_ref().is_some_and(|(_, at)| *at <= now_at) {
                self.actuate(&spec, ends(now_at));
            }
            let due: Vec<usize> = (0..self.containers.len())
                .filter(|i| self.containers[*i].next.is_some_and(|at| at <= now_at))
                .collect();
            for i in due {
                // One container's exit may have stopped the others (`RestartAllContainers`).
                if self.containers[i].next.is_some_and(|at| at <= now_at) {
                    self.step(i, &behavior, policy, &spec, ends(now_at));
                }
            }
            let phase = self.phase();
            self.write_status(phase).await?;
            if phase != "Running" {
                self.release();
                return self.until_deleted(&behavior).await;
            }
        }
    }

    /// A container whose run or back-off is over: it exits, or it starts again.
    fn step(
        &mut self,
        i: usize,
        behavior: &Behavior,
        policy: RestartPolicy,
        spec: &PodSpec,
        ends: Option<Instant>,
    ) {
        let now_at = Instant::now();
        let ctr = &mut self.containers[i];
        match &ctr.state {
            State::Running { started } => {
                let exit = behavior.exit;
                let ended = State::Terminated {
                    exit,
                    reason: behavior.reason_for(exit),
                    started: started.clone(),
                    finished: now(),
                };
                let restart = spec
                    .containers
                    .iter()
                    .find(|c| c.name == ctr.name)
                    .and_then(|c| restart_on_exit(c, policy, exit));
                match behavior.after_exit(restart, ctr.restarts) {
                    AfterExit::Stays => {
                        ctr.state = ended;
                        ctr.next = None;
                    }
                    AfterExit::CrashLoop => {
                        ctr.state = State::Waiting {
                            reason: "CrashLoopBackOff",
                        };
                        ctr.last = Some(ended);
                        ctr.next = None;
                    }
                    AfterExit::Restart(Restart::Container) => {
                        ctr.state = State::Waiting {
                            reason: "CrashLoopBackOff",
                        };
                        ctr.last = Some(ended);
                        ctr.next = Some(now_at + behavior.backoff);
                    }
                    AfterExit::Restart(Restart::AllContainers) => {
                        ctr.last = Some(ended);
                        self.restart_all(i, now_at + behavior.backoff);
                    }
                }
            }
            State::Waiting { .. } | State::Terminated { .. } => {
                let all = self.restarting_all;
                if all {
                    // Every container starts again together, init containers first.
                    self.restarting_all = false;
                    self.init_restarts += 1;
                    for c in &mut self.containers {
                        c.restarts += 1;
                        c.state = State::Running { started: now() };
                        c.next = ends;
                    }
                } else {
                    let ctr = &mut self.containers[i];
                    ctr.restarts += 1;
                    ctr.state = State::Running { started: now() };
                    ctr.next = ends;
                }
            }
        }
    }

    /// A `RestartAllContainers` rule matched container `trigger`'s exit: the kubelet stops
    /// every container and starts them all again (init containers first) at `at`. The others
    /// show the kill as their last termination, as the kubelet writes it.
    fn restart_all(&mut self, trigger: usize, at: Instant) {
        self.restarting_all = true;
        for (i, c) in self.containers.iter_mut().enumerate() {
            if i != trigger
                && let State::Running { started } = &c.state
            {
                c.last = Some(State::Terminated {
                    exit: 137,
                    reason: "RestartingAllContainers".into(),
                    started: started.clone(),
                    finished: now(),
                });
            } else if i != trigger
                && let State::Terminated { .. } = &c.state
            {
                c.last = Some(c.state.clone());
            }
            c.state = State::Waiting {
                reason: "RestartingAllContainers",
            };
            c.next = None;
        }
        self.containers[trigger].next = Some(at);
    }

    /// The pod's phase as the kubelet derives it from its containers: Running while one runs
    /// or will start again; once all have stopped for good, Failed if one failed, else
    /// Succeeded.
    fn phase(&self) -> &'static str {
        let mut failed = false;
        for c in &self.containers {
            match &c.state {
                State::Terminated { exit, .. } => failed |= *exit != 0,
                _ => return "Running",
            }
        }
        if failed { "Failed" } else { "Succeeded" }
    }

    /// The kubelet admits the pod as `pod` asks: its allocation, counted against its node.
    fn admit(&mut self, pod: &Pod) {
        self.allocated = Allocation::of(pod);
        self.actuated = self.allocated.clone();
        self.seen = (pod.metadata.generation, self.allocated.clone());
        self.count_allocation(pod);
    }

    fn count_allocation(&self, pod: &Pod) {
        let requests = pod_requests(&self.allocated.applied_to(pod));
        if let Ok(mut all) = self.inner.allocations.write() {
            all.insert(self.uid.clone(), (self.node.clone(), requests));
        }
    }

    /// The pod no longer holds its allocation on the node: the deferred resizes of the
    /// others there are tried again.
    fn release(&self) {
        let held = self
            .inner
            .allocations
            .write()
            .map(|mut all| all.remove(&self.uid).is_some())
            .unwrap_or(false);
        if held {
            self.inner.freed.send_replace(());
        }
    }

    /// The kubelet's decision on the spec's resources (see [`super::resize`]), at a change of
    /// the pod or when a deferred resize is tried again; an allocated resize is in progress
    /// for `actuation`.
    fn resize_decision(&mut self, actuation: Duration) {
        let pod = self.pod();
        let wanted = Allocation::of(&pod);
        let generation = pod.metadata.generation.unwrap_or(1);
        self.seen = (pod.metadata.generation, wanted.clone());
        if wanted == self.allocated {
            self.pending = None;
            return;
        }
        let (used, pods) = self.node_usage();
        let Some((allocatable, static_cpu_manager)) = self.inner.node_allocatable(&self.node) else {
            return;
        };
        let node = resize::Node {
            minor: self.inner.kubelet_minor(),
            allocatable: &allocatable,
            static_cpu_manager,
            used: &used,
            pods,
        };
        match resize::decide(&node, &pod, &self.allocated) {
            Verdict::Allocate => {
                self.pending = None;
                self.allocated = wanted;
                self.count_allocation(&pod);
                let at = Instant::now() + actuation;
                self.in_progress = Some((
                    Condition {
                        kind: "PodResizeInProgress",
                        reason: "",
                        message: String::new(),
                        generation,
                        since: now(),
                    },
                    at,
                ));
            }
            Verdict::Pending { reason, message } => {
                // A 1.33 kubelet tries a deferred resize again at each sync of the pod (every
                // minute), a later one every 3 minutes; both as soon as a pod leaves the node.
                let period = if self.inner.kubelet_minor() <= 33 { 60 } else { 180 };
                let retry = (reason == "Deferred").then(|| Instant::now() + Duration::from_secs(period));
                let since = match &self.pending {
                    Some((c, _)) if c.reason == reason => c.since.clone(),
                    _ => now(),
                };
                self.pending = Some((
                    Condition {
                        kind: "PodResizePending",
                        reason,
                        message,
                        generation,
                        since,
                    },
                    retry,
                ));
            }
        }
    }

    /// The requests of the other pods the kubelet admitted on this node, and their number.
    fn node_usage(&self) -> (ResourceMap, usize) {
        let mut used = ResourceMap::default();
        let mut pods = 0;
        if let Ok(all) = self.inner.allocations.read() {
            for (uid, (node, requests)) in all.iter() {
                if *node == self.node && *uid != self.uid {
                    used.add(requests);
                    pods += 1;
                }
            }
        }
        used.0.remove("pods");
        (used, pods)
    }

    /// The containers run with the allocation now; those whose `resizePolicy` says
    /// `RestartContainer` for a changed resource restart to take it (their run ends cleanly).
    fn actuate(&mut self, spec: &PodSpec, ends: Option<Instant>) {
        self.in_progress = None;
        let pod = Pod {
            spec: Some(spec.clone()),
            ..Pod::default()
        };
        let restart = self.allocated.restarts(&self.actuated, &pod);
        self.actuated = self.allocated.clone();
        for c in self.containers.iter_mut().filter(|c| restart.contains(&c.name)) {
            if let State::Running { started } = &c.state {
                c.last = Some(State::Terminated {
                    exit: 0,
                    reason: "Completed".into(),
                    started: started.clone(),
                    finished: now(),
                });
                c.restarts += 1;
                c.state = State::Running { started: now() };
                c.next = ends;
            }
        }
    }

    /// Sleeps for `d` unless the pod starts terminating or disappears first.
    async fn wait(&mut self, d: Duration) -> Wake {
        let sleep = tokio::time::sleep(d.min(Duration::from_secs(100 * 365 * 24 * 3600)));
        tokio::pin!(sleep);
        loop {
            if self.deleting() {
                return Wake::Deleting;
            }
            tokio::select! {
                _ = &mut sleep => return Wake::Elapsed,
                changed = self.rx.changed() => if changed.is_err() { return Wake::Gone },
            }
        }
    }

    /// As [`PodActor::wait`] while the containers run, probing readiness meanwhile: a change
    /// of the probe's verdict is written at once. As a kubelet's status manager does, a Ready
    /// condition someone else changed (the node lifecycle controller marks the pods of a node
    /// it saw go Unknown not ready) is written back once the pod changes. A change of the
    /// spec's resources or generation, or a pod leaving the node while a resize is deferred,
    /// ends the wait with [`Wake::Changed`].
    async fn wait_running(&mut self, d: Duration) -> Wake {
        let deadline = Instant::now() + d.min(Duration::from_secs(100 * 365 * 24 * 3600));
        loop {
            let probed = match self.probe.clone() {
                Some(probe) => self.probe_once(&probe).await,
                None => false,
            };
            if probed || self.ready_overwritten() {
                let phase = self.phase();
                if let Err(e) = self.write_status(phase).await {
                    tracing::warn!(pod = %format!("{}/{}", self.namespace, self.name), "status: {e}");
                }
            }
            if self.deleting() {
                return Wake::Deleting;
            }
            if self.spec_changed() {
                return Wake::Changed;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Wake::Elapsed;
            }
            let step = self.probe.as_ref().map_or(left, |p| p.period.min(left));
            let deferred = self.pending.as_ref().is_some_and(|(c, _)| c.reason == "Deferred");
            tokio::select! {
                _ = tokio::time::sleep(step) => {}
                changed = self.rx.changed() => if changed.is_err() { return Wake::Gone },
                _ = self.freed.changed(), if deferred => return Wake::Changed,
            }
        }
    }

    /// Whether the spec asks for other resources, or moved to another generation, than the
    /// kubelet last decided on.
    fn spec_changed(&self) -> bool {
        let pod = self.rx.borrow();
        pod.metadata.generation != self.seen.0 || Allocation::of(&pod) != self.seen.1
    }

    /// Whether the pod's Ready condition is no longer what this kubelet would write (someone
    /// else wrote it).
    fn ready_overwritten(&self) -> bool {
        let want = self.ready();
        let pod = self.pod();
        let seen = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status == "True");
        seen.is_some_and(|seen| seen != want)
    }

    /// Ready: every container runs (and the readiness probe, if any, succeeds).
    fn ready(&self) -> bool {
        !self.containers.is_empty()
            && self
                .containers
                .iter()
                .all(|c| matches!(c.state, State::Running { .. }))
            && (self.probe.is_none() || self.probed_ready)
    }

    /// Runs the readiness probe once, at the address registered for this pod; whether its
    /// verdict changed.
    async fn probe_once(&mut self, probe: &Probe) -> bool {
        let addr = self
            .inner
            .probes
            .read()
            .ok()
            .and_then(|p| p.get(&(self.namespace.clone(), self.name.clone())).cloned());
        let ok = match addr {
            Some(addr) => matches!(
                tokio::time::timeout(probe.timeout, crate::in_process::admin_get(&addr, &probe.path)).await,
                Ok(Some((code, _))) if (200..400).contains(&code)
            ),
            None => false,
        };
        let before = self.probed_ready;
        if ok {
            self.failures = 0;
            self.probed_ready = true;
        } else {
            self.failures += 1;
            if self.failures >= probe.failure_threshold {
                self.probed_ready = false;
            }
        }
        before != self.probed_ready
    }

    async fn until_deleted(&mut self, behavior: &Behavior) -> Result<(), kube::Error> {
        match self.wait(Duration::MAX).await {
            Wake::Deleting => self.finish_deletion(behavior).await,
            _ => Ok(()),
        }
    }

    /// Stops the containers within the grace period, then removes the pod with grace 0 and
    /// a UID precondition, as the kubelet does.
    async fn finish_deletion(&mut self, behavior: &Behavior) -> Result<(), kube::Error> {
        let pod = self.pod();
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(Duration::from_secs(30));
        let terminal = matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded") | Some("Failed")
        );
        if !terminal {
            tokio::select! {
                _ = tokio::time::sleep(behavior.stop.min(grace)) => {}
                _ = async { while self.rx.changed().await.is_ok() {} } => return Ok(()),
            }
        }
        let api: Api<Pod> = Api::namespaced(self.inner.client.clone(), &self.namespace);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        let _permit = self.inner.writes.acquire().await;
        match api.delete(&self.name, &params).await {
            Ok(_) => Ok(()),
            // Already gone, or a new pod with the same name: leave it alone.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn allocate_ip(&mut self) -> Option<String> {
        let index = self.inner.node_index(&self.node)?;
        let (b, c) = Inner::pod_net(index);
        let mut ips = self.inner.ips.lock().ok()?;
        let used = ips.entry(self.node.clone()).or_default();
        let host = (2u8..=254).find(|h| !used.contains(h))?;
        used.insert(host);
        let ip = format!("10.{b}.{c}.{host}");
        self.ip = Some(ip.clone());
        Some(ip)
    }

    fn claim_ip(&self) {
        let Some(host) = self
            .ip
            .as_deref()
            .and_then(|ip| ip.rsplit('.').next())
            .and_then(|h| h.parse::<u8>().ok())
        else {
            return;
        };
        if let Ok(mut ips) = self.inner.ips.lock() {
            ips.entry(self.node.clone()).or_default().insert(host);
        }
    }

    fn release_ip(&self) {
        let Some(host) = self
            .ip
            .as_deref()
            .and_then(|ip| ip.rsplit('.').next())
            .and_then(|h| h.parse::<u8>().ok())
        else {
            return;
        };
        if let Ok(mut ips) = self.inner.ips.lock()
            && let Some(used) = ips.get_mut(&self.node)
        {
            used.remove(&host);
        }
    }

    /// Writes the pod's status as a 1.37 kubelet writes it, in `phase`.
    async fn write_status(&self, phase: &str) -> Result<(), kube::Error> {
        let pod = self.pod();
        let spec = pod.spec.clone().unwrap_or_default();
        let now = now();
        let ready = self.ready();
        let terminal = phase == "Succeeded" || phase == "Failed";
        let resources = |name: &str| {
            (
                self.actuated.container(name).cloned().unwrap_or_default(),
                self.allocated.container(name).and_then(|r| r.requests.clone()),
            )
        };
        let containers: Vec<Value> = spec
            .containers
            .iter()
            .map(|c| {
                let ctr = self.containers.iter().find(|r| r.name == c.name);
                let running = State::Running {
                    started: self.start_time.clone(),
                };
                let (state, last, restarts) = match ctr {
                    Some(r) => (&r.state, r.last.as_ref(), r.restarts),
                    None => (&running, None, 0),
                };
                let c_ready =
                    matches!(state, State::Running { .. }) && (self.probe.is_none() || self.probed_ready);
                container_status(c, &self.uid, state, last, restarts, c_ready, resources(&c.name))
            })
            .collect();
        let done = State::Terminated {
            exit: 0,
            reason: "Completed".into(),
            started: self.start_time.clone(),
            finished: self.start_time.clone(),
        };
        // A restartable init container (a sidecar, `restartPolicy: Always`) runs beside the main
        // containers, as the kubelet keeps it; the others ran to completion before them.
        let init: Vec<Value> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| {
                let restarts = self.init_restarts;
                let sidecar = c.restart_policy.as_deref() == Some("Always");
                if sidecar && !terminal {
                    let running = State::Running {
                        started: self.start_time.clone(),
                    };
                    container_status(c, &self.uid, &running, None, restarts, true, resources(&c.name))
                } else {
                    container_status(c, &self.uid, &done, None, restarts, false, resources(&c.name))
                }
            })
            .collect();
        let ready_reason = if terminal {
            "PodCompleted"
        } else {
            "ContainersNotReady"
        };
        // As a 1.37 kubelet writes them: each condition and the status say which generation of
        // the pod they describe (the apiserver drops the fields where the feature is off).
        let generation = pod.metadata.generation.unwrap_or(1);
        let cond = |kind: &str, ok: bool, reason: &str| {
            let mut c = json!({"type": kind, "status": if ok { "True" } else { "False" },
                               "observedGeneration": generation,
                               "lastProbeTime": null, "lastTransitionTime": now});
            if !ok && !reason.is_empty() {
                c["reason"] = json!(reason);
            }
            c
        };
        let mut conditions = vec![
            cond("PodReadyToStartContainers", !terminal, ""),
            cond("Initialized", true, ""),
            cond("Ready", ready, ready_reason),
            cond("ContainersReady", ready, ready_reason),
            cond("PodScheduled", true, ""),
        ];
        // A pod that has a `RestartAllContainers` rule shows whether its containers are
        // restarting (1.36+).
        let restart_all = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .flat_map(|c| c.restart_policy_rules.iter().flatten())
            .any(|r| r.action == "RestartAllContainers");
        if restart_all {
            let mut c = cond("AllContainersRestarting", self.restarting_all, "");
            if self.restarting_all {
                c["reason"] = json!("RestartAllContainersStarted");
                c["message"] = json!("container exited with restart policy rule");
            } else if terminal {
                c["reason"] = json!(if phase == "Failed" {
                    "PodFailed"
                } else {
                    "PodCompleted"
                });
            }
            conditions.push(c);
        }
        // The resize's conditions, each with the generation it was decided at.
        for c in self
            .pending
            .iter()
            .map(|(c, _)| c)
            .chain(self.in_progress.iter().map(|(c, _)| c))
        {
            let mut shown = json!({"type": c.kind, "status": "True", "observedGeneration": c.generation,
                                   "lastProbeTime": now, "lastTransitionTime": c.since});
            if !c.reason.is_empty() {
                shown["reason"] = json!(c.reason);
                shown["message"] = json!(c.message);
            }
            conditions.push(shown);
        }
        let mut status = json!({
            "observedGeneration": generation,
            "phase": phase,
            "hostIP": self.inner.node_ip.to_string(),
            "hostIPs": [{"ip": self.inner.node_ip.to_string()}],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": containers,
        });
        // The pod level's totals (the pod-level resize, 1.36+ by default): what is allocated
        // and what the pod runs with.
        let allocated = resize::pod_level_requests(&self.allocated.applied_to(&pod));
        let actuated = self.actuated.applied_to(&pod);
        if !allocated.0.is_empty() {
            status["allocatedResources"] = resize::quantities(&allocated);
        }
        let mut level = json!({});
        for (key, list) in [
            ("requests", resize::pod_level_requests(&actuated)),
            ("limits", resize::pod_level_limits(&actuated)),
        ] {
            if !list.0.is_empty() {
                level[key] = resize::quantities(&list);
            }
        }
        status["resources"] = level;
        if !init.is_empty() {
            status["initContainerStatuses"] = json!(init);
        }
        if let Some(ip) = &self.ip {
            status["podIP"] = json!(ip);
            status["podIPs"] = json!([{"ip": ip}]);
        }
        self.write(status).await
    }

    /// Merge-patches the status subresource.
    async fn write(&self, status: Value) -> Result<(), kube::Error> {
        let api: Api<Pod> = Api::namespaced(self.inner.client.clone(), &self.namespace);
        let patch = json!({"metadata": {"uid": self.uid}, "status": status});
        let _permit = self.inner.writes.acquire().await;
        let mut attempt = 0;
        loop {
            match api
                .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                // Gone, or replaced by a pod with another UID: nothing of ours to write.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return Ok(()),
                Err(e) if attempt < 5 => {
                    attempt += 1;
                    tracing::debug!("status write retry {attempt}: {e}");
                    tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

fn state_json(state: &State) -> Value {
    match state {
        State::Waiting { reason } => json!({"waiting": {"reason": reason}}),
        State::Running { started } => json!({"running": {"startedAt": started}}),
        State::Terminated {
            exit,
            reason,
            started,
            finished,
        } => json!({"terminated": {
            "exitCode": exit, "reason": reason, "startedAt": started, "finishedAt": finished,
        }}),
    }
}

/// A container's status; `resources` is what it runs with and what is allocated of its
/// requests (written for every container, as a kubelet with in-place resize does).
fn container_status(
    c: &Container,
    uid: &str,
    state: &State,
    last: Option<&State>,
    restarts: u32,
    ready: bool,
    resources: (ResourceRequirements, Option<BTreeMap<String, Quantity>>),
) -> Value {
    let (name, image) = (&c.name, c.image.as_deref().unwrap_or_default());
    let mut s = json!({
        "name": name,
        "image": image,
        "imageID": format!("simulated://{image}"),
        "containerID": format!("simulated://{uid}/{name}/{restarts}"),
        "ready": ready,
        "started": matches!(state, State::Running { .. }),
        "restartCount": restarts,
        "state": state_json(state),
        "lastState": {},
        "resources": resources.0,
    });
    if let Some(last) = last {
        s["lastState"] = state_json(last);
    }
    if let Some(allocated) = resources.1.filter(|r| !r.is_empty()) {
        s["allocatedResources"] = json!(allocated);
    }
    s
}
