//! Pure translation between an upper pod and its lower pod: the pod that goes down, the
//! ownership marks, which updates may follow it, and the status that comes back up.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Affinity, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};
use tensile_common::names;
use tensile_common::stash::Stash;

use crate::model::refs::is_upper_api_source;
use crate::model::refs::is_upper_token_volume;
use crate::model::refs::service_account;
use crate::model::scale_ups::Signal;
use tensile_common::lower::identity::Identity;
use tensile_common::resources::is_terminal;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("annotation clusterSelector: {0}")]
    Stash(#[from] tensile_common::stash::Error),
    #[error(
        "annotation clusterSelector is not trusted: {0}; only a stash the webhook signed for this \
         pod is applied below"
    )]
    UntrustedStash(#[source] tensile_common::stash::Untrusted),
    #[error("pod has no uid")]
    NoUid,
}

/// Translation settings.
#[derive(Clone, Debug)]
pub struct Translation {
    pub identity: Identity,
    /// Labels kept upstream only: stripped on the way down, never compared.
    pub ignore_labels: Vec<String>,
    /// With keys, only stashes the webhook signed for their pod are applied
    /// (`--stash-key-file`, one or more).
    pub stash_key: Option<std::sync::Arc<tensile_common::stash::StashKeys>>,
    /// With `--upper-service-account-tokens`: pods get upper tokens below ([`crate::decide::tokens`]).
    pub tokens: Option<std::sync::Arc<crate::decide::tokens::Settings>>,
}

/// Takes the upper API out of `spec` where no upper token replaces it: a secret-based token
/// volume goes, and so do a projected token volume's upper-API sources; such a volume left with
/// nothing but the downward API (the namespace beside the token) goes too. Returns the names of
/// the volumes that went, whose mounts must go with them.
fn drop_upper_api(spec: &mut PodSpec, service_account: &str) -> Vec<String> {
    let mut dropped = Vec::new();
    for v in spec.volumes.iter_mut().flatten() {
        if !is_upper_token_volume(v, service_account) {
            continue;
        }
        let Some(projected) = v.projected.as_mut() else {
            dropped.push(v.name.clone());
            continue;
        };
        let sources = projected.sources.get_or_insert_default();
        sources.retain(|s| !is_upper_api_source(s));
        if sources.iter().all(|s| s.downward_api.is_some()) {
            dropped.push(v.name.clone());
        }
    }
    dropped
}

impl Translation {
    fn keep_label(&self, key: &str) -> bool {
        !self.ignore_labels.iter().any(|l| l == key)
            && ![names::MARK_CLUSTER, names::MARK_NODE, names::MARK_UPPER_UID].contains(&key)
    }

    /// Labels of the lower pod: the upper ones minus ignored, plus our marks.
    fn lower_labels(&self, upper: &Pod, uid: &str) -> BTreeMap<String, String> {
        let mut labels: BTreeMap<String, String> = upper
            .metadata
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| self.keep_label(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.extend(self.identity.marks());
        labels.insert(names::MARK_UPPER_UID.to_owned(), uid.to_owned());
        labels
    }

    /// Annotations of the lower pod: the upper ones minus the stash (it is applied) and
    /// kubectl's last-applied copy (it describes the upper object).
    fn lower_annotations(upper: &Pod) -> BTreeMap<String, String> {
        upper
            .metadata
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| {
                ![
                    names::CLUSTER_SELECTOR,
                    names::STASH_SIGNATURE,
                    "kubectl.kubernetes.io/last-applied-configuration",
                    names::COPIED_LABELS,
                    names::COPIED_ANNOTATIONS,
                    crate::decide::tokens::TOKEN_SECRET_ANNOTATION,
                    crate::decide::certificates::SECRET_ANNOTATION,
                    names::OVERRIDES,
                    names::UPPER_GENERATION,
                    names::RESIZE_REFUSED,
                ]
                .contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Why `upper` is not run below, when it projects a pod certificate this node does not
    /// carry to its namespace ([`crate::decide::certificates::not_carried`]).
    pub fn not_carried(&self, upper: &Pod) -> Option<String> {
        crate::decide::certificates::not_carried(
            upper.spec.as_ref()?,
            upper.metadata.namespace.as_deref().unwrap_or_default(),
            self.tokens.as_deref(),
        )
    }

    /// The pod to create below for `upper`.
    pub fn lower_pod(&self, upper: &Pod) -> Result<Pod, Error> {
        let uid = upper.metadata.uid.as_deref().ok_or(Error::NoUid)?;
        if let Some(keys) = &self.stash_key {
            keys.check(&upper.metadata).map_err(Error::UntrustedStash)?;
        }
        let stash = Stash::from_annotations(upper.metadata.annotations.as_ref())?.unwrap_or_default();
        let mut spec: PodSpec = upper.spec.clone().unwrap_or_default();
        let service_account = service_account(&spec);

        // Placement below: the stashed constraints, or none (the upper scheduler already
        // matched the others against the virtual node; lower nodes carry other labels).
        spec.node_name = None;
        spec.node_selector = (!stash.node_selector.is_empty()).then(|| stash.node_selector.clone());
        let pod_affinity = spec.affinity.as_ref().and_then(|a| a.pod_affinity.clone());
        let pod_anti_affinity = spec.affinity.as_ref().and_then(|a| a.pod_anti_affinity.clone());
        let node_affinity = stash.node_affinity().cloned();
        spec.affinity = (pod_affinity.is_some() || pod_anti_affinity.is_some() || node_affinity.is_some())
            .then_some(Affinity {
                node_affinity,
                pod_affinity,
                pod_anti_affinity,
            });
        spec.tolerations = (!stash.tolerations.is_empty()).then(|| stash.tolerations.clone());
        // Upper-only fields: the scheduler name, priority value and readiness gates mean
        // nothing below; the upper service-account token must not travel. The overhead is
        // the upper RuntimeClass's: the lower cluster's admission sets its own class's (and
        // refuses a pod that says another).
        spec.scheduler_name = None;
        spec.priority = None;
        spec.overhead = None;
        spec.readiness_gates = None;
        spec.ephemeral_containers = None;
        // In the upper-token mode the token volumes read the pod's lower Secret of upper tokens
        // instead; the lower ServiceAccount's own token is never mounted either way.
        let namespace = upper.metadata.namespace.as_deref().unwrap_or_default();
        let rewritten = self
            .tokens
            .as_ref()
            .filter(|t| t.applies(namespace))
            .is_some_and(|t| {
                crate::decide::tokens::rewrite(
                    &mut spec,
                    &service_account,
                    &crate::decide::tokens::secret_name(uid),
                    t,
                )
            });
        // Pod certificates and trust bundles read the pod's lower Secret of them (a pod whose
        // certificates are not carried is refused before it is made: `Translation::not_carried`).
        let certificates =
            crate::decide::certificates::rewrite(&mut spec, &crate::decide::certificates::secret_name(uid));
        spec.service_account_name = None;
        spec.service_account = None;
        spec.automount_service_account_token = Some(false);
        // A generic ephemeral volume's claim is made below by the lower cluster from its
        // template: like any claim made below, never bound to a chosen lower volume nor filled
        // from lower data (see `volumes::lower_claim`).
        for v in spec.volumes.iter_mut().flatten() {
            if let Some(claim) = v
                .ephemeral
                .as_mut()
                .and_then(|e| e.volume_claim_template.as_mut())
            {
                claim.spec.selector = None;
                claim.spec.volume_name = None;
                claim.spec.data_source = None;
                claim.spec.data_source_ref = None;
            }
        }
        let dropped = match rewritten {
            true => Vec::new(),
            false => drop_upper_api(&mut spec, &service_account),
        };
        if let Some(volumes) = &mut spec.volumes {
            volumes.retain(|v| !dropped.contains(&v.name));
            if volumes.is_empty() {
                spec.volumes = None;
            }
        }
        let strip = |c: &mut k8s_openapi::api::core::v1::Container| {
            if let Some(mounts) = &mut c.volume_mounts {
                mounts.retain(|m| !dropped.contains(&m.name));
                if mounts.is_empty() {
                    c.volume_mounts = None;
                }
            }
        };
        spec.containers.iter_mut().for_each(strip);
        spec.init_containers.iter_mut().flatten().for_each(strip);

        let labels = self.lower_labels(upper, uid);
        let mut annotations = Self::lower_annotations(upper);
        let copied_labels: Vec<&str> = labels
            .keys()
            .map(String::as_str)
            .filter(|k| self.keep_label(k))
            .collect();
        let copied_annotations = annotations.keys().cloned().collect::<Vec<_>>().join(",");
        annotations.insert(names::COPIED_LABELS.to_owned(), copied_labels.join(","));
        annotations.insert(names::COPIED_ANNOTATIONS.to_owned(), copied_annotations);
        if rewritten {
            annotations.insert(
                crate::decide::tokens::TOKEN_SECRET_ANNOTATION.to_owned(),
                crate::decide::tokens::secret_name(uid),
            );
        }
        if certificates {
            annotations.insert(
                crate::decide::certificates::SECRET_ANNOTATION.to_owned(),
                crate::decide::certificates::secret_name(uid),
            );
        }
        if let Some(generation) = upper.metadata.generation {
            annotations.insert(names::UPPER_GENERATION.to_owned(), generation.to_string());
        }
        Ok(Pod {
            metadata: ObjectMeta {
                name: upper.metadata.name.clone(),
                namespace: upper.metadata.namespace.clone(),
                labels: Some(labels),
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        })
    }

    /// A strategic-merge patch bringing the mutable fields of `actual` (labels, annotations,
    /// images, activeDeadlineSeconds, added tolerations) to `desired`; `None` when they agree.
    pub fn update_patch(&self, desired: &Pod, actual: &Pod) -> Option<Value> {
        let mut patch = json!({});
        let mut changed = false;
        let empty = BTreeMap::new();
        // Keys copied from upstream earlier, as the lower pod records them: only those may
        // be removed (the lower cluster's own keys are not ours).
        let copied = |tracker: &str| -> Vec<String> {
            actual
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(tracker))
                .map(|list| {
                    list.split(',')
                        .filter(|k| !k.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        for (field, is_labels) in [("labels", true), ("annotations", false)] {
            let (want, have, copied) = if is_labels {
                (
                    desired.metadata.labels.as_ref(),
                    actual.metadata.labels.as_ref(),
                    copied(names::COPIED_LABELS),
                )
            } else {
                (
                    desired.metadata.annotations.as_ref(),
                    actual.metadata.annotations.as_ref(),
                    copied(names::COPIED_ANNOTATIONS),
                )
            };
            let (want, have) = (want.unwrap_or(&empty), have.unwrap_or(&empty));
            let mut diff = serde_json::Map::new();
            for (k, v) in want {
                if have.get(k) != Some(v) {
                    diff.insert(k.clone(), json!(v));
                }
            }
            for k in have.keys() {
                if copied.contains(k) && !want.contains_key(k) {
                    diff.insert(k.clone(), Value::Null);
                }
            }
            if !diff.is_empty() {
                patch["metadata"][field] = Value::Object(diff);
                changed = true;
            }
        }
        let (Some(ds), Some(as_)) = (&desired.spec, &actual.spec) else {
            return changed.then_some(patch);
        };
        let images = |spec: &PodSpec, init: bool| -> Vec<(String, Option<String>)> {
            let list = if init {
                spec.init_containers.clone().unwrap_or_default()
            } else {
                spec.containers.clone()
            };
            list.into_iter().map(|c| (c.name, c.image)).collect()
        };
        for (field, init) in [("containers", false), ("initContainers", true)] {
            let have = images(as_, init);
            let diff: Vec<Value> = images(ds, init)
                .into_iter()
                .filter(|(n, img)| have.iter().any(|(hn, himg)| hn == n && himg != img))
                .map(|(n, img)| json!({"name": n, "image": img}))
                .collect();
            if !diff.is_empty() {
                patch["spec"][field] = json!(diff);
                changed = true;
            }
        }
        if ds.active_deadline_seconds != as_.active_deadline_seconds && ds.active_deadline_seconds.is_some() {
            patch["spec"]["activeDeadlineSeconds"] = json!(ds.active_deadline_seconds);
            changed = true;
        }
        // Kubernetes only allows adding tolerations to a running pod. The lower pod also
        // holds tolerations the lower apiserver added (DefaultTolerationSeconds), so the new
        // list is what it has plus what it lacks.
        let have = as_.tolerations.clone().unwrap_or_default();
        let missing: Vec<_> = ds
            .tolerations
            .iter()
            .flatten()
            .filter(|t| !have.contains(t))
            .cloned()
            .collect();
        if !missing.is_empty() {
            patch["spec"]["tolerations"] = json!(have.into_iter().chain(missing).collect::<Vec<_>>());
            changed = true;
        }
        changed.then_some(patch)
    }
}

/// The upper generation `lower`'s spec reflects ([`names::UPPER_GENERATION`]); `None` for a
/// lower pod made before it was recorded, or with an unreadable record.
pub fn recorded_generation(lower: &Pod) -> Option<i64> {
    annotation(lower, names::UPPER_GENERATION)?.parse().ok()
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// A resize of the upper pod the lower apiserver refused ([`names::RESIZE_REFUSED`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ResizeRefusal {
    /// The upper generation whose resize was refused.
    pub generation: i64,
    /// `Infeasible` (it cannot be made there as asked) or `Deferred` (not now: tried again).
    pub reason: String,
    pub message: String,
}

impl ResizeRefusal {
    /// The refusal the lower apiserver's answer `code`/`message` to a resize means: a
    /// ResourceQuota it would exceed (403, "exceeded quota"), a conflict, throttling or a
    /// server error may pass later, and defer it, as a kubelet defers a resize its node has
    /// no room for yet; anything else (a LimitRange's bound, 403; an invalid resize, 422; a
    /// lower version without the `resize` subresource, 404) is infeasible there.
    pub fn of_answer(generation: i64, code: Option<u16>, message: String) -> Self {
        let later = match code {
            Some(403) => message.contains("exceeded quota"),
            Some(409) | Some(429) | None => true,
            Some(c) => c >= 500,
        };
        Self {
            generation,
            reason: if later { "Deferred" } else { "Infeasible" }.into(),
            message,
        }
    }

    /// The refusal recorded on `lower`, if any.
    pub fn of(lower: &Pod) -> Option<Self> {
        serde_json::from_str(annotation(lower, names::RESIZE_REFUSED)?).ok()
    }
}

/// Whether a resize of `upper` is due below: its generation moved past the one `lower`
/// reflects (a lower pod without the record is taken to reflect generation 1), or the
/// lower apiserver deferred the resize of this very generation. Only then are the lower
/// pod's resources compared, so what lower admission set on them (a limit range's
/// defaults, an autoscaler's webhook) is never fought while the upper pod stands still.
pub fn resize_due(upper: &Pod, lower: &Pod) -> bool {
    let Some(generation) = upper.metadata.generation else {
        return false;
    };
    generation > recorded_generation(lower).unwrap_or(1)
        || ResizeRefusal::of(lower).is_some_and(|r| r.generation == generation && r.reason == "Deferred")
}

/// The body of a `resize` subresource patch bringing `actual`'s resources to `desired`'s:
/// per container, sidecar and init container, and at pod level (`spec.resources`), the
/// requests and limits `desired` names whose quantity differs below. What only the lower pod
/// names is left as it is. `None` when they agree.
pub fn resize_patch(desired: &Pod, actual: &Pod) -> Option<Value> {
    let (want, have) = (desired.spec.as_ref()?, actual.spec.as_ref()?);
    let mut patch = json!({});
    let none = Vec::new();
    for (field, want, have) in [
        ("containers", &want.containers, &have.containers),
        (
            "initContainers",
            want.init_containers.as_ref().unwrap_or(&none),
            have.init_containers.as_ref().unwrap_or(&none),
        ),
    ] {
        let changes: Vec<Value> = want
            .iter()
            .filter_map(|c| {
                let below = have.iter().find(|h| h.name == c.name)?;
                let change = resources_change(c.resources.as_ref(), below.resources.as_ref())?;
                Some(json!({"name": c.name, "resources": change}))
            })
            .collect();
        if !changes.is_empty() {
            patch["spec"][field] = json!(changes);
        }
    }
    if let Some(change) = resources_change(want.resources.as_ref(), have.resources.as_ref()) {
        patch["spec"]["resources"] = change;
    }
    (patch != json!({})).then_some(patch)
}

/// The requests and limits of `want` whose quantity `have` does not state equally.
fn resources_change(
    want: Option<&k8s_openapi::api::core::v1::ResourceRequirements>,
    have: Option<&k8s_openapi::api::core::v1::ResourceRequirements>,
) -> Option<Value> {
    let same = |a: &str, b: &str| {
        a == b
            || matches!(
                (
                    tensile_common::quantity::parse_milli(a),
                    tensile_common::quantity::parse_milli(b)
                ),
                (Ok(x), Ok(y)) if x == y
            )
    };
    let mut out = json!({});
    for (field, want, have) in [
        (
            "requests",
            want.and_then(|r| r.requests.as_ref()),
            have.and_then(|r| r.requests.as_ref()),
        ),
        (
            "limits",
            want.and_then(|r| r.limits.as_ref()),
            have.and_then(|r| r.limits.as_ref()),
        ),
    ] {
        let diff: serde_json::Map<String, Value> = want
            .into_iter()
            .flatten()
            .filter(|(k, v)| !have.and_then(|h| h.get(*k)).is_some_and(|h| same(&h.0, &v.0)))
            .map(|(k, v)| (k.clone(), json!(v.0)))
            .collect();
        if !diff.is_empty() {
            out[field] = Value::Object(diff);
        }
    }
    (out != json!({})).then_some(out)
}

/// The phase a deleted, unfinished upper pod is given before its deletion is confirmed, as a
/// 1.27+ kubelet makes a deleted pod terminal first: only for a pod its Job tracks by
/// finalizer (Kubernetes 1.26+), since such a Job counts the pod (and applies its
/// `podFailurePolicy`, which may ignore a `DisruptionTarget`) only once it is terminal, and
/// would otherwise wait on it forever. `Succeeded` when every container ended with exit code
/// 0 under a restart policy that lets them, `Failed` otherwise. `None` for other pods (1.20
/// to 1.25 write no such finalizer) and for pods already terminal.
pub fn terminal_phase_before_release(upper: &Pod) -> Option<&'static str> {
    let tracked = upper
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == names::JOB_TRACKING_FINALIZER);
    if !tracked || is_terminal(upper) {
        return None;
    }
    let restart = upper
        .spec
        .as_ref()
        .and_then(|s| s.restart_policy.as_deref())
        .unwrap_or("Always");
    let statuses = upper.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    let all_succeeded = restart != "Always"
        && statuses.is_some_and(|list| {
            !list.is_empty()
                && list.iter().all(|c| {
                    c.state
                        .as_ref()
                        .and_then(|s| s.terminated.as_ref())
                        .is_some_and(|t| t.exit_code == 0)
                })
        });
    Some(if all_succeeded { "Succeeded" } else { "Failed" })
}

/// True for pods a DaemonSet owns.
pub fn is_daemonset_pod(pod: &Pod) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
}

pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// Whether `lower` shows nothing yet but that it is on its way: Pending with no reason or
/// message, not refused by the lower scheduler, and every container at most being created.
/// A waiting reason such as `ImagePullBackOff`, an `Unschedulable` verdict or a started
/// container is news a user should see at once.
pub fn merely_pending(lower: &Pod) -> bool {
    let Some(status) = &lower.status else {
        return true;
    };
    let quiet_container = |c: &k8s_openapi::api::core::v1::ContainerStatus| {
        let Some(state) = &c.state else { return true };
        state.running.is_none()
            && state.terminated.is_none()
            && state.waiting.as_ref().is_none_or(|w| {
                matches!(
                    w.reason.as_deref(),
                    None | Some("") | Some("ContainerCreating") | Some("PodInitializing")
                )
            })
    };
    phase(lower) == "Pending"
        && status.reason.as_deref().unwrap_or_default().is_empty()
        && status.message.as_deref().unwrap_or_default().is_empty()
        && !status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "PodScheduled" && c.status == "False")
        && status.container_statuses.iter().flatten().all(quiet_container)
        && status
            .init_container_statuses
            .iter()
            .flatten()
            .all(quiet_container)
}

fn condition(pod: &Pod, kind: &str) -> Option<Value> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .and_then(|c| serde_json::to_value(c).ok())
}

/// Conditions of the upper pod, as JSON, with `kind` set to `status/reason/message`: the
/// transition time moves only when the status does.
pub fn with_condition(
    upper: &Pod,
    kind: &str,
    status: &str,
    reason: &str,
    message: &str,
    now: &str,
) -> Vec<Value> {
    let mut out: Vec<Value> = upper
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .filter(|c| c.type_ != kind)
        .filter_map(|c| serde_json::to_value(c).ok())
        .collect();
    let since = condition(upper, kind)
        .filter(|c| c["status"] == status)
        .and_then(|c| c.get("lastTransitionTime").cloned())
        .unwrap_or_else(|| json!(now));
    out.push(json!({"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}));
    out
}

/// Applies the upper pod's `readinessGates` to the Ready condition that came from below, as
/// the kubelet does: Ready only when the containers are ready and every gate's condition
/// (written upstream by its controller) is True.
fn gate_readiness(upper: &Pod, conditions: &mut [Value]) {
    let gates = upper.spec.iter().flat_map(|s| s.readiness_gates.iter().flatten());
    let mut unmet = None;
    for gate in gates {
        let condition = upper
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .find(|c| c.type_ == gate.condition_type);
        match condition {
            None => {
                unmet = Some(format!(
                    "corresponding condition of pod readiness gate {:?} does not exist.",
                    gate.condition_type
                ));
                break;
            }
            Some(c) if c.status != "True" => {
                unmet = Some(format!(
                    "the status of pod readiness gate {:?} is not \"True\", but {}",
                    gate.condition_type, c.status
                ));
                break;
            }
            Some(_) => {}
        }
    }
    let Some(message) = unmet else { return };
    if let Some(ready) = conditions.iter_mut().find(|c| c["type"] == "Ready")
        && ready["status"] == "True"
    {
        ready["status"] = json!("False");
        ready["reason"] = json!("ReadinessGatesNotReady");
        ready["message"] = json!(message);
    }
}

/// The entries of `desired` (a whole conditions list) a strategic merge patch must send so
/// the pod's conditions become `desired`: the changed or new ones, and a delete directive
/// for each type that went away. Unchanged entries are not sent, so a condition another
/// writer changes meanwhile (`DisruptionTarget`, a readiness gate) is never written back
/// with what was read before.
pub fn changed_conditions(upper: &Pod, desired: &[Value]) -> Vec<Value> {
    let current: Vec<Value> = upper
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .filter_map(|c| serde_json::to_value(c).ok())
        .collect();
    let mut out: Vec<Value> = desired
        .iter()
        .filter(|d| !current.iter().any(|c| c == *d))
        .map(|d| {
            // A field the entry no longer has is sent as null, or the merge would keep it.
            let mut d = d.clone();
            let before = current
                .iter()
                .find(|c| c["type"] == d["type"])
                .and_then(Value::as_object);
            if let (Some(before), Some(entry)) = (before, d.as_object_mut()) {
                for key in before.keys() {
                    entry.entry(key.clone()).or_insert(Value::Null);
                }
            }
            d
        })
        .collect();
    for c in &current {
        if !desired.iter().any(|d| d["type"] == c["type"]) {
            out.push(json!({"type": c["type"], "$patch": "delete"}));
        }
    }
    out
}

/// The `tensile.io/LowerPodNominated` condition the upper pod should show: True while the
/// lower pod is unbound and the lower cluster makes room for it. Reason `Preempting` when the
/// lower scheduler has nominated a node for it (`status.nominatedNodeName`: it preempted pods
/// there and waits for them to end); otherwise reason `ScaleUp`, with the autoscaler's
/// message, when the pod's latest scale-up signal below says a node is being added for it
/// ([`crate::model::scale_ups`]; not when it is cluster-autoscaler's `NotTriggerScaleUp`).
/// Its `lastTransitionTime` is when the upper pod first showed it (kept while it holds, `now`
/// otherwise), from which the descheduler bounds how long it protects the pod. The upper
/// pod's own `status.nominatedNodeName` cannot carry it: an apiserver of 1.35 or later
/// (`ClearingNominatedNodeNameAfterBinding`) refuses it on a bound pod, and the upper
/// scheduler reads nominations of unbound pods only.
fn lower_nomination(upper: &Pod, lower: &Pod, scale_up: Option<&Signal>, now: Timestamp) -> Option<Value> {
    let bound = lower
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    if bound {
        return None;
    }
    let nominated = lower
        .status
        .as_ref()
        .and_then(|s| s.nominated_node_name.as_deref())
        .filter(|n| !n.is_empty());
    let (reason, message) = match (nominated, scale_up.filter(|s| s.scales_up())) {
        (Some(node), _) => (
            "Preempting",
            format!(
                "the lower scheduler preempted pods on node {node} for this pod and waits for them to end"
            ),
        ),
        (None, Some(signal)) if signal.message.is_empty() => (
            "ScaleUp",
            format!("the lower cluster adds a node for this pod ({})", signal.reason),
        ),
        (None, Some(signal)) => ("ScaleUp", signal.message.clone()),
        (None, None) => return None,
    };
    let since = upper
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| c.type_ == names::CONDITION_LOWER_NOMINATED && c.status == "True")
        .and_then(|c| c.last_transition_time.as_ref())
        .map_or_else(
            || tensile_common::api::time(now),
            |t| tensile_common::api::time(t.0),
        );
    Some(json!({
        "type": names::CONDITION_LOWER_NOMINATED,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }))
}

/// The upper generation the status of `lower` reflects, as the kubelet's
/// `status.observedGeneration` says it: the one recorded on the lower pod
/// ([`recorded_generation`]) once the lower pod's status caught up with the lower spec that
/// carries it (where the lower apiserver tracks its own `observedGeneration`: 1.34+), else
/// what the upper pod showed before. The lower pod's own generation never comes up: it
/// counts other writes.
fn observed_generation(upper: &Pod, lower: &Pod) -> Option<i64> {
    let caught_up = match (
        lower.status.as_ref().and_then(|s| s.observed_generation),
        lower.metadata.generation,
    ) {
        (Some(seen), Some(current)) => seen >= current,
        _ => true,
    };
    let shown = upper.status.as_ref().and_then(|s| s.observed_generation);
    match caught_up {
        true => recorded_generation(lower).or(shown),
        false => shown,
    }
}

/// The kubelet's `PodReadyToStartContainers` when the lower pod shows none (a lower pod not
/// yet on a node, or a lower kubelet that writes none): True once a container of it started
/// or ended, as the sandbox is then up.
fn ready_to_start(lower: &Pod, now: &str) -> Value {
    let started = lower.status.iter().any(|s| {
        s.container_statuses
            .iter()
            .chain(s.init_container_statuses.iter())
            .flatten()
            .any(|c| {
                c.state
                    .as_ref()
                    .is_some_and(|st| st.running.is_some() || st.terminated.is_some())
            })
    });
    json!({"type": "PodReadyToStartContainers", "status": if started { "True" } else { "False" },
           "lastTransitionTime": now})
}

/// The status fields the upper pod should show for `lower` (and `scale_up`, its latest
/// scale-up signal below), as a merge-patch body, and whether they differ from what the
/// upper pod shows now. `tracks_generation`: the upper apiserver keeps
/// `observedGeneration` (PodObservedGenerationTracking, on from 1.34); without it the
/// field is neither written nor compared, so a status it drops is not written again.
pub fn upper_status(
    upper: &Pod,
    lower: &Pod,
    scale_up: Option<&Signal>,
    host_ip: &str,
    now: Timestamp,
    tracks_generation: bool,
) -> (Value, bool) {
    let ls = lower.status.clone().unwrap_or_default();
    let lower_json = serde_json::to_value(&ls).unwrap_or_else(|_| json!({}));
    let upper_json = upper
        .status
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_else(|| json!({}));

    // Conditions: the upper scheduler's PodScheduled stays; the lower pod's own conditions
    // come up; the lower scheduler's verdict becomes our LowerPodScheduled; conditions of
    // other writers upstream are kept; our LowerPodNominated, PodReadyToStartContainers and
    // a resize's conditions are made afresh (a resize's end is their absence).
    let lower_types: Vec<String> = ls.conditions.iter().flatten().map(|c| c.type_.clone()).collect();
    let made_afresh = [
        names::CONDITION_LOWER_SCHEDULED,
        names::CONDITION_LOWER_NOMINATED,
        "PodReadyToStartContainers",
        "PodResizePending",
        "PodResizeInProgress",
    ];
    let mut conditions: Vec<Value> = Vec::new();
    for c in upper.status.iter().flat_map(|s| s.conditions.iter().flatten()) {
        let keep = c.type_ == "PodScheduled"
            || c.type_ == names::CONDITION_LOWER_SYNCED
            || (!lower_types.contains(&c.type_) && !made_afresh.contains(&c.type_.as_str()));
        if keep && let Ok(v) = serde_json::to_value(c) {
            conditions.push(v);
        }
    }
    if !conditions.iter().any(|c| c["type"] == "PodScheduled") {
        conditions.push(json!({"type": "PodScheduled", "status": "True"}));
    }
    let observed = observed_generation(upper, lower).filter(|_| tracks_generation);
    // What the lower cluster wrote says which upper generation it reflects, never the lower
    // pod's own.
    let reflects = |v: &mut Value| match observed {
        Some(g) => v["observedGeneration"] = json!(g),
        None => {
            if let Some(fields) = v.as_object_mut() {
                fields.remove("observedGeneration");
            }
        }
    };
    let mut below: Vec<Value> = Vec::new();
    for c in ls.conditions.iter().flatten() {
        let Ok(mut v) = serde_json::to_value(c) else {
            continue;
        };
        if c.type_ == "PodScheduled" {
            v["type"] = json!(names::CONDITION_LOWER_SCHEDULED);
        }
        below.push(v);
    }
    let stamp = tensile_common::api::time(now);
    if !below.iter().any(|c| c["type"] == "PodReadyToStartContainers") {
        let mut synthesized = ready_to_start(lower, &stamp);
        if let Some(before) = condition(upper, "PodReadyToStartContainers")
            .filter(|c| c["status"] == synthesized["status"])
            .and_then(|c| c.get("lastTransitionTime").cloned())
        {
            synthesized["lastTransitionTime"] = before;
        }
        below.push(synthesized);
    }
    // A resize the lower apiserver refused, for the generation the lower pod reflects.
    if let Some(refusal) =
        ResizeRefusal::of(lower).filter(|r| Some(r.generation) == recorded_generation(lower))
    {
        below.retain(|c| c["type"] != "PodResizePending");
        let since = condition(upper, "PodResizePending")
            .filter(|c| c["reason"] == refusal.reason.as_str())
            .and_then(|c| c.get("lastTransitionTime").cloned())
            .unwrap_or_else(|| json!(stamp));
        below.push(
            json!({"type": "PodResizePending", "status": "True", "reason": refusal.reason,
                          "message": refusal.message, "lastTransitionTime": since}),
        );
    }
    for mut v in below {
        reflects(&mut v);
        conditions.retain(|c| c["type"] != v["type"]);
        conditions.push(v);
    }
    conditions.extend(lower_nomination(upper, lower, scale_up, now));
    gate_readiness(upper, &mut conditions);
    conditions.sort_by(|a, b| a["type"].as_str().cmp(&b["type"].as_str()));

    let mut status = serde_json::Map::new();
    for field in [
        "phase",
        "reason",
        "message",
        "podIP",
        "podIPs",
        "startTime",
        "containerStatuses",
        "initContainerStatuses",
        "resources",
        "allocatedResources",
    ] {
        status.insert(
            field.into(),
            lower_json.get(field).cloned().unwrap_or(Value::Null),
        );
    }
    status.insert("hostIP".into(), json!(host_ip));
    status.insert("hostIPs".into(), json!([{"ip": host_ip}]));
    if let Some(g) = observed {
        status.insert("observedGeneration".into(), json!(g));
    }
    status.insert("conditions".into(), Value::Array(conditions));

    let mut current: Vec<Value> = upper_json
        .get("conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    current.sort_by(|a, b| a["type"].as_str().cmp(&b["type"].as_str()));
    let differs = status.iter().any(|(k, v)| {
        let have = if k == "conditions" {
            Value::Array(current.clone())
        } else {
            upper_json.get(k).cloned().unwrap_or(Value::Null)
        };
        // Absent and empty mean the same to a reader.
        let empty =
            |x: &Value| x.is_null() || x.as_array().is_some_and(Vec::is_empty) || x.as_str() == Some("");
        !(have == *v || (empty(&have) && empty(v)))
    });
    (Value::Object(status), differs)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Toleration;
    use tensile_common::lower::identity::upper_uid;

    /// A translation for node `vn` of upper cluster `c1`, keeping label `team` upstream.
    pub(crate) fn translation() -> Translation {
        Translation {
            identity: Identity {
                cluster_id: "c1".into(),
                node: "vn".into(),
            },
            ignore_labels: vec!["team".into()],
            stash_key: None,
            tokens: None,
        }
    }

    fn upper() -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "9",
                "labels": {"app": "web", "team": "blue"},
                "annotations": {"clusterSelector": r#"{"nodeSelector":{"disk":"ssd"},"tolerations":[{"key":"gpu","operator":"Exists"}]}"#, "note": "x"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "rs", "controller": true}],
                "finalizers": ["f"],
            },
            "spec": {
                "nodeName": "vn", "schedulerName": "multi", "priority": 5, "serviceAccountName": "builder",
                "overhead": {"cpu": "250m"},
                "nodeSelector": {"type": "virtual-kubelet"},
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
                "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}},
                "containers": [{"name": "app", "image": "nginx:1", "env": [{"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "db", "key": "p"}}}],
                                 "volumeMounts": [{"name": "builder-token-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                                                  {"name": "kube-api-access-xyz", "mountPath": "/x"},
                                                  {"name": "data", "mountPath": "/data"}]}],
                "volumes": [
                    {"name": "builder-token-abcde", "secret": {"secretName": "builder-token-abcde"}},
                    {"name": "kube-api-access-xyz", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
                    {"name": "data", "secret": {"secretName": "app-data"}},
                ],
            },
            "status": {"phase": "Pending"},
        }))
        .unwrap()
    }

    #[test]
    fn the_lower_pod_carries_marks_the_stash_and_nothing_upper_only() {
        let lower = translation().lower_pod(&upper()).unwrap();
        let v = serde_json::to_value(&lower).unwrap();
        let m = &v["metadata"];
        assert_eq!(m["name"], "web-1");
        assert_eq!(m["namespace"], "shop");
        assert_eq!(m["labels"]["app"], "web");
        assert!(m["labels"].get("team").is_none(), "ignored labels stay upstream");
        assert_eq!(m["labels"][names::MARK_CLUSTER], "c1");
        assert_eq!(m["labels"][names::MARK_NODE], "vn");
        assert_eq!(m["labels"][names::MARK_UPPER_UID], "u-1");
        assert_eq!(m["annotations"]["note"], "x");
        assert_eq!(m["annotations"][names::COPIED_LABELS], "app");
        assert_eq!(m["annotations"][names::COPIED_ANNOTATIONS], "note");
        assert!(m["annotations"].get("clusterSelector").is_none());
        for gone in [
            "uid",
            "resourceVersion",
            "ownerReferences",
            "finalizers",
            "managedFields",
        ] {
            assert!(m.get(gone).is_none(), "{gone} cleared");
        }
        let s = &v["spec"];
        assert!(s.get("nodeName").is_none());
        assert_eq!(
            s["nodeSelector"],
            json!({"disk": "ssd"}),
            "stash replaces the upper selector"
        );
        assert_eq!(s["tolerations"], json!([{"key": "gpu", "operator": "Exists"}]));
        assert!(
            s["affinity"].get("podAntiAffinity").is_some(),
            "pod anti-affinity kept"
        );
        assert!(
            s.get("schedulerName").is_none() && s.get("priority").is_none() && s.get("overhead").is_none()
        );
        assert!(s.get("serviceAccountName").is_none());
        assert_eq!(s["automountServiceAccountToken"], false);
        assert_eq!(
            s["volumes"],
            json!([{"name": "data", "secret": {"secretName": "app-data"}}])
        );
        assert_eq!(
            s["containers"][0]["volumeMounts"],
            json!([{"name": "data", "mountPath": "/data"}])
        );
        assert_eq!(
            s["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["name"], "db",
            "env references stay references"
        );
        assert!(v.get("status").is_none());
        let id = &translation().identity;
        assert!(id.owns(&lower.metadata));
        assert_eq!(upper_uid(&lower), Some("u-1"));
    }

    #[test]
    fn in_the_upper_token_mode_the_token_volumes_read_the_pods_secret_in_its_namespaces_only() {
        let settings = crate::decide::tokens::Settings::new(
            "https://upper.example:6443",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
            vec!["shop".into()],
            vec!["default".into()],
            0.8,
        )
        .unwrap();
        let t = Translation {
            tokens: Some(std::sync::Arc::new(settings)),
            ..translation()
        };
        let s = serde_json::to_value(t.lower_pod(&upper()).unwrap().spec).unwrap();
        assert_eq!(s["volumes"][0]["secret"]["secretName"], "tensile-upper-token-u-1");
        assert_eq!(
            s["volumes"][1]["projected"]["sources"][0]["secret"]["name"],
            "tensile-upper-token-u-1"
        );
        assert_eq!(
            s["containers"][0]["volumeMounts"].as_array().unwrap().len(),
            3,
            "every mount kept"
        );
        assert_eq!(s["automountServiceAccountToken"], false);
        assert!(
            s.get("serviceAccountName").is_none(),
            "the account may not exist below"
        );
        assert!(s["containers"][0]["env"].to_string().contains("upper.example"));
        let lower = t.lower_pod(&upper()).unwrap();
        assert_eq!(
            kube::ResourceExt::annotations(&lower)
                .get(crate::decide::tokens::TOKEN_SECRET_ANNOTATION)
                .map(String::as_str),
            Some("tensile-upper-token-u-1"),
            "the token keeper writes tokens only for a lower pod made to mount them"
        );

        let mut elsewhere = upper();
        elsewhere.metadata.namespace = Some("other".into());
        let s = serde_json::to_value(t.lower_pod(&elsewhere).unwrap().spec).unwrap();
        assert_eq!(
            s["volumes"],
            json!([{"name": "data", "secret": {"secretName": "app-data"}}])
        );
        assert!(
            !s.to_string().contains("upper.example"),
            "a namespace not covered gets nothing"
        );
    }

    /// An upper pod whose own projected volume holds a token beside a Secret, a ConfigMap, the
    /// root CA and the downward API, next to the admission's `kube-api-access-*` volume and a
    /// volume merely named like one.
    fn upper_with_own_projection() -> Pod {
        let mut pod = upper();
        let spec = pod.spec.as_mut().unwrap();
        spec.volumes = Some(
            serde_json::from_value(json!([
                {"name": "mixed", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token", "audience": "vault"}},
                    {"secret": {"name": "db-root"}},
                    {"configMap": {"name": "settings"}},
                    {"configMap": {"name": "kube-root-ca.crt"}},
                    {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]}},
                {"name": "kube-api-access-xyz", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}},
                {"name": "kube-api-access-lookalike", "projected": {"sources": [{"secret": {"name": "other-pods-secret"}}]}},
            ]))
            .unwrap(),
        );
        spec.containers[0].volume_mounts = Some(
            serde_json::from_value(json!([
                {"name": "mixed", "mountPath": "/mixed"},
                {"name": "kube-api-access-xyz", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                {"name": "kube-api-access-lookalike", "mountPath": "/lookalike"},
            ]))
            .unwrap(),
        );
        pod
    }

    #[test]
    fn a_projected_volume_is_judged_source_by_source() {
        let pod = upper_with_own_projection();
        // Its own sources travel (copied and conflict-checked like any other), the upper
        // API's stay behind; a name alone makes no volume the upper API's.
        let references: Vec<(String, String)> = crate::model::refs::upper_references(&pod)
            .into_iter()
            .map(|r| (r.kind.to_string(), r.name))
            .collect();
        assert_eq!(
            references,
            [
                ("Secret", "db-root"),
                ("ConfigMap", "settings"),
                ("Secret", "other-pods-secret"),
                ("Secret", "db"),
            ]
            .map(|(k, n)| (k.to_owned(), n.to_owned()))
        );

        // Without upper tokens: the token and root CA go, the pod's own sources stay; the
        // admission's volume, left with the namespace only, goes with its mount.
        let s = serde_json::to_value(translation().lower_pod(&pod).unwrap().spec).unwrap();
        assert_eq!(
            s["volumes"],
            json!([
                {"name": "mixed", "projected": {"sources": [
                    {"secret": {"name": "db-root"}},
                    {"configMap": {"name": "settings"}},
                    {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]}},
                {"name": "kube-api-access-lookalike", "projected": {"sources": [{"secret": {"name": "other-pods-secret"}}]}},
            ])
        );
        assert_eq!(
            s["containers"][0]["volumeMounts"],
            json!([
                {"name": "mixed", "mountPath": "/mixed"},
                {"name": "kube-api-access-lookalike", "mountPath": "/lookalike"},
            ])
        );

        // With upper tokens: the token and root CA read the pod's Secret of upper tokens; the
        // other sources are still the pod's own references, never part of that Secret.
        let settings = crate::decide::tokens::Settings::new(
            "https://upper.example:6443",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
            vec!["shop".into()],
            vec!["default".into(), "builder".into()],
            0.8,
        )
        .unwrap();
        let t = Translation {
            tokens: Some(std::sync::Arc::new(settings)),
            ..translation()
        };
        let s = serde_json::to_value(t.lower_pod(&pod).unwrap().spec).unwrap();
        let mixed = &s["volumes"][0]["projected"]["sources"];
        assert_eq!(mixed[0]["secret"]["name"], "tensile-upper-token-u-1");
        assert_eq!(mixed[1], json!({"secret": {"name": "db-root"}}));
        assert_eq!(mixed[2], json!({"configMap": {"name": "settings"}}));
        assert_eq!(mixed[3]["secret"]["name"], "tensile-upper-token-u-1");
        assert_eq!(
            s["volumes"][2],
            json!({"name": "kube-api-access-lookalike", "projected": {"sources": [{"secret": {"name": "other-pods-secret"}}]}})
        );
        let wanted = crate::decide::tokens::wanted(pod.spec.as_ref().unwrap(), "builder");
        assert_eq!(
            wanted.len(),
            2,
            "one token a token source, none for a lookalike name"
        );
    }

    #[test]
    fn an_ephemeral_claim_below_names_no_lower_volume_or_data() {
        let mut pod = upper();
        pod.spec.as_mut().unwrap().volumes = Some(
            serde_json::from_value(
                json!([{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "fast",
                    "resources": {"requests": {"storage": "1Gi"}},
                    "selector": {"matchLabels": {"disk": "theirs"}},
                    "volumeName": "their-volume",
                    "dataSource": {"kind": "PersistentVolumeClaim", "name": "their-claim"},
                    "dataSourceRef": {"kind": "PersistentVolumeClaim", "name": "their-claim"},
                }}}}]),
            )
            .unwrap(),
        );
        let s = serde_json::to_value(translation().lower_pod(&pod).unwrap().spec).unwrap();
        assert_eq!(
            s["volumes"][0]["ephemeral"]["volumeClaimTemplate"]["spec"],
            json!({
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "fast",
                "resources": {"requests": {"storage": "1Gi"}},
            })
        );
    }

    #[test]
    fn without_a_stash_upper_placement_is_dropped() {
        let mut p = upper();
        p.metadata.annotations = None;
        let lower = translation().lower_pod(&p).unwrap();
        let s = lower.spec.unwrap();
        assert!(s.node_selector.is_none() && s.tolerations.is_none());
        assert!(s.affinity.unwrap().node_affinity.is_none());
    }

    #[test]
    fn a_broken_stash_is_an_error_naming_the_annotation() {
        let mut p = upper();
        p.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("clusterSelector".into(), "{not json".into());
        let err = translation().lower_pod(&p).unwrap_err();
        assert!(err.to_string().contains("clusterSelector"), "{err}");
    }

    #[test]
    fn foreign_objects_are_not_ours() {
        let id = &translation().identity;
        let mut meta = ObjectMeta::default();
        assert!(!id.owns(&meta));
        meta.labels = Some(BTreeMap::from([
            (names::MARK_CLUSTER.to_owned(), "c1".to_owned()),
            (names::MARK_NODE.to_owned(), "other".to_owned()),
        ]));
        assert!(!id.owns(&meta), "another virtual node's pod");
    }

    #[test]
    fn a_toleration_added_upstream_reaches_a_lower_pod_that_has_the_lower_apiservers_defaults() {
        let t = translation();
        let lower = t.lower_pod(&upper()).unwrap();
        let defaults = json!([
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]);
        let mut actual = lower.clone();
        let mut have = actual
            .spec
            .as_ref()
            .unwrap()
            .tolerations
            .clone()
            .unwrap_or_default();
        have.extend(serde_json::from_value::<Vec<Toleration>>(defaults).unwrap());
        actual.spec.as_mut().unwrap().tolerations = Some(have.clone());
        assert_eq!(t.update_patch(&lower, &actual), None, "nothing new upstream");
        let added: Toleration =
            serde_json::from_value(json!({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}))
                .unwrap();
        let mut desired = lower.clone();
        desired
            .spec
            .as_mut()
            .unwrap()
            .tolerations
            .get_or_insert_default()
            .push(added.clone());
        let patch = t.update_patch(&desired, &actual).unwrap();
        let mut want = have;
        want.push(added);
        assert_eq!(patch["spec"]["tolerations"], json!(want));
    }

    #[test]
    fn readiness_gates_hold_ready_back_until_their_conditions_are_true() {
        let lower: Pod = serde_json::from_value(json!({"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}}))
        .unwrap();
        let gated = |gate_status: Option<&str>| -> Pod {
            let mut conditions = vec![json!({"type": "PodScheduled", "status": "True"})];
            if let Some(s) = gate_status {
                conditions.push(json!({"type": "example.com/lb", "status": s}));
            }
            serde_json::from_value(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": [], "readinessGates": [{"conditionType": "example.com/lb"}]},
                "status": {"conditions": conditions}}))
            .unwrap()
        };
        let ready = |upper: &Pod| {
            let (status, _) = upper_status(upper, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "Ready")
                .cloned()
                .unwrap()
        };
        let missing = ready(&gated(None));
        assert_eq!(missing["status"], "False");
        assert_eq!(missing["reason"], "ReadinessGatesNotReady");
        assert!(
            missing["message"].as_str().unwrap().contains("does not exist"),
            "{missing}"
        );
        assert_eq!(ready(&gated(Some("False")))["status"], "False");
        assert_eq!(ready(&gated(Some("True")))["status"], "True");
        assert_eq!(
            ready(&gated(Some("True")))["type"],
            "Ready",
            "the gate's own condition stays upstream"
        );
    }

    #[test]
    fn only_changed_conditions_are_sent_and_gone_ones_deleted() {
        let upper: Pod = serde_json::from_value(json!({"status": {"conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
            {"type": "Gone", "status": "True"}]}}))
        .unwrap();
        let desired = vec![
            json!({"type": "PodScheduled", "status": "True"}),
            json!({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}),
            json!({"type": "Ready", "status": "True"}),
        ];
        assert_eq!(
            changed_conditions(&upper, &desired),
            vec![
                json!({"type": "Ready", "status": "True", "reason": null}),
                json!({"type": "Gone", "$patch": "delete"})
            ]
        );
    }

    #[test]
    fn with_a_stash_key_only_a_stash_the_webhook_signed_for_the_pod_is_applied() {
        use tensile_common::stash::{Holder, StashKey, StashKeys, Untrusted};
        let key = StashKey::new("k1", &[3u8; 32]).unwrap();
        let t = Translation {
            stash_key: Some(std::sync::Arc::new(StashKeys::new(vec![
                StashKey::new("k1", &[3u8; 32]).unwrap(),
            ]))),
            ..translation()
        };
        let stash = r#"{"tolerations":[{"key":"node-role.kubernetes.io/master","operator":"Exists"}]}"#;
        let with = |signature: Option<String>| {
            let mut pod = upper();
            let annotations = pod.metadata.annotations.get_or_insert_default();
            annotations.insert(names::CLUSTER_SELECTOR.into(), stash.into());
            if let Some(sig) = signature {
                annotations.insert(names::STASH_SIGNATURE.into(), sig);
            }
            pod
        };
        let ns = upper().metadata.namespace.unwrap_or_default();
        // The pod's controller is ReplicaSet `rs`.
        let web = Holder::Controller("rs");
        assert!(
            matches!(
                t.lower_pod(&with(None)),
                Err(Error::UntrustedStash(Untrusted::Missing))
            ),
            "written by hand"
        );
        assert!(matches!(
            t.lower_pod(&with(Some(key.sign("elsewhere", web, stash)))),
            Err(Error::UntrustedStash(Untrusted::Mismatch { .. }))
        ));
        let replayed = t
            .lower_pod(&with(Some(key.sign(&ns, Holder::Controller("rs-other"), stash))))
            .unwrap_err();
        assert!(
            replayed.to_string().contains("controller uid rs"),
            "another workload's signature: {replayed}"
        );
        let lower = t.lower_pod(&with(Some(key.sign(&ns, web, stash)))).unwrap();
        assert_eq!(lower.spec.unwrap().tolerations.unwrap().len(), 1);
        assert!(
            !lower
                .metadata
                .annotations
                .unwrap_or_default()
                .contains_key(names::STASH_SIGNATURE),
            "the signature stays upstream"
        );
        let mut plain = upper();
        plain
            .metadata
            .annotations
            .get_or_insert_default()
            .remove(names::CLUSTER_SELECTOR);
        assert!(
            t.lower_pod(&plain).is_ok(),
            "a pod without a stash needs no signature"
        );
    }

    #[test]
    fn a_deleted_pod_its_job_tracks_by_finalizer_is_made_terminal_first() {
        // As 1.26+ writes a Job's pod: the tracking finalizer, here running when evicted.
        let mut pod = upper();
        pod.metadata.finalizers = Some(vec![names::JOB_TRACKING_FINALIZER.to_owned()]);
        pod.spec.as_mut().unwrap().restart_policy = Some("Never".into());
        pod.status = serde_json::from_value(json!({"phase": "Running",
            "containerStatuses": [{"name": "app", "image": "i", "imageID": "", "ready": true,
                                   "restartCount": 0, "state": {"running": {}}}]}))
        .unwrap();
        assert_eq!(terminal_phase_before_release(&pod), Some("Failed"));
        let mut done = pod.clone();
        done.status = serde_json::from_value(json!({"phase": "Running",
            "containerStatuses": [{"name": "app", "image": "i", "imageID": "", "ready": false,
                                   "restartCount": 0, "state": {"terminated": {"exitCode": 0}}}]}))
        .unwrap();
        assert_eq!(terminal_phase_before_release(&done), Some("Succeeded"));
        let mut finished = pod.clone();
        finished.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(terminal_phase_before_release(&finished), None, "already terminal");
        // As 1.20 to 1.25 write it: no finalizer, released as before.
        let mut untracked = pod.clone();
        untracked.metadata.finalizers = None;
        assert_eq!(terminal_phase_before_release(&untracked), None);
    }

    #[test]
    fn only_mutable_fields_are_patched() {
        let t = translation();
        let lower = t.lower_pod(&upper()).unwrap();
        assert_eq!(t.update_patch(&lower, &lower), None);
        let mut changed = upper();
        changed
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("version".into(), "2".into());
        changed
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "red".into());
        changed.spec.as_mut().unwrap().containers[0].image = Some("nginx:2".into());
        changed.spec.as_mut().unwrap().active_deadline_seconds = Some(60);
        let desired = t.lower_pod(&changed).unwrap();
        let mut actual = lower.clone();
        // A label that came from upstream and is gone there now, and one the lower
        // cluster added itself.
        actual
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("stale".into(), "x".into());
        actual
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("lower-own".into(), "y".into());
        actual
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(names::COPIED_LABELS.into(), "app,stale".into());
        let patch = t.update_patch(&desired, &actual).unwrap();
        assert_eq!(
            patch["metadata"]["labels"],
            json!({"version": "2", "stale": null})
        );
        assert_eq!(
            patch["metadata"]["annotations"][names::COPIED_LABELS],
            "app,version"
        );
        assert_eq!(
            patch["spec"]["containers"],
            json!([{"name": "app", "image": "nginx:2"}])
        );
        assert_eq!(patch["spec"]["activeDeadlineSeconds"], 60);
        assert!(patch["spec"].get("tolerations").is_none());
    }

    #[test]
    fn status_comes_up_with_the_lower_verdict_as_our_condition() {
        let mut up = upper();
        up.status = Some(
            serde_json::from_value(json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "example.com/gate", "status": "True"}]}))
            .unwrap(),
        );
        let lower: Pod = serde_json::from_value(json!({"status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 3 Insufficient cpu."}]}}))
        .unwrap();
        let (status, differs) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        assert!(differs);
        let conds = status["conditions"].as_array().unwrap();
        let get = |t: &str| conds.iter().find(|c| c["type"] == t).cloned();
        assert_eq!(
            get("PodScheduled").unwrap()["status"],
            "True",
            "bound upstream stays bound"
        );
        let lower_sched = get(names::CONDITION_LOWER_SCHEDULED).unwrap();
        assert_eq!(lower_sched["reason"], "Unschedulable");
        assert!(
            lower_sched["message"]
                .as_str()
                .unwrap()
                .contains("Insufficient cpu")
        );
        assert!(
            get("example.com/gate").is_some(),
            "other writers' conditions kept"
        );
        assert_eq!(status["hostIP"], "10.1.1.1");

        // Applying the status makes the next comparison equal.
        let mut applied = serde_json::to_value(&up).unwrap();
        for (k, v) in status.as_object().unwrap() {
            applied["status"][k] = v.clone();
        }
        let applied: Pod = serde_json::from_value(applied).unwrap();
        let (_, again) = upper_status(&applied, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        assert!(!again, "no write when nothing changed");
    }

    #[test]
    fn a_lower_nomination_comes_up_as_our_condition_from_when_it_was_first_shown_until_it_ends() {
        let nominated = |node_name: Value, nominated: Value| -> Pod {
            serde_json::from_value(json!({"spec": {"containers": [], "nodeName": node_name}, "status": {
                "phase": "Pending", "nominatedNodeName": nominated,
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                "message": "0/3 nodes are available: 3 Insufficient cpu. preemption: ..."}]}}))
            .unwrap()
        };
        let (t1, t2) = (
            "2024-05-01T10:00:00Z".parse::<Timestamp>().unwrap(),
            "2024-05-01T10:05:00Z".parse::<Timestamp>().unwrap(),
        );
        let apply = |up: &Pod, status: &Value| -> Pod {
            let mut applied = serde_json::to_value(up).unwrap();
            for (k, v) in status.as_object().unwrap() {
                applied["status"][k] = v.clone();
            }
            serde_json::from_value(applied).unwrap()
        };
        let condition = |status: &Value| {
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == names::CONDITION_LOWER_NOMINATED)
                .cloned()
        };

        // The lower scheduler preempted on low-2 for the unbound lower pod.
        let lower = nominated(json!(null), json!("low-2"));
        let (status, differs) = upper_status(&upper(), &lower, None, "10.1.1.1", t1, true);
        assert!(differs);
        let c = condition(&status).expect("the nomination comes up");
        assert_eq!(
            (&c["status"], &c["reason"], &c["lastTransitionTime"]),
            (
                &json!("True"),
                &json!("Preempting"),
                &json!("2024-05-01T10:00:00Z")
            )
        );
        assert!(c["message"].as_str().unwrap().contains("low-2"), "{c}");
        assert!(
            status.get("nominatedNodeName").is_none(),
            "never the upper pod's own field: a bound pod cannot carry it"
        );

        // Later, still nominated: the condition keeps its time, and nothing is written.
        let shown = apply(&upper(), &status);
        let (later, again) = upper_status(&shown, &lower, None, "10.1.1.1", t2, true);
        assert!(!again, "no write while the nomination holds");
        assert_eq!(
            condition(&later).unwrap()["lastTransitionTime"],
            "2024-05-01T10:00:00Z"
        );

        // The nomination ends (bound below, or dropped by the lower scheduler): it goes.
        for ended in [
            nominated(json!(null), json!(null)),
            nominated(json!("low-2"), json!("low-2")),
        ] {
            let (status, differs) = upper_status(&shown, &ended, None, "10.1.1.1", t2, true);
            assert!(differs);
            assert_eq!(condition(&status), None, "{status}");
        }
    }

    #[test]
    fn a_scale_up_below_comes_up_as_the_nomination_with_the_autoscalers_message_until_bound_or_declined() {
        use crate::model::scale_ups::{NOMINATED, NOT_TRIGGERED, Signal, TRIGGERED};
        let lower = |node_name: Value, nominated: Value| -> Pod {
            serde_json::from_value(
                json!({"spec": {"containers": [], "nodeName": node_name}, "status": {
                "phase": "Pending", "nominatedNodeName": nominated,
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                "message": "0/3 nodes are available: 3 Insufficient cpu."}]}}),
            )
            .unwrap()
        };
        let signal = |reason: &str, message: &str| Signal {
            reason: reason.into(),
            message: message.into(),
            at: "2024-05-01T09:59:00Z".parse().unwrap(),
        };
        let (t1, t2) = (
            "2024-05-01T10:00:00Z".parse::<Timestamp>().unwrap(),
            "2024-05-01T10:05:00Z".parse::<Timestamp>().unwrap(),
        );
        let condition = |status: &Value| {
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == names::CONDITION_LOWER_NOMINATED)
                .cloned()
        };
        let apply = |up: &Pod, status: &Value| -> Pod {
            let mut applied = serde_json::to_value(up).unwrap();
            for (k, v) in status.as_object().unwrap() {
                applied["status"][k] = v.clone();
            }
            serde_json::from_value(applied).unwrap()
        };
        let waiting = lower(json!(null), json!(null));

        // cluster-autoscaler scales up for the unbound pod: its message comes up, from now.
        let triggered = signal(TRIGGERED, "pod triggered scale-up: [{pool 1->2 (max: 10)}]");
        let (status, differs) = upper_status(&upper(), &waiting, Some(&triggered), "10.1.1.1", t1, true);
        assert!(differs);
        let c = condition(&status).expect("the scale-up comes up");
        assert_eq!(
            (
                &c["status"],
                &c["reason"],
                &c["message"],
                &c["lastTransitionTime"]
            ),
            (
                &json!("True"),
                &json!("ScaleUp"),
                &json!("pod triggered scale-up: [{pool 1->2 (max: 10)}]"),
                &json!("2024-05-01T10:00:00Z")
            )
        );
        // Karpenter's nomination reads the same; the time stays while it holds.
        let shown = apply(&upper(), &status);
        let karpenter = signal(NOMINATED, "Pod should schedule on: nodeclaim/default-x7k2p");
        let (later, _) = upper_status(&shown, &waiting, Some(&karpenter), "10.1.1.1", t2, true);
        let c = condition(&later).unwrap();
        assert_eq!(
            (&c["reason"], &c["lastTransitionTime"]),
            (&json!("ScaleUp"), &json!("2024-05-01T10:00:00Z"))
        );
        let (_, again) = upper_status(&shown, &waiting, Some(&triggered), "10.1.1.1", t2, true);
        assert!(!again, "no write while the scale-up holds");

        // A preemption below says more: it names the node.
        let (status, _) = upper_status(
            &shown,
            &lower(json!(null), json!("low-2")),
            Some(&triggered),
            "10.1.1.1",
            t2,
            true,
        );
        assert_eq!(condition(&status).unwrap()["reason"], "Preempting");

        // Declined by the autoscaler, or bound below: the condition goes.
        let declined = signal(
            NOT_TRIGGERED,
            "pod didn't trigger scale-up: 1 max node group size reached",
        );
        for (pod, signal) in [
            (&waiting, Some(&declined)),
            (&waiting, None),
            (&lower(json!("low-3"), json!(null)), Some(&triggered)),
        ] {
            let (status, differs) = upper_status(&shown, pod, signal, "10.1.1.1", t2, true);
            assert!(differs);
            assert_eq!(condition(&status), None, "{status}");
        }
    }

    /// A lower pod running the upper pod's generation `recorded`, as the lower apiserver of
    /// `version` stores it: 1.37 keeps the lower pod's own generation (`own`) in
    /// `observedGeneration` and the allocated resources; 1.33 drops both (alpha and off there).
    fn lower_of_version(version: &str, recorded: i64, own: i64) -> Pod {
        let newest = version == "1.37";
        let cond = |kind: &str| {
            let mut c = json!({"type": kind, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"});
            if newest {
                c["observedGeneration"] = json!(own);
            }
            c
        };
        let mut app = json!({"name": "app", "image": "nginx:1", "imageID": "sha", "ready": true,
            "started": true, "restartCount": 0, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
            "resources": {"requests": {"cpu": "250m"}}});
        let mut status = json!({"phase": "Running", "podIP": "10.0.0.9", "hostIP": "10.9.9.9",
            "qosClass": "Burstable", "startTime": "2026-01-01T00:00:00Z",
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"),
                           cond("ContainersReady"), cond("PodScheduled")],
            "containerStatuses": [app.clone()]});
        if newest {
            app["allocatedResources"] = json!({"cpu": "250m"});
            status["containerStatuses"] = json!([app]);
            status["observedGeneration"] = json!(own);
            status["resources"] = json!({"requests": {"cpu": "1"}});
            status["allocatedResources"] = json!({"cpu": "1"});
        }
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "shop", "generation": own,
                         "annotations": {names::UPPER_GENERATION: recorded.to_string()}},
            "spec": {"nodeName": "low-0", "containers": [{"name": "app", "image": "nginx:1",
                     "resources": {"requests": {"cpu": "250m"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    /// `upper` after the upper apiserver applied `status`, as a version that keeps
    /// `observedGeneration` (`keeps`) or drops it.
    fn applied(upper: &Pod, status: &Value, keeps: bool) -> Pod {
        let mut applied = serde_json::to_value(upper).unwrap();
        for (k, v) in status.as_object().unwrap() {
            applied["status"][k] = v.clone();
        }
        if !keeps {
            let s = applied["status"].as_object_mut().unwrap();
            s.remove("observedGeneration");
            for c in s["conditions"].as_array_mut().unwrap() {
                c.as_object_mut().unwrap().remove("observedGeneration");
            }
        }
        serde_json::from_value(applied).unwrap()
    }

    fn upper_at(generation: i64) -> Pod {
        let mut up = upper();
        up.metadata.generation = Some(generation);
        up.status = Some(
            serde_json::from_value(json!({"phase": "Pending", "qosClass": "Burstable",
                "conditions": [{"type": "PodScheduled", "status": "True"}]}))
            .unwrap(),
        );
        up
    }

    #[test]
    fn the_upper_generation_the_lower_pod_reflects_is_observed_whatever_the_lower_version_writes() {
        for version in ["1.37", "1.33"] {
            // The lower pod's own generation (1) is never what comes up.
            let lower = lower_of_version(version, 3, 1);
            let up = upper_at(3);
            let (status, differs) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
            assert!(differs, "{version}");
            assert_eq!(status["observedGeneration"], 3, "{version}: {status}");
            for c in status["conditions"].as_array().unwrap() {
                let kubelets = c["type"] != "PodScheduled";
                assert_eq!(
                    c.get("observedGeneration").is_some_and(|g| *g == 3),
                    kubelets,
                    "{version}: {c}"
                );
            }
            assert_eq!(status["hostIPs"], json!([{"ip": "10.1.1.1"}]), "{version}");
            assert!(
                status.get("qosClass").is_none(),
                "the upper apiserver's qosClass stays"
            );
            let shown = applied(&up, &status, true);
            let (_, again) = upper_status(&shown, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
            assert!(!again, "{version}: no second write");
        }
        // Pod-level resize status (1.35+) comes up where the lower cluster writes it.
        let (status, _) = upper_status(
            &upper_at(3),
            &lower_of_version("1.37", 3, 1),
            None,
            "10.1.1.1",
            Timestamp::UNIX_EPOCH,
            true,
        );
        assert_eq!(status["allocatedResources"], json!({"cpu": "1"}));
        assert_eq!(
            status["containerStatuses"][0]["allocatedResources"],
            json!({"cpu": "250m"})
        );
    }

    #[test]
    fn a_status_the_lower_kubelet_has_not_caught_up_with_keeps_the_generation_shown() {
        // The lower spec (own generation 2) carries upper generation 4; its kubelet still
        // reports the lower generation 1, so the upper pod keeps saying 3.
        let mut lower = lower_of_version("1.37", 4, 2);
        lower.status.as_mut().unwrap().observed_generation = Some(1);
        let mut up = upper_at(4);
        up.status.as_mut().unwrap().observed_generation = Some(3);
        let (status, _) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        assert_eq!(status["observedGeneration"], 3, "{status}");
        lower.status.as_mut().unwrap().observed_generation = Some(2);
        let (status, _) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        assert_eq!(status["observedGeneration"], 4, "{status}");
    }

    #[test]
    fn an_upper_apiserver_that_drops_observed_generation_is_not_written_it_again() {
        for version in ["1.37", "1.33"] {
            let lower = lower_of_version(version, 2, 1);
            let up = upper_at(2);
            let (status, _) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, false);
            assert!(status.get("observedGeneration").is_none(), "{version}");
            assert!(
                status["conditions"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|c| c.get("observedGeneration").is_none()),
                "{version}: the lower generation never comes up: {status}"
            );
            let shown = applied(&up, &status, false);
            let (_, again) = upper_status(&shown, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, false);
            assert!(!again, "{version}: no write loop");
        }
    }

    #[test]
    fn a_resize_goes_below_when_the_upper_generation_moves_naming_only_what_the_upper_pod_asks() {
        let t = translation();
        let mut up = upper_at(2);
        let spec = up.spec.as_mut().unwrap();
        spec.containers[0].resources = Some(
            serde_json::from_value(
                json!({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}),
            )
            .unwrap(),
        );
        spec.resources = Some(serde_json::from_value(json!({"requests": {"cpu": "2"}})).unwrap());
        let desired = t.lower_pod(&up).unwrap();
        // Below: cpu as "1000m" (the same quantity), a memory request of another amount, and
        // an ephemeral-storage request the lower cluster's limit range added.
        let mut lower: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "annotations": {names::UPPER_GENERATION: "1"}},
            "spec": {"containers": [{"name": "app", "image": "nginx:1", "resources": {
                "requests": {"cpu": "1000m", "memory": "512Mi", "ephemeral-storage": "1Gi"},
                "limits": {"memory": "512Mi"}}}],
                "resources": {"requests": {"cpu": "1"}}}}))
        .unwrap();
        assert!(resize_due(&up, &lower));
        assert_eq!(
            resize_patch(&desired, &lower),
            Some(json!({"spec": {
                "containers": [{"name": "app", "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}}],
                "resources": {"requests": {"cpu": "2"}}}}))
        );
        // Once the lower pod records generation 2, nothing is compared: a lower webhook's
        // change of the resources is not fought.
        lower
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(names::UPPER_GENERATION.into(), "2".into());
        assert!(!resize_due(&up, &lower));
        // The generation is recorded with the update that follows the pod down.
        assert_eq!(
            desired.metadata.annotations.as_ref().unwrap()[names::UPPER_GENERATION],
            "2"
        );
        // A resize deferred below for this generation is due again; an infeasible one is not.
        for (reason, due) in [("Deferred", true), ("Infeasible", false)] {
            let refusal = ResizeRefusal {
                generation: 2,
                reason: reason.into(),
                message: "m".into(),
            };
            lower.metadata.annotations.as_mut().unwrap().insert(
                names::RESIZE_REFUSED.into(),
                serde_json::to_string(&refusal).unwrap(),
            );
            assert_eq!(resize_due(&up, &lower), due, "{reason}");
        }
        // An upper pod may not plant the records on its lower pod.
        let mut planted = up.clone();
        planted.metadata.annotations.as_mut().unwrap().extend([
            (names::UPPER_GENERATION.to_owned(), "99".to_owned()),
            (names::RESIZE_REFUSED.to_owned(), "{}".to_owned()),
        ]);
        let made = t.lower_pod(&planted).unwrap();
        let a = made.metadata.annotations.unwrap();
        assert_eq!(a[names::UPPER_GENERATION], "2");
        assert!(!a.contains_key(names::RESIZE_REFUSED));
    }

    #[test]
    fn a_resize_the_lower_apiserver_refused_shows_as_the_kubelets_pending_condition_of_its_generation() {
        assert_eq!(
            ResizeRefusal::of_answer(3, Some(422), "m".into()).reason,
            "Infeasible"
        );
        assert_eq!(
            ResizeRefusal::of_answer(3, Some(403), "pods \"p\" is forbidden: exceeded quota: q".into())
                .reason,
            "Deferred"
        );
        assert_eq!(
            ResizeRefusal::of_answer(
                3,
                Some(403),
                "maximum cpu usage per Container is 500m, but limit is 1".into()
            )
            .reason,
            "Infeasible"
        );
        let mut lower = lower_of_version("1.33", 3, 1);
        let refusal = ResizeRefusal {
            generation: 3,
            reason: "Infeasible".into(),
            message: "lower cluster b refused the resize: limit range".into(),
        };
        lower.metadata.annotations.as_mut().unwrap().insert(
            names::RESIZE_REFUSED.into(),
            serde_json::to_string(&refusal).unwrap(),
        );
        let up = upper_at(3);
        let (status, _) = upper_status(&up, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        let pending = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "PodResizePending")
            .cloned()
            .expect("pending");
        assert_eq!(
            (
                &pending["status"],
                &pending["reason"],
                &pending["observedGeneration"]
            ),
            (&json!("True"), &json!("Infeasible"), &json!(3))
        );
        assert!(pending["message"].as_str().unwrap().contains("limit range"));
        // Once the lower pod reflects a later generation (or the record is gone), the
        // condition goes.
        let shown = applied(&up, &status, true);
        lower
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(names::UPPER_GENERATION.into(), "4".into());
        let (status, differs) = upper_status(&shown, &lower, None, "10.1.1.1", Timestamp::UNIX_EPOCH, true);
        assert!(differs);
        assert!(
            !status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["type"] == "PodResizePending"),
            "{status}"
        );
    }

    #[test]
    fn ready_to_start_is_made_when_the_lower_pod_shows_none() {
        let unbound: Pod = serde_json::from_value(json!({"metadata": {"name": "web-1"},
            "status": {"phase": "Pending"}}))
        .unwrap();
        let (status, _) = upper_status(
            &upper_at(1),
            &unbound,
            None,
            "10.1.1.1",
            Timestamp::UNIX_EPOCH,
            true,
        );
        let ready_to_start = |status: &Value| {
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "PodReadyToStartContainers")
                .map(|c| c["status"].clone())
        };
        assert_eq!(ready_to_start(&status), Some(json!("False")));
        let mut running = lower_of_version("1.37", 1, 1);
        running
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .retain(|c| c.type_ != "PodReadyToStartContainers");
        let (status, _) = upper_status(
            &upper_at(1),
            &running,
            None,
            "10.1.1.1",
            Timestamp::UNIX_EPOCH,
            true,
        );
        assert_eq!(ready_to_start(&status), Some(json!("True")));
    }

    fn lower_with_status(status: Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap_or_default()
    }

    #[test]
    fn merely_pending_holds_only_for_a_quiet_pending_pod() {
        let quiet = [
            json!(null),
            json!({"phase": "Pending"}),
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}),
            json!({"phase": "Pending", "containerStatuses": [
                {"name": "c", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
        ];
        for status in quiet {
            assert!(merely_pending(&lower_with_status(status.clone())), "{status}");
        }
        let news = [
            json!({"phase": "Running"}),
            json!({"phase": "Failed", "reason": "Evicted"}),
            json!({"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}),
            json!({"phase": "Pending", "containerStatuses": [
                {"name": "c", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}),
            json!({"phase": "Pending", "initContainerStatuses": [
                {"name": "i", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"running": {}}}]}),
        ];
        for status in news {
            assert!(!merely_pending(&lower_with_status(status.clone())), "{status}");
        }
    }
}
