//! The set-up a scenario is made of, in the bed's words: an upper cluster and lower clusters
//! started side by side, simulated kubelets below, virtual nodes over a lower cluster, the
//! webhook in process, and the waits for a node, a pod or another object to show what the
//! scenario expects (and reads of what they show now).
//!
//! Start-up helpers return errors, for a shared bed's `init` ([`crate::shared::Shared::bed`]);
//! the waits panic, as the assertions of [`crate::check`] do, with what was awaited, in which
//! cluster, and what was last seen.

use std::path::Path;

use tensile_virtual_node::Args;
use tensile_webhook::Certificates;

use crate::in_process::{self, VirtualNode};
use crate::{ClusterOptions, Error, NodeConfig, NodeSimulator, Result, SimulatorOptions, TestCluster};

/// The jsonpath of a node's `Ready` condition status.
pub const READY: &str = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#;

/// The jsonpath of a pod's phase.
pub const PHASE: &str = "jsonpath={.status.phase}";

/// An upper cluster and one lower cluster with simulated nodes: the bed of most scenes.
pub struct UpperAndLower {
    /// The lower cluster's kubelets: first, so that they stop before the clusters do.
    pub sim: NodeSimulator,
    pub upper: TestCluster,
    pub lower: TestCluster,
}

impl UpperAndLower {
    /// Starts `upper` and the lower cluster `lower` of test `test` side by side, with the
    /// default options, and then simulated kubelets for `nodes` in the lower one.
    pub async fn start(test: &str, lower: &str, nodes: Vec<NodeConfig>) -> Result<Self> {
        let options = [
            ClusterOptions::new(test, "upper"),
            ClusterOptions::new(test, lower),
        ];
        Self::start_with(options, nodes).await
    }

    /// [`UpperAndLower::start`] with the options of both clusters, upper first.
    pub async fn start_with(options: [ClusterOptions; 2], nodes: Vec<NodeConfig>) -> Result<Self> {
        let [upper, lower] = clusters_with(options).await?;
        let sim = simulate(&lower, nodes).await?;
        Ok(Self { sim, upper, lower })
    }
}

/// Starts the clusters `names` of test `test` side by side, each with the default options.
pub async fn clusters<const N: usize>(test: &str, names: [&str; N]) -> Result<[TestCluster; N]> {
    clusters_with(names.map(|name| ClusterOptions::new(test, name))).await
}

/// Starts one cluster for each of `options`, side by side; the first that fails (in the order
/// given) is the error.
pub async fn clusters_with<const N: usize>(options: [ClusterOptions; N]) -> Result<[TestCluster; N]> {
    let started = futures::future::join_all(options.map(TestCluster::start)).await;
    let clusters = started.into_iter().collect::<Result<Vec<_>>>()?;
    let count = clusters.len();
    clusters.try_into().map_err(|_| Error::Cluster {
        cluster: "bed".into(),
        message: format!("{count} clusters started of the {N} asked for"),
    })
}

/// Nodes `<prefix>-0` … `<prefix>-<count - 1>` of the simulator's default size.
pub fn nodes(prefix: &str, count: usize) -> Vec<NodeConfig> {
    (0..count)
        .map(|i| NodeConfig::new(&format!("{prefix}-{i}")))
        .collect()
}

/// Simulated kubelets in `cluster` for `nodes`, the simulator named after the cluster.
pub async fn simulate(cluster: &TestCluster, nodes: Vec<NodeConfig>) -> Result<NodeSimulator> {
    let options = SimulatorOptions::new(cluster.name(), Some(cluster.kubelet_client_ca_pem()));
    NodeSimulator::start(cluster.client().await?, options, nodes).await
}

/// Starts virtual node `name` for `upper` over `lower` in this process, with the bed's options
/// ([`in_process::options`]) as `set` changes them. It runs until dropped.
pub fn virtual_node(
    upper: &TestCluster,
    name: &str,
    lower: &TestCluster,
    set: impl FnOnce(&mut Args),
) -> Result<VirtualNode> {
    let mut args = in_process::options(upper, name, lower).map_err(|e| Error::VirtualNode {
        name: name.to_owned(),
        message: format!("{e:#}"),
    })?;
    set(&mut args);
    Ok(VirtualNode::run(args))
}

/// [`virtual_node`], then waits up to 60 s until the node is Ready upstream; panics when it
/// cannot start or does not turn Ready.
pub async fn ready_virtual_node(
    upper: &TestCluster,
    name: &str,
    lower: &TestCluster,
    set: impl FnOnce(&mut Args),
) -> VirtualNode {
    let vn = virtual_node(upper, name, lower, set).unwrap_or_else(|e| panic!("{e}"));
    node_ready(upper.kubeconfig(), name, 60).await;
    vn
}

/// Labels namespace `ns` `tensile-e2e=<ns>`, so that a webhook registered for
/// [`crate::check::Namespaces::Labelled`]`(ns)` is sent its pods (and tests sharing a cluster do not meet
/// each other's webhooks).
pub async fn opt_in_namespace(kubeconfig: &Path, ns: &str) {
    let label = format!("tensile-e2e={ns}");
    crate::check::kubectl(kubeconfig, &["label", "namespace", ns, &label, "--overwrite"]).await;
}

/// The options of a webhook serving on 127.0.0.1:`port` with a certificate it makes itself.
pub fn webhook_options(port: u16) -> tensile_webhook::Options {
    let names = vec!["127.0.0.1".to_owned()];
    tensile_webhook::Options::new(([127, 0, 0, 1], port).into(), Certificates::SelfSigned { names })
}

/// Waits up to 30 s until `webhook` is ready: its CA is written into its registration.
pub async fn webhook_ready(webhook: &tensile_webhook::Running) {
    let what = "the webhook ready, its CA written into its registration";
    crate::wait::within(what, 30, || async {
        if webhook.state.ready.get() {
            Ok(())
        } else {
            Err("not ready".to_owned())
        }
    })
    .await
}

/// Waits up to `secs` until node `node` shows its Ready condition `True`.
pub async fn node_ready(kubeconfig: &Path, node: &str, secs: u64) {
    node_shows(kubeconfig, node, READY, "True", secs).await;
}

/// Waits up to `secs` until `node` is Ready and the node lifecycle controller has taken away
/// the `node.kubernetes.io/not-ready` taint that admission puts on every new Node (it does so
/// on its next pass after Ready, so for a moment a Ready node still carries it).
pub async fn node_untainted(kubeconfig: &Path, node: &str, secs: u64) {
    let untainted = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status} {.spec.taints[?(@.key=="node.kubernetes.io/not-ready")].effect}"#;
    node_shows(kubeconfig, node, untainted, "True", secs).await;
}

/// The jsonpath (`-o` argument) of condition `kind`'s `fields`, joined by `/`.
pub fn condition(kind: &str, fields: &[&str]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .map(|f| format!(r#"{{.status.conditions[?(@.type=="{kind}")].{f}}}"#))
        .collect();
    format!("jsonpath={}", parts.join("/"))
}

/// Waits up to `secs` until pod `ns/name` is Running.
pub async fn pod_running(kubeconfig: &Path, ns: &str, name: &str, secs: u64) {
    pod_shows(kubeconfig, ns, name, PHASE, "Running", secs).await;
}

/// Waits up to `secs` until `kubectl get node NODE -o OUTPUT` prints `want`.
pub async fn node_shows(kubeconfig: &Path, node: &str, output: &str, want: &str, secs: u64) {
    let what = format!(
        "node {node} in {} to show {want:?} for {output}",
        cluster(kubeconfig)
    );
    crate::check::eventually(
        kubeconfig,
        &what,
        secs,
        &["get", "node", node, "-o", output],
        want,
    )
    .await;
}

/// Waits up to `secs` until `kubectl -n NS get pod NAME -o OUTPUT` prints `want`.
pub async fn pod_shows(kubeconfig: &Path, ns: &str, name: &str, output: &str, want: &str, secs: u64) {
    let what = format!(
        "pod {ns}/{name} in {} to show {want:?} for {output}",
        cluster(kubeconfig)
    );
    let args = ["-n", ns, "get", "pod", name, "-o", output];
    crate::check::eventually(kubeconfig, &what, secs, &args, want).await;
}

/// Waits up to `secs` until `kubectl -n NS get OBJECT -o OUTPUT` prints `want`, for a
/// namespaced `object` written `kind/name` (`pvc/data`, `configmap/settings`).
pub async fn shows(kubeconfig: &Path, ns: &str, object: &str, output: &str, want: &str, secs: u64) {
    let what = format!(
        "{object} in {ns} of {} to show {want:?} for {output}",
        cluster(kubeconfig)
    );
    let args = ["-n", ns, "get", object, "-o", output];
    crate::check::eventually(kubeconfig, &what, secs, &args, want).await;
}

/// What `kubectl -n NS get OBJECT -o OUTPUT` prints now, for a namespaced `object` written
/// `kind/name`; panics with kubectl's error.
pub async fn field(kubeconfig: &Path, ns: &str, object: &str, output: &str) -> String {
    crate::check::kubectl(kubeconfig, &["-n", ns, "get", object, "-o", output]).await
}

/// What `kubectl -n NS get pod NAME -o OUTPUT` prints now; panics with kubectl's error.
pub async fn pod_field(kubeconfig: &Path, ns: &str, name: &str, output: &str) -> String {
    crate::check::kubectl(kubeconfig, &["-n", ns, "get", "pod", name, "-o", output]).await
}

/// What `kubectl get node NODE -o OUTPUT` prints now; panics with kubectl's error.
pub async fn node_field(kubeconfig: &Path, node: &str, output: &str) -> String {
    crate::check::kubectl(kubeconfig, &["get", "node", node, "-o", output]).await
}

/// The cluster a kubeconfig of the bed is for: its file is `<cluster>.kubeconfig`.
fn cluster(kubeconfig: &Path) -> String {
    kubeconfig
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| kubeconfig.display().to_string())
}
