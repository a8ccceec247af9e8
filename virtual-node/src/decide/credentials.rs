//! The lower Secrets of upper credentials: one per pod and kind ([`crate::decide::tokens`],
//! [`crate::decide::certificates`]), labelled with the upper cluster's id, the node and the
//! upper pod's UID, owned by the lower pod so they go with it.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use tensile_common::lower::identity::{Identity, TOKEN_LABEL};
use tensile_common::names;

/// The Secret `name` of upper credentials of `upper` (in its namespace), owned by its lower
/// pod `lower`, holding `data` and annotated with `annotations`.
pub fn secret(
    upper: &Pod,
    lower: &Pod,
    identity: &Identity,
    name: String,
    annotations: BTreeMap<String, String>,
    data: BTreeMap<String, ByteString>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: upper.namespace(),
            labels: Some(BTreeMap::from([
                (TOKEN_LABEL.to_owned(), identity.cluster_id.clone()),
                (names::MARK_NODE.to_owned(), identity.node.clone()),
                (
                    names::MARK_UPPER_UID.to_owned(),
                    upper.metadata.uid.clone().unwrap_or_default(),
                ),
            ])),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: lower.name_any(),
                uid: lower.metadata.uid.clone().unwrap_or_default(),
                controller: None,
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}
