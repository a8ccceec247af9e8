//! Where a virtual node's heap goes, cache by cache (see `tensile_e2e::scale::heap_profile`):
//! opens the watches a virtual node named `--node` opens on the two clusters, keeps each as
//! the virtual node does now and as it did before trimming, and prints the live bytes of each
//! as JSON. Every allocation of this process is counted for that, so it is a binary of its own.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[global_allocator]
static ALLOCATOR: cap::Cap<tensile_common::Allocator> = cap::Cap::new(tensile_common::Allocator, usize::MAX);

#[derive(Parser, Debug)]
#[command(name = "heap-profile", about = "A virtual node's caches, live bytes by cache")]
struct Cli {
    /// Kubeconfig of the upper cluster.
    #[arg(long)]
    upper_kubeconfig: PathBuf,
    /// Kubeconfig of the lower cluster.
    #[arg(long)]
    lower_kubeconfig: PathBuf,
    /// The virtual node's name.
    #[arg(long)]
    node: String,
}

async fn client(path: &PathBuf) -> anyhow::Result<kube::Client> {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .with_context(|| format!("using {}", path.display()))?;
    Ok(kube::Client::try_from(config)?)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Runtime::new().context("async runtime")?;
    let figures = rt.block_on(async {
        let (upper, lower) = (
            client(&cli.upper_kubeconfig).await?,
            client(&cli.lower_kubeconfig).await?,
        );
        tensile_e2e::scale::heap_profile(upper, lower, &cli.node, || ALLOCATOR.allocated()).await
    })?;
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}
