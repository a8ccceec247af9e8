//! The test bed is real: each test asserts what kubectl shows against real control planes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::time::Duration;

use serde_json::json;

use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};

struct Bed {
    cluster: TestCluster,
    sim: NodeSimulator,
}

static BED: Shared<Bed> = Shared::new();

/// One cluster with three simulated nodes, shared by the tests of this binary.
fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [cluster] = scene::clusters("testbed", ["shared"]).await?;
        let sim = scene::simulate(&cluster, scene::nodes("node", 3)).await?;
        Ok(Bed { cluster, sim })
    })
}

async fn kubectl(cluster: &TestCluster, args: &[&str]) -> String {
    tensile_e2e::check::kubectl(cluster.kubeconfig(), args).await
}

async fn apply(cluster: &TestCluster, manifest: &str) {
    tensile_e2e::check::apply(cluster.kubeconfig(), manifest).await
}

async fn eventually(cluster: &TestCluster, what: &str, secs: u64, args: &[&str], want: &str) {
    tensile_e2e::check::eventually(cluster.kubeconfig(), what, secs, args, want).await
}

#[tokio::test]
async fn two_clusters_have_separate_data() {
    let [a, b] = scene::clusters_with([
        ClusterOptions::new("two_clusters", "alpha").apiserver_only(),
        ClusterOptions::new("two_clusters", "beta").apiserver_only(),
    ])
    .await
    .unwrap();
    kubectl(&a, &["create", "namespace", "only-in-alpha"]).await;
    let in_a = kubectl(&a, &["get", "ns", "-o", "name"]).await;
    let in_b = kubectl(&b, &["get", "ns", "-o", "name"]).await;
    assert!(in_a.contains("namespace/only-in-alpha"), "{in_a}");
    assert!(!in_b.contains("only-in-alpha"), "{in_b}");
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        assert!(in_b.contains(&format!("namespace/{ns}")), "{in_b}");
    }
}

#[tokio::test]
async fn a_deployment_runs_on_simulated_nodes_and_logs_come_through_the_apiserver() {
    let c = &bed().cluster;
    c.create_namespace("deploy").await.unwrap();
    apply(
        c,
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: deploy}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: server, image: nginx}]
"#,
    )
    .await;
    eventually(
        c,
        "3 web pods Running",
        90,
        &[
            "-n",
            "deploy",
            "get",
            "pods",
            "-l",
            "app=web",
            "-o",
            "jsonpath={range .items[*]}{.status.phase} {end}",
        ],
        "Running Running Running",
    )
    .await;
    let wide = kubectl(c, &["-n", "deploy", "get", "pods", "-l", "app=web", "-o", "jsonpath={range .items[*]}{.metadata.name},{.spec.nodeName},{.status.podIP},{.status.containerStatuses[0].ready};{end}"]).await;
    let rows: Vec<&str> = wide.split(';').filter(|r| !r.is_empty()).collect();
    assert_eq!(rows.len(), 3, "{wide}");
    let mut ips = std::collections::HashSet::new();
    for row in &rows {
        let f: Vec<&str> = row.split(',').collect();
        assert!(
            f[1].starts_with("node-"),
            "bound by the real scheduler to a simulated node: {row}"
        );
        assert!(f[2].starts_with("10.244."), "pod IP from the node's range: {row}");
        assert_eq!(f[3], "true", "{row}");
        assert!(ips.insert(f[2].to_owned()), "pod IPs are unique: {wide}");
    }
    let pod = rows[0].split(',').next().unwrap();

    // Plain logs: deterministic lines naming the pod and container.
    let logs = kubectl(c, &["-n", "deploy", "logs", pod]).await;
    assert!(
        logs.starts_with(&format!("deploy/{pod} server line 0\n")),
        "{logs}"
    );
    // --tail and --timestamps.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tail = kubectl(c, &["-n", "deploy", "logs", pod, "--tail=2", "--timestamps"]).await;
    let lines: Vec<&str> = tail.lines().collect();
    assert_eq!(lines.len(), 2, "{tail}");
    for l in &lines {
        let (ts, text) = l.split_once(' ').unwrap();
        assert!(ts.parse::<jiff::Timestamp>().is_ok(), "timestamp first: {l}");
        assert!(text.starts_with(&format!("deploy/{pod} server line ")), "{l}");
    }
    // --limit-bytes cuts the stream.
    let limited = kubectl(c, &["-n", "deploy", "logs", pod, "--limit-bytes=5"]).await;
    assert_eq!(limited, "deplo");
    // -f keeps streaming new lines.
    let out = tokio::process::Command::new("timeout")
        .args([
            "3.5",
            tensile_e2e::kubectl::binary_for(c.kubeconfig()).to_str().unwrap(),
            "--kubeconfig",
            c.kubeconfig().to_str().unwrap(),
            "-n",
            "deploy",
            "logs",
            "-f",
            "--tail=1",
            pod,
        ])
        .output()
        .await
        .unwrap();
    let followed = String::from_utf8_lossy(&out.stdout);
    assert!(
        followed.lines().count() >= 3,
        "follow streams lines as they are written: {followed:?}"
    );
    // An unknown container is a clear client error.
    let bad = c.kubectl(&["-n", "deploy", "logs", pod, "-c", "nope"]).await;
    assert!(!bad.ok && bad.stderr.contains("nope"), "{}", bad.stderr);
}

#[tokio::test]
async fn an_oversized_pod_is_unschedulable() {
    let c = &bed().cluster;
    c.create_namespace("big").await.unwrap();
    apply(
        c,
        r#"
apiVersion: v1
kind: Pod
metadata: {name: huge, namespace: big}
spec:
  containers: [{name: c, image: x, resources: {requests: {cpu: "64"}}}]
"#,
    )
    .await;
    eventually(
        c,
        "PodScheduled=False/Unschedulable",
        60,
        &["-n", "big", "get", "pod", "huge", "-o", r#"jsonpath={.status.conditions[?(@.type=="PodScheduled")].status}/{.status.conditions[?(@.type=="PodScheduled")].reason}"#],
        "False/Unschedulable",
    )
    .await;
    let msg = kubectl(
        c,
        &[
            "-n",
            "big",
            "get",
            "pod",
            "huge",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="PodScheduled")].message}"#,
        ],
    )
    .await;
    assert!(msg.contains("Insufficient cpu"), "{msg}");
}

#[tokio::test]
async fn a_job_completes_and_a_failing_pod_shows_its_exit_code() {
    let c = &bed().cluster;
    c.create_namespace("jobs").await.unwrap();
    kubectl(c, &["-n", "jobs", "create", "job", "once", "--image=busybox"]).await;
    let waited = kubectl(
        c,
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
    eventually(
        c,
        "job succeeded count",
        10,
        &[
            "-n",
            "jobs",
            "get",
            "job",
            "once",
            "-o",
            "jsonpath={.status.succeeded}",
        ],
        "1",
    )
    .await;

    kubectl(
        c,
        &[
            "-n",
            "jobs",
            "run",
            "crash",
            "--image=x",
            "--restart=Never",
            "--annotations=tensile.io/sim=run=300ms,exit=7,reason=Error",
        ],
    )
    .await;
    eventually(
        c,
        "pod Failed",
        60,
        &[
            "-n",
            "jobs",
            "get",
            "pod",
            "crash",
            "-o",
            "jsonpath={.status.phase}",
        ],
        "Failed",
    )
    .await;
    let term = kubectl(c, &["-n", "jobs", "get", "pod", "crash", "-o", "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}/{.status.containerStatuses[0].state.terminated.reason}"]).await;
    assert_eq!(term, "7/Error");

    // restartPolicy Always with a limited restart budget: restarts, then CrashLoopBackOff.
    kubectl(
        c,
        &[
            "-n",
            "jobs",
            "run",
            "flaky",
            "--image=x",
            "--annotations=tensile.io/sim=run=300ms,exit=1,restarts=2,backoff=100ms",
        ],
    )
    .await;
    eventually(
        c,
        "two restarts then CrashLoopBackOff",
        60,
        &["-n", "jobs", "get", "pod", "flaky", "-o", "jsonpath={.status.containerStatuses[0].restartCount}/{.status.containerStatuses[0].state.waiting.reason}"],
        "2/CrashLoopBackOff",
    )
    .await;

    // A typo in the annotation fails the pod with a message naming it.
    kubectl(
        c,
        &[
            "-n",
            "jobs",
            "run",
            "typo",
            "--image=x",
            "--annotations=tensile.io/sim=colour=red",
        ],
    )
    .await;
    eventually(
        c,
        "invalid simulation reported",
        60,
        &[
            "-n",
            "jobs",
            "get",
            "pod",
            "typo",
            "-o",
            "jsonpath={.status.reason}",
        ],
        "InvalidSimulation",
    )
    .await;
    let msg = kubectl(
        c,
        &[
            "-n",
            "jobs",
            "get",
            "pod",
            "typo",
            "-o",
            "jsonpath={.status.message}",
        ],
    )
    .await;
    assert!(msg.contains("colour"), "{msg}");
}

#[tokio::test]
async fn graceful_deletion_leaves_nothing_terminating() {
    let c = &bed().cluster;
    c.create_namespace("deletion").await.unwrap();
    kubectl(
        c,
        &[
            "-n",
            "deletion",
            "create",
            "deployment",
            "gone",
            "--image=x",
            "--replicas=4",
        ],
    )
    .await;
    kubectl(
        c,
        &[
            "-n",
            "deletion",
            "run",
            "slow",
            "--image=x",
            "--annotations=tensile.io/sim=stop=2s",
        ],
    )
    .await;
    eventually(
        c,
        "5 pods Running",
        90,
        &[
            "-n",
            "deletion",
            "get",
            "pods",
            "-o",
            "jsonpath={range .items[*]}{.status.phase} {end}",
        ],
        "Running Running Running Running Running",
    )
    .await;
    let started = std::time::Instant::now();
    // kubectl delete waits until the objects are really gone, like a user would.
    kubectl(
        c,
        &["-n", "deletion", "delete", "pod", "slow", "--grace-period=30"],
    )
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "the container takes its 2 s to stop: {took:?}"
    );
    assert!(
        took < Duration::from_secs(20),
        "deletion ends well within the grace period: {took:?}"
    );
    kubectl(c, &["-n", "deletion", "delete", "deployment", "gone"]).await;
    eventually(
        c,
        "no pods left",
        60,
        &["-n", "deletion", "get", "pods", "-o", "name"],
        "",
    )
    .await;
}

#[tokio::test]
async fn a_node_without_heartbeat_becomes_unreachable_and_recovers() {
    let c = TestCluster::start(ClusterOptions::new("heartbeat", "hb"))
        .await
        .unwrap();
    let mut options = SimulatorOptions::new("hb", Some(c.kubelet_client_ca_pem()));
    options.lease_renew = Duration::from_secs(2);
    let sim = NodeSimulator::start(
        c.client().await.unwrap(),
        options,
        vec![NodeConfig::new("steady"), NodeConfig::new("silent")],
    )
    .await
    .unwrap();
    let ready = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;
    eventually(
        &c,
        "silent Ready",
        30,
        &["get", "node", "silent", "-o", ready],
        "True",
    )
    .await;
    sim.stop_heartbeat("silent").unwrap();
    let started = std::time::Instant::now();
    // Grace 20 s, monitor period 2 s: Unknown after ~21 s.
    eventually(
        &c,
        "silent Unknown",
        45,
        &["get", "node", "silent", "-o", ready],
        "Unknown",
    )
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(15),
        "not before the grace period: {took:?}"
    );
    eventually(
        &c,
        "unreachable taint",
        20,
        &["get", "node", "silent", "-o", "jsonpath={.spec.taints[*].key}"],
        "node.kubernetes.io/unreachable node.kubernetes.io/unreachable",
    )
    .await;
    let steady = kubectl(&c, &["get", "node", "steady", "-o", ready]).await;
    assert_eq!(steady, "True", "the other node keeps its heartbeat");

    sim.resume_heartbeat("silent").unwrap();
    eventually(
        &c,
        "silent Ready again",
        30,
        &["get", "node", "silent", "-o", ready],
        "True",
    )
    .await;
    eventually(
        &c,
        "taints removed",
        30,
        &["get", "node", "silent", "-o", "jsonpath={.spec.taints}"],
        "",
    )
    .await;
}

/// The pod status a simulated kubelet writes is what a kubelet of the cluster's version
/// writes: a sidecar (a restartable init container) runs and is ready beside the main
/// container while a plain init container shows Completed, `PodReadyToStartContainers` is
/// among the conditions, and, from 1.35 (GA; beta and on in 1.34, alpha and off in 1.33), the
/// status and each condition say which generation of the pod they describe. On the oldest
/// supported version the apiserver drops `observedGeneration`, as a 1.33 kubelet never
/// writes it.
#[tokio::test]
async fn pod_status_is_written_as_a_kubelet_of_the_clusters_version_writes_it() {
    let newest = &bed().cluster;
    let [oldest] =
        scene::clusters_with([ClusterOptions::new("kubelet-contract", "oldest").version("oldest")])
            .await
            .unwrap();
    let _sim = scene::simulate(&oldest, scene::nodes("node", 1)).await.unwrap();
    for (cluster, tracks_generation) in [(newest, true), (&oldest, false)] {
        let version = cluster.version();
        apply(
            cluster,
            r#"
apiVersion: v1
kind: Pod
metadata: {name: sidecar, namespace: default}
spec:
  nodeName: node-0
  initContainers:
  - {name: setup, image: busybox}
  - {name: proxy, image: envoy, restartPolicy: Always}
  containers: [{name: app, image: nginx}]
"#,
        )
        .await;
        eventually(
            cluster,
            &format!("the sidecar pod Ready on {version}"),
            60,
            &[
                "get",
                "pod",
                "sidecar",
                "-o",
                r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
            ],
            "True",
        )
        .await;
        let pod: serde_json::Value =
            serde_json::from_str(&kubectl(cluster, &["get", "pod", "sidecar", "-o", "json"]).await).unwrap();
        let status = &pod["status"];
        let generation = &pod["metadata"]["generation"];
        let conditions = status["conditions"].as_array().unwrap();
        let condition = |kind: &str| {
            conditions
                .iter()
                .find(|c| c["type"] == kind)
                .unwrap_or_else(|| panic!("{version}: no {kind} in {conditions:?}"))
        };
        for kind in [
            "PodReadyToStartContainers",
            "Initialized",
            "ContainersReady",
            "Ready",
        ] {
            assert_eq!(condition(kind)["status"], "True", "{version}: {kind}");
        }
        let init = status["initContainerStatuses"].as_array().unwrap();
        let setup = init.iter().find(|c| c["name"] == "setup").unwrap();
        let proxy = init.iter().find(|c| c["name"] == "proxy").unwrap();
        assert_eq!(
            setup["state"]["terminated"]["reason"], "Completed",
            "{version}: {setup}"
        );
        assert_eq!(setup["ready"], false, "{version}: {setup}");
        assert!(proxy["state"]["running"].is_object(), "{version}: {proxy}");
        assert_eq!(
            (&proxy["ready"], &proxy["started"]),
            (&json!(true), &json!(true)),
            "{version}"
        );
        if tracks_generation {
            assert_eq!(generation, &json!(1), "{version}");
            assert_eq!(&status["observedGeneration"], generation, "{version}: {status}");
            for c in conditions {
                assert_eq!(&c["observedGeneration"], generation, "{version}: {c}");
            }
        } else {
            assert!(status.get("observedGeneration").is_none(), "{version}: {status}");
            assert!(
                conditions.iter().all(|c| c.get("observedGeneration").is_none()),
                "{version}: {conditions:?}"
            );
        }
        kubectl(cluster, &["delete", "pod", "sidecar", "--wait=false"]).await;
    }
}

#[tokio::test]
async fn dropping_a_cluster_leaves_no_process_and_the_apiserver_restarts_with_its_data() {
    let c = TestCluster::start(ClusterOptions::new("drop", "ephemeral"))
        .await
        .unwrap();
    kubectl(&c, &["create", "configmap", "kept", "--from-literal=k=v"]).await;
    c.stop_apiserver();
    let down = c
        .kubectl(&["get", "configmap", "kept", "--request-timeout=3s"])
        .await;
    assert!(!down.ok, "the apiserver is down");
    c.start_apiserver().await.unwrap();
    let back = kubectl(&c, &["get", "configmap", "kept", "-o", "jsonpath={.data.k}"]).await;
    assert_eq!(back, "v", "data survives an apiserver restart");

    let pids = c.pids();
    assert_eq!(
        pids.len(),
        3,
        "apiserver, scheduler, controller-manager: {pids:?}"
    );
    assert!(pids.iter().all(|p| tensile_e2e::process::pid_alive(*p)));
    drop(c);
    for pid in pids {
        assert!(
            !tensile_e2e::process::pid_alive(pid),
            "process {pid} outlived its cluster"
        );
    }
}

#[tokio::test]
async fn the_kubelet_endpoint_admits_only_the_apiservers_client_certificate() {
    let bed = bed();
    let url = format!(
        "https://{}:{}/healthz",
        tensile_e2e::node_ip().unwrap(),
        bed.sim.kubelet_port()
    );
    let pki = bed.cluster.dir().join("pki");
    let anonymous = tokio::process::Command::new("curl")
        .args(["-sk", "--max-time", "5", &url])
        .output()
        .await
        .unwrap();
    assert!(
        !anonymous.status.success(),
        "a caller without a certificate is refused"
    );
    let admin_cert = bed.cluster.dir().join("pki/apiserver.crt");
    let admin_key = bed.cluster.dir().join("pki/apiserver.key");
    let wrong_ca = tokio::process::Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "--cert",
            admin_cert.to_str().unwrap(),
            "--key",
            admin_key.to_str().unwrap(),
            &url,
        ])
        .output()
        .await
        .unwrap();
    assert!(
        !wrong_ca.status.success(),
        "a certificate from another CA is refused"
    );
    let cert = pki.join("kubelet-client.crt");
    let key = pki.join("kubelet-client.key");
    let ok = tokio::process::Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "--cert",
            cert.to_str().unwrap(),
            "--key",
            key.to_str().unwrap(),
            &url,
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&ok.stdout), "ok");
}

#[tokio::test]
async fn the_testbed_binary_starts_clusters_and_tears_them_down() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_testbed"))
        .args([
            "up",
            "--dir",
            dir.path().to_str().unwrap(),
            "--cluster",
            "up",
            "--cluster",
            "low:nodes=2,cpu=2",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(line.starts_with("testbed ready: up="), "{line}");
    let low = dir.path().join("low.kubeconfig");
    assert!(dir.path().join("low.kubelet-client-ca.crt").is_file());
    let nodes = tensile_e2e::kubectl::run(
        &low,
        &[
            "get",
            "nodes",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.status.capacity.cpu} {end}",
        ],
    )
    .await;
    assert_eq!(
        nodes.stdout.trim(),
        "low-node-0=2 low-node-1=2",
        "{}",
        nodes.stderr
    );
    let ns = tensile_e2e::kubectl::run(
        &dir.path().join("up.kubeconfig"),
        &["get", "ns", "default", "-o", "name"],
    )
    .await;
    assert_eq!(ns.stdout.trim(), "namespace/default", "{}", ns.stderr);

    let pid = child.id().unwrap();
    let children = std::process::Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .unwrap();
    let children: Vec<u32> = String::from_utf8_lossy(&children.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    assert!(
        children.len() >= 7,
        "etcd + 2 x (apiserver, scheduler, controller-manager): {children:?}"
    );
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    for p in children {
        assert!(
            !tensile_e2e::process::pid_alive(p),
            "process {p} outlived the testbed"
        );
    }
}
