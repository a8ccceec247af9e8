//! What each watch cache keeps of an object: only what some decision reads, so memory grows
//! with what the virtual node needs, not with what the apiservers send.
//!
//! No cache keeps `metadata.managedFields` ([`tensile_common::cache`]). The upper pods of this
//! node are otherwise kept whole, since the pod controller translates them, but packed, with
//! what the passes over every pod read beside them ([`UpperPod`]). Its lower pods keep their
//! metadata and status and, of their spec, what an update follows ([`lower_pod`]), packed too. The
//! cache of every unfinished lower pod (the load on the lower nodes, other
//! tenants' pods included) keeps a [`PodLoad`] of each: what capacity, the capacity shape,
//! copy collection and claim collection read, computed once when the pod arrives. The lower
//! node cache keeps a [`lower_node`]: what capacity and the shape read.
//!
//! A `Pod` is the wrong container for a summary: its Rust form is over 2 KiB before any
//! content, a container 2 KiB and a volume 3 KiB, so even an emptied pod costs kilobytes.
//!
//! The unit tests below hold the decisions to that: each is computed on the full objects and
//! on what the caches keep, and must agree.

use k8s_openapi::api::core::v1::{Container, Node, NodeSpec, NodeStatus, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tensile_common::cache::Packed;
use tensile_common::names;
use tensile_common::quantity::ResourceMap;
use tensile_common::resources::{is_terminal, pod_requests};

use crate::model::refs::{self, Kind};

/// What a lower pod puts on its node and which objects it needs below: what the cache of
/// every unfinished lower pod keeps of each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodLoad {
    /// Name, namespace, uid, deletion mark, and of the labels only this suite's marks.
    pub metadata: ObjectMeta,
    /// The lower node it is bound to.
    pub node: Option<String>,
    /// Its effective requests, as the scheduler counts them ([`pod_requests`]).
    pub requests: ResourceMap,
    /// Finished (Succeeded or Failed): it holds nothing on its node.
    pub terminal: bool,
    /// The ConfigMaps and Secrets its upper pod referenced ([`names::LOWER_POD_REFERENCES`]);
    /// for a lower pod without that record, what its spec names.
    pub references: Vec<(Kind, String)>,
    /// The claims it mounts.
    pub claims: Vec<String>,
}

impl PodLoad {
    pub fn of(pod: &Pod) -> Self {
        // What its upper pod referenced, as recorded at create; a lower pod made before the
        // record existed counts what its spec names.
        let recorded = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::LOWER_POD_REFERENCES))
            .map(|text| refs::decode_references(text));
        let (references, claims) = match &pod.spec {
            Some(spec) => (
                recorded.unwrap_or_else(|| {
                    refs::references(spec, None)
                        .into_iter()
                        .map(|r| (r.kind, r.name))
                        .collect()
                }),
                refs::claims(pod),
            ),
            None => Default::default(),
        };
        let meta = &pod.metadata;
        let labels = meta.labels.as_ref().map(|labels| {
            labels
                .iter()
                .filter(|(k, _)| *k == names::MARK_CLUSTER || *k == names::MARK_NODE)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<std::collections::BTreeMap<_, _>>()
        });
        PodLoad {
            metadata: ObjectMeta {
                name: meta.name.clone(),
                namespace: meta.namespace.clone(),
                uid: meta.uid.clone(),
                labels: labels.filter(|l| !l.is_empty()),
                deletion_timestamp: meta.deletion_timestamp.clone(),
                ..Default::default()
            },
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            requests: pod_requests(pod),
            terminal: is_terminal(pod),
            references,
            claims,
        }
    }
}

tensile_common::kept_as!(PodLoad, Pod, metadata);

/// A lower pod of this node as the pod controller reads it: its metadata and status, and of
/// its spec what an update follows below (each container's and init container's image and
/// resources, the pod-level resources, `activeDeadlineSeconds`, tolerations) and the node it
/// runs on. Volumes, environment, probes, affinity and the rest were decided when the pod was
/// created and are not read.
pub fn lower_pod(pod: &mut Pod) {
    let images = |containers: Vec<Container>| -> Vec<Container> {
        containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                image: c.image,
                resources: c.resources,
                ..Default::default()
            })
            .collect()
    };
    pod.spec = pod.spec.take().map(|s| PodSpec {
        containers: images(s.containers),
        init_containers: s.init_containers.map(images),
        resources: s.resources,
        active_deadline_seconds: s.active_deadline_seconds,
        tolerations: s.tolerations,
        node_name: s.node_name,
        ..Default::default()
    });
}

/// A lower pod of this node as its cache keeps it: [`lower_pod`], packed ([`Packed`]).
pub type LowerPod = Packed<Pod>;

/// What the cache of this node's lower pods makes of each.
pub fn packed_lower_pod(mut pod: Pod) -> LowerPod {
    lower_pod(&mut pod);
    Packed::pack(pod)
}

/// An upper pod bound to this node as its cache keeps it: the whole pod, packed (the pod
/// controller reads one at a time and translates all of it), and beside it what the passes
/// over every pod read (copy and claim collection, the kubelet API's lookups), computed once
/// when the pod arrives.
#[derive(Clone, Debug)]
pub struct UpperPod {
    pub packed: Packed<Pod>,
    /// The node it is bound to.
    pub node: Option<String>,
    /// Finished (Succeeded or Failed).
    pub terminal: bool,
    /// The ConfigMaps and Secrets it references, its own service-account token aside.
    pub references: Vec<(Kind, String)>,
    /// The claims it mounts.
    pub claims: Vec<String>,
}

impl UpperPod {
    pub fn of(pod: Pod) -> Self {
        let references = refs::upper_references(&pod)
            .into_iter()
            .map(|r| (r.kind, r.name))
            .collect();
        UpperPod {
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            terminal: is_terminal(&pod),
            references,
            claims: refs::claims(&pod),
            packed: Packed::pack(pod),
        }
    }

    /// The whole pod.
    pub fn pod(&self) -> Result<Pod, serde_json::Error> {
        self.packed.unpack()
    }
}

tensile_common::kept_as!(UpperPod, Pod, packed.metadata);

/// The pod controller's bound asks every kind it runs on to be readable; an upper pod is
/// read as a pod (without `managedFields`), then kept as [`UpperPod::of`] keeps it.
impl<'de> serde::Deserialize<'de> for UpperPod {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        tensile_common::cache::LeanPod::deserialize(deserializer).map(|pod| UpperPod::of(pod.0))
    }
}

/// A lower node as capacity and the capacity shape read it: name, labels, cordon, taints,
/// allocatable, conditions and declared features (no images, addresses, volumes or system
/// information).
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
        declared_features: s.declared_features,
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
    use serde_json::json;
    use tensile_common::lower::identity::Identity;

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

    #[test]
    fn a_lower_pods_load_holds_what_its_decisions_read_of_it() {
        for (phase, node, ours) in [
            ("Running", "low-0", true),
            ("Pending", "low-1", false),
            ("Succeeded", "low-0", true),
            ("Failed", "", false),
        ] {
            let full = rich_pod(phase, node, ours);
            let load = PodLoad::of(&full);
            assert_eq!(load.requests, pod_requests(&full), "{phase}");
            assert_eq!(load.terminal, is_terminal(&full), "{phase}");
            assert_eq!(identity().owns(&load.metadata), identity().owns(&full.metadata));
            assert_eq!(identity().owns(&load.metadata), ours);
            let refs: Vec<(Kind, String)> = refs::references(full.spec.as_ref().unwrap(), None)
                .into_iter()
                .map(|r| (r.kind, r.name))
                .collect();
            assert_eq!(load.references, refs);
            assert_eq!(refs.len(), 10, "the fixture references every kind of source");
            assert_eq!(load.claims, refs::claims(&full));
            assert_eq!(load.claims, ["claim-1"]);
            assert_eq!(load.node, full.spec.as_ref().and_then(|s| s.node_name.clone()));
            assert_eq!(
                (load.metadata.name.as_deref(), load.metadata.namespace.as_deref()),
                (Some("p"), Some("ns"))
            );
            assert!(load.metadata.annotations.is_none() && load.metadata.managed_fields.is_none());
        }
    }

    #[test]
    fn a_lower_pods_load_counts_only_what_its_upper_pod_referenced() {
        // Lower admission injected an image pull secret and a CA ConfigMap no upper pod named.
        let mut full = rich_pod("Running", "low-0", true);
        let spec = full.spec.as_mut().unwrap();
        spec.image_pull_secrets = Some(vec![k8s_openapi::api::core::v1::LocalObjectReference {
            name: "injected-pull".into(),
        }]);
        full.metadata.annotations = Some(
            [(
                names::LOWER_POD_REFERENCES.to_owned(),
                "ConfigMap/cm-1,Secret/s-1".to_owned(),
            )]
            .into(),
        );
        let load = PodLoad::of(&full);
        assert_eq!(
            load.references,
            [
                (Kind::ConfigMap, "cm-1".to_owned()),
                (Kind::Secret, "s-1".to_owned())
            ]
        );
    }

    #[test]
    fn an_upper_pod_is_kept_whole_and_its_summary_holds_what_the_passes_read() {
        for phase in ["Running", "Succeeded"] {
            let full = rich_pod(phase, "vn", false);
            let kept = UpperPod::of(full.clone());
            let mut expected = full.clone();
            expected.metadata.managed_fields = None;
            assert_eq!(kept.pod().unwrap(), expected, "{phase}");
            assert_eq!(kept.terminal, is_terminal(&full), "{phase}");
            assert_eq!(kept.node.as_deref(), Some("vn"));
            let refs: Vec<(Kind, String)> = refs::upper_references(&full)
                .into_iter()
                .map(|r| (r.kind, r.name))
                .collect();
            assert_eq!(kept.references, refs);
            assert_eq!(refs.len(), 10, "the fixture references every kind of source");
            assert_eq!(kept.claims, ["claim-1"]);
            let read: UpperPod = serde_json::from_value(serde_json::to_value(&full).unwrap()).unwrap();
            assert_eq!(read.pod().unwrap(), expected);
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
        let pods = [
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
        let loads: Vec<PodLoad> = pods.iter().map(PodLoad::of).collect();
        let sums = crate::decide::capacity::NodeLoads::of(&loads, &identity());
        let full = crate::decide::capacity::compute(&nodes, &sums);
        let small = crate::decide::capacity::compute(&small_nodes, &sums);
        assert_eq!(small, full);
        assert_eq!(full.usable_nodes, 2);
        // One foreign unfinished pod on a usable node: 500m + 250m, raised to the init
        // container's 2 CPUs, plus 100m of overhead.
        assert_eq!(full.capacity.get("cpu") - full.allocatable.get("cpu"), 2 * 2100);
        let keys: Vec<String> = tensile_common::shape::DEFAULT_LABEL_KEYS.map(String::from).into();
        let at = jiff::Timestamp::UNIX_EPOCH;
        // The shape from whole objects, requests computed from each pod as it was sent.
        let whole: Vec<(String, ResourceMap)> = pods
            .iter()
            .filter(|p| !is_terminal(p))
            .map(|p| {
                (
                    p.spec.as_ref().unwrap().node_name.clone().unwrap(),
                    pod_requests(p),
                )
            })
            .collect();
        let kept = loads
            .iter()
            .filter(|l| !l.terminal)
            .map(|l| (l.node.as_deref().unwrap(), &l.requests));
        let summed = sums.all.iter().map(|(n, r)| (n.as_str(), r));
        let from_whole =
            tensile_common::shape::build(&nodes, whole.iter().map(|(n, r)| (n.as_str(), r)), &keys, 5, at);
        assert_eq!(
            tensile_common::shape::build(&small_nodes, kept, &keys, 5, at),
            from_whole
        );
        assert_eq!(
            tensile_common::shape::build(&small_nodes, summed, &keys, 5, at),
            from_whole,
            "charging each node its pods' sum is charging it each pod"
        );
    }

    #[test]
    fn the_pod_controller_decides_the_same_on_a_trimmed_lower_pod() {
        let t = crate::decide::translate::tests::translation();
        let upper: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1", "labels": {"app": "web"},
                "generation": 3,
                "annotations": {"note": "new",
                    "clusterSelector": r#"{"tolerations":[{"key":"gpu","operator":"Exists"}]}"#}},
            "spec": {"nodeName": "vn", "activeDeadlineSeconds": 60,
                "tolerations": [{"key": "a", "operator": "Exists"}],
                "containers": [{"name": "app", "image": "nginx:2", "env": [{"name": "X", "value": "1"}],
                    "resources": {"requests": {"cpu": "500m"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/d"}]}],
                "resources": {"limits": {"memory": "1Gi"}},
                "initContainers": [{"name": "init", "image": "busybox:2"}],
                "volumes": [{"name": "data", "emptyDir": {}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
        }))
        .unwrap();
        let desired = t.lower_pod(&upper).unwrap();
        // The lower pod as the lower apiserver returns it: made from an older upper pod
        // (images, deadline, tolerations, an annotation), defaulted and running.
        let mut actual = serde_json::to_value(&desired).unwrap();
        actual["metadata"]["uid"] = json!("l-1");
        actual["metadata"]["resourceVersion"] = json!("12");
        actual["metadata"]["annotations"]["note"] = json!("old");
        actual["metadata"]["managedFields"] =
            json!([{"manager": "tensile-virtual-node", "operation": "Update"}]);
        actual["spec"]["containers"][0]["image"] = json!("nginx:1");
        actual["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "250m"}});
        actual["spec"]["resources"] = json!({"limits": {"memory": "512Mi"}});
        actual["metadata"]["annotations"][names::UPPER_GENERATION] = json!("2");
        actual["spec"]["initContainers"][0]["image"] = json!("busybox:1");
        actual["spec"]["activeDeadlineSeconds"] = json!(null);
        actual["spec"]["nodeName"] = json!("low-0");
        actual["spec"]["tolerations"] = json!([{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
            "effect": "NoExecute", "tolerationSeconds": 300}]);
        actual["status"] = json!({"phase": "Running", "hostIP": "10.1.0.1", "podIP": "10.0.0.9",
            "startTime": "2024-01-01T00:00:00Z",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "app", "ready": true, "restartCount": 2, "image": "nginx:1",
                "imageID": "sha", "state": {"running": {"startedAt": "2024-01-01T00:00:01Z"}}}]});
        let full: Pod = serde_json::from_value(actual).unwrap();
        let mut small = full.clone();
        lower_pod(&mut small);
        assert!(small.spec.as_ref().unwrap().volumes.is_none());
        // The cache holds it packed: unpacked, it is the trimmed pod without managedFields.
        let unpacked = packed_lower_pod(full.clone()).unpack().unwrap();
        small.metadata.managed_fields = None;
        assert_eq!(unpacked, small);

        let patch = t.update_patch(&desired, &full);
        let p = patch
            .as_ref()
            .expect("the fixture differs in every followed field");
        for path in [
            "/metadata/annotations/note",
            "/spec/containers",
            "/spec/initContainers",
            "/spec/activeDeadlineSeconds",
            "/spec/tolerations",
        ] {
            assert!(p.pointer(path).is_some(), "{path} in {p}");
        }
        assert_eq!(t.update_patch(&desired, &small), patch);
        // A resize is due (generation 3 over the recorded 2) and reads the same resources.
        assert!(crate::decide::translate::resize_due(&upper, &small));
        let resize = crate::decide::translate::resize_patch(&desired, &full);
        assert!(resize.is_some(), "the fixture was resized");
        assert_eq!(crate::decide::translate::resize_patch(&desired, &small), resize);
        assert_eq!(
            crate::decide::translate::upper_status(
                &upper,
                &small,
                None,
                "10.1.0.1",
                jiff::Timestamp::UNIX_EPOCH,
                true
            ),
            crate::decide::translate::upper_status(
                &upper,
                &full,
                None,
                "10.1.0.1",
                jiff::Timestamp::UNIX_EPOCH,
                true
            )
        );
        let none = tensile_common::lower::overrides::Compiled::none();
        let view = crate::decide::pods::View {
            translation: &t,
            overrides: &none,
            run_daemonset_pods: false,
            warmed_up: true,
            cluster_name: "lower-a",
        };
        assert_eq!(
            crate::decide::pods::decide(&upper, Some(&small), &view),
            crate::decide::pods::decide(&upper, Some(&full), &view)
        );
        let mut deleted = upper.clone();
        deleted.metadata.deletion_timestamp = full.metadata.creation_timestamp.clone().or(Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        ));
        assert_eq!(
            crate::decide::pods::decide(&deleted, Some(&small), &view),
            crate::decide::pods::decide(&deleted, Some(&full), &view)
        );
    }
}
