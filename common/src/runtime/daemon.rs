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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    /// What an apiserver on 127.0.0.1 was asked: method, path and user agent of each call.
    type Calls = Arc<Mutex<Vec<(String, String, String)>>>;

    /// A plain-HTTP apiserver that answers every call with an empty object (or list) and records
    /// it, and a
    /// kubeconfig naming it.
    async fn apiserver(dir: &Path) -> (std::path::PathBuf, Calls) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Calls::default();
        let seen = calls.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let seen = seen.clone();
                let service =
                    hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let agent = req
                            .headers()
                            .get(http::header::USER_AGENT)
                            .and_then(|a| a.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        let call = (req.method().to_string(), req.uri().path().to_owned(), agent);
                        seen.lock().unwrap().push(call);
                        async {
                            Ok::<_, std::convert::Infallible>(
                                hyper::Response::builder()
                                    .header("content-type", "application/json")
                                    .body(http_body_util::Full::new(bytes::Bytes::from_static(
                                        br#"{"metadata":{},"items":[]}"#,
                                    )))
                                    .unwrap(),
                            )
                        }
                    });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service),
                );
            }
        });
        let path = dir.join("kubeconfig");
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
             current-context: x\n"
        );
        std::fs::write(&path, kubeconfig).unwrap();
        (path, calls)
    }

    fn leader_elect() -> LeaderArgs {
        LeaderArgs {
            leader_elect: true,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            resource_namespace: "kube-system".into(),
            resource_name: None,
        }
    }

    async fn create(client: kube::Client) -> Result<(), kube::Error> {
        let api = kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client, "default");
        api.create(&Default::default(), &Default::default())
            .await
            .map(drop)
    }

    async fn list(client: kube::Client) {
        let api = kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client, "default");
        api.list(&Default::default()).await.unwrap();
    }

    #[tokio::test]
    async fn an_elected_daemon_names_its_replica_and_writes_nothing_but_the_lease_before_it_leads() {
        let dir = tempfile::tempdir().unwrap();
        let (kubeconfig, calls) = apiserver(dir.path()).await;
        let mut daemon = Daemon::new("test", CancellationToken::new())
            .product("tensile-test")
            .elect(&leader_elect())
            .unwrap();
        let client = daemon.client(Some(&kubeconfig)).await.unwrap();
        list(client.clone()).await;
        assert!(create(client).await.is_err(), "a write refused before leading");
        let lease = daemon.lease.clone().expect("the first source writes the Lease");
        let _ = create(lease).await;
        let agent = format!("tensile-test ({})", daemon.replica());
        let calls = calls.lock().unwrap().clone();
        let methods: Vec<&str> = calls.iter().map(|(m, _, _)| m.as_str()).collect();
        assert_eq!(
            methods,
            ["GET", "POST"],
            "only the unfenced client wrote: {calls:?}"
        );
        assert!(calls.iter().all(|(_, _, a)| *a == agent), "{calls:?}");
    }

    #[tokio::test]
    async fn a_daemon_in_no_election_writes_at_once_and_names_only_its_product() {
        let dir = tempfile::tempdir().unwrap();
        let (kubeconfig, calls) = apiserver(dir.path()).await;
        let mut daemon = Daemon::new("test", CancellationToken::new()).product("tensile-test");
        let client = daemon.client(Some(&kubeconfig)).await.unwrap();
        create(client).await.unwrap();
        let running = daemon.start();
        tokio::time::timeout(Duration::from_secs(1), running.candidacy.leading())
            .await
            .expect("a replica in no election leads at once");
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0].2, "tensile-test");
    }

    #[tokio::test]
    async fn a_daemon_that_stands_for_election_with_no_client_stops_and_says_why() {
        let daemon = Daemon::new("test", CancellationToken::new())
            .elect(&leader_elect())
            .unwrap();
        let stopped = daemon.start().run().await.unwrap_err();
        assert_eq!(stopped.task, "the leader Lease");
        assert_eq!(
            stopped.reason.as_deref(),
            Some("no client source was made to write the Lease with")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_composition_that_failed_stops_the_tasks_started_and_is_the_daemons_error() {
        let mut running = Daemon::new("test", CancellationToken::new()).start();
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = finished.clone();
        running
            .tasks
            .spawn_graceful("the work in hand", move |stop| async move {
                stop.cancelled().await;
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            });
        let composed: Result<(), Stopped> = Err(Stopped {
            task: "composing",
            reason: Some("a bad flag".into()),
        });
        let err = running.finish(composed).await.unwrap_err();
        assert_eq!(err.to_string(), "composing stopped: a bad flag");
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
    }
}
