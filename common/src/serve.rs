//! The one HTTPS server of the suite (the webhook, the kubelet API of a virtual node, the
//! multi-scheduler's extender), hardened against clients that connect and then do little:
//!
//! * **a connection cap** ([`Limits::max_connections`]): at the cap, a new connection takes
//!   the place of the connection that has been idle longest (no request in progress), so
//!   idle or slow clients cannot lock out the apiserver; when every connection is busy, the
//!   new one is closed at once. Descriptors and memory stay bounded either way.
//! * **a TLS handshake deadline** ([`Limits::handshake`]);
//! * **a header deadline** ([`Limits::header`], 32 s as kube-apiserver's): once bytes of a
//!   request head arrive, the head must be complete within it, or the connection is closed.
//!   For HTTP/1.1 the clock starts at the first byte (TLS record bytes included) received
//!   while no request is in progress, and stops when a request starts; for HTTP/2 it runs
//!   from the first byte of a frame until that frame, or the header block it opens
//!   (HEADERS and its CONTINUATIONs), is whole. A client trickling a header a byte at a
//!   time is closed by it, however long its idle deadline;
//! * **an idle deadline** ([`Limits::idle`]): a connection with no request in progress for
//!   that long is closed. This covers a client that never sends a request and HTTP/1.1
//!   keep-alive or HTTP/2 connections left open. A streamed response (`kubectl logs -f`) is
//!   a request in progress for as long as it streams.
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
    /// Time from the first byte of a request head (for HTTP/2, of a frame) to its end,
    /// independent of `idle`.
    pub header: Duration,
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
    /// The kubelet's own server closes idle connections after 90 s; here a minute. A request
    /// head gets 32 s, kube-apiserver's `ReadHeaderTimeout`. 1,024 connections is far above
    /// what an apiserver opens to one endpoint.
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(60),
            header: DEFAULT_HEADER_DEADLINE,
            max_header_bytes: 64 * 1024,
            max_streams: 250,
            connection_window: 1024 * 1024,
            connection_body_bytes: 8 * 1024 * 1024,
            server_body_bytes: 64 * 1024 * 1024,
        }
    }
}

/// The default [`Limits::header`].
pub const DEFAULT_HEADER_DEADLINE: Duration = Duration::from_secs(32);

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
    /// Connections closed by the handshake, header or idle deadline.
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
            let activity = Activity {
                busy,
                idle_since,
                heads: Arc::default(),
            };
            connection(
                tcp, addr, acceptor, handler, &limits, &counters, activity, close, stopping, bodies,
            )
            .await;
            table.lock().unwrap_or_else(|e| e.into_inner()).slots.remove(&id);
            counters.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// A connection's requests in progress, when it last had none, and the request head it is
/// receiving.
#[derive(Clone)]
struct Activity {
    busy: Arc<AtomicUsize>,
    idle_since: Arc<Mutex<Instant>>,
    heads: Arc<Mutex<Heads>>,
}

impl Activity {
    fn start(&self) -> InProgress {
        self.heads().started();
        self.busy.fetch_add(1, Ordering::AcqRel);
        InProgress(self.clone())
    }

    fn heads(&self) -> std::sync::MutexGuard<'_, Heads> {
        self.heads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long the request head in progress has been arriving, if one is.
    fn head_for(&self) -> Option<Duration> {
        self.heads().since.map(|since| since.elapsed())
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

/// The first bytes of an HTTP/2 connection.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection has received of a request head that is not whole yet (see
/// [`Limits::header`]). Bytes are seen twice: as they arrive on the wire ([`Heads::arrived`],
/// TLS records included, so a record trickled a byte at a time counts) and as plain text
/// after TLS ([`Heads::received`]), where HTTP/2 frames are followed.
#[derive(Default)]
struct Heads {
    /// When the bytes not yet making up a whole head (HTTP/1.1) or frame (HTTP/2) began.
    since: Option<Instant>,
    framing: Framing,
}

enum Framing {
    /// Not known yet: this many bytes of the HTTP/2 preface have been received.
    Sniffing(usize),
    Http1,
    Http2(Frames),
}

impl Default for Framing {
    fn default() -> Self {
        Framing::Sniffing(0)
    }
}

/// Where an HTTP/2 connection's incoming frames stand.
#[derive(Default)]
struct Frames {
    header: [u8; 9],
    /// Bytes of the current frame's 9-byte header received.
    filled: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// The current frame is HEADERS or CONTINUATION, and carries END_HEADERS.
    block: bool,
    ends_block: bool,
    /// A header block has begun and its END_HEADERS frame has not come yet.
    open_block: bool,
}

impl Heads {
    /// Bytes arrived on the wire. For HTTP/1.1 they start the clock only between requests
    /// (while one is in progress they are its body, or a pipelined request); an HTTP/2
    /// connection carries many streams, so any byte does, until its frame is whole.
    fn arrived(&mut self, idle: bool) {
        let counts = matches!(self.framing, Framing::Http2(_)) || idle;
        if counts && self.since.is_none() {
            self.since = Some(Instant::now());
        }
    }

    /// The TLS handshake is done: its bytes were no request.
    fn handshake_done(&mut self) {
        self.since = None;
    }

    /// A request started: for HTTP/1.1 its head is whole. HTTP/2 heads are judged by their
    /// frames, since another stream's head may already be arriving.
    fn started(&mut self) {
        if !matches!(self.framing, Framing::Http2(_)) {
            self.since = None;
        }
    }

    /// Plain text received after TLS.
    fn received(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match &mut self.framing {
                Framing::Http1 => return,
                Framing::Sniffing(seen) => {
                    let want = &H2_PREFACE[*seen..];
                    let n = want.len().min(bytes.len());
                    if bytes[..n] != want[..n] {
                        self.framing = Framing::Http1;
                        return;
                    }
                    *seen += n;
                    bytes = &bytes[n..];
                    if *seen == H2_PREFACE.len() {
                        self.framing = Framing::Http2(Frames::default());
                        self.since = None;
                    }
                }
                Framing::Http2(frames) => {
                    if frames.filled < frames.header.len() {
                        let n = (frames.header.len() - frames.filled).min(bytes.len());
                        frames.header[frames.filled..frames.filled + n].copy_from_slice(&bytes[..n]);
                        frames.filled += n;
                        bytes = &bytes[n..];
                        if frames.filled < frames.header.len() {
                            return;
                        }
                        let [l0, l1, l2, kind, flags, ..] = frames.header;
                        frames.payload_left = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
                        // HEADERS (1) and CONTINUATION (9) carry a header block; flag 0x4 ends it.
                        frames.block = kind == 0x1 || kind == 0x9;
                        frames.ends_block = frames.block && flags & 0x4 != 0;
                    }
                    let n = frames.payload_left.min(bytes.len());
                    frames.payload_left -= n;
                    bytes = &bytes[n..];
                    if frames.payload_left > 0 {
                        return;
                    }
                    // The frame is whole.
                    if frames.block {
                        frames.open_block = !frames.ends_block;
                    }
                    frames.filled = 0;
                    if !frames.open_block {
                        self.since = None;
                    }
                }
            }
        }
    }
}

/// A connection's stream, below TLS ([`Layer::Wire`]) or above it ([`Layer::Plain`]),
/// telling [`Heads`] what it reads.
struct Watched<IO> {
    io: IO,
    activity: Activity,
    layer: Layer,
}

#[derive(Clone, Copy)]
enum Layer {
    Wire,
    Plain,
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let idle = self.activity.busy.load(Ordering::Acquire) == 0;
            let mut heads = self.activity.heads();
            match self.layer {
                Layer::Wire => heads.arrived(idle),
                Layer::Plain => heads.received(&buf.filled()[before..]),
            }
        }
        poll
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
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
    let tcp = Watched {
        io: tcp,
        activity: activity.clone(),
        layer: Layer::Wire,
    };
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
    activity.heads().handshake_done();
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
    // hyper's header timer runs from the moment it waits for a head, keep-alive idleness
    // included, so it can only be the idle deadline; `Heads` keeps the header deadline.
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
    let tls = Watched {
        io: tls,
        activity: activity.clone(),
        layer: Layer::Plain,
    };
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::pin!(conn);
    let check = (limits.idle.min(limits.header) / 4).max(Duration::from_millis(100));
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
                if activity.head_for().is_some_and(|head| head >= limits.header) {
                    counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%addr, "request head not received in time; connection closed");
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

    #[test]
    fn the_header_deadline_defaults_to_kube_apiservers() {
        assert_eq!(Limits::default().header, Duration::from_secs(32));
        assert_eq!(DEFAULT_HEADER_DEADLINE, Duration::from_secs(32));
        assert!(Limits::default().header < Limits::default().idle);
    }

    /// An HTTP/2 frame header: payload length, type, flags; stream 1 but for the
    /// connection's own frames (SETTINGS, PING), which are on stream 0.
    fn frame(len: usize, kind: u8, flags: u8) -> Vec<u8> {
        let l = len.to_be_bytes();
        let stream = u8::from(!matches!(kind, 0x4 | 0x6));
        vec![l[5], l[6], l[7], kind, flags, 0, 0, 0, stream]
    }

    #[test]
    fn http2_heads_run_from_a_frames_first_byte_to_the_end_of_its_header_block() {
        let mut heads = Heads::default();
        heads.arrived(true);
        heads.received(H2_PREFACE);
        assert!(heads.since.is_none(), "the preface is no request");
        heads.arrived(true);
        heads.received(&frame(0, 0x4, 0));
        assert!(heads.since.is_none(), "an empty SETTINGS frame is whole");
        // A HEADERS frame without END_HEADERS, then its CONTINUATION, in pieces.
        heads.arrived(false);
        let mut block = frame(3, 0x1, 0);
        block.extend_from_slice(b"abc");
        heads.received(&block[..5]);
        assert!(heads.since.is_some(), "a frame header in progress");
        heads.received(&block[5..]);
        assert!(heads.since.is_some(), "the block is still open");
        heads.started();
        assert!(
            heads.since.is_some(),
            "another stream starting does not end this head"
        );
        let mut end = frame(2, 0x9, 0x4);
        end.extend_from_slice(b"de");
        heads.received(&end);
        assert!(heads.since.is_none(), "END_HEADERS closes the block");
        // A DATA frame trickled: its clock runs until it is whole.
        heads.arrived(false);
        heads.received(&frame(4, 0x0, 0));
        heads.received(b"xy");
        assert!(heads.since.is_some());
        heads.received(b"zw");
        assert!(heads.since.is_none());
    }

    #[test]
    fn http1_heads_run_between_requests_only() {
        let mut heads = Heads::default();
        heads.arrived(true);
        heads.handshake_done();
        assert!(heads.since.is_none(), "the handshake is no request");
        heads.arrived(true);
        heads.received(b"GET / HT");
        assert!(matches!(heads.framing, Framing::Http1));
        assert!(heads.since.is_some());
        heads.started();
        assert!(heads.since.is_none());
        heads.arrived(false);
        assert!(
            heads.since.is_none(),
            "a body or a pipelined request while one is in progress"
        );
    }

    /// A loopback server answering every request `ok`, with `limits`, and a client
    /// configuration trusting it that offers `alpn`.
    async fn loopback(
        limits: Limits,
        alpn: &[u8],
    ) -> (
        SocketAddr,
        Arc<Counters>,
        CancellationToken,
        tokio_rustls::TlsConnector,
    ) {
        use rustls::pki_types::pem::PemObject as _;
        let signed = crate::tls::self_signed(&["127.0.0.1".into()]).unwrap();
        let config = crate::tls::server_config(crate::tls::CertResolver::new(signed.key)).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            config,
            limits,
            counters.clone(),
            stop.clone(),
            |_request, _peer| async { text(hyper::StatusCode::OK, "ok") },
        ));
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(signed.ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut client =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        client.alpn_protocols = vec![alpn.to_vec()];
        (
            addr,
            counters,
            stop,
            tokio_rustls::TlsConnector::from(Arc::new(client)),
        )
    }

    type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

    async fn connect(addr: SocketAddr, connector: &tokio_rustls::TlsConnector) -> Tls {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        connector.connect(name, tcp).await.unwrap()
    }

    /// Writes `bytes` one at a time every `every`, forever, while waiting for the server to
    /// close the connection; how long after the first byte it did.
    async fn trickle(tls: Tls, bytes: Vec<u8>, every: Duration) -> Duration {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut reader, mut writer) = tokio::io::split(tls);
        let started = Instant::now();
        let write = async {
            for byte in bytes.iter().cycle() {
                if writer.write_all(&[*byte]).await.is_err() || writer.flush().await.is_err() {
                    break;
                }
                tokio::time::sleep(every).await;
            }
            std::future::pending::<()>().await;
        };
        let closed = async {
            let mut buf = [0u8; 4096];
            // The server's own frames (HTTP/2 SETTINGS) are read and dropped.
            while matches!(reader.read(&mut buf).await, Ok(n) if n > 0) {}
        };
        tokio::select! {
            _ = write => {}
            _ = closed => {}
        }
        started.elapsed()
    }

    /// One HTTP/1.1 request on `tls`; the status line of the answer.
    async fn get(tls: &mut Tls) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        tls.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        tls.flush().await.unwrap();
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    }

    fn short_header() -> Limits {
        Limits {
            header: Duration::from_secs(1),
            idle: Duration::from_secs(30),
            ..Limits::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clients_trickling_a_header_are_closed_at_the_header_deadline_while_others_are_served() {
        let limits = short_header();
        let (addr, counters, stop, connector) = loopback(limits.clone(), b"http/1.1").await;
        // A keep-alive connection that asked once and is now silent: idle, not a head.
        let mut quiet = connect(addr, &connector).await;
        assert_eq!(get(&mut quiet).await, "HTTP/1.1 200 OK");
        let mut trickling = tokio::task::JoinSet::new();
        for _ in 0..60 {
            let tls = connect(addr, &connector).await;
            trickling.spawn(trickle(
                tls,
                b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ".to_vec(),
                Duration::from_millis(100),
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut fresh = connect(addr, &connector).await;
        assert_eq!(
            get(&mut fresh).await,
            "HTTP/1.1 200 OK",
            "served during the trickle"
        );
        // The deadline, plus the check period (a quarter of it) and a margin for a busy machine.
        let bound = limits.header + limits.header / 4 + Duration::from_millis(1500);
        let mut closed = 0;
        while let Some(lasted) = trickling.join_next().await {
            let lasted = lasted.unwrap();
            assert!(lasted >= limits.header, "closed before the deadline: {lasted:?}");
            assert!(
                lasted <= bound,
                "a trickling client lasted {lasted:?}, over {bound:?}"
            );
            closed += 1;
        }
        assert_eq!(closed, 60);
        assert!(counters.timed_out.load(Ordering::Relaxed) >= 60);
        // Far past the header deadline, the quiet keep-alive connection is still served.
        assert_eq!(get(&mut quiet).await, "HTTP/1.1 200 OK", "idle is not a head");
        stop.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http2_header_block_trickled_is_closed_and_control_frames_are_not_a_head() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let limits = short_header();
        let (addr, _counters, stop, connector) = loopback(limits.clone(), b"h2").await;
        let mut opening = H2_PREFACE.to_vec();
        opening.extend(frame(0, 0x4, 0));
        // Preface and SETTINGS at once, then a PING now and then: never a head.
        let mut quiet = connect(addr, &connector).await;
        quiet.write_all(&opening).await.unwrap();
        let mut trickled = connect(addr, &connector).await;
        trickled.write_all(&opening).await.unwrap();
        trickled.flush().await.unwrap();
        let mut headers = frame(40, 0x1, 0x4);
        headers.extend([0u8; 40]);
        let lasted = tokio::spawn(trickle(trickled, headers, Duration::from_millis(100)));
        let started = Instant::now();
        let mut buf = [0u8; 4096];
        while started.elapsed() < limits.header * 3 {
            let mut ping = frame(8, 0x6, 0);
            ping.extend([7u8; 8]);
            quiet.write_all(&ping).await.unwrap();
            quiet.flush().await.unwrap();
            // Read what the server sends (SETTINGS, ACKs) until a pause: a close ends the test.
            loop {
                match tokio::time::timeout(Duration::from_millis(300), quiet.read(&mut buf)).await {
                    Err(_) => break,
                    Ok(Ok(n)) if n > 0 => continue,
                    Ok(other) => panic!("the quiet HTTP/2 connection was closed: {other:?}"),
                }
            }
        }
        let lasted = lasted.await.unwrap();
        let bound = limits.header + limits.header / 4 + Duration::from_millis(1500);
        assert!(
            lasted >= limits.header && lasted <= bound,
            "the trickled HEADERS frame lasted {lasted:?}"
        );
        stop.cancel();
    }
}
