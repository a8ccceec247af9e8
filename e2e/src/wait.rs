//! Polling helpers for tests: wait until a condition holds, with a deadline and a message
//! that says what was awaited and what was last seen.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `probe` every `every` until it returns `Some`, or fails after `timeout` with the
/// last observation (`probe`'s `Err`) in the message.
pub async fn until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut probe: F,
) -> crate::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(v) => return Ok(v),
            Err(seen) => seen,
        };
        if Instant::now() >= deadline {
            return Err(crate::Error::Timeout {
                what: format!("{what}; last seen: {last}"),
                secs: timeout.as_secs(),
            });
        }
        tokio::time::sleep(every).await;
    }
}

/// [`until`] for tests: panics with what was awaited and what was last seen.
pub async fn must<T, F, Fut>(what: &str, timeout: Duration, every: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    match until(what, timeout, every, probe).await {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    }
}

/// [`must`] for up to `secs` seconds, polling every 250 ms.
pub async fn within<T, F, Fut>(what: &str, secs: u64, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    must(what, Duration::from_secs(secs), Duration::from_millis(250), probe).await
}
