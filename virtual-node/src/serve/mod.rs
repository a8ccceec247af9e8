//! What a virtual node serves: the kubelet API over TLS. [`kubelet`] holds the listener,
//! the client authentication and authorization and the pod a path may reach; [`routes`]
//! sends each request to its handler; [`logs`] forwards
//! `containerLogs`, [`streams`] relays exec, attach and port-forward, and [`stats`] answers
//! the summary and resource metrics from the lower nodes' own.

pub mod kubelet;
pub mod logs;
pub mod routes;
pub mod stats;
pub mod streams;
