//! What a lower cluster holds, seen through discovery: which kinds it serves, and whether a
//! namespace holds anything of anyone's. Read by the virtual node's namespace collection, by
//! the teardown of a whole virtual node ([`crate::lower::teardown`]) and by `tensilectl leave`.

use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use kube::discovery::{ApiCapabilities, ApiResource, Scope, verbs};

/// What the lower cluster puts in every namespace by itself: never a reason to keep a
/// namespace we made.
fn left_by_the_cluster(resource: &ApiResource, name: &str) -> bool {
    match (resource.group.as_str(), resource.plural.as_str()) {
        ("", "serviceaccounts") => name == "default",
        ("", "configmaps") => name == "kube-root-ca.crt",
        _ => false,
    }
}

/// Events outlive what they are about (an hour by default): they never keep a namespace,
/// and nothing of ours is an event.
pub fn is_events(resource: &ApiResource) -> bool {
    resource.plural == "events" && matches!(resource.group.as_str(), "" | "events.k8s.io")
}

/// Every kind the cluster serves, at its preferred version, with what it supports. A group
/// that does not answer (an aggregated API whose server is down, say) is left out rather
/// than failing the whole discovery: what it serves cannot be listed now anyway.
pub async fn kinds(client: &kube::Client) -> Result<Vec<(ApiResource, ApiCapabilities)>, kube::Error> {
    let mut names = vec![kube::discovery::ApiGroup::CORE_GROUP.to_owned()];
    names.extend(client.list_api_groups().await?.groups.into_iter().map(|g| g.name));
    let mut found = Vec::new();
    for name in names {
        match kube::discovery::group(client, &name).await {
            Ok(group) => found.extend(group.recommended_resources()),
            Err(e) => tracing::warn!(group = %name, "discovery: the group does not answer, left out: {e}"),
        }
    }
    Ok(found)
}

/// The kinds an emptiness check lists: every namespaced kind the cluster serves that can be
/// listed (so Roles, NetworkPolicies, LimitRanges and custom resources count), events aside.
pub async fn namespaced_kinds(client: &kube::Client) -> Result<Vec<ApiResource>, kube::Error> {
    Ok(kinds(client)
        .await?
        .into_iter()
        .filter(|(r, caps)| {
            caps.scope == Scope::Namespaced && caps.supports_operation(verbs::LIST) && !is_events(r)
        })
        .map(|(r, _)| r)
        .collect())
}

/// Whether namespace `ns` holds nothing of anyone's among `kinds`: only what the cluster
/// itself leaves ([`left_by_the_cluster`], service-account token Secrets) is ignored.
pub async fn namespace_is_empty(
    client: &kube::Client,
    ns: &str,
    kinds: &[ApiResource],
) -> Result<bool, kube::Error> {
    for resource in kinds {
        let fields = if resource.group.is_empty() && resource.plural == "secrets" {
            "type!=kubernetes.io/service-account-token"
        } else {
            ""
        };
        let params = ListParams::default().fields(fields).limit(10);
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, resource);
        let list = api.list_metadata(&params).await?;
        let held = list
            .items
            .iter()
            .any(|o| !left_by_the_cluster(resource, o.metadata.name.as_deref().unwrap_or_default()));
        if held || list.metadata.continue_.as_deref().is_some_and(|c| !c.is_empty()) {
            tracing::debug!(namespace = %ns, kind = %resource.kind, "namespace not empty");
            return Ok(false);
        }
    }
    Ok(true)
}
