//! Volumes: the PersistentVolumeClaims pods of this node use, made below, and the volumes
//! they get there reflected upstream so the upper scheduler keeps later pods of a claim on
//! this node.
//!
//! The model. This node handles an upper claim when a pod bound to it uses the claim or
//! when the upper scheduler picked this node for it (`volume.kubernetes.io/selected-node`,
//! set for claims of a `WaitForFirstConsumer` class). For each handled claim:
//! - the lower claim of the same namespace and name exists, with the upper claim's class,
//!   access modes, requests, selector and volume mode, and our marks (a same-named claim
//!   without them is a conflict, never touched);
//! - once the lower claim is bound (or waits for its first consumer below), the upper
//!   cluster gets a PersistentVolume `pvc-<upper claim uid>`, pre-bound to the upper claim,
//!   with the lower claim's capacity and access modes and a node affinity to this node.
//!   The upper cluster's own volume controller binds the claim to it; its status then shows
//!   what the lower cluster granted. The name is unique per upper claim, so it cannot
//!   collide across lower clusters.
//!
//! When the upper claim is gone, the lower claim is deleted once no lower pod uses it, and
//! the upper volume is deleted, unless the upper volume says
//! `persistentVolumeReclaimPolicy: Retain`. Then, as Kubernetes retains a volume, the upper
//! volume stays (Released) and the lower claim stays with its data; the lower claim records
//! the policy ([`names::LOWER_CLAIM_RECLAIM_POLICY`]) so it is kept even after an admin
//! deletes the upper volume. A lower claim belongs to one upper claim (its
//! [`names::MARK_UPPER_UID`]): a new upper claim of the same name never adopts it; its pods
//! wait, saying why, until the old lower claim is gone. Upstream, such claims use a StorageClass whose provisioner
//! is [`PROVISIONER`] and whose binding mode is `WaitForFirstConsumer`, named as the class
//! the lower cluster provides.
//!
//! [`plan`] decides every write of a pass from snapshots of the caches ([`View`]); a
//! StorageClass whose binding mode is unknown is a write that learns it, so the plan itself
//! never calls the API.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use tensile_common::names;

use crate::model::trim::{PodLoad, UpperPod};
use tensile_common::lower::identity::Identity;
use tensile_common::lower::overrides::Compiled;

/// The provisioner name of upper StorageClasses whose claims virtual nodes provision.
pub const PROVISIONER: &str = "virtual-node.tensile.io";

/// What one resync pass decides from: snapshots of the watch caches.
pub struct View<'a> {
    pub identity: &'a Identity,
    /// Upper pods bound to this node.
    pub upper_pods: &'a [Arc<UpperPod>],
    pub upper_claims: &'a [Arc<PersistentVolumeClaim>],
    /// Upper volumes carrying this node's marks.
    pub upper_volumes: &'a [Arc<PersistentVolume>],
    /// Lower claims carrying this node's marks.
    pub lower_claims: &'a [Arc<PersistentVolumeClaim>],
    /// Lower pods that have not finished.
    pub lower_pods: &'a [Arc<PodLoad>],
    /// Whether each lower StorageClass read so far binds on first consumer.
    pub classes: &'a HashMap<String, bool>,
    /// The upper StorageClasses: a reflected volume takes its class's `reclaimPolicy`.
    pub upper_classes: &'a [Arc<StorageClass>],
    /// The lower cluster's overrides in force (its StorageClass names).
    pub overrides: &'a Compiled,
}

/// The reclaim policy of volumes of upper class `class`: the class's `reclaimPolicy`, and
/// `Delete` (Kubernetes' default) for a class without one, no class, or a class not found.
pub fn reclaim_policy(upper_classes: &[Arc<StorageClass>], class: Option<&str>) -> String {
    class
        .and_then(|class| {
            upper_classes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(class))
        })
        .and_then(|c| c.reclaim_policy.clone())
        .unwrap_or_else(|| "Delete".to_owned())
}

/// One write of a resync pass.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The upper scheduler picked this node for a claim no pod here uses yet: the lower
    /// claim is made now, so the lower cluster provisions it.
    CreateLowerClaim { claim: Box<PersistentVolumeClaim> },
    /// The lower scheduler chose a node for the claim: the upper claim names this node.
    MarkSelected { namespace: String, name: String },
    /// The binding mode of a lower StorageClass is needed before the volume is reflected.
    LearnClass { class: String },
    /// The lower claim is ready: its volume is reflected upstream.
    CreateVolume { volume: Box<PersistentVolume> },
    /// The lower cluster granted another size: the upper volume shows it.
    ResizeVolume {
        name: String,
        capacity: BTreeMap<String, Quantity>,
    },
    /// The upper claim asks more storage than the lower claim: the lower claim is expanded.
    ExpandLowerClaim {
        namespace: String,
        name: String,
        storage: Quantity,
    },
    /// The lower claim records its upper volume's reclaim policy (`Retain` or not).
    SetReclaimPolicy {
        namespace: String,
        name: String,
        retain: bool,
    },
    DeleteLowerClaim {
        namespace: String,
        name: String,
        uid: Option<String>,
        why: &'static str,
    },
    DeleteUpperVolume {
        name: String,
        uid: Option<String>,
        why: &'static str,
    },
}

/// The name of the upper volume standing for `upper_claim`: unique per upper claim.
fn volume_name(upper_claim: &PersistentVolumeClaim) -> String {
    format!("pvc-{}", upper_claim.uid().unwrap_or_default())
}

/// Whether the upper volume keeps its storage when its claim goes.
fn retains(volume: &PersistentVolume) -> bool {
    volume
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
        == Some("Retain")
}

/// Whether a lower claim recorded a `Retain` policy.
pub fn retained(lower: &PersistentVolumeClaim) -> bool {
    lower
        .annotations()
        .get(names::LOWER_CLAIM_RECLAIM_POLICY)
        .map(String::as_str)
        == Some("Retain")
}

/// The upper claim UID a lower claim was made for.
pub fn made_for(lower: &PersistentVolumeClaim) -> Option<&str> {
    lower.labels().get(names::MARK_UPPER_UID).map(String::as_str)
}

fn selected_here(identity: &Identity, claim: &PersistentVolumeClaim) -> bool {
    claim.annotations().get(names::PVC_SELECTED_NODE) == Some(&identity.node)
}

pub fn at(meta: &kube::api::ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The lower claim for `upper`: its class named as the lower cluster's overrides map it. What
/// would pick an existing lower volume or copy lower data (a selector, a volume name, a data
/// source) stays upstream: those name the upper cluster's objects, and below they would name
/// someone else's. A lower claim is always provisioned afresh by its class.
pub fn lower_claim(
    identity: &Identity,
    upper: &PersistentVolumeClaim,
    overrides: &Compiled,
) -> PersistentVolumeClaim {
    let spec = upper.spec.clone().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = upper
        .labels()
        .iter()
        .filter(|(k, _)| {
            ![names::MARK_CLUSTER, names::MARK_NODE, names::MARK_UPPER_UID].contains(&k.as_str())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.extend(identity.marks());
    labels.insert(names::MARK_UPPER_UID.to_owned(), upper.uid().unwrap_or_default());
    PersistentVolumeClaim {
        metadata: kube::api::ObjectMeta {
            name: upper.metadata.name.clone(),
            namespace: upper.metadata.namespace.clone(),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::core::v1::PersistentVolumeClaimSpec {
            access_modes: spec.access_modes,
            resources: spec.resources,
            storage_class_name: overrides.storage_class(spec.storage_class_name),
            volume_mode: spec.volume_mode,
            ..Default::default()
        }),
        status: None,
    }
}

/// Whether the lower claim may get a volume reflected upstream now: bound below, or
/// waiting below for its first consumer (which is the pod this volume lets through).
/// `None` while the binding mode of its class is not known.
fn ready_below(lower: &PersistentVolumeClaim, classes: &HashMap<String, bool>) -> Option<bool> {
    if lower.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound") {
        return Some(true);
    }
    match lower.spec.as_ref().and_then(|s| s.storage_class_name.as_ref()) {
        None => Some(false),
        Some(class) => classes.get(class).copied(),
    }
}

/// The upper volume standing for the lower claim `lower` of `upper`, with reclaim policy
/// `reclaim` (its upper class's, [`reclaim_policy`]).
pub fn upper_volume(
    identity: &Identity,
    upper: &PersistentVolumeClaim,
    lower: &PersistentVolumeClaim,
    reclaim: String,
) -> PersistentVolume {
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference,
        PersistentVolumeSpec, VolumeNodeAffinity,
    };
    let spec = upper.spec.clone().unwrap_or_default();
    let status = lower.status.clone().unwrap_or_default();
    let bound = status.phase.as_deref() == Some("Bound");
    let capacity = if bound {
        status.capacity.clone()
    } else {
        spec.resources.as_ref().and_then(|r| r.requests.clone())
    };
    let access_modes = if bound { status.access_modes.clone() } else { None }.or(spec.access_modes.clone());
    let (ns, name) = at(&upper.metadata);
    PersistentVolume {
        metadata: kube::api::ObjectMeta {
            name: Some(volume_name(upper)),
            labels: Some(identity.marks()),
            annotations: Some(BTreeMap::from([(
                "pv.kubernetes.io/provisioned-by".to_owned(),
                PROVISIONER.to_owned(),
            )])),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity,
            access_modes,
            volume_mode: spec.volume_mode,
            storage_class_name: spec.storage_class_name,
            persistent_volume_reclaim_policy: Some(reclaim),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some(ns.clone()),
                name: Some(name.clone()),
                uid: upper.uid(),
                ..Default::default()
            }),
            csi: Some(CSIPersistentVolumeSource {
                driver: PROVISIONER.into(),
                volume_handle: format!(
                    "{}/{ns}/{name}/{}",
                    identity.node,
                    lower.uid().unwrap_or_default()
                ),
                ..Default::default()
            }),
            node_affinity: Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: "kubernetes.io/hostname".into(),
                            operator: "In".into(),
                            values: Some(vec![identity.node.clone()]),
                        }]),
                        match_fields: None,
                    }],
                }),
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// The writes of one resync pass: lower claims for the claims this node handles, their
/// volumes upstream, and the deletion of what no claim stands behind any more.
pub fn plan(view: &View<'_>) -> Vec<Write> {
    let id = view.identity;
    let mut writes = Vec::new();
    let upper_claims: HashMap<(String, String), &Arc<PersistentVolumeClaim>> =
        view.upper_claims.iter().map(|c| (at(&c.metadata), c)).collect();
    let lower_claims: HashMap<(String, String), &Arc<PersistentVolumeClaim>> = view
        .lower_claims
        .iter()
        .filter(|l| id.owns(&l.metadata))
        .map(|l| (at(&l.metadata), l))
        .collect();
    let volumes: HashMap<String, &Arc<PersistentVolume>> =
        view.upper_volumes.iter().map(|v| (v.name_any(), v)).collect();

    let mut handled = BTreeSet::new();
    for pod in view.upper_pods.iter().filter(|p| !p.terminal) {
        let ns = pod.namespace().unwrap_or_default();
        handled.extend(pod.claims.iter().map(|c| (ns.clone(), c.clone())));
    }
    handled.extend(
        view.upper_claims
            .iter()
            .filter(|c| selected_here(id, c))
            .map(|c| at(&c.metadata)),
    );
    for key in &handled {
        let Some(upper) = upper_claims.get(key) else {
            continue;
        };
        if upper.metadata.deletion_timestamp.is_some() {
            continue;
        }
        match lower_claims.get(key) {
            None if selected_here(id, upper) => writes.push(Write::CreateLowerClaim {
                claim: Box::new(lower_claim(id, upper, view.overrides)),
            }),
            None => {}
            // The lower claim of an earlier upper claim of the same name is never adopted.
            Some(lower) if made_for(lower) != upper.uid().as_deref() => {}
            Some(lower) => claim_writes(view, upper, lower, volumes.get(&volume_name(upper)), &mut writes),
        }
    }
    // Lower claims whose upper claim is gone (or is another claim of the same name).
    for lower in lower_claims.values() {
        if lower.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let key = at(&lower.metadata);
        if upper_claims.get(&key).and_then(|u| u.uid()).as_deref() == made_for(lower) || retained(lower) {
            continue;
        }
        // The upper volume may have been set to Retain just before its claim went.
        let volume = made_for(lower).and_then(|uid| volumes.get(&format!("pvc-{uid}")));
        if volume.is_some_and(|v| retains(v)) {
            writes.push(Write::SetReclaimPolicy {
                namespace: key.0,
                name: key.1,
                retain: true,
            });
            continue;
        }
        let in_use = view
            .lower_pods
            .iter()
            .any(|p| p.namespace().as_deref() == Some(key.0.as_str()) && p.claims.contains(&key.1));
        if !in_use {
            writes.push(Write::DeleteLowerClaim {
                namespace: key.0,
                name: key.1,
                uid: lower.uid(),
                why: "its upper claim is gone",
            });
        }
    }
    // Upper volumes whose claim is gone.
    for volume in view.upper_volumes {
        if !id.owns(&volume.metadata) || volume.metadata.deletion_timestamp.is_some() || retains(volume) {
            continue;
        }
        let claim = volume.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
        let exists = claim.is_some_and(|c| {
            let key = (
                c.namespace.clone().unwrap_or_default(),
                c.name.clone().unwrap_or_default(),
            );
            upper_claims.get(&key).and_then(|u| u.uid()) == c.uid
        });
        if !exists {
            writes.push(Write::DeleteUpperVolume {
                name: volume.name_any(),
                uid: volume.uid(),
                why: "its claim is gone",
            });
        }
    }
    writes
}

/// Brings one handled claim's upper side to its lower claim: the lower scheduler's node
/// choice named as this node, and the volume upstream.
fn claim_writes(
    view: &View<'_>,
    upper: &PersistentVolumeClaim,
    lower: &PersistentVolumeClaim,
    volume: Option<&&Arc<PersistentVolume>>,
    writes: &mut Vec<Write>,
) {
    // An expansion upstream (claims only grow) is passed down; the lower cluster's class
    // decides whether it may grow, and the lower claim's status says what it granted.
    let storage = |c: &PersistentVolumeClaim| {
        c.spec
            .as_ref()
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"))
            .cloned()
    };
    let milli = |q: &Option<Quantity>| {
        q.as_ref()
            .and_then(|q| tensile_common::quantity::parse_milli(&q.0).ok())
    };
    let (wanted, asked) = (storage(upper), storage(lower));
    if let (Some(more), Some(less)) = (milli(&wanted), milli(&asked))
        && more > less
        && let Some(storage) = wanted
    {
        let (namespace, name) = at(&lower.metadata);
        writes.push(Write::ExpandLowerClaim {
            namespace,
            name,
            storage,
        });
    }
    if lower.annotations().contains_key(names::PVC_SELECTED_NODE)
        && !upper.annotations().contains_key(names::PVC_SELECTED_NODE)
    {
        let (namespace, name) = at(&upper.metadata);
        writes.push(Write::MarkSelected { namespace, name });
    }
    match volume {
        None => match ready_below(lower, view.classes) {
            Some(true) => writes.push(Write::CreateVolume {
                volume: Box::new(upper_volume(
                    view.identity,
                    upper,
                    lower,
                    reclaim_policy(
                        view.upper_classes,
                        upper.spec.as_ref().and_then(|s| s.storage_class_name.as_deref()),
                    ),
                )),
            }),
            Some(false) => {}
            None => writes.extend(
                lower
                    .spec
                    .as_ref()
                    .and_then(|s| s.storage_class_name.clone())
                    .map(|class| Write::LearnClass { class }),
            ),
        },
        Some(volume) => {
            if retains(volume) != retained(lower) {
                let (namespace, name) = at(&lower.metadata);
                writes.push(Write::SetReclaimPolicy {
                    namespace,
                    name,
                    retain: retains(volume),
                });
            }
            let granted = lower
                .status
                .as_ref()
                .filter(|s| s.phase.as_deref() == Some("Bound"))
                .and_then(|s| s.capacity.clone());
            let shown = volume.spec.as_ref().and_then(|s| s.capacity.clone());
            if let Some(capacity) = granted
                && Some(&capacity) != shown.as_ref()
            {
                writes.push(Write::ResizeVolume {
                    name: volume.name_any(),
                    capacity,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::translate::tests::translation;
    use crate::model::refs::claims;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn claims_of(pod: serde_json::Value) -> Pod {
        serde_json::from_value(pod).unwrap()
    }

    #[test]
    fn claims_are_the_mounted_persistent_volume_claims() {
        let pod = claims_of(json!({"spec": {"containers": [], "volumes": [
            {"name": "a", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "b", "configMap": {"name": "cfg"}},
            {"name": "c", "persistentVolumeClaim": {"claimName": "logs", "readOnly": true}}]}}));
        assert_eq!(claims(&pod), ["data", "logs"]);
        assert!(claims(&Pod::default()).is_empty());
    }

    /// The caches one pass sees, built by each test.
    #[derive(Default)]
    struct World {
        upper_pods: Vec<Arc<UpperPod>>,
        upper_claims: Vec<Arc<PersistentVolumeClaim>>,
        upper_volumes: Vec<Arc<PersistentVolume>>,
        lower_claims: Vec<Arc<PersistentVolumeClaim>>,
        lower_pods: Vec<Arc<PodLoad>>,
        classes: HashMap<String, bool>,
        upper_classes: Vec<Arc<StorageClass>>,
    }

    impl World {
        fn plan(&self) -> Vec<Write> {
            let identity = translation().identity;
            plan(&View {
                identity: &identity,
                upper_pods: &self.upper_pods,
                upper_claims: &self.upper_claims,
                upper_volumes: &self.upper_volumes,
                lower_claims: &self.lower_claims,
                lower_pods: &self.lower_pods,
                classes: &self.classes,
                upper_classes: &self.upper_classes,
                overrides: &Compiled::none(),
            })
        }
    }

    /// A pod in `shop` mounting claim `data`, with `phase`.
    fn pod_using_data(phase: &str) -> Arc<UpperPod> {
        Arc::new(UpperPod::of(claims_of(json!({
            "metadata": {"name": "db-0", "namespace": "shop"},
            "spec": {"nodeName": "vn", "containers": [{"name": "db"}],
                     "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]},
            "status": {"phase": phase}}))))
    }

    /// Upper claim `shop/data` (uid `pvc-u`) of class `fast`, asking 1Gi, with `extra` merged.
    fn upper_claim(extra: serde_json::Value) -> Arc<PersistentVolumeClaim> {
        let mut v = json!({
            "metadata": {"name": "data", "namespace": "shop", "uid": "pvc-u", "labels": {"app": "db"}},
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}}});
        merge(&mut v, extra);
        Arc::new(serde_json::from_value(v).unwrap())
    }

    /// The lower claim this node made for [`upper_claim`], with `extra` merged.
    fn lower_claim_made(extra: serde_json::Value) -> Arc<PersistentVolumeClaim> {
        let mut v = serde_json::to_value(lower_claim(
            &translation().identity,
            &upper_claim(json!({})),
            &Compiled::none(),
        ))
        .unwrap();
        merge(&mut v, json!({"metadata": {"uid": "lower-u"}}));
        merge(&mut v, extra);
        Arc::new(serde_json::from_value(v).unwrap())
    }

    fn merge(base: &mut serde_json::Value, extra: serde_json::Value) {
        json_patch::merge(base, &extra);
    }

    fn bound(size: &str) -> serde_json::Value {
        json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": size}}})
    }

    fn volume_for(upper: &PersistentVolumeClaim, lower: &PersistentVolumeClaim) -> Arc<PersistentVolume> {
        let mut v = upper_volume(&translation().identity, upper, lower, "Delete".into());
        v.metadata.uid = Some("pv-u".into());
        Arc::new(v)
    }

    #[test]
    fn a_claim_the_upper_scheduler_picked_for_this_node_is_made_below_before_a_pod_uses_it() {
        let world = World {
            upper_claims: vec![upper_claim(
                json!({"metadata": {"annotations": {names::PVC_SELECTED_NODE: "vn"}}}),
            )],
            ..Default::default()
        };
        let writes = world.plan();
        let [Write::CreateLowerClaim { claim }] = writes.as_slice() else {
            panic!("{writes:?}")
        };
        let labels = claim.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get(names::MARK_UPPER_UID).map(String::as_str),
            Some("pvc-u")
        );
        assert_eq!(labels.get(names::MARK_NODE).map(String::as_str), Some("vn"));
        assert_eq!(labels.get("app").map(String::as_str), Some("db"));
        let spec = claim.spec.clone().unwrap_or_default();
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        // The lower cluster's overrides name its own class.
        let mapped = tensile_common::lower::overrides::parse("storageClasses: {fast: premium-b}")
            .and_then(tensile_common::lower::overrides::Overrides::compile)
            .unwrap();
        let below = lower_claim(&translation().identity, &upper_claim(json!({})), &mapped);
        assert_eq!(
            below.spec.and_then(|s| s.storage_class_name).as_deref(),
            Some("premium-b")
        );
        assert!(
            spec.volume_name.is_none(),
            "the lower cluster provisions its own volume"
        );
        let chosen = upper_claim(json!({"spec": {
            "selector": {"matchLabels": {"disk": "theirs"}},
            "volumeName": "their-volume",
            "dataSource": {"kind": "PersistentVolumeClaim", "name": "their-claim"},
        }}));
        let below = lower_claim(&translation().identity, &chosen, &Compiled::default())
            .spec
            .unwrap_or_default();
        assert!(
            below.selector.is_none() && below.volume_name.is_none() && below.data_source.is_none(),
            "no upper choice of volume or data names a lower one: {below:?}"
        );
    }

    #[test]
    fn a_retained_volume_keeps_its_lower_claim_and_upper_volume_after_the_claim_goes() {
        let upper = upper_claim(json!({}));
        let lower = lower_claim_made(bound("1Gi"));
        let mut volume = (*volume_for(&upper, &lower)).clone();
        volume
            .spec
            .get_or_insert_default()
            .persistent_volume_reclaim_policy = Some("Retain".into());
        let volume = Arc::new(volume);
        // While the claim exists, the lower claim records the policy.
        let world = World {
            upper_pods: vec![pod_using_data("Running")],
            upper_claims: vec![upper.clone()],
            upper_volumes: vec![volume.clone()],
            lower_claims: vec![lower.clone()],
            ..Default::default()
        };
        assert_eq!(
            world.plan(),
            [Write::SetReclaimPolicy {
                namespace: "shop".into(),
                name: "data".into(),
                retain: true
            }]
        );
        // The claim is gone before the record was written: the record is written, nothing
        // is deleted.
        let world = World {
            upper_volumes: vec![volume.clone()],
            lower_claims: vec![lower.clone()],
            ..Default::default()
        };
        assert_eq!(
            world.plan(),
            [Write::SetReclaimPolicy {
                namespace: "shop".into(),
                name: "data".into(),
                retain: true
            }]
        );
        // Recorded: neither the lower claim nor the upper volume is ever deleted, not even
        // once an admin deleted the upper volume.
        let recorded = lower_claim_made(
            json!({"metadata": {"annotations": {names::LOWER_CLAIM_RECLAIM_POLICY: "Retain"}}}),
        );
        let world = World {
            upper_volumes: vec![volume],
            lower_claims: vec![recorded.clone()],
            ..Default::default()
        };
        assert_eq!(world.plan(), []);
        let world = World {
            lower_claims: vec![recorded],
            ..Default::default()
        };
        assert_eq!(world.plan(), []);
    }

    #[test]
    fn an_upper_expansion_reaches_the_lower_claim_and_a_shrink_never_does() {
        let lower = lower_claim_made(bound("1Gi"));
        let upper = upper_claim(json!({}));
        let volume = volume_for(&upper, &lower);
        let world = |asks: &str| World {
            upper_pods: vec![pod_using_data("Running")],
            upper_claims: vec![upper_claim(
                json!({"spec": {"resources": {"requests": {"storage": asks}}}}),
            )],
            upper_volumes: vec![volume.clone()],
            lower_claims: vec![lower.clone()],
            ..Default::default()
        };
        assert_eq!(
            world("2Gi").plan(),
            [Write::ExpandLowerClaim {
                namespace: "shop".into(),
                name: "data".into(),
                storage: Quantity("2Gi".into())
            }]
        );
        assert_eq!(world("1Gi").plan(), []);
        assert_eq!(world("500Mi").plan(), []);
    }

    #[test]
    fn a_recreated_upper_claim_never_adopts_the_lower_claim_of_the_earlier_one() {
        let recreated = upper_claim(json!({"metadata": {"uid": "pvc-new"}}));
        let old = lower_claim_made(bound("1Gi"));
        let world = World {
            upper_pods: vec![pod_using_data("Pending")],
            upper_claims: vec![recreated],
            lower_claims: vec![old],
            ..Default::default()
        };
        let writes = world.plan();
        assert!(
            matches!(writes.as_slice(), [Write::DeleteLowerClaim { uid, .. }] if uid.as_deref() == Some("lower-u")),
            "no volume upstream for the new claim from the old lower claim; the old one goes: {writes:?}"
        );
    }

    #[test]
    fn a_claim_picked_for_another_node_or_used_by_no_pod_here_is_left_alone() {
        let world = World {
            upper_claims: vec![upper_claim(
                json!({"metadata": {"annotations": {names::PVC_SELECTED_NODE: "other"}}}),
            )],
            ..Default::default()
        };
        assert_eq!(world.plan(), []);
    }

    #[test]
    fn a_reflected_volume_takes_the_reclaim_policy_of_its_upper_class() {
        let class = |name: &str, policy: Option<&str>| -> Arc<StorageClass> {
            Arc::new(
                serde_json::from_value(json!({"metadata": {"name": name}, "provisioner": PROVISIONER,
                                              "reclaimPolicy": policy}))
                .unwrap(),
            )
        };
        let policy = |classes: Vec<Arc<StorageClass>>| {
            let world = World {
                upper_pods: vec![pod_using_data("Pending")],
                upper_claims: vec![upper_claim(json!({}))],
                lower_claims: vec![lower_claim_made(bound("2Gi"))],
                upper_classes: classes,
                ..Default::default()
            };
            let writes = world.plan();
            let [Write::CreateVolume { volume }] = writes.as_slice() else {
                panic!("{writes:?}")
            };
            volume
                .spec
                .clone()
                .unwrap_or_default()
                .persistent_volume_reclaim_policy
        };
        assert_eq!(
            policy(vec![class("fast", Some("Retain"))]).as_deref(),
            Some("Retain")
        );
        assert_eq!(policy(vec![class("fast", None)]).as_deref(), Some("Delete"));
        assert_eq!(
            policy(vec![class("slow", Some("Retain"))]).as_deref(),
            Some("Delete"),
            "another class's policy is not taken"
        );
    }

    #[test]
    fn a_claim_a_pod_here_uses_gets_its_volume_upstream_once_bound_below() {
        let lower = lower_claim_made(bound("2Gi"));
        let world = World {
            upper_pods: vec![pod_using_data("Pending")],
            upper_claims: vec![upper_claim(json!({}))],
            lower_claims: vec![lower.clone()],
            ..Default::default()
        };
        let writes = world.plan();
        let [Write::CreateVolume { volume }] = writes.as_slice() else {
            panic!("{writes:?}")
        };
        assert_eq!(volume.metadata.name.as_deref(), Some("pvc-pvc-u"));
        let spec = volume.spec.clone().unwrap_or_default();
        let claim = spec.claim_ref.unwrap_or_default();
        assert_eq!(
            (
                claim.namespace.as_deref(),
                claim.name.as_deref(),
                claim.uid.as_deref()
            ),
            (Some("shop"), Some("data"), Some("pvc-u")),
            "pre-bound to exactly the upper claim"
        );
        assert_eq!(
            spec.capacity.unwrap_or_default()["storage"].0,
            "2Gi",
            "what the lower cluster granted"
        );
        let term = &spec
            .node_affinity
            .unwrap_or_default()
            .required
            .unwrap_or_default()
            .node_selector_terms[0];
        let requirement = &term.match_expressions.clone().unwrap_or_default()[0];
        assert_eq!(requirement.values.as_deref(), Some(&["vn".to_owned()][..]));
    }

    #[test]
    fn a_claim_pending_below_gets_a_volume_only_when_its_class_waits_for_a_consumer() {
        let mut world = World {
            upper_pods: vec![pod_using_data("Pending")],
            upper_claims: vec![upper_claim(json!({}))],
            lower_claims: vec![lower_claim_made(json!({"status": {"phase": "Pending"}}))],
            ..Default::default()
        };
        assert_eq!(
            world.plan(),
            [Write::LearnClass { class: "fast".into() }],
            "the class is read first"
        );
        world.classes.insert("fast".into(), false);
        assert_eq!(world.plan(), [], "an immediate class binds below first");
        world.classes.insert("fast".into(), true);
        let writes = world.plan();
        let [Write::CreateVolume { volume }] = writes.as_slice() else {
            panic!("{writes:?}")
        };
        let capacity = volume
            .spec
            .clone()
            .unwrap_or_default()
            .capacity
            .unwrap_or_default();
        assert_eq!(capacity["storage"].0, "1Gi", "sized by the request until bound");
    }

    #[test]
    fn the_lower_schedulers_node_choice_is_named_as_this_node_upstream() {
        let world = World {
            upper_pods: vec![pod_using_data("Pending")],
            upper_claims: vec![upper_claim(json!({}))],
            lower_claims: vec![lower_claim_made(
                json!({"metadata": {"annotations": {names::PVC_SELECTED_NODE: "lower-3"}}, "status": {"phase": "Pending"}}),
            )],
            classes: HashMap::from([("fast".to_owned(), false)]),
            ..Default::default()
        };
        assert_eq!(
            world.plan(),
            [Write::MarkSelected {
                namespace: "shop".into(),
                name: "data".into()
            }]
        );
    }

    #[test]
    fn a_resize_below_shows_on_the_upper_volume_and_an_unchanged_one_writes_nothing() {
        let upper = upper_claim(json!({}));
        let before = lower_claim_made(bound("1Gi"));
        let volume = volume_for(&upper, &before);
        let mut world = World {
            upper_pods: vec![pod_using_data("Running")],
            upper_claims: vec![upper],
            upper_volumes: vec![volume],
            lower_claims: vec![before],
            ..Default::default()
        };
        assert_eq!(world.plan(), []);
        world.lower_claims = vec![lower_claim_made(bound("5Gi"))];
        assert_eq!(
            world.plan(),
            [Write::ResizeVolume {
                name: "pvc-pvc-u".into(),
                capacity: BTreeMap::from([("storage".to_owned(), Quantity("5Gi".into()))]),
            }]
        );
    }

    #[test]
    fn a_lower_claim_whose_upper_claim_is_gone_is_deleted_once_no_lower_pod_uses_it() {
        let mut world = World {
            lower_claims: vec![lower_claim_made(bound("1Gi"))],
            lower_pods: vec![Arc::new(PodLoad::of(&pod_using_data("Running").pod().unwrap()))],
            ..Default::default()
        };
        assert_eq!(world.plan(), [], "a running lower pod keeps its data");
        world.lower_pods.clear();
        assert_eq!(
            world.plan(),
            [Write::DeleteLowerClaim {
                namespace: "shop".into(),
                name: "data".into(),
                uid: Some("lower-u".into()),
                why: "its upper claim is gone",
            }]
        );
    }

    #[test]
    fn a_lower_claim_made_for_an_earlier_upper_claim_of_the_same_name_is_deleted() {
        let world = World {
            upper_claims: vec![upper_claim(json!({"metadata": {"uid": "pvc-new"}}))],
            lower_claims: vec![lower_claim_made(bound("1Gi"))],
            ..Default::default()
        };
        let writes = world.plan();
        assert!(
            matches!(writes.as_slice(), [Write::DeleteLowerClaim { uid, .. }] if uid.as_deref() == Some("lower-u")),
            "{writes:?}"
        );
    }

    #[test]
    fn a_same_named_lower_claim_that_is_not_ours_is_never_touched() {
        let foreign = Arc::new(claims_of_claim(json!({
            "metadata": {"name": "data", "namespace": "shop", "uid": "theirs"},
            "status": {"phase": "Bound"}})));
        let world = World {
            upper_pods: vec![pod_using_data("Pending")],
            upper_claims: vec![upper_claim(json!({}))],
            lower_claims: vec![foreign],
            ..Default::default()
        };
        assert_eq!(
            world.plan(),
            [],
            "no volume, no delete: the pod path reports the conflict"
        );
    }

    fn claims_of_claim(v: serde_json::Value) -> PersistentVolumeClaim {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn an_upper_volume_whose_claim_is_gone_or_was_recreated_is_deleted() {
        let upper = upper_claim(json!({}));
        let volume = volume_for(&upper, &lower_claim_made(bound("1Gi")));
        let gone = World {
            upper_volumes: vec![volume.clone()],
            ..Default::default()
        };
        let deleted = [Write::DeleteUpperVolume {
            name: "pvc-pvc-u".into(),
            uid: Some("pv-u".into()),
            why: "its claim is gone",
        }];
        assert_eq!(gone.plan(), deleted);
        let recreated = World {
            upper_claims: vec![upper_claim(json!({"metadata": {"uid": "pvc-new"}}))],
            upper_volumes: vec![volume],
            ..Default::default()
        };
        assert_eq!(recreated.plan(), deleted);
    }

    #[test]
    fn finished_pods_hold_no_claim_and_a_deleted_claim_gets_no_volume() {
        let finished = World {
            upper_pods: vec![pod_using_data("Succeeded")],
            upper_claims: vec![upper_claim(json!({}))],
            lower_claims: vec![lower_claim_made(bound("1Gi"))],
            ..Default::default()
        };
        assert_eq!(finished.plan(), []);
        let deleting = World {
            upper_pods: vec![pod_using_data("Running")],
            upper_claims: vec![upper_claim(
                json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
            )],
            lower_claims: vec![lower_claim_made(bound("1Gi"))],
            ..Default::default()
        };
        assert_eq!(deleting.plan(), []);
    }
}
