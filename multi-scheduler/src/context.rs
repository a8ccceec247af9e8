//! What a request is judged with besides the request ([`Context`]): the virtual nodes'
//! facts, decoded once per version of each Node ([`FactsCache`]), the pods bound to nodes
//! and what preempting some of them would free ([`BoundPods`]), and the workload's
//! exclusions ([`exclusions_for`]). The filter, prioritize, preempt and the standalone
//! scheduler all read them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tensile_common::exclusion::Exclusions;
use tensile_common::fit::{self, Options, ShapeFacts};
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::pod_requests;
use tensile_common::{names, pin};

/// Everything a request is judged with besides the request.
pub struct Context<'a> {
    pub view: &'a dyn View,
    /// The pods bound to nodes: what preempting some of them would free.
    pub pods: &'a dyn BoundPods,
    pub facts: &'a FactsCache,
    pub exclusions: &'a Exclusions,
    pub options: Options,
}

/// The key of the pod's workload in the exclusion records: its controller's UID, or for a
/// bare pod's replacement the line it belongs to.
pub fn owner_key(pod: &Pod) -> Option<String> {
    let controller = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone());
    controller.or_else(|| {
        pod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::LINEAGE))
            .cloned()
    })
}

/// What one node is to the filter, derived once per version of the Node.
#[derive(Debug)]
pub struct NodeFacts {
    pub virtual_node: bool,
    /// The shape (`None`: none published).
    pub shape: Option<Result<ShapeFacts, String>>,
}

/// Node facts by name and resourceVersion, so a shape is decoded once per change of its
/// Node rather than once per request.
#[derive(Debug, Default)]
pub struct FactsCache(Mutex<HashMap<String, (String, Arc<NodeFacts>)>>);

impl FactsCache {
    pub fn facts(&self, node: &Node) -> Arc<NodeFacts> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let version = node.metadata.resource_version.as_deref();
        if let Some(v) = version
            && let Ok(map) = self.0.lock()
            && let Some((seen, facts)) = map.get(name)
            && seen == v
        {
            return facts.clone();
        }
        let virtual_node = fit::is_virtual(node);
        let facts = Arc::new(NodeFacts {
            virtual_node,
            shape: if virtual_node { ShapeFacts::of(node) } else { None },
        });
        if let Some(v) = version
            && let Ok(mut map) = self.0.lock()
        {
            map.insert(name.to_owned(), (v.to_owned(), facts.clone()));
        }
        facts
    }

    /// Forgets nodes not in `keep` (deleted Nodes).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        if let Ok(mut map) = self.0.lock() {
            map.retain(|name, _| keep(name));
        }
    }
}

/// Where node names are looked up: the watch cache of virtual nodes.
pub trait View {
    /// The node named `name`, `None` when the cache has no such virtual node.
    fn node(&self, name: &str) -> Option<Arc<Node>>;
}

/// The pod's active exclusions at `now`: node → the message a rejection there gives. None
/// for a pod its volume pins to one node ([`pin::volume_pinned`]), as the webhook and
/// the descheduler exempt it: it can run nowhere else.
pub fn exclusions_for(pod: &Pod, exclusions: &Exclusions, now: jiff::Timestamp) -> BTreeMap<String, String> {
    if pin::volume_pinned(pod) {
        return BTreeMap::new();
    }
    let Some(record) = owner_key(pod).and_then(|k| exclusions.records.get(&k)) else {
        return BTreeMap::new();
    };
    if record.is_expired(now) {
        return BTreeMap::new();
    }
    record
        .nodes
        .iter()
        .filter(|(_, until)| **until > now)
        .map(|(node, until)| {
            let message = format!(
                "excluded for {} {}/{} until {}: its lower cluster refused the workload",
                record.kind,
                record.namespace,
                record.name,
                tensile_common::api::time(*until)
            );
            (node.clone(), message)
        })
        .collect()
}

/// A pod bound to a node, as preemption needs it: where, at which priority, asking what.
/// The extender's pod cache keeps these rather than whole pods.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BoundPod {
    /// Name, namespace and UID only.
    pub metadata: ObjectMeta,
    pub node: String,
    pub priority: i32,
    pub requests: ResourceMap,
}

tensile_common::kept_as!(BoundPod, Pod, metadata);

impl BoundPod {
    /// The summary of `pod` (a pod without a node gets an empty one, which nothing
    /// matches).
    pub fn of(pod: Pod) -> Self {
        let requests = pod_requests(&pod);
        let spec = pod.spec.as_ref();
        BoundPod {
            node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            priority: spec.and_then(|s| s.priority).unwrap_or(0),
            requests,
            metadata: ObjectMeta {
                name: pod.metadata.name,
                namespace: pod.metadata.namespace,
                uid: pod.metadata.uid,
                resource_version: pod.metadata.resource_version,
                ..ObjectMeta::default()
            },
        }
    }

    pub(crate) fn uid(&self) -> &str {
        self.metadata.uid.as_deref().unwrap_or_default()
    }
}

/// Where the pods bound to nodes are looked up: the extender's watch cache of bound,
/// non-terminal pods.
pub trait BoundPods {
    fn bound(&self) -> Vec<Arc<BoundPod>>;
}

/// No pods bound anywhere: for callers without a pod cache (benches, tools). With it, a
/// shape rejection counts as unresolvable, as if nothing could be evicted.
pub struct NoBoundPods;

impl BoundPods for NoBoundPods {
    fn bound(&self) -> Vec<Arc<BoundPod>> {
        Vec::new()
    }
}

/// A pod's priority as kube-scheduler reads it (none: 0).
pub fn priority_of(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// Per node, the requests of the bound pods a pod of `priority` may preempt (those of
/// strictly lower priority); each pod's requests hold `pods=1`, so `pods` counts them.
pub fn evictable(pods: &[Arc<BoundPod>], priority: i32) -> HashMap<String, ResourceMap> {
    let mut out: HashMap<String, ResourceMap> = HashMap::new();
    for p in pods
        .iter()
        .filter(|p| p.priority < priority && !p.node.is_empty())
    {
        let sum = out.entry(p.node.clone()).or_default();
        sum.add(&p.requests);
    }
    out
}
