//! Writing records: one object per record, created or replaced at the resourceVersion the
//! watch showed, and the sweep that deletes expired records (and the old ConfigMap once it
//! holds nothing in force).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};

use super::{ExclusionRecord, Exclusions, Location, Record, encode, object_name};
use crate::api::{ApiError, code};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("encoding the exclusion record: {0}")]
    Encode(#[from] serde_json::Error),
    /// The record is no longer the one the new record was computed from: written or
    /// deleted by someone else meanwhile. Nothing was written; judge again on what the watch
    /// shows now.
    #[error("exclusion record {0} changed since it was read; nothing written")]
    Changed(String),
}
/// Deletes in flight at once during a sweep.
const SWEEP_CONCURRENCY: usize = 16;
/// How long a write waits for the writer's own watch to show it.
const SEEN_WITHIN: Duration = Duration::from_secs(2);

/// The writer of records, with the view its own watch ([`super::follow`]) keeps.
#[derive(Clone)]
pub struct Writer {
    api: Api<ExclusionRecord>,
    legacy: Api<ConfigMap>,
    location: Location,
    seen: tokio::sync::watch::Receiver<Arc<Exclusions>>,
    manager: String,
}

/// What one sweep deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub records: usize,
    pub legacy: bool,
}

impl Writer {
    /// Writes the records of `location` as `manager` (field manager and label).
    pub fn new(
        client: kube::Client,
        location: Location,
        seen: tokio::sync::watch::Receiver<Arc<Exclusions>>,
        manager: &str,
    ) -> Self {
        Self {
            api: Api::namespaced(client.clone(), &location.namespace),
            legacy: Api::namespaced(client, &location.namespace),
            location,
            seen,
            manager: manager.to_owned(),
        }
    }

    /// The records as the watch last showed them.
    pub fn current(&self) -> Arc<Exclusions> {
        self.seen.borrow().clone()
    }

    fn what(&self, key: &str) -> String {
        format!("{} {}/{}", super::KIND, self.location.namespace, object_name(key))
    }

    /// Sets the record of workload `key` to `record`, computed from the object at
    /// resourceVersion `base` as the watch showed it (`None`: from no object). One object
    /// written, none other read or touched; its new resourceVersion is returned once the
    /// writer's own watch shows it (or after 2 s), so that readers, which get the same event
    /// at about the same moment, most likely have it too.
    ///
    /// The write is guarded by `base`: if the object changed meanwhile (another writer, a
    /// hand edit, a leader that had not yet stopped), nothing is written and
    /// [`Error::Changed`] says so, after the watch has caught up with the change, so the
    /// caller computes the record again from the newer one instead of overwriting it. Only
    /// an object deleted meanwhile is created afresh: nothing of it is left to lose.
    pub async fn put(&self, key: &str, record: &Record, base: Option<&str>) -> Result<String, Error> {
        let name = object_name(key);
        let pp = PostParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        let mut version = base.map(str::to_owned);
        loop {
            let object = encode(
                &self.location.namespace,
                key,
                record,
                version.clone(),
                &self.manager,
            )?;
            let written = match &version {
                None => self.api.create(&pp, &object).await,
                Some(_) => self.api.replace(&name, &pp, &object).await,
            };
            match written {
                Ok(object) => {
                    let written = object.metadata.resource_version.unwrap_or_default();
                    self.wait_seen(key, |shown| shown == Some(written.as_str())).await;
                    return Ok(written);
                }
                // Deleted since it was read (an expired record swept): nothing to lose.
                Err(e) if code(&e) == Some(404) && version.is_some() => version = None,
                // Created or replaced meanwhile: not ours to overwrite.
                Err(e) if code(&e) == Some(409) => {
                    self.wait_seen(key, |shown| shown.is_some() && shown != base)
                        .await;
                    return Err(Error::Changed(self.what(key)));
                }
                Err(e) => {
                    let verb = if version.is_some() { "replace" } else { "create" };
                    return Err(ApiError::on("upper", verb, self.what(key))(e).into());
                }
            }
        }
    }

    /// Waits until the watch shows the object of `key` at a resourceVersion `shown` accepts
    /// (the record as the apiserver keeps it: its times in whole seconds, so never compared
    /// with ours), for 2 s at most.
    async fn wait_seen(&self, key: &str, shown: impl Fn(Option<&str>) -> bool) {
        let mut seen = self.seen.clone();
        let shown = seen.wait_for(|ex| shown(ex.versions.get(key).map(String::as_str)));
        if tokio::time::timeout(SEEN_WITHIN, shown).await.is_err() {
            tracing::debug!(record = %self.what(key), "the watch has not shown the record's change after {SEEN_WITHIN:?}");
        }
    }

    /// Deletes every record that expired at `now` (each at the version the watch showed,
    /// so a record renewed meanwhile stays), and the old ConfigMap once it holds no record
    /// in force and none that does not decode. Records that do not decode are never
    /// deleted: their expiry is unknown, and a newer release may have written them.
    pub async fn sweep(&self, now: Timestamp) -> Result<Swept, Error> {
        let current = self.current();
        let expired: Vec<(String, String)> = current
            .versions
            .iter()
            .filter(|(key, _)| current.records.get(key).is_some_and(|r| r.is_expired(now)))
            .map(|(key, version)| (key.clone(), version.clone()))
            .collect();
        let results: Vec<Result<bool, Error>> = futures::stream::iter(expired)
            .map(|(key, version)| async move {
                let params = DeleteParams {
                    preconditions: Some(Preconditions {
                        resource_version: Some(version),
                        uid: None,
                    }),
                    ..Default::default()
                };
                match self.api.delete(&object_name(&key), &params).await {
                    Ok(_) => Ok(true),
                    Err(e) if matches!(code(&e), Some(404) | Some(409)) => Ok(false),
                    Err(e) => Err(ApiError::on("upper", "delete", self.what(&key))(e).into()),
                }
            })
            .buffer_unordered(SWEEP_CONCURRENCY)
            .collect()
            .await;
        let mut swept = Swept::default();
        for r in results {
            swept.records += usize::from(r?);
        }
        if let Some(legacy) = &current.legacy
            && legacy.unreadable == 0
            && !legacy.any_live(now)
        {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: legacy.resource_version.clone(),
                    uid: None,
                }),
                ..Default::default()
            };
            match self.legacy.delete(&self.location.name, &params).await {
                Ok(_) => swept.legacy = true,
                Err(e) if matches!(code(&e), Some(404) | Some(409)) => {}
                Err(e) => {
                    return Err(
                        ApiError::on("upper", "delete", format!("ConfigMap {}", self.location))(e).into(),
                    );
                }
            }
        }
        Ok(swept)
    }
}
