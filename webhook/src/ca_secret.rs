//! One serving CA for every replica, kept in a Secret.
//!
//! A replica that generated its own CA would write it into the registration's `caBundle`
//! over the other replicas' CAs, and the apiserver could then reach only the last one to
//! start (during a rollout, or with two replicas, every other call fails). With
//! `--ca-secret`, the first replica creates the CA and stores it in the Secret (`ca.crt`,
//! `ca.key`); every replica, the first included, reads it back and signs its own serving
//! certificate with it. Two replicas starting together race on the create: the loser gets
//! 409 and reads the winner's CA. Restarting a replica leaves the Secret, hence the bundle,
//! unchanged. A Secret that exists without data (the Helm chart makes it, so that uninstalling
//! the release removes it) is filled the same way: an update on its resourceVersion, whose
//! loser gets 409 and reads the winner's.

use std::path::Path;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use rustls::sign::CertifiedKey;

/// Keys of the Secret's data.
pub const CA_CERT_KEY: &str = "ca.crt";
pub const CA_KEY_KEY: &str = "ca.key";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("CA Secret {namespace}/{name}: {source}")]
    Kube {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("CA Secret {namespace}/{name} lacks {key}")]
    Incomplete {
        namespace: String,
        name: String,
        key: &'static str,
    },
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error(transparent)]
    Tls(#[from] tensile_common::tls::Error),
}

/// A Secret named `namespace/name` (the `--ca-secret` flag).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for SecretRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!("{s:?} is not namespace/name")),
        }
    }
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The shared CA: certificate and private key, PEM.
#[derive(Clone, Debug)]
pub struct SharedCa {
    pub cert_pem: String,
    pub key_pem: String,
}

impl SharedCa {
    /// A new CA (`tensile-webhook-ca`), valid for as long as rcgen's default (no expiry a
    /// cluster would meet).
    pub fn generate() -> Result<Self, Error> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "tensile-webhook-ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A serving certificate for `names` signed by this CA.
    pub fn issue(&self, names: &[String]) -> Result<CertifiedKey, Error> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::from_pem(&self.key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, ca_key)?;
        let leaf_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "tensile-webhook");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let leaf = params.signed_by(&leaf_key, &issuer)?;
        Ok(tensile_common::tls::certified_key(
            leaf.pem().as_bytes(),
            leaf_key.serialize_pem().as_bytes(),
            Path::new("<issued>"),
            Path::new("<issued>"),
        )?)
    }
}

/// Reads the CA from Secret `namespace/name`, creating the Secret with a new CA when there is
/// none. Needs `get` on that Secret and `create` on Secrets in `namespace`.
pub async fn load_or_create(client: kube::Client, namespace: &str, name: &str) -> Result<SharedCa, Error> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let err = |source| Error::Kube {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let existing = api.get_opt(name).await.map_err(err)?;
    if let Some(existing) = &existing
        && existing.data.as_ref().is_some_and(|d| !d.is_empty())
    {
        return from_secret(existing, namespace, name);
    }
    let ca = SharedCa::generate()?;
    let data = [
        (
            CA_CERT_KEY.to_owned(),
            ByteString(ca.cert_pem.clone().into_bytes()),
        ),
        (CA_KEY_KEY.to_owned(), ByteString(ca.key_pem.clone().into_bytes())),
    ];
    if let Some(empty) = existing {
        let mut filled = empty;
        filled.data = Some(data.into());
        return match api.replace(name, &PostParams::default(), &filled).await {
            Ok(_) => {
                tracing::info!(secret = %format!("{namespace}/{name}"), "filled the shared serving CA");
                Ok(ca)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                from_secret(&api.get(name).await.map_err(err)?, namespace, name)
            }
            Err(e) => Err(err(e)),
        };
    }
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "tensile-webhook".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data.into()),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = %format!("{namespace}/{name}"), "created the shared serving CA");
            Ok(ca)
        }
        // Another replica created it first: use theirs.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            from_secret(&api.get(name).await.map_err(err)?, namespace, name)
        }
        Err(e) => Err(err(e)),
    }
}

fn from_secret(secret: &Secret, namespace: &str, name: &str) -> Result<SharedCa, Error> {
    let field = |key: &'static str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::Incomplete {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                key,
            })
    };
    Ok(SharedCa {
        cert_pem: field(CA_CERT_KEY)?,
        key_pem: field(CA_KEY_KEY)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;

    #[test]
    fn two_serving_certificates_of_one_ca_verify_with_its_certificate() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca = SharedCa::generate().unwrap();
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let a = ca.issue(&names).unwrap();
        let b = ca.issue(&names).unwrap();
        assert_ne!(a.cert[0], b.cert[0], "each replica has its own certificate");
        let mut roots = rustls::RootCertStore::empty();
        let ca_der = rustls::pki_types::CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap();
        roots.add(ca_der).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder(roots.into())
            .build()
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        for leaf in [&a, &b] {
            verifier
                .verify_server_cert(&leaf.cert[0], &[], &name, &[], rustls::pki_types::UnixTime::now())
                .unwrap();
        }
    }

    #[test]
    fn the_flag_is_namespace_slash_name() {
        let r: SecretRef = "tensile/webhook-ca".parse().unwrap();
        assert_eq!(r.to_string(), "tensile/webhook-ca");
        for bad in ["webhook-ca", "/x", "x/", "a/b/c"] {
            assert!(bad.parse::<SecretRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_secret_without_the_key_is_reported() {
        let secret = Secret {
            data: Some([(CA_CERT_KEY.to_owned(), ByteString(b"x".to_vec()))].into()),
            ..Default::default()
        };
        let e = from_secret(&secret, "ns", "ca").unwrap_err();
        assert_eq!(e.to_string(), "CA Secret ns/ca lacks ca.key");
    }
}
