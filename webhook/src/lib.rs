//! webhook: the mutating admission webhook that keeps lower-cluster constraints for the
//! lower cluster.
//!
//! Model: a pod that opts in (label `virtual-pod=true`) describes, through its nodeSelector,
//! required node affinity and tolerations, nodes of a lower cluster that the upper scheduler
//! cannot see. On CREATE the webhook moves those into the `clusterSelector` stash annotation
//! ([`tensile_common::stash`]), keeps the keys named in `--ignore-selector-keys` upstream
//! (they choose the cluster), and gives the upper pod what it needs to land on a virtual
//! node: a toleration for the virtual node taint, a requirement for the virtual node label,
//! finite not-ready/unreachable tolerations so it fails over when a lower cluster is lost,
//! and a pin to the virtual node its bound PVC selected. When the descheduler recorded that
//! the pod's workload must avoid some virtual nodes (`--exclusions-configmap`, keyed by the
//! controller's UID), every upper node-affinity term also gets `kubernetes.io/hostname
//! NotIn` those nodes, after the split, so the exclusion steers the upper scheduler and
//! never enters the stash. virtual-node restores the stash below. With
//! `--job-disruption-rule`, an opted-in Job (its pod template carries the label) gets a
//! `podFailurePolicy` rule ignoring `DisruptionTarget` at CREATE ([`job`]), so the
//! descheduler may move its pods without costing it a failure.
//!
//! [`mutate::mutate`] is pure (review in, response out); [`server`] adds HTTPS, limits and
//! metrics; [`tensile_common::tls`] and [`ca_bundle`] handle the certificate. Every other pod, and every
//! pod already stashed, passes unchanged.

pub mod ca_bundle;
pub mod ca_secret;
pub mod job;
pub mod metrics;
pub mod mutate;
pub mod outcome;
pub mod policy;
pub mod raw;
pub mod review;
pub mod server;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tensile_common::runtime::{self, Daemon};
use tensile_common::tls;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use mutate::{ClaimNodes, ExcludedNodes, NoClaims, NoExclusions, mutate};
pub use outcome::{Outcome, Verdict};
pub use policy::{Label, Policy, VirtualNodeConstraint};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] tensile_common::tls::Error),
    #[error(transparent)]
    Admin(#[from] tensile_common::admin::Error),
    #[error(transparent)]
    Kubeconfig(#[from] tensile_common::kubeconfig::Error),
    #[error("no Kubernetes client: {0}")]
    Client(String),
    #[error("invalid flags: {0}")]
    Flags(String),
    #[error(transparent)]
    CaSecret(#[from] ca_secret::Error),
    #[error("waiting for a shutdown signal: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Stopped(#[from] runtime::Stopped),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Command-line flags (tensile-kube's `--address`/`--port`/`--tls-*` spellings kept).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "webhook",
    version,
    about = "Mutating admission webhook that stashes lower-cluster constraints"
)]
pub struct Args {
    /// Address to serve HTTPS on.
    #[arg(long, env = "WEBHOOK_ADDRESS", default_value = "0.0.0.0")]
    pub address: IpAddr,
    /// Port to serve HTTPS on (`/mutate`, `/healthz`, `/readyz`).
    #[arg(long, env = "WEBHOOK_PORT", default_value_t = 8443)]
    pub port: u16,
    #[command(flatten)]
    pub admin: tensile_common::admin::AdminArgs,
    /// Serving certificate (PEM); reloaded when it changes. Without it a certificate is
    /// generated at start.
    #[arg(long, env = "WEBHOOK_TLS_CERT_FILE", requires = "tls_private_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key of `--tls-cert-file` (PEM).
    #[arg(long, env = "WEBHOOK_TLS_PRIVATE_KEY_FILE", requires = "tls_cert_file")]
    pub tls_private_key_file: Option<PathBuf>,
    /// How often the certificate files are checked for a change, in seconds.
    #[arg(long, env = "WEBHOOK_TLS_RELOAD_SECONDS", default_value_t = 5)]
    pub tls_reload_seconds: u64,
    /// DNS names and IPs of the generated certificate (used without `--tls-cert-file`).
    #[arg(
        long,
        env = "WEBHOOK_SELF_SIGNED_NAMES",
        value_delimiter = ',',
        default_value = "localhost,127.0.0.1"
    )]
    pub self_signed_names: Vec<String>,
    /// Secret (`namespace/name`) holding the CA that signs the generated certificate, shared
    /// by every replica (created with a new CA when missing), so the `caBundle` verifies all
    /// of them. Without it each replica makes its own CA: run one replica only.
    #[arg(long, env = "WEBHOOK_CA_SECRET")]
    pub ca_secret: Option<ca_secret::SecretRef>,
    /// MutatingWebhookConfiguration whose webhooks get the generated CA as `caBundle`.
    #[arg(long, env = "WEBHOOK_CONFIG_NAME")]
    pub webhook_config_name: Option<String>,
    /// Kubeconfig for reading PVCs and writing the caBundle; in-cluster config without it.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Label (`key=value`) that opts a pod in.
    #[arg(long, env = "WEBHOOK_POD_LABEL", default_value = "virtual-pod=true")]
    pub pod_label: Label,
    /// Namespaces whose pods are never mutated.
    #[arg(
        long,
        env = "WEBHOOK_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub exclude_namespaces: Vec<String>,
    /// nodeSelector / node-affinity keys that stay on the upper pod to steer the choice of
    /// cluster (for example a label every virtual node of one region carries).
    #[arg(long, env = "WEBHOOK_IGNORE_SELECTOR_KEYS", value_delimiter = ',')]
    pub ignore_selector_keys: Vec<String>,
    /// The label (`key=value`) of virtual nodes, required of the upper pod.
    #[arg(
        long,
        env = "WEBHOOK_VIRTUAL_NODE_LABEL",
        default_value = "type=virtual-kubelet"
    )]
    pub virtual_node_label: Label,
    /// How the upper pod is kept on virtual nodes.
    #[arg(long, env = "WEBHOOK_VIRTUAL_NODE_CONSTRAINT", value_enum, default_value_t = VirtualNodeConstraint::Affinity)]
    pub virtual_node_constraint: VirtualNodeConstraint,
    /// `tolerationSeconds` for `node.kubernetes.io/not-ready` on the upper pod.
    #[arg(long, env = "WEBHOOK_NOT_READY_TOLERATION_SECONDS", default_value_t = 300)]
    pub not_ready_toleration_seconds: i64,
    /// `tolerationSeconds` for `node.kubernetes.io/unreachable` on the upper pod.
    #[arg(long, env = "WEBHOOK_UNREACHABLE_TOLERATION_SECONDS", default_value_t = 300)]
    pub unreachable_toleration_seconds: i64,
    /// A secret (at least 32 bytes) to sign every stash with, named by the file's name (the key
    /// id every signature carries); virtual nodes holding a key of that id (their
    /// `--stash-key-file`) apply only stashes signed for their pod.
    #[arg(long, env = "WEBHOOK_STASH_KEY_FILE")]
    pub stash_key_file: Option<PathBuf>,
    /// Largest request body accepted at `/mutate`.
    #[arg(long, env = "WEBHOOK_MAX_BODY_BYTES", default_value_t = 6 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Open HTTPS connections at most; at the cap the longest-idle one makes room.
    #[arg(long, env = "WEBHOOK_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Seconds an HTTPS connection may stay open with no request in progress.
    #[arg(long = "idle-timeout-seconds", env = "WEBHOOK_IDLE_TIMEOUT_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_seconds: u64,
    /// How long a PVC read may take before the pod is admitted without a volume pin, in ms.
    #[arg(long, env = "WEBHOOK_PVC_TIMEOUT_MS", default_value_t = 2000)]
    pub pvc_timeout_ms: u64,
    /// Where the descheduler's exclusion records live (`namespace/name`: ExclusionRecord
    /// objects in that namespace, and the old ConfigMap of that name): a pod whose
    /// controller has a record gets `kubernetes.io/hostname NotIn` the excluded virtual nodes.
    #[arg(long, env = "WEBHOOK_EXCLUSIONS_CONFIGMAP",
          default_value = tensile_common::exclusion::DEFAULT_LOCATION)]
    pub exclusions_configmap: tensile_common::exclusion::Location,
    /// The `schedulerName` given to opted-in pods at CREATE (for example `tensile-scheduler`,
    /// the multi-scheduler's); pods that name a scheduler other than `default-scheduler` keep
    /// theirs. Unset: schedulerName is left alone.
    #[arg(long, env = "WEBHOOK_SCHEDULER_NAME", value_parser = scheduler_name)]
    pub scheduler_name: Option<String>,
    /// Give every opted-in Job (its pod template carries `--pod-label`) the rule
    /// `{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}` first in its
    /// `spec.podFailurePolicy` at CREATE, so the descheduler may move its pods without a
    /// failure counting against `backoffLimit`. The registration must send Jobs (the chart's
    /// `webhook.jobDisruptionRule`).
    #[arg(long, env = "WEBHOOK_JOB_DISRUPTION_RULE")]
    pub job_disruption_rule: bool,
    #[command(flatten)]
    pub client: tensile_common::kubeconfig::ClientArgs,
    #[command(flatten)]
    pub log: tensile_common::telemetry::LogArgs,
}

impl Args {
    pub fn policy(&self) -> Result<Policy> {
        for (flag, secs) in [
            (
                "--not-ready-toleration-seconds",
                self.not_ready_toleration_seconds,
            ),
            (
                "--unreachable-toleration-seconds",
                self.unreachable_toleration_seconds,
            ),
        ] {
            if secs < 0 {
                return Err(Error::Flags(format!("{flag} must not be negative, got {secs}")));
            }
        }
        let set = |v: &[String]| -> BTreeSet<String> {
            v.iter()
                .map(|s| s.trim())
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        };
        Ok(Policy {
            opt_in: self.pod_label.clone(),
            excluded_namespaces: set(&self.exclude_namespaces),
            ignore_selector_keys: set(&self.ignore_selector_keys),
            virtual_node_label: self.virtual_node_label.clone(),
            virtual_node_constraint: self.virtual_node_constraint,
            not_ready_seconds: self.not_ready_toleration_seconds,
            unreachable_seconds: self.unreachable_toleration_seconds,
            stash_key: match &self.stash_key_file {
                Some(path) => Some(std::sync::Arc::new(
                    tensile_common::stash::StashKey::from_file(path)
                        .map_err(|e| Error::Flags(e.to_string()))?,
                )),
                None => None,
            },
            scheduler_name: self.scheduler_name.clone(),
            job_disruption_rule: self.job_disruption_rule,
        })
    }
}

/// A scheduler name is a DNS-1123 subdomain, as the apiserver validates `spec.schedulerName`;
/// checked at start so a typo fails the daemon, not every pod it admits.
fn scheduler_name(s: &str) -> std::result::Result<String, String> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if s.len() <= 253 && s.split('.').all(label_ok) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a valid scheduler name (lowercase letters, digits, '-' and '.', at most 253 characters)"
        ))
    }
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum Certificates {
    /// PEM files, reloaded when they change.
    Files {
        cert: PathBuf,
        key: PathBuf,
        reload_every: Duration,
    },
    /// Generated at start for these names; its CA goes into the registration's caBundle.
    SelfSigned { names: Vec<String> },
    /// Generated at start for these names, signed by the CA kept in Secret `secret` (made
    /// when missing): every replica given the same Secret serves under one CA.
    SharedCa {
        names: Vec<String>,
        secret: ca_secret::SecretRef,
    },
}

/// Everything a running webhook needs (the library form of [`Args`]).
#[derive(Clone)]
pub struct Options {
    pub address: SocketAddr,
    /// `None`: no admin port.
    pub admin_address: Option<SocketAddr>,
    pub policy: Policy,
    pub certificates: Certificates,
    /// Registration to keep the generated CA in (self-signed certificates only).
    pub webhook_config_name: Option<String>,
    /// For PVC reads and the caBundle; `None` disables both.
    pub client: Option<kube::Client>,
    pub max_body_bytes: usize,
    /// Connection cap and deadlines of the HTTPS port.
    pub limits: tensile_common::serve::Limits,
    pub pvc_timeout: Duration,
    /// Where the descheduler's exclusion records live, watched with `client`; `None`: not read.
    pub exclusions: Option<tensile_common::exclusion::Location>,
}

impl Options {
    /// Defaults for serving on `address` with the given certificates and no client.
    pub fn new(address: SocketAddr, certificates: Certificates) -> Self {
        Self {
            address,
            admin_address: None,
            policy: Policy::default(),
            certificates,
            webhook_config_name: None,
            client: None,
            max_body_bytes: 6 * 1024 * 1024,
            limits: tensile_common::serve::Limits::default(),
            pvc_timeout: Duration::from_secs(2),
            exclusions: None,
        }
    }
}

/// A started webhook; dropping it does not stop it, [`Running::stop`] does.
pub struct Running {
    /// The HTTPS address actually bound (port 0 resolved).
    pub address: SocketAddr,
    pub admin_address: Option<SocketAddr>,
    /// The generated CA (PEM) in self-signed mode.
    pub ca_pem: Option<String>,
    pub state: Arc<server::State>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, closes open connections gracefully and waits for the tasks.
    pub async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// How long readiness waits for the exclusion records before serving without them.
const EXCLUSIONS_SYNC: Duration = Duration::from_secs(10);

/// Binds the ports and starts serving.
pub async fn start(options: Options) -> Result<Running> {
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let (resolver, ca_pem) = serving_certificate(&options, &stop, &mut tasks).await?;
    let tls_config = tls::server_config(resolver)?;
    // Ready at once unless the apiserver must first learn our CA.
    let must_write_bundle = ca_pem.is_some() && options.webhook_config_name.is_some();
    if must_write_bundle && options.client.is_none() {
        return Err(Error::Client(
            "writing the caBundle of the webhook registration needs a Kubernetes client".into(),
        ));
    }
    let ready = tensile_common::admin::Readiness::default();
    // Written once the apiserver trusts our certificate (at once when it need not learn it).
    let (bundle_written, bundle_seen) = tokio::sync::watch::channel(!must_write_bundle);
    let (exclusions, exclusions_cache) = match (&options.client, &options.exclusions) {
        (Some(client), Some(location)) => {
            let api = kube::Api::namespaced(client.clone(), &location.namespace);
            let (cache, seen, watch) = tensile_common::exclusion::follow(api, &location.name);
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                stop.run_until_cancelled(watch).await;
            }));
            (Some(seen), Some((cache, location.clone())))
        }
        _ => (None, None),
    };
    tasks.push(await_readiness(
        ready.clone(),
        exclusions_cache,
        bundle_seen,
        stop.clone(),
    ));
    let state = Arc::new(server::State {
        policy: options.policy,
        max_body_bytes: options.max_body_bytes,
        metrics: metrics::Metrics::default(),
        connections: Arc::default(),
        client: options.client.clone(),
        pvc_timeout: options.pvc_timeout,
        ready,
        exclusions,
    });
    let listener = bind(options.address).await?;
    let address = listener.local_addr().map_err(|source| Error::Bind {
        addr: options.address,
        source,
    })?;
    let (admin, admin_address) = bind_admin(options.admin_address).await?;
    tasks.push(tokio::spawn(server::serve_https(
        listener,
        tls_config,
        options.limits,
        state.clone(),
        stop.clone(),
    )));
    if let Some(admin) = admin {
        let (registry, ready, stop) = (state.metrics.registry(), state.ready.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tensile_common::admin::serve(admin, registry, ready) => {}
            }
        }));
    }
    if let (true, Some(client), Some(name), Some(ca)) = (
        must_write_bundle,
        options.client,
        options.webhook_config_name,
        ca_pem.clone(),
    ) {
        tasks.push(tokio::spawn(ca_bundle::keep(
            client,
            name,
            ca,
            Duration::from_secs(30),
            stop.clone(),
            move || {
                bundle_written.send_replace(true);
            },
        )));
    }
    tracing::info!(%address, admin = ?admin_address, "webhook serving");
    Ok(Running {
        address,
        admin_address,
        ca_pem,
        state,
        stop,
        tasks,
    })
}

/// The serving certificate, its CA when the apiserver must learn it, and (for files) the
/// task that reloads it when it changes.
async fn serving_certificate(
    options: &Options,
    stop: &CancellationToken,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Result<(Arc<tls::CertResolver>, Option<String>)> {
    Ok(match &options.certificates {
        Certificates::Files {
            cert,
            key,
            reload_every,
        } => {
            let resolver = tls::CertResolver::new(tls::load(cert, key)?);
            tasks.push(tokio::spawn(tls::reload(
                resolver.clone(),
                cert.clone(),
                key.clone(),
                *reload_every,
                stop.clone(),
            )));
            (resolver, None)
        }
        Certificates::SelfSigned { names } => {
            let generated = tls::self_signed(names)?;
            (tls::CertResolver::new(generated.key), Some(generated.ca_pem))
        }
        Certificates::SharedCa { names, secret } => {
            let client = options.client.clone().ok_or_else(|| {
                Error::Client(format!(
                    "reading the shared CA in Secret {secret} needs a Kubernetes client"
                ))
            })?;
            let ca = ca_secret::load_or_create(client, &secret.namespace, &secret.name).await?;
            (tls::CertResolver::new(ca.issue(names)?), Some(ca.cert_pem))
        }
    })
}

/// Ready when the certificate is trusted and the exclusion records are read, so that a
/// replica just started does not admit a moved pod's replacement without them.
///
/// Records that cannot be read (no permission; the `ExclusionRecord` CRD not installed, by
/// an upgrade that has not applied it yet or a binary run by hand) delay readiness by at
/// most [`EXCLUSIONS_SYNC`]; the webhook then serves without them, warns once and says why
/// in the `/readyz` body, until they are read (the watch retries on its own, a minute apart
/// at most, and the body turns to a plain `ok`). This is on purpose, unlike the
/// descheduler, which stays not ready: the registration's failurePolicy is Fail, so a
/// webhook that is never ready would refuse every opted-in pod, while one without the
/// records only loses the exclusions (the descheduler, not ready meanwhile, writes none).
fn await_readiness(
    ready: tensile_common::admin::Readiness,
    exclusions: Option<(
        tensile_common::exclusion::Synced,
        tensile_common::exclusion::Location,
    )>,
    mut bundle_seen: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let wait = async {
            let mut degraded = None;
            if let Some((cache, location)) = exclusions
                && tokio::time::timeout(EXCLUSIONS_SYNC, cache.synced())
                    .await
                    .is_err()
            {
                let why = cache.trouble().unwrap_or_else(|| {
                    format!("the exclusion records in {} are not read yet", location.namespace)
                });
                tracing::warn!(
                    namespace = %location.namespace,
                    "serving without the exclusion records after {EXCLUSIONS_SYNC:?}, until they are read: {why}"
                );
                degraded = Some((format!("serving without the exclusion records: {why}"), cache));
            }
            bundle_seen.wait_for(|written| *written).await.ok()?;
            Some(degraded)
        };
        match stop.run_until_cancelled(wait).await {
            Some(Some(Some((why, cache)))) => {
                ready.say(true, why);
                if stop.run_until_cancelled(cache.synced()).await.is_some() {
                    tracing::info!("the exclusion records are read: serving with them");
                    ready.say(true, "");
                }
            }
            Some(Some(None)) => ready.set(true),
            _ => {}
        }
    })
}

/// The admin endpoint's port (`None`: no admin endpoint), bound, and its address.
async fn bind_admin(admin_address: Option<SocketAddr>) -> Result<(Option<TcpListener>, Option<SocketAddr>)> {
    let Some(addr) = admin_address else {
        return Ok((None, None));
    };
    let listener = tensile_common::admin::bind(addr).await?;
    let bound = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    Ok((Some(listener), Some(bound)))
}

async fn client(args: &Args, daemon: &mut Daemon) -> Result<Option<kube::Client>> {
    use tensile_common::kubeconfig::Error as ConfigError;
    let source = daemon.source(args.kubeconfig.as_deref()).await;
    match source.and_then(|source| source.client()) {
        Ok(client) => Ok(Some(client)),
        Err(ConfigError::NoInCluster { source }) => {
            if args.tls_cert_file.is_none()
                && (args.webhook_config_name.is_some() || args.ca_secret.is_some())
            {
                return Err(Error::Client(format!(
                    "no --kubeconfig and not in a cluster ({source}); one is needed to write the caBundle \
                     and to read the --ca-secret"
                )));
            }
            tracing::warn!(error = %source, "no --kubeconfig and not in a cluster: pods are not pinned to their PVC's node");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Runs the webhook until SIGINT or SIGTERM.
pub async fn run(args: Args) -> Result<()> {
    let policy = args.policy()?;
    let certificates = match (&args.tls_cert_file, &args.tls_private_key_file) {
        (Some(cert), Some(key)) => Certificates::Files {
            cert: cert.clone(),
            key: key.clone(),
            reload_every: Duration::from_secs(args.tls_reload_seconds.max(1)),
        },
        _ => match &args.ca_secret {
            Some(secret) => Certificates::SharedCa {
                names: args.self_signed_names.clone(),
                secret: secret.clone(),
            },
            None => Certificates::SelfSigned {
                names: args.self_signed_names.clone(),
            },
        },
    };
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    let mut daemon = Daemon::new("webhook", shutdown).client_options(args.client.options());
    let options = Options {
        address: SocketAddr::new(args.address, args.port),
        admin_address: Some(args.admin.admin_addr),
        policy,
        certificates,
        webhook_config_name: args.webhook_config_name.clone(),
        client: client(&args, &mut daemon).await?,
        max_body_bytes: args.max_body_bytes,
        limits: tensile_common::serve::Limits {
            max_connections: args.max_connections as usize,
            idle: Duration::from_secs(args.idle_timeout_seconds),
            ..Default::default()
        },
        pvc_timeout: Duration::from_millis(args.pvc_timeout_ms),
        exclusions: Some(args.exclusions_configmap.clone()),
    };
    let webhook = start(options).await?;
    let mut running = daemon.start();
    // Reviews in flight are answered; open connections are closed gracefully, within the
    // drain.
    running
        .tasks
        .spawn_graceful("the webhook's open connections", |stop| async move {
            stop.cancelled().await;
            webhook.stop().await
        });
    Ok(running.run().await?)
}
