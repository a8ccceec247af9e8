//! Benchmarks on the local test bed; each writes its figures as JSON under `--out`.
//!
//! `simulator`: N pods bound directly to M simulated nodes (no scheduler in the way); measures
//! how fast the node simulator takes them from created to Running, per pod and overall.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tensile_e2e::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};

#[derive(Parser, Debug)]
#[command(name = "bench", about = "Benchmarks on the local test bed")]
struct Cli {
    /// Directory for the JSON figures.
    #[arg(long, env = "BENCH_OUT", default_value = "target/bench")]
    out: PathBuf,
    /// Pods for the simulator benchmark.
    #[arg(long, env = "BENCH_SIM_PODS", default_value_t = 5000)]
    sim_pods: usize,
    /// Simulated nodes for the simulator benchmark.
    #[arg(long, env = "BENCH_SIM_NODES", default_value_t = 50)]
    sim_nodes: usize,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tensile_common::telemetry::init(&tensile_common::telemetry::LogArgs {
        level: "warn,kube_client=off".into(),
        format: tensile_common::telemetry::LogFormat::Plain,
    })?;
    let rt = tokio::runtime::Runtime::new().context("async runtime")?;
    rt.block_on(async {
        std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
        let figures = simulator(cli.sim_pods, cli.sim_nodes).await?;
        let path = cli.out.join("simulator.json");
        std::fs::write(&path, serde_json::to_string_pretty(&figures)?)
            .with_context(|| path.display().to_string())?;
        println!("{}", serde_json::to_string_pretty(&figures)?);
        println!("written to {}", path.display());
        Ok(())
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

async fn simulator(pods: usize, nodes: usize) -> anyhow::Result<serde_json::Value> {
    let mut options = ClusterOptions::new("bench", "simulator");
    options.scheduler = false;
    let cluster = TestCluster::start(options).await?;
    let per_node = pods.div_ceil(nodes.max(1)) + 10;
    let configs = (0..nodes)
        .map(|i| NodeConfig::new(&format!("sim-{i}")).resource("pods", &per_node.to_string()))
        .collect();
    let sim_options = SimulatorOptions::new("bench", Some(cluster.kubelet_client_ca_pem()));
    let _sim = NodeSimulator::start(cluster.client().await?, sim_options, configs).await?;
    let client = cluster.client().await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");

    // Observe Running through a watch, as a user's kubectl would.
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let running: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let watch = {
        let running = running.clone();
        let stream = watcher(api.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects();
        tokio::spawn(async move {
            let mut stream = stream.boxed();
            while let Some(Ok(pod)) = stream.next().await {
                if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    && let (Some(name), Ok(mut r)) = (pod.metadata.name, running.lock())
                {
                    r.entry(name).or_insert_with(Instant::now);
                }
            }
        })
    };

    let start = Instant::now();
    futures::stream::iter(0..pods)
        .map(|i| {
            let api = api.clone();
            let created = created.clone();
            async move {
                let name = format!("bench-{i}");
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": name},
                    "spec": {"nodeName": format!("sim-{}", i % nodes), "containers": [{"name": "c", "image": "x"}]},
                }))?;
                let t = Instant::now();
                api.create(&PostParams::default(), &pod).await?;
                if let Ok(mut c) = created.lock() {
                    c.insert(name, t);
                }
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await?;
    let create_secs = start.elapsed().as_secs_f64();

    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let n = running.lock().map(|r| r.len()).unwrap_or(0);
        if n >= pods || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all_running_secs = start.elapsed().as_secs_f64();
    watch.abort();
    let (created, running) = (
        created.lock().map(|c| c.clone()).unwrap_or_default(),
        running.lock().map(|r| r.clone()).unwrap_or_default(),
    );
    let mut latencies: Vec<f64> = created
        .iter()
        .filter_map(|(name, t0)| {
            running
                .get(name)
                .map(|t1| t1.saturating_duration_since(*t0).as_secs_f64() * 1000.0)
        })
        .collect();
    latencies.sort_by(|a, b| a.total_cmp(b));
    Ok(serde_json::json!({
        "benchmark": "node simulator: created -> Running",
        "kubernetes": cluster.version(),
        "pods": pods,
        "nodes": nodes,
        "running": running.len(),
        "create_secs": create_secs,
        "creates_per_sec": pods as f64 / create_secs,
        "all_running_secs": all_running_secs,
        "running_per_sec": running.len() as f64 / all_running_secs,
        "lag_after_last_create_secs": all_running_secs - create_secs,
        "latency_ms_p50": percentile(&latencies, 0.50),
        "latency_ms_p99": percentile(&latencies, 0.99),
        "latency_ms_max": latencies.last().copied().unwrap_or(f64::NAN),
        "note": "latency includes the simulator's default 100 ms start delay",
    }))
}
