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

/// The pod's effective requests: the sum over its containers, raised to the largest init
/// container's request per resource, plus the pod overhead; `pods` is always 1.
pub fn pod_requests(pod: &Pod) -> ResourceMap {
    let Some(spec) = &pod.spec else {
        return ResourceMap::default();
    };
    let mut total = ResourceMap::default();
    for c in &spec.containers {
        total.add(&requests(c));
    }
    for c in spec.init_containers.iter().flatten() {
        total.max_with(&requests(c));
    }
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
}
