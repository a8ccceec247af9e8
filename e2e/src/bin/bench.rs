//! Benchmarks on the local test bed; each writes its figures as JSON under `--out`.
//!
//! `simulator`: N pods bound directly to M simulated nodes (no scheduler in the way); measures
//! how fast the node simulator takes them from created to Running, per pod and overall.
//!
//! `virtual-node` (`--bench virtual-node`): N pods through a virtual node versus the same pods
//! created directly in the lower cluster, bound → Running.
//!
//! `webhook` (`--bench webhook`): admission reviews over HTTPS with keep-alive on loopback,
//! sent from one thread to the webhook running in this process on a runtime of its own. A closed loop on
//! several connections gives the throughput; an open loop at a fixed rate gives latency
//! measured from each request's scheduled send time, so a stall is not hidden.
//!
//! `copies` (`--bench copies`): what the upper cluster's ConfigMaps and Secrets cost a virtual
//! node's memory when it copies none of them.
//!
//! `streams` (`--bench streams`): `kubectl exec` (a line's round trip in an open session, and a
//! whole command) and `kubectl port-forward` (MB/s through an echo, and an HTTP round trip)
//! through a virtual node versus the same against the lower pod directly, over WebSocket and
//! SPDY, reported as ratios.
//!
//! `exclusions` (`--bench exclusions`): moves per second and the latency of one exclusion
//! record's write with 10,000 live records, against the old one-ConfigMap store.
//!
//! `failback` (`--bench failback`): from a lower cluster's recovery to restored spread, for
//! 100 pods of 10 spread Deployments moved back by the descheduler's `--rebalance`, once per
//! `--rebalance-max-owners` (1 and 10).
//!
//! `multi-scheduler` (`--bench multi-scheduler`): the capacity shape of a 5,000-node lower
//! cluster, the extender's filter in process for 100 such virtual nodes, and `POST /filter`
//! over HTTPS.

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
use tensile_e2e::stats::Samples;
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
    /// Pods for the virtual-node benchmark.
    #[arg(long, env = "BENCH_VN_PODS", default_value_t = 1000)]
    vn_pods: usize,
    /// Which benchmarks to run.
    #[arg(long, env = "BENCH", value_enum, default_value_t = Which::Simulator)]
    bench: Which,
    /// Live exclusion records of the exclusions benchmark.
    #[arg(long, env = "BENCH_EXCLUSIONS_LIVE", default_value_t = 10_000)]
    exclusions_live: usize,
    /// Moves (record write, then eviction) of the exclusions benchmark.
    #[arg(long, env = "BENCH_EXCLUSIONS_MOVES", default_value_t = 300)]
    exclusions_moves: usize,
    /// Records in the old one-ConfigMap store compared with (it cannot hold 10,000).
    #[arg(long, env = "BENCH_EXCLUSIONS_OLD", default_value_t = 3000)]
    exclusions_old: usize,
    /// Deployments of the descheduler rounds benchmark.
    #[arg(long, env = "BENCH_ROUNDS_DEPLOYMENTS", default_value_t = 1000)]
    rounds_deployments: usize,
    /// Replicas of each of its Deployments.
    #[arg(long, env = "BENCH_ROUNDS_REPLICAS", default_value_t = 10)]
    rounds_replicas: usize,
    /// Its virtual nodes.
    #[arg(long, env = "BENCH_ROUNDS_NODES", default_value_t = 4)]
    rounds_nodes: usize,
    /// Its Deployments with one more replica refused below.
    #[arg(long, env = "BENCH_ROUNDS_REFUSED", default_value_t = 1000)]
    rounds_refused: usize,
    /// Rounds it measures.
    #[arg(long, env = "BENCH_ROUNDS_ROUNDS", default_value_t = 20)]
    rounds_rounds: usize,
    /// Namespaces its Deployments are spread over.
    #[arg(long, env = "BENCH_ROUNDS_NAMESPACES", default_value_t = 1)]
    rounds_namespaces: usize,
    /// Keep-alive connections for the webhook throughput run.
    #[arg(long, env = "BENCH_WEBHOOK_CONNECTIONS", default_value_t = 16)]
    webhook_connections: usize,
    /// Seconds of each webhook run (throughput, then fixed rate).
    #[arg(long, env = "BENCH_WEBHOOK_SECS", default_value_t = 10)]
    webhook_secs: u64,
    /// Reviews per second of the webhook latency run.
    #[arg(long, env = "BENCH_WEBHOOK_RATE", default_value_t = 1000)]
    webhook_rate: u64,
    /// Keep-alive connections for the extender's HTTPS run.
    #[arg(long, env = "BENCH_EXTENDER_CONNECTIONS", default_value_t = 8)]
    extender_connections: usize,
    /// Upper Secrets and as many ConfigMaps for the copies benchmark.
    #[arg(long, env = "BENCH_COPIES_OBJECTS", default_value_t = 1000)]
    copies_objects: usize,
    /// Bytes of content in each of them.
    #[arg(long, env = "BENCH_COPIES_BYTES", default_value_t = 16384)]
    copies_bytes: usize,
    /// Line round trips in one open `kubectl exec -i -- cat`, per side and transport, for the
    /// streams benchmark.
    #[arg(long, env = "BENCH_STREAMS_ROUND_TRIPS", default_value_t = 200)]
    streams_round_trips: usize,
    /// Whole `kubectl exec -- echo hi` runs per side and transport.
    #[arg(long, env = "BENCH_STREAMS_COMMANDS", default_value_t = 20)]
    streams_commands: usize,
    /// MiB through the port-forwarded echo in each round.
    #[arg(long, env = "BENCH_STREAMS_FORWARD_MIB", default_value_t = 64)]
    streams_forward_mib: u64,
    /// Port-forward rounds per side and transport.
    #[arg(long, env = "BENCH_STREAMS_FORWARD_ROUNDS", default_value_t = 3)]
    streams_forward_rounds: usize,
    /// exec sessions open at once through the virtual node (its memory under load).
    #[arg(long, env = "BENCH_STREAMS_SESSIONS", default_value_t = 100)]
    streams_sessions: usize,
    /// MiB through one port-forward (the virtual node's memory under load).
    #[arg(long, env = "BENCH_STREAMS_LOAD_MIB", default_value_t = 1024)]
    streams_load_mib: u64,
    /// Seconds of the extender's HTTPS run.
    #[arg(long, env = "BENCH_EXTENDER_SECS", default_value_t = 5)]
    extender_secs: u64,
    /// Pods of the scale benchmark (through the virtual node, and as many directly below).
    #[arg(long, env = "BENCH_SCALE_PODS", default_value_t = 10_000)]
    scale_pods: usize,
    /// Simulated lower nodes under the scale benchmark's pods.
    #[arg(long, env = "BENCH_SCALE_LOWER_NODES", default_value_t = 100)]
    scale_lower_nodes: usize,
    /// Lower cluster sizes of the scale benchmark's capacity part (comma-separated; the flag
    /// without a value skips it).
    #[arg(long, env = "BENCH_SCALE_CAPACITY_NODES", value_delimiter = ',', num_args = 0.., default_values_t = [2000, 5000])]
    scale_capacity_nodes: Vec<usize>,
    /// Creates in flight at once in the scale benchmark.
    #[arg(long, env = "BENCH_SCALE_CLIENTS", default_value_t = 64)]
    scale_clients: usize,
    /// Arrival rates (creates per second) of the scale benchmark's paced runs, each through a
    /// virtual node of its own (comma-separated; the flag without a value skips them).
    #[arg(long, env = "BENCH_SCALE_RATES", value_delimiter = ',', num_args = 0.., default_values_t = [50, 400])]
    scale_rates: Vec<u32>,
    /// Seconds of the scale benchmark's idle windows (CPU with every pod settled).
    #[arg(long, env = "BENCH_SCALE_IDLE_SECS", default_value_t = 120)]
    scale_idle_secs: u64,
    /// A directory holding another build of `virtual-node`: the scale benchmark's paced runs
    /// are made with it too, first, in the same run, for a comparison of like with like.
    #[arg(long, env = "BENCH_SCALE_BASELINE_BIN_DIR")]
    scale_baseline_bin_dir: Option<PathBuf>,
    /// Arrival rates of the scale benchmark's paced runs in which every pod references a
    /// ConfigMap and a Secret of its own and the virtual node acts as `system:node:<name>`
    /// (comma-separated; the flag without a value skips them).
    #[arg(long, env = "BENCH_SCALE_REFS_RATES", value_delimiter = ',', num_args = 0.., default_values_t = [50])]
    scale_refs_rates: Vec<u32>,
    /// Only the scale benchmark's paced runs: not the burst against the direct path, the
    /// restart and the heap profile.
    #[arg(long, env = "BENCH_SCALE_PACED_ONLY")]
    scale_paced_only: bool,
    /// Lower clusters of the fleet benchmark, each under a virtual node of its own.
    #[arg(long, env = "BENCH_FLEET_CLUSTERS", default_value_t = 10)]
    fleet_clusters: usize,
    /// Pods bound to each virtual node of the fleet benchmark.
    #[arg(long, env = "BENCH_FLEET_PODS_PER_NODE", default_value_t = 1000)]
    fleet_pods_per_node: usize,
    /// Creates per second over all of the fleet benchmark's nodes (0: unpaced).
    #[arg(long, env = "BENCH_FLEET_RATE", default_value_t = 200)]
    fleet_rate: u32,
    /// Spread Deployments of the failback benchmark.
    #[arg(long, env = "BENCH_FAILBACK_DEPLOYMENTS", default_value_t = 10)]
    failback_deployments: usize,
    /// Replicas of each of them.
    #[arg(long, env = "BENCH_FAILBACK_REPLICAS", default_value_t = 10)]
    failback_replicas: u32,
    /// The descheduler's `--rebalance-max-owners` of each failback scene (comma-separated).
    #[arg(long, env = "BENCH_FAILBACK_MAX_OWNERS", value_delimiter = ',', default_values_t = [1, 10])]
    failback_max_owners: Vec<u32>,
    /// Seconds a failback scene may take from lower-a's return to the spread restored.
    #[arg(long, env = "BENCH_FAILBACK_BUDGET", default_value_t = 900)]
    failback_budget: u64,
    /// Client QPS of the test bed's kube-scheduler and kube-controller-manager in the
    /// virtual-node and scale benchmarks (burst twice that); 0 keeps their defaults (50).
    #[arg(long, env = "BENCH_TEST_BED_QPS", default_value_t = 1000)]
    test_bed_qps: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Simulator,
    Webhook,
    VirtualNode,
    MultiScheduler,
    Copies,
    Streams,
    Scale,
    Fleet,
    Exclusions,
    Rounds,
    Failback,
    All,
}

fn write_figures(out: &std::path::Path, name: &str, figures: &serde_json::Value) -> anyhow::Result<()> {
    let path = out.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(figures)?)
        .with_context(|| path.display().to_string())?;
    println!("{}", serde_json::to_string_pretty(figures)?);
    println!("written to {}", path.display());
    Ok(())
}

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tensile_common::telemetry::init(&tensile_common::telemetry::LogArgs {
        level: "warn,kube_client=off".into(),
        format: tensile_common::telemetry::LogFormat::Plain,
    })?;
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let test_bed_qps = (cli.test_bed_qps > 0).then_some((cli.test_bed_qps, 2 * cli.test_bed_qps));
    if matches!(cli.bench, Which::Simulator | Which::VirtualNode | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        rt.block_on(async {
            if matches!(cli.bench, Which::Simulator | Which::All) {
                let figures = simulator(cli.sim_pods, cli.sim_nodes).await?;
                write_figures(&cli.out, "simulator.json", &figures)?;
            }
            if matches!(cli.bench, Which::VirtualNode | Which::All) {
                let figures = tensile_e2e::benches::virtual_node(cli.vn_pods, test_bed_qps).await?;
                write_figures(&cli.out, "virtual-node.json", &figures)?;
            }
            Ok::<_, anyhow::Error>(())
        })?;
    }
    if matches!(cli.bench, Which::Webhook | Which::All) {
        // The load client runs on this one thread; the webhook gets a runtime of its own.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("async runtime")?;
        let secs = Duration::from_secs(cli.webhook_secs.max(1));
        let figures = rt.block_on(webhook::run(
            cli.webhook_connections.max(1),
            secs,
            cli.webhook_rate.max(1),
        ))?;
        write_figures(&cli.out, "webhook.json", &figures)?;
    }
    if matches!(cli.bench, Which::Copies | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let figures = rt.block_on(tensile_e2e::benches::copies(cli.copies_objects, cli.copies_bytes))?;
        write_figures(&cli.out, "copies.json", &figures)?;
    }
    if matches!(cli.bench, Which::Streams | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let figures = rt.block_on(tensile_e2e::benches::streams(
            &tensile_e2e::benches::StreamsBench {
                round_trips: cli.streams_round_trips.max(1),
                commands: cli.streams_commands.max(1),
                forward_mib: cli.streams_forward_mib.max(1),
                forward_rounds: cli.streams_forward_rounds.max(1),
                http_requests: 50,
                sessions: cli.streams_sessions.max(1),
                load_mib: cli.streams_load_mib.max(1),
            },
        ))?;
        write_figures(&cli.out, "streams.json", &figures)?;
    }
    if matches!(cli.bench, Which::MultiScheduler | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let figures = rt.block_on(tensile_e2e::benches::multi_scheduler(
            cli.extender_secs,
            cli.extender_connections,
        ))?;
        write_figures(&cli.out, "multi-scheduler.json", &figures)?;
    }
    if matches!(cli.bench, Which::Exclusions | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let figures = rt.block_on(tensile_e2e::records::exclusions(
            cli.exclusions_live,
            cli.exclusions_moves.max(1),
            cli.exclusions_old,
        ))?;
        write_figures(&cli.out, "exclusions.json", &figures)?;
    }
    if matches!(cli.bench, Which::Rounds | Which::All) {
        let figures = tensile_e2e::rounds::rounds(&tensile_e2e::rounds::RoundsBench {
            deployments: cli.rounds_deployments.max(1),
            replicas: cli.rounds_replicas.max(1),
            nodes: cli.rounds_nodes.max(2),
            refused: cli.rounds_refused,
            rounds: cli.rounds_rounds.max(1),
            namespaces: cli.rounds_namespaces.max(1),
        })?;
        write_figures(&cli.out, "rounds.json", &figures)?;
    }
    if matches!(cli.bench, Which::Failback | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let figures = rt.block_on(tensile_e2e::failback::bench(
            &tensile_e2e::failback::FailbackBench {
                deployments: cli.failback_deployments.max(1),
                replicas: cli.failback_replicas.max(1),
                max_owners: cli.failback_max_owners.clone(),
                budget: Duration::from_secs(cli.failback_budget.max(1)),
            },
        ))?;
        write_figures(&cli.out, "failback.json", &figures)?;
    }
    if matches!(cli.bench, Which::Scale | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let scale = tensile_e2e::scale::Scale {
            pods: cli.scale_pods,
            lower_nodes: cli.scale_lower_nodes.max(1),
            capacity_nodes: cli.scale_capacity_nodes.clone(),
            clients: cli.scale_clients.max(1),
            test_bed_qps,
            rates: cli.scale_rates.clone(),
            idle_secs: cli.scale_idle_secs,
            baseline: cli.scale_baseline_bin_dir.clone(),
            refs_rates: cli.scale_refs_rates.clone(),
            unpaced: !cli.scale_paced_only,
        };
        let figures = rt.block_on(tensile_e2e::scale::scale(&scale))?;
        write_figures(&cli.out, "scale.json", &figures)?;
    }
    if matches!(cli.bench, Which::Fleet | Which::All) {
        let rt = tokio::runtime::Runtime::new().context("async runtime")?;
        let fleet = tensile_e2e::fleet::Fleet {
            clusters: cli.fleet_clusters.max(1),
            pods_per_node: cli.fleet_pods_per_node.max(1),
            rate: cli.fleet_rate,
            clients: cli.scale_clients.max(1),
            test_bed_qps,
            idle_secs: cli.scale_idle_secs,
        };
        let figures = rt.block_on(tensile_e2e::fleet::fleet(&fleet))?;
        write_figures(&cli.out, "fleet.json", &figures)?;
    }
    Ok(())
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
    let latencies: Samples = created
        .iter()
        .filter_map(|(name, t0)| {
            running
                .get(name)
                .map(|t1| t1.saturating_duration_since(*t0).as_secs_f64() * 1000.0)
        })
        .collect();
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
        "latency_ms_p50": latencies.percentile(0.50),
        "latency_ms_p99": latencies.percentile(0.99),
        "latency_ms_max": latencies.max(),
        "note": "latency includes the simulator's default 100 ms start delay",
    }))
}

mod webhook {
    //! Load client for the webhook benchmark.
    //!
    //! The client shares the cores with the webhook, so it does no more than an honest client
    //! must: each connection is one task speaking HTTP/1.1 over its TLS stream, writes each
    //! request (head and body) in one TLS write and reads the answer by its Content-Length.
    //! Every review carries a uid of its own, and every answer must be status 200 with
    //! exactly the body the webhook's code gives for that uid. That body is checked once as
    //! JSON: a v1 review allowing the pod with a JSON Patch that applies and writes the stash.

    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::Context as _;
    use base64::Engine as _;
    use rustls::pki_types::ServerName;
    use serde_json::Value;
    use tensile_webhook::{Certificates, Options};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;
    use tokio_rustls::client::TlsStream;

    use tensile_e2e::stats::Samples;

    /// The uid of the template review; requests replace its last 12 digits.
    const UID: &str = "5d2d5a8e-6f1c-4b8e-9a0f-000000000000";
    const UID_DIGITS: usize = 12;

    /// A realistic opted-in pod: selectors, affinity, tolerations, volumes, two containers.
    fn pod() -> Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-7d4b9c-x2x9p", "namespace": "shop", "generateName": "web-7d4b9c-",
                "labels": {"virtual-pod": "true", "app": "web", "pod-template-hash": "7d4b9c"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d4b9c",
                    "uid": "0b6e4e7c-3f0e-4a55-9d55-3c5e4f1f2b10", "controller": true, "blockOwnerDeletion": true}]},
            "spec": {
                "containers": [
                    {"name": "web", "image": "nginx:1.25", "ports": [{"containerPort": 80, "protocol": "TCP"}],
                     "env": [{"name": "MODE", "value": "prod"}, {"name": "REGION", "value": "eu"}],
                     "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}, {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                     "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"},
                    {"name": "sidecar", "image": "busybox:1.36", "args": ["sh", "-c", "tail -f /dev/null"],
                     "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}
                ],
                "nodeSelector": {"disk": "ssd", "cluster": "eu-1"},
                "affinity": {"nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]},
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 10, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}}]}},
                "tolerations": [
                    {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
                "volumes": [{"name": "data", "emptyDir": {}}, {"name": "token", "secret": {"secretName": "default-token-abcde"}}],
                "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
                "serviceAccountName": "default", "schedulerName": "default-scheduler", "priority": 0,
                "enableServiceLinks": true, "securityContext": {}
            },
            "status": {}
        })
    }

    fn review_body(pod: &Value) -> anyhow::Result<Vec<u8>> {
        let review = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": UID,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "shop", "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                    "groups": ["system:serviceaccounts", "system:authenticated"]},
                "object": pod, "oldObject": null, "dryRun": false,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
            }
        });
        Ok(serde_json::to_vec(&review)?)
    }

    /// Where the uid's digits sit in `bytes`, which must hold the template uid exactly once.
    fn uid_digits(bytes: &[u8]) -> anyhow::Result<usize> {
        let uid = UID.as_bytes();
        let mut hits = bytes
            .windows(uid.len())
            .enumerate()
            .filter(|(_, w)| *w == uid)
            .map(|(i, _)| i);
        let at = hits.next().context("the template uid is missing")?;
        anyhow::ensure!(hits.next().is_none(), "the template uid occurs twice");
        Ok(at + uid.len() - UID_DIGITS)
    }

    fn write_digits(out: &mut [u8], mut n: u64) {
        for digit in out.iter_mut().rev() {
            *digit = b"0123456789abcdef"[(n & 15) as usize];
            n >>= 4;
        }
    }

    /// The answer every review must get, up to its uid.
    struct Expected {
        body: Vec<u8>,
        uid_at: usize,
    }

    impl Expected {
        /// The webhook's own answer to `body`, checked as JSON against `pod`.
        fn new(body: &[u8], pod: &Value) -> anyhow::Result<Self> {
            let policy = tensile_webhook::Policy::default();
            let review = tensile_webhook::review::parse(body)?;
            let outcome = tensile_webhook::mutate(&review, &policy, &std::collections::BTreeMap::new());
            let answer = tensile_webhook::review::encode(outcome.response)?;
            let v: Value = serde_json::from_slice(&answer)?;
            anyhow::ensure!(
                v["apiVersion"] == "admission.k8s.io/v1" && v["kind"] == "AdmissionReview",
                "not a v1 review: {v}"
            );
            let r = &v["response"];
            anyhow::ensure!(
                r["uid"] == UID && r["allowed"] == true && r["patchType"] == "JSONPatch",
                "not an allowed, patched answer for {UID}: {r}"
            );
            let patch = base64::engine::general_purpose::STANDARD
                .decode(r["patch"].as_str().context("no patch")?)
                .context("patch is not base64")?;
            let patch: json_patch::Patch = serde_json::from_slice(&patch).context("not a JSON Patch")?;
            let mut patched = pod.clone();
            json_patch::patch(&mut patched, &patch).context("the patch does not apply")?;
            anyhow::ensure!(
                patched["metadata"]["annotations"]["clusterSelector"].is_string(),
                "the patch writes no stash"
            );
            Ok(Self {
                uid_at: uid_digits(&answer)?,
                body: answer,
            })
        }

        fn check(&self, answer: &[u8], digits: &[u8]) -> anyhow::Result<()> {
            let (at, end) = (self.uid_at, self.uid_at + UID_DIGITS);
            anyhow::ensure!(
                answer.len() == self.body.len()
                    && answer[at..end] == *digits
                    && answer[..at] == self.body[..at]
                    && answer[end..] == self.body[end..],
                "unexpected answer: {}",
                String::from_utf8_lossy(answer)
            );
            Ok(())
        }
    }

    /// One keep-alive HTTPS connection to the webhook.
    struct Connection {
        tls: TlsStream<TcpStream>,
        /// The request, head and body, with the uid's digits at `digits_at`.
        request: Vec<u8>,
        digits_at: usize,
        next_uid: u64,
        answer: Vec<u8>,
        expected: Arc<Expected>,
    }

    impl Connection {
        async fn open(
            addr: SocketAddr,
            tls: Arc<rustls::ClientConfig>,
            body: &[u8],
            expected: Arc<Expected>,
            number: u64,
        ) -> anyhow::Result<Self> {
            let tcp = TcpStream::connect(addr).await.context("connecting")?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from("127.0.0.1")?;
            let tls = tokio_rustls::TlsConnector::from(tls)
                .connect(name, tcp)
                .await
                .context("TLS handshake")?;
            let mut request = format!(
                "POST /mutate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            let digits_at = request.len() + uid_digits(body)?;
            request.extend_from_slice(body);
            Ok(Self {
                tls,
                request,
                digits_at,
                // Connection number in the high digits: no two reviews share a uid.
                next_uid: number << 32,
                answer: Vec::with_capacity(16 * 1024),
                expected,
            })
        }

        /// Sends one review and checks its answer.
        async fn review(&mut self) -> anyhow::Result<()> {
            let digits = self.digits_at..self.digits_at + UID_DIGITS;
            write_digits(&mut self.request[digits.clone()], self.next_uid);
            self.next_uid += 1;
            self.tls.write_all(&self.request).await?;
            self.tls.flush().await?;
            self.answer.clear();
            let (head, length) = loop {
                anyhow::ensure!(
                    self.tls.read_buf(&mut self.answer).await? > 0,
                    "the webhook closed the connection"
                );
                let mut headers = [httparse::EMPTY_HEADER; 16];
                let mut response = httparse::Response::new(&mut headers);
                if let httparse::Status::Complete(head) = response.parse(&self.answer)? {
                    anyhow::ensure!(response.code == Some(200), "status {:?}", response.code);
                    let length = response
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                        .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<usize>().ok())
                        .context("answer without Content-Length")?;
                    break (head, length);
                }
            };
            while self.answer.len() < head + length {
                anyhow::ensure!(
                    self.tls.read_buf(&mut self.answer).await? > 0,
                    "the webhook closed the connection mid-answer"
                );
            }
            anyhow::ensure!(self.answer.len() == head + length, "bytes after the answer");
            self.expected.check(&self.answer[head..], &self.request[digits])
        }
    }

    /// CPU time so far of this process's threads: (the webhook's, everything else's).
    fn cpu_time() -> Option<(Duration, Duration)> {
        let (mut server, mut client) = (Duration::ZERO, Duration::ZERO);
        for task in std::fs::read_dir("/proc/self/task").ok()? {
            let dir = task.ok()?.path();
            let (Ok(comm), Ok(stat)) = (
                std::fs::read_to_string(dir.join("comm")),
                std::fs::read_to_string(dir.join("schedstat")),
            ) else {
                continue; // a thread that ended meanwhile
            };
            let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
            if comm.trim() == "webhook" {
                server += Duration::from_nanos(ns);
            } else {
                client += Duration::from_nanos(ns);
            }
        }
        Some((server, client))
    }

    pub async fn run(connections: usize, secs: Duration, rate: u64) -> anyhow::Result<serde_json::Value> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        // The webhook on its own runtime, like a separate process sharing the two cores.
        let server_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("webhook")
            .enable_all()
            .build()?;
        let options = Options::new(
            "127.0.0.1:0".parse()?,
            Certificates::SelfSigned {
                names: vec!["127.0.0.1".into()],
            },
        );
        let running = server_rt.spawn(tensile_webhook::start(options)).await??;
        let ca = running.ca_pem.clone().context("self-signed CA")?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in tensile_e2e::tls::certs_from_pem(&ca)? {
            roots.add(cert)?;
        }
        let tls = Arc::new(
            rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        let pod = pod();
        let body = review_body(&pod)?;
        let expected = Arc::new(Expected::new(&body, &pod)?);
        let addr = running.address;

        // The pure work of one review (parse, mutate, encode), without HTTP or TLS.
        let policy = tensile_webhook::Policy::default();
        let claims = std::collections::BTreeMap::new();
        let pure_start = Instant::now();
        let mut pure_n = 0u32;
        while pure_start.elapsed() < Duration::from_secs(1) {
            let review = tensile_webhook::review::parse(&body)?;
            let outcome = tensile_webhook::mutate(&review, &policy, &claims);
            anyhow::ensure!(
                outcome.verdict == tensile_webhook::Verdict::Mutated,
                "not mutated"
            );
            std::hint::black_box(tensile_webhook::review::encode(outcome.response)?);
            pure_n += 1;
        }
        let pure_us = pure_start.elapsed().as_secs_f64() * 1e6 / f64::from(pure_n.max(1));

        // Closed loop: every connection sends its next review as soon as the last returns.
        let warmup = Duration::from_secs(1);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for number in 0..connections {
            let (tls, body, expected) = (tls.clone(), body.clone(), expected.clone());
            tasks.push(tokio::spawn(async move {
                let mut connection = Connection::open(addr, tls, &body, expected, number as u64).await?;
                let mut latencies = Vec::new();
                let end = start + warmup + secs;
                loop {
                    let t = Instant::now();
                    if t >= end {
                        break;
                    }
                    connection.review().await?;
                    if t >= start + warmup {
                        latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                    }
                }
                Ok::<_, anyhow::Error>(latencies)
            }));
        }
        tokio::time::sleep_until((start + warmup).into()).await;
        let cpu_before = cpu_time();
        tokio::time::sleep_until((start + warmup + secs).into()).await;
        let cpu_after = cpu_time();
        let mut closed = Vec::new();
        for t in tasks {
            closed.extend(t.await??);
        }
        let closed = Samples::new(closed);
        let throughput = closed.len() as f64 / secs.as_secs_f64();
        let per_review_us = |before: Duration, after: Duration| {
            after.saturating_sub(before).as_secs_f64() * 1e6 / closed.len().max(1) as f64
        };
        let cpu = match (cpu_before, cpu_after) {
            (Some((s0, c0)), Some((s1, c1))) => serde_json::json!({
                "server_us_per_review": per_review_us(s0, s1),
                "client_us_per_review": per_review_us(c0, c1),
                "busy_share": (s1.saturating_sub(s0) + c1.saturating_sub(c0)).as_secs_f64()
                    / (secs.as_secs_f64() * std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64),
            }),
            _ => Value::Null,
        };

        // Open loop at a fixed rate over a few connections; latency from the scheduled time.
        let lanes = 4usize;
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        for lane in 0..lanes {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
            senders.push(tx);
            let (tls, body, expected) = (tls.clone(), body.clone(), expected.clone());
            let number = (connections + lane) as u64;
            workers.push(tokio::spawn(async move {
                let mut connection = Connection::open(addr, tls, &body, expected, number).await?;
                let mut latencies = Vec::new();
                while let Some(due) = rx.recv().await {
                    let sent = Instant::now();
                    connection.review().await?;
                    latencies.push((
                        due.elapsed().as_secs_f64() * 1000.0,
                        sent.elapsed().as_secs_f64() * 1000.0,
                    ));
                }
                Ok::<_, anyhow::Error>(latencies)
            }));
        }
        let total = rate * secs.as_secs().max(1);
        let period = Duration::from_secs_f64(1.0 / rate as f64);
        let begin = Instant::now() + Duration::from_millis(100);
        for i in 0..total {
            let due = begin + period.mul_f64(i as f64);
            tokio::time::sleep_until(due.into()).await;
            let _ = senders[(i as usize) % lanes].send(due);
        }
        drop(senders);
        let mut open = Vec::new();
        for w in workers {
            open.extend(w.await??);
        }
        let achieved = open.len() as f64 / begin.elapsed().as_secs_f64();
        let from_due: Samples = open.iter().map(|(due, _)| *due).collect();
        let from_send: Samples = open.iter().map(|(_, sent)| *sent).collect();
        let metrics = running.state.metrics.encode();
        server_rt.spawn(running.stop()).await?;
        server_rt.shutdown_background();
        Ok(serde_json::json!({
            "benchmark": "webhook: AdmissionReview over HTTPS (TLS 1.3, HTTP/1.1 keep-alive) on loopback",
            "review_bytes": body.len(),
            "answer_bytes": expected.body.len(),
            "parse_mutate_encode_us": pure_us,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "throughput": {
                "connections": connections,
                "secs": secs.as_secs_f64(),
                "reviews": closed.len(),
                "reviews_per_sec": throughput,
                "latency_ms_p50": closed.percentile(0.50),
                "latency_ms_p99": closed.percentile(0.99),
                "cpu": cpu,
            },
            "fixed_rate": {
                "target_per_sec": rate,
                "achieved_per_sec": achieved,
                "connections": lanes,
                "reviews": open.len(),
                "latency_ms_p50": from_send.percentile(0.50),
                "latency_ms_p99": from_send.percentile(0.99),
                "latency_ms_max": from_send.max(),
                "from_scheduled_time_ms_p50": from_due.percentile(0.50),
                "from_scheduled_time_ms_p99": from_due.percentile(0.99),
            },
            "server_mutations": metrics.lines().find(|l| l.starts_with("tensile_webhook_mutations_total")).unwrap_or(""),
            "note": "client and server share the machine's cores; latency is request written to response read; from_scheduled_time adds the client's timer lag (tokio timers tick in 1 ms); cpu is the threads' scheduled time over the closed loop, the webhook's runtime against the rest of the process",
        }))
    }
}
