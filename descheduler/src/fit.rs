//! Whether a virtual node would take a pod: what the upper scheduler checks (Ready, not
//! cordoned, taints, `nodeSelector`, required node affinity), plus whether some lower node
//! of its capacity shape has room for the pod's requests.
//!
//! The pod is judged as its replacement will be created: the `kubernetes.io/hostname NotIn`
//! values the webhook added for earlier exclusions (listed in `tensile.io/excluded-nodes`)
//! are not the workload's own constraints and are left out; the new exclusion is applied
//! by the caller.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration};
use tensile_common::names;
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::pod_requests;
use tensile_common::shape::Shape;
use tensile_common::stash::Stash;

/// Why a node would not take the pod (`None`: it would).
pub fn refuses(pod: &Pod, node: &Node) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    if !is_ready(node) {
        return Some(format!("{name} is not Ready"));
    }
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Some(format!("{name} is cordoned"));
    }
    let spec = pod.spec.as_ref()?;
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    for taint in node.spec.iter().flat_map(|s| s.taints.iter().flatten()) {
        let blocks = matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute");
        if blocks && !tolerations.iter().any(|t| tolerates(t, taint)) {
            return Some(format!(
                "{name} has the taint {} the pod does not tolerate",
                taint.key
            ));
        }
    }
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    for (k, v) in spec.node_selector.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Some(format!("{name} does not match the pod's nodeSelector {k}={v}"));
        }
    }
    let ours = excluded_by_us(pod);
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    if !terms.is_empty() && !terms.iter().any(|t| term_matches(t, name, labels, &ours)) {
        return Some(format!("{name} does not match the pod's required node affinity"));
    }
    if !shape_fits(pod, node) {
        return Some(format!("no lower node of {name} has room for the pod's requests"));
    }
    None
}

/// The node's Ready condition is True.
pub fn is_ready(node: &Node) -> bool {
    node.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True")
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

fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    match t.key.as_deref().filter(|k| !k.is_empty()) {
        None => t.operator.as_deref() == Some("Exists"),
        Some(key) if key != taint.key => false,
        Some(_) => match t.operator.as_deref() {
            Some("Exists") => true,
            _ => t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default(),
        },
    }
}

fn term_matches(
    term: &NodeSelectorTerm,
    name: &str,
    labels: &BTreeMap<String, String>,
    ours: &[String],
) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs.iter().all(|r| {
        // The webhook's own exclusions are for the pod being replaced, not for its successor.
        if r.key == names::HOSTNAME_LABEL && r.operator == "NotIn" {
            let values: Vec<&String> = r.values.iter().flatten().filter(|v| !ours.contains(v)).collect();
            return !values.iter().any(|v| labels.get(&r.key) == Some(*v));
        }
        requirement_matches(r, labels.get(&r.key).map(String::as_str))
    }) && fields.iter().all(|r| {
        let value = (r.key == "metadata.name").then_some(name);
        requirement_matches(r, value)
    })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(number), values.first().and_then(|x| number(x))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(number), values.first().and_then(|x| number(x))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

/// Whether some lower node in the node's capacity shape ([`tensile_common::shape`], either
/// form) has room for the pod's requests, among the groups whose taints the pod's stashed
/// tolerations tolerate. A node without a shape, or with one that does not decode, and a
/// pod whose stash does not decode, are given the benefit of the doubt, as is a group whose
/// frontier was cut unless its largest free amounts fall short: the lower scheduler will say.
pub fn shape_fits(pod: &Pod, node: &Node) -> bool {
    let Some(Ok(shape)) = Shape::from_annotations(node.metadata.annotations.as_ref()) else {
        return true;
    };
    let Ok(stash) = Stash::from_annotations(pod.metadata.annotations.as_ref()) else {
        return true;
    };
    let tolerations = stash.map(|s| s.tolerations).unwrap_or_default();
    let wants = pod_requests(pod);
    let mut truncated = false;
    for group in &shape.groups {
        if !group
            .taints
            .iter()
            .all(|taint| tolerations.iter().any(|t| tolerates(t, taint)))
        {
            continue;
        }
        let Ok(frontier) = group.free_maps() else {
            return true;
        };
        let holds = |free: &ResourceMap| {
            wants
                .0
                .iter()
                .filter(|(k, _)| k.as_str() != "pods" || free.0.contains_key("pods"))
                .all(|(k, v)| *v <= free.get(k))
        };
        if frontier.iter().any(holds) {
            return true;
        }
        // A cut frontier may hide a node that fits, unless the group's largest free
        // amounts already fall short.
        let Ok(max) = group.max_map() else {
            return true;
        };
        truncated |= group.truncated && max.as_ref().is_none_or(holds);
    }
    truncated
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
    fn operators_read_as_the_scheduler_reads_them() {
        let r = |op: &str, values: &[&str]| NodeSelectorRequirement {
            key: "k".into(),
            operator: op.into(),
            values: Some(values.iter().map(|s| s.to_string()).collect()),
        };
        assert!(requirement_matches(&r("In", &["a"]), Some("a")));
        assert!(!requirement_matches(&r("In", &["a"]), None));
        assert!(requirement_matches(&r("NotIn", &["a"]), None));
        assert!(requirement_matches(&r("Exists", &[]), Some("")));
        assert!(requirement_matches(&r("DoesNotExist", &[]), None));
        assert!(requirement_matches(&r("Gt", &["3"]), Some("4")));
        assert!(!requirement_matches(&r("Lt", &["3"]), Some("4")));
    }
}
