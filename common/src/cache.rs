//! Watch caches: a typed store kept current by a watch, and a "synced" signal that every
//! waiter sees once the first full list is in.
//!
//! kube's own `Store::wait_until_ready` wakes only the waiter that polled last; a [`Cache`]
//! broadcasts instead, so any number of components can wait on the same cache.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt, TryStreamExt};
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
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

/// As [`reflect`], with each object replaced by what `summary` makes of it before the cache
/// or the stream sees it (see [`watched_summaries`]).
pub fn reflect_summaries<K: Watched, S: Stored>(
    api: Api<K>,
    config: watcher::Config,
    summary: fn(K) -> S,
) -> (
    Cache<S>,
    impl Stream<Item = Result<S, watcher::Error>> + Send + 'static,
) {
    cache_of(watcher(api, config).map_ok(move |event| match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(summary(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(summary(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(summary(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
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
        .backoff(watch_backoff())
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                tx.send_replace(true);
            }
        })
        .touched_objects();
    (Cache { store, synced }, stream)
}

/// Where a cache lists its objects: every namespace (one watch), or each namespace of a list
/// (one watch each, for a credential that holds Roles in those namespaces only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Namespaces {
    All,
    Only(Vec<String>),
}

impl Namespaces {
    /// The APIs of kind `K` these namespaces are read through.
    pub fn apis<K>(&self, client: &kube::Client) -> Vec<Api<K>>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
    {
        match self {
            Namespaces::All => vec![Api::all(client.clone())],
            Namespaces::Only(list) => list
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect(),
        }
    }

    /// Whether `namespace` is read.
    pub fn contains(&self, namespace: &str) -> bool {
        match self {
            Namespaces::All => true,
            Namespaces::Only(list) => list.iter().any(|n| n == namespace),
        }
    }
}

/// As [`reflect_summaries`] over several APIs (one namespace each) kept in one cache: the
/// cache is synced once every watch has listed, and a watch that lists again (after its
/// resource version expired) changes only its own namespace's objects ([`Merge`]).
pub fn reflect_summaries_in<K: Watched, S: Stored>(
    apis: Vec<Api<K>>,
    config: watcher::Config,
    summary: fn(K) -> S,
) -> (
    Cache<S>,
    impl Stream<Item = Result<S, watcher::Error>> + Send + 'static,
) {
    let namespaces: Vec<Option<String>> = apis.iter().map(|a| a.namespace().map(str::to_owned)).collect();
    let namespaces_of = namespaces.clone();
    let sources = apis.into_iter().enumerate().map(|(i, api)| {
        watcher(api, config.clone())
            .map_ok(move |event| match event {
                watcher::Event::Apply(o) => watcher::Event::Apply(summary(o)),
                watcher::Event::Delete(o) => watcher::Event::Delete(summary(o)),
                watcher::Event::Init => watcher::Event::Init,
                watcher::Event::InitApply(o) => watcher::Event::InitApply(summary(o)),
                watcher::Event::InitDone => watcher::Event::InitDone,
            })
            .backoff(watch_backoff())
            .inspect({
                // A namespace whose watch keeps failing (no Role there, say) holds the whole
                // cache unsynced: said once per failing spell, with the namespace.
                let mut failing = false;
                let ns = namespaces_of[i].clone().unwrap_or_else(|| "every namespace".into());
                move |r| match r {
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(namespace = %ns, kind = K::kind(&()).as_ref(), "watch failing (retried): {e}");
                    }
                    Ok(_) if failing => {
                        failing = false;
                        tracing::info!(namespace = %ns, kind = K::kind(&()).as_ref(), "watch back");
                    }
                    _ => {}
                }
            })
            .map(move |r| (i, r))
            .boxed()
    });
    let (store, writer) = reflector::store::<S>();
    let mut merge = Merge::new(namespaces, store.clone());
    let events = futures::stream::select_all(sources)
        .map(move |(i, r)| match r {
            Ok(event) => merge.step(i, event).into_iter().map(Ok).collect::<Vec<_>>(),
            Err(e) => vec![Err(e)],
        })
        .flat_map(futures::stream::iter);
    let (tx, synced) = watch::channel(false);
    let stream = reflector(writer, events)
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                tx.send_replace(true);
            }
        })
        .touched_objects();
    (Cache { store, synced }, stream)
}

/// As [`watched_summaries`] over the APIs of `namespaces` ([`reflect_summaries_in`] when
/// there are several).
pub fn watched_summaries_in<K, S: Stored>(
    client: &kube::Client,
    namespaces: &Namespaces,
    config: watcher::Config,
    summary: fn(K) -> S,
    changed: &Arc<Notify>,
) -> (Cache<S>, BoxFuture<'static, ()>)
where
    K: Watched + kube::Resource<Scope = kube::core::NamespaceResourceScope>,
{
    let mut apis = namespaces.apis::<K>(client);
    if apis.len() == 1 {
        let (cache, feed) = watched_summaries(apis.remove(0), config, summary, changed);
        return (cache, feed.boxed());
    }
    let (cache, feed) = feeding(reflect_summaries_in(apis, config, summary), changed);
    (cache, feed.boxed())
}

/// As [`watched`] over the APIs of `namespaces`.
pub fn watched_in<K>(
    client: &kube::Client,
    namespaces: &Namespaces,
    config: watcher::Config,
    changed: &Arc<Notify>,
) -> (Cache<K>, BoxFuture<'static, ()>)
where
    K: Watched + kube::Resource<Scope = kube::core::NamespaceResourceScope>,
{
    fn kept<K: kube::Resource>(mut object: K) -> K {
        without_managed_fields(&mut object);
        object
    }
    watched_summaries_in(client, namespaces, config, kept::<K>, changed)
}

/// Several watches' events made into the events of one cache. kube's store replaces its whole
/// content when a watch finishes a list (`InitDone`), so the watches' lists cannot simply be
/// interleaved: until every watch has listed, their objects are gathered here and handed on as
/// one list; after that, a watch that lists again has its list handed on as changes to its own
/// namespace (applies, and deletes of what its namespace held that the new list lacks).
pub struct Merge<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    /// The namespace of each watch (`None`: every namespace).
    namespaces: Vec<Option<String>>,
    listed: Vec<bool>,
    /// Before every watch has listed: what they listed and saw since.
    gathered: Option<std::collections::HashMap<reflector::ObjectRef<K>, K>>,
    /// A watch listing again: what it listed so far.
    relisting: Vec<Option<Vec<K>>>,
    store: Store<K>,
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Merge<K> {
    /// For watches of `namespaces`, feeding the cache whose store is `store`.
    pub fn new(namespaces: Vec<Option<String>>, store: Store<K>) -> Self {
        let n = namespaces.len();
        Merge {
            namespaces,
            listed: vec![false; n],
            gathered: Some(Default::default()),
            relisting: vec![None; n],
            store,
        }
    }

    fn in_namespace(&self, source: usize, object: &K) -> bool {
        self.namespaces[source]
            .as_deref()
            .is_none_or(|ns| object.meta().namespace.as_deref() == Some(ns))
    }

    /// The cache's events for watch `source`'s `event`.
    pub fn step(&mut self, source: usize, event: watcher::Event<K>) -> Vec<watcher::Event<K>> {
        if let Some(gathered) = self.gathered.as_mut() {
            match event {
                // A watch listing again has not listed until it says so: its list so far
                // must not be handed on as whole by another watch's end of list.
                watcher::Event::Init => {
                    let ns = self.namespaces[source].clone();
                    gathered.retain(|key, _| ns.is_some() && key.namespace != ns);
                    self.listed[source] = false;
                }
                watcher::Event::InitApply(o) | watcher::Event::Apply(o) => {
                    gathered.insert(reflector::ObjectRef::from_obj(&o), o);
                }
                watcher::Event::Delete(o) => {
                    gathered.remove(&reflector::ObjectRef::from_obj(&o));
                }
                watcher::Event::InitDone => self.listed[source] = true,
            }
            if !self.listed.iter().all(|l| *l) {
                return Vec::new();
            }
            let gathered = self.gathered.take().unwrap_or_default();
            let mut out = Vec::with_capacity(gathered.len() + 2);
            out.push(watcher::Event::Init);
            out.extend(gathered.into_values().map(watcher::Event::InitApply));
            out.push(watcher::Event::InitDone);
            return out;
        }
        match event {
            watcher::Event::Init => {
                self.relisting[source] = Some(Vec::new());
                Vec::new()
            }
            watcher::Event::InitApply(o) => {
                self.relisting[source].get_or_insert_with(Vec::new).push(o);
                Vec::new()
            }
            watcher::Event::InitDone => {
                let listed = self.relisting[source].take().unwrap_or_default();
                let keys: std::collections::HashSet<_> =
                    listed.iter().map(reflector::ObjectRef::from_obj).collect();
                let gone: Vec<K> = self
                    .store
                    .state()
                    .into_iter()
                    .filter(|o| {
                        self.in_namespace(source, o)
                            && !keys.contains(&reflector::ObjectRef::from_obj(o.as_ref()))
                    })
                    .map(|o| o.as_ref().clone())
                    .collect();
                listed
                    .into_iter()
                    .map(watcher::Event::Apply)
                    .chain(gone.into_iter().map(watcher::Event::Delete))
                    .collect()
            }
            live => vec![live],
        }
    }
}

/// A cache that never holds anything and counts as synced: for what a scope does not read.
pub fn empty<K: Stored>() -> Cache<K> {
    let (store, _writer) = reflector::store::<K>();
    let (_tx, synced) = watch::channel(true);
    Cache { store, synced }
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
    feeding(reflect_summaries(api, config, summary), changed)
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

/// An object kept as its metadata (without `managedFields`) and the compact JSON of the rest,
/// decoded again by [`Packed::unpack`] when a reader needs it.
///
/// The Rust form of an API object is several times its JSON: k8s-openapi's structs hold every
/// optional field inline (an empty pod is 2 KiB, a container 2 KiB, a volume 3 KiB), so a
/// running pod of about 2 KiB of JSON costs 11 KiB decoded. A cache whose objects are read one
/// at a time, by a reconcile, keeps them packed; readers that scan every object read the
/// metadata, or a summary kept beside it.
#[derive(Clone)]
pub struct Packed<K> {
    pub metadata: ObjectMeta,
    body: Box<[u8]>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Packed<K>
where
    K: kube::Resource<DynamicType = ()> + serde::Serialize + serde::de::DeserializeOwned,
{
    /// Packs `object`: its metadata apart, the rest as JSON.
    pub fn pack(mut object: K) -> Self {
        let mut metadata = std::mem::take(object.meta_mut());
        metadata.managed_fields = None;
        // Encoding an API object into a vector cannot fail (string keys, no I/O); an empty
        // body would make `unpack` say so rather than produce a wrong object.
        let body = serde_json::to_vec(&object).unwrap_or_default();
        Packed {
            metadata,
            body: body.into_boxed_slice(),
            kind: PhantomData,
        }
    }

    /// The object again, as it was packed (`managedFields` aside).
    pub fn unpack(&self) -> Result<K, serde_json::Error> {
        let mut object: K = serde_json::from_slice(&self.body)?;
        *object.meta_mut() = self.metadata.clone();
        Ok(object)
    }

    /// Bytes of the packed part.
    pub fn packed_len(&self) -> usize {
        self.body.len()
    }
}

impl<K> std::fmt::Debug for Packed<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed")
            .field("metadata", &self.metadata)
            .field("packed_bytes", &self.body.len())
            .finish()
    }
}

impl<K> kube::Resource for Packed<K>
where
    K: kube::Resource<DynamicType = ()>,
{
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Read from the apiserver as `K`, then packed: a watch of `Packed<K>` never keeps the decoded
/// object.
impl<'de, K> serde::Deserialize<'de> for Packed<K>
where
    K: kube::Resource<DynamicType = ()> + serde::Serialize + serde::de::DeserializeOwned,
{
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(deserializer).map(Packed::pack)
    }
}

/// Makes `$kept`, a form in which a cache keeps objects of kind `$kind`, an object of that
/// kind to the API machinery (a store's keys, a controller's object references), its
/// metadata at `self.$($meta).+`.
#[macro_export]
macro_rules! kept_as {
    ($kept:ty, $kind:ty, $($meta:tt).+) => {
        impl kube::Resource for $kept {
            type DynamicType = ();
            type Scope = <$kind as kube::Resource>::Scope;

            fn kind(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::kind(dt)
            }
            fn group(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::group(dt)
            }
            fn version(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::version(dt)
            }
            fn plural(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::plural(dt)
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.$($meta).+
            }
            fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.$($meta).+
            }
        }
    };
}

/// A pod decoded without `metadata.managedFields`: the apiserver sends them with every pod
/// and no reader uses them, and on a pod they are a third of the JSON and most of the
/// allocations of decoding it (each entry is a tree of maps). Watches of pods read
/// `LeanPod`s, which skip those bytes instead of building them and dropping them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeanPod(pub Pod);

crate::kept_as!(LeanPod, Pod, 0.metadata);

impl<'de> serde::Deserialize<'de> for LeanPod {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Every field of a pod but `metadata.managedFields` (unknown fields are skipped).
        #[derive(serde::Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: Meta,
            #[serde(default)]
            spec: Option<PodSpec>,
            #[serde(default)]
            status: Option<PodStatus>,
        }
        #[derive(Default, serde::Deserialize)]
        #[serde(default, rename_all = "camelCase")]
        struct Meta {
            annotations: Option<BTreeMap<String, String>>,
            creation_timestamp: Option<Time>,
            deletion_grace_period_seconds: Option<i64>,
            deletion_timestamp: Option<Time>,
            finalizers: Option<Vec<String>>,
            generate_name: Option<String>,
            generation: Option<i64>,
            labels: Option<BTreeMap<String, String>>,
            name: Option<String>,
            namespace: Option<String>,
            owner_references: Option<Vec<OwnerReference>>,
            resource_version: Option<String>,
            self_link: Option<String>,
            uid: Option<String>,
        }
        let Wire {
            metadata: m,
            spec,
            status,
        } = Wire::deserialize(deserializer)?;
        let metadata = ObjectMeta {
            annotations: m.annotations,
            creation_timestamp: m.creation_timestamp,
            deletion_grace_period_seconds: m.deletion_grace_period_seconds,
            deletion_timestamp: m.deletion_timestamp,
            finalizers: m.finalizers,
            generate_name: m.generate_name,
            generation: m.generation,
            labels: m.labels,
            managed_fields: None,
            name: m.name,
            namespace: m.namespace,
            owner_references: m.owner_references,
            resource_version: m.resource_version,
            self_link: m.self_link,
            uid: m.uid,
        };
        Ok(LeanPod(Pod {
            metadata,
            spec,
            status,
        }))
    }
}

/// Retry delays of a failed watch: 200 ms doubling to 2 s (`backon`'s exponential backoff),
/// from the start again after a success. kube's default grows to 30 s, which leaves a
/// recovered cluster unseen for that long; a daemon must notice recovery as quickly as it
/// notices loss.
pub fn watch_backoff() -> kube::runtime::watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(2))
        .with_factor(2.0)
        .without_max_times()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_map(ns: &str, name: &str, v: &str) -> k8s_openapi::api::core::v1::ConfigMap {
        k8s_openapi::api::core::v1::ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                resource_version: Some(v.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Feeds `events` of watch `source` through `merge` into `writer`, as the reflector does.
    fn feed(
        merge: &mut Merge<k8s_openapi::api::core::v1::ConfigMap>,
        writer: &mut reflector::store::Writer<k8s_openapi::api::core::v1::ConfigMap>,
        source: usize,
        events: Vec<watcher::Event<k8s_openapi::api::core::v1::ConfigMap>>,
    ) -> usize {
        let mut out = 0;
        for event in events {
            for e in merge.step(source, event) {
                writer.apply_watcher_event(&e);
                out += 1;
            }
        }
        out
    }

    fn names(store: &Store<k8s_openapi::api::core::v1::ConfigMap>) -> Vec<String> {
        let mut n: Vec<String> = store
            .state()
            .iter()
            .map(|o| {
                format!(
                    "{}/{}@{}",
                    o.metadata.namespace.as_deref().unwrap_or_default(),
                    o.metadata.name.as_deref().unwrap_or_default(),
                    o.metadata.resource_version.as_deref().unwrap_or_default()
                )
            })
            .collect();
        n.sort();
        n
    }

    #[test]
    fn namespaces_watched_apart_make_one_cache_and_a_relist_changes_only_its_namespace() {
        use watcher::Event::*;
        let (store, mut writer) = reflector::store();
        let mut merge = Merge::new(vec![Some("a".into()), Some("b".into())], store.clone());
        // a lists, and changes before b has listed: nothing reaches the cache yet.
        let out = feed(
            &mut merge,
            &mut writer,
            0,
            vec![
                Init,
                InitApply(config_map("a", "x", "1")),
                InitApply(config_map("a", "y", "1")),
                InitDone,
            ],
        );
        assert_eq!(out, 0);
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![
                Delete(config_map("a", "y", "1")),
                Apply(config_map("a", "z", "1")),
            ],
        );
        assert!(names(&store).is_empty());
        // b lists: both namespaces arrive together, a's changes included.
        feed(
            &mut merge,
            &mut writer,
            1,
            vec![Init, InitApply(config_map("b", "x", "1")), InitDone],
        );
        assert_eq!(names(&store), ["a/x@1", "a/z@1", "b/x@1"]);
        // Live changes pass through.
        feed(&mut merge, &mut writer, 1, vec![Apply(config_map("b", "w", "1"))]);
        assert_eq!(names(&store), ["a/x@1", "a/z@1", "b/w@1", "b/x@1"]);
        // a lists again (its resource version expired): x changed, z is gone, b is untouched.
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![Init, InitApply(config_map("a", "x", "2"))],
        );
        assert_eq!(
            names(&store),
            ["a/x@1", "a/z@1", "b/w@1", "b/x@1"],
            "nothing changes mid-list"
        );
        feed(&mut merge, &mut writer, 0, vec![InitDone]);
        assert_eq!(names(&store), ["a/x@2", "b/w@1", "b/x@1"]);
    }

    #[test]
    fn a_watch_that_lists_again_before_the_others_listed_replaces_only_its_own_gathered_objects() {
        use watcher::Event::*;
        let (store, mut writer) = reflector::store();
        let mut merge = Merge::new(vec![Some("a".into()), Some("b".into())], store.clone());
        feed(
            &mut merge,
            &mut writer,
            1,
            vec![Init, InitApply(config_map("b", "x", "1"))],
        );
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![Init, InitApply(config_map("a", "old", "1")), InitDone],
        );
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![Init, InitApply(config_map("a", "new", "1")), InitDone],
        );
        assert!(names(&store).is_empty(), "b has not listed");
        feed(&mut merge, &mut writer, 1, vec![InitDone]);
        assert_eq!(names(&store), ["a/new@1", "b/x@1"]);
    }

    #[test]
    fn a_watch_listing_again_while_another_has_not_listed_is_awaited_to_its_end() {
        use watcher::Event::*;
        let (store, mut writer) = reflector::store();
        let mut merge = Merge::new(vec![Some("a".into()), Some("b".into())], store.clone());
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![Init, InitApply(config_map("a", "x", "1")), InitDone],
        );
        // a lists again (its resource version expired) and is halfway when b finishes.
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![Init, InitApply(config_map("a", "x", "2"))],
        );
        feed(
            &mut merge,
            &mut writer,
            1,
            vec![Init, InitApply(config_map("b", "y", "1")), InitDone],
        );
        assert!(names(&store).is_empty(), "a is not listed yet");
        feed(
            &mut merge,
            &mut writer,
            0,
            vec![InitApply(config_map("a", "z", "1")), InitDone],
        );
        assert_eq!(names(&store), ["a/x@2", "a/z@1", "b/y@1"]);
    }

    #[test]
    fn a_cache_of_nothing_is_synced_and_empty() {
        let cache = empty::<k8s_openapi::api::core::v1::Node>();
        futures::executor::block_on(cache.synced());
        assert!(cache.state().is_empty());
    }

    #[test]
    fn watch_retries_grow_to_two_seconds_and_start_over_after_a_success() {
        use kube::runtime::utils::Backoff as _;
        let mut b = watch_backoff();
        let ms: Vec<u128> = b.by_ref().take(7).map(|d| d.as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1600, 2000, 2000, 2000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(200)));
    }

    #[test]
    fn a_lean_pod_is_the_pod_without_managed_fields() {
        use k8s_openapi::api::core::v1::Pod;
        let json = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "generateName": "p-", "namespace": "n", "uid": "u",
                "resourceVersion": "9", "generation": 2, "selfLink": "/api/v1/p",
                "creationTimestamp": "2024-01-01T00:00:00Z", "deletionTimestamp": "2024-01-01T00:01:00Z",
                "deletionGracePeriodSeconds": 30, "labels": {"a": "b"}, "annotations": {"c": "d"},
                "finalizers": ["f"], "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "rs", "uid": "o", "controller": true}],
                "managedFields": [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": {"f:a": {}}}}}]},
            "spec": {"containers": [{"name": "c", "image": "i"}], "nodeName": "vn"},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        });
        let mut whole: Pod = serde_json::from_value(json.clone()).unwrap();
        assert!(whole.metadata.managed_fields.is_some());
        whole.metadata.managed_fields = None;
        let lean: LeanPod = serde_json::from_value(json).unwrap();
        assert_eq!(lean.0, whole);
        let bare: LeanPod = serde_json::from_value(serde_json::json!({"metadata": {"name": "q"}})).unwrap();
        assert_eq!(bare.0.metadata.name.as_deref(), Some("q"));
    }

    #[test]
    fn a_packed_pod_unpacks_to_the_same_pod_without_managed_fields() {
        use k8s_openapi::api::core::v1::Pod;
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "n", "uid": "u", "labels": {"a": "b"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
            "spec": {"containers": [{"name": "c", "image": "i"}], "nodeName": "vn"},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }))
        .unwrap();
        let packed = Packed::pack(pod.clone());
        let mut expected = pod;
        expected.metadata.managed_fields = None;
        assert_eq!(packed.unpack().unwrap(), expected);
        assert_eq!(packed.metadata, expected.metadata);
        assert!(packed.packed_len() < 200, "{} bytes", packed.packed_len());
        let read: Packed<Pod> = serde_json::from_value(serde_json::to_value(&expected).unwrap()).unwrap();
        assert_eq!(read.unpack().unwrap(), expected);
    }
}
