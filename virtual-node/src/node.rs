//! The virtual Node: registration, Lease, and a status that tells the truth about the lower
//! cluster (capacity from watched state, Ready from a real probe).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_common::cache::Cache;
use tensile_common::names;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::capacity::{self, Capacity};
use crate::metrics::Metrics;
use crate::translate::Identity;

/// Settings of the node loop.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub identity: Identity,
    pub node_ip: String,
    pub kubelet_port: u16,
    pub taint: bool,
    pub extra_labels: BTreeMap<String, String>,
    /// How often the lower cluster is probed (and the loop runs without changes).
    pub probe_period: Duration,
    /// A probe that takes longer failed.
    pub probe_timeout: Duration,
    /// Status is patched at least this often.
    pub status_period: Duration,
    pub lease_period: Duration,
}

impl NodeSettings {
    pub fn new(identity: Identity, node_ip: String, kubelet_port: u16) -> Self {
        Self {
            identity,
            node_ip,
            kubelet_port,
            taint: true,
            extra_labels: BTreeMap::new(),
            probe_period: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(4),
            status_period: Duration::from_secs(60),
            lease_period: Duration::from_secs(10),
        }
    }
}

/// The Ready verdict of one round. `probe`: whether the lower apiserver answered; `failures`:
/// failed probes in a row, this one included; `was_ready`: the previous verdict; and how many
/// usable lower nodes the caches show. One failed probe may be a blip; two in a row are an
/// outage.
fn judge(probe: Result<(), String>, failures: u32, was_ready: bool, usable_nodes: usize) -> Health {
    match probe {
        Ok(()) if usable_nodes == 0 => Health {
            ready: false,
            reason: "NoUsableLowerNodes",
            message: "the lower cluster has no Ready schedulable node".into(),
        },
        Ok(()) => Health {
            ready: true,
            reason: "LowerClusterReady",
            message: format!("the lower cluster answers and has {usable_nodes} usable node(s)"),
        },
        Err(e) => Health {
            ready: failures < 2 && was_ready,
            reason: "LowerClusterUnreachable",
            message: format!("the lower cluster's apiserver does not answer: {e}"),
        },
    }
}

/// Whether node status is written this round: it changed since the last write, or is due
/// (the status period passed), or someone else rewrote Ready upstream (the node lifecycle
/// controller, after missed heartbeats): the true status is then asserted again, as a
/// kubelet does.
fn status_due(
    last_sent: Option<&(Capacity, Health)>,
    now: (&Capacity, &Health),
    due: bool,
    upstream_ready: Option<bool>,
) -> bool {
    let Some((cap, health)) = last_sent else {
        return true;
    };
    due || cap != now.0 || health != now.1 || upstream_ready.is_some_and(|ready| ready != now.1.ready)
}

/// Readiness of the lower cluster as the Ready condition shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Health {
    ready: bool,
    reason: &'static str,
    message: String,
}

pub struct NodeLoop {
    /// The heartbeat's own client, built anew from `upper_source` after a failed heartbeat.
    pub upper: std::sync::Mutex<kube::Client>,
    pub upper_source: tensile_common::kubeconfig::ClientSource,
    pub lower: kube::Client,
    pub settings: NodeSettings,
    pub lower_nodes: Cache<Node>,
    pub lower_pods: Cache<Pod>,
    /// Woken when lower nodes or pods change.
    pub changed: Arc<Notify>,
    pub metrics: Arc<Metrics>,
    /// Watch of our own upper Node: when it vanishes, the node is registered again at once.
    pub upper_node: Cache<Node>,
}

use tensile_common::api::now;

impl NodeLoop {
    fn name(&self) -> &str {
        &self.settings.identity.node
    }

    fn upper(&self) -> kube::Client {
        match self.upper.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After a heartbeat failed without an answer from the apiserver: a fresh client, so the
    /// next heartbeat does not wait on another dead pooled connection.
    fn reconnect_after(&self, e: &kube::Error) {
        if matches!(e, kube::Error::Api(_)) {
            return;
        }
        match self.upper_source.client() {
            Ok(fresh) => {
                if let Ok(mut c) = self.upper.lock() {
                    *c = fresh;
                }
            }
            Err(e) => tracing::warn!(node = self.name(), "a fresh upper client: {e}"),
        }
    }

    async fn probe(&self) -> Result<String, String> {
        let req = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(self.settings.probe_timeout, self.lower.request_text(req)).await {
            Err(_) => Err(format!(
                "no answer within {} s",
                self.settings.probe_timeout.as_secs()
            )),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(body)) if body.trim() == "ok" => {
                let version =
                    tokio::time::timeout(self.settings.probe_timeout, self.lower.apiserver_version())
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .map(|v| v.git_version)
                        .unwrap_or_default();
                Ok(version)
            }
            Ok(Ok(body)) => Err(format!("readyz says {}", body.trim())),
        }
    }

    /// Whether the upper Node's Ready condition says True, as the watch last saw it.
    fn upstream_ready(&self) -> Option<bool> {
        let node = self
            .upper_node
            .get(&kube::runtime::reflector::ObjectRef::new(self.name()))?;
        let ready = node
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .find(|c| c.type_ == "Ready")?;
        Some(ready.status == "True")
    }

    fn capacity(&self) -> Capacity {
        let nodes = self.lower_nodes.state();
        let pods = self.lower_pods.state();
        capacity::compute(
            nodes.iter().map(|n| n.as_ref()),
            pods.iter().map(|p| p.as_ref()),
            &self.settings.identity,
        )
    }

    fn labels(&self, cap: &Capacity) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([
            (
                names::VIRTUAL_NODE_TYPE_LABEL.to_owned(),
                names::VIRTUAL_NODE_TYPE_VALUE.to_owned(),
            ),
            (
                "kubernetes.io/role".to_owned(),
                names::VIRTUAL_NODE_ROLE.to_owned(),
            ),
            ("kubernetes.io/hostname".to_owned(), self.name().to_owned()),
            (
                "kubernetes.io/os".to_owned(),
                cap.os.clone().unwrap_or_else(|| "linux".into()),
            ),
            (
                "kubernetes.io/arch".to_owned(),
                cap.arch.clone().unwrap_or_else(|| "amd64".into()),
            ),
        ]);
        labels.extend(self.settings.extra_labels.clone());
        labels
    }

    async fn create_node(&self, cap: &Capacity) -> Result<(), kube::Error> {
        let taints: Vec<Value> = if self.settings.taint {
            vec![
                json!({"key": names::VIRTUAL_NODE_TAINT, "value": names::VIRTUAL_NODE_TAINT_VALUE, "effect": "NoSchedule"}),
            ]
        } else {
            vec![]
        };
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": self.name(), "labels": self.labels(cap)},
            "spec": {"taints": taints},
        }))
        .map_err(kube::Error::SerdeError)?;
        let api: Api<Node> = Api::all(self.upper());
        match api.create(&PostParams::default(), &node).await {
            Ok(_) => {
                tracing::info!(node = self.name(), "registered the virtual node");
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn status_body(
        &self,
        cap: &Capacity,
        health: &Health,
        ready_since: &str,
        started: &str,
        version: &str,
    ) -> Value {
        let now = now();
        let cond = |kind: &str, status: &str, reason: &str, message: &str, since: &str| {
            json!({"type": kind, "status": status, "reason": reason, "message": message,
                   "lastHeartbeatTime": now, "lastTransitionTime": since})
        };
        json!({"status": {
            "capacity": cap.capacity.to_strings(),
            "allocatable": cap.allocatable.to_strings(),
            "conditions": [
                cond("Ready", if health.ready { "True" } else { "False" }, health.reason, &health.message, ready_since),
                cond("MemoryPressure", "False", "LowerClusterHasNoPressure", "memory pressure is handled by the lower cluster", started),
                cond("DiskPressure", "False", "LowerClusterHasNoPressure", "disk pressure is handled by the lower cluster", started),
                cond("PIDPressure", "False", "LowerClusterHasNoPressure", "PID pressure is handled by the lower cluster", started),
            ],
            "addresses": [{"type": "InternalIP", "address": self.settings.node_ip}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.settings.kubelet_port}},
            "nodeInfo": {
                "machineID": self.settings.identity.cluster_id, "systemUUID": self.name(), "bootID": started,
                "kernelVersion": "", "osImage": "tensile virtual node",
                "containerRuntimeVersion": "tensile://lower-cluster", "kubeletVersion": version,
                "kubeProxyVersion": version,
                "operatingSystem": cap.os.clone().unwrap_or_else(|| "linux".into()),
                "architecture": cap.arch.clone().unwrap_or_else(|| "amd64".into()),
            },
        }})
    }

    async fn renew_lease(&self) -> Result<(), kube::Error> {
        let leases: Api<Lease> = Api::namespaced(self.upper(), "kube-node-lease");
        let micro = tensile_common::api::now_micro();
        let renew =
            json!({"spec": {"renewTime": micro, "holderIdentity": self.name(), "leaseDurationSeconds": 40}});
        match leases
            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&renew))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
        let node = Api::<Node>::all(self.upper()).get(self.name()).await?;
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {"name": self.name(), "namespace": "kube-node-lease",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name(),
                                              "uid": node.metadata.uid.unwrap_or_default()}]},
            "spec": {"holderIdentity": self.name(), "leaseDurationSeconds": 40, "renewTime": micro},
        }))
        .map_err(kube::Error::SerdeError)?;
        match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs forever: probe, recompute, patch status on change or when due, renew the lease,
    /// and recreate the Node if someone deleted it.
    pub async fn run(self, stop: tensile_common::runtime::CancellationToken) {
        let started = now();
        let mut ready_since = started.clone();
        let mut last_health: Option<Health> = None;
        let mut last_sent: Option<(Capacity, Health)> = None;
        let mut last_status = Instant::now();
        let mut last_lease: Option<Instant> = None;
        let mut version = String::new();
        let mut failures = 0u32;
        let mut registered = false;
        // Set once our Node shows in the watch; its absence afterwards means it was deleted.
        let mut seen_in_watch = false;
        loop {
            let probe = self.probe().await;
            match &probe {
                Ok(v) => {
                    failures = 0;
                    if !v.is_empty() {
                        version = v.clone();
                    }
                }
                Err(_) => failures += 1,
            }
            let was_ready = last_health.as_ref().is_some_and(|h| h.ready);
            let health = judge(probe.map(drop), failures, was_ready, self.capacity().usable_nodes);
            self.metrics.lower_ready.set(i64::from(health.ready));
            if last_health.as_ref().map(|h| h.ready) != Some(health.ready) {
                ready_since = now();
                tracing::info!(
                    node = self.name(),
                    ready = health.ready,
                    reason = health.reason,
                    "{}",
                    health.message
                );
            }
            last_health = Some(health.clone());
            // Someone deleted the Node: register it again now, not at the next status write.
            let present = self
                .upper_node
                .get(&kube::runtime::reflector::ObjectRef::new(self.name()))
                .is_some();
            if present {
                seen_in_watch = true;
            } else if registered && seen_in_watch {
                seen_in_watch = false;
                tracing::warn!(
                    node = self.name(),
                    "the Node object was deleted; registering it again"
                );
                registered = false;
                last_sent = None;
                last_lease = None;
            }
            let cap = self.capacity();
            if !registered {
                match self.create_node(&cap).await {
                    Ok(()) => {
                        registered = true;
                    }
                    Err(e) => tracing::warn!(node = self.name(), "registering the node failed: {e}"),
                }
            }
            let write = registered
                && status_due(
                    last_sent.as_ref(),
                    (&cap, &health),
                    last_status.elapsed() >= self.settings.status_period,
                    self.upstream_ready(),
                );
            if write {
                let nodes: Api<Node> = Api::all(self.upper());
                let body = self.status_body(&cap, &health, &ready_since, &started, &version);
                match nodes
                    .patch_status(self.name(), &PatchParams::default(), &Patch::Strategic(&body))
                    .await
                {
                    Ok(_) => {
                        last_status = Instant::now();
                        last_sent = Some((cap.clone(), health.clone()));
                        let shape = serde_json::to_string(&cap.shape).unwrap_or_default();
                        let meta = json!({"metadata": {"annotations": {names::NODE_CAPACITY_SHAPE: shape}}});
                        if let Err(e) = nodes
                            .patch(self.name(), &PatchParams::default(), &Patch::Merge(&meta))
                            .await
                        {
                            tracing::warn!(node = self.name(), "capacity shape annotation: {e}");
                        }
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        tracing::warn!(
                            node = self.name(),
                            "the Node object was deleted; registering it again"
                        );
                        registered = false;
                        last_sent = None;
                        last_lease = None;
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(node = self.name(), "node status: {e}");
                        self.reconnect_after(&e);
                    }
                }
            }
            if registered && last_lease.is_none_or(|t| t.elapsed() >= self.settings.lease_period) {
                match self.renew_lease().await {
                    Ok(()) => last_lease = Some(Instant::now()),
                    Err(e) => {
                        tracing::warn!(node = self.name(), "lease: {e}");
                        self.reconnect_after(&e);
                    }
                }
            }
            // Wake on lower changes (debounced) or after the probe period; stop between
            // rounds, never inside one.
            tokio::select! {
                _ = tokio::time::sleep(self.settings.probe_period) => {}
                _ = self.changed.notified() => tokio::time::sleep(Duration::from_millis(300)).await,
                _ = stop.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failed_probe_is_a_blip_and_two_in_a_row_are_an_outage() {
        let ready = judge(Ok(()), 0, false, 3);
        assert!(ready.ready);
        assert_eq!(ready.reason, "LowerClusterReady");
        let blip = judge(Err("timeout".into()), 1, true, 3);
        assert!(blip.ready, "one failure keeps a Ready node Ready");
        let outage = judge(Err("timeout".into()), 2, blip.ready, 3);
        assert!(!outage.ready);
        assert_eq!(outage.reason, "LowerClusterUnreachable");
        assert!(outage.message.contains("timeout"), "{}", outage.message);
        assert!(
            !judge(Err("refused".into()), 1, false, 3).ready,
            "a node not Ready stays so"
        );
    }

    #[test]
    fn a_lower_cluster_without_usable_nodes_is_not_ready_and_says_why() {
        let h = judge(Ok(()), 0, true, 0);
        assert!(!h.ready);
        assert_eq!(h.reason, "NoUsableLowerNodes");
    }

    #[test]
    fn status_is_written_first_on_change_when_due_and_when_ready_was_rewritten_upstream() {
        let cap = Capacity::default();
        let ready = judge(Ok(()), 0, false, 1);
        let sent = (cap.clone(), ready.clone());
        assert!(
            status_due(None, (&cap, &ready), false, None),
            "the first round writes"
        );
        assert!(
            !status_due(Some(&sent), (&cap, &ready), false, Some(true)),
            "nothing changed"
        );
        assert!(
            status_due(Some(&sent), (&cap, &ready), true, Some(true)),
            "the period passed"
        );
        let outage = judge(Err("x".into()), 2, true, 1);
        assert!(
            status_due(Some(&sent), (&cap, &outage), false, Some(true)),
            "health changed"
        );
        assert!(
            status_due(Some(&sent), (&cap, &ready), false, Some(false)),
            "the node lifecycle controller marked it not Ready: assert Ready again"
        );
        assert!(
            !status_due(Some(&sent), (&cap, &ready), false, None),
            "an unseen upstream node is no reason to write"
        );
    }
}
