//! Idle and slow clients against one of the suite's HTTPS servers: connections that never
//! start TLS, and connections that finish TLS and then send a request's headers a byte at a
//! time, never completing them. Each connection watches for the server closing it.
//!
//! [`Uploads`]: one HTTP/2 connection that opens as many streams as the server lets it, each
//! a request whose body it sends as fast as flow control allows and never finishes.

use std::future::Future as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// One HTTP/2 connection of never-finished uploads; dropping it closes the connection.
pub struct Uploads {
    /// Concurrent streams the server advertised (its SETTINGS).
    pub advertised_streams: usize,
    /// Streams opened: the client waits for a free stream beyond what the server allows.
    pub opened: usize,
    sent: Arc<std::sync::atomic::AtomicU64>,
    answered: Arc<Mutex<Vec<u16>>>,
    tasks: JoinSet<()>,
}

impl Uploads {
    /// Opens up to `streams` POSTs to `path` declaring `declared` body bytes each, and sends
    /// body bytes on each as fast as the server's flow control lets it.
    pub async fn open(
        addr: SocketAddr,
        path: &str,
        streams: usize,
        declared: usize,
    ) -> anyhow::Result<Uploads> {
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate))
                .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = TcpStream::connect(addr).await?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1")?, tcp)
            .await?;
        let (client, mut connection) = h2::client::Builder::new()
            .handshake::<_, bytes::Bytes>(tls)
            .await?;
        let advertised = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        let seen = advertised.clone();
        tasks.spawn(async move {
            let _ = std::future::poll_fn(|cx| {
                let polled = std::pin::Pin::new(&mut connection).poll(cx);
                seen.store(connection.max_concurrent_send_streams(), Ordering::SeqCst);
                polled
            })
            .await;
        });
        // The server's SETTINGS arrive with its first frames.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let answered = Arc::new(Mutex::new(Vec::new()));
        let mut opened = 0;
        for _ in 0..streams {
            let Ok(Ok(mut ready)) =
                tokio::time::timeout(Duration::from_millis(500), client.clone().ready()).await
            else {
                break;
            };
            let request = http::Request::post(format!("https://127.0.0.1{path}"))
                .header("content-type", "application/json")
                .header("content-length", declared)
                .body(())?;
            let (response, mut body) = ready.send_request(request, false)?;
            opened += 1;
            let (sent, answered) = (sent.clone(), answered.clone());
            tasks.spawn(async move {
                let upload = async {
                    loop {
                        body.reserve_capacity(64 * 1024);
                        match std::future::poll_fn(|cx| body.poll_capacity(cx)).await {
                            Some(Ok(n)) if n > 0 => {
                                if body.send_data(bytes::Bytes::from(vec![b' '; n]), false).is_err() {
                                    return;
                                }
                                sent.fetch_add(n as u64, Ordering::SeqCst);
                            }
                            Some(Ok(_)) => {}
                            _ => return,
                        }
                    }
                };
                tokio::pin!(response);
                // The status, or 0 for a stream the server reset without one.
                let status = tokio::select! {
                    answer = &mut response => answer.map_or(0, |a| a.status().as_u16()),
                    _ = upload => match tokio::time::timeout(Duration::from_secs(1), response).await {
                        Ok(Ok(answer)) => answer.status().as_u16(),
                        _ => 0,
                    },
                };
                answered.lock().unwrap_or_else(|e| e.into_inner()).push(status);
            });
        }
        Ok(Uploads {
            advertised_streams: advertised.load(Ordering::SeqCst),
            opened,
            sent,
            answered,
            tasks,
        })
    }

    /// Body bytes the server has taken so far, over every stream.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// How every ended stream ended: its status, or 0 when the server reset it without one.
    pub fn answered(&self) -> Vec<u16> {
        self.answered.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Uploads {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Accepts any server certificate: floods attack and the streams bench measures; neither
/// authenticates the server.
#[derive(Debug)]
pub(crate) struct AnyCertificate;

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
