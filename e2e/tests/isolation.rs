//! Another tenant below, and a lower admin who cordons: an upper cluster, a lower cluster
//! with simulated kubelets that other tenants share, and a virtual node in process. Nothing
//! of another tenant's pod is reachable from above, nothing is written below for a pod that
//! is refused, only what upper pods name travels, and cordoned lower nodes take room away
//! without turning the node NotReady.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::Path;
use std::time::{Duration, Instant};

use tensile_e2e::check::{apply, eventually, kubectl};
use tensile_e2e::in_process;
use tensile_e2e::shared::Shared;
use tensile_e2e::streams::{Via, kubectl_run};
use tensile_e2e::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};
use tensile_virtual_node::Controllers;

struct Bed {
    upper: TestCluster,
    lower: TestCluster,
    _sim: NodeSimulator,
    _node: in_process::VirtualNode,
}

static BED: Shared<Bed> = Shared::new();

const NODE: &str = "vn-iso";
/// Lower namespaces other tenants use too, listed in `--shared-namespaces`.
const SHARED: &str = "shared";
const INJECTED: &str = "injected";

fn bed() -> &'static Bed {
    BED.get(|| async {
        let (upper, lower) = tokio::join!(
            TestCluster::start(ClusterOptions::new("isolation", "upper")),
            TestCluster::start(ClusterOptions {
                audit_writes: true,
                ..ClusterOptions::new("isolation", "lower")
            }),
        );
        let (upper, lower) = (upper?, lower?);
        let sim = NodeSimulator::start(
            lower.client().await?,
            SimulatorOptions::new("lower", Some(lower.kubelet_client_ca_pem())),
            vec![NodeConfig::new("low-0"), NodeConfig::new("low-1")],
        )
        .await?;
        let mut args =
            in_process::options(&upper, NODE, &lower).map_err(|e| tensile_e2e::Error::Cluster {
                cluster: NODE.into(),
                message: e.to_string(),
            })?;
        args.reflection.shared_namespaces = vec![SHARED.into(), INJECTED.into()];
        args.reflection.enable_controllers = vec![Controllers::Services];
        args.reflection.copy_collection_delay = 1;
        let node = in_process::VirtualNode::run(args);
        Ok(Bed {
            upper,
            lower,
            _sim: sim,
            _node: node,
        })
    })
    .unwrap_or_else(|e| panic!("shared test bed: {e}"))
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

fn low() -> &'static Path {
    bed().lower.kubeconfig()
}

async fn wait_ready(kubeconfig: &Path, node: &str) {
    eventually(
        kubeconfig,
        &format!("{node} Ready"),
        60,
        &["get", "node", node, "-o", READY],
        "True",
    )
    .await;
}

const READY: &str = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;
const SYNCED_REASON: &str = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].reason}"#;

/// An upper pod bound to `node` by hand (`spec.nodeName`), mounting ConfigMap `config`.
fn bound_pod(ns: &str, name: &str, node: &str, config: Option<&str>) -> String {
    let volumes = config
        .map(|c| format!("  volumes: [{{name: cfg, configMap: {{name: {c}}}}}]\n"))
        .unwrap_or_default();
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeName: {node}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: busybox}}]
{volumes}"#
    )
}

/// Whether `kind/name` exists in lower namespace `ns`.
async fn exists_below(ns: &str, kind: &str, name: &str) -> bool {
    let out = tensile_e2e::kubectl::run(low(), &["-n", ns, "get", kind, name, "-o", "name"]).await;
    if !out.ok && !out.stderr.contains("NotFound") {
        panic!("kubectl get {kind} {name}: {}", out.stderr);
    }
    out.ok
}

async fn running(kubeconfig: &Path, ns: &str, name: &str) {
    eventually(
        kubeconfig,
        &format!("{ns}/{name} Running"),
        90,
        &["-n", ns, "get", "pod", name, "-o", "jsonpath={.status.phase}"],
        "Running",
    )
    .await;
}

/// A pod named like another tenant's lower pod, bound to the node by hand, is refused below
/// as a conflict, and then reaches nothing of that pod: exec and logs answer as a kubelet
/// does for a pod it does not run, the node's usage lists no such pod, and no copy of what
/// the upper pod references was written below.
#[tokio::test]
async fn an_upper_pod_named_like_another_tenants_lower_pod_reaches_nothing_of_it() {
    let bed = bed();
    wait_ready(up(), NODE).await;
    bed.lower.create_namespace(SHARED).await.unwrap();
    apply(
        low(),
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: victim, namespace: {SHARED}, labels: {{tenant: b}}}}
spec:
  containers:
  - name: app
    image: busybox
    env: [{{name: TENANT_B_TOKEN, value: tenant-b-secret-value}}]
"#
        ),
    )
    .await;
    running(low(), SHARED, "victim").await;

    bed.upper.create_namespace(SHARED).await.unwrap();
    kubectl(
        up(),
        &[
            "-n",
            SHARED,
            "create",
            "configmap",
            "victim-config",
            "--from-literal=k=v",
        ],
    )
    .await;
    apply(up(), &bound_pod(SHARED, "victim", NODE, Some("victim-config"))).await;
    eventually(
        up(),
        "Conflict",
        60,
        &["-n", SHARED, "get", "pod", "victim", "-o", SYNCED_REASON],
        "Conflict",
    )
    .await;
    assert!(
        !exists_below(SHARED, "configmap", "victim-config").await,
        "nothing is written below for a refused pod"
    );

    for via in Via::BOTH {
        let run = kubectl_run(up(), via, &["-n", SHARED, "exec", "victim", "--", "env"], None)
            .await
            .unwrap();
        assert!(
            !run.out().contains("tenant-b-secret-value") && run.code != 0,
            "{via:?}: exec reached the other tenant's pod: {} {}",
            run.out(),
            run.stderr
        );
        assert!(
            run.stderr.contains("is not running on node vn-iso"),
            "{via:?}: {}",
            run.stderr
        );
    }
    let logs = tensile_e2e::kubectl::run(up(), &["-n", SHARED, "logs", "victim"]).await;
    assert!(
        !logs.ok && !logs.stdout.contains("victim app line"),
        "logs reached the other tenant's pod: {} {}",
        logs.stdout,
        logs.stderr
    );
    // The upper apiserver turns the kubelet's 404 into its own NotFound.
    assert!(logs.stderr.contains("NotFound"), "{}", logs.stderr);
    let summary = kubectl(
        up(),
        &[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{NODE}/proxy/stats/summary"),
        ],
    )
    .await;
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    let names: Vec<&str> = summary["pods"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["podRef"]["name"].as_str())
        .collect();
    assert!(!names.contains(&"victim"), "the node's usage lists {names:?}");
    let theirs = kubectl(
        low(),
        &[
            "-n",
            SHARED,
            "get",
            "pod",
            "victim",
            "-o",
            "jsonpath={.metadata.labels.tenant}",
        ],
    )
    .await;
    assert_eq!(theirs, "b", "the other tenant's pod is untouched");
}

/// Lower admission adds references no upper pod named (here the lower ServiceAccount's
/// image pull secret): an upper Secret of that name never travels.
#[tokio::test]
async fn references_lower_admission_injects_never_make_upper_objects_travel() {
    let bed = bed();
    wait_ready(up(), NODE).await;
    bed.lower.create_namespace(INJECTED).await.unwrap();
    tensile_e2e::wait::must(
        "the lower default ServiceAccount",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let out =
                tensile_e2e::kubectl::run(low(), &["-n", INJECTED, "get", "serviceaccount", "default"]).await;
            out.ok.then_some(()).ok_or(out.stderr)
        },
    )
    .await;
    kubectl(
        low(),
        &[
            "-n",
            INJECTED,
            "patch",
            "serviceaccount",
            "default",
            "-p",
            r#"{"imagePullSecrets":[{"name":"registry-pull"}]}"#,
        ],
    )
    .await;
    bed.upper.create_namespace(INJECTED).await.unwrap();
    kubectl(
        up(),
        &[
            "-n",
            INJECTED,
            "create",
            "secret",
            "generic",
            "registry-pull",
            "--from-literal=token=upper-only",
        ],
    )
    .await;
    apply(up(), &bound_pod(INJECTED, "plain", NODE, None)).await;
    running(up(), INJECTED, "plain").await;
    let pulled = kubectl(
        low(),
        &[
            "-n",
            INJECTED,
            "get",
            "pod",
            "plain",
            "-o",
            "jsonpath={.spec.imagePullSecrets[*].name}",
        ],
    )
    .await;
    assert_eq!(
        pulled, "registry-pull",
        "the lower admission injected the reference"
    );
    // Copies are resynced every second: give several passes the chance to copy it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !exists_below(INJECTED, "secret", "registry-pull").await,
        "an upper Secret no upper pod named was copied below"
    );
}

/// Services follow pods only into lower namespaces the pod path may use: a namespace of
/// someone else (not shared) gets none, an own one does.
#[tokio::test]
async fn services_are_reflected_only_into_namespaces_pods_may_use() {
    let bed = bed();
    wait_ready(up(), NODE).await;
    let service = |ns: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: db, namespace: {ns}}}\nspec: {{ports: [{{port: 5432}}]}}\n"
        )
    };
    bed.lower.create_namespace("theirs").await.unwrap();
    for ns in ["theirs", "ours"] {
        bed.upper.create_namespace(ns).await.unwrap();
        apply(up(), &service(ns)).await;
        apply(up(), &bound_pod(ns, "app", NODE, None)).await;
    }
    running(up(), "ours", "app").await;
    eventually(
        up(),
        "the foreign namespace refused",
        60,
        &["-n", "theirs", "get", "pod", "app", "-o", SYNCED_REASON],
        "Conflict",
    )
    .await;
    tensile_e2e::wait::must(
        "the Service reflected into the own namespace",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            exists_below("ours", "service", "db")
                .await
                .then_some(())
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
    assert!(
        !exists_below("theirs", "service", "db").await,
        "a Service was written into a namespace the pod path refused"
    );
}

/// A lower admin cordons every lower node: the node offers no room and says why, stays
/// Ready (so no pod of it is evicted) and its pods keep running; uncordoned, the room is back.
#[tokio::test]
async fn cordoning_every_lower_node_takes_room_away_and_keeps_the_node_ready() {
    let bed = bed();
    let lower = TestCluster::start(ClusterOptions::new("isolation", "lower-cordon"))
        .await
        .unwrap();
    let _sim = NodeSimulator::start(
        lower.client().await.unwrap(),
        SimulatorOptions::new("lower-cordon", Some(lower.kubelet_client_ca_pem())),
        vec![NodeConfig::new("c-0"), NodeConfig::new("c-1")],
    )
    .await
    .unwrap();
    let node = "vn-cordon";
    let _vn = in_process::VirtualNode::start(&bed.upper, node, &lower).unwrap();
    wait_ready(up(), node).await;
    bed.upper.create_namespace("cordon").await.unwrap();
    apply(up(), &bound_pod("cordon", "keeps-running", node, None)).await;
    running(up(), "cordon", "keeps-running").await;

    for n in ["c-0", "c-1"] {
        kubectl(lower.kubeconfig(), &["cordon", n]).await;
    }
    let usable = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerNodesUsable")].reason}"#;
    eventually(
        up(),
        "no usable lower node",
        30,
        &["get", "node", node, "-o", usable],
        "NoUsableLowerNodes",
    )
    .await;
    eventually(
        up(),
        "no room",
        30,
        &[
            "get",
            "node",
            node,
            "-o",
            "jsonpath={.status.allocatable.pods}/{.status.allocatable.cpu}",
        ],
        "0/0",
    )
    .await;
    // Longer than the test bed's node-monitor grace (20 s): Ready all along.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(25) {
        let ready = kubectl(up(), &["get", "node", node, "-o", READY]).await;
        assert_eq!(
            ready,
            "True",
            "the node turned NotReady {:?} after the cordon",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let phase = kubectl(
        up(),
        &[
            "-n",
            "cordon",
            "get",
            "pod",
            "keeps-running",
            "-o",
            "jsonpath={.status.phase}/{.metadata.deletionTimestamp}",
        ],
    )
    .await;
    assert_eq!(phase, "Running/", "the pod runs on, not evicted");

    for n in ["c-0", "c-1"] {
        kubectl(lower.kubeconfig(), &["uncordon", n]).await;
    }
    eventually(
        up(),
        "usable again",
        30,
        &["get", "node", node, "-o", usable],
        "UsableLowerNodes",
    )
    .await;
    let pods = kubectl(
        up(),
        &["get", "node", node, "-o", "jsonpath={.status.allocatable.pods}"],
    )
    .await;
    assert_ne!(pods, "0", "the room is back");
}

/// A virtual node restarted while its lower caches cannot finish listing (here: a lower
/// identity that may not list pods) keeps its registered node's Lease renewed, so the node
/// does not flap NotReady past the node-monitor grace.
#[tokio::test]
async fn heartbeats_start_before_the_lower_caches_finish_listing() {
    let bed = bed();
    let node = "vn-lease";
    let first = in_process::VirtualNode::start(&bed.upper, node, &bed.lower).unwrap();
    wait_ready(up(), node).await;
    drop(first);

    kubectl(
        low(),
        &["-n", "default", "create", "serviceaccount", "cannot-list"],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = tensile_e2e::chart::service_account_kubeconfig(
        &bed.lower,
        "default",
        "cannot-list",
        &dir.path().join("cannot-list.kubeconfig"),
    )
    .await
    .unwrap();
    let mut args = in_process::options(&bed.upper, node, &bed.lower).unwrap();
    args.lower.client_kubeconfig = kubeconfig;
    let _restarted = in_process::VirtualNode::run(args);
    let renew = "jsonpath={.spec.renewTime}";
    let before = kubectl(
        up(),
        &["-n", "kube-node-lease", "get", "lease", node, "-o", renew],
    )
    .await;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(30) {
        let ready = kubectl(up(), &["get", "node", node, "-o", READY]).await;
        assert_eq!(
            ready,
            "True",
            "the node went {ready} {:?} after the restart",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let after = kubectl(
        up(),
        &["-n", "kube-node-lease", "get", "lease", node, "-o", renew],
    )
    .await;
    assert_ne!(before, after, "the Lease was renewed");
}

/// A stash key turned on (or rotated) while pods run: a running pod whose stash no longer
/// verifies keeps its status coming up (its container ends, the upper pod shows Succeeded),
/// while nothing of that stash goes below.
#[tokio::test]
async fn a_stash_key_turned_on_later_never_freezes_a_running_pods_status() {
    let bed = bed();
    let node = "vn-keyed";
    let first = in_process::VirtualNode::start(&bed.upper, node, &bed.lower).unwrap();
    wait_ready(up(), node).await;
    bed.upper.create_namespace("keyed").await.unwrap();
    apply(
        up(),
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: later
  namespace: keyed
  annotations:
    tensile.io/sim: "run=25s,exit=0"
    clusterSelector: '{{"tolerations":[{{"key":"batch","operator":"Exists"}}]}}'
spec:
  nodeName: {node}
  restartPolicy: Never
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: busybox}}]
"#
        ),
    )
    .await;
    running(up(), "keyed", "later").await;
    drop(first);

    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("turned-on");
    std::fs::write(&key, "k".repeat(48)).unwrap();
    let mut args = in_process::options(&bed.upper, node, &bed.lower).unwrap();
    args.stash_key_file = vec![key];
    let _keyed = in_process::VirtualNode::run(args);
    eventually(
        up(),
        "Succeeded upstream",
        90,
        &[
            "-n",
            "keyed",
            "get",
            "pod",
            "later",
            "-o",
            "jsonpath={.status.phase}",
        ],
        "Succeeded",
    )
    .await;
}

/// A lower pod of ours made for an earlier upper pod of the same name gets one delete, then
/// is waited for while it stops (here 20 s): not a delete every second.
#[tokio::test]
async fn a_stale_lower_pod_gets_one_delete_while_it_stops() {
    let bed = bed();
    wait_ready(up(), NODE).await;
    bed.upper.create_namespace("stale").await.unwrap();
    let twin = format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: twin, namespace: stale, annotations: {{tensile.io/sim: "stop=20s"}}}}
spec:
  nodeName: {NODE}
  terminationGracePeriodSeconds: 30
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: busybox}}]
"#
    );
    apply(up(), &twin).await;
    running(up(), "stale", "twin").await;
    running(low(), "stale", "twin").await;
    // Its container settles into running before it is asked to stop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The upper pod is replaced by one of the same name: its lower pod is now stale.
    kubectl(
        up(),
        &[
            "-n",
            "stale",
            "delete",
            "pod",
            "twin",
            "--grace-period=0",
            "--force",
        ],
    )
    .await;
    apply(up(), &twin).await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let deletes = bed
        .lower
        .audited_writes()
        .unwrap()
        .into_iter()
        .filter(|w| {
            w.verb == "delete"
                && w.uri.starts_with("/api/v1/namespaces/stale/pods/twin")
                && w.user_agent.contains("tensile-virtual-node")
        })
        .count();
    assert!(
        (1..=2).contains(&deletes),
        "the stale lower pod got {deletes} deletes while it stopped"
    );
    running(up(), "stale", "twin").await;
}
