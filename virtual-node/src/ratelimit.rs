//! A token bucket for API writes (`--client-qps`/`--client-burst`): bursts up to `burst`,
//! `qps` sustained. Sized for thousands of pods by default; a cluster's own API priority
//! and fairness still has the last word.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct TokenBucket {
    inner: Option<Arc<Mutex<State>>>,
}

#[derive(Debug)]
struct State {
    tokens: f64,
    last: Instant,
    qps: f64,
    burst: f64,
}

impl TokenBucket {
    /// `qps == 0` disables limiting.
    pub fn new(qps: u32, burst: u32) -> Self {
        if qps == 0 {
            return Self { inner: None };
        }
        let burst = f64::from(burst.max(1));
        Self {
            inner: Some(Arc::new(Mutex::new(State {
                tokens: burst,
                last: Instant::now(),
                qps: f64::from(qps),
                burst,
            }))),
        }
    }

    /// Waits for one token.
    pub async fn acquire(&self) {
        let Some(inner) = &self.inner else { return };
        let wait = {
            let mut s = inner.lock().await;
            let now = Instant::now();
            s.tokens = (s.tokens + now.duration_since(s.last).as_secs_f64() * s.qps).min(s.burst);
            s.last = now;
            s.tokens -= 1.0;
            if s.tokens >= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-s.tokens / s.qps)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bursts_then_paces() {
        let bucket = TokenBucket::new(10, 5);
        let start = Instant::now();
        for _ in 0..5 {
            bucket.acquire().await;
        }
        assert!(start.elapsed() < Duration::from_millis(1), "the burst is free");
        for _ in 0..10 {
            bucket.acquire().await;
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(990) && took < Duration::from_millis(1100),
            "{took:?}"
        );
        let unlimited = TokenBucket::new(0, 0);
        for _ in 0..1000 {
            unlimited.acquire().await;
        }
    }
}
