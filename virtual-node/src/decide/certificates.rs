//! Pod certificates and ClusterTrustBundles for pods below.
//!
//! A projected volume may ask the kubelet for a pod certificate (`podCertificate`: a key the
//! kubelet makes, certified by an upper signer through a PodCertificateRequest) or for the
//! trust anchors of ClusterTrustBundles (`clusterTrustBundle`). Sent as they are, a lower
//! kubelet would ask the lower cluster's signers and bundles, of another trust domain. So the
//! virtual node answers them as the upper kubelet would and carries the answers down: the
//! lower pod reads one lower Secret per pod ([`secret_name`], owned by the lower pod) where
//! each source's files are kept, at the paths the upper pod projects them.
//!
//! - A pod certificate is asked for upstream (a PodCertificateRequest for the upper pod, made
//!   by the node with a fresh key, [`key_and_request`]) and written once issued: the credential
//!   bundle (the key, then the chain), the key and the chain. It is asked for again from the
//!   signer's `beginRefreshAt` on ([`refresh_due`]). A pod certificate is an upper credential:
//!   it goes only where upper service-account tokens may go (`--upper-service-account-tokens`
//!   and its namespaces), never into a namespace others share below.
//! - A trust bundle is public: the anchors of the bundle named, or of every bundle of the
//!   signer the selector matches, without duplicates, in a stable order ([`trust_anchors`]),
//!   followed as the bundles change.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{ClusterTrustBundle, PodCertificateRequest};
use k8s_openapi::api::core::v1::{KeyToPath, Pod, PodSpec, Secret, SecretProjection, VolumeProjection};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use tensile_common::lower::identity::Identity;

use crate::decide::tokens::Settings;

/// Prefix of the lower Secret of a pod's certificates and trust bundles; the upper pod's UID
/// follows.
pub const SECRET_PREFIX: &str = "tensile-upper-certificates-";
/// Annotation of a lower pod made to read such a Secret: that Secret's name.
pub const SECRET_ANNOTATION: &str = "tensile.io/upper-certificates-secret";
/// Annotation prefix of those Secrets: when a certificate's refresh begins (RFC 3339), the
/// certificate's key (`certificate-N`) follows.
pub const REFRESH_PREFIX: &str = "tensile.io/refresh-";
/// The key types the node makes keys of, as a projection names them.
pub const KEY_TYPES: [&str; 3] = ["ECDSAP256", "ECDSAP384", "ED25519"];

/// The lower Secret of the certificates and trust bundles of the pod whose UID is `upper_uid`.
pub fn secret_name(upper_uid: &str) -> String {
    format!("{SECRET_PREFIX}{upper_uid}")
}

/// A `podCertificate` source of a pod: the keys it is kept under and what to ask for.
#[derive(Clone, Debug, PartialEq)]
pub struct Certificate {
    /// `certificate-N`; the Secret keys are this with `-bundle`, `-key` and `-chain`.
    pub key: String,
    pub signer: String,
    pub key_type: String,
    pub max_expiration_seconds: Option<i32>,
    pub user_annotations: Option<BTreeMap<String, String>>,
}

impl Certificate {
    pub fn bundle_key(&self) -> String {
        format!("{}-bundle", self.key)
    }
    pub fn key_key(&self) -> String {
        format!("{}-key", self.key)
    }
    pub fn chain_key(&self) -> String {
        format!("{}-chain", self.key)
    }
    /// The annotation of the Secret saying when this certificate's refresh begins.
    pub fn refresh_annotation(&self) -> String {
        format!("{REFRESH_PREFIX}{}", self.key)
    }
}

/// A `clusterTrustBundle` source of a pod: the key it is kept under and which bundles.
#[derive(Clone, Debug, PartialEq)]
pub struct Bundle {
    /// `trust-bundle-N`.
    pub key: String,
    pub name: Option<String>,
    pub signer: Option<String>,
    pub selector: Option<LabelSelector>,
    pub optional: bool,
}

/// What a pod's projected volumes ask of the node in this module, in volume order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sources {
    pub certificates: Vec<Certificate>,
    pub bundles: Vec<Bundle>,
}

impl Sources {
    pub fn is_empty(&self) -> bool {
        self.certificates.is_empty() && self.bundles.is_empty()
    }
}

/// The pod certificates and trust bundles `spec` projects, keyed in the order [`rewrite`]
/// keys them.
pub fn sources(spec: &PodSpec) -> Sources {
    let mut out = Sources::default();
    let projections = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.projected.as_ref())
        .flat_map(|p| p.sources.iter().flatten());
    for s in projections {
        if let Some(c) = &s.pod_certificate {
            out.certificates.push(Certificate {
                key: format!("certificate-{}", out.certificates.len()),
                signer: c.signer_name.clone(),
                key_type: c.key_type.clone(),
                max_expiration_seconds: c.max_expiration_seconds,
                user_annotations: c.user_annotations.clone(),
            });
        }
        if let Some(b) = &s.cluster_trust_bundle {
            out.bundles.push(Bundle {
                key: format!("trust-bundle-{}", out.bundles.len()),
                name: b.name.clone(),
                signer: b.signer_name.clone(),
                selector: b.label_selector.clone(),
                optional: b.optional.unwrap_or(false),
            });
        }
    }
    out
}

/// Why the pod of `spec` in `namespace` is not run below, when it projects what the node
/// does not carry there: a pod certificate outside the mode of upper credentials below
/// (`tokens`, and its namespaces), or of a key type the node makes no keys of.
pub fn not_carried(spec: &PodSpec, namespace: &str, tokens: Option<&Settings>) -> Option<String> {
    spec.volumes.iter().flatten().find_map(|v| {
        let sources = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
        let certificate = sources.into_iter().find_map(|s| s.pod_certificate.as_ref())?;
        let why = match tokens {
            None => "pod certificates are upper credentials, carried below only with \
                     --upper-service-account-tokens"
                .to_owned(),
            Some(t) if !t.applies(namespace) => format!(
                "pod certificates are upper credentials, carried below only in the namespaces \
                 that get upper tokens ({}), where no one else below may read them",
                t.describe()
            ),
            Some(_) if !KEY_TYPES.contains(&certificate.key_type.as_str()) => format!(
                "the virtual node makes keys of type {} only, not {:?}",
                KEY_TYPES.join(", "),
                certificate.key_type
            ),
            Some(_) => return None,
        };
        Some(format!(
            "volume {:?} projects a pod certificate of signer {:?}: {why}; a lower kubelet \
             would ask the lower cluster's signers, of another trust domain",
            v.name, certificate.signer_name
        ))
    })
}

fn item(key: String, path: &str) -> KeyToPath {
    KeyToPath {
        key,
        path: path.to_owned(),
        ..Default::default()
    }
}

/// Rewrites the lower pod spec `spec` so that each pod certificate and trust bundle source
/// reads the Secret `secret` instead: a certificate its `-bundle`, `-key` and `-chain` at the
/// paths the source names, a trust bundle its `trust-bundle-N` at its path. Other sources
/// stay. Returns whether a source was rewritten.
pub fn rewrite(spec: &mut PodSpec, secret: &str) -> bool {
    let (mut certificates, mut bundles) = (0, 0);
    let projections = spec
        .volumes
        .iter_mut()
        .flatten()
        .filter_map(|v| v.projected.as_mut())
        .flat_map(|p| p.sources.iter_mut().flatten());
    for source in projections {
        let items = if let Some(c) = source.pod_certificate.take() {
            let key = format!("certificate-{certificates}");
            certificates += 1;
            [
                (c.credential_bundle_path, "bundle"),
                (c.key_path, "key"),
                (c.certificate_chain_path, "chain"),
            ]
            .into_iter()
            .filter_map(|(path, what)| Some(item(format!("{key}-{what}"), &path.filter(|p| !p.is_empty())?)))
            .collect()
        } else if let Some(b) = source.cluster_trust_bundle.take() {
            let key = format!("trust-bundle-{bundles}");
            bundles += 1;
            vec![item(key, &b.path)]
        } else {
            continue;
        };
        *source = VolumeProjection {
            secret: Some(SecretProjection {
                name: secret.to_owned(),
                items: Some(items),
                optional: None,
            }),
            ..Default::default()
        };
    }
    certificates + bundles > 0
}

/// A fresh key of `key_type` (a projection's name of it) as PKCS#8 PEM, and the stub PKCS#10
/// request (DER) that proves it: empty, as a kubelet's, signed by the key.
pub fn key_and_request(key_type: &str) -> Result<(String, Vec<u8>), String> {
    let algorithm = match key_type {
        "ECDSAP256" => &rcgen::PKCS_ECDSA_P256_SHA256,
        "ECDSAP384" => &rcgen::PKCS_ECDSA_P384_SHA384,
        "ED25519" => &rcgen::PKCS_ED25519,
        other => {
            return Err(format!(
                "the virtual node makes keys of type {} only, not {other:?}",
                KEY_TYPES.join(", ")
            ));
        }
    };
    let key = rcgen::KeyPair::generate_for(algorithm).map_err(|e| format!("making a {key_type} key: {e}"))?;
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    let request = params
        .serialize_request(&key)
        .map_err(|e| format!("signing the stub certificate request: {e}"))?;
    Ok((key.serialize_pem(), request.der().to_vec()))
}

/// The DER contents of the PEM blocks of `pem`, in order.
fn blocks(pem: &str) -> Vec<Vec<u8>> {
    ::pem::parse_many(pem.as_bytes())
        .map(|all| all.into_iter().map(|b| b.into_contents()).collect())
        .unwrap_or_default()
}

/// `ders` as PEM CERTIFICATE blocks.
fn certificates_pem<'a>(ders: impl IntoIterator<Item = &'a Vec<u8>>) -> String {
    ders.into_iter()
        .map(|der| {
            ::pem::encode_config(
                &::pem::Pem::new("CERTIFICATE", der.clone()),
                ::pem::EncodeConfig::new().set_line_ending(::pem::LineEnding::LF),
            )
        })
        .collect()
}

/// The chain of an issued request, cleaned as a kubelet cleans it (every block a
/// CERTIFICATE, nothing between them); `None` while it is not issued.
pub fn issued_chain(request: &PodCertificateRequest) -> Option<String> {
    let chain = request.status.as_ref()?.certificate_chain.as_deref()?;
    let ders = blocks(chain);
    (!ders.is_empty()).then(|| certificates_pem(&ders))
}

/// How a request ended when it was not issued: the condition type (`Denied` or `Failed`),
/// its reason and message.
pub fn refusal(request: &PodCertificateRequest) -> Option<(String, String, String)> {
    let conditions = request.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True")
        .map(|c| (c.type_.clone(), c.reason.clone(), c.message.clone()))
}

/// The trust anchors `source` asks of `bundles` (the upper cluster's), as a kubelet writes
/// them: the bundle named, or every bundle of the signer whose labels the selector matches
/// (no selector: none; an empty one: all), each anchor once, in a stable order. A source
/// that matches nothing gets an empty file when optional, else why it cannot be written.
pub fn trust_anchors(source: &Bundle, bundles: &[ClusterTrustBundle]) -> Result<String, String> {
    let chosen: Vec<&ClusterTrustBundle> = match (&source.name, &source.signer) {
        (Some(name), _) => bundles.iter().filter(|b| b.name_any() == *name).collect(),
        (None, Some(signer)) => bundles
            .iter()
            .filter(|b| b.spec.signer_name.as_deref() == Some(signer.as_str()))
            .filter(|b| {
                source
                    .selector
                    .as_ref()
                    .is_some_and(|s| tensile_common::label_selector::matches(s, b.labels()))
            })
            .collect(),
        (None, None) => return Err("the source names neither a bundle nor a signer".into()),
    };
    if chosen.is_empty() {
        return match source.optional {
            true => Ok(String::new()),
            false => Err(match &source.name {
                Some(name) => format!("no ClusterTrustBundle {name:?}"),
                None => format!(
                    "no ClusterTrustBundle of signer {:?} matches the selector",
                    source.signer.as_deref().unwrap_or_default()
                ),
            }),
        };
    }
    let anchors: BTreeSet<Vec<u8>> = chosen.iter().flat_map(|b| blocks(&b.spec.trust_bundle)).collect();
    Ok(certificates_pem(&anchors))
}

/// When the certificate `certificate` kept in `held` begins its refresh, as the Secret says.
pub fn refresh_at(held: &Secret, certificate: &Certificate) -> Option<jiff::Timestamp> {
    held.annotations()
        .get(&certificate.refresh_annotation())?
        .parse()
        .ok()
}

/// Whether `certificate` must be asked for (again): `held` lacks it, or its refresh began.
pub fn refresh_due(held: Option<&Secret>, certificate: &Certificate, now: jiff::Timestamp) -> bool {
    let Some(held) = held else {
        return true;
    };
    let kept = held
        .data
        .as_ref()
        .is_some_and(|d| d.contains_key(&certificate.bundle_key()));
    !kept || refresh_at(held, certificate).is_none_or(|at| at <= now)
}

/// The lower Secret of `upper`'s certificates and trust bundles, owned by its lower pod
/// `lower`: `data` (key → content) and `refresh` (annotation → time).
pub fn secret(
    upper: &Pod,
    lower: &Pod,
    identity: &Identity,
    data: BTreeMap<String, String>,
    refresh: BTreeMap<String, String>,
) -> Secret {
    let uid = upper.metadata.uid.clone().unwrap_or_default();
    let data = data
        .into_iter()
        .map(|(k, v)| (k, ByteString(v.into_bytes())))
        .collect();
    crate::decide::credentials::secret(upper, lower, identity, secret_name(&uid), refresh, data)
}

/// The contents of `held` (key → text) and its refresh annotations.
pub fn held(held: &Secret) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let data = held
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(&v.0).into_owned()))
        .collect();
    let refresh = held
        .annotations()
        .iter()
        .filter(|(k, _)| k.starts_with(REFRESH_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (data, refresh)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> PodSpec {
        serde_json::from_value(json!({
            "containers": [{"name": "app", "image": "app"}],
            "volumes": [
                {"name": "plain", "configMap": {"name": "settings"}},
                {"name": "identity", "projected": {"sources": [
                    {"podCertificate": {"signerName": "example.com/pods", "keyType": "ECDSAP256",
                        "credentialBundlePath": "bundle.pem", "keyPath": "key.pem",
                        "maxExpirationSeconds": 3600, "userAnnotations": {"example.com/a": "b"}}},
                    {"configMap": {"name": "other", "items": [{"key": "k", "path": "k"}]}},
                    {"clusterTrustBundle": {"name": "roots", "path": "roots.pem"}},
                ]}},
                {"name": "more", "projected": {"sources": [
                    {"clusterTrustBundle": {"signerName": "example.com/pods", "labelSelector": {}, "path": "pods.pem", "optional": true}},
                    {"podCertificate": {"signerName": "example.com/pods", "keyType": "ED25519", "certificateChainPath": "chain.pem"}},
                ]}},
            ],
        }))
        .unwrap()
    }

    #[test]
    fn every_certificate_and_bundle_source_is_keyed_in_volume_order_and_read_from_the_secret() {
        let mut spec = spec();
        let found = sources(&spec);
        let keys: Vec<&str> = found.certificates.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["certificate-0", "certificate-1"]);
        assert_eq!(found.certificates[0].key_type, "ECDSAP256");
        assert_eq!(found.certificates[0].max_expiration_seconds, Some(3600));
        assert_eq!(found.bundles[0].name.as_deref(), Some("roots"));
        assert!(found.bundles[1].optional && found.bundles[1].selector.is_some());

        assert!(rewrite(&mut spec, "tensile-upper-certificates-u1"));
        let volumes = serde_json::to_value(&spec.volumes).unwrap();
        assert_eq!(
            volumes[0],
            json!({"name": "plain", "configMap": {"name": "settings"}})
        );
        let identity = &volumes[1]["projected"]["sources"];
        assert_eq!(
            identity[0],
            json!({"secret": {"name": "tensile-upper-certificates-u1", "items": [
                {"key": "certificate-0-bundle", "path": "bundle.pem"},
                {"key": "certificate-0-key", "path": "key.pem"},
            ]}})
        );
        assert_eq!(identity[1]["configMap"]["name"], "other");
        assert_eq!(
            identity[2],
            json!({"secret": {"name": "tensile-upper-certificates-u1", "items": [{"key": "trust-bundle-0", "path": "roots.pem"}]}})
        );
        let more = &volumes[2]["projected"]["sources"];
        assert_eq!(
            more[0]["secret"]["items"],
            json!([{"key": "trust-bundle-1", "path": "pods.pem"}])
        );
        assert_eq!(
            more[1]["secret"]["items"],
            json!([{"key": "certificate-1-chain", "path": "chain.pem"}])
        );
        assert!(sources(&spec).is_empty(), "nothing below asks the lower cluster");
        let mut plain: PodSpec = serde_json::from_value(json!({"containers": []})).unwrap();
        assert!(!rewrite(&mut plain, "x"));
    }

    #[test]
    fn a_pod_certificate_goes_only_where_upper_credentials_may_and_of_a_key_type_the_node_makes() {
        let settings = Settings::new(
            "https://upper.example:6443",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
            vec![],
            vec!["default".into()],
            0.8,
        )
        .unwrap();
        let said = not_carried(&spec(), "team", None).unwrap();
        assert!(
            said.contains("--upper-service-account-tokens") && said.contains("\"identity\""),
            "{said}"
        );
        let said = not_carried(&spec(), "default", Some(&settings)).unwrap();
        assert!(
            said.contains("every namespace but those shared below (default)"),
            "{said}"
        );
        assert_eq!(not_carried(&spec(), "team", Some(&settings)), None);
        let mut rsa = spec();
        rsa.volumes.as_mut().unwrap()[1]
            .projected
            .as_mut()
            .unwrap()
            .sources
            .as_mut()
            .unwrap()[0]
            .pod_certificate
            .as_mut()
            .unwrap()
            .key_type = "RSA3072".into();
        let said = not_carried(&rsa, "team", Some(&settings)).unwrap();
        assert!(said.contains("\"RSA3072\""), "{said}");
        let bundles_only: PodSpec = serde_json::from_value(json!({"containers": [], "volumes": [
            {"name": "roots", "projected": {"sources": [{"clusterTrustBundle": {"name": "roots", "path": "r"}}]}}]}))
        .unwrap();
        assert_eq!(
            not_carried(&bundles_only, "default", None),
            None,
            "trust anchors are public"
        );
    }

    #[test]
    fn a_key_is_made_of_each_type_with_a_stub_request_it_signs() {
        for key_type in KEY_TYPES {
            let (key, request) = key_and_request(key_type).unwrap();
            assert!(
                key.starts_with("-----BEGIN PRIVATE KEY-----"),
                "{key_type}: PKCS#8"
            );
            use x509_parser::prelude::FromDer;
            let (_, parsed) =
                x509_parser::certification_request::X509CertificationRequest::from_der(&request)
                    .unwrap_or_else(|e| panic!("{key_type}: {e}"));
            parsed.verify_signature().unwrap();
            assert!(
                parsed.certification_request_info.subject.iter().next().is_none(),
                "an empty subject"
            );
            let pair = rcgen::KeyPair::from_pem(&key).unwrap();
            assert_eq!(
                pair.public_key_raw(),
                &parsed
                    .certification_request_info
                    .subject_pki
                    .subject_public_key
                    .data[..],
                "{key_type}: the request proves the key kept"
            );
        }
        assert!(key_and_request("RSA4096").unwrap_err().contains("\"RSA4096\""));
    }

    fn certificate(cn: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::new(vec![cn.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem()
    }

    fn bundle(name: &str, signer: Option<&str>, labels: &[(&str, &str)], pem: &str) -> ClusterTrustBundle {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect::<serde_json::Map<_, _>>()},
            "spec": {"signerName": signer, "trustBundle": pem},
        }))
        .unwrap()
    }

    #[test]
    fn trust_anchors_are_each_once_in_a_stable_order_and_a_missing_bundle_is_empty_only_when_optional() {
        let (a, b, c) = (certificate("a"), certificate("b"), certificate("c"));
        let bundles = [
            bundle("roots", None, &[], &format!("{a}\n{b}")),
            bundle(
                "example.com:pods:1",
                Some("example.com/pods"),
                &[("tier", "x")],
                &format!("{b}{c}"),
            ),
            bundle(
                "example.com:pods:2",
                Some("example.com/pods"),
                &[("tier", "y")],
                &a,
            ),
        ];
        let by_name = Bundle {
            key: "trust-bundle-0".into(),
            name: Some("roots".into()),
            signer: None,
            selector: None,
            optional: false,
        };
        let named = trust_anchors(&by_name, &bundles).unwrap();
        assert_eq!(blocks(&named).len(), 2);
        let by_signer = |selector: Option<serde_json::Value>, optional: bool| Bundle {
            key: "trust-bundle-1".into(),
            name: None,
            signer: Some("example.com/pods".into()),
            selector: selector.map(|s| serde_json::from_value(s).unwrap()),
            optional,
        };
        let all = trust_anchors(&by_signer(Some(json!({})), false), &bundles).unwrap();
        assert_eq!(blocks(&all).len(), 3, "b is in two bundles and kept once");
        let reversed: Vec<_> = bundles.iter().rev().cloned().collect();
        assert_eq!(
            trust_anchors(&by_signer(Some(json!({})), false), &reversed).unwrap(),
            all
        );
        let tier_x = trust_anchors(
            &by_signer(Some(json!({"matchLabels": {"tier": "x"}})), false),
            &bundles,
        )
        .unwrap();
        assert_eq!(blocks(&tier_x).len(), 2);
        let none = by_signer(None, false);
        assert!(
            trust_anchors(&none, &bundles)
                .unwrap_err()
                .contains("example.com/pods")
        );
        assert_eq!(trust_anchors(&by_signer(None, true), &bundles).unwrap(), "");
        let missing = Bundle {
            name: Some("gone".into()),
            ..by_name
        };
        assert!(
            trust_anchors(&missing, &bundles)
                .unwrap_err()
                .contains("\"gone\"")
        );
    }

    #[test]
    fn a_certificate_is_asked_for_when_missing_or_once_its_refresh_began() {
        let c = &sources(&spec()).certificates[0];
        let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        assert!(refresh_due(None, c, now));
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "n", "uid": "u1"}}))
                .unwrap();
        let identity = Identity {
            cluster_id: "c1".into(),
            node: "vn".into(),
        };
        let kept = |refresh: &str| {
            secret(
                &pod,
                &pod,
                &identity,
                BTreeMap::from([(c.bundle_key(), "pem".to_owned())]),
                BTreeMap::from([(c.refresh_annotation(), refresh.to_owned())]),
            )
        };
        assert!(!refresh_due(Some(&kept("2026-01-01T00:10:00Z")), c, now));
        assert!(refresh_due(Some(&kept("2025-12-31T23:59:00Z")), c, now));
        assert!(refresh_due(Some(&kept("unreadable")), c, now));
        let written = kept("2026-01-01T00:10:00Z");
        assert_eq!(
            written.metadata.name.as_deref(),
            Some("tensile-upper-certificates-u1")
        );
        assert_eq!(
            written
                .labels()
                .get(tensile_common::lower::identity::TOKEN_LABEL)
                .map(String::as_str),
            Some("c1")
        );
        let (data, refresh) = held(&written);
        assert_eq!(data[&c.bundle_key()], "pem");
        assert_eq!(refresh.len(), 1);
    }

    #[test]
    fn an_issued_chain_is_cleaned_and_a_denial_is_read() {
        let a = certificate("a");
        let request: PodCertificateRequest = serde_json::from_value(json!({
            "metadata": {"name": "req-1"},
            "spec": {"signerName": "s", "podName": "p", "podUID": "u", "serviceAccountName": "d",
                "serviceAccountUID": "su", "nodeName": "vn", "nodeUID": "nu", "stubPKCS10Request": ""},
            "status": {"certificateChain": format!("junk before\n{a}")},
        }))
        .unwrap();
        assert_eq!(issued_chain(&request).unwrap(), a);
        let denied: PodCertificateRequest = serde_json::from_value(json!({
            "metadata": {"name": "req-2"},
            "spec": {"signerName": "s", "podName": "p", "podUID": "u", "serviceAccountName": "d",
                "serviceAccountUID": "su", "nodeName": "vn", "nodeUID": "nu", "stubPKCS10Request": ""},
            "status": {"conditions": [{"type": "Denied", "status": "True", "reason": "UnsupportedKeyType",
                "message": "use ECDSAP256", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        }))
        .unwrap();
        assert_eq!(issued_chain(&denied), None);
        assert_eq!(
            refusal(&denied),
            Some((
                "Denied".into(),
                "UnsupportedKeyType".into(),
                "use ECDSAP256".into()
            ))
        );
    }
}
