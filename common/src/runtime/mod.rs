//! How a daemon runs: a [`Daemon`] builds its clients, its admin endpoint and its part in a
//! leader election, then runs named tasks under one [`Supervisor`], stopped together on
//! SIGTERM or SIGINT (or a token the caller cancels) within a bounded drain, or when any one
//! of them ends (none should), which is then named with its reason.
//!
//! A task either stops at once when shutdown begins ([`Supervisor::spawn`]: watches,
//! servers) or is handed the shutdown token and finishes its work in hand first
//! ([`Supervisor::spawn_graceful`]: controllers, whose reconciles then never stop half-way).

mod daemon;

use std::fmt::Debug;
use std::time::Duration;

pub use tokio_util::sync::CancellationToken;

pub use self::daemon::{Daemon, Running};
pub use crate::supervisor::{Stopped, Supervisor, TaskOutput};

/// Aborts the process as `kill -9` would end it (nothing cleaned up, no Lease released) when
/// `crash_at` is `step`: a daemon's hidden `--crash-at` flag, with which tests prove that a
/// restart after any step of a multi-write task finishes it exactly once.
pub fn crash_point<S: PartialEq + Debug>(process: &str, crash_at: Option<S>, step: S) {
    if crash_at.as_ref() == Some(&step) {
        eprintln!("{process}: --crash-at={step:?}: aborting");
        std::process::abort();
    }
}

/// The steps at which a daemon's hidden `--crash-at` aborts it ([`crash_point`]), named with
/// the daemon's process; made by [`Daemon::crash_points`]. The default aborts nowhere.
#[derive(Clone, Copy, Debug)]
pub struct CrashPoints<S> {
    process: &'static str,
    at: Option<S>,
}

impl<S> Default for CrashPoints<S> {
    fn default() -> Self {
        Self {
            process: "",
            at: None,
        }
    }
}

impl<S: PartialEq + Debug> CrashPoints<S> {
    /// Aborts the process if `--crash-at` named `step`.
    pub fn reached(&self, step: S) {
        crash_point(self.process, self.at.as_ref(), &step);
    }
}

/// How long graceful tasks get to finish after shutdown begins, unless a daemon says otherwise.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(10);

/// A token cancelled on the first SIGTERM or SIGINT (logged with the signal's name).
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = cancel.cancelled() => return,
        };
        tracing::info!("{name} received: stopping");
        cancel.cancel();
    });
    Ok(token)
}
