//! Writing a pod's lower Secret of upper credentials ([`crate::decide::credentials`]): only
//! this node's for that pod is ever replaced, at the version seen.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use tensile_common::lower::identity::Identity;

use crate::act::ratelimit::WriteLimit;

/// An API failure: which cluster, and what failed.
pub type Failure = (&'static str, String);

/// The version of the Secret `name` of `namespace` to replace for the pod whose upper UID is
/// `uid`: the cache's (`cached`), or, one the cache does not show yet, what is there when it
/// is this node's for that pod (`None`: none is there). Someone else's is never overwritten:
/// `refused` says what the pod goes without.
pub async fn version(
    api: &Api<Secret>,
    identity: &Identity,
    cached: Option<&Secret>,
    (namespace, name, uid): (&str, &str, &str),
    refused: &str,
) -> Result<Option<String>, Failure> {
    if let Some(c) = cached {
        return Ok(c.metadata.resource_version.clone());
    }
    match api.get_opt(name).await {
        Ok(None) => Ok(None),
        Ok(Some(found)) if identity.holds_credentials(&found.metadata, uid) => {
            Ok(found.metadata.resource_version)
        }
        Ok(Some(_)) => Err((
            "lower",
            format!(
                "Secret {namespace}/{name} exists and is not this node's: the pod gets {refused} until it is gone"
            ),
        )),
        Err(e) => Err(("lower", format!("reading Secret {namespace}/{name}: {e}"))),
    }
}

/// Creates `desired`, or replaces it at `version` (a conflict fails; the next pass tries
/// again): the verbs a copy needs, nothing more.
pub async fn store(
    api: &Api<Secret>,
    limit: &WriteLimit,
    mut desired: Secret,
    version: Option<String>,
) -> Result<(), Failure> {
    let name = desired.metadata.name.clone().unwrap_or_default();
    let namespace = desired.metadata.namespace.clone().unwrap_or_default();
    limit.acquire().await;
    let written = match version {
        None => api.create(&PostParams::default(), &desired).await,
        Some(v) => {
            desired.metadata.resource_version = Some(v);
            api.replace(&name, &PostParams::default(), &desired).await
        }
    };
    written
        .map(drop)
        .map_err(|e| ("lower", format!("writing Secret {namespace}/{name}: {e}")))
}
