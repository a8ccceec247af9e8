//! Shared pieces of the tensile suite: the one place every label, annotation and taint
//! name is defined ([`names`]), client construction from a kubeconfig with errors that name
//! the file ([`kubeconfig`]), and logging set-up shared by every binary ([`telemetry`]).

pub mod kubeconfig;
pub mod names;
pub mod telemetry;
