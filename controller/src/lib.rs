//! The fleet as Kubernetes objects: one `LowerCluster` ([`resource`]) per lower cluster.
//!
//! The cluster controller (bin `cluster-controller`, leader-elected) runs one virtual node
//! per `LowerCluster`: a Deployment made from the chart's template, under a ServiceAccount of
//! its own whose rights name only its Node and Leases ([`plan`]). It reports what it sees in
//! the object's status, renews the lower credential's token before it expires
//! ([`credential`]), and on deletion, behind a finalizer, stops the virtual node and removes
//! everything it made in both clusters before the object goes ([`reconcile`]).
//!
//! `tensilectl` ([`ctl`]) sets a lower cluster up in one command (`join`: the lower
//! account, its rights, a short-lived credential, the upper Secret and the `LowerCluster`),
//! tears it down in one (`leave`), and prints the fleet (`status`).

pub mod approve;
pub mod credential;
pub mod ctl;
pub mod metrics;
pub mod plan;
pub mod reconcile;
pub mod resource;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use tensile_common::admin::{self, AdminArgs};
use tensile_common::kubeconfig::{self, ClientArgs};
use tensile_common::leader::LeaderArgs;
use tensile_common::names;
use tensile_common::runtime::{self, CancellationToken, Daemon, Running};
use tensile_common::telemetry::LogArgs;

use crate::plan::Settings;
use crate::reconcile::Context;
use crate::resource::LowerCluster;

/// Command-line flags (each also read from the environment).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "cluster-controller",
    version,
    about = "Runs one virtual node per LowerCluster and removes every trace of one deleted"
)]
pub struct Args {
    /// Kubeconfig of the upper cluster; without it, the pod's service account (in-cluster).
    #[arg(long, env = "TENSILE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The controller's namespace: credentials are read, and virtual nodes run, there. It
    /// acts on the LowerClusters labelled `tensile.io/controller-namespace=<namespace>`.
    #[arg(long, env = "TENSILE_NAMESPACE")]
    pub namespace: String,
    /// Prefix of the names of what the controller makes (the chart's release name).
    #[arg(long = "name-prefix", env = "TENSILE_NAME_PREFIX", default_value = "tensile")]
    pub name_prefix: String,
    /// The Deployment (YAML or JSON) every virtual node's is made from; its container named
    /// `virtual-node` gets each cluster's flags, account and credential.
    #[arg(long = "virtual-node-template", env = "TENSILE_VIRTUAL_NODE_TEMPLATE")]
    pub virtual_node_template: PathBuf,
    /// The ClusterRole every virtual node is bound to (default: `<name-prefix>-virtual-node`).
    #[arg(long = "virtual-node-cluster-role", env = "TENSILE_VIRTUAL_NODE_CLUSTER_ROLE")]
    pub virtual_node_cluster_role: Option<String>,
    /// Id of the upper cluster in lower ownership marks (default: the upper kube-system
    /// namespace UID, as the virtual node's own default).
    #[arg(long = "cluster-id", env = "TENSILE_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// Give a virtual node of several replicas a `policy/v1` PodDisruptionBudget keeping one
    /// replica up.
    #[arg(long = "disruption-budgets", env = "TENSILE_DISRUPTION_BUDGETS")]
    pub disruption_budgets: bool,
    /// Seconds between two looks at each lower cluster.
    #[arg(long = "resync-seconds", env = "TENSILE_RESYNC_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub resync_seconds: u64,
    /// Share of a credential token's lifetime after which it is renewed (the kubelet renews
    /// projected tokens at 0.8).
    #[arg(long = "token-renew-at", env = "TENSILE_TOKEN_RENEW_AT", default_value_t = credential::RENEW_AT,
          value_parser = parse_share)]
    pub token_renew_at: f64,
    /// How long the virtual node of a leaving cluster is drained (its pods evicted, their
    /// disruption budgets honoured) before it stops and the rest go with it.
    #[arg(long = "drain-timeout", env = "TENSILE_DRAIN_TIMEOUT", default_value = "5m",
          value_parser = tensile_common::leader::parse_duration)]
    pub drain_timeout: Duration,
    /// For tests only: abort the process right after this step of a cluster's removal, as
    /// `kill -9` would, to prove a restart finishes the removal.
    #[arg(long = "crash-at", env = "TENSILE_CRASH_AT", hide = true, value_enum)]
    pub crash_at: Option<reconcile::RemovalStep>,
    /// Virtual nodes act upstream as `system:node:<name>` (`--upper-identity=node`): their
    /// grants name that user, their account may only ask for that node's client certificate,
    /// and the controller approves exactly that request.
    #[arg(long = "node-identity", env = "TENSILE_NODE_IDENTITY")]
    pub node_identity: bool,
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(flatten)]
    pub leader: LeaderArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v < 1.0 => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 and 1 (exclusive)")),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Flags(String),
    #[error("--virtual-node-template {path}: {why}")]
    Template { path: PathBuf, why: String },
    #[error(transparent)]
    Kubeconfig(#[from] kubeconfig::Error),
    #[error(transparent)]
    Admin(#[from] admin::Error),
    #[error("cannot read the upper cluster's id (namespace kube-system): {0}; pass --cluster-id")]
    ClusterId(kube::Error),
    #[error("cannot install the signal handlers: {0}")]
    Signal(std::io::Error),
    #[error(transparent)]
    Stopped(#[from] runtime::Stopped),
}

/// Reads the virtual node's Deployment template.
pub fn read_template(path: &std::path::Path) -> Result<Deployment, Error> {
    let bad = |why: String| Error::Template {
        path: path.to_owned(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let template: Deployment =
        serde_yaml::from_str(&text).map_err(|e| bad(format!("not a Deployment: {e}")))?;
    let has_container = template
        .spec
        .template
        .spec
        .as_ref()
        .is_some_and(|p| p.containers.iter().any(|c| c.name == plan::CONTAINER));
    if !has_container {
        return Err(bad(format!("it has no container named {:?}", plan::CONTAINER)));
    }
    Ok(template)
}

/// Runs the controller until SIGTERM or SIGINT.
pub async fn run(args: Args) -> Result<(), Error> {
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    run_until(args, shutdown).await
}

/// As [`run`], stopping when `shutdown` is cancelled.
pub async fn run_until(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    let template = read_template(&args.virtual_node_template)?;
    let mut daemon = Daemon::new("cluster-controller", shutdown)
        .product(names::CONTROLLER_MANAGER)
        .client_options(args.client.options())
        .elect(&args.leader)
        .map_err(Error::Flags)?;
    let upper = daemon.client(args.kubeconfig.as_deref()).await?;
    let cluster_id = match &args.cluster_id {
        Some(id) => id.clone(),
        None => Api::<Namespace>::all(upper.clone())
            .get("kube-system")
            .await
            .map_err(Error::ClusterId)?
            .metadata
            .uid
            .unwrap_or_default(),
    };
    daemon.bind_admin(args.admin.admin_addr).await?;
    let metrics = Arc::new(metrics::Metrics::new(daemon.registry()));
    let ctx = Arc::new(Context {
        upper: upper.clone(),
        settings: Settings {
            namespace: args.namespace.clone(),
            prefix: args.name_prefix.clone(),
            shared_role: args
                .virtual_node_cluster_role
                .clone()
                .unwrap_or_else(|| format!("{}-virtual-node", args.name_prefix)),
            template,
            cluster_id,
            disruption_budgets: args.disruption_budgets,
            node_identity: args.node_identity,
        },
        lower_options: args.client.options(),
        resync: Duration::from_secs(args.resync_seconds),
        renew_at: args.token_renew_at,
        drain_timeout: args.drain_timeout,
        crash_at: daemon.crash_points(args.crash_at),
        applied: Default::default(),
        rights: Default::default(),
        metrics,
        events: kube::runtime::events::Recorder::new(
            upper.clone(),
            kube::runtime::events::Reporter {
                controller: names::CONTROLLER_MANAGER.into(),
                instance: std::env::var("HOSTNAME").ok(),
            },
        ),
    });
    let mut running = daemon.start();
    compose(&args, upper, ctx, &mut running);
    Ok(running.run().await?)
}

/// The certificate approver (with `--node-identity`) and the LowerCluster controller,
/// handed to `running`'s tasks; both act once this replica leads.
fn compose(args: &Args, upper: kube::Client, ctx: Arc<Context>, running: &mut Running) {
    tracing::info!(namespace = %args.namespace, cluster_id = %ctx.settings.cluster_id, "starting");
    let namespace = args.namespace.clone();
    if args.node_identity {
        let (upper, settings, leading) = (upper.clone(), ctx.settings.clone(), running.candidacy.clone());
        running
            .tasks
            .spawn_graceful("the node certificate approver", move |stop| async move {
                if stop.run_until_cancelled(leading.leading()).await.is_none() {
                    return;
                }
                stop.run_until_cancelled(approve::run(upper, settings)).await;
            });
    }
    let (standing, leading) = (running.standing.clone(), running.candidacy.clone());
    running
        .tasks
        .spawn_graceful("the LowerCluster controller", move |stop| async move {
            // Nothing to fill on standby: every pass reads what it needs.
            standing.synced();
            if stop.run_until_cancelled(leading.leading()).await.is_none() {
                return;
            }
            let clusters: Api<LowerCluster> = Api::all(upper.clone());
            let ours = format!("{}={}", names::CONTROLLER_NAMESPACE, namespace);
            // The watch paused and its failures said as every watch of the suite's are (a
            // missing CRD named once, retried 5 s doubling to 60 s), its delays reset only
            // by what it lists or sees.
            let (reader, writer) = reflector::store();
            let events = tensile_common::cache::retried::<LowerCluster, _>(
                watcher(clusters, watcher::Config::default().labels(&ours)),
                None,
            );
            Controller::for_stream(reflector(writer, events).applied_objects(), reader)
                .graceful_shutdown_on(stop.cancelled_owned())
                .run(reconcile::reconcile, error_policy, ctx)
                .for_each(|outcome| async move {
                    if let Err(e) = outcome {
                        tracing::debug!("{e}");
                    }
                })
                .await;
        });
}

fn error_policy(
    cluster: Arc<LowerCluster>,
    error: &reconcile::Error,
    ctx: Arc<Context>,
) -> kube::runtime::controller::Action {
    tracing::warn!(cluster = %cluster.name(), "{error}");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&metrics::Metrics::cluster(cluster.name()))
        .inc();
    kube::runtime::controller::Action::requeue(Duration::from_secs(5))
}
