//! Named tasks that stop together: the first to end on its own ends the daemon and is
//! named with its reason; on shutdown graceful tasks get a bounded drain. Public as
//! `runtime::Supervisor`: the runtime builds a daemon around it.
//!
//! A task either stops at once when shutdown begins ([`Supervisor::spawn`]: watches,
//! servers) or is handed the shutdown token and finishes its work in hand first
//! ([`Supervisor::spawn_graceful`]: controllers, whose reconciles then never stop half-way).

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a supervised task may return: nothing, or a result whose error says why it ended.
pub trait TaskOutput: Send + 'static {
    fn into_reason(self) -> Option<String>;
}

impl TaskOutput for () {
    fn into_reason(self) -> Option<String> {
        None
    }
}

impl TaskOutput for Option<String> {
    fn into_reason(self) -> Option<String> {
        self
    }
}

impl<E: Display + Send + 'static> TaskOutput for Result<(), E> {
    fn into_reason(self) -> Option<String> {
        self.err().map(|e| e.to_string())
    }
}

/// Why a supervised daemon stopped, when it was not asked to.
#[derive(Debug, thiserror::Error)]
#[error("{task} stopped{}", .reason.as_ref().map(|r| format!(": {r}")).unwrap_or_else(|| " unexpectedly".into()))]
pub struct Stopped {
    pub task: &'static str,
    pub reason: Option<String>,
}

/// Named tasks that stop together.
pub struct Supervisor {
    shutdown: CancellationToken,
    drain: Duration,
    tasks: JoinSet<(&'static str, Option<String>)>,
    names: HashMap<tokio::task::Id, &'static str>,
}

impl Supervisor {
    /// Tasks stop when `shutdown` is cancelled (for example on SIGTERM);
    /// graceful ones get `drain` to finish.
    pub fn new(shutdown: CancellationToken, drain: Duration) -> Self {
        Self {
            shutdown,
            drain,
            tasks: JoinSet::new(),
            names: HashMap::new(),
        }
    }

    /// A task that is simply dropped when shutdown begins.
    pub fn spawn<F>(&mut self, name: &'static str, task: F)
    where
        F: Future + Send + 'static,
        F::Output: TaskOutput,
    {
        let shutdown = self.shutdown.clone();
        self.spawn_graceful(name, move |_| async move {
            match shutdown.run_until_cancelled(task).await {
                Some(out) => out.into_reason(),
                None => None,
            }
        });
    }

    /// A task handed the shutdown token: it must end by itself once the token is cancelled,
    /// within the drain, or it is aborted.
    pub fn spawn_graceful<F, Fut>(&mut self, name: &'static str, task: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: TaskOutput,
    {
        let fut = task(self.shutdown.clone());
        let handle = self.tasks.spawn(async move { (name, fut.await.into_reason()) });
        self.names.insert(handle.id(), name);
    }

    /// Runs until shutdown is asked for (then `Ok`) or a task ends on its own (then
    /// [`Stopped`] names it); either way every task is stopped, graceful ones within the drain.
    pub async fn run(mut self) -> Result<(), Stopped> {
        let first = tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => None,
            Some(ended) = self.tasks.join_next_with_id() => match ended {
                // A graceful task that saw the shutdown first and ended: it was asked to.
                _ if self.shutdown.is_cancelled() => None,
                Ok((_, (name, reason))) => Some(Stopped { task: name, reason }),
                Err(e) => Some(Stopped {
                    task: self.names.get(&e.id()).copied().unwrap_or("a task"),
                    reason: Some(if e.is_panic() { "it panicked".into() } else { e.to_string() }),
                }),
            },
        };
        if let Some(stopped) = &first {
            tracing::error!("{stopped}; stopping every other task");
        }
        self.shutdown.cancel();
        let drained = tokio::time::timeout(self.drain, async {
            while let Some(ended) = self.tasks.join_next_with_id().await {
                if let Ok((id, (name, Some(reason)))) = &ended {
                    tracing::warn!(task = name, "ended while stopping: {reason}");
                    self.names.remove(id);
                } else if let Ok((id, _)) = &ended {
                    self.names.remove(id);
                } else if let Err(e) = &ended {
                    self.names.remove(&e.id());
                }
            }
        })
        .await;
        if drained.is_err() {
            let mut left: Vec<&str> = self.names.values().copied().collect();
            left.sort_unstable();
            tracing::warn!(
                "still running after the {:?} drain, aborted: {}",
                self.drain,
                left.join(", ")
            );
            self.tasks.abort_all();
        }
        match first {
            Some(stopped) => Err(stopped),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test(start_paused = true)]
    async fn the_first_task_to_end_is_named_with_its_reason_and_the_others_stop() {
        let shutdown = CancellationToken::new();
        let mut sup = Supervisor::new(shutdown.clone(), Duration::from_secs(5));
        let finished = Arc::new(AtomicBool::new(false));
        let f = finished.clone();
        sup.spawn("the watch", futures::future::pending::<()>());
        sup.spawn_graceful("the controller", move |stop| async move {
            stop.cancelled().await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            f.store(true, Ordering::SeqCst);
        });
        sup.spawn("the lease", async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Err::<(), _>("lost the Lease")
        });
        let err = sup.run().await.unwrap_err();
        assert_eq!(err.to_string(), "the lease stopped: lost the Lease");
        assert!(shutdown.is_cancelled());
        assert!(
            finished.load(Ordering::SeqCst),
            "graceful work finished in the drain"
        );
    }

    #[tokio::test]
    async fn a_graceful_task_that_ends_as_soon_as_it_is_told_is_no_failure() {
        for _ in 0..200 {
            let shutdown = CancellationToken::new();
            let mut sup = Supervisor::new(shutdown.clone(), Duration::from_secs(5));
            sup.spawn_graceful("the kubelet API", |stop| async move { stop.cancelled().await });
            let signal = shutdown.clone();
            let run = tokio::spawn(sup.run());
            tokio::task::yield_now().await;
            signal.cancel();
            assert!(
                run.await.unwrap().is_ok(),
                "a SIGTERM is not a task stopping on its own"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_is_not_an_error_and_a_task_that_ignores_it_is_aborted_at_the_drain() {
        let shutdown = CancellationToken::new();
        let mut sup = Supervisor::new(shutdown.clone(), Duration::from_secs(2));
        sup.spawn_graceful("a stubborn task", |_| futures::future::pending::<()>());
        let started = tokio::time::Instant::now();
        shutdown.cancel();
        assert!(sup.run().await.is_ok());
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_panicking_task_is_named() {
        let mut sup = Supervisor::new(CancellationToken::new(), Duration::from_secs(1));
        sup.spawn("the resync", async {
            if std::hint::black_box(true) {
                panic!("boom");
            }
        });
        let err = sup.run().await.unwrap_err();
        assert_eq!(err.task, "the resync");
        assert_eq!(err.reason.as_deref(), Some("it panicked"));
    }
}
