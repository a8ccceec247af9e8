//! Removing every trace of one virtual node from its lower cluster: what the deletion of a
//! `LowerCluster` runs before its finalizer goes, and what `tensilectl leave` runs after it
//! with the lower admin's credential.
//!
//! What is ours is what carries our marks (the upper cluster's id and the node's name), of
//! any kind the cluster serves: discovery finds the kinds, so a kind the virtual node learns
//! to make later is removed too; and the copies the upper cluster's virtual nodes share there
//! (its mark alone), once none of its pods is left below. Nothing unmarked is touched. A namespace we made goes last,
//! and only once it holds nothing of anyone's, so a lower admin's objects put in it keep it.
//!
//! One call is one pass: it deletes what it finds and reports what still stands (pods in
//! their grace period, a namespace terminating) and which kinds the credential may not list
//! or delete. The caller repeats it until [`Removal::done`].

use crate::cache::Namespaces;
use crate::names;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PropagationPolicy};
use kube::core::DynamicObject;
use kube::discovery::{Scope, verbs};

use crate::lower::identity::Identity;
use crate::lower::objects;

/// What one pass found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// Objects of ours still there (`kind namespace/name`), deleted and going.
    pub remaining: Vec<String>,
    /// Objects of ours the credential may not delete (`kind namespace/name: reason`).
    pub refused: Vec<String>,
    /// Kinds the credential may not list (`plural.group`). A credential that may not list a
    /// kind could not have made objects of it either, so these never hold a removal back.
    pub unseen: Vec<String>,
    /// Claims of ours kept on purpose: their upper class said `Retain`, so their data stays
    /// (as when the upper claim is deleted).
    pub kept: Vec<String>,
}

impl Removal {
    /// Nothing of ours is left and nothing was out of reach.
    pub fn done(&self) -> bool {
        self.remaining.is_empty() && self.refused.is_empty()
    }

    /// One line for a status message or a log.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.remaining.is_empty() {
            let shown: Vec<&str> = self.remaining.iter().take(5).map(String::as_str).collect();
            let more = self.remaining.len().saturating_sub(shown.len());
            parts.push(format!(
                "{} object(s) still going ({}{})",
                self.remaining.len(),
                shown.join(", "),
                if more > 0 {
                    format!(", and {more} more")
                } else {
                    String::new()
                }
            ));
        }
        if !self.refused.is_empty() {
            parts.push(format!("not allowed to remove: {}", self.refused.join("; ")));
        }
        if !self.kept.is_empty() {
            parts.push(format!("kept (reclaim policy Retain): {}", self.kept.join(", ")));
        }
        if parts.is_empty() {
            "nothing left".into()
        } else {
            parts.join("; ")
        }
    }
}

/// A copy the upper cluster `cluster_id`'s virtual nodes share below: its mark and no
/// node's. What `tensilectl join` makes carries the upper cluster's id too, but belongs to a
/// LowerCluster (its label), not to the virtual nodes.
fn shared_copy(meta: &ObjectMeta, cluster_id: &str) -> bool {
    let labels = meta.labels.as_ref();
    labels
        .and_then(|l| l.get(names::MARK_CLUSTER))
        .map(String::as_str)
        == Some(cluster_id)
        && !labels.is_some_and(|l| l.contains_key(names::MARK_NODE) || l.contains_key(names::LOWER_CLUSTER))
}

/// A lower claim whose upper class's reclaim policy is `Retain`: never deleted by us.
fn retained(resource: &kube::discovery::ApiResource, meta: &ObjectMeta) -> bool {
    resource.group.is_empty()
        && resource.plural == "persistentvolumeclaims"
        && meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::LOWER_CLAIM_RECLAIM_POLICY))
            .is_some_and(|p| p == "Retain")
}

fn kind_name(r: &kube::discovery::ApiResource) -> String {
    if r.group.is_empty() {
        r.plural.clone()
    } else {
        format!("{}.{}", r.plural, r.group)
    }
}

/// One pass of removing everything `identity` made in the cluster of `client`.
///
/// Copies (ConfigMaps, Secrets, Services, Endpoints) carry the upper cluster's mark only:
/// the virtual nodes of one upper cluster over one lower cluster share them. They go once
/// no lower pod of the upper cluster is left there, so another virtual node of the same
/// upper cluster keeps what its pods use (and collects the rest itself).
///
/// Under a namespace scope (`served`), only the served namespaces are looked in, and
/// namespaces (never made there) are left alone.
pub async fn remove_everything(
    client: &kube::Client,
    identity: &Identity,
    served: &Namespaces,
) -> Result<Removal, kube::Error> {
    let mut removal = Removal::default();
    let kinds = objects::kinds(client).await?;
    let own = ListParams::default().labels(&identity.selector());
    sweep(
        client,
        served,
        &kinds,
        &own,
        &|meta| identity.owns(meta),
        &mut removal,
    )
    .await?;
    // The pods' Secrets of upper tokens go with their lower pods; any left (a lower cluster
    // whose garbage collector is behind) go here.
    let tokens = ListParams::default().labels(&identity.token_selector());
    let token_of = |meta: &ObjectMeta| {
        let labels = meta.labels.as_ref();
        labels.and_then(|l| l.get(crate::lower::identity::TOKEN_LABEL)) == Some(&identity.cluster_id)
            && labels.and_then(|l| l.get(names::MARK_NODE)) == Some(&identity.node)
    };
    let secrets: Vec<_> = kinds
        .iter()
        .filter(|(r, _)| r.group.is_empty() && r.plural == "secrets")
        .cloned()
        .collect();
    sweep(client, served, &secrets, &tokens, &token_of, &mut removal).await?;
    if !removal.remaining.is_empty() {
        return Ok(removal);
    }
    let cluster = format!("{}={}", names::MARK_CLUSTER, identity.cluster_id);
    let mut others = false;
    for pods in served.apis::<k8s_openapi::api::core::v1::Pod>(client) {
        let found = pods
            .list_metadata(&ListParams::default().labels(&cluster).limit(1))
            .await?;
        others |= !found.items.is_empty();
    }
    if !others {
        let shared = ListParams::default().labels(&format!(
            "{cluster},!{},!{}",
            names::MARK_NODE,
            names::LOWER_CLUSTER
        ));
        let is_shared = |meta: &ObjectMeta| shared_copy(meta, &identity.cluster_id);
        sweep(client, served, &kinds, &shared, &is_shared, &mut removal).await?;
    }
    if *served != Namespaces::All {
        return Ok(removal);
    }
    // Namespaces last: one we made goes once nothing of ours is left anywhere and it holds
    // nothing of anyone's.
    let namespaces = kinds
        .iter()
        .find(|(r, _)| r.group.is_empty() && r.plural == "namespaces")
        .map(|(r, _)| r.clone());
    if let Some(resource) = namespaces
        && removal.remaining.is_empty()
    {
        remove_namespaces(client, identity, &resource, &own, &mut removal).await?;
    }
    Ok(removal)
}

/// Deletes every object of every kind that `params` lists and `ours` accepts; what is
/// still there goes into `removal`.
async fn sweep(
    client: &kube::Client,
    served: &Namespaces,
    kinds: &[(kube::discovery::ApiResource, kube::discovery::ApiCapabilities)],
    params: &ListParams,
    ours: &(dyn Fn(&ObjectMeta) -> bool + Sync),
    removal: &mut Removal,
) -> Result<(), kube::Error> {
    let background = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..Default::default()
    };
    for (resource, caps) in kinds {
        if !caps.supports_operation(verbs::LIST) || !caps.supports_operation(verbs::DELETE) {
            continue;
        }
        if objects::is_events(resource) || (resource.group.is_empty() && resource.plural == "namespaces") {
            continue;
        }
        let apis: Vec<Api<DynamicObject>> = match served {
            Namespaces::All => vec![Api::all_with(client.clone(), resource)],
            // Cluster-wide kinds are out of a namespace scope's reach, and nothing of them is
            // made there.
            Namespaces::Only(_) if caps.scope != Scope::Namespaced => continue,
            Namespaces::Only(list) => list
                .iter()
                .map(|ns| Api::namespaced_with(client.clone(), ns, resource))
                .collect(),
        };
        let mut items = Vec::new();
        for api in apis {
            match api.list_metadata(params).await {
                Ok(list) => items.extend(list.items),
                Err(e) if matches!(crate::api::code(&e), Some(403) | Some(405)) => {
                    if !removal.unseen.contains(&kind_name(resource)) {
                        removal.unseen.push(kind_name(resource));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        for object in items {
            if !ours(&object.metadata) {
                continue;
            }
            if retained(resource, &object.metadata) {
                let at = format!(
                    "{} {}/{}",
                    kind_name(resource),
                    object.metadata.namespace.as_deref().unwrap_or_default(),
                    object.metadata.name.as_deref().unwrap_or_default()
                );
                if !removal.kept.contains(&at) {
                    removal.kept.push(at);
                }
                continue;
            }
            let name = object.metadata.name.clone().unwrap_or_default();
            let ns = object.metadata.namespace.clone();
            let at = match &ns {
                Some(ns) => format!("{} {ns}/{name}", kind_name(resource)),
                None => format!("{} {name}", kind_name(resource)),
            };
            if object.metadata.deletion_timestamp.is_none() {
                let api: Api<DynamicObject> = match (&ns, caps.scope == Scope::Namespaced) {
                    (Some(ns), true) => Api::namespaced_with(client.clone(), ns, resource),
                    _ => Api::all_with(client.clone(), resource),
                };
                let exact = DeleteParams {
                    preconditions: Some(kube::api::Preconditions {
                        uid: object.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..background.clone()
                };
                match api.delete(&name, &exact).await {
                    Ok(_) => tracing::info!(object = %at, "teardown: deleted"),
                    Err(e) if matches!(crate::api::code(&e), Some(404) | Some(409)) => continue,
                    Err(e) if crate::api::code(&e) == Some(403) => {
                        removal.refused.push(format!("{at}: {}", crate::api::message(&e)));
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            removal.remaining.push(at);
        }
    }
    Ok(())
}

async fn remove_namespaces(
    client: &kube::Client,
    identity: &Identity,
    resource: &kube::discovery::ApiResource,
    params: &ListParams,
    removal: &mut Removal,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::core::v1::Namespace;
    let api: Api<Namespace> = Api::all(client.clone());
    let list = match api.list_metadata(params).await {
        Ok(list) => list,
        Err(e) if crate::api::code(&e) == Some(403) => {
            removal.unseen.push(kind_name(resource));
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let mut inside = None;
    for ns in list.items {
        if !identity.owns(&ns.metadata) {
            continue;
        }
        let name = ns.metadata.name.clone().unwrap_or_default();
        let at = format!("namespaces {name}");
        if ns.metadata.deletion_timestamp.is_some() {
            removal.remaining.push(at);
            continue;
        }
        if inside.is_none() {
            inside = Some(objects::namespaced_kinds(client).await?);
        }
        let kinds = inside.as_deref().unwrap_or_default();
        let empty = match objects::namespace_is_empty(client, &name, kinds).await {
            Ok(empty) => empty,
            // A kind the credential may not list there: it cannot say the namespace is empty.
            Err(e) if crate::api::code(&e) == Some(403) => false,
            Err(e) => return Err(e),
        };
        if !empty {
            tracing::info!(namespace = %name, "teardown: a namespace we made holds objects of others: kept");
            continue;
        }
        match crate::api::delete_exact(&api, &name, ns.metadata.uid.clone(), None).await {
            Ok(crate::api::Deleted::Accepted) => {
                tracing::info!(namespace = %name, "teardown: deleted");
                removal.remaining.push(at);
            }
            Ok(crate::api::Deleted::AlreadyGone) => {}
            Err(e) if crate::api::code(&e) == Some(403) => {
                removal.refused.push(format!("{at}: {}", crate::api::message(&e)));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removal_is_done_only_with_nothing_left_and_nothing_refused() {
        assert!(Removal::default().done());
        assert_eq!(Removal::default().summary(), "nothing left");
        let going = Removal {
            remaining: (0..7).map(|i| format!("pods ns/p{i}")).collect(),
            ..Default::default()
        };
        assert!(!going.done());
        assert_eq!(
            going.summary(),
            "7 object(s) still going (pods ns/p0, pods ns/p1, pods ns/p2, pods ns/p3, pods ns/p4, and 2 more)"
        );
        let refused = Removal {
            refused: vec!["services ns/s: forbidden".into()],
            ..Default::default()
        };
        assert!(!refused.done());
        assert_eq!(
            refused.summary(),
            "not allowed to remove: services ns/s: forbidden"
        );
        let unseen = Removal {
            unseen: vec!["deployments.apps".into()],
            ..Default::default()
        };
        assert!(
            unseen.done(),
            "a kind the credential cannot list holds nothing it made"
        );
    }

    #[test]
    fn a_claim_kept_on_purpose_does_not_hold_the_removal() {
        let kept = Removal {
            kept: vec!["persistentvolumeclaims ns/data".into()],
            ..Default::default()
        };
        assert!(kept.done(), "a retained claim is kept on purpose");
        assert_eq!(
            kept.summary(),
            "kept (reclaim policy Retain): persistentvolumeclaims ns/data"
        );
    }

    #[test]
    fn only_claims_whose_class_retains_are_kept() {
        let claims =
            kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::PersistentVolumeClaim>(&());
        let maps = kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        let with = |policy: &str| ObjectMeta {
            annotations: Some([(names::LOWER_CLAIM_RECLAIM_POLICY.to_owned(), policy.to_owned())].into()),
            ..Default::default()
        };
        assert!(retained(&claims, &with("Retain")));
        assert!(!retained(&claims, &with("Delete")));
        assert!(!retained(&claims, &ObjectMeta::default()));
        assert!(!retained(&maps, &with("Retain")), "only claims");
    }

    #[test]
    fn a_shared_copy_is_the_upper_clusters_alone_never_a_nodes_nor_what_join_made() {
        let with = |labels: &[(&str, &str)]| ObjectMeta {
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        };
        assert!(shared_copy(&with(&[(names::MARK_CLUSTER, "c1")]), "c1"));
        assert!(
            !shared_copy(&with(&[(names::MARK_CLUSTER, "c2")]), "c1"),
            "another upper cluster's"
        );
        assert!(!shared_copy(
            &with(&[(names::MARK_CLUSTER, "c1"), (names::MARK_NODE, "vn")]),
            "c1"
        ));
        assert!(
            !shared_copy(
                &with(&[
                    (names::MARK_CLUSTER, "c1"),
                    (names::LOWER_CLUSTER, "lower-b"),
                    (names::MANAGED_BY, "tensilectl")
                ]),
                "c1"
            ),
            "another LowerCluster's account, made by join"
        );
        assert!(!shared_copy(&ObjectMeta::default(), "c1"));
    }
}
