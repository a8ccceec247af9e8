//! The keeper of pod certificates and trust bundles below ([`crate::decide::certificates`]
//! describes what is carried): [`Keeper`] asks the upper cluster for a pod's certificates
//! with PodCertificateRequests, as the pod's node, follows them until issued, asks again once
//! their refresh begins, reads the upper ClusterTrustBundles the pod projects, and writes the
//! pod's lower Secret.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    ClusterTrustBundle, PodCertificateRequest, PodCertificateRequestSpec,
};
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tensile_common::cache::Cache;
use tensile_common::lower::identity::{Identity, upper_uid};
use tokio::sync::Notify;

use crate::act::credentials::{Failure, store, version};
use crate::act::events::Events;
use crate::act::ratelimit::{Deferred, WriteLimit};
use crate::decide::certificates::{
    Certificate, SECRET_ANNOTATION, Sources, held, issued_chain, key_and_request, refresh_due, refusal,
    secret, secret_name, sources, trust_anchors,
};
use crate::model::refs::service_account;
use crate::model::trim::{LowerPod, UpperPod};

/// The lower pods (namespace, name) made to read a Secret of certificates: the pod controller
/// adds each it makes, the keeper finds the others when it starts.
#[derive(Default)]
pub struct Tracked {
    pods: Mutex<HashSet<(String, String)>>,
    changed: Notify,
}

impl Tracked {
    /// Follows the lower pod `name` of `namespace`, at once.
    pub fn track(&self, namespace: &str, name: &str) {
        if let Ok(mut pods) = self.pods.lock() {
            pods.insert((namespace.to_owned(), name.to_owned()));
        }
        self.changed.notify_one();
    }

    fn snapshot(&self) -> Vec<(String, String)> {
        self.pods
            .lock()
            .map(|p| p.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn forget(&self, key: &(String, String)) {
        if let Ok(mut pods) = self.pods.lock() {
            pods.remove(key);
        }
    }
}

/// Where one certificate of a pod stands between its request and the Secret.
#[derive(Clone)]
enum Asked {
    /// Asked for with request `request` for the key `key` (PKCS#8 PEM), not issued yet; or
    /// issued, kept here until the Secret holding it is written.
    Waiting { key: String, request: String },
    /// Denied or failed: a kubelet asks no more for that pod, and neither does the node.
    Refused,
}

/// A certificate as written into the pod's Secret: its entries (bundle, key, chain) and its
/// refresh annotation.
#[derive(Clone)]
struct Written {
    begins: jiff::Timestamp,
    entries: [(String, String); 3],
    refresh: (String, String),
}

/// How long bundles listed upstream are used before they are listed again: how soon a
/// change of a bundle reaches the pods that project it.
const BUNDLES_FRESH: Duration = Duration::from_secs(5);

/// Issues, refreshes and carries the certificates and trust bundles of this node's pods.
pub struct Keeper {
    pub upper: kube::Client,
    pub lower: kube::Client,
    pub identity: Identity,
    pub upper_pods: Cache<UpperPod>,
    pub lower_pods: Cache<LowerPod>,
    /// The virtual node's own Node upstream (its UID goes in each request).
    pub upper_node: Cache<k8s_openapi::api::core::v1::Node>,
    /// This node's lower Secrets of upper credentials.
    pub secrets: Cache<Secret>,
    pub tracked: Arc<Tracked>,
    pub limit: WriteLimit,
    pub events: Events,
    pub metrics: Arc<crate::metrics::Metrics>,
    asked: Mutex<HashMap<(String, String), Asked>>,
    /// Each certificate written, by (pod UID, key), until its refresh begins: a Secret the
    /// cache does not show yet, or one a lower admin deleted or edited, is written again
    /// from here without a new request (a kubelet keeps them in memory too).
    written: Mutex<HashMap<(String, String), Written>>,
    bundles: Mutex<Option<(tokio::time::Instant, Arc<Vec<ClusterTrustBundle>>)>>,
    retries: Deferred,
}

impl Keeper {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        upper: kube::Client,
        lower: kube::Client,
        identity: Identity,
        upper_pods: Cache<UpperPod>,
        lower_pods: Cache<LowerPod>,
        upper_node: Cache<k8s_openapi::api::core::v1::Node>,
        secrets: Cache<Secret>,
        tracked: Arc<Tracked>,
        limit: WriteLimit,
        events: Events,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Self {
        Keeper {
            upper,
            lower,
            identity,
            upper_pods,
            lower_pods,
            upper_node,
            secrets,
            tracked,
            limit,
            events,
            metrics,
            asked: Mutex::default(),
            written: Mutex::default(),
            bundles: Mutex::default(),
            retries: Deferred::default(),
        }
    }

    /// Passes forever: at once when a pod is tracked, every second while a request waits for
    /// its signer, else every 5 s (a changed bundle or a lost Secret is seen within that).
    pub async fn run(self) {
        self.upper_pods.synced().await;
        self.lower_pods.synced().await;
        self.secrets.synced().await;
        for pod in self.lower_pods.state() {
            let annotated = pod
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(SECRET_ANNOTATION));
            if annotated {
                self.tracked
                    .track(&pod.namespace().unwrap_or_default(), &pod.name_any());
            }
        }
        loop {
            let period = match self.pass().await {
                true => Duration::from_secs(1),
                false => Duration::from_secs(5),
            };
            tokio::select! {
                () = self.tracked.changed.notified() => {}
                () = tokio::time::sleep(period) => {}
            }
        }
    }

    /// One look at every tracked pod; whether a request is still waiting.
    pub async fn pass(&self) -> bool {
        let instant = tokio::time::Instant::now();
        let mut waiting = false;
        for key in self.tracked.snapshot() {
            let (ns, name) = &key;
            let (up, down) = (ObjectRef::new(name).within(ns), ObjectRef::new(name).within(ns));
            let (Some(kept), Some(below)) = (self.upper_pods.get(&up), self.lower_pods.get(&down)) else {
                match self.upper_pods.get(&up) {
                    None => self.tracked.forget(&key),
                    // A lower pod just made, not in the cache yet: looked at again soon.
                    Some(_) => waiting = true,
                }
                continue;
            };
            let uid = kept.uid().unwrap_or_default();
            let reads = below
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SECRET_ANNOTATION))
                .is_some_and(|s| *s == secret_name(&uid));
            if kept.terminal
                || kept.node.as_deref() != Some(self.identity.node.as_str())
                || !reads
                || upper_uid(&*below) != Some(uid.as_str())
            {
                continue;
            }
            if self.retries.waits(&uid, instant) {
                continue;
            }
            let (Ok(upper), Ok(lower)) = (kept.pod(), below.unpack()) else {
                continue;
            };
            if upper.metadata.deletion_timestamp.is_some() || lower.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let wanted = upper.spec.as_ref().map(sources).unwrap_or_default();
            match self.keep(&upper, &lower, &wanted).await {
                Ok(w) => {
                    waiting |= w;
                    self.retries.succeeded(&uid);
                }
                Err((cluster, message)) => {
                    let delay = self.retries.failed(&uid, instant);
                    self.metrics.api_error(cluster, "certificate");
                    tracing::warn!(pod = %format!("{ns}/{name}"), retry_in = ?delay, "pod certificates and trust bundles: {message}");
                }
            }
        }
        self.forget_gone();
        waiting
    }

    /// Forgets what was asked and written for pods that are gone.
    fn forget_gone(&self) {
        let remembered = [
            self.asked.lock().map_or(0, |a| a.len()),
            self.written.lock().map_or(0, |w| w.len()),
            self.retries.len(),
        ];
        if remembered.iter().all(|n| *n == 0) {
            return;
        }
        let live: HashSet<String> = self.upper_pods.state().iter().filter_map(|p| p.uid()).collect();
        if let Ok(mut asked) = self.asked.lock() {
            asked.retain(|(uid, _), _| live.contains(uid));
        }
        if let Ok(mut written) = self.written.lock() {
            written.retain(|(uid, _), _| live.contains(uid));
        }
        self.retries.retain(|uid| live.contains(uid));
    }

    /// Brings the Secret of `upper` (whose lower pod is `lower`) to what `wanted` asks;
    /// whether a request is still waiting for its signer.
    async fn keep(&self, upper: &Pod, lower: &Pod, wanted: &Sources) -> Result<bool, Failure> {
        let ns = upper.namespace().unwrap_or_default();
        let uid = upper.metadata.uid.clone().unwrap_or_default();
        let name = secret_name(&uid);
        let cached = self.secrets.get(&ObjectRef::new(&name).within(&ns));
        let (mut data, mut refresh) = cached.as_deref().map(held).unwrap_or_default();
        let before = (data.clone(), refresh.clone());
        if !wanted.bundles.is_empty() {
            let bundles = self.bundles().await?;
            for b in &wanted.bundles {
                match trust_anchors(b, &bundles) {
                    Ok(pem) => {
                        data.insert(b.key.clone(), pem);
                    }
                    // The pod waits, as on a kubelet: its volume cannot be made.
                    Err(why) => {
                        data.remove(&b.key);
                        tracing::warn!(pod = %format!("{ns}/{}", upper.name_any()), "trust bundle {}: {why}", b.key);
                    }
                }
            }
        }
        let now = jiff::Timestamp::now();
        let mut waiting = false;
        let mut issued = Vec::new();
        for c in &wanted.certificates {
            let at = (uid.clone(), c.key.clone());
            let kept = self.written.lock().ok().and_then(|w| w.get(&at).cloned());
            if let Some(kept) = kept.filter(|k| k.begins > now) {
                data.extend(kept.entries);
                refresh.insert(kept.refresh.0, kept.refresh.1);
                continue;
            }
            if !refresh_due(cached.as_deref(), c, now) {
                continue;
            }
            let asked = self.asked.lock().ok().and_then(|a| a.get(&at).cloned());
            match asked {
                None => {
                    let asked = self.ask(upper, c).await?;
                    if let Ok(mut a) = self.asked.lock() {
                        a.insert(at, asked);
                    }
                    waiting = true;
                }
                Some(Asked::Refused) => {}
                Some(Asked::Waiting { key, request }) => {
                    let api = Api::<PodCertificateRequest>::namespaced(self.upper.clone(), &ns);
                    let found = match api.get_opt(&request).await {
                        Ok(found) => found,
                        // The Node authorizer learns of a request from its own watch: a
                        // request just made may be refused for a moment.
                        Err(kube::Error::Api(s)) if s.code == 403 => {
                            waiting = true;
                            continue;
                        }
                        Err(e) => {
                            return Err((
                                "upper",
                                format!("reading PodCertificateRequest {ns}/{request}: {e}"),
                            ));
                        }
                    };
                    let Some(found) = found else {
                        // Deleted before it was issued: asked for again.
                        if let Ok(mut a) = self.asked.lock() {
                            a.remove(&at);
                        }
                        waiting = true;
                        continue;
                    };
                    if let Some(chain) = issued_chain(&found) {
                        let begins = found
                            .status
                            .as_ref()
                            .and_then(|s| s.begin_refresh_at.as_ref())
                            .map(|t| t.0)
                            .unwrap_or(now);
                        let written = Written {
                            begins,
                            entries: [
                                (c.bundle_key(), format!("{key}{chain}")),
                                (c.key_key(), key.clone()),
                                (c.chain_key(), chain),
                            ],
                            refresh: (c.refresh_annotation(), begins.to_string()),
                        };
                        data.extend(written.entries.clone());
                        refresh.insert(written.refresh.0.clone(), written.refresh.1.clone());
                        issued.push((at, written));
                    } else if let Some((type_, reason, message)) = refusal(&found) {
                        self.events.publish(
                            upper.object_ref(&()),
                            EventType::Warning,
                            &type_,
                            &format!(
                                "PodCertificateRequest {request} for {}: {reason}: {message}",
                                c.key
                            ),
                        );
                        if let Ok(mut a) = self.asked.lock() {
                            a.insert(at, Asked::Refused);
                        }
                    } else {
                        waiting = true;
                    }
                }
            }
        }
        if (&data, &refresh) != (&before.0, &before.1) {
            self.write(upper, lower, cached.as_deref(), data, refresh).await?;
        }
        for (at, written) in issued {
            if let Ok(mut a) = self.asked.lock() {
                a.remove(&at);
            }
            if let Ok(mut w) = self.written.lock() {
                w.insert(at, written);
            }
        }
        Ok(waiting)
    }

    /// The upper ClusterTrustBundles, listed at most every [`BUNDLES_FRESH`].
    async fn bundles(&self) -> Result<Arc<Vec<ClusterTrustBundle>>, Failure> {
        let now = tokio::time::Instant::now();
        if let Some((at, list)) = self.bundles.lock().ok().and_then(|b| b.clone())
            && now.duration_since(at) < BUNDLES_FRESH
        {
            return Ok(list);
        }
        let list = Api::<ClusterTrustBundle>::all(self.upper.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| ("upper", format!("listing ClusterTrustBundles: {e}")))?;
        let list = Arc::new(list.items);
        if let Ok(mut b) = self.bundles.lock() {
            *b = Some((now, list.clone()));
        }
        Ok(list)
    }

    /// Asks the upper cluster for certificate `c` of `upper`, as its node: a fresh key, and a
    /// request naming the pod, its ServiceAccount and this node by name and UID.
    async fn ask(&self, upper: &Pod, c: &Certificate) -> Result<Asked, Failure> {
        let ns = upper.namespace().unwrap_or_default();
        let spec = upper
            .spec
            .as_ref()
            .ok_or(("upper", "the pod has no spec".to_owned()))?;
        let account = service_account(spec);
        let account_uid = Api::<ServiceAccount>::namespaced(self.upper.clone(), &ns)
            .get(&account)
            .await
            .map_err(|e| ("upper", format!("reading ServiceAccount {ns}/{account}: {e}")))?
            .metadata
            .uid
            .unwrap_or_default();
        let node_uid = self
            .upper_node
            .get(&ObjectRef::new(&self.identity.node))
            .and_then(|n| n.metadata.uid.clone())
            .ok_or((
                "upper",
                format!("Node {} is not registered yet", self.identity.node),
            ))?;
        let (key, stub) = key_and_request(&c.key_type).map_err(|e| ("upper", e))?;
        let request = PodCertificateRequest {
            metadata: ObjectMeta {
                generate_name: Some("req-".into()),
                namespace: Some(ns.clone()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: upper.name_any(),
                    uid: upper.metadata.uid.clone().unwrap_or_default(),
                    controller: None,
                    block_owner_deletion: None,
                }]),
                ..Default::default()
            },
            spec: PodCertificateRequestSpec {
                signer_name: c.signer.clone(),
                pod_name: upper.name_any(),
                pod_uid: upper.metadata.uid.clone().unwrap_or_default(),
                service_account_name: account,
                service_account_uid: account_uid,
                node_name: self.identity.node.clone(),
                node_uid,
                max_expiration_seconds: c.max_expiration_seconds,
                stub_pkc_s10_request: ByteString(stub),
                unverified_user_annotations: c.user_annotations.clone(),
            },
            status: None,
        };
        let made = Api::<PodCertificateRequest>::namespaced(self.upper.clone(), &ns)
            .create(&PostParams::default(), &request)
            .await
            .map_err(|e| {
                (
                    "upper",
                    format!("a PodCertificateRequest of signer {:?}: {e}", c.signer),
                )
            })?;
        tracing::info!(
            pod = %format!("{ns}/{}", upper.name_any()),
            request = %made.name_any(),
            signer = %c.signer,
            "pod certificate asked for"
        );
        Ok(Asked::Waiting {
            key,
            request: made.name_any(),
        })
    }

    /// Writes the pod's Secret: created, or replaced at the version `cached` shows; one of
    /// that name that is not this node's for this pod is never overwritten.
    async fn write(
        &self,
        upper: &Pod,
        lower: &Pod,
        cached: Option<&Secret>,
        data: BTreeMap<String, String>,
        refresh: BTreeMap<String, String>,
    ) -> Result<(), Failure> {
        let ns = upper.namespace().unwrap_or_default();
        let uid = upper.metadata.uid.clone().unwrap_or_default();
        let name = secret_name(&uid);
        let api = Api::<Secret>::namespaced(self.lower.clone(), &ns);
        let version = version(&api, &self.identity, cached, (&ns, &name, &uid), "no certificate").await?;
        store(
            &api,
            &self.limit,
            secret(upper, lower, &self.identity, data, refresh),
            version,
        )
        .await?;
        tracing::info!(pod = %format!("{ns}/{}", upper.name_any()), "pod certificates and trust bundles written below");
        Ok(())
    }
}
