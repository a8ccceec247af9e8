//! Deterministic resource usage of simulated nodes, so tests can check exact figures: every
//! running container uses 10m of CPU ([`CONTAINER_NANO_CORES`]) and 16 MiB of working set
//! ([`CONTAINER_BYTES`]), and has used 10m × its run time of CPU seconds; a node uses the sum
//! of its containers plus 50m and 256 MiB of its own.

use jiff::Timestamp;
use serde_json::{Value, json};
use tensile_virtual_node::serve::stats::Usage;

use super::Inner;

pub const CONTAINER_NANO_CORES: u64 = 10_000_000;
pub const CONTAINER_BYTES: u64 = 16 << 20;
pub const NODE_NANO_CORES: u64 = 50_000_000;
pub const NODE_BYTES: u64 = 256 << 20;

/// The kubelet Summary of `node` (of every simulated node when `None`).
pub(super) fn summary(inner: &Inner, node: Option<&str>) -> Value {
    let now = Timestamp::now();
    let time = now.to_string();
    let pods: Vec<k8s_openapi::api::core::v1::Pod> = inner
        .pods
        .read()
        .map(|p| p.values().cloned().collect())
        .unwrap_or_default();
    let mut total = Usage {
        nano_cores: NODE_NANO_CORES,
        core_nano_seconds: 0,
        working_set_bytes: NODE_BYTES,
    };
    let mut out = Vec::new();
    for pod in pods {
        let on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if node.is_some() && on != node {
            continue;
        }
        let mut pod_usage = Usage::default();
        let mut containers = Vec::new();
        for c in pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten())
        {
            let Some(started) = c
                .state
                .as_ref()
                .and_then(|s| s.running.as_ref())
                .and_then(|r| r.started_at.as_ref())
            else {
                continue;
            };
            let ran = now.duration_since(started.0).as_nanos().max(0) as u64;
            let usage = Usage {
                nano_cores: CONTAINER_NANO_CORES,
                core_nano_seconds: ran / 100,
                working_set_bytes: CONTAINER_BYTES,
            };
            pod_usage.nano_cores += usage.nano_cores;
            pod_usage.core_nano_seconds += usage.core_nano_seconds;
            pod_usage.working_set_bytes += usage.working_set_bytes;
            let (cpu, memory) = usage.fields(&time);
            containers.push(
                json!({"name": c.name, "startTime": started.0.to_string(), "cpu": cpu, "memory": memory}),
            );
        }
        if containers.is_empty() {
            continue;
        }
        total.nano_cores += pod_usage.nano_cores;
        total.core_nano_seconds += pod_usage.core_nano_seconds;
        total.working_set_bytes += pod_usage.working_set_bytes;
        let (cpu, memory) = pod_usage.fields(&time);
        out.push(json!({
            "podRef": {"name": pod.metadata.name, "namespace": pod.metadata.namespace, "uid": pod.metadata.uid},
            "containers": containers, "cpu": cpu, "memory": memory,
        }));
    }
    let (cpu, memory) = total.fields(&time);
    json!({"node": {"nodeName": node.unwrap_or("simulated"), "cpu": cpu, "memory": memory}, "pods": out})
}
