//! Leader election on `coordination.k8s.io/v1` Leases (served by every supported Kubernetes
//! version), with client-go's algorithm and flag names.
//!
//! A candidate takes the Lease when it is free, released, or has not changed for a whole
//! lease duration as this candidate observed it (its own clock, never the holder's
//! timestamps). The leader renews every retry period. Fencing: the leader may write only
//! until `renew deadline` after the start of its last successful renewal; the renew deadline
//! is shorter than the lease duration, so a leader that cannot renew (partitioned, paused,
//! starved) stops writing before anyone else can acquire. Writes are refused by
//! [`FenceLayer`] on the daemon's clients, so no code path can write past the fence. A
//! leader that lost the Lease ends: the daemon exits and its restart is a candidate again,
//! as kube-controller-manager and kube-scheduler do.
//!
//! A standby fills its caches as the leader does and only waits to act ([`stand`],
//! [`Candidacy::leading`]); once they have synced it is ready (`/readyz` 200, `ok: standby:
//! …`), as a replica that can take over at once should be, while `tensile_leader` says 0
//! ([`Standing`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Method, Request};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::deadline::BoxError;

/// Leader-election flags, client-go's spellings.
#[derive(Clone, Debug, clap::Args)]
pub struct LeaderArgs {
    /// Run as one of several replicas: only the holder of the Lease acts.
    #[arg(long = "leader-elect", env = "TENSILE_LEADER_ELECT")]
    pub leader_elect: bool,
    /// How long a Lease not renewed keeps others from taking it (for example `15s`).
    #[arg(long = "leader-elect-lease-duration", env = "TENSILE_LEADER_ELECT_LEASE_DURATION",
          default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// How long the leader keeps acting without a successful renewal; shorter than the lease
    /// duration, so it stops before another replica can take over.
    #[arg(long = "leader-elect-renew-deadline", env = "TENSILE_LEADER_ELECT_RENEW_DEADLINE",
          default_value = "10s", value_parser = parse_duration)]
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews.
    #[arg(long = "leader-elect-retry-period", env = "TENSILE_LEADER_ELECT_RETRY_PERIOD",
          default_value = "2s", value_parser = parse_duration)]
    pub retry_period: Duration,
    /// Namespace of the Lease.
    #[arg(
        long = "leader-elect-resource-namespace",
        env = "TENSILE_LEADER_ELECT_RESOURCE_NAMESPACE",
        default_value = "kube-system"
    )]
    pub resource_namespace: String,
    /// Name of the Lease (each daemon has its own default).
    #[arg(
        long = "leader-elect-resource-name",
        env = "TENSILE_LEADER_ELECT_RESOURCE_NAME"
    )]
    pub resource_name: Option<String>,
}

/// A duration as client-go's flags write it: `15s`, `500ms`, `1m`, `1m30s`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration (for example 15s, 500ms, 1m30s)");
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    // Zero needs no unit, as in Go's time.ParseDuration.
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            _ => return Err(bad()),
        };
        total += unit;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// The timing of an election, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    /// Who this replica is (in the Lease's `holderIdentity`).
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaderArgs {
    /// The election these flags ask for, `None` without `--leader-elect`. `default_name` names
    /// the Lease unless `--leader-elect-resource-name` does.
    pub fn config(&self, default_name: &str, identity: String) -> Result<Option<LeaderConfig>, String> {
        if !self.leader_elect {
            return Ok(None);
        }
        // client-go's rules: the leader must give up before the Lease can expire, and retry
        // (with up to 20 % jitter) at least once before it must give up.
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "--leader-elect-lease-duration ({:?}) must be longer than --leader-elect-renew-deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return Err(format!(
                "--leader-elect-renew-deadline ({:?}) must be longer than 1.2 x --leader-elect-retry-period ({:?})",
                self.renew_deadline, self.retry_period
            ));
        }
        if self.retry_period.is_zero() {
            return Err("--leader-elect-retry-period must be positive".into());
        }
        Ok(Some(LeaderConfig {
            namespace: self.resource_namespace.clone(),
            name: self
                .resource_name
                .clone()
                .unwrap_or_else(|| default_name.to_owned()),
            identity,
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        }))
    }
}

/// A replica's identity: host name and process id, unique among replicas.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tensile".into());
    format!("{host}_{}", std::process::id())
}

/// Whether this process may write now; shared by the elector and the fenced clients.
#[derive(Clone, Debug)]
pub struct Leadership(Arc<State>);

#[derive(Debug)]
struct State {
    elected: bool,
    until: Mutex<Option<Instant>>,
    leading: Gauge,
    lost: Counter,
    refused: Counter,
}

impl Leadership {
    /// No election: this process may always write.
    pub fn always() -> Self {
        Self::new(false)
    }

    /// An elected process, not leading until an [`Elector`] acquires.
    pub fn elected() -> Self {
        Self::new(true)
    }

    /// [`Leadership::elected`] when there is an election to take part in, otherwise
    /// [`Leadership::always`].
    pub fn of(election: &Option<LeaderConfig>) -> Self {
        Self::new(election.is_some())
    }

    fn new(elected: bool) -> Self {
        Leadership(Arc::new(State {
            elected,
            until: Mutex::new(None),
            leading: Gauge::default(),
            lost: Counter::default(),
            refused: Counter::default(),
        }))
    }

    /// Registers `tensile_leader`, `tensile_leader_lost_total` and
    /// `tensile_leader_refused_writes_total`.
    pub fn register(&self, registry: &mut Registry) {
        if !self.0.elected {
            self.0.leading.set(1);
        }
        registry.register(
            "tensile_leader",
            "1 while this replica may act (leads, or runs without election), 0 on standby",
            self.0.leading.clone(),
        );
        registry.register(
            "tensile_leader_lost",
            "Times this replica stopped acting because it could not renew its Lease",
            self.0.lost.clone(),
        );
        registry.register(
            "tensile_leader_refused_writes",
            "API writes refused because this replica did not hold the Lease",
            self.0.refused.clone(),
        );
    }

    /// Whether a write may be sent now.
    pub fn may_write(&self) -> bool {
        !self.0.elected
            || self
                .0
                .until
                .lock()
                .is_ok_and(|until| until.is_some_and(|u| Instant::now() < u))
    }

    fn extend(&self, until: Instant) {
        if let Ok(mut u) = self.0.until.lock() {
            *u = Some(until);
        }
        self.0.leading.set(1);
    }

    fn revoke(&self) {
        if let Ok(mut u) = self.0.until.lock() {
            *u = None;
        }
        self.0.leading.set(0);
    }
}

/// The error of a write refused by the fence.
#[derive(Debug, thiserror::Error)]
#[error("{0}: refused, this replica does not hold the leader Lease")]
pub struct NotLeading(String);

/// Refuses writes (every method but GET, HEAD and OPTIONS) unless [`Leadership::may_write`].
#[derive(Clone, Debug)]
pub struct FenceLayer {
    pub leadership: Leadership,
}

impl<S> tower::Layer<S> for FenceLayer {
    type Service = Fence<S>;

    fn layer(&self, inner: S) -> Fence<S> {
        Fence {
            inner,
            leadership: self.leadership.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Fence<S> {
    inner: S,
    leadership: Leadership,
}

impl<S, B> tower::Service<Request<B>> for Fence<S>
where
    S: tower::Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let reads = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
        if !reads && !self.leadership.may_write() {
            self.leadership.0.refused.inc();
            let what = format!("{} {}", req.method(), req.uri().path());
            return Box::pin(async move { Err(Box::new(NotLeading(what)) as BoxError) });
        }
        let call = self.inner.call(req);
        Box::pin(async move { call.await.map_err(Into::into) })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "lost the leader Lease {namespace}/{name}: no renewal succeeded within the renew deadline ({deadline:?}); last error: {last}"
    )]
    Lost {
        namespace: String,
        name: String,
        deadline: Duration,
        last: String,
    },
}

/// The Lease record as this candidate last saw it, and when it saw it change.
struct Observed {
    spec: Option<LeaseSpec>,
    at: Instant,
}

/// One candidate in an election.
pub struct Elector {
    leases: Api<Lease>,
    config: LeaderConfig,
    leadership: Leadership,
    observed: Mutex<Observed>,
    /// The Lease as this candidate last wrote it while holding it: a renewal writes over it
    /// directly, one call instead of a read and a write (kube-scheduler's elector does the
    /// same), and reads first only when that write is refused.
    written: Mutex<Option<Lease>>,
}

/// What one attempt to acquire or renew found.
enum Attempt {
    Leading,
    HeldBy(String),
    Failed(String),
}

impl Elector {
    /// `client` must not be fenced by `leadership` (it writes the Lease itself).
    pub fn new(client: kube::Client, config: LeaderConfig, leadership: Leadership) -> Self {
        Self {
            leases: Api::namespaced(client, &config.namespace),
            config,
            leadership,
            observed: Mutex::new(Observed {
                spec: None,
                at: Instant::now(),
            }),
            written: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &LeaderConfig {
        &self.config
    }

    /// Waits until this candidate holds the Lease; `standby` is told who holds it meanwhile.
    pub async fn acquire(&self, mut standby: impl FnMut(&str)) {
        let mut last_holder = String::new();
        loop {
            let started = Instant::now();
            match self.try_acquire_or_renew().await {
                Attempt::Leading => {
                    tracing::info!(lease = %self.lease_name(), identity = %self.config.identity, "acquired the leader Lease");
                    return;
                }
                Attempt::HeldBy(holder) => {
                    if holder != last_holder {
                        tracing::info!(lease = %self.lease_name(), %holder, "standing by: the leader Lease is held");
                        standby(&holder);
                        last_holder = holder;
                    }
                }
                Attempt::Failed(e) => {
                    tracing::warn!(lease = %self.lease_name(), "acquiring the leader Lease: {e}")
                }
            }
            tokio::time::sleep_until(self.next_attempt(started)).await;
        }
    }

    /// When a candidate that does not hold the Lease tries again: a retry period after its
    /// last attempt began (a slow apiserver does not push every later attempt back by its
    /// answers), or when the Lease it watches expires if that is sooner and was still ahead
    /// when the attempt began (a Lease found expired whose write failed is tried again a
    /// retry period on); never sooner than a fifth of a retry period from now.
    fn next_attempt(&self, started: Instant) -> Instant {
        let mut next = started + self.config.retry_period;
        if let Some(expires) = self.observed_expiry().filter(|e| *e > started) {
            next = next.min(expires);
        }
        next.max(Instant::now() + self.config.retry_period / 5)
    }

    /// When the Lease as last observed expires: a lease duration after this candidate saw
    /// it change.
    fn observed_expiry(&self) -> Option<Instant> {
        let observed = self.observed.lock().ok()?;
        let lease = observed
            .spec
            .as_ref()?
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.config.lease_duration);
        Some(observed.at + lease)
    }

    /// Renews every retry period while leading; returns [`Error::Lost`] once no renewal
    /// succeeded within the renew deadline (the fence closed at that instant).
    pub async fn keep(&self) -> Result<(), Error> {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(self.config.retry_period).await;
            let started = Instant::now();
            let attempt =
                tokio::time::timeout_at(last_ok + self.config.renew_deadline, self.try_acquire_or_renew())
                    .await
                    .unwrap_or_else(|_| {
                        Attempt::Failed("the renewal did not finish before the renew deadline".into())
                    });
            let last = match attempt {
                Attempt::Leading => {
                    last_ok = started;
                    continue;
                }
                Attempt::HeldBy(holder) => format!("the Lease is held by {holder}"),
                Attempt::Failed(e) => e,
            };
            if Instant::now() >= last_ok + self.config.renew_deadline || last.starts_with("the Lease is held")
            {
                self.leadership.revoke();
                self.leadership.0.lost.inc();
                let err = Error::Lost {
                    namespace: self.config.namespace.clone(),
                    name: self.config.name.clone(),
                    deadline: self.config.renew_deadline,
                    last,
                };
                tracing::error!("{err}");
                return Err(err);
            }
            tracing::warn!(lease = %self.lease_name(), "renewing the leader Lease: {last}");
        }
    }

    /// Gives the Lease up (a clean shutdown), so a standby takes over without waiting for it
    /// to expire. Writes are fenced off first.
    pub async fn release(&self) {
        let was_leading = self.leadership.may_write();
        self.leadership.revoke();
        if let Ok(mut written) = self.written.lock() {
            *written = None;
        }
        if !was_leading {
            return;
        }
        let Ok(Some(mut lease)) = self.leases.get_opt(&self.config.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        match self
            .leases
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!(lease = %self.lease_name(), "released the leader Lease"),
            Err(e) => tracing::warn!(lease = %self.lease_name(), "releasing the leader Lease: {e}"),
        }
    }

    fn lease_name(&self) -> String {
        format!("{}/{}", self.config.namespace, self.config.name)
    }

    fn desired(&self, old: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(jiff::Timestamp::now());
        let held_by_me =
            old.and_then(|s| s.holder_identity.as_deref()) == Some(self.config.identity.as_str());
        let transitions = old.and_then(|s| s.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_duration.as_secs().max(1) as i32),
            acquire_time: if held_by_me {
                old.and_then(|s| s.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if held_by_me || old.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..Default::default()
        }
    }

    async fn try_acquire_or_renew(&self) -> Attempt {
        if let Some(renewed) = self.renew_written().await {
            return renewed;
        }
        match self.attempt().await {
            // Another candidate created the Lease first: it holds it, and this one says so at
            // once rather than a retry period later.
            Err(Created::ByAnother) => self.attempt().await.unwrap_or_else(Created::failed),
            Err(created) => created.failed(),
            Ok(attempt) => attempt,
        }
    }

    /// The renewal of a Lease this candidate holds, written over the Lease as it last wrote
    /// it; `None` when it holds none, or the write was refused (another wrote the Lease
    /// since, or the call failed): the caller then reads the Lease first.
    async fn renew_written(&self) -> Option<Attempt> {
        let mut lease = self.written.lock().ok()?.take()?;
        let started = Instant::now();
        lease.spec = Some(self.desired(lease.spec.as_ref()));
        match self
            .leases
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => Some(self.won(updated, started)),
            Err(_) => None,
        }
    }

    /// One look at the Lease and, where it is free, a write taking it; `Err` when creating it
    /// failed.
    async fn attempt(&self) -> Result<Attempt, Created> {
        let started = Instant::now();
        let current = match self.leases.get_opt(&self.config.name).await {
            Ok(l) => l,
            Err(e) => return Ok(Attempt::Failed(format!("reading the Lease: {e}"))),
        };
        let Some(mut lease) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(self.desired(None)),
            };
            return match self.leases.create(&PostParams::default(), &lease).await {
                Ok(created) => Ok(self.won(created, started)),
                Err(kube::Error::Api(s)) if s.code == 409 => Err(Created::ByAnother),
                Err(e) => Err(Created::Failed(e.to_string())),
            };
        };
        let spec = lease.spec.clone();
        let holder = spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default();
        let observed_at = {
            let Ok(mut observed) = self.observed.lock() else {
                return Ok(Attempt::Failed("the observed Lease record is poisoned".into()));
            };
            if observed.spec != spec {
                observed.spec = spec.clone();
                observed.at = Instant::now();
            }
            observed.at
        };
        let lease_secs = spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.config.lease_duration);
        if !holder.is_empty() && holder != self.config.identity && Instant::now() < observed_at + lease_secs {
            return Ok(Attempt::HeldBy(holder));
        }
        lease.spec = Some(self.desired(spec.as_ref()));
        Ok(
            match self
                .leases
                .replace(&self.config.name, &PostParams::default(), &lease)
                .await
            {
                Ok(updated) => self.won(updated, started),
                Err(kube::Error::Api(s)) if s.code == 409 => Attempt::HeldBy(if holder.is_empty() {
                    "another candidate".into()
                } else {
                    holder
                }),
                Err(e) => Attempt::Failed(format!("writing the Lease: {e}")),
            },
        )
    }

    fn won(&self, written: Lease, started: Instant) -> Attempt {
        if let Ok(mut observed) = self.observed.lock() {
            observed.spec = written.spec.clone();
            observed.at = Instant::now();
        }
        if let Ok(mut kept) = self.written.lock() {
            *kept = Some(written);
        }
        self.leadership.extend(started + self.config.renew_deadline);
        Attempt::Leading
    }
}

/// Why creating the Lease failed.
enum Created {
    /// Another candidate created it first (409).
    ByAnother,
    Failed(String),
}

impl Created {
    fn failed(self) -> Attempt {
        match self {
            Created::ByAnother => {
                Attempt::Failed("creating the Lease: another candidate created it meanwhile".into())
            }
            Created::Failed(e) => Attempt::Failed(format!("creating the Lease: {e}")),
        }
    }
}

/// Where a replica stands in its election.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    /// No election: it acts.
    Unelected,
    /// Trying for the Lease, no holder seen yet.
    Acquiring,
    /// Another replica holds the Lease.
    Standby {
        holder: String,
    },
    Leading {
        identity: String,
    },
    /// It could not renew the Lease and stops.
    Lost,
}

/// What `/readyz` says of a replica, from its role and whether its caches have synced.
#[derive(Clone, Debug)]
struct Stand {
    role: Role,
    synced: bool,
    /// Said when ready without an election (for example `scheduling`).
    acting: String,
    /// Said after the role (for example `dry run`).
    note: String,
}

impl Stand {
    /// Ready once the caches have synced, leading or on standby: a standby is then ready to
    /// take over (a Deployment of several replicas becomes Available, a rollout proceeds, a
    /// disruption budget lets the leader's node drain). Never ready again after a lost Lease.
    fn answer(&self) -> (bool, String) {
        let role = match &self.role {
            Role::Lost => return (false, "lost the leader Lease; stopping".into()),
            Role::Unelected if self.synced => self.acting.clone(),
            Role::Unelected => String::new(),
            Role::Acquiring => "standby: acquiring the leader Lease".into(),
            Role::Standby { holder } => format!("standby: the leader Lease is held by {holder}"),
            Role::Leading { identity } => format!("leading as {identity}"),
        };
        let syncing = if self.synced { "" } else { "caches syncing" };
        let said: Vec<&str> = [role.as_str(), self.note.as_str(), syncing]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        (self.synced, said.join("; "))
    }
}

/// A replica's readiness as its election and its caches make it, written to the
/// [`Readiness`](crate::admin::Readiness) that `/readyz` answers from.
#[derive(Clone, Debug)]
pub struct Standing {
    readiness: crate::admin::Readiness,
    stand: Arc<Mutex<Stand>>,
}

impl Standing {
    /// Not ready (caches syncing). `acting` is what a synced replica without election says.
    pub fn new(readiness: crate::admin::Readiness, acting: impl Into<String>) -> Self {
        let standing = Self {
            readiness,
            stand: Arc::new(Mutex::new(Stand {
                role: Role::Unelected,
                synced: false,
                acting: acting.into(),
                note: String::new(),
            })),
        };
        standing.update(|_| {});
        standing
    }

    /// Adds `note` to what a ready or syncing replica says (for example `dry run`).
    pub fn with_note(self, note: impl Into<String>) -> Self {
        let note = note.into();
        self.update(|s| s.note = note);
        self
    }

    /// The caches have synced: the replica is ready, to act or to take over.
    pub fn synced(&self) {
        self.update(|s| s.synced = true);
    }

    fn role(&self, role: Role) {
        self.update(|s| {
            // A lost Lease is final: the process is stopping.
            if s.role != Role::Lost {
                s.role = role;
            }
        });
    }

    fn update(&self, change: impl FnOnce(&mut Stand)) {
        let Ok(mut stand) = self.stand.lock() else {
            return;
        };
        change(&mut stand);
        let (ready, why) = stand.answer();
        self.readiness.say(ready, why);
    }
}

/// This replica's part in its election: resolves [`Candidacy::leading`] once it may act, and
/// gives the Lease up on exit.
#[derive(Clone)]
pub struct Candidacy {
    leading: tokio::sync::watch::Receiver<bool>,
    elector: Option<Arc<Elector>>,
}

impl Candidacy {
    /// A candidacy in no election: it leads at once when `leads`, never otherwise.
    pub(crate) fn unelected(leads: bool) -> Self {
        let (_, leading) = tokio::sync::watch::channel(leads);
        Self {
            leading,
            elector: None,
        }
    }

    /// Resolves once this replica leads (at once without election); never on standby.
    pub async fn leading(&self) {
        let mut leading = self.leading.clone();
        if leading.wait_for(|l| *l).await.is_err() {
            // The election task ended without leading (shutdown): never act.
            futures::future::pending::<()>().await;
        }
    }

    /// `work`, started once this replica leads.
    pub fn when_leading<F: Future>(&self, work: F) -> impl Future<Output = F::Output> + use<F> {
        let candidacy = self.clone();
        async move {
            candidacy.leading().await;
            work.await
        }
    }

    /// Gives the Lease up, when this replica holds it ([`Elector::release`]).
    pub async fn release(&self) {
        if let Some(elector) = &self.elector {
            elector.release().await;
        }
    }
}

/// Enters this replica in the election `config` asks for, as the task "the leader Lease" of
/// `tasks`: it stands by until it holds the Lease, then keeps it, and ends the daemon when it
/// loses it. `standing` follows (standby, leading, lost); without `config` the replica acts
/// at once. Caches and watches start meanwhile, on standby too; what writes waits for
/// [`Candidacy::leading`].
pub fn stand(
    client: kube::Client,
    config: Option<LeaderConfig>,
    leadership: &Leadership,
    standing: &Standing,
    tasks: &mut crate::supervisor::Supervisor,
) -> Candidacy {
    let (leading, candidacy) = tokio::sync::watch::channel(config.is_none());
    let Some(config) = config else {
        return Candidacy {
            leading: candidacy,
            elector: None,
        };
    };
    let elector = Arc::new(Elector::new(client, config, leadership.clone()));
    standing.role(Role::Acquiring);
    let (keeper, standing) = (elector.clone(), standing.clone());
    tasks.spawn("the leader Lease", async move {
        keeper
            .acquire(|holder| {
                standing.role(Role::Standby {
                    holder: holder.to_owned(),
                })
            })
            .await;
        standing.role(Role::Leading {
            identity: keeper.config().identity.clone(),
        });
        leading.send_replace(true);
        let kept = keeper.keep().await;
        if kept.is_err() {
            standing.role(Role::Lost);
        }
        kept
    });
    Candidacy {
        leading: candidacy,
        elector: Some(elector),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        leader: LeaderArgs,
    }

    fn flags(extra: &[&str]) -> Result<LeaderArgs, clap::Error> {
        let mut argv = vec!["d"];
        argv.extend(extra);
        Flags::try_parse_from(argv).map(|f| f.leader)
    }

    #[test]
    fn durations_read_as_client_go_writes_them() {
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO), "zero needs no unit");
        assert!(parse_duration("5").is_err(), "any other number does");
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in ["", "15", "s", "1.5s", "10x", "-1s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn without_the_flag_there_is_no_election_and_defaults_are_client_gos() {
        assert_eq!(flags(&[]).unwrap().config("vn", "me".into()), Ok(None));
        let config = flags(&["--leader-elect"])
            .unwrap()
            .config("tensile-virtual-node-a", "me".into())
            .unwrap()
            .unwrap();
        assert_eq!(config.namespace, "kube-system");
        assert_eq!(config.name, "tensile-virtual-node-a");
        assert_eq!(
            (config.lease_duration, config.renew_deadline, config.retry_period),
            (
                Duration::from_secs(15),
                Duration::from_secs(10),
                Duration::from_secs(2)
            )
        );
    }

    #[test]
    fn a_renew_deadline_that_does_not_fence_is_refused() {
        let err = flags(&[
            "--leader-elect",
            "--leader-elect-lease-duration=10s",
            "--leader-elect-renew-deadline=10s",
        ])
        .unwrap()
        .config("x", "me".into())
        .unwrap_err();
        assert!(
            err.contains("must be longer than --leader-elect-renew-deadline"),
            "{err}"
        );
        let err = flags(&[
            "--leader-elect",
            "--leader-elect-renew-deadline=2s",
            "--leader-elect-retry-period=2s",
        ])
        .unwrap()
        .config("x", "me".into())
        .unwrap_err();
        assert!(err.contains("retry-period"), "{err}");
        let err = flags(&["--leader-elect-lease-duration=forever"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not a duration"), "{err}");
    }

    fn said(readiness: &crate::admin::Readiness) -> (bool, String) {
        (readiness.get(), readiness.why())
    }

    #[test]
    fn a_standby_is_ready_once_synced_and_says_it_stands_by() {
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "");
        standing.role(Role::Acquiring);
        assert_eq!(
            said(&readiness),
            (
                false,
                "standby: acquiring the leader Lease; caches syncing".into()
            )
        );
        standing.role(Role::Standby {
            holder: "host-a_7".into(),
        });
        assert_eq!(
            said(&readiness),
            (
                false,
                "standby: the leader Lease is held by host-a_7; caches syncing".into()
            )
        );
        standing.synced();
        assert_eq!(
            said(&readiness),
            (true, "standby: the leader Lease is held by host-a_7".into()),
            "ready to take over"
        );
        standing.role(Role::Leading {
            identity: "host-b_9".into(),
        });
        assert_eq!(said(&readiness), (true, "leading as host-b_9".into()));
    }

    #[test]
    fn a_lost_lease_is_not_ready_until_the_process_ends() {
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "");
        standing.role(Role::Leading {
            identity: "me".into(),
        });
        standing.synced();
        assert!(readiness.get());
        standing.role(Role::Lost);
        assert_eq!(
            said(&readiness),
            (false, "lost the leader Lease; stopping".into())
        );
        standing.synced();
        standing.role(Role::Leading {
            identity: "me".into(),
        });
        assert_eq!(
            said(&readiness),
            (false, "lost the leader Lease; stopping".into()),
            "nothing makes it ready again"
        );
    }

    #[test]
    fn without_election_a_replica_says_what_it_does_once_synced() {
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "scheduling");
        assert_eq!(said(&readiness), (false, "caches syncing".into()));
        standing.synced();
        assert_eq!(said(&readiness), (true, "scheduling".into()));
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "").with_note("dry run");
        assert_eq!(said(&readiness), (false, "dry run; caches syncing".into()));
        standing.role(Role::Leading {
            identity: "me".into(),
        });
        standing.synced();
        assert_eq!(said(&readiness), (true, "leading as me; dry run".into()));
        let readiness = crate::admin::Readiness::default();
        Standing::new(readiness.clone(), "").synced();
        assert_eq!(said(&readiness), (true, String::new()), "`ok` alone");
    }

    /// An apiserver serving one Lease: held by `holder` and renewed at every read (so it never
    /// expires), or missing when `holder` is `None` (then a create wins it).
    fn lease_server(holder: Option<&'static str>) -> kube::Client {
        let service = tower::service_fn(move |req: Request<kube::client::Body>| async move {
            let lease = |holder: &str| {
                serde_json::json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "tensile-test", "namespace": "ns", "resourceVersion": "1"},
                    "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                             "renewTime": jiff::Timestamp::now().to_string()},
                })
            };
            let status = |code: u16, reason: &str| {
                serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "reason": reason, "code": code})
            };
            let (code, body) = match (req.method(), holder) {
                (&Method::GET, Some(h)) => (200, lease(h)),
                (&Method::GET, None) => (404, status(404, "NotFound")),
                (&Method::POST, None) => (201, lease("me")),
                _ => (409, status(409, "Conflict")),
            };
            let body = kube::client::Body::from(serde_json::to_vec(&body).unwrap_or_default());
            http::Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(body)
                .map_err(|e| Box::new(e) as BoxError)
        });
        kube::Client::new(service, "ns")
    }

    fn election() -> LeaderConfig {
        LeaderConfig {
            namespace: "ns".into(),
            name: "tensile-test".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    async fn until_said(readiness: &crate::admin::Readiness, says: &str) {
        for _ in 0..600 {
            if readiness.why().contains(says) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("/readyz never said {says:?}; it says {:?}", readiness.why());
    }

    #[tokio::test(start_paused = true)]
    async fn a_synced_standby_is_ready_and_never_acts_while_another_replica_holds_the_lease() {
        let shutdown = crate::runtime::CancellationToken::new();
        let mut tasks = crate::runtime::Supervisor::new(shutdown.clone(), Duration::from_secs(1));
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "");
        let leadership = Leadership::elected();
        let candidacy = stand(
            lease_server(Some("other_1")),
            Some(election()),
            &leadership,
            &standing,
            &mut tasks,
        );
        let run = tokio::spawn(tasks.run());
        until_said(&readiness, "held by other_1").await;
        assert_eq!(
            said(&readiness),
            (
                false,
                "standby: the leader Lease is held by other_1; caches syncing".into()
            )
        );
        standing.synced();
        assert_eq!(
            said(&readiness),
            (true, "standby: the leader Lease is held by other_1".into())
        );
        assert!(
            tokio::time::timeout(Duration::from_secs(120), candidacy.leading())
                .await
                .is_err(),
            "a standby never acts"
        );
        assert!(!leadership.may_write());
        assert!(readiness.get(), "still ready to take over");
        shutdown.cancel();
        run.await.unwrap().unwrap();
    }

    /// The methods an apiserver was called with.
    type Calls = Arc<Mutex<Vec<String>>>;

    /// An apiserver of one Lease that keeps what is written to it (its resourceVersion
    /// shared), and the methods it was called with.
    fn recording_lease_server() -> (kube::Client, Calls, Arc<Mutex<u64>>) {
        let calls: Arc<Mutex<Vec<String>>> = Arc::default();
        let version: Arc<Mutex<u64>> = Arc::new(Mutex::new(0));
        let (seen, current) = (calls.clone(), version.clone());
        let service = tower::service_fn(move |req: Request<kube::client::Body>| {
            let (seen, current) = (seen.clone(), current.clone());
            async move {
                let method = req.method().clone();
                seen.lock().unwrap().push(method.to_string());
                let body = http_body_util::BodyExt::collect(req.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let sent: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let mut version = current.lock().unwrap();
                let lease = |rv: u64| {
                    serde_json::json!({
                        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": "tensile-test", "namespace": "ns", "resourceVersion": rv.to_string()},
                        "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15,
                                 "renewTime": jiff::Timestamp::now().to_string()},
                    })
                };
                let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                  "reason": "Conflict", "code": 409});
                let (code, body) = match method {
                    Method::GET if *version == 0 => (
                        404,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                           "reason": "NotFound", "code": 404}),
                    ),
                    Method::GET => (200, lease(*version)),
                    Method::POST => {
                        *version = 1;
                        (201, lease(1))
                    }
                    _ if sent["metadata"]["resourceVersion"] == version.to_string() => {
                        *version += 1;
                        (200, lease(*version))
                    }
                    _ => (409, conflict),
                };
                http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(
                        serde_json::to_vec(&body).unwrap_or_default(),
                    ))
                    .map_err(|e| Box::new(e) as BoxError)
            }
        });
        (kube::Client::new(service, "ns"), calls, version)
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_renews_with_one_write_and_reads_the_lease_only_after_a_refused_one() {
        let shutdown = crate::runtime::CancellationToken::new();
        let mut tasks = crate::runtime::Supervisor::new(shutdown.clone(), Duration::from_secs(1));
        let standing = Standing::new(crate::admin::Readiness::default(), "");
        let leadership = Leadership::elected();
        let (client, calls, version) = recording_lease_server();
        let candidacy = stand(client, Some(election()), &leadership, &standing, &mut tasks);
        let run = tokio::spawn(tasks.run());
        tokio::time::timeout(Duration::from_secs(10), candidacy.leading())
            .await
            .expect("the free Lease is won");
        // Three retry periods: three renewals.
        tokio::time::sleep(Duration::from_secs(7)).await;
        let taken: Vec<String> = calls.lock().unwrap().drain(..).collect();
        assert_eq!(
            taken,
            ["GET", "POST", "PUT", "PUT", "PUT"],
            "created, then renewed by writes alone"
        );
        // Another writer changes the Lease: the next renewal is refused, reads, and writes.
        *version.lock().unwrap() += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after: Vec<String> = calls.lock().unwrap().drain(..).collect();
        assert_eq!(after, ["PUT", "GET", "PUT"]);
        assert!(leadership.may_write(), "still leading");
        shutdown.cancel();
        run.await.unwrap().unwrap();
    }

    /// An apiserver whose Lease is held by `other`, who stopped renewing it: reads show the
    /// same record; a write takes it.
    fn abandoned_lease_server() -> kube::Client {
        let service = tower::service_fn(move |req: Request<kube::client::Body>| async move {
            let lease = |holder: &str, rv: &str| {
                serde_json::json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "tensile-test", "namespace": "ns", "resourceVersion": rv},
                    "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                             "renewTime": "2024-05-01T10:00:00.000000Z"},
                })
            };
            let body = match *req.method() {
                Method::GET => lease("other", "1"),
                _ => lease("me", "2"),
            };
            http::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(kube::client::Body::from(
                    serde_json::to_vec(&body).unwrap_or_default(),
                ))
                .map_err(|e| Box::new(e) as BoxError)
        });
        kube::Client::new(service, "ns")
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_takes_an_abandoned_lease_when_it_expires_not_at_a_later_retry() {
        let elector = Elector::new(abandoned_lease_server(), election(), Leadership::elected());
        let began = Instant::now();
        elector.acquire(|_| {}).await;
        // Seen first at 0 s with a 15 s duration; retries every 2 s would take it at 16 s.
        assert_eq!(began.elapsed(), Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_whose_write_of_an_expired_lease_fails_tries_again_a_retry_period_on() {
        let (client, calls) = refusing_lease_server();
        let elector = Elector::new(client, election(), Leadership::elected());
        let _ = tokio::time::timeout(Duration::from_secs(21), elector.acquire(|_| {})).await;
        // Seen at 0 s, expired at 15 s: reads at 0, 2, .. 14, then a read and a refused write
        // at 15, 17 and 19 s, not every 0.4 s.
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.iter().filter(|m| *m == "PUT").count(), 3, "{calls:?}");
    }

    /// An abandoned Lease (as [`abandoned_lease_server`]) whose every write fails with a 500,
    /// and the methods it was called with.
    fn refusing_lease_server() -> (kube::Client, Calls) {
        let calls: Calls = Arc::default();
        let seen = calls.clone();
        let service = tower::service_fn(move |req: Request<kube::client::Body>| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(req.method().to_string());
                let (code, body) = match *req.method() {
                    Method::GET => (
                        200,
                        serde_json::json!({
                            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                            "metadata": {"name": "tensile-test", "namespace": "ns", "resourceVersion": "1"},
                            "spec": {"holderIdentity": "other", "leaseDurationSeconds": 15,
                                     "renewTime": "2024-05-01T10:00:00.000000Z"},
                        }),
                    ),
                    _ => (
                        500,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                           "reason": "InternalError", "code": 500}),
                    ),
                };
                http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(
                        serde_json::to_vec(&body).unwrap_or_default(),
                    ))
                    .map_err(|e| Box::new(e) as BoxError)
            }
        });
        (kube::Client::new(service, "ns"), calls)
    }

    #[tokio::test(start_paused = true)]
    async fn a_candidate_that_wins_the_lease_acts_and_says_it_leads() {
        let shutdown = crate::runtime::CancellationToken::new();
        let mut tasks = crate::runtime::Supervisor::new(shutdown.clone(), Duration::from_secs(1));
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "");
        let leadership = Leadership::elected();
        let candidacy = stand(
            lease_server(None),
            Some(election()),
            &leadership,
            &standing,
            &mut tasks,
        );
        let run = tokio::spawn(tasks.run());
        tokio::time::timeout(Duration::from_secs(10), candidacy.leading())
            .await
            .expect("the free Lease is won");
        assert!(leadership.may_write());
        assert_eq!(said(&readiness), (false, "leading as me; caches syncing".into()));
        standing.synced();
        assert_eq!(said(&readiness), (true, "leading as me".into()));
        shutdown.cancel();
        run.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn without_election_a_candidate_leads_at_once() {
        let shutdown = crate::runtime::CancellationToken::new();
        let mut tasks = crate::runtime::Supervisor::new(shutdown, Duration::from_secs(1));
        let readiness = crate::admin::Readiness::default();
        let standing = Standing::new(readiness.clone(), "");
        let client = kube::Client::new(
            tower::service_fn(|_req: Request<kube::client::Body>| async {
                Err::<http::Response<kube::client::Body>, BoxError>("no apiserver here".into())
            }),
            "default",
        );
        let candidacy = stand(client, None, &Leadership::always(), &standing, &mut tasks);
        tokio::time::timeout(Duration::from_secs(5), candidacy.leading())
            .await
            .expect("leads without election");
        candidacy.release().await;
        assert_eq!(said(&readiness), (false, "caches syncing".into()));
    }

    #[tokio::test(start_paused = true)]
    async fn the_fence_closes_at_the_renew_deadline_and_refuses_only_writes() {
        use tower::{Layer as _, Service as _, ServiceExt as _};
        let leadership = Leadership::elected();
        let ok = tower::service_fn(|_req: Request<()>| async { Ok::<_, BoxError>(()) });
        let mut svc = FenceLayer {
            leadership: leadership.clone(),
        }
        .layer(ok);
        let mut send = async |method: Method| {
            let req = Request::builder()
                .method(method)
                .uri("/api/v1/pods")
                .body(())
                .unwrap();
            svc.ready().await.unwrap().call(req).await
        };
        assert!(send(Method::GET).await.is_ok(), "reads pass on standby");
        let err = send(Method::POST).await.unwrap_err();
        assert!(
            err.to_string().contains("does not hold the leader Lease"),
            "{err}"
        );
        leadership.extend(Instant::now() + Duration::from_secs(10));
        assert!(send(Method::PATCH).await.is_ok(), "the leader writes");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            send(Method::DELETE).await.is_err(),
            "no write past the renew deadline"
        );
        assert!(!leadership.may_write());
        assert!(Leadership::always().may_write());
    }
}
