//! `demo [--dir DIR] up | stop LOWER | start LOWER`
//!
//! `up` (what `make demo` runs) starts the whole suite on this machine: an upper cluster, two
//! lower clusters with simulated nodes, the webhook and one virtual-node per lower cluster,
//! then applies the sample workload, waits until it runs, prints what to try, and keeps
//! everything running until SIGINT or SIGTERM. `stop` and `start`, from another terminal,
//! stop and restart a lower cluster's apiserver in the running demo.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tensile_common::telemetry::LogArgs;
use tensile_e2e::demo::{Demo, DemoOptions, send_command, shown};

const DEFAULT_DIR: &str = "target/demo";

#[derive(Parser, Debug)]
#[command(
    name = "demo",
    about = "The tensile suite on this machine, with a sample workload"
)]
struct Cli {
    /// Directory for kubeconfigs, logs and the control socket.
    #[arg(long, env = "DEMO_DIR", default_value = DEFAULT_DIR, global = true)]
    dir: PathBuf,
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start everything and keep it running until Ctrl-C (the default).
    Up {
        /// The workload to apply to the upper cluster.
        #[arg(long, env = "DEMO_MANIFEST")]
        manifest: Option<PathBuf>,
        /// Place opted-in pods with the multi-scheduler: its extender behind a second
        /// kube-scheduler, and the webhook handing pods to it.
        #[arg(long, env = "DEMO_MULTI_SCHEDULER")]
        multi_scheduler: bool,
    },
    /// Stop a lower cluster's apiserver in the running demo: its virtual node goes NotReady.
    Stop {
        /// The lower cluster (lower-a or lower-b).
        cluster: String,
    },
    /// Start a stopped lower cluster's apiserver again.
    Start {
        /// The lower cluster (lower-a or lower-b).
        cluster: String,
    },
}

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut log = cli.log.clone();
    // The demo's own lines are the output; the simulators' warnings stay, kube's client
    // retries (which fail by design while apiservers start) do not.
    tensile_e2e::main_of("demo", &mut log, "warn,kube_client=off,kube_runtime=off", || {
        run(cli)
    })
}

fn say(message: &str) {
    println!("demo: {message}");
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let default = Command::Up {
        manifest: None,
        multi_scheduler: std::env::var("DEMO_MULTI_SCHEDULER").is_ok_and(|v| v == "1" || v == "true"),
    };
    match cli.command.unwrap_or(default) {
        Command::Up {
            manifest,
            multi_scheduler,
        } => up(&cli.dir, manifest, multi_scheduler).await,
        Command::Stop { cluster } => control(&cli.dir, &format!("stop {cluster}")).await,
        Command::Start { cluster } => control(&cli.dir, &format!("start {cluster}")).await,
    }
}

async fn control(dir: &Path, command: &str) -> anyhow::Result<()> {
    let reply = send_command(dir, command).await?;
    println!("{reply}");
    Ok(())
}

async fn up(dir: &Path, manifest: Option<PathBuf>, multi_scheduler: bool) -> anyhow::Result<()> {
    let mut options = DemoOptions::new(dir);
    options.multi_scheduler = multi_scheduler;
    if let Some(m) = manifest {
        options.manifest = m;
    }
    options.control_command = control_command(dir);
    let demo = tokio::select! {
        demo = Demo::start(options, &say) => demo.context("starting the demo")?,
        r = tensile_e2e::wait_for_signal() => {
            r?;
            say("interrupted; stopping what was started");
            return Ok(());
        }
    };
    println!("{}", demo.summary());
    tokio::select! {
        _ = demo.serve_control(&say) => {}
        r = tensile_e2e::wait_for_signal() => r?,
    }
    say("stopping the virtual nodes, the webhook and the clusters");
    drop(demo);
    say("stopped");
    Ok(())
}

/// How a user in the current directory reaches this demo: this executable, plus `--dir`
/// unless it is the default.
fn control_command(dir: &Path) -> String {
    let exe = std::env::current_exe()
        .map(|p| shown(&p))
        .unwrap_or_else(|_| "demo".into());
    let exe = if exe.contains('/') {
        exe
    } else {
        format!("./{exe}")
    };
    if dir == Path::new(DEFAULT_DIR) {
        exe
    } else {
        format!("{exe} --dir {}", dir.display())
    }
}
