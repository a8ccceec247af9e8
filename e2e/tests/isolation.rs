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
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::streams::{Via, kubectl_run};
use tensile_e2e::{ClusterOptions, NodeSimulator, TestCluster};
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
/// The namespace-scoped virtual node, the lower namespace of its account (the chart's lower
/// install, release [`SCOPED_RELEASE`]), and that account's user.
const SCOPED: &str = "vn-scoped";
const SCOPED_NS: &str = "tensile-scoped";
const SCOPED_RELEASE: &str = "scoped";
const SCOPED_USER: &str = "system:serviceaccount:tensile-scoped:scoped-tensile-lower";

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower] = scene::clusters_with([
            ClusterOptions::new("isolation", "upper"),
            ClusterOptions {
                audit_writes: true,
                audit_users: vec![SCOPED_USER.into()],
                ..ClusterOptions::new("isolation", "lower")
            },
        ])
        .await?;
        let sim = scene::simulate(&lower, scene::nodes("low", 2)).await?;
        let node = scene::virtual_node(&upper, NODE, &lower, |args| {
            args.reflection.shared_namespaces = vec![SHARED.into(), INJECTED.into()];
            args.reflection.enable_controllers = vec![Controllers::Services];
            args.reflection.copy_collection_delay = 1;
        })?;
        Ok(Bed {
            upper,
            lower,
            _sim: sim,
            _node: node,
        })
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

fn low() -> &'static Path {
    bed().lower.kubeconfig()
}

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

/// A pod named like another tenant's lower pod, bound to the node by hand, is refused below
/// as a conflict, and then reaches nothing of that pod: exec and logs answer as a kubelet
/// does for a pod it does not run, the node's usage lists no such pod, and no copy of what
/// the upper pod references was written below.
#[tokio::test]
async fn an_upper_pod_named_like_another_tenants_lower_pod_reaches_nothing_of_it() {
    let bed = bed();
    scene::node_ready(up(), NODE, 60).await;
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
    scene::pod_running(low(), SHARED, "victim", 90).await;

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
    scene::pod_shows(up(), SHARED, "victim", SYNCED_REASON, "Conflict", 60).await;
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
    let theirs = scene::pod_field(low(), SHARED, "victim", "jsonpath={.metadata.labels.tenant}").await;
    assert_eq!(theirs, "b", "the other tenant's pod is untouched");
}

/// Lower admission adds references no upper pod named (here the lower ServiceAccount's
/// image pull secret): an upper Secret of that name never travels.
#[tokio::test]
async fn references_lower_admission_injects_never_make_upper_objects_travel() {
    let bed = bed();
    scene::node_ready(up(), NODE, 60).await;
    bed.lower.create_namespace(INJECTED).await.unwrap();
    tensile_e2e::wait::within("the lower default ServiceAccount", 30, || async {
        let out =
            tensile_e2e::kubectl::run(low(), &["-n", INJECTED, "get", "serviceaccount", "default"]).await;
        out.ok.then_some(()).ok_or(out.stderr)
    })
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
    scene::pod_running(up(), INJECTED, "plain", 90).await;
    let pulled = scene::pod_field(
        low(),
        INJECTED,
        "plain",
        "jsonpath={.spec.imagePullSecrets[*].name}",
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
    scene::node_ready(up(), NODE, 60).await;
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
    scene::pod_running(up(), "ours", "app", 90).await;
    scene::pod_shows(up(), "theirs", "app", SYNCED_REASON, "Conflict", 60).await;
    tensile_e2e::wait::within("the Service reflected into the own namespace", 30, || async {
        exists_below("ours", "service", "db")
            .await
            .then_some(())
            .ok_or_else(|| "not yet".to_owned())
    })
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
    let [lower] = scene::clusters("isolation", ["lower-cordon"]).await.unwrap();
    let _sim = scene::simulate(&lower, scene::nodes("c", 2)).await.unwrap();
    let node = "vn-cordon";
    let _vn = in_process::VirtualNode::start(&bed.upper, node, &lower).unwrap();
    scene::node_ready(up(), node, 60).await;
    bed.upper.create_namespace("cordon").await.unwrap();
    apply(up(), &bound_pod("cordon", "keeps-running", node, None)).await;
    scene::pod_running(up(), "cordon", "keeps-running", 90).await;

    for n in ["c-0", "c-1"] {
        kubectl(lower.kubeconfig(), &["cordon", n]).await;
    }
    let usable = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerNodesUsable")].reason}"#;
    scene::node_shows(up(), node, usable, "NoUsableLowerNodes", 30).await;
    scene::node_shows(
        up(),
        node,
        "jsonpath={.status.allocatable.pods}/{.status.allocatable.cpu}",
        "0/0",
        30,
    )
    .await;
    // Longer than the test bed's node-monitor grace (20 s): Ready all along.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(25) {
        let ready = scene::node_field(up(), node, scene::READY).await;
        assert_eq!(
            ready,
            "True",
            "the node turned NotReady {:?} after the cordon",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let phase = scene::pod_field(
        up(),
        "cordon",
        "keeps-running",
        "jsonpath={.status.phase}/{.metadata.deletionTimestamp}",
    )
    .await;
    assert_eq!(phase, "Running/", "the pod runs on, not evicted");

    for n in ["c-0", "c-1"] {
        kubectl(lower.kubeconfig(), &["uncordon", n]).await;
    }
    scene::node_shows(up(), node, usable, "UsableLowerNodes", 30).await;
    let pods = scene::node_field(up(), node, "jsonpath={.status.allocatable.pods}").await;
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
    scene::node_ready(up(), node, 60).await;
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
    let _restarted = scene::virtual_node(&bed.upper, node, &bed.lower, |args| {
        args.lower.client_kubeconfig = kubeconfig
    })
    .unwrap();
    let renew = "jsonpath={.spec.renewTime}";
    let before = kubectl(
        up(),
        &["-n", "kube-node-lease", "get", "lease", node, "-o", renew],
    )
    .await;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(30) {
        let ready = scene::node_field(up(), node, scene::READY).await;
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
    scene::node_ready(up(), node, 60).await;
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
    scene::pod_running(up(), "keyed", "later", 90).await;
    drop(first);

    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("turned-on");
    std::fs::write(&key, "k".repeat(48)).unwrap();
    let _keyed = scene::virtual_node(&bed.upper, node, &bed.lower, |args| {
        args.stash_key_file = vec![key]
    })
    .unwrap();
    scene::pod_shows(up(), "keyed", "later", scene::PHASE, "Succeeded", 90).await;
}

/// A lower pod of ours made for an earlier upper pod of the same name gets one delete, then
/// is waited for while it stops (here 20 s): not a delete every second.
#[tokio::test]
async fn a_stale_lower_pod_gets_one_delete_while_it_stops() {
    let bed = bed();
    scene::node_ready(up(), NODE, 60).await;
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
    scene::pod_running(up(), "stale", "twin", 90).await;
    scene::pod_running(low(), "stale", "twin", 90).await;
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
    scene::pod_running(up(), "stale", "twin", 90).await;
}

/// A pod with requests (a quota on requests refuses pods without), bound to `node`, mounting
/// ConfigMap `settings` and Secret `password`.
fn requesting_pod(ns: &str, name: &str, node: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeName: {node}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: app
    image: busybox
    resources: {{requests: {{cpu: 100m, memory: 64Mi}}}}
    volumeMounts: [{{name: cfg, mountPath: /cfg}}, {{name: pw, mountPath: /pw}}]
  volumes:
  - {{name: cfg, configMap: {{name: settings}}}}
  - {{name: pw, secret: {{secretName: password}}}}
"#
    )
}

/// A virtual node whose lower credential is the chart's namespace-scoped rendering (a Role in
/// each served namespace, nothing cluster-wide) runs pods in those namespaces with what they
/// reference, their Services, logs and exec; shows as room what the namespaces' quotas leave
/// after another tenant's pod; refuses a pod of another namespace with the reason and writes
/// nothing for it; and is never refused a call below (the lower apiserver's audit of its
/// account), while the account is refused everything outside its namespaces.
#[tokio::test]
async fn a_namespace_scoped_node_serves_its_namespaces_and_is_refused_nothing_below() {
    let bed = bed();
    let lower = tensile_e2e::chart::Access::of(&bed.lower);
    for ns in ["team-a", "team-b", SCOPED_NS] {
        bed.lower.create_namespace(ns).await.unwrap();
    }
    // The lower admin's quota on team-a, and another tenant's pod in it.
    apply(
        low(),
        r#"
apiVersion: v1
kind: ResourceQuota
metadata: {name: team-a, namespace: team-a}
spec: {hard: {requests.cpu: "4", requests.memory: 8Gi, pods: "10"}}
"#,
    )
    .await;
    scene::shows(
        low(),
        "team-a",
        "resourcequota/team-a",
        "jsonpath={.status.hard.pods}",
        "10",
        30,
    )
    .await;
    apply(
        low(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: tenant, namespace: team-a}
spec:
  containers: [{name: app, image: busybox, resources: {requests: {cpu: "1", memory: 1Gi}}}]
"#,
    )
    .await;
    scene::pod_running(low(), "team-a", "tenant", 90).await;

    // The chart's lower install for the two namespaces, as rendered.
    let rendered = tensile_e2e::chart::helm_with(
        &lower,
        &[
            "template",
            SCOPED_RELEASE,
            &tensile_e2e::chart::chart_dir().display().to_string(),
            "-n",
            SCOPED_NS,
            "--set",
            "target=lower",
            "--set",
            "lower.namespaces={team-a,team-b}",
            "--set",
            "virtualNodes.reflectServices=true",
        ],
    )
    .await
    .unwrap();
    assert!(rendered.ok, "{}", rendered.stderr);
    assert!(
        !rendered.stdout.contains("kind: ClusterRole"),
        "a namespace scope renders nothing cluster-wide:\n{}",
        rendered.stdout
    );
    let file = bed.lower.dir().join("scoped-lower.yaml");
    std::fs::write(&file, &rendered.stdout).unwrap();
    kubectl(low(), &["apply", "-f", &file.display().to_string()]).await;
    let credential = tensile_e2e::chart::service_account_kubeconfig_with(
        &lower,
        SCOPED_NS,
        &format!("{SCOPED_RELEASE}-tensile-lower"),
        &bed.lower.dir().join("scoped.kubeconfig"),
    )
    .await
    .unwrap();

    let _node = scene::virtual_node(&bed.upper, SCOPED, &bed.lower, |args| {
        args.lower.client_kubeconfig = credential.clone();
        args.lower.namespaces = vec!["team-a".into(), "team-b".into()];
        args.reflection.enable_controllers = vec![Controllers::Services];
        args.reflection.copy_collection_delay = 1;
    })
    .unwrap();
    scene::node_ready(up(), SCOPED, 60).await;

    // The room: team-a's quota less the tenant's pod; team-b bounds nothing, so adds nothing.
    let room = "jsonpath={.status.capacity.cpu}/{.status.allocatable.cpu}/{.status.allocatable.memory}/{.status.allocatable.pods}";
    scene::node_shows(up(), SCOPED, room, "4/3/7516192768/9", 30).await;
    let usable = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerNodesUsable")].reason}: {.status.conditions[?(@.type=="tensile.io/LowerNodesUsable")].message}"#;
    let condition = scene::node_field(up(), SCOPED, usable).await;
    assert!(
        condition.starts_with("ServedNamespaceQuotas: ") && condition.contains("team-b"),
        "{condition}"
    );

    // A pod of a served namespace runs below with what it references, and its Service.
    bed.upper.create_namespace("team-a").await.unwrap();
    kubectl(
        up(),
        &[
            "-n",
            "team-a",
            "create",
            "configmap",
            "settings",
            "--from-literal=k=v",
        ],
    )
    .await;
    kubectl(
        up(),
        &[
            "-n",
            "team-a",
            "create",
            "secret",
            "generic",
            "password",
            "--from-literal=p=s",
        ],
    )
    .await;
    kubectl(
        up(),
        &[
            "-n",
            "team-a",
            "create",
            "service",
            "clusterip",
            "web",
            "--tcp=80:8080",
        ],
    )
    .await;
    apply(up(), &requesting_pod("team-a", "app", SCOPED)).await;
    scene::pod_running(up(), "team-a", "app", 90).await;
    scene::pod_running(low(), "team-a", "app", 90).await;
    for (kind, name) in [("configmap", "settings"), ("secret", "password")] {
        assert!(exists_below("team-a", kind, name).await, "{kind} {name} below");
    }
    scene::shows(low(), "team-a", "service/web", "name", "service/web", 30).await;
    let logs = kubectl(up(), &["-n", "team-a", "logs", "app"]).await;
    assert!(logs.contains("team-a/app app line"), "{logs}");
    let run = kubectl_run(
        up(),
        Via::WebSocket,
        &["-n", "team-a", "exec", "app", "--", "echo", "scoped"],
        None,
    )
    .await
    .unwrap();
    assert!(run.out().contains("scoped"), "{} {}", run.out(), run.stderr);

    // A claim: made below in the served namespace, bound there (the lower admin's class and
    // volume), and its pod runs; nothing cluster-wide is read for it.
    apply(
        low(),
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {name: scoped-disk},
   provisioner: kubernetes.io/no-provisioner, volumeBindingMode: Immediate}
- apiVersion: v1
  kind: PersistentVolume
  metadata: {name: scoped-disk-0}
  spec: {capacity: {storage: 1Gi}, accessModes: [ReadWriteOnce], storageClassName: scoped-disk,
         hostPath: {path: /tmp/scoped-disk-0}}
"#,
    )
    .await;
    apply(
        up(),
        &format!(
            r#"
apiVersion: v1
kind: List
items:
- {{apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {{name: scoped-disk}},
   provisioner: virtual-node.tensile.io, volumeBindingMode: WaitForFirstConsumer}}
- apiVersion: v1
  kind: PersistentVolumeClaim
  metadata: {{name: data, namespace: team-a}}
  spec: {{accessModes: [ReadWriteOnce], storageClassName: scoped-disk, resources: {{requests: {{storage: 500Mi}}}}}}
- apiVersion: v1
  kind: Pod
  metadata: {{name: store, namespace: team-a}}
  spec:
    nodeName: {SCOPED}
    tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
    volumes: [{{name: data, persistentVolumeClaim: {{claimName: data}}}}]
    containers: [{{name: db, image: db, resources: {{requests: {{cpu: 100m, memory: 64Mi}}}},
                  volumeMounts: [{{name: data, mountPath: /data}}]}}]
"#
        ),
    )
    .await;
    scene::pod_running(low(), "team-a", "store", 90).await;
    scene::pod_running(up(), "team-a", "store", 90).await;
    for cluster in [low(), up()] {
        scene::shows(
            cluster,
            "team-a",
            "pvc/data",
            "jsonpath={.status.phase}",
            "Bound",
            60,
        )
        .await;
    }

    // A pod of a namespace not served is refused with the reason, and nothing is made for it.
    bed.upper.create_namespace("team-c").await.unwrap();
    apply(up(), &bound_pod("team-c", "outside", SCOPED, None)).await;
    scene::pod_shows(up(), "team-c", "outside", SYNCED_REASON, "NamespaceNotServed", 60).await;
    let message = scene::pod_field(
        up(),
        "team-c",
        "outside",
        r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].message}"#,
    )
    .await;
    assert!(message.contains("namespace team-c is not served"), "{message}");
    let below = tensile_e2e::kubectl::run(low(), &["get", "namespace", "team-c"]).await;
    assert!(
        !below.ok && below.stderr.contains("NotFound"),
        "team-c was made below: {}",
        below.stdout
    );

    // The account may do nothing outside its namespaces (the lower apiserver's answers).
    let can = |verb: &'static str, what: &'static str, ns: &'static str| {
        let credential = credential.clone();
        async move {
            let mut args = vec!["auth", "can-i", verb, what];
            if !ns.is_empty() {
                args.extend(["-n", ns]);
            }
            tensile_e2e::kubectl::run(&credential, &args)
                .await
                .stdout
                .trim()
                .to_owned()
        }
    };
    for (verb, what, ns) in [
        ("list", "pods", "team-a"),
        ("watch", "resourcequotas", "team-b"),
        ("create", "secrets", "team-b"),
    ] {
        assert_eq!(can(verb, what, ns).await, "yes", "{verb} {what} in {ns}");
    }
    for (verb, what, ns) in [
        ("list", "nodes", ""),
        ("list", "pods", "team-c"),
        ("get", "pods", "default"),
        ("list", "secrets", "kube-system"),
        ("create", "namespaces", ""),
        ("get", "priorityclasses", ""),
        ("get", "storageclasses", ""),
        ("list", "pods", ""),
    ] {
        assert_eq!(can(verb, what, ns).await, "no", "{verb} {what} in {ns:?}");
    }
    let denied = tensile_e2e::kubectl::run(&credential, &["-n", "kube-system", "get", "secrets"]).await;
    assert!(
        !denied.ok && denied.stderr.contains("forbidden"),
        "{} {}",
        denied.stdout,
        denied.stderr
    );

    // Deleted above, gone below with its copies.
    kubectl(up(), &["-n", "team-a", "delete", "pod", "app", "--wait=false"]).await;
    eventually(
        low(),
        "the lower pod gone",
        60,
        &[
            "-n",
            "team-a",
            "get",
            "pods",
            "-o",
            "name",
            "--field-selector=metadata.name=app",
        ],
        "",
    )
    .await;
    eventually(
        low(),
        "the copy gone",
        60,
        &[
            "-n",
            "team-a",
            "get",
            "configmaps",
            "-o",
            "name",
            "--field-selector=metadata.name=settings",
        ],
        "",
    )
    .await;

    // Every call the node made below was allowed.
    let calls: Vec<_> = bed
        .lower
        .audited_writes()
        .unwrap()
        .into_iter()
        .filter(|c| c.user == SCOPED_USER && c.user_agent.starts_with("tensile-virtual-node/"))
        .collect();
    // (A watch is recorded once it ends; a refused one ends at once, with its 403.)
    assert!(
        calls
            .iter()
            .any(|c| c.verb == "list" && c.uri.contains("/namespaces/team-b/")),
        "the node's calls are audited: {} seen",
        calls.len()
    );
    let refused: Vec<String> = calls
        .iter()
        .filter(|c| c.code == 403)
        .map(|c| format!("{} {}", c.verb, c.uri))
        .collect();
    assert!(refused.is_empty(), "refused below: {refused:#?}");
}
