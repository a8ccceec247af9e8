//! Reading an `AdmissionReview` body and writing the answer.
//!
//! The review is read in two steps so that a pod which does not decode still gets an
//! answer carrying the request's `uid`: the envelope must be a well-formed
//! `admission.k8s.io/v1` review (otherwise the caller gets a 400), while the object is kept
//! as raw JSON and judged by [`crate::mutate`].

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use serde_json::Value;

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
    pub request: AdmissionRequest<DynamicObject>,
    /// `request.object`, `None` when absent or null.
    pub object: Option<Value>,
}

pub fn parse(body: &[u8]) -> Result<Review, ReviewError> {
    let mut value: Value = serde_json::from_slice(body).map_err(|e| ReviewError::Json(e.to_string()))?;
    let Some(envelope) = value.as_object_mut() else {
        return Err(ReviewError::NotAReview("not a JSON object".into()));
    };
    let api_version = envelope
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = envelope.get("kind").and_then(Value::as_str).unwrap_or_default();
    if api_version != API_VERSION || kind != KIND {
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
    // The old object is never used (only CREATE is mutated) and may not decode either.
    request.remove("oldObject");
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(value).map_err(|e| ReviewError::Request(e.to_string()))?;
    let request: AdmissionRequest<DynamicObject> = review.try_into().map_err(|_| ReviewError::NoRequest)?;
    Ok(Review { request, object })
}

/// The response body for `response`.
pub fn encode(response: AdmissionResponse) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&response.into_review())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        assert_eq!(review.object.unwrap()["spec"]["containers"], "oops");
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
}
