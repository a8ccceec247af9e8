//! What the virtual node and the cluster controller both know of a lower cluster, with this
//! module as its one owner: who a node is below and the marks it puts on what it makes
//! ([`identity`]), the override rules a lower cluster's pods go down under ([`overrides`]),
//! the kinds a lower cluster serves and whether a namespace holds anything ([`objects`]),
//! and the removal of everything a node made there ([`teardown`]).

pub mod identity;
pub mod objects;
pub mod overrides;
pub mod teardown;
