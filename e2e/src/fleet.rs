//! The `fleet` benchmark: pods through several virtual nodes over as many lower clusters on
//! one machine, every cluster a control plane of its own on one shared etcd.
//!
//! `clusters` lower clusters, each with simulated nodes and a `virtual-node` process of its
//! own; `pods_per_node` pods bound to each virtual node, created upstream at `rate` a second
//! in all (round robin over the nodes): created → all Running, each virtual node's CPU per
//! pod and RSS, the CPU of every control plane, etcd and this process (the simulated
//! kubelets) meanwhile, and each node's idle CPU with every pod settled. Then a restart of
//! every virtual node at once with nothing changed: the writes each apiserver served. Every
//! other lower cluster runs the oldest supported version.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use serde_json::{Value, json};

use crate::benches::{CpuUse, api_writes, cpu_secs, node_ready, round3, rss};
use crate::in_process::VirtualNodeProcess;
use crate::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};

/// What the benchmark runs.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// Lower clusters, each under a virtual node of its own.
    pub clusters: usize,
    /// Pods bound to each virtual node.
    pub pods_per_node: usize,
    /// Creates per second over all nodes (0: as fast as `clients` allow).
    pub rate: u32,
    /// Creates in flight at once.
    pub clients: usize,
    /// `--kube-api-qps`/`--kube-api-burst` of every cluster's scheduler and controller-manager.
    pub test_bed_qps: Option<(u32, u32)>,
    /// Seconds of the idle window once every pod settled.
    pub idle_secs: u64,
}

/// Pods a simulated lower node holds (below the simulator's 253 addresses).
const PODS_PER_LOWER_NODE: usize = 240;

/// Control planes started at once: each apiserver's start is CPU-bound for a few seconds.
const STARTS_AT_ONCE: usize = 3;

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / 1048576.0 * 10.0).round() / 10.0
}

/// One lower cluster of the fleet, its simulated nodes and its virtual node.
struct Member {
    cluster: TestCluster,
    _sim: NodeSimulator,
    node: String,
    vn: VirtualNodeProcess,
}

impl Member {
    fn pid(&self) -> anyhow::Result<u32> {
        self.vn.pid().with_context(|| format!("{} exited", self.node))
    }
}

/// The process groups whose CPU the benchmark reports.
fn groups(upper: &TestCluster, members: &[Member], nodes: &[u32]) -> Vec<(&'static str, Vec<u32>)> {
    vec![
        ("upper_control_plane", upper.pids()),
        (
            "lower_control_planes",
            members.iter().flat_map(|m| m.cluster.pids()).collect(),
        ),
        ("etcd_shared", upper.etcd_pid().into_iter().collect()),
        ("virtual_nodes", nodes.to_vec()),
        (
            "bench_clients_watches_and_simulated_kubelets",
            vec![std::process::id()],
        ),
    ]
}

pub async fn fleet(f: &Fleet) -> anyhow::Result<Value> {
    let options = |name: &str| {
        let mut o = ClusterOptions::new("bench-fleet", name);
        o.kube_api_qps = f.test_bed_qps;
        o
    };
    let upper = TestCluster::start(options("upper")).await?;
    // Every other lower cluster runs the oldest supported version.
    let lowers: Vec<TestCluster> = futures::stream::iter(0..f.clusters)
        .map(|i| {
            let mut o = options(&format!("lower-{i}"));
            if i % 2 == 1 {
                o.version = crate::bins::version_for(crate::bins::SKEWED_CLUSTER);
            }
            TestCluster::start(o)
        })
        .buffered(STARTS_AT_ONCE)
        .try_collect()
        .await?;
    let mut members = Vec::new();
    for (i, cluster) in lowers.into_iter().enumerate() {
        let sim = NodeSimulator::start(
            cluster.client().await?,
            SimulatorOptions::new(&format!("bench-fleet-{i}"), Some(cluster.kubelet_client_ca_pem())),
            Vec::new(),
        )
        .await?;
        futures::stream::iter(0..f.pods_per_node.div_ceil(PODS_PER_LOWER_NODE))
            .map(|n| {
                sim.add_node(
                    NodeConfig::new(&format!("lower-{i}-{n}"))
                        .resource("pods", &PODS_PER_LOWER_NODE.to_string()),
                )
            })
            .buffer_unordered(16)
            .try_collect::<()>()
            .await?;
        let node = format!("vn-fleet-{i}");
        let vn = VirtualNodeProcess::start(&upper, &node, &cluster, &[], &format!("fleet-{i}"))?;
        members.push(Member {
            cluster,
            _sim: sim,
            node,
            vn,
        });
    }
    for m in &members {
        node_ready(&upper, &m.node).await?;
    }
    upper.create_namespace("fleet").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let pids: Vec<u32> = members.iter().map(Member::pid).collect::<anyhow::Result<_>>()?;
    let rss_before: Vec<u64> = pids.iter().map(|p| rss(*p)).collect::<anyhow::Result<_>>()?;
    let cpu_before: Vec<f64> = pids.iter().map(|p| cpu_secs(*p)).collect::<anyhow::Result<_>>()?;
    let cpu = CpuUse::start(groups(&upper, &members, &pids))?;
    let pods = f.clusters * f.pods_per_node;
    let nodes: Vec<String> = members.iter().map(|m| m.node.clone()).collect();
    let container =
        json!([{"name": "c", "image": "x", "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}]);
    let started = Instant::now();
    let run = crate::scale::created_to_running(
        Api::namespaced(upper.client().await?, "fleet"),
        pods,
        f.clients,
        (f.rate > 0).then_some(f.rate),
        Arc::default(),
        |i| crate::scale::bound_pod(i, &nodes[i % nodes.len()], &container),
    )
    .await?;
    let cpu_to_running = cpu.report()?;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let settled_secs = started.elapsed().as_secs_f64();
    let cpu_settled: Vec<f64> = pids
        .iter()
        .zip(&cpu_before)
        .map(|(p, before)| Ok(cpu_secs(*p)? - before))
        .collect::<anyhow::Result<_>>()?;
    let steady: Vec<u64> = pids.iter().map(|p| rss(*p)).collect::<anyhow::Result<_>>()?;
    let peak: Vec<u64> = pids
        .iter()
        .map(|p| crate::benches::proc_memory(*p, "VmHWM"))
        .collect::<anyhow::Result<_>>()?;
    let idle_from: Vec<f64> = pids.iter().map(|p| cpu_secs(*p)).collect::<anyhow::Result<_>>()?;
    let idle_cpu = CpuUse::start(groups(&upper, &members, &pids))?;
    tokio::time::sleep(Duration::from_secs(f.idle_secs)).await;
    let idle_cpu = idle_cpu.report()?;
    let idle_ms_per_sec: Vec<f64> = pids
        .iter()
        .zip(&idle_from)
        .map(|(p, from)| {
            Ok(round3(
                (cpu_secs(*p)? - from) * 1000.0 / f.idle_secs.max(1) as f64,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let per_node: Vec<Value> = (0..members.len())
        .map(|i| {
            json!({
                "node": members[i].node,
                "kubernetes_below": members[i].cluster.version(),
                "cpu_ms_per_pod": round3(cpu_settled[i] * 1000.0 / f.pods_per_node as f64),
                "rss_mib": {"idle": mib(rss_before[i]), "steady": mib(steady[i]), "peak": mib(peak[i])},
                "idle_cpu_ms_per_sec": idle_ms_per_sec[i],
            })
        })
        .collect();

    let restart = restart_all(&upper, &mut members, f.pods_per_node).await?;
    let max = |values: &[f64]| values.iter().copied().fold(f64::NAN, f64::max);
    let cpu_ms_per_pod: Vec<f64> = cpu_settled
        .iter()
        .map(|c| c * 1000.0 / f.pods_per_node as f64)
        .collect();
    let steady_mib: Vec<f64> = steady.iter().map(|b| mib(*b)).collect();
    Ok(json!({
        "benchmark": "fleet: pods through several virtual nodes over as many lower clusters on one machine",
        "kubernetes": upper.version(),
        "clusters": f.clusters,
        "pods_per_node": f.pods_per_node,
        "pods": pods,
        "test_bed_client_qps_burst": f.test_bed_qps,
        "run": run,
        "settled_after_secs": round3(settled_secs),
        "cpu_until_all_running": cpu_to_running,
        "cpu_idle_window": idle_cpu,
        "idle_window_secs": f.idle_secs,
        "virtual_nodes": {
            "cpu_ms_per_pod_max": round3(max(&cpu_ms_per_pod)),
            "rss_steady_mib_max": max(&steady_mib),
            "idle_cpu_ms_per_sec_max": max(&idle_ms_per_sec),
            "each": per_node,
        },
        "restart_of_every_node_with_nothing_changed": restart,
    }))
}

/// Stops every virtual node with SIGTERM and starts them again at once; once each has
/// reconciled its `pods` pods (and 15 s more), the pod writes every apiserver served meanwhile.
async fn restart_all(upper: &TestCluster, members: &mut [Member], pods: usize) -> anyhow::Result<Value> {
    let upper_client = upper.client().await?;
    let mut lower_clients = Vec::new();
    for m in members.iter() {
        lower_clients.push(m.cluster.client().await?);
    }
    let upper_before = api_writes(&upper_client).await?;
    let mut lower_before = Vec::new();
    for c in &lower_clients {
        lower_before.push(api_writes(c).await?);
    }
    for m in members.iter() {
        m.vn.signal("TERM")?;
    }
    for m in members.iter_mut() {
        m.vn.exit_within(Duration::from_secs(60))
            .await
            .with_context(|| format!("{} did not stop within 60 s of SIGTERM", m.node))?;
    }
    let restarted_at = Instant::now();
    for (i, m) in members.iter_mut().enumerate() {
        m.vn = VirtualNodeProcess::start(upper, &m.node, &m.cluster, &[], &format!("fleet-{i}-restart"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    for m in members.iter() {
        loop {
            let reconciled =
                crate::scale::metric_sum(&m.vn.admin_addr, "tensile_virtual_node_reconcile_seconds_count")
                    .await
                    .unwrap_or(0.0);
            if reconciled >= pods as f64 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "restarted {} reconciled {reconciled} of {pods} pods in 600 s",
                m.node
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let caught_up = restarted_at.elapsed();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let upper_writes = crate::scale::writes_between(&upper_before, &api_writes(&upper_client).await?);
    let mut lower_pod_writes = 0.0;
    let mut lower = Vec::new();
    for (c, before) in lower_clients.iter().zip(&lower_before) {
        let w = crate::scale::writes_between(before, &api_writes(c).await?);
        lower_pod_writes += w["pod_writes"].as_f64().unwrap_or(0.0);
        lower.push(w);
    }
    Ok(json!({
        "every_pod_reconciled_after_secs": round3(caught_up.as_secs_f64()),
        "upper_apiserver": upper_writes,
        "lower_apiservers_pod_writes": lower_pod_writes,
        "lower_apiservers": lower,
        "note": "writes from SIGTERM until 15 s after every node reconciled its pods once; node status and lease writes are the heartbeat's",
    }))
}
