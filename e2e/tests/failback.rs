//! Failback end to end: a lower cluster whose apiserver was away comes back, and no pod runs
//! twice. While lower-a does not answer, its virtual node turns NotReady and the upper cluster
//! evicts its pods (taint eviction: their Deployment and StatefulSet recreate them on vn-b),
//! and an operator force-deletes the pods that stay stuck; a StatefulSet pod and a bare pod
//! come back under their old names with new UIDs. When lower-a answers again, every lower pod
//! it still runs for an upper pod that is gone, Terminating or replaced must stop within
//! seconds, and nothing else below may be touched. Every assertion is what kubectl shows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use tensile_e2e::TestCluster;
use tensile_e2e::check::{apply, kubectl};
use tensile_e2e::scene;

const NS: &str = "failback";

/// How long lower-a's apiserver stays away at least: long enough for the eviction and the
/// operator's force-deletes, and for the retries of a pod that failed all along to have grown.
const OUTAGE: Duration = Duration::from_secs(90);

/// From lower-a's apiserver answering again to the last stale lower pod gone, at most. What
/// it takes: the virtual node sees the lower cluster answer (probed every second while it does
/// not; the lower pod watch's re-list shows it too), deletes what no upper pod stands for (one
/// call each), and the simulated kubelet, whose watch retries every second, confirms each
/// deletion. Under a second here (all gone by kubectl's first answer); 15 s leaves room for a
/// loaded 2-core machine on which the restarted apiserver, kubectl and three control planes
/// compete. Before, the periodic collection (every `--copy-collection-delay`, up to 30 s) and
/// per-pod retries that had doubled through the outage took 29 to 31 s.
const BOUND: Duration = Duration::from_secs(15);

/// Every pod template here tolerates the virtual node's taint, goes to a node of the pool,
/// and leaves a NotReady node after 2 s instead of the default 300 s.
const TEMPLATE: &str = r#"
      nodeSelector: {failback: pool}
      tolerations:
      - {key: virtual-kubelet.io/provider, operator: Exists}
      - {key: node.kubernetes.io/not-ready, operator: Exists, effect: NoExecute, tolerationSeconds: 2}
      - {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 2}
      containers: [{name: app, image: nginx}]"#;

fn web() -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: {NS}}}
spec:
  replicas: 3
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:{TEMPLATE}
"#
    )
}

fn db() -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: db, namespace: {NS}}}
spec:
  replicas: 1
  serviceName: db
  selector: {{matchLabels: {{app: db}}}}
  template:
    metadata: {{labels: {{app: db}}}}
    spec:{TEMPLATE}
"#
    )
}

/// A pod bound to vn-a by name that stays there whatever the node's state, as a DaemonSet's
/// pod does.
fn pinned(name: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  nodeName: vn-a
  tolerations: [{{operator: Exists}}]
  containers: [{{name: app, image: nginx}}]
"#
    )
}

/// One pod as kubectl lists it.
#[derive(Clone, Debug)]
struct Row {
    name: String,
    uid: String,
    node: String,
    /// `tensile.io/upper-uid` (lower pods).
    upper_uid: String,
    terminating: bool,
    phase: String,
}

const ROWS: &str = r#"jsonpath={range .items[*]}{.metadata.name}{"\t"}{.metadata.uid}{"\t"}{.spec.nodeName}{"\t"}{.metadata.labels.tensile\.io/upper-uid}{"\t"}{.metadata.deletionTimestamp}{"\t"}{.status.phase}{"\n"}{end}"#;

/// The pods of the namespace, or kubectl's complaint (lower-a may not answer yet).
async fn rows(kubeconfig: &Path) -> Result<Vec<Row>, String> {
    let out = tensile_e2e::kubectl::run(kubeconfig, &["-n", NS, "get", "pods", "-o", ROWS]).await;
    if !out.ok {
        return Err(out.stderr.trim().to_owned());
    }
    Ok(out
        .stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            let field = |i: usize| f.get(i).copied().unwrap_or_default().to_owned();
            Row {
                name: field(0),
                uid: field(1),
                node: field(2),
                upper_uid: field(3),
                terminating: !field(4).is_empty(),
                phase: field(5),
            }
        })
        .collect())
}

async fn must_rows(kubeconfig: &Path) -> Vec<Row> {
    rows(kubeconfig)
        .await
        .unwrap_or_else(|e| panic!("kubectl get pods: {e}"))
}

/// Waits until `test` holds on the namespace's pods in `kubeconfig`'s cluster.
async fn until_pods(kubeconfig: &Path, what: &str, secs: u64, test: impl Fn(&[Row]) -> bool) {
    tensile_e2e::wait::must(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(300),
        || async {
            let rows = rows(kubeconfig).await?;
            if test(&rows) {
                Ok(())
            } else {
                Err(format!("{rows:#?}"))
            }
        },
    )
    .await
}

fn running_on(rows: &[Row], prefix: &str, node: &str) -> usize {
    rows.iter()
        .filter(|r| r.name.starts_with(prefix) && r.node == node && !r.terminating && r.phase == "Running")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_pod_runs_twice_after_a_lower_cluster_comes_back() {
    let [upper, lower_a, lower_b] = scene::clusters("failback", ["upper", "lower-a", "lower-b"])
        .await
        .unwrap();
    let (sim_a, sim_b) = tokio::join!(
        scene::simulate(&lower_a, scene::nodes("lower-a", 2)),
        scene::simulate(&lower_b, scene::nodes("lower-b", 2)),
    );
    let (_sim_a, _sim_b) = (sim_a.unwrap(), sim_b.unwrap());
    let up = upper.kubeconfig();
    let low_a = lower_a.kubeconfig();
    let start = |name: &str, lower: &TestCluster| {
        scene::virtual_node(&upper, name, lower, |args| {
            args.node_labels = vec![("failback".into(), "pool".into())]
        })
        .unwrap()
    };

    // Everything runs on vn-a first: vn-b joins only once it does.
    let _vn_a = start("vn-a", &lower_a);
    scene::node_ready(up, "vn-a", 90).await;
    upper.create_namespace(NS).await.unwrap();
    for manifest in [web(), db(), pinned("solo"), pinned("keeper")] {
        apply(up, &manifest).await;
    }
    until_pods(up, "web, db-0, solo and keeper Running on vn-a", 90, |rows| {
        running_on(rows, "web-", "vn-a") == 3
            && ["db-0", "solo", "keeper"]
                .iter()
                .all(|n| running_on(rows, n, "vn-a") == 1)
    })
    .await;
    until_pods(low_a, "six lower pods Running in lower-a", 60, |rows| {
        rows.iter()
            .filter(|r| r.phase == "Running" && !r.upper_uid.is_empty())
            .count()
            == 6
    })
    .await;
    // A pod of the lower cluster's own in the same namespace: never ours to delete.
    kubectl(
        low_a,
        &["-n", NS, "run", "bystander", "--image=nginx", "--restart=Never"],
    )
    .await;
    until_pods(low_a, "the bystander Running", 60, |rows| {
        rows.iter().any(|r| r.name == "bystander" && r.phase == "Running")
    })
    .await;
    let before: BTreeMap<String, Row> = must_rows(low_a)
        .await
        .into_iter()
        .map(|r| (r.name.clone(), r))
        .collect();
    let upper_before = must_rows(up).await;
    let uid_of = |rows: &[Row], name: &str| {
        rows.iter()
            .find(|r| r.name == name)
            .map(|r| r.uid.clone())
            .unwrap()
    };
    let keeper_uid = uid_of(&upper_before, "keeper");
    let _vn_b = start("vn-b", &lower_b);
    scene::node_ready(up, "vn-b", 90).await;

    // The outage.
    lower_a.stop_apiserver();
    let stopped = Instant::now();
    scene::node_shows(up, "vn-a", scene::READY, "False", 90).await;
    println!(
        "vn-a NotReady {:?} after lower-a's apiserver stopped",
        stopped.elapsed()
    );
    // Taint eviction: vn-a's Deployment and StatefulSet pods are Terminating (nothing below
    // confirms them) and the Deployment runs three more on vn-b.
    until_pods(
        up,
        "web and db-0 evicted from vn-a, web replaced on vn-b",
        90,
        |rows| {
            let evicted = rows
                .iter()
                .filter(|r| {
                    r.node == "vn-a" && r.terminating && (r.name.starts_with("web-") || r.name == "db-0")
                })
                .count();
            evicted == 4 && running_on(rows, "web-", "vn-b") == 3
        },
    )
    .await;
    // The operator: db-0 stays stuck Terminating, so the StatefulSet waits; one web pod too.
    let rows_now = must_rows(up).await;
    let stuck_web = rows_now
        .iter()
        .find(|r| r.name.starts_with("web-") && r.node == "vn-a")
        .map(|r| r.name.clone())
        .unwrap();
    for pod in ["db-0", stuck_web.as_str(), "solo"] {
        kubectl(
            up,
            &["-n", NS, "delete", "pod", pod, "--force", "--grace-period=0"],
        )
        .await;
    }
    // The StatefulSet recreates db-0 under its name, on vn-b; solo is recreated on vn-a.
    apply(up, &pinned("solo")).await;
    until_pods(up, "db-0 Running on vn-b", 90, |rows| {
        running_on(rows, "db-0", "vn-b") == 1
    })
    .await;
    let upper_during = must_rows(up).await;
    let new_solo_uid = uid_of(&upper_during, "solo");
    assert_ne!(
        new_solo_uid,
        uid_of(&upper_before, "solo"),
        "solo came back as a new pod"
    );
    // What lower-a still runs that no live upper pod of vn-a stands for.
    let live_on_a: BTreeSet<String> = upper_during
        .iter()
        .filter(|r| r.node == "vn-a" && !r.terminating)
        .map(|r| r.uid.clone())
        .collect();
    let stale: BTreeMap<String, String> = before
        .values()
        .filter(|r| !r.upper_uid.is_empty() && !live_on_a.contains(&r.upper_uid))
        .map(|r| (r.uid.clone(), r.name.clone()))
        .collect();
    assert_eq!(
        stale.len(),
        5,
        "three web pods (two Terminating, one force-deleted), db-0 and the first solo: {stale:?}"
    );
    if let Some(rest) = OUTAGE.checked_sub(stopped.elapsed()) {
        tokio::time::sleep(rest).await;
    }

    // lower-a answers again: how long until none of the stale pods is left below?
    lower_a.start_apiserver().await.unwrap();
    let back = Instant::now();
    println!(
        "lower-a's apiserver back after an outage of {:?}",
        stopped.elapsed()
    );
    let mut deleting: BTreeMap<String, Duration> = BTreeMap::new();
    let mut gone: BTreeMap<String, Duration> = BTreeMap::new();
    while gone.len() < stale.len() && back.elapsed() < Duration::from_secs(180) {
        if let Ok(rows) = rows(low_a).await {
            let at = back.elapsed();
            for (uid, name) in &stale {
                match rows.iter().find(|r| &r.uid == uid) {
                    Some(r) if r.terminating => {
                        deleting.entry(name.clone()).or_insert(at);
                    }
                    Some(_) => {}
                    None => {
                        deleting.entry(name.clone()).or_insert(at);
                        gone.entry(name.clone()).or_insert(at);
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let last = gone.values().max().copied().unwrap_or(Duration::MAX);
    let show = |m: &BTreeMap<String, Duration>| {
        m.iter()
            .map(|(name, d)| format!("{name} {:.1} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "figure: the last of {} stale lower pods gone from lower-a {:.1} s after its apiserver was back \
         (deleted: {}; gone: {})",
        stale.len(),
        last.as_secs_f64(),
        show(&deleting),
        show(&gone)
    );
    assert_eq!(
        gone.len(),
        stale.len(),
        "stale lower pods left in lower-a: {stale:?}, gone: {gone:?}"
    );
    assert!(
        last <= BOUND,
        "the last stale lower pod went {last:?} after lower-a was back (at most {BOUND:?})"
    );

    // Nothing else below was touched: keeper's lower pod is the one from before, and the
    // lower cluster's own pod runs on.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = must_rows(low_a).await;
    for name in ["keeper", "bystander"] {
        let now = after.iter().find(|r| r.name == name && !r.terminating);
        assert_eq!(
            now.map(|r| r.uid.as_str()),
            Some(before[name].uid.as_str()),
            "{name}'s pod in lower-a is untouched: {after:#?}"
        );
    }
    // The new solo runs below, and each pod runs once: lower-a for vn-a's live pods, lower-b
    // for the rest.
    until_pods(low_a, "solo's new pod Running in lower-a", 60, |rows| {
        rows.iter()
            .any(|r| r.name == "solo" && r.upper_uid == new_solo_uid && r.phase == "Running")
    })
    .await;
    let ours_a: BTreeSet<String> = must_rows(low_a)
        .await
        .into_iter()
        .filter(|r| !r.upper_uid.is_empty())
        .map(|r| r.upper_uid)
        .collect();
    assert_eq!(
        ours_a,
        BTreeSet::from([keeper_uid, new_solo_uid]),
        "lower-a runs only keeper and the new solo"
    );
    // The Terminating upper pods are released once their lower pods are gone.
    until_pods(up, "no pod of vn-a left Terminating", 60, |rows| {
        !rows.iter().any(|r| r.node == "vn-a" && r.terminating)
    })
    .await;
    let upper_after = must_rows(up).await;
    let on_b: BTreeSet<String> = upper_after
        .iter()
        .filter(|r| r.node == "vn-b")
        .map(|r| r.uid.clone())
        .collect();
    until_pods(
        lower_b.kubeconfig(),
        "lower-b runs vn-b's four pods",
        60,
        |rows| {
            let below: BTreeSet<String> = rows
                .iter()
                .filter(|r| r.phase == "Running")
                .map(|r| r.upper_uid.clone())
                .collect();
            below == on_b
        },
    )
    .await;
}
