//! The kubelet API of the virtual node, over TLS on `--kubelet-port`: the upper apiserver
//! proxies `kubectl logs` here, and we forward to the lower cluster's `pods/log`.
//!
//! Callers must present a client certificate signed by `--client-verify-ca` (the upper
//! apiserver's kubelet-client CA); a caller without one gets 401. Serving without
//! authentication takes an explicit `--no-verify-clients`.

use std::path::PathBuf;
use std::sync::Arc;
use tensile_common::cache::Cache;

use bytes::Bytes;
use futures::AsyncReadExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};
use kube::runtime::reflector::ObjectRef;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tensile_common::kubelet::{Body, LogOptions, streamed, text};
use tokio::net::TcpListener;

/// How callers are authenticated.
#[derive(Clone, Debug)]
pub enum ClientAuth {
    /// Client certificates signed by this CA (PEM file).
    Ca(PathBuf),
    /// Anyone: explicitly asked for with `--no-verify-clients`.
    None,
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum ServingCert {
    Files {
        cert: PathBuf,
        key: PathBuf,
    },
    /// Generated at start for these names/addresses.
    SelfSigned(Vec<String>),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubelet API: reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubelet API: {path}: {detail}")]
    Pem { path: PathBuf, detail: String },
    #[error("kubelet API: TLS: {0}")]
    Tls(String),
    #[error("kubelet API: binding {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

fn read(path: &PathBuf) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read {
        path: path.clone(),
        source,
    })
}

fn certs(pem: &[u8], path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(c),
        Ok(_) => Err(Error::Pem {
            path: path.to_owned(),
            detail: "no CERTIFICATE block".into(),
        }),
        Err(e) => Err(Error::Pem {
            path: path.to_owned(),
            detail: e.to_string(),
        }),
    }
}

/// Builds the TLS configuration; every file problem is reported with its path.
pub fn tls_config(cert: &ServingCert, auth: &ClientAuth) -> Result<Arc<rustls::ServerConfig>, Error> {
    let (chain, key) = match cert {
        ServingCert::Files { cert, key } => {
            let chain = certs(&read(cert)?, cert)?;
            let key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| Error::Pem {
                path: key.clone(),
                detail: e.to_string(),
            })?;
            (chain, key)
        }
        ServingCert::SelfSigned(names) => {
            let generated =
                rcgen::generate_simple_self_signed(names.clone()).map_err(|e| Error::Tls(e.to_string()))?;
            let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der())
                .map_err(|e| Error::Tls(e.to_string()))?;
            (vec![generated.cert.der().clone()], key)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?;
    let builder = match auth {
        ClientAuth::Ca(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs(&read(path)?, path)? {
                roots.add(c).map_err(|e| Error::Pem {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            }
            // Unauthenticated handshakes are allowed so the caller gets an HTTP 401 that
            // says why, instead of a bare TLS alert.
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| Error::Tls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        ClientAuth::None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| Error::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

pub async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// What a request handler needs.
pub struct KubeletState {
    pub node: String,
    pub upper_pods: Cache<Pod>,
    pub lower: kube::Client,
    pub require_client_cert: bool,
}

pub async fn serve(listener: TcpListener, config: Arc<rustls::ServerConfig>, state: Arc<KubeletState>) {
    tensile_common::kubelet::serve_tls(listener, config, move |req, authenticated| {
        let state = state.clone();
        async move { route(&state, authenticated, req).await }
    })
    .await
}

async fn route(state: &KubeletState, authenticated: bool, req: Request<Incoming>) -> Response<Body> {
    if state.require_client_cert && !authenticated {
        return text(
            StatusCode::UNAUTHORIZED,
            "a client certificate signed by the kubelet client CA (--client-verify-ca) is required",
        );
    }
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match segments.as_slice() {
        ["healthz"] => text(StatusCode::OK, "ok"),
        ["containerLogs", ns, pod, container] if req.method() == http::Method::GET => {
            match LogOptions::from_query(req.uri().query().unwrap_or("")) {
                Ok(options) => logs(state, ns, pod, container, options).await,
                Err(e) => text(StatusCode::BAD_REQUEST, e),
            }
        }
        ["containerLogs", ..] => text(
            StatusCode::BAD_REQUEST,
            format!("{path}: expected GET /containerLogs/{{namespace}}/{{pod}}/{{container}}"),
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            format!("{path}: not served by this virtual node"),
        ),
    }
}

async fn logs(state: &KubeletState, ns: &str, pod: &str, container: &str, o: LogOptions) -> Response<Body> {
    let bound_here = state
        .upper_pods
        .get(&ObjectRef::new(pod).within(ns))
        .is_some_and(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(state.node.as_str()));
    if !bound_here {
        return text(
            StatusCode::NOT_FOUND,
            format!("pod {ns}/{pod} is not on node {}", state.node),
        );
    }
    let params = LogParams {
        container: Some(container.to_owned()),
        follow: o.follow,
        limit_bytes: o.limit_bytes.map(|n| n as i64),
        pretty: false,
        previous: o.previous,
        since_seconds: o.since_seconds.map(|n| n as i64),
        since_time: o.since_time,
        tail_lines: o.tail_lines.map(|n| n as i64),
        timestamps: o.timestamps,
    };
    let api: Api<Pod> = Api::namespaced(state.lower.clone(), ns);
    let mut reader = match api.log_stream(pod, &params).await {
        Ok(r) => Box::pin(r),
        Err(kube::Error::Api(s)) => {
            let code = StatusCode::from_u16(s.code).unwrap_or(StatusCode::BAD_GATEWAY);
            return text(code, format!("lower cluster: {}", s.message));
        }
        Err(e) => return text(StatusCode::BAD_GATEWAY, format!("lower cluster: {e}")),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                // Each chunk is sent as it arrives: `kubectl logs -f` sees lines at once.
                Ok(n) => {
                    if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    streamed(rx)
}
