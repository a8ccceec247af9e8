//! `kubectl exec`, `attach` and `port-forward` through the virtual node: a splice of bytes.
//!
//! The upper apiserver proxies the client's upgrade request to the kubelet API unchanged:
//! WebSocket (`Sec-WebSocket-Protocol: v5.channel.k8s.io`, or the port-forward tunnel
//! `SPDY/3.1+portforward.k8s.io`) or SPDY/3.1 (`X-Stream-Protocol-Version` offers). The
//! virtual node opens the same upgrade on the lower apiserver's `pods/exec`, `pods/attach` or
//! `pods/portforward` for the lower pod, with the lower credentials and the client's offers,
//! answers with the lower side's `101` and negotiated protocol, then copies bytes both ways
//! until either side closes. It never parses a frame: whatever the client and the lower
//! kubelet agreed on travels through, half-closes included.
//!
//! Refusals read like a local pod's: a pod this node does not run (or another UID) is 404;
//! what the lower cluster refuses keeps its code and message (404 for an unknown pod or
//! container, 400 for a container that is not running); an unreachable lower apiserver is
//! 503. Every refusal is a `metav1.Status`, which kubectl prints as `Error from server`.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;
use tensile_common::kubelet::Body;

use crate::metrics::Metrics;

/// What a stream request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Exec,
    Attach,
    PortForward,
}

impl Kind {
    /// The lower apiserver's pod subresource.
    pub fn subresource(self) -> &'static str {
        match self {
            Kind::Exec => "exec",
            Kind::Attach => "attach",
            Kind::PortForward => "portforward",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Exec => "exec",
            Kind::Attach => "attach",
            Kind::PortForward => "port-forward",
        }
    }
}

/// A parsed kubelet stream path: `/exec|attach/{ns}/{pod}[/{uid}]/{container}` or
/// `/portForward/{ns}/{pod}[/{uid}]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub kind: Kind,
    pub namespace: String,
    pub pod: String,
    pub uid: Option<String>,
    pub container: Option<String>,
}

/// `None` when the path is no stream path; `Err` when it is one, malformed.
pub fn parse_path(segments: &[&str]) -> Option<Result<Target, String>> {
    let (kind, rest) = match segments.split_first()? {
        (&"exec", rest) => (Kind::Exec, rest),
        (&"attach", rest) => (Kind::Attach, rest),
        (&"portForward", rest) => (Kind::PortForward, rest),
        _ => return None,
    };
    let target = |ns: &str, pod: &str, uid: Option<&str>, container: Option<&str>| {
        if [Some(ns), Some(pod), uid, container]
            .iter()
            .flatten()
            .any(|s| s.is_empty())
        {
            return Err(format!("/{}: empty path segment", segments.join("/")));
        }
        Ok(Target {
            kind,
            namespace: ns.to_owned(),
            pod: pod.to_owned(),
            uid: uid.map(str::to_owned),
            container: container.map(str::to_owned),
        })
    };
    Some(match (kind, rest) {
        (Kind::PortForward, [ns, pod]) => target(ns, pod, None, None),
        (Kind::PortForward, [ns, pod, uid]) => target(ns, pod, Some(uid), None),
        (Kind::Exec | Kind::Attach, [ns, pod, container]) => target(ns, pod, None, Some(container)),
        (Kind::Exec | Kind::Attach, [ns, pod, uid, container]) => target(ns, pod, Some(uid), Some(container)),
        (Kind::PortForward, _) => Err("expected /portForward/{namespace}/{pod}[/{uid}]".to_owned()),
        (_, _) => Err(format!(
            "expected /{}/{{namespace}}/{{pod}}[/{{uid}}]/{{container}}",
            segments[0]
        )),
    })
}

fn truthy(value: &str) -> bool {
    matches!(value, "1" | "true" | "True" | "TRUE")
}

/// The lower apiserver's query for a kubelet query: `input/output/error` become
/// `stdin/stdout/stderr`, `tty` and `command` stay, the container comes from the path,
/// `port` becomes `ports`. Unknown parameters are dropped.
pub fn lower_query(target: &Target, kubelet_query: &str) -> Result<String, String> {
    let mut out = form_urlencoded::Serializer::new(String::new());
    let mut commands = 0;
    for (key, value) in form_urlencoded::parse(kubelet_query.as_bytes()) {
        let flag = |name: &str| {
            (
                name.to_owned(),
                if truthy(&value) { "true" } else { "false" }.to_owned(),
            )
        };
        let mapped = match (target.kind, key.as_ref()) {
            (Kind::Exec, "command") => {
                commands += 1;
                Some(("command".to_owned(), value.to_string()))
            }
            (Kind::Exec | Kind::Attach, "input" | "stdin") => Some(flag("stdin")),
            (Kind::Exec | Kind::Attach, "output" | "stdout") => Some(flag("stdout")),
            (Kind::Exec | Kind::Attach, "error" | "stderr") => Some(flag("stderr")),
            (Kind::Exec | Kind::Attach, "tty") => Some(flag("tty")),
            (Kind::PortForward, "port" | "ports") => {
                for port in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    match port.parse::<u16>() {
                        Ok(p) if p > 0 => {
                            out.append_pair("ports", &p.to_string());
                        }
                        _ => return Err(format!("invalid port {port:?}")),
                    }
                }
                None
            }
            _ => None,
        };
        if let Some((k, v)) = mapped {
            out.append_pair(&k, &v);
        }
    }
    if target.kind == Kind::Exec && commands == 0 {
        return Err("you must specify at least one command for the container".to_owned());
    }
    if let Some(container) = &target.container {
        out.append_pair("container", container);
    }
    Ok(out.finish())
}

/// The lower apiserver's path for `kind` on pod `namespace/pod`.
pub fn lower_path(kind: Kind, namespace: &str, pod: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/pods/{pod}/{}", kind.subresource())
}

/// The request headers that carry the client's upgrade offer: passed to the lower apiserver
/// as they came, every value of each.
const OFFER_HEADERS: &[&str] = &[
    "upgrade",
    "connection",
    "x-stream-protocol-version",
    "sec-websocket-protocol",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
];

/// The `101` headers that carry the lower side's answer back to the client.
const ANSWER_HEADERS: &[&str] = &[
    "upgrade",
    "connection",
    "x-stream-protocol-version",
    "sec-websocket-protocol",
    "sec-websocket-accept",
    "sec-websocket-extensions",
];

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, names: &[&'static str]) {
    for name in names {
        let name = HeaderName::from_static(name);
        for value in from.get_all(&name) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Whether a request offers an upgrade at all.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(http::header::UPGRADE)
}

/// A refusal as kubectl prints it: a `metav1.Status` with the code and message. The
/// connection is closed after it: the upper apiserver's upgrade proxy copies a refused
/// upgrade's answer until the backend closes.
pub fn refusal(code: StatusCode, message: impl Into<String>) -> Response<Body> {
    let message = message.into();
    let reason = match code {
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        StatusCode::GATEWAY_TIMEOUT => "Timeout",
        StatusCode::CONFLICT => "Conflict",
        _ => "InternalError",
    };
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut response = Response::new(http_body_util::Full::new(Bytes::from(status.to_string())).boxed());
    *response.status_mut() = code;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    response
}

/// What the upper caller gets for a lower answer other than `101`: the lower code and
/// message, except that a lower refusal of the virtual node's own credentials (401/403) is
/// the node's fault, not the caller's (502, naming the permission), and anything else that is
/// no client error is a bad gateway.
pub fn lower_refusal(kind: Kind, code: u16, body: &[u8]) -> (StatusCode, String) {
    let text = String::from_utf8_lossy(body);
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| text.trim().to_owned());
    let message = if message.is_empty() {
        format!("lower cluster answered {code}")
    } else {
        message
    };
    match code {
        401 | 403 => (
            StatusCode::BAD_GATEWAY,
            format!(
                "the lower cluster refused the virtual node (it needs get and create on pods/{}): {message}",
                kind.subresource()
            ),
        ),
        400..=504 => (
            StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
            message,
        ),
        _ => (
            StatusCode::BAD_GATEWAY,
            format!("lower cluster answered {code}: {message}"),
        ),
    }
}

/// What bounds the kubelet API's long-lived streams (exec, attach and port-forward sessions,
/// and followed logs): how many at once, how many of them one namespace may hold, how long a
/// session may stay silent, and the token that ends every one (cancelled when the kubelet API
/// stops, so no session outlives the process's leadership or a shutdown). Every call reaches
/// the kubelet API through the upper apiserver, one caller: the namespace in the path is the
/// tenant, and its share keeps room for the others.
#[derive(Clone, Debug)]
pub struct Sessions {
    max: usize,
    per_namespace: usize,
    held: Arc<std::sync::Mutex<Held>>,
    pub idle: std::time::Duration,
    pub stop: tokio_util::sync::CancellationToken,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_namespace: std::collections::HashMap<String, usize>,
}

/// One stream's place among [`Sessions`], given back when dropped.
#[derive(Debug)]
pub struct Slot {
    held: Arc<std::sync::Mutex<Held>>,
    namespace: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.by_namespace.get_mut(&self.namespace) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.by_namespace.remove(&self.namespace);
            }
        }
    }
}

/// Why a stream got no slot.
#[derive(Debug, PartialEq, Eq)]
pub enum Full {
    /// The server runs `--kubelet-max-stream-sessions` streams.
    Server,
    /// The namespace holds its share, `--kubelet-max-stream-sessions-per-namespace`.
    Namespace,
}

impl Sessions {
    pub fn new(max: usize, per_namespace: usize, idle: std::time::Duration) -> Self {
        Sessions {
            max,
            per_namespace: per_namespace.min(max),
            held: Arc::default(),
            idle,
            stop: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// A slot for a stream of a pod in `namespace`, or which bound is reached.
    pub fn take(&self, namespace: &str) -> Result<Slot, Full> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.total >= self.max {
            return Err(Full::Server);
        }
        let of_namespace = held.by_namespace.get(namespace).copied().unwrap_or(0);
        if of_namespace >= self.per_namespace {
            return Err(Full::Namespace);
        }
        held.total += 1;
        held.by_namespace.insert(namespace.to_owned(), of_namespace + 1);
        Ok(Slot {
            held: self.held.clone(),
            namespace: namespace.to_owned(),
        })
    }

    /// The 503 a stream gets without a slot: which bound, in words.
    pub fn refused(&self, full: Full, what: &str, namespace: &str) -> (&'static str, String) {
        match full {
            Full::Server => (
                "too_many_sessions",
                format!(
                    "the virtual node runs as many {what} streams as it may (--kubelet-max-stream-sessions={}); \
                     try again later",
                    self.max
                ),
            ),
            Full::Namespace => (
                "namespace_share",
                format!(
                    "namespace {namespace} holds as many streams as one namespace may \
                     (--kubelet-max-stream-sessions-per-namespace={}); end one or try again later",
                    self.per_namespace
                ),
            ),
        }
    }
}

/// When bytes last went through a session either way, as milliseconds since it began: one
/// atomic store per read or write on the copy's path.
struct Activity {
    began: tokio::time::Instant,
    last_ms: std::sync::atomic::AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            began: tokio::time::Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.began.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn last(&self) -> tokio::time::Instant {
        self.began + std::time::Duration::from_millis(self.last_ms.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// An upgraded connection that records its [`Activity`].
struct Watched<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T> Watched<T> {
    fn touch(&self) {
        self.activity.touch();
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Resolves once `activity` has been silent for `idle`.
async fn silent_for(activity: &Activity, idle: std::time::Duration) {
    loop {
        let deadline = activity.last() + idle;
        if tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline).await;
    }
}

/// Opens the upgrade below for `target` and, once the lower side answered `101`, answers
/// the upper caller the same and splices the two connections in a task of its own. At most
/// `sessions.slots` sessions run at once (more are refused, 503); a session with no byte
/// either way for `sessions.idle` is closed, as the kubelet's
/// `--streaming-connection-idle-timeout` closes one; all end when `sessions.stop` fires.
pub async fn splice(
    lower: &kube::Client,
    metrics: &Arc<Metrics>,
    sessions: &Sessions,
    target: &Target,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let slot = match sessions.take(&target.namespace) {
        Ok(slot) => slot,
        Err(full) => {
            let (why, message) = sessions.refused(full, target.kind.name(), &target.namespace);
            metrics.stream_refused(target.kind.name(), why);
            return refusal(StatusCode::SERVICE_UNAVAILABLE, message);
        }
    };
    if !is_upgrade(req.headers()) {
        return refusal(
            StatusCode::BAD_REQUEST,
            format!(
                "{} needs an upgrade to SPDY/3.1 or WebSocket (Upgrade header missing)",
                target.kind.name()
            ),
        );
    }
    let query = match lower_query(target, req.uri().query().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return refusal(StatusCode::BAD_REQUEST, e),
    };
    let uri = format!(
        "{}?{query}",
        lower_path(target.kind, &target.namespace, &target.pod)
    );
    let mut lower_req = Request::new(kube::client::Body::empty());
    *lower_req.method_mut() = req.method().clone();
    *lower_req.uri_mut() = match uri.parse() {
        Ok(u) => u,
        Err(e) => return refusal(StatusCode::BAD_REQUEST, format!("{uri}: {e}")),
    };
    copy_headers(req.headers(), lower_req.headers_mut(), OFFER_HEADERS);
    let mut lower_res = match lower.send(lower_req).await {
        Ok(r) => r,
        Err(e) => {
            metrics.stream_refused(target.kind.name(), "lower_unreachable");
            return refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the lower cluster cannot be reached: {e}"),
            );
        }
    };
    if lower_res.status() != StatusCode::SWITCHING_PROTOCOLS {
        let code = lower_res.status().as_u16();
        let body = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            http_body_util::Limited::new(lower_res.into_body(), 64 * 1024).collect(),
        )
        .await
        .ok()
        .and_then(|r| r.ok())
        .map(|c| c.to_bytes())
        .unwrap_or_default();
        let (code, message) = lower_refusal(target.kind, code, &body);
        metrics.stream_refused(target.kind.name(), "lower_refused");
        return refusal(code, message);
    }
    let mut answer_headers = HeaderMap::new();
    copy_headers(lower_res.headers(), &mut answer_headers, ANSWER_HEADERS);
    let lower_io = match hyper::upgrade::on(&mut lower_res).await {
        Ok(io) => io,
        Err(e) => {
            metrics.stream_refused(target.kind.name(), "lower_upgrade_failed");
            return refusal(
                StatusCode::BAD_GATEWAY,
                format!("the lower upgrade did not complete: {e}"),
            );
        }
    };
    let upper_upgrade = hyper::upgrade::on(&mut req);
    let session = metrics.stream_opened(target.kind.name());
    let label = format!("{}/{}", target.namespace, target.pod);
    let kind = target.kind.name();
    let (idle, stop) = (sessions.idle, sessions.stop.clone());
    tokio::spawn(async move {
        let (_session, _slot) = (session, slot);
        let upper_io = match upper_upgrade.await {
            Ok(io) => io,
            Err(e) => {
                tracing::debug!(pod = %label, kind, error = %e, "upper upgrade did not complete");
                return;
            }
        };
        let activity = Arc::new(Activity::new());
        let mut upper_io = Watched {
            inner: hyper_util::rt::TokioIo::new(upper_io),
            activity: activity.clone(),
        };
        let mut lower_io = hyper_util::rt::TokioIo::new(lower_io);
        // On EOF from one side the other side's write half is shut down and the other
        // direction goes on (a half-close passes through); an error ends both.
        let copy =
            tokio::io::copy_bidirectional_with_sizes(&mut upper_io, &mut lower_io, 64 * 1024, 64 * 1024);
        tokio::select! {
            copied = copy => match copied {
                Ok((up, down)) => {
                    tracing::debug!(pod = %label, kind, to_lower = up, to_upper = down, "stream session ended")
                }
                Err(e) => tracing::debug!(pod = %label, kind, error = %e, "stream session ended with an error"),
            },
            _ = silent_for(&activity, idle) => {
                tracing::info!(pod = %label, kind, idle_seconds = idle.as_secs(), "stream session closed: idle");
            }
            _ = stop.cancelled() => {
                tracing::info!(pod = %label, kind, "stream session closed: the kubelet API stopped");
            }
        }
    });
    let mut response = Response::new(http_body_util::Full::new(Bytes::new()).boxed());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *response.headers_mut() = answer_headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_namespace_takes_its_share_and_leaves_the_rest_to_others() {
        let sessions = Sessions::new(4, 2, std::time::Duration::from_secs(1));
        let a1 = sessions.take("a").unwrap();
        let _a2 = sessions.take("a").unwrap();
        assert_eq!(sessions.take("a").unwrap_err(), Full::Namespace);
        let _b1 = sessions.take("b").unwrap();
        let _b2 = sessions.take("b").unwrap();
        assert_eq!(sessions.take("c").unwrap_err(), Full::Server);
        // A slot given back is free again, for the namespace that held it or another.
        drop(a1);
        let _c1 = sessions.take("c").unwrap();
        assert_eq!(sessions.take("a").unwrap_err(), Full::Server);
        let (why, message) = sessions.refused(Full::Namespace, "logs", "a");
        assert_eq!(why, "namespace_share");
        assert!(
            message.contains("namespace a") && message.contains("per-namespace=2"),
            "{message}"
        );
        // A share above the whole is the whole.
        let one = Sessions::new(1, 128, std::time::Duration::from_secs(1));
        let _x = one.take("x").unwrap();
        assert_eq!(one.take("y").unwrap_err(), Full::Server);
    }

    fn target(kind: Kind, container: Option<&str>) -> Target {
        Target {
            kind,
            namespace: "ns".into(),
            pod: "p".into(),
            uid: None,
            container: container.map(str::to_owned),
        }
    }

    #[test]
    fn paths_parse_with_and_without_the_uid() {
        let exec = parse_path(&["exec", "ns", "p", "app"]).unwrap().unwrap();
        assert_eq!(exec, target(Kind::Exec, Some("app")));
        let with_uid = parse_path(&["attach", "ns", "p", "u-1", "app"]).unwrap().unwrap();
        assert_eq!(
            (with_uid.kind, with_uid.uid.as_deref()),
            (Kind::Attach, Some("u-1"))
        );
        let pf = parse_path(&["portForward", "ns", "p"]).unwrap().unwrap();
        assert_eq!(pf, target(Kind::PortForward, None));
        let pf_uid = parse_path(&["portForward", "ns", "p", "u-2"]).unwrap().unwrap();
        assert_eq!(pf_uid.uid.as_deref(), Some("u-2"));
        assert!(parse_path(&["containerLogs", "ns", "p", "c"]).is_none());
        assert!(parse_path(&["exec", "ns", "p"]).unwrap().is_err());
        assert!(parse_path(&["exec", "ns", "", "c"]).unwrap().is_err());
        assert!(
            parse_path(&["portForward", "ns", "p", "u", "x"])
                .unwrap()
                .is_err()
        );
    }

    #[test]
    fn exec_queries_map_to_the_pod_subresource() {
        let q = lower_query(
            &target(Kind::Exec, Some("app")),
            "command=sh&command=-c&command=exit+3&input=1&output=1&error=1&tty=0&ignored=x",
        )
        .unwrap();
        assert_eq!(
            q,
            "command=sh&command=-c&command=exit+3&stdin=true&stdout=true&stderr=true&tty=false&container=app"
        );
        assert!(lower_query(&target(Kind::Exec, Some("app")), "input=1").is_err());
        let attach = lower_query(&target(Kind::Attach, Some("app")), "output=1&tty=true").unwrap();
        assert_eq!(attach, "stdout=true&tty=true&container=app");
    }

    #[test]
    fn port_forward_ports_map_and_are_checked() {
        let q = lower_query(&target(Kind::PortForward, None), "port=8080&port=9090").unwrap();
        assert_eq!(q, "ports=8080&ports=9090");
        assert_eq!(
            lower_query(&target(Kind::PortForward, None), "ports=1,2").unwrap(),
            "ports=1&ports=2"
        );
        assert_eq!(lower_query(&target(Kind::PortForward, None), "").unwrap(), "");
        assert!(lower_query(&target(Kind::PortForward, None), "port=0").is_err());
        assert!(lower_query(&target(Kind::PortForward, None), "port=http").is_err());
        assert_eq!(
            lower_path(Kind::PortForward, "ns", "p"),
            "/api/v1/namespaces/ns/pods/p/portforward"
        );
    }

    #[test]
    fn lower_refusals_keep_code_and_message_unless_they_are_the_nodes_own() {
        let status = br#"{"kind":"Status","code":404,"message":"pods \"p\" not found"}"#;
        assert_eq!(
            lower_refusal(Kind::Exec, 404, status),
            (StatusCode::NOT_FOUND, "pods \"p\" not found".to_owned())
        );
        assert_eq!(
            lower_refusal(Kind::Exec, 400, b"container not found (\"app\")\n"),
            (
                StatusCode::BAD_REQUEST,
                "container not found (\"app\")".to_owned()
            )
        );
        let (code, message) = lower_refusal(Kind::PortForward, 403, b"forbidden");
        assert_eq!(code, StatusCode::BAD_GATEWAY);
        assert!(message.contains("pods/portforward") && message.contains("forbidden"));
        let (code, message) = lower_refusal(Kind::Exec, 302, b"");
        assert_eq!(code, StatusCode::BAD_GATEWAY);
        assert!(message.contains("302"));
    }

    #[test]
    fn offers_and_answers_pass_every_value() {
        let mut offer = HeaderMap::new();
        offer.append("X-Stream-Protocol-Version", "v4.channel.k8s.io".parse().unwrap());
        offer.append("X-Stream-Protocol-Version", "v3.channel.k8s.io".parse().unwrap());
        offer.append("Upgrade", "SPDY/3.1".parse().unwrap());
        offer.append("Authorization", "Bearer upper".parse().unwrap());
        let mut out = HeaderMap::new();
        copy_headers(&offer, &mut out, OFFER_HEADERS);
        assert_eq!(out.get_all("x-stream-protocol-version").iter().count(), 2);
        assert!(
            out.get("authorization").is_none(),
            "upper credentials never travel down"
        );
        assert!(is_upgrade(&out));
    }
}
