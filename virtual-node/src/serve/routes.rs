//! The kubelet API's routes: each request is authenticated and authorized
//! ([`crate::serve::kubelet`]), then answered by its handler: `containerLogs`
//! ([`crate::serve::logs`]), exec, attach and port-forward ([`crate::serve::streams`]), and
//! the summary and resource metrics ([`crate::serve::stats`]).

use std::sync::Arc;
use std::time::Instant;

use tensile_common::serve::{self, Peer};

use crate::serve::streams;

use crate::serve::kubelet::Attributes;
use crate::serve::kubelet::KubeletState;
use crate::serve::kubelet::PodPath;
use crate::serve::kubelet::SUMMARY_CONCURRENCY;
use crate::serve::kubelet::SUMMARY_TTL;
use crate::serve::kubelet::identity;
use crate::serve::kubelet::resolve;
use crate::serve::kubelet::resolve_in;
use crate::serve::kubelet::verb;
use crate::serve::logs::logs;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use tensile_common::kubelet::{Body, LogOptions, text};
use tokio::net::TcpListener;

pub async fn serve(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    limits: serve::Limits,
    counters: Arc<serve::Counters>,
    state: Arc<KubeletState>,
    stop: tokio_util::sync::CancellationToken,
) {
    // Every spliced session ends with the server, also when this future is dropped.
    let _sessions = state.sessions.stop.clone().drop_guard();
    serve::serve(listener, config, limits, counters, stop, move |req, peer| {
        let state = state.clone();
        async move { route(&state, &peer, req).await }
    })
    .await
}

async fn route(state: &KubeletState, peer: &Peer, req: Request<Incoming>) -> Response<Body> {
    let identity = match identity(peer) {
        Ok(identity) => identity,
        Err(refusal) => return text(StatusCode::UNAUTHORIZED, refusal),
    };
    if state.require_client_cert && identity.is_none() {
        return text(
            StatusCode::UNAUTHORIZED,
            "a client certificate signed by the kubelet client CA (--client-verify-ca) is required",
        );
    }
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (user, groups) = identity.unwrap_or_else(|| {
        (
            "system:anonymous".to_owned(),
            vec!["system:unauthenticated".to_owned()],
        )
    });
    // As a 1.36+ kubelet (KubeletFineGrainedAuthz: beta and on from 1.33, GA 1.36): the
    // fine-grained subresource first, then the one it falls back to.
    let wanted = subresources(&segments);
    let mut allowed = false;
    for subresource in wanted {
        let attributes = Attributes {
            user: user.clone(),
            groups: groups.clone(),
            verb: verb(req.method()),
            subresource,
        };
        match state.authorizer.allows(&state.node, &attributes).await {
            Ok(true) => {
                allowed = true;
                break;
            }
            Ok(false) => {}
            Err(e) => {
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("authorisation failed: {e}"),
                );
            }
        }
    }
    if !allowed {
        let names: Vec<String> = wanted.iter().map(|s| format!("nodes/{s}")).collect();
        return text(
            StatusCode::FORBIDDEN,
            format!(
                "user {user} may not {} {} of node {}",
                verb(req.method()),
                names.join(" or "),
                state.node
            ),
        );
    }
    if let Some(target) = streams::parse_path(&segments) {
        let target = match target {
            Ok(t) => t,
            Err(e) => return streams::refusal(StatusCode::BAD_REQUEST, e),
        };
        if !matches!(*req.method(), http::Method::GET | http::Method::POST) {
            return streams::refusal(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{path}: {} takes GET or POST", target.kind.name()),
            );
        }
        let path = PodPath {
            namespace: &target.namespace,
            name: &target.pod,
            uid: target.uid.as_deref(),
        };
        if let Err(e) = resolve_in(state, path) {
            state.metrics.stream_refused(target.kind.name(), "not_on_node");
            return streams::refusal(StatusCode::NOT_FOUND, e);
        }
        return streams::splice(&state.lower, &state.metrics, &state.sessions, &target, req).await;
    }
    let get = req.method() == http::Method::GET;
    match segments.as_slice() {
        ["healthz"] if get => text(StatusCode::OK, "ok"),
        ["pods"] | ["pods", ""] if get => json(&pods(state, false)),
        ["runningpods"] | ["runningpods", ""] if get => json(&pods(state, true)),
        ["configz"] if get => json(&configz(state)),
        ["stats", "summary"] | ["metrics", "resource"] if get => match summary(state).await {
            Ok(summary) if segments[0] == "stats" => json(&summary),
            Ok(summary) => text(StatusCode::OK, crate::serve::stats::resource_metrics(&summary)),
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, e),
        },
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

fn json(value: &serde_json::Value) -> Response<Body> {
    let mut response = text(StatusCode::OK, value.to_string());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

/// The lower nodes' summaries, from the last fan-out when it is younger than [`SUMMARY_TTL`].
/// Concurrent scrapes wait on one fan-out instead of each starting their own.
async fn lower_summaries(state: &KubeletState) -> Result<Arc<Vec<serde_json::Value>>, String> {
    if !state.read_lower_nodes {
        return Err(
            "usage is read from the lower nodes' summaries, and a namespace-scoped virtual node (--lower-namespaces) reads no lower node"
                .into(),
        );
    }
    let mut last = state.summaries.lock().await;
    if let Some((at, summaries)) = last.as_ref()
        && at.elapsed() < SUMMARY_TTL
    {
        return Ok(summaries.clone());
    }
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(state.lower.clone())
        .list_metadata(&Default::default())
        .await
        .map_err(|e| format!("the lower cluster cannot be reached: {e}"))?;
    let fetches = nodes
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .map(|name| {
            let lower = state.lower.clone();
            async move {
                let request = http::Request::get(format!("/api/v1/nodes/{name}/proxy/stats/summary"))
                    .body(Vec::new())
                    .map_err(|e| e.to_string())?;
                let text = lower
                    .request_text(request)
                    .await
                    .map_err(|e| format!("{name}: {e}"))?;
                serde_json::from_str::<serde_json::Value>(&text).map_err(|e| format!("{name}: {e}"))
            }
        });
    let results: Vec<_> = futures::stream::iter(fetches)
        .buffer_unordered(SUMMARY_CONCURRENCY)
        .collect()
        .await;
    let mut summaries = Vec::new();
    for result in results {
        match result {
            Ok(s) => summaries.push(s),
            // A node that does not answer counts as using nothing, as metrics-server skips it.
            Err(e) => tracing::debug!(error = %e, "lower node summary"),
        }
    }
    let summaries = Arc::new(summaries);
    *last = Some((Instant::now(), summaries.clone()));
    Ok(summaries)
}

/// The node's summary from the lower nodes' summaries ([`crate::serve::stats`]). A lower pod's
/// figures are shown only for the lower pod this node made for an upper pod bound here
/// ([`resolve`]), never for another tenant's pod of the same name.
async fn summary(state: &KubeletState) -> Result<serde_json::Value, String> {
    let summaries = lower_summaries(state).await?;
    let time = jiff::Timestamp::now().to_string();
    Ok(crate::serve::stats::aggregate(
        &state.node,
        &summaries,
        &time,
        |ns, name, lower_uid| {
            let upper = state.upper_pods.get(&ObjectRef::new(name).within(ns))?;
            let lower = state.lower_pods.get(&ObjectRef::new(name).within(ns))?;
            if lower.metadata.uid.as_deref() != Some(lower_uid) {
                return None;
            }
            let path = PodPath {
                namespace: ns,
                name,
                uid: None,
            };
            resolve(&state.node, Some(&upper), Some(&lower), path).ok()?;
            Some((
                ns.to_owned(),
                name.to_owned(),
                upper.packed.metadata.uid.clone().unwrap_or_default(),
            ))
        },
    ))
}

/// The kubelet's subresources for a path, in the order they are tried (`nodes/<subresource>`
/// is what is authorised), as a kubelet of 1.36+ names them.
fn subresources(segments: &[&str]) -> &'static [&'static str] {
    match segments.first().copied() {
        Some("pods" | "runningpods") => &["pods", "proxy"],
        Some("healthz") => &["healthz", "proxy"],
        Some("configz") => &["configz", "proxy"],
        Some("flagz") => &["configz"],
        Some("stats") => &["stats"],
        Some("metrics") => &["metrics"],
        Some("logs") => &["log"],
        Some("checkpoint") => &["checkpoint"],
        Some("statusz") => &["statusz"],
        _ => &["proxy"],
    }
}

/// The kubelet's `/pods` (or, `running`, `/runningpods`): the upper pods bound to this node,
/// as a PodList, with the status the node last wrote for them. Nothing of the lower cluster.
fn pods(state: &KubeletState, running: bool) -> serde_json::Value {
    let mut items: Vec<serde_json::Value> = state
        .upper_pods
        .state()
        .iter()
        .filter_map(|p| p.pod().ok())
        .filter(|p| !running || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| serde_json::to_value(p).ok())
        .collect();
    items.sort_by(|a, b| {
        let key = |v: &serde_json::Value| {
            (
                v["metadata"]["namespace"].as_str().unwrap_or_default().to_owned(),
                v["metadata"]["name"].as_str().unwrap_or_default().to_owned(),
            )
        };
        key(a).cmp(&key(b))
    });
    serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
}

/// The kubelet's `/configz`: what of a KubeletConfiguration this node's kubelet API is.
fn configz(state: &KubeletState) -> serde_json::Value {
    let mode = match state.authorizer {
        crate::serve::kubelet::Authorizer::Webhook { .. } => "Webhook",
        crate::serve::kubelet::Authorizer::AlwaysAllow => "AlwaysAllow",
    };
    serde_json::json!({"kubeletconfig": {
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "authentication": {"anonymous": {"enabled": !state.require_client_cert},
                           "webhook": {"enabled": false}},
        "authorization": {"mode": mode},
    }})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_path_is_authorised_as_a_kubelet_of_1_36_names_it() {
        let of = |path: &str| subresources(&path.trim_start_matches('/').split('/').collect::<Vec<_>>());
        assert_eq!(of("/pods"), ["pods", "proxy"]);
        assert_eq!(of("/runningpods/"), ["pods", "proxy"]);
        assert_eq!(of("/healthz"), ["healthz", "proxy"]);
        assert_eq!(of("/configz"), ["configz", "proxy"]);
        assert_eq!(of("/flagz"), ["configz"]);
        assert_eq!(of("/stats/summary"), ["stats"]);
        assert_eq!(of("/metrics/resource"), ["metrics"]);
        assert_eq!(of("/logs/kubelet.log"), ["log"]);
        assert_eq!(of("/containerLogs/ns/pod/c"), ["proxy"]);
        assert_eq!(of("/exec/ns/pod/c"), ["proxy"]);
        assert_eq!(of("/portForward/ns/pod"), ["proxy"]);
    }
}
