//! multi-scheduler: lets the upper scheduler pick only virtual nodes whose lower cluster
//! really has a node that fits the pod.
//!
//! The model: each virtual node publishes a capacity shape of its lower cluster
//! ([`tensile_common::shape`]): its nodes grouped by label values and taints, with each
//! group's frontier of per-node free resources. The suite's one fit predicate
//! ([`tensile_common::fit`], which the descheduler also uses) judges a pod against a
//! virtual node from that shape and the pod's stashed lower-cluster constraints; where the
//! data cannot answer exactly it passes the node and says why (fail open), since the lower
//! scheduler and the descheduler remain the backstop. A virtual node the descheduler
//! excluded for the pod's workload is rejected while the exclusion lasts.
//!
//! Two modes share that filter and its score, and what it judges with ([`context`]):
//!
//! * `--mode=extender` (default): an HTTPS kube-scheduler extender ([`extender`], [`server`])
//!   behind a second stock kube-scheduler (`config/` holds its configuration), which also
//!   takes part in preemption ([`preempt`]). It reads virtual Nodes, bound pods and the
//!   exclusion records from watch caches, so answering makes no API call, and keeps no
//!   state: several replicas may serve.
//! * `--mode=scheduler`: a standalone scheduler ([`scheduler`]) for pods with
//!   `spec.schedulerName=<--scheduler-name>`, which places them only on virtual nodes: a
//!   priority queue with per-pod backoff ([`queue`]), the upper checks kube-scheduler makes
//!   plus the filter ([`place`]), an assume ledger, binding, events; one leader acts.

pub mod context;
pub mod extender;
pub mod metrics;
pub mod place;
pub mod preempt;
pub mod queue;
pub mod scheduler;
pub mod server;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tensile_common::admin::{self, AdminArgs};
use tensile_common::cache::{watched, watched_summaries};
use tensile_common::exclusion::{self, Location};
use tensile_common::kubeconfig::{self, ClientArgs};
use tensile_common::leader::LeaderArgs;
use tensile_common::runtime::{self, CancellationToken, Daemon, Running, Supervisor};
use tensile_common::telemetry::LogArgs;
use tensile_common::tls;
use tokio::sync::Notify;

use crate::context::{BoundPod, FactsCache};
use crate::extender::Score;
use crate::server::{BoundPodStore, NodeStore, State};

/// How the multi-scheduler takes part in scheduling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// A kube-scheduler extender (`POST /filter`, `POST /prioritize`).
    Extender,
    /// A standalone scheduler of the pods that name `--scheduler-name`.
    Scheduler,
}

/// Command-line flags (each also read from the environment), then the shared runtime's
/// (clients, admin endpoint, logging).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "multi-scheduler",
    version,
    about = "Filters virtual nodes by whether some lower node fits the pod (a kube-scheduler extender)"
)]
pub struct Args {
    /// How to take part in scheduling.
    #[arg(long, env = "TENSILE_MODE", value_enum, default_value_t = Mode::Extender)]
    pub mode: Mode,
    /// Kubeconfig of the upper cluster; without it, the pod's service account (in-cluster).
    #[arg(long, env = "TENSILE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Scheduler mode: the `spec.schedulerName` of the pods it places.
    #[arg(
        long = "scheduler-name",
        env = "TENSILE_SCHEDULER_NAME",
        default_value = tensile_common::names::MULTI_SCHEDULER
    )]
    pub scheduler_name: String,
    /// Address to serve the extender's HTTPS on.
    #[arg(long, env = "TENSILE_ADDRESS", default_value = "0.0.0.0")]
    pub address: IpAddr,
    /// Port to serve the extender's HTTPS on.
    #[arg(long, env = "TENSILE_PORT", default_value_t = 8443)]
    pub port: u16,
    /// How prioritize ranks the virtual nodes that fit: the tightest lower node first
    /// (binpack) or the roomiest (spread).
    #[arg(long, env = "TENSILE_SCORE", value_enum, default_value_t = Score::Binpack)]
    pub score: Score,
    /// A capacity shape older than this is not trusted and the node passes (`15m`, or
    /// seconds; 0 trusts any age). Virtual nodes refresh an unchanged shape every 5 minutes.
    #[arg(long = "shape-max-age", env = "TENSILE_SHAPE_MAX_AGE", default_value = "15m",
          value_parser = parse_seconds)]
    pub shape_max_age: Duration,
    /// Label selector of the virtual nodes; any other node passes the filter.
    #[arg(
        long = "node-selector",
        env = "TENSILE_NODE_SELECTOR",
        default_value = "type=virtual-kubelet"
    )]
    pub node_selector: String,
    /// Where the descheduler's exclusion records live (`namespace/name`): ExclusionRecord
    /// objects in that namespace, and the old ConfigMap of that name, still honoured.
    #[arg(long = "exclusions-configmap", env = "TENSILE_EXCLUSIONS_CONFIGMAP",
          default_value = exclusion::DEFAULT_LOCATION)]
    pub exclusions_configmap: Location,
    /// Serving certificate (PEM); reloaded when it changes. Without it a certificate is
    /// generated at start.
    #[arg(
        long = "tls-cert-file",
        env = "TENSILE_TLS_CERT_FILE",
        requires = "tls_private_key_file"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key of `--tls-cert-file` (PEM).
    #[arg(
        long = "tls-private-key-file",
        env = "TENSILE_TLS_PRIVATE_KEY_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_private_key_file: Option<PathBuf>,
    /// How often the certificate files are checked for a change, in seconds.
    #[arg(long = "tls-reload-seconds", env = "TENSILE_TLS_RELOAD_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub tls_reload_seconds: u64,
    /// DNS names and IPs of the generated certificate (without `--tls-cert-file`).
    #[arg(
        long = "self-signed-names",
        env = "TENSILE_SELF_SIGNED_NAMES",
        value_delimiter = ',',
        default_value = "localhost,127.0.0.1"
    )]
    pub self_signed_names: Vec<String>,
    /// Where to write the generated certificate's CA (PEM), for the scheduler's
    /// `tlsConfig.caFile` (without `--tls-cert-file`).
    #[arg(
        long = "self-signed-ca-file",
        env = "TENSILE_SELF_SIGNED_CA_FILE",
        conflicts_with = "tls_cert_file"
    )]
    pub self_signed_ca_file: Option<PathBuf>,
    /// Largest request body accepted, in bytes (a scheduler that is not node-cache-capable
    /// sends every candidate Node).
    #[arg(long = "max-body-bytes", env = "TENSILE_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    #[command(flatten)]
    pub client: ClientArgs,
    /// Scheduler mode only: the extender keeps no state, so its replicas need no leader.
    #[command(flatten)]
    pub leader: LeaderArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Seconds as a plain number, or a duration as client-go's flags write it (`30s`, `15m`).
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(n) => Ok(Duration::from_secs(n)),
        Err(_) => tensile_common::leader::parse_duration(s),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid flags: {0}")]
    Flags(String),
    #[error("{0}")]
    Kubeconfig(#[from] kubeconfig::Error),
    #[error("{0}")]
    Admin(#[from] admin::Error),
    #[error(transparent)]
    Tls(#[from] tls::Error),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("writing the CA to {path}: {source}")]
    WriteCa {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("waiting for a shutdown signal: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Stopped(#[from] runtime::Stopped),
}

/// Time a client has to send a request body.
const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// Runs until SIGTERM or SIGINT (then `Ok`) or a failure.
pub async fn run(args: Args) -> Result<(), Error> {
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    run_until(args, shutdown).await
}

/// As [`run`], stopping when `shutdown` is cancelled.
pub async fn run_until(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    match args.mode {
        Mode::Extender => run_extender(args, shutdown).await,
        Mode::Scheduler => run_scheduler(args, shutdown).await,
    }
}

fn max_age(args: &Args) -> Option<jiff::SignedDuration> {
    (!args.shape_max_age.is_zero())
        .then(|| jiff::SignedDuration::from_secs(args.shape_max_age.as_secs() as i64))
}

/// The extender: HTTPS verbs over watch caches.
async fn run_extender(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    // Its replicas all serve and write nothing: no election, and a user agent without the
    // replica.
    let mut daemon = Daemon::new("multi-scheduler", shutdown)
        .product("tensile-multi-scheduler")
        .client_options(args.client.options())
        .acting("serving; virtual nodes, bound pods and exclusions synced");
    let client = daemon.client(args.kubeconfig.as_deref()).await?;
    let (tls_config, reload) = serving_tls(&args)?;
    let addr = SocketAddr::new(args.address, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    daemon.bind_admin(args.admin.admin_addr).await?;
    let metrics = metrics::Metrics::new(daemon.registry());
    let mut running = daemon.start();
    if let Some(reload) = reload {
        reload.spawn(&mut running.tasks);
    }
    compose_extender(&args, client, (listener, tls_config), metrics, &mut running);
    Ok(running.run().await?)
}

/// The extender's caches and HTTPS server (on `listener`, with `tls_config`), handed to
/// `running`'s tasks.
fn compose_extender(
    args: &Args,
    client: kube::Client,
    (listener, tls_config): (tokio::net::TcpListener, Arc<rustls::ServerConfig>),
    metrics: metrics::Metrics,
    running: &mut Running,
) {
    let tasks = &mut running.tasks;
    let changed = Arc::new(Notify::new());
    let (nodes, nodes_watch) = watched::<Node>(
        Api::all(client.clone()),
        watcher::Config::default().labels(&args.node_selector),
        &changed,
    );
    // Bound, non-terminal pods, summarised: what preempting some of them would free.
    let (pods, pods_watch) = watched_summaries::<Pod, BoundPod>(
        Api::all(client.clone()),
        watcher::Config::default().fields("spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"),
        BoundPod::of,
        &Arc::new(Notify::new()),
    );
    let location = args.exclusions_configmap.clone();
    let (exclusions_cache, exclusions, exclusions_watch) = exclusion::follow(
        Api::<ConfigMap>::namespaced(client, &location.namespace),
        &location.name,
    );
    let state = Arc::new(State {
        nodes: Arc::new(NodeStore(nodes.store().clone())),
        pods: Arc::new(BoundPodStore(pods.store().clone())),
        facts: FactsCache::default(),
        exclusions,
        max_age: max_age(args),
        score: args.score,
        metrics,
        max_body_bytes: args.max_body_bytes,
        body_deadline: BODY_DEADLINE,
    });
    tracing::info!(
        addr = %SocketAddr::new(args.address, args.port),
        node_selector = %args.node_selector,
        exclusions = %location,
        score = ?args.score,
        shape_max_age = ?args.shape_max_age,
        "serving the extender"
    );
    tasks.spawn("the node watch", nodes_watch);
    tasks.spawn("the bound pod watch", pods_watch);
    tasks.spawn("the exclusions watch", exclusions_watch);
    tasks.spawn(
        "the node facts clean-up",
        forget_deleted(state.clone(), nodes.clone(), changed),
    );
    let standing = running.standing.clone();
    // Not ready while the exclusion records cannot be read, and `/readyz` says why (the
    // ExclusionRecord CRD not installed, say).
    tasks.spawn(
        "the exclusion records on /readyz",
        exclusions_cache.clone().report_to(standing.clone(), None),
    );
    tasks.spawn("readiness", async move {
        nodes.synced().await;
        pods.synced().await;
        exclusions_cache.synced().await;
        standing.synced();
        futures::future::pending::<()>().await
    });
    tasks.spawn_graceful("the extender", move |stop| {
        server::serve_https(listener, tls_config, state, stop)
    });
}

/// The standalone scheduler: leader election, caches, and the scheduling loop.
async fn run_scheduler(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    let mut daemon = Daemon::new("multi-scheduler", shutdown)
        .product("tensile-multi-scheduler")
        .client_options(args.client.options())
        .elect(&args.leader)
        .map_err(Error::Flags)?
        .acting("scheduling");
    let replica = daemon.replica().to_owned();
    let client = daemon.client(args.kubeconfig.as_deref()).await?;
    daemon.bind_admin(args.admin.admin_addr).await?;
    let metrics = Arc::new(metrics::Metrics::new(daemon.registry()));
    // The caches fill on standby too; the loop schedules once this replica leads.
    let mut running = daemon.start();
    compose_scheduler(&args, client, replica, metrics, &mut running);
    Ok(running.run().await?)
}

/// The standalone scheduler's caches and loop, handed to `running`'s tasks.
fn compose_scheduler(
    args: &Args,
    client: kube::Client,
    replica: String,
    metrics: Arc<metrics::Metrics>,
    running: &mut Running,
) {
    let tasks = &mut running.tasks;
    let changed = Arc::new(Notify::new());
    // Every non-terminal pod: the pods to place and what is bound to each virtual node.
    let (pods, pods_watch) = watched::<Pod>(
        Api::all(client.clone()),
        watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed"),
        &changed,
    );
    let (nodes, nodes_watch) = watched::<Node>(
        Api::all(client.clone()),
        watcher::Config::default().labels(&args.node_selector),
        &changed,
    );
    let location = args.exclusions_configmap.clone();
    let (exclusions_cache, exclusions, exclusions_watch) = exclusion::follow(
        Api::<ConfigMap>::namespaced(client.clone(), &location.namespace),
        &location.name,
    );
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: args.scheduler_name.clone(),
            instance: Some(replica),
        },
    );
    let scheduler = scheduler::Scheduler {
        client,
        name: args.scheduler_name.clone(),
        pods: pods.clone(),
        nodes: nodes.clone(),
        exclusions,
        facts: FactsCache::default(),
        score: args.score,
        max_age: max_age(args),
        metrics,
        recorder,
        changed: changed.clone(),
    };
    tracing::info!(
        scheduler_name = %args.scheduler_name,
        node_selector = %args.node_selector,
        exclusions = %location,
        score = ?args.score,
        "scheduling"
    );
    {
        // Exclusion changes wake the loop too.
        let mut rx = scheduler.exclusions.clone();
        tasks.spawn("the exclusions wake-up", async move {
            while rx.changed().await.is_ok() {
                changed.notify_one();
            }
        });
    }
    tasks.spawn("the pod watch", pods_watch);
    tasks.spawn("the node watch", nodes_watch);
    tasks.spawn("the exclusions watch", exclusions_watch);
    let (standing, leads) = (running.standing.clone(), running.candidacy.clone());
    // Not ready while the exclusion records cannot be read, and `/readyz` says why (the
    // ExclusionRecord CRD not installed, say): a pod placed without them could go back to
    // a node that refused its workload.
    tasks.spawn(
        "the exclusion records on /readyz",
        exclusions_cache.clone().report_to(standing.clone(), None),
    );
    tasks.spawn_graceful("the scheduling loop", move |stop| async move {
        let synced = async {
            pods.synced().await;
            nodes.synced().await;
            exclusions_cache.synced().await;
        };
        if stop.run_until_cancelled(synced).await.is_none() {
            return;
        }
        standing.synced();
        if stop.run_until_cancelled(leads.leading()).await.is_none() {
            return;
        }
        scheduler.run(stop).await
    });
}

/// Drops the decoded shapes of deleted nodes as the watch shows the deletions.
async fn forget_deleted(state: Arc<State>, nodes: tensile_common::cache::Cache<Node>, changed: Arc<Notify>) {
    loop {
        changed.notified().await;
        state
            .facts
            .retain(|name| nodes.get(&ObjectRef::new(name)).is_some());
    }
}

/// The serving certificate: files reloaded on change (as the returned [`Reload`] says), or
/// generated (its CA written where asked).
fn serving_tls(args: &Args) -> Result<(Arc<rustls::ServerConfig>, Option<Reload>), Error> {
    let (resolver, reload) = match (&args.tls_cert_file, &args.tls_private_key_file) {
        (Some(cert), Some(key)) => {
            let resolver = tls::CertResolver::new(tls::load(cert, key)?);
            let reload = Reload {
                resolver: resolver.clone(),
                cert: cert.clone(),
                key: key.clone(),
                every: Duration::from_secs(args.tls_reload_seconds),
            };
            (resolver, Some(reload))
        }
        _ => {
            let generated = tls::self_signed(&args.self_signed_names)?;
            if let Some(path) = &args.self_signed_ca_file {
                std::fs::write(path, &generated.ca_pem).map_err(|source| Error::WriteCa {
                    path: path.clone(),
                    source,
                })?;
            }
            (tls::CertResolver::new(generated.key), None)
        }
    };
    Ok((tls::server_config(resolver)?, reload))
}

/// The certificate files the extender serves, checked `every` so often for a change.
struct Reload {
    resolver: Arc<tls::CertResolver>,
    cert: PathBuf,
    key: PathBuf,
    every: Duration,
}

impl Reload {
    fn spawn(self, tasks: &mut Supervisor) {
        let Reload {
            resolver,
            cert,
            key,
            every,
        } = self;
        tasks.spawn_graceful("the certificate reload", move |stop| {
            tls::reload(resolver, cert, key, every, stop)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn defaults_serve_an_extender_with_binpack_and_a_15_minute_shape_age() {
        let args = Args::try_parse_from(["multi-scheduler"]).unwrap();
        assert_eq!(args.mode, Mode::Extender);
        assert_eq!(args.score, Score::Binpack);
        assert_eq!(args.shape_max_age, Duration::from_secs(900));
        assert_eq!(args.port, 8443);
        assert_eq!(args.node_selector, "type=virtual-kubelet");
        assert_eq!(
            args.exclusions_configmap.to_string(),
            "kube-system/tensile-exclusions"
        );
        let args = Args::try_parse_from(["multi-scheduler", "--score=spread", "--shape-max-age=2m"]).unwrap();
        assert_eq!(args.score, Score::Spread);
        assert_eq!(args.shape_max_age, Duration::from_secs(120));
    }

    #[test]
    fn bad_flags_are_named() {
        for (flag, needle) in [
            ("--score=random", "random"),
            ("--shape-max-age=soon", "not a duration"),
            ("--tls-cert-file=/x", "tls-private-key-file"),
            ("--mode=both", "both"),
        ] {
            let err = Args::try_parse_from(["multi-scheduler", flag])
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{flag}: {err}");
        }
    }

    #[test]
    fn scheduler_mode_names_its_pods_and_may_elect_a_leader() {
        let args = Args::try_parse_from([
            "multi-scheduler",
            "--mode=scheduler",
            "--scheduler-name=tensile-standalone",
            "--leader-elect",
        ])
        .unwrap();
        assert_eq!(args.mode, Mode::Scheduler);
        assert_eq!(args.scheduler_name, "tensile-standalone");
        assert!(args.leader.leader_elect);
        let default = Args::try_parse_from(["multi-scheduler"]).unwrap();
        assert_eq!(default.scheduler_name, "tensile-scheduler");
        assert!(!default.leader.leader_elect);
    }

    #[test]
    fn the_shipped_scheduler_configuration_calls_the_verbs_this_server_serves() {
        let file = "scheduler-v1.yaml";
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config")
            .join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let config: serde_json::Value = serde_yaml::from_str(&text).unwrap();
        assert_eq!(config["apiVersion"], "kubescheduler.config.k8s.io/v1", "{file}");
        assert_eq!(config["kind"], "KubeSchedulerConfiguration");
        assert_eq!(config["profiles"][0]["schedulerName"], "tensile-scheduler");
        let extender = &config["extenders"][0];
        assert_eq!(extender["filterVerb"], "filter");
        assert_eq!(extender["prioritizeVerb"], "prioritize");
        assert_eq!(
            extender["preemptVerb"], "preempt",
            "{file}: preemption asks the extender"
        );
        assert_eq!(extender["nodeCacheCapable"], true);
        assert_eq!(extender["enableHTTPS"], true);
        assert_eq!(extender["ignorable"], false);
        assert!(extender["tlsConfig"]["caFile"].is_string());
        assert!(extender["bindVerb"].is_null(), "the default binder binds");
        let preemption_off = config["profiles"][0]["plugins"]["postFilter"]["disabled"]
            .as_array()
            .is_some_and(|d| d.iter().any(|p| p["name"] == "DefaultPreemption"));
        assert!(
            !preemption_off,
            "{file}: preemption stays on and asks the extender"
        );
    }
}
