//! The lower namespaces this node puts objects in: one rule for pods, claims and Services. A
//! namespace is used when this upper cluster made it, when `--shared-namespaces` lists it, or,
//! under a namespace scope (`--lower-namespaces`), when it is served; one that does not exist
//! is made, marked as ours. Anything else is another tenant's, and nothing of ours goes there.

use std::collections::HashSet;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use tensile_common::api::ApiError;
use tensile_common::cache::Namespaces;
use tensile_common::names;

use crate::act::ratelimit::WriteLimit;
use crate::model::refs::Blocked;
use tensile_common::lower::identity::Identity;

pub struct LowerNamespaces {
    lower: kube::Client,
    identity: Identity,
    cluster_name: String,
    /// Lower namespaces pods may share with others (`--shared-namespaces`; `*`: any).
    shared: Vec<String>,
    /// The lower namespaces served (`--lower-namespaces`).
    served: Namespaces,
    limit: WriteLimit,
    /// Lower namespaces known to exist and be usable.
    usable: Mutex<HashSet<String>>,
}

impl LowerNamespaces {
    pub fn new(
        lower: kube::Client,
        identity: Identity,
        cluster_name: String,
        shared: Vec<String>,
        served: Namespaces,
        limit: WriteLimit,
    ) -> Self {
        Self {
            lower,
            identity,
            cluster_name,
            shared,
            served,
            limit,
            usable: Mutex::default(),
        }
    }

    /// Whether `ns` was judged usable since it was last forgotten.
    pub fn known(&self, ns: &str) -> bool {
        self.usable.lock().is_ok_and(|u| u.contains(ns))
    }

    /// Judges `ns` again at its next use: a create in it failed, or it is being deleted.
    pub fn forget(&self, ns: &str) {
        if let Ok(mut usable) = self.usable.lock() {
            usable.remove(ns);
        }
    }

    /// Makes `ns` exist below and be usable; `Ok(Err(_))` says why nothing of ours may go
    /// there. A namespace seen once stays known until [`forget`](Self::forget).
    pub async fn ensure(&self, ns: &str) -> Result<Result<(), Blocked>, ApiError> {
        if self.known(ns) {
            return Ok(Ok(()));
        }
        let result = self.ensure_below(ns).await;
        if matches!(result, Ok(Ok(())))
            && let Ok(mut usable) = self.usable.lock()
        {
            usable.insert(ns.to_owned());
        }
        result
    }

    async fn ensure_below(&self, ns: &str) -> Result<Result<(), Blocked>, ApiError> {
        // A namespace scope runs pods in the served namespaces as they are (the lower
        // admin's), and nowhere else.
        if let Namespaces::Only(served) = &self.served {
            if self.served.contains(ns) {
                return Ok(Ok(()));
            }
            return Ok(Err(Blocked::NotServed(format!(
                "namespace {ns} is not served in lower cluster {} (served: {}); the virtual node's \
                 lower credential holds no rights there",
                self.cluster_name,
                served.join(", ")
            ))));
        }
        let api: Api<Namespace> = Api::all(self.lower.clone());
        if let Some(existing) =
            api.get_opt(ns)
                .await
                .map_err(ApiError::on("lower", "get", format!("namespace {ns}")))?
        {
            if namespace_usable(&existing, &self.identity.cluster_id, &self.shared) {
                return Ok(Ok(()));
            }
            return Ok(Err(Blocked::Conflict(format!(
                "lower cluster {} already has a namespace {ns} that this upper cluster did not create; \
                 nothing is made in it unless --shared-namespaces lists it",
                self.cluster_name
            ))));
        }
        let namespace = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(ns.to_owned()),
                labels: Some(self.identity.marks()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.limit.acquire().await;
        // A 409 (made meanwhile, by another virtual node of ours or by someone else) is an
        // error too: the retry reads it and judges whose it is.
        api.create(&PostParams::default(), &namespace)
            .await
            .map_err(ApiError::on("lower", "create", format!("namespace {ns}")))?;
        Ok(Ok(()))
    }
}

/// Whether an existing lower namespace may be used: this upper cluster made it (any of its
/// virtual nodes), or `shared` lists it (`*`: any).
pub fn namespace_usable(namespace: &Namespace, cluster_id: &str, shared: &[String]) -> bool {
    let name = namespace.metadata.name.as_deref().unwrap_or_default();
    let ours = namespace
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(names::MARK_CLUSTER))
        .is_some_and(|id| id == cluster_id);
    ours || shared.iter().any(|s| s == "*" || s == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_lower_namespace_is_used_when_ours_or_listed_as_shared() {
        let ns = |name: &str, cluster: Option<&str>| -> Namespace {
            let labels = cluster
                .map(|c| json!({names::MARK_CLUSTER: c}))
                .unwrap_or(json!({}));
            serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
        };
        let default_shared = ["default".to_owned()];
        assert!(namespace_usable(&ns("shop", Some("c1")), "c1", &default_shared));
        assert!(
            !namespace_usable(&ns("shop", Some("c2")), "c1", &default_shared),
            "another upper cluster's"
        );
        assert!(
            !namespace_usable(&ns("shop", None), "c1", &default_shared),
            "the lower admin's"
        );
        assert!(namespace_usable(&ns("default", None), "c1", &default_shared));
        assert!(namespace_usable(&ns("shop", None), "c1", &["shop".to_owned()]));
        assert!(namespace_usable(&ns("shop", None), "c1", &["*".to_owned()]));
    }
}
