//! What a pod asks of a node, computed as the scheduler does.

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::quantity::ResourceMap;

fn requests(c: &Container) -> ResourceMap {
    c.resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .map(|r| ResourceMap::parse(r.iter().map(|(k, v)| (k, &v.0))).0)
        .unwrap_or_default()
}

/// A native sidecar: an init container with `restartPolicy: Always` (Kubernetes 1.28+,
/// on by default from 1.29). It starts in init order and then runs beside the containers.
pub fn is_sidecar(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

/// The pod's effective requests, as the scheduler computes them: the containers plus every
/// native sidecar, raised to what the init phase needs at its peak (each ordinary init
/// container beside the sidecars started before it, each sidecar beside those before it),
/// plus the pod overhead; `pods` is always 1. Without sidecars this is the sum over the
/// containers raised to the largest init container, as before 1.28.
pub fn pod_requests(pod: &Pod) -> ResourceMap {
    let Some(spec) = &pod.spec else {
        return ResourceMap::default();
    };
    let mut sidecars = ResourceMap::default();
    let mut init_peak = ResourceMap::default();
    for c in spec.init_containers.iter().flatten() {
        if is_sidecar(c) {
            sidecars.add(&requests(c));
            init_peak.max_with(&sidecars);
        } else {
            let mut during = requests(c);
            during.add(&sidecars);
            init_peak.max_with(&during);
        }
    }
    let mut total = sidecars;
    for c in &spec.containers {
        total.add(&requests(c));
    }
    total.max_with(&init_peak);
    if let Some(overhead) = &spec.overhead {
        total.add(&ResourceMap::parse(overhead.iter().map(|(k, v)| (k, &v.0))).0);
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
