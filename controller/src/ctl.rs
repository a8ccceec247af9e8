//! `tensilectl`: a lower cluster joins the fleet in one command and leaves it in one.
//!
//! `join NAME` makes, in the lower cluster, the account a virtual node acts as there with
//! the rights the chart's `target=lower` renders (read from `deploy/lower-cluster-rbac.yaml`,
//! one source for both), asks the lower cluster for a token of it that lives
//! `--token-lifetime` (the cluster controller renews it at 80 %), and makes in the upper
//! cluster the credential Secret and the `LowerCluster`; then it waits until the virtual
//! node is Ready. `leave NAME` deletes the `LowerCluster` (whose finalizer removes the
//! virtual node and what it made), then what `join` made, in both clusters. Everything
//! `join` makes carries `app.kubernetes.io/managed-by=tensilectl` and
//! `tensile.io/lower-cluster=NAME`; `leave` deletes nothing without those.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use tensile_common::api::{code, message};
use tensile_common::kubeconfig::ClientOptions;
use tensile_common::lower::identity::Identity;
use tensile_common::lower::teardown;
use tensile_common::names;

use crate::credential::{self, Endpoint};
use crate::resource::{Credential, LowerCluster, LowerClusterSpec, condition, record};

/// The rights of a virtual node in a lower cluster, as the chart renders them: every
/// namespace, and namespace scope (one served namespace).
const LOWER_RBAC: &str = include_str!("../../deploy/lower-cluster-rbac.yaml");
const LOWER_NAMESPACE_RBAC: &str = include_str!("../../deploy/lower-namespace-rbac.yaml");
/// The rights of every namespace with the features that need more on (reflectServices,
/// gcNamespaces): where join takes those from.
const LOWER_FEATURES_RBAC: &str = include_str!("../../deploy/lower-cluster-features-rbac.yaml");

/// `rules` with what `features` need besides: Services and Endpoints copied
/// (reflectServices), namespaces listed and deleted and every kind listed to see one is empty
/// (gcNamespaces, never under a namespace scope), as the chart renders them.
fn with_features(
    mut rules: Vec<PolicyRule>,
    features: crate::plan::Features,
    cluster_wide: bool,
) -> Vec<PolicyRule> {
    let has = |rule: &PolicyRule, resource: &str| {
        rule.resources
            .as_ref()
            .is_some_and(|r| r.iter().any(|x| x == resource))
    };
    let rendered = chart_rules(LOWER_FEATURES_RBAC, "ClusterRole", CHART_ACCOUNT);
    let from_rendered = |resource: &str| rendered.iter().find(|r| has(r, resource)).cloned();
    if features.reflect_services
        && let Some(copies) = rules.iter_mut().find(|r| has(r, "configmaps"))
        && let Some(wanted) = from_rendered("configmaps")
    {
        copies.resources = wanted.resources;
    }
    if features.gc_namespaces && cluster_wide {
        if let Some(namespaces) = rules.iter_mut().find(|r| has(r, "namespaces"))
            && let Some(wanted) = from_rendered("namespaces")
        {
            namespaces.verbs = wanted.verbs;
        }
        rules.extend(rendered.iter().filter(|r| r.verbs == ["list"]).cloned());
    }
    rules
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "tensilectl",
    version,
    about = "Joins lower clusters to a tensile fleet and removes them"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Sets a lower cluster up and registers it as a LowerCluster; waits until it is Ready.
    Join(JoinArgs),
    /// Removes a lower cluster: its LowerCluster, its virtual node and everything either
    /// made, in both clusters.
    Leave(LeaveArgs),
    /// Prints the fleet.
    Status(StatusArgs),
    /// Applies this release's CustomResourceDefinitions to the upper cluster: helm installs
    /// its crds/ on a first install only, and never upgrades them.
    Crds(CrdsArgs),
    /// Refuses (exit 1) while a LowerCluster of the release still holds a virtual node, whose
    /// removal needs the release's controller; the chart's pre-delete hook runs it.
    UninstallCheck(UninstallCheckArgs),
}

#[derive(Debug, clap::Args)]
pub struct UninstallCheckArgs {
    #[command(flatten)]
    pub clusters: Clusters,
    /// How long to wait for removals already under way to end (0: do not wait).
    #[arg(long, default_value = "2m", value_parser = tensile_common::leader::parse_duration)]
    pub wait: Duration,
}

#[derive(Debug, clap::Args)]
pub struct CrdsArgs {
    #[command(flatten)]
    pub clusters: Clusters,
}

/// The CustomResourceDefinitions of this release (the chart's crds/).
const CRDS: [&str; 2] = [
    include_str!("../../deploy/helm/tensile/crds/lowerclusters.yaml"),
    include_str!("../../deploy/helm/tensile/crds/exclusionrecords.yaml"),
];

/// `tensilectl crds`: applies [`CRDS`] and waits until each is established; says of each
/// whether it was made, changed or already so.
pub async fn crds(args: &CrdsArgs) -> Result<String, Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let upper = upper_client(&args.clusters).await?;
    let api: Api<CustomResourceDefinition> = Api::all(upper);
    let mut out = String::new();
    for text in CRDS {
        let value: serde_json::Value = serde_yaml::from_str(text).map_err(|e| {
            Error::Refused(format!(
                "a CustomResourceDefinition of this release does not parse: {e}"
            ))
        })?;
        let name = value["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let what = format!("CustomResourceDefinition {name}");
        let before = api
            .get_opt(&name)
            .await
            .map_err(api_error("upper", "get", what.clone()))?;
        let applied = api
            .patch(&name, &ssa(), &Patch::Apply(&value))
            .await
            .map_err(api_error("upper", "apply", what.clone()))?;
        let said = match before {
            None => "made",
            Some(b) if b.metadata.resource_version != applied.metadata.resource_version => "updated",
            Some(_) => "already current",
        };
        let started = Instant::now();
        loop {
            let established = api
                .get_opt(&name)
                .await
                .map_err(api_error("upper", "get", what.clone()))?
                .and_then(|c| c.status?.conditions)
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Established" && c.status == "True"));
            if established {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err(Error::Timeout(format!("{what} is not established after 60 s")));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let _ = writeln!(out, "{what}: {said}");
    }
    Ok(out)
}

/// The two clusters and where tensile lives in each.
#[derive(Debug, clap::Args)]
pub struct Clusters {
    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long = "upper-kubeconfig", env = "TENSILE_UPPER_KUBECONFIG")]
    pub upper_kubeconfig: Option<PathBuf>,
    /// Context of the upper kubeconfig (default: its current one).
    #[arg(long = "upper-context", env = "TENSILE_UPPER_CONTEXT")]
    pub upper_context: Option<String>,
    /// The upper namespace of the chart's release, where credentials live.
    #[arg(long, short = 'n', env = "TENSILE_NAMESPACE", default_value = "tensile")]
    pub namespace: String,
    /// Id of the upper cluster in lower marks, if the chart sets one (default: the upper
    /// kube-system namespace UID, as the daemons' default).
    #[arg(long = "cluster-id", env = "TENSILE_CLUSTER_ID")]
    pub cluster_id: Option<String>,
}

/// The lower cluster, as its admin reaches it.
#[derive(Debug, clap::Args)]
pub struct Lower {
    /// Kubeconfig of an admin of the lower cluster.
    #[arg(long = "lower-kubeconfig", env = "TENSILE_LOWER_KUBECONFIG")]
    pub lower_kubeconfig: PathBuf,
    /// Context of the lower kubeconfig (default: its current one).
    #[arg(long = "lower-context", env = "TENSILE_LOWER_CONTEXT")]
    pub lower_context: Option<String>,
    /// The lower namespace of the virtual node's account.
    #[arg(
        long = "lower-namespace",
        env = "TENSILE_LOWER_NAMESPACE",
        default_value = "tensile"
    )]
    pub lower_namespace: String,
}

#[derive(Debug, clap::Args)]
pub struct JoinArgs {
    /// The LowerCluster's name, and the virtual node's.
    pub name: String,
    #[command(flatten)]
    pub clusters: Clusters,
    #[command(flatten)]
    pub lower: Lower,
    /// The lower apiserver's address as the upper cluster's pods reach it (default: the
    /// lower kubeconfig's).
    #[arg(long, env = "TENSILE_LOWER_SERVER")]
    pub server: Option<String>,
    /// Lifetime of the credential's token; the cluster controller renews it at 80 %.
    #[arg(long = "token-lifetime", default_value = "24h", value_parser = tensile_common::leader::parse_duration)]
    pub token_lifetime: Duration,
    /// Labels of the virtual node, `key=value,...`.
    #[arg(long = "node-labels", value_delimiter = ',', value_parser = tensile_common::names::parse_label)]
    pub node_labels: Vec<(String, String)>,
    /// Register the virtual node without its virtual-kubelet.io/provider taint.
    #[arg(long = "disable-taint")]
    pub disable_taint: bool,
    /// Namespace scope: the lower namespaces the virtual node serves (comma-separated; they
    /// must exist). The credential then holds a Role in each and nothing cluster-wide.
    #[arg(long, value_delimiter = ',')]
    pub namespaces: Vec<String>,
    /// How long to wait for Ready (0: do not wait).
    #[arg(long, default_value = "3m", value_parser = tensile_common::leader::parse_duration)]
    pub wait: Duration,
    /// Print the objects join would make, in both clusters, and make none.
    #[arg(long = "dry-run")]
    pub dry_run: bool,
}

#[derive(Debug, clap::Args)]
pub struct LeaveArgs {
    /// The LowerCluster's name.
    pub name: String,
    #[command(flatten)]
    pub clusters: Clusters,
    /// Kubeconfig of an admin of the lower cluster.
    #[arg(
        long = "lower-kubeconfig",
        env = "TENSILE_LOWER_KUBECONFIG",
        required_unless_present = "lower_unreachable"
    )]
    pub lower_kubeconfig: Option<PathBuf>,
    /// Context of the lower kubeconfig (default: its current one).
    #[arg(long = "lower-context", env = "TENSILE_LOWER_CONTEXT")]
    pub lower_context: Option<String>,
    /// The lower namespace of the virtual node's account (default: the one join recorded on
    /// the LowerCluster, else `tensile`).
    #[arg(long = "lower-namespace", env = "TENSILE_LOWER_NAMESPACE")]
    pub lower_namespace: Option<String>,
    /// The lower cluster is gone for good: remove the LowerCluster and its virtual node
    /// without touching it, and print what stays there.
    #[arg(long = "lower-unreachable", conflicts_with = "lower_kubeconfig")]
    pub lower_unreachable: bool,
    /// How long to wait for each removal.
    #[arg(long, default_value = "5m", value_parser = tensile_common::leader::parse_duration)]
    pub wait: Duration,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub clusters: Clusters,
    /// The lower clusters of every release, not only those of `-n`'s.
    #[arg(long = "all-namespaces", short = 'A')]
    pub all_namespaces: bool,
    /// Output format: `text` (a line each) or `json`.
    #[arg(long, short = 'o', default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
}

/// What went wrong, naming the cluster, the step and the object.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{cluster} cluster: {verb} {what}: {why}{hint}")]
    Api {
        cluster: &'static str,
        verb: &'static str,
        what: String,
        why: String,
        hint: &'static str,
    },
    #[error("{0}")]
    Client(#[from] tensile_common::kubeconfig::Error),
    #[error("lower kubeconfig {path}: {why}")]
    LowerKubeconfig { path: PathBuf, why: String },
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Timeout(String),
    /// The status, printed as it is: some lower cluster is not Ready.
    #[error("{0}")]
    NotReady(String),
    /// A step failed after others made objects: which, and how to remove them.
    #[error("{source}\nmade before that: {made}; `tensilectl leave {name}` removes them, or run join again")]
    Partial {
        name: String,
        made: String,
        source: Box<Error>,
    },
}

fn api_error(
    cluster: &'static str,
    verb: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |e| {
        let hint = match code(&e) {
            Some(403) if cluster == "lower" => {
                " (the lower kubeconfig must be an admin's: join grants the virtual node its rights there)"
            }
            Some(403) => {
                " (the upper kubeconfig must be allowed to manage Secrets in the release namespace and LowerClusters)"
            }
            _ => "",
        };
        Error::Api {
            cluster,
            verb,
            what,
            why: message(&e),
            hint,
        }
    }
}

fn ssa() -> PatchParams {
    PatchParams::apply(names::TENSILECTL).force()
}

/// The lower objects' names.
pub fn account_name(cluster: &str) -> String {
    format!("tensile-{cluster}")
}

/// The upper credential Secret's name.
pub fn secret_name(cluster: &str) -> String {
    format!("{cluster}-credential")
}

fn labels(cluster: &str, upper_id: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (names::MANAGED_BY.to_owned(), names::TENSILECTL.to_owned()),
        (names::LOWER_CLUSTER.to_owned(), cluster.to_owned()),
        (names::MARK_CLUSTER.to_owned(), upper_id.to_owned()),
    ])
}

/// Whether tensilectl made `meta`'s object for lower cluster `cluster` of the upper cluster
/// `upper_id`: an object of another fleet (another upper cluster's join) is never touched.
fn ours(meta: &ObjectMeta, cluster: &str, upper_id: &str) -> bool {
    let l = meta.labels.as_ref();
    let label = |key: &str| l.and_then(|l| l.get(key)).map(String::as_str);
    label(names::MANAGED_BY) == Some(names::TENSILECTL)
        && label(names::LOWER_CLUSTER) == Some(cluster)
        && label(names::MARK_CLUSTER) == Some(upper_id)
}

/// The lower objects of join's names for `cluster` (its account in `namespace` and its
/// token Role and binding, its ClusterRole and binding when `cluster_wide`, its Role and
/// binding in each of `served`) that exist and that tensilectl did not make for it of the
/// upper cluster `upper_id`.
async fn foreign_below(
    lower: &kube::Client,
    (namespace, served): (&str, &[String]),
    cluster_wide: bool,
    cluster: &str,
    upper_id: &str,
) -> Result<Vec<String>, Error> {
    let account = account_name(cluster);
    let token = format!("{account}-token");
    let mut found = Vec::new();
    let (sa, roles, bindings) = (
        Api::<ServiceAccount>::namespaced(lower.clone(), namespace),
        Api::<Role>::namespaced(lower.clone(), namespace),
        Api::<RoleBinding>::namespaced(lower.clone(), namespace),
    );
    found.extend(foreign(&sa, "lower", &account, cluster, upper_id).await?);
    found.extend(foreign(&roles, "lower", &token, cluster, upper_id).await?);
    found.extend(foreign(&bindings, "lower", &token, cluster, upper_id).await?);
    if cluster_wide {
        let role = Api::<ClusterRole>::all(lower.clone());
        found.extend(foreign(&role, "lower", &account, cluster, upper_id).await?);
        let binding = Api::<ClusterRoleBinding>::all(lower.clone());
        found.extend(foreign(&binding, "lower", &account, cluster, upper_id).await?);
    }
    for ns in served {
        let role = Api::<Role>::namespaced(lower.clone(), ns);
        found.extend(foreign(&role, "lower", &account, cluster, upper_id).await?);
        let binding = Api::<RoleBinding>::namespaced(lower.clone(), ns);
        found.extend(foreign(&binding, "lower", &account, cluster, upper_id).await?);
    }
    Ok(found)
}

/// `what`, named `name`, when it exists and tensilectl did not make it for `cluster` of the
/// upper cluster `upper_id`.
async fn foreign<K>(
    api: &Api<K>,
    side: &'static str,
    name: &str,
    cluster: &str,
    upper_id: &str,
) -> Result<Option<String>, Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let what = match api.namespace() {
        Some(ns) => format!("{} {ns}/{name}", K::kind(&())),
        None => format!("{} {name}", K::kind(&())),
    };
    let found = api
        .get_opt(name)
        .await
        .map_err(api_error(side, "get", what.clone()))?;
    Ok(found.filter(|f| !ours(f.meta(), cluster, upper_id)).map(|_| what))
}

/// The rules of the first `kind` named `name` in the chart's lower rendering `rendered`.
fn chart_rules(rendered: &str, kind: &str, name: &str) -> Vec<PolicyRule> {
    for doc in rendered.split("\n---") {
        let Ok(value) = serde_yaml::from_str::<serde_json::Value>(doc) else {
            continue;
        };
        if value["kind"] == kind
            && value["metadata"]["name"] == name
            && let Ok(rules) = serde_json::from_value::<Vec<PolicyRule>>(value["rules"].clone())
        {
            return rules;
        }
    }
    Vec::new()
}

/// The chart's lower account name in the rendered files (release `tensile`).
const CHART_ACCOUNT: &str = "tensile-lower";

/// What `join` makes in the lower cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct LowerObjects {
    pub namespace: Namespace,
    pub account: ServiceAccount,
    /// Every namespace: one ClusterRole and its binding.
    pub role: Option<ClusterRole>,
    pub binding: Option<ClusterRoleBinding>,
    /// Namespace scope: a Role and its binding in each served namespace.
    pub namespace_grants: Vec<(Role, RoleBinding)>,
    pub token_role: Role,
    pub token_binding: RoleBinding,
}

/// The lower objects of cluster `name`, in `namespace`, for the upper cluster `upper_id`;
/// rights in every namespace, or in those of `served` only, with what `features` need.
pub fn lower_objects(
    name: &str,
    namespace: &str,
    upper_id: &str,
    served: &[String],
    features: crate::plan::Features,
) -> LowerObjects {
    let account = account_name(name);
    let meta = |ns: Option<&str>, object: &str| ObjectMeta {
        name: Some(object.to_owned()),
        namespace: ns.map(str::to_owned),
        labels: Some(labels(name, upper_id)),
        ..Default::default()
    };
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: account.clone(),
        namespace: Some(namespace.to_owned()),
        api_group: None,
    };
    let token_rules = chart_rules(LOWER_RBAC, "Role", &format!("{CHART_ACCOUNT}-token"))
        .into_iter()
        .map(|mut rule| {
            rule.resource_names = Some(vec![account.clone()]);
            rule
        })
        .collect();
    LowerObjects {
        namespace: Namespace {
            metadata: meta(None, namespace),
            ..Default::default()
        },
        account: ServiceAccount {
            metadata: meta(Some(namespace), &account),
            ..Default::default()
        },
        role: served.is_empty().then(|| ClusterRole {
            metadata: meta(None, &account),
            rules: Some(with_features(
                chart_rules(LOWER_RBAC, "ClusterRole", CHART_ACCOUNT),
                features,
                true,
            )),
            aggregation_rule: None,
        }),
        binding: served.is_empty().then(|| ClusterRoleBinding {
            metadata: meta(None, &account),
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: account.clone(),
            },
            subjects: Some(vec![subject.clone()]),
        }),
        namespace_grants: served
            .iter()
            .map(|ns| {
                let role = Role {
                    metadata: meta(Some(ns), &account),
                    rules: Some(with_features(
                        chart_rules(LOWER_NAMESPACE_RBAC, "Role", CHART_ACCOUNT),
                        features,
                        false,
                    )),
                };
                let binding = RoleBinding {
                    metadata: meta(Some(ns), &account),
                    role_ref: RoleRef {
                        api_group: Some("rbac.authorization.k8s.io".into()),
                        kind: "Role".into(),
                        name: account.clone(),
                    },
                    subjects: Some(vec![subject.clone()]),
                };
                (role, binding)
            })
            .collect(),
        token_role: Role {
            metadata: meta(Some(namespace), &format!("{account}-token")),
            rules: Some(token_rules),
        },
        token_binding: RoleBinding {
            metadata: meta(Some(namespace), &format!("{account}-token")),
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Role".into(),
                name: format!("{account}-token"),
            },
            subjects: Some(vec![subject]),
        },
    }
}

/// Which lower cluster join made its objects in: recorded on the `LowerCluster`.
#[derive(Clone, Debug, Default)]
pub struct Joined {
    /// The lower cluster's id (its kube-system namespace's UID).
    pub lower_uid: String,
    pub server: String,
    pub namespace: String,
}

/// The upper objects of cluster `name`: the credential Secret and the `LowerCluster`, with
/// the record of `joined`.
pub fn upper_objects(
    args: &JoinArgs,
    upper_id: &str,
    kubeconfig: &str,
    token: &str,
    joined: &Joined,
) -> (Secret, LowerCluster) {
    let name = args.name.as_str();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(name)),
            namespace: Some(args.clusters.namespace.clone()),
            labels: Some(labels(name, upper_id)),
            ..Default::default()
        },
        data: Some(credential::secret_data(kubeconfig, token)),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    let mut cluster = LowerCluster::new(
        name,
        LowerClusterSpec {
            credential: Credential {
                secret_name: secret_name(name),
                key: None,
            },
            node_labels: args.node_labels.iter().cloned().collect(),
            disable_taint: args.disable_taint,
            namespaces: args.namespaces.clone(),
            ..Default::default()
        },
    );
    let mut cluster_labels = labels(name, upper_id);
    cluster_labels.insert(
        names::CONTROLLER_NAMESPACE.to_owned(),
        args.clusters.namespace.clone(),
    );
    cluster.metadata.labels = Some(cluster_labels);
    cluster.metadata.annotations = Some(BTreeMap::from([
        (record::LOWER_UID.to_owned(), joined.lower_uid.clone()),
        (record::LOWER_SERVER.to_owned(), joined.server.clone()),
        (record::LOWER_NAMESPACE.to_owned(), joined.namespace.clone()),
    ]));
    (secret, cluster)
}

async fn upper_client(clusters: &Clusters) -> Result<kube::Client, Error> {
    let options = ClientOptions {
        context: clusters.upper_context.clone(),
        user_agent: Some(names::TENSILECTL.into()),
        ..Default::default()
    };
    let path = clusters
        .upper_kubeconfig
        .clone()
        .or_else(|| std::env::var_os("KUBECONFIG").map(PathBuf::from))
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            let default = Path::new(&home).join(".kube/config");
            default.exists().then_some(default)
        });
    Ok(tensile_common::kubeconfig::client(path.as_deref(), &options).await?)
}

async fn lower_client(kubeconfig: &Path, context: Option<&str>) -> Result<kube::Client, Error> {
    let options = ClientOptions {
        context: context.map(str::to_owned),
        user_agent: Some(names::TENSILECTL.into()),
        ..Default::default()
    };
    Ok(tensile_common::kubeconfig::client_from_file(kubeconfig, &options).await?)
}

async fn upper_id(client: &kube::Client, clusters: &Clusters) -> Result<String, Error> {
    match &clusters.cluster_id {
        Some(id) => Ok(id.clone()),
        None => cluster_uid(client, "upper").await,
    }
}

/// A cluster's id: its kube-system namespace's UID.
async fn cluster_uid(client: &kube::Client, side: &'static str) -> Result<String, Error> {
    let ns = Api::<Namespace>::all(client.clone())
        .get("kube-system")
        .await
        .map_err(api_error(side, "get", "namespace kube-system (the cluster's id)"))?;
    Ok(ns.metadata.uid.unwrap_or_default())
}

/// Applies `object`; what it is, to say it was made.
async fn apply<K>(api: &Api<K>, cluster: &'static str, object: &K) -> Result<String, Error>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    let what = match &object.meta().namespace {
        Some(ns) => format!("{} {ns}/{name}", K::kind(&())),
        None => format!("{} {name}", K::kind(&())),
    };
    let mut value =
        serde_json::to_value(object).map_err(|e| Error::Refused(format!("encoding {what}: {e}")))?;
    value["apiVersion"] = K::api_version(&()).into();
    value["kind"] = K::kind(&()).into();
    api.patch(&name, &ssa(), &Patch::Apply(&value))
        .await
        .map_err(api_error(cluster, "apply", what.clone()))?;
    Ok(format!("{cluster} {what}"))
}

/// Applies `object` and notes it in `made`; a failure says what `made` holds.
async fn make<K>(
    made: &mut Vec<String>,
    name: &str,
    api: &Api<K>,
    cluster: &'static str,
    object: &K,
) -> Result<(), Error>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let what = apply(api, cluster, object)
        .await
        .map_err(|e| partial(name, made, e))?;
    made.push(what);
    Ok(())
}

/// `e`, saying what was `made` before it when anything was.
fn partial(name: &str, made: &[String], e: Error) -> Error {
    if made.is_empty() {
        return e;
    }
    Error::Partial {
        name: name.to_owned(),
        made: made.join(", "),
        source: Box::new(e),
    }
}

/// What join reads of the release it joins a cluster to.
#[derive(Debug, Default)]
pub struct Release {
    /// The name prefix, from its cluster controller's flags.
    pub prefix: Option<String>,
    /// What its virtual nodes do below beyond the base, from their template.
    pub features: crate::plan::Features,
}

/// The release of namespace `upper_ns`, as far as the upper kubeconfig may read it (an
/// account that may not read Deployments or ConfigMaps there leaves the name's length to the
/// controller and joins with the base rights, which the controller then reports short).
async fn release(upper: &kube::Client, upper_ns: &str) -> Release {
    let controllers = Api::<Deployment>::namespaced(upper.clone(), upper_ns)
        .list(&ListParams::default().labels("app.kubernetes.io/component=cluster-controller"))
        .await;
    let prefix = controllers.ok().and_then(|list| {
        list.items
            .iter()
            .filter_map(|d| d.spec.template.spec.as_ref())
            .flat_map(|spec| &spec.containers)
            .flat_map(|c| c.args.iter().flatten())
            .find_map(|a| a.strip_prefix("--name-prefix=").map(str::to_owned))
    });
    let template = match &prefix {
        Some(prefix) => Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(upper.clone(), upper_ns)
            .get_opt(&format!("{prefix}-virtual-node-template"))
            .await
            .ok()
            .flatten()
            .and_then(|c| c.data?.remove("deployment.yaml"))
            .and_then(|text| serde_yaml::from_str::<Deployment>(&text).ok()),
        None => None,
    };
    Release {
        prefix,
        features: template
            .as_ref()
            .map(crate::plan::Features::of_template)
            .unwrap_or_default(),
    }
}

/// What join checks upstream before it makes anything: that NAME fits the chart's names,
/// and that nothing of the upper cluster already answers to it but a LowerCluster of that
/// name (whose lower cluster is checked once reached). Returns that LowerCluster.
async fn check_upper(
    upper: &kube::Client,
    args: &JoinArgs,
    upper_id: &str,
    release: &Release,
) -> Result<Option<LowerCluster>, Error> {
    let name = args.name.as_str();
    let upper_ns = args.clusters.namespace.as_str();
    if let Some(prefix) = &release.prefix {
        crate::plan::name_fits(prefix, name).map_err(|why| Error::Refused(format!("{name}: {why}")))?;
    }
    let all = Api::<LowerCluster>::all(upper.clone())
        .list(&ListParams::default())
        .await
        .map_err(api_error("upper", "list", "lowerclusters"))?;
    if let Some(other) = all
        .items
        .iter()
        .find(|c| c.name() != name && c.node_name() == name)
    {
        return Err(Error::Refused(format!(
            "upper cluster: LowerCluster {} has the virtual node {name}: choose another name",
            other.name()
        )));
    }
    let existing = all.items.into_iter().find(|c| c.name() == name);
    match &existing {
        Some(e) if e.metadata.deletion_timestamp.is_some() => {
            return Err(Error::Refused(format!(
                "upper cluster: LowerCluster {name} is being removed: join again once it is gone \
                 (kubectl get lowercluster {name})"
            )));
        }
        Some(e) if !ours(&e.metadata, name, upper_id) => {
            return Err(Error::Refused(format!(
                "upper cluster: LowerCluster {name} exists and was not made by tensilectl join: it is \
                 left alone; choose another name, or delete it first"
            )));
        }
        Some(_) => {}
        None => {
            if Api::<Node>::all(upper.clone())
                .get_opt(name)
                .await
                .map_err(api_error("upper", "get", format!("Node {name}")))?
                .is_some()
            {
                return Err(Error::Refused(format!(
                    "upper cluster: Node {name} exists and is no LowerCluster's virtual node: the \
                     virtual node would take its name; choose another name"
                )));
            }
        }
    }
    if let Some(what) = foreign(
        &Api::<Secret>::namespaced(upper.clone(), upper_ns),
        "upper",
        &secret_name(name),
        name,
        upper_id,
    )
    .await?
    {
        return Err(Error::Refused(format!(
            "upper cluster: {what} exists and was not made by tensilectl for {name}: it is left \
             alone; choose another name"
        )));
    }
    Ok(existing)
}

/// A join of `existing`'s name again: only of the lower cluster and namespace it was
/// joined with (renewing its grants and credential); another one would take its entry
/// over and orphan what runs below.
fn check_rejoin(existing: &LowerCluster, joined: &Joined) -> Result<(), Error> {
    let name = existing.name();
    let recorded = |key: &str| {
        existing
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .cloned()
    };
    match recorded(record::LOWER_UID) {
        Some(uid) if uid == joined.lower_uid => {}
        Some(_) => {
            return Err(Error::Refused(format!(
                "LowerCluster {name} is joined to another lower cluster ({}): join would take its \
                 entry over and orphan what runs there; `tensilectl leave {name}` first, or choose \
                 another name",
                recorded(record::LOWER_SERVER).unwrap_or_else(|| "its server is not recorded".into())
            )));
        }
        None => {
            return Err(Error::Refused(format!(
                "LowerCluster {name} exists and records no lower cluster: `tensilectl leave {name}` \
                 first, or choose another name"
            )));
        }
    }
    match recorded(record::LOWER_NAMESPACE) {
        Some(ns) if ns != joined.namespace => Err(Error::Refused(format!(
            "LowerCluster {name} was joined with --lower-namespace {ns}: join again with it, or \
             `tensilectl leave {name}` first"
        ))),
        _ => Ok(()),
    }
}

fn yaml<K: serde::Serialize + kube::Resource<DynamicType = ()>>(out: &mut String, object: &K) {
    let value = crate::plan::apply_body(object).unwrap_or_default();
    let _ = write!(out, "---\n{}", serde_yaml::to_string(&value).unwrap_or_default());
}

/// `tensilectl join`: returns what to print.
pub async fn join(args: &JoinArgs) -> Result<String, Error> {
    let name = args.name.as_str();
    if !names::is_dns_label(name) {
        return Err(Error::Refused(format!(
            "{name:?} is not a DNS label (at most 63 lowercase letters, digits and '-', starting \
             and ending with a letter or digit): it names the virtual node and objects in both \
             clusters"
        )));
    }
    if let Some(bad) = args
        .namespaces
        .iter()
        .find(|n| !tensile_common::names::is_dns_label(n))
    {
        return Err(Error::Refused(format!(
            "--namespaces: {bad:?} is not a namespace name"
        )));
    }
    if args.token_lifetime < credential::MIN_LIFETIME {
        return Err(Error::Refused(format!(
            "--token-lifetime {:?} is shorter than the 10 minutes the apiserver issues at least",
            args.token_lifetime
        )));
    }
    let bad_kubeconfig = |why: String| Error::LowerKubeconfig {
        path: args.lower.lower_kubeconfig.clone(),
        why,
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(&args.lower.lower_kubeconfig)
        .map_err(|e| bad_kubeconfig(e.to_string()))?;
    let mut endpoint = Endpoint::of(&kubeconfig, args.lower.lower_context.as_deref())
        .map_err(|e| bad_kubeconfig(e.to_string()))?;
    if let Some(server) = &args.server {
        endpoint.server = server.clone();
    }
    let credential_kubeconfig = endpoint.kubeconfig(name);

    let upper = upper_client(&args.clusters).await?;
    let upper_id = upper_id(&upper, &args.clusters).await?;
    let ns = args.lower.lower_namespace.as_str();
    let release = release(&upper, &args.clusters.namespace).await;
    let lower_objects = lower_objects(name, ns, &upper_id, &args.namespaces, release.features);
    if args.dry_run {
        let mut out = String::new();
        let _ = writeln!(out, "# In the lower cluster ({}):", endpoint.server);
        yaml(&mut out, &lower_objects.namespace);
        yaml(&mut out, &lower_objects.account);
        if let (Some(role), Some(binding)) = (&lower_objects.role, &lower_objects.binding) {
            yaml(&mut out, role);
            yaml(&mut out, binding);
        }
        for (role, binding) in &lower_objects.namespace_grants {
            yaml(&mut out, role);
            yaml(&mut out, binding);
        }
        yaml(&mut out, &lower_objects.token_role);
        yaml(&mut out, &lower_objects.token_binding);
        let joined = Joined {
            lower_uid: "<the lower kube-system namespace's UID>".into(),
            server: endpoint.server.clone(),
            namespace: ns.to_owned(),
        };
        let (mut secret, cluster) = upper_objects(args, &upper_id, &credential_kubeconfig, "", &joined);
        secret.data = None;
        secret.string_data = Some(BTreeMap::from([
            (
                names::CREDENTIAL_KUBECONFIG_KEY.to_owned(),
                credential_kubeconfig.clone(),
            ),
            (
                names::CREDENTIAL_TOKEN_KEY.to_owned(),
                format!(
                    "<a token of {ns}/{} requested at join, living {:?}>",
                    account_name(name),
                    args.token_lifetime
                ),
            ),
        ]));
        let _ = writeln!(out, "# In the upper cluster:");
        yaml(&mut out, &secret);
        yaml(&mut out, &cluster);
        return Ok(out);
    }

    // The upper side must be ready for the credential before anything is made below.
    let upper_ns = args.clusters.namespace.as_str();
    if Api::<Namespace>::all(upper.clone())
        .get_opt(upper_ns)
        .await
        .map_err(api_error("upper", "get", format!("namespace {upper_ns}")))?
        .is_none()
    {
        return Err(Error::Refused(format!(
            "upper cluster: namespace {upper_ns} does not exist: install the chart there first (helm install ... -n {upper_ns}), or name its namespace with -n"
        )));
    }
    let clusters: Api<LowerCluster> = Api::all(upper.clone());
    if let Err(e) = clusters
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
    {
        return Err(if code(&e) == Some(404) {
            Error::Refused(
                "upper cluster: it does not serve lowerclusters.tensile.io: install the chart (its crds/) first".into(),
            )
        } else {
            api_error("upper", "list", "lowerclusters")(e)
        });
    }

    let existing = check_upper(&upper, args, &upper_id, &release).await?;

    let lower = lower_client(&args.lower.lower_kubeconfig, args.lower.lower_context.as_deref()).await?;
    let joined = Joined {
        lower_uid: cluster_uid(&lower, "lower").await?,
        server: endpoint.server.clone(),
        namespace: ns.to_owned(),
    };
    if let Some(existing) = &existing {
        check_rejoin(existing, &joined)?;
    }
    let account = account_name(name);
    let taken = foreign_below(
        &lower,
        (ns, &args.namespaces),
        lower_objects.role.is_some(),
        name,
        &upper_id,
    )
    .await?;
    if !taken.is_empty() {
        return Err(Error::Refused(format!(
            "lower cluster: {} exist and were not made by tensilectl for {name} of this upper cluster \
             ({upper_id}): they are left alone; remove them or choose another name",
            taken.join(", ")
        )));
    }
    let namespaces: Api<Namespace> = Api::all(lower.clone());
    // A served namespace is the lower admin's: it must be there, and join makes none.
    for served in &args.namespaces {
        if namespaces
            .get_opt(served)
            .await
            .map_err(api_error("lower", "get", format!("namespace {served}")))?
            .is_none()
        {
            return Err(Error::Refused(format!(
                "lower cluster: namespace {served} (--namespaces) does not exist: a served namespace is made by the lower cluster's admin, not by join"
            )));
        }
    }

    // Everything checked: from here on, what is made is said if a later step fails.
    let mut made = Vec::new();
    if namespaces
        .get_opt(ns)
        .await
        .map_err(api_error("lower", "get", format!("namespace {ns}")))?
        .is_none()
    {
        make(&mut made, name, &namespaces, "lower", &lower_objects.namespace).await?;
    }
    let accounts: Api<ServiceAccount> = Api::namespaced(lower.clone(), ns);
    make(&mut made, name, &accounts, "lower", &lower_objects.account).await?;
    if let (Some(role), Some(binding)) = (&lower_objects.role, &lower_objects.binding) {
        make(&mut made, name, &Api::all(lower.clone()), "lower", role).await?;
        make(&mut made, name, &Api::all(lower.clone()), "lower", binding).await?;
    }
    for (role, binding) in &lower_objects.namespace_grants {
        let served = role.metadata.namespace.as_deref().unwrap_or_default();
        make(
            &mut made,
            name,
            &Api::namespaced(lower.clone(), served),
            "lower",
            role,
        )
        .await?;
        make(
            &mut made,
            name,
            &Api::namespaced(lower.clone(), served),
            "lower",
            binding,
        )
        .await?;
    }
    make(
        &mut made,
        name,
        &Api::namespaced(lower.clone(), ns),
        "lower",
        &lower_objects.token_role,
    )
    .await?;
    make(
        &mut made,
        name,
        &Api::namespaced(lower.clone(), ns),
        "lower",
        &lower_objects.token_binding,
    )
    .await?;
    let token = credential::request_token(&lower, ns, &account, args.token_lifetime)
        .await
        .map_err(api_error(
            "lower",
            "request a token of",
            format!("ServiceAccount {ns}/{account}"),
        ))
        .map_err(|e| partial(name, &made, e))?;

    let (secret, cluster) = upper_objects(args, &upper_id, &credential_kubeconfig, &token, &joined);
    make(
        &mut made,
        name,
        &Api::namespaced(upper.clone(), upper_ns),
        "upper",
        &secret,
    )
    .await?;
    apply(&clusters, "upper", &cluster)
        .await
        .map_err(|e| partial(name, &made, e))?;

    let mut out = String::new();
    let mut grants = match args.namespaces.as_slice() {
        [] => format!("ClusterRole {}", account_name(name)),
        served => format!("a Role in namespace(s) {}", served.join(", ")),
    };
    let features = release.features;
    let wanted: Vec<&str> = [
        (features.reflect_services, "reflectServices"),
        (
            features.gc_namespaces && args.namespaces.is_empty(),
            "gcNamespaces",
        ),
    ]
    .into_iter()
    .filter_map(|(on, what)| on.then_some(what))
    .collect();
    if !wanted.is_empty() {
        grants = format!("{grants} (with the rights of {})", wanted.join(", "));
    }
    let _ = writeln!(
        out,
        "lower cluster ({}): ServiceAccount {ns}/{account} with {grants} and Role {account}-token; \
         a token of it living {:?}",
        endpoint.server,
        args.token_lifetime,
        account = account_name(name),
    );
    let _ = writeln!(
        out,
        "upper cluster: Secret {upper_ns}/{} and LowerCluster {name}",
        secret_name(name)
    );
    if args.wait.is_zero() {
        return Ok(out);
    }
    let joined = wait_ready(&clusters, name, args.wait).await?;
    let _ = writeln!(out, "{}", describe(&joined));
    Ok(out)
}

/// Waits until LowerCluster `name` is Ready, or says why it is not.
async fn wait_ready(api: &Api<LowerCluster>, name: &str, wait: Duration) -> Result<LowerCluster, Error> {
    let started = Instant::now();
    let mut last = None;
    loop {
        if let Some(found) =
            api.get_opt(name)
                .await
                .map_err(api_error("upper", "get", format!("lowercluster {name}")))?
        {
            if found
                .condition(condition::READY)
                .is_some_and(|c| c.status == "True")
            {
                return Ok(found);
            }
            // Refused by the controller: no wait makes it Ready.
            if let Some(refused) = found
                .condition(condition::ACCEPTED)
                .filter(|c| c.status == "False")
            {
                return Err(Error::Refused(format!(
                    "LowerCluster {name} is not accepted: {}: {}",
                    refused.reason, refused.message
                )));
            }
            last = found
                .condition(condition::READY)
                .map(|c| format!("{}: {}", c.reason, c.message));
        }
        if started.elapsed() >= wait {
            return Err(Error::Timeout(format!(
                "LowerCluster {name} is not Ready after {wait:?}: {}; see kubectl get lowercluster {name} -o yaml, \
                 and the cluster controller's log",
                last.unwrap_or_else(
                    || "the cluster controller has not reported on it (is it running?)".into()
                )
            )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One line for a lower cluster.
pub fn describe(cluster: &LowerCluster) -> String {
    let status = cluster.status.clone().unwrap_or_default();
    let ready = cluster.condition(condition::READY);
    format!(
        "{} node={} ready={} version={} nodes={} cpu={} memory={} heartbeat={}{}",
        cluster.name(),
        cluster.node_name(),
        ready.map(|c| c.status.as_str()).unwrap_or("Unknown"),
        status.lower_version.as_deref().unwrap_or("-"),
        status
            .lower_nodes
            .map(|n| n.to_string())
            .unwrap_or_else(|| "-".into()),
        status.allocatable.get("cpu").map(String::as_str).unwrap_or("-"),
        status
            .allocatable
            .get("memory")
            .map(String::as_str)
            .unwrap_or("-"),
        status.last_heartbeat.as_deref().unwrap_or("-"),
        match ready {
            Some(c) if c.status != "True" => format!("\n  {}: {}", c.reason, c.message),
            _ => String::new(),
        }
    )
}

/// `tensilectl status`: the lower clusters of the release of `-n` (or of all, `-A`); a
/// [`Error::NotReady`] holding the same output when one is not Ready.
pub async fn status(args: &StatusArgs) -> Result<String, Error> {
    let upper = upper_client(&args.clusters).await?;
    let mut params = ListParams::default();
    if !args.all_namespaces {
        params = params.labels(&format!(
            "{}={}",
            names::CONTROLLER_NAMESPACE,
            args.clusters.namespace
        ));
    }
    let list = Api::<LowerCluster>::all(upper)
        .list(&params)
        .await
        .map_err(api_error("upper", "list", "lowerclusters"))?;
    let ready = |c: &LowerCluster| c.condition(condition::READY).is_some_and(|r| r.status == "True");
    let out = match args.output.as_str() {
        "json" => {
            let items: Vec<serde_json::Value> = list.items.iter().map(summary).collect();
            serde_json::to_string_pretty(&items).unwrap_or_default() + "\n"
        }
        _ if list.items.is_empty() => "no lower clusters: add one with tensilectl join\n".into(),
        _ => list.items.iter().map(|c| describe(c) + "\n").collect(),
    };
    if list.items.iter().all(ready) {
        Ok(out)
    } else {
        Err(Error::NotReady(out))
    }
}

/// `tensilectl uninstall-check`: the release of `-n` may go when none of its LowerClusters
/// carries the controller's finalizer (one that never got it made nothing). Removals already
/// under way are waited for, up to `--wait`; any other is named with the way to remove it.
pub async fn uninstall_check(args: &UninstallCheckArgs) -> Result<String, Error> {
    let upper = upper_client(&args.clusters).await?;
    let namespace = args.clusters.namespace.as_str();
    let api = Api::<LowerCluster>::all(upper);
    let params = ListParams::default().labels(&format!("{}={namespace}", names::CONTROLLER_NAMESPACE));
    let started = Instant::now();
    loop {
        let items = match api.list(&params).await {
            Ok(list) => list.items,
            // Without the kind served there is no LowerCluster.
            Err(e) if code(&e) == Some(404) => Vec::new(),
            Err(e) => return Err(api_error("upper", "list", "lowerclusters")(e)),
        };
        let held: Vec<&LowerCluster> = items
            .iter()
            .filter(|c| {
                c.metadata
                    .finalizers
                    .as_ref()
                    .is_some_and(|f| f.iter().any(|f| f == names::LOWER_CLUSTER_FINALIZER))
            })
            .collect();
        let (leaving, staying): (Vec<&LowerCluster>, Vec<&LowerCluster>) = held
            .into_iter()
            .partition(|c| c.metadata.deletion_timestamp.is_some());
        if leaving.is_empty() && staying.is_empty() {
            return Ok(format!(
                "no lower cluster of the release in namespace {namespace} holds a virtual node: \
                 it may be uninstalled\n"
            ));
        }
        if staying.is_empty() && started.elapsed() < args.wait {
            tokio::time::sleep(Duration::from_secs(2)).await;
            continue;
        }
        let mut out = format!(
            "the release in namespace {namespace} still runs lower clusters; uninstalling it \
             now would strand their virtual nodes and what those made below, since their \
             removal needs the release's cluster controller:"
        );
        for cluster in &staying {
            let name = cluster.name();
            let label = |key: &str| cluster.metadata.labels.as_ref().and_then(|l| l.get(key));
            let how = match label(names::MANAGED_BY).map(String::as_str) {
                Some(names::TENSILECTL) => format!("tensilectl leave {name} -n {namespace}"),
                Some("Helm") => format!(
                    "kubectl delete lowercluster {name} --wait (the chart's virtualNodes.nodes \
                     makes it: drop it there before any later helm upgrade)"
                ),
                _ => format!("kubectl delete lowercluster {name} --wait"),
            };
            let _ = write!(out, "\n  {name}: {how}");
        }
        for cluster in &leaving {
            let _ = write!(
                out,
                "\n  {}: still being removed after {}s",
                cluster.name(),
                started.elapsed().as_secs()
            );
        }
        out.push_str(
            "\nthen uninstall again (helm keeps the release as it is, listed as uninstalling; \
             `helm rollback` to its last revision makes it deployed again); `helm uninstall --no-hooks` goes \
             regardless and leaves them to be let go by hand (docs/deploy.md, Uninstall)",
        );
        return Err(Error::Refused(out));
    }
}

/// A lower cluster as `status -o json` prints it.
fn summary(cluster: &LowerCluster) -> serde_json::Value {
    let status = cluster.status.clone().unwrap_or_default();
    let ready = cluster.condition(condition::READY);
    serde_json::json!({
        "name": cluster.name(),
        "node": cluster.node_name(),
        "ready": ready.map(|c| c.status.as_str()).unwrap_or("Unknown"),
        "reason": ready.map(|c| c.reason.as_str()),
        "message": ready.map(|c| c.message.as_str()),
        "version": status.lower_version,
        "nodes": status.lower_nodes,
        "allocatable": status.allocatable,
        "heartbeat": status.last_heartbeat,
        "conditions": status.conditions,
    })
}

async fn delete_ours<K>(
    api: &Api<K>,
    cluster_side: &'static str,
    name: &str,
    (cluster, upper_id): (&str, &str),
) -> Result<bool, Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let what = format!("{} {name}", K::kind(&()));
    let Some(found) = api
        .get_opt(name)
        .await
        .map_err(api_error(cluster_side, "get", what.clone()))?
    else {
        return Ok(false);
    };
    if !ours(found.meta(), cluster, upper_id) {
        return Ok(false);
    }
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(e) if code(&e) == Some(404) => Ok(false),
        Err(e) => Err(api_error(cluster_side, "delete", what)(e)),
    }
}

/// `tensilectl leave`: returns what to print.
pub async fn leave(args: &LeaveArgs) -> Result<String, Error> {
    let name = args.name.as_str();
    let mut out = String::new();
    let upper = upper_client(&args.clusters).await?;
    let upper_id = upper_id(&upper, &args.clusters).await?;
    let mine = (name, upper_id.as_str());
    let clusters: Api<LowerCluster> = Api::all(upper.clone());
    // A cluster that serves no LowerClusters has none of that name.
    let found = match clusters.get(name).await {
        Ok(found) => Some(found),
        Err(e) if code(&e) == Some(404) => None,
        Err(e) => return Err(api_error("upper", "get", format!("lowercluster {name}"))(e)),
    };
    let recorded = |key: &str| {
        found
            .as_ref()
            .and_then(|f| f.metadata.annotations.as_ref()?.get(key).cloned())
    };
    let server = recorded(record::LOWER_SERVER).unwrap_or_else(|| "not recorded".into());
    let ns = match (&args.lower_namespace, recorded(record::LOWER_NAMESPACE)) {
        (Some(given), Some(joined)) if *given != joined => {
            return Err(Error::Refused(format!(
                "LowerCluster {name} was joined with --lower-namespace {joined}, not {given}: nothing was removed"
            )));
        }
        (Some(given), _) => given.clone(),
        (None, Some(joined)) => joined,
        (None, None) => "tensile".to_owned(),
    };
    // The lower cluster is checked to be the one joined before anything is removed.
    let lower = match &args.lower_kubeconfig {
        Some(path) => {
            let lower = lower_client(path, args.lower_context.as_deref()).await?;
            let uid = cluster_uid(&lower, "lower").await?;
            if let Some(joined) = recorded(record::LOWER_UID).filter(|joined| *joined != uid) {
                return Err(Error::Refused(format!(
                    "LowerCluster {name} was joined to lower cluster {server} (kube-system {joined}); the lower \
                     kubeconfig reaches another (kube-system {uid}): nothing was removed"
                )));
            }
            Some(lower)
        }
        None => None,
    };
    let upper_ns = args.clusters.namespace.as_str();
    // Without its credential Secret the controller cannot clean below; leave does that with
    // the admin's kubeconfig.
    let credential = match &found {
        Some(f) => Api::<Secret>::namespaced(upper.clone(), upper_ns)
            .get_opt(&f.spec.credential.secret_name)
            .await
            .map_err(api_error(
                "upper",
                "get",
                format!("Secret {upper_ns}/{}", f.spec.credential.secret_name),
            ))?
            .filter(|s| s.metadata.deletion_timestamp.is_none()),
        None => None,
    };
    let mut node = name.to_owned();
    if let Some(found) = &found {
        node = found.node_name().to_owned();
        if lower.is_none() || credential.is_none() {
            // Gone for good, or no credential to reach it with: the controller removes the node
            // and leaves the lower side be (to leave, when it reaches it).
            let orphan =
                serde_json::json!({"metadata": {"annotations": {crate::reconcile::ORPHAN_LOWER: "true"}}});
            clusters
                .patch(name, &PatchParams::default(), &Patch::Merge(&orphan))
                .await
                .map_err(api_error("upper", "annotate", format!("lowercluster {name}")))?;
        }
        match clusters.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if code(&e) == Some(404) => {}
            Err(e) => return Err(api_error("upper", "delete", format!("lowercluster {name}"))(e)),
        }
        let started = Instant::now();
        loop {
            let Some(found) = clusters.get_opt(name).await.map_err(api_error(
                "upper",
                "get",
                format!("lowercluster {name}"),
            ))?
            else {
                break;
            };
            if started.elapsed() >= args.wait {
                let why = found
                    .condition(condition::READY)
                    .map(|c| c.message.clone())
                    .unwrap_or_else(|| {
                        "the cluster controller has not reported on it (is it running?)".into()
                    });
                return Err(Error::Timeout(format!(
                    "LowerCluster {name} is still being removed after {:?}: {why}",
                    args.wait
                )));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let _ = writeln!(
            out,
            "upper cluster: LowerCluster {name} removed, with its virtual node {node}"
        );
    }
    let secret_deleted = delete_ours(
        &Api::<Secret>::namespaced(upper.clone(), upper_ns),
        "upper",
        &secret_name(name),
        mine,
    )
    .await?;
    if secret_deleted {
        let _ = writeln!(
            out,
            "upper cluster: Secret {upper_ns}/{} deleted",
            secret_name(name)
        );
    }
    let account = account_name(name);
    let Some(lower) = lower else {
        let _ = writeln!(
            out,
            "lower cluster {server}: not reached (--lower-unreachable); left there: ServiceAccount \
             {ns}/{account} with its ClusterRole or Roles and Role {ns}/{account}-token (labelled \
             {}={name}), and what the virtual node made (labelled {}={upper_id}, {}={node}); \
             the credential's token expires by itself",
            names::LOWER_CLUSTER,
            names::MARK_CLUSTER,
            names::MARK_NODE,
        );
        return Ok(out);
    };
    let found = found.is_some();

    // Below: what the virtual node made and its credential could not remove (a namespace
    // it made, say), then what join made.
    let identity = Identity {
        cluster_id: upper_id.clone(),
        node,
    };
    let started = Instant::now();
    loop {
        let removal = teardown::remove_everything(&lower, &identity, &tensile_common::cache::Namespaces::All)
            .await
            .map_err(api_error("lower", "remove", "the virtual node's objects"))?;
        if removal.done() {
            break;
        }
        if started.elapsed() >= args.wait {
            return Err(Error::Timeout(format!(
                "lower cluster: the virtual node's objects are still there after {:?}: {}",
                args.wait,
                removal.summary()
            )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let ns = ns.as_str();
    let token = format!("{account}-token");
    let mut gone = Vec::new();
    if delete_ours(
        &Api::<RoleBinding>::namespaced(lower.clone(), ns),
        "lower",
        &token,
        mine,
    )
    .await?
    {
        gone.push(format!("RoleBinding {ns}/{token}"));
    }
    if delete_ours(&Api::<Role>::namespaced(lower.clone(), ns), "lower", &token, mine).await? {
        gone.push(format!("Role {ns}/{token}"));
    }
    if delete_ours(
        &Api::<ClusterRoleBinding>::all(lower.clone()),
        "lower",
        &account,
        mine,
    )
    .await?
    {
        gone.push(format!("ClusterRoleBinding {account}"));
    }
    if delete_ours(&Api::<ClusterRole>::all(lower.clone()), "lower", &account, mine).await? {
        gone.push(format!("ClusterRole {account}"));
    }
    // Namespace scope: the Role and binding join made in each served namespace.
    let made_by_join = kube::api::ListParams::default().labels(&format!(
        "{}={},{}={name}",
        names::MANAGED_BY,
        names::TENSILECTL,
        names::LOWER_CLUSTER
    ));
    let grants = Api::<RoleBinding>::all(lower.clone())
        .list_metadata(&made_by_join)
        .await
        .map_err(api_error("lower", "list", "rolebindings"))?;
    for binding in grants.items {
        let (Some(served), Some(object)) = (binding.metadata.namespace, binding.metadata.name) else {
            continue;
        };
        if object != account {
            continue;
        }
        if delete_ours(
            &Api::<RoleBinding>::namespaced(lower.clone(), &served),
            "lower",
            &account,
            mine,
        )
        .await?
        {
            gone.push(format!("RoleBinding {served}/{account}"));
        }
        if delete_ours(
            &Api::<Role>::namespaced(lower.clone(), &served),
            "lower",
            &account,
            mine,
        )
        .await?
        {
            gone.push(format!("Role {served}/{account}"));
        }
    }
    if delete_ours(
        &Api::<ServiceAccount>::namespaced(lower.clone(), ns),
        "lower",
        &account,
        mine,
    )
    .await?
    {
        gone.push(format!("ServiceAccount {ns}/{account}"));
    }
    // The namespace join made goes only when it holds nothing of anyone's (a second
    // LowerCluster's account, a lower admin's objects keep it).
    let namespaces: Api<Namespace> = Api::all(lower.clone());
    let mut namespace_kept = false;
    let made_by_join = namespaces
        .get_opt(ns)
        .await
        .map_err(api_error("lower", "get", format!("namespace {ns}")))?
        .is_some_and(|found| ours(&found.metadata, name, &upper_id));
    if made_by_join {
        let kinds = tensile_common::lower::objects::namespaced_kinds(&lower)
            .await
            .map_err(api_error("lower", "discover", "the kinds it serves"))?;
        let empty = tensile_common::lower::objects::namespace_is_empty(&lower, ns, &kinds)
            .await
            .map_err(api_error("lower", "list", format!("what namespace {ns} holds")))?;
        if !empty {
            namespace_kept = true;
            let _ = writeln!(out, "lower cluster: namespace {ns} holds objects of others: kept");
        } else if delete_ours(&namespaces, "lower", ns, mine).await? {
            gone.push(format!("namespace {ns}"));
            let started = Instant::now();
            while namespaces
                .get_opt(ns)
                .await
                .map_err(api_error("lower", "get", format!("namespace {ns}")))?
                .is_some()
            {
                if started.elapsed() >= args.wait {
                    return Err(Error::Timeout(format!(
                        "lower cluster: namespace {ns} is still terminating after {:?}",
                        args.wait
                    )));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    if !gone.is_empty() {
        let _ = writeln!(out, "lower cluster: deleted {}", gone.join(", "));
    }
    // What answers to join's names and was not made by it for this fleet stays, and is said.
    let kept = foreign_below(&lower, (ns, &[]), true, name, &upper_id).await?;
    if !kept.is_empty() {
        let _ = writeln!(
            out,
            "lower cluster: kept {}: not made by tensilectl for {name} of this upper cluster ({upper_id})",
            kept.join(", ")
        );
    }
    if !found && !secret_deleted && gone.is_empty() {
        let _ = writeln!(
            out,
            "nothing of {name} was found: no LowerCluster {name} upstream, and nothing join made for it \
             in namespace {ns} below"
        );
    } else if kept.is_empty() && !namespace_kept {
        let _ = writeln!(out, "{name} has left: nothing of it is left in either cluster");
    } else {
        let _ = writeln!(out, "{name} has left; what is kept is said above");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn join_grants_below_exactly_the_rights_the_chart_renders_and_its_own_token() {
        let objects = lower_objects("lower-a", "tensile", "upper-uid", &[], Default::default());
        assert!(objects.namespace_grants.is_empty());
        let role = objects.role.clone().unwrap();
        let rules = role.rules.as_ref().unwrap();
        assert!(!rules.is_empty(), "the chart's ClusterRole is read");
        assert!(
            rules.iter().any(|r| r
                .resources
                .as_ref()
                .is_some_and(|res| res.iter().any(|x| x == "pods/exec"))),
            "exec is relayed below"
        );
        let token = objects.token_role.rules.as_ref().unwrap();
        assert_eq!(token.len(), 1);
        assert_eq!(
            token[0].resources.as_deref(),
            Some(&["serviceaccounts/token".to_owned()][..])
        );
        assert_eq!(token[0].verbs, ["create"]);
        assert_eq!(
            token[0].resource_names.as_deref(),
            Some(&["tensile-lower-a".to_owned()][..]),
            "its own token, no other account's"
        );
        for meta in [
            &objects.namespace.metadata,
            &objects.account.metadata,
            &role.metadata,
        ] {
            assert!(ours(meta, "lower-a", "upper-uid"), "leave finds what join made");
            assert!(!ours(meta, "lower-b", "upper-uid"), "and only that cluster's");
            assert!(
                !ours(meta, "lower-a", "another-upper"),
                "and only what this fleet's join made"
            );
        }
    }

    #[test]
    fn join_grants_what_the_releases_features_need_as_the_chart_renders_them() {
        let both = crate::plan::Features {
            reflect_services: true,
            gc_namespaces: true,
        };
        let objects = lower_objects("lower-a", "tensile", "upper-uid", &[], both);
        assert_eq!(
            objects.role.unwrap().rules.unwrap(),
            chart_rules(LOWER_FEATURES_RBAC, "ClusterRole", CHART_ACCOUNT),
            "the chart's rendering with both on"
        );
        let services = crate::plan::Features {
            reflect_services: true,
            gc_namespaces: false,
        };
        let scoped = lower_objects("lower-a", "tensile", "upper-uid", &["team-a".to_owned()], both);
        let rules = scoped.namespace_grants[0].0.rules.clone().unwrap();
        let copies = rules
            .iter()
            .find(|r| {
                r.resources
                    .as_ref()
                    .is_some_and(|x| x.iter().any(|x| x == "configmaps"))
            })
            .unwrap();
        assert!(
            copies
                .resources
                .as_ref()
                .unwrap()
                .contains(&"services".to_owned())
        );
        assert!(
            !rules.iter().any(|r| r.verbs == ["list"]
                && r.api_groups
                    .as_ref()
                    .is_some_and(|g| g.contains(&"apps".to_owned()))),
            "no namespace collection under a namespace scope"
        );
        let only = lower_objects("lower-a", "tensile", "upper-uid", &[], services)
            .role
            .unwrap()
            .rules
            .unwrap();
        let namespaces = only
            .iter()
            .find(|r| {
                r.resources
                    .as_ref()
                    .is_some_and(|x| x == &["namespaces".to_owned()])
            })
            .unwrap();
        assert_eq!(
            namespaces.verbs,
            ["get", "create"],
            "no delete without gcNamespaces"
        );
    }

    #[test]
    fn join_with_namespaces_grants_the_charts_namespace_role_in_each_and_nothing_cluster_wide() {
        let served = ["team-a".to_owned(), "team-b".to_owned()];
        let objects = lower_objects("lower-a", "tensile", "upper-uid", &served, Default::default());
        assert!(
            objects.role.is_none() && objects.binding.is_none(),
            "nothing cluster-wide"
        );
        assert_eq!(objects.namespace_grants.len(), 2);
        for ((role, binding), ns) in objects.namespace_grants.iter().zip(&served) {
            assert_eq!(role.metadata.namespace.as_deref(), Some(ns.as_str()));
            assert_eq!(binding.metadata.namespace.as_deref(), Some(ns.as_str()));
            assert_eq!(binding.role_ref.kind, "Role");
            assert!(
                ours(&role.metadata, "lower-a", "upper-uid")
                    && ours(&binding.metadata, "lower-a", "upper-uid")
            );
            let rules = role.rules.as_ref().unwrap();
            let granted = |resource: &str| {
                rules.iter().any(|r| {
                    r.resources
                        .as_ref()
                        .is_some_and(|res| res.iter().any(|x| x == resource))
                })
            };
            assert!(granted("pods") && granted("pods/exec") && granted("resourcequotas"));
            assert!(!granted("nodes") && !granted("namespaces"), "{rules:?}");
            let subject = &binding.subjects.as_ref().unwrap()[0];
            assert_eq!(
                (subject.name.as_str(), subject.namespace.as_deref()),
                ("tensile-lower-a", Some("tensile"))
            );
        }
    }

    #[test]
    fn the_lower_cluster_is_for_the_controller_of_the_namespace_its_credential_is_in() {
        let cli = Cli::try_parse_from([
            "tensilectl",
            "join",
            "lower-a",
            "--lower-kubeconfig=k",
            "-n",
            "fleet",
        ])
        .unwrap();
        let Command::Join(join) = cli.command else {
            panic!("join")
        };
        let joined = Joined {
            lower_uid: "lower-uid".into(),
            server: "https://lower:6443".into(),
            namespace: "tensile".into(),
        };
        let (secret, cluster) = upper_objects(&join, "upper-uid", "kubeconfig text", "token", &joined);
        assert!(ours(&cluster.metadata, "lower-a", "upper-uid"));
        check_rejoin(&cluster, &joined).unwrap();
        let other = Joined {
            lower_uid: "other-uid".into(),
            ..joined.clone()
        };
        let refused = check_rejoin(&cluster, &other).unwrap_err().to_string();
        assert!(
            refused.contains("joined to another lower cluster (https://lower:6443)"),
            "{refused}"
        );
        let elsewhere = Joined {
            namespace: "other".into(),
            ..joined.clone()
        };
        let refused = check_rejoin(&cluster, &elsewhere).unwrap_err().to_string();
        assert!(refused.contains("--lower-namespace tensile"), "{refused}");
        let mut unrecorded = cluster.clone();
        unrecorded.metadata.annotations = None;
        assert!(
            check_rejoin(&unrecorded, &joined).is_err(),
            "no record, no take-over"
        );
        assert_eq!(secret.metadata.namespace.as_deref(), Some("fleet"));
        let labels = cluster.metadata.labels.unwrap_or_default();
        assert_eq!(
            labels.get(names::CONTROLLER_NAMESPACE).map(String::as_str),
            Some("fleet")
        );
        assert_eq!(cluster.spec.credential.secret_name, "lower-a-credential");
        let data = secret.data.unwrap_or_default();
        assert_eq!(data[names::CREDENTIAL_TOKEN_KEY].0, b"token");
        assert_eq!(data[names::CREDENTIAL_KUBECONFIG_KEY].0, b"kubeconfig text");
    }

    #[test]
    fn the_flags_parse_as_documented() {
        let cli = Cli::try_parse_from([
            "tensilectl",
            "join",
            "lower-a",
            "--lower-kubeconfig=a.kubeconfig",
            "--node-labels=region=eu,zone=a",
            "--token-lifetime=2h",
            "--dry-run",
        ])
        .unwrap();
        let Command::Join(join) = cli.command else {
            panic!("join")
        };
        assert_eq!(join.token_lifetime, Duration::from_secs(7200));
        assert_eq!(join.node_labels.len(), 2);
        assert_eq!(join.clusters.namespace, "tensile");
        assert_eq!(join.lower.lower_namespace, "tensile");
        assert!(
            Cli::try_parse_from(["tensilectl", "join", "a"]).is_err(),
            "the lower kubeconfig is required"
        );
        assert!(
            Cli::try_parse_from(["tensilectl", "leave", "a"]).is_err(),
            "leave needs the lower kubeconfig"
        );
        let Command::Leave(gone) = Cli::try_parse_from(["tensilectl", "leave", "a", "--lower-unreachable"])
            .unwrap()
            .command
        else {
            panic!("leave")
        };
        assert!(gone.lower_unreachable && gone.lower_kubeconfig.is_none());
        assert!(
            Cli::try_parse_from([
                "tensilectl",
                "leave",
                "a",
                "--lower-unreachable",
                "--lower-kubeconfig=k"
            ])
            .is_err(),
            "a lower cluster is reached or gone, not both"
        );
        assert!(
            Cli::try_parse_from([
                "tensilectl",
                "join",
                "a",
                "--lower-kubeconfig=k",
                "--node-labels=novalue"
            ])
            .is_err()
        );
    }
}
