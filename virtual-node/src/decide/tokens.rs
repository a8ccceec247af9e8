//! Upper service-account tokens for pods below (`--upper-service-account-tokens`).
//!
//! By default a pod's service-account token stays upstream: the lower pod has none. In this
//! mode a pod whose upper spec mounts a token (the legacy `<sa>-token-*` Secret volume, or a
//! projected volume with `serviceAccountToken` sources such as `kube-api-access-*`) gets, below,
//! tokens **of the upper cluster** for its upper ServiceAccount, asked for with the TokenRequest
//! API and bound to the upper pod (they stop authenticating once it is deleted), with the
//! audience and lifetime each source asks for. They are kept in one lower Secret per pod
//! ([`secret_name`], owned by the lower pod, so it goes with it), with the upper CA (`ca.crt`)
//! and the namespace, and mounted at the paths the upper pod mounts them; every container's
//! `KUBERNETES_SERVICE_HOST`/`PORT` name the upper API endpoint the lower cluster reaches.
//! The keeper asks for the tokens once the lower pod exists and again at 80 % of their
//! lifetime (the kubelet's rule, [`renew_time`], [`due`]), so a token is never used past its
//! renewal and never shared by two pods.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    EnvVar, KeyToPath, PodSpec, Secret, SecretProjection, SecretVolumeSource, Volume, VolumeProjection,
};
use kube::ResourceExt;

use crate::model::refs::ROOT_CA_CONFIG_MAP;
use crate::model::refs::is_upper_token_volume;
use tensile_common::lower::identity::Identity;

/// Prefix of the lower Secret of a pod's upper tokens; the upper pod's UID follows.
pub const SECRET_PREFIX: &str = "tensile-upper-token-";
/// Annotation of a lower pod made to mount a Secret of upper tokens: that Secret's name.
pub const TOKEN_SECRET_ANNOTATION: &str = "tensile.io/upper-token-secret";
/// Annotation of those Secrets: when the first of their tokens is due for renewal (RFC 3339).
pub const RENEW_AT: &str = "tensile.io/upper-token-renew-at";
/// Keys of the Secret besides the tokens (`token-0`, `token-1`…).
pub const CA_KEY: &str = "ca.crt";
pub const NAMESPACE_KEY: &str = "namespace";
/// The lifetime a token of a legacy token Secret volume is asked for (that volume's token
/// never expired; the kubelet asks 3607 s for `kube-api-access-*`).
pub const LEGACY_EXPIRATION: i64 = 3607;
/// The API's default `expirationSeconds` of a projected token source.
pub const PROJECTED_EXPIRATION: i64 = 3600;

/// The mode's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The upper API endpoint as the lower pods reach it.
    pub host: String,
    pub port: u16,
    /// The CA bundle (PEM) that endpoint's certificate verifies with.
    pub ca: String,
    /// Namespaces whose pods get tokens; empty: every namespace not shared below.
    pub namespaces: Vec<String>,
    /// Lower namespaces shared with others (`--shared-namespaces`; `*`: any): with no list
    /// above, their pods get no token (anyone who may read Secrets there could take it).
    pub shared: Vec<String>,
    /// Share of a token's lifetime after which it is renewed.
    pub renew_at: f64,
}

impl Settings {
    /// `endpoint` (`https://host[:port]`), the CA, the namespaces and the renewal share, or
    /// why they cannot be used.
    pub fn new(
        endpoint: &str,
        ca: String,
        namespaces: Vec<String>,
        shared: Vec<String>,
        renew_at: f64,
    ) -> Result<Self, String> {
        let uri: http::Uri = endpoint
            .parse()
            .map_err(|e| format!("--upper-api-endpoint {endpoint:?}: {e}"))?;
        if uri.scheme_str() != Some("https") {
            return Err(format!(
                "--upper-api-endpoint {endpoint:?}: in-cluster clients speak https only; give https://host[:port]"
            ));
        }
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(format!(
                "--upper-api-endpoint {endpoint:?}: in-cluster clients take a host and a port, not a path"
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("--upper-api-endpoint {endpoint:?} names no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        if !ca.contains("-----BEGIN CERTIFICATE-----") {
            return Err(
                "the upper CA (--upper-api-ca-file, or the upper kubeconfig's) holds no PEM certificate"
                    .into(),
            );
        }
        if !(renew_at > 0.0 && renew_at < 1.0) {
            return Err(format!(
                "--upper-token-renew-at {renew_at} is not between 0 and 1"
            ));
        }
        Ok(Settings {
            host,
            port: uri.port_u16().unwrap_or(443),
            ca,
            namespaces,
            shared,
            renew_at,
        })
    }

    /// Whether pods of `namespace` get upper tokens.
    pub fn applies(&self, namespace: &str) -> bool {
        match self.namespaces.is_empty() {
            true => !self.shared.iter().any(|s| s == "*" || s == namespace),
            false => self.namespaces.iter().any(|n| n == namespace),
        }
    }

    /// Which namespaces get upper tokens, in words, for the log.
    pub fn describe(&self) -> String {
        match (self.namespaces.is_empty(), self.shared.iter().any(|s| s == "*")) {
            (false, _) => format!("namespaces {}", self.namespaces.join(", ")),
            (true, true) => "no namespace (every one is shared below)".to_owned(),
            (true, false) => format!(
                "every namespace but those shared below ({})",
                self.shared.join(", ")
            ),
        }
    }
}

/// The lower Secret of the upper tokens of the pod whose UID is `upper_uid`.
pub fn secret_name(upper_uid: &str) -> String {
    format!("{SECRET_PREFIX}{upper_uid}")
}

/// One token a pod's spec asks for: the Secret key it is kept under, its audience (`None`:
/// the apiserver's), and its lifetime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub key: String,
    pub audience: Option<String>,
    pub expiration_seconds: i64,
}

fn token_key(i: usize) -> String {
    format!("token-{i}")
}

fn item(key: &str, path: &str) -> KeyToPath {
    KeyToPath {
        key: key.to_owned(),
        path: path.to_owned(),
        ..Default::default()
    }
}

/// The tokens the upper pod spec `spec` (running as `service_account`) asks for, in the order
/// [`rewrite`] keys them.
pub fn wanted(spec: &PodSpec, service_account: &str) -> Vec<Wanted> {
    let mut out = Vec::new();
    for v in spec.volumes.iter().flatten() {
        if !is_upper_token_volume(v, service_account) {
            continue;
        }
        if v.secret.is_some() {
            out.push(Wanted {
                key: token_key(out.len()),
                audience: None,
                expiration_seconds: LEGACY_EXPIRATION,
            });
        }
        for source in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            if let Some(t) = &source.service_account_token {
                out.push(Wanted {
                    key: token_key(out.len()),
                    audience: t.audience.clone().filter(|a| !a.is_empty()),
                    expiration_seconds: t.expiration_seconds.unwrap_or(PROJECTED_EXPIRATION),
                });
            }
        }
    }
    out
}

/// Rewrites the lower pod spec `spec` (still holding the upper pod's token volumes, for
/// `service_account`) so that each token volume reads the Secret `secret` instead: a legacy
/// token Secret volume becomes that Secret's `token-N`, `ca.crt` and `namespace`; in a projected
/// volume each `serviceAccountToken` source becomes its `token-N` at the source's path and the
/// `kube-root-ca.crt` ConfigMap source its `ca.crt` (the upper CA, where the lower cluster's own
/// ConfigMap of that name holds the lower one); other sources stay. Every container's
/// `KUBERNETES_SERVICE_HOST`/`PORT` name the upper endpoint. Returns whether a volume was
/// rewritten (then the token volumes stay, rewritten; else nothing changed).
pub fn rewrite(spec: &mut PodSpec, service_account: &str, secret: &str, settings: &Settings) -> bool {
    let mut n = 0;
    let mut rewrote = false;
    for v in spec.volumes.iter_mut().flatten() {
        if !is_upper_token_volume(v, service_account) {
            continue;
        }
        rewrote = true;
        if let Some(legacy) = v.secret.take() {
            *v = Volume {
                name: v.name.clone(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.to_owned()),
                    items: Some(vec![
                        item(&token_key(n), "token"),
                        item(CA_KEY, CA_KEY),
                        item(NAMESPACE_KEY, NAMESPACE_KEY),
                    ]),
                    default_mode: legacy.default_mode,
                    ..Default::default()
                }),
                ..Default::default()
            };
            n += 1;
            continue;
        }
        let Some(projected) = v.projected.as_mut() else {
            continue;
        };
        for source in projected.sources.iter_mut().flatten() {
            if let Some(t) = source.service_account_token.take() {
                *source = VolumeProjection {
                    secret: Some(SecretProjection {
                        name: secret.to_owned(),
                        items: Some(vec![item(&token_key(n), &t.path)]),
                        optional: None,
                    }),
                    ..Default::default()
                };
                n += 1;
            } else if source
                .config_map
                .as_ref()
                .is_some_and(|c| c.name == ROOT_CA_CONFIG_MAP)
            {
                let items = source
                    .config_map
                    .take()
                    .and_then(|c| c.items)
                    .unwrap_or_else(|| vec![item(CA_KEY, CA_KEY)])
                    .into_iter()
                    .filter(|i| i.key == CA_KEY)
                    .map(|i| KeyToPath {
                        key: CA_KEY.to_owned(),
                        ..i
                    })
                    .collect();
                *source = VolumeProjection {
                    secret: Some(SecretProjection {
                        name: secret.to_owned(),
                        items: Some(items),
                        optional: None,
                    }),
                    ..Default::default()
                };
            }
        }
    }
    if !rewrote {
        return false;
    }
    let endpoint = [
        ("KUBERNETES_SERVICE_HOST", settings.host.clone()),
        ("KUBERNETES_SERVICE_PORT", settings.port.to_string()),
    ];
    let containers = spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten());
    for c in containers {
        let env = c.env.get_or_insert_default();
        env.retain(|e| !endpoint.iter().any(|(k, _)| *k == e.name));
        env.extend(endpoint.iter().map(|(k, v)| EnvVar {
            name: (*k).to_owned(),
            value: Some(v.clone()),
            value_from: None,
        }));
    }
    true
}

/// When tokens issued at `issued`, expiring at `expirations` (as the apiserver granted them,
/// which may be shorter than asked), are due for renewal: the earliest `renew_at` share of a
/// lifetime, and never sooner than 10 s.
pub fn renew_time(
    issued: jiff::Timestamp,
    expirations: &[jiff::Timestamp],
    renew_at: f64,
) -> jiff::Timestamp {
    let shortest = expirations
        .iter()
        .map(|e| e.duration_since(issued).as_secs_f64())
        .fold(f64::INFINITY, f64::min);
    let shortest = match shortest.is_finite() {
        true => shortest,
        false => LEGACY_EXPIRATION as f64,
    };
    issued + Duration::from_secs_f64((shortest * renew_at).max(10.0))
}

/// The lower Secret of `upper`'s tokens, owned by its lower pod `lower`.
pub fn secret(
    upper: &k8s_openapi::api::core::v1::Pod,
    lower: &k8s_openapi::api::core::v1::Pod,
    identity: &Identity,
    tokens: Vec<(String, String)>,
    settings: &Settings,
    renew: jiff::Timestamp,
) -> Secret {
    let uid = upper.metadata.uid.clone().unwrap_or_default();
    let ns = upper.namespace().unwrap_or_default();
    let mut data: BTreeMap<String, ByteString> = tokens
        .into_iter()
        .map(|(k, t)| (k, ByteString(t.into_bytes())))
        .collect();
    data.insert(CA_KEY.to_owned(), ByteString(settings.ca.clone().into_bytes()));
    data.insert(NAMESPACE_KEY.to_owned(), ByteString(ns.clone().into_bytes()));
    let annotations = BTreeMap::from([(RENEW_AT.to_owned(), renew.to_string())]);
    crate::decide::credentials::secret(upper, lower, identity, secret_name(&uid), annotations, data)
}

/// When the Secret `held` is due for renewal, as it says.
pub fn renewal(held: &Secret) -> Option<jiff::Timestamp> {
    held.annotations().get(RENEW_AT)?.parse().ok()
}

/// Whether the Secret `held` must be issued again: its renewal time passed (or cannot be
/// read), or it lacks a token the pod asks for.
pub fn due(held: &Secret, wanted: &[Wanted], now: jiff::Timestamp) -> bool {
    let keys = held.data.as_ref();
    renewal(held).is_none_or(|r| r <= now)
        || wanted
            .iter()
            .any(|w| keys.is_none_or(|d| !d.contains_key(&w.key)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";

    fn settings(namespaces: &[&str]) -> Settings {
        Settings::new(
            "https://upper.example:6443",
            CA.into(),
            namespaces.iter().map(|n| (*n).to_owned()).collect(),
            vec!["default".into()],
            0.8,
        )
        .unwrap()
    }

    /// A pod spec as the upper apiserver's admission leaves it: 1.20 and older mount the
    /// account's token Secret; 1.21 on a projected `kube-api-access-*` volume (token, root CA,
    /// namespace); `extra` adds a projected volume of the pod's own.
    fn spec(version: &str, extra: Option<serde_json::Value>) -> PodSpec {
        let token_volume = match version {
            "1.20" => {
                json!({"name": "builder-token-abcde", "secret": {"secretName": "builder-token-abcde", "defaultMode": 420}})
            }
            _ => json!({"name": "kube-api-access-x1", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ]}}),
        };
        let name = token_volume["name"].clone();
        let mut volumes = vec![
            token_volume,
            json!({"name": "data", "configMap": {"name": "settings"}}),
        ];
        volumes.extend(extra);
        serde_json::from_value(json!({
            "serviceAccountName": "builder",
            "containers": [{"name": "app", "image": "app",
                "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.1"}, {"name": "KEEP", "value": "1"}],
                "volumeMounts": [{"name": name, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}]}],
            "initContainers": [{"name": "init", "image": "init"}],
            "volumes": volumes,
        }))
        .unwrap()
    }

    fn env(spec: &PodSpec, container: usize) -> Vec<(String, String)> {
        let c = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .nth(container)
            .unwrap();
        c.env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn a_legacy_token_volume_reads_the_pods_secret_of_upper_tokens() {
        let mut s = spec("1.20", None);
        assert_eq!(
            wanted(&s, "builder"),
            [Wanted {
                key: "token-0".into(),
                audience: None,
                expiration_seconds: LEGACY_EXPIRATION
            }]
        );
        assert!(rewrite(
            &mut s,
            "builder",
            "tensile-upper-token-u1",
            &settings(&[])
        ));
        let v = serde_json::to_value(&s.volumes.as_ref().unwrap()[0]).unwrap();
        assert_eq!(
            v,
            json!({"name": "builder-token-abcde", "secret": {"secretName": "tensile-upper-token-u1", "defaultMode": 420,
                "items": [{"key": "token-0", "path": "token"}, {"key": "ca.crt", "path": "ca.crt"}, {"key": "namespace", "path": "namespace"}]}})
        );
        assert_eq!(
            serde_json::to_value(&s.volumes.as_ref().unwrap()[1]).unwrap()["configMap"]["name"],
            "settings"
        );
        // Every container's in-cluster clients go to the upper endpoint; other env stays.
        assert_eq!(
            env(&s, 1),
            [
                ("KEEP".to_owned(), "1".to_owned()),
                ("KUBERNETES_SERVICE_HOST".to_owned(), "upper.example".to_owned()),
                ("KUBERNETES_SERVICE_PORT".to_owned(), "6443".to_owned())
            ]
        );
        assert_eq!(env(&s, 0).len(), 2, "init containers too");
    }

    #[test]
    fn a_projected_token_volume_keeps_its_paths_with_the_upper_token_and_ca() {
        let own = json!({"name": "vault", "projected": {"sources": [
            {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 600, "path": "vault-token"}},
            {"secret": {"name": "vault-config"}},
        ]}});
        let mut s = spec("1.21", Some(own));
        assert_eq!(
            wanted(&s, "builder"),
            [
                Wanted {
                    key: "token-0".into(),
                    audience: None,
                    expiration_seconds: 3607
                },
                Wanted {
                    key: "token-1".into(),
                    audience: Some("vault".into()),
                    expiration_seconds: 600
                },
            ]
        );
        assert!(rewrite(
            &mut s,
            "builder",
            "tensile-upper-token-u1",
            &settings(&[])
        ));
        let volumes = serde_json::to_value(s.volumes.as_ref().unwrap()).unwrap();
        assert_eq!(
            volumes[0]["projected"]["sources"],
            json!([
                {"secret": {"name": "tensile-upper-token-u1", "items": [{"key": "token-0", "path": "token"}]}},
                {"secret": {"name": "tensile-upper-token-u1", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ])
        );
        assert_eq!(volumes[0]["projected"]["defaultMode"], 420);
        assert_eq!(
            volumes[2]["projected"]["sources"],
            json!([
                {"secret": {"name": "tensile-upper-token-u1", "items": [{"key": "token-1", "path": "vault-token"}]}},
                {"secret": {"name": "vault-config"}},
            ]),
            "the pod's own sources stay, its token becomes the upper one"
        );
    }

    #[test]
    fn a_pod_that_mounts_no_token_is_left_as_it_is() {
        let mut s: PodSpec = serde_json::from_value(json!({
            "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": "app"}],
        }))
        .unwrap();
        let before = s.clone();
        assert!(wanted(&s, "default").is_empty());
        assert!(!rewrite(
            &mut s,
            "default",
            "tensile-upper-token-u1",
            &settings(&[])
        ));
        assert_eq!(s, before, "no env either");
    }

    #[test]
    fn the_mode_needs_an_https_endpoint_a_ca_and_a_share_below_one() {
        let s = settings(&["team-a"]);
        assert_eq!((s.host.as_str(), s.port), ("upper.example", 6443));
        assert!(s.applies("team-a") && !s.applies("team-b"));
        assert!(settings(&[]).applies("anything"));
        assert!(
            !settings(&[]).applies("default") && settings(&["default"]).applies("default"),
            "a namespace shared below gets tokens only when listed"
        );
        let v6 = Settings::new("https://[fd00::1]", CA.into(), vec![], vec![], 0.8).unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("fd00::1", 443));
        for (endpoint, ca, share, says) in [
            ("http://upper:80", CA, 0.8, "https only"),
            ("https://upper:6443/api", CA, 0.8, "not a path"),
            ("not a url at all", CA, 0.8, "--upper-api-endpoint"),
            ("https://upper", "no pem", 0.8, "holds no PEM certificate"),
            ("https://upper", CA, 1.0, "is not between 0 and 1"),
        ] {
            let e = Settings::new(endpoint, ca.into(), vec![], vec![], share).unwrap_err();
            assert!(e.contains(says), "{endpoint}: {e}");
        }
    }

    #[test]
    fn tokens_are_renewed_at_their_share_of_the_shortest_lifetime_and_a_secret_missing_one_is_due() {
        let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let at = |secs: u64| now + Duration::from_secs(secs);
        assert_eq!(
            renew_time(now, &[at(3607), at(600)], 0.8).to_string(),
            "2026-01-01T00:08:00Z"
        );
        assert_eq!(
            renew_time(now, &[at(3600)], 0.8).to_string(),
            "2026-01-01T00:48:00Z",
            "from what the apiserver granted"
        );
        assert_eq!(
            renew_time(now, &[at(86_400)], 0.8).to_string(),
            "2026-01-01T19:12:00Z"
        );
        assert_eq!(
            renew_time(now, &[at(600)], 0.001).to_string(),
            "2026-01-01T00:00:10Z",
            "never sooner than 10 s"
        );
        let held: Secret = serde_json::from_value(json!({
            "metadata": {"name": "tensile-upper-token-u1", "annotations": {RENEW_AT: "2026-01-01T00:08:00Z"}},
            "data": {"token-0": "dA==", "ca.crt": "Yw==", "namespace": "bg=="},
        }))
        .unwrap();
        let one = [Wanted {
            key: "token-0".into(),
            audience: None,
            expiration_seconds: 600,
        }];
        assert!(!due(&held, &one, now));
        assert!(due(&held, &one, "2026-01-01T00:08:00Z".parse().unwrap()));
        let two = [
            one[0].clone(),
            Wanted {
                key: "token-1".into(),
                audience: None,
                expiration_seconds: 600,
            },
        ];
        assert!(due(&held, &two, now), "a token the pod asks for is missing");
    }
}
