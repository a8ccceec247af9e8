//! Shared pieces of the tensile suite: the admin endpoint ([`admin`]), the one place every label, annotation and taint
//! name is defined ([`names`]), the codec of the stashed lower-cluster constraints
//! ([`stash`]), client construction from a kubeconfig with errors that name
//! the file ([`kubeconfig`]), exact resource arithmetic ([`quantity`], [`resources`]), the
//! kubelet API's shared parsing ([`kubelet`]), logging set-up shared by every binary ([`telemetry`]),
//! and the memory allocator every binary uses ([`Allocator`]).

pub mod admin;
pub mod kubeconfig;
pub mod kubelet;
pub mod names;
pub mod quantity;
pub mod resources;
pub mod stash;
pub mod telemetry;

/// The global allocator of every tensile binary: mimalloc. Admission reviews and watch events
/// are decoded into many small strings and maps that live for one request; with the system
/// allocator, allocating and freeing them was a fifth of the webhook's CPU time.
pub use mimalloc::MiMalloc as Allocator;
