//! Running the real kubectl against a test cluster.

use std::path::Path;
use std::process::Command;

/// Output of one kubectl run.
#[derive(Debug)]
pub struct Output {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kubectl --kubeconfig KUBECONFIG ARGS…` (blocking: call it from `spawn_blocking` or
/// through [`run`]).
pub fn run_blocking(kubeconfig: &Path, args: &[&str]) -> Output {
    let result = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output();
    match result {
        Ok(out) => Output {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        },
        Err(e) => Output {
            ok: false,
            stdout: String::new(),
            stderr: format!("cannot run kubectl: {e}"),
        },
    }
}

/// Async wrapper around [`run_blocking`].
pub async fn run(kubeconfig: &Path, args: &[&str]) -> Output {
    let kubeconfig = kubeconfig.to_owned();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run_blocking(&kubeconfig, &refs)
    })
    .await
    .unwrap_or_else(|e| Output {
        ok: false,
        stdout: String::new(),
        stderr: format!("kubectl task failed: {e}"),
    })
}
