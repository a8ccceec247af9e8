//! Copies: the ConfigMaps and Secrets that pods of this node reference, reflected into the
//! lower cluster under the same namespace and name.
//!
//! The model: a copy exists below exactly while its upper object exists and some pod of this
//! upper cluster needs it there (an upper pod bound to this node, or a lower pod of this upper
//! cluster that still runs), and its content is the upper object's. Copies carry the upper
//! cluster's mark only, not a node's: virtual nodes of one upper cluster over one lower
//! cluster share them, write the same content from the same upper object, and each keeps a
//! copy while any lower pod of the cluster references it. A lower object of the same name
//! without our mark is never touched; the pod that needs it is not started below.
//!
//! ConfigMaps and Secrets are watched upstream by metadata only: the process holds no upper
//! content it does not copy. The content is read (one GET) when a copy is written; a copy is
//! judged current from its annotations ([`is_current`]): the upper version it was made from,
//! and a digest of what was written, which an edit below no longer matches.
//!
//! The plan of a pass is pure: [`needs`] (what pods need below), [`judge`] (a lower object
//! against the copy wanted there) and [`plan`] (the writes: create, update, delete by UID
//! with a reason). The copy resync performs it. Values are never logged.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use tensile_common::names;

use crate::model::reflected::Reflected;
use crate::model::reflected::empty_as_none;
use crate::model::refs::Kind;
use crate::model::trim::{PodLoad, UpperPod};
use crate::world::fetched::Upper;

/// Upper annotations that describe the upper object itself and are not copied.
const UPPER_ONLY_ANNOTATIONS: [&str; 1] = ["kubectl.kubernetes.io/last-applied-configuration"];

/// How a lower object of a copy's name stands against the copy wanted there.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Ours, with current content.
    Current,
    /// Ours, with other content: replaced.
    Stale,
    /// Not made by this upper cluster: never touched.
    Conflict,
}

/// Whether `meta` carries the mark of upper cluster `cluster_id`.
fn owns(cluster_id: &str, meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(names::MARK_CLUSTER))
        .is_some_and(|c| c == cluster_id)
}

/// The lower copy of `upper`: its payload, its labels and annotations, the mark of upper
/// cluster `cluster_id`.
pub fn desired<K: Reflected>(cluster_id: &str, upper: &K) -> K {
    let mut copy = K::payload(upper);
    let meta = copy.meta_mut();
    meta.name = upper.meta().name.clone();
    meta.namespace = upper.meta().namespace.clone();
    let mut labels: BTreeMap<String, String> = upper
        .meta()
        .labels
        .iter()
        .flatten()
        .filter(|(k, _)| {
            ![names::MARK_CLUSTER, names::MARK_NODE, names::MARK_UPPER_UID].contains(&k.as_str())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(names::MARK_CLUSTER.to_owned(), cluster_id.to_owned());
    meta.labels = Some(labels);
    let mut annotations: BTreeMap<String, String> = upper
        .meta()
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| !UPPER_ONLY_ANNOTATIONS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.extend(meta.annotations.take().unwrap_or_default());
    if K::FETCHED {
        annotations.remove(names::COPY_DIGEST);
        match &upper.meta().resource_version {
            Some(version) => annotations.insert(names::COPY_UPPER_VERSION.to_owned(), version.clone()),
            None => annotations.remove(names::COPY_UPPER_VERSION),
        };
    }
    meta.annotations = (!annotations.is_empty()).then_some(annotations);
    if K::FETCHED {
        let digest = digest(&copy);
        copy.meta_mut()
            .annotations
            .get_or_insert_default()
            .insert(names::COPY_DIGEST.to_owned(), digest);
    }
    copy
}

/// A digest of what a copy holds: its content, labels and annotations (its own digest
/// aside), with empty and null members dropped as the apiserver drops them, so a copy read
/// back digests as it was written.
pub fn digest<K: Reflected>(copy: &K) -> String {
    fn prune(v: &mut serde_json::Value) -> bool {
        match v {
            serde_json::Value::Null => false,
            serde_json::Value::Object(map) => {
                map.retain(|_, v| prune(v));
                !map.is_empty()
            }
            serde_json::Value::Array(items) => !items.is_empty(),
            _ => true,
        }
    }
    let meta = copy.meta();
    let annotations: BTreeMap<&String, &String> = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != names::COPY_DIGEST)
        .collect();
    let mut written = serde_json::json!({
        "payload": K::payload(copy),
        "labels": meta.labels,
        "annotations": annotations,
    });
    prune(&mut written);
    let bytes = serde_json::to_vec(&written).unwrap_or_default();
    let sum = ring::digest::digest(&ring::digest::SHA256, &bytes);
    sum.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The copies of one kind found to digest as written, by UID and the version the lower
/// cluster gave them: a copy nobody changed since is not digested again. Each pass keeps
/// what it found, so a copy that is gone or changed is forgotten by the next.
#[derive(Debug, Default)]
pub struct Digested {
    /// Found by the previous pass.
    before: HashSet<(String, String)>,
    /// Found by this pass.
    now: HashSet<(String, String)>,
}

impl Digested {
    /// A new pass begins: what the previous one found is what is known.
    fn begin(&mut self) {
        self.before = std::mem::take(&mut self.now);
    }

    /// Whether `copy` digests as written: known for its version, or digested now.
    fn as_written<K: Reflected>(&mut self, copy: &K, written: Option<&String>) -> bool {
        let version = copy.meta().uid.clone().zip(copy.meta().resource_version.clone());
        if let Some(version) = version.as_ref().filter(|v| self.before.contains(*v)) {
            self.now.insert(version.clone());
            return true;
        }
        let as_written = written == Some(&digest(copy));
        if let Some(version) = version.filter(|_| as_written) {
            self.now.insert(version);
        }
        as_written
    }
}

/// Whether `copy` (ours) holds what `upper` holds now. Of a fetched kind only the upper
/// metadata is at hand: the copy is current when it was made from this version of the upper
/// object and still digests as written (known from `digested` while its version is the same).
pub fn is_current<K: Reflected>(cluster_id: &str, upper: &K, copy: &K, digested: &mut Digested) -> bool {
    if K::FETCHED {
        let annotation = |key: &str| copy.meta().annotations.as_ref().and_then(|a| a.get(key));
        upper.meta().resource_version.is_some()
            && annotation(names::COPY_UPPER_VERSION) == upper.meta().resource_version.as_ref()
            && digested.as_written(copy, annotation(names::COPY_DIGEST))
    } else {
        judge(cluster_id, &desired(cluster_id, upper), copy) == Verdict::Current
    }
}

/// How `actual` (the lower object of the copy's name) stands against `desired`.
pub fn judge<K: Reflected>(cluster_id: &str, desired: &K, actual: &K) -> Verdict {
    if !owns(cluster_id, actual.meta()) {
        return Verdict::Conflict;
    }
    let (d, a) = (desired.meta(), actual.meta());
    let current = desired.same_payload(actual)
        && empty_as_none(&d.labels) == empty_as_none(&a.labels)
        && empty_as_none(&d.annotations) == empty_as_none(&a.annotations);
    if current { Verdict::Current } else { Verdict::Stale }
}

/// What the pods of this upper cluster need below: `(needed, used_below)`. A copy is needed
/// while an upper pod of this node or a lower pod of the cluster references it, a Service
/// (and its Endpoints) while such pods run in its namespace; `used_below` is the part running
/// lower pods account for. `services`: the upper Services and whether kube-system's and
/// `default/kubernetes` count, when Services are reflected.
/// `usable` says whether the pod path judged a lower namespace usable (ours, or shared):
/// Services follow upper pods only into those, never into a namespace the pod path refused.
pub fn needs(
    cluster_id: &str,
    upper_pods: &[Arc<UpperPod>],
    lower_pods: &[Arc<PodLoad>],
    services: Option<(&[Arc<Service>], bool)>,
    usable: impl Fn(&str) -> bool,
) -> (BTreeSet<Key>, BTreeSet<Key>) {
    let mut needed: BTreeSet<Key> = BTreeSet::new();
    let mut namespaces: BTreeSet<String> = BTreeSet::new();
    for pod in upper_pods.iter().filter(|p| !p.terminal) {
        let ns = pod.namespace().unwrap_or_default();
        needed.extend(
            pod.references
                .iter()
                .map(|(kind, name)| (*kind, ns.clone(), name.clone())),
        );
        if usable(&ns) {
            namespaces.insert(ns);
        }
    }
    let mut used_below: BTreeSet<Key> = BTreeSet::new();
    for pod in lower_pods.iter().filter(|p| owns(cluster_id, &p.metadata)) {
        let ns = pod.namespace().unwrap_or_default();
        used_below.extend(
            pod.references
                .iter()
                .map(|(kind, name)| (*kind, ns.clone(), name.clone())),
        );
        namespaces.insert(ns);
    }
    for svc in services.map(|(s, _)| s).unwrap_or_default() {
        let include_system = services.is_some_and(|(_, system)| system);
        let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
        let system = ns == "kube-system" || (ns == "default" && name == "kubernetes");
        if namespaces.contains(&ns) && (include_system || !system) {
            needed.insert((Kind::Service, ns.clone(), name.clone()));
            needed.insert((Kind::Endpoints, ns, name));
        }
    }
    needed.extend(used_below.iter().cloned());
    (needed, used_below)
}

/// What one resync pass plans from.
pub struct Model<'a> {
    pub cluster_id: &'a str,
    pub needed: &'a BTreeSet<Key>,
    pub used_below: &'a BTreeSet<Key>,
    pub now: Instant,
    /// Copies a foreign lower object blocked recently: not retried yet.
    pub conflicts: &'a HashMap<Key, Instant>,
    /// How long a copy stays after its last reference went.
    pub gc_delay: Duration,
}

/// One write of a resync pass over copies of kind `K`.
#[derive(Debug, PartialEq)]
pub enum Write<K> {
    /// A copy is missing below: made from `upper`.
    Create { upper: Arc<K> },
    /// A copy's content differs from `upper`'s (edited above or below): made current.
    Update { upper: Arc<K>, copy: Arc<K> },
    /// A copy nobody should have: deleted by UID.
    Delete {
        namespace: String,
        name: String,
        uid: Option<String>,
        why: &'static str,
    },
}

/// The writes that bring the copies of kind `K` to the model. `upper` looks up an upper
/// object by namespace and name; `lower` is every lower object of the kind the watch shows.
/// `create_needed`: every needed copy is created (Services); otherwise only copies that
/// running lower pods use are repaired (the pod path creates the others and reports
/// conflicts). `since` remembers when each copy was last seen unneeded.
pub fn plan<K: Reflected>(
    model: &Model<'_>,
    upper: impl Fn(&str, &str) -> Upper<K>,
    lower: &[Arc<K>],
    create_needed: bool,
    since: &mut HashMap<Key, Instant>,
    digested: &mut Digested,
) -> Vec<Write<K>> {
    let mut writes = Vec::new();
    digested.begin();
    for copy in lower {
        if !owns(model.cluster_id, copy.meta()) || copy.meta().deletion_timestamp.is_some() {
            continue;
        }
        let (ns, name) = (copy.namespace().unwrap_or_default(), copy.name_any());
        let key = (K::KIND, ns.clone(), name.clone());
        match upper(&ns, &name) {
            Upper::Gone => {
                writes.push(Write::Delete {
                    namespace: ns,
                    name,
                    uid: copy.uid(),
                    why: "its upper object is gone",
                });
                since.remove(&key);
                continue;
            }
            Upper::Present(source) if model.needed.contains(&key) => {
                since.remove(&key);
                if !is_current(model.cluster_id, &*source, copy, digested) {
                    writes.push(Write::Update {
                        upper: source,
                        copy: copy.clone(),
                    });
                }
                continue;
            }
            // Needed by pods this node does not follow the objects of (another virtual node
            // of the lower cluster): theirs to keep current.
            Upper::Unknown if model.needed.contains(&key) => {
                since.remove(&key);
                continue;
            }
            Upper::Present(_) | Upper::Unknown => {}
        }
        let first = *since.entry(key.clone()).or_insert(model.now);
        if model.now.duration_since(first) >= model.gc_delay {
            writes.push(Write::Delete {
                namespace: ns,
                name,
                uid: copy.uid(),
                why: "no pod needs it",
            });
            since.remove(&key);
        }
    }
    let present: BTreeSet<(&str, &str)> = lower
        .iter()
        .filter_map(|c| Some((c.meta().namespace.as_deref()?, c.meta().name.as_deref()?)))
        .collect();
    let missing = if create_needed {
        model.needed
    } else {
        model.used_below
    };
    for key @ (kind, ns, name) in missing {
        if *kind != K::KIND || model.conflicts.contains_key(key) || present.contains(&(ns, name)) {
            continue;
        }
        if let Upper::Present(source) = upper(ns, name) {
            writes.push(Write::Create { upper: source });
        }
    }
    since.retain(|(kind, ns, name), _| *kind != K::KIND || present.contains(&(ns.as_str(), name.as_str())));
    writes
}

/// A copy: its kind, namespace and name.
pub type Key = (Kind, String, String);

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::core::v1::Secret;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "n"}, "spec": spec})).unwrap()
    }

    #[test]
    fn payload_comparison_ignores_empty_versus_absent() {
        let a: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {}})).unwrap();
        let b: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
        assert!(a.same_payload(&b));
        let c: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {"k": "v"}})).unwrap();
        assert!(!a.same_payload(&c));
        let s1: Secret =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "type": "Opaque"})).unwrap();
        let s2: Secret = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
        assert!(s1.same_payload(&s2));
        let s3: Secret =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "type": "kubernetes.io/tls"})).unwrap();
        assert!(!s1.same_payload(&s3));
    }

    fn config_map(v: serde_json::Value) -> Arc<ConfigMap> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    /// Upper ConfigMap `shop/cfg` with `data`.
    fn upper_cfg(data: serde_json::Value) -> Arc<ConfigMap> {
        config_map(
            json!({"metadata": {"name": "cfg", "namespace": "shop", "uid": "up", "resourceVersion": "7",
            "labels": {"app": "web"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "note": "n"}},
            "data": data}),
        )
    }

    /// The copy of `upper` as upper cluster `c1` makes it, with uid `low`.
    fn copy_of(upper: &ConfigMap) -> Arc<ConfigMap> {
        let mut c = desired("c1", upper);
        c.metadata.uid = Some("low".into());
        Arc::new(c)
    }

    fn key(name: &str) -> Key {
        (Kind::ConfigMap, "shop".into(), name.into())
    }

    /// One pass over ConfigMaps with `upper` above and `lower` below.
    struct Pass {
        needed: BTreeSet<Key>,
        used_below: BTreeSet<Key>,
        conflicts: HashMap<Key, Instant>,
        now: Instant,
        since: HashMap<Key, Instant>,
        digested: Digested,
        /// Upper names this node does not follow.
        unknown: BTreeSet<String>,
    }

    impl Pass {
        fn new(needed: &[&str], used_below: &[&str]) -> Pass {
            Pass {
                needed: needed.iter().map(|n| key(n)).collect(),
                used_below: used_below.iter().map(|n| key(n)).collect(),
                conflicts: HashMap::new(),
                now: Instant::now(),
                since: HashMap::new(),
                digested: Digested::default(),
                unknown: BTreeSet::new(),
            }
        }

        fn plan(&mut self, upper: &[Arc<ConfigMap>], lower: &[Arc<ConfigMap>]) -> Vec<Write<ConfigMap>> {
            let model = Model {
                cluster_id: "c1",
                needed: &self.needed,
                used_below: &self.used_below,
                now: self.now,
                conflicts: &self.conflicts,
                gc_delay: Duration::from_secs(30),
            };
            let lookup = |ns: &str, name: &str| match upper.iter().find(|u| {
                u.metadata.namespace.as_deref() == Some(ns) && u.metadata.name.as_deref() == Some(name)
            }) {
                Some(u) => Upper::Present(u.clone()),
                None if self.unknown.contains(name) => Upper::Unknown,
                None => Upper::Gone,
            };
            plan(&model, lookup, lower, false, &mut self.since, &mut self.digested)
        }
    }

    #[test]
    fn a_copy_carries_the_upper_content_labels_and_annotations_and_this_clusters_mark() {
        let copy = desired("c1", &*upper_cfg(json!({"k": "v"})));
        let labels = copy.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get(names::MARK_CLUSTER).map(String::as_str), Some("c1"));
        assert_eq!(labels.get("app").map(String::as_str), Some("web"));
        assert!(
            !labels.contains_key(names::MARK_NODE),
            "copies are shared by the cluster's nodes"
        );
        let annotations = copy.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations.get("note").map(String::as_str), Some("n"));
        assert!(!annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"));
        assert_eq!(copy.data.clone().unwrap_or_default()["k"], "v");
        assert!(copy.metadata.uid.is_none() && copy.metadata.resource_version.is_none());
        assert_eq!(
            annotations.get(names::COPY_UPPER_VERSION).map(String::as_str),
            Some("7")
        );
        assert_eq!(annotations.get(names::COPY_DIGEST), Some(&digest(&copy)));
    }

    /// What the upper cache holds of a ConfigMap: its metadata only.
    fn header(upper: &ConfigMap) -> Arc<ConfigMap> {
        Arc::new(ConfigMap {
            metadata: upper.metadata.clone(),
            ..ConfigMap::default()
        })
    }

    #[test]
    fn a_copy_is_judged_from_the_upper_metadata_alone() {
        let upper = upper_cfg(json!({"k": "v"}));
        let mut pass = Pass::new(&["cfg"], &[]);
        assert_eq!(pass.plan(&[header(&upper)], &[copy_of(&upper)]), []);
        // A newer upper version: rewritten (its content is read then).
        let mut newer = (*header(&upper)).clone();
        newer.metadata.resource_version = Some("8".into());
        let newer = Arc::new(newer);
        assert_eq!(
            pass.plan(std::slice::from_ref(&newer), &[copy_of(&upper)]),
            [Write::Update {
                upper: newer,
                copy: copy_of(&upper)
            }]
        );
        // A copy written before copies carried their upper version: rewritten once.
        let mut older = (*copy_of(&upper)).clone();
        older.metadata.annotations = Some(BTreeMap::from([("note".to_owned(), "n".to_owned())]));
        let older = Arc::new(older);
        assert_eq!(
            pass.plan(&[header(&upper)], std::slice::from_ref(&older)).len(),
            1
        );
    }

    /// `copy` with its `app` label edited, as a lower admin would.
    fn relabelled(copy: &ConfigMap) -> ConfigMap {
        let mut edited = copy.clone();
        edited
            .metadata
            .labels
            .get_or_insert_default()
            .insert("app".into(), "other".into());
        edited
    }

    #[test]
    fn a_copy_read_back_from_the_apiserver_digests_as_written() {
        // Written with an empty `binaryData` and read back with server fields and without
        // the empty member, as the apiserver returns it.
        let mut upper = (*upper_cfg(json!({"k": "v"}))).clone();
        upper.binary_data = Some(BTreeMap::new());
        let written = desired("c1", &upper);
        let mut read: serde_json::Value = serde_json::to_value(&written).unwrap();
        read.as_object_mut().unwrap().remove("binaryData");
        read["metadata"]["uid"] = json!("low");
        read["metadata"]["resourceVersion"] = json!("99");
        read["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        read["metadata"]["managedFields"] =
            json!([{"manager": "tensile-virtual-node", "operation": "Update"}]);
        let read: ConfigMap = serde_json::from_value(read).unwrap();
        assert!(is_current(
            "c1",
            &*header(&upper),
            &read,
            &mut Digested::default()
        ));
        // A label edited below no longer digests as written.
        let relabelled = relabelled(&read);
        assert!(!is_current(
            "c1",
            &*header(&upper),
            &relabelled,
            &mut Digested::default()
        ));
    }

    #[test]
    fn a_copy_is_digested_again_only_once_the_lower_cluster_changed_its_version() {
        let upper = upper_cfg(json!({"k": "v"}));
        let mut read = (*copy_of(&upper)).clone();
        read.metadata.uid = Some("low".into());
        read.metadata.resource_version = Some("99".into());
        let mut digested = Digested::default();
        digested.begin();
        assert!(is_current("c1", &*header(&upper), &read, &mut digested));
        // The same version again: known, not digested (a change below always comes with a
        // new version, which this stands in for).
        let mut relabelled = relabelled(&read);
        digested.begin();
        assert!(is_current("c1", &*header(&upper), &relabelled, &mut digested));
        // Its new version: digested, and found edited.
        relabelled.metadata.resource_version = Some("100".into());
        digested.begin();
        assert!(!is_current("c1", &*header(&upper), &relabelled, &mut digested));
        // A pass that did not meet the copy forgets it.
        digested.begin();
        digested.begin();
        relabelled.metadata.resource_version = Some("99".into());
        assert!(!is_current("c1", &*header(&upper), &relabelled, &mut digested));
    }

    #[test]
    fn a_same_named_lower_object_without_our_mark_is_a_conflict_never_an_update() {
        let upper = upper_cfg(json!({"k": "v"}));
        let wanted = desired("c1", &*upper);
        let foreign =
            config_map(json!({"metadata": {"name": "cfg", "namespace": "shop"}, "data": {"k": "v"}}));
        assert_eq!(judge("c1", &wanted, &foreign), Verdict::Conflict);
        let other_cluster = desired("c2", &*upper);
        assert_eq!(judge("c1", &wanted, &other_cluster), Verdict::Conflict);
        assert_eq!(judge("c1", &wanted, &wanted), Verdict::Current);
    }

    #[test]
    fn a_copy_edited_below_or_above_is_made_current_again() {
        let upper = upper_cfg(json!({"k": "v"}));
        let mut edited = (*copy_of(&upper)).clone();
        edited.data = Some(BTreeMap::from([("k".to_owned(), "changed below".to_owned())]));
        let edited = Arc::new(edited);
        let mut pass = Pass::new(&["cfg"], &[]);
        assert_eq!(
            pass.plan(std::slice::from_ref(&upper), &[copy_of(&upper)]),
            [],
            "a current copy costs no write"
        );
        assert_eq!(
            pass.plan(std::slice::from_ref(&upper), std::slice::from_ref(&edited)),
            [Write::Update { upper, copy: edited }]
        );
    }

    #[test]
    fn a_copy_whose_upper_object_is_gone_is_deleted_by_uid() {
        let upper = upper_cfg(json!({}));
        let mut pass = Pass::new(&["cfg"], &["cfg"]);
        assert_eq!(
            pass.plan(&[], &[copy_of(&upper)]),
            [Write::Delete {
                namespace: "shop".into(),
                name: "cfg".into(),
                uid: Some("low".into()),
                why: "its upper object is gone",
            }]
        );
    }

    #[test]
    fn a_copy_whose_upper_object_this_node_does_not_follow_is_never_taken_for_gone() {
        // Another virtual node of the lower cluster made it for its own pod: this node may not
        // read the upper object (the Node authorizer), so it neither updates nor deletes it
        // while a lower pod uses it, and collects it only once nothing does.
        let upper = upper_cfg(json!({}));
        let mut stale = (*copy_of(&upper)).clone();
        stale.data = Some(BTreeMap::from([("k".to_owned(), "old".to_owned())]));
        let lower = vec![Arc::new(stale)];
        let mut pass = Pass::new(&["cfg"], &["cfg"]);
        pass.unknown.insert("cfg".into());
        assert_eq!(pass.plan(&[], &lower), [], "needed below: theirs to keep");
        pass.needed.clear();
        pass.used_below.clear();
        assert_eq!(
            pass.plan(&[], &lower),
            [],
            "no longer needed: the collection delay first"
        );
        pass.now += Duration::from_secs(30);
        assert!(matches!(
            pass.plan(&[], &lower).as_slice(),
            [Write::Delete {
                why: "no pod needs it",
                ..
            }]
        ));
    }

    #[test]
    fn an_unneeded_copy_stays_for_the_collection_delay_then_goes() {
        let upper = upper_cfg(json!({}));
        let mut pass = Pass::new(&[], &[]);
        let (upper, lower) = (vec![upper.clone()], vec![copy_of(&upper)]);
        assert_eq!(
            pass.plan(&upper, &lower),
            [],
            "a rolling update may need it again"
        );
        pass.now += Duration::from_secs(29);
        assert_eq!(pass.plan(&upper, &lower), []);
        pass.now += Duration::from_secs(1);
        assert!(matches!(
            pass.plan(&upper, &lower).as_slice(),
            [Write::Delete {
                why: "no pod needs it",
                ..
            }]
        ));
    }

    #[test]
    fn a_copy_needed_again_within_the_delay_is_kept_and_its_clock_restarts() {
        let upper = vec![upper_cfg(json!({}))];
        let lower = vec![copy_of(&upper[0])];
        let mut pass = Pass::new(&[], &[]);
        assert_eq!(pass.plan(&upper, &lower), []);
        pass.now += Duration::from_secs(20);
        pass.needed.insert(key("cfg"));
        assert_eq!(pass.plan(&upper, &lower), []);
        pass.needed.clear();
        pass.now += Duration::from_secs(20);
        assert_eq!(pass.plan(&upper, &lower), [], "unneeded for 20 s only");
    }

    #[test]
    fn a_copy_deleted_below_while_a_lower_pod_uses_it_is_recreated_unless_a_conflict_holds_it() {
        let upper = upper_cfg(json!({}));
        let mut pass = Pass::new(&["cfg"], &["cfg"]);
        assert_eq!(
            pass.plan(std::slice::from_ref(&upper), &[]),
            [Write::Create { upper: upper.clone() }]
        );
        pass.conflicts.insert(key("cfg"), pass.now);
        assert_eq!(
            pass.plan(&[upper], &[]),
            [],
            "a conflict is retried later, not every second"
        );
    }

    #[test]
    fn a_copy_only_an_upper_pod_needs_is_left_to_the_pod_path() {
        let upper = upper_cfg(json!({}));
        let mut pass = Pass::new(&["cfg"], &[]);
        assert_eq!(pass.plan(&[upper], &[]), []);
    }

    #[test]
    fn what_pods_need_follows_their_references_and_services_their_namespaces() {
        let upper_pod = Arc::new(UpperPod::of(pod(
            json!({"volumes": [{"name": "v", "configMap": {"name": "c1"}}]}),
        )));
        let mut finished = pod(json!({"volumes": [{"name": "v", "configMap": {"name": "old"}}]}));
        finished.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        let mut lower_pod = pod(json!({"volumes": [{"name": "v", "secret": {"secretName": "s1"}}]}));
        lower_pod.metadata.namespace = Some("other".into());
        lower_pod.metadata.labels = Some(BTreeMap::from([(
            names::MARK_CLUSTER.to_owned(),
            "c1".to_owned(),
        )]));
        let mut foreign_pod = lower_pod.clone();
        foreign_pod.metadata.labels = None;
        foreign_pod.metadata.namespace = Some("elsewhere".into());
        let services: Vec<Arc<Service>> = [
            ("n", "web"),
            ("empty", "db"),
            ("default", "kubernetes"),
            ("n", "x"),
        ]
        .iter()
        .map(|(ns, name)| {
            Arc::new(serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns}})).unwrap())
        })
        .collect();
        let (needed, used_below) = needs(
            "c1",
            &[upper_pod, Arc::new(UpperPod::of(finished))],
            &[
                Arc::new(PodLoad::of(&lower_pod)),
                Arc::new(PodLoad::of(&foreign_pod)),
            ],
            Some((&services, false)),
            |ns| ns != "refused",
        );
        let k = |kind, ns: &str, name: &str| (kind, ns.to_owned(), name.to_owned());
        assert_eq!(used_below, BTreeSet::from([k(Kind::Secret, "other", "s1")]));
        assert_eq!(
            needed,
            BTreeSet::from([
                k(Kind::ConfigMap, "n", "c1"),
                k(Kind::Secret, "other", "s1"),
                k(Kind::Service, "n", "web"),
                k(Kind::Endpoints, "n", "web"),
                k(Kind::Service, "n", "x"),
                k(Kind::Endpoints, "n", "x"),
            ]),
            "finished pods need nothing; Services only where pods are"
        );
        // An upper pod in a lower namespace the pod path refused brings no Service there.
        let mut refused = pod(json!({}));
        refused.metadata.namespace = Some("refused".into());
        let (needed, _) = needs(
            "c1",
            &[Arc::new(UpperPod::of(refused))],
            &[],
            Some((
                &[Arc::new(
                    serde_json::from_value(json!({"metadata": {"name": "db", "namespace": "refused"}}))
                        .unwrap(),
                )],
                false,
            )),
            |ns| ns != "refused",
        );
        assert!(needed.is_empty(), "{needed:?}");
    }
}
