//! Shared pieces of the tensile suite: the admin endpoint ([`admin`]), the one place every label, annotation and taint
//! name is defined ([`names`]), the codec of the stashed lower-cluster constraints
//! ([`stash`]), client construction from a kubeconfig with errors that name
//! the file ([`kubeconfig`]), exact resource arithmetic ([`quantity`], [`resources`]), the
//! kubelet API's shared parsing ([`kubelet`]), and logging set-up shared by every binary ([`telemetry`]).

pub mod admin;
pub mod kubeconfig;
pub mod kubelet;
pub mod names;
pub mod quantity;
pub mod resources;
pub mod stash;
pub mod telemetry;
