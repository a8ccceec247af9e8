//! Benchmarks on the local test bed; each writes its figures as JSON under `--out`.
//!
//! `simulator`: N pods bound directly to M simulated nodes (no scheduler in the way); measures
//! how fast the node simulator takes them from created to Running, per pod and overall.
//!
//! `virtual-node` (`--bench virtual-node`): N pods through a virtual node versus the same pods
//! created directly in the lower cluster, bound → Running.
//!
//! `webhook` (`--bench webhook`): admission reviews over HTTPS with keep-alive on loopback,
//! sent to the webhook running in this process on a runtime of its own. A closed loop on
//! several connections gives the throughput; an open loop at a fixed rate gives latency
//! measured from each request's scheduled send time, so a stall is not hidden.

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
    /// Pods for the virtual-node benchmark.
    #[arg(long, env = "BENCH_VN_PODS", default_value_t = 1000)]
    vn_pods: usize,
    /// Which benchmarks to run.
    #[arg(long, env = "BENCH", value_enum, default_value_t = Which::Simulator)]
    bench: Which,
    /// Keep-alive connections for the webhook throughput run.
    #[arg(long, env = "BENCH_WEBHOOK_CONNECTIONS", default_value_t = 16)]
    webhook_connections: usize,
    /// Seconds of each webhook run (throughput, then fixed rate).
    #[arg(long, env = "BENCH_WEBHOOK_SECS", default_value_t = 10)]
    webhook_secs: u64,
    /// Reviews per second of the webhook latency run.
    #[arg(long, env = "BENCH_WEBHOOK_RATE", default_value_t = 1000)]
    webhook_rate: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Simulator,
    Webhook,
    VirtualNode,
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tensile_common::telemetry::init(&tensile_common::telemetry::LogArgs {
        level: "warn,kube_client=off".into(),
        format: tensile_common::telemetry::LogFormat::Plain,
    })?;
    let rt = tokio::runtime::Runtime::new().context("async runtime")?;
    rt.block_on(async {
        std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
        if matches!(cli.bench, Which::Simulator | Which::All) {
            let figures = simulator(cli.sim_pods, cli.sim_nodes).await?;
            write_figures(&cli.out, "simulator.json", &figures)?;
        }
        if matches!(cli.bench, Which::VirtualNode | Which::All) {
            let figures = tensile_e2e::benches::virtual_node(cli.vn_pods).await?;
            write_figures(&cli.out, "virtual-node.json", &figures)?;
        }
        if matches!(cli.bench, Which::Webhook | Which::All) {
            let secs = Duration::from_secs(cli.webhook_secs.max(1));
            let figures = webhook::run(cli.webhook_connections.max(1), secs, cli.webhook_rate.max(1)).await?;
            write_figures(&cli.out, "webhook.json", &figures)?;
        }
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

mod webhook {
    //! Load client for the webhook benchmark.

    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::Context as _;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use rustls::pki_types::ServerName;
    use tensile_webhook::{Certificates, Options};

    use super::percentile;

    type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

    /// A realistic opted-in pod: selectors, affinity, tolerations, volumes, two containers.
    fn review_body() -> anyhow::Result<Bytes> {
        let pod = serde_json::json!({
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
        });
        let review = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "5d2d5a8e-6f1c-4b8e-9a0f-1b2c3d4e5f60",
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
        Ok(Bytes::from(serde_json::to_vec(&review)?))
    }

    async fn connect(addr: SocketAddr, tls: Arc<rustls::ClientConfig>) -> anyhow::Result<Sender> {
        let tcp = tokio::net::TcpStream::connect(addr).await.context("connecting")?;
        tcp.set_nodelay(true)?;
        let name = ServerName::try_from("127.0.0.1")?;
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .context("TLS handshake")?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// Sends one review and checks that it came back mutated.
    async fn review(sender: &mut Sender, body: &Bytes) -> anyhow::Result<()> {
        let request = http::Request::post("/mutate")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let response = sender.send_request(request).await?;
        anyhow::ensure!(
            response.status() == http::StatusCode::OK,
            "status {}",
            response.status()
        );
        let bytes = response.into_body().collect().await?.to_bytes();
        anyhow::ensure!(
            bytes.windows(9).any(|w| w == b"JSONPatch"),
            "review was not mutated"
        );
        Ok(())
    }

    fn millis(sorted: &[f64], p: f64) -> f64 {
        percentile(sorted, p)
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
        let body = review_body()?;
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
        for _ in 0..connections {
            let (tls, body) = (tls.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let mut sender = connect(addr, tls).await?;
                let mut latencies = Vec::new();
                let end = start + warmup + secs;
                loop {
                    let t = Instant::now();
                    if t >= end {
                        break;
                    }
                    review(&mut sender, &body).await?;
                    if t >= start + warmup {
                        latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                    }
                }
                Ok::<_, anyhow::Error>(latencies)
            }));
        }
        let mut closed = Vec::new();
        for t in tasks {
            closed.extend(t.await??);
        }
        closed.sort_by(|a, b| a.total_cmp(b));
        let throughput = closed.len() as f64 / secs.as_secs_f64();

        // Open loop at a fixed rate over a few connections; latency from the scheduled time.
        let lanes = 4usize;
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        for _ in 0..lanes {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
            senders.push(tx);
            let (tls, body) = (tls.clone(), body.clone());
            workers.push(tokio::spawn(async move {
                let mut sender = connect(addr, tls).await?;
                let mut latencies = Vec::new();
                while let Some(due) = rx.recv().await {
                    let sent = Instant::now();
                    review(&mut sender, &body).await?;
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
        let mut from_due: Vec<f64> = open.iter().map(|(due, _)| *due).collect();
        let mut from_send: Vec<f64> = open.iter().map(|(_, sent)| *sent).collect();
        from_due.sort_by(|a, b| a.total_cmp(b));
        from_send.sort_by(|a, b| a.total_cmp(b));
        let metrics = running.state.metrics.encode();
        server_rt.spawn(running.stop()).await?;
        server_rt.shutdown_background();
        Ok(serde_json::json!({
            "benchmark": "webhook: AdmissionReview over HTTPS (TLS 1.3, HTTP/1.1 keep-alive) on loopback",
            "review_bytes": body.len(),
            "parse_mutate_encode_us": pure_us,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "throughput": {
                "connections": connections,
                "secs": secs.as_secs_f64(),
                "reviews": closed.len(),
                "reviews_per_sec": throughput,
                "latency_ms_p50": millis(&closed, 0.50),
                "latency_ms_p99": millis(&closed, 0.99),
            },
            "fixed_rate": {
                "target_per_sec": rate,
                "achieved_per_sec": achieved,
                "connections": lanes,
                "reviews": open.len(),
                "latency_ms_p50": millis(&from_send, 0.50),
                "latency_ms_p99": millis(&from_send, 0.99),
                "latency_ms_max": from_send.last().copied().unwrap_or(f64::NAN),
                "from_scheduled_time_ms_p50": millis(&from_due, 0.50),
                "from_scheduled_time_ms_p99": millis(&from_due, 0.99),
            },
            "server_mutations": metrics.lines().find(|l| l.starts_with("tensile_webhook_mutations_total")).unwrap_or(""),
            "note": "client and server share the machine's cores; latency is request written to response read; from_scheduled_time adds the client's timer lag (tokio timers tick in 1 ms)",
        }))
    }
}
