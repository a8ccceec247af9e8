//! Copies: the ConfigMaps and Secrets that pods of this node reference, reflected into the
//! lower cluster under the same namespace and name.
//!
//! The model: a copy exists below exactly while its upper object exists and some pod of this
//! upper cluster needs it there (an upper pod bound to this node, or a lower pod of this upper
//! cluster that still runs), and its content is the upper object's. Copies carry the upper
//! cluster's mark only, not a node's: virtual nodes of one upper cluster over one lower
//! cluster share them, write the same content from the same upper object, and each keeps a
//! copy while any lower pod of the cluster references it. A lower object of the same name
//! without our mark is never touched; the pod that needs it is not started below.
//!
//! Two paths keep the model true. Before a pod is created below, [`Copies::prepare`] makes
//! every copy it references exist with current content. [`Copies::run`] resyncs from the
//! watch caches on every change and every second: it follows upper edits, repairs copies
//! edited or deleted below, deletes copies whose upper object is gone, and deletes copies
//! nobody references once they have been unreferenced for the collection delay (which
//! absorbs rolling updates). Values are never logged.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tensile_common::cache::Cache;

use futures::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    ConfigMap, EndpointAddress, EndpointPort, EndpointSubset, Endpoints, Pod, PodSpec, Secret, Service,
    ServicePort, ServiceSpec, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tensile_common::api::{Deleted, delete_exact};
use tensile_common::names;

use crate::metrics::Metrics;
use crate::ratelimit::TokenBucket;
use crate::translate;

/// The kinds of object that travel with a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    ConfigMap,
    Secret,
    Service,
    Endpoints,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::ConfigMap => "ConfigMap",
            Kind::Secret => "Secret",
            Kind::Service => "Service",
            Kind::Endpoints => "Endpoints",
        })
    }
}

/// One object a pod spec names, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub kind: Kind,
    pub name: String,
    /// The pod starts without it (the reference says `optional`, or it is an image pull
    /// secret, which a kubelet treats as a warning).
    pub optional: bool,
    /// Where the spec names it, for messages: `volume "config"`, `env of container "app"`.
    pub via: String,
}

/// Every ConfigMap and Secret `spec` references, in spec order, skipping volumes for which
/// `carried` is false (volumes that do not travel with the pod).
pub fn references(spec: &PodSpec, carried: impl Fn(&Volume) -> bool) -> Vec<Reference> {
    let mut refs = Vec::new();
    let mut add = |kind, name: &str, optional: Option<bool>, via: String| {
        if !name.is_empty() {
            refs.push(Reference {
                kind,
                name: name.to_owned(),
                optional: optional.unwrap_or(false),
                via,
            });
        }
    };
    for v in spec.volumes.iter().flatten().filter(|v| carried(v)) {
        let via = || format!("volume {:?}", v.name);
        if let Some(c) = &v.config_map {
            add(Kind::ConfigMap, &c.name, c.optional, via());
        }
        if let Some(s) = &v.secret {
            add(
                Kind::Secret,
                s.secret_name.as_deref().unwrap_or(""),
                s.optional,
                via(),
            );
        }
        for source in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            if let Some(c) = &source.config_map {
                add(Kind::ConfigMap, &c.name, c.optional, via());
            }
            if let Some(s) = &source.secret {
                add(Kind::Secret, &s.name, s.optional, via());
            }
        }
        // Volume sources whose driver reads credentials from a Secret.
        let secret_refs = [
            v.cephfs.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.rbd.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.iscsi.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.flex_volume.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.storageos.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.scale_io.as_ref().map(|s| &s.secret_ref),
            v.csi.as_ref().and_then(|s| s.node_publish_secret_ref.as_ref()),
        ];
        for r in secret_refs.into_iter().flatten() {
            add(Kind::Secret, &r.name, None, via());
        }
        if let Some(a) = &v.azure_file {
            add(Kind::Secret, &a.secret_name, None, via());
        }
    }
    let containers = spec.init_containers.iter().flatten().chain(&spec.containers);
    for c in containers {
        for e in c.env.iter().flatten() {
            let Some(from) = &e.value_from else { continue };
            let via = || format!("env {} of container {:?}", e.name, c.name);
            if let Some(k) = &from.config_map_key_ref {
                add(Kind::ConfigMap, &k.name, k.optional, via());
            }
            if let Some(k) = &from.secret_key_ref {
                add(Kind::Secret, &k.name, k.optional, via());
            }
        }
        for e in c.env_from.iter().flatten() {
            let via = || format!("envFrom of container {:?}", c.name);
            if let Some(r) = &e.config_map_ref {
                add(Kind::ConfigMap, &r.name, r.optional, via());
            }
            if let Some(r) = &e.secret_ref {
                add(Kind::Secret, &r.name, r.optional, via());
            }
        }
    }
    for s in spec.image_pull_secrets.iter().flatten() {
        add(Kind::Secret, &s.name, Some(true), "imagePullSecrets".into());
    }
    refs
}

/// The references of an upper pod that travel with it (the upper cluster's service-account
/// token volumes stay behind, see [`translate`]).
pub fn upper_references(pod: &Pod) -> Vec<Reference> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let service_account = translate::service_account(spec);
    references(spec, |v| !translate::is_upper_token_volume(v, &service_account))
}

fn lower_references(pod: &Pod) -> Vec<Reference> {
    pod.spec
        .as_ref()
        .map(|s| references(s, |_| true))
        .unwrap_or_default()
}

/// What is reflected of an object's payload and how a copy is compared.
pub trait Reflected:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Send
    + Sync
    + 'static
    + DeserializeOwned
    + Serialize
    + fmt::Debug
{
    const KIND: Kind;
    /// The copy's content: the payload of `upper`, plus any annotations of its own (the rest
    /// of the metadata is set by the caller).
    fn payload(upper: &Self) -> Self;
    /// Same payload (data, type, immutability).
    fn same_payload(&self, other: &Self) -> bool;
    /// Fields the lower cluster assigned that an update must keep (a Service's cluster IP).
    fn carry_over(&mut self, _actual: &Self) {}
}

fn empty_as_none<T: PartialEq + Default>(v: &Option<T>) -> Option<&T> {
    v.as_ref().filter(|v| **v != T::default())
}

impl Reflected for ConfigMap {
    const KIND: Kind = Kind::ConfigMap;
    fn payload(upper: &Self) -> Self {
        ConfigMap {
            data: upper.data.clone(),
            binary_data: upper.binary_data.clone(),
            immutable: upper.immutable,
            metadata: ObjectMeta::default(),
        }
    }
    fn same_payload(&self, other: &Self) -> bool {
        empty_as_none(&self.data) == empty_as_none(&other.data)
            && empty_as_none(&self.binary_data) == empty_as_none(&other.binary_data)
            && self.immutable.unwrap_or(false) == other.immutable.unwrap_or(false)
    }
}

impl Reflected for Secret {
    const KIND: Kind = Kind::Secret;
    fn payload(upper: &Self) -> Self {
        Secret {
            data: upper.data.clone(),
            type_: upper.type_.clone(),
            immutable: upper.immutable,
            metadata: ObjectMeta::default(),
            string_data: None,
        }
    }
    fn same_payload(&self, other: &Self) -> bool {
        empty_as_none(&self.data) == empty_as_none(&other.data)
            && self.type_.as_deref().unwrap_or("Opaque") == other.type_.as_deref().unwrap_or("Opaque")
            && self.immutable.unwrap_or(false) == other.immutable.unwrap_or(false)
    }
}

/// A Service below: the upper ports and kind, no selector (its endpoints are the upper
/// ones, reflected), the upper selector kept in an annotation, the cluster IP left to the
/// lower cluster (a headless Service stays headless).
impl Reflected for Service {
    const KIND: Kind = Kind::Service;
    fn payload(upper: &Self) -> Self {
        let spec = upper.spec.clone().unwrap_or_default();
        let headless = spec.cluster_ip.as_deref() == Some("None");
        let external = spec.type_.as_deref() == Some("ExternalName");
        let ports = spec.ports.map(|ports| {
            ports
                .into_iter()
                .map(|p| ServicePort { node_port: None, ..p })
                .collect()
        });
        let selector = spec
            .selector
            .as_ref()
            .and_then(|s| serde_json::to_string(s).ok())
            .map(|s| BTreeMap::from([(names::SERVICE_SELECTOR.to_owned(), s)]));
        Service {
            metadata: ObjectMeta {
                annotations: selector,
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some(if external { "ExternalName" } else { "ClusterIP" }.into()),
                external_name: spec.external_name,
                cluster_ip: headless.then(|| "None".into()),
                ports,
                publish_not_ready_addresses: spec.publish_not_ready_addresses,
                session_affinity: spec.session_affinity,
                session_affinity_config: spec.session_affinity_config,
                ..Default::default()
            }),
            status: None,
        }
    }
    fn same_payload(&self, other: &Self) -> bool {
        let key = |s: &Service| {
            let spec = s.spec.clone().unwrap_or_default();
            let ports: Vec<_> = spec
                .ports
                .unwrap_or_default()
                .into_iter()
                .map(|p| {
                    let target = p.target_port.unwrap_or(IntOrString::Int(p.port));
                    (
                        p.name.unwrap_or_default(),
                        p.port,
                        p.protocol.unwrap_or_else(|| "TCP".into()),
                        target,
                        p.app_protocol,
                    )
                })
                .collect();
            (
                spec.type_.unwrap_or_else(|| "ClusterIP".into()),
                spec.cluster_ip.as_deref() == Some("None"),
                spec.external_name,
                ports,
                spec.publish_not_ready_addresses.unwrap_or(false),
                spec.session_affinity.unwrap_or_else(|| "None".into()),
                spec.selector.unwrap_or_default(),
            )
        };
        key(self) == key(other)
    }
    fn carry_over(&mut self, actual: &Self) {
        if let (Some(desired), Some(actual)) = (self.spec.as_mut(), actual.spec.as_ref())
            && desired.cluster_ip.as_deref() != Some("None")
        {
            desired.cluster_ip = actual.cluster_ip.clone();
            desired.cluster_ips = actual.cluster_ips.clone();
            desired.ip_families = actual.ip_families.clone();
            desired.ip_family_policy = actual.ip_family_policy.clone();
        }
    }
}

/// Endpoints below: the upper addresses and ports, without references to upper pods and
/// nodes (they mean nothing below).
impl Reflected for Endpoints {
    const KIND: Kind = Kind::Endpoints;
    fn payload(upper: &Self) -> Self {
        let strip = |addresses: Option<Vec<EndpointAddress>>| {
            addresses.map(|a| {
                a.into_iter()
                    .map(|a| EndpointAddress {
                        node_name: None,
                        target_ref: None,
                        ..a
                    })
                    .collect()
            })
        };
        let subsets = upper.subsets.clone().map(|subsets| {
            subsets
                .into_iter()
                .map(|s| EndpointSubset {
                    addresses: strip(s.addresses),
                    not_ready_addresses: strip(s.not_ready_addresses),
                    ports: s.ports.map(|ports| {
                        ports
                            .into_iter()
                            .map(|p| EndpointPort {
                                protocol: Some(p.protocol.unwrap_or_else(|| "TCP".into())),
                                ..p
                            })
                            .collect()
                    }),
                })
                .collect()
        });
        Endpoints {
            metadata: ObjectMeta::default(),
            subsets,
        }
    }
    fn same_payload(&self, other: &Self) -> bool {
        empty_as_none(&Self::payload(self).subsets) == empty_as_none(&Self::payload(other).subsets)
    }
}

/// Upper annotations that describe the upper object itself and are not copied.
const UPPER_ONLY_ANNOTATIONS: [&str; 1] = ["kubectl.kubernetes.io/last-applied-configuration"];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("lower {verb} {kind} {key}: {source}")]
    Api {
        verb: &'static str,
        kind: Kind,
        key: String,
        #[source]
        source: kube::Error,
    },
}

/// Why a pod cannot be created below yet.
#[derive(Debug, PartialEq, Eq)]
pub enum Blocked {
    /// A required object does not exist upstream.
    Missing(String),
    /// A same-named lower object is not ours.
    Conflict(String),
}

/// Outcome of making one copy current.
enum Ensured {
    Current,
    Conflict,
}

/// The reflection of ConfigMaps, Secrets, Services and Endpoints for one virtual node.
pub struct Copies {
    pub lower: kube::Client,
    pub cluster_id: String,
    /// The lower cluster's name, for messages.
    pub cluster_name: String,
    pub upper_config_maps: Cache<ConfigMap>,
    pub upper_secrets: Cache<Secret>,
    /// Lower ConfigMaps and Secrets carrying this upper cluster's mark.
    pub lower_config_maps: Cache<ConfigMap>,
    pub lower_secrets: Cache<Secret>,
    /// Upper pods bound to this node.
    pub upper_pods: Cache<Pod>,
    /// Lower pods that have not finished (every owner; filtered by mark here).
    pub lower_pods: Cache<Pod>,
    pub limit: TokenBucket,
    pub metrics: Arc<Metrics>,
    /// How long a copy stays after its last reference went.
    pub gc_delay: Duration,
    pub unreferenced_since: Mutex<HashMap<Key, Instant>>,
    /// Copies a foreign lower object blocks, and since when.
    pub conflicts: Mutex<HashMap<Key, Instant>>,
    /// Services and their Endpoints, when their reflection is enabled.
    pub services: Option<ServiceStores>,
    /// Reports conflicts found by the resync on the upper object.
    pub events: crate::events::Events,
}

/// The watch caches of Service reflection.
pub struct ServiceStores {
    pub upper_services: Cache<Service>,
    pub upper_endpoints: Cache<Endpoints>,
    /// Lower Services and Endpoints carrying this upper cluster's mark.
    pub lower_services: Cache<Service>,
    pub lower_endpoints: Cache<Endpoints>,
    /// Also reflect kube-system's Services and `default/kubernetes`.
    pub include_system: bool,
}

type Key = (Kind, String, String);

impl Copies {
    fn owns(&self, meta: &ObjectMeta) -> bool {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(names::MARK_CLUSTER))
            .is_some_and(|c| *c == self.cluster_id)
    }

    /// The lower copy of `upper`: its payload, its labels and annotations, our mark.
    fn desired<K: Reflected>(&self, upper: &K) -> K {
        let mut copy = K::payload(upper);
        let meta = copy.meta_mut();
        meta.name = upper.meta().name.clone();
        meta.namespace = upper.meta().namespace.clone();
        let mut labels: BTreeMap<String, String> = upper
            .meta()
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| {
                ![names::MARK_CLUSTER, names::MARK_NODE, names::MARK_UPPER_UID].contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.insert(names::MARK_CLUSTER.to_owned(), self.cluster_id.clone());
        meta.labels = Some(labels);
        let mut annotations: BTreeMap<String, String> = upper
            .meta()
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| !UPPER_ONLY_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        annotations.extend(meta.annotations.take().unwrap_or_default());
        meta.annotations = (!annotations.is_empty()).then_some(annotations);
        copy
    }

    fn current<K: Reflected>(desired: &K, actual: &K) -> bool {
        let (d, a) = (desired.meta(), actual.meta());
        desired.same_payload(actual)
            && empty_as_none(&d.labels) == empty_as_none(&a.labels)
            && empty_as_none(&d.annotations) == empty_as_none(&a.annotations)
    }

    /// Makes the lower copy of `upper` exist with current content. `cached` is what the
    /// lower watch shows under that name (ours only).
    async fn ensure<K: Reflected>(&self, upper: &K, cached: Option<Arc<K>>) -> Result<Ensured, Error> {
        let desired = self.desired(upper);
        let ns = upper.namespace().unwrap_or_default();
        let name = upper.name_any();
        let key = format!("{ns}/{name}");
        let api: Api<K> = Api::namespaced(self.lower.clone(), &ns);
        let err = |verb| {
            let key = key.clone();
            move |source| Error::Api {
                verb,
                kind: K::KIND,
                key,
                source,
            }
        };
        let actual = match cached {
            Some(a) => Some((*a).clone()),
            None => {
                self.limit.acquire().await;
                match api.create(&PostParams::default(), &desired).await {
                    Ok(_) => {
                        tracing::info!(kind = %K::KIND, copy = %key, "created below");
                        return Ok(Ensured::Current);
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        api.get_opt(&name).await.map_err(err("get"))?
                    }
                    Err(e) => return Err(err("create")(e)),
                }
            }
        };
        let Some(actual) = actual else {
            // Deleted between our create and get: the next pass creates it.
            return Ok(Ensured::Current);
        };
        if !self.owns(actual.meta()) {
            return Ok(Ensured::Conflict);
        }
        if Self::current(&desired, &actual) {
            return Ok(Ensured::Current);
        }
        self.limit.acquire().await;
        let mut update = desired;
        update.meta_mut().resource_version = actual.resource_version();
        match api.replace(&name, &PostParams::default(), &update).await {
            Ok(_) => {
                tracing::info!(kind = %K::KIND, copy = %key, "updated below");
                Ok(Ensured::Current)
            }
            // Immutable content (an immutable object, a Secret's type) changes by
            // replacement: deleted here, created again by the next pass.
            Err(kube::Error::Api(s)) if s.code == 422 => {
                match delete_exact(&api, &name, actual.uid(), None).await {
                    Ok(deleted) => {
                        if deleted == Deleted::Accepted {
                            tracing::info!(kind = %K::KIND, copy = %key, "replacing a copy whose content is immutable");
                        }
                        Ok(Ensured::Current)
                    }
                    Err(e) => Err(err("delete")(e)),
                }
            }
            Err(e) => Err(err("update")(e)),
        }
    }

    /// Makes every copy `pod` needs exist below with current content. `Ok(Err(_))` says why
    /// the pod must not be created below yet (a message for the upper pod).
    pub async fn prepare(&self, pod: &Pod) -> Result<Result<(), Blocked>, Error> {
        let ns = pod.namespace().unwrap_or_default();
        let mut seen = BTreeSet::new();
        for r in upper_references(pod) {
            // One pass per object; a required reference wins over an optional one.
            if !seen.insert((r.kind, r.name.clone(), r.optional)) {
                continue;
            }
            let outcome = match r.kind {
                // Pods never name these; they follow namespaces, see `needs`.
                Kind::Service | Kind::Endpoints => continue,
                Kind::ConfigMap => {
                    let at = ObjectRef::new(&r.name).within(&ns);
                    self.upper_config_maps.synced().await;
                    match self.upper_config_maps.get(&at) {
                        Some(upper) => Some(self.ensure(&*upper, self.lower_config_maps.get(&at)).await?),
                        None => None,
                    }
                }
                Kind::Secret => {
                    let at = ObjectRef::new(&r.name).within(&ns);
                    self.upper_secrets.synced().await;
                    match self.upper_secrets.get(&at) {
                        Some(upper) => Some(self.ensure(&*upper, self.lower_secrets.get(&at)).await?),
                        None => None,
                    }
                }
            };
            match outcome {
                Some(Ensured::Current) => {}
                Some(Ensured::Conflict) => {
                    return Ok(Err(Blocked::Conflict(format!(
                        "lower cluster {} already has a {} {ns}/{} ({}) not created by this upper cluster; it is left untouched and the pod is not started below",
                        self.cluster_name, r.kind, r.name, r.via
                    ))));
                }
                None if r.optional => {}
                None => {
                    let token = if r.kind == Kind::Secret {
                        " (service-account token Secrets are never copied)"
                    } else {
                        ""
                    };
                    return Ok(Err(Blocked::Missing(format!(
                        "{} {ns}/{} ({}) does not exist in the upper cluster{token}",
                        r.kind, r.name, r.via
                    ))));
                }
            }
        }
        Ok(Ok(()))
    }

    /// Resyncs every copy from the watch caches: on each `changed` notification and at least
    /// every second, until dropped.
    pub async fn run(self: Arc<Self>, changed: Arc<tokio::sync::Notify>) {
        self.upper_config_maps.synced().await;
        self.upper_secrets.synced().await;
        self.lower_config_maps.synced().await;
        self.lower_secrets.synced().await;
        self.upper_pods.synced().await;
        self.lower_pods.synced().await;
        if let Some(s) = &self.services {
            s.upper_services.synced().await;
            s.upper_endpoints.synced().await;
            s.lower_services.synced().await;
            s.lower_endpoints.synced().await;
        }
        loop {
            self.sync().await;
            tokio::select! {
                _ = changed.notified() => tokio::time::sleep(Duration::from_millis(50)).await,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// What the pods of this upper cluster need below: `(needed, used_below)`. A copy is
    /// needed while an upper pod of this node or a lower pod of the cluster references it,
    /// a Service (and its Endpoints) while such pods run in its namespace; `used_below` is
    /// the part running lower pods account for.
    fn needs(&self) -> (BTreeSet<Key>, BTreeSet<Key>) {
        let mut needed: BTreeSet<Key> = BTreeSet::new();
        let mut namespaces: BTreeSet<String> = BTreeSet::new();
        for pod in self.upper_pods.state() {
            if translate::is_terminal(&pod) {
                continue;
            }
            let ns = pod.namespace().unwrap_or_default();
            needed.extend(
                upper_references(&pod)
                    .into_iter()
                    .map(|r| (r.kind, ns.clone(), r.name)),
            );
            namespaces.insert(ns);
        }
        let mut used_below: BTreeSet<Key> = BTreeSet::new();
        for pod in self.lower_pods.state() {
            if !self.owns(&pod.metadata) {
                continue;
            }
            let ns = pod.namespace().unwrap_or_default();
            used_below.extend(
                lower_references(&pod)
                    .into_iter()
                    .map(|r| (r.kind, ns.clone(), r.name)),
            );
            namespaces.insert(ns);
        }
        if let Some(s) = &self.services {
            for svc in s.upper_services.state() {
                let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
                let system = ns == "kube-system" || (ns == "default" && name == "kubernetes");
                if namespaces.contains(&ns) && (s.include_system || !system) {
                    needed.insert((Kind::Service, ns.clone(), name.clone()));
                    needed.insert((Kind::Endpoints, ns, name));
                }
            }
        }
        needed.extend(used_below.iter().cloned());
        (needed, used_below)
    }

    /// One resync pass.
    pub async fn sync(&self) {
        let (needed, used_below) = self.needs();
        let mut work: Vec<Write<'_>> = Vec::new();
        {
            let now = Instant::now();
            let mut since = match self.unreferenced_since.lock() {
                Ok(s) => s,
                Err(poisoned) => poisoned.into_inner(),
            };
            let mut conflicts = match self.conflicts.lock() {
                Ok(c) => c,
                Err(poisoned) => poisoned.into_inner(),
            };
            // Conflicts are retried every 30 s, not on every pass.
            conflicts.retain(|_, at| now.duration_since(*at) < Duration::from_secs(30));
            let plan = Plan {
                needed: &needed,
                used_below: &used_below,
                now,
                conflicts: &conflicts,
            };
            self.plan(
                self.upper_config_maps.store().clone(),
                self.lower_config_maps.store().clone(),
                false,
                &plan,
                &mut since,
                &mut work,
            );
            self.plan(
                self.upper_secrets.store().clone(),
                self.lower_secrets.store().clone(),
                false,
                &plan,
                &mut since,
                &mut work,
            );
            if let Some(s) = &self.services {
                self.plan(
                    s.upper_services.store().clone(),
                    s.lower_services.store().clone(),
                    true,
                    &plan,
                    &mut since,
                    &mut work,
                );
                self.plan(
                    s.upper_endpoints.store().clone(),
                    s.lower_endpoints.store().clone(),
                    true,
                    &plan,
                    &mut since,
                    &mut work,
                );
            }
        }
        let mut copies = self.lower_config_maps.len() + self.lower_secrets.len();
        if let Some(s) = &self.services {
            copies += s.lower_services.len() + s.lower_endpoints.len();
        }
        self.metrics.copies.set(copies.try_into().unwrap_or(i64::MAX));
        futures::stream::iter(work)
            .for_each_concurrent(16, |write| async move {
                if let Err(e) = write.await {
                    self.metrics.api_error("lower", "copy");
                    tracing::warn!("copy resync: {e}");
                }
            })
            .await;
    }

    /// The writes that bring the copies of one kind to the model. `create_needed`: the
    /// resync creates every needed copy (Services); otherwise it only repairs copies that
    /// running lower pods use (the pod path creates the others and reports conflicts).
    fn plan<'a, K: Reflected>(
        &'a self,
        upper: Store<K>,
        lower: Store<K>,
        create_needed: bool,
        plan: &Plan<'_>,
        since: &mut HashMap<Key, Instant>,
        work: &mut Vec<Write<'a>>,
    ) {
        for copy in lower.state() {
            if !self.owns(copy.meta()) || copy.meta().deletion_timestamp.is_some() {
                continue;
            }
            let (ns, name) = (copy.namespace().unwrap_or_default(), copy.name_any());
            let key = (K::KIND, ns.clone(), name.clone());
            let Some(source) = upper.get(&ObjectRef::new(&name).within(&ns)) else {
                work.push(Box::pin(self.delete::<K>(
                    ns,
                    name,
                    copy.uid(),
                    "its upper object is gone",
                )));
                since.remove(&key);
                continue;
            };
            if plan.needed.contains(&key) {
                since.remove(&key);
                if !Self::current(&self.desired(&*source), &copy) {
                    work.push(Box::pin(self.ensure_quietly(source, Some(copy.clone()))));
                }
                continue;
            }
            let first = *since.entry(key.clone()).or_insert(plan.now);
            if plan.now.duration_since(first) >= self.gc_delay {
                work.push(Box::pin(self.delete::<K>(
                    ns,
                    name,
                    copy.uid(),
                    "no pod needs it",
                )));
                since.remove(&key);
            }
        }
        let missing = if create_needed {
            plan.needed
        } else {
            plan.used_below
        };
        for key @ (kind, ns, name) in missing {
            if *kind != K::KIND || plan.conflicts.contains_key(key) {
                continue;
            }
            let at = ObjectRef::new(name).within(ns);
            if lower.get(&at).is_none()
                && let Some(source) = upper.get(&at)
            {
                work.push(Box::pin(self.ensure_quietly(source, None)));
            }
        }
        since.retain(|(kind, ns, name), _| {
            *kind != K::KIND || lower.get(&ObjectRef::new(name).within(ns)).is_some()
        });
    }

    /// [`Copies::ensure`] for the resync: a conflict is remembered (retried in 30 s) and
    /// reported once as a Warning event on the upper object.
    async fn ensure_quietly<K: Reflected>(&self, upper: Arc<K>, cached: Option<Arc<K>>) -> Result<(), Error> {
        if let Ensured::Conflict = self.ensure(&*upper, cached).await? {
            let key = (K::KIND, upper.namespace().unwrap_or_default(), upper.name_any());
            let first = match self.conflicts.lock() {
                Ok(mut c) => c.insert(key.clone(), Instant::now()).is_none(),
                Err(_) => false,
            };
            let message = format!(
                "lower cluster {} already has a {} {}/{} not created by this upper cluster; it is left untouched",
                self.cluster_name, key.0, key.1, key.2
            );
            tracing::warn!("{message}");
            if first {
                self.events.publish(
                    upper.object_ref(&()),
                    EventType::Warning,
                    "LowerCopyConflict",
                    &message,
                );
            }
        }
        Ok(())
    }

    /// Deletes exactly the copy with `uid` (a newer object of the same name is left alone).
    async fn delete<K: Reflected>(
        &self,
        ns: String,
        name: String,
        uid: Option<String>,
        why: &str,
    ) -> Result<(), Error> {
        self.limit.acquire().await;
        match delete_exact(&Api::<K>::namespaced(self.lower.clone(), &ns), &name, uid, None).await {
            Ok(Deleted::Accepted) => {
                tracing::info!(kind = %K::KIND, copy = %format!("{ns}/{name}"), "deleted below: {why}");
                Ok(())
            }
            Ok(Deleted::AlreadyGone) => Ok(()),
            Err(source) => Err(Error::Api {
                verb: "delete",
                kind: K::KIND,
                key: format!("{ns}/{name}"),
                source,
            }),
        }
    }
}

/// What one resync pass plans from.
struct Plan<'a> {
    needed: &'a BTreeSet<Key>,
    used_below: &'a BTreeSet<Key>,
    now: Instant,
    conflicts: &'a HashMap<Key, Instant>,
}

/// One write of a resync pass.
type Write<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send + 'a>>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "n"}, "spec": spec})).unwrap()
    }

    #[test]
    fn every_kind_of_reference_is_found_with_its_optionality() {
        let p = pod(json!({
            "serviceAccountName": "sa",
            "imagePullSecrets": [{"name": "pull"}],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "c1"}},
                {"name": "sec", "secret": {"secretName": "s1", "optional": true}},
                {"name": "proj", "projected": {"sources": [
                    {"configMap": {"name": "c2"}}, {"secret": {"name": "s2"}}]}},
                {"name": "ceph", "cephfs": {"monitors": ["m"], "secretRef": {"name": "s3"}}},
                {"name": "csi", "csi": {"driver": "d", "nodePublishSecretRef": {"name": "s4"}}},
                {"name": "sa-token-abcde", "secret": {"secretName": "sa-token-abcde"}},
                {"name": "kube-api-access-x", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt"}}]}}
            ],
            "initContainers": [{"name": "init", "envFrom": [{"secretRef": {"name": "s5"}}]}],
            "containers": [{"name": "app",
                "env": [
                    {"name": "A", "value": "plain"},
                    {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c3", "key": "k", "optional": true}}},
                    {"name": "C", "valueFrom": {"secretKeyRef": {"name": "s6", "key": "k"}}},
                    {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                ],
                "envFrom": [{"configMapRef": {"name": "c4"}}]}]
        }));
        let got: Vec<(Kind, String, bool)> = upper_references(&p)
            .into_iter()
            .map(|r| (r.kind, r.name, r.optional))
            .collect();
        let want: Vec<(Kind, String, bool)> = [
            (Kind::ConfigMap, "c1", false),
            (Kind::Secret, "s1", true),
            (Kind::ConfigMap, "c2", false),
            (Kind::Secret, "s2", false),
            (Kind::Secret, "s3", false),
            (Kind::Secret, "s4", false),
            (Kind::Secret, "s5", false),
            (Kind::ConfigMap, "c3", true),
            (Kind::Secret, "s6", false),
            (Kind::ConfigMap, "c4", false),
            (Kind::Secret, "pull", true),
        ]
        .into_iter()
        .map(|(k, n, o)| (k, n.to_owned(), o))
        .collect();
        assert_eq!(
            got, want,
            "the token volumes of the upper cluster are not references"
        );
        let via: Vec<String> = upper_references(&p).into_iter().map(|r| r.via).collect();
        assert_eq!(via[0], "volume \"cfg\"");
        assert_eq!(via[6], "envFrom of container \"init\"");
        assert_eq!(via[8], "env C of container \"app\"");
    }

    #[test]
    fn a_pod_without_spec_or_references_needs_nothing() {
        assert!(upper_references(&Pod::default()).is_empty());
        assert!(upper_references(&pod(json!({"containers": [{"name": "c"}]}))).is_empty());
    }

    #[test]
    fn payload_comparison_ignores_empty_versus_absent() {
        let a: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {}})).unwrap();
        let b: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
        assert!(a.same_payload(&b));
        let c: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "data": {"k": "v"}})).unwrap();
        assert!(!a.same_payload(&c));
        let s1: Secret =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "type": "Opaque"})).unwrap();
        let s2: Secret = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
        assert!(s1.same_payload(&s2));
        let s3: Secret =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "type": "kubernetes.io/tls"})).unwrap();
        assert!(!s1.same_payload(&s3));
    }
}
