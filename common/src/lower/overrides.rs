//! Per-lower-cluster pod overrides: what differs between lower clusters (a registry mirror,
//! dedicated nodes behind a taint, a PriorityClass or RuntimeClass of another name, a
//! StorageClass of another name, an environment variable naming the region) said once per
//! cluster and applied to every pod that goes there.
//!
//! The model. A set of overrides is a list of rules, a StorageClass name map for claims, and
//! whether rules may weaken isolation (`allowPrivileged`). A rule selects pods by namespace
//! and labels (of the upper pod, as the user wrote it) and holds operations on the lower pod.
//! When a pod is created below, after the translation (the stash applied, upper-only fields
//! dropped), the rules that select it are applied in list order, and each rule's operations
//! in this fixed order: image rewrite, tolerations, nodeSelector, nodeSelectorTerms,
//! PriorityClass names, RuntimeClass names, env, labels, annotations, JSON patch.
//!
//! A rule that cannot be applied to a pod (a patch path the pod lacks, a nodeSelector the
//! pod contradicts, a change that would weaken isolation) refuses that pod with the reason;
//! other pods are not affected. Without `allowPrivileged`, no rule may add host namespaces,
//! privileged containers, added capabilities, host ports or hostPath volumes; no rule may
//! change the labels and annotations the virtual node owns (`tensile.io/…`).
//!
//! The lower pod records the rules that applied, as written ([`names::OVERRIDES`]). The
//! updates that follow a running pod down (images, tolerations, labels) go through those
//! recorded rules, never the rules in force now: a rewritten image stays rewritten, and a
//! rule edited while pods run reaches new pods only.
//!
//! Rules are checked when loaded: the schema, regular expressions, selectors, tolerations,
//! node selector terms, reserved keys, and each rule applied to a sample pod (one container
//! `app`, the shape every lower pod has). A set that fails is refused whole with the reason,
//! and the rules in force stay.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use crate::names;
use crate::overrides::{self as placement, PlacementOverrides, PlacementRule};
use json_patch::PatchOperation;
use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec,
    Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most bytes a set of rules may take written out: every lower pod may carry them in its
/// record, and a pod's annotations hold 256 KiB in all.
const MAX_RECORD: usize = 32 * 1024;

/// One lower cluster's overrides, as written (in a `LowerCluster`'s `spec.overrides`, or the
/// virtual node's `--overrides-file`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Overrides {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
    /// Upper StorageClass name → the lower cluster's, for the claims made below.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub storage_classes: BTreeMap<String, String>,
    /// Rules may add host namespaces, privileged containers, capabilities, host ports and
    /// hostPath volumes to pods of this cluster.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_privileged: bool,
}

/// One rule: which pods, and what changes in their lower pods.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// Named in the lower pod's record and the upper pod's event: a DNS label, unique.
    pub name: String,
    /// Pods of these namespaces; every namespace when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// Pods whose (upper) labels it selects; every pod when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageRewrite>,
    /// Added, unless the pod has the same one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Added to the pod's nodeSelector; a key the pod sets to another value refuses the pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity, in conjunction with the pod's own: the pod then needs a node
    /// matching one of its terms and one of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_selector_terms: Vec<NodeSelectorTerm>,
    /// PriorityClass name upstream → name below.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub priority_class_names: BTreeMap<String, String>,
    /// RuntimeClass name upstream → name below.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub runtime_class_names: BTreeMap<String, String>,
    /// Set in every container and init container (replacing a variable of the same name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// RFC 6902 operations on the lower pod, under `/spec/`, `/metadata/labels/` or
    /// `/metadata/annotations/`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patch: Vec<Value>,
}

/// How a rule rewrites images: exactly one of `prefix` and `regex`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageRewrite {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixRewrite>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<RegexRewrite>,
}

/// An image starting with `from` (as written, or as a container runtime reads it: `nginx` is
/// `docker.io/library/nginx`) starts with `to` instead.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PrefixRewrite {
    pub from: String,
    pub to: String,
}

/// The first match of `pattern` (Rust regular expression syntax) in the image, as written,
/// is replaced by `replacement` (`$1`, `${name}` name groups).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegexRewrite {
    pub pattern: String,
    pub replacement: String,
}

/// Why a set of overrides is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// A set of overrides checked and ready to apply.
#[derive(Debug, Default)]
pub struct Compiled {
    overrides: Overrides,
    rules: Vec<Ready>,
}

/// What a rule needs at apply time besides what it says.
#[derive(Debug)]
struct Ready {
    image: Option<Rewrite>,
    patch: Vec<PatchOperation>,
}

#[derive(Debug)]
enum Rewrite {
    Prefix { from: String, to: String },
    Regex(regex::Regex, String),
}

/// Reads overrides from YAML or JSON text; empty text is no overrides.
pub fn parse(text: &str) -> Result<Overrides, Invalid> {
    if text.trim().is_empty() {
        return Ok(Overrides::default());
    }
    let value: Value = serde_yaml::from_str(text).map_err(|e| Invalid(format!("not YAML or JSON: {e}")))?;
    Overrides::from_value(value)
}

impl Overrides {
    /// Reads overrides from a JSON value, naming the rule (index and name) a schema error is
    /// in.
    pub fn from_value(value: Value) -> Result<Self, Invalid> {
        let mut top = match value {
            Value::Null => return Ok(Self::default()),
            Value::Object(top) => top,
            other => {
                return Err(Invalid(format!(
                    "overrides must be a mapping (rules, storageClasses, allowPrivileged), not {other}"
                )));
            }
        };
        let rules = top.remove("rules");
        let mut overrides: Overrides =
            serde_json::from_value(Value::Object(top)).map_err(|e| Invalid(format!("overrides: {e}")))?;
        let rules = match rules {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(rules)) => rules,
            Some(other) => return Err(Invalid(format!("rules must be a list, not {other}"))),
        };
        for (i, rule) in rules.into_iter().enumerate() {
            let name = rule
                .get("name")
                .and_then(Value::as_str)
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            let parsed: Rule = serde_json::from_value(rule.clone())
                .map_err(|e| Invalid(format!("rules[{i}]{name}: {e}")))?;
            // The API types inside a rule (tolerations, env, selectors) ignore a field they
            // lack: a misspelt one would be dropped without a word.
            let read =
                serde_json::to_value(&parsed).map_err(|e| Invalid(format!("rules[{i}]{name}: {e}")))?;
            if let Some(path) = lost(&rule, &read, String::new()) {
                return Err(Invalid(format!(
                    "rules[{i}]{name}: {path} is not a field of a rule"
                )));
            }
            overrides.rules.push(parsed);
        }
        Ok(overrides)
    }

    /// Checks every rule (each applied to a sample pod) and readies them.
    pub fn compile(self) -> Result<Compiled, Invalid> {
        let mut seen = BTreeSet::new();
        let mut rules = Vec::new();
        for rule in &self.rules {
            if !seen.insert(rule.name.as_str()) {
                return Err(Invalid(format!("rule {:?} is named twice", rule.name)));
            }
            rules.push(ready(rule).map_err(|e| Invalid(format!("rule {:?}: {e}", rule.name)))?);
        }
        for (from, to) in &self.storage_classes {
            if !is_name(from) || !is_name(to) {
                return Err(Invalid(format!(
                    "storageClasses: {from:?} → {to:?} is not a map of StorageClass names"
                )));
            }
        }
        let size = serde_json::to_string(&self.rules).map_or(0, |r| r.len());
        if size > MAX_RECORD {
            return Err(Invalid(format!(
                "the rules take {size} bytes written out; at most {MAX_RECORD} fit the record every lower pod carries"
            )));
        }
        let compiled = Compiled {
            overrides: self,
            rules,
        };
        for (rule, ready) in compiled.overrides.rules.iter().zip(&compiled.rules) {
            compiled.sample_check(rule, ready)?;
        }
        Ok(compiled)
    }
}

/// A Kubernetes object name (DNS subdomain).
fn is_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(names::is_dns_label)
}

/// Whether `key` is a label or annotation key: an optional DNS subdomain prefix and `/`,
/// then a name of at most 63 letters, digits, `-`, `_` and `.`, starting and ending with a
/// letter or digit.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    prefix.is_none_or(is_name) && !name.is_empty() && is_label_value(name)
}

/// Whether `value` is a label value: empty, or at most 63 letters, digits, `-`, `_` and
/// `.`, starting and ending with a letter or digit.
fn is_label_value(value: &str) -> bool {
    let edge = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edge(value.chars().next())
        && edge(value.chars().last())
}

/// Whether the virtual node owns this label or annotation key of a lower pod.
fn reserved(key: &str) -> bool {
    key.starts_with(names::PREFIX) || key == names::CLUSTER_SELECTOR
}

fn ready(rule: &Rule) -> Result<Ready, String> {
    if !names::is_dns_label(&rule.name) {
        return Err("the name must be a DNS label (lowercase letters, digits and '-', at most 63)".into());
    }
    if let Some(ns) = rule.namespaces.iter().find(|n| !names::is_dns_label(n)) {
        return Err(format!("namespaces: {ns:?} is not a namespace name"));
    }
    if let Some(selector) = &rule.selector {
        for r in selector.match_expressions.iter().flatten() {
            let values = r.values.as_deref().unwrap_or_default();
            match (r.operator.as_str(), values.is_empty()) {
                ("In" | "NotIn", false) | ("Exists" | "DoesNotExist", true) => {}
                ("In" | "NotIn", true) => {
                    return Err(format!("selector: {} {} needs values", r.key, r.operator));
                }
                ("Exists" | "DoesNotExist", false) => {
                    return Err(format!("selector: {} {} takes no values", r.key, r.operator));
                }
                (op, _) => {
                    return Err(format!(
                        "selector: operator {op:?} of {} is not In, NotIn, Exists or DoesNotExist",
                        r.key
                    ));
                }
            }
        }
    }
    let image = match &rule.image {
        None => None,
        Some(ImageRewrite {
            prefix: Some(p),
            regex: None,
        }) => {
            if p.from.is_empty()
                || p.to.is_empty()
                || p.from.contains(char::is_whitespace)
                || p.to.contains(char::is_whitespace)
            {
                return Err("image.prefix: from and to must be non-empty image prefixes".into());
            }
            if p.to.contains("://") {
                return Err(format!(
                    "image.prefix: to {:?} names a scheme; an image reference has none",
                    p.to
                ));
            }
            Some(Rewrite::Prefix {
                from: p.from.clone(),
                to: p.to.clone(),
            })
        }
        Some(ImageRewrite {
            prefix: None,
            regex: Some(r),
        }) => {
            let compiled = regex::Regex::new(&r.pattern).map_err(|e| format!("image.regex: {e}"))?;
            Some(Rewrite::Regex(compiled, r.replacement.clone()))
        }
        Some(_) => return Err("image: give exactly one of prefix and regex".into()),
    };
    for t in &rule.tolerations {
        check_toleration(t)?;
    }
    if let Some((k, v)) = rule
        .node_selector
        .iter()
        .find(|(k, v)| !is_label_key(k) || !is_label_value(v))
    {
        return Err(format!("nodeSelector: {k}={v} is not a label"));
    }
    for term in &rule.node_selector_terms {
        let expressions = term.match_expressions.iter().flatten();
        let fields = term.match_fields.iter().flatten();
        let mut any = false;
        for r in expressions.chain(fields) {
            any = true;
            check_node_requirement(r)?;
        }
        if !any {
            return Err("nodeSelectorTerms: an empty term matches no node".into());
        }
    }
    for (what, map) in [
        ("priorityClassNames", &rule.priority_class_names),
        ("runtimeClassNames", &rule.runtime_class_names),
    ] {
        if let Some((from, to)) = map.iter().find(|(from, to)| !is_name(from) || !is_name(to)) {
            return Err(format!("{what}: {from:?} → {to:?} is not a map of names"));
        }
    }
    let mut env = BTreeSet::new();
    for e in &rule.env {
        if e.name.is_empty() || e.name.contains('=') || !env.insert(e.name.as_str()) {
            return Err(format!("env: {:?} is empty, holds '=' or is set twice", e.name));
        }
    }
    for (what, map) in [("labels", &rule.labels), ("annotations", &rule.annotations)] {
        if let Some(key) = map.keys().find(|k| reserved(k)) {
            return Err(format!(
                "{what}: {key:?} is a key the virtual node owns ({}…, {})",
                names::PREFIX,
                names::CLUSTER_SELECTOR
            ));
        }
        if let Some(key) = map.keys().find(|k| !is_label_key(k)) {
            return Err(format!(
                "{what}: {key:?} is not a key (a DNS subdomain prefix and '/', then a name)"
            ));
        }
    }
    if let Some((k, v)) = rule.labels.iter().find(|(_, v)| !is_label_value(v)) {
        return Err(format!(
            "labels: {k}={v:?} is not a label value (at most 63 letters, digits, '-', '_' and '.')"
        ));
    }
    let mut patch = Vec::new();
    for (i, op) in rule.patch.iter().enumerate() {
        let op: PatchOperation =
            serde_json::from_value(op.clone()).map_err(|e| format!("patch[{i}]: {e}"))?;
        let mut paths = vec![op.path().to_owned()];
        match &op {
            PatchOperation::Move(m) => paths.push(m.from.clone()),
            PatchOperation::Copy(c) => paths.push(c.from.clone()),
            _ => {}
        }
        for path in paths {
            patch_path_allowed(&path).map_err(|e| format!("patch[{i}]: path {:?} {e}", path.as_str()))?;
        }
        patch.push(op);
    }
    Ok(Ready { image, patch })
}

/// A patch may change the lower pod's spec, and its labels and annotations other than the
/// virtual node's own: never its name, namespace or owner, nor its status.
fn patch_path_allowed(path: &json_patch::jsonptr::Pointer) -> Result<(), String> {
    let tokens: Vec<String> = path.tokens().map(|t| t.decoded().into_owned()).collect();
    match tokens.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["spec", _, ..] => Ok(()),
        ["metadata", "labels" | "annotations", key, ..] if !reserved(key) => Ok(()),
        ["metadata", "labels" | "annotations", _, ..] => Err("changes a key the virtual node owns".into()),
        _ => Err("is not under /spec/, /metadata/labels/ or /metadata/annotations/".into()),
    }
}

fn check_toleration(t: &Toleration) -> Result<(), String> {
    let key = t.key.as_deref().unwrap_or_default();
    let operator = t.operator.as_deref().unwrap_or("Equal");
    let value = t.value.as_deref().unwrap_or_default();
    let effect = t.effect.as_deref().unwrap_or_default();
    match operator {
        "Exists" if !value.is_empty() => Err(format!("tolerations: {key} Exists takes no value")),
        "Exists" => Ok(()),
        "Equal" if key.is_empty() => Err("tolerations: an empty key needs operator Exists".into()),
        "Equal" => Ok(()),
        op => Err(format!(
            "tolerations: operator {op:?} of {key} is not Equal or Exists"
        )),
    }?;
    if !["", "NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&effect) {
        return Err(format!(
            "tolerations: effect {effect:?} of {key} is not NoSchedule, PreferNoSchedule or NoExecute"
        ));
    }
    if t.toleration_seconds.is_some() && effect != "NoExecute" {
        return Err(format!(
            "tolerations: tolerationSeconds of {key} needs effect NoExecute"
        ));
    }
    Ok(())
}

fn check_node_requirement(r: &NodeSelectorRequirement) -> Result<(), String> {
    let values = r.values.as_deref().unwrap_or_default();
    let ok = match r.operator.as_str() {
        "In" | "NotIn" => !values.is_empty(),
        "Exists" | "DoesNotExist" => values.is_empty(),
        "Gt" | "Lt" => values.len() == 1 && values[0].parse::<i64>().is_ok(),
        op => {
            return Err(format!(
                "nodeSelectorTerms: operator {op:?} of {} is not In, NotIn, Exists, DoesNotExist, Gt or Lt",
                r.key
            ));
        }
    };
    match ok && !r.key.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "nodeSelectorTerms: {:?} {} {values:?}: In and NotIn need values, Exists and DoesNotExist none, Gt and Lt one integer",
            r.key, r.operator
        )),
    }
}

/// The pod every rule is tried on when loaded: the shape of every lower pod (labels,
/// annotations, one container `app`).
fn sample_pod() -> Pod {
    Pod {
        metadata: kube::api::ObjectMeta {
            name: Some("sample".into()),
            namespace: Some("default".into()),
            labels: Some(BTreeMap::from([(
                names::MARK_NODE.to_owned(),
                "sample".to_owned(),
            )])),
            annotations: Some(BTreeMap::new()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![k8s_openapi::api::core::v1::Container {
                name: "app".into(),
                image: Some("registry.example/app:1".into()),
                ..Default::default()
            }],
            automount_service_account_token: Some(false),
            ..Default::default()
        }),
        status: None,
    }
}

impl Compiled {
    /// No rules.
    pub fn none() -> Self {
        Self::default()
    }

    /// The overrides as written.
    pub fn source(&self) -> &Overrides {
        &self.overrides
    }

    /// The placement part of the rules, for the fit predicate of the descheduler and the
    /// multi-scheduler (published on the Node): the rules that change where a pod may go
    /// below, in order; `None` when no rule does.
    pub fn placement(&self) -> Option<PlacementOverrides> {
        let rules: Vec<PlacementRule> = self
            .overrides
            .rules
            .iter()
            .map(|r| PlacementRule {
                name: r.name.clone(),
                namespaces: r.namespaces.clone(),
                selector: r.selector.clone(),
                tolerations: r.tolerations.clone(),
                node_selector: r.node_selector.clone(),
                node_selector_terms: r.node_selector_terms.clone(),
                runtime_class_names: r.runtime_class_names.clone(),
                opaque: placement::patch_changes_placement(&r.patch),
            })
            .filter(|r| {
                r.opaque
                    || !r.tolerations.is_empty()
                    || !r.node_selector.is_empty()
                    || !r.node_selector_terms.is_empty()
                    || !r.runtime_class_names.is_empty()
            })
            .collect();
        (!rules.is_empty()).then_some(PlacementOverrides {
            v: placement::VERSION,
            rules,
        })
    }

    /// The lower StorageClass of a claim of upper class `class`.
    pub fn storage_class(&self, class: Option<String>) -> Option<String> {
        class.map(|c| self.overrides.storage_classes.get(&c).cloned().unwrap_or(c))
    }

    /// Applies `rule` to the sample pod: what it cannot do there, it cannot do anywhere. A
    /// patch gated by a `test` operation holds or not by the pod: it is judged by what it can
    /// produce, every test taken to hold and each operation tried on its own (a test on a
    /// label the sample lacks hides nothing). A rule that weakens isolation (allowed by
    /// `allowPrivileged`) must name its namespaces: anyone may label a pod so that a selector
    /// takes it. [`apply`](Self::apply) checks each real pod the same way.
    fn sample_check(&self, rule: &Rule, ready: &Ready) -> Result<(), Invalid> {
        let mut pod = sample_pod();
        let gated = ready.patch.iter().any(|op| matches!(op, PatchOperation::Test(_)));
        let patching = if gated { Patching::Reach } else { Patching::Strict };
        let before = Guarded::of(&pod);
        let said = |e: String| {
            Invalid(format!(
                "rule {:?} fails on a pod of one container: {e}",
                rule.name
            ))
        };
        apply_rule(rule, ready, &mut pod, patching)
            .and_then(|()| before.owned_unchanged(&pod))
            .map_err(said)?;
        match before.isolation_kept(&pod, rule) {
            Ok(()) => Ok(()),
            Err(e) if !self.overrides.allow_privileged => Err(said(not_allowed(e))),
            Err(e) if rule.namespaces.is_empty() => Err(Invalid(format!(
                "rule {:?} weakens isolation ({e}) in every namespace: with allowPrivileged, such a rule must \
                 name its namespaces, since anyone may label a pod so that its selector takes it",
                rule.name
            ))),
            Err(_) => Ok(()),
        }
    }

    /// Applies the rules that select `upper` to its lower pod `lower` and records them on it;
    /// the names of the rules applied. `Err`: the reason the pod is refused.
    pub fn apply(&self, upper: &Pod, lower: &mut Pod) -> Result<Vec<String>, String> {
        let namespace = upper.metadata.namespace.as_deref().unwrap_or_default();
        let empty = BTreeMap::new();
        let labels = upper.metadata.labels.as_ref().unwrap_or(&empty);
        let chosen: Vec<(&Rule, &Ready)> = self
            .overrides
            .rules
            .iter()
            .zip(&self.rules)
            .filter(|(rule, _)| {
                placement::selects(&rule.namespaces, rule.selector.as_ref(), namespace, labels)
            })
            .collect();
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        let before = Guarded::of(lower);
        for (rule, ready) in &chosen {
            apply_rule(rule, ready, lower, Patching::Strict)
                .and_then(|()| before.check(lower, rule, self.overrides.allow_privileged))
                .map_err(|e| format!("override rule {:?} of this lower cluster: {e}", rule.name))?;
        }
        let record: Vec<&Rule> = chosen.iter().map(|(rule, _)| *rule).collect();
        let record = serde_json::to_string(&record)
            .map_err(|e| format!("the rules applied cannot be recorded: {e}"))?;
        lower
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(names::OVERRIDES.to_owned(), record);
        Ok(chosen.iter().map(|(rule, _)| rule.name.clone()).collect())
    }
}

/// Brings `desired` (a fresh translation of the upper pod) to what its lower pod `actual`
/// was made with: the rules `actual` records, all of them, as recorded. A patch operation
/// that no longer applies (a `remove` of a label the user dropped since) is passed over, and
/// a `test` that no longer holds ends its rule's patch. `Err` when the record cannot be read
/// (it was edited below). A record copied from the upper pod by a version before overrides
/// (its key listed among the copied annotations) is the user's, not the node's: ignored.
pub fn replay(actual: &Pod, desired: &mut Pod) -> Result<(), String> {
    let annotations = actual.metadata.annotations.as_ref();
    let Some(record) = annotations.and_then(|a| a.get(names::OVERRIDES)) else {
        return Ok(());
    };
    let copied = annotations
        .and_then(|a| a.get(names::COPIED_ANNOTATIONS))
        .is_some_and(|list| list.split(',').any(|k| k == names::OVERRIDES));
    if copied {
        return Ok(());
    }
    for (rule, ready) in recorded(record)?.iter() {
        apply_rule(rule, ready, desired, Patching::Replay)
            .map_err(|e| format!("{} rule {:?}: {e}", names::OVERRIDES, rule.name))?;
    }
    desired
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(names::OVERRIDES.to_owned(), record.clone());
    Ok(())
}

/// The rules of a record, ready: read once per distinct record (most pods of a cluster
/// carry the same few), not on every reconcile.
fn recorded(record: &str) -> Result<Arc<Vec<(Rule, Ready)>>, String> {
    type Read = std::collections::HashMap<String, Arc<Vec<(Rule, Ready)>>>;
    static READ: std::sync::LazyLock<std::sync::Mutex<Read>> = std::sync::LazyLock::new(Default::default);
    if let Some(found) = READ.lock().ok().and_then(|read| read.get(record).cloned()) {
        return Ok(found);
    }
    let rules: Vec<Rule> = serde_json::from_str(record).map_err(|e| format!("{}: {e}", names::OVERRIDES))?;
    let mut list = Vec::with_capacity(rules.len());
    for rule in rules {
        let ready = ready(&rule).map_err(|e| format!("{} rule {:?}: {e}", names::OVERRIDES, rule.name))?;
        list.push((rule, ready));
    }
    let list = Arc::new(list);
    if let Ok(mut read) = READ.lock() {
        if read.len() >= 64 {
            read.clear();
        }
        read.insert(record.to_owned(), list.clone());
    }
    Ok(list)
}

/// The image as a container runtime reads it: a first component without `.` or `:` (and
/// not `localhost`) is a Docker Hub repository (`index.docker.io` is `docker.io`), and a
/// Docker Hub repository of one component is under `library/`.
fn qualified(image: &str) -> String {
    let (registry, rest) = match image.split_once('/') {
        Some((first, rest)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            (first, rest)
        }
        _ => ("docker.io", image),
    };
    let registry = if registry == "index.docker.io" {
        "docker.io"
    } else {
        registry
    };
    match registry == "docker.io" && !rest.contains('/') {
        true => format!("docker.io/library/{rest}"),
        false => format!("{registry}/{rest}"),
    }
}

fn rewrite(image: &str, how: &Rewrite) -> String {
    match how {
        Rewrite::Prefix { from, to } => {
            if let Some(rest) = image.strip_prefix(from.as_str()) {
                return format!("{to}{rest}");
            }
            let full = qualified(image);
            match full.strip_prefix(from.as_str()) {
                Some(rest) => format!("{to}{rest}"),
                None => image.to_owned(),
            }
        }
        Rewrite::Regex(pattern, replacement) => pattern.replace(image, replacement.as_str()).into_owned(),
    }
}

/// How a rule's JSON patch is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Patching {
    /// Whole, or the pod is refused.
    Strict,
    /// Each operation on its own, one that does not apply passed over, a `test` that does not
    /// hold ending the patch (a replay of the rules a lower pod records).
    Replay,
    /// Each operation on its own, one that does not apply passed over, every `test` taken to
    /// hold: what a gated patch can produce (the sample pod's check).
    Reach,
}

/// Applies one rule's operations, in the documented order, its patch as `patching` says.
fn apply_rule(rule: &Rule, ready: &Ready, pod: &mut Pod, patching: Patching) -> Result<(), String> {
    let spec = pod.spec.get_or_insert_default();
    let mut containers: Vec<&mut k8s_openapi::api::core::v1::Container> =
        spec.containers.iter_mut().collect();
    containers.extend(spec.init_containers.iter_mut().flatten());
    for c in containers {
        if let (Some(how), Some(image)) = (&ready.image, &c.image) {
            let rewritten = rewrite(image, how);
            if rewritten.is_empty() {
                return Err(format!("the image rewrite leaves container {} no image", c.name));
            }
            c.image = Some(rewritten);
        }
        for e in &rule.env {
            let env = c.env.get_or_insert_default();
            match env.iter_mut().find(|have| have.name == e.name) {
                Some(have) => *have = e.clone(),
                None => env.push(e.clone()),
            }
        }
    }
    if !rule.tolerations.is_empty() {
        placement::add_tolerations(spec.tolerations.get_or_insert_default(), &rule.tolerations);
    }
    if !rule.node_selector.is_empty() {
        placement::add_node_selector(spec.node_selector.get_or_insert_default(), &rule.node_selector)?;
    }
    if !rule.node_selector_terms.is_empty() {
        conjoin(spec, &rule.node_selector_terms)?;
    }
    if let Some(class) = spec
        .priority_class_name
        .as_ref()
        .and_then(|c| rule.priority_class_names.get(c))
    {
        spec.priority_class_name = Some(class.clone());
    }
    if let Some(class) = spec
        .runtime_class_name
        .as_ref()
        .and_then(|c| rule.runtime_class_names.get(c))
    {
        spec.runtime_class_name = Some(class.clone());
    }
    let meta = &mut pod.metadata;
    meta.labels
        .get_or_insert_default()
        .extend(rule.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    meta.annotations
        .get_or_insert_default()
        .extend(rule.annotations.iter().map(|(k, v)| (k.clone(), v.clone())));
    if !ready.patch.is_empty() {
        let mut doc = serde_json::to_value(&*pod).map_err(|e| format!("the pod as JSON: {e}"))?;
        match patching {
            Patching::Strict => {
                json_patch::patch(&mut doc, &ready.patch).map_err(|e| format!("patch: {e}"))?;
            }
            Patching::Replay => {
                for op in &ready.patch {
                    let held = json_patch::patch(&mut doc, std::slice::from_ref(op)).is_ok();
                    if !held && matches!(op, PatchOperation::Test(_)) {
                        break;
                    }
                }
            }
            Patching::Reach => {
                for op in ready
                    .patch
                    .iter()
                    .filter(|op| !matches!(op, PatchOperation::Test(_)))
                {
                    let _passed_over = json_patch::patch(&mut doc, std::slice::from_ref(op));
                }
            }
        }
        let patched: Pod =
            serde_json::from_value(doc.clone()).map_err(|e| format!("the patched pod is not a pod: {e}"))?;
        // A field the pod type does not have would be dropped without a word.
        let kept = serde_json::to_value(&patched).map_err(|e| format!("the patched pod as JSON: {e}"))?;
        if let Some(path) = lost(&doc, &kept, String::new()) {
            return Err(format!("patch: {path} is not a field of a pod"));
        }
        *pod = patched;
    }
    Ok(())
}

/// The first path of `written` that `kept` lacks (null values, empty lists and empty
/// mappings aside: their absence says the same).
fn lost(written: &Value, kept: &Value, at: String) -> Option<String> {
    let says_nothing = |v: &Value| match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    };
    match (written, kept) {
        (Value::Object(w), Value::Object(k)) => {
            w.iter().filter(|(_, v)| !says_nothing(v)).find_map(|(key, v)| {
                let here = format!("{at}/{key}");
                match k.get(key) {
                    None => Some(here),
                    Some(kv) => lost(v, kv, here),
                }
            })
        }
        (Value::Array(w), Value::Array(k)) => w
            .iter()
            .zip(k)
            .enumerate()
            .find_map(|(i, (wv, kv))| lost(wv, kv, format!("{at}/{i}"))),
        _ => None,
    }
}

/// The pod's required node affinity, in conjunction with `terms` (see
/// [`placement::conjoin`]).
fn conjoin(spec: &mut PodSpec, terms: &[NodeSelectorTerm]) -> Result<(), String> {
    let affinity = spec.affinity.get_or_insert_with(Affinity::default);
    let node = affinity.node_affinity.get_or_insert_with(NodeAffinity::default);
    let required = node
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(NodeSelector::default);
    placement::conjoin(&mut required.node_selector_terms, terms)
}

/// What rules must leave as they found it: the virtual node's own keys, the pod's name and
/// namespace, and (without `allowPrivileged`) its isolation.
struct Guarded {
    owned: BTreeMap<String, Option<String>>,
    place: (Option<String>, Option<String>),
    escalations: BTreeSet<String>,
    /// The capabilities each container drops.
    drops: BTreeMap<String, BTreeSet<String>>,
    /// The pod's RuntimeClass (a sandbox, perhaps).
    runtime_class: Option<String>,
}

impl Guarded {
    fn of(pod: &Pod) -> Self {
        Self {
            owned: owned_keys(pod),
            place: (pod.metadata.name.clone(), pod.metadata.namespace.clone()),
            escalations: escalations(pod),
            drops: drops(pod),
            runtime_class: runtime_class(pod),
        }
    }

    /// What `rule` did to the real pod `pod`: isolation weakened only with `allowPrivileged`,
    /// and then only by a rule that names its namespaces (as the sample check asks of the
    /// rules whose sample shows it).
    fn check(&self, pod: &Pod, rule: &Rule, allow_privileged: bool) -> Result<(), String> {
        self.owned_unchanged(pod)?;
        match self.isolation_kept(pod, rule) {
            Ok(()) => Ok(()),
            Err(e) if !allow_privileged => Err(not_allowed(e)),
            Err(e) if rule.namespaces.is_empty() => Err(format!(
                "it would add {e}, which allowPrivileged allows only to rules that name their namespaces"
            )),
            Err(_) => Ok(()),
        }
    }

    fn owned_unchanged(&self, pod: &Pod) -> Result<(), String> {
        if (pod.metadata.name.clone(), pod.metadata.namespace.clone()) != self.place {
            return Err("it changes the pod's name or namespace".into());
        }
        let owned = owned_keys(pod);
        if let Some(key) = self
            .owned
            .keys()
            .chain(owned.keys())
            .find(|k| self.owned.get(*k) != owned.get(*k))
        {
            return Err(format!("it changes {key}, which the virtual node owns"));
        }
        Ok(())
    }

    /// `Err`: what the pod gained that weakens isolation (by `rule`), said in a list. A
    /// RuntimeClass changed other than by the rule's own mapping may leave a sandbox.
    fn isolation_kept(&self, pod: &Pod, rule: &Rule) -> Result<(), String> {
        let now = escalations(pod);
        let mut added: Vec<String> = now.difference(&self.escalations).cloned().collect();
        let class = runtime_class(pod);
        let mapped = self
            .runtime_class
            .as_ref()
            .and_then(|c| rule.runtime_class_names.get(c));
        if class != self.runtime_class && (mapped.is_none() || class.as_ref() != mapped) {
            let name = |c: &Option<String>| c.clone().unwrap_or_else(|| "none".to_owned());
            added.push(format!(
                "RuntimeClass {} in place of {}",
                name(&class),
                name(&self.runtime_class)
            ));
        }
        let dropped_now = drops(pod);
        for (container, before) in &self.drops {
            let after = dropped_now.get(container);
            for cap in before.iter().filter(|c| after.is_none_or(|a| !a.contains(*c))) {
                added.push(format!(
                    "capability {cap} no longer dropped in container {container}"
                ));
            }
        }
        match added.is_empty() {
            true => Ok(()),
            false => Err(added.join(", ")),
        }
    }
}

/// Why a change that weakens isolation (`added`, said in a list) is refused.
fn not_allowed(added: String) -> String {
    format!("it would add {added}, which this lower cluster's overrides do not allow (allowPrivileged)")
}

/// The capabilities each container and init container drops.
fn drops(pod: &Pod) -> BTreeMap<String, BTreeSet<String>> {
    let Some(spec) = &pod.spec else {
        return BTreeMap::new();
    };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .map(|c| {
            let dropped = c
                .security_context
                .as_ref()
                .and_then(|s| s.capabilities.as_ref())
                .and_then(|c| c.drop.clone())
                .unwrap_or_default();
            (c.name.clone(), dropped.into_iter().collect())
        })
        .collect()
}

/// The RuntimeClass a pod names.
fn runtime_class(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.runtime_class_name.clone())
}

/// The virtual node's labels and annotations of a pod, as `label <key>` and `annotation <key>`.
fn owned_keys(pod: &Pod) -> BTreeMap<String, Option<String>> {
    let mut owned = BTreeMap::new();
    for (kind, map) in [
        ("label", &pod.metadata.labels),
        ("annotation", &pod.metadata.annotations),
    ] {
        for (k, v) in map.iter().flatten().filter(|(k, _)| reserved(k)) {
            owned.insert(format!("{kind} {k}"), Some(v.clone()));
        }
    }
    owned
}

/// What of a pod weakens isolation: what the Pod Security baseline forbids (host
/// namespaces, privileged containers, escalation, added capabilities, host ports, hostPath
/// volumes, unconfined seccomp or AppArmor, SELinux types, users and roles, unmasked /proc,
/// sysctls, host processes), and what would give it a lower credential (a lower
/// ServiceAccount, its token, any lower Secret it names: in env, a volume or a projected
/// source it could read, or as an image pull secret) or take it past the lower scheduler
/// (`nodeName`). A rule comparing before and after counts what it added.
fn escalations(pod: &Pod) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (key, value) in pod.metadata.annotations.iter().flatten() {
        if key.starts_with("container.apparmor.security.beta.kubernetes.io/") && value == "unconfined" {
            found.insert(format!("an unconfined AppArmor profile ({key})"));
        }
    }
    let Some(spec) = &pod.spec else {
        return found;
    };
    if spec.automount_service_account_token == Some(true) {
        found.insert("the token of a lower ServiceAccount (automountServiceAccountToken)".to_owned());
    }
    if let Some(account) = spec
        .service_account_name
        .as_ref()
        .or(spec.service_account.as_ref())
    {
        found.insert(format!("lower ServiceAccount {account}"));
    }
    if let Some(node) = &spec.node_name {
        found.insert(format!("nodeName {node} (past the lower scheduler)"));
    }
    if let Some(context) = &spec.security_context {
        confinement(
            "the pod",
            context.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
            context.app_armor_profile.as_ref().map(|p| p.type_.as_str()),
            context.se_linux_options.as_ref(),
            context.windows_options.as_ref().and_then(|w| w.host_process),
            &mut found,
        );
        for sysctl in context.sysctls.iter().flatten() {
            found.insert(format!("sysctl {}", sysctl.name));
        }
    }
    for (on, what) in [
        (spec.host_network, "hostNetwork"),
        (spec.host_pid, "hostPID"),
        (spec.host_ipc, "hostIPC"),
    ] {
        if on == Some(true) {
            found.insert(what.to_owned());
        }
    }
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    for c in containers {
        let context = c.security_context.as_ref();
        if context.and_then(|s| s.privileged) == Some(true) {
            found.insert(format!("a privileged container {}", c.name));
        }
        if context.and_then(|s| s.allow_privilege_escalation) == Some(true) {
            found.insert(format!("privilege escalation in container {}", c.name));
        }
        for cap in context
            .and_then(|s| s.capabilities.as_ref())
            .and_then(|c| c.add.as_ref())
            .into_iter()
            .flatten()
        {
            found.insert(format!("capability {cap} in container {}", c.name));
        }
        for port in c.ports.iter().flatten().filter_map(|p| p.host_port) {
            found.insert(format!("host port {port} in container {}", c.name));
        }
        for e in c.env.iter().flatten() {
            if let Some(secret) = e.value_from.as_ref().and_then(|f| f.secret_key_ref.as_ref()) {
                found.insert(format!(
                    "lower Secret {} (env {} of container {})",
                    secret.name, e.name, c.name
                ));
            }
        }
        for e in c.env_from.iter().flatten() {
            if let Some(secret) = &e.secret_ref {
                found.insert(format!(
                    "lower Secret {} (envFrom of container {})",
                    secret.name, c.name
                ));
            }
        }
        if let Some(context) = context {
            confinement(
                &format!("container {}", c.name),
                context.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
                context.app_armor_profile.as_ref().map(|p| p.type_.as_str()),
                context.se_linux_options.as_ref(),
                context.windows_options.as_ref().and_then(|w| w.host_process),
                &mut found,
            );
            if context.proc_mount.as_deref() == Some("Unmasked") {
                found.insert(format!("an unmasked /proc in container {}", c.name));
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(path) = &v.host_path {
            found.insert(format!("hostPath volume {} ({})", v.name, path.path));
        }
        let token = v
            .projected
            .iter()
            .flat_map(|p| p.sources.iter().flatten())
            .any(|s| s.service_account_token.is_some());
        if token {
            found.insert(format!("the token of a lower ServiceAccount (volume {})", v.name));
        }
        let secrets = v.secret.iter().filter_map(|s| s.secret_name.clone()).chain(
            v.projected
                .iter()
                .flat_map(|p| p.sources.iter().flatten())
                .filter_map(|s| s.secret.as_ref().map(|s| s.name.clone())),
        );
        for secret in secrets {
            found.insert(format!("lower Secret {secret} (volume {})", v.name));
        }
    }
    for pull in spec.image_pull_secrets.iter().flatten() {
        found.insert(format!("lower Secret {} (imagePullSecrets)", pull.name));
    }
    found
}

/// The confinement a security context gives up, for [`escalations`].
fn confinement(
    whose: &str,
    seccomp: Option<&str>,
    app_armor: Option<&str>,
    se_linux: Option<&k8s_openapi::api::core::v1::SELinuxOptions>,
    host_process: Option<bool>,
    found: &mut BTreeSet<String>,
) {
    if seccomp == Some("Unconfined") {
        found.insert(format!("an unconfined seccomp profile for {whose}"));
    }
    if app_armor == Some("Unconfined") {
        found.insert(format!("an unconfined AppArmor profile for {whose}"));
    }
    if let Some(options) = se_linux
        && (options.type_.is_some() || options.user.is_some() || options.role.is_some())
    {
        found.insert(format!("SELinux type, user or role for {whose}"));
    }
    if host_process == Some(true) {
        found.insert(format!("a host process for {whose}"));
    }
}

/// Reads and checks the overrides file: the overrides, and the bytes they were read from
/// (what [`follow`] compares the file with).
pub fn load(path: &Path) -> Result<(Compiled, Vec<u8>), Invalid> {
    let bytes = std::fs::read(path).map_err(|e| Invalid(format!("{}: {e}", path.display())))?;
    Ok((read(path, &bytes)?, bytes))
}

/// Checks the overrides `bytes` read from `path`.
pub fn read(path: &Path, bytes: &[u8]) -> Result<Compiled, Invalid> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| Invalid(format!("{}: not UTF-8: {e}", path.display())))?;
    parse(text)
        .and_then(Overrides::compile)
        .map_err(|e| Invalid(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(v: Value) -> Result<Compiled, Invalid> {
        Overrides::from_value(v).and_then(Overrides::compile)
    }

    fn pod(v: Value) -> Pod {
        let mut p: Value = json!({
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"}, "annotations": {}},
            "spec": {"containers": [{"name": "app", "image": "nginx:1.25"}]}
        });
        json_patch::merge(&mut p, &v);
        serde_json::from_value(p).unwrap()
    }

    fn applied(rules: Value, upper: &Pod) -> Result<(Vec<String>, Pod), String> {
        let c = compile(rules).unwrap();
        let mut lower = upper.clone();
        let names = c.apply(upper, &mut lower)?;
        Ok((names, lower))
    }

    fn spec(p: &Pod) -> Value {
        serde_json::to_value(p.spec.as_ref().unwrap()).unwrap()
    }

    #[test]
    fn a_prefix_rewrites_images_as_a_runtime_reads_them_and_a_regex_as_written() {
        let upper = pod(json!({"spec": {
            "containers": [{"name": "app", "image": "nginx:1.25"}, {"name": "side", "image": "quay.io/x/side:2"}],
            "initContainers": [{"name": "init", "image": "busybox@sha256:abc"}]}}));
        let (names, lower) = applied(
            json!({"rules": [{"name": "mirror", "image": {"prefix": {"from": "docker.io/", "to": "mirror.b.example/hub/"}}}]}),
            &upper,
        )
        .unwrap();
        assert_eq!(names, ["mirror"]);
        let s = spec(&lower);
        assert_eq!(
            s["containers"][0]["image"],
            "mirror.b.example/hub/library/nginx:1.25"
        );
        assert_eq!(
            s["containers"][1]["image"], "quay.io/x/side:2",
            "another registry is left alone"
        );
        assert_eq!(
            s["initContainers"][0]["image"],
            "mirror.b.example/hub/library/busybox@sha256:abc"
        );

        let (_, lower) = applied(
            json!({"rules": [{"name": "quay", "image": {"regex": {"pattern": "^quay\\.io/(.*)$", "replacement": "quay.b.example/$1"}}}]}),
            &upper,
        )
        .unwrap();
        let s = spec(&lower);
        assert_eq!(s["containers"][0]["image"], "nginx:1.25");
        assert_eq!(s["containers"][1]["image"], "quay.b.example/x/side:2");
        assert_eq!(qualified("localhost:5000/a"), "localhost:5000/a");
        assert_eq!(qualified("team/app"), "docker.io/team/app");
        assert_eq!(qualified("docker.io/nginx"), "docker.io/library/nginx");
        assert_eq!(qualified("index.docker.io/nginx:1"), "docker.io/library/nginx:1");
        assert_eq!(qualified("index.docker.io/team/app"), "docker.io/team/app");
    }

    #[test]
    fn tolerations_and_node_selectors_are_added_and_terms_conjoined() {
        let upper = pod(json!({"spec": {
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "nodeSelector": {"zone": "a"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]},
                {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["nvme"]}]}]}}}}}));
        let (_, lower) = applied(
            json!({"rules": [{"name": "dedicated",
                "tolerations": [{"key": "gpu", "operator": "Exists"}, {"key": "dedicated", "value": "tensile", "effect": "NoSchedule"}],
                "nodeSelector": {"pool": "fleet", "zone": "a"},
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]}]}),
            &upper,
        )
        .unwrap();
        let s = spec(&lower);
        assert_eq!(
            s["tolerations"].as_array().unwrap().len(),
            2,
            "the same toleration once: {s}"
        );
        assert_eq!(s["tolerations"][1]["key"], "dedicated");
        assert_eq!(s["nodeSelector"], json!({"pool": "fleet", "zone": "a"}));
        let terms = &s["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        assert_eq!(
            terms,
            &json!([
                {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}, {"key": "pool", "operator": "Exists"}]},
                {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["nvme"]}, {"key": "pool", "operator": "Exists"}]}
            ])
        );
        // A pod without terms gets the rule's; a contradicting nodeSelector refuses the pod.
        let (_, plain) = applied(
            json!({"rules": [{"name": "t", "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]}]}),
            &pod(json!({})),
        )
        .unwrap();
        assert_eq!(
            spec(&plain)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
            json!([{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}])
        );
        let refused = applied(
            json!({"rules": [{"name": "zone-b", "nodeSelector": {"zone": "b"}}]}),
            &upper,
        )
        .unwrap_err();
        assert_eq!(
            refused,
            "override rule \"zone-b\" of this lower cluster: nodeSelector zone=b contradicts the pod's zone=a"
        );
    }

    #[test]
    fn class_names_are_mapped_and_env_labels_annotations_set() {
        let upper = pod(json!({"spec": {
            "priorityClassName": "high", "runtimeClassName": "gvisor",
            "containers": [{"name": "app", "image": "a", "env": [{"name": "REGION", "value": "upper"}, {"name": "KEEP", "value": "1"}]}],
            "initContainers": [{"name": "init", "image": "b"}]}}));
        let (_, lower) = applied(
            json!({"rules": [{"name": "b",
                "priorityClassNames": {"high": "fleet-high"}, "runtimeClassNames": {"gvisor": "runsc"},
                "env": [{"name": "REGION", "value": "eu-b"}],
                "labels": {"region": "eu-b"}, "annotations": {"cost-center": "42"}}]}),
            &upper,
        )
        .unwrap();
        let s = spec(&lower);
        assert_eq!(s["priorityClassName"], "fleet-high");
        assert_eq!(s["runtimeClassName"], "runsc");
        assert_eq!(
            s["containers"][0]["env"],
            json!([{"name": "REGION", "value": "eu-b"}, {"name": "KEEP", "value": "1"}])
        );
        assert_eq!(
            s["initContainers"][0]["env"],
            json!([{"name": "REGION", "value": "eu-b"}])
        );
        assert_eq!(lower.metadata.labels.as_ref().unwrap()["region"], "eu-b");
        assert_eq!(lower.metadata.annotations.as_ref().unwrap()["cost-center"], "42");
        // A class not in the map is left as it is.
        let (_, other) = applied(
            json!({"rules": [{"name": "b", "priorityClassNames": {"low": "fleet-low"}}]}),
            &upper,
        )
        .unwrap();
        assert_eq!(spec(&other)["priorityClassName"], "high");
    }

    #[test]
    fn a_json_patch_changes_anything_of_the_spec_and_failing_on_a_pod_refuses_that_pod() {
        let rules = json!({"rules": [{"name": "limits", "patch": [
            {"op": "add", "path": "/spec/containers/0/resources", "value": {"limits": {"memory": "1Gi"}}},
            {"op": "add", "path": "/spec/dnsPolicy", "value": "Default"}]}]});
        let (_, lower) = applied(rules.clone(), &pod(json!({}))).unwrap();
        let s = spec(&lower);
        assert_eq!(s["containers"][0]["resources"]["limits"]["memory"], "1Gi");
        assert_eq!(s["dnsPolicy"], "Default");
        let c = compile(json!({"rules": [{"name": "gate", "patch": [
            {"op": "test", "path": "/spec/containers/0/name", "value": "main"},
            {"op": "add", "path": "/spec/hostname", "value": "h"}]}]}))
        .unwrap();
        let upper = pod(json!({}));
        let mut lower = upper.clone();
        let refused = c.apply(&upper, &mut lower).unwrap_err();
        assert!(refused.starts_with("override rule \"gate\" of this lower cluster: patch: operation '/0' failed at path '/spec/containers/0/name'"), "{refused}");
    }

    #[test]
    fn a_patch_writing_what_a_pod_has_no_field_for_is_refused_not_dropped() {
        let e = compile(json!({"rules": [{"name": "typo", "patch": [
            {"op": "add", "path": "/spec/containers/0/securityContext", "value": {"runAsUsr": 1000}}]}]}))
        .unwrap_err();
        assert!(
            e.0.ends_with("patch: /spec/containers/0/securityContext/runAsUsr is not a field of a pod"),
            "{e}"
        );
        let fine = compile(json!({"rules": [{"name": "user", "patch": [
            {"op": "add", "path": "/spec/containers/0/securityContext", "value": {"runAsUser": 1000, "seLinuxOptions": null}}]}]}));
        assert!(fine.is_ok(), "{fine:?}");
    }

    #[test]
    fn rules_select_by_namespace_and_labels_and_the_pod_records_them() {
        let rules = json!({"rules": [
            {"name": "shop-only", "namespaces": ["shop"], "labels": {"a": "1"}},
            {"name": "web", "selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]}, "labels": {"b": "1"}},
            {"name": "db", "selector": {"matchLabels": {"app": "db"}}, "labels": {"c": "1"}}]});
        let upper = pod(json!({}));
        let (names, lower) = applied(rules.clone(), &upper).unwrap();
        assert_eq!(names, ["shop-only", "web"]);
        let record: Vec<Rule> =
            serde_json::from_str(&lower.metadata.annotations.as_ref().unwrap()[names::OVERRIDES]).unwrap();
        assert_eq!(
            record.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["shop-only", "web"]
        );
        let mut elsewhere = upper.clone();
        elsewhere.metadata.namespace = Some("other".into());
        let (names, lower) = applied(rules, &elsewhere).unwrap();
        assert_eq!(names, ["web"]);
        assert!(!lower.metadata.labels.unwrap().contains_key("a"));
        // No rule applies: nothing is recorded.
        let (names, lower) = applied(
            json!({"rules": [{"name": "db", "namespaces": ["db"], "labels": {"c": "1"}}]}),
            &upper,
        )
        .unwrap();
        assert!(names.is_empty());
        assert!(!lower.metadata.annotations.unwrap().contains_key(names::OVERRIDES));
    }

    #[test]
    fn an_update_goes_through_the_recorded_rules_not_the_rules_in_force() {
        let upper = pod(json!({}));
        let (_, actual) = applied(
            json!({"rules": [{"name": "mirror", "image": {"prefix": {"from": "docker.io/", "to": "old.example/"}}, "labels": {"r": "1"}}]}),
            &upper,
        )
        .unwrap();
        // Upstream the image changes; the rules in force now say another mirror.
        let mut desired = pod(json!({"spec": {"containers": [{"name": "app", "image": "nginx:1.27"}]}}));
        replay(&actual, &mut desired).unwrap();
        assert_eq!(
            spec(&desired)["containers"][0]["image"],
            "old.example/library/nginx:1.27"
        );
        assert_eq!(desired.metadata.labels.as_ref().unwrap()["r"], "1");
        assert_eq!(
            desired.metadata.annotations.as_ref().unwrap()[names::OVERRIDES],
            actual.metadata.annotations.as_ref().unwrap()[names::OVERRIDES]
        );
        // A gated patch that no longer applies is passed over: the user dropped the label the
        // rule removed.
        let (_, made) = applied(
            json!({"rules": [{"name": "quiet", "patch": [
                {"op": "test", "path": "/metadata/labels/debug", "value": "1"},
                {"op": "remove", "path": "/metadata/labels/debug"}]}]}),
            &pod(json!({"metadata": {"labels": {"debug": "1"}}})),
        )
        .unwrap();
        let mut now = pod(json!({}));
        replay(&made, &mut now).unwrap();
        assert_eq!(now.metadata.labels.as_ref().unwrap().get("debug"), None);
        // A record copied from the upper pod by a version before overrides is the user's.
        let mut copied = actual.clone();
        copied.metadata.annotations.as_mut().unwrap().insert(
            names::COPIED_ANNOTATIONS.into(),
            format!("note,{}", names::OVERRIDES),
        );
        let mut plain = pod(json!({"spec": {"containers": [{"name": "app", "image": "nginx:1.27"}]}}));
        replay(&copied, &mut plain).unwrap();
        assert_eq!(spec(&plain)["containers"][0]["image"], "nginx:1.27");
        // A record edited below is said, not guessed at.
        let mut edited = actual.clone();
        edited
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(names::OVERRIDES.into(), "{".into());
        assert!(replay(&edited, &mut pod(json!({}))).is_err());
        // A pod made without rules replays nothing.
        let mut unchanged = pod(json!({}));
        replay(&pod(json!({})), &mut unchanged).unwrap();
        assert_eq!(unchanged, pod(json!({})));
    }

    #[test]
    fn isolation_is_never_weakened_unless_the_cluster_allows_it() {
        let host = json!({"rules": [{"name": "host", "patch": [{"op": "add", "path": "/spec/hostNetwork", "value": true}]}]});
        let refused = compile(host.clone()).unwrap_err();
        assert_eq!(
            refused.0,
            "rule \"host\" fails on a pod of one container: it would add hostNetwork, which this lower cluster's overrides do not allow (allowPrivileged)"
        );
        for (path, value, said) in [
            (
                "/spec/automountServiceAccountToken",
                json!(true),
                "the token of a lower ServiceAccount (automountServiceAccountToken)",
            ),
            (
                "/spec/serviceAccountName",
                json!("admin"),
                "lower ServiceAccount admin",
            ),
            (
                "/spec/nodeName",
                json!("n-1"),
                "nodeName n-1 (past the lower scheduler)",
            ),
            (
                "/spec/securityContext",
                json!({"seccompProfile": {"type": "Unconfined"}}),
                "an unconfined seccomp profile for the pod",
            ),
            (
                "/spec/securityContext",
                json!({"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}),
                "sysctl kernel.msgmax",
            ),
            (
                "/spec/containers/0/securityContext",
                json!({"seLinuxOptions": {"type": "spc_t"}}),
                "SELinux type, user or role for container app",
            ),
            (
                "/spec/containers/0/securityContext",
                json!({"procMount": "Unmasked"}),
                "an unmasked /proc in container app",
            ),
            (
                "/spec/volumes",
                json!([{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]),
                "the token of a lower ServiceAccount (volume t)",
            ),
            (
                "/metadata/annotations/container.apparmor.security.beta.kubernetes.io~1app",
                json!("unconfined"),
                "an unconfined AppArmor profile",
            ),
            (
                "/spec/containers/0/securityContext",
                json!({"privileged": true}),
                "a privileged container app",
            ),
            (
                "/spec/containers/0/securityContext",
                json!({"capabilities": {"add": ["SYS_ADMIN"]}}),
                "capability SYS_ADMIN in container app",
            ),
            (
                "/spec/volumes",
                json!([{"name": "root", "hostPath": {"path": "/"}}]),
                "hostPath volume root (/)",
            ),
            (
                "/spec/containers/0/ports",
                json!([{"containerPort": 80, "hostPort": 80}]),
                "host port 80 in container app",
            ),
        ] {
            let e = compile(
                json!({"rules": [{"name": "r", "patch": [{"op": "add", "path": path, "value": value}]}]}),
            )
            .unwrap_err();
            assert!(e.0.contains(said), "{e}");
        }
        // Allowed for the cluster, such a rule names its namespaces: a tenant may label any
        // pod so that a selector takes it, not put it in another namespace.
        let mut allowed = host;
        allowed["allowPrivileged"] = json!(true);
        let e = compile(allowed.clone()).unwrap_err();
        assert!(
            e.0.starts_with("rule \"host\" weakens isolation (hostNetwork) in every namespace"),
            "{e}"
        );
        allowed["rules"][0]["namespaces"] = json!(["shop"]);
        let (_, lower) = applied(allowed, &pod(json!({}))).unwrap();
        assert_eq!(spec(&lower)["hostNetwork"], true);
        // A capability the pod drops stays dropped.
        let upper = pod(json!({"spec": {"containers": [{"name": "app", "image": "a",
            "securityContext": {"capabilities": {"drop": ["ALL"]}}}]}}));
        let c = compile(json!({"rules": [{"name": "caps", "patch": [
            {"op": "test", "path": "/spec/containers/0/name", "value": "app"},
            {"op": "remove", "path": "/spec/containers/0/securityContext/capabilities"}]}]}))
        .unwrap();
        let mut lower = upper.clone();
        let refused = c.apply(&upper, &mut lower).unwrap_err();
        assert!(
            refused.contains("it would add capability ALL no longer dropped in container app"),
            "{refused}"
        );
        // What the pod had already is not the rule's doing.
        let c = compile(json!({"rules": [{"name": "env", "env": [{"name": "A", "value": "1"}]}]})).unwrap();
        let upper = pod(json!({"spec": {"hostNetwork": true}}));
        let mut lower = upper.clone();
        c.apply(&upper, &mut lower).unwrap();
    }

    #[test]
    fn a_rule_is_judged_by_what_it_can_produce_and_checked_again_on_each_pod() {
        // A test on a label the sample pod lacks hides nothing the patch adds.
        let gated = json!({"rules": [{"name": "gated", "patch": [
            {"op": "test", "path": "/metadata/labels/fast", "value": "yes"},
            {"op": "add", "path": "/spec/hostNetwork", "value": true}]}]});
        let e = compile(gated.clone()).unwrap_err();
        assert!(e.0.contains("it would add hostNetwork"), "{e}");
        let mut allowed = gated;
        allowed["allowPrivileged"] = json!(true);
        let e = compile(allowed).unwrap_err();
        assert!(
            e.0.contains("weakens isolation (hostNetwork) in every namespace"),
            "{e}"
        );

        // A lower Secret a rule hands the pod, to read or to pull with; a RuntimeClass a patch
        // changes (out of a sandbox, perhaps).
        for (rule, said) in [
            (
                json!({"name": "r", "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "admin-token-x", "key": "token"}}}]}),
                "lower Secret admin-token-x (env T of container app)",
            ),
            (
                json!({"name": "r", "patch": [{"op": "add", "path": "/spec/containers/0/envFrom",
                    "value": [{"secretRef": {"name": "db-root"}}]}]}),
                "lower Secret db-root (envFrom of container app)",
            ),
            (
                json!({"name": "r", "patch": [{"op": "add", "path": "/spec/volumes",
                    "value": [{"name": "t", "secret": {"secretName": "default-token-abcde"}}]}]}),
                "lower Secret default-token-abcde (volume t)",
            ),
            (
                json!({"name": "r", "patch": [{"op": "add", "path": "/spec/imagePullSecrets",
                    "value": [{"name": "registry-admin"}]}]}),
                "lower Secret registry-admin (imagePullSecrets)",
            ),
            (
                json!({"name": "r", "patch": [{"op": "add", "path": "/spec/runtimeClassName", "value": "runc"}]}),
                "RuntimeClass runc in place of none",
            ),
        ] {
            let e = compile(json!({"rules": [rule]})).unwrap_err();
            assert!(e.0.contains(said), "{said}: {e}");
        }
        // The rule's own class map is the cluster's word, not an escape.
        let mapped = json!({"rules": [{"name": "m", "runtimeClassNames": {"gvisor": "gvisor-b"}}]});
        let upper = pod(json!({"spec": {"runtimeClassName": "gvisor"}}));
        let (_, lower) = applied(mapped, &upper).unwrap();
        assert_eq!(spec(&lower)["runtimeClassName"], "gvisor-b");
        let away = compile(json!({"rules": [{"name": "away", "patch": [
            {"op": "test", "path": "/spec/containers/0/name", "value": "app"},
            {"op": "remove", "path": "/spec/runtimeClassName"}]}]}))
        .unwrap();
        let mut lower = upper.clone();
        let e = away.apply(&upper, &mut lower).unwrap_err();
        assert!(e.contains("RuntimeClass none in place of gvisor"), "{e}");

        // What the sample cannot show (a second container) is checked on the real pod: with
        // allowPrivileged too, a rule that names no namespace may not weaken it.
        let second = json!({"allowPrivileged": true, "rules": [{"name": "second", "patch": [
            {"op": "test", "path": "/spec/containers/1/name", "value": "side"},
            {"op": "add", "path": "/spec/containers/1/securityContext", "value": {"privileged": true}}]}]});
        let c = compile(second).unwrap();
        let upper = pod(json!({"spec": {"containers": [
            {"name": "app", "image": "a"}, {"name": "side", "image": "s"}]}}));
        let mut lower = upper.clone();
        let e = c.apply(&upper, &mut lower).unwrap_err();
        assert!(
            e.contains("a privileged container side, which allowPrivileged allows only to rules that name their namespaces"),
            "{e}"
        );
    }

    #[test]
    fn the_virtual_nodes_own_keys_name_and_namespace_are_out_of_reach() {
        for (rules, said) in [
            (
                json!({"rules": [{"name": "r", "labels": {"tensile.io/virtual-node": "x"}}]}),
                "labels: \"tensile.io/virtual-node\" is a key the virtual node owns",
            ),
            (
                json!({"rules": [{"name": "r", "annotations": {"clusterSelector": "{}"}}]}),
                "annotations: \"clusterSelector\"",
            ),
            (
                json!({"rules": [{"name": "r", "patch": [{"op": "remove", "path": "/metadata/labels/tensile.io~1virtual-node"}]}]}),
                "changes a key the virtual node owns",
            ),
            (
                json!({"rules": [{"name": "r", "patch": [{"op": "replace", "path": "/metadata/name", "value": "x"}]}]}),
                "is not under /spec/",
            ),
            (
                json!({"rules": [{"name": "r", "patch": [{"op": "add", "path": "/status", "value": {}}]}]}),
                "is not under /spec/",
            ),
            (
                json!({"rules": [{"name": "r", "patch": [{"op": "move", "from": "/metadata/namespace", "path": "/spec/hostname"}]}]}),
                "path \"/metadata/namespace\"",
            ),
        ] {
            let e = compile(rules).unwrap_err();
            assert!(e.0.contains(said), "{e} lacks {said}");
        }
    }

    #[test]
    fn a_bad_set_is_refused_whole_with_the_rule_and_the_reason() {
        for (rules, said) in [
            (
                json!({"rules": [{"name": "a"}, {"name": "a"}]}),
                "rule \"a\" is named twice",
            ),
            (
                json!({"rules": [{"name": "Mirror"}]}),
                "rule \"Mirror\": the name must be a DNS label",
            ),
            (
                json!({"rules": [{"name": "a"}, {"name": "b", "imagee": {}}]}),
                "rules[1] (b): unknown field `imagee`",
            ),
            (
                json!({"rules": [{"name": "a", "image": {"regex": {"pattern": "(", "replacement": ""}}}]}),
                "rule \"a\": image.regex: regex parse error",
            ),
            (
                json!({"rules": [{"name": "a", "image": {}}]}),
                "image: give exactly one of prefix and regex",
            ),
            (
                json!({"rules": [{"name": "a", "tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}]}),
                "tolerations: k Exists takes no value",
            ),
            (
                json!({"rules": [{"name": "a", "tolerations": [{"key": "k", "effect": "NoRun"}]}]}),
                "effect \"NoRun\"",
            ),
            (
                json!({"rules": [{"name": "a", "nodeSelectorTerms": [{}]}]}),
                "an empty term matches no node",
            ),
            (
                json!({"rules": [{"name": "a", "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["x"]}]}]}]}),
                "Gt and Lt one integer",
            ),
            (
                json!({"rules": [{"name": "a", "selector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}]}),
                "selector: k In needs values",
            ),
            (
                json!({"rules": [{"name": "a", "patch": [{"op": "frobnicate", "path": "/spec"}]}]}),
                "patch[0]: unknown variant `frobnicate`",
            ),
            (
                json!({"rules": [{"name": "a", "patch": [{"op": "replace", "path": "/spec/containers/1/image", "value": "x"}]}]}),
                "fails on a pod of one container: patch: operation '/0' failed at path '/spec/containers/1/image'",
            ),
            (
                json!({"storageClasses": {"fast": "Premium SSD"}}),
                "storageClasses",
            ),
            (json!({"rules": {"name": "a"}}), "rules must be a list"),
            (
                json!({"rules": [{"name": "a", "tolerations": [{"key": "k", "opertor": "Exists"}]}]}),
                "rules[0] (a): /tolerations/0/opertor is not a field of a rule",
            ),
            (
                json!({"rules": [{"name": "a", "labels": {"bad key": "x"}}]}),
                "labels: \"bad key\" is not a key",
            ),
            (
                json!({"rules": [{"name": "a", "labels": {"k": "-x"}}]}),
                "labels: k=\"-x\" is not a label value",
            ),
            (
                json!({"rules": [{"name": "a", "nodeSelector": {"": "x"}}]}),
                "nodeSelector: =x is not a label",
            ),
            (
                json!({"rules": [{"name": "a", "env": [{"name": "A=B"}]}]}),
                "env: \"A=B\" is empty, holds '=' or is set twice",
            ),
            (
                json!({"rules": [{"name": "a", "annotations": {"big": "x".repeat(40_000)}}]}),
                "at most 32768 fit the record",
            ),
            (json!({"allowPrivileged": "yes"}), "overrides: invalid type"),
        ] {
            let e = compile(rules).unwrap_err();
            assert!(e.0.contains(said), "{e} lacks {said}");
        }
        assert!(
            parse("rules: [name: a")
                .unwrap_err()
                .0
                .starts_with("not YAML or JSON")
        );
        // A patch gated by a test holds or not by the pod: its removal of an optional field
        // is not refused for the sample pod's lacking it.
        let gated = compile(json!({"rules": [{"name": "g", "patch": [
            {"op": "test", "path": "/spec/containers/0/name", "value": "app"},
            {"op": "remove", "path": "/spec/containers/0/livenessProbe"}]}]}));
        assert!(gated.is_ok(), "{gated:?}");
        assert_eq!(parse("").unwrap(), Overrides::default());
        let yaml = "rules:\n- name: mirror\n  image: {prefix: {from: docker.io/, to: m.example/}}\nstorageClasses: {fast: premium}\n";
        let c = parse(yaml).unwrap().compile().unwrap();
        assert_eq!(c.storage_class(Some("fast".into())).as_deref(), Some("premium"));
        assert_eq!(c.storage_class(Some("slow".into())).as_deref(), Some("slow"));
        assert_eq!(c.storage_class(None), None);
    }
}
