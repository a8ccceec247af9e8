//! Whether another virtual node would take a refused pod: what the upper scheduler checks
//! of the node itself (Ready, not cordoned, taints, `nodeSelector`, required node affinity),
//! then whether some lower node of its capacity shape holds the pod, by the suite's one fit
//! predicate ([`tensile_common::fit`], the multi-scheduler's filter): the stashed selector
//! against the shape's label groups, the stashed tolerations against their taints, the
//! requests against their frontiers, the shape's age, and the same fail-open rules.
//!
//! The pod is judged as its replacement will be created: the `kubernetes.io/hostname NotIn`
//! values the webhook added for earlier exclusions (listed in `tensile.io/excluded-nodes`)
//! are not the workload's own constraints and are left out; the new exclusion is applied
//! by the caller.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use k8s_openapi::api::core::v1::{Node, NodeSelectorTerm, Pod};
use tensile_common::fit::{self, Options, PodFacts, ShapeFacts, UpperRefusal, Verdict};
use tensile_common::names;

/// Why a virtual node would not take the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotFit {
    /// The upper scheduler itself keeps the pod off the node (not Ready, cordoned, a taint,
    /// the selector or the affinity): no exclusion is needed to steer the pod away.
    Upper(String),
    /// The upper scheduler would bind the pod there, but the node's capacity shape says no
    /// lower node holds it: only an exclusion keeps the replacement away.
    Shape(String),
}

impl NotFit {
    pub fn message(&self) -> &str {
        match self {
            NotFit::Upper(m) | NotFit::Shape(m) => m,
        }
    }
}

/// Whether a virtual node would take the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// It would not, and why.
    No(NotFit),
    /// The upper scheduler would bind the pod there and a lower node of its shape holds it.
    Fits,
    /// The upper scheduler would bind the pod there; the shape cannot say whether a lower
    /// node holds it (none, stale, a label it does not publish, …).
    Unknown,
}

/// Why `node` would not take the pod (`None`: it would, or its shape cannot say).
pub fn refuses(pod: &Pod, node: &Node, options: &Options) -> Option<NotFit> {
    match takes(pod, node, options) {
        Take::No(why) => Some(why),
        Take::Fits | Take::Unknown => None,
    }
}

/// Whether `node` would take the pod, apart from the exclusions of ours it carries.
pub fn takes(pod: &Pod, node: &Node, options: &Options) -> Take {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    if pod.spec.is_none() {
        return Take::Unknown;
    }
    if let Some(why) = upper_refusal(pod, node) {
        return Take::No(NotFit::Upper(why.of_node(name)));
    }
    match fit::judge(&PodFacts::of(pod), shape_of(node).as_ref().as_ref(), options).verdict {
        Verdict::Rejected(why) => Take::No(NotFit::Shape(format!(
            "no lower node of {name} holds the pod: {why}"
        ))),
        Verdict::Fits => Take::Fits,
        Verdict::NotVirtual | Verdict::FailOpen(_) => Take::Unknown,
    }
}

/// A node's capacity shape and placement overrides, decoded once per version of the Node
/// (the resourceVersion the watch shows), not once per pod judged against it.
fn shape_of(node: &Node) -> Arc<Option<Result<ShapeFacts, String>>> {
    type Decoded = HashMap<String, (String, Arc<Option<Result<ShapeFacts, String>>>)>;
    static DECODED: LazyLock<Mutex<Decoded>> = LazyLock::new(Mutex::default);
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let Some(version) = node.metadata.resource_version.as_deref() else {
        return Arc::new(ShapeFacts::of(node));
    };
    if let Ok(decoded) = DECODED.lock()
        && let Some((seen, facts)) = decoded.get(name)
        && seen == version
    {
        return facts.clone();
    }
    let facts = Arc::new(ShapeFacts::of(node));
    if let Ok(mut decoded) = DECODED.lock() {
        // Nodes are few; names of deleted ones are dropped once there are many.
        if decoded.len() >= 4096 {
            decoded.clear();
        }
        decoded.insert(name.to_owned(), (version.to_owned(), facts.clone()));
    }
    facts
}

/// Whether `node` matches the pod's `nodeSelector` and required node affinity (the
/// exclusions of ours it carries left out).
pub fn matches_constraints(pod: &Pod, node: &Node) -> bool {
    !matches!(
        upper_refusal(pod, node),
        Some(UpperRefusal::NodeSelector(..) | UpperRefusal::Affinity)
    )
}

/// Why the upper scheduler would keep the pod's replacement off `node`, by the suite's one
/// upper predicate: the pod's tolerations, `nodeSelector` and required node affinity, the
/// exclusions of ours it carries left out.
fn upper_refusal(pod: &Pod, node: &Node) -> Option<UpperRefusal> {
    let spec = pod.spec.as_ref()?;
    let terms = fit::required_terms(spec).map(|terms| without_our_exclusions(terms, &excluded_by_us(pod)));
    fit::upper_refusal(
        node,
        spec.tolerations.as_deref().unwrap_or_default(),
        spec.node_selector.as_ref(),
        terms.as_deref(),
    )
}

/// The terms with the webhook's own `kubernetes.io/hostname NotIn` values taken out: they
/// were for the pod being replaced, not for its successor.
fn without_our_exclusions(terms: &[NodeSelectorTerm], ours: &[String]) -> Vec<NodeSelectorTerm> {
    let mut terms = terms.to_vec();
    for r in terms
        .iter_mut()
        .flat_map(|t| t.match_expressions.iter_mut().flatten())
    {
        if r.key == names::HOSTNAME_LABEL
            && r.operator == "NotIn"
            && let Some(values) = r.values.as_mut()
        {
            values.retain(|v| !ours.contains(v));
        }
    }
    terms
}

/// The virtual nodes the webhook excluded on this pod (its `tensile.io/excluded-nodes`).
pub fn excluded_by_us(pod: &Pod) -> Vec<String> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::EXCLUDED_NODES))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn options() -> Options {
        Options {
            now: "2024-05-01T10:01:00Z".parse().unwrap(),
            max_age: Some(jiff::SignedDuration::from_mins(15)),
        }
    }

    /// The message, for tests that only read it.
    fn refuses(pod: &Pod, node: &Node) -> Option<String> {
        super::refuses(pod, node, &options()).map(|n| n.message().to_owned())
    }

    fn node(name: &str, extra: serde_json::Value) -> Node {
        let mut v = json!({
            "metadata": {"name": name, "labels": {"type": "virtual-kubelet", "kubernetes.io/hostname": name}},
            "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "value": "tensile", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        });
        merge(&mut v, extra);
        serde_json::from_value(v).unwrap()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    fn pod(extra: serde_json::Value) -> Pod {
        let mut v = json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]}}},
            },
        });
        merge(&mut v, extra);
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_ready_virtual_node_the_pod_tolerates_would_take_it() {
        assert_eq!(refuses(&pod(json!({})), &node("vn-b", json!({}))), None);
    }

    #[test]
    fn a_not_ready_or_cordoned_node_would_not() {
        let not_ready = node(
            "vn-b",
            json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        );
        assert!(
            refuses(&pod(json!({})), &not_ready)
                .unwrap()
                .contains("not Ready")
        );
        let cordoned = node("vn-b", json!({"spec": {"unschedulable": true}}));
        assert!(refuses(&pod(json!({})), &cordoned).unwrap().contains("cordoned"));
    }

    #[test]
    fn an_untolerated_taint_or_a_selector_mismatch_keeps_the_pod_off() {
        let tainted = node(
            "vn-b",
            json!({"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}),
        );
        assert!(refuses(&pod(json!({})), &tainted).unwrap().contains("taint gpu"));
        let p = pod(json!({"spec": {"nodeSelector": {"region": "eu"}}}));
        assert!(
            refuses(&p, &node("vn-b", json!({})))
                .unwrap()
                .contains("nodeSelector")
        );
        assert_eq!(
            refuses(
                &p,
                &node("vn-b", json!({"metadata": {"labels": {"region": "eu"}}}))
            ),
            None
        );
    }

    #[test]
    fn the_webhooks_own_exclusions_do_not_count_but_the_users_do() {
        let p = |annotation: &str| {
            pod(json!({
                "metadata": {"annotations": {"tensile.io/excluded-nodes": annotation}},
                "spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": "type", "operator": "In", "values": ["virtual-kubelet"]},
                        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-b"]}]}]}}}},
            }))
        };
        assert_eq!(refuses(&p("vn-b"), &node("vn-b", json!({}))), None);
        assert!(
            refuses(&p(""), &node("vn-b", json!({})))
                .unwrap()
                .contains("affinity")
        );
    }

    #[test]
    fn a_pod_bigger_than_every_lower_node_of_the_shape_does_not_fit() {
        let shaped = |shape: &str| {
            node(
                "vn-b",
                json!({"metadata": {"annotations": {"tensile.io/capacity-shape": shape}}}),
            )
        };
        let small =
            shaped(r#"[{"cpu":"2","memory":"4Gi","pods":"100"},{"cpu":"2","memory":"4Gi","pods":"100"}]"#);
        assert!(
            refuses(&pod(json!({})), &small)
                .unwrap()
                .contains("no lower node")
        );
        let big =
            shaped(r#"[{"cpu":"2","memory":"4Gi","pods":"100"},{"cpu":"8","memory":"4Gi","pods":"100"}]"#);
        assert_eq!(refuses(&pod(json!({})), &big), None);
        assert_eq!(refuses(&pod(json!({})), &shaped("not json")), None, "fails open");
        let five = shaped(&serde_json::to_string(&vec![json!({"cpu": "2", "pods": "100"}); 5]).unwrap());
        assert_eq!(
            refuses(&pod(json!({})), &five),
            None,
            "a first-form list of five may have been cut: the benefit of the doubt"
        );
    }

    #[test]
    fn in_the_current_shape_only_groups_whose_taints_the_stash_tolerates_count() {
        let shape = json!({"v": 2, "at": "2024-05-01T10:00:00Z", "keys": ["topology.kubernetes.io/zone"],
            "nodes": 3, "truncated": false, "groups": [
                {"labels": {"topology.kubernetes.io/zone": "a"}, "count": 2, "truncated": false,
                 "free": [{"cpu": "2", "memory": "4Gi", "pods": "100"}]},
                {"labels": {"topology.kubernetes.io/zone": "b"}, "count": 1, "truncated": false,
                 "taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}],
                 "free": [{"cpu": "8", "memory": "32Gi", "pods": "100"}]}]});
        let vn = node(
            "vn-c",
            json!({"metadata": {"annotations": {"tensile.io/capacity-shape": shape.to_string()}}}),
        );
        let refused = refuses(&pod(json!({})), &vn).unwrap();
        assert!(
            refused.contains("no lower node"),
            "3 CPUs fit only the tainted group: {refused}"
        );
        let stash = json!({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]});
        let tolerating = pod(json!({"metadata": {"annotations": {"clusterSelector": stash.to_string()}}}));
        assert_eq!(refuses(&tolerating, &vn), None);
        let small =
            pod(json!({"spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "2"}}}]}}));
        assert_eq!(refuses(&small, &vn), None, "2 CPUs fit the untainted group");
        let big = pod(json!({
            "metadata": {"annotations": {"clusterSelector": stash.to_string()}},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "9"}}}]},
        }));
        assert!(refuses(&big, &vn).is_some(), "9 CPUs fit no group");

        let cut = json!({"v": 2, "nodes": 9, "truncated": true, "groups": [
            {"count": 9, "truncated": true, "free": [{"cpu": "2", "pods": "100"}], "max": {"cpu": "4", "pods": "100"}}]});
        let vn = node(
            "vn-d",
            json!({"metadata": {"annotations": {"tensile.io/capacity-shape": cut.to_string()}}}),
        );
        assert_eq!(
            refuses(&pod(json!({})), &vn),
            None,
            "3 CPUs may be on a node the cut hid"
        );
        let nine =
            pod(json!({"spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "9"}}}]}}));
        assert!(
            refuses(&nine, &vn).is_some(),
            "above the group's largest free cpu"
        );
    }

    #[test]
    fn the_stashed_selector_is_matched_against_the_shapes_label_groups() {
        // Zone a has an 8-CPU node, zone b only 2-CPU nodes: a 3-CPU pod whose stash wants
        // zone b fits no lower node, though some node of the cluster has room.
        let shape = json!({"v": 2, "at": "2024-05-01T10:00:00Z", "keys": ["topology.kubernetes.io/zone"],
            "nodes": 3, "truncated": false, "groups": [
                {"labels": {"topology.kubernetes.io/zone": "a"}, "count": 1, "truncated": false,
                 "free": [{"cpu": "8", "memory": "32Gi", "pods": "100"}]},
                {"labels": {"topology.kubernetes.io/zone": "b"}, "count": 2, "truncated": false,
                 "free": [{"cpu": "2", "memory": "4Gi", "pods": "100"}]}]});
        let vn = node(
            "vn-c",
            json!({"metadata": {"annotations": {"tensile.io/capacity-shape": shape.to_string()}}}),
        );
        let in_zone = |zone: &str| {
            let stash = json!({"nodeSelector": {"topology.kubernetes.io/zone": zone}});
            pod(json!({"metadata": {"annotations": {"clusterSelector": stash.to_string()}}}))
        };
        match super::refuses(&in_zone("b"), &vn, &options()) {
            Some(NotFit::Shape(m)) => assert!(m.contains("cpu=3 (largest free 2"), "{m}"),
            other => panic!("zone b holds no 3-CPU pod: {other:?}"),
        }
        assert_eq!(refuses(&in_zone("a"), &vn), None);
        let nowhere = refuses(&in_zone("c"), &vn).unwrap();
        assert!(nowhere.contains("stashed node selector"), "{nowhere}");
    }

    #[test]
    fn a_stale_shape_says_nothing_and_the_node_may_take_the_pod() {
        let shape = json!({"v": 2, "at": "2024-05-01T09:00:00Z", "keys": [], "nodes": 1, "truncated": false,
            "groups": [{"count": 1, "truncated": false, "free": [{"cpu": "2", "pods": "100"}]}]});
        let vn = node(
            "vn-c",
            json!({"metadata": {"annotations": {"tensile.io/capacity-shape": shape.to_string()}}}),
        );
        assert_eq!(
            refuses(&pod(json!({})), &vn),
            None,
            "an hour old, past the 15 minutes"
        );
        let any_age = Options {
            max_age: None,
            ..options()
        };
        assert!(matches!(
            super::refuses(&pod(json!({})), &vn, &any_age),
            Some(NotFit::Shape(_))
        ));
    }

    #[test]
    fn what_the_upper_scheduler_checks_is_told_apart_from_the_shape() {
        let cordoned = node("vn-b", json!({"spec": {"unschedulable": true}}));
        assert!(matches!(
            super::refuses(&pod(json!({})), &cordoned, &options()),
            Some(NotFit::Upper(_))
        ));
        let small = node(
            "vn-b",
            json!({"metadata": {"annotations": {"tensile.io/capacity-shape": r#"[{"cpu":"2","pods":"100"}]"#}}}),
        );
        assert!(matches!(
            super::refuses(&pod(json!({})), &small, &options()),
            Some(NotFit::Shape(_))
        ));
    }
}
