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
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use tokio::net::TcpListener;

use super::Inner;
use super::logs::{LogOptions, LogSource};
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

pub(super) fn lookup(inner: &Inner, ns: &str, pod: &str) -> Option<Pod> {
    inner
        .pods
        .read()
        .ok()?
        .get(&(ns.to_owned(), pod.to_owned()))
        .cloned()
}

pub(super) fn container_status<'a>(pod: &'a Pod, container: &str) -> Option<&'a ContainerStatus> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .chain(status.init_container_statuses.iter())
        .flatten()
        .find(|c| c.name == container)
}

/// The log source of the current (or, with `previous`, the last terminated) run.
pub(super) fn source(
    pod: &Pod,
    ns: &str,
    name: &str,
    container: &str,
    previous: bool,
) -> Result<LogSource, (StatusCode, String)> {
    let known = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()))
        .any(|c| c.name == container);
    if !known {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("container \"{container}\" is not valid for pod \"{name}\""),
        ));
    }
    let waiting = || {
        (
            StatusCode::BAD_REQUEST,
            format!("container \"{container}\" in pod \"{name}\" is waiting to start: ContainerCreating"),
        )
    };
    let status = container_status(pod, container).ok_or_else(waiting)?;
    let state = if previous {
        status.last_state.as_ref()
    } else {
        status.state.as_ref()
    };
    let lines = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(tensile_common::names::SIM_BEHAVIOR))
        .and_then(|b| super::behavior::Behavior::parse(b).ok())
        .and_then(|b| b.log_lines);
    let make = |started: Option<Timestamp>, finished: Option<Timestamp>| {
        started.map(|started| LogSource {
            namespace: ns.to_owned(),
            pod: name.to_owned(),
            container: container.to_owned(),
            started,
            finished,
            lines,
        })
    };
    let found = state.and_then(|s| {
        if let Some(r) = &s.running {
            make(r.started_at.as_ref().map(|t| t.0), None)
        } else if let Some(t) = &s.terminated {
            make(
                t.started_at.as_ref().map(|t| t.0),
                Some(t.finished_at.as_ref().map(|t| t.0).unwrap_or_else(Timestamp::now)),
            )
        } else {
            None
        }
    });
    match (found, previous) {
        (Some(src), _) => Ok(src),
        (None, true) => Err((
            StatusCode::BAD_REQUEST,
            format!("previous terminated container \"{container}\" in pod \"{name}\" not found"),
        )),
        (None, false) => {
            // A container between runs shows its last run's log, as the kubelet does.
            let last = status.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            last.and_then(|t| {
                make(
                    t.started_at.as_ref().map(|t| t.0),
                    t.finished_at.as_ref().map(|t| t.0),
                )
            })
            .ok_or_else(waiting)
        }
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
