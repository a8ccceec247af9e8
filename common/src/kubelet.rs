//! Pieces of the kubelet API shared by every endpoint that serves it (served by
//! [`crate::serve`]): plain-text and streamed responses, and the query options of
//! `containerLogs`, parsed exactly as the kubelet parses them.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use jiff::{SignedDuration, Timestamp};

/// Response body of every kubelet API handler.
pub type Body = BoxBody<Bytes, Infallible>;

/// A plain-text response.
pub fn text(status: StatusCode, body: impl Into<String>) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body.into())).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// A plain-text response streamed from `chunks`; each chunk is flushed as it comes, so a
/// following client (`kubectl logs -f`) sees lines at once.
pub fn streamed(chunks: tokio::sync::mpsc::Receiver<Bytes>) -> Response<Body> {
    let stream = futures::stream::unfold(chunks, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// The kubelet's `containerLogs` query options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub tail_lines: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub since_seconds: Option<u64>,
    pub since_time: Option<Timestamp>,
}

impl LogOptions {
    /// Parses a query string; errors name the parameter.
    pub fn from_query(query: &str) -> Result<Self, String> {
        let mut o = LogOptions::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let flag = || match value.as_ref() {
                "" | "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                v => Err(format!("{key}={v:?}: not a boolean")),
            };
            let count = || {
                value
                    .parse::<i64>()
                    .map_err(|_| format!("{key}={value:?}: not an integer"))
                    .and_then(|n| u64::try_from(n).map_err(|_| format!("{key}={n}: must not be negative")))
            };
            let positive = || {
                count().and_then(|n| {
                    if n == 0 {
                        Err(format!("{key}=0: must be positive"))
                    } else {
                        Ok(n)
                    }
                })
            };
            match key.as_ref() {
                "follow" => o.follow = flag()?,
                "previous" => o.previous = flag()?,
                "timestamps" => o.timestamps = flag()?,
                "tailLines" => o.tail_lines = Some(count()?),
                "limitBytes" => o.limit_bytes = Some(positive()?),
                "sinceSeconds" => o.since_seconds = Some(positive()?),
                "sinceTime" => {
                    o.since_time = Some(
                        value
                            .parse::<Timestamp>()
                            .map_err(|e| format!("sinceTime={value:?}: not RFC 3339: {e}"))?,
                    )
                }
                _ => {}
            }
        }
        if o.since_seconds.is_some() && o.since_time.is_some() {
            return Err("sinceSeconds and sinceTime are mutually exclusive".into());
        }
        Ok(o)
    }

    /// Earliest timestamp a line may have, if the options bound it.
    pub fn since(&self, now: Timestamp) -> Option<Timestamp> {
        match (self.since_seconds, self.since_time) {
            (Some(s), _) => now.checked_sub(SignedDuration::from_secs(s as i64)).ok(),
            (None, t) => t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_and_bad_ones_are_named() {
        let o = LogOptions::from_query(
            "follow=true&tailLines=5&timestamps=1&limitBytes=100&sinceTime=2026-01-02T03%3A04%3A05Z",
        )
        .unwrap();
        assert!(o.follow && o.timestamps && !o.previous);
        assert_eq!(o.tail_lines, Some(5));
        assert_eq!(o.limit_bytes, Some(100));
        assert_eq!(o.since_time, Some("2026-01-02T03:04:05Z".parse().unwrap()));
        for (q, needle) in [
            ("tailLines=x", "tailLines"),
            ("tailLines=-1", "negative"),
            ("limitBytes=0", "limitBytes"),
            ("sinceTime=yesterday", "sinceTime"),
            (
                "sinceSeconds=5&sinceTime=2026-01-02T03:04:05Z",
                "mutually exclusive",
            ),
            ("follow=maybe", "follow"),
        ] {
            let err = LogOptions::from_query(q).unwrap_err();
            assert!(err.contains(needle), "{q}: {err}");
        }
    }
}
