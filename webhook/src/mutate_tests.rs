use serde_json::{Value, json};

use super::*;
use crate::review;

fn review_of(object: Value, namespace: &str, operation: &str, kind: &str) -> Review {
    let body = json!({
        "apiVersion": review::API_VERSION,
        "kind": review::KIND,
        "request": {
            "uid": "uid-7",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "tester"},
            "object": object,
        }
    });
    review::parse(&serde_json::to_vec(&body).unwrap()).unwrap()
}

fn pod(labels: Value, spec: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team", "labels": labels},
        "spec": spec,
    })
}

fn opted_in(spec: Value) -> Value {
    pod(json!({"virtual-pod": "true", "app": "x"}), spec)
}

fn containers() -> Value {
    json!([{"name": "c", "image": "busybox"}])
}

/// Applies the outcome's patch to `object`.
fn applied(object: &Value, outcome: &Outcome) -> Value {
    let mut doc = object.clone();
    if let Some(bytes) = &outcome.response.patch {
        let patch: json_patch::Patch = serde_json::from_slice(bytes).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
    }
    doc
}

fn run(object: Value, policy: &Policy) -> (Outcome, Value) {
    let outcome = mutate(
        &review_of(object.clone(), "team", "CREATE", "Pod"),
        policy,
        &NoClaims,
    );
    let after = applied(&object, &outcome);
    (outcome, after)
}

fn stash_of(pod: &Value) -> Stash {
    Stash::decode(
        pod["metadata"]["annotations"][names::CLUSTER_SELECTOR]
            .as_str()
            .unwrap(),
    )
    .unwrap()
}

fn ops(outcome: &Outcome) -> Vec<(String, String)> {
    let patch: Value = serde_json::from_slice(outcome.response.patch.as_deref().unwrap_or(b"[]")).unwrap();
    patch
        .as_array()
        .unwrap()
        .iter()
        .map(|op| {
            (
                op["op"].as_str().unwrap().to_owned(),
                op["path"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn full_spec() -> Value {
    json!({
        "containers": containers(),
        "nodeSelector": {"disk": "ssd", "region": "eu"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                ]},
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 5, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}},
                ],
            },
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"},
            ]},
        },
        "tolerations": [
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        ],
    })
}

#[test]
fn a_pod_without_the_label_passes_unchanged() {
    let (outcome, _) = run(pod(json!({"app": "x"}), full_spec()), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    assert!(outcome.response.allowed && outcome.response.patch.is_none());
    assert_eq!(outcome.response.uid, "uid-7");
    let (outcome, _) = run(
        pod(json!({"virtual-pod": "false"}), full_spec()),
        &Policy::default(),
    );
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    let no_labels =
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": full_spec()});
    assert_eq!(run(no_labels, &Policy::default()).0.verdict, Verdict::Unchanged);
}

#[test]
fn an_opted_in_pod_moves_its_lower_constraints_into_the_stash() {
    let original = opted_in(full_spec());
    let (outcome, after) = run(original.clone(), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert!(outcome.response.allowed);
    assert_eq!(outcome.response.uid, "uid-7");

    let stash = stash_of(&after);
    assert_eq!(
        stash.node_selector,
        BTreeMap::from([("disk".into(), "ssd".into()), ("region".into(), "eu".into())])
    );
    let lower = serde_json::to_value(stash.node_affinity().unwrap()).unwrap();
    assert_eq!(
        lower,
        json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        ]}}),
        "only the required part goes down"
    );
    assert_eq!(
        serde_json::to_value(&stash.tolerations).unwrap(),
        original["spec"]["tolerations"]
    );

    let spec = &after["spec"];
    assert!(spec.get("nodeSelector").is_none(), "{spec}");
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]})
    );
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"],
        original["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"],
        "preferred node affinity stays upstream"
    );
    assert_eq!(
        spec["affinity"]["podAntiAffinity"],
        original["spec"]["affinity"]["podAntiAffinity"]
    );
    assert_eq!(
        spec["tolerations"],
        json!([
            {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        ])
    );
    assert_eq!(after["spec"]["containers"], original["spec"]["containers"]);
    assert_eq!(after["metadata"]["labels"], original["metadata"]["labels"]);
    assert!(serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(after).is_ok());
}

#[test]
fn the_patch_touches_only_the_changed_fields() {
    let (outcome, _) = run(opted_in(full_spec()), &Policy::default());
    assert_eq!(
        ops(&outcome),
        vec![
            ("add".into(), "/metadata/annotations".into()),
            ("remove".into(), "/spec/nodeSelector".into()),
            ("add".into(), "/spec/affinity/nodeAffinity".into()),
            ("add".into(), "/spec/tolerations".into()),
        ]
    );
    let mut bare = opted_in(json!({"containers": containers()}));
    bare["metadata"]["annotations"] = json!({"note": "keep me"});
    let (outcome, after) = run(bare, &Policy::default());
    assert_eq!(
        ops(&outcome),
        vec![
            ("add".into(), "/metadata/annotations/clusterSelector".into()),
            ("add".into(), "/spec/affinity".into()),
            ("add".into(), "/spec/tolerations".into()),
        ]
    );
    assert_eq!(after["metadata"]["annotations"]["note"], "keep me");
    assert!(stash_of(&after).is_empty());
}

#[test]
fn ignored_keys_stay_upstream_to_steer_the_cluster_choice() {
    let policy = Policy {
        ignore_selector_keys: BTreeSet::from(["region".to_owned(), "cluster".to_owned()]),
        ..Policy::default()
    };
    let mut spec = full_spec();
    spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] = json!([
        {"matchExpressions": [
            {"key": "cluster", "operator": "In", "values": ["a", "b"]},
            {"key": "zone", "operator": "In", "values": ["z1"]},
        ]},
    ]);
    let (outcome, after) = run(opted_in(spec), &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(after["spec"]["nodeSelector"], json!({"region": "eu"}));
    assert_eq!(
        after["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
        json!([{"matchExpressions": [
            {"key": "cluster", "operator": "In", "values": ["a", "b"]},
            {"key": "type", "operator": "In", "values": ["virtual-kubelet"]},
        ]}])
    );
    let stash = stash_of(&after);
    assert_eq!(
        stash.node_selector,
        BTreeMap::from([("disk".into(), "ssd".into())])
    );
    let terms = &stash
        .node_affinity()
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms;
    assert_eq!(terms.len(), 1);
    assert_eq!(terms[0].match_expressions.as_ref().unwrap()[0].key, "zone");
    assert!(outcome.response.warnings.is_none(), "one term: nothing is lost");
}

#[test]
fn match_fields_go_down_with_their_term() {
    let spec = json!({
        "containers": containers(),
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["lower-node-1"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}],
             "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["lower-node-2"]}]},
        ]}}},
    });
    let original = opted_in(spec);
    let (_, after) = run(original.clone(), &Policy::default());
    let stash = stash_of(&after);
    assert_eq!(
        serde_json::to_value(stash.node_affinity().unwrap()).unwrap()["requiredDuringSchedulingIgnoredDuringExecution"],
        original["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        "both terms, fields included, reach the lower cluster intact"
    );
    let upper = &after["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    assert_eq!(
        *upper,
        json!([{"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]),
        "no lower node name is left upstream"
    );
}

#[test]
fn a_term_left_empty_on_one_side_leaves_that_side_unconstrained() {
    let policy = Policy {
        ignore_selector_keys: BTreeSet::from(["cluster".to_owned()]),
        ..Policy::default()
    };
    let spec = json!({
        "containers": containers(),
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "cluster", "operator": "In", "values": ["a"]}, {"key": "zone", "operator": "In", "values": ["z"]}]},
            {"matchExpressions": [{"key": "cluster", "operator": "In", "values": ["b"]}]},
        ]}}},
    });
    let (outcome, after) = run(opted_in(spec), &policy);
    // Term 2 puts no constraint below, so below nothing is required (an empty term would
    // match no node at all).
    assert!(stash_of(&after).node_affinity().is_none());
    let upper = &after["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    assert_eq!(upper.as_array().unwrap().len(), 2);
    for term in upper.as_array().unwrap() {
        assert_eq!(
            term["matchExpressions"].as_array().unwrap().last().unwrap()["key"],
            "type"
        );
    }
    let warnings = outcome.response.warnings.unwrap();
    assert!(warnings[0].contains("lost"), "{warnings:?}");
}

#[test]
fn toleration_seconds_and_the_virtual_node_constraint_are_configurable() {
    let policy = Policy {
        not_ready_seconds: 30,
        unreachable_seconds: 45,
        virtual_node_constraint: VirtualNodeConstraint::NodeSelector,
        virtual_node_label: crate::Label::new("kind", "virtual"),
        ..Policy::default()
    };
    let (_, after) = run(opted_in(full_spec()), &policy);
    assert_eq!(after["spec"]["nodeSelector"], json!({"kind": "virtual"}));
    assert!(
        after["spec"]["affinity"]["nodeAffinity"]
            .get("requiredDuringSchedulingIgnoredDuringExecution")
            .is_none(),
        "{after}"
    );
    let tolerations = after["spec"]["tolerations"].as_array().unwrap();
    assert_eq!(tolerations[1]["tolerationSeconds"], 30);
    assert_eq!(tolerations[2]["tolerationSeconds"], 45);

    let none = Policy {
        virtual_node_constraint: VirtualNodeConstraint::None,
        ..Policy::default()
    };
    let (_, after) = run(
        opted_in(json!({"containers": containers(), "nodeSelector": {"a": "b"}})),
        &none,
    );
    assert!(after["spec"].get("nodeSelector").is_none());
    assert!(after["spec"].get("affinity").is_none());
}

#[test]
fn a_bound_pvc_pins_the_pod_to_its_virtual_node() {
    let mut spec = full_spec();
    spec["volumes"] = json!([
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}},
        {"name": "cfg", "configMap": {"name": "cfg"}},
    ]);
    let object = opted_in(spec);
    let review = review_of(object.clone(), "team", "CREATE", "Pod");
    assert_eq!(
        claims_to_look_up(&review, &Policy::default()),
        vec!["cache".to_owned(), "data".to_owned()]
    );
    let claims = BTreeMap::from([("data".to_owned(), "vnode-a".to_owned())]);
    let outcome = mutate(&review, &Policy::default(), &claims);
    let after = applied(&object, &outcome);
    assert_eq!(
        after["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
        json!([{
            "matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vnode-a"]}],
        }])
    );

    let split = BTreeMap::from([
        ("data".to_owned(), "vnode-a".to_owned()),
        ("cache".to_owned(), "vnode-b".to_owned()),
    ]);
    let outcome = mutate(&review, &Policy::default(), &split);
    assert_eq!(outcome.verdict, Verdict::Denied);
    let message = &outcome.response.result.message;
    assert!(
        message.contains("vnode-a") && message.contains("vnode-b"),
        "{message}"
    );
}

#[test]
fn reviews_that_are_not_ours_pass_unchanged() {
    let object = opted_in(full_spec());
    for review in [
        review_of(object.clone(), "kube-system", "CREATE", "Pod"),
        review_of(object.clone(), "team", "UPDATE", "Pod"),
        review_of(object.clone(), "team", "DELETE", "Pod"),
    ] {
        assert!(claims_to_look_up(&review, &Policy::default()).is_empty());
        let outcome = mutate(&review, &Policy::default(), &NoClaims);
        assert_eq!(outcome.verdict, Verdict::Unchanged);
        assert!(outcome.response.allowed && outcome.response.patch.is_none());
    }
    let outcome = mutate(
        &review_of(object, "team", "CREATE", "Deployment"),
        &Policy::default(),
        &NoClaims,
    );
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    assert!(outcome.response.warnings.unwrap()[0].contains("not a pod"));
}

#[test]
fn a_stashed_pod_is_not_stashed_again_and_a_broken_stash_is_refused() {
    let (first, after) = run(opted_in(full_spec()), &Policy::default());
    assert_eq!(first.verdict, Verdict::Mutated);
    let (second, again) = run(after.clone(), &Policy::default());
    assert_eq!(second.verdict, Verdict::Unchanged);
    assert!(second.response.patch.is_none());
    assert_eq!(again, after);

    let mut broken = opted_in(full_spec());
    broken["metadata"]["annotations"] = json!({"clusterSelector": "{nope"});
    let (outcome, _) = run(broken.clone(), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(!outcome.response.allowed);
    assert!(
        outcome.response.result.message.contains("clusterSelector"),
        "{}",
        outcome.response.result.message
    );
    broken["metadata"]["annotations"] = json!({"clusterSelector": 5});
    assert_eq!(run(broken, &Policy::default()).0.verdict, Verdict::Denied);
}

#[test]
fn a_pod_whose_read_members_do_not_decode_is_refused_with_the_reason() {
    let broken = [
        json!({"containers": containers(), "tolerations": "not a list"}),
        json!({"containers": containers(), "nodeSelector": {"disk": 5}}),
        json!({"containers": containers(), "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}}),
        json!({"containers": containers(), "volumes": [{"name": "v", "persistentVolumeClaim": {}}]}),
    ];
    for spec in broken {
        let (outcome, _) = run(opted_in(spec.clone()), &Policy::default());
        assert_eq!(outcome.verdict, Verdict::Denied, "{spec}");
        assert_eq!(outcome.response.uid, "uid-7");
        assert!(
            outcome.response.result.message.contains("does not decode"),
            "{spec}: {}",
            outcome.response.result.message
        );
    }
    let mut wrong_kind = opted_in(full_spec());
    wrong_kind["kind"] = json!("Deployment");
    let (outcome, _) = run(wrong_kind, &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(
        outcome
            .response
            .result
            .message
            .contains("kind \"Deployment\", expected \"Pod\""),
        "{}",
        outcome.response.result.message
    );
    let no_spec = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"virtual-pod": "true"}}});
    let (outcome, _) = run(no_spec, &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(outcome.response.result.message.contains("no spec"));
    let (outcome, _) = run(Value::Null, &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(outcome.response.result.message.contains("carries no pod"));
}

#[test]
fn a_label_key_with_a_slash_is_found() {
    let policy = Policy {
        opt_in: crate::Label::new("tensile.io/virtual", "yes"),
        ..Policy::default()
    };
    let (outcome, _) = run(pod(json!({"tensile.io/virtual": "yes"}), full_spec()), &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
}

#[test]
fn a_field_already_as_wanted_is_left_alone_unless_its_json_differs() {
    let upper = json!([
        {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    ]);
    let (outcome, after) = run(
        opted_in(json!({"containers": containers(), "tolerations": upper.clone()})),
        &Policy::default(),
    );
    assert!(!ops(&outcome).contains(&("add".into(), "/spec/tolerations".into())));
    // The stash still holds them: they were the pod's own.
    assert_eq!(
        serde_json::to_value(&stash_of(&after).tolerations).unwrap(),
        upper
    );

    // The same tolerations as decoded, but not as written: the field is rewritten.
    let mut noisy = upper.clone();
    noisy[0]["value"] = Value::Null;
    noisy[1]["note"] = json!("dropped by decoding");
    let (outcome, after) = run(
        opted_in(json!({"containers": containers(), "tolerations": noisy})),
        &Policy::default(),
    );
    assert!(ops(&outcome).contains(&("add".into(), "/spec/tolerations".into())));
    assert_eq!(after["spec"]["tolerations"], upper);

    let required = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]}});
    let mut spec = json!({"containers": containers(), "affinity": {"nodeAffinity": required.clone()}});
    let (outcome, _) = run(opted_in(spec.clone()), &Policy::default());
    assert!(
        !ops(&outcome)
            .iter()
            .any(|(_, path)| path.starts_with("/spec/affinity"))
    );
    spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = Value::Null;
    let (outcome, after) = run(opted_in(spec), &Policy::default());
    assert!(ops(&outcome).contains(&("add".into(), "/spec/affinity/nodeAffinity".into())));
    assert_eq!(after["spec"]["affinity"]["nodeAffinity"], required);
}

#[test]
fn members_the_webhook_does_not_read_are_left_to_the_apiserver() {
    // Containers that are not a list: the apiserver's validation refuses them after
    // admission. The webhook stashes the pod and its patch leaves them exactly as they were.
    let mut spec = full_spec();
    spec["containers"] = json!("not a list");
    spec["priority"] = json!({"not": "a number"});
    let original = opted_in(spec);
    let (outcome, after) = run(original.clone(), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(after["spec"]["containers"], "not a list");
    assert_eq!(after["spec"]["priority"], original["spec"]["priority"]);
    assert!(
        ops(&outcome)
            .iter()
            .all(|(_, path)| !path.starts_with("/spec/containers") && !path.starts_with("/spec/priority"))
    );
    assert_eq!(stash_of(&after).node_selector.len(), 2);
}

#[test]
fn a_pod_that_does_not_decode_is_judged_on_its_raw_labels_and_stash() {
    let broken = json!({"containers": containers(), "tolerations": "not a list"});
    let (outcome, _) = run(pod(json!({"app": "x"}), broken.clone()), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Unchanged, "not ours, decoding or not");
    let mut stashed = opted_in(broken.clone());
    stashed["metadata"]["annotations"] = json!({"clusterSelector": "{}"});
    let (outcome, _) = run(stashed.clone(), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Unchanged, "already stashed");
    stashed["metadata"]["annotations"] = json!({"clusterSelector": 5});
    let (outcome, _) = run(stashed, &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Denied);
    assert!(outcome.response.result.message.contains("must be a string"));
    // Labels that are not a map: the pod does not decode, and the raw lookup does not find
    // the label either.
    let (outcome, _) = run(
        pod(json!(["virtual-pod"]), json!({"containers": containers()})),
        &Policy::default(),
    );
    assert_eq!(outcome.verdict, Verdict::Unchanged);
}

#[test]
fn the_two_steps_agree_with_mutate() {
    let mut spec = full_spec();
    spec["volumes"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    let review = review_of(opted_in(spec), "team", "CREATE", "Pod");
    let claims = BTreeMap::from([("data".to_owned(), "vnode-a".to_owned())]);
    let Judgement::Stash(stashing) = judge(&review, &Policy::default()) else {
        panic!("an opted-in pod without a stash is to be stashed");
    };
    assert_eq!(stashing.claims(), vec!["data".to_owned()]);
    let two_steps = stashing.finish(&Policy::default(), &claims);
    let one_step = mutate(&review, &Policy::default(), &claims);
    assert_eq!(two_steps.verdict, Verdict::Mutated);
    assert_eq!(two_steps.response, one_step.response);
    let not_ours = review_of(pod(json!({"app": "x"}), full_spec()), "team", "CREATE", "Pod");
    assert!(matches!(
        judge(&not_ours, &Policy::default()),
        Judgement::Decided(_)
    ));
}

#[test]
fn patch_paths_escape_tilde_and_slash() {
    assert_eq!(
        path(&["metadata", "annotations", "a/b~c"]),
        "/metadata/annotations/a~1b~0c"
    );
    assert_eq!(path(&["spec", "nodeSelector"]), "/spec/nodeSelector");
}

/// The descheduler's record for the ReplicaSet `rs-uid`: avoid `vn-a` and `vn-c`.
struct Excluding;

impl ExcludedNodes for Excluding {
    fn excluded_nodes(&self, owner_uid: &str) -> Vec<String> {
        match owner_uid {
            "rs-uid" => vec!["vn-a".into(), "vn-c".into()],
            _ => Vec::new(),
        }
    }
}

fn owned_by(mut pod: Value, uid: &str) -> Value {
    pod["metadata"]["ownerReferences"] = json!([
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-1", "uid": uid, "controller": true},
    ]);
    pod
}

fn run_excluding(object: Value, policy: &Policy) -> (Outcome, Value) {
    let review = review_of(object.clone(), "team", "CREATE", "Pod");
    let Judgement::Stash(stashing) = judge(&review, policy) else {
        panic!("an opted-in pod without a stash is stashed")
    };
    let outcome = stashing.finish_excluding(policy, &NoClaims, &Excluding);
    let after = applied(&object, &outcome);
    (outcome, after)
}

const TERMS: &str =
    "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms";

#[test]
fn a_replacement_of_an_excluded_workload_avoids_the_refusing_nodes_in_every_upper_term_only() {
    let mut spec = full_spec();
    spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] = json!([
        {"matchExpressions": [{"key": "cluster", "operator": "In", "values": ["eu"]}, {"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "cluster", "operator": "In", "values": ["us"]}]},
    ]);
    let policy = Policy {
        ignore_selector_keys: ["cluster".to_owned()].into(),
        ..Policy::default()
    };
    let (outcome, after) = run_excluding(owned_by(opted_in(spec), "rs-uid"), &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
    let not_in = json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-a", "vn-c"]});
    let terms = after.pointer(TERMS).unwrap().as_array().unwrap().clone();
    assert_eq!(terms.len(), 2);
    for term in &terms {
        let exprs = term["matchExpressions"].as_array().unwrap();
        assert!(
            exprs.contains(&not_in),
            "every term carries the exclusion: {term}"
        );
    }
    assert_eq!(
        after["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        "vn-a,vn-c"
    );
    let stash = serde_json::to_string(&stash_of(&after)).unwrap();
    assert!(
        !stash.contains("kubernetes.io/hostname"),
        "the exclusion never reaches the lower pod: {stash}"
    );
}

#[test]
fn an_excluded_workload_without_required_affinity_gets_one_term_holding_the_exclusion() {
    let policy = Policy {
        virtual_node_constraint: crate::policy::VirtualNodeConstraint::NodeSelector,
        ..Policy::default()
    };
    let spec = json!({"containers": containers()});
    let (_, after) = run_excluding(
        owned_by(pod(json!({"virtual-pod": "true"}), spec), "rs-uid"),
        &policy,
    );
    assert_eq!(
        after.pointer(TERMS).unwrap(),
        &json!([{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-a", "vn-c"]}]}])
    );
    assert_eq!(
        after["metadata"]["annotations"]["tensile.io/excluded-nodes"], "vn-a,vn-c",
        "written into a new annotations map"
    );
    assert!(after["metadata"]["annotations"]["clusterSelector"].is_string());
}

#[test]
fn pods_of_other_workloads_bare_pods_and_volume_pinned_pods_get_no_exclusion() {
    for object in [
        owned_by(opted_in(full_spec()), "other-uid"),
        opted_in(full_spec()),
    ] {
        let (_, after) = run_excluding(object, &Policy::default());
        let text = after.to_string();
        assert!(
            !text.contains("NotIn") && !text.contains("excluded-nodes"),
            "{text}"
        );
    }
    let mut spec = full_spec();
    spec["volumes"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    let object = owned_by(opted_in(spec), "rs-uid");
    let review = review_of(object.clone(), "team", "CREATE", "Pod");
    let Judgement::Stash(stashing) = judge(&review, &Policy::default()) else {
        panic!("stashed")
    };
    let claims = BTreeMap::from([("data".to_owned(), "vn-a".to_owned())]);
    let after = applied(
        &object,
        &stashing.finish_excluding(&Policy::default(), &claims, &Excluding),
    );
    assert!(
        !after.to_string().contains("NotIn"),
        "its volume lives below vn-a"
    );
}

#[test]
fn malformed_owner_references_are_the_apiservers_to_refuse_and_mean_no_exclusion() {
    let (clean, clean_after) = run_excluding(opted_in(full_spec()), &Policy::default());
    for garbage in [
        json!([null]),
        json!("x"),
        json!([{"uid": 5, "controller": true}]),
        json!({}),
    ] {
        let mut object = opted_in(full_spec());
        object["metadata"]["ownerReferences"] = garbage.clone();
        let (outcome, mut after) = run_excluding(object, &Policy::default());
        assert_eq!(outcome.verdict, clean.verdict, "{garbage}");
        assert_eq!(after["metadata"]["ownerReferences"], garbage, "left as written");
        after["metadata"]
            .as_object_mut()
            .map(|m| m.remove("ownerReferences"));
        assert_eq!(after, clean_after, "mutated as a pod without owners: {garbage}");
    }
}

fn signing() -> (Policy, tensile_common::stash::StashKeys) {
    let key = tensile_common::stash::StashKey::new("k1", &[5u8; 32]).unwrap();
    let policy = Policy {
        stash_key: Some(std::sync::Arc::new(key)),
        ..Policy::default()
    };
    let keys = tensile_common::stash::StashKeys::new(vec![
        tensile_common::stash::StashKey::new("k1", &[5u8; 32]).unwrap(),
    ]);
    (policy, keys)
}

fn metadata(pod: &Value) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
    serde_json::from_value(pod["metadata"].clone()).unwrap()
}

#[test]
fn with_a_stash_key_every_stash_is_signed_for_its_pods_controller_or_name() {
    use tensile_common::stash::Untrusted;
    let (policy, keys) = signing();
    let tolerations = json!([{"key": "gpu", "operator": "Exists"}]);
    let controlled = |uid: &str| {
        let mut object = opted_in(json!({"containers": containers(), "tolerations": tolerations}));
        object["metadata"]["ownerReferences"] = json!([
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "not-the-controller"},
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": uid, "controller": true}]);
        object
    };
    // Without annotations, and with some: the signature goes in either way.
    let mut annotated = controlled("rs-web");
    annotated["metadata"]["annotations"] = json!({"team": "red"});
    for object in [controlled("rs-web"), annotated] {
        let (_, after) = run(object, &policy);
        let signature = after["metadata"]["annotations"][names::STASH_SIGNATURE]
            .as_str()
            .unwrap();
        assert!(signature.starts_with("v2:k1:"), "{signature}");
        assert_eq!(keys.check(&metadata(&after)), Ok(()), "{after}");
        assert_eq!(stash_of(&after).tolerations.len(), 1);
        assert_eq!(after["metadata"]["name"], "p", "a controlled pod keeps its name");
        // The same annotations on a pod of another workload, or on a bare pod, of the namespace.
        let mut replayed = controlled("rs-other");
        replayed["metadata"]["annotations"] = after["metadata"]["annotations"].clone();
        assert!(matches!(
            keys.check(&metadata(&replayed)),
            Err(Untrusted::Mismatch { .. })
        ));
        replayed["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("ownerReferences");
        assert!(matches!(
            keys.check(&metadata(&replayed)),
            Err(Untrusted::Mismatch { .. })
        ));
    }
    // A bare pod is bound to its name.
    let (_, after) = run(opted_in(json!({"containers": containers()})), &policy);
    assert_eq!(keys.check(&metadata(&after)), Ok(()));
    let mut renamed = after.clone();
    renamed["metadata"]["name"] = json!("q");
    assert!(matches!(
        keys.check(&metadata(&renamed)),
        Err(Untrusted::Mismatch { .. })
    ));
    // Without a key, no signature.
    let (_, unsigned) = run(opted_in(json!({"containers": containers()})), &Policy::default());
    assert!(
        unsigned["metadata"]["annotations"]
            .get(names::STASH_SIGNATURE)
            .is_none(),
        "no key, no signature"
    );
}

#[test]
fn a_bare_generate_name_pod_whose_stash_is_signed_is_named_by_the_webhook() {
    let (policy, keys) = signing();
    let mut object = opted_in(json!({"containers": containers()}));
    let meta = object["metadata"].as_object_mut().unwrap();
    meta.remove("name");
    meta.insert("generateName".into(), json!("job-"));
    let (outcome, after) = run(object.clone(), &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
    // Named as the apiserver would, from the request's uid, and the signature bound to it.
    let want = tensile_common::stash::generated_name("job-", "uid-7");
    assert_eq!(after["metadata"]["name"], json!(want));
    assert!(ops(&outcome).contains(&("add".to_owned(), "/metadata/name".to_owned())));
    assert_eq!(keys.check(&metadata(&after)), Ok(()));
    // The name the apiserver would have picked instead does not verify.
    let mut other = after.clone();
    other["metadata"]["name"] = json!("job-zzzzz");
    assert!(keys.check(&metadata(&other)).is_err());
    // Without signing the apiserver names it, as always.
    let (_, after) = run(object.clone(), &Policy::default());
    assert!(after["metadata"].get("name").is_none());
    // A pod with no controller, name or generateName cannot be bound: refused, saying so.
    object["metadata"].as_object_mut().unwrap().remove("generateName");
    let (outcome, _) = run(object, &policy);
    assert_eq!(outcome.verdict, Verdict::Denied);
    let message = outcome.response.result.message;
    assert!(
        message.contains("no controller, name or generateName"),
        "{message}"
    );
}

#[test]
fn with_a_scheduler_name_opted_in_pods_of_the_default_scheduler_move_to_it() {
    let policy = Policy {
        scheduler_name: Some("tensile-scheduler".into()),
        ..Policy::default()
    };
    // The apiserver has defaulted the name before admission; an absent one is met too.
    for spec in [
        json!({"containers": containers(), "schedulerName": "default-scheduler"}),
        json!({"containers": containers()}),
    ] {
        let (outcome, after) = run(opted_in(spec), &policy);
        assert_eq!(outcome.verdict, Verdict::Mutated);
        assert_eq!(after["spec"]["schedulerName"], "tensile-scheduler");
        assert!(stash_of(&after).tolerations.is_empty());
    }
    // A pod that names a scheduler of its own keeps it.
    let own = json!({"containers": containers(), "schedulerName": "gpu-scheduler"});
    let (_, after) = run(opted_in(own), &policy);
    assert_eq!(after["spec"]["schedulerName"], "gpu-scheduler");
    // Pods that did not opt in are left alone.
    let other = pod(
        json!({"app": "x"}),
        json!({"containers": containers(), "schedulerName": "default-scheduler"}),
    );
    let (outcome, after) = run(other, &policy);
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    assert_eq!(after["spec"]["schedulerName"], "default-scheduler");
    // Without the flag, schedulerName is never touched.
    let (_, after) = run(
        opted_in(json!({"containers": containers(), "schedulerName": "default-scheduler"})),
        &Policy::default(),
    );
    assert_eq!(after["spec"]["schedulerName"], "default-scheduler");
}

#[test]
fn a_pod_written_with_its_stash_still_moves_to_the_configured_scheduler() {
    let policy = Policy {
        scheduler_name: Some("tensile-scheduler".into()),
        ..Policy::default()
    };
    let mut object = opted_in(json!({"containers": containers(), "schedulerName": "default-scheduler"}));
    object["metadata"]["annotations"] = json!({names::CLUSTER_SELECTOR: Stash::default().encode().unwrap()});
    let (outcome, after) = run(object.clone(), &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(
        ops(&outcome),
        vec![("add".to_owned(), "/spec/schedulerName".to_owned())]
    );
    assert_eq!(after["spec"]["schedulerName"], "tensile-scheduler");
    // A broken stash is still refused, whatever the scheduler.
    object["metadata"]["annotations"][names::CLUSTER_SELECTOR] = json!("{not json");
    let (outcome, _) = run(object, &policy);
    assert_eq!(outcome.verdict, Verdict::Denied);
}

/// Judges a pod that may already carry a stash, with the records of [`Excluding`].
fn judged_excluding(object: Value, policy: &Policy) -> (Outcome, Value) {
    let review = review_of(object.clone(), "team", "CREATE", "Pod");
    let Judgement::Decided(outcome) = judge_excluding(&review, policy, &Excluding) else {
        panic!("a pod written with its stash is answered in the first step")
    };
    let after = applied(&object, &outcome);
    (outcome, after)
}

#[test]
fn a_pod_written_with_its_stash_still_avoids_the_nodes_its_workload_is_excluded_from() {
    // A template that carries the stash: as the webhook itself would have written it.
    let (_, stashed) = run(opted_in(full_spec()), &Policy::default());
    let (outcome, after) = judged_excluding(owned_by(stashed.clone(), "rs-uid"), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    let not_in = json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-a", "vn-c"]});
    let terms = after.pointer(TERMS).unwrap().as_array().unwrap().clone();
    assert!(!terms.is_empty());
    for term in &terms {
        assert!(
            term["matchExpressions"].as_array().unwrap().contains(&not_in),
            "every term carries the exclusion: {term}"
        );
    }
    assert_eq!(
        after["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        "vn-a,vn-c"
    );
    assert_eq!(
        after["metadata"]["annotations"]["clusterSelector"],
        stashed["metadata"]["annotations"]["clusterSelector"],
        "the stash is untouched"
    );

    // Once excluded (a re-invocation), it passes unchanged.
    let (again, same) = judged_excluding(after.clone(), &Policy::default());
    assert_eq!(again.verdict, Verdict::Unchanged);
    assert_eq!(same, after);

    // Without required affinity: one term holding only the exclusion, in a new affinity.
    let mut bare_spec = opted_in(json!({"containers": containers()}));
    bare_spec["metadata"]["annotations"] = json!({"clusterSelector": "{}"});
    let (_, after) = judged_excluding(owned_by(bare_spec, "rs-uid"), &Policy::default());
    assert_eq!(
        after.pointer(TERMS).unwrap(),
        &json!([{"matchExpressions": [not_in]}])
    );

    // Another workload, a bare pod, a pod pinned by its volume: nothing to add.
    let mut pinned = owned_by(stashed.clone(), "rs-uid");
    pinned["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        [0]["matchFields"] = json!([{"key": "metadata.name", "operator": "In", "values": ["vn-a"]}]);
    for object in [owned_by(stashed.clone(), "other-uid"), stashed, pinned] {
        let (outcome, _) = judged_excluding(object, &Policy::default());
        assert_eq!(outcome.verdict, Verdict::Unchanged);
    }
}

#[test]
fn a_template_copied_from_an_excluded_pod_gets_the_current_exclusion_not_the_stale_one() {
    // A pod as the webhook wrote it while its workload avoided vn-a and vn-c, copied into a
    // template of a workload whose record now avoids nothing: the old exclusion goes.
    let (_, stashed) = run(opted_in(full_spec()), &Policy::default());
    let (_, excluded) = judged_excluding(owned_by(stashed.clone(), "rs-uid"), &Policy::default());
    let (outcome, after) = judged_excluding(owned_by(excluded.clone(), "other-uid"), &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert!(
        after["metadata"]["annotations"]
            .get("tensile.io/excluded-nodes")
            .is_none(),
        "{}",
        after["metadata"]
    );
    assert_eq!(
        after.pointer(TERMS),
        stashed.pointer(TERMS),
        "the user's own terms are back as they were"
    );

    // A pod with no required terms of its own: the term the exclusion made goes with it.
    let mut plain = opted_in(json!({"containers": containers()}));
    plain["metadata"]["annotations"] = json!({"clusterSelector": "{}"});
    let (_, excluded) = judged_excluding(owned_by(plain, "rs-uid"), &Policy::default());
    assert!(excluded.pointer(TERMS).is_some());
    let (_, after) = judged_excluding(owned_by(excluded, "other-uid"), &Policy::default());
    assert!(
        after["spec"]["affinity"]["nodeAffinity"]
            .get("requiredDuringSchedulingIgnoredDuringExecution")
            .is_none(),
        "{}",
        after["spec"]
    );

    // A copy whose stale exclusion names other nodes than the record: the record's replaces it.
    let mut stale = owned_by(stashed, "rs-uid");
    stale["metadata"]["annotations"]["tensile.io/excluded-nodes"] = json!("vn-z");
    for term in stale.pointer_mut(TERMS).unwrap().as_array_mut().unwrap() {
        term["matchExpressions"].as_array_mut().unwrap().push(
            json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vn-z", "vn-user"]}),
        );
    }
    let (_, after) = judged_excluding(stale, &Policy::default());
    assert_eq!(
        after["metadata"]["annotations"]["tensile.io/excluded-nodes"],
        "vn-a,vn-c"
    );
    for term in after.pointer(TERMS).unwrap().as_array().unwrap() {
        let text = term.to_string();
        assert!(!text.contains("vn-z"), "{text}");
        assert!(
            text.contains("vn-user"),
            "the user's own NotIn value stays: {text}"
        );
        assert!(text.contains("vn-c"), "{text}");
    }
}

#[test]
fn a_pod_written_with_its_stash_is_signed_for_itself_not_for_its_original() {
    let (policy, keys) = signing();
    // A bare pod signed for its name, then copied under another name (a descheduler move).
    let (_, original) = run(
        opted_in(json!({"containers": containers(), "tolerations": [{"key": "gpu", "operator": "Exists"}]})),
        &policy,
    );
    assert_eq!(keys.check(&metadata(&original)), Ok(()));
    let mut moved = original.clone();
    moved["metadata"]["name"] = json!("p-abcde");
    assert!(
        keys.check(&metadata(&moved)).is_err(),
        "the copy's signature is its original's"
    );
    let (outcome, after) = run(moved, &policy);
    assert_eq!(outcome.verdict, Verdict::Mutated);
    assert_eq!(keys.check(&metadata(&after)), Ok(()), "signed for its own name");
    assert_eq!(
        after["metadata"]["annotations"][names::CLUSTER_SELECTOR],
        original["metadata"]["annotations"][names::CLUSTER_SELECTOR],
        "the stash itself is untouched"
    );
    // A re-invocation, or a pod whose signature already holds: nothing to change.
    let (outcome, _) = run(after, &policy);
    assert_eq!(outcome.verdict, Verdict::Unchanged);
    // Without a key a written stash passes as it is.
    let mut unsigned = original.clone();
    unsigned["metadata"]["name"] = json!("p-fghij");
    let (outcome, _) = run(unsigned, &Policy::default());
    assert_eq!(outcome.verdict, Verdict::Unchanged);
}
