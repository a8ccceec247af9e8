//! The keeper of upper service-account tokens below ([`crate::decide::tokens`] describes the
//! mode): [`Keeper`] asks the upper cluster's TokenRequest API for a pod's tokens once its
//! lower pod exists and again when [`crate::decide::tokens::due`] says so, and writes the
//! pod's lower Secret.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use tensile_common::cache::Cache;
use tokio::sync::Notify;

use crate::act::credentials::{store, version};
use crate::act::ratelimit::WriteLimit;
use crate::decide::tokens::Settings;
use crate::decide::tokens::TOKEN_SECRET_ANNOTATION;
use crate::decide::tokens::Wanted;
use crate::decide::tokens::due;
use crate::decide::tokens::renew_time;
use crate::decide::tokens::renewal;
use crate::decide::tokens::secret;
use crate::decide::tokens::secret_name;
use crate::decide::tokens::wanted;
use crate::model::refs::service_account;
use crate::model::trim::{LowerPod, UpperPod};
use tensile_common::lower::identity::Identity;
use tensile_common::lower::identity::upper_uid;

/// Issues and renews the upper tokens of this node's pods (see the module).
pub struct Keeper {
    pub upper: kube::Client,
    pub lower: kube::Client,
    pub identity: Identity,
    pub settings: Settings,
    pub upper_pods: Cache<UpperPod>,
    pub lower_pods: Cache<LowerPod>,
    /// The lower token Secrets of this node.
    pub secrets: Cache<Secret>,
    pub limit: WriteLimit,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Upper pods (by UID) that mount no token.
    pub tokenless: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Pods (by UID) whose tokens failed: the pod controller's per-pod delays (1 s doubling
    /// to 5 minutes).
    pub retries: crate::act::ratelimit::Deferred,
    /// Pods (by UID) whose lower pod is not seen yet, and since when.
    pub unseen: std::sync::Mutex<std::collections::HashMap<String, tokio::time::Instant>>,
}

/// How long a pod whose lower pod was just made is looked at twice a second.
const JUST_MADE: Duration = Duration::from_secs(10);

impl Keeper {
    /// Passes forever: at once when a lower pod is made or a token Secret changes, twice a
    /// second while a lower pod was just made and its tokens are not written yet, else
    /// every 5 s.
    pub async fn run(self, changed: Arc<Notify>) {
        self.upper_pods.synced().await;
        self.lower_pods.synced().await;
        self.secrets.synced().await;
        loop {
            let period = match self.pass().await {
                true => Duration::from_millis(500),
                false => Duration::from_secs(5),
            };
            tokio::select! {
                () = changed.notified() => {}
                () = tokio::time::sleep(period) => {}
            }
        }
    }

    /// Issues what is missing or due, for every running pod of this node in the mode whose
    /// lower pod mounts them; whether a pod just made waits for its lower pod to be seen.
    pub async fn pass(&self) -> bool {
        let now = jiff::Timestamp::now();
        let instant = tokio::time::Instant::now();
        let mut waiting = false;
        for kept in self.upper_pods.state() {
            if kept.terminal || kept.node.as_deref() != Some(self.identity.node.as_str()) {
                continue;
            }
            let ns = kept.namespace().unwrap_or_default();
            let uid = kept.uid().unwrap_or_default();
            if !self.settings.applies(&ns) || self.tokenless.lock().is_ok_and(|t| t.contains(&uid)) {
                continue;
            }
            if self.retries.waits(&uid, instant) {
                continue;
            }
            // A Secret not due is passed by without reading the pod.
            let held = self.secrets.get(&ObjectRef::new(&secret_name(&uid)).within(&ns));
            if held.as_ref().is_some_and(|h| renewal(h).is_some_and(|r| r > now)) {
                continue;
            }
            let Some(lower) = self.lower_pods.get(&ObjectRef::new(&kept.name_any()).within(&ns)) else {
                if let Ok(mut unseen) = self.unseen.lock() {
                    let since = *unseen.entry(uid).or_insert(instant);
                    waiting |= instant.duration_since(since) < JUST_MADE;
                }
                continue;
            };
            if let Ok(mut unseen) = self.unseen.lock() {
                unseen.remove(&uid);
            }
            // Only a lower pod made to mount them gets tokens (one made before the mode, or
            // before its namespace was covered, mounts none: minting for it would leave live
            // tokens below that nothing uses).
            let mounts = lower
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TOKEN_SECRET_ANNOTATION))
                .is_some_and(|s| *s == secret_name(&uid));
            if !mounts {
                continue;
            }
            let (Ok(upper), Ok(lower)) = (kept.pod(), lower.unpack()) else {
                continue;
            };
            if upper.metadata.deletion_timestamp.is_some()
                || lower.metadata.deletion_timestamp.is_some()
                || upper_uid(&lower) != Some(uid.as_str())
            {
                continue;
            }
            let Some(spec) = upper.spec.as_ref() else {
                continue;
            };
            let wanted = wanted(spec, &service_account(spec));
            if wanted.is_empty() {
                // A pod's volumes never change: it never wants one.
                if let Ok(mut t) = self.tokenless.lock() {
                    t.insert(uid);
                }
                continue;
            }
            if held.as_ref().is_some_and(|h| !due(h, &wanted, now)) {
                continue;
            }
            match self.issue(&upper, &lower, &wanted, held.as_deref()).await {
                Ok(()) => self.retries.succeeded(&uid),
                Err(e) => {
                    let delay = self.retries.failed(&uid, instant);
                    self.metrics.api_error(e.0, "token");
                    tracing::warn!(
                        pod = %format!("{ns}/{}", upper.name_any()),
                        retry_in = ?delay,
                        "upper service-account token: {}",
                        e.1
                    );
                }
            }
        }
        // Forget pods that are gone.
        let remembered = [
            self.tokenless.lock().map_or(0, |t| t.len()),
            self.retries.len(),
            self.unseen.lock().map_or(0, |u| u.len()),
        ];
        if remembered.iter().any(|n| *n > 0) {
            let live: std::collections::HashSet<String> =
                self.upper_pods.state().iter().filter_map(|p| p.uid()).collect();
            if let Ok(mut t) = self.tokenless.lock() {
                t.retain(|uid| live.contains(uid));
            }
            if let Ok(mut u) = self.unseen.lock() {
                u.retain(|uid, _| live.contains(uid));
            }
            self.retries.retain(|uid| live.contains(uid));
        }
        waiting
    }

    /// Asks for every token `upper` wants and writes them into its lower Secret (`held`: as
    /// the cache shows it).
    async fn issue(
        &self,
        upper: &k8s_openapi::api::core::v1::Pod,
        lower: &k8s_openapi::api::core::v1::Pod,
        wanted: &[Wanted],
        held: Option<&Secret>,
    ) -> Result<(), (&'static str, String)> {
        let ns = upper.namespace().unwrap_or_default();
        let uid = upper.metadata.uid.clone().unwrap_or_default();
        let name = secret_name(&uid);
        let api = Api::<Secret>::namespaced(self.lower.clone(), &ns);
        // Someone else's Secret is never overwritten, and no token is asked for it.
        let version = version(&api, &self.identity, held, (&ns, &name, &uid), "no upper token").await?;
        let spec = upper.spec.as_ref().ok_or(("upper", "no spec".to_owned()))?;
        let account = service_account(spec);
        let issued_at = jiff::Timestamp::now();
        let mut tokens = Vec::with_capacity(wanted.len());
        let mut expirations = Vec::with_capacity(wanted.len());
        for w in wanted {
            let request = TokenRequestSpec {
                audiences: Some(w.audience.iter().cloned().collect()),
                expiration_seconds: Some(w.expiration_seconds),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(upper.name_any()),
                    uid: upper.metadata.uid.clone(),
                }),
                ..Default::default()
            };
            let (token, expires) = tensile_common::api::request_token(&self.upper, &ns, &account, request)
                .await
                .map_err(|e| ("upper", format!("a token of ServiceAccount {ns}/{account}: {e}")))?;
            tokens.push((w.key.clone(), token));
            expirations
                .push(expires.unwrap_or(issued_at + Duration::from_secs(w.expiration_seconds.max(0) as u64)));
        }
        let renew = renew_time(issued_at, &expirations, self.settings.renew_at);
        let desired = secret(upper, lower, &self.identity, tokens, &self.settings, renew);
        store(&api, &self.limit, desired, version).await?;
        tracing::info!(pod = %format!("{ns}/{}", upper.name_any()), %renew, "upper service-account tokens issued");
        Ok(())
    }
}
