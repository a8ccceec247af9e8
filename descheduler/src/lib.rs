//! descheduler: moves pods a lower cluster cannot place to another virtual node, and loses
//! none.
//!
//! The model: the upper scheduler sees a virtual node's aggregate free capacity, so it may
//! bind a pod to a lower cluster none of whose nodes fits it. The virtual node then shows
//! the lower refusal on the upper pod as `tensile.io/LowerPodScheduled=False` (reason
//! `Unschedulable`) while the pod stays Pending and holds the node's allocatable. Once that
//! refusal is older than `--unschedulable-threshold` (and the lower scheduler is not making
//! room for the pod: `tensile.io/LowerPodNominated`), the descheduler:
//!
//! 1. records, durably and shared between replicas, that the pod's workload (keyed by its
//!    controller's UID) should avoid that virtual node until `--exclusion-ttl` has passed
//!    ([`tensile_common::exclusion`], written by [`store`]); the webhook turns the record
//!    into a `kubernetes.io/hostname NotIn` requirement on the replacement, for the upper
//!    scheduler only;
//! 2. evicts the pod through the Eviction API with a UID precondition ([`tensile_common::evict`]), so its
//!    controller recreates it; a bare pod that opted in is replaced first, then evicted
//!    ([`bare`]).
//!
//! What qualifies and what to do is decided by pure functions ([`decide`], [`fit`]); the
//! loop ([`rounds`]) runs them on every pod or node change, when a refusal reaches the
//! threshold, and every `--descheduling-interval`, within caps that hold per interval.
//! `--dry-run` writes nothing and logs and counts what it would do. Until the exclusion
//! records are read (their CRD installed), the replica is not ready, `/readyz` says why, and
//! nothing moves.
//!
//! Only pods the suite is responsible for are touched: opted in with `--pod-label`, outside
//! `--exclude-namespaces` (the webhook's flags of the same names and defaults). Pods that a
//! Job tracks by finalizer move only when the Job ignores evictions ([`job`]); every
//! bare-pod move ends with one pod ([`pairs`]).

pub mod bare;
pub mod decide;
pub mod fit;
pub mod job;
pub mod metrics;
pub mod pairs;
pub mod rebalance;
pub mod rounds;
pub mod store;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;
use tensile_common::admin::{self, AdminArgs};
use tensile_common::cache::{Cache, watched};
use tensile_common::exclusion::{self, Location};
use tensile_common::kubeconfig::{self, ClientArgs, ClientOptions};
use tensile_common::leader::{self, LeaderArgs};
use tensile_common::runtime::{self, CancellationToken, CrashPoints, Daemon, Running, Supervisor};
use tensile_common::telemetry::LogArgs;
use tokio::sync::{Notify, watch};

use crate::decide::{BarePods, Settings};
use crate::rounds::{Caps, Descheduler};

/// Command-line flags (each also read from the environment): kubernetes-sigs/descheduler's
/// and tensile-kube's names where they exist, then what this model adds, then the shared
/// runtime's (clients, leader election, admin endpoint, logging).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "descheduler",
    version,
    about = "Moves pods a lower cluster cannot place to another virtual node"
)]
pub struct Args {
    /// Kubeconfig of the upper cluster; without it, the pod's service account (in-cluster).
    #[arg(long, env = "TENSILE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Time between two rounds when nothing changes (`30s`, `1m`, or seconds). Rounds also
    /// run when a pod or node changes and when a refusal reaches the threshold.
    #[arg(long = "descheduling-interval", env = "TENSILE_DESCHEDULING_INTERVAL",
          default_value = "30s", value_parser = parse_seconds)]
    pub descheduling_interval: Duration,
    /// Decide and log, count as `result="dry_run"`, but write nothing (no eviction, record,
    /// pod or event).
    #[arg(long = "dry-run", env = "TENSILE_DRY_RUN")]
    pub dry_run: bool,
    /// Pods moved off one virtual node per round (0: no limit).
    #[arg(
        long = "max-pods-to-evict-per-node",
        env = "TENSILE_MAX_PODS_TO_EVICT_PER_NODE",
        default_value_t = 0
    )]
    pub max_per_node: u32,
    /// Pods moved per namespace per round (0: no limit).
    #[arg(
        long = "max-pods-to-evict-per-namespace",
        env = "TENSILE_MAX_PODS_TO_EVICT_PER_NAMESPACE",
        default_value_t = 0
    )]
    pub max_per_namespace: u32,
    /// Pods moved per round in total (0: no limit).
    #[arg(
        long = "max-pods-to-evict-total",
        env = "TENSILE_MAX_PODS_TO_EVICT_TOTAL",
        default_value_t = 0
    )]
    pub max_total: u32,
    /// Pods of one workload moved per round (0: no limit). Disruption budgets never protect
    /// Pending pods, so this is the workload's protection.
    #[arg(
        long = "max-pods-to-evict-per-owner",
        env = "TENSILE_MAX_PODS_TO_EVICT_PER_OWNER",
        default_value_t = 5
    )]
    pub max_per_owner: u32,
    /// Label selector of the virtual nodes.
    #[arg(
        long = "node-selector",
        env = "TENSILE_NODE_SELECTOR",
        default_value = "type=virtual-kubelet"
    )]
    pub node_selector: String,
    /// How long the lower refusal must have lasted before the pod moves (`60s`, `2m`, or
    /// seconds); measured from the condition's last transition, not the pod's creation.
    #[arg(long = "unschedulable-threshold", env = "TENSILE_UNSCHEDULABLE_THRESHOLD",
          default_value = "60", value_parser = parse_seconds)]
    pub unschedulable_threshold: Duration,
    /// `tensile.io/LowerPodScheduled` reasons that make a pod a candidate (comma-separated).
    #[arg(
        long = "unschedulable-reasons",
        env = "TENSILE_UNSCHEDULABLE_REASONS",
        value_delimiter = ',',
        default_value = "Unschedulable"
    )]
    pub unschedulable_reasons: Vec<String>,
    /// How long a virtual node that refused a workload stays excluded for it (`10m`, or
    /// seconds).
    #[arg(long = "exclusion-ttl", env = "TENSILE_EXCLUSION_TTL", default_value = "600",
          value_parser = parse_seconds)]
    pub exclusion_ttl: Duration,
    /// Virtual nodes a workload may be excluded from within the TTL; one more refusal and
    /// the descheduler stops moving it, with a `DeschedulingExhausted` warning.
    #[arg(long = "max-moves-per-owner", env = "TENSILE_MAX_MOVES_PER_OWNER", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_moves_per_owner: u32,
    /// A virtual node's capacity shape older than this says nothing about where a pod fits
    /// (`15m`, or seconds; 0 trusts any age): the multi-scheduler's `--shape-max-age`.
    #[arg(long = "shape-max-age", env = "TENSILE_SHAPE_MAX_AGE", default_value = "15m",
          value_parser = parse_seconds)]
    pub shape_max_age: Duration,
    /// Label (`key=value`) that opts a pod in; only such pods are moved. The webhook's
    /// `--pod-label`: set both alike.
    #[arg(long = "pod-label", env = "TENSILE_POD_LABEL", default_value = "virtual-pod=true",
          value_parser = tensile_common::names::parse_label)]
    pub pod_label: (String, String),
    /// Namespaces whose pods are never moved (comma-separated). The webhook's
    /// `--exclude-namespaces`: set both alike, since a pod the webhook does not serve gets
    /// no exclusion and its replacement would land on the same node again.
    #[arg(
        long = "exclude-namespaces",
        env = "TENSILE_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub exclude_namespaces: Vec<String>,
    /// Which bare pods are moved, each by creating its replacement: `off` (then the
    /// descheduler never creates a pod), `annotated` (those with
    /// `descheduler.alpha.kubernetes.io/evict`), or `all`.
    #[arg(long = "bare-pods", env = "TENSILE_BARE_PODS", value_enum, default_value_t = BarePods::Annotated)]
    pub bare_pods: BarePods,
    /// The same as `--bare-pods=all` (the earlier flag).
    #[arg(
        long = "recreate-bare-pods",
        env = "TENSILE_RECREATE_BARE_PODS",
        hide = true,
        conflicts_with = "bare_pods"
    )]
    pub recreate_bare_pods: bool,
    /// Move pods of the `system-cluster-critical` and `system-node-critical` classes too.
    #[arg(
        long = "evict-system-critical-pods",
        env = "TENSILE_EVICT_SYSTEM_CRITICAL_PODS"
    )]
    pub evict_system_critical_pods: bool,
    /// Where the exclusion records live (`namespace/name`): ExclusionRecord objects in that
    /// namespace, and the old ConfigMap of that name, whose records are still honoured and
    /// which is deleted once none is in force. The webhook reads the same.
    #[arg(long = "exclusions-configmap", env = "TENSILE_EXCLUSIONS_CONFIGMAP",
          default_value = exclusion::DEFAULT_LOCATION)]
    pub exclusions_configmap: Location,
    /// Also move running pods back where their own constraints want them once a virtual
    /// node has room again (topology spread, preferred node affinity): failback after a
    /// lower cluster recovers. See "Failback and rebalancing" in docs/descheduler.md.
    #[arg(long = "rebalance", env = "TENSILE_REBALANCE")]
    pub rebalance: bool,
    /// Pods of one workload that may be unavailable when rebalancing evicts one more.
    #[arg(long = "rebalance-max-unavailable", env = "TENSILE_REBALANCE_MAX_UNAVAILABLE",
          default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rebalance_max_unavailable: u32,
    /// How long a virtual node must have been Ready before pods move back to it (`60s`,
    /// `2m`, or seconds): a node that flaps never pulls pods.
    #[arg(long = "rebalance-stabilization", env = "TENSILE_REBALANCE_STABILIZATION",
          default_value = "60", value_parser = parse_seconds)]
    pub rebalance_stabilization: Duration,
    /// How long a rebalanced workload is left alone (`5m`, or seconds).
    #[arg(long = "rebalance-cooldown", env = "TENSILE_REBALANCE_COOLDOWN",
          default_value = "300", value_parser = parse_seconds)]
    pub rebalance_cooldown: Duration,
    /// Pods rebalancing evicts per round.
    #[arg(long = "rebalance-max-per-round", env = "TENSILE_REBALANCE_MAX_PER_ROUND",
          default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub rebalance_max_per_round: u32,
    /// Workloads rebalancing moves at once (each one pod at a time).
    #[arg(long = "rebalance-max-owners", env = "TENSILE_REBALANCE_MAX_OWNERS",
          default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rebalance_max_owners: u32,
    /// For tests only: abort the process right after this step of a bare-pod move, as
    /// `kill -9` would, to prove a restart finishes the move exactly once.
    #[arg(long = "crash-at", env = "TENSILE_CRASH_AT", hide = true, value_enum)]
    pub crash_at: Option<bare::Step>,
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(flatten)]
    pub leader: LeaderArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Seconds as a plain number, or a duration as client-go's flags write it (`30s`, `1m30s`).
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(n) => Ok(Duration::from_secs(n)),
        Err(_) => leader::parse_duration(s),
    }
}

impl Args {
    /// The decision's settings.
    pub fn settings(&self) -> Settings {
        Settings {
            threshold: self.unschedulable_threshold,
            reasons: self
                .unschedulable_reasons
                .iter()
                .map(|r| r.trim().to_owned())
                .filter(|r| !r.is_empty())
                .collect(),
            bare_pods: if self.recreate_bare_pods {
                BarePods::All
            } else {
                self.bare_pods
            },
            evict_system_critical: self.evict_system_critical_pods,
            max_moves_per_owner: self.max_moves_per_owner,
            exclusion_ttl: self.exclusion_ttl,
            shape_max_age: (!self.shape_max_age.is_zero())
                .then(|| jiff::SignedDuration::from_secs(self.shape_max_age.as_secs() as i64)),
            pod_label: self.pod_label.clone(),
            excluded_namespaces: self
                .exclude_namespaces
                .iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect(),
        }
    }

    /// Rebalancing's settings (`None`: off).
    pub fn rebalancing(&self) -> Option<rebalance::Settings> {
        self.rebalance.then_some(rebalance::Settings {
            max_unavailable: self.rebalance_max_unavailable,
            stabilization: self.rebalance_stabilization,
            cooldown: self.rebalance_cooldown,
            max_per_round: self.rebalance_max_per_round,
            max_owners: self.rebalance_max_owners,
        })
    }

    pub fn caps(&self) -> Caps {
        Caps {
            total: self.max_total,
            per_namespace: self.max_per_namespace,
            per_node: self.max_per_node,
            per_owner: self.max_per_owner,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Kubeconfig(#[from] kubeconfig::Error),
    #[error("{0}")]
    Admin(#[from] admin::Error),
    #[error("invalid flags: {0}")]
    Flags(String),
    #[error("waiting for a shutdown signal: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Stopped(#[from] runtime::Stopped),
}

/// Runs until SIGTERM or SIGINT (then `Ok`, after the round in progress) or a failure.
pub async fn run(args: Args) -> Result<(), Error> {
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    run_until(args, shutdown).await
}

/// As [`run`], stopping when `shutdown` is cancelled.
pub async fn run_until(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    if args.descheduling_interval.is_zero() {
        return Err(Error::Flags("--descheduling-interval must be positive".into()));
    }
    let mut daemon = Daemon::new("descheduler", shutdown)
        .product("tensile-descheduler")
        .client_options(ClientOptions {
            // A 429 from the Eviction API is a disruption budget's (or the apiserver's) "not
            // now", which a round acts on: counted as `limited`, the workload tried later and
            // others moved meanwhile. Repeated inside the client it only ran into the deadline.
            server_retry: false,
            ..args.client.options()
        })
        .elect(&args.leader)
        .map_err(Error::Flags)?;
    if args.dry_run {
        daemon = daemon.note("dry run");
    }
    let client = daemon.client(args.kubeconfig.as_deref()).await?;
    daemon.bind_admin(args.admin.admin_addr).await?;
    let metrics = Arc::new(metrics::Metrics::new(daemon.registry()));
    let crash_at = daemon.crash_points(args.crash_at);
    let mut running = daemon.start();
    compose(&args, client, metrics, crash_at, &mut running);
    Ok(running.run().await?)
}

/// The caches a descheduler decides from.
struct Caches {
    /// Pending, opted-in pods: the candidates.
    pods: Cache<Pod>,
    /// With `--rebalance`, the opted-in pods that run.
    running: Option<Cache<Pod>>,
    replacements: Cache<Pod>,
    nodes: Cache<Node>,
    exclusions: exclusion::Synced,
}

impl Caches {
    /// The caches, their watches handed to `tasks` (they fill on standby too, so a replica
    /// that takes over decides from current ones); and the exclusion records as they are.
    fn watch(
        args: &Args,
        client: &kube::Client,
        changed: &Arc<Notify>,
        tasks: &mut Supervisor,
    ) -> (Self, watch::Receiver<Arc<exclusion::Exclusions>>) {
        // Candidates are Pending and opted in; the watch never carries the cluster's running
        // pods, nor pods the suite does not serve.
        let (key, value) = &args.pod_label;
        let opted_in = |phase: &str| {
            watcher::Config::default()
                .fields(&format!("status.phase={phase}"))
                .labels(&format!("{key}={value}"))
        };
        let (pods, pods_watch) = watched::<Pod>(Api::all(client.clone()), opted_in("Pending"), changed);
        tasks.spawn("the pod watch", pods_watch);
        // Bare pods' replacements in any phase: each pair must end with one pod.
        let (replacements, replacements_watch) = watched::<Pod>(
            Api::all(client.clone()),
            watcher::Config::default().labels(tensile_common::names::REPLACES),
            changed,
        );
        tasks.spawn("the replacements watch", replacements_watch);
        // With --rebalance, the opted-in pods that run too: where they run is what is balanced.
        let running = args.rebalance.then(|| {
            let (cache, watch) = watched::<Pod>(Api::all(client.clone()), opted_in("Running"), changed);
            tasks.spawn("the running pods watch", watch);
            cache
        });
        let (nodes, nodes_watch) = watched::<Node>(
            Api::all(client.clone()),
            watcher::Config::default().labels(&args.node_selector),
            changed,
        );
        tasks.spawn("the node watch", nodes_watch);
        let location = &args.exclusions_configmap;
        let (exclusions, seen, exclusions_watch) = exclusion::follow(
            Api::<ConfigMap>::namespaced(client.clone(), &location.namespace),
            &location.name,
        );
        tasks.spawn("the exclusions watch", exclusions_watch);
        let caches = Caches {
            pods,
            running,
            replacements,
            nodes,
            exclusions,
        };
        (caches, seen)
    }

    async fn synced(&self) {
        self.pods.synced().await;
        self.replacements.synced().await;
        self.nodes.synced().await;
        self.exclusions.synced().await;
        if let Some(running) = &self.running {
            running.synced().await;
        }
    }
}

/// Builds the caches and the loop of a descheduler and hands them to `running`'s tasks.
/// The loop runs once this replica leads.
fn compose(
    args: &Args,
    client: kube::Client,
    metrics: Arc<metrics::Metrics>,
    crash_at: CrashPoints<bare::Step>,
    running: &mut Running,
) {
    let changed = Arc::new(Notify::new());
    let (caches, seen) = Caches::watch(args, &client, &changed, &mut running.tasks);
    let location = args.exclusions_configmap.clone();
    let store = store::Store::new(client.clone(), location.clone(), seen);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "tensile-descheduler".into(),
            instance: Some(leader::default_identity()),
        },
    );
    let mut descheduler = Descheduler::new(
        client,
        caches.pods.clone(),
        caches.replacements.clone(),
        caches.nodes.clone(),
        store,
        args.settings(),
        args.caps(),
        args.dry_run,
        args.descheduling_interval,
        metrics,
        recorder,
        changed,
    );
    descheduler.crash_at = crash_at;
    if let (Some(cache), Some(settings)) = (&caches.running, args.rebalancing()) {
        descheduler.rebalancing = Some(rounds::Rebalancing::new(cache.clone(), settings));
    }
    tracing::info!(
        node_selector = %args.node_selector,
        exclusions = %location,
        dry_run = args.dry_run,
        threshold = ?args.unschedulable_threshold,
        "starting"
    );
    let (standing, candidacy) = (running.standing.clone(), running.candidacy.clone());
    // Not ready while the records cannot be read, and `/readyz` says why (the
    // ExclusionRecord CRD not installed, say): without them a move could send a pod back to
    // a node that refused it, so nothing moves until they are read.
    let note = args.dry_run.then(|| "dry run".to_owned());
    running.tasks.spawn(
        "the exclusion records on /readyz",
        caches.exclusions.clone().report_to(standing.clone(), note),
    );
    running
        .tasks
        .spawn_graceful("the descheduling loop", move |stop| async move {
            if stop.run_until_cancelled(caches.synced()).await.is_none() {
                return;
            }
            standing.synced();
            if stop.run_until_cancelled(candidacy.leading()).await.is_none() {
                return;
            }
            descheduler.run(stop).await
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn bare_pods_are_off_annotated_or_all_and_the_earlier_flag_cannot_contradict_it() {
        let parse = |extra: &[&str]| Args::try_parse_from([&["descheduler"][..], extra].concat());
        assert_eq!(parse(&[]).unwrap().settings().bare_pods, BarePods::Annotated);
        assert_eq!(
            parse(&["--bare-pods=off"]).unwrap().settings().bare_pods,
            BarePods::Off
        );
        assert_eq!(
            parse(&["--bare-pods=all"]).unwrap().settings().bare_pods,
            BarePods::All
        );
        let both = parse(&["--bare-pods=off", "--recreate-bare-pods"]).unwrap_err();
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert!(parse(&["--bare-pods=some"]).is_err());
    }

    #[test]
    fn flags_keep_the_names_operators_know_and_read_seconds_or_durations() {
        let args = Args::try_parse_from([
            "descheduler",
            "--descheduling-interval=10s",
            "--dry-run",
            "--max-pods-to-evict-per-node=2",
            "--max-pods-to-evict-per-namespace=3",
            "--max-pods-to-evict-total=4",
            "--max-pods-to-evict-per-owner=1",
            "--node-selector=type=virtual-kubelet,region=eu",
            "--unschedulable-threshold=90",
            "--exclusion-ttl=5m",
            "--max-moves-per-owner=2",
            "--recreate-bare-pods",
            "--exclusions-configmap=tensile/exclusions",
            "--leader-elect",
            "--pod-label=tensile=yes",
            "--exclude-namespaces=kube-system,tensile",
        ])
        .unwrap();
        assert_eq!(args.descheduling_interval, Duration::from_secs(10));
        assert!(args.dry_run && args.recreate_bare_pods && args.leader.leader_elect);
        let s = args.settings();
        assert_eq!(s.bare_pods, BarePods::All, "the earlier flag is --bare-pods=all");
        assert_eq!(s.threshold, Duration::from_secs(90));
        assert_eq!(s.exclusion_ttl, Duration::from_secs(300));
        assert_eq!(s.max_moves_per_owner, 2);
        let c = args.caps();
        assert_eq!((c.per_node, c.per_namespace, c.total, c.per_owner), (2, 3, 4, 1));
        assert_eq!(args.exclusions_configmap.to_string(), "tensile/exclusions");
        assert_eq!(s.pod_label, ("tensile".to_owned(), "yes".to_owned()));
        assert_eq!(
            s.excluded_namespaces.iter().collect::<Vec<_>>(),
            ["kube-system", "tensile"]
        );
    }

    #[test]
    fn defaults_follow_the_issue() {
        let args = Args::try_parse_from(["descheduler"]).unwrap();
        let s = args.settings();
        assert_eq!(s.threshold, Duration::from_secs(60));
        assert_eq!(s.exclusion_ttl, Duration::from_secs(600));
        assert_eq!(s.reasons, vec!["Unschedulable"]);
        assert_eq!(args.caps().per_owner, 5);
        assert_eq!(
            args.exclusions_configmap.to_string(),
            "kube-system/tensile-exclusions"
        );
        assert!(!args.dry_run);
        // The webhook's defaults: the same pods are opted in, the same namespaces left out.
        assert_eq!(s.pod_label, ("virtual-pod".to_owned(), "true".to_owned()));
        assert_eq!(s.excluded_namespaces.iter().collect::<Vec<_>>(), ["kube-system"]);
    }

    #[test]
    fn rebalancing_is_off_unless_asked_and_reads_its_budget() {
        let args = Args::try_parse_from(["descheduler"]).unwrap();
        assert!(args.rebalancing().is_none());
        let args = Args::try_parse_from([
            "descheduler",
            "--rebalance",
            "--rebalance-stabilization=2m",
            "--rebalance-cooldown=10m",
            "--rebalance-max-unavailable=2",
            "--rebalance-max-per-round=3",
            "--rebalance-max-owners=4",
        ])
        .unwrap();
        let r = args.rebalancing().unwrap();
        assert_eq!(r.stabilization, Duration::from_secs(120));
        assert_eq!(r.cooldown, Duration::from_secs(600));
        assert_eq!((r.max_unavailable, r.max_per_round, r.max_owners), (2, 3, 4));
        let d = Args::try_parse_from(["descheduler", "--rebalance"])
            .unwrap()
            .rebalancing()
            .unwrap();
        assert_eq!(d.stabilization, Duration::from_secs(60));
        assert_eq!(d.cooldown, Duration::from_secs(300));
        assert_eq!((d.max_unavailable, d.max_per_round, d.max_owners), (1, 5, 1));
        assert!(Args::try_parse_from(["descheduler", "--rebalance-max-unavailable=0"]).is_err());
    }

    #[test]
    fn bad_flags_are_named() {
        for (flag, needle) in [
            ("--max-moves-per-owner=0", "max-moves-per-owner"),
            ("--exclusion-ttl=soon", "not a duration"),
            ("--exclusions-configmap=nope", "namespace/name"),
            ("--pod-label=virtual-pod", "key=value"),
        ] {
            let err = Args::try_parse_from(["descheduler", flag])
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{flag}: {err}");
        }
    }
}
