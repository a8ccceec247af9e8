//! virtual-node: registers one lower cluster as one Node of the upper cluster and runs the
//! pods bound to that node in the lower cluster, reflecting their status back.
//!
//! Not built yet: this crate has no behaviour and ships no binary until it does.
