//! One virtual node, composed: the world built and its watches started, each component
//! built from the flags and the world ([`Parts`]), and each handed to the daemon's tasks,
//! what writes to start once this replica leads.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use tensile_common::cache::Namespaces;
use tensile_common::kubeconfig::ClientSource;
use tensile_common::lower::identity::Identity;
use tensile_common::lower::overrides::{self, Compiled};
use tensile_common::runtime::Running;
use tensile_common::stash::StashKeys;

use crate::act::controller::{Collection, PodEvents, pod_controller, standby};
use crate::act::copies::Copies;
use crate::act::events::Events;
use crate::act::lower_namespaces::LowerNamespaces;
use crate::act::node::{LowerHealth, NodeLoop, NodeSettings};
use crate::act::pods::{self, Context};
use crate::act::ratelimit::WriteLimit;
use crate::act::tokens::Keeper;
use crate::act::volumes::Volumes;
use crate::decide::tokens::Settings;
use crate::decide::translate::Translation;
use crate::metrics::Metrics;
use crate::model::trim::{LowerPod, UpperPod};
use crate::serve::kubelet::{Authorizer, ClientAuth, KubeletState};
use crate::serve::streams::Sessions;
use crate::world::overrides::{Current, follow};
use crate::world::{self, Signals, World, scale_ups};
use crate::{Args, Controllers, Error, UpperIdentity};

/// How often the overrides file is looked at (a ConfigMap volume changes within a minute or
/// so of its ConfigMap).
const OVERRIDES_CHECK: Duration = Duration::from_secs(2);

/// The clients of one virtual node: the upper source (the heartbeat builds its own client
/// from it), the lower client of the controllers, and the kubelet API's stream client.
pub(crate) struct Clients {
    pub upper_source: ClientSource,
    pub lower: kube::Client,
    pub lower_streams: kube::Client,
}

/// How the kubelet API serves: TLS, its bound listener, who may call it.
pub(crate) struct Serving {
    pub tls: Arc<rustls::ServerConfig>,
    pub listener: tokio::net::TcpListener,
    pub auth: ClientAuth,
    pub authorizer: Authorizer,
}

/// What decides how pods go below besides the flags: the lower scope, the upper tokens'
/// settings, the stash keys and the overrides.
pub(crate) struct Policy {
    scope: Namespaces,
    tokens: Option<Arc<Settings>>,
    stash_key: Option<Arc<StashKeys>>,
    /// The overrides, and the file's bytes they were read from.
    overrides: (Compiled, Option<Vec<u8>>),
}

impl Policy {
    /// A scope, a token mode or kubelet API bounds that cannot work stop the node before it
    /// asks for anything; so do overrides that fail their checks: pods must not go below
    /// without the rules their cluster needs.
    pub(crate) fn of(args: &Args) -> Result<Self, Error> {
        args.kubelet.check().map_err(Error::Flags)?;
        let scope = args
            .lower
            .scope(args.reflection.gc_namespaces)
            .map_err(Error::Flags)?;
        let tokens = args
            .tokens
            .settings(
                args.upper.kubeconfig.as_deref(),
                &args.reflection.shared_namespaces,
                &scope,
            )
            .map_err(Error::Flags)?
            .map(Arc::new);
        let overrides = match &args.overrides_file {
            Some(path) => {
                let (compiled, read) =
                    overrides::load(path).map_err(|e| Error::Flags(format!("--overrides-file {e}")))?;
                (compiled, Some(read))
            }
            None => (Compiled::none(), None),
        };
        let stash_key = match args.stash_key_file.as_slice() {
            [_, ..] => Some(Arc::new(StashKeys::from_files(&args.stash_key_file)?)),
            [] => {
                tracing::warn!(
                    "no --stash-key-file: stashes (clusterSelector) are applied below whoever wrote them"
                );
                None
            }
        };
        Ok(Self {
            scope,
            tokens,
            stash_key,
            overrides,
        })
    }
}

/// Builds the world (every cache) and the components of one virtual node, and hands them to
/// the daemon's tasks. The world fills at once, on standby too; the components act once this
/// replica leads. They share one upper client; the node loop's heartbeat has its own.
pub(crate) async fn compose(
    args: &Args,
    clients: Clients,
    serving: Serving,
    policy: Policy,
    metrics: Arc<Metrics>,
    running: &mut Running,
) -> Result<(), Error> {
    let Policy {
        scope,
        tokens,
        stash_key,
        overrides: (overrides, read),
    } = policy;
    let overrides = Current::new(overrides);
    if let (Some(path), Some(read)) = (&args.overrides_file, read) {
        let counters = (
            metrics.overrides_loaded.clone(),
            metrics.overrides_refused.clone(),
        );
        let followed = follow(path.clone(), overrides.clone(), OVERRIDES_CHECK, read, counters);
        running.tasks.spawn("the overrides file", followed);
    }
    let upper = clients.upper_source.client()?;
    let identity = identify(args, &upper).await?;
    if let Some(settings) = &tokens {
        tracing::info!(node = %identity.node, "upper tokens go to pods of {}", settings.describe());
    }
    let world_scope = world::Scope {
        services: args
            .reflection
            .enable_controllers
            .contains(&Controllers::Services),
        system_services: args.reflection.reflect_system_services,
        upper_reads_per_second: args.reflection.upper_reads_per_second,
        lower: scope.clone(),
    };
    let (world, watches, signals) = World::build(&upper, &clients.lower, &identity, &world_scope);
    for (name, feed) in watches.feeds {
        running.tasks.spawn(name, feed);
    }
    let (scale_ups, scale_up_watch, scale_up_wakes) =
        scale_ups::watch(&clients.lower, &scope, world.lower_pods.clone());
    running
        .tasks
        .spawn("the lower scale-up signal watch", scale_up_watch);
    let (events, events_run) = Events::new(upper.clone(), identity.node.clone(), metrics.clone());
    let parts = Parts {
        args,
        upper,
        lower: clients.lower,
        cluster_name: cluster_name(args),
        identity,
        scope,
        world,
        signals,
        metrics,
        overrides,
        lower_limit: WriteLimit::new(args.lower.client_qps, args.lower.client_burst),
        upper_limit: WriteLimit::new(args.upper.upper_qps, args.upper.upper_burst),
    };
    let lower_health = Arc::new(LowerHealth::default());
    let ctx = parts.pod_context(events, stash_key, tokens.clone(), scale_ups, lower_health.clone());
    let node_loop = parts.node_loop(clients.upper_source, lower_health)?;
    let orphans_suspected = Arc::new(tokio::sync::Notify::new());
    let pod_events = (watches.upper_pod_events, watches.lower_pod_events);
    parts.start_pod_controller(
        running,
        &ctx,
        pod_events,
        scale_up_wakes,
        orphans_suspected.clone(),
    );
    parts.start_node_loop(running, node_loop);
    parts.start_collection(running, &ctx, orphans_suspected);
    running.tasks.spawn("the event publisher", events_run);
    parts.start_resyncs(running, &ctx, tokens.as_deref());
    parts.start_kubelet_api(running, clients.lower_streams, serving);
    Ok(())
}

/// This node's identity below: the upper cluster's id (`--cluster-id`, or its kube-system
/// namespace's UID) and the node's name. A version outside the supported range is served,
/// with a warning naming it; the lower cluster's is checked where the node reads it (the
/// heartbeat's probe).
async fn identify(args: &Args, upper: &kube::Client) -> Result<Identity, Error> {
    let cluster_id = match &args.upper.cluster_id {
        Some(id) => id.clone(),
        None => Api::<Namespace>::all(upper.clone())
            .get("kube-system")
            .await
            .map_err(|e| Error::ClusterId(e.to_string()))?
            .metadata
            .uid
            .ok_or_else(|| Error::ClusterId("kube-system has no uid".into()))?,
    };
    let identity = Identity {
        cluster_id,
        node: args.nodename.clone(),
    };
    tracing::info!(node = %identity.node, cluster_id = %identity.cluster_id, "starting");
    match upper.apiserver_version().await {
        Ok(info) => {
            if let Some(warning) = tensile_common::versions::warning("the upper cluster", &info.git_version) {
                tracing::warn!(node = %identity.node, "{warning}");
            }
        }
        Err(e) => tracing::warn!(node = %identity.node, "reading the upper cluster's version: {e}"),
    }
    Ok(identity)
}

/// The lower cluster's name in messages: its kubeconfig file's stem.
fn cluster_name(args: &Args) -> String {
    args.lower
        .client_kubeconfig
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lower".into())
}

/// What every component of one node is built from.
struct Parts<'a> {
    args: &'a Args,
    upper: kube::Client,
    lower: kube::Client,
    /// The lower cluster's name, for messages.
    cluster_name: String,
    identity: Identity,
    /// The lower namespaces served.
    scope: Namespaces,
    world: World,
    signals: Signals,
    metrics: Arc<Metrics>,
    overrides: Current,
    lower_limit: WriteLimit,
    upper_limit: WriteLimit,
}

impl Parts<'_> {
    /// What the pod controller works with, the copies and volumes it makes before a pod
    /// among them. Lower namespaces judged usable for pods and claims; Service reflection
    /// keeps to them.
    fn pod_context(
        &self,
        events: Events,
        stash_key: Option<Arc<StashKeys>>,
        tokens: Option<Arc<Settings>>,
        scale_ups: Arc<scale_ups::ScaleUps>,
        lower_health: Arc<LowerHealth>,
    ) -> Arc<Context> {
        let (args, world) = (self.args, &self.world);
        let namespaces = Arc::new(LowerNamespaces::new(
            self.lower.clone(),
            self.identity.clone(),
            self.cluster_name.clone(),
            args.reflection.shared_namespaces.clone(),
            self.scope.clone(),
            self.lower_limit.clone(),
        ));
        Arc::new(Context {
            upper: self.upper.clone(),
            lower: self.lower.clone(),
            translation: Translation {
                identity: self.identity.clone(),
                ignore_labels: args.ignore_labels.clone(),
                stash_key,
                tokens,
            },
            overrides: self.overrides.clone(),
            lower_pods: world.lower_pods.clone(),
            upper_pods: world.upper_pods.clone(),
            host_ip: args.kubelet.node_ip.to_string(),
            copies: self.copies(&namespaces, events.clone()),
            volumes: self.volumes(&namespaces),
            events,
            metrics: self.metrics.clone(),
            run_daemonset_pods: args.reflection.run_daemonset_pods,
            upper_limit: self.upper_limit.clone(),
            lower_limit: self.lower_limit.clone(),
            started: Instant::now(),
            lost_grace: Duration::from_secs(10),
            cluster_name: self.cluster_name.clone(),
            namespaces,
            served: self.scope.clone(),
            known_priority_classes: Default::default(),
            first_status_held: Default::default(),
            retries: Default::default(),
            settled: Default::default(),
            reconcile_timeout: Duration::from_secs(args.reconcile_timeout),
            lower_health,
            tokens_changed: self.signals.tokens_changed.clone(),
            certificates: Arc::default(),
            scale_ups,
            upper_tracks_generation: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// The copies of ConfigMaps, Secrets (and Services) that pods need below.
    fn copies(&self, namespaces: &Arc<LowerNamespaces>, events: Events) -> Arc<Copies> {
        let world = &self.world;
        Arc::new(Copies {
            upper: self.upper.clone(),
            lower: self.lower.clone(),
            cluster_id: self.identity.cluster_id.clone(),
            cluster_name: self.cluster_name.clone(),
            upper_config_maps: world.upper_config_maps.clone(),
            upper_secrets: world.upper_secrets.clone(),
            lower_config_maps: world.lower_config_maps.clone(),
            lower_secrets: world.lower_secrets.clone(),
            upper_pods: world.upper_pods.clone(),
            lower_pods: world.lower_load.clone(),
            limit: self.lower_limit.clone(),
            metrics: self.metrics.clone(),
            gc_delay: Duration::from_secs(self.args.reflection.copy_collection_delay),
            unreferenced_since: Default::default(),
            conflicts: Default::default(),
            digested: Default::default(),
            services: world.services.clone(),
            namespaces: namespaces.clone(),
            events,
            last_pass: Default::default(),
        })
    }

    /// The claims pods mount, made below, and the upper volumes standing for them.
    fn volumes(&self, namespaces: &Arc<LowerNamespaces>) -> Arc<Volumes> {
        let world = &self.world;
        Arc::new(Volumes {
            upper: self.upper.clone(),
            lower: self.lower.clone(),
            identity: self.identity.clone(),
            cluster_name: self.cluster_name.clone(),
            upper_claims: world.upper_claims.clone(),
            upper_volumes: world.upper_volumes.clone(),
            lower_claims: world.lower_claims.clone(),
            upper_pods: world.upper_pods.clone(),
            lower_pods: world.lower_load.clone(),
            upper_limit: self.upper_limit.clone(),
            lower_limit: self.lower_limit.clone(),
            metrics: self.metrics.clone(),
            classes: Default::default(),
            upper_classes: world.upper_classes.clone(),
            read_lower_classes: self.scope == Namespaces::All,
            refused_expansions: Default::default(),
            overrides: self.overrides.clone(),
            namespaces: namespaces.clone(),
            last_pass: Default::default(),
        })
    }

    /// The node loop. The heartbeat has its own client: a partition's dead connections are
    /// then dropped with it, without waiting on the pool the controllers share.
    fn node_loop(
        &self,
        upper_source: ClientSource,
        lower_health: Arc<LowerHealth>,
    ) -> Result<NodeLoop, Error> {
        let args = self.args;
        let mut settings = NodeSettings::new(
            self.identity.clone(),
            args.kubelet.node_ip.to_string(),
            args.kubelet.kubelet_port,
        );
        settings.taint = !args.disable_taint;
        settings.role_label = args.upper.identity == UpperIdentity::Credential;
        settings.retaint = args.upper.identity == UpperIdentity::Credential;
        settings.extra_labels = args.node_labels.iter().cloned().collect::<BTreeMap<_, _>>();
        settings.shape_label_keys = args.shape.label_keys.clone();
        Ok(NodeLoop {
            upper: std::sync::Mutex::new(upper_source.client()?),
            upper_source,
            lower: self.lower.clone(),
            settings,
            lower_nodes: self.world.lower_nodes.clone(),
            lower_quotas: self.world.lower_quotas.clone(),
            served: self.scope.clone(),
            lower_pods: self.world.lower_load.clone(),
            changed: self.signals.lower_changed.clone(),
            metrics: self.metrics.clone(),
            upper_node: self.world.upper_node.clone(),
            lower_health,
            taint_told: Default::default(),
            overrides: self.overrides.clone(),
            worked_out: Default::default(),
        })
    }

    /// The pod controller, its own task: a watch decoding a large object then runs on a
    /// shallow stack, and a controller that stops is named. It finishes the work in hand on
    /// SIGTERM. On standby the pod events only keep the caches current; taking over, every
    /// pod is reconciled at once (the events seen on standby were not).
    fn start_pod_controller(
        &self,
        running: &mut Running,
        ctx: &Arc<Context>,
        events: (PodEvents<UpperPod>, PodEvents<LowerPod>),
        scale_up_wakes: BoxStream<'static, ObjectRef<UpperPod>>,
        suspected: Arc<tokio::sync::Notify>,
    ) {
        let (ctx, world, metrics) = (ctx.clone(), self.world.clone(), self.metrics.clone());
        let (workers, leads) = (self.args.pod_sync_workers, running.candidacy.clone());
        running
            .tasks
            .spawn_graceful("the pod controller", move |stop| async move {
                let Some(events) = stop.run_until_cancelled(standby(events, &leads)).await else {
                    return;
                };
                let store = world.upper_pods.clone();
                pod_controller(&world, events, scale_up_wakes, &ctx, suspected, workers)
                    .reconcile_all_on(futures::stream::once(async {}))
                    .graceful_shutdown_on(async move { stop.cancelled().await })
                    .run(pods::reconcile, pods::error_policy, ctx)
                    .for_each(move |_| {
                        metrics.pods_managed.set(store.len() as i64);
                        futures::future::ready(())
                    })
                    .await
            });
    }

    /// The node loop's task. The node is registered only once the pod watches and the lower
    /// nodes have synced (a node without a working pod path would attract pods it cannot
    /// run, and one that has not seen its lower nodes would show no room).
    fn start_node_loop(&self, running: &mut Running, node_loop: NodeLoop) {
        let (world, leads, standing) = (
            self.world.clone(),
            running.candidacy.clone(),
            running.standing.clone(),
        );
        running
            .tasks
            .spawn_graceful("the node loop", move |stop| async move {
                let registered = async {
                    // A standby is ready once its caches have listed: it can take over at once.
                    tokio::select! {
                        biased;
                        () = leads.leading() => {}
                        () = world.node_synced() => {
                            standing.synced();
                            leads.leading().await;
                        }
                    }
                    // Heartbeats start as soon as this replica acts, before the caches finish
                    // listing; a leader is ready once its node is registered on synced caches.
                    node_loop.beat_until(world.node_synced()).await;
                    standing.synced();
                };
                if stop.run_until_cancelled(registered).await.is_none() {
                    return;
                }
                node_loop.run(stop).await
            });
    }

    /// Orphan collection, once this replica leads.
    fn start_collection(
        &self,
        running: &mut Running,
        ctx: &Arc<Context>,
        suspected: Arc<tokio::sync::Notify>,
    ) {
        let reflection = &self.args.reflection;
        let collection = Collection {
            period: Duration::from_secs(reflection.copy_collection_delay.clamp(1, 30)),
            namespaces: reflection.gc_namespaces,
            recoveries: Box::pin(ctx.lower_health.recoveries()),
            suspected,
        };
        let (ctx, world, leads) = (ctx.clone(), self.world.clone(), running.candidacy.clone());
        running
            .tasks
            .spawn_graceful("orphan collection", move |stop| async move {
                stop.run_until_cancelled(leads.when_leading(collection.run(&ctx, &world)))
                    .await;
            });
    }

    /// The token keeper (with upper tokens), the certificate keeper, and the copy and volume
    /// resyncs, once this replica leads.
    fn start_resyncs(&self, running: &mut Running, ctx: &Arc<Context>, tokens: Option<&Settings>) {
        let (world, leads) = (&self.world, &running.candidacy);
        let certificates = crate::act::certificates::Keeper::new(
            self.upper.clone(),
            self.lower.clone(),
            self.identity.clone(),
            world.upper_pods.clone(),
            world.lower_pods.clone(),
            world.upper_node.clone(),
            world.lower_tokens.clone(),
            ctx.certificates.clone(),
            ctx.lower_limit.clone(),
            ctx.events.clone(),
            self.metrics.clone(),
        );
        running
            .tasks
            .spawn("the certificate keeper", leads.when_leading(certificates.run()));
        if let Some(settings) = tokens {
            let keeper = Keeper {
                upper: self.upper.clone(),
                lower: self.lower.clone(),
                identity: self.identity.clone(),
                settings: settings.clone(),
                upper_pods: world.upper_pods.clone(),
                lower_pods: world.lower_pods.clone(),
                secrets: world.lower_tokens.clone(),
                limit: ctx.lower_limit.clone(),
                metrics: self.metrics.clone(),
                tokenless: Default::default(),
                retries: Default::default(),
                unseen: Default::default(),
            };
            let kept = leads.when_leading(keeper.run(self.signals.tokens_changed.clone()));
            running.tasks.spawn("the token keeper", kept);
        }
        let pass_deadline = Duration::from_secs(self.args.reconcile_timeout);
        let copies = ctx.copies.clone();
        let copy_resync = leads.when_leading(crate::act::resync(
            ("lower", "copy-pass-timeout"),
            world.clone(),
            self.signals.copies_changed.clone(),
            pass_deadline,
            self.metrics.clone(),
            move || {
                let copies = copies.clone();
                async move { copies.sync().await }
            },
        ));
        let volumes = ctx.volumes.clone();
        let volume_resync = leads.when_leading(crate::act::resync(
            ("both", "volume-pass-timeout"),
            world.clone(),
            self.signals.volumes_changed.clone(),
            pass_deadline,
            self.metrics.clone(),
            // A class's binding mode was read: the volumes waiting for it go at once.
            move || {
                let volumes = volumes.clone();
                async move { volumes.sync().await }
            },
        ));
        running.tasks.spawn("the copy resync", copy_resync);
        running.tasks.spawn("the volume resync", volume_resync);
    }

    /// The kubelet API. Only the leader's address is on the Node; a standby's port stays
    /// closed until it leads.
    fn start_kubelet_api(&self, running: &mut Running, lower_streams: kube::Client, serving: Serving) {
        let kubelet = &self.args.kubelet;
        let state = Arc::new(KubeletState {
            node: self.identity.node.clone(),
            upper_pods: self.world.upper_pods.clone(),
            lower_pods: self.world.lower_pods.clone(),
            summaries: Default::default(),
            lower: lower_streams,
            metrics: self.metrics.clone(),
            require_client_cert: matches!(serving.auth, ClientAuth::Ca(_)),
            authorizer: serving.authorizer,
            sessions: Sessions::new(
                kubelet.max_stream_sessions as usize,
                kubelet.max_stream_sessions_per_namespace as usize,
                Duration::from_secs(kubelet.stream_idle_timeout_seconds),
            ),
            read_lower_nodes: self.scope == Namespaces::All,
        });
        let limits = tensile_common::serve::Limits {
            max_connections: kubelet.max_connections as usize,
            idle: Duration::from_secs(kubelet.idle_timeout_seconds),
            ..Default::default()
        };
        let (listener, tls, leads) = (serving.listener, serving.tls, running.candidacy.clone());
        running
            .tasks
            .spawn_graceful("the kubelet API", move |stop| async move {
                let serve =
                    crate::serve::routes::serve(listener, tls, limits, Arc::default(), state, stop.clone());
                if stop.run_until_cancelled(leads.leading()).await.is_some() {
                    serve.await
                }
            });
    }
}
