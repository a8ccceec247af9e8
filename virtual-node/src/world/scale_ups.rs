//! The lower cluster's scale-up signals. An autoscaler of the lower cluster says on a pod it
//! adds a node for: cluster-autoscaler writes an Event of reason `TriggeredScaleUp` (and
//! `NotTriggerScaleUp` when no node group would help), Karpenter one of reason `Nominated`
//! ("Pod should schedule on: nodeclaim/…"). Such a pod is being made room for, not refused:
//! while it waits unbound, its upper pod shows `tensile.io/LowerPodNominated=True` with reason
//! `ScaleUp` (the status going up), and the descheduler leaves it for a bounded time.
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
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tensile_common::cache::{Cache, Namespaces};
use tokio::sync::mpsc;

use crate::model::scale_ups::PodKey;
use crate::model::scale_ups::REASONS;
use crate::model::scale_ups::Signal;
use crate::model::scale_ups::read;
use crate::model::scale_ups::supersedes;
use crate::model::trim::{LowerPod, UpperPod};

/// How often entries of pods bound or gone are forgotten.
const SWEEP: Duration = Duration::from_secs(60);
/// How often a watch the lower credential may not make is tried again.
const FORBIDDEN_RETRY: Duration = Duration::from_secs(300);
/// Reconciles asked for and not yet taken; past it a wake-up is dropped (the controller's
/// periodic resync still comes).
const WAKES: usize = 1024;

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
            // The watcher says Init before each list, a failed one's retry too: only what it
            // lists or sees is progress.
            Ok(watcher::Event::Init) => {}
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
pub fn forbidden(e: &watcher::Error) -> bool {
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
    use crate::model::scale_ups::tests::{key, pod, signal};
    use crate::model::scale_ups::{NOMINATED, NOT_TRIGGERED, TRIGGERED};

    /// kube's watcher says `Init` before each new list, after a failed one too: a watch whose
    /// list keeps failing waits longer each time (200 ms doubling), not 200 ms for ever.
    #[tokio::test(start_paused = true)]
    async fn a_list_that_keeps_failing_is_retried_ever_later() {
        let (wake, _woken) = mpsc::channel(1);
        let taker = Arc::new(Taker {
            signals: Arc::default(),
            lower_pods: tensile_common::cache::empty(),
            wake,
        });
        let down = || {
            kube::core::Status::failure("the apiserver is down", "ServiceUnavailable")
                .with_code(503)
                .boxed()
        };
        let events = futures::stream::iter((0..4).flat_map(move |_| {
            [
                Ok(watcher::Event::Init),
                Err(watcher::Error::InitialListFailed(kube::Error::Api(down()))),
            ]
        }))
        .boxed();
        let started = tokio::time::Instant::now();
        follow(events, "ns".into(), Arc::default(), taker).await;
        // The timer rounds each pause up to its next millisecond.
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200 + 400 + 800 + 1600) && waited < Duration::from_millis(3050),
            "four failed lists: {waited:?}"
        );
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
