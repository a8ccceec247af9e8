//! The pod controller's wiring: its triggers (upper and lower pod events, scale-up signals,
//! the periodic resync, the lower cluster's return, new override rules), standby until this
//! replica leads, and orphan collection.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, controller};
use tensile_common::leader::Candidacy;

use crate::act::pods;
use crate::model::trim;
use crate::world;

/// How soon an orphan collection pass with a failed delete runs again.
const ORPHAN_RETRY: Duration = Duration::from_secs(1);

/// How long a suspected orphan waits for more before the pass: a re-list of every lower pod
/// is then one pass, not one per pod.
const ORPHAN_DEBOUNCE: Duration = Duration::from_millis(200);

/// The objects a pod watch touches, as it changes.
pub type PodEvents<K> = futures::stream::BoxStream<'static, Result<K, kube::runtime::watcher::Error>>;

/// A watch's objects without its errors, for the pod controller. The caches pace their own
/// watch retries (200 ms doubling to 2 s); passed on, each error would also make kube's
/// controller stop taking every trigger (upper pod events, the resync, the lower cluster's
/// return) for a delay that grows to 30 s, so a lower cluster that went away would leave
/// the controller deaf for up to that long after it came back.
fn objects_only<K: Send + 'static>(
    events: PodEvents<K>,
) -> impl futures::Stream<Item = Result<K, kube::runtime::watcher::Error>> + Send + 'static {
    events.filter(|event| {
        if let Err(e) = event {
            tracing::debug!("pod watch: {e}");
        }
        futures::future::ready(event.is_ok())
    })
}

/// Until `candidacy` leads, the pod events (`events`: upper, lower) only keep the pod caches
/// current and nothing is reconciled; then they are handed back for the pod controller.
pub async fn standby<U, L>(
    mut events: (PodEvents<U>, PodEvents<L>),
    candidacy: &Candidacy,
) -> (PodEvents<U>, PodEvents<L>) {
    {
        let (upper, lower) = (&mut events.0, &mut events.1);
        let drain = futures::stream::select(upper.map(drop), lower.map(drop)).for_each(|()| async {});
        tokio::select! {
            biased;
            () = candidacy.leading() => {}
            () = drain => {}
        }
    }
    // The watches do not end; were they to, this replica would still act only as leader.
    candidacy.leading().await;
    events
}

/// The pod controller over the world's pod events (`events`: upper, lower). Every pod is
/// reconciled every 60 s, and at once when the lower cluster answers again after an outage,
/// with its retry delay started over: deletions and confirmations that waited through the
/// outage go then, not at retries that grew to minutes. A lower pod event (the re-list after
/// the lower cluster's return among them) whose upper pod is gone or another wakes
/// `orphans_suspected`; orphan collection judges on the synced caches.
pub fn pod_controller(
    world: &world::World,
    (upper_events, lower_events): (PodEvents<trim::UpperPod>, PodEvents<trim::LowerPod>),
    scale_ups: futures::stream::BoxStream<'static, ObjectRef<trim::UpperPod>>,
    ctx: &Arc<pods::Context>,
    orphans_suspected: Arc<tokio::sync::Notify>,
    workers: u16,
) -> Controller<trim::UpperPod> {
    let resync = futures::stream::unfold((), |()| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Some(((), ()))
    });
    let recovered = {
        let ctx = ctx.clone();
        ctx.lower_health.recoveries().map(move |()| {
            tracing::info!(
                node = %ctx.translation.identity.node,
                "the lower cluster answers again: every pod is reconciled now"
            );
            ctx.retries.forget_all();
        })
    };
    // Pods refused by the rules before are looked at again under new ones.
    let overridden = ctx.overrides.changes();
    let (upper_pods, identity, held) = (
        world.upper_pods.clone(),
        ctx.translation.identity.clone(),
        ctx.clone(),
    );
    // An upper pod at the version a status write of this node stored, its lower pod
    // unchanged since, is settled: the event of that write is not worth a reconcile when it
    // comes after the write's answer (when the watch brings it first, its reconcile ends at
    // the same check, in the reconcile).
    let unsettled = {
        let ctx = ctx.clone();
        move |event: &Result<trim::UpperPod, kube::runtime::watcher::Error>| {
            futures::future::ready(
                event
                    .as_ref()
                    .is_ok_and(|upper| !ctx.settled_now(upper, ctx.lower_of(upper).as_deref())),
            )
        }
    };
    Controller::for_stream(
        objects_only(upper_events).filter(unsettled),
        world.upper_pods.store().clone(),
    )
    .with_config(controller::Config::default().concurrency(workers))
    .watches_stream(objects_only(lower_events), move |lower: trim::LowerPod| {
        let ns = lower.metadata.namespace.clone().unwrap_or_default();
        let at = ObjectRef::new(lower.metadata.name.as_deref()?).within(&ns);
        let upper = upper_pods.get(&at);
        if crate::decide::pods::orphaned(
            &lower.metadata,
            upper.as_ref().map(|u| kube::Resource::meta(&**u)),
            &identity,
        ) {
            orphans_suspected.notify_one();
        }
        // A new lower pod passes through steps (bound, containers being created) that its
        // held-back first status does not show.
        if upper.is_some_and(|upper| held.held_quiet(&upper, &lower)) {
            return None;
        }
        Some(at)
    })
    // A scale-up signal below changes the status the pod should show.
    .reconcile_on(scale_ups)
    .reconcile_all_on(futures::stream::select(
        futures::stream::select(resync, recovered),
        overridden,
    ))
}

/// Orphan collection ([`pods::collect_orphans`]): every `period` (the collection delay, 1 to
/// 30 s), at once when `suspected` is woken or the lower cluster answers again, and 1 s after
/// a failed delete. With `namespaces` (`--gc-namespaces`) empty namespaces are collected
/// too, judged empty on two passes in a row: at least one `period` apart, at most 30 s.
pub struct Collection {
    pub period: Duration,
    pub namespaces: bool,
    pub recoveries: std::pin::Pin<Box<dyn futures::Stream<Item = ()> + Send>>,
    pub suspected: Arc<tokio::sync::Notify>,
}

impl Collection {
    pub async fn run(mut self, ctx: &pods::Context, world: &world::World) {
        world.pods_synced().await;
        let mut empty_before = Default::default();
        let mut namespaces_due = tokio::time::Instant::now();
        // What the last pass that failed nothing read: a pass over the same pods finds no
        // orphan it did not find then, so it is skipped.
        let mut clean_at: Option<[u64; 3]> = None;
        loop {
            let inputs = [
                ctx.lower_pods.changes(),
                ctx.upper_pods.changes(),
                u64::from(ctx.lower_health.reachable()),
            ];
            let collected = if clean_at == Some(inputs) {
                pods::forget_stale_holds(ctx, false);
                pods::Collected::default()
            } else {
                let collected = pods::collect_orphans(ctx).await;
                pods::forget_stale_holds(ctx, true);
                // A pass cut short by the lower cluster's loss is not clean.
                let whole = u64::from(ctx.lower_health.reachable()) == inputs[2];
                clean_at = (collected.failed == 0 && whole).then_some(inputs);
                collected
            };
            let now = tokio::time::Instant::now();
            if self.namespaces && now >= namespaces_due {
                pods::collect_namespaces(ctx, &mut empty_before).await;
                namespaces_due = now + self.period;
            }
            let mut next = if collected.failed > 0 {
                ORPHAN_RETRY
            } else {
                self.period
            };
            if self.namespaces {
                next = next.min(namespaces_due.saturating_duration_since(tokio::time::Instant::now()));
            }
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                Some(()) = self.recoveries.next() => {}
                _ = self.suspected.notified() => tokio::time::sleep(ORPHAN_DEBOUNCE).await,
            }
        }
    }
}
