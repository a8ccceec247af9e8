//! virtual-node: one lower cluster as one honest Node of the upper cluster.
//!
//! The model: every upper pod bound to the node (`spec.nodeName`) has at most one lower pod
//! of the same namespace and name, carrying marks that name the upper cluster, this node and
//! the upper pod's UID. A level-triggered controller ([`pods`]) drives each pair toward
//! agreement: create below, follow mutable fields, bring status up, delete down then up.
//! The node loop ([`node`]) keeps the Node, its Lease and its status true to the lower
//! cluster: capacity from watched lower nodes and pods ([`capacity`]), Ready from a timed
//! probe. The kubelet endpoint ([`kubelet`]) forwards `kubectl logs` to the lower cluster.
//! Nothing without our marks is ever modified or deleted.
//!
//! The shape: the [`world`] builds and holds every watch cache behind one sync gate; pure
//! planners decide ([`pods::decide`], the copy and volume plans, the heartbeat's judge in
//! [`node`], [`translate`]) and are unit-tested on small objects; the controllers act on
//! their plans; what a pod spec references is a leaf ([`refs`]) that all of them read.

pub mod act;
pub mod decide;
pub mod metrics;
pub mod model;
pub mod serve;
pub mod world;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, controller};
use tensile_common::admin::{self, AdminArgs, Readiness};
use tensile_common::kubeconfig::{self, ClientArgs, ClientOptions};
use tensile_common::leader::{self, Candidacy, LeaderArgs, Leadership, Standing};
use tensile_common::node_identity;
use tensile_common::runtime::{self, CancellationToken, Supervisor};
use tensile_common::telemetry::LogArgs;

use crate::act::node::{NodeLoop, NodeSettings};
use crate::act::{copies, events, lower_namespaces, node, pods, ratelimit, volumes};
use crate::decide::translate::Translation;
use crate::decide::{capacity, tokens};
use crate::model::trim;
use crate::serve::kubelet::{self, ClientAuth, KubeletState, ServingCert};
use crate::serve::streams;
use crate::world::scale_ups;
use tensile_common::lower::identity::Identity;
use tensile_common::lower::overrides;

/// Command-line flags (each also read from the environment), in groups: the upper cluster,
/// the lower cluster, the kubelet API, what travels with pods, and the shared runtime's
/// (clients, leader election, admin endpoint, logging).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "virtual-node",
    about = "Registers a lower cluster as one node of the upper cluster"
)]
pub struct Args {
    /// Name of the virtual node in the upper cluster.
    #[arg(long, env = "TENSILE_NODENAME", value_parser = parse_node_name)]
    pub nodename: String,
    /// Do not taint the node with virtual-kubelet.io/provider=tensile:NoSchedule.
    #[arg(long = "disable-taint", env = "TENSILE_DISABLE_TAINT")]
    pub disable_taint: bool,
    /// Extra node labels, `key=value,...`.
    #[arg(long = "node-labels", env = "TENSILE_NODE_LABELS", value_delimiter = ',', value_parser = tensile_common::names::parse_label)]
    pub node_labels: Vec<(String, String)>,
    /// Pod labels kept in the upper cluster only (comma-separated keys).
    #[arg(long = "ignore-labels", env = "TENSILE_IGNORE_LABELS", value_delimiter = ',')]
    pub ignore_labels: Vec<String>,
    /// The webhook's stash keys, each named by its file name (repeat the flag, or separate
    /// with commas; two during a rotation): only stashes signed for their pod with one of
    /// them are applied below. Without any, every stash is trusted, as written.
    #[arg(
        long = "stash-key-file",
        env = "TENSILE_STASH_KEY_FILE",
        value_delimiter = ','
    )]
    pub stash_key_file: Vec<PathBuf>,
    /// This lower cluster's pod overrides (YAML or JSON; docs/virtual-node.md): rules applied
    /// to every pod created below, and a StorageClass name map for claims. The file is
    /// followed; a change that fails its checks is refused, and the rules in force stay.
    #[arg(long = "overrides-file", env = "TENSILE_OVERRIDES_FILE")]
    pub overrides_file: Option<PathBuf>,
    /// Pods reconciled at once. Each reconcile mostly waits on the API, so a burst of
    /// thousands of pods needs many in flight (docs/virtual-node.md has the figures).
    #[arg(long = "pod-sync-workers", env = "TENSILE_POD_SYNC_WORKERS", default_value_t = 128,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub pod_sync_workers: u16,
    /// Seconds one reconcile of a pod (or one resync pass of copies or volumes) may take;
    /// past it the worker is freed and the pod retried, or the next pass begins.
    #[arg(long = "reconcile-timeout", env = "TENSILE_RECONCILE_TIMEOUT", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub reconcile_timeout: u64,
    #[command(flatten)]
    pub upper: UpperArgs,
    #[command(flatten)]
    pub lower: LowerArgs,
    #[command(flatten)]
    pub kubelet: KubeletArgs,
    #[command(flatten)]
    pub reflection: ReflectionArgs,
    #[command(flatten)]
    pub tokens: TokenArgs,
    #[command(flatten)]
    pub shape: capacity::ShapeArgs,
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(flatten)]
    pub leader: LeaderArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The upper cluster: where the node, its Lease and the pods' status are written.
#[derive(Clone, Debug, clap::Args)]
pub struct UpperArgs {
    /// Kubeconfig of the upper cluster; without it, the pod's service account (in-cluster).
    #[arg(long, env = "TENSILE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Sustained writes per second to the upper cluster (0: unlimited).
    #[arg(long = "upper-qps", env = "TENSILE_UPPER_QPS", default_value_t = 500)]
    pub upper_qps: u32,
    /// Burst of writes to the upper cluster.
    #[arg(long = "upper-burst", env = "TENSILE_UPPER_BURST", default_value_t = 1000)]
    pub upper_burst: u32,
    /// Id of the upper cluster in lower ownership marks (default: the upper kube-system
    /// namespace UID).
    #[arg(long = "cluster-id", env = "TENSILE_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// Who the node acts as upstream: `credential` (the kubeconfig's or the pod's
    /// ServiceAccount, authorised by RBAC) or `node` (`system:node:<nodename>`: a kubelet
    /// client certificate asked for with that credential through a CertificateSigningRequest
    /// and renewed at 80 % of its lifetime, confined by the Node authorizer like a kubelet).
    #[arg(long = "upper-identity", env = "TENSILE_UPPER_IDENTITY", value_enum, default_value_t = UpperIdentity::Credential)]
    pub identity: UpperIdentity,
    /// Seconds to wait for the node's client certificate to be issued.
    #[arg(long = "node-certificate-timeout", env = "TENSILE_NODE_CERTIFICATE_TIMEOUT", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub certificate_timeout: u64,
}

/// Who a virtual node acts as in the upper cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UpperIdentity {
    /// The configured credential.
    Credential,
    /// `system:node:<nodename>`, through a client certificate.
    Node,
}

/// The lower cluster: where pods and what travels with them are made.
#[derive(Clone, Debug, clap::Args)]
pub struct LowerArgs {
    /// Kubeconfig of the lower cluster.
    #[arg(long = "client-kubeconfig", env = "TENSILE_CLIENT_KUBECONFIG")]
    pub client_kubeconfig: PathBuf,
    /// Sustained writes per second to the lower cluster (0: unlimited).
    #[arg(long = "client-qps", env = "TENSILE_CLIENT_QPS", default_value_t = 500)]
    pub client_qps: u32,
    /// Burst of writes to the lower cluster.
    #[arg(long = "client-burst", env = "TENSILE_CLIENT_BURST", default_value_t = 1000)]
    pub client_burst: u32,
    /// Serve only these lower namespaces (comma-separated; empty: every namespace). The lower
    /// credential then needs Roles in them alone and nothing cluster-wide: pods of any other
    /// namespace are refused with the reason on the pod, namespaces are never made or
    /// deleted below, and the room shown is what the namespaces' ResourceQuotas leave
    /// (docs/virtual-node.md).
    #[arg(
        long = "lower-namespaces",
        env = "TENSILE_LOWER_NAMESPACES",
        value_delimiter = ','
    )]
    pub namespaces: Vec<String>,
}

impl LowerArgs {
    /// The lower namespaces read and written; an error for a scope that cannot work.
    pub fn scope(&self, gc_namespaces: bool) -> Result<tensile_common::cache::Namespaces, String> {
        let mut served: Vec<String> = self.namespaces.iter().map(|n| n.trim().to_owned()).collect();
        served.retain(|n| !n.is_empty());
        served.sort();
        served.dedup();
        if served.is_empty() {
            return Ok(tensile_common::cache::Namespaces::All);
        }
        if let Some(bad) = served.iter().find(|n| !tensile_common::names::is_dns_label(n)) {
            return Err(format!("--lower-namespaces: {bad:?} is not a namespace name"));
        }
        if gc_namespaces {
            return Err(
                "--gc-namespaces cannot be given with --lower-namespaces: the served namespaces \
                        are the lower admin's, never made or deleted by a virtual node"
                    .into(),
            );
        }
        Ok(tensile_common::cache::Namespaces::Only(served))
    }
}

/// The kubelet API the upper apiserver calls for `kubectl logs`.
#[derive(Clone, Debug, clap::Args)]
pub struct KubeletArgs {
    /// Port of the kubelet API (published in the node's daemonEndpoints).
    #[arg(long = "kubelet-port", env = "TENSILE_KUBELET_PORT", default_value_t = 10250)]
    pub kubelet_port: u16,
    /// The node's InternalIP: the upper apiserver must reach the kubelet port there.
    #[arg(long = "node-ip", env = "TENSILE_NODE_IP")]
    pub node_ip: IpAddr,
    /// Serving certificate of the kubelet API (PEM); self-signed when absent.
    #[arg(
        long = "tls-cert-file",
        env = "TENSILE_TLS_CERT_FILE",
        requires = "tls_private_key_file"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key of --tls-cert-file (PEM).
    #[arg(
        long = "tls-private-key-file",
        env = "TENSILE_TLS_PRIVATE_KEY_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_private_key_file: Option<PathBuf>,
    /// CA of the client certificates the upper apiserver presents to kubelets.
    #[arg(
        long = "client-verify-ca",
        env = "TENSILE_CLIENT_VERIFY_CA",
        conflicts_with = "no_verify_clients"
    )]
    pub client_verify_ca: Option<PathBuf>,
    /// Serve the kubelet API without authenticating callers.
    #[arg(long = "no-verify-clients", env = "TENSILE_NO_VERIFY_CLIENTS")]
    pub no_verify_clients: bool,
    /// How callers of the kubelet API are authorised: `webhook` (a SubjectAccessReview for
    /// `nodes/proxy` on the upper cluster, as the kubelet does) or `always-allow` (any
    /// authenticated caller).
    #[arg(long = "kubelet-authorization", env = "TENSILE_KUBELET_AUTHORIZATION", value_enum,
          default_value_t = KubeletAuthorization::Webhook)]
    pub authorization: KubeletAuthorization,
    /// Open connections of the kubelet API at most; at the cap the longest-idle one makes
    /// room.
    #[arg(long = "kubelet-max-connections", env = "TENSILE_KUBELET_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Seconds a kubelet API connection may stay open with no request in progress.
    #[arg(long = "kubelet-idle-timeout-seconds", env = "TENSILE_KUBELET_IDLE_TIMEOUT_SECONDS",
          default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_seconds: u64,
    /// Long-lived streams at once at most (exec, attach and port-forward sessions, followed
    /// logs); more are refused (503). Below --kubelet-max-connections, so that streams never
    /// take every connection.
    #[arg(long = "kubelet-max-stream-sessions", env = "TENSILE_KUBELET_MAX_STREAM_SESSIONS",
          default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_stream_sessions: u32,
    /// Of those, what the pods of one namespace may hold at once (at most all of them); more
    /// are refused (503), so one tenant keeps a share for the others.
    #[arg(long = "kubelet-max-stream-sessions-per-namespace", env = "TENSILE_KUBELET_MAX_STREAM_SESSIONS_PER_NAMESPACE",
          default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_stream_sessions_per_namespace: u32,
    /// Seconds an exec, attach or port-forward session may pass without a byte either way
    /// before it is closed (the kubelet's --streaming-connection-idle-timeout, 4 h).
    #[arg(long = "stream-idle-timeout-seconds", env = "TENSILE_STREAM_IDLE_TIMEOUT_SECONDS",
          default_value_t = 14400, value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_idle_timeout_seconds: u64,
}

impl KubeletArgs {
    /// Bounds that hold together: streams below the connections, else streams could take
    /// every one.
    pub fn check(&self) -> Result<(), String> {
        if self.max_stream_sessions >= self.max_connections {
            return Err(format!(
                "--kubelet-max-stream-sessions ({}) must be below --kubelet-max-connections ({}): \
                 streams would otherwise hold every connection of the kubelet API",
                self.max_stream_sessions, self.max_connections
            ));
        }
        Ok(())
    }
}

/// See [`KubeletArgs::authorization`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KubeletAuthorization {
    Webhook,
    AlwaysAllow,
}

/// What travels with pods, and what is collected below.
#[derive(Clone, Debug, clap::Args)]
pub struct ReflectionArgs {
    /// Seconds a ConfigMap or Secret copy stays below after the last pod referencing it
    /// went (absorbs rolling updates).
    #[arg(
        long = "copy-collection-delay",
        env = "TENSILE_COPY_COLLECTION_DELAY",
        default_value_t = 10
    )]
    pub copy_collection_delay: u64,
    /// Reads per second of the upper ConfigMaps and Secrets that pods bound here reference:
    /// each is read by name (nothing lists them), and re-read once a second while there are
    /// at most this many, less often in proportion beyond (docs/virtual-node.md).
    #[arg(
        long = "upper-reads-per-second",
        env = "TENSILE_UPPER_READS_PER_SECOND",
        default_value_t = 20,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub upper_reads_per_second: u32,
    /// Optional reflections, comma-separated: `ServiceControllers` copies the Services (and
    /// their Endpoints) of namespaces where this node runs pods into the lower cluster.
    #[arg(
        long = "enable-controllers",
        env = "TENSILE_ENABLE_CONTROLLERS",
        value_delimiter = ','
    )]
    pub enable_controllers: Vec<Controllers>,
    /// With ServiceControllers: also reflect kube-system's Services and `default/kubernetes`.
    #[arg(long = "reflect-system-services", env = "TENSILE_REFLECT_SYSTEM_SERVICES")]
    pub reflect_system_services: bool,
    /// Delete lower namespaces this node created once nothing is left in them.
    #[arg(long = "gc-namespaces", env = "TENSILE_GC_NAMESPACES")]
    pub gc_namespaces: bool,
    /// Lower namespaces that pods may share with what the lower cluster already has there,
    /// comma-separated (`*`: any). A namespace not listed that exists below without this
    /// upper cluster's mark is refused, with the reason on the pod.
    #[arg(
        long = "shared-namespaces",
        env = "TENSILE_SHARED_NAMESPACES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub shared_namespaces: Vec<String>,
    /// Run DaemonSet pods bound to the virtual node in the lower cluster.
    #[arg(long = "run-daemonset-pods", env = "TENSILE_RUN_DAEMONSET_PODS")]
    pub run_daemonset_pods: bool,
}

/// Upper service-account tokens for pods below ([`tokens`]).
#[derive(Clone, Debug, clap::Args)]
pub struct TokenArgs {
    /// Give a pod that mounts its service-account token upstream, below, tokens of the upper
    /// cluster for its upper ServiceAccount, bound to the upper pod and renewed at 80 % of
    /// their lifetime, and point its in-cluster clients at --upper-api-endpoint. Off: pods
    /// below get no token (docs/virtual-node.md, "Upper service-account tokens").
    #[arg(
        long = "upper-service-account-tokens",
        env = "TENSILE_UPPER_SERVICE_ACCOUNT_TOKENS",
        requires = "upper_api_endpoint"
    )]
    pub upper_tokens: bool,
    /// The upper apiserver as pods of the lower cluster reach it (`https://host[:port]`):
    /// their KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT.
    #[arg(long = "upper-api-endpoint", env = "TENSILE_UPPER_API_ENDPOINT")]
    pub upper_api_endpoint: Option<String>,
    /// The CA bundle (PEM) that endpoint's certificate verifies with, mounted as `ca.crt`
    /// (default: the upper kubeconfig's CA, or the in-cluster one).
    #[arg(long = "upper-api-ca-file", env = "TENSILE_UPPER_API_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Only pods of these namespaces get upper tokens (comma-separated; empty: every one but
    /// the --shared-namespaces, where others below could read the tokens).
    #[arg(
        long = "upper-token-namespaces",
        env = "TENSILE_UPPER_TOKEN_NAMESPACES",
        value_delimiter = ','
    )]
    pub token_namespaces: Vec<String>,
    /// Share of a token's lifetime after which it is renewed (tests shorten it).
    #[arg(
        long = "upper-token-renew-at",
        env = "TENSILE_UPPER_TOKEN_RENEW_AT",
        default_value_t = 0.8,
        hide = true
    )]
    pub renew_at: f64,
}

/// The CA bundle (PEM) of the upper cluster as its kubeconfig `kubeconfig` names it (the
/// in-cluster one without).
fn upper_ca(kubeconfig: Option<&Path>) -> Result<String, String> {
    const IN_CLUSTER: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
    let Some(path) = kubeconfig else {
        return std::fs::read_to_string(IN_CLUSTER).map_err(|e| format!("{IN_CLUSTER}: {e}"));
    };
    let config = kube::config::Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let cluster =
        kubeconfig::cluster_of(&config, None).ok_or_else(|| format!("{}: no cluster", path.display()))?;
    let pem = kubeconfig::ca_pem(cluster)
        .map_err(|e| format!("{}: the cluster's CA: {e}", path.display()))?
        .ok_or_else(|| {
            format!(
                "{}: the cluster names no CA; give --upper-api-ca-file",
                path.display()
            )
        })?;
    String::from_utf8(pem).map_err(|e| format!("{}: the cluster's CA: {e}", path.display()))
}

impl TokenArgs {
    /// The mode's settings (`None`: off), or why they cannot be used.
    /// `shared`: the lower namespaces shared with others (`--shared-namespaces`); under a
    /// namespace scope (`scope`) the served namespaces are too: they are the lower cluster's
    /// users', who can read the Secrets there.
    pub fn settings(
        &self,
        upper_kubeconfig: Option<&Path>,
        shared: &[String],
        scope: &tensile_common::cache::Namespaces,
    ) -> Result<Option<tokens::Settings>, String> {
        if !self.upper_tokens {
            return Ok(None);
        }
        let endpoint = self
            .upper_api_endpoint
            .as_deref()
            .ok_or("--upper-service-account-tokens needs --upper-api-endpoint")?;
        let ca = match &self.ca_file {
            Some(file) => std::fs::read_to_string(file)
                .map_err(|e| format!("--upper-api-ca-file {}: {e}", file.display()))?,
            None => upper_ca(upper_kubeconfig)?,
        };
        let mut shared = shared.to_vec();
        if let tensile_common::cache::Namespaces::Only(served) = scope {
            shared.extend(served.iter().cloned());
        }
        tokens::Settings::new(endpoint, ca, self.token_namespaces.clone(), shared, self.renew_at).map(Some)
    }
}

/// Optional reflections (tensile-kube's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Controllers {
    /// Services and their Endpoints.
    #[value(name = "ServiceControllers")]
    Services,
}

impl Args {
    /// Every flag at its default (environment variables applied, as on the command line)
    /// for virtual node `nodename` at `node_ip`, of the upper cluster of `upper` (in-cluster
    /// when `None`) over the lower cluster of `lower`; the fields are then set as typed
    /// values.
    pub fn new(
        nodename: &str,
        node_ip: IpAddr,
        upper: Option<&Path>,
        lower: &Path,
    ) -> Result<Args, clap::Error> {
        let mut argv = vec![
            "virtual-node".into(),
            format!("--nodename={nodename}"),
            format!("--node-ip={node_ip}"),
            format!("--client-kubeconfig={}", lower.display()),
        ];
        argv.extend(upper.map(|u| format!("--kubeconfig={}", u.display())));
        <Args as clap::Parser>::try_parse_from(argv)
    }
}

fn parse_node_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part.len() <= 63
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a valid node name (a lowercase DNS subdomain)"
        ))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Kubeconfig(#[from] tensile_common::kubeconfig::Error),
    #[error("{0}")]
    Kubelet(#[from] kubelet::Error),
    #[error("{0}")]
    Admin(#[from] admin::Error),
    #[error(
        "the kubelet API needs a way to authenticate callers: give --client-verify-ca (the upper apiserver's kubelet client CA) or, to serve without authentication, --no-verify-clients"
    )]
    NoClientAuth,
    #[error("{0}")]
    StashKey(#[from] tensile_common::stash::KeyError),
    #[error("{0}")]
    NodeIdentity(#[from] tensile_common::node_identity::Error),
    #[error("reading the upper cluster id (kube-system namespace UID; or pass --cluster-id): {0}")]
    ClusterId(String),
    #[error("invalid flags: {0}")]
    Flags(String),
    #[error("waiting for a shutdown signal: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Stopped(#[from] runtime::Stopped),
}

/// Renews the node's client certificate at 80 % of its lifetime, asking with `asking` (the
/// configured credential); a request that fails is made again every 10 s. Past the
/// certificate's end without a new one, the node stops: a restart asks anew.
async fn renew(
    asking: kube::Client,
    node: String,
    credential: kubeconfig::NodeCredential,
    timeout: Duration,
) -> Option<String> {
    loop {
        let (_, current) = credential.current();
        // Slept an hour at most at a time, the wall clock read again after each: a
        // suspended machine or a clock that jumped renews late by an hour at most.
        let now = node_identity::now_seconds();
        if now < current.renew_at() {
            tokio::time::sleep(current.renew_in(now).min(Duration::from_secs(3600))).await;
            continue;
        }
        loop {
            match node_identity::request(&asking, &node, timeout).await {
                Ok(issued) => {
                    tracing::info!(
                        node,
                        not_after = issued.not_after,
                        "node client certificate renewed"
                    );
                    credential.replace(issued);
                    break;
                }
                Err(e) if node_identity::now_seconds() >= current.not_after => {
                    return Some(format!(
                        "the node's client certificate expired and no new one was issued: {e}"
                    ));
                }
                Err(e) => {
                    tracing::warn!(node, "renewing the node client certificate: {e}");
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            }
        }
    }
}

/// Runs the virtual node until SIGTERM or SIGINT (then `Ok`, after a graceful drain) or
/// until a component fails.
pub async fn run(args: Args) -> Result<(), Error> {
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    run_until(args, shutdown).await
}

/// As [`run`], stopping gracefully when `shutdown` is cancelled.
pub async fn run_until(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    let replica = leader::default_identity();
    let election = args
        .leader
        .config(
            &format!("tensile-virtual-node-{}", args.nodename),
            replica.clone(),
        )
        .map_err(Error::Flags)?;
    let leadership = Leadership::of(&election);
    // A scope, a token mode or kubelet API bounds that cannot work stop the node before it
    // asks for anything.
    args.kubelet.check().map_err(Error::Flags)?;
    let scope = args
        .lower
        .scope(args.reflection.gc_namespaces)
        .map_err(Error::Flags)?;
    args.tokens
        .settings(
            args.upper.kubeconfig.as_deref(),
            &args.reflection.shared_namespaces,
            &scope,
        )
        .map_err(Error::Flags)?;
    // Overrides that fail their checks at start stop the node: pods must not go below
    // without the rules their cluster needs.
    let overrides = match &args.overrides_file {
        Some(path) => {
            let (compiled, read) =
                overrides::load(path).map_err(|e| Error::Flags(format!("--overrides-file {e}")))?;
            (compiled, Some(read))
        }
        None => (overrides::Compiled::none(), None),
    };
    let stash_key = match args.stash_key_file.as_slice() {
        [_, ..] => Some(Arc::new(tensile_common::stash::StashKeys::from_files(
            &args.stash_key_file,
        )?)),
        [] => {
            tracing::warn!(
                "no --stash-key-file: stashes (clusterSelector) are applied below whoever wrote them"
            );
            None
        }
    };
    // Every request names the replica, so the apiserver's audit log says who wrote what.
    let options = ClientOptions {
        user_agent: Some(format!("tensile-virtual-node/{} ({replica})", args.nodename)),
        ..args.client.options()
    };
    let mut upper_source = kubeconfig::ClientSource::new(args.upper.kubeconfig.as_deref(), &options).await?;
    // The election's Lease is written with the configured credential: NodeRestriction lets a
    // node write no Lease but its heartbeat.
    let election_source = upper_source.clone();
    let mut renewal = None;
    if args.upper.identity == UpperIdentity::Node {
        // The configured credential only asks for the node's certificate, now and at renewal.
        let asking = upper_source.client()?;
        let timeout = Duration::from_secs(args.upper.certificate_timeout);
        let issued = node_identity::request(&asking, &args.nodename, timeout).await?;
        tracing::info!(node = %args.nodename, not_after = issued.not_after, "acting as {}", node_identity::user(&args.nodename));
        let credential = kubeconfig::NodeCredential::new(issued);
        upper_source = upper_source.with_identity(credential.clone());
        renewal = Some(renew(asking, args.nodename.clone(), credential, timeout));
    }
    let mut lower_source =
        kubeconfig::ClientSource::new(Some(&args.lower.client_kubeconfig), &options).await?;
    // The Lease itself is written unfenced; everything else only while leading.
    let lease_client = election_source.client()?;
    let review_client = upper_source.client()?;
    if election.is_some() {
        upper_source = upper_source.fenced(leadership.clone());
        lower_source = lower_source.fenced(leadership.clone());
    }
    let lower = lower_source.client()?;
    // The kubelet API's own lower client: exec, attach, port-forward and logs are relayed
    // write by write ([`kubeconfig::ClientSource::stream_client`]).
    let lower_streams = lower_source.stream_client()?;
    let auth = match (&args.kubelet.client_verify_ca, args.kubelet.no_verify_clients) {
        (Some(ca), _) => ClientAuth::Ca(ca.clone()),
        (None, true) => ClientAuth::None,
        (None, false) => return Err(Error::NoClientAuth),
    };
    let serving = match (&args.kubelet.tls_cert_file, &args.kubelet.tls_private_key_file) {
        (Some(cert), Some(key)) => ServingCert::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        _ => ServingCert::SelfSigned(vec![args.kubelet.node_ip.to_string(), args.nodename.clone()]),
    };
    let tls = kubelet::tls_config(&serving, &auth)?;
    let kubelet_listener =
        kubelet::bind(SocketAddr::new(args.kubelet.node_ip, args.kubelet.kubelet_port)).await?;
    let admin_listener = admin::bind(args.admin.admin_addr).await?;

    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(metrics::Metrics::new(&mut registry));
    leadership.register(&mut registry);
    let readiness = Readiness::default();
    let mut tasks = Supervisor::new(shutdown.clone(), DRAIN);
    if let Some(renewal) = renewal {
        tasks.spawn("the node certificate renewal", renewal);
    }
    // The admin endpoint serves from the start, so a standby replica says it stands by.
    let admin_task = admin::serve(admin_listener, Arc::new(registry), readiness.clone());
    let admin_handle = tokio::spawn(shutdown.clone().run_until_cancelled_owned(admin_task));

    // Reviews of kubelet API callers are answered on any replica, so they are unfenced.
    let authorizer = match args.kubelet.authorization {
        KubeletAuthorization::Webhook => kubelet::Authorizer::webhook(review_client),
        KubeletAuthorization::AlwaysAllow => kubelet::Authorizer::AlwaysAllow,
    };
    // The world fills on standby too: a standby is ready once it has synced, and takes over
    // with its caches current.
    let standing = Standing::new(readiness, "");
    let candidacy = leader::stand(lease_client, election, &leadership, &standing, &mut tasks);

    let clients = Clients {
        upper_source,
        lower,
        lower_streams,
    };
    let serving = Serving {
        tls,
        listener: kubelet_listener,
        auth,
        authorizer,
    };
    let started = Started {
        standing,
        candidacy: candidacy.clone(),
    };
    let policy = Policy { stash_key, overrides };
    let result = compose(&args, clients, serving, policy, metrics, started, &mut tasks).await;
    let outcome = match result {
        Ok(()) => tasks.run().await.map_err(Error::from),
        Err(e) => {
            shutdown.cancel();
            let _ = tasks.run().await;
            Err(e)
        }
    };
    candidacy.release().await;
    admin_handle.abort();
    outcome
}

/// How often the overrides file is looked at (a ConfigMap volume changes within a minute or
/// so of its ConfigMap).
const OVERRIDES_CHECK: Duration = Duration::from_secs(2);

/// How long in-flight reconciles get to finish after SIGTERM.
const DRAIN: Duration = runtime::DEFAULT_DRAIN;

/// How soon an orphan collection pass with a failed delete runs again.
const ORPHAN_RETRY: Duration = Duration::from_secs(1);

/// How long a suspected orphan waits for more before the pass: a re-list of every lower pod
/// is then one pass, not one per pod.
const ORPHAN_DEBOUNCE: Duration = Duration::from_millis(200);

/// The objects a pod watch touches, as it changes.
type PodEvents<K> = futures::stream::BoxStream<'static, Result<K, kube::runtime::watcher::Error>>;

/// A watch's objects without its errors, for the pod controller. The caches pace their own
/// watch retries (200 ms doubling to 2 s); passed on, each error would also make kube's
/// controller stop taking every trigger (upper pod events, the resync, the lower cluster's
/// return) for a delay that grows to 30 s, so a lower cluster that went away would leave
/// the controller deaf for up to that long after it came back.
fn objects_only<K: Send + 'static>(
    events: PodEvents<K>,
) -> impl futures::Stream<Item = Result<K, kube::runtime::watcher::Error>> + Send + 'static {
    events.filter(|event| {
        if let Err(e) = event {
            tracing::debug!("pod watch: {e}");
        }
        futures::future::ready(event.is_ok())
    })
}

/// Until `candidacy` leads, the pod events (`events`: upper, lower) only keep the pod caches
/// current and nothing is reconciled; then they are handed back for the pod controller.
async fn standby<U, L>(
    mut events: (PodEvents<U>, PodEvents<L>),
    candidacy: &Candidacy,
) -> (PodEvents<U>, PodEvents<L>) {
    {
        let (upper, lower) = (&mut events.0, &mut events.1);
        let drain = futures::stream::select(upper.map(drop), lower.map(drop)).for_each(|()| async {});
        tokio::select! {
            biased;
            () = candidacy.leading() => {}
            () = drain => {}
        }
    }
    // The watches do not end; were they to, this replica would still act only as leader.
    candidacy.leading().await;
    events
}

/// The pod controller over the world's pod events (`events`: upper, lower). Every pod is
/// reconciled every 60 s, and at once when the lower cluster answers again after an outage,
/// with its retry delay started over: deletions and confirmations that waited through the
/// outage go then, not at retries that grew to minutes. A lower pod event (the re-list after
/// the lower cluster's return among them) whose upper pod is gone or another wakes
/// `orphans_suspected`; orphan collection judges on the synced caches.
fn pod_controller(
    world: &world::World,
    (upper_events, lower_events): (PodEvents<trim::UpperPod>, PodEvents<trim::LowerPod>),
    scale_ups: futures::stream::BoxStream<'static, ObjectRef<trim::UpperPod>>,
    ctx: &Arc<pods::Context>,
    orphans_suspected: Arc<tokio::sync::Notify>,
    workers: u16,
) -> Controller<trim::UpperPod> {
    let resync = futures::stream::unfold((), |()| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Some(((), ()))
    });
    let recovered = {
        let ctx = ctx.clone();
        ctx.lower_health.recoveries().map(move |()| {
            tracing::info!(
                node = %ctx.translation.identity.node,
                "the lower cluster answers again: every pod is reconciled now"
            );
            ctx.retries.forget_all();
        })
    };
    // Pods refused by the rules before are looked at again under new ones.
    let overridden = ctx.overrides.changes();
    let (upper_pods, identity) = (world.upper_pods.clone(), ctx.translation.identity.clone());
    Controller::for_stream(objects_only(upper_events), world.upper_pods.store().clone())
        .with_config(controller::Config::default().concurrency(workers))
        .watches_stream(objects_only(lower_events), move |lower: trim::LowerPod| {
            let ns = lower.metadata.namespace.clone().unwrap_or_default();
            let at = ObjectRef::new(lower.metadata.name.as_deref()?).within(&ns);
            let upper = upper_pods.get(&at);
            if crate::decide::pods::orphaned(
                &lower.metadata,
                upper.as_ref().map(|u| kube::Resource::meta(&**u)),
                &identity,
            ) {
                orphans_suspected.notify_one();
            }
            Some(at)
        })
        // A scale-up signal below changes the status the pod should show.
        .reconcile_on(scale_ups)
        .reconcile_all_on(futures::stream::select(
            futures::stream::select(resync, recovered),
            overridden,
        ))
}

/// Orphan collection ([`pods::collect_orphans`]): every `period` (the collection delay, 1 to
/// 30 s), at once when `suspected` is woken or the lower cluster answers again, and 1 s after
/// a failed delete. With `namespaces` (`--gc-namespaces`) empty namespaces are collected
/// too, judged empty on two passes in a row: at least one `period` apart, at most 30 s.
struct Collection {
    period: Duration,
    namespaces: bool,
    recoveries: std::pin::Pin<Box<dyn futures::Stream<Item = ()> + Send>>,
    suspected: Arc<tokio::sync::Notify>,
}

impl Collection {
    async fn run(mut self, ctx: &pods::Context, world: &world::World) {
        world.pods_synced().await;
        let mut empty_before = Default::default();
        let mut namespaces_due = tokio::time::Instant::now();
        loop {
            let collected = pods::collect_orphans(ctx).await;
            pods::forget_stale_holds(ctx);
            let now = tokio::time::Instant::now();
            if self.namespaces && now >= namespaces_due {
                pods::collect_namespaces(ctx, &mut empty_before).await;
                namespaces_due = now + self.period;
            }
            let mut next = if collected.failed > 0 {
                ORPHAN_RETRY
            } else {
                self.period
            };
            if self.namespaces {
                next = next.min(namespaces_due.saturating_duration_since(tokio::time::Instant::now()));
            }
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                Some(()) = self.recoveries.next() => {}
                _ = self.suspected.notified() => tokio::time::sleep(ORPHAN_DEBOUNCE).await,
            }
        }
    }
}

/// The clients of one virtual node: the upper source (the heartbeat builds its own client
/// from it), the lower client of the controllers, and the kubelet API's stream client.
struct Clients {
    upper_source: kubeconfig::ClientSource,
    lower: kube::Client,
    lower_streams: kube::Client,
}

/// How the kubelet API serves: TLS, its bound listener, who may call it.
struct Serving {
    tls: Arc<rustls::ServerConfig>,
    listener: tokio::net::TcpListener,
    auth: ClientAuth,
    authorizer: kubelet::Authorizer,
}

/// What decides how pods go below besides the flags: the stash keys and the overrides.
struct Policy {
    stash_key: Option<Arc<tensile_common::stash::StashKeys>>,
    /// The overrides, and the file's bytes they were read from.
    overrides: (overrides::Compiled, Option<Vec<u8>>),
}

/// What `/readyz` says, and when this replica may act.
struct Started {
    standing: Standing,
    candidacy: Candidacy,
}

/// Builds the world (every cache, [`world`]) and the components of one virtual node, and
/// hands them to `tasks`. The world fills at once, on standby too; the components act once
/// `started` leads. They share one upper client; the node loop's heartbeat has its own.
async fn compose(
    args: &Args,
    clients: Clients,
    serving: Serving,
    policy: Policy,
    metrics: Arc<metrics::Metrics>,
    started: Started,
    tasks: &mut Supervisor,
) -> Result<(), Error> {
    let Clients {
        upper_source,
        lower,
        lower_streams,
    } = clients;
    let Serving {
        tls,
        listener: kubelet_listener,
        auth,
        authorizer,
    } = serving;
    let Started { standing, candidacy } = started;
    let Policy {
        stash_key,
        overrides: (overrides, read),
    } = policy;
    let overrides = crate::world::overrides::Current::new(overrides);
    if let (Some(path), Some(read)) = (&args.overrides_file, read) {
        tasks.spawn(
            "the overrides file",
            crate::world::overrides::follow(
                path.clone(),
                overrides.clone(),
                OVERRIDES_CHECK,
                read,
                (
                    metrics.overrides_loaded.clone(),
                    metrics.overrides_refused.clone(),
                ),
            ),
        );
    }
    let upper = upper_source.client()?;
    let cluster_id = match &args.upper.cluster_id {
        Some(id) => id.clone(),
        None => Api::<Namespace>::all(upper.clone())
            .get("kube-system")
            .await
            .map_err(|e| Error::ClusterId(e.to_string()))?
            .metadata
            .uid
            .ok_or_else(|| Error::ClusterId("kube-system has no uid".into()))?,
    };
    let identity = Identity {
        cluster_id,
        node: args.nodename.clone(),
    };
    let lower_name = args
        .lower
        .client_kubeconfig
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lower".into());
    tracing::info!(node = %identity.node, cluster_id = %identity.cluster_id, "starting");
    // A version outside the supported range is served, with a warning naming it; the lower
    // cluster's is checked where the node reads it (the heartbeat's probe).
    match upper.apiserver_version().await {
        Ok(info) => {
            if let Some(warning) = tensile_common::versions::warning("the upper cluster", &info.git_version) {
                tracing::warn!(node = %identity.node, "{warning}");
            }
        }
        Err(e) => tracing::warn!(node = %identity.node, "reading the upper cluster's version: {e}"),
    }

    let lower_scope = args
        .lower
        .scope(args.reflection.gc_namespaces)
        .map_err(Error::Flags)?;
    let token_settings = args
        .tokens
        .settings(
            args.upper.kubeconfig.as_deref(),
            &args.reflection.shared_namespaces,
            &lower_scope,
        )
        .map_err(Error::Flags)?
        .map(Arc::new);
    if let Some(settings) = &token_settings {
        tracing::info!(node = %identity.node, "upper tokens go to pods of {}", settings.describe());
    }
    let scope = world::Scope {
        services: args
            .reflection
            .enable_controllers
            .contains(&Controllers::Services),
        system_services: args.reflection.reflect_system_services,
        upper_reads_per_second: args.reflection.upper_reads_per_second,
        lower: lower_scope.clone(),
        tokens: token_settings.is_some(),
    };
    let (world, watches, signals) = world::World::build(&upper, &lower, &identity, &scope);
    let world::Watches {
        feeds,
        upper_pod_events,
        lower_pod_events,
    } = watches;
    for (name, feed) in feeds {
        tasks.spawn(name, feed);
    }
    let (scale_ups, scale_up_watch, scale_up_wakes) =
        scale_ups::watch(&lower, &lower_scope, world.lower_pods.clone());
    tasks.spawn("the lower scale-up signal watch", scale_up_watch);
    let (events, events_run) = events::Events::new(
        Recorder::new(
            upper.clone(),
            Reporter {
                controller: "tensile-virtual-node".into(),
                instance: Some(identity.node.clone()),
            },
        ),
        metrics.clone(),
    );
    let lower_limit = ratelimit::WriteLimit::new(args.lower.client_qps, args.lower.client_burst);
    let upper_limit = ratelimit::WriteLimit::new(args.upper.upper_qps, args.upper.upper_burst);
    // Lower namespaces judged usable for pods and claims; Service reflection keeps to them.
    let namespaces = Arc::new(lower_namespaces::LowerNamespaces::new(
        lower.clone(),
        identity.clone(),
        lower_name.clone(),
        args.reflection.shared_namespaces.clone(),
        lower_scope.clone(),
        lower_limit.clone(),
    ));
    let copies = Arc::new(copies::Copies {
        upper: upper.clone(),
        lower: lower.clone(),
        cluster_id: identity.cluster_id.clone(),
        cluster_name: lower_name.clone(),
        upper_config_maps: world.upper_config_maps.clone(),
        upper_secrets: world.upper_secrets.clone(),
        lower_config_maps: world.lower_config_maps.clone(),
        lower_secrets: world.lower_secrets.clone(),
        upper_pods: world.upper_pods.clone(),
        lower_pods: world.lower_load.clone(),
        limit: lower_limit.clone(),
        metrics: metrics.clone(),
        gc_delay: Duration::from_secs(args.reflection.copy_collection_delay),
        unreferenced_since: Default::default(),
        conflicts: Default::default(),
        services: world.services.clone(),
        namespaces: namespaces.clone(),
        events: events.clone(),
    });
    let volumes = Arc::new(volumes::Volumes {
        upper: upper.clone(),
        lower: lower.clone(),
        identity: identity.clone(),
        cluster_name: lower_name.clone(),
        upper_claims: world.upper_claims.clone(),
        upper_volumes: world.upper_volumes.clone(),
        lower_claims: world.lower_claims.clone(),
        upper_pods: world.upper_pods.clone(),
        lower_pods: world.lower_load.clone(),
        upper_limit: upper_limit.clone(),
        lower_limit: lower_limit.clone(),
        metrics: metrics.clone(),
        classes: Default::default(),
        upper_classes: world.upper_classes.clone(),
        read_lower_classes: lower_scope == tensile_common::cache::Namespaces::All,
        refused_expansions: Default::default(),
        overrides: overrides.clone(),
        namespaces: namespaces.clone(),
    });
    let lower_health = Arc::new(node::LowerHealth::default());
    let ctx = Arc::new(pods::Context {
        upper: upper.clone(),
        lower: lower.clone(),
        translation: Translation {
            identity: identity.clone(),
            ignore_labels: args.ignore_labels.clone(),
            stash_key: stash_key.clone(),
            tokens: token_settings.clone(),
        },
        overrides: overrides.clone(),
        lower_pods: world.lower_pods.clone(),
        upper_pods: world.upper_pods.clone(),
        host_ip: args.kubelet.node_ip.to_string(),
        events,
        metrics: metrics.clone(),
        run_daemonset_pods: args.reflection.run_daemonset_pods,
        upper_limit,
        lower_limit,
        copies: copies.clone(),
        volumes: volumes.clone(),
        started: Instant::now(),
        lost_grace: Duration::from_secs(10),
        cluster_name: lower_name,
        namespaces,
        served: lower_scope.clone(),
        known_priority_classes: Default::default(),
        first_status_held: Default::default(),
        retries: Default::default(),
        settled: Default::default(),
        reconcile_timeout: Duration::from_secs(args.reconcile_timeout),
        lower_health: lower_health.clone(),
        tokens_changed: signals.tokens_changed.clone(),
        scale_ups,
    });

    let orphans_suspected = Arc::new(tokio::sync::Notify::new());

    let mut settings = NodeSettings::new(
        identity.clone(),
        args.kubelet.node_ip.to_string(),
        args.kubelet.kubelet_port,
    );
    settings.taint = !args.disable_taint;
    settings.role_label = args.upper.identity == UpperIdentity::Credential;
    settings.retaint = args.upper.identity == UpperIdentity::Credential;
    settings.extra_labels = args.node_labels.iter().cloned().collect::<BTreeMap<_, _>>();
    settings.shape_label_keys = args.shape.label_keys.clone();
    // The heartbeat has its own client: a partition's dead connections are then dropped with
    // it, without waiting on the pool the controllers share.
    let node_loop = NodeLoop {
        upper: std::sync::Mutex::new(upper_source.client()?),
        upper_source,
        lower: lower.clone(),
        settings,
        lower_nodes: world.lower_nodes.clone(),
        lower_quotas: world.lower_quotas.clone(),
        served: lower_scope.clone(),
        lower_pods: world.lower_load.clone(),
        changed: signals.lower_changed.clone(),
        metrics: metrics.clone(),
        upper_node: world.upper_node.clone(),
        lower_health,
        taint_told: Default::default(),
        overrides,
    };
    let kubelet_state = Arc::new(KubeletState {
        node: identity.node.clone(),
        upper_pods: world.upper_pods.clone(),
        lower_pods: world.lower_pods.clone(),
        summaries: Default::default(),
        lower: lower_streams,
        metrics: metrics.clone(),
        require_client_cert: matches!(auth, ClientAuth::Ca(_)),
        authorizer,
        sessions: streams::Sessions::new(
            args.kubelet.max_stream_sessions as usize,
            args.kubelet.max_stream_sessions_per_namespace as usize,
            Duration::from_secs(args.kubelet.stream_idle_timeout_seconds),
        ),
        read_lower_nodes: lower_scope == tensile_common::cache::Namespaces::All,
    });
    let kubelet_limits = tensile_common::serve::Limits {
        max_connections: args.kubelet.max_connections as usize,
        idle: Duration::from_secs(args.kubelet.idle_timeout_seconds),
        ..Default::default()
    };

    // Each component is its own task: a watch decoding a large object then runs on a
    // shallow stack, and a component that stops is named. The controller, the node loop
    // and collection finish the work in hand on SIGTERM; the rest stop at once.
    let resync_metrics = metrics.clone();
    let (controller_ctx, store) = (ctx.clone(), world.upper_pods.clone());
    let (controller_world, suspected) = (world.clone(), orphans_suspected.clone());
    let (workers, leads) = (args.pod_sync_workers, candidacy.clone());
    tasks.spawn_graceful("the pod controller", move |stop| async move {
        let events = (upper_pod_events, lower_pod_events);
        let Some(events) = stop.run_until_cancelled(standby(events, &leads)).await else {
            return;
        };
        // Taking over, every pod is reconciled at once (the events seen on standby were not).
        pod_controller(
            &controller_world,
            events,
            scale_up_wakes,
            &controller_ctx,
            suspected,
            workers,
        )
        .reconcile_all_on(futures::stream::once(async {}))
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(pods::reconcile, pods::error_policy, controller_ctx)
        .for_each(move |_| {
            metrics.pods_managed.set(store.len() as i64);
            futures::future::ready(())
        })
        .await
    });
    // The node is registered only once the pod watches and the lower nodes have synced (a
    // node without a working pod path would attract pods it cannot run, and one that has not
    // seen its lower nodes would show no room).
    {
        let (world, leads) = (world.clone(), candidacy.clone());
        tasks.spawn_graceful("the node loop", move |stop| async move {
            let registered = async {
                // A standby is ready once its caches have listed: it can take over at once.
                tokio::select! {
                    biased;
                    () = leads.leading() => {}
                    () = world.node_synced() => {
                        standing.synced();
                        leads.leading().await;
                    }
                }
                // Heartbeats start as soon as this replica acts, before the caches finish
                // listing; a leader is ready once its node is registered on synced caches.
                node_loop.beat_until(world.node_synced()).await;
                standing.synced();
            };
            if stop.run_until_cancelled(registered).await.is_none() {
                return;
            }
            node_loop.run(stop).await
        });
    }
    {
        let collection = Collection {
            period: Duration::from_secs(args.reflection.copy_collection_delay.clamp(1, 30)),
            namespaces: args.reflection.gc_namespaces,
            recoveries: Box::pin(ctx.lower_health.recoveries()),
            suspected: orphans_suspected,
        };
        let (ctx, world, leads) = (ctx.clone(), world.clone(), candidacy.clone());
        tasks.spawn_graceful("orphan collection", move |stop| async move {
            stop.run_until_cancelled(leads.when_leading(collection.run(&ctx, &world)))
                .await;
        });
    }
    tasks.spawn("the event publisher", events_run);
    if let Some(settings) = &token_settings {
        let keeper = crate::act::tokens::Keeper {
            upper: upper.clone(),
            lower: lower.clone(),
            identity: identity.clone(),
            settings: (**settings).clone(),
            upper_pods: world.upper_pods.clone(),
            lower_pods: world.lower_pods.clone(),
            secrets: world.lower_tokens.clone(),
            limit: ctx.lower_limit.clone(),
            metrics: resync_metrics.clone(),
            tokenless: Default::default(),
            failures: Default::default(),
            retries: Default::default(),
            unseen: Default::default(),
        };
        tasks.spawn(
            "the token keeper",
            candidacy.when_leading(keeper.run(signals.tokens_changed.clone())),
        );
    }
    let pass_deadline = Duration::from_secs(args.reconcile_timeout);
    tasks.spawn(
        "the copy resync",
        candidacy.when_leading(crate::act::resync(
            ("lower", "copy-pass-timeout"),
            world.clone(),
            signals.copies_changed.clone(),
            pass_deadline,
            resync_metrics.clone(),
            move || {
                let copies = copies.clone();
                async move {
                    copies.sync().await;
                    false
                }
            },
        )),
    );
    tasks.spawn(
        "the volume resync",
        candidacy.when_leading(crate::act::resync(
            ("both", "volume-pass-timeout"),
            world,
            signals.volumes_changed.clone(),
            pass_deadline,
            resync_metrics,
            // A class's binding mode was read: the volumes waiting for it go at once.
            move || {
                let volumes = volumes.clone();
                async move { volumes.sync().await }
            },
        )),
    );
    // Only the leader's address is on the Node; a standby's port stays closed until it leads.
    tasks.spawn_graceful("the kubelet API", move |stop| async move {
        let serve = crate::serve::routes::serve(
            kubelet_listener,
            tls,
            kubelet_limits,
            Arc::default(),
            kubelet_state,
            stop.clone(),
        );
        if stop.run_until_cancelled(candidacy.leading()).await.is_some() {
            serve.await
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_upper_tokens_go_to_no_namespace_others_share_below_and_under_a_scope_to_none() {
        use tensile_common::cache::Namespaces;
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let tokens = |listed: &[&str]| TokenArgs {
            upper_tokens: true,
            upper_api_endpoint: Some("https://upper.example:6443".into()),
            ca_file: Some(ca.clone()),
            token_namespaces: listed.iter().map(|s| (*s).to_owned()).collect(),
            renew_at: 0.8,
        };
        let shared = ["default".to_owned()];
        let all = tokens(&[])
            .settings(None, &shared, &Namespaces::All)
            .unwrap()
            .unwrap();
        assert!(all.applies("shop") && !all.applies("default"));
        // The served namespaces are the lower cluster's users': shared, so no token by default.
        let scope = Namespaces::Only(vec!["team-a".into(), "team-b".into()]);
        let scoped = tokens(&[]).settings(None, &shared, &scope).unwrap().unwrap();
        assert!(!scoped.applies("team-a") && !scoped.applies("team-b"));
        // An operator who lists a namespace means it.
        let listed = tokens(&["team-a"])
            .settings(None, &shared, &scope)
            .unwrap()
            .unwrap();
        assert!(listed.applies("team-a") && !listed.applies("team-b"));
    }

    #[test]
    fn a_namespace_scope_is_a_list_of_namespace_names_and_excludes_namespace_collection() {
        let lower = |list: &[&str]| LowerArgs {
            client_kubeconfig: "k".into(),
            client_qps: 1,
            client_burst: 1,
            namespaces: list.iter().map(|s| (*s).to_owned()).collect(),
        };
        assert_eq!(lower(&[]).scope(true), Ok(tensile_common::cache::Namespaces::All));
        assert_eq!(
            lower(&[" "]).scope(false),
            Ok(tensile_common::cache::Namespaces::All)
        );
        assert_eq!(
            lower(&["b", "a", "b"]).scope(false),
            Ok(tensile_common::cache::Namespaces::Only(vec![
                "a".into(),
                "b".into()
            ]))
        );
        for bad in ["Team", "a.b", "-a", "a_b"] {
            let e = lower(&[bad]).scope(false).unwrap_err();
            assert!(e.contains("is not a namespace name"), "{bad}: {e}");
        }
        let e = lower(&["a"]).scope(true).unwrap_err();
        assert!(
            e.contains("--gc-namespaces cannot be given with --lower-namespaces"),
            "{e}"
        );
    }
    use clap::Parser;

    #[test]
    fn flags_parse_and_bad_ones_are_named() {
        let args = Args::try_parse_from([
            "virtual-node",
            "--kubeconfig=/u",
            "--client-kubeconfig=/l",
            "--nodename=vn-a",
            "--node-ip=127.0.0.1",
            "--node-labels=zone=a,tier=x",
            "--ignore-labels=team,env",
            "--no-verify-clients",
        ])
        .unwrap();
        assert_eq!(args.nodename, "vn-a");
        assert_eq!(
            args.node_labels,
            vec![("zone".into(), "a".into()), ("tier".into(), "x".into())]
        );
        assert_eq!(args.ignore_labels, vec!["team", "env"]);
        for (bad, needle) in [
            (vec!["--nodename=Bad_Name"], "not a valid node name"),
            (vec!["--nodename=ok", "--node-ip=nope"], "nope"),
            (
                vec!["--nodename=ok", "--node-ip=127.0.0.1", "--node-labels=x"],
                "not key=value",
            ),
            (
                vec!["--nodename=ok", "--node-ip=127.0.0.1", "--pod-sync-workers=0"],
                "pod-sync-workers",
            ),
            (
                vec![
                    "--nodename=ok",
                    "--node-ip=127.0.0.1",
                    "--upper-service-account-tokens",
                ],
                "--upper-api-endpoint",
            ),
        ] {
            let mut argv = vec!["virtual-node", "--kubeconfig=/u", "--client-kubeconfig=/l"];
            argv.extend(bad);
            let err = Args::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
