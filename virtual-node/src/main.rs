use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    tensile_common::small_pages_only();
    let args = tensile_virtual_node::Args::parse();
    if let Err(e) = tensile_common::telemetry::init(&args.log) {
        eprintln!("virtual-node: {e}");
        return ExitCode::from(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(usize::from(args.worker_threads))
        .enable_all()
        .build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("virtual-node: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tensile_virtual_node::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("virtual-node: {e}");
            ExitCode::FAILURE
        }
    }
}
