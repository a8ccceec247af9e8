//! Prometheus metrics of the webhook, served on the admin port.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use std::sync::Arc;

use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `unchanged`, `mutated` or `denied`.
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// What was wrong with the request (`bad_request`, `content_type`, `too_large`, ...).
    pub reason: &'static str,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Admission reviews answered, by result.
    pub reviews: Family<ResultLabels, Counter>,
    /// Pods patched.
    pub mutations: Counter,
    /// Requests to `/mutate` answered with an HTTP error, by reason.
    pub errors: Family<ErrorLabels, Counter>,
    /// Time from request received to response ready, for every `/mutate` request.
    pub latency: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensile_webhook");
        let reviews = Family::<ResultLabels, Counter>::default();
        let mutations = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        // 50 µs .. ~1.6 s.
        let latency = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        registry.register(
            "reviews",
            "Admission reviews answered, by result",
            reviews.clone(),
        );
        registry.register("mutations", "Pods patched with a stash", mutations.clone());
        registry.register(
            "errors",
            "Requests refused with an HTTP error, by reason",
            errors.clone(),
        );
        registry.register(
            "review_duration_seconds",
            "Time to answer a request to /mutate",
            latency.clone(),
        );
        Self {
            registry: Arc::new(registry),
            reviews,
            mutations,
            errors,
            latency,
        }
    }
}

impl Metrics {
    /// The metrics in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The registry, for the admin endpoint.
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.clone()
    }

    pub fn error(&self, reason: &'static str) {
        self.errors.get_or_create(&ErrorLabels { reason }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_show_in_the_text_format() {
        let m = Metrics::default();
        m.reviews.get_or_create(&ResultLabels { result: "mutated" }).inc();
        m.mutations.inc();
        m.error("too_large");
        m.latency.observe(0.001);
        let text = m.encode();
        assert!(
            text.contains("tensile_webhook_reviews_total{result=\"mutated\"} 1"),
            "{text}"
        );
        assert!(text.contains("tensile_webhook_mutations_total 1"), "{text}");
        assert!(
            text.contains("tensile_webhook_errors_total{reason=\"too_large\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tensile_webhook_review_duration_seconds_count 1"),
            "{text}"
        );
    }
}
