//! The webhook against a real kube-apiserver: the apiserver calls it over HTTPS for every
//! opted-in pod, and each test asserts with kubectl what the apiserver stored.
//!
//! Each test registers its own MutatingWebhookConfiguration scoped to its own namespace
//! (plus the production objectSelector `virtual-pod=true`), so tests sharing the cluster do
//! not see each other's webhook. The Job tests run on a bed of their own: an upper cluster
//! with its scheduler over lower-a and lower-b, virtual nodes and the descheduler.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tensile_common::stash::Stash;
use tensile_e2e::pki::Ca;
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::wait::until;
use tensile_e2e::{ClusterOptions, NodeConfig, NodeSimulator, TestCluster, free_port};
use tensile_webhook::{Certificates, Options, Policy, Running};

static UPPER: Shared<TestCluster> = Shared::new();

/// The upper cluster, shared by the tests of this binary (no scheduler: nothing is placed).
fn upper() -> &'static TestCluster {
    UPPER
        .get(|| async {
            let mut options = ClusterOptions::new("webhook", "upper");
            options.scheduler = false;
            TestCluster::start(options).await
        })
        .unwrap_or_else(|e| panic!("upper cluster: {e}"))
}

fn init() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

async fn kubectl(cluster: &TestCluster, args: &[&str]) -> String {
    let out = cluster.kubectl(args).await;
    assert!(out.ok, "kubectl {args:?} failed: {}", out.stderr);
    out.stdout
}

/// `kubectl apply` of `manifest`; returns kubectl's output (stdout and stderr).
async fn apply(cluster: &TestCluster, manifest: &str) -> tensile_e2e::kubectl::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.yaml");
    std::fs::write(&path, manifest).unwrap();
    cluster.kubectl(&["apply", "-f", path.to_str().unwrap()]).await
}

async fn namespace(cluster: &TestCluster, name: &str) {
    cluster.create_namespace(name).await.unwrap();
    scene::opt_in_namespace(cluster.kubeconfig(), name).await;
}

fn registration(name: &str, port: u16, namespace: &str, ca_pem: Option<&str>) -> String {
    tensile_e2e::check::webhook_registration(
        name,
        port,
        tensile_e2e::check::Namespaces::Labelled(namespace),
        ca_pem,
    )
}

fn pod_json(cluster_out: &str) -> Value {
    serde_json::from_str(cluster_out).unwrap_or_else(|e| panic!("pod JSON: {e}: {cluster_out}"))
}

async fn get_pod(cluster: &TestCluster, ns: &str, name: &str) -> Value {
    pod_json(&kubectl(cluster, &["-n", ns, "get", "pod", name, "-o", "json"]).await)
}

fn stash_of(pod: &Value) -> Stash {
    let text = pod["metadata"]["annotations"]["clusterSelector"]
        .as_str()
        .unwrap_or_else(|| panic!("no clusterSelector annotation: {pod}"));
    Stash::decode(text).unwrap()
}

async fn start_webhook(options: Options) -> Running {
    tensile_webhook::start(options).await.unwrap()
}

/// Runs `n` opted-in pods in `ns` with kubectl while `what` goes on; each must be admitted and
/// stashed.
async fn stashed_while(c: &TestCluster, ns: &str, n: usize, what: &str) {
    for i in 0..n {
        let name = format!("during-{i}");
        let out = c
            .kubectl(&[
                "-n",
                ns,
                "run",
                &name,
                "--image=nginx",
                "--restart=Never",
                "--labels=virtual-pod=true",
            ])
            .await;
        assert!(out.ok, "review {i} during {what}: {}", out.stderr);
        assert!(stash_of(&get_pod(c, ns, &name).await).tolerations.len() >= 2);
    }
}

fn options(port: u16, certificates: Certificates) -> Options {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    Options::new(addr, certificates)
}

/// An opted-in pod is stored with its lower constraints in the stash and the upper
/// constraints added; a pod without the label is stored as written. The webhook makes its
/// own certificate and writes the CA into the registration with a server-side apply.
#[tokio::test]
async fn an_opted_in_pod_is_stored_with_its_stash_and_others_unchanged() {
    init();
    let c = upper();
    let ns = "wh-mutate";
    namespace(c, ns).await;
    let port = free_port().unwrap();
    let config = "tensile-webhook-mutate";
    let out = apply(c, &registration(config, port, ns, None)).await;
    assert!(out.ok, "{}", out.stderr);

    let mut opts = scene::webhook_options(port);
    opts.client = Some(c.client().await.unwrap());
    opts.webhook_config_name = Some(config.into());
    opts.policy = Policy {
        ignore_selector_keys: ["cluster".to_owned()].into(),
        not_ready_seconds: 30,
        unreachable_seconds: 40,
        ..Policy::default()
    };
    let running = start_webhook(opts).await;
    let ca = running.ca_pem.clone().unwrap();
    until(
        "the caBundle written by server-side apply",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let out = c
                .kubectl(&[
                    "get",
                    "mutatingwebhookconfiguration",
                    config,
                    "-o",
                    "json",
                    "--show-managed-fields",
                ])
                .await;
            let v: Value = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
            let bundle = v["webhooks"][0]["clientConfig"]["caBundle"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let managers: Vec<String> = v["metadata"]["managedFields"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| Some(format!("{}/{}", m["manager"].as_str()?, m["operation"].as_str()?)))
                .collect();
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(&bundle)
                .unwrap_or_default();
            if decoded == ca.as_bytes() && managers.iter().any(|m| m == "tensile-webhook/Apply") {
                Ok(())
            } else {
                Err(format!("caBundle {} bytes, managers {managers:?}", decoded.len()))
            }
        },
    )
    .await
    .unwrap();
    assert!(running.state.ready.get());

    // A PVC the upper scheduler already bound for virtual node vnode-1.
    let out = apply(
        c,
        &format!(
            r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: data
  namespace: {ns}
  annotations: {{volume.kubernetes.io/selected-node: vnode-1}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
"#
        ),
    )
    .await;
    assert!(out.ok, "{}", out.stderr);

    let out = apply(
        c,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: opted-in
  namespace: {ns}
  labels: {{virtual-pod: "true", app: web}}
spec:
  containers: [{{name: c, image: nginx}}]
  nodeSelector: {{disk: ssd, cluster: a}}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
        - matchExpressions: [{{key: zone, operator: In, values: [z1]}}]
          matchFields: [{{key: metadata.name, operator: In, values: [lower-node-1]}}]
      preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 10
        preference: {{matchExpressions: [{{key: fast, operator: Exists}}]}}
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 1
        podAffinityTerm: {{labelSelector: {{matchLabels: {{app: web}}}}, topologyKey: zone}}
  tolerations: [{{key: gpu, operator: Exists, effect: NoSchedule}}]
  volumes: [{{name: data, persistentVolumeClaim: {{claimName: data}}}}]
"#
        ),
    )
    .await;
    assert!(out.ok, "{}", out.stderr);

    let pod = get_pod(c, ns, "opted-in").await;
    let spec = &pod["spec"];
    // Stored upstream: only the cluster key, the virtual-node requirement and the PVC's node.
    assert_eq!(spec["nodeSelector"], json!({"cluster": "a"}), "{pod}");
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        json!({"nodeSelectorTerms": [{
            "matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vnode-1"]}],
        }]}),
        "{pod}"
    );
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"], 10,
        "preferred node affinity stays: {pod}"
    );
    assert_eq!(
        spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"],
        1
    );
    assert_eq!(
        spec["tolerations"],
        json!([
            {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 40},
        ]),
        "{pod}"
    );
    // The stash holds what the lower cluster needs, in tensile-kube's format.
    let stash = stash_of(&pod);
    assert_eq!(
        stash.node_selector,
        [("disk".to_owned(), "ssd".to_owned())].into()
    );
    let lower = serde_json::to_value(stash.node_affinity().unwrap()).unwrap();
    assert_eq!(
        lower,
        json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["lower-node-1"]}],
        }]}})
    );
    let keys: Vec<&str> = stash
        .tolerations
        .iter()
        .filter_map(|t| t.key.as_deref())
        .collect();
    // The apiserver's DefaultTolerationSeconds ran before us: its tolerations go down too.
    assert_eq!(
        keys,
        [
            "gpu",
            "node.kubernetes.io/not-ready",
            "node.kubernetes.io/unreachable"
        ],
        "{stash:?}"
    );

    // Mixed terms lose their pairing: kubectl shows the webhook's warning.
    let out = apply(
        c,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: mixed, namespace: {ns}, labels: {{virtual-pod: "true"}}}}
spec:
  containers: [{{name: c, image: nginx}}]
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
        - matchExpressions: [{{key: cluster, operator: In, values: [a]}}, {{key: zone, operator: In, values: [z1]}}]
        - matchExpressions: [{{key: cluster, operator: In, values: [b]}}, {{key: zone, operator: In, values: [z2]}}]
"#
        ),
    )
    .await;
    assert!(out.ok, "{}", out.stderr);
    assert!(out.stderr.contains("Warning: tensile webhook"), "{}", out.stderr);

    // A pod without the label is stored exactly as written.
    let out = apply(
        c,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: plain, namespace: {ns}, labels: {{app: web}}}}
spec:
  containers: [{{name: c, image: nginx}}]
  nodeSelector: {{disk: ssd}}
  tolerations: [{{key: gpu, operator: Exists, effect: NoSchedule}}]
"#
        ),
    )
    .await;
    assert!(out.ok, "{}", out.stderr);
    let plain = get_pod(c, ns, "plain").await;
    assert!(
        plain["metadata"]["annotations"].get("clusterSelector").is_none(),
        "{plain}"
    );
    assert_eq!(plain["spec"]["nodeSelector"], json!({"disk": "ssd"}));
    assert!(plain["spec"].get("affinity").is_none(), "{plain}");
    assert_eq!(plain["spec"]["tolerations"][0]["key"], "gpu");
    assert_eq!(
        plain["spec"]["tolerations"][1]["tolerationSeconds"], 300,
        "the apiserver's default, not ours"
    );

    // Two passes through the webhook: the stash is never written twice.
    assert_eq!(running.state.metrics.mutations.get(), 2);
    running.stop().await;
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

/// With the webhook down, an opted-in pod is refused with a message naming the webhook,
/// while every other pod is created as usual (the registration only matches opted-in pods).
#[tokio::test]
async fn with_the_webhook_stopped_only_opted_in_pods_are_refused() {
    init();
    let c = upper();
    let ns = "wh-down";
    namespace(c, ns).await;
    let port = free_port().unwrap();
    let running = start_webhook(scene::webhook_options(port)).await;
    let config = "tensile-webhook-down";
    let out = apply(c, &registration(config, port, ns, running.ca_pem.as_deref())).await;
    assert!(out.ok, "{}", out.stderr);

    let create = |name: &'static str, labels: &'static str| async move {
        c.kubectl(&[
            "-n",
            ns,
            "run",
            name,
            "--image=nginx",
            "--restart=Never",
            &format!("--labels={labels}"),
        ])
        .await
    };
    let out = create("up", "virtual-pod=true").await;
    assert!(out.ok, "{}", out.stderr);
    assert!(stash_of(&get_pod(c, ns, "up").await).tolerations.len() >= 2);

    running.stop().await;
    let refused = create("down", "virtual-pod=true").await;
    assert!(!refused.ok, "created without its webhook: {}", refused.stdout);
    assert!(
        refused
            .stderr
            .contains("failed calling webhook \"pods.tensile.io\"")
            && refused.stderr.contains("127.0.0.1"),
        "the message names the webhook and where it was called: {}",
        refused.stderr
    );
    let absent = c.kubectl(&["-n", ns, "get", "pod", "down"]).await;
    assert!(
        !absent.ok && absent.stderr.contains("NotFound"),
        "{}",
        absent.stderr
    );

    for (name, labels) in [("other", "app=web"), ("not-true", "virtual-pod=false")] {
        let out = create(name, labels).await;
        assert!(out.ok, "{name} must not depend on the webhook: {}", out.stderr);
        let pod = get_pod(c, ns, name).await;
        assert!(
            pod["metadata"]["annotations"].get("clusterSelector").is_none(),
            "{pod}"
        );
    }
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

/// Idle and slow clients cannot take the webhook away from the apiserver: 64 connections
/// that never start TLS and 16 that send an unfinished request a byte at a time are held
/// open against a cap of 16. The server keeps at most the cap open (the longest-idle make
/// room), the apiserver's reviews keep being answered, and the idle deadline closes every
/// flood connection.
#[tokio::test]
async fn idle_and_slow_clients_are_capped_and_cut_while_reviews_are_answered() {
    init();
    let c = upper();
    let ns = "wh-flood";
    namespace(c, ns).await;
    let port = free_port().unwrap();
    let mut opts = scene::webhook_options(port);
    opts.limits.max_connections = 16;
    opts.limits.idle = Duration::from_secs(4);
    let running = start_webhook(opts).await;
    let config = "tensile-webhook-flood";
    let out = apply(c, &registration(config, port, ns, running.ca_pem.as_deref())).await;
    assert!(out.ok, "{}", out.stderr);

    let flood = tensile_e2e::flood::Flood::open(running.address, 64, 16).await;
    flood.assert_capped(64, 16).await;
    stashed_while(c, ns, 5, "the flood").await;
    flood.assert_all_closed_within(Duration::from_secs(10)).await;
    running.stop().await;
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

/// A pod with more claim volumes than the webhook reads is admitted, and kubectl shows the
/// warning that only the first 16 claims were read for volume pinning.
#[tokio::test]
async fn a_pod_with_many_claims_is_admitted_with_the_lookup_cap_in_a_warning() {
    init();
    let c = upper();
    let ns = "wh-claims";
    namespace(c, ns).await;
    let port = free_port().unwrap();
    let mut opts = scene::webhook_options(port);
    opts.client = Some(c.client().await.unwrap());
    let running = start_webhook(opts).await;
    let config = "tensile-webhook-claims";
    let out = apply(c, &registration(config, port, ns, running.ca_pem.as_deref())).await;
    assert!(out.ok, "{}", out.stderr);
    let volumes: Vec<Value> = (0..20)
        .map(|i| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": format!("c{i}")}}))
        .collect();
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "many-claims", "namespace": ns, "labels": {"virtual-pod": "true"}},
        "spec": {"containers": [{"name": "c", "image": "nginx"}], "volumes": volumes},
    });
    let out = apply(c, &pod.to_string()).await;
    assert!(out.ok, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("the pod has 20 claims; only the first 16 are read"),
        "{}",
        out.stderr
    );
    running.stop().await;
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

fn write_pair(dir: &Path, ca: &Ca) {
    let pair = ca.server("tensile-webhook", &[]).unwrap();
    // Key first, then certificate: the server sees a mismatched pair for a moment and must
    // keep the old one until both agree.
    std::fs::write(dir.join("tls.key"), pair.key_pem).unwrap();
    std::fs::write(dir.join("tls.crt"), pair.cert_pem).unwrap();
}

/// Whether a TLS handshake with the webhook succeeds when trusting only `ca`.
async fn trusted_by(addr: SocketAddr, ca: &Ca) -> bool {
    let mut roots = rustls::RootCertStore::empty();
    for cert in tensile_e2e::tls::certs_from_pem(&ca.cert_pem()).unwrap() {
        roots.add(cert).unwrap();
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .is_ok()
}

/// A certificate rotated on disk is served without a restart, and the apiserver, told the
/// new CA, keeps admitting opted-in pods through the same running webhook.
#[tokio::test]
async fn a_certificate_rotated_on_disk_is_picked_up_without_restart() {
    init();
    let c = upper();
    let ns = "wh-rotate";
    namespace(c, ns).await;
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (Ca::new("old-ca").unwrap(), Ca::new("new-ca").unwrap());
    write_pair(dir.path(), &old_ca);
    let port = free_port().unwrap();
    let running = start_webhook(options(
        port,
        Certificates::Files {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            reload_every: Duration::from_millis(500),
        },
    ))
    .await;
    let config = "tensile-webhook-rotate";
    let out = apply(c, &registration(config, port, ns, Some(&old_ca.cert_pem()))).await;
    assert!(out.ok, "{}", out.stderr);
    let run = |name: String| async move {
        c.kubectl(&[
            "-n",
            ns,
            "run",
            &name,
            "--image=nginx",
            "--restart=Never",
            "--labels=virtual-pod=true",
        ])
        .await
    };
    let out = run("before".into()).await;
    assert!(out.ok, "{}", out.stderr);
    assert!(trusted_by(running.address, &old_ca).await && !trusted_by(running.address, &new_ca).await);

    write_pair(dir.path(), &new_ca);
    until(
        "the new certificate served",
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            if trusted_by(running.address, &new_ca).await {
                Ok(())
            } else {
                Err("still the old certificate".into())
            }
        },
    )
    .await
    .unwrap();
    assert!(!trusted_by(running.address, &old_ca).await);

    // The apiserver now trusts only the new CA.
    let out = apply(c, &registration(config, port, ns, Some(&new_ca.cert_pem()))).await;
    assert!(out.ok, "{}", out.stderr);
    let mut attempt = 0;
    let name = until(
        "an opted-in pod admitted through the rotated certificate",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || {
            attempt += 1;
            let name = format!("after-{attempt}");
            async move {
                let out = run(name.clone()).await;
                if out.ok { Ok(name) } else { Err(out.stderr) }
            }
        },
    )
    .await
    .unwrap();
    let pod = get_pod(c, ns, &name).await;
    assert_eq!(
        pod["spec"]["tolerations"][0]["key"], "virtual-kubelet.io/provider",
        "{pod}"
    );
    assert!(stash_of(&pod).node_selector.is_empty());
    // Same process, same counters: no restart happened.
    assert_eq!(running.state.metrics.mutations.get(), 2);
    running.stop().await;
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

/// One HTTP/2 client cannot make the webhook hold more than a connection's budget of
/// request bodies: of 300 uploads of 6 MiB bodies that never finish, 250 at a time (the
/// advertised stream cap) are served, the webhook takes at most its per-connection budget
/// (plus the connection's flow-control window), the apiserver's reviews keep being answered,
/// and each upload is refused (or reset) at its deadline, after which the budget is whole
/// again.
#[tokio::test]
async fn one_http2_client_gets_the_stream_cap_and_a_connection_budget_of_bodies_while_reviews_are_answered() {
    init();
    let c = upper();
    let ns = "wh-h2";
    namespace(c, ns).await;
    let port = free_port().unwrap();
    let opts = scene::webhook_options(port);
    let limits = opts.limits.clone();
    let running = start_webhook(opts).await;
    let config = "tensile-webhook-h2";
    let out = apply(c, &registration(config, port, ns, running.ca_pem.as_deref())).await;
    assert!(out.ok, "{}", out.stderr);

    let uploads = tensile_e2e::flood::Uploads::open(running.address, "/mutate", 300, 6 << 20)
        .await
        .unwrap();
    // The server says how many streams it serves at once; the client queues the rest.
    assert_eq!(uploads.advertised_streams, limits.max_streams as usize);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = || {
        running
            .state
            .connections
            .body_kib_held
            .load(std::sync::atomic::Ordering::SeqCst)
            * 1024
    };
    assert!(
        held() as usize <= limits.connection_body_bytes,
        "held {} bytes",
        held()
    );
    // What one connection can make the server hold: the budget, a frame in hand per stream
    // waiting for budget, and the flow-control window (with a little slack for frames in
    // flight).
    let ceiling = limits.connection_body_bytes
        + limits.max_streams as usize * tensile_common::serve::H2_FRAME_BYTES as usize
        + limits.connection_window as usize
        + (256 << 10);
    eprintln!(
        "one HTTP/2 client, {} streams: the webhook took {} bytes of bodies, holds {} (ceiling {ceiling})",
        uploads.opened,
        uploads.sent_bytes(),
        held()
    );
    assert!(
        uploads.sent_bytes() as usize <= ceiling,
        "the server took {} bytes",
        uploads.sent_bytes()
    );
    stashed_while(c, ns, 3, "the uploads").await;
    tensile_e2e::wait::within(
        "every upload ended at its deadline (the queued ones after a second deadline)",
        45,
        || async {
            let answered = uploads.answered();
            if answered.len() == uploads.opened {
                Ok(answered)
            } else {
                Err(format!("{} of {} answered", answered.len(), uploads.opened))
            }
        },
    )
    .await
    .into_iter()
    .for_each(|status| assert!(matches!(status, 0 | 408 | 503), "status {status}"));
    assert_eq!(held(), 0, "every body given back");
    drop(uploads);
    running.stop().await;
    let _ = c
        .kubectl(&["delete", "mutatingwebhookconfiguration", config])
        .await;
}

/// The bed of the Job test: an upper cluster with its scheduler, lower-a (1.37) and lower-b
/// (the oldest supported version), each with simulated kubelets.
struct Lowers {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    sim_a: NodeSimulator,
    sim_b: NodeSimulator,
}

static LOWERS: Shared<Lowers> = Shared::new();

fn lowers() -> &'static Lowers {
    LOWERS
        .get(|| async {
            let [upper, lower_a, lower_b] =
                scene::clusters("webhook-jobs", ["upper", "lower-a", "lower-b"]).await?;
            tensile_e2e::chart::install_exclusion_records(upper.kubeconfig()).await?;
            let sim_a = scene::simulate(&lower_a, Vec::new()).await?;
            let sim_b = scene::simulate(&lower_b, Vec::new()).await?;
            Ok(Lowers {
                upper,
                lower_a,
                lower_b,
                sim_a,
                sim_b,
            })
        })
        .unwrap_or_else(|e| panic!("test bed: {e}"))
}

/// Label key of the Job test's virtual nodes (both carry it), kept upstream by the webhook.
const VN_KEY: &str = "tensile-e2e-vn";
/// Label key telling the Job test's two virtual nodes apart (`a`, `b`), kept upstream too.
const SIDE_KEY: &str = "tensile-e2e-side";
/// Label key of the Job test's lower nodes, which the stash carries down.
const LOWER_KEY: &str = "tensile-e2e";

/// A `backoffLimit: 0` Job `name` of one `restartPolicy: Never` pod of `cpu` CPUs, opted in
/// by its pod template's label (not its own), on the scene's virtual nodes (`side`: only
/// that one), preferring vn-a.
fn job(ns: &str, name: &str, cpu: &str, side: Option<&str>) -> String {
    let mut selector = json!({VN_KEY: ns, LOWER_KEY: ns});
    if let Some(side) = side {
        selector[SIDE_KEY] = json!(side);
    }
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app": name, "virtual-pod": "true"}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 5,
                    "nodeSelector": selector,
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "preference": {"matchExpressions": [
                            {"key": SIDE_KEY, "operator": "In", "values": ["a"]}]}}]}},
                    "containers": [{"name": "work", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}],
                },
            },
        },
    })
    .to_string()
}

/// A Job whose pod lower-a refuses (3 CPUs, 2-CPU nodes) while lower-b fits it is tracked by
/// finalizers, so the descheduler moves its pod only when the Job's `podFailurePolicy`
/// ignores `DisruptionTarget`. With `--job-disruption-rule` the webhook gives every opted-in
/// Job that rule at CREATE: the `backoffLimit: 0` Job is moved from vn-a (lower-a, 1.37) to
/// vn-b (lower-b, 1.33) and completes with no failure. Jobs placed directly on either lower
/// cluster complete under the rule too, so both versions run a Job's pod with it.
#[tokio::test]
async fn with_the_job_disruption_rule_a_job_refused_below_moves_and_completes() {
    init();
    let bed = lowers();
    let ns = "wh-jobs";
    let name = ns.to_owned();
    LOWERS
        .handle()
        .unwrap()
        .spawn(async move {
            for i in 0..12 {
                let node = NodeConfig::new(&format!("{name}-a{i}"))
                    .resource("cpu", "2")
                    .label(LOWER_KEY, &name);
                bed.sim_a.add_node(node).await.unwrap();
            }
            let node = NodeConfig::new(&format!("{name}-b0"))
                .resource("cpu", "8")
                .resource("memory", "16Gi")
                .label(LOWER_KEY, &name);
            bed.sim_b.add_node(node).await.unwrap();
        })
        .await
        .unwrap();
    namespace(&bed.upper, ns).await;
    let identity = tensile_e2e::descheduler::chart_identity(&bed.upper, ns, "annotated")
        .await
        .unwrap();
    let records = tensile_common::exclusion::Location {
        namespace: ns.to_owned(),
        name: format!("{ns}-tensile-exclusions"),
    };

    let port = free_port().unwrap();
    let config = format!("tensile-webhook-{ns}");
    let out = apply(
        &bed.upper,
        &tensile_e2e::check::webhook_registration_with_jobs(
            &config,
            port,
            tensile_e2e::check::Namespaces::Labelled(ns),
            None,
        ),
    )
    .await;
    assert!(out.ok, "{}", out.stderr);
    let mut opts = scene::webhook_options(port);
    opts.client = Some(bed.upper.client().await.unwrap());
    opts.webhook_config_name = Some(config.clone());
    opts.policy = Policy {
        ignore_selector_keys: [VN_KEY.to_owned(), SIDE_KEY.to_owned()].into(),
        job_disruption_rule: true,
        ..Policy::default()
    };
    opts.exclusions = Some(records.clone());
    // On the bed's runtime: the in-process virtual nodes keep this test's thread busy.
    let webhook = LOWERS
        .handle()
        .unwrap()
        .spawn(tensile_webhook::start(opts))
        .await
        .unwrap()
        .unwrap();
    scene::webhook_ready(&webhook).await;

    let (vn_a, vn_b) = (format!("{ns}-a"), format!("{ns}-b"));
    let node = |name: &str, side: &str, lower: &TestCluster| {
        scene::virtual_node(&bed.upper, name, lower, |args| {
            args.node_labels = vec![
                (VN_KEY.to_owned(), ns.to_owned()),
                (SIDE_KEY.to_owned(), side.to_owned()),
            ]
        })
        .unwrap()
    };
    let _nodes = [node(&vn_a, "a", &bed.lower_a), node(&vn_b, "b", &bed.lower_b)];
    for vn in [&vn_a, &vn_b] {
        scene::node_ready(bed.upper.kubeconfig(), vn, 60).await;
    }
    let flags = [
        format!("--node-selector=type=virtual-kubelet,{VN_KEY}={ns}"),
        format!("--exclusions-configmap={records}"),
        "--unschedulable-threshold=3".to_owned(),
        "--descheduling-interval=5s".to_owned(),
    ];
    let descheduler =
        tensile_e2e::descheduler::DeschedulerProcess::start_as(&bed.upper, &identity, &flags, "jobs")
            .unwrap();
    descheduler.wait_ready(Duration::from_secs(30)).await.unwrap();

    // Refused by lower-a, fits lower-b; and one Job placed on each lower cluster directly.
    for (name, cpu, side) in [
        ("moved", "3", None),
        ("on-a", "1", Some("a")),
        ("on-b", "1", Some("b")),
    ] {
        let out = apply(&bed.upper, &job(ns, name, cpu, side)).await;
        assert!(out.ok, "{name}: {}", out.stderr);
    }

    // Every Job completes; meanwhile, which virtual nodes each Job's pods were seen on.
    let mut seen: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> = Default::default();
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        let pods: Value = serde_json::from_str(
            &kubectl(
                &bed.upper,
                &["-n", ns, "get", "pods", "-l", "job-name", "-o", "json"],
            )
            .await,
        )
        .unwrap();
        let pods = pods["items"].as_array().cloned().unwrap_or_default();
        for p in &pods {
            let (job, node) = (&p["metadata"]["labels"]["job-name"], &p["spec"]["nodeName"]);
            if let (Some(job), Some(node)) = (job.as_str(), node.as_str()) {
                seen.entry(job.to_owned()).or_default().insert(node.to_owned());
            }
        }
        let status = kubectl(
            &bed.upper,
            &[
                "-n",
                ns,
                "get",
                "jobs",
                "-o",
                r#"jsonpath={range .items[*]}{.metadata.name}:{.status.succeeded}|{.status.failed}|{.status.active} {end}"#,
            ],
        )
        .await;
        if status.split_whitespace().filter(|j| j.contains(":1|")).count() == 3 {
            assert_eq!(
                status.trim(),
                "moved:1|| on-a:1|| on-b:1||",
                "name:succeeded|failed|active"
            );
            break;
        }
        if std::time::Instant::now() > deadline {
            let pods: Vec<String> = pods
                .iter()
                .map(|p| {
                    format!(
                        "{} on {} {}",
                        p["metadata"]["name"], p["spec"]["nodeName"], p["status"]["phase"]
                    )
                })
                .collect();
            panic!(
                "not every Job completed within 180 s (name:succeeded|failed|active): {status}; pods: {pods:?}; seen on: {seen:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for name in ["moved", "on-a", "on-b"] {
        let stored: Value =
            serde_json::from_str(&kubectl(&bed.upper, &["-n", ns, "get", "job", name, "-o", "json"]).await)
                .unwrap();
        assert_eq!(
            stored["spec"]["podFailurePolicy"]["rules"][0],
            json!({"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}),
            "{name}: {}",
            stored["spec"]
        );
    }
    let on = |job: &str| {
        seen.get(job)
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        on("moved"),
        [vn_a.as_str(), vn_b.as_str()],
        "refused on vn-a, moved to vn-b"
    );
    assert_eq!(on("on-a"), [vn_a.as_str()]);
    assert_eq!(on("on-b"), [vn_b.as_str()]);
    let warned = kubectl(
        &bed.upper,
        &[
            "-n",
            ns,
            "get",
            "events",
            "--field-selector",
            "reason=JobPodNotMoved",
            "-o",
            "name",
        ],
    )
    .await;
    assert_eq!(warned.trim(), "", "no Job was held back");
    // The descheduler reads a Job's podFailurePolicy once and keeps it: the apiserver
    // refuses any change of it.
    let changed = bed
        .upper
        .kubectl(&[
            "-n",
            ns,
            "patch",
            "job",
            "moved",
            "--type=json",
            "-p",
            r#"[{"op": "remove", "path": "/spec/podFailurePolicy/rules/0"}]"#,
        ])
        .await;
    assert!(
        !changed.ok && changed.stderr.contains("immutable"),
        "a Job's podFailurePolicy cannot change: {} {}",
        changed.stdout,
        changed.stderr
    );
    drop(descheduler);
    webhook.stop().await;
    let _ = bed
        .upper
        .kubectl(&["delete", "mutatingwebhookconfiguration", &config])
        .await;
}

/// `webhook.jobDisruptionRule` gives the chart's webhook `--job-disruption-rule` and its
/// registration a second webhook for Jobs at CREATE, sent by the apiserver only when their pod
/// template carries the opt-in label; the apiservers of both ends of the supported range
/// (1.37 above, 1.33 in lower-b) compile its condition and accept the registration. Off, the
/// chart renders neither.
#[tokio::test]
async fn the_charts_job_webhook_is_rendered_with_its_value_and_accepted_by_both_versions() {
    init();
    let bed = lowers();
    let render = |on: bool| async move {
        let chart = tensile_e2e::chart::chart_dir().display().to_string();
        let value = format!("webhook.jobDisruptionRule={on}");
        let args = [
            "template",
            "r",
            &chart,
            "-n",
            "tensile",
            "--show-only",
            "templates/webhook.yaml",
            "--set",
            &value,
        ];
        let out = tensile_e2e::chart::helm(&bed.upper, &args).await.unwrap();
        assert!(out.ok, "helm template: {}", out.stderr);
        let objects: Vec<Value> = out
            .stdout
            .split("\n---")
            .filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok())
            .filter(Value::is_object)
            .collect();
        let of = |kind: &str| {
            objects
                .iter()
                .find(|o| o["kind"] == kind)
                .cloned()
                .unwrap_or_else(|| panic!("no {kind} rendered"))
        };
        (of("MutatingWebhookConfiguration"), of("Deployment"))
    };
    let args =
        |deployment: &Value| deployment["spec"]["template"]["spec"]["containers"][0]["args"].to_string();

    let (registration, deployment) = render(true).await;
    assert!(
        args(&deployment).contains("\"--job-disruption-rule\""),
        "{}",
        args(&deployment)
    );
    let webhooks = registration["webhooks"].as_array().unwrap();
    let names: Vec<&str> = webhooks.iter().filter_map(|w| w["name"].as_str()).collect();
    assert_eq!(names, ["pods.tensile.io", "jobs.tensile.io"]);
    let jobs = &webhooks[1];
    assert_eq!(
        jobs["rules"],
        json!([{"operations": ["CREATE"], "apiGroups": ["batch"], "apiVersions": ["v1"], "resources": ["jobs"], "scope": "Namespaced"}])
    );
    assert!(jobs.get("objectSelector").is_none(), "{jobs}");
    assert_eq!(
        jobs["matchConditions"][0]["expression"],
        r#"object.spec.template.metadata.?labels[?"virtual-pod"].orValue('') == "true""#
    );
    for key in [
        "failurePolicy",
        "timeoutSeconds",
        "clientConfig",
        "namespaceSelector",
        "sideEffects",
    ] {
        assert_eq!(jobs[key], webhooks[0][key], "{key} as the pods' webhook");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("registration.json");
    std::fs::write(&path, registration.to_string()).unwrap();
    for cluster in [&bed.upper, &bed.lower_b] {
        let out = cluster
            .kubectl(&["apply", "--dry-run=server", "-f", path.to_str().unwrap()])
            .await;
        assert!(out.ok, "{}: {}", cluster.kubeconfig().display(), out.stderr);
    }

    let (registration, deployment) = render(false).await;
    assert!(!args(&deployment).contains("job-disruption-rule"));
    assert_eq!(registration["webhooks"].as_array().map(Vec::len), Some(1));
}
