//! What to do for one upper pod, decided from the upper pod, its lower pod and what the node
//! knows ([`View`]), nothing else: [`decide`] returns a [`Step`], which the pod controller
//! performs. Also the pure judgements the controller leans on: whether a lower pod is an
//! orphan ([`orphaned`]), and a pod's key.

use k8s_openapi::api::core::v1::Pod;
use kube::{Resource, ResourceExt};
use tensile_common::names;

use crate::decide::translate::{self, Translation};
use tensile_common::lower::identity::Identity;
use tensile_common::resources::is_terminal;

/// What a reconcile does for one upper pod, decided from the objects alone.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// A lower pod of ours stands for an earlier upper pod of the same name: delete it.
    DeleteStale,
    /// The upper pod is being deleted and its lower pod runs: stop it with this grace.
    StopLower { grace: Option<i64> },
    /// The upper pod is being deleted and its lower pod terminates: wait until it is gone.
    AwaitLowerGone,
    /// The upper pod is being deleted and nothing of it runs below: confirm the deletion
    /// (grace 0, UID precondition), as a kubelet does.
    ReleaseUpper,
    /// A finished pod is never run again; its lower pod stays for logs until the upper goes.
    Finished,
    /// The pod is not run below; the upper pod says why (condition and event).
    Refuse {
        reason: &'static str,
        event: &'static str,
        message: String,
    },
    /// The lower pod of a pod that ran is gone; judged only once the caches warmed up.
    AwaitWarmUp,
    /// The lower pod of a pod that ran is gone and `restartPolicy` is Never: the upper pod
    /// fails, so its controller replaces it.
    FailLost { message: String },
    /// Create the lower pod (what it references first). `lost`: it ran before and vanished
    /// below, so this starts it again. `overrides`: the override rules it was made with.
    Create {
        desired: Box<Pod>,
        lost: bool,
        overrides: Vec<String>,
    },
    /// Follow the mutable fields (`patch` when they differ below; `resize`, a body for the
    /// lower pod's `resize` subresource, first, when the upper pod was resized) and bring
    /// status up.
    Sync {
        patch: Option<serde_json::Value>,
        resize: Option<serde_json::Value>,
    },
}

/// What [`decide`] knows besides the two pods.
pub struct View<'a> {
    pub translation: &'a Translation,
    /// The lower cluster's override rules in force ([`tensile_common::lower::overrides`]).
    pub overrides: &'a tensile_common::lower::overrides::Compiled,
    pub run_daemonset_pods: bool,
    /// The caches have been up long enough to call a missing lower pod lost.
    pub warmed_up: bool,
    /// The lower cluster's name, for messages.
    pub cluster_name: &'a str,
}

/// The step for `upper` given its lower pod (`lower`: the same-named lower pod carrying this
/// node's marks, if any).
pub fn decide(upper: &Pod, lower: Option<&Pod>, view: &View<'_>) -> Step {
    let upper_uid = upper.uid().unwrap_or_default();
    if let Some(l) = lower
        && tensile_common::lower::identity::upper_uid(l) != Some(upper_uid.as_str())
    {
        // One delete starts it; while it terminates there is nothing to send again.
        return if l.metadata.deletion_timestamp.is_some() {
            Step::AwaitLowerGone
        } else {
            Step::DeleteStale
        };
    }
    // Deletion flows down, then up: the lower pod stops with the same grace; once it is
    // gone, the upper pod is released. A grace shortened upstream while the lower pod is
    // already stopping (`kubectl delete --grace-period=1` after a first delete) is passed
    // down too: the apiserver accepts a second delete with a shorter grace.
    if upper.metadata.deletion_timestamp.is_some() {
        let grace = upper.metadata.deletion_grace_period_seconds;
        return match lower {
            Some(l) if l.metadata.deletion_timestamp.is_none() => Step::StopLower { grace },
            Some(l)
                if grace
                    .zip(l.metadata.deletion_grace_period_seconds)
                    .is_some_and(|(upper, lower)| upper < lower) =>
            {
                Step::StopLower { grace }
            }
            Some(_) => Step::AwaitLowerGone,
            None => Step::ReleaseUpper,
        };
    }
    if is_terminal(upper) {
        return Step::Finished;
    }
    if translate::is_daemonset_pod(upper) && !view.run_daemonset_pods {
        return Step::Refuse {
            reason: "DaemonSetPod",
            event: "DaemonSetPodNotRun",
            message: "DaemonSet pods are not run in the lower cluster (see --run-daemonset-pods)".into(),
        };
    }
    let lost = lower.is_none()
        && upper
            .status
            .as_ref()
            .is_some_and(|s| s.container_statuses.as_ref().is_some_and(|c| !c.is_empty()));
    if lost {
        if !view.warmed_up {
            return Step::AwaitWarmUp;
        }
        let policy = upper
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.as_deref())
            .unwrap_or("Always");
        if policy == "Never" {
            return Step::FailLost {
                message: format!(
                    "the pod disappeared from lower cluster {} and restartPolicy is Never",
                    view.cluster_name
                ),
            };
        }
    }
    // The translation (and the stash's signature with it) guards the create only: a pod
    // that runs below always gets its status, even when its stash is no longer trusted (a
    // key turned on or rotated later); nothing of such a stash goes below.
    // The override rules in force apply to a pod made now; a pod that runs is followed
    // through the rules it was made with.
    match (lower, view.translation.lower_pod(upper)) {
        (None, Ok(_)) if let Some(message) = view.translation.not_carried(upper) => Step::Refuse {
            reason: "VolumeNotCarried",
            event: "VolumeNotCarried",
            message,
        },
        (None, Ok(mut desired)) => match view.overrides.apply(upper, &mut desired) {
            Ok(overrides) => Step::Create {
                desired: Box::new(desired),
                lost,
                overrides,
            },
            Err(message) => Step::Refuse {
                reason: "OverrideFailed",
                event: "OverrideFailed",
                message,
            },
        },
        (None, Err(e)) => {
            let reason = match e {
                translate::Error::UntrustedStash(_) => "StashNotTrusted",
                _ => "InvalidPod",
            };
            Step::Refuse {
                reason,
                event: reason,
                message: e.to_string(),
            }
        }
        (Some(l), Ok(mut desired)) => match tensile_common::lower::overrides::replay(l, &mut desired) {
            Ok(()) => Step::Sync {
                patch: view.translation.update_patch(&desired, l),
                resize: translate::resize_due(upper, l)
                    .then(|| translate::resize_patch(&desired, l))
                    .flatten(),
            },
            // Nothing follows a pod whose record was edited below: patched by another
            // reading, its images would lose their rewrite.
            Err(e) => {
                tracing::warn!(pod = %key(upper), "not updated below: {e}");
                Step::Sync {
                    patch: None,
                    resize: None,
                }
            }
        },
        (Some(_), Err(_)) => Step::Sync {
            patch: None,
            resize: None,
        },
    }
}

/// Whether `lower`, a lower pod, stands for no upper pod bound here: it carries this node's
/// marks and the UID of the upper pod it was made for, it is not being deleted already, and
/// `upper` (the upper pod of its namespace and name bound to this node, if any) is absent or
/// another pod (force-deleted, evicted and released, recreated under the same name). A lower
/// pod whose upper pod exists with its UID is never an orphan, even while that pod is being
/// deleted: its deletion flows down with its grace through the pod's own reconcile.
pub fn orphaned(
    lower: &kube::api::ObjectMeta,
    upper: Option<&kube::api::ObjectMeta>,
    identity: &Identity,
) -> bool {
    if !identity.owns(lower) || lower.deletion_timestamp.is_some() {
        return false;
    }
    let Some(uid) = lower.labels.as_ref().and_then(|l| l.get(names::MARK_UPPER_UID)) else {
        return false;
    };
    upper.and_then(|u| u.uid.as_ref()) != Some(uid)
}

/// A pod's `namespace/name`, as logs and retries name it.
pub fn key(pod: &impl Resource) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::decide::translate::tests::translation;
    use serde_json::json;
    use tensile_common::lower::identity::upper_uid;

    static NO_OVERRIDES: std::sync::LazyLock<tensile_common::lower::overrides::Compiled> =
        std::sync::LazyLock::new(tensile_common::lower::overrides::Compiled::none);

    pub(crate) fn view(t: &Translation) -> View<'_> {
        View {
            translation: t,
            overrides: &NO_OVERRIDES,
            run_daemonset_pods: false,
            warmed_up: true,
            cluster_name: "lower-a",
        }
    }

    /// An upper pod bound to the node, as a user would make it, with `status` merged in.
    pub(crate) fn upper(extra: serde_json::Value) -> Pod {
        let mut pod = json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u1"},
            "spec": {"nodeName": "vn", "restartPolicy": "Always",
                     "containers": [{"name": "app", "image": "nginx:1"}]},
        });
        json_patch::merge(&mut pod, &extra);
        serde_json::from_value(pod).unwrap()
    }

    /// The lower pod `decide` would create for `upper`, with `extra` merged in.
    pub(crate) fn lower_of(upper: &Pod, extra: serde_json::Value) -> Pod {
        let mut pod = serde_json::to_value(translation().lower_pod(upper).unwrap()).unwrap();
        json_patch::merge(&mut pod, &extra);
        serde_json::from_value(pod).unwrap()
    }

    const RAN: &str = r#"{"status": {"phase": "Running", "containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "", "ready": true, "restartCount": 0}]}}"#;

    fn ran(restart: &str) -> Pod {
        let mut extra: serde_json::Value = serde_json::from_str(RAN).unwrap();
        extra["spec"] = json!({"restartPolicy": restart});
        upper(extra)
    }

    #[test]
    fn a_new_pod_is_created_below_with_the_marks_of_this_node_and_cluster() {
        let t = translation();
        let Step::Create { desired, lost, .. } = decide(&upper(json!({})), None, &view(&t)) else {
            panic!("a pod with nothing below is created");
        };
        assert!(!lost);
        assert!(t.identity.owns(&desired.metadata));
        assert_eq!(upper_uid(&*desired), Some("u1"));
        assert_eq!(desired.spec.as_ref().and_then(|s| s.node_name.clone()), None);
    }

    #[test]
    fn a_lower_pod_made_for_an_earlier_pod_of_the_same_name_is_deleted() {
        let t = translation();
        let old = upper(json!({"metadata": {"uid": "u0"}}));
        let stale = lower_of(&old, json!({}));
        assert_eq!(
            decide(&upper(json!({})), Some(&stale), &view(&t)),
            Step::DeleteStale
        );
    }

    #[test]
    fn deletion_stops_the_lower_pod_with_the_same_grace_then_waits_then_releases_the_upper_pod() {
        let t = translation();
        let deleting = upper(json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z",
                                                  "deletionGracePeriodSeconds": 7}}));
        let running = lower_of(&deleting, json!({}));
        assert_eq!(
            decide(&deleting, Some(&running), &view(&t)),
            Step::StopLower { grace: Some(7) }
        );
        let stopping = lower_of(
            &deleting,
            json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:01Z"}}),
        );
        assert_eq!(
            decide(&deleting, Some(&stopping), &view(&t)),
            Step::AwaitLowerGone
        );
        assert_eq!(decide(&deleting, None, &view(&t)), Step::ReleaseUpper);
    }

    #[test]
    fn a_grace_shortened_upstream_while_the_lower_pod_stops_is_passed_down_once() {
        let t = translation();
        let shortened = upper(json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z",
                                                   "deletionGracePeriodSeconds": 1}}));
        let stopping_slowly = lower_of(
            &shortened,
            json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:30Z",
                                "deletionGracePeriodSeconds": 30}}),
        );
        assert_eq!(
            decide(&shortened, Some(&stopping_slowly), &view(&t)),
            Step::StopLower { grace: Some(1) }
        );
        let stopping_fast = lower_of(
            &shortened,
            json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:01Z",
                                "deletionGracePeriodSeconds": 1}}),
        );
        assert_eq!(
            decide(&shortened, Some(&stopping_fast), &view(&t)),
            Step::AwaitLowerGone,
            "the same grace is not sent again"
        );
    }

    #[test]
    fn a_finished_pod_is_never_run_again_even_when_its_lower_pod_is_gone() {
        let t = translation();
        for phase in ["Succeeded", "Failed"] {
            let done = upper(json!({"status": {"phase": phase}}));
            assert_eq!(decide(&done, None, &view(&t)), Step::Finished, "{phase}");
        }
    }

    #[test]
    fn daemonset_pods_are_refused_with_the_reason_unless_asked_for() {
        let t = translation();
        let ds = upper(json!({"metadata": {"ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "d1", "controller": true}]}}));
        let Step::Refuse { reason, message, .. } = decide(&ds, None, &view(&t)) else {
            panic!("a DaemonSet pod is refused by default");
        };
        assert_eq!(reason, "DaemonSetPod");
        assert!(message.contains("--run-daemonset-pods"), "{message}");
        let mut v = view(&t);
        v.run_daemonset_pods = true;
        assert!(matches!(decide(&ds, None, &v), Step::Create { .. }));
    }

    #[test]
    fn a_pod_whose_stash_does_not_decode_is_refused_with_the_decoder_message() {
        let t = translation();
        let broken = upper(json!({"metadata": {"annotations": {names::CLUSTER_SELECTOR: "{not json"}}}));
        let Step::Refuse { reason, message, .. } = decide(&broken, None, &view(&t)) else {
            panic!("a broken stash is refused");
        };
        assert_eq!(reason, "InvalidPod");
        assert!(!message.is_empty());
    }

    #[test]
    fn a_running_pod_whose_stash_is_no_longer_accepted_keeps_its_status_coming_up() {
        let t = translation();
        let running = upper(json!({}));
        let below = lower_of(&running, json!({"status": {"phase": "Running"}}));
        // The stash is replaced by one that does not verify (a key turned on or rotated
        // later, an edit): nothing of it goes below, the status still comes up.
        let edited = upper(json!({"metadata": {"annotations": {names::CLUSTER_SELECTOR: "{not json"}}}));
        assert_eq!(
            decide(&edited, Some(&below), &view(&t)),
            Step::Sync {
                patch: None,
                resize: None
            }
        );
    }

    #[test]
    fn a_stale_lower_pod_gets_one_delete_then_is_awaited() {
        let t = translation();
        let old = upper(json!({"metadata": {"uid": "u0"}}));
        let stopping = lower_of(
            &old,
            json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:01Z"}}),
        );
        assert_eq!(
            decide(&upper(json!({})), Some(&stopping), &view(&t)),
            Step::AwaitLowerGone
        );
    }

    #[test]
    fn a_pod_that_ran_and_vanished_below_is_judged_only_once_caches_warmed_up() {
        let t = translation();
        let mut cold = view(&t);
        cold.warmed_up = false;
        assert_eq!(decide(&ran("Always"), None, &cold), Step::AwaitWarmUp);
        let Step::Create { lost, .. } = decide(&ran("Always"), None, &view(&t)) else {
            panic!("restartPolicy Always starts it again");
        };
        assert!(lost);
        let Step::Create { lost, .. } = decide(&ran("OnFailure"), None, &view(&t)) else {
            panic!("restartPolicy OnFailure starts it again");
        };
        assert!(lost);
        let Step::FailLost { message } = decide(&ran("Never"), None, &view(&t)) else {
            panic!("restartPolicy Never fails the upper pod");
        };
        assert!(
            message.contains("lower-a") && message.contains("Never"),
            "{message}"
        );
    }

    #[test]
    fn a_lower_pod_is_an_orphan_only_when_ours_and_its_upper_pod_is_gone_or_another() {
        let t = translation();
        let id = &t.identity;
        let pod = upper(json!({}));
        let below = lower_of(&pod, json!({}));
        assert!(orphaned(&below.metadata, None, id), "its upper pod is gone");
        let recreated = upper(json!({"metadata": {"uid": "u2"}}));
        assert!(
            orphaned(&below.metadata, Some(&recreated.metadata), id),
            "the name is another pod's now"
        );
        assert!(
            !orphaned(&below.metadata, Some(&pod.metadata), id),
            "its upper pod lives"
        );
        let terminating = upper(json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z"}}));
        assert!(
            !orphaned(&below.metadata, Some(&terminating.metadata), id),
            "a Terminating upper pod stops its lower pod itself, with its grace"
        );
        let stopping = lower_of(
            &pod,
            json!({"metadata": {"deletionTimestamp": "2024-01-01T00:00:01Z"}}),
        );
        assert!(!orphaned(&stopping.metadata, None, id), "already being deleted");
        for (label, value) in [
            (names::MARK_NODE, json!("another-node")),
            (names::MARK_CLUSTER, json!("another-cluster")),
            (names::MARK_UPPER_UID, serde_json::Value::Null),
        ] {
            let other = lower_of(&pod, json!({"metadata": {"labels": {label: value}}}));
            assert!(!orphaned(&other.metadata, None, id), "{label}: {value}");
        }
    }

    #[test]
    fn override_rules_shape_the_create_refuse_a_pod_they_cannot_apply_to_and_a_running_pod_follows_its_record()
     {
        let t = translation();
        let rules = tensile_common::lower::overrides::parse(
            "rules:\n- name: mirror\n  image: {prefix: {from: docker.io/, to: m.example/}}\n\
             - name: pool\n  selector: {matchLabels: {tier: db}}\n  nodeSelector: {pool: fleet}\n",
        )
        .and_then(tensile_common::lower::overrides::Overrides::compile)
        .unwrap();
        let v = View {
            overrides: &rules,
            ..view(&t)
        };
        let Step::Create {
            desired, overrides, ..
        } = decide(&upper(json!({})), None, &v)
        else {
            panic!()
        };
        assert_eq!(overrides, ["mirror"]);
        let lower = *desired;
        let image = |p: &Pod| p.spec.as_ref().unwrap().containers[0].image.clone().unwrap();
        assert_eq!(image(&lower), "m.example/library/nginx:1");
        // A rule that cannot apply to one pod refuses that pod, with its reason.
        let stashed = upper(json!({"metadata": {"labels": {"tier": "db"},
            "annotations": {"clusterSelector": r#"{"nodeSelector":{"pool":"gpu"}}"#}}}));
        let Step::Refuse { reason, message, .. } = decide(&stashed, None, &v) else {
            panic!()
        };
        assert_eq!(reason, "OverrideFailed");
        assert!(
            message.ends_with("nodeSelector pool=fleet contradicts the pod's pool=gpu"),
            "{message}"
        );
        // The running pod follows the rules it recorded, whatever is in force now.
        let changed = upper(json!({"spec": {"containers": [{"name": "app", "image": "nginx:2"}]}}));
        let Step::Sync { patch, .. } = decide(&changed, Some(&lower), &view(&t)) else {
            panic!()
        };
        assert_eq!(
            patch,
            Some(json!({"spec": {"containers": [{"name": "app", "image": "m.example/library/nginx:2"}]}}))
        );
        assert_eq!(
            decide(&upper(json!({})), Some(&lower), &view(&t)),
            Step::Sync {
                patch: None,
                resize: None
            }
        );
    }

    #[test]
    fn a_changed_image_is_patched_below_and_an_unchanged_pod_only_syncs_status() {
        let t = translation();
        let pod = upper(json!({}));
        let below = lower_of(&pod, json!({}));
        assert_eq!(
            decide(&pod, Some(&below), &view(&t)),
            Step::Sync {
                patch: None,
                resize: None
            }
        );
        let newer = upper(json!({"spec": {"containers": [{"name": "app", "image": "nginx:2"}]}}));
        let Step::Sync {
            patch: Some(patch), ..
        } = decide(&newer, Some(&below), &view(&t))
        else {
            panic!("a new image is patched below");
        };
        assert!(patch.to_string().contains("nginx:2"), "{patch}");
    }
}
