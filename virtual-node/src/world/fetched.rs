//! Upper ConfigMaps and Secrets read the way a kubelet reads them: one object at a time, by
//! name, and only those that the pods bound to this node reference. Nothing lists or watches
//! them cluster-wide, so the upper credential needs `get` and nothing more, and under a node
//! identity the Node authorizer allows exactly these reads.
//!
//! A [`Fetched`] cache knows, for each name it was asked to follow, the object's metadata or
//! that it does not exist; of every other name it knows nothing ([`Upper::Unknown`]), and a
//! reader must not take that for "gone" (a copy another virtual node of the same lower cluster
//! made for its own pods is not ours to judge). Its feed re-reads every followed object once
//! per period, at most `per_second` reads a second: with up to `per_second` objects an edit
//! is seen within a second, with more the period grows in proportion.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::Api;
use tensile_common::cache::Cache;
use tokio::sync::{Notify, watch};

use crate::model::reflected::Reflected;
use crate::model::trim::UpperPod;

/// What is known of one upper object.
#[derive(Debug)]
pub enum Upper<K> {
    /// It exists: its metadata.
    Present(Arc<K>),
    /// It was read and does not exist (or may never travel).
    Gone,
    /// Not followed here: nothing is known.
    Unknown,
}

impl<K> Upper<K> {
    pub fn present(self) -> Option<Arc<K>> {
        match self {
            Upper::Present(k) => Some(k),
            Upper::Gone | Upper::Unknown => None,
        }
    }
}

type Key = (String, String);

/// What [`Fetched::read`] found of an object that exists and may travel.
#[derive(Debug)]
pub enum Read<K> {
    /// Followed already: its metadata as last read (its content is read when it is needed).
    Known(Arc<K>),
    /// Not followed until now, read whole: the content with it, so a copy made from it needs
    /// no second read.
    Whole(K),
}

struct Entry<K> {
    object: Option<Arc<K>>,
    read_at: Instant,
}

/// The objects read, and their names in the order they were last read: a tick takes its
/// due reads from the front instead of looking at every followed name.
struct Known<K> {
    entries: HashMap<Key, Entry<K>>,
    by_read: std::collections::BTreeSet<(Instant, Key)>,
}

impl<K> Default for Known<K> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            by_read: Default::default(),
        }
    }
}

struct Inner<K> {
    client: kube::Client,
    entries: RwLock<Known<K>>,
    /// Names whose last read failed: when to read them again, and how many failed in a row.
    failures: std::sync::Mutex<HashMap<Key, (Instant, u32)>>,
    synced: watch::Receiver<bool>,
    changed: Arc<Notify>,
    /// How many differences the entries have taken (see [`Fetched::changes`]).
    changes: AtomicU64,
}

/// The followed upper objects of kind `K` (metadata only).
pub struct Fetched<K> {
    inner: Arc<Inner<K>>,
}

impl<K> Clone for Fetched<K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

/// Whether a read object may travel: a service-account token Secret never does.
fn travels<K: Reflected>(object: &K) -> bool {
    match serde_json::to_value(object) {
        Ok(v) => v.get("type").and_then(|t| t.as_str()) != Some("kubernetes.io/service-account-token"),
        Err(_) => false,
    }
}

/// The metadata of `object`, its content and `managedFields` dropped.
fn header<K: Reflected + Default>(object: &K) -> K {
    let mut kept = K::default();
    *kept.meta_mut() = object.meta().clone();
    kept.meta_mut().managed_fields = None;
    kept
}

impl<K: Reflected + Default> Fetched<K> {
    /// What is known of `ns/name`.
    pub fn get(&self, ns: &str, name: &str) -> Upper<K> {
        let entries = match self.inner.entries.read() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        match entries.entries.get(&(ns.to_owned(), name.to_owned())) {
            Some(Entry { object: Some(o), .. }) => Upper::Present(o.clone()),
            Some(Entry { object: None, .. }) => Upper::Gone,
            None => Upper::Unknown,
        }
    }

    /// Resolves once every object the bound pods referenced at start has been read once
    /// (or failed to be, and stays unknown until a later read).
    pub async fn synced(&self) {
        let mut rx = self.inner.synced.clone();
        if rx.wait_for(|s| *s).await.is_err() {
            futures::future::pending::<()>().await;
        }
    }

    /// `ns/name` as known, read now when it is not followed yet (a pod that was just bound
    /// names it): `None` when it does not exist or may not travel.
    pub async fn read(&self, ns: &str, name: &str) -> Result<Option<Read<K>>, kube::Error> {
        match self.get(ns, name) {
            Upper::Present(o) => Ok(Some(Read::Known(o))),
            Upper::Gone => Ok(None),
            Upper::Unknown => Ok(self
                .refresh(&(ns.to_owned(), name.to_owned()))
                .await?
                .map(Read::Whole)),
        }
    }

    /// Reads `key` and records what it found; wakes the readers when that differs from what
    /// was known. Returns the whole object read (the record keeps its metadata).
    async fn refresh(&self, key: &Key) -> Result<Option<K>, kube::Error> {
        let (ns, name) = key;
        let read = Api::<K>::namespaced(self.inner.client.clone(), ns)
            .get_opt(name)
            .await?;
        let whole = read.filter(travels);
        let object = whole.as_ref().map(|o| Arc::new(header(o)));
        let mut entries = match self.inner.entries.write() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        let read_at = Instant::now();
        let before = entries.entries.insert(
            key.clone(),
            Entry {
                object: object.clone(),
                read_at,
            },
        );
        if let Some(before) = &before {
            entries.by_read.remove(&(before.read_at, key.clone()));
        }
        entries.by_read.insert((read_at, key.clone()));
        drop(entries);
        let before = before.map(|e| e.object.as_ref().map(|o| o.resource_version()));
        let after = Some(object.as_ref().map(|o| o.resource_version()));
        if before != after {
            self.inner.changes.fetch_add(1, Ordering::AcqRel);
            self.inner.changed.notify_one();
        }
        Ok(whole)
    }

    /// Records the outcome of a read of `key`: a failure is read again after a delay that
    /// doubles up to a minute (a lasting refusal, a missing grant, is said at warning level).
    fn record(&self, key: &Key, failed: Option<&kube::Error>) {
        let mut failures = match self.inner.failures.lock() {
            Ok(f) => f,
            Err(poisoned) => poisoned.into_inner(),
        };
        let Some(e) = failed else {
            failures.remove(key);
            return;
        };
        let count = failures.get(key).map_or(0, |(_, n)| *n) + 1;
        let delay = Duration::from_secs(1u64 << count.min(6)).min(Duration::from_secs(60));
        failures.insert(key.clone(), (Instant::now() + delay, count));
        let (ns, name) = key;
        if count == 4 {
            tracing::warn!(kind = %K::KIND, object = %format!("{ns}/{name}"), "upper read keeps failing: {e}");
        } else {
            // A pod bound a moment ago may name what the Node authorizer does not allow
            // yet; the next read comes after the delay.
            tracing::debug!(kind = %K::KIND, object = %format!("{ns}/{name}"), "upper read: {e}");
        }
    }

    /// Whether a read of `key` failed and its delay has not passed.
    fn held(&self, key: &Key, now: Instant) -> bool {
        let failures = match self.inner.failures.lock() {
            Ok(f) => f,
            Err(poisoned) => poisoned.into_inner(),
        };
        failures.get(key).is_some_and(|(next, _)| *next > now)
    }

    /// Stops following what no bound pod references any more.
    fn keep_only(&self, wanted: &HashSet<Key>) {
        if let Ok(mut failures) = self.inner.failures.lock() {
            failures.retain(|key, _| wanted.contains(key));
        }
        let mut entries = match self.inner.entries.write() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        let before = entries.entries.len();
        entries.entries.retain(|key, _| wanted.contains(key));
        if entries.entries.len() != before {
            entries.by_read.retain(|(_, key)| wanted.contains(key));
            self.inner.changes.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Of `wanted`, the names never read yet (or whose reads all failed).
    fn unread(&self, wanted: &HashSet<Key>) -> HashSet<Key> {
        let entries = match self.inner.entries.read() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        wanted
            .iter()
            .filter(|key| !entries.entries.contains_key(*key))
            .cloned()
            .collect()
    }

    /// How many differences the followed objects have shown (one read, appeared, changed or
    /// gone; one unfollowed): as [`tensile_common::cache::Cache::changes`].
    pub fn changes(&self) -> u64 {
        self.inner.changes.load(Ordering::Acquire)
    }

    /// The reads of one tick: every name of `unread` whose last failure's delay passed, then
    /// up to `share` of the followed names read longest ago, last read at least `period` ago.
    /// Costs what it reads (and what waits out a failure), not what is followed.
    fn due(&self, unread: &HashSet<Key>, period: Duration, share: usize, now: Instant) -> Vec<Key> {
        let mut due: Vec<Key> = unread
            .iter()
            .filter(|key| !self.held(key, now))
            .cloned()
            .collect();
        let entries = match self.inner.entries.read() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        let stale = entries
            .by_read
            .iter()
            .take_while(|(at, _)| now.saturating_duration_since(*at) >= period)
            .filter(|(_, key)| !self.held(key, now))
            .take(share)
            .map(|(_, key)| key.clone());
        due.extend(stale);
        due
    }
}

/// The names of kind `K` that non-terminal `pods` reference.
pub fn wanted<K: Reflected>(pods: &[Arc<UpperPod>]) -> HashSet<Key> {
    pods.iter()
        .filter(|p| !p.terminal && p.references.iter().any(|(kind, _)| *kind == K::KIND))
        .flat_map(|p| {
            let ns = p.namespace().unwrap_or_default();
            p.references
                .iter()
                .filter(|(kind, _)| *kind == K::KIND)
                .map(move |(_, name)| (ns.clone(), name.clone()))
        })
        .collect()
}

/// Least time between two workings out of what the pods reference.
const WANTED_EVERY: Duration = Duration::from_secs(1);

/// How long one round over `followed` objects takes at `per_second` reads a second (a
/// second at least).
pub fn period(followed: usize, per_second: u32) -> Duration {
    let per_second = f64::from(per_second.max(1));
    Duration::from_secs_f64((followed as f64 / per_second).max(1.0))
}

/// How many re-reads one tick of `tick` may make at `per_second` reads a second (one at
/// least).
fn share(per_second: u32, tick: Duration) -> usize {
    ((f64::from(per_second) * tick.as_secs_f64()).ceil() as usize).max(1)
}

/// A [`Fetched`] cache of the `K`s the pods of `upper_pods` reference, read through `client`,
/// and the feed that keeps it current; `changed` wakes on every difference.
pub fn fetched<K: Reflected + Default>(
    client: kube::Client,
    upper_pods: Cache<UpperPod>,
    per_second: u32,
    changed: &Arc<Notify>,
) -> (Fetched<K>, impl Future<Output = ()> + Send + 'static) {
    let (tx, synced) = watch::channel(false);
    let cache = Fetched {
        inner: Arc::new(Inner {
            client,
            entries: RwLock::new(Known::default()),
            failures: Default::default(),
            synced,
            changed: changed.clone(),
            changes: AtomicU64::new(0),
        }),
    };
    let feed = {
        let cache = cache.clone();
        async move {
            const TICK: Duration = Duration::from_millis(250);
            upper_pods.synced().await;
            // What the pods reference, and which of it was never read, worked out again only
            // after the pods changed, and at most once a second: it walks every pod, and a
            // pod that was just bound has its own names read by the pod path.
            let (mut wanted_at, mut wanted, mut unread) = (None, HashSet::new(), HashSet::new());
            let mut worked_out: Option<Instant> = None;
            loop {
                let changes = upper_pods.changes();
                if wanted_at != Some(changes) && worked_out.is_none_or(|at| at.elapsed() >= WANTED_EVERY) {
                    worked_out = Some(Instant::now());
                    wanted = self::wanted::<K>(&upper_pods.state());
                    cache.keep_only(&wanted);
                    unread = cache.unread(&wanted);
                    wanted_at = Some(changes);
                }
                let now = Instant::now();
                let reads = cache.due(
                    &unread,
                    period(wanted.len(), per_second),
                    share(per_second, TICK),
                    now,
                );
                let done: Vec<Key> = futures::stream::iter(reads)
                    .map(|key| {
                        let cache = cache.clone();
                        async move {
                            let read = cache.refresh(&key).await;
                            cache.record(&key, read.as_ref().err());
                            read.is_ok().then_some(key)
                        }
                    })
                    .buffer_unordered(8)
                    .filter_map(futures::future::ready)
                    .collect()
                    .await;
                for key in &done {
                    unread.remove(key);
                }
                // After the first round: what failed stays unknown and is read again.
                if !*tx.borrow() {
                    tx.send_replace(true);
                }
                tokio::time::sleep(TICK).await;
            }
        }
    };
    (cache, feed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Key {
        ("ns".to_owned(), name.to_owned())
    }

    #[test]
    fn a_round_takes_a_second_until_the_budget_is_spent_then_grows_in_proportion() {
        assert_eq!(period(0, 20), Duration::from_secs(1));
        assert_eq!(period(20, 20), Duration::from_secs(1));
        assert_eq!(period(100, 20), Duration::from_secs(5));
        assert_eq!(
            period(5, 0),
            Duration::from_secs(5),
            "a zero budget reads one a second"
        );
    }

    /// A cache of ConfigMaps over a client that is never used.
    fn cache() -> Fetched<k8s_openapi::api::core::v1::ConfigMap> {
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("a URL"));
        let client = kube::Client::try_from(config).expect("a client");
        let (_, synced) = watch::channel(false);
        Fetched {
            inner: Arc::new(Inner {
                client,
                entries: RwLock::new(Known::default()),
                failures: Default::default(),
                synced,
                changed: Arc::default(),
                changes: AtomicU64::new(0),
            }),
        }
    }

    fn read_at(cache: &Fetched<k8s_openapi::api::core::v1::ConfigMap>, name: &str, at: Instant) {
        let mut known = cache.inner.entries.write().expect("not poisoned");
        known.entries.insert(
            key(name),
            Entry {
                object: None,
                read_at: at,
            },
        );
        known.by_read.insert((at, key(name)));
    }

    #[tokio::test]
    async fn a_tick_reads_the_unread_then_its_share_of_the_longest_unread_due_ones() {
        let cache = cache();
        let now = Instant::now();
        let period = Duration::from_secs(10);
        for (name, ago) in [
            ("fresh", 1),
            ("old", 30),
            ("older", 40),
            ("oldest", 50),
            ("due", 10),
        ] {
            read_at(&cache, name, now - Duration::from_secs(ago));
        }
        let unread: HashSet<Key> = [key("new")].into();
        assert_eq!(
            cache.due(&unread, period, 2, now),
            vec![key("new"), key("oldest"), key("older")],
            "what was never read, then the share, longest unread first"
        );
        assert_eq!(
            cache.due(&HashSet::new(), period, 10, now),
            vec![key("oldest"), key("older"), key("old"), key("due")],
            "nothing read within the period"
        );
        cache.record(
            &key("oldest"),
            Some(&kube::Error::LinesCodecMaxLineLengthExceeded),
        );
        cache.record(&key("new"), Some(&kube::Error::LinesCodecMaxLineLengthExceeded));
        assert_eq!(
            cache.due(&unread, period, 2, now),
            vec![key("older"), key("old")],
            "a failed read waits out its delay"
        );
        cache.keep_only(&[key("old"), key("fresh")].into());
        assert_eq!(cache.due(&HashSet::new(), period, 10, now), vec![key("old")]);
        assert_eq!(
            cache.unread(&[key("old"), key("new")].into()),
            [key("new")].into(),
            "what was never read is read"
        );
    }

    #[test]
    fn a_tick_has_its_share_of_the_budget_and_at_least_one_read() {
        assert_eq!(share(20, Duration::from_millis(250)), 5);
        assert_eq!(share(0, Duration::from_millis(250)), 1);
    }

    #[test]
    fn a_service_account_token_secret_never_travels() {
        use k8s_openapi::api::core::v1::Secret;
        let token = Secret {
            type_: Some("kubernetes.io/service-account-token".into()),
            ..Secret::default()
        };
        assert!(!travels(&token));
        assert!(travels(&Secret {
            type_: Some("Opaque".into()),
            ..Secret::default()
        }));
        assert!(travels(&k8s_openapi::api::core::v1::ConfigMap::default()));
    }
}
