//! Watch caches: a typed store kept current by a watch, and a "synced" signal that every
//! waiter sees once the first full list is in.
//!
//! kube's own `Store::wait_until_ready` wakes only the waiter that polled last; a [`Cache`]
//! broadcasts instead, so any number of components can wait on the same cache.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use kube::api::Api;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{Notify, watch};

/// A watch cache: the store, and whether it has had its first full list.
pub struct Cache<K: kube::Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    synced: watch::Receiver<bool>,
}

impl<K: kube::Resource<DynamicType = ()> + 'static> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            synced: self.synced.clone(),
        }
    }
}

impl<K> Cache<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    pub fn store(&self) -> &Store<K> {
        &self.store
    }

    /// Waits until the first full list is in (forever if the watch never lists).
    pub async fn synced(&self) {
        let mut rx = self.synced.clone();
        if rx.wait_for(|s| *s).await.is_err() {
            // The watch is gone without ever listing: nothing will come.
            futures::future::pending::<()>().await;
        }
    }
}

impl<K> std::ops::Deref for Cache<K>
where
    K: kube::Resource<DynamicType = ()> + 'static,
{
    type Target = Store<K>;

    fn deref(&self) -> &Store<K> {
        &self.store
    }
}

/// The bound every kind a cache keeps meets.
pub trait Stored: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static {}

impl<K> Stored for K where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static
{
}

/// The bound every watched kind meets: stored, and read from the apiserver.
pub trait Watched: Stored + serde::de::DeserializeOwned {}

impl<K> Watched for K where K: Stored + serde::de::DeserializeOwned {}

/// A cache of `api` narrowed by `config`, and the stream of objects its watch touches
/// (which must be polled to keep the cache current, for example by a controller).
///
/// No cache keeps `metadata.managedFields`: field ownership is read by no decision, and on
/// a pod it is often the largest part of the object.
pub fn reflect<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    cache_of(watcher(api, config).modify(without_managed_fields))
}

fn without_managed_fields<K: kube::Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// As [`reflect`], with every object cut down by `trim` before the cache or the stream sees
/// it: for caches whose readers need only part of each object.
pub fn reflect_trimmed<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    cache_of(watcher(api, config).modify(move |object: &mut K| {
        without_managed_fields(object);
        trim(object);
    }))
}

/// A cache kept by the watch `events`, and the stream of objects they touch.
fn cache_of<K: Stored>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    let (store, writer) = reflector::store::<K>();
    let (tx, synced) = watch::channel(false);
    let stream = reflector(writer, events)
        .backoff(WatchBackoff::default())
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                tx.send_replace(true);
            }
        })
        .touched_objects();
    (Cache { store, synced }, stream)
}

/// A cache of `api` narrowed by `config` whose every event wakes `changed`, and the future
/// that keeps it current.
pub fn watched<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    feeding(reflect(api, config), changed)
}

/// A cache of what `summary` makes of each `K` of `api` narrowed by `config`: for readers
/// that need a digest of each object, which then costs neither the memory of the object nor
/// its recomputation on every read. Every event wakes `changed`; the future keeps the cache
/// current.
pub fn watched_summaries<K: Watched, S: Stored>(
    api: Api<K>,
    config: watcher::Config,
    summary: fn(K) -> S,
    changed: &Arc<Notify>,
) -> (Cache<S>, impl Future<Output = ()> + Send + 'static) {
    let events = watcher(api, config).map_ok(move |event| match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(summary(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(summary(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(summary(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    });
    feeding(cache_of(events), changed)
}

/// As [`watched`], with every object cut down by `trim` (see [`reflect_trimmed`]).
pub fn watched_trimmed<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    feeding(reflect_trimmed(api, config, trim), changed)
}

/// The future that polls a cache's stream, waking `changed` on every object it touches.
fn feeding<K: Stored>(
    (cache, stream): (
        Cache<K>,
        impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    ),
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    let changed = changed.clone();
    let feed = stream.for_each(move |_| {
        changed.notify_one();
        futures::future::ready(())
    });
    (cache, feed)
}

/// A cache of every `K` the client sees, narrowed by `config`, metadata only: the apiserver sends only
/// metadata (a metadata watch), and each object is kept as `K::default()` with that metadata,
/// `managedFields` dropped. For kinds whose content is read only when it is needed (fetched
/// then), so neither the process nor the wire carries the content of objects it never uses.
/// Every event wakes `changed`; the future keeps the cache current.
pub fn watched_metadata<K: Watched + Default>(
    client: kube::Client,
    config: watcher::Config,
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    fn header<K: Watched + Default>(partial: kube::core::PartialObjectMeta<K>) -> K {
        let mut object = K::default();
        *object.meta_mut() = partial.metadata;
        object.meta_mut().managed_fields = None;
        object
    }
    let api = Api::<kube::core::PartialObjectMeta<K>>::all(client);
    watched_summaries(api, config, header::<K>, changed)
}

/// Retry delays of a failed watch: 200 ms doubling to 2 s, from the start again after a
/// success. kube's default grows to 30 s, which leaves a recovered cluster unseen for that
/// long; a daemon must notice recovery as quickly as it notices loss.
#[derive(Clone, Debug, Default)]
pub struct WatchBackoff(u32);

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = Duration::from_millis(200 << self.0.min(4)).min(Duration::from_secs(2));
        self.0 = self.0.saturating_add(1);
        Some(delay)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0 = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_retries_grow_to_two_seconds_and_start_over_after_a_success() {
        use kube::runtime::utils::Backoff as _;
        let mut b = WatchBackoff::default();
        let ms: Vec<u128> = b.by_ref().take(7).map(|d| d.as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1600, 2000, 2000, 2000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(200)));
    }
}
