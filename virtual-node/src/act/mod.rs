//! What a virtual node writes. The planners of [`crate::decide`] say what should change;
//! this layer performs it: the pod controller performs a pod's `Step` ([`pods`]), the node
//! loop its `Round` ([`node`]), the copy and volume resyncs ([`copies`], [`volumes`]) and
//! the upper-token keeper ([`tokens`]) and the certificate keeper ([`certificates`]) their plans
//! (both write a pod's Secret of upper credentials through [`credentials`]), through one executor ([`act`]) that
//! performs every write of a pass a bounded number at once, counting and logging each
//! failure (the next pass plans again from the world; nothing is retried in place).
//! Writes are paced ([`ratelimit`]); events on upper objects are sent off the reconcile path
//! ([`events`]); lower namespaces are made and checked before anything goes in
//! ([`lower_namespaces`]).

pub mod certificates;
pub mod controller;
pub mod copies;
pub mod credentials;
pub mod events;
pub mod lower_namespaces;
pub mod node;
pub mod pods;
pub mod ratelimit;
pub mod tokens;
pub mod volumes;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;

use crate::world::World;

/// The one resync loop of the copy and volume passes: once the world has listed, `pass` runs
/// on every `changed` wake-up (50 ms later, so a burst of events is one pass, and at least
/// [`spacing`] after the previous pass began: each pass reads every pod, and a stream of pod
/// events would otherwise run one every 50 ms) and at least every second or that spacing;
/// a pass stuck past `deadline` is dropped (counted as an API error of `side` and `timeout`)
/// and the next begins. A pass that says `again` learnt something the next pass needs at once.
pub async fn resync<F, Fut>(
    (side, timeout): (&'static str, &'static str),
    world: World,
    changed: Arc<Notify>,
    deadline: std::time::Duration,
    metrics: Arc<crate::metrics::Metrics>,
    mut pass: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Pass>,
{
    world.synced().await;
    loop {
        let began = tokio::time::Instant::now();
        let done = match tokio::time::timeout(deadline, pass()).await {
            Ok(done) => done,
            Err(_) => {
                metrics.api_error(side, timeout);
                tracing::warn!(
                    "a resync pass ({timeout}) took longer than {deadline:?}; the next one goes on"
                );
                Pass::default()
            }
        };
        if done.again {
            continue;
        }
        let next = began + spacing(done.planned_in);
        tokio::select! {
            _ = changed.notified() => {
                let debounced = tokio::time::Instant::now() + Duration::from_millis(50);
                tokio::time::sleep_until(debounced.max(next)).await
            }
            _ = tokio::time::sleep_until((tokio::time::Instant::now() + Duration::from_secs(1)).max(next)) => {}
        }
    }
}

/// What one resync pass did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pass {
    /// It learnt something the next pass needs at once.
    pub again: bool,
    /// How long working out its plan took (reading every pod and object), its writes aside.
    pub planned_in: Duration,
}

/// Least time from the start of one resync pass to the start of the next that a change woke
/// (the pod controller makes a new pod's copies and claims itself; the resync follows later
/// changes of the objects and collects what nothing references).
pub const RESYNC_MIN_SPACING: Duration = Duration::from_millis(500);

/// Most time between two passes, however long planning takes.
pub const RESYNC_MAX_SPACING: Duration = Duration::from_secs(10);

/// Time between the starts of two passes per unit of the first one's planning time.
const RESYNC_SPACING_PER_PLANNING: u32 = 50;

/// How long after a pass began the next one may begin: [`RESYNC_MIN_SPACING`], or fifty
/// times what the pass took to plan when that is longer (up to [`RESYNC_MAX_SPACING`]). A
/// pass reads every pod and object it keeps, so with thousands of them a stream of pod
/// events would keep one running back to back; spaced by their cost, the passes take about
/// a fiftieth of a core at any size, and a change is still followed within a second or two.
pub fn spacing(planned_in: Duration) -> Duration {
    planned_in
        .saturating_mul(RESYNC_SPACING_PER_PLANNING)
        .clamp(RESYNC_MIN_SPACING, RESYNC_MAX_SPACING)
}

/// How often a resync pass runs in full though its inputs show no change: the safety net for
/// what no counter follows (a lower namespace judged usable or forgotten).
const FULL_PASS_EVERY: Duration = Duration::from_secs(60);

/// What the last quiet pass of a resync read: the change counts of its inputs, and when.
/// A pass over the same counts would plan what it planned, nothing, so it is skipped: with
/// every pod settled, a pass costs a comparison instead of a walk over every pod.
#[derive(Default)]
pub struct LastPass(std::sync::Mutex<Option<(Vec<u64>, Instant)>>);

impl LastPass {
    /// Whether a pass over inputs whose change counts are `inputs` would find what the last
    /// quiet pass found (and it ran less than [`FULL_PASS_EVERY`] ago).
    pub fn unchanged(&self, inputs: &[u64], now: Instant) -> bool {
        let last = match self.0.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        last.as_ref()
            .is_some_and(|(seen, at)| seen == inputs && now.duration_since(*at) < FULL_PASS_EVERY)
    }

    /// After a pass over `inputs` (counted before it read them): `quiet` when it planned no
    /// write and waits for no deadline of its own.
    pub fn record(&self, inputs: Vec<u64>, quiet: bool, now: Instant) {
        let mut last = match self.0.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        *last = quiet.then_some((inputs, now));
    }
}

/// One planned write being performed; `true` when it learnt something the next pass needs
/// at once.
pub type Act<'a> = BoxFuture<'a, Result<bool, tensile_common::api::ApiError>>;

/// The one executor of planned writes (copies, claims, volumes): performs `writes` with at
/// most `concurrency` in flight, counts each failure as an API error of its cluster and
/// `kind` and logs it (the next pass plans again from the world, so nothing is retried
/// here). `true` when some write learnt something the next pass needs at once.
pub async fn act(
    writes: Vec<Act<'_>>,
    concurrency: usize,
    kind: &'static str,
    metrics: &crate::metrics::Metrics,
) -> bool {
    let learned = std::sync::atomic::AtomicBool::new(false);
    futures::stream::iter(writes)
        .for_each_concurrent(concurrency, |write| {
            let learned = &learned;
            async move {
                match write.await {
                    Ok(true) => learned.store(true, std::sync::atomic::Ordering::Relaxed),
                    Ok(false) => {}
                    Err(e) => {
                        metrics.api_error(e.cluster, kind);
                        tracing::warn!("{kind} resync: {e}");
                    }
                }
            }
        })
        .await;
    learned.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_are_spaced_by_fifty_times_their_planning_between_half_a_second_and_ten() {
        let ms = Duration::from_millis;
        assert_eq!(spacing(Duration::ZERO), ms(500), "a skipped pass");
        assert_eq!(spacing(ms(8)), ms(500), "a small node");
        assert_eq!(spacing(ms(40)), ms(2_000), "a pass over thousands of pods");
        assert_eq!(spacing(ms(900)), ms(10_000), "capped");
    }

    #[test]
    fn a_pass_is_skipped_only_after_a_quiet_one_over_the_same_inputs_within_a_minute() {
        let last = LastPass::default();
        let now = Instant::now();
        assert!(!last.unchanged(&[1, 2], now), "no pass yet");
        last.record(vec![1, 2], true, now);
        assert!(last.unchanged(&[1, 2], now + Duration::from_secs(1)));
        assert!(
            !last.unchanged(&[1, 3], now + Duration::from_secs(1)),
            "an input moved"
        );
        assert!(
            !last.unchanged(&[1, 2], now + FULL_PASS_EVERY),
            "a full pass at least every {FULL_PASS_EVERY:?}"
        );
        last.record(vec![1, 2], false, now);
        assert!(!last.unchanged(&[1, 2], now), "the last pass planned writes");
    }
}
