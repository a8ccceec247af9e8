//! The kubelet of the test bed for the virtual nodes the cluster controller makes.
//!
//! The bed runs no containers, so this stands in for the kubelet of their pods: for each
//! Deployment of a namespace that carries `tensile.io/lower-cluster`, it runs one process of
//! its `virtual-node` container with the Deployment's own flags. Only what a pod would give
//! the process differs: the node's address and ports, a kubeconfig of the pod's
//! ServiceAccount token, and each Secret or ConfigMap volume (the credential, the stash keys,
//! the overrides) as a directory of files in place of its mount path, kept in step with its
//! object (written whole and renamed into place, as the kubelet swaps such a volume). A Deployment that is deleted, or being deleted, has its process stopped
//! as a kubelet stops a pod: SIGTERM, then SIGKILL after the grace period. A Deployment whose
//! pod template changed is rolled as its controller would: the process stopped, a new one
//! started from the new template (counted in [`Seen::rollouts`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;

use crate::process::Service;
use crate::{Result, TestCluster, free_port};

/// The credential's volume, as the controller's Deployment names it.
const CREDENTIAL_VOLUME: &str = "lower-credential";

/// A Secret or ConfigMap volume: which object, which keys as which files (all, as
/// themselves, when `items` is empty), and where its files are.
struct ObjectVolume {
    volume: String,
    source: Source,
    items: Vec<(String, String)>,
    dir: PathBuf,
}

enum Source {
    Secret(String),
    ConfigMap(String),
}

impl Source {
    /// The object's keys and contents.
    async fn read(
        &self,
        client: &kube::Client,
        namespace: &str,
    ) -> std::result::Result<BTreeMap<String, Vec<u8>>, String> {
        match self {
            Source::Secret(name) => {
                let secret = Api::<Secret>::namespaced(client.clone(), namespace)
                    .get(name)
                    .await
                    .map_err(|e| format!("secret {name}: {e}"))?;
                Ok(secret
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect())
            }
            Source::ConfigMap(name) => {
                let config_map = Api::<ConfigMap>::namespaced(client.clone(), namespace)
                    .get(name)
                    .await
                    .map_err(|e| format!("configmap {name}: {e}"))?;
                let text = config_map
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()));
                let binary = config_map
                    .binary_data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0));
                Ok(text.chain(binary).collect())
            }
        }
    }
}

struct Running {
    service: Service,
    volumes: Vec<ObjectVolume>,
    /// The pod template it was started from.
    template: String,
}

/// What the runner has run, for a test to look at.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// Each Deployment's process log, by Deployment name.
    pub logs: BTreeMap<String, PathBuf>,
    /// How many times each Deployment's credential directory was rewritten after the start.
    pub credential_updates: BTreeMap<String, u32>,
    /// How many times each Deployment was rolled for a changed pod template.
    pub rollouts: BTreeMap<String, u32>,
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
                let template = serde_json::to_string(&deployment.spec.template).unwrap_or_default();
                if running.get(name).is_some_and(|r| r.template != template)
                    && let Some(r) = running.remove(name)
                {
                    terminate(r.service).await;
                    if let Ok(mut seen) = seen.lock() {
                        *seen.rollouts.entry(name.clone()).or_default() += 1;
                    }
                }
                if let Some(r) = running.get(name) {
                    for v in &r.volumes {
                        if let Ok(data) = v.source.read(&client, &namespace).await
                            && mount(data, v).unwrap_or(false)
                            && v.volume == CREDENTIAL_VOLUME
                            && let Ok(mut seen) = seen.lock()
                        {
                            *seen.credential_updates.entry(name.clone()).or_default() += 1;
                        }
                    }
                    continue;
                }
                match start(upper, &namespace, name, deployment, &client, &binary).await {
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

/// Writes the keys of an object (`all`) as the files of `volume`, swapping the whole
/// directory in at once when anything changed; whether it did.
fn mount(all: BTreeMap<String, Vec<u8>>, volume: &ObjectVolume) -> std::io::Result<bool> {
    let dir = volume.dir.as_path();
    let data: BTreeMap<String, Vec<u8>> = if volume.items.is_empty() {
        all
    } else {
        volume
            .items
            .iter()
            .filter_map(|(key, path)| all.get(key).map(|v| (path.clone(), v.clone())))
            .collect()
    };
    let unchanged = data
        .iter()
        .all(|(k, v)| std::fs::read(dir.join(k)).is_ok_and(|on_disk| &on_disk == v));
    if unchanged && dir.exists() {
        return Ok(false);
    }
    let next = dir.with_extension("next");
    let _ = std::fs::remove_dir_all(&next);
    std::fs::create_dir_all(&next)?;
    for (k, v) in &data {
        std::fs::write(next.join(k), v)?;
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
    client: &kube::Client,
    binary: &Path,
) -> std::result::Result<Running, String> {
    let pod = deployment.spec.template.spec.clone().ok_or("no pod template")?;
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "virtual-node")
        .ok_or("no virtual-node container")?;
    let account = pod.service_account_name.clone().ok_or("no ServiceAccount")?;
    let base = upper.dir().join("runner").join(name);
    let mut volumes = Vec::new();
    let mut args: Vec<String> = container.args.clone().unwrap_or_default();
    for mount_point in container.volume_mounts.clone().unwrap_or_default() {
        let Some(found) = pod.volumes.iter().flatten().find(|v| v.name == mount_point.name) else {
            continue;
        };
        let (source, items) = match (&found.secret, &found.config_map) {
            (Some(secret), _) => (
                Source::Secret(
                    secret
                        .secret_name
                        .clone()
                        .ok_or("a Secret volume names no Secret")?,
                ),
                secret.items.clone(),
            ),
            (None, Some(config_map)) => (
                Source::ConfigMap(config_map.name.clone()),
                config_map.items.clone(),
            ),
            (None, None) => continue,
        };
        let volume = ObjectVolume {
            volume: mount_point.name.clone(),
            source,
            items: items
                .unwrap_or_default()
                .into_iter()
                .map(|i| (i.key, i.path))
                .collect(),
            dir: base.join(&mount_point.name),
        };
        let data = volume.source.read(client, namespace).await?;
        std::fs::create_dir_all(&base).map_err(|e| e.to_string())?;
        mount(data, &volume).map_err(|e| e.to_string())?;
        let local = volume.dir.display().to_string();
        args = args
            .into_iter()
            .map(|a| a.replace(&mount_point.mount_path, &local))
            .collect();
        volumes.push(volume);
    }
    if !volumes.iter().any(|v| v.volume == CREDENTIAL_VOLUME) {
        return Err("no lower-credential volume".into());
    }
    let kubeconfig = crate::chart::service_account_kubeconfig(
        upper,
        namespace,
        &account,
        &upper.dir().join("runner").join(format!("{name}.sa.kubeconfig")),
    )
    .await
    .map_err(|e| e.to_string())?;
    let port = |what: &str| free_port().map_err(|e| format!("{what}: {e}"));
    let args = crate::chart::with_flags(
        &args,
        &[
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--node-ip={}", crate::node_ip().map_err(|e| e.to_string())?),
            format!("--kubelet-port={}", port("kubelet port")?),
            format!("--admin-addr=127.0.0.1:{}", port("admin port")?),
            format!("--client-verify-ca={}", upper.kubelet_client_ca_path().display()),
        ],
    );
    let log = upper.dir().join("runner").join(format!("{name}.log"));
    let service =
        Service::start(&format!("virtual-node {name}"), binary, &args, &log).map_err(|e| e.to_string())?;
    let template = serde_json::to_string(&deployment.spec.template).unwrap_or_default();
    Ok(Running {
        service,
        volumes,
        template,
    })
}
