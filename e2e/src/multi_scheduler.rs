//! The multi-scheduler as a test sees it: the `multi-scheduler` binary as a child process
//! (so a test can take the extender down), as an extender serving with a certificate of a
//! CA made here behind a second kube-scheduler configured from the shipped
//! KubeSchedulerConfiguration, or as the standalone scheduler.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::pki::Ca;
use crate::process::Service;
use crate::{TestCluster, free_port};

/// The shipped configuration (`kubescheduler.config.k8s.io/v1`).
pub const CONFIG_V1: &str = include_str!("../../multi-scheduler/config/scheduler-v1.yaml");

/// A running `multi-scheduler --mode=extender`.
pub struct ExtenderProcess {
    pub service: Service,
    /// `https://127.0.0.1:<port>`: the extender's `urlPrefix`.
    pub url: String,
    /// The CA that signed its serving certificate (PEM file).
    pub ca_file: PathBuf,
    pub admin_addr: String,
}

impl ExtenderProcess {
    /// Starts the extender for `upper` with a serving certificate from a CA made here,
    /// `extra` flags added, logging to `<upper dir>/multi-scheduler-<log_name>.log`.
    pub fn start(upper: &TestCluster, extra: &[String], log_name: &str) -> anyhow::Result<Self> {
        Self::start_as(upper, upper.kubeconfig(), extra, log_name)
    }

    /// As [`ExtenderProcess::start`], under the credential of `kubeconfig` (such as the
    /// chart's account, from [`crate::chart::component_identity`]).
    pub fn start_as(
        upper: &TestCluster,
        kubeconfig: &Path,
        extra: &[String],
        log_name: &str,
    ) -> anyhow::Result<Self> {
        let dir = upper.dir().join(format!("multi-scheduler-{log_name}"));
        std::fs::create_dir_all(&dir)?;
        let ca = Ca::new("tensile-extender-ca")?;
        let serving = ca.server("tensile-multi-scheduler", &[])?;
        let (ca_file, cert, key) = (dir.join("ca.crt"), dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&ca_file, ca.cert_pem())?;
        std::fs::write(&cert, &serving.cert_pem)?;
        std::fs::write(&key, &serving.key_pem)?;
        let port = free_port()?;
        let admin_addr = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            "--address=127.0.0.1".to_owned(),
            format!("--port={port}"),
            format!("--admin-addr={admin_addr}"),
            format!("--tls-cert-file={}", cert.display()),
            format!("--tls-private-key-file={}", key.display()),
        ];
        args.extend(extra.iter().cloned());
        let program = crate::bins::suite_binary("multi-scheduler")?;
        let log = upper.dir().join(format!("multi-scheduler-{log_name}.log"));
        let service = Service::start(&format!("multi-scheduler {log_name}"), &program, &args, &log)?;
        Ok(Self {
            service,
            url: format!("https://127.0.0.1:{port}"),
            ca_file,
            admin_addr,
        })
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) -> anyhow::Result<()> {
        wait_ready(&self.admin_addr, within)
            .await
            .map_err(|e| anyhow::anyhow!("{e}; log:\n{}", self.log()))
    }

    pub fn log(&self) -> String {
        self.service.log_tail(20_000)
    }
}

/// A running `multi-scheduler --mode=scheduler`.
pub struct StandaloneProcess {
    pub service: Service,
    pub admin_addr: String,
}

impl StandaloneProcess {
    /// Starts the standalone scheduler for `upper`, placing the pods that name
    /// `scheduler_name`, under the credential of `kubeconfig` (such as the chart's account)
    /// with `extra` flags, logging to `<upper dir>/multi-scheduler-<log_name>.log`.
    pub fn start(
        upper: &TestCluster,
        kubeconfig: &Path,
        scheduler_name: &str,
        extra: &[String],
        log_name: &str,
    ) -> anyhow::Result<Self> {
        let admin_addr = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec![
            "--mode=scheduler".to_owned(),
            format!("--scheduler-name={scheduler_name}"),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--admin-addr={admin_addr}"),
        ];
        args.extend(extra.iter().cloned());
        let program = crate::bins::suite_binary("multi-scheduler")?;
        let log = upper.dir().join(format!("multi-scheduler-{log_name}.log"));
        let service = Service::start(&format!("multi-scheduler {log_name}"), &program, &args, &log)?;
        Ok(Self { service, admin_addr })
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) -> anyhow::Result<()> {
        wait_ready(&self.admin_addr, within)
            .await
            .map_err(|e| anyhow::anyhow!("{e}; log:\n{}", self.service.log_tail(20_000)))
    }
}

async fn wait_ready(admin_addr: &str, within: Duration) -> crate::Result<()> {
    crate::wait::until(
        "the multi-scheduler ready",
        within,
        Duration::from_millis(200),
        || async {
            match crate::in_process::admin_get(admin_addr, "/readyz").await {
                Some((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

/// The shipped configuration `template` made ready for a test bed: the upper cluster's
/// kubeconfig, the extender's URL and CA, and no leader election (one scheduler, quick
/// start). Everything else (verbs, weight, nodeCacheCapable, ignorable) stays as shipped.
pub fn scheduler_config(
    template: &str,
    kubeconfig: &Path,
    url: &str,
    ca_file: &Path,
) -> anyhow::Result<String> {
    let mut config: serde_json::Value = serde_yaml::from_str(template)?;
    config["clientConnection"]["kubeconfig"] = kubeconfig.display().to_string().into();
    config["leaderElection"] = serde_json::json!({"leaderElect": false});
    let extender = config["extenders"]
        .get_mut(0)
        .ok_or_else(|| anyhow::anyhow!("the configuration has no extender"))?;
    extender["urlPrefix"] = url.into();
    extender["tlsConfig"]["caFile"] = ca_file.display().to_string().into();
    Ok(serde_yaml::to_string(&config)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_is_filled_in_and_keeps_its_extender_settings() {
        let text = scheduler_config(
            CONFIG_V1,
            Path::new("/k/upper.kubeconfig"),
            "https://127.0.0.1:1234",
            Path::new("/k/ca.crt"),
        )
        .unwrap();
        let config: serde_json::Value = serde_yaml::from_str(&text).unwrap();
        assert_eq!(config["apiVersion"], "kubescheduler.config.k8s.io/v1");
        assert_eq!(config["clientConnection"]["kubeconfig"], "/k/upper.kubeconfig");
        assert_eq!(config["leaderElection"]["leaderElect"], false);
        let extender = &config["extenders"][0];
        assert_eq!(extender["urlPrefix"], "https://127.0.0.1:1234");
        assert_eq!(extender["tlsConfig"]["caFile"], "/k/ca.crt");
        assert_eq!(extender["filterVerb"], "filter");
        assert_eq!(extender["nodeCacheCapable"], true);
        assert_eq!(config["profiles"][0]["schedulerName"], "tensile-scheduler");
    }
}
