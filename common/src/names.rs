//! Every label, annotation, taint and condition name the suite reads or writes.
//!
//! Names users already know from tensile-kube keep their spelling so workloads migrate
//! unchanged; everything the suite adds on its own lives under [`PREFIX`].

/// The prefix of every name the suite introduces.
pub const PREFIX: &str = "tensile.io/";

/// Per-pod annotation that tells the test bed's node simulator how a pod behaves
/// (timings, exit code, restarts). Its grammar is documented in the e2e crate's
/// `simulator::Behavior`; real clusters ignore it.
pub const SIM_BEHAVIOR: &str = "tensile.io/sim";

/// Label the node simulator puts on the Nodes it manages, with the simulator's name as value,
/// so several simulators can share one cluster without touching each other's nodes.
pub const SIM_MANAGED_BY: &str = "tensile.io/simulated-by";

// --- webhook and stash ---
// tensile-kube's user-facing names, kept so workloads and lower clusters migrate unchanged.

/// Label a pod carries, with value [`VIRTUAL_POD_VALUE`], to opt in to the webhook.
pub const VIRTUAL_POD_LABEL: &str = "virtual-pod";
/// The opt-in label's value.
pub const VIRTUAL_POD_VALUE: &str = "true";
/// Pod annotation holding the stashed lower-cluster constraints (see the `stash` module).
pub const CLUSTER_SELECTOR: &str = "clusterSelector";
/// Upper pod annotation: the webhook's signature of the stash (see `stash::StashKey`), so a
/// virtual node holding the key honours only stashes the webhook wrote.
pub const STASH_SIGNATURE: &str = "tensile.io/stash-signature";
/// Node label every virtual node carries, with value [`VIRTUAL_NODE_TYPE_VALUE`].
pub const VIRTUAL_NODE_TYPE_LABEL: &str = "type";
/// The virtual node label's value.
pub const VIRTUAL_NODE_TYPE_VALUE: &str = "virtual-kubelet";
/// NoSchedule taint on every virtual node (any value), so only pods that tolerate it land there.
pub const VIRTUAL_NODE_TAINT: &str = "virtual-kubelet.io/provider";
/// Taint the node controller puts on a node whose Ready condition is False.
pub const TAINT_NODE_NOT_READY: &str = "node.kubernetes.io/not-ready";
/// Taint the node controller puts on a node whose Ready condition is Unknown.
pub const TAINT_NODE_UNREACHABLE: &str = "node.kubernetes.io/unreachable";
/// PVC annotation naming the node the scheduler chose for a delayed-binding volume.
pub const PVC_SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// Pod finalizer with which the Job controller tracks a pod (Kubernetes 1.26 and later): it
/// counts such a pod, once deleted, only when the pod is terminal.
pub const JOB_TRACKING_FINALIZER: &str = "batch.kubernetes.io/job-tracking";

// --- virtual node ---

/// Node label value of `kubernetes.io/role` on virtual nodes.
pub const VIRTUAL_NODE_ROLE: &str = "agent";
/// Value of the virtual node taint.
pub const VIRTUAL_NODE_TAINT_VALUE: &str = "tensile";
/// Ownership marks on every object virtual-node creates in a lower cluster (labels): the
/// upper cluster's id, the virtual node's name, and for pods the upper pod's UID. Nothing
/// without all of them is ever modified or deleted.
pub const MARK_CLUSTER: &str = "tensile.io/upper-cluster";
pub const MARK_NODE: &str = "tensile.io/virtual-node";
pub const MARK_UPPER_UID: &str = "tensile.io/upper-uid";
/// Lower claim annotation, `Retain` while its upper volume says
/// `persistentVolumeReclaimPolicy: Retain`: such a claim (and its data) is never deleted by
/// a virtual node, even after the upper claim and volume are gone.
pub const LOWER_CLAIM_RECLAIM_POLICY: &str = "tensile.io/reclaim-policy";
/// Upper pod condition: whether the lower scheduler placed the pod (reason `Unschedulable`
/// with the lower scheduler's message when it could not). The descheduler acts on it.
pub const CONDITION_LOWER_SCHEDULED: &str = "tensile.io/LowerPodScheduled";
/// Upper pod condition, True while the lower cluster is making room for the unscheduled
/// lower pod: its scheduler preempted pods for it (the lower `status.nominatedNodeName`,
/// reason `Preempting`). The upper pod cannot carry a nomination of its own: an apiserver
/// of 1.35 or later refuses `status.nominatedNodeName` on a bound pod. The descheduler does
/// not move a pod while this holds, for a bounded time.
pub const CONDITION_LOWER_NOMINATED: &str = "tensile.io/LowerPodNominated";
/// Upper pod condition: whether the lower pod exists and matches (reasons `Conflict`,
/// `CreateFailed`, `DaemonSetPod`, `LowerPodLost`).
pub const CONDITION_LOWER_SYNCED: &str = "tensile.io/LowerPodSynced";
/// Lower pod annotation: the ConfigMaps and Secrets its upper pod references
/// (`ConfigMap/name,Secret/name`), written at create. Copies follow these, never the lower
/// pod's spec, into which lower admission may inject references (a ServiceAccount's
/// imagePullSecrets, a mesh's CA ConfigMap) that no upper pod named.
pub const LOWER_POD_REFERENCES: &str = "tensile.io/references";
/// Lower pod annotation: the override rules of its lower cluster that applied when it was
/// made (JSON, the rules as written). Updates that follow the pod down go through these same
/// rules, so a rule edited later reaches new pods only.
pub const OVERRIDES: &str = "tensile.io/overrides";
/// Lower pod annotation: the upper pod's `metadata.generation` its spec reflects, recorded at
/// create and with every update that follows the upper pod down (a resize among them). The
/// upper pod's `status.observedGeneration` and its kubelet conditions' come from it, never
/// from the lower pod's own generation.
pub const UPPER_GENERATION: &str = "tensile.io/upper-generation";
/// Lower pod annotation: a resize of the upper pod the lower apiserver refused, as JSON
/// `{"generation": N, "reason": "Infeasible"|"Deferred", "message": "..."}`; the upper pod
/// shows it as the kubelet's `PodResizePending` condition while that generation stands.
pub const RESIZE_REFUSED: &str = "tensile.io/resize-refused";
/// On a ConfigMap or Secret copy: the upper object's resourceVersion it was made from, and a
/// digest of what was written (content, labels, annotations), so the copy is judged current
/// without holding the upper content, and an edit below is still seen.
pub const COPY_UPPER_VERSION: &str = "tensile.io/upper-version";
pub const COPY_DIGEST: &str = "tensile.io/copy-digest";
/// Lower pod annotations listing the label and annotation keys copied from the upper pod,
/// so an update removes only keys that came from upstream, never ones the lower cluster
/// added (its admission webhooks, for example).
pub const COPIED_LABELS: &str = "tensile.io/copied-labels";
pub const COPIED_ANNOTATIONS: &str = "tensile.io/copied-annotations";
/// Annotation on a Service copied into a lower cluster: the upper Service's selector (JSON).
/// The copy itself has none; its endpoints are the upper ones, reflected.
pub const SERVICE_SELECTOR: &str = "tensile.io/service-selector";
/// Node condition: whether some lower node is Ready and schedulable (reason
/// `NoUsableLowerNodes` when none is; the node then offers no room, and stays Ready).
pub const CONDITION_LOWER_NODES_USABLE: &str = "tensile.io/LowerNodesUsable";
/// Node annotation: the placement part of the lower cluster's override rules in force
/// (JSON, see the `overrides` module), for the fit predicate.
pub const NODE_PLACEMENT_OVERRIDES: &str = "tensile.io/placement-overrides";
/// Node annotation: the capacity shape of the lower cluster (JSON, see the `shape` module).
pub const NODE_CAPACITY_SHAPE: &str = "tensile.io/capacity-shape";
/// Node label the virtual node bumps (a counter) when its capacity shape grows: the upper
/// scheduler retries unschedulable pods on a label change, never on an annotation change.
pub const NODE_SHAPE_GENERATION: &str = "tensile.io/shape-generation";
/// Node annotation: the `--node-labels` keys the virtual node set (comma-separated), so a key
/// dropped from the flag is removed and no one else's label ever is.
pub const NODE_EXTRA_LABELS: &str = "tensile.io/node-labels";
/// Field manager of every write virtual-node makes.
pub const FIELD_MANAGER: &str = "tensile-virtual-node";

// --- descheduler ---

/// The node label every node carries with its own name; exclusions are `NotIn` on it.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// The scheduler the apiserver names when a pod names none.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";
/// The multi-scheduler's name: of its own scheduler, or of the second kube-scheduler that
/// runs with its extender.
pub const MULTI_SCHEDULER: &str = "tensile-scheduler";
/// Pod annotation (kubernetes-sigs/descheduler's name) that lets the descheduler move a pod
/// it would otherwise leave alone: a bare pod.
pub const DESCHEDULER_EVICT: &str = "descheduler.alpha.kubernetes.io/evict";
/// Pod annotation (kubernetes-sigs/descheduler's name): never move this pod.
pub const DESCHEDULER_PREFER_NO_EVICTION: &str = "descheduler.alpha.kubernetes.io/prefer-no-eviction";
/// Pod annotation: `false` keeps the descheduler away from the pod.
pub const DESCHEDULE: &str = "tensile.io/deschedule";
/// Pod annotation the webhook writes next to the `kubernetes.io/hostname NotIn` it adds:
/// the virtual nodes it excluded (comma-separated), so readers can tell them from the
/// user's own constraints.
pub const EXCLUDED_NODES: &str = "tensile.io/excluded-nodes";
/// Label on a bare pod's replacement: the UID of the pod it replaces.
pub const REPLACES: &str = "tensile.io/replaces";
/// Annotation on a bare pod's replacement: the key of its exclusion record (the UID of the
/// first pod of the line), so every later move counts against the same record.
pub const LINEAGE: &str = "tensile.io/lineage";
/// Annotation on a bare pod's replacement: how many times the pod was moved.
pub const DESCHEDULE_COUNT: &str = "tensile.io/deschedule-count";
/// API group of the suite's own kinds (the exclusion record, the `exclusion` module).
pub const API_GROUP: &str = "tensile.io";
/// Label on every exclusion record: the field manager that wrote it.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";

// --- lower clusters as objects (the cluster controller and tensilectl) ---
/// Label on every object the cluster controller or `tensilectl` makes for a lower cluster,
/// in either cluster: the `LowerCluster`'s name.
pub const LOWER_CLUSTER: &str = "tensile.io/lower-cluster";
/// Label of a `LowerCluster`: the namespace of the cluster controller that runs it, where
/// its credential lives. A controller acts on the LowerClusters of its namespace only, so
/// two releases in one upper cluster never act on one object.
pub const CONTROLLER_NAMESPACE: &str = "tensile.io/controller-namespace";
/// Finalizer of a `LowerCluster`: its virtual node's traces are removed before it goes.
pub const LOWER_CLUSTER_FINALIZER: &str = "tensile.io/lower-cluster";
/// Field manager of the cluster controller's writes.
pub const CONTROLLER_MANAGER: &str = "tensile-cluster-controller";
/// Field manager, and `app.kubernetes.io/managed-by` value, of what `tensilectl` makes.
pub const TENSILECTL: &str = "tensilectl";
/// Keys of a lower cluster's credential Secret: the kubeconfig, and the token it reads from
/// a file beside it (`tokenFile: token`) that the cluster controller renews.
pub const CREDENTIAL_KUBECONFIG_KEY: &str = "kubeconfig";
pub const CREDENTIAL_TOKEN_KEY: &str = "token";

/// Whether `s` is a DNS-1123 label (a namespace's name): at most 63 lowercase letters,
/// digits and `-`, starting and ending with a letter or digit.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A `key=value` label, as a flag writes it (`--node-labels region=eu,zone=a`).
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("{s:?} is not key=value")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_name_is_a_dns_label() {
        assert!(is_dns_label("team-a") && is_dns_label("a1"));
        for bad in ["", "Team", "a.b", "-a", "a-", "a_b", &"x".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn a_label_flag_is_key_equals_value() {
        assert_eq!(parse_label(" region = eu "), Ok(("region".into(), "eu".into())));
        assert_eq!(parse_label("empty="), Ok(("empty".into(), String::new())));
        assert!(parse_label("novalue").is_err() && parse_label("=v").is_err());
    }

    #[test]
    fn suite_names_share_the_prefix() {
        for name in [
            SIM_BEHAVIOR,
            SIM_MANAGED_BY,
            MARK_CLUSTER,
            MARK_NODE,
            MARK_UPPER_UID,
            LOWER_CLUSTER,
            CONTROLLER_NAMESPACE,
            CONDITION_LOWER_SCHEDULED,
            CONDITION_LOWER_SYNCED,
            CONDITION_LOWER_NOMINATED,
            CONDITION_LOWER_NODES_USABLE,
            NODE_CAPACITY_SHAPE,
            NODE_PLACEMENT_OVERRIDES,
            NODE_SHAPE_GENERATION,
            NODE_EXTRA_LABELS,
            SERVICE_SELECTOR,
            LOWER_POD_REFERENCES,
            DESCHEDULE,
            EXCLUDED_NODES,
            REPLACES,
            LINEAGE,
            DESCHEDULE_COUNT,
        ] {
            assert!(name.starts_with(PREFIX), "{name} is outside {PREFIX}");
        }
    }
}
