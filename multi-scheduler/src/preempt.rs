//! The extender's part in preemption: which rejections preempting upper pods could
//! resolve, and the `preempt` verb (k8s.io/kube-scheduler `extender/v1`), apart from HTTP.
//!
//! kube-scheduler picks victims by the virtual node's aggregate allocatable, which says
//! nothing about single lower nodes. Evicting an upper pod frees, on the one lower node its
//! lower pod ran on, what it requested, so after evicting a set of pods a lower node has at
//! most its free resources plus all of their requests. That bound
//! ([`ShapeFacts::freeing`](tensile_common::fit::ShapeFacts::freeing)) decides both:
//!
//! * **filter**: a virtual node the shape rejects is *unresolvable* when even evicting every
//!   upper pod of lower priority bound to it leaves no lower node that holds the pod (or the
//!   rejection is about labels, taints or usable nodes, which no eviction changes); an
//!   exclusion is always unresolvable;
//! * **preempt**: kube-scheduler's candidates are kept only where evicting the proposed
//!   victims could make some lower node hold the pod; the others are dropped, so their pods
//!   are never evicted for nothing. The victims themselves are kept as proposed: which
//!   lower node each runs on is not published, so the extender cannot choose better ones.
//!
//! The bound is sound but not tight: it may keep a node where the victims run on different
//! lower nodes and none would hold the pod. A node it cannot judge (no shape, a stale one, a
//! victim this process does not know) is kept, as the filter fails open.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::pod_requests;

use crate::context::{BoundPod, BoundPods, Context, NodeFacts, exclusions_for};
use tensile_common::fit::{self, PodFacts};

/// A victim as kube-scheduler names it to a node-cache-capable extender (`MetaPod`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    #[serde(rename = "UID")]
    pub uid: String,
}

/// A list Go may encode as `null` (a nil slice): read as empty.
fn null_as_empty<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

/// The victims of one node, by UID (`MetaVictims`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    #[serde(rename = "Pods", default, deserialize_with = "null_as_empty")]
    pub pods: Vec<MetaPod>,
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// The victims of one node, whole (`Victims`), sent to an extender that is not
/// node-cache-capable.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Victims {
    #[serde(rename = "Pods", default, deserialize_with = "null_as_empty")]
    pub pods: Vec<Pod>,
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// The request of `preempt` (`ExtenderPreemptionArgs`): the preemptor and, per candidate
/// node, the victims kube-scheduler chose, whole or by UID.
#[derive(Clone, Debug, Deserialize)]
pub struct ExtenderPreemptionArgs {
    #[serde(rename = "Pod")]
    pub pod: Pod,
    #[serde(rename = "NodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    #[serde(rename = "NodeNameToMetaVictims", default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

/// The answer to `preempt` (`ExtenderPreemptionResult`): always by UID, whatever the
/// request held; a subset of the request's nodes, their victims unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderPreemptionResult {
    #[serde(rename = "NodeNameToMetaVictims")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// Why a preemption request cannot be answered (a 400).
#[derive(Debug, thiserror::Error)]
pub enum BadPreemption {
    #[error("the body is not ExtenderPreemptionArgs JSON: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("ExtenderPreemptionArgs has neither NodeNameToVictims nor NodeNameToMetaVictims")]
    NoNodes,
}

impl ExtenderPreemptionArgs {
    pub fn decode(body: &[u8]) -> Result<Self, BadPreemption> {
        let args: Self = serde_json::from_slice(body)?;
        if args.node_name_to_victims.is_none() && args.node_name_to_meta_victims.is_none() {
            return Err(BadPreemption::NoNodes);
        }
        Ok(args)
    }

    /// Each node's victims by UID, with their requests where known (`None`: a victim
    /// neither sent whole nor in the pod cache).
    fn candidates(&self, pods: &dyn BoundPods) -> Vec<(String, MetaVictims, Option<ResourceMap>)> {
        if let Some(map) = &self.node_name_to_meta_victims {
            let by_uid: HashMap<String, Arc<BoundPod>> = if map.is_empty() {
                HashMap::new()
            } else {
                pods.bound()
                    .into_iter()
                    .map(|p| (p.uid().to_owned(), p))
                    .collect()
            };
            return map
                .iter()
                .map(|(node, victims)| {
                    let victims = victims.clone().unwrap_or_default();
                    let freed = victims
                        .pods
                        .iter()
                        .try_fold(ResourceMap::default(), |mut sum, v| {
                            let pod = by_uid.get(&v.uid).filter(|p| p.node == *node)?;
                            sum.add(&pod.requests);
                            Some(sum)
                        });
                    (node.clone(), victims, freed)
                })
                .collect();
        }
        self.node_name_to_victims
            .iter()
            .flatten()
            .map(|(node, victims)| {
                let whole = victims.as_ref();
                let mut freed = ResourceMap::default();
                let mut meta = MetaVictims {
                    pods: Vec::new(),
                    num_pdb_violations: whole.map_or(0, |v| v.num_pdb_violations),
                };
                for pod in whole.iter().flat_map(|v| &v.pods) {
                    freed.add(&pod_requests(pod));
                    meta.pods.push(MetaPod {
                        uid: pod.metadata.uid.clone().unwrap_or_default(),
                    });
                }
                (node.clone(), meta, Some(freed))
            })
            .collect()
    }
}

/// What `preempt` decided for one candidate node, for the metrics and the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Kept: not a virtual node, or evicting the victims could make a lower node hold the
    /// pod, or the extender cannot tell (`reason` says why).
    Kept(&'static str),
    /// Dropped: excluded, or no lower node would hold the pod after evicting the victims.
    Dropped(&'static str),
}

/// Answers `preempt`: the candidates where evicting the proposed victims could let the pod
/// run below, with their victims as proposed; and each node's decision, in node order.
pub fn preempt(
    args: &ExtenderPreemptionArgs,
    ctx: &Context<'_>,
    pods: &dyn BoundPods,
) -> (ExtenderPreemptionResult, Vec<(String, Decision)>) {
    let pod = PodFacts::of(&args.pod);
    let excluded = exclusions_for(&args.pod, ctx.exclusions, ctx.options.now);
    let mut result = ExtenderPreemptionResult::default();
    let mut decisions = Vec::new();
    for (node, victims, freed) in args.candidates(pods) {
        let decision = decide(&node, &pod, freed.as_ref(), &excluded, ctx);
        if matches!(decision, Decision::Kept(_)) {
            result.node_name_to_meta_victims.insert(node.clone(), victims);
        }
        decisions.push((node, decision));
    }
    (result, decisions)
}

fn decide(
    node: &str,
    pod: &PodFacts,
    freed: Option<&ResourceMap>,
    excluded: &BTreeMap<String, String>,
    ctx: &Context<'_>,
) -> Decision {
    let Some(facts) = ctx
        .view
        .node(node)
        .map(|n| ctx.facts.facts(&n))
        .filter(|f| f.virtual_node)
    else {
        return Decision::Kept("not_virtual");
    };
    if excluded.contains_key(node) {
        return Decision::Dropped("exclusion");
    }
    let Some(freed) = freed else {
        return Decision::Kept("unknown_victim");
    };
    let shape = facts
        .shape
        .as_ref()
        .map(|s| s.as_ref().map(|f| f.freeing(freed)).map_err(Clone::clone));
    if fit::judge(pod, shape.as_ref(), &ctx.options).verdict.passes() {
        Decision::Kept("may_fit")
    } else {
        Decision::Dropped("shape")
    }
}

/// Whether preempting upper pods could resolve the shape's rejection of a virtual node
/// for `pod`: some lower node holds it once `evictable` (what every preemptable pod bound
/// there requested) is freed. `None` (no shape facts) counts as resolvable.
pub fn resolvable(
    pod: &PodFacts,
    facts: &NodeFacts,
    evictable: Option<&ResourceMap>,
    ctx: &Context<'_>,
) -> bool {
    let empty = ResourceMap::default();
    let freed = evictable.unwrap_or(&empty);
    let shape = facts
        .shape
        .as_ref()
        .map(|s| s.as_ref().map(|f| f.freeing(freed)).map_err(Clone::clone));
    fit::judge(pod, shape.as_ref(), &ctx.options).verdict.passes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{FactsCache, View, evictable};
    use crate::extender::{ExtenderArgs, filter as filter_verb};
    use k8s_openapi::api::core::v1::Node;
    use serde_json::{Value, json};
    use tensile_common::exclusion::Exclusions;
    use tensile_common::fit::Options;
    use tensile_common::names;
    use tensile_common::shape::{DEFAULT_GROUP_CAP, build};

    fn now() -> jiff::Timestamp {
        "2024-05-01T10:00:00Z".parse().unwrap()
    }

    /// A virtual node whose lower nodes have `free` CPUs each.
    fn virtual_node(name: &str, free: &[&str]) -> Node {
        let lowers: Vec<Node> = free
            .iter()
            .enumerate()
            .map(|(i, c)| {
                serde_json::from_value(json!({
                    "metadata": {"name": format!("{name}-{i}"),
                                 "labels": {"topology.kubernetes.io/zone": "z1"}},
                    "status": {"allocatable": {"cpu": c, "memory": "16Gi", "pods": "110"},
                               "conditions": [{"type": "Ready", "status": "True"}]},
                }))
                .unwrap()
            })
            .collect();
        let keys = ["topology.kubernetes.io/zone".to_owned()];
        let shape = build(&lowers, [], &keys, DEFAULT_GROUP_CAP, now())
            .encode()
            .unwrap();
        serde_json::from_value(json!({
            "metadata": {"name": name, "resourceVersion": "1",
                         "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE},
                         "annotations": {names::NODE_CAPACITY_SHAPE: shape}},
        }))
        .unwrap()
    }

    struct Bed {
        nodes: Vec<Node>,
        pods: Vec<Arc<BoundPod>>,
    }

    impl View for Bed {
        fn node(&self, name: &str) -> Option<Arc<Node>> {
            self.nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name))
                .map(|n| Arc::new(n.clone()))
        }
    }

    impl BoundPods for Bed {
        fn bound(&self) -> Vec<Arc<BoundPod>> {
            self.pods.clone()
        }
    }

    /// An upper pod as the apiserver has it once admitted (priority resolved), JSON.
    fn pod_json(name: &str, uid: &str, cpu: &str, priority: i32, node: Option<&str>) -> Value {
        json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": node, "priority": priority,
                     "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
        })
    }

    fn bound(name: &str, uid: &str, cpu: &str, priority: i32, node: &str) -> Arc<BoundPod> {
        let pod: Pod = serde_json::from_value(pod_json(name, uid, cpu, priority, Some(node))).unwrap();
        Arc::new(BoundPod::of(pod))
    }

    /// vn-a: two lower nodes with 1 CPU free, holding two upper pods of priority 0 (1 CPU
    /// each) and one of priority 2000; vn-b: one lower node with 4 CPUs free, holding an
    /// upper pod of 4 CPUs at priority 100; worker-1: not a virtual node.
    fn bed() -> Bed {
        Bed {
            nodes: vec![
                virtual_node("vn-a", &["1", "1"]),
                virtual_node("vn-b", &["4"]),
                serde_json::from_value(json!({"metadata": {"name": "worker-1"}})).unwrap(),
            ],
            pods: vec![
                bound("low-1", "u1", "1", 0, "vn-a"),
                bound("low-2", "u2", "1", 0, "vn-a"),
                bound("system", "u0", "3", 2000, "vn-a"),
                bound("medium", "u3", "4", 100, "vn-b"),
                bound("other", "u9", "1", 0, "worker-1"),
            ],
        }
    }

    fn with_ctx<T>(bed: &Bed, exclusions: &Exclusions, f: impl FnOnce(&Context<'_>) -> T) -> T {
        let facts = FactsCache::default();
        let ctx = Context {
            view: bed,
            pods: bed,
            facts: &facts,
            exclusions,
            options: Options {
                now: now(),
                max_age: None,
            },
        };
        f(&ctx)
    }

    /// A filter request as kube-scheduler sends it to a node-cache-capable extender; 1.20
    /// and 1.28 write the same keys.
    fn filter_json(bed: &Bed, pod: Value) -> Value {
        let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["vn-a", "vn-b", "worker-1"]});
        let args = ExtenderArgs::decode(body.to_string().as_bytes()).unwrap();
        let (result, _) = with_ctx(bed, &Exclusions::default(), |ctx| filter_verb(&args, ctx));
        serde_json::to_value(result).unwrap()
    }

    #[test]
    fn a_shape_rejection_no_eviction_of_lower_priority_upper_pods_can_lift_is_unresolvable() {
        let bed = bed();
        // 6 CPUs: vn-a's lower nodes have 1 free, and evicting both priority-0 pods frees
        // at most 2 more on one of them: never 6. vn-b: 4 free plus its 4-CPU pod: 8.
        let out = filter_json(&bed, pod_json("p", "up", "6", 1000, None));
        assert_eq!(out["NodeNames"], json!(["worker-1"]));
        assert_eq!(
            out["FailedNodes"],
            json!({"vn-a": "no lower node fits cpu=6 (largest free 1)",
                   "vn-b": "no lower node fits cpu=6 (largest free 4)"})
        );
        assert_eq!(
            out["FailedAndUnresolvableNodes"],
            json!({"vn-a": "no lower node fits cpu=6 (largest free 1)"}),
            "1.21+ skips vn-a in preemption; vn-b may still be freed by evicting its pod"
        );
    }

    #[test]
    fn only_pods_of_lower_priority_count_as_evictable() {
        let bed = bed();
        // 3 CPUs fit vn-a's 1 free plus its two 1-CPU pods, for a preemptor above them.
        let out = filter_json(&bed, pod_json("p", "up", "3", 1000, None));
        assert_eq!(
            out["FailedNodes"]["vn-a"],
            "no lower node fits cpu=3 (largest free 1)"
        );
        assert!(out["FailedAndUnresolvableNodes"].get("vn-a").is_none(), "{out}");
        // The same pod at priority 0 preempts nobody: nothing could free room for it.
        let out = filter_json(&bed, pod_json("p", "up", "3", 0, None));
        assert_eq!(
            out["FailedAndUnresolvableNodes"],
            json!({"vn-a": "no lower node fits cpu=3 (largest free 1)"})
        );
    }

    #[test]
    fn a_stash_no_lower_node_matches_is_unresolvable_whatever_could_be_evicted() {
        let bed = bed();
        let stash = json!({"nodeSelector": {"topology.kubernetes.io/zone": "z9"}}).to_string();
        let mut pod = pod_json("p", "up", "100m", 1000, None);
        pod["metadata"]["annotations"] = json!({names::CLUSTER_SELECTOR: stash});
        let out = filter_json(&bed, pod);
        let message = "no lower node matches the pod's stashed node selector and affinity";
        assert_eq!(
            out["FailedAndUnresolvableNodes"],
            json!({"vn-a": message, "vn-b": message})
        );
        assert_eq!(
            out["FailedNodes"], out["FailedAndUnresolvableNodes"],
            "1.20 reads FailedNodes"
        );
    }

    fn preempt_json(bed: &Bed, exclusions: &Exclusions, body: Value) -> (Value, Vec<(String, Decision)>) {
        let args = ExtenderPreemptionArgs::decode(body.to_string().as_bytes()).unwrap();
        let (result, decisions) = with_ctx(bed, exclusions, |ctx| preempt(&args, ctx, bed));
        (serde_json::to_value(result).unwrap(), decisions)
    }

    #[test]
    fn preempt_by_uid_keeps_only_nodes_where_the_victims_could_make_room_below() {
        let bed = bed();
        // As kube-scheduler sends it to a node-cache-capable extender (1.20 and 1.28 alike).
        let body = json!({
            "Pod": pod_json("p", "up", "6", 1000, None),
            "NodeNameToVictims": null,
            "NodeNameToMetaVictims": {
                "vn-a": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0},
                "vn-b": {"Pods": [{"UID": "u3"}], "NumPDBViolations": 1},
                "worker-1": {"Pods": [{"UID": "u9"}], "NumPDBViolations": 0},
            },
        });
        let (out, decisions) = preempt_json(&bed, &Exclusions::default(), body);
        assert_eq!(
            out,
            json!({"NodeNameToMetaVictims": {
                "vn-b": {"Pods": [{"UID": "u3"}], "NumPDBViolations": 1},
                "worker-1": {"Pods": [{"UID": "u9"}], "NumPDBViolations": 0},
            }}),
            "vn-a's victim frees 1 CPU on a lower node with 1 free: never 6"
        );
        assert_eq!(
            decisions,
            [
                ("vn-a".to_owned(), Decision::Dropped("shape")),
                ("vn-b".to_owned(), Decision::Kept("may_fit")),
                ("worker-1".to_owned(), Decision::Kept("not_virtual")),
            ]
        );
    }

    #[test]
    fn preempt_with_whole_pods_answers_by_uid_and_drops_a_node_with_no_victims() {
        let bed = bed();
        // As an extender that is not node-cache-capable gets it; 1.20 may name a node
        // where the pod fits the aggregate without evicting anyone (a nil list: null).
        let body = json!({
            "Pod": pod_json("p", "up", "2", 1000, None),
            "NodeNameToVictims": {
                "vn-a": {"Pods": [pod_json("low-1", "u1", "1", 0, Some("vn-a"))], "NumPDBViolations": 0},
                "vn-b": {"Pods": null, "NumPDBViolations": 0},
            },
            "NodeNameToMetaVictims": null,
        });
        let (out, _) = preempt_json(&bed, &Exclusions::default(), body);
        assert_eq!(
            out,
            json!({"NodeNameToMetaVictims": {
                "vn-a": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0},
                "vn-b": {"Pods": [], "NumPDBViolations": 0},
            }}),
            "vn-a: 1 free + 1 freed holds 2 CPUs; vn-b holds it without evictions"
        );
        let body = json!({
            "Pod": pod_json("p", "up", "6", 1000, None),
            "NodeNameToVictims": {"vn-a": {"Pods": null, "NumPDBViolations": 0}},
        });
        let (out, _) = preempt_json(&bed, &Exclusions::default(), body);
        assert_eq!(out, json!({"NodeNameToMetaVictims": {}}));
    }

    #[test]
    fn preempt_keeps_a_node_whose_victim_it_does_not_know_and_drops_an_excluded_one() {
        let bed = bed();
        let body = json!({
            "Pod": pod_json("p", "up", "6", 1000, None),
            "NodeNameToMetaVictims": {"vn-a": {"Pods": [{"UID": "not-cached"}]}},
        });
        let (_, decisions) = preempt_json(&bed, &Exclusions::default(), body);
        assert_eq!(decisions, [("vn-a".to_owned(), Decision::Kept("unknown_victim"))]);
        // A victim named on a node it is not bound to is unknown there, too.
        let body = json!({
            "Pod": pod_json("p", "up", "6", 1000, None),
            "NodeNameToMetaVictims": {"vn-a": {"Pods": [{"UID": "u3"}]}},
        });
        let (_, decisions) = preempt_json(&bed, &Exclusions::default(), body);
        assert_eq!(decisions, [("vn-a".to_owned(), Decision::Kept("unknown_victim"))]);

        let record = json!({"namespace": "ns", "kind": "ReplicaSet", "name": "web", "moves": 1,
                            "nodes": {"vn-b": "2024-05-01T10:05:00Z"}, "expires": "2024-05-01T10:10:00Z"});
        let cm = serde_json::from_value(
            json!({"metadata": {"name": "x"}, "data": {"rs-uid": record.to_string()}}),
        )
        .unwrap();
        let exclusions = Exclusions::from_config_map(&cm);
        let mut pod = pod_json("p", "up", "6", 1000, None);
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "rs-uid", "controller": true}]);
        let body = json!({"Pod": pod, "NodeNameToMetaVictims": {"vn-b": {"Pods": [{"UID": "u3"}]}}});
        let (out, decisions) = preempt_json(&bed, &exclusions, body);
        assert_eq!(out, json!({"NodeNameToMetaVictims": {}}));
        assert_eq!(decisions, [("vn-b".to_owned(), Decision::Dropped("exclusion"))]);
    }

    #[test]
    fn a_preemption_request_without_victims_or_that_is_not_json_is_a_bad_request() {
        let err = ExtenderPreemptionArgs::decode(br#"{"Pod": {}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "ExtenderPreemptionArgs has neither NodeNameToVictims nor NodeNameToMetaVictims"
        );
        let err = ExtenderPreemptionArgs::decode(b"[").unwrap_err().to_string();
        assert!(
            err.starts_with("the body is not ExtenderPreemptionArgs JSON"),
            "{err}"
        );
    }

    #[test]
    fn evictable_sums_lower_priority_pods_per_node_and_counts_them() {
        let sums = evictable(&bed().pods, 1000);
        assert_eq!(sums["vn-a"].get("cpu"), 2000, "the priority-2000 pod stays");
        assert_eq!(sums["vn-a"].get("pods"), 2000);
        assert_eq!(sums["vn-b"].get("cpu"), 4000);
        assert!(evictable(&bed().pods, 0).is_empty());
    }
}
