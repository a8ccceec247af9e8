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
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::names::{CLUSTER_SELECTOR, STASH_SIGNATURE};

/// The holder of a stash: the identity of the pod the webhook saw that survives admission
/// (a pod's UID and, for `generateName` pods, its name are only given after mutating
/// admission). A signature binds the stash to its namespace and holder, so it cannot be
/// replayed onto a pod of another workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder<'a> {
    /// The UID of the pod's controller (its `ownerReferences` entry with `controller: true`).
    Controller(&'a str),
    /// The name of a pod without a controller.
    Name(&'a str),
}

impl<'a> Holder<'a> {
    /// The holder of the pod with `metadata`: its controller, else its name; `None` for a
    /// pod with neither.
    pub fn of(metadata: &'a ObjectMeta) -> Option<Self> {
        let controller = metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true));
        match controller {
            Some(owner) => Some(Holder::Controller(&owner.uid)),
            None => metadata
                .name
                .as_deref()
                .filter(|n| !n.is_empty())
                .map(Holder::Name),
        }
    }
}

impl std::fmt::Display for Holder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Controller(uid) => write!(f, "controller uid {uid}"),
            Holder::Name(name) => write!(f, "pod name {name}"),
        }
    }
}

/// The name the apiserver would give a pod of `generate_name` (the prefix cut to 58
/// characters, then 5 of its random alphabet), drawn from `seed` instead of at random. The
/// webhook names a bare `generateName` pod itself when it signs its stash, because the
/// apiserver names it only after mutating admission; `seed` is the admission request's UID,
/// so the same review always gets the same name.
pub fn generated_name(generate_name: &str, seed: &str) -> String {
    const ALPHABET: &[u8; 27] = b"bcdfghjklmnpqrstvwxz2456789";
    let prefix: String = generate_name.chars().take(58).collect();
    let digest = ring::digest::digest(&ring::digest::SHA256, seed.as_bytes());
    let suffix: String = digest.as_ref()[..5]
        .iter()
        .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]))
        .collect();
    prefix + &suffix
}

/// One key the webhook signs stashes with and virtual nodes verify them with (HMAC-SHA256),
/// named by an id that every signature carries, so keys can be rotated.
///
/// The trust model: the webhook is the only writer of stashes. A stash written by hand, on a
/// pod the webhook never saw, edited afterwards, or copied from another workload's pod,
/// carries no valid signature for its pod, so a virtual node holding the key never applies
/// it below (it would give the lower pod tolerations or selectors no upper admission policy
/// saw on that pod).
pub struct StashKey {
    id: String,
    key: ring::hmac::Key,
}

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
    #[error(
        "stash key id {id:?} (a key file's name): use 1 to 63 letters, digits, '-', '_' or '.', \
         as a Secret's keys"
    )]
    BadId { id: String },
    #[error("stash keys {first} and {second} have the same id {id:?} (the file name)")]
    DuplicateId {
        id: String,
        first: std::path::PathBuf,
        second: std::path::PathBuf,
    },
}

/// Why a stash is not trusted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    #[error("annotation {STASH_SIGNATURE} is missing")]
    Missing,
    #[error(
        "annotation {STASH_SIGNATURE} is a v1 signature, which bound only the namespace; \
         it is no longer accepted (the webhook signs v2: recreate the pod)"
    )]
    Version1,
    #[error("annotation {STASH_SIGNATURE} is malformed: expected v2:<key id>:<64 hex digits>")]
    Malformed,
    #[error("annotation {STASH_SIGNATURE} names key {id:?}, which is not one of the keys held ({held})")]
    UnknownKey { id: String, held: String },
    #[error("the pod has no controller and no name, so no signature can be bound to it")]
    NoHolder,
    #[error(
        "annotation {STASH_SIGNATURE} (key {id:?}) is not the signature of this stash for this pod \
         (namespace {namespace}, {holder}): it was made for another pod, or the stash was edited"
    )]
    Mismatch {
        id: String,
        namespace: String,
        holder: String,
    },
}

/// The signature's version prefix.
const VERSION: &str = "v2";

impl StashKey {
    /// The key in `path`, named by the file's name (its bytes, surrounding whitespace
    /// trimmed; at least 32). A Secret mounted as a volume gives one file per key id.
    pub fn from_file(path: &std::path::Path) -> Result<Self, KeyError> {
        let id = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
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
        Self::new(&id, secret)
    }

    /// A key named `id` (1 to 63 letters, digits, `-`, `_`, `.`: it travels in the signature,
    /// which is split at `:`).
    pub fn new(id: &str, secret: &[u8]) -> Result<Self, KeyError> {
        let valid = (1..=63).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid {
            return Err(KeyError::BadId { id: id.to_owned() });
        }
        Ok(StashKey {
            id: id.to_owned(),
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// What is signed: the version, the namespace, the holder and the stash text, one per
    /// line (names and UIDs hold no newline; the stash comes last, so it may).
    fn message(namespace: &str, holder: Holder<'_>, stash: &str) -> Vec<u8> {
        let (kind, value) = match holder {
            Holder::Controller(uid) => ("controller", uid),
            Holder::Name(name) => ("name", name),
        };
        [VERSION, "\n", namespace, "\n", kind, "\n", value, "\n", stash]
            .concat()
            .into_bytes()
    }

    /// The signature of stash text `stash` on the pod of `namespace` held by `holder`:
    /// `v2:<key id>:<hex MAC>`.
    pub fn sign(&self, namespace: &str, holder: Holder<'_>, stash: &str) -> String {
        let tag = ring::hmac::sign(&self.key, &Self::message(namespace, holder, stash));
        let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        format!("{VERSION}:{}:{hex}", self.id)
    }
}

impl std::fmt::Debug for StashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StashKey({:?})", self.id)
    }
}

/// The keys a virtual node accepts stashes signed with: during a rotation, the old and the
/// new one.
#[derive(Debug)]
pub struct StashKeys(Vec<StashKey>);

impl StashKeys {
    /// The keys in `paths`, each named by its file name; the names must differ.
    pub fn from_files(paths: &[std::path::PathBuf]) -> Result<Self, KeyError> {
        let mut keys: Vec<(StashKey, &std::path::PathBuf)> = Vec::with_capacity(paths.len());
        for path in paths {
            let key = StashKey::from_file(path)?;
            if let Some((_, first)) = keys.iter().find(|(k, _)| k.id == key.id) {
                return Err(KeyError::DuplicateId {
                    id: key.id,
                    first: (*first).clone(),
                    second: path.clone(),
                });
            }
            keys.push((key, path));
        }
        Ok(StashKeys(keys.into_iter().map(|(k, _)| k).collect()))
    }

    /// The keys given (the first of those sharing an id is kept).
    pub fn new(keys: Vec<StashKey>) -> Self {
        let mut kept: Vec<StashKey> = Vec::with_capacity(keys.len());
        for key in keys {
            if !kept.iter().any(|k| k.id == key.id) {
                kept.push(key);
            }
        }
        StashKeys(kept)
    }

    /// The ids held, comma-separated.
    pub fn ids(&self) -> String {
        self.0.iter().map(|k| k.id.as_str()).collect::<Vec<_>>().join(",")
    }

    /// Whether `signature` is the signature, by a key held, of `stash` on the pod of
    /// `namespace` held by `holder`.
    pub fn verify(
        &self,
        namespace: &str,
        holder: Option<Holder<'_>>,
        stash: &str,
        signature: Option<&str>,
    ) -> Result<(), Untrusted> {
        let signature = signature.ok_or(Untrusted::Missing)?;
        if signature.starts_with("v1:") {
            return Err(Untrusted::Version1);
        }
        let (id, hex) = signature
            .strip_prefix("v2:")
            .and_then(|rest| rest.split_once(':'))
            .ok_or(Untrusted::Malformed)?;
        let tag = decode_hex(hex).ok_or(Untrusted::Malformed)?;
        let key = self
            .0
            .iter()
            .find(|k| k.id == id)
            .ok_or_else(|| Untrusted::UnknownKey {
                id: id.to_owned(),
                held: self.ids(),
            })?;
        let holder = holder.ok_or(Untrusted::NoHolder)?;
        ring::hmac::verify(&key.key, &StashKey::message(namespace, holder, stash), &tag).map_err(|_| {
            Untrusted::Mismatch {
                id: id.to_owned(),
                namespace: namespace.to_owned(),
                holder: holder.to_string(),
            }
        })
    }

    /// Whether the stash of the pod with `metadata`, if it has one, is signed for that pod
    /// by a key held. A pod without a stash needs no signature.
    pub fn check(&self, metadata: &ObjectMeta) -> Result<(), Untrusted> {
        let annotations = metadata.annotations.as_ref();
        let Some(stash) = annotations.and_then(|a| a.get(CLUSTER_SELECTOR)) else {
            return Ok(());
        };
        let signature = annotations.and_then(|a| a.get(STASH_SIGNATURE));
        self.verify(
            metadata.namespace.as_deref().unwrap_or_default(),
            Holder::of(metadata),
            stash,
            signature.map(String::as_str),
        )
    }
}

/// Hex digits to bytes; `None` for an odd length or a non-hex digit.
fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
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

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    const STASH: &str = r#"{"tolerations":[{"key":"gpu","operator":"Exists"}]}"#;

    fn key(id: &str, byte: u8) -> StashKey {
        StashKey::new(id, &[byte; 32]).unwrap()
    }

    /// A pod of namespace `shop`: named `name`, controlled by `controller` when given, with
    /// `STASH` signed as `signature`.
    fn pod(name: Option<&str>, controller: Option<&str>, signature: Option<String>) -> ObjectMeta {
        let mut annotations = BTreeMap::from([(CLUSTER_SELECTOR.to_owned(), STASH.to_owned())]);
        if let Some(sig) = signature {
            annotations.insert(STASH_SIGNATURE.to_owned(), sig);
        }
        ObjectMeta {
            name: name.map(str::to_owned),
            namespace: Some("shop".into()),
            annotations: Some(annotations),
            owner_references: controller.map(|uid| {
                vec![
                    OwnerReference {
                        uid: "not-the-controller".into(),
                        controller: Some(false),
                        ..Default::default()
                    },
                    OwnerReference {
                        uid: uid.into(),
                        controller: Some(true),
                        ..Default::default()
                    },
                ]
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_signature_holds_for_its_stash_namespace_and_holder_only() {
        let k = key("k1", 7);
        let keys = StashKeys::new(vec![key("k1", 7)]);
        let web = Holder::Controller("rs-web");
        let signature = k.sign("shop", web, STASH);
        assert!(
            signature.starts_with("v2:k1:") && signature.len() == 6 + 64,
            "{signature}"
        );
        assert_eq!(keys.verify("shop", Some(web), STASH, Some(&signature)), Ok(()));
        assert!(
            keys.verify("other", Some(web), STASH, Some(&signature)).is_err(),
            "the namespace"
        );
        let edited = r#"{"tolerations":[{"operator":"Exists"}]}"#;
        assert!(
            keys.verify("shop", Some(web), edited, Some(&signature)).is_err(),
            "an edited stash"
        );
        let other_key = StashKeys::new(vec![key("k1", 8)]);
        assert!(matches!(
            other_key.verify("shop", Some(web), STASH, Some(&signature)),
            Err(Untrusted::Mismatch { .. })
        ));
        // A controller's UID and a pod name that read the same are different holders.
        assert!(
            keys.verify("shop", Some(Holder::Name("rs-web")), STASH, Some(&signature))
                .is_err()
        );
    }

    #[test]
    fn a_signature_replayed_onto_another_workloads_pod_is_refused() {
        let k = key("k1", 7);
        let keys = StashKeys::new(vec![key("k1", 7)]);
        let signed = pod(
            Some("web-abcde"),
            Some("rs-web"),
            Some(k.sign("shop", Holder::Controller("rs-web"), STASH)),
        );
        assert_eq!(Holder::of(&signed), Some(Holder::Controller("rs-web")));
        assert_eq!(keys.check(&signed), Ok(()));
        // Another pod of the same workload carries the same signature rightly.
        let sibling = ObjectMeta {
            name: Some("web-fghij".into()),
            ..signed.clone()
        };
        assert_eq!(keys.check(&sibling), Ok(()));
        // Copied onto another workload's pod, or onto a bare pod, of the same namespace.
        let signature = signed.annotations.as_ref().unwrap()[STASH_SIGNATURE].clone();
        let other_owner = pod(Some("api-1"), Some("rs-api"), Some(signature.clone()));
        let err = keys.check(&other_owner).unwrap_err();
        assert!(matches!(err, Untrusted::Mismatch { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("controller uid rs-api") && text.contains("namespace shop"),
            "{text}"
        );
        let bare = pod(Some("web-abcde"), None, Some(signature));
        assert!(matches!(keys.check(&bare), Err(Untrusted::Mismatch { .. })));
    }

    #[test]
    fn a_bare_pods_signature_is_bound_to_its_name() {
        let k = key("k1", 7);
        let keys = StashKeys::new(vec![key("k1", 7)]);
        let signature = k.sign("shop", Holder::Name("job-runner"), STASH);
        let signed = pod(Some("job-runner"), None, Some(signature.clone()));
        assert_eq!(Holder::of(&signed), Some(Holder::Name("job-runner")));
        assert_eq!(keys.check(&signed), Ok(()));
        let renamed = pod(Some("job-runner-2"), None, Some(signature.clone()));
        let err = keys.check(&renamed).unwrap_err();
        assert!(err.to_string().contains("pod name job-runner-2"), "{err}");
        // A pod with neither a controller nor a name has nothing to be bound to.
        let nameless = pod(None, None, Some(signature));
        assert_eq!(keys.check(&nameless), Err(Untrusted::NoHolder));
    }

    #[test]
    fn during_a_rotation_both_keys_are_accepted_and_an_unknown_id_is_named() {
        let (old, new) = (key("2024-01", 1), key("2024-07", 2));
        let web = Holder::Controller("rs-web");
        let both = StashKeys::new(vec![key("2024-01", 1), key("2024-07", 2)]);
        for signer in [&old, &new] {
            let sig = signer.sign("shop", web, STASH);
            assert_eq!(both.verify("shop", Some(web), STASH, Some(&sig)), Ok(()), "{sig}");
        }
        let after = StashKeys::new(vec![key("2024-07", 2)]);
        let err = after
            .verify("shop", Some(web), STASH, Some(&old.sign("shop", web, STASH)))
            .unwrap_err();
        assert_eq!(
            err,
            Untrusted::UnknownKey {
                id: "2024-01".into(),
                held: "2024-07".into()
            }
        );
        assert!(
            err.to_string().contains("\"2024-01\"") && err.to_string().contains("2024-07"),
            "{err}"
        );
        // The key id in a signature is the signer's claim only: a key of that id that is not
        // the signer's does not verify.
        let forged = new.sign("shop", web, STASH).replace("v2:2024-07:", "v2:2024-01:");
        assert!(matches!(
            both.verify("shop", Some(web), STASH, Some(&forged)),
            Err(Untrusted::Mismatch { .. })
        ));
    }

    #[test]
    fn missing_malformed_and_version_1_signatures_get_their_own_reasons() {
        let keys = StashKeys::new(vec![key("k1", 7)]);
        let web = Some(Holder::Controller("rs-web"));
        assert_eq!(keys.verify("shop", web, STASH, None), Err(Untrusted::Missing));
        assert_eq!(
            keys.verify("shop", web, STASH, Some(&format!("v1:{}", "0".repeat(64)))),
            Err(Untrusted::Version1)
        );
        for bad in ["", "v2:", "v2:k1", "v2:k1:zz", "v2:k1:abc", "v3:k1:00"] {
            assert_eq!(
                keys.verify("shop", web, STASH, Some(bad)),
                Err(Untrusted::Malformed),
                "{bad:?}"
            );
        }
        // A pod without a stash needs no signature.
        let mut plain = pod(Some("p"), None, None);
        plain.annotations = None;
        assert_eq!(keys.check(&plain), Ok(()));
    }

    #[test]
    fn a_generated_name_is_the_prefix_and_five_characters_of_the_apiservers_alphabet() {
        let name = generated_name("job-", "3f1c-uid");
        assert_eq!(name.len(), 9, "{name}");
        assert!(name.starts_with("job-"));
        assert!(
            name[4..]
                .bytes()
                .all(|b| b"bcdfghjklmnpqrstvwxz2456789".contains(&b)),
            "{name}"
        );
        assert_eq!(
            generated_name("job-", "3f1c-uid"),
            name,
            "the same review, the same name"
        );
        assert_ne!(generated_name("job-", "other-uid"), name);
        assert_eq!(generated_name(&"x".repeat(80), "u").len(), 63);
    }

    #[test]
    fn key_files_are_named_by_their_file_name_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("2024-07");
        std::fs::write(&path, "too short\n").unwrap();
        let err = StashKey::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("9 bytes") && err.contains("32"), "{err}");
        std::fs::write(&path, format!("{}\n", "k".repeat(40))).unwrap();
        assert_eq!(StashKey::from_file(&path).unwrap().id(), "2024-07");
        let bad = dir.path().join("a:b");
        std::fs::write(&bad, "k".repeat(40)).unwrap();
        assert!(matches!(StashKey::from_file(&bad), Err(KeyError::BadId { .. })));
        let again = dir.path().join("again");
        std::fs::create_dir(&again).unwrap();
        let twin = again.join("2024-07");
        std::fs::write(&twin, "j".repeat(40)).unwrap();
        let err = StashKeys::from_files(&[path.clone(), twin]).unwrap_err();
        assert!(matches!(err, KeyError::DuplicateId { .. }), "{err}");
        let other = dir.path().join("2024-01");
        std::fs::write(&other, "j".repeat(40)).unwrap();
        assert_eq!(
            StashKeys::from_files(&[path, other]).unwrap().ids(),
            "2024-07,2024-01"
        );
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
