//! A virtual node run inside the test process, so tests can crash and restart it at will.

use clap::Parser as _;

use crate::{TestCluster, free_port};

/// A virtual node running in process; dropping it is a crash (no clean-up runs).
pub struct VirtualNode {
    pub kubelet_port: u16,
    pub admin_addr: String,
    task: tokio::task::JoinHandle<Result<(), tensile_virtual_node::Error>>,
}

impl VirtualNode {
    /// Starts `virtual-node --nodename NAME` for `upper` over `lower`, with the flags a test
    /// bed needs (loopback node IP, free ports, the upper kubelet-client CA) plus `extra`.
    pub fn start(
        upper: &TestCluster,
        name: &str,
        lower: &TestCluster,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_on_port(upper, name, lower, extra, free_port()?)
    }

    /// As [`VirtualNode::start`], on a given kubelet port (a restart keeps its port).
    pub fn start_on_port(
        upper: &TestCluster,
        name: &str,
        lower: &TestCluster,
        extra: &[&str],
        kubelet_port: u16,
    ) -> anyhow::Result<Self> {
        let admin_addr = format!("127.0.0.1:{}", free_port()?);
        let mut argv: Vec<String> = vec![
            "virtual-node".into(),
            format!("--kubeconfig={}", upper.kubeconfig().display()),
            format!("--client-kubeconfig={}", lower.kubeconfig().display()),
            format!("--nodename={name}"),
            "--node-ip=127.0.0.1".into(),
            format!("--kubelet-port={kubelet_port}"),
            format!("--admin-addr={admin_addr}"),
            format!("--client-verify-ca={}", upper.kubelet_client_ca_path().display()),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = tensile_virtual_node::Args::try_parse_from(argv)?;
        Ok(VirtualNode {
            kubelet_port,
            admin_addr,
            task: tokio::spawn(tensile_virtual_node::run(args)),
        })
    }
}

impl Drop for VirtualNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}
