//! Whether moving a Job's pod would cost the Job a failure, pure.
//!
//! Up to 1.25 (and wherever the Job controller does not track by finalizers) a Job counts
//! only pods whose phase is `Failed`; an evicted Pending pod is deleted, never Failed, so a
//! move costs nothing. With tracking by finalizers (GA in 1.26; the pod then carries the
//! finalizer `batch.kubernetes.io/job-tracking`), a deleted unfinished pod counts as a
//! failure, unless the Job's `podFailurePolicy` has a first matching rule with action
//! `Ignore`. From 1.26 the Eviction API adds the condition `DisruptionTarget=True` to the
//! pod it deletes, so a rule `Ignore` on `onPodConditions: [{type: DisruptionTarget}]`
//! makes the move free. The finalizer is read on the pod itself, so the rule holds on any
//! version without knowing it.

use k8s_openapi::api::batch::v1::{Job, PodFailurePolicyRule};
use k8s_openapi::api::core::v1::Pod;

/// The finalizer the Job controller puts on its pods when it tracks them by finalizers.
pub const TRACKING_FINALIZER: &str = "batch.kubernetes.io/job-tracking";
/// The condition the Eviction API adds (1.26+) to the pod it deletes.
pub const DISRUPTION_TARGET: &str = "DisruptionTarget";

/// The Job a pod belongs to, when its Job tracks it by finalizer (a move could then count
/// as a failure): the Job's name.
pub fn tracking_job(pod: &Pod) -> Option<&str> {
    let tracked = pod
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == TRACKING_FINALIZER);
    if !tracked {
        return None;
    }
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "Job")
        .map(|o| o.name.as_str())
}

/// Whether the move may go ahead for a pod tracked by `job` (`uid`: the Job the pod names
/// as its controller; another Job under the same name is not that Job).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobRisk {
    /// The Job's policy ignores the eviction: the move costs no failure.
    Ignored,
    /// The move would count as a failure; the text says what to add to the Job.
    WouldFail(String),
}

/// The rule to add to a Job so that moves cost it nothing.
pub const IGNORE_RULE: &str = "spec.podFailurePolicy.rules: [{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}] (first among the rules)";

/// Judges the move of `pod` (tracked by finalizer) against its Job.
pub fn judge(pod: &Pod, job: Option<&Job>, owner_uid: &str) -> JobRisk {
    let name = job.and_then(|j| j.metadata.name.as_deref()).unwrap_or_default();
    let Some(job) = job.filter(|j| j.metadata.uid.as_deref() == Some(owner_uid)) else {
        return JobRisk::WouldFail(
            "its Job could not be read, and a Job tracking its pods by finalizer counts a deleted pod as a failure".into(),
        );
    };
    let rules = job
        .spec
        .as_ref()
        .and_then(|s| s.pod_failure_policy.as_ref())
        .map(|p| p.rules.as_slice())
        .unwrap_or_default();
    // The Job controller applies the first rule that matches the failed pod; after the
    // eviction the pod shows its current conditions plus DisruptionTarget=True.
    for rule in rules {
        if matches(rule, pod) {
            return if rule.action == "Ignore" {
                JobRisk::Ignored
            } else {
                JobRisk::WouldFail(format!(
                    "Job {name} tracks its pods by finalizer and the first podFailurePolicy rule matching an evicted pod has action {}, so moving the pod would count against the Job; to let the descheduler move its pods, add {IGNORE_RULE}",
                    rule.action
                ))
            };
        }
    }
    JobRisk::WouldFail(format!(
        "Job {name} tracks its pods by finalizer and its podFailurePolicy does not ignore evictions, so moving the pod would count as a failure of the Job (backoffLimit); to let the descheduler move its pods, add {IGNORE_RULE}"
    ))
}

/// Whether `rule` matches `pod` once evicted.
fn matches(rule: &PodFailurePolicyRule, pod: &Pod) -> bool {
    if let Some(codes) = &rule.on_exit_codes {
        return exit_codes_match(codes, pod);
    }
    let conditions: Vec<(&str, &str)> = pod
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .filter(|c| c.type_ != DISRUPTION_TARGET)
        .map(|c| (c.type_.as_str(), c.status.as_str()))
        .chain([(DISRUPTION_TARGET, "True")])
        .collect();
    rule.on_pod_conditions.iter().flatten().any(|pattern| {
        // The apiserver defaults an omitted status to True.
        let status = pattern
            .status
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or("True");
        conditions
            .iter()
            .any(|(t, s)| *t == pattern.type_ && *s == status)
    })
}

/// An exit-code rule matches only containers that terminated; a pod that never ran has
/// none, but one that ran before (restarted below) may.
fn exit_codes_match(
    codes: &k8s_openapi::api::batch::v1::PodFailurePolicyOnExitCodesRequirement,
    pod: &Pod,
) -> bool {
    pod.status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .filter(|c| codes.container_name.as_deref().is_none_or(|n| n == c.name))
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code))
        .any(|code| {
            let listed = codes.values.contains(&code);
            match codes.operator.as_str() {
                "In" => listed,
                // The Job controller never counts exit code 0 under NotIn.
                "NotIn" => !listed && code != 0,
                _ => true,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A Job pod as 1.26+ writes it: the tracking finalizer, a Job controller.
    fn pod_of_job(finalizer: bool) -> Pod {
        let mut v = json!({
            "metadata": {"name": "batch-x7k2p", "namespace": "ns", "uid": "pod-uid",
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "batch", "uid": "job-uid",
                    "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"restartPolicy": "Never", "nodeName": "vn-a", "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "tensile.io/LowerPodScheduled", "status": "False", "reason": "Unschedulable"}]},
        });
        if finalizer {
            v["metadata"]["finalizers"] = json!([TRACKING_FINALIZER]);
        }
        serde_json::from_value(v).unwrap()
    }

    /// A Job as a 1.26+ apiserver returns it (defaults filled in), with `rules`.
    fn job(rules: serde_json::Value) -> Job {
        let mut v = json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "batch", "namespace": "ns", "uid": "job-uid"},
            "spec": {"backoffLimit": 0, "completionMode": "NonIndexed", "suspend": false,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}},
        });
        if !rules.is_null() {
            v["spec"]["podFailurePolicy"] = json!({"rules": rules});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_pod_of_a_job_without_the_tracking_finalizer_as_1_20_writes_it_is_not_tracked() {
        assert_eq!(tracking_job(&pod_of_job(false)), None);
        assert_eq!(tracking_job(&pod_of_job(true)), Some("batch"));
    }

    #[test]
    fn a_tracked_pod_whose_job_has_no_pod_failure_policy_would_fail_the_job_and_says_what_to_add() {
        let JobRisk::WouldFail(why) = judge(&pod_of_job(true), Some(&job(json!(null))), "job-uid") else {
            panic!("a move would count as a failure")
        };
        assert!(why.contains("Job batch"), "{why}");
        assert!(
            why.contains("{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}"),
            "{why}"
        );
    }

    #[test]
    fn a_tracked_pod_whose_job_ignores_disruptions_moves() {
        let rules = json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]);
        assert_eq!(
            judge(&pod_of_job(true), Some(&job(rules)), "job-uid"),
            JobRisk::Ignored
        );
    }

    #[test]
    fn the_first_matching_rule_decides_as_the_job_controller_applies_it() {
        // A FailJob rule on DisruptionTarget before the Ignore one: the Job would fail.
        let rules = json!([
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]);
        assert!(matches!(
            judge(&pod_of_job(true), Some(&job(rules)), "job-uid"),
            JobRisk::WouldFail(why) if why.contains("action FailJob")
        ));
        // An exit-code rule first cannot match a pod that never ran: the Ignore rule decides.
        let rules = json!([
            {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]);
        assert_eq!(
            judge(&pod_of_job(true), Some(&job(rules)), "job-uid"),
            JobRisk::Ignored
        );
        // A policy that ignores only other conditions does not cover the eviction.
        let rules =
            json!([{"action": "Ignore", "onPodConditions": [{"type": "ConfigIssue", "status": "True"}]}]);
        assert!(matches!(
            judge(&pod_of_job(true), Some(&job(rules)), "job-uid"),
            JobRisk::WouldFail(_)
        ));
        // Count is not Ignore: it counts against backoffLimit.
        let rules =
            json!([{"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]);
        assert!(matches!(
            judge(&pod_of_job(true), Some(&job(rules)), "job-uid"),
            JobRisk::WouldFail(_)
        ));
    }

    #[test]
    fn a_job_that_cannot_be_read_or_is_another_job_of_the_same_name_never_lets_the_pod_move() {
        assert!(matches!(
            judge(&pod_of_job(true), None, "job-uid"),
            JobRisk::WouldFail(_)
        ));
        let rules = json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]);
        assert!(matches!(
            judge(&pod_of_job(true), Some(&job(rules)), "another-uid"),
            JobRisk::WouldFail(_)
        ));
    }
}
