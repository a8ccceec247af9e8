//! What a virtual node decides: pure planners, one per concern, each taking snapshots of the
//! world and returning what should be written. None calls an API or reads a clock it was not
//! given, so each is unit-tested on small objects.
//!
//! - [`pods`]: one upper pod and its lower pod to a `Step`.
//! - [`translate`]: an upper pod to its lower pod, update patches, and the status going up.
//! - [`copies`]: which ConfigMaps, Secrets, Services and Endpoints pods need below, and the
//!   writes that make the copies so.
//! - [`volumes`]: the claims pods mount, made below, and the upper volumes standing for them.
//! - [`node`]: the heartbeat's judge (register, status, lease) and the Node's metadata.
//! - [`capacity`]: capacity, allocatable and the capacity shape from lower nodes and pods.
//! - [`features`]: pod features a lower cluster may lack, and the node features declared.
//! - [`tokens`]: which upper service-account tokens a pod gets below, and when they renew.
//! - [`certificates`]: pod certificates and trust bundles a pod gets below, and when they
//!   refresh.
//! - [`credentials`]: the lower Secret of a pod's upper credentials, either kind.
//!
//! The override rules themselves (their format, checks and application) are
//! `tensile_common::lower::overrides`, shared with the cluster controller.

pub mod capacity;
pub mod certificates;
pub mod copies;
pub mod credentials;
pub mod features;
pub mod node;
pub mod pods;
pub mod tokens;
pub mod translate;
pub mod volumes;
