//! The limit on API writes (`--client-qps`/`--client-burst`, `--upper-qps`/`--upper-burst`):
//! bursts up to `burst`, `qps` sustained, with `governor`'s GCRA limiter (lock-free, one
//! atomic per write). Sized for thousands of pods by default; a cluster's own API priority
//! and fairness still has the last word.

use std::num::NonZeroU32;
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

#[derive(Clone, Debug)]
pub struct WriteLimit(Option<Arc<DefaultDirectRateLimiter>>);

impl WriteLimit {
    /// `qps == 0` disables limiting.
    pub fn new(qps: u32, burst: u32) -> Self {
        let Some(qps) = NonZeroU32::new(qps) else {
            return WriteLimit(None);
        };
        let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
        WriteLimit(Some(Arc::new(RateLimiter::direct(
            Quota::per_second(qps).allow_burst(burst),
        ))))
    }

    /// Waits until one more write is allowed.
    pub async fn acquire(&self) {
        if let Some(limiter) = &self.0 {
            limiter.until_ready().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[tokio::test]
    async fn bursts_then_paces() {
        let limit = WriteLimit::new(100, 5);
        let start = Instant::now();
        for _ in 0..5 {
            limit.acquire().await;
        }
        assert!(start.elapsed() < Duration::from_millis(20), "the burst is free");
        for _ in 0..10 {
            limit.acquire().await;
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(90) && took < Duration::from_millis(400),
            "ten more writes at 100 per second: {took:?}"
        );
        let unlimited = WriteLimit::new(0, 0);
        let start = Instant::now();
        for _ in 0..1000 {
            unlimited.acquire().await;
        }
        assert!(start.elapsed() < Duration::from_millis(50));
    }
}
