//! Eviction through the `pods/eviction` subresource, with a UID precondition.
//!
//! The body is written by hand, without `apiVersion` and `kind`: the apiserver then decodes
//! it as the subresource's default kind, `policy/v1beta1` on 1.20 (which has no `policy/v1`
//! Eviction) and either version from 1.22 on. kube's `Api::evict` cannot carry the
//! precondition: it sends the delete options under a snake_case key the apiserver drops.
//! With the precondition, a pod recreated under the same name meanwhile is never evicted by
//! mistake.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// What an eviction found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is being deleted (gracefully) and its owner recreates it.
    Accepted,
    /// Nothing of that UID is left: the pod is gone (404) or the name holds another pod (409).
    Gone,
    /// Refused for now (429: a disruption budget, which does not apply to Pending pods, or
    /// the apiserver's throttle); retried next round.
    Refused(String),
}

/// The eviction body for pod `namespace/name` with UID `uid`.
pub fn body(namespace: &str, name: &str, uid: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": {"preconditions": {"uid": uid}},
    })
}

/// Evicts the pod `name` of `api`'s namespace if its UID is still `uid`.
pub async fn evict(api: &Api<Pod>, namespace: &str, name: &str, uid: &str) -> Result<Evicted, kube::Error> {
    let result = api
        .create_subresource::<Value, Value>(
            "eviction",
            name,
            &PostParams::default(),
            &body(namespace, name, uid),
        )
        .await;
    match result {
        Ok(_) => Ok(Evicted::Accepted),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Evicted::Gone),
        Err(kube::Error::Api(s)) if s.code == 429 => Ok(Evicted::Refused(s.message)),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_names_no_version_and_carries_the_uid_precondition_in_camel_case() {
        let b = body("shop", "web-1", "u-1");
        assert!(b.get("apiVersion").is_none() && b.get("kind").is_none());
        assert_eq!(b["deleteOptions"]["preconditions"]["uid"], "u-1");
        assert_eq!(b["metadata"]["namespace"], "shop");
    }
}
