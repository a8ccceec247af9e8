//! The volume pin: the webhook pins a pod whose PVC is bound below one virtual node to that
//! node, with `matchFields metadata.name In [node]` joined to each term of its upper required
//! node affinity (see the webhook's docs). Such a pod can run nowhere else, so no exclusion of
//! its workload applies to it and the descheduler never moves it.

use k8s_openapi::api::core::v1::{NodeSelectorTerm, Pod};

/// Whether a volume pins `pod` to one node: a `matchFields metadata.name In` requirement in a
/// term of its upper required node affinity.
pub fn volume_pinned(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
        .is_some_and(|r| pins(&r.node_selector_terms))
}

/// Whether required node selector terms carry the volume pin.
pub fn pins(terms: &[NodeSelectorTerm]) -> bool {
    terms.iter().any(|t| {
        t.match_fields
            .iter()
            .flatten()
            .any(|f| f.key == "metadata.name" && f.operator == "In")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn with_terms(terms: Value) -> Pod {
        serde_json::from_value(json!({"spec": {"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}}))
        .unwrap()
    }

    #[test]
    fn a_pod_is_volume_pinned_by_a_match_fields_name_in_term_only() {
        let pinned = with_terms(json!([{
            "matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vn-b"]}]}]));
        assert!(volume_pinned(&pinned));
        let not_in = with_terms(json!([{
            "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["vn-b"]}]}]));
        assert!(
            !volume_pinned(&not_in),
            "NotIn keeps the pod off a node, it pins nothing"
        );
        let by_label = with_terms(json!([{
            "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["vn-b"]}]}]));
        assert!(
            !volume_pinned(&by_label),
            "a hostname the user chose is no volume's pin"
        );
        assert!(!volume_pinned(&Pod::default()));
    }
}
