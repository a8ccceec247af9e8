//! The admin endpoint every daemon serves on `--admin-addr`: `/metrics` (Prometheus text),
//! `/healthz` (the process runs) and `/readyz` (the daemon has synced: it does its job, or,
//! elected, stands by ready to take over; see `leader::Standing`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Admin flags, flattened into every daemon.
#[derive(Clone, Debug, clap::Args)]
pub struct AdminArgs {
    /// Address of the plain-HTTP admin endpoint (`/metrics`, `/healthz`, `/readyz`).
    #[arg(
        long = "admin-addr",
        env = "TENSILE_ADMIN_ADDR",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_addr: SocketAddr,
}

/// Readiness shared between a daemon and its admin endpoint, with what `/readyz` says.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<(AtomicBool, Mutex<String>)>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.0.store(ready, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.0.0.load(Ordering::SeqCst)
    }
    /// Sets readiness and the sentence `/readyz` answers with (for example which replica
    /// leads).
    pub fn say(&self, ready: bool, why: impl Into<String>) {
        if let Ok(mut s) = self.0.1.lock() {
            *s = why.into();
        }
        self.set(ready);
    }
    pub(crate) fn why(&self) -> String {
        self.0.1.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("admin endpoint {addr}: {source}")]
pub struct Error {
    addr: SocketAddr,
    #[source]
    source: std::io::Error,
}

/// Binds the admin address (so a taken port fails start-up with a clear message).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error { addr, source })
}

/// Serves until the future is dropped.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, ready: Readiness) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let registry = registry.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let resp = respond(req.uri().path(), &registry, &ready);
                async move { Ok::<_, Infallible>(resp) }
            });
            let io = hyper_util::rt::TokioIo::new(tcp);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await;
        });
    }
}

fn respond(path: &str, registry: &Registry, ready: &Readiness) -> Response<Full<Bytes>> {
    let (code, ctype, body) = match path {
        "/healthz" => (StatusCode::OK, "text/plain", "ok".to_string()),
        "/readyz" => {
            let why = ready.why();
            match (ready.get(), why.is_empty()) {
                (true, true) => (StatusCode::OK, "text/plain", "ok".to_string()),
                (true, false) => (StatusCode::OK, "text/plain", format!("ok: {why}")),
                (false, true) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "not ready".to_string(),
                ),
                (false, false) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}"),
                ),
            }
        }
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, registry) {
                Ok(()) => (
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    out,
                ),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, "text/plain", e.to_string()),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("{path}: not found (serves /metrics, /healthz, /readyz)"),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = code;
    if let Ok(v) = http::HeaderValue::from_str(ctype) {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_answer_as_documented() {
        let mut registry = Registry::default();
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        registry.register("things", "Things done", counter.clone());
        counter.inc();
        let ready = Readiness::default();
        assert_eq!(respond("/healthz", &registry, &ready).status(), StatusCode::OK);
        assert_eq!(
            respond("/readyz", &registry, &ready).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        ready.set(true);
        assert_eq!(respond("/readyz", &registry, &ready).status(), StatusCode::OK);
        let metrics = respond("/metrics", &registry, &ready);
        assert_eq!(metrics.status(), StatusCode::OK);
        assert_eq!(
            respond("/nope", &registry, &ready).status(),
            StatusCode::NOT_FOUND
        );
    }
}
