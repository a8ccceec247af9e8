use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    tensile_common::small_pages_only();
    let args = tensile_descheduler::Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Err(e) = tensile_common::telemetry::init(&args.log) {
        eprintln!("descheduler: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("descheduler: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tensile_descheduler::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("descheduler: {e}");
            ExitCode::FAILURE
        }
    }
}
