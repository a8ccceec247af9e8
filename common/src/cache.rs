//! Watch caches: a typed store kept current by a watch, and a "synced" signal that every
//! waiter sees once the first full list is in.
//!
//! kube's own `Store::wait_until_ready` wakes only the waiter that polled last; a [`Cache`]
//! broadcasts instead, so any number of components can wait on the same cache.
//!
//! Every watch here is [`retried`]: its delays grow across failed attempts and start over
//! only when it lists or sees a change, and its failures are said once per spell, then at
//! most once a minute. A kind the apiserver does not serve (a CRD of the suite not installed)
//! is said as such, with the file that installs it, and retried 5 s to 60 s apart.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
    changes: Arc<AtomicU64>,
}

impl<K: kube::Resource<DynamicType = ()> + 'static> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            synced: self.synced.clone(),
            changes: self.changes.clone(),
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

    /// How many changes the store has taken (an object applied or deleted, a list finished):
    /// a pass over the cache whose count is the one it last saw would find what it found.
    /// Counted after the store holds the change.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
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

/// A value worked out from caches, kept until the change count of one of them moves: the
/// work is done again only after a change (see [`Cache::changes`]).
pub struct Memo<T>(std::sync::Mutex<Option<(Vec<u64>, T)>>);

impl<T> Default for Memo<T> {
    fn default() -> Self {
        Self(std::sync::Mutex::new(None))
    }
}

impl<T: Clone> Memo<T> {
    /// The value for inputs whose change counts are `inputs` (read before the inputs are):
    /// the kept one when they are those it was worked out at, else `work()`'s, then kept.
    pub fn get(&self, inputs: Vec<u64>, work: impl FnOnce() -> T) -> T {
        let mut kept = match self.0.lock() {
            Ok(k) => k,
            Err(poisoned) => poisoned.into_inner(),
        };
        match kept.as_ref() {
            Some((at, value)) if *at == inputs => value.clone(),
            _ => {
                let value = work();
                *kept = Some((inputs, value.clone()));
                value
            }
        }
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
    let namespace = api.namespace().map(str::to_owned);
    cache_of(
        watcher(api, config).modify(without_managed_fields),
        namespace,
        None,
    )
}

fn without_managed_fields<K: kube::Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// As [`reflect`], with every object cut down by `trim` before the cache or the stream sees
/// it: for caches whose readers need only part of each object. An object whose only changes
/// were trimmed away (a node's heartbeat) counts as no change.
pub fn reflect_trimmed<K: Watched + PartialEq>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    let namespace = api.namespace().map(str::to_owned);
    let events = watcher(api, config).modify(move |object: &mut K| {
        without_managed_fields(object);
        trim(object);
    });
    cache_of(events, namespace, Some(same_but_version::<K>))
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
    let namespace = api.namespace().map(str::to_owned);
    let events = watcher(api, config).map_ok(move |event| match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(summary(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(summary(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(summary(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    });
    cache_of(events, namespace, None)
}

/// A cache kept by the watch `events` (of `namespace`; `None`: every namespace, or a
/// cluster-scoped kind), [`retried`], and the stream of objects they touch.
/// What a cache's feed does with each event its reflector has applied: counts the changes
/// (every event but the start of a list) and says it is synced at the end of the first list.
fn counted<K>(
    synced: watch::Sender<bool>,
    changes: Arc<AtomicU64>,
    unchanged: Arc<AtomicBool>,
) -> impl FnMut(&watcher::Event<K>) {
    move |event| {
        if !matches!(event, watcher::Event::Init) && !unchanged.swap(false, Ordering::AcqRel) {
            changes.fetch_add(1, Ordering::AcqRel);
        }
        if matches!(event, watcher::Event::InitDone) {
            synced.send_replace(true);
        }
    }
}

/// Whether `old` and `new` differ in nothing but their resourceVersion: a trimmed object
/// whose only changes were in the parts trimmed away.
fn same_but_version<K: Stored + PartialEq>(old: &K, new: &K) -> bool {
    let mut old = old.clone();
    old.meta_mut().resource_version = new.meta().resource_version.clone();
    old == *new
}

/// A cache fed by `events`. With `same`, an object applied that `same` finds equal to the one
/// stored is stored but not counted as a change (and wakes no reader of [`watched`]).
fn cache_of<K: Stored>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    namespace: Option<String>,
    same: Option<fn(&K, &K) -> bool>,
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    let (store, writer) = reflector::store::<K>();
    let (tx, synced) = watch::channel(false);
    let changes = Arc::new(AtomicU64::new(0));
    let unchanged = Arc::new(AtomicBool::new(false));
    let (reader, seen_unchanged) = (store.clone(), unchanged.clone());
    let events = retried(events, namespace).inspect_ok(move |event| {
        if let (Some(same), watcher::Event::Apply(new)) = (same, event) {
            let old = reader.get(&reflector::ObjectRef::from_obj(new));
            seen_unchanged.store(old.is_some_and(|old| same(&old, new)), Ordering::Release);
        }
    });
    let stream = reflector(writer, events)
        .inspect_ok(counted(tx, changes.clone(), unchanged))
        .touched_objects();
    (
        Cache {
            store,
            synced,
            changes,
        },
        stream,
    )
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
        let events = watcher(api, config.clone()).map_ok(move |event| match event {
            watcher::Event::Apply(o) => watcher::Event::Apply(summary(o)),
            watcher::Event::Delete(o) => watcher::Event::Delete(summary(o)),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitApply(o) => watcher::Event::InitApply(summary(o)),
            watcher::Event::InitDone => watcher::Event::InitDone,
        });
        // A namespace whose watch keeps failing (no Role there, say) holds the whole cache
        // unsynced: said once per failing spell, with the namespace.
        retried(events, namespaces_of[i].clone())
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
    let changes = Arc::new(AtomicU64::new(0));
    let stream = reflector(writer, events)
        .inspect_ok(counted(tx, changes.clone(), Arc::default()))
        .touched_objects();
    (
        Cache {
            store,
            synced,
            changes,
        },
        stream,
    )
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

    /// The object of `key` the cache holds or, before every watch has listed, will hold.
    fn held(&self, key: &reflector::ObjectRef<K>) -> Option<K> {
        match &self.gathered {
            Some(gathered) => gathered.get(key).cloned(),
            None => self.store.get(key).map(|o| o.as_ref().clone()),
        }
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

/// What a cache's feed does with each event its reflector has applied ([`counted`]).
type Counting<S> = Box<dyn FnMut(&watcher::Event<S>) + Send>;

/// What a [`Split`] makes of each object for its two caches.
type SplitFn<K, A, B> = Box<dyn FnMut(K) -> (Option<A>, Option<B>) + Send>;

/// One side of a [`Split`]: a cache, and what keeps it.
struct Side<S: Stored> {
    writer: reflector::store::Writer<S>,
    merge: Merge<S>,
    count: Counting<S>,
    changes: Arc<AtomicU64>,
}

impl<S: Stored> Side<S> {
    fn new(namespaces: Vec<Option<String>>) -> (Self, Cache<S>) {
        let (store, writer) = reflector::store::<S>();
        let (tx, synced) = watch::channel(false);
        let changes = Arc::new(AtomicU64::new(0));
        let side = Side {
            writer,
            merge: Merge::new(namespaces, store.clone()),
            count: Box::new(counted(tx, changes.clone(), Arc::default())),
            changes: changes.clone(),
        };
        (
            side,
            Cache {
                store,
                synced,
                changes,
            },
        )
    }

    /// What the cache holds (or will hold) under the name and namespace of `meta`.
    fn held(&self, meta: &ObjectMeta) -> Option<S> {
        let mut key = reflector::ObjectRef::<S>::new(meta.name.as_deref().unwrap_or_default());
        key.namespace = meta.namespace.clone();
        self.merge.held(&key)
    }

    /// Applies `event` of watch `source` (`None`: nothing for this cache); the objects it
    /// touched, in `touched` when given.
    fn apply(&mut self, source: usize, event: Option<watcher::Event<S>>, mut touched: Option<&mut Vec<S>>) {
        let Some(event) = event else { return };
        for event in self.merge.step(source, event) {
            self.writer.apply_watcher_event(&event);
            (self.count)(&event);
            if let Some(touched) = touched.as_deref_mut() {
                match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
                        touched.push(o)
                    }
                    watcher::Event::Init | watcher::Event::InitDone => {}
                }
            }
        }
    }
}

/// One watch kept as two caches, each in the form its readers need, where a watch for each
/// would have the apiserver send, and this process decode, every object they share twice
/// (every lower pod as a summary of the load it puts on its node, and a node's own lower pods
/// among them, packed). `split` makes of each object what each cache keeps of it; `None`
/// keeps nothing there, and deletes what that cache held under its name (an object that
/// stopped matching). A delete costs no `split`.
pub struct Split<K, A: Stored, B: Stored> {
    split: SplitFn<K, A, B>,
    first: Side<A>,
    second: Side<B>,
}

impl<K: kube::Resource<DynamicType = ()>, A: Stored, B: Stored> Split<K, A, B> {
    /// For watches of `namespaces` (see [`Merge`]).
    pub fn new(
        namespaces: Vec<Option<String>>,
        split: impl FnMut(K) -> (Option<A>, Option<B>) + Send + 'static,
    ) -> (Self, Cache<A>, Cache<B>) {
        let (first, a) = Side::new(namespaces.clone());
        let (second, b) = Side::new(namespaces);
        let split = Split {
            split: Box::new(split),
            first,
            second,
        };
        (split, a, b)
    }

    /// Applies watch `source`'s `event` to both caches; the objects of the second cache it
    /// touched (as a cache's stream of touched objects yields them), and whether the first
    /// cache's content changed.
    pub fn step(&mut self, source: usize, event: watcher::Event<K>) -> (Vec<B>, bool) {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let (a, b) = match event {
            Init => (Some(Init), Some(Init)),
            InitDone => (Some(InitDone), Some(InitDone)),
            InitApply(o) => {
                let (a, b) = (self.split)(o);
                (a.map(InitApply), b.map(InitApply))
            }
            Apply(o) => {
                let meta = ObjectMeta {
                    name: o.meta().name.clone(),
                    namespace: o.meta().namespace.clone(),
                    ..Default::default()
                };
                let (a, b) = (self.split)(o);
                (
                    a.map(Apply).or_else(|| self.first.held(&meta).map(Delete)),
                    b.map(Apply).or_else(|| self.second.held(&meta).map(Delete)),
                )
            }
            Delete(o) => (
                self.first.held(o.meta()).map(Delete),
                self.second.held(o.meta()).map(Delete),
            ),
        };
        let before = self.first.changes.load(Ordering::Acquire);
        self.first.apply(source, a, None);
        let mut touched = Vec::new();
        self.second.apply(source, b, Some(&mut touched));
        (touched, self.first.changes.load(Ordering::Acquire) != before)
    }
}

/// The caches of a [`Split`] of the watches of `apis` narrowed by `config`, and the stream of
/// the second cache's touched objects, which keeps both current (it must be polled); every
/// change of the first wakes `first_changed`.
pub fn reflect_split<K, A, B>(
    apis: Vec<Api<K>>,
    config: watcher::Config,
    split: impl FnMut(K) -> (Option<A>, Option<B>) + Send + 'static,
    first_changed: &Arc<Notify>,
) -> (
    Cache<A>,
    Cache<B>,
    impl Stream<Item = Result<B, watcher::Error>> + Send + 'static,
)
where
    K: Watched,
    A: Stored,
    B: Stored,
{
    let namespaces: Vec<Option<String>> = apis.iter().map(|a| a.namespace().map(str::to_owned)).collect();
    let (mut split, first, second) = Split::new(namespaces.clone(), split);
    let sources = apis
        .into_iter()
        .zip(namespaces)
        .enumerate()
        .map(|(i, (api, namespace))| {
            retried(watcher(api, config.clone()), namespace)
                .map(move |r| (i, r))
                .boxed()
        });
    let changed = first_changed.clone();
    let stream = futures::stream::select_all(sources)
        .map(move |(i, r)| match r {
            Ok(event) => {
                let (touched, first_changed) = split.step(i, event);
                if first_changed {
                    changed.notify_one();
                }
                touched.into_iter().map(Ok).collect::<Vec<_>>()
            }
            Err(e) => vec![Err(e)],
        })
        .flat_map(futures::stream::iter);
    (first, second, stream)
}

/// A cache that never holds anything and counts as synced: for what a scope does not read.
pub fn empty<K: Stored>() -> Cache<K> {
    let (store, _writer) = reflector::store::<K>();
    let (_tx, synced) = watch::channel(true);
    Cache {
        store,
        synced,
        changes: Arc::default(),
    }
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
pub fn watched_trimmed<K: Watched + PartialEq>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    feeding(reflect_trimmed(api, config, trim), changed)
}

/// The future that polls a cache's stream, waking `changed` on every change it counts.
fn feeding<K: Stored>(
    (cache, stream): (
        Cache<K>,
        impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    ),
    changed: &Arc<Notify>,
) -> (Cache<K>, impl Future<Output = ()> + Send + 'static) {
    let changed = changed.clone();
    let (counts, mut woken_at) = (cache.clone(), None);
    let feed = stream.for_each(move |_| {
        // Only a change wakes (not an object applied as it was stored).
        let changes = counts.changes();
        if woken_at != Some(changes) {
            woken_at = Some(changes);
            changed.notify_one();
        }
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

    /// What `T` reads of the packed part (the object without its metadata): a reader of a
    /// few fields decodes those, and skips the rest without building it.
    pub fn unpack_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
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
/// from the start again once the watch lists or sees a change ([`Retries`]). kube's default grows to 30 s, which leaves a
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

/// Retry delays of a watch of a kind the apiserver does not serve (for a kind of the suite,
/// its CRD is not installed): 5 s doubling to 60 s. Installing a definition is an
/// operator's step of minutes, not a blip; asking every 2 s would only fill the log and load
/// the apiserver, and a minute at most after the step the watch lists.
pub fn unserved_backoff() -> kube::runtime::watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(5))
        .with_max_delay(Duration::from_secs(60))
        .with_factor(2.0)
        .without_max_times()
        .into()
}

/// How long a failing watch goes between two warnings about it; the attempts between are
/// logged at debug level.
pub const WATCH_REMINDER: Duration = Duration::from_secs(60);

/// Why a watch attempt failed, as far as its retries and its log tell it apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The apiserver does not serve the kind: a 404 on its list or watch (a plain
    /// `404 page not found` when the group or version is unknown). For a kind of the suite,
    /// its CRD is not installed.
    Unserved,
    /// Anything else: the apiserver unreachable, a refused credential, an expired version.
    Other,
}

impl Failure {
    pub fn of(error: &watcher::Error) -> Self {
        let status = match error {
            watcher::Error::InitialListFailed(e)
            | watcher::Error::WatchStartFailed(e)
            | watcher::Error::WatchFailed(e) => match e {
                kube::Error::Api(status) => Some(status.as_ref()),
                _ => None,
            },
            watcher::Error::WatchError(status) => Some(status.as_ref()),
            watcher::Error::NoResourceVersion => None,
        };
        match status {
            Some(status) if status.code == 404 => Failure::Unserved,
            _ => Failure::Other,
        }
    }
}

/// What one item of a watch is to its retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A list starting or under way (`Init`, `InitApply`). kube's watcher says `Init` again
    /// before every attempt to list, failed ones included, so it is no sign of health.
    Listing,
    /// A list finished, or a change seen (`InitDone`, `Apply`, `Delete`).
    Progress,
    Failed(Failure),
}

impl Step {
    pub fn of<K>(item: &Result<watcher::Event<K>, watcher::Error>) -> Self {
        match item {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => Step::Listing,
            Ok(watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                Step::Progress
            }
            Err(e) => Step::Failed(Failure::of(e)),
        }
    }
}

/// What to say of one step of a watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Say {
    Nothing,
    /// The first failure of a spell, or the first of another kind within it: in full.
    Failing,
    /// A failure within [`WATCH_REMINDER`] of the last one said: at debug level.
    Again,
    /// A failure [`WATCH_REMINDER`] or more after the last one said: a reminder, with the
    /// attempts of the spell so far and how long it has lasted.
    Still {
        attempts: u32,
        lasted: Duration,
    },
    /// Progress after a spell of failures that lasted this long.
    Back(Duration),
}

/// A watch's spell of failures.
struct Spell {
    since: Instant,
    failure: Failure,
    said: Instant,
    attempts: u32,
}

/// The retries of one watch and what is said of its failures (pure: [`retried`] drives it).
///
/// Its delays grow across failed attempts and start over only on [`Step::Progress`]. kube's
/// `StreamBackoff` starts over on any item that is not an error, and the watcher's `Init`
/// before each new attempt to list is one: a list that kept failing (a CRD not installed)
/// was retried at the first delay, five times a second, for ever.
pub struct Retries {
    quick: kube::runtime::watcher::ExponentialBackoff,
    slow: kube::runtime::watcher::ExponentialBackoff,
    spell: Option<Spell>,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            quick: watch_backoff(),
            slow: unserved_backoff(),
            spell: None,
        }
    }
}

impl Retries {
    /// What to say of `step`, seen at `now`, and how long to wait before the watch is polled
    /// again: [`watch_backoff`] after a failure, [`unserved_backoff`] after a kind not
    /// served.
    pub fn step(&mut self, step: Step, now: Instant) -> (Say, Option<Duration>) {
        use kube::runtime::utils::Backoff as _;
        match step {
            Step::Listing => (Say::Nothing, None),
            Step::Progress => {
                self.quick.reset();
                self.slow.reset();
                match self.spell.take() {
                    Some(spell) => (Say::Back(now.saturating_duration_since(spell.since)), None),
                    None => (Say::Nothing, None),
                }
            }
            Step::Failed(failure) => {
                let pause = match failure {
                    Failure::Unserved => self.slow.next(),
                    Failure::Other => self.quick.next(),
                };
                let say = match &mut self.spell {
                    Some(spell) if spell.failure == failure => {
                        spell.attempts += 1;
                        if now.saturating_duration_since(spell.said) >= WATCH_REMINDER {
                            spell.said = now;
                            Say::Still {
                                attempts: spell.attempts,
                                lasted: now.saturating_duration_since(spell.since),
                            }
                        } else {
                            Say::Again
                        }
                    }
                    Some(spell) => {
                        (spell.failure, spell.said) = (failure, now);
                        spell.attempts += 1;
                        Say::Failing
                    }
                    None => {
                        self.spell = Some(Spell {
                            since: now,
                            failure,
                            said: now,
                            attempts: 1,
                        });
                        Say::Failing
                    }
                };
                (say, pause)
            }
        }
    }
}

/// A sentence saying why watching `K` fails with `error`; for a kind of the suite the
/// apiserver does not serve, which CRD is missing and the file that installs it (the
/// chart's `crds/` holds each definition as `<plural>.yaml`).
pub fn failing<K: kube::Resource<DynamicType = ()>>(error: &watcher::Error) -> String {
    let (kind, plural, group) = (K::kind(&()), K::plural(&()), K::group(&()));
    match Failure::of(error) {
        Failure::Unserved if group == crate::names::API_GROUP => format!(
            "the {kind} CRD ({plural}.{group}) is not installed: install it with `tensilectl crds` \
             (this release's definitions), or `kubectl apply -f deploy/helm/tensile/crds/{plural}.yaml` \
             (the chart's crds/, which `helm upgrade` does not apply)"
        ),
        Failure::Unserved => format!(
            "the apiserver does not serve {kind} ({}): {error}",
            K::api_version(&())
        ),
        Failure::Other => format!("watching {kind} fails: {error}"),
    }
}

/// `events`, a watch of `K` in `namespace` (`None`: every namespace, or a cluster-scoped
/// kind), paused after each failure and its failures said as [`Retries`] decides: the first
/// of a spell in full (an error for a CRD not installed, else a warning), a reminder at most
/// every [`WATCH_REMINDER`], the attempts between at debug level, and the watch's return.
pub fn retried<K, S>(events: S, namespace: Option<String>) -> impl Stream<Item = S::Item> + Send + 'static
where
    K: kube::Resource<DynamicType = ()> + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    struct State<S> {
        events: std::pin::Pin<Box<S>>,
        retries: Retries,
        pause: Option<Duration>,
        namespace: Option<String>,
    }
    let state = State {
        events: Box::pin(events),
        retries: Retries::default(),
        pause: None,
        namespace,
    };
    futures::stream::unfold(state, |mut state| async move {
        if let Some(pause) = state.pause.take() {
            tokio::time::sleep(pause).await;
        }
        let item = state.events.next().await?;
        let (say, pause) = state.retries.step(Step::of(&item), Instant::now());
        state.pause = pause;
        tell::<K>(say, &item, state.namespace.as_deref(), pause);
        Some((item, state))
    })
}

/// Logs what [`Retries`] decided to say of `item`.
fn tell<K: kube::Resource<DynamicType = ()>>(
    say: Say,
    item: &Result<watcher::Event<K>, watcher::Error>,
    namespace: Option<&str>,
    retry_in: Option<Duration>,
) {
    let kind = K::kind(&());
    let kind = kind.as_ref();
    let retry_in = retry_in.unwrap_or_default();
    match (say, item) {
        (Say::Failing, Err(e)) if Failure::of(e) == Failure::Unserved => {
            tracing::error!(kind, namespace, retry_in = ?retry_in, error = %e, "{}", failing::<K>(e));
        }
        (Say::Failing, Err(e)) => {
            tracing::warn!(kind, namespace, retry_in = ?retry_in, "{} (retried)", failing::<K>(e));
        }
        (Say::Again, Err(e)) => {
            tracing::debug!(kind, namespace, retry_in = ?retry_in, "{}", failing::<K>(e));
        }
        (Say::Still { attempts, lasted }, Err(e)) => {
            tracing::warn!(
                kind,
                namespace,
                attempts,
                retry_in = ?retry_in,
                "still, for {}s: {}",
                lasted.as_secs(),
                failing::<K>(e)
            );
        }
        (Say::Back(lasted), _) => {
            tracing::info!(
                kind,
                namespace,
                "watching {kind} again after {}s of failures",
                lasted.as_secs()
            );
        }
        _ => {}
    }
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

    fn list_failed(code: u16) -> watcher::Error {
        let status =
            kube::core::Status::failure("404 page not found", "Failed to parse error data").with_code(code);
        watcher::Error::InitialListFailed(kube::Error::Api(status.boxed()))
    }

    /// Feeds `steps` to `retries`, each seen when the pause before it has passed, as
    /// [`retried`] does: what was said and each pause, in milliseconds.
    fn run(retries: &mut Retries, start: Instant, steps: &[Step]) -> (Vec<Say>, Vec<u128>, Instant) {
        let (mut said, mut pauses, mut now) = (Vec::new(), Vec::new(), start);
        for step in steps {
            let (say, pause) = retries.step(*step, now);
            said.push(say);
            if let Some(pause) = pause {
                pauses.push(pause.as_millis());
                now += pause;
            }
        }
        (said, pauses, now)
    }

    /// A list that keeps failing as the watcher shows it: `Init`, then the failure.
    fn failing_lists(failure: Failure, n: usize) -> Vec<Step> {
        [Step::Listing, Step::Failed(failure)].repeat(n)
    }

    #[test]
    fn a_kind_not_served_is_a_404_on_its_list_and_anything_else_is_another_failure() {
        assert_eq!(Failure::of(&list_failed(404)), Failure::Unserved);
        assert_eq!(Failure::of(&list_failed(403)), Failure::Other);
        assert_eq!(Failure::of(&watcher::Error::NoResourceVersion), Failure::Other);
        let gone = kube::core::Status::failure("too old", "Expired")
            .with_code(410)
            .boxed();
        assert_eq!(Failure::of(&watcher::Error::WatchError(gone)), Failure::Other);
        use watcher::Event::*;
        let cm = k8s_openapi::api::core::v1::ConfigMap::default;
        let steps: Vec<Step> = [Init, InitApply(cm()), InitDone, Apply(cm()), Delete(cm())]
            .into_iter()
            .map(|e| Step::of(&Ok(e)))
            .collect();
        assert_eq!(
            steps,
            [
                Step::Listing,
                Step::Listing,
                Step::Progress,
                Step::Progress,
                Step::Progress
            ]
        );
    }

    #[test]
    fn a_missing_crd_is_said_once_then_retried_five_seconds_doubling_to_a_minute_with_a_reminder_a_minute_apart()
     {
        let mut retries = Retries::default();
        let (said, pauses, _) = run(&mut retries, Instant::now(), &failing_lists(Failure::Unserved, 8));
        assert_eq!(
            pauses,
            [5000, 10_000, 20_000, 40_000, 60_000, 60_000, 60_000, 60_000]
        );
        let failures: Vec<Say> = said.into_iter().filter(|s| *s != Say::Nothing).collect();
        assert_eq!(failures[0], Say::Failing);
        // At 5, 15, 35 s: quietly; at 75 s (a minute after the first): a reminder; at 135,
        // 195, 255 s: one each, a minute apart.
        assert_eq!(failures[1..4], [Say::Again, Say::Again, Say::Again]);
        let reminders: Vec<(u32, u64)> = failures[4..]
            .iter()
            .map(|s| match s {
                Say::Still { attempts, lasted } => (*attempts, lasted.as_secs()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(reminders, [(5, 75), (6, 135), (7, 195), (8, 255)]);
    }

    #[test]
    fn the_watchers_init_before_each_new_list_does_not_start_the_delays_over() {
        // kube's StreamBackoff started over on it: 200 ms, five lists a second, for ever.
        let mut retries = Retries::default();
        let (said, pauses, _) = run(&mut retries, Instant::now(), &failing_lists(Failure::Other, 7));
        assert_eq!(pauses, [200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(said.iter().filter(|s| **s == Say::Failing).count(), 1);
        assert!(!said.iter().any(|s| matches!(s, Say::Still { .. })), "{said:?}");
    }

    #[test]
    fn progress_starts_the_delays_over_and_ends_the_spell_which_is_said() {
        let mut retries = Retries::default();
        let start = Instant::now();
        let (_, _, now) = run(&mut retries, start, &failing_lists(Failure::Unserved, 3));
        // The CRD is applied: the next list succeeds.
        let (said, pauses, now) = run(&mut retries, now, &[Step::Listing, Step::Listing, Step::Progress]);
        assert!(pauses.is_empty());
        assert_eq!(said[2], Say::Back(Duration::from_secs(35)));
        let (said, pauses, _) = run(&mut retries, now, &failing_lists(Failure::Unserved, 2));
        assert_eq!(pauses, [5000, 10_000], "from the first delay again");
        assert_eq!(said[1], Say::Failing, "a new spell is said in full");
    }

    #[test]
    fn a_failure_of_another_kind_within_a_spell_is_said_in_full_and_keeps_its_own_delays() {
        let mut retries = Retries::default();
        // The apiserver unreachable for a while, then up without the CRD.
        let (said, pauses, now) = run(&mut retries, Instant::now(), &failing_lists(Failure::Other, 3));
        assert_eq!(pauses, [200, 400, 800]);
        assert_eq!(said[1], Say::Failing);
        let (said, pauses, _) = run(&mut retries, now, &failing_lists(Failure::Unserved, 2));
        assert_eq!(pauses, [5000, 10_000]);
        assert_eq!(
            said[1],
            Say::Failing,
            "the missing CRD is said at once, not a minute later"
        );
        assert_eq!(said[3], Say::Again);
    }

    #[test]
    fn a_missing_crd_of_the_suite_is_named_with_the_chart_file_that_installs_it() {
        let said = failing::<crate::exclusion::ExclusionRecord>(&list_failed(404));
        assert!(
            said.contains("ExclusionRecord CRD (exclusionrecords.tensile.io) is not installed"),
            "{said}"
        );
        let file = "deploy/helm/tensile/crds/exclusionrecords.yaml";
        assert!(said.contains(&format!("kubectl apply -f {file}")), "{said}");
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        assert!(repo.join(file).is_file(), "the file named is the chart's");
        let other = failing::<Pod>(&list_failed(404));
        assert!(
            other.starts_with("the apiserver does not serve Pod (v1)"),
            "{other}"
        );
        let refused = failing::<Pod>(&list_failed(403));
        assert!(
            refused.starts_with("watching Pod fails: failed to perform initial object list"),
            "{refused}"
        );
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

    #[test]
    fn a_trimmed_object_whose_only_change_was_trimmed_away_is_the_same() {
        let node = |version: &str, unschedulable: bool| k8s_openapi::api::core::v1::Node {
            metadata: ObjectMeta {
                name: Some("n".into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::core::v1::NodeSpec {
                unschedulable: Some(unschedulable),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(same_but_version(&node("1", false), &node("2", false)));
        assert!(!same_but_version(&node("1", false), &node("2", true)));
    }

    #[test]
    fn a_memo_works_out_again_only_when_an_input_moved() {
        let memo = Memo::default();
        let mut works = 0;
        for (inputs, want) in [(vec![1, 1], 1), (vec![1, 1], 1), (vec![1, 2], 2), (vec![1, 2], 2)] {
            let value = memo.get(inputs, || {
                works += 1;
                works
            });
            assert_eq!(value, want);
        }
        assert_eq!(works, 2);
    }

    /// A split of ConfigMaps: the first cache keeps those not marked done, the second those
    /// labelled `mine`.
    fn split_of(
        namespaces: Vec<Option<String>>,
    ) -> (
        Split<
            k8s_openapi::api::core::v1::ConfigMap,
            k8s_openapi::api::core::v1::ConfigMap,
            k8s_openapi::api::core::v1::ConfigMap,
        >,
        Cache<k8s_openapi::api::core::v1::ConfigMap>,
        Cache<k8s_openapi::api::core::v1::ConfigMap>,
    ) {
        Split::new(namespaces, |cm: k8s_openapi::api::core::v1::ConfigMap| {
            let done = cm.data.as_ref().is_some_and(|d| d.contains_key("done"));
            let mine = cm
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("mine"));
            ((!done).then(|| cm.clone()), mine.then_some(cm))
        })
    }

    fn marked(
        mut cm: k8s_openapi::api::core::v1::ConfigMap,
        mine: bool,
        done: bool,
    ) -> k8s_openapi::api::core::v1::ConfigMap {
        if mine {
            cm.metadata.labels = Some([("mine".to_owned(), String::new())].into());
        }
        if done {
            cm.data = Some([("done".to_owned(), String::new())].into());
        }
        cm
    }

    fn touched_names(touched: &[k8s_openapi::api::core::v1::ConfigMap]) -> Vec<String> {
        touched
            .iter()
            .map(|o| o.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    #[test]
    fn one_watch_split_in_two_caches_keeps_each_as_its_own_watch_would() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let (mut split, first, second) = split_of(vec![None]);
        let (mut touched, mut changed) = (Vec::new(), false);
        for event in [
            Init,
            InitApply(marked(config_map("a", "p1", "1"), true, false)),
            InitApply(marked(config_map("a", "p2", "1"), false, false)),
            InitApply(marked(config_map("a", "p3", "1"), true, true)),
            InitDone,
        ] {
            let (t, c) = split.step(0, event);
            touched.extend(t);
            changed |= c;
        }
        assert_eq!(
            names(first.store()),
            ["a/p1@1", "a/p2@1"],
            "the done one is not kept first"
        );
        assert_eq!(names(second.store()), ["a/p1@1", "a/p3@1"]);
        let mut yielded = touched_names(&touched);
        yielded.sort();
        assert_eq!(
            yielded,
            ["p1", "p3"],
            "only the second cache's objects are yielded"
        );
        assert!(changed && *first.synced.borrow() && *second.synced.borrow());

        // Labelled later: now in the second cache too.
        let (t, c) = split.step(0, Apply(marked(config_map("a", "p2", "2"), true, false)));
        assert_eq!((touched_names(&t), c), (vec!["p2".to_owned()], true));
        assert_eq!(names(second.store()), ["a/p1@1", "a/p2@2", "a/p3@1"]);

        // A label taken off: gone from the second cache (yielded, as a deleted object is), kept first.
        let (t, _) = split.step(0, Apply(config_map("a", "p1", "2")));
        assert_eq!(touched_names(&t), ["p1"]);
        assert_eq!(names(second.store()), ["a/p2@2", "a/p3@1"]);
        assert_eq!(names(first.store()), ["a/p1@2", "a/p2@2"]);

        // Done: out of the first cache only.
        let before = first.changes();
        let (_, c) = split.step(0, Apply(marked(config_map("a", "p2", "3"), true, true)));
        assert!(c && first.changes() > before);
        assert_eq!(names(first.store()), ["a/p1@2"]);
        assert_eq!(names(second.store()), ["a/p2@3", "a/p3@1"]);

        // Deleted while only the second held it: the first does not change.
        let before = first.changes();
        let (t, c) = split.step(0, Delete(config_map("a", "p3", "2")));
        assert_eq!(
            (touched_names(&t), c, first.changes()),
            (vec!["p3".to_owned()], false, before)
        );
        assert_eq!(names(second.store()), ["a/p2@3"]);

        // Neither cache keeps it, nor held it: nothing happens anywhere.
        let (t, c) = split.step(0, Apply(marked(config_map("a", "p9", "1"), false, true)));
        assert!(t.is_empty() && !c);
        assert_eq!(names(first.store()), ["a/p1@2"]);
        assert_eq!(names(second.store()), ["a/p2@3"]);
    }

    #[test]
    fn a_split_over_several_namespaces_forgets_what_stopped_matching_before_every_watch_listed() {
        use watcher::Event::{Apply, Init, InitApply, InitDone};
        let (mut split, first, second) = split_of(vec![Some("a".into()), Some("b".into())]);
        for event in [
            Init,
            InitApply(marked(config_map("a", "p1", "1"), true, false)),
            InitDone,
        ] {
            split.step(0, event);
        }
        // Namespace b has not listed: nothing is in either cache yet, and p1 stops matching
        // the second one meanwhile.
        assert!(names(second.store()).is_empty());
        split.step(0, Apply(marked(config_map("a", "p1", "2"), false, false)));
        for event in [
            Init,
            InitApply(marked(config_map("b", "q1", "1"), true, false)),
            InitDone,
        ] {
            split.step(1, event);
        }
        assert_eq!(names(first.store()), ["a/p1@2", "b/q1@1"]);
        assert_eq!(
            names(second.store()),
            ["b/q1@1"],
            "p1 is not kept as it was listed"
        );
        assert!(*first.synced.borrow() && *second.synced.borrow());

        // Namespace b lists again without q1: gone from both caches; a is untouched.
        for event in [Init, InitDone] {
            split.step(1, event);
        }
        assert_eq!(names(first.store()), ["a/p1@2"]);
        assert!(names(second.store()).is_empty());
    }
}
