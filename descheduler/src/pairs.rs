//! Every bare-pod move ends with exactly one pod, level-triggered.
//!
//! A bare pod is moved by creating its replacement (labelled `tensile.io/replaces=<old
//! UID>`), then evicting the original. When the eviction does not happen (a crash, a 429 or
//! 5xx, a 409 because the original changed) and the original is placed below meanwhile,
//! both would run for good. Every round therefore looks at every replacement and its
//! original ([`settle`]) and ends each pair that still has two pods:
//!
//! - the original was placed below, runs or has finished: it wins, and the replacement is
//!   evicted (the user's own pod, under its own name, is never the one removed once it runs);
//! - the original is still waiting, unplaced: the move goes on, and the original is evicted.
//!
//! Each eviction carries the UID and resourceVersion judged, so a pod that changed meanwhile
//! is judged again next round instead.

use k8s_openapi::api::core::v1::Pod;
use tensile_common::names;

/// What to do about one replacement and its original.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PairStep {
    /// One pod is left (the original is gone): nothing more will ever happen to this pair.
    Settled,
    /// A deletion is under way; look again next round.
    Wait,
    /// Finish the move: evict the original, still unplaced.
    EvictOriginal,
    /// The original runs (or was placed below, or finished): evict the replacement.
    RemoveReplacement,
}

/// The UID of the pod `replacement` replaces.
pub fn replaced_uid(replacement: &Pod) -> Option<&str> {
    replacement
        .metadata
        .labels
        .as_ref()?
        .get(names::REPLACES)
        .map(String::as_str)
}

/// The label selector that finds the original of `replacement` in its namespace: the
/// replacement copies every label of the original and adds `tensile.io/replaces`, whose
/// value differs when the original was itself a replacement, so that key is left out.
pub fn original_selector(replacement: &Pod) -> String {
    replacement
        .metadata
        .labels
        .iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != names::REPLACES)
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether the lower cluster placed the pod, or it ran.
fn placed_or_ran(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    if phase != "Pending" {
        return true;
    }
    status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == names::CONDITION_LOWER_SCHEDULED && c.status == "True")
}

/// Whether a descheduler serving the virtual nodes `serves` names (its `--node-selector`)
/// ends this pair: the move left the original's node, so the pair is the business of the
/// descheduler serving that node (or, for an original bound nowhere, the replacement's).
/// Several deschedulers, each over its own virtual nodes, then never end each other's pairs.
pub fn ours(original: Option<&Pod>, replacement: &Pod, serves: impl Fn(&str) -> bool) -> bool {
    let node = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
    original
        .and_then(node)
        .or_else(|| node(replacement))
        .is_some_and(|n| serves(&n))
}

/// Decides about `replacement` given its `original` as found now (`None`: no pod of that
/// UID exists any more).
pub fn settle(original: Option<&Pod>, replacement: &Pod) -> PairStep {
    let Some(original) = original.filter(|o| o.metadata.uid.as_deref() == replaced_uid(replacement)) else {
        return PairStep::Settled;
    };
    if original.metadata.deletion_timestamp.is_some() || replacement.metadata.deletion_timestamp.is_some() {
        return PairStep::Wait;
    }
    if placed_or_ran(original) {
        PairStep::RemoveReplacement
    } else {
        PairStep::EvictOriginal
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, labels: serde_json::Value, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": format!("solo-{uid}"), "namespace": "ns", "uid": uid, "labels": labels},
            "spec": {"nodeName": "vn-a", "containers": [{"name": "c", "image": "busybox"}]},
            "status": status,
        }))
        .unwrap()
    }

    fn replacement() -> Pod {
        pod(
            "new",
            json!({"app": "solo", "virtual-pod": "true", "tensile.io/replaces": "old"}),
            json!({"phase": "Running"}),
        )
    }

    fn refused() -> serde_json::Value {
        json!({"phase": "Pending", "conditions": [
            {"type": "tensile.io/LowerPodScheduled", "status": "False", "reason": "Unschedulable"}]})
    }

    #[test]
    fn a_pair_is_ended_only_by_the_descheduler_serving_the_originals_node() {
        let original = pod("old", json!({"app": "solo", "virtual-pod": "true"}), refused());
        let replacement = replacement();
        assert!(ours(Some(&original), &replacement, |n| n == "vn-a"));
        assert!(
            !ours(Some(&original), &replacement, |n| n == "vn-other"),
            "another descheduler's virtual nodes"
        );
        let mut unbound = original.clone();
        unbound.spec.as_mut().unwrap().node_name = None;
        assert!(
            ours(Some(&unbound), &replacement, |n| n == "vn-a"),
            "the replacement's node then"
        );
        assert!(!ours(None, &replacement, |n| n == "vn-b"));
    }

    #[test]
    fn an_original_placed_below_after_its_replacement_was_made_keeps_running_and_the_replacement_goes() {
        let placed = json!({"phase": "Pending", "conditions": [
            {"type": "tensile.io/LowerPodScheduled", "status": "True"}]});
        let original = pod("old", json!({"app": "solo", "virtual-pod": "true"}), placed);
        assert_eq!(
            settle(Some(&original), &replacement()),
            PairStep::RemoveReplacement
        );
        let running = pod("old", json!({"app": "solo"}), json!({"phase": "Running"}));
        assert_eq!(
            settle(Some(&running), &replacement()),
            PairStep::RemoveReplacement
        );
        let finished = pod("old", json!({"app": "solo"}), json!({"phase": "Succeeded"}));
        assert_eq!(
            settle(Some(&finished), &replacement()),
            PairStep::RemoveReplacement,
            "it ran to the end: running the copy would run it twice"
        );
    }

    #[test]
    fn an_original_still_refused_is_evicted_to_finish_the_move() {
        let original = pod("old", json!({"app": "solo"}), refused());
        assert_eq!(settle(Some(&original), &replacement()), PairStep::EvictOriginal);
    }

    #[test]
    fn a_pair_with_a_pod_being_deleted_waits_and_a_pair_whose_original_is_gone_is_settled() {
        let mut original = pod("old", json!({"app": "solo"}), json!({"phase": "Running"}));
        original.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2024-05-01T10:00:00Z".parse().unwrap(),
        ));
        assert_eq!(settle(Some(&original), &replacement()), PairStep::Wait);
        assert_eq!(settle(None, &replacement()), PairStep::Settled);
        let same_name_other_pod = pod("other", json!({"app": "solo"}), refused());
        assert_eq!(
            settle(Some(&same_name_other_pod), &replacement()),
            PairStep::Settled
        );
    }

    #[test]
    fn the_original_is_found_by_the_labels_it_shares_with_its_replacement() {
        let mut r = replacement();
        assert_eq!(replaced_uid(&r), Some("old"));
        assert_eq!(original_selector(&r), "app=solo,virtual-pod=true");
        r.metadata.labels = None;
        assert_eq!(original_selector(&r), "");
    }
}
