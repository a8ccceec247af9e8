//! What the webhook answers a review: allowed as it is, allowed with a patch, or denied,
//! with the verdict its metrics and logs count. Pods and Jobs are answered
//! alike.

use json_patch::Patch;
use kube::core::admission::AdmissionResponse;

use crate::review::Review;

/// What happened to a review, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed as it is (not ours to change, or already stashed).
    Unchanged,
    Mutated,
    Denied,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Unchanged => "unchanged",
            Verdict::Mutated => "mutated",
            Verdict::Denied => "denied",
        }
    }
}

/// The answer to a review and its verdict.
#[derive(Debug)]
pub struct Outcome {
    pub response: AdmissionResponse,
    pub verdict: Verdict,
}

/// The review allowed with `patch` (JSON patch text).
pub(crate) fn patched(review: &Review, patch: Vec<u8>, warnings: Vec<String>) -> Outcome {
    // `with_patch` is the only way to set the patch type; the patch itself is written
    // straight from the typed values.
    match allow(review).with_patch(Patch::default()) {
        Ok(mut response) => {
            response.patch = Some(patch);
            if !warnings.is_empty() {
                response.warnings = Some(warnings);
            }
            Outcome {
                response,
                verdict: Verdict::Mutated,
            }
        }
        Err(e) => deny(review, format!("cannot encode the patch: {e}")),
    }
}

/// The review allowed as it is.
pub(crate) fn allow(review: &Review) -> AdmissionResponse {
    AdmissionResponse::from(&review.request)
}

/// The review denied, saying why.
pub(crate) fn deny(review: &Review, message: String) -> Outcome {
    Outcome {
        response: allow(review).deny(format!("tensile webhook: {message}")),
        verdict: Verdict::Denied,
    }
}
