//! Lower clusters as `LowerCluster` objects, with the real `tensilectl`, helm and kubectl:
//! one command joins a lower cluster and its virtual node runs pods; the fleet shows in
//! `kubectl get lowerclusters`; the credential's short-lived token is renewed; one command
//! removes a cluster with nothing left behind in either cluster, while a lower admin's own
//! objects are kept.
//!
//! The chart is installed in the upper cluster with its defaults (the webhook and the
//! descheduler off: this is about the fleet); its cluster controller runs here under the
//! chart's ServiceAccount with the chart's flags, and [`VirtualNodeRunner`] runs the virtual
//! node Deployments it makes, as a kubelet would run their pods.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use tensile_common::node_identity;
use tensile_e2e::chart::{self, helm};
use tensile_e2e::check::{apply, eventually, kubectl};
use tensile_e2e::process::Service;
use tensile_e2e::runner::VirtualNodeRunner;
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::{NodeSimulator, TestCluster};

struct Bed {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    _sims: Vec<NodeSimulator>,
}

static BED: Shared<Bed> = Shared::new();

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] = scene::clusters("clusters", ["upper", "lower-a", "lower-b"]).await?;
        let sim_a = scene::simulate(&lower_a, scene::nodes("a", 2)).await?;
        let sim_b = scene::simulate(&lower_b, scene::nodes("b", 3)).await?;
        Ok(Bed {
            upper,
            lower_a,
            lower_b,
            _sims: vec![sim_a, sim_b],
        })
    })
}

const NS: &str = "tensile";
const RELEASE: &str = "fleet";
const FULL: &str = "fleet-tensile";

/// Runs `tensilectl ARGS` against the bed; its output (stdout and stderr) and success.
async fn tensilectl(args: &[&str]) -> (bool, String) {
    tensilectl_with(args, &[]).await
}

/// [`tensilectl`] with environment variables `env` set (and no proxy but theirs).
async fn tensilectl_with(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let bin = tensile_e2e::bins::suite_binary("tensilectl").unwrap();
    let mut command = tokio::process::Command::new(bin);
    command.args(args).env_remove("KUBECONFIG");
    for proxy in [
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "NO_PROXY",
        "no_proxy",
    ] {
        command.env_remove(proxy);
    }
    command.envs(env.iter().copied());
    let out = command.output().await.unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// Every object of the cluster (but events, which outlive what they are about), as
/// `kind namespace/name`.
async fn listing(cluster: &TestCluster, leave_out_namespace: Option<&str>) -> BTreeSet<String> {
    tensile_e2e::check::listing(cluster.kubeconfig(), |kind, ns, name| {
        !leave_out_namespace.is_some_and(|l| ns == l || (kind == "Namespace" && name == l))
    })
    .await
}

/// Waits until `cluster`'s listing is `want` again; panics with the difference.
async fn listing_returns_to(
    cluster: &TestCluster,
    leave_out: Option<&str>,
    want: &BTreeSet<String>,
    what: &str,
) {
    tensile_e2e::wait::must(what, Duration::from_secs(90), Duration::from_secs(1), || async {
        let now = listing(cluster, leave_out).await;
        if &now == want {
            Ok(())
        } else {
            let extra: Vec<_> = now.difference(want).collect();
            let missing: Vec<_> = want.difference(&now).collect();
            Err(format!("left behind: {extra:?}; missing: {missing:?}"))
        }
    })
    .await
}

/// The chart installed upstream, and its cluster controller running here with the chart's
/// flags under the chart's ServiceAccount; `extra` flags on top.
async fn install_and_run_controller(up: &'static TestCluster, extra: &[String]) -> Service {
    up.create_namespace(NS).await.unwrap();
    let out = helm(
        up,
        &[
            "install",
            RELEASE,
            &path(&chart::chart_dir()),
            "-n",
            NS,
            "--set",
            "webhook.enabled=false",
            "--set",
            "descheduler.enabled=false",
        ],
    )
    .await
    .unwrap();
    assert!(out.ok, "helm install: {}", out.stderr);
    chart::run_cluster_controller(up, NS, FULL, extra).await.unwrap()
}

fn secret_token(up: &TestCluster, secret: &str) -> impl std::future::Future<Output = String> {
    let kubeconfig = up.kubeconfig().to_owned();
    let secret = secret.to_owned();
    async move {
        let b64 = kubectl(
            &kubeconfig,
            &["-n", NS, "get", "secret", &secret, "-o", "jsonpath={.data.token}"],
        )
        .await;
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .unwrap(),
        )
        .unwrap()
    }
}

fn workload(replicas: u32) -> String {
    format!(
        r#"
apiVersion: v1
kind: ConfigMap
metadata: {{name: settings, namespace: fleet}}
data: {{greeting: hello}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: fleet}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      nodeSelector: {{type: virtual-kubelet}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      topologySpreadConstraints:
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule,
         labelSelector: {{matchLabels: {{app: web}}}}}}
      terminationGracePeriodSeconds: 2
      containers:
      - name: app
        image: nginx
        envFrom: [{{configMapRef: {{name: settings}}}}]
"#
    )
}

/// Running pods of `fleet/web` per node, as `node=count` sorted.
async fn spread(up: &TestCluster) -> String {
    let out = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            "fleet",
            "get",
            "pods",
            "-l",
            "app=web",
            "--field-selector=status.phase=Running",
            "-o",
            "jsonpath={range .items[*]}{.spec.nodeName}{\"\\n\"}{end}",
        ],
    )
    .await;
    let mut counts = std::collections::BTreeMap::<String, u32>::new();
    for node in out.lines().filter(|l| !l.is_empty()) {
        *counts.entry(node.to_owned()).or_default() += 1;
    }
    counts
        .iter()
        .map(|(n, c)| format!("{n}={c}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A client of `up` as ServiceAccount `NS/account`, with a token of an hour the apiserver
/// issued it (no object is made for it).
async fn account_client(up: &TestCluster, account: &str) -> kube::Client {
    let token = kubectl(
        up.kubeconfig(),
        &["-n", NS, "create", "token", account, "--duration=1h"],
    )
    .await;
    let ca = kubectl(
        up.kubeconfig(),
        &[
            "config",
            "view",
            "--raw",
            "--minify",
            "-o",
            "jsonpath={.clusters[0].cluster.certificate-authority-data}",
        ],
    )
    .await;
    let file = up.dir().join(format!("{account}.token.kubeconfig"));
    std::fs::write(
        &file,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: up\n  cluster: {{server: '{}', certificate-authority-data: {}}}\n\
             users:\n- name: {account}\n  user: {{token: {}}}\ncontexts:\n- name: up\n  context: {{cluster: up, user: {account}}}\n\
             current-context: up\n",
            up.url(),
            ca.trim(),
            token.trim()
        ),
    )
    .unwrap();
    tensile_common::kubeconfig::client_from_file(&file, &Default::default())
        .await
        .unwrap()
}

/// A request `name` for the client certificate of `node`, exactly as a virtual node makes it
/// but for its lifetime (`spec.expirationSeconds`) and, unless `labelled`, the label the
/// approver watches.
fn node_request(name: &str, node: &str, lifetime: Option<i32>, labelled: bool) -> CertificateSigningRequest {
    let (pem, _) = node_identity::certificate_request(node).unwrap();
    let mut csr: CertificateSigningRequest = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "request": base64::engine::general_purpose::STANDARD.encode(pem),
            "signerName": node_identity::SIGNER,
            "usages": node_identity::USAGES,
        },
    }))
    .unwrap();
    csr.spec.expiration_seconds = lifetime;
    if labelled {
        csr.metadata.labels = Some([(node_identity::NODE_LABEL.to_owned(), node.to_owned())].into());
    }
    csr
}

/// The answer on request `name`, as `type: message` of its first condition once it has one.
async fn answer(up: &TestCluster, name: &str) -> String {
    kubectl(
        up.kubeconfig(),
        &[
            "get",
            "csr",
            name,
            "-o",
            "jsonpath={.status.conditions[0].type}: {.status.conditions[0].message}",
        ],
    )
    .await
}

/// Waits until request `name` is answered; the answer.
async fn answered(up: &TestCluster, name: &str) -> String {
    tensile_e2e::wait::within(&format!("request {name} answered"), 30, || async {
        let said = answer(up, name).await;
        if said.trim() == ":" {
            Err("unanswered".to_owned())
        } else {
            Ok(said)
        }
    })
    .await
}

/// What was lower-a's node account, asking for its node's certificate as a leaked credential
/// of its virtual node could: without a lifetime, or for ten years, the signer would issue a
/// certificate for its own maximum that no one can revoke, so both are denied with the reason;
/// for the day a node asks, it is approved. A request the approver does not watch (no node
/// label) waits, and is what [`node_identity_ends_with_the_cluster`] finds gone.
async fn node_account_asks_for_a_bounded_lifetime_only(up: &TestCluster) -> kube::Client {
    let account = account_client(up, &format!("{FULL}-vn-lower-a")).await;
    let requests: kube::Api<CertificateSigningRequest> = kube::Api::all(account.clone());
    let post = kube::api::PostParams::default();
    let ten_years = 10 * 365 * 24 * 3600;
    for csr in [
        node_request("lower-a-no-lifetime", "lower-a", None, true),
        node_request("lower-a-ten-years", "lower-a", Some(ten_years), true),
        node_request(
            "lower-a-a-day",
            "lower-a",
            Some(node_identity::LIFETIME_SECONDS),
            true,
        ),
        node_request(
            "lower-a-unwatched",
            "lower-a",
            Some(node_identity::LIFETIME_SECONDS),
            false,
        ),
    ] {
        requests.create(&post, &csr).await.unwrap();
    }
    assert_eq!(
        answered(up, "lower-a-no-lifetime").await,
        "Denied: spec.expirationSeconds is not set, so the signer would issue for its own maximum: a \
         node's certificate is issued for 86400 s at most"
    );
    assert_eq!(
        answered(up, "lower-a-ten-years").await,
        "Denied: spec.expirationSeconds 315360000 is longer than the 86400 s a node's certificate is \
         issued for"
    );
    assert_eq!(
        answered(up, "lower-a-a-day").await,
        "Approved: the client certificate of virtual node lower-a, asked for by its account"
    );
    assert_eq!(answer(up, "lower-a-unwatched").await.trim(), ":", "unanswered");
    account
}

/// Once lower-a has left, its node identity is unusable: what its account asked that was
/// unanswered is denied and, with all it asked, deleted (no one approves it later, and
/// nothing of it is left), the account can ask for nothing more (its token names an account
/// that is gone), and its Node is gone. A certificate issued before ends with its lifetime.
async fn node_identity_ends_with_the_cluster(up: &TestCluster, account: kube::Client) {
    for request in [
        "lower-a-unwatched",
        "lower-a-no-lifetime",
        "lower-a-ten-years",
        "lower-a-a-day",
    ] {
        let left = tensile_e2e::kubectl::run(up.kubeconfig(), &["get", "csr", request]).await;
        assert!(
            !left.ok && left.stderr.contains("NotFound"),
            "{request}: {}",
            left.stdout
        );
    }
    let requests: kube::Api<CertificateSigningRequest> = kube::Api::all(account);
    let again = node_request(
        "lower-a-again",
        "lower-a",
        Some(node_identity::LIFETIME_SECONDS),
        true,
    );
    match requests.create(&kube::api::PostParams::default(), &again).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 401, "{s:?}"),
        other => panic!("the account of a cluster that left asked again: {other:?}"),
    }
    let node = tensile_e2e::kubectl::run(up.kubeconfig(), &["get", "node", "lower-a"]).await;
    assert!(!node.ok && node.stderr.contains("NotFound"), "{}", node.stdout);
}

#[tokio::test]
async fn lower_clusters_join_with_one_command_run_pods_renew_their_credential_and_leave_without_a_trace() {
    let bed = bed();
    let (up, low_a, low_b) = (&bed.upper, &bed.lower_a, &bed.lower_b);

    // What lower-a holds before it ever joins.
    let lower_a_before = listing(low_a, None).await;

    // The chart, its controller (tokens renewed at 5 % of their life: 30 s of the shortest
    // lifetime the apiserver issues, 10 minutes), and the kubelet of its virtual nodes.
    let admin = format!("127.0.0.1:{}", tensile_e2e::free_port().unwrap());
    let mut controller = install_and_run_controller(
        up,
        &[
            "--token-renew-at=0.05".to_owned(),
            format!("--admin-addr={admin}"),
        ],
    )
    .await;
    let runner = VirtualNodeRunner::start(up, NS).unwrap();

    // A stale definition of the kind (an older release's: no status.lowerRemoved, which a
    // resumed removal needs) is brought to this release's by `tensilectl crds`: helm never
    // upgrades its crds/.
    let lower_removed = || {
        kubectl(
            up.kubeconfig(),
            &[
                "get",
                "crd",
                "lowerclusters.tensile.io",
                "-o",
                "jsonpath={.spec.versions[0].schema.openAPIV3Schema.properties.status.properties.lowerRemoved.type}",
            ],
        )
    };
    let definition = std::fs::read_to_string(chart::chart_dir().join("crds/lowerclusters.yaml")).unwrap();
    let stale = definition.replace("              lowerRemoved: {type: boolean}\n", "");
    assert_ne!(stale, definition);
    let file = up.dir().join("stale-lowerclusters.yaml");
    std::fs::write(&file, &stale).unwrap();
    kubectl(up.kubeconfig(), &["replace", "-f", &path(&file)]).await;
    assert_eq!(lower_removed().await, "", "the stale definition in force");
    let (ok, said) = tensilectl(&["crds", &format!("--upper-kubeconfig={}", path(up.kubeconfig()))]).await;
    assert!(
        ok && said.contains("CustomResourceDefinition lowerclusters.tensile.io: updated")
            && said.contains("CustomResourceDefinition exclusionrecords.tensile.io: "),
        "{said}"
    );
    assert_eq!(lower_removed().await, "boolean", "this release's definition");
    let (ok, said) = tensilectl(&["crds", &format!("--upper-kubeconfig={}", path(up.kubeconfig()))]).await;
    assert!(
        ok && said.contains("lowerclusters.tensile.io: already current"),
        "{said}"
    );
    let common = |name: &'static str, lower: &TestCluster| -> Vec<String> {
        vec![
            name.to_owned(),
            format!("--lower-kubeconfig={}", path(lower.kubeconfig())),
            format!("--upper-kubeconfig={}", path(up.kubeconfig())),
            format!("-n={NS}"),
        ]
    };

    // --dry-run prints both clusters' objects and makes none.
    let mut dry = common("lower-a", low_a);
    dry.push("--dry-run".into());
    let dry: Vec<&str> = dry.iter().map(String::as_str).collect();
    let (ok, printed) = tensilectl(&["join"].into_iter().chain(dry).collect::<Vec<_>>()).await;
    assert!(ok, "{printed}");
    for kind in [
        "kind: ServiceAccount",
        "kind: ClusterRole",
        "kind: Secret",
        "kind: LowerCluster",
    ] {
        assert!(printed.contains(kind), "dry run prints {kind}: {printed}");
    }
    assert_eq!(
        listing(low_a, None).await,
        lower_a_before,
        "a dry run makes nothing below"
    );
    assert!(
        kubectl(up.kubeconfig(), &["get", "lowerclusters", "-o", "name"])
            .await
            .trim()
            .is_empty(),
        "nor above"
    );

    // lower-b joins namespace-scoped: its admin made the namespace the fleet's pods use, with
    // default requests and a quota, and join grants a Role there and nothing cluster-wide.
    // The upper cluster as it then stands is what must come back after lower-a has joined
    // and left.
    low_b.create_namespace("fleet").await.unwrap();
    apply(
        low_b.kubeconfig(),
        r#"
apiVersion: v1
kind: LimitRange
metadata: {name: defaults, namespace: fleet}
spec: {limits: [{type: Container, defaultRequest: {cpu: 100m, memory: 64Mi}}]}
---
apiVersion: v1
kind: ResourceQuota
metadata: {name: fleet, namespace: fleet}
spec: {hard: {requests.cpu: "12", requests.memory: 24Gi, pods: "10"}}
"#,
    )
    .await;
    // Everything settles (the namespace's account and root CA) before lower-b's listing.
    scene::shows(
        low_b.kubeconfig(),
        "fleet",
        "serviceaccount/default",
        "name",
        "serviceaccount/default",
        30,
    )
    .await;
    let lower_b_before = listing(low_b, None).await;
    let mut join_b = common("lower-b", low_b);
    join_b.extend([
        "--node-labels=region=b".into(),
        "--token-lifetime=10m".into(),
        "--namespaces=fleet".into(),
    ]);
    let join_b: Vec<&str> = join_b.iter().map(String::as_str).collect();
    let (ok, said) = tensilectl(&["join"].into_iter().chain(join_b).collect::<Vec<_>>()).await;
    assert!(
        ok,
        "join lower-b: {said}\ncontroller: {}",
        controller.log_tail(4000)
    );
    assert!(said.contains("lower-b node=lower-b ready=True"), "{said}");
    assert!(said.contains("with a Role in namespace(s) fleet"), "{said}");
    let granted = kubectl(
        low_b.kubeconfig(),
        &[
            "get",
            "clusterroles,clusterrolebindings",
            "-l",
            "tensile.io/lower-cluster=lower-b",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(granted.trim().is_empty(), "nothing cluster-wide below: {granted}");
    let upper_before = listing(up, Some("fleet")).await;

    // A LowerCluster that claims lower-b's node name is refused and runs nothing; its
    // removal removes nothing of lower-b's.
    apply(
        up.kubeconfig(),
        &format!(
            "apiVersion: tensile.io/v1alpha1\nkind: LowerCluster\nmetadata:\n  name: impostor\n  labels: {{tensile.io/controller-namespace: {NS}}}\n\
             spec: {{credential: {{secretName: lower-b-credential}}, nodeName: lower-b}}\n"
        ),
    )
    .await;
    eventually(
        up.kubeconfig(),
        "the impostor refused",
        30,
        &[
            "get",
            "lowercluster",
            "impostor",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Accepted")].message}"#,
        ],
        r#"the virtual node name "lower-b" is LowerCluster lower-b's; choose another (spec.nodeName)"#,
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &[
            "delete",
            "lowercluster",
            "impostor",
            "--wait=true",
            "--timeout=60s",
        ],
    )
    .await;
    eventually(
        up.kubeconfig(),
        "lower-b untouched by the impostor's removal",
        10,
        &[
            "get",
            "lowercluster",
            "lower-b",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
        ],
        "True",
    )
    .await;
    assert_eq!(
        listing(up, Some("fleet")).await,
        upper_before,
        "nothing of lower-b's was removed"
    );
    // A LowerCluster whose first overrides fail their checks has nothing in force to keep:
    // its virtual node is not started until they pass, and the status says why.
    apply(
        up.kubeconfig(),
        &format!(
            "apiVersion: tensile.io/v1alpha1\nkind: LowerCluster\nmetadata:\n  name: held\n  labels: {{tensile.io/controller-namespace: {NS}}}\n\
             spec: {{credential: {{secretName: lower-b-credential}}, overrides: {{rules: [{{name: mirror, image: {{regex: {{pattern: '(', replacement: x}}}}}}]}}}}\n"
        ),
    )
    .await;
    tensile_e2e::wait::within("held refused for its overrides", 30, || async {
        let said = kubectl(
            up.kubeconfig(),
            &[
                "get",
                "lowercluster",
                "held",
                "-o",
                r#"jsonpath={.status.conditions[?(@.type=="Accepted")].message}"#,
            ],
        )
        .await;
        match said.starts_with("spec.overrides: rule \"mirror\": image.regex: regex parse error")
            && said.ends_with("none were accepted before, so the virtual node is not started until they pass")
        {
            true => Ok(()),
            false => Err(said),
        }
    })
    .await;
    let made = kubectl(
        up.kubeconfig(),
        &["-n", NS, "get", "deployments,configmaps", "-o", "name"],
    )
    .await;
    assert!(!made.contains("vn-held"), "nothing runs for it: {made}");
    kubectl(
        up.kubeconfig(),
        &["delete", "lowercluster", "held", "--wait=true", "--timeout=60s"],
    )
    .await;
    assert_eq!(
        listing(up, Some("fleet")).await,
        upper_before,
        "its removal removed nothing"
    );

    let mut join_a = common("lower-a", low_a);
    join_a.extend(["--node-labels=region=a".into(), "--token-lifetime=10m".into()]);
    let join_a: Vec<&str> = join_a.iter().map(String::as_str).collect();
    let (ok, said) = tensilectl(&["join"].into_iter().chain(join_a).collect::<Vec<_>>()).await;
    assert!(
        ok,
        "join lower-a: {said}\ncontroller: {}",
        controller.log_tail(4000)
    );
    assert!(
        said.contains(&format!(
            "lower-a node=lower-a ready=True version={} nodes=2",
            low_a.version()
        )),
        "{said}"
    );

    // The fleet at a glance: both Ready, with their versions and sizes.
    let fleet = kubectl(up.kubeconfig(), &["get", "lowerclusters", "--no-headers"]).await;
    eprintln!("kubectl get lowerclusters:\n{fleet}");
    let rows: Vec<Vec<&str>> = fleet.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), 2, "{fleet}");
    assert_eq!(
        &rows[0][..6],
        ["lower-a", "lower-a", "True", low_a.version(), "2", "8"],
        "{fleet}"
    );
    // lower-b's credential reads no node: its room is its namespace's quota.
    assert_eq!(
        &rows[1][..4],
        ["lower-b", "lower-b", "True", low_b.version()],
        "{fleet}"
    );
    let room = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "lowercluster",
            "lower-b",
            "-o",
            "jsonpath={.status.lowerNodes}/{.status.allocatable.cpu}",
        ],
    )
    .await;
    assert_eq!(room, "/12", "no node count; the quota's cpu");
    let (ok, status) =
        tensilectl(&["status", &format!("--upper-kubeconfig={}", path(up.kubeconfig()))]).await;
    assert!(
        ok && status.lines().count() == 2 && status.contains("lower-b node=lower-b ready=True"),
        "{status}"
    );
    let (ok, json) = tensilectl(&[
        "status",
        "-o",
        "json",
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
    ])
    .await;
    let fleet_json: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
    assert!(ok, "{json}");
    assert_eq!(
        fleet_json.as_array().map(|a| a
            .iter()
            .map(|c| (c["name"].clone(), c["ready"].clone()))
            .collect::<Vec<_>>()),
        Some(vec![
            ("lower-a".into(), "True".into()),
            ("lower-b".into(), "True".into())
        ]),
        "{json}"
    );
    // The release may not be uninstalled now (the check its pre-delete hook runs): each
    // joined cluster is named with the command that removes it.
    let uninstall_check = [
        "uninstall-check",
        "--wait=0",
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
    ];
    let (ok, said) = tensilectl(&uninstall_check).await;
    assert!(
        !ok && ["lower-a", "lower-b"]
            .iter()
            .all(|c| said.contains(&format!("{c}: tensilectl leave {c} -n {NS}"))),
        "uninstall-check with two clusters joined: {said}"
    );
    // Each became Ready, and says so in an event on its LowerCluster.
    for cluster in ["lower-a", "lower-b"] {
        cluster_event_until(up, cluster, "Normal Ready").await;
    }
    join_and_leave_refuse_to_take_over_or_reach_past_their_fleet(up, low_a, low_b).await;
    a_right_the_credential_lacks_is_named_and_join_grants_it_again(up, low_a).await;
    a_lower_cluster_gone_for_good_leaves_saying_what_stays_below(up, low_b).await;
    eventually(
        up.kubeconfig(),
        "each virtual node with the labels it joined with",
        30,
        &[
            "get",
            "nodes",
            "-l",
            "region",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.metadata.labels.region} {end}",
        ],
        "lower-a=a lower-b=b",
    )
    .await;

    // Pods run on both, with what they reference copied below.
    up.create_namespace("fleet").await.unwrap();
    apply(up.kubeconfig(), &workload(4)).await;
    tensile_e2e::wait::must(
        "web spread 2 + 2 and Running",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            let s = spread(up).await;
            if s == "lower-a=2,lower-b=2" {
                Ok(())
            } else {
                Err(s)
            }
        },
    )
    .await;
    for lower in [low_a, low_b] {
        let below = kubectl(
            lower.kubeconfig(),
            &["-n", "fleet", "get", "pods,configmaps", "-o", "name"],
        )
        .await;
        assert_eq!(below.matches("pod/").count(), 2, "{}: {below}", lower.name());
        assert!(below.contains("configmap/settings"), "{}: {below}", lower.name());
    }

    // The credential's 10-minute token is renewed (at 30 s here) and the Secret holds the new
    // one; the virtual nodes read it from their mounted file and no call of theirs is refused.
    let digest = || {
        kubectl(
            up.kubeconfig(),
            &[
                "-n",
                NS,
                "get",
                "deployment",
                "fleet-tensile-vn-lower-a",
                "-o",
                r"jsonpath={.spec.template.metadata.annotations.tensile\.io/credential-digest}",
            ],
        )
    };
    let joined_digest = digest().await;
    assert!(!joined_digest.is_empty(), "the pod template names its credential");
    let joined_token = secret_token(up, "lower-a-credential").await;
    tensile_e2e::wait::must(
        "lower-a's token renewed",
        Duration::from_secs(90),
        Duration::from_secs(2),
        || async {
            let now = secret_token(up, "lower-a-credential").await;
            if now != joined_token {
                Ok(())
            } else {
                Err("the token is still the one join made".to_owned())
            }
        },
    )
    .await;
    tensile_e2e::wait::must(
        "the renewed token in lower-a's mounted credential",
        Duration::from_secs(30),
        Duration::from_secs(1),
        || async {
            let seen = runner.seen();
            match seen.credential_updates.get(&format!("{FULL}-vn-lower-a")) {
                Some(n) if *n >= 1 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    credential_rotation_rolls_the_node_and_a_deleted_secret_goes(up, &runner, &joined_digest, digest).await;
    // What an operator alerts on: each credential's expiry (a 10-minute token renewed at 5 %
    // expires within 10 minutes), and each cluster Ready.
    tensile_e2e::wait::within("the controller's fleet metrics", 30, || async {
        let (_, body) = tensile_e2e::in_process::admin_get(&admin, "/metrics")
            .await
            .ok_or("no answer on /metrics")?;
        let now = jiff::Timestamp::now().as_second();
        let sample = |line: &str| {
            body.lines()
                .find_map(|l| l.strip_prefix(line))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        let expiry = sample(r#"tensile_controller_credential_expiry_timestamp_seconds{cluster="lower-a"} "#);
        let ready = (
            sample(r#"tensile_controller_cluster_ready{cluster="lower-a"} "#),
            sample(r#"tensile_controller_cluster_ready{cluster="lower-b"} "#),
        );
        match (expiry, ready) {
            (Some(at), (Some(1.0), Some(1.0))) if at as i64 > now && (at as i64) <= now + 600 => Ok(()),
            other => Err(format!("{other:?} at {now}")),
        }
    })
    .await;
    let expires = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "lowercluster",
            "lower-a",
            "-o",
            "jsonpath={.status.credentialExpires}",
        ],
    )
    .await;
    assert!(
        !expires.trim().is_empty(),
        "the status says when the token in force expires"
    );
    // Past kube's token-file reload (a minute) the virtual node calls with the new token:
    // scaling up still places pods below, and no call was refused.
    tokio::time::sleep(Duration::from_secs(65)).await;
    kubectl(
        up.kubeconfig(),
        &["-n", "fleet", "scale", "deployment/web", "--replicas=6"],
    )
    .await;
    tensile_e2e::wait::must(
        "web spread 3 + 3",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            let s = spread(up).await;
            if s == "lower-a=3,lower-b=3" {
                Ok(())
            } else {
                Err(s)
            }
        },
    )
    .await;
    for (name, log) in runner.seen().logs {
        let text = tensile_e2e::process::log_tail(&log, 4_000_000);
        assert!(
            !text.contains("Unauthorized") && !text.contains(" 401"),
            "{name} made a call with a token the lower cluster refused:\n{text}"
        );
        assert!(
            chart::denied_calls(&text).is_empty(),
            "{name}: {:?}",
            chart::denied_calls(&text)
        );
    }

    // lower-b's overrides, said in its LowerCluster: the controller checks them, hands them
    // to the virtual node as a ConfigMap it mounts, and pods made there from then on carry
    // them; a malformed edit is refused with the reason and the rules in force stay.
    let set_overrides = |overrides: &'static str| async move {
        let patch = format!(r#"{{"spec":{{"overrides":{overrides}}}}}"#);
        kubectl(
            up.kubeconfig(),
            &["patch", "lowercluster", "lower-b", "--type=merge", "-p", &patch],
        )
        .await
    };
    set_overrides(
        r#"{"rules":[{"name":"region","labels":{"region":"b"},"env":[{"name":"REGION","value":"b"}]}]}"#,
    )
    .await;
    eventually(
        up.kubeconfig(),
        "lower-b's overrides accepted",
        30,
        &[
            "get",
            "lowercluster",
            "lower-b",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="OverridesAccepted")].message}"#,
        ],
        "1 rule(s) and 0 StorageClass name(s) in force",
    )
    .await;
    let log_b = runner.seen().logs[&format!("{FULL}-vn-lower-b")].clone();
    tensile_e2e::wait::must(
        "lower-b's virtual node follows its overrides",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            let text = tensile_e2e::process::log_tail(&log_b, 4_000_000);
            match text.contains("overrides loaded") {
                true => Ok(()),
                false => Err("not loaded yet".to_owned()),
            }
        },
    )
    .await;
    apply(
        up.kubeconfig(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: tagged, namespace: fleet}
spec:
  nodeSelector: {kubernetes.io/hostname: lower-b}
  tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
  terminationGracePeriodSeconds: 1
  containers: [{name: app, image: nginx}]
"#,
    )
    .await;
    scene::pod_shows(
        low_b.kubeconfig(),
        "fleet",
        "tagged",
        "jsonpath={.metadata.labels.region} {.spec.containers[0].env[0].value}",
        "b b",
        60,
    )
    .await;
    let untouched = kubectl(
        low_b.kubeconfig(),
        &["-n", "fleet", "get", "pods", "-l", "app=web,region", "-o", "name"],
    )
    .await;
    assert!(
        untouched.trim().is_empty(),
        "pods made before keep what they were made with: {untouched}"
    );
    // What the schema can check, the apiserver refuses: kubectl says why, nothing changes.
    let refused = tensile_e2e::kubectl::run(
        up.kubeconfig(),
        &[
            "patch",
            "lowercluster",
            "lower-b",
            "--type=merge",
            "-p",
            r#"{"spec":{"overrides":{"rules":[{"name":"Region","labels":{"region":"c"}}]}}}"#,
        ],
    )
    .await;
    assert!(
        !refused.ok
            && refused.stderr.contains("spec.overrides.rules[0].name")
            && refused.stderr.contains("Region"),
        "{}",
        refused.stderr
    );
    tensile_e2e::check::node_name_change_refused(up.kubeconfig(), "lower-b").await;
    // What only the controller can check, it refuses, and the rules in force stay.
    set_overrides(r#"{"rules":[{"name":"region","image":{"regex":{"pattern":"(","replacement":"x"}}}]}"#)
        .await;
    eventually(
        up.kubeconfig(),
        "the malformed overrides refused",
        30,
        &[
            "get",
            "lowercluster",
            "lower-b",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="OverridesAccepted")].status} {.status.conditions[?(@.type=="Ready")].status}"#,
        ],
        "False True",
    )
    .await;
    let why = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "lowercluster",
            "lower-b",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="OverridesAccepted")].message}"#,
        ],
    )
    .await;
    assert!(
        why.starts_with("spec.overrides: rule \"region\": image.regex: regex parse error")
            && why.ends_with("the overrides accepted before stay in force"),
        "{why}"
    );
    let in_force = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            NS,
            "get",
            "configmap",
            &format!("{FULL}-vn-lower-b"),
            "-o",
            r"jsonpath={.data.overrides\.json}",
        ],
    )
    .await;
    assert!(
        in_force.contains("\"region\"") && !in_force.contains("regex"),
        "{in_force}"
    );
    kubectl(
        up.kubeconfig(),
        &[
            "-n",
            "fleet",
            "delete",
            "pod",
            "tagged",
            "--wait=true",
            "--timeout=60s",
        ],
    )
    .await;

    // A lower admin's own objects, in the namespace the virtual node made and in the one join
    // made, keep those namespaces.
    for ns in ["fleet", "tensile"] {
        apply(
            low_a.kubeconfig(),
            &format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: theirs, namespace: {ns}}}\ndata: {{owner: lower-admin}}\n"),
        )
        .await;
    }

    let lower_a_account = node_account_asks_for_a_bounded_lifetime_only(up).await;

    // lower-a leaves: its pods move to lower-b, and nothing of it is left in either cluster.
    // Its removal survives the controller killed after each step (as `kill -9` ends it, its
    // election Lease still held) and the credential Secret deleted half-way: each run finds
    // done what the last one did, and the last run finishes.
    controller.stop();
    let leave_args: Vec<String> = vec![
        "leave".into(),
        "lower-a".into(),
        format!("--lower-kubeconfig={}", path(low_a.kubeconfig())),
        format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        format!("-n={NS}"),
    ];
    let leave = tokio::spawn(async move {
        let args: Vec<&str> = leave_args.iter().map(String::as_str).collect();
        tensilectl(&args).await
    });
    let get = |args: &'static [&'static str]| kubectl(up.kubeconfig(), args);
    for step in ["drained", "stopped", "below", "released"] {
        if step == "released" {
            // Held by the controller's finalizer, it stays until the removal lets it go.
            get(&["-n", NS, "delete", "secret", "lower-a-credential", "--wait=false"]).await;
        }
        let mut crashing = chart::run_cluster_controller(up, NS, FULL, &[format!("--crash-at={step}")])
            .await
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(150);
        let status = loop {
            if let Some(status) = crashing.exited() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the controller did not reach {step}: {}",
                crashing.log_tail(6000)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert!(!status.success(), "{status}");
        assert!(
            crashing.log_tail(6000).contains("aborting"),
            "{}",
            crashing.log_tail(6000)
        );
        let finalizers = get(&[
            "get",
            "lowercluster",
            "lower-a",
            "-o",
            "jsonpath={.metadata.finalizers}",
        ])
        .await;
        assert!(
            finalizers.contains("tensile.io/lower-cluster"),
            "after {step}: still held: {finalizers}"
        );
        let node = get(&["get", "nodes", "-o", "name"]).await;
        let deployments = get(&["-n", NS, "get", "deployments", "-o", "name"]).await;
        let secret = get(&["-n", NS, "get", "secrets", "-o", "name"]).await;
        let lower_removed = get(&[
            "get",
            "lowercluster",
            "lower-a",
            "-o",
            "jsonpath={.status.lowerRemoved}",
        ])
        .await;
        match step {
            "drained" => {
                let cordoned = get(&["get", "node", "lower-a", "-o", "jsonpath={.spec.unschedulable}"]).await;
                assert_eq!(cordoned.trim(), "true");
                assert!(deployments.contains("fleet-tensile-vn-lower-a"), "{deployments}");
            }
            "stopped" => {
                assert!(!deployments.contains("fleet-tensile-vn-lower-a"), "{deployments}");
                assert!(node.contains("node/lower-a"), "{node}");
                assert_eq!(lower_removed.trim(), "");
            }
            "below" => {
                assert_eq!(lower_removed.trim(), "true");
                assert!(node.contains("node/lower-a"), "upstream is next: {node}");
                assert!(secret.contains("lower-a-credential"), "{secret}");
            }
            _ => {
                assert!(!node.contains("node/lower-a"), "{node}");
                assert!(
                    !secret.contains("lower-a-credential"),
                    "let go once released: {secret}"
                );
            }
        }
        println!("removal: the controller aborted after {step}, the LowerCluster still held");
    }
    controller = chart::run_cluster_controller(up, NS, FULL, &["--token-renew-at=0.05".to_owned()])
        .await
        .unwrap();
    let (ok, said) = leave.await.unwrap();
    assert!(
        ok,
        "leave lower-a: {said}\ncontroller: {}",
        controller.log_tail(6000)
    );
    assert!(said.contains("lower-a has left"), "{said}");
    node_identity_ends_with_the_cluster(up, lower_a_account).await;
    assert!(
        said.contains("namespace tensile holds objects of others: kept"),
        "{said}"
    );
    tensile_e2e::wait::must(
        "web all on lower-b",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            let s = spread(up).await;
            if s == "lower-b=6" { Ok(()) } else { Err(s) }
        },
    )
    .await;
    let kept = kubectl(
        low_a.kubeconfig(),
        &["-n", "fleet", "get", "configmaps,pods", "-o", "name"],
    )
    .await;
    let kept: Vec<&str> = kept
        .lines()
        .filter(|l| *l != "configmap/kube-root-ca.crt")
        .collect();
    assert_eq!(
        kept,
        ["configmap/theirs"],
        "only the lower admin's object is left in namespace fleet"
    );
    let kept = kubectl(
        low_a.kubeconfig(),
        &[
            "-n",
            "tensile",
            "get",
            "configmaps,serviceaccounts,roles",
            "-o",
            "name",
        ],
    )
    .await;
    let kept: Vec<&str> = kept
        .lines()
        .filter(|l| *l != "configmap/kube-root-ca.crt" && *l != "serviceaccount/default")
        .collect();
    assert_eq!(
        kept,
        ["configmap/theirs"],
        "join's account and role went, the admin's object stayed"
    );
    kubectl(
        low_a.kubeconfig(),
        &["delete", "namespace", "fleet", "tensile", "--wait=true"],
    )
    .await;
    listing_returns_to(low_a, None, &lower_a_before, "lower-a as it was before it joined").await;
    listing_returns_to(
        up,
        Some("fleet"),
        &upper_before,
        "the upper cluster as it was before lower-a joined",
    )
    .await;
    assert!(
        kubectl(up.kubeconfig(), &["get", "lowerclusters", "-o", "name"])
            .await
            .trim()
            == "lowercluster.tensile.io/lower-b",
        "lower-b stays"
    );

    // lower-b leaves too: its Role and binding in the served namespace go with the rest of
    // what join made, and the admin's namespace, quota and defaults stay.
    kubectl(
        up.kubeconfig(),
        &["-n", "fleet", "delete", "deployment", "web", "--wait=true"],
    )
    .await;
    let (ok, said) = tensilectl(&[
        "leave",
        "lower-b",
        &format!("--lower-kubeconfig={}", path(low_b.kubeconfig())),
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
    ])
    .await;
    assert!(
        ok,
        "leave lower-b: {said}\ncontroller: {}",
        controller.log_tail(4000)
    );
    assert!(
        said.contains("RoleBinding fleet/tensile-lower-b") && said.contains("Role fleet/tensile-lower-b"),
        "{said}"
    );
    listing_returns_to(low_b, None, &lower_b_before, "lower-b as it was before it joined").await;
    let (ok, said) = tensilectl(&uninstall_check).await;
    assert!(ok, "uninstall-check with every cluster gone: {said}");

    assert!(controller.exited().is_none(), "{}", controller.log_tail(4000));
    let log = controller.log_tail(4_000_000);
    assert!(
        chart::denied_calls(&log).is_empty(),
        "the controller was refused calls: {:?}",
        chart::denied_calls(&log)
    );
    runner.shutdown().await;
}

/// The clients go through the HTTP proxy a kubeconfig's `proxy-url` names, and reach a
/// loopback apiserver directly whatever `HTTPS_PROXY` says, as client-go's do.
#[tokio::test]
async fn the_clients_go_through_the_proxy_the_kubeconfig_names() {
    let up = &bed().upper;
    // The kind `status` lists (helm, installing the chart in the other test, leaves a
    // definition that is there alone).
    let crd = chart::chart_dir().join("crds/lowerclusters.yaml");
    kubectl(up.kubeconfig(), &["apply", "-f", &path(&crd)]).await;
    kubectl(
        up.kubeconfig(),
        &[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/lowerclusters.tensile.io",
        ],
    )
    .await;
    let proxy = tensile_e2e::proxy::ConnectProxy::start().await.unwrap();
    let status = [
        "status".to_owned(),
        format!("--upper-kubeconfig={}", path(up.kubeconfig())),
    ];
    let status: Vec<&str> = status.iter().map(String::as_str).collect();

    // The bed's apiserver is on 127.0.0.1, which client-go never reaches through a proxy
    // named by the environment (the unit tests cover other hosts and NO_PROXY).
    let (ok, said) = tensilectl_with(&status, &[("HTTPS_PROXY", &proxy.url())]).await;
    assert!(ok, "{said}");
    assert_eq!(proxy.tunnels(), 0, "a loopback apiserver is reached directly");
    let through = proxy.tunnels();

    let with_proxy = up.dir().join("proxied.kubeconfig");
    let text = std::fs::read_to_string(up.kubeconfig()).unwrap();
    let mut config: serde_json::Value = serde_yaml::from_str(&text).unwrap();
    config["clusters"][0]["cluster"]["proxy-url"] = proxy.url().into();
    std::fs::write(&with_proxy, serde_yaml::to_string(&config).unwrap()).unwrap();
    let (ok, said) = tensilectl_with(
        &["status", &format!("--upper-kubeconfig={}", path(&with_proxy))],
        &[],
    )
    .await;
    assert!(ok, "{said}");
    assert!(
        proxy.tunnels() > through,
        "the kubeconfig's proxy-url: no tunnel was opened"
    );
}

/// Waits until an event of `type reason` (as `kubectl get events` shows them) is on
/// LowerCluster `cluster`.
async fn cluster_event_until(up: &TestCluster, cluster: &str, seen: &str) {
    let selector = format!("involvedObject.kind=LowerCluster,involvedObject.name={cluster}");
    tensile_e2e::wait::within(&format!("event {seen} on LowerCluster {cluster}"), 60, || async {
        let events = kubectl(
            up.kubeconfig(),
            &[
                "get",
                "events",
                "-A",
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={range .items[*]}{.type} {.reason}{\"\\n\"}{end}",
            ],
        )
        .await;
        match events.lines().any(|l| l == seen) {
            true => Ok(()),
            false => Err(events),
        }
    })
    .await;
}

/// The credential Secret of lower-a as an operator rotates it: a renewed token rolls
/// nothing; another kubeconfig (the same apiserver by another name) rolls the virtual node,
/// which comes back Ready; a deleted Secret goes (no finalizer holds it) and the cluster says
/// so, until join makes it again.
async fn credential_rotation_rolls_the_node_and_a_deleted_secret_goes<F, Fut>(
    up: &TestCluster,
    runner: &VirtualNodeRunner,
    joined_digest: &str,
    digest: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = String>,
{
    assert_eq!(digest().await, joined_digest, "a renewed token rolls nothing");
    let rollouts = || {
        runner
            .seen()
            .rollouts
            .get(&format!("{FULL}-vn-lower-a"))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(rollouts(), 0);
    let encoded = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            NS,
            "get",
            "secret",
            "lower-a-credential",
            "-o",
            "jsonpath={.data.kubeconfig}",
        ],
    )
    .await;
    let kubeconfig = String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .unwrap(),
    )
    .unwrap();
    assert!(kubeconfig.contains("https://127.0.0.1:"), "{kubeconfig}");
    let renamed = kubeconfig.replace("https://127.0.0.1:", "https://localhost:");
    let patch = serde_json::json!({"data": {"kubeconfig": base64::engine::general_purpose::STANDARD.encode(renamed)}});
    kubectl(
        up.kubeconfig(),
        &[
            "-n",
            NS,
            "patch",
            "secret",
            "lower-a-credential",
            "--type=merge",
            "-p",
            &patch.to_string(),
        ],
    )
    .await;
    tensile_e2e::wait::within("the virtual node rolled for its new kubeconfig", 60, || async {
        match (digest().await, rollouts()) {
            (now, 1) if now != joined_digest => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let ready = || {
        kubectl(
            up.kubeconfig(),
            &[
                "get",
                "lowercluster",
                "lower-a",
                "-o",
                r#"jsonpath={.status.conditions[?(@.type=="CredentialValid")].reason} {.status.conditions[?(@.type=="NodeReady")].status} {.status.conditions[?(@.type=="Ready")].status}"#,
            ],
        )
    };
    tensile_e2e::wait::within("lower-a Ready again through its new kubeconfig", 90, || async {
        match ready().await {
            now if now == "Accepted True True" => Ok(()),
            now => Err(now),
        }
    })
    .await;
    // Deleted, it goes at once (the controller lets it go), and the cluster says why.
    kubectl(
        up.kubeconfig(),
        &[
            "-n",
            NS,
            "delete",
            "secret",
            "lower-a-credential",
            "--wait=true",
            "--timeout=60s",
        ],
    )
    .await;
    tensile_e2e::wait::within("lower-a says its Secret is missing", 60, || async {
        match ready().await {
            now if now.starts_with("SecretMissing ") && now.ends_with(" False") => Ok(()),
            now => Err(now),
        }
    })
    .await;
    cluster_event_until(up, "lower-a", "Warning NotReadySecretMissing").await;
    // join, again of the same cluster, makes it anew.
    let (ok, said) = tensilectl(&[
        "join",
        "lower-a",
        &format!("--lower-kubeconfig={}", path(bed().lower_a.kubeconfig())),
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
        "--node-labels=region=a",
        "--token-lifetime=10m",
    ])
    .await;
    assert!(ok && said.contains("lower-a node=lower-a ready=True"), "{said}");
}

/// A lower cluster gone for good leaves without being reached (`--lower-unreachable`): its
/// LowerCluster, virtual node and credential go upstream, and what stays below is said; it is
/// there, and its admin removes it by the labels named.
async fn a_lower_cluster_gone_for_good_leaves_saying_what_stays_below(up: &TestCluster, low_b: &TestCluster) {
    let upper_now = listing(up, Some("fleet")).await;
    let lower_now = listing(low_b, None).await;
    let (ok, said) = tensilectl(&[
        "join",
        "spare",
        &format!("--lower-kubeconfig={}", path(low_b.kubeconfig())),
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
        "--token-lifetime=10m",
    ])
    .await;
    assert!(ok && said.contains("spare node=spare ready=True"), "{said}");
    let (ok, said) = tensilectl(&[
        "leave",
        "spare",
        "--lower-unreachable",
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
    ])
    .await;
    assert!(
        ok && said.contains("LowerCluster spare removed")
            && said.contains(
                "not reached (--lower-unreachable); left there: ServiceAccount tensile/tensile-spare"
            ),
        "{said}"
    );
    listing_returns_to(up, Some("fleet"), &upper_now, "the upper cluster without spare").await;
    let stays = kubectl(
        low_b.kubeconfig(),
        &[
            "get",
            "serviceaccounts,clusterroles",
            "-A",
            "-l",
            "tensile.io/lower-cluster=spare",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(
        stays.contains("serviceaccount/tensile-spare")
            && stays.contains("clusterrole.rbac.authorization.k8s.io/tensile-spare"),
        "what was said to stay is there: {stays}"
    );
    for kinds in [
        "serviceaccounts,roles,rolebindings",
        "clusterroles,clusterrolebindings",
    ] {
        kubectl(
            low_b.kubeconfig(),
            &[
                "delete",
                kinds,
                "-A",
                "-l",
                "tensile.io/lower-cluster=spare",
                "--wait=true",
            ],
        )
        .await;
    }
    listing_returns_to(
        low_b,
        None,
        &lower_now,
        "lower-b once its admin removed what stayed",
    )
    .await;
}

/// A lower admin trims lower-a's ClusterRole of a right its virtual node needs (in-place
/// resize): the LowerCluster says which right its credential lacks, and join, again of the
/// same cluster, grants it back.
async fn a_right_the_credential_lacks_is_named_and_join_grants_it_again(
    up: &TestCluster,
    low_a: &TestCluster,
) {
    let role = kubectl(
        low_a.kubeconfig(),
        &["get", "clusterrole", "tensile-lower-a", "-o", "json"],
    )
    .await;
    let mut role: serde_json::Value = serde_json::from_str(&role).unwrap();
    let rules = role["rules"].as_array_mut().unwrap();
    let before = rules.len();
    rules.retain(|r| r["resources"] != serde_json::json!(["pods/resize"]));
    assert_eq!(rules.len(), before - 1, "{role}");
    let file = up.dir().join("trimmed-role.json");
    std::fs::write(&file, role.to_string()).unwrap();
    kubectl(low_a.kubeconfig(), &["replace", "-f", &path(&file)]).await;
    let credential = || {
        kubectl(
            up.kubeconfig(),
            &[
                "get",
                "lowercluster",
                "lower-a",
                "-o",
                r#"jsonpath={.status.conditions[?(@.type=="CredentialValid")].reason}: {.status.conditions[?(@.type=="CredentialValid")].message}"#,
            ],
        )
    };
    tensile_e2e::wait::within("the missing right named", 120, || async {
        let said = credential().await;
        match said
            .starts_with("InsufficientRights: the credential may not patch pods/resize (in-place resize)")
        {
            true => Ok(()),
            false => Err(said),
        }
    })
    .await;
    let (ok, said) = tensilectl(&[
        "join",
        "lower-a",
        &format!("--lower-kubeconfig={}", path(low_a.kubeconfig())),
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
        &format!("-n={NS}"),
        "--node-labels=region=a",
        "--token-lifetime=10m",
    ])
    .await;
    assert!(ok && said.contains("lower-a node=lower-a ready=True"), "{said}");
    assert!(credential().await.starts_with("Accepted: "));
}

/// With lower-a and lower-b joined: a join that would take an entry, a name or an object
/// over is refused before anything is made, and a leave reaches nothing of another fleet
/// or another lower cluster. Each leaves both clusters as it found them.
async fn join_and_leave_refuse_to_take_over_or_reach_past_their_fleet(
    up: &TestCluster,
    low_a: &TestCluster,
    low_b: &TestCluster,
) {
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        tensilectl(&args).await
    };
    let flags = |verb: &str, name: &str, lower: &TestCluster| -> Vec<String> {
        vec![
            verb.to_owned(),
            name.to_owned(),
            format!("--lower-kubeconfig={}", path(lower.kubeconfig())),
            format!("--upper-kubeconfig={}", path(up.kubeconfig())),
            format!("-n={NS}"),
        ]
    };
    let record = || {
        kubectl(
            up.kubeconfig(),
            &[
                "get",
                "lowercluster",
                "lower-a",
                "-o",
                "jsonpath={.metadata.annotations}",
            ],
        )
    };
    let recorded = record().await;
    assert!(
        recorded.contains("tensile.io/lower-cluster-uid") && recorded.contains("tensile.io/lower-namespace"),
        "join records which lower cluster it joined: {recorded}"
    );
    let lower_b_now = listing(low_b, None).await;
    // lower-a's entry pointed at lower-b: refused, nothing made there, the entry as it was.
    let (ok, said) = run(flags("join", "lower-a", low_b)).await;
    assert!(
        !ok && said.contains("LowerCluster lower-a is joined to another lower cluster"),
        "{said}"
    );
    assert_eq!(record().await, recorded, "the entry is untouched");
    assert_eq!(listing(low_b, None).await, lower_b_now, "nothing made below");
    // The same cluster joined again renews its grants and credential; --wait 0 returns at once.
    let mut again = flags("join", "lower-a", low_a);
    again.extend([
        "--node-labels=region=a".into(),
        "--token-lifetime=10m".into(),
        "--wait=0".into(),
    ]);
    let (ok, said) = run(again).await;
    assert!(
        ok && !said.contains("ready="),
        "a join again, not waited for: {said}"
    );
    // A name longer than the release's names allow (fleet-tensile-vn-NAME within 47).
    let (ok, said) = run(flags("join", "a-name-far-too-long-for-this-fleet", low_a)).await;
    assert!(
        !ok && said.contains("with its pods' suffixes it must stay within 47"),
        "{said}"
    );
    // An upper Node of that name, which is no virtual node of the fleet.
    apply(
        up.kubeconfig(),
        "apiVersion: v1\nkind: Node\nmetadata: {name: bystander}\n",
    )
    .await;
    let (ok, said) = run(flags("join", "bystander", low_a)).await;
    assert!(
        !ok && said.contains("Node bystander exists and is no LowerCluster's virtual node"),
        "{said}"
    );
    kubectl(up.kubeconfig(), &["delete", "node", "bystander"]).await;
    // A lower ClusterRole of join's name that someone else made: named, kept, not relabelled;
    // a leave of that name reports it kept.
    let lower_a_now = listing(low_a, None).await;
    apply(
        low_a.kubeconfig(),
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: tensile-squatter}\nrules: []\n",
    )
    .await;
    let (ok, said) = run(flags("join", "squatter", low_a)).await;
    assert!(
        !ok && said.contains("ClusterRole tensile-squatter exist and were not made by tensilectl"),
        "{said}"
    );
    let labels = kubectl(
        low_a.kubeconfig(),
        &[
            "get",
            "clusterrole",
            "tensile-squatter",
            "-o",
            "jsonpath={.metadata.labels}",
        ],
    )
    .await;
    assert_eq!(labels, "", "not relabelled");
    let (ok, said) = run(flags("leave", "squatter", low_a)).await;
    assert!(
        ok && said.contains("kept ClusterRole tensile-squatter")
            && said.contains("nothing of squatter was found"),
        "{said}"
    );
    kubectl(low_a.kubeconfig(), &["delete", "clusterrole", "tensile-squatter"]).await;
    assert_eq!(listing(low_a, None).await, lower_a_now, "nothing made below");
    // leave with the wrong lower kubeconfig: refused before anything is removed.
    let (ok, said) = run(flags("leave", "lower-a", low_b)).await;
    assert!(
        !ok && said.contains("the lower kubeconfig reaches another"),
        "{said}"
    );
    // leave from another upper cluster (another fleet): nothing of this fleet's is removed.
    let mut elsewhere = flags("leave", "lower-a", low_a);
    elsewhere[3] = format!("--upper-kubeconfig={}", path(low_b.kubeconfig()));
    let (ok, said) = run(elsewhere).await;
    assert!(
        ok && said.contains("nothing of lower-a was found")
            && said.contains("kept ServiceAccount tensile/tensile-lower-a"),
        "{said}"
    );
    assert_eq!(
        listing(low_a, None).await,
        lower_a_now,
        "another fleet's leave removed nothing"
    );
    eventually(
        up.kubeconfig(),
        "lower-a still Ready",
        60,
        &[
            "get",
            "lowercluster",
            "lower-a",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
        ],
        "True",
    )
    .await;
}

#[tokio::test]
async fn join_refuses_what_it_cannot_do_with_the_reason_and_makes_nothing() {
    let bed = bed();
    let (up, low_b) = (&bed.upper, &bed.lower_b);
    let join = |ns: &str, extra: &[&str]| {
        let mut args = vec![
            "join".to_owned(),
            "intruder".to_owned(),
            format!("--lower-kubeconfig={}", path(low_b.kubeconfig())),
            format!("--upper-kubeconfig={}", path(up.kubeconfig())),
            format!("-n={ns}"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    // No release namespace upstream: said before anything is made below.
    let args = join("no-such-namespace", &[]);
    let (ok, said) = tensilectl(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(!ok);
    assert!(
        said.contains("namespace no-such-namespace does not exist: install the chart there first"),
        "{said}"
    );
    // A token shorter than the apiserver issues.
    let args = join(NS, &["--token-lifetime=5m"]);
    let (ok, said) = tensilectl(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(!ok);
    assert!(said.contains("shorter than the 10 minutes"), "{said}");
    // A lower kubeconfig that is not one.
    let bogus = up.dir().join("bogus.kubeconfig");
    std::fs::write(&bogus, "not: [a kubeconfig").unwrap();
    let (ok, said) = tensilectl(&[
        "join",
        "intruder",
        &format!("--lower-kubeconfig={}", path(&bogus)),
        &format!("--upper-kubeconfig={}", path(up.kubeconfig())),
    ])
    .await;
    assert!(!ok);
    assert!(
        said.contains(&format!("lower kubeconfig {}", path(&bogus))),
        "{said}"
    );
    // A name that is no DNS label, and a lower context the kubeconfig lacks.
    let args = join(NS, &[]);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args[1] = "Intruder_X";
    let (ok, said) = tensilectl(&args).await;
    assert!(
        !ok && said.contains("\"Intruder_X\" is not a DNS label"),
        "{said}"
    );
    let args = join(NS, &["--lower-context=nope"]);
    let (ok, said) = tensilectl(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(!ok && said.contains("has no context \"nope\""), "{said}");
    // Every binary says its version.
    for binary in [
        "tensilectl",
        "cluster-controller",
        "virtual-node",
        "webhook",
        "descheduler",
        "multi-scheduler",
    ] {
        let out = tokio::process::Command::new(tensile_e2e::bins::suite_binary(binary).unwrap())
            .arg("--version")
            .output()
            .await
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.trim() == format!("{binary} {}", env!("CARGO_PKG_VERSION")),
            "{said}"
        );
    }
    // Nothing was made below (the other test joins lower-b meanwhile: look by name).
    for object in [
        "clusterrole/tensile-intruder",
        "clusterrolebinding/tensile-intruder",
    ] {
        let out = tensile_e2e::kubectl::run(low_b.kubeconfig(), &["get", object]).await;
        assert!(
            !out.ok && out.stderr.contains("NotFound"),
            "{object}: {}",
            out.stdout
        );
    }
    let out = tensile_e2e::kubectl::run(
        low_b.kubeconfig(),
        &["-n", NS, "get", "serviceaccount/tensile-intruder"],
    )
    .await;
    assert!(!out.ok, "{}", out.stdout);
}
