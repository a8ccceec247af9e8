//! Shared pieces of the tensile suite.
//!
//! The daemon runtime every binary is assembled from: clients from a kubeconfig or the
//! pod's service account, each call under a deadline ([`kubeconfig`], [`deadline`]); watch
//! caches with a synced signal every waiter sees ([`cache`]); named tasks stopped together
//! on SIGTERM within a bounded drain ([`runtime`]); leader election on Leases with writes
//! fenced by the renew deadline ([`leader`]); the admin endpoint ([`admin`]); the HTTPS
//! server with its connection limits ([`serve`]); serving certificates, from files reloaded
//! on change or generated ([`tls`]); logging ([`telemetry`]); one API error shape, the exact
//! delete and timestamps ([`api`]); eviction with preconditions on every version ([`evict`]).
//!
//! The suite's vocabulary: every label, annotation and taint name ([`names`]), the codec of
//! the stashed lower-cluster constraints ([`stash`]), the descheduler's exclusion record
//! ([`exclusion`]) and the volume pin that exempts a pod from it ([`pin`]), the one
//! predicate of whether a pod fits a virtual node's lower nodes ([`fit`]) and what a lower
//! cluster's override rules change of it ([`overrides`]), a label selector read as the API
//! reads it ([`label_selector`]); what the virtual node and the cluster controller both know
//! of a lower cluster: identity and marks, the override rules, teardown ([`lower`]); exact resource
//! arithmetic ([`quantity`], [`resources`]), the kubelet API's shared parsing ([`kubelet`]), and the
//! memory allocator every binary uses ([`Allocator`]).

pub mod admin;
pub mod api;
pub mod cache;
pub mod deadline;
pub mod evict;
pub mod exclusion;
pub mod fit;
pub mod kubeconfig;
pub mod kubelet;
pub mod label_selector;
pub mod lanes;
pub mod leader;
pub mod lower;
pub mod names;
pub mod node_identity;
pub mod overrides;
pub mod pin;
pub mod quantity;
pub mod resources;
pub mod runtime;
pub mod serve;
pub mod shape;
pub mod stash;
mod supervisor;
pub mod telemetry;
pub mod tls;
pub mod versions;

/// The global allocator of every tensile binary: mimalloc. Admission reviews and watch events
/// are decoded into many small strings and maps that live for one request; with the system
/// allocator, allocating and freeing them was a fifth of the webhook's CPU time.
pub use mimalloc::MiMalloc as Allocator;

/// Turns transparent huge pages off for this process, as the first thing a daemon does.
///
/// The allocator asks for huge pages on its large regions (`madvise`), and the kernel then
/// backs each 2 MiB of them whole as soon as one byte is touched: a daemon whose live heap is
/// spread over many partly used regions keeps megabytes it does not use. With them off, a
/// region costs the pages that were touched. A kernel without the setting leaves it as it was,
/// which is only a matter of memory, so a refusal is ignored.
pub fn small_pages_only() {
    let _ = rustix::thread::disable_transparent_huge_pages(true);
}
