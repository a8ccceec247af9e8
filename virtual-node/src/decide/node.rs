//! The virtual Node's judgements: what a heartbeat round does ([`Heartbeat::round`]: register,
//! write status, renew the Lease) from what it saw (the probe of the lower apiserver, the
//! capacity, the upper Node in the watch), remembering what was sent; the Ready and room
//! conditions; and the Node's metadata and resources patches.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};
use tensile_common::names;
use tokio::time::Instant;

use crate::decide::capacity::{Capacity, ShapePublisher};

/// The Ready verdict of one round. `probe`: whether the lower apiserver answered; `failures`:
/// failed probes in a row, this one included; `was_ready`: the previous verdict; and how many
/// usable lower nodes the caches show. One failed probe may be a blip; two in a row are an
/// outage. Ready says only whether the lower cluster answers: a lower cluster whose nodes are
/// all cordoned or not Ready still runs its pods, so it is shown as no room (capacity and
/// allocatable zero) and a condition that says why, never as NotReady, which would make the
/// upper node lifecycle controller evict every pod of the node.
/// Under a namespace scope (`quotas`) the count is of served namespaces with a quota.
fn judge(
    probe: Result<(), String>,
    failures: u32,
    was_ready: bool,
    usable_nodes: usize,
    quotas: bool,
) -> Health {
    let nodes_usable = usable_nodes > 0;
    let places = match quotas {
        true => "served namespace(s) with a ResourceQuota",
        false => "usable node(s)",
    };
    match probe {
        Ok(()) => Health {
            ready: true,
            reason: "LowerClusterReady",
            message: format!("the lower cluster answers and has {usable_nodes} {places}"),
            nodes_usable,
        },
        Err(e) => Health {
            ready: failures < 2 && was_ready,
            reason: "LowerClusterUnreachable",
            message: format!("the lower cluster's apiserver does not answer: {e}"),
            nodes_usable,
        },
    }
}

/// The `tensile.io/LowerNodesUsable` condition: status, reason, message. Under a namespace
/// scope it says where the room shown comes from, and which served namespaces bound none.
pub fn room_condition(cap: &Capacity, usable: bool) -> (&'static str, &'static str, String) {
    match (&cap.quotas, usable) {
        (None, true) => (
            "True",
            "UsableLowerNodes",
            "the lower cluster has a Ready schedulable node".into(),
        ),
        (None, false) => (
            "False",
            "NoUsableLowerNodes",
            "no lower node is Ready and schedulable (cordoned or not Ready): the node offers no room until one is; its pods keep running below".into(),
        ),
        (Some(unbounded), true) => {
            let mut message = "the room shown is what the served namespaces' ResourceQuotas leave".to_owned();
            if !unbounded.is_empty() {
                message.push_str(&format!(
                    "; {} bound(s) no cpu, memory or pods, which adds no room of it",
                    unbounded.join(", ")
                ));
            }
            ("True", "ServedNamespaceQuotas", message)
        }
        (Some(_), false) => (
            "False",
            "NoServedNamespaceQuota",
            "no served namespace has a ResourceQuota: the node offers no room until one has (hard: requests.cpu, requests.memory, pods)".into(),
        ),
    }
}

/// [`room_condition`] as a round shows it (usable when some place counted).
#[cfg(test)]
pub(crate) fn room_condition_for_tests(cap: &Capacity) -> (&'static str, &'static str, String) {
    room_condition(cap, cap.usable_nodes > 0)
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
pub struct Health {
    pub ready: bool,
    pub reason: &'static str,
    pub message: String,
    /// Some lower node is Ready and schedulable (the `tensile.io/LowerNodesUsable` condition).
    pub nodes_usable: bool,
}

/// What one round of the node loop sees.
pub struct Observed {
    /// Whether the lower apiserver answered.
    pub probe: Result<(), String>,
    pub capacity: Capacity,
    /// Whether the watch of the upper Node shows it.
    pub in_watch: bool,
    /// Ready as the upper Node shows it, when seen.
    pub upstream_ready: Option<bool>,
    pub now: Instant,
}

/// The node loop's periods, as its decisions read them.
pub struct Periods {
    pub probe: Duration,
    pub status: Duration,
    pub lease: Duration,
}

/// What one round of the node loop does, in order; registration, status and lease writes
/// happen only while the node is registered.
#[derive(Debug, PartialEq)]
pub struct Round {
    pub health: Health,
    /// Ready flipped this round (logged, and the transition time moves).
    pub ready_changed: bool,
    /// The Node was seen and is gone: someone deleted it.
    pub deleted_upstream: bool,
    pub register: bool,
    pub write_status: bool,
    pub renew_lease: bool,
}

/// The node loop's memory between rounds and its decisions, apart from the API calls: the
/// loop tells it what it saw and what its writes did.
#[derive(Default)]
pub struct Heartbeat {
    pub failures: u32,
    /// When the current run of failed probes began.
    pub failing_since: Option<Instant>,
    pub last_health: Option<Health>,
    /// What the last status write sent.
    pub last_sent: Option<(Capacity, Health)>,
    pub last_status: Option<Instant>,
    pub last_lease: Option<Instant>,
    /// The last heartbeat write (status or Lease) got no answer: rounds come at the
    /// recovery period until a Lease renewal is taken.
    pub heartbeat_failing: bool,
    pub registered: bool,
    /// Set once the Node shows in the watch; its absence afterwards means it was deleted.
    pub seen_in_watch: bool,
    /// When the capacity shape is written.
    pub shape: ShapePublisher,
}

impl Heartbeat {
    pub fn round(&mut self, seen: &Observed, periods: &Periods) -> Round {
        // Failed probes count as an outage only when they span a probe period: rounds also
        // run on watch events, and a broken watch wakes several at once.
        if seen.probe.is_ok() {
            self.failures = 0;
            self.failing_since = None;
        } else {
            let since = *self.failing_since.get_or_insert(seen.now);
            self.failures = if seen.now.duration_since(since) >= periods.probe {
                self.failures.saturating_add(1).max(2)
            } else {
                1
            };
        }
        let was_ready = self.last_health.as_ref().is_some_and(|h| h.ready);
        let health = judge(
            seen.probe.clone(),
            self.failures,
            was_ready,
            seen.capacity.usable_nodes,
            seen.capacity.quotas.is_some(),
        );
        let ready_changed = self.last_health.as_ref().map(|h| h.ready) != Some(health.ready);
        self.last_health = Some(health.clone());
        let mut deleted_upstream = false;
        if seen.in_watch {
            self.seen_in_watch = true;
        } else if self.registered && self.seen_in_watch {
            deleted_upstream = true;
            self.node_gone();
        }
        let write_status = status_due(
            self.last_sent.as_ref(),
            (&seen.capacity, &health),
            self.last_status
                .is_none_or(|t| seen.now.duration_since(t) >= periods.status),
            seen.upstream_ready,
        );
        let renew_lease = self
            .last_lease
            .is_none_or(|t| seen.now.duration_since(t) >= periods.lease);
        Round {
            health,
            ready_changed,
            deleted_upstream,
            register: !self.registered,
            write_status,
            renew_lease,
        }
    }

    /// The Node is gone upstream: it is registered again, with a full status and a lease.
    pub fn node_gone(&mut self) {
        self.registered = false;
        self.seen_in_watch = false;
        self.last_sent = None;
        self.last_lease = None;
        self.shape = ShapePublisher::default();
    }

    pub fn status_written(&mut self, capacity: Capacity, health: Health, at: Instant) {
        self.last_sent = Some((capacity, health));
        self.last_status = Some(at);
    }

    pub fn lease_renewed(&mut self, at: Instant) {
        self.last_lease = Some(at);
        self.heartbeat_failing = false;
    }

    /// A status write or Lease renewal went unanswered. The status is owed whatever it
    /// last said: the node controller may have marked the node Unknown meanwhile, and a
    /// watch left on a connection that died with the outage would not show it.
    pub fn heartbeat_failed(&mut self) {
        self.last_sent = None;
        self.heartbeat_failing = true;
    }

    /// How long the loop may sleep after a round: the recovery period while heartbeats
    /// fail, else `idle` (the probe period, or the recovery period while the lower cluster
    /// is not Ready) but not past the Lease's renewal or an owed bump of the shape
    /// generation; never less than the recovery period (a write refused at once is not
    /// made again at once).
    pub fn sleep(&self, now: Instant, idle: Duration, recovery: Duration, periods: &Periods) -> Duration {
        if self.heartbeat_failing {
            return recovery;
        }
        let bump = self.shape.bump_due_in(now).unwrap_or(idle);
        let lease = match self.last_lease {
            Some(t) if self.registered => (t + periods.lease).saturating_duration_since(now),
            _ => idle,
        };
        idle.min(bump).min(lease).max(recovery.min(idle))
    }
}

/// The merge patch that brings `node` to `labels` (every label the virtual node sets), with
/// `extra` the `--node-labels` among them, to the placement overrides `placement` (the
/// annotation's text; `None`: none published), and to the virtual-node taint present or
/// not; `None` when nothing differs; `taint` `None` leaves the taints alone. Labels of others are never touched; a `--node-labels` key no
/// longer given is removed. The patch carries the Node's resourceVersion when it rewrites
/// the taints (a list shared with the node controller), so it never overwrites a newer one.
pub fn metadata_patch(
    node: &Node,
    labels: &BTreeMap<String, String>,
    extra: &BTreeMap<String, String>,
    placement: Option<&str>,
    taint: Option<bool>,
) -> Option<Value> {
    let have = node.metadata.labels.clone().unwrap_or_default();
    let mut label_patch = serde_json::Map::new();
    for (k, v) in labels {
        if have.get(k) != Some(v) {
            label_patch.insert(k.clone(), json!(v));
        }
    }
    let recorded = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_EXTRA_LABELS))
        .cloned()
        .unwrap_or_default();
    for old in recorded.split(',').filter(|k| !k.is_empty()) {
        if !labels.contains_key(old) && have.contains_key(old) {
            label_patch.insert(old.to_owned(), Value::Null);
        }
    }
    let extra_keys = extra.keys().map(String::as_str).collect::<Vec<_>>().join(",");
    let mut patch = json!({});
    if !label_patch.is_empty() {
        patch["metadata"]["labels"] = Value::Object(label_patch);
    }
    if recorded != extra_keys {
        patch["metadata"]["annotations"][names::NODE_EXTRA_LABELS] = json!(extra_keys);
    }
    let published = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::NODE_PLACEMENT_OVERRIDES))
        .map(String::as_str);
    if published != placement {
        patch["metadata"]["annotations"][names::NODE_PLACEMENT_OVERRIDES] = json!(placement);
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let ours = |t: &k8s_openapi::api::core::v1::Taint| t.key == names::VIRTUAL_NODE_TAINT;
    let has = taints.iter().any(ours);
    if let Some(taint) = taint
        && has != taint
    {
        let mut wanted: Vec<Value> = taints
            .iter()
            .filter(|t| !ours(t))
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect();
        if taint {
            wanted.push(
                json!({"key": names::VIRTUAL_NODE_TAINT, "value": names::VIRTUAL_NODE_TAINT_VALUE,
                               "effect": "NoSchedule"}),
            );
        }
        patch["spec"] = json!({"taints": wanted});
        patch["metadata"]["resourceVersion"] = json!(node.metadata.resource_version);
    }
    (patch != json!({})).then_some(patch)
}

/// Resources every virtual node states, at zero when no lower node offers them, so that a
/// lower cluster without usable nodes shows no room instead of the last figures.
const STATED_RESOURCES: [&str; 3] = ["cpu", "memory", "pods"];

/// The node feature (`status.declaredFeatures`) by which a kubelet says it takes WebSocket
/// exec, attach and port-forward streams from the apiserver.
pub const EXTEND_WEBSOCKETS_TO_KUBELET: &str = "ExtendWebSocketsToKubelet";

/// The node features of pods the virtual node carries down unchanged, so that it declares
/// them where its lower nodes do: restart rules that restart every container, resizes of
/// pod-level resources, of init containers and of pods with memory-backed volumes (made
/// through the lower pod's `resize` subresource), user namespaces beside the host network,
/// and bind mounts' options. Not carried: the DRA features (resource claims stay upstream).
const CARRIED_NODE_FEATURES: [&str; 6] = [
    "RestartAllContainersOnContainerExits",
    "InPlacePodLevelResourcesVerticalScaling",
    "InPlacePodVerticalScalingInitContainers",
    "InPlacePodVerticalScalingMemoryBackedVolumes",
    "UserNamespacesHostNetworkSupport",
    "VolumeBindMountOptions",
];

/// The virtual node's `status.declaredFeatures`: its own kubelet API's
/// [`EXTEND_WEBSOCKETS_TO_KUBELET`], and of the features it carries down, those every usable
/// lower node declares (`cap.declared_features`). Sorted, as a kubelet writes them.
pub fn declared_features(cap: &crate::decide::capacity::Capacity) -> Vec<String> {
    let mut out: Vec<String> = cap
        .declared_features
        .iter()
        .filter(|f| CARRIED_NODE_FEATURES.contains(&f.as_str()))
        .cloned()
        .chain([EXTEND_WEBSOCKETS_TO_KUBELET.to_owned()])
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The `capacity` or `allocatable` map of a status patch: `now`, the resources every node
/// states at zero when absent, and a removal (`null`) for each resource the Node shows that
/// no lower node offers any more (a strategic merge keeps keys a patch leaves out).
pub fn resources_patch(
    now: &tensile_common::quantity::ResourceMap,
    shown: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Value {
    let mut out: serde_json::Map<String, Value> =
        now.to_strings().into_iter().map(|(k, v)| (k, json!(v))).collect();
    for name in STATED_RESOURCES {
        out.entry(name).or_insert_with(|| json!("0"));
    }
    for name in shown.into_iter().flat_map(|m| m.keys()) {
        out.entry(name.clone()).or_insert(Value::Null);
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_declares_its_own_websocket_streams_and_the_carried_features_of_its_lower_nodes() {
        let cap = |features: &[&str]| crate::decide::capacity::Capacity {
            declared_features: features.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        };
        // A 1.33 lower cluster (no declared features): only the node's own.
        assert_eq!(declared_features(&cap(&[])), [EXTEND_WEBSOCKETS_TO_KUBELET]);
        // A 1.37 one: what the pods carry, not DRA's.
        assert_eq!(
            declared_features(&cap(&[
                "DRANodeAllocatableResources",
                "ExtendWebSocketsToKubelet",
                "RestartAllContainersOnContainerExits",
                "InPlacePodLevelResourcesVerticalScaling",
            ])),
            [
                EXTEND_WEBSOCKETS_TO_KUBELET,
                "InPlacePodLevelResourcesVerticalScaling",
                "RestartAllContainersOnContainerExits"
            ]
        );
    }

    #[test]
    fn node_labels_and_taint_follow_the_settings_and_leave_others_alone() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "vn", "resourceVersion": "41",
                         "labels": {"kubernetes.io/os": "linux", "team": "a", "someone-else": "x"},
                         "annotations": {names::NODE_EXTRA_LABELS: "team"}},
            "spec": {"taints": [
                {"key": names::VIRTUAL_NODE_TAINT, "value": "tensile", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]}}))
        .unwrap();
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // Unchanged settings: nothing to write.
        let same = labels(&[("kubernetes.io/os", "linux"), ("team", "a")]);
        assert_eq!(
            metadata_patch(&node, &same, &labels(&[("team", "a")]), None, Some(true)),
            None
        );
        // --node-labels now zone=z1, os learned as windows, --disable-taint.
        let extra = labels(&[("zone", "z1")]);
        let wanted = labels(&[("kubernetes.io/os", "windows"), ("zone", "z1")]);
        let kept = metadata_patch(&node, &wanted, &extra, None, None).unwrap();
        assert!(kept.get("spec").is_none(), "taints left alone: {kept}");
        assert_eq!(kept["metadata"]["labels"]["zone"], "z1");
        let patch = metadata_patch(&node, &wanted, &extra, None, Some(false)).unwrap();
        assert_eq!(
            patch["metadata"]["labels"],
            json!({"kubernetes.io/os": "windows", "zone": "z1", "team": null})
        );
        assert_eq!(patch["metadata"]["annotations"][names::NODE_EXTRA_LABELS], "zone");
        assert_eq!(
            patch["spec"]["taints"],
            json!([{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]),
            "only our taint goes; the node controller's stays"
        );
        assert_eq!(patch["metadata"]["resourceVersion"], "41");
    }

    #[test]
    fn one_failed_probe_is_a_blip_and_two_in_a_row_are_an_outage() {
        let ready = judge(Ok(()), 0, false, 3, false);
        assert!(ready.ready);
        assert_eq!(ready.reason, "LowerClusterReady");
        let blip = judge(Err("timeout".into()), 1, true, 3, false);
        assert!(blip.ready, "one failure keeps a Ready node Ready");
        let outage = judge(Err("timeout".into()), 2, blip.ready, 3, false);
        assert!(!outage.ready);
        assert_eq!(outage.reason, "LowerClusterUnreachable");
        assert!(outage.message.contains("timeout"), "{}", outage.message);
        assert!(
            !judge(Err("refused".into()), 1, false, 3, false).ready,
            "a node not Ready stays so"
        );
    }

    #[test]
    fn a_lower_cluster_without_usable_nodes_stays_ready_and_says_it_has_no_room() {
        let h = judge(Ok(()), 0, true, 0, false);
        assert!(h.ready, "cordoned lower nodes still run their pods");
        assert!(!h.nodes_usable);
        assert!(judge(Ok(()), 0, true, 2, false).nodes_usable);
    }

    #[test]
    fn resources_no_lower_node_offers_are_zero_or_removed() {
        let shown: BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity> = [
            ("cpu", "8"),
            ("memory", "16Gi"),
            ("pods", "220"),
            ("nvidia.com/gpu", "2"),
        ]
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_owned(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(v.into()),
            )
        })
        .collect();
        let none = tensile_common::quantity::ResourceMap::default();
        assert_eq!(
            resources_patch(&none, Some(&shown)),
            json!({"cpu": "0", "memory": "0", "pods": "0", "nvidia.com/gpu": null})
        );
        let pairs = [
            ("cpu".to_owned(), "4".to_owned()),
            ("pods".to_owned(), "110".to_owned()),
        ];
        let (some, _) = tensile_common::quantity::ResourceMap::parse(pairs.iter().map(|(k, v)| (k, v)));
        assert_eq!(
            resources_patch(&some, None),
            json!({"cpu": "4", "memory": "0", "pods": "110"})
        );
    }

    #[test]
    fn status_is_written_first_on_change_when_due_and_when_ready_was_rewritten_upstream() {
        let cap = Capacity::default();
        let ready = judge(Ok(()), 0, false, 1, false);
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
        let outage = judge(Err("x".into()), 2, true, 1, false);
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

    fn seen(probe: Result<(), String>, usable_nodes: usize, in_watch: bool, now: Instant) -> Observed {
        Observed {
            probe,
            capacity: Capacity {
                usable_nodes,
                ..Default::default()
            },
            in_watch,
            upstream_ready: in_watch.then_some(true),
            now,
        }
    }

    const STATUS: Duration = Duration::from_secs(60);
    const LEASE: Duration = Duration::from_secs(10);
    const PERIODS: Periods = Periods {
        probe: Duration::from_secs(5),
        status: STATUS,
        lease: LEASE,
    };

    /// A registered node whose first round wrote status and renewed its lease at `t0`.
    fn registered(t0: Instant) -> Heartbeat {
        let mut state = Heartbeat::default();
        let first = state.round(&seen(Ok(()), 3, false, t0), &PERIODS);
        assert!(first.register && first.write_status && first.renew_lease && first.ready_changed);
        state.registered = true;
        state.status_written(seen(Ok(()), 3, false, t0).capacity, first.health, t0);
        state.lease_renewed(t0);
        state
    }

    #[test]
    fn a_quiet_ready_node_renews_its_lease_every_lease_period_and_its_status_every_status_period() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let quiet = state.round(&seen(Ok(()), 3, true, t0 + Duration::from_secs(5)), &PERIODS);
        assert!(!quiet.register && !quiet.write_status && !quiet.renew_lease && !quiet.ready_changed);
        let lease = state.round(&seen(Ok(()), 3, true, t0 + LEASE), &PERIODS);
        assert!(lease.renew_lease && !lease.write_status);
        let status = state.round(&seen(Ok(()), 3, true, t0 + STATUS), &PERIODS);
        assert!(status.write_status);
    }

    #[test]
    fn an_unanswered_heartbeat_is_retried_at_the_recovery_period_with_the_status_owed() {
        let t0 = Instant::now();
        let (idle, recovery) = (PERIODS.probe, Duration::from_secs(1));
        let mut state = registered(t0);
        assert_eq!(state.sleep(t0, idle, recovery, &PERIODS), idle);
        // The Lease falls due before the next probe: the loop wakes for it.
        let t = t0 + Duration::from_secs(7);
        assert_eq!(state.sleep(t, idle, recovery, &PERIODS), Duration::from_secs(3));
        let t = t0 + LEASE;
        assert!(state.round(&seen(Ok(()), 3, true, t), &PERIODS).renew_lease);
        state.heartbeat_failed();
        assert_eq!(state.sleep(t, idle, recovery, &PERIODS), recovery);
        let t = t + Duration::from_secs(3);
        let retry = state.round(&seen(Ok(()), 3, true, t), &PERIODS);
        assert!(
            retry.renew_lease && retry.write_status,
            "the Lease again, and the status whatever it last said"
        );
        state.lease_renewed(t);
        state.status_written(seen(Ok(()), 3, true, t).capacity, retry.health, t);
        assert_eq!(state.sleep(t, idle, recovery, &PERIODS), idle);
        let quiet = state.round(&seen(Ok(()), 3, true, t + Duration::from_secs(1)), &PERIODS);
        assert!(!quiet.renew_lease && !quiet.write_status);
        // A failure while the Lease is not yet due: one recovery period, not a probe period.
        state.heartbeat_failed();
        assert_eq!(state.sleep(t, idle, recovery, &PERIODS), recovery);
    }

    #[test]
    fn a_lower_outage_turns_the_node_not_ready_once_failed_probes_span_a_probe_period() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let t = t0 + Duration::from_secs(1);
        let blip = state.round(&seen(Err("timeout".into()), 3, true, t), &PERIODS);
        assert!(
            blip.health.ready && !blip.ready_changed,
            "one failed probe is a blip"
        );
        // Rounds woken by watch events a moment later: still the same blip.
        let soon = t + Duration::from_millis(300);
        for _ in 0..3 {
            let again = state.round(&seen(Err("timeout".into()), 3, true, soon), &PERIODS);
            assert!(
                again.health.ready,
                "failures within one probe period are one blip"
            );
        }
        let t = t + PERIODS.probe;
        let outage = state.round(&seen(Err("timeout".into()), 3, true, t), &PERIODS);
        assert!(!outage.health.ready && outage.ready_changed && outage.write_status);
        let back = state.round(&seen(Ok(()), 3, true, t), &PERIODS);
        assert!(
            back.health.ready && back.ready_changed,
            "one good probe is enough to come back"
        );
    }

    #[test]
    fn a_node_deleted_upstream_is_registered_again_with_a_full_status_and_lease() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let t = t0 + Duration::from_secs(1);
        assert!(!state.round(&seen(Ok(()), 3, true, t), &PERIODS).deleted_upstream);
        let gone = state.round(&seen(Ok(()), 3, false, t), &PERIODS);
        assert!(gone.deleted_upstream && gone.register && gone.write_status && gone.renew_lease);
        let again = state.round(&seen(Ok(()), 3, false, t), &PERIODS);
        assert!(
            !again.deleted_upstream,
            "reported once, not every round until the watch shows it"
        );
    }

    #[test]
    fn a_node_not_yet_in_the_watch_after_registering_is_not_taken_for_deleted() {
        let t0 = Instant::now();
        let mut state = registered(t0);
        let round = state.round(&seen(Ok(()), 3, false, t0 + Duration::from_secs(1)), &PERIODS);
        assert!(!round.deleted_upstream && !round.register);
    }
}
