//! The pure mutation: one review in, one response out, no I/O.
//!
//! The only outside knowledge a mutation needs, which node a bound PVC selected, is looked
//! up between two steps: [`judge`] answers every review it can and hands back an opted-in
//! pod to stash, whose PVCs ([`Stashing::claims`]) the caller looks up before
//! [`Stashing::finish`] writes the patch. [`mutate`] takes both steps at once.
//!
//! The pod is decoded once, before anything is read from it, into [`PodMembers`]: the
//! members the webhook reads or rewrites, with their API types. The rest of the pod stays
//! text: the patch never names it, and the apiserver validates it after admission. A pod
//! whose members do not decode is refused rather than patched; only then are its labels and
//! stash read from the raw JSON ([`crate::raw`]), to tell a pod that is not ours, or already
//! stashed, from one to refuse.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Toleration,
};
use kube::core::admission::Operation;
use serde::ser::{SerializeMap as _, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use tensile_common::names;
use tensile_common::stash::{Holder, Stash, generated_name};

use crate::outcome::{Outcome, Verdict, allow, deny, patched};
use crate::policy::{Policy, VirtualNodeConstraint};
use crate::raw::{self, Level};
use crate::review::{self, Review};

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

/// The virtual nodes the workload of a pod must avoid, by the UID of the pod's controller
/// (the descheduler's exclusion records).
pub trait ExcludedNodes {
    fn excluded_nodes(&self, owner_uid: &str) -> Vec<String>;
}

/// No workload avoids any node.
pub struct NoExclusions;

impl ExcludedNodes for NoExclusions {
    fn excluded_nodes(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

impl ExcludedNodes for tensile_common::exclusion::Exclusions {
    fn excluded_nodes(&self, owner_uid: &str) -> Vec<String> {
        tensile_common::exclusion::Exclusions::excluded_nodes(self, owner_uid, jiff::Timestamp::now())
    }
}

/// A review after the first step.
// Made and taken apart once per review: boxing the answer would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Judgement<'a> {
    /// Answered without asking about PVCs.
    Decided(Outcome),
    /// An opted-in pod without a stash: to be stashed.
    Stash(Stashing<'a>),
}

/// The members of a pod that the webhook reads or rewrites, decoded with the types the API
/// gives them (`Pod`'s own decoding rules: a missing or `null` member is `None`, unknown
/// members are skipped). Everything else in the pod is left as the text it came in.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodMembers {
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<MetadataMembers>,
    spec: Option<SpecMembers>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataMembers {
    /// Read to bind the stash's signature to a pod without a controller.
    name: Option<String>,
    generate_name: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    /// Read only for the controller's UID, and never a reason to refuse a pod: malformed
    /// owners are the apiserver's to reject, and mean no exclusion here.
    owner_references: Option<Box<serde_json::value::RawValue>>,
}

#[derive(Deserialize)]
struct OwnerMembers {
    uid: String,
    controller: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecMembers {
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<AffinityMembers>,
    tolerations: Option<Vec<Toleration>>,
    volumes: Option<Vec<VolumeMembers>>,
    scheduler_name: Option<String>,
}

/// Only node affinity is read; pod (anti-)affinity stays on the upper pod untouched.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AffinityMembers {
    node_affinity: Option<NodeAffinity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct VolumeMembers {
    persistent_volume_claim: Option<ClaimMembers>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClaimMembers {
    claim_name: String,
}

impl PodMembers {
    /// Decodes `object`, held to being a v1 Pod where it says what it is.
    fn decode(object: &RawValue) -> Result<Self, String> {
        let pod: Self = serde_json::from_str(object.get()).map_err(|e| review::message(&e))?;
        if let Some(v) = pod.api_version.as_deref().filter(|v| *v != "v1") {
            return Err(format!("apiVersion {v:?}, expected \"v1\""));
        }
        if let Some(k) = pod.kind.as_deref().filter(|k| *k != "Pod") {
            return Err(format!("kind {k:?}, expected \"Pod\""));
        }
        Ok(pod)
    }

    fn label(&self, key: &str) -> Option<&String> {
        self.metadata.as_ref()?.labels.as_ref()?.get(key)
    }

    fn annotation(&self, key: &str) -> Option<&String> {
        self.metadata.as_ref()?.annotations.as_ref()?.get(key)
    }
}

/// An opted-in pod, decoded, that carries no stash yet.
pub struct Stashing<'a> {
    review: &'a Review,
    object: &'a RawValue,
    pod: PodMembers,
}

impl Stashing<'_> {
    /// The PVCs whose selected node [`Stashing::finish`] will ask about.
    pub fn claims(&self) -> Vec<String> {
        let volumes = self.pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
        let mut claims: Vec<String> = volumes
            .filter_map(|v| v.persistent_volume_claim.as_ref())
            .map(|c| c.claim_name.clone())
            .collect();
        claims.sort();
        claims.dedup();
        claims
    }

    /// The second step: the patch, given the nodes the pod's PVCs selected.
    pub fn finish(self, policy: &Policy, claims: &dyn ClaimNodes) -> Outcome {
        self.finish_excluding(policy, claims, &NoExclusions)
    }

    /// The second step, with the virtual nodes the pod's workload must avoid: after the
    /// stash split, a `kubernetes.io/hostname NotIn` requirement joins every upper term, so
    /// it steers the upper scheduler and never reaches the lower pod.
    pub fn finish_excluding(
        self,
        policy: &Policy,
        claims: &dyn ClaimNodes,
        excluded: &dyn ExcludedNodes,
    ) -> Outcome {
        let review = self.review;
        let namespace = review.request.namespace.as_deref().unwrap_or_default();
        let uid = review.request.uid.as_str();
        match plan(self.object, self.pod, namespace, uid, policy, claims, excluded) {
            Ok((patch, warnings)) => patched(review, patch, warnings),
            Err(message) => deny(review, message),
        }
    }
}

fn encode(ops: &[Op<'_>]) -> Result<Vec<u8>, String> {
    let mut patch = Vec::with_capacity(2048);
    serde_json::to_writer(&mut patch, ops).map_err(|e| format!("cannot encode the patch: {e}"))?;
    Ok(patch)
}

/// The scheduler the policy hands opted-in pods, for a pod left to the default scheduler
/// (the apiserver defaults an absent name before admission, so both forms are met).
fn scheduler_op<'a>(spec: Option<&SpecMembers>, policy: &'a Policy) -> Option<Op<'a>> {
    let name = policy.scheduler_name.as_deref()?;
    let current = spec.and_then(|s| s.scheduler_name.as_deref());
    match current {
        None | Some(names::DEFAULT_SCHEDULER) => Some(add(&["spec", "schedulerName"], New::Name(name))),
        Some(_) => None,
    }
}

/// The PVCs whose selected node [`mutate`] will ask about: those of a pod it will stash.
pub fn claims_to_look_up(review: &Review, policy: &Policy) -> Vec<String> {
    match judge(review, policy) {
        Judgement::Stash(pod) => pod.claims(),
        Judgement::Decided(_) => Vec::new(),
    }
}

/// Decides the review.
pub fn mutate(review: &Review, policy: &Policy, claims: &dyn ClaimNodes) -> Outcome {
    match judge(review, policy) {
        Judgement::Decided(outcome) => outcome,
        Judgement::Stash(pod) => pod.finish(policy, claims),
    }
}

/// The first step: everything but the patch, with no exclusion records.
pub fn judge<'a>(review: &'a Review, policy: &Policy) -> Judgement<'a> {
    judge_excluding(review, policy, &NoExclusions)
}

/// The first step, with the virtual nodes workloads must avoid: a pod written with its
/// stash is answered here, and gets its workload's exclusion as a stashed pod would.
pub fn judge_excluding<'a>(
    review: &'a Review,
    policy: &Policy,
    excluded: &dyn ExcludedNodes,
) -> Judgement<'a> {
    let unchanged = |response| {
        Judgement::Decided(Outcome {
            response,
            verdict: Verdict::Unchanged,
        })
    };
    if crate::job::is_job(review) {
        return Judgement::Decided(crate::job::judge(review, policy));
    }
    let object = match target(review, policy) {
        Ok(Some(object)) => object,
        Ok(None) => return unchanged(allow(review)),
        Err(Skip::NotAPod(what)) => {
            let mut response = allow(review);
            response.warnings = Some(vec![format!(
                "tensile webhook: {what} is not a pod and passes unchanged; the webhook registration should send only pods and opted-in Jobs"
            )]);
            return unchanged(response);
        }
        Err(Skip::Deny(message)) => return Judgement::Decided(deny(review, message)),
    };
    let opt_in = &policy.opt_in;
    match PodMembers::decode(object) {
        Ok(pod) => {
            if pod.label(&opt_in.key) != Some(&opt_in.value) {
                return unchanged(allow(review));
            }
            if let Some(text) = pod.annotation(names::CLUSTER_SELECTOR) {
                let outcome = stashed(review, Some(text));
                if outcome.verdict != Verdict::Unchanged {
                    return Judgement::Decided(outcome);
                }
                // A pod written with its stash (a template that carries one) still avoids
                // the nodes its workload is excluded from, or its replacement could land on
                // the refusing node again, and still goes to the configured scheduler.
                let exclusion = stashed_exclusion(&pod, excluded);
                let mut ops = Vec::new();
                if let Some((nodes, affinity)) = &exclusion {
                    let at = ["metadata", "annotations", names::EXCLUDED_NODES];
                    ops.push(match nodes {
                        Some(nodes) => add(&at, New::Stash(nodes)),
                        None => remove(&at),
                    });
                    match pod.spec.as_ref().and_then(|s| s.affinity.as_ref()) {
                        Some(_) => ops.push(add(
                            &["spec", "affinity", "nodeAffinity"],
                            New::NodeAffinity(affinity),
                        )),
                        None => ops.push(add(&["spec", "affinity"], New::Affinity(affinity))),
                    }
                }
                ops.extend(scheduler_op(pod.spec.as_ref(), policy));
                // With a key, the stash it was written with is signed for this pod, as a stash
                // made here would be: a bare pod the descheduler moves carries its original's
                // signature, bound to another name. (Writing a stash gains a pod nothing its
                // spec could not ask for: the same constraints in its spec would be stashed
                // and signed here.)
                let mut signed = None;
                if let Some(key) = &policy.stash_key {
                    let namespace = review.request.namespace.as_deref().unwrap_or_default();
                    let controller = controller_uid(pod.metadata.as_ref());
                    match sign(
                        key,
                        namespace,
                        pod.metadata.as_ref(),
                        controller.as_deref(),
                        review.request.uid.as_str(),
                        text,
                    ) {
                        Ok(pair) => signed = Some(pair),
                        Err(message) => return Judgement::Decided(deny(review, message)),
                    }
                }
                if let Some((signature, given)) = &signed {
                    if pod.annotation(names::STASH_SIGNATURE) != Some(signature) {
                        ops.push(add(
                            &["metadata", "annotations", names::STASH_SIGNATURE],
                            New::Stash(signature),
                        ));
                    }
                    if let Some(name) = given {
                        ops.push(add(&["metadata", "name"], New::Name(name)));
                    }
                }
                return Judgement::Decided(if ops.is_empty() {
                    outcome
                } else {
                    match encode(&ops) {
                        Ok(patch) => patched(review, patch, Vec::new()),
                        Err(message) => deny(review, message),
                    }
                });
            }
            Judgement::Stash(Stashing { review, object, pod })
        }
        Err(reason) => {
            let metadata = Level::of(object)
                .step("metadata")
                .map(Level::of)
                .unwrap_or_default();
            let label = metadata
                .step("labels")
                .and_then(|labels| Level::of(labels).step(&opt_in.key))
                .and_then(raw::string);
            if label.as_deref() != Some(opt_in.value.as_str()) {
                return unchanged(allow(review));
            }
            let stash = metadata
                .step("annotations")
                .and_then(|a| Level::of(a).step(names::CLUSTER_SELECTOR));
            if let Some(text) = stash {
                return Judgement::Decided(stashed(review, raw::string(text).as_deref()));
            }
            Judgement::Decided(deny(review, format!("the pod does not decode: {reason}")))
        }
    }
}

/// The controller's UID of a pod (`None`: a bare pod, or owners that do not decode, which
/// are the apiserver's to reject).
fn controller_uid(metadata: Option<&MetadataMembers>) -> Option<String> {
    metadata
        .and_then(|m| m.owner_references.as_ref())
        .and_then(|raw| serde_json::from_str::<Vec<OwnerMembers>>(raw.get()).ok())
        .and_then(|owners| owners.into_iter().find(|o| o.controller == Some(true)))
        .map(|o| o.uid)
}

/// For a pod that already carries a stash: its workload's exclusion now, as the
/// excluded-nodes text (`None`: the annotation goes) and the node affinity with
/// `kubernetes.io/hostname NotIn` joined to every required term (or one term holding only
/// it). An exclusion of ours the pod was written with (its `tensile.io/excluded-nodes`: a
/// template copied from a pod) is taken out first: only the record's current one holds, so
/// a stale one never keeps the workload off a node for good. `None` when there is nothing
/// to change: no controller (a bare pod's replacement carries what the descheduler wrote),
/// the exclusion the pod carries is the current one (a re-invocation after the webhook
/// stashed it), or a volume pins the pod to its node (`matchFields metadata.name In`).
fn stashed_exclusion(
    pod: &PodMembers,
    excluded: &dyn ExcludedNodes,
) -> Option<(Option<String>, NodeAffinity)> {
    let written = pod.annotation(names::EXCLUDED_NODES);
    let mut ours: Vec<String> = written
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    ours.sort_unstable();
    let uid = controller_uid(pod.metadata.as_ref())?;
    let mut nodes = excluded.excluded_nodes(&uid);
    nodes.sort_unstable();
    if nodes == ours && (written.is_some() || nodes.is_empty()) {
        return None;
    }
    let node_affinity = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.clone())
        .unwrap_or_default();
    let terms = node_affinity
        .required_during_scheduling_ignored_during_execution
        .map(|r| r.node_selector_terms)
        .unwrap_or_default();
    if tensile_common::pin::pins(&terms) {
        return None;
    }
    let mut terms: Vec<NodeSelectorTerm> = terms
        .into_iter()
        .filter_map(|t| without_exclusion(t, &ours))
        .collect();
    if terms.is_empty() && !nodes.is_empty() {
        terms.push(NodeSelectorTerm::default());
    }
    if !nodes.is_empty() {
        let exclusion = NodeSelectorRequirement {
            key: names::HOSTNAME_LABEL.into(),
            operator: "NotIn".into(),
            values: Some(nodes.clone()),
        };
        for t in &mut terms {
            t.match_expressions
                .get_or_insert_default()
                .push(exclusion.clone());
        }
    }
    let affinity = NodeAffinity {
        required_during_scheduling_ignored_during_execution: (!terms.is_empty()).then_some(NodeSelector {
            node_selector_terms: terms,
        }),
        preferred_during_scheduling_ignored_during_execution: node_affinity
            .preferred_during_scheduling_ignored_during_execution,
    };
    Some(((!nodes.is_empty()).then(|| nodes.join(",")), affinity))
}

/// `term` without the `kubernetes.io/hostname NotIn` values of `ours`; `None` when that
/// leaves it empty (a term the webhook made to hold only the exclusion).
fn without_exclusion(mut term: NodeSelectorTerm, ours: &[String]) -> Option<NodeSelectorTerm> {
    if ours.is_empty() {
        return Some(term);
    }
    let had = term.match_expressions.as_ref().is_some_and(|e| !e.is_empty())
        || term.match_fields.as_ref().is_some_and(|f| !f.is_empty());
    if let Some(expressions) = term.match_expressions.as_mut() {
        for r in expressions.iter_mut() {
            if r.key == names::HOSTNAME_LABEL
                && r.operator == "NotIn"
                && let Some(values) = r.values.as_mut()
            {
                values.retain(|v| !ours.contains(v));
            }
        }
        expressions.retain(|r| {
            !(r.key == names::HOSTNAME_LABEL
                && r.operator == "NotIn"
                && r.values.as_ref().is_none_or(Vec::is_empty))
        });
    }
    let empty = term.match_expressions.as_ref().is_none_or(Vec::is_empty)
        && term.match_fields.as_ref().is_none_or(Vec::is_empty);
    (!(had && empty)).then_some(term)
}

/// The answer for a pod that carries a stash (`None`: one that is not a string): a
/// re-invocation, or a pod written with its stash. It is never stashed twice.
fn stashed(review: &Review, text: Option<&str>) -> Outcome {
    match text.map(Stash::decode) {
        Some(Ok(_)) => Outcome {
            response: allow(review),
            verdict: Verdict::Unchanged,
        },
        Some(Err(e)) => deny(review, e.to_string()),
        None => deny(
            review,
            format!("annotation {} must be a string", names::CLUSTER_SELECTOR),
        ),
    }
}

enum Skip {
    NotAPod(String),
    Deny(String),
}

/// The pod object of a review that may be ours; `Ok(None)` when the review is not.
fn target<'a>(review: &'a Review, policy: &Policy) -> Result<Option<&'a RawValue>, Skip> {
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
    match review.object.as_deref() {
        Some(object) => Ok(Some(object)),
        None => Err(Skip::Deny("the CREATE review carries no pod".into())),
    }
}

/// A JSON pointer to `tokens`.
fn path(tokens: &[&str]) -> String {
    let mut out = String::with_capacity(tokens.iter().map(|t| t.len() + 1).sum::<usize>() + 4);
    for token in tokens {
        out.push('/');
        for c in token.chars() {
            match c {
                '~' => out.push_str("~0"),
                '/' => out.push_str("~1"),
                c => out.push(c),
            }
        }
    }
    out
}

/// A value of the patch, written straight from its typed form.
enum New<'a> {
    /// An annotation's text (the stash, the excluded nodes).
    Stash(&'a str),
    /// A new `annotations` holding only the stash, the excluded nodes and the stash's
    /// signature, the last two when there are.
    Annotations(&'a str, Option<&'a str>, Option<&'a str>),
    NodeSelector(&'a BTreeMap<String, String>),
    NodeAffinity(&'a NodeAffinity),
    /// A new `affinity` holding only node affinity.
    Affinity(&'a NodeAffinity),
    Tolerations(&'a [Toleration]),
    /// A plain string member (`schedulerName`, `metadata.name`).
    Name(&'a str),
}

impl Serialize for New<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            New::Stash(text) => serializer.serialize_str(text),
            New::Annotations(text, excluded, signature) => {
                let entries = 1 + usize::from(excluded.is_some()) + usize::from(signature.is_some());
                let mut map = serializer.serialize_map(Some(entries))?;
                map.serialize_entry(names::CLUSTER_SELECTOR, text)?;
                if let Some(nodes) = excluded {
                    map.serialize_entry(names::EXCLUDED_NODES, nodes)?;
                }
                if let Some(signature) = signature {
                    map.serialize_entry(names::STASH_SIGNATURE, signature)?;
                }
                map.end()
            }
            New::NodeSelector(selector) => selector.serialize(serializer),
            New::NodeAffinity(na) => na.serialize(serializer),
            New::Affinity(na) => {
                let mut map = serializer.serialize_map(Some(1))?;
                map.serialize_entry("nodeAffinity", na)?;
                map.end()
            }
            New::Tolerations(tolerations) => tolerations.serialize(serializer),
            New::Name(name) => serializer.serialize_str(name),
        }
    }
}

/// One RFC 6902 operation.
#[derive(Serialize)]
struct Op<'a> {
    op: &'static str,
    path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<New<'a>>,
}

fn add<'a>(tokens: &[&str], value: New<'a>) -> Op<'a> {
    Op {
        op: "add",
        path: path(tokens),
        value: Some(value),
    }
}

fn remove(tokens: &[&str]) -> Op<'static> {
    Op {
        op: "remove",
        path: path(tokens),
        value: None,
    }
}

/// Whether the field at `tokens` of the raw object is other than `new` as JSON (absent
/// counts as other). Asked only when the decoded field equals `new`: the raw one may still
/// hold what decoding drops (fields this code does not model, explicit nulls).
fn raw_differs<T: Serialize>(object: &RawValue, tokens: &[&str], new: &T) -> Result<bool, String> {
    let new = serde_json::to_value(new)
        .map_err(|e| format!("cannot encode the upper pod's {}: {e}", tokens.join(".")))?;
    let old = raw::pointer(object, tokens).and_then(|o| serde_json::from_str::<Value>(o.get()).ok());
    Ok(old.as_ref() != Some(&new))
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

/// The signature of `stash` for the pod of `metadata` in `namespace`, bound to its holder: its
/// controller (`controller_uid`), else its name; a bare `generateName` pod is named here, as
/// the apiserver would name it (its name is only given after mutating admission), and that
/// name is returned to be written.
fn sign(
    key: &tensile_common::stash::StashKey,
    namespace: &str,
    metadata: Option<&MetadataMembers>,
    controller_uid: Option<&str>,
    request_uid: &str,
    stash: &str,
) -> Result<(String, Option<String>), String> {
    let name = metadata.and_then(|m| m.name.as_deref()).filter(|n| !n.is_empty());
    let prefix = metadata
        .and_then(|m| m.generate_name.as_deref())
        .filter(|n| !n.is_empty());
    let given = match (controller_uid, name, prefix) {
        (None, None, Some(prefix)) => Some(generated_name(prefix, request_uid)),
        _ => None,
    };
    let holder = match (controller_uid, name, &given) {
        (Some(uid), _, _) => Holder::Controller(uid),
        (None, Some(name), _) => Holder::Name(name),
        (None, None, Some(given)) => Holder::Name(given),
        (None, None, None) => {
            return Err(
                "the pod has no controller, name or generateName to bind its stash signature to".into(),
            );
        }
    };
    Ok((key.sign(namespace, holder, stash), given))
}

/// The patch and warnings for a pod that opted in and carries no stash; `request_uid` is the
/// admission request's, which names a bare `generateName` pod whose stash is signed.
// One call site; the arguments are the review's parts and the outside knowledge.
#[allow(clippy::too_many_arguments)]
fn plan(
    object: &RawValue,
    pod: PodMembers,
    namespace: &str,
    request_uid: &str,
    policy: &Policy,
    claims: &dyn ClaimNodes,
    excluded: &dyn ExcludedNodes,
) -> Result<(Vec<u8>, Vec<String>), String> {
    let PodMembers { metadata, spec, .. } = pod;
    let controller_uid = controller_uid(metadata.as_ref());
    let mut spec = spec.ok_or("the pod has no spec")?;
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
    let node_affinity = spec.affinity.as_ref().and_then(|a| a.node_affinity.as_ref());
    let terms: &[NodeSelectorTerm] = node_affinity
        .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
        .map_or(&[], |r| &r.node_selector_terms);
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
    let (uppers, lowers): (Vec<_>, Vec<_>) = splits.into_iter().map(|s| (s.upper, s.lower)).unzip();
    let lower_terms = side(lowers.into_iter());
    let mut upper_terms = side(uppers.into_iter());

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
    // The descheduler's exclusion of the workload, unless a volume pins the pod to its node.
    let excluded_nodes = match &controller_uid {
        Some(uid) if pins.is_empty() => excluded.excluded_nodes(uid),
        _ => Vec::new(),
    };
    if !excluded_nodes.is_empty() {
        add_expressions.push(NodeSelectorRequirement {
            key: names::HOSTNAME_LABEL.into(),
            operator: "NotIn".into(),
            values: Some(excluded_nodes.clone()),
        });
    }
    let excluded_text = excluded_nodes.join(",");
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
    let preferred =
        node_affinity.and_then(|na| na.preferred_during_scheduling_ignored_during_execution.clone());
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
    // Judged before the pod's own tolerations move into the stash.
    let new_tolerations = spec.tolerations.as_ref() != Some(&upper_tolerations)
        || raw_differs(object, &["spec", "tolerations"], &upper_tolerations)?;
    let stash = Stash::new(
        lower_selector,
        lower_affinity,
        spec.tolerations.take().unwrap_or_default(),
    );
    let stash_text = stash.encode().map_err(|e| e.to_string())?;
    // The signature binds the stash to the pod's controller, or to the name of a bare pod.
    // A bare `generateName` pod is named here, as the apiserver would name it, since its name
    // is only given after mutating admission.
    let (signature, given_name) = match &policy.stash_key {
        None => (None, None),
        Some(key) => {
            let (signature, given_name) = sign(
                key,
                namespace,
                metadata.as_ref(),
                controller_uid.as_deref(),
                request_uid,
                &stash_text,
            )?;
            (Some(signature), given_name)
        }
    };

    // The patch touches only the fields that change. The decoded pod tells when a field
    // differs; when it reads the same, the raw field decides.
    let mut ops = Vec::new();
    let excluded_annotation = (!excluded_text.is_empty()).then_some(excluded_text.as_str());
    match metadata.and_then(|m| m.annotations) {
        Some(_) => {
            ops.push(add(
                &["metadata", "annotations", names::CLUSTER_SELECTOR],
                New::Stash(&stash_text),
            ));
            if let Some(text) = excluded_annotation {
                ops.push(add(
                    &["metadata", "annotations", names::EXCLUDED_NODES],
                    New::Stash(text),
                ));
            }
            if let Some(signature) = &signature {
                ops.push(add(
                    &["metadata", "annotations", names::STASH_SIGNATURE],
                    New::Stash(signature),
                ));
            }
        }
        None => ops.push(add(
            &["metadata", "annotations"],
            New::Annotations(&stash_text, excluded_annotation, signature.as_deref()),
        )),
    }
    match &spec.node_selector {
        Some(_) if upper_selector.is_empty() => ops.push(remove(&["spec", "nodeSelector"])),
        Some(old) if *old == upper_selector => {}
        _ if upper_selector.is_empty() => {}
        _ => ops.push(add(&["spec", "nodeSelector"], New::NodeSelector(&upper_selector))),
    }
    let old_node_affinity = spec.affinity.as_ref().and_then(|a| a.node_affinity.as_ref());
    match (&upper_affinity, old_node_affinity) {
        (None, None) => {}
        (None, Some(_)) => ops.push(remove(&["spec", "affinity", "nodeAffinity"])),
        (Some(na), old) => {
            if old != Some(na) || raw_differs(object, &["spec", "affinity", "nodeAffinity"], na)? {
                match spec.affinity {
                    Some(_) => ops.push(add(&["spec", "affinity", "nodeAffinity"], New::NodeAffinity(na))),
                    None => ops.push(add(&["spec", "affinity"], New::Affinity(na))),
                }
            }
        }
    }
    if new_tolerations {
        ops.push(add(
            &["spec", "tolerations"],
            New::Tolerations(&upper_tolerations),
        ));
    }
    ops.extend(scheduler_op(Some(&spec), policy));
    if let Some(name) = &given_name {
        ops.push(add(&["metadata", "name"], New::Name(name)));
    }
    Ok((encode(&ops)?, warnings))
}

#[cfg(test)]
#[path = "mutate_tests.rs"]
mod tests;
