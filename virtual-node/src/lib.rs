//! virtual-node: one lower cluster as one honest Node of the upper cluster.
//!
//! The model: every upper pod bound to the node (`spec.nodeName`) has at most one lower pod
//! of the same namespace and name, carrying marks that name the upper cluster, this node and
//! the upper pod's UID. A level-triggered controller drives each pair toward agreement:
//! create below, follow mutable fields, bring status up, delete down then up. The node loop
//! keeps the Node, its Lease and its status true to the lower cluster: capacity from watched
//! lower nodes and pods, Ready from a timed probe. The kubelet API forwards logs, exec,
//! attach, port-forward and stats to the lower cluster. Nothing without our marks is ever
//! modified or deleted.
//!
//! The shape, one folder per layer, each importing only the layers below it:
//! - [`model`]: the concepts every layer reads (what a pod references, the kept forms of
//!   pods and the load a pod puts on its node, what of each reflected kind travels, a
//!   scale-up signal). The node's identity and marks below, the override rules and the
//!   teardown are `tensile_common::lower`, shared with the cluster controller.
//! - [`world`]: what the node watches and holds, every cache behind one sync gate.
//! - [`decide`]: pure planners, one per concern, unit-tested on small objects.
//! - [`act`]: what the node writes: the controllers and loops that perform the plans, one
//!   executor for the resyncs' writes.
//! - [`serve`]: the kubelet API.
//!
//! [`run`] assembles the daemon on the shared runtime (`tensile_common::runtime::Daemon`);
//! the composition of one node, part by part, is `compose`.

mod args;
mod compose;

pub mod act;
pub mod decide;
pub mod metrics;
pub mod model;
pub mod serve;
pub mod world;

pub use args::{
    Args, Controllers, KubeletArgs, KubeletAuthorization, LowerArgs, ReflectionArgs, TokenArgs, UpperArgs,
    UpperIdentity,
};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensile_common::kubeconfig::NodeCredential;
use tensile_common::node_identity;
use tensile_common::runtime::{self, CancellationToken, Daemon};

use crate::serve::kubelet::{self, ClientAuth, ServingCert};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Kubeconfig(#[from] tensile_common::kubeconfig::Error),
    #[error("{0}")]
    Kubelet(#[from] kubelet::Error),
    #[error("{0}")]
    Admin(#[from] tensile_common::admin::Error),
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

/// Runs the virtual node until SIGTERM or SIGINT (then `Ok`, after a graceful drain) or
/// until a component fails.
pub async fn run(args: Args) -> Result<(), Error> {
    let shutdown = runtime::shutdown_on_signals().map_err(Error::Signal)?;
    run_until(args, shutdown).await
}

/// As [`run`], stopping gracefully when `shutdown` is cancelled.
pub async fn run_until(args: Args, shutdown: CancellationToken) -> Result<(), Error> {
    // Every request names the replica, so the apiserver's audit log says who wrote what.
    let mut daemon = Daemon::new("virtual-node", shutdown)
        .product(format!("tensile-virtual-node/{}", args.nodename))
        .client_options(args.client.options())
        .elect_as(&args.leader, &format!("tensile-virtual-node-{}", args.nodename))
        .map_err(Error::Flags)?;
    let policy = compose::Policy::of(&args)?;
    // The first source writes the election's Lease, with the configured credential:
    // NodeRestriction lets a node write no Lease but its heartbeat.
    let mut upper_source = daemon.source(args.upper.kubeconfig.as_deref()).await?;
    let mut renewal = None;
    if args.upper.identity == UpperIdentity::Node {
        // The configured credential only asks for the node's certificate, now and at renewal.
        let asking = upper_source.client()?;
        let timeout = Duration::from_secs(args.upper.certificate_timeout);
        let issued = node_identity::request(&asking, &args.nodename, timeout).await?;
        tracing::info!(node = %args.nodename, not_after = issued.not_after, "acting as {}", node_identity::user(&args.nodename));
        let credential = NodeCredential::new(issued);
        upper_source = upper_source.with_identity(credential.clone());
        renewal = Some(act::node::renew(
            asking,
            args.nodename.clone(),
            credential,
            timeout,
        ));
    }
    let lower_source = daemon.source(Some(&args.lower.client_kubeconfig)).await?;
    // Reviews of kubelet API callers are answered on any replica, so they are unfenced;
    // everything else writes only while leading.
    let review_client = upper_source.client()?;
    let lower_source = daemon.fence(&lower_source);
    let clients = compose::Clients {
        upper_source: daemon.fence(&upper_source),
        lower: lower_source.client()?,
        // The kubelet API's own lower client: exec, attach, port-forward and logs are
        // relayed write by write ([`kubeconfig::ClientSource::stream_client`]).
        lower_streams: lower_source.stream_client()?,
    };
    let serving = serving(&args, review_client).await?;
    daemon.bind_admin(args.admin.admin_addr).await?;
    let metrics = Arc::new(metrics::Metrics::new(daemon.registry()));
    // The admin endpoint serves from the start, so a standby replica says it stands by; the
    // world fills on standby too, and takes over with its caches current.
    let mut running = daemon.start();
    if let Some(renewal) = renewal {
        running.tasks.spawn("the node certificate renewal", renewal);
    }
    let composed = compose::compose(&args, clients, serving, policy, metrics, &mut running).await;
    running.finish(composed).await
}

/// The kubelet API's TLS, its bound port and who may call it.
async fn serving(args: &Args, review_client: kube::Client) -> Result<compose::Serving, Error> {
    let auth = match (&args.kubelet.client_verify_ca, args.kubelet.no_verify_clients) {
        (Some(ca), _) => ClientAuth::Ca(ca.clone()),
        (None, true) => ClientAuth::None,
        (None, false) => return Err(Error::NoClientAuth),
    };
    let cert = match (&args.kubelet.tls_cert_file, &args.kubelet.tls_private_key_file) {
        (Some(cert), Some(key)) => ServingCert::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        _ => ServingCert::SelfSigned(vec![args.kubelet.node_ip.to_string(), args.nodename.clone()]),
    };
    Ok(compose::Serving {
        tls: kubelet::tls_config(&cert, &auth)?,
        listener: kubelet::bind(SocketAddr::new(args.kubelet.node_ip, args.kubelet.kubelet_port)).await?,
        auth,
        authorizer: match args.kubelet.authorization {
            KubeletAuthorization::Webhook => kubelet::Authorizer::webhook(review_client),
            KubeletAuthorization::AlwaysAllow => kubelet::Authorizer::AlwaysAllow,
        },
    })
}
