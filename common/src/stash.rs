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

/// The key the webhook signs stashes with and virtual nodes verify them with (HMAC-SHA256).
/// The trust model: the webhook is the only writer of stashes. A stash written by hand, on a
/// pod the webhook never saw or edited afterwards, carries no valid signature, so a virtual
/// node holding the key never applies it below (it would give the lower pod tolerations or
/// selectors no upper admission policy saw).
pub struct StashKey(ring::hmac::Key);

/// Why a stash key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("stash key {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stash key {path}: {len} bytes; at least 32 are needed")]
    Short { path: std::path::PathBuf, len: usize },
}

impl StashKey {
    /// The key in `path` (its bytes, surrounding whitespace trimmed; at least 32).
    pub fn from_file(path: &std::path::Path) -> Result<Self, KeyError> {
        let bytes = std::fs::read(path).map_err(|source| KeyError::Read {
            path: path.to_owned(),
            source,
        })?;
        let secret = bytes.trim_ascii();
        if secret.len() < 32 {
            return Err(KeyError::Short {
                path: path.to_owned(),
                len: secret.len(),
            });
        }
        Ok(Self::new(secret))
    }

    pub fn new(secret: &[u8]) -> Self {
        StashKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret))
    }

    fn message(namespace: &str, stash: &str) -> Vec<u8> {
        [namespace.as_bytes(), b"\n", stash.as_bytes()].concat()
    }

    /// The signature of stash text `stash` on a pod of `namespace`: `v1:` and the hex MAC.
    pub fn sign(&self, namespace: &str, stash: &str) -> String {
        let tag = ring::hmac::sign(&self.0, &Self::message(namespace, stash));
        let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        format!("v1:{hex}")
    }

    /// Whether `signature` is this key's signature of `stash` in `namespace`.
    pub fn verify(&self, namespace: &str, stash: &str, signature: &str) -> bool {
        let Some(hex) = signature.strip_prefix("v1:") else {
            return false;
        };
        let bytes: Option<Vec<u8>> = (0..hex.len())
            .step_by(2)
            .map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect();
        bytes.is_some_and(|tag| ring::hmac::verify(&self.0, &Self::message(namespace, stash), &tag).is_ok())
    }
}

impl std::fmt::Debug for StashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StashKey(..)")
    }
}

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

    #[test]
    fn a_signature_holds_for_its_stash_and_namespace_only() {
        let key = StashKey::new(&[7u8; 32]);
        let stash = r#"{"tolerations":[{"key":"gpu","operator":"Exists"}]}"#;
        let signature = key.sign("shop", stash);
        assert!(
            signature.starts_with("v1:") && signature.len() == 3 + 64,
            "{signature}"
        );
        assert!(key.verify("shop", stash, &signature));
        assert!(!key.verify("other", stash, &signature), "bound to the namespace");
        assert!(
            !key.verify("shop", r#"{"tolerations":[{"operator":"Exists"}]}"#, &signature),
            "an edited stash"
        );
        assert!(
            !StashKey::new(&[8u8; 32]).verify("shop", stash, &signature),
            "another key"
        );
        for forged in ["", "v1:", "v1:zz", "v2:00", &signature[..signature.len() - 1]] {
            assert!(!key.verify("shop", stash, forged), "{forged:?}");
        }
    }

    #[test]
    fn a_short_key_file_is_refused_with_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "too short\n").unwrap();
        let err = StashKey::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("9 bytes") && err.contains("32"), "{err}");
        std::fs::write(&path, format!("{}\n", "k".repeat(40))).unwrap();
        assert!(StashKey::from_file(&path).is_ok());
    }
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
