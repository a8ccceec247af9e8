//! Figures from samples, one rule for every test and benchmark: the nearest-rank percentile
//! of the sorted samples.

use serde_json::json;

/// Samples (milliseconds, by convention), sorted once.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    pub fn new(mut samples: Vec<f64>) -> Samples {
        samples.sort_by(f64::total_cmp);
        Samples(samples)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The sample at rank `p` (0 to 1) of the sorted samples; NaN when there are none.
    pub fn percentile(&self, p: f64) -> f64 {
        let Some(last) = self.0.len().checked_sub(1) else {
            return f64::NAN;
        };
        let rank = ((last as f64) * p.clamp(0.0, 1.0)).round() as usize;
        self.0[rank.min(last)]
    }

    pub fn max(&self) -> f64 {
        self.0.last().copied().unwrap_or(f64::NAN)
    }

    /// `{"p50", "p99", "max"}`.
    pub fn summary(&self) -> serde_json::Value {
        json!({"p50": self.percentile(0.5), "p99": self.percentile(0.99), "max": self.max()})
    }
}

impl FromIterator<f64> for Samples {
    fn from_iter<I: IntoIterator<Item = f64>>(iter: I) -> Samples {
        Samples::new(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_of_the_sorted_samples() {
        let s: Samples = [5.0, 1.0, 3.0, 2.0, 4.0].into_iter().collect();
        assert_eq!(s.percentile(0.0), 1.0);
        assert_eq!(s.percentile(0.5), 3.0);
        assert_eq!(s.percentile(1.0), 5.0);
        assert_eq!(s.max(), 5.0);
        assert!(Samples::default().percentile(0.5).is_nan());
        assert_eq!(Samples::new(vec![7.0]).percentile(0.99), 7.0);
    }
}
