//! What a lower cluster's overrides change about where its pods may go below.
//!
//! A virtual node's override rules (docs/virtual-node.md, *Overrides*) add tolerations, a
//! nodeSelector and node selector terms to the pods it creates below, and may map their
//! RuntimeClass. The lower scheduler places the pod so changed, so the fit predicate (the
//! `fit` module) must judge that pod, not the stash alone: a cluster whose nodes sit
//! behind a taint its rule tolerates holds pods the stash alone says it cannot.
//!
//! The virtual node publishes the placement part of its rules in force on its Node
//! ([`names::NODE_PLACEMENT_OVERRIDES`]), and the readers apply it to the stash with the same
//! operations the virtual node applies to the lower pod ([`add_tolerations`],
//! [`add_node_selector`], [`conjoin`]). A rule whose JSON patch may change what the fit reads
//! (tolerations, node selection, the RuntimeClass, resources) is published as `opaque`, and
//! the fit cannot judge a pod it selects.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorRequirement, NodeSelectorTerm, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::names;

/// The most node selector terms a conjunction may produce (rule terms times pod terms).
pub const MAX_TERMS: usize = 64;

/// The placement part of one override rule.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacementRule {
    pub name: String,
    /// Pods of these namespaces; every namespace when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// Pods whose (upper) labels it selects; every pod when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_selector_terms: Vec<NodeSelectorTerm>,
    /// RuntimeClass name upstream → name below.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub runtime_class_names: BTreeMap<String, String>,
    /// Its JSON patch may change what the fit reads.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
}

/// The placement part of a lower cluster's rules in force, in their order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlacementOverrides {
    /// The format's version.
    pub v: u32,
    #[serde(default)]
    pub rules: Vec<PlacementRule>,
}

/// The format's version this release writes and reads.
pub const VERSION: u32 = 1;

/// What the rules make of a pod's placement below.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// The lower pod's nodeSelector, required terms and tolerations.
    Known {
        node_selector: BTreeMap<String, String>,
        terms: Option<Vec<NodeSelectorTerm>>,
        tolerations: Vec<Toleration>,
    },
    /// The virtual node refuses the pod: the rule and why.
    Refused(String, String),
    /// A rule changes what the fit cannot see: the rule and what.
    Unknown(String, &'static str),
}

impl PlacementOverrides {
    /// The placement overrides a Node publishes (`None`: none), or why they do not decode.
    pub fn of(annotations: Option<&BTreeMap<String, String>>) -> Option<Result<Self, String>> {
        let text = annotations?.get(names::NODE_PLACEMENT_OVERRIDES)?;
        Some(Self::decode(text))
    }

    pub fn decode(text: &str) -> Result<Self, String> {
        let decoded: Self = serde_json::from_str(text)
            .map_err(|e| format!("{} does not decode: {e}", names::NODE_PLACEMENT_OVERRIDES))?;
        if decoded.v != VERSION {
            return Err(format!(
                "{} is of version {}; this release reads version {VERSION}",
                names::NODE_PLACEMENT_OVERRIDES,
                decoded.v
            ));
        }
        Ok(decoded)
    }

    pub fn encode(&self) -> String {
        // Plain data: serialising it cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The lower pod's placement: the stash's nodeSelector, required terms and tolerations,
    /// changed by the rules that select a pod of `namespace`, `labels` and RuntimeClass
    /// `runtime_class`, in their order, as the virtual node changes them.
    pub fn place(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        runtime_class: Option<&str>,
        node_selector: &BTreeMap<String, String>,
        terms: Option<&[NodeSelectorTerm]>,
        tolerations: &[Toleration],
    ) -> Placement {
        let mut node_selector = node_selector.clone();
        let mut terms = terms.map(<[NodeSelectorTerm]>::to_vec);
        let mut tolerations = tolerations.to_vec();
        for rule in self
            .rules
            .iter()
            .filter(|r| selects(&r.namespaces, r.selector.as_ref(), namespace, labels))
        {
            if rule.opaque {
                return Placement::Unknown(rule.name.clone(), "its patch may change the pod's placement");
            }
            if runtime_class.is_some_and(|c| rule.runtime_class_names.get(c).is_some_and(|to| to != c)) {
                return Placement::Unknown(
                    rule.name.clone(),
                    "it maps the RuntimeClass, whose overhead and scheduling below are not published",
                );
            }
            add_tolerations(&mut tolerations, &rule.tolerations);
            if let Err(why) = add_node_selector(&mut node_selector, &rule.node_selector) {
                return Placement::Refused(rule.name.clone(), why);
            }
            if !rule.node_selector_terms.is_empty() {
                let have = terms.get_or_insert_with(Vec::new);
                if let Err(why) = conjoin(have, &rule.node_selector_terms) {
                    return Placement::Refused(rule.name.clone(), why);
                }
            }
        }
        Placement::Known {
            node_selector,
            terms,
            tolerations,
        }
    }
}

/// Whether a rule of these namespaces and selector selects a pod of `namespace` and upper
/// `labels`.
pub fn selects(
    namespaces: &[String],
    selector: Option<&LabelSelector>,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    (namespaces.is_empty() || namespaces.iter().any(|n| n == namespace))
        && selector.is_none_or(|s| crate::label_selector::matches(s, labels))
}

/// Adds each toleration of `add` the pod lacks.
pub fn add_tolerations(have: &mut Vec<Toleration>, add: &[Toleration]) {
    for t in add {
        if !have.contains(t) {
            have.push(t.clone());
        }
    }
}

/// Adds the pairs of `add` to a nodeSelector; a key set to another value is a contradiction.
pub fn add_node_selector(
    have: &mut BTreeMap<String, String>,
    add: &BTreeMap<String, String>,
) -> Result<(), String> {
    for (k, v) in add {
        match have.get(k) {
            Some(theirs) if theirs != v => {
                return Err(format!("nodeSelector {k}={v} contradicts the pod's {k}={theirs}"));
            }
            _ => {
                have.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(())
}

/// The required node selector terms `have` in conjunction with `terms`: (a ∨ b) ∧ (x ∨ y)
/// is (a∧x) ∨ (a∧y) ∨ (b∧x) ∨ (b∧y). No terms before: `terms` alone.
pub fn conjoin(have: &mut Vec<NodeSelectorTerm>, terms: &[NodeSelectorTerm]) -> Result<(), String> {
    if have.is_empty() {
        *have = terms.to_vec();
        return Ok(());
    }
    if have.len() * terms.len() > MAX_TERMS {
        return Err(format!(
            "nodeSelectorTerms: {} of the pod's terms times {} of the rule's exceed {MAX_TERMS}",
            have.len(),
            terms.len()
        ));
    }
    let join = |a: &Option<Vec<NodeSelectorRequirement>>, b: &Option<Vec<NodeSelectorRequirement>>| {
        let all: Vec<NodeSelectorRequirement> = a.iter().chain(b).flatten().cloned().collect();
        (!all.is_empty()).then_some(all)
    };
    *have = have
        .iter()
        .flat_map(|t| {
            terms.iter().map(move |r| NodeSelectorTerm {
                match_expressions: join(&t.match_expressions, &r.match_expressions),
                match_fields: join(&t.match_fields, &r.match_fields),
            })
        })
        .collect();
    Ok(())
}

/// Whether a JSON patch may change what the fit reads of a pod: its tolerations, node
/// selection, RuntimeClass, overhead or the resources of any container. Operations are
/// judged by their `path` (and `from`, for `move` and `copy`); a `test` changes nothing.
pub fn patch_changes_placement(patch: &[Value]) -> bool {
    const PLACEMENT: [&str; 8] = [
        "/spec/tolerations",
        "/spec/nodeSelector",
        "/spec/affinity",
        "/spec/runtimeClassName",
        "/spec/overhead",
        "/spec/resources",
        "/spec/containers",
        "/spec/initContainers",
    ];
    let touches = |path: &str| {
        path == "/spec"
            || PLACEMENT
                .iter()
                .any(|p| path == *p || path.strip_prefix(p).is_some_and(|rest| rest.starts_with('/')))
    };
    patch.iter().any(|op| {
        let verb = op.get("op").and_then(Value::as_str).unwrap_or_default();
        let path = op.get("path").and_then(Value::as_str).unwrap_or_default();
        let from = op.get("from").and_then(Value::as_str).unwrap_or_default();
        let resources_only = |p: &str| {
            // A container's image, env or command is not placement; its resources are.
            match p
                .strip_prefix("/spec/containers/")
                .or(p.strip_prefix("/spec/initContainers/"))
            {
                Some(rest) => {
                    let mut parts = rest.splitn(3, '/');
                    let _index = parts.next();
                    matches!(parts.next(), None | Some("resources"))
                }
                None => touches(p),
            }
        };
        verb != "test" && (resources_only(path) || (verb == "move" && resources_only(from)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(v: Value) -> PlacementOverrides {
        serde_json::from_value(json!({"v": 1, "rules": v})).unwrap()
    }

    fn toleration(key: &str) -> Toleration {
        Toleration {
            key: Some(key.into()),
            operator: Some("Exists".into()),
            ..Default::default()
        }
    }

    #[test]
    fn the_rules_selecting_a_pod_change_its_placement_in_order_and_the_others_do_not() {
        let o = rules(json!([
            {"name": "dedicated", "namespaces": ["shop"], "tolerations": [{"key": "dedicated", "operator": "Exists"}],
             "nodeSelector": {"pool": "fleet"}},
            {"name": "zone", "selector": {"matchLabels": {"tier": "db"}},
             "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]},
        ]));
        let labels = BTreeMap::from([("tier".to_owned(), "web".to_owned())]);
        let placed = o.place("shop", &labels, None, &BTreeMap::new(), None, &[toleration("a")]);
        assert_eq!(
            placed,
            Placement::Known {
                node_selector: BTreeMap::from([("pool".to_owned(), "fleet".to_owned())]),
                terms: None,
                tolerations: vec![toleration("a"), toleration("dedicated")],
            }
        );
        let db = BTreeMap::from([("tier".to_owned(), "db".to_owned())]);
        let Placement::Known { terms, .. } = o.place("other", &db, None, &BTreeMap::new(), None, &[]) else {
            panic!("known");
        };
        assert_eq!(terms.unwrap().len(), 1, "the zone rule alone");
    }

    #[test]
    fn a_contradiction_refuses_and_what_the_fit_cannot_see_is_unknown() {
        let o = rules(json!([{"name": "fleet", "nodeSelector": {"pool": "fleet"}}]));
        let own = BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]);
        assert!(matches!(
            o.place("ns", &BTreeMap::new(), None, &own, None, &[]),
            Placement::Refused(rule, why) if rule == "fleet" && why.contains("contradicts")
        ));
        let o = rules(json!([{"name": "kata", "runtimeClassNames": {"runc": "kata"}}]));
        assert!(matches!(
            o.place("ns", &BTreeMap::new(), Some("runc"), &BTreeMap::new(), None, &[]),
            Placement::Unknown(rule, _) if rule == "kata"
        ));
        assert!(
            matches!(
                o.place("ns", &BTreeMap::new(), None, &BTreeMap::new(), None, &[]),
                Placement::Known { .. }
            ),
            "a pod without that RuntimeClass"
        );
        let o = rules(json!([{"name": "patched", "opaque": true}]));
        assert!(matches!(
            o.place("ns", &BTreeMap::new(), None, &BTreeMap::new(), None, &[]),
            Placement::Unknown(..)
        ));
    }

    #[test]
    fn terms_conjoin_and_a_conjunction_too_large_refuses() {
        let term = |k: &str| NodeSelectorTerm {
            match_expressions: Some(vec![NodeSelectorRequirement {
                key: k.into(),
                operator: "Exists".into(),
                values: None,
            }]),
            match_fields: None,
        };
        let mut have = vec![term("a"), term("b")];
        conjoin(&mut have, &[term("x"), term("y")]).unwrap();
        assert_eq!(have.len(), 4);
        assert_eq!(have[0].match_expressions.as_ref().unwrap().len(), 2);
        let mut many: Vec<NodeSelectorTerm> = (0..9).map(|i| term(&i.to_string())).collect();
        let rule: Vec<NodeSelectorTerm> = (0..8).map(|i| term(&format!("r{i}"))).collect();
        assert!(conjoin(&mut many, &rule).is_err());
    }

    #[test]
    fn patches_are_opaque_when_they_touch_what_the_fit_reads() {
        let p = |v: Value| patch_changes_placement(v.as_array().unwrap());
        assert!(p(
            json!([{"op": "add", "path": "/spec/tolerations/-", "value": {}}])
        ));
        assert!(p(
            json!([{"op": "replace", "path": "/spec/containers/0/resources/requests/cpu", "value": "2"}])
        ));
        assert!(
            p(json!([{"op": "add", "path": "/spec/containers/-", "value": {}}])),
            "a whole container"
        );
        assert!(!p(
            json!([{"op": "add", "path": "/spec/priorityClassName", "value": "x"}])
        ));
        assert!(!p(
            json!([{"op": "replace", "path": "/spec/containers/0/image", "value": "x"}])
        ));
        assert!(!p(
            json!([{"op": "add", "path": "/metadata/labels/a", "value": "b"}])
        ));
        assert!(!p(
            json!([{"op": "test", "path": "/spec/nodeSelector/pool", "value": "b"}])
        ));
        assert!(p(json!([{"op": "remove", "path": "/spec/affinity"}])));
        assert!(
            !p(json!([{"op": "add", "path": "/spec/tolerationsExtra", "value": 1}])),
            "another field"
        );
    }

    #[test]
    fn the_annotation_round_trips_and_another_version_is_named() {
        let o = rules(json!([{"name": "r", "tolerations": [{"key": "k", "operator": "Exists"}]}]));
        assert_eq!(PlacementOverrides::decode(&o.encode()).unwrap(), o);
        let err = PlacementOverrides::decode(r#"{"v":2,"rules":[]}"#).unwrap_err();
        assert!(err.contains("version 2"), "{err}");
        assert!(PlacementOverrides::decode("{").is_err());
    }
}
