//! The test bed is real: each test asserts what kubectl shows against real control planes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::time::Duration;

use serde_json::{Value, json};

use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};

struct Bed {
    cluster: TestCluster,
    sim: NodeSimulator,
}

static BED: Shared<Bed> = Shared::new();
static OLDEST: Shared<Bed> = Shared::new();

/// One cluster with three simulated nodes, shared by the tests of this binary, and the
/// resize tests' nodes.
fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [cluster] = scene::clusters("testbed", ["shared"]).await?;
        let sim = scene::simulate(&cluster, bed_nodes(3)).await?;
        Ok(Bed { cluster, sim })
    })
}

/// A cluster of the oldest supported version, for the tests of the kubelet contract that
/// compare a kubelet of that version with the newest: one node, and the resize tests' nodes.
fn oldest() -> &'static Bed {
    OLDEST.bed(|| async {
        let [cluster] =
            scene::clusters_with([ClusterOptions::new("kubelet-contract", "oldest").version("oldest")])
                .await?;
        let sim = scene::simulate(&cluster, bed_nodes(1)).await?;
        Ok(Bed { cluster, sim })
    })
}

/// `node-0` … `node-<count - 1>`, then the nodes of the resize tests, 2 CPUs and 4 GiB each,
/// tainted so that the scheduler leaves them to the pods those tests bind by name.
fn bed_nodes(count: usize) -> Vec<NodeConfig> {
    let resize = |name: &str| {
        NodeConfig::new(name)
            .resource("cpu", "2")
            .resource("memory", "4Gi")
            .taint("tensile.io/test", "resize", "NoSchedule")
    };
    let mut nodes = scene::nodes("node", count);
    nodes.extend([
        resize("resize-fits"),
        resize("resize-small"),
        resize("resize-static").static_cpu_manager(),
        resize("resize-busy"),
    ]);
    nodes
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
    for (cluster, tracks_generation) in [(&bed().cluster, true), (&oldest().cluster, false)] {
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

/// Polls pod `default/name` until `ready` holds of its JSON; returns that JSON.
async fn pod_until(
    cluster: &TestCluster,
    name: &str,
    what: &str,
    secs: u64,
    ready: impl Fn(&Value) -> bool,
) -> Value {
    let ready = &ready;
    tensile_e2e::wait::must(
        &format!("{what} on {}", cluster.version()),
        Duration::from_secs(secs),
        Duration::from_millis(300),
        || async move {
            let out = cluster.kubectl(&["get", "pod", name, "-o", "json"]).await;
            let pod: Value = serde_json::from_str(&out.stdout).map_err(|e| format!("{e}: {}", out.stderr))?;
            if ready(&pod) {
                Ok(pod)
            } else {
                Err(pod["status"].to_string())
            }
        },
    )
    .await
}

/// The condition `kind` of a pod's status.
fn condition<'a>(pod: &'a Value, kind: &str) -> Option<&'a Value> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// The status of container `name` in the pod's `list` (`containerStatuses`,
/// `initContainerStatuses`); null while there is none.
fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    static NONE: Value = Value::Null;
    pod["status"][list]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["name"] == name))
        .unwrap_or(&NONE)
}

fn resized(pod: &Value) -> bool {
    condition(pod, "PodResizePending").is_none() && condition(pod, "PodResizeInProgress").is_none()
}

/// `kubectl patch pod NAME --subresource resize` with a strategic merge of `patch`.
async fn resize(cluster: &TestCluster, name: &str, patch: &str) {
    kubectl(
        cluster,
        &["patch", "pod", name, "--subresource", "resize", "-p", patch],
    )
    .await;
}

/// Each condition, and the status, names the pod's generation on a version that tracks it
/// (1.35+); the oldest supported version's apiserver drops the field.
fn generation_observed(pod: &Value, newest: bool) {
    let conditions = pod["status"]["conditions"].as_array().unwrap();
    if newest {
        let generation = &pod["metadata"]["generation"];
        assert_eq!(
            &pod["status"]["observedGeneration"], generation,
            "{}",
            pod["status"]
        );
        for c in conditions {
            assert_eq!(&c["observedGeneration"], generation, "{c}");
        }
    } else {
        assert!(
            pod["status"].get("observedGeneration").is_none(),
            "{}",
            pod["status"]
        );
        assert!(
            conditions.iter().all(|c| c.get("observedGeneration").is_none()),
            "{conditions:?}"
        );
    }
}

/// An in-place resize that fits (KEP-1287: beta and on in 1.33, GA in 1.35): the kubelet
/// allocates the new requests at once (`allocatedResources` of the container's status), shows
/// `PodResizeInProgress` until the container runs with them (`resources`), then drops the
/// condition; the container whose `resizePolicy` says `RestartContainer` for a changed
/// resource restarts. A sidecar's status carries its resources too. On 1.37 the pod's
/// status carries the pod-level totals (`allocatedResources`, `resources`: the pod-level
/// resize, beta and on from 1.36), and a pod-level resize is allocated the same way; the
/// 1.33 apiserver drops those fields and `observedGeneration`.
#[tokio::test]
async fn a_resize_that_fits_is_allocated_then_actuated_as_the_clusters_kubelet_shows_it() {
    for (cluster, newest) in [(&bed().cluster, true), (&oldest().cluster, false)] {
        let version = cluster.version();
        apply(
            cluster,
            r#"
apiVersion: v1
kind: Pod
metadata: {name: resize-fits, namespace: default, annotations: {tensile.io/sim: "resize=3s"}}
spec:
  nodeName: resize-fits
  initContainers:
  - name: proxy
    image: envoy
    restartPolicy: Always
    resources: {requests: {cpu: 50m, memory: 32Mi}}
  containers:
  - name: app
    image: nginx
    resizePolicy: [{resourceName: memory, restartPolicy: RestartContainer}]
    resources: {requests: {cpu: 100m, memory: 64Mi}, limits: {cpu: 200m, memory: 128Mi}}
"#,
        )
        .await;
        let pod = pod_until(cluster, "resize-fits", "resize-fits Running", 60, |p| {
            p["status"]["phase"] == "Running"
        })
        .await;
        let app = container(&pod, "containerStatuses", "app");
        assert_eq!(
            app["allocatedResources"],
            json!({"cpu": "100m", "memory": "64Mi"}),
            "{version}: {app}"
        );
        assert_eq!(
            app["resources"],
            json!({"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}}),
            "{version}: {app}"
        );
        let proxy = container(&pod, "initContainerStatuses", "proxy");
        assert_eq!(
            proxy["allocatedResources"],
            json!({"cpu": "50m", "memory": "32Mi"}),
            "{version}: {proxy}"
        );
        if newest {
            assert_eq!(
                pod["status"]["allocatedResources"],
                json!({"cpu": "150m", "memory": "96Mi"}),
                "{version}"
            );
            assert_eq!(
                pod["status"]["resources"]["requests"],
                json!({"cpu": "150m", "memory": "96Mi"}),
                "{version}"
            );
        } else {
            assert!(
                pod["status"].get("allocatedResources").is_none(),
                "{version}: {}",
                pod["status"]
            );
            assert!(
                pod["status"].get("resources").is_none(),
                "{version}: {}",
                pod["status"]
            );
        }

        resize(
            cluster,
            "resize-fits",
            r#"{"spec":{"containers":[{"name":"app","resources":{"requests":{"cpu":"150m","memory":"96Mi"}}}]}}"#,
        )
        .await;
        let pod = pod_until(cluster, "resize-fits", "the resize in progress", 20, |p| {
            condition(p, "PodResizeInProgress").is_some()
        })
        .await;
        let app = container(&pod, "containerStatuses", "app");
        assert_eq!(
            app["allocatedResources"],
            json!({"cpu": "150m", "memory": "96Mi"}),
            "{version}: {app}"
        );
        assert_eq!(
            app["resources"]["requests"],
            json!({"cpu": "100m", "memory": "64Mi"}),
            "{version}: {app}"
        );
        assert_eq!(
            condition(&pod, "PodResizeInProgress").unwrap()["status"],
            "True",
            "{version}"
        );
        generation_observed(&pod, newest);

        let pod = pod_until(cluster, "resize-fits", "the resize done", 20, resized).await;
        let app = container(&pod, "containerStatuses", "app");
        assert_eq!(
            app["resources"],
            json!({"requests": {"cpu": "150m", "memory": "96Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}}),
            "{version}: {app}"
        );
        assert_eq!(
            app["restartCount"], 1,
            "memory's resizePolicy restarts the container: {version}: {app}"
        );
        assert!(app["state"]["running"].is_object(), "{version}: {app}");
        generation_observed(&pod, newest);
        if newest {
            assert_eq!(pod["metadata"]["generation"], 2, "{version}");
            assert_eq!(
                pod["status"]["allocatedResources"],
                json!({"cpu": "200m", "memory": "128Mi"}),
                "{version}"
            );
        }
        kubectl(cluster, &["delete", "pod", "resize-fits", "--wait=false"]).await;
    }

    // The pod-level resize (KEP-2837 with KEP-1287, beta and on from 1.36).
    let cluster = &bed().cluster;
    apply(
        cluster,
        r#"
apiVersion: v1
kind: Pod
metadata: {name: resize-pod-level, namespace: default, annotations: {tensile.io/sim: "resize=0s"}}
spec:
  nodeName: resize-fits
  resources: {requests: {cpu: 200m, memory: 64Mi}, limits: {cpu: 400m, memory: 128Mi}}
  containers: [{name: app, image: nginx}]
"#,
    )
    .await;
    pod_until(cluster, "resize-pod-level", "resize-pod-level Running", 60, |p| {
        p["status"]["allocatedResources"]["cpu"] == "200m"
    })
    .await;
    resize(
        cluster,
        "resize-pod-level",
        r#"{"spec":{"resources":{"requests":{"cpu":"300m"}}}}"#,
    )
    .await;
    let pod = pod_until(
        cluster,
        "resize-pod-level",
        "the pod-level resize done",
        20,
        |p| p["status"]["allocatedResources"]["cpu"] == "300m" && resized(p),
    )
    .await;
    assert_eq!(
        pod["status"]["resources"],
        json!({"requests": {"cpu": "300m", "memory": "64Mi"}, "limits": {"cpu": "400m", "memory": "128Mi"}}),
        "{}",
        pod["status"]
    );
    generation_observed(&pod, true);
    kubectl(cluster, &["delete", "pod", "resize-pod-level", "--wait=false"]).await;
}

/// A resize the node cannot take. Above the node's allocatable, a 1.33 kubelet finds it
/// `Infeasible` ("Node didn't have enough capacity: …"); the 1.37 apiserver refuses it before
/// any kubelet sees it. On a node with the static CPU manager policy, a Guaranteed pod's CPU
/// resize is `Infeasible` on both, each version in its own words. The allocation stays what
/// it was.
#[tokio::test]
async fn a_resize_beyond_the_node_is_refused_as_the_clusters_kubelet_refuses_it() {
    for (cluster, newest) in [(&bed().cluster, true), (&oldest().cluster, false)] {
        let version = cluster.version();
        apply(
            cluster,
            r#"
apiVersion: v1
kind: Pod
metadata: {name: resize-too-big, namespace: default}
spec:
  nodeName: resize-small
  containers: [{name: app, image: nginx, resources: {requests: {cpu: 500m}}}]
---
apiVersion: v1
kind: Pod
metadata: {name: resize-guaranteed, namespace: default}
spec:
  nodeName: resize-static
  containers: [{name: app, image: nginx, resources: {limits: {cpu: "1", memory: 1Gi}}}]
"#,
        )
        .await;
        for name in ["resize-too-big", "resize-guaranteed"] {
            pod_until(cluster, name, &format!("{name} Running"), 60, |p| {
                p["status"]["phase"] == "Running"
            })
            .await;
        }
        let patch = r#"{"spec":{"containers":[{"name":"app","resources":{"requests":{"cpu":"3"}}}]}}"#;
        if newest {
            // From 1.34 the apiserver refuses it first (admission plugin PodResizeValidator).
            let refused = cluster
                .kubectl(&[
                    "patch",
                    "pod",
                    "resize-too-big",
                    "--subresource",
                    "resize",
                    "-p",
                    patch,
                ])
                .await;
            assert!(!refused.ok, "{version}: {}", refused.stdout);
            assert!(
                refused.stderr.contains(
                    "node didn't have enough allocatable resources: cpu, requested: 3000, allocatable: 2000"
                ),
                "{version}: {}",
                refused.stderr
            );
        } else {
            resize(cluster, "resize-too-big", patch).await;
            let pod = pod_until(cluster, "resize-too-big", "the resize pending", 20, |p| {
                condition(p, "PodResizePending").is_some()
            })
            .await;
            let pending = condition(&pod, "PodResizePending").unwrap();
            assert_eq!(
                (&pending["status"], &pending["reason"], &pending["message"]),
                (
                    &json!("True"),
                    &json!("Infeasible"),
                    &json!("Node didn't have enough capacity: cpu, requested: 3000, capacity: 2000")
                ),
                "{version}: {pending}"
            );
            assert_eq!(
                container(&pod, "containerStatuses", "app")["allocatedResources"],
                json!({"cpu": "500m"}),
                "{version}"
            );
            generation_observed(&pod, newest);
        }

        resize(
            cluster,
            "resize-guaranteed",
            r#"{"spec":{"containers":[{"name":"app","resources":{"requests":{"cpu":"2"},"limits":{"cpu":"2"}}}]}}"#,
        )
        .await;
        let message = if newest {
            r#"Resize is infeasible for Guaranteed Pods alongside CPU Manager policy "static""#
        } else {
            "Resize is infeasible for Guaranteed Pods alongside CPU Manager static policy"
        };
        let pod = pod_until(cluster, "resize-guaranteed", "the resize pending", 20, |p| {
            condition(p, "PodResizePending").is_some()
        })
        .await;
        let pending = condition(&pod, "PodResizePending").unwrap();
        assert_eq!(
            (&pending["reason"], &pending["message"]),
            (&json!("Infeasible"), &json!(message)),
            "{version}: {pending}"
        );
        assert_eq!(
            container(&pod, "containerStatuses", "app")["allocatedResources"],
            json!({"cpu": "1", "memory": "1Gi"}),
            "{version}"
        );
        kubectl(
            cluster,
            &[
                "delete",
                "pod",
                "resize-too-big",
                "resize-guaranteed",
                "--wait=false",
            ],
        )
        .await;
    }
}

/// A resize above the room the node's other pods leave is `Deferred`, and the kubelet
/// allocates it once a pod on the node is gone.
#[tokio::test]
async fn a_deferred_resize_completes_once_another_pod_leaves_the_node() {
    for (cluster, newest) in [(&bed().cluster, true), (&oldest().cluster, false)] {
        let version = cluster.version();
        apply(
            cluster,
            r#"
apiVersion: v1
kind: Pod
metadata: {name: resize-hog, namespace: default}
spec:
  nodeName: resize-busy
  terminationGracePeriodSeconds: 0
  containers: [{name: app, image: nginx, resources: {requests: {cpu: 1500m}}}]
---
apiVersion: v1
kind: Pod
metadata: {name: resize-grower, namespace: default}
spec:
  nodeName: resize-busy
  containers: [{name: app, image: nginx, resources: {requests: {cpu: 200m}}}]
"#,
        )
        .await;
        for name in ["resize-hog", "resize-grower"] {
            pod_until(cluster, name, &format!("{name} Running"), 60, |p| {
                p["status"]["phase"] == "Running"
            })
            .await;
        }
        resize(
            cluster,
            "resize-grower",
            r#"{"spec":{"containers":[{"name":"app","resources":{"requests":{"cpu":"1"}}}]}}"#,
        )
        .await;
        let pod = pod_until(cluster, "resize-grower", "the resize deferred", 20, |p| {
            condition(p, "PodResizePending").is_some()
        })
        .await;
        let pending = condition(&pod, "PodResizePending").unwrap();
        assert_eq!(
            (&pending["reason"], &pending["message"]),
            (
                &json!("Deferred"),
                &json!("Node didn't have enough resource: cpu, requested: 1000, used: 1500, capacity: 2000")
            ),
            "{version}: {pending}"
        );
        generation_observed(&pod, newest);
        kubectl(cluster, &["delete", "pod", "resize-hog"]).await;
        let pod = pod_until(cluster, "resize-grower", "the deferred resize done", 30, |p| {
            resized(p) && container(p, "containerStatuses", "app")["resources"]["requests"]["cpu"] == "1"
        })
        .await;
        assert_eq!(
            container(&pod, "containerStatuses", "app")["allocatedResources"],
            json!({"cpu": "1"}),
            "{version}"
        );
        generation_observed(&pod, newest);
        kubectl(cluster, &["delete", "pod", "resize-grower", "--wait=false"]).await;
    }
}

/// Container restart rules (KEP-5307, beta and on from 1.35; `RestartAllContainers`,
/// KEP-5532, beta and on from 1.36): under pod `restartPolicy: Never`, a container whose
/// rule matches its exit code restarts while its sibling stays terminated, and a
/// `RestartAllContainers` rule restarts every container of the pod. The 1.33 apiserver
/// does not know the fields: kubectl's strict field validation refuses the pod.
#[tokio::test]
async fn container_restart_rules_restart_a_container_on_1_37_and_1_33_refuses_them() {
    let manifest = r#"
apiVersion: v1
kind: Pod
metadata: {name: restart-rules, namespace: default, annotations: {tensile.io/sim: "run=1s,exit=42,restarts=1,backoff=200ms"}}
spec:
  nodeName: node-0
  restartPolicy: Never
  containers:
  - name: app
    image: busybox
    restartPolicy: Never
    restartPolicyRules: [{action: Restart, exitCodes: {operator: In, values: [42]}}]
  - {name: sibling, image: busybox}
---
apiVersion: v1
kind: Pod
metadata: {name: restart-all, namespace: default, annotations: {tensile.io/sim: "run=1s,exit=42,restarts=1,backoff=200ms"}}
spec:
  nodeName: node-0
  restartPolicy: Never
  containers:
  - name: app
    image: busybox
    restartPolicy: Never
    restartPolicyRules: [{action: RestartAllContainers, exitCodes: {operator: NotIn, values: [0]}}]
  - {name: sibling, image: busybox}
"#;
    let newest = &bed().cluster;
    apply(newest, manifest).await;
    let pod = pod_until(
        newest,
        "restart-rules",
        "app restarted once by its rule, then out of restarts",
        30,
        |p| {
            let app = container(p, "containerStatuses", "app");
            app["restartCount"] == 1 && app["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        },
    )
    .await;
    let app = container(&pod, "containerStatuses", "app");
    let sibling = container(&pod, "containerStatuses", "sibling");
    assert_eq!(app["restartCount"], 1, "{app}");
    assert_eq!(app["lastState"]["terminated"]["exitCode"], 42, "{app}");
    assert_eq!(sibling["restartCount"], 0, "{sibling}");
    assert_eq!(sibling["state"]["terminated"]["exitCode"], 42, "{sibling}");
    assert_eq!(pod["status"]["phase"], "Running", "a container may still restart");

    let pod = pod_until(newest, "restart-all", "every container restarted", 30, |p| {
        container(p, "containerStatuses", "sibling")["restartCount"] == 1
    })
    .await;
    assert_eq!(
        container(&pod, "containerStatuses", "app")["restartCount"],
        1,
        "{}",
        pod["status"]
    );
    kubectl(
        newest,
        &["delete", "pod", "restart-rules", "restart-all", "--wait=false"],
    )
    .await;

    let old = &oldest().cluster;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.yaml");
    std::fs::write(&path, manifest).unwrap();
    let refused = old.kubectl(&["apply", "-f", path.to_str().unwrap()]).await;
    assert!(
        !refused.ok,
        "{} refused the pod: {}",
        old.version(),
        refused.stdout
    );
    assert!(
        refused
            .stderr
            .contains(r#"strict decoding error: unknown field "spec.containers[0].restartPolicyRules""#),
        "{}",
        refused.stderr
    );
    let absent = old.kubectl(&["get", "pod", "restart-rules"]).await;
    assert!(!absent.ok, "{}", absent.stdout);
}

/// A simulated 1.37 node declares what a 1.37 kubelet with its default feature gates
/// declares (`status.declaredFeatures`, GA in 1.37); the 1.33 apiserver drops the field.
#[tokio::test]
async fn nodes_declare_the_features_of_a_1_37_kubelet_and_1_33_drops_them() {
    // The features of the registry whose gates are on by default in 1.37, sorted by name.
    let want = "ExtendWebSocketsToKubelet InPlacePodLevelResourcesVerticalScaling \
                InPlacePodVerticalScalingInitContainers RestartAllContainersOnContainerExits";
    assert_eq!(tensile_e2e::simulator::DECLARED_FEATURES.join(" "), want);
    eventually(
        &bed().cluster,
        "node-0's declared features",
        30,
        &[
            "get",
            "node",
            "node-0",
            "-o",
            "jsonpath={.status.declaredFeatures[*]}",
        ],
        want,
    )
    .await;
    let node: Value =
        serde_json::from_str(&kubectl(&oldest().cluster, &["get", "node", "node-0", "-o", "json"]).await)
            .unwrap();
    assert!(
        node["status"].get("declaredFeatures").is_none(),
        "{}",
        node["status"]
    );
    assert!(
        node["status"]["nodeInfo"]["kubeletVersion"]
            .as_str()
            .unwrap()
            .starts_with("v1.33.")
    );
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
