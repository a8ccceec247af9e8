//! Pure planning: the upper objects that run one `LowerCluster`'s virtual node, and the
//! status the controller reports from what it observed. Nothing here calls an API.
//!
//! Each virtual node gets a ServiceAccount of its own, so the rights that name one node (its
//! Node, its heartbeat Lease, its leader-election Lease) are granted to that node's
//! account alone; what every virtual node does alike (watch its pods, write their status,
//! read what they reference) comes from one shared ClusterRole that the chart renders.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, SecretVolumeSource, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use tensile_common::names;

use crate::resource::{LowerCluster, LowerClusterStatus, condition};

/// Where the credential Secret is mounted in the virtual node's pod.
pub const CREDENTIAL_DIR: &str = "/etc/tensile/lower";
/// Where the overrides ConfigMap is mounted in the virtual node's pod, and its key.
pub const OVERRIDES_DIR: &str = "/etc/tensile/overrides";
pub const OVERRIDES_KEY: &str = "overrides.json";
/// The container of the template that is the virtual node.
pub const CONTAINER: &str = "virtual-node";
/// The heartbeat Leases' namespace.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// What the controller was started with.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The controller's namespace: where credentials, virtual nodes and their accounts live.
    pub namespace: String,
    /// Prefix of every object name the controller makes (the chart's release name).
    pub prefix: String,
    /// The ClusterRole every virtual node is bound to.
    pub shared_role: String,
    /// The Deployment every virtual node's is made from.
    pub template: Deployment,
    /// The upper cluster's id in the lower objects' marks.
    pub cluster_id: String,
    /// A virtual node of several replicas gets a `policy/v1` PodDisruptionBudget.
    pub disruption_budgets: bool,
    /// Virtual nodes act upstream as `system:node:<name>` (`--upper-identity=node`): their
    /// grants name that user, and their account may only ask for its certificate.
    pub node_identity: bool,
}

/// What a virtual node does below beyond the base (the chart's `virtualNodes.reflectServices`
/// and `gcNamespaces`, as flags of its container or of the cluster's `extraArgs`): rights
/// its lower credential must hold too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Features {
    pub reflect_services: bool,
    pub gc_namespaces: bool,
}

impl Features {
    /// The features the flags `args` turn on.
    pub fn of_args<'a>(args: impl IntoIterator<Item = &'a String>) -> Features {
        let mut features = Features::default();
        for arg in args {
            if let Some(list) = arg.strip_prefix("--enable-controllers=") {
                features.reflect_services |= list.split(',').any(|c| c.trim() == "ServiceControllers");
            }
            if arg == "--gc-namespaces" || arg == "--gc-namespaces=true" {
                features.gc_namespaces = true;
            }
        }
        features
    }

    /// The features of the virtual node container of the Deployment `template`.
    pub fn of_template(template: &Deployment) -> Features {
        Features::of_args(
            template
                .spec
                .template
                .spec
                .iter()
                .flat_map(|pod| &pod.containers)
                .filter(|c| c.name == CONTAINER)
                .flat_map(|c| c.args.iter().flatten()),
        )
    }

    /// The features of `cluster`'s virtual node: its template's and its `extraArgs`'.
    pub fn of(settings: &Settings, cluster: &LowerCluster) -> Features {
        let (template, extra) = (
            Features::of_template(&settings.template),
            Features::of_args(&cluster.spec.extra_args),
        );
        Features {
            reflect_services: template.reflect_services || extra.reflect_services,
            gc_namespaces: template.gc_namespaces || extra.gc_namespaces,
        }
    }
}

/// A right the lower credential must hold: `verb` on `resource` (`group`, `subresource`),
/// and what needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Right {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: &'static str,
    pub why: &'static str,
}

impl std::fmt::Display for Right {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            String::new()
        } else {
            format!(".{}", self.group)
        };
        let sub = if self.subresource.is_empty() {
            String::new()
        } else {
            format!("/{}", self.subresource)
        };
        write!(f, "{} {}{group}{sub} ({})", self.verb, self.resource, self.why)
    }
}

/// The rights checked of a lower credential: one of each thing the virtual node does below
/// (not every verb of its role; a credential short of one shows here), and those `features`
/// add; `cluster_wide`: the credential is not namespace-scoped.
pub fn required_rights(features: Features, cluster_wide: bool) -> Vec<Right> {
    let right = |verb, group, resource, subresource, why| Right {
        verb,
        group,
        resource,
        subresource,
        why,
    };
    let mut rights = vec![
        right("create", "", "pods", "", "pods"),
        right("delete", "", "pods", "", "pods"),
        right("watch", "", "pods", "", "pods"),
        right("patch", "", "pods", "resize", "in-place resize"),
        right("create", "", "pods", "exec", "exec"),
        right("get", "", "pods", "log", "logs"),
        right("create", "", "configmaps", "", "copies"),
        right("create", "", "secrets", "", "copies"),
        right("create", "", "persistentvolumeclaims", "", "volumes"),
    ];
    if cluster_wide {
        rights.push(right(
            "create",
            "",
            "namespaces",
            "",
            "namespaces of the upper pods",
        ));
        rights.push(right("list", "", "nodes", "", "capacity"));
    } else {
        rights.push(right("list", "", "resourcequotas", "", "capacity"));
    }
    if features.reflect_services {
        rights.push(right("create", "", "services", "", "reflectServices"));
        rights.push(right("create", "", "endpoints", "", "reflectServices"));
    }
    if features.gc_namespaces && cluster_wide {
        rights.push(right("delete", "", "namespaces", "", "gcNamespaces"));
        rights.push(right("list", "apps", "deployments", "", "gcNamespaces"));
    }
    rights
}

/// Why a `LowerCluster` cannot be acted on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// The upper objects that run one lower cluster's virtual node.
#[derive(Clone, Debug, PartialEq)]
pub struct Objects {
    pub account: ServiceAccount,
    pub node_role: ClusterRole,
    pub node_binding: ClusterRoleBinding,
    pub shared_binding: ClusterRoleBinding,
    pub lease_role: Role,
    pub lease_binding: RoleBinding,
    pub leader_role: Role,
    pub leader_binding: RoleBinding,
    pub deployment: Deployment,
    /// The overrides the virtual node follows (its `--overrides-file`), as checked.
    pub overrides: Overrides,
    /// A budget keeping one replica up, for a virtual node of several (a PodDisruptionBudget
    /// of the configured API version).
    pub budget: Option<serde_json::Value>,
}

/// What a virtual node's overrides ConfigMap becomes.
#[derive(Clone, Debug, PartialEq)]
pub enum Overrides {
    /// `spec.overrides` passed its checks: the ConfigMap holds them.
    Accepted(Box<ConfigMap>),
    /// They did not (the reason): the ConfigMap keeps what it holds. When there is none (no
    /// overrides were ever accepted), the virtual node is not started until they pass: its
    /// pods would go below without the rules their cluster needs.
    Refused(String),
}

/// Why overrides are refused, when some accepted before stay in force.
pub fn kept_in_force(why: &str) -> String {
    format!("{why}; the overrides accepted before stay in force")
}

/// Why overrides are refused, when none were ever accepted.
pub fn none_in_force(why: &str) -> String {
    format!("{why}; none were accepted before, so the virtual node is not started until they pass")
}

/// `spec.overrides` checked: the text the virtual node reads (JSON), and what it holds.
pub fn checked_overrides(cluster: &LowerCluster) -> Result<(String, String), String> {
    let value = cluster.spec.overrides.clone().unwrap_or_default();
    let compiled = tensile_common::lower::overrides::Overrides::from_value(value)
        .and_then(tensile_common::lower::overrides::Overrides::compile)
        .map_err(|e| format!("spec.overrides: {e}"))?;
    let source = compiled.source();
    let text = serde_json::to_string_pretty(source).map_err(|e| format!("spec.overrides: {e}"))?;
    let said = format!(
        "{} rule(s) and {} StorageClass name(s) in force{}",
        source.rules.len(),
        source.storage_classes.len(),
        if source.allow_privileged {
            ", isolation may be weakened (allowPrivileged)"
        } else {
            ""
        }
    );
    Ok((text, said))
}

fn overrides(settings: &Settings, cluster: &LowerCluster, name: &str) -> Overrides {
    match checked_overrides(cluster) {
        Ok((text, _)) => Overrides::Accepted(Box::new(ConfigMap {
            metadata: meta(name, Some(settings.namespace.as_str()), cluster),
            data: Some(BTreeMap::from([(OVERRIDES_KEY.to_owned(), text)])),
            ..Default::default()
        })),
        Err(why) => Overrides::Refused(why),
    }
}

/// The name of every object made for `cluster` (Deployment, account, roles, bindings).
pub fn object_name(settings: &Settings, cluster: &str) -> String {
    format!("{}-vn-{cluster}", settings.prefix)
}

/// The leader-election Lease of the virtual node `node`.
pub fn leader_lease(node: &str) -> String {
    format!("tensile-virtual-node-{node}")
}

/// Whether the objects of a cluster named `cluster` fit their names under the name prefix
/// `prefix` (the chart's `--name-prefix`); why not.
pub fn name_fits(prefix: &str, cluster: &str) -> Result<(), String> {
    let name = format!("{prefix}-vn-{cluster}");
    // A Deployment's pods are named `<name>-<10>-<5>`; labels and pod names stop at 63.
    if name.len() > 47 {
        return Err(format!(
            "the virtual node's Deployment would be named {name:?} ({} characters): with its pods' \
             suffixes it must stay within 47; choose a shorter LowerCluster name",
            name.len()
        ));
    }
    if cluster.len() > 63 {
        return Err(format!(
            "the name {cluster:?} is longer than 63 characters, the most a label value holds"
        ));
    }
    Ok(())
}

/// Checks what the schema cannot: names that must fit in a label value and a Deployment's
/// pod names.
pub fn validate(settings: &Settings, cluster: &LowerCluster) -> Result<(), Invalid> {
    name_fits(&settings.prefix, cluster.name()).map_err(Invalid)?;
    if cluster.spec.credential.secret_name.is_empty() {
        return Err(Invalid("spec.credential.secretName is empty".into()));
    }
    let template_args = settings
        .template
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.as_ref());
    let collects = template_args
        .into_iter()
        .flatten()
        .chain(&cluster.spec.extra_args)
        .any(|a| a == "--gc-namespaces");
    if !cluster.spec.namespaces.is_empty() && collects {
        return Err(Invalid(
            "spec.namespaces and --gc-namespaces exclude each other: the served namespaces are the lower \
             admin's, never made or deleted by a virtual node"
                .into(),
        ));
    }
    // A node asks for its pods' tokens as itself: the Node authorizer and NodeRestriction
    // let it mint tokens only for the accounts of pods bound to it, bound to those pods.
    if cluster.spec.upper_tokens.is_some() && !settings.node_identity {
        return Err(Invalid(
            "spec.upperTokens needs the node identity (the controller's --node-identity, the chart's \
             virtualNodes.upperIdentity: node): under a credential, minting the pods' tokens would \
             take serviceaccounts/token create on every ServiceAccount of the cluster"
                .into(),
        ));
    }
    Ok(())
}

fn labels(cluster: &LowerCluster) -> BTreeMap<String, String> {
    BTreeMap::from([
        (names::LOWER_CLUSTER.to_owned(), cluster.name().to_owned()),
        (names::MANAGED_BY.to_owned(), names::CONTROLLER_MANAGER.to_owned()),
    ])
}

fn meta(name: &str, namespace: Option<&str>, cluster: &LowerCluster) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(labels(cluster)),
        ..Default::default()
    }
}

fn rule(group: &str, resources: &[&str], names: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(strings(resources)),
        resource_names: (!names.is_empty()).then(|| strings(names)),
        verbs: strings(verbs),
        non_resource_urls: None,
    }
}

/// The annotation of a virtual node's pod template holding the digest of its credential
/// Secret: a changed server, CA or inline token rolls the node, which reads its kubeconfig
/// once; a renewed token (key `token`, which the node reads again from its file) does not.
pub const CREDENTIAL_DIGEST: &str = "tensile.io/credential-digest";

/// The digest of `secret`'s data but its renewed token.
pub fn credential_digest(secret: &k8s_openapi::api::core::v1::Secret) -> String {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    for (key, value) in secret.data.iter().flatten() {
        if key != names::CREDENTIAL_TOKEN_KEY {
            context.update(key.as_bytes());
            context.update(&[0]);
            context.update(&value.0);
            context.update(&[0]);
        }
    }
    context
        .finish()
        .as_ref()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Sets the credential digest `digest` on the virtual node's pod template.
pub fn with_credential(objects: &mut Objects, digest: &str) {
    objects
        .deployment
        .spec
        .template
        .metadata
        .get_or_insert_with(Default::default)
        .annotations
        .get_or_insert_with(Default::default)
        .insert(CREDENTIAL_DIGEST.to_owned(), digest.to_owned());
}

/// Everything that runs `cluster`'s virtual node.
pub fn objects(settings: &Settings, cluster: &LowerCluster) -> Objects {
    let name = object_name(settings, cluster.name());
    let ns = settings.namespace.as_str();
    let node = cluster.node_name();
    let account = Subject {
        kind: "ServiceAccount".into(),
        name: name.clone(),
        namespace: Some(ns.to_owned()),
        api_group: None,
    };
    // Who acts: the node's user under a node identity, else its account.
    let subject = if settings.node_identity {
        Subject {
            kind: "User".into(),
            name: tensile_common::node_identity::user(node),
            namespace: None,
            api_group: Some("rbac.authorization.k8s.io".into()),
        }
    } else {
        account.clone()
    };
    // Its Node, and only its Node, changed by name; under a node identity the Node
    // authorizer and NodeRestriction already confine the node's user to its Node, and the
    // account only asks for the node's certificate.
    let (node_rules, node_subjects) = if settings.node_identity {
        (
            vec![
                rule(
                    "certificates.k8s.io",
                    &["certificatesigningrequests"],
                    &[],
                    &["create"],
                ),
                rule(
                    "certificates.k8s.io",
                    &["certificatesigningrequests"],
                    &[&tensile_common::node_identity::request_name(node)],
                    &["get", "delete"],
                ),
            ],
            vec![account.clone()],
        )
    } else {
        (
            vec![
                rule("", &["nodes"], &[node], &["patch"]),
                rule("", &["nodes/status"], &[node], &["patch"]),
            ],
            vec![subject.clone()],
        )
    };
    let cluster_role_ref = |role: &str| RoleRef {
        api_group: Some("rbac.authorization.k8s.io".into()),
        kind: "ClusterRole".into(),
        name: role.to_owned(),
    };
    let role_ref = RoleRef {
        api_group: Some("rbac.authorization.k8s.io".into()),
        kind: "Role".into(),
        name: name.clone(),
    };
    let lease = leader_lease(node);
    Objects {
        account: ServiceAccount {
            metadata: meta(&name, Some(ns), cluster),
            ..Default::default()
        },
        node_role: ClusterRole {
            metadata: meta(&name, None, cluster),
            rules: Some(node_rules),
            aggregation_rule: None,
        },
        node_binding: ClusterRoleBinding {
            metadata: meta(&name, None, cluster),
            role_ref: cluster_role_ref(&name),
            subjects: Some(node_subjects),
        },
        shared_binding: ClusterRoleBinding {
            metadata: meta(&format!("{name}-shared"), None, cluster),
            role_ref: cluster_role_ref(&settings.shared_role),
            subjects: Some(vec![subject.clone()]),
        },
        // Its heartbeat Lease.
        lease_role: Role {
            metadata: meta(&name, Some(NODE_LEASE_NAMESPACE), cluster),
            rules: Some(vec![
                rule("coordination.k8s.io", &["leases"], &[], &["create"]),
                rule("coordination.k8s.io", &["leases"], &[node], &["get", "patch"]),
            ]),
        },
        lease_binding: RoleBinding {
            metadata: meta(&name, Some(NODE_LEASE_NAMESPACE), cluster),
            role_ref: role_ref.clone(),
            subjects: Some(vec![subject.clone()]),
        },
        // The election among its replicas.
        leader_role: Role {
            metadata: meta(&name, Some(ns), cluster),
            rules: Some(vec![
                rule("coordination.k8s.io", &["leases"], &[], &["create"]),
                rule("coordination.k8s.io", &["leases"], &[&lease], &["get", "update"]),
            ]),
        },
        // Elections are held by the account (NodeRestriction lets a node write no Lease but
        // its heartbeat).
        leader_binding: RoleBinding {
            metadata: meta(&name, Some(ns), cluster),
            role_ref,
            subjects: Some(vec![account.clone()]),
        },
        budget: budget(settings, cluster, &name),
        overrides: overrides(settings, cluster, &name),
        deployment: deployment(settings, cluster, &name),
    }
}

fn budget(settings: &Settings, cluster: &LowerCluster, name: &str) -> Option<serde_json::Value> {
    if !settings.disruption_budgets {
        return None;
    }
    let template = Some(&settings.template.spec);
    let replicas = cluster
        .spec
        .replicas
        .or_else(|| template.and_then(|s| s.replicas))
        .unwrap_or(1);
    if replicas <= 1 {
        return None;
    }
    let deployment = deployment(settings, cluster, name);
    let selector = deployment.spec.selector;
    Some(serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": labels(cluster)},
        "spec": {"minAvailable": 1, "selector": selector},
    }))
}

/// The flags that make the template's virtual node `cluster`'s.
pub fn node_args(settings: &Settings, cluster: &LowerCluster) -> Vec<String> {
    let spec = &cluster.spec;
    let mut args = vec![
        format!("--nodename={}", cluster.node_name()),
        format!("--client-kubeconfig={CREDENTIAL_DIR}/{}", spec.credential.key()),
        format!("--cluster-id={}", settings.cluster_id),
    ];
    if !spec.node_labels.is_empty() {
        let labels: Vec<String> = spec.node_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        args.push(format!("--node-labels={}", labels.join(",")));
    }
    if spec.disable_taint {
        args.push("--disable-taint".into());
    }
    if settings.node_identity {
        args.push("--upper-identity=node".into());
    }
    if !spec.namespaces.is_empty() {
        args.push(format!("--lower-namespaces={}", spec.namespaces.join(",")));
    }
    args.push(format!("--overrides-file={OVERRIDES_DIR}/{OVERRIDES_KEY}"));
    if let Some(tokens) = &spec.upper_tokens {
        args.push("--upper-service-account-tokens".into());
        args.push(format!("--upper-api-endpoint={}", tokens.api_endpoint));
        if !tokens.namespaces.is_empty() {
            args.push(format!(
                "--upper-token-namespaces={}",
                tokens.namespaces.join(",")
            ));
        }
    }
    args.extend(spec.extra_args.iter().cloned());
    args
}

fn deployment(settings: &Settings, cluster: &LowerCluster, name: &str) -> Deployment {
    let mut deployment = settings.template.clone();
    let own = labels(cluster);
    deployment.metadata = ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(settings.namespace.clone()),
        labels: Some(
            deployment
                .metadata
                .labels
                .take()
                .unwrap_or_default()
                .into_iter()
                .chain(own.clone())
                .collect(),
        ),
        annotations: deployment.metadata.annotations.take(),
        ..Default::default()
    };
    let spec = &mut deployment.spec;
    if let Some(replicas) = cluster.spec.replicas {
        spec.replicas = Some(replicas);
    }
    let selector = spec.selector.match_labels.get_or_insert_with(Default::default);
    selector.insert(names::LOWER_CLUSTER.to_owned(), cluster.name().to_owned());
    let template_meta = spec.template.metadata.get_or_insert_with(Default::default);
    template_meta
        .labels
        .get_or_insert_with(Default::default)
        .insert(names::LOWER_CLUSTER.to_owned(), cluster.name().to_owned());
    let pod = spec.template.spec.get_or_insert_with(Default::default);
    pod.service_account_name = Some(name.to_owned());
    let volumes = pod.volumes.get_or_insert_with(Vec::new);
    volumes.push(Volume {
        name: "lower-credential".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(cluster.spec.credential.secret_name.clone()),
            ..Default::default()
        }),
        ..Default::default()
    });
    volumes.push(Volume {
        name: "overrides".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: name.to_owned(),
            ..Default::default()
        }),
        ..Default::default()
    });
    if let Some(container) = pod.containers.iter_mut().find(|c| c.name == CONTAINER) {
        container
            .args
            .get_or_insert_with(Vec::new)
            .extend(node_args(settings, cluster));
        container.volume_mounts.get_or_insert_with(Vec::new).extend([
            VolumeMount {
                name: "lower-credential".into(),
                mount_path: CREDENTIAL_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: "overrides".into(),
                mount_path: OVERRIDES_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]);
    }
    deployment
}

/// `object` as a server-side apply body: its fields with its `apiVersion` and `kind`, which
/// typed objects leave out.
pub fn apply_body<K>(object: &K) -> Result<serde_json::Value, serde_json::Error>
where
    K: kube::Resource<DynamicType = ()> + serde::Serialize,
{
    let mut value = serde_json::to_value(object)?;
    value["apiVersion"] = K::api_version(&()).into();
    value["kind"] = K::kind(&()).into();
    Ok(value)
}

/// What the controller observed of one lower cluster in one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    /// Why the spec cannot be acted on, if it cannot.
    pub invalid: Option<String>,
    /// The credential: `Ok` when the lower cluster accepted it, else the reason and message.
    pub credential: Option<Result<(), (String, String)>>,
    /// The lower apiserver: its version, or the reason and message it could not be reached.
    pub lower: Option<Result<String, (String, String)>>,
    pub lower_nodes: Option<i64>,
    /// The upper Node's Ready condition (status, reason, message); `None` while absent.
    pub node_ready: Option<(String, String, String)>,
    pub allocatable: BTreeMap<String, String>,
    pub last_heartbeat: Option<String>,
    pub credential_expires: Option<String>,
    /// The credential Secret held for it.
    pub credential_secret: Option<String>,
    /// `spec.overrides`: what is in force, or why they were refused.
    pub overrides: Option<Result<String, String>>,
}

/// A condition's status values.
const TRUE: &str = "True";
const FALSE: &str = "False";
const UNKNOWN: &str = "Unknown";

fn set(
    conditions: &mut Vec<Condition>,
    before: &[Condition],
    generation: Option<i64>,
    c: (&str, &str, &str, &str),
) {
    let (type_, status, reason, message) = c;
    // A message is always said: v1.20's apiserver turns an empty one in a merge patch into
    // null, which the condition schema refuses.
    let message = if message.is_empty() { reason } else { message };
    // The transition time moves only when the status does.
    let since = before
        .iter()
        .find(|b| b.type_ == type_ && b.status == status)
        .map(|b| b.last_transition_time.clone())
        .unwrap_or_else(|| Time(jiff::Timestamp::now()));
    conditions.push(Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: since,
        observed_generation: generation,
    });
}

/// The status to report from `observed`, with `before` the status as it stands (so
/// transition times hold while nothing changes).
pub fn status(cluster: &LowerCluster, observed: &Observed) -> LowerClusterStatus {
    let before: &[Condition] = cluster
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let generation = cluster.metadata.generation;
    let mut conditions = Vec::new();
    let accepted = observed.invalid.is_none();
    set(
        &mut conditions,
        before,
        generation,
        match &observed.invalid {
            None => (condition::ACCEPTED, TRUE, "Accepted", "the spec can be acted on"),
            Some(why) => (condition::ACCEPTED, FALSE, "Invalid", why),
        },
    );
    let (credential_ok, credential) = match &observed.credential {
        Some(Ok(())) => (
            true,
            (
                condition::CREDENTIAL_VALID,
                TRUE,
                "Accepted",
                "the lower cluster accepts the credential",
            ),
        ),
        Some(Err((reason, message))) => (
            false,
            (
                condition::CREDENTIAL_VALID,
                FALSE,
                reason.as_str(),
                message.as_str(),
            ),
        ),
        None => (
            false,
            (
                condition::CREDENTIAL_VALID,
                UNKNOWN,
                "NotChecked",
                "the lower cluster could not be asked",
            ),
        ),
    };
    set(&mut conditions, before, generation, credential);
    let (reachable, lower) = match &observed.lower {
        Some(Ok(version)) => (
            true,
            (condition::LOWER_REACHABLE, TRUE, "Reachable", version.as_str()),
        ),
        Some(Err((reason, message))) => (
            false,
            (
                condition::LOWER_REACHABLE,
                FALSE,
                reason.as_str(),
                message.as_str(),
            ),
        ),
        None => (
            false,
            (
                condition::LOWER_REACHABLE,
                UNKNOWN,
                "NotChecked",
                "the credential gives no client to ask with",
            ),
        ),
    };
    set(&mut conditions, before, generation, lower);
    let (node_ok, node) = match &observed.node_ready {
        Some((status, reason, message)) if status == "True" => (
            true,
            (condition::NODE_READY, TRUE, reason.as_str(), message.as_str()),
        ),
        Some((_, reason, message)) => (
            false,
            (condition::NODE_READY, FALSE, reason.as_str(), message.as_str()),
        ),
        None => (
            false,
            (
                condition::NODE_READY,
                FALSE,
                "NotRegistered",
                "the virtual node has not registered its Node yet",
            ),
        ),
    };
    set(&mut conditions, before, generation, node);
    // The first False condition says why not Ready; else the first Unknown leaves it Unknown.
    let first_false = conditions
        .iter()
        .find(|c| c.status == FALSE)
        .or_else(|| conditions.iter().find(|c| c.status != TRUE))
        .cloned();
    let ready = match (accepted && credential_ok && reachable && node_ok, &first_false) {
        (true, _) => TRUE,
        (false, Some(c)) if c.status == UNKNOWN => UNKNOWN,
        (false, _) => FALSE,
    };
    let ready_message = first_false
        .as_ref()
        .map(|c| format!("{} is {}: {}", c.type_, c.status, c.message))
        .unwrap_or_else(|| "pods bound to the virtual node run in the lower cluster".into());
    let ready_reason = first_false
        .as_ref()
        .map(|c| c.reason.clone())
        .unwrap_or_else(|| "Ready".into());
    set(
        &mut conditions,
        before,
        generation,
        (condition::READY, ready, &ready_reason, &ready_message),
    );
    // Said apart from Ready: refused overrides leave the ones in force, and pods run.
    if let Some(overrides) = &observed.overrides {
        set(
            &mut conditions,
            before,
            generation,
            match overrides {
                Ok(said) => (condition::OVERRIDES_ACCEPTED, TRUE, "Accepted", said.as_str()),
                Err(why) => (condition::OVERRIDES_ACCEPTED, FALSE, "Invalid", why.as_str()),
            },
        );
    }
    let previous = cluster.status.as_ref();
    LowerClusterStatus {
        observed_generation: generation,
        // Recorded once accepted: the node its removal removes. A refused object keeps what it
        // had (nothing, if it was never accepted).
        node_name: if accepted {
            Some(cluster.node_name().to_owned())
        } else {
            previous.and_then(|s| s.node_name.clone())
        },
        credential_secret: observed
            .credential_secret
            .clone()
            .or_else(|| previous.and_then(|s| s.credential_secret.clone())),
        conditions,
        lower_version: observed.lower.as_ref().and_then(|l| l.as_ref().ok().cloned()),
        lower_nodes: observed.lower_nodes,
        allocatable: observed.allocatable.clone(),
        last_heartbeat: observed.last_heartbeat.clone(),
        credential_expires: observed.credential_expires.clone(),
        // Only a removal sets it.
        lower_removed: None,
        upper_token_namespaces: cluster.spec.token_namespaces(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::resource::{Credential, LowerClusterSpec};

    pub fn settings() -> Settings {
        let template: Deployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "template", "labels": {"app.kubernetes.io/name": "tensile"}},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app.kubernetes.io/component": "virtual-node"}},
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/component": "virtual-node"}},
                    "spec": {"containers": [
                        {"name": "virtual-node", "image": "tensile:0.1.0",
                         "args": ["--kubelet-port=10250", "--leader-elect"]}
                    ]}
                }
            }
        }))
        .unwrap();
        Settings {
            namespace: "tensile".into(),
            prefix: "tensile".into(),
            shared_role: "tensile-virtual-node".into(),
            template,
            cluster_id: "upper-uid".into(),
            disruption_budgets: true,
            node_identity: false,
        }
    }

    pub fn cluster(name: &str) -> LowerCluster {
        let mut c = LowerCluster::new(
            name,
            LowerClusterSpec {
                credential: Credential {
                    secret_name: format!("{name}-credential"),
                    key: None,
                },
                node_labels: BTreeMap::from([("region".into(), "eu".into()), ("zone".into(), "a".into())]),
                ..Default::default()
            },
        );
        c.metadata.generation = Some(3);
        c
    }

    #[test]
    fn overrides_are_checked_and_handed_to_the_node_as_a_config_map_it_mounts() {
        let s = settings();
        let mut c = cluster("lower-a");
        let name = object_name(&s, "lower-a");
        c.spec.overrides = Some(serde_json::json!({
            "rules": [{"name": "mirror", "image": {"prefix": {"from": "docker.io/", "to": "m.example/"}}}],
            "storageClasses": {"fast": "premium"}}));
        let made = objects(&s, &c);
        let Overrides::Accepted(config_map) = &made.overrides else {
            panic!("{:?}", made.overrides)
        };
        assert_eq!(config_map.metadata.name.as_deref(), Some(name.as_str()));
        assert_eq!(
            config_map.metadata.namespace.as_deref(),
            Some(s.namespace.as_str())
        );
        let text = &config_map.data.as_ref().unwrap()[OVERRIDES_KEY];
        let read = tensile_common::lower::overrides::parse(text).unwrap();
        assert_eq!(read.rules[0].name, "mirror");
        assert_eq!(read.storage_classes["fast"], "premium");
        let pod = made.deployment.spec.template.spec.unwrap();
        let volume = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "overrides")
            .unwrap();
        assert_eq!(volume.config_map.unwrap().name, name);
        let container = pod.containers.iter().find(|c| c.name == CONTAINER).unwrap();
        assert!(
            container
                .args
                .as_ref()
                .unwrap()
                .contains(&"--overrides-file=/etc/tensile/overrides/overrides.json".to_owned())
        );
        assert!(
            container
                .volume_mounts
                .as_ref()
                .unwrap()
                .iter()
                .any(|m| m.name == "overrides" && m.mount_path == OVERRIDES_DIR)
        );
        // Without overrides the node follows an empty set (adding some later restarts nothing).
        c.spec.overrides = None;
        let Overrides::Accepted(empty) = objects(&s, &c).overrides else {
            panic!()
        };
        assert_eq!(
            tensile_common::lower::overrides::parse(&empty.data.unwrap()[OVERRIDES_KEY]).unwrap(),
            Default::default()
        );
        // Refused: the reason; the ConfigMap is not written.
        c.spec.overrides = Some(
            serde_json::json!({"rules": [{"name": "mirror", "image": {"regex": {"pattern": "(", "replacement": ""}}}]}),
        );
        let Overrides::Refused(why) = objects(&s, &c).overrides else {
            panic!()
        };
        assert!(
            why.starts_with("spec.overrides: rule \"mirror\": image.regex: regex parse error"),
            "{why}"
        );
        let why = kept_in_force(&why);
        // The condition says it; Ready is not about it.
        let observed = Observed {
            overrides: Some(Err(why.clone())),
            ..Default::default()
        };
        let status = status(&c, &observed);
        let said = status
            .conditions
            .iter()
            .find(|x| x.type_ == condition::OVERRIDES_ACCEPTED)
            .unwrap();
        assert_eq!(
            (said.status.as_str(), said.reason.as_str(), said.message.as_str()),
            ("False", "Invalid", why.as_str())
        );
        let ready = status
            .conditions
            .iter()
            .find(|x| x.type_ == condition::READY)
            .unwrap();
        assert!(!ready.message.contains("Overrides"), "{}", ready.message);
        let fine = Observed {
            overrides: Some(checked_overrides(&cluster("lower-a")).map(|(_, said)| said)),
            ..Default::default()
        };
        let said = status_of(&cluster("lower-a"), &fine, condition::OVERRIDES_ACCEPTED);
        assert_eq!(
            said,
            (
                "True".to_owned(),
                "0 rule(s) and 0 StorageClass name(s) in force".to_owned()
            )
        );
    }

    #[test]
    fn the_rights_checked_follow_the_features_the_flags_turn_on() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            Features::of_args(&args(&["--kubelet-port=10250"])),
            Features::default()
        );
        let both = Features::of_args(&args(&[
            "--enable-controllers=PodControllers,ServiceControllers",
            "--gc-namespaces",
        ]));
        assert_eq!(
            both,
            Features {
                reflect_services: true,
                gc_namespaces: true
            }
        );
        let said = |rights: Vec<Right>| rights.iter().map(ToString::to_string).collect::<Vec<_>>();
        let base = said(required_rights(Features::default(), true));
        assert!(base.contains(&"list nodes (capacity)".to_owned()), "{base:?}");
        assert!(
            base.contains(&"patch pods/resize (in-place resize)".to_owned()),
            "{base:?}"
        );
        assert!(!base.iter().any(|r| r.contains("services")), "{base:?}");
        let all = said(required_rights(both, true));
        assert!(
            all.contains(&"create services (reflectServices)".to_owned()),
            "{all:?}"
        );
        assert!(
            all.contains(&"list deployments.apps (gcNamespaces)".to_owned()),
            "{all:?}"
        );
        let scoped = said(required_rights(both, false));
        assert!(
            !scoped
                .iter()
                .any(|r| r.contains("nodes") || r.contains("namespaces")),
            "nothing cluster-wide under a namespace scope: {scoped:?}"
        );
        let mut c = cluster("lower-a");
        c.spec.extra_args = args(&["--gc-namespaces"]);
        assert!(
            Features::of(&settings(), &c).gc_namespaces,
            "a cluster's own flags count"
        );
    }

    #[test]
    fn a_changed_kubeconfig_rolls_the_virtual_node_and_a_renewed_token_does_not() {
        use k8s_openapi::ByteString;
        let secret = |kubeconfig: &str, token: &str| k8s_openapi::api::core::v1::Secret {
            data: Some(BTreeMap::from([
                (
                    names::CREDENTIAL_KUBECONFIG_KEY.to_owned(),
                    ByteString(kubeconfig.into()),
                ),
                (names::CREDENTIAL_TOKEN_KEY.to_owned(), ByteString(token.into())),
            ])),
            ..Default::default()
        };
        let first = credential_digest(&secret("server: https://a:6443", "t1"));
        assert_eq!(first, credential_digest(&secret("server: https://a:6443", "t2")));
        assert_ne!(first, credential_digest(&secret("server: https://b:6443", "t1")));
        let mut objects = objects(&settings(), &cluster("lower-a"));
        with_credential(&mut objects, &first);
        let template = objects.deployment.spec.template.metadata.unwrap_or_default();
        assert_eq!(
            template.annotations.unwrap_or_default().get(CREDENTIAL_DIGEST),
            Some(&first)
        );
    }

    fn status_of(c: &LowerCluster, observed: &Observed, type_: &str) -> (String, String) {
        let status = status(c, observed);
        let found = status.conditions.into_iter().find(|x| x.type_ == type_).unwrap();
        (found.status, found.message)
    }

    #[test]
    fn upper_tokens_are_passed_to_the_node_and_need_its_node_identity() {
        let mut c = cluster("lower-a");
        c.spec.upper_tokens = Some(crate::resource::UpperTokens {
            api_endpoint: "https://upper.example:6443".into(),
            namespaces: vec!["team-a".into()],
        });
        let mut s = settings();
        s.node_identity = true;
        assert!(validate(&s, &c).is_ok());
        let args = node_args(&s, &c);
        for flag in [
            "--upper-service-account-tokens",
            "--upper-api-endpoint=https://upper.example:6443",
            "--upper-token-namespaces=team-a",
        ] {
            assert!(args.contains(&flag.to_owned()), "{flag}: {args:?}");
        }
        let refused = validate(&settings(), &c).unwrap_err();
        assert!(
            refused.0.contains("spec.upperTokens needs the node identity"),
            "{}",
            refused.0
        );
    }

    #[test]
    fn a_namespace_scoped_cluster_runs_its_node_over_those_namespaces_only() {
        let mut c = cluster("lower-a");
        assert!(
            !node_args(&settings(), &c)
                .iter()
                .any(|a| a.starts_with("--lower-namespaces"))
        );
        assert_eq!(c.spec.served(), tensile_common::cache::Namespaces::All);
        c.spec.namespaces = vec!["team-a".into(), "team-b".into()];
        assert!(node_args(&settings(), &c).contains(&"--lower-namespaces=team-a,team-b".to_owned()));
        assert!(c.spec.served().contains("team-b") && !c.spec.served().contains("default"));
        assert!(validate(&settings(), &c).is_ok());
        c.spec.extra_args = vec!["--gc-namespaces".into()];
        let refused = validate(&settings(), &c).unwrap_err();
        assert!(
            refused
                .0
                .contains("spec.namespaces and --gc-namespaces exclude each other"),
            "{}",
            refused.0
        );
    }

    #[test]
    fn a_virtual_node_gets_the_template_with_its_own_flags_account_and_credential() {
        let objects = objects(&settings(), &cluster("lower-a"));
        let d = &objects.deployment;
        assert_eq!(d.metadata.name.as_deref(), Some("tensile-vn-lower-a"));
        assert_eq!(d.metadata.namespace.as_deref(), Some("tensile"));
        let spec = &d.spec;
        assert_eq!(
            spec.selector
                .match_labels
                .as_ref()
                .unwrap()
                .get(names::LOWER_CLUSTER)
                .map(String::as_str),
            Some("lower-a"),
            "each virtual node selects its own pods only"
        );
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("tensile-vn-lower-a"));
        let args = pod.containers[0].args.as_ref().unwrap();
        assert_eq!(
            args,
            &[
                "--kubelet-port=10250",
                "--leader-elect",
                "--nodename=lower-a",
                "--client-kubeconfig=/etc/tensile/lower/kubeconfig",
                "--cluster-id=upper-uid",
                "--node-labels=region=eu,zone=a",
                "--overrides-file=/etc/tensile/overrides/overrides.json",
            ]
        );
        let volume = &pod.volumes.as_ref().unwrap()[0];
        assert_eq!(
            volume.secret.as_ref().unwrap().secret_name.as_deref(),
            Some("lower-a-credential"),
            "the whole Secret, so the token file beside the kubeconfig follows renewals"
        );
        assert!(volume.secret.as_ref().unwrap().items.is_none());
    }

    #[test]
    fn the_rights_that_name_a_node_are_granted_to_that_nodes_account_alone() {
        let objects = objects(&settings(), &cluster("lower-a"));
        let rules = objects.node_role.rules.as_ref().unwrap();
        for rule in rules {
            assert_eq!(rule.resource_names.as_deref(), Some(&["lower-a".to_owned()][..]));
        }
        let lease_rules = objects.lease_role.rules.as_ref().unwrap();
        assert_eq!(
            lease_rules[1].resource_names.as_deref(),
            Some(&["lower-a".to_owned()][..])
        );
        let leader_rules = objects.leader_role.rules.as_ref().unwrap();
        assert_eq!(
            leader_rules[1].resource_names.as_deref(),
            Some(&["tensile-virtual-node-lower-a".to_owned()][..])
        );
        for subjects in [
            &objects.node_binding.subjects,
            &objects.shared_binding.subjects,
            &objects.lease_binding.subjects,
            &objects.leader_binding.subjects,
        ] {
            let s = &subjects.as_ref().unwrap()[0];
            assert_eq!(
                (s.name.as_str(), s.namespace.as_deref()),
                ("tensile-vn-lower-a", Some("tensile"))
            );
        }
        assert_eq!(objects.shared_binding.role_ref.name, "tensile-virtual-node");
    }

    #[test]
    fn under_a_node_identity_the_grants_name_the_nodes_user_and_the_account_only_asks() {
        let s = Settings {
            node_identity: true,
            ..settings()
        };
        let lower_a = cluster("lower-a");
        let objects = objects(&s, &lower_a);
        let user = |b: &ClusterRoleBinding| b.subjects.clone().unwrap_or_default();
        let leader = objects.leader_binding.subjects.clone().unwrap_or_default();
        assert_eq!(
            (leader[0].kind.as_str(), leader[0].name.as_str()),
            ("ServiceAccount", "tensile-vn-lower-a"),
            "the election is the account's: a node may write no Lease but its heartbeat"
        );
        for subjects in [
            user(&objects.shared_binding),
            objects.lease_binding.subjects.clone().unwrap_or_default(),
        ] {
            assert_eq!(subjects.len(), 1);
            assert_eq!(
                (subjects[0].kind.as_str(), subjects[0].name.as_str()),
                ("User", "system:node:lower-a")
            );
        }
        let node_subjects = user(&objects.node_binding);
        assert_eq!(node_subjects.len(), 1);
        assert_eq!(
            (node_subjects[0].kind.as_str(), node_subjects[0].name.as_str()),
            ("ServiceAccount", "tensile-vn-lower-a")
        );
        let rules = objects.node_role.rules.unwrap_or_default();
        assert_eq!(
            rules.len(),
            2,
            "the account asks for the certificate, and nothing else"
        );
        for rule in &rules {
            assert_eq!(
                rule.resources.as_deref(),
                Some(&["certificatesigningrequests".to_owned()][..])
            );
        }
        assert_eq!(rules[0].verbs, ["create"]);
        assert_eq!(
            (rules[1].verbs.clone(), rules[1].resource_names.clone()),
            (
                vec!["get".to_owned(), "delete".to_owned()],
                Some(vec!["tensile-node-lower-a".to_owned()])
            ),
            "its own request only"
        );
        assert!(node_args(&s, &lower_a).contains(&"--upper-identity=node".to_owned()));
        assert!(
            !node_args(&settings(), &lower_a)
                .iter()
                .any(|a| a.starts_with("--upper-identity"))
        );
    }

    #[test]
    fn a_virtual_node_of_several_replicas_keeps_one_up() {
        let s = settings();
        assert!(
            objects(&s, &cluster("a")).budget.is_none(),
            "one replica: no budget"
        );
        let mut two = cluster("a");
        two.spec.replicas = Some(2);
        let budget = objects(&s, &two).budget.unwrap();
        assert_eq!(budget["apiVersion"], "policy/v1");
        assert_eq!(budget["spec"]["minAvailable"], 1);
        assert_eq!(
            budget["spec"]["selector"]["matchLabels"][names::LOWER_CLUSTER],
            "a"
        );
        let none = Settings {
            disruption_budgets: false,
            ..settings()
        };
        assert!(objects(&none, &two).budget.is_none());
    }

    #[test]
    fn names_too_long_for_a_deployments_pods_are_refused_with_the_reason() {
        let s = settings();
        assert!(validate(&s, &cluster("lower-a")).is_ok());
        let long = "a".repeat(37);
        let err = validate(&s, &cluster(&long)).unwrap_err();
        assert!(err.0.contains("within 47"), "{err}");
        let mut empty = cluster("b");
        empty.spec.credential.secret_name.clear();
        assert_eq!(
            validate(&s, &empty).unwrap_err().0,
            "spec.credential.secretName is empty"
        );
    }

    #[test]
    fn ready_says_the_first_reason_it_is_not_and_transition_times_hold() {
        let mut c = cluster("lower-a");
        let mut observed = Observed {
            credential: Some(Ok(())),
            lower: Some(Ok("v1.20.2".into())),
            lower_nodes: Some(3),
            node_ready: Some(("True".into(), "LowerReachable".into(), "".into())),
            ..Default::default()
        };
        let first = status(&c, &observed);
        let ready = first
            .conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("True", "Ready"));
        assert_eq!(first.lower_version.as_deref(), Some("v1.20.2"));
        assert_eq!(first.observed_generation, Some(3));

        c.status = Some(first.clone());
        let again = status(&c, &observed);
        assert_eq!(again, first, "nothing changed, nothing to write");

        observed.credential = Some(Err((
            "Unauthorized".into(),
            "the lower cluster refused the token".into(),
        )));
        let broken = status(&c, &observed);
        let ready = broken
            .conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .unwrap();
        assert_eq!(ready.status, "False");
        assert_eq!(ready.reason, "Unauthorized");
        assert_eq!(
            ready.message,
            "CredentialValid is False: the lower cluster refused the token"
        );
        // What could not be asked is Unknown, not False, and so is Ready when nothing is False.
        let unasked = Observed {
            node_ready: Some(("True".into(), "Ready".into(), "ready".into())),
            ..Default::default()
        };
        assert_eq!(status_of(&c, &unasked, condition::CREDENTIAL_VALID).0, "Unknown");
        assert_eq!(status_of(&c, &unasked, condition::LOWER_REACHABLE).0, "Unknown");
        assert_eq!(
            status_of(&c, &unasked, condition::READY),
            (
                "Unknown".to_owned(),
                "CredentialValid is Unknown: the lower cluster could not be asked".to_owned()
            )
        );
    }

    #[test]
    fn a_refused_object_records_no_node_it_never_had() {
        let observed = Observed {
            invalid: Some("the virtual node name \"a\" is LowerCluster b's".into()),
            ..Default::default()
        };
        let mut c = cluster("a");
        assert_eq!(
            status(&c, &observed).node_name,
            None,
            "its removal removes nothing"
        );
        c.status = Some(LowerClusterStatus {
            node_name: Some("a".into()),
            ..Default::default()
        });
        assert_eq!(
            status(&c, &observed).node_name.as_deref(),
            Some("a"),
            "what was made stays recorded"
        );
        let accepted = Observed::default();
        assert_eq!(status(&cluster("a"), &accepted).node_name.as_deref(), Some("a"));
    }

    #[test]
    fn a_node_not_yet_registered_is_not_ready() {
        let observed = Observed {
            credential: Some(Ok(())),
            lower: Some(Ok("v1.20.2".into())),
            ..Default::default()
        };
        let s = status(&cluster("a"), &observed);
        let ready = s.conditions.iter().find(|c| c.type_ == condition::READY).unwrap();
        assert_eq!(ready.reason, "NotRegistered");
        assert!(
            s.conditions.iter().all(|c| !c.message.is_empty()),
            "every condition says something: {:?}",
            s.conditions
        );
    }
}
