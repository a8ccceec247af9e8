//! Reading an `AdmissionReview` body and writing the answer.
//!
//! The review is read in two steps so that a pod which does not decode still gets an
//! answer carrying the request's `uid`: the envelope must be a well-formed
//! `admission.k8s.io/v1` review (otherwise the caller gets a 400), while the object is kept
//! as raw JSON and judged by the `mutate` module.
//!
//! The body is read in one pass that keeps the pod as text ([`crate::raw`]): the pod, most
//! of the body, is decoded once, by the `mutate` module, and never parsed into a tree. The
//! errors are the ones decoding the whole review as `AdmissionReview` gives.

use std::collections::HashMap;

use base64::Engine as _;
use kube::core::admission::{AdmissionRequest, AdmissionResponse};
use kube::core::{DynamicObject, Status, TypeMeta};
use serde::de::value::MapDeserializer;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::raw::{self, Level};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// Why a body is not a review this webhook can answer; each maps to a 400.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    #[error("body is not JSON: {0}")]
    Json(String),
    #[error("body is not an {API_VERSION} {KIND}: {0}")]
    NotAReview(String),
    #[error("the {KIND} has no request")]
    NoRequest,
    #[error("the {KIND}'s request is malformed: {0}")]
    Request(String),
}

/// A review request with its object kept as raw JSON.
#[derive(Clone, Debug)]
pub struct Review {
    /// The request without its objects (`object` and `old_object` are `None`).
    pub request: AdmissionRequest<DynamicObject>,
    /// `request.object`, `None` when absent or null.
    pub object: Option<Box<RawValue>>,
}

/// The body split in one pass: the members the review needs as raw text, and `request` one
/// level further, so that the pod inside is scanned once. A repeated member: the last one
/// counts, as in a parsed `Value`.
#[derive(Default)]
struct Envelope<'a> {
    api_version: Option<&'a RawValue>,
    kind: Option<&'a RawValue>,
    request: Option<Level<'a>>,
    response: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Envelope<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Envelope<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut envelope = Envelope::default();
                while let Some(key) = map.next_key::<raw::Text<'de>>()? {
                    match key.0.as_ref() {
                        "apiVersion" => envelope.api_version = Some(map.next_value()?),
                        "kind" => envelope.kind = Some(map.next_value()?),
                        "request" => envelope.request = Some(map.next_value()?),
                        "response" => envelope.response = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(envelope)
            }
        }
        deserializer.deserialize_map(V)
    }
}

/// A decoding error without its position: the position is in a part of the body, not in
/// the body, so it would mislead.
pub(crate) fn message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let at = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&at) {
        Some(bare) if e.line() > 0 => bare.to_owned(),
        _ => text,
    }
}

pub fn parse(body: &[u8]) -> Result<Review, ReviewError> {
    let json = |e: serde_json::Error| ReviewError::Json(e.to_string());
    let first = body.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    if first != Some(&b'{') {
        serde_json::from_slice::<IgnoredAny>(body).map_err(json)?;
        return Err(ReviewError::NotAReview("not a JSON object".into()));
    }
    let envelope: Envelope = serde_json::from_slice(body).map_err(json)?;
    let api_version = envelope.api_version.and_then(raw::string).unwrap_or_default();
    let kind = envelope.kind.and_then(raw::string).unwrap_or_default();
    if api_version != API_VERSION || kind != KIND {
        return Err(ReviewError::NotAReview(format!(
            "apiVersion {api_version:?}, kind {kind:?}"
        )));
    }
    let members = match envelope.request {
        Some(Level::Object(members)) => members,
        Some(Level::Null) | None => return Err(ReviewError::NoRequest),
        Some(_) => return Err(ReviewError::Request("request is not an object".into())),
    };
    // The other members are decoded straight from their text, each once, the last time it
    // occurs, as in a parsed tree. Should that fail, they are decoded again from a tree, so
    // that a malformed request gets the very error decoding the whole review gives.
    let object = members.iter().rev().find(|(k, _)| k == "object").map(|(_, v)| *v);
    let fields = || {
        members
            .iter()
            .enumerate()
            .filter(|(i, (k, _))| {
                k != "object" && k != "oldObject" && !members[i + 1..].iter().any(|(later, _)| later == k)
            })
            .map(|(_, (k, v))| (k.clone(), *v))
    };
    let direct = AdmissionRequest::<DynamicObject>::deserialize(
        MapDeserializer::<_, serde_json::Error>::new(fields()),
    );
    let mut request = match direct {
        Ok(request) => request,
        Err(_) => {
            let mut tree = serde_json::Map::new();
            for (key, value) in fields() {
                tree.insert(key.into_owned(), serde_json::from_str(value.get()).map_err(json)?);
            }
            serde_json::from_value(Value::Object(tree)).map_err(|e| ReviewError::Request(e.to_string()))?
        }
    };
    // An answer in the review is held to its type, as decoding the whole review would.
    if let Some(answer) = envelope.response {
        let answer: Value = serde_json::from_str(answer.get()).map_err(json)?;
        serde_json::from_value::<Option<AdmissionResponse>>(answer)
            .map_err(|e| ReviewError::Request(e.to_string()))?;
    }
    request.types = TypeMeta {
        api_version: API_VERSION.to_owned(),
        kind: KIND.to_owned(),
    };
    let object = object.filter(|o| !raw::is_null(o)).map(ToOwned::to_owned);
    Ok(Review { request, object })
}

/// The response body for `response`: an `admission.k8s.io/v1` review whose patch is
/// base64, the JSON form of the API's `[]byte`.
pub fn encode(response: AdmissionResponse) -> Result<Vec<u8>, serde_json::Error> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Answer {
        uid: String,
        allowed: bool,
        status: Status,
        #[serde(skip_serializing_if = "Option::is_none")]
        patch: Option<Box<RawValue>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        patch_type: Option<&'static str>,
        #[serde(skip_serializing_if = "HashMap::is_empty")]
        audit_annotations: HashMap<String, String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        warnings: Option<Vec<String>>,
    }
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Envelope {
        api_version: String,
        kind: String,
        response: Answer,
    }
    let AdmissionResponse {
        types,
        uid,
        allowed,
        result,
        patch,
        audit_annotations,
        warnings,
        ..
    } = response;
    // Base64 never needs escaping, so the string goes out as it is written.
    let patch = patch
        .map(|p| {
            let mut text = String::with_capacity(p.len().div_ceil(3) * 4 + 2);
            text.push('"');
            base64::engine::general_purpose::STANDARD.encode_string(p, &mut text);
            text.push('"');
            RawValue::from_string(text)
        })
        .transpose()?;
    // Only `with_patch` sets a patch, and its type is always JSONPatch.
    let patch_type = patch.as_ref().map(|_| "JSONPatch");
    let size = 256 + patch.as_ref().map_or(0, |p| p.get().len()) + result.message.len();
    let mut out = Vec::with_capacity(size);
    serde_json::to_writer(
        &mut out,
        &Envelope {
            api_version: types.api_version,
            kind: types.kind,
            response: Answer {
                uid,
                allowed,
                status: result,
                patch,
                patch_type,
                audit_annotations,
                warnings,
            },
        },
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    pub(crate) fn body(request: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request})).unwrap()
    }

    fn request() -> Value {
        json!({
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "default",
            "operation": "CREATE",
            "userInfo": {},
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": "oops"}},
            "oldObject": null,
        })
    }

    #[test]
    fn a_review_keeps_its_object_raw_even_when_the_pod_does_not_decode() {
        let review = parse(&body(request())).unwrap();
        assert_eq!(review.request.uid, "u-1");
        let object: Value = serde_json::from_str(review.object.unwrap().get()).unwrap();
        assert_eq!(object["spec"]["containers"], "oops");
        assert!(review.request.object.is_none());
    }

    #[test]
    fn malformed_bodies_are_told_apart() {
        assert!(matches!(parse(b"{nope"), Err(ReviewError::Json(_))));
        assert!(matches!(parse(b"[]"), Err(ReviewError::NotAReview(_))));
        let v1beta1 = json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND, "request": request()});
        let err = parse(&serde_json::to_vec(&v1beta1).unwrap()).unwrap_err();
        assert!(err.to_string().contains("v1beta1"), "{err}");
        let none = json!({"apiVersion": API_VERSION, "kind": KIND});
        assert_eq!(
            parse(&serde_json::to_vec(&none).unwrap()).unwrap_err(),
            ReviewError::NoRequest
        );
        let mut no_uid = request();
        no_uid.as_object_mut().unwrap().remove("uid");
        let err = parse(&body(no_uid)).unwrap_err();
        assert!(
            matches!(&err, ReviewError::Request(m) if m.contains("uid")),
            "{err}"
        );
        assert!(matches!(parse(&body(json!(3))), Err(ReviewError::Request(_))));
    }

    #[test]
    fn the_answer_is_a_v1_review_with_the_uid() {
        let review = parse(&body(request())).unwrap();
        let answer: Value =
            serde_json::from_slice(&encode(AdmissionResponse::from(&review.request)).unwrap()).unwrap();
        assert_eq!(answer["apiVersion"], API_VERSION);
        assert_eq!(answer["kind"], KIND);
        assert_eq!(answer["response"]["uid"], "u-1");
        assert_eq!(answer["response"]["allowed"], true);
    }

    #[test]
    fn a_repeated_member_counts_the_last_time_as_in_a_parsed_tree() {
        let body = br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": 5,
            "request": {"uid": "first", "u\u0069d": "u-2", "operation": "CREATE", "userInfo": {},
                "kind": {"group": "", "version": "v1", "kind": 1, "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": {"kind": "Pod"}, "object": null, "oldObject": {"never": ["read"]}}}"#;
        let review = parse(body).unwrap();
        assert_eq!(review.request.uid, "u-2");
        assert_eq!(review.request.kind.kind, "Pod");
        assert!(review.object.is_none());
    }

    #[test]
    fn an_answer_inside_the_review_is_held_to_its_type() {
        let mut review = json!({"apiVersion": API_VERSION, "kind": KIND, "request": request()});
        review["response"] = json!({"uid": 5});
        let err = parse(&serde_json::to_vec(&review).unwrap()).unwrap_err();
        assert!(
            matches!(&err, ReviewError::Request(m) if m.contains("expected a string")),
            "{err}"
        );
        review["response"] = Value::Null;
        assert!(parse(&serde_json::to_vec(&review).unwrap()).is_ok());
    }

    #[test]
    fn the_patch_is_sent_in_base64() {
        let review = parse(&body(request())).unwrap();
        let patch = json_patch::Patch(vec![json_patch::PatchOperation::Remove(
            json_patch::RemoveOperation {
                path: json_patch::jsonptr::PointerBuf::from_tokens(["spec", "nodeSelector"]),
            },
        )]);
        let response = AdmissionResponse::from(&review.request)
            .with_patch(patch)
            .unwrap();
        let bytes = response.patch.clone().unwrap();
        let answer: Value = serde_json::from_slice(&encode(response).unwrap()).unwrap();
        let sent = base64::engine::general_purpose::STANDARD
            .decode(answer["response"]["patch"].as_str().unwrap())
            .unwrap();
        assert_eq!(sent, bytes);
        assert_eq!(answer["response"]["patchType"], "JSONPatch");
        assert_eq!(answer["response"]["status"], json!({}));
    }
}
