//! A server's certificate: read from files and reloaded when they change, or generated at
//! start under a CA of our own (the webhook puts that CA into its `caBundle`).
//!
//! Reload polls the files' contents rather than watching inotify events: Kubernetes swaps
//! mounted Secrets through symlinks, which inotify watches on the file miss, and a poll
//! every few seconds costs nothing.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no usable PEM {what}: {detail}")]
    Pem {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("certificate {cert} and key {key} do not go together: {source}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate the server presents; swapped in place on reload.
#[derive(Debug)]
pub struct CertResolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl CertResolver {
    pub fn new(key: CertifiedKey) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(Arc::new(key)),
        })
    }

    pub fn current(&self) -> Arc<CertifiedKey> {
        match self.current.read() {
            Ok(k) => k.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, key: CertifiedKey) {
        let key = Arc::new(key);
        match self.current.write() {
            Ok(mut k) => *k = key,
            Err(poisoned) => *poisoned.into_inner() = key,
        }
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A rustls server configuration presenting `resolver`'s certificate, with HTTP/2 and 1.1.
pub fn server_config(resolver: Arc<CertResolver>) -> Result<Arc<rustls::ServerConfig>, Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })
}

/// A certified key from PEM bytes; `cert`/`key` name the files in errors.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert: &Path,
    key: &Path,
) -> Result<CertifiedKey, Error> {
    let chain: Result<Vec<CertificateDer<'static>>, _> = CertificateDer::pem_slice_iter(cert_pem).collect();
    let chain = chain.map_err(|e| Error::Pem {
        path: cert.to_owned(),
        what: "certificate",
        detail: e.to_string(),
    })?;
    if chain.is_empty() {
        return Err(Error::Pem {
            path: cert.to_owned(),
            what: "certificate",
            detail: "no CERTIFICATE block".into(),
        });
    }
    let private = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| Error::Pem {
        path: key.to_owned(),
        what: "private key",
        detail: e.to_string(),
    })?;
    CertifiedKey::from_der(chain, private, &provider()).map_err(|source| Error::Pair {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    })
}

/// A certificate and key read from files.
pub fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, Error> {
    certified_key(&read(cert)?, &read(key)?, cert, key)
}

/// Polls `cert` and `key` every `every` and swaps in a new pair once it reads and matches.
/// A half-written rotation (new certificate, old key) is skipped until the pair agrees.
pub async fn reload(
    resolver: Arc<CertResolver>,
    cert: PathBuf,
    key: PathBuf,
    every: Duration,
    stop: CancellationToken,
) {
    let mut last = (read(&cert).ok(), read(&key).ok());
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = (read(&cert).ok(), read(&key).ok());
        if now == last {
            continue;
        }
        let (Some(c), Some(k)) = &now else {
            tracing::warn!(cert = %cert.display(), key = %key.display(), "serving certificate files are unreadable; keeping the current one");
            continue;
        };
        match certified_key(c, k, &cert, &key) {
            Ok(pair) => {
                resolver.set(pair);
                tracing::info!(cert = %cert.display(), "serving certificate reloaded");
                last = now;
            }
            Err(e) => {
                tracing::warn!(error = %e, "new serving certificate not usable yet; keeping the current one")
            }
        }
    }
}

/// A CA made at start and the serving certificate it signed.
pub struct SelfSigned {
    pub ca_pem: String,
    pub key: CertifiedKey,
}

/// Generates a CA and a serving certificate for `names` (DNS names or IP addresses).
pub fn self_signed(names: &[String]) -> Result<SelfSigned, Error> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tensile-webhook-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;

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
    let leaf = params.signed_by(&leaf_key, &ca)?;
    let chain = vec![leaf.der().clone()];
    let private = PrivateKeyDer::try_from(leaf_key.serialize_der()).map_err(|e| Error::Pem {
        path: PathBuf::from("<generated>"),
        what: "private key",
        detail: e.to_string(),
    })?;
    let key = CertifiedKey::from_der(chain, private, &provider())?;
    Ok(SelfSigned {
        ca_pem: ca.pem(),
        key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_pair_is_usable() {
        let s = self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(s.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.key.keys_match().is_ok());
    }

    #[test]
    fn mismatched_files_are_refused_with_both_names() {
        let dir = tempfile::tempdir().unwrap();
        let a = rcgen::generate_simple_self_signed(vec!["a".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["b".into()]).unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, a.cert.pem()).unwrap();
        std::fs::write(&key, b.signing_key.serialize_pem()).unwrap();
        let err = load(&cert, &key).unwrap_err().to_string();
        assert!(err.contains("tls.crt") && err.contains("tls.key"), "{err}");
        std::fs::write(&key, a.signing_key.serialize_pem()).unwrap();
        assert!(load(&cert, &key).is_ok());
        let missing = load(&dir.path().join("none.crt"), &key).unwrap_err().to_string();
        assert!(missing.contains("none.crt"), "{missing}");
        std::fs::write(&cert, "garbage").unwrap();
        assert!(load(&cert, &key).unwrap_err().to_string().contains("certificate"));
    }

    #[tokio::test]
    async fn a_rotation_on_disk_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let a = rcgen::generate_simple_self_signed(vec!["a".into()]).unwrap();
        std::fs::write(&cert, a.cert.pem()).unwrap();
        std::fs::write(&key, a.signing_key.serialize_pem()).unwrap();
        let resolver = CertResolver::new(load(&cert, &key).unwrap());
        let stop = CancellationToken::new();
        let task = tokio::spawn(reload(
            resolver.clone(),
            cert.clone(),
            key.clone(),
            Duration::from_millis(20),
            stop.clone(),
        ));
        let b = rcgen::generate_simple_self_signed(vec!["b".into()]).unwrap();
        // Half a rotation: the old key does not match, so the old pair stays.
        std::fs::write(&cert, b.cert.pem()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(resolver.current().cert[0].as_ref(), a.cert.der().as_ref());
        std::fs::write(&key, b.signing_key.serialize_pem()).unwrap();
        for _ in 0..100 {
            if resolver.current().cert[0].as_ref() == b.cert.der().as_ref() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(resolver.current().cert[0].as_ref(), b.cert.der().as_ref());
        stop.cancel();
        task.await.unwrap();
    }
}
