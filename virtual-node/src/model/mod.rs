//! The concepts every layer reads, importing none of them: what a pod spec references
//! ([`refs`]), the kept forms of pods and nodes and the load a pod puts on its node
//! ([`trim`]), what of each reflected kind travels below ([`reflected`]), and a lower
//! autoscaler's Event read as a scale-up signal on a pending pod ([`scale_ups`]). The node's
//! identity below is `tensile_common::lower::identity`, shared with the cluster controller.

pub mod reflected;
pub mod refs;
pub mod scale_ups;
pub mod trim;
