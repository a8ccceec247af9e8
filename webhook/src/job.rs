//! Jobs: the disruption rule (`--job-disruption-rule`), pure.
//!
//! A Job tracks its pods by finalizer on every supported version, so a pod of it that is
//! evicted counts against its `backoffLimit` unless the Job's `podFailurePolicy` ignores
//! the `DisruptionTarget` condition the Eviction API gives the pod. The descheduler moves
//! such a pod only when it costs the Job nothing (descheduler/src/job.rs), so a Job refused
//! below would otherwise wait for ever. At CREATE, an opted-in Job (its pod template carries
//! the opt-in label, outside the excluded namespaces) gets the rule
//! `{action: Ignore, onPodConditions: [{type: DisruptionTarget, status: "True"}]}` as the
//! first of its rules, unless the apiserver would refuse the Job with it or the Job already
//! says what a disruption costs it ([`plan`]).
//!
//! The Job is decoded once into [`JobMembers`], the members read here; the patch inserts the
//! rule and never rewrites the rules the Job came with.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use crate::outcome::{Outcome, Verdict, allow, deny, patched};
use crate::policy::Policy;
use crate::raw::{self, Level};
use crate::review::{self, Review};

/// The condition the Eviction API (and the kubelet, the scheduler's preemption, the taint
/// manager, the pod garbage collector) gives a pod it disrupts.
pub const DISRUPTION_TARGET: &str = "DisruptionTarget";
/// The most rules a `podFailurePolicy` may hold (the apiserver's limit).
pub const MAX_RULES: usize = 20;
/// The only `podReplacementPolicy` the apiserver allows beside a `podFailurePolicy`.
const REPLACE_WHEN_FAILED: &str = "Failed";

/// Whether a review is of a `batch/v1` Job.
pub fn is_job(review: &Review) -> bool {
    let kind = &review.request.kind;
    kind.group == "batch" && kind.kind == "Job"
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobMembers {
    api_version: Option<String>,
    kind: Option<String>,
    spec: Option<JobSpecMembers>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JobSpecMembers {
    template: Option<TemplateMembers>,
    pod_failure_policy: Option<PolicyMembers>,
    pod_replacement_policy: Option<String>,
}

#[derive(Deserialize)]
struct TemplateMembers {
    metadata: Option<TemplateMetadata>,
    spec: Option<TemplateSpec>,
}

#[derive(Deserialize)]
struct TemplateMetadata {
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TemplateSpec {
    restart_policy: Option<String>,
}

#[derive(Deserialize)]
struct PolicyMembers {
    rules: Option<Vec<RuleMembers>>,
}

/// A rule, as far as it says what a disruption costs; `onExitCodes` is not read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RuleMembers {
    action: Option<String>,
    on_pod_conditions: Option<Vec<PatternMembers>>,
}

#[derive(Deserialize)]
struct PatternMembers {
    #[serde(rename = "type")]
    type_: Option<String>,
    status: Option<String>,
}

impl JobMembers {
    /// Decodes `object`, held to being a `batch/v1` Job where it says what it is.
    pub fn decode(object: &RawValue) -> Result<Self, String> {
        let job: Self = serde_json::from_str(object.get()).map_err(|e| review::message(&e))?;
        if let Some(v) = job.api_version.as_deref().filter(|v| *v != "batch/v1") {
            return Err(format!("apiVersion {v:?}, expected \"batch/v1\""));
        }
        if let Some(k) = job.kind.as_deref().filter(|k| *k != "Job") {
            return Err(format!("kind {k:?}, expected \"Job\""));
        }
        Ok(job)
    }

    fn template_label(&self, key: &str) -> Option<&String> {
        let template = self.spec.as_ref()?.template.as_ref()?;
        template.metadata.as_ref()?.labels.as_ref()?.get(key)
    }
}

impl RuleMembers {
    /// Whether the rule matches a pod that was disrupted: one of its condition patterns is
    /// `DisruptionTarget` with status `True` (the apiserver's default for an empty status).
    fn names_disruption(&self) -> bool {
        self.on_pod_conditions.iter().flatten().any(|p| {
            p.type_.as_deref() == Some(DISRUPTION_TARGET)
                && matches!(p.status.as_deref(), None | Some("" | "True"))
        })
    }
}

/// What becomes of an opted-in Job.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// The rule goes first among the Job's rules.
    Add {
        /// Where it goes: the Job has no `podFailurePolicy`, one without rules, or rules.
        at: Insert,
        /// The Job's `podReplacementPolicy` (`TerminatingOrFailed`, the default without a
        /// policy) becomes `Failed`, the only one allowed beside a policy.
        replace_when_failed: bool,
    },
    /// The Job stays as written; the warning, when there is one, says why the rule is not
    /// added and what that costs.
    Keep(Option<String>),
}

#[derive(Debug, PartialEq, Eq)]
pub enum Insert {
    NewPolicy,
    NewRules,
    First,
}

/// Whether the disruption rule goes into the Job `job` (opted in), and where.
pub fn plan(job: &JobMembers) -> Plan {
    let spec = job.spec.as_ref();
    let restart = spec
        .and_then(|s| s.template.as_ref())
        .and_then(|t| t.spec.as_ref())
        .and_then(|s| s.restart_policy.as_deref());
    if restart != Some("Never") {
        let restart = restart.map_or("not set".to_owned(), |r| format!("{r:?}"));
        return Plan::Keep(Some(format!(
            "tensile webhook: the Job's pod template has restartPolicy {restart}, and a podFailurePolicy \
             needs \"Never\", so the Job gets no rule ignoring DisruptionTarget: the descheduler will not \
             move its pods, since a move would count against its backoffLimit"
        )));
    }
    let policy = spec.and_then(|s| s.pod_failure_policy.as_ref());
    let rules = policy.and_then(|p| p.rules.as_deref()).unwrap_or_default();
    if let Some((at, rule)) = rules.iter().enumerate().find(|(_, r)| r.names_disruption()) {
        let action = rule.action.as_deref().unwrap_or_default();
        return Plan::Keep((action != "Ignore").then(|| {
            format!(
                "tensile webhook: rule {at} of the Job's podFailurePolicy (action {action:?} on \
                 DisruptionTarget) already says what a disruption costs the Job, so it is left as \
                 written: the descheduler will not move its pods"
            )
        }));
    }
    if rules.len() >= MAX_RULES {
        return Plan::Keep(Some(format!(
            "tensile webhook: the Job's podFailurePolicy holds {} rules, the most it may, so it gets \
             no rule ignoring DisruptionTarget: the descheduler will not move its pods",
            rules.len()
        )));
    }
    let at = match policy {
        None => Insert::NewPolicy,
        Some(PolicyMembers { rules: None }) => Insert::NewRules,
        Some(_) => Insert::First,
    };
    let replace_when_failed = spec
        .and_then(|s| s.pod_replacement_policy.as_deref())
        .is_some_and(|p| p != REPLACE_WHEN_FAILED);
    Plan::Add {
        at,
        replace_when_failed,
    }
}

/// The rule, as the apiserver stores it (the status written out: it defaults to `True`).
pub fn rule() -> serde_json::Value {
    json!({"action": "Ignore", "onPodConditions": [{"type": DISRUPTION_TARGET, "status": "True"}]})
}

/// The JSON patch of [`Plan::Add`].
fn patch(at: &Insert, replace_when_failed: bool) -> serde_json::Value {
    let mut ops = vec![match at {
        Insert::NewPolicy => {
            json!({"op": "add", "path": "/spec/podFailurePolicy", "value": {"rules": [rule()]}})
        }
        Insert::NewRules => json!({"op": "add", "path": "/spec/podFailurePolicy/rules", "value": [rule()]}),
        Insert::First => json!({"op": "add", "path": "/spec/podFailurePolicy/rules/0", "value": rule()}),
    }];
    if replace_when_failed {
        ops.push(json!({"op": "add", "path": "/spec/podReplacementPolicy", "value": REPLACE_WHEN_FAILED}));
    }
    serde_json::Value::Array(ops)
}

/// Answers the review of a Job.
pub fn judge(review: &Review, policy: &Policy) -> Outcome {
    let unchanged = |response| Outcome {
        response,
        verdict: Verdict::Unchanged,
    };
    let request = &review.request;
    if request.operation != kube::core::admission::Operation::Create || request.sub_resource.is_some() {
        return unchanged(allow(review));
    }
    if !policy.job_disruption_rule {
        let mut response = allow(review);
        response.warnings = Some(vec![
            "tensile webhook: a Job passes unchanged while --job-disruption-rule is off; the webhook \
             registration should send Jobs only with it on"
                .to_owned(),
        ]);
        return unchanged(response);
    }
    if let Some(ns) = &request.namespace
        && policy.excluded_namespaces.contains(ns)
    {
        return unchanged(allow(review));
    }
    let Some(object) = review.object.as_deref() else {
        return deny(review, "the CREATE review carries no Job".into());
    };
    let opt_in = &policy.opt_in;
    let job = match JobMembers::decode(object) {
        Ok(job) => job,
        Err(reason) => {
            // Only a Job that opted in is refused for it; any other is not ours.
            let label = ["spec", "template", "metadata", "labels"]
                .iter()
                .try_fold(object, |at, key| Level::of(at).step(key))
                .and_then(|labels| Level::of(labels).step(&opt_in.key))
                .and_then(raw::string);
            if label.as_deref() != Some(opt_in.value.as_str()) {
                return unchanged(allow(review));
            }
            return deny(review, format!("the Job does not decode: {reason}"));
        }
    };
    if job.template_label(&opt_in.key) != Some(&opt_in.value) {
        return unchanged(allow(review));
    }
    match plan(&job) {
        Plan::Keep(warning) => {
            let mut response = allow(review);
            response.warnings = warning.map(|w| vec![w]);
            unchanged(response)
        }
        Plan::Add {
            at,
            replace_when_failed,
        } => match serde_json::to_vec(&patch(&at, replace_when_failed)) {
            Ok(patch) => patched(review, patch, Vec::new()),
            Err(e) => deny(review, format!("cannot encode the patch: {e}")),
        },
    }
}

#[cfg(test)]
#[path = "job_tests.rs"]
mod tests;
