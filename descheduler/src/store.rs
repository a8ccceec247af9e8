//! Writing exclusion records into the exclusions ConfigMap (see
//! [`tensile_common::exclusion`] for the format and why it is one ConfigMap).
//!
//! Every write is a read-modify-write guarded by the resourceVersion it read, retried on a
//! conflict; expired entries are dropped on the way. After a write the store waits (briefly)
//! until its own watch shows it: by then the webhook's watch has most likely seen it too,
//! so the replacement its owner creates right after the eviction gets the exclusion.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use tensile_common::api::ApiError;
use tensile_common::exclusion::{Exclusions, Location, Record};
use tokio::sync::watch;

/// Field manager / label value of what the descheduler writes.
pub const MANAGER: &str = "tensile-descheduler";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("encoding the exclusion record: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("exclusions ConfigMap {0}: still conflicting after {1} attempts")]
    Conflict(String, usize),
}

/// The exclusions ConfigMap: read from a watch, written by the leader.
#[derive(Clone)]
pub struct Store {
    api: Api<ConfigMap>,
    location: Location,
    seen: watch::Receiver<Arc<Exclusions>>,
}

const ATTEMPTS: usize = 5;
/// Extra wait after our own watch showed a write, before the eviction it precedes.
const SETTLE: Duration = Duration::from_millis(250);

impl Store {
    pub fn new(client: kube::Client, location: Location, seen: watch::Receiver<Arc<Exclusions>>) -> Self {
        Self {
            api: Api::namespaced(client, &location.namespace),
            location,
            seen,
        }
    }

    /// The records as the watch last showed them.
    pub fn current(&self) -> Arc<Exclusions> {
        self.seen.borrow().clone()
    }

    /// Sets the record of workload `key`.
    pub async fn put(&self, key: &str, record: &Record, now: Timestamp) -> Result<(), Error> {
        let mut base = self.current();
        for _ in 0..ATTEMPTS {
            let mut next = (*base).clone();
            next.records.insert(key.to_owned(), record.clone());
            let data = next.to_data(now)?;
            match self.write(base.resource_version.as_deref(), data).await {
                Ok(rv) => {
                    self.wait_seen(&rv).await;
                    return Ok(());
                }
                Err(e) if tensile_common::api::code(&e) == Some(409) => {
                    base = Arc::new(self.read().await?);
                }
                Err(e) => {
                    return Err(
                        ApiError::on("upper", "write", format!("ConfigMap {}", self.location))(e).into(),
                    );
                }
            }
        }
        Err(Error::Conflict(self.location.to_string(), ATTEMPTS))
    }

    async fn read(&self) -> Result<Exclusions, ApiError> {
        let cm = self.api.get_opt(&self.location.name).await.map_err(ApiError::on(
            "upper",
            "get",
            format!("ConfigMap {}", self.location),
        ))?;
        Ok(cm.map(|cm| Exclusions::from_config_map(&cm)).unwrap_or_default())
    }

    /// Creates the ConfigMap (`rv` `None`) or replaces it at `rv`; returns the new version.
    async fn write(&self, rv: Option<&str>, data: BTreeMap<String, String>) -> Result<String, kube::Error> {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.location.name.clone()),
                namespace: Some(self.location.namespace.clone()),
                resource_version: rv.map(str::to_owned),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    MANAGER.to_owned(),
                )])),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        };
        let pp = PostParams {
            field_manager: Some(MANAGER.into()),
            ..Default::default()
        };
        let written = match rv {
            None => self.api.create(&pp, &cm).await?,
            Some(_) => self.api.replace(&self.location.name, &pp, &cm).await?,
        };
        Ok(written.metadata.resource_version.unwrap_or_default())
    }

    async fn wait_seen(&self, rv: &str) {
        let mut seen = self.seen.clone();
        let shown = seen.wait_for(|ex| ex.resource_version.as_deref() == Some(rv));
        if tokio::time::timeout(Duration::from_secs(2), shown).await.is_err() {
            tracing::debug!(configmap = %self.location, "the watch has not shown our write after 2 s");
        }
        // Other watchers (the webhook's) get the same event at about the same moment; a
        // moment more lets a busy one decode it before the owner's replacement arrives.
        tokio::time::sleep(SETTLE).await;
    }
}
