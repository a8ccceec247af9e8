//! The limit on API writes (`--client-qps`/`--client-burst`, `--upper-qps`/`--upper-burst`):
//! bursts up to `burst`, `qps` sustained, with `governor`'s GCRA limiter (lock-free, one
//! atomic per write). Sized for thousands of pods by default; a cluster's own API priority
//! and fairness still has the last word.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

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

/// Per-key retry delays: 1 s doubling to 5 min (`backon`'s exponential backoff, one per
/// failing key), forgotten on success.
#[derive(Debug, Default)]
pub struct Backoff(std::sync::Mutex<std::collections::HashMap<String, backon::ExponentialBackoff>>);

impl Backoff {
    const FIRST: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);

    fn delays() -> backon::ExponentialBackoff {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::default()
            .with_min_delay(Self::FIRST)
            .with_max_delay(Self::MAX)
            .with_factor(2.0)
            .without_max_times()
            .build()
    }

    /// The delay before retrying `key` after one more failure.
    pub fn next_delay(&self, key: &str) -> Duration {
        let Ok(mut failures) = self.0.lock() else {
            return Self::MAX;
        };
        failures
            .entry(key.to_owned())
            .or_insert_with(Self::delays)
            .next()
            .unwrap_or(Self::MAX)
    }

    /// Whether `key` failed since its last success.
    pub fn failing(&self, key: &str) -> bool {
        self.0.lock().is_ok_and(|failures| failures.contains_key(key))
    }

    /// Keeps only the counts of keys `keep` says are still live.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        if let Ok(mut failures) = self.0.lock() {
            failures.retain(|key, _| keep(key));
        }
    }

    pub fn forget(&self, key: &str) {
        if let Ok(mut failures) = self.0.lock() {
            failures.remove(key);
        }
    }

    /// Forgets every count: the failures came from a lower cluster that did not answer and
    /// now does, so each pod's next failure waits 1 s again, not the minutes an outage grew.
    pub fn forget_all(&self) {
        if let Ok(mut failures) = self.0.lock() {
            failures.clear();
        }
    }
}

/// Per-key retries for a keeper that passes over its keys on a timer: a key that failed is
/// passed by until its [`Backoff`] delay is over, and starts over at 1 s after a success.
#[derive(Debug, Default)]
pub struct Deferred {
    delays: Backoff,
    until: std::sync::Mutex<std::collections::HashMap<String, tokio::time::Instant>>,
}

impl Deferred {
    /// Whether `key` failed and its delay is not over at `now`.
    pub fn waits(&self, key: &str, now: tokio::time::Instant) -> bool {
        self.until
            .lock()
            .is_ok_and(|u| u.get(key).is_some_and(|next| *next > now))
    }

    /// `key` failed at `now`: the delay before it is tried again.
    pub fn failed(&self, key: &str, now: tokio::time::Instant) -> Duration {
        let delay = self.delays.next_delay(key);
        if let Ok(mut u) = self.until.lock() {
            u.insert(key.to_owned(), now + delay);
        }
        delay
    }

    pub fn succeeded(&self, key: &str) {
        if let Ok(mut u) = self.until.lock() {
            u.remove(key);
        }
        self.delays.forget(key);
    }

    /// How many keys wait.
    pub fn len(&self) -> usize {
        self.until.lock().map_or(0, |u| u.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the keys `keep` says are still live.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        if let Ok(mut u) = self.until.lock() {
            u.retain(|key, _| keep(key));
        }
        self.delays.retain(keep);
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

    #[test]
    fn retries_double_per_failure_up_to_five_minutes_and_start_over_after_a_success() {
        let b = Backoff::default();
        let delays: Vec<u64> = (0..12).map(|_| b.next_delay("p").as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(b.next_delay("other").as_secs(), 1, "each pod has its own count");
        b.forget("p");
        assert_eq!(b.next_delay("p").as_secs(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_key_waits_its_delay_and_a_success_starts_it_over() {
        let d = Deferred::default();
        let now = tokio::time::Instant::now();
        assert!(!d.waits("p", now));
        assert_eq!(d.failed("p", now), Duration::from_secs(1));
        assert!(d.waits("p", now) && !d.waits("q", now));
        assert!(!d.waits("p", now + Duration::from_secs(1)));
        assert_eq!(d.failed("p", now), Duration::from_secs(2));
        d.succeeded("p");
        assert!(!d.waits("p", now) && d.is_empty());
        assert_eq!(d.failed("p", now), Duration::from_secs(1));
        d.retain(|k| k != "p");
        assert!(d.is_empty() && !d.waits("p", now));
    }

    #[test]
    fn an_outage_s_grown_retries_start_over_for_every_pod() {
        let b = Backoff::default();
        for _ in 0..8 {
            b.next_delay("p");
            b.next_delay("q");
        }
        assert_eq!(b.next_delay("p").as_secs(), 256);
        b.forget_all();
        assert_eq!(b.next_delay("p").as_secs(), 1);
        assert_eq!(b.next_delay("q").as_secs(), 1);
    }
}
