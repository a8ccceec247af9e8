//! The reader's view of the records, kept current one watch event at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;

use super::{ExclusionRecord, Exclusions, Legacy, Record, decode};

/// Record objects and the old ConfigMap merged into one [`Exclusions`]: an object wins over
/// an old entry of the same key. Each event costs the records it changes.
#[derive(Default)]
pub struct Index {
    view: Exclusions,
    /// Object name → key, for the objects that decoded (a delete event's object may differ
    /// from the one the index holds).
    keys: BTreeMap<String, String>,
    /// Names of the objects that did not decode.
    unreadable: BTreeSet<String>,
    /// Keys whose record in the view comes from the old ConfigMap.
    from_legacy: BTreeSet<String>,
    /// Objects of a list in progress (a watch's first list or a re-list).
    staged: Option<Vec<ExclusionRecord>>,
}

impl Index {
    /// Every record as the events so far show them.
    pub fn exclusions(&self) -> &Exclusions {
        &self.view
    }

    /// A list of every object starts (the watch restarted); the objects come by [`Index::stage`].
    pub fn restart(&mut self) {
        self.staged = Some(Vec::new());
    }

    pub fn stage(&mut self, object: &ExclusionRecord) {
        self.staged.get_or_insert_with(Vec::new).push(object.clone());
    }

    /// The list is complete: it replaces every object the index held.
    pub fn listed(&mut self) {
        let staged = self.staged.take().unwrap_or_default();
        let names: Vec<String> = self.keys.keys().chain(&self.unreadable).cloned().collect();
        for name in names {
            self.forget(&name);
        }
        for object in &staged {
            self.apply(object);
        }
    }

    /// An object was created or changed.
    pub fn apply(&mut self, object: &ExclusionRecord) {
        let name = object.metadata.name.clone().unwrap_or_default();
        let version = object.metadata.resource_version.clone().unwrap_or_default();
        match decode(object) {
            Ok((key, record)) => {
                if let Some(old) = self.keys.get(&name)
                    && *old != key
                {
                    let old = old.clone();
                    self.forget(&name);
                    self.keys.remove(&old);
                }
                self.unreadable.remove(&name);
                self.keys.insert(name, key.clone());
                self.from_legacy.remove(&key);
                self.view.records.insert(key.clone(), record);
                self.view.versions.insert(key, version);
            }
            Err(_) => {
                self.forget(&name);
                self.unreadable.insert(name);
            }
        }
        self.count_unreadable();
    }

    /// An object was deleted.
    pub fn delete(&mut self, object: &ExclusionRecord) {
        if let Some(name) = object.metadata.name.as_deref() {
            self.forget(name);
        }
        self.count_unreadable();
    }

    /// The old ConfigMap as it is now (`None`: it does not exist).
    pub fn legacy(&mut self, cm: Option<&ConfigMap>) {
        for key in std::mem::take(&mut self.from_legacy) {
            self.view.records.remove(&key);
        }
        self.view.legacy = cm.map(Legacy::from_config_map);
        let records = self
            .view
            .legacy
            .as_ref()
            .map(|l| l.records.clone())
            .unwrap_or_else(|| Arc::new(BTreeMap::new()));
        for (key, record) in records.iter() {
            self.shadowed_or_shown(key, record);
        }
        self.count_unreadable();
    }

    /// Drops the object `name` from the view; an old entry of its key shows again.
    fn forget(&mut self, name: &str) {
        self.unreadable.remove(name);
        let Some(key) = self.keys.remove(name) else {
            return;
        };
        self.view.records.remove(&key);
        self.view.versions.remove(&key);
        let old = self
            .view
            .legacy
            .as_ref()
            .and_then(|l| l.records.get(&key).cloned());
        if let Some(record) = old {
            self.shadowed_or_shown(&key, &record);
        }
    }

    fn shadowed_or_shown(&mut self, key: &str, record: &Record) {
        if !self.view.versions.contains_key(key) {
            self.view.records.insert(key.to_owned(), record.clone());
            self.from_legacy.insert(key.to_owned());
        }
    }

    fn count_unreadable(&mut self) {
        self.view.unreadable = self.unreadable.len() + self.view.legacy.as_ref().map_or(0, |l| l.unreadable);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{encode, object_name};
    use super::*;
    use jiff::Timestamp;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn record(node: &str, moves: u32) -> Record {
        Record {
            namespace: "web".into(),
            kind: "ReplicaSet".into(),
            name: "web-1".into(),
            nodes: [(node.to_owned(), at("2024-05-01T10:10:00Z"))].into(),
            moves,
            expires: at("2024-05-01T10:10:00Z"),
            exhausted: None,
        }
    }

    fn object(key: &str, r: &Record, rv: &str) -> ExclusionRecord {
        encode("ns", key, r, Some(rv.into()), "test").unwrap()
    }

    fn garbage(name: &str) -> ExclusionRecord {
        ExclusionRecord {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: serde_json::json!({"key": name, "nodes": "vn-a"}),
            ..Default::default()
        }
    }

    fn old_configmap(entries: &[(&str, String)]) -> ConfigMap {
        ConfigMap {
            data: Some(entries.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn an_undecodable_record_is_counted_and_survives_other_records_writes_and_deletes() {
        let mut index = Index::default();
        index.restart();
        index.stage(&garbage("bad"));
        index.stage(&object("uid-1", &record("vn-a", 1), "2"));
        index.listed();
        assert_eq!(index.exclusions().unreadable, 1);
        assert_eq!(index.exclusions().records.len(), 1);
        // Another record's create, change and delete leave it counted (and its object, which
        // only its own key's write would ever replace, untouched).
        index.apply(&object("uid-2", &record("vn-b", 1), "3"));
        index.apply(&object("uid-1", &record("vn-b", 2), "4"));
        index.delete(&object("uid-2", &record("vn-b", 1), "5"));
        assert_eq!(index.exclusions().unreadable, 1);
        assert!(index.exclusions().records.get("bad").is_none(), "never applied");
        assert_eq!(index.exclusions().records["uid-1"].moves, 2);
        assert_eq!(
            index.exclusions().versions.get("uid-1").map(String::as_str),
            Some("4")
        );
        // Once its own key writes a record it decodes; once deleted it is no longer counted.
        index.apply(&object("bad", &record("vn-a", 1), "6"));
        assert_eq!(index.exclusions().unreadable, 0);
        index.apply(&garbage("bad"));
        assert_eq!(index.exclusions().unreadable, 1);
        assert!(index.exclusions().records.get("bad").is_none());
        index.delete(&garbage("bad"));
        assert_eq!(index.exclusions().unreadable, 0);
    }

    #[test]
    fn old_configmap_records_count_until_an_object_of_the_same_key_replaces_them() {
        let mut index = Index::default();
        let old = serde_json::to_string(&record("vn-old", 1)).unwrap();
        let cm = old_configmap(&[("uid-1", old.clone()), ("uid-2", old), ("uid-3", "{".into())]);
        index.legacy(Some(&cm));
        index.restart();
        index.listed();
        let view = index.exclusions();
        assert_eq!(view.records.len(), 2);
        assert_eq!(view.unreadable, 1);
        assert!(view.versions.is_empty());

        index.apply(&object("uid-1", &record("vn-new", 2), "9"));
        let now = at("2024-05-01T10:05:00Z");
        assert_eq!(
            index.exclusions().excluded_nodes("uid-1", now),
            ["vn-new"],
            "the object wins"
        );
        assert_eq!(index.exclusions().excluded_nodes("uid-2", now), ["vn-old"]);
        // The ConfigMap changes (or is re-listed): the object still wins.
        index.legacy(Some(&cm));
        assert_eq!(index.exclusions().excluded_nodes("uid-1", now), ["vn-new"]);
        // The object goes: the old entry shows again.
        index.delete(&object("uid-1", &record("vn-new", 2), "10"));
        assert_eq!(index.exclusions().excluded_nodes("uid-1", now), ["vn-old"]);
        // The ConfigMap goes: so do its records.
        index.legacy(None);
        assert!(index.exclusions().records.is_empty());
        assert_eq!(index.exclusions().unreadable, 0);
        assert!(index.exclusions().legacy.is_none());
    }

    #[test]
    fn a_relist_replaces_what_the_index_held() {
        let mut index = Index::default();
        index.restart();
        index.stage(&object("uid-1", &record("vn-a", 1), "1"));
        index.stage(&garbage("bad"));
        index.listed();
        // The watch broke; meanwhile uid-1 and bad were deleted and uid-2 created.
        index.restart();
        index.stage(&object("uid-2", &record("vn-a", 1), "5"));
        assert_eq!(
            index.exclusions().records.len(),
            1,
            "the old view serves until the list is in"
        );
        index.listed();
        let view = index.exclusions();
        assert_eq!(view.records.keys().collect::<Vec<_>>(), ["uid-2"]);
        assert_eq!(view.unreadable, 0);
    }

    #[test]
    fn a_hundred_thousand_records_index_and_change_one_at_a_time() {
        let mut index = Index::default();
        index.restart();
        for i in 0..100_000 {
            let key = format!("uid-{i}");
            index.stage(&object(&key, &record("vn-a", 1), "1"));
        }
        index.listed();
        assert_eq!(index.exclusions().records.len(), 100_000);
        let published = index.exclusions().clone();
        let started = std::time::Instant::now();
        for i in 0..1000 {
            index.apply(&object(&format!("uid-{i}"), &record("vn-b", 2), "2"));
            // What `follow` does after every event: publish a clone.
            let _ = std::hint::black_box(index.exclusions().clone());
        }
        let per_change = started.elapsed() / 1000;
        assert_eq!(
            published.records["uid-1"].moves, 1,
            "a published view never changes"
        );
        assert_eq!(index.exclusions().records["uid-1"].moves, 2);
        assert!(
            per_change < std::time::Duration::from_millis(5),
            "one change costs a reader {per_change:?}"
        );
        assert_eq!(object_name("uid-1"), "uid-1");
    }
}
