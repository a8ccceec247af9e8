//! The world: every watch cache a virtual node reads, built in one place, with one gate that
//! opens once all of them have listed ([`World::synced`]). The pod controller, the node loop,
//! the copy and volume resyncs and the kubelet API read the world; none builds a watch of its
//! own. Each cache keeps only what its readers read ([`crate::model::trim`]).
//!
//! Building the world starts nothing: [`Watches`] holds the futures that keep the caches
//! current (the caller runs them, each named) and the pod controller's trigger streams, and
//! [`Signals`] the wake-ups each resync waits on.
//!
//! Beside the caches: [`fetched`] (upper ConfigMaps and Secrets read by name, for a credential
//! that may not list them), [`overrides`] (the override file in force, followed as it
//! changes) and [`scale_ups`] (the lower autoscalers' signals on pending pods).

pub mod fetched;
pub mod overrides;
pub mod scale_ups;

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{
    ConfigMap, Endpoints, Node, PersistentVolume, PersistentVolumeClaim, ResourceQuota, Secret, Service,
};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::Api;
use kube::runtime::watcher;
use tensile_common::cache::{self, Cache, LeanPod, Namespaces, watched, watched_in};
use tokio::sync::Notify;

use crate::model::trim::{self, LowerPod, PodLoad, UpperPod};
use crate::world::fetched::{Fetched, fetched};
use tensile_common::lower::identity::Identity;
use tensile_common::resources::is_terminal;

/// Every cache of one virtual node.
#[derive(Clone)]
pub struct World {
    /// Upper pods bound to this node.
    pub upper_pods: Cache<UpperPod>,
    /// Lower pods carrying this node's marks.
    pub lower_pods: Cache<LowerPod>,
    /// Every unfinished lower pod (other tenants' too) of the namespaces read below: the load
    /// on the lower nodes, or on the served namespaces' quotas.
    pub lower_load: Cache<PodLoad>,
    /// The lower nodes (none under a namespace scope, which cannot read them).
    pub lower_nodes: Cache<Node>,
    /// Under a namespace scope, the served namespaces' ResourceQuotas (the room shown).
    pub lower_quotas: Cache<ResourceQuota>,
    /// This node's own upper Node.
    pub upper_node: Cache<Node>,
    /// Upper ConfigMaps and Secrets that pods bound here reference, metadata only (never
    /// service-account tokens), read by name.
    pub upper_config_maps: Fetched<ConfigMap>,
    pub upper_secrets: Fetched<Secret>,
    /// Lower ConfigMaps and Secrets carrying this upper cluster's mark.
    pub lower_config_maps: Cache<ConfigMap>,
    pub lower_secrets: Cache<Secret>,
    /// Services and Endpoints both sides, when their reflection is enabled.
    pub services: Option<ServiceStores>,
    pub upper_claims: Cache<PersistentVolumeClaim>,
    pub upper_classes: Cache<StorageClass>,
    /// Upper volumes and lower claims carrying this node's marks.
    pub upper_volumes: Cache<PersistentVolume>,
    pub lower_claims: Cache<PersistentVolumeClaim>,
    /// The lower Secrets of upper credentials of this node's pods: their upper tokens, pod
    /// certificates and trust bundles.
    pub lower_tokens: Cache<Secret>,
}

/// What wakes each loop: lower nodes and pods (the node loop), what copies and volumes read.
#[derive(Clone, Default)]
pub struct Signals {
    pub lower_changed: Arc<Notify>,
    pub copies_changed: Arc<Notify>,
    pub volumes_changed: Arc<Notify>,
    /// Token Secrets changed (the token keeper).
    pub tokens_changed: Arc<Notify>,
}

/// The futures that keep the world current, and the pod controller's triggers.
pub struct Watches {
    /// Each named for the supervisor.
    pub feeds: Vec<(&'static str, BoxFuture<'static, ()>)>,
    /// Upper pods bound to this node, as they change.
    pub upper_pod_events: BoxStream<'static, Result<UpperPod, watcher::Error>>,
    /// This node's lower pods, as they change. Polling it keeps `lower_pods` and
    /// `lower_load` current: one watch feeds both.
    pub lower_pod_events: BoxStream<'static, Result<LowerPod, watcher::Error>>,
}

/// What the world watches beyond the pods and nodes.
#[derive(Clone, Debug)]
pub struct Scope {
    /// Services and Endpoints are reflected.
    pub services: bool,
    /// With `services`: kube-system's Services and `default/kubernetes` too.
    pub system_services: bool,
    /// The budget of by-name reads of upper ConfigMaps and Secrets ([`crate::world::fetched`]).
    pub upper_reads_per_second: u32,
    /// The lower namespaces read and written: every one, or the served ones.
    pub lower: Namespaces,
}

impl World {
    /// The world of the node `identity` over `upper` and `lower`.
    pub fn build(
        upper: &kube::Client,
        lower: &kube::Client,
        identity: &Identity,
        scope: &Scope,
    ) -> (World, Watches, Signals) {
        let signals = Signals::default();
        let mut feeds: Vec<(&'static str, BoxFuture<'static, ()>)> = Vec::new();

        let below = &scope.lower;
        let (lower_nodes, lower_quotas) = match below {
            Namespaces::All => {
                let (nodes, watch) = cache::watched_trimmed(
                    Api::all(lower.clone()),
                    watcher::Config::default(),
                    trim::lower_node,
                    &signals.lower_changed,
                );
                feeds.push(("the lower node watch", watch.boxed()));
                (nodes, cache::empty())
            }
            Namespaces::Only(_) => {
                let (quotas, watch) = watched_in::<ResourceQuota>(
                    lower,
                    below,
                    watcher::Config::default(),
                    &signals.lower_changed,
                );
                feeds.push(("the lower quota watch", watch));
                (cache::empty(), quotas)
            }
        };
        // One watch of every lower pod keeps both the load on the lower nodes (the unfinished
        // pods, other tenants' too) and this node's own lower pods (in every phase: a finished
        // one is what its upper pod is told): each pod is sent and decoded once, where a watch
        // for each would carry this node's pods twice.
        let mine = identity.clone();
        let (lower_load, lower_pods, lower_pod_events) = cache::reflect_split(
            below.apis::<LeanPod>(lower),
            watcher::Config::default(),
            move |pod: LeanPod| {
                let pod = pod.0;
                let load = (!is_terminal(&pod)).then(|| PodLoad::of(&pod));
                let own = mine.owns(&pod.metadata).then(|| trim::packed_lower_pod(pod));
                (load, own)
            },
            &signals.lower_changed,
        );
        let (upper_node, watch) = watched::<Node>(
            Api::all(upper.clone()),
            watcher::Config::default().fields(&format!("metadata.name={}", identity.node)),
            &signals.lower_changed,
        );
        feeds.push(("the upper node watch", watch.boxed()));
        let (upper_pods, upper_pod_events) = cache::reflect_summaries(
            Api::<LeanPod>::all(upper.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={}", identity.node)),
            |pod| UpperPod::of(pod.0),
        );

        // ConfigMaps and Secrets: the metadata of each upper one a pod bound here references,
        // read by name (the content is read when a copy is written), and the copies of this
        // upper cluster.
        let copies = &signals.copies_changed;
        let copy_marks = format!("{}={}", tensile_common::names::MARK_CLUSTER, identity.cluster_id);
        let ours_below = || watcher::Config::default().labels(&copy_marks);
        let (upper_config_maps, w1) = fetched::<ConfigMap>(
            upper.clone(),
            upper_pods.clone(),
            scope.upper_reads_per_second,
            copies,
        );
        let (upper_secrets, w2) = fetched::<Secret>(
            upper.clone(),
            upper_pods.clone(),
            scope.upper_reads_per_second,
            copies,
        );
        let (lower_config_maps, w3) = watched_in::<ConfigMap>(lower, below, ours_below(), copies);
        let (lower_secrets, w4) = watched_in::<Secret>(lower, below, ours_below(), copies);
        feeds.push((
            "the ConfigMap and Secret watches",
            async move {
                tokio::join!(w1, w2, w3, w4);
            }
            .boxed(),
        ));
        let services = scope.services.then(|| {
            let (upper_services, w1) =
                watched::<Service>(Api::all(upper.clone()), watcher::Config::default(), copies);
            let (upper_endpoints, w2) =
                watched::<Endpoints>(Api::all(upper.clone()), watcher::Config::default(), copies);
            let (lower_services, w3) = watched_in::<Service>(lower, below, ours_below(), copies);
            let (lower_endpoints, w4) = watched_in::<Endpoints>(lower, below, ours_below(), copies);
            feeds.push((
                "the Service and Endpoints watches",
                async move {
                    tokio::join!(w1, w2, w3, w4);
                }
                .boxed(),
            ));
            ServiceStores {
                upper_services,
                upper_endpoints,
                lower_services,
                lower_endpoints,
                include_system: scope.system_services,
            }
        });

        // Claims and classes upstream, and the claims and volumes this node made.
        let volumes = &signals.volumes_changed;
        let node_marks = || watcher::Config::default().labels(&identity.selector());
        let (upper_claims, w1) =
            watched::<PersistentVolumeClaim>(Api::all(upper.clone()), watcher::Config::default(), volumes);
        let (upper_classes, w2) =
            watched::<StorageClass>(Api::all(upper.clone()), watcher::Config::default(), volumes);
        let (upper_volumes, w3) = watched::<PersistentVolume>(Api::all(upper.clone()), node_marks(), volumes);
        let (lower_claims, w4) = watched_in::<PersistentVolumeClaim>(lower, below, node_marks(), volumes);
        feeds.push((
            "the claim, class and volume watches",
            async move {
                tokio::join!(w1, w2, w3, w4);
            }
            .boxed(),
        ));

        let (lower_tokens, watch) = watched_in::<Secret>(
            lower,
            below,
            watcher::Config::default().labels(&identity.token_selector()),
            &signals.tokens_changed,
        );
        feeds.push(("the Secret watch of upper credentials", watch));
        let world = World {
            upper_pods,
            lower_pods,
            lower_load,
            lower_nodes,
            lower_quotas,
            upper_node,
            upper_config_maps,
            upper_secrets,
            lower_config_maps,
            lower_secrets,
            services,
            upper_claims,
            upper_classes,
            upper_volumes,
            lower_claims,
            lower_tokens,
        };
        let watches = Watches {
            feeds,
            upper_pod_events: upper_pod_events.boxed(),
            lower_pod_events: lower_pod_events.boxed(),
        };
        (world, watches, signals)
    }

    /// Resolves once the pod caches have listed: the pod controller, registration and
    /// collection wait for these.
    pub async fn pods_synced(&self) {
        self.upper_pods.synced().await;
        self.lower_pods.synced().await;
        self.lower_load.synced().await;
    }

    /// Resolves once what the node's status is computed from has listed (the pod caches, the
    /// lower nodes, the upper Node): registration waits for it, so the first status already
    /// counts every lower node (a Ready node with no room would otherwise be shown for a
    /// moment).
    pub async fn node_synced(&self) {
        self.pods_synced().await;
        self.lower_nodes.synced().await;
        self.lower_quotas.synced().await;
        self.upper_node.synced().await;
    }

    /// Resolves once every cache has listed: the one gate of the resyncs.
    pub async fn synced(&self) {
        self.pods_synced().await;
        self.lower_nodes.synced().await;
        self.lower_quotas.synced().await;
        self.upper_node.synced().await;
        self.upper_config_maps.synced().await;
        self.upper_secrets.synced().await;
        self.lower_config_maps.synced().await;
        self.lower_secrets.synced().await;
        if let Some(s) = &self.services {
            s.upper_services.synced().await;
            s.upper_endpoints.synced().await;
            s.lower_services.synced().await;
            s.lower_endpoints.synced().await;
        }
        self.upper_claims.synced().await;
        self.upper_classes.synced().await;
        self.upper_volumes.synced().await;
        self.lower_claims.synced().await;
    }
}

/// The watch caches of Service reflection.
#[derive(Clone)]
pub struct ServiceStores {
    pub upper_services: Cache<Service>,
    pub upper_endpoints: Cache<Endpoints>,
    /// Lower Services and Endpoints carrying this upper cluster's mark.
    pub lower_services: Cache<Service>,
    pub lower_endpoints: Cache<Endpoints>,
    /// Also reflect kube-system's Services and `default/kubernetes`.
    pub include_system: bool,
}
