//! Running the real kubectl against a test cluster: the kubectl of the version the cluster
//! runs, as kubectl supports only one minor of skew to its apiserver.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

fn known() -> &'static Mutex<HashMap<String, PathBuf>> {
    static KNOWN: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    KNOWN.get_or_init(Default::default)
}

/// Runs `kubectl` for every kubeconfig whose server is `url` (a cluster's apiserver URL).
pub fn register(url: &str, kubectl: &Path) {
    if let Ok(mut known) = known().lock() {
        known.insert(url.to_owned(), kubectl.to_owned());
    }
}

/// The kubectl for `kubeconfig`: the one registered for the server its current context names,
/// else the newest version's.
pub fn binary_for(kubeconfig: &Path) -> PathBuf {
    let server = std::fs::read_to_string(kubeconfig)
        .ok()
        .and_then(|text| server_of(&text));
    let registered = server.and_then(|server| known().lock().ok()?.get(&server).cloned());
    registered
        .or_else(|| crate::Binaries::newest().ok().map(|b| b.kubectl.clone()))
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// The server of a kubeconfig's current context (the first cluster's when that cannot be read).
fn server_of(kubeconfig: &str) -> Option<String> {
    let config: serde_yaml::Value = serde_yaml::from_str(kubeconfig).ok()?;
    let clusters = config.get("clusters")?.as_sequence()?;
    let context_cluster = config
        .get("current-context")
        .and_then(|c| c.as_str())
        .and_then(|current| {
            config.get("contexts")?.as_sequence()?.iter().find_map(|c| {
                (c.get("name")?.as_str()? == current)
                    .then(|| c.get("context")?.get("cluster")?.as_str())
                    .flatten()
            })
        });
    let cluster = match context_cluster {
        Some(name) => clusters
            .iter()
            .find(|c| c.get("name").and_then(|n| n.as_str()) == Some(name))?,
        None => clusters.first()?,
    };
    Some(cluster.get("cluster")?.get("server")?.as_str()?.to_owned())
}

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
    let result = Command::new(binary_for(kubeconfig))
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_server_is_the_current_contexts() {
        let config = "apiVersion: v1\nkind: Config\nclusters:\n- name: a\n  cluster: {server: https://127.0.0.1:1}\n\
                      - name: b\n  cluster: {server: https://127.0.0.1:2}\ncontexts:\n- name: x\n  context: {cluster: b, user: u}\n\
                      current-context: x\n";
        assert_eq!(super::server_of(config).as_deref(), Some("https://127.0.0.1:2"));
        let no_context = "clusters:\n- name: a\n  cluster: {server: https://127.0.0.1:1}\n";
        assert_eq!(
            super::server_of(no_context).as_deref(),
            Some("https://127.0.0.1:1")
        );
        assert_eq!(super::server_of("not: [yaml"), None);
    }
}
