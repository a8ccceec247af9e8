//! The volume resync: every pass snapshots the world, asks [`crate::decide::volumes::plan`]
//! for its writes and performs them through the executor, and claims are made below before
//! a pod that mounts them ([`Volumes`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;
use tensile_common::api::ApiError as Error;
use tensile_common::api::{Deleted, code, delete_exact};
use tensile_common::cache::Cache;
use tensile_common::names;

use crate::act::ratelimit::WriteLimit;
use crate::decide::volumes::View;
use crate::decide::volumes::Write;
use crate::decide::volumes::at;
use crate::decide::volumes::lower_claim;
use crate::decide::volumes::made_for;
use crate::decide::volumes::plan;
use crate::decide::volumes::retained;
use crate::metrics::Metrics;
use crate::model::refs::Blocked;
use crate::model::trim::{PodLoad, UpperPod};
use tensile_common::lower::identity::Identity;

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
    pub upper_pods: Cache<UpperPod>,
    /// Lower pods that have not finished.
    pub lower_pods: Cache<PodLoad>,
    pub upper_limit: WriteLimit,
    pub lower_limit: WriteLimit,
    pub metrics: Arc<Metrics>,
    /// Whether each lower StorageClass binds on first consumer (a class's binding mode is
    /// immutable, so one read each).
    pub classes: std::sync::Mutex<HashMap<String, bool>>,
    /// The upper StorageClasses (their reclaim policies).
    pub upper_classes: Cache<StorageClass>,
    /// Whether lower StorageClasses can be read (not under a namespace scope).
    pub read_lower_classes: bool,
    /// The lower cluster's overrides in force (its StorageClass names).
    pub overrides: crate::world::overrides::Current,
    /// Expansions the lower cluster refused (`ns/name=size`), not asked again.
    pub refused_expansions: std::sync::Mutex<BTreeSet<String>>,
    /// The lower namespaces claims may go into: those pods may.
    pub namespaces: Arc<crate::act::lower_namespaces::LowerNamespaces>,
    /// What the last quiet pass read.
    pub last_pass: crate::act::LastPass,
}

impl Volumes {
    /// Makes the lower claim of `ns/name` exist (ours). `Ok(Err(_))` says why a pod using it
    /// must not be created below.
    pub async fn prepare(&self, ns: &str, name: &str) -> Result<Result<(), Blocked>, Error> {
        self.upper_claims.synced().await;
        let at = ObjectRef::new(name).within(ns);
        let Some(upper) = self.upper_claims.get(&at) else {
            return Ok(Err(Blocked::Missing(format!(
                "PersistentVolumeClaim {ns}/{name} does not exist in the upper cluster"
            ))));
        };
        if let Some(lower) = self.lower_claims.get(&at)
            && self.identity.owns(&lower.metadata)
        {
            if made_for(&lower) == upper.uid().as_deref() {
                return Ok(Ok(()));
            }
            let kept = if retained(&lower) {
                "its volume was retained (reclaim policy Retain): delete the lower claim to reuse the name"
            } else {
                "it is deleted once no lower pod uses it"
            };
            return Ok(Err(Blocked::Conflict(format!(
                "lower cluster {} still has the claim {ns}/{name} of an earlier upper claim of that name; {kept}",
                self.cluster_name
            ))));
        }
        self.create_lower_claim(&lower_claim(&self.identity, &upper, &self.overrides.get()))
            .await
    }

    async fn create_lower_claim(&self, claim: &PersistentVolumeClaim) -> Result<Result<(), Blocked>, Error> {
        let (ns, name) = at(&claim.metadata);
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.lower.clone(), &ns);
        self.lower_limit.acquire().await;
        let existing = match api.create(&PostParams::default(), claim).await {
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

    /// One resync pass; `again` when it learnt a StorageClass's binding mode.
    pub async fn sync(&self) -> crate::act::Pass {
        let overrides = self.overrides.get();
        let inputs = vec![
            self.upper_pods.changes(),
            self.upper_claims.changes(),
            self.upper_volumes.changes(),
            self.lower_claims.changes(),
            self.lower_pods.changes(),
            self.upper_classes.changes(),
            // The overrides in force, by identity: a change swaps them whole.
            Arc::as_ptr(&overrides).addr() as u64,
        ];
        let now = Instant::now();
        if self.last_pass.unchanged(&inputs, now) {
            return crate::act::Pass::default();
        }
        let classes = self.classes.lock().map(|c| c.clone()).unwrap_or_default();
        let (upper_pods, upper_claims, upper_volumes, lower_claims, lower_pods, upper_classes) = (
            self.upper_pods.state(),
            self.upper_claims.state(),
            self.upper_volumes.state(),
            self.lower_claims.state(),
            self.lower_pods.state(),
            self.upper_classes.state(),
        );
        let writes = plan(&View {
            identity: &self.identity,
            upper_pods: &upper_pods,
            upper_claims: &upper_claims,
            upper_volumes: &upper_volumes,
            lower_claims: &lower_claims,
            lower_pods: &lower_pods,
            classes: &classes,
            upper_classes: &upper_classes,
            overrides: &overrides,
        });
        self.last_pass.record(inputs, writes.is_empty(), now);
        let planned_in = now.elapsed();
        let planned = writes.into_iter().map(|w| self.perform(w).boxed()).collect();
        crate::act::Pass {
            again: crate::act::act(planned, 8, "volume", &self.metrics).await,
            planned_in,
        }
    }

    /// Performs one write; true when it learnt a StorageClass's binding mode.
    async fn perform(&self, write: Write) -> Result<bool, Error> {
        let upper_volumes: Api<PersistentVolume> = Api::all(self.upper.clone());
        match write {
            Write::CreateLowerClaim { claim } => {
                // A claim the upper scheduler picked this node for goes where the pods using
                // it may go, never into another tenant's namespace.
                let (ns, _) = at(&claim.metadata);
                let made = match self.namespaces.ensure(&ns).await? {
                    Ok(()) => self.create_lower_claim(&claim).await?,
                    Err(blocked) => Err(blocked),
                };
                if let Err(blocked) = made {
                    tracing::warn!("{blocked:?}");
                }
            }
            Write::MarkSelected { namespace, name } => {
                let patch =
                    json!({"metadata": {"annotations": {names::PVC_SELECTED_NODE: self.identity.node}}});
                self.upper_limit.acquire().await;
                Api::<PersistentVolumeClaim>::namespaced(self.upper.clone(), &namespace)
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(Error::on("upper", "patch", format!("claim {namespace}/{name}")))?;
            }
            Write::LearnClass { class } if !self.read_lower_classes => {
                // Classes are cluster-wide, out of a namespace scope's reach: the claim is
                // taken as ready while it binds, which holds for either binding mode (the
                // lower scheduler holds the pod until its claim is bound).
                if let Ok(mut m) = self.classes.lock() {
                    m.insert(class, true);
                }
                return Ok(true);
            }
            Write::LearnClass { class } => {
                let found = Api::<StorageClass>::all(self.lower.clone())
                    .get_opt(&class)
                    .await
                    .map_err(Error::on("lower", "get", format!("storage class {class}")))?;
                // A class that does not exist (yet) is asked about again on the next pass.
                if let Some(c) = found {
                    let waits = c.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer");
                    if let Ok(mut m) = self.classes.lock() {
                        m.insert(class, waits);
                    }
                    return Ok(true);
                }
            }
            Write::CreateVolume { volume } => {
                let name = volume.name_any();
                self.upper_limit.acquire().await;
                match upper_volumes.create(&PostParams::default(), &volume).await {
                    Ok(_) => tracing::info!(volume = %name, "volume reflected upstream"),
                    Err(e) if code(&e) == Some(409) => {}
                    Err(e) => return Err(Error::on("upper", "create", format!("volume {name}"))(e)),
                }
            }
            Write::ResizeVolume { name, capacity } => {
                let patch = json!({"spec": {"capacity": capacity}});
                self.upper_limit.acquire().await;
                upper_volumes
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(Error::on("upper", "patch", format!("volume {name}")))?;
            }
            Write::ExpandLowerClaim {
                namespace,
                name,
                storage,
            } => {
                let key = format!("{namespace}/{name}={}", storage.0);
                if self.refused_expansions.lock().is_ok_and(|r| r.contains(&key)) {
                    return Ok(false);
                }
                let patch = json!({"spec": {"resources": {"requests": {"storage": storage}}}});
                self.lower_limit.acquire().await;
                match Api::<PersistentVolumeClaim>::namespaced(self.lower.clone(), &namespace)
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        tracing::info!(claim = %format!("{namespace}/{name}"), storage = %storage.0, "expanded below")
                    }
                    // The lower class does not allow expansion (or the size is invalid there):
                    // said once, not retried every pass.
                    Err(e) if matches!(code(&e), Some(403) | Some(422)) => {
                        tracing::warn!(claim = %format!("{namespace}/{name}"), "the lower cluster refused the expansion: {e}");
                        if let Ok(mut refused) = self.refused_expansions.lock() {
                            refused.insert(key);
                        }
                    }
                    Err(e) => {
                        return Err(Error::on("lower", "patch", format!("claim {namespace}/{name}"))(
                            e,
                        ));
                    }
                }
            }
            Write::SetReclaimPolicy {
                namespace,
                name,
                retain,
            } => {
                let value = retain.then_some("Retain");
                let patch = json!({"metadata": {"annotations": {names::LOWER_CLAIM_RECLAIM_POLICY: value}}});
                self.lower_limit.acquire().await;
                Api::<PersistentVolumeClaim>::namespaced(self.lower.clone(), &namespace)
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(Error::on("lower", "patch", format!("claim {namespace}/{name}")))?;
                tracing::info!(claim = %format!("{namespace}/{name}"), retain, "reclaim policy recorded below");
            }
            Write::DeleteLowerClaim {
                namespace,
                name,
                uid,
                why,
            } => {
                self.lower_limit.acquire().await;
                let api = Api::<PersistentVolumeClaim>::namespaced(self.lower.clone(), &namespace);
                let deleted = delete_exact(&api, &name, uid, None).await.map_err(Error::on(
                    "lower",
                    "delete",
                    format!("claim {namespace}/{name}"),
                ))?;
                if deleted == Deleted::Accepted {
                    tracing::info!(claim = %format!("{namespace}/{name}"), "deleted below: {why}");
                }
            }
            Write::DeleteUpperVolume { name, uid, why } => {
                self.upper_limit.acquire().await;
                let deleted = delete_exact(&upper_volumes, &name, uid, None)
                    .await
                    .map_err(Error::on("upper", "delete", format!("volume {name}")))?;
                if deleted == Deleted::Accepted {
                    tracing::info!(volume = %name, "deleted upstream: {why}");
                }
            }
        }
        Ok(false)
    }
}
