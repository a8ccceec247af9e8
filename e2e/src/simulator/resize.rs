//! In-place pod resize (KEP-1287; beta and on in 1.33, GA in 1.35) and the pod-level resize
//! (beta and on from 1.36), as the kubelet of the cluster's version decides them.
//!
//! The kubelet keeps what it admitted of each container, and of the pod level, as the
//! pod's *allocation*; its status shows that (`allocatedResources`) beside what the
//! containers run with (`resources`). When the spec asks for other resources it decides:
//!
//! * **Infeasible**: never, whatever the other pods do. On 1.33, requests above the node's
//!   allocatable (cpu, memory); on every version, a Guaranteed pod's CPU on a node with the
//!   static CPU manager policy (on 1.33 any resize of such a pod).
//! * **Deferred**: not now. The kubelet's admission check against the room the node's other
//!   pods leave fails; from 1.34 this includes requests above the node's allocatable.
//! * otherwise the new requests are allocated, and the containers resized.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};
use tensile_common::quantity::{ResourceMap, format_milli};
use tensile_common::resources::{is_sidecar, pod_requests};

/// The resources of each container (regular and init) and of the pod level, by name.
#[derive(Clone, Debug, Default)]
pub(super) struct Allocation {
    containers: BTreeMap<String, ResourceRequirements>,
    pod: Option<ResourceRequirements>,
}

/// Requests and limits as exact numbers, for comparing two requirements.
fn numbers(r: Option<&ResourceRequirements>) -> (ResourceMap, ResourceMap) {
    let parse = |l: Option<&BTreeMap<String, Quantity>>| {
        ResourceMap::parse(l.into_iter().flatten().map(|(k, v)| (k, &v.0))).0
    };
    (
        parse(r.and_then(|r| r.requests.as_ref())),
        parse(r.and_then(|r| r.limits.as_ref())),
    )
}

fn same(a: Option<&ResourceRequirements>, b: Option<&ResourceRequirements>) -> bool {
    numbers(a) == numbers(b)
}

impl PartialEq for Allocation {
    fn eq(&self, other: &Self) -> bool {
        self.containers.len() == other.containers.len()
            && self
                .containers
                .iter()
                .all(|(name, r)| same(Some(r), other.containers.get(name)))
            && same(self.pod.as_ref(), other.pod.as_ref())
    }
}

impl Allocation {
    /// What `pod`'s spec asks for.
    pub(super) fn of(pod: &Pod) -> Self {
        let Some(spec) = &pod.spec else {
            return Self::default();
        };
        let containers = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .map(|c| (c.name.clone(), c.resources.clone().unwrap_or_default()))
            .collect();
        Self {
            containers,
            pod: spec.resources.clone(),
        }
    }

    /// Container `name`'s resources.
    pub(super) fn container(&self, name: &str) -> Option<&ResourceRequirements> {
        self.containers.get(name)
    }

    /// `pod` with these resources in its spec and no status: the pod as the kubelet counts it.
    pub(super) fn applied_to(&self, pod: &Pod) -> Pod {
        let mut view = pod.clone();
        view.status = None;
        if let Some(spec) = view.spec.as_mut() {
            for c in spec
                .containers
                .iter_mut()
                .chain(spec.init_containers.iter_mut().flatten())
            {
                if let Some(r) = self.containers.get(&c.name) {
                    c.resources = Some(r.clone());
                }
            }
            spec.resources = self.pod.clone();
        }
        view
    }

    /// The containers that restart to take this allocation over `before`: those whose
    /// `resizePolicy` says `RestartContainer` for a resource that changed.
    pub(super) fn restarts(&self, before: &Allocation, pod: &Pod) -> Vec<String> {
        let Some(spec) = &pod.spec else {
            return Vec::new();
        };
        let changed = |c: &Container, resource: &str| {
            let (req_a, lim_a) = numbers(self.containers.get(&c.name));
            let (req_b, lim_b) = numbers(before.containers.get(&c.name));
            req_a.0.get(resource) != req_b.0.get(resource) || lim_a.0.get(resource) != lim_b.0.get(resource)
        };
        spec.containers
            .iter()
            .filter(|c| {
                c.resize_policy
                    .iter()
                    .flatten()
                    .any(|p| p.restart_policy == "RestartContainer" && changed(c, &p.resource_name))
            })
            .map(|c| c.name.clone())
            .collect()
    }
}

/// What the kubelet makes of a resize.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Allocated: the containers are resized next.
    Allocate,
    /// `PodResizePending` with reason `Infeasible` or `Deferred`.
    Pending { reason: &'static str, message: String },
}

/// The node as the kubelet that decides a resize sees it.
pub(super) struct Node<'a> {
    /// The kubelet's minor version (1.`minor`).
    pub minor: u32,
    pub allocatable: &'a ResourceMap,
    pub static_cpu_manager: bool,
    /// The requests of the other pods the kubelet admitted on the node, and their number.
    pub used: &'a ResourceMap,
    pub pods: usize,
}

/// The kubelet's verdict on `desired` (the pod as its spec now asks) over `allocated`.
pub(super) fn decide(node: &Node<'_>, desired: &Pod, allocated: &Allocation) -> Verdict {
    let infeasible = |message: String| Verdict::Pending {
        reason: "Infeasible",
        message,
    };
    let wanted = Allocation::of(desired);
    if node.static_cpu_manager && guaranteed(desired) {
        if node.minor <= 33 {
            return infeasible(
                "Resize is infeasible for Guaranteed Pods alongside CPU Manager static policy".into(),
            );
        }
        let cpu_changes = wanted.containers.iter().any(|(name, r)| {
            numbers(Some(r)).0.get("cpu") != numbers(allocated.containers.get(name)).0.get("cpu")
        });
        if cpu_changes {
            return infeasible(
                r#"Resize is infeasible for Guaranteed Pods alongside CPU Manager policy "static""#.into(),
            );
        }
    }
    let requests = pod_requests(&wanted.applied_to(desired));
    if node.minor <= 33 {
        // A 1.33 kubelet weighs cpu and memory against the node's allocatable first, memory
        // named before cpu.
        for (name, unit) in [("memory", 1000), ("cpu", 1)] {
            let (asked, room) = (requests.get(name), node.allocatable.get(name));
            if asked > room {
                return infeasible(format!(
                    "Node didn't have enough capacity: {name}, requested: {}, capacity: {}",
                    asked / unit,
                    room / unit
                ));
            }
        }
    }
    match short(node, &requests) {
        Some(message) => Verdict::Pending {
            reason: "Deferred",
            message,
        },
        None => Verdict::Allocate,
    }
}

/// The first resource the node lacks for `requests` beside its other pods, in the order and
/// the words of the kubelet's admission check (the scheduler's `Fits`): pods, cpu (in
/// millicores), memory, ephemeral storage, then the others (in units).
fn short(node: &Node<'_>, requests: &ResourceMap) -> Option<String> {
    let pods = node.allocatable.get("pods") / 1000;
    if node.pods as i128 + 1 > pods {
        return Some(format!(
            "Node didn't have enough resource: pods, requested: 1, used: {}, capacity: {pods}",
            node.pods
        ));
    }
    let mut names: Vec<&str> = vec!["cpu", "memory", "ephemeral-storage"];
    names.extend(
        requests
            .0
            .keys()
            .map(String::as_str)
            .filter(|k| !matches!(*k, "cpu" | "memory" | "ephemeral-storage" | "pods")),
    );
    names.into_iter().find_map(|name| {
        let unit = if name == "cpu" { 1 } else { 1000 };
        let (asked, used, capacity) = (
            requests.get(name),
            node.used.get(name),
            node.allocatable.get(name),
        );
        (asked > 0 && asked > capacity - used).then(|| {
            format!(
                "Node didn't have enough resource: {name}, requested: {}, used: {}, capacity: {}",
                asked / unit,
                used / unit,
                capacity / unit
            )
        })
    })
}

/// Guaranteed QoS: every container (and init container) has cpu and memory limits and
/// requests equal to them (the apiserver defaults a missing request to its limit).
fn guaranteed(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .all(|c| {
            let (requests, limits) = numbers(c.resources.as_ref());
            ["cpu", "memory"].iter().all(|r| {
                limits.0.contains_key(*r) && requests.0.get(*r).is_none_or(|q| Some(q) == limits.0.get(*r))
            })
        })
}

/// The pod's requests as the pod-level status shows them (`PodRequests`, without `pods`).
pub(super) fn pod_level_requests(pod: &Pod) -> ResourceMap {
    let mut r = pod_requests(pod);
    r.0.remove("pods");
    r
}

/// The pod's limits as the pod-level status shows them (`PodLimits`): the pod level's for
/// cpu and memory where it sets them, otherwise the containers' and sidecars' summed, raised
/// to any init container's.
pub(super) fn pod_level_limits(pod: &Pod) -> ResourceMap {
    let Some(spec) = &pod.spec else {
        return ResourceMap::default();
    };
    let mut total = ResourceMap::default();
    let mut init_peak = ResourceMap::default();
    for c in &spec.containers {
        total.add(&numbers(c.resources.as_ref()).1);
    }
    for c in spec.init_containers.iter().flatten() {
        let limits = numbers(c.resources.as_ref()).1;
        if is_sidecar(c) {
            total.add(&limits);
        } else {
            init_peak.max_with(&limits);
        }
    }
    total.max_with(&init_peak);
    for (name, limit) in numbers(spec.resources.as_ref()).1.0 {
        if matches!(name.as_str(), "cpu" | "memory") {
            total.0.insert(name, limit);
        }
    }
    total
}

/// A sum of quantities written as the apiserver's canonical form writes it: cpu in cores or
/// millicores, whole multiples of 1024 with the largest binary suffix that divides them.
pub(super) fn quantities(map: &ResourceMap) -> Value {
    let text = |name: &str, milli: i128| {
        if name == "cpu" || milli % 1000 != 0 || milli == 0 {
            return format_milli(milli);
        }
        let mut value = milli / 1000;
        let mut suffix = "";
        for next in ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"] {
            if value % 1024 != 0 {
                break;
            }
            value /= 1024;
            suffix = next;
        }
        format!("{value}{suffix}")
    };
    Value::Object(
        map.0
            .iter()
            .map(|(k, v)| (k.clone(), json!(text(k, *v))))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn map(pairs: &[(&str, &str)]) -> ResourceMap {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ResourceMap::parse(owned.iter().map(|(k, v)| (k, v))).0
    }

    fn app(requests: Value, limits: Value) -> Pod {
        pod(json!({"spec": {"containers": [{"name": "app",
            "resources": {"requests": requests, "limits": limits}}]}}))
    }

    fn node<'a>(minor: u32, allocatable: &'a ResourceMap, used: &'a ResourceMap) -> Node<'a> {
        Node {
            minor,
            allocatable,
            static_cpu_manager: false,
            used,
            pods: 1,
        }
    }

    #[test]
    fn above_the_allocatable_is_infeasible_on_1_33_and_deferred_later() {
        let allocatable = map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]);
        let used = ResourceMap::default();
        let before = Allocation::of(&app(json!({"cpu": "500m"}), json!({})));
        let want = app(json!({"cpu": "3"}), json!({}));
        assert_eq!(
            decide(&node(33, &allocatable, &used), &want, &before),
            Verdict::Pending {
                reason: "Infeasible",
                message: "Node didn't have enough capacity: cpu, requested: 3000, capacity: 2000".into()
            }
        );
        assert_eq!(
            decide(&node(37, &allocatable, &used), &want, &before),
            Verdict::Pending {
                reason: "Deferred",
                message: "Node didn't have enough resource: cpu, requested: 3000, used: 0, capacity: 2000"
                    .into()
            }
        );
        // Memory is named first on 1.33, in bytes.
        let want = app(json!({"cpu": "3", "memory": "5Gi"}), json!({}));
        let Verdict::Pending { message, .. } = decide(&node(33, &allocatable, &used), &want, &before) else {
            panic!("fits")
        };
        assert_eq!(
            message,
            "Node didn't have enough capacity: memory, requested: 5368709120, capacity: 4294967296"
        );
    }

    #[test]
    fn above_the_room_other_pods_leave_is_deferred_and_within_it_allocated() {
        let allocatable = map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]);
        let used = map(&[("cpu", "1500m"), ("memory", "1Gi")]);
        let before = Allocation::of(&app(json!({"cpu": "200m"}), json!({})));
        for minor in [33, 37] {
            assert_eq!(
                decide(
                    &node(minor, &allocatable, &used),
                    &app(json!({"cpu": "1"}), json!({})),
                    &before
                ),
                Verdict::Pending {
                    reason: "Deferred",
                    message:
                        "Node didn't have enough resource: cpu, requested: 1000, used: 1500, capacity: 2000"
                            .into()
                }
            );
            assert_eq!(
                decide(
                    &node(minor, &allocatable, &used),
                    &app(json!({"cpu": "500m"}), json!({})),
                    &before
                ),
                Verdict::Allocate
            );
        }
        let full = map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "1")]);
        let Verdict::Pending { message, .. } = decide(
            &node(37, &full, &used),
            &app(json!({"cpu": "100m"}), json!({})),
            &before,
        ) else {
            panic!("fits")
        };
        assert_eq!(
            message,
            "Node didn't have enough resource: pods, requested: 1, used: 1, capacity: 1"
        );
    }

    #[test]
    fn the_static_cpu_manager_refuses_a_guaranteed_pods_cpu_resize() {
        let allocatable = map(&[("cpu", "8"), ("memory", "8Gi"), ("pods", "110")]);
        let used = ResourceMap::default();
        let mut n = node(37, &allocatable, &used);
        n.static_cpu_manager = true;
        let before = Allocation::of(&app(json!({}), json!({"cpu": "1", "memory": "1Gi"})));
        let cpu = app(json!({"cpu": "2"}), json!({"cpu": "2", "memory": "1Gi"}));
        let memory = app(json!({}), json!({"cpu": "1", "memory": "2Gi"}));
        assert_eq!(
            decide(&n, &cpu, &before),
            Verdict::Pending {
                reason: "Infeasible",
                message: r#"Resize is infeasible for Guaranteed Pods alongside CPU Manager policy "static""#
                    .into()
            }
        );
        assert_eq!(decide(&n, &memory, &before), Verdict::Allocate);
        n.minor = 33;
        for want in [&cpu, &memory] {
            assert_eq!(
                decide(&n, want, &before),
                Verdict::Pending {
                    reason: "Infeasible",
                    message: "Resize is infeasible for Guaranteed Pods alongside CPU Manager static policy"
                        .into()
                }
            );
        }
        // A Burstable pod is resized as on any node.
        let burstable = Allocation::of(&app(json!({"cpu": "1"}), json!({})));
        assert_eq!(
            decide(&n, &app(json!({"cpu": "2"}), json!({})), &burstable),
            Verdict::Allocate
        );
    }

    #[test]
    fn a_restart_follows_the_resize_policy_of_a_changed_resource() {
        let spec = |cpu: &str, memory: &str| {
            pod(json!({"spec": {"containers": [
                {"name": "app", "resizePolicy": [{"resourceName": "memory", "restartPolicy": "RestartContainer"}],
                 "resources": {"requests": {"cpu": cpu, "memory": memory}}},
                {"name": "log", "resources": {"requests": {"cpu": cpu, "memory": memory}}},
            ]}}))
        };
        let before = Allocation::of(&spec("100m", "64Mi"));
        let cpu = spec("0.2", "64Mi");
        assert!(Allocation::of(&cpu).restarts(&before, &cpu).is_empty());
        let memory = spec("100m", "128Mi");
        assert_eq!(Allocation::of(&memory).restarts(&before, &memory), ["app"]);
        // Quantities compare by value.
        assert!(Allocation::of(&spec("0.1", "65536Ki")) == before);
    }

    #[test]
    fn pod_level_totals_are_written_in_canonical_form() {
        let p = pod(json!({"spec": {
            "containers": [{"name": "app", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"},
                                                         "limits": {"cpu": "200m", "memory": "128Mi"}}}],
            "initContainers": [{"name": "proxy", "restartPolicy": "Always",
                                "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}}}],
        }}));
        assert_eq!(
            quantities(&pod_level_requests(&p)),
            json!({"cpu": "150m", "memory": "96Mi"})
        );
        assert_eq!(
            quantities(&pod_level_limits(&p)),
            json!({"cpu": "200m", "memory": "128Mi"})
        );
        let level = pod(json!({"spec": {
            "resources": {"requests": {"cpu": "300m"}, "limits": {"cpu": "1", "memory": "1536Mi"}},
            "containers": [{"name": "app"}],
        }}));
        assert_eq!(
            quantities(&pod_level_limits(&level)),
            json!({"cpu": "1", "memory": "1536Mi"})
        );
        assert_eq!(
            quantities(&map(&[("memory", "1G"), ("cpu", "2")])),
            json!({"cpu": "2", "memory": "1000000000"})
        );
    }
}
