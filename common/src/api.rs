//! The one shape of an API failure in the suite, the one delete that can only hit the object
//! it names, writes whose answer is read for the stored version only, and the timestamps
//! written into API objects.

use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};

/// An API call that failed: where, what, and the apiserver's (or the client's) reason.
#[derive(Debug, thiserror::Error)]
#[error("{cluster} {verb} {what}: {source}")]
pub struct ApiError {
    /// Which side of the suite the call went to (`upper`, `lower`).
    pub cluster: &'static str,
    pub verb: &'static str,
    pub what: String,
    #[source]
    pub source: kube::Error,
}

impl ApiError {
    /// For `map_err`: `.map_err(ApiError::on("lower", "create", format!("pod {key}")))`.
    pub fn on(
        cluster: &'static str,
        verb: &'static str,
        what: impl Into<String>,
    ) -> impl FnOnce(kube::Error) -> ApiError {
        let what = what.into();
        move |source| ApiError {
            cluster,
            verb,
            what,
            source,
        }
    }
}

/// The HTTP status of an apiserver refusal; `None` for client-side failures.
pub fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// The message of an API error as the apiserver phrased it.
pub fn message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

/// What an exact delete found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// The delete was accepted (the object may stay while it terminates).
    Accepted,
    /// Nothing of that UID was left: gone already (404), or the name now holds another
    /// object (409 on the UID precondition), which is left alone.
    AlreadyGone,
}

/// Deletes the object `name` only if its UID is still `uid`, with `grace` seconds
/// (`None`: the object's own). A grace too large for the API is clamped, never wrapped.
pub async fn delete_exact<K>(
    api: &Api<K>,
    name: &str,
    uid: Option<String>,
    grace: Option<i64>,
) -> Result<Deleted, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams {
        grace_period_seconds: grace.map(|g| g.clamp(0, i64::from(u32::MAX)) as u32),
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(Deleted::Accepted),
        Err(e) if matches!(code(&e), Some(404) | Some(409)) => Ok(Deleted::AlreadyGone),
        Err(e) => Err(e),
    }
}

/// What an apiserver's answer to a write says of the object it stored, read without building
/// the object: its version and, for a status, `status.observedGeneration`. A pod's answer is
/// several kilobytes of JSON and a decoded `Pod` many more; a writer that only needs to know
/// the write took (and at which version) reads this instead.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Stored {
    #[serde(default)]
    pub metadata: StoredMeta,
    #[serde(default)]
    pub status: Option<StoredStatus>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredMeta {
    #[serde(default)]
    pub resource_version: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredStatus {
    #[serde(default)]
    pub observed_generation: Option<i64>,
}

/// `api.create(params, object)`, answered as [`Stored`].
pub async fn create_stored<K>(api: &Api<K>, params: &PostParams, object: &K) -> Result<Stored, kube::Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let body = serde_json::to_vec(object).map_err(kube::Error::SerdeError)?;
    let request = kube::core::Request::new(api.resource_url())
        .create(params, body)
        .map_err(kube::Error::BuildRequest)?;
    api.clone().into_client().request::<Stored>(request).await
}

/// `api.patch_status(name, params, patch)`, answered as [`Stored`].
pub async fn patch_status_stored<K, P>(
    api: &Api<K>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Stored, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    P: serde::Serialize + std::fmt::Debug,
{
    let request = kube::core::Request::new(api.resource_url())
        .patch_subresource("status", name, params, patch)
        .map_err(kube::Error::BuildRequest)?;
    api.clone().into_client().request::<Stored>(request).await
}

/// A token of ServiceAccount `namespace/name` as `spec` asks for it (TokenRequest API), and
/// when it expires as the apiserver granted it (it may cap the lifetime asked for).
pub async fn request_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    spec: k8s_openapi::api::authentication::v1::TokenRequestSpec,
) -> Result<(String, Option<jiff::Timestamp>), kube::Error> {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    let api: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: Some(spec),
        ..Default::default()
    };
    let answer: TokenRequest = api
        .create_subresource("token", name, &Default::default(), &request)
        .await?;
    Ok(answer
        .status
        .map(|s| (s.token.unwrap_or_default(), s.expiration_timestamp.map(|t| t.0)))
        .unwrap_or_default())
}

/// Now, as API objects write a `Time` (RFC 3339, seconds).
pub fn now() -> String {
    time(jiff::Timestamp::now())
}

/// `t` as API objects write a `Time` (RFC 3339, seconds).
pub fn time(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Now, as API objects write a `MicroTime` (RFC 3339, microseconds).
pub fn now_micro() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_as_the_api_types() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
        let _: Time = serde_json::from_value(serde_json::json!(now())).unwrap();
        let _: MicroTime = serde_json::from_value(serde_json::json!(now_micro())).unwrap();
        assert_eq!(now().len(), "2024-01-01T00:00:00Z".len());
    }
}
