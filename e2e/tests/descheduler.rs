//! The descheduler end to end: an upper cluster, lower-a (many 2-CPU nodes: a large
//! aggregate, no big node) and lower-b (8-CPU nodes), one virtual node over each, the
//! webhook, and the `descheduler` binary. Every assertion is what kubectl (or the
//! descheduler's admin endpoint) shows.
//!
//! Each test plays in its own scene: its namespace, its own lower nodes (labelled with the
//! test's name, which the pods' stashed nodeSelector requires below), its own two virtual
//! nodes (labelled likewise, which the pods require upstream through an ignored selector
//! key), its own webhook registration and exclusion records. Tests can then run side by
//! side on the shared clusters.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tensile_common::exclusion::Location;
use tensile_common::stash::Stash;
use tensile_e2e::check::{Namespaces, apply, kubectl, webhook_registration};
use tensile_e2e::descheduler::{DeschedulerProcess, metric_sum};
use tensile_e2e::in_process;
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::wait::within;
use tensile_e2e::{NodeConfig, NodeSimulator, TestCluster, free_port};
use tensile_webhook::Policy;

struct Bed {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    sim_a: NodeSimulator,
    sim_b: NodeSimulator,
}

static BED: Shared<Bed> = Shared::new();

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] =
            scene::clusters("descheduler", ["upper", "lower-a", "lower-b"]).await?;
        tensile_e2e::chart::install_exclusion_records(upper.kubeconfig()).await?;
        let sim_a = scene::simulate(&lower_a, Vec::new()).await?;
        let sim_b = scene::simulate(&lower_b, Vec::new()).await?;
        Ok(Bed {
            upper,
            lower_a,
            lower_b,
            sim_a,
            sim_b,
        })
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

/// Label key of this scene's virtual nodes, kept upstream by the webhook.
const VN_KEY: &str = "tensile-e2e-vn";
/// Label key of this scene's lower nodes, which the stash carries down.
const LOWER_KEY: &str = "tensile-e2e";

/// One test's namespace, lower nodes, virtual nodes and webhook.
struct Scene {
    ns: String,
    /// The descheduler's account as the chart renders it for release `ns` in namespace `ns`
    /// (bare pods moved when annotated): every descheduler of the scene runs under it.
    identity: std::path::PathBuf,
    /// The logs of the scene's deschedulers: none may show a call the chart's account was
    /// refused (checked when the scene ends).
    logs: std::sync::Mutex<Vec<std::path::PathBuf>>,
    vn_a: String,
    vn_b: String,
    _nodes: Vec<in_process::VirtualNode>,
    _webhook: tensile_webhook::Running,
}

impl Drop for Scene {
    /// Every descheduler of the scene ran under the chart's account without a refused call.
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let logs = self.logs.lock().map(|l| l.clone()).unwrap_or_default();
        for log in logs {
            let denied = tensile_e2e::chart::denied_calls(&tensile_e2e::process::log_tail(&log, 4_000_000));
            assert!(
                denied.is_empty(),
                "{} under the chart's account was refused: {denied:?}",
                log.display()
            );
        }
    }
}

impl Scene {
    /// `lower_b_nodes` nodes of 8 CPUs in lower-b; always 12 nodes of 2 CPUs in lower-a (so
    /// that vn-a's preferred affinity outweighs its utilisation in the upper scheduler).
    async fn start(ns: &str, lower_b_nodes: u32) -> Scene {
        Self::start_with(ns, lower_b_nodes, false).await
    }

    /// As [`Scene::start`]; with `shaped`, the virtual nodes' capacity shapes also group the
    /// lower nodes by the scene's label, so they can say where the scene's pods fit.
    async fn start_with(ns: &str, lower_b_nodes: u32, shaped: bool) -> Scene {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bed = bed();
        let name = ns.to_owned();
        BED.handle()
            .unwrap()
            .spawn(async move {
                for i in 0..12 {
                    let node = NodeConfig::new(&format!("{name}-a{i}"))
                        .resource("cpu", "2")
                        .label(LOWER_KEY, &name);
                    bed.sim_a.add_node(node).await.unwrap();
                }
                for i in 0..lower_b_nodes {
                    let node = NodeConfig::new(&format!("{name}-b{i}"))
                        .resource("cpu", "8")
                        .resource("memory", "16Gi")
                        .label(LOWER_KEY, &name);
                    bed.sim_b.add_node(node).await.unwrap();
                }
            })
            .await
            .unwrap();
        bed.upper.create_namespace(ns).await.unwrap();
        scene::opt_in_namespace(up(), ns).await;
        let identity = tensile_e2e::descheduler::chart_identity(&bed.upper, ns, "annotated")
            .await
            .unwrap();

        let port = free_port().unwrap();
        let config = format!("tensile-webhook-{ns}");
        apply(
            up(),
            &webhook_registration(&config, port, Namespaces::Labelled(ns), None),
        )
        .await;
        let mut options = scene::webhook_options(port);
        options.client = Some(bed.upper.client().await.unwrap());
        options.webhook_config_name = Some(config);
        options.policy = Policy {
            ignore_selector_keys: [VN_KEY.to_owned()].into(),
            ..Policy::default()
        };
        options.exclusions = Some(exclusions(ns));
        // On the bed's multi-threaded runtime: the in-process virtual nodes keep this test's
        // thread busy, and the webhook's watch of the exclusions must keep up.
        let webhook = BED
            .handle()
            .unwrap()
            .spawn(tensile_webhook::start(options))
            .await
            .unwrap()
            .unwrap();
        scene::webhook_ready(&webhook).await;

        let (vn_a, vn_b) = (format!("{ns}-a"), format!("{ns}-b"));
        let node = |name: &str, lower: &TestCluster| {
            scene::virtual_node(&bed.upper, name, lower, |args| {
                args.node_labels = vec![(VN_KEY.to_owned(), ns.to_owned())];
                if shaped {
                    args.shape.label_keys.push(LOWER_KEY.to_owned());
                }
            })
            .unwrap()
        };
        let nodes = vec![node(&vn_a, &bed.lower_a), node(&vn_b, &bed.lower_b)];
        for vn in [&vn_a, &vn_b] {
            scene::node_ready(up(), vn, 60).await;
        }
        Scene {
            ns: ns.to_owned(),
            identity,
            logs: Default::default(),
            vn_a,
            vn_b,
            _nodes: nodes,
            _webhook: webhook,
        }
    }

    /// The descheduler flags that confine it to this scene, plus `extra`.
    fn flags(&self, extra: &[&str]) -> Vec<String> {
        let mut flags = vec![
            format!("--node-selector=type=virtual-kubelet,{VN_KEY}={}", self.ns),
            format!("--exclusions-configmap={}", exclusions(&self.ns)),
            "--unschedulable-threshold=3".to_owned(),
        ];
        if !extra.iter().any(|f| f.starts_with("--descheduling-interval")) {
            flags.push("--descheduling-interval=5s".to_owned());
        }
        flags.extend(extra.iter().map(|s| s.to_string()));
        flags
    }

    async fn descheduler(&self, extra: &[&str], log: &str) -> DeschedulerProcess {
        let d = self.process(extra, log);
        d.wait_ready(Duration::from_secs(30)).await.unwrap();
        d
    }

    /// A descheduler of the scene under the chart's account, not waited for.
    fn process(&self, extra: &[&str], log: &str) -> DeschedulerProcess {
        let d = DeschedulerProcess::start_as(&bed().upper, &self.identity, &self.flags(extra), log).unwrap();
        if let Ok(mut logs) = self.logs.lock() {
            logs.push(d.log_path().to_owned());
        }
        d
    }

    /// A pod template of `cpu` CPUs that prefers vn-a, with `lower` added to the nodeSelector
    /// the stash carries down, and `annotations`.
    fn template(&self, app: &str, cpu: &str, lower: Value, annotations: Value) -> Value {
        let mut selector = json!({VN_KEY: self.ns, LOWER_KEY: self.ns});
        if let (Some(s), Some(extra)) = (selector.as_object_mut(), lower.as_object()) {
            s.extend(extra.clone());
        }
        json!({
            "metadata": {"labels": {"app": app, "virtual-pod": "true"}, "annotations": annotations},
            "spec": {
                "terminationGracePeriodSeconds": 5,
                "nodeSelector": selector,
                "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100, "preference": {"matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": [self.vn_a]}]}}]}},
                "containers": [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": cpu}}}],
            },
        })
    }

    fn deployment(&self, name: &str, replicas: u32, cpu: &str, lower: Value) -> String {
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": self.template(name, cpu, lower, json!({})),
            },
        })
        .to_string()
    }

    /// A bare pod `name` (label `app=<name>`) of 3 CPUs that opted in to being moved.
    fn bare_pod(&self, name: &str) -> String {
        let mut pod = self.template(
            name,
            "3",
            json!({}),
            json!({"descheduler.alpha.kubernetes.io/evict": "true"}),
        );
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["name"] = json!(name);
        pod["metadata"]["namespace"] = json!(self.ns);
        pod.to_string()
    }

    async fn pods(&self, selector: &str) -> Vec<Value> {
        pods_of(up(), &self.ns, selector).await
    }
}

/// Where the chart's descheduler of release `ns` keeps its records (see [`Scene::identity`]).
fn exclusions(ns: &str) -> Location {
    Location {
        namespace: ns.to_owned(),
        name: format!("{ns}-tensile-exclusions"),
    }
}

async fn pods_of(kubeconfig: &Path, ns: &str, selector: &str) -> Vec<Value> {
    let mut args = vec!["-n", ns, "get", "pods", "-o", "json"];
    if !selector.is_empty() {
        args.extend(["-l", selector]);
    }
    let out: Value = serde_json::from_str(&kubectl(kubeconfig, &args).await).unwrap();
    out["items"].as_array().cloned().unwrap_or_default()
}

fn node_of(p: &Value) -> &str {
    p["spec"]["nodeName"].as_str().unwrap_or_default()
}

fn phase(p: &Value) -> &str {
    p["status"]["phase"].as_str().unwrap_or_default()
}

fn uid(p: &Value) -> String {
    p["metadata"]["uid"].as_str().unwrap_or_default().to_owned()
}

fn name(p: &Value) -> String {
    p["metadata"]["name"].as_str().unwrap_or_default().to_owned()
}

fn terminating(p: &Value) -> bool {
    p["metadata"]["deletionTimestamp"].is_string()
}

/// When the lower refusal began, as the upper pod's condition says.
fn refused_since(p: &Value) -> Option<jiff::Timestamp> {
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "tensile.io/LowerPodScheduled" && c["status"] == "False")?["lastTransitionTime"]
        .as_str()?
        .parse()
        .ok()
}

/// Events of `reason` in `ns`.
async fn events(ns: &str, reason: &str) -> Vec<Value> {
    let out = kubectl(
        up(),
        &[
            "-n",
            ns,
            "get",
            "events",
            "--field-selector",
            &format!("reason={reason}"),
            "-o",
            "json",
        ],
    )
    .await;
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// What a test sees of its workload's pods while they move.
#[derive(Default)]
struct Watch {
    /// First refusal of each pod seen on vn-a, by UID.
    refused: BTreeMap<String, jiff::Timestamp>,
    /// When each pod was first seen Running on vn-b, by UID.
    running: BTreeMap<String, jiff::Timestamp>,
    /// Pods seen bound to vn-a: UID → name.
    on_a: BTreeMap<String, String>,
}

impl Watch {
    fn see(&mut self, pods: &[Value], vn_a: &str, vn_b: &str) {
        let now = jiff::Timestamp::now();
        for p in pods {
            if node_of(p) == vn_a {
                self.on_a.insert(uid(p), name(p));
                if let Some(t) = refused_since(p) {
                    self.refused.entry(uid(p)).or_insert(t);
                }
            }
            if node_of(p) == vn_b && phase(p) == "Running" {
                self.running.entry(uid(p)).or_insert(now);
            }
        }
    }

    /// Refusal → Running elsewhere, pairing the i-th refusal with the i-th start.
    fn moves(&self) -> Vec<Duration> {
        let mut refused: Vec<_> = self.refused.values().copied().collect();
        let mut running: Vec<_> = self.running.values().copied().collect();
        refused.sort();
        running.sort();
        refused
            .iter()
            .zip(&running)
            .map(|(r, s)| Duration::try_from(r.duration_until(*s)).unwrap_or_default())
            .collect()
    }
}

fn p50_max(mut d: Vec<Duration>) -> (Duration, Duration) {
    d.sort();
    (d[(d.len() - 1) / 2], d[d.len() - 1])
}

/// Waits until `want` pods of `selector` run on vn-b and none is left on vn-a, watching
/// them meanwhile.
async fn until_moved(scene: &Scene, selector: &str, want: usize, secs: u64) -> Watch {
    let mut watch = Watch::default();
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let pods = scene.pods(selector).await;
        watch.see(&pods, &scene.vn_a, &scene.vn_b);
        let on_b = pods
            .iter()
            .filter(|p| node_of(p) == scene.vn_b && phase(p) == "Running" && !terminating(p))
            .count();
        let left_on_a = pods.iter().filter(|p| node_of(p) == scene.vn_a).count();
        if on_b == want && left_on_a == 0 && pods.len() == want {
            return watch;
        }
        if Instant::now() > deadline {
            let seen: Vec<String> = pods
                .iter()
                .map(|p| {
                    format!(
                        "{} on {} {} {}",
                        name(p),
                        node_of(p),
                        phase(p),
                        if terminating(p) { "(terminating)" } else { "" }
                    )
                })
                .collect();
            panic!(
                "pods {selector} not all moved to {} within {secs} s: {seen:?}",
                scene.vn_b
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The checks every move shares: the stash is intact upstream, the lower pods carry it, and
/// nothing of the workload is left in lower-a.
async fn assert_stash_intact_and_lower_a_empty(scene: &Scene, selector: &str) {
    for p in scene.pods(selector).await {
        let text = p["metadata"]["annotations"]["clusterSelector"].as_str().unwrap();
        let stash = Stash::decode(text).unwrap();
        let lower_selector = serde_json::to_value(&stash).unwrap()["nodeSelector"].clone();
        assert_eq!(
            lower_selector[LOWER_KEY],
            scene.ns.as_str(),
            "stash of {}: {text}",
            name(&p)
        );
        assert!(
            !text.contains("kubernetes.io/hostname"),
            "the exclusion stays out of the stash: {text}"
        );
    }
    for p in pods_of(bed().lower_b.kubeconfig(), &scene.ns, selector).await {
        assert_eq!(
            p["spec"]["nodeSelector"][LOWER_KEY],
            scene.ns.as_str(),
            "lower pod {}",
            name(&p)
        );
        assert!(
            !p["spec"].to_string().contains("NotIn"),
            "no exclusion below: {}",
            p["spec"]
        );
    }
    let lower_a = bed().lower_a.kubeconfig();
    within("nothing of the workload left in lower-a", 60, || async {
        let left = pods_of(lower_a, &scene.ns, selector).await;
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", left.iter().map(name).collect::<Vec<_>>()))
        }
    })
    .await;
}

/// Each pod seen on vn-a has a `Descheduled` event naming vn-a and the lower message.
async fn assert_descheduled_events(scene: &Scene, moved: &BTreeMap<String, String>) {
    let names: BTreeSet<String> = moved.values().cloned().collect();
    assert!(!names.is_empty());
    within("a Descheduled event on every moved pod", 20, || {
        let names = names.clone();
        async move {
            let evs = events(&scene.ns, "Descheduled").await;
            let got: BTreeSet<String> = evs
                .iter()
                .filter(|e| {
                    let note = e["message"].as_str().or(e["note"].as_str()).unwrap_or_default();
                    note.contains(&scene.vn_a) && note.contains("nodes are available")
                })
                .filter_map(|e| e["involvedObject"]["name"].as_str().map(str::to_owned))
                .collect();
            if names.is_subset(&got) {
                Ok(())
            } else {
                Err(format!("want {names:?}, got {got:?}"))
            }
        }
    })
    .await;
}

#[tokio::test]
async fn a_deployment_refused_by_lower_a_ends_running_in_lower_b_with_its_stash_intact() {
    let scene = Scene::start("ds-deploy", 2).await;
    let d = scene.descheduler(&[], "deploy").await;
    apply(up(), &scene.deployment("web", 4, "3", json!({}))).await;
    let watch = until_moved(&scene, "app=web", 4, 180).await;
    // A replacement created before the webhook's watch delivered the record lands on vn-a
    // once more and is moved again (without counting a move).
    assert!(
        watch.on_a.len() >= 4,
        "every replica was first placed on {}: {:?}",
        scene.vn_a,
        watch.on_a
    );
    let escaped = watch.on_a.len() - 4;

    for p in scene.pods("app=web").await {
        assert_eq!(
            p["metadata"]["annotations"]["tensile.io/excluded-nodes"],
            scene.vn_a.as_str(),
            "the replacement avoids vn-a"
        );
    }
    assert_stash_intact_and_lower_a_empty(&scene, "app=web").await;
    assert_descheduled_events(&scene, &watch.on_a).await;
    let metrics = d.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "tensile_descheduler_pods_moved_total",
            &[("result", "success")]
        ),
        watch.on_a.len() as f64,
        "{metrics}"
    );
    let (p50, max) = p50_max(watch.moves());
    println!(
        "figure: descheduler, Deployment of 4 x 3 CPU refused by lower-a: refusal -> Running in lower-b p50 {:.1} s, max {:.1} s (threshold 3 s; {escaped} replacement(s) escaped the exclusion and moved twice)",
        p50.as_secs_f64(),
        max.as_secs_f64()
    );
}

/// Every eviction makes watch events, and every event starts a round 300 ms later: caps per
/// round would let four refused pods go within seconds. The caps hold per
/// `--descheduling-interval`, as kubernetes-sigs/descheduler's hold per cycle.
#[tokio::test]
async fn the_eviction_cap_holds_per_descheduling_interval_whatever_the_rounds() {
    let scene = Scene::start("ds-caps", 2).await;
    let d = scene
        .descheduler(
            &["--max-pods-to-evict-total=1", "--descheduling-interval=20s"],
            "caps",
        )
        .await;
    apply(up(), &scene.deployment("web", 4, "3", json!({}))).await;
    let moved = || async {
        metric_sum(
            &d.metrics().await,
            "tensile_descheduler_pods_moved_total",
            &[("result", "success")],
        )
    };
    within("the first pod moved", 120, || async {
        if moved().await >= 1.0 {
            Ok(())
        } else {
            Err("none yet".into())
        }
    })
    .await;
    let first = Instant::now();
    // The other three stay refused on vn-a, and rounds keep running on their events, but
    // the interval's one eviction is spent.
    let mut rounds_at_first = None;
    while first.elapsed() < Duration::from_secs(10) {
        let metrics = d.metrics().await;
        let rounds = metric_sum(&metrics, "tensile_descheduler_cycles_total", &[]);
        rounds_at_first.get_or_insert(rounds);
        let n = metric_sum(
            &metrics,
            "tensile_descheduler_pods_moved_total",
            &[("result", "success")],
        );
        assert_eq!(
            n,
            1.0,
            "one eviction per interval; {n} after {:?}",
            first.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let metrics = d.metrics().await;
    let limited = metric_sum(
        &metrics,
        "tensile_descheduler_pods_moved_total",
        &[("result", "limited")],
    );
    assert!(
        limited >= 1.0,
        "the waiting pods are counted as limited: {metrics}"
    );
    // The next window lets the next one go, and so on, until all four run in lower-b.
    let watch = until_moved(&scene, "app=web", 4, 180).await;
    let total = moved().await;
    assert!(total >= 4.0, "every replica moved: {total} ({:?})", watch.on_a);
    let spent = first.elapsed();
    assert!(
        spent >= Duration::from_secs(40),
        "three more evictions need three more intervals of 20 s: {spent:?}"
    );
    println!(
        "figure: descheduler, 4 refused pods under --max-pods-to-evict-total=1 per 20 s interval: last moved {:.0} s after the first, {} rounds meanwhile",
        spent.as_secs_f64(),
        metric_sum(&d.metrics().await, "tensile_descheduler_cycles_total", &[])
            - rounds_at_first.unwrap_or(0.0)
    );
}

#[tokio::test]
async fn in_dry_run_nothing_moves_and_nothing_is_written_but_the_log_and_metrics_say_what_would() {
    let scene = Scene::start("ds-dry", 1).await;
    let d = scene.descheduler(&["--dry-run"], "dry-run").await;
    apply(up(), &scene.deployment("web", 2, "3", json!({}))).await;
    let name = "tensile_descheduler_pods_moved_total";
    within("dry-run moves counted for both pods", 90, || async {
        let m = d.metrics().await;
        let n = metric_sum(
            &m,
            name,
            &[("result", "dry_run"), ("virtual_node", scene.vn_a.as_str())],
        );
        if n >= 2.0 { Ok(()) } else { Err(format!("{n}")) }
    })
    .await;
    let before: BTreeSet<String> = scene.pods("app=web").await.iter().map(uid).collect();
    // A few more rounds: still nothing happens.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let pods = scene.pods("app=web").await;
    let after: BTreeSet<String> = pods.iter().map(uid).collect();
    assert_eq!(before, after, "the same pods");
    assert!(pods.iter().all(|p| node_of(p) == scene.vn_a && !terminating(p)));
    assert!(events(&scene.ns, "Descheduled").await.is_empty());
    let cm = bed()
        .upper
        .kubectl(&["-n", &scene.ns, "get", "configmap", &exclusions(&scene.ns).name])
        .await;
    assert!(!cm.ok, "no exclusion record written: {}", cm.stdout);
    let records = kubectl(
        up(),
        &[
            "-n",
            &scene.ns,
            "get",
            "exclusionrecords.tensile.io",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(
        records.trim().is_empty(),
        "no exclusion record written: {records}"
    );
    let m = d.metrics().await;
    assert_eq!(metric_sum(&m, name, &[("result", "success")]), 0.0);
    let log = d.log();
    assert!(log.contains("dry run: would move the pod"), "{log}");
    assert!(log.contains(&scene.vn_a), "{log}");
}

#[tokio::test]
async fn the_exclusion_expires_after_its_ttl_and_a_later_pod_may_use_vn_a_again() {
    let scene = Scene::start("ds-ttl", 1).await;
    let _d = scene.descheduler(&["--exclusion-ttl=25"], "ttl").await;
    apply(up(), &scene.deployment("web", 1, "3", json!({}))).await;
    until_moved(&scene, "app=web", 1, 120).await;
    let moved_at = Instant::now();

    // While the exclusion holds, a new replica avoids vn-a.
    kubectl(
        up(),
        &["-n", &scene.ns, "scale", "deployment", "web", "--replicas=2"],
    )
    .await;
    let fresh = newest_pod(&scene, 1).await;
    assert_eq!(node_of(&fresh), scene.vn_b, "within the TTL: {}", fresh["spec"]);
    assert_eq!(
        fresh["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        scene.vn_a.as_str()
    );

    // After it, a new replica may land on vn-a again.
    let ttl = Duration::from_secs(27);
    if let Some(left) = ttl.checked_sub(moved_at.elapsed()) {
        tokio::time::sleep(left).await;
    }
    kubectl(
        up(),
        &["-n", &scene.ns, "scale", "deployment", "web", "--replicas=3"],
    )
    .await;
    let later = newest_pod(&scene, 2).await;
    assert_eq!(node_of(&later), scene.vn_a, "after the TTL: {}", later["spec"]);
    assert!(later["metadata"]["annotations"]["tensile.io/excluded-nodes"].is_null());
    assert!(!later["spec"].to_string().contains("NotIn"), "{}", later["spec"]);
}

/// Waits until a bound pod of app=web exists besides the `older` ones; returns the newest.
async fn newest_pod(scene: &Scene, older: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut pods: Vec<Value> = scene
            .pods("app=web")
            .await
            .into_iter()
            .filter(|p| !terminating(p))
            .collect();
        pods.sort_by_key(|p| {
            p["metadata"]["creationTimestamp"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        });
        if let Some(p) = pods.last()
            && pods.len() > older
            && !node_of(p).is_empty()
        {
            return p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no new bound replica: {} pods",
            pods.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_pod_that_fits_nowhere_moves_at_most_the_configured_times_warns_once_and_then_stays() {
    let scene = Scene::start("ds-nowhere", 1).await;
    let d = scene.descheduler(&["--max-moves-per-owner=2"], "nowhere").await;
    // No lower node of either cluster has disk=nvme: both lower schedulers refuse it.
    apply(up(), &scene.deployment("web", 1, "100m", json!({"disk": "nvme"}))).await;
    within("the DeschedulingExhausted warning", 180, || async {
        let n = events(&scene.ns, "DeschedulingExhausted").await.len();
        if n >= 1 {
            Ok(())
        } else {
            Err(format!("{n} warnings"))
        }
    })
    .await;
    let moved = "tensile_descheduler_pods_moved_total";
    let m = d.metrics().await;
    let moves = metric_sum(&m, moved, &[("result", "success")]);
    assert_eq!(moves, 2.0, "{m}");
    let pod = scene
        .pods("app=web")
        .await
        .into_iter()
        .find(|p| !terminating(p))
        .unwrap();
    let cycles = metric_sum(&m, "tensile_descheduler_cycles_total", &[]);

    // No churn afterwards.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let m = d.metrics().await;
    assert_eq!(metric_sum(&m, moved, &[("result", "success")]), moves, "{m}");
    assert!(
        metric_sum(&m, "tensile_descheduler_cycles_total", &[]) > cycles,
        "rounds kept running"
    );
    assert_eq!(
        metric_sum(&m, "tensile_descheduler_skipped", &[("reason", "exhausted")]),
        1.0,
        "{m}"
    );
    let warnings = events(&scene.ns, "DeschedulingExhausted").await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0]["count"].as_i64().unwrap_or(1), 1, "warned once");
    assert_eq!(warnings[0]["type"], "Warning");
    let now: Vec<String> = scene.pods("app=web").await.iter().map(uid).collect();
    assert_eq!(now, vec![uid(&pod)], "the same pod stays");
    println!(
        "figure: descheduler, a pod no lower cluster can place: {moves} moves, 1 warning, 0 moves in the next 60 s"
    );
}

#[tokio::test]
async fn an_opted_in_bare_pod_is_replaced_in_lower_b_and_never_lost() {
    let scene = Scene::start("ds-bare", 1).await;
    let _d = scene.descheduler(&[], "bare").await;
    apply(up(), &scene.bare_pod("solo")).await;
    let mut original = None;
    let mut counts = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pods = scene.pods("app=solo").await;
        counts.insert(pods.len());
        if original.is_none() {
            original = pods.iter().find(|p| name(p) == "solo").map(uid);
        }
        let running: Vec<&Value> = pods
            .iter()
            .filter(|p| node_of(p) == scene.vn_b && phase(p) == "Running")
            .collect();
        if pods.len() == 1 && running.len() == 1 {
            let p = running[0];
            assert!(name(p).starts_with("solo-"), "{}", name(p));
            assert_eq!(
                p["metadata"]["labels"]["tensile.io/replaces"].as_str(),
                original.as_deref()
            );
            assert_eq!(p["metadata"]["annotations"]["tensile.io/deschedule-count"], "1");
            break;
        }
        assert!(Instant::now() < deadline, "not replaced: {pods:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!counts.contains(&0), "there was always a pod: {counts:?}");
    assert_stash_intact_and_lower_a_empty(&scene, "app=solo").await;
}

/// Jobs are tracked by finalizers on every supported version, so an evicted pod counts as a
/// failure unless the Job's `podFailurePolicy` ignores `DisruptionTarget`: the Job with that
/// rule moves and keeps its `backoffLimit: 0`; the Job without it is left in place, with a
/// `JobPodNotMoved` warning saying what to add, and does not fail either.
#[tokio::test]
async fn a_statefulset_and_a_job_move_and_the_job_keeps_its_backoff_limit() {
    let scene = Scene::start("ds-owners", 2).await;
    let _d = scene.descheduler(&[], "owners").await;
    let ns = &scene.ns;
    let sts = json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "db", "namespace": ns},
        "spec": {"serviceName": "db", "replicas": 1, "selector": {"matchLabels": {"app": "db"}},
                 "template": scene.template("db", "3", json!({}), json!({}))},
    })
    .to_string();
    let job = |name: &str, policy: Value| {
        let mut template = scene.template(name, "3", json!({}), json!({}));
        template["spec"]["restartPolicy"] = json!("Never");
        let mut spec = json!({"backoffLimit": 0, "template": template});
        if !policy.is_null() {
            spec["podFailurePolicy"] = policy;
        }
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        })
        .to_string()
    };
    let ignore_disruption = json!({"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    ]});
    apply(up(), &sts).await;
    apply(up(), &job("batch", ignore_disruption)).await;
    apply(up(), &job("strict", Value::Null)).await;
    let (db, batch) = tokio::join!(
        until_moved(&scene, "app=db", 1, 180),
        until_moved(&scene, "app=batch", 1, 180)
    );
    assert_eq!(db.on_a.values().collect::<Vec<_>>(), ["db-0"]);
    assert_eq!(
        scene.pods("app=db").await.iter().map(name).collect::<Vec<_>>(),
        ["db-0"],
        "the same name, a new pod"
    );
    assert_eq!(batch.on_a.len(), 1);
    let status = |job: &'static str| async move {
        kubectl(
            up(),
            &[
                "-n",
                ns,
                "get",
                "job",
                job,
                "-o",
                "jsonpath={.status.failed}|{.status.active}|{.status.conditions[*].type}",
            ],
        )
        .await
    };
    assert_eq!(
        status("batch").await,
        "|1|",
        "the eviction did not count as a failure (failed|active|conditions)"
    );
    // The Job without the rule: its pod stays where it was placed, said once, and the Job
    // neither fails nor loses its pod.
    let strict_pods = scene.pods("app=strict").await;
    assert_eq!(strict_pods.len(), 1, "{strict_pods:?}");
    assert_eq!(node_of(&strict_pods[0]), scene.vn_a, "left in place");
    let warned = events(ns, "JobPodNotMoved").await;
    assert!(
        warned.iter().any(|e| {
            e["involvedObject"]["name"] == strict_pods[0]["metadata"]["name"]
                && e["type"] == "Warning"
                && e["message"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("DisruptionTarget")
        }),
        "{warned:?}"
    );
    assert_eq!(
        status("strict").await,
        "|1|",
        "the Job is neither failed nor short of its pod"
    );
    assert_stash_intact_and_lower_a_empty(&scene, "app=db").await;
    assert_stash_intact_and_lower_a_empty(&scene, "app=batch").await;
}

#[tokio::test]
async fn with_two_replicas_only_the_leader_moves_pods_and_the_standby_takes_over() {
    let scene = Scene::start("ds-leader", 1).await;
    let elect = [
        "--leader-elect",
        "--leader-elect-resource-namespace=ds-leader",
        "--leader-elect-resource-name=tensile-descheduler",
        "--leader-elect-lease-duration=6s",
        "--leader-elect-renew-deadline=4s",
        "--leader-elect-retry-period=1s",
    ];
    let first = scene.descheduler(&elect, "leader-1").await;
    first
        .wait_ready_saying("leading", Duration::from_secs(30))
        .await
        .unwrap();
    let second = scene.process(&elect, "leader-2");
    // Ready once its caches synced, so that a Deployment of both is Available, and saying
    // it stands by.
    second
        .wait_ready_saying("standby: the leader Lease is held by", Duration::from_secs(20))
        .await
        .unwrap();
    apply(up(), &scene.deployment("web", 2, "3", json!({}))).await;
    until_moved(&scene, "app=web", 2, 120).await;
    let moved = |m: &str| {
        metric_sum(
            m,
            "tensile_descheduler_pods_moved_total",
            &[("result", "success")],
        )
    };
    assert_eq!(moved(&first.metrics().await), 2.0);
    let standby = second.metrics().await;
    assert_eq!(moved(&standby), 0.0, "{standby}");
    assert_eq!(metric_sum(&standby, "tensile_leader", &[]), 0.0);
    assert_eq!(metric_sum(&first.metrics().await, "tensile_leader", &[]), 1.0);
    assert_eq!(
        metric_sum(&standby, "tensile_leader_refused_writes_total", &[]),
        0.0,
        "the standby did not even try to write: {standby}"
    );
    match second.readyz().await {
        Some((200, body)) if body.contains("standby") => {}
        other => panic!("the standby stays ready while the leader works: {other:?}"),
    }

    first.signal("KILL").unwrap();
    let started = Instant::now();
    second
        .wait_ready_saying("leading", Duration::from_secs(30))
        .await
        .unwrap();
    println!(
        "figure: descheduler, standby leading {:.1} s after the leader was killed (lease 6 s)",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test]
async fn a_bare_pod_move_killed_at_each_step_ends_with_exactly_one_pod_running_in_lower_b() {
    let scene = Scene::start("ds-crash", 2).await;
    for step in ["recorded", "created", "evicted"] {
        let app = format!("solo-{step}");
        apply(up(), &scene.bare_pod(&app)).await;
        let selector = format!("app={app}");
        let original = {
            let mut found = None;
            while found.is_none() {
                found = scene.pods(&selector).await.first().map(uid);
            }
            found.unwrap()
        };
        let mut crashing = scene.process(&[&format!("--crash-at={step}")], &format!("crash-{step}"));
        let deadline = Instant::now() + Duration::from_secs(90);
        let status = loop {
            if let Some(status) = crashing.service.exited() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "no crash after {step}: {}",
                crashing.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(!status.success(), "killed at {step}: {status}");
        let log = crashing.log();
        assert!(log.contains("aborting"), "{log}");

        // A fresh process finishes the move.
        let restarted = scene.descheduler(&[], &format!("after-{step}")).await;
        let mut counts = BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let pods = scene.pods(&selector).await;
            counts.insert(pods.iter().filter(|p| !terminating(p)).count());
            let running: Vec<&Value> = pods
                .iter()
                .filter(|p| node_of(p) == scene.vn_b && phase(p) == "Running" && !terminating(p))
                .collect();
            if pods.len() == 1 && running.len() == 1 {
                assert_eq!(
                    running[0]["metadata"]["labels"]["tensile.io/replaces"].as_str(),
                    Some(original.as_str()),
                    "after a kill at {step}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "after a kill at {step}: {pods:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            !counts.contains(&0),
            "after a kill at {step} there was always a pod: {counts:?}"
        );
        let replacements = kubectl(
            up(),
            &[
                "-n",
                &scene.ns,
                "get",
                "pods",
                "-l",
                &format!("tensile.io/replaces={original}"),
                "-o",
                "name",
            ],
        )
        .await;
        assert_eq!(
            replacements.lines().count(),
            1,
            "one replacement after a kill at {step}: {replacements}"
        );
        drop(restarted);
    }
}

#[tokio::test]
async fn a_bare_pod_placed_below_after_its_replacement_was_made_ends_as_one_pod_the_original() {
    let scene = Scene::start("ds-pair", 1).await;
    apply(up(), &scene.bare_pod("solo")).await;
    let original = {
        let mut found = None;
        while found.is_none() {
            found = scene.pods("app=solo").await.first().map(uid);
        }
        found.unwrap()
    };
    // The move stops after the replacement is made: the original is never evicted.
    let mut crashing = scene.process(&["--crash-at=created"], "pair-crash");
    let deadline = Instant::now() + Duration::from_secs(90);
    while crashing.service.exited().is_none() {
        assert!(Instant::now() < deadline, "no crash: {}", crashing.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(crashing.log().contains("aborting"), "{}", crashing.log());

    // Room appears in lower-a: its scheduler places the original after all.
    let ns = scene.ns.clone();
    BED.handle()
        .unwrap()
        .spawn(async move {
            let node = NodeConfig::new(&format!("{ns}-a-big"))
                .resource("cpu", "4")
                .label(LOWER_KEY, &ns);
            bed().sim_a.add_node(node).await.unwrap();
        })
        .await
        .unwrap();
    within("the original and its replacement both running", 90, || async {
        let pods = scene.pods("app=solo").await;
        let runs = |vn: &str, want_original: bool| {
            pods.iter()
                .any(|p| node_of(p) == vn && phase(p) == "Running" && (uid(p) == original) == want_original)
        };
        if runs(&scene.vn_a, true) && runs(&scene.vn_b, false) {
            Ok(())
        } else {
            Err(format!("{pods:?}"))
        }
    })
    .await;

    // A descheduler running again ends the pair: the original, which runs, stays alone.
    let _d = scene.descheduler(&[], "pair").await;
    let mut counts = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = scene.pods("app=solo").await;
        counts.insert(pods.iter().filter(|p| !terminating(p)).count());
        if pods.len() == 1 {
            let p = &pods[0];
            assert_eq!(uid(p), original, "the original is kept: {pods:?}");
            assert_eq!((node_of(p), phase(p)), (scene.vn_a.as_str(), "Running"));
            break;
        }
        assert!(Instant::now() < deadline, "still two pods: {pods:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!counts.contains(&0), "there was always a pod: {counts:?}");
    let removed = events(&scene.ns, "ReplacementRemoved").await;
    assert_eq!(removed.len(), 1, "{removed:?}");
    // And it stays one pod: nothing moves the original again.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let pods = scene.pods("app=solo").await;
    assert_eq!(pods.iter().map(uid).collect::<Vec<_>>(), vec![original]);
}

#[tokio::test]
async fn a_pod_whose_create_lower_a_refuses_for_quota_moves_to_lower_b() {
    let scene = Scene::start("ds-quota", 1).await;
    let ns = &scene.ns;
    // A first small pod makes the virtual node create the namespace in lower-a.
    let mut warm = scene.template("warm", "100m", json!({}), json!({}));
    warm["apiVersion"] = json!("v1");
    warm["kind"] = json!("Pod");
    warm["metadata"]["name"] = json!("warm");
    warm["metadata"]["namespace"] = json!(ns);
    apply(up(), &warm.to_string()).await;
    within("the first pod running in lower-a", 60, || async {
        let pods = scene.pods("app=warm").await;
        if pods
            .iter()
            .any(|p| node_of(p) == scene.vn_a && phase(p) == "Running")
        {
            Ok(())
        } else {
            Err(format!("{pods:?}"))
        }
    })
    .await;
    // Lower-a's quota then refuses a 1.5-CPU pod that any of its nodes would hold.
    let quota = json!({
        "apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "cap", "namespace": ns},
        "spec": {"hard": {"requests.cpu": "1"}},
    })
    .to_string();
    apply(bed().lower_a.kubeconfig(), &quota).await;
    let _d = scene.descheduler(&[], "quota").await;
    apply(up(), &scene.deployment("web", 1, "1500m", json!({}))).await;
    let mut refused_on_a = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pods = scene.pods("app=web").await;
        refused_on_a |= pods.iter().any(|p| {
            node_of(p) == scene.vn_a
                && p["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "tensile.io/LowerPodSynced" && c["reason"] == "CreateFailed")
                })
        });
        let live: Vec<&Value> = pods.iter().filter(|p| !terminating(p)).collect();
        if live.len() == 1 && node_of(live[0]) == scene.vn_b && phase(live[0]) == "Running" {
            break;
        }
        assert!(Instant::now() < deadline, "not moved: {pods:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(refused_on_a, "the pod was first refused by lower-a's quota");
    let moved = events(ns, "Descheduled").await;
    assert!(
        moved
            .iter()
            .any(|e| e["message"].as_str().unwrap_or_default().contains("quota")),
        "{moved:?}"
    );
}

/// `n` live exclusion records of other workloads, created directly in `ns` (32 at a time);
/// returns the bytes the same records took as entries of the old ConfigMap.
async fn many_records(ns: &str, n: usize) -> usize {
    use futures::{StreamExt as _, TryStreamExt as _};
    use tensile_common::exclusion::{ExclusionRecord, Record, encode};
    let api: kube::Api<ExclusionRecord> = kube::Api::namespaced(bed().upper.client().await.unwrap(), ns);
    let until = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(1);
    let records: Vec<(String, Record)> = (0..n)
        .map(|i| {
            let key = format!("{i:08x}-0000-4000-8000-{i:012x}");
            let record = Record {
                namespace: ns.to_owned(),
                kind: "ReplicaSet".into(),
                name: format!("other-{i}-5d8c7f9b6"),
                nodes: [("vn-elsewhere".to_owned(), until)].into(),
                moves: 1,
                expires: until,
                exhausted: None,
            };
            (key, record)
        })
        .collect();
    let old_bytes = records
        .iter()
        .map(|(k, r)| k.len() + serde_json::to_string(r).unwrap().len())
        .sum();
    futures::stream::iter(records)
        .map(|(key, record)| {
            let api = api.clone();
            async move {
                let object = encode(ns, &key, &record, None, "e2e").unwrap();
                api.create(&kube::api::PostParams::default(), &object)
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await
        .unwrap();
    old_bytes
}

#[tokio::test]
async fn with_eight_thousand_live_records_and_an_undecodable_one_a_pod_still_moves_and_the_undecodable_record_survives()
 {
    let scene = Scene::start("ds-many", 1).await;
    let started = Instant::now();
    let old_bytes = many_records(&scene.ns, 8000).await;
    assert!(
        old_bytes > 1024 * 1024,
        "more than one ConfigMap could hold ({old_bytes} bytes of entries)"
    );
    println!(
        "figure: 8,000 exclusion records created in {:.1} s ({old_bytes} bytes as ConfigMap entries)",
        started.elapsed().as_secs_f64()
    );
    // A record that does not decode, as a newer release or a hand might write it.
    apply(
        up(),
        &json!({
            "apiVersion": "tensile.io/v1alpha1", "kind": "ExclusionRecord",
            "metadata": {"name": "not-a-record", "namespace": scene.ns},
            "spec": {"key": "not-a-record", "nodes": "every one"},
        })
        .to_string(),
    )
    .await;
    let undecodable = |out: String| -> (String, String) {
        let v: Value = serde_json::from_str(&out).unwrap();
        (
            v["metadata"]["resourceVersion"].to_string(),
            v["spec"].to_string(),
        )
    };
    let get_undecodable = || async {
        undecodable(
            scene::field(
                up(),
                &scene.ns,
                "exclusionrecords.tensile.io/not-a-record",
                "json",
            )
            .await,
        )
    };
    let before = get_undecodable().await;

    let d = scene.descheduler(&[], "many").await;
    apply(up(), &scene.deployment("web", 1, "3", json!({}))).await;
    until_moved(&scene, "app=web", 1, 180).await;
    for p in scene.pods("app=web").await {
        assert_eq!(
            p["metadata"]["annotations"]["tensile.io/excluded-nodes"],
            scene.vn_a.as_str(),
            "the webhook applied the exclusion: the replacement avoids vn-a"
        );
    }
    let records = kubectl(
        up(),
        &[
            "-n",
            &scene.ns,
            "get",
            "exclusionrecords.tensile.io",
            "-o",
            "name",
        ],
    )
    .await;
    assert_eq!(
        records.lines().count(),
        8002,
        "the 8,000, the undecodable one and the move's"
    );
    assert_eq!(
        get_undecodable().await,
        before,
        "another record's write left the undecodable one as it was"
    );
    within("the undecodable record counted", 30, || async {
        let m = d.metrics().await;
        let n = metric_sum(&m, "tensile_descheduler_exclusions_unreadable", &[]);
        let live = metric_sum(&m, "tensile_descheduler_exclusions", &[]);
        if n == 1.0 && live >= 8001.0 {
            Ok(())
        } else {
            Err(format!("unreadable {n}, live {live}"))
        }
    })
    .await;
}

/// The scene's ExclusionRecords: workload name → excluded nodes.
async fn records(ns: &str) -> BTreeMap<String, Vec<String>> {
    let out = kubectl(
        up(),
        &["-n", ns, "get", "exclusionrecords.tensile.io", "-o", "json"],
    )
    .await;
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            let nodes = r["spec"]["nodes"]
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            (r["spec"]["name"].as_str().unwrap_or_default().to_owned(), nodes)
        })
        .collect()
}

#[tokio::test]
async fn a_replica_kept_off_vn_a_by_an_exclusion_runs_there_once_lower_a_frees_up() {
    let scene = Scene::start_with("ds-stuck", 1, true).await;
    let d = scene.descheduler(&[], "stuck").await;
    // Lower-a's nodes have 2 CPUs: the 3-CPU replica is refused there and moves to vn-b.
    // Replicas never share a virtual node (required pod anti-affinity, kept upstream).
    let mut web: Value = serde_json::from_str(&scene.deployment("web", 1, "3", json!({}))).unwrap();
    web["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"] = json!({
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": "kubernetes.io/hostname"}]});
    apply(up(), &web.to_string()).await;
    until_moved(&scene, "app=web", 1, 120).await;

    // A second replica, made while the exclusion holds, fits nowhere upstream (vn-b holds
    // the first, vn-a is excluded) and waits unplaced.
    kubectl(
        up(),
        &["-n", &scene.ns, "scale", "deployment", "web", "--replicas=2"],
    )
    .await;
    let unplaced = |pods: &[Value]| -> Vec<String> {
        pods.iter()
            .filter(|p| node_of(p).is_empty() && !terminating(p))
            .map(name)
            .collect()
    };
    within("one replica unplaced upstream", 60, || async {
        let pods = scene.pods("app=web").await;
        let on_b = pods
            .iter()
            .filter(|p| node_of(p) == scene.vn_b && phase(p) == "Running")
            .count();
        let waiting = unplaced(&pods);
        if on_b == 1 && waiting.len() == 1 {
            Ok(())
        } else {
            Err(format!("{on_b} running on vn-b, unplaced {waiting:?}"))
        }
    })
    .await;
    let stuck = unplaced(&scene.pods("app=web").await)[0].clone();

    // While lower-a still holds no 3-CPU pod, the unplaced replica is left alone: without the
    // exclusion it would only be refused on vn-a instead.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let pods = scene.pods("app=web").await;
    assert_eq!(unplaced(&pods), vec![stuck.clone()], "the same replica waits");
    let released = "tensile_descheduler_pods_released_total";
    assert_eq!(metric_sum(&d.metrics().await, released, &[]), 0.0);

    // Lower-a frees up (a node of 8 CPUs joins): the exclusion no longer holds, and the
    // replica runs there, long before the record's 600 s TTL.
    let freed_at = Instant::now();
    let node = NodeConfig::new(&format!("{}-big", scene.ns))
        .resource("cpu", "8")
        .resource("memory", "16Gi")
        .label(LOWER_KEY, &scene.ns);
    BED.handle()
        .unwrap()
        .spawn(async move { bed().sim_a.add_node(node).await.unwrap() })
        .await
        .unwrap();
    within(
        "the unplaced replica recreated and Running on vn-a",
        120,
        || async {
            let pods = scene.pods("app=web").await;
            let on_a: Vec<&Value> = pods
                .iter()
                .filter(|p| node_of(p) == scene.vn_a && phase(p) == "Running" && !terminating(p))
                .collect();
            if on_a.len() == 1 && unplaced(&pods).is_empty() && pods.len() == 2 {
                Ok(())
            } else {
                Err(format!(
                    "{:?}",
                    pods.iter()
                        .map(|p| format!("{} on {:?} {}", name(p), node_of(p), phase(p)))
                        .collect::<Vec<_>>()
                ))
            }
        },
    )
    .await;
    let took = freed_at.elapsed();
    let pods = scene.pods("app=web").await;
    assert!(
        pods.iter().all(|p| name(p) != stuck),
        "the replica that waited was recreated"
    );
    let on_a = pods.iter().find(|p| node_of(p) == scene.vn_a).unwrap();
    assert!(
        on_a["metadata"]["annotations"]["tensile.io/excluded-nodes"].is_null(),
        "the recreated replica avoids nothing: {}",
        on_a["metadata"]
    );
    let recs = records(&scene.ns).await;
    assert!(
        recs.values().all(|nodes| !nodes.contains(&scene.vn_a)),
        "vn-a left the record: {recs:?}"
    );
    let m = d.metrics().await;
    assert_eq!(metric_sum(&m, released, &[("result", "success")]), 1.0, "{m}");
    let evs = events(&scene.ns, "Released").await;
    assert!(
        evs.iter().any(|e| e["involvedObject"]["name"] == stuck.as_str()),
        "a Released event on {stuck}: {evs:?}"
    );
    println!(
        "figure: descheduler, a replica kept off vn-a by an exclusion: lower-a frees up -> Running on vn-a in {:.1} s (threshold 3 s, TTL 600 s)",
        took.as_secs_f64()
    );
}

/// Writes an ExclusionRecord keeping ReplicaSet `rs` (of UID `uid`) off `node` for an hour,
/// as the descheduler would.
async fn exclude(ns: &str, rs: &str, uid: &str, node: &str) {
    use tensile_common::exclusion::{ExclusionRecord, Record, encode};
    let api: kube::Api<ExclusionRecord> = kube::Api::namespaced(bed().upper.client().await.unwrap(), ns);
    let until = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(1);
    let record = Record {
        namespace: ns.to_owned(),
        kind: "ReplicaSet".into(),
        name: rs.to_owned(),
        nodes: [(node.to_owned(), until)].into(),
        moves: 1,
        expires: until,
        exhausted: None,
    };
    let object = encode(ns, uid, &record, None, "e2e").unwrap();
    api.create(&kube::api::PostParams::default(), &object)
        .await
        .unwrap();
}

/// The first bound pod of `app` other than `old`, within 60 s.
async fn bound_other_than(scene: &Scene, app: &str, old: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = scene.pods(&format!("app={app}")).await;
        if let Some(p) = pods
            .iter()
            .find(|p| name(p) != old && !node_of(p).is_empty() && !terminating(p))
        {
            return p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no bound pod of {app} besides {old:?}: {:?}",
            pods.iter().map(name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The first bound pod of `app`.
async fn bound(scene: &Scene, app: &str) -> Value {
    bound_other_than(scene, app, "").await
}

/// Deletes pod `old` of `app`; returns the bound pod its controller makes instead.
async fn recreated(scene: &Scene, app: &str, old: &str) -> Value {
    kubectl(up(), &["-n", &scene.ns, "delete", "pod", old, "--wait=false"]).await;
    bound_other_than(scene, app, old).await
}

#[tokio::test]
async fn a_template_written_with_its_stash_follows_its_workloads_current_exclusion_never_a_copied_one() {
    let scene = Scene::start("ds-copy", 1).await;
    let ns = scene.ns.clone();
    // A pod the webhook kept off vn-a: its ReplicaSet's record excludes vn-a.
    apply(up(), &scene.deployment("first", 1, "100m", json!({}))).await;
    let pod = bound(&scene, "first").await;
    assert_eq!(node_of(&pod), scene.vn_a, "vn-a is preferred");
    let owner = &pod["metadata"]["ownerReferences"][0];
    exclude(
        &ns,
        owner["name"].as_str().unwrap(),
        owner["uid"].as_str().unwrap(),
        &scene.vn_a,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let excluded = recreated(&scene, "first", &name(&pod)).await;
    assert_eq!(node_of(&excluded), scene.vn_b);
    assert_eq!(
        excluded["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        scene.vn_a.as_str()
    );

    // Its stash, exclusion and constraints copied into another Deployment's template, as
    // `kubectl get pod -o yaml` gives them: that workload has no record, so nothing keeps
    // its pod off vn-a.
    let annotations: serde_json::Map<String, Value> = excluded["metadata"]["annotations"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| ["clusterSelector", "tensile.io/excluded-nodes"].contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let spec = &excluded["spec"];
    let copy = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "copy", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "copy"}},
            "template": {
                "metadata": {"labels": {"app": "copy", "virtual-pod": "true"}, "annotations": annotations},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "nodeSelector": spec["nodeSelector"],
                    "affinity": spec["affinity"],
                    "tolerations": spec["tolerations"],
                    "containers": [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "100m"}}}],
                }}},
    });
    assert!(
        copy.to_string().contains("NotIn"),
        "the copy carries the exclusion: {copy}"
    );
    apply(up(), &copy.to_string()).await;
    let pod = bound(&scene, "copy").await;
    assert_eq!(
        node_of(&pod),
        scene.vn_a,
        "the copied exclusion is gone: {}",
        pod["spec"]["affinity"]
    );
    assert!(pod["metadata"]["annotations"]["tensile.io/excluded-nodes"].is_null());
    assert!(!pod["spec"].to_string().contains("NotIn"), "{}", pod["spec"]);
    assert_eq!(
        pod["metadata"]["annotations"]["clusterSelector"], annotations["clusterSelector"],
        "the stash is untouched"
    );

    // Its own record excludes vn-a: the next pod, written with its stash, avoids vn-a.
    let owner = &pod["metadata"]["ownerReferences"][0];
    exclude(
        &ns,
        owner["name"].as_str().unwrap(),
        owner["uid"].as_str().unwrap(),
        &scene.vn_a,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let next = recreated(&scene, "copy", &name(&pod)).await;
    assert_eq!(node_of(&next), scene.vn_b, "{}", next["spec"]["affinity"]);
    assert_eq!(
        next["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        scene.vn_a.as_str()
    );
    assert_eq!(
        next["metadata"]["annotations"]["clusterSelector"],
        annotations["clusterSelector"]
    );
}

/// Lower-a's scheduler preempts a low-priority pod for a high-priority opted-in pod; the
/// victim takes 20 s to stop (its grace period is 60 s). The upper pod shows the lower
/// refusal for far longer than the 3 s threshold, but it is being made room for: it is not
/// moved, and runs where its victim was.
#[tokio::test]
async fn a_pod_the_lower_scheduler_preempted_for_is_not_moved_while_its_victim_stops_and_runs_there() {
    let scene = Scene::start("ds-preempt", 1).await;
    let ns = &scene.ns;
    let (target, high, victims) = (format!("{ns}-a0"), format!("{ns}-high"), format!("{ns}-low"));
    // The class exists in both clusters, so the lower pod keeps it (docs/virtual-node.md).
    let class = json!({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": high}, "value": 1_000_000,
    })
    .to_string();
    apply(up(), &class).await;
    apply(bed().lower_a.kubeconfig(), &class).await;
    // A pod of the lower cluster's own, at priority 0, holds 1.5 of the target's 2 CPUs.
    bed().lower_a.create_namespace(&victims).await.unwrap();
    let victim = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "victim", "namespace": victims, "annotations": {"tensile.io/sim": "stop=20s"}},
        "spec": {
            "nodeName": target, "terminationGracePeriodSeconds": 60,
            "containers": [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "1500m"}}}],
        },
    })
    .to_string();
    apply(bed().lower_a.kubeconfig(), &victim).await;
    within("the victim running in lower-a", 60, || async {
        let pods = pods_of(bed().lower_a.kubeconfig(), &victims, "").await;
        match pods.first() {
            Some(p) if phase(p) == "Running" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    let _d = scene.descheduler(&[], "preempt").await;
    let mut deployment: Value =
        serde_json::from_str(&scene.deployment("urgent", 1, "1", json!({"kubernetes.io/hostname": target})))
            .unwrap();
    deployment["spec"]["template"]["spec"]["priorityClassName"] = json!(high);
    apply(up(), &deployment.to_string()).await;

    let mut first: Option<String> = None;
    let mut nominated_seen = false;
    let mut refused_from: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(150);
    let running = loop {
        let pods = scene.pods("app=urgent").await;
        for p in &pods {
            let original = first.get_or_insert_with(|| uid(p));
            assert_eq!(
                (&uid(p), terminating(p)),
                (&*original, false),
                "the pod was moved while lower-a made room for it: {pods:?}"
            );
        }
        if let Some(p) = pods.first() {
            let conditions = p["status"]["conditions"].as_array().cloned().unwrap_or_default();
            if refused_since(p).is_some() {
                refused_from.get_or_insert_with(Instant::now);
            }
            nominated_seen |= conditions
                .iter()
                .any(|c| c["type"] == "tensile.io/LowerPodNominated" && c["status"] == "True");
            if node_of(p) == scene.vn_a && phase(p) == "Running" {
                break p.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "not running on {}: {pods:?}",
            scene.vn_a
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let refused_for = refused_from.map(|t| t.elapsed()).unwrap_or_default();
    assert!(
        refused_for > Duration::from_secs(10),
        "the lower refusal lasted well past the threshold ({refused_for:?})"
    );
    assert!(nominated_seen, "the upper pod showed the nomination below");
    assert!(
        !running["status"]["conditions"]
            .to_string()
            .contains("tensile.io/LowerPodNominated"),
        "the nomination ended with the bind below: {}",
        running["status"]
    );
    let lower = pods_of(bed().lower_a.kubeconfig(), ns, "app=urgent").await;
    assert_eq!(lower.len(), 1, "{lower:?}");
    assert_eq!(node_of(&lower[0]), target, "it runs where its victim was");
    assert!(
        pods_of(bed().lower_a.kubeconfig(), &victims, "").await.is_empty(),
        "the victim is gone"
    );
    assert!(events(ns, "Descheduled").await.is_empty());
    println!(
        "figure: descheduler, preemption in lower-a: refused {:.1} s (threshold 3 s), Running on {} as {}",
        refused_for.as_secs_f64(),
        scene.vn_a,
        name(&running)
    );
}

/// A 3-CPU pod lands on vn-a, where no node of lower-a can hold it; an autoscaler of
/// lower-a says it adds a node for it (a `TriggeredScaleUp` Event on the lower pod, as
/// cluster-autoscaler writes it). The upper pod shows the scale-up, the descheduler (3 s
/// threshold) leaves it however long it stays refused, and once the new node joins lower-a
/// the pod runs there, never moved.
#[tokio::test]
async fn a_pod_an_autoscaler_below_adds_a_node_for_is_not_moved_and_runs_on_the_new_node() {
    let scene = Scene::start("ds-scaleup", 1).await;
    let ns = &scene.ns;
    apply(up(), &scene.deployment("grow", 1, "3", json!({}))).await;
    let refused_below = |p: &Value| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
    };
    within("the lower pod refused by lower-a's scheduler", 90, || async {
        let pods = pods_of(bed().lower_a.kubeconfig(), ns, "app=grow").await;
        match pods.iter().any(refused_below) {
            true => Ok(()),
            false => Err(format!("{pods:?}")),
        }
    })
    .await;
    let lower = pods_of(bed().lower_a.kubeconfig(), ns, "app=grow").await;
    let (lower_name, lower_uid) = (name(&lower[0]), uid(&lower[0]));
    let original = uid(&scene.pods("app=grow").await[0]);

    // What cluster-autoscaler writes when it scales a node group up for the pod (its event
    // recorder writes core Events with first and last timestamps, no eventTime).
    let message = "pod triggered scale-up: [{pool 1->2 (max: 10)}]";
    let now = jiff::Timestamp::now();
    let event = json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("{lower_name}.scale-up"), "namespace": ns},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": lower_name, "namespace": ns, "uid": lower_uid},
        "reason": "TriggeredScaleUp", "message": message, "type": "Normal",
        "source": {"component": "cluster-autoscaler"}, "count": 1,
        "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("event.json");
    std::fs::write(&file, event.to_string()).unwrap();
    kubectl(
        bed().lower_a.kubeconfig(),
        &["create", "-f", &file.display().to_string()],
    )
    .await;

    let scale_up = |p: &Value| {
        p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "tensile.io/LowerPodNominated" && c["status"] == "True")
            .cloned()
    };
    // A few seconds for the signal to come up; the descheduler starts with the pod refused
    // past its threshold either way.
    for _ in 0..20 {
        if scene.pods("app=grow").await.iter().any(|p| scale_up(p).is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let _d = scene.descheduler(&[], "scale-up").await;
    let mut shown: Option<Value> = None;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(20) {
        let pods = scene.pods("app=grow").await;
        for p in &pods {
            assert_eq!(
                (uid(p), terminating(p)),
                (original.clone(), false),
                "the pod was moved while lower-a scaled up for it: {pods:?}"
            );
            assert!(refused_since(p).is_some(), "still refused below: {p}");
            shown = shown.or_else(|| scale_up(p));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let shown = shown.expect("the upper pod showed the scale-up below");
    assert_eq!(
        (&shown["reason"], &shown["message"]),
        (&json!("ScaleUp"), &json!(message)),
        "{shown}"
    );

    // The autoscaler's node joins lower-a: the pod runs there, where it was placed.
    let node = format!("{ns}-a-new");
    let (added, label) = (node.clone(), ns.clone());
    BED.handle()
        .unwrap()
        .spawn(async move {
            let config = NodeConfig::new(&added)
                .resource("cpu", "8")
                .label(LOWER_KEY, &label);
            bed().sim_a.add_node(config).await.unwrap();
        })
        .await
        .unwrap();
    within("the pod running on vn-a", 90, || async {
        let pods = scene.pods("app=grow").await;
        match pods.as_slice() {
            [p] if uid(p) == original && node_of(p) == scene.vn_a && phase(p) == "Running" => Ok(()),
            _ => Err(format!("{pods:?}")),
        }
    })
    .await;
    let lower = pods_of(bed().lower_a.kubeconfig(), ns, "app=grow").await;
    assert_eq!(
        (lower.len(), node_of(&lower[0])),
        (1, node.as_str()),
        "it runs on the new node: {lower:?}"
    );
    let pods = scene.pods("app=grow").await;
    assert!(
        scale_up(&pods[0]).is_none(),
        "the scale-up ended with the bind below: {}",
        pods[0]["status"]
    );
    assert!(events(ns, "Descheduled").await.is_empty());
    println!(
        "figure: descheduler, scale-up in lower-a: pod {} refused, shown as ScaleUp and left in place, Running on {}",
        name(&pods[0]),
        scene.vn_a
    );
}
