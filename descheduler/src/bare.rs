//! Moving a bare pod, which nothing recreates: create-then-evict under a new name.
//!
//! 1. The replacement is the pod's copy with `nodeName`, identity, status and `priority`
//!    cleared (Priority admission recomputes it, and older servers refuse a preset value),
//!    its stash untouched, the exclusion written into every required node-affinity term,
//!    the label `tensile.io/replaces=<old UID>`, and the annotations `tensile.io/lineage`
//!    (the record's key, the UID of the first pod of the line) and
//!    `tensile.io/deschedule-count`.
//! 2. It is created under a name derived from the old pod's UID, so a retry after a crash
//!    finds it (by label, or as a name conflict) instead of making a second one.
//! 3. The old pod is evicted with its UID and resourceVersion as preconditions.
//!
//! The old pod never ran (it is Pending below), so running both for a moment loses nothing,
//! and at no point is there no pod: a restart at any step finishes the move exactly once.
//! When the eviction does not happen (a crash, a refusal, a 409 because the old pod changed)
//! and the old pod is placed below meanwhile, [`crate::pairs`] ends the pair with one pod.
//! The name changes because the old pod holds its name until the virtual node has deleted
//! its lower pod; waiting for that would leave a window in which only a record of the pod
//! exists.

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
};
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use tensile_common::names;

use crate::fit;
use tensile_common::evict::{self, Evicted};
use tensile_common::runtime::CrashPoints;

/// A step of a bare-pod move after which `--crash-at` aborts the process, so that tests can
/// prove a restart at any step finishes the move exactly once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Step {
    /// The exclusion record is written; no replacement yet.
    Recorded,
    /// The replacement exists; the original is not evicted yet.
    Created,
    /// The original is evicted.
    Evicted,
}

/// The replacement's name: the line's base name and five characters of the old UID.
pub fn replacement_name(pod: &Pod) -> String {
    let name = pod.metadata.name.as_deref().unwrap_or("pod");
    let is_replacement = pod
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(names::REPLACES));
    // A replacement's name already ends in `-xxxxx`: the line keeps one base.
    let base = match name.rsplit_once('-') {
        Some((base, suffix)) if is_replacement && suffix.len() == 5 => base,
        _ => name,
    };
    let suffix: String = pod
        .metadata
        .uid
        .as_deref()
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(5)
        .collect::<String>()
        .to_ascii_lowercase();
    let base: String = base.chars().take(57).collect();
    format!("{}-{suffix}", base.trim_end_matches(['-', '.']))
}

/// The replacement of `pod` in line `lineage` (the record's key), avoiding `excluded`.
pub fn replacement(pod: &Pod, lineage: &str, excluded: &[String]) -> Pod {
    let old_uid = pod.metadata.uid.clone().unwrap_or_default();
    let count = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::DESCHEDULE_COUNT))
        .and_then(|c| c.parse::<u32>().ok())
        .unwrap_or(0);
    let mut labels = pod.metadata.labels.clone().unwrap_or_default();
    labels.insert(names::REPLACES.into(), old_uid);
    let mut annotations = pod.metadata.annotations.clone().unwrap_or_default();
    annotations.insert(names::LINEAGE.into(), lineage.to_owned());
    annotations.insert(names::DESCHEDULE_COUNT.into(), (count + 1).to_string());
    if excluded.is_empty() {
        annotations.remove(names::EXCLUDED_NODES);
    } else {
        annotations.insert(names::EXCLUDED_NODES.into(), excluded.join(","));
    }
    let mut spec = pod.spec.clone().unwrap_or_default();
    spec.node_name = None;
    spec.priority = None;
    let ours = fit::excluded_by_us(pod);
    let affinity = spec.affinity.get_or_insert_with(Affinity::default);
    let na = affinity.node_affinity.get_or_insert_with(NodeAffinity::default);
    let required = na
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(NodeSelector::default);
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(NodeSelectorTerm::default());
    }
    for term in &mut required.node_selector_terms {
        let exprs = term.match_expressions.get_or_insert_with(Vec::new);
        // The previous exclusion is replaced by the current one; the user's own stay.
        for r in exprs.iter_mut() {
            if r.key == names::HOSTNAME_LABEL && r.operator == "NotIn" {
                r.values
                    .get_or_insert_with(Vec::new)
                    .retain(|v| !ours.contains(v));
            }
        }
        exprs.retain(|r| {
            !(r.key == names::HOSTNAME_LABEL
                && r.operator == "NotIn"
                && r.values.as_ref().is_none_or(Vec::is_empty))
        });
        if !excluded.is_empty() {
            exprs.push(NodeSelectorRequirement {
                key: names::HOSTNAME_LABEL.into(),
                operator: "NotIn".into(),
                values: Some(excluded.to_vec()),
            });
        }
    }
    Pod {
        metadata: ObjectMeta {
            name: Some(replacement_name(pod)),
            namespace: pod.metadata.namespace.clone(),
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// Moves the bare pod: finds or creates its replacement (line `lineage`, avoiding
/// `excluded`), then evicts it.
pub async fn replace(
    api: &Api<Pod>,
    pod: &Pod,
    lineage: &str,
    excluded: &[String],
    crash_at: CrashPoints<Step>,
) -> Result<Evicted, kube::Error> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let selector = format!("{}={uid}", names::REPLACES);
    let existing = api.list(&ListParams::default().labels(&selector)).await?;
    if existing.items.is_empty() {
        let new = replacement(pod, lineage, excluded);
        match api.create(&PostParams::default(), &new).await {
            Ok(created) => tracing::info!(
                pod = %format!("{ns}/{name}"),
                replacement = created.metadata.name.as_deref().unwrap_or_default(),
                "created the replacement"
            ),
            // A replacement made before a crash whose label the list did not show yet.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let theirs = api.get_opt(&replacement_name(pod)).await?;
                let replaces = theirs
                    .as_ref()
                    .and_then(|p| p.metadata.labels.as_ref())
                    .and_then(|l| l.get(names::REPLACES));
                if replaces != Some(&uid) {
                    return Err(kube::Error::Api(s));
                }
            }
            Err(e) => return Err(e),
        }
    }
    crash_at.reached(Step::Created);
    let evicted = evict::evict(api, pod).await?;
    crash_at.reached(Step::Evicted);
    Ok(evicted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bare(name: &str, extra_labels: serde_json::Value, annotations: serde_json::Value) -> Pod {
        let mut labels = json!({"virtual-pod": "true", "app": "solo"});
        if let (Some(l), Some(extra)) = (labels.as_object_mut(), extra_labels.as_object()) {
            l.extend(extra.clone());
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": "4f2a9c1e-0000-1111-2222-333344445555",
                "resourceVersion": "17", "creationTimestamp": "2024-05-01T09:00:00Z",
                "labels": labels, "annotations": annotations},
            "spec": {
                "nodeName": "vn-a", "priority": 0,
                "containers": [{"name": "c", "image": "busybox"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]}}},
            },
            "status": {"phase": "Pending"},
        }))
        .unwrap()
    }

    fn nodes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_replacement_keeps_the_stash_and_spec_avoids_the_refusing_node_and_names_the_original() {
        let pod = bare(
            "solo",
            json!({}),
            json!({"clusterSelector": "{\"nodeSelector\":{\"disk\":\"ssd\"}}"}),
        );
        let new = replacement(&pod, "first-uid", &nodes(&["vn-a"]));
        let meta = &new.metadata;
        assert_eq!(meta.name.as_deref(), Some("solo-4f2a9"));
        assert!(meta.uid.is_none() && meta.resource_version.is_none() && meta.creation_timestamp.is_none());
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(
            labels["tensile.io/replaces"],
            "4f2a9c1e-0000-1111-2222-333344445555"
        );
        assert_eq!(labels["app"], "solo");
        let a = meta.annotations.as_ref().unwrap();
        assert_eq!(
            a["clusterSelector"], "{\"nodeSelector\":{\"disk\":\"ssd\"}}",
            "the stash is untouched"
        );
        assert_eq!(a["tensile.io/lineage"], "first-uid");
        assert_eq!(a["tensile.io/deschedule-count"], "1");
        assert_eq!(a["tensile.io/excluded-nodes"], "vn-a");
        let spec = new.spec.as_ref().unwrap();
        assert!(spec.node_name.is_none() && spec.priority.is_none());
        let v = serde_json::to_value(spec).unwrap();
        assert_eq!(
            v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                [0]["matchExpressions"],
            json!([
                {"key": "type", "operator": "In", "values": ["virtual-kubelet"]},
                {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-a"]},
            ])
        );
        assert!(new.status.is_none());
    }

    #[test]
    fn a_second_move_keeps_the_base_name_and_replaces_the_previous_exclusion() {
        let first = bare("solo", json!({}), json!({}));
        let mut second = replacement(&first, "first-uid", &nodes(&["vn-a"]));
        second.metadata.uid = Some("9b8c7d6e-aaaa".into());
        let third = replacement(&second, "first-uid", &nodes(&["vn-b"]));
        assert_eq!(third.metadata.name.as_deref(), Some("solo-9b8c7"));
        let a = third.metadata.annotations.as_ref().unwrap();
        assert_eq!(a["tensile.io/deschedule-count"], "2");
        let v = serde_json::to_value(third.spec.as_ref().unwrap()).unwrap();
        let exprs = &v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"];
        assert_eq!(exprs.as_array().unwrap().len(), 2, "{exprs}");
        assert_eq!(exprs[1]["values"], json!(["vn-b"]));
    }

    #[test]
    fn a_replacement_with_nothing_left_to_avoid_carries_no_exclusion_of_ours() {
        let first = bare("solo", json!({}), json!({}));
        let mut second = replacement(&first, "first-uid", &nodes(&["vn-a"]));
        second.metadata.uid = Some("9b8c7d6e-aaaa".into());
        let third = replacement(&second, "first-uid", &[]);
        let a = third.metadata.annotations.as_ref().unwrap();
        assert!(!a.contains_key("tensile.io/excluded-nodes"), "{a:?}");
        assert_eq!(a["tensile.io/lineage"], "first-uid");
        let v = serde_json::to_value(third.spec.as_ref().unwrap()).unwrap();
        assert_eq!(
            v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                [0]["matchExpressions"],
            json!([{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]),
            "the user's own term stays, ours is gone"
        );
    }

    #[test]
    fn a_long_name_is_cut_so_the_replacement_stays_within_63_characters() {
        let long = "x".repeat(80);
        let name = replacement_name(&bare(&long, json!({}), json!({})));
        assert_eq!(name.len(), 63);
        assert!(name.ends_with("-4f2a9"));
    }
}
