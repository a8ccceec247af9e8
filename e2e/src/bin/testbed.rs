//! `testbed up --dir DIR --cluster NAME[:nodes=N,cpu=C,memory=M,pods=P] ...`
//!
//! Starts the named clusters (scheduler and controller-manager included) on one etcd, with
//! N simulated nodes each when asked; writes `DIR/NAME.kubeconfig` and
//! `DIR/NAME.kubelet-client-ca.crt`; prints one line when everything is ready; tears it all
//! down on SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tensile_common::telemetry::LogArgs;
use tensile_e2e::testbed::{ClusterSpec, Testbed};

#[derive(Parser, Debug)]
#[command(
    name = "testbed",
    about = "Real Kubernetes control planes on loopback with simulated nodes"
)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start clusters and keep them running until interrupted.
    Up {
        /// Directory for kubeconfigs, certificates and logs.
        #[arg(long, env = "TESTBED_DIR")]
        dir: PathBuf,
        /// A cluster: `NAME`, or `NAME:nodes=N[,cpu=C][,memory=M][,pods=P]`. Repeatable.
        #[arg(long = "cluster", required = true, value_parser = ClusterSpec::parse)]
        clusters: Vec<ClusterSpec>,
    },
}

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    // Readiness polling fails by design until the apiservers answer; kube's client logs each
    // such failure as an error, which would drown the test bed's own messages.
    tensile_e2e::main_of("testbed", &mut cli.log, "info,kube_client=off", || {
        run(cli.command)
    })
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Up { dir, clusters } => {
            let bed = Testbed::up(&dir, &clusters)
                .await
                .context("starting the test bed")?;
            println!("{}", bed.ready_line());
            tensile_e2e::wait_for_signal().await?;
            eprintln!("testbed: stopping");
            drop(bed);
            Ok(())
        }
    }
}
