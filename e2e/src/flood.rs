//! Idle and slow clients against one of the suite's HTTPS servers: connections that never
//! start TLS, and connections that finish TLS and then send a request's headers a byte at a
//! time, never completing them. Each connection watches for the server closing it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// Open connections of a flood; dropping it closes those still open.
pub struct Flood {
    opened: usize,
    open: Arc<AtomicUsize>,
    tasks: JoinSet<()>,
}

impl Flood {
    /// Opens `silent` connections that never send a byte and `trickling` connections that
    /// finish the TLS handshake and then send one byte of an unfinished request header every
    /// 200 ms. Returns once every connection is open (or refused).
    pub async fn open(addr: SocketAddr, silent: usize, trickling: usize) -> Flood {
        let open = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map(|b| {
                    b.dangerous()
                        .with_custom_certificate_verifier(Arc::new(AnyCertificate))
                        .with_no_client_auth()
                })
                .unwrap_or_else(|e| panic!("TLS client configuration: {e}")),
        ));
        let mut handshakes = JoinSet::new();
        for _ in 0..silent {
            let Ok(mut tcp) = TcpStream::connect(addr).await else {
                continue;
            };
            open.fetch_add(1, Ordering::SeqCst);
            opened.fetch_add(1, Ordering::SeqCst);
            let open = open.clone();
            tasks.spawn(async move {
                // Reads only end when the server closes (or resets) the connection.
                let _ = tcp.read(&mut [0u8; 64]).await;
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
        for _ in 0..trickling {
            let (connector, open, opened) = (connector.clone(), open.clone(), opened.clone());
            handshakes.spawn(async move {
                let tcp = TcpStream::connect(addr).await.ok()?;
                let name = ServerName::try_from("127.0.0.1").ok()?;
                let tls = connector.connect(name, tcp).await.ok()?;
                open.fetch_add(1, Ordering::SeqCst);
                opened.fetch_add(1, Ordering::SeqCst);
                Some(tls)
            });
        }
        while let Some(joined) = handshakes.join_next().await {
            let Ok(Some(tls)) = joined else { continue };
            let open = open.clone();
            tasks.spawn(async move {
                let (mut reader, mut writer) = tokio::io::split(tls);
                let trickle = async {
                    for byte in b"POST /mutate HTTP/1.1\r\nHost: flood\r\nX-Slow: ".iter().cycle() {
                        if writer.write_all(&[*byte]).await.is_err() || writer.flush().await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                };
                let mut buf = [0u8; 64];
                tokio::select! {
                    _ = reader.read(&mut buf) => {}
                    _ = trickle => {}
                }
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Flood {
            opened: opened.load(Ordering::SeqCst),
            open,
            tasks,
        }
    }

    /// Connections the server accepted (TCP connected, TLS finished for trickling ones).
    pub fn opened(&self) -> usize {
        self.opened
    }

    /// Connections the server has not closed yet.
    pub fn still_open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Panics unless the server let in at least `silent` connections and, half a second
    /// later, keeps at most `cap` of them open.
    pub async fn assert_capped(&self, silent: usize, cap: usize) {
        assert!(self.opened() >= silent, "the flood got in: {}", self.opened());
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            self.still_open() <= cap,
            "at most the cap stays open: {} of {}",
            self.still_open(),
            self.opened()
        );
    }

    /// Panics unless the server closes every flood connection within `within`.
    pub async fn assert_all_closed_within(&self, within: Duration) {
        crate::wait::until(
            "every flood connection closed by the idle deadline",
            within,
            Duration::from_millis(200),
            || async {
                match self.still_open() {
                    0 => Ok(()),
                    n => Err(format!("{n} still open")),
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Accepts any server certificate: the flood attacks, it does not authenticate.
#[derive(Debug)]
struct AnyCertificate;

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}
