//! A node identity upstream: the kubelet client certificate of `system:node:<name>` (group
//! `system:nodes`), obtained the way a kubelet bootstraps one, through a
//! CertificateSigningRequest to the `kubernetes.io/kube-apiserver-client-kubelet` signer, and
//! renewed at 80 % of its lifetime. Acting as that user, a virtual node is confined by the
//! upper apiserver's Node authorizer and NodeRestriction admission like a kubelet: its own
//! Node and Lease, the pods bound to it, and the Secrets, ConfigMaps and claims they name.
//!
//! The request is made with the process's own credential (its ServiceAccount); what approves
//! it is [`judge`]: the request must ask for exactly a node client certificate, for the node
//! the requesting account is made for, and [`bounded_lifetime`]: for [`LIFETIME_SECONDS`] at
//! most (the cluster controller approves with both). A certificate cannot be revoked, so that
//! lifetime is how long one outlives its node's leaving.

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PublicKeyData as _};
use x509_parser::prelude::FromDer as _;

/// The signer of kubelet client certificates.
pub const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The usages a kubelet client certificate asks for.
pub const USAGES: [&str; 3] = ["digital signature", "key encipherment", "client auth"];
/// The user name of node `node`.
pub fn user(node: &str) -> String {
    format!("system:node:{node}")
}
/// The group of every node.
pub const GROUP: &str = "system:nodes";
/// Label on a request: the node it is for.
pub const NODE_LABEL: &str = "tensile.io/node";

/// The lifetime a node asks its certificate for, and the longest the approver grants: a day,
/// so that one that leaked stops working within a day of the node's leaving.
pub const LIFETIME_SECONDS: i32 = 24 * 3600;

/// The name of node `node`'s request: one name, so its account's rights can name it (read it
/// and delete it once answered) and a node never has more than one.
pub fn request_name(node: &str) -> String {
    format!("tensile-node-{node}")
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("making the certificate request of node {node}: {source}")]
    Key { node: String, source: rcgen::Error },
    #[error("CertificateSigningRequest for node {node}: {source}")]
    Api { node: String, source: kube::Error },
    #[error("CertificateSigningRequest {name} for node {node} was {verdict}: {message}")]
    Refused {
        name: String,
        node: String,
        verdict: String,
        message: String,
    },
    #[error(
        "CertificateSigningRequest {name} for node {node} was not issued within {0:?}: is the cluster controller running, and does the cluster sign {SIGNER}?",
        timeout
    )]
    NotIssued {
        name: String,
        node: String,
        timeout: Duration,
    },
    #[error("the certificate issued for node {node} cannot be read: {message}")]
    Unreadable { node: String, message: String },
    #[error(
        "the certificate issued for node {node} was valid until {not_after} (seconds since the epoch) and is no longer: the signer's lifetime is shorter than its backdating (kube-controller-manager --cluster-signing-duration)"
    )]
    Expired { node: String, not_after: i64 },
}

/// A client certificate and its key, both PEM, and its validity.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    /// Seconds since the epoch.
    pub not_before: i64,
    pub not_after: i64,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued")
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Issued {
    /// When to ask for the next one: at 80 % of the lifetime, as a kubelet does.
    pub fn renew_at(&self) -> i64 {
        self.not_before + (self.not_after - self.not_before) * 4 / 5
    }

    /// How long to wait from `now` before asking for the next one: until [`Self::renew_at`],
    /// and 10 s at least, so a certificate already due is not asked for in a loop.
    pub fn renew_in(&self, now: i64) -> Duration {
        Duration::from_secs(u64::try_from(self.renew_at() - now).unwrap_or(0).max(10))
    }

    fn read(node: &str, cert_pem: String, key: &KeyPair) -> Result<Self, Error> {
        let unreadable = |message: String| Error::Unreadable {
            node: node.to_owned(),
            message,
        };
        let (_, pem) =
            x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()).map_err(|e| unreadable(e.to_string()))?;
        let cert = pem.parse_x509().map_err(|e| unreadable(e.to_string()))?;
        let validity = cert.validity();
        let subject = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or_default()
            .to_owned();
        if subject != user(node) {
            return Err(unreadable(format!("it names {subject:?}, not {}", user(node))));
        }
        if cert.public_key().subject_public_key.data.as_ref() != key.der_bytes() {
            return Err(unreadable("it is not for the key that was asked with".into()));
        }
        let not_after = validity.not_after.timestamp();
        if not_after <= now_seconds() {
            return Err(Error::Expired {
                node: node.to_owned(),
                not_after,
            });
        }
        Ok(Issued {
            not_before: validity.not_before.timestamp(),
            not_after,
            cert_pem,
            key_pem: key.serialize_pem(),
        })
    }
}

/// Seconds since the epoch.
pub fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A fresh key and the PEM certificate request of node `node` for it.
pub fn certificate_request(node: &str) -> Result<(String, KeyPair), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, GROUP);
    name.push(DnType::CommonName, user(node));
    params.distinguished_name = name;
    let request = params.serialize_request(&key)?;
    Ok((request.pem()?, key))
}

/// Asks the upper cluster, through `client` (the process's own credential), for a client
/// certificate of node `node` (request [`request_name`]) and waits up to `timeout` for it; the
/// request is deleted once answered.
pub async fn request(client: &kube::Client, node: &str, timeout: Duration) -> Result<Issued, Error> {
    let key_error = |source| Error::Key {
        node: node.to_owned(),
        source,
    };
    let api_error = |source| Error::Api {
        node: node.to_owned(),
        source,
    };
    let (request, key) = certificate_request(node).map_err(key_error)?;
    let name = request_name(node);
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(NODE_LABEL.to_owned(), node.to_owned())].into()),
            ..ObjectMeta::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.into_bytes()),
            signer_name: SIGNER.to_owned(),
            usages: Some(USAGES.iter().map(|u| (*u).to_owned()).collect()),
            // Asked for, or the approver denies the request; the signer may make it shorter
            // (its --cluster-signing-duration), never longer.
            expiration_seconds: Some(LIFETIME_SECONDS),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    };
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + timeout;
    let not_issued = || Error::NotIssued {
        name: name.clone(),
        node: node.to_owned(),
        timeout,
    };
    // The name is the node's, shared by its replicas: a request another replica made is
    // waited for (it deletes it once it read the answer); one answered more than 10 s ago,
    // or older than the timeout (its maker died), is deleted first.
    let uid = loop {
        match api.create(&PostParams::default(), &csr).await {
            Ok(made) => break made.metadata.uid.unwrap_or_default(),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if let Ok(Some(there)) = api.get_opt(&name).await {
                    let created = there
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .map(|t| t.0.as_second());
                    let stale = created.is_none_or(|at| {
                        now_seconds() - at > timeout.as_secs().try_into().unwrap_or(i64::MAX)
                    });
                    // Its maker deletes it once it read the answer: an answer is left to
                    // it for 10 s, and deleted here only after that (its maker died).
                    let answered_at = there
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .into_iter()
                        .flatten()
                        .filter_map(|c| c.last_update_time.as_ref().or(c.last_transition_time.as_ref()))
                        .map(|t| t.0.as_second())
                        .max()
                        .or(created);
                    let left = answered(&there) && answered_at.is_none_or(|at| now_seconds() - at > 10);
                    if left || stale {
                        let only_that = DeleteParams {
                            preconditions: Some(kube::api::Preconditions {
                                uid: there.metadata.uid.clone(),
                                resource_version: None,
                            }),
                            ..DeleteParams::default()
                        };
                        match api.delete(&name, &only_that).await {
                            Ok(_) => {
                                tracing::info!(node, request = %name, "deleted an earlier request");
                                continue;
                            }
                            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => continue,
                            Err(e) => {
                                tracing::warn!(node, request = %name, "deleting an earlier request: {e}")
                            }
                        }
                    }
                }
            }
            // An apiserver that does not answer yet, or a refusal: tried again until the
            // deadline, which then says what went wrong.
            Err(e) => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(api_error(e));
                }
                tracing::warn!(node, request = %name, "asking for the node's certificate: {e}");
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(not_issued());
        }
        tokio::time::sleep(Duration::from_millis(500 + u64::from(now_nanos() % 500))).await;
    };
    tracing::info!(node, request = %name, "asked for a node client certificate");
    let answer = loop {
        match api.get_opt(&name).await {
            Ok(Some(csr)) if csr.metadata.uid.as_deref() == Some(uid.as_str()) => {
                if let Some(answer) = answer_of(csr, &name, node, &key) {
                    break answer;
                }
            }
            // Gone, or another's: ours was deleted unanswered.
            Ok(_) => {
                break Err(Error::Refused {
                    name: name.clone(),
                    node: node.to_owned(),
                    verdict: "deleted".into(),
                    message: "the request was deleted before it was answered".into(),
                });
            }
            Err(e) => tracing::debug!(node, request = %name, "reading the request: {e}"),
        }
        if tokio::time::Instant::now() >= deadline {
            break Err(not_issued());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let ours = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    if let Err(e) = api.delete(&name, &ours).await {
        tracing::debug!(node, request = %name, "deleting the answered request: {e}");
    }
    answer
}

/// A varying number, to spread retries of replicas that start together.
fn now_nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

/// Whether `csr` was approved, denied, failed or issued.
pub fn answered(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .is_some_and(|s| s.certificate.is_some() || s.conditions.as_ref().is_some_and(|c| !c.is_empty()))
}

/// The outcome `csr` shows, once it shows one: refused, or the certificate, which must be of
/// `key`.
fn answer_of(
    csr: CertificateSigningRequest,
    name: &str,
    node: &str,
    key: &KeyPair,
) -> Option<Result<Issued, Error>> {
    let status = csr.status.unwrap_or_default();
    if let Some(refusal) = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Denied" || c.type_ == "Failed")
    {
        return Some(Err(Error::Refused {
            name: name.to_owned(),
            node: node.to_owned(),
            verdict: refusal.type_.to_lowercase(),
            message: refusal.message.unwrap_or_default(),
        }));
    }
    let cert = status.certificate.filter(|c| !c.0.is_empty())?;
    let cert_pem = String::from_utf8_lossy(&cert.0).into_owned();
    Some(Issued::read(node, cert_pem, key))
}

/// Why a request is not approved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// The node a pending request asks a client certificate for, when it asks for exactly a
/// node client certificate: the kubelet signer, the usages of [`USAGES`] (key encipherment
/// optional), subject `system:node:<name>` in organisation `system:nodes` only, and no
/// alternative name. Who asked is for the caller to check.
pub fn judge(csr: &CertificateSigningRequest) -> Result<String, Refusal> {
    let spec = &csr.spec;
    if spec.signer_name != SIGNER {
        return Err(Refusal(format!("signer {} is not {SIGNER}", spec.signer_name)));
    }
    let usages = spec.usages.clone().unwrap_or_default();
    if usages.iter().any(|u| !USAGES.contains(&u.as_str()))
        || !usages.iter().any(|u| u == "client auth")
        || !usages.iter().any(|u| u == "digital signature")
    {
        return Err(Refusal(format!(
            "usages {usages:?} are not those of a node client certificate"
        )));
    }
    let pem = x509_parser::pem::parse_x509_pem(&spec.request.0)
        .map_err(|e| Refusal(format!("the request is not PEM: {e}")))?
        .1;
    let (_, request) = x509_parser::certification_request::X509CertificationRequest::from_der(&pem.contents)
        .map_err(|e| Refusal(format!("the request cannot be parsed: {e}")))?;
    let info = &request.certification_request_info;
    // Every attribute of the subject, each decoded: one that cannot be read here may still be
    // read by the apiserver and the signer (a second common name as a T61String, say), so it
    // is refused, never skipped.
    let mut names: Vec<&str> = Vec::new();
    let mut organisations: Vec<&str> = Vec::new();
    for attribute in info.subject.iter_attributes() {
        let oid = attribute.attr_type();
        let value = attribute.as_str().map_err(|_| {
            Refusal(format!(
                "subject attribute {oid} is not a string this approver reads"
            ))
        })?;
        if *oid == x509_parser::oid_registry::OID_X509_COMMON_NAME {
            names.push(value);
        } else if *oid == x509_parser::oid_registry::OID_X509_ORGANIZATION_NAME {
            organisations.push(value);
        } else {
            return Err(Refusal(format!(
                "subject attribute {oid} has no place in a node certificate"
            )));
        }
    }
    if organisations != [GROUP] {
        return Err(Refusal(format!(
            "organisations {organisations:?} are not [{GROUP:?}]"
        )));
    }
    let node = match names.as_slice() {
        [one] => one
            .strip_prefix("system:node:")
            .filter(|n| !n.is_empty())
            .ok_or_else(|| Refusal(format!("common name {one:?} is not system:node:<name>")))?,
        _ => {
            return Err(Refusal(format!(
                "common names {names:?} are not one system:node:<name>"
            )));
        }
    };
    if let Some(extensions) = request.requested_extensions()
        && extensions.into_iter().any(|e| {
            matches!(
                e,
                x509_parser::extensions::ParsedExtension::SubjectAlternativeName(_)
            )
        })
    {
        return Err(Refusal(
            "a node client certificate names no alternative name".into(),
        ));
    }
    Ok(node.to_owned())
}

/// Whether `csr` asks for a lifetime of [`LIFETIME_SECONDS`] at most: without
/// `spec.expirationSeconds` the signer issues for its own maximum (a year by default), and a
/// certificate cannot be revoked.
pub fn bounded_lifetime(csr: &CertificateSigningRequest) -> Result<(), Refusal> {
    match csr.spec.expiration_seconds {
        None => Err(Refusal(format!(
            "spec.expirationSeconds is not set, so the signer would issue for its own maximum: a node's \
             certificate is issued for {LIFETIME_SECONDS} s at most"
        ))),
        Some(asked) if asked > LIFETIME_SECONDS => Err(Refusal(format!(
            "spec.expirationSeconds {asked} is longer than the {LIFETIME_SECONDS} s a node's certificate is \
             issued for"
        ))),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(request: String, signer: &str, usages: &[&str]) -> CertificateSigningRequest {
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                request: ByteString(request.into_bytes()),
                signer_name: signer.to_owned(),
                usages: Some(usages.iter().map(|u| (*u).to_owned()).collect()),
                ..CertificateSigningRequestSpec::default()
            },
            ..CertificateSigningRequest::default()
        }
    }

    fn request_of(params: CertificateParams) -> String {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
        params
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_node_client_request_names_its_node() {
        let (request, _) = certificate_request("vn-a").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(judge(&csr(request.clone(), SIGNER, &USAGES)), Ok("vn-a".into()));
        assert_eq!(
            judge(&csr(request, SIGNER, &["digital signature", "client auth"])),
            Ok("vn-a".into()),
            "key encipherment is optional"
        );
    }

    #[test]
    fn anything_but_a_node_client_certificate_is_refused_with_the_reason() {
        let (request, _) = certificate_request("vn-a").unwrap_or_else(|e| panic!("{e}"));
        let refused = |c: &CertificateSigningRequest| judge(c).err().map(|r| r.0).unwrap_or_default();
        assert!(
            refused(&csr(
                request.clone(),
                "kubernetes.io/kube-apiserver-client",
                &USAGES
            ))
            .contains("signer")
        );
        assert!(
            refused(&csr(
                request.clone(),
                SIGNER,
                &["digital signature", "client auth", "server auth"]
            ))
            .contains("usages")
        );
        assert!(refused(&csr(request, SIGNER, &["digital signature"])).contains("usages"));

        let mut admin = CertificateParams::default();
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin
            .distinguished_name
            .push(DnType::CommonName, "system:node:vn-a");
        assert!(refused(&csr(request_of(admin), SIGNER, &USAGES)).contains("organisations"));

        let mut user = CertificateParams::default();
        user.distinguished_name.push(DnType::OrganizationName, GROUP);
        user.distinguished_name.push(DnType::CommonName, "alice");
        assert!(refused(&csr(request_of(user), SIGNER, &USAGES)).contains("common name"));

        let mut named =
            CertificateParams::new(vec!["kubernetes.default".to_owned()]).unwrap_or_else(|e| panic!("{e}"));
        named.distinguished_name.push(DnType::OrganizationName, GROUP);
        named
            .distinguished_name
            .push(DnType::CommonName, "system:node:vn-a");
        assert!(refused(&csr(request_of(named), SIGNER, &USAGES)).contains("alternative name"));

        assert!(refused(&csr("not a request".into(), SIGNER, &USAGES)).contains("PEM"));

        // A common name in a string type this approver does not read is refused, never
        // skipped: the apiserver reads it, and would issue for the name it hides.
        let mut hidden = CertificateParams::default();
        hidden.distinguished_name.push(DnType::OrganizationName, GROUP);
        hidden.distinguished_name.push(
            DnType::CommonName,
            rcgen::DnValue::TeletexString(
                rcgen::string::TeletexString::try_from("system:node:victim")
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
        );
        assert!(refused(&csr(request_of(hidden), SIGNER, &USAGES)).contains("not a string"));

        let mut extra = CertificateParams::default();
        extra.distinguished_name.push(DnType::OrganizationName, GROUP);
        extra
            .distinguished_name
            .push(DnType::CommonName, "system:node:vn-a");
        extra.distinguished_name.push(DnType::CountryName, "DE");
        assert!(refused(&csr(request_of(extra), SIGNER, &USAGES)).contains("no place"));
    }

    #[test]
    fn renewal_comes_at_four_fifths_of_the_lifetime() {
        let issued = Issued {
            cert_pem: String::new(),
            key_pem: String::new(),
            not_before: 1_000,
            not_after: 1_000 + 3_600,
        };
        assert_eq!(issued.renew_at(), 1_000 + 2_880);
        assert_eq!(issued.renew_in(1_000), Duration::from_secs(2_880));
        assert_eq!(
            issued.renew_in(1_000 + 2_875),
            Duration::from_secs(10),
            "never sooner than 10 s"
        );
        assert_eq!(issued.renew_in(1_000 + 9_999), Duration::from_secs(10));
    }
}
