//! Events on upper objects, sent off the reconcile path.
//!
//! Events go into a bounded queue drained by a few publishers. During a burst of thousands of
//! pods they then wait behind status writes instead of competing with them for the upper
//! apiserver: a status write is what a user waits for, an event is a record of it. A full
//! queue drops the event and counts it (`tensile_virtual_node_events_dropped_total`), as
//! Kubernetes' own event broadcaster drops events it cannot keep up with.

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// Events waiting to be published; past this, new ones are dropped.
const QUEUE: usize = 4096;
/// Events published at once.
const PUBLISHERS: usize = 4;

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Events {
    queue: mpsc::Sender<(Event, ObjectReference)>,
    metrics: Arc<Metrics>,
}

impl Events {
    /// The handle and the task that publishes what it is given.
    pub fn new(recorder: Recorder, metrics: Arc<Metrics>) -> (Self, impl Future<Output = ()>) {
        let (queue, mut received) = mpsc::channel::<(Event, ObjectReference)>(QUEUE);
        let failures = metrics.clone();
        let publish = async move {
            futures::stream::poll_fn(move |cx| received.poll_recv(cx))
                .for_each_concurrent(PUBLISHERS, |(event, reference)| {
                    let (recorder, failures) = (&recorder, &failures);
                    async move {
                        if let Err(e) = recorder.publish(&event, &reference).await {
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
            note: Some(note.chars().take(1000).collect()),
            action: "Sync".into(),
            secondary: None,
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
