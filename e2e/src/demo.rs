//! The demo: the whole suite on this machine, as `make demo` runs it and its end-to-end test
//! checks it.
//!
//! [`Demo::start`] starts an upper cluster and two lower clusters with simulated nodes of
//! different sizes (a [`Testbed`]), registers the webhook in the upper cluster and runs it,
//! runs one `virtual-node` per lower cluster and the `descheduler`, applies the sample
//! workload with kubectl and waits until every replica is Running. The webhook, the virtual
//! nodes and the descheduler are their real binaries, run as child processes that die with
//! the demo.
//!
//! With [`DemoOptions::multi_scheduler`], the `multi-scheduler` extender runs too, behind a
//! second kube-scheduler started from the shipped KubeSchedulerConfiguration, and the webhook
//! hands opted-in pods to it (`--scheduler-name`): a pod no lower node can hold is never
//! bound to that lower cluster's virtual node in the first place.
//!
//! A running demo listens on a Unix socket in its directory ([`CONTROL_SOCKET`]); `demo stop
//! lower-a` and `demo start lower-a` ([`send_command`]) stop and restart a lower cluster's
//! apiserver through it, so its virtual node can be watched going NotReady and back.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use tensile_common::names;

use crate::multi_scheduler::{CONFIG_V1, ExtenderProcess, scheduler_config};
use crate::process::Service;
use crate::testbed::{ClusterSpec, Testbed};
use crate::{Error, Result, free_port, io_err};

/// The upper cluster's name; the lower clusters are named by their specs.
pub const UPPER: &str = "upper";
/// Namespace and Deployment of the sample workload (`examples/demo.yaml`).
pub const NAMESPACE: &str = "demo";
pub const DEPLOYMENT: &str = "web";
/// The demo's control socket, in its directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Name of the webhook's MutatingWebhookConfiguration.
pub const WEBHOOK_CONFIG: &str = "tensile-webhook";

/// How to start a [`Demo`].
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Kubeconfigs, certificates, logs and the control socket go here.
    pub dir: PathBuf,
    /// The workload applied to the upper cluster.
    pub manifest: PathBuf,
    /// Lower clusters, each with its simulated nodes and its virtual node of the same name.
    pub lowers: Vec<ClusterSpec>,
    /// How long opted-in pods tolerate a NotReady or unreachable virtual node before they are
    /// replaced elsewhere (the webhook's `--not-ready-toleration-seconds`).
    pub toleration_seconds: u32,
    /// The command that reaches this demo's control socket, as printed in the hints
    /// (`demo --dir DIR`).
    pub control_command: String,
    /// How long the workload may take to run.
    pub workload_timeout: Duration,
    /// Opted-in pods are placed by a second kube-scheduler with the multi-scheduler's
    /// extender, which only picks virtual nodes whose lower cluster has a node that fits.
    pub multi_scheduler: bool,
}

impl DemoOptions {
    /// The demo's defaults: lower-a with three 4-CPU/8Gi nodes, lower-b with two 8-CPU/16Gi
    /// nodes, the workload in `examples/demo.yaml`.
    pub fn new(dir: &Path) -> Self {
        let spec = |name: &str, nodes: u32, cpu: &str, memory: &str| ClusterSpec {
            name: name.to_owned(),
            nodes,
            cpu: cpu.to_owned(),
            memory: memory.to_owned(),
            pods: "110".to_owned(),
            version: None,
        };
        Self {
            dir: dir.to_owned(),
            manifest: default_manifest(),
            lowers: vec![spec("lower-a", 3, "4", "8Gi"), spec("lower-b", 2, "8", "16Gi")],
            toleration_seconds: 30,
            control_command: "demo".to_owned(),
            workload_timeout: Duration::from_secs(180),
            multi_scheduler: false,
        }
    }
}

/// `examples/demo.yaml` of this repository.
pub fn default_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo.yaml")
}

/// `examples/demo-move.yaml`: a pod only lower-b can place, which the descheduler moves.
pub fn move_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo-move.yaml")
}

/// Seconds the demo's descheduler waits after a lower refusal before moving the pod.
pub const DESCHEDULE_AFTER: u64 = 10;

/// A daemon of the suite run by the demo.
struct Daemon {
    service: Service,
    admin: String,
}

/// A running demo. Dropping it stops every process it started: the daemons first, then the
/// simulators and the clusters.
pub struct Demo {
    webhook: Daemon,
    virtual_nodes: Vec<(String, Daemon)>,
    descheduler: Daemon,
    /// The multi-scheduler's extender and the kube-scheduler that asks it, when switched on.
    multi_scheduler: Option<(Daemon, Service)>,
    control: UnixListener,
    testbed: Testbed,
    options: DemoOptions,
    dir: PathBuf,
    took: Duration,
}

fn demo_err(message: impl Into<String>) -> Error {
    Error::Demo(message.into())
}

impl Demo {
    /// Starts everything and returns once the workload runs; `progress` hears each step.
    pub async fn start(options: DemoOptions, progress: &dyn Fn(&str)) -> Result<Demo> {
        let started = Instant::now();
        let virtual_node_bin = crate::bins::suite_binary("virtual-node")?;
        let webhook_bin = crate::bins::suite_binary("webhook")?;
        let descheduler_bin = crate::bins::suite_binary("descheduler")?;
        let mut bins = vec![
            virtual_node_bin.clone(),
            webhook_bin.clone(),
            descheduler_bin.clone(),
        ];
        if options.multi_scheduler {
            bins.push(crate::bins::suite_binary("multi-scheduler")?);
        }
        for bin in &bins {
            if let Some(newer) = newer_source(bin) {
                progress(&format!(
                    "warning: {} is older than {}; rebuild it to run the current code",
                    bin.display(),
                    newer.display()
                ));
            }
        }
        if !options.manifest.is_file() {
            return Err(demo_err(format!("no workload at {}", options.manifest.display())));
        }
        std::fs::create_dir_all(&options.dir).map_err(io_err(&options.dir))?;
        let dir = options.dir.canonicalize().map_err(io_err(&options.dir))?;
        let control = bind_control(&dir, &options.control_command).await?;

        let mut specs = vec![ClusterSpec::parse(UPPER).map_err(demo_err)?];
        specs.extend(options.lowers.iter().cloned());
        progress(&format!(
            "starting {} clusters (etcd, then kube-apiserver, kube-scheduler and kube-controller-manager for each; \
             about 20-40 s on 2 cores)",
            specs.len()
        ));
        let testbed = Testbed::up(&dir, &specs).await?;
        let upper = testbed
            .clusters()
            .find(|c| c.name() == UPPER)
            .ok_or_else(|| demo_err("the upper cluster is missing"))?;
        progress(&format!(
            "clusters ready after {} s (Kubernetes {})",
            started.elapsed().as_secs(),
            upper.version()
        ));

        let logs = dir.join("logs");
        let upper_kc = testbed.kubeconfig(UPPER);

        // The kind of the descheduler's exclusion records, as the chart installs it.
        crate::chart::install_exclusion_records(&upper_kc).await?;
        // The registration first: the webhook writes its generated CA into it.
        let port = free_port()?;
        let registration = dir.join("webhook.yaml");
        std::fs::write(&registration, webhook_registration(port)).map_err(io_err(&registration))?;
        kubectl_ok(&upper_kc, &["apply", "-f", &registration.display().to_string()]).await?;
        let admin = format!("127.0.0.1:{}", free_port()?);
        let secs = options.toleration_seconds.to_string();
        let mut args = vec![
            "--address=127.0.0.1".to_owned(),
            format!("--port={port}"),
            format!("--admin-addr={admin}"),
            format!("--kubeconfig={}", upper_kc.display()),
            format!("--webhook-config-name={WEBHOOK_CONFIG}"),
            "--self-signed-names=127.0.0.1".to_owned(),
            format!("--not-ready-toleration-seconds={secs}"),
            format!("--unreachable-toleration-seconds={secs}"),
        ];
        if options.multi_scheduler {
            args.push(format!("--scheduler-name={}", names::MULTI_SCHEDULER));
        }
        let mut webhook = Daemon {
            service: start_daemon("webhook", &webhook_bin, &args, &logs.join("webhook.log"))?,
            admin,
        };
        wait_admin_ready(&mut webhook, "the webhook (its caBundle written)").await?;
        progress(&format!(
            "webhook serving on 127.0.0.1:{port}, registered as MutatingWebhookConfiguration {WEBHOOK_CONFIG}"
        ));

        let upper_client = upper.client().await?;
        let mut virtual_nodes = Vec::new();
        for lower in &options.lowers {
            let name = lower.name.clone();
            let admin = format!("127.0.0.1:{}", free_port()?);
            let args = [
                format!("--kubeconfig={}", upper_kc.display()),
                format!("--client-kubeconfig={}", testbed.kubeconfig(&name).display()),
                format!("--nodename={name}"),
                format!("--node-ip={}", crate::node_ip()?),
                format!("--kubelet-port={}", free_port()?),
                format!("--admin-addr={admin}"),
                format!(
                    "--client-verify-ca={}",
                    dir.join(format!("{UPPER}.kubelet-client-ca.crt")).display()
                ),
            ];
            let log = logs.join(format!("virtual-node-{name}.log"));
            let service = start_daemon("virtual-node", &virtual_node_bin, &args, &log)?;
            virtual_nodes.push((name, Daemon { service, admin }));
        }
        for (name, daemon) in &mut virtual_nodes {
            wait_node_ready(&upper_client, name, daemon).await?;
            progress(&format!("virtual node {name} Ready in the upper cluster"));
        }

        let admin = format!("127.0.0.1:{}", free_port()?);
        let args = [
            format!("--kubeconfig={}", upper_kc.display()),
            format!("--admin-addr={admin}"),
            format!("--unschedulable-threshold={DESCHEDULE_AFTER}"),
            "--descheduling-interval=10s".to_owned(),
        ];
        let log = logs.join("descheduler.log");
        let mut descheduler = Daemon {
            service: start_daemon("descheduler", &descheduler_bin, &args, &log)?,
            admin,
        };
        wait_admin_ready(&mut descheduler, "the descheduler").await?;
        progress("descheduler running");

        let multi_scheduler = if options.multi_scheduler {
            let extender = ExtenderProcess::start(upper, &[], "demo").map_err(|e| demo_err(e.to_string()))?;
            let config = scheduler_config(CONFIG_V1, &upper_kc, &extender.url, &extender.ca_file)
                .map_err(|e| demo_err(e.to_string()))?;
            let config_path = dir.join("tensile-scheduler.yaml");
            std::fs::write(&config_path, config).map_err(io_err(&config_path))?;
            let mut extender = Daemon {
                service: extender.service,
                admin: extender.admin_addr,
            };
            wait_admin_ready(&mut extender, "the multi-scheduler's extender").await?;
            let scheduler = upper.start_scheduler(&config_path, names::MULTI_SCHEDULER)?;
            progress(&format!(
                "multi-scheduler extender running behind kube-scheduler {} ({})",
                names::MULTI_SCHEDULER,
                shown(&config_path)
            ));
            Some((extender, scheduler))
        } else {
            None
        };

        progress(&format!("applying {}", shown(&options.manifest)));
        kubectl_ok(
            &upper_kc,
            &["apply", "-f", &options.manifest.display().to_string()],
        )
        .await?;
        let mut demo = Demo {
            webhook,
            virtual_nodes,
            descheduler,
            multi_scheduler,
            control,
            testbed,
            options,
            dir,
            took: Duration::ZERO,
        };
        demo.wait_workload(&upper_client, progress).await?;
        demo.took = started.elapsed();
        Ok(demo)
    }

    async fn wait_workload(&mut self, upper: &kube::Client, progress: &dyn Fn(&str)) -> Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(upper.clone(), NAMESPACE);
        let pods: Api<Pod> = Api::namespaced(upper.clone(), NAMESPACE);
        let deadline = Instant::now() + self.options.workload_timeout;
        let mut reported = None;
        loop {
            let want = deployments
                .get_opt(DEPLOYMENT)
                .await?
                .and_then(|d| d.spec.replicas)
                .unwrap_or(1);
            let list = pods
                .list(&ListParams::default().labels(&format!("app={DEPLOYMENT}")))
                .await?;
            let running = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            if reported != Some(running) {
                progress(&format!(
                    "Deployment {NAMESPACE}/{DEPLOYMENT}: {running}/{want} pods Running"
                ));
                reported = Some(running);
            }
            if i32::try_from(running).unwrap_or(i32::MAX) >= want {
                return Ok(());
            }
            if let Some(failure) = self.failed_daemon() {
                return Err(demo_err(failure));
            }
            if Instant::now() > deadline {
                let describe = crate::kubectl::run(
                    &self.kubeconfig(UPPER),
                    &["-n", NAMESPACE, "get", "pods", "-o", "wide"],
                )
                .await;
                return Err(Error::Timeout {
                    what: format!(
                        "{want} pods of {NAMESPACE}/{DEPLOYMENT} Running; the pods:\n{}{}",
                        describe.stdout, describe.stderr
                    ),
                    secs: self.options.workload_timeout.as_secs(),
                });
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A daemon that exited, with its log tail.
    fn failed_daemon(&mut self) -> Option<String> {
        exited(&mut self.webhook.service)
            .or_else(|| exited(&mut self.descheduler.service))
            .or_else(|| {
                let (extender, scheduler) = self.multi_scheduler.as_mut()?;
                exited(&mut extender.service).or_else(|| exited(scheduler))
            })
            .or_else(|| {
                self.virtual_nodes
                    .iter_mut()
                    .find_map(|(_, d)| exited(&mut d.service))
            })
    }

    /// The demo's directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kubeconfig of cluster `name`.
    pub fn kubeconfig(&self, name: &str) -> PathBuf {
        self.testbed.kubeconfig(name)
    }

    /// The lower clusters' names, which are also their virtual nodes' names.
    pub fn lower_names(&self) -> Vec<String> {
        self.options.lowers.iter().map(|l| l.name.clone()).collect()
    }

    /// How long start-up took, up to the workload running.
    pub fn took(&self) -> Duration {
        self.took
    }

    /// Every process the demo started except the shared etcd.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.webhook.service.pid().into_iter().collect();
        pids.extend(self.virtual_nodes.iter().filter_map(|(_, d)| d.service.pid()));
        pids.extend(self.descheduler.service.pid());
        if let Some((extender, scheduler)) = &self.multi_scheduler {
            pids.extend(extender.service.pid());
            pids.extend(scheduler.pid());
        }
        for cluster in self.testbed.clusters() {
            pids.extend(cluster.pids());
        }
        pids
    }

    /// The commands to try, grouped under a line saying what they show.
    pub fn hints(&self) -> Vec<(String, Vec<String>)> {
        // Each cluster's own kubectl: the bed's clusters run different versions, and kubectl
        // keeps to one minor of skew from its apiserver.
        let kubectl = |cluster: &str| {
            let kubeconfig = self.kubeconfig(cluster);
            format!(
                "{} --kubeconfig {}",
                shown(&crate::kubectl::binary_for(&kubeconfig)),
                shown(&kubeconfig)
            )
        };
        let up = kubectl(UPPER);
        let lowers = self.lower_names();
        let first = lowers.first().cloned().unwrap_or_default();
        let others = lowers.iter().skip(1).cloned().collect::<Vec<_>>().join(", ");
        let last = lowers.last().cloned().unwrap_or_default();
        let ctl = &self.options.control_command;
        let secs = self.options.toleration_seconds;
        let mut below = vec![format!("{up} -n {NAMESPACE} get pods -o wide")];
        below.extend(
            lowers
                .iter()
                .map(|l| format!("{} -n {NAMESPACE} get pods -o wide", kubectl(l))),
        );
        vec![
            (
                "The virtual nodes: one per lower cluster, its capacity the sum of that cluster's nodes"
                    .into(),
                vec![
                    format!("{up} get nodes -o wide"),
                    format!(
                        "{up} get nodes -o custom-columns=NODE:.metadata.name,CPU:.status.capacity.cpu,MEMORY:.status.capacity.memory,PODS:.status.capacity.pods"
                    ),
                ],
            ),
            (
                "The pods above, on virtual nodes, and the same pods below, on the lower clusters' nodes"
                    .into(),
                below,
            ),
            (
                "What the webhook stashed for the lower cluster (clusterSelector)".into(),
                vec![format!(
                    r#"{up} -n {NAMESPACE} get pods -o jsonpath='{{range .items[*]}}{{.metadata.name}}{{"\t"}}{{.metadata.annotations.clusterSelector}}{{"\n"}}{{end}}'"#
                )],
            ),
            (
                "Logs: upper apiserver -> virtual node -> lower apiserver -> simulated kubelet".into(),
                vec![format!("{up} -n {NAMESPACE} logs deploy/{DEPLOYMENT} --tail 3")],
            ),
            (
                "Scale the Deployment; the new pods run below too".into(),
                vec![
                    format!("{up} -n {NAMESPACE} scale deploy/{DEPLOYMENT} --replicas 6"),
                    format!("{up} -n {NAMESPACE} get pods -o wide"),
                ],
            ),
            if self.multi_scheduler.is_some() {
                (
                    format!(
                        "A pod only {last} can place: {first} has enough CPUs in all but none on one node, so the \
                         multi-scheduler's filter rules it out and the pod goes straight to {last}, never refused \
                         below (the scheduler's events say why {first} was passed over)"
                    ),
                    vec![
                        format!("{up} apply -f {}", shown(&move_manifest())),
                        format!("{up} -n {NAMESPACE} get pods -l app=big -o wide -w"),
                        format!(
                            "{up} -n {NAMESPACE} get pods -l app=big -o jsonpath='{{.items[*].spec.schedulerName}}'"
                        ),
                    ],
                )
            } else {
                (
                    format!(
                        "A pod only {last} can place: the upper scheduler puts it on {first} (enough CPUs in all, \
                         none on one node), {first} refuses it, and {DESCHEDULE_AFTER} s later the descheduler moves it \
                         (a Descheduled event says why)"
                    ),
                    vec![
                        format!("{up} apply -f {}", shown(&move_manifest())),
                        format!("{up} -n {NAMESPACE} get pods -l app=big -o wide -w"),
                        format!("{up} -n {NAMESPACE} get events --field-selector reason=Descheduled -w"),
                    ],
                )
            },
            (
                format!(
                    "Stop {first}'s apiserver: its node goes NotReady (about 15 s), {secs} s later its pods move \
                     to {others}; then start it again"
                ),
                vec![
                    format!("{ctl} stop {first}"),
                    format!("{up} get nodes -w"),
                    format!("{up} -n {NAMESPACE} get pods -o wide -w"),
                    format!("{ctl} start {first}"),
                ],
            ),
        ]
    }

    /// What the demo did and what to try next, as printed when it is ready.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "\ntensile demo ready after {} s: {} virtual nodes, the webhook and Deployment {NAMESPACE}/{DEPLOYMENT} \
             running below.\n\n",
            self.took.as_secs(),
            self.options.lowers.len()
        );
        out.push_str("Clusters (kubeconfigs):\n");
        out.push_str(&format!(
            "  {:<9} {}  (virtual nodes {})\n",
            UPPER,
            shown(&self.kubeconfig(UPPER)),
            self.lower_names().join(", ")
        ));
        for l in &self.options.lowers {
            out.push_str(&format!(
                "  {:<9} {}  ({} simulated nodes, {} CPU / {} each)\n",
                l.name,
                shown(&self.kubeconfig(&l.name)),
                l.nodes,
                l.cpu,
                l.memory
            ));
        }
        out.push_str("Processes (logs):\n");
        let mut daemon = |what: String, d: &Daemon| {
            out.push_str(&format!(
                "  {what:<22} pid {:<8} admin http://{}/metrics  {}\n",
                d.service.pid().unwrap_or(0),
                d.admin,
                shown(d.service.log_path())
            ));
        };
        daemon("webhook".into(), &self.webhook);
        for (name, d) in &self.virtual_nodes {
            daemon(format!("virtual-node {name}"), d);
        }
        daemon("descheduler".into(), &self.descheduler);
        if let Some((extender, scheduler)) = &self.multi_scheduler {
            daemon("multi-scheduler".into(), extender);
            out.push_str(&format!(
                "  {:<22} pid {:<8} {}\n",
                format!("kube-scheduler {}", names::MULTI_SCHEDULER),
                scheduler.pid().unwrap_or(0),
                shown(scheduler.log_path())
            ));
        }
        out.push_str(&format!(
            "  control planes         {}\n",
            shown(&self.dir.join("logs"))
        ));
        out.push_str(&format!(
            "Workload: {}; webhook registration: {}\n\nTry, from another terminal in this directory:\n",
            shown(&self.options.manifest),
            shown(&self.dir.join("webhook.yaml"))
        ));
        for (what, commands) in self.hints() {
            out.push_str(&format!("\n  # {what}\n"));
            for c in commands {
                out.push_str(&format!("  {c}\n"));
            }
        }
        out.push_str("\nCtrl-C here stops everything.\n");
        out
    }

    /// Serves the control socket until the future is dropped; `report` hears every command
    /// and its outcome.
    pub async fn serve_control(&self, report: &dyn Fn(&str)) {
        loop {
            let Ok((stream, _)) = self.control.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            let read = BufReader::new(read.take(1024)).read_line(&mut line).await;
            let reply = match read {
                Ok(_) => {
                    report(&format!("control: {}", line.trim()));
                    match self.command(line.trim()).await {
                        Ok(text) => text,
                        Err(e) => format!("error: {e}"),
                    }
                }
                Err(e) => format!("error: reading the command: {e}"),
            };
            report(&reply);
            let _ = write.write_all(format!("{reply}\n").as_bytes()).await;
            let _ = write.shutdown().await;
        }
    }

    /// Runs one control command: `stop NAME` or `start NAME` for a lower cluster.
    pub async fn command(&self, line: &str) -> Result<String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let lowers = self.lower_names();
        let usage = || format!("usage: stop|start <{}>", lowers.join("|"));
        let (verb, name) = match words.as_slice() {
            [verb @ ("stop" | "start"), name] => (*verb, *name),
            _ => return Err(demo_err(format!("unknown command {line:?}; {}", usage()))),
        };
        if !lowers.iter().any(|l| l == name) {
            return Err(demo_err(format!(
                "{name:?} is not a lower cluster of this demo; {}",
                usage()
            )));
        }
        let cluster = self
            .testbed
            .clusters()
            .find(|c| c.name() == name)
            .ok_or_else(|| demo_err(format!("no cluster {name}")))?;
        if verb == "stop" {
            cluster.stop_apiserver();
            Ok(format!(
                "{name}: kube-apiserver stopped. The virtual node {name} turns NotReady within about 15 s; \
                 {} s later its pods are evicted and replaced on another virtual node. The evicted pods stay \
                 Terminating until {name} is back: nothing can confirm that they stopped there.",
                self.options.toleration_seconds
            ))
        } else {
            cluster.start_apiserver().await?;
            Ok(format!(
                "{name}: kube-apiserver running again. The virtual node {name} turns Ready within about 10 s; \
                 pods evicted meanwhile are deleted below, then upstream, within a minute or two."
            ))
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        // The fields go next, daemons first; the socket file would only mislead.
        let _ = std::fs::remove_file(self.dir.join(CONTROL_SOCKET));
    }
}

/// Sends one control command to the demo running in `dir` and returns its reply; a reply
/// that starts with `error:` is an error.
pub async fn send_command(dir: &Path, command: &str) -> Result<String> {
    let path = dir.join(CONTROL_SOCKET);
    let mut stream = UnixStream::connect(&path).await.map_err(|e| {
        demo_err(format!(
            "no demo answers at {} ({e}); is `make demo` running with this directory?",
            path.display()
        ))
    })?;
    stream
        .write_all(format!("{command}\n").as_bytes())
        .await
        .map_err(io_err(&path))?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.map_err(io_err(&path))?;
    let reply = reply.trim().to_owned();
    match reply.strip_prefix("error: ") {
        Some(e) => Err(demo_err(e)),
        None if reply.is_empty() => Err(demo_err("the demo closed the connection without a reply")),
        None => Ok(reply),
    }
}

/// Binds the control socket; a live one means another demo uses this directory.
async fn bind_control(dir: &Path, control_command: &str) -> Result<UnixListener> {
    let path = dir.join(CONTROL_SOCKET);
    if UnixStream::connect(&path).await.is_ok() {
        return Err(demo_err(format!(
            "a demo is already running with {} (stop it with Ctrl-C, or try `{control_command} stop`)",
            dir.display()
        )));
    }
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
        _ => {}
    }
    UnixListener::bind(&path).map_err(io_err(&path))
}

/// The registration an operator would write for a webhook on `127.0.0.1:port`: only opted-in
/// pods, `failurePolicy: Fail`, every namespace but those labelled
/// `tensile.io/webhook=disabled`. The webhook fills in the `caBundle`.
pub fn webhook_registration(port: u16) -> String {
    crate::check::webhook_registration(
        WEBHOOK_CONFIG,
        port,
        crate::check::Namespaces::AllButDisabled,
        None,
    )
}

fn start_daemon(name: &str, program: &Path, args: &[String], log: &Path) -> Result<Service> {
    // A fresh log per run: Service appends.
    match std::fs::remove_file(log) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(log)(e)),
        _ => {}
    }
    Ok(Service::start(name, program, args, log)?)
}

/// `Some(message with the log tail)` when the daemon has exited.
fn exited(service: &mut Service) -> Option<String> {
    let status = service.exited()?;
    Some(format!(
        "{} exited ({status}); the end of {}:\n{}",
        service.name(),
        service.log_path().display(),
        service.log_tail(3000)
    ))
}

async fn wait_admin_ready(daemon: &mut Daemon, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(failure) = exited(&mut daemon.service) {
            return Err(demo_err(failure));
        }
        // `ok`, or `ok: <why>` from a daemon that says what it is ready for.
        if http_get(&daemon.admin, "/readyz")
            .await
            .is_ok_and(|b| b == "ok" || b.starts_with("ok: "))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(demo_err(format!(
                "{what} not ready after 60 s; the end of {}:\n{}",
                daemon.service.log_path().display(),
                daemon.service.log_tail(3000)
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_node_ready(upper: &kube::Client, name: &str, daemon: &mut Daemon) -> Result<()> {
    let nodes: Api<Node> = Api::all(upper.clone());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(failure) = exited(&mut daemon.service) {
            return Err(demo_err(failure));
        }
        let ready = nodes.get_opt(name).await?.is_some_and(|n| {
            n.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        });
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(demo_err(format!(
                "virtual node {name} not Ready after 90 s; the end of {}:\n{}",
                daemon.service.log_path().display(),
                daemon.service.log_tail(3000)
            )));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A plain-HTTP GET on the loopback admin port; the body when the status is 200.
async fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if head.split_whitespace().nth(1) == Some("200") {
        Ok(body.trim().to_owned())
    } else {
        Err(std::io::Error::other(
            head.lines().next().unwrap_or("").to_owned(),
        ))
    }
}

async fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = crate::kubectl::run(kubeconfig, args).await;
    if out.ok {
        Ok(out.stdout)
    } else {
        Err(demo_err(format!(
            "kubectl {}: {}",
            args.join(" "),
            out.stderr.trim()
        )))
    }
}

/// `path` relative to the current directory when it lies below it, as a user would type it.
pub fn shown(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_owned());
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A source file of the suite's daemons newer than `binary` (so the binary is stale).
fn newer_source(binary: &Path) -> Option<PathBuf> {
    let built = binary.metadata().and_then(|m| m.modified()).ok()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut stack: Vec<PathBuf> = [
        "common/src",
        "virtual-node/src",
        "webhook/src",
        "descheduler/src",
        "multi-scheduler/src",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t > built)
            {
                return Some(path);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registration_is_valid_yaml_for_opted_in_pods() {
        let doc: serde_json::Value = serde_yaml::from_str(&webhook_registration(8443)).unwrap();
        let hook = &doc["webhooks"][0];
        assert_eq!(hook["clientConfig"]["url"], "https://127.0.0.1:8443/mutate");
        assert_eq!(hook["objectSelector"]["matchLabels"]["virtual-pod"], "true");
        assert_eq!(hook["failurePolicy"], "Fail");
        assert_eq!(doc["metadata"]["name"], WEBHOOK_CONFIG);
    }

    #[test]
    fn the_workload_is_an_opted_in_deployment_with_its_config_and_secret() {
        let text = std::fs::read_to_string(default_manifest()).unwrap();
        let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect();
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        assert_eq!(kinds, ["Namespace", "ConfigMap", "Secret", "Deployment"]);
        let deployment = &docs[3];
        assert_eq!(deployment["metadata"]["name"], DEPLOYMENT);
        assert_eq!(deployment["metadata"]["namespace"], NAMESPACE);
        assert_eq!(
            deployment["spec"]["template"]["metadata"]["labels"]["virtual-pod"],
            "true"
        );
    }

    #[test]
    fn the_move_workload_asks_more_than_a_lower_a_node_has_and_prefers_lower_a() {
        let text = std::fs::read_to_string(move_manifest()).unwrap();
        let doc: serde_json::Value = serde_yaml::from_str(&text).unwrap();
        let spec = &doc["spec"]["template"]["spec"];
        assert_eq!(spec["containers"][0]["resources"]["requests"]["cpu"], "6");
        let pref = &spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
        assert_eq!(pref["preference"]["matchExpressions"][0]["values"][0], "lower-a");
        assert_eq!(
            doc["spec"]["template"]["metadata"]["labels"]["virtual-pod"],
            "true"
        );
        assert_eq!(doc["metadata"]["namespace"], NAMESPACE);
    }

    #[tokio::test]
    async fn a_control_command_without_a_demo_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let err = send_command(dir.path(), "stop lower-a").await.unwrap_err();
        assert!(err.to_string().contains("no demo answers"), "{err}");
    }
}
