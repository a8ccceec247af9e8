//! HTTPS serving of the extender verbs: `POST /filter`, `POST /prioritize` and
//! `POST /preempt`.
//!
//! Every bad request gets a precise 4xx status and a one-line text body; only well-formed
//! ExtenderArgs reach [`crate::extender`], and ExtenderPreemptionArgs [`crate::preempt`]. No API call happens on this path: nodes and
//! exclusions come from watch caches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{ObjectRef, Store};
use tensile_common::exclusion::Exclusions;
use tensile_common::serve::{self, BodyError, text};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::context::{BoundPod, BoundPods, Context, FactsCache, View};
use crate::extender::{self, ExtenderArgs, Score};
use crate::metrics::Metrics;
use crate::preempt::{self, ExtenderPreemptionArgs};
use tensile_common::fit::Options;

/// What every request shares.
pub struct State {
    pub nodes: Arc<dyn View + Send + Sync>,
    pub pods: Arc<dyn BoundPods + Send + Sync>,
    pub facts: FactsCache,
    pub exclusions: watch::Receiver<Arc<Exclusions>>,
    /// A shape older than this fails open.
    pub max_age: Option<jiff::SignedDuration>,
    pub score: Score,
    pub metrics: Metrics,
    pub max_body_bytes: usize,
    /// Time a client has to send its body.
    pub body_deadline: Duration,
}

/// The watch cache of virtual nodes, as the extender looks names up.
pub struct NodeStore(pub Store<Node>);

impl View for NodeStore {
    fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.0.get(&ObjectRef::new(name))
    }
}

/// The watch cache of bound pods, summarised.
pub struct BoundPodStore(pub Store<BoundPod>);

impl BoundPods for BoundPodStore {
    fn bound(&self) -> Vec<Arc<BoundPod>> {
        self.0.state()
    }
}

type Body = Full<Bytes>;

fn json(bytes: Vec<u8>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(bytes)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn is_json(value: Option<&header::HeaderValue>) -> bool {
    let Some(v) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = v.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
}

#[derive(Clone, Copy)]
enum Verb {
    Filter,
    Prioritize,
    Preempt,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Preempt => "preempt",
        }
    }
}

/// Routes one request.
pub async fn handle<B>(state: Arc<State>, request: Request<B>, bodies: serve::Bodies) -> Response<Body>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let verb = match request.uri().path() {
        "/filter" => Verb::Filter,
        "/prioritize" => Verb::Prioritize,
        "/preempt" => Verb::Preempt,
        path => {
            state.metrics.request("other", "not_found");
            return text(
                StatusCode::NOT_FOUND,
                format!(
                    "no such path: {path} (the verbs are POST /filter, POST /prioritize and POST /preempt)\n"
                ),
            );
        }
    };
    let started = Instant::now();
    let (result, response) = answer(&state, verb, request, &bodies).await;
    state.metrics.request(verb.name(), result);
    state
        .metrics
        .duration
        .get_or_create(&crate::metrics::VerbLabels { verb: verb.name() })
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn answer<B>(
    state: &State,
    verb: Verb,
    request: Request<B>,
    bodies: &serve::Bodies,
) -> (&'static str, Response<Body>)
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if request.method() != Method::POST {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("only POST is served at /{}\n", verb.name()),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
        return ("method", r);
    }
    let content_type = request.headers().get(header::CONTENT_TYPE);
    if !is_json(content_type) {
        let got = content_type
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_owned();
        let mut r = text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("content type must be application/json, got {got}\n"),
        );
        // The body is left unread: the connection cannot be reused.
        r.headers_mut()
            .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        return ("content_type", r);
    }
    let body = match bodies
        .read(request.into_body(), state.max_body_bytes, state.body_deadline)
        .await
    {
        Ok(b) => b,
        Err(e) => {
            let status = match e {
                BodyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
                BodyError::TooSlow(_) => StatusCode::REQUEST_TIMEOUT,
                BodyError::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
                BodyError::Read(_) => StatusCode::BAD_REQUEST,
            };
            let mut r = text(status, format!("{e}\n"));
            r.headers_mut()
                .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            return ("body", r);
        }
    };
    let exclusions = state.exclusions.borrow().clone();
    let ctx = Context {
        view: state.nodes.as_ref(),
        pods: state.pods.as_ref(),
        facts: &state.facts,
        exclusions: &exclusions,
        options: Options {
            now: jiff::Timestamp::now(),
            max_age: state.max_age,
        },
    };
    let bad = |e: &dyn std::fmt::Display| {
        let line = e.to_string().replace('\n', " ");
        ("decode", text(StatusCode::BAD_REQUEST, format!("{line}\n")))
    };
    let encoded = match verb {
        Verb::Preempt => {
            let args = match ExtenderPreemptionArgs::decode(&body) {
                Ok(a) => a,
                Err(e) => return bad(&e),
            };
            let (result, decisions) = preempt::preempt(&args, &ctx, ctx.pods);
            state.metrics.preemption(&decisions);
            for (node, decision) in &decisions {
                tracing::debug!(node, ?decision, "preemption candidate");
            }
            serde_json::to_vec(&result)
        }
        Verb::Filter | Verb::Prioritize => {
            let args = match ExtenderArgs::decode(&body) {
                Ok(a) => a,
                Err(e) => return bad(&e),
            };
            if matches!(verb, Verb::Filter) {
                let (result, outcomes) = extender::filter(&args, &ctx);
                state.metrics.outcomes(&outcomes);
                serde_json::to_vec(&result)
            } else {
                serde_json::to_vec(&extender::prioritize(&args, &ctx, state.score))
            }
        }
    };
    match encoded {
        Ok(bytes) => ("ok", json(bytes)),
        Err(e) => (
            "encode",
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot encode the answer: {e}\n"),
            ),
        ),
    }
}

/// Serves HTTPS on `listener` until `stop`; open connections are closed gracefully.
pub async fn serve_https(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    state: Arc<State>,
    stop: CancellationToken,
) {
    let counters = Arc::new(serve::Counters::default());
    serve::serve(
        listener,
        tls,
        serve::Limits::default(),
        counters,
        stop,
        move |request, peer| handle(state.clone(), request, peer.bodies),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;
    use prometheus_client::registry::Registry;
    use serde_json::json;

    struct NoNodes;

    struct NoPods;

    impl BoundPods for NoPods {
        fn bound(&self) -> Vec<Arc<BoundPod>> {
            Vec::new()
        }
    }

    impl View for NoNodes {
        fn node(&self, _: &str) -> Option<Arc<Node>> {
            None
        }
    }

    fn state() -> Arc<State> {
        let (_, exclusions) = watch::channel(Arc::new(Exclusions::default()));
        Arc::new(State {
            nodes: Arc::new(NoNodes),
            pods: Arc::new(NoPods),
            facts: FactsCache::default(),
            exclusions,
            max_age: None,
            score: Score::Binpack,
            metrics: Metrics::new(&mut Registry::default()),
            max_body_bytes: 1024,
            body_deadline: Duration::from_secs(1),
        })
    }

    async fn call(method: &str, path: &str, content_type: &str, body: &str) -> (u16, String) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let response = handle(state(), request, serve::Bodies::unshared(1 << 20, 1 << 20)).await;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    const JSON: &str = "application/json";

    #[tokio::test]
    async fn the_verbs_answer_json_with_the_protocols_field_names() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
        let args = json!({"Pod": pod, "NodeNames": ["a", "b"]}).to_string();
        let (status, body) = call("POST", "/filter", JSON, &args).await;
        assert_eq!(status, 200);
        let out: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(out["NodeNames"], json!(["a", "b"]));
        let (status, body) = call("POST", "/prioritize", "application/json; charset=utf-8", &args).await;
        assert_eq!(status, 200);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap(),
            json!([{"Host": "a", "Score": 0}, {"Host": "b", "Score": 0}])
        );
        let args = json!({"Pod": pod, "NodeNameToVictims": null,
                          "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0}}});
        let (status, body) = call("POST", "/preempt", JSON, &args.to_string()).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap(),
            json!({"NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0}}}),
            "a node that is not a virtual node keeps its victims"
        );
    }

    #[tokio::test]
    async fn bad_requests_get_a_precise_status_and_one_line() {
        let cases = [
            ("GET", "/filter", JSON, "", 405, "only POST is served at /filter"),
            ("POST", "/bind", JSON, "{}", 404, "no such path: /bind"),
            (
                "POST",
                "/filter",
                "text/plain",
                "{}",
                415,
                "content type must be application/json, got text/plain",
            ),
            (
                "POST",
                "/filter",
                JSON,
                &"x".repeat(2048),
                413,
                "request body larger than 1024 bytes",
            ),
            (
                "POST",
                "/filter",
                JSON,
                "{\"Pod\": 1}",
                400,
                "the body is not ExtenderArgs JSON",
            ),
            (
                "POST",
                "/prioritize",
                JSON,
                "{\"Pod\": {}}",
                400,
                "ExtenderArgs has neither Nodes nor NodeNames",
            ),
            (
                "POST",
                "/preempt",
                JSON,
                "{\"Pod\": {}, \"NodeNames\": []}",
                400,
                "ExtenderPreemptionArgs has neither NodeNameToVictims nor NodeNameToMetaVictims",
            ),
        ];
        for (method, path, content_type, body, want, needle) in cases {
            let (status, text) = call(method, path, content_type, body).await;
            assert_eq!(status, want, "{method} {path}: {text}");
            assert!(text.starts_with(needle), "{method} {path}: {text}");
            assert_eq!(text.lines().count(), 1, "{text}");
        }
    }
}
