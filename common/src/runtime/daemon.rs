//! The daemon builder: what every daemon's start-up shares, written once.
//!
//! In order, a daemon's `run_until`: says who it is ([`Daemon::new`], [`Daemon::product`]),
//! enters its election ([`Daemon::elect`]), builds its clients ([`Daemon::client`], or
//! [`Daemon::source`] and [`Daemon::fence`] for a second cluster or another credential),
//! binds its admin port ([`Daemon::bind_admin`]) and adds its metrics to the registry
//! ([`Daemon::registry`]), then [`Daemon::start`]s: the admin endpoint serves, the
//! replica stands for election, and the returned [`Running`] holds the tasks to compose
//! the daemon into and runs them to the end.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{CrashPoints, DEFAULT_DRAIN};
use crate::admin::{self, Readiness};
use crate::kubeconfig::{self, ClientOptions, ClientSource};
use crate::leader::{self, Candidacy, LeaderArgs, LeaderConfig, Leadership, Standing};
use crate::supervisor::{Stopped, Supervisor};

/// A daemon being assembled: its identity, its clients' settings, its election, its admin
/// port and metrics. Nothing runs until [`Daemon::start`].
pub struct Daemon {
    process: &'static str,
    replica: String,
    product: Option<String>,
    options: ClientOptions,
    shutdown: CancellationToken,
    /// `None`: the daemon stands for no election (its replicas all act).
    election: Option<Option<LeaderConfig>>,
    leadership: Leadership,
    /// The client the Lease is written with: the first source's, unfenced.
    lease: Option<kube::Client>,
    admin: Option<TcpListener>,
    registry: Registry,
    acting: String,
    note: Option<String>,
}

impl Daemon {
    /// A daemon that stops when `shutdown` is cancelled ([`super::shutdown_on_signals`] for
    /// SIGTERM and SIGINT). `process` is the binary's name, which its crash points say.
    pub fn new(process: &'static str, shutdown: CancellationToken) -> Self {
        Self {
            process,
            replica: leader::default_identity(),
            product: None,
            options: ClientOptions::default(),
            shutdown,
            election: None,
            leadership: Leadership::always(),
            lease: None,
            admin: None,
            registry: Registry::default(),
            acting: String::new(),
            note: None,
        }
    }

    /// Names the daemon in its clients' `User-Agent` (with the replica, once it stands for
    /// election, so the apiserver's audit log says which replica wrote what); the default
    /// name of its Lease.
    pub fn product(mut self, product: impl Into<String>) -> Self {
        self.product = Some(product.into());
        self
    }

    /// The settings of every client ([`kubeconfig::ClientArgs::options`], say); the
    /// daemon adds its user agent and, once elected, the fence.
    pub fn client_options(mut self, options: ClientOptions) -> Self {
        self.options = options;
        self
    }

    /// Enters the election `leader` describes, for the Lease named after the product unless
    /// the flags name another. Without `--leader-elect` the replica acts at once, and says
    /// so in the leadership metrics all the same. An error names the bad flag.
    pub fn elect(self, leader: &LeaderArgs) -> Result<Self, String> {
        let lease = self.product.clone().unwrap_or_else(|| self.process.to_owned());
        self.elect_as(leader, &lease)
    }

    /// As [`Daemon::elect`], for the Lease named `lease` unless the flags name another.
    pub fn elect_as(mut self, leader: &LeaderArgs, lease: &str) -> Result<Self, String> {
        let election = leader.config(lease, self.replica.clone())?;
        self.leadership = Leadership::of(&election);
        self.election = Some(election);
        Ok(self)
    }

    /// What `/readyz` says of a synced replica that stands for no election (`scheduling`,
    /// say); an elected one says whether it leads.
    pub fn acting(mut self, acting: impl Into<String>) -> Self {
        self.acting = acting.into();
        self
    }

    /// Added to what `/readyz` says (`dry run`, say).
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    /// This replica's identity in its election (and its events).
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The steps at which `--crash-at` (`at`) aborts this daemon.
    pub fn crash_points<S>(&self, at: Option<S>) -> CrashPoints<S> {
        CrashPoints {
            process: self.process,
            at,
        }
    }

    /// A client source of the cluster `path` configures (the pod's service account when
    /// `None`), unfenced, with the daemon's settings. The first one made also writes the
    /// Lease, with its configured credential: take it before
    /// [`ClientSource::with_identity`] swaps the credential.
    pub async fn source(&mut self, path: Option<&Path>) -> Result<ClientSource, kubeconfig::Error> {
        let mut options = self.options.clone();
        options.user_agent = match (&self.product, &self.election) {
            (Some(product), Some(_)) => Some(format!("{product} ({})", self.replica)),
            (product, None) => product.clone(),
            (None, Some(_)) => options.user_agent,
        };
        let source = ClientSource::new(path, &options).await?;
        if self.election.is_some() && self.lease.is_none() {
            self.lease = Some(source.client()?);
        }
        Ok(source)
    }

    /// `source`, its writes refused unless this replica leads (unchanged without election).
    pub fn fence(&self, source: &ClientSource) -> ClientSource {
        match &self.election {
            Some(Some(_)) => source.fenced(self.leadership.clone()),
            _ => source.clone(),
        }
    }

    /// The fenced client of the cluster `path` configures: [`Daemon::source`], then
    /// [`Daemon::fence`].
    pub async fn client(&mut self, path: Option<&Path>) -> Result<kube::Client, kubeconfig::Error> {
        let source = self.source(path).await?;
        self.fence(&source).client()
    }

    /// Binds the admin port now, so a taken port fails start-up; it serves from
    /// [`Daemon::start`] until the daemon has stopped.
    pub async fn bind_admin(&mut self, addr: SocketAddr) -> Result<(), admin::Error> {
        self.admin = Some(admin::bind(addr).await?);
        Ok(())
    }

    /// The registry `/metrics` serves, for the daemon's own metrics; the leadership
    /// metrics join them at [`Daemon::start`].
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Serves the admin endpoint and enters the election ("the leader Lease" task); the
    /// daemon's own tasks go into [`Running::tasks`]. Caches fill on standby too; what
    /// writes waits for [`Running::candidacy`] to lead.
    pub fn start(self) -> Running {
        let Daemon {
            shutdown,
            election,
            leadership,
            lease,
            admin,
            mut registry,
            acting,
            note,
            ..
        } = self;
        if election.is_some() {
            leadership.register(&mut registry);
        }
        let readiness = Readiness::default();
        let admin = admin.map(|listener| {
            let serve = admin::serve(listener, Arc::new(registry), readiness.clone());
            tokio::spawn(shutdown.clone().run_until_cancelled_owned(serve))
        });
        let mut tasks = Supervisor::new(shutdown.clone(), DEFAULT_DRAIN);
        let mut standing = Standing::new(readiness, acting);
        if let Some(note) = note {
            standing = standing.with_note(note);
        }
        let candidacy = match (election.flatten(), lease) {
            (None, _) => Candidacy::unelected(true),
            (Some(config), Some(client)) => {
                leader::stand(client, Some(config), &leadership, &standing, &mut tasks)
            }
            (Some(_), None) => {
                tasks.spawn("the leader Lease", async {
                    Err::<(), _>("no client source was made to write the Lease with")
                });
                Candidacy::unelected(false)
            }
        };
        Running {
            tasks,
            standing,
            candidacy,
            shutdown,
            admin,
        }
    }
}

/// A started daemon: its tasks, readiness and candidacy, and its admin endpoint serving.
pub struct Running {
    /// Where the daemon's own tasks go.
    pub tasks: Supervisor,
    /// Readiness as the election and the caches make it: call [`Standing::synced`] once
    /// the caches are.
    pub standing: Standing,
    /// Resolves once this replica may write.
    pub candidacy: Candidacy,
    shutdown: CancellationToken,
    admin: Option<JoinHandle<Option<()>>>,
}

impl Running {
    /// Runs the tasks until shutdown (then `Ok`, after the drain) or until one ends on its
    /// own ([`Stopped`]); then gives the Lease up and stops the admin endpoint.
    pub async fn run(self) -> Result<(), Stopped> {
        self.finish(Ok(())).await
    }

    /// As [`Running::run`] once composing the daemon went as `composed` says; when it
    /// failed, the tasks already started are stopped within the drain and its error is
    /// the daemon's.
    pub async fn finish<E: From<Stopped>>(self, composed: Result<(), E>) -> Result<(), E> {
        let Running {
            tasks,
            candidacy,
            shutdown,
            admin,
            ..
        } = self;
        let outcome = match composed {
            Ok(()) => tasks.run().await.map_err(E::from),
            Err(e) => {
                shutdown.cancel();
                let _ = tasks.run().await;
                Err(e)
            }
        };
        candidacy.release().await;
        if let Some(admin) = admin {
            admin.abort();
        }
        outcome
    }
}
