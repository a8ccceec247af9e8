//! The stash: lower-cluster scheduling constraints carried on an upper pod.
//!
//! The webhook moves an opted-in pod's `nodeSelector`, required node affinity and tolerations
//! into the [`CLUSTER_SELECTOR`](crate::names::CLUSTER_SELECTOR) annotation, because they
//! describe nodes of a lower cluster that the upper scheduler cannot see; virtual-node puts
//! them back on the lower pod. The format is tensile-kube's, so stashes written by either
//! side read on the other: a JSON object with optional `nodeSelector`, `affinity` (only its
//! `nodeAffinity` is meaningful) and `tolerations`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, NodeAffinity, Toleration};
use serde::{Deserialize, Serialize};

use crate::names::CLUSTER_SELECTOR;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("annotation {CLUSTER_SELECTOR} is not a valid stash: {0}")]
    Decode(#[source] serde_json::Error),
    #[error("cannot encode the {CLUSTER_SELECTOR} stash: {0}")]
    Encode(#[source] serde_json::Error),
}

/// Constraints meant for the lower cluster, as stored in the annotation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stash {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Only `nodeAffinity` is written; pod (anti-)affinity stays on the upper pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

impl Stash {
    /// A stash holding `node_affinity` (when there is one) under `affinity.nodeAffinity`.
    pub fn new(
        node_selector: BTreeMap<String, String>,
        node_affinity: Option<NodeAffinity>,
        tolerations: Vec<Toleration>,
    ) -> Self {
        let affinity = node_affinity.map(|na| Affinity {
            node_affinity: Some(na),
            ..Default::default()
        });
        Self {
            node_selector,
            affinity,
            tolerations,
        }
    }

    pub fn node_affinity(&self) -> Option<&NodeAffinity> {
        self.affinity.as_ref().and_then(|a| a.node_affinity.as_ref())
    }

    /// True when the stash constrains nothing (the pod still went through the webhook).
    pub fn is_empty(&self) -> bool {
        self.node_selector.is_empty() && self.node_affinity().is_none() && self.tolerations.is_empty()
    }

    pub fn encode(&self) -> Result<String, Error> {
        serde_json::to_string(self).map_err(Error::Encode)
    }

    pub fn decode(text: &str) -> Result<Self, Error> {
        serde_json::from_str(text).map_err(Error::Decode)
    }

    /// The stash in a pod's annotations, `None` when the pod carries none.
    pub fn from_annotations(annotations: Option<&BTreeMap<String, String>>) -> Result<Option<Self>, Error> {
        annotations
            .and_then(|a| a.get(CLUSTER_SELECTOR))
            .map(|text| Self::decode(text))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

    fn sample() -> Stash {
        let term = NodeSelectorTerm {
            match_expressions: Some(vec![NodeSelectorRequirement {
                key: "zone".into(),
                operator: "In".into(),
                values: Some(vec!["a".into(), "b".into()]),
            }]),
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".into(),
                operator: "NotIn".into(),
                values: Some(vec!["n1".into()]),
            }]),
        };
        Stash::new(
            BTreeMap::from([("disk".into(), "ssd".into())]),
            Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: vec![term],
                }),
                ..Default::default()
            }),
            vec![Toleration {
                key: Some("gpu".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }],
        )
    }

    #[test]
    fn a_stash_round_trips_in_tensile_kube_format() {
        let stash = sample();
        let text = stash.encode().unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["nodeSelector"]["disk"], "ssd");
        let term = &json["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0];
        assert_eq!(term["matchExpressions"][0]["key"], "zone");
        assert_eq!(term["matchFields"][0]["key"], "metadata.name");
        assert_eq!(json["tolerations"][0]["key"], "gpu");
        assert_eq!(Stash::decode(&text).unwrap(), stash);
    }

    #[test]
    fn an_empty_stash_is_an_empty_object() {
        let stash = Stash::default();
        assert!(stash.is_empty());
        assert_eq!(stash.encode().unwrap(), "{}");
        assert_eq!(Stash::decode("{}").unwrap(), stash);
    }

    #[test]
    fn a_stash_written_by_tensile_kube_decodes() {
        // Go's encoder writes every field of the Affinity it was given, nulls included.
        let text = r#"{"nodeSelector":{"kubernetes.io/hostname":"n1"},"affinity":{"nodeAffinity":null},"tolerations":[{"key":"k","operator":"Equal","value":"v","effect":"NoExecute","tolerationSeconds":30}]}"#;
        let stash = Stash::decode(text).unwrap();
        assert_eq!(stash.node_selector["kubernetes.io/hostname"], "n1");
        assert!(stash.node_affinity().is_none());
        assert_eq!(stash.tolerations[0].toleration_seconds, Some(30));
    }

    #[test]
    fn annotations_without_a_stash_give_none_and_a_bad_one_names_the_annotation() {
        assert!(Stash::from_annotations(None).unwrap().is_none());
        let other = BTreeMap::from([("a".to_string(), "b".to_string())]);
        assert!(Stash::from_annotations(Some(&other)).unwrap().is_none());
        let bad = BTreeMap::from([(CLUSTER_SELECTOR.to_string(), "{not json".to_string())]);
        let err = Stash::from_annotations(Some(&bad)).unwrap_err();
        assert!(err.to_string().contains(CLUSTER_SELECTOR), "{err}");
    }
}
