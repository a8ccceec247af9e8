//! The kinds reflected below (ConfigMaps, Secrets, Services, Endpoints): what of each one
//! travels, and how a copy is compared with its upper object.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    ConfigMap, EndpointAddress, EndpointPort, EndpointSubset, Endpoints, Secret, Service, ServicePort,
    ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tensile_common::names;

use crate::model::refs::Kind;

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
    /// The upper cache holds only metadata: the content is fetched when a copy is written,
    /// and copies carry the upper version and a digest (see [`is_current`]).
    const FETCHED: bool = false;
    /// The copy's content: the payload of `upper`, plus any annotations of its own (the rest
    /// of the metadata is set by the caller).
    fn payload(upper: &Self) -> Self;
    /// Same payload (data, type, immutability).
    fn same_payload(&self, other: &Self) -> bool;
    /// Fields the lower cluster assigned that an update must keep (a Service's cluster IP).
    fn carry_over(&mut self, _actual: &Self) {}
}

pub fn empty_as_none<T: PartialEq + Default>(v: &Option<T>) -> Option<&T> {
    v.as_ref().filter(|v| **v != T::default())
}

impl Reflected for ConfigMap {
    const KIND: Kind = Kind::ConfigMap;
    const FETCHED: bool = true;
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
    const FETCHED: bool = true;
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
