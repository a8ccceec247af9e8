//! The lower cluster's scale-up signals. An autoscaler of the lower cluster says on a pod it
//! adds a node for: cluster-autoscaler writes an Event of reason `TriggeredScaleUp` (and
//! `NotTriggerScaleUp` when no node group would help), Karpenter one of reason `Nominated`
//! ("Pod should schedule on: nodeclaim/…"). Such a pod is being made room for, not refused:
//! while it waits unbound, its upper pod shows `tensile.io/LowerPodNominated=True` with reason
//! `ScaleUp` ([`crate::translate`]), and the descheduler leaves it for a bounded time.
//!
//! The lower Events of those reasons are watched (one watch per reason, since a field
//! selector cannot match either of two values; one per served namespace under a namespace
//! scope), and the latest signal of each of this node's unbound lower pods is kept here,
//! forgotten once the pod is bound or gone: at most one small entry per pending lower pod.
//! A signal that changes what is kept wakes the pod's reconcile. A lower credential that may
//! not read Events is said once; the node then runs without the signals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tensile_common::cache::{Cache, Namespaces};
use tokio::sync::mpsc;

use crate::trim::{LowerPod, UpperPod};

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
/// How often entries of pods bound or gone are forgotten.
const SWEEP: Duration = Duration::from_secs(60);
/// How often a watch the lower credential may not make is tried again.
const FORBIDDEN_RETRY: Duration = Duration::from_secs(300);
/// Reconciles asked for and not yet taken; past it a wake-up is dropped (the controller's
/// periodic resync still comes).
const WAKES: usize = 1024;

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
fn supersedes(new: &Signal, kept: &Signal) -> bool {
    new.at > kept.at || (new.at == kept.at && new != kept && !new.scales_up())
}

/// The latest signal of each of this node's unbound lower pods, by pod and UID.
#[derive(Debug, Default)]
pub struct ScaleUps {
    kept: Mutex<HashMap<PodKey, (String, Signal)>>,
}

impl ScaleUps {
    /// Keeps `signal` for the pod `key` of UID `uid` unless a later one is kept for it;
    /// `true` when what is kept changed.
    pub fn note(&self, key: PodKey, uid: &str, signal: Signal) -> bool {
        let Ok(mut kept) = self.kept.lock() else {
            return false;
        };
        match kept.get(&key) {
            Some((same, old)) if same == uid && !supersedes(&signal, old) => false,
            _ => {
                kept.insert(key, (uid.to_owned(), signal));
                true
            }
        }
    }

    /// The latest signal of the lower pod `pod` (of its UID).
    pub fn of(&self, pod: &Pod) -> Option<Signal> {
        let key = PodKey {
            namespace: pod.metadata.namespace.clone()?,
            name: pod.metadata.name.clone()?,
        };
        let uid = pod.metadata.uid.as_deref()?;
        let kept = self.kept.lock().ok()?;
        kept.get(&key).filter(|(u, _)| u == uid).map(|(_, s)| s.clone())
    }

    /// Whether any signal is kept for the pod `namespace/name`.
    pub fn holds(&self, namespace: &str, name: &str) -> bool {
        let key = PodKey {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        self.kept.lock().is_ok_and(|kept| kept.contains_key(&key))
    }

    /// Keeps only the pods `keep` says still wait below (by pod and UID).
    pub fn retain(&self, keep: impl Fn(&PodKey, &str) -> bool) {
        if let Ok(mut kept) = self.kept.lock() {
            kept.retain(|key, (uid, _)| keep(key, uid));
        }
    }
}

/// Whether the lower pod `key` of UID `uid` is one of this node's, unbound.
fn waiting(lower_pods: &Cache<LowerPod>, key: &PodKey, uid: &str) -> bool {
    let Some(pod) = lower_pods.get(&ObjectRef::new(&key.name).within(&key.namespace)) else {
        return false;
    };
    if pod.metadata.uid.as_deref() != Some(uid) {
        return false;
    }
    pod.unpack()
        .is_ok_and(|p| p.spec.and_then(|s| s.node_name).is_none_or(|n| n.is_empty()))
}

/// What a watch does with each Event: keeps the signal of one of this node's unbound lower
/// pods, and asks for the reconcile of its upper pod when that changed what is kept.
struct Taker {
    signals: Arc<ScaleUps>,
    lower_pods: Cache<LowerPod>,
    wake: mpsc::Sender<ObjectRef<UpperPod>>,
}

impl Taker {
    fn take(&self, event: &Event) {
        let Some((key, uid, signal)) = read(event) else {
            return;
        };
        if waiting(&self.lower_pods, &key, &uid) && self.signals.note(key.clone(), &uid, signal) {
            // A full queue drops the wake-up: the controller's periodic resync still comes.
            let _ = self
                .wake
                .try_send(ObjectRef::new(&key.name).within(&key.namespace));
        }
    }
}

/// The signals, the future that watches lower Events into them, and the stream of upper
/// pods (same namespace and name as their lower pods) whose reconcile a new signal asks for.
pub fn watch(
    lower: &kube::Client,
    scope: &Namespaces,
    lower_pods: Cache<LowerPod>,
) -> (
    Arc<ScaleUps>,
    BoxFuture<'static, ()>,
    BoxStream<'static, ObjectRef<UpperPod>>,
) {
    let signals = Arc::new(ScaleUps::default());
    let (wake, woken) = mpsc::channel::<ObjectRef<UpperPod>>(WAKES);
    let taker = Arc::new(Taker {
        signals: signals.clone(),
        lower_pods,
        wake,
    });
    let told = Arc::new(AtomicBool::new(false));
    let mut watches = Vec::new();
    for api in scope.apis::<Event>(lower) {
        for reason in REASONS {
            let config =
                watcher::Config::default().fields(&format!("involvedObject.kind=Pod,reason={reason}"));
            let scope = api.namespace().unwrap_or("every namespace").to_owned();
            watches.push(follow(
                watcher(api.clone(), config).boxed(),
                scope,
                told.clone(),
                taker.clone(),
            ));
        }
    }
    let feed = async move {
        // Signals are kept only for pods the cache knows: it lists first.
        taker.lower_pods.synced().await;
        let sweep = async {
            let mut every = tokio::time::interval(SWEEP);
            loop {
                every.tick().await;
                let pods = &taker.lower_pods;
                taker.signals.retain(|key, uid| waiting(pods, key, uid));
            }
        };
        tokio::join!(futures::future::join_all(watches), sweep);
    };
    let woken = futures::stream::unfold(woken, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
    (signals, feed.boxed(), woken.boxed())
}

/// Follows one watch of lower Events, handing each listed or changed Event to `taker`.
/// Errors are retried: a refusal of the credential every [`FORBIDDEN_RETRY`], said once for
/// all watches (`told`); any other failure within seconds, said once per failing spell.
async fn follow(
    mut watch: BoxStream<'static, Result<watcher::Event<Event>, watcher::Error>>,
    scope: String,
    told: Arc<AtomicBool>,
    taker: Arc<Taker>,
) {
    let mut delays = tensile_common::cache::watch_backoff();
    let mut failing = false;
    while let Some(next) = watch.next().await {
        match next {
            Ok(event) => {
                if failing {
                    failing = false;
                    tracing::info!(namespace = %scope, "the lower Event watch is back");
                }
                delays = tensile_common::cache::watch_backoff();
                if let watcher::Event::Apply(e) | watcher::Event::InitApply(e) = event {
                    taker.take(&e);
                }
            }
            Err(e) if forbidden(&e) => {
                if !told.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        namespace = %scope,
                        "the lower credential may not list and watch events ({e}): scale-ups below \
                         are not carried up until it may (docs/deploy.md)"
                    );
                }
                failing = true;
                tokio::time::sleep(FORBIDDEN_RETRY).await;
            }
            Err(e) => {
                if !failing {
                    failing = true;
                    tracing::warn!(namespace = %scope, "the lower Event watch is failing (retried): {e}");
                }
                tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(2))).await;
            }
        }
    }
}

/// Whether the watch failed because the credential may not list or watch events.
fn forbidden(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => {
            tensile_common::api::code(e).is_some_and(|c| c == 401 || c == 403)
        }
        watcher::Error::WatchError(s) => s.code == 401 || s.code == 403,
        watcher::Error::NoResourceVersion => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(body: serde_json::Value) -> Event {
        serde_json::from_value(body).unwrap()
    }

    fn at(t: &str) -> Timestamp {
        t.parse().unwrap()
    }

    fn signal(reason: &str, t: &str) -> Signal {
        Signal {
            reason: reason.into(),
            message: format!("{reason} at {t}"),
            at: at(t),
        }
    }

    fn key(name: &str) -> PodKey {
        PodKey {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn pod(name: &str, uid: &str) -> Pod {
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

    #[test]
    fn only_a_refused_credential_waits_minutes_before_the_watch_is_tried_again() {
        let status = |code: u16| {
            kube::core::Status::failure("events is forbidden", "Forbidden")
                .with_code(code)
                .boxed()
        };
        assert!(forbidden(&watcher::Error::InitialListFailed(kube::Error::Api(
            status(403)
        ))));
        assert!(forbidden(&watcher::Error::WatchStartFailed(kube::Error::Api(
            status(401)
        ))));
        assert!(forbidden(&watcher::Error::WatchError(status(403))));
        assert!(
            !forbidden(&watcher::Error::WatchError(status(410))),
            "expired: listed again"
        );
        assert!(!forbidden(&watcher::Error::InitialListFailed(kube::Error::Api(
            status(503)
        ))));
        assert!(!forbidden(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn the_latest_signal_of_a_pod_is_kept_a_refusal_winning_a_tie_and_only_for_its_uid() {
        let ups = ScaleUps::default();
        let t = "2026-01-01T10:00:00Z";
        assert!(ups.note(key("p"), "u1", signal(TRIGGERED, t)));
        assert!(
            !ups.note(key("p"), "u1", signal(TRIGGERED, t)),
            "the same again changes nothing"
        );
        assert!(
            !ups.note(key("p"), "u1", signal(NOT_TRIGGERED, "2026-01-01T09:59:00Z")),
            "an older refusal is no news"
        );
        assert_eq!(ups.of(&pod("p", "u1")).unwrap().reason, TRIGGERED);
        assert!(
            ups.note(key("p"), "u1", signal(NOT_TRIGGERED, t)),
            "a refusal wins a tie"
        );
        assert!(!ups.of(&pod("p", "u1")).unwrap().scales_up());
        assert!(!ups.note(key("p"), "u1", signal(NOMINATED, t)));
        assert!(ups.note(key("p"), "u1", signal(NOMINATED, "2026-01-01T10:00:01Z")));
        assert!(ups.of(&pod("p", "u1")).unwrap().scales_up());

        // A pod of the same name made again is another pod.
        assert_eq!(ups.of(&pod("p", "u2")), None);
        assert!(ups.holds("ns", "p"));
        assert!(
            ups.note(key("p"), "u2", signal(NOT_TRIGGERED, t)),
            "its own signal, older or not"
        );
        assert_eq!(ups.of(&pod("p", "u1")), None);

        // Pods bound or gone are forgotten.
        assert!(ups.note(key("q"), "u3", signal(TRIGGERED, t)));
        ups.retain(|k, _| k.name == "q");
        assert!(!ups.holds("ns", "p"));
        assert!(ups.holds("ns", "q"));
    }
}
