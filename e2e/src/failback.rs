//! Failback: a lower cluster that was away comes back, and the descheduler's `--rebalance`
//! moves running pods back where their topology spread or preferred node affinity wants
//! them.
//!
//! The bed of the `rebalance` end-to-end test, for the `failback` benchmark and any test that
//! needs it: an upper cluster, lower-a and lower-b with simulated nodes of 8 CPUs, a virtual
//! node over each (vn-a, vn-b, in process) labelled `tensile-e2e-vn=<label>`, and the
//! ExclusionRecord CRD; Deployments of opted-in pods on those nodes; and a
//! `kubectl get pods --watch` reader that knows every pod's node and readiness, so the fewest
//! Ready pods of a workload at any moment are known, not only at samples.
//!
//! The benchmark ([`bench`]) times the way back for many spread Deployments at once: from
//! lower-a's apiserver answering again to every Deployment spread evenly over vn-a and vn-b,
//! once per `--rebalance-max-owners`, each in a namespace of its own with a fresh descheduler.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use crate::descheduler::{DeschedulerProcess, metric_sum};
use crate::{NodeSimulator, TestCluster, in_process};

/// Label key of the bed's virtual nodes; its value is the bed's label.
pub const VN_KEY: &str = "tensile-e2e-vn";

/// The benchmark's pods (100m CPU each) one simulated 8-CPU node is sized for: 80 would fit;
/// the rest is room for replacements while their moved pods terminate.
const PODS_PER_NODE: usize = 60;

/// The failback bed. Fields drop in order: the virtual nodes stop first, the clusters last.
pub struct Bed {
    pub nodes: [in_process::VirtualNode; 2],
    pub sims: Vec<NodeSimulator>,
    pub lower_b: TestCluster,
    pub lower_a: TestCluster,
    pub upper: TestCluster,
    /// The value of [`VN_KEY`] on both virtual nodes.
    pub label: String,
}

impl Bed {
    /// Starts the bed of `test` (logs under `target/e2e-logs/<test>/`): the three clusters,
    /// the ExclusionRecord CRD in the upper one, `nodes` simulated nodes of 8 CPUs and
    /// 16 GiB in each lower cluster, vn-a over lower-a and vn-b over lower-b labelled
    /// [`VN_KEY`]`=label`; returns once both are Ready.
    pub async fn start(test: &str, label: &str, nodes: usize) -> anyhow::Result<Bed> {
        let [upper, lower_a, lower_b] = crate::scene::clusters(test, ["upper", "lower-a", "lower-b"]).await?;
        crate::chart::install_exclusion_records(upper.kubeconfig()).await?;
        let mut sims = Vec::new();
        for lower in [&lower_a, &lower_b] {
            let configs = crate::scene::nodes(lower.name(), nodes)
                .into_iter()
                .map(|node| node.resource("cpu", "8").resource("memory", "16Gi"))
                .collect();
            sims.push(crate::scene::simulate(lower, configs).await?);
        }
        let node = |name: &str, lower: &TestCluster| {
            crate::scene::virtual_node(&upper, name, lower, |args| {
                args.node_labels = vec![(VN_KEY.to_owned(), label.to_owned())]
            })
        };
        let nodes = [node("vn-a", &lower_a)?, node("vn-b", &lower_b)?];
        for vn in ["vn-a", "vn-b"] {
            crate::wait::until(
                &format!("{vn} Ready"),
                Duration::from_secs(60),
                Duration::from_millis(250),
                || async {
                    let ready = upper
                        .kubectl(&[
                            "get",
                            "node",
                            vn,
                            "-o",
                            r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
                        ])
                        .await;
                    if ready.stdout.trim() == "True" {
                        Ok(())
                    } else {
                        Err(format!("{} {}", ready.stdout, ready.stderr))
                    }
                },
            )
            .await?;
        }
        Ok(Bed {
            nodes,
            sims,
            lower_b,
            lower_a,
            upper,
            label: label.to_owned(),
        })
    }

    /// A Deployment in `namespace` of the bed's virtual nodes: see [`deployment`].
    pub fn deployment(&self, namespace: &str, name: &str, replicas: u32, extra: Value) -> String {
        deployment(namespace, &self.label, name, replicas, extra)
    }

    /// The descheduler as the failback scenes run it: every node of the bed, records in
    /// `namespace`, a round every 2 s, rebalancing after 10 s of a node's readiness; `extra`
    /// flags added.
    pub fn descheduler(
        &self,
        namespace: &str,
        extra: &[String],
        log_name: &str,
    ) -> anyhow::Result<DeschedulerProcess> {
        let mut args = vec![
            format!("--node-selector=type=virtual-kubelet,{VN_KEY}={}", self.label),
            format!("--exclusions-configmap={namespace}/exclusions"),
            "--descheduling-interval=2s".to_owned(),
            "--rebalance".to_owned(),
            "--rebalance-stabilization=10".to_owned(),
        ];
        args.extend(extra.iter().cloned());
        DeschedulerProcess::start(&self.upper, &args, log_name)
    }
}

/// A Deployment `name` in `namespace` of `replicas` opted-in pods (`virtual-pod=true`, 100m
/// CPU each) on the virtual nodes labelled [`VN_KEY`]`=label`, evicted 5 s after their node
/// turns NotReady or unreachable, with `extra` merged into the pod spec.
pub fn deployment(namespace: &str, label: &str, name: &str, replicas: u32, extra: Value) -> String {
    let mut spec = json!({
        "terminationGracePeriodSeconds": 2,
        "nodeSelector": {"type": "virtual-kubelet", VN_KEY: label},
        "tolerations": [
            {"key": "virtual-kubelet.io/provider", "operator": "Exists"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
        ],
        "containers": [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "100m"}}}],
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name, "virtual-pod": "true"}}, "spec": spec}},
    })
    .to_string()
}

/// A topology spread constraint over the virtual nodes for the pods of `app`: maxSkew 1,
/// `ScheduleAnyway`, as [`deployment`]'s `extra`.
pub fn spread_over_nodes(app: &str) -> Value {
    json!({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"app": app}}}]})
}

/// Whether pod `p` (as JSON) is Ready and not being deleted.
pub fn ready(p: &Value) -> bool {
    p["metadata"]["deletionTimestamp"].is_null()
        && p["status"]["phase"] == "Running"
        && p["status"]["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// Ready pods of `app` in `namespace` per node, as `kubectl get pods` shows them.
pub async fn ready_per_node(
    kubeconfig: &Path,
    namespace: &str,
    app: &str,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let selector = format!("app={app}");
    let out = crate::kubectl::run(
        kubeconfig,
        &["-n", namespace, "get", "pods", "-l", &selector, "-o", "json"],
    )
    .await;
    anyhow::ensure!(out.ok, "kubectl get pods: {}", out.stderr);
    let list: Value = serde_json::from_str(&out.stdout).context("kubectl get pods")?;
    let mut per_node = BTreeMap::new();
    for p in list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| ready(p))
    {
        let node = p["spec"]["nodeName"].as_str().unwrap_or_default();
        *per_node.entry(node.to_owned()).or_default() += 1;
    }
    Ok(per_node)
}

/// Ready pods per app, then per node.
pub type PerNode = BTreeMap<String, BTreeMap<String, usize>>;

/// One pod as the watch last showed it.
struct Watched {
    app: String,
    node: String,
    /// `Ready`, or why not: `deleting`, `unscheduled`, the phase.
    state: &'static str,
}

impl Watched {
    fn ready(&self) -> bool {
        self.state == "Ready"
    }
}

/// Where a pod stands, as one word.
fn state(p: &Value) -> &'static str {
    if ready(p) {
        "Ready"
    } else if !p["metadata"]["deletionTimestamp"].is_null() {
        "deleting"
    } else if p["spec"]["nodeName"].as_str().unwrap_or_default().is_empty() {
        "unscheduled"
    } else {
        match p["status"]["phase"].as_str() {
            Some("Pending") => "Pending",
            Some("Running") => "Running, not Ready",
            _ => "ended",
        }
    }
}

/// A workload's pods when it had the fewest Ready ones.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct AtLowest {
    /// Its pods, Ready or not (a deleted pod whose replacement is not created yet is none).
    pub pods: usize,
    /// Those not Ready, per node and state (`vn-b deleting`).
    pub not_ready: BTreeMap<String, usize>,
}

#[derive(Default)]
struct Seen {
    /// By UID; gone once deleted.
    pods: BTreeMap<String, Watched>,
    /// The fewest Ready pods per app since the last [`ReadyWatch::reset`].
    lowest: BTreeMap<String, usize>,
    /// Per app, its pods when it had the fewest Ready.
    at_lowest: BTreeMap<String, AtLowest>,
    /// The node of every pod created since the last reset (empty while unscheduled).
    created: BTreeMap<String, String>,
    /// Whether a reset was made, so new pods are counted in `created`.
    counting: bool,
}

impl Seen {
    fn show(&mut self, event: &Value) {
        let p = &event["object"];
        let uid = p["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        if event["type"] == "DELETED" {
            self.pods.remove(&uid);
        } else {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            let pod = Watched {
                app: text(&p["metadata"]["labels"]["app"]),
                node: text(&p["spec"]["nodeName"]),
                state: state(p),
            };
            if self.counting && (event["type"] == "ADDED" || self.created.contains_key(&uid)) {
                self.created.insert(uid.clone(), pod.node.clone());
            }
            self.pods.insert(uid, pod);
        }
        let mut now: BTreeMap<&str, usize> = BTreeMap::new();
        for pod in self.pods.values() {
            *now.entry(&pod.app).or_default() += usize::from(pod.ready());
        }
        for (app, n) in now {
            let l = self.lowest.entry(app.to_owned()).or_insert(usize::MAX);
            if n < *l {
                *l = n;
                let mut pods = 0;
                let mut down: BTreeMap<String, usize> = BTreeMap::new();
                for pod in self.pods.values().filter(|p| p.app == app) {
                    pods += 1;
                    if !pod.ready() {
                        *down.entry(format!("{} {}", pod.node, pod.state)).or_default() += 1;
                    }
                }
                self.at_lowest.insert(
                    app.to_owned(),
                    AtLowest {
                        pods,
                        not_ready: down,
                    },
                );
            }
        }
    }
}

/// `kubectl get pods --watch` of a namespace: every change as kubectl shows it.
pub struct ReadyWatch {
    child: std::process::Child,
    seen: Arc<Mutex<Seen>>,
}

impl ReadyWatch {
    /// Starts `kubectl get pods --watch --output-watch-events -o json` in `namespace` and a
    /// thread that reads it.
    pub fn start(kubeconfig: &Path, namespace: &str) -> anyhow::Result<ReadyWatch> {
        let mut child = std::process::Command::new(crate::kubectl::binary_for(kubeconfig))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "-n",
                namespace,
                "get",
                "pods",
                "--watch",
                "--output-watch-events",
                "-o",
                "json",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting kubectl get pods --watch")?;
        let stdout = child.stdout.take().context("kubectl's stdout")?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shown = seen.clone();
        std::thread::spawn(move || {
            for event in serde_json::Deserializer::from_reader(stdout).into_iter::<Value>() {
                let Ok(event) = event else { return };
                shown.lock().unwrap_or_else(PoisonError::into_inner).show(&event);
            }
        });
        Ok(ReadyWatch { child, seen })
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets the fewest Ready pods seen so far, and counts the pods created from now on.
    pub fn reset(&self) {
        let mut seen = self.seen();
        seen.lowest.clear();
        seen.at_lowest.clear();
        seen.created.clear();
        seen.counting = true;
    }

    /// The fewest Ready pods of `app` since [`ReadyWatch::reset`] (`usize::MAX` when no
    /// change was seen).
    pub fn lowest(&self, app: &str) -> usize {
        self.seen().lowest.get(app).copied().unwrap_or(usize::MAX)
    }

    /// The fewest Ready pods of each app since [`ReadyWatch::reset`].
    pub fn lowest_per_app(&self) -> BTreeMap<String, usize> {
        self.seen().lowest.clone()
    }

    /// The pods of `app` when it had the fewest Ready pods since [`ReadyWatch::reset`].
    pub fn at_lowest(&self, app: &str) -> AtLowest {
        self.seen().at_lowest.get(app).cloned().unwrap_or_default()
    }

    /// The pods created since [`ReadyWatch::reset`], per node they went to (`""`: none yet).
    pub fn created_per_node(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for node in self.seen().created.values() {
            *out.entry(node.clone()).or_default() += 1;
        }
        out
    }

    /// Ready pods per app and node now.
    pub fn ready_per_node(&self) -> PerNode {
        let mut out = PerNode::new();
        for pod in self.seen().pods.values().filter(|p| p.ready()) {
            *out.entry(pod.app.clone())
                .or_default()
                .entry(pod.node.clone())
                .or_default() += 1;
        }
        out
    }

    /// Waits up to 180 s until `test` holds for the Ready pods per app and node.
    pub async fn wait_for(&self, what: &str, test: &dyn Fn(&PerNode) -> bool) -> crate::Result<()> {
        crate::wait::until(
            what,
            Duration::from_secs(180),
            Duration::from_millis(100),
            || async {
                let now = self.ready_per_node();
                if test(&now) {
                    Ok(())
                } else {
                    Err(format!("{now:?}"))
                }
            },
        )
        .await
    }
}

impl Drop for ReadyWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the failback benchmark runs.
#[derive(Clone, Debug)]
pub struct FailbackBench {
    /// Spread Deployments.
    pub deployments: usize,
    /// Replicas of each.
    pub replicas: u32,
    /// One scene per value of the descheduler's `--rebalance-max-owners`.
    pub max_owners: Vec<u32>,
    /// How long one scene may wait for the spread to come back.
    pub budget: Duration,
}

/// The bed's label in the benchmark.
const BENCH_LABEL: &str = "failback";

/// The failback benchmark: one bed, then a scene per `--rebalance-max-owners`.
pub async fn bench(b: &FailbackBench) -> anyhow::Result<Value> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pods = b.deployments * b.replicas as usize;
    // Every pod must fit one lower cluster while the other is away.
    let nodes = pods.div_ceil(PODS_PER_NODE).max(2);
    let started = Instant::now();
    let bed = Bed::start("bench-failback", BENCH_LABEL, nodes).await?;
    let bed_secs = started.elapsed().as_secs_f64();
    let mut runs = Vec::new();
    for (i, &owners) in b.max_owners.iter().enumerate() {
        let namespace = format!("failback-owners-{owners}");
        let run = scene(&bed, b, &namespace, owners)
            .await
            .with_context(|| format!("the scene with --rebalance-max-owners={owners}"))?;
        println!("{}", summary_line(&run));
        runs.push(run);
        if i + 1 < b.max_owners.len() {
            clear(&bed, &namespace).await?;
        }
    }
    Ok(json!({
        "benchmark": "failback: lower-a's apiserver answers again -> every Deployment spread evenly over vn-a and vn-b again (Ready pods)",
        "deployments": b.deployments,
        "replicas": b.replicas,
        "pods": pods,
        "spread": "topologySpreadConstraint on kubernetes.io/hostname, maxSkew 1, ScheduleAnyway; not-ready and unreachable NoExecute tolerated for 5 s",
        "lower_nodes_each": nodes,
        "lower_node_cpu": 8,
        "descheduler": "--rebalance --rebalance-stabilization=10 --descheduling-interval=2s, other rebalance flags at their defaults (max-unavailable 1, max-per-round 5, cool-down 300 s); a fresh process per scene",
        "bed_start_secs": round1(bed_secs),
        "runs": runs,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "note": "seconds from lower-a's apiserver answering /readyz again (apiserver_restart_secs before that); moves from tensile_descheduler_pods_rebalanced_total{result=\"success\"}, first and last seen by polling /metrics every 100 ms, as is held_last_seen_secs (the last poll at which tensile_descheduler_rebalance_held showed a workload held back, per reason); Ready counts from a kubectl watch of every pod change in the scene's namespace: fewest_ready is the fewest Ready pods of any one Deployment at any moment, at_fewest its pods then (a pod deleted and not yet recreated by its ReplicaSet counts in neither), pods_created_per_node where the pods created after lower-a's return went; the test bed's kube-controller-manager and kube-scheduler keep their default client QPS; three control planes, two virtual nodes, the simulators and the descheduler share the machine's cores",
    }))
}

/// One scene: Deployments placed evenly, lower-a away until every Ready pod runs on vn-b,
/// lower-a back; the way back timed.
async fn scene(bed: &Bed, b: &FailbackBench, namespace: &str, max_owners: u32) -> anyhow::Result<Value> {
    let up = bed.upper.kubeconfig();
    let replicas = b.replicas as usize;
    let apps: Vec<String> = (0..b.deployments).map(|i| format!("spread-{i}")).collect();
    bed.upper.create_namespace(namespace).await?;
    let watch = ReadyWatch::start(up, namespace)?;
    let client = bed.upper.client().await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let placing = Instant::now();
    for app in &apps {
        let manifest = bed.deployment(namespace, app, b.replicas, spread_over_nodes(app));
        let d: Deployment = serde_json::from_str(&manifest)?;
        deployments.create(&PostParams::default(), &d).await?;
    }
    let even = |per_node: &PerNode| {
        apps.iter()
            .all(|app| evenly_spread(per_node.get(app).unwrap_or(&BTreeMap::new()), replicas))
    };
    watch
        .wait_for("every Deployment spread evenly over vn-a and vn-b", &even)
        .await?;
    let placement_secs = placing.elapsed().as_secs_f64();

    let descheduler = bed.descheduler(
        namespace,
        &[format!("--rebalance-max-owners={max_owners}")],
        &format!("failback-owners-{max_owners}"),
    )?;
    descheduler.wait_ready(Duration::from_secs(30)).await?;

    // Lower-a goes away: its pods are evicted upstream and their replacements run on vn-b.
    let outage = Instant::now();
    bed.lower_a.stop_apiserver();
    let all_on_b = |per_node: &PerNode| {
        apps.iter().all(|app| {
            let on = |node: &str| per_node.get(app).and_then(|n| n.get(node)).copied().unwrap_or(0);
            on("vn-b") == replicas && on("vn-a") == 0
        })
    };
    watch.wait_for("every Ready pod on vn-b", &all_on_b).await?;
    let outage_secs = outage.elapsed().as_secs_f64();

    // Lower-a comes back.
    watch.reset();
    let restarting = Instant::now();
    bed.lower_a.start_apiserver().await?;
    let back = Instant::now();
    let restart_secs = back.duration_since(restarting).as_secs_f64();
    let nodes: Api<Node> = Api::all(client);
    let moves = |metrics: &str| {
        metric_sum(
            metrics,
            "tensile_descheduler_pods_rebalanced_total",
            &[("result", "success")],
        )
    };
    let (mut vn_a_ready, mut first_move, mut last_move) = (None, None, None);
    // The last round that held a workload back, per reason (`stabilizing`, `no_fit`, …).
    let mut held: BTreeMap<String, Duration> = BTreeMap::new();
    let mut moved = 0.0;
    // The longest time between two moves seen.
    let mut longest_pause = Duration::ZERO;
    let restored = loop {
        let (now, at) = (watch.ready_per_node(), back.elapsed());
        if vn_a_ready.is_none() && node_ready(&nodes, "vn-a").await {
            vn_a_ready = Some(back.elapsed());
        }
        let metrics = descheduler.metrics().await;
        let m = moves(&metrics);
        if m > moved {
            let t = back.elapsed();
            if let Some(last) = last_move {
                longest_pause = longest_pause.max(t - last);
            }
            moved = m;
            first_move.get_or_insert(t);
            last_move = Some(t);
        }
        for reason in held_reasons(&metrics) {
            held.insert(reason, back.elapsed());
        }
        if even(&now) && vn_a_ready.is_some() {
            break at;
        }
        anyhow::ensure!(
            back.elapsed() < b.budget,
            "not spread again {:?} after lower-a came back: {now:?}; descheduler log:\n{}",
            b.budget,
            descheduler.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let lowest = watch.lowest_per_app();
    let fewest = lowest
        .iter()
        .filter(|(app, _)| apps.contains(app))
        .min_by_key(|(_, n)| **n)
        .map(|(app, n)| (app.clone(), *n));
    let at_fewest = fewest.as_ref().map(|(app, _)| watch.at_lowest(app));
    let created = watch.created_per_node();
    let moves_at_restored = moves(&descheduler.metrics().await);
    // Nothing should move once every Deployment is spread: two more rounds and a margin.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let moves_after = moves(&descheduler.metrics().await) - moves_at_restored;
    let mut still_even = true;
    for app in &apps {
        still_even &= evenly_spread(&ready_per_node(up, namespace, app).await?, replicas);
    }
    let secs = |d: Option<Duration>| d.map(|d| round1(d.as_secs_f64()));
    Ok(json!({
        "max_owners": max_owners,
        "namespace": namespace,
        "placement_secs": round1(placement_secs),
        "outage_to_all_on_vn_b_secs": round1(outage_secs),
        "apiserver_restart_secs": round1(restart_secs),
        "vn_a_ready_secs": secs(vn_a_ready),
        "first_move_secs": secs(first_move),
        "last_move_secs": secs(last_move),
        "longest_pause_between_moves_secs": round1(longest_pause.as_secs_f64()),
        "restored_secs": round1(restored.as_secs_f64()),
        "moves": moves_at_restored as u64,
        "moves_after_restored": moves_after as u64,
        "fewest_ready": fewest.as_ref().map(|(_, n)| *n),
        "fewest_ready_of": fewest.map(|(app, _)| app),
        "at_fewest": at_fewest,
        "pods_created_per_node": created,
        "held_last_seen_secs": held.iter().map(|(r, d)| (r.clone(), round1(d.as_secs_f64()))).collect::<BTreeMap<_, _>>(),
        "replicas": replicas,
        "still_spread_6s_later": still_even,
    }))
}

/// The reasons the descheduler's last round held a workload back for
/// (`tensile_descheduler_rebalance_held`, a gauge per reason).
fn held_reasons(metrics: &str) -> Vec<String> {
    let name = "tensile_descheduler_rebalance_held";
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let reason = series.split("reason=\"").nth(1)?.split('"').next()?;
            (value.parse::<f64>().ok()? > 0.0).then(|| reason.to_owned())
        })
        .collect()
}

/// Whether node `name` reports Ready.
async fn node_ready(nodes: &Api<Node>, name: &str) -> bool {
    let Ok(node) = nodes.get(name).await else {
        return false;
    };
    node.status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Deletes a scene's namespace and waits until its pods are gone from the upper cluster, so
/// the next scene starts on empty virtual nodes.
async fn clear(bed: &Bed, namespace: &str) -> anyhow::Result<()> {
    let up = bed.upper.kubeconfig();
    let out = crate::kubectl::run(up, &["delete", "namespace", namespace, "--wait=false"]).await;
    anyhow::ensure!(out.ok, "kubectl delete namespace {namespace}: {}", out.stderr);
    crate::wait::until(
        &format!("the pods of {namespace} gone"),
        Duration::from_secs(180),
        Duration::from_millis(500),
        || async {
            let out = crate::kubectl::run(up, &["-n", namespace, "get", "pods", "-o", "name"]).await;
            if out.ok && out.stdout.trim().is_empty() {
                Ok(())
            } else {
                Err(format!("{} {}", out.stdout.lines().count(), out.stderr.trim()))
            }
        },
    )
    .await?;
    Ok(())
}

/// Whether `replicas` Ready pods run on vn-a and vn-b together, neither holding more than one
/// more than the other (maxSkew 1).
fn evenly_spread(per_node: &BTreeMap<String, usize>, replicas: usize) -> bool {
    let on = |node: &str| per_node.get(node).copied().unwrap_or(0);
    on("vn-a") + on("vn-b") == replicas && on("vn-a").abs_diff(on("vn-b")) <= 1
}

/// One line of a scene's figures.
fn summary_line(run: &Value) -> String {
    format!(
        "figure: failback, --rebalance-max-owners={}: lower-a back -> vn-a Ready {} s, first move {} s, last move {} s (longest pause {} s), every Deployment evenly spread again in {} s; {} moves ({} after), fewest Ready {} of {}",
        run["max_owners"],
        run["vn_a_ready_secs"],
        run["first_move_secs"],
        run["last_move_secs"],
        run["longest_pause_between_moves_secs"],
        run["restored_secs"],
        run["moves"],
        run["moves_after_restored"],
        run["fewest_ready"],
        run["replicas"],
    )
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
