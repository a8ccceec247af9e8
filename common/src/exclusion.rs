//! The exclusion record: which virtual nodes refused a workload, kept where the webhook and
//! the multi-scheduler can read it. Only the descheduler's leader writes records; every
//! reader and the writer go through this module (the codec, [`follow`], [`store::Writer`]).
//!
//! Each workload's record is an object of its own, an `ExclusionRecord`
//! (`tensile.io/v1alpha1`, namespaced; its definition ships in the chart's `crds/`), in the
//! namespace of `--exclusions-configmap`. The object is named after the record's key (the
//! UID of the pods' controller, or for a bare pod the UID of the first pod of its line of
//! replacements) and its `spec` is the record:
//!
//! ```json
//! {"key":"<uid>","namespace":"web","kind":"ReplicaSet","name":"web-7d4b9","moves":1,
//!  "nodes":{"vn-a":"2024-05-01T10:10:00Z"},"expires":"2024-05-01T10:10:00Z"}
//! ```
//!
//! `nodes` maps each excluded virtual node to the instant its exclusion ends; `moves` counts
//! how many times a node was added, which bounds the moves of one workload; `exhausted` says
//! when the descheduler gave up on it; past `expires` the record is void and the
//! descheduler's leader deletes the object ([`store::Writer::sweep`]).
//!
//! Why a kind of our own: a change writes one object of a few hundred bytes, and every
//! watcher receives that object, not the whole set; there is no size limit on the set (one
//! ConfigMap held about 4–6k records before its 1 MiB limit); RBAC grants exactly these
//! objects; and no component outside the suite lists them (kube-controller-manager
//! watches every ConfigMap and every Lease of the cluster, so a ConfigMap or Lease per
//! record would load it with the whole set).
//!
//! Until version 0.1 every record lived in one ConfigMap, `--exclusions-configmap` (by
//! default `kube-system/tensile-exclusions`), keyed by the same keys with the same JSON
//! (without `key`). Readers still honour the records of that ConfigMap (an object of the
//! same key wins), nothing writes it any more, and the descheduler deletes it once it holds
//! no live record, so an upgrade loses no exclusion.
//!
//! A record that does not decode (written by a newer release, or by hand) is counted in
//! [`Exclusions::unreadable`], applied to nobody and left alone: no other record's write
//! touches it, and the sweep deletes only records it can read.

mod index;
pub mod store;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::runtime::watcher;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::cache;

pub use index::Index;

/// Where the records live: their namespace, and the name of the old ConfigMap of records
/// that readers still honour (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub namespace: String,
    pub name: String,
}

/// Where the records live unless a flag says otherwise.
pub const DEFAULT_LOCATION: &str = "kube-system/tensile-exclusions";

impl std::str::FromStr for Location {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => Ok(Location {
                namespace: ns.to_owned(),
                name: name.to_owned(),
            }),
            _ => Err(format!("{s:?} is not namespace/name")),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The exclusions of one workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub namespace: String,
    /// Kind and name of the controller (`Pod` and the first pod's name for a bare pod).
    pub kind: String,
    pub name: String,
    /// Excluded virtual node → when its exclusion ends.
    #[serde(with = "times")]
    pub nodes: BTreeMap<String, Timestamp>,
    /// How many times a virtual node was added to `nodes`.
    #[serde(default)]
    pub moves: u32,
    /// When the whole entry may be dropped.
    #[serde(with = "time")]
    pub expires: Timestamp,
    /// When the descheduler gave up moving this workload (it warned once, then).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_time")]
    pub exhausted: Option<Timestamp>,
}

impl Record {
    /// The nodes still excluded at `now`, by name.
    pub fn active(&self, now: Timestamp) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .filter(move |(_, until)| **until > now)
            .map(|(n, _)| n.as_str())
    }

    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires <= now
    }
}

/// The API version and kind of the record objects.
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "ExclusionRecord";
pub const PLURAL: &str = "exclusionrecords";

/// One record as the API stores it. `spec` is decoded per object (see [`decode`]), so one
/// record that does not decode is skipped instead of failing the whole watch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExclusionRecord {
    #[serde(rename = "apiVersion", default)]
    pub api_version: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl kube::Resource for ExclusionRecord {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        crate::names::API_GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The `spec` of a record object: its key and the record.
#[derive(Serialize, Deserialize)]
struct Spec {
    key: String,
    #[serde(flatten)]
    record: Record,
}

/// The name of the object holding the record of `key`: the key itself when it is a valid
/// object name (UIDs are), otherwise `h-` and a SHA-256 of it, so each key has one name.
pub fn object_name(key: &str) -> String {
    let valid = !key.is_empty()
        && key.len() <= 63
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !key.starts_with('-')
        && !key.ends_with('-')
        && !key.starts_with("h-");
    if valid {
        return key.to_owned();
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let hex: String = digest.as_ref()[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("h-{hex}")
}

/// The object holding `record` for `key` in `namespace`, written by `manager`; at
/// `resource_version` when it replaces one.
pub fn encode(
    namespace: &str,
    key: &str,
    record: &Record,
    resource_version: Option<String>,
    manager: &str,
) -> Result<ExclusionRecord, serde_json::Error> {
    let spec = serde_json::to_value(Spec {
        key: key.to_owned(),
        record: record.clone(),
    })?;
    Ok(ExclusionRecord {
        api_version: format!("{}/{VERSION}", crate::names::API_GROUP),
        kind: KIND.to_owned(),
        metadata: ObjectMeta {
            name: Some(object_name(key)),
            namespace: Some(namespace.to_owned()),
            resource_version,
            labels: Some(BTreeMap::from([(
                crate::names::MANAGED_BY.to_owned(),
                manager.to_owned(),
            )])),
            ..Default::default()
        },
        spec,
    })
}

/// The key and record an object holds; an error when its spec does not decode or its name
/// is not the one its key gives (a record never applies under a key it was not written for).
pub fn decode(object: &ExclusionRecord) -> Result<(String, Record), String> {
    let spec = Spec::deserialize(&object.spec).map_err(|e| e.to_string())?;
    let name = object.metadata.name.as_deref().unwrap_or_default();
    if object_name(&spec.key) != name {
        return Err(format!(
            "named {name:?}, but its key {:?} names {:?}",
            spec.key,
            object_name(&spec.key)
        ));
    }
    Ok((spec.key, spec.record))
}

/// How many shards a [`Records`] map has: a change copies at most one shard (a 256th of
/// the records) while a reader still holds the previous version.
const SHARDS: usize = 256;

/// Records by key, cheap to clone and to change: the map is split into shards that clones
/// share, and a change copies only the shard it touches when that shard is shared. Every
/// change the watch shows is published as a new version without copying the whole set.
#[derive(Clone)]
pub struct Records<V: Clone> {
    shards: Vec<Arc<BTreeMap<String, V>>>,
    len: usize,
}

impl<V: Clone> Default for Records<V> {
    fn default() -> Self {
        let empty = Arc::new(BTreeMap::new());
        Self {
            shards: vec![empty; SHARDS],
            len: 0,
        }
    }
}

fn shard_of(key: &str) -> usize {
    // FNV-1a: stable across runs and processes, unlike std's random hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % SHARDS as u64) as usize
}

impl<V: Clone> Records<V> {
    pub fn get(&self, key: &str) -> Option<&V> {
        self.shards[shard_of(key)].get(key)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn insert(&mut self, key: String, value: V) -> Option<V> {
        let old = Arc::make_mut(&mut self.shards[shard_of(&key)]).insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    pub fn remove(&mut self, key: &str) -> Option<V> {
        let shard = &mut self.shards[shard_of(key)];
        if !shard.contains_key(key) {
            return None;
        }
        let old = Arc::make_mut(shard).remove(key);
        self.len -= 1;
        old
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every record, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &V)> {
        self.shards.iter().flat_map(|s| s.iter())
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.iter().map(|(k, _)| k)
    }
}

impl<V: Clone + PartialEq> PartialEq for Records<V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len
            && self
                .shards
                .iter()
                .zip(&other.shards)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a == b)
    }
}

impl<V: Clone + Eq> Eq for Records<V> {}

impl<V: Clone + std::fmt::Debug> std::fmt::Debug for Records<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V: Clone> std::ops::Index<&str> for Records<V> {
    type Output = V;

    fn index(&self, key: &str) -> &V {
        match self.get(key) {
            Some(v) => v,
            None => panic!("no record {key:?}"),
        }
    }
}

impl<V: Clone> FromIterator<(String, V)> for Records<V> {
    fn from_iter<I: IntoIterator<Item = (String, V)>>(iter: I) -> Self {
        let mut out = Self::default();
        for (k, v) in iter {
            out.insert(k, v);
        }
        out
    }
}

/// Every record a reader knows: the record objects, and those of the old ConfigMap that no
/// object of the same key replaces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exclusions {
    pub records: Records<Record>,
    /// Key → resourceVersion of the object holding its record (records from the old
    /// ConfigMap have none): what the writer replaces and what the sweep deletes.
    pub versions: Records<String>,
    /// Records that did not decode, objects and old entries together (never applied).
    pub unreadable: usize,
    /// The old ConfigMap, when it exists: its resourceVersion, its records, and how many of
    /// its entries did not decode.
    pub legacy: Option<Legacy>,
}

/// The records of the old ConfigMap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Legacy {
    pub resource_version: Option<String>,
    pub records: Arc<BTreeMap<String, Record>>,
    pub unreadable: usize,
}

impl Legacy {
    /// Reads the ConfigMap's entries; an entry that does not decode is counted and skipped.
    pub fn from_config_map(cm: &ConfigMap) -> Self {
        let mut records = BTreeMap::new();
        let mut unreadable = 0;
        for (key, value) in cm.data.iter().flatten() {
            match serde_json::from_str::<Record>(value) {
                Ok(record) => {
                    records.insert(key.clone(), record);
                }
                Err(_) => unreadable += 1,
            }
        }
        Legacy {
            resource_version: cm.metadata.resource_version.clone(),
            records: Arc::new(records),
            unreadable,
        }
    }

    /// Whether any of its records is still in force at `now`.
    pub fn any_live(&self, now: Timestamp) -> bool {
        self.records.values().any(|r| !r.is_expired(now))
    }
}

impl Exclusions {
    /// The records of an old exclusions ConfigMap alone (as a reader saw them before
    /// records were objects).
    pub fn from_config_map(cm: &ConfigMap) -> Self {
        let mut index = Index::default();
        index.legacy(Some(cm));
        index.exclusions().clone()
    }

    /// The virtual nodes excluded for the workload `key` at `now`, sorted.
    pub fn excluded_nodes(&self, key: &str, now: Timestamp) -> Vec<String> {
        match self.records.get(key) {
            Some(r) if !r.is_expired(now) => r.active(now).map(str::to_owned).collect(),
            _ => Vec::new(),
        }
    }

    /// Records that have not expired at `now`.
    pub fn live(&self, now: Timestamp) -> usize {
        self.records.values().filter(|r| !r.is_expired(now)).count()
    }
}

/// Waits until a reader has its first full view of the records (the objects, and the old
/// ConfigMap), and says why it cannot have it while a watch of them fails.
#[derive(Clone)]
pub struct Synced {
    synced: watch::Receiver<bool>,
    trouble: watch::Receiver<Option<String>>,
}

impl Synced {
    /// Waits until both lists are in (forever if they never come).
    pub async fn synced(&self) {
        let mut rx = self.synced.clone();
        if rx.wait_for(|s| *s).await.is_err() {
            futures::future::pending::<()>().await;
        }
    }

    /// Why the records cannot be read now, while a watch of them fails: for example that the
    /// `ExclusionRecord` CRD is not installed, and how to install it ([`cache::failing`]).
    pub fn trouble(&self) -> Option<String> {
        self.trouble.borrow().clone()
    }

    /// Keeps what `standing`'s `/readyz` says current with [`Synced::trouble`], after
    /// `note` (what the daemon says anyway, such as `dry run`); runs for ever. A daemon that
    /// waits for the records is then not ready *and says why*: "caches syncing" alone left
    /// an operator guessing.
    pub async fn report_to(self, standing: crate::leader::Standing, note: Option<String>) {
        let mut trouble = self.trouble;
        loop {
            let said = {
                let trouble = trouble.borrow_and_update();
                [note.as_deref(), trouble.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            // `with_note` sets the note of every clone: they share one standing.
            standing.clone().with_note(said);
            if trouble.changed().await.is_err() {
                futures::future::pending::<()>().await;
            }
        }
    }
}

/// What one of the two watches of [`follow`] showed.
enum Seen {
    Record(Result<watcher::Event<ExclusionRecord>, watcher::Error>),
    Legacy(Result<watcher::Event<ConfigMap>, watcher::Error>),
}

/// Watches the record objects in `api`'s namespace and the old ConfigMap `name` there.
/// Returns a handle that says when both are read (and why not, while a watch fails), a
/// channel holding every record after every change, and the future that keeps it current.
/// Each change costs a reader the record it changes (see [`Records`]), not the whole set.
///
/// Both watches are [`cache::retried`]: without the `ExclusionRecord` CRD (a binary run by
/// hand, an upgrade that has not applied it yet) the reader says once which definition is
/// missing and how to install it, asks again 5 s to 60 s apart, and reads the records
/// within a minute of its installation, without a restart.
pub fn follow(
    api: Api<ConfigMap>,
    name: &str,
) -> (
    Synced,
    watch::Receiver<Arc<Exclusions>>,
    impl Future<Output = ()> + Send + 'static,
) {
    let namespace = api.namespace().unwrap_or("default").to_owned();
    let client = kube::Client::from(api.clone());
    let records: Api<ExclusionRecord> = Api::namespaced(client, &namespace);
    let records = cache::retried(
        watcher(records, watcher::Config::default()),
        Some(namespace.clone()),
    )
    .map(Seen::Record);
    let legacy = cache::retried(
        watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        ),
        Some(namespace.clone()),
    )
    .map(Seen::Legacy);
    let (tx, rx) = watch::channel(Arc::new(Exclusions::default()));
    let (synced_tx, synced_rx) = watch::channel(false);
    let (trouble_tx, trouble_rx) = watch::channel(None);
    let feed = async move {
        let mut index = Index::default();
        let mut events = std::pin::pin!(futures::stream::select(records, legacy));
        let mut legacy_staged: Option<ConfigMap> = None;
        let mut listed = (false, false);
        // Why each watch fails, while it does (said by `cache::retried`, shown by `Synced`).
        let mut failing: (Option<String>, Option<String>) = (None, None);
        let mut unreadable = 0;
        while let Some(event) = events.next().await {
            let changed = match event {
                Seen::Record(event) => {
                    if !matches!(cache::Step::of(&event), cache::Step::Listing) {
                        failing.0 = event.as_ref().err().map(cache::failing::<ExclusionRecord>);
                    }
                    match event {
                        Ok(watcher::Event::Init) => {
                            index.restart();
                            false
                        }
                        Ok(watcher::Event::InitApply(object)) => {
                            index.stage(&object);
                            false
                        }
                        Ok(watcher::Event::InitDone) => {
                            index.listed();
                            listed.0 = true;
                            true
                        }
                        Ok(watcher::Event::Apply(object)) => {
                            index.apply(&object);
                            true
                        }
                        Ok(watcher::Event::Delete(object)) => {
                            index.delete(&object);
                            true
                        }
                        Err(_) => false,
                    }
                }
                Seen::Legacy(event) => {
                    if !matches!(cache::Step::of(&event), cache::Step::Listing) {
                        failing.1 = event.as_ref().err().map(cache::failing::<ConfigMap>);
                    }
                    match event {
                        Ok(watcher::Event::Init) => {
                            legacy_staged = None;
                            false
                        }
                        Ok(watcher::Event::InitApply(cm)) => {
                            legacy_staged = Some(cm);
                            false
                        }
                        Ok(watcher::Event::InitDone) => {
                            index.legacy(legacy_staged.take().as_ref());
                            listed.1 = true;
                            true
                        }
                        Ok(watcher::Event::Apply(cm)) => {
                            index.legacy(Some(&cm));
                            true
                        }
                        Ok(watcher::Event::Delete(_)) => {
                            index.legacy(None);
                            true
                        }
                        Err(_) => false,
                    }
                }
            };
            let trouble = failing.0.clone().or_else(|| failing.1.clone());
            trouble_tx.send_if_modified(|t| {
                let modified = *t != trouble;
                *t = trouble;
                modified
            });
            if changed && listed.0 && listed.1 {
                let current = index.exclusions();
                if current.unreadable != unreadable {
                    unreadable = current.unreadable;
                    tracing::warn!(namespace = %namespace, unreadable, "exclusion records that do not decode are skipped");
                }
                tx.send_replace(Arc::new(current.clone()));
                synced_tx.send_replace(true);
            }
        }
    };
    let synced = Synced {
        synced: synced_rx,
        trouble: trouble_rx,
    };
    (synced, rx, feed)
}

mod time {
    use jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::api::time(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

mod opt_time {
    use jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&crate::api::time(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Timestamp>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

mod times {
    use std::collections::BTreeMap;

    use jiff::Timestamp;
    use serde::ser::SerializeMap as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<String, Timestamp>, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(m.len()))?;
        for (k, v) in m {
            map.serialize_entry(k, &crate::api::time(*v))?;
        }
        map.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, Timestamp>, D::Error> {
        let raw = BTreeMap::<String, String>::deserialize(d)?;
        raw.into_iter()
            .map(|(k, v)| v.parse().map(|t| (k, t)).map_err(serde::de::Error::custom))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn config_map(data: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            data: Some(data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        }
    }

    fn record(node: &str, until: &str) -> Record {
        Record {
            namespace: "web".into(),
            kind: "ReplicaSet".into(),
            name: "web-1".into(),
            nodes: [(node.to_owned(), at(until))].into(),
            moves: 1,
            expires: at(until),
            exhausted: None,
        }
    }

    #[test]
    fn an_old_configmap_record_reads_as_written_and_only_unexpired_nodes_are_excluded() {
        let text = r#"{"namespace":"web","kind":"ReplicaSet","name":"web-1","moves":2,
            "nodes":{"vn-a":"2024-05-01T10:10:00Z","vn-c":"2024-05-01T10:00:00Z"},
            "expires":"2024-05-01T10:10:00Z"}"#;
        let ex = Exclusions::from_config_map(&config_map(&[("uid-1", text), ("uid-2", "not json")]));
        assert_eq!(ex.unreadable, 1);
        let now = at("2024-05-01T10:05:00Z");
        assert_eq!(ex.excluded_nodes("uid-1", now), vec!["vn-a"]);
        assert!(ex.excluded_nodes("uid-9", now).is_empty());
        assert!(
            ex.excluded_nodes("uid-1", at("2024-05-01T10:10:00Z")).is_empty(),
            "an exclusion ends at its expiry"
        );
        assert_eq!(ex.records["uid-1"].moves, 2);
        assert!(ex.versions.is_empty(), "old records are in no object");
    }

    #[test]
    fn a_record_object_reads_back_as_written_under_its_key() {
        let r = record("vn-a", "2024-05-01T10:10:00Z");
        let uid = "0b6f5c1e-7a0d-4f43-9b0e-2b1d3c4e5f60";
        let object = encode("tensile", uid, &r, Some("7".into()), "tensile-descheduler").unwrap();
        assert_eq!(
            object.metadata.name.as_deref(),
            Some(uid),
            "a UID names its own object"
        );
        // What the apiserver sends back, as JSON.
        let back: ExclusionRecord = serde_json::from_value(serde_json::to_value(&object).unwrap()).unwrap();
        assert_eq!(back.api_version, "tensile.io/v1alpha1");
        assert_eq!(decode(&back).unwrap(), (uid.to_owned(), r.clone()));
        assert_eq!(back.spec["key"], uid);
        assert_eq!(back.spec["nodes"]["vn-a"], "2024-05-01T10:10:00Z");
        let size = serde_json::to_vec(&object).unwrap().len();
        assert!(size < 600, "one record is a small object: {size} bytes");
    }

    #[test]
    fn times_come_back_in_whole_seconds_so_a_write_is_recognised_by_its_version_not_its_record() {
        let mut r = record("vn-a", "2024-05-01T10:10:00Z");
        r.expires = at("2024-05-01T10:10:00.5Z");
        let object = encode("ns", "uid-1", &r, None, "m").unwrap();
        let (_, back) = decode(&object).unwrap();
        assert_ne!(
            back, r,
            "the writer must not wait for an equal record: it never comes"
        );
        assert_eq!(back.expires, at("2024-05-01T10:10:00Z"));
    }

    #[test]
    fn every_key_names_one_valid_object_and_odd_keys_are_hashed() {
        for key in ["Upper", "a/b", "", "-x", "h-abc", &"x".repeat(64)] {
            let name = object_name(key);
            assert!(name.starts_with("h-") && name.len() == 42, "{key:?} -> {name}");
            assert_eq!(name, object_name(key), "deterministic");
        }
        assert_ne!(object_name("a/b"), object_name("a/c"));
        assert_eq!(object_name("abc-1"), "abc-1");
    }

    #[test]
    fn an_object_whose_name_is_not_its_keys_or_whose_spec_is_not_a_record_does_not_decode() {
        let mut object = encode("ns", "uid-1", &record("vn-a", "2024-05-01T10:10:00Z"), None, "m").unwrap();
        object.metadata.name = Some("uid-2".into());
        assert!(decode(&object).is_err());
        object.metadata.name = Some("uid-1".into());
        object.spec["nodes"] = serde_json::json!("vn-a");
        assert!(decode(&object).is_err());
        object.spec = serde_json::Value::Null;
        assert!(decode(&object).is_err());
    }

    #[test]
    fn records_split_in_shards_behave_as_one_map_and_clones_share_untouched_shards() {
        let mut a: Records<u32> = (0..1000).map(|i| (format!("k{i}"), i)).collect();
        assert_eq!(a.len(), 1000);
        let b = a.clone();
        a.insert("k5".into(), 50);
        a.insert("new".into(), 1);
        assert_eq!(a.remove("k7"), Some(7));
        assert_eq!(a.remove("k7"), None);
        assert_eq!((a.len(), b.len()), (1000, 1000));
        assert_eq!((a["k5"], b["k5"]), (50, 5), "the clone keeps its version");
        assert!(b.contains_key("k7") && !a.contains_key("k7"));
        let shared = a
            .shards
            .iter()
            .zip(&b.shards)
            .filter(|(x, y)| Arc::ptr_eq(x, y))
            .count();
        assert!(
            shared >= SHARDS - 3,
            "only the touched shards were copied: {shared} shared"
        );
        let mut c = b.clone();
        assert_eq!(c, b);
        c.insert("k5".into(), 5);
        assert_eq!(c, b, "equal content");
        c.insert("k5".into(), 6);
        assert_ne!(c, b);
        let mut keys: Vec<&String> = a.keys().collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 1000);
    }

    #[test]
    fn the_chart_defines_the_kind_the_code_reads_and_writes() {
        let crd: serde_json::Value = serde_yaml::from_str(include_str!(
            "../../deploy/helm/tensile/crds/exclusionrecords.yaml"
        ))
        .unwrap();
        let spec = &crd["spec"];
        assert_eq!(
            crd["metadata"]["name"],
            format!("{PLURAL}.{}", crate::names::API_GROUP)
        );
        assert_eq!(spec["group"], crate::names::API_GROUP);
        assert_eq!(spec["names"]["kind"], KIND);
        assert_eq!(spec["names"]["plural"], PLURAL);
        assert_eq!(spec["scope"], "Namespaced");
        assert_eq!(spec["versions"][0]["name"], VERSION);
        assert_eq!(spec["versions"][0]["served"], true);
        assert_eq!(spec["versions"][0]["storage"], true);
        let schema = &spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            schema["x-kubernetes-preserve-unknown-fields"], true,
            "the apiserver keeps records it cannot validate, so readers skip them instead of a write failing"
        );
    }

    #[test]
    fn locations_read_as_namespace_slash_name() {
        let l: Location = DEFAULT_LOCATION.parse().unwrap();
        assert_eq!(
            (l.namespace.as_str(), l.name.as_str()),
            ("kube-system", "tensile-exclusions")
        );
        for bad in ["x", "/x", "x/", "a/b/c"] {
            assert!(bad.parse::<Location>().is_err(), "{bad}");
        }
    }
}
