//! The multi-scheduler end to end, behind a real kube-scheduler: an upper cluster with its
//! default scheduler and a second one, `tensile-scheduler`, started from the shipped
//! `scheduler-v1.yaml` with the `multi-scheduler` extender; three lower clusters, each
//! shown as one virtual node:
//!
//! * lower-a: many 2-CPU nodes (a large aggregate, no big node);
//! * lower-b: a few 8-CPU nodes;
//! * lower-c: two 4-CPU nodes with `example.com/gpu`, tainted `gpu=yes:NoSchedule`.
//!
//! Pods are created as the webhook leaves them: lower constraints in the stash, the virtual
//! node toleration and label requirement upstream, and a preference for vn-a (the cheap
//! cluster). The standalone mode (`--mode=scheduler`, as `tensile-standalone`) runs the same
//! burst without any kube-scheduler. The burst as Deployments, stashed by the webhook, is also
//! timed through the extender and through the default scheduler with the descheduler. One
//! scene runs at a time; each cleans up its pods. The `multi-scheduler` and `descheduler`
//! binaries must be built (`make test` builds every binary first).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tensile_common::exclusion::Location;
use tensile_common::names;
use tensile_common::quantity::ResourceMap;
use tensile_common::stash::Stash;
use tensile_e2e::check::{Namespaces, apply, kubectl, webhook_registration};
use tensile_e2e::descheduler::DeschedulerProcess;
use tensile_e2e::in_process;
use tensile_e2e::multi_scheduler::{CONFIG_V1, ExtenderProcess, StandaloneProcess, scheduler_config};
use tensile_e2e::process::Service;
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::wait::within;
use tensile_e2e::{NodeConfig, NodeSimulator, TestCluster, free_port};
use tensile_webhook::Policy;

const ZONE: &str = "topology.kubernetes.io/zone";
const GPU: &str = "example.com/gpu";
const SCHEDULER: &str = "tensile-scheduler";
/// The standalone scheduler's name (the extender's kube-scheduler keeps `tensile-scheduler`).
const STANDALONE: &str = "tensile-standalone";
const VN_A: &str = "vn-a";
const VN_B: &str = "vn-b";
const VN_C: &str = "vn-c";

struct Bed {
    upper: TestCluster,
    /// lower-a, lower-b, lower-c: the clusters behind vn-a, vn-b, vn-c.
    lowers: Vec<TestCluster>,
    sim_b: NodeSimulator,
    _sims: Vec<NodeSimulator>,
    _nodes: Vec<in_process::VirtualNode>,
    extender: std::sync::Mutex<ExtenderProcess>,
    /// The standalone scheduler's account as the chart renders it (`mode: scheduler`,
    /// release `tensile-standalone`), for the scenes that start one.
    standalone: std::path::PathBuf,
    _scheduler: Service,
}

/// The standalone scheduler's flags as the chart renders them for its release.
const STANDALONE_EXCLUSIONS: &str = "--exclusions-configmap=kube-system/tensile-standalone-exclusions";

static BED: Shared<Bed> = Shared::new();
/// One scene at a time: they share the lower clusters' capacity.
static SCENE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Takes the scene and sets it: no upper pod left by an earlier scene (one that failed
/// before its clean-up included), and every virtual node's shape showing each of its lower
/// nodes empty again. Without the second, a burst that starts within the 5 s a virtual node
/// takes to publish a changed shape is filtered against the previous scene's load.
async fn scene() -> Scene {
    let guard = SCENE.lock().await;
    let bed = bed();
    let client = bed.upper.client().await.unwrap();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    for ns in namespaces.list(&ListParams::default()).await.unwrap().items {
        let ns = ns.metadata.name.unwrap_or_default();
        if !ns.starts_with("kube-") {
            clean_up(&Api::namespaced(client.clone(), &ns)).await;
        }
    }
    for (name, lower) in [VN_A, VN_B, VN_C].into_iter().zip(&bed.lowers) {
        let lower = lower.client().await.unwrap();
        let upper = client.clone();
        within(
            &format!("{name}'s shape showing every lower node empty"),
            30,
            || shape_shows_empty(upper.clone(), lower.clone(), name),
        )
        .await;
    }
    Scene { _guard: guard }
}

/// The scene, held while it runs. When it ends, no log of the suite's daemons (the
/// extender's, a standalone scheduler's, a descheduler's) shows a call the chart's account
/// was refused.
struct Scene {
    _guard: tokio::sync::MutexGuard<'static, ()>,
}

impl Drop for Scene {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let dir = bed().upper.dir();
        let logs = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path());
        for log in logs.filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            (name.starts_with("multi-scheduler-") || name.starts_with("descheduler-"))
                && name.ends_with(".log")
        }) {
            let denied = tensile_e2e::chart::denied_calls(&tensile_e2e::process::log_tail(&log, 4_000_000));
            assert!(
                denied.is_empty(),
                "{} under the chart's account was refused: {denied:?}",
                log.display()
            );
        }
    }
}

/// Ok when the shape of virtual node `name` has, for each lower node, a frontier vector
/// with all of that node's allocatable free (on the resources the shape names).
async fn shape_shows_empty(upper: kube::Client, lower: kube::Client, name: &str) -> Result<(), String> {
    let node = Api::<Node>::all(upper)
        .get(name)
        .await
        .map_err(|e| e.to_string())?;
    let text = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_CAPACITY_SHAPE))
        .ok_or("no shape")?;
    let shape = tensile_common::shape::Shape::decode(text).map_err(|e| e.to_string())?;
    let mut free = Vec::new();
    for group in &shape.groups {
        free.extend(group.free_maps().map_err(|e| e.to_string())?);
    }
    let lower_nodes = Api::<Node>::all(lower)
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    for n in lower_nodes
        .items
        .iter()
        .filter(|n| tensile_common::shape::usable(n))
    {
        let allocatable = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let Some(allocatable) = allocatable else { continue };
        let (allocatable, _) = ResourceMap::parse(allocatable.iter().map(|(k, v)| (k, &v.0)));
        let empty = free
            .iter()
            .any(|v| v.0.iter().all(|(k, amount)| *amount >= allocatable.get(k)));
        if !empty {
            return Err(format!(
                "lower node {} not shown empty in {free:?}",
                n.metadata.name.as_deref().unwrap_or_default()
            ));
        }
    }
    Ok(())
}

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let [upper, a, b, c] =
            scene::clusters("multi_scheduler", ["upper", "lower-a", "lower-b", "lower-c"]).await?;
        tensile_e2e::chart::install_exclusion_records(upper.kubeconfig()).await?;
        let sim_a = scene::simulate(&a, Vec::new()).await?;
        let sim_b = scene::simulate(&b, Vec::new()).await?;
        let sim_c = scene::simulate(&c, Vec::new()).await?;
        for i in 0..12 {
            let node = NodeConfig::new(&format!("a{i}"))
                .resource("cpu", "2")
                .label(ZONE, "zone-a");
            sim_a.add_node(node).await?;
        }
        for i in 0..3 {
            let node = NodeConfig::new(&format!("b{i}"))
                .resource("cpu", "8")
                .resource("memory", "16Gi")
                .label(ZONE, "zone-b");
            sim_b.add_node(node).await?;
        }
        for i in 0..2 {
            let node = NodeConfig::new(&format!("c{i}"))
                .resource(GPU, "2")
                .label(ZONE, "zone-c")
                .taint("gpu", "yes", "NoSchedule");
            sim_c.add_node(node).await?;
        }
        let mut nodes = Vec::new();
        for (name, lower) in [(VN_A, &a), (VN_B, &b), (VN_C, &c)] {
            nodes.push(scene::virtual_node(&upper, name, lower, |_| {})?);
        }
        let client = upper.client().await?;
        for name in [VN_A, VN_B, VN_C] {
            tensile_e2e::wait::until(
                &format!("{name} Ready with a current capacity shape"),
                Duration::from_secs(60),
                Duration::from_millis(250),
                || node_published(client.clone(), name),
            )
            .await?;
        }
        // Both modes run under the accounts the chart renders for them: the extender as
        // release `tensile` in kube-system (its exclusion records, the default location),
        // the standalone scheduler as release `tensile-standalone` there.
        let chart_identity = |release: &'static str, mode: &'static str| {
            let sets = [
                "multiScheduler.enabled=true".to_owned(),
                format!("multiScheduler.mode={mode}"),
            ];
            let account = format!("{release}-multi-scheduler");
            let upper = &upper;
            async move {
                tensile_e2e::chart::component_identity(
                    upper,
                    "multi-scheduler",
                    release,
                    "kube-system",
                    &sets,
                    &account,
                )
                .await
            }
        };
        let extender_identity = chart_identity("tensile", "extender").await?;
        let standalone = chart_identity("tensile-standalone", "scheduler").await?;
        let extender =
            ExtenderProcess::start_as(&upper, &extender_identity, &[], "extender").map_err(demo)?;
        extender.wait_ready(Duration::from_secs(30)).await.map_err(demo)?;
        let config = scheduler_config(CONFIG_V1, upper.kubeconfig(), &extender.url, &extender.ca_file)
            .map_err(demo)?;
        let config_path = upper.dir().join("tensile-scheduler.yaml");
        std::fs::write(&config_path, config).map_err(|e| tensile_e2e::Error::Demo(e.to_string()))?;
        let scheduler = upper.start_scheduler(&config_path, "tensile-scheduler")?;
        Ok(Bed {
            upper,
            lowers: vec![a, b, c],
            sim_b,
            _sims: vec![sim_a, sim_c],
            _nodes: nodes,
            extender: std::sync::Mutex::new(extender),
            standalone,
            _scheduler: scheduler,
        })
    })
}

fn demo(e: impl std::fmt::Display) -> tensile_e2e::Error {
    tensile_e2e::Error::Demo(e.to_string())
}

async fn node_published(client: kube::Client, name: &str) -> Result<(), String> {
    let node = Api::<Node>::all(client)
        .get(name)
        .await
        .map_err(|e| e.to_string())?;
    let ready = node
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let shape = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_CAPACITY_SHAPE))
        .cloned()
        .unwrap_or_default();
    if ready && shape.contains(r#""v":2"#) {
        Ok(())
    } else {
        Err(format!("ready={ready}, shape={shape}"))
    }
}

/// A pod as the webhook leaves an opted-in one: `stash` holds its lower constraints.
fn pod(name: &str, scheduler: Option<&str>, requests: Value, stash: &Stash) -> Pod {
    let mut annotations = serde_json::Map::new();
    annotations.insert(names::CLUSTER_SELECTOR.into(), stash.encode().unwrap().into());
    let limits: serde_json::Map<String, Value> = requests
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.contains('/'))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {names::VIRTUAL_POD_LABEL: names::VIRTUAL_POD_VALUE},
                     "annotations": annotations},
        "spec": {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": names::VIRTUAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": names::VIRTUAL_NODE_TYPE_LABEL, "operator": "In", "values": [names::VIRTUAL_NODE_TYPE_VALUE]}]}]},
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {"matchExpressions": [
                    {"key": names::HOSTNAME_LABEL, "operator": "In", "values": [VN_A]}]}}]}},
            "containers": [{"name": "app", "image": "nginx", "resources": {"requests": requests, "limits": limits}}],
        },
    }))
    .unwrap()
}

fn gpu_stash() -> Stash {
    serde_json::from_value(json!({
        "nodeSelector": {ZONE: "zone-c"},
        "tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}],
    }))
    .unwrap()
}

/// The mixed burst: 8 small pods, 3 of 6 CPUs, 2 needing a GPU of lower-c. Each with the
/// clusters (virtual nodes) that can hold it.
fn burst(scheduler: Option<&str>) -> Vec<(Pod, &'static [&'static str])> {
    let mut pods: Vec<(Pod, &'static [&'static str])> = Vec::new();
    for i in 0..8 {
        let p = pod(
            &format!("small-{i}"),
            scheduler,
            json!({"cpu": "500m"}),
            &Stash::default(),
        );
        pods.push((p, &[VN_A, VN_B]));
    }
    for i in 0..3 {
        let p = pod(
            &format!("big-{i}"),
            scheduler,
            json!({"cpu": "6"}),
            &Stash::default(),
        );
        pods.push((p, &[VN_B]));
    }
    for i in 0..2 {
        let p = pod(
            &format!("gpu-{i}"),
            scheduler,
            json!({"cpu": "1", GPU: "1"}),
            &gpu_stash(),
        );
        pods.push((p, &[VN_C]));
    }
    pods
}

/// A namespace of the upper cluster for one scene.
async fn namespace(name: &str) -> Api<Pod> {
    bed().upper.create_namespace(name).await.unwrap();
    Api::namespaced(bed().upper.client().await.unwrap(), name)
}

async fn create_all(api: &Api<Pod>, pods: &[(Pod, &[&str])]) {
    let params = PostParams::default();
    let creates = pods.iter().map(|(p, _)| api.create(&params, p));
    for result in futures::future::join_all(creates).await {
        result.unwrap();
    }
}

fn lower_refused(p: &Pod) -> bool {
    p.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == names::CONDITION_LOWER_SCHEDULED && c.status == "False")
}

fn node_of(p: &Pod) -> &str {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

fn name_of(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Deletes every pod of the namespace and waits until they are gone (the virtual nodes
/// delete the lower pods first, so lower capacity is free again then).
async fn clean_up(api: &Api<Pod>) {
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    within("the scene's pods gone", 60, || async {
        let left = api
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        if left.items.is_empty() {
            Ok(())
        } else {
            Err(format!("{} left", left.items.len()))
        }
    })
    .await;
}

/// FailedScheduling messages of pod `name`.
async fn failed_scheduling(ns: &str, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(bed().upper.client().await.unwrap(), ns);
    let params = ListParams::default().fields(&format!("involvedObject.name={name},reason=FailedScheduling"));
    messages(events, params).await
}

/// Messages of the events of `reason` in `ns`.
async fn events(ns: &str, reason: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(bed().upper.client().await.unwrap(), ns);
    messages(events, ListParams::default().fields(&format!("reason={reason}"))).await
}

async fn messages(events: Api<Event>, params: ListParams) -> Vec<String> {
    events
        .list(&params)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.message)
        .collect()
}

/// Creates `pods` and waits until every one is Running, watching that no pod is ever
/// refused by a lower scheduler and that each lands on a virtual node that can hold it.
/// Returns the time to all Running.
async fn run_burst(api: &Api<Pod>, pods: &[(Pod, &[&str])], log: impl Fn() -> String) -> Duration {
    let fits: BTreeMap<String, &[&str]> = pods.iter().map(|(p, f)| (name_of(p), *f)).collect();
    let started = Instant::now();
    create_all(api, pods).await;
    let mut refused: BTreeSet<String> = BTreeSet::new();
    let deadline = started + Duration::from_secs(90);
    let placed = loop {
        let now = api.list(&ListParams::default()).await.unwrap().items;
        refused.extend(now.iter().filter(|p| lower_refused(p)).map(name_of));
        if now.len() == pods.len() && now.iter().all(running) {
            break now;
        }
        if Instant::now() > deadline {
            let seen: Vec<String> = now
                .iter()
                .map(|p| format!("{} on {:?} running={}", name_of(p), node_of(p), running(p)))
                .collect();
            panic!("not all Running after 90 s: {seen:?}; log:\n{}", log());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let elapsed = started.elapsed();
    assert!(refused.is_empty(), "refused by a lower scheduler: {refused:?}");
    for p in &placed {
        let allowed = fits[&name_of(p)];
        assert!(
            allowed.contains(&node_of(p)),
            "{} on {}, which cannot hold it (allowed: {allowed:?})",
            name_of(p),
            node_of(p)
        );
    }
    elapsed
}

#[tokio::test]
async fn a_mixed_burst_through_the_extender_runs_with_no_pod_ever_refused_below() {
    let _scene = scene().await;
    let bed = bed();
    let api = namespace("burst-extender").await;
    let pods = burst(Some(SCHEDULER));
    let elapsed = run_burst(&api, &pods, || bed.extender.lock().unwrap().log()).await;
    let admin = bed.extender.lock().unwrap().admin_addr.clone();
    let metrics = in_process::admin_get(&admin, "/metrics")
        .await
        .unwrap_or_default()
        .1;
    let rejected = tensile_e2e::descheduler::metric_sum(
        &metrics,
        "tensile_multischeduler_nodes_rejected_total",
        &[("reason", "shape")],
    );
    assert!(rejected > 0.0, "the filter turned nodes down: {metrics}");
    println!(
        "burst of {} pods through the extender: all Running in {:.1} s",
        pods.len(),
        elapsed.as_secs_f64()
    );
    clean_up(&api).await;
}

#[tokio::test]
async fn the_standalone_scheduler_runs_the_burst_with_no_pod_refused_below_and_explains_a_pod_that_fits_nowhere()
 {
    let _scene = scene().await;
    let bed = bed();
    let standalone = StandaloneProcess::start(
        &bed.upper,
        &bed.standalone,
        STANDALONE,
        &[STANDALONE_EXCLUSIONS.to_owned()],
        "standalone",
    )
    .unwrap();
    standalone.wait_ready(Duration::from_secs(30)).await.unwrap();
    let ns = "burst-standalone";
    let api = namespace(ns).await;
    let pods = burst(Some(STANDALONE));
    let elapsed = run_burst(&api, &pods, || standalone.service.log_tail(20_000)).await;
    println!(
        "burst of {} pods through the standalone scheduler: all Running in {:.1} s",
        pods.len(),
        elapsed.as_secs_f64()
    );
    let scheduled = events(ns, "Scheduled").await;
    assert!(
        scheduled
            .iter()
            .any(|m| m == &format!("Successfully assigned {ns}/big-0 to {VN_B}")),
        "{scheduled:?}"
    );

    let twenty = pod(
        "twenty",
        Some(STANDALONE),
        json!({"cpu": "20"}),
        &Stash::default(),
    );
    api.create(&PostParams::default(), &twenty).await.unwrap();
    let condition = within("PodScheduled=False with the reason", 30, || async {
        let p = api.get("twenty").await.map_err(|e| e.to_string())?;
        let c = p
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .cloned();
        match c {
            Some(c)
                if c.message
                    .as_deref()
                    .is_some_and(|m| m.contains("no lower node fits cpu=20")) =>
            {
                Ok(c)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(condition.reason.as_deref(), Some("Unschedulable"));
    let failed = failed_scheduling(ns, "twenty").await;
    assert!(
        failed
            .iter()
            .any(|m| m.starts_with("0/3 nodes are available") && m.contains("no lower node fits cpu=20")),
        "{failed:?}"
    );
    println!("standalone, a pod that fits nowhere: {failed:?}");
    clean_up(&api).await;
}

#[tokio::test]
async fn the_same_burst_with_the_default_scheduler_leaves_pods_refused_below() {
    let _scene = scene().await;
    bed();
    let api = namespace("burst-default").await;
    let pods = burst(None);
    create_all(&api, &pods).await;
    let refused = within("a pod refused by a lower scheduler", 60, || async {
        let now = api
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items;
        let refused: Vec<String> = now
            .iter()
            .filter(|p| lower_refused(p))
            .map(|p| format!("{} on {}", name_of(p), node_of(p)))
            .collect();
        if refused.is_empty() {
            Err(format!("{} pods, none refused yet", now.len()))
        } else {
            Ok(refused)
        }
    })
    .await;
    println!("with the default scheduler, refused below: {refused:?}");
    clean_up(&api).await;
}

#[tokio::test]
async fn a_pod_no_lower_node_holds_waits_with_the_reason_and_schedules_once_a_lower_node_is_added() {
    let _scene = scene().await;
    let bed = bed();
    let ns = "too-big";
    let api = namespace(ns).await;
    let big = pod("twelve", Some(SCHEDULER), json!({"cpu": "12"}), &Stash::default());
    api.create(&PostParams::default(), &big).await.unwrap();
    let messages = within(
        "a FailedScheduling event with the filter's reason",
        30,
        || async {
            let messages = failed_scheduling(ns, "twelve").await;
            if messages.iter().any(|m| m.contains("no lower node fits cpu=12")) {
                Ok(messages)
            } else {
                Err(format!("{messages:?}"))
            }
        },
    )
    .await;
    println!("FailedScheduling: {messages:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = api.get("twelve").await.unwrap();
    assert_eq!(node_of(&waiting), "", "still unbound");

    let nodes: Api<Node> = Api::all(bed.upper.client().await.unwrap());
    let generation = |n: &Node| {
        n.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(names::NODE_SHAPE_GENERATION))
            .and_then(|g| g.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = generation(&nodes.get(VN_B).await.unwrap());
    let added = Instant::now();
    BED.handle()
        .unwrap()
        .spawn(async move {
            let node = NodeConfig::new("b-large")
                .resource("cpu", "16")
                .label(ZONE, "zone-b");
            bed.sim_b.add_node(node).await.unwrap();
        })
        .await
        .unwrap();
    within("the waiting pod bound to vn-b", 30, || async {
        let p = api.get("twelve").await.map_err(|e| e.to_string())?;
        if node_of(&p) == VN_B {
            Ok(())
        } else {
            Err(format!("on {:?}", node_of(&p)))
        }
    })
    .await;
    let bound_after = added.elapsed();
    // kube-scheduler may retry the pod on the shape's own write before the label moves: the
    // bump follows the shape by a second, and one within 10 s of the previous bump is owed
    // until then, so the label is given that long.
    let after = within("the shape grew, so the generation label moved", 20, || async {
        let after = generation(&nodes.get(VN_B).await.map_err(|e| e.to_string())?);
        if after > before {
            Ok(after)
        } else {
            Err(format!("{before} -> {after}"))
        }
    })
    .await;
    println!(
        "retry: bound {:.1} s after the lower node was added (generation {before} -> {after})",
        bound_after.as_secs_f64()
    );
    clean_up(&api).await;
}

#[tokio::test]
async fn with_the_extender_down_its_pods_wait_and_default_scheduler_pods_still_schedule() {
    let _scene = scene().await;
    let bed = bed();
    let ns = "extender-down";
    let api = namespace(ns).await;
    bed.extender.lock().unwrap().service.stop();
    let ours = pod("ours", Some(SCHEDULER), json!({"cpu": "500m"}), &Stash::default());
    let theirs = pod("theirs", None, json!({"cpu": "500m"}), &Stash::default());
    create_all(&api, &[(ours, &[]), (theirs, &[])]).await;
    within("the default scheduler's pod bound", 20, || async {
        let p = api.get("theirs").await.map_err(|e| e.to_string())?;
        if node_of(&p).is_empty() {
            Err("unbound".into())
        } else {
            Ok(())
        }
    })
    .await;
    let messages = within("a FailedScheduling event naming the extender", 20, || async {
        let messages = failed_scheduling(ns, "ours").await;
        if messages.iter().any(|m| m.contains("/filter")) {
            Ok(messages)
        } else {
            Err(format!("{messages:?}"))
        }
    })
    .await;
    println!("with the extender down: {messages:?}");
    assert_eq!(
        node_of(&api.get("ours").await.unwrap()),
        "",
        "waits for the extender"
    );

    let admin = {
        let mut extender = bed.extender.lock().unwrap();
        extender.service.restart().unwrap();
        extender.admin_addr.clone()
    };
    within("the extender back", 30, || async {
        match in_process::admin_get(&admin, "/readyz").await {
            Some((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    clean_up(&api).await;
}

/// The burst as Deployments, pods as users write them (the webhook stashes their lower
/// constraints): its pods under `scheduler` (`None`: the default scheduler).
fn deployments(ns: &str, scheduler: Option<&str>) -> [String; 3] {
    let deployment = |name: &str, replicas: u32, requests: Value, gpu: bool| {
        let limits: serde_json::Map<String, Value> = requests
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.contains('/'))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let (selector, tolerations) = if gpu {
            (
                json!({ZONE: "zone-c"}),
                json!([{"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}]),
            )
        } else {
            (json!({}), json!([]))
        };
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name, names::VIRTUAL_POD_LABEL: names::VIRTUAL_POD_VALUE}},
                    "spec": {
                        "schedulerName": scheduler,
                        "terminationGracePeriodSeconds": 1,
                        "nodeSelector": selector,
                        "tolerations": tolerations,
                        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 100, "preference": {"matchExpressions": [
                                {"key": names::HOSTNAME_LABEL, "operator": "In", "values": [VN_A]}]}}]}},
                        "containers": [{"name": "app", "image": "nginx",
                                        "resources": {"requests": requests, "limits": limits}}],
                    },
                },
            },
        })
        .to_string()
    };
    [
        deployment("small", 8, json!({"cpu": "500m"}), false),
        deployment("big", 3, json!({"cpu": "6"}), false),
        deployment("gpu", 2, json!({"cpu": "1", GPU: "1"}), true),
    ]
}

/// Applies the burst as Deployments and waits until its 13 pods run, none left elsewhere;
/// returns the time to all Running and the pods refused below meanwhile.
async fn deployments_running(ns: &str, scheduler: Option<&str>) -> (Duration, BTreeSet<String>) {
    let api: Api<Pod> = Api::namespaced(bed().upper.client().await.unwrap(), ns);
    let started = Instant::now();
    for deployment in deployments(ns, scheduler) {
        apply(bed().upper.kubeconfig(), &deployment).await;
    }
    let mut refused = BTreeSet::new();
    loop {
        let now = api.list(&ListParams::default()).await.unwrap().items;
        refused.extend(now.iter().filter(|p| lower_refused(p)).map(name_of));
        let live: Vec<&Pod> = now
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        if live.len() == 13 && live.iter().all(|p| running(p)) {
            return (started.elapsed(), refused);
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "not all Running after 180 s: {:?}",
            live.iter()
                .map(|p| format!("{} on {:?} running={}", name_of(p), node_of(p), running(p)))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Registers a webhook for the namespaces labelled `tensile-e2e=<label>` and starts it with
/// `policy`; returns it ready, with the registration's name.
async fn start_webhook(
    label: &str,
    policy: Policy,
    exclusions: Option<Location>,
) -> (tensile_webhook::Running, String) {
    let bed = bed();
    let port = free_port().unwrap();
    let config = format!("tensile-webhook-{label}");
    apply(
        bed.upper.kubeconfig(),
        &webhook_registration(&config, port, Namespaces::Labelled(label), None),
    )
    .await;
    let mut options = scene::webhook_options(port);
    options.client = Some(bed.upper.client().await.unwrap());
    options.webhook_config_name = Some(config.clone());
    options.policy = policy;
    options.exclusions = exclusions;
    let webhook = BED
        .handle()
        .unwrap()
        .spawn(tensile_webhook::start(options))
        .await
        .unwrap()
        .unwrap();
    scene::webhook_ready(&webhook).await;
    (webhook, config)
}

/// The Deployments name no scheduler: the webhook's `--scheduler-name` hands their opted-in
/// pods to the second kube-scheduler, so workloads need no edit.
#[tokio::test]
async fn the_burst_as_deployments_runs_sooner_through_the_extender_than_through_the_default_scheduler_and_the_descheduler()
 {
    let _scene = scene().await;
    let bed = bed();
    let (via_extender, via_descheduler) = ("deploy-extender", "deploy-descheduler");
    for ns in [via_extender, via_descheduler] {
        bed.upper.create_namespace(ns).await.unwrap();
        scene::opt_in_namespace(bed.upper.kubeconfig(), ns).await;
    }
    let to_the_extender = Policy {
        scheduler_name: Some(SCHEDULER.to_owned()),
        ..Policy::default()
    };
    let (webhook_extender, config_extender) = start_webhook(via_extender, to_the_extender, None).await;
    // The descheduler runs under the account the chart renders for release
    // `deploy-descheduler` in that namespace, whose records are named after the release.
    let exclusions = Location {
        namespace: via_descheduler.to_owned(),
        name: format!("{via_descheduler}-tensile-exclusions"),
    };
    let (webhook_default, config_default) =
        start_webhook(via_descheduler, Policy::default(), Some(exclusions.clone())).await;

    let (extender_time, refused) = deployments_running(via_extender, None).await;
    let extender_api: Api<Pod> = Api::namespaced(bed.upper.client().await.unwrap(), via_extender);
    let schedulers: BTreeSet<String> = extender_api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.scheduler_name.clone())
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(
        schedulers,
        BTreeSet::from([SCHEDULER.to_owned()]),
        "the webhook gave every opted-in pod the multi-scheduler's name"
    );
    assert!(
        refused.is_empty(),
        "refused below through the extender: {refused:?}"
    );
    kubectl(
        bed.upper.kubeconfig(),
        &[
            "-n",
            via_extender,
            "delete",
            "deployments",
            "--all",
            "--wait=false",
        ],
    )
    .await;
    clean_up(&extender_api).await;

    let identity = tensile_e2e::descheduler::chart_identity(&bed.upper, via_descheduler, "off")
        .await
        .unwrap();
    let descheduler = DeschedulerProcess::start_as(
        &bed.upper,
        &identity,
        &[
            "--node-selector=type=virtual-kubelet".to_owned(),
            "--bare-pods=off".to_owned(),
            format!("--exclusions-configmap={exclusions}"),
            "--unschedulable-threshold=3".to_owned(),
            "--descheduling-interval=5s".to_owned(),
        ],
        "deploy-burst",
    )
    .unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();
    let (descheduler_time, refused) = deployments_running(via_descheduler, None).await;
    assert!(
        !refused.is_empty(),
        "the default scheduler's placement was refused below and moved"
    );
    println!(
        "the burst as Deployments, to all Running: {:.1} s through the extender; {:.1} s through the \
         default scheduler and the descheduler ({} pods refused below and moved)",
        extender_time.as_secs_f64(),
        descheduler_time.as_secs_f64(),
        refused.len()
    );
    assert!(
        extender_time < descheduler_time,
        "the filter saves the detour through a refusal"
    );
    let api: Api<Pod> = Api::namespaced(bed.upper.client().await.unwrap(), via_descheduler);
    kubectl(
        bed.upper.kubeconfig(),
        &[
            "-n",
            via_descheduler,
            "delete",
            "deployments",
            "--all",
            "--wait=false",
        ],
    )
    .await;
    clean_up(&api).await;
    drop(descheduler);
    for (webhook, config) in [
        (webhook_extender, config_extender),
        (webhook_default, config_default),
    ] {
        kubectl(
            bed.upper.kubeconfig(),
            &["delete", "mutatingwebhookconfiguration", &config],
        )
        .await;
        webhook.stop().await;
    }
}

/// A pod of `pod` pinned upstream to the virtual node `node` (required node affinity on its
/// hostname), at `priority_class` when given.
fn pinned(name: &str, scheduler: &str, cpu: &str, node: &str, priority_class: Option<&str>) -> Pod {
    let mut p = pod(name, Some(scheduler), json!({"cpu": cpu}), &Stash::default());
    let spec = p.spec.as_mut().unwrap();
    spec.affinity = Some(
        serde_json::from_value(
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": names::HOSTNAME_LABEL, "operator": "In", "values": [node]}]}]}}}),
        )
        .unwrap(),
    );
    spec.priority_class_name = priority_class.map(str::to_owned);
    p
}

/// Waits until every pod of `api` is Running, or panics after 90 s.
async fn all_running(api: &Api<Pod>, what: &str) {
    within(what, 90, || async {
        let now = api
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items;
        let waiting: Vec<String> = now.iter().filter(|p| !running(p)).map(name_of).collect();
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(format!("not Running: {waiting:?}"))
        }
    })
    .await;
}

/// kube-scheduler picks preemption victims by the virtual node's aggregate room. On vn-a
/// (2-CPU lower nodes) no eviction can ever let a 6-CPU pod run below, so none of its pods
/// may be evicted for one: kube-scheduler marks vn-a unresolvable from the extender's filter
/// answer and asks the extender's `preempt` verb about the other candidates, which drops every
/// node where evicting cannot let a lower node hold the pod.
#[tokio::test]
async fn a_high_priority_pod_no_lower_node_can_hold_evicts_nothing() {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    let _scene = scene().await;
    let bed = bed();
    let client = bed.upper.client().await.unwrap();
    let high: PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": "tensile-e2e-high"}, "value": 1000})).unwrap();
    match Api::<PriorityClass>::all(client.clone())
        .create(&PostParams::default(), &high)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("priority class: {e}"),
    }
    let ns = "preempt";
    let api = namespace(ns).await;

    // vn-a: one 1.6-CPU pod of priority 0 on each of its twelve 2-CPU lower nodes, so the
    // aggregate has 4.8 CPUs left and every lower node 0.4.
    let low: Vec<(Pod, &[&str])> = (0..12)
        .map(|i| {
            (
                pinned(&format!("low-a-{i}"), SCHEDULER, "1600m", VN_A, None),
                &[VN_A][..],
            )
        })
        .collect();
    create_all(&api, &low).await;
    all_running(&api, "the low-priority pods Running").await;

    let uids = |pods: &[Pod], prefix: &str| -> BTreeSet<String> {
        pods.iter()
            .filter(|p| name_of(p).starts_with(prefix) && p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.uid.clone())
            .collect()
    };
    let before = api.list(&ListParams::default()).await.unwrap().items;
    let on_a = uids(&before, "low-a-");
    assert_eq!(on_a.len(), 12);

    let six = pinned("six-on-a", SCHEDULER, "6", VN_A, Some("tensile-e2e-high"));
    api.create(&PostParams::default(), &six).await.unwrap();
    let messages = within("a FailedScheduling event for the 6-CPU pod", 30, || async {
        let m = failed_scheduling(ns, "six-on-a").await;
        if m.is_empty() {
            Err("none yet".to_owned())
        } else {
            Ok(m)
        }
    })
    .await;
    // Preemption runs right after the failed attempt; give it and any eviction time to show.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let after = api.list(&ListParams::default()).await.unwrap().items;
    let admin = bed.extender.lock().unwrap().admin_addr.clone();
    let metrics = in_process::admin_get(&admin, "/metrics")
        .await
        .unwrap_or_default()
        .1;
    let preemption: Vec<&str> = metrics
        .lines()
        .filter(|l| l.contains("preempt") && !l.starts_with('#'))
        .collect();
    assert_eq!(
        uids(&after, "low-a-"),
        on_a,
        "no pod on vn-a evicted for a pod no lower node there can hold ({messages:?}); preempt verb: \
         {preemption:?}; Preempted events: {:?}",
        events(ns, "Preempted").await
    );
    let waiting = api.get("six-on-a").await.unwrap();
    assert_eq!(node_of(&waiting), "");
    let nominated = waiting
        .status
        .as_ref()
        .and_then(|s| s.nominated_node_name.clone());
    assert_eq!(nominated, None, "not nominated to vn-a either");
    println!("preemption: nothing evicted on vn-a for {messages:?}");
    clean_up(&api).await;
}

/// The standalone scheduler does not see the pods that inter-pod constraints refer to: a
/// pod with one is refused once, with a condition and an event that say so and what to do,
/// never bound as if it had none.
#[tokio::test]
async fn the_standalone_scheduler_refuses_a_pod_with_inter_pod_constraints_and_says_what_to_do() {
    let _scene = scene().await;
    let bed = bed();
    let standalone = StandaloneProcess::start(
        &bed.upper,
        &bed.standalone,
        STANDALONE,
        &[STANDALONE_EXCLUSIONS.to_owned()],
        "standalone-refuse",
    )
    .unwrap();
    standalone.wait_ready(Duration::from_secs(30)).await.unwrap();
    let ns = "standalone-refuse";
    let api = namespace(ns).await;
    let mut spread = pod(
        "spread",
        Some(STANDALONE),
        json!({"cpu": "100m"}),
        &Stash::default(),
    );
    let spec = spread.spec.as_mut().unwrap();
    spec.affinity.as_mut().unwrap().pod_anti_affinity = Some(
        serde_json::from_value(json!({"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {names::VIRTUAL_POD_LABEL: names::VIRTUAL_POD_VALUE}},
             "topologyKey": names::HOSTNAME_LABEL}]}))
        .unwrap(),
    );
    let plain = pod(
        "plain",
        Some(STANDALONE),
        json!({"cpu": "100m"}),
        &Stash::default(),
    );
    create_all(&api, &[(spread, &[]), (plain, &[])]).await;
    let condition = within("PodScheduled=False naming the constraint", 30, || async {
        let p = api.get("spread").await.map_err(|e| e.to_string())?;
        let c = p
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .cloned();
        match c {
            Some(c)
                if c.message
                    .as_deref()
                    .is_some_and(|m| m.contains("required pod anti-affinity")) =>
            {
                Ok(c)
            }
            other => Err(format!("{other:?}; node {:?}", node_of(&p))),
        }
    })
    .await;
    let message = condition.message.unwrap_or_default();
    assert!(
        message.contains("multi-scheduler extender"),
        "says what to do: {message}"
    );
    let failed = failed_scheduling(ns, "spread").await;
    assert!(
        failed.iter().any(|m| m == &message),
        "a Warning event with it: {failed:?}"
    );
    within("the plain pod bound", 30, || async {
        let p = api.get("plain").await.map_err(|e| e.to_string())?;
        if node_of(&p).is_empty() {
            Err("unbound".to_owned())
        } else {
            Ok(())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(node_of(&api.get("spread").await.unwrap()), "", "never bound");
    println!("standalone refusal: {message}");
    clean_up(&api).await;
}

/// A StatefulSet of `replicas` in `ns` whose pods the webhook pinned to `node` by their
/// volume (a PVC bound below there): the pin is `matchFields metadata.name In [node]`
/// joined to each required upper term, as the webhook writes it; `scheduler` places them.
fn volume_pinned_set(ns: &str, name: &str, scheduler: &str, node: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, names::VIRTUAL_POD_LABEL: names::VIRTUAL_POD_VALUE},
                             "annotations": {names::CLUSTER_SELECTOR: "{}"}},
                "spec": {
                    "schedulerName": scheduler,
                    "terminationGracePeriodSeconds": 1,
                    "tolerations": [{"key": names::VIRTUAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                        "matchExpressions": [{"key": names::VIRTUAL_NODE_TYPE_LABEL, "operator": "In",
                                              "values": [names::VIRTUAL_NODE_TYPE_VALUE]}],
                        "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
                    "containers": [{"name": "db", "image": "postgres", "resources": {"requests": {"cpu": "100m"}}}],
                },
            },
        },
    })
}

/// The descheduler's record excluding `node` for the StatefulSet `name` (by its UID) for
/// ten minutes, written where `location` says.
async fn exclude_set(ns: &str, name: &str, node: &str, location: &Location) {
    use tensile_common::exclusion::{ExclusionRecord, Record, encode};
    let client = bed().upper.client().await.unwrap();
    let set: Api<k8s_openapi::api::apps::v1::StatefulSet> = Api::namespaced(client.clone(), ns);
    let uid = set.get(name).await.unwrap().metadata.uid.unwrap();
    let until = jiff::Timestamp::now() + jiff::SignedDuration::from_mins(10);
    let record = Record {
        namespace: ns.to_owned(),
        kind: "StatefulSet".into(),
        name: name.to_owned(),
        nodes: [(node.to_owned(), until)].into(),
        moves: 1,
        expires: until,
        exhausted: None,
    };
    let object = encode(&location.namespace, &uid, &record, None, "e2e").unwrap();
    Api::<ExclusionRecord>::namespaced(client, &location.namespace)
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// A StatefulSet pod whose volume lives below one virtual node can run nowhere else. When
/// the descheduler excluded that node for the StatefulSet (a sibling was refused there),
/// the webhook and the descheduler leave such a pod alone; the extender and the standalone
/// scheduler must too, or the pod stays Pending until the exclusion expires.
#[tokio::test]
async fn a_volume_pinned_pod_of_an_excluded_statefulset_runs_on_its_volumes_node_in_both_modes() {
    let _scene = scene().await;
    let bed = bed();
    let standalone = StandaloneProcess::start(
        &bed.upper,
        &bed.standalone,
        STANDALONE,
        &[STANDALONE_EXCLUSIONS.to_owned()],
        "standalone-pinned",
    )
    .unwrap();
    standalone.wait_ready(Duration::from_secs(30)).await.unwrap();
    let ns = "volume-pinned";
    let api = namespace(ns).await;
    let kubeconfig = bed.upper.kubeconfig();
    let sets = [
        (
            "db-extender",
            SCHEDULER,
            tensile_common::exclusion::DEFAULT_LOCATION.parse().unwrap(),
        ),
        (
            "db-standalone",
            STANDALONE,
            "kube-system/tensile-standalone-exclusions".parse().unwrap(),
        ),
    ];
    for (name, scheduler, location) in &sets {
        apply(
            kubeconfig,
            &volume_pinned_set(ns, name, scheduler, VN_B, 0).to_string(),
        )
        .await;
        exclude_set(ns, name, VN_B, location).await;
    }
    // The records reach the schedulers' caches before the pods exist.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (name, scheduler, _) in &sets {
        apply(
            kubeconfig,
            &volume_pinned_set(ns, name, scheduler, VN_B, 1).to_string(),
        )
        .await;
    }
    let outcome = tensile_e2e::wait::until(
        "each pinned pod Running on its volume's node",
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            let pods = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items;
            let placed: Vec<String> = pods
                .iter()
                .filter(|p| node_of(p) == VN_B && running(p))
                .map(name_of)
                .collect();
            if placed.len() == sets.len() {
                Ok(placed)
            } else {
                let mut seen = Vec::new();
                for p in &pods {
                    let failed = failed_scheduling(ns, &name_of(p)).await;
                    seen.push(format!("{} on {:?}: {:?}", name_of(p), node_of(p), failed.last()));
                }
                Err(format!("{seen:?}"))
            }
        },
    )
    .await;
    kubectl(
        kubeconfig,
        &["-n", ns, "delete", "statefulset", "--all", "--wait=true"],
    )
    .await;
    let placed =
        outcome.unwrap_or_else(|e| panic!("{e}; standalone log:\n{}", standalone.service.log_tail(8_000)));
    println!("volume-pinned pods of excluded StatefulSets on {VN_B}: {placed:?}");
    clean_up(&api).await;
}

/// The conditions of pod `name` of `api`: PodScheduled's status, message and transition.
async fn pod_scheduled(api: &Api<Pod>, name: &str) -> Result<(String, String, String), String> {
    let p = api.get(name).await.map_err(|e| e.to_string())?;
    let c = p
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| c.type_ == "PodScheduled")
        .ok_or("no PodScheduled condition")?;
    Ok((
        c.status.clone(),
        c.message.clone().unwrap_or_default(),
        c.last_transition_time
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
    ))
}

/// kube-scheduler moves `PodScheduled.lastTransitionTime` only when the condition's status
/// changes, and the descheduler's release rule measures a pod's wait from it. A pod no node
/// takes, whose message changes as the lower clusters change, keeps the time it became
/// unschedulable.
#[tokio::test]
async fn a_waiting_pods_podscheduled_transition_time_stays_while_lower_churn_changes_its_message() {
    let _scene = scene().await;
    let bed = bed();
    let standalone = StandaloneProcess::start(
        &bed.upper,
        &bed.standalone,
        STANDALONE,
        &[STANDALONE_EXCLUSIONS.to_owned()],
        "standalone-transition",
    )
    .unwrap();
    standalone.wait_ready(Duration::from_secs(30)).await.unwrap();
    let api = namespace("transition").await;
    let twenty = pod(
        "twenty",
        Some(STANDALONE),
        json!({"cpu": "20"}),
        &Stash::default(),
    );
    api.create(&PostParams::default(), &twenty).await.unwrap();
    let (_, first, since) = within("PodScheduled=False", 30, || async {
        let c = pod_scheduled(&api, "twenty").await?;
        if c.0 == "False" {
            Ok(c)
        } else {
            Err(format!("{c:?}"))
        }
    })
    .await;
    // Whole seconds: a later write would show a later time.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Lower churn: pods created directly in lower-b leave one CPU free on each of its
    // nodes, so vn-b's next shape changes the reason the pod gets there.
    let lower = bed.lowers[1].client().await.unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), "default");
    let mut churn = Vec::new();
    for n in Api::<Node>::all(lower)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        let cpus = n
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("cpu"))
            .and_then(|q| q.0.parse::<u32>().ok())
            .unwrap_or(0);
        if cpus < 2 || !tensile_common::shape::usable(&n) {
            continue;
        }
        let node = n.metadata.name.clone().unwrap_or_default();
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("churn-{node}")},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "busybox",
                                     "resources": {"requests": {"cpu": (cpus - 1).to_string()}}}]},
        }))
        .unwrap();
        lower_pods.create(&PostParams::default(), &p).await.unwrap();
        churn.push(name_of(&p));
    }
    let outcome = tensile_e2e::wait::until(
        "a new message for the waiting pod",
        Duration::from_secs(45),
        Duration::from_millis(300),
        || async {
            let c = pod_scheduled(&api, "twenty").await?;
            if c.1 != first {
                Ok(c)
            } else {
                Err(format!("{c:?}"))
            }
        },
    )
    .await;
    for name in &churn {
        let _ = lower_pods.delete(name, &DeleteParams::default()).await;
    }
    let (status, message, transition) = outcome.unwrap();
    println!("PodScheduled {status}: {first:?} at {since}, then {message:?} at {transition}");
    assert_eq!(status, "False");
    assert_eq!(
        transition, since,
        "the status stayed False, so lastTransitionTime must stay ({first:?} -> {message:?})"
    );
    clean_up(&api).await;
}

/// vn-b's shape: when it was computed, and the cpu of each frontier vector, sorted.
async fn vn_b_shape(upper: &kube::Client) -> Result<(jiff::Timestamp, Vec<i128>), String> {
    let node = Api::<Node>::all(upper.clone())
        .get(VN_B)
        .await
        .map_err(|e| e.to_string())?;
    let text = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_CAPACITY_SHAPE))
        .ok_or("no shape")?;
    let shape = tensile_common::shape::Shape::decode(text).map_err(|e| e.to_string())?;
    let at = shape
        .at
        .as_deref()
        .ok_or("no at")?
        .parse::<jiff::Timestamp>()
        .map_err(|e| e.to_string())?;
    let mut cpus = Vec::new();
    for group in &shape.groups {
        cpus.extend(
            group
                .free_maps()
                .map_err(|e| e.to_string())?
                .iter()
                .map(|m| m.get("cpu")),
        );
    }
    cpus.sort_unstable();
    Ok((at, cpus))
}

/// A pod created directly in lower-b on `node`, requesting `cpu`.
fn lower_pod(name: &str, node: &str, cpu: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}]},
    }))
    .unwrap()
}

/// kube-scheduler keeps a bound pod in its cache (assumed) until it sees it; the standalone
/// scheduler keeps a placed pod's requests out of its node's shape until the shape can show
/// it. A newer shape is not enough: while the virtual node has not created the lower pod
/// (here a lower ResourceQuota refuses the create), every shape it computes shows the space
/// free, and giving it to the next pod sends two pods to one lower node's room.
#[tokio::test]
async fn a_placed_pods_space_is_not_given_again_while_its_lower_create_is_slow() {
    let _scene = scene().await;
    let bed = bed();
    let standalone = StandaloneProcess::start(
        &bed.upper,
        &bed.standalone,
        STANDALONE,
        &[STANDALONE_EXCLUSIONS.to_owned()],
        "standalone-slow-create",
    )
    .unwrap();
    standalone.wait_ready(Duration::from_secs(30)).await.unwrap();
    let ns = "slow-create";
    let api = namespace(ns).await;
    let upper = bed.upper.client().await.unwrap();
    let lower_b = &bed.lowers[1];
    // vn-b makes the lower namespace for its first pod there.
    let warm = pinned("warm", STANDALONE, "100m", VN_B, None);
    api.create(&PostParams::default(), &warm).await.unwrap();
    all_running(&api, "the first pod Running below").await;
    clean_up(&api).await;

    // Lower-b: one node with 8 CPUs and 4Gi free, every other one with 5 CPUs and all its
    // memory (an aggregate with room for two 6-CPU pods, a lower node for one; each node
    // on the frontier, so a change of the others changes the shape).
    let lower = lower_b.client().await.unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), "default");
    let mut usable: Vec<(String, u32, String)> = Api::<Node>::all(lower)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|n| tensile_common::shape::usable(n))
        .filter_map(|n| {
            let allocatable = n.status.as_ref()?.allocatable.as_ref()?;
            let cpus = allocatable.get("cpu")?.0.parse().ok()?;
            let memory = allocatable.get("memory").map(|q| q.0.clone()).unwrap_or_default();
            Some((n.metadata.name.clone()?, cpus, memory))
        })
        .collect();
    usable.sort();
    let free = usable
        .iter()
        .position(|(_, cpus, memory)| *cpus == 8 && memory == "16Gi")
        .expect("an 8-CPU, 16Gi lower node in lower-b");
    let (free, _, _) = usable.remove(free);
    let mut made = Vec::new();
    let mut fill = vec![(free.clone(), json!({"memory": "12Gi"}))];
    fill.extend(
        usable
            .iter()
            .filter(|(_, cpus, _)| *cpus > 5)
            .map(|(node, cpus, _)| (node.clone(), json!({"cpu": (cpus - 5).to_string()}))),
    );
    for (node, requests) in fill {
        let mut p = lower_pod(&format!("fill-{node}"), &node, "0");
        p.spec.as_mut().unwrap().containers[0].resources =
            Some(serde_json::from_value(json!({"requests": requests})).unwrap());
        lower_pods.create(&PostParams::default(), &p).await.unwrap();
        made.push(name_of(&p));
    }
    let outcome = async {
        let (eight, five) = (8_000, 5_000);
        tensile_e2e::wait::until(
            "vn-b's shape showing 8 CPUs free on one lower node, 5 on the others",
            Duration::from_secs(30),
            Duration::from_millis(250),
            || async {
                let (_, cpus) = vn_b_shape(&upper).await?;
                let top = cpus.iter().rev().take(2).copied().collect::<Vec<_>>();
                if top == [eight, five] { Ok(()) } else { Err(format!("{cpus:?}")) }
            },
        )
        .await?;
        // The lower namespace now refuses every pod: vn-b's create of the next one fails
        // and is retried, as under a slow or refusing lower apiserver.
        let quota = json!({"apiVersion": "v1", "kind": "ResourceQuota",
                           "metadata": {"name": "no-pods", "namespace": ns}, "spec": {"hard": {"pods": "0"}}});
        apply(lower_b.kubeconfig(), &quota.to_string()).await;
        let first = pod("first", Some(STANDALONE), json!({"cpu": "6"}), &Stash::default());
        api.create(&PostParams::default(), &first).await.unwrap();
        tensile_e2e::wait::until("the first 6-CPU pod bound to vn-b", Duration::from_secs(20), Duration::from_millis(200), || async {
            let p = api.get("first").await.map_err(|e| e.to_string())?;
            if node_of(&p) == VN_B { Ok(()) } else { Err(format!("on {:?}", node_of(&p))) }
        })
        .await?;
        let bound = jiff::Timestamp::now();
        // Lower churn elsewhere: a small pod on each node but the free one changes the
        // frontier, so vn-b writes a shape computed after the bind, without the first pod.
        for (node, _, _) in &usable {
            let p = lower_pod(&format!("churn-{node}"), node, "100m");
            lower_pods.create(&PostParams::default(), &p).await.unwrap();
            made.push(name_of(&p));
        }
        let newer = tensile_e2e::wait::until(
            "a shape computed after the bind, still showing 8 CPUs free",
            Duration::from_secs(20),
            Duration::from_millis(250),
            || async {
                let (at, cpus) = vn_b_shape(&upper).await?;
                let fresh = at > bound + jiff::SignedDuration::from_secs(1) && cpus.last() == Some(&eight);
                if fresh && !cpus.contains(&five) { Ok((at, cpus)) } else { Err(format!("{at}: {cpus:?}")) }
            },
        )
        .await?;
        let second = pod("second", Some(STANDALONE), json!({"cpu": "6"}), &Stash::default());
        api.create(&PostParams::default(), &second).await.unwrap();
        tokio::time::sleep(Duration::from_secs(8)).await;
        let first = api.get("first").await.unwrap();
        let second = api.get("second").await.unwrap();
        let failed = failed_scheduling(ns, "second").await;
        Ok::<_, tensile_e2e::Error>((newer, first, second, failed))
    }
    .await;
    for name in &made {
        let _ = lower_pods.delete(name, &DeleteParams::default()).await;
    }
    kubectl(
        lower_b.kubeconfig(),
        &[
            "-n",
            ns,
            "delete",
            "resourcequota",
            "no-pods",
            "--ignore-not-found",
        ],
    )
    .await;
    let ((at, cpus), first, second, failed) =
        outcome.unwrap_or_else(|e| panic!("{e}; standalone log:\n{}", standalone.service.log_tail(8_000)));
    println!("shape at {at}: {cpus:?}; the second pod: {failed:?}");
    assert!(
        !first
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .any(|c| c.type_ == names::CONDITION_LOWER_SCHEDULED && c.status == "True"),
        "the first pod is still not placed below"
    );
    assert_eq!(
        node_of(&second),
        "",
        "the lower node's room went to the first pod; {failed:?}; log:\n{}",
        standalone.service.log_tail(8_000)
    );
    assert!(
        failed.iter().any(|m| m.contains("no lower node fits cpu=6")),
        "{failed:?}"
    );
    clean_up(&api).await;
}
