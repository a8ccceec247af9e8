//! The override rules in force: read from `--overrides-file` and followed as it changes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use tensile_common::lower::overrides::{Compiled, read};

/// The overrides in force, swapped whole when a valid set is loaded.
#[derive(Clone)]
pub struct Current {
    sender: Arc<tokio::sync::watch::Sender<Arc<Compiled>>>,
}

impl Current {
    pub fn new(compiled: Compiled) -> Self {
        Self {
            sender: Arc::new(tokio::sync::watch::channel(Arc::new(compiled)).0),
        }
    }

    pub fn get(&self) -> Arc<Compiled> {
        self.sender.borrow().clone()
    }

    fn set(&self, compiled: Compiled) {
        self.sender.send_replace(Arc::new(compiled));
    }

    /// One item each time another set comes into force.
    pub fn changes(&self) -> impl Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.sender.subscribe(), |mut rx| async move {
            rx.changed().await.ok()?;
            Some(((), rx))
        })
    }
}

/// Follows the overrides file (a ConfigMap volume the kubelet swaps) from `last`, the bytes
/// the rules in force were read from: a changed file's rules come into force when they are
/// valid (counted in `counts.0`); otherwise the reason is logged and counted (`counts.1`),
/// and the rules in force stay.
pub async fn follow(
    path: PathBuf,
    current: Current,
    every: Duration,
    last: Vec<u8>,
    counts: (Counter, Counter),
) {
    let (loaded, refused) = counts;
    let mut last = Some(last);
    loop {
        tokio::time::sleep(every).await;
        let now = match std::fs::read(&path) {
            Ok(now) => now,
            Err(e) => {
                if last.is_some() {
                    tracing::warn!(file = %path.display(), "overrides file unreadable ({e}); the rules in force stay");
                }
                last = None;
                continue;
            }
        };
        if last.as_ref() == Some(&now) {
            continue;
        }
        let checked = read(&path, &now);
        last = Some(now);
        match checked {
            Ok(compiled) => {
                tracing::info!(
                    file = %path.display(),
                    rules = compiled.source().rules.len(),
                    storage_classes = compiled.source().storage_classes.len(),
                    "overrides loaded; they apply to pods created from now on"
                );
                current.set(compiled);
                loaded.inc();
            }
            Err(e) => {
                refused.inc();
                tracing::error!("overrides refused, the rules in force stay: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensile_common::lower::overrides::load;

    #[tokio::test]
    async fn the_file_is_followed_and_a_bad_edit_keeps_the_rules_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("overrides.yaml");
        std::fs::write(&path, "rules: [{name: one, labels: {v: '1'}}]").unwrap();
        let (first, bytes) = load(&path).unwrap();
        let current = Current::new(first);
        let (loaded, rejected) = (Counter::default(), Counter::default());
        let task = tokio::spawn(follow(
            path.clone(),
            current.clone(),
            Duration::from_millis(10),
            bytes,
            (loaded.clone(), rejected.clone()),
        ));
        let names = |c: &Current| {
            c.get()
                .source()
                .rules
                .iter()
                .map(|r| r.name.clone())
                .collect::<Vec<_>>()
        };
        let mut changes = Box::pin(current.changes());
        std::fs::write(&path, "rules: [{name: two, labels: {v: '2'}}]").unwrap();
        futures::StreamExt::next(&mut changes).await;
        assert_eq!(names(&current), ["two"]);
        assert_eq!(loaded.get(), 1);
        std::fs::write(&path, "rules: [{name: Three}]").unwrap();
        while rejected.get() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(names(&current), ["two"], "the rules in force stay");
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(names(&current), ["two"], "a missing file removes no rule");
        task.abort();
        assert!(load(&path).unwrap_err().0.contains("overrides.yaml"));
    }
}
