//! Benchmarks that need more than one cluster, shared by the `bench` binary.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser as _;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use crate::stats::Samples;
use crate::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster, free_port};

#[derive(Default)]
pub(crate) struct Seen {
    /// When our create call returned (pods we created).
    pub(crate) created: HashMap<String, Instant>,
    /// When a watch first showed the pod (pods created by someone else).
    first_seen: HashMap<String, Instant>,
    bound: HashMap<String, Instant>,
    pub(crate) running: HashMap<String, Instant>,
}

/// An upper and a lower cluster of benchmark `test`, started at once: each with the test
/// bed's client throttle `test_bed_qps` (see [`ClusterOptions::kube_api_qps`]) and then as
/// `adjust` makes it.
pub(crate) async fn clusters(
    test: &str,
    test_bed_qps: Option<(u32, u32)>,
    adjust: fn(ClusterOptions) -> ClusterOptions,
) -> anyhow::Result<(TestCluster, TestCluster)> {
    let options = |name: &str| {
        let mut o = ClusterOptions::new(test, name);
        o.kube_api_qps = test_bed_qps;
        adjust(o)
    };
    let (upper, lower) = tokio::join!(
        TestCluster::start(options("upper")),
        TestCluster::start(options("lower"))
    );
    Ok((upper?, lower?))
}

/// The legs of the pods a virtual node ran, from the upper and the lower cluster's watches.
pub(crate) fn legs(upper: &Mutex<Seen>, lower: &Mutex<Seen>) -> anyhow::Result<serde_json::Value> {
    let (u, l) = (
        upper.lock().map_err(|_| anyhow::anyhow!("lock poisoned"))?,
        lower.lock().map_err(|_| anyhow::anyhow!("lock poisoned"))?,
    );
    Ok(json!({
        "upper_bound_to_lower_created_ms": between(&u.bound, &l.first_seen),
        "lower_created_to_lower_bound_ms": between(&l.first_seen, &l.bound),
        "lower_bound_to_lower_running_ms": between(&l.bound, &l.running),
        "lower_running_to_upper_running_ms": between(&l.running, &u.running),
        // Per pod, the time spent in the virtual node's two legs together: what it adds
        // to the lower cluster's own created → Running.
        "virtual_node_own_ms": own_legs(&u, &l),
    }))
}

/// Creates `pods` pods from `template`, `in_flight` at a time, recording in `seen` when
/// each create returned.
pub(crate) async fn create_all(
    api: &Api<Pod>,
    pods: usize,
    in_flight: usize,
    rate: Option<u32>,
    seen: &Arc<Mutex<Seen>>,
    template: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<()> {
    // Paced: the i-th create is not sent before i/rate seconds from the start.
    let start = tokio::time::Instant::now();
    futures::stream::iter(0..pods)
        .then(move |i| async move {
            if let Some(rate) = rate.filter(|r| *r > 0) {
                tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / f64::from(rate))).await;
            }
            i
        })
        .map(|i| {
            let (api, seen) = (api.clone(), seen.clone());
            let pod: Result<Pod, _> = serde_json::from_value(template(i));
            async move {
                let pod = pod?;
                let t = Instant::now();
                api.create(&PostParams::default(), &pod).await?;
                if let (Some(name), Ok(mut s)) = (pod.metadata.name, seen.lock()) {
                    s.created.insert(name, t);
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(in_flight.max(1))
        .try_collect::<()>()
        .await
}

/// Figures of one burst: create `pods` pods, watch them get bound and Running.
async fn burst(
    api: Api<Pod>,
    pods: usize,
    template: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    burst_into(api, pods, Arc::default(), template).await
}

/// Records, per pod, when it was first seen, first seen bound and first seen Running.
pub(crate) async fn observe(api: Api<Pod>, seen: Arc<Mutex<Seen>>) {
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(Ok(pod)) = stream.next().await {
        let now = Instant::now();
        let Some(name) = pod.metadata.name.clone() else {
            continue;
        };
        let Ok(mut s) = seen.lock() else { return };
        s.first_seen.entry(name.clone()).or_insert(now);
        if pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
            s.bound.entry(name.clone()).or_insert(now);
        }
        if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
            s.running.entry(name).or_insert(now);
        }
    }
}

/// Percentiles of the time from `from` to `to`, per pod.
pub(crate) fn between(from: &HashMap<String, Instant>, to: &HashMap<String, Instant>) -> serde_json::Value {
    from.iter()
        .filter_map(|(n, a)| {
            to.get(n)
                .map(|b| b.saturating_duration_since(*a).as_secs_f64() * 1000.0)
        })
        .collect::<Samples>()
        .summary()
}

/// Percentiles, over the pods seen on both sides, of (upper bound → lower created) +
/// (lower Running → upper Running).
fn own_legs(upper: &Seen, lower: &Seen) -> serde_json::Value {
    upper
        .bound
        .iter()
        .filter_map(|(name, bound)| {
            let down = lower.first_seen.get(name)?.saturating_duration_since(*bound);
            let up = upper
                .running
                .get(name)?
                .saturating_duration_since(*lower.running.get(name)?);
            Some((down + up).as_secs_f64() * 1000.0)
        })
        .collect::<Samples>()
        .summary()
}

async fn burst_into(
    api: Api<Pod>,
    pods: usize,
    seen: Arc<Mutex<Seen>>,
    template: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    let watch = tokio::spawn(observe(api.clone(), seen.clone()));
    let start = Instant::now();
    create_all(&api, pods, 32, None, &seen, template).await?;
    let created_secs = start.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(600);
    while seen.lock().map(|s| s.running.len()).unwrap_or(0) < pods && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let burst_secs = start.elapsed().as_secs_f64();
    watch.abort();
    let s = seen.lock().map_err(|_| anyhow::anyhow!("lock poisoned"))?;
    Ok(json!({
        "pods": pods,
        "running": s.running.len(),
        "create_secs": created_secs,
        "burst_secs": burst_secs,
        "created_to_bound_ms": between(&s.created, &s.bound),
        "bound_to_running_ms": between(&s.bound, &s.running),
        "created_to_running_ms": between(&s.created, &s.running),
    }))
}

/// `pods` pods through a virtual node versus the same pods created directly in the lower
/// cluster (the baseline), in one run on one machine.
pub async fn virtual_node(
    pods: usize,
    test_bed_qps: Option<(u32, u32)>,
) -> anyhow::Result<serde_json::Value> {
    let (upper, lower) = clusters("bench", test_bed_qps, |o| o).await?;
    // Room for both bursts: the baseline's pods stay and count against the virtual node's
    // allocatable (they are foreign to it), exactly as in production.
    let nodes = (2 * pods).div_ceil(100).max(1);
    let configs = (0..nodes)
        .map(|i| NodeConfig::new(&format!("lower-{i}")))
        .collect();
    let _sim = NodeSimulator::start(
        lower.client().await?,
        SimulatorOptions::new("bench", Some(lower.kubelet_client_ca_pem())),
        configs,
    )
    .await?;

    // Baseline: straight into the lower cluster, placed by its scheduler.
    lower.create_namespace("baseline").await?;
    // The virtual node runs in this process: its CPU is the bench process's.
    let groups = || {
        cpu_groups(
            &upper,
            &lower,
            "bench_clients_simulated_kubelets_and_virtual_node",
        )
    };
    let baseline_cpu = CpuUse::start(groups())?;
    let baseline = burst(Api::namespaced(lower.client().await?, "baseline"), pods, |i| {
        json!({"metadata": {"name": format!("direct-{i}")}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    })
    .await?;
    let baseline_cpu = baseline_cpu.report()?;

    // BENCH_VN_ARGS adds virtual-node flags (for example `--pod-sync-workers 128`).
    let argv = [
        "virtual-node".to_string(),
        format!("--kubeconfig={}", upper.kubeconfig().display()),
        format!("--client-kubeconfig={}", lower.kubeconfig().display()),
        "--nodename=vn-bench".into(),
        format!("--node-ip={}", crate::node_ip()?),
        format!("--kubelet-port={}", free_port()?),
        format!("--admin-addr=127.0.0.1:{}", free_port()?),
        format!("--client-verify-ca={}", upper.kubelet_client_ca_path().display()),
    ]
    .into_iter()
    .chain(
        std::env::var("BENCH_VN_ARGS")
            .ok()
            .into_iter()
            .flat_map(|a| a.split_whitespace().map(str::to_owned).collect::<Vec<_>>()),
    );
    let args = tensile_virtual_node::Args::try_parse_from(argv)?;
    let vn = tokio::spawn(tensile_virtual_node::run(args));
    node_ready(&upper, "vn-bench").await?;
    upper.create_namespace("virtual").await?;
    // The lower side of the same pods, to split the time into virtual-node's own legs.
    let lower_seen: Arc<Mutex<Seen>> = Arc::default();
    let lower_watch = tokio::spawn(observe(
        Api::namespaced(lower.client().await?, "virtual"),
        lower_seen.clone(),
    ));
    let upper_seen: Arc<Mutex<Seen>> = Arc::default();
    let writes_before = api_writes(&upper.client().await?).await?;
    let through_cpu = CpuUse::start(groups())?;
    let through = burst_into(
        Api::namespaced(upper.client().await?, "virtual"),
        pods,
        upper_seen.clone(),
        |i| {
            json!({"metadata": {"name": format!("virtual-{i}")}, "spec": {
            "nodeSelector": {"type": "virtual-kubelet"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "containers": [{"name": "c", "image": "x"}]}})
        },
    )
    .await?;
    let through_cpu = through_cpu.report()?;
    let writes_after = api_writes(&upper.client().await?).await?;
    vn.abort();
    lower_watch.abort();
    // Every write the upper apiserver took during the burst, by kind, per pod.
    let upper_writes_per_pod: serde_json::Map<String, serde_json::Value> = writes_after
        .iter()
        .map(|(k, after)| {
            let n = after - writes_before.get(k).copied().unwrap_or(0.0);
            (k.clone(), json!((n / pods as f64 * 100.0).round() / 100.0))
        })
        .filter(|(_, v)| v.as_f64().is_some_and(|v| v > 0.0))
        .collect();
    let legs = legs(&upper_seen, &lower_seen)?;

    let ratio = through["burst_secs"].as_f64().unwrap_or(f64::NAN)
        / baseline["burst_secs"].as_f64().unwrap_or(f64::NAN);
    // Like for like: the baseline's clock starts when a pod enters the lower cluster
    // (created there), the virtual node's when the pod is handed to it (bound upstream).
    // Both then include one pass of the lower scheduler and kubelet.
    let ms = |v: &serde_json::Value, path: &str, p: &str| v[path][p].as_f64().unwrap_or(f64::NAN);
    let overhead_p50 =
        ms(&through, "bound_to_running_ms", "p50") - ms(&baseline, "created_to_running_ms", "p50");
    let overhead_p99 =
        ms(&through, "bound_to_running_ms", "p99") - ms(&baseline, "created_to_running_ms", "p99");
    // The literal reading, bound → Running on both sides: the baseline then skips its
    // scheduler's queue while the virtual node's figure includes the lower one.
    let literal_p99 =
        ms(&through, "bound_to_running_ms", "p99") - ms(&baseline, "bound_to_running_ms", "p99");
    Ok(json!({
        "benchmark": "virtual-node: bound -> Running upstream vs. directly in the lower cluster",
        "kubernetes": upper.version(),
        "test_bed_client_qps_burst": test_bed_qps,
        "lower_nodes": nodes,
        "baseline_direct_in_lower": baseline,
        "through_virtual_node": through,
        "through_virtual_node_legs": legs,
        "cpu_during_burst": {"direct_in_lower": baseline_cpu, "through_virtual_node": through_cpu,
            "note": "both clusters share one etcd and the machine's cores; pods through the virtual node are written to both apiservers"},
        "upper_writes_per_pod": upper_writes_per_pod,
        "burst_time_ratio": ratio,
        "p50_overhead_ms": overhead_p50,
        "p99_overhead_ms": overhead_p99,
        "p99_overhead_vs_baseline_bound_to_running_ms": literal_p99,
        "targets": {"p99_overhead_ms_below": 1000, "burst_time_ratio_below": 1.5},
    }))
}

/// Successful writes an apiserver has served so far, by `VERB resource[/subresource]`, from
/// its own `apiserver_request_total`.
pub(crate) async fn api_writes(client: &kube::Client) -> anyhow::Result<HashMap<String, f64>> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let mut writes: HashMap<String, f64> = HashMap::new();
    for line in text.lines() {
        let Some((labels, value)) = line
            .strip_prefix("apiserver_request_total{")
            .and_then(|rest| rest.rsplit_once("} "))
        else {
            continue;
        };
        // name="value" pairs; label values here never hold `",`.
        let labels: HashMap<&str, &str> = labels
            .split("\",")
            .filter_map(|pair| pair.split_once("=\""))
            .map(|(k, v)| (k, v.trim_end_matches('"')))
            .collect();
        let label = |name: &str| labels.get(name).copied().unwrap_or_default().to_owned();
        let (verb, code) = (label("verb"), label("code"));
        if !matches!(verb.as_str(), "POST" | "PUT" | "PATCH" | "DELETE") || !code.starts_with('2') {
            continue;
        }
        let (resource, sub) = (label("resource"), label("subresource"));
        let key = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        *writes.entry(key).or_default() += value.parse::<f64>().unwrap_or(0.0);
    }
    Ok(writes)
}

/// The multi-scheduler's extender: the capacity shape of a 5,000-node lower cluster, the
/// filter's latency in process for 100 such virtual nodes, and `POST /filter` over HTTPS
/// (TLS 1.3, HTTP/1.1 keep-alive on loopback, `connections` clients for `secs` seconds,
/// client and server in this process).
pub async fn multi_scheduler(secs: u64, connections: usize) -> anyhow::Result<serde_json::Value> {
    use tensile_common::fit::Options;
    use tensile_multi_scheduler::context::{Context, FactsCache};
    use tensile_multi_scheduler::extender::{self, ExtenderArgs, Score};

    const VIRTUAL_NODES: usize = 100;
    const LOWER_NODES: usize = 5000;
    const CALLS: usize = 2000;
    // Ten distinct lower clusters, each shown by ten virtual nodes.
    let shapes: Vec<String> = (0..10)
        .map(|seed| lower_cluster_shape(LOWER_NODES, seed))
        .collect::<Result<_, _>>()?;
    let shape_bytes = shapes.iter().map(String::len).max().unwrap_or(0);
    let nodes: Vec<k8s_openapi::api::core::v1::Node> = (0..VIRTUAL_NODES)
        .map(|i| {
            serde_json::from_value(json!({
                "metadata": {
                    "name": format!("vn-{i}"), "resourceVersion": "1",
                    "labels": {tensile_common::names::VIRTUAL_NODE_TYPE_LABEL: tensile_common::names::VIRTUAL_NODE_TYPE_VALUE},
                    "annotations": {tensile_common::names::NODE_CAPACITY_SHAPE: shapes[i % shapes.len()]},
                },
            }))
        })
        .collect::<Result<_, _>>()?;
    let view = Arc::new(BenchNodes(nodes.iter().cloned().map(Arc::new).collect()));
    let names: Vec<String> = nodes.iter().filter_map(|n| n.metadata.name.clone()).collect();
    // A 6-CPU pod that must be in zone eu-1b: some groups fit, most are filtered by label.
    let stash = json!({"nodeSelector": {"topology.kubernetes.io/zone": "eu-1b"}}).to_string();
    let pod = json!({
        "metadata": {"name": "p", "namespace": "ns", "annotations": {tensile_common::names::CLUSTER_SELECTOR: stash}},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "6", "memory": "8Gi"}}}]},
    });
    let body = serde_json::to_vec(&json!({"Pod": pod, "NodeNames": names}))?;
    let args = ExtenderArgs::decode(&body)?;
    let exclusions = tensile_common::exclusion::Exclusions::default();
    let facts = FactsCache::default();
    let ctx = Context {
        view: view.as_ref(),
        pods: &tensile_multi_scheduler::context::NoBoundPods,
        facts: &facts,
        exclusions: &exclusions,
        options: Options {
            now: jiff::Timestamp::now(),
            max_age: None,
        },
    };
    let cold = Instant::now();
    let (first, _) = extender::filter(&args, &ctx);
    let cold_ms = cold.elapsed().as_secs_f64() * 1000.0;
    let passing = first.node_names.as_ref().map_or(0, Vec::len);
    let mut samples = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        let (result, _) = extender::filter(&args, &ctx);
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(
            result.node_names.as_ref().map_or(0, Vec::len) == passing,
            "answers differ"
        );
    }
    let filter_ms = samples.into_iter().collect::<Samples>().summary();
    // A 64-CPU pod no lower node holds: every node rejected, every message written.
    let too_big = json!({
        "metadata": {"name": "q", "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "64"}}}]},
    });
    let rejecting = ExtenderArgs::decode(&serde_json::to_vec(&json!({"Pod": too_big, "NodeNames": names}))?)?;
    let mut samples = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        let (result, _) = extender::filter(&rejecting, &ctx);
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(result.failed_nodes.len() == VIRTUAL_NODES, "every node rejected");
    }
    let rejecting_ms = samples.into_iter().collect::<Samples>().summary();
    let mut prioritize = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        let scores = extender::prioritize(&args, &ctx, Score::Binpack);
        prioritize.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(scores.len() == VIRTUAL_NODES, "a score per node");
    }

    let https = extender_over_https(
        view,
        body.clone(),
        Duration::from_secs(secs.max(1)),
        connections.max(1),
    )
    .await?;
    Ok(json!({
        "benchmark": "multi-scheduler: capacity shape size, filter latency in process, POST /filter over HTTPS",
        "shape": {
            "lower_nodes": LOWER_NODES,
            "groups": 12,
            "group_cap": tensile_common::shape::DEFAULT_GROUP_CAP,
            "annotation_bytes": shape_bytes,
        },
        "filter_in_process": {
            "virtual_nodes": VIRTUAL_NODES,
            "passing": passing,
            "first_call_ms_shapes_decoded": cold_ms,
            "calls": CALLS,
            "filter_ms": filter_ms,
            "filter_all_rejected_ms": rejecting_ms,
            "prioritize_ms": prioritize.into_iter().collect::<Samples>().summary(),
            "request_body_bytes": body.len(),
        },
        "https": https,
    }))
}

/// The encoded capacity shape of a lower cluster of `nodes` nodes in 3 zones × 4 instance
/// types, every node with its own free vector (`seed` varies them).
fn lower_cluster_shape(nodes: usize, seed: usize) -> anyhow::Result<String> {
    let types = ["m5.large", "m5.4xlarge", "r5.2xlarge", "c5.9xlarge"];
    let zones = ["eu-1a", "eu-1b", "eu-1c"];
    let lower: Vec<k8s_openapi::api::core::v1::Node> = (0..nodes)
        .map(|i| {
            let j = i + seed * 7919;
            serde_json::from_value(json!({
                "metadata": {"name": format!("node-{i}"), "labels": {
                    "topology.kubernetes.io/zone": zones[i % 3],
                    "topology.kubernetes.io/region": "eu-1",
                    "node.kubernetes.io/instance-type": types[i % 4],
                    "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
                "status": {
                    "allocatable": {"cpu": format!("{}m", 2000 + (j * 37) % 30000),
                                    "memory": format!("{}Mi", 4096 + (j * 7919) % 120000), "pods": "110"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }))
        })
        .collect::<Result<_, _>>()?;
    let keys: Vec<String> = tensile_common::shape::DEFAULT_LABEL_KEYS
        .map(String::from)
        .to_vec();
    let shape = tensile_common::shape::build(
        &lower,
        [],
        &keys,
        tensile_common::shape::DEFAULT_GROUP_CAP,
        jiff::Timestamp::now(),
    );
    Ok(shape.encode()?)
}

struct BenchNodes(Vec<Arc<k8s_openapi::api::core::v1::Node>>);

impl tensile_multi_scheduler::context::View for BenchNodes {
    fn node(&self, name: &str) -> Option<Arc<k8s_openapi::api::core::v1::Node>> {
        self.0
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .cloned()
    }
}

/// `POST /filter` with `body` on `connections` keep-alive HTTPS connections for `duration`.
async fn extender_over_https(
    view: Arc<BenchNodes>,
    body: Vec<u8>,
    duration: Duration,
    connections: usize,
) -> anyhow::Result<serde_json::Value> {
    use http_body_util::{BodyExt as _, Full};
    use tensile_multi_scheduler::context::FactsCache;
    use tensile_multi_scheduler::extender::Score;
    use tensile_multi_scheduler::server::{State, serve_https};

    let generated = tensile_common::tls::self_signed(&["127.0.0.1".to_owned()])?;
    let tls = tensile_common::tls::server_config(tensile_common::tls::CertResolver::new(generated.key))?;
    let (_, exclusions) =
        tokio::sync::watch::channel(Arc::new(tensile_common::exclusion::Exclusions::default()));
    let state = Arc::new(State {
        nodes: view,
        pods: Arc::new(tensile_multi_scheduler::context::NoBoundPods),
        facts: FactsCache::default(),
        exclusions,
        max_age: None,
        score: Score::Binpack,
        metrics: tensile_multi_scheduler::metrics::Metrics::new(&mut Default::default()),
        max_body_bytes: 64 << 20,
        body_deadline: Duration::from_secs(10),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(serve_https(listener, tls, state, stop.clone()));

    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(generated.ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let client_tls = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let body = bytes::Bytes::from(body);
    let until = Instant::now() + duration;
    let clients = (0..connections).map(|_| {
        let (client_tls, body) = (client_tls.clone(), body.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
            let stream = tokio_rustls::TlsConnector::from(client_tls)
                .connect(name, tcp)
                .await
                .context("TLS handshake")?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            let mut latencies = Vec::new();
            while Instant::now() < until {
                let request = http::Request::post("/filter")
                    .header(http::header::HOST, "127.0.0.1")
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(body.clone()))?;
                let t = Instant::now();
                sender.ready().await?;
                let response = sender.send_request(request).await?;
                anyhow::ensure!(response.status() == 200, "status {}", response.status());
                let answer = response.into_body().collect().await?.to_bytes();
                latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                anyhow::ensure!(answer.starts_with(b"{\"Nodes\":null"), "an ExtenderFilterResult");
            }
            Ok::<_, anyhow::Error>(latencies)
        }
    });
    let started = Instant::now();
    let results = futures::future::join_all(clients).await;
    let elapsed = started.elapsed().as_secs_f64();
    stop.cancel();
    let _ = server.await;
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    Ok(json!({
        "connections": connections,
        "seconds": elapsed,
        "requests": all.len(),
        "requests_per_second": all.len() as f64 / elapsed,
        "latency_ms": all.into_iter().collect::<Samples>().summary(),
    }))
}

/// Waits until node `name` of `upper` is Ready.
pub(crate) async fn node_ready(upper: &TestCluster, name: &str) -> crate::Result<()> {
    crate::wait::until(
        &format!("{name} Ready"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let out = crate::kubectl::run(
                upper.kubeconfig(),
                &[
                    "get",
                    "node",
                    name,
                    "-o",
                    r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
                ],
            )
            .await;
            if out.stdout.trim() == "True" {
                Ok(())
            } else {
                Err(out.stderr)
            }
        },
    )
    .await
}

/// CPU seconds (user and system) process `pid` has used so far.
pub fn cpu_secs(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name: state is the first, utime the 12th, stime the 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .with_context(|| format!("/proc/{pid}/stat is short"))?
            .parse::<f64>()?)
    };
    // USER_HZ is 100 on every Linux this runs on.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Busy and total CPU seconds of the whole machine so far, from `/proc/stat`.
fn machine_cpu() -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cpu "))
        .context("/proc/stat has no cpu line")?
        .split_whitespace()
        .map(|t| t.parse::<f64>().unwrap_or(0.0))
        .collect();
    let total: f64 = ticks.iter().take(8).sum();
    // idle and iowait are the 4th and 5th.
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    Ok(((total - idle) / 100.0, total / 100.0))
}

/// Where the machine's CPU goes during one phase: process groups by name, and the machine.
pub struct CpuUse {
    groups: Vec<(&'static str, Vec<u32>)>,
    start: Vec<f64>,
    machine: (f64, f64),
}

impl CpuUse {
    pub fn start(groups: Vec<(&'static str, Vec<u32>)>) -> anyhow::Result<CpuUse> {
        let start = groups.iter().map(|(_, pids)| group_cpu(pids)).collect();
        Ok(CpuUse {
            groups,
            start,
            machine: machine_cpu()?,
        })
    }

    /// CPU seconds of each group since the start, and the machine's busy fraction.
    pub fn report(&self) -> anyhow::Result<serde_json::Value> {
        let (busy, total) = machine_cpu()?;
        let mut by = serde_json::Map::new();
        for ((name, pids), start) in self.groups.iter().zip(&self.start) {
            by.insert((*name).into(), json!(round3(group_cpu(pids) - start)));
        }
        by.insert("machine_busy".into(), json!(round3(busy - self.machine.0)));
        Ok(json!({
            "cpu_secs": by,
            "machine_busy_fraction": round3((busy - self.machine.0) / (total - self.machine.1).max(0.01)),
        }))
    }
}

/// The process groups whose CPU a phase reports: both control planes, the etcd they share,
/// and this process, named for what it runs.
pub fn cpu_groups(
    upper: &TestCluster,
    lower: &TestCluster,
    this_process: &'static str,
) -> Vec<(&'static str, Vec<u32>)> {
    vec![
        ("upper_control_plane", upper.pids()),
        ("lower_control_plane", lower.pids()),
        ("etcd_shared", upper.etcd_pid().into_iter().collect()),
        (this_process, vec![std::process::id()]),
    ]
}

/// CPU seconds of the processes `pids` (those still running).
fn group_cpu(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|p| cpu_secs(*p).ok()).sum()
}

/// `x` to three decimals.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// A memory figure of process `pid` in bytes: `field` of `/proc/<pid>/status` (`VmRSS`,
/// `VmHWM`).
pub(crate) fn proc_memory(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| anyhow::anyhow!("no {field} for {pid}"))
}

/// Resident memory of process `pid` in bytes.
pub(crate) fn rss(pid: u32) -> anyhow::Result<u64> {
    proc_memory(pid, "VmRSS")
}

/// What the upper cluster's ConfigMaps and Secrets cost a virtual node that copies none of
/// them: `objects` of each kind holding `bytes` of content each. The `virtual-node` binary's
/// RSS before they exist, after they arrive, and after a restart with them in place; and,
/// like for like in this process, what a cache of full objects (how the virtual node held
/// them before) and a cache of their metadata (how it holds them now) add to its RSS.
pub async fn copies(objects: usize, bytes: usize) -> anyhow::Result<serde_json::Value> {
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    let (upper, lower) = clusters("bench-copies", None, |o| o).await?;
    let _sim = NodeSimulator::start(
        lower.client().await?,
        SimulatorOptions::new("bench-copies", Some(lower.kubelet_client_ca_pem())),
        vec![NodeConfig::new("lower-0")],
    )
    .await?;
    let settle = Duration::from_secs(5);
    let vn = crate::in_process::VirtualNodeProcess::start(&upper, "vn-copies", &lower, &[], "copies")?;
    node_ready(&upper, "vn-copies").await?;
    tokio::time::sleep(settle).await;
    let pid = vn
        .service
        .pid()
        .ok_or_else(|| anyhow::anyhow!("virtual-node exited"))?;
    let empty = rss(pid)?;

    upper.create_namespace("bulk").await?;
    let client = upper.client().await?;
    let content = "x".repeat(bytes);
    let started = Instant::now();
    futures::stream::iter(0..objects)
        .map(|i| {
            let (client, content) = (client.clone(), content.clone());
            async move {
                let secret: Secret = serde_json::from_value(json!({
                    "metadata": {"name": format!("s-{i}")}, "stringData": {"v": content}}))?;
                let map: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("c-{i}")}, "data": {"v": content}}))?;
                Api::<Secret>::namespaced(client.clone(), "bulk")
                    .create(&PostParams::default(), &secret)
                    .await?;
                Api::<ConfigMap>::namespaced(client, "bulk")
                    .create(&PostParams::default(), &map)
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    let created_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(settle).await;
    let with_objects = rss(pid)?;
    drop(vn);
    let vn =
        crate::in_process::VirtualNodeProcess::start(&upper, "vn-copies", &lower, &[], "copies-restart")?;
    node_ready(&upper, "vn-copies").await?;
    tokio::time::sleep(settle).await;
    let pid = vn
        .service
        .pid()
        .ok_or_else(|| anyhow::anyhow!("virtual-node exited"))?;
    let restarted = rss(pid)?;
    drop(vn);

    let mib = |b: u64| (b as f64 / 1048576.0 * 10.0).round() / 10.0;
    Ok(json!({
        "benchmark": "upper ConfigMaps and Secrets a virtual node copies none of: its memory",
        "kubernetes": upper.version(),
        "objects": {"secrets": objects, "config_maps": objects, "bytes_each": bytes,
                    "content_mib": mib((2 * objects * bytes) as u64), "created_in_secs": created_secs},
        "virtual_node_rss_mib": {
            "before_the_objects": mib(empty),
            "after_they_arrived": mib(with_objects),
            "after_a_restart_with_them": mib(restarted),
        },
        "cost": "nothing is read of an upper ConfigMap or Secret no pod bound to the node references; a referenced one is read by name (docs/virtual-node.md)",
    }))
}

/// What the `streams` benchmark does: sizes of each part.
pub struct StreamsBench {
    /// Line round trips in one open `exec -i -- cat`, per side and transport.
    pub round_trips: usize,
    /// Whole `kubectl exec -- echo hi` runs, per side and transport.
    pub commands: usize,
    /// MiB pushed through the port-forwarded echo in each round.
    pub forward_mib: u64,
    /// Port-forward rounds, per side and transport.
    pub forward_rounds: usize,
    /// HTTP requests on the forwarded port 8080, per side and transport.
    pub http_requests: usize,
    /// exec sessions open at once through the virtual node, for its memory under load.
    pub sessions: usize,
    /// MiB through one port-forward, for its memory under load.
    pub load_mib: u64,
}

/// Rounded to 3 decimals, for the figures.
fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One open `exec` of `cat` over WebSocket (`v5.channel.k8s.io`) that this process speaks
/// itself, to a kubelet API or an apiserver, with a client certificate: no kubectl, so two
/// of them differ only by the path behind their first hop.
struct RawCat {
    ws: tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
}

impl RawCat {
    async fn open(
        (host, port): (std::net::IpAddr, u16),
        path: &str,
        (cert, key): (&str, &str),
    ) -> anyhow::Result<RawCat> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let certs = CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes())?;
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(crate::flood::AnyCertificate))
                .with_client_auth_cert(certs, key)?;
        let tcp = tokio::net::TcpStream::connect((host, port))
            .await
            .with_context(|| format!("connecting to {host}:{port}"))?;
        tcp.set_nodelay(true)?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1")?.to_owned(), tcp)
            .await?;
        let mut request = format!("wss://127.0.0.1:{port}{path}").into_client_request()?;
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", "v5.channel.k8s.io".parse()?);
        let (ws, _) = tokio_tungstenite::client_async(request, tls)
            .await
            .with_context(|| format!("WebSocket exec on port {port} {path}"))?;
        Ok(RawCat { ws })
    }

    /// Writes `line` on stdin and waits until stdout gave it back.
    async fn round_trip(&mut self, line: &str) -> anyhow::Result<Duration> {
        use futures::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::Message;
        let started = Instant::now();
        let mut frame = vec![0u8];
        frame.extend_from_slice(line.as_bytes());
        self.ws.send(Message::Binary(frame.into())).await?;
        let mut out = Vec::new();
        while !out.ends_with(line.as_bytes()) {
            match tokio::time::timeout(Duration::from_secs(10), self.ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) if b.first() == Some(&1) => out.extend_from_slice(&b[1..]),
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => anyhow::bail!("the exec stream: {e}"),
                Ok(None) => anyhow::bail!("the exec stream closed"),
                Err(_) => anyhow::bail!("no echo of {line:?} within 10 s"),
            }
        }
        Ok(started.elapsed())
    }
}

/// The admin client certificate and key (PEM) of a cluster's kubeconfig.
fn admin_credentials(cluster: &TestCluster) -> anyhow::Result<(String, String)> {
    use base64::Engine as _;
    let config: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(cluster.kubeconfig())?)?;
    let user = &config["users"][0]["user"];
    let decode = |field: &str| -> anyhow::Result<String> {
        let data = user[field]
            .as_str()
            .with_context(|| format!("the kubeconfig has no {field}"))?;
        Ok(String::from_utf8(
            base64::engine::general_purpose::STANDARD.decode(data)?,
        )?)
    };
    Ok((decode("client-certificate-data")?, decode("client-key-data")?))
}

/// What the virtual node's own hop costs a line round trip: this process execs `cat` over
/// WebSocket once on the node's kubelet API (as the upper apiserver does, with its kubelet
/// client certificate) and once on the lower apiserver (as the node does, as the lower
/// admin), alternating, `rounds` lines each. The first path is the second behind one more hop,
/// the node's, so the difference is that hop; what kubectl's through and direct paths differ
/// by beyond it is the upper apiserver's hop.
async fn virtual_node_hop(
    upper: &TestCluster,
    lower: &TestCluster,
    vn: &crate::in_process::VirtualNodeProcess,
    (lower_ns, lower_pod): (&str, &str),
    rounds: usize,
) -> anyhow::Result<serde_json::Value> {
    let pki = upper.dir().join("pki");
    let kubelet_client = (
        std::fs::read_to_string(pki.join("kubelet-client.crt"))?,
        std::fs::read_to_string(pki.join("kubelet-client.key"))?,
    );
    let admin = admin_credentials(lower)?;
    let lower_port: u16 = lower
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .context("the lower apiserver's port")?;
    let mut cats = [
        RawCat::open(
            (crate::node_ip()?, vn.kubelet_port),
            "/exec/streams/bench/app?command=cat&input=1&output=1",
            (&kubelet_client.0, &kubelet_client.1),
        )
        .await?,
        RawCat::open(
            (std::net::Ipv4Addr::LOCALHOST.into(), lower_port),
            &format!("/api/v1/namespaces/{lower_ns}/pods/{lower_pod}/exec?command=cat&stdin=true&stdout=true&container=app"),
            (&admin.0, &admin.1),
        )
        .await?,
    ];
    for i in 0..10 {
        for cat in &mut cats {
            cat.round_trip(&format!("warm-{i:05}\n")).await?;
        }
    }
    let mut took: [Vec<f64>; 2] = Default::default();
    for i in 0..rounds {
        let order = if i.is_multiple_of(2) { [0, 1] } else { [1, 0] };
        for side in order {
            took[side].push(ms(cats[side].round_trip(&format!("line-{i:05}\n")).await?));
        }
    }
    let [node, lower_only] = took.map(Samples::new);
    Ok(json!({
        "via_virtual_node_kubelet_api_ms": summary_ms(&node),
        "via_lower_apiserver_ms": summary_ms(&lower_only),
        "virtual_node_hop_p50_ms": r3(node.percentile(0.5) - lower_only.percentile(0.5)),
        "note": "this process's own WebSocket exec of cat, a line out and back: on the virtual node's kubelet API \
                 (virtual node, lower apiserver, simulated kubelet) and on the lower apiserver (lower apiserver, \
                 simulated kubelet), alternating; the difference of the medians is the virtual node's hop",
    }))
}

/// The best ratios a virtual node could reach on this bed, from this run's figures: the
/// round trip with the node's own hop (`hop`, measured over WebSocket) taken out of the
/// through median, and port-forward throughput with the node's CPU per MiB taken out of the
/// through side's (the forwarding is CPU-bound: every process shares the cores).
fn bounds_without_the_node(
    per_transport: &serde_json::Map<String, serde_json::Value>,
    hop: &serde_json::Value,
) -> serde_json::Value {
    let node_hop = hop["virtual_node_hop_p50_ms"].as_f64().unwrap_or(0.0);
    let bound = |figures: &serde_json::Value| {
        let (through, direct) = (
            &figures["exec_round_trip_ms"]["through"]["p50"],
            &figures["exec_round_trip_ms"]["direct"]["p50"],
        );
        let cpu = &figures["cpu_ms_per_mib_forwarded"];
        let total = |side: &serde_json::Value| {
            side.as_object()
                .map(|groups| groups.values().filter_map(serde_json::Value::as_f64).sum::<f64>())
                .unwrap_or(0.0)
        };
        let node_cpu = cpu["through"]["virtual_node"].as_f64().unwrap_or(0.0);
        json!({
            "exec_round_trip_p50": ratio(through.as_f64().unwrap_or(0.0) - node_hop, direct.as_f64().unwrap_or(1.0)),
            "port_forward_mb_per_sec": ratio(total(&cpu["direct"]), total(&cpu["through"]) - node_cpu),
        })
    };
    let mut bounds: serde_json::Map<String, serde_json::Value> = per_transport
        .iter()
        .map(|(via, figures)| (via.clone(), bound(figures)))
        .collect();
    bounds.insert(
        "note".into(),
        json!(
            "ratios through/direct as in `ratios`, had the virtual node cost nothing: the round trip \
               less virtual_node_hop_p50_ms, and port-forward MB/s as direct CPU per MiB over through CPU \
               per MiB less the virtual node's (the forwarding is CPU-bound on this machine)"
        ),
    );
    serde_json::Value::Object(bounds)
}

/// The virtual node's memory under stream load: `bench.sessions` `kubectl exec -i -- cat`
/// sessions open at once through it (each answering a line), then `bench.load_mib` MiB
/// through one port-forward. Its RSS before, with all open (and the high-water mark), and
/// once they closed; the open-session gauge at each step.
async fn stream_load(
    vn: &crate::in_process::VirtualNodeProcess,
    through: &Side<'_>,
    bench: &StreamsBench,
) -> anyhow::Result<serde_json::Value> {
    use crate::streams::{Cat, Forward, Via, echo_throughput};
    let pid = vn.service.pid().context("the virtual node has no pid")?;
    let mib = |b: u64| round3(b as f64 / (1024.0 * 1024.0));
    let gauge = || async {
        crate::in_process::admin_get(&vn.admin_addr, "/metrics")
            .await
            .map(|(_, body)| {
                body.lines()
                    .filter(|l| l.starts_with("tensile_virtual_node_stream_sessions{"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>()
            })
            .unwrap_or(-1.0)
    };
    let settle = || tokio::time::sleep(Duration::from_secs(3));
    settle().await;
    let before = rss(pid)?;
    let high_before = proc_memory(pid, "VmHWM")?;
    let started = Instant::now();
    let opened = futures::future::join_all(
        (0..bench.sessions).map(|_| Cat::start(through.kubeconfig, Via::WebSocket, through.ns, through.pod)),
    )
    .await;
    let mut cats = opened.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    for (i, cat) in cats.iter_mut().enumerate() {
        cat.round_trip(format!("session-{i:04}\n").as_bytes(), Duration::from_secs(60))
            .await
            .with_context(|| format!("session {i}"))?;
    }
    let all_open = started.elapsed();
    let open_gauge = gauge().await;
    let with_sessions = rss(pid)?;
    drop(cats);
    settle().await;
    let after_sessions = rss(pid)?;
    let closed_gauge = gauge().await;

    let port = free_port()?;
    let forward = Forward::start(
        through.kubeconfig,
        Via::WebSocket,
        through.ns,
        through.pod,
        &[format!("{port}:9090")],
    )
    .await?;
    echo_throughput(port, 1024 * 1024, Duration::from_secs(60)).await?;
    let before_forward = rss(pid)?;
    let bytes = bench.load_mib * 1024 * 1024;
    let took = echo_throughput(port, bytes, Duration::from_secs(600)).await?;
    let during_forward = rss(pid)?;
    drop(forward);
    settle().await;
    let after_forward = rss(pid)?;
    let high = proc_memory(pid, "VmHWM")?;
    Ok(json!({
        "sessions": bench.sessions,
        "sessions_open_and_answered_secs": round3(all_open.as_secs_f64()),
        "sessions_gauge": {"all_open": open_gauge, "after_close": closed_gauge},
        "rss_mib": {
            "before": mib(before),
            "sessions_open": mib(with_sessions),
            "sessions_closed": mib(after_sessions),
            "before_forward": mib(before_forward),
            "end_of_forward": mib(during_forward),
            "forward_closed": mib(after_forward),
        },
        "high_water_mib": {"before": mib(high_before), "end": mib(high)},
        "forward_mib": bench.load_mib,
        "forward_mb_per_sec": round3(bytes as f64 / 1e6 / took.as_secs_f64()),
    }))
}

/// The processes a stream crosses, whose CPU the streams bench tallies per side: the upper
/// control plane (its apiserver does the work), the virtual node, the lower control plane,
/// and this process (the simulated kubelets and the clients that read and write).
struct StreamHops {
    groups: [(&'static str, Vec<u32>); 4],
}

impl StreamHops {
    fn new(upper: &TestCluster, lower: &TestCluster, virtual_node: Option<u32>) -> Self {
        StreamHops {
            groups: [
                ("upper_control_plane", upper.pids()),
                ("virtual_node", virtual_node.into_iter().collect()),
                ("lower_control_plane", lower.pids()),
                ("bench_and_simulated_kubelets", vec![std::process::id()]),
            ],
        }
    }

    /// CPU seconds of each group so far.
    fn cpu(&self) -> [f64; 4] {
        self.groups.each_ref().map(|(_, pids)| group_cpu(pids))
    }

    /// Per side (through, direct), CPU seconds of each group.
    fn tally(&self) -> [[f64; 4]; 2] {
        [[0.0; 4]; 2]
    }

    /// Adds what each group used since `before` to `into`.
    fn add(&self, into: &mut [f64; 4], before: &[f64; 4]) {
        for ((sum, now), then) in into.iter_mut().zip(self.cpu()).zip(before) {
            *sum += now - then;
        }
    }

    /// Each side's CPU milliseconds per one of `units`, by group. The kernel counts CPU in
    /// 10 ms ticks, so a figure is good to about 10 ms over all the units.
    fn per(&self, tally: &[[f64; 4]; 2], units: f64) -> serde_json::Value {
        let side = |t: &[f64; 4]| {
            let by: serde_json::Map<String, serde_json::Value> = self
                .groups
                .iter()
                .zip(t)
                .map(|((name, _), secs)| ((*name).to_owned(), json!(round3(secs * 1000.0 / units.max(1.0)))))
                .collect();
            serde_json::Value::Object(by)
        };
        json!({"through": side(&tally[0]), "direct": side(&tally[1])})
    }
}

/// `through / direct`, rounded.
fn ratio(through: f64, direct: f64) -> f64 {
    r3(through / direct)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn summary_ms(s: &Samples) -> serde_json::Value {
    json!({"p50": r3(s.percentile(0.5)), "p99": r3(s.percentile(0.99)), "max": r3(s.max()), "n": s.len()})
}

/// One side of the comparison: the kubeconfig and the pod kubectl names there.
struct Side<'a> {
    kubeconfig: &'a std::path::Path,
    ns: &'a str,
    pod: &'a str,
}

/// `kubectl exec` and `kubectl port-forward` through a virtual node (the `virtual-node`
/// binary) against the same commands on the same lower pod with the lower cluster's
/// kubeconfig, over WebSocket and over SPDY, the two sides interleaved so background load
/// hits both alike.
pub async fn streams(bench: &StreamsBench) -> anyhow::Result<serde_json::Value> {
    use crate::streams::{Cat, Forward, Via, echo_throughput, http_get, kubectl_run, pod_manifest};
    const NODE: &str = "vn-streams";
    const NS: &str = "streams";
    const POD: &str = "bench";
    let (upper, lower) = clusters("bench-streams", None, |o| o).await?;
    let _sim = NodeSimulator::start(
        lower.client().await?,
        SimulatorOptions::new("bench-streams", Some(lower.kubelet_client_ca_pem())),
        vec![NodeConfig::new("lower-0"), NodeConfig::new("lower-1")],
    )
    .await?;
    let vn = crate::in_process::VirtualNodeProcess::start(&upper, NODE, &lower, &[], "streams")?;
    node_ready(&upper, NODE).await?;
    upper.create_namespace(NS).await?;
    let pods: Api<Pod> = Api::namespaced(upper.client().await?, NS);
    let pod: Pod = serde_yaml::from_str(&pod_manifest(NS, POD, NODE)).context("the pod manifest")?;
    pods.create(&PostParams::default(), &pod).await?;
    let phase = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default()
    };
    let uid = crate::wait::until(
        "the upper pod Running",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get(POD).await.map_err(|e| e.to_string())?;
                match (phase(&p).as_str(), p.metadata.uid) {
                    ("Running", Some(uid)) => Ok(uid),
                    (other, _) => Err(format!("phase {other:?}")),
                }
            }
        },
    )
    .await?;
    // The lower pod is found by the upper UID the virtual node marks it with.
    let lower_pods: Api<Pod> = Api::all(lower.client().await?);
    let selector = format!("{}={uid}", tensile_common::names::MARK_UPPER_UID);
    let (lower_ns, lower_name) = crate::wait::until(
        "the lower pod Running",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let (lower_pods, selector) = (lower_pods.clone(), selector.clone());
            async move {
                let list = lower_pods
                    .list(&kube::api::ListParams::default().labels(&selector))
                    .await
                    .map_err(|e| e.to_string())?;
                match list.items.as_slice() {
                    [p] if phase(p) == "Running" => Ok((
                        p.metadata.namespace.clone().unwrap_or_default(),
                        p.metadata.name.clone().unwrap_or_default(),
                    )),
                    other => Err(format!(
                        "{} lower pods, phase {:?}",
                        other.len(),
                        other.first().map(phase)
                    )),
                }
            }
        },
    )
    .await?;
    let through = Side {
        kubeconfig: upper.kubeconfig(),
        ns: NS,
        pod: POD,
    };
    let direct = Side {
        kubeconfig: lower.kubeconfig(),
        ns: &lower_ns,
        pod: &lower_name,
    };
    let sides = [&through, &direct];
    // Alternate which side goes first, so neither always runs right after the other.
    let order = |i: usize| if i.is_multiple_of(2) { [0, 1] } else { [1, 0] };
    // Where the CPU of each side goes, process by process: what each hop costs.
    let hops = StreamHops::new(&upper, &lower, vn.service.pid());

    let mut per_transport = serde_json::Map::new();
    let mut ratios = serde_json::Map::new();
    for via in Via::BOTH {
        // (a) One open `exec -i -- cat`: a line out and back.
        let mut cats = [
            Cat::start(through.kubeconfig, via, through.ns, through.pod).await?,
            Cat::start(direct.kubeconfig, via, direct.ns, direct.pod).await?,
        ];
        let within = Duration::from_secs(10);
        for i in 0..10 {
            for cat in &mut cats {
                cat.round_trip(format!("warm-{i:05}\n").as_bytes(), within)
                    .await?;
            }
        }
        let mut round_trips: [Vec<f64>; 2] = Default::default();
        let mut round_trip_cpu = hops.tally();
        for i in 0..bench.round_trips {
            for side in order(i) {
                let before = hops.cpu();
                let took = cats[side]
                    .round_trip(format!("line-{i:05}\n").as_bytes(), within)
                    .await
                    .with_context(|| format!("{via:?} round trip {i}, side {side}"))?;
                hops.add(&mut round_trip_cpu[side], &before);
                round_trips[side].push(ms(took));
            }
        }
        drop(cats);
        let [rt_through, rt_direct] = round_trips.map(Samples::new);

        // (b) Whole `kubectl exec -- echo hi` runs, kubectl's start-up included.
        let mut commands: [Vec<f64>; 2] = Default::default();
        for i in 0..=bench.commands {
            for side in order(i) {
                let s = sides[side];
                let started = Instant::now();
                let run = kubectl_run(
                    s.kubeconfig,
                    via,
                    &["-n", s.ns, "exec", s.pod, "--", "echo", "hi"],
                    None,
                )
                .await?;
                let took = started.elapsed();
                anyhow::ensure!(
                    run.code == 0 && run.out() == "hi\n",
                    "{via:?}: exec -- echo hi on side {side}: {} {:?} {}",
                    run.code,
                    run.out(),
                    run.stderr
                );
                // The first run of each side is a warm-up.
                if i > 0 {
                    commands[side].push(ms(took));
                }
            }
        }
        let [cmd_through, cmd_direct] = commands.map(Samples::new);

        // port-forward: the echo on 9090 and HTTP on 8080, one kubectl per side.
        let mut ports = Vec::new();
        let mut forwards = Vec::new();
        for s in sides {
            let (http, echo) = (free_port()?, free_port()?);
            forwards.push(
                Forward::start(
                    s.kubeconfig,
                    via,
                    s.ns,
                    s.pod,
                    &[format!("{http}:8080"), format!("{echo}:9090")],
                )
                .await?,
            );
            ports.push((http, echo));
        }
        let bytes = bench.forward_mib * 1024 * 1024;
        let forward_within = Duration::from_secs(300);
        for &(_, echo) in &ports {
            echo_throughput(echo, 1024 * 1024, forward_within).await?;
        }
        let mut rates: [Vec<f64>; 2] = Default::default();
        let mut forward_cpu = hops.tally();
        for round in 0..bench.forward_rounds {
            for side in order(round) {
                let before = hops.cpu();
                let took = echo_throughput(ports[side].1, bytes, forward_within)
                    .await
                    .with_context(|| format!("{via:?} port-forward round {round}, side {side}"))?;
                hops.add(&mut forward_cpu[side], &before);
                rates[side].push(r3(bytes as f64 / 1e6 / took.as_secs_f64()));
            }
        }
        let mut http: [Vec<f64>; 2] = Default::default();
        for i in 0..=bench.http_requests {
            for side in order(i) {
                let started = Instant::now();
                let answer = http_get(ports[side].0).await?;
                let took = started.elapsed();
                anyhow::ensure!(
                    answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with(" port 8080\n"),
                    "{via:?}: HTTP on side {side}: {answer:?}"
                );
                if i > 0 {
                    http[side].push(ms(took));
                }
            }
        }
        drop(forwards);
        let [rate_through, rate_direct] = rates.clone().map(Samples::new);
        let [http_through, http_direct] = http.map(Samples::new);

        per_transport.insert(
            via.name().into(),
            json!({
                "exec_round_trip_ms": {"through": summary_ms(&rt_through), "direct": summary_ms(&rt_direct)},
                "exec_command_ms": {"through": summary_ms(&cmd_through), "direct": summary_ms(&cmd_direct)},
                "port_forward_mb_per_sec": {
                    "through": {"median": rate_through.percentile(0.5), "rounds": rates[0]},
                    "direct": {"median": rate_direct.percentile(0.5), "rounds": rates[1]},
                    "mib_per_round": bench.forward_mib,
                },
                "port_forward_http_ms": {"through": summary_ms(&http_through), "direct": summary_ms(&http_direct)},
                "cpu_ms_per_round_trip": hops.per(&round_trip_cpu, bench.round_trips as f64),
                "cpu_ms_per_mib_forwarded": hops.per(&forward_cpu, bench.forward_mib as f64 * bench.forward_rounds as f64),
            }),
        );
        ratios.insert(
            via.name().into(),
            json!({
                "exec_round_trip_p50": ratio(rt_through.percentile(0.5), rt_direct.percentile(0.5)),
                "exec_round_trip_p99": ratio(rt_through.percentile(0.99), rt_direct.percentile(0.99)),
                "exec_command_p50": ratio(cmd_through.percentile(0.5), cmd_direct.percentile(0.5)),
                "port_forward_mb_per_sec": ratio(rate_through.percentile(0.5), rate_direct.percentile(0.5)),
                "port_forward_http_p50": ratio(http_through.percentile(0.5), http_direct.percentile(0.5)),
            }),
        );
    }
    let hop = virtual_node_hop(&upper, &lower, &vn, (&lower_ns, &lower_name), bench.round_trips).await?;
    let bounds = bounds_without_the_node(&per_transport, &hop);
    let load = stream_load(&vn, &through, bench).await?;
    let kubectl = crate::kubectl::run(upper.kubeconfig(), &["version", "--client", "-o", "json"]).await;
    let kubectl = serde_json::from_str::<serde_json::Value>(&kubectl.stdout)
        .ok()
        .and_then(|v| v["clientVersion"]["gitVersion"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let open = crate::in_process::admin_get(&vn.admin_addr, "/metrics")
        .await
        .map(|(_, body)| {
            body.lines()
                .filter(|l| l.starts_with("tensile_virtual_node_stream_sessions{"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    drop(vn);
    Ok(json!({
        "benchmark": "exec and port-forward through a virtual node vs directly against the same lower pod",
        "kubernetes": upper.version(),
        "kubectl": kubectl,
        "pod": {"through": format!("{NS}/{POD} (upper)"), "direct": format!("{lower_ns}/{lower_name} (lower)")},
        "sizes": {"round_trips": bench.round_trips, "round_trip_warm_up": 10, "commands": bench.commands,
                  "forward_mib": bench.forward_mib, "forward_rounds": bench.forward_rounds,
                  "http_requests": bench.http_requests},
        "websocket": per_transport.get("websocket"),
        "spdy": per_transport.get("spdy"),
        "ratios": ratios,
        "sessions_gauge_at_end": open,
        "load": load,
        "virtual_node_hop": hop,
        "bounds_if_the_virtual_node_cost_nothing": bounds,
        "note": "through = the upper cluster's kubectl, upper apiserver, virtual-node process, lower apiserver, \
                 simulated kubelet; direct = the lower cluster's kubectl against the same lower pod (lower \
                 apiserver, simulated kubelet). cpu_ms_per_round_trip and cpu_ms_per_mib_forwarded: the CPU \
                 each process group used while that side ran (kubectl aside), per line or per MiB. Ratios are through/direct: above 1 is slower through for \
                 latencies, below 1 is slower through for MB/s. exec_round_trip_ms: one line written to an \
                 open `kubectl exec -i -- cat` and read back, after 10 warm-up lines (kubectl's stdin and \
                 stdout pipes included, no process start). exec_command_ms: the wall time of a whole \
                 `kubectl exec POD -- echo hi`, kubectl's start-up, kubeconfig load and session set-up \
                 included, after one warm-up run. port_forward_mb_per_sec: MB (10^6 bytes) per second each \
                 way, forward_mib MiB written to and read back at once from the echo on port 9090 over \
                 one TCP connection to `kubectl port-forward`, checked byte for byte, after a 1 MiB warm-up; \
                 median of the rounds. port_forward_http_ms: a new connection, GET / and the whole answer \
                 on the forwarded port 8080 (a new port-forward stream each). Through and direct runs \
                 alternate; every process shares the machine's cores.",
    }))
}
