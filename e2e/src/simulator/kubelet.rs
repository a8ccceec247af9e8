//! The simulated kubelet's HTTPS endpoint: `containerLogs`, `exec`, `attach` and
//! `portForward` ([`super::streams`]) for every simulated pod.
//!
//! It serves on the bed's node address ([`crate::node_ip`]) with a self-signed certificate (the apiserver does not verify
//! kubelet certificates unless told to) and, when given the apiserver's kubelet-client CA,
//! admits only clients presenting a certificate from it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use jiff::Timestamp;
use tokio::net::TcpListener;

use super::Inner;
use super::containers::{lookup, source};
use super::logs::LogOptions;
use crate::{Result, io_err};
use tensile_common::kubelet::{Body, streamed, text};

pub(super) async fn bind(client_ca_pem: Option<&str>) -> Result<(TcpListener, Arc<rustls::ServerConfig>)> {
    let addr = std::net::SocketAddr::new(crate::node_ip()?, 0);
    let listener = TcpListener::bind(addr).await.map_err(io_err(&addr.to_string()))?;
    let cert = crate::pki::self_signed_server("tensile-simulated-kubelet")?;
    let config = crate::tls::server_config(&cert.cert_pem, &cert.key_pem, client_ca_pem)?;
    Ok((listener, config))
}

/// Serves the kubelet API; `node` names the node whose `/stats` and `/metrics` these are.
pub(super) async fn serve(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    inner: Arc<Inner>,
    node: Option<String>,
) {
    // The TLS configuration already refused callers without the apiserver's certificate.
    let (limits, counters) = (Default::default(), Default::default());
    // Never cancelled: the simulator's task is dropped with it.
    let stop = tokio_util::sync::CancellationToken::new();
    tensile_common::serve::serve(listener, config, limits, counters, stop, move |req, _peer| {
        let (inner, node) = (inner.clone(), node.clone());
        async move { route(&inner, node.as_deref(), req) }
    })
    .await
}

fn route(inner: &Arc<Inner>, node: Option<&str>, mut req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    if let Some(response) = super::streams::route(inner, &mut req, &segments) {
        return response;
    }
    match (req.method(), segments.as_slice()) {
        (&http::Method::GET, ["healthz"]) => text(StatusCode::OK, "ok"),
        (&http::Method::GET, ["stats", "summary"]) => {
            inner
                .summaries_served
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let summary = super::stats::summary(inner, node);
            let mut r = text(StatusCode::OK, summary.to_string());
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            r
        }
        (&http::Method::GET, ["metrics", "resource"]) => text(
            StatusCode::OK,
            tensile_virtual_node::serve::stats::resource_metrics(&super::stats::summary(inner, node)),
        ),
        (&http::Method::GET, ["containerLogs", ns, pod, container]) => {
            let options = match LogOptions::from_query(req.uri().query().unwrap_or("")) {
                Ok(o) => o,
                Err(e) => return text(StatusCode::BAD_REQUEST, e),
            };
            container_logs(inner, ns, pod, container, options)
        }
        (_, ["containerLogs", ..]) if req.method() != http::Method::GET => {
            text(StatusCode::METHOD_NOT_ALLOWED, "containerLogs takes GET")
        }
        _ => text(
            StatusCode::NOT_FOUND,
            format!(
                "{path}: not served by the simulated kubelet (it serves /containerLogs/{{namespace}}/{{pod}}/{{container}})"
            ),
        ),
    }
}

fn container_logs(
    inner: &Arc<Inner>,
    ns: &str,
    name: &str,
    container: &str,
    options: LogOptions,
) -> Response<Body> {
    let Some(pod) = lookup(inner, ns, name) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("pod \"{ns}/{name}\" not found on a simulated node"),
        );
    };
    let src = match source(&pod, ns, name, container, options.previous) {
        Ok(s) => s,
        Err((code, msg)) => return text(code, msg),
    };
    let now = Timestamp::now();
    let (first, end) = src.window(&options, now);
    let mut budget = options.limit_bytes.unwrap_or(u64::MAX);
    let mut initial = String::new();
    for i in first..end {
        if !push_limited(&mut initial, &src.render(i, options.timestamps), &mut budget) {
            break;
        }
    }
    let follow = options.follow && src.finished.is_none() && budget > 0 && !options.previous;
    if !follow {
        return text(StatusCode::OK, initial);
    }
    // Follow: stream lines as they become due until the run ends or the client leaves.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let inner = inner.clone();
    let (ns, name, container) = (ns.to_owned(), name.to_owned(), container.to_owned());
    tokio::spawn(async move {
        if tx.send(Bytes::from(initial)).await.is_err() {
            return;
        }
        let mut next = end;
        let mut src = src;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            // The run may have ended since: re-read the pod.
            let current = lookup(&inner, &ns, &name)
                .filter(|p| p.metadata.uid == pod.metadata.uid)
                .and_then(|p| source(&p, &ns, &name, &container, false).ok());
            let ended = match current {
                Some(cur) if cur.started == src.started => {
                    src = cur;
                    src.finished.is_some()
                }
                _ => true,
            };
            let upto = src.written_by(Timestamp::now());
            let mut chunk = String::new();
            while next < upto {
                if !push_limited(&mut chunk, &src.render(next, options.timestamps), &mut budget) {
                    break;
                }
                next += 1;
            }
            if !chunk.is_empty() && tx.send(Bytes::from(chunk)).await.is_err() {
                return;
            }
            if ended || budget == 0 {
                return;
            }
        }
    });
    streamed(rx)
}

/// Appends `line` within the byte budget; false once the budget is spent.
fn push_limited(out: &mut String, line: &str, budget: &mut u64) -> bool {
    if *budget == 0 {
        return false;
    }
    let take = (line.len() as u64).min(*budget) as usize;
    out.push_str(&line[..take]);
    *budget -= take as u64;
    *budget > 0
}
