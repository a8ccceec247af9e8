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

    /// Sets the record of workload `key`.
    pub async fn put(&self, key: &str, record: &Record, _now: Timestamp) -> Result<(), Error> {
        self.writer.put(key, record).await?;
        tokio::time::sleep(SETTLE).await;
        Ok(())
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
