//! What the webhook does to which pods, independent of how it is configured.

use std::collections::BTreeSet;

use tensile_common::names;

/// A `key=value` label pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub key: String,
    pub value: String,
}

impl Label {
    pub fn new(key: &str, value: &str) -> Self {
        Self {
            key: key.to_owned(),
            value: value.to_owned(),
        }
    }
}

impl std::str::FromStr for Label {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok(Label::new(k.trim(), v.trim())),
            _ => Err(format!("{s:?} is not of the form key=value")),
        }
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// How the upper pod is kept on virtual nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum VirtualNodeConstraint {
    /// A required node-affinity expression, ANDed into every term.
    #[default]
    Affinity,
    /// A `nodeSelector` entry.
    NodeSelector,
    /// Nothing: the upper scheduler may place the pod anywhere its tolerations allow.
    None,
}

/// The mutation policy.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Pods carrying this label are mutated; all others pass unchanged.
    pub opt_in: Label,
    /// Namespaces whose pods pass unchanged whatever their labels.
    pub excluded_namespaces: BTreeSet<String>,
    /// nodeSelector / node-affinity keys that stay on the upper pod (they pick the cluster).
    pub ignore_selector_keys: BTreeSet<String>,
    /// The label every virtual node carries.
    pub virtual_node_label: Label,
    pub virtual_node_constraint: VirtualNodeConstraint,
    /// `tolerationSeconds` of the upper pod's not-ready toleration: how long a pod stays
    /// bound to a virtual node whose lower cluster stopped answering before it is evicted.
    pub not_ready_seconds: i64,
    /// `tolerationSeconds` of the upper pod's unreachable toleration.
    pub unreachable_seconds: i64,
    /// Signs every stash written (`tensile.io/stash-signature`) for the pod's namespace and
    /// controller (or name, for a bare pod), so virtual nodes holding the same key apply only
    /// stashes this webhook wrote for that pod.
    pub stash_key: Option<std::sync::Arc<tensile_common::stash::StashKey>>,
    /// The `schedulerName` opted-in pods get at CREATE (the multi-scheduler's, say), so
    /// workloads need no edit. Only a pod left to the default scheduler is moved: one that
    /// names a scheduler of its own keeps it.
    pub scheduler_name: Option<String>,
    /// Opted-in Jobs (their pod template carries `opt_in`) get the rule ignoring
    /// `DisruptionTarget` first in their `podFailurePolicy` at CREATE (the `job` module).
    pub job_disruption_rule: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            opt_in: Label::new(names::VIRTUAL_POD_LABEL, names::VIRTUAL_POD_VALUE),
            excluded_namespaces: BTreeSet::from(["kube-system".to_owned()]),
            ignore_selector_keys: BTreeSet::new(),
            virtual_node_label: Label::new(names::VIRTUAL_NODE_TYPE_LABEL, names::VIRTUAL_NODE_TYPE_VALUE),
            virtual_node_constraint: VirtualNodeConstraint::Affinity,
            not_ready_seconds: 300,
            unreachable_seconds: 300,
            stash_key: None,
            scheduler_name: None,
            job_disruption_rule: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_parse_from_key_value() {
        assert_eq!("a=b".parse::<Label>().unwrap(), Label::new("a", "b"));
        assert_eq!("a=".parse::<Label>().unwrap(), Label::new("a", ""));
        assert!("=b".parse::<Label>().is_err());
        assert!("ab".parse::<Label>().unwrap_err().contains("key=value"));
    }
}
