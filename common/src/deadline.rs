//! Deadlines on API calls: a tower layer every client of the suite carries.
//!
//! A call must be answered, headers and body, within its deadline; a call that is not fails
//! with [`Exceeded`] and its request is dropped (an HTTP/1.1 connection with it; an HTTP/2
//! stream is reset), so a half-open connection to an apiserver frees the task that waits on
//! it instead of holding it (and, for the node's Lease, the node's health) forever. Watches
//! and followed log streams are exempt: they are meant to stay open. An HTTP/2 connection
//! that stops answering is closed by its ping ([`crate::kubeconfig::PING_TIMEOUT`]), with the
//! watches on it, which are then made again.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The error of a call that outlived its deadline.
#[derive(Debug, thiserror::Error)]
#[error("{what}: no complete answer within {} s", .after.as_secs_f64())]
pub struct Exceeded {
    pub what: String,
    pub after: Duration,
}

/// Adds [`Deadline`] to a client's service stack.
#[derive(Clone, Copy, Debug)]
pub struct DeadlineLayer {
    pub deadline: Duration,
}

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            deadline: self.deadline,
        }
    }
}

/// See the module doc.
#[derive(Clone, Debug)]
pub struct Deadline<S> {
    inner: S,
    deadline: Duration,
}

/// Whether a request is meant to stay open: a watch, a followed log, or an upgrade (exec,
/// attach, port-forward).
pub fn is_stream<B>(req: &Request<B>) -> bool {
    if req.headers().contains_key(http::header::UPGRADE) {
        return true;
    }
    req.uri().query().is_some_and(|q| {
        form_urlencoded::parse(q.as_bytes())
            .any(|(k, v)| (k == "watch" || k == "follow") && (v == "true" || v == "1"))
    })
}

impl<S, ReqBody, B> tower::Service<Request<ReqBody>> for Deadline<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Response = Response<TimedBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if is_stream(&req) {
            let call = self.inner.call(req);
            return Box::pin(async move {
                call.await
                    .map(|r| r.map(|inner| TimedBody { inner, until: None }))
                    .map_err(Into::into)
            });
        }
        let after = self.deadline;
        let until = tokio::time::Instant::now() + after;
        // Cheap clones (shared bytes); the message is only written if the deadline passes.
        let call_of = Call {
            method: req.method().clone(),
            uri: req.uri().clone(),
            after,
        };
        let call = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout_at(until, call).await {
                Ok(Ok(resp)) => Ok(resp.map(|inner| TimedBody {
                    inner,
                    until: Some((Box::pin(tokio::time::sleep_until(until)), call_of)),
                })),
                Ok(Err(e)) => Err(e.into()),
                Err(_) => Err(Box::new(call_of.exceeded()) as BoxError),
            }
        })
    }
}

/// The call a deadline belongs to, for its error.
struct Call {
    method: http::Method,
    uri: http::Uri,
    after: Duration,
}

impl Call {
    fn exceeded(self) -> Exceeded {
        Exceeded {
            what: format!("{} {}", self.method, self.uri.path()),
            after: self.after,
        }
    }
}

/// A response body that must be read to its end before the call's deadline.
pub struct TimedBody<B> {
    inner: B,
    until: Option<(Pin<Box<tokio::time::Sleep>>, Call)>,
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let expired = match &mut this.until {
            Some((sleep, _)) => sleep.as_mut().poll(cx).is_ready(),
            None => false,
        };
        match this.until.take() {
            Some((_, call)) if expired => Poll::Ready(Some(Err(Box::new(call.exceeded())))),
            until => {
                this.until = until;
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_followed_logs_and_upgrades_are_streams_and_plain_calls_are_not() {
        let req = |uri: &str| Request::get(uri).body(()).unwrap();
        assert!(is_stream(&req("/api/v1/pods?watch=true&resourceVersion=1")));
        assert!(is_stream(&req("/api/v1/pods?watch=1")));
        assert!(is_stream(&req("/api/v1/namespaces/a/pods/p/log?follow=true")));
        assert!(!is_stream(&req("/api/v1/namespaces/a/pods/p/log?follow=false")));
        assert!(!is_stream(&req("/api/v1/pods?labelSelector=watch%3Dtrue")));
        assert!(!is_stream(&req("/api/v1/namespaces/kube-node-lease/leases/n")));
        let exec = Request::get("/api/v1/namespaces/a/pods/p/exec?command=sh")
            .header(http::header::UPGRADE, "websocket")
            .body(())
            .unwrap();
        assert!(is_stream(&exec));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_without_an_answer_fails_at_its_deadline_and_a_watch_does_not() {
        use tower::{Layer as _, Service as _, ServiceExt as _};
        // An apiserver that never answers.
        let silent = tower::service_fn(|_req: Request<()>| async {
            futures::future::pending::<Result<Response<http_body_util::Empty<Bytes>>, BoxError>>().await
        });
        let mut svc = DeadlineLayer {
            deadline: Duration::from_secs(3),
        }
        .layer(silent);
        let call = svc
            .ready()
            .await
            .unwrap()
            .call(Request::patch("/api/v1/nodes/vn").body(()).unwrap());
        let started = tokio::time::Instant::now();
        let err = call.await.err().expect("the call fails");
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        assert!(err.to_string().contains("PATCH /api/v1/nodes/vn"), "{err}");
        let watch = svc
            .ready()
            .await
            .unwrap()
            .call(Request::get("/api/v1/pods?watch=true").body(()).unwrap());
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), watch)
                .await
                .is_err(),
            "a watch is not cut by the call deadline"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_fails_at_the_deadline() {
        use futures::StreamExt as _;
        use http_body_util::BodyExt as _;
        use tower::{Layer as _, Service as _, ServiceExt as _};
        let stalls = tower::service_fn(|_req: Request<()>| async {
            let frames = futures::stream::iter([Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"{")))])
                .chain(futures::stream::pending());
            Ok::<_, BoxError>(Response::new(http_body_util::StreamBody::new(frames)))
        });
        let mut svc = DeadlineLayer {
            deadline: Duration::from_secs(2),
        }
        .layer(stalls);
        let resp = svc
            .ready()
            .await
            .unwrap()
            .call(Request::get("/api/v1/nodes").body(()).unwrap())
            .await
            .unwrap();
        let err = match resp.into_body().collect().await {
            Ok(_) => panic!("the body read should fail"),
            Err(e) => e,
        };
        assert!(err.to_string().contains("GET /api/v1/nodes"), "{err}");
    }
}
