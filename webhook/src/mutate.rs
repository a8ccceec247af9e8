//! The pure mutation: one review in, one response out, no I/O.
//!
//! The only outside knowledge a mutation needs, which node a bound PVC selected, is looked
//! up beforehand ([`claims_to_look_up`]) and passed in through [`ClaimNodes`].

use std::collections::{BTreeMap, BTreeSet};

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation};
use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, Toleration,
};
use kube::core::admission::{AdmissionResponse, Operation};
use serde::Deserialize as _;
use serde_json::Value;
use tensile_common::names;
use tensile_common::stash::Stash;

use crate::policy::{Policy, VirtualNodeConstraint};
use crate::review::Review;

/// The node a PVC of the pod's namespace was bound for (its selected-node annotation).
pub trait ClaimNodes {
    fn selected_node(&self, claim: &str) -> Option<&str>;
}

impl ClaimNodes for BTreeMap<String, String> {
    fn selected_node(&self, claim: &str) -> Option<&str> {
        self.get(claim).map(String::as_str)
    }
}

/// No PVC is bound to a node.
pub struct NoClaims;

impl ClaimNodes for NoClaims {
    fn selected_node(&self, _: &str) -> Option<&str> {
        None
    }
}

/// What happened to a review, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed as it is (not ours to change, or already stashed).
    Unchanged,
    Mutated,
    Denied,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Unchanged => "unchanged",
            Verdict::Mutated => "mutated",
            Verdict::Denied => "denied",
        }
    }
}

#[derive(Debug)]
pub struct Outcome {
    pub response: AdmissionResponse,
    pub verdict: Verdict,
}

/// The PVCs whose selected node [`mutate`] will ask about: those of a pod it will stash.
pub fn claims_to_look_up(review: &Review, policy: &Policy) -> Vec<String> {
    let Ok(Some(object)) = target(review, policy) else {
        return Vec::new();
    };
    if stash_annotation(object).is_some() {
        return Vec::new();
    }
    let volumes = object.pointer("/spec/volumes").and_then(Value::as_array);
    let mut claims: Vec<String> = volumes
        .into_iter()
        .flatten()
        .filter_map(|v| {
            v.pointer("/persistentVolumeClaim/claimName")
                .and_then(Value::as_str)
        })
        .map(str::to_owned)
        .collect();
    claims.sort();
    claims.dedup();
    claims
}

/// Decides the review.
pub fn mutate(review: &Review, policy: &Policy, claims: &dyn ClaimNodes) -> Outcome {
    let allow = || AdmissionResponse::from(&review.request);
    let object = match target(review, policy) {
        Ok(Some(object)) => object,
        Ok(None) => {
            return Outcome {
                response: allow(),
                verdict: Verdict::Unchanged,
            };
        }
        Err(Skip::NotAPod(what)) => {
            let mut response = allow();
            response.warnings = Some(vec![format!(
                "tensile webhook: {what} is not a pod and passes unchanged; the webhook registration should send only pods"
            )]);
            return Outcome {
                response,
                verdict: Verdict::Unchanged,
            };
        }
        Err(Skip::Deny(message)) => return deny(review, message),
    };
    if let Some(text) = stash_annotation(object) {
        // Already stashed (a re-invocation, or a pod written with its stash): never stash twice.
        return match text.map(Stash::decode) {
            Some(Ok(_)) => Outcome {
                response: allow(),
                verdict: Verdict::Unchanged,
            },
            Some(Err(e)) => deny(review, e.to_string()),
            None => deny(
                review,
                format!("annotation {} must be a string", names::CLUSTER_SELECTOR),
            ),
        };
    }
    match plan(object, policy, claims) {
        Ok((patch, warnings)) => match allow().with_patch(patch) {
            Ok(mut response) => {
                if !warnings.is_empty() {
                    response.warnings = Some(warnings);
                }
                Outcome {
                    response,
                    verdict: Verdict::Mutated,
                }
            }
            Err(e) => deny(review, format!("cannot encode the patch: {e}")),
        },
        Err(message) => deny(review, message),
    }
}

fn deny(review: &Review, message: String) -> Outcome {
    Outcome {
        response: AdmissionResponse::from(&review.request).deny(format!("tensile webhook: {message}")),
        verdict: Verdict::Denied,
    }
}

enum Skip {
    NotAPod(String),
    Deny(String),
}

/// The pod object this review asks us to mutate; `Ok(None)` when the review is not ours.
fn target<'a>(review: &'a Review, policy: &Policy) -> Result<Option<&'a Value>, Skip> {
    let request = &review.request;
    if request.operation != Operation::Create {
        return Ok(None);
    }
    if request.sub_resource.is_some() {
        return Ok(None);
    }
    let kind = &request.kind;
    if !(kind.group.is_empty() && kind.kind == "Pod") {
        let group = if kind.group.is_empty() {
            "core"
        } else {
            &kind.group
        };
        return Err(Skip::NotAPod(format!("{group}/{}/{}", kind.version, kind.kind)));
    }
    if let Some(ns) = &request.namespace
        && policy.excluded_namespaces.contains(ns)
    {
        return Ok(None);
    }
    let Some(object) = &review.object else {
        return Err(Skip::Deny("the CREATE review carries no pod".into()));
    };
    let label = object
        .pointer(&format!("/metadata/labels/{}", escape(&policy.opt_in.key)))
        .and_then(Value::as_str);
    if label != Some(policy.opt_in.value.as_str()) {
        return Ok(None);
    }
    Ok(Some(object))
}

/// The stash annotation: `None` when absent, `Some(None)` when present but not a string.
fn stash_annotation(object: &Value) -> Option<Option<&str>> {
    object
        .pointer(&format!(
            "/metadata/annotations/{}",
            escape(names::CLUSTER_SELECTOR)
        ))
        .map(Value::as_str)
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

fn ptr(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(tokens.iter().copied())
}

fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: ptr(tokens),
        value,
    })
}

fn remove(tokens: &[&str]) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation { path: ptr(tokens) })
}

fn to_value<T: serde::Serialize>(what: &str, v: &T) -> Result<Value, String> {
    serde_json::to_value(v).map_err(|e| format!("cannot encode the upper pod's {what}: {e}"))
}

/// A node-selector term split by key: what stays upstream and what goes down.
struct Split {
    upper: NodeSelectorTerm,
    lower: NodeSelectorTerm,
}

fn term_is_empty(t: &NodeSelectorTerm) -> bool {
    t.match_expressions.as_ref().is_none_or(Vec::is_empty)
        && t.match_fields.as_ref().is_none_or(Vec::is_empty)
}

fn split_term(term: &NodeSelectorTerm, keep: &BTreeSet<String>) -> Split {
    let part = |reqs: &Option<Vec<NodeSelectorRequirement>>, upper: bool| {
        let out: Vec<NodeSelectorRequirement> = reqs
            .iter()
            .flatten()
            .filter(|r| keep.contains(&r.key) == upper)
            .cloned()
            .collect();
        (!out.is_empty()).then_some(out)
    };
    Split {
        upper: NodeSelectorTerm {
            match_expressions: part(&term.match_expressions, true),
            match_fields: part(&term.match_fields, true),
        },
        lower: NodeSelectorTerm {
            match_expressions: part(&term.match_expressions, false),
            match_fields: part(&term.match_fields, false),
        },
    }
}

/// Terms ORed together: if one side of any term is empty that side matches every node, so
/// the whole side is unconstrained (`None`); an empty term would instead match no node.
fn side(terms: impl Iterator<Item = NodeSelectorTerm>) -> Option<Vec<NodeSelectorTerm>> {
    let mut out = Vec::new();
    for t in terms {
        if term_is_empty(&t) {
            return None;
        }
        out.push(t);
    }
    (!out.is_empty()).then_some(out)
}

fn required(
    terms: Option<Vec<NodeSelectorTerm>>,
    preferred: Option<Vec<k8s_openapi::api::core::v1::PreferredSchedulingTerm>>,
) -> Option<NodeAffinity> {
    let na = NodeAffinity {
        required_during_scheduling_ignored_during_execution: terms
            .map(|node_selector_terms| NodeSelector { node_selector_terms }),
        preferred_during_scheduling_ignored_during_execution: preferred.filter(|p| !p.is_empty()),
    };
    (na.required_during_scheduling_ignored_during_execution.is_some()
        || na.preferred_during_scheduling_ignored_during_execution.is_some())
    .then_some(na)
}

fn toleration(key: &str, effect: &str, seconds: Option<i64>) -> Toleration {
    Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some(effect.to_owned()),
        toleration_seconds: seconds,
        value: None,
    }
}

/// The patch and warnings for a pod that opted in and carries no stash.
fn plan(object: &Value, policy: &Policy, claims: &dyn ClaimNodes) -> Result<(Patch, Vec<String>), String> {
    // Decoded from the borrowed tree: no copy of the object.
    let pod = Pod::deserialize(object).map_err(|e| format!("the pod does not decode: {e}"))?;
    let spec = pod.spec.ok_or("the pod has no spec")?;
    let keep = &policy.ignore_selector_keys;
    let mut warnings = Vec::new();

    // nodeSelector: ignored keys stay (they steer the choice of cluster), the rest goes down.
    let (mut upper_selector, lower_selector): (BTreeMap<_, _>, BTreeMap<_, _>) = spec
        .node_selector
        .clone()
        .unwrap_or_default()
        .into_iter()
        .partition(|(k, _)| keep.contains(k));

    // Required node affinity, term by term.
    let node_affinity = spec.affinity.as_ref().and_then(|a| a.node_affinity.clone());
    let terms: Vec<NodeSelectorTerm> = node_affinity
        .as_ref()
        .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|r| r.node_selector_terms.clone())
        .unwrap_or_default();
    let splits: Vec<Split> = terms.iter().map(|t| split_term(t, keep)).collect();
    if splits.len() > 1
        && splits
            .iter()
            .any(|s| !term_is_empty(&s.upper) && !term_is_empty(&s.lower))
    {
        warnings.push(
            "tensile webhook: node-affinity terms mix cluster keys with lower-cluster keys; \
             each side keeps its own OR, so which lower constraints go with which cluster is lost"
                .to_owned(),
        );
    }
    let lower_terms = if splits.is_empty() {
        None
    } else {
        side(splits.iter().map(|s| s.lower.clone()))
    };
    let mut upper_terms = if splits.is_empty() {
        None
    } else {
        side(splits.into_iter().map(|s| s.upper))
    };

    // A PVC already bound for a virtual node pins the pod there.
    let mut volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.persistent_volume_claim.as_ref().map(|c| c.claim_name.as_str()))
        .collect();
    volumes.sort_unstable();
    volumes.dedup();
    let pins: BTreeMap<&str, &str> = volumes
        .into_iter()
        .filter_map(|claim| claims.selected_node(claim).map(|node| (node, claim)))
        .collect();
    if pins.len() > 1 {
        let list: Vec<String> = pins
            .iter()
            .map(|(node, claim)| format!("PVC {claim} on {node}"))
            .collect();
        return Err(format!(
            "the pod's volumes are bound to different nodes ({}); it cannot run on all of them",
            list.join(", ")
        ));
    }

    // What keeps the upper pod on virtual nodes (and on the pinned one).
    let mut add_expressions = Vec::new();
    let vlabel = &policy.virtual_node_label;
    match policy.virtual_node_constraint {
        VirtualNodeConstraint::Affinity => add_expressions.push(NodeSelectorRequirement {
            key: vlabel.key.clone(),
            operator: "In".into(),
            values: Some(vec![vlabel.value.clone()]),
        }),
        VirtualNodeConstraint::NodeSelector => {
            upper_selector.insert(vlabel.key.clone(), vlabel.value.clone());
        }
        VirtualNodeConstraint::None => {}
    }
    let add_fields: Vec<NodeSelectorRequirement> = pins
        .keys()
        .map(|node| NodeSelectorRequirement {
            key: "metadata.name".into(),
            operator: "In".into(),
            values: Some(vec![(*node).to_owned()]),
        })
        .collect();
    if !add_expressions.is_empty() || !add_fields.is_empty() {
        let base = upper_terms
            .take()
            .unwrap_or_else(|| vec![NodeSelectorTerm::default()]);
        upper_terms = Some(
            base.into_iter()
                .map(|mut t| {
                    if !add_expressions.is_empty() {
                        t.match_expressions
                            .get_or_insert_default()
                            .extend(add_expressions.iter().cloned());
                    }
                    if !add_fields.is_empty() {
                        t.match_fields
                            .get_or_insert_default()
                            .extend(add_fields.iter().cloned());
                    }
                    t
                })
                .collect(),
        );
    }
    let preferred = node_affinity.and_then(|na| na.preferred_during_scheduling_ignored_during_execution);
    let upper_affinity = required(upper_terms, preferred);
    let lower_affinity = required(lower_terms, None);

    let upper_tolerations = vec![
        toleration(names::VIRTUAL_NODE_TAINT, "NoSchedule", None),
        toleration(
            names::TAINT_NODE_NOT_READY,
            "NoExecute",
            Some(policy.not_ready_seconds),
        ),
        toleration(
            names::TAINT_NODE_UNREACHABLE,
            "NoExecute",
            Some(policy.unreachable_seconds),
        ),
    ];
    let stash = Stash::new(
        lower_selector,
        lower_affinity,
        spec.tolerations.clone().unwrap_or_default(),
    );
    let stash_text = stash.encode().map_err(|e| e.to_string())?;

    // The patch touches only the fields that change, judged on the raw object so that fields
    // this code does not model are never rewritten.
    let mut ops = Vec::new();
    match object.pointer("/metadata/annotations") {
        Some(Value::Object(_)) => ops.push(add(
            &["metadata", "annotations", names::CLUSTER_SELECTOR],
            Value::String(stash_text),
        )),
        _ => ops.push(add(
            &["metadata", "annotations"],
            serde_json::json!({ names::CLUSTER_SELECTOR: stash_text }),
        )),
    }
    let raw_spec = object.get("spec");
    let raw = |key: &str| raw_spec.and_then(|s| s.get(key));
    let new_selector = to_value("nodeSelector", &upper_selector)?;
    match raw("nodeSelector") {
        Some(old) if upper_selector.is_empty() => {
            if !old.is_null() {
                ops.push(remove(&["spec", "nodeSelector"]));
            }
        }
        Some(old) if *old == new_selector => {}
        _ if upper_selector.is_empty() => {}
        _ => ops.push(add(&["spec", "nodeSelector"], new_selector)),
    }
    let raw_affinity = raw("affinity").filter(|a| a.is_object());
    let raw_node_affinity = raw_affinity
        .and_then(|a| a.get("nodeAffinity"))
        .filter(|n| !n.is_null());
    match (upper_affinity, raw_node_affinity) {
        (None, None) => {}
        (None, Some(_)) => ops.push(remove(&["spec", "affinity", "nodeAffinity"])),
        (Some(na), old) => {
            let new = to_value("node affinity", &na)?;
            if old != Some(&new) {
                match raw_affinity {
                    Some(_) => ops.push(add(&["spec", "affinity", "nodeAffinity"], new)),
                    None => ops.push(add(
                        &["spec", "affinity"],
                        serde_json::json!({ "nodeAffinity": new }),
                    )),
                }
            }
        }
    }
    let new_tolerations = to_value("tolerations", &upper_tolerations)?;
    if raw("tolerations") != Some(&new_tolerations) {
        ops.push(add(&["spec", "tolerations"], new_tolerations));
    }
    Ok((Patch(ops), warnings))
}

#[cfg(test)]
#[path = "mutate_tests.rs"]
mod tests;
