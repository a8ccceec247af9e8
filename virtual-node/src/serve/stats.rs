//! Resource usage on the virtual node's kubelet port: `/stats/summary` (the kubelet's
//! Summary JSON) and `/metrics/resource` (its Prometheus text).
//!
//! Usage comes from the lower cluster: each lower node's `/stats/summary` through the lower
//! apiserver's node proxy. The node figures are the sums over the lower nodes; the pods are
//! the lower pods of upper pods bound to this node, under their upper names and UIDs. Only
//! the fields `kubectl top`, metrics-server and the resource metrics endpoint read are kept:
//! CPU (`usageNanoCores`, `usageCoreNanoSeconds`) and memory (`workingSetBytes`).

use serde_json::{Value, json};

/// A CPU and memory reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub nano_cores: u64,
    pub core_nano_seconds: u64,
    pub working_set_bytes: u64,
}

impl Usage {
    /// The reading of a summary object (`node`, a pod or a container).
    pub fn of(v: &Value) -> Usage {
        let num = |a: &str, b: &str| {
            v.get(a)
                .and_then(|x| x.get(b))
                .and_then(Value::as_u64)
                .unwrap_or(0)
        };
        Usage {
            nano_cores: num("cpu", "usageNanoCores"),
            core_nano_seconds: num("cpu", "usageCoreNanoSeconds"),
            working_set_bytes: num("memory", "workingSetBytes"),
        }
    }

    fn add(&mut self, other: Usage) {
        self.nano_cores += other.nano_cores;
        self.core_nano_seconds += other.core_nano_seconds;
        self.working_set_bytes += other.working_set_bytes;
    }

    /// The `cpu` and `memory` objects of a summary at `time`.
    pub fn fields(&self, time: &str) -> (Value, Value) {
        (
            json!({"time": time, "usageNanoCores": self.nano_cores, "usageCoreNanoSeconds": self.core_nano_seconds}),
            json!({"time": time, "workingSetBytes": self.working_set_bytes}),
        )
    }
}

/// The upper identity of a lower pod, when it is one of this node's: `(namespace, name, uid)`.
pub type Upper = (String, String, String);

/// One summary for the virtual node `node` from the lower nodes' `summaries`; `upper` maps a
/// lower pod's namespace, name and UID to its upper identity (`None`: not this node's).
pub fn aggregate(
    node: &str,
    summaries: &[Value],
    time: &str,
    upper: impl Fn(&str, &str, &str) -> Option<Upper>,
) -> Value {
    let mut total = Usage::default();
    let mut pods = Vec::new();
    for summary in summaries {
        if let Some(n) = summary.get("node") {
            total.add(Usage::of(n));
        }
        for pod in summary
            .get("pods")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let reference = &pod["podRef"];
            let (Some(ns), Some(name), Some(lower_uid)) = (
                reference["namespace"].as_str(),
                reference["name"].as_str(),
                reference["uid"].as_str(),
            ) else {
                continue;
            };
            let Some((ns, name, uid)) = upper(ns, name, lower_uid) else {
                continue;
            };
            let mut pod = pod.clone();
            pod["podRef"] = json!({"namespace": ns, "name": name, "uid": uid});
            pods.push(pod);
        }
    }
    let (cpu, memory) = total.fields(time);
    json!({"node": {"nodeName": node, "cpu": cpu, "memory": memory}, "pods": pods})
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn seconds(nanos: u64) -> String {
    format!("{}", nanos as f64 / 1e9)
}

/// The kubelet's `/metrics/resource` text for a summary.
pub fn resource_metrics(summary: &Value) -> String {
    let node = Usage::of(&summary["node"]);
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, String)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, value) in samples {
            out.push_str(&format!("{name}{labels} {value}\n"));
        }
    };
    family(
        "node_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
        vec![(String::new(), seconds(node.core_nano_seconds))],
    );
    family(
        "node_memory_working_set_bytes",
        "gauge",
        "Current working set of the node in bytes",
        vec![(String::new(), node.working_set_bytes.to_string())],
    );
    let pods: Vec<&Value> = summary["pods"].as_array().into_iter().flatten().collect();
    let pod_labels = |p: &Value| {
        format!(
            r#"namespace="{}",pod="{}""#,
            label(p["podRef"]["namespace"].as_str().unwrap_or_default()),
            label(p["podRef"]["name"].as_str().unwrap_or_default())
        )
    };
    let containers: Vec<(String, Usage)> = pods
        .iter()
        .flat_map(|p| {
            p["containers"].as_array().into_iter().flatten().map(move |c| {
                (
                    format!(
                        r#"{{container="{}",{}}}"#,
                        label(c["name"].as_str().unwrap_or_default()),
                        pod_labels(p)
                    ),
                    Usage::of(c),
                )
            })
        })
        .collect();
    family(
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
        containers
            .iter()
            .map(|(l, u)| (l.clone(), seconds(u.core_nano_seconds)))
            .collect(),
    );
    family(
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
        containers
            .iter()
            .map(|(l, u)| (l.clone(), u.working_set_bytes.to_string()))
            .collect(),
    );
    let pod_usage: Vec<(String, Usage)> = pods
        .iter()
        .map(|p| (format!("{{{}}}", pod_labels(p)), Usage::of(p)))
        .collect();
    family(
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
        pod_usage
            .iter()
            .map(|(l, u)| (l.clone(), seconds(u.core_nano_seconds)))
            .collect(),
    );
    family(
        "pod_memory_working_set_bytes",
        "gauge",
        "Current working set of the pod in bytes",
        pod_usage
            .iter()
            .map(|(l, u)| (l.clone(), u.working_set_bytes.to_string()))
            .collect(),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lower(node: &str, pods: &[(&str, &str, u64)]) -> Value {
        let pods: Vec<Value> = pods
            .iter()
            .map(|(ns, name, ws)| {
                json!({
                    "podRef": {"namespace": ns, "name": name, "uid": "lower-uid"},
                    "cpu": {"usageNanoCores": 10, "usageCoreNanoSeconds": 2_000_000_000u64},
                    "memory": {"workingSetBytes": ws},
                    "containers": [{"name": "app", "cpu": {"usageNanoCores": 10, "usageCoreNanoSeconds": 2_000_000_000u64}, "memory": {"workingSetBytes": ws}}],
                })
            })
            .collect();
        json!({"node": {"nodeName": node, "cpu": {"usageNanoCores": 100, "usageCoreNanoSeconds": 5}, "memory": {"workingSetBytes": 1000}}, "pods": pods})
    }

    #[test]
    fn node_figures_are_sums_and_pods_take_their_upper_names() {
        let summaries = [
            lower("a", &[("ns", "mine", 7), ("ns", "foreign", 9)]),
            lower("b", &[]),
        ];
        let s = aggregate("vn", &summaries, "t", |ns, name, lower_uid| {
            assert_eq!(lower_uid, "lower-uid", "the lower pod's UID is passed on");
            (name == "mine").then(|| (ns.to_owned(), name.to_owned(), "upper-uid".to_owned()))
        });
        assert_eq!(s["node"]["nodeName"], "vn");
        assert_eq!(Usage::of(&s["node"]).nano_cores, 200);
        assert_eq!(Usage::of(&s["node"]).working_set_bytes, 2000);
        let pods = s["pods"].as_array().unwrap();
        assert_eq!(pods.len(), 1, "only this node's pods");
        assert_eq!(pods[0]["podRef"]["uid"], "upper-uid");
        let text = resource_metrics(&s);
        assert!(text.contains("node_memory_working_set_bytes 2000\n"), "{text}");
        assert!(
            text.contains(
                r#"container_memory_working_set_bytes{container="app",namespace="ns",pod="mine"} 7"#
            )
        );
        assert!(text.contains(r#"pod_cpu_usage_seconds_total{namespace="ns",pod="mine"} 2"#));
        assert!(text.contains("# TYPE node_cpu_usage_seconds_total counter\n"));
    }
}
