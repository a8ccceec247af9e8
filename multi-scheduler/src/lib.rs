//! multi-scheduler: picks only virtual nodes whose lower cluster really has a node that
//! fits the pod.
//!
//! Built so far: the [`filter`], a pure function that judges one pod against one virtual
//! node from the [capacity shape](tensile_common::shape) the node publishes and the pod's
//! stashed lower-cluster constraints. Not built yet: the extender and scheduler modes that
//! would serve it; this crate ships no binary until they exist.

pub mod filter;
