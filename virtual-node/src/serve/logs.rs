//! `containerLogs`: a lower pod's logs, forwarded from the lower cluster.

use crate::serve::kubelet::KubeletState;
use crate::serve::kubelet::PodPath;
use crate::serve::kubelet::resolve_in;
use bytes::Bytes;
use futures::AsyncReadExt;
use http::{Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};
use tensile_common::kubelet::{Body, LogOptions, streamed, text};

pub async fn logs(
    state: &KubeletState,
    ns: &str,
    pod: &str,
    container: &str,
    o: LogOptions,
) -> Response<Body> {
    let path = PodPath {
        namespace: ns,
        name: pod,
        uid: None,
    };
    if let Err(e) = resolve_in(state, path) {
        return text(StatusCode::NOT_FOUND, e);
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
    // A followed log holds its stream for as long as the caller reads: it takes a slot of the
    // long-lived streams, within its namespace's share.
    let slot = match o.follow.then(|| state.sessions.take(ns)).transpose() {
        Ok(slot) => slot,
        Err(full) => {
            let (why, message) = state.sessions.refused(full, "logs", ns);
            state.metrics.stream_refused("logs", why);
            return text(StatusCode::SERVICE_UNAVAILABLE, message);
        }
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
    // A followed log holds a lower connection for as long as it streams: counted, so a
    // stream left open after its caller went shows.
    let session = o.follow.then(|| state.metrics.stream_opened("logs"));
    tokio::spawn(async move {
        let _session = (session, slot);
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let read = tokio::select! {
                read = reader.read(&mut buf) => read,
                // The caller is gone (its response body was dropped): a quiet container
                // would otherwise keep the lower stream open until it writes again.
                _ = tx.closed() => return,
            };
            match read {
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
