//! HTTPS serving of `/mutate`, `/healthz` and `/readyz`.
//!
//! Every bad request gets a precise HTTP status and a one-line text body; only a well-formed
//! review reaches [`crate::mutate`], which answers in the review itself.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;
use kube::core::DynamicObject;
use kube::core::admission::AdmissionRequest;
use tensile_common::names;
use tensile_common::serve::{self, text};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::metrics::{Metrics, ResultLabels};
use crate::mutate::{self, Judgement};
use crate::outcome::Verdict;
use crate::policy::Policy;
use crate::review;

/// What every request handler shares.
pub struct State {
    pub policy: Policy,
    pub max_body_bytes: usize,
    pub metrics: Metrics,
    /// Reads PVCs for volume pinning; `None` disables it.
    pub client: Option<kube::Client>,
    pub pvc_timeout: Duration,
    /// False until the serving certificate is trusted (its caBundle written, when we make it).
    pub ready: tensile_common::admin::Readiness,
    /// The descheduler's exclusion records, as the watch last showed them; `None`: not read.
    pub exclusions: Option<tokio::sync::watch::Receiver<Arc<tensile_common::exclusion::Exclusions>>>,
    /// Open, evicted, refused and timed-out connections of the HTTPS port.
    pub connections: Arc<serve::Counters>,
}

type Body = Full<Bytes>;

/// How long a review's body may take to arrive; the apiserver's own webhook timeout is at
/// most 30 s and its bodies arrive at once.
const BODY_DEADLINE: Duration = Duration::from_secs(10);

fn health(state: &State, path: &str) -> Option<Response<Body>> {
    match path {
        "/healthz" | "/livez" => Some(text(StatusCode::OK, "ok\n")),
        "/readyz" if state.ready.get() => Some(text(StatusCode::OK, "ok\n")),
        "/readyz" => Some(text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the caBundle is not written yet\n",
        )),
        _ => None,
    }
}

/// Routes one request of the HTTPS port.
pub async fn handle(state: Arc<State>, request: Request<Incoming>, bodies: serve::Bodies) -> Response<Body> {
    if request.uri().path() == "/mutate" {
        let started = Instant::now();
        let response = if request.method() == Method::POST {
            admit(&state, request, &bodies).await
        } else {
            state.metrics.error("method");
            let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "only POST is served at /mutate\n");
            r.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
            r
        };
        state.metrics.latency.observe(started.elapsed().as_secs_f64());
        return response;
    }
    let path = request.uri().path();
    if request.method() == Method::GET
        && let Some(r) = health(&state, path)
    {
        return r;
    }
    text(StatusCode::NOT_FOUND, format!("no such path: {path}\n"))
}

fn is_json(value: Option<&header::HeaderValue>) -> bool {
    let Some(v) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = v.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
}

async fn admit(state: &State, request: Request<Incoming>, bodies: &serve::Bodies) -> Response<Body> {
    let metrics = &state.metrics;
    let content_type = request.headers().get(header::CONTENT_TYPE);
    let limit = state.max_body_bytes;
    if !is_json(content_type) {
        metrics.error("content_type");
        let got = content_type
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_owned();
        // Read the body anyway (within the limit) so the keep-alive connection stays usable.
        let _ = bodies.read(request.into_body(), limit, BODY_DEADLINE).await;
        return text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("content type must be application/json, got {got}\n"),
        );
    }
    // The rest of an oversized body is never read, so the connection cannot be reused.
    let too_large = || {
        let mut r = text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body exceeds the limit of {limit} bytes\n"),
        );
        r.headers_mut()
            .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        r
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        metrics.error("too_large");
        return too_large();
    }
    let body = match bodies.read(request.into_body(), limit, BODY_DEADLINE).await {
        Ok(body) => body,
        Err(serve::BodyError::TooLarge(_)) => {
            metrics.error("too_large");
            return too_large();
        }
        Err(e @ serve::BodyError::TooSlow(_)) => {
            metrics.error("body_timeout");
            return text(StatusCode::REQUEST_TIMEOUT, format!("{e}\n"));
        }
        Err(e @ serve::BodyError::Busy(_)) => {
            metrics.error("body_budget");
            return text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n"));
        }
        Err(e) => {
            metrics.error("body");
            return text(StatusCode::BAD_REQUEST, format!("cannot read the body: {e}\n"));
        }
    };
    let review = match review::parse(&body) {
        Ok(r) => r,
        Err(e) => {
            metrics.error("bad_request");
            return text(StatusCode::BAD_REQUEST, format!("{e}\n"));
        }
    };
    let req = &review.request;
    let span = tracing::debug_span!("review", uid = %req.uid, pod = %PodName(req));
    async {
        let exclusions = state.exclusions.as_ref().map(|rx| rx.borrow().clone());
        let judged = match &exclusions {
            Some(ex) => mutate::judge_excluding(&review, &state.policy, ex.as_ref()),
            None => mutate::judge(&review, &state.policy),
        };
        let outcome = match judged {
            Judgement::Decided(outcome) => outcome,
            Judgement::Stash(pod) => {
                let claims = pod.claims();
                let (nodes, warnings) = match (&state.client, req.namespace.as_deref()) {
                    (Some(client), Some(ns)) if !claims.is_empty() => {
                        selected_nodes(client.clone(), ns, &claims, state.pvc_timeout).await
                    }
                    _ => (BTreeMap::new(), Vec::new()),
                };
                let mut outcome = match &exclusions {
                    Some(ex) => pod.finish_excluding(&state.policy, &nodes, ex.as_ref()),
                    None => pod.finish(&state.policy, &nodes),
                };
                if outcome.verdict == Verdict::Mutated && !warnings.is_empty() {
                    outcome.response.warnings.get_or_insert_default().extend(warnings);
                }
                outcome
            }
        };
        metrics
            .reviews
            .get_or_create(&ResultLabels {
                result: outcome.verdict.as_str(),
            })
            .inc();
        match outcome.verdict {
            Verdict::Mutated => {
                metrics.mutations.inc();
                tracing::debug!(kind = %req.kind.kind, "mutated: a pod stashed, or a Job given the disruption rule");
            }
            Verdict::Denied => tracing::info!(reason = %outcome.response.result.message, "denied"),
            Verdict::Unchanged => {}
        }
        match review::encode(outcome.response) {
            Ok(bytes) => {
                let mut r = Response::new(Full::new(Bytes::from(bytes)));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("application/json"),
                );
                r
            }
            Err(e) => {
                metrics.error("encode");
                text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot encode the response: {e}\n"),
                )
            }
        }
    }
    .instrument(span)
    .await
}

/// `namespace/name` of the pod a review is about, written only when a log line needs it.
struct PodName<'a>(&'a AdmissionRequest<DynamicObject>);

impl std::fmt::Display for PodName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.0.namespace, self.0.name.as_str()) {
            (Some(ns), "") => write!(f, "{ns}/<generated>"),
            (Some(ns), name) => write!(f, "{ns}/{name}"),
            (None, name) => f.write_str(name),
        }
    }
}

/// The selected node of each of `claims` that has one; failures become warnings (the pod is
/// admitted without the pin rather than refused for a read error).
/// Claims of one pod read for volume pinning, at most, and how many at once: a pod with
/// thousands of claim volumes must not turn one review into thousands of API reads.
const MAX_CLAIM_LOOKUPS: usize = 16;
const CLAIM_LOOKUP_CONCURRENCY: usize = 4;

async fn selected_nodes(
    client: kube::Client,
    namespace: &str,
    claims: &[String],
    timeout: Duration,
) -> (BTreeMap<String, String>, Vec<String>) {
    use futures::StreamExt as _;
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client, namespace);
    let mut warnings = Vec::new();
    if claims.len() > MAX_CLAIM_LOOKUPS {
        warnings.push(format!(
            "tensile webhook: the pod has {} claims; only the first {MAX_CLAIM_LOOKUPS} are read \
             for volume pinning",
            claims.len()
        ));
    }
    let reads = claims.iter().take(MAX_CLAIM_LOOKUPS).cloned().map(|claim| {
        let api = api.clone();
        async move {
            let result = tokio::time::timeout(timeout, api.get_metadata_opt(&claim)).await;
            (claim, result)
        }
    });
    let results: Vec<_> = futures::stream::iter(reads)
        .buffer_unordered(CLAIM_LOOKUP_CONCURRENCY)
        .collect()
        .await;
    let mut nodes = BTreeMap::new();
    for (claim, result) in results {
        let problem = match result {
            Ok(Ok(Some(pvc))) => {
                if let Some(node) = pvc
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(names::PVC_SELECTED_NODE))
                {
                    nodes.insert(claim, node.clone());
                }
                continue;
            }
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} ms", timeout.as_millis()),
        };
        tracing::warn!(pvc = %claim, error = %problem, "cannot read the PVC");
        warnings.push(format!(
            "tensile webhook: cannot read PVC {claim} ({problem}); the pod is not pinned to its volume's node"
        ));
    }
    (nodes, warnings)
}

/// Serves HTTPS on `listener` until `stop`, within `limits`; open connections are closed
/// gracefully.
pub async fn serve_https(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    limits: serve::Limits,
    state: Arc<State>,
    stop: CancellationToken,
) {
    let counters = state.connections.clone();
    serve::serve(listener, tls, limits, counters, stop, move |request, peer| {
        handle(state.clone(), request, peer.bodies)
    })
    .await
}
