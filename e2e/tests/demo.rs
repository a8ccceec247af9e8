//! The demo end to end, started through the same `Demo::start` that `make demo` runs: the
//! sample workload runs in the lower clusters and shows Running above, the commands the demo
//! prints work, the control socket stops and restarts a lower cluster, and nothing survives
//! the demo.
//!
//! The webhook and virtual-node run as their binaries, which `cargo test --workspace` builds
//! (each package has integration tests); alone, build them first with
//! `cargo build -p tensile-virtual-node -p tensile-webhook --bins`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tensile_common::names;
use tensile_common::stash::Stash;
use tensile_e2e::check::{eventually, kubectl};
use tensile_e2e::demo::{DEPLOYMENT, Demo, DemoOptions, NAMESPACE, UPPER, move_manifest};
use tensile_e2e::process::pid_alive;
use tensile_e2e::scene;

const READY: &str = r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}/{.status.conditions[?(@.type=="Ready")].reason}"#;

async fn pods(kubeconfig: &Path) -> Vec<Value> {
    let out = kubectl(kubeconfig, &["-n", NAMESPACE, "get", "pods", "-o", "json"]).await;
    let list: Value = serde_json::from_str(&out).unwrap();
    list["items"].as_array().cloned().unwrap_or_default()
}

fn name(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap_or_default().to_owned()
}

/// Runs a printed command the way a user pastes it into a shell.
async fn shell(command: &str) -> std::process::Output {
    tokio::process::Command::new("sh")
        .args(["-c", command])
        .output()
        .await
        .unwrap()
}

/// Waits until none of `pids` runs any more.
async fn all_gone(pids: &[u32]) {
    tensile_e2e::wait::must(
        "every process gone",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let alive: Vec<u32> = pids.iter().copied().filter(|p| pid_alive(*p)).collect();
            if alive.is_empty() {
                Ok(())
            } else {
                Err(format!("{alive:?}"))
            }
        },
    )
    .await;
}

/// One demo at a time: each starts three clusters.
static ONE_DEMO: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn the_demo_runs_its_workload_below_shows_it_above_and_cleans_up() {
    let _one = ONE_DEMO.lock().await;
    let dir = tensile_e2e::target_dir().join("e2e-logs").join("demo");
    let mut options = DemoOptions::new(&dir);
    options.control_command = format!("{} --dir {}", env!("CARGO_BIN_EXE_demo"), dir.display());
    let demo = Demo::start(options, &|m| eprintln!("demo: {m}"))
        .await
        .unwrap_or_else(|e| panic!("the demo did not start: {e}"));
    eprintln!("{}", demo.summary());
    eprintln!("demo start-up took {:?}", demo.took());
    let up = demo.kubeconfig(UPPER);
    let lowers = demo.lower_names();

    // Above: every replica Running, each on a virtual node, spread over both, and stashed by
    // the webhook with what the workload wrote for the lower cluster.
    let upper_pods = pods(&up).await;
    assert_eq!(upper_pods.len(), 4, "the Deployment's 4 replicas");
    let mut placed: BTreeMap<String, String> = BTreeMap::new();
    for pod in &upper_pods {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        assert!(lowers.iter().any(|l| l == node), "bound to a virtual node: {pod}");
        assert_eq!(pod["status"]["phase"], "Running", "{pod}");
        let stash = pod["metadata"]["annotations"]["clusterSelector"]
            .as_str()
            .unwrap_or_else(|| panic!("no stash from the webhook: {pod}"));
        let stash = Stash::decode(stash).unwrap();
        assert_eq!(
            stash.node_selector.get("kubernetes.io/os").map(String::as_str),
            Some("linux"),
            "{stash:?}"
        );
        assert!(
            stash
                .tolerations
                .iter()
                .any(|t| t.key.as_deref() == Some("example.com/batch")),
            "{stash:?}"
        );
        assert!(
            pod["spec"]["nodeSelector"].get("kubernetes.io/os").is_none(),
            "moved, not copied: {pod}"
        );
        let tolerations = pod["spec"]["tolerations"].to_string();
        assert!(
            tolerations.contains("virtual-kubelet.io/provider")
                && tolerations.contains(r#""tolerationSeconds":30"#),
            "the webhook's tolerations: {tolerations}"
        );
        placed.insert(name(pod), node.to_owned());
    }
    let used: BTreeSet<&str> = placed.values().map(String::as_str).collect();
    assert_eq!(used.len(), 2, "spread over both virtual nodes: {placed:?}");

    // Below: each upper pod has its lower pod, Running on a node of that lower cluster, with
    // the stashed constraints restored and the virtual node's marks.
    for lower in &lowers {
        let below = pods(&demo.kubeconfig(lower)).await;
        let names: BTreeSet<String> = below.iter().map(name).collect();
        let expected: BTreeSet<String> = placed
            .iter()
            .filter(|(_, n)| *n == lower)
            .map(|(p, _)| p.clone())
            .collect();
        assert_eq!(names, expected, "the pods placed on {lower} run in {lower}");
        for pod in &below {
            assert_eq!(pod["status"]["phase"], "Running", "{pod}");
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            assert!(node.starts_with(&format!("{lower}-node-")), "{pod}");
            assert_eq!(pod["spec"]["nodeSelector"]["kubernetes.io/os"], "linux", "{pod}");
            assert_eq!(
                pod["metadata"]["labels"]["tensile.io/virtual-node"],
                lower.as_str()
            );
        }
        // The ConfigMap and Secret the pods use travelled with them, with upstream content.
        for (kind, name, field) in [
            ("configmap", "web-config", "{.data.greeting}"),
            ("secret", "web-secret", "{.data.token}"),
        ] {
            let get = |kubeconfig: std::path::PathBuf| async move {
                let out = tensile_e2e::kubectl::run(
                    &kubeconfig,
                    &[
                        "-n",
                        "demo",
                        "get",
                        kind,
                        name,
                        "-o",
                        &format!("jsonpath={field}"),
                    ],
                )
                .await;
                assert!(out.ok, "{kind} {name}: {}", out.stderr);
                out.stdout
            };
            let above = get(demo.kubeconfig("upper")).await;
            assert!(!above.is_empty());
            assert_eq!(
                get(demo.kubeconfig(lower)).await,
                above,
                "{kind} {name} in {lower}"
            );
        }
    }

    // Every command the demo prints works (watches aside), the scale included.
    for (_, commands) in demo.hints() {
        for command in commands
            .iter()
            .filter(|c| c.contains("/kubectl --kubeconfig ") && !c.ends_with(" -w"))
        {
            let out = shell(command).await;
            assert!(
                out.status.success() && !out.stdout.is_empty(),
                "{command}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let logs = kubectl(
        &up,
        &[
            "-n",
            NAMESPACE,
            "logs",
            &format!("deploy/{DEPLOYMENT}"),
            "--tail",
            "1",
        ],
    )
    .await;
    assert!(logs.contains(" web line "), "a simulated log line: {logs}");
    // The printed apply of the pod only lower-b can place: the descheduler moves it there.
    eventually(
        &up,
        "the 6-CPU pod moved from lower-a to lower-b by the descheduler",
        120,
        &[
            "-n",
            NAMESPACE,
            "get",
            "pods",
            "-l",
            "app=big",
            "-o",
            "jsonpath={range .items[*]}{.spec.nodeName}/{.status.phase} {end}",
        ],
        "lower-b/Running",
    )
    .await;
    eventually(
        &up,
        "6 replicas after the printed scale command",
        60,
        &[
            "-n",
            NAMESPACE,
            "get",
            "deploy",
            DEPLOYMENT,
            "-o",
            "jsonpath={.status.readyReplicas}",
        ],
        "6",
    )
    .await;

    // The printed stop and start commands reach the running demo through its socket.
    let (stop, start) = demo
        .hints()
        .into_iter()
        .flat_map(|(_, c)| c)
        .filter(|c| c.contains(" stop ") || c.contains(" start "))
        .fold((None, None), |(stop, start), c| {
            if c.contains(" stop ") {
                (Some(c), start)
            } else {
                (stop, Some(c))
            }
        });
    let (stop, start) = (stop.unwrap(), start.unwrap());
    let first = &lowers[0];
    let control = async {
        let out = shell(&stop).await;
        assert!(
            out.status.success(),
            "{stop}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("kube-apiserver stopped"),
            "{out:?}"
        );
        scene::node_shows(&up, first, READY, "False/LowerClusterUnreachable", 60).await;
        let bad = shell(&stop.replace(first.as_str(), UPPER)).await;
        assert!(!bad.status.success(), "only lower clusters can be stopped");
        let out = shell(&start).await;
        assert!(
            out.status.success(),
            "{start}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ready = ["get", "node", first.as_str(), "-o", READY];
        tensile_e2e::wait::until(
            "the virtual node Ready again",
            Duration::from_secs(60),
            Duration::from_millis(500),
            || async {
                let out = tensile_e2e::kubectl::run(&up, &ready).await;
                if out.stdout.starts_with("True/") {
                    Ok(())
                } else {
                    Err(out.stdout)
                }
            },
        )
        .await
        .unwrap();
    };
    tokio::select! {
        _ = demo.serve_control(&|m| eprintln!("demo: {m}")) => unreachable!("the control loop never ends"),
        _ = control => {}
    }

    // Nothing the demo started outlives it.
    let pids = demo.pids();
    assert!(pids.len() >= 3 * 3 + 3, "{pids:?}");
    let socket = demo.dir().join(tensile_e2e::demo::CONTROL_SOCKET);
    drop(demo);
    all_gone(&pids).await;
    assert!(
        tensile_e2e::demo::send_command(socket.parent().unwrap(), "stop lower-a")
            .await
            .is_err(),
        "no demo answers any more"
    );
}

/// `demo --multi-scheduler`: the webhook hands the workload to the second kube-scheduler, and
/// the pod only lower-b can hold goes straight there: lower-a's aggregate has room, no node
/// of it does, and the filter knows it. No refusal below, no descheduling, no replacement.
#[tokio::test]
async fn the_demo_with_the_multi_scheduler_puts_the_pod_only_lower_b_holds_there_without_a_refusal() {
    let _one = ONE_DEMO.lock().await;
    let dir = tensile_e2e::target_dir()
        .join("e2e-logs")
        .join("demo-multi-scheduler");
    let mut options = DemoOptions::new(&dir);
    options.multi_scheduler = true;
    let demo = Demo::start(options, &|m| eprintln!("demo: {m}"))
        .await
        .unwrap_or_else(|e| panic!("the demo did not start: {e}"));
    let summary = demo.summary();
    assert!(summary.contains("multi-scheduler"), "{summary}");
    assert!(summary.contains("never refused below"), "{summary}");
    let up = demo.kubeconfig(UPPER);

    let workload = pods(&up).await;
    assert_eq!(workload.len(), 4, "the Deployment's 4 replicas");
    for pod in &workload {
        assert_eq!(
            pod["spec"]["schedulerName"],
            names::MULTI_SCHEDULER,
            "{}",
            name(pod)
        );
        assert_eq!(pod["status"]["phase"], "Running", "{}", name(pod));
    }

    kubectl(&up, &["apply", "-f", &move_manifest().display().to_string()]).await;
    let seen = std::cell::RefCell::new(BTreeSet::<String>::new());
    let refused = std::cell::RefCell::new(BTreeSet::<String>::new());
    tensile_e2e::wait::within("the pod only lower-b holds Running there", 90, || async {
        let big: Vec<Value> = pods(&up)
            .await
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["app"] == "big")
            .collect();
        for pod in &big {
            seen.borrow_mut().insert(name(pod));
            let conditions = pod["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if conditions
                .iter()
                .any(|c| c["type"] == names::CONDITION_LOWER_SCHEDULED && c["status"] == "False")
            {
                refused.borrow_mut().insert(name(pod));
            }
        }
        match big.as_slice() {
            [pod] if pod["spec"]["nodeName"] == "lower-b" && pod["status"]["phase"] == "Running" => Ok(()),
            other => Err(format!(
                "{:?}",
                other
                    .iter()
                    .map(|p| (name(p), p["spec"]["nodeName"].clone()))
                    .collect::<Vec<_>>()
            )),
        }
    })
    .await;
    let (seen, refused) = (seen.into_inner(), refused.into_inner());
    assert!(refused.is_empty(), "refused below: {refused:?}");
    assert_eq!(seen.len(), 1, "one pod, never replaced: {seen:?}");
    let descheduled = kubectl(
        &up,
        &[
            "-n",
            NAMESPACE,
            "get",
            "events",
            "--field-selector",
            "reason=Descheduled",
            "-o",
            "name",
        ],
    )
    .await;
    assert_eq!(descheduled.trim(), "", "nothing was descheduled");

    let pids = demo.pids();
    drop(demo);
    all_gone(&pids).await;
}
