//! The one HTTPS server of the suite (the webhook, the kubelet API of a virtual node, the
//! multi-scheduler's extender), hardened against clients that connect and then do little:
//!
//! * **a connection cap** ([`Limits::max_connections`]): at the cap, a new connection takes
//!   the place of the connection that has been idle longest (no request in progress), so
//!   idle or slow clients cannot lock out the apiserver; when every connection is busy, the
//!   new one is closed at once. Descriptors and memory stay bounded either way.
//! * **a TLS handshake deadline** ([`Limits::handshake`]);
//! * **an idle deadline** ([`Limits::idle`]): a connection with no request in progress for
//!   that long is closed. This covers a client that never sends a request, one that sends
//!   its headers a byte at a time (the request is not in progress until its headers are
//!   complete), and HTTP/1.1 keep-alive or HTTP/2 connections left open. A streamed
//!   response (`kubectl logs -f`) is a request in progress for as long as it streams.
//! * **header and HTTP/2 limits**: header bytes per request, concurrent streams per
//!   connection, flow-control windows (how much a client can make the server buffer);
//! * **body reads with a size cap and a deadline** ([`read_body`]), for handlers.
//!
//! Each handler gets the request and the [`Peer`] (its address and, when the TLS
//! configuration verifies client certificates, the certificate it presented).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How much a server lets its clients hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open connections, handshakes included.
    pub max_connections: usize,
    /// Time from accept to a finished TLS handshake.
    pub handshake: Duration,
    /// Time a connection may stay open with no request in progress.
    pub idle: Duration,
    /// Bytes of request line and headers (HTTP/1.1) or of a header list (HTTP/2).
    pub max_header_bytes: usize,
    /// Concurrent requests on one HTTP/2 connection.
    pub max_streams: u32,
    /// HTTP/2 flow-control window of one connection: the request bytes a client can send
    /// before a handler reads them.
    pub connection_window: u32,
}

impl Default for Limits {
    /// The kubelet's own server closes idle connections after 90 s; here a minute. 1,024
    /// connections is far above what an apiserver opens to one endpoint.
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            max_streams: 250,
            connection_window: 1024 * 1024,
        }
    }
}

/// Who sent a request.
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The certificate chain the client presented, leaf first, when the TLS configuration
    /// verified it; `None` without one.
    pub certificates: Option<Arc<Vec<CertificateDer<'static>>>>,
}

/// Connection counts, for a server's metrics and for tests.
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections open now (handshakes included).
    pub open: AtomicUsize,
    /// Idle connections closed to make room for a new one.
    pub evicted: AtomicU64,
    /// New connections closed at once because every open one was busy.
    pub refused: AtomicU64,
    /// Connections closed by the handshake or idle deadline.
    pub timed_out: AtomicU64,
}

/// One open connection as the cap sees it.
struct Slot {
    /// Requests in progress (a response counts until its body is finished or dropped).
    busy: Arc<AtomicUsize>,
    /// When the connection last went idle (or opened).
    idle_since: Arc<Mutex<Instant>>,
    close: CancellationToken,
}

#[derive(Default)]
struct Table {
    next: u64,
    slots: HashMap<u64, Slot>,
}

impl Table {
    /// Makes room for one more connection: true when there is room (possibly by closing the
    /// longest-idle connection).
    fn admit(&mut self, cap: usize, counters: &Counters) -> bool {
        if self.slots.len() < cap {
            return true;
        }
        let idlest = self
            .slots
            .iter()
            .filter(|(_, s)| s.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, s)| *s.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
            .map(|(id, _)| *id);
        match idlest {
            Some(id) => {
                if let Some(slot) = self.slots.remove(&id) {
                    slot.close.cancel();
                }
                counters.evicted.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}

/// Serves HTTPS on `listener` until `stop`; then open connections finish their requests
/// within a few seconds. `handler` answers each request.
pub async fn serve<H, Fut, B>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    limits: Limits,
    counters: Arc<Counters>,
    stop: CancellationToken,
    handler: H,
) where
    H: Fn(Request<Incoming>, Peer) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let table = Arc::new(Mutex::new(Table::default()));
    let limits = Arc::new(limits);
    loop {
        let (tcp, addr) = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let busy = Arc::new(AtomicUsize::new(0));
        let idle_since = Arc::new(Mutex::new(Instant::now()));
        let close = CancellationToken::new();
        let id = {
            let mut table = table.lock().unwrap_or_else(|e| e.into_inner());
            if !table.admit(limits.max_connections, &counters) {
                tracing::debug!(%addr, "connection refused: every connection is busy");
                continue;
            }
            let id = table.next;
            table.next += 1;
            table.slots.insert(
                id,
                Slot {
                    busy: busy.clone(),
                    idle_since: idle_since.clone(),
                    close: close.clone(),
                },
            );
            id
        };
        counters.open.fetch_add(1, Ordering::Relaxed);
        let _ = tcp.set_nodelay(true);
        let (acceptor, handler, limits, counters, table) = (
            acceptor.clone(),
            handler.clone(),
            limits.clone(),
            counters.clone(),
            table.clone(),
        );
        let stopping = stop.clone();
        tokio::spawn(async move {
            let activity = Activity { busy, idle_since };
            connection(
                tcp, addr, acceptor, handler, &limits, &counters, activity, close, stopping,
            )
            .await;
            table.lock().unwrap_or_else(|e| e.into_inner()).slots.remove(&id);
            counters.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// A connection's requests in progress and when it last had none.
#[derive(Clone)]
struct Activity {
    busy: Arc<AtomicUsize>,
    idle_since: Arc<Mutex<Instant>>,
}

impl Activity {
    fn start(&self) -> InProgress {
        self.busy.fetch_add(1, Ordering::AcqRel);
        InProgress(self.clone())
    }

    /// How long the connection has been idle, or `None` while a request is in progress.
    fn idle_for(&self) -> Option<Duration> {
        (self.busy.load(Ordering::Acquire) == 0).then(|| {
            self.idle_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
        })
    }
}

/// One request in progress; dropped when its response body is finished or dropped.
struct InProgress(Activity);

impl Drop for InProgress {
    fn drop(&mut self) {
        // The clock is reset before the count drops, so an idle check never sees a zero
        // count with a stale time.
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in progress until it is done.
struct Tracked<B> {
    inner: B,
    _progress: InProgress,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[allow(clippy::too_many_arguments)]
async fn connection<H, Fut, B>(
    tcp: tokio::net::TcpStream,
    addr: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    handler: H,
    limits: &Limits,
    counters: &Counters,
    activity: Activity,
    close: CancellationToken,
    stopping: CancellationToken,
) where
    H: Fn(Request<Incoming>, Peer) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tls = tokio::select! {
        _ = close.cancelled() => return,
        done = tokio::time::timeout(limits.handshake, acceptor.accept(tcp)) => match done {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%addr, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                counters.timed_out.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%addr, "TLS handshake not finished in time");
                return;
            }
        },
    };
    let certificates = tls
        .get_ref()
        .1
        .peer_certificates()
        .filter(|c| !c.is_empty())
        .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect::<Vec<_>>()));
    let peer = Peer { addr, certificates };
    let service_activity = activity.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let progress = service_activity.start();
        let response = handler(request, peer.clone());
        async move {
            let (parts, body) = response.await.into_parts();
            Ok::<_, std::convert::Infallible>(Response::from_parts(
                parts,
                Tracked {
                    inner: body,
                    _progress: progress,
                },
            ))
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .initial_connection_window_size(limits.connection_window)
        .initial_stream_window_size(limits.connection_window.min(256 * 1024))
        .max_send_buf_size(256 * 1024);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::pin!(conn);
    let check = (limits.idle / 4).max(Duration::from_millis(100));
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%addr, error = %e, "connection ended with an error");
                }
                return;
            }
            // Made room for a newer connection: this one was idle, nothing is lost.
            _ = close.cancelled() => return,
            _ = stopping.cancelled() => {
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(Duration::from_secs(5), conn.as_mut()).await;
                return;
            }
            _ = tokio::time::sleep(check) => {
                if activity.idle_for().is_some_and(|idle| idle >= limits.idle) {
                    counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%addr, "idle connection closed");
                    return;
                }
            }
        }
    }
}

/// A plain-text response (one line of what went wrong, or `ok`).
pub fn text(status: hyper::StatusCode, body: impl Into<String>) -> Response<http_body_util::Full<Bytes>> {
    let mut response = Response::new(http_body_util::Full::new(Bytes::from(body.into())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Why a request body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body larger than {0} bytes")]
    TooLarge(usize),
    #[error("request body not received within {0:?}")]
    TooSlow(Duration),
    #[error("reading the request body: {0}")]
    Read(String),
}

/// Reads a whole request body of at most `max_bytes` within `deadline`.
pub async fn read_body<B>(body: B, max_bytes: usize, deadline: Duration) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match tokio::time::timeout(deadline, Limited::new(body, max_bytes).collect()).await {
        Err(_) => Err(BodyError::TooSlow(deadline)),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge(max_bytes)),
        Ok(Err(e)) => Err(BodyError::Read(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(busy: usize, idle_secs: u64) -> (Slot, CancellationToken) {
        let close = CancellationToken::new();
        let since = Instant::now()
            .checked_sub(Duration::from_secs(idle_secs))
            .unwrap_or_else(Instant::now);
        (
            Slot {
                busy: Arc::new(AtomicUsize::new(busy)),
                idle_since: Arc::new(Mutex::new(since)),
                close: close.clone(),
            },
            close,
        )
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room() {
        let counters = Counters::default();
        let mut table = Table::default();
        let (busy, busy_close) = slot(1, 100);
        let (idle_long, long_close) = slot(0, 50);
        let (idle_short, short_close) = slot(0, 5);
        table.slots.insert(0, busy);
        table.slots.insert(1, idle_long);
        table.slots.insert(2, idle_short);
        assert!(table.admit(4, &counters), "below the cap nothing is closed");
        assert_eq!(table.slots.len(), 3);
        assert!(table.admit(3, &counters));
        assert!(long_close.is_cancelled(), "the longest-idle connection is closed");
        assert!(!busy_close.is_cancelled() && !short_close.is_cancelled());
        assert_eq!(counters.evicted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn when_every_connection_is_busy_the_new_one_is_refused() {
        let counters = Counters::default();
        let mut table = Table::default();
        let (busy, busy_close) = slot(2, 100);
        table.slots.insert(0, busy);
        assert!(!table.admit(1, &counters));
        assert!(!busy_close.is_cancelled());
        assert_eq!(counters.refused.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn bodies_are_capped_in_size() {
        let body = http_body_util::Full::new(Bytes::from(vec![0u8; 100]));
        assert!(matches!(
            read_body(body, 10, Duration::from_secs(1)).await,
            Err(BodyError::TooLarge(10))
        ));
        let body = http_body_util::Full::new(Bytes::from_static(b"ok"));
        assert_eq!(
            read_body(body, 10, Duration::from_secs(1)).await.ok(),
            Some(Bytes::from_static(b"ok"))
        );
    }
}
