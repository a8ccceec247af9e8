//! The `LowerCluster` kind (`tensile.io/v1alpha1`, cluster-scoped): one lower cluster of the
//! fleet, its virtual node's settings, and what the cluster controller last saw of it. Its
//! definition ships in the chart's `crds/lowerclusters.yaml`; the unit tests hold the two
//! together.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta};
use serde::{Deserialize, Serialize};
use tensile_common::names;

pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "LowerCluster";
pub const PLURAL: &str = "lowerclusters";

/// Condition types of a `LowerCluster`'s status.
pub mod condition {
    /// The spec can be acted on (names valid, nothing contradicts).
    pub const ACCEPTED: &str = "Accepted";
    /// The credential Secret exists, holds a usable kubeconfig, and the lower cluster
    /// accepts it.
    pub const CREDENTIAL_VALID: &str = "CredentialValid";
    /// The lower cluster's apiserver answers.
    pub const LOWER_REACHABLE: &str = "LowerReachable";
    /// The virtual node is registered upstream and Ready.
    pub const NODE_READY: &str = "NodeReady";
    /// All of the above: pods bound to the virtual node run below.
    pub const READY: &str = "Ready";
    /// `spec.overrides` passed its checks and is in force; when False, the overrides
    /// accepted before stay in force. Ready does not depend on it.
    pub const OVERRIDES_ACCEPTED: &str = "OverridesAccepted";
}

/// What `tensilectl join` records on a `LowerCluster` of the lower cluster it joined, so a
/// second join and `leave` know which lower cluster it is: annotations, which no stale
/// definition of the kind prunes.
pub mod record {
    /// The lower cluster's id: its kube-system namespace's UID.
    pub const LOWER_UID: &str = "tensile.io/lower-cluster-uid";
    /// The lower apiserver's address, as the credential names it.
    pub const LOWER_SERVER: &str = "tensile.io/lower-server";
    /// The lower namespace of the virtual node's account.
    pub const LOWER_NAMESPACE: &str = "tensile.io/lower-namespace";
}

/// One lower cluster as the API stores it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LowerCluster {
    #[serde(rename = "apiVersion", default)]
    pub api_version: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: LowerClusterSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<LowerClusterStatus>,
}

/// What the operator says of a lower cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LowerClusterSpec {
    /// The Secret, in the cluster controller's namespace, with the lower cluster's
    /// kubeconfig (key `kubeconfig`) and, when the controller renews it, the token that
    /// kubeconfig reads from a file beside it (key `token`).
    pub credential: Credential,
    /// The virtual node's name; the object's name when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Labels of the virtual node, besides the suite's own.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// Whether the virtual node goes without its `virtual-kubelet.io/provider` taint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disable_taint: bool,
    /// Replicas of the virtual node (one leads); the controller's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// More flags of this virtual node (`--name=value`), after the controller's own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
    /// The lower namespaces served, when the credential holds Roles in them alone (the
    /// virtual node's `--lower-namespaces`); every namespace when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// Pods below get tokens of the upper cluster for their upper ServiceAccount (the virtual
    /// node's `--upper-service-account-tokens`); none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_tokens: Option<UpperTokens>,
    /// Rules applied to every pod that goes to this cluster, and its StorageClass names
    /// (`tensile_common::lower::overrides`). Kept as written: it is checked (and refused,
    /// with the reason in the `OverridesAccepted` condition) apart from the rest of the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overrides: Option<serde_json::Value>,
}

/// Upper service-account tokens for the pods of one lower cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpperTokens {
    /// The upper apiserver as the lower cluster's pods reach it (`https://host[:port]`).
    pub api_endpoint: String,
    /// Only pods of these namespaces get tokens. When empty, every namespace but those shared
    /// with others below, and none under a namespace scope (see
    /// [`LowerClusterSpec::token_namespaces`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
}

impl LowerClusterSpec {
    /// With `upperTokens`: which namespaces' pods get upper tokens below, in words, as its
    /// virtual node decides: those listed; else, under a namespace scope, none (the served
    /// namespaces are the lower cluster's users', who could read the tokens there); else every
    /// namespace but those shared with others below (`--shared-namespaces` in `extraArgs`,
    /// `default` by default).
    pub fn token_namespaces(&self) -> Option<String> {
        let tokens = self.upper_tokens.as_ref()?;
        if !tokens.namespaces.is_empty() {
            return Some(tokens.namespaces.join(", "));
        }
        if !self.namespaces.is_empty() {
            return Some(
                "none: the served namespaces are the lower cluster's users'; list namespaces in \
                 upperTokens.namespaces to give them tokens"
                    .to_owned(),
            );
        }
        let shared = self
            .extra_args
            .iter()
            .rev()
            .find_map(|a| a.strip_prefix("--shared-namespaces="))
            .unwrap_or("default");
        Some(match shared.split(',').any(|s| s.trim() == "*") {
            true => "none: every namespace is shared below".to_owned(),
            false => format!("every namespace but those shared below ({shared})"),
        })
    }

    /// The lower namespaces its virtual node reads and writes.
    pub fn served(&self) -> tensile_common::cache::Namespaces {
        match self.namespaces.is_empty() {
            true => tensile_common::cache::Namespaces::All,
            false => tensile_common::cache::Namespaces::Only(self.namespaces.clone()),
        }
    }
}

/// Where a lower cluster's credential is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Credential {
    pub secret_name: String,
    /// The Secret's key of the kubeconfig; `kubeconfig` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl Credential {
    /// The Secret's key of the kubeconfig.
    pub fn key(&self) -> &str {
        self.key.as_deref().unwrap_or(names::CREDENTIAL_KUBECONFIG_KEY)
    }
}

/// What the cluster controller last saw.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LowerClusterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The name of the virtual node made for it; set once it is accepted, and what its
    /// removal removes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The lower apiserver's version (`gitVersion`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_version: Option<String>,
    /// Nodes of the lower cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_nodes: Option<i64>,
    /// What the virtual node offers the upper scheduler (its Node's allocatable).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocatable: BTreeMap<String, String>,
    /// The virtual node's last heartbeat (its Lease's renew time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<String>,
    /// When the credential's token expires, for a credential the controller renews.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_expires: Option<String>,
    /// The credential Secret the controller holds (its finalizer) for this object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<String>,
    /// Set during the removal once everything made below is gone: a removal resumed after
    /// a restart does not need the lower cluster (or its credential) again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_removed: Option<bool>,
    /// With `spec.upperTokens`: the namespaces whose pods get upper tokens below, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_token_namespaces: Option<String>,
}

impl LowerCluster {
    /// A new object named `name` with `spec`, ready to be created.
    pub fn new(name: &str, spec: LowerClusterSpec) -> Self {
        Self {
            api_version: format!("{}/{VERSION}", names::API_GROUP),
            kind: KIND.into(),
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            spec,
            status: None,
        }
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// The virtual node's name.
    pub fn node_name(&self) -> &str {
        self.spec.node_name.as_deref().unwrap_or_else(|| self.name())
    }

    /// The status condition of `type_`, if reported.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
    }
}

impl kube::Resource for LowerCluster {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        names::API_GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crd() -> serde_json::Value {
        let text = include_str!("../../deploy/helm/tensile/crds/lowerclusters.yaml");
        serde_yaml::from_str(text).unwrap()
    }

    #[test]
    fn the_chart_defines_the_kind_this_code_reads() {
        let crd = crd();
        assert_eq!(crd["spec"]["group"], names::API_GROUP);
        assert_eq!(crd["spec"]["scope"], "Cluster");
        assert_eq!(crd["spec"]["names"]["kind"], KIND);
        assert_eq!(crd["spec"]["names"]["plural"], PLURAL);
        assert_eq!(crd["spec"]["versions"][0]["name"], VERSION);
        assert_eq!(
            crd["spec"]["versions"][0]["subresources"]["status"],
            serde_json::json!({})
        );
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let mut in_schema: Vec<&str> = spec["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        in_schema.sort();
        let full = LowerClusterSpec {
            credential: Credential {
                secret_name: "s".into(),
                key: None,
            },
            node_name: Some("n".into()),
            node_labels: BTreeMap::from([("a".into(), "b".into())]),
            disable_taint: true,
            replicas: Some(2),
            extra_args: vec!["--x".into()],
            namespaces: vec!["team-a".into()],
            upper_tokens: Some(UpperTokens {
                api_endpoint: "https://upper:6443".into(),
                namespaces: vec![],
            }),
            overrides: Some(serde_json::json!({"rules": []})),
        };
        let written = serde_json::to_value(&full).unwrap();
        let mut in_code: Vec<&str> = written.as_object().unwrap().keys().map(String::as_str).collect();
        in_code.sort();
        assert_eq!(
            in_schema, in_code,
            "every spec field has a schema, and no schema field is unread"
        );
    }

    #[test]
    fn the_status_says_which_namespaces_get_upper_tokens_as_the_virtual_node_decides() {
        let spec = |namespaces: &[&str], listed: &[&str], extra: &[&str]| LowerClusterSpec {
            namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
            upper_tokens: Some(UpperTokens {
                api_endpoint: "https://upper:6443".into(),
                namespaces: listed.iter().map(|s| (*s).to_owned()).collect(),
            }),
            extra_args: extra.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        };
        assert_eq!(
            spec(&[], &[], &[]).token_namespaces().as_deref(),
            Some("every namespace but those shared below (default)")
        );
        assert_eq!(
            spec(&[], &[], &["--shared-namespaces=default,ops"])
                .token_namespaces()
                .as_deref(),
            Some("every namespace but those shared below (default,ops)")
        );
        assert!(
            spec(&["team-a"], &[], &[])
                .token_namespaces()
                .is_some_and(|s| s.starts_with("none: the served namespaces are the lower cluster's users'"))
        );
        assert_eq!(
            spec(&["team-a"], &["team-a"], &[]).token_namespaces().as_deref(),
            Some("team-a")
        );
        let off = LowerClusterSpec::default();
        assert_eq!(off.token_namespaces(), None);
    }

    #[test]
    fn the_status_fields_the_printer_columns_name_are_the_ones_written() {
        let crd = crd();
        let status = LowerClusterStatus {
            observed_generation: Some(1),
            node_name: Some("n".into()),
            conditions: vec![Condition {
                type_: condition::READY.into(),
                status: "True".into(),
                reason: "Ready".into(),
                message: String::new(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    jiff::Timestamp::now(),
                ),
                observed_generation: None,
            }],
            lower_version: Some("v1.20.2".into()),
            lower_nodes: Some(3),
            allocatable: BTreeMap::from([("cpu".into(), "12".into())]),
            last_heartbeat: Some("2026-01-01T00:00:00Z".into()),
            credential_expires: Some("2026-01-02T00:00:00Z".into()),
            credential_secret: Some("s".into()),
            lower_removed: None,
            upper_token_namespaces: Some("every namespace but those shared below (default)".into()),
        };
        let written = serde_json::to_value(&status).unwrap();
        for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .unwrap()
        {
            let path = column["jsonPath"].as_str().unwrap();
            let Some(rest) = path.strip_prefix(".status.") else {
                continue;
            };
            let field = rest.split(['.', '[']).next().unwrap();
            assert!(
                written.get(field).is_some(),
                "printer column {} reads .status.{field}, which is never written",
                column["name"]
            );
        }
    }

    #[test]
    fn an_object_as_kubectl_shows_it_decodes() {
        let object: LowerCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "tensile.io/v1alpha1",
            "kind": "LowerCluster",
            "metadata": {"name": "lower-a", "generation": 2},
            "spec": {"credential": {"secretName": "lower-a-credential"}, "nodeLabels": {"region": "a"}},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready",
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}], "lowerNodes": 3}
        }))
        .unwrap();
        assert_eq!(object.node_name(), "lower-a");
        assert_eq!(
            object.condition(condition::READY).map(|c| c.status.as_str()),
            Some("True")
        );
        assert_eq!(object.status.as_ref().and_then(|s| s.lower_nodes), Some(3));
    }
}
