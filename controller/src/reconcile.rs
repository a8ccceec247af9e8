//! One pass over one `LowerCluster`: observe, apply the planned objects, renew the
//! credential when due, report the status; or, once it is being deleted, remove every trace
//! of its virtual node in both clusters before its finalizer goes.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Node, ObjectReference, PersistentVolume, Secret, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use serde_json::json;
use tensile_common::api::{ApiError, code};
use tensile_common::kubeconfig::ClientOptions;
use tensile_common::lower::identity::Identity;
use tensile_common::lower::teardown;
use tensile_common::names;

use crate::approve;
use crate::credential::{self, Claims};
use crate::plan::{self, NODE_LEASE_NAMESPACE, Observed, Settings};
use crate::resource::{LowerCluster, LowerClusterStatus, condition};

/// The annotation that lets a `LowerCluster` go without removing its virtual node's objects
/// below, for a lower cluster that is gone for good.
pub const ORPHAN_LOWER: &str = "tensile.io/orphan-lower-objects";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("encoding {0}: {1}")]
    Encode(&'static str, serde_json::Error),
}

/// What every pass shares.
pub struct Context {
    pub upper: kube::Client,
    pub settings: Settings,
    /// Options of the clients made from credentials.
    pub lower_options: ClientOptions,
    /// How often each cluster is looked at again.
    pub resync: Duration,
    /// The share of a token's life after which it is renewed.
    pub renew_at: f64,
    /// How long a leaving cluster's virtual node is drained before it stops regardless.
    pub drain_timeout: Duration,
    /// The removal step after which the process aborts (tests only).
    pub crash_at: tensile_common::runtime::CrashPoints<RemovalStep>,
    /// What was last applied for each cluster, and when: an unchanged plan is applied again
    /// only every [`REAPPLY`] (to repair edits), not every pass.
    pub applied: std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The rights each cluster's credential was last found to lack, with what they were
    /// asked for (Secret version, features) and when.
    #[allow(clippy::type_complexity)]
    pub rights:
        std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant, Vec<String>)>>,
    /// Events on the LowerClusters: Ready gained or lost.
    pub events: kube::runtime::events::Recorder,
}

/// A step of a cluster's removal, each ended by writes a restart must find done or redo.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RemovalStep {
    /// Its Node is cordoned and its pods evicted.
    Drained,
    /// Its Deployment is gone and no replica holds its election Lease.
    Stopped,
    /// What it made below is removed.
    Below,
    /// Its volumes, Node, Lease, grants and account upstream are removed, and what its
    /// account asked that is unanswered is denied.
    Upstream,
    /// Its credential Secret is released; the finalizer is still on.
    Released,
}

fn crash_point(ctx: &Context, step: RemovalStep) {
    ctx.crash_at.reached(step);
}

/// How often an unchanged plan is applied again, to repair what someone edited or deleted.
pub const REAPPLY: Duration = Duration::from_secs(300);

fn ssa() -> PatchParams {
    PatchParams::apply(names::CONTROLLER_MANAGER).force()
}

/// The pass for `cluster`.
pub async fn reconcile(cluster: Arc<LowerCluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = cluster.name().to_owned();
    let api: Api<LowerCluster> = Api::all(ctx.upper.clone());
    if cluster.metadata.deletion_timestamp.is_some() {
        ctx.metrics.forget(&name);
        if let Ok(mut rights) = ctx.rights.lock() {
            rights.remove(&name);
        }
        return remove(&cluster, &ctx, &api).await;
    }
    if set_finalizer(&api, cluster.as_ref(), &format!("lowercluster {name}"), true).await? {
        // The change of the object brings the next pass.
        return Ok(Action::await_change());
    }

    let mut observed = Observed::default();
    let others = api
        .list(&ListParams::default().labels(&ours(ctx.as_ref())))
        .await
        .map_err(ApiError::on("upper", "list", "lowerclusters"))?;
    let invalid = match plan::validate(&ctx.settings, &cluster) {
        Err(invalid) => Some(invalid.0),
        Ok(()) => conflict(&cluster, &others.items, &ctx).await?,
    };
    if let Some(why) = invalid {
        observed.invalid = Some(why);
        report(&ctx, &api, &cluster, &observed).await?;
        return Ok(Action::requeue(ctx.resync * 6));
    }
    observed.overrides = match plan::checked_overrides(&cluster) {
        Ok((_, said)) => Some(Ok(said)),
        Err(why) => {
            let name = plan::object_name(&ctx.settings, &name);
            let in_force = Api::<ConfigMap>::namespaced(ctx.upper.clone(), &ctx.settings.namespace)
                .get_metadata_opt(&name)
                .await
                .map_err(ApiError::on("upper", "get", format!("configmap {name}")))?
                .is_some();
            if !in_force {
                // Nothing to keep: the virtual node waits for overrides that pass.
                observed.invalid = Some(plan::none_in_force(&why));
                report(&ctx, &api, &cluster, &observed).await?;
                return Ok(Action::requeue(ctx.resync * 6));
            }
            Some(Err(plan::kept_in_force(&why)))
        }
    };

    let secrets: Api<Secret> = Api::namespaced(ctx.upper.clone(), &ctx.settings.namespace);
    let secret_name = &cluster.spec.credential.secret_name;
    let secret = secrets.get_opt(secret_name).await.map_err(ApiError::on(
        "upper",
        "get",
        format!("secret {}/{secret_name}", ctx.settings.namespace),
    ))?;
    let lower = match &secret {
        None => {
            observed.credential = Some(Err((
                "SecretMissing".into(),
                format!("Secret {}/{secret_name} does not exist", ctx.settings.namespace),
            )));
            None
        }
        // Deleted while the cluster is in use: let go, so it goes, and said. The virtual node
        // keeps the credential it has read until it restarts or the token expires.
        Some(deleting) if deleting.metadata.deletion_timestamp.is_some() => {
            release_credential(secret_name, &cluster, &others.items, &ctx).await?;
            observed.credential = Some(Err((
                "SecretMissing".into(),
                format!(
                    "Secret {}/{secret_name} was deleted: make it again (tensilectl join {name} renews it) for the \
                     virtual node to reach the lower cluster past its current token",
                    ctx.settings.namespace
                ),
            )));
            None
        }
        Some(secret) => match lower_client(secret, cluster.spec.credential.key(), &ctx, &name).await {
            Ok(client) => Some(client),
            Err(message) => {
                observed.credential = Some(Err(("Invalid".into(), message)));
                None
            }
        },
    };
    let secret = secret.filter(|s| s.metadata.deletion_timestamp.is_none());
    if let Some(secret) = &secret {
        hold(&secrets, secret).await?;
    }
    // A credential Secret the object named before and names no more is let go.
    if let Some(before) = cluster.status.as_ref().and_then(|s| s.credential_secret.clone())
        && before != *secret_name
    {
        release_credential(&before, &cluster, &others.items, &ctx).await?;
    }
    observed.credential_secret = Some(secret_name.clone());
    if let (Some(lower), Some(secret)) = (&lower, &secret) {
        observe_lower(lower, &mut observed, cluster.spec.namespaces.is_empty()).await;
        if observed.credential == Some(Ok(())) {
            observed.credential_expires = renew(lower, secret, &ctx, &name).await;
            let missing = missing_rights(lower, &cluster, secret, &ctx).await;
            if !missing.is_empty() {
                observed.credential = Some(Err((
                    "InsufficientRights".into(),
                    format!(
                        "the credential may not {}: run tensilectl join {name} again with the lower admin's \
                         kubeconfig, which grants what this release's virtual nodes need",
                        missing.join(", ")
                    ),
                )));
            }
        }
    }

    apply(&ctx, &cluster, secret.as_ref().map(plan::credential_digest)).await?;
    observe_node(&ctx, cluster.node_name(), &mut observed).await?;
    report(&ctx, &api, &cluster, &observed).await?;
    Ok(Action::requeue(ctx.resync))
}

/// Writes the status of `cluster` from `observed`; its metrics say it too, and an event says
/// when it became Ready or stopped being so.
async fn report(
    ctx: &Context,
    api: &Api<LowerCluster>,
    cluster: &LowerCluster,
    observed: &Observed,
) -> Result<(), Error> {
    let status = plan::status(cluster, observed);
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::READY)
        .cloned();
    let was = cluster.condition(condition::READY).map(|c| c.status.clone());
    ctx.metrics.report(
        cluster.name(),
        ready.as_ref().is_some_and(|r| r.status == "True"),
        status.credential_expires.as_deref(),
    );
    write_status(api, cluster, status).await?;
    if let Some(ready) = ready
        && was.as_deref() != Some(ready.status.as_str())
    {
        let (type_, reason) = match ready.status.as_str() {
            "True" => (EventType::Normal, "Ready".to_owned()),
            _ => (EventType::Warning, format!("NotReady{}", ready.reason)),
        };
        announce(ctx, cluster, type_, &reason, &ready.message).await;
    }
    Ok(())
}

/// An event on `cluster`; one that cannot be written is logged, never an error.
async fn announce(ctx: &Context, cluster: &LowerCluster, type_: EventType, reason: &str, note: &str) {
    let reference = ObjectReference {
        api_version: Some(format!("{}/{}", names::API_GROUP, crate::resource::VERSION)),
        kind: Some(crate::resource::KIND.to_owned()),
        name: Some(cluster.name().to_owned()),
        uid: cluster.metadata.uid.clone(),
        ..Default::default()
    };
    let event = Event {
        type_,
        reason: reason.chars().take(128).collect(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.events.publish(&event, &reference).await {
        tracing::debug!(cluster = %cluster.name(), "an event on the LowerCluster: {e}");
    }
}

/// The label selector of the LowerClusters this controller acts on.
fn ours(ctx: &Context) -> String {
    format!("{}={}", names::CONTROLLER_NAMESPACE, ctx.settings.namespace)
}

/// Why `cluster` may not run although its spec is well formed: its node name changed since
/// its virtual node was made, another LowerCluster has that node name, or a Node of that
/// name exists that is not a virtual node.
async fn conflict(
    cluster: &LowerCluster,
    others: &[LowerCluster],
    ctx: &Context,
) -> Result<Option<String>, Error> {
    let node = cluster.node_name();
    if let Some(made) = cluster.status.as_ref().and_then(|s| s.node_name.as_deref())
        && made != node
    {
        return Ok(Some(format!(
            "spec.nodeName changed from {made:?} to {node:?}: a virtual node's name cannot change; \
             delete this LowerCluster and make a new one"
        )));
    }
    let older = |o: &LowerCluster| {
        (o.metadata.creation_timestamp.as_ref().map(|t| t.0), o.name())
            < (
                cluster.metadata.creation_timestamp.as_ref().map(|t| t.0),
                cluster.name(),
            )
    };
    if let Some(other) = others.iter().find(|o| {
        o.name() != cluster.name()
            && (o.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                || (o.node_name() == node && older(o)))
    }) {
        return Ok(Some(format!(
            "the virtual node name {node:?} is LowerCluster {}'s; choose another (spec.nodeName)",
            other.name()
        )));
    }
    let nodes: Api<Node> = Api::all(ctx.upper.clone());
    if let Some(found) =
        nodes
            .get_opt(node)
            .await
            .map_err(ApiError::on("upper", "get", format!("node {node}")))?
        && !is_virtual_node(&found)
    {
        return Ok(Some(format!(
            "a Node {node:?} exists that is not a virtual node; choose another name (spec.nodeName)"
        )));
    }
    Ok(None)
}

/// Deletes `name` if it is what this controller made for `cluster` (by its labels), and only
/// that object (UID precondition).
async fn delete_made<K>(api: &Api<K>, name: &str, cluster: &str, params: &DeleteParams) -> Result<bool, Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let what = || format!("{} {name}", api.resource_url());
    let Some(found) = api
        .get_opt(name)
        .await
        .map_err(ApiError::on("upper", "get", what()))?
    else {
        return Ok(false);
    };
    let labels = found.meta().labels.as_ref();
    let made = labels
        .and_then(|l| l.get(names::LOWER_CLUSTER))
        .map(String::as_str)
        == Some(cluster)
        && labels.and_then(|l| l.get(names::MANAGED_BY)).map(String::as_str)
            == Some(names::CONTROLLER_MANAGER);
    if !made {
        tracing::warn!(object = %what(), cluster, "not made for this LowerCluster: left alone");
        return Ok(false);
    }
    let exact = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: found.meta().uid.clone(),
            resource_version: None,
        }),
        ..params.clone()
    };
    match api.delete(name, &exact).await {
        Ok(_) => Ok(true),
        Err(e) if matches!(code(&e), Some(404) | Some(409)) => Ok(false),
        Err(e) => Err(ApiError::on("upper", "delete", what())(e).into()),
    }
}

/// A client of the lower cluster from the credential `secret`, or why there is none.
async fn lower_client(
    secret: &Secret,
    key: &str,
    ctx: &Context,
    cluster: &str,
) -> Result<kube::Client, String> {
    let what = format!(
        "Secret {}/{} key {key}",
        ctx.settings.namespace,
        secret.metadata.name.as_deref().unwrap_or_default(),
    );
    let text =
        credential::secret_text(secret, key).ok_or_else(|| format!("{what} is missing or not text"))?;
    let mut kubeconfig = kube::config::Kubeconfig::from_yaml(&text).map_err(|e| format!("{what}: {e}"))?;
    // The token file beside the kubeconfig in the pod is the Secret's `token` key here.
    if let Some(token) = credential::secret_text(secret, names::CREDENTIAL_TOKEN_KEY) {
        for user in &mut kubeconfig.auth_infos {
            if let Some(auth) = &mut user.auth_info
                && auth.token_file.is_some()
            {
                auth.token_file = None;
                auth.token = Some(token.trim().to_owned().into());
            }
        }
    }
    let options = ClientOptions {
        user_agent: Some(format!("{} (lower cluster {cluster})", names::CONTROLLER_MANAGER)),
        ..ctx.lower_options.clone()
    };
    tensile_common::kubeconfig::client_from_kubeconfig(kubeconfig, &what, &options)
        .await
        .map_err(|e| e.to_string())
}

/// What the lower cluster says: its version, whether it takes the credential, and its node
/// count when the credential may read nodes (`nodes`: not a namespace-scoped one).
async fn observe_lower(lower: &kube::Client, observed: &mut Observed, nodes: bool) {
    match lower.apiserver_version().await {
        Ok(info) => {
            observed.lower = Some(Ok(info.git_version));
            observed.credential = Some(Ok(()));
        }
        Err(e) if code(&e) == Some(401) => {
            observed.lower = Some(Ok("unknown".into()));
            observed.credential = Some(Err((
                "Unauthorized".into(),
                format!(
                    "the lower cluster refuses the credential: {}",
                    tensile_common::api::message(&e)
                ),
            )));
            return;
        }
        Err(e) => {
            observed.lower = Some(Err(("Unreachable".into(), e.to_string())));
            observed.credential = None;
            return;
        }
    }
    if !nodes {
        return;
    }
    let nodes: Api<Node> = Api::all(lower.clone());
    match nodes.list_metadata(&ListParams::default()).await {
        Ok(list) => observed.lower_nodes = Some(list.items.len() as i64),
        Err(e) => tracing::debug!("listing lower nodes: {e}"),
    }
}

/// The rights of [`plan::required_rights`] the credential of `cluster` (Secret `secret`)
/// lacks, as the lower cluster answers its own access reviews (which every authenticated
/// user may ask), in each served namespace under a namespace scope. Asked again when the
/// Secret or the features change, else every [`REAPPLY`]; nothing is said when the lower
/// cluster cannot tell.
async fn missing_rights(
    lower: &kube::Client,
    cluster: &LowerCluster,
    secret: &Secret,
    ctx: &Context,
) -> Vec<String> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let features = plan::Features::of(&ctx.settings, cluster);
    let key = format!(
        "{:?} {features:?} {:?}",
        secret.metadata.resource_version, cluster.spec.namespaces
    );
    if let Ok(checked) = ctx.rights.lock()
        && let Some((last, at, missing)) = checked.get(cluster.name())
        && *last == key
        && at.elapsed() < REAPPLY
    {
        return missing.clone();
    }
    let scopes: Vec<Option<String>> = match cluster.spec.namespaces.as_slice() {
        [] => vec![None],
        served => served.iter().cloned().map(Some).collect(),
    };
    let api = Api::<SelfSubjectAccessReview>::all(lower.clone());
    let mut missing = Vec::new();
    for right in plan::required_rights(features, scopes == [None]) {
        for namespace in &scopes {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        namespace: namespace.clone(),
                        verb: Some(right.verb.into()),
                        group: Some(right.group.into()),
                        resource: Some(right.resource.into()),
                        subresource: (!right.subresource.is_empty()).then(|| right.subresource.into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            match api.create(&kube::api::PostParams::default(), &review).await {
                Ok(answer) if answer.status.as_ref().is_some_and(|s| s.allowed) => {}
                Ok(_) => missing.push(match namespace {
                    Some(ns) => format!("{right} in namespace {ns}"),
                    None => right.to_string(),
                }),
                Err(e) => {
                    tracing::debug!(cluster = %cluster.name(), "asking the lower cluster what the credential may do: {e}");
                    return Vec::new();
                }
            }
        }
    }
    if let Ok(mut checked) = ctx.rights.lock() {
        checked.insert(
            cluster.name().to_owned(),
            (key, std::time::Instant::now(), missing.clone()),
        );
    }
    missing
}

/// Renews the credential's token when it is due; returns when the token in force expires.
async fn renew(lower: &kube::Client, secret: &Secret, ctx: &Context, cluster: &str) -> Option<String> {
    let token = credential::secret_text(secret, names::CREDENTIAL_TOKEN_KEY)?;
    let claims = match Claims::of(&token) {
        Ok(claims) => claims,
        Err(e) => {
            tracing::warn!(cluster, "the credential's token is not renewed: {e}");
            return None;
        }
    };
    let now = jiff::Timestamp::now();
    if now < claims.renew_at(ctx.renew_at) {
        return Some(tensile_common::api::time(claims.expires));
    }
    let lifetime = claims.lifetime().max(credential::MIN_LIFETIME);
    let fresh = match credential::request_token(lower, &claims.namespace, &claims.service_account, lifetime)
        .await
    {
        Ok(fresh) => fresh,
        Err(e) => {
            ctx.metrics
                .renewal_failures
                .get_or_create(&crate::metrics::Metrics::cluster(cluster))
                .inc();
            tracing::warn!(
                cluster,
                account = %format!("{}/{}", claims.namespace, claims.service_account),
                "renewing the credential's token: {e}; tried again on the next pass, the token expires at {}",
                claims.expires
            );
            return Some(tensile_common::api::time(claims.expires));
        }
    };
    let expires = Claims::of(&fresh).map(|c| c.expires).unwrap_or(claims.expires);
    let secrets: Api<Secret> = Api::namespaced(ctx.upper.clone(), &ctx.settings.namespace);
    let name = secret.metadata.name.clone().unwrap_or_default();
    let patch = json!({
        "metadata": {"resourceVersion": secret.metadata.resource_version},
        "data": {names::CREDENTIAL_TOKEN_KEY: k8s_openapi::ByteString(fresh.into_bytes())},
    });
    match secrets
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            tracing::info!(cluster, expires = %expires, "renewed the credential's token");
            Some(tensile_common::api::time(expires))
        }
        Err(e) => {
            ctx.metrics
                .renewal_failures
                .get_or_create(&crate::metrics::Metrics::cluster(cluster))
                .inc();
            tracing::warn!(cluster, "writing the renewed token into Secret {name}: {e}");
            Some(tensile_common::api::time(claims.expires))
        }
    }
}

/// Applies what runs `cluster`'s virtual node, its pods rolled by a changed credential
/// (`credential`: the digest of the Secret; without one, the digest in force is kept, so a
/// missing Secret rolls nothing).
async fn apply(ctx: &Context, cluster: &LowerCluster, credential: Option<String>) -> Result<(), Error> {
    let mut objects = plan::objects(&ctx.settings, cluster);
    let ns = ctx.settings.namespace.as_str();
    let credential = match credential {
        Some(digest) => Some(digest),
        None => Api::<Deployment>::namespaced(ctx.upper.clone(), ns)
            .get_opt(objects.deployment.metadata.name.as_deref().unwrap_or_default())
            .await
            .map_err(ApiError::on("upper", "get", "the virtual node's Deployment"))?
            .and_then(|d| {
                d.spec
                    .template
                    .metadata?
                    .annotations?
                    .remove(plan::CREDENTIAL_DIGEST)
            }),
    };
    if let Some(digest) = &credential {
        plan::with_credential(&mut objects, digest);
    }
    let digest = format!("{objects:?}");
    let fresh = ctx.applied.lock().ok().and_then(|applied| {
        applied
            .get(cluster.name())
            .map(|(last, at)| *last == digest && at.elapsed() < REAPPLY)
    });
    if fresh == Some(true) {
        return Ok(());
    }
    let c = &ctx.upper;
    apply_one(Api::<ServiceAccount>::namespaced(c.clone(), ns), &objects.account).await?;
    apply_one(Api::<ClusterRole>::all(c.clone()), &objects.node_role).await?;
    apply_one(Api::<ClusterRoleBinding>::all(c.clone()), &objects.node_binding).await?;
    apply_one(Api::<ClusterRoleBinding>::all(c.clone()), &objects.shared_binding).await?;
    apply_one(
        Api::<Role>::namespaced(c.clone(), NODE_LEASE_NAMESPACE),
        &objects.lease_role,
    )
    .await?;
    apply_one(
        Api::<RoleBinding>::namespaced(c.clone(), NODE_LEASE_NAMESPACE),
        &objects.lease_binding,
    )
    .await?;
    apply_one(Api::<Role>::namespaced(c.clone(), ns), &objects.leader_role).await?;
    apply_one(
        Api::<RoleBinding>::namespaced(c.clone(), ns),
        &objects.leader_binding,
    )
    .await?;
    // The overrides before the Deployment whose pods mount them.
    let config_maps = Api::<ConfigMap>::namespaced(c.clone(), ns);
    if let plan::Overrides::Accepted(config_map) = &objects.overrides {
        apply_one(config_maps, config_map).await?;
    }
    apply_one(Api::<Deployment>::namespaced(c.clone(), ns), &objects.deployment).await?;
    let budgets = budget_api(ctx);
    let name = plan::object_name(&ctx.settings, cluster.name());
    match (&objects.budget, budgets) {
        (Some(budget), Some(api)) => {
            api.patch(&name, &ssa(), &Patch::Apply(budget))
                .await
                .map_err(ApiError::on(
                    "upper",
                    "apply",
                    format!("poddisruptionbudget {ns}/{name}"),
                ))?;
        }
        (None, Some(api)) => delete_quietly(&api, &name).await?,
        _ => {}
    }
    if let Ok(mut applied) = ctx.applied.lock() {
        applied.insert(cluster.name().to_owned(), (digest, std::time::Instant::now()));
    }
    Ok(())
}

/// The PodDisruptionBudgets in the controller's namespace, when it makes them.
fn budget_api(ctx: &Context) -> Option<Api<kube::core::DynamicObject>> {
    if !ctx.settings.disruption_budgets {
        return None;
    }
    let gvk = kube::core::GroupVersionKind::gvk("policy", "v1", "PodDisruptionBudget");
    let resource = kube::discovery::ApiResource::from_gvk(&gvk);
    Some(Api::namespaced_with(
        ctx.upper.clone(),
        &ctx.settings.namespace,
        &resource,
    ))
}

async fn apply_one<K>(api: Api<K>, object: &K) -> Result<(), Error>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    let value = plan::apply_body(object).map_err(|e| Error::Encode("an object", e))?;
    api.patch(&name, &ssa(), &Patch::Apply(&value))
        .await
        .map_err(ApiError::on("upper", "apply", format!("{} {name}", K::kind(&()))))?;
    Ok(())
}

async fn observe_node(ctx: &Context, node: &str, observed: &mut Observed) -> Result<(), Error> {
    let nodes: Api<Node> = Api::all(ctx.upper.clone());
    if let Some(found) =
        nodes
            .get_opt(node)
            .await
            .map_err(ApiError::on("upper", "get", format!("node {node}")))?
    {
        let status = found.status.unwrap_or_default();
        observed.node_ready = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| {
                (
                    c.status,
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default(),
                )
            });
        observed.allocatable = status
            .allocatable
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| matches!(k.as_str(), "cpu" | "memory" | "pods"))
            .map(|(k, v)| (k, v.0))
            .collect();
    }
    let leases: Api<Lease> = Api::namespaced(ctx.upper.clone(), NODE_LEASE_NAMESPACE);
    if let Some(lease) = leases.get_opt(node).await.map_err(ApiError::on(
        "upper",
        "get",
        format!("lease {NODE_LEASE_NAMESPACE}/{node}"),
    ))? {
        observed.last_heartbeat = lease
            .spec
            .and_then(|s| s.renew_time)
            .map(|t| tensile_common::api::time(t.0));
    }
    Ok(())
}

async fn write_status(
    api: &Api<LowerCluster>,
    cluster: &LowerCluster,
    status: LowerClusterStatus,
) -> Result<(), Error> {
    if cluster.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let patch = json!({"status": status});
    api.patch_status(cluster.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(ApiError::on(
            "upper",
            "patch",
            format!("lowercluster {} status", cluster.name()),
        ))?;
    Ok(())
}

/// Says on the object why its removal waits, and looks again soon.
async fn removing(api: &Api<LowerCluster>, cluster: &LowerCluster, why: String) -> Result<Action, Error> {
    tracing::info!(cluster = %cluster.name(), "removal waits: {why}");
    let mut status = cluster.status.clone().unwrap_or_default();
    let since = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::READY && c.reason == "Removing")
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()));
    status.conditions.retain(|c| c.type_ != condition::READY);
    status
        .conditions
        .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: condition::READY.into(),
            status: "False".into(),
            reason: "Removing".into(),
            message: why,
            last_transition_time: since,
            observed_generation: cluster.metadata.generation,
        });
    write_status(api, cluster, status).await?;
    Ok(Action::requeue(Duration::from_secs(3)))
}

/// Removes `cluster`'s virtual node: its Deployment first (so nothing writes any more), then
/// everything it made below, then its Node, Leases, volumes and accounts upstream (and the
/// unanswered certificate requests of its account); the finalizer goes last.
async fn remove(cluster: &LowerCluster, ctx: &Context, api: &Api<LowerCluster>) -> Result<Action, Error> {
    let name = cluster.name().to_owned();
    if !cluster
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|f| f == names::LOWER_CLUSTER_FINALIZER))
    {
        return Ok(Action::await_change());
    }
    let ns = ctx.settings.namespace.as_str();
    let object = plan::object_name(&ctx.settings, &name);
    let others = api
        .list(&ListParams::default().labels(&ours(ctx)))
        .await
        .map_err(ApiError::on("upper", "list", "lowerclusters"))?;
    // The virtual node that was made for it, if one ever was (never for a LowerCluster that
    // was refused from the start: nothing of it exists, and another's must not be touched).
    let Some(node) = cluster.status.as_ref().and_then(|s| s.node_name.clone()) else {
        release_credential(&cluster.spec.credential.secret_name, cluster, &others.items, ctx).await?;
        return finish(cluster, api).await;
    };

    // 1. Drained as `kubectl drain` would: cordoned, and every pod bound to it evicted
    // (disruption budgets honoured) while it still runs, so each stops below gracefully
    // and its controller makes it again elsewhere; past the drain timeout the rest go with
    // the node.
    if let Some(waiting) = drain(cluster, ctx, &node).await? {
        return removing(api, cluster, waiting).await;
    }
    crash_point(ctx, RemovalStep::Drained);
    // 2. The virtual node stops: its Deployment goes with its pods (foreground).
    let deployments: Api<Deployment> = Api::namespaced(ctx.upper.clone(), ns);
    let foreground = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    if delete_made(&deployments, &object, &name, &foreground).await? {
        return removing(
            api,
            cluster,
            format!("deployment {ns}/{object}: its pods are stopping"),
        )
        .await;
    }
    // 3. No replica of it leads any more: its election Lease is free or lapsed (a replica on
    // a partitioned node may outlive its pod object; its writes are fenced by that Lease).
    let leases: Api<Lease> = Api::namespaced(ctx.upper.clone(), ns);
    let leader = plan::leader_lease(&node);
    if let Some(lease) =
        leases
            .get_opt(&leader)
            .await
            .map_err(ApiError::on("upper", "get", format!("lease {ns}/{leader}")))?
    {
        if held(&lease) {
            return removing(
                api,
                cluster,
                format!("lease {ns}/{leader} is still held by a replica"),
            )
            .await;
        }
        delete_quietly(&leases, &leader).await?;
    }
    crash_point(ctx, RemovalStep::Stopped);
    // 4. Everything it made below.
    let identity = Identity {
        cluster_id: ctx.settings.cluster_id.clone(),
        node: node.clone(),
    };
    let orphan = cluster
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORPHAN_LOWER))
        .is_some_and(|v| v == "true");
    let removed_below = cluster.status.as_ref().and_then(|s| s.lower_removed) == Some(true);
    if !orphan && !removed_below {
        let secrets: Api<Secret> = Api::namespaced(ctx.upper.clone(), ns);
        let secret_name = &cluster.spec.credential.secret_name;
        let hint = format!("annotate the LowerCluster {ORPHAN_LOWER}=true to remove it without that");
        let Some(secret) = secrets.get_opt(secret_name).await.map_err(ApiError::on(
            "upper",
            "get",
            format!("secret {ns}/{secret_name}"),
        ))?
        else {
            return removing(
                api,
                cluster,
                format!("Secret {ns}/{secret_name} is gone, so the lower objects cannot be removed; {hint}"),
            )
            .await;
        };
        let lower = match lower_client(&secret, cluster.spec.credential.key(), ctx, &name).await {
            Ok(lower) => lower,
            Err(e) => return removing(api, cluster, format!("{e}; {hint}")).await,
        };
        match teardown::remove_everything(&lower, &identity, &cluster.spec.served()).await {
            Ok(removal) if removal.done() => {
                tracing::info!(cluster = %name, "below: {}", removal.summary());
                // Recorded, so that a removal resumed after a restart goes on upstream even
                // once the credential is gone; the status change brings the next pass.
                let mut status = cluster.status.clone().unwrap_or_default();
                status.lower_removed = Some(true);
                write_status(api, cluster, status).await?;
                crash_point(ctx, RemovalStep::Below);
                return Ok(Action::await_change());
            }
            Ok(removal) => {
                // A pod on a lower node that is gone stays Terminating: deleting it below with
                // grace 0, or giving the objects below up, ends the wait.
                return removing(
                    api,
                    cluster,
                    format!(
                        "lower cluster: {}; what stays Terminating there (a pod on a lost node) holds this: \
                         delete it below with --grace-period=0, or {hint}",
                        removal.summary()
                    ),
                )
                .await;
            }
            Err(e) => {
                return removing(api, cluster, format!("lower cluster: {e}; {hint}")).await;
            }
        }
    }
    // 5. Upstream: its volumes (a retained one stays, as its reclaim policy says), Node and
    // heartbeat, and what was made for it.
    let volumes: Api<PersistentVolume> = Api::all(ctx.upper.clone());
    let marked = volumes
        .list(&ListParams::default().labels(&identity.selector()))
        .await
        .map_err(ApiError::on("upper", "list", "persistentvolumes"))?;
    for volume in marked.items {
        let retain = volume
            .spec
            .as_ref()
            .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
            == Some("Retain");
        if !retain {
            delete_quietly(&volumes, volume.metadata.name.as_deref().unwrap_or_default()).await?;
        }
    }
    let nodes: Api<Node> = Api::all(ctx.upper.clone());
    let virtual_or_gone = match nodes.get_opt(&node).await.map_err(ApiError::on(
        "upper",
        "get",
        format!("node {node}"),
    ))? {
        Some(found) if is_virtual_node(&found) => {
            delete_quietly(&nodes, &node).await?;
            true
        }
        Some(_) => {
            tracing::warn!(node = %node, "a Node of that name is not a virtual node: left alone, with its Lease");
            false
        }
        None => true,
    };
    if virtual_or_gone {
        let node_leases: Api<Lease> = Api::namespaced(ctx.upper.clone(), NODE_LEASE_NAMESPACE);
        delete_quietly(&node_leases, &node).await?;
    }
    let c = &ctx.upper;
    let plain = DeleteParams::default();
    if let Some(budgets) = budget_api(ctx) {
        delete_made(&budgets, &object, &name, &plain).await?;
    }
    // Its grants in the release namespace (election Lease) and in kube-node-lease (heartbeat).
    for namespace in [ns, NODE_LEASE_NAMESPACE] {
        let bindings = Api::<RoleBinding>::namespaced(c.clone(), namespace);
        delete_made(&bindings, &object, &name, &plain).await?;
        delete_made(
            &Api::<Role>::namespaced(c.clone(), namespace),
            &object,
            &name,
            &plain,
        )
        .await?;
    }
    let shared = format!("{object}-shared");
    delete_made(&Api::<ClusterRoleBinding>::all(c.clone()), &shared, &name, &plain).await?;
    delete_made(&Api::<ClusterRoleBinding>::all(c.clone()), &object, &name, &plain).await?;
    delete_made(&Api::<ClusterRole>::all(c.clone()), &object, &name, &plain).await?;
    delete_made(
        &Api::<ServiceAccount>::namespaced(c.clone(), ns),
        &object,
        &name,
        &plain,
    )
    .await?;
    // With the account gone it asks for nothing more; what it asked that is unanswered is
    // denied, so no one approves it later, and then deleted. A certificate issued before cannot be revoked: it
    // ends within the lifetime the approver bounds (a day at most).
    if ctx.settings.node_identity {
        let account = approve::account(&ctx.settings, &name);
        let requests = Api::<CertificateSigningRequest>::all(c.clone());
        let denied = approve::deny_unanswered(&requests, &account, &name)
            .await
            .map_err(ApiError::on(
                "upper",
                "deny",
                format!("certificatesigningrequests of {account}"),
            ))?;
        if denied > 0 {
            tracing::info!(cluster = %name, denied, "unanswered certificate requests of its account denied");
        }
        // Then none of them is left: a node stopped while it waited leaves its request.
        approve::delete_requests(&requests, &account)
            .await
            .map_err(ApiError::on(
                "upper",
                "delete",
                format!("certificatesigningrequests of {account}"),
            ))?;
    }
    delete_made(
        &Api::<ConfigMap>::namespaced(c.clone(), ns),
        &object,
        &name,
        &plain,
    )
    .await?;
    if let Ok(mut applied) = ctx.applied.lock() {
        applied.remove(&name);
    }
    crash_point(ctx, RemovalStep::Upstream);
    // 6. The credential may go (unless another LowerCluster uses it), then the finalizer.
    release_credential(&cluster.spec.credential.secret_name, cluster, &others.items, ctx).await?;
    crash_point(ctx, RemovalStep::Released);
    finish(cluster, api).await
}

/// Removes `cluster`'s finalizer: the last step of its removal.
async fn finish(cluster: &LowerCluster, api: &Api<LowerCluster>) -> Result<Action, Error> {
    let name = cluster.name();
    if set_finalizer(api, cluster, &format!("lowercluster {name}"), false).await? {
        tracing::info!(cluster = %name, "removed");
    }
    Ok(Action::await_change())
}

/// Adds (`on`) or removes the finalizer `tensile.io/lower-cluster` on `object`, guarded by
/// its resourceVersion. `Ok(true)` when it was changed; an object already so, or gone, is
/// left as it is.
async fn set_finalizer<K>(api: &Api<K>, object: &K, what: &str, on: bool) -> Result<bool, Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let finalizers = object.meta().finalizers.clone().unwrap_or_default();
    if finalizers.iter().any(|f| f == names::LOWER_CLUSTER_FINALIZER) == on {
        return Ok(false);
    }
    let mut rest: Vec<String> = finalizers
        .into_iter()
        .filter(|f| f != names::LOWER_CLUSTER_FINALIZER)
        .collect();
    if on {
        rest.push(names::LOWER_CLUSTER_FINALIZER.to_owned());
    }
    let patch = json!({"metadata": {"finalizers": rest, "resourceVersion": object.meta().resource_version}});
    let name = object.meta().name.clone().unwrap_or_default();
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if code(&e) == Some(404) => Ok(false),
        Err(e) => Err(ApiError::on("upper", "patch", format!("{what} (finalizer)"))(e).into()),
    }
}

/// Cordons `node` and evicts its pods; `Some(why)` while pods remain and the drain has
/// not timed out.
async fn drain(cluster: &LowerCluster, ctx: &Context, node: &str) -> Result<Option<String>, Error> {
    let nodes: Api<Node> = Api::all(ctx.upper.clone());
    let Some(found) =
        nodes
            .get_opt(node)
            .await
            .map_err(ApiError::on("upper", "get", format!("node {node}")))?
    else {
        return Ok(None);
    };
    if !is_virtual_node(&found) {
        return Ok(None);
    }
    if !found.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false) {
        let patch = json!({"spec": {"unschedulable": true}});
        nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(ApiError::on("upper", "patch", format!("node {node} (cordon)")))?;
        tracing::info!(node, "cordoned: its lower cluster is leaving");
    }
    let started = cluster
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or_else(jiff::Timestamp::now);
    let waited = jiff::Timestamp::now().duration_since(started);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::all(ctx.upper.clone());
    let bound = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(ApiError::on("upper", "list", format!("pods on node {node}")))?;
    let drained: Vec<_> = bound
        .items
        .into_iter()
        .filter(|p| {
            !p.metadata
                .owner_references
                .as_ref()
                .is_some_and(|o| o.iter().any(|o| o.kind == "DaemonSet"))
        })
        .collect();
    if drained.is_empty() {
        return Ok(None);
    }
    if waited >= jiff::SignedDuration::try_from(ctx.drain_timeout).unwrap_or(jiff::SignedDuration::MAX) {
        tracing::warn!(
            node,
            pods = drained.len(),
            "drain timed out: the remaining pods go with the node"
        );
        return Ok(None);
    }
    let mut refused = 0;
    for pod in drained.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(ctx.upper.clone(), &ns);
        match tensile_common::evict::evict(&api, pod).await {
            Ok(tensile_common::evict::Evicted::Refused(_)) => refused += 1,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(node, pod = %format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default()), "evicting: {e}")
            }
        }
    }
    Ok(Some(format!(
        "draining node {node}: {} pod(s) still bound{}",
        drained.len(),
        if refused > 0 {
            format!(", {refused} held by a disruption budget")
        } else {
            String::new()
        }
    )))
}

fn is_virtual_node(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(names::VIRTUAL_NODE_TYPE_LABEL))
        .is_some_and(|v| v == names::VIRTUAL_NODE_TYPE_VALUE)
}

/// Keeps the credential Secret while a LowerCluster uses it: deleted with the chart's
/// release (or by hand) before the LowerCluster's removal has used it to clean up below, it
/// stays until that is done.
async fn hold(secrets: &Api<Secret>, secret: &Secret) -> Result<(), Error> {
    // A Secret being deleted takes no new finalizer.
    if secret.metadata.deletion_timestamp.is_none() {
        let name = secret.metadata.name.as_deref().unwrap_or_default();
        set_finalizer(secrets, secret, &format!("secret {name}"), true).await?;
    }
    Ok(())
}

/// Lets the credential Secret `secret_name` go, unless another LowerCluster uses it: one
/// that names it and is not being deleted, or one still being removed with it.
async fn release_credential(
    secret_name: &str,
    cluster: &LowerCluster,
    others: &[LowerCluster],
    ctx: &Context,
) -> Result<(), Error> {
    let holds = |o: &LowerCluster| {
        o.metadata.deletion_timestamp.is_none()
            || o.metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f == names::LOWER_CLUSTER_FINALIZER))
    };
    let shared = others
        .iter()
        .any(|o| o.name() != cluster.name() && o.spec.credential.secret_name == secret_name && holds(o));
    if shared {
        return Ok(());
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.upper.clone(), &ctx.settings.namespace);
    let Some(secret) = secrets.get_opt(secret_name).await.map_err(ApiError::on(
        "upper",
        "get",
        format!("secret {secret_name}"),
    ))?
    else {
        return Ok(());
    };
    set_finalizer(&secrets, &secret, &format!("secret {secret_name}"), false).await?;
    Ok(())
}

/// Whether an election Lease is held by someone whose term has not lapsed.
fn held(lease: &Lease) -> bool {
    let Some(spec) = &lease.spec else {
        return false;
    };
    if spec.holder_identity.as_deref().unwrap_or_default().is_empty() {
        return false;
    }
    let (Some(renewed), Some(seconds)) = (&spec.renew_time, spec.lease_duration_seconds) else {
        return false;
    };
    let until = renewed.0 + jiff::SignedDuration::from_secs(i64::from(seconds));
    jiff::Timestamp::now() < until
}

async fn delete_quietly<K>(api: &Api<K>, name: &str) -> Result<(), Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(e) if code(&e) == Some(404) => Ok(()),
        Err(e) => Err(ApiError::on("upper", "delete", format!("{} {name}", api.resource_url()))(e).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(holder: &str, renewed_ago: i64, duration: i32) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(
                    jiff::Timestamp::now() - jiff::SignedDuration::from_secs(renewed_ago),
                )),
                lease_duration_seconds: Some(duration),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn an_election_lease_is_held_only_by_a_holder_within_its_term() {
        assert!(held(&lease("vn-0", 1, 15)));
        assert!(!held(&lease("vn-0", 16, 15)), "lapsed");
        assert!(!held(&lease("", 1, 15)), "released");
        assert!(!held(&Lease::default()));
    }
}
