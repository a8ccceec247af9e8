//! The `descheduler` binary as a child process (so tests can kill it with -9 or run two
//! replicas), and the reading of its admin endpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::process::Service;
use crate::{TestCluster, free_port};

/// A running `descheduler`.
pub struct DeschedulerProcess {
    pub service: Service,
    pub admin_addr: String,
}

/// The descheduler's identity as the chart renders it for release `release` in namespace
/// `release` (`descheduler.barePods` = `bare_pods`), applied to `upper`: a kubeconfig holding
/// that account's token. The chart's exclusion records are then
/// `<release>-tensile-exclusions` in that namespace, and its election Lease
/// `tensile-descheduler` there.
pub async fn chart_identity(upper: &TestCluster, release: &str, bare_pods: &str) -> anyhow::Result<PathBuf> {
    let sets = [format!("descheduler.barePods={bare_pods}")];
    let account = format!("{release}-tensile-descheduler");
    Ok(crate::chart::component_identity(upper, "descheduler", release, release, &sets, &account).await?)
}

impl DeschedulerProcess {
    /// Starts `descheduler --kubeconfig <upper> --admin-addr <free port> EXTRA…`, logging to
    /// `<upper dir>/descheduler-<log_name>.log` (appended across restarts).
    pub fn start(upper: &TestCluster, extra: &[String], log_name: &str) -> anyhow::Result<Self> {
        Self::start_as(upper, upper.kubeconfig(), extra, log_name)
    }

    /// As [`DeschedulerProcess::start`], under the credential of `kubeconfig` (such as the
    /// chart's account, from [`chart_identity`]).
    pub fn start_as(
        upper: &TestCluster,
        kubeconfig: &Path,
        extra: &[String],
        log_name: &str,
    ) -> anyhow::Result<Self> {
        let admin_addr = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--admin-addr={admin_addr}"),
        ];
        args.extend(extra.iter().cloned());
        let program = crate::bins::suite_binary("descheduler")?;
        let log = upper.dir().join(format!("descheduler-{log_name}.log"));
        let service = Service::start(&format!("descheduler {log_name}"), &program, &args, &log)?;
        Ok(Self { service, admin_addr })
    }

    /// Sends `signal` (`TERM`, `KILL`, …) to the process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.service.pid().ok_or_else(|| anyhow::anyhow!("not running"))?;
        crate::process::signal(pid, signal).map_err(anyhow::Error::msg)
    }

    /// Starts it again with the same flags (after a kill).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.service.restart()?;
        Ok(())
    }

    /// `/metrics` as text (empty when it does not answer).
    pub async fn metrics(&self) -> String {
        crate::in_process::admin_get(&self.admin_addr, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// `/readyz`: status code and body.
    pub async fn readyz(&self) -> Option<(u16, String)> {
        crate::in_process::admin_get(&self.admin_addr, "/readyz").await
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, within: Duration) -> anyhow::Result<()> {
        self.wait_ready_saying("", within).await
    }

    /// Waits until `/readyz` answers 200 with a body containing `says` (`leading`, `standby`).
    pub async fn wait_ready_saying(&self, says: &str, within: Duration) -> anyhow::Result<()> {
        let result = crate::wait::until(
            &format!("the descheduler ready, saying {says:?}"),
            within,
            Duration::from_millis(200),
            || async {
                match self.readyz().await {
                    Some((200, body)) if body.contains(says) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
        result.map_err(|e| anyhow::anyhow!("{e}; log:\n{}", self.log()))
    }

    pub fn log(&self) -> String {
        self.service.log_tail(30_000)
    }

    pub fn log_path(&self) -> &Path {
        self.service.log_path()
    }
}

/// The sum of the samples of metric `name` (OpenMetrics text; a counter's `_total` suffix
/// included in `name`) whose labels include every `key="value"` of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, rest)) => (m, rest),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let all = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            all.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_match_on_name_and_labels() {
        let text = "# HELP x\n\
            tensile_descheduler_pods_moved_total{result=\"success\",reason=\"Unschedulable\",virtual_node=\"a\",namespace=\"n\"} 3\n\
            tensile_descheduler_pods_moved_total{result=\"dry_run\",reason=\"Unschedulable\",virtual_node=\"a\",namespace=\"n\"} 2\n\
            tensile_descheduler_cycles_total 7\n";
        let name = "tensile_descheduler_pods_moved_total";
        assert_eq!(metric_sum(text, name, &[("result", "success")]), 3.0);
        assert_eq!(metric_sum(text, name, &[]), 5.0);
        assert_eq!(metric_sum(text, "tensile_descheduler_cycles_total", &[]), 7.0);
        assert_eq!(metric_sum(text, name, &[("result", "error")]), 0.0);
    }
}
