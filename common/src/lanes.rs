//! A client's connections to its apiserver as lanes: each lane is an HTTP client of its own
//! (one HTTP/2 connection, when the apiserver offers HTTP/2), and a call takes the lane with
//! the fewest streams open, a new lane when every lane has [`STREAMS_PER_LANE`].
//!
//! An apiserver lets a connection have only so many streams open at once (100 by default,
//! `--http2-max-streams-per-connection`), and an HTTP/2 client that reaches the limit holds
//! every further call until a stream ends. A watch's stream never ends, so a client with
//! more watches than the limit (a namespace-scoped credential watches each namespace apart)
//! would hold its calls for good. client-go opens another connection then; lanes do the same,
//! before the limit: the connections a client holds grow with the calls and watches it has
//! open at once, a lane for every [`STREAMS_PER_LANE`], never with the objects it serves.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};

/// The streams a lane takes before a call opens another lane: below the apiserver's default
/// limit of a connection's streams (100), with room for the calls of a burst.
pub const STREAMS_PER_LANE: usize = 64;

/// See the module doc. `S` is one lane's HTTP client, made by `make` when a lane is opened.
pub struct Lanes<S> {
    make: Arc<dyn Fn() -> S + Send + Sync>,
    lanes: Arc<Mutex<Vec<Lane<S>>>>,
    per_lane: usize,
}

impl<S> Clone for Lanes<S> {
    fn clone(&self) -> Self {
        Self {
            make: self.make.clone(),
            lanes: self.lanes.clone(),
            per_lane: self.per_lane,
        }
    }
}

struct Lane<S> {
    client: S,
    open: Arc<AtomicUsize>,
}

impl<S> Lanes<S> {
    /// Lanes made by `make`, opened as calls need them.
    pub fn new(make: impl Fn() -> S + Send + Sync + 'static) -> Self {
        Self::with_streams_per_lane(make, STREAMS_PER_LANE)
    }

    fn with_streams_per_lane(make: impl Fn() -> S + Send + Sync + 'static, per_lane: usize) -> Self {
        Self {
            make: Arc::new(make),
            lanes: Arc::default(),
            per_lane: per_lane.max(1),
        }
    }

    /// How many lanes are open (each holds its connection while a stream or its pool keeps
    /// it).
    #[cfg(test)]
    fn lanes(&self) -> usize {
        self.lanes
            .lock()
            .map(|l| l.len())
            .unwrap_or_else(|p| p.into_inner().len())
    }
}

impl<S: Clone> Lanes<S> {
    /// The lane a new call takes, and the count of its open streams (the call's included).
    fn take(&self) -> (S, Open) {
        let mut lanes = match self.lanes.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        let least = lanes
            .iter()
            .enumerate()
            .min_by_key(|(_, lane)| lane.open.load(Ordering::Relaxed))
            .filter(|(_, lane)| lane.open.load(Ordering::Relaxed) < self.per_lane)
            .map(|(i, _)| i);
        let i = match least {
            Some(i) => i,
            None => {
                lanes.push(Lane {
                    client: (self.make)(),
                    open: Arc::default(),
                });
                lanes.len() - 1
            }
        };
        let lane = &lanes[i];
        lane.open.fetch_add(1, Ordering::Relaxed);
        (lane.client.clone(), Open(lane.open.clone()))
    }
}

/// A stream counted open on its lane until dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<S, ReqBody, B> tower::Service<Request<ReqBody>> for Lanes<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = Response<Counted<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        // A lane's client is ready when it is called (hyper's is always ready).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (mut client, open) = self.take();
        Box::pin(async move {
            let response = client.call(req).await?;
            Ok(response.map(|body| Counted { body, _open: open }))
        })
    }
}

/// A response body that keeps its stream counted open on its lane until it is dropped.
pub struct Counted<B> {
    body: B,
    _open: Open,
}

impl<B> Body for Counted<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::Service as _;

    /// Lanes over a fake client that answers at once with an empty body and says which lane
    /// (by the order lanes were made) took the call.
    fn numbered(
        per_lane: usize,
    ) -> Lanes<
        tower::util::BoxCloneSyncService<
            Request<()>,
            Response<http_body_util::Empty<Bytes>>,
            std::convert::Infallible,
        >,
    > {
        let made = Arc::new(AtomicUsize::new(0));
        Lanes::with_streams_per_lane(
            move || {
                let lane = made.fetch_add(1, Ordering::Relaxed);
                tower::util::BoxCloneSyncService::new(tower::service_fn(
                    move |_req: Request<()>| async move {
                        let mut response = Response::new(http_body_util::Empty::new());
                        response.extensions_mut().insert(lane);
                        Ok(response)
                    },
                ))
            },
            per_lane,
        )
    }

    fn lane_of<B>(response: &Response<B>) -> usize {
        *response.extensions().get::<usize>().unwrap()
    }

    #[tokio::test]
    async fn a_call_takes_the_least_busy_lane_and_opens_one_only_when_every_lane_is_full() {
        let mut lanes = numbered(3);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(lanes.call(Request::new(())).await.unwrap());
        }
        assert!(
            held.iter().all(|r| lane_of(r) == 0),
            "three streams fit the first lane"
        );
        assert_eq!(lanes.lanes(), 1);
        let fourth = lanes.call(Request::new(())).await.unwrap();
        assert_eq!(lane_of(&fourth), 1, "a full lane sends the call to a new one");
        assert_eq!(lanes.lanes(), 2);
        // Two streams of the first lane end: it is now the least busy (1 against 1, the
        // first found), and no lane is opened.
        held.truncate(1);
        let next = lanes.call(Request::new(())).await.unwrap();
        assert_eq!(lane_of(&next), 0);
        let next = lanes.call(Request::new(())).await.unwrap();
        assert_eq!(lane_of(&next), 1);
        assert_eq!(lanes.lanes(), 2);
    }

    #[tokio::test]
    async fn a_stream_is_counted_until_its_response_body_is_gone() {
        use http_body_util::BodyExt as _;
        let mut lanes = numbered(1);
        let first = lanes.call(Request::new(())).await.unwrap();
        let (_, body) = first.into_parts();
        let body = body.collect().await;
        assert!(body.is_ok());
        // The body was consumed by `collect`, and with it the count.
        let again = lanes.call(Request::new(())).await.unwrap();
        assert_eq!(lane_of(&again), 0, "the finished stream freed its lane");
        let other = lanes.call(Request::new(())).await.unwrap();
        assert_eq!(lane_of(&other), 1, "a stream still held keeps its lane full");
    }

    #[tokio::test]
    async fn a_failed_call_frees_its_stream() {
        let made = Arc::new(AtomicUsize::new(0));
        let mut lanes = Lanes::with_streams_per_lane(
            move || {
                made.fetch_add(1, Ordering::Relaxed);
                tower::service_fn(|_req: Request<()>| async {
                    Err::<Response<http_body_util::Empty<Bytes>>, _>("refused")
                })
            },
            1,
        );
        for _ in 0..3 {
            assert!(lanes.call(Request::new(())).await.is_err());
        }
        assert_eq!(
            lanes.lanes(),
            1,
            "failed calls hold no stream, so one lane serves them all"
        );
    }
}
