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
//! * **body budgets** ([`Bodies::read`], for handlers): a body is read whole within a size
//!   cap and a deadline, and the bytes it holds count against its connection's budget
//!   ([`Limits::connection_body_bytes`]) and the server's ([`Limits::server_body_bytes`]) until
//!   the handler drops it. HTTP/2 lets one connection upload on hundreds of streams at once and
//!   a handler reading a body frees flow-control window as it goes, so without a budget one
//!   client could make the server hold `streams x max body` bytes. A body that finds no room
//!   within its deadline is refused as [`BodyError::Busy`].
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
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
    /// Bytes of request bodies the handlers may hold at once for one connection; at least
    /// the largest body a handler accepts.
    pub connection_body_bytes: usize,
    /// Bytes of request bodies the handlers may hold at once for the whole server.
    pub server_body_bytes: usize,
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
            connection_body_bytes: 8 * 1024 * 1024,
            server_body_bytes: 64 * 1024 * 1024,
        }
    }
}

/// Largest HTTP/2 frame a client may send (the protocol's default): a handler waiting for
/// body budget holds at most one frame per stream, so one connection makes the server hold at
/// most `connection_body_bytes + max_streams x this + connection_window` of request bodies.
pub const H2_FRAME_BYTES: u32 = 16 * 1024;

/// Who sent a request.
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The certificate chain the client presented, leaf first, when the TLS configuration
    /// verified it; `None` without one.
    pub certificates: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// Where the request bodies of this connection are read, within its budget.
    pub bodies: Bodies,
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
    /// KiB of request bodies handlers hold now.
    pub body_kib_held: AtomicU64,
    /// Request bodies refused because their connection or the server held its budget.
    pub bodies_refused: AtomicU64,
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
    let server_bodies = Arc::new(Semaphore::new(kib(limits.server_body_bytes)));
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
        let bodies = Bodies {
            connection: Arc::new(Semaphore::new(kib(limits.connection_body_bytes))),
            server: server_bodies.clone(),
            counters: counters.clone(),
        };
        tokio::spawn(async move {
            let activity = Activity { busy, idle_since };
            connection(
                tcp, addr, acceptor, handler, &limits, &counters, activity, close, stopping, bodies,
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
    bodies: Bodies,
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
    let peer = Peer {
        addr,
        certificates,
        bodies,
    };
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
        .max_frame_size(H2_FRAME_BYTES)
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
    #[error("the server holds as many request bodies as it may; try again (waited {0:?})")]
    Busy(Duration),
    #[error("reading the request body: {0}")]
    Read(String),
}

/// Budgets are counted in KiB, a semaphore permit each.
fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024).min(Semaphore::MAX_PERMITS)
}

/// The request-body budgets of one connection: its own, and the server's it shares.
#[derive(Clone, Debug)]
pub struct Bodies {
    connection: Arc<Semaphore>,
    server: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl Bodies {
    /// Budgets of their own, for a handler called outside [`serve`] (tests).
    pub fn unshared(connection_bytes: usize, server_bytes: usize) -> Bodies {
        Bodies {
            connection: Arc::new(Semaphore::new(kib(connection_bytes))),
            server: Arc::new(Semaphore::new(kib(server_bytes))),
            counters: Arc::default(),
        }
    }

    /// Reads a whole request body of at most `max_bytes` within `deadline`, each KiB taken
    /// from the connection's budget and then the server's as it arrives; the bytes stay
    /// counted until the returned [`HeldBody`] is dropped.
    pub async fn read<B>(&self, body: B, max_bytes: usize, deadline: Duration) -> Result<HeldBody, BodyError>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let until = tokio::time::Instant::now() + deadline;
        let mut body = std::pin::pin!(body);
        let mut buf = bytes::BytesMut::new();
        let mut held = HeldBody {
            bytes: Bytes::new(),
            connection: None,
            server: None,
            kib: 0,
            counters: self.counters.clone(),
        };
        loop {
            let frame = match tokio::time::timeout_at(until, body.frame()).await {
                Err(_) => return Err(BodyError::TooSlow(deadline)),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(BodyError::Read(e.into().to_string())),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let len = buf.len() + data.len();
            if len > max_bytes {
                return Err(BodyError::TooLarge(max_bytes));
            }
            let more = kib(len) - held.kib;
            if more > 0 {
                let more = u32::try_from(more).map_err(|_| BodyError::TooLarge(max_bytes))?;
                for (budget, slot) in [
                    (&self.connection, &mut held.connection),
                    (&self.server, &mut held.server),
                ] {
                    let permit =
                        match tokio::time::timeout_at(until, budget.clone().acquire_many_owned(more)).await {
                            Ok(Ok(permit)) => permit,
                            _ => {
                                self.counters.bodies_refused.fetch_add(1, Ordering::Relaxed);
                                return Err(BodyError::Busy(deadline));
                            }
                        };
                    match slot {
                        Some(p) => p.merge(permit),
                        None => *slot = Some(permit),
                    }
                }
                held.kib += more as usize;
                self.counters
                    .body_kib_held
                    .fetch_add(u64::from(more), Ordering::Relaxed);
            }
            buf.extend_from_slice(&data);
        }
        held.bytes = buf.freeze();
        Ok(held)
    }
}

/// A request body read whole, counted against its budgets until dropped.
#[derive(Debug)]
pub struct HeldBody {
    bytes: Bytes,
    connection: Option<OwnedSemaphorePermit>,
    server: Option<OwnedSemaphorePermit>,
    kib: usize,
    counters: Arc<Counters>,
}

impl std::ops::Deref for HeldBody {
    type Target = Bytes;

    fn deref(&self) -> &Bytes {
        &self.bytes
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        self.counters
            .body_kib_held
            .fetch_sub(self.kib as u64, Ordering::Relaxed);
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

    fn full(bytes: usize) -> http_body_util::Full<Bytes> {
        http_body_util::Full::new(Bytes::from(vec![7u8; bytes]))
    }

    #[tokio::test]
    async fn bodies_are_capped_in_size() {
        let bodies = Bodies::unshared(1 << 20, 1 << 20);
        assert!(matches!(
            bodies.read(full(100), 10, Duration::from_secs(1)).await,
            Err(BodyError::TooLarge(10))
        ));
        let body = http_body_util::Full::new(Bytes::from_static(b"ok"));
        let held = bodies.read(body, 10, Duration::from_secs(1)).await.unwrap();
        assert_eq!(&held[..], b"ok");
    }

    #[tokio::test]
    async fn a_connection_holds_its_budget_of_bodies_at_most_and_gets_it_back_on_drop() {
        let server = Arc::new(Semaphore::new(kib(64 << 10)));
        let counters = Arc::new(Counters::default());
        let connection = |bytes| Bodies {
            connection: Arc::new(Semaphore::new(kib(bytes))),
            server: server.clone(),
            counters: counters.clone(),
        };
        let (one, other) = (connection(16 << 10), connection(16 << 10));
        let wait = Duration::from_millis(200);
        let first = one.read(full(10 << 10), 16 << 10, wait).await.unwrap();
        assert_eq!(counters.body_kib_held.load(Ordering::Relaxed), 10);
        // The same connection has 6 KiB left: a second 10 KiB body waits, then is refused.
        assert!(matches!(
            one.read(full(10 << 10), 16 << 10, wait).await,
            Err(BodyError::Busy(_))
        ));
        // Another connection has its own budget.
        let second = other.read(full(10 << 10), 16 << 10, wait).await.unwrap();
        assert_eq!(counters.body_kib_held.load(Ordering::Relaxed), 20);
        drop(first);
        assert!(one.read(full(10 << 10), 16 << 10, wait).await.is_ok());
        drop(second);
        assert_eq!(counters.body_kib_held.load(Ordering::Relaxed), 0);
        assert_eq!(counters.bodies_refused.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn the_server_budget_bounds_every_connection_together() {
        let server = Arc::new(Semaphore::new(kib(24 << 10)));
        let counters = Arc::new(Counters::default());
        let connections: Vec<Bodies> = (0..3)
            .map(|_| Bodies {
                connection: Arc::new(Semaphore::new(kib(16 << 10))),
                server: server.clone(),
                counters: counters.clone(),
            })
            .collect();
        let wait = Duration::from_millis(200);
        let a = connections[0].read(full(12 << 10), 16 << 10, wait).await.unwrap();
        let b = connections[1].read(full(12 << 10), 16 << 10, wait).await.unwrap();
        assert!(matches!(
            connections[2].read(full(1 << 10), 16 << 10, wait).await,
            Err(BodyError::Busy(_))
        ));
        drop((a, b));
        assert!(connections[2].read(full(1 << 10), 16 << 10, wait).await.is_ok());
    }
}
