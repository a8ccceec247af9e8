//! Property tests over generated pods and garbage: the webhook never panics, never returns a
//! patch that breaks the pod or touches a member it does not own, moves exactly what it
//! should, and is idempotent.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::{BTreeMap, BTreeSet};

use json_patch::Patch;
use k8s_openapi::api::core::v1::{NodeAffinity, Pod, Toleration};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use proptest::prelude::*;
use serde_json::{Value, json};
use tensile_common::stash::Stash;
use tensile_webhook::review::{self, Review, ReviewError};
use tensile_webhook::{Label, Policy, Verdict, VirtualNodeConstraint, mutate};

const KEYS: &[&str] = &["zone", "disk", "region", "cluster", "tensile.io/x~y", "type"];

fn key() -> impl Strategy<Value = String> {
    prop::sample::select(KEYS).prop_map(str::to_owned)
}

fn small_map() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(key(), "[a-z0-9]{0,4}", 0..4)
}

fn requirement(field: bool) -> impl Strategy<Value = Value> {
    let key = if field {
        Just("metadata.name".to_owned()).boxed()
    } else {
        key().boxed()
    };
    (
        key,
        prop::sample::select(&["In", "NotIn", "Exists", "DoesNotExist", "Gt"][..]),
        prop::collection::vec("[a-z0-9]{1,3}", 0..3),
    )
        .prop_map(|(k, op, values)| {
            if values.is_empty() {
                json!({"key": k, "operator": op})
            } else {
                json!({"key": k, "operator": op, "values": values})
            }
        })
}

fn term() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(requirement(false), 0..3),
        prop::collection::vec(requirement(true), 0..2),
    )
        .prop_map(|(e, f)| {
            let mut t = serde_json::Map::new();
            if !e.is_empty() {
                t.insert("matchExpressions".into(), json!(e));
            }
            if !f.is_empty() {
                t.insert("matchFields".into(), json!(f));
            }
            Value::Object(t)
        })
}

fn affinity() -> impl Strategy<Value = Option<Value>> {
    let required = prop::option::of(prop::collection::vec(term(), 1..4));
    let preferred = prop::option::of(prop::collection::vec(
        (1..100i32, term()).prop_map(|(w, t)| json!({"weight": w, "preference": t})),
        1..3,
    ));
    let pod_affinity = any::<bool>();
    prop::option::of((required, preferred, pod_affinity).prop_map(|(r, p, pa)| {
        let mut na = serde_json::Map::new();
        if let Some(r) = r {
            na.insert(
                "requiredDuringSchedulingIgnoredDuringExecution".into(),
                json!({"nodeSelectorTerms": r}),
            );
        }
        if let Some(p) = p {
            na.insert("preferredDuringSchedulingIgnoredDuringExecution".into(), json!(p));
        }
        let mut a = json!({"nodeAffinity": na});
        if pa {
            a["podAffinity"] = json!({"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "zone"}]});
        }
        a
    }))
}

fn toleration() -> impl Strategy<Value = Value> {
    (
        key(),
        prop::option::of("[a-z]{1,3}"),
        prop::sample::select(&["NoSchedule", "NoExecute", "PreferNoSchedule"][..]),
        prop::option::of(0..1000i64),
    )
        .prop_map(|(k, v, effect, secs)| {
            let mut t = json!({"key": k, "effect": effect});
            match v {
                Some(v) => {
                    t["operator"] = json!("Equal");
                    t["value"] = json!(v);
                }
                None => t["operator"] = json!("Exists"),
            }
            if let (Some(s), "NoExecute") = (secs, effect) {
                t["tolerationSeconds"] = json!(s);
            }
            t
        })
}

/// A pod as the apiserver would send it, sometimes with explicit nulls.
fn pod() -> impl Strategy<Value = (Value, bool)> {
    (
        any::<bool>(),
        prop::option::of(small_map()),
        prop::option::of(small_map()),
        prop::option::of(prop::option::of(small_map())),
        affinity(),
        prop::option::of(prop::collection::vec(toleration(), 0..4)),
        prop::collection::vec(prop::sample::select(&["data", "cache", "logs"][..]), 0..3),
    )
        .prop_map(
            |(opted_in, labels, annotations, selector, affinity, tolerations, claims)| {
                let mut labels = labels.unwrap_or_default();
                if opted_in {
                    labels.insert("virtual-pod".into(), "true".into());
                } else {
                    labels.remove("virtual-pod");
                }
                let mut meta = json!({"name": "p", "namespace": "team", "labels": labels});
                if let Some(a) = annotations {
                    meta["annotations"] = json!(a);
                }
                let mut spec =
                    json!({"containers": [{"name": "c", "image": "busybox"}], "restartPolicy": "Always"});
                match selector {
                    Some(Some(s)) => spec["nodeSelector"] = json!(s),
                    Some(None) => spec["nodeSelector"] = Value::Null,
                    None => {}
                }
                if let Some(a) = affinity {
                    spec["affinity"] = a;
                }
                if let Some(t) = tolerations {
                    spec["tolerations"] = json!(t);
                }
                if !claims.is_empty() {
                    let volumes: Vec<Value> = claims
                    .iter()
                    .enumerate()
                    .map(|(i, c)| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": c}}))
                    .collect();
                    spec["volumes"] = json!(volumes);
                }
                (
                    json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}),
                    opted_in,
                )
            },
        )
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        prop::collection::btree_set(key(), 0..3),
        prop::sample::select(
            &[
                VirtualNodeConstraint::Affinity,
                VirtualNodeConstraint::NodeSelector,
                VirtualNodeConstraint::None,
            ][..],
        ),
        0..600i64,
        0..600i64,
    )
        .prop_map(|(ignore, constraint, nr, ur)| Policy {
            ignore_selector_keys: ignore,
            virtual_node_constraint: constraint,
            not_ready_seconds: nr,
            unreachable_seconds: ur,
            virtual_node_label: Label::new("type", "virtual-kubelet"),
            ..Policy::default()
        })
}

fn claims() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(
        prop::sample::select(&["data", "cache", "logs"][..]).prop_map(str::to_owned),
        prop::sample::select(&["vnode-a", "vnode-b"][..]).prop_map(str::to_owned),
        0..2,
    )
}

fn review_of(object: &Value) -> Review {
    let body = json!({
        "apiVersion": review::API_VERSION, "kind": review::KIND,
        "request": {
            "uid": "u", "operation": "CREATE", "namespace": "team", "userInfo": {},
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": object,
        }
    });
    review::parse(&serde_json::to_vec(&body).unwrap()).unwrap()
}

fn apply(object: &Value, bytes: &[u8]) -> Value {
    let patch: Patch = serde_json::from_slice(bytes).expect("the patch is JSON Patch");
    let mut doc = object.clone();
    json_patch::patch(&mut doc, &patch).expect("the patch applies to the pod it was made for");
    doc
}

/// Whether the members a patch may write decode with their API types, the stash included.
fn written_members_decode(pod: &Value) -> bool {
    fn decodes<T: serde::de::DeserializeOwned>(pod: &Value, at: &str) -> bool {
        pod.pointer(at)
            .is_none_or(|v| serde_json::from_value::<Option<T>>(v.clone()).is_ok())
    }
    let stash = pod["metadata"]["annotations"]["clusterSelector"].as_str();
    decodes::<BTreeMap<String, String>>(pod, "/metadata/annotations")
        && decodes::<BTreeMap<String, String>>(pod, "/spec/nodeSelector")
        && decodes::<NodeAffinity>(pod, "/spec/affinity/nodeAffinity")
        && decodes::<Vec<Toleration>>(pod, "/spec/tolerations")
        && stash.is_some_and(|text| Stash::decode(text).is_ok())
}

/// `pod` without the members a patch may write: what must be the same before and after.
fn unwritten(pod: &Value) -> Value {
    let mut pod = pod.clone();
    if let Some(meta) = pod.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("annotations");
    }
    if let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) {
        spec.remove("nodeSelector");
        spec.remove("tolerations");
        if let Some(affinity) = spec.get_mut("affinity").and_then(Value::as_object_mut) {
            affinity.remove("nodeAffinity");
        }
        // A `null` or empty affinity is the absent one that a patch may fill in.
        if spec
            .get("affinity")
            .is_some_and(|a| a.is_null() || a.as_object().is_some_and(serde_json::Map::is_empty))
        {
            spec.remove("affinity");
        }
    }
    pod
}

/// What the lower side of the required terms should be.
fn expected_lower_terms(object: &Value, keep: &BTreeSet<String>) -> Option<Value> {
    let terms = object.pointer(
        "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms",
    )?;
    let mut out = Vec::new();
    for t in terms.as_array()? {
        let mut lower = serde_json::Map::new();
        for part in ["matchExpressions", "matchFields"] {
            let reqs: Vec<Value> = t
                .get(part)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|r| !keep.contains(r["key"].as_str().unwrap_or_default()))
                .cloned()
                .collect();
            if !reqs.is_empty() {
                lower.insert(part.into(), json!(reqs));
            }
        }
        if lower.is_empty() {
            return None;
        }
        out.push(Value::Object(lower));
    }
    (!out.is_empty()).then(|| json!(out))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn generated_pods_are_mutated_soundly_and_once((object, opted_in) in pod(), policy in policy(), claims in claims()) {
        let review = review_of(&object);
        let outcome = mutate(&review, &policy, &claims);
        prop_assert_eq!(&outcome.response.uid, "u");
        if !opted_in {
            prop_assert_eq!(outcome.verdict, Verdict::Unchanged);
            prop_assert!(outcome.response.patch.is_none());
            return Ok(());
        }
        let pins: BTreeSet<&String> = object["spec"]["volumes"].as_array().into_iter().flatten()
            .filter_map(|v| claims.get(v["persistentVolumeClaim"]["claimName"].as_str()?))
            .collect();
        if pins.len() > 1 {
            prop_assert_eq!(outcome.verdict, Verdict::Denied);
            prop_assert!(!outcome.response.allowed);
            return Ok(());
        }
        prop_assert_eq!(outcome.verdict, Verdict::Mutated, "{:?}", outcome.response.result);
        let after = apply(&object, outcome.response.patch.as_deref().unwrap());
        let pod: Pod = serde_json::from_value(after.clone()).expect("still a Pod");
        let spec = pod.spec.clone().unwrap();

        // The stash holds exactly what moved.
        let stash = Stash::from_annotations(pod.metadata.annotations.as_ref()).unwrap().expect("stash written");
        let keep = &policy.ignore_selector_keys;
        let selector: BTreeMap<String, String> = serde_json::from_value(
            object["spec"].get("nodeSelector").cloned().filter(|v| !v.is_null()).unwrap_or(json!({}))).unwrap();
        let (kept, moved): (BTreeMap<_, _>, BTreeMap<_, _>) = selector.into_iter().partition(|(k, _)| keep.contains(k));
        prop_assert_eq!(&stash.node_selector, &moved);
        let tolerations = object["spec"].get("tolerations").cloned().unwrap_or(json!([]));
        prop_assert_eq!(serde_json::to_value(&stash.tolerations).unwrap(), tolerations);
        let lower_terms = stash.node_affinity()
            .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
            .map(|r| serde_json::to_value(&r.node_selector_terms).unwrap());
        prop_assert_eq!(lower_terms, expected_lower_terms(&object, keep));
        prop_assert!(stash.node_affinity().is_none_or(|na| na.preferred_during_scheduling_ignored_during_execution.is_none()));

        // The upper pod keeps ignored keys, gains the virtual-node constraints, loses the rest.
        let mut want_selector = kept.clone();
        if policy.virtual_node_constraint == VirtualNodeConstraint::NodeSelector {
            want_selector.insert("type".into(), "virtual-kubelet".into());
        }
        prop_assert_eq!(spec.node_selector.clone().unwrap_or_default(), want_selector);
        let upper_tolerations = spec.tolerations.clone().unwrap();
        prop_assert_eq!(upper_tolerations.len(), 3);
        prop_assert_eq!(upper_tolerations[0].key.as_deref(), Some("virtual-kubelet.io/provider"));
        prop_assert_eq!(upper_tolerations[1].toleration_seconds, Some(policy.not_ready_seconds));
        prop_assert_eq!(upper_tolerations[2].toleration_seconds, Some(policy.unreachable_seconds));
        let upper_terms = spec.affinity.as_ref().and_then(|a| a.node_affinity.as_ref())
            .and_then(|na| na.required_during_scheduling_ignored_during_execution.as_ref())
            .map(|r| r.node_selector_terms.clone()).unwrap_or_default();
        for t in &upper_terms {
            for r in t.match_expressions.iter().flatten() {
                prop_assert!(keep.contains(&r.key) || r.key == "type", "lower key {} left upstream", r.key);
            }
            if policy.virtual_node_constraint == VirtualNodeConstraint::Affinity {
                prop_assert!(t.match_expressions.iter().flatten().any(|r| r.key == "type" && r.values.as_deref() == Some(&["virtual-kubelet".to_owned()][..])));
            }
            if let Some(node) = pins.iter().next() {
                prop_assert!(t.match_fields.iter().flatten().any(|r| r.key == "metadata.name" && r.values.as_deref() == Some(&[(*node).clone()][..])));
            }
        }
        if policy.virtual_node_constraint == VirtualNodeConstraint::Affinity || !pins.is_empty() {
            prop_assert!(!upper_terms.is_empty());
        }
        prop_assert_eq!(
            after["spec"]["affinity"]["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution"),
            object["spec"]["affinity"]["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution")
        );
        prop_assert_eq!(after["spec"]["affinity"].get("podAffinity"), object["spec"]["affinity"].get("podAffinity"));
        // Nothing else changed.
        for field in ["containers", "restartPolicy", "volumes"] {
            prop_assert_eq!(after["spec"].get(field), object["spec"].get(field));
        }
        prop_assert_eq!(&after["metadata"]["labels"], &object["metadata"]["labels"]);
        for (k, v) in object["metadata"]["annotations"].as_object().into_iter().flatten() {
            prop_assert_eq!(after["metadata"]["annotations"].get(k), Some(v));
        }

        // A second pass changes nothing.
        let again = mutate(&review_of(&after), &policy, &claims);
        prop_assert_eq!(again.verdict, Verdict::Unchanged);
        prop_assert!(again.response.patch.is_none());
    }

    #[test]
    fn arbitrary_objects_never_yield_a_corrupting_patch(object in arb_json(), opted_in in any::<bool>()) {
        let mut object = object;
        if opted_in && let Some(m) = object.as_object_mut() {
            m.insert("metadata".into(), json!({"labels": {"virtual-pod": "true"}}));
        }
        let review = review_of(&object);
        let outcome = mutate(&review, &Policy::default(), &BTreeMap::new());
        if let Some(bytes) = &outcome.response.patch {
            let after = apply(&object, bytes);
            if serde_json::from_value::<Pod>(object.clone()).is_ok() {
                prop_assert!(serde_json::from_value::<Pod>(after.clone()).is_ok());
            }
            prop_assert!(written_members_decode(&after), "{after}");
            prop_assert_eq!(unwritten(&after), unwritten(&object));
        }
        if outcome.verdict == Verdict::Denied {
            prop_assert!(!outcome.response.result.message.is_empty());
        }
    }

    #[test]
    fn garbage_in_members_the_webhook_does_not_read_changes_nothing(
        (object, _) in pod(),
        policy in policy(),
        claims in claims(),
        at in prop::sample::select(&["", "/metadata", "/spec", "/spec/containers/0"][..]),
        name in prop::sample::select(&["containers", "status", "priority", "ownerReferences", "x"][..]),
        garbage in arb_json(),
    ) {
        let clean = mutate(&review_of(&object), &policy, &claims);
        let mut dirty = object.clone();
        if let Some(parent) = dirty.pointer_mut(at).and_then(Value::as_object_mut) {
            parent.insert(name.to_owned(), garbage.clone());
        }
        let outcome = mutate(&review_of(&dirty), &policy, &claims);
        prop_assert_eq!(outcome.verdict, clean.verdict);
        prop_assert_eq!(&outcome.response.patch, &clean.response.patch);
        prop_assert_eq!(&outcome.response.result.message, &clean.response.result.message);
        if let Some(bytes) = &outcome.response.patch {
            let after = apply(&dirty, bytes);
            prop_assert_eq!(after.pointer(at).and_then(|p| p.get(name)), Some(&garbage));
            prop_assert_eq!(unwritten(&after), unwritten(&dirty));
        }
    }

    #[test]
    fn reviews_read_as_decoding_the_whole_review_reads_them(body in review_body()) {
        let bytes = serde_json::to_vec(&body).unwrap();
        match (review::parse(&bytes), decoded_whole(&bytes)) {
            (Ok(review), Ok((request, object))) => {
                prop_assert_eq!(&review.request.uid, &request.uid);
                prop_assert_eq!(&review.request.kind, &request.kind);
                prop_assert_eq!(&review.request.resource, &request.resource);
                prop_assert_eq!(&review.request.sub_resource, &request.sub_resource);
                prop_assert_eq!(&review.request.request_kind, &request.request_kind);
                prop_assert_eq!(&review.request.name, &request.name);
                prop_assert_eq!(&review.request.namespace, &request.namespace);
                prop_assert_eq!(&review.request.operation, &request.operation);
                prop_assert_eq!(&review.request.user_info, &request.user_info);
                prop_assert_eq!(review.request.dry_run, request.dry_run);
                prop_assert_eq!(&review.request.options, &request.options);
                prop_assert_eq!(&review.request.types, &request.types);
                let raw = review.object.map(|o| serde_json::from_str::<Value>(o.get()).unwrap());
                prop_assert_eq!(raw, object);
            }
            (Err(split), Err(whole)) => prop_assert_eq!(split, whole),
            (split, whole) => prop_assert!(false, "split: {:?}\nwhole: {:?}", split.err(), whole.err()),
        }
    }

    #[test]
    fn arbitrary_bodies_are_answered_or_refused_without_panic(body in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = review::parse(&body);
    }

    #[test]
    fn arbitrary_json_bodies_are_answered_or_refused_without_panic(body in arb_json()) {
        let _ = review::parse(&serde_json::to_vec(&body).unwrap());
        let wrapped = json!({"apiVersion": review::API_VERSION, "kind": review::KIND, "request": body});
        if let Ok(review) = review::parse(&serde_json::to_vec(&wrapped).unwrap()) {
            let _ = mutate(&review, &Policy::default(), &BTreeMap::new());
        }
    }
}

/// A review read the plain way: the whole body parsed into a tree, the objects set aside,
/// the rest decoded as `AdmissionReview`. [`review::parse`] reads only what it needs and must
/// come to the same request, object and errors.
fn decoded_whole(body: &[u8]) -> Result<(AdmissionRequest<DynamicObject>, Option<Value>), ReviewError> {
    let mut value: Value = serde_json::from_slice(body).map_err(|e| ReviewError::Json(e.to_string()))?;
    let Some(envelope) = value.as_object_mut() else {
        return Err(ReviewError::NotAReview("not a JSON object".into()));
    };
    let text = |key| {
        envelope
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let (api_version, kind) = (text("apiVersion"), text("kind"));
    if api_version != review::API_VERSION || kind != review::KIND {
        return Err(ReviewError::NotAReview(format!(
            "apiVersion {api_version:?}, kind {kind:?}"
        )));
    }
    let request = match envelope.get_mut("request") {
        Some(Value::Object(request)) => request,
        Some(Value::Null) | None => return Err(ReviewError::NoRequest),
        Some(_) => return Err(ReviewError::Request("request is not an object".into())),
    };
    let object = request.remove("object").filter(|o| !o.is_null());
    request.remove("oldObject");
    let whole: AdmissionReview<DynamicObject> =
        serde_json::from_value(value).map_err(|e| ReviewError::Request(e.to_string()))?;
    let request = whole.try_into().map_err(|_| ReviewError::NoRequest)?;
    Ok((request, object))
}

const REQUEST_KEYS: &[&str] = &[
    "uid",
    "kind",
    "resource",
    "subResource",
    "requestKind",
    "name",
    "namespace",
    "operation",
    "userInfo",
    "object",
    "oldObject",
    "dryRun",
    "options",
];

/// Reviews around a well-formed one: members of the request replaced by arbitrary JSON or
/// removed, and the envelope bent now and then.
fn review_body() -> impl Strategy<Value = Value> {
    let key = prop::sample::select(REQUEST_KEYS);
    (
        prop::collection::btree_map(key.clone(), arb_json(), 0..3),
        prop::collection::vec(key, 0..3),
        0..10u8,
        arb_json(),
    )
        .prop_map(|(replaced, removed, shape, other)| {
            let mut request = json!({
                "uid": "u", "operation": "CREATE", "namespace": "team", "name": "p",
                "userInfo": {"username": "someone", "groups": ["a"]},
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": {"metadata": {"labels": {"virtual-pod": "true"}}},
                "oldObject": null, "dryRun": false,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
            });
            if let Some(members) = request.as_object_mut() {
                for key in removed {
                    members.remove(key);
                }
                for (key, value) in replaced {
                    members.insert(key.to_owned(), value);
                }
            }
            let mut body =
                json!({"apiVersion": review::API_VERSION, "kind": review::KIND, "request": request});
            match shape {
                0 => body["apiVersion"] = json!("admission.k8s.io/v1beta1"),
                1 => body["kind"] = other,
                2 => body["request"] = other,
                3 => body["response"] = other,
                4 => body["response"] = json!({"uid": "u", "allowed": true, "status": {}}),
                5 => body["unrelated"] = other,
                6 => body = other,
                _ => {}
            }
            body
        })
}

/// Arbitrary JSON, biased towards pod-shaped keys so that decoding gets deep.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-zA-Z0-9/~.-]{0,6}".prop_map(Value::String),
    ];
    let names = prop::sample::select(
        &[
            "apiVersion",
            "kind",
            "metadata",
            "spec",
            "labels",
            "annotations",
            "clusterSelector",
            "containers",
            "nodeSelector",
            "affinity",
            "nodeAffinity",
            "tolerations",
            "volumes",
            "name",
            "x",
        ][..],
    );
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(names.clone().prop_map(str::to_owned), inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
