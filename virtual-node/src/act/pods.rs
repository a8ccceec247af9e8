//! The pod controller: every upper pod bound to the virtual node is reconciled against its
//! lower pod, level-triggered, one key at a time. Each reconcile reads both pods from the
//! world, asks [`crate::decide::pods::decide`] for the step and performs it; orphaned lower
//! pods and emptied lower namespaces are collected here too.
//!
//! kube-runtime's controller serializes work per pod key and re-runs a key that changed
//! while it was being worked on; every run reads the latest upper and lower objects from
//! the watch caches, so a retry never acts on stale desired state.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tensile_common::cache::Cache;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tensile_common::api::ApiError;
use tensile_common::names;

use crate::act::copies::Copies;
use crate::act::ratelimit::Backoff;
use crate::act::ratelimit::WriteLimit;
use crate::decide::features;
use crate::decide::pods::Step;
use crate::decide::pods::View;
use crate::decide::pods::decide;
use crate::decide::pods::key;
use crate::decide::pods::orphaned;
use crate::decide::translate::{self, Translation};
use crate::metrics::Metrics;
use crate::model::refs::{self, Blocked};
use crate::model::trim::{LowerPod, UpperPod};
use tensile_common::cache::Namespaces;

/// What one reconcile needs.
pub struct Context {
    pub upper: kube::Client,
    pub lower: kube::Client,
    pub translation: Translation,
    /// The lower cluster's override rules in force.
    pub overrides: crate::world::overrides::Current,
    /// Lower pods carrying this node's marks.
    pub lower_pods: Cache<LowerPod>,
    pub upper_pods: Cache<UpperPod>,
    pub host_ip: String,
    pub events: crate::act::events::Events,
    pub metrics: Arc<Metrics>,
    pub run_daemonset_pods: bool,
    pub upper_limit: WriteLimit,
    pub lower_limit: WriteLimit,
    /// ConfigMaps and Secrets the pods reference.
    pub copies: Arc<Copies>,
    /// Claims the pods mount.
    pub volumes: Arc<crate::act::volumes::Volumes>,
    /// Pods missing below are only judged lost after this instant (caches warm up).
    pub started: Instant,
    pub lost_grace: Duration,
    pub cluster_name: String,
    /// Upper pods (by UID) whose first status write is held back, since when, and for which
    /// lower pod (its UID).
    pub first_status_held: std::sync::Mutex<std::collections::HashMap<String, (Instant, String)>>,
    /// The lower namespaces this node may use, and making them.
    pub namespaces: Arc<crate::act::lower_namespaces::LowerNamespaces>,
    /// The lower namespaces served (`--lower-namespaces`).
    pub served: Namespaces,
    /// Lower PriorityClasses known to exist.
    pub known_priority_classes: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Failures in a row per pod, for the retry delay.
    pub retries: Backoff,
    /// Pods whose last reconcile found nothing to do, and on which versions.
    pub settled: Settled,
    /// One reconcile's deadline.
    pub reconcile_timeout: Duration,
    /// Whether the lower cluster answers, as the node loop last judged it.
    pub lower_health: Arc<crate::act::node::LowerHealth>,
    /// Told when a lower pod is made (its upper tokens are then issued).
    pub tokens_changed: Arc<tokio::sync::Notify>,
    /// The lower pods the certificate keeper follows.
    pub certificates: Arc<crate::act::certificates::Tracked>,
    /// The lower cluster's scale-up signals on unbound lower pods.
    pub scale_ups: Arc<crate::world::scale_ups::ScaleUps>,
    /// Whether the upper apiserver keeps a pod's `status.observedGeneration`: assumed until
    /// a status write shows it dropped.
    pub upper_tracks_generation: std::sync::atomic::AtomicBool,
}

/// The upper and lower pod versions on which each pod's last reconcile found both pods
/// agreeing (nothing to patch below, no status to write up), by upper UID. A run on the same
/// two versions, as the periodic resync and the 5-minute requeue bring, decides the same: it
/// is answered from here without decoding either pod. Any change to either pod is a new
/// version, and a lower pod gone from the cache is no version at all, so both run in full.
#[derive(Debug, Default)]
pub struct Settled(std::sync::Mutex<std::collections::HashMap<String, (String, String)>>);

impl Settled {
    fn versions(upper: &impl Resource, lower: &impl Resource) -> Option<(String, String)> {
        Some((
            upper.meta().resource_version.clone()?,
            lower.meta().resource_version.clone()?,
        ))
    }

    /// Whether `upper` and `lower` are the versions last found settled.
    pub fn holds(&self, upper: &impl Resource, lower: &impl Resource) -> bool {
        let (Some(uid), Some(versions)) = (upper.uid(), Self::versions(upper, lower)) else {
            return false;
        };
        self.0
            .lock()
            .is_ok_and(|settled| settled.get(&uid) == Some(&versions))
    }

    /// Remembers that `upper` and `lower` agree.
    pub fn record(&self, upper: &impl Resource, lower: &impl Resource) {
        if let (Some(uid), Some(versions)) = (upper.uid(), Self::versions(upper, lower)) {
            self.insert(uid, versions);
        }
    }

    /// Remembers that `upper` agrees with `lower` at `upper_version`: the version a status
    /// write made conditional on `upper`'s own version stored, so the pod differs from
    /// `upper` by that status alone.
    pub fn record_written(&self, upper: &impl Resource, upper_version: String, lower: &impl Resource) {
        if let (Some(uid), Some(lower_version)) = (upper.uid(), lower.meta().resource_version.clone()) {
            self.insert(uid, (upper_version, lower_version));
        }
    }

    fn insert(&self, uid: String, versions: (String, String)) {
        if let Ok(mut settled) = self.0.lock() {
            settled.insert(uid, versions);
        }
    }

    /// Keeps only the pods (by UID) `keep` says are still bound here.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        if let Ok(mut settled) = self.0.lock() {
            settled.retain(|uid, _| keep(uid));
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("the reconcile took longer than {0:?}; retrying")]
    Timeout(Duration),
    /// A cached object no longer decodes: the watch's next event replaces it.
    #[error("the cached {0} does not decode: {1}")]
    Cache(&'static str, serde_json::Error),
}

impl Error {
    /// An upper refusal by the node authorizer because it finds no path from this node to
    /// the object: under a node identity, what a read of a pod's reference gets while the
    /// authorizer's graph does not have the pod's binding yet.
    pub fn binding_unseen(&self) -> bool {
        matches!(self, Error::Api(e) if e.cluster == "upper"
            && tensile_common::api::code(&e.source) == Some(403)
            && tensile_common::api::message(&e.source).contains("no relationship found between node"))
    }

    pub(crate) fn api(
        cluster: &'static str,
        verb: &'static str,
        what: impl Into<String>,
    ) -> impl FnOnce(kube::Error) -> Error {
        let on = ApiError::on(cluster, verb, what);
        move |source| Error::Api(on(source))
    }
}

pub async fn reconcile(upper: Arc<UpperPod>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.in_flight.inc();
    let result = tokio::time::timeout(ctx.reconcile_timeout, reconcile_inner(&upper, &ctx))
        .await
        .unwrap_or(Err(Error::Timeout(ctx.reconcile_timeout)));
    ctx.metrics.in_flight.dec();
    ctx.metrics.observe_reconcile(started.elapsed(), result.is_ok());
    match &result {
        Ok(_) => ctx.retries.forget(&retry_key(&*upper)),
        // The node authorizer learns a pod's binding from its own watch, which may lag ours
        // by a moment: the first such refusal is that lag, a second one is not.
        Err(e) if e.binding_unseen() && !ctx.retries.failing(&retry_key(&*upper)) => tracing::debug!(
            pod = %key(&*upper),
            "the upper node authorizer has not seen the pod bound to this node yet; retried in a second: {e}"
        ),
        Err(e) => tracing::warn!(pod = %key(&*upper), "reconcile failed: {e}"),
    }
    result
}

fn retry_key(pod: &impl Resource) -> String {
    pod.uid().unwrap_or_else(|| key(pod))
}

/// A failed pod is retried after a delay that doubles per failure in a row (1 s up to
/// 5 min): a lower cluster refusing a thousand pods (a quota, an admission policy) sees a
/// few creates a second, not hundreds.
pub fn error_policy(pod: Arc<UpperPod>, err: &Error, ctx: Arc<Context>) -> Action {
    match err {
        Error::Api(e) => ctx.metrics.api_error(e.cluster, e.verb),
        Error::Timeout(_) => ctx.metrics.api_error("both", "reconcile-timeout"),
        Error::Cache(..) => ctx.metrics.api_error("both", "cache-decode"),
    }
    Action::requeue(ctx.retries.next_delay(&retry_key(&*pod)))
}

impl Context {
    /// The lower pod of `upper` in the cache, if it carries this node's marks.
    pub fn lower_of(&self, upper: &UpperPod) -> Option<Arc<LowerPod>> {
        let at = ObjectRef::new(&upper.name_any()).within(&upper.namespace().unwrap_or_default());
        self.lower_pods
            .get(&at)
            .filter(|l| self.translation.identity.owns(&l.metadata))
    }

    /// Whether a reconcile of `upper` (its lower pod `lower`) would find nothing to do, known
    /// without decoding either pod: both are at the versions last found settled. While the
    /// lower cluster does not answer, its cache is stale: the status it implies is not
    /// written (it would undo the node lifecycle controller's marking of the pods not ready),
    /// nor is a settled pod taken as current. A scale-up signal below changes the status
    /// without changing either pod.
    pub fn settled_now(&self, upper: &UpperPod, lower: Option<&LowerPod>) -> bool {
        self.lower_health.reachable()
            && lower.is_some_and(|l| self.settled.holds(upper, l))
            && !self
                .scale_ups
                .holds(&upper.namespace().unwrap_or_default(), &upper.name_any())
    }

    /// Whether an event of `lower`, the lower pod of `upper`, would find the first status of
    /// `upper` still held back for it ([`first_status_wait`]): held within its wait, for this
    /// lower pod, neither pod being deleted, and the lower pod at this version merely pending.
    /// The reconcile that held it back comes again when the wait ends (its requeue); until
    /// then one more such event is not worth a reconcile. Only the lower pod's status is
    /// decoded, and only while a hold is on.
    pub fn held_quiet(&self, upper: &UpperPod, lower: &LowerPod) -> bool {
        #[derive(serde::Deserialize)]
        struct StatusOnly {
            status: Option<k8s_openapi::api::core::v1::PodStatus>,
        }
        if upper.packed.metadata.deletion_timestamp.is_some()
            || lower.metadata.deletion_timestamp.is_some()
            || !self.lower_health.reachable()
        {
            return false;
        }
        let (Some(uid), Some(lower_uid)) = (upper.uid(), lower.uid()) else {
            return false;
        };
        let holding = self.first_status_held.lock().is_ok_and(|held| {
            held.get(&uid).is_some_and(|(since, held_for)| {
                *held_for == lower_uid && since.elapsed() < FIRST_STATUS_DELAY
            })
        });
        holding
            && lower.unpack_as::<StatusOnly>().is_ok_and(|only| {
                translate::merely_pending(&Pod {
                    status: only.status,
                    ..Default::default()
                })
            })
    }
}

/// Performs the step [`decide`] chose.
async fn reconcile_inner(kept: &UpperPod, ctx: &Context) -> Result<Action, Error> {
    ctx.lower_pods.synced().await;
    let ns = kept.namespace().unwrap_or_default();
    let name = kept.name_any();
    let lower = ctx.lower_of(kept);
    let reachable = ctx.lower_health.reachable();
    if ctx.settled_now(kept, lower.as_deref()) {
        return Ok(Action::requeue(STATUS_RECHECK));
    }
    let upper = &kept.pod().map_err(|e| Error::Cache("upper pod", e))?;
    let lower = lower
        .map(|l| l.unpack().map_err(|e| Error::Cache("lower pod", e)))
        .transpose()?;
    let lower_pods: Api<Pod> = Api::namespaced(ctx.lower.clone(), &ns);
    let overrides = ctx.overrides.get();
    let view = View {
        translation: &ctx.translation,
        overrides: &overrides,
        run_daemonset_pods: ctx.run_daemonset_pods,
        warmed_up: ctx.started.elapsed() >= ctx.lost_grace,
        cluster_name: &ctx.cluster_name,
    };
    match (decide(upper, lower.as_ref(), &view), lower) {
        // A delete sent to a lower cluster that does not answer fails (or waits out its
        // deadline on a partition) and grows the pod's retry delay: it waits for the lower
        // cluster instead, looked at again shortly and at once when it answers again.
        (Step::DeleteStale | Step::StopLower { .. }, Some(_)) if !reachable => {
            Ok(Action::requeue(UNREACHABLE_RECHECK))
        }
        (Step::DeleteStale, Some(l)) => {
            delete_lower(ctx, &lower_pods, &l, None).await?;
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        (Step::StopLower { grace }, Some(l)) => {
            delete_lower(ctx, &lower_pods, &l, grace).await?;
            Ok(Action::requeue(Duration::from_secs(2)))
        }
        (Step::AwaitLowerGone, _) => Ok(Action::requeue(Duration::from_secs(2))),
        (Step::ReleaseUpper, _) => {
            release_upper(ctx, upper).await?;
            Ok(Action::await_change())
        }
        (Step::Finished, _) => Ok(Action::await_change()),
        (
            Step::Refuse {
                reason,
                event: why,
                message,
            },
            _,
        ) => {
            if !synced_says(upper, |c| {
                c.reason.as_deref() == Some(reason) && c.message.as_deref() == Some(message.as_str())
            }) {
                event(ctx, upper, EventType::Warning, why, &message);
            }
            set_condition(
                ctx,
                upper,
                names::CONDITION_LOWER_SYNCED,
                "False",
                reason,
                &message,
            )
            .await?;
            Ok(Action::await_change())
        }
        (Step::AwaitWarmUp, _) => Ok(Action::requeue(ctx.lost_grace)),
        (Step::FailLost { message }, _) => {
            fail_upper(ctx, upper, "LowerPodLost", &message).await?;
            event(ctx, upper, EventType::Warning, "LowerPodLost", &message);
            Ok(Action::await_change())
        }
        (
            Step::Create {
                desired,
                lost,
                overrides,
            },
            _,
        ) => {
            if lost {
                let msg = format!(
                    "the pod disappeared from lower cluster {}; starting it again",
                    ctx.cluster_name
                );
                event(ctx, upper, EventType::Warning, "LowerPodLost", &msg);
            }
            create_lower(ctx, kept, upper, &lower_pods, &desired, &overrides).await
        }
        (Step::Sync { .. }, Some(_)) if !reachable => Ok(Action::requeue(UNREACHABLE_RECHECK)),
        (Step::Sync { mut patch, resize }, Some(l)) => {
            let agree = patch.is_none() && resize.is_none();
            let mut retry = None;
            if let Some(body) = resize {
                let refusal = resize_lower(ctx, upper, &lower_pods, &body).await;
                if refusal.as_ref().is_some_and(|r| r.reason == "Deferred") {
                    retry = Some(RESIZE_RETRY);
                }
                if translate::ResizeRefusal::of(&l) != refusal {
                    let record = refusal
                        .as_ref()
                        .and_then(|r| serde_json::to_string(r).ok())
                        .map_or(serde_json::Value::Null, serde_json::Value::String);
                    patch.get_or_insert_with(|| json!({}))["metadata"]["annotations"]
                        [names::RESIZE_REFUSED] = record;
                }
            }
            if let Some(patch) = patch {
                ctx.lower_limit.acquire().await;
                let params = PatchParams {
                    force: false,
                    ..PatchParams::apply(names::FIELD_MANAGER)
                };
                if let Err(e) = lower_pods.patch(&name, &params, &Patch::Strategic(&patch)).await {
                    // An update failure never regresses a running pod: report and go on.
                    let msg = tensile_common::api::message(&e);
                    event(ctx, upper, EventType::Warning, "LowerUpdateFailed", &msg);
                }
            }
            let (action, written) = write_status(ctx, upper, &l).await?;
            match written {
                Written::Current if agree => ctx.settled.record(upper, &l),
                Written::Stored(version) if agree => ctx.settled.record_written(upper, version, &l),
                _ => {}
            }
            Ok(retry.map_or(action, Action::requeue))
        }
        // Steps about a lower pod always come with one.
        (Step::DeleteStale | Step::StopLower { .. } | Step::Sync { .. }, None) => {
            Ok(Action::requeue(Duration::from_secs(1)))
        }
    }
}

/// How soon a resize the lower apiserver deferred (a quota, say) is tried again.
const RESIZE_RETRY: Duration = Duration::from_secs(15);

/// Resizes the lower pod of `upper` through its `resize` subresource (`body`: see
/// [`translate::resize_patch`]); the refusal, if the lower apiserver refuses it, which the
/// upper pod then shows as the kubelet's `PodResizePending`. An event says either way.
async fn resize_lower(
    ctx: &Context,
    upper: &Pod,
    lower_pods: &Api<Pod>,
    body: &serde_json::Value,
) -> Option<translate::ResizeRefusal> {
    let generation = upper.metadata.generation.unwrap_or(1);
    ctx.lower_limit.acquire().await;
    let answer = lower_pods
        .patch_subresource(
            "resize",
            &upper.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(body),
        )
        .await;
    match answer {
        Ok(_) => {
            let said = format!("resized in lower cluster {}", ctx.cluster_name);
            event(ctx, upper, EventType::Normal, "LowerPodResized", &said);
            None
        }
        Err(e) => {
            let message = format!(
                "lower cluster {} refused the resize: {}",
                ctx.cluster_name,
                tensile_common::api::message(&e)
            );
            let refusal =
                translate::ResizeRefusal::of_answer(generation, tensile_common::api::code(&e), message);
            event(
                ctx,
                upper,
                EventType::Warning,
                "LowerResizeRefused",
                &refusal.message,
            );
            Some(refusal)
        }
    }
}

/// Whether the upper pod's `LowerPodSynced` condition already says what `says` checks (an
/// event for it was then sent before).
fn synced_says(upper: &Pod, says: impl Fn(&k8s_openapi::api::core::v1::PodCondition) -> bool) -> bool {
    upper
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == names::CONDITION_LOWER_SYNCED && says(c))
        })
}

/// Whether the lower cluster has PriorityClass `name`; found ones are remembered (a class
/// is rarely deleted, and a create naming a deleted one fails and is retried), missing ones
/// are asked again next time.
async fn lower_priority_class_exists(ctx: &Context, name: &str) -> Result<bool, Error> {
    if ctx.known_priority_classes.lock().is_ok_and(|k| k.contains(name)) {
        return Ok(true);
    }
    let api: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(ctx.lower.clone());
    let found = api
        .get_metadata_opt(name)
        .await
        .map_err(Error::api("lower", "get", format!("priorityclass {name}")))?
        .is_some();
    if found && let Ok(mut known) = ctx.known_priority_classes.lock() {
        known.insert(name.to_owned());
    }
    Ok(found)
}

/// Says on the upper pod why it is not created below yet, and retries in a few seconds.
async fn blocked_below(ctx: &Context, upper: &Pod, blocked: Blocked) -> Result<Action, Error> {
    let (reason, event_reason, msg) = match blocked {
        Blocked::Missing(msg) => ("ReferenceMissing", "ReferenceMissing", msg),
        Blocked::Conflict(msg) => ("Conflict", "LowerCopyConflict", msg),
        Blocked::NotServed(msg) => ("NamespaceNotServed", "NamespaceNotServed", msg),
    };
    // Only a restart with other flags serves another namespace: asked again rarely.
    let again = match reason {
        "NamespaceNotServed" => Duration::from_secs(300),
        _ => Duration::from_secs(5),
    };
    if !synced_says(upper, |c| c.message.as_deref() == Some(msg.as_str())) {
        event(ctx, upper, EventType::Warning, event_reason, &msg);
    }
    set_condition(ctx, upper, names::CONDITION_LOWER_SYNCED, "False", reason, &msg).await?;
    Ok(Action::requeue(again))
}

/// Creates `desired` below, after the namespace and what the pod references.
async fn create_lower(
    ctx: &Context,
    kept: &UpperPod,
    upper: &Pod,
    lower_pods: &Api<Pod>,
    desired: &Pod,
    overrides: &[String],
) -> Result<Action, Error> {
    let ns = upper.namespace().unwrap_or_default();
    if let Err(blocked) = ctx.namespaces.ensure(&ns).await? {
        return blocked_below(ctx, upper, blocked).await;
    }
    let result = create_in_namespace(ctx, kept, upper, lower_pods, desired, overrides).await;
    if result.is_err() {
        // The lower admin may have deleted the namespace since it was seen: the next attempt
        // looks again (one read) instead of failing until restart.
        ctx.namespaces.forget(&ns);
    }
    result
}

/// Creates `desired` below once its namespace exists: what the pod references first
/// (`kept`: the cache's summary of `upper`, with its references and claims). `overrides`:
/// the rules it was made with, named in the event.
async fn create_in_namespace(
    ctx: &Context,
    kept: &UpperPod,
    upper: &Pod,
    lower_pods: &Api<Pod>,
    desired: &Pod,
    overrides: &[String],
) -> Result<Action, Error> {
    let name = upper.name_any();
    let ns = upper.namespace().unwrap_or_default();
    // Nothing is written below for a pod that is refused: a same-named pod of someone else
    // is looked for before any copy or claim is made (a pod that needs none finds it with
    // its create).
    if (!kept.claims.is_empty() || !kept.references.is_empty())
        && let Some(action) = foreign_pod_below(ctx, upper, lower_pods).await?
    {
        return Ok(action);
    }
    // What the pod references is below before the pod is.
    let mut blocked = ctx.copies.prepare(upper).await?;
    for claim in &kept.claims {
        if blocked.is_err() {
            break;
        }
        if let Err(b) = ctx.volumes.prepare(&ns, claim).await? {
            blocked = Err(b);
        }
    }
    let absent = match blocked {
        Ok(absent) => absent,
        Err(blocked) => return blocked_below(ctx, upper, blocked).await,
    };
    // Optional references that did not travel must not meet a same-named lower object.
    let mut desired = desired.clone();
    if let Some(spec) = desired.spec.as_mut() {
        refs::drop_absent(spec, &absent);
        // The references that travelled, recorded: copies follow them, not what lower
        // admission adds to the spec. Only the upper pod's own references are copies: the
        // pod's Secret of upper tokens and what override rules name (the lower cluster's
        // own objects) are not recorded.
        let travelled: Vec<refs::Reference> = refs::references(spec, None)
            .into_iter()
            .filter(|r| {
                kept.references
                    .iter()
                    .any(|(kind, name)| *kind == r.kind && *name == r.name)
            })
            .collect();
        let record = refs::encode_references(travelled.iter().map(|r| (r.kind, r.name.as_str())));
        desired
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(names::LOWER_POD_REFERENCES.to_owned(), record);
        // A PriorityClass only the upper cluster has would fail the create below (the
        // Priority admission plugin refuses unknown names): the pod runs there at the lower
        // cluster's default priority instead.
        // A namespace scope cannot read classes (cluster-wide): it never keeps one.
        if let Some(class) = spec.priority_class_name.clone()
            && (ctx.served != Namespaces::All || !lower_priority_class_exists(ctx, &class).await?)
        {
            spec.priority_class_name = None;
        }
    }
    ctx.lower_limit.acquire().await;
    if let Some(msg) = lower_refusal(ctx, &ns, &desired).await {
        create_failed(ctx, upper, &msg).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    match tensile_common::api::create_stored(lower_pods, &PostParams::default(), &desired).await {
        Ok(_) => {
            ctx.metrics.created();
            ctx.tokens_changed.notify_one();
            let reads_certificates = desired
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(crate::decide::certificates::SECRET_ANNOTATION));
            if reads_certificates {
                ctx.certificates.track(&ns, &upper.name_any());
            }
            let mut said = format!("created in lower cluster {}", ctx.cluster_name);
            if !overrides.is_empty() {
                said.push_str(&format!(" with override rules {}", overrides.join(", ")));
            }
            event(ctx, upper, EventType::Normal, "LowerPodCreated", &said);
            // The first status write sets LowerPodSynced=True (one write, not two).
            Ok(Action::requeue(Duration::from_secs(300)))
        }
        Err(e) if tensile_common::api::code(&e) == Some(409) => {
            // A same-named lower pod exists. Ours (the cache is behind) or someone else's.
            let existing = lower_pods.get_opt(&name).await.map_err(Error::api(
                "lower",
                "get",
                format!("pod {ns}/{name}"),
            ))?;
            match existing {
                Some(p) if ctx.translation.identity.owns(&p.metadata) => {
                    Ok(Action::requeue(Duration::from_secs(1)))
                }
                Some(_) => pod_conflict(ctx, upper).await,
                None => Ok(Action::requeue(Duration::from_secs(1))),
            }
        }
        Err(e) => {
            let msg = format!(
                "lower cluster {} rejected the pod: {}",
                ctx.cluster_name,
                tensile_common::api::message(&e)
            );
            create_failed(ctx, upper, &msg).await?;
            let verb_err = Error::api("lower", "create", format!("pod {ns}/{name}"))(e);
            Err(verb_err)
        }
    }
}

/// The upper pod says its lower pod was not created, and why: `LowerPodSynced=False`, reason
/// `CreateFailed` (which the descheduler moves), and a `LowerCreateFailed` event.
async fn create_failed(ctx: &Context, upper: &Pod, msg: &str) -> Result<(), Error> {
    set_condition(
        ctx,
        upper,
        names::CONDITION_LOWER_SYNCED,
        "False",
        "CreateFailed",
        msg,
    )
    .await?;
    event(ctx, upper, EventType::Warning, "LowerCreateFailed", msg);
    Ok(())
}

/// Why `desired` is not created below: it asks for a feature ([`features::asked`]) the
/// lower apiserver refuses (a field its version does not know, under strict field
/// validation, or a value it does not accept) or drops (a gate off there), and would run
/// there without it. Found out on the lower apiserver itself, by a server-side dry run of
/// the create, for such pods only; a dry run that fails for another reason (a quota, the
/// namespace, a conflict, a lower webhook that takes no dry runs) says nothing, and the
/// create goes on.
async fn lower_refusal(ctx: &Context, ns: &str, desired: &Pod) -> Option<String> {
    let spec = desired.spec.as_ref()?;
    let asked = features::asked(spec);
    if asked.is_empty() {
        return None;
    }
    let lower_version = || async {
        match ctx.lower.apiserver_version().await {
            Ok(v) => format!("Kubernetes {}", v.git_version),
            Err(_) => "its Kubernetes version unknown".to_owned(),
        }
    };
    let describe =
        |list: &[&features::Feature]| list.iter().map(|f| f.describe()).collect::<Vec<_>>().join("; ");
    match dry_run_strict(&ctx.lower, ns, desired).await {
        Ok(stored) => {
            let lost = features::dropped(spec, stored.spec.as_ref()?);
            if lost.is_empty() {
                return None;
            }
            Some(format!(
                "lower cluster {} ({}) does not keep {}: its apiserver drops it, and the pod would run there \
                 without it; it is not created there",
                ctx.cluster_name,
                lower_version().await,
                describe(&lost)
            ))
        }
        // A lower admission webhook with side effects refuses every dry run: that says
        // nothing of the pod.
        Err(kube::Error::Api(s)) if s.message.contains("does not support dry run") => None,
        Err(kube::Error::Api(s)) if s.code == 400 || s.code == 422 => Some(format!(
            "lower cluster {} ({}) refuses the pod, which asks for {}: {}; it is not created there",
            ctx.cluster_name,
            lower_version().await,
            describe(&asked),
            s.message
        )),
        Err(_) => None,
    }
}

/// A server-side dry run of creating `pod` in `namespace`, with strict field validation: a
/// field the apiserver does not know is an error rather than dropped.
async fn dry_run_strict(client: &kube::Client, namespace: &str, pod: &Pod) -> Result<Pod, kube::Error> {
    let body = serde_json::to_vec(pod).map_err(kube::Error::SerdeError)?;
    let request = http::Request::post(format!(
        "/api/v1/namespaces/{namespace}/pods?dryRun=All&fieldValidation=Strict"
    ))
    .header(http::header::CONTENT_TYPE, "application/json")
    .body(body)
    .map_err(kube::Error::HttpError)?;
    client.request(request).await
}

/// The answer when the lower cluster has a same-named pod without this node's marks: it is
/// left untouched, and the upper pod says so (condition and event).
async fn pod_conflict(ctx: &Context, upper: &Pod) -> Result<Action, Error> {
    let (ns, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
    let msg = format!(
        "lower cluster {} already has a pod {ns}/{name} not created by this virtual node; it is left untouched",
        ctx.cluster_name
    );
    if !synced_says(upper, |c| c.message.as_deref() == Some(msg.as_str())) {
        event(ctx, upper, EventType::Warning, "LowerPodConflict", &msg);
    }
    set_condition(
        ctx,
        upper,
        names::CONDITION_LOWER_SYNCED,
        "False",
        "Conflict",
        &msg,
    )
    .await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// `Some` (the conflict answer) when the lower cluster has a pod of `upper`'s name that is
/// not this node's: from the cache of every unfinished lower pod, else one read (a finished
/// pod holds the name too).
async fn foreign_pod_below(
    ctx: &Context,
    upper: &Pod,
    lower_pods: &Api<Pod>,
) -> Result<Option<Action>, Error> {
    let (ns, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
    let identity = &ctx.translation.identity;
    let cached = ctx.copies.lower_pods.get(&ObjectRef::new(&name).within(&ns));
    let foreign = match cached {
        Some(load) => !identity.owns(&load.metadata),
        None => lower_pods
            .get_metadata_opt(&name)
            .await
            .map_err(Error::api("lower", "get", format!("pod {ns}/{name}")))?
            .is_some_and(|p| !identity.owns(&p.metadata)),
    };
    if foreign {
        return pod_conflict(ctx, upper).await.map(Some);
    }
    Ok(None)
}

/// Deletes exactly `pod` (UID precondition) in `cluster`. Already gone (404) or replaced by
/// a newer pod of the same name (409) both mean there is nothing of ours left to delete.
async fn delete_exact(
    api: &Api<Pod>,
    limit: &WriteLimit,
    cluster: &'static str,
    pod: &impl Resource,
    grace: Option<i64>,
) -> Result<(), Error> {
    limit.acquire().await;
    tensile_common::api::delete_exact(api, &pod.name_any(), pod.uid(), grace)
        .await
        .map(drop)
        .map_err(Error::api(cluster, "delete", format!("pod {}", key(pod))))
}

/// Deletes a lower pod we own, with the given grace; a pod without our marks is never touched.
async fn delete_lower(
    ctx: &Context,
    api: &Api<Pod>,
    lower: &impl Resource,
    grace: Option<i64>,
) -> Result<(), Error> {
    if !ctx.translation.identity.owns(lower.meta()) {
        return Ok(());
    }
    delete_exact(api, &ctx.lower_limit, "lower", lower, grace).await
}

/// Confirms the upper deletion as a kubelet does: grace 0 and the pod's UID (a mismatch means
/// the pod was recreated: the new one is left alone).
async fn release_upper(ctx: &Context, upper: &Pod) -> Result<(), Error> {
    // A pod its Job tracks by finalizer is made terminal first (see the function).
    if let Some(phase) = translate::terminal_phase_before_release(upper) {
        patch_upper_status(ctx, upper, json!({"phase": phase})).await?;
    }
    let api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
    delete_exact(&api, &ctx.upper_limit, "upper", upper, Some(0)).await
}

/// Writes `status` (whose `conditions`, when present, is the whole list wanted) with a
/// strategic merge patch, as the kubelet does: conditions merge by `type`, and only the
/// changed ones are sent.
async fn patch_upper_status(ctx: &Context, upper: &Pod, status: serde_json::Value) -> Result<(), Error> {
    write_upper_status(ctx, upper, status, false).await.map(drop)
}

/// As [`patch_upper_status`], and what the upper apiserver stored (`None` when the pod is
/// gone or another one now). With `at_version` the write is also conditional on the pod
/// being at the version read (`None` when it is not, as for a pod that is gone): the pod
/// stored is then the one read with this status, nothing else.
async fn write_upper_status(
    ctx: &Context,
    upper: &Pod,
    mut status: serde_json::Value,
    at_version: bool,
) -> Result<Option<tensile_common::api::Stored>, Error> {
    let api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
    if let Some(wanted) = status.get("conditions").and_then(|c| c.as_array()) {
        let changed = translate::changed_conditions(upper, wanted);
        if let Some(fields) = status.as_object_mut() {
            if changed.is_empty() {
                fields.remove("conditions");
            } else {
                fields.insert("conditions".into(), json!(changed));
            }
        }
    }
    // The uid in the body makes the write conditional on the pod being the one we read; a
    // resourceVersion, on its being at that version.
    let mut patch = json!({"metadata": {"uid": upper.uid()}, "status": status});
    if at_version {
        patch["metadata"]["resourceVersion"] = json!(upper.resource_version());
    }
    ctx.upper_limit.acquire().await;
    match tensile_common::api::patch_status_stored(
        &api,
        &upper.name_any(),
        &PatchParams::default(),
        &Patch::Strategic(&patch),
    )
    .await
    {
        Ok(stored) => Ok(Some(stored)),
        Err(e) if matches!(tensile_common::api::code(&e), Some(404) | Some(409)) => Ok(None),
        Err(e) => Err(Error::api("upper", "patch-status", format!("pod {}", key(upper)))(e)),
    }
}

/// How long the first status of a new lower pod may wait while the pod is merely pending
/// (see [`translate::merely_pending`]). Most pods are Running sooner; one write then carries
/// both that and `LowerPodSynced`, instead of one write per step of the lower pod. During a
/// burst the upper apiserver's write latency is what status waits on, so every write saved
/// shortens everyone's wait.
const FIRST_STATUS_DELAY: Duration = Duration::from_secs(2);

/// How often a pod of a lower cluster that does not answer is looked at again.
const UNREACHABLE_RECHECK: Duration = Duration::from_secs(5);

/// How often a pod whose status is current is looked at again without any event.
const STATUS_RECHECK: Duration = Duration::from_secs(300);

/// What [`write_status`] did with the status the lower pod implies.
enum Written {
    /// The upper pod showed it already.
    Current,
    /// Not written: it may still wait, or the pod changed since it was read.
    NotYet,
    /// Written, and the upper pod now stored at this version shows it.
    Stored(String),
}

/// Writes the upper status the lower pod implies, unless it is the first and may still wait;
/// says when to look again, and what became of the status. The write is conditional on the
/// upper pod's version first, so that the version stored is known to be the pod read plus
/// this status.
async fn write_status(ctx: &Context, upper: &Pod, lower: &Pod) -> Result<(Action, Written), Error> {
    let again = Action::requeue(STATUS_RECHECK);
    let scale_up = ctx.scale_ups.of(lower);
    let tracks_generation = ctx
        .upper_tracks_generation
        .load(std::sync::atomic::Ordering::Relaxed);
    let (mut status, differs) = translate::upper_status(
        upper,
        lower,
        scale_up.as_ref(),
        &ctx.host_ip,
        jiff::Timestamp::now(),
        tracks_generation,
    );
    if !differs {
        return Ok((again, Written::Current));
    }
    if let Some(wait) = first_status_wait(ctx, upper, lower) {
        return Ok((Action::requeue(wait), Written::NotYet));
    }
    // The lower pod exists and is ours: the sync condition says so.
    if let Some(conds) = status.get_mut("conditions").and_then(|c| c.as_array_mut()) {
        let synced_ok = conds
            .iter()
            .any(|c| c["type"] == names::CONDITION_LOWER_SYNCED && c["status"] == "True");
        if !synced_ok {
            conds.retain(|c| c["type"] != names::CONDITION_LOWER_SYNCED);
            conds.push(
                json!({"type": names::CONDITION_LOWER_SYNCED, "status": "True", "reason": "Created",
                              "lastTransitionTime": tensile_common::api::now()}),
            );
        }
    }
    let sent_generation = status.get("observedGeneration").is_some();
    let Some(stored) = write_upper_status(ctx, upper, status.clone(), true).await? else {
        // The pod changed since it was read, or is gone. Most often the change is this
        // node's own status write that the watch has not brought yet: waiting for its event
        // would hold the status back by the watch's lag (seconds when the upper apiserver is
        // busy, and more first statuses then wait out their hold and take two writes). The
        // status goes up as the kubelet writes it, onto the pod as stored, and that version
        // is not taken as settled: its event is reconciled in full.
        write_upper_status(ctx, upper, status, false).await?;
        return Ok((again, Written::NotYet));
    };
    // An upper apiserver without PodObservedGenerationTracking (off before 1.34) drops the
    // field: it is then no longer written, or every reconcile would find it missing and
    // write the status again.
    if sent_generation
        && stored
            .status
            .as_ref()
            .is_none_or(|s| s.observed_generation.is_none())
    {
        ctx.upper_tracks_generation
            .store(false, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            "the upper apiserver does not keep a pod's status.observedGeneration \
             (PodObservedGenerationTracking is off there): it is no longer written"
        );
        return Ok((again, Written::NotYet));
    }
    Ok((
        again,
        stored
            .metadata
            .resource_version
            .map_or(Written::NotYet, Written::Stored),
    ))
}

/// How much longer the first status write for `upper` may wait: only while the lower pod is
/// merely pending, nothing was written yet (no `LowerPodSynced`), and for at most
/// [`FIRST_STATUS_DELAY`] from the first time it was held back.
fn first_status_wait(ctx: &Context, upper: &Pod, lower: &Pod) -> Option<Duration> {
    let uid = upper.uid().unwrap_or_default();
    let Ok(mut held) = ctx.first_status_held.lock() else {
        return None;
    };
    if synced_says(upper, |_| true) || !translate::merely_pending(lower) {
        held.remove(&uid);
        return None;
    }
    let lower_uid = lower.uid().unwrap_or_default();
    let since = match held.get(&uid) {
        Some((since, held_for)) if *held_for == lower_uid => *since,
        _ => {
            held.insert(uid.clone(), (Instant::now(), lower_uid));
            Instant::now()
        }
    };
    match FIRST_STATUS_DELAY.checked_sub(since.elapsed()) {
        Some(wait) if !wait.is_zero() => Some(wait),
        _ => {
            held.remove(&uid);
            None
        }
    }
}

/// Forgets held-back first writes of pods that went away before they were written.
/// Also forgets, when the upper pods may have changed (`pods_changed`), the failure counts
/// of pods no longer bound here (deleted without a last successful reconcile).
pub fn forget_stale_holds(ctx: &Context, pods_changed: bool) {
    if let Ok(mut held) = ctx.first_status_held.lock() {
        held.retain(|_, (since, _)| since.elapsed() < 10 * FIRST_STATUS_DELAY);
    }
    if !pods_changed {
        return;
    }
    let bound: std::collections::HashSet<String> =
        ctx.upper_pods.state().iter().map(|p| retry_key(&**p)).collect();
    ctx.retries.retain(|key| bound.contains(key));
    ctx.settled.retain(|uid| bound.contains(uid));
}

async fn set_condition(
    ctx: &Context,
    upper: &Pod,
    kind: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    let unchanged = upper
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == kind))
        .is_some_and(|c| {
            c.status == status
                && c.reason.as_deref() == Some(reason)
                && c.message.as_deref().unwrap_or("") == message
        });
    if unchanged {
        return Ok(());
    }
    let now = tensile_common::api::now();
    let conditions = translate::with_condition(upper, kind, status, reason, message, &now);
    patch_upper_status(ctx, upper, json!({"conditions": conditions})).await
}

async fn fail_upper(ctx: &Context, upper: &Pod, reason: &str, message: &str) -> Result<(), Error> {
    let now = tensile_common::api::now();
    let conditions = translate::with_condition(
        upper,
        names::CONDITION_LOWER_SYNCED,
        "False",
        reason,
        message,
        &now,
    );
    patch_upper_status(
        ctx,
        upper,
        json!({"phase": "Failed", "reason": reason, "message": message, "conditions": conditions}),
    )
    .await
}

fn event(ctx: &Context, upper: &Pod, type_: EventType, reason: &str, note: &str) {
    ctx.events.publish(upper.object_ref(&()), type_, reason, note);
}

/// What one orphan collection pass did.
#[derive(Debug, Default, PartialEq)]
pub struct Collected {
    pub deleted: usize,
    /// Deletes that failed: the pass is worth running again soon.
    pub failed: usize,
}

/// Deletes the lower pods of ours that are [`orphaned`], each with a UID precondition. Runs
/// only once both caches are warm (the caller waits), so a pod is never judged orphaned on
/// an empty cache; and only while the lower cluster answers, since its deletes would
/// otherwise fail, or on a partition wait out their deadlines one after the other and hold
/// the pass past the lower cluster's return.
pub async fn collect_orphans(ctx: &Context) -> Collected {
    let mut collected = Collected::default();
    for lower in ctx.lower_pods.state() {
        let ns = lower.namespace().unwrap_or_default();
        let upper = ctx.upper_pods.get(&ObjectRef::new(&lower.name_any()).within(&ns));
        if !orphaned(
            &lower.metadata,
            upper.as_ref().map(|u| u.meta()),
            &ctx.translation.identity,
        ) {
            continue;
        }
        if !ctx.lower_health.reachable() {
            break;
        }
        let api: Api<Pod> = Api::namespaced(ctx.lower.clone(), &ns);
        match delete_lower(ctx, &api, &*lower, None).await {
            Ok(()) => {
                tracing::info!(pod = %key(&*lower), "deleted a lower pod whose upper pod is gone");
                collected.deleted += 1;
            }
            Err(e) => {
                tracing::warn!("orphan collection: {e}");
                collected.failed += 1;
            }
        }
    }
    collected
}

/// With `--gc-namespaces`: deletes lower namespaces this node created once they have been
/// empty (see [`tensile_common::lower::objects::namespace_is_empty`]) on two passes in a row and no upper pod of this node
/// lives in them. `empty_before` carries the previous pass's verdicts.
pub async fn collect_namespaces(ctx: &Context, empty_before: &mut std::collections::HashSet<String>) {
    let api: Api<Namespace> = Api::all(ctx.lower.clone());
    let ours = match api
        .list_metadata(&kube::api::ListParams::default().labels(&ctx.translation.identity.selector()))
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!("namespace collection: listing lower namespaces: {e}");
            return;
        }
    };
    let hosts_upper_pods = |name: &str| {
        ctx.upper_pods
            .state()
            .iter()
            .any(|p| p.namespace().as_deref() == Some(name))
    };
    let mut empty_now = std::collections::HashSet::new();
    let mut kinds = None;
    for ns in ours {
        let name = ns.metadata.name.clone().unwrap_or_default();
        if ns.metadata.deletion_timestamp.is_some()
            || !ctx.translation.identity.owns(&ns.metadata)
            || hosts_upper_pods(&name)
        {
            continue;
        }
        if kinds.is_none() {
            match tensile_common::lower::objects::namespaced_kinds(&ctx.lower).await {
                Ok(found) => kinds = Some(found),
                Err(e) => {
                    tracing::warn!("namespace collection: discovering the lower cluster's kinds: {e}");
                    return;
                }
            }
        }
        let kinds = kinds.as_deref().unwrap_or_default();
        match tensile_common::lower::objects::namespace_is_empty(&ctx.lower, &name, kinds).await {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(namespace = %name, "namespace collection: {e}");
                continue;
            }
        }
        if !empty_before.contains(&name) {
            empty_now.insert(name);
            continue;
        }
        // There is no delete-if-empty: look once more right before deleting, so what was
        // put there since the last pass (by anyone) keeps the namespace.
        if !matches!(
            tensile_common::lower::objects::namespace_is_empty(&ctx.lower, &name, kinds).await,
            Ok(true)
        ) || hosts_upper_pods(&name)
        {
            continue;
        }
        ctx.namespaces.forget(&name);
        ctx.lower_limit.acquire().await;
        match tensile_common::api::delete_exact(&api, &name, ns.metadata.uid.clone(), None).await {
            Ok(tensile_common::api::Deleted::Accepted) => {
                tracing::info!(namespace = %name, "deleted an empty lower namespace this node created")
            }
            Ok(tensile_common::api::Deleted::AlreadyGone) => {}
            Err(e) => tracing::warn!(namespace = %name, "namespace collection: {e}"),
        }
    }
    *empty_before = empty_now;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_node_authorizers_missing_binding_is_taken_for_its_lag() {
        let refused = |cluster: &'static str, code: u16, message: &str| {
            Error::api(cluster, "get", "ConfigMap fleet/settings")(kube::Error::Api(
                kube::core::Status::failure(message, "Forbidden")
                    .with_code(code)
                    .boxed(),
            ))
        };
        let lag = "configmaps \"settings\" is forbidden: User \"system:node:lower-b\" cannot get resource \"configmaps\" in API group \"\" in the namespace \"fleet\": node: no relationship found between node 'lower-b' and this object";
        assert!(refused("upper", 403, lag).binding_unseen());
        assert!(
            !refused("upper", 403, "configmaps is forbidden: no RBAC policy matched").binding_unseen(),
            "a missing grant is no lag"
        );
        assert!(!refused("lower", 403, lag).binding_unseen());
        assert!(!refused("upper", 404, lag).binding_unseen());
        let retries = Backoff::default();
        assert!(!retries.failing("uid"));
        retries.next_delay("uid");
        assert!(
            retries.failing("uid"),
            "the second refusal is logged as a failure"
        );
        retries.forget("uid");
        assert!(!retries.failing("uid"));
    }

    #[test]
    fn a_settled_pod_is_skipped_only_while_neither_pod_changes() {
        let settled = Settled::default();
        let at = |uid: &str, rv: &str| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "p", "uid": uid, "resourceVersion": rv}}))
                .unwrap()
        };
        let (upper, lower) = (at("u", "10"), at("l", "11"));
        assert!(!settled.holds(&upper, &lower), "nothing recorded yet");
        settled.record(&upper, &lower);
        assert!(settled.holds(&upper, &lower));
        assert!(!settled.holds(&at("u", "12"), &lower), "the upper pod changed");
        assert!(!settled.holds(&upper, &at("l", "13")), "the lower pod changed");
        assert!(
            !settled.holds(&at("v", "10"), &lower),
            "another pod of the same name"
        );
        settled.retain(|uid| uid != "u");
        assert!(!settled.holds(&upper, &lower), "no longer bound here");
        // A status written on the version read, stored as version 14: settled at 14 only.
        settled.record_written(&upper, "14".into(), &lower);
        assert!(
            settled.holds(&at("u", "14"), &lower),
            "the pod as the write stored it"
        );
        assert!(
            !settled.holds(&upper, &lower),
            "the pod as read, before its status"
        );
        assert!(!settled.holds(&at("u", "15"), &lower), "a change after the write");
    }
}
