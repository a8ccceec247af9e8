//! The Helm chart in the test bed: the real helm binary, the chart in `deploy/helm/tensile`,
//! kubeconfigs of the ServiceAccounts an install creates, and the daemons' command lines as
//! the chart's Deployments give them.
//!
//! helm comes from `HELM_BIN` or, without it, from `scripts/helm.sh`, which installs it once
//! into the user's cache (as `scripts/kube-bins.sh` does for the control plane).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;

use crate::{Error, Result, TestCluster, io_err};

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/tensile")
}

/// Installs the chart's ExclusionRecord definition into the cluster of `kubeconfig` (as
/// `helm install` does) and waits until the apiserver serves it.
pub async fn install_exclusion_records(kubeconfig: &Path) -> Result<()> {
    let crd = chart_dir().join("crds/exclusionrecords.yaml");
    let crd = crd.display().to_string();
    let name = format!(
        "crd/{}.{}",
        tensile_common::exclusion::PLURAL,
        tensile_common::names::API_GROUP
    );
    for args in [
        vec!["apply", "-f", crd.as_str()],
        vec![
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            name.as_str(),
        ],
    ] {
        let out = crate::kubectl::run(kubeconfig, &args).await;
        if !out.ok {
            return Err(Error::Demo(format!("kubectl {args:?}: {}", out.stderr)));
        }
    }
    Ok(())
}

/// Runs `tensilectl crds` against the cluster of `kubeconfig`: this release's definitions
/// applied and established. Its output, or why it failed.
pub async fn apply_crds(kubeconfig: &Path) -> Result<String> {
    let ctl = crate::bins::suite_binary("tensilectl")?;
    let out = tokio::process::Command::new(&ctl)
        .arg("crds")
        .arg(format!("--upper-kubeconfig={}", kubeconfig.display()))
        .env_remove("KUBECONFIG")
        .output()
        .await
        .map_err(io_err(&ctl))?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(Error::Demo(format!(
            "tensilectl crds: {}",
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

/// The helm binary: `HELM_BIN`, or what `scripts/helm.sh` installed (installing it first).
pub fn helm_binary() -> Result<&'static Path> {
    static HELM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    HELM.get_or_init(|| crate::run_script("helm.sh", &[]).map(PathBuf::from))
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|e| Error::Demo(e.clone()))
}

/// Runs `helm ARGS…` against `cluster` (its admin kubeconfig), with helm's own state under the
/// cluster's directory so tests never touch the user's.
pub async fn helm(cluster: &TestCluster, args: &[&str]) -> Result<crate::kubectl::Output> {
    helm_with(&Access::of(cluster), args).await
}

/// What a helper needs of a cluster to act on it with kubectl and helm, apart from the
/// [`TestCluster`] (for a task that outlives a borrow of it).
#[derive(Clone, Debug)]
pub struct Access {
    pub name: String,
    pub dir: PathBuf,
    /// Admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The apiserver's URL.
    pub server: String,
    /// The Kubernetes version the cluster runs (`v1.37.2`).
    pub version: String,
}

impl Access {
    pub fn of(cluster: &TestCluster) -> Self {
        Self {
            name: cluster.name().to_owned(),
            dir: cluster.dir().to_owned(),
            kubeconfig: cluster.kubeconfig().to_owned(),
            server: cluster.url(),
            version: cluster.version().to_owned(),
        }
    }

    pub async fn kubectl(&self, args: &[&str]) -> crate::kubectl::Output {
        crate::kubectl::run(&self.kubeconfig, args).await
    }
}

/// [`helm`] on the cluster `access` reaches. `helm template` renders for the cluster's version
/// unless the arguments name one (offline, helm assumes the version its own client library
/// was built for).
pub async fn helm_with(access: &Access, args: &[&str]) -> Result<crate::kubectl::Output> {
    let bin = helm_binary()?.to_owned();
    let home = access.dir.join("helm");
    let kubeconfig = access.kubeconfig.clone();
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    if args.first().is_some_and(|a| a == "template") && !args.iter().any(|a| a == "--kube-version") {
        args.extend(["--kube-version".to_owned(), access.version.clone()]);
    }
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&bin)
            .args(&args)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
    })
    .await
    .map_err(|e| Error::Demo(e.to_string()))?
    .map_err(io_err("helm"))?;
    Ok(crate::kubectl::Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Writes a kubeconfig for ServiceAccount `namespace/name` of `cluster` to `path`, with a token
/// the cluster issued it, requested with a `kubernetes.io/service-account-token` Secret.
pub async fn service_account_kubeconfig(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
    path: &Path,
) -> Result<PathBuf> {
    service_account_kubeconfig_with(&Access::of(cluster), namespace, name, path).await
}

/// [`service_account_kubeconfig`] on the cluster `access` reaches.
pub async fn service_account_kubeconfig_with(
    cluster: &Access,
    namespace: &str,
    name: &str,
    path: &Path,
) -> Result<PathBuf> {
    // No supported version makes an account's token Secret by itself (none has since 1.24):
    // a `service-account-token` Secret naming the account asks the token controller for one.
    let secret = format!("{name}-token-requested");
    let manifest = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {secret}\n  namespace: {namespace}\n  \
         annotations:\n    kubernetes.io/service-account.name: {name}\ntype: kubernetes.io/service-account-token\n"
    );
    let file = cluster.dir.join(format!("{secret}.yaml"));
    std::fs::write(&file, manifest).map_err(io_err(&file))?;
    let out = cluster
        .kubectl(&["apply", "-f", &file.display().to_string()])
        .await;
    if !out.ok {
        return Err(Error::Demo(format!(
            "requesting a token for {name}: {}",
            out.stderr
        )));
    }
    let token = crate::wait::until(
        &format!("the token of ServiceAccount {namespace}/{name}"),
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let out = cluster
                .kubectl(&[
                    "-n",
                    namespace,
                    "get",
                    "secret",
                    &secret,
                    "-o",
                    "jsonpath={.data.token}",
                ])
                .await;
            let b64 = out.stdout.trim();
            if out.ok && !b64.is_empty() {
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| e.to_string())
                    .and_then(|t| String::from_utf8(t).map_err(|e| e.to_string()))
            } else {
                Err(format!("{b64:?} {}", out.stderr.trim()))
            }
        },
    )
    .await?;
    token_kubeconfig(cluster, &format!("{namespace}-{name}"), &token, path).await
}

/// Writes a kubeconfig for `user` with bearer `token` on the cluster `cluster` reaches to `path`.
async fn token_kubeconfig(cluster: &Access, user: &str, token: &str, path: &Path) -> Result<PathBuf> {
    let ca = cluster
        .kubectl(&[
            "config",
            "view",
            "--raw",
            "--minify",
            "-o",
            "jsonpath={.clusters[0].cluster.certificate-authority-data}",
        ])
        .await;
    let cluster_name = &cluster.name;
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: {cluster_name}
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: {cluster_name}
  context:
    cluster: {cluster_name}
    user: {user}
current-context: {cluster_name}
",
        server = cluster.server,
        ca = ca.stdout.trim(),
    );
    std::fs::write(path, text).map_err(io_err(path))?;
    Ok(path.to_owned())
}

/// `helm uninstall RELEASE -n NAMESPACE --wait` while the bed stands in for the kubelet of
/// the release's hook pods ([`run_hook_pods`]): helm runs the chart's pre-delete hook as in a
/// cluster, and fails the uninstall when the hook fails.
pub async fn uninstall(cluster: &Access, release: &str, namespace: &str) -> Result<crate::kubectl::Output> {
    let stop = tokio_util::sync::CancellationToken::new();
    let hooks = tokio::spawn(run_hook_pods(cluster.clone(), namespace.to_owned(), stop.clone()));
    let out = helm_with(cluster, &["uninstall", release, "-n", namespace, "--wait"]).await;
    stop.cancel();
    let ran = hooks
        .await
        .map_err(|e| Error::Demo(format!("the hook pods' runner: {e}")))?;
    let mut out = out?;
    // What ran, for the test's log and its assertions on helm's answer.
    for line in ran? {
        out.stderr.push_str(&format!("\n(bed) {line}"));
    }
    Ok(out)
}

/// The node name hook pods are bound to: no Node has it, as no kubelet of the bed runs them.
const HOOK_NODE: &str = "bed-hook-runner";

/// Stands in for the kubelet of every Job pod of `namespace` until `stop`: binds a pending
/// one, runs its container's command (a binary of the suite, by its file name) here with a
/// token of the pod's ServiceAccount as its kubeconfig, and reports the end in the pod's
/// status as a kubelet does (the exit code, and under `FallbackToLogsOnError` the output's
/// tail as the termination message), so the Job controller completes or fails the Job.
/// Returns a line for each pod run: its name, exit code and output.
async fn run_hook_pods(
    cluster: Access,
    namespace: String,
    stop: tokio_util::sync::CancellationToken,
) -> Result<Vec<String>> {
    let mut ran = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    while !stop.is_cancelled() {
        let out = cluster
            .kubectl(&[
                "-n",
                &namespace,
                "get",
                "pods",
                "-l",
                "batch.kubernetes.io/job-name",
                "-o",
                "json",
            ])
            .await;
        let pods: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
            if pod["status"]["phase"] != "Pending" || !seen.insert(uid) {
                continue;
            }
            ran.push(run_hook_pod(&cluster, &namespace, pod).await?);
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
    Ok(ran)
}

/// One pod of [`run_hook_pods`].
async fn run_hook_pod(cluster: &Access, namespace: &str, pod: &serde_json::Value) -> Result<String> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let container = &pod["spec"]["containers"][0];
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let command = strings(&container["command"]);
    let args = strings(&container["args"]);
    let binary = command
        .first()
        .and_then(|c| Path::new(c).file_name())
        .and_then(|f| f.to_str())
        .ok_or_else(|| Error::Demo(format!("hook pod {name} names no command")))?;
    let binary = crate::bins::suite_binary(binary)?;
    let account = pod["spec"]["serviceAccountName"].as_str().unwrap_or("default");

    let binding = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace},
        "target": {"apiVersion": "v1", "kind": "Node", "name": HOOK_NODE},
    });
    let file = cluster.dir.join(format!("{name}-binding.json"));
    std::fs::write(&file, binding.to_string()).map_err(io_err(&file))?;
    let bound = cluster
        .kubectl(&["create", "-f", &file.display().to_string()])
        .await;
    if !bound.ok {
        return Err(Error::Demo(format!("binding hook pod {name}: {}", bound.stderr)));
    }
    let token = cluster
        .kubectl(&["-n", namespace, "create", "token", account, "--duration=10m"])
        .await;
    if !token.ok {
        return Err(Error::Demo(format!("a token of {account}: {}", token.stderr)));
    }
    let kubeconfig = token_kubeconfig(
        cluster,
        &format!("{namespace}-{account}"),
        token.stdout.trim(),
        &cluster.dir.join(format!("{name}.kubeconfig")),
    )
    .await?;
    let started = now();
    let status = |phase: &str, state: serde_json::Value| {
        serde_json::json!({"status": {
            "phase": phase,
            "startTime": started,
            "containerStatuses": [{
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": false,
                "restartCount": 0,
                "state": state,
            }],
        }})
    };
    let patch = |body: serde_json::Value| async move {
        let out = cluster
            .kubectl(&[
                "-n",
                namespace,
                "patch",
                "pod",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                &body.to_string(),
            ])
            .await;
        match out.ok {
            true => Ok(()),
            false => Err(Error::Demo(format!("status of hook pod {name}: {}", out.stderr))),
        }
    };
    patch(status(
        "Running",
        serde_json::json!({"running": {"startedAt": started}}),
    ))
    .await?;
    let output = tokio::process::Command::new(&binary)
        .args(&args)
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .await
        .map_err(io_err(&binary))?;
    let code = output.status.code().unwrap_or(128);
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // FallbackToLogsOnError: the last 80 lines, 2048 bytes at most, of a failed container.
    let message = if code != 0 && container["terminationMessagePolicy"] == "FallbackToLogsOnError" {
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(80)..].join("\n");
        let cut = tail.len().saturating_sub(2048);
        let cut = (cut..=tail.len())
            .find(|i| tail.is_char_boundary(*i))
            .unwrap_or(tail.len());
        tail[cut..].to_owned()
    } else {
        String::new()
    };
    let (phase, reason) = match code {
        0 => ("Succeeded", "Completed"),
        _ => ("Failed", "Error"),
    };
    patch(status(
        phase,
        serde_json::json!({"terminated": {
            "exitCode": code,
            "reason": reason,
            "message": message,
            "startedAt": started,
            "finishedAt": now(),
        }}),
    ))
    .await?;
    Ok(format!(
        "hook pod {name} ran {} {args:?}: exit {code}: {}",
        binary.display(),
        log.trim()
    ))
}

/// The time now as the API writes it.
fn now() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

/// The arguments of the first container of Deployment `namespace/name`, as the chart wrote them.
pub async fn deployment_args(cluster: &TestCluster, namespace: &str, name: &str) -> Result<Vec<String>> {
    let out = cluster
        .kubectl(&[
            "-n",
            namespace,
            "get",
            "deployment",
            name,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].args}",
        ])
        .await;
    if !out.ok {
        return Err(Error::Demo(format!(
            "deployment {namespace}/{name}: {}",
            out.stderr
        )));
    }
    serde_json::from_str(out.stdout.trim())
        .map_err(|e| Error::Demo(format!("args of {namespace}/{name}: {e}: {}", out.stdout)))
}

/// The cluster controller of release `full` (the chart's fullname) in `namespace`, run here
/// as its Deployment would run it: the chart's flags, the chart's ServiceAccount, and the
/// virtual node template from the chart's ConfigMap as a file; `extra` flags on top.
pub async fn run_cluster_controller(
    cluster: &TestCluster,
    namespace: &str,
    full: &str,
    extra: &[String],
) -> Result<crate::process::Service> {
    let account = service_account_kubeconfig(
        cluster,
        namespace,
        &format!("{full}-cluster-controller"),
        &cluster.dir().join(format!("{full}-controller.kubeconfig")),
    )
    .await?;
    let out = cluster
        .kubectl(&[
            "-n",
            namespace,
            "get",
            "configmap",
            &format!("{full}-virtual-node-template"),
            "-o",
            r"jsonpath={.data.deployment\.yaml}",
        ])
        .await;
    if !out.ok {
        return Err(Error::Demo(format!("the virtual node template: {}", out.stderr)));
    }
    let template = cluster.dir().join(format!("{full}-virtual-node-template.yaml"));
    std::fs::write(&template, out.stdout).map_err(io_err(&template))?;
    let args = deployment_args(cluster, namespace, &format!("{full}-cluster-controller")).await?;
    if !args.contains(&"--virtual-node-template=/etc/tensile/virtual-node/deployment.yaml".to_owned()) {
        return Err(Error::Demo(format!(
            "the controller's flags name no template: {args:?}"
        )));
    }
    let defaults = vec![
        format!("--kubeconfig={}", account.display()),
        format!("--virtual-node-template={}", template.display()),
        format!("--admin-addr=127.0.0.1:{}", crate::free_port()?),
        "--log-format=plain".to_owned(),
    ];
    // A flag of `extra` replaces the default of that name.
    let args = with_flags(&args, &with_flags(&defaults, extra));
    let bin = crate::bins::suite_binary("cluster-controller")?;
    let log = cluster.dir().join(format!("{full}-cluster-controller.log"));
    let _ = std::fs::remove_file(&log);
    Ok(crate::process::Service::start(
        "cluster-controller",
        &bin,
        &args,
        &log,
    )?)
}

/// `args` with each flag named in `set` (`--flag=value`) replacing the flag of that name, and
/// added when absent.
pub fn with_flags(args: &[String], set: &[String]) -> Vec<String> {
    let name = |f: &str| f.split('=').next().unwrap_or_default().to_owned();
    let mut out: Vec<String> = args
        .iter()
        .filter(|a| !set.iter().any(|s| name(s) == name(a)))
        .cloned()
        .collect();
    out.extend(set.iter().cloned());
    out
}

/// A component's identity as the chart renders it: the ServiceAccount, ClusterRole, Role and
/// bindings of `templates/<template>.yaml` for release `release` in `namespace` (with `sets`,
/// each `key=value`) applied to `upper`, and a kubeconfig holding the token of `account`, so
/// that a test runs the daemon under exactly what the chart grants it.
pub async fn component_identity(
    upper: &TestCluster,
    template: &str,
    release: &str,
    namespace: &str,
    sets: &[String],
    account: &str,
) -> Result<PathBuf> {
    let chart = chart_dir().display().to_string();
    let only = format!("templates/{template}.yaml");
    let mut args = vec!["template", release, &chart, "-n", namespace, "--show-only", &only];
    for set in sets {
        args.extend(["--set", set.as_str()]);
    }
    let out = helm(upper, &args).await?;
    if !out.ok {
        return Err(Error::Demo(format!("helm template {only}: {}", out.stderr)));
    }
    let grants: Vec<&str> = out
        .stdout
        .split("\n---")
        .filter(|doc| {
            doc.lines().any(|l| {
                matches!(
                    l.trim(),
                    "kind: ServiceAccount"
                        | "kind: ClusterRole"
                        | "kind: ClusterRoleBinding"
                        | "kind: Role"
                        | "kind: RoleBinding"
                )
            })
        })
        .collect();
    if !grants.iter().any(|g| g.contains("kind: ServiceAccount")) {
        return Err(Error::Demo(format!(
            "{only} renders no ServiceAccount: {}",
            out.stdout
        )));
    }
    crate::check::apply(upper.kubeconfig(), &grants.join("\n---")).await;
    let path = upper.dir().join(format!("{account}.kubeconfig"));
    service_account_kubeconfig(upper, namespace, account, &path).await
}

/// Lines of a daemon's log that report a call the apiserver refused for want of permission:
/// the authorizer's `… is forbidden: User "…" cannot …`, or a 403 code. A refusal quoted from
/// elsewhere, such as a lower cluster's quota (`is forbidden: exceeded quota`), is not one.
pub fn denied_calls(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("is forbidden: user \"") || l.contains("\"code\":403") || l.contains("code: 403")
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every binary a chart template runs is built and copied into the image.
    #[test]
    fn the_image_holds_every_binary_the_chart_runs() {
        let dockerfile =
            std::fs::read_to_string(chart_dir().join("../../docker/Dockerfile")).unwrap_or_default();
        let mut run = Vec::new();
        for entry in std::fs::read_dir(chart_dir().join("templates"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for part in text.split("/usr/local/bin/").skip(1) {
                let name: String = part
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                run.push(name);
            }
        }
        run.sort();
        run.dedup();
        assert!(
            run.contains(&"cluster-controller".to_owned()) && run.len() >= 5,
            "{run:?}"
        );
        for name in run {
            assert!(
                dockerfile.contains(&format!("target/release/{name}")),
                "the image lacks {name}, which the chart runs"
            );
        }
        assert!(dockerfile.contains("USER 65532:65532") && dockerfile.contains("distroless"));
    }

    #[test]
    fn a_set_flag_replaces_the_charts_and_others_are_added() {
        let args = vec!["--port=8443".to_owned(), "--log-format=json".to_owned()];
        let got = with_flags(&args, &["--port=1".into(), "--kubeconfig=k".into()]);
        assert_eq!(got, ["--log-format=json", "--port=1", "--kubeconfig=k"]);
    }

    #[test]
    fn a_refusal_is_found_in_plain_and_json_logs() {
        let log = "ok line\n\
                   WARN pods is forbidden: User \"system:serviceaccount:t:vn\" cannot create\n\
                   {\"level\":\"WARN\",\"code\":403}\n";
        assert_eq!(denied_calls(log).len(), 2);
        assert!(denied_calls("all fine\n").is_empty());
        let quoted = "INFO descheduled: lower cluster lower-a rejected the pod: pods \"web\" is \
                      forbidden: exceeded quota: cap, requested: requests.cpu=1500m\n";
        assert!(
            denied_calls(quoted).is_empty(),
            "a lower quota's refusal is not ours"
        );
    }
}
