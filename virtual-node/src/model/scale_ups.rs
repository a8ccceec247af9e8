//! A lower autoscaler's scale-up signal on a pod: cluster-autoscaler's Events of reason
//! `TriggeredScaleUp` and `NotTriggerScaleUp`, Karpenter's of reason `Nominated`. [`read`]
//! takes one Event to the pod it is about and its [`Signal`]; of two signals of one pod, the
//! later stands, a refusal winning a tie. The world keeps the latest signal of each pending
//! lower pod; the status going up shows it.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Event;

/// cluster-autoscaler scales a node group up for the pod.
pub const TRIGGERED: &str = "TriggeredScaleUp";
/// cluster-autoscaler will not: no node group would make the pod fit.
pub const NOT_TRIGGERED: &str = "NotTriggerScaleUp";
/// Karpenter launches a node (a NodeClaim) for the pod, or expects it on one starting.
pub const NOMINATED: &str = "Nominated";
/// The reasons watched, one watch each.
pub const REASONS: [&str; 3] = [TRIGGERED, NOT_TRIGGERED, NOMINATED];

/// A signal's message is kept to this many bytes (a condition message, not a log).
const MESSAGE_BYTES: usize = 1024;
/// The latest scale-up signal of one lower pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signal {
    /// The Event's reason: one of [`REASONS`].
    pub reason: String,
    pub message: String,
    /// When the Event was last observed.
    pub at: Timestamp,
}

impl Signal {
    /// Whether it says a node is being added for the pod (not that none will be).
    pub fn scales_up(&self) -> bool {
        self.reason == TRIGGERED || self.reason == NOMINATED
    }
}

/// The lower pod a signal is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

/// Of one lower Event: the pod it is about (with its UID) and its signal; `None` for an
/// Event that is no scale-up signal on a pod, or names no pod UID (it could be about an
/// earlier pod of that name).
pub fn read(event: &Event) -> Option<(PodKey, String, Signal)> {
    let about = &event.involved_object;
    let reason = event.reason.as_deref().filter(|r| REASONS.contains(r))?;
    if about.kind.as_deref() != Some("Pod") {
        return None;
    }
    let namespace = about
        .namespace
        .clone()
        .or_else(|| event.metadata.namespace.clone())?;
    let (name, uid) = (about.name.clone()?, about.uid.clone()?);
    if name.is_empty() || uid.is_empty() {
        return None;
    }
    // The last time it was seen, whichever of the Event's times its recorder wrote.
    let at = [
        event
            .series
            .as_ref()
            .and_then(|s| s.last_observed_time.as_ref())
            .map(|t| t.0),
        event.last_timestamp.as_ref().map(|t| t.0),
        event.event_time.as_ref().map(|t| t.0),
        event.first_timestamp.as_ref().map(|t| t.0),
        event.metadata.creation_timestamp.as_ref().map(|t| t.0),
    ]
    .into_iter()
    .flatten()
    .max()?;
    let mut message = event.message.clone().unwrap_or_default();
    if message.len() > MESSAGE_BYTES {
        let mut end = MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    Some((
        PodKey { namespace, name },
        uid,
        Signal {
            reason: reason.to_owned(),
            message,
            at,
        },
    ))
}

/// Whether `new` replaces `kept` as a pod's latest signal: it is later, or as late and says
/// the pod will get no node (of two signals in the same second, the refusal wins: the pod
/// is then not held on the strength of a signal that may be stale).
pub fn supersedes(new: &Signal, kept: &Signal) -> bool {
    new.at > kept.at || (new.at == kept.at && new != kept && !new.scales_up())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    use serde_json::json;

    fn event(body: serde_json::Value) -> Event {
        serde_json::from_value(body).unwrap()
    }

    fn at(t: &str) -> Timestamp {
        t.parse().unwrap()
    }

    pub(crate) fn signal(reason: &str, t: &str) -> Signal {
        Signal {
            reason: reason.into(),
            message: format!("{reason} at {t}"),
            at: at(t),
        }
    }

    pub(crate) fn key(name: &str) -> PodKey {
        PodKey {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    pub(crate) fn pod(name: &str, uid: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid}})).unwrap()
    }

    #[test]
    fn an_autoscalers_event_on_a_pod_reads_as_its_signal_at_its_last_time() {
        // cluster-autoscaler's recorder: first and last timestamps.
        let ca = event(json!({
            "metadata": {"name": "p.1", "namespace": "ns", "creationTimestamp": "2026-01-01T10:00:00Z"},
            "involvedObject": {"kind": "Pod", "namespace": "ns", "name": "p", "uid": "u1"},
            "reason": "TriggeredScaleUp", "message": "pod triggered scale-up: [{pool 1->2 (max: 10)}]",
            "firstTimestamp": "2026-01-01T10:00:00Z", "lastTimestamp": "2026-01-01T10:00:30Z",
        }));
        let (k, uid, s) = read(&ca).unwrap();
        assert_eq!((k, uid.as_str()), (key("p"), "u1"));
        assert_eq!(
            s,
            Signal {
                reason: TRIGGERED.into(),
                message: "pod triggered scale-up: [{pool 1->2 (max: 10)}]".into(),
                at: at("2026-01-01T10:00:30Z"),
            }
        );
        assert!(s.scales_up());
        // A recorder of events.k8s.io: eventTime and a series.
        let karpenter = event(json!({
            "metadata": {"name": "p.2", "namespace": "ns"},
            "involvedObject": {"kind": "Pod", "namespace": "ns", "name": "p", "uid": "u1"},
            "reason": "Nominated", "message": "Pod should schedule on: nodeclaim/default-x7k2p",
            "eventTime": "2026-01-01T10:01:00.000000Z",
            "series": {"count": 2, "lastObservedTime": "2026-01-01T10:02:00.500000Z"},
        }));
        let (_, _, s) = read(&karpenter).unwrap();
        assert_eq!(
            (s.reason.as_str(), s.at),
            (NOMINATED, at("2026-01-01T10:02:00.5Z"))
        );
        let declined = event(json!({
            "metadata": {"name": "p.3", "namespace": "ns"},
            "involvedObject": {"kind": "Pod", "namespace": "ns", "name": "p", "uid": "u1"},
            "reason": "NotTriggerScaleUp", "lastTimestamp": "2026-01-01T10:03:00Z",
            "message": "pod didn't trigger scale-up: 1 max node group size reached",
        }));
        assert!(!read(&declined).unwrap().2.scales_up());
    }

    #[test]
    fn events_that_are_no_signal_on_a_known_pod_are_not_read() {
        let base = json!({
            "metadata": {"name": "e", "namespace": "ns"},
            "involvedObject": {"kind": "Pod", "namespace": "ns", "name": "p", "uid": "u1"},
            "reason": "TriggeredScaleUp", "lastTimestamp": "2026-01-01T10:00:00Z",
        });
        assert!(read(&event(base.clone())).is_some());
        for (field, value) in [
            ("reason", json!("FailedScheduling")),
            (
                "involvedObject",
                json!({"kind": "Node", "name": "n1", "uid": "u1"}),
            ),
            (
                "involvedObject",
                json!({"kind": "Pod", "namespace": "ns", "name": "p"}),
            ),
            ("lastTimestamp", json!(null)),
        ] {
            let mut e = base.clone();
            e[field] = value;
            assert_eq!(read(&event(e.clone())), None, "{e}");
        }
        // A long message is cut at a character boundary.
        let mut long = base;
        long["message"] = json!("é".repeat(MESSAGE_BYTES));
        let (_, _, s) = read(&event(long)).unwrap();
        assert_eq!(s.message.len(), MESSAGE_BYTES);
    }
}
