//! Certificates and keys for a test cluster, generated in process.
//!
//! Two CAs per cluster: the cluster CA signs the apiserver's serving certificate and the
//! admin identity; a separate kubelet-client CA signs the certificate the apiserver
//! presents to kubelets, so a kubelet endpoint can trust exactly that caller.

use std::net::{IpAddr, Ipv4Addr};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    IsCa, KeyPair, KeyUsagePurpose, SanType,
};

#[derive(Debug, thiserror::Error)]
#[error("generating {what}: {source}")]
pub struct Error {
    what: &'static str,
    #[source]
    source: rcgen::Error,
}

fn ctx(what: &'static str) -> impl FnOnce(rcgen::Error) -> Error {
    move |source| Error { what, source }
}

/// A PEM certificate with its PEM private key.
#[derive(Clone, Debug)]
pub struct CertKey {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A certificate authority able to sign leaves.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    pub fn new(common_name: &str) -> Result<Self, Error> {
        let key = KeyPair::generate().map_err(ctx("CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(ctx("CA params"))?;
        params.distinguished_name = name(common_name, None);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(ctx("CA certificate"))?;
        Ok(Self { issuer })
    }

    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA's private key (PEM): for a signer that issues certificates of this CA.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// A serving certificate for loopback (`127.0.0.1`, `::1`, `localhost`) plus `extra` DNS names.
    pub fn server(&self, common_name: &str, extra: &[&str]) -> Result<CertKey, Error> {
        let mut dns: Vec<String> = vec!["localhost".into()];
        dns.extend(extra.iter().map(|s| s.to_string()));
        let mut params = CertificateParams::new(dns).map_err(ctx("server params"))?;
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))));
        params.distinguished_name = name(common_name, None);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.leaf(params)
    }

    /// A client certificate for user `common_name` in group `group`.
    pub fn client(&self, common_name: &str, group: Option<&str>) -> Result<CertKey, Error> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(ctx("client params"))?;
        params.distinguished_name = name(common_name, group);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.leaf(params)
    }

    /// A client certificate whose subject holds two common names, `first` then `last`: Go's
    /// x509 authenticator (the apiserver's) takes the last as the user.
    pub fn client_with_two_names(&self, first: &str, last: &str) -> Result<CertKey, Error> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(ctx("client params"))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, first);
        // The common name's own OID under another key: the name map holds one value a type.
        dn.push(DnType::CustomDnType(vec![2, 5, 4, 3]), last);
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.leaf(params)
    }

    fn leaf(&self, params: CertificateParams) -> Result<CertKey, Error> {
        let key = KeyPair::generate().map_err(ctx("leaf key"))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(ctx("leaf certificate"))?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A self-signed serving certificate for loopback, for endpoints nobody verifies by CA
/// (the apiserver checks a kubelet's certificate only when told to).
pub fn self_signed_server(common_name: &str) -> Result<CertKey, Error> {
    let ca = Ca::new(common_name)?;
    ca.server(common_name, &[])
}

/// The service-account signing key pair, as PEM (private PKCS#8, public SPKI).
pub fn service_account_keys() -> Result<(String, String), Error> {
    let key = KeyPair::generate().map_err(ctx("service-account key"))?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}

fn name(common_name: &str, group: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(group) = group {
        dn.push(DnType::OrganizationName, group);
    }
    dn
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_are_pem_and_signed_by_their_ca() {
        let ca = Ca::new("test-ca").unwrap();
        let server = ca.server("apiserver", &["kubernetes"]).unwrap();
        let client = ca.client("admin", Some("system:masters")).unwrap();
        for pem in [&server.cert_pem, &client.cert_pem, &ca.cert_pem()] {
            assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
        }
        assert!(server.key_pem.contains("PRIVATE KEY"));
        // The certificate verifies against the CA with rustls' verifier (what kube uses).
        let mut roots = rustls::RootCertStore::empty();
        let ca_der = crate::tls::certs_from_pem(&ca.cert_pem()).unwrap();
        roots.add(ca_der[0].clone()).unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
            .build()
            .unwrap();
        let leaf = crate::tls::certs_from_pem(&server.cert_pem).unwrap();
        use rustls::client::danger::ServerCertVerifier as _;
        let now = rustls::pki_types::UnixTime::now();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        verifier
            .verify_server_cert(&leaf[0], &[], &name, &[], now)
            .unwrap();
    }
}
