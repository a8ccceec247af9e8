//! descheduler: finds pods a lower cluster cannot place and moves them to another
//! virtual node.
//!
//! Not built yet: this crate has no behaviour and ships no binary until it does.
