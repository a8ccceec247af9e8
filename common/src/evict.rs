//! Eviction through the `pods/eviction` subresource, with UID and resourceVersion
//! preconditions.
//!
//! The body is a `policy/v1` Eviction, the version every supported release serves, written
//! by hand because kube's `Api::evict` cannot carry the precondition: it sends the delete options under a snake_case key the apiserver drops.
//! With the UID, a pod recreated under the same name meanwhile is never evicted by mistake;
//! with the resourceVersion, neither is the pod if it changed since it was judged (placed
//! below meanwhile, say): the eviction then fails with 409 and the next round judges it
//! again.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// What an eviction found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is being deleted (gracefully) and its owner recreates it.
    Accepted,
    /// Nothing of that name is left (404).
    Gone,
    /// The pod is not the one judged (409): it changed since (another resourceVersion), or
    /// the name holds another pod (another UID). The next round judges what is there.
    Changed(String),
    /// Refused for now (429: a disruption budget, which does not apply to Pending pods, or
    /// the apiserver's throttle); retried next round.
    Refused(String),
}

/// The eviction body for `pod` as it was judged: its name, UID and resourceVersion.
pub fn body(pod: &Pod) -> Value {
    let meta = &pod.metadata;
    let mut preconditions = json!({"uid": meta.uid.as_deref().unwrap_or_default()});
    if let Some(rv) = meta.resource_version.as_deref() {
        preconditions["resourceVersion"] = json!(rv);
    }
    json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": meta.name.as_deref().unwrap_or_default(), "namespace": meta.namespace.as_deref().unwrap_or_default()},
        "deleteOptions": {"preconditions": preconditions},
    })
}

/// Evicts `pod` (its namespace in `api`) if it is still the object judged: same UID, same
/// resourceVersion.
pub async fn evict(api: &Api<Pod>, pod: &Pod) -> Result<Evicted, kube::Error> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let result = api
        .create_subresource::<Value, Value>("eviction", name, &PostParams::default(), &body(pod))
        .await;
    match result {
        Ok(_) => Ok(Evicted::Accepted),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Evicted::Gone),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Evicted::Changed(s.message)),
        Err(kube::Error::Api(s)) if s.code == 429 => Ok(Evicted::Refused(s.message)),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "4711"},
        }))
        .unwrap()
    }

    #[test]
    fn the_body_is_a_policy_v1_eviction_with_the_uid_precondition_in_camel_case() {
        let b = body(&pod());
        assert_eq!(
            (&b["apiVersion"], &b["kind"]),
            (&json!("policy/v1"), &json!("Eviction"))
        );
        assert_eq!(b["deleteOptions"]["preconditions"]["uid"], "u-1");
        assert_eq!(b["metadata"]["namespace"], "shop");
        assert_eq!(b["metadata"]["name"], "web-1");
    }

    #[test]
    fn the_body_also_requires_the_resource_version_the_pod_was_judged_at() {
        let b = body(&pod());
        assert_eq!(
            b["deleteOptions"]["preconditions"],
            json!({"uid": "u-1", "resourceVersion": "4711"})
        );
    }
}
