//! Every label, annotation, taint and condition name the suite reads or writes.
//!
//! Names users already know from tensile-kube keep their spelling so workloads migrate
//! unchanged; everything the suite adds on its own lives under [`PREFIX`].

/// The prefix of every name the suite introduces.
pub const PREFIX: &str = "tensile.io/";

/// Per-pod annotation that tells the test bed's node simulator how a pod behaves
/// (timings, exit code, restarts). Its grammar is documented in the e2e crate's
/// `simulator::Behavior`; real clusters ignore it.
pub const SIM_BEHAVIOR: &str = "tensile.io/sim";

/// Label the node simulator puts on the Nodes it manages, with the simulator's name as value,
/// so several simulators can share one cluster without touching each other's nodes.
pub const SIM_MANAGED_BY: &str = "tensile.io/simulated-by";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suite_names_share_the_prefix() {
        for name in [SIM_BEHAVIOR, SIM_MANAGED_BY] {
            assert!(name.starts_with(PREFIX), "{name} is outside {PREFIX}");
        }
    }
}
