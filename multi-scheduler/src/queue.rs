//! The scheduling queue of the standalone scheduler, apart from time and the API: pods
//! waiting to be tried, highest priority first, then oldest; a pod that failed waits out a
//! per-pod backoff (1 s doubling to 10 s, kube-scheduler's defaults), and a pod no node
//! could take waits for a change in the cluster, or [`UNSCHEDULABLE_RETRY`] at most.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

/// First retry delay after a failure.
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(1);
/// Longest retry delay after failures.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// An unschedulable pod is tried again after this long even if nothing changed.
pub const UNSCHEDULABLE_RETRY: Duration = Duration::from_secs(60);

/// Queue order: priority (highest first), then creation, then key.
type Order = (Reverse<i32>, jiff::Timestamp, String);

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Active,
    /// Waiting out its backoff.
    Backoff(Instant),
    /// No node could take it: waiting for a change (or the retry period).
    Unschedulable(Instant),
    /// Being tried now.
    InFlight,
}

#[derive(Clone, Debug)]
struct Entry {
    order: Order,
    attempts: u32,
    state: State,
}

/// Pods to schedule, by key (`namespace/name`).
#[derive(Debug, Default)]
pub struct Queue {
    entries: HashMap<String, Entry>,
    active: BTreeSet<Order>,
}

impl Queue {
    /// Makes sure `key` is queued (new pods become active; known ones keep their state).
    pub fn add(&mut self, key: &str, priority: i32, created: jiff::Timestamp) {
        if self.entries.contains_key(key) {
            return;
        }
        let order = (Reverse(priority), created, key.to_owned());
        self.active.insert(order.clone());
        self.entries.insert(
            key.to_owned(),
            Entry {
                order,
                attempts: 0,
                state: State::Active,
            },
        );
    }

    /// Forgets `key` (bound, deleted, or no longer ours).
    pub fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.active.remove(&e.order);
        }
    }

    /// Keys the queue holds.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.entries.keys()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn activate_due(&mut self, now: Instant) {
        for e in self.entries.values_mut() {
            let due = match e.state {
                State::Backoff(until) => until <= now,
                State::Unschedulable(since) => now.duration_since(since) >= UNSCHEDULABLE_RETRY,
                State::Active | State::InFlight => false,
            };
            if due {
                e.state = State::Active;
                self.active.insert(e.order.clone());
            }
        }
    }

    /// The next pod to try, marked in flight until [`Queue::failed`],
    /// [`Queue::unschedulable`] or [`Queue::remove`].
    pub fn pop(&mut self, now: Instant) -> Option<String> {
        self.activate_due(now);
        let order = self.active.pop_first()?;
        let key = order.2.clone();
        if let Some(e) = self.entries.get_mut(&key) {
            e.state = State::InFlight;
        }
        Some(key)
    }

    fn backoff(attempts: u32) -> Duration {
        INITIAL_BACKOFF
            .saturating_mul(1 << attempts.saturating_sub(1).min(8))
            .min(MAX_BACKOFF)
    }

    /// The try failed for a reason other than the nodes (an API error): retry after the
    /// backoff.
    pub fn failed(&mut self, key: &str, now: Instant) {
        if let Some(e) = self.entries.get_mut(key) {
            e.attempts += 1;
            e.state = State::Backoff(now + Self::backoff(e.attempts));
        }
    }

    /// No node could take the pod: it waits for [`Queue::cluster_changed`].
    pub fn unschedulable(&mut self, key: &str, now: Instant) {
        if let Some(e) = self.entries.get_mut(key) {
            e.attempts += 1;
            e.state = State::Unschedulable(now);
        }
    }

    /// Nodes, bound pods or exclusions changed: unschedulable pods are tried again once
    /// their backoff has passed.
    pub fn cluster_changed(&mut self, now: Instant) {
        for e in self.entries.values_mut() {
            if let State::Unschedulable(since) = e.state {
                e.state = State::Backoff(since + Self::backoff(e.attempts)).max_with(now);
            }
        }
    }

    /// How long until a waiting pod becomes due (`None`: nothing waits on time).
    pub fn next_due(&self, now: Instant) -> Option<Duration> {
        if !self.active.is_empty() {
            return Some(Duration::ZERO);
        }
        self.entries
            .values()
            .filter_map(|e| match e.state {
                State::Backoff(until) => Some(until.saturating_duration_since(now)),
                State::Unschedulable(since) => {
                    Some((since + UNSCHEDULABLE_RETRY).saturating_duration_since(now))
                }
                State::Active | State::InFlight => None,
            })
            .min()
    }
}

impl State {
    /// A backoff that ends no earlier than `now` stays; one already over becomes due at `now`.
    fn max_with(self, now: Instant) -> State {
        match self {
            State::Backoff(until) => State::Backoff(until.max(now)),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    #[test]
    fn higher_priority_first_then_older() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.add("ns/late", 0, t(2));
        q.add("ns/early", 0, t(1));
        q.add("ns/urgent", 1000, t(3));
        q.add("ns/early", 5, t(0));
        let order: Vec<String> = std::iter::from_fn(|| q.pop(now)).collect();
        assert_eq!(
            order,
            ["ns/urgent", "ns/early", "ns/late"],
            "a known key keeps its place"
        );
    }

    #[test]
    fn a_failed_pod_backs_off_from_one_second_doubling_to_ten() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.add("ns/p", 0, t(0));
        let mut delays = Vec::new();
        let mut at = now;
        for _ in 0..6 {
            assert_eq!(q.pop(at).as_deref(), Some("ns/p"));
            q.failed("ns/p", at);
            let wait = q.next_due(at).unwrap();
            assert!(
                q.pop(at + wait - Duration::from_millis(1)).is_none(),
                "not before its backoff"
            );
            delays.push(wait.as_secs());
            at += wait;
        }
        assert_eq!(delays, [1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn an_unschedulable_pod_waits_for_a_change_or_a_minute() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.add("ns/p", 0, t(0));
        q.pop(now);
        q.unschedulable("ns/p", now);
        assert!(q.pop(now + Duration::from_secs(30)).is_none(), "nothing changed");
        q.cluster_changed(now + Duration::from_secs(30));
        assert_eq!(q.pop(now + Duration::from_secs(30)).as_deref(), Some("ns/p"));
        q.unschedulable("ns/p", now + Duration::from_secs(30));
        assert!(q.pop(now + Duration::from_secs(60)).is_none());
        assert_eq!(q.pop(now + Duration::from_secs(90)).as_deref(), Some("ns/p"));
        q.remove("ns/p");
        assert!(q.is_empty() && q.next_due(now).is_none());
    }
}
