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
/// The namespaces whose pods get upper credentials below (pod certificates among them).
const CREDENTIAL_NAMESPACES: [&str; 2] = ["certificates", "denied"];

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] =
            scene::clusters("pod_contract", ["upper", "lower-a", "lower-b"]).await?;
        let sim_a = scene::simulate(&lower_a, scene::nodes("a", 2)).await?;
        let sim_b = scene::simulate(&lower_b, scene::nodes("b", 2)).await?;
        // Started on the bed's runtime, so they outlive the test that first asks.
        // Upper credentials go below only into the namespaces of the pod-certificate tests.
        let server = upper.url();
        let credentials = |args: &mut tensile_virtual_node::Args| {
            args.tokens.upper_tokens = true;
            args.tokens.upper_api_endpoint = Some(server.clone());
            args.tokens.token_namespaces = CREDENTIAL_NAMESPACES.iter().map(|n| (*n).to_owned()).collect();
        };
        let vn_a = scene::virtual_node(&upper, VN_A, &lower_a, credentials)?;
        let vn_b = scene::virtual_node(&upper, VN_B, &lower_b, credentials)?;
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

/// A pod certificate is an upper credential: in a namespace that gets none below (here one
/// not listed, as a namespace others share below is not by default), a pod projecting one is
/// not run below, on either lower version. The upper pod says which volume and why, no
/// PodCertificateRequest is made upstream and nothing is made in either lower cluster.
#[tokio::test]
async fn a_pod_certificate_is_not_carried_into_a_namespace_without_upper_credentials() {
    let ns = "not-carried";
    namespace(ns).await;
    for (node, lower) in nodes().await {
        let name = format!("certificate-{node}");
        let spec = "  containers: [{name: app, image: busybox, volumeMounts: [{name: projected, mountPath: /p}]}]\n  volumes: [{name: projected, projected: {sources: [{podCertificate: {signerName: example.com/issuer, keyType: ED25519, credentialBundlePath: bundle.pem}}]}}]";
        apply(up(), &pod(ns, &name, node, "", spec)).await;
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
            message.contains("\"projected\"")
                && message.contains("namespaces that get upper tokens (namespaces certificates, denied)"),
            "the volume and the rule are named: {message}"
        );
        let below = kubectl(
            lower.kubeconfig(),
            &["-n", ns, "get", "pod", &name, "--ignore-not-found", "-o", "name"],
        )
        .await;
        assert_eq!(below.trim(), "", "nothing made on {}", lower.version());
    }
    let requests = kubectl(up(), &["-n", ns, "get", "podcertificaterequests", "-o", "name"]).await;
    assert_eq!(requests.trim(), "", "no certificate asked for upstream");
}

/// The signer names the test's signer answers: it issues for the first, denies the second.
const ISSUING: &str = "tensile.test/pods";
const DENYING: &str = "tensile.test/deny";

/// A signer of the upper cluster for the tests: every PodCertificateRequest of namespace `ns`
/// is issued by `ca` (signer [`ISSUING`]: a leaf for the requested key, named after the pod,
/// valid from 285 s ago for an hour, to be refreshed 10 minutes after it begins, the earliest
/// the API allows) or denied (signer [`DENYING`]). Runs until dropped.
struct Signer(tokio::task::JoinHandle<()>);

impl Drop for Signer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn signer(ns: &'static str, ca: std::sync::Arc<(rcgen::CertificateParams, rcgen::KeyPair)>) -> Signer {
    use k8s_openapi::api::certificates::v1::PodCertificateRequest;
    use kube::api::{Api, ListParams, Patch, PatchParams};
    Signer(tokio::spawn(async move {
        let client = bed().upper.client().await.unwrap();
        let api = Api::<PodCertificateRequest>::namespaced(client, ns);
        loop {
            for request in api
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default()
            {
                let answered = request
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| !c.is_empty());
                if answered {
                    continue;
                }
                let now = jiff::Timestamp::now();
                let condition = |type_: &str, reason: &str, message: &str| {
                    serde_json::json!({"type": type_, "status": "True", "reason": reason, "message": message,
                        "lastTransitionTime": now.round(jiff::Unit::Second).unwrap().to_string()})
                };
                let status = match request.spec.signer_name.as_str() {
                    ISSUING => {
                        let stub = rustls::pki_types::CertificateSigningRequestDer::from(
                            request.spec.stub_pkc_s10_request.0.clone(),
                        );
                        let mut leaf = rcgen::CertificateSigningRequestParams::from_der(&stub).unwrap();
                        let begins = now.as_second() - 285;
                        leaf.params.not_before = time::OffsetDateTime::from_unix_timestamp(begins).unwrap();
                        leaf.params.not_after =
                            time::OffsetDateTime::from_unix_timestamp(begins + 3600).unwrap();
                        leaf.params
                            .distinguished_name
                            .push(rcgen::DnType::CommonName, request.spec.pod_name.clone());
                        let issuer = rcgen::Issuer::from_params(&ca.0, &ca.1);
                        let chain = leaf.signed_by(&issuer).unwrap().pem();
                        let at = |s: i64| jiff::Timestamp::from_second(s).unwrap().to_string();
                        serde_json::json!({"status": {
                            "conditions": [condition("Issued", "Issued", "issued by the test's signer")],
                            "certificateChain": chain,
                            "notBefore": at(begins),
                            "beginRefreshAt": at(begins + 600),
                            "notAfter": at(begins + 3600),
                        }})
                    }
                    DENYING => serde_json::json!({"status": {
                        "conditions": [condition("Denied", "NotAllowed", "the test's signer refuses every request")],
                    }}),
                    _ => continue,
                };
                let name = request.metadata.name.clone().unwrap_or_default();
                if let Err(e) = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                {
                    eprintln!("signing {ns}/{name}: {e}");
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }))
}

/// A certificate authority of the test's signer.
fn authority(name: &str) -> std::sync::Arc<(rcgen::CertificateParams, rcgen::KeyPair)> {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::sync::Arc::new((params, key))
}

fn authority_pem(ca: &(rcgen::CertificateParams, rcgen::KeyPair)) -> String {
    ca.0.clone().self_signed(&ca.1).unwrap().pem()
}

/// The DER of each PEM block of `pem`.
fn ders(pem: &str) -> Vec<Vec<u8>> {
    pem::parse_many(pem)
        .unwrap()
        .into_iter()
        .map(pem::Pem::into_contents)
        .collect()
}

/// Key `key` of lower Secret `name` of `ns`, decoded; empty when the Secret or the key is
/// missing.
async fn secret_key(lower: &TestCluster, ns: &str, name: &str, key: &str) -> String {
    let escaped = key.replace('.', "\\.");
    let out = kubectl(
        lower.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "secret",
            name,
            "--ignore-not-found",
            "-o",
            &format!("jsonpath={{.data.{escaped}}}"),
        ],
    )
    .await;
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(out.trim())
        .unwrap_or_default();
    String::from_utf8(bytes).unwrap()
}

/// Waits up to `secs` until key `key` of lower Secret `name` satisfies `ok`; its value.
async fn secret_key_until(
    lower: &TestCluster,
    ns: &str,
    name: &str,
    key: &str,
    secs: u64,
    what: &str,
    ok: impl Fn(&str) -> bool,
) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let value = secret_key(lower, ns, name, key).await;
        if ok(&value) {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} on {}: key {key} of {ns}/{name} is {value:?}",
            lower.version()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The public key (subject public key bits) the leaf of `chain` certifies.
fn leaf_key(chain: &str) -> Vec<u8> {
    use x509_parser::prelude::FromDer;
    let der = ders(chain).remove(0);
    let (_, leaf) = x509_parser::certificate::X509Certificate::from_der(&der).unwrap();
    leaf.tbs_certificate.subject_pki.subject_public_key.data.to_vec()
}

/// A pod projecting a pod certificate and ClusterTrustBundles (GA in 1.37) runs below on
/// either lower version, the lower kubelet asking nothing of them: the virtual node asks the
/// upper cluster for the certificate as the pod's node (a PodCertificateRequest naming the
/// pod, its ServiceAccount and the node), and the lower pod reads, at the paths the upper pod
/// projects, the credential bundle (key, then chain), the key and the chain the upper signer
/// issued, and the upper trust anchors (by name, by signer and selector, and an optional
/// missing bundle as an empty file). A changed bundle is followed; the certificate is asked
/// for again once the signer's `beginRefreshAt` passes, with a new key.
#[tokio::test]
async fn a_pod_certificate_is_issued_upstream_for_the_pod_and_reaches_it_below_with_its_trust_bundles() {
    let ns = CREDENTIAL_NAMESPACES[0];
    namespace(ns).await;
    let (ca, other) = (authority("tensile test pods"), authority("tensile test more"));
    let _signer = signer(ns, ca.clone());
    let (ca_pem, other_pem) = (authority_pem(&ca), authority_pem(&other));
    let bundles = |roots: &str| {
        let indent = |pem: &str| pem.lines().map(|l| format!("    {l}\n")).collect::<String>();
        format!(
            "apiVersion: certificates.k8s.io/v1\nkind: ClusterTrustBundle\nmetadata: {{name: tensile-test-roots}}\nspec:\n  trustBundle: |\n{}---\napiVersion: certificates.k8s.io/v1\nkind: ClusterTrustBundle\nmetadata: {{name: \"tensile.test:pods:one\", labels: {{set: a}}}}\nspec:\n  signerName: {ISSUING}\n  trustBundle: |\n{}",
            indent(roots),
            indent(&ca_pem)
        )
    };
    apply(up(), &bundles(&ca_pem)).await;
    apply(
        up(),
        &format!("apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: app, namespace: {ns}}}\n"),
    )
    .await;
    let spec = format!(
        "  serviceAccountName: app\n  containers: [{{name: app, image: busybox, volumeMounts: [{{name: identity, mountPath: /identity}}]}}]\n  volumes: [{{name: identity, projected: {{sources: [\n    {{podCertificate: {{signerName: {ISSUING}, keyType: ECDSAP256, credentialBundlePath: bundle.pem, keyPath: key.pem, certificateChainPath: chain.pem, maxExpirationSeconds: 3600}}}},\n    {{clusterTrustBundle: {{name: tensile-test-roots, path: roots.pem}}}},\n    {{clusterTrustBundle: {{signerName: {ISSUING}, labelSelector: {{matchLabels: {{set: a}}}}, path: pod-roots.pem}}}},\n    {{clusterTrustBundle: {{name: absent, path: absent.pem, optional: true}}}}]}}}}]"
    );
    let mut issued = Vec::new();
    for (node, lower) in nodes().await {
        let name = format!("with-certificate-{node}");
        apply(up(), &pod(ns, &name, node, "", &spec)).await;
        scene::pod_running(up(), ns, &name, 90).await;
        let uid = scene::pod_field(up(), ns, &name, "jsonpath={.metadata.uid}").await;
        let secret = format!("tensile-upper-certificates-{uid}");
        // The lower pod reads the Secret at the upper pod's paths; nothing below is asked.
        let sources = kubectl(
            lower.kubeconfig(),
            &[
                "-n",
                ns,
                "get",
                "pod",
                &name,
                "-o",
                "jsonpath={.spec.volumes[?(@.name==\"identity\")].projected.sources}",
            ],
        )
        .await;
        let sources: serde_json::Value = serde_json::from_str(&sources).unwrap();
        let items: Vec<(String, String, String)> = sources
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| {
                let name = s["secret"]["name"].as_str().unwrap_or("not a Secret").to_owned();
                s["secret"]["items"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |i| {
                        (
                            name.clone(),
                            i["key"].as_str().unwrap().to_owned(),
                            i["path"].as_str().unwrap().to_owned(),
                        )
                    })
            })
            .collect();
        let paths: Vec<(&str, &str)> = items.iter().map(|(_, k, p)| (k.as_str(), p.as_str())).collect();
        assert_eq!(
            paths,
            [
                ("certificate-0-bundle", "bundle.pem"),
                ("certificate-0-key", "key.pem"),
                ("certificate-0-chain", "chain.pem"),
                ("trust-bundle-0", "roots.pem"),
                ("trust-bundle-1", "pod-roots.pem"),
                ("trust-bundle-2", "absent.pem"),
            ],
            "on {}: {sources}",
            lower.version()
        );
        assert!(
            items.iter().all(|(s, _, _)| *s == secret),
            "every source reads {secret}: {sources}"
        );
        // Issued: the chain reaches the Secret.
        let chain = secret_key_until(
            lower,
            ns,
            &secret,
            "certificate-0-chain",
            60,
            "the issued chain below",
            |v| !v.is_empty(),
        )
        .await;
        // The request upstream: for this pod, its account and this node.
        let requests = kubectl(up(), &["-n", ns, "get", "podcertificaterequests", "-o", "json"]).await;
        let requests: serde_json::Value = serde_json::from_str(&requests).unwrap();
        let mine: Vec<&serde_json::Value> = requests["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["spec"]["podUID"] == uid.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "one request for {name}: {requests}");
        let asked = &mine[0]["spec"];
        assert_eq!(
            (
                asked["podName"].as_str(),
                asked["serviceAccountName"].as_str(),
                asked["nodeName"].as_str(),
                asked["signerName"].as_str(),
                asked["maxExpirationSeconds"].as_i64()
            ),
            (
                Some(name.as_str()),
                Some("app"),
                Some(node),
                Some(ISSUING),
                Some(3600)
            )
        );
        assert_eq!(
            mine[0]["metadata"]["ownerReferences"][0]["uid"],
            uid.as_str(),
            "owned by the upper pod"
        );
        // Below: the key and chain the signer issued, the bundle being both.
        let issued_chain = mine[0]["status"]["certificateChain"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert_eq!(ders(&chain), ders(&issued_chain), "the chain the signer issued");
        let key = secret_key(lower, ns, &secret, "certificate-0-key").await;
        assert!(
            key.starts_with("-----BEGIN PRIVATE KEY-----"),
            "a PKCS#8 key: {key:.40}"
        );
        let pair = rcgen::KeyPair::from_pem(&key).unwrap();
        assert_eq!(
            leaf_key(&chain),
            pair.public_key_raw(),
            "the leaf certifies the key kept below"
        );
        assert_eq!(
            secret_key(lower, ns, &secret, "certificate-0-bundle").await,
            format!("{key}{chain}")
        );
        assert_eq!(
            ders(&secret_key(lower, ns, &secret, "trust-bundle-0").await),
            ders(&ca_pem),
            "the bundle named"
        );
        assert_eq!(
            ders(&secret_key(lower, ns, &secret, "trust-bundle-1").await),
            ders(&ca_pem),
            "the signer's bundle"
        );
        assert_eq!(
            secret_key(lower, ns, &secret, "trust-bundle-2").await,
            "",
            "an optional bundle that is missing"
        );
        issued.push((lower, secret, ders(&chain), key));
    }
    // A bundle changed upstream is followed below.
    apply(up(), &bundles(&format!("{ca_pem}{other_pem}"))).await;
    for (lower, secret, _, _) in &issued {
        let mut want = ders(&format!("{ca_pem}{other_pem}"));
        want.sort();
        secret_key_until(
            lower,
            ns,
            secret,
            "trust-bundle-0",
            30,
            "the changed bundle below",
            |v| {
                let mut have = ders(v);
                have.sort();
                have == want
            },
        )
        .await;
    }
    // A lower admin who deletes the Secret gets it back as it was: the same certificate and
    // key, and no new request upstream.
    for (lower, secret, first, key) in &issued {
        kubectl(lower.kubeconfig(), &["-n", ns, "delete", "secret", secret]).await;
        let chain = secret_key_until(
            lower,
            ns,
            secret,
            "certificate-0-chain",
            30,
            "the certificate written again after a lower admin deleted it",
            |v| !v.is_empty(),
        )
        .await;
        assert_eq!(
            ders(&chain),
            *first,
            "the same certificate on {}",
            lower.version()
        );
        assert_eq!(&secret_key(lower, ns, secret, "certificate-0-key").await, key);
        let uid = secret.trim_start_matches("tensile-upper-certificates-");
        let requests = kubectl(
            up(),
            &[
                "-n",
                ns,
                "get",
                "podcertificaterequests",
                "-o",
                "jsonpath={.items[*].spec.podUID}",
            ],
        )
        .await;
        assert_eq!(
            requests.split_whitespace().filter(|u| *u == uid).count(),
            1,
            "no new request for {uid}: {requests}"
        );
    }
    // Refreshed from beginRefreshAt on (about 315 s from the issue), with a new key.
    for (lower, secret, first, key) in &issued {
        let chain = secret_key_until(
            lower,
            ns,
            secret,
            "certificate-0-chain",
            420,
            "a refreshed certificate",
            |v| ders(v) != *first,
        )
        .await;
        let renewed = secret_key(lower, ns, secret, "certificate-0-key").await;
        assert_ne!(&renewed, key, "a new key");
        assert_eq!(
            leaf_key(&chain),
            rcgen::KeyPair::from_pem(&renewed).unwrap().public_key_raw()
        );
    }
}

/// A request the upper signer denies is shown on the upper pod as a kubelet shows it (a
/// Warning event `Denied` with the signer's reason and message) and not asked again; nothing
/// of it is written below.
#[tokio::test]
async fn a_denied_pod_certificate_is_reported_on_the_pod_and_nothing_is_written_below() {
    let ns = CREDENTIAL_NAMESPACES[1];
    namespace(ns).await;
    let _signer = signer(ns, authority("unused"));
    let spec = format!(
        "  containers: [{{name: app, image: busybox, volumeMounts: [{{name: identity, mountPath: /identity}}]}}]\n  volumes: [{{name: identity, projected: {{sources: [{{podCertificate: {{signerName: {DENYING}, keyType: ED25519, credentialBundlePath: bundle.pem}}}}]}}}}]"
    );
    for (node, lower) in nodes().await {
        let name = format!("denied-{node}");
        apply(up(), &pod(ns, &name, node, "", &spec)).await;
        tensile_e2e::check::eventually(
            up(),
            &format!("a Denied event on {name}"),
            60,
            &[
                "-n",
                ns,
                "get",
                "events",
                "--field-selector",
                &format!("involvedObject.name={name},reason=Denied"),
                "-o",
                "jsonpath={.items[0].type}",
            ],
            "Warning",
        )
        .await;
        let said = kubectl(
            up(),
            &[
                "-n",
                ns,
                "get",
                "events",
                "--field-selector",
                &format!("involvedObject.name={name},reason=Denied"),
                "-o",
                "jsonpath={.items[0].message}",
            ],
        )
        .await;
        assert!(
            said.contains("NotAllowed") && said.contains("refuses every request"),
            "{said}"
        );
        let uid = scene::pod_field(up(), ns, &name, "jsonpath={.metadata.uid}").await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let requests = kubectl(
            up(),
            &[
                "-n",
                ns,
                "get",
                "podcertificaterequests",
                "-o",
                &format!("jsonpath={{.items[?(@.spec.podUID==\"{uid}\")].metadata.name}}"),
            ],
        )
        .await;
        assert_eq!(
            requests.split_whitespace().count(),
            1,
            "asked once, not again: {requests}"
        );
        let secret = format!("tensile-upper-certificates-{uid}");
        assert_eq!(
            secret_key(lower, ns, &secret, "certificate-0-bundle").await,
            "",
            "nothing written below on {}",
            lower.version()
        );
    }
}
