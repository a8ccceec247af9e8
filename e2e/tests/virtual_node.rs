//! virtual-node end to end: an upper cluster, two lower clusters with simulated nodes, and
//! virtual nodes run in process. Every assertion is what kubectl shows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::Path;
use std::time::{Duration, Instant};

use tensile_e2e::check::{apply, deployment, eventually, kubectl};
use tensile_e2e::in_process;
use tensile_e2e::scene;
use tensile_e2e::scene::condition;
use tensile_e2e::shared::Shared;
use tensile_e2e::{NodeConfig, NodeSimulator, TestCluster, free_port};
use tensile_virtual_node::{Args, UpperIdentity};

struct Bed {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    _sim_a: NodeSimulator,
    sim_b: NodeSimulator,
}

static BED: Shared<Bed> = Shared::new();

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] =
            scene::clusters("virtual_node", ["upper", "lower-a", "lower-b"]).await?;
        let sim_a = scene::simulate(&lower_a, scene::nodes("a", 3)).await?;
        let sim_b = scene::simulate(&lower_b, scene::nodes("b", 3)).await?;
        Ok(Bed {
            upper,
            lower_a,
            lower_b,
            _sim_a: sim_a,
            sim_b,
        })
    })
}

/// A virtual node over `lower` in this test process.
struct VirtualNode;

impl VirtualNode {
    fn start(name: &str, lower: &TestCluster) -> in_process::VirtualNode {
        Self::start_with(name, lower, |_| {})
    }

    /// A virtual node over `lower`, once it is Ready without the not-ready taint.
    async fn ready(name: &str, lower: &TestCluster) -> in_process::VirtualNode {
        let vn = Self::start(name, lower);
        wait_ready(name).await;
        vn
    }

    /// A virtual node whose options `set` changes.
    fn start_with(name: &str, lower: &TestCluster, set: impl FnOnce(&mut Args)) -> in_process::VirtualNode {
        scene::virtual_node(&bed().upper, name, lower, set).unwrap()
    }
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

/// Waits until `node` is Ready without the not-ready taint ([`scene::node_untainted`]).
async fn wait_ready(node: &str) {
    scene::node_untainted(up(), node, 60).await;
}

fn pod(ns: &str, name: &str, node: &str, restart: &str, annotations: &str, cpu: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, annotations: {{{annotations}}}}}
spec:
  restartPolicy: {restart}
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: busybox, resources: {{requests: {{cpu: "{cpu}"}}}}}}]
"#
    )
}

async fn namespace(ns: &str) {
    bed().upper.create_namespace(ns).await.unwrap();
}

async fn capacity_cpu(node: &str) -> i64 {
    let cpu = scene::node_field(up(), node, "jsonpath={.status.capacity.cpu}").await;
    cpu.trim().parse().unwrap()
}

#[tokio::test]
async fn the_node_is_ready_with_labels_taint_and_capacity_that_follows_the_lower_cluster() {
    let bed = bed();
    let vn = VirtualNode::start_with("vn-node", &bed.lower_b, |args| {
        args.node_labels = vec![("region".into(), "b".into())]
    });
    wait_ready("vn-node").await;
    // Ready says the lower cluster answers; whether it offers room is its own condition
    // (lower-b's nodes may still be recovering from the outage test's stopped apiserver).
    scene::node_shows(
        up(),
        "vn-node",
        &condition("tensile.io/LowerNodesUsable", &["status"]),
        "True",
        60,
    )
    .await;
    let labels = scene::node_field(up(), "vn-node", "jsonpath={.metadata.labels}").await;
    for want in [
        r#""type":"virtual-kubelet""#,
        r#""kubernetes.io/hostname":"vn-node""#,
        r#""kubernetes.io/os":"linux""#,
        r#""region":"b""#,
    ] {
        assert!(labels.contains(want), "{want} in {labels}");
    }
    // Acting as its node, it sets no label NodeRestriction keeps from kubelets.
    assert!(!labels.contains("kubernetes.io/role"), "{labels}");
    let taints = scene::node_field(
        up(),
        "vn-node",
        "jsonpath={.spec.taints[0].key}={.spec.taints[0].value}:{.spec.taints[0].effect}",
    )
    .await;
    assert_eq!(taints, "virtual-kubelet.io/provider=tensile:NoSchedule");
    let ip = scene::node_field(up(), "vn-node", r#"jsonpath={.status.addresses[*].type}={.status.addresses[*].address} {.status.nodeInfo.kubeletVersion}"#).await;
    assert_eq!(
        ip,
        format!(
            "InternalIP={} {}",
            tensile_e2e::node_ip().unwrap(),
            bed.lower_b.version()
        )
    );
    // The shape is rewritten at most every 5 s: it shows the three nodes within that.
    tensile_e2e::wait::within(
        "the capacity shape summarises the three lower nodes",
        15,
        || async {
            let shape = scene::node_field(
                up(),
                "vn-node",
                r#"jsonpath={.metadata.annotations.tensile\.io/capacity-shape}"#,
            )
            .await;
            let parsed: serde_json::Value =
                serde_json::from_str(&shape).map_err(|e| format!("{e}: {shape}"))?;
            if (parsed["v"].as_u64(), parsed["nodes"].as_u64()) == (Some(2), Some(3)) {
                Ok(())
            } else {
                Err(shape)
            }
        },
    )
    .await;

    // Capacity is the sum of the lower nodes' allocatable: 3 x 4 CPUs (lower-b is used by no
    // other pods at this point, and capacity never subtracts pods anyway).
    let before = capacity_cpu("vn-node").await;
    assert_eq!(before, 12);
    let handle = BED.handle().unwrap();
    let started = Instant::now();
    handle
        .spawn(async move { bed.add_lower_b_node().await })
        .await
        .unwrap();
    scene::node_shows(up(), "vn-node", "jsonpath={.status.capacity.cpu}", "14", 10).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "capacity followed within 5 s of the node turning Ready: {took:?}"
    );

    // Someone deletes the Node object: it comes back.
    let uid = scene::node_field(up(), "vn-node", "jsonpath={.metadata.uid}").await;
    kubectl(up(), &["delete", "node", "vn-node"]).await;
    wait_ready("vn-node").await;
    let new_uid = scene::node_field(up(), "vn-node", "jsonpath={.metadata.uid}").await;
    assert_ne!(uid, new_uid, "a new Node object was registered");

    // The admin endpoint reports readiness and metrics.
    let admin = |path: &'static str| {
        let url = format!("http://{}{path}", vn.admin_addr);
        async move {
            let out = tokio::process::Command::new("curl")
                .args(["-s", &url])
                .output()
                .await
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    assert_eq!(admin("/readyz").await, "ok");
    assert_eq!(admin("/healthz").await, "ok");
    let metrics = admin("/metrics").await;
    assert!(
        metrics.contains("tensile_virtual_node_lower_cluster_ready 1"),
        "{metrics}"
    );
}

impl Bed {
    /// Adds a 2-CPU node to lower-b (on the fixture's runtime, so it outlives the test).
    async fn add_lower_b_node(&self) {
        self.sim_b
            .add_node(NodeConfig::new("b-extra").resource("cpu", "2"))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_deployment_runs_below_with_marks_and_stash_and_scales_down_cleanly() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-deploy", &bed.lower_a).await;
    namespace("deploy").await;
    apply(
        up(),
        &deployment(
            "deploy",
            "web",
            "vn-deploy",
            3,
            Some(r#"{"nodeSelector":{"kubernetes.io/hostname":"a-1"}}"#),
            "",
        ),
    )
    .await;
    let running = "Running Running Running";
    let phases = [
        "-n",
        "deploy",
        "get",
        "pods",
        "-l",
        "app=web",
        "-o",
        "jsonpath={range .items[*]}{.status.phase} {end}",
    ];
    eventually(up(), "3 Running upstream", 60, &phases, running).await;
    eventually(bed.lower_a.kubeconfig(), "3 Running below", 10, &phases, running).await;

    let upper_rows = kubectl(up(), &["-n", "deploy", "get", "pods", "-l", "app=web", "-o", "jsonpath={range .items[*]}{.metadata.name},{.metadata.uid},{.status.podIP},{.spec.nodeName};{end}"]).await;
    let lower_rows = kubectl(bed.lower_a.kubeconfig(), &["-n", "deploy", "get", "pods", "-l", "app=web", "-o", r#"jsonpath={range .items[*]}{.metadata.name},{.metadata.labels.tensile\.io/upper-uid},{.status.podIP},{.spec.nodeName},{.metadata.labels.tensile\.io/virtual-node};{end}"#]).await;
    let mut upper: Vec<&str> = upper_rows.split(';').filter(|s| !s.is_empty()).collect();
    let mut lower: Vec<&str> = lower_rows.split(';').filter(|s| !s.is_empty()).collect();
    upper.sort();
    lower.sort();
    assert_eq!(upper.len(), 3);
    for (u, l) in upper.iter().zip(&lower) {
        let u: Vec<&str> = u.split(',').collect();
        let l: Vec<&str> = l.split(',').collect();
        assert_eq!(u[0], l[0], "same name below");
        assert_eq!(u[1], l[1], "marked with the upper UID");
        assert_eq!(u[2], l[2], "the lower pod IP shows upstream");
        assert!(!u[2].is_empty());
        assert_eq!(u[3], "vn-deploy");
        assert_eq!(l[3], "a-1", "the stashed nodeSelector applies below");
        assert_eq!(l[4], "vn-deploy");
    }

    // Mutable fields follow: a label added upstream appears below.
    let first = upper[0].split(',').next().unwrap().to_owned();
    kubectl(up(), &["-n", "deploy", "label", "pod", &first, "tier=gold"]).await;
    let tier = [
        "-n",
        "deploy",
        "get",
        "pod",
        &first,
        "-o",
        "jsonpath={.metadata.labels.tier}",
    ];
    eventually(bed.lower_a.kubeconfig(), "label below", 15, &tier, "gold").await;

    kubectl(
        up(),
        &["-n", "deploy", "scale", "deployment", "web", "--replicas=1"],
    )
    .await;
    eventually(
        bed.lower_a.kubeconfig(),
        "1 pod below",
        30,
        &[
            "-n",
            "deploy",
            "get",
            "pods",
            "-o",
            "jsonpath={.items[*].status.phase}",
        ],
        "Running",
    )
    .await;
    eventually(
        up(),
        "1 pod upstream, nothing Terminating",
        30,
        &[
            "-n",
            "deploy",
            "get",
            "pods",
            "-o",
            "jsonpath={range .items[*]}{.status.phase}{.metadata.deletionTimestamp}{end}",
        ],
        "Running",
    )
    .await;
}

#[tokio::test]
async fn jobs_complete_and_failures_show_the_lower_exit_code() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-jobs", &bed.lower_a).await;
    namespace("jobs").await;
    apply(
        up(),
        r#"
apiVersion: batch/v1
kind: Job
metadata: {name: once, namespace: jobs}
spec:
  template:
    spec:
      restartPolicy: Never
      nodeSelector: {kubernetes.io/hostname: vn-jobs}
      tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
      containers: [{name: app, image: busybox}]
"#,
    )
    .await;
    let waited = kubectl(
        up(),
        &[
            "-n",
            "jobs",
            "wait",
            "--for=condition=complete",
            "job/once",
            "--timeout=60s",
        ],
    )
    .await;
    assert!(waited.contains("condition met"), "{waited}");

    apply(
        up(),
        &pod(
            "jobs",
            "crash",
            "vn-jobs",
            "Never",
            r#"tensile.io/sim: "run=500ms,exit=3,reason=OOMKilled""#,
            "10m",
        ),
    )
    .await;
    scene::pod_shows(up(), "jobs", "crash", scene::PHASE, "Failed", 60).await;
    let term = scene::pod_field(up(), "jobs", "crash", "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}/{.status.containerStatuses[0].state.terminated.reason}").await;
    assert_eq!(term, "3/OOMKilled");
}

#[tokio::test]
async fn kubectl_logs_reach_the_lower_pod_and_callers_are_authenticated() {
    let bed = bed();
    let vn = VirtualNode::ready("vn-logs", &bed.lower_a).await;
    namespace("logs").await;
    apply(up(), &pod("logs", "talker", "vn-logs", "Always", "", "10m")).await;
    scene::pod_running(up(), "logs", "talker", 60).await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let plain = kubectl(up(), &["-n", "logs", "logs", "talker"]).await;
    assert!(
        plain.starts_with("logs/talker app line 0\nlogs/talker app line 1\n"),
        "{plain}"
    );
    let tail = kubectl(up(), &["-n", "logs", "logs", "talker", "--tail=2"]).await;
    assert_eq!(tail.lines().count(), 2, "{tail}");
    assert!(
        tail.lines().all(|l| l.starts_with("logs/talker app line ")),
        "{tail}"
    );
    let since = kubectl(
        up(),
        &["-n", "logs", "logs", "talker", "--since=2s", "--timestamps"],
    )
    .await;
    let n = since.lines().count();
    assert!(
        (1..=3).contains(&n),
        "--since=2s keeps the last lines only: {since}"
    );
    let out = tokio::process::Command::new("timeout")
        .args([
            "3.5",
            tensile_e2e::kubectl::binary_for(up()).to_str().unwrap(),
            "--kubeconfig",
            up().to_str().unwrap(),
            "-n",
            "logs",
            "logs",
            "-f",
            "--tail=1",
            "talker",
        ])
        .output()
        .await
        .unwrap();
    let followed = String::from_utf8_lossy(&out.stdout);
    assert!(
        followed.lines().count() >= 3,
        "-f streams new lines: {followed:?}"
    );
    let bad = bed
        .upper
        .kubectl(&["-n", "logs", "logs", "talker", "-c", "nope"])
        .await;
    assert!(!bad.ok && bad.stderr.contains("nope"), "{}", bad.stderr);

    // Without the apiserver's client certificate the kubelet API answers 401.
    let url = format!(
        "https://{}:{}/containerLogs/logs/talker/app",
        tensile_e2e::node_ip().unwrap(),
        vn.kubelet_port
    );
    let anon = tokio::process::Command::new("curl")
        .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", &url])
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&anon.stdout), "401");
    // Another node's kubelet certificate (same CA, user system:node:some-other-node) is
    // authenticated but not authorised for nodes/proxy of this node: 403, no logs.
    let other = get_as("other-kubelet", &url).await;
    assert!(other.ends_with("\n403"), "{other}");
    assert!(
        other.contains("system:node:some-other-node") && !other.contains("talker app line"),
        "{other}"
    );
    // A certificate naming two users: the apiserver would take the last (tensile-tenant, who
    // may do nothing); the kubelet API must not act on the first (allowed to read logs here),
    // and refuses the certificate.
    apply(
        up(),
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: e2e-log-reader}
rules: [{apiGroups: [""], resources: [nodes/proxy, nodes/log], verbs: [get, create]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: e2e-log-reader}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-log-reader}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: tensile-log-reader}]
"#,
    )
    .await;
    let two = get_as("two-names", &url).await;
    assert!(two.ends_with("\n401"), "{two}");
    assert!(
        two.contains("more than one common name") && !two.contains("talker app line"),
        "{two}"
    );
}

/// The kubelet API authorises as a 1.36+ kubelet (fine-grained kubelet authorization): a
/// caller allowed only `nodes/pods` of the node reads `/pods` (its upper pods, nothing of the
/// lower cluster) and no logs; a caller allowed only `nodes/proxy` reads `/pods`, `/healthz`
/// and `/configz` through the fallback; another node's certificate reads none.
#[tokio::test]
async fn the_kubelet_api_asks_for_the_fine_grained_subresource_before_nodes_proxy() {
    let bed = bed();
    let ns = "fine-grained";
    bed.upper.create_namespace(ns).await.unwrap();
    let vn = VirtualNode::ready("vn-fine", &bed.lower_a).await;
    apply(
        up(),
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: listed, namespace: {ns}}}
spec:
  nodeName: vn-fine
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: nginx}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: e2e-pod-lister}}
rules: [{{apiGroups: [""], resources: [nodes/pods], verbs: [get]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: e2e-pod-lister}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-pod-lister}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: tensile-pod-lister}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: e2e-proxy-only}}
rules: [{{apiGroups: [""], resources: [nodes/proxy], verbs: [get]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: e2e-proxy-only}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-proxy-only}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: tensile-proxy-only}}]
"#
        ),
    )
    .await;
    scene::pod_running(up(), ns, "listed", 60).await;
    let kubelet = format!("https://{}:{}", tensile_e2e::node_ip().unwrap(), vn.kubelet_port);
    let get_as = |name: &'static str, path: &str| get_as(name, format!("{kubelet}{path}"));
    let listed = get_as("pod-lister", "/pods").await;
    let (body, code) = listed.rsplit_once('\n').unwrap();
    assert_eq!(code, "200", "{listed}");
    let list: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(list["kind"], "PodList");
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["listed"], "the pods bound to this node");
    assert!(
        !body.contains("tensile.io/upper-uid"),
        "nothing of the lower pod: {body}"
    );
    let logs = get_as("pod-lister", &format!("/containerLogs/{ns}/listed/app")).await;
    assert!(logs.ends_with("\n403") && logs.contains("nodes/proxy"), "{logs}");
    let health = get_as("pod-lister", "/healthz").await;
    assert!(
        health.ends_with("\n403") && health.contains("nodes/healthz or nodes/proxy"),
        "{health}"
    );
    for path in ["/pods", "/healthz", "/configz"] {
        let fallback = get_as("proxy-only", path).await;
        assert!(fallback.ends_with("\n200"), "{path}: {fallback}");
    }
    let configz = get_as("proxy-only", "/configz").await;
    assert!(configz.contains(r#""mode":"Webhook""#), "{configz}");
    let other = get_as("other-kubelet", "/pods").await;
    assert!(other.ends_with("\n403") && !other.contains("listed"), "{other}");
}

/// The body and, on its own last line, the status code of a GET of `url` with client
/// certificate `name` of the upper pki (written by the bed: `other-kubelet`, `two-names`,
/// `pod-lister`, `proxy-only`).
async fn get_as(name: &str, url: impl AsRef<std::ffi::OsStr>) -> String {
    let pki = bed().upper.dir().join("pki");
    let out = tokio::process::Command::new("curl")
        .args(["-sk", "-w", "\n%{http_code}", "--cert"])
        .arg(pki.join(format!("{name}.crt")))
        .arg("--key")
        .arg(pki.join(format!("{name}.key")))
        .arg(url)
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Idle and slow clients cannot take the kubelet API away from the apiserver: with a cap of
/// 16, 64 silent connections and 16 trickling an unfinished request leave at most 16 open,
/// `kubectl logs` keeps working, and the idle deadline closes the flood.
#[tokio::test]
async fn the_kubelet_api_caps_and_cuts_idle_and_slow_clients_while_logs_work() {
    let bed = bed();
    let vn = VirtualNode::start_with("vn-flood", &bed.lower_a, |args| {
        args.kubelet.max_connections = 16;
        args.kubelet.max_stream_sessions = 8;
        args.kubelet.idle_timeout_seconds = 4;
    });
    wait_ready("vn-flood").await;
    namespace("flood").await;
    apply(up(), &pod("flood", "talker", "vn-flood", "Always", "", "10m")).await;
    scene::pod_running(up(), "flood", "talker", 60).await;
    let addr = std::net::SocketAddr::new(tensile_e2e::node_ip().unwrap(), vn.kubelet_port);
    let flood = tensile_e2e::flood::Flood::open(addr, 64, 16).await;
    flood.assert_capped(64, 16).await;
    for _ in 0..3 {
        let logs = kubectl(up(), &["-n", "flood", "logs", "talker", "--tail=1"]).await;
        assert!(logs.starts_with("flood/talker app line "), "{logs}");
    }
    flood.assert_all_closed_within(Duration::from_secs(10)).await;
}

/// A lower namespace the lower admin deletes is created again for the next pod: the virtual
/// node does not go on believing it exists.
#[tokio::test]
async fn a_lower_namespace_deleted_below_is_created_again_for_the_next_pod() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-nsgone", &bed.lower_a).await;
    namespace("nsgone").await;
    let phase = |name: &'static str| async move {
        scene::pod_running(up(), "nsgone", name, 90).await;
    };
    apply(up(), &pod("nsgone", "first", "vn-nsgone", "Always", "", "10m")).await;
    phase("first").await;
    let low = bed.lower_a.kubeconfig();
    let deleted = kubectl(
        low,
        &["delete", "namespace", "nsgone", "--wait=true", "--timeout=90s"],
    )
    .await;
    assert!(deleted.contains("deleted"), "{deleted}");
    apply(up(), &pod("nsgone", "second", "vn-nsgone", "Always", "", "10m")).await;
    phase("second").await;
    let below = scene::pod_field(low, "nsgone", "second", "jsonpath={.metadata.name}").await;
    assert_eq!(below, "second");
}

/// A PriorityClass only the upper cluster has does not keep the pod from running below: it
/// runs there at the lower cluster's default priority; one both clusters have is kept.
#[tokio::test]
async fn a_priority_class_only_the_upper_cluster_has_does_not_block_the_lower_pod() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-prio", &bed.lower_a).await;
    namespace("prio").await;
    let class = |name: &str| {
        format!(
            "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata: {{name: {name}}}\nvalue: 1000\n"
        )
    };
    apply(up(), &class("upper-only")).await;
    apply(up(), &class("both-prio")).await;
    apply(bed.lower_a.kubeconfig(), &class("both-prio")).await;
    for (name, class) in [("only-up", "upper-only"), ("both", "both-prio")] {
        let manifest = pod("prio", name, "vn-prio", "Always", "", "10m").replace(
            "  restartPolicy:",
            &format!("  priorityClassName: {class}\n  restartPolicy:"),
        );
        apply(up(), &manifest).await;
    }
    for name in ["only-up", "both"] {
        scene::pod_running(up(), "prio", name, 60).await;
    }
    let below = |name: &'static str| async move {
        scene::pod_field(
            bed.lower_a.kubeconfig(),
            "prio",
            name,
            "jsonpath={.spec.priorityClassName}/{.spec.priority}",
        )
        .await
    };
    assert_eq!(
        below("only-up").await,
        "/0",
        "the lower cluster's default priority"
    );
    assert_eq!(below("both").await, "both-prio/1000");
}

/// A toleration added to a running pod's stash reaches its lower pod, next to the
/// tolerations the lower apiserver added there itself.
#[tokio::test]
async fn a_toleration_added_to_a_running_pod_reaches_the_lower_pod() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-tol", &bed.lower_a).await;
    namespace("tol").await;
    let stash = r#"clusterSelector: '{"tolerations":[{"key":"first","operator":"Exists"}]}'"#;
    apply(up(), &pod("tol", "p", "vn-tol", "Always", stash, "10m")).await;
    scene::pod_running(up(), "tol", "p", 60).await;
    let keys = "jsonpath={range .spec.tolerations[*]}{.key},{end}";
    let before = scene::pod_field(bed.lower_a.kubeconfig(), "tol", "p", keys).await;
    assert!(
        before.contains("first,") && before.contains("node.kubernetes.io/not-ready,"),
        "the stash and the lower apiserver's defaults: {before}"
    );
    kubectl(
        up(),
        &[
            "-n",
            "tol",
            "annotate",
            "pod",
            "p",
            "--overwrite",
            r#"clusterSelector={"tolerations":[{"key":"first","operator":"Exists"},{"key":"second","operator":"Exists"}]}"#,
        ],
    )
    .await;
    tensile_e2e::wait::until(
        "the added toleration below",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let now = scene::pod_field(bed.lower_a.kubeconfig(), "tol", "p", keys).await;
            if now.contains("second,")
                && now.contains("first,")
                && now.contains("node.kubernetes.io/not-ready,")
            {
                Ok(())
            } else {
                Err(now)
            }
        },
    )
    .await
    .unwrap();
}

/// A pod with a readiness gate is Ready upstream only once the gate's condition is True,
/// however ready its lower pod is; status writes (strategic merge by condition type) leave
/// the gate's condition to its controller.
#[tokio::test]
async fn a_readiness_gate_holds_upper_ready_until_its_condition_is_true() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-gate", &bed.lower_a).await;
    namespace("gate").await;
    let manifest = pod("gate", "p", "vn-gate", "Always", "", "10m").replace(
        "  restartPolicy:",
        "  readinessGates: [{conditionType: example.com/lb}]\n  restartPolicy:",
    );
    apply(up(), &manifest).await;
    let ready = r#"jsonpath={.status.phase}/{.status.conditions[?(@.type=="Ready")].status}/{.status.conditions[?(@.type=="Ready")].reason}"#;
    scene::pod_shows(
        up(),
        "gate",
        "p",
        ready,
        "Running/False/ReadinessGatesNotReady",
        60,
    )
    .await;
    let lower_ready = scene::pod_field(
        bed.lower_a.kubeconfig(),
        "gate",
        "p",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
    )
    .await;
    assert_eq!(lower_ready, "True", "the lower pod itself is ready");
    kubectl(
        up(),
        &[
            "-n",
            "gate",
            "patch",
            "pod",
            "p",
            "--subresource=status",
            "--type=strategic",
            "-p",
            r#"{"status":{"conditions":[{"type":"example.com/lb","status":"True"}]}}"#,
        ],
    )
    .await;
    scene::pod_shows(up(), "gate", "p", ready, "Running/True/", 30).await;
    let gate = scene::pod_field(
        up(),
        "gate",
        "p",
        r#"jsonpath={.status.conditions[?(@.type=="example.com/lb")].status}"#,
    )
    .await;
    assert_eq!(
        gate, "True",
        "the gate's condition is left as its controller wrote it"
    );
}

/// A lower namespace this upper cluster did not create is not used unless
/// `--shared-namespaces` lists it: the pod says why and nothing is created there.
#[tokio::test]
async fn a_lower_namespace_of_someone_else_is_refused_unless_shared() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-theirs", &bed.lower_a).await;
    namespace("theirs").await;
    bed.lower_a.create_namespace("theirs").await.unwrap();
    apply(up(), &pod("theirs", "p", "vn-theirs", "Always", "", "10m")).await;
    let synced = &condition("tensile.io/LowerPodSynced", &["status", "reason"]);
    scene::pod_shows(up(), "theirs", "p", synced, "False/Conflict", 60).await;
    let message = scene::pod_field(
        up(),
        "theirs",
        "p",
        &condition("tensile.io/LowerPodSynced", &["message"]),
    )
    .await;
    assert!(
        message.contains("--shared-namespaces") && message.contains("theirs"),
        "{message}"
    );
    let below = tensile_e2e::kubectl::run(
        bed.lower_a.kubeconfig(),
        &["-n", "theirs", "get", "pods", "-o", "name"],
    )
    .await;
    assert_eq!(below.stdout.trim(), "", "nothing is created in their namespace");
}

/// Acting as its configured credential.
fn by_credential(args: &mut Args) {
    args.upper.identity = UpperIdentity::Credential;
    args.upper.kubeconfig = Some(up().to_owned());
}

/// A virtual node restarted with other `--node-labels` and `--disable-taint` brings its
/// registered Node up to date: the new label set, the dropped one gone, the taint removed,
/// and a label someone else put on the Node kept (acting as its credential).
#[tokio::test]
async fn changed_node_labels_and_taint_apply_to_a_registered_node() {
    let bed = bed();
    let first = VirtualNode::start_with("vn-relabel", &bed.lower_a, |args| {
        by_credential(args);
        args.node_labels = vec![("team".into(), "a".into())];
    });
    wait_ready("vn-relabel").await;
    kubectl(up(), &["label", "node", "vn-relabel", "owner=ops"]).await;
    let shown = r#"jsonpath={.metadata.labels.team}/{.metadata.labels.zone}/{.metadata.labels.owner}/{.spec.taints[*].key}"#;
    let now = scene::node_field(up(), "vn-relabel", shown).await;
    assert_eq!(now, "a//ops/virtual-kubelet.io/provider");
    drop(first);
    let _second = VirtualNode::start_with("vn-relabel", &bed.lower_a, |args| {
        by_credential(args);
        args.node_labels = vec![("zone".into(), "z1".into())];
        args.disable_taint = true;
    });
    scene::node_shows(up(), "vn-relabel", shown, "/z1/ops/", 60).await;
}

/// Under a node identity NodeRestriction lets a node set its taints only when it registers:
/// restarted with other labels and `--disable-taint`, the node brings its labels up to date
/// (a refused taint change would have taken them down with it) and leaves the taint to an
/// admin, never putting it back once removed.
#[tokio::test]
async fn under_a_node_identity_changed_labels_apply_and_the_taint_is_left_to_an_admin() {
    let bed = bed();
    let first = VirtualNode::start_with("vn-retaint", &bed.lower_a, |args| {
        args.node_labels = vec![("team".into(), "a".into())];
    });
    wait_ready("vn-retaint").await;
    let shown = r#"jsonpath={.metadata.labels.team}/{.metadata.labels.zone}/{.spec.taints[*].key}"#;
    let now = scene::node_field(up(), "vn-retaint", shown).await;
    assert_eq!(now, "a//virtual-kubelet.io/provider");
    drop(first);
    let _second = VirtualNode::start_with("vn-retaint", &bed.lower_a, |args| {
        args.node_labels = vec![("zone".into(), "z1".into())];
        args.disable_taint = true;
    });
    scene::node_shows(up(), "vn-retaint", shown, "/z1/virtual-kubelet.io/provider", 60).await;
    kubectl(
        up(),
        &["taint", "node", "vn-retaint", "virtual-kubelet.io/provider-"],
    )
    .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let after = scene::node_field(up(), "vn-retaint", shown).await;
    assert_eq!(after, "/z1/", "the admin's removal stays");
}

#[tokio::test]
async fn a_pod_the_lower_cluster_cannot_place_shows_unschedulable_upstream() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-sched", &bed.lower_a).await;
    namespace("sched").await;
    // 6 CPUs fit the virtual node's aggregate (12) but no single 4-CPU lower node.
    apply(up(), &pod("sched", "wide", "vn-sched", "Always", "", "6")).await;
    let cond = &condition("tensile.io/LowerPodScheduled", &["status", "reason"]);
    scene::pod_shows(up(), "sched", "wide", cond, "False/Unschedulable", 60).await;
    let msg = scene::pod_field(
        up(),
        "sched",
        "wide",
        &condition("tensile.io/LowerPodScheduled", &["message"]),
    )
    .await;
    assert!(
        msg.contains("Insufficient cpu"),
        "the lower scheduler's message: {msg}"
    );
    let scheduled = scene::pod_field(
        up(),
        "sched",
        "wide",
        r#"jsonpath={.spec.nodeName} {.status.conditions[?(@.type=="PodScheduled")].status}"#,
    )
    .await;
    assert_eq!(scheduled, "vn-sched True", "still bound upstream");
}

#[tokio::test]
async fn a_foreign_lower_pod_of_the_same_name_is_a_reported_conflict() {
    let bed = bed();
    let _vn = VirtualNode::start_with("vn-conflict", &bed.lower_a, |args| {
        args.reflection.shared_namespaces = vec!["conflict".into()];
    });
    wait_ready("vn-conflict").await;
    namespace("conflict").await;
    bed.lower_a.create_namespace("conflict").await.unwrap();
    kubectl(
        bed.lower_a.kubeconfig(),
        &[
            "-n",
            "conflict",
            "run",
            "clash",
            "--image=theirs",
            "--labels=owner=someone-else",
        ],
    )
    .await;
    let before = scene::pod_field(
        bed.lower_a.kubeconfig(),
        "conflict",
        "clash",
        "jsonpath={.metadata.uid} {.spec.containers[0].image}",
    )
    .await;

    apply(
        up(),
        &pod("conflict", "clash", "vn-conflict", "Always", "", "10m"),
    )
    .await;
    let cond = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].reason}"#;
    scene::pod_shows(up(), "conflict", "clash", cond, "Conflict", 60).await;
    let events = kubectl(
        up(),
        &[
            "-n",
            "conflict",
            "get",
            "events",
            "-o",
            "jsonpath={range .items[*]}{.reason} {end}",
        ],
    )
    .await;
    assert!(events.contains("LowerPodConflict"), "a Warning event: {events}");
    let after = scene::pod_field(
        bed.lower_a.kubeconfig(),
        "conflict",
        "clash",
        "jsonpath={.metadata.uid} {.spec.containers[0].image}",
    )
    .await;
    assert_eq!(before, after, "the foreign pod is left untouched");
    let phase = scene::pod_field(up(), "conflict", "clash", scene::PHASE).await;
    assert_eq!(phase, "Pending", "never shown Running with someone else's pod");
}

#[tokio::test]
async fn a_restart_mid_rollout_converges_without_duplicates_or_losses() {
    let bed = bed();
    let port = free_port().unwrap();
    let vn = VirtualNode::start_with("vn-restart", &bed.lower_a, |args| {
        args.kubelet.kubelet_port = port
    });
    wait_ready("vn-restart").await;
    namespace("restart").await;
    apply(up(), &deployment("restart", "roll", "vn-restart", 6, None, "")).await;
    // Crash while the pods are being created below.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(vn);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _vn = VirtualNode::start_with("vn-restart", &bed.lower_a, |args| {
        args.kubelet.kubelet_port = port
    });
    let six = "Running Running Running Running Running Running";
    let phases = [
        "-n",
        "restart",
        "get",
        "pods",
        "-o",
        "jsonpath={range .items[*]}{.status.phase} {end}",
    ];
    eventually(up(), "6 Running upstream", 90, &phases, six).await;
    eventually(
        bed.lower_a.kubeconfig(),
        "exactly 6 Running below",
        30,
        &phases,
        six,
    )
    .await;
    let upper_uids = kubectl(
        up(),
        &[
            "-n",
            "restart",
            "get",
            "pods",
            "-o",
            "jsonpath={.items[*].metadata.uid}",
        ],
    )
    .await;
    let lower_uids = kubectl(
        bed.lower_a.kubeconfig(),
        &[
            "-n",
            "restart",
            "get",
            "pods",
            "-o",
            r#"jsonpath={.items[*].metadata.labels.tensile\.io/upper-uid}"#,
        ],
    )
    .await;
    let mut u: Vec<&str> = upper_uids.split_whitespace().collect();
    let mut l: Vec<&str> = lower_uids.split_whitespace().collect();
    u.sort();
    l.sort();
    assert_eq!(u, l, "one lower pod per upper pod");
}

/// A lower cluster of its own for the outage test, which stops its apiserver: the lower
/// clusters the other tests use meanwhile stay up.
struct OutageLower {
    lower: TestCluster,
    _sim: NodeSimulator,
}

static OUTAGE: Shared<OutageLower> = Shared::new();

fn outage_lower() -> &'static TestCluster {
    &OUTAGE
        .bed(|| async {
            let lower =
                TestCluster::start(tensile_e2e::ClusterOptions::new("virtual_node", "lower-outage")).await?;
            let sim = scene::simulate(&lower, scene::nodes("o", 2)).await?;
            Ok(OutageLower { lower, _sim: sim })
        })
        .lower
}

#[tokio::test]
async fn an_unreachable_lower_cluster_turns_the_node_not_ready_and_recovery_resumes_status() {
    let lower = outage_lower();
    let _vn = VirtualNode::ready("vn-outage", lower).await;
    namespace("outage").await;
    apply(up(), &pod("outage", "survivor", "vn-outage", "Always", "", "10m")).await;
    scene::pod_running(up(), "outage", "survivor", 60).await;

    lower.stop_apiserver();
    let started = Instant::now();
    scene::node_shows(up(), "vn-outage", scene::READY, "False", 30).await;
    let took = started.elapsed();
    let reason = scene::node_field(
        up(),
        "vn-outage",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].reason}"#,
    )
    .await;
    assert_eq!(reason, "LowerClusterUnreachable");
    eprintln!("Ready=False {took:?} after the lower apiserver stopped");
    // Someone marks the pod not Ready (the node lifecycle controller does so when a node goes
    // Unknown); the virtual node, which cannot see below, writes no status from its stale
    // cache over that.
    let pod_ready = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;
    scene::pod_shows(up(), "outage", "survivor", pod_ready, "True", 30).await;
    kubectl(
        up(),
        &[
            "-n",
            "outage",
            "patch",
            "pod",
            "survivor",
            "--subresource=status",
            "--type=strategic",
            "-p",
            r#"{"status":{"conditions":[{"type":"Ready","status":"False","reason":"NodeNotReady"}]}}"#,
        ],
    )
    .await;
    let marked = Instant::now();
    while marked.elapsed() < Duration::from_secs(12) {
        let ready = scene::pod_field(up(), "outage", "survivor", pod_ready).await;
        assert_eq!(
            ready,
            "False",
            "status written from the stale cache {:?} into the outage",
            marked.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    lower.start_apiserver().await.unwrap();
    wait_ready("vn-outage").await;
    scene::pod_shows(up(), "outage", "survivor", pod_ready, "True", 60).await;
    // Statuses resume: a new pod runs and an existing one keeps reporting.
    apply(up(), &pod("outage", "newcomer", "vn-outage", "Always", "", "10m")).await;
    let phase = &[
        "-n",
        "outage",
        "get",
        "pod",
        "newcomer",
        "-o",
        "jsonpath={.status.phase}",
    ];
    let running = tensile_e2e::wait::until(
        "new pod Running after recovery",
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            let out = tensile_e2e::kubectl::run(up(), phase).await;
            match out.stdout.trim() {
                "Running" => Ok(()),
                other => Err(format!("{other:?} {}", out.stderr.trim())),
            }
        },
    )
    .await;
    if let Err(e) = running {
        // What the lower cluster made of it, to tell a stuck lower scheduler or kubelet
        // from a virtual node that never wrote.
        let below = tensile_e2e::kubectl::run(
            lower.kubeconfig(),
            &["-n", "outage", "get", "pod,events", "-o", "wide"],
        )
        .await;
        let nodes = tensile_e2e::kubectl::run(lower.kubeconfig(), &["get", "nodes", "-o", "wide"]).await;
        // And upstream: whether the upper scheduler placed it, and what the node offered.
        let upstream = tensile_e2e::kubectl::run(
            up(),
            &[
                "-n",
                "outage",
                "get",
                "pod",
                "newcomer",
                "-o",
                "jsonpath={.spec.nodeName} {.status.conditions}",
            ],
        )
        .await;
        let node = tensile_e2e::kubectl::run(
            up(),
            &[
                "get",
                "node",
                "vn-outage",
                "-o",
                "jsonpath={.spec.taints} {.status.allocatable}",
            ],
        )
        .await;
        panic!(
            "{e}\nupstream: {}\nvn-outage: {}\nbelow:\n{}{}\nlower nodes:\n{}",
            upstream.stdout, node.stdout, below.stdout, below.stderr, nodes.stdout
        );
    }
    kubectl(
        up(),
        &["-n", "outage", "delete", "pod", "survivor", "--wait=true"],
    )
    .await;
}

#[tokio::test]
async fn two_virtual_nodes_on_one_lower_cluster_keep_to_their_own_pods() {
    let bed = bed();
    let _one = VirtualNode::start("vn-one", &bed.lower_a);
    let _two = VirtualNode::start("vn-two", &bed.lower_a);
    wait_ready("vn-one").await;
    wait_ready("vn-two").await;
    namespace("pair").await;
    apply(up(), &deployment("pair", "one", "vn-one", 2, None, "")).await;
    apply(up(), &deployment("pair", "two", "vn-two", 2, None, "")).await;
    let phases = [
        "-n",
        "pair",
        "get",
        "pods",
        "-o",
        "jsonpath={range .items[*]}{.status.phase} {end}",
    ];
    eventually(
        up(),
        "4 Running upstream",
        60,
        &phases,
        "Running Running Running Running",
    )
    .await;
    let owners = |app: &'static str| async move {
        kubectl(
            bed.lower_a.kubeconfig(),
            &[
                "-n",
                "pair",
                "get",
                "pods",
                "-l",
                &format!("app={app}"),
                "-o",
                r#"jsonpath={.items[*].metadata.labels.tensile\.io/virtual-node}"#,
            ],
        )
        .await
    };
    assert_eq!(owners("one").await, "vn-one vn-one");
    assert_eq!(owners("two").await, "vn-two vn-two");
    // Deleting one node's workload leaves the other's pods alone, through GC rounds too.
    kubectl(up(), &["-n", "pair", "delete", "deployment", "one"]).await;
    eventually(
        bed.lower_a.kubeconfig(),
        "only vn-two pods below",
        60,
        &[
            "-n",
            "pair",
            "get",
            "pods",
            "-o",
            r#"jsonpath={.items[*].metadata.labels.tensile\.io/virtual-node}"#,
        ],
        "vn-two vn-two",
    )
    .await;
    let two = kubectl(
        up(),
        &[
            "-n",
            "pair",
            "get",
            "pods",
            "-l",
            "app=two",
            "-o",
            "jsonpath={range .items[*]}{.status.phase} {end}",
        ],
    )
    .await;
    assert_eq!(two.trim(), "Running Running");
}

#[tokio::test]
async fn lower_pods_lost_below_are_restarted_or_failed_and_orphans_are_collected() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-lost", &bed.lower_a).await;
    namespace("lost").await;
    let low = bed.lower_a.kubeconfig();
    apply(up(), &pod("lost", "always", "vn-lost", "Always", "", "10m")).await;
    apply(
        up(),
        &pod(
            "lost",
            "never",
            "vn-lost",
            "Never",
            r#"tensile.io/sim: "run=10m""#,
            "10m",
        ),
    )
    .await;
    apply(up(), &pod("lost", "orphan", "vn-lost", "Always", "", "10m")).await;
    let phases = [
        "-n",
        "lost",
        "get",
        "pods",
        "-o",
        "jsonpath={range .items[*]}{.status.phase} {end}",
    ];
    eventually(up(), "3 Running", 60, &phases, "Running Running Running").await;
    eventually(low, "3 Running below", 30, &phases, "Running Running Running").await;

    // Someone deletes lower pods behind our back.
    let uid_of = [
        "-n",
        "lost",
        "get",
        "pod",
        "always",
        "-o",
        "jsonpath={.metadata.uid}",
    ];
    let old_uid = kubectl(low, &uid_of).await;
    kubectl(low, &["-n", "lost", "delete", "pod", "always", "never"]).await;
    // restartPolicy Always: it runs again below; Never: the upper pod fails and says why.
    let always = [
        "-n",
        "lost",
        "get",
        "pod",
        "always",
        "-o",
        "jsonpath={.status.phase}",
    ];
    eventually(low, "always recreated below", 60, &always, "Running").await;
    assert_ne!(old_uid, kubectl(low, &uid_of).await);
    let never = [
        "-n",
        "lost",
        "get",
        "pod",
        "never",
        "-o",
        "jsonpath={.status.phase}/{.status.reason}",
    ];
    eventually(up(), "never Failed", 60, &never, "Failed/LowerPodLost").await;
    assert_eq!(kubectl(up(), &always).await, "Running");

    // The upper pod vanishes without a graceful delete: its lower pod is collected.
    kubectl(
        up(),
        &[
            "-n",
            "lost",
            "delete",
            "pod",
            "orphan",
            "--grace-period=0",
            "--force",
        ],
    )
    .await;
    let orphan = [
        "-n",
        "lost",
        "get",
        "pod",
        "orphan",
        "--ignore-not-found",
        "-o",
        "name",
    ];
    eventually(low, "orphan collected below", 60, &orphan, "").await;
}

#[tokio::test]
async fn daemonset_pods_are_not_run_below_by_default_and_say_so() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-ds", &bed.lower_a).await;
    namespace("ds").await;
    apply(
        up(),
        r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: agent, namespace: ds}
spec:
  selector: {matchLabels: {app: agent}}
  template:
    metadata: {labels: {app: agent}}
    spec:
      nodeSelector: {kubernetes.io/hostname: vn-ds}
      tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
      containers: [{name: app, image: agent}]
"#,
    )
    .await;
    let cond = r#"jsonpath={.items[0].status.conditions[?(@.type=="tensile.io/LowerPodSynced")].reason}"#;
    eventually(
        up(),
        "DaemonSetPod condition",
        60,
        &["-n", "ds", "get", "pods", "-o", cond],
        "DaemonSetPod",
    )
    .await;
    let below = kubectl(
        bed.lower_a.kubeconfig(),
        &["-n", "ds", "get", "pods", "--ignore-not-found", "-o", "name"],
    )
    .await;
    assert_eq!(below, "", "nothing runs below");
    let events = kubectl(
        up(),
        &[
            "-n",
            "ds",
            "get",
            "events",
            "-o",
            "jsonpath={range .items[*]}{.reason} {end}",
        ],
    )
    .await;
    assert!(events.contains("DaemonSetPodNotRun"), "{events}");
}

/// The webhook and a virtual node together: constraints written for the lower cluster are
/// stashed upstream by the webhook and applied to the lower pod by the virtual node.
/// A webhook for the opted-in pods of namespace `ns` (registered as `config`, its caBundle
/// written), signing stashes with `stash_key` when given.
async fn webhook_for(
    ns: &str,
    config: &str,
    stash_key: Option<std::sync::Arc<tensile_common::stash::StashKey>>,
) -> tensile_webhook::Running {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bed = bed();
    scene::opt_in_namespace(up(), ns).await;
    let port = free_port().unwrap();
    apply(
        up(),
        &tensile_e2e::check::webhook_registration(
            config,
            port,
            tensile_e2e::check::Namespaces::Labelled(ns),
            None,
        ),
    )
    .await;
    let mut options = tensile_webhook::Options::new(
        ([127, 0, 0, 1], port).into(),
        tensile_webhook::Certificates::SelfSigned {
            names: vec!["127.0.0.1".into()],
        },
    );
    options.client = Some(bed.upper.client().await.unwrap());
    options.webhook_config_name = Some(config.into());
    // The virtual node's hostname steers the upper scheduler; everything else is for below.
    options.policy = tensile_webhook::Policy {
        ignore_selector_keys: ["kubernetes.io/hostname".to_owned()].into(),
        stash_key,
        ..tensile_webhook::Policy::default()
    };
    let webhook = tensile_webhook::start(options).await.unwrap();
    let bundle = [
        "get",
        "mutatingwebhookconfiguration",
        config,
        "-o",
        "jsonpath={.webhooks[0].clientConfig.caBundle}",
    ];
    tensile_e2e::wait::until(
        "caBundle written",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let out = bed.upper.kubectl(&bundle).await;
            if out.stdout.trim().is_empty() {
                Err(out.stderr)
            } else {
                Ok(())
            }
        },
    )
    .await
    .unwrap();
    webhook
}

/// With a stash key shared by the webhook and the virtual node, the webhook's stash is applied
/// below and a stash written by hand is not: its pod is refused with the reason, and nothing
/// is created below with the tolerations it asked for. The webhook's signature binds the stash
/// to its pod: copied onto another pod of the namespace, it is refused the same way. A bare
/// `generateName` pod is named by the webhook and runs. The virtual node holds two keys, as
/// during a rotation: a stash signed with the old one is applied too.
#[tokio::test]
async fn with_a_stash_key_only_the_webhooks_stash_is_applied_below() {
    use tensile_common::stash::{Holder, StashKey};
    let bed = bed();
    let dir = tempfile::tempdir().unwrap();
    // Key ids are the files' names.
    let key_file = dir.path().join("new");
    std::fs::write(&key_file, "k".repeat(48)).unwrap();
    let old_file = dir.path().join("old");
    std::fs::write(&old_file, "o".repeat(48)).unwrap();
    let key = std::sync::Arc::new(StashKey::from_file(&key_file).unwrap());
    let old_key = StashKey::from_file(&old_file).unwrap();
    let _vn = VirtualNode::start_with("vn-signed", &bed.lower_a, |args| {
        args.stash_key_file = vec![old_file.clone(), key_file.clone()];
    });
    wait_ready("vn-signed").await;
    let ns = "signed";
    namespace(ns).await;
    let _webhook = webhook_for(ns, "tensile-webhook-signed", Some(key)).await;
    let manifest = |name: &str, labels: &str, annotations: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: signed, labels: {{{labels}}}, annotations: {{{annotations}}}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: vn-signed}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}, {{key: dedicated, operator: Exists}}]
  containers: [{{name: app, image: busybox}}]
"#
        )
    };
    apply(up(), &manifest("by-webhook", "virtual-pod: \"true\"", "")).await;
    let forged = r#"clusterSelector: '{"tolerations":[{"key":"node-role.kubernetes.io/master","operator":"Exists"}]}'"#;
    apply(up(), &manifest("by-hand", "app: x", forged)).await;
    scene::pod_running(up(), ns, "by-webhook", 60).await;
    let tolerations = scene::pod_field(
        bed.lower_a.kubeconfig(),
        ns,
        "by-webhook",
        "jsonpath={.spec.tolerations[*].key}",
    )
    .await;
    assert!(tolerations.contains("dedicated"), "{tolerations}");
    let synced = &condition("tensile.io/LowerPodSynced", &["status", "reason"]);
    scene::pod_shows(up(), ns, "by-hand", synced, "False/StashNotTrusted", 60).await;
    let below =
        tensile_e2e::kubectl::run(bed.lower_a.kubeconfig(), &["-n", ns, "get", "pod", "by-hand"]).await;
    assert!(!below.ok && below.stderr.contains("NotFound"), "{}", below.stdout);

    // The webhook's stash and signature, as the apiserver stored them, copied onto another
    // pod of the namespace (not opted in: the webhook leaves it as written).
    let annotation = |pod: &str, key: &str| {
        let path = format!("jsonpath={{.metadata.annotations.{}}}", key.replace('.', "\\."));
        let pod = pod.to_owned();
        async move { scene::pod_field(up(), ns, &pod, &path).await }
    };
    let stash = annotation("by-webhook", tensile_common::names::CLUSTER_SELECTOR).await;
    let signature = annotation("by-webhook", tensile_common::names::STASH_SIGNATURE).await;
    assert!(
        signature.starts_with("v2:new:"),
        "signed with the webhook's key: {signature}"
    );
    let quoted = |s: &str| serde_json::to_string(s).unwrap();
    let copied = format!(
        "{}: {}, {}: {}",
        tensile_common::names::CLUSTER_SELECTOR,
        quoted(&stash),
        tensile_common::names::STASH_SIGNATURE,
        quoted(&signature)
    );
    apply(up(), &manifest("replayed", "app: x", &copied)).await;
    scene::pod_shows(up(), ns, "replayed", synced, "False/StashNotTrusted", 60).await;
    let message = scene::pod_field(
        up(),
        ns,
        "replayed",
        &condition("tensile.io/LowerPodSynced", &["message"]),
    )
    .await;
    assert!(
        message.contains("pod name replayed") && message.contains("made for another pod"),
        "{message}"
    );
    let below =
        tensile_e2e::kubectl::run(bed.lower_a.kubeconfig(), &["-n", ns, "get", "pod", "replayed"]).await;
    assert!(!below.ok && below.stderr.contains("NotFound"), "{}", below.stdout);

    // The same annotations on an opted-in pod, as the descheduler writes the replacement of a
    // bare pod it moves: the webhook signs the stash for this pod's own name, and it runs.
    apply(up(), &manifest("moved", "virtual-pod: \"true\"", &copied)).await;
    scene::pod_running(up(), ns, "moved", 60).await;
    let resigned = annotation("moved", tensile_common::names::STASH_SIGNATURE).await;
    assert!(
        resigned.starts_with("v2:new:") && resigned != signature,
        "signed for its own name: {resigned}"
    );

    // A stash signed with the old key of the rotation, for its pod, is applied.
    let old_stash = r#"{"tolerations":[{"key":"dedicated","operator":"Exists"}]}"#;
    let old_signed = format!(
        "{}: {}, {}: {}",
        tensile_common::names::CLUSTER_SELECTOR,
        quoted(old_stash),
        tensile_common::names::STASH_SIGNATURE,
        quoted(&old_key.sign(ns, Holder::Name("by-old-key"), old_stash))
    );
    apply(up(), &manifest("by-old-key", "app: x", &old_signed)).await;

    // A bare generateName pod: the webhook names it and binds the signature to that name.
    let generated =
        manifest("unused", "virtual-pod: \"true\"", "").replace("name: unused", "generateName: gen-");
    let file = dir.path().join("generated.yaml");
    std::fs::write(&file, &generated).unwrap();
    let file = file.display().to_string();
    let out =
        tensile_e2e::kubectl::run(up(), &["create", "-f", &file, "-o", "jsonpath={.metadata.name}"]).await;
    assert!(out.ok, "{}", out.stderr);
    let gen_name = out.stdout.trim().to_owned();
    assert!(gen_name.starts_with("gen-") && gen_name.len() == 9, "{gen_name}");
    for pod in ["by-old-key", gen_name.as_str()] {
        scene::pod_running(up(), ns, pod, 60).await;
        let tolerations = scene::pod_field(
            bed.lower_a.kubeconfig(),
            ns,
            pod,
            "jsonpath={.spec.tolerations[*].key}",
        )
        .await;
        assert!(tolerations.contains("dedicated"), "{pod}: {tolerations}");
    }
}

#[tokio::test]
async fn the_webhook_stash_is_applied_below_by_the_virtual_node() {
    let bed = bed();
    let _vn = VirtualNode::ready("vn-webhook", &bed.lower_a).await;
    let ns = "stash";
    namespace(ns).await;
    let _webhook = webhook_for(ns, "tensile-webhook-stash", None).await;

    // Written as if for one cluster: lower node a-2 by name, and a lower taint tolerated.
    apply(
        up(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: placed, namespace: stash, labels: {virtual-pod: "true"}}
spec:
  nodeSelector: {kubernetes.io/hostname: vn-webhook}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms: [{matchFields: [{key: metadata.name, operator: In, values: [a-2]}]}]
  tolerations: [{key: dedicated, operator: Equal, value: batch, effect: NoSchedule}]
  containers: [{name: app, image: busybox}]
"#,
    )
    .await;
    let stash = scene::pod_field(
        up(),
        ns,
        "placed",
        "jsonpath={.metadata.annotations.clusterSelector}",
    )
    .await;
    assert!(
        stash.contains("a-2") && stash.contains("dedicated"),
        "stashed by the webhook: {stash}"
    );
    scene::pod_shows(
        up(),
        ns,
        "placed",
        "jsonpath={.spec.nodeName}/{.status.phase}",
        "vn-webhook/Running",
        60,
    )
    .await;
    let low = bed.lower_a.kubeconfig();
    let below = scene::pod_field(
        low,
        ns,
        "placed",
        "jsonpath={.spec.nodeName}|{.spec.tolerations[*].key}|{.spec.nodeSelector}",
    )
    .await;
    let parts: Vec<&str> = below.split('|').collect();
    assert_eq!(
        parts[0], "a-2",
        "the stashed matchFields placed it below: {below}"
    );
    assert!(
        parts[1].split(' ').any(|k| k == "dedicated"),
        "stashed toleration below: {below}"
    );
    assert!(
        !parts[1].contains("virtual-kubelet.io/provider"),
        "upper-only toleration stays up: {below}"
    );
    assert_eq!(parts[2], "", "no upper selector went down: {below}");
}

/// `kubectl logs -f` on a container that has gone quiet: once kubectl is gone, the virtual
/// node closes its stream to the lower cluster at once instead of holding it until the
/// container writes again (it never will). The node's `stream_sessions{kind="logs"}` gauge
/// counts the open lower log streams.
#[tokio::test]
async fn a_followed_log_of_a_quiet_container_is_closed_below_when_kubectl_goes() {
    let bed = bed();
    let vn = VirtualNode::ready("vn-quiet", &bed.lower_a).await;
    namespace("quiet").await;
    let sim = format!("{}: \"lines=1\"", tensile_common::names::SIM_BEHAVIOR);
    apply(up(), &pod("quiet", "hush", "vn-quiet", "Always", &sim, "10m")).await;
    scene::pod_running(up(), "quiet", "hush", 60).await;
    let open_streams = || async {
        let metrics = tensile_e2e::in_process::admin_get(&vn.admin_addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        metrics
            .lines()
            .find(|l| l.starts_with("tensile_virtual_node_stream_sessions{kind=\"logs\"}"))
            .and_then(|l| l.split_whitespace().last()?.parse::<i64>().ok())
            .unwrap_or(0)
    };
    let mut follow = tokio::process::Command::new(tensile_e2e::kubectl::binary_for(up()))
        .args(["--kubeconfig", &up().display().to_string()])
        .args(["-n", "quiet", "logs", "-f", "hush"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(follow.stdout.take().unwrap());
    let mut first = String::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut first),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(first, "quiet/hush app line 0\n");
    tensile_e2e::wait::within("one lower log stream open while kubectl follows", 10, || async {
        match open_streams().await {
            1 => Ok(()),
            n => Err(format!("{n} open")),
        }
    })
    .await;
    // The container stays quiet; kubectl goes.
    follow.kill().await.unwrap();
    tensile_e2e::wait::within("the lower log stream closed after kubectl went", 5, || async {
        match open_streams().await {
            0 => Ok(()),
            n => Err(format!("{n} still open")),
        }
    })
    .await;
}

/// A kubeconfig at `path` that reaches the upper apiserver with `token`, trusting `ca` (PEM),
/// as an in-cluster client of a lower pod would.
fn token_kubeconfig(path: &Path, server: &str, ca: &str, token: &str) {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca);
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: upper, cluster: {{server: \"{server}\", certificate-authority-data: {ca}}}}}]\n\
             users: [{{name: pod, user: {{token: \"{token}\"}}}}]\n\
             contexts: [{{name: pod, context: {{cluster: upper, user: pod}}}}]\ncurrent-context: pod\n"
        ),
    )
    .unwrap();
}

/// Key `key` of lower Secret `ns/name`, decoded; empty while it is not there.
async fn secret_key(lower: &TestCluster, ns: &str, name: &str, key: &str) -> String {
    use base64::Engine as _;
    let out = tensile_e2e::kubectl::run(
        lower.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "secret",
            name,
            "-o",
            &format!("jsonpath={{.data.{}}}", key.replace('.', "\\.")),
        ],
    )
    .await;
    let data = base64::engine::general_purpose::STANDARD
        .decode(out.stdout.trim())
        .unwrap_or_default();
    String::from_utf8(data).unwrap_or_default()
}

/// The token of lower Secret `tok/secret` once it is there and is not `before`.
async fn token_other_than(lower: &TestCluster, secret: &str, before: &str, what: &str) -> String {
    tensile_e2e::wait::until(
        what,
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            let t = secret_key(lower, "tok", secret, "token-0").await;
            (!t.is_empty() && t != before)
                .then_some(t)
                .ok_or_else(|| format!("no token but the one before ({})", before.len()))
        },
    )
    .await
    .unwrap()
}

/// `--upper-service-account-tokens`: a pod whose upper spec mounts its account's token gets,
/// below, a token of the upper cluster for that account, mounted where in-cluster clients
/// look, with KUBERNETES_SERVICE_HOST/PORT naming the upper endpoint. The token authenticates
/// upstream as the pod's ServiceAccount and may do what it may and nothing more; it is renewed
/// before it expires; once the upper pod is deleted it no longer authenticates and its Secret
/// goes with the lower pod. A pod of a namespace the mode does not cover gets nothing.
#[tokio::test]
async fn a_pod_below_reaches_the_upper_api_as_its_own_service_account_while_its_upper_pod_lives() {
    let bed = bed();
    let node = "vn-tokens";
    let server = bed.upper.url();
    let _vn = VirtualNode::start_with(node, &bed.lower_a, |args| {
        args.tokens.upper_tokens = true;
        args.tokens.upper_api_endpoint = Some(server.clone());
        args.tokens.token_namespaces = vec!["tok".into()];
        // Tokens of 3607 s renewed after 18 s instead of 48 min.
        args.tokens.renew_at = 0.005;
    });
    wait_ready(node).await;
    for ns in ["tok", "plain"] {
        bed.upper.create_namespace(ns).await.unwrap();
    }
    apply(
        up(),
        r#"
apiVersion: v1
kind: ServiceAccount
metadata: {name: reader, namespace: tok}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: reader, namespace: tok}
rules: [{apiGroups: [""], resources: [pods], verbs: [get, list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader, namespace: tok}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: reader}
subjects: [{kind: ServiceAccount, name: reader, namespace: tok}]
"#,
    )
    .await;
    // Admission mounts the account's token as a projected volume once the account exists.
    scene::shows(
        up(),
        "tok",
        "serviceaccount/reader",
        "jsonpath={.metadata.name}",
        "reader",
        30,
    )
    .await;
    let talker = |ns: &str, name: &str, account: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  serviceAccountName: {account}
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers: [{{name: app, image: busybox}}]
"#
        )
    };
    apply(up(), &talker("tok", "talker", "reader")).await;
    apply(up(), &talker("plain", "quiet", "default")).await;
    for (ns, name) in [("tok", "talker"), ("plain", "quiet")] {
        scene::pod_running(up(), ns, name, 90).await;
    }
    let uid = scene::pod_field(up(), "tok", "talker", "jsonpath={.metadata.uid}").await;
    let secret = format!("tensile-upper-token-{uid}");
    let low = bed.lower_a.kubeconfig();

    // The lower pod mounts the Secret where the upper pod mounts its token, and its
    // in-cluster clients go to the upper endpoint.
    let lower_pod: serde_json::Value =
        serde_json::from_str(&scene::pod_field(low, "tok", "talker", "json").await).unwrap();
    let spec = &lower_pod["spec"];
    // Admission mounts the token as a projected volume (`kube-api-access-*`): below, its token
    // and CA sources read the Secret; the namespace still comes from the downward API.
    let volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| {
            v["projected"]["sources"].as_array().is_some_and(|sources| {
                let reads = |key: &str| {
                    sources.iter().any(|s| {
                        s["secret"]["name"] == secret.as_str() && s["secret"]["items"][0]["key"] == key
                    })
                };
                reads("token-0") && reads("ca.crt")
            })
        })
        .unwrap_or_else(|| panic!("no volume reads {secret}: {spec}"));
    assert!(
        !volume["projected"]["sources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s.get("serviceAccountToken").is_some()),
        "no lower token is asked for: {volume}"
    );
    let mounted = spec["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| {
            m["name"] == volume["name"] && m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
        });
    assert!(mounted, "{spec}");
    let port = server.rsplit(':').next().unwrap();
    let env = &spec["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "KUBERNETES_SERVICE_HOST" && e["value"] == "127.0.0.1")
            && env
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == "KUBERNETES_SERVICE_PORT" && e["value"] == port),
        "{env}"
    );
    assert_eq!(
        spec["automountServiceAccountToken"], false,
        "the lower account's own token is not mounted"
    );

    // The token authenticates upstream as the pod's account, with its rights and no more.
    let first = token_other_than(&bed.lower_a, &secret, "", "the token below").await;
    let ca = secret_key(&bed.lower_a, "tok", &secret, "ca.crt").await;
    assert_eq!(secret_key(&bed.lower_a, "tok", &secret, "namespace").await, "tok");
    let as_pod = bed.lower_a.dir().join("talker.kubeconfig");
    token_kubeconfig(&as_pod, &server, &ca, &first);
    let can = |args: &'static [&'static str]| {
        let as_pod = as_pod.clone();
        async move { tensile_e2e::kubectl::run(&as_pod, args).await }
    };
    assert_eq!(
        can(&["auth", "can-i", "list", "pods", "-n", "tok"])
            .await
            .stdout
            .trim(),
        "yes"
    );
    assert_eq!(
        can(&["auth", "can-i", "list", "secrets", "-n", "tok"])
            .await
            .stdout
            .trim(),
        "no"
    );
    let listed = can(&["-n", "tok", "get", "pods", "-o", "name"]).await;
    assert!(
        listed.ok && listed.stdout.contains("pod/talker"),
        "{} {}",
        listed.stdout,
        listed.stderr
    );
    let elsewhere = can(&["-n", "default", "get", "pods"]).await;
    assert!(
        !elsewhere.ok
            && elsewhere
                .stderr
                .contains(r#"User "system:serviceaccount:tok:reader" cannot list resource "pods""#),
        "{}",
        elsewhere.stderr
    );

    // Renewed before it expires (at 0.5 % of its life here): a new token, which works too.
    let renewed = token_other_than(&bed.lower_a, &secret, &first, "a renewed token").await;
    token_kubeconfig(&as_pod, &server, &ca, &renewed);
    assert_eq!(
        can(&["auth", "can-i", "list", "pods", "-n", "tok"])
            .await
            .stdout
            .trim(),
        "yes"
    );

    // A lower admin who deletes the Secret gets a fresh one back, with a fresh token.
    kubectl(low, &["-n", "tok", "delete", "secret", &secret]).await;
    let fresh = token_other_than(&bed.lower_a, &secret, &renewed, "the Secret made again").await;
    token_kubeconfig(&as_pod, &server, &ca, &fresh);
    assert_eq!(
        can(&["auth", "can-i", "list", "pods", "-n", "tok"])
            .await
            .stdout
            .trim(),
        "yes"
    );

    // A pod of a namespace the mode does not cover gets nothing.
    let quiet: serde_json::Value =
        serde_json::from_str(&scene::pod_field(low, "plain", "quiet", "json").await).unwrap();
    assert!(
        !quiet["spec"].to_string().contains("tensile-upper-token-")
            && quiet["spec"]["automountServiceAccountToken"] == false,
        "{}",
        quiet["spec"]
    );
    let none = kubectl(low, &["-n", "plain", "get", "secrets", "-o", "name"]).await;
    assert!(!none.contains("tensile-upper-token-"), "{none}");

    // Deleted upstream: the token stops authenticating, and its Secret goes with the lower pod.
    kubectl(
        up(),
        &[
            "-n",
            "tok",
            "delete",
            "pod",
            "talker",
            "--wait=true",
            "--timeout=60s",
        ],
    )
    .await;
    tensile_e2e::wait::must(
        "the token refused",
        Duration::from_secs(30),
        Duration::from_secs(1),
        || async {
            let out = can(&["auth", "can-i", "list", "pods", "-n", "tok"]).await;
            if !out.ok && (out.stderr.contains("Unauthorized") || out.stderr.contains("must be logged in")) {
                Ok(())
            } else {
                Err(format!("{} {}", out.stdout, out.stderr))
            }
        },
    )
    .await;
    let field = format!("metadata.name={secret}");
    eventually(
        low,
        "the token Secret gone",
        60,
        &[
            "-n",
            "tok",
            "get",
            "secrets",
            "-o",
            "name",
            "--field-selector",
            &field,
        ],
        "",
    )
    .await;
}

/// A projected volume is judged source by source: a token beside a Secret never mounts the
/// lower Secret of that name (another tenant's, in a namespace shared below), and without
/// upper tokens the pod's own sources still travel. Run over lower-b, the bed's oldest supported
/// version.
#[tokio::test]
async fn a_token_in_a_projected_volume_carries_no_lower_secret_and_drops_no_source_of_the_pod() {
    let bed = bed();
    let node = "vn-projected";
    let server = bed.upper.url();
    let _vn = VirtualNode::start_with(node, &bed.lower_b, |args| {
        args.tokens.upper_tokens = true;
        args.tokens.upper_api_endpoint = Some(server.clone());
        args.tokens.token_namespaces = vec!["projtok".into()];
    });
    wait_ready(node).await;
    let low = bed.lower_b.kubeconfig();
    let pod = |ns: &str, name: &str, source: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  terminationGracePeriodSeconds: 1
  containers: [{{name: app, image: busybox, volumeMounts: [{{name: mixed, mountPath: /mixed}}]}}]
  volumes:
  - name: mixed
    projected:
      sources:
      - serviceAccountToken: {{path: token, expirationSeconds: 3600}}
      - {source}
"#
        )
    };
    let phase = |ns: &'static str, name: &'static str| async move {
        scene::pod_running(up(), ns, name, 90).await;
    };
    for ns in ["projtok", "projplain"] {
        namespace(ns).await;
    }
    // A first pod makes the namespace below; then someone else's Secret lives there.
    apply(
        up(),
        &pod(
            "projtok",
            "first",
            "downwardAPI: {items: [{path: podname, fieldRef: {fieldPath: metadata.name}}]}",
        ),
    )
    .await;
    phase("projtok", "first").await;
    kubectl(
        low,
        &[
            "-n",
            "projtok",
            "create",
            "secret",
            "generic",
            "db-root",
            "--from-literal=password=lower-only",
        ],
    )
    .await;

    // The Secret exists below only: the pod waits for it upstream, and nothing mounts it.
    apply(up(), &pod("projtok", "thief", "secret: {name: db-root}")).await;
    let synced = format!(
        "jsonpath={{.status.conditions[?(@.type==\"{}\")].reason}}",
        tensile_common::names::CONDITION_LOWER_SYNCED
    );
    scene::pod_shows(up(), "projtok", "thief", &synced, "ReferenceMissing", 60).await;
    // Made upstream too: the lower one is someone else's, never replaced nor mounted.
    kubectl(
        up(),
        &[
            "-n",
            "projtok",
            "create",
            "secret",
            "generic",
            "db-root",
            "--from-literal=password=upper",
        ],
    )
    .await;
    scene::pod_shows(up(), "projtok", "thief", &synced, "Conflict", 60).await;
    let below = tensile_e2e::kubectl::run(low, &["-n", "projtok", "get", "pod", "thief"]).await;
    assert!(
        !below.ok && below.stderr.contains("NotFound"),
        "{}{}",
        below.stdout,
        below.stderr
    );
    let kept = scene::field(low, "projtok", "secret/db-root", "jsonpath={.data.password}").await;
    assert_eq!(kept, "bG93ZXItb25seQ==", "the lower Secret is untouched");

    // Without upper tokens the pod's own ConfigMap source travels and is mounted below.
    kubectl(
        up(),
        &[
            "-n",
            "projplain",
            "create",
            "configmap",
            "settings",
            "--from-literal=mode=fast",
        ],
    )
    .await;
    apply(up(), &pod("projplain", "reader", "configMap: {name: settings}")).await;
    phase("projplain", "reader").await;
    let sources = scene::pod_field(
        low,
        "projplain",
        "reader",
        "jsonpath={.spec.volumes[?(@.name==\"mixed\")].projected.sources[*].configMap.name}",
    )
    .await;
    assert_eq!(sources, "settings", "the ConfigMap source is mounted below");
    let copied = scene::field(low, "projplain", "configmap/settings", "jsonpath={.data.mode}").await;
    assert_eq!(copied, "fast");
    for ns in ["projtok", "projplain"] {
        kubectl(up(), &["-n", ns, "delete", "pod", "--all", "--wait=true"]).await;
    }
}

/// One tenant cannot shut the kubelet API for the others: followed logs take slots of the
/// long-lived streams, one namespace holds at most its share, the next is refused saying
/// which bound, and another namespace's logs still stream. The apiserver's log calls share
/// HTTP/2 connections instead of taking one connection each.
#[tokio::test]
async fn followed_logs_of_one_namespace_keep_a_share_for_the_others_and_share_connections() {
    let bed = bed();
    let vn = VirtualNode::start_with("vn-fair", &bed.lower_a, |args| {
        args.kubelet.max_stream_sessions = 6;
        args.kubelet.max_stream_sessions_per_namespace = 3;
    });
    wait_ready("vn-fair").await;
    let quiet = format!("{}: \"lines=1\"", tensile_common::names::SIM_BEHAVIOR);
    for ns in ["fair-a", "fair-b"] {
        namespace(ns).await;
        apply(up(), &pod(ns, "hush", "vn-fair", "Always", &quiet, "10m")).await;
    }
    for ns in ["fair-a", "fair-b"] {
        scene::pod_running(up(), ns, "hush", 60).await;
    }
    let follow = |ns: &str| {
        let mut child = tokio::process::Command::new(tensile_e2e::kubectl::binary_for(up()))
            .args(["--kubeconfig", &up().display().to_string()])
            .args(["-n", ns, "logs", "-f", "hush"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
        (child, stdout)
    };
    let first_line = |mut stdout: tokio::io::BufReader<tokio::process::ChildStdout>| async move {
        let mut line = String::new();
        let read = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line),
        )
        .await;
        assert!(matches!(read, Ok(Ok(n)) if n > 0), "a first line: {read:?}");
        line
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        let (child, stdout) = follow("fair-a");
        assert_eq!(first_line(stdout).await, "fair-a/hush app line 0\n");
        held.push(child);
    }
    // The apiserver multiplexes its calls to this node over HTTP/2: three streams, fewer
    // connections.
    let port = format!("sport = :{}", vn.kubelet_port);
    let ss = std::process::Command::new("ss")
        .args(["-Htn", "state", "established", &port])
        .output()
        .unwrap();
    let connections = String::from_utf8_lossy(&ss.stdout).lines().count();
    assert!(
        (1..3).contains(&connections),
        "three followed logs over {connections} connections"
    );
    // The namespace's fourth is refused (503: the apiserver says it cannot handle the
    // request), counted under the bound it met.
    let refused = tensile_e2e::kubectl::run(up(), &["-n", "fair-a", "logs", "-f", "hush"]).await;
    assert!(
        !refused.ok && refused.stderr.contains("unable to handle the request"),
        "{} {}",
        refused.stdout,
        refused.stderr
    );
    let metrics = tensile_e2e::in_process::admin_get(&vn.admin_addr, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default();
    let counted = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                r#"tensile_virtual_node_stream_refusals_total{kind="logs",reason="namespace_share"} "#,
            )
        })
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(counted.is_some_and(|n| n >= 1), "{metrics}");
    // Another namespace's log streams.
    let (mut other, stdout) = follow("fair-b");
    assert_eq!(first_line(stdout).await, "fair-b/hush app line 0\n");
    other.kill().await.unwrap();
    // A slot given back is free for the namespace again.
    held.pop().unwrap().kill().await.unwrap();
    tensile_e2e::wait::must(
        "a fair-a follow once one ended",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || async {
            let (mut child, stdout) = follow("fair-a");
            let mut line = String::new();
            let mut stdout = stdout;
            let read = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line),
            )
            .await;
            let _ = child.kill().await;
            match read {
                Ok(Ok(n)) if n > 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    for mut child in held {
        let _ = child.kill().await;
    }
}

/// Under a namespace scope the served namespaces are the lower cluster's users': by default no
/// upper token is written there, where anyone with `secrets get` below could act upstream as
/// the pod's account; the pod runs below without one. A namespace the operator lists gets
/// tokens.
#[tokio::test]
async fn under_a_namespace_scope_upper_tokens_go_only_where_the_operator_lists() {
    let bed = bed();
    let server = bed.upper.url();
    let low = bed.lower_a.kubeconfig();
    for ns in ["scoped-tok", "scoped-listed"] {
        namespace(ns).await;
        // The lower admin's namespaces, served as they are, with the quota a scoped node
        // shows as its room.
        bed.lower_a.create_namespace(ns).await.unwrap();
        apply(
            low,
            &format!(
                "{{apiVersion: v1, kind: ResourceQuota, metadata: {{name: room, namespace: {ns}}}, \
                 spec: {{hard: {{requests.cpu: '4', requests.memory: 8Gi, pods: '10'}}}}}}"
            ),
        )
        .await;
    }
    let start = |node: &'static str, listed: Vec<String>| {
        let server = server.clone();
        VirtualNode::start_with(node, &bed.lower_a, move |args| {
            args.lower.namespaces = vec!["scoped-tok".into(), "scoped-listed".into()];
            args.tokens.upper_tokens = true;
            args.tokens.upper_api_endpoint = Some(server);
            args.tokens.token_namespaces = listed;
        })
    };
    let _default = start("vn-scoped-tok", Vec::new());
    let _listed = start("vn-scoped-listed", vec!["scoped-listed".into()]);
    wait_ready("vn-scoped-tok").await;
    wait_ready("vn-scoped-listed").await;
    let talker = |ns: &str, node: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: talker, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  terminationGracePeriodSeconds: 1
  containers: [{{name: app, image: busybox, resources: {{requests: {{cpu: 10m, memory: 16Mi}}}}}}]
"#
        )
    };
    // Admission mounts the default account's token once the account exists.
    for ns in ["scoped-tok", "scoped-listed"] {
        scene::shows(
            up(),
            ns,
            "serviceaccount/default",
            "jsonpath={.metadata.name}",
            "default",
            30,
        )
        .await;
    }
    apply(up(), &talker("scoped-tok", "vn-scoped-tok")).await;
    apply(up(), &talker("scoped-listed", "vn-scoped-listed")).await;
    for ns in ["scoped-tok", "scoped-listed"] {
        let phase = &["-n", ns, "get", "pod", "talker", "-o", "jsonpath={.status.phase}"];
        let running = tensile_e2e::wait::until(
            &format!("{ns}/talker Running"),
            Duration::from_secs(90),
            Duration::from_millis(300),
            || async {
                match tensile_e2e::kubectl::run(up(), phase).await.stdout.trim() {
                    "Running" => Ok(()),
                    other => Err(other.to_owned()),
                }
            },
        )
        .await;
        if let Err(e) = running {
            let why =
                tensile_e2e::kubectl::run(up(), &["-n", ns, "get", "pod", "talker", "-o", "yaml"]).await;
            panic!("{e}\n{}", why.stdout);
        }
    }
    let token_secrets = |ns: &'static str| async move {
        kubectl(
            low,
            &["-n", ns, "get", "secrets", "-l", tokens_label(), "-o", "name"],
        )
        .await
    };
    // The listed namespace gets its Secret of upper tokens; the other gets none, and its
    // lower pod mounts no token.
    tensile_e2e::wait::must(
        "a Secret of upper tokens in the listed namespace",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            match token_secrets("scoped-listed").await {
                found if found.contains("tensile-upper-token-") => Ok(()),
                other => Err(other),
            }
        },
    )
    .await;
    assert_eq!(
        token_secrets("scoped-tok").await,
        "",
        "no upper token where others read Secrets"
    );
    let volumes = scene::pod_field(low, "scoped-tok", "talker", "jsonpath={.spec.volumes}").await;
    assert!(!volumes.contains("tensile-upper-token-"), "{volumes}");
    for ns in ["scoped-tok", "scoped-listed"] {
        kubectl(up(), &["-n", ns, "delete", "pod", "talker", "--wait=true"]).await;
    }
}

fn tokens_label() -> &'static str {
    tensile_common::lower::identity::TOKEN_LABEL
}

#[tokio::test]
async fn a_lower_pod_with_pod_level_requests_takes_its_requests_from_the_room_shown() {
    let bed = bed();
    let ns = "pod-level";
    let low = bed.lower_a.kubeconfig();
    bed.lower_a.create_namespace(ns).await.unwrap();
    apply(
        low,
        &format!(
            "{{apiVersion: v1, kind: ResourceQuota, metadata: {{name: room, namespace: {ns}}}, \
             spec: {{hard: {{requests.cpu: '4', requests.memory: 8Gi, pods: '10'}}}}}}"
        ),
    )
    .await;
    // Scoped to one namespace, the node's room is its quota less the other pods there, so
    // the other tests' pods on lower-a change nothing this test reads.
    let _vn = VirtualNode::start_with("vn-pod-level", &bed.lower_a, |args| {
        args.lower.namespaces = vec![ns.into()];
    });
    wait_ready("vn-pod-level").await;
    let room = [
        "get",
        "node",
        "vn-pod-level",
        "-o",
        "jsonpath={.status.allocatable.cpu}/{.status.allocatable.memory}",
    ];
    eventually(up(), "the quota's room", 30, &room, "4/8589934592").await;

    // Someone else's pod in the served namespace, its requests on the pod level
    // (`spec.resources`, KEP-2837) and a little on its container.
    apply(
        low,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: pod-level, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 1
  resources: {{requests: {{cpu: 1500m, memory: 1Gi}}}}
  containers: [{{name: app, image: busybox, resources: {{requests: {{cpu: 100m, memory: 64Mi}}}}}}]
"#
        ),
    )
    .await;
    // The pod level is on by default from 1.34; a 1.33 apiserver drops it, and its scheduler
    // charges the container alone.
    let kept = scene::pod_field(low, ns, "pod-level", "jsonpath={.spec.resources.requests.cpu}").await;
    let minor: u32 = bed.lower_a.version().split('.').nth(1).unwrap().parse().unwrap();
    assert_eq!(
        kept,
        if minor >= 34 { "1500m" } else { "" },
        "pod level kept by {}",
        bed.lower_a.version()
    );
    let want = if minor >= 34 {
        "2500m/7516192768" // 4 - 1500m, 8Gi - 1Gi
    } else {
        "3900m/8522825728" // 4 - 100m, 8Gi - 64Mi
    };
    eventually(up(), "the room less the pod's requests", 30, &room, want).await;
    kubectl(low, &["-n", ns, "delete", "pod", "pod-level", "--wait=true"]).await;
    eventually(up(), "the whole room again", 30, &room, "4/8589934592").await;
}

/// A pod asking for pod-level resources is not created in a lower cluster whose apiserver
/// would drop them (it would run there charged for its containers alone), found out by a
/// dry run on that apiserver; a lower cluster that keeps them runs it. On the bed, lower-b
/// runs the oldest supported version (1.33, the feature off) and lower-a the newest.
#[tokio::test]
async fn a_pod_with_pod_level_requests_is_not_run_where_the_lower_apiserver_drops_them() {
    let bed = bed();
    let ns = "pod-level-up";
    bed.upper.create_namespace(ns).await.unwrap();
    let _a = VirtualNode::start_with("vn-level-a", &bed.lower_a, |_| {});
    let _b = VirtualNode::start_with("vn-level-b", &bed.lower_b, |_| {});
    wait_ready("vn-level-a").await;
    wait_ready("vn-level-b").await;
    let manifest = |name: &str, node: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 1
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  resources: {{requests: {{cpu: 500m, memory: 256Mi}}}}
  containers: [{{name: app, image: busybox}}]
"#
        )
    };
    apply(up(), &manifest("on-a", "vn-level-a")).await;
    apply(up(), &manifest("on-b", "vn-level-b")).await;
    let keeps = |c: &TestCluster| c.minor() >= 34;
    for (pod, lower) in [("on-a", &bed.lower_a), ("on-b", &bed.lower_b)] {
        let synced = condition("tensile.io/LowerPodSynced", &["status", "reason"]);
        if keeps(lower) {
            scene::pod_shows(
                lower.kubeconfig(),
                ns,
                pod,
                "jsonpath={.spec.resources.requests.cpu}",
                "500m",
                60,
            )
            .await;
        } else {
            scene::pod_shows(up(), ns, pod, &synced, "False/CreateFailed", 60).await;
            let message = scene::pod_field(
                up(),
                ns,
                pod,
                &condition("tensile.io/LowerPodSynced", &["message"]),
            )
            .await;
            assert!(
                message.contains("pod-level resources") && message.contains("1.34"),
                "the refusal says why: {message}"
            );
            let below = kubectl(lower.kubeconfig(), &["-n", ns, "get", "pods", "-o", "name"]).await;
            assert_eq!(below.trim(), "", "nothing made below in {}", lower.version());
        }
    }
}
