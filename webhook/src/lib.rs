//! webhook: the mutating admission webhook that moves an opted-in pod's nodeSelector,
//! node affinity and tolerations into the `clusterSelector` stash for the lower cluster.
//!
//! Not built yet: this crate has no behaviour and ships no binary until it does.
