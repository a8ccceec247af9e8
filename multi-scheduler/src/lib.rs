//! multi-scheduler: picks only virtual nodes whose lower cluster really has a node that
//! fits the pod.
//!
//! Not built yet: this crate has no behaviour and ships no binary until it does.
