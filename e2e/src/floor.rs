//! The pod traffic's floor: what the watch events and writes a virtual node cannot do without
//! cost a client built as the node's is (the suite's kube client over rustls, pods decoded
//! into k8s-openapi's structs), on a thread and runtime of its own whose CPU clock counts
//! nothing else.
//!
//! During a paced run the floor watches what the virtual node watches of that run, the upper
//! pods bound to the node and the lower pods it made, decoding every event as a pod and doing
//! nothing with it. Once the run has settled it makes, one at a time, the three writes a pod
//! costs the node (the lower pod's create, the upper status write, the upper event), as dry
//! runs, so that the bed is left as it was: the apiserver admits and answers them as real
//! writes, and the client pays for them in full. Its CPU per pod is then what a virtual node
//! would cost if it did nothing but its traffic.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::benches::round3;

/// Writes of each kind made to measure what one costs.
const WRITES: usize = 500;

/// The floor's thread, watching until asked for its figures.
pub(crate) struct Floor {
    ask: Option<oneshot::Sender<usize>>,
    answer: mpsc::Receiver<anyhow::Result<Value>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the floor watches and where it writes.
pub(crate) struct Target {
    pub upper_kubeconfig: PathBuf,
    pub lower_kubeconfig: PathBuf,
    /// The virtual node (its upper pods by `spec.nodeName`, its lower pods by its mark).
    pub node: String,
}

impl Floor {
    /// Starts watching; the watches are open when this returns.
    pub(crate) async fn start(target: Target) -> anyhow::Result<Floor> {
        let (ask, asked) = oneshot::channel();
        let (answer_to, answer) = mpsc::channel(2);
        let thread = std::thread::Builder::new().name("floor".into()).spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = answer_to.blocking_send(Err(e.into()));
                    return;
                }
            };
            runtime.block_on(run(target, asked, answer_to));
        })?;
        let mut floor = Floor {
            ask: Some(ask),
            answer,
            thread: Some(thread),
        };
        // The first answer says the watches are open (or why not).
        floor
            .answer
            .recv()
            .await
            .context("the floor's thread ended before its watches opened")??;
        Ok(floor)
    }

    /// Stops watching, makes the writes, and reports the figures per pod of a run of `pods`.
    pub(crate) async fn figures(mut self, pods: usize) -> anyhow::Result<Value> {
        if let Some(ask) = self.ask.take() {
            let _ = ask.send(pods);
        }
        self.answer
            .recv()
            .await
            .context("the floor's thread ended without its figures")?
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        // Dropping the sender ends the thread's run.
        self.ask.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let ns: u64 = stat
        .split_whitespace()
        .next()
        .context("/proc/thread-self/schedstat is empty")?
        .parse()?;
    Ok(Duration::from_nanos(ns))
}

/// What the watch task has seen.
#[derive(Default)]
struct Seen {
    events: usize,
    /// Some of the pods, as last seen, for the writes.
    pods: std::collections::BTreeMap<String, Pod>,
}

/// Counts every event of `api`'s pods that `config` selects, decoded as a pod.
async fn watch(api: Api<Pod>, config: watcher::Config, seen: std::rc::Rc<std::cell::RefCell<Seen>>) {
    let mut events = std::pin::pin!(watcher(api, config));
    while let Some(event) = events.next().await {
        let Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
            continue;
        };
        let mut seen = seen.borrow_mut();
        seen.events += 1;
        let name = pod.metadata.name.clone().unwrap_or_default();
        if seen.pods.len() < WRITES || seen.pods.contains_key(&name) {
            seen.pods.insert(name, pod);
        }
    }
}

async fn run(target: Target, asked: oneshot::Receiver<usize>, answer: mpsc::Sender<anyhow::Result<Value>>) {
    let result = async {
        let options = Default::default();
        let upper = tensile_common::kubeconfig::client_from_file(&target.upper_kubeconfig, &options).await?;
        let lower = tensile_common::kubeconfig::client_from_file(&target.lower_kubeconfig, &options).await?;
        let (upper_seen, lower_seen) = (Default::default(), Default::default());
        let local = tokio::task::LocalSet::new();
        let started = thread_cpu()?;
        let upper_watch = local.spawn_local(watch(
            Api::all(upper.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={}", target.node)),
            std::rc::Rc::clone(&upper_seen),
        ));
        let lower_watch = local.spawn_local(watch(
            Api::all(lower.clone()),
            watcher::Config::default().labels(&format!("{}={}", tensile_common::names::MARK_NODE, target.node)),
            std::rc::Rc::clone(&lower_seen),
        ));
        // Open: the initial lists (empty before a run) have been made.
        local
            .run_until(tokio::time::sleep(Duration::from_secs(2)))
            .await;
        answer.send(Ok(Value::Null)).await?;
        let Ok(pods) = local.run_until(asked).await else {
            return Ok(None);
        };
        upper_watch.abort();
        lower_watch.abort();
        let watch_cpu = thread_cpu()? - started;
        let events = |seen: &std::rc::Rc<std::cell::RefCell<Seen>>| seen.borrow().events;
        let (upper_events, lower_events) = (events(&upper_seen), events(&lower_seen));
        let upper_pods: Vec<Pod> = upper_seen.borrow().pods.values().cloned().collect();
        let lower_pods: Vec<Pod> = lower_seen.borrow().pods.values().cloned().collect();
        anyhow::ensure!(
            !upper_pods.is_empty() && !lower_pods.is_empty(),
            "the floor saw no pod of node {} ({upper_events} upper and {lower_events} lower events)",
            target.node
        );
        let writes = writes(&upper, &lower, &upper_pods, &lower_pods).await?;
        let per_pod = |d: Duration| d.as_secs_f64() * 1000.0 / pods.max(1) as f64;
        let write_ms: f64 = writes.iter().map(|(_, ms)| ms).sum();
        let watch_ms = per_pod(watch_cpu);
        Ok(Some(json!({
            "note": "the least the node's pod traffic costs a client built as the node's: its watches of the run (every event decoded as a pod, nothing else done) over the run, and one of each write a pod costs it (lower create, upper status write, upper event; dry runs, one at a time) after it, on a thread of its own",
            "watch_events_per_pod": {
                "upper": round3(upper_events as f64 / pods.max(1) as f64),
                "lower": round3(lower_events as f64 / pods.max(1) as f64),
            },
            "watch_cpu_ms_per_pod": round3(watch_ms),
            "write_cpu_ms": writes.into_iter().map(|(kind, ms)| (kind.to_owned(), json!(round3(ms)))).collect::<serde_json::Map<_, _>>(),
            "cpu_ms_per_pod": round3(watch_ms + write_ms),
        })))
    }
    .await;
    match result {
        Ok(Some(figures)) => {
            let _ = answer.send(Ok(figures)).await;
        }
        Ok(None) => {}
        Err(e) => {
            let _ = answer.send(Err(e)).await;
        }
    }
}

/// CPU milliseconds of one write of each kind, over [`WRITES`] made one after the other.
async fn writes(
    upper: &kube::Client,
    lower: &kube::Client,
    upper_pods: &[Pod],
    lower_pods: &[Pod],
) -> anyhow::Result<Vec<(&'static str, f64)>> {
    let dry_post = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let dry_patch = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let mut figures = Vec::new();

    // The lower pod's create: a lower pod as the node made it, without what the apiserver
    // added, under a new name.
    let started = thread_cpu()?;
    for i in 0..WRITES {
        let mut pod = lower_pods[i % lower_pods.len()].clone();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        pod.metadata = kube::api::ObjectMeta {
            name: Some(format!("floor-{i}")),
            namespace: Some(namespace.clone()),
            labels: pod.metadata.labels.take(),
            annotations: pod.metadata.annotations.take(),
            ..Default::default()
        };
        pod.status = None;
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_name = None;
        }
        let api: Api<Pod> = Api::namespaced(lower.clone(), &namespace);
        tensile_common::api::create_stored(&api, &dry_post, &pod)
            .await
            .context("a dry-run create of a lower pod")?;
    }
    figures.push(("lower_pod_create", per_write(started)?));

    // The upper status write: the pod's status as it is, under its UID.
    let started = thread_cpu()?;
    for i in 0..WRITES {
        let pod = &upper_pods[i % upper_pods.len()];
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let patch = json!({"metadata": {"uid": pod.metadata.uid}, "status": pod.status});
        let api: Api<Pod> = Api::namespaced(upper.clone(), &namespace);
        tensile_common::api::patch_status_stored(&api, &name, &dry_patch, &Patch::Strategic(&patch))
            .await
            .context("a dry-run status write of an upper pod")?;
    }
    figures.push(("upper_status_write", per_write(started)?));

    // The upper event, as the node's publisher makes one.
    let started = thread_cpu()?;
    for i in 0..WRITES {
        let pod = &upper_pods[i % upper_pods.len()];
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let wall = jiff::Timestamp::now();
        let event: Event = serde_json::from_value(json!({
            "metadata": {"name": format!("floor.{:x}", wall.as_nanosecond()), "namespace": namespace},
            "eventTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(wall),
            "action": "Create",
            "reason": "Created",
            "note": "the floor's event",
            "type": "Normal",
            "regarding": {"kind": "Pod", "apiVersion": "v1", "namespace": namespace,
                          "name": pod.metadata.name, "uid": pod.metadata.uid},
            "reportingController": "tensile-floor",
            "reportingInstance": "tensile-floor",
        }))?;
        let api: Api<Event> = Api::namespaced(upper.clone(), &namespace);
        tensile_common::api::create_stored(&api, &dry_post, &event)
            .await
            .context("a dry-run create of an upper event")?;
    }
    figures.push(("upper_event_create", per_write(started)?));
    Ok(figures)
}

/// CPU milliseconds a write took since `started`, over [`WRITES`].
fn per_write(started: Duration) -> anyhow::Result<f64> {
    Ok((thread_cpu()? - started).as_secs_f64() * 1000.0 / WRITES as f64)
}
