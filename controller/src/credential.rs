//! A lower cluster's credential: a kubeconfig whose user reads its token from a file beside
//! it (`tokenFile: token`), and that token, a ServiceAccount token of the lower cluster
//! requested with the TokenRequest API. Both live in one upper Secret (keys `kubeconfig`
//! and `token`), mounted into the virtual node's pod as one directory.
//!
//! Renewal: at 80 % of a token's life (the kubelet's rule for projected tokens) the cluster
//! controller asks the lower cluster, with the token itself, for a new one of the same
//! lifetime for the same ServiceAccount, and writes it into the Secret. The kubelet updates
//! the mounted file and the virtual node's client reads it again within a minute, so no
//! call ever goes out with an expired token while the lower cluster can be reached in the
//! last fifth of a lifetime. A token is never written anywhere else.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::TokenRequestSpec;
use k8s_openapi::api::core::v1::Secret;
use serde::Deserialize;
use tensile_common::names;

/// The share of a token's lifetime after which it is renewed.
pub const RENEW_AT: f64 = 0.8;

/// The shortest token lifetime the apiserver issues (TokenRequest refuses less).
pub const MIN_LIFETIME: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the token is not a JSON web token with a payload")]
    NotJwt,
    #[error("the token's payload does not decode: {0}")]
    Payload(String),
    #[error("the token is not a ServiceAccount's (its subject is {0:?})")]
    NotServiceAccount(String),
    #[error("the kubeconfig does not decode: {0}")]
    Kubeconfig(String),
    #[error("the kubeconfig names no cluster to use")]
    NoCluster,
    #[error("the kubeconfig has no context {name:?} (it has: {known})")]
    NoContext { name: String, known: String },
    #[error("the kubeconfig's cluster has no server")]
    NoServer,
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// What a ServiceAccount token says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    pub namespace: String,
    pub service_account: String,
    pub issued: Timestamp,
    pub expires: Timestamp,
}

#[derive(Deserialize)]
struct Payload {
    sub: String,
    iat: i64,
    exp: i64,
}

impl Claims {
    /// Reads the claims of `token` (not its signature: the lower apiserver checks that).
    pub fn of(token: &str) -> Result<Self, Error> {
        let payload = token.trim().split('.').nth(1).ok_or(Error::NotJwt)?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload.trim_end_matches('='))
            .map_err(|e| Error::Payload(e.to_string()))?;
        let payload: Payload = serde_json::from_slice(&bytes).map_err(|e| Error::Payload(e.to_string()))?;
        let account = payload
            .sub
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains(':'))
            .ok_or_else(|| Error::NotServiceAccount(payload.sub.clone()))?;
        let at = |s: i64| Timestamp::from_second(s).map_err(|e| Error::Payload(e.to_string()));
        Ok(Self {
            namespace: account.0.to_owned(),
            service_account: account.1.to_owned(),
            issued: at(payload.iat)?,
            expires: at(payload.exp)?,
        })
    }

    /// The token's lifetime (never negative).
    pub fn lifetime(&self) -> Duration {
        self.expires
            .duration_since(self.issued)
            .try_into()
            .unwrap_or(Duration::ZERO)
    }

    /// When the token is renewed: after `share` of its lifetime.
    pub fn renew_at(&self, share: f64) -> Timestamp {
        let life = self.expires.duration_since(self.issued).as_secs_f64().max(0.0);
        let after = SignedDuration::from_secs_f64(life * share.clamp(0.0, 1.0));
        self.issued.checked_add(after).unwrap_or(self.issued)
    }
}

/// The cluster a kubeconfig points at, with its CA inline: what a credential kubeconfig is
/// built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub server: String,
    /// The CA's PEM, base64 (`certificate-authority-data`), if the kubeconfig names one.
    pub ca_data: Option<String>,
    pub insecure: bool,
    pub proxy_url: Option<String>,
    /// The name the apiserver's certificate is checked against, when not the server's host.
    pub tls_server_name: Option<String>,
}

impl Endpoint {
    /// The current context's cluster of `kubeconfig` (or of `context`), the CA read from its
    /// file when the kubeconfig names one, so the result stands on its own (`--flatten`).
    pub fn of(kubeconfig: &kube::config::Kubeconfig, context: Option<&str>) -> Result<Self, Error> {
        if let Some(name) = context
            && !kubeconfig.contexts.iter().any(|c| c.name == name)
        {
            let known: Vec<&str> = kubeconfig.contexts.iter().map(|c| c.name.as_str()).collect();
            return Err(Error::NoContext {
                name: name.to_owned(),
                known: if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                },
            });
        }
        let cluster = tensile_common::kubeconfig::cluster_of(kubeconfig, context).ok_or(Error::NoCluster)?;
        let server = cluster.server.clone().ok_or(Error::NoServer)?;
        // Inline as written, or the file's PEM inlined.
        let ca_data = match &cluster.certificate_authority_data {
            Some(data) => Some(data.clone()),
            None => tensile_common::kubeconfig::ca_pem(cluster)
                .map_err(|source| Error::Read {
                    path: cluster.certificate_authority.clone().unwrap_or_default(),
                    source,
                })?
                .map(|pem| base64::engine::general_purpose::STANDARD.encode(pem)),
        };
        Ok(Self {
            server,
            ca_data,
            insecure: cluster.insecure_skip_tls_verify.unwrap_or(false),
            proxy_url: cluster.proxy_url.clone(),
            tls_server_name: cluster.tls_server_name.clone(),
        })
    }

    /// A kubeconfig for this endpoint whose user reads its token from the file `token`
    /// beside it.
    pub fn kubeconfig(&self, name: &str) -> String {
        let mut cluster = serde_json::json!({"server": self.server});
        if let Some(ca) = &self.ca_data {
            cluster["certificate-authority-data"] = ca.clone().into();
        }
        if self.insecure {
            cluster["insecure-skip-tls-verify"] = true.into();
        }
        if let Some(proxy) = &self.proxy_url {
            cluster["proxy-url"] = proxy.clone().into();
        }
        if let Some(name) = &self.tls_server_name {
            cluster["tls-server-name"] = name.clone().into();
        }
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": cluster}],
            "users": [{"name": name, "user": {"tokenFile": names::CREDENTIAL_TOKEN_KEY}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
        });
        serde_yaml::to_string(&config).unwrap_or_default()
    }
}

/// Asks the cluster of `client` for a token of ServiceAccount `namespace/name` that lives
/// `lifetime`.
pub async fn request_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    lifetime: Duration,
) -> Result<String, kube::Error> {
    let spec = TokenRequestSpec {
        expiration_seconds: Some(lifetime.as_secs().try_into().unwrap_or(i64::MAX)),
        ..Default::default()
    };
    tensile_common::api::request_token(client, namespace, name, spec)
        .await
        .map(|(token, _)| token)
}

/// The data of a credential Secret: the kubeconfig and the token it reads.
pub fn secret_data(kubeconfig: &str, token: &str) -> BTreeMap<String, ByteString> {
    BTreeMap::from([
        (
            names::CREDENTIAL_KUBECONFIG_KEY.to_owned(),
            ByteString(kubeconfig.as_bytes().to_vec()),
        ),
        (
            names::CREDENTIAL_TOKEN_KEY.to_owned(),
            ByteString(token.as_bytes().to_vec()),
        ),
    ])
}

/// The text of key `key` of `secret`.
pub fn secret_text(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A token shaped as the apiserver issues one (the signature is not checked here).
    pub fn token(sub: &str, iat: i64, exp: i64) -> String {
        let b64 =
            |v: serde_json::Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
        format!(
            "{}.{}.c2ln",
            b64(serde_json::json!({"alg": "RS256", "kid": "k"})),
            b64(
                serde_json::json!({"aud": ["https://kubernetes.default.svc"], "sub": sub, "iat": iat, "exp": exp,
                "nbf": iat, "iss": "https://kubernetes.default.svc.cluster.local",
                "kubernetes.io": {"namespace": "tensile", "serviceaccount": {"name": "tensile-a", "uid": "u"}}})
            )
        )
    }

    #[test]
    fn a_service_account_token_names_its_account_and_lifetime() {
        let claims = Claims::of(&token("system:serviceaccount:tensile:tensile-a", 1_000, 87_400)).unwrap();
        assert_eq!(claims.namespace, "tensile");
        assert_eq!(claims.service_account, "tensile-a");
        assert_eq!(claims.lifetime(), Duration::from_secs(86_400));
        // At 80 % of its life: 19.2 hours after it was issued.
        assert_eq!(
            claims.renew_at(RENEW_AT),
            Timestamp::from_second(1_000 + 69_120).unwrap()
        );
        // A newline after the token (as `kubectl create token > file` leaves it) is no matter.
        let with_newline = format!("{}\n", token("system:serviceaccount:a:b", 0, 600));
        assert_eq!(Claims::of(&with_newline).unwrap().lifetime(), MIN_LIFETIME);
    }

    #[test]
    fn tokens_that_are_not_a_service_accounts_are_refused_with_the_reason() {
        assert!(matches!(Claims::of("opaque-static-token"), Err(Error::NotJwt)));
        assert!(matches!(Claims::of("a.!!!.c"), Err(Error::Payload(_))));
        for sub in [
            "admin",
            "system:serviceaccount:only-ns",
            "system:serviceaccount::x",
            "system:node:n",
        ] {
            assert!(
                matches!(Claims::of(&token(sub, 0, 600)), Err(Error::NotServiceAccount(_))),
                "{sub}"
            );
        }
    }

    #[test]
    fn a_renewal_point_never_falls_outside_the_lifetime() {
        let claims = Claims::of(&token("system:serviceaccount:a:b", 100, 700)).unwrap();
        assert_eq!(claims.renew_at(0.0), claims.issued);
        assert_eq!(claims.renew_at(1.5), claims.expires);
        assert_eq!(claims.renew_at(0.5), Timestamp::from_second(400).unwrap());
    }

    #[test]
    fn a_credential_kubeconfig_reads_its_token_from_the_file_beside_it() {
        let endpoint = Endpoint {
            server: "https://lower-a.example:6443".into(),
            ca_data: Some("Q0E=".into()),
            insecure: false,
            proxy_url: Some("http://proxy.example:3128".into()),
            tls_server_name: Some("lower-a.internal".into()),
        };
        let text = endpoint.kubeconfig("lower-a");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kubeconfig"), &text).unwrap();
        std::fs::write(dir.path().join("token"), "t").unwrap();
        let parsed = kube::config::Kubeconfig::read_from(dir.path().join("kubeconfig")).unwrap();
        let user = parsed.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref().map(std::path::Path::new),
            Some(dir.path().join("token").as_path()),
            "relative to the kubeconfig, so the Secret's two keys mounted as one directory work"
        );
        assert_eq!(
            Endpoint::of(&parsed, None).unwrap(),
            endpoint,
            "the TLS server name is kept"
        );
        let wrong = Endpoint::of(&parsed, Some("lower-b")).unwrap_err().to_string();
        assert_eq!(
            wrong,
            "the kubeconfig has no context \"lower-b\" (it has: lower-a)"
        );
    }
}
