//! The standalone scheduler's decision for one pod, apart from the API: which virtual node
//! takes it, or why none does, in kube-scheduler's words ("0/3 nodes are available: …").
//!
//! A node takes the pod when it is Ready and not cordoned, the pod tolerates its
//! `NoSchedule`/`NoExecute` taints, its labels (and name) satisfy the pod's nodeSelector and
//! required node affinity, the pod's workload is not excluded from it, the pod fits what is
//! left of its allocatable (pods bound to it and pods just placed counted), and the filter
//! passes it by its capacity shape, with the pods placed since the shape was computed taken
//! out. Among those, the best score wins (the extender's prioritize), then the name.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use tensile_common::quantity::ResourceMap;

use crate::context::NodeFacts;
use crate::extender::{Outcome, Score, score_of};
use tensile_common::fit::{self, Options, PodFacts, Verdict};

/// A virtual node as one scheduling attempt sees it.
pub struct Candidate<'a> {
    pub node: &'a Node,
    pub facts: Arc<NodeFacts>,
    /// Requests of the non-terminal pods bound to the node and of pods placed on it that
    /// the watch does not show bound yet.
    pub requested: ResourceMap,
    /// Requests of the pods placed on it since its shape was computed.
    pub taken: Vec<ResourceMap>,
}

/// Where the pod goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    Node(String),
    /// No node takes it; the message says why, node by node, counted.
    Unschedulable(String),
}

/// Decides for `pod` among `candidates`; `excluded` maps the nodes its workload must avoid
/// to the reason. Returns the placement and each node's shape outcome, for the metrics.
pub fn place(
    pod: &Pod,
    candidates: &[Candidate<'_>],
    excluded: &BTreeMap<String, String>,
    options: &Options,
    score: Score,
) -> (Placement, Vec<Outcome>) {
    let facts = PodFacts::of(pod);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut outcomes = Vec::new();
    let mut best: Option<(i64, &str)> = None;
    for c in candidates {
        let name = c.node.metadata.name.as_deref().unwrap_or_default();
        let verdict = match upper_refusal(pod, c.node, &facts.requests, &c.requested) {
            Some(reason) => Err(reason),
            None => match excluded.get(name) {
                Some(message) => {
                    outcomes.push(Outcome::Rejected("exclusion"));
                    Err(message.clone())
                }
                None => {
                    let shape = c
                        .facts
                        .shape
                        .as_ref()
                        .map(|s| s.as_ref().map(|f| f.taking(&c.taken)).map_err(Clone::clone));
                    let judgement = fit::judge(&facts, shape.as_ref(), options);
                    match judgement.verdict {
                        Verdict::Rejected(m) => {
                            outcomes.push(Outcome::Rejected("shape"));
                            Err(m)
                        }
                        Verdict::FailOpen(f) => {
                            outcomes.push(Outcome::FailOpen(f.reason()));
                            Ok(0)
                        }
                        Verdict::NotVirtual | Verdict::Fits => Ok(score_of(&judgement.shares, score)),
                    }
                }
            },
        };
        match verdict {
            Err(reason) => *reasons.entry(reason).or_default() += 1,
            Ok(s) => {
                if best.is_none_or(|(b, n)| s > b || (s == b && name < n)) {
                    best = Some((s, name));
                }
            }
        }
    }
    let placement = match best {
        Some((_, name)) => Placement::Node(name.to_owned()),
        None => {
            let counted: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
            Placement::Unschedulable(format!(
                "0/{} nodes are available: {}.",
                candidates.len(),
                counted.join(", ")
            ))
        }
    };
    (placement, outcomes)
}

/// The inter-pod constraints of `pod` this scheduler does not honour, named as the pod
/// spells them (`None`: it has none): required pod affinity and anti-affinity, topology
/// spread constraints with `whenUnsatisfiable: DoNotSchedule`, and host ports. Each needs
/// the pods of every node in view, which kube-scheduler's plugins have and this scheduler
/// does not; placing such a pod anyway would silently break what it asked for. Preferences
/// (preferred affinity terms, `ScheduleAnyway`) are not constraints, and are ignored.
pub fn unsupported_constraints(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let affinity = spec.affinity.as_ref();
    let required = |terms: Option<&Vec<k8s_openapi::api::core::v1::PodAffinityTerm>>| {
        terms.is_some_and(|t| !t.is_empty())
    };
    let mut found = Vec::new();
    if required(
        affinity
            .and_then(|a| a.pod_affinity.as_ref())
            .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref()),
    ) {
        found.push("required pod affinity");
    }
    if required(
        affinity
            .and_then(|a| a.pod_anti_affinity.as_ref())
            .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref()),
    ) {
        found.push("required pod anti-affinity");
    }
    if spec
        .topology_spread_constraints
        .iter()
        .flatten()
        .any(|c| c.when_unsatisfiable == "DoNotSchedule")
    {
        found.push("topology spread constraints (DoNotSchedule)");
    }
    let host_port = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten())
        .any(|p| p.host_port.is_some_and(|h| h > 0));
    if host_port {
        found.push("host ports");
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// The message a pod with [`unsupported_constraints`] gets, for the scheduler `name`.
pub fn refusal(name: &str, constraints: &str) -> String {
    format!(
        "{name} places pods without the other pods in view, so it does not schedule a pod with {constraints}: \
         remove them, or give the pod to a kube-scheduler that runs the multi-scheduler extender \
         (its spec.schedulerName), whose plugins honour them"
    )
}

/// Why the node refuses the pod by what the upper scheduler checks; `None`: it does not.
fn upper_refusal(pod: &Pod, node: &Node, requests: &ResourceMap, requested: &ResourceMap) -> Option<String> {
    let spec = pod.spec.as_ref();
    let tolerations = spec.and_then(|s| s.tolerations.as_deref()).unwrap_or_default();
    if let Some(why) = fit::upper_refusal(
        node,
        tolerations,
        spec.and_then(|s| s.node_selector.as_ref()),
        spec.and_then(fit::required_terms),
    ) {
        return Some(why.scheduler_reason());
    }
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| ResourceMap::parse(a.iter().map(|(k, v)| (k, &v.0))).0)
        .unwrap_or_default();
    for (resource, want) in requests.0.iter().filter(|(_, q)| **q > 0) {
        if allocatable.get(resource) - requested.get(resource) < *want {
            return Some(if resource == "pods" {
                "Too many pods".into()
            } else {
                format!("Insufficient {resource}")
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::FactsCache;
    use serde_json::{Value, json};
    use tensile_common::names;
    use tensile_common::shape::{DEFAULT_GROUP_CAP, build};

    fn now() -> jiff::Timestamp {
        "2024-05-01T10:00:00Z".parse().unwrap()
    }

    fn virtual_node(name: &str, lower_cpus: &[&str], extra: Value) -> Node {
        let lowers: Vec<Node> = lower_cpus
            .iter()
            .enumerate()
            .map(|(i, c)| {
                serde_json::from_value(json!({
                    "metadata": {"name": format!("n{i}")},
                    "status": {"allocatable": {"cpu": c, "memory": "16Gi", "pods": "110"},
                               "conditions": [{"type": "Ready", "status": "True"}]},
                }))
                .unwrap()
            })
            .collect();
        let shape = build(&lowers, [], &[], DEFAULT_GROUP_CAP, now())
            .encode()
            .unwrap();
        let total: u32 = lower_cpus.iter().map(|c| c.parse::<u32>().unwrap()).sum();
        let mut node = json!({
            "metadata": {"name": name,
                         "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE,
                                    names::HOSTNAME_LABEL: name},
                         "annotations": {names::NODE_CAPACITY_SHAPE: shape}},
            "spec": {"taints": [{"key": names::VIRTUAL_NODE_TAINT, "value": "tensile", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": total.to_string(), "memory": "64Gi", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        });
        if let (Some(n), Some(e)) = (node.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                n.insert(k.clone(), v.clone());
            }
        }
        serde_json::from_value(node).unwrap()
    }

    fn pod(cpu: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "tolerations": [{"key": names::VIRTUAL_NODE_TAINT, "operator": "Exists"}],
                "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
            },
        }))
        .unwrap()
    }

    fn decide(pod: &Pod, nodes: &[Node], requested: &[&str], taken: &[Vec<&str>]) -> Placement {
        let cache = FactsCache::default();
        let candidates: Vec<Candidate<'_>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| Candidate {
                node: n,
                facts: cache.facts(n),
                requested: cpu_map(requested.get(i).copied().unwrap_or("0")),
                taken: taken.get(i).into_iter().flatten().map(|c| cpu_map(c)).collect(),
            })
            .collect();
        let options = Options {
            now: now(),
            max_age: None,
        };
        place(pod, &candidates, &BTreeMap::new(), &options, Score::Binpack).0
    }

    fn cpu_map(cpu: &str) -> ResourceMap {
        ResourceMap::parse([(&"cpu".to_owned(), &cpu.to_owned())]).0
    }

    #[test]
    fn a_pod_goes_where_a_lower_node_fits_it_and_otherwise_gets_the_reasons_counted() {
        let nodes = [
            virtual_node("vn-a", &["2", "2", "2", "2", "2", "2"], json!({})),
            virtual_node("vn-b", &["8"], json!({})),
        ];
        assert_eq!(
            decide(&pod("6"), &nodes, &[], &[]),
            Placement::Node("vn-b".into())
        );
        assert_eq!(
            decide(&pod("2"), &nodes, &[], &[]),
            Placement::Node("vn-a".into()),
            "binpack"
        );
        assert_eq!(
            decide(&pod("10"), &nodes, &[], &[]),
            Placement::Unschedulable(
                "0/2 nodes are available: 1 Insufficient cpu, 1 no lower node fits cpu=10 (largest free 2)."
                    .into()
            )
        );
    }

    #[test]
    fn pods_placed_since_the_shape_take_its_space_and_bound_pods_take_allocatable() {
        // Two 8-CPU lower nodes are one frontier vector: after a 6-CPU pod is placed, the
        // shape offers 2 CPUs until the next shape shows where that pod went.
        let nodes = [virtual_node("vn-b", &["8", "8"], json!({}))];
        assert_eq!(
            decide(&pod("6"), &nodes, &["6"], &[vec!["6"]]),
            Placement::Unschedulable(
                "0/1 nodes are available: 1 no lower node fits cpu=6 (largest free 2).".into()
            )
        );
        assert_eq!(
            decide(&pod("6"), &nodes, &["6"], &[]),
            Placement::Node("vn-b".into()),
            "a newer shape counted it"
        );
        assert_eq!(
            decide(&pod("2"), &nodes, &["6"], &[vec!["6"]]),
            Placement::Node("vn-b".into())
        );
        assert_eq!(
            decide(&pod("6"), &nodes, &["12"], &[]),
            Placement::Unschedulable("0/1 nodes are available: 1 Insufficient cpu.".into())
        );
    }

    #[test]
    fn inter_pod_constraints_are_named_and_preferences_are_not() {
        let with = |spec: Value| -> Pod {
            let mut spec = spec;
            spec["containers"] = json!([{"name": "c"}]);
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
        };
        let term =
            json!([{"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": names::HOSTNAME_LABEL}]);
        assert_eq!(unsupported_constraints(&pod("1")), None);
        let preferences = with(json!({
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": term[0]}]}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}],
        }));
        assert_eq!(
            unsupported_constraints(&preferences),
            None,
            "preferences are not constraints"
        );
        let all = with(json!({
            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": term},
                         "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": term}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "initContainers": [{"name": "i", "ports": [{"containerPort": 80, "hostPort": 8080}]}],
        }));
        let named = unsupported_constraints(&all).unwrap();
        assert_eq!(
            named,
            "required pod affinity, required pod anti-affinity, topology spread constraints (DoNotSchedule), host ports"
        );
        let mut ports = with(json!({}));
        ports.spec.as_mut().unwrap().containers[0].ports =
            serde_json::from_value(json!([{"containerPort": 80, "hostPort": 80}])).unwrap();
        assert_eq!(unsupported_constraints(&ports).as_deref(), Some("host ports"));
        let message = refusal("tensile-scheduler", &named);
        assert!(
            message.starts_with("tensile-scheduler places pods without the other pods in view"),
            "{message}"
        );
        assert!(
            message.contains("multi-scheduler extender"),
            "says what to do: {message}"
        );
    }

    #[test]
    fn upper_taints_selectors_and_readiness_are_checked_as_kube_scheduler_does() {
        let tainted = virtual_node(
            "vn-t",
            &["8"],
            json!({"spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]}}),
        );
        let not_ready = virtual_node(
            "vn-n",
            &["8"],
            json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        );
        let cordoned = virtual_node("vn-c", &["8"], json!({"spec": {"unschedulable": true}}));
        let mut p = pod("1");
        p.spec.as_mut().unwrap().node_selector = Some(BTreeMap::from([("tier".into(), "gold".into())]));
        let plain = virtual_node("vn-p", &["8"], json!({}));
        assert_eq!(
            decide(&p, &[tainted, not_ready, cordoned, plain], &[], &[]),
            Placement::Unschedulable(
                "0/4 nodes are available: 1 node(s) didn't match node selector, 1 node(s) had taint {dedicated: x}, \
                 that the pod didn't tolerate, 1 node(s) were not ready, 1 node(s) were unschedulable."
                    .into()
            )
        );
        let pinned: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "tolerations": [{"operator": "Exists"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vn-2"]}]}]}}},
                "containers": [{"name": "c"}],
            },
        }))
        .unwrap();
        let nodes = [
            virtual_node("vn-1", &["8"], json!({})),
            virtual_node("vn-2", &["8"], json!({})),
        ];
        assert_eq!(decide(&pinned, &nodes, &[], &[]), Placement::Node("vn-2".into()));
    }
}
