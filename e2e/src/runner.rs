//! The kubelet of the test bed for the virtual nodes the cluster controller makes.
//!
//! The bed runs no containers, so this stands in for the kubelet of their pods: for each
//! Deployment of a namespace that carries `tensile.io/lower-cluster`, it runs one process of
//! its `virtual-node` container with the Deployment's own flags. Only what a pod would give
//! the process differs: the node's address and ports, a kubeconfig of the pod's
//! ServiceAccount token, and the credential Secret's keys as files in one directory, kept in
//! step with the Secret (written whole and renamed into place, as the kubelet swaps a
//! Secret volume). A Deployment that is deleted, or being deleted, has its process stopped
//! as a kubelet stops a pod: SIGTERM, then SIGKILL after the grace period.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;

use crate::process::Service;
use crate::{Result, TestCluster, free_port};

/// Where the credential is mounted in the pod, as the controller's Deployment says.
const CREDENTIAL_DIR: &str = "/etc/tensile/lower";

struct Running {
    service: Service,
    secret: String,
    dir: PathBuf,
}

/// What the runner has run, for a test to look at.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// Each Deployment's process log, by Deployment name.
    pub logs: BTreeMap<String, PathBuf>,
    /// How many times each Deployment's credential directory was rewritten after the start.
    pub credential_updates: BTreeMap<String, u32>,
}

/// Runs the controller's virtual nodes until dropped.
pub struct VirtualNodeRunner {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
    seen: Arc<Mutex<Seen>>,
}

impl VirtualNodeRunner {
    /// Starts running the virtual node Deployments of `namespace` in `upper`.
    pub fn start(upper: &'static TestCluster, namespace: &str) -> Result<Self> {
        let stop = CancellationToken::new();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let binary = crate::bins::suite_binary("virtual-node")?;
        let task = tokio::spawn(run(
            upper,
            namespace.to_owned(),
            binary,
            stop.clone(),
            seen.clone(),
        ));
        Ok(Self {
            stop,
            task: Some(task),
            seen,
        })
    }

    /// What has been run so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stops every process it runs and waits until they are gone.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for VirtualNodeRunner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn run(
    upper: &'static TestCluster,
    namespace: String,
    binary: PathBuf,
    stop: CancellationToken,
    seen: Arc<Mutex<Seen>>,
) {
    let mut running: HashMap<String, Running> = HashMap::new();
    let client = match upper.client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runner: no client of the upper cluster: {e}");
            return;
        }
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    while !stop.is_cancelled() {
        let listed = deployments
            .list(&ListParams::default().labels(tensile_common::names::LOWER_CLUSTER))
            .await;
        if let Ok(list) = listed {
            let live: HashMap<String, Deployment> = list
                .items
                .into_iter()
                .filter(|d| d.metadata.deletion_timestamp.is_none())
                .map(|d| (d.metadata.name.clone().unwrap_or_default(), d))
                .collect();
            let gone: Vec<String> = running
                .keys()
                .filter(|k| !live.contains_key(*k))
                .cloned()
                .collect();
            for name in gone {
                if let Some(r) = running.remove(&name) {
                    terminate(r.service).await;
                }
            }
            for (name, deployment) in &live {
                if let Some(r) = running.get(name) {
                    if let Ok(secret) = secrets.get(&r.secret).await
                        && mount(&secret, &r.dir).unwrap_or(false)
                        && let Ok(mut seen) = seen.lock()
                    {
                        *seen.credential_updates.entry(name.clone()).or_default() += 1;
                    }
                    continue;
                }
                match start(upper, &namespace, name, deployment, &secrets, &binary).await {
                    Ok(r) => {
                        if let Ok(mut seen) = seen.lock() {
                            seen.logs.insert(name.clone(), r.service.log_path().to_owned());
                        }
                        running.insert(name.clone(), r);
                    }
                    Err(e) => eprintln!("runner: deployment {namespace}/{name} not started yet: {e}"),
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    for (_, r) in running.drain() {
        terminate(r.service).await;
    }
}

/// SIGTERM, and SIGKILL after 10 s, as a kubelet stops a container.
async fn terminate(mut service: Service) {
    if let Some(pid) = service.pid() {
        let _ = crate::process::signal(pid, "TERM");
        let started = Instant::now();
        while service.exited().is_none() && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    service.stop();
}

/// Writes the keys of `secret` as files of `dir`, swapping the whole directory in at once
/// when anything changed; whether it did.
fn mount(secret: &Secret, dir: &Path) -> std::io::Result<bool> {
    let data = secret.data.clone().unwrap_or_default();
    let unchanged = data
        .iter()
        .all(|(k, v)| std::fs::read(dir.join(k)).is_ok_and(|on_disk| on_disk == v.0));
    if unchanged && dir.exists() {
        return Ok(false);
    }
    let next = dir.with_extension("next");
    let _ = std::fs::remove_dir_all(&next);
    std::fs::create_dir_all(&next)?;
    for (k, v) in &data {
        std::fs::write(next.join(k), &v.0)?;
    }
    let old = dir.with_extension("old");
    let _ = std::fs::remove_dir_all(&old);
    if dir.exists() {
        std::fs::rename(dir, &old)?;
    }
    std::fs::rename(&next, dir)?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(true)
}

async fn start(
    upper: &'static TestCluster,
    namespace: &str,
    name: &str,
    deployment: &Deployment,
    secrets: &Api<Secret>,
    binary: &Path,
) -> std::result::Result<Running, String> {
    let pod = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .ok_or("no pod template")?;
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "virtual-node")
        .ok_or("no virtual-node container")?;
    let account = pod.service_account_name.clone().ok_or("no ServiceAccount")?;
    let secret_name = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.name == "lower-credential")
        .and_then(|v| v.secret)
        .and_then(|s| s.secret_name)
        .ok_or("no lower-credential volume")?;
    let secret = secrets.get(&secret_name).await.map_err(|e| e.to_string())?;
    let dir = upper.dir().join("runner").join(name);
    std::fs::create_dir_all(dir.parent().unwrap_or(&dir)).map_err(|e| e.to_string())?;
    mount(&secret, &dir).map_err(|e| e.to_string())?;
    let kubeconfig = crate::chart::service_account_kubeconfig(
        upper,
        namespace,
        &account,
        &upper.dir().join("runner").join(format!("{name}.sa.kubeconfig")),
    )
    .await
    .map_err(|e| e.to_string())?;
    let port = |what: &str| free_port().map_err(|e| format!("{what}: {e}"));
    let args: Vec<String> = container
        .args
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.replace(CREDENTIAL_DIR, &dir.display().to_string()))
        .collect();
    let args = crate::chart::with_flags(
        &args,
        &[
            format!("--kubeconfig={}", kubeconfig.display()),
            "--node-ip=127.0.0.1".into(),
            format!("--kubelet-port={}", port("kubelet port")?),
            format!("--admin-addr=127.0.0.1:{}", port("admin port")?),
            format!("--client-verify-ca={}", upper.kubelet_client_ca_path().display()),
        ],
    );
    let log = upper.dir().join("runner").join(format!("{name}.log"));
    let service =
        Service::start(&format!("virtual-node {name}"), binary, &args, &log).map_err(|e| e.to_string())?;
    Ok(Running {
        service,
        secret: secret_name,
        dir,
    })
}
