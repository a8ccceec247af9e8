use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    let args = tensile_controller::Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Err(e) = tensile_common::telemetry::init(&args.log) {
        eprintln!("cluster-controller: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cluster-controller: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tensile_controller::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cluster-controller: {e}");
            ExitCode::FAILURE
        }
    }
}
