//! The capacity shape: what a virtual node publishes about its lower cluster's nodes, so a
//! scheduler can tell "fits on some lower node" from "fits in aggregate" without lower
//! credentials.
//!
//! Lower nodes that are Ready and schedulable are grouped by the values of a chosen set of
//! label keys and by their `NoSchedule`/`NoExecute` taints. Each group keeps the Pareto
//! frontier of its nodes' free resources (allocatable minus the requests of non-terminal
//! pods, every resource name, `pods` included): the vectors no other node beats on every
//! resource. Fit is monotone, so a pod fits some node of a group iff it fits a frontier
//! vector; the answer is exact unless the frontier was cut at the per-group cap, which the
//! group's `truncated` flag says.
//!
//! The annotation ([`NODE_CAPACITY_SHAPE`](crate::names::NODE_CAPACITY_SHAPE)) is JSON:
//!
//! ```json
//! {"v":2,"at":"2024-05-01T10:00:00Z","keys":["topology.kubernetes.io/zone"],"nodes":37,
//!  "truncated":false,
//!  "groups":[{"labels":{"topology.kubernetes.io/zone":"a"},
//!             "taints":[{"key":"gpu","effect":"NoSchedule"}],
//!             "count":4,"truncated":false,
//!             "free":[{"cpu":"6","memory":"20Gi","pods":"80"}]}]}
//! ```
//!
//! The first form (a bare list of free maps of the largest lower nodes, at most five, no
//! labels, no taints, no timestamp) still reads, as one group without labels or taints;
//! it is marked truncated when it holds five entries, because that writer cut its list at
//! five without saying so, and a reader cannot know what it left out.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Taint};
use serde::{Deserialize, Serialize};

use crate::quantity::ResourceMap;

/// The version [`Shape::v`] carries in the current form.
pub const VERSION: u32 = 2;
/// How many frontier vectors a group keeps unless told otherwise.
pub const DEFAULT_GROUP_CAP: usize = 5;
/// The label keys groups are formed by unless told otherwise: where a node is and what it is.
pub const DEFAULT_LABEL_KEYS: [&str; 5] = [
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/os",
    "kubernetes.io/arch",
];
/// How many entries the first form listed at most.
pub const V1_LIST_LEN: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("capacity shape is neither the current object nor the first list form: {0}")]
    Decode(#[source] serde_json::Error),
    #[error("capacity shape has version {0}, this reader knows up to {VERSION}")]
    Version(u32),
    #[error("capacity shape holds an unparsable quantity: {0}")]
    Quantity(#[from] crate::quantity::Error),
}

/// A lower cluster's nodes, summarised.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    pub v: u32,
    /// When the shape was computed (RFC 3339); `None` for the first form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// The label keys groups are formed by. A key outside this list says nothing about a
    /// node; a listed key absent from a group's labels means its nodes lack that label.
    #[serde(default)]
    pub keys: Vec<String>,
    /// Usable lower nodes summarised.
    pub nodes: usize,
    /// True when some group is truncated.
    pub truncated: bool,
    pub groups: Vec<Group>,
}

/// Lower nodes sharing the published label values and taints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Group {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// `NoSchedule` and `NoExecute` taints, without `timeAdded`, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    pub count: usize,
    /// True when the frontier was cut at the cap: some node may fit a pod no listed vector does.
    pub truncated: bool,
    /// The Pareto frontier of per-node free resources, as quantity strings.
    pub free: Vec<BTreeMap<String, String>>,
    /// For a truncated group, the largest free amount of each resource on any of its nodes
    /// (not one node's vector): a pod above it on some resource fits no node of the group,
    /// truncated or not. Empty when the frontier is whole.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub max: BTreeMap<String, String>,
}

impl Group {
    /// [`Group::max`] in milli-units; `None` when the group does not publish one.
    pub fn max_map(&self) -> Result<Option<ResourceMap>, crate::quantity::Error> {
        if self.max.is_empty() {
            return Ok(None);
        }
        let (map, errors) = ResourceMap::parse(&self.max);
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(Some(map)),
        }
    }

    /// The frontier vectors in milli-units.
    pub fn free_maps(&self) -> Result<Vec<ResourceMap>, crate::quantity::Error> {
        self.free
            .iter()
            .map(|f| {
                let (map, errors) = ResourceMap::parse(f);
                match errors.into_iter().next() {
                    Some(e) => Err(e),
                    None => Ok(map),
                }
            })
            .collect()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum AnyForm {
    Current(Shape),
    First(Vec<BTreeMap<String, String>>),
}

impl Shape {
    /// Reads the annotation, current or first form; quantities are checked here so a reader
    /// of the result never meets a bad one.
    pub fn decode(text: &str) -> Result<Self, Error> {
        let shape = match serde_json::from_str::<AnyForm>(text) {
            Ok(AnyForm::Current(s)) => s,
            Ok(AnyForm::First(list)) => Self::from_first_form(list),
            // Decoding again as the current form names the field that is wrong.
            Err(_) => serde_json::from_str::<Shape>(text).map_err(Error::Decode)?,
        };
        if shape.v > VERSION {
            return Err(Error::Version(shape.v));
        }
        for g in &shape.groups {
            g.free_maps()?;
            g.max_map()?;
        }
        Ok(shape)
    }

    pub fn encode(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }

    fn from_first_form(list: Vec<BTreeMap<String, String>>) -> Self {
        let truncated = list.len() >= V1_LIST_LEN;
        Self {
            v: 1,
            at: None,
            keys: Vec::new(),
            nodes: list.len(),
            truncated,
            groups: vec![Group {
                labels: BTreeMap::new(),
                taints: Vec::new(),
                count: list.len(),
                truncated,
                free: list,
                max: BTreeMap::new(),
            }],
        }
    }

    /// The shape in a node's annotations, `None` when it carries none.
    pub fn from_annotations(annotations: Option<&BTreeMap<String, String>>) -> Option<Result<Self, Error>> {
        annotations
            .and_then(|a| a.get(crate::names::NODE_CAPACITY_SHAPE))
            .map(|t| Self::decode(t))
    }
}

/// True for a lower node the lower scheduler may use: Ready and not cordoned.
pub fn usable(node: &Node) -> bool {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    let unschedulable = node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    ready && !unschedulable
}

/// True when `a` has at least as much as `b` of every resource either names.
pub fn covers(a: &ResourceMap, b: &ResourceMap) -> bool {
    b.0.iter().all(|(k, v)| a.get(k) >= *v)
}

/// The vectors no other vector covers, duplicates kept once, largest first by
/// (cpu, memory, then the whole vector) so a cut keeps the biggest nodes.
pub fn pareto_frontier(vectors: Vec<ResourceMap>) -> Vec<ResourceMap> {
    let mut out: Vec<ResourceMap> = Vec::new();
    for v in vectors {
        if out.iter().any(|o| covers(o, &v)) {
            continue;
        }
        out.retain(|o| !covers(&v, o));
        out.push(v);
    }
    out.sort_by(|a, b| {
        (b.get("cpu"), b.get("memory"))
            .cmp(&(a.get("cpu"), a.get("memory")))
            .then_with(|| b.0.cmp(&a.0))
    });
    out
}

fn scheduling_taints(node: &Node) -> Vec<Taint> {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .map(|t| Taint {
            time_added: None,
            ..t.clone()
        })
        .collect();
    taints.sort_by(|a, b| (&a.key, &a.value, &a.effect).cmp(&(&b.key, &b.value, &b.effect)));
    taints.dedup();
    taints
}

type GroupKey = (BTreeMap<String, String>, Vec<(String, Option<String>, String)>);

/// Builds the shape of the usable `nodes`, charging each the requests of the unfinished pods
/// bound to it (`pods`: each one's node and effective requests, see
/// [`pod_requests`](crate::resources::pod_requests)), grouped by the values of `label_keys`
/// and by taints, with at most `cap` frontier vectors per group (at least one).
pub fn build<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    pods: impl IntoIterator<Item = (&'a str, &'a ResourceMap)>,
    label_keys: &[String],
    cap: usize,
    at: jiff::Timestamp,
) -> Shape {
    let cap = cap.max(1);
    let keys: BTreeSet<&String> = label_keys.iter().collect();
    let mut free: BTreeMap<String, (GroupKey, Vec<Taint>, ResourceMap)> = BTreeMap::new();
    for node in nodes.into_iter().filter(|n| usable(n)) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let labels: BTreeMap<String, String> = node
            .metadata
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| keys.contains(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let taints = scheduling_taints(node);
        let taint_key = taints
            .iter()
            .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
            .collect();
        let alloc = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .map(|a| ResourceMap::parse(a.iter().map(|(k, v)| (k, &v.0))).0)
            .unwrap_or_default();
        free.insert(name, ((labels, taint_key), taints, alloc));
    }
    for (node, requests) in pods {
        if let Some((_, _, f)) = free.get_mut(node) {
            f.saturating_sub(requests);
        }
    }
    let nodes = free.len();
    let mut grouped: BTreeMap<GroupKey, (Vec<Taint>, Vec<ResourceMap>)> = BTreeMap::new();
    for (key, taints, f) in free.into_values() {
        grouped
            .entry(key)
            .or_insert_with(|| (taints, Vec::new()))
            .1
            .push(f);
    }
    let groups: Vec<Group> = grouped
        .into_iter()
        .map(|((labels, _), (taints, vectors))| {
            let count = vectors.len();
            let mut frontier = pareto_frontier(vectors);
            let truncated = frontier.len() > cap;
            let mut max = ResourceMap::default();
            if truncated {
                for v in &frontier {
                    max.max_with(v);
                }
            }
            frontier.truncate(cap);
            Group {
                labels,
                taints,
                count,
                truncated,
                free: frontier.iter().map(ResourceMap::to_strings).collect(),
                max: max.to_strings(),
            }
        })
        .collect();
    Shape {
        v: VERSION,
        at: Some(crate::api::time(at)),
        keys: keys.into_iter().cloned().collect(),
        nodes,
        truncated: groups.iter().any(|g| g.truncated),
        groups,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{is_terminal, pod_requests};
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn node(name: &str, zone: &str, cpu: &str, memory: &str, taint: Option<&str>) -> Node {
        let taints =
            taint.map(|k| json!([{"key": k, "effect": "NoSchedule", "timeAdded": "2024-01-01T00:00:00Z"}]));
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone, "kubernetes.io/hostname": name}},
            "spec": {"taints": taints},
            "status": {
                "allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .unwrap()
    }

    fn pod(node: &str, cpu: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn keys() -> Vec<String> {
        vec!["topology.kubernetes.io/zone".into()]
    }

    fn at() -> jiff::Timestamp {
        "2024-05-01T10:00:00Z".parse().unwrap()
    }

    fn rm(pairs: &[(&str, i128)]) -> ResourceMap {
        ResourceMap(pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    #[test]
    fn the_pareto_frontier_drops_dominated_vectors_and_duplicates() {
        let f = pareto_frontier(vec![
            rm(&[("cpu", 2000), ("memory", 8)]),
            rm(&[("cpu", 4000), ("memory", 4)]),
            rm(&[("cpu", 1000), ("memory", 2)]),
            rm(&[("cpu", 2000), ("memory", 8)]),
            rm(&[("cpu", 4000), ("memory", 4), ("gpu", 1000)]),
        ]);
        assert_eq!(
            f,
            vec![
                rm(&[("cpu", 4000), ("memory", 4), ("gpu", 1000)]),
                rm(&[("cpu", 2000), ("memory", 8)])
            ]
        );
    }

    #[test]
    fn free_is_allocatable_minus_live_pods_grouped_by_zone_and_taints() {
        let nodes = [
            node("a1", "a", "4", "8Gi", None),
            node("a2", "a", "2", "8Gi", None),
            node("b1", "b", "8", "32Gi", Some("gpu")),
        ];
        let pods = [
            pod("a1", "1", "Running"),
            pod("a1", "2", "Succeeded"),
            pod("a2", "1", "Running"),
            pod("b1", "3", "Pending"),
        ];
        let loads: Vec<(String, ResourceMap)> = pods
            .iter()
            .filter(|p| !is_terminal(p))
            .map(|p| {
                (
                    p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap(),
                    pod_requests(p),
                )
            })
            .collect();
        let s = build(
            &nodes,
            loads.iter().map(|(n, r)| (n.as_str(), r)),
            &keys(),
            DEFAULT_GROUP_CAP,
            at(),
        );
        assert_eq!(s.v, VERSION);
        assert_eq!(s.at.as_deref(), Some("2024-05-01T10:00:00Z"));
        assert_eq!(s.nodes, 3);
        assert!(!s.truncated);
        assert_eq!(s.groups.len(), 2);
        let a = &s.groups[0];
        assert_eq!(a.labels["topology.kubernetes.io/zone"], "a");
        assert_eq!(a.count, 2);
        assert_eq!(a.free.len(), 1, "a2 (1 CPU free) is dominated by a1 (3 free)");
        assert_eq!(a.free[0]["cpu"], "3");
        assert_eq!(a.free[0]["pods"], "109");
        let b = &s.groups[1];
        assert_eq!(b.taints.len(), 1);
        assert_eq!(b.taints[0].key, "gpu");
        assert!(b.taints[0].time_added.is_none(), "timeAdded would split groups");
        assert_eq!(b.free[0]["cpu"], "5");
        assert_eq!(Shape::decode(&s.encode().unwrap()).unwrap(), s);
    }

    #[test]
    fn a_frontier_longer_than_the_cap_is_cut_and_marked_truncated() {
        let nodes = [
            node("n1", "a", "1", "8Gi", None),
            node("n2", "a", "2", "4Gi", None),
            node("n3", "a", "4", "2Gi", None),
        ];
        let s = build(&nodes, [], &keys(), 2, at());
        assert!(s.truncated);
        assert!(s.groups[0].truncated);
        assert_eq!(s.groups[0].count, 3);
        let cpus: Vec<&str> = s.groups[0].free.iter().map(|f| f["cpu"].as_str()).collect();
        assert_eq!(cpus, ["4", "2"], "the largest kept");
        assert_eq!(
            (
                s.groups[0].max["cpu"].as_str(),
                s.groups[0].max["memory"].as_str()
            ),
            ("4", "8589934592"),
            "the largest of each resource (8Gi), the cut vectors included"
        );
        let whole = build(&nodes, [], &keys(), 3, at());
        assert!(!whole.truncated && !whole.groups[0].truncated);
        assert!(
            whole.groups[0].max.is_empty(),
            "a whole frontier needs no maximum"
        );
        assert_eq!(Shape::decode(&s.encode().unwrap()).unwrap(), s);
    }

    #[test]
    fn unusable_nodes_are_left_out() {
        let mut cordoned = node("c", "a", "64", "8Gi", None);
        cordoned.spec.get_or_insert_default().unschedulable = Some(true);
        let s = build(
            &[cordoned, node("n", "a", "2", "8Gi", None)],
            [],
            &keys(),
            5,
            at(),
        );
        assert_eq!(s.nodes, 1);
        assert_eq!(s.groups[0].free[0]["cpu"], "2");
    }

    #[test]
    fn a_5000_node_cluster_in_12_groups_publishes_under_16_kib() {
        // 3 zones x 4 instance types, every node with its own free vector: the size grows
        // with groups x cap, not with nodes.
        let types = ["m5.large", "m5.4xlarge", "r5.2xlarge", "c5.9xlarge"];
        let nodes: Vec<Node> = (0..5000)
            .map(|i| {
                let mut n = node(
                    &format!("node-{i}"),
                    ["eu-1a", "eu-1b", "eu-1c"][i % 3],
                    &format!("{}m", 2000 + (i * 37) % 30000),
                    &format!("{}Mi", 4096 + (i * 7919) % 120000),
                    None,
                );
                let labels = n.metadata.labels.get_or_insert_default();
                labels.insert("node.kubernetes.io/instance-type".into(), types[i % 4].into());
                labels.insert("kubernetes.io/os".into(), "linux".into());
                labels.insert("kubernetes.io/arch".into(), "amd64".into());
                labels.insert("topology.kubernetes.io/region".into(), "eu-1".into());
                n
            })
            .collect();
        let keys: Vec<String> = DEFAULT_LABEL_KEYS.iter().map(|k| k.to_string()).collect();
        let s = build(&nodes, [], &keys, DEFAULT_GROUP_CAP, at());
        assert_eq!((s.nodes, s.groups.len()), (5000, 12));
        let size = s.encode().unwrap().len();
        assert!(size < 16 * 1024, "{size} bytes");
    }

    #[test]
    fn the_first_form_reads_as_one_group_without_labels() {
        let s =
            Shape::decode(r#"[{"cpu":"6","memory":"8Gi","pods":"100"},{"cpu":"3","pods":"110"}]"#).unwrap();
        assert_eq!(s.v, 1);
        assert!(s.at.is_none() && s.keys.is_empty());
        assert_eq!(s.groups.len(), 1);
        assert!(
            !s.groups[0].truncated,
            "fewer than five entries: the whole cluster"
        );
        assert_eq!(s.groups[0].free_maps().unwrap()[0].get("cpu"), 6000);
        let five = serde_json::to_string(&vec![json!({"cpu": "1"}); 5]).unwrap();
        let s = Shape::decode(&five).unwrap();
        assert!(
            s.truncated && s.groups[0].truncated,
            "five entries may have been cut"
        );
    }

    #[test]
    fn a_bad_shape_is_an_error() {
        assert!(Shape::decode("{not json").is_err());
        assert!(Shape::decode(r#"[{"cpu":"lots"}]"#).is_err());
        assert!(Shape::decode(r#"{"v":3,"nodes":0,"truncated":false,"groups":[]}"#).is_err());
        let err = Shape::decode(r#"{"v":2,"nodes":"x","truncated":false,"groups":[]}"#).unwrap_err();
        assert!(err.to_string().contains("expected usize"), "{err}");
    }
}
