use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: tensile_common::Allocator = tensile_common::Allocator;

fn main() -> ExitCode {
    let args = tensile_virtual_node::Args::parse();
    if let Err(e) = tensile_common::telemetry::init(&args.log) {
        eprintln!("virtual-node: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
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
