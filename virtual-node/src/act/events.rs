//! Events on upper objects, sent off the reconcile path.
//!
//! Events go into a bounded queue drained by a few publishers. During a burst of thousands of
//! pods they then wait behind status writes instead of competing with them for the upper
//! apiserver: a status write is what a user waits for, an event is a record of it. A full
//! queue drops the event and counts it (`tensile_virtual_node_events_dropped_total`), as
//! Kubernetes' own event broadcaster drops events it cannot keep up with.
//!
//! A repeat of an event (same object, type, reason and action) within [`REMEMBERED`] is
//! counted in the first one's `series` by a patch, as Kubernetes' own recorders do, instead
//! of making a new event. What was published is remembered in order of publication, so
//! forgetting the old costs in proportion to what is forgotten: a node that records an event
//! for each of 10,000 pods pays for each event, not for the 10,000 before it.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as ApiEvent;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::metrics::Metrics;

/// Events waiting to be published; past this, new ones are dropped.
const QUEUE: usize = 4096;
/// Events published at once.
const PUBLISHERS: usize = 4;
/// How long a published event is remembered for its repeats to count in its series.
const REMEMBERED: Duration = Duration::from_secs(6 * 60);
/// The events' `reportingController`.
const CONTROLLER: &str = "tensile-virtual-node";

/// An event to publish.
#[derive(Clone, Debug)]
struct Event {
    type_: EventType,
    reason: String,
    note: String,
    action: &'static str,
}

/// What makes two events one series: the object, the type, the reason and the action.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Key {
    kind: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
    warning: bool,
    reason: String,
    action: &'static str,
}

impl Key {
    fn of(event: &Event, regarding: &ObjectReference) -> Self {
        Key {
            kind: regarding.kind.clone(),
            namespace: regarding.namespace.clone(),
            name: regarding.name.clone(),
            uid: regarding.uid.clone(),
            warning: matches!(event.type_, EventType::Warning),
            reason: event.reason.clone(),
            action: event.action,
        }
    }
}

/// An event published within [`REMEMBERED`]: its name, its count so far, and when it was
/// last published.
#[derive(Clone, Debug, PartialEq)]
struct Published {
    name: String,
    count: i32,
    at: Instant,
}

/// The events published within [`REMEMBERED`], by key and in order of publication.
#[derive(Debug, Default)]
struct Recent {
    by_key: HashMap<Key, Published>,
    /// Each publication, oldest first; a key published again appears again, and only its
    /// latest entry forgets it.
    order: VecDeque<(Instant, Key)>,
}

impl Recent {
    /// Forgets what was last published before `now - REMEMBERED`.
    fn forget_old(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < REMEMBERED {
                break;
            }
            let Some((at, key)) = self.order.pop_front() else {
                break;
            };
            if self.by_key.get(&key).is_some_and(|p| p.at == at) {
                self.by_key.remove(&key);
            }
        }
    }

    /// The event `key` repeats, if any (its name and count so far).
    fn repeated(&mut self, key: &Key, now: Instant) -> Option<Published> {
        self.forget_old(now);
        self.by_key.get(key).cloned()
    }

    /// `key` was published at `at` as `name`, `count` times in all.
    fn record(&mut self, key: Key, name: String, count: i32, at: Instant) {
        self.order.push_back((at, key.clone()));
        self.by_key.insert(key, Published { name, count, at });
    }
}

/// Publishes events on upper objects as `instance` (the node) of [`CONTROLLER`].
struct Publisher {
    client: kube::Client,
    instance: String,
    recent: Mutex<Recent>,
}

impl Publisher {
    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        match self.recent.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    async fn publish(&self, event: &Event, regarding: &ObjectReference) -> Result<(), kube::Error> {
        let key = Key::of(event, regarding);
        let now = Instant::now();
        let repeated = self.recent().repeated(&key, now);
        let wall = jiff::Timestamp::now();
        let micro = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(wall);
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let events: Api<ApiEvent> = Api::namespaced(self.client.clone(), namespace);
        if let Some(first) = repeated {
            let count = first.count + 1;
            let series = json!({"series": {"count": count, "lastObservedTime": micro}});
            match events
                .patch(&first.name, &PatchParams::default(), &Patch::Merge(&series))
                .await
            {
                Ok(_) => {
                    self.recent().record(key, first.name, count, now);
                    return Ok(());
                }
                // Deleted meanwhile (by its TTL or by hand): made anew.
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or(CONTROLLER),
            wall.as_nanosecond()
        );
        let body: ApiEvent = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": micro,
            "action": event.action,
            "reason": event.reason,
            "note": event.note,
            "type": if key.warning { "Warning" } else { "Normal" },
            "regarding": regarding,
            "reportingController": CONTROLLER,
            "reportingInstance": self.instance,
        }))
        .map_err(kube::Error::SerdeError)?;
        tensile_common::api::create_stored(&events, &PostParams::default(), &body).await?;
        self.recent().record(key, name, 1, now);
        Ok(())
    }
}

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Events {
    queue: mpsc::Sender<(Event, ObjectReference)>,
    metrics: Arc<Metrics>,
}

impl Events {
    /// The handle and the task that publishes what it is given through `client`, as the
    /// virtual node `node`.
    pub fn new(
        client: kube::Client,
        node: String,
        metrics: Arc<Metrics>,
    ) -> (Self, impl Future<Output = ()>) {
        let (queue, mut received) = mpsc::channel::<(Event, ObjectReference)>(QUEUE);
        let failures = metrics.clone();
        let publisher = Publisher {
            client,
            instance: node,
            recent: Mutex::default(),
        };
        let publish = async move {
            futures::stream::poll_fn(move |cx| received.poll_recv(cx))
                .for_each_concurrent(PUBLISHERS, |(event, reference)| {
                    let (publisher, failures) = (&publisher, &failures);
                    async move {
                        if let Err(e) = publisher.publish(&event, &reference).await {
                            failures.api_error("upper", "event");
                            let object = reference.name.as_deref().unwrap_or_default();
                            // A refusal is a missing grant, for the operator to see.
                            if tensile_common::api::code(&e).is_some_and(|c| c == 401 || c == 403) {
                                tracing::warn!(object, reason = %event.reason, "event not recorded: {e}");
                            } else {
                                tracing::debug!(object, reason = %event.reason, "event not recorded: {e}");
                            }
                        }
                    }
                })
                .await;
        };
        (Self { queue, metrics }, publish)
    }

    /// Queues an event about `reference` (action `Sync`, note cut to 1,000 characters);
    /// never waits.
    pub fn publish(&self, reference: ObjectReference, type_: EventType, reason: &str, note: &str) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: note.chars().take(1000).collect(),
            action: "Sync",
        };
        if let Err(e) = self.queue.try_send((event, reference)) {
            self.metrics.events_dropped.inc();
            let (why, (event, reference)) = match e {
                mpsc::error::TrySendError::Full(x) => ("the event queue is full", x),
                mpsc::error::TrySendError::Closed(x) => ("the event publisher has stopped", x),
            };
            tracing::debug!(
                object = reference.name.as_deref().unwrap_or_default(),
                reason = %event.reason,
                "event dropped: {why}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pod: &str, reason: &str) -> Key {
        let event = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: "n".into(),
            action: "Sync",
        };
        let regarding = ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some("ns".into()),
            name: Some(pod.into()),
            uid: Some(format!("uid-{pod}")),
            ..Default::default()
        };
        Key::of(&event, &regarding)
    }

    #[test]
    fn a_repeat_within_the_window_is_counted_in_the_first_events_series_and_forgotten_after_it() {
        let t0 = Instant::now();
        let mut recent = Recent::default();
        assert_eq!(recent.repeated(&key("a", "LowerPodCreated"), t0), None);
        recent.record(key("a", "LowerPodCreated"), "a.1".into(), 1, t0);
        assert_eq!(
            recent.repeated(&key("a", "LowerPodLost"), t0),
            None,
            "another reason"
        );
        assert_eq!(
            recent.repeated(&key("b", "LowerPodCreated"), t0),
            None,
            "another object"
        );
        let later = t0 + Duration::from_secs(60);
        let first = recent.repeated(&key("a", "LowerPodCreated"), later).unwrap();
        assert_eq!((first.name.as_str(), first.count), ("a.1", 1));
        recent.record(key("a", "LowerPodCreated"), first.name, 2, later);
        // Remembered from its last publication, not its first.
        let past_first = t0 + REMEMBERED + Duration::from_secs(1);
        assert_eq!(
            recent
                .repeated(&key("a", "LowerPodCreated"), past_first)
                .map(|p| p.count),
            Some(2)
        );
        assert_eq!(recent.by_key.len(), 1);
        assert_eq!(recent.order.len(), 1, "the first publication is forgotten");
        let past_last = later + REMEMBERED;
        assert_eq!(recent.repeated(&key("a", "LowerPodCreated"), past_last), None);
        assert!(recent.by_key.is_empty() && recent.order.is_empty());
    }

    #[test]
    fn what_was_published_longest_ago_is_forgotten_first_and_only_it() {
        let t0 = Instant::now();
        let mut recent = Recent::default();
        for i in 0..10_000u64 {
            recent.record(
                key(&format!("p-{i}"), "LowerPodCreated"),
                format!("p-{i}.1"),
                1,
                t0 + Duration::from_millis(i * 20),
            );
        }
        // 200 s of events at 50 a second; REMEMBERED after the first 100 of them were
        // published, exactly those are forgotten and the rest stay in order.
        let now = t0 + REMEMBERED + Duration::from_millis(100 * 20);
        assert!(recent.repeated(&key("p-0", "LowerPodCreated"), now).is_none());
        assert_eq!(recent.by_key.len(), 10_000 - 101);
        assert_eq!(recent.order.len(), 10_000 - 101);
        assert!(recent.repeated(&key("p-101", "LowerPodCreated"), now).is_some());
    }
}
