//! Fixtures shared by all tests of one test binary.
//!
//! Each `#[tokio::test]` has its own runtime, which dies with the test; a shared cluster and
//! its node simulator therefore live on a runtime of their own, started once. Tests talk to
//! them through clients they build on their own runtime ([`crate::TestCluster::client`]).

use std::future::Future;
use std::sync::OnceLock;

/// A value built once per process on a dedicated runtime that lives as long as the process.
pub struct Shared<T: 'static> {
    cell: OnceLock<Result<(tokio::runtime::Runtime, T), String>>,
}

impl<T: Send + Sync + 'static> Shared<T> {
    pub const fn new() -> Self {
        Self {
            cell: OnceLock::new(),
        }
    }

    /// The shared value, built by `init` on first use. A failed start is reported to every
    /// test that asks, with the same message.
    pub fn get<F, Fut>(&'static self, init: F) -> Result<&'static T, String>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = crate::Result<T>> + Send + 'static,
    {
        let entry = self.cell.get_or_init(|| {
            // Built on a plain thread: the caller may be inside another runtime.
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("e2e-shared")
                    .enable_all()
                    .build()
                    .map_err(|e| format!("shared runtime: {e}"))?;
                let value = rt.block_on(init()).map_err(|e| e.to_string())?;
                Ok((rt, value))
            })
            .join()
            .unwrap_or_else(|_| Err("shared fixture start-up panicked".into()))
        });
        entry.as_ref().map(|(_, v)| v).map_err(Clone::clone)
    }

    /// [`Shared::get`] for a test's bed: panics, in every test that asks, with why it could
    /// not start.
    pub fn bed<F, Fut>(&'static self, init: F) -> &'static T
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = crate::Result<T>> + Send + 'static,
    {
        self.get(init).unwrap_or_else(|e| panic!("shared test bed: {e}"))
    }

    /// Runs `fut` on the fixture's runtime (for work that must outlive one test, such as
    /// starting more simulated nodes).
    pub fn handle(&'static self) -> Option<tokio::runtime::Handle> {
        self.cell
            .get()
            .and_then(|r| r.as_ref().ok())
            .map(|(rt, _)| rt.handle().clone())
    }
}

impl<T: Send + Sync + 'static> Default for Shared<T> {
    fn default() -> Self {
        Self::new()
    }
}
