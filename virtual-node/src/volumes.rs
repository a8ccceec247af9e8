//! Volumes: the PersistentVolumeClaims pods of this node use, made below, and the volumes
//! they get there reflected upstream so the upper scheduler keeps later pods of a claim on
//! this node.
//!
//! The model. This node handles an upper claim when a pod bound to it uses the claim or
//! when the upper scheduler picked this node for it (`volume.kubernetes.io/selected-node`,
//! set for claims of a `WaitForFirstConsumer` class). For each handled claim:
//! - the lower claim of the same namespace and name exists, with the upper claim's class,
//!   access modes, requests, selector and volume mode, and our marks (a same-named claim
//!   without them is a conflict, never touched);
//! - once the lower claim is bound (or waits for its first consumer below), the upper
//!   cluster gets a PersistentVolume `pvc-<upper claim uid>`, pre-bound to the upper claim,
//!   with the lower claim's capacity and access modes and a node affinity to this node.
//!   The upper cluster's own volume controller binds the claim to it; its status then shows
//!   what the lower cluster granted. The name is unique per upper claim, so it cannot
//!   collide across lower clusters.
//!
//! When the upper claim is gone, the lower claim is deleted once no lower pod uses it, and
//! the upper volume is deleted. Upstream, such claims use a StorageClass whose provisioner
//! is [`PROVISIONER`] and whose binding mode is `WaitForFirstConsumer`, named as the class
//! the lower cluster provides.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tensile_common::cache::Cache;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;
use tensile_common::names;

use crate::copies::Blocked;
use crate::metrics::Metrics;
use crate::ratelimit::TokenBucket;
use crate::translate::{self, Identity};
use tensile_common::api::ApiError as Error;

/// The provisioner name of upper StorageClasses whose claims virtual nodes provision.
pub const PROVISIONER: &str = "virtual-node.tensile.io";

use tensile_common::api::{Deleted, code, delete_exact};

/// The claims a pod spec mounts.
pub fn claims(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone()))
        .collect()
}

/// The reflection of claims and volumes for one virtual node.
pub struct Volumes {
    pub upper: kube::Client,
    pub lower: kube::Client,
    pub identity: Identity,
    pub cluster_name: String,
    pub upper_claims: Cache<PersistentVolumeClaim>,
    /// Upper volumes carrying this node's marks.
    pub upper_volumes: Cache<PersistentVolume>,
    /// Lower claims carrying this node's marks.
    pub lower_claims: Cache<PersistentVolumeClaim>,
    pub upper_pods: Cache<Pod>,
    /// Lower pods that have not finished.
    pub lower_pods: Cache<Pod>,
    pub upper_limit: TokenBucket,
    pub lower_limit: TokenBucket,
    pub metrics: Arc<Metrics>,
    /// Whether each lower StorageClass binds on first consumer (a class's binding mode is
    /// immutable, so one read each).
    pub waits_for_consumer: std::sync::Mutex<std::collections::HashMap<String, bool>>,
}

impl Volumes {
    fn volume_name(upper_claim: &PersistentVolumeClaim) -> String {
        format!("pvc-{}", upper_claim.uid().unwrap_or_default())
    }

    /// The lower claim for `upper`.
    fn lower_claim(&self, upper: &PersistentVolumeClaim) -> PersistentVolumeClaim {
        let spec = upper.spec.clone().unwrap_or_default();
        let mut labels: BTreeMap<String, String> = upper
            .labels()
            .iter()
            .filter(|(k, _)| {
                ![names::MARK_CLUSTER, names::MARK_NODE, names::MARK_UPPER_UID].contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.extend(self.identity.marks());
        labels.insert(names::MARK_UPPER_UID.to_owned(), upper.uid().unwrap_or_default());
        PersistentVolumeClaim {
            metadata: kube::api::ObjectMeta {
                name: upper.metadata.name.clone(),
                namespace: upper.metadata.namespace.clone(),
                labels: Some(labels),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::core::v1::PersistentVolumeClaimSpec {
                access_modes: spec.access_modes,
                resources: spec.resources,
                selector: spec.selector,
                storage_class_name: spec.storage_class_name,
                volume_mode: spec.volume_mode,
                ..Default::default()
            }),
            status: None,
        }
    }

    fn selected_here(&self, claim: &PersistentVolumeClaim) -> bool {
        claim.annotations().get(names::PVC_SELECTED_NODE) == Some(&self.identity.node)
    }

    /// Makes the lower claim of `ns/name` exist (ours). `Ok(Err(_))` says why a pod using it
    /// must not be created below.
    pub async fn prepare(&self, ns: &str, name: &str) -> Result<Result<(), Blocked>, Error> {
        self.upper_claims.synced().await;
        let Some(upper) = self.upper_claims.get(&ObjectRef::new(name).within(ns)) else {
            return Ok(Err(Blocked::Missing(format!(
                "PersistentVolumeClaim {ns}/{name} does not exist in the upper cluster"
            ))));
        };
        self.ensure_lower_claim(&upper).await
    }

    async fn ensure_lower_claim(&self, upper: &PersistentVolumeClaim) -> Result<Result<(), Blocked>, Error> {
        let (ns, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
        if let Some(lower) = self.lower_claims.get(&ObjectRef::new(&name).within(&ns))
            && self.identity.owns(&lower.metadata)
        {
            return Ok(Ok(()));
        }
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.lower.clone(), &ns);
        self.lower_limit.acquire().await;
        let existing = match api.create(&PostParams::default(), &self.lower_claim(upper)).await {
            Ok(_) => {
                tracing::info!(claim = %format!("{ns}/{name}"), "created below");
                return Ok(Ok(()));
            }
            Err(e) if code(&e) == Some(409) => {
                api.get_opt(&name)
                    .await
                    .map_err(Error::on("lower", "get", format!("claim {ns}/{name}")))?
            }
            Err(e) => return Err(Error::on("lower", "create", format!("claim {ns}/{name}"))(e)),
        };
        match existing {
            Some(l) if !self.identity.owns(&l.metadata) => Ok(Err(Blocked::Conflict(format!(
                "lower cluster {} already has a PersistentVolumeClaim {ns}/{name} not created by this virtual node; it is left untouched and the pod is not started below",
                self.cluster_name
            )))),
            _ => Ok(Ok(())),
        }
    }

    /// Whether the lower claim may get a volume reflected upstream now: bound below, or
    /// waiting below for its first consumer (which is the pod this volume lets through).
    async fn ready_below(&self, lower: &PersistentVolumeClaim) -> bool {
        if lower.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound") {
            return true;
        }
        let Some(class) = lower.spec.as_ref().and_then(|s| s.storage_class_name.clone()) else {
            return false;
        };
        if let Some(known) = self
            .waits_for_consumer
            .lock()
            .ok()
            .and_then(|m| m.get(&class).copied())
        {
            return known;
        }
        match Api::<StorageClass>::all(self.lower.clone()).get_opt(&class).await {
            Ok(Some(c)) => {
                let waits = c.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer");
                if let Ok(mut m) = self.waits_for_consumer.lock() {
                    m.insert(class, waits);
                }
                waits
            }
            // A class that does not exist (yet) is asked about again on the next pass.
            _ => false,
        }
    }

    /// The upper volume standing for the lower claim `lower` of `upper`.
    fn upper_volume(&self, upper: &PersistentVolumeClaim, lower: &PersistentVolumeClaim) -> PersistentVolume {
        use k8s_openapi::api::core::v1::{
            CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
            ObjectReference, PersistentVolumeSpec, VolumeNodeAffinity,
        };
        let spec = upper.spec.clone().unwrap_or_default();
        let status = lower.status.clone().unwrap_or_default();
        let bound = status.phase.as_deref() == Some("Bound");
        let capacity = if bound {
            status.capacity.clone()
        } else {
            spec.resources.as_ref().and_then(|r| r.requests.clone())
        };
        let access_modes =
            if bound { status.access_modes.clone() } else { None }.or(spec.access_modes.clone());
        let (ns, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
        PersistentVolume {
            metadata: kube::api::ObjectMeta {
                name: Some(Self::volume_name(upper)),
                labels: Some(self.identity.marks()),
                annotations: Some(BTreeMap::from([(
                    "pv.kubernetes.io/provisioned-by".to_owned(),
                    PROVISIONER.to_owned(),
                )])),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                capacity,
                access_modes,
                volume_mode: spec.volume_mode,
                storage_class_name: spec.storage_class_name,
                persistent_volume_reclaim_policy: Some("Delete".into()),
                claim_ref: Some(ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("PersistentVolumeClaim".into()),
                    namespace: Some(ns.clone()),
                    name: Some(name.clone()),
                    uid: upper.uid(),
                    ..Default::default()
                }),
                csi: Some(CSIPersistentVolumeSource {
                    driver: PROVISIONER.into(),
                    volume_handle: format!(
                        "{}/{ns}/{name}/{}",
                        self.identity.node,
                        lower.uid().unwrap_or_default()
                    ),
                    ..Default::default()
                }),
                node_affinity: Some(VolumeNodeAffinity {
                    required: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: "kubernetes.io/hostname".into(),
                                operator: "In".into(),
                                values: Some(vec![self.identity.node.clone()]),
                            }]),
                            match_fields: None,
                        }],
                    }),
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// Resyncs from the watch caches every second, until dropped.
    pub async fn run(self: Arc<Self>, changed: Arc<tokio::sync::Notify>) {
        self.upper_claims.synced().await;
        self.upper_volumes.synced().await;
        self.lower_claims.synced().await;
        self.upper_pods.synced().await;
        self.lower_pods.synced().await;
        let metrics = &self.metrics;
        loop {
            let work = self.plan();
            futures::stream::iter(work)
                .for_each_concurrent(8, |w| async move {
                    if let Err(e) = w.await {
                        metrics.api_error("lower", "volume");
                        tracing::warn!("volume resync: {e}");
                    }
                })
                .await;
            tokio::select! {
                _ = changed.notified() => tokio::time::sleep(Duration::from_millis(50)).await,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    fn plan(&self) -> Vec<Write<'_>> {
        let mut work: Vec<Write<'_>> = Vec::new();
        let mut handled = std::collections::BTreeSet::new();
        for pod in self.upper_pods.state() {
            if translate::is_terminal(&pod) {
                continue;
            }
            let ns = pod.namespace().unwrap_or_default();
            handled.extend(claims(&pod).into_iter().map(|c| (ns.clone(), c)));
        }
        for claim in self.upper_claims.state() {
            if self.selected_here(&claim) {
                handled.insert((claim.namespace().unwrap_or_default(), claim.name_any()));
            }
        }
        for (ns, name) in &handled {
            let Some(upper) = self.upper_claims.get(&ObjectRef::new(name).within(ns)) else {
                continue;
            };
            if upper.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let lower = self
                .lower_claims
                .get(&ObjectRef::new(name).within(ns))
                .filter(|l| self.identity.owns(&l.metadata));
            match lower {
                None if self.selected_here(&upper) => work.push(Box::pin(async move {
                    if let Err(blocked) = self.ensure_lower_claim(&upper).await? {
                        tracing::warn!("{blocked:?}");
                    }
                    Ok(())
                })),
                None => {}
                Some(lower) => work.push(Box::pin(self.sync_claim(upper, lower))),
            }
        }
        // Lower claims whose upper claim is gone (or is another claim of the same name).
        for lower in self.lower_claims.state() {
            if !self.identity.owns(&lower.metadata) || lower.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let (ns, name) = (lower.namespace().unwrap_or_default(), lower.name_any());
            let upper = self.upper_claims.get(&ObjectRef::new(&name).within(&ns));
            let made_for = lower.labels().get(names::MARK_UPPER_UID).cloned();
            if upper.as_ref().and_then(|u| u.uid()) == made_for {
                continue;
            }
            let in_use = self
                .lower_pods
                .state()
                .iter()
                .any(|p| p.namespace().as_deref() == Some(ns.as_str()) && claims(p).contains(&name));
            if !in_use {
                work.push(Box::pin(self.delete_lower_claim(lower)));
            }
        }
        // Upper volumes whose claim is gone.
        for volume in self.upper_volumes.state() {
            if !self.identity.owns(&volume.metadata) || volume.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let claim = volume.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
            let exists = claim.is_some_and(|c| {
                let at = ObjectRef::new(c.name.as_deref().unwrap_or_default())
                    .within(c.namespace.as_deref().unwrap_or_default());
                self.upper_claims.get(&at).and_then(|u| u.uid()) == c.uid
            });
            if !exists {
                work.push(Box::pin(self.delete_upper_volume(volume)));
            }
        }
        work
    }

    /// Brings one handled claim's upper side to its lower claim: the volume upstream, and
    /// the lower scheduler's node choice named as this node.
    async fn sync_claim(
        &self,
        upper: Arc<PersistentVolumeClaim>,
        lower: Arc<PersistentVolumeClaim>,
    ) -> Result<(), Error> {
        let (ns, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
        if lower.annotations().contains_key(names::PVC_SELECTED_NODE)
            && !upper.annotations().contains_key(names::PVC_SELECTED_NODE)
        {
            let patch = json!({"metadata": {"annotations": {names::PVC_SELECTED_NODE: self.identity.node}}});
            self.upper_limit.acquire().await;
            Api::<PersistentVolumeClaim>::namespaced(self.upper.clone(), &ns)
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(Error::on("upper", "patch", format!("claim {ns}/{name}")))?;
        }
        let volume_name = Self::volume_name(&upper);
        let existing = self.upper_volumes.get(&ObjectRef::new(&volume_name));
        let api: Api<PersistentVolume> = Api::all(self.upper.clone());
        match existing {
            None => {
                if !self.ready_below(&lower).await {
                    return Ok(());
                }
                let volume = self.upper_volume(&upper, &lower);
                self.upper_limit.acquire().await;
                match api.create(&PostParams::default(), &volume).await {
                    Ok(_) => {
                        tracing::info!(claim = %format!("{ns}/{name}"), volume = %volume_name, "volume reflected upstream");
                        Ok(())
                    }
                    Err(e) if code(&e) == Some(409) => Ok(()),
                    Err(e) => Err(Error::on("upper", "create", format!("volume {volume_name}"))(e)),
                }
            }
            Some(volume) => {
                // A resize below shows upstream.
                let granted = lower
                    .status
                    .as_ref()
                    .filter(|s| s.phase.as_deref() == Some("Bound"))
                    .and_then(|s| s.capacity.clone());
                let shown = volume.spec.as_ref().and_then(|s| s.capacity.clone());
                if granted.is_none() || granted == shown {
                    return Ok(());
                }
                let patch = json!({"spec": {"capacity": granted}});
                self.upper_limit.acquire().await;
                api.patch(&volume_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ())
                    .map_err(Error::on("upper", "patch", format!("volume {volume_name}")))
            }
        }
    }

    async fn delete_lower_claim(&self, lower: Arc<PersistentVolumeClaim>) -> Result<(), Error> {
        let (ns, name) = (lower.namespace().unwrap_or_default(), lower.name_any());
        self.lower_limit.acquire().await;
        let api = Api::<PersistentVolumeClaim>::namespaced(self.lower.clone(), &ns);
        let deleted = delete_exact(&api, &name, lower.uid(), None)
            .await
            .map_err(Error::on("lower", "delete", format!("claim {ns}/{name}")))?;
        if deleted == Deleted::Accepted {
            tracing::info!(claim = %format!("{ns}/{name}"), "deleted below: its upper claim is gone");
        }
        Ok(())
    }

    async fn delete_upper_volume(&self, volume: Arc<PersistentVolume>) -> Result<(), Error> {
        let name = volume.name_any();
        self.upper_limit.acquire().await;
        let api = Api::<PersistentVolume>::all(self.upper.clone());
        let deleted = delete_exact(&api, &name, volume.uid(), None)
            .await
            .map_err(Error::on("upper", "delete", format!("volume {name}")))?;
        if deleted == Deleted::Accepted {
            tracing::info!(volume = %name, "deleted upstream: its claim is gone");
        }
        Ok(())
    }
}

/// One write of a resync pass.
type Write<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send + 'a>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_the_mounted_persistent_volume_claims() {
        let pod: Pod = serde_json::from_value(json!({"spec": {"containers": [], "volumes": [
            {"name": "a", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "b", "configMap": {"name": "cfg"}},
            {"name": "c", "persistentVolumeClaim": {"claimName": "logs", "readOnly": true}}]}}))
        .unwrap();
        assert_eq!(claims(&pod), ["data", "logs"]);
        assert!(claims(&Pod::default()).is_empty());
    }
}
