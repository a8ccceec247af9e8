//! Keeping our CA in the `caBundle` of the webhook's registration.
//!
//! The registration itself is the operator's (it names the pods and namespaces we see); we
//! own only the `caBundle` of its webhooks, written with a server-side apply under our own
//! field manager so no other field changes hands.

use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, Patch, PatchParams};
use tokio_util::sync::CancellationToken;

pub const FIELD_MANAGER: &str = "tensile-webhook";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("MutatingWebhookConfiguration {name}: {source}")]
    Kube {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("MutatingWebhookConfiguration {0} has no webhooks to give a caBundle")]
    NoWebhooks(String),
}

/// Writes `ca_pem` into every webhook of registration `name`; returns whether it changed anything.
pub async fn apply(client: kube::Client, name: &str, ca_pem: &str) -> Result<bool, Error> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    let err = |source| Error::Kube {
        name: name.to_owned(),
        source,
    };
    let current = api.get(name).await.map_err(err)?;
    let webhooks = current.webhooks.unwrap_or_default();
    if webhooks.is_empty() {
        return Err(Error::NoWebhooks(name.to_owned()));
    }
    let wanted = ca_pem.as_bytes();
    if webhooks
        .iter()
        .all(|w| w.client_config.ca_bundle.as_ref().is_some_and(|b| b.0 == wanted))
    {
        return Ok(false);
    }
    let bundle = base64::engine::general_purpose::STANDARD.encode(wanted);
    let entries: Vec<serde_json::Value> = webhooks
        .iter()
        .map(|w| serde_json::json!({"name": w.name, "clientConfig": {"caBundle": bundle}}))
        .collect();
    let patch = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": entries,
    });
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(err)?;
    Ok(true)
}

/// Applies the bundle until it holds, then checks it every `resync` (someone may re-create
/// the registration without it). Calls `on_applied` after the first success.
pub async fn keep(
    client: kube::Client,
    name: String,
    ca_pem: String,
    resync: Duration,
    stop: CancellationToken,
    on_applied: impl Fn() + Send,
) {
    let mut applied = false;
    loop {
        match apply(client.clone(), &name, &ca_pem).await {
            Ok(changed) => {
                if changed {
                    tracing::info!(registration = %name, "caBundle written");
                }
                if !applied {
                    applied = true;
                    on_applied();
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot write the caBundle yet; retrying"),
        }
        let wait = if applied {
            resync
        } else {
            Duration::from_secs(2).min(resync)
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
