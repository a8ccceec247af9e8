//! What a pod asks of a node, computed as kube-scheduler computes it (the `PodRequests` of
//! Kubernetes' resource helpers, as a 1.37 scheduler calls it for pods on a node).

use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;

use crate::quantity::ResourceMap;

fn parse(list: &BTreeMap<String, Quantity>) -> ResourceMap {
    ResourceMap::parse(list.iter().map(|(k, v)| (k, &v.0))).0
}

/// Requests with each limit that has no request standing in for it, as the apiserver
/// defaults a pod's containers before it stores them.
fn requests_or_limits(r: Option<&ResourceRequirements>) -> ResourceMap {
    let Some(r) = r else {
        return ResourceMap::default();
    };
    let mut out = r.requests.as_ref().map(parse).unwrap_or_default();
    for (k, v) in r.limits.as_ref().map(parse).unwrap_or_default().0 {
        out.0.entry(k).or_insert(v);
    }
    out
}

/// A native sidecar: an init container with `restartPolicy: Always` (Kubernetes 1.28+,
/// on by default from 1.29). It starts in init order and then runs beside the containers.
pub fn is_sidecar(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

/// A resource the pod level (`spec.resources`) can set: cpu, memory and hugepages.
fn pod_level(name: &str) -> bool {
    matches!(name, "cpu" | "memory") || name.starts_with("hugepages-")
}

/// Which requests of a container a sum takes while an in-place resize is under way.
#[derive(Clone, Copy)]
enum Side {
    /// What the spec asks for now.
    Spec,
    /// What the kubelet admitted (`allocatedResources` of the container's status).
    Allocated,
    /// What the container runs with (`resources.requests` of its status).
    Actuated,
}

/// The requests of `c` on one side of a resize. Without a status the spec stands in, except
/// for a resize the kubelet found infeasible: then only what the status shows counts.
fn container_requests(
    c: &Container,
    status: Option<&ContainerStatus>,
    side: Side,
    infeasible: bool,
) -> ResourceMap {
    let allocated = status.and_then(|s| s.allocated_resources.as_ref());
    let actuated = status
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref());
    let shown = match side {
        Side::Spec => None,
        Side::Allocated => allocated,
        Side::Actuated => actuated.or(allocated),
    };
    match (side, shown) {
        (Side::Spec, _) => requests_or_limits(c.resources.as_ref()),
        (_, Some(list)) => parse(list),
        (_, None) if infeasible => ResourceMap::default(),
        (_, None) => requests_or_limits(c.resources.as_ref()),
    }
}

/// The containers' requests on one side: the containers plus every native sidecar, raised
/// to what the init phase needs at its peak (each ordinary init container beside the
/// sidecars started before it, each sidecar beside those before it). Without sidecars this
/// is the sum over the containers raised to the largest init container, as before 1.28.
fn aggregate(pod: &Pod, side: Side, infeasible: bool) -> ResourceMap {
    let Some(spec) = &pod.spec else {
        return ResourceMap::default();
    };
    let status = pod.status.as_ref();
    let status_of = |name: &str| {
        let mut all = status
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .chain(
                status
                    .and_then(|s| s.init_container_statuses.as_ref())
                    .into_iter()
                    .flatten(),
            );
        all.find(|s| s.name == name)
    };
    let requests = |c: &Container| container_requests(c, status_of(&c.name), side, infeasible);
    let mut total = ResourceMap::default();
    for c in &spec.containers {
        total.add(&requests(c));
    }
    let mut sidecars = ResourceMap::default();
    let mut init_peak = ResourceMap::default();
    for c in spec.init_containers.iter().flatten() {
        let own = requests(c);
        if is_sidecar(c) {
            total.add(&own);
            sidecars.add(&own);
            init_peak.max_with(&sidecars);
        } else {
            let mut during = own;
            during.add(&sidecars);
            init_peak.max_with(&during);
        }
    }
    total.max_with(&init_peak);
    total
}

/// True when the kubelet declared the pod's pending resize infeasible (condition
/// `PodResizePending` with reason `Infeasible`, Kubernetes 1.33+).
fn resize_infeasible(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodResizePending"))
        .is_some_and(|c| c.reason.as_deref() == Some("Infeasible"))
}

/// The pod-level requests (`spec.resources`, KEP-2837) of cpu, memory and hugepages, with
/// the apiserver's defaults for a pod-level limit without a request: the containers'
/// aggregate where they request that resource (cpu and memory), otherwise the limit.
/// Empty when the pod level sets none of them.
fn pod_level_requests(pod: &Pod, containers: &ResourceMap) -> ResourceMap {
    let Some(r) = pod.spec.as_ref().and_then(|s| s.resources.as_ref()) else {
        return ResourceMap::default();
    };
    let mut out = r.requests.as_ref().map(parse).unwrap_or_default();
    for (k, limit) in r.limits.as_ref().map(parse).unwrap_or_default().0 {
        let from_containers = containers
            .0
            .get(&k)
            .filter(|_| !k.starts_with("hugepages-"))
            .copied();
        out.0.entry(k).or_insert(from_containers.unwrap_or(limit));
    }
    out.0.retain(|k, _| pod_level(k));
    out
}

/// The pod's effective requests, as kube-scheduler charges a pod on a node:
///
/// * the containers' aggregate ([`aggregate`]) of the requests each container asks for, or,
///   while an in-place resize is under way (KEP-1287), per resource the largest of the
///   aggregates of the spec, of what the kubelet allocated and of what runs (only the last
///   two when the resize is infeasible);
/// * each resource the pod level requests (cpu, memory, hugepages) replaces the containers'
///   aggregate of it (KEP-2837, Kubernetes 1.34+ by default);
/// * plus the pod overhead; `pods` is always 1.
///
/// A container's limit without a request counts as its request, as the apiserver defaults.
/// For a pod not yet running this is what its spec asks for. A pod-level resize
/// (InPlacePodLevelResourcesVerticalScaling, beta and on from 1.36) is counted as a
/// container's: once the kubelet reports the pod level's status (`status.resources`, 1.35+),
/// per resource the largest of the pod level's spec (left out when the resize is
/// infeasible), what runs (`status.resources.requests`) and what is allocated
/// (`status.allocatedResources`).
pub fn pod_requests(pod: &Pod) -> ResourceMap {
    let Some(spec) = &pod.spec else {
        return ResourceMap::default();
    };
    let infeasible = resize_infeasible(pod);
    let asked = aggregate(pod, Side::Spec, false);
    let mut total = aggregate(pod, Side::Allocated, infeasible);
    total.max_with(&aggregate(pod, Side::Actuated, infeasible));
    if !infeasible {
        total.max_with(&asked);
    }
    let mut level = pod_level_requests(pod, &asked);
    let status = pod.status.as_ref();
    if !level.0.is_empty()
        && let Some(running) = status.and_then(|s| s.resources.as_ref())
    {
        let mut effective = running.requests.as_ref().map(parse).unwrap_or_default();
        if let Some(allocated) = status.and_then(|s| s.allocated_resources.as_ref()) {
            effective.max_with(&parse(allocated));
        }
        if !infeasible {
            effective.max_with(&level);
        }
        effective.0.retain(|k, _| pod_level(k));
        level = effective;
    }
    for (k, v) in level.0 {
        total.0.insert(k, v);
    }
    if let Some(overhead) = &spec.overhead {
        total.add(&parse(overhead));
    }
    total.0.insert("pods".into(), 1000);
    total
}

/// True for pods that no longer hold resources on their node.
pub fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded") | Some("Failed")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    const GI: i128 = (1 << 30) * 1000;
    const MI: i128 = (1 << 20) * 1000;

    #[test]
    fn pod_level_requests_alone_are_what_the_pod_asks() {
        let r = pod_requests(&pod(serde_json::json!({"spec": {
            "resources": {"requests": {"cpu": "1500m", "memory": "1Gi"}},
            "containers": [{"name": "app"}, {"name": "log"}],
        }})));
        assert_eq!((r.get("cpu"), r.get("memory"), r.get("pods")), (1500, GI, 1000));
    }

    #[test]
    fn pod_level_requests_replace_the_containers_only_for_cpu_memory_and_hugepages() {
        let r = pod_requests(&pod(serde_json::json!({"spec": {
            "resources": {"requests": {"cpu": "2", "hugepages-2Mi": "4Mi", "ephemeral-storage": "9Gi"}},
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "3", "memory": "2Gi",
                    "ephemeral-storage": "1Gi", "example.com/gpu": "1"}}},
                {"name": "b", "resources": {"requests": {"cpu": "100m", "hugepages-2Mi": "2Mi"}}},
            ],
        }})));
        // cpu and hugepages from the pod level, even below the containers' sum; memory, which
        // the pod level leaves out, from the containers; ephemeral-storage and extended
        // resources are never pod-level and stay the containers'.
        assert_eq!(r.get("cpu"), 2000);
        assert_eq!(r.get("hugepages-2Mi"), 4 * MI);
        assert_eq!(r.get("memory"), 2 * GI);
        assert_eq!(r.get("ephemeral-storage"), GI);
        assert_eq!(r.get("example.com/gpu"), 1000);
    }

    #[test]
    fn during_a_pod_level_resize_the_larger_of_spec_running_and_allocated_counts() {
        // Resized from 1 to 2 cpu and from 2Gi to 1Gi memory: the kubelet of 1.37 still runs
        // and allocates the old amounts.
        let resizing = |reason: &str| {
            pod(serde_json::json!({"spec": {
                "resources": {"requests": {"cpu": "2", "memory": "1Gi"}},
                "containers": [{"name": "a"}]},
                "status": {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                           "allocatedResources": {"cpu": "1", "memory": "2Gi"},
                           "conditions": [{"type": "PodResizePending", "status": "True", "reason": reason}]}}))
        };
        let r = pod_requests(&resizing("Deferred"));
        assert_eq!((r.get("cpu"), r.get("memory")), (2000, 2 * GI));
        // Infeasible: the spec is left out, what runs counts.
        let r = pod_requests(&resizing("Infeasible"));
        assert_eq!((r.get("cpu"), r.get("memory")), (1000, 2 * GI));
        // A kubelet without pod-level status (before 1.35): the spec alone.
        let mut old = resizing("Deferred");
        old.status = None;
        let r = pod_requests(&old);
        assert_eq!((r.get("cpu"), r.get("memory")), (2000, GI));
    }

    #[test]
    fn limits_without_requests_count_as_requests_as_the_apiserver_defaults() {
        // A container's limit stands in for its request.
        let r = pod_requests(&pod(serde_json::json!({"spec": {
            "containers": [{"name": "a", "resources": {"limits": {"cpu": "700m"}}}],
        }})));
        assert_eq!(r.get("cpu"), 700);
        // A pod-level limit without a request: the containers' requests where they ask for
        // the resource, the limit where none does.
        let r = pod_requests(&pod(serde_json::json!({"spec": {
            "resources": {"limits": {"cpu": "1", "memory": "128Mi"}},
            "containers": [{"name": "a", "resources": {"requests": {"memory": "64Mi"}}}],
        }})));
        assert_eq!((r.get("cpu"), r.get("memory")), (1000, 64 * MI));
    }

    #[test]
    fn pod_level_requests_hold_beside_sidecars_and_init_containers_and_overhead_is_added() {
        let r = pod_requests(&pod(serde_json::json!({"spec": {
            "resources": {"requests": {"cpu": "1"}},
            "containers": [{"name": "app", "resources": {"requests": {"cpu": "400m", "memory": "1Gi"}}}],
            "initContainers": [
                {"name": "mesh", "restartPolicy": "Always", "resources": {"requests": {"cpu": "300m", "memory": "256Mi"}}},
                {"name": "setup", "resources": {"requests": {"cpu": "3", "memory": "2Gi"}}},
            ],
            "overhead": {"cpu": "250m", "memory": "64Mi"},
        }})));
        // cpu: the pod level (1) plus the overhead, whatever the init phase needs; memory:
        // the init peak (setup beside mesh) plus the overhead.
        assert_eq!(r.get("cpu"), 1250);
        assert_eq!(r.get("memory"), 2 * GI + 256 * MI + 64 * MI);
    }

    /// A pod of two containers and a sidecar, `a` asking `spec_a` cpu with `allocated_a`
    /// allocated, and the pod's conditions.
    fn resizing(spec_a: &str, allocated_a: &str, conditions: serde_json::Value) -> Pod {
        pod(serde_json::json!({
            "spec": {
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": spec_a}}},
                    {"name": "b", "resources": {"requests": {"cpu": "1"}}},
                ],
                "initContainers": [{"name": "mesh", "restartPolicy": "Always",
                                    "resources": {"requests": {"cpu": "500m"}}}],
            },
            "status": {
                "conditions": conditions,
                "containerStatuses": [
                    {"name": "a", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                     "allocatedResources": {"cpu": allocated_a},
                     "resources": {"requests": {"cpu": allocated_a}}},
                    {"name": "b", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                     "allocatedResources": {"cpu": "1"}},
                ],
                "initContainerStatuses": [
                    {"name": "mesh", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                     "allocatedResources": {"cpu": "800m"}},
                ],
            },
        }))
    }

    #[test]
    fn during_a_resize_the_larger_of_spec_and_allocated_counts_and_an_infeasible_one_counts_what_runs() {
        let pending = |reason: &str| serde_json::json!([{"type": "PodResizePending", "status": "True", "reason": reason}]);
        // Resized up, not yet allocated: the spec's sum (2 + 1 + 500m) is the larger.
        assert_eq!(
            pod_requests(&resizing("2", "1", serde_json::json!([]))).get("cpu"),
            3500
        );
        assert_eq!(
            pod_requests(&resizing("2", "1", pending("Deferred"))).get("cpu"),
            3500
        );
        // Resized down, still running with more: the allocated sum (1 + 1 + the sidecar's
        // 800m, above its spec of 500m).
        assert_eq!(
            pod_requests(&resizing("500m", "1", serde_json::json!([]))).get("cpu"),
            2800
        );
        // A resize the kubelet cannot do never runs: what is allocated and running counts.
        assert_eq!(
            pod_requests(&resizing("4", "1", pending("Infeasible"))).get("cpu"),
            2800
        );
        // The larger is taken of the sums, not per container (as a 1.33 scheduler did): `a`
        // up by 1 and `b` down by 1 charge the allocated sum 1 + 2 + 800m, not 2 + 2 + 800m.
        let mut swapped = resizing("2", "1", serde_json::json!([]));
        let status = swapped.status.as_mut().unwrap();
        status.container_statuses.as_mut().unwrap()[1].allocated_resources =
            Some([("cpu".to_owned(), Quantity("2".into()))].into());
        assert_eq!(pod_requests(&swapped).get("cpu"), 3800);
        // Without a status (a pod not yet running) the spec alone counts.
        let mut fresh = resizing("2", "1", serde_json::json!([]));
        fresh.status = None;
        assert_eq!(pod_requests(&fresh).get("cpu"), 3500);
    }

    #[test]
    fn effective_requests_follow_the_scheduler() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "spec": {
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "250m"}}},
                ],
                "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}],
                "overhead": {"cpu": "100m"},
            }
        }))
        .unwrap();
        let r = pod_requests(&pod);
        assert_eq!(r.get("cpu"), 2100);
        assert_eq!(r.get("memory"), (1i128 << 30) * 1000);
        assert_eq!(r.get("pods"), 1000);
    }

    #[test]
    fn native_sidecars_are_added_to_the_containers_and_counted_in_the_init_phase() {
        // As 1.29+ writes such a pod: a sidecar (restartPolicy Always) between two ordinary
        // init containers.
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "spec": {
                "containers": [{"name": "app", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
                "initContainers": [
                    {"name": "setup", "resources": {"requests": {"cpu": "1500m"}}},
                    {"name": "mesh", "restartPolicy": "Always",
                     "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}},
                    {"name": "migrate", "resources": {"requests": {"cpu": "1200m", "memory": "2Gi"}}},
                ],
            }
        }))
        .unwrap();
        let r = pod_requests(&pod);
        // Running: app + mesh = 1.5 cpu; init peak: migrate beside mesh = 1.7 cpu.
        assert_eq!(r.get("cpu"), 1700);
        // Running: 1Gi + 256Mi; init peak: 2Gi + 256Mi.
        assert_eq!(r.get("memory"), ((2i128 << 30) + (256i128 << 20)) * 1000);
        // Without the sidecar's restartPolicy it is an ordinary init container: max, not sum.
        let mut plain = pod.clone();
        plain.spec.as_mut().unwrap().init_containers.as_mut().unwrap()[1].restart_policy = None;
        assert_eq!(pod_requests(&plain).get("cpu"), 1500);
        // A sidecar alone adds to the containers.
        let sidecar_only: Pod = serde_json::from_value(serde_json::json!({
            "spec": {
                "containers": [{"name": "app", "resources": {"requests": {"cpu": "1"}}}],
                "initContainers": [{"name": "mesh", "restartPolicy": "Always",
                                    "resources": {"requests": {"cpu": "500m"}}}],
            }
        }))
        .unwrap();
        assert_eq!(pod_requests(&sidecar_only).get("cpu"), 1500);
    }
}
