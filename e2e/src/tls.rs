//! Small rustls helpers: PEM parsing and server configurations.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("PEM {what}: {detail}")]
    Pem { what: &'static str, detail: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(String),
}

pub fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem.as_bytes()).collect();
    let certs = certs.map_err(|e| Error::Pem {
        what: "certificate",
        detail: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(Error::Pem {
            what: "certificate",
            detail: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

pub fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| Error::Pem {
        what: "private key",
        detail: e.to_string(),
    })
}

/// A TLS server configuration; with `client_ca_pem`, only clients holding a certificate
/// signed by that CA get through the handshake.
pub fn server_config(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: Option<&str>,
) -> Result<Arc<rustls::ServerConfig>, Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca_pem {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certs_from_pem(ca)? {
                roots.add(cert)?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| Error::Verifier(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs_from_pem(cert_pem)?, key_from_pem(key_pem)?)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
