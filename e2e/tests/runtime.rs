//! The daemon runtime end to end, with the real binaries as child processes: SIGTERM, a
//! frozen upper apiserver, leader election between two virtual nodes for one lower
//! cluster, and a CRD of the suite not installed. Every assertion is what kubectl, the
//! upper apiserver's audit log, or a daemon's log and admin endpoint shows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use tensile_e2e::check::{apply, eventually, kubectl};
use tensile_e2e::descheduler::{DeschedulerProcess, metric_sum};
use tensile_e2e::in_process::{VirtualNodeProcess, admin_get};
use tensile_e2e::partition::Partition;
use tensile_e2e::scene::{self, UpperAndLower};
use tensile_e2e::shared::Shared;
use tensile_e2e::wait::{must, until, within};
use tensile_e2e::{ClusterOptions, NodeConfig, TestCluster, free_port};

static BED: Shared<UpperAndLower> = Shared::new();

fn bed() -> &'static UpperAndLower {
    BED.bed(|| async {
        let mut upper = ClusterOptions::new("runtime", "upper");
        upper.audit_writes = true;
        let nodes = (0..3)
            .map(|i| NodeConfig::new(&format!("rt-{i}")).resource("pods", "250"))
            .collect();
        UpperAndLower::start_with([upper, ClusterOptions::new("runtime", "lower")], nodes).await
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

fn down() -> &'static Path {
    bed().lower.kubeconfig()
}

/// A Deployment of `replicas` plain pods pinned to virtual node `node`.
fn deployment(ns: &str, name: &str, node: &str, replicas: u32) -> String {
    tensile_e2e::check::deployment(ns, name, node, replicas, None, "")
}

/// Upper pods of `ns` that are Running, by UID.
async fn running_upstream(ns: &str) -> BTreeSet<String> {
    let rows = kubectl(
        up(),
        &[
            "-n",
            ns,
            "get",
            "pods",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.uid},{.status.phase};{end}"#,
        ],
    )
    .await;
    rows.split(';')
        .filter_map(|r| r.split_once(','))
        .filter(|(_, phase)| *phase == "Running")
        .map(|(uid, _)| uid.to_owned())
        .collect()
}

/// The upper UIDs the lower pods of virtual node `node` in `ns` stand for, one entry per
/// lower pod (duplicates kept).
async fn lower_pods_of(ns: &str, node: &str) -> Vec<String> {
    let rows = kubectl(
        down(),
        &[
            "-n",
            ns,
            "get",
            "pods",
            "-l",
            &format!("tensile.io/virtual-node={node}"),
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.labels.tensile\.io/upper-uid};{end}"#,
        ],
    )
    .await;
    rows.split(';')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Every one of `replicas` pods runs upstream, and exactly one lower pod stands for each.
async fn all_running_exactly_once(ns: &str, node: &str, replicas: usize, secs: u64) {
    let what = format!("{ns}: {replicas} pods Running upstream, each exactly once below");
    must(
        &what,
        Duration::from_secs(secs),
        Duration::from_secs(1),
        || async {
            let upper = running_upstream(ns).await;
            let lower = lower_pods_of(ns, node).await;
            let lower_set: BTreeSet<String> = lower.iter().cloned().collect();
            if upper.len() == replicas && lower.len() == replicas && lower_set == upper {
                return Ok(());
            }
            Err(format!(
                "{} Running upstream, {} lower pods ({} distinct), {} lower pods with no Running upper pod",
                upper.len(),
                lower.len(),
                lower_set.len(),
                lower_set.difference(&upper).count()
            ))
        },
    )
    .await
}

/// Waits until at least `n` lower pods of `node` exist in `ns` (a burst under way).
async fn lower_pods_at_least(ns: &str, node: &str, n: usize, secs: u64) {
    let what = format!("{ns}: at least {n} lower pods");
    must(
        &what,
        Duration::from_secs(secs),
        Duration::from_millis(200),
        || async {
            let seen = lower_pods_of(ns, node).await.len();
            if seen >= n {
                Ok(())
            } else {
                Err(format!("{seen} lower pods"))
            }
        },
    )
    .await
}

/// Waits until `vn`'s `/readyz` answers `code` with a body containing `says`.
/// `code` 0 accepts any status.
async fn readyz_says(vn: &VirtualNodeProcess, code: u16, says: &str, secs: u64) -> Duration {
    let started = Instant::now();
    let what = format!("/readyz of {} answering {code} with {says:?}", vn.admin_addr);
    let answered = until(
        &what,
        Duration::from_secs(secs),
        Duration::from_millis(100),
        || async {
            match vn.readyz().await {
                Some((c, body)) if (code == 0 || c == code) && body.contains(says) => Ok(()),
                seen => Err(format!("{seen:?}")),
            }
        },
    )
    .await;
    if let Err(e) = answered {
        panic!("{e}; log:\n{}", vn.log());
    }
    started.elapsed()
}

const ELECTION: [&str; 4] = [
    "--leader-elect",
    "--leader-elect-lease-duration=6s",
    "--leader-elect-renew-deadline=4s",
    "--leader-elect-retry-period=1s",
];

#[tokio::test]
async fn sigterm_stops_the_virtual_node_and_the_webhook_within_seconds_and_leaves_nothing_half_written() {
    let bed = bed();
    bed.upper.create_namespace("term").await.unwrap();
    let mut vn = VirtualNodeProcess::start(&bed.upper, "vn-term", &bed.lower, &[], "term").unwrap();
    scene::node_ready(up(), "vn-term", 60).await;
    apply(up(), &deployment("term", "web", "vn-term", 40)).await;
    // Mid-burst: some lower pods exist, others are being made.
    lower_pods_at_least("term", "vn-term", 5, 60).await;
    vn.signal("TERM").unwrap();
    let asked = Instant::now();
    let status = vn.exit_within(Duration::from_secs(15)).await;
    let took = asked.elapsed();
    let log = vn.log();
    assert!(
        status.is_some_and(|s| s.success()),
        "virtual-node should exit 0 on SIGTERM; status {status:?}; log:\n{log}"
    );
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM to exit took {took:?}; log:\n{log}"
    );
    eprintln!("figure: virtual-node SIGTERM to exit mid-burst: {took:?}");
    assert!(
        log.contains("SIGTERM received"),
        "the log says why it stopped:\n{log}"
    );

    // A new process picks up where the old one stopped: nothing was left half-done.
    let _vn = VirtualNodeProcess::start(&bed.upper, "vn-term", &bed.lower, &[], "term-again").unwrap();
    all_running_exactly_once("term", "vn-term", 40, 120).await;

    // The webhook binary: answers while it runs, exits 0 within seconds of SIGTERM.
    let program = tensile_e2e::bins::suite_binary("webhook").unwrap();
    let admin = format!("127.0.0.1:{}", free_port().unwrap());
    let args = vec![
        "--address=127.0.0.1".to_owned(),
        format!("--port={}", free_port().unwrap()),
        format!("--admin-addr={admin}"),
        format!("--kubeconfig={}", up().display()),
    ];
    let log = bed.upper.dir().join("webhook-term.log");
    let mut webhook = tensile_e2e::process::Service::start("webhook", &program, &args, &log).unwrap();
    let started = Instant::now();
    while admin_get(&admin, "/readyz").await.map(|(c, _)| c) != Some(200) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "webhook not ready: {}",
            webhook.log_tail(3000)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tensile_e2e::process::signal(webhook.pid().unwrap(), "TERM").unwrap();
    let asked = Instant::now();
    let status = loop {
        if let Some(s) = webhook.exited() {
            break s;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(15),
            "webhook still runs after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "webhook exit status {status}: {}",
        webhook.log_tail(3000)
    );
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "webhook took {:?} to stop",
        asked.elapsed()
    );
    eprintln!("figure: webhook SIGTERM to exit: {:?}", asked.elapsed());
}

#[tokio::test]
async fn a_frozen_upper_apiserver_stalls_no_lease_renewal_past_the_freeze() {
    let bed = bed();
    // Its own upper cluster: freezing the shared one would stall the other tests.
    let upper = TestCluster::start(ClusterOptions::new("runtime", "frozen-upper"))
        .await
        .unwrap();
    let _vn = VirtualNodeProcess::start(
        &upper,
        "vn-frozen",
        &bed.lower,
        &["--request-timeout=3", "--connect-timeout=2"],
        "frozen",
    )
    .unwrap();
    let kc = upper.kubeconfig();
    scene::node_ready(kc, "vn-frozen", 60).await;
    let before = lease_renew_time(kc, "vn-frozen").await;

    let freeze = Duration::from_secs(12);
    upper.signal_apiserver("STOP").unwrap();
    tokio::time::sleep(freeze).await;
    upper.signal_apiserver("CONT").unwrap();

    // Within the length of the freeze, a renewal lands (the Lease is newer than before the
    // freeze) and the node is Ready: no call stayed stuck on a connection the freeze left
    // half-open. (A renewal sent during the freeze and answered at the resume counts: it was
    // not stuck.)
    let started = Instant::now();
    let what = "the Lease renewed and the node Ready within the length of the freeze";
    must(what, freeze, Duration::from_millis(500), || {
        renewed_and_ready(kc, "vn-frozen", before)
    })
    .await;
    eprintln!(
        "figure: lease renewed and node Ready {:?} after a {freeze:?} freeze",
        started.elapsed()
    );
    // And it stays so past the node monitor's grace (20 s from the last renewal before the
    // freeze): a node whose renewals were stuck would be Unknown by now.
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(started.elapsed())).await;
    assert_eq!(scene::node_field(kc, "vn-frozen", scene::READY).await, "True");
}

/// When the Lease of virtual node `node` was last renewed, or what kubectl said instead.
async fn renew_time(kc: &Path, node: &str) -> Result<jiff::Timestamp, String> {
    let args = [
        "-n",
        "kube-node-lease",
        "get",
        "lease",
        node,
        "-o",
        "jsonpath={.spec.renewTime}",
    ];
    let out = tensile_e2e::kubectl::run(kc, &args).await;
    out.stdout
        .trim()
        .parse()
        .map_err(|_| format!("{} {}", out.stdout, out.stderr))
}

/// When the Lease of virtual node `node` was last renewed (it follows the node's first
/// status write within the round, so it is waited for).
async fn lease_renew_time(kc: &Path, node: &str) -> jiff::Timestamp {
    let what = format!("the Lease of {node}");
    within(&what, 10, || renew_time(kc, node)).await
}

/// The Lease of virtual node `node` was renewed after `since`, and the node is Ready.
async fn renewed_and_ready(kc: &Path, node: &str, since: jiff::Timestamp) -> Result<(), String> {
    let renewed = renew_time(kc, node).await;
    let ready = scene::node_field(kc, node, scene::READY).await;
    match renewed {
        Ok(t) if t > since && ready == "True" => Ok(()),
        _ => Err(format!(
            "lease renewed at {renewed:?} (wanted after {since}), Ready={ready}"
        )),
    }
}

#[tokio::test]
async fn a_partition_that_leaves_connections_half_open_stalls_no_lease_renewal() {
    let bed = bed();
    // The virtual node reaches the upper apiserver through a relay that can lose connections.
    let upper_url = bed.upper.url();
    let port: u16 = upper_url.rsplit(':').next().unwrap().parse().unwrap();
    let partition = Partition::start(([127, 0, 0, 1], port).into()).await.unwrap();
    let kubeconfig = bed.upper.dir().join("upper-through-partition.kubeconfig");
    let text = std::fs::read_to_string(up())
        .unwrap()
        .replace(&upper_url, &format!("https://127.0.0.1:{}", partition.port));
    std::fs::write(&kubeconfig, text).unwrap();
    let _vn = VirtualNodeProcess::start(
        &bed.upper,
        "vn-cut",
        &bed.lower,
        &[
            &format!("--kubeconfig={}", kubeconfig.display()),
            "--request-timeout=3",
            "--connect-timeout=2",
        ],
        "cut",
    )
    .unwrap();
    scene::node_ready(up(), "vn-cut", 60).await;
    let before = lease_renew_time(up(), "vn-cut").await;

    // 12 s of partition: every open connection is lost for good, new ones hang.
    partition.cut();
    tokio::time::sleep(Duration::from_secs(12)).await;
    partition.heal();
    let healed = Instant::now();
    tensile_e2e::wait::until(
        "the Lease renewed and the node Ready after the partition healed",
        Duration::from_secs(12),
        Duration::from_millis(250),
        || renewed_and_ready(up(), "vn-cut", before),
    )
    .await
    .unwrap();
    eprintln!(
        "figure: after a 12 s partition, Lease renewed and node Ready {:?} after the heal",
        healed.elapsed()
    );
    // Past the node monitor's grace (20 s from the last renewal before the cut): a node
    // whose calls stayed stuck on the lost connections would be Unknown by now.
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(healed.elapsed())).await;
    renewed_and_ready(up(), "vn-cut", before).await.unwrap();

    // The node's watches of the upper cluster were on connections the partition lost for
    // good. A pod made now is run below and reported Running upstream only if the node found
    // those connections dead and watched again, without waiting out a watch's timeout.
    bed.upper.create_namespace("cut").await.unwrap();
    apply(up(), &deployment("cut", "web", "vn-cut", 1)).await;
    let made = Instant::now();
    must(
        "the pod made after the heal Running upstream",
        Duration::from_secs(45),
        Duration::from_millis(500),
        || async {
            match running_upstream("cut").await.len() {
                1 => Ok(()),
                n => Err(format!("{n} Running")),
            }
        },
    )
    .await;
    eprintln!(
        "figure: a pod made {:?} after the heal Running upstream {:?} after it was made",
        healed.elapsed() - made.elapsed(),
        made.elapsed()
    );
}

/// The port of apiserver address `url` (`https://host:port`).
fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// A burst of pods has the pod controller make dozens of calls at once to both apiservers.
/// Over HTTP/1.1 each call in flight held a connection of its own, and the node kept them
/// open; over HTTP/2 the calls and watches of a client share one connection, so the burst
/// opens none.
#[tokio::test]
async fn a_burst_of_pods_opens_no_connection_to_either_apiserver() {
    let bed = bed();
    bed.upper.create_namespace("conns").await.unwrap();
    let vn = VirtualNodeProcess::start(&bed.upper, "vn-conns", &bed.lower, &[], "conns").unwrap();
    scene::node_ready(up(), "vn-conns", 60).await;
    let pid = vn.pid().unwrap();
    let (upper, lower) = (port_of(&bed.upper.url()), port_of(&bed.lower.url()));
    let open = || {
        (
            tensile_e2e::process::open_connections(pid, Some(upper)).unwrap(),
            tensile_e2e::process::open_connections(pid, Some(lower)).unwrap(),
        )
    };
    // The node's first rounds (its node status, Lease, capacity) are done by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = open();
    apply(up(), &deployment("conns", "web", "vn-conns", 120)).await;
    must(
        "120 pods Running upstream",
        Duration::from_secs(180),
        Duration::from_millis(500),
        || async {
            match running_upstream("conns").await.len() {
                120 => Ok(()),
                n => Err(format!("{n} Running")),
            }
        },
    )
    .await;
    let after = open();
    eprintln!(
        "figure: connections to the upper and lower apiservers, before the pods {before:?}, 120 Running {after:?}"
    );
    assert!(
        after.0 <= before.0 && after.1 <= before.1,
        "connections (upper, lower) grew with the pods: {before:?} before, {after:?} with 120 Running"
    );
}

/// An apiserver lets one HTTP/2 connection carry 100 streams at once by default, and a
/// client that reached the limit holds every further call until a stream ends; a watch's
/// never does. A client of the suite with more watches open than that (a namespace-scoped
/// credential watches each namespace apart) still has its calls answered: it opens another
/// connection first, as client-go does.
#[tokio::test]
async fn a_client_with_more_watches_open_than_a_connection_carries_has_its_calls_answered() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, ListParams, WatchParams};
    let client = tensile_common::kubeconfig::client_from_file(up(), &Default::default())
        .await
        .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let opened = tokio::time::timeout(Duration::from_secs(60), async {
        let mut watches = Vec::new();
        for i in 0..150 {
            let params = WatchParams::default().labels(&format!("tensile-test-watch={i}"));
            watches.push(api.watch(&params, "0").await.unwrap());
        }
        watches
    })
    .await
    .expect("150 watches opened within 60 s");
    let started = Instant::now();
    let answered =
        tokio::time::timeout(Duration::from_secs(10), api.list(&ListParams::default().limit(1))).await;
    assert!(
        matches!(answered, Ok(Ok(_))),
        "a list made with {} watches open: {answered:?}",
        opened.len()
    );
    eprintln!(
        "figure: a list answered {:?} after it was made, {} watches open on the client",
        started.elapsed(),
        opened.len()
    );
}

/// Two replicas of one virtual node started at the same instant, each acting as the node:
/// they take turns on the node's one certificate request, each gets a certificate of its own
/// key (a standby is Ready only once its caches synced, which takes a certificate), and no
/// request is left behind.
#[tokio::test]
async fn replicas_started_together_each_get_their_node_certificate() {
    let bed = bed();
    let replica = || {
        scene::virtual_node(&bed.upper, "vn-pair", &bed.lower, |args| {
            args.leader.leader_elect = true
        })
        .unwrap()
    };
    let (first, second) = (replica(), replica());
    for vn in [&first, &second] {
        must(
            &format!("replica {} Ready", vn.admin_addr),
            Duration::from_secs(120),
            Duration::from_millis(500),
            || async {
                match admin_get(&vn.admin_addr, "/readyz").await {
                    Some((200, body)) if body.contains("leading") || body.contains("standby") => Ok(()),
                    seen => Err(format!("{seen:?}")),
                }
            },
        )
        .await;
    }
    eventually(
        up(),
        "no certificate request left behind",
        30,
        &[
            "get",
            "certificatesigningrequests",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
        "",
    )
    .await;
}

#[tokio::test]
async fn with_leader_election_one_replica_acts_and_the_standby_takes_over_a_killed_leader_mid_burst() {
    let bed = bed();
    bed.upper.create_namespace("ha").await.unwrap();
    let first = VirtualNodeProcess::start(&bed.upper, "vn-ha", &bed.lower, &ELECTION, "ha-1").unwrap();
    readyz_says(&first, 200, "leading", 60).await;
    let second = VirtualNodeProcess::start(&bed.upper, "vn-ha", &bed.lower, &ELECTION, "ha-2").unwrap();
    // Ready once its caches have synced (a Deployment of both is Available), saying it
    // stands by.
    readyz_says(&second, 200, "standby: the leader Lease is held by", 30).await;
    scene::node_ready(up(), "vn-ha", 60).await;
    let leader_port = scene::node_field(
        up(),
        "vn-ha",
        "jsonpath={.status.daemonEndpoints.kubeletEndpoint.Port}",
    )
    .await;
    assert_eq!(
        leader_port,
        first.kubelet_port.to_string(),
        "the node points at the leader's kubelet API"
    );

    apply(up(), &deployment("ha", "web", "vn-ha", 200)).await;
    lower_pods_at_least("ha", "vn-ha", 50, 120).await;
    // The standby watches the same pods, and acts on none of them.
    let standby = admin_get(&second.admin_addr, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default();
    assert_eq!(metric_sum(&standby, "tensile_leader", &[]), 0.0, "{standby}");
    assert_eq!(
        metric_sum(&standby, "tensile_leader_refused_writes_total", &[]),
        0.0,
        "the standby did not even try to write: {standby}"
    );
    readyz_says(&second, 200, "standby", 5).await;
    let second_pid = second.pid().unwrap();
    let killed = jiff::Timestamp::now();
    first.signal("KILL").unwrap();
    // It holds the Lease within the lease duration and one retry of the kill (the leader
    // renewed at most a retry period before it; 2 s of slack for polling on a busy machine),
    // then serves once its caches synced.
    let acquired = readyz_says(&second, 0, "leading", 30).await;
    assert!(
        acquired <= Duration::from_secs(6 + 1 + 2),
        "the standby should hold the Lease within the lease duration (6 s) and a retry; it took {acquired:?}"
    );
    let serving = readyz_says(&second, 200, "leading", 30).await + acquired;
    eprintln!(
        "figure: kill -9 of the leader to the standby holding the Lease: {acquired:?}, serving: {serving:?}"
    );
    all_running_exactly_once("ha", "vn-ha", 200, 240).await;
    scene::node_shows(
        up(),
        "vn-ha",
        "jsonpath={.status.daemonEndpoints.kubeletEndpoint.Port}",
        &second.kubelet_port.to_string(),
        30,
    )
    .await;
    apply(up(), &deployment("ha", "web", "vn-ha", 0)).await;

    // The apiserver's audit log: no write of the standby while the leader lived.
    let agent = format!("_{second_pid})");
    let early: Vec<_> = bed
        .upper
        .audited_writes()
        .unwrap()
        .into_iter()
        .filter(|w| {
            w.user_agent.starts_with("tensile-virtual-node/vn-ha")
                && w.user_agent.ends_with(&agent)
                && w.received < killed
        })
        .collect();
    assert!(
        early.is_empty(),
        "writes from the standby before the leader was killed: {early:#?}"
    );
}

#[tokio::test]
async fn a_leader_paused_past_its_lease_writes_nothing_once_resumed() {
    let bed = bed();
    bed.upper.create_namespace("pause").await.unwrap();
    let mut first =
        VirtualNodeProcess::start(&bed.upper, "vn-pause", &bed.lower, &ELECTION, "pause-1").unwrap();
    readyz_says(&first, 200, "leading", 60).await;
    let second = VirtualNodeProcess::start(&bed.upper, "vn-pause", &bed.lower, &ELECTION, "pause-2").unwrap();
    readyz_says(&second, 200, "standby", 30).await;
    scene::node_ready(up(), "vn-pause", 60).await;
    apply(up(), &deployment("pause", "web", "vn-pause", 10)).await;
    all_running_exactly_once("pause", "vn-pause", 10, 120).await;

    let first_pid = first.pid().unwrap();
    first.signal("STOP").unwrap();
    readyz_says(&second, 200, "leading", 30).await;
    // The new leader does its work while the old one sleeps: a scale-up to act on.
    apply(up(), &deployment("pause", "web", "vn-pause", 20)).await;
    let resumed = jiff::Timestamp::now();
    first.signal("CONT").unwrap();
    let status = first.exit_within(Duration::from_secs(20)).await;
    let log = first.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the resumed old leader sees its Lease lost and exits non-zero; status {status:?}; log:\n{log}"
    );
    assert!(log.contains("lost the leader Lease"), "it says why:\n{log}");
    all_running_exactly_once("pause", "vn-pause", 20, 120).await;

    // The apiserver's audit log: no write from the old leader after it resumed.
    let agent = format!("_{first_pid})");
    let writes = bed.upper.audited_writes().unwrap();
    let ours: Vec<_> = writes
        .iter()
        .filter(|w| {
            w.user_agent.starts_with("tensile-virtual-node/vn-pause") && w.user_agent.ends_with(&agent)
        })
        .collect();
    assert!(
        !ours.is_empty(),
        "the audit log names the old leader's writes before the pause"
    );
    let late: Vec<_> = ours.iter().filter(|w| w.received > resumed).collect();
    assert!(
        late.is_empty(),
        "writes from the old leader after it resumed: {late:#?}"
    );
}

/// The lines of `log` about the exclusion records (their kind, their CRD, their location)
/// that an operator sees by default (info and above).
fn exclusion_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.to_ascii_lowercase().contains("exclusion") && !l.contains("DEBUG"))
        .collect()
}

/// Started without the chart's CRDs (a binary run by hand, an upgrade that has not applied
/// them yet), the descheduler and the webhook say once which definition is missing and how
/// to install it, then ask again seconds apart (not five times a second). The descheduler
/// stays not ready, saying why; the webhook, whose failurePolicy is Fail, serves without the
/// records and says so. Once the definition is applied both read the records, without a
/// restart: the descheduler turns ready, the webhook drops its warning.
#[tokio::test]
async fn a_missing_exclusion_record_crd_is_said_once_and_the_descheduler_turns_ready_once_it_is_applied() {
    // Its own upper cluster: the shared one must keep running without the definition.
    let upper = TestCluster::start(ClusterOptions::new("runtime", "no-crd").apiserver_only())
        .await
        .unwrap();
    // Each attempt of its watch at debug level: the log counts them.
    let attempts = ["--log-level=info,tensile_common::cache=debug".to_owned()];
    let mut descheduler = DeschedulerProcess::start(&upper, &attempts, "no-crd").unwrap();
    let webhook_admin = format!("127.0.0.1:{}", free_port().unwrap());
    let args = vec![
        "--address=127.0.0.1".to_owned(),
        format!("--port={}", free_port().unwrap()),
        format!("--admin-addr={webhook_admin}"),
        format!("--kubeconfig={}", upper.kubeconfig().display()),
    ];
    let program = tensile_e2e::bins::suite_binary("webhook").unwrap();
    let log = upper.dir().join("webhook-no-crd.log");
    let mut webhook = tensile_e2e::process::Service::start("webhook", &program, &args, &log).unwrap();
    let pids = (descheduler.service.pid(), webhook.pid());

    // Past the webhook's wait for the records (10 s): each has said what it will say.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let crd = "exclusionrecords.tensile.io";
    let hint = "kubectl apply -f deploy/helm/tensile/crds/exclusionrecords.yaml";
    let descheduler_log = descheduler.log();
    for (name, log) in [
        ("descheduler", descheduler_log.as_str()),
        ("webhook", &webhook.log_tail(200_000)),
    ] {
        let lines = exclusion_lines(log);
        assert!(
            lines.len() <= 4,
            "{name}: {} lines about the exclusion records in 12 s:\n{}",
            lines.len(),
            lines.join("\n")
        );
        let errors: Vec<_> = lines
            .iter()
            .filter(|l| {
                l.contains("ERROR") && l.contains("ExclusionRecord") && l.contains(crd) && l.contains(hint)
            })
            .collect();
        assert_eq!(
            errors.len(),
            1,
            "{name}: one error names the missing CRD and how to install it:\n{log}"
        );
    }
    // Asked again 5 s later, then 10 s after that: twice in 12 s (five times a second
    // before).
    let asked = descheduler_log.lines().filter(|l| l.contains(crd)).count();
    assert!(
        asked <= 3,
        "the descheduler asked for the records {asked} times in 12 s:\n{descheduler_log}"
    );
    match descheduler.readyz().await {
        Some((503, body)) if body.contains(crd) => {}
        seen => panic!(
            "the descheduler should be not ready, naming the missing CRD: {seen:?}; log:\n{}",
            descheduler.log()
        ),
    }
    match admin_get(&webhook_admin, "/readyz").await {
        Some((200, body)) if body.contains(crd) => {}
        seen => panic!(
            "the webhook should serve without the records, naming the missing CRD: {seen:?}; log:\n{}",
            webhook.log_tail(5000)
        ),
    }

    tensile_e2e::chart::install_exclusion_records(upper.kubeconfig())
        .await
        .unwrap();
    let applied = Instant::now();
    // Asked at most a minute apart once the definition has been missing a while.
    descheduler.wait_ready(Duration::from_secs(90)).await.unwrap();
    eprintln!(
        "figure: ExclusionRecord CRD applied to the descheduler ready: {:?}",
        applied.elapsed()
    );
    within("the webhook reading the exclusion records", 90, || async {
        match admin_get(&webhook_admin, "/readyz").await {
            Some((200, body)) if !body.contains("exclusion") => Ok(()),
            seen => Err(format!("{seen:?}")),
        }
    })
    .await;
    assert!(descheduler.service.exited().is_none() && webhook.exited().is_none());
    assert_eq!(
        (descheduler.service.pid(), webhook.pid()),
        pids,
        "neither was restarted"
    );
}

/// The cluster controller started without the LowerCluster definition says once which is
/// missing and how to install it, asks again seconds apart, and once the definition is
/// applied takes the clusters made after it, without a restart.
#[tokio::test]
async fn a_missing_lower_cluster_crd_is_said_once_and_the_cluster_controller_takes_clusters_once_it_is_applied()
 {
    let upper = TestCluster::start(ClusterOptions::new("runtime", "no-lowercluster-crd").apiserver_only())
        .await
        .unwrap();
    kubectl(upper.kubeconfig(), &["create", "namespace", "tensile"]).await;
    // The smallest template a virtual node's Deployment is made from.
    let template = upper.dir().join("virtual-node-template.yaml");
    std::fs::write(
        &template,
        "apiVersion: apps/v1\nkind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n      \
         - name: virtual-node\n        image: tensile\n",
    )
    .unwrap();
    let args = vec![
        format!("--kubeconfig={}", upper.kubeconfig().display()),
        "--namespace=tensile".to_owned(),
        format!("--virtual-node-template={}", template.display()),
        format!("--admin-addr=127.0.0.1:{}", free_port().unwrap()),
        "--log-format=plain".to_owned(),
        // Each attempt of its watch at debug level: the log counts them.
        "--log-level=info,tensile_common::cache=debug".to_owned(),
    ];
    let program = tensile_e2e::bins::suite_binary("cluster-controller").unwrap();
    let log = upper.dir().join("cluster-controller.log");
    let mut controller =
        tensile_e2e::process::Service::start("cluster-controller", &program, &args, &log).unwrap();

    tokio::time::sleep(Duration::from_secs(12)).await;
    let crd = "lowerclusters.tensile.io";
    let said = controller.log_tail(200_000);
    let lines: Vec<&str> = said.lines().filter(|l| l.contains(crd)).collect();
    let errors = lines
        .iter()
        .filter(|l| l.contains("ERROR") && l.contains("LowerCluster") && l.contains("tensilectl crds"))
        .count();
    assert_eq!(
        errors, 1,
        "one error names the missing CRD and how to install it:\n{said}"
    );
    // Asked 5 s later, then 10 s after that: at most three times in 12 s.
    assert!(
        lines.len() <= 3,
        "the controller asked for its LowerClusters {} times in 12 s:\n{}",
        lines.len(),
        lines.join("\n")
    );

    tensile_e2e::chart::apply_crds(upper.kubeconfig()).await.unwrap();
    let applied = Instant::now();
    apply(
        upper.kubeconfig(),
        "apiVersion: tensile.io/v1alpha1\nkind: LowerCluster\nmetadata:\n  name: late\n  labels: {tensile.io/controller-namespace: tensile}\n\
         spec:\n  credential: {secretName: late-credential}\n",
    )
    .await;
    eventually(
        upper.kubeconfig(),
        "the controller taking the LowerCluster made after its definition",
        90,
        &[
            "get",
            "lowercluster",
            "late",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="CredentialValid")].reason}"#,
        ],
        "SecretMissing",
    )
    .await;
    eprintln!(
        "figure: LowerCluster CRD applied to its first cluster taken: {:?}",
        applied.elapsed()
    );
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));
}
