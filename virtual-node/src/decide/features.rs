//! Pod features a lower cluster may lack, and the node features the virtual node declares.
//!
//! A lower apiserver that does not serve a feature either refuses its field (a field its
//! version does not know, with strict field validation; a value its validation rejects) or
//! silently drops it (a field it knows behind a feature gate that is off there), and would
//! then run the pod without it: half applied. [`asked`] names the features a pod's spec uses;
//! the pod controller checks such a pod by a server-side dry run of its create on the lower
//! apiserver, and [`dropped`] says which of them the stored pod lost. Either way the pod is
//! not created there.
//!
//! [`declared`] is what the virtual node publishes as `status.declaredFeatures`: the node
//! features every usable lower node declares, so the upper scheduler and admission keep a pod
//! that needs another one off this node.

use k8s_openapi::api::core::v1::{Container, Node, PodSpec};

/// A pod feature a lower apiserver may not serve.
#[derive(Debug)]
pub struct Feature {
    /// Its feature gate in Kubernetes.
    pub gate: &'static str,
    /// The field that asks for it, as a user writes it.
    pub field: &'static str,
    /// From which Kubernetes version the gate is on by default; `None`: off by default in
    /// every supported version.
    pub on_since: Option<&'static str>,
    asks: fn(&PodSpec) -> bool,
}

impl Feature {
    /// `field (feature Gate, on by default from Kubernetes X)`.
    pub fn describe(&self) -> String {
        match self.on_since {
            Some(v) => format!(
                "{} (feature {}, on by default from Kubernetes {v})",
                self.field, self.gate
            ),
            None => format!(
                "{} (feature {}, off by default in Kubernetes 1.33 to 1.37)",
                self.field, self.gate
            ),
        }
    }
}

fn containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

fn pod_level_resources(spec: &PodSpec) -> bool {
    spec.resources.as_ref().is_some_and(|r| {
        r.requests.as_ref().is_some_and(|q| !q.is_empty()) || r.limits.as_ref().is_some_and(|q| !q.is_empty())
    })
}

fn user_namespace(spec: &PodSpec) -> bool {
    spec.host_users == Some(false)
}

fn restart_rules(spec: &PodSpec) -> bool {
    spec.containers
        .iter()
        .any(|c| c.restart_policy.is_some() || c.restart_policy_rules.as_ref().is_some_and(|r| !r.is_empty()))
        || spec
            .init_containers
            .iter()
            .flatten()
            .any(|c| c.restart_policy_rules.as_ref().is_some_and(|r| !r.is_empty()))
}

fn restart_all(spec: &PodSpec) -> bool {
    containers(spec)
        .flat_map(|c| c.restart_policy_rules.iter().flatten())
        .any(|r| r.action == "RestartAllContainers")
}

fn image_volume(spec: &PodSpec) -> bool {
    spec.volumes.iter().flatten().any(|v| v.image.is_some())
}

fn env_file(spec: &PodSpec) -> bool {
    containers(spec)
        .flat_map(|c| c.env.iter().flatten())
        .any(|e| e.value_from.as_ref().is_some_and(|f| f.file_key_ref.is_some()))
}

fn stop_signal(spec: &PodSpec) -> bool {
    containers(spec).any(|c| c.lifecycle.as_ref().is_some_and(|l| l.stop_signal.is_some()))
}

fn sleep_action(spec: &PodSpec) -> bool {
    containers(spec).any(|c| {
        c.lifecycle.as_ref().is_some_and(|l| {
            [&l.pre_stop, &l.post_start]
                .into_iter()
                .flatten()
                .any(|h| h.sleep.is_some())
        })
    })
}

/// Every feature checked, in the order messages name them.
pub const FEATURES: [Feature; 8] = [
    Feature {
        gate: "PodLevelResources",
        field: "pod-level resources, spec.resources",
        on_since: Some("1.34"),
        asks: pod_level_resources,
    },
    Feature {
        gate: "UserNamespacesSupport",
        field: "spec.hostUsers: false",
        on_since: Some("1.33"),
        asks: user_namespace,
    },
    Feature {
        gate: "ContainerRestartRules",
        field: "a container's restartPolicy or restartPolicyRules",
        on_since: Some("1.35"),
        asks: restart_rules,
    },
    Feature {
        gate: "RestartAllContainersOnContainerExits",
        field: "a restart rule's action RestartAllContainers",
        on_since: Some("1.36"),
        asks: restart_all,
    },
    Feature {
        gate: "ImageVolume",
        field: "an image volume",
        on_since: Some("1.35"),
        asks: image_volume,
    },
    Feature {
        gate: "EnvFiles",
        field: "an env var from fileKeyRef",
        on_since: Some("1.35"),
        asks: env_file,
    },
    Feature {
        gate: "ContainerStopSignals",
        field: "a container's lifecycle.stopSignal",
        on_since: None,
        asks: stop_signal,
    },
    Feature {
        gate: "PodLifecycleSleepAction",
        field: "a sleep lifecycle action",
        on_since: Some("1.30"),
        asks: sleep_action,
    },
];

/// The features of [`FEATURES`] `spec` asks for.
pub fn asked(spec: &PodSpec) -> Vec<&'static Feature> {
    FEATURES.iter().filter(|f| (f.asks)(spec)).collect()
}

/// Of the features `sent` asks for, those the lower apiserver dropped from `stored` (the pod
/// as its dry-run create answered).
pub fn dropped(sent: &PodSpec, stored: &PodSpec) -> Vec<&'static Feature> {
    asked(sent).into_iter().filter(|f| !(f.asks)(stored)).collect()
}

/// The node features the virtual node declares from `nodes`, the usable lower nodes (their
/// `status.declaredFeatures`, 1.35+): those every one of them declares, sorted. A node that
/// declares none (an older kubelet) leaves nothing; no lower node, nothing.
pub fn declared<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> Vec<String> {
    let mut common: Option<Vec<String>> = None;
    for node in nodes {
        let mine: Vec<String> = node
            .status
            .as_ref()
            .and_then(|s| s.declared_features.clone())
            .unwrap_or_default();
        common = Some(match common {
            None => mine,
            Some(before) => before.into_iter().filter(|f| mine.contains(f)).collect(),
        });
    }
    let mut out = common.unwrap_or_default();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn each_feature_is_found_where_the_spec_asks_for_it() {
        let plain = spec(json!({"containers": [{"name": "app", "image": "x"}]}));
        assert!(asked(&plain).is_empty());
        let cases = [
            (
                json!({"resources": {"requests": {"cpu": "1"}}}),
                "PodLevelResources",
            ),
            (json!({"hostUsers": false}), "UserNamespacesSupport"),
            (
                json!({"volumes": [{"name": "v", "image": {"reference": "r"}}]}),
                "ImageVolume",
            ),
        ];
        for (extra, gate) in cases {
            let mut v = json!({"containers": [{"name": "app", "image": "x"}]});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            let found: Vec<&str> = asked(&spec(v)).iter().map(|f| f.gate).collect();
            assert_eq!(found, [gate]);
        }
        let container_cases = [
            (json!({"restartPolicy": "Never"}), vec!["ContainerRestartRules"]),
            (
                json!({"restartPolicy": "Never", "restartPolicyRules": [{"action": "RestartAllContainers",
                    "exitCodes": {"operator": "In", "values": [42]}}]}),
                vec!["ContainerRestartRules", "RestartAllContainersOnContainerExits"],
            ),
            (
                json!({"env": [{"name": "E", "valueFrom": {"fileKeyRef": {"volumeName": "v", "path": "p", "key": "k"}}}]}),
                vec!["EnvFiles"],
            ),
            (
                json!({"lifecycle": {"stopSignal": "SIGUSR1"}}),
                vec!["ContainerStopSignals"],
            ),
            (
                json!({"lifecycle": {"preStop": {"sleep": {"seconds": 0}}}}),
                vec!["PodLifecycleSleepAction"],
            ),
        ];
        for (extra, gates) in container_cases {
            let mut c = json!({"name": "app", "image": "x"});
            for (k, x) in extra.as_object().unwrap() {
                c[k] = x.clone();
            }
            let found: Vec<&str> = asked(&spec(json!({"containers": [c]})))
                .iter()
                .map(|f| f.gate)
                .collect();
            assert_eq!(found, gates);
        }
        // A sidecar's restartPolicy is the native sidecar of 1.28+, not a restart rule.
        let sidecar = spec(json!({"containers": [{"name": "app", "image": "x"}],
            "initContainers": [{"name": "proxy", "image": "y", "restartPolicy": "Always"}]}));
        assert!(asked(&sidecar).is_empty());
    }

    #[test]
    fn a_field_the_lower_apiserver_dropped_is_named_and_one_it_kept_is_not() {
        let sent = spec(
            json!({"hostUsers": false, "resources": {"requests": {"cpu": "1"}},
            "containers": [{"name": "app", "image": "x"}]}),
        );
        // As a 1.33 apiserver stores it: user namespaces kept (on there), pod-level resources
        // dropped (off there).
        let as_133 = spec(json!({"hostUsers": false, "containers": [{"name": "app", "image": "x"}]}));
        let lost: Vec<&str> = dropped(&sent, &as_133).iter().map(|f| f.gate).collect();
        assert_eq!(lost, ["PodLevelResources"]);
        assert!(FEATURES[0].describe().contains("spec.resources") && FEATURES[0].describe().contains("1.34"));
        // As 1.37 stores it: everything kept.
        assert!(dropped(&sent, &sent).is_empty());
    }

    #[test]
    fn the_node_declares_what_every_usable_lower_node_declares() {
        let node = |features: serde_json::Value| -> Node {
            serde_json::from_value(
                json!({"metadata": {"name": "n"}, "status": {"declaredFeatures": features}}),
            )
            .unwrap()
        };
        let newest = node(json!([
            "RestartAllContainersOnContainerExits",
            "ExtendWebSocketsToKubelet"
        ]));
        let narrower = node(json!(["ExtendWebSocketsToKubelet"]));
        let older: Node = serde_json::from_value(json!({"metadata": {"name": "old"}, "status": {}})).unwrap();
        assert_eq!(
            declared([&newest]),
            [
                "ExtendWebSocketsToKubelet",
                "RestartAllContainersOnContainerExits"
            ]
        );
        assert_eq!(declared([&newest, &narrower]), ["ExtendWebSocketsToKubelet"]);
        assert!(
            declared([&newest, &older]).is_empty(),
            "a 1.33 kubelet declares nothing"
        );
        assert!(declared(std::iter::empty::<&Node>()).is_empty());
    }
}
