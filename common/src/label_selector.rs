//! Whether a label selector selects a set of labels, by the API's rules: one reading shared
//! by the fit predicate's placement overrides and the descheduler's rebalancing.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Whether a label selector (of a Deployment, a topology spread, a PodDisruptionBudget)
/// selects these labels, by the API's rules: every `matchLabels` pair and every
/// `matchExpressions` requirement holds; an unknown operator selects nothing.
pub fn matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_label = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expression = selector.match_expressions.iter().flatten().all(|r| {
        let value = labels.get(&r.key);
        let values = r.values.as_deref().unwrap_or_default();
        match r.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    });
    by_label && by_expression
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_selector_reads_as_the_api_defines_it() {
        let sel: LabelSelector = serde_json::from_value(serde_json::json!({"matchLabels": {"app": "web"},
            "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["db"]}, {"key": "app", "operator": "Exists"}]}))
        .unwrap();
        let l = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(matches(&sel, &l(&[("app", "web")])));
        assert!(matches(&sel, &l(&[("app", "web"), ("tier", "front")])));
        assert!(!matches(&sel, &l(&[("app", "web"), ("tier", "db")])));
        assert!(!matches(&sel, &l(&[("app", "api")])));
    }
}
