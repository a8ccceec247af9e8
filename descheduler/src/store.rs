//! The descheduler's side of the exclusion records: writes through the one writer in
//! [`tensile_common::exclusion::store`] (one small object per record), a short settle after
//! each, and a sweep of expired records at most once a minute.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tensile_common::exclusion::store::{Swept, Writer};
use tensile_common::exclusion::{Exclusions, Location, Record};
use tokio::sync::watch;

pub use tensile_common::exclusion::store::Error;

/// Field manager / label value of what the descheduler writes.
pub const MANAGER: &str = "tensile-descheduler";

/// Extra wait after our own watch showed a write, before the eviction it precedes: other
/// watchers (the webhook's) get the same event at about the same moment, and a moment more
/// lets a busy one decode it before the owner's replacement arrives.
const SETTLE: Duration = Duration::from_millis(250);
/// How often the leader deletes expired records.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The exclusion records: read from a watch, written by the leader.
#[derive(Clone)]
pub struct Store {
    writer: Writer,
    last_sweep: Arc<Mutex<Option<Instant>>>,
}

impl Store {
    pub fn new(client: kube::Client, location: Location, seen: watch::Receiver<Arc<Exclusions>>) -> Self {
        Self {
            writer: Writer::new(client, location, seen, MANAGER),
            last_sweep: Arc::default(),
        }
    }

    /// The records as the watch last showed them.
    pub fn current(&self) -> Arc<Exclusions> {
        self.writer.current()
    }

    /// Sets the record of workload `key` to `record`, computed from `exclusions` (the round's
    /// view), and brings that view up to date: with the record written, or, when the record
    /// changed meanwhile ([`Error::Changed`]: nothing written), with the record as the watch
    /// shows it now, so what the round judges next starts from it.
    pub async fn put(&self, key: &str, record: &Record, exclusions: &mut Exclusions) -> Result<(), Error> {
        let base = exclusions.versions.get(key).cloned();
        match self.writer.put(key, record, base.as_deref()).await {
            Ok(version) => {
                exclusions.records.insert(key.to_owned(), record.clone());
                exclusions.versions.insert(key.to_owned(), version);
                tokio::time::sleep(SETTLE).await;
                Ok(())
            }
            Err(e) => {
                if let Error::Changed(_) = e {
                    let now = self.current();
                    match now.records.get(key) {
                        Some(r) => exclusions.records.insert(key.to_owned(), r.clone()),
                        None => exclusions.records.remove(key),
                    };
                    match now.versions.get(key) {
                        Some(v) => exclusions.versions.insert(key.to_owned(), v.clone()),
                        None => exclusions.versions.remove(key),
                    };
                }
                Err(e)
            }
        }
    }

    /// Deletes expired records, unless a sweep ran within the last minute.
    pub async fn sweep_if_due(&self, now: Timestamp) -> Option<Result<Swept, Error>> {
        {
            let mut last = self.last_sweep.lock().ok()?;
            if last.is_some_and(|t| t.elapsed() < SWEEP_EVERY) {
                return None;
            }
            *last = Some(Instant::now());
        }
        Some(self.writer.sweep(now).await)
    }
}
