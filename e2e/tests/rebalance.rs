//! Failback end to end: an upper cluster, lower-a and lower-b (simulated nodes of 8 CPUs),
//! a virtual node over each (in process), and the `descheduler` binary with `--rebalance`.
//! A spread Deployment and one that prefers vn-a run; lower-a's apiserver stops until their
//! pods run on vn-b, then starts again; the test watches, with kubectl, the spread and the
//! preference come back within the budget, and nothing move afterwards.
//!
//! The other scenes run on beds of their own (`tensile_e2e::failback::Bed`): a workload whose
//! spread constraint has no `labelSelector` is not moved (kube-scheduler counts no pod for
//! it); and a workload refused by lower-a's ResourceQuota after a rebalance toward vn-a is
//! moved there once, not again when the exclusion and the cool-down end, nor after the
//! descheduler restarts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tensile_e2e::TestCluster;
use tensile_e2e::check::{apply, kubectl};
use tensile_e2e::descheduler::{DeschedulerProcess, metric_sum};
use tensile_e2e::scene;
use tensile_e2e::wait::within;

/// Label of this bed's virtual nodes.
const VN_KEY: &str = "tensile-e2e-vn";
const NS: &str = "failback";

async fn pods(up: &Path, selector: &str) -> Vec<Value> {
    let out = kubectl(up, &["-n", NS, "get", "pods", "-l", selector, "-o", "json"]).await;
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

fn node_of(p: &Value) -> &str {
    p["spec"]["nodeName"].as_str().unwrap_or_default()
}

fn ready(p: &Value) -> bool {
    p["metadata"]["deletionTimestamp"].is_null()
        && p["status"]["phase"] == "Running"
        && p["status"]["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// Ready pods of `app` per node.
async fn spread(up: &Path, app: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for p in pods(up, &format!("app={app}")).await.iter().filter(|p| ready(p)) {
        *out.entry(node_of(p).to_owned()).or_default() += 1;
    }
    out
}

/// `kubectl get pods --watch` of the namespace: every change as kubectl shows it, so the
/// fewest Ready pods of each app at any moment are known, not only at samples.
struct ReadyWatch {
    child: std::process::Child,
    /// The fewest Ready pods per app seen since [`ReadyWatch::reset`].
    lowest: std::sync::Arc<std::sync::Mutex<BTreeMap<String, usize>>>,
}

impl ReadyWatch {
    fn start(up: &Path) -> ReadyWatch {
        let mut child = std::process::Command::new(tensile_e2e::kubectl::binary_for(up))
            .arg("--kubeconfig")
            .arg(up)
            .args([
                "-n",
                NS,
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
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let lowest = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let seen = lowest.clone();
        std::thread::spawn(move || {
            let mut pods: BTreeMap<String, (String, bool)> = BTreeMap::new();
            for event in serde_json::Deserializer::from_reader(stdout).into_iter::<Value>() {
                let Ok(event) = event else { return };
                let p = &event["object"];
                let uid = p["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
                let app = p["metadata"]["labels"]["app"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                if event["type"] == "DELETED" {
                    pods.remove(&uid);
                } else {
                    pods.insert(uid, (app, ready(p)));
                }
                let mut now: BTreeMap<String, usize> = BTreeMap::new();
                for (app, ready) in pods.values() {
                    *now.entry(app.clone()).or_default() += usize::from(*ready);
                }
                let mut lowest = seen.lock().unwrap();
                for (app, n) in now {
                    let l = lowest.entry(app).or_insert(usize::MAX);
                    *l = (*l).min(n);
                }
            }
        });
        ReadyWatch { child, lowest }
    }

    fn reset(&self) {
        self.lowest.lock().unwrap().clear();
    }

    fn lowest(&self, app: &str) -> usize {
        self.lowest
            .lock()
            .unwrap()
            .get(app)
            .copied()
            .unwrap_or(usize::MAX)
    }
}

impl Drop for ReadyWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Deployment of `replicas` opted-in pods on this bed's virtual nodes, evicted 5 s after
/// their node turns NotReady or unreachable, with `extra` merged into the pod spec.
fn deployment(name: &str, replicas: u32, extra: Value) -> String {
    let mut spec = json!({
        "terminationGracePeriodSeconds": 2,
        "nodeSelector": {"type": "virtual-kubelet", VN_KEY: NS},
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
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name, "virtual-pod": "true"}}, "spec": spec}},
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_lower_a_recovers_its_workloads_return_within_the_budget_and_then_stay() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let [upper, lower_a, lower_b] = scene::clusters("rebalance", ["upper", "lower-a", "lower-b"])
        .await
        .unwrap();
    let up = upper.kubeconfig().to_owned();
    tensile_e2e::chart::install_exclusion_records(&up).await.unwrap();
    let mut sims = Vec::new();
    for lower in [&lower_a, &lower_b] {
        let nodes = scene::nodes(lower.name(), 2)
            .into_iter()
            .map(|node| node.resource("cpu", "8").resource("memory", "16Gi"))
            .collect();
        sims.push(scene::simulate(lower, nodes).await.unwrap());
    }
    let node = |name: &str, lower: &TestCluster| {
        scene::virtual_node(&upper, name, lower, |args| {
            args.node_labels = vec![(VN_KEY.to_owned(), NS.to_owned())]
        })
        .unwrap()
    };
    let _nodes = [node("vn-a", &lower_a), node("vn-b", &lower_b)];
    for vn in ["vn-a", "vn-b"] {
        scene::node_ready(&up, vn, 60).await;
    }
    upper.create_namespace(NS).await.unwrap();

    // Four replicas spread over the virtual nodes (ScheduleAnyway), two that prefer vn-a.
    apply(
        &up,
        &deployment(
            "spread",
            4,
            json!({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"app": "spread"}}}]}),
        ),
    )
    .await;
    apply(
        &up,
        &deployment(
            "prefer",
            2,
            json!({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": {"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["vn-a"]}]}}]}}}),
        ),
    )
    .await;
    // Two more that prefer vn-a, whose PodDisruptionBudget allows no eviction: they stay
    // where they are, and do not hold the others back.
    apply(
        &up,
        &deployment(
            "guarded",
            2,
            json!({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": {"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["vn-a"]}]}}]}}}),
        ),
    )
    .await;
    apply(
        &up,
        &json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "guarded", "namespace": NS},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}}})
        .to_string(),
    )
    .await;
    let balanced = |s: &BTreeMap<String, usize>, p: &BTreeMap<String, usize>| {
        s.get("vn-a") == Some(&2) && s.get("vn-b") == Some(&2) && p.get("vn-a") == Some(&2)
    };
    within(
        "the first placement: 2 + 2 spread, both preferring pods on vn-a",
        90,
        || async {
            let (s, p) = (spread(&up, "spread").await, spread(&up, "prefer").await);
            if balanced(&s, &p) {
                Ok(())
            } else {
                Err(format!("spread {s:?}, prefer {p:?}"))
            }
        },
    )
    .await;

    // Both deschedulers run under the account the chart renders for release `failback` in
    // this namespace (bare pods off, as the chart's default), as the chart passes them.
    let identity = tensile_e2e::descheduler::chart_identity(&upper, NS, "off")
        .await
        .unwrap();
    let descheduler = DeschedulerProcess::start_as(
        &upper,
        &identity,
        &[
            format!("--node-selector=type=virtual-kubelet,{VN_KEY}={NS}"),
            format!("--exclusions-configmap={NS}/{NS}-tensile-exclusions"),
            "--bare-pods=off".to_owned(),
            "--descheduling-interval=2s".to_owned(),
            "--rebalance".to_owned(),
            // Longer than the lower control plane's node-monitor grace period (40 s): after its
            // restart, lower-a's node controller still trusts its nodes' last heartbeats for
            // that long, so its shape may say "fits" before its nodes are known Ready again.
            "--rebalance-stabilization=45".to_owned(),
            "--rebalance-cooldown=120".to_owned(),
        ],
        "rebalance",
    )
    .unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();
    // The same, in dry run, alongside: it says what it would move and touches nothing.
    let dry = DeschedulerProcess::start_as(
        &upper,
        &identity,
        &[
            format!("--node-selector=type=virtual-kubelet,{VN_KEY}={NS}"),
            format!("--exclusions-configmap={NS}/{NS}-tensile-exclusions"),
            "--bare-pods=off".to_owned(),
            "--descheduling-interval=2s".to_owned(),
            "--rebalance".to_owned(),
            "--rebalance-stabilization=45".to_owned(),
            "--dry-run".to_owned(),
        ],
        "rebalance-dry-run",
    )
    .unwrap();
    dry.wait_ready(Duration::from_secs(30)).await.unwrap();

    // Lower-a goes away: its pods are evicted upstream and their replacements run on vn-b.
    lower_a.stop_apiserver();
    within("every Ready pod on vn-b", 120, || async {
        let (s, p) = (spread(&up, "spread").await, spread(&up, "prefer").await);
        let g = spread(&up, "guarded").await;
        if s.get("vn-b") == Some(&4) && p.get("vn-b") == Some(&2) && g.get("vn-b") == Some(&2) {
            Ok(())
        } else {
            Err(format!("spread {s:?}, prefer {p:?}"))
        }
    })
    .await;

    // Lower-a comes back.
    let watch = ReadyWatch::start(&up);
    tokio::time::sleep(Duration::from_secs(1)).await;
    watch.reset();
    lower_a.start_apiserver().await.unwrap();
    let back = Instant::now();
    let back_at = jiff::Timestamp::now();
    let mut stale_gone = None;
    let deadline = Duration::from_secs(180);
    loop {
        let (s, p) = (spread(&up, "spread").await, spread(&up, "prefer").await);
        if stale_gone.is_none() {
            // Lower-a may refuse connections for a moment after its start.
            let out = lower_a.kubectl(&["-n", NS, "get", "pods", "-o", "name"]).await;
            if out.ok && out.stdout.trim().is_empty() {
                stale_gone = Some(back.elapsed());
            }
        }
        if balanced(&s, &p) {
            break;
        }
        assert!(
            back.elapsed() < deadline,
            "not rebalanced {deadline:?} after lower-a came back: spread {s:?}, prefer {p:?}\n{}",
            descheduler.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let restored = back.elapsed();
    let (lowest_spread, lowest_prefer) = (watch.lowest("spread"), watch.lowest("prefer"));
    assert!(
        lowest_spread >= 3 && lowest_prefer >= 1,
        "at most one pod of a workload unavailable: lowest Ready spread {lowest_spread}/4, prefer {lowest_prefer}/2"
    );
    let m = descheduler.metrics().await;
    let moved = |reason: &str| {
        metric_sum(
            &m,
            "tensile_descheduler_pods_rebalanced_total",
            &[("reason", reason), ("result", "success")],
        )
    };
    assert_eq!((moved("spread"), moved("preferred")), (2.0, 2.0), "{m}");
    let guarded = spread(&up, "guarded").await;
    assert_eq!(
        guarded.get("vn-b"),
        Some(&2),
        "the guarded pods stay: {guarded:?}"
    );
    // The guarded workload's turn comes once the others are done: its eviction is refused.
    within(
        "the guarded workload's eviction refused and counted",
        60,
        || async {
            let m = descheduler.metrics().await;
            let refused = |result: &str| {
                metric_sum(
                    &m,
                    "tensile_descheduler_pods_rebalanced_total",
                    &[("reason", "preferred"), ("result", result)],
                )
            };
            if refused("limited") >= 1.0 {
                Ok(())
            } else {
                Err(format!(
                    "limited {}, error {}",
                    refused("limited"),
                    refused("error")
                ))
            }
        },
    )
    .await;
    let guarded = spread(&up, "guarded").await;
    assert_eq!(
        guarded.get("vn-b"),
        Some(&2),
        "the guarded pods stay: {guarded:?}"
    );
    let events = kubectl(
        &up,
        &[
            "-n",
            NS,
            "get",
            "events",
            "--field-selector",
            "reason=Rebalanced",
            "-o",
            "json",
        ],
    )
    .await;
    let events: Value = serde_json::from_str(&events).unwrap();
    assert_eq!(
        events["items"].as_array().map(Vec::len),
        Some(4),
        "one event per move, none for the guarded pods: {events}"
    );
    let mut moved_at: Vec<f64> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["firstTimestamp"].as_str().or(e["eventTime"].as_str()))
        .filter_map(|t| t.parse::<jiff::Timestamp>().ok())
        .map(|t| t.duration_since(back_at).as_secs_f64())
        .collect();
    moved_at.sort_by(f64::total_cmp);
    // Nothing moves afterwards (the cool-down is 120 s).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let after = descheduler.metrics().await;
    let total = |m: &str| {
        metric_sum(
            m,
            "tensile_descheduler_pods_rebalanced_total",
            &[("result", "success")],
        )
    };
    assert_eq!(total(&after), total(&m), "{after}");
    // The dry run reported moves and made none: the four events and moves are the other
    // descheduler's.
    let d = dry.metrics().await;
    let would = metric_sum(
        &d,
        "tensile_descheduler_pods_rebalanced_total",
        &[("result", "dry_run")],
    );
    assert!(would >= 1.0, "the dry run says what it would move: {d}");
    assert_eq!(total(&d), 0.0, "{d}");
    assert!(dry.log().contains("dry run: would rebalance"), "{}", dry.log());
    let (s, p) = (spread(&up, "spread").await, spread(&up, "prefer").await);
    assert!(balanced(&s, &p), "still balanced: spread {s:?}, prefer {p:?}");
    for d in [&descheduler, &dry] {
        let log = tensile_e2e::process::log_tail(d.log_path(), 4_000_000);
        let denied = tensile_e2e::chart::denied_calls(&log);
        assert!(denied.is_empty(), "refused under the chart's account: {denied:?}");
    }
    println!(
        "figure: failback, lower-a back -> stale lower pods gone {}, first move at {:.1} s, last at {:.1} s, spread and preference restored in {:.1} s (stabilization 45 s; 4 moves, one workload at a time; fewest Ready {lowest_spread}/4 and {lowest_prefer}/2)",
        stale_gone.map_or("not seen".to_owned(), |d| format!("in {:.1} s", d.as_secs_f64())),
        moved_at.first().copied().unwrap_or_default(),
        moved_at.last().copied().unwrap_or_default(),
        restored.as_secs_f64()
    );
    drop(sims);
}

/// The in-process webhook for namespace `ns` (labelled `tensile-e2e=<ns>`), reading the
/// records of `exclusions`: a replacement avoids the virtual nodes excluded for its workload.
async fn webhook(upper: &TestCluster, ns: &str, exclusions: &str) -> tensile_webhook::Running {
    use tensile_webhook::Policy;
    scene::opt_in_namespace(upper.kubeconfig(), ns).await;
    let port = tensile_e2e::free_port().unwrap();
    let config = format!("tensile-webhook-{ns}");
    apply(
        upper.kubeconfig(),
        &tensile_e2e::check::webhook_registration(
            &config,
            port,
            tensile_e2e::check::Namespaces::Labelled(ns),
            None,
        ),
    )
    .await;
    let mut options = scene::webhook_options(port);
    options.client = Some(upper.client().await.unwrap());
    options.webhook_config_name = Some(config);
    options.policy = Policy {
        ignore_selector_keys: [VN_KEY.to_owned(), "type".to_owned()].into(),
        not_ready_seconds: 5,
        unreachable_seconds: 5,
        ..Policy::default()
    };
    options.exclusions = Some(exclusions.parse().unwrap());
    let running = tensile_webhook::start(options).await.unwrap();
    scene::webhook_ready(&running).await;
    running
}

/// Rebalanced events in `ns` whose message names `owner` (each event counted as often as
/// it happened).
async fn rebalanced(up: &Path, ns: &str, owner: &str) -> u64 {
    let out = kubectl(
        up,
        &[
            "-n",
            ns,
            "get",
            "events",
            "--field-selector",
            "reason=Rebalanced",
            "-o",
            "json",
        ],
    )
    .await;
    let events: Value = serde_json::from_str(&out).unwrap();
    events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["message"].as_str().unwrap_or_default().contains(owner))
        .map(|e| e["count"].as_u64().or(e["series"]["count"].as_u64()).unwrap_or(1))
        .sum()
}

/// Each pod of `ns` in one line: name, node, phase and the conditions that are not True.
async fn pod_lines(up: &Path, ns: &str) -> String {
    let out = kubectl(up, &["-n", ns, "get", "pods", "-o", "json"]).await;
    let list: Value = serde_json::from_str(&out).unwrap();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let bad: Vec<String> = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|c| c["status"] != "True")
                .map(|c| format!("{}={} {} {}", c["type"], c["status"], c["reason"], c["message"]))
                .collect();
            format!(
                "{} on {} {} {:?}",
                p["metadata"]["name"], p["spec"]["nodeName"], p["status"]["phase"], bad
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_refused_below_after_a_rebalance_is_not_moved_there_again_even_after_a_restart() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    const Q: &str = "refused";
    let bed = tensile_e2e::failback::Bed::start("rebalance-refused", Q, 2)
        .await
        .unwrap();
    let up = bed.upper.kubeconfig().to_owned();
    bed.upper.create_namespace(Q).await.unwrap();
    let records = format!("{Q}/exclusions");
    let _webhook = webhook(&bed.upper, Q, &records).await;
    apply(
        &up,
        &bed.deployment(Q, "web", 2, tensile_e2e::failback::spread_over_nodes("web")),
    )
    .await;
    let per_node = || async {
        tensile_e2e::failback::ready_per_node(&up, Q, "web")
            .await
            .unwrap()
    };
    within("one pod on each virtual node", 90, || async {
        let s = per_node().await;
        if s.get("vn-a") == Some(&1) && s.get("vn-b") == Some(&1) {
            Ok(())
        } else {
            Err(format!("{s:?}\n{}", pod_lines(&up, Q).await))
        }
    })
    .await;
    // The exclusions last 15 s and the cool-down 5 s: without a memory of the refusal, the
    // workload would be moved toward vn-a again about every 25 s.
    let flags = [
        "--unschedulable-threshold=2".to_owned(),
        "--exclusion-ttl=15".to_owned(),
        "--rebalance-cooldown=5".to_owned(),
    ];
    let mut descheduler = bed.descheduler(Q, &flags, "refused").unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();

    // Lower-a goes away; both pods run on vn-b.
    bed.lower_a.stop_apiserver();
    within("both pods on vn-b", 120, || async {
        let s = per_node().await;
        if s.get("vn-b") == Some(&2) {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
    // Lower-a comes back with a quota that admits no more pods in the namespace: a thing
    // the capacity shape cannot see.
    bed.lower_a.start_apiserver().await.unwrap();
    let quota = json!({"apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "none", "namespace": Q}, "spec": {"hard": {"pods": "0"}}})
    .to_string();
    apply(bed.lower_a.kubeconfig(), &quota).await;

    // The rebalance toward vn-a is refused there, and the pod moved back to vn-b.
    within(
        "a rebalance toward vn-a refused by lower-a's quota",
        120,
        || async {
            let moved = kubectl(
                &up,
                &[
                    "-n",
                    Q,
                    "get",
                    "events",
                    "--field-selector",
                    "reason=Descheduled",
                    "-o",
                    "json",
                ],
            )
            .await;
            if rebalanced(&up, Q, "ReplicaSet/web").await >= 1 && moved.contains("quota") {
                Ok(())
            } else {
                Err(format!(
                    "rebalanced {}, {moved}",
                    rebalanced(&up, Q, "ReplicaSet/web").await
                ))
            }
        },
    )
    .await;
    // Four exclusion lifetimes: the workload is not rebalanced toward vn-a again.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let before_restart = rebalanced(&up, Q, "ReplicaSet/web").await;
    // Nor after the descheduler restarts, its memory gone.
    descheduler.signal("KILL").unwrap();
    descheduler.restart().unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(45)).await;
    let after_restart = rebalanced(&up, Q, "ReplicaSet/web").await;
    assert_eq!(
        (before_restart, after_restart),
        (1, 1),
        "rebalanced toward the refusing node once, before the restart and after it\n{}",
        descheduler.log()
    );
    let s = per_node().await;
    assert_eq!(s.get("vn-b"), Some(&2), "both pods run on vn-b: {s:?}");
    assert!(
        descheduler.log().contains("refused"),
        "the descheduler says why the workload stays: {}",
        descheduler.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spread_constraint_without_a_label_selector_counts_no_pod_so_nothing_moves_for_it() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    const S: &str = "selector";
    let bed = tensile_e2e::failback::Bed::start("rebalance-selector", S, 2)
        .await
        .unwrap();
    let up = bed.upper.kubeconfig().to_owned();
    bed.upper.create_namespace(S).await.unwrap();
    // Every pod lands on vn-b while vn-a is cordoned.
    kubectl(&up, &["cordon", "vn-a"]).await;
    let unselected = json!({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway"}]});
    apply(&up, &bed.deployment(S, "unselected", 2, unselected)).await;
    apply(
        &up,
        &bed.deployment(
            S,
            "selected",
            2,
            tensile_e2e::failback::spread_over_nodes("selected"),
        ),
    )
    .await;
    within("all four pods on vn-b", 90, || async {
        let (u, s) = (
            tensile_e2e::failback::ready_per_node(&up, S, "unselected")
                .await
                .unwrap(),
            tensile_e2e::failback::ready_per_node(&up, S, "selected")
                .await
                .unwrap(),
        );
        if u.get("vn-b") == Some(&2) && s.get("vn-b") == Some(&2) {
            Ok(())
        } else {
            Err(format!("unselected {u:?}, selected {s:?}"))
        }
    })
    .await;
    kubectl(&up, &["uncordon", "vn-a"]).await;
    let descheduler = bed
        .descheduler(S, &["--rebalance-max-owners=2".to_owned()], "selector")
        .unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();
    // The selected workload is spread 1 + 1 (kube-scheduler counts its pods)…
    within("the selected workload spread over both nodes", 90, || async {
        let s = tensile_e2e::failback::ready_per_node(&up, S, "selected")
            .await
            .unwrap();
        if s.get("vn-a") == Some(&1) && s.get("vn-b") == Some(&1) {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
    // …and the one without a selector stays: kube-scheduler counts no pod for it, so its
    // skew is 0.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let u = tensile_e2e::failback::ready_per_node(&up, S, "unselected")
        .await
        .unwrap();
    assert_eq!(u.get("vn-b"), Some(&2), "{u:?}\n{}", descheduler.log());
    assert_eq!(rebalanced(&up, S, "unselected").await, 0, "{}", descheduler.log());
    assert_eq!(
        rebalanced(&up, S, "ReplicaSet/selected").await,
        1,
        "{}",
        descheduler.log()
    );
}
