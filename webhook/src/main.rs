use clap::Parser;

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tensile_common::small_pages_only();
    let args = tensile_webhook::Args::parse();
    // One crypto provider for every TLS user in the process (kube's client included).
    let _ = rustls::crypto::ring::default_provider().install_default();
    tensile_common::telemetry::init(&args.log)?;
    tensile_webhook::run(args).await?;
    Ok(())
}
