//! Prometheus metrics of the descheduler (`tensile_descheduler_*`), plus the shared
//! `tensile_leader` from the election.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// `result`: `success`, `error`, `dry_run` or `limited` (a cap of the round, or a 429).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MoveLabels {
    pub result: String,
    /// The lower refusal's reason (`Unschedulable`).
    pub reason: String,
    pub virtual_node: String,
    pub namespace: String,
}

/// `reason`: `spread` or `preferred`; `result` as for moves.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RebalanceLabels {
    pub reason: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub virtual_node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

pub struct Metrics {
    pub moved: Family<MoveLabels, Counter>,
    pub candidates: Family<NodeLabels, Gauge>,
    pub skipped: Family<ReasonLabels, Gauge>,
    pub exclusions: Gauge,
    pub exclusion_writes: Family<ResultLabels, Counter>,
    pub exclusions_unreadable: Gauge,
    pub exclusions_swept: Counter,
    pub gave_up: Family<ResultLabels, Counter>,
    pub released: Family<ResultLabels, Counter>,
    pub rebalanced: Family<RebalanceLabels, Counter>,
    pub rebalance_held: Family<ReasonLabels, Gauge>,
    pub cycle_seconds: Histogram,
    pub cycles: Counter,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            moved: Family::default(),
            candidates: Family::default(),
            skipped: Family::default(),
            exclusions: Gauge::default(),
            exclusion_writes: Family::default(),
            exclusions_unreadable: Gauge::default(),
            exclusions_swept: Counter::default(),
            gave_up: Family::default(),
            released: Family::default(),
            rebalanced: Family::default(),
            rebalance_held: Family::default(),
            cycle_seconds: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0]),
            cycles: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("tensile_descheduler");
        r.register(
            "pods_moved",
            "Pods the descheduler moved (or, in dry run, would have), by result",
            m.moved.clone(),
        );
        r.register(
            "candidates",
            "Pods refused below for longer than the threshold, per virtual node, at the last round",
            m.candidates.clone(),
        );
        r.register(
            "skipped",
            "Candidates left in place at the last round, by reason",
            m.skipped.clone(),
        );
        r.register(
            "exclusions",
            "Workloads with an exclusion record that has not expired",
            m.exclusions.clone(),
        );
        r.register(
            "exclusion_writes",
            "Writes of exclusion records, by result",
            m.exclusion_writes.clone(),
        );
        r.register(
            "exclusions_unreadable",
            "Exclusion records that do not decode (skipped, never applied, never deleted)",
            m.exclusions_unreadable.clone(),
        );
        r.register(
            "exclusions_swept",
            "Expired exclusion records deleted",
            m.exclusions_swept.clone(),
        );
        r.register(
            "owners_exhausted",
            "Workloads given up on after the maximum of moves (result: warned or dry_run)",
            m.gave_up.clone(),
        );
        r.register(
            "pods_released",
            "Unplaced pods recreated without an exclusion that no longer holds, by result",
            m.released.clone(),
        );
        r.register(
            "pods_rebalanced",
            "Running pods evicted to restore their workload's spread or preferred node, by reason and result",
            m.rebalanced.clone(),
        );
        r.register(
            "rebalance_held",
            "Workloads that would be rebalanced but were held back at the last round, by reason",
            m.rebalance_held.clone(),
        );
        r.register(
            "cycle_duration_seconds",
            "Duration of one descheduling round",
            m.cycle_seconds.clone(),
        );
        r.register("cycles", "Descheduling rounds run", m.cycles.clone());
        m
    }

    pub fn moved(&self, result: &str, reason: &str, node: &str, namespace: &str) {
        self.moved
            .get_or_create(&MoveLabels {
                result: result.into(),
                reason: reason.into(),
                virtual_node: node.into(),
                namespace: namespace.into(),
            })
            .inc();
    }

    pub fn rebalanced(&self, reason: &str, result: &str) {
        self.rebalanced
            .get_or_create(&RebalanceLabels {
                reason: reason.into(),
                result: result.into(),
            })
            .inc();
    }
}
