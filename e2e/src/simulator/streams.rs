//! The simulated kubelet's stream endpoints: `/exec`, `/attach` and `/portForward`, over the
//! protocols real clients speak through an apiserver that only proxies the upgrade:
//!
//! * exec and attach over WebSocket (`v5.channel.k8s.io`, `v4.channel.k8s.io`: one binary
//!   message per chunk, its first byte the channel; v5's channel 255 half-closes stdin) and
//!   over SPDY/3.1 (`X-Stream-Protocol-Version` `v5`/`v4.channel.k8s.io`: one SPDY stream
//!   per channel, named by its `streamType` header). kubectl 1.30+ tries WebSocket v5 first
//!   and falls back to SPDY when the upgrade is refused; older clients speak SPDY only.
//! * port-forward over SPDY (`portforward.k8s.io`: a data and an error stream per
//!   connection, named by `port` and `requestID`), over the WebSocket tunnel kubectl
//!   1.31+ uses (`SPDY/3.1+portforward.k8s.io`: the same SPDY session inside binary
//!   messages) and over WebSocket channels (`v4.channel.k8s.io`, which other clients such as
//!   the official Python one speak: one connection per `port` of the query, on channels
//!   `2i` (data) and `2i + 1` (error), each opened by the port number in two little-endian
//!   bytes; the session closes when every connection has ended). Every `containerPort` of the
//!   pod answers: a connection whose first bytes are an HTTP request gets `200` with
//!   `<namespace>/<pod> port <port>`, anything else is echoed. A port the pod does not
//!   declare is refused on the error stream.
//!
//! What runs for exec is [`super::exec`]'s command set; attach follows the container's
//! simulated log (and echoes stdin when attached with it). The error channel ends every
//! exec and attach with the kubelet's status (`Success`, or `NonZeroExitCode`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, frame::coding::CloseCode};
use tokio_util::sync::CancellationToken;

use super::Inner;
use super::containers;
use super::exec::{self, Context, STDERR, STDOUT};
use super::spdy;
use tensile_common::kubelet::{Body, text};

const CHANNEL_PROTOCOLS: &[&str] = &["v5.channel.k8s.io", "v4.channel.k8s.io"];
const PORT_FORWARD_SPDY: &str = "portforward.k8s.io";
const PORT_FORWARD_TUNNEL: &str = "SPDY/3.1+portforward.k8s.io";
const PORT_FORWARD_CHANNELS: &str = "v4.channel.k8s.io";
/// How long the streams of a SPDY exec may take to arrive (the kubelet's limit).
const STREAM_CREATION: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Exec,
    Attach,
    PortForward,
}

/// The negotiated transport.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Transport {
    WebSocket(String),
    Spdy(String),
}

/// Options of an exec or attach, from the query as the apiserver sends it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Options {
    command: Vec<String>,
    stdin: bool,
    stdout: bool,
    stderr: bool,
    tty: bool,
    /// Port-forward over WebSocket channels: the `port` parameters, in order.
    ports: Vec<String>,
}

fn options(query: &str) -> Options {
    let mut o = Options::default();
    let truthy = |v: &str| matches!(v, "1" | "true" | "True");
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "command" => o.command.push(v.into_owned()),
            "input" | "stdin" => o.stdin = truthy(&v),
            "output" | "stdout" => o.stdout = truthy(&v),
            "error" | "stderr" => o.stderr = truthy(&v),
            "tty" => o.tty = truthy(&v),
            "port" => o.ports.push(v.into_owned()),
            _ => {}
        }
    }
    o
}

/// Every offered value of a header that may be repeated or comma-separated.
fn offers(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The transport for a request: the client's first offer this server supports.
fn negotiate(kind: Kind, headers: &HeaderMap) -> Result<Transport, (StatusCode, String)> {
    let upgrade = offers(headers, "upgrade");
    let (ws_supported, spdy_supported): (&[&str], &[&str]) = match kind {
        Kind::PortForward => (
            &[PORT_FORWARD_TUNNEL, PORT_FORWARD_CHANNELS],
            &[PORT_FORWARD_SPDY],
        ),
        _ => (CHANNEL_PROTOCOLS, CHANNEL_PROTOCOLS),
    };
    let pick = |offered: Vec<String>, supported: &[&str]| {
        offered.iter().find(|o| supported.contains(&o.as_str())).cloned().ok_or_else(|| {
            (
                StatusCode::FORBIDDEN,
                format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports {supported:?}"),
            )
        })
    };
    if upgrade.iter().any(|u| u.eq_ignore_ascii_case("websocket")) {
        let offered = offers(headers, "sec-websocket-protocol");
        // A refused WebSocket upgrade is what makes kubectl fall back to SPDY.
        return pick(offered, ws_supported)
            .map(Transport::WebSocket)
            .map_err(|(_, m)| (StatusCode::BAD_REQUEST, m));
    }
    if upgrade.iter().any(|u| u.eq_ignore_ascii_case("SPDY/3.1")) {
        return pick(offers(headers, "x-stream-protocol-version"), spdy_supported).map(Transport::Spdy);
    }
    Err((
        StatusCode::BAD_REQUEST,
        "Upgrade request required (SPDY/3.1 or websocket)".to_owned(),
    ))
}

/// Serves a stream request if `segments` name one.
pub(super) fn route(
    inner: &Arc<Inner>,
    req: &mut Request<Incoming>,
    segments: &[&str],
) -> Option<Response<Body>> {
    let (kind, rest) = match segments.split_first()? {
        (&"exec", rest) => (Kind::Exec, rest),
        (&"attach", rest) => (Kind::Attach, rest),
        (&"portForward", rest) => (Kind::PortForward, rest),
        _ => return None,
    };
    let (ns, name, uid, container) = match (kind, rest) {
        (Kind::PortForward, [ns, pod]) => (*ns, *pod, None, None),
        (Kind::PortForward, [ns, pod, uid]) => (*ns, *pod, Some(*uid), None),
        (Kind::Exec | Kind::Attach, [ns, pod, c]) => (*ns, *pod, None, Some(*c)),
        (Kind::Exec | Kind::Attach, [ns, pod, uid, c]) => (*ns, *pod, Some(*uid), Some(*c)),
        _ => {
            return Some(text(
                StatusCode::NOT_FOUND,
                format!("/{}: malformed", segments.join("/")),
            ));
        }
    };
    if !matches!(*req.method(), http::Method::GET | http::Method::POST) {
        return Some(text(StatusCode::METHOD_NOT_ALLOWED, "streams take GET or POST"));
    }
    Some(match start(inner, kind, ns, name, uid, container, req) {
        Ok(r) => r,
        Err((code, message)) => {
            let mut r = text(code, message);
            r.headers_mut()
                .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
            r
        }
    })
}

type Refusal = (StatusCode, String);

fn start(
    inner: &Arc<Inner>,
    kind: Kind,
    ns: &str,
    name: &str,
    uid: Option<&str>,
    container: Option<&str>,
    req: &mut Request<Incoming>,
) -> Result<Response<Body>, Refusal> {
    let pod = containers::lookup(inner, ns, name)
        .filter(|p| uid.is_none() || p.metadata.uid.as_deref() == uid)
        .ok_or_else(|| (StatusCode::NOT_FOUND, format!("pod not found (\"{name}_{ns}\")")))?;
    let spec = pod.spec.clone().unwrap_or_default();
    if let Some(c) = container {
        if !spec.containers.iter().any(|x| x.name == c) {
            return Err((StatusCode::NOT_FOUND, format!("container not found (\"{c}\")")));
        }
        let running = containers::container_status(&pod, c)
            .and_then(|s| s.state.as_ref())
            .is_some_and(|s| s.running.is_some());
        if !running {
            return Err((StatusCode::BAD_REQUEST, format!("container not found (\"{c}\")")));
        }
    } else if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("pod not running (\"{name}_{ns}\")"),
        ));
    }
    let transport = negotiate(kind, req.headers())?;
    let opts = options(req.uri().query().unwrap_or(""));
    if kind == Kind::Exec && opts.command.is_empty() {
        return Err((StatusCode::BAD_REQUEST, "missing command".to_owned()));
    }
    if transport == Transport::WebSocket(PORT_FORWARD_CHANNELS.to_owned()) {
        if opts.ports.is_empty() {
            return Err((
                StatusCode::BAD_REQUEST,
                "query parameter \"port\" is required".to_owned(),
            ));
        }
        if let Some(bad) = opts.ports.iter().find(|p| p.parse::<u16>().is_err()) {
            return Err((
                StatusCode::BAD_REQUEST,
                format!("unable to parse \"{bad}\" as a port: invalid port"),
            ));
        }
        // Two channels a port, each numbered by one byte.
        if opts.ports.len() > 128 {
            return Err((
                StatusCode::BAD_REQUEST,
                format!(
                    "{} ports asked for, at most 128 fit the channels",
                    opts.ports.len()
                ),
            ));
        }
    }
    let mut response = Response::new(text(StatusCode::OK, "").into_body());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = response.headers_mut();
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("Upgrade"),
    );
    match &transport {
        Transport::WebSocket(protocol) => {
            let key = req
                .headers()
                .get("sec-websocket-key")
                .ok_or_else(|| (StatusCode::BAD_REQUEST, "Sec-WebSocket-Key missing".to_owned()))?;
            let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
            h.insert(http::header::UPGRADE, http::HeaderValue::from_static("websocket"));
            h.insert("sec-websocket-accept", header_value(&accept)?);
            h.insert("sec-websocket-protocol", header_value(protocol)?);
        }
        Transport::Spdy(protocol) => {
            h.insert(http::header::UPGRADE, http::HeaderValue::from_static("SPDY/3.1"));
            h.insert("x-stream-protocol-version", header_value(protocol)?);
        }
    }
    let upgrade = hyper::upgrade::on(req);
    let job = Job {
        kind,
        pod,
        container: container.unwrap_or_default().to_owned(),
        opts,
        inner: inner.clone(),
    };
    tokio::spawn(async move {
        let io = match upgrade.await {
            Ok(io) => io,
            Err(e) => {
                tracing::debug!(error = %e, "stream upgrade did not complete");
                return;
            }
        };
        match (transport, kind) {
            (Transport::WebSocket(p), Kind::PortForward) => {
                let ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
                if p == PORT_FORWARD_CHANNELS {
                    port_forward_channels(job, ws).await
                } else {
                    port_forward(job, bridge(ws)).await
                }
            }
            (Transport::WebSocket(p), _) => ws_session(job, io, p == "v5.channel.k8s.io").await,
            (Transport::Spdy(_), Kind::PortForward) => port_forward(job, TokioIo::new(io)).await,
            (Transport::Spdy(_), _) => spdy_session(job, io).await,
        }
    });
    Ok(response)
}

fn header_value(s: &str) -> Result<http::HeaderValue, Refusal> {
    http::HeaderValue::from_str(s).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))
}

struct Job {
    kind: Kind,
    pod: Pod,
    container: String,
    opts: Options,
    inner: Arc<Inner>,
}

impl Job {
    fn context(
        &self,
        stdin: Option<mpsc::Receiver<Bytes>>,
        out: mpsc::Sender<(u8, Bytes)>,
        size: watch::Receiver<exec::Size>,
        gone: CancellationToken,
    ) -> Context {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let env = spec
            .containers
            .iter()
            .find(|c| c.name == self.container)
            .and_then(|c| c.env.clone())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|e| e.value.map(|v| (e.name, v)))
            .collect();
        let hostname = spec
            .hostname
            .clone()
            .or_else(|| self.pod.metadata.name.clone())
            .unwrap_or_default();
        Context {
            stdin,
            out,
            size,
            tty: self.opts.tty,
            env,
            hostname,
            gone,
        }
    }

    /// Runs the command (exec) or follows the container (attach); the exit code.
    async fn run(&self, mut ctx: Context) -> i32 {
        match self.kind {
            Kind::Exec => exec::run(&self.opts.command, &mut ctx).await,
            _ => attach(self, ctx).await,
        }
    }

    fn label(&self) -> Vec<String> {
        match self.kind {
            Kind::Exec => self.opts.command.clone(),
            _ => vec!["attach".to_owned()],
        }
    }
}

/// Attach: the container's simulated log lines as they are written, and stdin echoed.
async fn attach(job: &Job, mut ctx: Context) -> i32 {
    let ns = job.pod.metadata.namespace.clone().unwrap_or_default();
    let name = job.pod.metadata.name.clone().unwrap_or_default();
    let Ok(src) = containers::source(&job.pod, &ns, &name, &job.container, false) else {
        return 0;
    };
    let mut next = src.written_by(Timestamp::now());
    let mut stdin_open = ctx.stdin.is_some();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = ctx.gone.cancelled() => return 0,
            chunk = async { match ctx.stdin.as_mut() { Some(s) if stdin_open => s.recv().await, _ => std::future::pending().await } } => {
                match chunk {
                    Some(c) => { let _ = ctx.out.send((STDOUT, c)).await; }
                    None => stdin_open = false,
                }
            }
            _ = tick.tick() => {
                let current = containers::lookup(&job.inner, &ns, &name)
                    .filter(|p| p.metadata.uid == job.pod.metadata.uid);
                let Some(current) = current else { return 0 };
                let Ok(now_src) = containers::source(&current, &ns, &name, &job.container, false) else {
                    return 0;
                };
                if now_src.started != src.started {
                    return 0;
                }
                let upto = now_src.written_by(Timestamp::now());
                let mut chunk = String::new();
                while next < upto {
                    chunk.push_str(&now_src.render(next, false));
                    next += 1;
                }
                if !chunk.is_empty() && ctx.out.send((STDOUT, Bytes::from(chunk))).await.is_err() {
                    return 0;
                }
                if now_src.finished.is_some() {
                    return 0;
                }
            }
        }
    }
}

/// Exec or attach over WebSocket (`v5` when `close_signal`, else `v4`).
async fn ws_session(job: Job, io: Upgraded, close_signal: bool) {
    let ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
    let (mut sink, mut stream) = ws.split();
    let gone = CancellationToken::new();
    let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(16);
    let (size_tx, size_rx) = watch::channel(None);
    let (out_tx, mut out_rx) = mpsc::channel::<(u8, Bytes)>(16);
    let reader_gone = gone.clone();
    let reader = tokio::spawn(async move {
        let mut stdin = Some(stdin_tx);
        while let Some(message) = stream.next().await {
            let data = match message {
                Ok(Message::Binary(b)) => b,
                // The kubelet reads a text message as the same bytes: the official Python
                // client sends a `str` written to stdin as one.
                Ok(Message::Text(t)) => Bytes::from(t),
                Ok(Message::Close(_)) | Err(_) => break,
                // Pings are answered by the library.
                Ok(_) => continue,
            };
            match data.first() {
                Some(0) => {
                    if let Some(tx) = &stdin {
                        let _ = tx.send(data.slice(1..)).await;
                    }
                }
                Some(4) => {
                    if let Some(size) = exec::parse_resize(&data[1..]) {
                        let _ = size_tx.send(Some(size));
                    }
                }
                Some(255) if close_signal && data.get(1) == Some(&0) => stdin = None,
                _ => {}
            }
        }
        reader_gone.cancel();
    });
    let ctx = job.context(job.opts.stdin.then_some(stdin_rx), out_tx, size_rx, gone.clone());
    let tty = job.opts.tty;
    let run = job.run(ctx);
    tokio::pin!(run);
    let mut code = None;
    // Output is sent as it comes; the status follows the last of it.
    loop {
        tokio::select! {
            c = &mut run, if code.is_none() => code = Some(c),
            out = out_rx.recv() => match out {
                Some((channel, data)) => {
                    let (channel, data) = if tty { (STDOUT, exec::onlcr(&data)) } else { (channel, data) };
                    let mut frame = Vec::with_capacity(data.len() + 1);
                    frame.push(channel);
                    frame.extend_from_slice(&data);
                    if sink.send(Message::Binary(frame.into())).await.is_err() {
                        gone.cancel();
                    }
                }
                None => break,
            },
        }
    }
    let code = match code {
        Some(c) => c,
        None => run.await,
    };
    if !gone.is_cancelled() {
        let mut frame = vec![3u8];
        frame.extend_from_slice(exec::status(&job.label(), code).to_string().as_bytes());
        let _ = sink.send(Message::Binary(frame.into())).await;
        let _ = sink
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Normal,
                reason: "".into(),
            })))
            .await;
        // The client answers the close; then the connection ends.
        let _ = tokio::time::timeout(Duration::from_secs(5), gone.cancelled()).await;
    }
    reader.abort();
}

/// Exec or attach over SPDY: the client opens a stream per channel, then the command runs.
async fn spdy_session(job: Job, io: Upgraded) {
    let (mut accepted, writer) = spdy::serve(TokioIo::new(io));
    let o = &job.opts;
    let expected = 1 + [o.stdin, o.stdout, o.stderr, o.tty]
        .iter()
        .filter(|b| **b)
        .count();
    let mut streams: HashMap<String, spdy::Stream> = HashMap::new();
    let collected = tokio::time::timeout(STREAM_CREATION, async {
        while streams.len() < expected {
            let stream = accepted.recv().await?;
            let kind = spdy::header(&stream.headers, "streamtype")
                .unwrap_or_default()
                .to_owned();
            streams.insert(kind, stream);
        }
        Some(())
    })
    .await;
    if !matches!(collected, Ok(Some(()))) {
        tracing::debug!(got = streams.len(), expected, "exec streams did not all arrive");
        writer.close().await;
        return;
    }
    let gone = CancellationToken::new();
    let watcher = gone.clone();
    // The session's end (the client closed the connection) ends what runs.
    tokio::spawn(async move {
        while accepted.recv().await.is_some() {}
        watcher.cancel();
    });
    let (size_tx, size_rx) = watch::channel(None);
    if let Some(mut resize) = streams.remove("resize") {
        tokio::spawn(async move {
            let mut buf = Vec::new();
            while let Some(chunk) = resize.data.recv().await {
                buf.extend_from_slice(&chunk);
                let mut de = serde_json::Deserializer::from_slice(&buf).into_iter::<serde_json::Value>();
                let mut used = 0;
                while let Some(Ok(v)) = de.next() {
                    used = de.byte_offset();
                    if let Some(size) = exec::parse_resize(v.to_string().as_bytes()) {
                        let _ = size_tx.send(Some(size));
                    }
                }
                buf.drain(..used);
            }
        });
    }
    let stdin = streams.remove("stdin").map(|s| s.data);
    let id_of = |name: &str| streams.get(name).map(|s| s.id);
    let (stdout, stderr, error) = (id_of("stdout"), id_of("stderr"), id_of("error"));
    let (out_tx, mut out_rx) = mpsc::channel::<(u8, Bytes)>(16);
    let ctx = job.context(stdin, out_tx, size_rx, gone.clone());
    let tty = job.opts.tty;
    let run = job.run(ctx);
    tokio::pin!(run);
    let mut code = None;
    loop {
        tokio::select! {
            c = &mut run, if code.is_none() => code = Some(c),
            out = out_rx.recv() => match out {
                Some((channel, data)) => {
                    let (id, data) = match (tty, channel) {
                        (true, _) => (stdout, exec::onlcr(&data)),
                        (false, STDERR) => (stderr, data),
                        _ => (stdout, data),
                    };
                    if let Some(id) = id && writer.data(id, &data, false).await.is_err() {
                        gone.cancel();
                    }
                }
                None => break,
            },
        }
    }
    let code = match code {
        Some(c) => c,
        None => run.await,
    };
    if !gone.is_cancelled() {
        for id in [stdout, stderr].into_iter().flatten() {
            let _ = writer.fin(id).await;
        }
        if let Some(id) = error {
            let status = exec::status(&job.label(), code).to_string();
            let _ = writer.data(id, status.as_bytes(), true).await;
        }
        // The client closes the connection once it has read everything.
        let _ = tokio::time::timeout(Duration::from_secs(5), gone.cancelled()).await;
    }
    writer.close().await;
}

/// A WebSocket whose binary messages carry a byte stream (the port-forward tunnel), as a
/// byte stream.
fn bridge(ws: WebSocketStream<TokioIo<Upgraded>>) -> tokio::io::DuplexStream {
    let (ours, theirs) = tokio::io::duplex(256 * 1024);
    let (mut read, mut write) = tokio::io::split(ours);
    let (mut sink, mut stream) = ws.split();
    tokio::spawn(async move {
        while let Some(Ok(message)) = stream.next().await {
            match message {
                Message::Binary(b) if write.write_all(&b).await.is_err() => break,
                Message::Close(_) => break,
                _ => {}
            }
        }
        let _ = write.shutdown().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if sink
                        .send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
        let _ = sink
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Normal,
                reason: "".into(),
            })))
            .await;
    });
    theirs
}

/// Port-forward: each data stream is one connection to a container port.
async fn port_forward<IO>(job: Job, io: IO)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (mut accepted, writer) = spdy::serve(io);
    let ports = declared_ports(&job.pod);
    let (ns, name, uid) = pod_names(&job.pod);
    let mut errors: HashMap<String, u32> = HashMap::new();
    while let Some(stream) = accepted.recv().await {
        let h = &stream.headers;
        let port = spdy::header(h, "port").unwrap_or_default().to_owned();
        let key = spdy::header(h, "requestid").unwrap_or(&port).to_owned();
        match spdy::header(h, "streamtype") {
            Some("error") => {
                errors.insert(key, stream.id);
            }
            Some("data") => {
                let error = errors.remove(&key);
                let writer = writer.clone();
                let parsed = port.parse::<u16>().ok().filter(|p| ports.contains(p));
                let (ns, name, uid) = (ns.clone(), name.clone(), uid.clone());
                tokio::spawn(async move {
                    match parsed {
                        Some(p) => {
                            let id = stream.id;
                            let (out, mut answer) = mpsc::channel::<Bytes>(16);
                            let sending = async {
                                while let Some(chunk) = answer.recv().await {
                                    if writer.data(id, &chunk, false).await.is_err() {
                                        return;
                                    }
                                }
                                let _ = writer.fin(id).await;
                            };
                            tokio::join!(serve_port(stream.data, out, &ns, &name, p), sending);
                        }
                        None => {
                            if let Some(e) = error {
                                let message = refused(&port, &ns, &name, &uid);
                                let _ = writer.data(e, message.as_bytes(), false).await;
                            }
                            let _ = writer.fin(stream.id).await;
                        }
                    }
                    if let Some(e) = error {
                        let _ = writer.fin(e).await;
                    }
                });
            }
            _ => {
                let _ = writer.reset(stream.id).await;
            }
        }
    }
    writer.close().await;
}

/// The ports a pod's containers declare.
fn declared_ports(pod: &Pod) -> Vec<u16> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| u16::try_from(p.container_port).ok())
        .collect()
}

/// A pod's namespace, name and UID.
fn pod_names(pod: &Pod) -> (String, String, String) {
    let m = &pod.metadata;
    (
        m.namespace.clone().unwrap_or_default(),
        m.name.clone().unwrap_or_default(),
        m.uid.clone().unwrap_or_default(),
    )
}

/// The error the kubelet reports for a port nothing listens on.
fn refused(port: &str, ns: &str, name: &str, uid: &str) -> String {
    format!(
        "error forwarding port {port} to pod {name}, uid {uid}: failed to connect to localhost:{port} inside namespace \"{ns}\": connection refused"
    )
}

/// Port-forward over WebSocket channels (`v4.channel.k8s.io`): one connection per `port` of
/// the query, port `i` on data channel `2i` and error channel `2i + 1`; the server opens each
/// channel with the port number (two bytes, little-endian) and closes the session once every
/// connection has ended, as the kubelet does.
async fn port_forward_channels(job: Job, ws: WebSocketStream<TokioIo<Upgraded>>) {
    let declared = declared_ports(&job.pod);
    let (ns, name, uid) = pod_names(&job.pod);
    let (mut sink, mut stream) = ws.split();
    // `start` refused a query with a port that does not parse or too many for the channels.
    let ports: Vec<u16> = job.opts.ports.iter().filter_map(|p| p.parse().ok()).collect();
    let channels = |i: usize| (2 * i as u8, 2 * i as u8 + 1);
    for (i, port) in ports.iter().enumerate() {
        let (data, error) = channels(i);
        for channel in [data, error] {
            let opening = framed(channel, &port.to_le_bytes());
            if sink.send(Message::Binary(opening)).await.is_err() {
                return;
            }
        }
    }
    let (frames, mut outgoing) = mpsc::channel::<Bytes>(16);
    let mut inputs = Vec::new();
    let mut connections = Vec::new();
    for (i, port) in ports.into_iter().enumerate() {
        let (data, error) = channels(i);
        let (input, received) = mpsc::channel::<Bytes>(16);
        inputs.push(input);
        let frames = frames.clone();
        let (ns, name, uid) = (ns.clone(), name.clone(), uid.clone());
        let served = declared.contains(&port).then_some(port);
        connections.push(tokio::spawn(async move {
            let Some(p) = served else {
                let message = refused(&port.to_string(), &ns, &name, &uid);
                let _ = frames.send(framed(error, message.as_bytes())).await;
                return;
            };
            let (out, mut answer) = mpsc::channel::<Bytes>(16);
            let sending = async {
                while let Some(chunk) = answer.recv().await {
                    if frames.send(framed(data, &chunk)).await.is_err() {
                        return;
                    }
                }
            };
            tokio::join!(serve_port(received, out, &ns, &name, p), sending);
        }));
    }
    drop(frames);
    // Client frames go to their port's connection; a frame on an error channel or on no
    // channel of this session is ignored, as the kubelet ignores it.
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = stream.next().await {
            match message {
                Message::Binary(b) if b.len() > 1 && b[0] % 2 == 0 => {
                    if let Some(input) = inputs.get(usize::from(b[0] / 2)) {
                        let _ = input.send(b.slice(1..)).await;
                    }
                }
                Message::Close(_) => break,
                _ => {}
            }
        }
    });
    while let Some(frame) = outgoing.recv().await {
        if sink.send(Message::Binary(frame)).await.is_err() {
            break;
        }
    }
    // The client is gone or every connection has ended: nothing more is sent.
    drop(outgoing);
    for connection in connections {
        let _ = connection.await;
    }
    let _ = sink
        .send(Message::Close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        })))
        .await;
    reader.abort();
}

/// `data` behind its channel byte.
fn framed(channel: u8, data: &[u8]) -> Bytes {
    let mut frame = Vec::with_capacity(data.len() + 1);
    frame.push(channel);
    frame.extend_from_slice(data);
    Bytes::from(frame)
}

/// One connection to a simulated container port, as what the client sends (`incoming`, ending
/// when the client closes its side) and what the port answers (`out`, closed at the end): HTTP
/// when it starts like an HTTP request, an echo otherwise.
async fn serve_port(
    mut incoming: mpsc::Receiver<Bytes>,
    out: mpsc::Sender<Bytes>,
    ns: &str,
    name: &str,
    port: u16,
) {
    let Some(first) = incoming.recv().await else {
        return;
    };
    let is_http = ["GET ", "POST ", "HEAD ", "PUT ", "DELETE ", "OPTIONS ", "PATCH "]
        .iter()
        .any(|m| first.starts_with(m.as_bytes()));
    if !is_http {
        let mut chunk = Some(first);
        while let Some(c) = chunk {
            if out.send(c).await.is_err() {
                return;
            }
            chunk = incoming.recv().await;
        }
        return;
    }
    let mut request = first.to_vec();
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 64 * 1024 {
        match incoming.recv().await {
            Some(c) => request.extend_from_slice(&c),
            None => break,
        }
    }
    let body = format!("{ns}/{name} port {port}\n");
    let head = request.starts_with(b"HEAD ");
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head { "" } else { body.as_str() }
    );
    let _ = out.send(Bytes::from(response)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_first_supported_offer_wins() {
        let ws = headers(&[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Protocol", "v5.channel.k8s.io, v4.channel.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::Exec, &ws),
            Ok(Transport::WebSocket("v5.channel.k8s.io".into()))
        );
        let spdy = headers(&[
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
            ("X-Stream-Protocol-Version", "v3.channel.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::Attach, &spdy),
            Ok(Transport::Spdy("v4.channel.k8s.io".into()))
        );
        let tunnel = headers(&[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Protocol", "SPDY/3.1+portforward.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::PortForward, &tunnel),
            Ok(Transport::WebSocket(PORT_FORWARD_TUNNEL.into()))
        );
        // The official Python client offers the exec protocols for port-forward too.
        let channels = headers(&[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Protocol", "v5.channel.k8s.io,v4.channel.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::PortForward, &channels),
            Ok(Transport::WebSocket(PORT_FORWARD_CHANNELS.into()))
        );
        let old = headers(&[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Protocol", "channel.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::Exec, &old).unwrap_err().0,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            negotiate(Kind::Exec, &HeaderMap::new()).unwrap_err().0,
            StatusCode::BAD_REQUEST
        );
        let pf = headers(&[
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "portforward.k8s.io"),
        ]);
        assert_eq!(
            negotiate(Kind::PortForward, &pf),
            Ok(Transport::Spdy(PORT_FORWARD_SPDY.into()))
        );
    }

    #[test]
    fn exec_options_read_as_the_apiserver_writes_them() {
        let o = options("command=sh&command=-c&command=exit%203&input=1&output=1&tty=1");
        assert_eq!(o.command, vec!["sh", "-c", "exit 3"]);
        assert!(o.stdin && o.stdout && !o.stderr && o.tty);
        assert_eq!(options("port=8080&port=9090").ports, vec!["8080", "9090"]);
    }
}
