//! The exclusion record: which virtual nodes refused a workload, kept where the webhook (and
//! later the multi-scheduler) can read it.
//!
//! One ConfigMap (by default `kube-system/tensile-exclusions`) holds one entry per workload,
//! keyed by the UID of the pods' controller (a ReplicaSet, StatefulSet, Job…) or, for a bare
//! pod, by the UID of the first pod of its line of replacements. The value is JSON:
//!
//! ```json
//! {"namespace":"web","kind":"ReplicaSet","name":"web-7d4b9","moves":1,
//!  "nodes":{"vn-a":"2024-05-01T10:10:00Z"},"expires":"2024-05-01T10:10:00Z"}
//! ```
//!
//! `nodes` maps each excluded virtual node to the instant its exclusion ends; `moves` counts
//! how many times a node was added, which bounds the moves of one workload; `exhausted` says
//! when the descheduler gave up on it. An entry is dropped from the map once `expires` has
//! passed. Only the descheduler's leader writes it; everyone else only reads it.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::watcher;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::cache::{self, Cache};

/// Namespace and name of the exclusions ConfigMap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub namespace: String,
    pub name: String,
}

/// Where the exclusions live unless a flag says otherwise.
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

/// Every record, as the ConfigMap held them at `resource_version`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exclusions {
    /// `None`: the ConfigMap does not exist.
    pub resource_version: Option<String>,
    pub records: BTreeMap<String, Record>,
    /// Entries that did not decode (left alone, never applied).
    pub unreadable: usize,
}

impl Exclusions {
    /// Reads the ConfigMap's entries; an entry that does not decode is counted and skipped.
    pub fn from_config_map(cm: &ConfigMap) -> Self {
        let mut out = Exclusions {
            resource_version: cm.metadata.resource_version.clone(),
            ..Default::default()
        };
        for (key, value) in cm.data.iter().flatten() {
            match serde_json::from_str::<Record>(value) {
                Ok(record) => {
                    out.records.insert(key.clone(), record);
                }
                Err(_) => out.unreadable += 1,
            }
        }
        out
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

    /// The ConfigMap data for these records, without those expired at `now`.
    pub fn to_data(&self, now: Timestamp) -> Result<BTreeMap<String, String>, serde_json::Error> {
        self.records
            .iter()
            .filter(|(_, r)| !r.is_expired(now))
            .map(|(k, r)| Ok((k.clone(), serde_json::to_string(r)?)))
            .collect()
    }
}

/// Watches the exclusions ConfigMap. Returns its cache, a channel holding the decoded
/// records after every change (empty while the ConfigMap does not exist), and the future
/// that keeps both current.
pub fn follow(
    api: Api<ConfigMap>,
    name: &str,
) -> (
    Cache<ConfigMap>,
    watch::Receiver<Arc<Exclusions>>,
    impl Future<Output = ()> + Send + 'static,
) {
    let (cache, stream) = cache::reflect(
        api,
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    );
    let (tx, rx) = watch::channel(Arc::new(Exclusions::default()));
    let store = cache.clone();
    let name = name.to_owned();
    let feed = stream.for_each(move |_| {
        let current = store
            .state()
            .into_iter()
            .find(|cm| cm.metadata.name.as_deref() == Some(name.as_str()))
            .map(|cm| Exclusions::from_config_map(&cm))
            .unwrap_or_default();
        tx.send_if_modified(|old| {
            if **old == current {
                return false;
            }
            *old = Arc::new(current);
            true
        });
        futures::future::ready(())
    });
    (cache, rx, feed)
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

    #[test]
    fn a_record_reads_back_as_written_and_only_unexpired_nodes_are_excluded() {
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
        let data = ex.to_data(now).unwrap();
        let again = Exclusions::from_config_map(&config_map(&[("uid-1", &data["uid-1"])]));
        assert_eq!(again.records["uid-1"], ex.records["uid-1"]);
        assert!(
            ex.to_data(at("2024-05-01T11:00:00Z")).unwrap().is_empty(),
            "expired entries are not written back"
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
