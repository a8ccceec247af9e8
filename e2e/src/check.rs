//! Assertions for end-to-end tests, phrased as a user at kubectl would check: each helper
//! panics with what kubectl said when the expectation fails.

use std::path::Path;
use std::time::Duration;

/// Runs kubectl and returns stdout; panics with kubectl's stderr on failure.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let out = crate::kubectl::run(kubeconfig, args).await;
    assert!(out.ok, "kubectl {args:?} failed: {}", out.stderr);
    out.stdout
}

/// `kubectl apply -f` of a manifest given as text.
pub async fn apply(kubeconfig: &Path, manifest: &str) {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("temporary directory: {e}"),
    };
    let path = dir.path().join("manifest.yaml");
    if let Err(e) = std::fs::write(&path, manifest) {
        panic!("writing {}: {e}", path.display());
    }
    kubectl(kubeconfig, &["apply", "-f", &path.display().to_string()]).await;
}

/// Waits until `kubectl ARGS` prints exactly `want` (trimmed); panics with the last output.
pub async fn eventually(kubeconfig: &Path, what: &str, secs: u64, args: &[&str], want: &str) {
    let result = crate::wait::until(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(300),
        || async {
            let out = crate::kubectl::run(kubeconfig, args).await;
            let got = out.stdout.trim().to_owned();
            if out.ok && got == want {
                Ok(())
            } else {
                Err(format!("{got:?} {}", out.stderr.trim()))
            }
        },
    )
    .await;
    if let Err(e) = result {
        panic!("{e}");
    }
}
