//! The virtual node's capacity, recomputed from watched lower state every time (never by
//! deltas, so nothing drifts and nothing is counted twice after a restart).
//!
//! * capacity = Σ allocatable of lower nodes that are Ready and schedulable;
//! * allocatable = capacity − requests of lower pods this node does not manage (its own
//!   pods are already counted by the upper scheduler against allocatable);
//! * shape = the free resources of the largest lower nodes, so a scheduler can tell "fits
//!   in aggregate" from "fits on one node".

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::{is_terminal, pod_requests};
use tensile_common::shape::usable;

use crate::translate::Identity;

/// How many of the largest lower nodes the shape lists.
pub const SHAPE_NODES: usize = 5;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub capacity: ResourceMap,
    pub allocatable: ResourceMap,
    /// Free resources of the largest usable lower nodes, largest first.
    pub shape: Vec<BTreeMap<String, String>>,
    pub usable_nodes: usize,
    pub os: Option<String>,
    pub arch: Option<String>,
}

fn allocatable(node: &Node) -> ResourceMap {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| ResourceMap::parse(a.iter().map(|(k, v)| (k, &v.0))).0)
        .unwrap_or_default()
}

/// Computes the capacity from the lower nodes and all lower pods.
pub fn compute<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pods: impl IntoIterator<Item = &'a Pod>,
    identity: &Identity,
) -> Capacity {
    let mut out = Capacity::default();
    let mut per_node: BTreeMap<String, (ResourceMap, ResourceMap)> = BTreeMap::new();
    for node in nodes {
        if !usable(node) {
            continue;
        }
        let name = node.metadata.name.clone().unwrap_or_default();
        let alloc = allocatable(node);
        out.capacity.add(&alloc);
        out.usable_nodes += 1;
        if out.os.is_none() {
            let labels = node.metadata.labels.as_ref();
            out.os = labels.and_then(|l| l.get("kubernetes.io/os")).cloned();
            out.arch = labels.and_then(|l| l.get("kubernetes.io/arch")).cloned();
        }
        per_node.insert(name, (alloc, ResourceMap::default()));
    }
    let mut foreign = ResourceMap::default();
    for pod in pods {
        if is_terminal(pod) {
            continue;
        }
        let Some(entry) = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .and_then(|n| per_node.get_mut(n))
        else {
            continue;
        };
        let requests = pod_requests(pod);
        entry.1.add(&requests);
        if !identity.owns(&pod.metadata) {
            foreign.add(&requests);
        }
    }
    out.allocatable = out.capacity.clone();
    out.allocatable.saturating_sub(&foreign);

    let mut free: Vec<ResourceMap> = per_node
        .into_values()
        .map(|(mut alloc, used)| {
            alloc.saturating_sub(&used);
            alloc
        })
        .collect();
    free.sort_by_key(|f| std::cmp::Reverse((f.get("cpu"), f.get("memory"))));
    out.shape = free
        .iter()
        .take(SHAPE_NODES)
        .map(ResourceMap::to_strings)
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tensile_common::names;

    fn node(name: &str, cpu: &str, ready: bool, unschedulable: bool) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
            "spec": {"unschedulable": unschedulable},
            "status": {
                "capacity": {"cpu": "64", "memory": "64Gi", "pods": "110"},
                "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110", "example.com/gpu": "2"},
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn pod(node: &str, cpu: &str, ours: bool, phase: &str) -> Pod {
        let labels = if ours {
            json!({names::MARK_CLUSTER: "c", names::MARK_NODE: "vn"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "p", "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn id() -> Identity {
        Identity {
            cluster_id: "c".into(),
            node: "vn".into(),
        }
    }

    #[test]
    fn capacity_counts_usable_allocatable_and_subtracts_only_foreign_pods() {
        let nodes = [
            node("a", "4", true, false),
            node("b", "8", true, false),
            node("down", "16", false, false),
            node("cordoned", "16", true, true),
        ];
        let pods = [
            pod("a", "1", false, "Running"),
            pod("b", "2", true, "Running"),
            pod("b", "3", false, "Succeeded"),
            pod("down", "5", false, "Running"),
            pod("", "7", false, "Pending"),
        ];
        let c = compute(&nodes, &pods, &id());
        assert_eq!(c.usable_nodes, 2);
        assert_eq!(
            c.capacity.get("cpu"),
            12_000,
            "allocatable, not capacity, of usable nodes"
        );
        assert_eq!(
            c.capacity.get("example.com/gpu"),
            4_000,
            "extended resources carried"
        );
        assert_eq!(
            c.allocatable.get("cpu"),
            11_000,
            "foreign running pod subtracted, ours not"
        );
        assert_eq!(c.allocatable.get("pods"), 219_000);
        assert_eq!(c.os.as_deref(), Some("linux"));
        // Shape: per-node free resources, ours included, largest first.
        assert_eq!(c.shape.len(), 2);
        assert_eq!(c.shape[0]["cpu"], "6");
        assert_eq!(c.shape[1]["cpu"], "3");
    }

    #[test]
    fn the_same_state_gives_the_same_answer() {
        let nodes = [node("a", "4", true, false)];
        let pods = [pod("a", "1", false, "Running")];
        assert_eq!(compute(&nodes, &pods, &id()), compute(&nodes, &pods, &id()));
    }
}
