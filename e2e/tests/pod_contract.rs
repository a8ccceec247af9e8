//! The kubelet's pod contract of Kubernetes 1.33–1.37 kept by the virtual node, on a bed
//! whose lower clusters run both ends of the supported range: lower-a the newest (as the
//! upper cluster), lower-b the oldest. Every assertion is what kubectl shows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::Path;
use std::time::Duration;

use tensile_e2e::check::{apply, kubectl};
use tensile_e2e::in_process::VirtualNode;
use tensile_e2e::scene;
use tensile_e2e::scene::condition;
use tensile_e2e::shared::Shared;
use tensile_e2e::{NodeSimulator, TestCluster};

struct Bed {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    _sim_a: NodeSimulator,
    _sim_b: NodeSimulator,
    _vn_a: VirtualNode,
    _vn_b: VirtualNode,
}

static BED: Shared<Bed> = Shared::new();

/// The virtual nodes over lower-a (newest) and lower-b (oldest).
const VN_A: &str = "vn-a";
const VN_B: &str = "vn-b";

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] =
            scene::clusters("pod_contract", ["upper", "lower-a", "lower-b"]).await?;
        let sim_a = scene::simulate(&lower_a, scene::nodes("a", 2)).await?;
        let sim_b = scene::simulate(&lower_b, scene::nodes("b", 2)).await?;
        // Started on the bed's runtime, so they outlive the test that first asks.
        let vn_a = scene::virtual_node(&upper, VN_A, &lower_a, |_| {})?;
        let vn_b = scene::virtual_node(&upper, VN_B, &lower_b, |_| {})?;
        Ok(Bed {
            upper,
            lower_a,
            lower_b,
            _sim_a: sim_a,
            _sim_b: sim_b,
            _vn_a: vn_a,
            _vn_b: vn_b,
        })
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

/// Both virtual nodes, each with its lower cluster, once Ready and without the
/// `node.kubernetes.io/not-ready` taint admission puts on a new Node (the node lifecycle
/// controller takes it away on its next pass after Ready).
async fn nodes() -> [(&'static str, &'static TestCluster); 2] {
    let bed = bed();
    for node in [VN_A, VN_B] {
        scene::node_untainted(up(), node, 60).await;
    }
    [(VN_A, &bed.lower_a), (VN_B, &bed.lower_b)]
}

/// A namespace of the upper cluster for one test.
async fn namespace(ns: &str) {
    bed().upper.create_namespace(ns).await.unwrap();
}

/// A pod `name` bound to virtual node `node`, its taint tolerated, with `spec` (YAML lines at
/// the pod spec's indentation) and annotations `annotations` (`key: value, ...`).
fn pod(ns: &str, name: &str, node: &str, annotations: &str, spec: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, annotations: {{{annotations}}}}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 1
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
{spec}
"#
    )
}

/// A Job whose pod runs a native sidecar (a restartable init container) beside its main
/// container completes when the main container ends, on either lower version; while it
/// runs, the upper pod shows the sidecar started and ready in `initContainerStatuses` and
/// the pod Ready, as a kubelet says it.
#[tokio::test]
async fn a_job_with_a_sidecar_runs_below_and_completes_when_its_main_container_ends() {
    let ns = "sidecar";
    namespace(ns).await;
    for (node, lower) in nodes().await {
        let job = format!("job-{node}");
        apply(
            up(),
            &format!(
                r#"
apiVersion: batch/v1
kind: Job
metadata: {{name: {job}, namespace: {ns}}}
spec:
  backoffLimit: 0
  template:
    metadata: {{annotations: {{tensile.io/sim: "run=6s"}}}}
    spec:
      restartPolicy: Never
      nodeName: {node}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      initContainers: [{{name: proxy, image: envoy, restartPolicy: Always}}]
      containers: [{{name: app, image: busybox}}]
"#
            ),
        )
        .await;
        let pods = ["-n", ns, "get", "pods", "-l", &format!("job-name={job}"), "-o"];
        let running = r#"jsonpath={.items[0].status.conditions[?(@.type=="Ready")].status} {.items[0].status.initContainerStatuses[?(@.name=="proxy")].started} {.items[0].status.initContainerStatuses[?(@.name=="proxy")].ready}"#;
        tensile_e2e::check::eventually(
            up(),
            &format!("the sidecar started and ready, the pod Ready, on {node}"),
            60,
            &[pods.as_slice(), &[running]].concat(),
            "True true true",
        )
        .await;
        // Below it was made as given: the sidecar is an init container that restarts.
        let below = kubectl(
            lower.kubeconfig(),
            &[
                "-n",
                ns,
                "get",
                "pods",
                "-o",
                r#"jsonpath={.items[0].spec.initContainers[0].restartPolicy}"#,
            ],
        )
        .await;
        assert_eq!(below, "Always", "on {}", lower.version());
        scene::shows(
            up(),
            ns,
            &format!("job/{job}"),
            r#"jsonpath={.status.succeeded} {.status.conditions[?(@.type=="Complete")].status}"#,
            "1 True",
            60,
        )
        .await;
    }
}

/// The upper pod's `status.observedGeneration`, and each kubelet condition's, is the upper
/// generation the lower pod runs, whatever the lower version writes (1.37 its own
/// generation, 1.33 nothing): a lower admin's edit below, which moves only the lower pod's
/// generation, is undone and does not move it; an edit upstream does, once it is made
/// below. Settled, the upper pod is not written again.
#[tokio::test]
async fn the_upper_generation_is_observed_whatever_the_lower_version_writes() {
    let ns = "generation";
    namespace(ns).await;
    let observed = "jsonpath={.metadata.generation} {.status.observedGeneration} {.status.conditions[?(@.type==\"Ready\")].observedGeneration}";
    for (node, lower) in nodes().await {
        let name = format!("gen-{node}");
        apply(
            up(),
            &pod(ns, &name, node, "", "  containers: [{name: app, image: nginx:1}]"),
        )
        .await;
        scene::pod_running(up(), ns, &name, 60).await;
        scene::pod_shows(up(), ns, &name, observed, "1 1 1", 30).await;

        // A lower admin changes the image below: the node puts it back; the lower pod's
        // generation moves (on 1.37), the upper one's does not.
        kubectl(
            lower.kubeconfig(),
            &["-n", ns, "set", "image", &format!("pod/{name}"), "app=nginx:evil"],
        )
        .await;
        scene::pod_shows(
            lower.kubeconfig(),
            ns,
            &name,
            "jsonpath={.spec.containers[0].image}",
            "nginx:1",
            30,
        )
        .await;
        scene::pod_shows(up(), ns, &name, observed, "1 1 1", 10).await;

        kubectl(
            up(),
            &["-n", ns, "set", "image", &format!("pod/{name}"), "app=nginx:2"],
        )
        .await;
        scene::pod_shows(
            lower.kubeconfig(),
            ns,
            &name,
            "jsonpath={.spec.containers[0].image} {.metadata.annotations.tensile\\.io/upper-generation}",
            "nginx:2 2",
            30,
        )
        .await;
        scene::pod_shows(up(), ns, &name, observed, "2 2 2", 30).await;
        if lower.minor() < 35 {
            let own = scene::pod_field(
                lower.kubeconfig(),
                ns,
                &name,
                "jsonpath={.status.observedGeneration}",
            )
            .await;
            assert_eq!(own, "", "{} keeps no observedGeneration", lower.version());
        }

        // Settled: nothing writes the upper pod any more.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let version = "jsonpath={.metadata.resourceVersion}";
        let before = scene::pod_field(up(), ns, &name, version).await;
        tokio::time::sleep(Duration::from_secs(6)).await;
        let after = scene::pod_field(up(), ns, &name, version).await;
        assert_eq!(before, after, "no status write loop over {}", lower.version());
    }
}

/// A resize of the upper pod (`resize` subresource) is made on the lower pod, on either
/// lower version, and its observed generation comes up; a resize the lower apiserver
/// refuses shows upstream as the kubelet's `PodResizePending`: `Infeasible` for a lower
/// LimitRange's bound, `Deferred` for a lower ResourceQuota, which is tried again and made
/// once the quota allows it.
#[tokio::test]
async fn a_resize_upstream_is_made_below_and_a_refused_one_shows_as_the_kubelets_pending_resize() {
    let resources = |cpu: &str| {
        format!(
            r#"{{"spec":{{"containers":[{{"name":"app","resources":{{"requests":{{"cpu":"{cpu}"}},"limits":{{"cpu":"{cpu}"}}}}}}]}}}}"#
        )
    };
    let spec =
        "  containers: [{name: app, image: nginx, resources: {requests: {cpu: 100m}, limits: {cpu: 100m}}}]";
    let pending = condition("PodResizePending", &["status", "reason", "observedGeneration"]);
    let cpu_below = "jsonpath={.spec.containers[0].resources.requests.cpu}";
    let resize = |ns: &'static str, name: String, cpu: &str| {
        let body = resources(cpu);
        async move {
            kubectl(
                up(),
                &[
                    "-n",
                    ns,
                    "patch",
                    "pod",
                    &name,
                    "--subresource",
                    "resize",
                    "-p",
                    &body,
                ],
            )
            .await;
        }
    };
    for ns in ["resize", "resize-limit", "resize-quota"] {
        namespace(ns).await;
    }
    for (node, lower) in nodes().await {
        // Accepted.
        let name = format!("ok-{node}");
        apply(up(), &pod("resize", &name, node, "", spec)).await;
        scene::pod_running(up(), "resize", &name, 60).await;
        resize("resize", name.clone(), "200m").await;
        scene::pod_shows(lower.kubeconfig(), "resize", &name, cpu_below, "200m", 30).await;
        scene::pod_shows(
            up(),
            "resize",
            &name,
            "jsonpath={.metadata.generation} {.status.observedGeneration}",
            "2 2",
            30,
        )
        .await;
        // What the lower kubelet runs and allocated comes up, from either version.
        scene::pod_shows(
            up(),
            "resize",
            &name,
            "jsonpath={.status.containerStatuses[0].resources.requests.cpu} {.status.containerStatuses[0].allocatedResources.cpu}",
            "200m 200m",
            30,
        )
        .await;

        // Refused for good: a LimitRange below bounds a container's cpu at 500m.
        let name = format!("limited-{node}");
        apply(up(), &pod("resize-limit", &name, node, "", spec)).await;
        scene::pod_running(up(), "resize-limit", &name, 60).await;
        apply(
            lower.kubeconfig(),
            r#"
apiVersion: v1
kind: LimitRange
metadata: {name: bound, namespace: resize-limit}
spec:
  limits: [{type: Container, max: {cpu: 500m}}]
"#,
        )
        .await;
        resize("resize-limit", name.clone(), "1").await;
        scene::pod_shows(up(), "resize-limit", &name, &pending, "True/Infeasible/2", 30).await;
        let message = scene::pod_field(
            up(),
            "resize-limit",
            &name,
            &condition("PodResizePending", &["message"]),
        )
        .await;
        assert!(
            message.contains("maximum cpu"),
            "the lower refusal is named: {message}"
        );
        assert_eq!(
            scene::pod_field(lower.kubeconfig(), "resize-limit", &name, cpu_below).await,
            "100m",
            "nothing half-made below"
        );
        // A resize within the bound clears it.
        resize("resize-limit", name.clone(), "300m").await;
        scene::pod_shows(lower.kubeconfig(), "resize-limit", &name, cpu_below, "300m", 30).await;
        scene::pod_shows(up(), "resize-limit", &name, &pending, "//", 30).await;

        // Deferred: a ResourceQuota below leaves no room for it until it is raised.
        let name = format!("quota-{node}");
        apply(up(), &pod("resize-quota", &name, node, "", spec)).await;
        scene::pod_running(up(), "resize-quota", &name, 60).await;
        let quota = |cpu: &str| {
            format!(
                r#"
apiVersion: v1
kind: ResourceQuota
metadata: {{name: room, namespace: resize-quota}}
spec:
  hard: {{requests.cpu: "{cpu}", limits.cpu: "{cpu}"}}
"#
            )
        };
        apply(lower.kubeconfig(), &quota("200m")).await;
        resize("resize-quota", name.clone(), "400m").await;
        scene::pod_shows(up(), "resize-quota", &name, &pending, "True/Deferred/2", 30).await;
        apply(lower.kubeconfig(), &quota("1")).await;
        scene::pod_shows(lower.kubeconfig(), "resize-quota", &name, cpu_below, "400m", 60).await;
        scene::pod_shows(up(), "resize-quota", &name, &pending, "//", 30).await;
        kubectl(
            lower.kubeconfig(),
            &["-n", "resize-quota", "delete", "resourcequota", "room"],
        )
        .await;
        kubectl(
            lower.kubeconfig(),
            &["-n", "resize-limit", "delete", "limitrange", "bound"],
        )
        .await;
    }
}

/// A pod asking for a feature the lower cluster lacks is refused there, not half applied:
/// container restart rules (a field 1.33 does not know) and an image volume (a field 1.33
/// drops, the gate off) are not created on lower-b, and the upper pod says which feature and
/// which lower version; lower-a runs both as given.
#[tokio::test]
async fn a_pod_asking_for_a_feature_the_lower_version_lacks_is_refused_there_and_runs_where_it_is_served() {
    let ns = "features";
    namespace(ns).await;
    let cases = [
        (
            "rules",
            "  restartPolicy: Never\n  containers:\n  - name: app\n    image: busybox\n    restartPolicy: Never\n    restartPolicyRules: [{action: Restart, exitCodes: {operator: In, values: [42]}}]",
            "jsonpath={.spec.containers[0].restartPolicyRules[0].action}",
            "Restart",
            "ContainerRestartRules",
        ),
        (
            "image",
            "  containers: [{name: app, image: busybox, volumeMounts: [{name: tools, mountPath: /tools}]}]\n  volumes: [{name: tools, image: {reference: \"example.com/tools:1\"}}]",
            "jsonpath={.spec.volumes[0].image.reference}",
            "example.com/tools:1",
            "ImageVolume",
        ),
    ];
    for (node, lower) in nodes().await {
        for (case, spec, kept, want, gate) in cases {
            let name = format!("{case}-{node}");
            apply(up(), &pod(ns, &name, node, "", spec)).await;
            if lower.minor() >= 36 {
                scene::pod_shows(lower.kubeconfig(), ns, &name, kept, want, 60).await;
                continue;
            }
            let synced = condition("tensile.io/LowerPodSynced", &["status", "reason"]);
            scene::pod_shows(up(), ns, &name, &synced, "False/CreateFailed", 60).await;
            let message = scene::pod_field(
                up(),
                ns,
                &name,
                &condition("tensile.io/LowerPodSynced", &["message"]),
            )
            .await;
            assert!(
                message.contains(gate) && message.contains(lower.version()),
                "the refusal names the feature and the lower version: {message}"
            );
            let events = kubectl(
                up(),
                &[
                    "-n",
                    ns,
                    "get",
                    "events",
                    "--field-selector",
                    &format!("involvedObject.name={name},reason=LowerCreateFailed"),
                    "-o",
                    "jsonpath={.items[0].message}",
                ],
            )
            .await;
            assert!(events.contains(gate), "an event says it too: {events}");
            let below = kubectl(
                lower.kubeconfig(),
                &["-n", ns, "get", "pod", &name, "--ignore-not-found", "-o", "name"],
            )
            .await;
            assert_eq!(below.trim(), "", "nothing made on {}", lower.version());
        }
    }
}

/// Each virtual node declares the node features every lower node of its cluster declares
/// (a 1.37 kubelet declares some, a 1.33 one none), beside its own WebSocket streams; the
/// upper scheduler then keeps a pod needing `RestartAllContainersOnContainerExits` off the
/// node over the older cluster and places it on the other, where it runs.
#[tokio::test]
async fn each_virtual_node_declares_what_its_lower_nodes_declare_and_the_upper_scheduler_follows() {
    let ns = "declared";
    namespace(ns).await;
    let declared = "jsonpath={.status.declaredFeatures}";
    nodes().await;
    scene::node_shows(up(), VN_B, declared, r#"["ExtendWebSocketsToKubelet"]"#, 30).await;
    tensile_e2e::wait::within(
        "vn-a declaring RestartAllContainersOnContainerExits",
        30,
        || async {
            let shown = scene::node_field(up(), VN_A, declared).await;
            match shown.contains("RestartAllContainersOnContainerExits")
                && shown.contains("ExtendWebSocketsToKubelet")
            {
                true => Ok(()),
                false => Err(shown),
            }
        },
    )
    .await;
    let restart_all = |name: &str, node: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  terminationGracePeriodSeconds: 1
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: app
    image: busybox
    restartPolicy: Never
    restartPolicyRules: [{{action: RestartAllContainers, exitCodes: {{operator: In, values: [42]}}}}]
"#
        )
    };
    apply(up(), &restart_all("on-old", VN_B)).await;
    apply(up(), &restart_all("on-new", VN_A)).await;
    scene::pod_running(up(), ns, "on-new", 60).await;
    let scheduled = condition("PodScheduled", &["status", "reason"]);
    scene::pod_shows(up(), ns, "on-old", &scheduled, "False/Unschedulable", 30).await;
    let message = scene::pod_field(up(), ns, "on-old", &condition("PodScheduled", &["message"])).await;
    assert!(message.contains("required features"), "{message}");
    assert_eq!(
        scene::pod_field(up(), ns, "on-old", "jsonpath={.spec.nodeName}").await,
        ""
    );
}

/// A pod projecting a pod certificate or a ClusterTrustBundle (GA in 1.37) is not run
/// below, where a lower kubelet would ask the lower cluster's signers and bundles: the upper
/// pod says which volume and why, and nothing is made in either lower cluster.
#[tokio::test]
async fn a_pod_projecting_a_pod_certificate_or_trust_bundle_is_not_run_below() {
    let ns = "not-carried";
    namespace(ns).await;
    let cases = [
        (
            "certificate",
            "podCertificate: {signerName: example.com/issuer, keyType: ED25519, credentialBundlePath: bundle.pem}",
        ),
        (
            "bundle",
            "clusterTrustBundle: {name: example-roots, path: roots.pem, optional: true}",
        ),
    ];
    for (node, lower) in nodes().await {
        for (case, source) in cases {
            let name = format!("{case}-{node}");
            let spec = format!(
                "  containers: [{{name: app, image: busybox, volumeMounts: [{{name: projected, mountPath: /p}}]}}]\n  volumes: [{{name: projected, projected: {{sources: [{{{source}}}]}}}}]"
            );
            apply(up(), &pod(ns, &name, node, "", &spec)).await;
            let synced = condition("tensile.io/LowerPodSynced", &["status", "reason"]);
            scene::pod_shows(up(), ns, &name, &synced, "False/VolumeNotCarried", 60).await;
            let message = scene::pod_field(
                up(),
                ns,
                &name,
                &condition("tensile.io/LowerPodSynced", &["message"]),
            )
            .await;
            assert!(
                message.contains("\"projected\""),
                "the volume is named: {message}"
            );
            let below = kubectl(
                lower.kubeconfig(),
                &["-n", ns, "get", "pod", &name, "--ignore-not-found", "-o", "name"],
            )
            .await;
            assert_eq!(below.trim(), "", "nothing made on {}", lower.version());
        }
    }
}
