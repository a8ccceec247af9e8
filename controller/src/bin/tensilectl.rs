use std::process::ExitCode;

use clap::Parser;
use tensile_controller::ctl::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tensilectl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match &cli.command {
            Command::Join(args) => ctl::join(args).await,
            Command::Leave(args) => ctl::leave(args).await,
            Command::Status(args) => ctl::status(args).await,
            Command::Crds(args) => ctl::crds(args).await,
            Command::UninstallCheck(args) => ctl::uninstall_check(args).await,
        }
    });
    match outcome {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        // The status as asked, and an exit code scripts can test.
        Err(ctl::Error::NotReady(out)) => {
            print!("{out}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("tensilectl: {e}");
            ExitCode::FAILURE
        }
    }
}
