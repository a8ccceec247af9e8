//! `kubectl exec`, `attach` and `port-forward` on pods that run below a virtual node: an upper
//! cluster, a lower cluster with simulated kubelets (which speak WebSocket and SPDY as real
//! ones do), a virtual node in process. Every command is an upper cluster's kubectl, but for
//! the official Python client's, which runs against both clusters.
//!
//! The upper apiserver (1.37) passes kubectl's WebSocket to the virtual node as it came
//! (`ExtendWebSocketsToKubelet`, on by default); a second upper cluster over the same lower
//! cluster has that gate off, so its apiserver translates every stream into SPDY/3.1 toward
//! the kubelet API, as 1.35 and older apiservers do.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tensile_e2e::check::apply;
use tensile_e2e::in_process::{self, admin_get};
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::streams::{
    Cat, Forward, Run, Via, echo, http_get, kubectl_command, kubectl_run, pod_manifest, python_client_streams,
};
use tensile_e2e::{ClusterOptions, Error, NodeSimulator, TestCluster, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Bed {
    upper: TestCluster,
    lower: TestCluster,
    sim: NodeSimulator,
    node: in_process::VirtualNode,
}

static BED: Shared<Bed> = Shared::new();

const NODE: &str = "vn-exec";
const NS: &str = "streams";

/// The lower account every virtual node of the bed acts as below ([`in_process::options`]
/// gives them the chart's lower identity): the lower apiserver audits each of its calls.
const LOWER_USER: &str = "system:serviceaccount:tensile-e2e-lower:e2e-tensile-lower";

fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower] = scene::clusters_with([
            ClusterOptions::new("exec", "upper"),
            ClusterOptions {
                audit_writes: true,
                audit_users: vec![LOWER_USER.into()],
                ..ClusterOptions::new("exec", "lower")
            },
        ])
        .await?;
        let sim = scene::simulate(&lower, scene::nodes("low", 2)).await?;
        let node = scene::virtual_node(&upper, NODE, &lower, |_| {})?;
        upper.create_namespace(NS).await?;
        Ok(Bed {
            upper,
            lower,
            sim,
            node,
        })
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

/// An upper cluster whose apiserver has `ExtendWebSocketsToKubelet` off, with a virtual node
/// over the bed's lower cluster: whatever kubectl speaks, the kubelet API is reached over SPDY.
struct SpdyUpper {
    upper: TestCluster,
    node: in_process::VirtualNode,
}

static SPDY_UPPER: Shared<SpdyUpper> = Shared::new();

const SPDY_NODE: &str = "vn-exec-spdy";
/// Its pods' namespace: another than [`NS`], since both virtual nodes make their lower pods
/// in the same lower cluster under the upper pods' namespaces and names.
const SPDY_NS: &str = "streams-spdy";

fn spdy_upper() -> &'static SpdyUpper {
    SPDY_UPPER.bed(|| async {
        let options = ClusterOptions::new("exec", "upper-spdy")
            .apiserver_feature_gates(&["ExtendWebSocketsToKubelet=false"]);
        // The bed's clusters start meanwhile, if no other test has started them.
        let (upper, lower) = tokio::join!(
            TestCluster::start(options),
            tokio::task::spawn_blocking(|| &bed().lower)
        );
        let (upper, lower) = (
            upper?,
            lower.map_err(|e| Error::Cluster {
                cluster: "lower".into(),
                message: format!("the shared bed did not start: {e}"),
            })?,
        );
        let node = scene::virtual_node(&upper, SPDY_NODE, lower, |_| {})?;
        upper.create_namespace(SPDY_NS).await?;
        Ok(SpdyUpper { upper, node })
    })
}

/// Creates pod `name` on the shared virtual node and waits until it runs.
async fn running_pod(kubeconfig: &Path, ns: &str, name: &str, node: &str) {
    apply(kubeconfig, &pod_manifest(ns, name, node)).await;
    scene::pod_running(kubeconfig, ns, name, 90).await;
}

async fn exec(via: Via, pod: &str, command: &[&str], stdin: Option<Vec<u8>>) -> Run {
    exec_at(up(), NS, via, pod, command, stdin).await
}

/// `kubectl -n NS exec [-i] POD -- COMMAND…` through the apiserver of `kubeconfig`.
async fn exec_at(
    kubeconfig: &Path,
    ns: &str,
    via: Via,
    pod: &str,
    command: &[&str],
    stdin: Option<Vec<u8>>,
) -> Run {
    let mut args = vec!["-n", ns, "exec"];
    if stdin.is_some() {
        args.push("-i");
    }
    args.push(pod);
    args.push("--");
    args.extend_from_slice(command);
    kubectl_run(kubeconfig, via, &args, stdin).await.unwrap()
}

/// The value of the first sample in a Prometheus text `body` whose line starts with
/// `line_prefix` (0 without one).
fn sample(body: &str, line_prefix: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A gauge or counter value from the virtual node's admin `/metrics`.
async fn metric(admin: &str, line_prefix: &str) -> f64 {
    let (_, body) = admin_get(admin, "/metrics")
        .await
        .expect("admin endpoint answers");
    sample(&body, line_prefix)
}

const OPEN_EXEC: &str = r#"tensile_virtual_node_stream_sessions{kind="exec"} "#;

#[tokio::test]
async fn kubectl_exec_runs_the_command_below_over_websocket_and_spdy() {
    let bed = bed();
    running_pod(up(), NS, "runner", NODE).await;
    for via in [Via::WebSocket, Via::Spdy] {
        let hi = exec(via, "runner", &["echo", "hi"], None).await;
        assert_eq!(
            (hi.code, hi.out().as_str()),
            (0, "hi\n"),
            "{via:?}: {}",
            hi.stderr
        );
        let env = exec(via, "runner", &["env"], None).await;
        assert!(
            env.out().contains("GREETING=hello-from-below\n") && env.out().contains("HOSTNAME=runner\n"),
            "{via:?}: {}",
            env.out()
        );
        let exit = exec(via, "runner", &["sh", "-c", "exit 3"], None).await;
        assert_eq!(
            exit.code, 3,
            "{via:?}: kubectl exits with the command's code: {}",
            exit.stderr
        );
        assert!(
            exit.stderr.contains("command terminated with exit code 3"),
            "{}",
            exit.stderr
        );

        // 1 MiB through stdin comes back byte for byte.
        let data: Vec<u8> = (0..(1 << 20))
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let started = Instant::now();
        let cat = exec(via, "runner", &["cat"], Some(data.clone())).await;
        assert_eq!(cat.code, 0, "{via:?}: {}", cat.stderr);
        assert_eq!(cat.stdout.len(), data.len(), "{via:?}: bytes back");
        assert!(cat.stdout == data, "{via:?}: the bytes are identical");
        eprintln!("{via:?}: 1 MiB through cat in {:?}", started.elapsed());

        let unknown = exec(via, "runner", &["ls"], None).await;
        assert_eq!(unknown.code, 127, "{}", unknown.stderr);
    }

    // A wrong container name gets kubectl's usual error from the upper apiserver.
    let wrong = kubectl_run(
        up(),
        Via::WebSocket,
        &["-n", NS, "exec", "runner", "-c", "nope", "--", "echo"],
        None,
    )
    .await
    .unwrap();
    assert_ne!(wrong.code, 0);
    assert!(
        wrong
            .stderr
            .contains("container nope is not valid for pod runner")
            || wrong.stderr.contains("container not found (\"nope\")"),
        "{}",
        wrong.stderr
    );
    // Sessions end with the command: nothing stays open in the virtual node.
    assert_eq!(metric(&bed.node.admin_addr, OPEN_EXEC).await, 0.0);
}

#[tokio::test]
async fn kubectl_exec_with_a_tty_gets_a_terminal() {
    bed();
    running_pod(up(), NS, "terminal", NODE).await;
    for via in Via::BOTH {
        terminal_works(up(), NS, via, "terminal").await;
    }
}

/// `kubectl exec -it POD` in a terminal (`script`'s) of 132×43 that shrinks to 100×30 four
/// seconds in: the container gets a terminal, in cooked mode, of the size kubectl's terminal
/// has, and follows its resize (kubectl sends it on `SIGWINCH`, the kernel's signal of a
/// changed terminal size). A `SIGWINCH` that reaches kubectl before it listens for it is
/// lost in kubectl (seen once on a loaded machine: the size never changed), so the terminal
/// then widens by a column and narrows back, two seconds apart: the container must end at
/// 100×30 whichever of the three signals kubectl saw first.
async fn terminal_works(kubeconfig: &Path, ns: &str, via: Via, pod: &str) {
    let kubectl = format!(
        "{} --kubeconfig {} -n {ns} exec -it {pod} -- sh -c 'env; stty size; sleep 10; stty size'",
        tensile_e2e::kubectl::binary_for(kubeconfig).display(),
        kubeconfig.display()
    );
    let resize = "sleep 4; stty cols 100 rows 30 </dev/tty; sleep 2; stty cols 101 rows 30 </dev/tty; \
                  sleep 2; stty cols 100 rows 30 </dev/tty";
    let line = format!("stty cols 132 rows 43; ({resize}) & exec {kubectl}");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("script")
            .args(["-qec", &line, "/dev/null"])
            .env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", via.websockets_env())
            .env("SHELL", "/bin/sh")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{via:?}: {text}");
    assert!(
        text.contains("TERM=xterm\r\n"),
        "{via:?}: a tty, in cooked mode: {text:?}"
    );
    assert!(!text.contains("Unable to use a TTY"), "{via:?}: {text}");
    let sizes: Vec<&str> = text
        .split("\r\n")
        .filter(|l| l.split(' ').count() == 2 && l.split(' ').all(|w| w.parse::<u16>().is_ok()))
        .collect();
    assert_eq!(
        sizes,
        ["43 132", "30 100"],
        "{via:?}: the terminal's size, then its size after the resize: {text:?}"
    );
}

#[tokio::test]
async fn twenty_concurrent_execs_all_complete() {
    bed();
    running_pod(up(), NS, "busy", NODE).await;
    let started = Instant::now();
    let runs = futures::future::join_all((0..20).map(|i| async move {
        let via = if i % 2 == 0 { Via::WebSocket } else { Via::Spdy };
        let word = format!("exec-{i}");
        let run = exec(via, "busy", &["echo", &word], None).await;
        (word, run)
    }))
    .await;
    for (word, run) in runs {
        assert_eq!((run.code, run.out()), (0, format!("{word}\n")), "{}", run.stderr);
    }
    eprintln!("20 concurrent execs in {:?}", started.elapsed());
}

#[tokio::test]
async fn kubectl_attach_follows_the_lower_container() {
    bed();
    running_pod(up(), NS, "attached", NODE).await;
    for via in Via::BOTH {
        attach_follows(up(), NS, via, "attached").await;
    }
}

/// `kubectl attach` to `pod`'s container shows two of its lines within 30 s.
async fn attach_follows(kubeconfig: &Path, ns: &str, via: Via, pod: &str) {
    let mut cmd = kubectl_command(kubeconfig, via, &["-n", ns, "attach", pod, "-c", "app"]);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let line = format!("{ns}/{pod} app line ");
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    while seen.lines().filter(|l| l.starts_with(&line)).count() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stdout.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            _ => {
                let _ = child.kill().await;
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err).await;
                panic!("{via:?}: attach showed {seen:?}; stderr {err}");
            }
        }
    }
    child.kill().await.unwrap();
}

#[tokio::test]
async fn kubectl_port_forward_reaches_the_lower_pods_ports() {
    bed();
    running_pod(up(), NS, "server", NODE).await;
    for via in [Via::WebSocket, Via::Spdy] {
        let (a, b) = (free_port().unwrap(), free_port().unwrap());
        let forward = Forward::start(up(), via, NS, "server", &[format!("{a}:8080")])
            .await
            .unwrap();
        for round in 0..2 {
            let answer = http_get(a).await.unwrap();
            assert!(
                answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("streams/server port 8080\n"),
                "{via:?} round {round}: {answer:?}"
            );
        }
        drop(forward);
        // Two ports at once: HTTP on one, an echo of 256 KiB on the other.
        let forward = Forward::start(
            up(),
            via,
            NS,
            "server",
            &[format!("{a}:8080"), format!("{b}:9090")],
        )
        .await
        .unwrap();
        let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8).collect();
        let (answer, back) = tokio::join!(http_get(a), echo(b, &data));
        let (answer, back) = (answer.unwrap(), back.unwrap());
        assert!(
            answer.ends_with("streams/server port 8080\n"),
            "{via:?}: {answer:?}"
        );
        assert!(back == data, "{via:?}: the echo is identical");
        drop(forward);
    }
}

/// With `ExtendWebSocketsToKubelet` off the upper apiserver reaches the kubelet API over SPDY
/// whatever kubectl speaks, and everything works as with the gate on: exec's output, stdin
/// (1 MiB, ended over WebSocket by kubectl's close signal), exit codes, a terminal, attach,
/// and execs side by side.
#[tokio::test]
async fn with_websockets_to_the_kubelet_off_exec_and_attach_reach_the_lower_pod_over_spdy() {
    let spdy = spdy_upper();
    let upper = spdy.upper.kubeconfig();
    running_pod(upper, SPDY_NS, "runner", SPDY_NODE).await;
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for via in Via::BOTH {
        let (hi, exit, unknown, cat) = tokio::join!(
            exec_at(upper, SPDY_NS, via, "runner", &["echo", "hi"], None),
            exec_at(upper, SPDY_NS, via, "runner", &["sh", "-c", "exit 3"], None),
            exec_at(upper, SPDY_NS, via, "runner", &["ls"], None),
            exec_at(upper, SPDY_NS, via, "runner", &["cat"], Some(data.clone())),
        );
        assert_eq!(
            (hi.code, hi.out().as_str()),
            (0, "hi\n"),
            "{via:?}: {}",
            hi.stderr
        );
        assert!(
            exit.code == 3 && exit.stderr.contains("command terminated with exit code 3"),
            "{via:?}: kubectl exits with the command's code: {} {}",
            exit.code,
            exit.stderr
        );
        assert_eq!(unknown.code, 127, "{via:?}: {}", unknown.stderr);
        assert_eq!(cat.code, 0, "{via:?}: {}", cat.stderr);
        assert!(
            cat.stdout == data,
            "{via:?}: 1 MiB through cat comes back identical ({} bytes back)",
            cat.stdout.len()
        );
        terminal_works(upper, SPDY_NS, via, "runner").await;
        attach_follows(upper, SPDY_NS, via, "runner").await;
    }
    let runs = futures::future::join_all((0..10).map(|i| async move {
        let via = Via::BOTH[i % 2];
        let word = format!("exec-{i}");
        let run = exec_at(upper, SPDY_NS, via, "runner", &["echo", &word], None).await;
        (word, run)
    }))
    .await;
    for (word, run) in runs {
        assert_eq!((run.code, run.out()), (0, format!("{word}\n")), "{}", run.stderr);
    }
    tensile_e2e::wait::within("every exec session released", 10, || async {
        match metric(&spdy.node.admin_addr, OPEN_EXEC).await {
            0.0 => Ok(()),
            open => Err(format!("{open} open")),
        }
    })
    .await;
}

/// With `ExtendWebSocketsToKubelet` off port-forward is tunnelled to the kubelet API over
/// SPDY: two ports at once, each carrying four connections side by side (HTTP on one, 64 KiB
/// echoes on the other).
#[tokio::test]
async fn with_websockets_to_the_kubelet_off_port_forward_carries_concurrent_streams_over_spdy() {
    let spdy = spdy_upper();
    let upper = spdy.upper.kubeconfig();
    running_pod(upper, SPDY_NS, "server", SPDY_NODE).await;
    let sent: Vec<Vec<u8>> = (0..4u32)
        .map(|k| (0..64 * 1024u32).map(|i| ((i + k) % 251) as u8).collect())
        .collect();
    for via in Via::BOTH {
        let (a, b) = (free_port().unwrap(), free_port().unwrap());
        let mappings = [format!("{a}:8080"), format!("{b}:9090")];
        let forward = Forward::start(upper, via, SPDY_NS, "server", &mappings)
            .await
            .unwrap();
        let (answers, backs) = tokio::join!(
            futures::future::join_all((0..4).map(|_| http_get(a))),
            futures::future::join_all(sent.iter().map(|data| echo(b, data))),
        );
        for answer in answers {
            let answer = answer.unwrap();
            assert!(
                answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("streams-spdy/server port 8080\n"),
                "{via:?}: {answer:?}"
            );
        }
        for (back, data) in backs.into_iter().zip(&sent) {
            assert!(back.unwrap() == *data, "{via:?}: the echo is identical");
        }
        drop(forward);
    }
}

/// Which protocol reaches the virtual node, seen twice: by the upper apiserver's own counters
/// of the streams it translated (`apiserver_stream_translator_requests_total` for exec,
/// `apiserver_stream_tunnel_requests_total` for port-forward), and by what the virtual node
/// opened below, where it passes on the method and upgrade it was handed: a WebSocket
/// handshake is always a GET (audited `get`), SPDY from an apiserver a POST (`create`).
/// kubectl speaks WebSocket to both upper apiservers; with the gate on (1.37's default) the
/// virtual node gets it as it is, with the gate off it gets SPDY.
#[tokio::test]
async fn the_upper_apiserver_reaches_the_virtual_node_over_websocket_and_over_spdy_with_the_gate_off() {
    let (bed, spdy) = (bed(), spdy_upper());
    // (upper, namespace, virtual node, the verb the lower apiserver audits)
    let uppers = [
        (up(), NS, NODE, "get"),
        (spdy.upper.kubeconfig(), SPDY_NS, SPDY_NODE, "create"),
    ];
    for (upper, ns, node, _) in uppers {
        running_pod(upper, ns, "protocol", node).await;
        let hi = exec_at(upper, ns, Via::WebSocket, "protocol", &["echo", "hi"], None).await;
        assert_eq!((hi.code, hi.out().as_str()), (0, "hi\n"), "{ns}: {}", hi.stderr);
        let port = free_port().unwrap();
        let forward = Forward::start(upper, Via::WebSocket, ns, "protocol", &[format!("{port}:8080")])
            .await
            .unwrap();
        let answer = http_get(port).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{ns}: {answer:?}");
        drop(forward);
    }

    for (upper, ns, _, verb) in uppers {
        let what = format!("the virtual node's exec and port-forward of {ns}/protocol audited below");
        let verbs = tensile_e2e::wait::within(&what, 15, || async {
            let calls = bed.lower.audited_writes().map_err(|e| e.to_string())?;
            let verbs = |sub: &str| -> BTreeSet<String> {
                let path = format!("/api/v1/namespaces/{ns}/pods/protocol/{sub}?");
                calls
                    .iter()
                    .filter(|c| c.user == LOWER_USER && c.uri.starts_with(&path))
                    .map(|c| c.verb.clone())
                    .collect()
            };
            let seen = (verbs("exec"), verbs("portforward"));
            if seen.0.is_empty() || seen.1.is_empty() {
                Err(format!("{seen:?}"))
            } else {
                Ok(seen)
            }
        })
        .await;
        let only = BTreeSet::from([verb.to_owned()]);
        assert_eq!(verbs, (only.clone(), only), "{ns}: exec and port-forward below");

        let metrics = tensile_e2e::check::kubectl(upper, &["get", "--raw", "/metrics"]).await;
        let translated = sample(
            &metrics,
            r#"apiserver_stream_translator_requests_total{code="200"} "#,
        );
        let tunnelled = sample(&metrics, r#"apiserver_stream_tunnel_requests_total{code="101"} "#);
        if verb == "get" {
            assert_eq!(
                (translated, tunnelled),
                (0.0, 0.0),
                "{ns}: the gate on, the upper apiserver translates nothing"
            );
        } else {
            assert!(
                translated >= 1.0 && tunnelled >= 1.0,
                "{ns}: the gate off, the upper apiserver translates exec ({translated}) and \
                 tunnels port-forward ({tunnelled}) into SPDY"
            );
        }
    }
}

/// The official Kubernetes Python client (`e2e/python/client_streams.py`) sees the same
/// through the virtual node as on a pod of the lower cluster itself: its exec (WebSocket v5,
/// which the 1.37 apiservers pass to the kubelet API as it is) with stdout, stderr, stdin
/// and exit codes, and its port-forward (WebSocket `v4.channel.k8s.io`, which both apiservers
/// pass to the kubelet as it is) carrying an HTTP request to the pod's port.
#[tokio::test]
async fn the_python_client_execs_and_port_forwards_through_the_virtual_node_as_below() {
    let bed = bed();
    running_pod(up(), NS, "python", NODE).await;
    let lower = bed.lower.kubeconfig();
    bed.lower.create_namespace("direct").await.unwrap();
    running_pod(lower, "direct", "python", "low-0").await;

    let (via_node, direct) = tokio::join!(
        python_client_streams(up(), NS, "python", 8080),
        python_client_streams(lower, "direct", "python", 8080),
    );
    let (via_node, direct) = (via_node.unwrap(), direct.unwrap());
    eprintln!("through the virtual node: {via_node:#}\nbelow: {direct:#}");
    for (at, seen, ns) in [("virtual node", &via_node, NS), ("lower", &direct, "direct")] {
        let runs = seen["exec"].as_array().unwrap();
        let run = |i: usize| &runs[i];
        assert_eq!(
            (&run(0)["stdout"], &run(0)["stderr"], &run(0)["code"]),
            (&"hi\n".into(), &"".into(), &0.into()),
            "{at}: echo hi: {seen:#}"
        );
        let env = run(1)["stdout"].as_str().unwrap_or_default();
        assert!(
            env.contains("GREETING=hello-from-below\n") && env.contains("HOSTNAME=python\n"),
            "{at}: env: {seen:#}"
        );
        assert_eq!(run(2)["code"], 3, "{at}: exit 3: {seen:#}");
        assert_eq!(run(3)["code"], 127, "{at}: ls: {seen:#}");
        assert!(
            run(3)["stderr"]
                .as_str()
                .is_some_and(|e| e.contains("\"ls\": executable file not found")),
            "{at}: ls: {seen:#}"
        );
        assert_eq!(
            (&run(4)["stdout"], &run(4)["code"]),
            (&"line one\nline two\n".into(), &0.into()),
            "{at}: cat with stdin: {seen:#}"
        );
        let forward = &seen["forward"];
        assert_eq!(
            (&forward["status"], &forward["body"]),
            (
                &"HTTP/1.1 200 OK".into(),
                &format!("{ns}/python port 8080\n").into()
            ),
            "{at}: GET through port-forward: {seen:#}"
        );
    }
    // Everything else is the same, byte for byte.
    assert_eq!(via_node["exec"], direct["exec"]);
    assert_eq!(via_node["forward"]["error"], direct["forward"]["error"]);
}

#[tokio::test]
async fn a_lower_apiserver_killed_mid_session_ends_it_and_leaks_nothing() {
    let bed = bed();
    // A lower cluster of its own: its apiserver is killed.
    let [lower] = scene::clusters("exec", ["lower-kill"]).await.unwrap();
    let _sim = scene::simulate(&lower, scene::nodes("kill", 1)).await.unwrap();
    let node = scene::virtual_node(&bed.upper, "vn-kill", &lower, |_| {}).unwrap();
    running_pod(up(), NS, "doomed", "vn-kill").await;
    for via in [Via::WebSocket, Via::Spdy] {
        let mut cmd = kubectl_command(up(), via, &["-n", NS, "exec", "-i", "doomed", "--", "cat"]);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        stdin.write_all(b"before\n").await.unwrap();
        let mut buf = [0u8; 7];
        tokio::time::timeout(Duration::from_secs(30), stdout.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"before\n", "{via:?}: the session works");
        assert_eq!(metric(&node.admin_addr, OPEN_EXEC).await, 1.0, "{via:?}");

        lower.stop_apiserver();
        let ended = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        let status = ended
            .unwrap_or_else(|_| panic!("{via:?}: kubectl still runs 30 s after the kill"))
            .unwrap();
        // Over WebSocket kubectl sees the abnormal close and fails. Over SPDY the error stream
        // just ends without a status, which kubectl takes for a clean end: it does the same
        // when a local pod's kubelet goes away, and no byte-transparent splice can change it.
        if matches!(via, Via::WebSocket) {
            assert!(!status.success(), "{via:?}: the session ends with an error");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&node.admin_addr, OPEN_EXEC).await != 0.0 {
            assert!(
                Instant::now() < deadline,
                "{via:?}: the spliced session is released"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drop(stdin);
        lower.start_apiserver().await.unwrap();
        // The lower cluster is back: a new session works.
        let again = tensile_e2e::wait::must(
            "exec after the restart",
            Duration::from_secs(60),
            Duration::from_secs(1),
            || async {
                let r = exec(via, "doomed", &["echo", "back"], None).await;
                if r.code == 0 && r.out() == "back\n" {
                    Ok(())
                } else {
                    Err(r.stderr)
                }
            },
        );
        again.await;
    }
    let refused = metric(
        &node.admin_addr,
        r#"tensile_virtual_node_stream_sessions_started_total{kind="exec"} "#,
    )
    .await;
    assert!(refused >= 3.0, "sessions are counted: {refused}");
}

#[tokio::test]
async fn node_and_pod_usage_of_the_lower_cluster_reach_the_upper_node_proxy() {
    use tensile_e2e::simulator::stats::{CONTAINER_BYTES, CONTAINER_NANO_CORES, NODE_BYTES};
    bed();
    running_pod(up(), NS, "metered", NODE).await;
    let base = format!("/api/v1/nodes/{NODE}/proxy");
    let mine = r#"container_memory_working_set_bytes{container="app",namespace="streams",pod="metered"} "#;
    // The lower nodes' answers are reused for 5 s (another test's scrapes may have just read
    // them, before this pod ran): the pod shows once that window has passed.
    let resource = format!("{base}/metrics/resource");
    let metrics = tensile_e2e::wait::within("the metered pod in /metrics/resource", 15, || async {
        let metrics = tensile_e2e::check::kubectl(up(), &["get", "--raw", &resource]).await;
        if metrics.contains(mine) {
            Ok(metrics)
        } else {
            Err(metrics)
        }
    })
    .await;
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{prefix} in {metrics}"))
    };
    assert_eq!(value(mine), CONTAINER_BYTES as f64, "{metrics}");
    assert!(value(r#"pod_cpu_usage_seconds_total{namespace="streams",pod="metered"} "#) > 0.0);
    // The node is the lower cluster: its two nodes and every container running on them
    // (all of them this virtual node's).
    let containers = metrics
        .lines()
        .filter(|l| l.starts_with("container_memory_working_set_bytes{"))
        .count() as f64;
    assert_eq!(
        value("node_memory_working_set_bytes "),
        2.0 * NODE_BYTES as f64 + containers * CONTAINER_BYTES as f64,
        "{metrics}"
    );
    let summary =
        tensile_e2e::check::kubectl(up(), &["get", "--raw", &format!("{base}/stats/summary")]).await;
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["node"]["nodeName"], NODE);
    let uid = tensile_e2e::check::kubectl(
        up(),
        &[
            "-n",
            NS,
            "get",
            "pod",
            "metered",
            "-o",
            "jsonpath={.metadata.uid}",
        ],
    )
    .await;
    let pod = summary["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["podRef"]["name"] == "metered")
        .unwrap_or_else(|| panic!("metered in {summary}"));
    assert_eq!(pod["podRef"]["uid"], uid.as_str(), "the upper UID");
    assert_eq!(pod["cpu"]["usageNanoCores"], CONTAINER_NANO_CORES);
    assert_eq!(pod["memory"]["workingSetBytes"], CONTAINER_BYTES);
}

/// Spliced sessions are bounded as a kubelet bounds them: one silent for the idle timeout is
/// closed, one past the cap is refused saying why, and every one ends when the virtual node
/// stops (a deposed or stopped replica keeps no session open).
#[tokio::test]
async fn stream_sessions_close_when_idle_are_capped_and_end_with_the_node() {
    let bed = bed();
    let node = scene::virtual_node(&bed.upper, "vn-limits", &bed.lower, |args| {
        args.kubelet.stream_idle_timeout_seconds = 3;
        args.kubelet.max_stream_sessions = 1;
    })
    .unwrap();
    running_pod(up(), NS, "limited", "vn-limits").await;

    // SPDY: kubectl's WebSocket client pings every 5 s, which is traffic, at a kubelet too.
    let mut idle = Cat::start(up(), Via::Spdy, NS, "limited").await.unwrap();
    let silent = Instant::now();
    assert!(
        idle.ended_within(Duration::from_secs(20)).await.is_some(),
        "a silent session is closed"
    );
    assert!(
        silent.elapsed() >= Duration::from_secs(2),
        "not before the idle timeout"
    );
    drop(idle);

    // One session talks the whole time, so it never idles out.
    let busy = Cat::start(up(), Via::Spdy, NS, "limited").await.unwrap();
    let (stop_talking, mut stop) = tokio::sync::oneshot::channel::<()>();
    let talker = tokio::spawn(async move {
        let mut busy = busy;
        loop {
            busy.round_trip(b"still here\n", Duration::from_secs(10))
                .await
                .unwrap();
            tokio::select! {
                _ = &mut stop => return busy,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
        }
    });
    let refused = exec(Via::Spdy, "limited", &["echo", "hi"], None).await;
    assert!(
        refused.code != 0 && refused.stderr.contains("--kubelet-max-stream-sessions"),
        "a session past the cap is refused: {} {}",
        refused.out(),
        refused.stderr
    );
    stop_talking.send(()).unwrap();
    let mut busy = talker.await.unwrap();

    drop(node);
    assert!(
        busy.ended_within(Duration::from_secs(15)).await.is_some(),
        "the session ends with the virtual node"
    );
}

/// A storm of usage scrapes costs the lower cluster one fan-out per few seconds, never one
/// request per lower node per scrape: 20 scrapes at once of a virtual node over two lower
/// nodes ask the lower kubelets a handful of times, not 40.
#[tokio::test]
async fn a_storm_of_usage_scrapes_asks_the_lower_nodes_once_per_window() {
    let bed = bed();
    running_pod(up(), NS, "scraped", NODE).await;
    let path = format!("/api/v1/nodes/{NODE}/proxy/stats/summary");
    let before = bed.sim.summaries_served();
    let args = ["get", "--raw", path.as_str()];
    let scrapes = (0..20).map(|_| tensile_e2e::kubectl::run(up(), &args));
    let answers = futures::future::join_all(scrapes).await;
    let served = bed.sim.summaries_served() - before;
    for answer in &answers {
        assert!(answer.ok && answer.stdout.contains(NODE), "{}", answer.stderr);
    }
    // Two nodes per fan-out; a fan-out answers the scrapes of 5 s. Another test of this bed
    // may scrape meanwhile: a few fan-outs at most, against 40 requests for 20 scrapes.
    assert!(served <= 12, "20 scrapes asked the lower kubelets {served} times");
}
