//! Prometheus metrics of one virtual node.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub cluster: String,
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub kind: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

pub struct Metrics {
    pub pods_managed: Gauge,
    pub lower_pods_created: Counter,
    pub reconcile_seconds: Family<OutcomeLabels, Histogram>,
    pub in_flight: Gauge,
    pub api_errors: Family<ApiLabels, Counter>,
    pub lower_ready: Gauge,
    pub copies: Gauge,
    pub events_dropped: Counter,
    /// exec/attach/port-forward sessions spliced now: each holds one upper and one lower
    /// connection and one task, so a leak shows here.
    pub stream_sessions: Family<StreamLabels, Gauge>,
    pub stream_sessions_total: Family<StreamLabels, Counter>,
    pub stream_refusals: Family<RefusalLabels, Counter>,
    /// Changes of the overrides file that came into force, and those refused.
    pub overrides_loaded: Counter,
    pub overrides_refused: Counter,
}

/// One spliced session, counted in [`Metrics::stream_sessions`] until dropped.
pub struct StreamSession {
    open: Gauge,
}

impl Drop for StreamSession {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            pods_managed: Gauge::default(),
            lower_pods_created: Counter::default(),
            reconcile_seconds: Family::new_with_constructor(|| {
                Histogram::new([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0])
            }),
            in_flight: Gauge::default(),
            api_errors: Family::default(),
            lower_ready: Gauge::default(),
            copies: Gauge::default(),
            events_dropped: Counter::default(),
            stream_sessions: Family::default(),
            stream_sessions_total: Family::default(),
            stream_refusals: Family::default(),
            overrides_loaded: Counter::default(),
            overrides_refused: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("tensile_virtual_node");
        r.register(
            "pods_managed",
            "Upper pods bound to this virtual node",
            m.pods_managed.clone(),
        );
        r.register(
            "lower_pods_created",
            "Lower pods created",
            m.lower_pods_created.clone(),
        );
        r.register(
            "reconcile_seconds",
            "Duration of one pod reconcile",
            m.reconcile_seconds.clone(),
        );
        r.register(
            "reconciles_in_flight",
            "Pod reconciles running now (queue depth)",
            m.in_flight.clone(),
        );
        r.register(
            "api_errors",
            "API errors by cluster and verb",
            m.api_errors.clone(),
        );
        r.register(
            "lower_cluster_ready",
            "1 when the lower cluster answers and has a usable node",
            m.lower_ready.clone(),
        );
        r.register(
            "copies",
            "ConfigMaps and Secrets of this upper cluster in the lower cluster",
            m.copies.clone(),
        );
        r.register(
            "events_dropped",
            "Events not sent because the event queue was full",
            m.events_dropped.clone(),
        );
        r.register(
            "stream_sessions",
            "exec, attach and port-forward sessions spliced to the lower cluster now, and followed logs (kind logs) streaming from it",
            m.stream_sessions.clone(),
        );
        r.register(
            "stream_sessions_started",
            "exec, attach and port-forward sessions spliced to the lower cluster",
            m.stream_sessions_total.clone(),
        );
        r.register(
            "stream_refusals",
            "exec, attach, port-forward and followed-log requests refused, by reason",
            m.stream_refusals.clone(),
        );
        r.register(
            "overrides_loaded",
            "Changes of the overrides file that came into force",
            m.overrides_loaded.clone(),
        );
        r.register(
            "overrides_refused",
            "Changes of the overrides file refused (the rules in force stayed)",
            m.overrides_refused.clone(),
        );
        m
    }

    /// Counts a spliced session of `kind` until the returned guard is dropped.
    pub fn stream_opened(&self, kind: &str) -> StreamSession {
        let labels = StreamLabels { kind: kind.into() };
        self.stream_sessions_total.get_or_create(&labels).inc();
        let open = self.stream_sessions.get_or_create(&labels).clone();
        open.inc();
        StreamSession { open }
    }

    pub fn stream_refused(&self, kind: &str, reason: &str) {
        self.stream_refusals
            .get_or_create(&RefusalLabels {
                kind: kind.into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn observe_reconcile(&self, took: Duration, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.reconcile_seconds
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn api_error(&self, cluster: &str, verb: &str) {
        self.api_errors
            .get_or_create(&ApiLabels {
                cluster: cluster.into(),
                verb: verb.into(),
            })
            .inc();
    }

    pub fn created(&self) {
        self.lower_pods_created.inc();
    }
}
