//! Pod lifecycles on simulated nodes: one watch for every bound pod, one actor per pod UID.
//!
//! The actor is the only writer of its pod's status, so work on a pod is serialized; it
//! always sees the latest object through a `watch` channel and resumes correctly from any
//! status it finds (a simulator restarted mid-run picks its pods up where they are).
//!
//! Ready follows Running, except for a container with an HTTP readiness probe: the actor runs
//! that probe against the process a test runs for the pod ([`super::NodeSimulator::probe_at`])
//! and the pod is Ready only while it succeeds, as a kubelet would have it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::Inner;
use super::behavior::{AfterExit, Behavior, RestartPolicy};
use tensile_common::api::now;

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

/// The status of a running container, as [`PodActor::write_status`] takes it.
struct Running<'a> {
    start_time: &'a str,
    state: &'a State,
    last: Option<&'a State>,
    restarts: u32,
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
            inner,
            rx,
            namespace,
            name,
            ip: None,
            probe: Probe::of(&pod),
            probed_ready: false,
            failures: 0,
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

        let mut restarts: u32 = 0;
        let mut last: Option<State> = None;
        let mut started = now();
        let start_time;
        if phase == "Running" && status.pod_ip.is_some() {
            // Resuming after a simulator restart: keep the IP, count and start time.
            self.ip = status.pod_ip.clone();
            self.claim_ip();
            restarts = status
                .container_statuses
                .as_ref()
                .and_then(|c| c.first())
                .map(|c| c.restart_count.max(0) as u32)
                .unwrap_or(0);
            start_time = status.start_time.map(|t| t.0.to_string()).unwrap_or_else(now);
            if let Some(s) = status
                .container_statuses
                .as_ref()
                .and_then(|c| c.first())
                .and_then(|c| c.state.as_ref())
                .and_then(|s| s.running.as_ref())
                .and_then(|r| r.started_at.as_ref())
            {
                started = s.0.to_string();
            }
        } else {
            match self.wait(behavior.start).await {
                Wake::Elapsed => {}
                Wake::Deleting => return self.finish_deletion(&behavior).await,
                Wake::Gone => return Ok(()),
            }
            if self.allocate_ip().is_none() {
                tracing::warn!(node = %self.node, "no free pod IP on the node; the pod stays Pending");
                return self.until_deleted(&behavior).await;
            }
            start_time = now();
            started = now();
            self.write_status(
                &start_time,
                "Running",
                &State::Running {
                    started: started.clone(),
                },
                None,
                restarts,
            )
            .await?;
        }

        loop {
            let run_for = behavior.run_for(policy);
            let state = State::Running {
                started: started.clone(),
            };
            let running = Running {
                start_time: &start_time,
                state: &state,
                last: last.as_ref(),
                restarts,
            };
            let wake = self
                .wait_running(run_for.unwrap_or(Duration::MAX), &running)
                .await;
            match wake {
                Wake::Elapsed => {}
                Wake::Deleting => return self.finish_deletion(&behavior).await,
                Wake::Gone => return Ok(()),
            }
            // The container run ends.
            let exit = behavior.exit;
            let ended = State::Terminated {
                exit,
                reason: behavior.reason_for(exit),
                started: started.clone(),
                finished: now(),
            };
            match behavior.after_exit(policy, exit, restarts) {
                AfterExit::Terminal { succeeded } => {
                    let phase = if succeeded { "Succeeded" } else { "Failed" };
                    self.write_status(&start_time, phase, &ended, last.as_ref(), restarts)
                        .await?;
                    return self.until_deleted(&behavior).await;
                }
                AfterExit::CrashLoop => {
                    let waiting = State::Waiting {
                        reason: "CrashLoopBackOff",
                    };
                    self.write_status(&start_time, "Running", &waiting, Some(&ended), restarts)
                        .await?;
                    return self.until_deleted(&behavior).await;
                }
                AfterExit::Restart => {
                    let waiting = State::Waiting {
                        reason: "CrashLoopBackOff",
                    };
                    self.write_status(&start_time, "Running", &waiting, Some(&ended), restarts)
                        .await?;
                    match self.wait(behavior.backoff).await {
                        Wake::Elapsed => {}
                        Wake::Deleting => return self.finish_deletion(&behavior).await,
                        Wake::Gone => return Ok(()),
                    }
                    restarts += 1;
                    started = now();
                    let running = State::Running {
                        started: started.clone(),
                    };
                    self.write_status(&start_time, "Running", &running, Some(&ended), restarts)
                        .await?;
                    last = Some(ended);
                }
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
    /// of the probe's verdict is written with `running`. As a kubelet's status manager does,
    /// a Ready condition someone else changed (the node lifecycle controller marks the pods of
    /// a node it saw go Unknown not ready) is written back once the pod changes.
    async fn wait_running(&mut self, d: Duration, running: &Running<'_>) -> Wake {
        let deadline = tokio::time::Instant::now() + d.min(Duration::from_secs(100 * 365 * 24 * 3600));
        loop {
            let probed = match self.probe.clone() {
                Some(probe) => self.probe_once(&probe).await,
                None => false,
            };
            if probed || self.ready_overwritten(running) {
                let written = self
                    .write_status(
                        running.start_time,
                        "Running",
                        running.state,
                        running.last,
                        running.restarts,
                    )
                    .await;
                if let Err(e) = written {
                    tracing::warn!(pod = %format!("{}/{}", self.namespace, self.name), "status: {e}");
                }
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Wake::Elapsed;
            }
            let step = self.probe.as_ref().map_or(left, |p| p.period.min(left));
            if self.deleting() {
                return Wake::Deleting;
            }
            tokio::select! {
                _ = tokio::time::sleep(step) => {}
                changed = self.rx.changed() => if changed.is_err() { return Wake::Gone },
            }
        }
    }

    /// Whether the pod's Ready condition is no longer what this kubelet would write for
    /// `running` (someone else wrote it).
    fn ready_overwritten(&self, running: &Running<'_>) -> bool {
        let want =
            matches!(running.state, State::Running { .. }) && (self.probe.is_none() || self.probed_ready);
        let pod = self.pod();
        let seen = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status == "True");
        seen.is_some_and(|seen| seen != want)
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

    async fn write_status(
        &self,
        start_time: &str,
        phase: &str,
        state: &State,
        last: Option<&State>,
        restarts: u32,
    ) -> Result<(), kube::Error> {
        let pod = self.pod();
        let spec = pod.spec.clone().unwrap_or_default();
        let now = now();
        let ready = matches!(state, State::Running { .. }) && (self.probe.is_none() || self.probed_ready);
        let containers: Vec<Value> = spec
            .containers
            .iter()
            .map(|c| {
                container_status(
                    &c.name,
                    c.image.as_deref(),
                    &self.uid,
                    state,
                    last,
                    restarts,
                    ready,
                )
            })
            .collect();
        let done = State::Terminated {
            exit: 0,
            reason: "Completed".into(),
            started: start_time.to_owned(),
            finished: start_time.to_owned(),
        };
        // A restartable init container (a sidecar, `restartPolicy: Always`) runs beside the main
        // containers, as the kubelet keeps it; the others ran to completion before them.
        let init: Vec<Value> = spec
            .init_containers
            .unwrap_or_default()
            .iter()
            .map(|c| {
                let sidecar = c.restart_policy.as_deref() == Some("Always");
                if sidecar && !matches!(state, State::Terminated { .. }) {
                    let running = State::Running {
                        started: start_time.to_owned(),
                    };
                    container_status(&c.name, c.image.as_deref(), &self.uid, &running, None, 0, true)
                } else {
                    container_status(&c.name, c.image.as_deref(), &self.uid, &done, None, 0, false)
                }
            })
            .collect();
        let terminal = phase == "Succeeded" || phase == "Failed";
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
            if !ok {
                c["reason"] = json!(reason);
            }
            c
        };
        let mut status = json!({
            "observedGeneration": generation,
            "phase": phase,
            "hostIP": self.inner.node_ip.to_string(),
            "hostIPs": [{"ip": self.inner.node_ip.to_string()}],
            "startTime": start_time,
            "conditions": [
                cond("PodReadyToStartContainers", !terminal, ""),
                cond("Initialized", true, ""),
                cond("Ready", ready, ready_reason),
                cond("ContainersReady", ready, ready_reason),
                cond("PodScheduled", true, ""),
            ],
            "containerStatuses": containers,
        });
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

fn container_status(
    name: &str,
    image: Option<&str>,
    uid: &str,
    state: &State,
    last: Option<&State>,
    restarts: u32,
    ready: bool,
) -> Value {
    let image = image.unwrap_or_default();
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
    });
    if let Some(last) = last {
        s["lastState"] = state_json(last);
    }
    s
}
