//! The kubelet API of the virtual node, over TLS on `--kubelet-port`: the upper apiserver
//! proxies `kubectl logs` here, and we forward to the lower cluster's `pods/log`;
//! `kubectl exec`, `attach` and `port-forward` are spliced to the lower apiserver
//! ([`crate::serve::streams`]).
//!
//! Callers must present a client certificate signed by `--client-verify-ca` (the upper
//! apiserver's kubelet-client CA); a caller without one gets 401. Serving without
//! authentication takes an explicit `--no-verify-clients` (callers are then
//! `system:anonymous`).
//!
//! Authorisation is the kubelet's: the caller (certificate CN as user, O as groups) must be
//! allowed the node's subresource (`nodes/proxy` for `containerLogs`, `exec`, `attach` and
//! `portForward`, `nodes/stats` for `/stats`, `nodes/metrics` for `/metrics`, `nodes/pods`,
//! `nodes/healthz` or `nodes/configz` and then `nodes/proxy` for `/pods`, `/healthz` and
//! `/configz`, as a 1.36+ kubelet; the verb from the method) by a SubjectAccessReview on the
//! upper cluster, cached like the kubelet caches it
//! (allowed 5 min, denied 30 s). A certificate from the same CA is therefore not enough: on
//! kubeadm every kubelet has one, and none may read another node's logs.
//! `--kubelet-authorization=always-allow` skips the review.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensile_common::cache::Cache;
use tensile_common::serve::Peer;

use crate::serve::streams;

use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

/// How callers are authenticated.
#[derive(Clone, Debug)]
pub enum ClientAuth {
    /// Client certificates signed by this CA (PEM file).
    Ca(PathBuf),
    /// Anyone: explicitly asked for with `--no-verify-clients`.
    None,
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum ServingCert {
    Files {
        cert: PathBuf,
        key: PathBuf,
    },
    /// Generated at start for these names/addresses.
    SelfSigned(Vec<String>),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubelet API: reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubelet API: {path}: {detail}")]
    Pem { path: PathBuf, detail: String },
    #[error("kubelet API: TLS: {0}")]
    Tls(String),
    #[error("kubelet API: binding {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

fn read(path: &PathBuf) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read {
        path: path.clone(),
        source,
    })
}

fn certs(pem: &[u8], path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(c),
        Ok(_) => Err(Error::Pem {
            path: path.to_owned(),
            detail: "no CERTIFICATE block".into(),
        }),
        Err(e) => Err(Error::Pem {
            path: path.to_owned(),
            detail: e.to_string(),
        }),
    }
}

/// Builds the TLS configuration; every file problem is reported with its path.
pub fn tls_config(cert: &ServingCert, auth: &ClientAuth) -> Result<Arc<rustls::ServerConfig>, Error> {
    let (chain, key) = match cert {
        ServingCert::Files { cert, key } => {
            let chain = certs(&read(cert)?, cert)?;
            let key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| Error::Pem {
                path: key.clone(),
                detail: e.to_string(),
            })?;
            (chain, key)
        }
        ServingCert::SelfSigned(names) => {
            let generated =
                rcgen::generate_simple_self_signed(names.clone()).map_err(|e| Error::Tls(e.to_string()))?;
            let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der())
                .map_err(|e| Error::Tls(e.to_string()))?;
            (vec![generated.cert.der().clone()], key)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?;
    let builder = match auth {
        ClientAuth::Ca(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs(&read(path)?, path)? {
                roots.add(c).map_err(|e| Error::Pem {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            }
            // Unauthenticated handshakes are allowed so the caller gets an HTTP 401 that
            // says why, instead of a bare TLS alert.
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| Error::Tls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        ClientAuth::None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| Error::Tls(e.to_string()))?;
    // HTTP/2 where the caller offers it: the apiserver then carries its log and stats calls
    // to this node on one connection; its upgrades (exec, attach, port-forward) ask for
    // HTTP/1.1.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

pub async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// How callers are authorised.
pub enum Authorizer {
    /// A SubjectAccessReview on the upper cluster per caller and attributes, cached.
    Webhook {
        upper: kube::Client,
        decisions: Mutex<HashMap<Attributes, (bool, Instant)>>,
    },
    /// Every authenticated caller may do everything (`--kubelet-authorization=always-allow`).
    AlwaysAllow,
}

/// Who asks for what, as the kubelet puts it to the authoriser.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Attributes {
    pub user: String,
    pub groups: Vec<String>,
    pub verb: &'static str,
    pub subresource: &'static str,
}

/// How long a decision is reused: the kubelet's webhook authoriser cache.
const ALLOWED_TTL: Duration = Duration::from_secs(300);
const DENIED_TTL: Duration = Duration::from_secs(30);

impl Authorizer {
    pub fn webhook(upper: kube::Client) -> Self {
        Authorizer::Webhook {
            upper,
            decisions: Mutex::default(),
        }
    }

    /// Whether `attributes` are allowed on node `node`; `Err` says why none could be had.
    pub async fn allows(&self, node: &str, attributes: &Attributes) -> Result<bool, String> {
        let (upper, decisions) = match self {
            Authorizer::AlwaysAllow => return Ok(true),
            Authorizer::Webhook { upper, decisions } => (upper, decisions),
        };
        let cached = decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(attributes)
            .filter(|(_, until)| *until > Instant::now())
            .map(|(allowed, _)| *allowed);
        if let Some(allowed) = cached {
            return Ok(allowed);
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(attributes.user.clone()),
                groups: Some(attributes.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(attributes.verb.to_owned()),
                    resource: Some("nodes".to_owned()),
                    subresource: Some(attributes.subresource.to_owned()),
                    name: Some(node.to_owned()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(upper.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| format!("SubjectAccessReview: {e}"))?;
        let allowed = answer.status.is_some_and(|s| s.allowed);
        let ttl = if allowed { ALLOWED_TTL } else { DENIED_TTL };
        let mut decisions = decisions.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        decisions.retain(|_, (_, until)| *until > now);
        decisions.insert(attributes.clone(), (allowed, now + ttl));
        Ok(allowed)
    }
}

/// The caller's user (CN) and groups (O) from its verified certificate, as the apiserver's
/// x509 authenticator reads them; `Ok(None)` when it presented none. A subject with more than
/// one common name is refused: Go takes the last, a reader taking another would authorise
/// someone the apiserver never authenticated.
pub fn identity(peer: &Peer) -> Result<Option<(String, Vec<String>)>, &'static str> {
    match peer.certificates.as_ref().and_then(|c| c.first()) {
        Some(leaf) => certificate_identity(leaf.as_ref()).map(Some),
        None => Ok(None),
    }
}

/// The user and groups of a client certificate (DER), as [`identity`] reads them.
fn certificate_identity(der: &[u8]) -> Result<(String, Vec<String>), &'static str> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|_| "the client certificate cannot be read")?;
    let subject = cert.subject();
    let mut names = subject.iter_common_name();
    let user = match (names.next(), names.next()) {
        (Some(name), None) => name
            .as_str()
            .map_err(|_| "the client certificate's common name is not a string")?
            .to_owned(),
        (None, _) => return Err("the client certificate has no common name"),
        (Some(_), Some(_)) => return Err("the client certificate has more than one common name"),
    };
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_owned))
        .collect();
    Ok((user, groups))
}

/// The kubelet's verb for a method.
pub fn verb(method: &http::Method) -> &'static str {
    match *method {
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "get",
    }
}

/// What a request handler needs.
pub struct KubeletState {
    pub node: String,
    pub upper_pods: Cache<crate::model::trim::UpperPod>,
    /// This node's lower pods (our marks): a call goes below only to the lower pod made for
    /// the upper pod named in the path.
    pub lower_pods: Cache<crate::model::trim::LowerPod>,
    /// The lower nodes' summaries of the last `/stats/summary` fan-out, shared by the scrapes
    /// of the next [`SUMMARY_TTL`].
    pub summaries: tokio::sync::Mutex<Option<(Instant, Arc<Vec<serde_json::Value>>)>>,
    /// The lower client of the kubelet API (logs, streams, usage): a
    /// [`stream_client`](tensile_common::kubeconfig::ClientSource::stream_client).
    pub lower: kube::Client,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub require_client_cert: bool,
    pub authorizer: Authorizer,
    /// Bounds of spliced exec, attach and port-forward sessions.
    pub sessions: streams::Sessions,
    /// Lower nodes can be read (not under a namespace scope): usage is read from them.
    pub read_lower_nodes: bool,
}

/// How long the lower nodes' summaries of one fan-out answer later scrapes: metrics-server
/// and `kubectl top` scrape every 15 s or more, so a scrape storm costs one fan-out.
pub const SUMMARY_TTL: Duration = Duration::from_secs(5);
/// Lower nodes asked for their summary at once.
pub const SUMMARY_CONCURRENCY: usize = 8;

/// How a kubelet API call names a pod: upper namespace, name and, when the path has one,
/// UID.
#[derive(Clone, Copy, Debug)]
pub struct PodPath<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: Option<&'a str>,
}

/// The lower pod that runs upper pod `path` for this node, or why there is none. The upper
/// pod must be bound here (with the path's UID, when it names one), and the lower pod of that
/// name must carry this node's marks and the upper pod's UID: an upper pod named like another
/// tenant's lower pod (bound here by hand, refused below as a conflict) reaches nothing, and
/// neither does a lower pod left from an earlier upper pod of the same name. The answer for
/// "none" is a kubelet's for a pod it does not run, and no lower call is made.
pub fn resolve(
    node: &str,
    upper: Option<&crate::model::trim::UpperPod>,
    lower: Option<&crate::model::trim::LowerPod>,
    path: PodPath<'_>,
) -> Result<(), String> {
    let PodPath { namespace, name, uid } = path;
    let not_here = || format!("pod {namespace}/{name} is not running on node {node}");
    let upper = upper
        .filter(|p| p.node.as_deref() == Some(node))
        .ok_or_else(not_here)?;
    let upper_uid = upper.packed.metadata.uid.as_deref();
    if let Some(uid) = uid
        && upper_uid != Some(uid)
    {
        return Err(format!(
            "pod {namespace}/{name} on node {node} has another UID than {uid}"
        ));
    }
    let lower = lower.ok_or_else(not_here)?;
    if upper_uid.is_none() || tensile_common::lower::identity::upper_uid(lower) != upper_uid {
        return Err(not_here());
    }
    Ok(())
}

pub fn resolve_in(state: &KubeletState, path: PodPath<'_>) -> Result<(), String> {
    resolve(
        &state.node,
        state
            .upper_pods
            .get(&ObjectRef::new(path.name).within(path.namespace))
            .as_deref(),
        state
            .lower_pods
            .get(&ObjectRef::new(path.name).within(path.namespace))
            .as_deref(),
        path,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::trim::{UpperPod, packed_lower_pod};
    use serde_json::json;
    use tensile_common::names;

    fn upper(node: &str, uid: &str) -> UpperPod {
        UpperPod::of(
            serde_json::from_value(json!({
                "metadata": {"name": "web", "namespace": "ns", "uid": uid},
                "spec": {"nodeName": node, "containers": [{"name": "app"}]},
            }))
            .unwrap(),
        )
    }

    fn lower(upper_uid: Option<&str>) -> crate::model::trim::LowerPod {
        let mut labels = json!({names::MARK_CLUSTER: "c", names::MARK_NODE: "vn"});
        if let Some(uid) = upper_uid {
            labels[names::MARK_UPPER_UID] = json!(uid);
        }
        packed_lower_pod(
            serde_json::from_value(json!({
                "metadata": {"name": "web", "namespace": "ns", "uid": "lower-1", "labels": labels},
                "spec": {"containers": [{"name": "app"}]},
            }))
            .unwrap(),
        )
    }

    const PATH: PodPath<'static> = PodPath {
        namespace: "ns",
        name: "web",
        uid: None,
    };

    #[test]
    fn only_the_lower_pod_made_for_the_upper_pod_bound_here_is_reached() {
        let ours = lower(Some("u-1"));
        assert_eq!(
            resolve("vn", Some(&upper("vn", "u-1")), Some(&ours), PATH),
            Ok(())
        );
        let with_uid = PodPath {
            uid: Some("u-1"),
            ..PATH
        };
        assert_eq!(
            resolve("vn", Some(&upper("vn", "u-1")), Some(&ours), with_uid),
            Ok(())
        );
    }

    #[test]
    fn an_upper_pod_named_like_a_foreign_or_stale_lower_pod_reaches_nothing() {
        let not_here = Err("pod ns/web is not running on node vn".to_owned());
        // Another tenant's pod of the same name is not in this node's cache at all.
        assert_eq!(resolve("vn", Some(&upper("vn", "u-1")), None, PATH), not_here);
        // A lower pod of ours made for an earlier upper pod of the same name.
        assert_eq!(
            resolve("vn", Some(&upper("vn", "u-2")), Some(&lower(Some("u-1"))), PATH),
            not_here
        );
        // A lower pod with our node marks but no upper UID.
        assert_eq!(
            resolve("vn", Some(&upper("vn", "u-1")), Some(&lower(None)), PATH),
            not_here
        );
        // An upper pod bound elsewhere, or none.
        assert_eq!(
            resolve(
                "vn",
                Some(&upper("other", "u-1")),
                Some(&lower(Some("u-1"))),
                PATH
            ),
            not_here
        );
        assert_eq!(resolve("vn", None, Some(&lower(Some("u-1"))), PATH), not_here);
        // The path names another UID than the upper pod's.
        let stale = PodPath {
            uid: Some("u-0"),
            ..PATH
        };
        assert_eq!(
            resolve("vn", Some(&upper("vn", "u-1")), Some(&lower(Some("u-1"))), stale),
            Err("pod ns/web on node vn has another UID than u-0".to_owned())
        );
    }

    fn certificate(names: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = rcgen::DistinguishedName::new();
        for (kind, value) in names {
            dn.push(kind.clone(), *value);
        }
        params.distinguished_name = dn;
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_certificate_is_read_as_the_apiserver_reads_it_and_two_common_names_are_refused() {
        use rcgen::DnType;
        let one = certificate(&[(DnType::CommonName, "alice"), (DnType::OrganizationName, "team")]);
        assert_eq!(
            certificate_identity(&one),
            Ok(("alice".to_owned(), vec!["team".to_owned()]))
        );
        // The common name's OID a second time: Go's authenticator would read "mallory".
        let two = certificate(&[
            (DnType::CommonName, "alice"),
            (DnType::CustomDnType(vec![2, 5, 4, 3]), "mallory"),
        ]);
        assert_eq!(
            certificate_identity(&two),
            Err("the client certificate has more than one common name")
        );
        let none = certificate(&[(DnType::OrganizationName, "team")]);
        assert_eq!(
            certificate_identity(&none),
            Err("the client certificate has no common name")
        );
        assert_eq!(
            certificate_identity(b"not a certificate"),
            Err("the client certificate cannot be read")
        );
    }
}
