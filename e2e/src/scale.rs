//! The `scale` benchmark: what one virtual node costs and how it keeps pace with many pods
//! and a large lower cluster, measured on the `virtual-node` binary as a child process
//! (`TENSILE_BIN_DIR` selects another build of it, to compare two versions in one way).
//!
//! * **Pods**: `pods` pods created upstream with `nodeName` set to the virtual node (no upper
//!   scheduler in the way), against the same pods created directly in the lower cluster in the
//!   same run, both placed by the lower scheduler over `lower_nodes` simulated nodes: created →
//!   all Running, as a ratio. The virtual node's idle, peak and steady RSS and its CPU seconds
//!   per pod. Then a restart with nothing changed: the writes each apiserver served meanwhile,
//!   from its own `apiserver_request_total`.
//! * **Paced**: for each arrival rate in `rates`, `pods` pods created at that rate through a
//!   virtual node of their own: its CPU per pod, RSS, and idle CPU once they all run. With
//!   `baseline`, each rate is run with that other build first, on the same lower cluster, so
//!   two builds are compared in one run (the second run's node meets 10,000 more lower pods).
//! * **Paced with references**: for each rate in `refs_rates`, the same with every pod
//!   mounting a ConfigMap and a Secret of its own and the node acting upstream as
//!   `system:node:<name>`: also its reads of them and its open connections; with `baseline`,
//!   made with that build first too.
//! * **Capacity**: for each size in `capacity_nodes`, a virtual node started over a lower
//!   cluster of that many nodes: seconds until its allocatable upstream counts them all, then
//!   seconds until a cordon of a tenth of them shows, and its RSS.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::benches::{
    CpuUse, Seen, api_writes, between, clusters, cpu_groups, cpu_secs, create_all, legs, node_ready, observe,
    round3, rss,
};
use crate::in_process::{VirtualNodeProcess, admin_get};
use crate::{ClusterOptions, NodeConfig, NodeSimulator, SimulatorOptions, TestCluster};

/// What the benchmark runs.
#[derive(Clone, Debug)]
pub struct Scale {
    /// Pods through the virtual node, and as many directly below.
    pub pods: usize,
    /// Simulated lower nodes under the pods.
    pub lower_nodes: usize,
    /// Lower cluster sizes of the capacity part, ascending.
    pub capacity_nodes: Vec<usize>,
    /// Creates in flight at once.
    pub clients: usize,
    /// `--kube-api-qps`/`--kube-api-burst` of the test bed's scheduler and controller-manager.
    pub test_bed_qps: Option<(u32, u32)>,
    /// Arrival rates (creates per second) of the paced runs, each `pods` pods through a
    /// virtual node of its own after the unpaced one.
    pub rates: Vec<u32>,
    /// Seconds of the idle window after each run settled, CPU measured over it.
    pub idle_secs: u64,
    /// Another build of `virtual-node` (a directory holding it): each paced run is made with
    /// it too, first, on the same lower cluster, so two builds are compared in one run.
    pub baseline: Option<std::path::PathBuf>,
    /// Arrival rates of the paced runs in which every pod references a ConfigMap and a Secret
    /// of its own, the virtual node acting upstream as `system:node:<name>`.
    pub refs_rates: Vec<u32>,
    /// Whether the burst against the direct path, the restart and the heap profile run
    /// (otherwise only the paced runs).
    pub unpaced: bool,
}

const NODE: &str = "vn-scale";

/// Pod `p-I` bound to virtual node `node` (its taint tolerated), with `container`.
pub(crate) fn bound_pod(i: usize, node: &str, container: &Value) -> Value {
    json!({"metadata": {"name": format!("p-{i}")}, "spec": {
        "nodeName": node,
        "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
        "containers": container}})
}

/// Pods a lower node added for a paced run holds (below the simulator's 253 addresses).
const PACED_PODS_PER_NODE: usize = 240;

pub async fn scale(s: &Scale) -> anyhow::Result<Value> {
    let pods = pods(s).await?;
    let mut capacity = Vec::new();
    if !s.capacity_nodes.is_empty() {
        capacity = self::capacity(s).await?;
    }
    Ok(json!({
        "benchmark": "scale: pods through one virtual node vs directly below; capacity of large lower clusters",
        "virtual_node_binary": crate::bins::suite_binary("virtual-node")?.display().to_string(),
        "pods": pods,
        "capacity": capacity,
    }))
}

/// Peak resident memory of process `pid` in bytes.
fn peak_rss(pid: u32) -> anyhow::Result<u64> {
    crate::benches::proc_memory(pid, "VmHWM")
}

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / 1048576.0 * 10.0).round() / 10.0
}

/// Creates `pods` pods from `template` with `clients` creates in flight and waits until a
/// watch shows them all Running: created → all Running, and per pod. `seen` records what the
/// watch saw, per pod.
pub(crate) async fn created_to_running(
    api: Api<Pod>,
    pods: usize,
    clients: usize,
    rate: Option<u32>,
    seen: Arc<Mutex<Seen>>,
    template: impl Fn(usize) -> Value,
) -> anyhow::Result<Value> {
    let watch = tokio::spawn(observe(api.clone(), seen.clone()));
    let start = Instant::now();
    create_all(&api, pods, clients, rate, &seen, template).await?;
    let created_secs = start.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(900);
    while seen.lock().map(|s| s.running.len()).unwrap_or(0) < pods {
        anyhow::ensure!(
            Instant::now() < deadline,
            "not all {pods} pods Running within 15 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all_running_secs = start.elapsed().as_secs_f64();
    watch.abort();
    let s = seen.lock().map_err(|_| anyhow::anyhow!("lock poisoned"))?;
    Ok(json!({
        "pods": pods,
        "creates_in_flight": clients,
        "arrivals_per_sec_asked": rate,
        "created_secs": round3(created_secs),
        "creates_per_sec": round3(pods as f64 / created_secs),
        "created_to_all_running_secs": round3(all_running_secs),
        "all_running_after_last_create_secs": round3(all_running_secs - created_secs),
        "created_to_running_ms": between(&s.created, &s.running),
    }))
}

/// A gauge or counter from the virtual node's admin `/metrics`, summed over its label sets.
pub(crate) async fn metric_sum(admin: &str, name: &str) -> Option<f64> {
    let (_, body) = admin_get(admin, "/metrics").await?;
    let sum = body
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Some(sum)
}

/// Writes an apiserver served between two readings, by kind, and those on pods.
pub(crate) fn writes_between(
    before: &std::collections::HashMap<String, f64>,
    after: &std::collections::HashMap<String, f64>,
) -> Value {
    let mut by_kind = serde_json::Map::new();
    let mut pods = 0.0;
    for (k, a) in after {
        let n = a - before.get(k).copied().unwrap_or(0.0);
        if n > 0.0 {
            by_kind.insert(k.clone(), json!(n));
            if k.split_once(' ')
                .is_some_and(|(_, r)| r == "pods" || r.starts_with("pods/"))
            {
                pods += n;
            }
        }
    }
    json!({"pod_writes": pods, "all_writes_by_kind": by_kind})
}

async fn pods(s: &Scale) -> anyhow::Result<Value> {
    let (upper, lower) = clusters("bench-scale", s.test_bed_qps, |o| o).await?;
    // Room for both runs: the direct pods stay, as other tenants' pods would (each paced run
    // brings nodes of its own).
    let per_node = (2 * s.pods).div_ceil(s.lower_nodes.max(1)) + 10;
    let sim = NodeSimulator::start(
        lower.client().await?,
        SimulatorOptions::new("bench-scale", Some(lower.kubelet_client_ca_pem())),
        Vec::new(),
    )
    .await?;
    futures::stream::iter(0..s.lower_nodes)
        .map(|i| sim.add_node(NodeConfig::new(&format!("lower-{i}")).resource("pods", &per_node.to_string())))
        .buffer_unordered(16)
        .try_collect::<()>()
        .await?;
    let container =
        json!([{"name": "c", "image": "x", "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}]);
    let mut figures = if s.unpaced {
        unpaced(s, &upper, &lower, &container).await?
    } else {
        json!({"kubernetes": upper.version(), "pods": s.pods, "lower_nodes": s.lower_nodes})
    };
    let bed = Bed {
        s,
        upper: &upper,
        lower: &lower,
        sim: &sim,
        container: &container,
    };
    let mut paced = Vec::new();
    for &rate in &s.rates {
        paced.push(both_builds(&bed, rate, false).await?);
    }
    figures["paced"] = json!(paced);
    let mut with_refs = Vec::new();
    for &rate in &s.refs_rates {
        with_refs.push(both_builds(&bed, rate, true).await?);
    }
    figures["paced_with_a_configmap_and_a_secret_per_pod_under_the_node_identity"] = json!(with_refs);
    drop(sim);
    Ok(figures)
}

/// A paced run at `rate` of the build under test, with the baseline build's run of the same
/// kind made first (under `baseline`) when there is one.
async fn both_builds(bed: &Bed<'_>, rate: u32, refs: bool) -> anyhow::Result<Value> {
    let baseline = match &bed.s.baseline {
        Some(dir) => Some(paced_run(bed, rate, Some(dir), refs).await?),
        None => None,
    };
    let mut run = paced_run(bed, rate, None, refs).await?;
    if let Some(baseline) = baseline {
        run["baseline"] = baseline;
    }
    Ok(run)
}

/// The burst through the virtual node against the same pods directly below, the restart
/// with nothing changed, and the heap by component.
async fn unpaced(
    s: &Scale,
    upper: &TestCluster,
    lower: &TestCluster,
    container: &Value,
) -> anyhow::Result<Value> {
    lower.create_namespace("direct").await?;
    let groups = |vn: Option<u32>| {
        let mut g = cpu_groups(upper, lower, "bench_clients_watches_and_simulated_kubelets");
        g.extend(vn.map(|pid| ("virtual_node", vec![pid])));
        g
    };
    let direct_cpu = CpuUse::start(groups(None))?;
    let direct = created_to_running(
        Api::namespaced(lower.client().await?, "direct"),
        s.pods,
        s.clients,
        None,
        Arc::default(),
        |i| json!({"metadata": {"name": format!("p-{i}")}, "spec": {"containers": container}}),
    )
    .await?;
    let direct_cpu = direct_cpu.report()?;

    let vn = VirtualNodeProcess::start(upper, NODE, lower, &[], "scale")?;
    node_ready(upper, NODE).await?;
    upper.create_namespace("virtual").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = vn.pid().context("virtual-node exited")?;
    let idle = rss(pid)?;
    let cpu_before = cpu_secs(pid)?;
    // The same pods below, to tell the virtual node's own legs from the lower cluster's.
    let lower_seen: Arc<Mutex<Seen>> = Arc::default();
    let lower_watch = tokio::spawn(observe(
        Api::namespaced(lower.client().await?, "virtual"),
        lower_seen.clone(),
    ));
    let upper_seen: Arc<Mutex<Seen>> = Arc::default();
    let through_cpu = CpuUse::start(groups(Some(pid)))?;
    let started = Instant::now();
    let through = created_to_running(
        Api::namespaced(upper.client().await?, "virtual"),
        s.pods,
        s.clients,
        None,
        upper_seen.clone(),
        |i| bound_pod(i, NODE, container),
    )
    .await?;
    let cpu_at_running = cpu_secs(pid)? - cpu_before;
    let at_running = started.elapsed();
    let through_cpu = through_cpu.report()?;
    lower_watch.abort();
    let legs = legs(&upper_seen, &lower_seen)?;
    // Settled: what it holds once the burst's work is done.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let steady = rss(pid)?;
    let peak = peak_rss(pid)?;
    let cpu_settled = cpu_secs(pid)? - cpu_before;
    let settled_wall = started.elapsed();
    let idle_cpu = idle_cpu(pid, s.idle_secs).await?;

    // A restart with nothing changed.
    let (upper_client, lower_client) = (upper.client().await?, lower.client().await?);
    let (upper_before, lower_before) = (api_writes(&upper_client).await?, api_writes(&lower_client).await?);
    vn.signal("TERM")?;
    let mut vn = vn;
    vn.exit_within(Duration::from_secs(60))
        .await
        .context("virtual-node did not stop within 60 s of SIGTERM")?;
    drop(vn);
    let restarted_at = Instant::now();
    let vn = VirtualNodeProcess::start(upper, NODE, lower, &[], "scale-restart")?;
    let pid = vn.pid().context("virtual-node exited")?;
    // Caught up: every pod reconciled once since the start.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let reconciled = metric_sum(&vn.admin_addr, "tensile_virtual_node_reconcile_seconds_count")
            .await
            .unwrap_or(0.0);
        if reconciled >= s.pods as f64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the restarted virtual node reconciled {reconciled} pods in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let caught_up = restarted_at.elapsed();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let restart_cpu = cpu_secs(pid)?;
    let restart_rss = rss(pid)?;
    let restart_peak = peak_rss(pid)?;
    let (upper_after, lower_after) = (api_writes(&upper_client).await?, api_writes(&lower_client).await?);
    let profile = heap_profile_of(upper, lower).await?;
    drop(vn);

    let ratio = through["created_to_all_running_secs"]
        .as_f64()
        .unwrap_or(f64::NAN)
        / direct["created_to_all_running_secs"].as_f64().unwrap_or(f64::NAN);
    Ok(json!({
        "kubernetes": upper.version(),
        "pods": s.pods,
        "lower_nodes": s.lower_nodes,
        "test_bed_client_qps_burst": s.test_bed_qps,
        "direct_in_lower": direct,
        "through_virtual_node": through,
        "through_virtual_node_legs": legs,
        "cpu_while_creating_until_all_running": {
            "direct_in_lower": direct_cpu,
            "through_virtual_node": through_cpu,
            "note": "both clusters share one etcd and the machine's cores; pods through the virtual node are written to both apiservers",
        },
        "created_to_all_running_ratio": round3(ratio),
        "virtual_node": {
            "rss_mib": {"idle": mib(idle), "peak": mib(peak), "steady": mib(steady)},
            "cpu_secs": {"to_all_running": round3(cpu_at_running), "settled": round3(cpu_settled),
                         "settled_after_secs": round3(settled_wall.as_secs_f64())},
            "cpu_ms_per_pod": round3(cpu_settled * 1000.0 / s.pods as f64),
            "all_running_after_secs": round3(at_running.as_secs_f64()),
            "idle_with_every_pod_settled": idle_cpu,
        },
        "restart_with_nothing_changed": {
            "every_pod_reconciled_after_secs": round3(caught_up.as_secs_f64()),
            "cpu_secs": round3(restart_cpu),
            "rss_mib": {"steady": mib(restart_rss), "peak": mib(restart_peak)},
            "upper_apiserver": writes_between(&upper_before, &upper_after),
            "lower_apiserver": writes_between(&lower_before, &lower_after),
            "note": "writes from SIGTERM until 15 s after every pod was reconciled once; node status and lease writes are the heartbeat's",
        },
        "heap_by_component": profile,
    }))
}

/// The virtual node's CPU over `secs` seconds of nothing changing: ms per second.
async fn idle_cpu(pid: u32, secs: u64) -> anyhow::Result<Value> {
    let before = cpu_secs(pid)?;
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let used = cpu_secs(pid)? - before;
    Ok(json!({
        "window_secs": secs,
        "cpu_ms_per_sec": round3(used * 1000.0 / secs.max(1) as f64),
        "rss_mib": mib(rss(pid)?),
    }))
}

/// What the paced runs share: the benchmark, its clusters, the lower nodes' simulator and
/// the pods' container.
struct Bed<'a> {
    s: &'a Scale,
    upper: &'a TestCluster,
    lower: &'a TestCluster,
    sim: &'a NodeSimulator,
    container: &'a Value,
}

/// Pod `p-I` of [`bound_pod`] mounting ConfigMap `cm-I` and Secret `s-I`.
fn pod_with_refs(i: usize, node: &str, container: &Value) -> Value {
    let mut pod = bound_pod(i, node, container);
    pod["spec"]["volumes"] = json!([
        {"name": "config", "configMap": {"name": format!("cm-{i}")}},
        {"name": "secret", "secret": {"secretName": format!("s-{i}")}},
    ]);
    if let Some(containers) = pod["spec"]["containers"].as_array_mut() {
        for c in containers {
            c["volumeMounts"] = json!([
                {"name": "config", "mountPath": "/config"},
                {"name": "secret", "mountPath": "/secret"},
            ]);
        }
    }
    pod
}

/// Creates ConfigMap `cm-I` and Secret `s-I` for every pod of a run in `namespace`.
async fn create_refs(client: kube::Client, namespace: &str, pods: usize) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    let (maps, secrets): (Api<ConfigMap>, Api<Secret>) = (
        Api::namespaced(client.clone(), namespace),
        Api::namespaced(client, namespace),
    );
    futures::stream::iter(0..pods)
        .map(|i| {
            let (maps, secrets) = (maps.clone(), secrets.clone());
            async move {
                let map: ConfigMap = serde_json::from_value(
                    json!({"metadata": {"name": format!("cm-{i}")}, "data": {"settings": format!("pod {i}")}}),
                )?;
                let secret: Secret = serde_json::from_value(
                    json!({"metadata": {"name": format!("s-{i}")}, "stringData": {"token": format!("secret of pod {i}")}}),
                )?;
                maps.create(&Default::default(), &map).await?;
                secrets.create(&Default::default(), &secret).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await
}

/// The sum of counter `name` of the apiserver of `client` over the label sets `labels` holds
/// (the text between the braces).
async fn apiserver_counter(
    client: &kube::Client,
    name: &str,
    labels: impl Fn(&str) -> bool,
) -> anyhow::Result<f64> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let prefix = format!("{name}{{");
    let sum = text
        .lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str())?.rsplit_once("} "))
        .filter(|(set, _)| labels(set))
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum();
    Ok(sum)
}

/// The reads of ConfigMaps and Secrets by name an apiserver served so far, from its own
/// `apiserver_request_total`.
async fn refs_reads(client: &kube::Client) -> anyhow::Result<f64> {
    apiserver_counter(client, "apiserver_request_total", |labels| {
        labels.contains("verb=\"GET\"")
            && (labels.contains("resource=\"configmaps\"") || labels.contains("resource=\"secrets\""))
            && labels.contains("subresource=\"\"")
    })
    .await
}

/// Pod watch events the apiserver of `client` has sent, to every watcher.
async fn pod_watch_events(client: &kube::Client) -> anyhow::Result<f64> {
    apiserver_counter(client, "apiserver_watch_events_total", |labels| {
        labels.contains("resource=\"pods\"") || labels.contains("kind=\"Pod\"")
    })
    .await
}

/// `s.pods` pods created at `rate` a second, bound to a virtual node of their own (started
/// for the run, over the same lower cluster, from the build in `build` if given, on lower
/// nodes added for it): its CPU per pod, RSS and idle CPU once they all run. With `refs`,
/// every pod mounts a ConfigMap and a Secret of its own (made before the run) and the node
/// acts upstream as `system:node:<name>`: its reads of them and its open connections too.
/// The pods stay, as other tenants' would: a later run's node holds 10,000 more lower pods.
async fn paced_run(
    bed: &Bed<'_>,
    rate: u32,
    build: Option<&std::path::Path>,
    refs: bool,
) -> anyhow::Result<Value> {
    let Bed {
        s,
        upper,
        lower,
        sim,
        container,
    } = *bed;
    let suffix = match (build.is_some(), refs) {
        (true, true) => "-refs-baseline",
        (true, false) => "-baseline",
        (false, true) => "-refs",
        (false, false) => "",
    };
    // Nodes for the run's pods: a simulated node has 253 pod addresses.
    futures::stream::iter(0..s.pods.div_ceil(PACED_PODS_PER_NODE))
        .map(|i| {
            sim.add_node(
                NodeConfig::new(&format!("paced-{rate}{suffix}-{i}"))
                    .resource("pods", &PACED_PODS_PER_NODE.to_string()),
            )
        })
        .buffer_unordered(16)
        .try_collect::<()>()
        .await?;
    let node = format!("vn-paced-{rate}{suffix}");
    let namespace = format!("paced-{rate}{suffix}");
    let log = format!("scale-paced-{rate}{suffix}");
    let program = match build {
        Some(dir) => dir.join("virtual-node"),
        None => crate::bins::suite_binary("virtual-node")?,
    };
    upper.create_namespace(&namespace).await?;
    let upper_client = upper.client().await?;
    if refs {
        create_refs(upper_client.clone(), &namespace, s.pods).await?;
    }
    let vn = if refs {
        VirtualNodeProcess::start_as_node(&program, upper, &node, lower, &[], &log).await?
    } else {
        VirtualNodeProcess::start_binary(&program, upper, &node, lower, &[], &log)?
    };
    node_ready(upper, &node).await?;
    let floor = crate::floor::Floor::start(crate::floor::Target {
        upper_kubeconfig: upper.kubeconfig().to_owned(),
        lower_kubeconfig: lower.kubeconfig().to_owned(),
        node: node.clone(),
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = vn.pid().context("virtual-node exited")?;
    let idle = rss(pid)?;
    let connections_idle = crate::process::open_connections(pid, None)?;
    let cpu_before = cpu_secs(pid)?;
    let reads_before = refs_reads(&upper_client).await?;
    let lower_client = lower.client().await?;
    let writes_before = (api_writes(&upper_client).await?, api_writes(&lower_client).await?);
    let lower_events_before = pod_watch_events(&lower_client).await?;
    let mut groups = cpu_groups(upper, lower, "bench_clients_watches_and_simulated_kubelets");
    groups.push(("virtual_node", vec![pid]));
    let machine_cpu = CpuUse::start(groups)?;
    let started = Instant::now();
    let run = created_to_running(
        Api::namespaced(upper_client.clone(), &namespace),
        s.pods,
        s.clients,
        Some(rate),
        Arc::default(),
        |i| {
            if refs {
                pod_with_refs(i, &node, container)
            } else {
                bound_pod(i, &node, container)
            }
        },
    )
    .await?;
    let connections_running = crate::process::open_connections(pid, None)?;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let cpu_settled = cpu_secs(pid)? - cpu_before;
    let settled_wall = started.elapsed();
    let machine_cpu = machine_cpu.report()?;
    let reads_settled = refs_reads(&upper_client).await?;
    let writes_settled = (api_writes(&upper_client).await?, api_writes(&lower_client).await?);
    let lower_events = pod_watch_events(&lower_client).await? - lower_events_before;
    let reconciles = metric_sum(&vn.admin_addr, "tensile_virtual_node_reconcile_seconds_count")
        .await
        .context("the virtual node's metrics do not answer")?;
    let steady = rss(pid)?;
    let peak = peak_rss(pid)?;
    let idle_cpu = idle_cpu(pid, s.idle_secs).await?;
    let floor = floor.figures(s.pods).await?;
    let reads_idle = refs_reads(&upper_client).await?;
    let connections_settled = crate::process::open_connections(pid, None)?;
    drop(vn);
    clear_run(&upper_client, &lower_client, &namespace, &node).await?;
    let mut figures = json!({
        "arrivals_per_sec_asked": rate,
        "virtual_node_binary": program.display().to_string(),
        "run": run,
        "virtual_node": {
            "rss_mib": {"idle": mib(idle), "peak": mib(peak), "steady": mib(steady)},
            "cpu_secs_settled": round3(cpu_settled),
            "settled_after_secs": round3(settled_wall.as_secs_f64()),
            "cpu_ms_per_pod": round3(cpu_settled * 1000.0 / s.pods as f64),
            "idle_with_every_pod_settled": idle_cpu,
            "open_connections": {"before_the_pods": connections_idle, "all_running": connections_running,
                                 "settled": connections_settled},
            "pod_reconciles_per_pod": round3(reconciles / s.pods as f64),
        },
        "writes_until_settled": {
            "note": "every write each apiserver served from the first create until settled, whoever wrote (the bench's creates, the lower scheduler's bindings and the simulated kubelets' status writes included)",
            "upper": writes_between(&writes_before.0, &writes_settled.0),
            "lower": writes_between(&writes_before.1, &writes_settled.1),
        },
        "lower_pod_watch_events_per_pod": {
            "note": "pod watch events the lower apiserver sent until settled, to every watcher (the lower scheduler, the simulated kubelets and the floor's watch too), per pod of the run",
            "sent": round3(lower_events / s.pods as f64),
        },
        "traffic_floor": floor,
        "cpu_until_settled": machine_cpu,
    });
    if refs {
        let settled_secs = settled_wall.as_secs_f64();
        figures["upper_reads_of_configmaps_and_secrets"] = json!({
            "until_settled": reads_settled - reads_before,
            "per_sec_until_settled": round3((reads_settled - reads_before) / settled_secs),
            "per_sec_while_idle": round3((reads_idle - reads_settled) / s.idle_secs.max(1) as f64),
            "note": "every GET of a ConfigMap or Secret the upper apiserver served, whoever asked; each pod's own two are read once when it arrives, then re-read within --upper-reads-per-second",
        });
    }
    Ok(figures)
}

/// Removes what a paced run left once its virtual node has stopped: its copies below, its
/// pods in both clusters (at once, no kubelet being there to confirm) and its upper node. Left in place, the next
/// run of the bed would share its apiservers with the node lifecycle controller marking every
/// one of those pods not ready and its lower pod watch would carry them all: two builds
/// compared one after the other would not be measured alike.
async fn clear_run(
    upper: &kube::Client,
    lower: &kube::Client,
    namespace: &str,
    node: &str,
) -> anyhow::Result<()> {
    // The run's copies below: the next run's node, of the same upper cluster, would
    // otherwise collect them all while it is measured.
    let marked = ListParams::default().labels(tensile_common::names::MARK_CLUSTER);
    emptied(Api::<ConfigMap>::namespaced(lower.clone(), namespace), &marked).await?;
    emptied(Api::<Secret>::namespaced(lower.clone(), namespace), &marked).await?;
    for client in [upper, lower] {
        emptied(
            Api::<Pod>::namespaced(client.clone(), namespace),
            &ListParams::default(),
        )
        .await?;
    }
    let nodes: Api<Node> = Api::all(upper.clone());
    nodes
        .delete(node, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting node {node}"))?;
    Ok(())
}

/// Deletes every object of `api` that `selected` selects, at once (no grace period), and
/// waits until none is left. A collection of thousands outlasts one request's deadline: each
/// try deletes what it reaches, and the next takes the rest.
async fn emptied<K>(api: Api<K>, selected: &ListParams) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let what = format!("{} {}", K::plural(&()), api.resource_url());
    let deadline = Instant::now() + Duration::from_secs(300);
    while !api
        .list_metadata(&selected.clone().limit(1))
        .await?
        .items
        .is_empty()
    {
        anyhow::ensure!(Instant::now() < deadline, "the {what} were not gone within 300 s");
        if let Err(e) = api.delete_collection(&now, selected).await {
            tracing::info!("deleting the {what} (going on): {e}");
        }
    }
    Ok(())
}

/// Sum of the `pods` allocatable the upper cluster shows for the virtual node.
async fn allocatable_pods(nodes: &Api<Node>) -> Option<i64> {
    let node = nodes.get_opt(NODE).await.ok()??;
    let milli = tensile_common::quantity::parse_milli(&node.status?.allocatable?.get("pods")?.0).ok()?;
    i64::try_from(milli / 1000).ok()
}

/// Waits until the virtual node's allocatable shows `pods` pods; seconds from `from`.
async fn allocatable_shows(nodes: &Api<Node>, pods: i64, from: Instant) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if allocatable_pods(nodes).await == Some(pods) {
            return Ok(from.elapsed().as_secs_f64());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "allocatable pods never reached {pods} (last {:?})",
            allocatable_pods(nodes).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn set_unschedulable(
    api: &Api<Node>,
    names: &[String],
    on: bool,
    clients: usize,
) -> anyhow::Result<()> {
    futures::stream::iter(names)
        .map(|name| async move {
            api.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"unschedulable": on}})),
            )
            .await
            .with_context(|| format!("cordoning {name}"))
            .map(|_| ())
        })
        .buffer_unordered(clients.max(1))
        .try_collect::<()>()
        .await
}

async fn capacity(s: &Scale) -> anyhow::Result<Vec<Value>> {
    // Neither cluster needs a scheduler or controller-manager: the lower nodes stay as their
    // simulated kubelets post them, and the virtual node manages its upper Node itself.
    let (upper, lower) = clusters(
        "bench-scale-capacity",
        s.test_bed_qps,
        ClusterOptions::apiserver_only,
    )
    .await?;
    // Kubelet-like heartbeats: a Lease a minute, status every ten, so thousands of simulated
    // nodes do not take the cores the virtual node is measured on.
    let mut sim_options = SimulatorOptions::new("bench-scale-capacity", Some(lower.kubelet_client_ca_pem()));
    sim_options.lease_renew = Duration::from_secs(60);
    sim_options.status_period = Duration::from_secs(600);
    let sim = NodeSimulator::start(lower.client().await?, sim_options, Vec::new()).await?;
    let lower_nodes: Api<Node> = Api::all(lower.client().await?);
    let upper_nodes: Api<Node> = Api::all(upper.client().await?);
    let per_node: i64 = 110;
    let mut sizes = s.capacity_nodes.clone();
    sizes.sort_unstable();
    let mut out = Vec::new();
    let mut registered = 0usize;
    for size in sizes {
        let t = Instant::now();
        futures::stream::iter(registered..size)
            .map(|i| sim.add_node(NodeConfig::new(&format!("n-{i:05}"))))
            .buffer_unordered(32)
            .try_collect::<()>()
            .await?;
        let registration_secs = t.elapsed().as_secs_f64();
        registered = registered.max(size);
        // Let the registrations' own status writes settle before the clock starts.
        tokio::time::sleep(Duration::from_secs(5)).await;

        let started = Instant::now();
        let vn = VirtualNodeProcess::start(&upper, NODE, &lower, &[], &format!("capacity-{size}"))?;
        let full_secs = allocatable_shows(&upper_nodes, size as i64 * per_node, started).await?;
        let pid = vn.pid().context("virtual-node exited")?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss_full = rss(pid)?;
        let cordoned: Vec<String> = (0..size).step_by(10).map(|i| format!("n-{i:05}")).collect();
        let t = Instant::now();
        set_unschedulable(&lower_nodes, &cordoned, true, s.clients).await?;
        let cordon_write_secs = t.elapsed().as_secs_f64();
        let done = Instant::now();
        let shown_secs =
            allocatable_shows(&upper_nodes, (size - cordoned.len()) as i64 * per_node, done).await?;
        let rss_end = rss(pid)?;
        let peak = peak_rss(pid)?;
        drop(vn);
        set_unschedulable(&lower_nodes, &cordoned, false, s.clients).await?;
        out.push(json!({
            "lower_nodes": size,
            "registration_secs": round3(registration_secs),
            "full_allocatable_after_start_secs": round3(full_secs),
            "cordoned_nodes": cordoned.len(),
            "cordon_writes_secs": round3(cordon_write_secs),
            "cordon_shown_after_writes_secs": round3(shown_secs),
            "rss_mib": {"all_counted": mib(rss_full), "after_cordon": mib(rss_end), "peak": mib(peak)},
        }));
    }
    drop(sim);
    // Keep the clusters until the measurements are taken.
    drop((upper, lower));
    Ok(out)
}

/// Runs the `heap-profile` binary (built beside this one) against `upper` and `lower` and
/// returns its figures.
async fn heap_profile_of(upper: &TestCluster, lower: &TestCluster) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let program = exe.with_file_name("heap-profile");
    let out = tokio::process::Command::new(&program)
        .arg(format!("--upper-kubeconfig={}", upper.kubeconfig().display()))
        .arg(format!("--lower-kubeconfig={}", lower.kubeconfig().display()))
        .arg(format!("--node={NODE}"))
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| {
            format!(
                "running {} (`cargo build --release -p tensile-e2e --bins`)",
                program.display()
            )
        })?;
    anyhow::ensure!(
        out.status.success(),
        "heap-profile failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// A cache of whole objects, `managedFields` included, as the virtual node kept every cache
/// before trimming; the future keeps it current.
fn whole<K: tensile_common::cache::Watched>(
    api: Api<K>,
    config: kube::runtime::watcher::Config,
) -> (
    kube::runtime::reflector::Store<K>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    use kube::runtime::{WatchStreamExt as _, reflector, watcher};
    let (store, writer) = reflector::store::<K>();
    let feed = reflector(writer, watcher(api, config))
        .applied_objects()
        .for_each(|_| async {});
    (store, feed)
}

/// Where a virtual node's heap goes at this scale, cache by cache: each cache the virtual
/// node keeps, built in this process from the same clusters, as it keeps it now (trimmed) and
/// as it kept it before (whole objects), measured as live bytes of this process's allocator.
/// Every cache stays until the end, so no measurement reuses another's freed memory.
///
/// `allocated` reads the live bytes: the `heap-profile` binary counts every allocation for
/// this, which the `bench` binary does not (counting would slow its other benchmarks).
pub async fn heap_profile(
    upper_client: kube::Client,
    lower_client: kube::Client,
    node: &str,
    allocated: fn() -> usize,
) -> anyhow::Result<Value> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::runtime::watcher::Config;
    use tensile_common::cache;
    use tensile_virtual_node::model::trim;

    let cluster_id = Api::<Namespace>::all(upper_client.clone())
        .get("kube-system")
        .await?
        .metadata
        .uid
        .context("kube-system has no uid")?;
    let ours = format!(
        "{}={cluster_id},{}={node}",
        tensile_common::names::MARK_CLUSTER,
        tensile_common::names::MARK_NODE
    );
    let on_node = format!("spec.nodeName={node}");
    let unfinished = "status.phase!=Succeeded,status.phase!=Failed";
    let changed = Arc::new(tokio::sync::Notify::new());
    let mut feeds = Vec::new();
    let mut out = serde_json::Map::new();

    // Each cache: (objects, live bytes once synced).
    async fn cost<Fut>(
        allocated: fn() -> usize,
        feeds: &mut Vec<tokio::task::JoinHandle<()>>,
        open: Fut,
    ) -> anyhow::Result<(usize, usize)>
    where
        Fut: std::future::Future<Output = anyhow::Result<(usize, tokio::task::JoinHandle<()>)>>,
    {
        let before = allocated();
        let (objects, feed) = open.await?;
        feeds.push(feed);
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok((objects, allocated().saturating_sub(before)))
    }
    async fn kept<K: tensile_common::cache::Stored>(
        (cache, feed): (
            cache::Cache<K>,
            impl std::future::Future<Output = ()> + Send + 'static,
        ),
    ) -> anyhow::Result<(usize, tokio::task::JoinHandle<()>)> {
        let feed = tokio::spawn(feed);
        cache.synced().await;
        Ok((cache.state().len(), feed))
    }
    async fn whole_objects<K: tensile_common::cache::Watched>(
        api: Api<K>,
        config: Config,
    ) -> anyhow::Result<(usize, tokio::task::JoinHandle<()>)> {
        let (store, feed) = whole(api, config);
        let feed = tokio::spawn(feed);
        store.wait_until_ready().await?;
        Ok((store.state().len(), feed))
    }

    let pods = |client: &kube::Client| Api::<Pod>::all(client.clone());
    let lean_pods = |client: &kube::Client| Api::<cache::LeanPod>::all(client.clone());
    let mut rows = Vec::new();
    let f = &mut feeds;
    let now = cost(
        allocated,
        f,
        kept(cache::watched_summaries(
            lean_pods(&upper_client),
            Config::default().fields(&on_node),
            |pod| trim::UpperPod::of(pod.0),
            &changed,
        )),
    )
    .await?;
    let then = cost(
        allocated,
        f,
        whole_objects(pods(&upper_client), Config::default().fields(&on_node)),
    )
    .await?;
    rows.push(("upper pods of the node", now, then));
    let now = cost(
        allocated,
        f,
        kept(cache::watched_summaries(
            lean_pods(&lower_client),
            Config::default().labels(&ours),
            |pod| trim::packed_lower_pod(pod.0),
            &changed,
        )),
    )
    .await?;
    let then = cost(
        allocated,
        f,
        whole_objects(pods(&lower_client), Config::default().labels(&ours)),
    )
    .await?;
    rows.push(("lower pods of the node", now, then));
    let load = || Config::default().fields(unfinished);
    let now = cost(
        allocated,
        f,
        kept(cache::watched_summaries(
            lean_pods(&lower_client),
            load(),
            |pod| trim::PodLoad::of(&pod.0),
            &changed,
        )),
    )
    .await?;
    let then = cost(allocated, f, whole_objects(pods(&lower_client), load())).await?;
    rows.push(("unfinished lower pods (the load)", now, then));
    let nodes = || Api::<Node>::all(lower_client.clone());
    let now = cost(
        allocated,
        f,
        kept(cache::watched_trimmed(
            nodes(),
            Config::default(),
            trim::lower_node,
            &changed,
        )),
    )
    .await?;
    let then = cost(allocated, f, whole_objects(nodes(), Config::default())).await?;
    rows.push(("lower nodes", now, then));
    for f in &feeds {
        f.abort();
    }
    let (mut total_now, mut total_then) = (0, 0);
    for (name, (objects, now), (_, then)) in rows {
        total_now += now;
        total_then += then;
        out.insert(
            name.into(),
            json!({"objects": objects, "now_mib": mib(now as u64), "before_mib": mib(then as u64),
                   "now_bytes_per_object": now / objects.max(1), "before_bytes_per_object": then / objects.max(1)}),
        );
    }
    out.insert(
        "all_pod_and_node_caches".into(),
        json!({"now_mib": mib(total_now as u64), "before_mib": mib(total_then as u64)}),
    );
    out.insert(
        "how".into(),
        json!("live bytes of the bench process's allocator after each cache synced, the same watches the virtual node opens"),
    );
    Ok(Value::Object(out))
}
