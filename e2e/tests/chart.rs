//! The Helm chart against real control planes with the real helm: it installs, upgrades and
//! uninstalls cleanly; what it grants is least privilege (`kubectl auth can-i --as` the
//! ServiceAccounts it made); and the real `virtual-node` and `webhook` binaries, run here with
//! the tokens of those ServiceAccounts and the flags of the chart's Deployments, do their work
//! without one refused call.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use tensile_e2e::chart::{self, helm};
use tensile_e2e::check::{apply, eventually, kubectl};
use tensile_e2e::process::Service;
use tensile_e2e::scene::{self, UpperAndLower};
use tensile_e2e::shared::Shared;
use tensile_e2e::{NodeConfig, NodeSimulator, SimulatorOptions, TestCluster, free_port};

static BED: Shared<UpperAndLower> = Shared::new();

fn bed() -> &'static UpperAndLower {
    BED.bed(|| UpperAndLower::start("chart", "lower-a", scene::nodes("a", 2)))
}

fn chart() -> String {
    chart::chart_dir().display().to_string()
}

async fn helm_ok(cluster: &TestCluster, args: &[&str]) -> String {
    let out = helm(cluster, args).await.unwrap();
    assert!(out.ok, "helm {args:?} failed: {}", out.stderr);
    out.stdout
}

/// `kubectl auth can-i VERB RESOURCE… --as` the ServiceAccount: "yes" or "no".
async fn can_i(cluster: &TestCluster, sa: &str, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let who = format!("--as={sa}");
    all.push(&who);
    let out = cluster.kubectl(&all).await;
    match out.stdout.trim() {
        "yes" => true,
        "no" => false,
        other => panic!("kubectl {all:?}: {other:?} {}", out.stderr),
    }
}

/// `helm uninstall --wait` of `release` in `ns`, the bed running its hook pods; helm's output.
async fn uninstall_ok(cluster: &TestCluster, release: &str, ns: &str) -> String {
    let out = chart::uninstall(&chart::Access::of(cluster), release, ns)
        .await
        .unwrap();
    assert!(out.ok, "helm uninstall {release}: {}", out.stderr);
    out.stdout
}

/// The status helm gives release `release` in `ns` (`deployed`, `uninstalling`, …).
async fn release_status(cluster: &TestCluster, release: &str, ns: &str) -> String {
    let status = helm_ok(cluster, &["status", release, "-n", ns, "-o", "json"]).await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["info"]["status"].as_str().unwrap_or_default().to_owned()
}

/// Every object of release `release`, cluster-wide, as `kind/name` lines.
async fn release_objects(cluster: &TestCluster, release: &str) -> Vec<String> {
    let selector = format!("app.kubernetes.io/instance={release}");
    let mut found = Vec::new();
    for kinds in [
        "deployments,services,serviceaccounts,secrets,configmaps,roles,rolebindings,poddisruptionbudgets",
        "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,lowerclusters",
        "validatingadmissionpolicies,validatingadmissionpolicybindings",
    ] {
        let out = kubectl(
            cluster.kubeconfig(),
            &["get", kinds, "-A", "-l", &selector, "-o", "name"],
        )
        .await;
        found.extend(out.lines().map(str::to_owned));
    }
    found.sort();
    found
}

/// Every object of namespace `namespace`, and every cluster-wide object whose name holds
/// `release`, of every kind the cluster lists (events aside), as `kind namespace/name`: what
/// an uninstall must leave as it found it, labelled or not.
async fn around_the_release(
    cluster: &TestCluster,
    namespace: &str,
    release: &str,
) -> std::collections::BTreeSet<String> {
    tensile_e2e::check::listing(cluster.kubeconfig(), |_, ns, name| {
        ns == namespace || (ns == "<none>" && name.contains(release))
    })
    .await
}

#[tokio::test]
async fn the_chart_installs_upgrades_and_uninstalls_and_each_account_may_do_only_its_work() {
    let started = Instant::now();
    let up = &bed().upper;
    up.create_namespace("tensile-life").await.unwrap();
    let release = "life";
    let chart = chart();
    let sets = [
        "--set",
        "virtualNodes.nodes[0].name=vn-life",
        "--set",
        "virtualNodes.nodes[0].kubeconfig.value=placeholder",
        "--set",
        "multiScheduler.enabled=true",
        "--set",
        "descheduler.replicas=2",
        // Its registration (nobody serves it) must not catch the other test's pods.
        "--set",
        "webhook.objectSelector.matchLabels.chart-test=life",
    ];

    // Bad values are refused by the schema, with the field named.
    let mut bad = vec!["install", release, &chart, "-n", "tensile-life"];
    bad.extend_from_slice(&["--set", "webhook.failurePolicy=Sometimes"]);
    let out = helm(up, &bad).await.unwrap();
    assert!(!out.ok, "a bad failurePolicy installed");
    assert!(
        out.stderr.contains("webhook.failurePolicy"),
        "the message names the value: {}",
        out.stderr
    );

    // What the namespace holds before (its account and root CA, once made).
    scene::shows(
        up.kubeconfig(),
        "tensile-life",
        "serviceaccount/default",
        "name",
        "serviceaccount/default",
        30,
    )
    .await;
    scene::shows(
        up.kubeconfig(),
        "tensile-life",
        "configmap/kube-root-ca.crt",
        "name",
        "configmap/kube-root-ca.crt",
        30,
    )
    .await;
    let before = around_the_release(up, "tensile-life", release).await;

    let mut install = vec!["install", release, &chart, "-n", "tensile-life"];
    install.extend_from_slice(&sets);
    let notes = helm_ok(up, &install).await;
    assert!(notes.contains("kubectl get node vn-life"), "{notes}");
    let objects = release_objects(up, release).await;
    for want in [
        "clusterrole.rbac.authorization.k8s.io/life-tensile-virtual-node",
        "clusterrole.rbac.authorization.k8s.io/life-tensile-webhook",
        "clusterrole.rbac.authorization.k8s.io/life-tensile-descheduler",
        "clusterrole.rbac.authorization.k8s.io/life-tensile-multi-scheduler",
        "clusterrole.rbac.authorization.k8s.io/life-tensile-cluster-controller",
        "configmap/life-tensile-virtual-node-template",
        "deployment.apps/life-tensile-cluster-controller",
        "deployment.apps/life-tensile-webhook",
        "deployment.apps/life-tensile-descheduler",
        "deployment.apps/life-tensile-multi-scheduler",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io/life-tensile-webhook",
        "validatingadmissionpolicy.admissionregistration.k8s.io/life-tensile-nodes",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/life-tensile-node-volumes",
        "poddisruptionbudget.policy/life-tensile-webhook",
        "poddisruptionbudget.policy/life-tensile-descheduler",
        "lowercluster.tensile.io/vn-life",
        "role.rbac.authorization.k8s.io/life-tensile-cluster-controller",
        "secret/life-tensile-vn-vn-life-kubeconfig",
        "serviceaccount/life-tensile-webhook",
    ] {
        assert!(objects.iter().any(|o| o == want), "{want} in {objects:#?}");
    }

    // No wildcard and no cluster-admin anywhere in what the chart grants.
    let rbac = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "clusterroles,roles,clusterrolebindings,rolebindings",
            "-A",
            "-l",
            "app.kubernetes.io/instance=life",
            "-o",
            "json",
        ],
    )
    .await;
    let rbac: serde_json::Value = serde_json::from_str(&rbac).unwrap();
    for item in rbac["items"].as_array().unwrap() {
        assert_ne!(item["roleRef"]["name"], "cluster-admin", "{item}");
        for rule in item["rules"].as_array().into_iter().flatten() {
            for field in ["verbs", "resources", "apiGroups"] {
                let values = rule[field].as_array().unwrap();
                assert!(
                    values.iter().all(|v| v != "*"),
                    "wildcard {field} in {}",
                    item["metadata"]["name"]
                );
            }
        }
    }

    // Least privilege, as the apiserver's authorizer answers.
    let cc = "system:serviceaccount:tensile-life:life-tensile-cluster-controller";
    let wh = "system:serviceaccount:tensile-life:life-tensile-webhook";
    let ds = "system:serviceaccount:tensile-life:life-tensile-descheduler";
    let ms = "system:serviceaccount:tensile-life:life-tensile-multi-scheduler";
    let checks: &[(&str, &[&str], bool)] = &[
        // The cluster controller: the fleet, each virtual node's Deployment, account and
        // grants (only rights it holds: no escalate; the shared role bound by name), the
        // credentials of its namespace; a leaving node drained and deleted. (Each virtual
        // node's own account is made by the controller: the run test checks its rights.)
        (cc, &["patch", "lowerclusters.tensile.io/vn-life"], true),
        (
            cc,
            &[
                "patch",
                "lowerclusters.tensile.io/vn-life",
                "--subresource=status",
            ],
            true,
        ),
        (cc, &["create", "lowerclusters.tensile.io"], false),
        (cc, &["create", "deployments.apps", "-n", "tensile-life"], true),
        (cc, &["create", "deployments.apps", "-n", "default"], false),
        (cc, &["get", "secrets", "-n", "tensile-life"], true),
        (cc, &["patch", "secrets", "-n", "tensile-life"], true),
        (cc, &["get", "secrets", "-n", "default"], false),
        (cc, &["list", "secrets", "-n", "tensile-life"], false),
        (cc, &["create", "clusterroles"], true),
        (cc, &["escalate", "clusterroles"], false),
        (cc, &["bind", "clusterroles/life-tensile-virtual-node"], true),
        (cc, &["bind", "clusterroles/cluster-admin"], false),
        (cc, &["patch", "leases/vn-life", "-n", "kube-node-lease"], true),
        (
            cc,
            &["create", "pods", "--subresource=eviction", "-n", "default"],
            true,
        ),
        (cc, &["delete", "pods", "-n", "default"], false),
        (cc, &["create", "pods", "-n", "default"], false),
        (cc, &["delete", "nodes/vn-life"], true),
        // Under node identities (the default) it approves their certificate requests.
        (
            cc,
            &["update", "certificatesigningrequests", "--subresource=approval"],
            true,
        ),
        (cc, &["delete", "certificatesigningrequests"], true),
        // The webhook: its registration, its CA Secret, the exclusions; nothing else.
        (
            wh,
            &["get", "secrets/life-tensile-webhook-ca", "-n", "tensile-life"],
            true,
        ),
        (wh, &["get", "secrets/other", "-n", "tensile-life"], false),
        (wh, &["get", "secrets", "-n", "kube-system"], false),
        (wh, &["list", "secrets", "-n", "default"], false),
        (
            wh,
            &["patch", "mutatingwebhookconfigurations/life-tensile-webhook"],
            true,
        ),
        (wh, &["patch", "mutatingwebhookconfigurations/another"], false),
        (wh, &["create", "pods", "-n", "default"], false),
        // The descheduler evicts, never deletes; it moves no bare pod by default, so it
        // creates none.
        (
            ds,
            &["create", "pods", "--subresource=eviction", "-n", "default"],
            true,
        ),
        (ds, &["delete", "pods", "-n", "default"], false),
        (ds, &["create", "pods", "-n", "default"], false),
        // The exclusion records: the descheduler writes and deletes them, the others read
        // them; the old ConfigMap of records is only read, and deleted once empty.
        (
            ds,
            &["update", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            true,
        ),
        (
            ds,
            &["delete", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            true,
        ),
        (
            ds,
            &["update", "exclusionrecords.tensile.io", "-n", "default"],
            false,
        ),
        (
            ds,
            &[
                "delete",
                "configmaps/life-tensile-exclusions",
                "-n",
                "tensile-life",
            ],
            true,
        ),
        (
            ds,
            &[
                "update",
                "configmaps/life-tensile-exclusions",
                "-n",
                "tensile-life",
            ],
            false,
        ),
        (ds, &["update", "configmaps/other", "-n", "tensile-life"], false),
        (
            wh,
            &["watch", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            true,
        ),
        (
            wh,
            &["create", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            false,
        ),
        (
            ms,
            &["list", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            true,
        ),
        (
            ms,
            &["update", "exclusionrecords.tensile.io", "-n", "tensile-life"],
            false,
        ),
        (
            ds,
            &["update", "leases/tensile-descheduler", "-n", "tensile-life"],
            true,
        ),
        // Leader election with one replica too (a rolling update runs two).
        (
            ms,
            &["update", "leases/tensile-multi-scheduler", "-n", "tensile-life"],
            true,
        ),
        // The multi-scheduler binds, and reads no Secret.
        (
            ms,
            &["create", "pods", "--subresource=binding", "-n", "default"],
            true,
        ),
        (ms, &["get", "secrets", "-n", "tensile-life"], false),
        (ms, &["delete", "pods", "-n", "default"], false),
        (ms, &["create", "pods", "-n", "default"], false),
        (
            ds,
            &["create", "pods", "--subresource=binding", "-n", "default"],
            false,
        ),
    ];
    for (who, args, want) in checks {
        assert_eq!(can_i(up, who, args).await, *want, "can-i {args:?} as {who}");
    }

    // An upgrade with a changed value reaches the objects.
    let mut upgrade = vec!["upgrade", release, &chart, "-n", "tensile-life"];
    upgrade.extend_from_slice(&sets);
    upgrade.extend_from_slice(&["--set", "webhook.timeoutSeconds=9"]);
    helm_ok(up, &upgrade).await;
    let timeout = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "mutatingwebhookconfiguration",
            "life-tensile-webhook",
            "-o",
            "jsonpath={.webhooks[0].timeoutSeconds}",
        ],
    )
    .await;
    assert_eq!(timeout, "9");
    let history = helm_ok(up, &["history", release, "-n", "tensile-life", "-o", "json"]).await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&history)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );

    uninstall_ok(up, release, "tensile-life").await;
    let left = release_objects(up, release).await;
    assert!(left.is_empty(), "left behind: {left:#?}");
    // Nor anything unlabelled, in its namespace or named after it cluster-wide.
    tensile_e2e::wait::within(
        "the namespace and the cluster as before the release",
        60,
        || async {
            let now = around_the_release(up, "tensile-life", release).await;
            match now == before {
                true => Ok(()),
                false => Err(format!(
                    "left behind: {:?}; missing: {:?}",
                    now.difference(&before).collect::<Vec<_>>(),
                    before.difference(&now).collect::<Vec<_>>()
                )),
            }
        },
    )
    .await;
    let list = helm_ok(up, &["list", "-A", "-q"]).await;
    assert!(!list.lines().any(|l| l == release), "{list}");
    eprintln!("install, upgrade, can-i and uninstall: {:?}", started.elapsed());
}

/// The role a lower cluster grants, rendered as the docs show it, is the file under deploy/.
#[tokio::test]
async fn the_lower_role_file_is_what_the_chart_renders() {
    let up = &bed().upper;
    // Every namespace, and the namespace scope (which tensilectl join --namespaces grants
    // from).
    for (sets, file, scoped) in [
        (vec![], "lower-cluster-rbac.yaml", false),
        (
            vec!["--set", "lower.namespaces={team-a}"],
            "lower-namespace-rbac.yaml",
            true,
        ),
        // What join takes the rights of the features from.
        (
            vec![
                "--set",
                "virtualNodes.reflectServices=true",
                "--set",
                "virtualNodes.gcNamespaces=true",
            ],
            "lower-cluster-features-rbac.yaml",
            false,
        ),
    ] {
        let chart = chart();
        let mut args = vec![
            "template",
            "tensile",
            &chart,
            "-n",
            "tensile",
            "--set",
            "target=lower",
        ];
        args.extend(sets);
        let rendered = helm_ok(up, &args).await;
        let file = chart::chart_dir().join("../..").join(file);
        let kept = std::fs::read_to_string(&file).unwrap();
        assert_eq!(
            kept.trim(),
            rendered.trim(),
            "{} is stale: regenerate it with helm template (docs/deploy.md)",
            file.display()
        );
        assert_eq!(
            !kept.contains("kind: ClusterRole"),
            scoped,
            "nothing cluster-wide in a namespace scope"
        );
    }
    // The upper install names the same namespaces on the node's LowerCluster.
    let objects = rendered(
        up,
        "scoped",
        &["--set", "virtualNodes.nodes[0].namespaces={team-a,team-b}"],
    )
    .await;
    assert_eq!(
        object(&objects, "LowerCluster", "a")["spec"]["namespaces"],
        serde_json::json!(["team-a", "team-b"])
    );
    // The namespace scope and namespace collection exclude each other, with the reason.
    let refused = chart::helm(
        up,
        &[
            "template",
            "tensile",
            &chart(),
            "--set",
            "target=lower",
            "--set",
            "lower.namespaces={team-a}",
            "--set",
            "virtualNodes.gcNamespaces=true",
        ],
    )
    .await
    .unwrap();
    assert!(
        !refused.ok
            && refused
                .stderr
                .contains("lower.namespaces and virtualNodes.gcNamespaces exclude each other"),
        "{}",
        refused.stderr
    );
}

/// The stash keys reach both components: the webhook mounts and signs with `signWith` only,
/// every virtual node mounts and accepts each key (two during a rotation), all from the chart's
/// Secret; bad key values are refused with the value named.
#[tokio::test]
async fn the_stash_keys_reach_the_webhook_and_every_virtual_node() {
    let up = &bed().upper;
    let (old, new) = ("o".repeat(40), "n".repeat(40));
    let (old_set, new_set) = (
        format!("stashKeys.keys.old={old}"),
        format!("stashKeys.keys.new={new}"),
    );
    let chart = chart();
    let mut rendered = vec!["template", "keys", chart.as_str()];
    let base = [
        "-n",
        "tensile",
        "--set",
        "virtualNodes.nodes[0].name=a",
        "--set",
        "virtualNodes.nodes[0].kubeconfig.value=x",
        "--set",
        "virtualNodes.nodes[1].name=b",
        "--set",
        "virtualNodes.nodes[1].kubeconfig.value=y",
        "--set",
        &old_set,
        "--set",
        &new_set,
    ];
    rendered.extend_from_slice(&base);
    rendered.extend_from_slice(&["--set", "stashKeys.signWith=new"]);
    let text = helm_ok(up, &rendered).await;
    let objects: Vec<serde_json::Value> = text
        .split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<serde_json::Value>(doc).ok())
        .filter(|v| v.is_object())
        .collect();
    let find = |kind: &str, name: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{kind} {name} rendered"))
            .clone()
    };
    let secret = find("Secret", "keys-tensile-stash-keys");
    let decode = |v: &serde_json::Value| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap())
                .unwrap(),
        )
        .unwrap()
    };
    assert_eq!(decode(&secret["data"]["old"]), old);
    assert_eq!(decode(&secret["data"]["new"]), new);
    let stash_args = |deployment: &serde_json::Value| -> Vec<String> {
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a.as_str())
            .filter(|a| a.starts_with("--stash-key-file="))
            .map(str::to_owned)
            .collect()
    };
    let mounted = |deployment: &serde_json::Value| -> Vec<String> {
        let volumes = deployment["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap();
        let volume = volumes.iter().find(|v| v["name"] == "stash-keys").unwrap();
        assert_eq!(volume["secret"]["secretName"], "keys-tensile-stash-keys");
        let mounts = deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["name"] == "stash-keys" && m["mountPath"] == "/etc/tensile/stash-keys")
        );
        volume["secret"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["key"].as_str().unwrap().to_owned())
            .collect()
    };
    let webhook = find("Deployment", "keys-tensile-webhook");
    assert_eq!(
        stash_args(&webhook),
        ["--stash-key-file=/etc/tensile/stash-keys/new"]
    );
    assert_eq!(
        mounted(&webhook),
        ["new"],
        "the webhook holds only the key it signs with"
    );
    // Every virtual node is made from one template.
    let vn = virtual_node_template(&objects, "keys");
    assert_eq!(
        stash_args(&vn),
        [
            "--stash-key-file=/etc/tensile/stash-keys/new",
            "--stash-key-file=/etc/tensile/stash-keys/old"
        ]
    );
    assert_eq!(mounted(&vn), ["new", "old"]);

    // Refused: a short key (by the schema), a signing key the nodes do not accept, keys
    // accepted with nothing signing.
    for (set, says) in [
        ("stashKeys.keys.new=short", "stashKeys.keys.new"),
        ("stashKeys.signWith=other", "stashKeys.signWith \"other\""),
        ("stashKeys.signWith=", "signWith is empty"),
    ] {
        let mut bad = rendered.clone();
        bad.extend_from_slice(&["--set", set]);
        let out = helm(up, &bad).await.unwrap();
        assert!(!out.ok, "{set} rendered");
        assert!(out.stderr.contains(says), "{set}: {}", out.stderr);
    }
}

/// The Deployment every virtual node of release `release` is made from, as rendered in
/// `objects` (the cluster controller's template).
fn virtual_node_template(objects: &[serde_json::Value], release: &str) -> serde_json::Value {
    let name = format!("{release}-tensile-virtual-node-template");
    let config = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name.as_str())
        .unwrap_or_else(|| panic!("ConfigMap {name} rendered"));
    serde_yaml::from_str(config["data"]["deployment.yaml"].as_str().unwrap()).unwrap()
}

/// A kubeconfig of ServiceAccount `ns/name` in `dir/<file>`.
async fn token_kubeconfig(cluster: &TestCluster, ns: &str, name: &str, file: &str) -> PathBuf {
    chart::service_account_kubeconfig(cluster, ns, name, &cluster.dir().join(file))
        .await
        .unwrap()
}

/// HTTPS GET of `/healthz` on 127.0.0.1:`port` verified with `ca` only; the body.
async fn healthz_with_ca(port: u16, ca: &Path) -> Result<String, String> {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(ca)
        .arg(format!("https://127.0.0.1:{port}/healthz"))
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

async fn bundle(up: &TestCluster, name: &str) -> String {
    let b64 = kubectl(
        up.kubeconfig(),
        &[
            "get",
            "mutatingwebhookconfiguration",
            name,
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ],
    )
    .await;
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .unwrap(),
    )
    .unwrap()
}

fn assert_no_denied(name: &str, service: &Service) {
    let log = service.log_tail(4_000_000);
    let denied = chart::denied_calls(&log);
    assert!(
        denied.is_empty(),
        "{name} was refused calls:\n{}",
        denied.join("\n")
    );
}

#[tokio::test]
async fn the_daemons_run_under_the_charts_accounts_without_one_refused_call() {
    let started = Instant::now();
    let bed = bed();
    let (up, low) = (&bed.upper, &bed.lower);
    let ns = "tensile-run";
    let release = "run";
    let node = "vn-chart";
    let full = "run-tensile";

    // The lower cluster's side, installed there with the same chart.
    low.create_namespace(ns).await.unwrap();
    helm_ok(
        low,
        &["install", "lower", &chart(), "-n", ns, "--set", "target=lower"],
    )
    .await;
    let lower_kubeconfig = token_kubeconfig(low, ns, "lower-tensile-lower", "lower-token.kubeconfig").await;
    let lower_text = std::fs::read_to_string(&lower_kubeconfig).unwrap();

    // The upper install: the virtual node's lower kubeconfig as a value, the webhook reached
    // at this machine's address (it runs here, not in a pod).
    up.create_namespace(ns).await.unwrap();
    let webhook_ports = [free_port().unwrap(), free_port().unwrap()];
    let values = up.dir().join("run-values.yaml");
    let indented: String = lower_text.lines().map(|l| format!("        {l}\n")).collect();
    std::fs::write(
        &values,
        format!(
            "virtualNodes:\n  nodes:\n  - name: {node}\n    labels: {{region: a}}\n    extraArgs: [\"--shared-namespaces=default,chart-app\"]\n    kubeconfig:\n      value: |\n{indented}\
             webhook:\n  url: https://127.0.0.1:{}/mutate\n\
             stashKeys:\n  signWith: chart-key\n  keys: {{chart-key: {}}}\n",
            webhook_ports[0],
            "c".repeat(48)
        ),
    )
    .unwrap();
    helm_ok(
        up,
        &[
            "install",
            release,
            &chart(),
            "-n",
            ns,
            "-f",
            &values.display().to_string(),
        ],
    )
    .await;
    let upper_wh = token_kubeconfig(up, ns, &format!("{full}-webhook"), "wh-token.kubeconfig").await;

    // The stash key as a pod of the chart finds it: its Secret's entry, a file named by its id.
    let key_dir = up.dir().join("stash-keys");
    std::fs::create_dir_all(&key_dir).unwrap();
    let key = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "secret",
            &format!("{full}-stash-keys"),
            "-o",
            "jsonpath={.data.chart-key}",
        ],
    )
    .await;
    let key_file = key_dir.join("chart-key");
    std::fs::write(
        &key_file,
        base64::engine::general_purpose::STANDARD
            .decode(key.trim())
            .unwrap(),
    )
    .unwrap();
    let local_key = |args: &[String]| -> String {
        let charted: Vec<&String> = args
            .iter()
            .filter(|a| a.starts_with("--stash-key-file="))
            .collect();
        assert_eq!(
            charted,
            ["--stash-key-file=/etc/tensile/stash-keys/chart-key"],
            "the chart gives the key"
        );
        format!("--stash-key-file={}", key_file.display())
    };

    // The cluster controller with the flags and account of the chart's Deployment, and the
    // virtual node it makes from the chart's LowerCluster, run as a kubelet would run its pod
    // (only what a pod gives differs: addresses, files).
    let mut controller = chart::run_cluster_controller(up, ns, full, &[]).await.unwrap();
    let runner = tensile_e2e::runner::VirtualNodeRunner::start(up, ns).unwrap();
    // The chart's default: the virtual node acts as its node (a client certificate its
    // account asks for, which the controller approves), and its account may do nothing else.
    let node_account = format!("system:serviceaccount:{ns}:{full}-vn-{node}");
    tensile_e2e::wait::must(
        "the virtual node's account, made by the controller",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            if can_i(up, &node_account, &["create", "certificatesigningrequests"]).await {
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await;
    let checks: &[(&[&str], bool)] = &[
        (
            &["get", &format!("certificatesigningrequests/tensile-node-{node}")],
            true,
        ),
        (
            &[
                "delete",
                &format!("certificatesigningrequests/tensile-node-{node}"),
            ],
            true,
        ),
        (&["get", "certificatesigningrequests/tensile-node-another"], false),
        (
            &["delete", "certificatesigningrequests/tensile-node-another"],
            false,
        ),
        (&["list", "certificatesigningrequests"], false),
        (
            &["update", "certificatesigningrequests", "--subresource=approval"],
            false,
        ),
        (&["patch", &format!("nodes/{node}")], false),
        (&["get", "secrets", "-n", ns], false),
        (&["get", "configmaps", "-n", "default"], false),
        (&["list", "pods"], false),
        (&["create", "clusterroles"], false),
        // The election among its replicas is the account's.
        (
            &["update", &format!("leases/tensile-virtual-node-{node}"), "-n", ns],
            true,
        ),
        (&["update", "leases/tensile-virtual-node-other", "-n", ns], false),
    ];
    for (args, want) in checks {
        assert_eq!(
            can_i(up, &node_account, args).await,
            *want,
            "can-i {args:?} as {node_account}"
        );
    }

    // Two webhook replicas, as the chart starts them.
    let wh_args = chart::deployment_args(up, ns, &format!("{full}-webhook"))
        .await
        .unwrap();
    let wh_bin = tensile_e2e::bins::suite_binary("webhook").unwrap();
    let webhook_args = |port: u16| {
        chart::with_flags(
            &wh_args,
            &[
                format!("--kubeconfig={}", upper_wh.display()),
                "--address=127.0.0.1".into(),
                format!("--port={port}"),
                "--self-signed-names=127.0.0.1,localhost".into(),
                format!("--admin-addr=127.0.0.1:{}", free_port().unwrap()),
                local_key(&wh_args),
            ],
        )
    };
    let mut webhooks: Vec<Service> = webhook_ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let log = up.dir().join(format!("webhook-chart-{i}.log"));
            let _ = std::fs::remove_file(&log);
            Service::start(&format!("webhook {i}"), &wh_bin, &webhook_args(*port), &log).unwrap()
        })
        .collect();

    // One CA for both: the bundle written into the chart's registration is the Secret's, and
    // verifies each replica's own serving certificate.
    let registration = format!("{full}-webhook");
    tensile_e2e::wait::within("the caBundle of the chart's registration", 40, || async {
        let out = up
            .kubectl(&[
                "get",
                "mutatingwebhookconfiguration",
                &registration,
                "-o",
                "jsonpath={.webhooks[0].clientConfig.caBundle}",
            ])
            .await;
        if out.ok && !out.stdout.trim().is_empty() {
            Ok(())
        } else {
            Err(out.stderr)
        }
    })
    .await;
    let ca_pem = bundle(up, &registration).await;
    let in_secret = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "secret",
            &format!("{full}-webhook-ca"),
            "-o",
            r"jsonpath={.data.ca\.crt}",
        ],
    )
    .await;
    let in_secret = String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(in_secret.trim())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(ca_pem, in_secret, "the bundle is the shared CA");
    let ca_file = up.dir().join("webhook-bundle.crt");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    for port in webhook_ports {
        let body =
            tensile_e2e::wait::within(&format!("webhook on {port} verified with the bundle"), 20, || {
                healthz_with_ca(port, &ca_file)
            })
            .await;
        assert_eq!(body, "ok");
    }
    // A restarted replica serves a new certificate of the same CA; the bundle stays.
    webhooks[1].restart().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let body = tensile_e2e::wait::within(
        "the restarted webhook verified with the unchanged bundle",
        20,
        || healthz_with_ca(webhook_ports[1], &ca_file),
    )
    .await;
    assert_eq!(body, "ok");
    assert_eq!(
        bundle(up, &registration).await,
        ca_pem,
        "the restart left the bundle as it was"
    );

    // The virtual node registers Ready with the chart's labels.
    scene::node_shows(
        up.kubeconfig(),
        node,
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status} {.metadata.labels.region}"#,
        "True a",
        60,
    )
    .await;

    // An opted-in workload with a ConfigMap, a Secret and a claim: through the webhook, run
    // below with its copies and its claim, status and logs upstream.
    // As in the claim scenario of the copies tests, a lower admin makes the namespace first
    // (the claim is made below before any pod), and the node is told it may share it.
    let app = "chart-app";
    up.create_namespace(app).await.unwrap();
    low.create_namespace(app).await.unwrap();
    apply(
        low.kubeconfig(),
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {name: chart-disk},
   provisioner: kubernetes.io/no-provisioner, volumeBindingMode: Immediate}
- apiVersion: v1
  kind: PersistentVolume
  metadata: {name: chart-lower-disk}
  spec:
    capacity: {storage: 1Gi}
    accessModes: [ReadWriteOnce]
    storageClassName: chart-disk
    hostPath: {path: /tmp/chart-lower-disk}
"#,
    )
    .await;
    apply(
        up.kubeconfig(),
        &format!(
            r#"
apiVersion: v1
kind: List
items:
- {{apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {{name: chart-disk}},
   provisioner: virtual-node.tensile.io, volumeBindingMode: WaitForFirstConsumer}}
- apiVersion: v1
  kind: PersistentVolumeClaim
  metadata: {{name: data, namespace: {app}}}
  spec:
    accessModes: [ReadWriteOnce]
    storageClassName: chart-disk
    resources: {{requests: {{storage: 500Mi}}}}
- apiVersion: v1
  kind: ConfigMap
  metadata: {{name: settings, namespace: {app}}}
  data: {{mode: chart}}
- apiVersion: v1
  kind: Secret
  metadata: {{name: password, namespace: {app}}}
  stringData: {{password: s3cret}}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {{name: web, namespace: {app}}}
  spec:
    replicas: 1
    selector: {{matchLabels: {{app: web}}}}
    template:
      metadata:
        labels: {{app: web, virtual-pod: "true"}}
      spec:
        terminationGracePeriodSeconds: 1
        volumes:
        - {{name: data, persistentVolumeClaim: {{claimName: data}}}}
        - {{name: settings, configMap: {{name: settings}}}}
        containers:
        - name: app
          image: web
          env: [{{name: PASSWORD, valueFrom: {{secretKeyRef: {{name: password, key: password}}}}}}]
          volumeMounts: [{{name: data, mountPath: /data}}, {{name: settings, mountPath: /etc/app}}]
"#
        ),
    )
    .await;
    let phases = [
        "-n",
        app,
        "get",
        "pods",
        "-l",
        "app=web",
        "-o",
        "jsonpath={.items[*].status.phase}",
    ];
    eventually(
        up.kubeconfig(),
        "the pod Running upstream",
        90,
        &phases,
        "Running",
    )
    .await;
    eventually(low.kubeconfig(), "the pod Running below", 10, &phases, "Running").await;
    let pod = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            app,
            "get",
            "pods",
            "-l",
            "app=web",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ],
    )
    .await;
    let upper_pod = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            app,
            "get",
            "pod",
            &pod,
            "-o",
            r"jsonpath={.spec.nodeName} {.metadata.annotations.tensile\.io/stash-signature} {.metadata.annotations.clusterSelector}",
        ],
    )
    .await;
    assert!(
        upper_pod.starts_with(&format!("{node} v2:chart-key:")),
        "on the virtual node, its stash signed with the chart's key (the node verified it): {upper_pod}"
    );
    assert!(
        upper_pod.len() > node.len() + 1,
        "the webhook stashed the pod's constraints: {upper_pod}"
    );
    let copies = kubectl(
        low.kubeconfig(),
        &[
            "-n",
            app,
            "get",
            "configmap/settings",
            "secret/password",
            "pvc/data",
            "-o",
            "jsonpath={range .items[*]}{.kind} {end}",
        ],
    )
    .await;
    assert_eq!(copies.trim(), "ConfigMap Secret PersistentVolumeClaim");
    node_identity_is_confined_like_a_kubelet(up, ns, app, node).await;
    scene::shows(
        up.kubeconfig(),
        app,
        "pvc/data",
        "jsonpath={.status.phase}",
        "Bound",
        30,
    )
    .await;
    let logs = tensile_e2e::wait::must(
        "kubectl logs through the virtual node",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || async {
            let out = up.kubectl(&["-n", app, "logs", &pod, "--tail=5"]).await;
            if out.ok && !out.stdout.trim().is_empty() {
                Ok(out.stdout)
            } else {
                Err(out.stderr)
            }
        },
    )
    .await;
    assert!(!logs.is_empty());

    // The node's certificate is renewed before it expires (the test bed's are valid for 3
    // minutes from their issue), and the node goes on under the new one: what follows runs
    // after a renewal.
    tensile_e2e::wait::must(
        "the node's client certificate renewed",
        Duration::from_secs(180),
        Duration::from_secs(1),
        || async {
            let logs = runner.seen().logs;
            let renewed = logs.iter().any(|(_, log)| {
                tensile_e2e::process::log_tail(log, 4_000_000).contains("node client certificate renewed")
            });
            if renewed {
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &[
            "-n",
            app,
            "patch",
            "configmap",
            "settings",
            "-p",
            r#"{"data":{"mode":"renewed"}}"#,
        ],
    )
    .await;
    scene::shows(
        low.kubeconfig(),
        app,
        "configmap/settings",
        "jsonpath={.data.mode}",
        "renewed",
        10,
    )
    .await;

    // Going away: the lower pod, the copies' last user, and the claim follow.
    kubectl(
        up.kubeconfig(),
        &["-n", app, "delete", "deployment", "web", "--wait=true"],
    )
    .await;
    eventually(low.kubeconfig(), "no pod below", 30, &phases, "").await;
    kubectl(
        up.kubeconfig(),
        &["-n", app, "delete", "pvc", "data", "--wait=true"],
    )
    .await;
    eventually(
        low.kubeconfig(),
        "the lower claim gone",
        30,
        &[
            "-n",
            app,
            "get",
            "pvc",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
        "",
    )
    .await;
    // Its reflected volume goes too, deleted by the node under the chart's volume policy.
    eventually(
        up.kubeconfig(),
        "the reflected volume gone upstream",
        30,
        &[
            "get",
            "pv",
            "-l",
            &format!("tensile.io/virtual-node={node}"),
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
        "",
    )
    .await;

    // Not one call was refused, in any daemon.
    let logs = runner.seen().logs;
    assert_eq!(logs.len(), 1, "{logs:?}");
    for (name, log) in logs {
        let text = tensile_e2e::process::log_tail(&log, 4_000_000);
        let denied = chart::denied_calls(&text);
        assert!(
            denied.is_empty(),
            "{name} was refused calls:\n{}",
            denied.join("\n")
        );
        assert!(text.contains(node), "the log is the virtual node's");
    }
    assert_no_denied("cluster-controller", &controller);
    for (i, w) in webhooks.iter().enumerate() {
        assert_no_denied(&format!("webhook {i}"), w);
    }
    for w in webhooks.iter_mut() {
        assert!(w.exited().is_none(), "a webhook exited: {}", w.log_tail(3000));
    }
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));

    // While its LowerCluster holds a virtual node, the release does not go: the chart's
    // pre-delete hook fails helm uninstall before anything is deleted, and its log names the
    // cluster and how to remove it.
    let refused = chart::uninstall(&chart::Access::of(up), release, ns)
        .await
        .unwrap();
    let check = format!("{full}-cluster-controller-uninstall-check");
    assert!(
        !refused.ok
            && refused
                .stderr
                .contains(&format!("job {check} failed: BackoffLimitExceeded")),
        "helm uninstall with a LowerCluster left: {} {}",
        refused.stdout,
        refused.stderr
    );
    let failed = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "job",
            &check,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Failed\")].reason}",
        ],
    )
    .await;
    assert_eq!(failed, "BackoffLimitExceeded");
    let said = kubectl(
        up.kubeconfig(),
        &[
            "-n",
            ns,
            "get",
            "pods",
            "-l",
            &format!("batch.kubernetes.io/job-name={check}"),
            "-o",
            "jsonpath={.items[0].status.containerStatuses[0].state.terminated.message}",
        ],
    )
    .await;
    assert!(
        said.contains(&format!(
            "{node}: kubectl delete lowercluster {node} --wait (the chart's virtualNodes.nodes makes it"
        )),
        "the hook's message: {said}"
    );
    // helm lists the release as uninstalling, everything in place; a rollback makes it
    // deployed again.
    assert_eq!(release_status(up, release, ns).await, "uninstalling");
    helm_ok(up, &["rollback", release, "1", "-n", ns]).await;
    assert_eq!(release_status(up, release, ns).await, "deployed");
    let kept = kubectl(
        up.kubeconfig(),
        &[
            "get",
            &format!("lowercluster/{node}"),
            &format!("deployment/{full}-cluster-controller"),
            &format!("deployment/{full}-vn-{node}"),
            "-n",
            ns,
            "-o",
            "jsonpath={range .items[*]}{.kind}:{.metadata.deletionTimestamp};{end}",
        ],
    )
    .await;
    assert_eq!(
        kept, "LowerCluster:;Deployment:;Deployment:;",
        "what the refused uninstall kept"
    );
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));

    // Before the release goes, its lower clusters (docs/deploy.md): the controller removes
    // their virtual nodes and what they made.
    kubectl(
        up.kubeconfig(),
        &["delete", "lowerclusters", node, "--wait=true", "--timeout=120s"],
    )
    .await;
    runner.shutdown().await;
    drop(controller);
    drop(webhooks);
    uninstall_ok(up, release, ns).await;
    uninstall_ok(low, "lower", ns).await;
    eprintln!("daemons under the chart's accounts: {:?}", started.elapsed());
}

/// What `kubectl` answers when `node` itself (its user and group, as its certificate names
/// them) runs `args`.
async fn as_node(cluster: &TestCluster, node: &str, args: &[&str]) -> tensile_e2e::kubectl::Output {
    let user = format!("--as=system:node:{node}");
    let mut all: Vec<&str> = vec![&user, "--as-group=system:nodes"];
    all.extend_from_slice(args);
    cluster.kubectl(&all).await
}

/// The chart's virtual node acts as `system:node:<node>`, and the upper apiserver's Node
/// authorizer and NodeRestriction confine it like a kubelet: the Secret and ConfigMap its
/// running pod in `app` references, and nothing else of theirs; its own Node and Lease, and
/// neither of another node's.
async fn node_identity_is_confined_like_a_kubelet(up: &TestCluster, ns: &str, app: &str, node: &str) {
    kubectl(
        up.kubeconfig(),
        &[
            "-n",
            app,
            "create",
            "secret",
            "generic",
            "unreferenced",
            "--from-literal=k=v",
        ],
    )
    .await;
    let other = "chart-other-node";
    apply(
        up.kubeconfig(),
        &format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {other}\n  labels: {{team: a}}\n"),
    )
    .await;
    let reads: &[(&[&str], bool)] = &[
        (&["-n", app, "get", "secret", "password"], true),
        (&["-n", app, "get", "configmap", "settings"], true),
        (&["-n", app, "get", "secret", "unreferenced"], false),
        (&["-n", app, "get", "secrets"], false),
        (&["get", "secrets", "-A"], false),
        (&["-n", ns, "get", "secrets"], false),
        (&["-n", app, "get", "configmaps"], false),
        (&["get", "node", node], true),
        (&["-n", "kube-node-lease", "get", "lease", node], true),
        (&["-n", "kube-node-lease", "get", "lease", other], false),
        (
            &["-n", ns, "get", "lease", &format!("tensile-virtual-node-{node}")],
            false,
        ),
        (&["-n", ns, "get", "lease", "tensile-virtual-node-other"], false),
        (
            &[
                "-n",
                app,
                "create",
                "secret",
                "generic",
                "planted",
                "--from-literal=k=v",
            ],
            false,
        ),
        (&["-n", app, "delete", "configmap", "settings"], false),
        (&["label", "node", other, "team=b", "--overwrite"], false),
        (&["delete", "node", other], false),
        (&["-n", "kube-node-lease", "delete", "lease", other], false),
        (
            &[
                "create",
                "clusterrole",
                "planted",
                "--verb=get",
                "--resource=secrets",
            ],
            false,
        ),
    ];
    for (args, allowed) in reads {
        let out = as_node(up, node, args).await;
        assert_eq!(
            out.ok, *allowed,
            "as system:node:{node}: kubectl {args:?}: {} {}",
            out.stdout, out.stderr
        );
        if !allowed {
            assert!(
                out.stderr.contains("forbidden") || out.stderr.contains("Forbidden"),
                "refused by the authorizer or NodeRestriction, not for another reason: kubectl {args:?}: {}",
                out.stderr
            );
        }
    }
    kubectl(up.kubeconfig(), &["delete", "node", other]).await;
    kubectl(up.kubeconfig(), &["-n", app, "delete", "secret", "unreferenced"]).await;
}

/// A reflected volume as virtual node `node` makes it (volumes.rs): marked with the upper
/// cluster and the node, CSI driver `virtual-node.tensile.io`, pinned to the node, pre-bound.
fn reflected_volume(name: &str, node: &str, reclaim: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata:
  name: {name}
  labels: {{tensile.io/upper-cluster: marks-cluster, tensile.io/virtual-node: {node}}}
  annotations: {{pv.kubernetes.io/provisioned-by: virtual-node.tensile.io}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: marks-reflected
  persistentVolumeReclaimPolicy: {reclaim}
  claimRef: {{apiVersion: v1, kind: PersistentVolumeClaim, namespace: marks-app, name: {name}}}
  csi: {{driver: virtual-node.tensile.io, volumeHandle: {node}/marks-app/{name}/u}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [{node}]}}]
"#
    )
}

/// Runs each of `calls` as `who`: what differs from its answer (allowed, or refused saying
/// the message given), one line each.
async fn each_as(
    who: &str,
    run: impl AsyncFn(&[&str]) -> tensile_e2e::kubectl::Output,
    calls: &[(&[&str], Result<(), &str>)],
) -> Vec<String> {
    let mut wrong = Vec::new();
    for (args, want) in calls {
        let out = run(args).await;
        let right = match want {
            Ok(()) => out.ok,
            Err(message) => !out.ok && out.stderr.contains(message),
        };
        if !right {
            wrong.push(format!(
                "as {who}: kubectl {args:?} wanted {want:?}, got: {} {}",
                out.stdout.trim(),
                out.stderr.trim()
            ));
        }
    }
    wrong
}

/// A client of `cluster` acting as `user` in `groups` (impersonated, as `kubectl --as`).
async fn client_as(cluster: &TestCluster, user: &str, groups: &[&str]) -> kube::Client {
    let mut config = tensile_common::kubeconfig::config_from_file(cluster.kubeconfig(), &Default::default())
        .await
        .unwrap();
    config.auth_info.impersonate = Some(user.to_owned());
    config.auth_info.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
    kube::Client::try_from(config).unwrap()
}

/// The merge patch `body` of `pv NAME` or `pvc NS/NAME`, dry run, sent as virtual-node sends
/// it (kubectl reads an object before it patches it, which a node may not); kubectl's answer.
async fn merge_patch(
    client: &kube::Client,
    kind: &str,
    name: &str,
    body: &str,
) -> tensile_e2e::kubectl::Output {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use kube::api::{Api, Patch, PatchParams};
    let patch: serde_json::Value = serde_json::from_str(body).unwrap();
    let params = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let done = match (kind, name.split_once('/')) {
        ("pvc", Some((ns, name))) => Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
            .patch(name, &params, &Patch::Merge(&patch))
            .await
            .map(|_| ()),
        ("pv", None) => Api::<PersistentVolume>::all(client.clone())
            .patch(name, &params, &Patch::Merge(&patch))
            .await
            .map(|_| ()),
        other => panic!("no such patch: {other:?}"),
    };
    tensile_e2e::kubectl::Output {
        ok: done.is_ok(),
        stdout: format!("{kind} {name} patched (dry run)"),
        stderr: done.err().map(|e| e.to_string()).unwrap_or_default(),
    }
}

/// The release's accounts and its virtual nodes' identities hold some rights cluster-wide
/// (RBAC cannot name Nodes and volumes made later): the chart's admission policies confine
/// each write to what the suite made. The cluster controller deletes and cordons virtual
/// Nodes only, and deletes only volumes a virtual node reflected (never a retained one); a
/// node identity makes, resizes and deletes only its own reflected volumes (CSI
/// `virtual-node.tensile.io`, pinned to it, never hostPath) and never re-points one; an
/// account of the release marks a claim with a node only where none was named, changing
/// nothing else. Then the controller, removing its LowerCluster, cordons and deletes its
/// virtual Node and its volume through those policies without one refused call.
#[tokio::test]
async fn the_releases_identities_change_only_the_nodes_and_volumes_the_suite_made() {
    let up = &bed().upper;
    let (ns, release, full, node) = ("tensile-marks", "marks", "marks-tensile", "vn-marks");
    up.create_namespace(ns).await.unwrap();
    up.create_namespace("marks-app").await.unwrap();
    helm_ok(
        up,
        &[
            "install",
            release,
            &chart(),
            "-n",
            ns,
            "--set",
            &format!("virtualNodes.nodes[0].name={node}"),
            "--set",
            "virtualNodes.nodes[0].kubeconfig.value=placeholder",
            // The upper cluster id the volumes below are marked with.
            "--set",
            "virtualNodes.clusterId=marks-cluster",
            // Its registration (nobody serves it) must not catch the other tests' pods.
            "--set",
            "webhook.objectSelector.matchLabels.chart-test=marks",
        ],
    )
    .await;
    // The virtual node's registration, as it makes it (it is not run here), a real node's,
    // and volumes: one reflected for this node, one retained, one of another virtual node,
    // one an administrator made on a host path; claims, one selected for another node.
    let dir = up.dir().join("marks");
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: String| -> String {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let host_path_pv = |name: &str, labels: &str| {
        format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: {name}\n  labels: {{{labels}}}\n\
             spec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  storageClassName: marks-reflected\n  \
             hostPath: {{path: /}}\n  claimRef: {{namespace: marks-app, name: colluding}}\n"
        )
    };
    apply(
        up.kubeconfig(),
        &format!(
            "apiVersion: v1\nkind: List\nitems:\n\
             - {{apiVersion: v1, kind: Node, metadata: {{name: {node}, labels: {{type: virtual-kubelet}}}}}}\n\
             - {{apiVersion: v1, kind: Node, metadata: {{name: marks-real-node}}}}\n\
             - {{apiVersion: v1, kind: PersistentVolumeClaim, metadata: {{name: data, namespace: marks-app}},\n   \
                spec: {{accessModes: [ReadWriteOnce], storageClassName: marks-unbound, resources: {{requests: {{storage: 1Gi}}}}}}}}\n\
             - {{apiVersion: v1, kind: PersistentVolumeClaim, metadata: {{name: chosen, namespace: marks-app,\n   \
                annotations: {{volume.kubernetes.io/selected-node: vn-other}}}},\n   \
                spec: {{accessModes: [ReadWriteOnce], storageClassName: marks-unbound, resources: {{requests: {{storage: 1Gi}}}}}}}}\n"
        ),
    )
    .await;
    for text in [
        reflected_volume("pvc-marks-own", node, "Delete"),
        reflected_volume("pvc-marks-kept", node, "Retain"),
        reflected_volume("pvc-marks-other", "vn-other", "Delete"),
        host_path_pv("marks-foreign", ""),
    ] {
        apply(up.kubeconfig(), &text).await;
    }

    // The apiserver checked every expression of the chart's policies against the types of
    // what they match, and warns of none.
    for policy in ["nodes", "grants", "volumes", "claims", "node-volumes"] {
        let checked = tensile_e2e::wait::within(
            &format!("the policy {full}-{policy} type-checked"),
            30,
            || async {
                let out = up
                    .kubectl(&[
                        "get",
                        "validatingadmissionpolicy",
                        &format!("{full}-{policy}"),
                        "-o",
                        "jsonpath={.status.observedGeneration} {.status.typeChecking}",
                    ])
                    .await;
                match out.stdout.split_once(' ') {
                    Some(("1", checked)) if out.ok => Ok(checked.to_owned()),
                    _ => Err(format!("{} {}", out.stdout, out.stderr)),
                }
            },
        )
        .await;
        assert!(!checked.contains("expressionWarnings"), "{policy}: {checked}");
    }

    // The controller, run with the chart's flags and account, grants the node's user the
    // shared role.
    let mut controller = chart::run_cluster_controller(up, ns, full, &[]).await.unwrap();
    let node_user = format!("system:node:{node}");
    tensile_e2e::wait::must(
        "the node's user bound to the shared role by the controller",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            let who = format!("--as={node_user}");
            let out = up
                .kubectl(&["auth", "can-i", "create", "persistentvolumes", &who])
                .await;
            if out.stdout.starts_with("yes") {
                Ok(())
            } else {
                Err(out.stdout)
            }
        },
    )
    .await;

    let cc = token_kubeconfig(
        up,
        ns,
        &format!("{full}-cluster-controller"),
        "marks-cc.kubeconfig",
    )
    .await;
    let cordon = r#"{"spec":{"unschedulable":true}}"#;
    let not_virtual = "only virtual nodes";
    let not_reflected = "not reflected by a virtual node";
    let retained = "persistentVolumeReclaimPolicy: Retain";
    let mut wrong = each_as(
        "the cluster controller",
        async |args: &[&str]| tensile_e2e::kubectl::run(&cc, args).await,
        &[
            (
                &["delete", "node", "marks-real-node", "--dry-run=server"],
                Err(not_virtual),
            ),
            (&["delete", "node", node, "--dry-run=server"], Ok(())),
            (
                &[
                    "patch",
                    "node",
                    "marks-real-node",
                    "-p",
                    cordon,
                    "--dry-run=server",
                ],
                Err(not_virtual),
            ),
            (&["patch", "node", node, "-p", cordon, "--dry-run=server"], Ok(())),
            (
                &["delete", "pv", "marks-foreign", "--dry-run=server"],
                Err(not_reflected),
            ),
            (
                &["delete", "pv", "pvc-marks-kept", "--dry-run=server"],
                Err(retained),
            ),
            (&["delete", "pv", "pvc-marks-own", "--dry-run=server"], Ok(())),
            (
                &["delete", "clusterrole", "system:node", "--dry-run=server"],
                Err("made by the cluster controller"),
            ),
        ],
    )
    .await;

    let own_shape = |name: &str, mark: &str, pinned: &str| {
        reflected_volume(name, mark, "Delete")
            .replace(&format!("values: [{mark}]"), &format!("values: [{pinned}]"))
    };
    let files = [
        file(
            "host-path.yaml",
            host_path_pv(
                "marks-planted",
                &format!("tensile.io/upper-cluster: c, tensile.io/virtual-node: {node}"),
            ),
        ),
        file(
            "another.yaml",
            own_shape("pvc-marks-another", "vn-other", "vn-other"),
        ),
        file(
            "unpinned.yaml",
            own_shape("pvc-marks-unpinned", node, "marks-real-node"),
        ),
        file("own.yaml", own_shape("pvc-marks-new", node, node)),
    ];
    let claim_ref = r#"{"spec":{"claimRef":{"name":"stolen"}}}"#;
    let resize = r#"{"spec":{"capacity":{"storage":"2Gi"}}}"#;
    let selected = |n: &str| {
        format!(r#"{{"metadata":{{"annotations":{{"volume.kubernetes.io/selected-node":"{n}"}}}}}}"#)
    };
    let for_me = selected(node);
    let labelled = format!(
        r#"{{"metadata":{{"labels":{{"team":"b"}},"annotations":{{"volume.kubernetes.io/selected-node":"{node}"}}}}}}"#
    );
    let other_node = "marked tensile.io/virtual-node=vn-marks";
    let as_the_node = client_as(up, &node_user, &["system:nodes"]).await;
    wrong.extend(
        each_as(
            &node_user,
            async |args: &[&str]| match *args {
                ["patch", kind, name, body] => merge_patch(&as_the_node, kind, name, body).await,
                _ => as_node(up, node, args).await,
            },
            &[
                (
                    &["create", "-f", &files[0], "--dry-run=server"],
                    Err("CSI driver virtual-node.tensile.io"),
                ),
                (&["create", "-f", &files[1], "--dry-run=server"], Err(other_node)),
                (&["create", "-f", &files[2], "--dry-run=server"], Err("pinned")),
                (&["create", "-f", &files[3], "--dry-run=server"], Ok(())),
                (&["patch", "pv", "marks-foreign", claim_ref], Err(other_node)),
                (
                    &["patch", "pv", "pvc-marks-own", claim_ref],
                    Err("only its capacity"),
                ),
                (&["patch", "pv", "pvc-marks-other", resize], Err(other_node)),
                (&["patch", "pv", "pvc-marks-own", resize], Ok(())),
                (
                    &["delete", "pv", "marks-foreign", "--dry-run=server"],
                    Err(other_node),
                ),
                (
                    &["delete", "pv", "pvc-marks-other", "--dry-run=server"],
                    Err(other_node),
                ),
                (
                    &["delete", "pv", "pvc-marks-kept", "--dry-run=server"],
                    Err(retained),
                ),
                (&["delete", "pv", "pvc-marks-own", "--dry-run=server"], Ok(())),
                // NodeRestriction lets a node write no claim but its status; nor does the
                // chart grant it.
                (
                    &["patch", "pvc", "marks-app/data", &for_me],
                    Err("cannot patch resource"),
                ),
            ],
        )
        .await,
    );
    // Under a credential (upperIdentity: credential) a virtual node's account holds the same
    // volume rights and marks claims: any account of the release holding them is confined
    // alike, and marks a claim with a node only where none was named.
    let account_user = format!("system:serviceaccount:{ns}:{full}-vn-credential");
    let role = format!("{full}-credential-volumes");
    kubectl(
        up.kubeconfig(),
        &[
            "create",
            "clusterrole",
            &role,
            "--verb=create,patch,delete",
            "--resource=persistentvolumes,persistentvolumeclaims",
        ],
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &[
            "create",
            "clusterrolebinding",
            &role,
            &format!("--clusterrole={role}"),
            &format!("--user={account_user}"),
        ],
    )
    .await;
    let account_groups = [
        "system:serviceaccounts".to_owned(),
        format!("system:serviceaccounts:{ns}"),
    ];
    let as_the_account = client_as(up, &account_user, &[&account_groups[0], &account_groups[1]]).await;
    let who = format!("--as={account_user}");
    wrong.extend(
        each_as(
            &account_user,
            async |args: &[&str]| match *args {
                ["patch", kind, name, body] => merge_patch(&as_the_account, kind, name, body).await,
                _ => up.kubectl(&[args, &[who.as_str()]].concat()).await,
            },
            &[
                (
                    &["create", "-f", &files[0], "--dry-run=server"],
                    Err("CSI driver virtual-node.tensile.io"),
                ),
                (
                    &["delete", "pv", "marks-foreign", "--dry-run=server"],
                    Err(not_reflected),
                ),
                (
                    &["patch", "pvc", "marks-app/data", &labelled],
                    Err("changes nothing else"),
                ),
                (
                    &["patch", "pvc", "marks-app/chosen", &for_me],
                    Err("where no other node was named"),
                ),
                (&["patch", "pvc", "marks-app/data", &for_me], Ok(())),
            ],
        )
        .await,
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // The LowerCluster leaves (its lower objects given up: its credential is a placeholder):
    // the controller cordons and deletes its virtual Node and deletes its reflected volume,
    // through the policies, and keeps the retained one.
    kubectl(
        up.kubeconfig(),
        &[
            "annotate",
            "lowercluster",
            node,
            "tensile.io/orphan-lower-objects=true",
        ],
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &["delete", "lowercluster", node, "--wait=true", "--timeout=120s"],
    )
    .await;
    for gone in [format!("node/{node}"), "pv/pvc-marks-own".to_owned()] {
        kubectl(up.kubeconfig(), &["wait", "--for=delete", &gone, "--timeout=30s"]).await;
    }
    kubectl(
        up.kubeconfig(),
        &[
            "get",
            "node/marks-real-node",
            "pv/pvc-marks-kept",
            "pv/marks-foreign",
        ],
    )
    .await;
    assert_no_denied("cluster-controller", &controller);
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));
    drop(controller);
    uninstall_ok(up, release, ns).await;
    kubectl(
        up.kubeconfig(),
        &[
            "delete",
            "node/marks-real-node",
            "pv/pvc-marks-kept",
            "pv/pvc-marks-other",
            "pv/marks-foreign",
            &format!("clusterrole/{role}"),
            &format!("clusterrolebinding/{role}"),
            "namespace/marks-app",
            "--wait=false",
        ],
    )
    .await;
}

/// The objects `helm template` renders for `sets` (on top of one virtual node), as JSON.
async fn rendered(up: &TestCluster, release: &str, sets: &[&str]) -> Vec<serde_json::Value> {
    let chart = chart();
    let mut args = vec![
        "template",
        release,
        &chart,
        "-n",
        "tensile",
        "--set",
        "virtualNodes.nodes[0].name=a",
        "--set",
        "virtualNodes.nodes[0].kubeconfig.value=x",
    ];
    args.extend_from_slice(sets);
    let text = helm_ok(up, &args).await;
    text.split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<serde_json::Value>(doc).ok())
        .filter(|v| v.is_object())
        .collect()
}

fn object<'a>(objects: &'a [serde_json::Value], kind: &str, name: &str) -> &'a serde_json::Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} rendered"))
}

/// The Role `name` of the release namespace (`tensile`): the cluster controller has another
/// of the same name in `kube-node-lease`.
fn release_role<'a>(objects: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    objects
        .iter()
        .find(|o| {
            o["kind"] == "Role" && o["metadata"]["name"] == name && o["metadata"]["namespace"] == "tensile"
        })
        .unwrap_or_else(|| panic!("Role tensile/{name} rendered"))
}

fn container_args(deployment: &serde_json::Value) -> Vec<String> {
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

/// With `prometheusRule.enabled` the chart ships alerts on the fleet (a credential about to
/// expire, failing renewals, a lower cluster not Ready, no cluster controller leading), and
/// with `serviceMonitor.enabled` a monitor per component; each only where the cluster serves
/// its kind, so an install before the prometheus-operator's CRDs does not fail.
#[tokio::test]
async fn the_fleet_alerts_and_monitors_are_rendered_only_where_their_kinds_are_served() {
    let up = &bed().upper;
    let on = [
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "serviceMonitor.enabled=true",
    ];
    let without = rendered(up, "watched", &on).await;
    assert!(
        !without
            .iter()
            .any(|o| o["kind"] == "PrometheusRule" || o["kind"] == "ServiceMonitor"),
        "neither kind is served"
    );
    let mut served = on.to_vec();
    served.extend([
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
    ]);
    let with = rendered(up, "watched", &served).await;
    let rule = object(&with, "PrometheusRule", "watched-tensile");
    let rules = rule["spec"]["groups"][0]["rules"].as_array().unwrap();
    let alerts: Vec<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    assert_eq!(
        alerts,
        [
            "TensileCredentialExpiresSoon",
            "TensileCredentialRenewalFailing",
            "TensileLowerClusterNotReady",
            "TensileClusterControllerDown"
        ]
    );
    assert_eq!(
        rules[0]["expr"],
        "min by (cluster) (tensile_controller_credential_expiry_timestamp_seconds{namespace=\"tensile\"}) - time() < 7200"
    );
    assert!(
        rules[0]["annotations"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("tensilectl join {{ $labels.cluster }}")),
        "says how to recover: {rule}"
    );
    assert!(
        with.iter().any(|o| o["kind"] == "ServiceMonitor"
            && o["metadata"]["name"] == "watched-tensile-cluster-controller"),
        "the controller's metrics are scraped"
    );
}

/// With `networkPolicy.enabled` the release's pods take their HTTPS ports from anyone (the
/// apiserver calls them) and their admin port, which serves `/metrics` without
/// authentication, only from the peers `networkPolicy.metricsFrom` names.
#[tokio::test]
async fn a_network_policy_opens_the_admin_port_only_to_the_metrics_peers() {
    let up = &bed().upper;
    let none = rendered(up, "fenced", &[]).await;
    assert!(
        !none.iter().any(|o| o["kind"] == "NetworkPolicy"),
        "off by default"
    );
    let objects = rendered(
        up,
        "fenced",
        &[
            "--set",
            "networkPolicy.enabled=true",
            "--set",
            "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=observability",
        ],
    )
    .await;
    let policy = object(&objects, "NetworkPolicy", "fenced-tensile");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"],
        "fenced"
    );
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(
        ingress[0],
        serde_json::json!({"ports": [{"port": "https"}, {"port": "kubelet"}]}),
        "{policy}"
    );
    assert_eq!(ingress[1]["ports"], serde_json::json!([{"port": "admin"}]));
    assert_eq!(
        ingress[1]["from"][0]["namespaceSelector"]["matchLabels"]["team"],
        "observability"
    );
    // Every pod it selects names the ports it opens.
    for deployment in objects.iter().filter(|o| o["kind"] == "Deployment") {
        let ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"].to_string();
        assert!(ports.contains("\"admin\""), "{ports}");
    }
}

/// The webhook's replicas spread over nodes by default, so one node's loss leaves one to
/// answer (its failurePolicy is Fail); a spread given in values replaces the default.
#[tokio::test]
async fn the_webhooks_replicas_spread_over_nodes() {
    let up = &bed().upper;
    let objects = rendered(up, "spread", &[]).await;
    let spread = &object(&objects, "Deployment", "spread-tensile-webhook")["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert_eq!(spread[0]["topologyKey"], "kubernetes.io/hostname", "{spread}");
    assert_eq!(spread[0]["whenUnsatisfiable"], "ScheduleAnyway", "{spread}");
    assert_eq!(
        spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "webhook"
    );
    let objects = rendered(
        up,
        "spread",
        &[
            "--set",
            "webhook.topologySpreadConstraints[0].maxSkew=1",
            "--set",
            "webhook.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
            "--set",
            "webhook.topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
        ],
    )
    .await;
    let spread = &object(&objects, "Deployment", "spread-tensile-webhook")["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert_eq!(spread.as_array().map(Vec::len), Some(1), "{spread}");
    assert_eq!(spread[0]["topologyKey"], "topology.kubernetes.io/zone");
}

/// The descheduler may create pods only when it moves bare pods (a move creates the
/// replacement first): `descheduler.barePods` is passed as `--bare-pods`, `off` (the
/// default, also when written unquoted, which YAML reads as false) grants no `create`.
#[tokio::test]
async fn the_descheduler_may_create_pods_only_when_it_moves_bare_pods() {
    let up = &bed().upper;
    let seen = |objects: &[serde_json::Value]| -> (Vec<String>, Vec<String>) {
        let flags = container_args(object(objects, "Deployment", "bp-tensile-descheduler"))
            .into_iter()
            .filter(|a| a.starts_with("--bare-pods"))
            .collect();
        let role = object(objects, "ClusterRole", "bp-tensile-descheduler");
        let verbs = role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["resources"] == serde_json::json!(["pods"]))
            .flat_map(|r| r["verbs"].as_array().unwrap().iter())
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        (flags, verbs)
    };
    let read = ["get", "list", "watch"].map(String::from).to_vec();
    let with_create = ["get", "list", "watch", "create"].map(String::from).to_vec();
    let default = seen(&rendered(up, "bp", &[]).await);
    assert_eq!(default, (vec!["--bare-pods=off".to_owned()], read.clone()));
    let unquoted = seen(&rendered(up, "bp", &["--set", "descheduler.barePods=false"]).await);
    assert_eq!(unquoted, default);
    for value in ["annotated", "all"] {
        let set = format!("descheduler.barePods={value}");
        let on = seen(&rendered(up, "bp", &["--set", &set]).await);
        assert_eq!(on, (vec![format!("--bare-pods={value}")], with_create.clone()));
    }
    let wrong = template(
        up,
        "bp",
        &with_nodes(&["a"], &["--set", "descheduler.barePods=some"]),
    )
    .await;
    assert!(!wrong.ok, "an unknown value is refused");
    assert!(wrong.stderr.contains("barePods"), "{}", wrong.stderr);
}

/// Failback is off by default; `descheduler.rebalance.enabled` turns it on with its budget.
#[tokio::test]
async fn enabling_rebalance_passes_its_budget_to_the_descheduler() {
    let up = &bed().upper;
    let flags = |objects: &[serde_json::Value]| -> Vec<String> {
        container_args(object(objects, "Deployment", "rb-tensile-descheduler"))
            .into_iter()
            .filter(|a| a.starts_with("--rebalance"))
            .collect()
    };
    assert!(flags(&rendered(up, "rb", &[]).await).is_empty());
    let on = rendered(
        up,
        "rb",
        &[
            "--set",
            "descheduler.rebalance.enabled=true",
            "--set",
            "descheduler.rebalance.stabilizationSeconds=90",
        ],
    )
    .await;
    assert_eq!(
        flags(&on),
        [
            "--rebalance",
            "--rebalance-max-unavailable=1",
            "--rebalance-stabilization=90",
            "--rebalance-cooldown=300",
            "--rebalance-max-owners=1",
            "--rebalance-max-per-round=5",
        ]
    );
}

/// Enabling the multi-scheduler hands the opted-in pods to it: the webhook sets their
/// `schedulerName` to the multi-scheduler's (`--scheduler-name`), in either mode, and to
/// nothing when it is off. In extender mode the multi-scheduler may read pods (what
/// preempting them frees below).
#[tokio::test]
async fn enabling_the_multi_scheduler_makes_the_webhook_hand_it_the_opted_in_pods() {
    let up = &bed().upper;
    let name_flags = |objects: &[serde_json::Value]| -> Vec<String> {
        container_args(object(objects, "Deployment", "ms-tensile-webhook"))
            .into_iter()
            .filter(|a| a.starts_with("--scheduler-name"))
            .collect()
    };
    let off = rendered(up, "ms", &[]).await;
    assert!(name_flags(&off).is_empty(), "{:?}", name_flags(&off));
    for mode in ["scheduler", "extender"] {
        let mode_set = format!("multiScheduler.mode={mode}");
        let on = rendered(
            up,
            "ms",
            &["--set", "multiScheduler.enabled=true", "--set", &mode_set],
        )
        .await;
        assert_eq!(name_flags(&on), ["--scheduler-name=tensile-scheduler"], "{mode}");
        let multi = container_args(object(&on, "Deployment", "ms-tensile-multi-scheduler"));
        assert!(
            multi.contains(&"--scheduler-name=tensile-scheduler".to_owned()),
            "{multi:?}"
        );
        let role = object(&on, "ClusterRole", "ms-tensile-multi-scheduler");
        let reads_pods = role["rules"].as_array().unwrap().iter().any(|r| {
            r["resources"].as_array().unwrap().iter().any(|x| x == "pods")
                && ["list", "watch"]
                    .iter()
                    .all(|v| r["verbs"].as_array().unwrap().iter().any(|x| x == v))
        });
        assert!(reads_pods, "{mode}: {role}");
    }
    let renamed = rendered(
        up,
        "ms",
        &[
            "--set",
            "multiScheduler.enabled=true",
            "--set",
            "multiScheduler.schedulerName=placer",
        ],
    )
    .await;
    assert_eq!(name_flags(&renamed), ["--scheduler-name=placer"]);
    let explicit = rendered(up, "ms", &["--set", "webhook.schedulerName=elsewhere"]).await;
    assert_eq!(name_flags(&explicit), ["--scheduler-name=elsewhere"]);
    let bad = helm(
        up,
        &[
            "template",
            "ms",
            &chart(),
            "--set",
            "webhook.schedulerName=Not_A_Name",
        ],
    )
    .await
    .unwrap();
    assert!(
        !bad.ok && bad.stderr.contains("webhook.schedulerName"),
        "{}",
        bad.stderr
    );
}

/// Every `apiVersion` of the PodDisruptionBudgets rendered for `kube_version`.
async fn pdb_versions(up: &TestCluster, kube_version: &str) -> (Vec<String>, Vec<String>) {
    let objects = rendered(
        up,
        "pdb",
        &[
            "--kube-version",
            kube_version,
            "--set",
            "descheduler.replicas=2",
            "--set",
            "virtualNodes.replicas=2",
            "--set",
            "clusterController.replicas=2",
            "--set",
            "multiScheduler.enabled=true",
            "--set",
            "multiScheduler.replicas=2",
        ],
    )
    .await;
    let budgets = objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
        .map(|o| o["apiVersion"].as_str().unwrap().to_owned())
        .collect();
    // The budgets of virtual nodes are the cluster controller's to make; its role lets it
    // write them.
    let controller = container_args(object(&objects, "Deployment", "pdb-tensile-cluster-controller"));
    let told: Vec<String> = controller
        .iter()
        .filter(|a| a.contains("budget"))
        .cloned()
        .collect();
    let role = release_role(&objects, "pdb-tensile-cluster-controller");
    assert!(
        role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["resources"] == serde_json::json!(["poddisruptionbudgets"])
                && r["apiGroups"] == serde_json::json!(["policy"])),
        "{role}"
    );
    (budgets, told)
}

/// Every supported version gets `policy/v1` budgets, the only PodDisruptionBudget API it
/// serves, and the cluster controller is told to make its virtual nodes' budgets; a cluster
/// older than the supported range is refused by the chart's `kubeVersion`, naming it.
#[tokio::test]
async fn the_disruption_budgets_are_policy_v1_and_older_clusters_are_refused() {
    let up = &bed().upper;
    for version in ["1.33.0", "v1.33.0-eks-1234", "1.35.4", "1.37.2"] {
        let (versions, told) = pdb_versions(up, version).await;
        assert_eq!(
            versions.len(),
            4,
            "webhook, descheduler, multi-scheduler and cluster controller: {versions:?}"
        );
        assert!(
            versions.iter().all(|v| v == "policy/v1"),
            "{version}: {versions:?}"
        );
        assert_eq!(
            told,
            ["--disruption-budgets"],
            "{version}: the controller makes virtual nodes' budgets"
        );
    }
    let old = helm(
        up,
        &[
            "template",
            "old",
            &chart(),
            "--kube-version",
            "1.32.9",
            "--set",
            "virtualNodes.nodes[0].name=a",
            "--set",
            "virtualNodes.nodes[0].kubeconfig.value=x",
        ],
    )
    .await
    .unwrap();
    assert!(
        !old.ok && old.stderr.contains("1.32.9") && old.stderr.contains(">=1.33.0-0"),
        "{}",
        old.stderr
    );
}

/// Leader election whatever the replica count: one replica still runs two pods during a
/// rolling update (and a scale-up adds a second), so the daemons that elect always get the
/// flags and may always use their Lease. The webhook, and the multi-scheduler's extender,
/// have no election.
#[tokio::test]
async fn every_daemon_that_elects_a_leader_does_so_with_one_replica_too() {
    let up = &bed().upper;
    let election = [
        "--leader-elect".to_owned(),
        "--leader-elect-resource-namespace=tensile".to_owned(),
    ];
    let elects = |args: &[String]| election.iter().all(|f| args.contains(f));
    let lease_rule = |role: &serde_json::Value, lease: &str| {
        let rules = role["rules"].as_array().unwrap();
        let has = |verb: &str, named: bool| {
            rules.iter().any(|r| {
                r["resources"] == serde_json::json!(["leases"])
                    && r["verbs"].as_array().unwrap().iter().any(|v| v == verb)
                    && (!named
                        || r["resourceNames"]
                            .as_array()
                            .is_some_and(|n| n.iter().any(|x| x == lease)))
            })
        };
        has("create", false) && has("get", true) && has("update", true)
    };
    for replicas in ["1", "2"] {
        let sets: Vec<String> = [
            format!("virtualNodes.replicas={replicas}"),
            format!("descheduler.replicas={replicas}"),
            format!("multiScheduler.replicas={replicas}"),
            format!("webhook.replicas={replicas}"),
            "multiScheduler.enabled=true".to_owned(),
        ]
        .into_iter()
        .flat_map(|s| ["--set".to_owned(), s])
        .collect();
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let objects = rendered(up, "le", &sets).await;
        for deployment in [
            "le-tensile-cluster-controller",
            "le-tensile-descheduler",
            "le-tensile-multi-scheduler",
        ] {
            let args = container_args(object(&objects, "Deployment", deployment));
            assert!(elects(&args), "{deployment}, {replicas} replica(s): {args:?}");
        }
        // Every virtual node elects too; the controller grants each its Lease by name (its
        // unit tests, and the run test's can-i).
        let args = container_args(&virtual_node_template(&objects, "le"));
        assert!(elects(&args), "virtual nodes, {replicas} replica(s): {args:?}");
        let webhook = container_args(object(&objects, "Deployment", "le-tensile-webhook"));
        assert!(
            !webhook.iter().any(|a| a.starts_with("--leader-elect")),
            "{webhook:?}"
        );
        let controller_role = release_role(&objects, "le-tensile-cluster-controller");
        assert!(
            controller_role["rules"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["resources"] == serde_json::json!(["leases"])
                    && ["get", "create", "update"].iter().all(|v| r["verbs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x == v))),
            "{controller_role}"
        );
        assert!(lease_rule(
            object(&objects, "Role", "le-tensile-descheduler"),
            "tensile-descheduler"
        ));
        assert!(lease_rule(
            object(&objects, "Role", "le-tensile-multi-scheduler"),
            "tensile-multi-scheduler"
        ));
    }
    let extender = rendered(
        up,
        "le",
        &[
            "--set",
            "multiScheduler.enabled=true",
            "--set",
            "multiScheduler.mode=extender",
        ],
    )
    .await;
    let args = container_args(object(&extender, "Deployment", "le-tensile-multi-scheduler"));
    assert!(!args.iter().any(|a| a.starts_with("--leader-elect")), "{args:?}");
    assert!(!lease_rule(
        object(&extender, "Role", "le-tensile-multi-scheduler"),
        "tensile-multi-scheduler"
    ));
}

/// `helm template` of release `release` with `sets` on top of the chart's defaults.
async fn template(up: &TestCluster, release: &str, sets: &[String]) -> tensile_e2e::kubectl::Output {
    let chart = chart();
    let mut args = vec!["template", release, &chart, "-n", "tensile"];
    args.extend(sets.iter().map(String::as_str));
    helm(up, &args).await.unwrap()
}

/// `--set` flags of one virtual node per name, each with a kubeconfig, then `more`.
fn with_nodes(names: &[&str], more: &[&str]) -> Vec<String> {
    let mut sets = Vec::new();
    for (i, name) in names.iter().enumerate() {
        sets.extend([
            "--set".to_owned(),
            format!("virtualNodes.nodes[{i}].name={name}"),
            "--set".to_owned(),
            format!("virtualNodes.nodes[{i}].kubeconfig.value=x"),
        ]);
    }
    sets.extend(more.iter().map(|s| s.to_string()));
    sets
}

/// Values that would make a broken release are refused before anything is installed, each
/// with a message that names the value and says why.
#[tokio::test]
async fn values_that_would_break_the_release_are_refused_with_the_reason() {
    let up = &bed().upper;
    let refused = async |release: &str, sets: Vec<String>| {
        let out = template(up, release, &sets).await;
        assert!(!out.ok, "{sets:?} rendered:\n{}", out.stdout);
        out.stderr
    };

    // One lower cluster named twice: one Node, one Lease, two Deployments fighting over them.
    let err = refused("bad", with_nodes(&["lower-a", "lower-b", "lower-a"], &[])).await;
    assert!(
        err.contains(
            r#"virtualNodes.nodes[2].name "lower-a" is also virtualNodes.nodes[0].name: each lower cluster is one Node of its own name"#
        ),
        "{err}"
    );

    // A name whose Deployment name leaves its pods no room: the cluster controller would
    // refuse it, so the chart says so first.
    let long = "x".repeat(33);
    let err = refused("bad", with_nodes(&["a", &long], &[])).await;
    // "bad-tensile-vn-" and the name: 15 + 33 = 48 characters, one too many.
    assert!(
        err.contains(&format!(
            r#"virtualNodes.nodes[1].name "{long}" makes the Deployment "bad-tensile-vn-{long}" (bad-tensile-vn-<name>) of 48 characters"#
        )) && err.contains("with a name of at most 32 characters"),
        "{err}"
    );
    // A name within it is fine.
    let fits = template(up, "bad", &with_nodes(&[&"x".repeat(32)], &[])).await;
    assert!(fits.ok, "{}", fits.stderr);

    // An empty Secret name (the Deployment would mount a Secret nobody made), or empty text.
    let node_a = ["--set", "virtualNodes.nodes[0].name=a"];
    for (field, set) in [
        ("secretName", "virtualNodes.nodes[0].kubeconfig.secretName="),
        ("value", "virtualNodes.nodes[0].kubeconfig.value="),
    ] {
        let sets = [node_a[0], node_a[1], "--set", set].map(str::to_owned).to_vec();
        let err = refused("bad", sets).await;
        assert!(
            err.contains(&format!(
                "virtualNodes.nodes.0.kubeconfig.{field}: String length must be greater than or equal to 1"
            )),
            "{err}"
        );
    }

    // Upper tokens under a credential identity (they would need a token grant on every
    // ServiceAccount), and an endpoint in-cluster clients cannot use.
    let tokens = |identity: &str, endpoint: &str| {
        with_nodes(
            &["a"],
            &[
                "--set",
                &format!("virtualNodes.upperIdentity={identity}"),
                "--set",
                &format!("virtualNodes.nodes[0].upperTokens.apiEndpoint={endpoint}"),
            ],
        )
    };
    let err = refused("bad", tokens("credential", "https://upper:6443")).await;
    assert!(
        err.contains("virtualNodes.nodes[].upperTokens of a needs virtualNodes.upperIdentity: node"),
        "{err}"
    );
    let err = refused("bad", tokens("node", "http://upper")).await;
    assert!(
        err.contains("virtualNodes.nodes.0.upperTokens.apiEndpoint: Does not match pattern"),
        "{err}"
    );
    // A namespace-scoped node with namespace collection: it would stop at start-up.
    let err = refused(
        "bad",
        with_nodes(
            &["a"],
            &[
                "--set",
                "virtualNodes.gcNamespaces=true",
                "--set",
                "virtualNodes.nodes[0].namespaces={team-a}",
            ],
        ),
    )
    .await;
    assert!(
        err.contains("virtualNodes.nodes[].namespaces of a and virtualNodes.gcNamespaces exclude each other"),
        "{err}"
    );
    let fine = template(up, "bad", &tokens("node", "https://upper:6443")).await;
    assert!(
        fine.ok && fine.stdout.contains("apiEndpoint: https://upper:6443"),
        "{}",
        fine.stderr
    );
    // A node's overrides go into its LowerCluster as written; one that is not a mapping is
    // refused by the schema.
    let overrides = with_nodes(
        &["a"],
        &[
            "--set",
            "virtualNodes.nodes[0].overrides.rules[0].name=mirror",
            "--set",
            "virtualNodes.nodes[0].overrides.storageClasses.fast=premium",
        ],
    );
    let fine = template(up, "bad", &overrides).await;
    assert!(
        fine.ok
            && fine.stdout.contains(
                "  overrides:\n    rules:\n    - name: mirror\n    storageClasses:\n      fast: premium"
            ),
        "{}{}",
        fine.stderr,
        fine.stdout
    );
    let err = refused(
        "bad",
        with_nodes(&["a"], &["--set", "virtualNodes.nodes[0].overrides=x"]),
    )
    .await;
    assert!(
        err.contains("virtualNodes.nodes.0.overrides: Invalid type"),
        "{err}"
    );

    // No webhook replica with failurePolicy Fail: every opted-in pod would be refused.
    let err = refused("bad", with_nodes(&["a"], &["--set", "webhook.replicas=0"])).await;
    assert!(
        err.contains(
            "webhook.replicas is 0 with webhook.failurePolicy Fail: no replica would answer, so the apiserver would refuse every opted-in pod"
        ),
        "{err}"
    );
    // Allowed where nothing is refused: Ignore, or a webhook outside the cluster.
    for allowed in [
        "webhook.failurePolicy=Ignore",
        "webhook.url=https://webhook.example/mutate",
    ] {
        let out = template(
            up,
            "ok",
            &with_nodes(&["a"], &["--set", "webhook.replicas=0", "--set", allowed]),
        )
        .await;
        assert!(out.ok, "{allowed}: {}", out.stderr);
    }
}

/// With `replicas: 2` the descheduler's Deployment becomes Available, as `kubectl rollout
/// status` waits for it: both pods Ready by their readiness probe (the simulated kubelet sends
/// it to the real descheduler run here for each pod, under the chart's ServiceAccount, with
/// the Deployment's flags), one leading (`tensile_leader 1`), the other on standby (`0`, Ready
/// once its caches synced), and the disruption budget lets one pod go, so the leader's node
/// can drain.
#[tokio::test]
async fn with_two_replicas_the_descheduler_deployment_is_available_with_one_leader() {
    let up = &bed().upper;
    let (ns, release, deployment) = ("tensile-ha", "ha", "ha-tensile-descheduler");
    up.create_namespace(ns).await.unwrap();
    // A node only the chart's pods tolerate, whose kubelet probes the processes run here.
    let host = NodeSimulator::start(
        up.client().await.unwrap(),
        SimulatorOptions::new("chart-host", Some(up.kubelet_client_ca_pem())),
        vec![
            NodeConfig::new("chart-host-0")
                .label("tensile.io/chart-host", "yes")
                .taint("tensile.io/chart-host", "yes", "NoSchedule"),
        ],
    )
    .await
    .unwrap();
    let values = up.dir().join("ha-values.yaml");
    std::fs::write(
        &values,
        "webhook: {enabled: false}\n\
         virtualNodes: {enabled: false}\n\
         descheduler:\n  replicas: 2\n  nodeSelector: {tensile.io/chart-host: \"yes\"}\n  \
         tolerations: [{key: tensile.io/chart-host, operator: Exists, effect: NoSchedule}]\n",
    )
    .unwrap();
    let values = values.display().to_string();
    helm_ok(up, &["install", release, &chart(), "-n", ns, "-f", &values]).await;

    // Both pods run on the node, not Ready: nothing answers their probe yet.
    let selector = format!("app.kubernetes.io/instance={release},app.kubernetes.io/component=descheduler");
    let rows = r#"jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.phase}{"\n"}{end}"#;
    let what = "two descheduler pods Running on chart-host-0";
    let pods: Vec<String> = tensile_e2e::wait::within(what, 60, || async {
        let out = kubectl(
            up.kubeconfig(),
            &["-n", ns, "get", "pods", "-l", &selector, "-o", rows],
        )
        .await;
        let running: Vec<String> = out
            .lines()
            .filter(|l| l.ends_with(" chart-host-0 Running"))
            .filter_map(|l| l.split(' ').next().map(str::to_owned))
            .collect();
        if running.len() == 2 { Ok(running) } else { Err(out) }
    })
    .await;
    let ready = [
        "-n",
        ns,
        "get",
        "deployment",
        deployment,
        "-o",
        r#"jsonpath={.status.readyReplicas}/{.status.availableReplicas}/{.status.conditions[?(@.type=="Available")].status}"#,
    ];
    assert_eq!(
        kubectl(up.kubeconfig(), &ready).await,
        "//False",
        "not Available before anything answers the probes"
    );

    // The descheduler for each pod, with the Deployment's flags and its account's token.
    let token = token_kubeconfig(up, ns, deployment, "ha-token.kubeconfig").await;
    let args = chart::deployment_args(up, ns, deployment).await.unwrap();
    for flag in ["--leader-elect", "--leader-elect-resource-namespace=tensile-ha"] {
        assert!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }
    let bin = tensile_e2e::bins::suite_binary("descheduler").unwrap();
    let mut admins = Vec::new();
    let mut replicas = Vec::new();
    for pod in &pods {
        let admin = format!("127.0.0.1:{}", free_port().unwrap());
        let args = chart::with_flags(
            &args,
            &[
                format!("--kubeconfig={}", token.display()),
                format!("--admin-addr={admin}"),
            ],
        );
        let log = up.dir().join(format!("descheduler-{pod}.log"));
        let _ = std::fs::remove_file(&log);
        replicas.push(Service::start(pod, &bin, &args, &log).unwrap());
        host.probe_at(ns, pod, &admin).unwrap();
        admins.push(admin);
    }

    // Available: both Ready, as a rollout waits for.
    let rollout = up
        .kubectl(&[
            "-n",
            ns,
            "rollout",
            "status",
            &format!("deployment/{deployment}"),
            "--timeout=90s",
        ])
        .await;
    assert!(
        rollout.ok && rollout.stdout.contains("successfully rolled out"),
        "{} {}\n{}\n{}",
        rollout.stdout,
        rollout.stderr,
        replicas[0].log_tail(3000),
        replicas[1].log_tail(3000)
    );
    assert_eq!(kubectl(up.kubeconfig(), &ready).await, "2/2/True");

    // One leads, the other stands by, and both say so.
    let mut stands = Vec::new();
    for admin in &admins {
        let metrics = tensile_e2e::in_process::admin_get(admin, "/metrics")
            .await
            .unwrap()
            .1;
        let leader = tensile_e2e::descheduler::metric_sum(&metrics, "tensile_leader", &[]);
        let (code, readyz) = tensile_e2e::in_process::admin_get(admin, "/readyz")
            .await
            .unwrap();
        assert_eq!(code, 200, "{readyz}");
        stands.push((leader, readyz));
    }
    stands.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!((stands[0].0, stands[1].0), (0.0, 1.0), "{stands:?}");
    assert!(
        stands[0]
            .1
            .starts_with("ok: standby: the leader Lease is held by"),
        "{stands:?}"
    );
    assert!(stands[1].1.starts_with("ok: leading as"), "{stands:?}");

    // The budget of one pod down is now free to spend (a drain of the leader's node goes).
    eventually(
        up.kubeconfig(),
        "the disruption budget allowing one disruption",
        30,
        &[
            "-n",
            ns,
            "get",
            "poddisruptionbudget",
            deployment,
            "-o",
            "jsonpath={.status.disruptionsAllowed}",
        ],
        "1",
    )
    .await;

    for (pod, replica) in pods.iter().zip(&replicas) {
        assert_no_denied(pod, replica);
    }
    drop(replicas);
    uninstall_ok(up, release, ns).await;
    drop(host);
    kubectl(
        up.kubeconfig(),
        &["delete", "node", "chart-host-0", "--wait=false"],
    )
    .await;
}

/// Each component's pods take a PriorityClass, annotations, labels, an update strategy and
/// extra env, volumes and mounts from values; the chart's own stay (its selector labels,
/// its env and volumes), and a label the chart selects by is refused.
#[tokio::test]
async fn each_component_takes_pod_settings_from_values() {
    let up = &bed().upper;
    let values = up.dir().join("pod-settings.yaml");
    let settings = "  priorityClassName: tensile-critical\n  podAnnotations: {example.com/team: infra}\n  \
                    podLabels: {team: infra}\n  \
                    updateStrategy: {type: RollingUpdate, rollingUpdate: {maxSurge: 1, maxUnavailable: 0}}\n  \
                    extraEnv: [{name: HTTPS_PROXY, value: \"http://proxy:3128\"}]\n  \
                    extraVolumes: [{name: corp-ca, configMap: {name: corp-ca}}]\n  \
                    extraVolumeMounts: [{name: corp-ca, mountPath: /etc/ssl/corp, readOnly: true}]\n";
    let mut text = String::new();
    for component in [
        "virtualNodes",
        "clusterController",
        "webhook",
        "descheduler",
        "multiScheduler",
    ] {
        text.push_str(&format!("{component}:\n{settings}"));
        if component == "multiScheduler" {
            text.push_str("  enabled: true\n");
        }
    }
    std::fs::write(&values, text).unwrap();
    let values = values.display().to_string();
    let objects = rendered(
        up,
        "pod",
        &[
            "-f",
            &values,
            "--set",
            "stashKeys.signWith=k",
            "--set",
            &format!("stashKeys.keys.k={}", "k".repeat(32)),
        ],
    )
    .await;
    let vn_template = virtual_node_template(&objects, "pod");
    for (name, component, own_env, own_volume) in [
        (
            "virtual node template",
            "virtual-node",
            Some("TENSILE_NODE_IP"),
            Some("stash-keys"),
        ),
        (
            "pod-tensile-cluster-controller",
            "cluster-controller",
            None,
            Some("template"),
        ),
        ("pod-tensile-webhook", "webhook", None, Some("stash-keys")),
        ("pod-tensile-descheduler", "descheduler", None, None),
        ("pod-tensile-multi-scheduler", "multi-scheduler", None, None),
    ] {
        let d = if name == "virtual node template" {
            &vn_template
        } else {
            object(&objects, "Deployment", name)
        };
        let pod = &d["spec"]["template"];
        let container = &pod["spec"]["containers"][0];
        assert_eq!(pod["spec"]["priorityClassName"], "tensile-critical", "{name}");
        assert_eq!(
            pod["metadata"]["annotations"]["example.com/team"], "infra",
            "{name}"
        );
        assert_eq!(pod["metadata"]["labels"]["team"], "infra", "{name}");
        assert_eq!(
            pod["metadata"]["labels"]["app.kubernetes.io/component"], component,
            "{name}: the selector labels stay"
        );
        assert_eq!(
            d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0,
            "{name}"
        );
        let names = |list: &serde_json::Value| -> Vec<String> {
            list.as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e["name"].as_str().map(str::to_owned))
                .collect()
        };
        let env = names(&container["env"]);
        assert!(env.contains(&"HTTPS_PROXY".to_owned()), "{name}: {env:?}");
        if let Some(own) = own_env {
            assert!(env.contains(&own.to_owned()), "{name}: {env:?}");
        }
        let volumes = names(&pod["spec"]["volumes"]);
        let mounts = names(&container["volumeMounts"]);
        assert!(volumes.contains(&"corp-ca".to_owned()), "{name}: {volumes:?}");
        assert!(mounts.contains(&"corp-ca".to_owned()), "{name}: {mounts:?}");
        if let Some(own) = own_volume {
            assert!(
                volumes.contains(&own.to_owned()) && mounts.contains(&own.to_owned()),
                "{name}"
            );
        }
    }
    // Without them nothing changes: no strategy, no priority, no extra env.
    let plain = rendered(up, "pod", &[]).await;
    let d = object(&plain, "Deployment", "pod-tensile-descheduler");
    assert!(d["spec"]["strategy"].is_null() && d["spec"]["template"]["spec"]["priorityClassName"].is_null());

    let out = template(
        up,
        "pod",
        &with_nodes(
            &["a"],
            &["--set", "descheduler.podLabels.app\\.kubernetes\\.io/component=x"],
        ),
    )
    .await;
    assert!(!out.ok);
    assert!(
        out.stderr.contains(
            r#"descheduler.podLabels: "app.kubernetes.io/component" is a label the chart selects the pods by"#
        ),
        "{}",
        out.stderr
    );
    let out = template(
        up,
        "pod",
        &with_nodes(&["a"], &["--set", "webhook.updateStrategy.type=Sometimes"]),
    )
    .await;
    assert!(
        !out.ok && out.stderr.contains("webhook.updateStrategy.type"),
        "{}",
        out.stderr
    );
}

/// A signed stash cannot be replayed onto another pod after admission: the chart's policy lets
/// no update add, change or copy a stash signature (or the stash it signs) into a pod, while
/// other edits and taking the stash out stay allowed. Shown on the apiserver itself.
#[tokio::test]
async fn a_signed_stash_is_set_at_creation_only() {
    let up = &bed().upper;
    let key = format!("stashKeys.keys.only={}", "k".repeat(40));
    let chart = chart();
    let args = [
        "template",
        "replay",
        chart.as_str(),
        "-n",
        "tensile",
        "--set",
        "virtualNodes.nodes[0].name=a",
        "--set",
        "virtualNodes.nodes[0].kubeconfig.value=x",
        "--set",
        &key,
        "--set",
        "stashKeys.signWith=only",
    ];
    let text = helm_ok(up, &args).await;
    let policies: Vec<String> = text
        .split("\n---")
        .filter(|doc| doc.contains("name: replay-tensile-webhook-stash"))
        .map(str::to_owned)
        .collect();
    assert_eq!(policies.len(), 2, "the policy and its binding are rendered");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, policies.join("\n---\n")).unwrap();
    let file = file.display().to_string();
    kubectl(up.kubeconfig(), &["apply", "-f", &file]).await;

    up.create_namespace("replay").await.unwrap();
    let pod = |name: &str, annotations: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: replay, annotations: {{{annotations}}}}}
spec: {{containers: [{{name: app, image: nginx}}]}}
"#
        )
    };
    apply(
        up.kubeconfig(),
        &pod(
            "mine",
            "clusterSelector: '{}', tensile.io/stash-signature: v2.only.aaaa",
        ),
    )
    .await;
    apply(up.kubeconfig(), &pod("bare", "note: x")).await;
    let annotate = |pod: &'static str, set: &'static [&'static str]| async move {
        let mut all = vec!["-n", "replay", "annotate", "pod", pod, "--overwrite"];
        all.extend_from_slice(set);
        up.kubectl(&all).await
    };
    let replay: &[&str] = &[
        "tensile.io/stash-signature=v2.only.bbbb",
        r#"clusterSelector={"tolerations":[{"key":"gpu","operator":"Exists"}]}"#,
    ];
    // The policy takes effect within seconds of its creation: awaited without writing
    // (a server dry run runs admission too).
    tensile_e2e::wait::must(
        "the policy in effect",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            let mut all = vec![
                "-n",
                "replay",
                "annotate",
                "pod",
                "mine",
                "--overwrite",
                "--dry-run=server",
            ];
            all.extend_from_slice(replay);
            match up.kubectl(&all).await.ok {
                false => Ok(()),
                true => Err("accepted".to_owned()),
            }
        },
    )
    .await;
    let refused = tensile_e2e::wait::must(
        "the replay of another pod's signature refused",
        Duration::from_secs(5),
        Duration::from_millis(500),
        || async {
            let out = annotate("mine", replay).await;
            match out.ok {
                false => Ok(out.stderr),
                true => Err("accepted".to_owned()),
            }
        },
    )
    .await;
    assert!(
        refused.contains("a signed stash (annotations clusterSelector and tensile.io/stash-signature) is set when the pod is created"),
        "{refused}"
    );
    // Nor added to a pod that had none, nor the stash changed under a kept signature.
    let added = annotate("bare", &["tensile.io/stash-signature=v2.only.bbbb"]).await;
    assert!(
        !added.ok && added.stderr.contains("may not be added or changed later"),
        "{}",
        added.stderr
    );
    let changed = annotate("mine", &[r#"clusterSelector={"nodeSelector":{"pool":"gpu"}}"#]).await;
    assert!(
        !changed.ok,
        "the stash under a kept signature changed: {}",
        changed.stdout
    );
    // Other edits go through, and so does taking the stash out.
    let other = annotate("mine", &["note=edited"]).await;
    assert!(other.ok, "{}", other.stderr);
    let removed = annotate("mine", &["tensile.io/stash-signature-", "clusterSelector-"]).await;
    assert!(removed.ok, "{}", removed.stderr);

    kubectl(up.kubeconfig(), &["delete", "-f", &file]).await;
    kubectl(
        up.kubeconfig(),
        &["delete", "namespace", "replay", "--wait=false"],
    )
    .await;
}

/// A LowerCluster manifest named `name`, of the release in `ns`, its credential in Secret
/// `secret`, with `spec` fields besides.
fn lower_cluster(name: &str, ns: &str, secret: &str, spec: &str) -> String {
    format!(
        "apiVersion: tensile.io/v1alpha1\nkind: LowerCluster\nmetadata:\n  name: {name}\n  labels: {{tensile.io/controller-namespace: {ns}}}\n\
         spec:\n  credential: {{secretName: {secret}}}\n{spec}"
    )
}

/// On an upper cluster of the oldest supported version, as on the bed's newest: `tensilectl
/// crds` applies the definitions, whose CEL rules refuse a name that is not a DNS label, a
/// virtual node name changed once made, and an override rule named against its schema; the
/// controller reports on a LowerCluster with Events; the chart's pre-delete hook refuses the
/// uninstall while the LowerCluster holds its virtual node, and lets it go once it left.
#[tokio::test]
async fn on_the_oldest_supported_upper_the_fleet_is_checked_events_are_written_and_uninstall_is_guarded() {
    let started = Instant::now();
    let version = tensile_e2e::bins::version_for(tensile_e2e::bins::SKEWED_CLUSTER);
    let options = tensile_e2e::ClusterOptions::new("chart", "upper-oldest").version(&version);
    let up = TestCluster::start(options).await.unwrap();
    let (ns, release, full) = ("tensile-old", "old", "old-tensile");
    eprintln!("upper cluster {}", up.version());

    let said = chart::apply_crds(up.kubeconfig()).await.unwrap();
    assert!(
        said.contains("CustomResourceDefinition lowerclusters.tensile.io: made"),
        "tensilectl crds on {}: {said}",
        up.version()
    );

    // What the definition's rules refuse, the apiserver refuses, saying why.
    let upper = &up;
    let refused = |name: &str, spec: &str| {
        let manifest = lower_cluster(name, ns, "none", spec);
        let file = upper.dir().join(format!("{name}-refused.yaml"));
        std::fs::write(&file, manifest).unwrap();
        let file = file.display().to_string();
        async move { upper.kubectl(&["create", "-f", &file]).await }
    };
    let out = refused("with.dot", "").await;
    assert!(
        !out.ok && out.stderr.contains("the name must be a DNS label"),
        "{}",
        out.stderr
    );
    let out = refused(
        "badrule",
        "  overrides:\n    rules: [{name: Region, labels: {region: c}}]\n",
    )
    .await;
    assert!(
        !out.ok && out.stderr.contains("spec.overrides.rules[0].name") && out.stderr.contains("Region"),
        "{}",
        out.stderr
    );
    apply(
        up.kubeconfig(),
        &lower_cluster("fixed", ns, "none", "  nodeName: fixed-node\n"),
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &[
            "patch",
            "lowercluster",
            "fixed",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"nodeName":"fixed-node"}}"#,
        ],
    )
    .await;
    tensile_e2e::check::node_name_change_refused(up.kubeconfig(), "fixed").await;
    kubectl(
        up.kubeconfig(),
        &["delete", "lowercluster", "fixed", "--wait=true"],
    )
    .await;

    // The release, and its controller with the chart's account and flags.
    up.create_namespace(ns).await.unwrap();
    helm_ok(&up, &["install", release, &chart(), "-n", ns]).await;
    let mut controller = chart::run_cluster_controller(&up, ns, full, &[]).await.unwrap();
    apply(up.kubeconfig(), &lower_cluster("held", ns, "held-credential", "")).await;
    let selector = "involvedObject.kind=LowerCluster,involvedObject.name=held";
    tensile_e2e::wait::within("a NotReady event on LowerCluster held", 60, || async {
        let events = kubectl(
            up.kubeconfig(),
            &[
                "get",
                "events",
                "-A",
                "--field-selector",
                selector,
                "-o",
                "jsonpath={range .items[*]}{.type} {.reason}: {.message}{\"\\n\"}{end}",
            ],
        )
        .await;
        match events
            .lines()
            .any(|l| l.starts_with("Warning NotReady") && l.contains("held-credential does not exist"))
        {
            true => Ok(()),
            false => Err(events),
        }
    })
    .await;

    let refused = chart::uninstall(&chart::Access::of(&up), release, ns)
        .await
        .unwrap();
    assert!(
        !refused.ok
            && refused.stderr.contains(&format!(
                "job {full}-cluster-controller-uninstall-check failed: BackoffLimitExceeded"
            ))
            && refused
                .stderr
                .contains("held: kubectl delete lowercluster held --wait"),
        "helm uninstall with a LowerCluster left: {}",
        refused.stderr
    );
    assert_eq!(release_status(&up, release, ns).await, "uninstalling");

    // It leaves (nothing below to reach: its lower objects given up), and the release goes.
    kubectl(
        up.kubeconfig(),
        &[
            "annotate",
            "lowercluster",
            "held",
            "tensile.io/orphan-lower-objects=true",
        ],
    )
    .await;
    kubectl(
        up.kubeconfig(),
        &["delete", "lowercluster", "held", "--wait=true", "--timeout=60s"],
    )
    .await;
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));
    assert_no_denied("cluster-controller", &controller);
    controller.stop();
    let out = uninstall_ok(&up, release, ns).await;
    eprintln!("{out}");
    eprintln!("the fleet on {}: {:?}", up.version(), started.elapsed());
}
