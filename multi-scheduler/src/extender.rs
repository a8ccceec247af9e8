//! The kube-scheduler extender protocol (k8s.io/kube-scheduler `extender/v1`) and the
//! answers to its `filter` and `prioritize` verbs, apart from HTTP.
//!
//! The Go types carry no json tags, so the keys are the Go field names: `Pod`, `Nodes`,
//! `NodeNames` in; `NodeNames` or `Nodes`, `FailedNodes`, `FailedAndUnresolvableNodes`,
//! `Error` out for a filter; `[{"Host","Score"}]` for a prioritize. A scheduler configured
//! with `nodeCacheCapable: true` sends node names only, and the nodes are read from this
//! process's watch cache ([`View`]); otherwise it sends whole Nodes, and the answer names
//! a subset of them in the same form.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use serde::{Deserialize, Serialize};
use tensile_common::quantity::ResourceMap;

use crate::context::{self, Context, NodeFacts, exclusions_for};
use crate::preempt;
use tensile_common::fit::{self, Judgement, PodFacts, Verdict};

/// The highest score an extender may give (`MaxExtenderPriority`).
pub const MAX_SCORE: i64 = 10;

/// A node list as the scheduler writes one (`v1.NodeList`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NodeList {
    #[serde(default)]
    pub metadata: ListMeta,
    #[serde(default)]
    pub items: Vec<Node>,
}

/// The request of both verbs.
#[derive(Clone, Debug, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod")]
    pub pod: Pod,
    /// The candidate nodes, when the extender is not node-cache-capable.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// The candidate node names, when it is.
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

/// The answer to `filter`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeListOut>,
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    /// Rejected node → why.
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Read from 1.21 on, where it takes precedence over `FailedNodes` and preemption skips
    /// these nodes: the rejections no preemption of upper pods can resolve, also listed in
    /// `FailedNodes` for 1.20.
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error")]
    pub error: String,
}

/// The node list of a filter answer: the passing nodes as they came.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeListOut {
    pub metadata: serde_json::Value,
    pub items: Vec<serde_json::Value>,
}

/// One entry of the answer to `prioritize` (`HostPriorityList`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    #[serde(rename = "Score")]
    pub score: i64,
}

/// How prioritize ranks the nodes that fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Score {
    /// Prefer the lower node the pod fills most (fewer, fuller nodes; large holes kept).
    Binpack,
    /// Prefer the lower node with the most room left.
    Spread,
}

/// Why the request cannot be answered (a 400).
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    #[error("the body is not ExtenderArgs JSON: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("ExtenderArgs has neither Nodes nor NodeNames")]
    NoNodes,
}

impl ExtenderArgs {
    pub fn decode(body: &[u8]) -> Result<Self, BadRequest> {
        let args: Self = serde_json::from_slice(body)?;
        if args.nodes.is_none() && args.node_names.is_none() {
            return Err(BadRequest::NoNodes);
        }
        Ok(args)
    }
}

/// What the filter decided for one node, for the metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Passed: not a virtual node (or one the cache does not know yet), or a fit.
    Passed,
    FailOpen(&'static str),
    /// Rejected, with the reason label: `shape` or `exclusion`.
    Rejected(&'static str),
}

/// A candidate node as the request named it.
enum Candidate<'a> {
    Name(&'a str),
    Node(&'a Node),
}

impl Candidate<'_> {
    fn name(&self) -> &str {
        match self {
            Candidate::Name(n) => n,
            Candidate::Node(n) => n.metadata.name.as_deref().unwrap_or_default(),
        }
    }
}

fn candidates(args: &ExtenderArgs) -> Vec<Candidate<'_>> {
    match (&args.node_names, &args.nodes) {
        (Some(names), _) => names.iter().map(|n| Candidate::Name(n)).collect(),
        (None, Some(list)) => list.items.iter().map(Candidate::Node).collect(),
        (None, None) => Vec::new(),
    }
}

/// What the filter knows of a candidate that is a virtual node (`None`: not one, or one
/// the cache does not know yet).
fn virtual_facts(candidate: &Candidate<'_>, ctx: &Context<'_>) -> Option<Arc<NodeFacts>> {
    let facts = match candidate {
        Candidate::Node(node) => Some(ctx.facts.facts(node)),
        Candidate::Name(n) => ctx.view.node(n).map(|node| ctx.facts.facts(&node)),
    };
    facts.filter(|f| f.virtual_node)
}

/// The judgement of one node for the pod, with the exclusion applied first.
fn judge_node(
    candidate: &Candidate<'_>,
    pod: &PodFacts,
    excluded: &BTreeMap<String, String>,
    ctx: &Context<'_>,
) -> (Option<Judgement>, Outcome, Option<String>) {
    let name = candidate.name();
    let Some(facts) = virtual_facts(candidate, ctx) else {
        return (None, Outcome::Passed, None);
    };
    if let Some(message) = excluded.get(name) {
        return (None, Outcome::Rejected("exclusion"), Some(message.clone()));
    }
    let judgement = fit::judge(pod, facts.shape.as_ref(), &ctx.options);
    let (outcome, message) = match &judgement.verdict {
        Verdict::NotVirtual | Verdict::Fits => (Outcome::Passed, None),
        Verdict::FailOpen(f) => (Outcome::FailOpen(f.reason()), None),
        Verdict::Rejected(m) => (Outcome::Rejected("shape"), Some(m.clone())),
    };
    (Some(judgement), outcome, message)
}

/// Answers `filter`: the passing candidates in the form they came, the rejected ones with
/// the reason; and the outcome of each node, in order, for the metrics.
///
/// A rejected node is also in `FailedAndUnresolvableNodes` when no preemption of upper
/// pods could resolve it (see [`crate::preempt`]): an exclusion, or a shape that holds the
/// pod on no lower node even with every upper pod of lower priority bound there evicted.
/// 1.21 and later skip those nodes in preemption; 1.20 reads only `FailedNodes`, which
/// lists every rejected node.
pub fn filter(args: &ExtenderArgs, ctx: &Context<'_>) -> (ExtenderFilterResult, Vec<Outcome>) {
    let pod = PodFacts::of(&args.pod);
    let excluded = exclusions_for(&args.pod, ctx.exclusions, ctx.options.now);
    let mut result = ExtenderFilterResult::default();
    let mut outcomes = Vec::new();
    let mut passed_names = Vec::new();
    let mut passed_nodes = Vec::new();
    // Read from the pod cache only when a shape rejects a node, once per request.
    let mut evictable: Option<HashMap<String, ResourceMap>> = None;
    for candidate in candidates(args) {
        let (_, outcome, message) = judge_node(&candidate, &pod, &excluded, ctx);
        match message {
            Some(m) => {
                let unresolvable = outcome == Outcome::Rejected("exclusion") || {
                    let freed = evictable.get_or_insert_with(|| {
                        context::evictable(&ctx.pods.bound(), context::priority_of(&args.pod))
                    });
                    virtual_facts(&candidate, ctx).is_some_and(|facts| {
                        !preempt::resolvable(&pod, &facts, freed.get(candidate.name()), ctx)
                    })
                };
                if unresolvable {
                    result
                        .failed_and_unresolvable_nodes
                        .insert(candidate.name().to_owned(), m.clone());
                }
                result.failed_nodes.insert(candidate.name().to_owned(), m);
            }
            None => match candidate {
                Candidate::Name(n) => passed_names.push(n.to_owned()),
                Candidate::Node(n) => passed_nodes.push(n),
            },
        }
        outcomes.push(outcome);
    }
    if args.node_names.is_some() {
        result.node_names = Some(passed_names);
    } else {
        let items = passed_nodes
            .into_iter()
            .filter_map(|n| serde_json::to_value(n).ok())
            .collect();
        result.nodes = Some(NodeListOut {
            metadata: serde_json::json!({}),
            items,
        });
    }
    (result, outcomes)
}

/// A node's score, 0 to [`MAX_SCORE`], from the shares of the frontier vectors that hold
/// the pod (none: 0): the tightest for binpack, the roomiest for spread.
pub fn score_of(shares: &[f64], score: Score) -> i64 {
    let best = match score {
        Score::Binpack => shares.iter().copied().reduce(f64::max),
        Score::Spread => shares.iter().copied().reduce(f64::min).map(|s| 1.0 - s),
    };
    best.map_or(0, |b| (b * MAX_SCORE as f64).round() as i64)
}

/// Answers `prioritize`: every candidate, scored 0 to [`MAX_SCORE`] by the frontier
/// vector that holds the pod best for `score`; a node no vector answers for (not virtual,
/// excluded, rejected or judged open) scores 0.
pub fn prioritize(args: &ExtenderArgs, ctx: &Context<'_>, score: Score) -> Vec<HostPriority> {
    let pod = PodFacts::of(&args.pod);
    let excluded = exclusions_for(&args.pod, ctx.exclusions, ctx.options.now);
    candidates(args)
        .iter()
        .map(|candidate| {
            let (judgement, _, _) = judge_node(candidate, &pod, &excluded, ctx);
            let shares = judgement.map(|j| j.shares).unwrap_or_default();
            HostPriority {
                host: candidate.name().to_owned(),
                score: score_of(&shares, score),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{BoundPod, BoundPods, FactsCache, View};
    use serde_json::{Value, json};
    use tensile_common::exclusion::Exclusions;
    use tensile_common::fit::Options;
    use tensile_common::names;
    use tensile_common::shape::{DEFAULT_GROUP_CAP, build};

    fn now() -> jiff::Timestamp {
        "2024-05-01T10:00:00Z".parse().unwrap()
    }

    fn lower(name: &str, cpu: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"allocatable": {"cpu": cpu, "memory": "16Gi", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap()
    }

    fn virtual_node(name: &str, cpus: &[&str]) -> Node {
        let lowers: Vec<Node> = cpus
            .iter()
            .enumerate()
            .map(|(i, c)| lower(&format!("n{i}"), c))
            .collect();
        let shape = build(&lowers, [], &[], DEFAULT_GROUP_CAP, now())
            .encode()
            .unwrap();
        serde_json::from_value(json!({
            "metadata": {"name": name, "resourceVersion": "1",
                         "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE},
                         "annotations": {names::NODE_CAPACITY_SHAPE: shape}},
        }))
        .unwrap()
    }

    fn plain_node(name: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
    }

    struct Nodes(Vec<Node>);

    pub(crate) struct NoPods;

    impl BoundPods for NoPods {
        fn bound(&self) -> Vec<Arc<BoundPod>> {
            Vec::new()
        }
    }

    impl View for Nodes {
        fn node(&self, name: &str) -> Option<Arc<Node>> {
            self.0
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name))
                .map(|n| Arc::new(n.clone()))
        }
    }

    fn nodes() -> Nodes {
        Nodes(vec![
            virtual_node("vn-a", &["2", "2", "2"]),
            virtual_node("vn-b", &["8"]),
        ])
    }

    fn pod(cpu: &str, owner: Option<&str>) -> Value {
        let owners = owner.map(|uid| {
            json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web",
                                             "uid": uid, "controller": true}])
        });
        json!({"metadata": {"name": "p", "namespace": "ns", "ownerReferences": owners},
               "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]}})
    }

    fn run(body: Value, view: &Nodes, exclusions: &Exclusions) -> (Value, Vec<Outcome>) {
        let args = ExtenderArgs::decode(body.to_string().as_bytes()).unwrap();
        let facts = FactsCache::default();
        let ctx = Context {
            view,
            pods: &NoPods,
            facts: &facts,
            exclusions,
            options: Options {
                now: now(),
                max_age: None,
            },
        };
        let (result, outcomes) = filter(&args, &ctx);
        (serde_json::to_value(result).unwrap(), outcomes)
    }

    #[test]
    fn node_names_in_give_the_passing_subset_out_with_the_reason_for_the_rest() {
        let body = json!({"Pod": pod("6", None), "Nodes": null, "NodeNames": ["vn-a", "vn-b", "worker-1"]});
        let (out, outcomes) = run(body, &nodes(), &Exclusions::default());
        assert_eq!(
            out,
            json!({
                "Nodes": null,
                "NodeNames": ["vn-b", "worker-1"],
                "FailedNodes": {"vn-a": "no lower node fits cpu=6 (largest free 2)"},
                // No upper pod is bound to vn-a: evicting nothing frees nothing.
                "FailedAndUnresolvableNodes": {"vn-a": "no lower node fits cpu=6 (largest free 2)"},
                "Error": "",
            })
        );
        assert_eq!(
            outcomes,
            [Outcome::Rejected("shape"), Outcome::Passed, Outcome::Passed]
        );
    }

    #[test]
    fn whole_nodes_in_give_whole_nodes_out() {
        let view = Nodes(Vec::new());
        let items: Vec<Value> = nodes()
            .0
            .iter()
            .map(|n| serde_json::to_value(n).unwrap())
            .collect();
        let body =
            json!({"Pod": pod("6", None), "Nodes": {"metadata": {}, "items": items}, "NodeNames": null});
        let (out, _) = run(body, &view, &Exclusions::default());
        assert_eq!(out["NodeNames"], Value::Null);
        let names: Vec<&str> = out["Nodes"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["vn-b"]);
        assert_eq!(out["Nodes"]["items"][0], items[1], "the node as it came");
        assert!(out["FailedNodes"]["vn-a"].as_str().unwrap().contains("cpu=6"));
    }

    #[test]
    fn a_virtual_node_excluded_for_the_pods_workload_is_rejected_until_the_exclusion_ends() {
        let record = json!({"namespace": "ns", "kind": "ReplicaSet", "name": "web", "moves": 1,
                            "nodes": {"vn-b": "2024-05-01T10:05:00Z"}, "expires": "2024-05-01T10:10:00Z"});
        let cm =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {"uid-1": record.to_string()}}))
                .unwrap();
        let exclusions = Exclusions::from_config_map(&cm);
        let body = json!({"Pod": pod("1", Some("uid-1")), "NodeNames": ["vn-a", "vn-b"]});
        let (out, outcomes) = run(body, &nodes(), &exclusions);
        assert_eq!(out["NodeNames"], json!(["vn-a"]));
        assert_eq!(
            out["FailedNodes"]["vn-b"],
            "excluded for ReplicaSet ns/web until 2024-05-01T10:05:00Z: its lower cluster refused the workload"
        );
        assert_eq!(outcomes[1], Outcome::Rejected("exclusion"));
        assert_eq!(
            out["FailedAndUnresolvableNodes"]["vn-b"], out["FailedNodes"]["vn-b"],
            "1.21 and later skip it in preemption; 1.20 reads FailedNodes"
        );
        let other = json!({"Pod": pod("1", Some("uid-2")), "NodeNames": ["vn-a", "vn-b"]});
        assert_eq!(
            run(other, &nodes(), &exclusions).0["NodeNames"],
            json!(["vn-a", "vn-b"])
        );
    }

    #[test]
    fn a_pod_its_volume_pins_to_an_excluded_node_is_never_refused_by_the_exclusion() {
        let record = json!({"namespace": "ns", "kind": "StatefulSet", "name": "db", "moves": 1,
                            "nodes": {"vn-b": "2024-05-01T10:05:00Z"}, "expires": "2024-05-01T10:10:00Z"});
        let cm =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {"uid-1": record.to_string()}}))
                .unwrap();
        let exclusions = Exclusions::from_config_map(&cm);
        let mut pinned = pod("1", Some("uid-1"));
        pinned["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vn-b"]}]}]}}});
        let body = json!({"Pod": pinned, "NodeNames": ["vn-b"]});
        let (out, outcomes) = run(body, &nodes(), &exclusions);
        assert_eq!(out["NodeNames"], json!(["vn-b"]), "{out}");
        assert_eq!(outcomes, [Outcome::Passed]);
        // The standalone scheduler reads the same exclusions.
        let pinned: Pod = serde_json::from_value(pinned).unwrap();
        assert!(exclusions_for(&pinned, &exclusions, now()).is_empty());
        let sibling: Pod = serde_json::from_value(pod("1", Some("uid-1"))).unwrap();
        assert_eq!(
            exclusions_for(&sibling, &exclusions, now())
                .keys()
                .collect::<Vec<_>>(),
            ["vn-b"],
            "an unpinned sibling is still kept off"
        );
    }

    #[test]
    fn prioritize_scores_the_tightest_fit_highest_for_binpack_and_lowest_for_spread() {
        let view = Nodes(vec![
            virtual_node("vn-a", &["2"]),
            virtual_node("vn-b", &["8"]),
            plain_node("w"),
        ]);
        let facts = FactsCache::default();
        let exclusions = Exclusions::default();
        let ctx = Context {
            view: &view,
            pods: &NoPods,
            facts: &facts,
            exclusions: &exclusions,
            options: Options {
                now: now(),
                max_age: None,
            },
        };
        let body = json!({"Pod": pod("2", None), "NodeNames": ["vn-a", "vn-b", "w", "unknown"]});
        let args = ExtenderArgs::decode(body.to_string().as_bytes()).unwrap();
        let scores = |s| -> Vec<(String, i64)> {
            prioritize(&args, &ctx, s)
                .into_iter()
                .map(|h| (h.host, h.score))
                .collect()
        };
        let pairs = |v: &[(&str, i64)]| -> Vec<(String, i64)> {
            v.iter().map(|(h, s)| (h.to_string(), *s)).collect()
        };
        assert_eq!(
            scores(Score::Binpack),
            pairs(&[("vn-a", 10), ("vn-b", 3), ("w", 0), ("unknown", 0)])
        );
        assert_eq!(
            scores(Score::Spread),
            pairs(&[("vn-a", 0), ("vn-b", 8), ("w", 0), ("unknown", 0)])
        );
        let out = serde_json::to_value(prioritize(&args, &ctx, Score::Binpack)).unwrap();
        assert_eq!(out[0], json!({"Host": "vn-a", "Score": 10}));
    }

    #[test]
    fn a_request_without_nodes_or_that_is_not_json_is_a_bad_request() {
        let err = ExtenderArgs::decode(br#"{"Pod": {}}"#).unwrap_err();
        assert_eq!(err.to_string(), "ExtenderArgs has neither Nodes nor NodeNames");
        let err = ExtenderArgs::decode(b"{nope").unwrap_err().to_string();
        assert!(err.starts_with("the body is not ExtenderArgs JSON"), "{err}");
        assert!(!err.contains('\n'));
    }

    #[test]
    fn the_shape_is_decoded_once_per_version_of_the_node() {
        let cache = FactsCache::default();
        let mut node = virtual_node("vn-a", &["2"]);
        let first = cache.facts(&node);
        assert!(Arc::ptr_eq(&first, &cache.facts(&node)));
        node.metadata.resource_version = Some("2".into());
        let second = cache.facts(&node);
        assert!(!Arc::ptr_eq(&first, &second));
        cache.retain(|_| false);
        assert!(
            !Arc::ptr_eq(&second, &cache.facts(&node)),
            "a forgotten node is decoded anew"
        );
    }
}
