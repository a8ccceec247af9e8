//! What a pod spec references: the ConfigMaps and Secrets that travel with it (and where it
//! names each), the claims it mounts, how the references that travelled are recorded on the
//! lower pod, and why a pod waits for them. A leaf: the caches, the copy and volume plans
//! and the pod controller read it, and it reads none of them.

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::core::v1::{Pod, PodSpec, Volume, VolumeProjection};

/// The kinds of object that travel with a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    ConfigMap,
    Secret,
    Service,
    Endpoints,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::ConfigMap => "ConfigMap",
            Kind::Secret => "Secret",
            Kind::Service => "Service",
            Kind::Endpoints => "Endpoints",
        })
    }
}

/// One object a pod spec names, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub kind: Kind,
    pub name: String,
    /// The pod starts without it (the reference says `optional`, or it is an image pull
    /// secret, which a kubelet treats as a warning).
    pub optional: bool,
    /// Where the spec names it, for messages: `volume "config"`, `env of container "app"`.
    pub via: String,
}

/// Every ConfigMap and Secret `spec` references, in spec order. With `upper_service_account`
/// (the spec is an upper pod's, running as that account), what reaches the upper API is left
/// out: it stays behind ([`translate::is_upper_token_volume`]); every other source of a
/// projected volume is a reference like any other.
pub fn references(spec: &PodSpec, upper_service_account: Option<&str>) -> Vec<Reference> {
    let mut refs = Vec::new();
    let mut add = |kind, name: &str, optional: Option<bool>, via: String| {
        if !name.is_empty() {
            refs.push(Reference {
                kind,
                name: name.to_owned(),
                optional: optional.unwrap_or(false),
                via,
            });
        }
    };
    for v in spec.volumes.iter().flatten() {
        let upper_api = upper_service_account.is_some_and(|sa| is_upper_token_volume(v, sa));
        if upper_api && v.secret.is_some() {
            continue;
        }
        let via = || format!("volume {:?}", v.name);
        if let Some(c) = &v.config_map {
            add(Kind::ConfigMap, &c.name, c.optional, via());
        }
        if let Some(s) = &v.secret {
            add(
                Kind::Secret,
                s.secret_name.as_deref().unwrap_or(""),
                s.optional,
                via(),
            );
        }
        let sources = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
        for source in sources.filter(|s| !(upper_api && is_upper_api_source(s))) {
            if let Some(c) = &source.config_map {
                add(Kind::ConfigMap, &c.name, c.optional, via());
            }
            if let Some(s) = &source.secret {
                add(Kind::Secret, &s.name, s.optional, via());
            }
        }
        // Volume sources whose driver reads credentials from a Secret.
        let secret_refs = [
            v.cephfs.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.rbd.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.iscsi.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.flex_volume.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.storageos.as_ref().and_then(|s| s.secret_ref.as_ref()),
            v.scale_io.as_ref().map(|s| &s.secret_ref),
            v.csi.as_ref().and_then(|s| s.node_publish_secret_ref.as_ref()),
        ];
        for r in secret_refs.into_iter().flatten() {
            add(Kind::Secret, &r.name, None, via());
        }
        if let Some(a) = &v.azure_file {
            add(Kind::Secret, &a.secret_name, None, via());
        }
    }
    let containers = spec.init_containers.iter().flatten().chain(&spec.containers);
    for c in containers {
        for e in c.env.iter().flatten() {
            let Some(from) = &e.value_from else { continue };
            let via = || format!("env {} of container {:?}", e.name, c.name);
            if let Some(k) = &from.config_map_key_ref {
                add(Kind::ConfigMap, &k.name, k.optional, via());
            }
            if let Some(k) = &from.secret_key_ref {
                add(Kind::Secret, &k.name, k.optional, via());
            }
        }
        for e in c.env_from.iter().flatten() {
            let via = || format!("envFrom of container {:?}", c.name);
            if let Some(r) = &e.config_map_ref {
                add(Kind::ConfigMap, &r.name, r.optional, via());
            }
            if let Some(r) = &e.secret_ref {
                add(Kind::Secret, &r.name, r.optional, via());
            }
        }
    }
    for s in spec.image_pull_secrets.iter().flatten() {
        add(Kind::Secret, &s.name, Some(true), "imagePullSecrets".into());
    }
    refs
}

/// Optional references whose object does not exist upstream, so no copy travelled.
pub type Absent = BTreeSet<(Kind, String)>;

/// Takes the references in `absent` out of a lower pod spec, the way a kubelet treats a
/// missing optional object, so that they never resolve to a same-named lower object the
/// pod's owner has no business reading (another tenant's Secret, a pull credential): a
/// ConfigMap or Secret volume becomes an empty directory, a projected source, an `envFrom`
/// entry or an env var from a key is left out, and so is an image pull secret.
pub fn drop_absent(spec: &mut PodSpec, absent: &Absent) {
    if absent.is_empty() {
        return;
    }
    let gone = |kind: Kind, name: &str| absent.contains(&(kind, name.to_owned()));
    for v in spec.volumes.iter_mut().flatten() {
        let config_map = v
            .config_map
            .as_ref()
            .is_some_and(|c| gone(Kind::ConfigMap, &c.name));
        let secret = v
            .secret
            .as_ref()
            .is_some_and(|s| gone(Kind::Secret, s.secret_name.as_deref().unwrap_or("")));
        if config_map || secret {
            v.config_map = None;
            v.secret = None;
            v.empty_dir = Some(Default::default());
        }
        if let Some(sources) = v.projected.as_mut().and_then(|p| p.sources.as_mut()) {
            sources.retain(|source| {
                !(source
                    .config_map
                    .as_ref()
                    .is_some_and(|c| gone(Kind::ConfigMap, &c.name))
                    || source
                        .secret
                        .as_ref()
                        .is_some_and(|s| gone(Kind::Secret, &s.name)))
            });
        }
    }
    let containers = spec
        .init_containers
        .iter_mut()
        .flatten()
        .chain(spec.containers.iter_mut());
    for c in containers {
        if let Some(env) = c.env.as_mut() {
            env.retain(|e| {
                let from = e.value_from.as_ref();
                !(from
                    .and_then(|f| f.config_map_key_ref.as_ref())
                    .is_some_and(|k| gone(Kind::ConfigMap, &k.name))
                    || from
                        .and_then(|f| f.secret_key_ref.as_ref())
                        .is_some_and(|k| gone(Kind::Secret, &k.name)))
            });
        }
        if let Some(env_from) = c.env_from.as_mut() {
            env_from.retain(|e| {
                !(e.config_map_ref
                    .as_ref()
                    .is_some_and(|r| gone(Kind::ConfigMap, &r.name))
                    || e.secret_ref.as_ref().is_some_and(|r| gone(Kind::Secret, &r.name)))
            });
        }
    }
    if let Some(pull) = spec.image_pull_secrets.as_mut() {
        pull.retain(|s| !gone(Kind::Secret, &s.name));
        if pull.is_empty() {
            spec.image_pull_secrets = None;
        }
    }
}

/// The [`names::LOWER_POD_REFERENCES`] text of `refs`: `Kind/name`, comma-separated, each
/// once, in order. Names of ConfigMaps and Secrets hold neither `/` nor `,`.
pub fn encode_references<'a>(refs: impl IntoIterator<Item = (Kind, &'a str)>) -> String {
    let mut seen = BTreeSet::new();
    refs.into_iter()
        .filter(|(kind, _)| matches!(kind, Kind::ConfigMap | Kind::Secret))
        .filter(|r| seen.insert(*r))
        .map(|(kind, name)| format!("{kind}/{name}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The references a [`names::LOWER_POD_REFERENCES`] text lists; entries of another form
/// (edited by hand) are skipped, so they keep nothing below.
pub fn decode_references(text: &str) -> Vec<(Kind, String)> {
    text.split(',')
        .filter_map(|entry| {
            let (kind, name) = entry.split_once('/')?;
            let kind = match kind {
                "ConfigMap" => Kind::ConfigMap,
                "Secret" => Kind::Secret,
                _ => return None,
            };
            (!name.is_empty()).then(|| (kind, name.to_owned()))
        })
        .collect()
}

/// The references of an upper pod that travel with it (the upper cluster's service-account
/// token volumes stay behind, see [`translate`]).
pub fn upper_references(pod: &Pod) -> Vec<Reference> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    references(spec, Some(&service_account(spec)))
}

/// Why a pod cannot be created below yet.
#[derive(Debug, PartialEq, Eq)]
pub enum Blocked {
    /// A required object does not exist upstream.
    Missing(String),
    /// A same-named lower object is not ours.
    Conflict(String),
    /// The pod's namespace is not one this node serves below (`--lower-namespaces`).
    NotServed(String),
}

/// The claims a pod spec mounts.
pub fn claims(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone()))
        .collect()
}

/// The service account a pod runs as upstream.
pub fn service_account(spec: &PodSpec) -> String {
    spec.service_account_name
        .clone()
        .or_else(|| spec.service_account.clone())
        .unwrap_or_else(|| "default".into())
}

/// A volume through which a pod reaches the upper API: a secret-based `<sa>-token-*` volume,
/// or a projected volume with a `serviceAccountToken` source (what the upper cluster's
/// service-account admission adds as `kube-api-access-*`, or a pod's own). In a projected one
/// only the upper-API sources ([`is_upper_api_source`]) are the upper cluster's; its other
/// sources are the pod's, judged one by one as in any volume, as a kubelet does.
pub fn is_upper_token_volume(v: &Volume, service_account: &str) -> bool {
    if let Some(secret) = &v.secret {
        let prefix = format!("{service_account}-token-");
        return secret
            .secret_name
            .as_deref()
            .is_some_and(|n| n.starts_with(&prefix));
    }
    v.projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten())
        .any(|s| s.service_account_token.is_some())
}

/// A source of an upper token volume ([`is_upper_token_volume`]) that belongs to the upper
/// API: a token, or the upper cluster's root CA published beside it (`kube-root-ca.crt`, which
/// the lower cluster publishes in every namespace too).
pub fn is_upper_api_source(source: &VolumeProjection) -> bool {
    source.service_account_token.is_some()
        || source
            .config_map
            .as_ref()
            .is_some_and(|c| c.name == ROOT_CA_CONFIG_MAP)
}

/// The well-known ConfigMap of the cluster CA a `kube-api-access-*` volume projects.
pub const ROOT_CA_CONFIG_MAP: &str = "kube-root-ca.crt";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "n"}, "spec": spec})).unwrap()
    }

    #[test]
    fn absent_optional_references_are_taken_out_like_a_kubelet_ignores_them() {
        let mut spec: PodSpec = serde_json::from_value(json!({
            "imagePullSecrets": [{"name": "gone"}, {"name": "kept"}],
            "volumes": [
                {"name": "a", "secret": {"secretName": "gone", "optional": true}},
                {"name": "b", "configMap": {"name": "kept", "optional": true}},
                {"name": "p", "projected": {"sources": [
                    {"secret": {"name": "gone", "optional": true}},
                    {"configMap": {"name": "kept"}}]}},
            ],
            "containers": [{"name": "c", "image": "i",
                "env": [
                    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": true}}},
                    {"name": "B", "value": "plain"}],
                "envFrom": [{"secretRef": {"name": "gone", "optional": true}}, {"configMapRef": {"name": "kept"}}]}],
        }))
        .unwrap();
        let absent: Absent = [(Kind::Secret, "gone".to_owned())].into();
        drop_absent(&mut spec, &absent);
        let v = serde_json::to_value(&spec).unwrap();
        assert!(!v.to_string().contains("gone"), "{v}");
        assert_eq!(v["volumes"][0], json!({"name": "a", "emptyDir": {}}));
        assert_eq!(v["volumes"][1]["configMap"]["name"], "kept");
        assert_eq!(
            v["volumes"][2]["projected"]["sources"],
            json!([{"configMap": {"name": "kept"}}])
        );
        assert_eq!(
            v["containers"][0]["env"],
            json!([{"name": "B", "value": "plain"}])
        );
        assert_eq!(
            v["containers"][0]["envFrom"],
            json!([{"configMapRef": {"name": "kept"}}])
        );
        assert_eq!(v["imagePullSecrets"], json!([{"name": "kept"}]));
    }

    #[test]
    fn every_kind_of_reference_is_found_with_its_optionality() {
        let p = pod(json!({
            "serviceAccountName": "sa",
            "imagePullSecrets": [{"name": "pull"}],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "c1"}},
                {"name": "sec", "secret": {"secretName": "s1", "optional": true}},
                {"name": "proj", "projected": {"sources": [
                    {"configMap": {"name": "c2"}}, {"secret": {"name": "s2"}}]}},
                {"name": "ceph", "cephfs": {"monitors": ["m"], "secretRef": {"name": "s3"}}},
                {"name": "csi", "csi": {"driver": "d", "nodePublishSecretRef": {"name": "s4"}}},
                {"name": "sa-token-abcde", "secret": {"secretName": "sa-token-abcde"}},
                {"name": "kube-api-access-x", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt"}}]}}
            ],
            "initContainers": [{"name": "init", "envFrom": [{"secretRef": {"name": "s5"}}]}],
            "containers": [{"name": "app",
                "env": [
                    {"name": "A", "value": "plain"},
                    {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c3", "key": "k", "optional": true}}},
                    {"name": "C", "valueFrom": {"secretKeyRef": {"name": "s6", "key": "k"}}},
                    {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                ],
                "envFrom": [{"configMapRef": {"name": "c4"}}]}]
        }));
        let got: Vec<(Kind, String, bool)> = upper_references(&p)
            .into_iter()
            .map(|r| (r.kind, r.name, r.optional))
            .collect();
        let want: Vec<(Kind, String, bool)> = [
            (Kind::ConfigMap, "c1", false),
            (Kind::Secret, "s1", true),
            (Kind::ConfigMap, "c2", false),
            (Kind::Secret, "s2", false),
            (Kind::Secret, "s3", false),
            (Kind::Secret, "s4", false),
            (Kind::Secret, "s5", false),
            (Kind::ConfigMap, "c3", true),
            (Kind::Secret, "s6", false),
            (Kind::ConfigMap, "c4", false),
            (Kind::Secret, "pull", true),
        ]
        .into_iter()
        .map(|(k, n, o)| (k, n.to_owned(), o))
        .collect();
        assert_eq!(
            got, want,
            "the token volumes of the upper cluster are not references"
        );
        let via: Vec<String> = upper_references(&p).into_iter().map(|r| r.via).collect();
        assert_eq!(via[0], "volume \"cfg\"");
        assert_eq!(via[6], "envFrom of container \"init\"");
        assert_eq!(via[8], "env C of container \"app\"");
    }

    #[test]
    fn a_pod_without_spec_or_references_needs_nothing() {
        assert!(upper_references(&Pod::default()).is_empty());
        assert!(upper_references(&pod(json!({"containers": [{"name": "c"}]}))).is_empty());
    }

    #[test]
    fn the_record_of_references_lists_configmaps_and_secrets_once_and_reads_back() {
        let record = encode_references([
            (Kind::ConfigMap, "a"),
            (Kind::Secret, "s"),
            (Kind::ConfigMap, "a"),
            (Kind::Service, "svc"),
        ]);
        assert_eq!(record, "ConfigMap/a,Secret/s");
        assert_eq!(
            decode_references(&record),
            [(Kind::ConfigMap, "a".to_owned()), (Kind::Secret, "s".to_owned())]
        );
        assert_eq!(
            decode_references("Widget/x,Secret/,junk,Secret/ok"),
            [(Kind::Secret, "ok".to_owned())]
        );
        assert_eq!(decode_references(""), []);
    }
}
