//! What each watch cache keeps of an object: only what some decision reads, so memory grows
//! with what the virtual node needs, not with what the apiservers send.
//!
//! No cache keeps `metadata.managedFields` ([`tensile_common::cache`]). The upper pods of this
//! node and its lower pods are otherwise kept whole: the pod controller translates and
//! compares them. The cache of every unfinished lower pod (the load on the lower nodes, other
//! tenants' pods included) keeps a [`lower_load`] of each: what capacity, the capacity shape,
//! copy collection and claim collection read, and nothing else. The lower node cache keeps a
//! [`lower_node`]: what capacity and the shape read.
//!
//! The unit tests below hold the decisions to that: each is computed on the full object and
//! on its trimmed form, and must agree.

use k8s_openapi::api::core::v1::{
    Container, EnvVar, Node, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The part of a container the load and the references read: its name, resources, the env
/// entries that come from another object, `envFrom`, and (init containers) its restart policy.
fn container_load(c: &mut Container) -> Container {
    Container {
        name: std::mem::take(&mut c.name),
        resources: c.resources.take().map(|r| ResourceRequirements {
            requests: r.requests,
            limits: r.limits,
            ..Default::default()
        }),
        env: c.env.take().and_then(|env| {
            let from: Vec<EnvVar> = env.into_iter().filter(|e| e.value_from.is_some()).collect();
            (!from.is_empty()).then_some(from)
        }),
        env_from: c.env_from.take(),
        restart_policy: c.restart_policy.take(),
        ..Default::default()
    }
}

/// A lower pod as the load on the lower nodes and the copy and claim collections read it:
/// its identity, labels and deletion mark; the node it is bound to, the containers'
/// resources and references to other objects, the volumes, pull secrets and overhead; its
/// phase.
pub fn lower_load(pod: &mut Pod) {
    let meta = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        deletion_timestamp: meta.deletion_timestamp,
        ..Default::default()
    };
    pod.spec = pod.spec.take().map(|mut s| PodSpec {
        node_name: s.node_name.take(),
        containers: s.containers.iter_mut().map(container_load).collect(),
        init_containers: s
            .init_containers
            .take()
            .map(|cs| cs.into_iter().map(|mut c| container_load(&mut c)).collect()),
        overhead: s.overhead.take(),
        volumes: s.volumes.take(),
        image_pull_secrets: s.image_pull_secrets.take(),
        ..Default::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        ..Default::default()
    });
}

/// A lower node as capacity and the capacity shape read it: name, labels, cordon, taints,
/// allocatable and conditions (no images, addresses, volumes or system information).
pub fn lower_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.spec = node.spec.take().map(|s| NodeSpec {
        unschedulable: s.unschedulable,
        taints: s.taints,
        ..Default::default()
    });
    node.status = node.status.take().map(|s| NodeStatus {
        allocatable: s.allocatable,
        conditions: s.conditions.map(|cs| {
            cs.into_iter()
                .map(|mut c| {
                    // Heartbeat times change on every status write; what is read is the type
                    // and status.
                    c.last_heartbeat_time = None;
                    c.message = None;
                    c
                })
                .collect()
        }),
        ..Default::default()
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::translate::Identity;
    use serde_json::json;
    use tensile_common::names;
    use tensile_common::resources::{is_terminal, pod_requests};

    fn identity() -> Identity {
        Identity {
            cluster_id: "c-1".into(),
            node: "vn".into(),
        }
    }

    /// A lower pod carrying every kind of field: resources in containers, init containers and
    /// overhead, references from volumes, projected sources, env, envFrom and pull secrets,
    /// and much that no decision reads.
    fn rich_pod(phase: &str, node: &str, ours: bool) -> Pod {
        let labels = if ours {
            json!({names::MARK_CLUSTER: "c-1", names::MARK_NODE: "vn", "app": "web"})
        } else {
            json!({"app": "other"})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": "7",
                "labels": labels,
                "annotations": {"big": "x".repeat(4096)},
                "managedFields": [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {"f:containers": {}}}}],
                "ownerReferences": [{"apiVersion": "v1", "kind": "ReplicaSet", "name": "rs", "uid": "o"}]},
            "spec": {
                "nodeName": node,
                "containers": [
                    {"name": "a", "image": "nginx", "command": ["nginx"], "args": ["-g", "daemon off;"],
                     "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                     "env": [{"name": "LIT", "value": "v"},
                             {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm-env", "key": "k"}}},
                             {"name": "FROM_S", "valueFrom": {"secretKeyRef": {"name": "s-env", "key": "k", "optional": true}}}],
                     "envFrom": [{"configMapRef": {"name": "cm-from"}}, {"secretRef": {"name": "s-from"}}],
                     "ports": [{"containerPort": 80}],
                     "livenessProbe": {"httpGet": {"path": "/", "port": 80}}},
                    {"name": "b", "image": "busybox", "resources": {"requests": {"cpu": "250m"}}}
                ],
                "initContainers": [
                    {"name": "i", "image": "init", "resources": {"requests": {"cpu": "2"}},
                     "env": [{"name": "I", "valueFrom": {"secretKeyRef": {"name": "s-init", "key": "k"}}}]},
                    {"name": "sidecar", "image": "proxy", "restartPolicy": "Always",
                     "resources": {"requests": {"memory": "64Mi"}}}
                ],
                "overhead": {"cpu": "100m"},
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "cm-vol"}},
                    {"name": "sec", "secret": {"secretName": "s-vol", "optional": true}},
                    {"name": "proj", "projected": {"sources": [{"configMap": {"name": "cm-proj"}}, {"secret": {"name": "s-proj"}}]}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "claim-1"}},
                    {"name": "scratch", "emptyDir": {}}
                ],
                "imagePullSecrets": [{"name": "pull"}],
                "tolerations": [{"key": "t", "operator": "Exists"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
            },
            "status": {"phase": phase, "podIP": "10.0.0.1", "hostIP": "10.1.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "a", "ready": true, "restartCount": 0, "image": "nginx", "imageID": ""}]}
        }))
        .unwrap()
    }

    fn trimmed(mut pod: Pod) -> Pod {
        lower_load(&mut pod);
        pod
    }

    #[test]
    fn the_load_and_references_of_a_lower_pod_survive_its_trim() {
        for (phase, node, ours) in [
            ("Running", "low-0", true),
            ("Pending", "low-1", false),
            ("Succeeded", "low-0", true),
            ("Failed", "", false),
        ] {
            let full = rich_pod(phase, node, ours);
            let small = trimmed(full.clone());
            assert_eq!(pod_requests(&small), pod_requests(&full), "{phase}");
            assert_eq!(is_terminal(&small), is_terminal(&full), "{phase}");
            assert_eq!(identity().owns(&small.metadata), identity().owns(&full.metadata));
            let refs = |p: &Pod| {
                crate::copies::references(p.spec.as_ref().unwrap(), |_| true)
                    .into_iter()
                    .map(|r| (r.kind, r.name, r.optional, r.via))
                    .collect::<Vec<_>>()
            };
            assert_eq!(refs(&small), refs(&full));
            assert_eq!(
                refs(&full).len(),
                10,
                "the fixture references every kind of source"
            );
            assert_eq!(crate::volumes::claims(&small), crate::volumes::claims(&full));
            assert_eq!(
                small.spec.as_ref().and_then(|s| s.node_name.clone()),
                full.spec.as_ref().and_then(|s| s.node_name.clone())
            );
        }
    }

    #[test]
    fn capacity_and_shape_agree_on_full_and_trimmed_objects() {
        let node = |name: &str, cordoned: bool| -> Node {
            serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "a", "kubernetes.io/os": "linux"},
                    "annotations": {"a": "b"},
                    "managedFields": [{"manager": "kubelet", "operation": "Update"}]},
                "spec": {"unschedulable": cordoned, "podCIDR": "10.0.0.0/24",
                    "taints": [{"key": "gpu", "effect": "NoSchedule"}]},
                "status": {"allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"},
                    "capacity": {"cpu": "4", "memory": "8Gi", "pods": "110"},
                    "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2024-01-01T00:00:00Z"}],
                    "images": [{"names": ["nginx"], "sizeBytes": 1}],
                    "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                        "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "",
                        "operatingSystem": "linux", "architecture": "amd64"}}
            }))
            .unwrap()
        };
        let nodes = vec![node("low-0", false), node("low-1", false), node("low-2", true)];
        let pods = vec![
            rich_pod("Running", "low-0", true),
            rich_pod("Running", "low-1", false),
            rich_pod("Pending", "low-0", false),
            rich_pod("Succeeded", "low-1", false),
        ];
        let small_nodes: Vec<Node> = nodes
            .iter()
            .cloned()
            .map(|mut n| {
                lower_node(&mut n);
                n
            })
            .collect();
        let small_pods: Vec<Pod> = pods.iter().cloned().map(trimmed).collect();
        let full = crate::capacity::compute(&nodes, &pods, &identity());
        let small = crate::capacity::compute(&small_nodes, &small_pods, &identity());
        assert_eq!(small, full);
        assert_eq!(full.usable_nodes, 2);
        let keys: Vec<String> = tensile_common::shape::DEFAULT_LABEL_KEYS.map(String::from).into();
        let at = jiff::Timestamp::UNIX_EPOCH;
        assert_eq!(
            tensile_common::shape::build(&small_nodes, &small_pods, &keys, 5, at),
            tensile_common::shape::build(&nodes, &pods, &keys, 5, at)
        );
    }

    #[test]
    fn a_trimmed_lower_pod_is_much_smaller() {
        let full = rich_pod("Running", "low-0", true);
        let size = |p: &Pod| serde_json::to_vec(p).unwrap().len();
        let small = trimmed(full.clone());
        assert!(small.metadata.managed_fields.is_none());
        assert!(
            size(&small) * 4 < size(&full),
            "{} vs {}",
            size(&small),
            size(&full)
        );
    }
}
