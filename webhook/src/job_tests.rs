use serde_json::{Value, json};

use super::*;
use crate::mutate::{NoClaims, mutate};

fn review_of(object: Value, namespace: &str, operation: &str) -> Review {
    let body = json!({
        "apiVersion": review::API_VERSION,
        "kind": review::KIND,
        "request": {
            "uid": "uid-9",
            "kind": {"group": "batch", "version": "v1", "kind": "Job"},
            "resource": {"group": "batch", "version": "v1", "resource": "jobs"},
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "tester"},
            "object": object,
        }
    });
    review::parse(&serde_json::to_vec(&body).unwrap()).unwrap()
}

/// A Job as a 1.33+ apiserver hands it to admission: defaulted, `podReplacementPolicy`
/// `TerminatingOrFailed` (the default without a policy), its pod template opted in.
fn job(restart: &str) -> Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "batch", "namespace": "team", "labels": {"app": "batch"}},
        "spec": {
            "backoffLimit": 0,
            "completionMode": "NonIndexed",
            "podReplacementPolicy": "TerminatingOrFailed",
            "template": {
                "metadata": {"labels": {"app": "batch", "virtual-pod": "true"}},
                "spec": {"restartPolicy": restart, "containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    })
}

fn on() -> Policy {
    Policy {
        job_disruption_rule: true,
        ..Policy::default()
    }
}

/// The outcome of `object` under `policy`, and the Job with its patch applied.
fn run(object: &Value, policy: &Policy) -> (Outcome, Value) {
    let outcome = mutate(&review_of(object.clone(), "team", "CREATE"), policy, &NoClaims);
    let mut after = object.clone();
    if let Some(bytes) = &outcome.response.patch {
        let patch: json_patch::Patch = serde_json::from_slice(bytes).unwrap();
        json_patch::patch(&mut after, &patch).unwrap();
    }
    (outcome, after)
}

/// The Job as the apiserver would decode it, so a patched Job is one it can store.
fn decodes(job: &Value) -> k8s_openapi::api::batch::v1::Job {
    serde_json::from_value(job.clone()).unwrap_or_else(|e| panic!("{e}: {job}"))
}

fn warning(outcome: &Outcome) -> String {
    outcome.response.warnings.clone().unwrap_or_default().join("\n")
}

#[test]
fn an_opted_in_job_gets_the_rule_first_and_replaces_pods_once_failed() {
    let (outcome, after) = run(&job("Never"), &on());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert!(outcome.response.allowed);
    assert_eq!(after["spec"]["podFailurePolicy"], json!({"rules": [rule()]}));
    assert_eq!(after["spec"]["podReplacementPolicy"], "Failed");
    let decoded = decodes(&after);
    let rules = decoded.spec.unwrap().pod_failure_policy.unwrap().rules;
    assert_eq!(rules[0].action, "Ignore");
    let pattern = &rules[0].on_pod_conditions.as_ref().unwrap()[0];
    assert_eq!(
        (
            pattern.type_.as_str(),
            pattern.status.as_deref().unwrap_or_default()
        ),
        ("DisruptionTarget", "True")
    );
    // Nothing else of the Job changes.
    let mut rest = after.clone();
    rest["spec"].as_object_mut().unwrap().remove("podFailurePolicy");
    rest["spec"]["podReplacementPolicy"] = json!("TerminatingOrFailed");
    assert_eq!(rest, job("Never"));
    // A second pass (a re-invocation) is a no-op.
    let (again, same) = run(&after, &on());
    assert_eq!(again.verdict, Verdict::Unchanged);
    assert!(again.response.patch.is_none() && again.response.warnings.is_none());
    assert_eq!(same, after);
}

#[test]
fn the_rule_goes_before_the_jobs_own_rules_which_stay_as_written() {
    let mut j = job("Never");
    let own = json!([
        {"action": "FailJob", "onExitCodes": {"containerName": "c", "operator": "In", "values": [42]}},
        {"action": "Count", "onPodConditions": [{"type": "ConfigIssue", "status": "True"}]},
    ]);
    j["spec"]["podFailurePolicy"] = json!({"rules": own});
    j["spec"]["podReplacementPolicy"] = json!("Failed");
    let (outcome, after) = run(&j, &on());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    let rules = after["spec"]["podFailurePolicy"]["rules"].as_array().unwrap();
    assert_eq!(rules[0], rule());
    assert_eq!(rules[1..], own.as_array().unwrap()[..]);
    // Already Failed: the patch only inserts the rule.
    let patch: Value = serde_json::from_slice(outcome.response.patch.as_deref().unwrap()).unwrap();
    assert_eq!(
        patch,
        json!([{"op": "add", "path": "/spec/podFailurePolicy/rules/0", "value": rule()}])
    );
    decodes(&after);

    // A policy without rules, with no rules or with null ones gets them.
    for policy in [
        json!({}),
        json!({"rules": []}),
        json!({"rules": null}),
        json!(null),
    ] {
        let mut j = job("Never");
        j["spec"]["podFailurePolicy"] = policy.clone();
        let (_, after) = run(&j, &on());
        assert_eq!(
            after["spec"]["podFailurePolicy"],
            json!({"rules": [rule()]}),
            "{policy}"
        );
        decodes(&after);
    }
}

#[test]
fn a_job_that_already_ignores_disruptions_is_left_unchanged() {
    for (rules, why) in [
        (
            json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]),
            "the rule",
        ),
        (
            json!([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]),
            "status defaulted",
        ),
        (
            json!([{"action": "Ignore", "onPodConditions": [
                {"type": "ConfigIssue", "status": "True"}, {"type": "DisruptionTarget", "status": "True"}]}]),
            "among other patterns",
        ),
        (
            json!([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
                   {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]),
            "after an exit-code rule: the author's order",
        ),
    ] {
        let mut j = job("Never");
        j["spec"]["podFailurePolicy"] = json!({"rules": rules});
        let (outcome, after) = run(&j, &on());
        assert_eq!(outcome.verdict, Verdict::Unchanged, "{why}");
        assert!(
            outcome.response.warnings.is_none(),
            "{why}: {}",
            warning(&outcome)
        );
        assert_eq!(after, j, "{why}");
    }
}

#[test]
fn a_job_whose_rules_say_otherwise_of_disruptions_is_left_as_written_with_a_warning() {
    for action in ["FailJob", "Count", "FailIndex"] {
        let mut j = job("Never");
        j["spec"]["podFailurePolicy"] = json!({"rules": [
            {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [3]}},
            {"action": action, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]});
        let (outcome, after) = run(&j, &on());
        assert_eq!(outcome.verdict, Verdict::Unchanged);
        assert!(outcome.response.allowed);
        assert_eq!(after, j);
        let said = warning(&outcome);
        assert!(
            said.contains(&format!(
                "rule 1 of the Job's podFailurePolicy (action {action:?} on DisruptionTarget)"
            )) && said.contains("will not move its pods"),
            "{said}"
        );
    }
    // A pattern on DisruptionTarget=False says nothing about a disrupted pod.
    let mut j = job("Never");
    j["spec"]["podFailurePolicy"] = json!({"rules": [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}]});
    let (outcome, after) = run(&j, &on());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(after["spec"]["podFailurePolicy"]["rules"][0], rule());
}

#[test]
fn a_job_the_apiserver_would_refuse_with_the_rule_is_left_unchanged_saying_why() {
    // restartPolicy OnFailure: a podFailurePolicy needs Never.
    let (outcome, after) = run(&job("OnFailure"), &on());
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    assert_eq!(after, job("OnFailure"));
    let said = warning(&outcome);
    assert!(
        said.contains("restartPolicy \"OnFailure\"") && said.contains("needs \"Never\""),
        "{said}"
    );
    // A template without one (the apiserver refuses the Job anyway).
    let mut j = job("Never");
    j["spec"]["template"]["spec"]
        .as_object_mut()
        .unwrap()
        .remove("restartPolicy");
    let (outcome, after) = run(&j, &on());
    assert_eq!((outcome.verdict, &after), (Verdict::Unchanged, &j));
    assert!(warning(&outcome).contains("restartPolicy not set"));
    // Twenty rules, the most a policy may hold: a 21st would be refused.
    let mut j = job("Never");
    let rules: Vec<Value> = (1..=MAX_RULES)
        .map(|code| json!({"action": "Count", "onExitCodes": {"operator": "In", "values": [code]}}))
        .collect();
    j["spec"]["podFailurePolicy"] = json!({"rules": rules});
    let (outcome, after) = run(&j, &on());
    assert_eq!((outcome.verdict, &after), (Verdict::Unchanged, &j));
    assert!(
        warning(&outcome).contains("holds 20 rules"),
        "{}",
        warning(&outcome)
    );
    // Nineteen take the rule.
    j["spec"]["podFailurePolicy"]["rules"]
        .as_array_mut()
        .unwrap()
        .pop();
    let (outcome, after) = run(&j, &on());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(
        after["spec"]["podFailurePolicy"]["rules"]
            .as_array()
            .unwrap()
            .len(),
        MAX_RULES
    );
}

#[test]
fn only_opted_in_jobs_created_outside_excluded_namespaces_with_the_option_on_are_changed() {
    // Off: unchanged, saying the registration should not send Jobs.
    let (outcome, after) = run(&job("Never"), &Policy::default());
    assert_eq!((outcome.verdict, &after), (Verdict::Unchanged, &job("Never")));
    assert!(warning(&outcome).contains("--job-disruption-rule is off"));
    // The label on the Job itself, not its template, does not opt in.
    let mut j = job("Never");
    j["spec"]["template"]["metadata"]["labels"] = json!({"app": "batch"});
    j["metadata"]["labels"] = json!({"virtual-pod": "true"});
    let (outcome, after) = run(&j, &on());
    assert_eq!((outcome.verdict, &after), (Verdict::Unchanged, &j));
    assert!(outcome.response.warnings.is_none());
    // Another value of the label.
    j["spec"]["template"]["metadata"]["labels"] = json!({"virtual-pod": "false"});
    assert_eq!(run(&j, &on()).0.verdict, Verdict::Unchanged);
    // An excluded namespace, an UPDATE.
    for (ns, op) in [("kube-system", "CREATE"), ("team", "UPDATE")] {
        let outcome = mutate(&review_of(job("Never"), ns, op), &on(), &NoClaims);
        assert_eq!(outcome.verdict, Verdict::Unchanged, "{ns} {op}");
        assert!(outcome.response.patch.is_none());
    }
    // Another opt-in label.
    let policy = Policy {
        opt_in: crate::Label::new("tensile", "on"),
        ..on()
    };
    assert_eq!(run(&job("Never"), &policy).0.verdict, Verdict::Unchanged);
    let mut j = job("Never");
    j["spec"]["template"]["metadata"]["labels"]["tensile"] = json!("on");
    assert_eq!(run(&j, &policy).0.verdict, Verdict::Mutated);
}

#[test]
fn a_job_that_does_not_decode_is_refused_if_opted_in_and_never_panics() {
    let mut j = job("Never");
    j["spec"]["podFailurePolicy"] = json!({"rules": "all of them"});
    let (outcome, _) = run(&j, &on());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(!outcome.response.allowed);
    assert!(
        outcome
            .response
            .result
            .message
            .contains("the Job does not decode"),
        "{}",
        outcome.response.result.message
    );
    // Not opted in: not ours to judge.
    j["spec"]["template"]["metadata"]["labels"] = json!({"app": "batch"});
    assert_eq!(run(&j, &on()).0.verdict, Verdict::Unchanged);
    // Another kind of object under the Job's kind, and odd shapes anywhere.
    let mut wrong = job("Never");
    wrong["kind"] = json!("CronJob");
    assert_eq!(run(&wrong, &on()).0.verdict, Verdict::Denied);
    for odd in [
        json!(null),
        json!([]),
        json!("job"),
        json!({"spec": null}),
        json!({"spec": {"template": null}}),
        json!({"spec": {"template": {"metadata": {"labels": {"virtual-pod": "true"}}}}}),
        json!({"spec": {"template": {"metadata": {"labels": {"virtual-pod": "true"}}, "spec": {"restartPolicy": "Never"}},
                         "podFailurePolicy": {"rules": [{"onPodConditions": [{}]}, {}]}}}),
        json!({"spec": {"template": {"metadata": {"labels": {"virtual-pod": 7}}}}}),
    ] {
        let outcome = mutate(&review_of(odd.clone(), "team", "CREATE"), &on(), &NoClaims);
        assert!(
            outcome.response.allowed || outcome.verdict == Verdict::Denied,
            "{odd}: {outcome:?}"
        );
    }
    // A CREATE review without the Job.
    let mut r = review_of(job("Never"), "team", "CREATE");
    r.object = None;
    let outcome = mutate(&r, &on(), &NoClaims);
    assert_eq!(outcome.verdict, Verdict::Denied);
}
