//! Prometheus metrics of the multi-scheduler (`tensile_multischeduler_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::extender::Outcome;
use crate::preempt::Decision;

/// `verb`: `filter`, `prioritize`, `preempt` or `other` (a path that is neither); `result`: `ok` or
/// the kind of bad request (`method`, `content_type`, `body`, `decode`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub verb: &'static str,
}

/// `result` of a scheduling attempt (scheduler mode): `success`, `unschedulable`,
/// `unsupported` (refused for inter-pod constraints), `conflict` (bound by someone else, or
/// gone) or `error`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

type HistogramFamily = Family<VerbLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: HistogramFamily,
    /// Virtual nodes a filter rejected, by reason (`shape`, `exclusion`).
    pub rejected: Family<ReasonLabels, Counter>,
    /// Virtual nodes a filter passed without an exact answer, by reason.
    pub fail_open: Family<ReasonLabels, Counter>,
    /// Scheduling attempts of the scheduler mode, by result.
    pub binds: Family<ResultLabels, Counter>,
    /// Pods the scheduler mode holds in its queue.
    pub queue_pending: Gauge,
    /// Preemption candidates the `preempt` verb answered for, by decision and reason.
    pub preemption: Family<PreemptionLabels, Counter>,
}

/// `decision`: `kept` or `dropped`; `reason`: why (see [`crate::preempt::Decision`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PreemptionLabels {
    pub decision: &'static str,
    pub reason: &'static str,
}

fn latency() -> Histogram {
    Histogram::new([
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0,
    ])
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency),
            rejected: Family::default(),
            fail_open: Family::default(),
            binds: Family::default(),
            queue_pending: Gauge::default(),
            preemption: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("tensile_multischeduler");
        r.register(
            "requests",
            "Extender requests, by verb and result",
            m.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from a request's arrival to its answer, body read included, by verb",
            m.duration.clone(),
        );
        r.register(
            "nodes_rejected",
            "Virtual nodes the filter rejected, by reason (shape or exclusion)",
            m.rejected.clone(),
        );
        r.register(
            "fail_open",
            "Virtual nodes the filter passed without an exact answer, by reason",
            m.fail_open.clone(),
        );
        r.register(
            "binds",
            "Scheduling attempts in scheduler mode, by result",
            m.binds.clone(),
        );
        r.register(
            "queue_pending",
            "Pods waiting in the scheduler mode's queue",
            m.queue_pending.clone(),
        );
        r.register(
            "preemption_nodes",
            "Preemption candidates the preempt verb kept or dropped, by decision and reason",
            m.preemption.clone(),
        );
        m
    }

    /// Counts the decisions of one `preempt`.
    pub fn preemption(&self, decisions: &[(String, Decision)]) {
        for (_, d) in decisions {
            let (decision, reason) = match d {
                Decision::Kept(r) => ("kept", *r),
                Decision::Dropped(r) => ("dropped", *r),
            };
            self.preemption
                .get_or_create(&PreemptionLabels { decision, reason })
                .inc();
        }
    }

    pub fn bind(&self, result: &'static str) {
        self.binds.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn request(&self, verb: &'static str, result: &'static str) {
        self.requests.get_or_create(&RequestLabels { verb, result }).inc();
    }

    /// Counts the outcomes of one filter.
    pub fn outcomes(&self, outcomes: &[Outcome]) {
        for o in outcomes {
            match o {
                Outcome::Passed => {}
                Outcome::FailOpen(reason) => {
                    self.fail_open.get_or_create(&ReasonLabels { reason }).inc();
                }
                Outcome::Rejected(reason) => {
                    self.rejected.get_or_create(&ReasonLabels { reason }).inc();
                }
            }
        }
    }
}
