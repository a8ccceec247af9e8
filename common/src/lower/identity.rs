//! Who a virtual node is below: the marks every lower object it makes carries.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::names;

/// Label of the lower Secrets that hold a pod's upper credentials (its upper service-account
/// tokens; its pod certificates and trust bundles): the upper cluster's id (beside the node
/// mark, never the copy mark that copies carry: they are not copies).
pub const TOKEN_LABEL: &str = "tensile.io/upper-token";

/// Who we are: every lower object we create carries these marks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Id of the upper cluster (by default its kube-system namespace UID).
    pub cluster_id: String,
    /// The virtual node's name.
    pub node: String,
}

impl Identity {
    /// Label selector matching exactly the lower objects of this virtual node.
    pub fn selector(&self) -> String {
        format!(
            "{}={},{}={}",
            names::MARK_CLUSTER,
            self.cluster_id,
            names::MARK_NODE,
            self.node
        )
    }

    /// True when `meta` carries our cluster and node marks.
    pub fn owns(&self, meta: &ObjectMeta) -> bool {
        let labels = meta.labels.as_ref();
        let get = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
        get(names::MARK_CLUSTER) == Some(self.cluster_id.as_str())
            && get(names::MARK_NODE) == Some(self.node.as_str())
    }

    /// Label selector matching exactly the upper-token Secrets of this virtual node.
    pub fn token_selector(&self) -> String {
        format!(
            "{TOKEN_LABEL}={},{}={}",
            self.cluster_id,
            names::MARK_NODE,
            self.node
        )
    }

    /// True when `meta` is this node's Secret of upper credentials of the pod whose upper UID
    /// is `uid` (what a Secret of that name must be before it is overwritten).
    pub fn holds_credentials(&self, meta: &ObjectMeta, uid: &str) -> bool {
        let labels = meta.labels.as_ref();
        let get = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
        get(TOKEN_LABEL) == Some(self.cluster_id.as_str())
            && get(names::MARK_NODE) == Some(self.node.as_str())
            && get(names::MARK_UPPER_UID) == Some(uid)
    }

    /// Our marks as labels.
    pub fn marks(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (names::MARK_CLUSTER.to_owned(), self.cluster_id.clone()),
            (names::MARK_NODE.to_owned(), self.node.clone()),
        ])
    }
}

/// The upper pod UID a lower pod of ours was made for.
pub fn upper_uid(lower: &impl kube::Resource) -> Option<&str> {
    lower
        .meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(names::MARK_UPPER_UID))
        .map(String::as_str)
}
