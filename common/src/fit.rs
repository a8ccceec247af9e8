//! The one fit predicate of the suite: may this pod go to this virtual node, judged by the
//! lower nodes the node's [capacity shape](crate::shape) summarises. The multi-scheduler's
//! filter, its standalone scheduler and preemption, and the descheduler's choice of where a
//! refused pod may go all ask it, so they never disagree.
//!
//! The pod's stashed nodeSelector, required node affinity and tolerations are what the lower
//! scheduler will apply, so they are matched against each group of the shape: the node
//! passes iff some group has labels the selector and affinity accept, taints the stashed
//! tolerations tolerate, and a frontier vector holding the pod's effective requests.
//!
//! Where the shape cannot answer exactly (no shape, one that does not decode or is older
//! than the allowed age, a stash that does not decode, a label key the shape does not
//! publish, `matchFields`, a cut frontier), the predicate passes and says why
//! ([`FailOpen`]), so a gap in the data never strands a pod; the lower scheduler and the
//! descheduler remain the backstop. Nodes that are not virtual nodes always pass.
//!
//! The matching rules themselves (label requirements, node selector terms, tolerations) are
//! here too, and the daemons use them for the upper node's own labels and taints.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::names;
use crate::overrides::{Placement, PlacementOverrides};
use crate::quantity::{ResourceMap, format_milli};
use crate::resources::pod_requests;
use crate::shape::{Group, Shape};
use crate::stash::Stash;
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration};

/// What the filter is told besides the pod and the node.
#[derive(Clone, Debug)]
pub struct Options {
    pub now: jiff::Timestamp,
    /// A shape older than this fails open; `None` accepts any age.
    pub max_age: Option<jiff::SignedDuration>,
}

/// Why the filter passed a node it could not judge exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailOpen {
    /// The virtual node publishes no shape.
    NoShape,
    /// The shape does not decode (the error says why).
    BadShape(String),
    /// The shape is older than the allowed age.
    StaleShape,
    /// The pod's stash does not decode (the error says why).
    BadStash(String),
    /// The stash selects on a label key the shape does not publish.
    UnpublishedLabel(String),
    /// The stash's affinity uses `matchFields`: lower node names the shape does not list.
    MatchFields,
    /// No listed vector fits, but a matching group's frontier was cut.
    Truncated,
    /// The node's placement overrides do not decode (the error says why).
    BadOverrides(String),
    /// An override rule changes the pod below in a way the shape cannot judge: the rule
    /// and what.
    Override(String, &'static str),
}

impl FailOpen {
    /// The reason as a metric label value.
    pub fn reason(&self) -> &'static str {
        match self {
            FailOpen::NoShape => "no_shape",
            FailOpen::BadShape(_) => "bad_shape",
            FailOpen::StaleShape => "stale_shape",
            FailOpen::BadStash(_) => "bad_stash",
            FailOpen::UnpublishedLabel(_) => "unpublished_label",
            FailOpen::MatchFields => "match_fields",
            FailOpen::Truncated => "truncated",
            FailOpen::BadOverrides(_) => "bad_overrides",
            FailOpen::Override(..) => "override",
        }
    }
}

impl std::fmt::Display for FailOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailOpen::NoShape => write!(f, "the virtual node publishes no capacity shape"),
            FailOpen::BadShape(e) => write!(f, "{e}"),
            FailOpen::StaleShape => write!(f, "the capacity shape is stale"),
            FailOpen::BadStash(e) => write!(f, "{e}"),
            FailOpen::UnpublishedLabel(k) => write!(f, "the capacity shape does not publish label {k:?}"),
            FailOpen::MatchFields => write!(f, "the stashed affinity uses matchFields"),
            FailOpen::Truncated => write!(f, "a matching group of the capacity shape is truncated"),
            FailOpen::BadOverrides(e) => write!(f, "{e}"),
            FailOpen::Override(rule, what) => {
                write!(f, "override rule {rule:?} of the lower cluster: {what}")
            }
        }
    }
}

/// The filter's answer for one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a virtual node: nothing to judge.
    NotVirtual,
    /// Some lower node fits the pod.
    Fits,
    /// Passed without an exact answer.
    FailOpen(FailOpen),
    /// No lower node fits; the message says why.
    Rejected(String),
}

impl Verdict {
    pub fn passes(&self) -> bool {
        !matches!(self, Verdict::Rejected(_))
    }
}

/// The pod as the filter reads it: decoded once, judged against many nodes.
#[derive(Clone, Debug)]
pub struct PodFacts {
    /// Effective requests, as the scheduler counts them.
    pub requests: ResourceMap,
    /// The stash (empty without one), or why it does not decode.
    stash: Result<Stash, String>,
    /// What override rules select a pod by: its namespace, labels and RuntimeClass.
    namespace: String,
    labels: BTreeMap<String, String>,
    runtime_class: Option<String>,
}

impl PodFacts {
    pub fn of(pod: &Pod) -> Self {
        let stash = Stash::from_annotations(pod.metadata.annotations.as_ref())
            .map(Option::unwrap_or_default)
            .map_err(|e| e.to_string());
        Self {
            requests: pod_requests(pod),
            stash,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            runtime_class: pod.spec.as_ref().and_then(|s| s.runtime_class_name.clone()),
        }
    }
}

/// A virtual node's capacity shape, decoded and with every quantity parsed: read once per
/// version of the Node, judged against many pods.
#[derive(Clone, Debug)]
pub struct ShapeFacts {
    shape: Shape,
    /// The placement part of the node's override rules: `None` when it publishes none.
    overrides: Option<Result<PlacementOverrides, String>>,
    at: Option<jiff::Timestamp>,
    /// Each group's frontier, in milli-units.
    free: Vec<Vec<ResourceMap>>,
    /// Each truncated group's largest free amount per resource, when published.
    max: Vec<Option<ResourceMap>>,
}

impl ShapeFacts {
    /// Decodes the annotation's text; the error is what [`FailOpen::BadShape`] says.
    pub fn decode(text: &str) -> Result<Self, String> {
        let shape = Shape::decode(text).map_err(|e| e.to_string())?;
        let at = match &shape.at {
            None => None,
            Some(t) => Some(
                t.parse::<jiff::Timestamp>()
                    .map_err(|e| format!("capacity shape time {t:?}: {e}"))?,
            ),
        };
        let free = shape
            .groups
            .iter()
            .map(Group::free_maps)
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let max = shape
            .groups
            .iter()
            .map(Group::max_map)
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            shape,
            overrides: None,
            at,
            free,
            max,
        })
    }

    /// When the shape was computed (`None` for the first form).
    pub fn at(&self) -> Option<jiff::Timestamp> {
        self.at
    }

    /// The shape with the requests of pods placed since it was computed taken out of its
    /// frontier: each, largest first, from the first vector that holds it (vectors are
    /// largest first), so the space they will use is not offered twice. A request no
    /// vector holds is left out.
    pub fn taking(&self, taken: &[ResourceMap]) -> ShapeFacts {
        let mut out = self.clone();
        let mut taken: Vec<&ResourceMap> = taken.iter().collect();
        taken.sort_by_key(|r| std::cmp::Reverse((r.get("cpu"), r.get("memory"))));
        for request in taken {
            if let Some(v) = out.free.iter_mut().flatten().find(|v| fits(request, v)) {
                v.saturating_sub(request);
            }
        }
        out
    }

    /// The shape as it would be at best if each lower node got `freed` back: `freed` added
    /// to every frontier vector and every published maximum. Each lower node's free
    /// resources after evicting upper pods are at most its own plus all they requested, so
    /// a pod this shape rejects fits no lower node after that eviction, wherever the
    /// evicted pods ran.
    pub fn freeing(&self, freed: &ResourceMap) -> ShapeFacts {
        let mut out = self.clone();
        for v in out.free.iter_mut().flatten().chain(out.max.iter_mut().flatten()) {
            v.add(freed);
        }
        out
    }

    /// The shape a node publishes, with the placement overrides it publishes; `None` when
    /// it publishes no shape.
    pub fn of(node: &Node) -> Option<Result<Self, String>> {
        let annotations = node.metadata.annotations.as_ref();
        let shape = annotations.and_then(|a| a.get(names::NODE_CAPACITY_SHAPE))?;
        Some(Self::decode(shape).map(|mut facts| {
            facts.overrides = PlacementOverrides::of(annotations);
            facts
        }))
    }
}

/// True for a node labelled as a virtual node.
pub fn is_virtual(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(names::VIRTUAL_NODE_TYPE_LABEL))
        .is_some_and(|v| v == names::VIRTUAL_NODE_TYPE_VALUE)
}

/// The filter's answer for a virtual node, with what scoring needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Judgement {
    pub verdict: Verdict,
    /// For each frontier vector that holds the pod, the largest share of one of its
    /// resources the pod would take (0 to 1): near 1 is a tight fit.
    pub shares: Vec<f64>,
}

impl Judgement {
    fn open(reason: FailOpen) -> Self {
        Judgement {
            verdict: Verdict::FailOpen(reason),
            shares: Vec::new(),
        }
    }
}

/// Judges `node` for `pod`.
pub fn judge_node(pod: &Pod, node: &Node, options: &Options) -> Verdict {
    if !is_virtual(node) {
        return Verdict::NotVirtual;
    }
    judge(&PodFacts::of(pod), ShapeFacts::of(node).as_ref(), options).verdict
}

/// Judges a virtual node, by the shape it publishes (`None`: none), for a pod.
pub fn judge(pod: &PodFacts, shape: Option<&Result<ShapeFacts, String>>, options: &Options) -> Judgement {
    let facts = match shape {
        None => return Judgement::open(FailOpen::NoShape),
        Some(Err(e)) => return Judgement::open(FailOpen::BadShape(e.clone())),
        Some(Ok(f)) => f,
    };
    if let (Some(at), Some(max_age)) = (facts.at, options.max_age)
        && options.now.duration_since(at) > max_age
    {
        return Judgement::open(FailOpen::StaleShape);
    }
    let stash = match &pod.stash {
        Ok(s) => s,
        Err(e) => return Judgement::open(FailOpen::BadStash(e.clone())),
    };
    let shape = &facts.shape;
    let stashed_terms = stash
        .node_affinity()
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|s| s.node_selector_terms.as_slice());
    // The pod as the virtual node creates it below: the stash changed by the override
    // rules that select it.
    let placed = match &facts.overrides {
        None => None,
        Some(Err(e)) => return Judgement::open(FailOpen::BadOverrides(e.clone())),
        Some(Ok(o)) => match o.place(
            &pod.namespace,
            &pod.labels,
            pod.runtime_class.as_deref(),
            &stash.node_selector,
            stashed_terms,
            &stash.tolerations,
        ) {
            Placement::Known {
                node_selector,
                terms,
                tolerations,
            } => Some((node_selector, terms, tolerations)),
            Placement::Refused(rule, why) => {
                return Judgement {
                    verdict: Verdict::Rejected(format!(
                        "override rule {rule:?} of the lower cluster refuses the pod: {why}"
                    )),
                    shares: Vec::new(),
                };
            }
            Placement::Unknown(rule, what) => return Judgement::open(FailOpen::Override(rule, what)),
        },
    };
    let (node_selector, terms, tolerations) = match &placed {
        Some((selector, terms, tolerations)) => (selector, terms.as_deref(), tolerations.as_slice()),
        None => (&stash.node_selector, stashed_terms, stash.tolerations.as_slice()),
    };
    if terms
        .into_iter()
        .flatten()
        .any(|t| t.match_fields.as_ref().is_some_and(|f| !f.is_empty()))
    {
        return Judgement::open(FailOpen::MatchFields);
    }
    let referenced = node_selector.keys().map(String::as_str).chain(
        terms
            .into_iter()
            .flatten()
            .flat_map(|t| t.match_expressions.iter().flatten())
            .map(|r| r.key.as_str()),
    );
    for key in referenced {
        if !shape.keys.iter().any(|k| k == key) {
            return Judgement::open(FailOpen::UnpublishedLabel(key.to_owned()));
        }
    }

    let requests = &pod.requests;
    let selected: Vec<usize> = (0..shape.groups.len())
        .filter(|i| {
            let g = &shape.groups[*i];
            g.count > 0 && labels_match(&g.labels, node_selector, terms)
        })
        .collect();
    let candidates: Vec<usize> = selected
        .iter()
        .copied()
        .filter(|i| shape.groups[*i].taints.iter().all(|t| tolerated(t, tolerations)))
        .collect();
    let shares: Vec<f64> = candidates
        .iter()
        .flat_map(|i| &facts.free[*i])
        .filter(|v| fits(requests, v))
        .map(|v| share(requests, v))
        .collect();
    if !shares.is_empty() {
        return Judgement {
            verdict: Verdict::Fits,
            shares,
        };
    }
    // A cut frontier may hide a node that fits, unless the group's largest free amounts
    // already fall short.
    let hidden = |i: &usize| facts.max[*i].as_ref().is_none_or(|m| fits(requests, m));
    if candidates.iter().any(|i| shape.groups[*i].truncated && hidden(i)) {
        return Judgement::open(FailOpen::Truncated);
    }
    let groups = |ids: &[usize]| -> Vec<&Group> { ids.iter().map(|i| &shape.groups[*i]).collect() };
    // The largest free amounts seen, for the message: the listed vectors and each cut
    // group's maximum.
    let vectors: Vec<(&Group, &ResourceMap)> = candidates
        .iter()
        .flat_map(|i| {
            let group = &shape.groups[*i];
            facts.free[*i]
                .iter()
                .chain(facts.max[*i].iter())
                .map(move |v| (group, v))
        })
        .collect();
    Judgement {
        verdict: Verdict::Rejected(rejection(
            shape,
            &groups(&selected),
            &groups(&candidates),
            requests,
            &vectors,
            tolerations,
        )),
        shares: Vec::new(),
    }
}

/// The largest share of one resource of `free` that `requests` takes.
fn share(requests: &ResourceMap, free: &ResourceMap) -> f64 {
    requests
        .0
        .iter()
        .filter(|(_, q)| **q > 0)
        .map(|(k, q)| *q as f64 / free.get(k).max(1) as f64)
        .fold(0.0, f64::max)
        .min(1.0)
}

fn fits(requests: &ResourceMap, free: &ResourceMap) -> bool {
    requests.0.iter().all(|(k, q)| *q <= 0 || free.get(k) >= *q)
}

fn rejection(
    shape: &Shape,
    selected: &[&Group],
    candidates: &[&Group],
    requests: &ResourceMap,
    vectors: &[(&Group, &ResourceMap)],
    tolerations: &[Toleration],
) -> String {
    if shape.groups.iter().all(|g| g.count == 0) {
        return "no usable lower node".into();
    }
    if selected.is_empty() {
        return "no lower node matches the pod's stashed node selector and affinity".into();
    }
    if candidates.is_empty() {
        let untolerated: BTreeSet<String> = selected
            .iter()
            .flat_map(|g| &g.taints)
            .filter(|t| !tolerated(t, tolerations))
            .map(show_taint)
            .collect();
        let list: Vec<String> = untolerated.into_iter().collect();
        return format!(
            "no lower node matching the stashed selector has taints the pod tolerates (untolerated: {})",
            list.join(", ")
        );
    }
    // The resources no single node has enough of, each with the largest free amount seen.
    let mut short: Vec<(&str, i128, i128, &Group)> = Vec::new();
    let mut wanted: Vec<String> = Vec::new();
    for (name, q) in requests.0.iter().filter(|(_, q)| **q > 0) {
        wanted.push(format!("{name}={}", show(*q)));
        let best = vectors.iter().max_by_key(|(_, v)| v.get(name));
        let (group, largest) = match best {
            Some((g, v)) => (*g, v.get(name)),
            None => (candidates[0], 0),
        };
        if largest < *q {
            short.push((name, *q, largest, group));
        }
    }
    if short.is_empty() {
        return format!(
            "no single lower node fits {} together; each fits alone on some node",
            wanted.join(", ")
        );
    }
    let asked: Vec<String> = short
        .iter()
        .map(|(n, q, _, _)| format!("{n}={}", show(*q)))
        .collect();
    let mut out = format!("no lower node fits {} (largest free ", asked.join(", "));
    for (i, (name, _, largest, group)) in short.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        if short.len() > 1 {
            let _ = write!(out, "{name}=");
        }
        out.push_str(&show(*largest));
        // Only the labels that tell the groups apart: a value every node shares says nothing.
        let labels: Vec<String> = group
            .labels
            .iter()
            .filter(|(k, v)| shape.groups.iter().any(|g| g.labels.get(*k) != Some(*v)))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if !labels.is_empty() {
            let _ = write!(out, " in {}", labels.join(","));
        }
    }
    out.push(')');
    out
}

/// A quantity as a person reads it: whole binary units where exact, else as the API writes it.
fn show(milli: i128) -> String {
    const GI: i128 = 1 << 30;
    const MI: i128 = 1 << 20;
    if milli % 1000 == 0 {
        let units = milli / 1000;
        if units >= GI && units % GI == 0 {
            return format!("{}Gi", units / GI);
        }
        if units >= MI && units % MI == 0 {
            return format!("{}Mi", units / MI);
        }
    }
    format_milli(milli)
}

fn show_taint(t: &Taint) -> String {
    match &t.value {
        Some(v) if !v.is_empty() => format!("{}={}:{}", t.key, v, t.effect),
        _ => format!("{}:{}", t.key, t.effect),
    }
}

/// True when a group's labels satisfy the nodeSelector and the required affinity (any term,
/// every expression of it), as the scheduler reads them.
fn labels_match(
    labels: &BTreeMap<String, String>,
    selector: &BTreeMap<String, String>,
    terms: Option<&[NodeSelectorTerm]>,
) -> bool {
    selector_matches(selector, labels) && terms_match(terms, None, labels)
}

pub fn requirement_matches(labels: &BTreeMap<String, String>, r: &NodeSelectorRequirement) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let compare = |want: std::cmp::Ordering| {
        let label = value.and_then(|v| v.parse::<i64>().ok());
        let bound = values.first().and_then(|v| v.parse::<i64>().ok());
        matches!((label, bound), (Some(l), Some(b)) if l.cmp(&b) == want)
    };
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => compare(std::cmp::Ordering::Greater),
        "Lt" => compare(std::cmp::Ordering::Less),
        _ => false,
    }
}

/// True when the node's `Ready` condition is `True`.
pub fn is_ready(node: &Node) -> bool {
    node.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The first `NoSchedule`/`NoExecute` taint of `node` no toleration tolerates (`None`: the
/// pod may go there as far as taints go). `PreferNoSchedule` never decides fit.
pub fn untolerated_taint<'a>(node: &'a Node, tolerations: &[Toleration]) -> Option<&'a Taint> {
    node.spec
        .iter()
        .flat_map(|s| s.taints.iter().flatten())
        .find(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute") && !tolerated(t, tolerations))
}

/// True when a node of these labels (and this name, when known) satisfies the required node
/// selector terms, as kube-scheduler reads them: `None` (no required affinity) constrains
/// nothing; otherwise some term matches, a term matching when it has at least one
/// requirement and all of them hold (`matchFields` knows `metadata.name` only, and a node
/// whose name is not known matches no field requirement). So an empty term, and an empty
/// list of terms, select nothing.
pub fn terms_match(
    terms: Option<&[NodeSelectorTerm]>,
    name: Option<&str>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let Some(terms) = terms else {
        return true;
    };
    let fields = name.map(|n| BTreeMap::from([("metadata.name".to_owned(), n.to_owned())]));
    terms.iter().any(|t| {
        let exprs = t.match_expressions.as_deref().unwrap_or_default();
        let by_field = t.match_fields.as_deref().unwrap_or_default();
        (!exprs.is_empty() || !by_field.is_empty())
            && exprs.iter().all(|r| requirement_matches(labels, r))
            && by_field
                .iter()
                .all(|r| fields.as_ref().is_some_and(|f| requirement_matches(f, r)))
    })
}

/// Why the upper scheduler keeps a pod off a node by the node itself: what kube-scheduler's
/// NodeUnschedulable, TaintToleration and NodeAffinity filters check, and the node's
/// readiness (which kube-scheduler reads through the `not-ready` taint the node controller
/// sets).
#[derive(Clone, Debug, PartialEq)]
pub enum UpperRefusal {
    NotReady,
    /// `spec.unschedulable`, and the pod does not tolerate `node.kubernetes.io/unschedulable`.
    Cordoned,
    /// A `NoSchedule`/`NoExecute` taint no toleration of the pod tolerates.
    Taint(Taint),
    /// A `nodeSelector` pair the node's labels lack.
    NodeSelector(String, String),
    /// No term of the required node affinity matches.
    Affinity,
}

impl UpperRefusal {
    /// The refusal in kube-scheduler's words, as its `FailedScheduling` message counts them.
    pub fn scheduler_reason(&self) -> String {
        match self {
            UpperRefusal::NotReady => "node(s) were not ready".into(),
            UpperRefusal::Cordoned => "node(s) were unschedulable".into(),
            UpperRefusal::Taint(t) => format!(
                "node(s) had taint {{{}: {}}}, that the pod didn't tolerate",
                t.key,
                t.value.as_deref().unwrap_or_default()
            ),
            UpperRefusal::NodeSelector(..) | UpperRefusal::Affinity => {
                "node(s) didn't match node selector".into()
            }
        }
    }

    /// The refusal of the node `name`, in a sentence.
    pub fn of_node(&self, name: &str) -> String {
        match self {
            UpperRefusal::NotReady => format!("{name} is not Ready"),
            UpperRefusal::Cordoned => format!("{name} is cordoned"),
            UpperRefusal::Taint(t) => format!("{name} has the taint {} the pod does not tolerate", t.key),
            UpperRefusal::NodeSelector(k, v) => {
                format!("{name} does not match the pod's nodeSelector {k}={v}")
            }
            UpperRefusal::Affinity => format!("{name} does not match the pod's required node affinity"),
        }
    }
}

/// The taint kube-scheduler's NodeUnschedulable filter takes a cordon for: a pod tolerating
/// it may go to a cordoned node.
const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

/// Why the upper scheduler would not bind a pod of these tolerations, `nodeSelector` and
/// required node affinity terms to `node`, by the node itself (`None`: it would, capacity
/// aside). The one upper predicate of the suite: the multi-scheduler's filter and the
/// descheduler's choice of targets both ask it.
pub fn upper_refusal(
    node: &Node,
    tolerations: &[Toleration],
    node_selector: Option<&BTreeMap<String, String>>,
    terms: Option<&[NodeSelectorTerm]>,
) -> Option<UpperRefusal> {
    if !is_ready(node) {
        return Some(UpperRefusal::NotReady);
    }
    let cordon = Taint {
        key: UNSCHEDULABLE_TAINT.into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    };
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) && !tolerated(&cordon, tolerations) {
        return Some(UpperRefusal::Cordoned);
    }
    if let Some(taint) = untolerated_taint(node, tolerations) {
        return Some(UpperRefusal::Taint(taint.clone()));
    }
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    if let Some((k, v)) = node_selector
        .into_iter()
        .flatten()
        .find(|(k, v)| labels.get(*k) != Some(*v))
    {
        return Some(UpperRefusal::NodeSelector(k.clone(), v.clone()));
    }
    (!terms_match(terms, node.metadata.name.as_deref(), labels)).then_some(UpperRefusal::Affinity)
}

/// The pod's required node affinity terms (`None`: it has none).
pub fn required_terms(spec: &k8s_openapi::api::core::v1::PodSpec) -> Option<&[NodeSelectorTerm]> {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|r| r.node_selector_terms.as_slice())
}

/// True when the labels carry every key and value of the nodeSelector.
pub fn selector_matches(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// True when some toleration tolerates the taint, by the API's rules.
pub fn tolerated(taint: &Taint, tolerations: &[Toleration]) -> bool {
    tolerations.iter().any(|t| {
        let effect = t.effect.as_deref().unwrap_or_default();
        if !effect.is_empty() && effect != taint.effect {
            return false;
        }
        let key = t.key.as_deref().unwrap_or_default();
        match t.operator.as_deref().unwrap_or("Equal") {
            "Exists" => key.is_empty() || key == taint.key,
            "Equal" => {
                key == taint.key
                    && t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
            }
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{DEFAULT_GROUP_CAP, build};
    use serde_json::{Value, json};

    const ZONE: &str = "topology.kubernetes.io/zone";

    fn lower(name: &str, zone: &str, cpu: &str, memory: &str, taint: Option<&str>) -> Node {
        let taints = taint.map(|k| json!([{"key": k, "value": "yes", "effect": "NoSchedule"}]));
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {ZONE: zone}},
            "spec": {"taints": taints},
            "status": {
                "allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .unwrap()
    }

    fn shape_of(nodes: &[Node], cap: usize) -> String {
        build(nodes, [], &[ZONE.to_string()], cap, now())
            .encode()
            .unwrap()
    }

    fn virtual_node(shape: Option<&str>) -> Node {
        let annotations = shape.map(|s| json!({names::NODE_CAPACITY_SHAPE: s}));
        serde_json::from_value(json!({
            "metadata": {
                "name": "vn",
                "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE},
                "annotations": annotations,
            },
        }))
        .unwrap()
    }

    fn pod(requests: Value, stash: Option<Value>) -> Pod {
        let annotations = stash.map(|s| json!({names::CLUSTER_SELECTOR: s.to_string()}));
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "annotations": annotations},
            "spec": {"containers": [{"name": "c", "resources": {"requests": requests}}]},
        }))
        .unwrap()
    }

    fn cpu(n: &str) -> Pod {
        pod(json!({"cpu": n}), None)
    }

    fn now() -> jiff::Timestamp {
        "2024-05-01T10:00:00Z".parse().unwrap()
    }

    fn options() -> Options {
        Options {
            now: now(),
            max_age: Some(jiff::SignedDuration::from_secs(120)),
        }
    }

    fn judge(pod: &Pod, shape: &str) -> Verdict {
        judge_node(pod, &virtual_node(Some(shape)), &options())
    }

    fn two_cpu_cluster() -> Vec<Node> {
        (0..3)
            .map(|i| lower(&format!("n{i}"), "a", "2", "8Gi", None))
            .collect()
    }

    #[test]
    fn a_6_cpu_pod_is_rejected_on_a_cluster_of_2_cpu_nodes_with_the_reason() {
        let shape = shape_of(&two_cpu_cluster(), DEFAULT_GROUP_CAP);
        assert_eq!(
            judge(&cpu("6"), &shape),
            Verdict::Rejected("no lower node fits cpu=6 (largest free 2)".into()),
            "one zone: its label tells nothing apart"
        );
        assert_eq!(judge(&cpu("2"), &shape), Verdict::Fits);
    }

    #[test]
    fn a_6_cpu_pod_passes_when_some_group_has_8_free() {
        let mut nodes = two_cpu_cluster();
        nodes.push(lower("big", "b", "8", "32Gi", None));
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        assert_eq!(judge(&cpu("6"), &shape), Verdict::Fits);
        assert!(!judge(&cpu("9"), &shape).passes());
    }

    #[test]
    fn init_containers_and_overhead_count_as_the_scheduler_counts_them() {
        let shape = shape_of(&[lower("big", "b", "8", "32Gi", None)], DEFAULT_GROUP_CAP);
        let mut p: Pod = serde_json::from_value(json!({
            "spec": {
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
                "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "7"}}}],
                "overhead": {"cpu": "500m"},
            }
        }))
        .unwrap();
        assert_eq!(judge(&p, &shape), Verdict::Fits, "max(7, 1) + 0.5 = 7.5 ≤ 8");
        p.spec.as_mut().unwrap().overhead = Some(BTreeMap::from([(
            "cpu".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("1500m".into()),
        )]));
        assert_eq!(
            judge(&p, &shape),
            Verdict::Rejected("no lower node fits cpu=8500m (largest free 8)".into())
        );
    }

    #[test]
    fn a_stashed_zone_selector_restricts_groups() {
        let mut nodes = two_cpu_cluster();
        nodes.push(lower("big", "b", "8", "32Gi", None));
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        let in_a = pod(json!({"cpu": "6"}), Some(json!({"nodeSelector": {ZONE: "a"}})));
        assert_eq!(
            judge(&in_a, &shape),
            Verdict::Rejected(format!("no lower node fits cpu=6 (largest free 2 in {ZONE}=a)"))
        );
        let affinity = |op: &str, zone: &str| {
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": ZONE, "operator": op, "values": [zone]}]}]
            }}}})
        };
        assert_eq!(
            judge(&pod(json!({"cpu": "6"}), Some(affinity("In", "b"))), &shape),
            Verdict::Fits
        );
        assert_eq!(
            judge(&pod(json!({"cpu": "6"}), Some(affinity("NotIn", "a"))), &shape),
            Verdict::Fits
        );
        assert!(!judge(&pod(json!({"cpu": "6"}), Some(affinity("NotIn", "b"))), &shape).passes());
        assert_eq!(
            judge(
                &pod(json!({"cpu": "1"}), Some(json!({"nodeSelector": {ZONE: "c"}}))),
                &shape
            ),
            Verdict::Rejected("no lower node matches the pod's stashed node selector and affinity".into())
        );
    }

    #[test]
    fn a_stashed_toleration_admits_a_tainted_group() {
        let mut nodes = two_cpu_cluster();
        nodes.push(lower("gpu", "a", "8", "32Gi", Some("gpu")));
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        assert_eq!(
            judge(&cpu("6"), &shape),
            Verdict::Rejected("no lower node fits cpu=6 (largest free 2)".into()),
            "the tainted 8-CPU node does not count for a pod without the toleration"
        );
        for toleration in [
            json!({"key": "gpu", "operator": "Exists"}),
            json!({"key": "gpu", "value": "yes", "effect": "NoSchedule"}),
            json!({"operator": "Exists"}),
        ] {
            let p = pod(json!({"cpu": "6"}), Some(json!({"tolerations": [toleration]})));
            assert_eq!(judge(&p, &shape), Verdict::Fits, "{toleration}");
        }
        let wrong = pod(
            json!({"cpu": "6"}),
            Some(json!({"tolerations": [{"key": "gpu", "value": "no"}]})),
        );
        assert!(!judge(&wrong, &shape).passes());

        let only_tainted = shape_of(&[lower("gpu", "a", "8", "32Gi", Some("gpu"))], DEFAULT_GROUP_CAP);
        assert_eq!(
            judge(&cpu("1"), &only_tainted),
            Verdict::Rejected(
                "no lower node matching the stashed selector has taints the pod tolerates \
                 (untolerated: gpu=yes:NoSchedule)"
                    .into()
            )
        );
    }

    /// The node with its shape and the placement overrides it publishes.
    fn overridden(shape: &str, rules: Value) -> Node {
        let mut node = virtual_node(Some(shape));
        let overrides = json!({"v": 1, "rules": rules}).to_string();
        node.metadata
            .annotations
            .get_or_insert_default()
            .insert(names::NODE_PLACEMENT_OVERRIDES.into(), overrides);
        node
    }

    #[test]
    fn the_pod_judged_is_the_one_the_override_rules_make_below() {
        // Dedicated nodes behind a taint, and a rule that tolerates it for namespace ns.
        let shape = shape_of(
            &[lower("fleet", "a", "8", "32Gi", Some("dedicated"))],
            DEFAULT_GROUP_CAP,
        );
        let dedicated = json!([{"name": "dedicated", "namespaces": ["ns"],
            "tolerations": [{"key": "dedicated", "operator": "Exists"}]}]);
        let node = overridden(&shape, dedicated.clone());
        assert_eq!(
            judge_node(&cpu("6"), &node, &options()),
            Verdict::Fits,
            "the rule's toleration reaches the pod below"
        );
        assert!(
            !judge_node(&cpu("6"), &virtual_node(Some(&shape)), &options()).passes(),
            "without the rule, the taint keeps the pod off"
        );
        let mut elsewhere = cpu("6");
        elsewhere.metadata.namespace = Some("other".into());
        assert!(
            !judge_node(&elsewhere, &node, &options()).passes(),
            "a rule selects by namespace"
        );

        // The reverse: a rule's nodeSelector keeps the pod to zone a, where nothing fits.
        let mut nodes = two_cpu_cluster();
        nodes.push(lower("big", "b", "8", "32Gi", None));
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        let zone_a = overridden(&shape, json!([{"name": "zone-a", "nodeSelector": {ZONE: "a"}}]));
        assert_eq!(
            judge_node(&cpu("6"), &zone_a, &options()),
            Verdict::Rejected(format!("no lower node fits cpu=6 (largest free 2 in {ZONE}=a)"))
        );
        let terms = overridden(
            &shape,
            json!([{"name": "not-b", "nodeSelectorTerms": [{"matchExpressions": [
                {"key": ZONE, "operator": "NotIn", "values": ["b"]}]}]}]),
        );
        assert!(
            !judge_node(&cpu("6"), &terms, &options()).passes(),
            "terms conjoined"
        );

        // A rule the virtual node would refuse the pod by: no lower node takes it.
        let mine = pod(json!({"cpu": "1"}), Some(json!({"nodeSelector": {ZONE: "b"}})));
        assert!(matches!(
            judge_node(&mine, &zone_a, &options()),
            Verdict::Rejected(why) if why.contains("zone-a") && why.contains("contradicts")
        ));
        // What the shape cannot judge passes, and says why.
        let opaque = overridden(&shape, json!([{"name": "patched", "opaque": true}]));
        assert_eq!(
            judge_node(&cpu("6"), &opaque, &options()),
            Verdict::FailOpen(FailOpen::Override(
                "patched".into(),
                "its patch may change the pod's placement"
            ))
        );
        let mut bad = virtual_node(Some(&shape));
        bad.metadata
            .annotations
            .get_or_insert_default()
            .insert(names::NODE_PLACEMENT_OVERRIDES.into(), "{".into());
        assert!(matches!(
            judge_node(&cpu("6"), &bad, &options()),
            Verdict::FailOpen(FailOpen::BadOverrides(_))
        ));
    }

    #[test]
    fn every_resource_short_is_named_and_a_combination_no_node_holds_is_said() {
        let nodes = [
            lower("cpu", "a", "8", "4Gi", None),
            lower("mem", "b", "2", "64Gi", None),
        ];
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        let both = pod(json!({"cpu": "16", "memory": "128Gi"}), None);
        assert_eq!(
            judge(&both, &shape),
            Verdict::Rejected(format!(
                "no lower node fits cpu=16, memory=128Gi (largest free cpu=8 in {ZONE}=a, memory=64Gi in {ZONE}=b)"
            ))
        );
        let together = pod(json!({"cpu": "6", "memory": "32Gi"}), None);
        assert_eq!(
            judge(&together, &shape),
            Verdict::Rejected(
                "no single lower node fits cpu=6, memory=32Gi, pods=1 together; each fits alone on some node"
                    .into()
            )
        );
    }

    #[test]
    fn match_fields_fails_open() {
        let shape = shape_of(&two_cpu_cluster(), DEFAULT_GROUP_CAP);
        let p = pod(
            json!({"cpu": "6"}),
            Some(
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
                }}}}),
            ),
        );
        let v = judge(&p, &shape);
        assert_eq!(v, Verdict::FailOpen(FailOpen::MatchFields));
        assert!(v.passes());
    }

    #[test]
    fn a_label_key_the_shape_does_not_publish_fails_open() {
        let shape = shape_of(&two_cpu_cluster(), DEFAULT_GROUP_CAP);
        let p = pod(
            json!({"cpu": "6"}),
            Some(json!({"nodeSelector": {"disk": "ssd"}})),
        );
        let v = judge(&p, &shape);
        assert_eq!(v, Verdict::FailOpen(FailOpen::UnpublishedLabel("disk".into())));
        assert_eq!(
            FailOpen::UnpublishedLabel("disk".into()).reason(),
            "unpublished_label"
        );
    }

    #[test]
    fn a_truncated_group_fails_open_when_no_listed_node_fits() {
        let nodes = [
            lower("wide", "a", "4", "1Gi", None),
            lower("tall", "a", "1", "16Gi", None),
        ];
        let shape = shape_of(&nodes, 1);
        let v = judge(&pod(json!({"memory": "8Gi"}), None), &shape);
        assert_eq!(v, Verdict::FailOpen(FailOpen::Truncated));
        assert!(v.passes());
        assert_eq!(
            judge(&cpu("3"), &shape),
            Verdict::Fits,
            "a listed vector still answers exactly"
        );
    }

    #[test]
    fn a_truncated_group_still_rejects_a_pod_above_its_largest_free_amounts() {
        let nodes = [
            lower("wide", "a", "4", "1Gi", None),
            lower("tall", "a", "1", "16Gi", None),
        ];
        let shape = shape_of(&nodes, 1);
        assert_eq!(
            judge(&pod(json!({"cpu": "6"}), None), &shape),
            Verdict::Rejected("no lower node fits cpu=6 (largest free 4)".into())
        );
        assert_eq!(
            judge(&pod(json!({"memory": "32Gi"}), None), &shape),
            Verdict::Rejected("no lower node fits memory=32Gi (largest free 16Gi)".into()),
            "the cut vector's memory is in the group's maximum"
        );
        assert_eq!(
            judge(&pod(json!({"cpu": "2", "memory": "2Gi"}), None), &shape),
            Verdict::FailOpen(FailOpen::Truncated),
            "within the maximum, a cut vector may hold it"
        );
    }

    #[test]
    fn a_first_form_shape_is_read_as_one_group_without_labels() {
        let first = r#"[{"cpu":"2","memory":"8Gi","pods":"110"},{"cpu":"1","memory":"8Gi","pods":"110"}]"#;
        assert_eq!(
            judge(&cpu("6"), first),
            Verdict::Rejected("no lower node fits cpu=6 (largest free 2)".into())
        );
        let zoned = pod(json!({"cpu": "1"}), Some(json!({"nodeSelector": {ZONE: "a"}})));
        assert_eq!(
            judge(&zoned, first),
            Verdict::FailOpen(FailOpen::UnpublishedLabel(ZONE.into()))
        );
        let five = serde_json::to_string(&vec![json!({"cpu": "2", "pods": "110"}); 5]).unwrap();
        assert_eq!(judge(&cpu("6"), &five), Verdict::FailOpen(FailOpen::Truncated));
    }

    #[test]
    fn missing_bad_or_stale_shapes_fail_open_and_other_nodes_always_pass() {
        let p = cpu("6");
        assert_eq!(
            judge_node(&p, &virtual_node(None), &options()),
            Verdict::FailOpen(FailOpen::NoShape)
        );
        assert!(matches!(
            judge(&p, "{oops"),
            Verdict::FailOpen(FailOpen::BadShape(_))
        ));
        let shape = shape_of(&two_cpu_cluster(), DEFAULT_GROUP_CAP);
        let later = Options {
            now: now() + jiff::SignedDuration::from_secs(121),
            ..options()
        };
        assert_eq!(
            judge_node(&p, &virtual_node(Some(&shape)), &later),
            Verdict::FailOpen(FailOpen::StaleShape)
        );
        let any_age = Options {
            max_age: None,
            ..later
        };
        assert!(!judge_node(&p, &virtual_node(Some(&shape)), &any_age).passes());
        let mut plain = virtual_node(Some(&shape));
        plain.metadata.labels = None;
        assert_eq!(judge_node(&p, &plain, &options()), Verdict::NotVirtual);
        let bad_stash = pod(json!({"cpu": "6"}), Some(json!("not an object")));
        assert!(matches!(
            judge(&bad_stash, &shape),
            Verdict::FailOpen(FailOpen::BadStash(_))
        ));
    }

    #[test]
    fn operators_read_as_the_scheduler_reads_them() {
        let r = |op: &str, values: &[&str]| NodeSelectorRequirement {
            key: "k".into(),
            operator: op.into(),
            values: Some(values.iter().map(|s| s.to_string()).collect()),
        };
        let with = |v: Option<&str>| -> BTreeMap<String, String> {
            v.map(|v| BTreeMap::from([("k".to_owned(), v.to_owned())]))
                .unwrap_or_default()
        };
        assert!(requirement_matches(&with(Some("a")), &r("In", &["a"])));
        assert!(!requirement_matches(&with(None), &r("In", &["a"])));
        assert!(requirement_matches(&with(None), &r("NotIn", &["a"])));
        assert!(requirement_matches(&with(Some("")), &r("Exists", &[])));
        assert!(requirement_matches(&with(None), &r("DoesNotExist", &[])));
        assert!(requirement_matches(&with(Some("4")), &r("Gt", &["3"])));
        assert!(!requirement_matches(&with(Some("4")), &r("Lt", &["3"])));
        assert!(
            !requirement_matches(&with(Some("x")), &r("Gt", &["3"])),
            "not a number"
        );
    }

    #[test]
    fn node_terms_read_match_fields_by_name_and_an_empty_term_selects_nothing() {
        let terms: Vec<NodeSelectorTerm> = serde_json::from_value(json!([
            {"matchExpressions": [{"key": ZONE, "operator": "In", "values": ["a"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vn-b"]}]},
        ]))
        .unwrap();
        let labels = |zone: &str| BTreeMap::from([(ZONE.to_owned(), zone.to_owned())]);
        assert!(
            terms_match(Some(&terms), Some("vn-a"), &labels("a")),
            "the first term"
        );
        assert!(
            terms_match(Some(&terms), Some("vn-b"), &labels("z")),
            "the second term, by name"
        );
        assert!(!terms_match(Some(&terms), Some("vn-c"), &labels("z")));
        assert!(
            !terms_match(Some(&terms), None, &labels("z")),
            "a field requirement of an unnamed node"
        );
        let empty: Vec<NodeSelectorTerm> = serde_json::from_value(json!([{}])).unwrap();
        assert!(!terms_match(Some(&empty), Some("vn-a"), &labels("a")));
        assert!(
            !terms_match(Some(&[]), Some("vn-a"), &labels("a")),
            "an empty list of terms selects nothing, as in kube-scheduler"
        );
        assert!(
            terms_match(None, Some("vn-a"), &labels("a")),
            "no required affinity, no constraint"
        );
    }

    #[test]
    fn the_upper_predicate_is_kube_schedulers_node_filters() {
        let node = |spec: serde_json::Value| -> Node {
            serde_json::from_value(json!({"metadata": {"name": "vn-a", "labels": {ZONE: "a"}},
                "spec": spec,
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
            .unwrap()
        };
        let toleration = |key: &str| Toleration {
            key: Some(key.into()),
            operator: Some("Exists".into()),
            ..Default::default()
        };
        let plain = node(json!({}));
        assert_eq!(upper_refusal(&plain, &[], None, None), None);
        let cordoned = node(json!({"unschedulable": true}));
        assert_eq!(
            upper_refusal(&cordoned, &[], None, None),
            Some(UpperRefusal::Cordoned)
        );
        assert_eq!(
            upper_refusal(&cordoned, &[toleration(UNSCHEDULABLE_TAINT)], None, None),
            None,
            "a pod tolerating the cordon's taint goes to a cordoned node"
        );
        let tainted = node(json!({"taints": [{"key": "gpu", "effect": "NoSchedule"}]}));
        assert!(
            matches!(upper_refusal(&tainted, &[], None, None), Some(UpperRefusal::Taint(t)) if t.key == "gpu")
        );
        let selector = BTreeMap::from([(ZONE.to_owned(), "b".to_owned())]);
        assert_eq!(
            upper_refusal(&plain, &[], Some(&selector), None),
            Some(UpperRefusal::NodeSelector(ZONE.into(), "b".into()))
        );
        assert_eq!(
            upper_refusal(&plain, &[], None, Some(&[])),
            Some(UpperRefusal::Affinity)
        );
        let mut not_ready = plain.clone();
        not_ready.status = None;
        assert_eq!(
            upper_refusal(&not_ready, &[], None, None),
            Some(UpperRefusal::NotReady)
        );
    }

    #[test]
    fn untolerated_taints_of_a_node_block_only_with_no_schedule_or_no_execute() {
        let node: Node = serde_json::from_value(json!({"spec": {"taints": [
            {"key": "soft", "effect": "PreferNoSchedule"},
            {"key": "gpu", "value": "yes", "effect": "NoSchedule"}]}}))
        .unwrap();
        assert_eq!(untolerated_taint(&node, &[]).map(|t| t.key.as_str()), Some("gpu"));
        let tolerate: Vec<Toleration> =
            serde_json::from_value(json!([{"key": "gpu", "operator": "Exists"}])).unwrap();
        assert_eq!(untolerated_taint(&node, &tolerate), None);
    }

    #[test]
    fn a_pareto_frontier_answers_exactly_for_either_corner() {
        // One node wide in cpu, one tall in memory: neither dominates, both are listed.
        let nodes = [
            lower("wide", "a", "8", "4Gi", None),
            lower("tall", "a", "2", "32Gi", None),
            lower("small", "a", "1", "2Gi", None),
        ];
        let shape = shape_of(&nodes, DEFAULT_GROUP_CAP);
        assert_eq!(
            judge(&pod(json!({"cpu": "6", "memory": "2Gi"}), None), &shape),
            Verdict::Fits
        );
        assert_eq!(
            judge(&pod(json!({"cpu": "1", "memory": "16Gi"}), None), &shape),
            Verdict::Fits
        );
        assert!(!judge(&pod(json!({"cpu": "6", "memory": "16Gi"}), None), &shape).passes());
    }
}
