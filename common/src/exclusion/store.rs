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
    #[error("exclusion record {0}: still conflicting after {1} attempts")]
    Conflict(String, usize),
}

/// Attempts of one write when its resourceVersion was stale.
const ATTEMPTS: usize = 5;
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

    /// Sets the record of workload `key`: one object written, none other read or touched.
    /// Returns once the writer's own watch shows it (or after 2 s), so that readers, which
    /// get the same event at about the same moment, most likely have it too.
    pub async fn put(&self, key: &str, record: &Record) -> Result<(), Error> {
        let name = object_name(key);
        let pp = PostParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        let mut version = self.current().versions.get(key).cloned();
        for _ in 0..ATTEMPTS {
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
                    self.wait_seen(key, object.metadata.resource_version.as_deref())
                        .await;
                    return Ok(());
                }
                // Created meanwhile, replaced meanwhile, or gone: start from what is there.
                Err(e) if matches!(code(&e), Some(409) | Some(404)) => {
                    version = self
                        .api
                        .get_opt(&name)
                        .await
                        .map_err(ApiError::on("upper", "get", self.what(key)))?
                        .and_then(|o| o.metadata.resource_version);
                }
                Err(e) => {
                    let verb = if version.is_some() { "replace" } else { "create" };
                    return Err(ApiError::on("upper", verb, self.what(key))(e).into());
                }
            }
        }
        Err(Error::Conflict(self.what(key), ATTEMPTS))
    }

    /// Waits until the watch shows the object of `key` at `version` (the record as the
    /// apiserver keeps it: its times in whole seconds, so never compared with ours).
    async fn wait_seen(&self, key: &str, version: Option<&str>) {
        let Some(version) = version else {
            return;
        };
        let mut seen = self.seen.clone();
        let shown = seen.wait_for(|ex| ex.versions.get(key).map(String::as_str) == Some(version));
        if tokio::time::timeout(SEEN_WITHIN, shown).await.is_err() {
            tracing::debug!(record = %self.what(key), "the watch has not shown our write after {SEEN_WITHIN:?}");
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
