//! Prometheus metrics of the cluster controller (`tensile_controller_*`), plus the shared
//! `tensile_leader` from the election: what an operator alerts on before a lower cluster's
//! credential runs out.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    /// The `LowerCluster`'s name.
    pub cluster: String,
}

#[derive(Default)]
pub struct Metrics {
    pub credential_expiry: Family<ClusterLabels, Gauge>,
    pub ready: Family<ClusterLabels, Gauge>,
    pub renewal_failures: Family<ClusterLabels, Counter>,
    pub reconcile_errors: Family<ClusterLabels, Counter>,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("tensile_controller");
        r.register(
            "credential_expiry_timestamp_seconds",
            "When the token of each lower cluster's credential expires (Unix seconds); renewed at --token-renew-at of its life",
            m.credential_expiry.clone(),
        );
        r.register(
            "cluster_ready",
            "1 while a lower cluster is Ready, else 0",
            m.ready.clone(),
        );
        r.register(
            "credential_renewal_failures",
            "Failed renewals of a lower cluster's credential (asking the lower cluster, or writing the Secret)",
            m.renewal_failures.clone(),
        );
        r.register(
            "reconcile_errors",
            "Passes over a lower cluster that ended in an error",
            m.reconcile_errors.clone(),
        );
        m
    }

    pub fn cluster(cluster: &str) -> ClusterLabels {
        ClusterLabels {
            cluster: cluster.to_owned(),
        }
    }

    /// What the status of `cluster` says: Ready, and when its credential expires.
    pub fn report(&self, cluster: &str, ready: bool, expires: Option<&str>) {
        let labels = Self::cluster(cluster);
        self.ready.get_or_create(&labels).set(i64::from(ready));
        match expires.and_then(|e| e.parse::<jiff::Timestamp>().ok()) {
            Some(at) => {
                self.credential_expiry.get_or_create(&labels).set(at.as_second());
            }
            None => {
                self.credential_expiry.remove(&labels);
            }
        }
    }

    /// `cluster` is gone: its series go.
    pub fn forget(&self, cluster: &str) {
        let labels = Self::cluster(cluster);
        self.ready.remove(&labels);
        self.credential_expiry.remove(&labels);
        self.renewal_failures.remove(&labels);
        self.reconcile_errors.remove(&labels);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_of_a_cluster_reads_as_its_series_and_a_removed_cluster_has_none() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.report("lower-a", true, Some("2026-11-28T10:00:00Z"));
        m.renewal_failures
            .get_or_create(&Metrics::cluster("lower-a"))
            .inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                r#"tensile_controller_credential_expiry_timestamp_seconds{cluster="lower-a"} 1795860000"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"tensile_controller_cluster_ready{cluster="lower-a"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"tensile_controller_credential_renewal_failures_total{cluster="lower-a"} 1"#),
            "{text}"
        );
        m.forget("lower-a");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("lower-a"), "{text}");
    }
}
