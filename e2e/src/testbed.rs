//! Several clusters with simulated nodes, as the `testbed` binary and the demo run them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{ClusterOptions, Etcd, NodeConfig, NodeSimulator, Result, SimulatorOptions, TestCluster, io_err};

/// One cluster of a test bed: its name and simulated nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpec {
    pub name: String,
    pub nodes: u32,
    pub cpu: String,
    pub memory: String,
    pub pods: String,
    /// The Kubernetes version it runs (`newest`, `oldest`, `1.MINOR`, `v1.MINOR.PATCH`); `None`
    /// is the default for its name ([`crate::bins::version_for`]).
    pub version: Option<String>,
}

impl ClusterSpec {
    /// Parses `NAME` or `NAME:nodes=N[,cpu=C][,memory=M][,pods=P][,version=V]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, rest) = s.split_once(':').unwrap_or((s, ""));
        let valid = !name.is_empty()
            && name.len() <= 40
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !name.starts_with('-')
            && !name.ends_with('-');
        if !valid {
            return Err(format!(
                "cluster name {name:?} must be 1-40 lowercase letters, digits or '-', not starting or ending with '-'"
            ));
        }
        let mut spec = ClusterSpec {
            name: name.to_owned(),
            nodes: 0,
            cpu: "4".into(),
            memory: "8Gi".into(),
            pods: "110".into(),
            version: None,
        };
        for item in rest.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} in {s:?} is not key=value"))?;
            match k {
                "nodes" => spec.nodes = v.parse().map_err(|_| format!("nodes={v:?} is not a count"))?,
                "cpu" => spec.cpu = quantity(k, v)?,
                "memory" => spec.memory = quantity(k, v)?,
                "pods" => {
                    spec.pods = v
                        .parse::<u32>()
                        .map(|n| n.to_string())
                        .map_err(|_| format!("pods={v:?} is not a count"))?
                }
                "version" => spec.version = Some(version(v)?),
                _ => {
                    return Err(format!(
                        "unknown key {k:?} in {s:?} (nodes, cpu, memory, pods, version)"
                    ));
                }
            }
        }
        Ok(spec)
    }

    /// The node configurations this spec asks for.
    pub fn node_configs(&self) -> Vec<NodeConfig> {
        (0..self.nodes)
            .map(|i| {
                NodeConfig::new(&format!("{}-node-{i}", self.name))
                    .resource("cpu", &self.cpu)
                    .resource("memory", &self.memory)
                    .resource("pods", &self.pods)
            })
            .collect()
    }
}

/// A version as the build script reads it: `newest`, `oldest`, `1.MINOR` or `v1.MINOR.PATCH`.
fn version(v: &str) -> Result<String, String> {
    let numbers: Vec<&str> = v.trim_start_matches('v').split('.').collect();
    let numeric = numbers
        .iter()
        .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if v == "newest" || v == "oldest" || (numeric && numbers[0] == "1" && (2..=3).contains(&numbers.len())) {
        Ok(v.to_owned())
    } else {
        Err(format!(
            "version={v:?} is not newest, oldest, 1.MINOR or v1.MINOR.PATCH"
        ))
    }
}

fn quantity(key: &str, v: &str) -> Result<String, String> {
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &v[digits.len()..];
    let ok_suffix = ["", "m", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"].contains(&suffix);
    if !digits.is_empty() && digits.parse::<f64>().is_ok() && ok_suffix {
        Ok(v.to_owned())
    } else {
        Err(format!(
            "{key}={v:?} is not a Kubernetes quantity (e.g. 4, 500m, 8Gi)"
        ))
    }
}

/// A running test bed: clusters and their simulators on one private etcd.
pub struct Testbed {
    dir: PathBuf,
    // Simulators before clusters: they stop before the apiservers go.
    members: Vec<(Option<NodeSimulator>, TestCluster)>,
    _etcd: Arc<Etcd>,
}

impl Testbed {
    /// Starts every cluster (in parallel) and its nodes; files go to `dir`.
    pub async fn up(dir: &Path, specs: &[ClusterSpec]) -> Result<Testbed> {
        let mut names = std::collections::HashSet::new();
        for s in specs {
            if !names.insert(&s.name) {
                return Err(crate::Error::Cluster {
                    cluster: s.name.clone(),
                    message: "named twice".into(),
                });
            }
        }
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let dir = dir.canonicalize().map_err(io_err(dir))?;
        let log_dir = dir.join("logs");
        let etcd = {
            let log_dir = log_dir.clone();
            Arc::new(
                tokio::task::spawn_blocking(move || Etcd::start(&log_dir))
                    .await
                    .map_err(|e| crate::Error::Etcd(e.to_string()))??,
            )
        };
        let starts = specs.iter().map(|spec| {
            let etcd = etcd.clone();
            let mut options = ClusterOptions::new("testbed", &spec.name);
            options.dir = log_dir.join(&spec.name);
            if let Some(version) = &spec.version {
                options.version = version.clone();
            }
            async move {
                let cluster = TestCluster::start_on(options, etcd).await?;
                let sim = if spec.nodes > 0 {
                    let client = cluster.client().await?;
                    let opts = SimulatorOptions::new(&spec.name, Some(cluster.kubelet_client_ca_pem()));
                    Some(NodeSimulator::start(client, opts, spec.node_configs()).await?)
                } else {
                    None
                };
                Ok::<_, crate::Error>((sim, cluster))
            }
        });
        let members = futures::future::try_join_all(starts).await?;
        for (_, cluster) in &members {
            let name = cluster.name();
            let kc = dir.join(format!("{name}.kubeconfig"));
            std::fs::copy(cluster.kubeconfig(), &kc).map_err(io_err(&kc))?;
            let ca = dir.join(format!("{name}.kubelet-client-ca.crt"));
            std::fs::copy(cluster.kubelet_client_ca_path(), &ca).map_err(io_err(&ca))?;
        }
        Ok(Testbed {
            dir,
            members,
            _etcd: etcd,
        })
    }

    /// The clusters, in the order they were asked for.
    pub fn clusters(&self) -> impl Iterator<Item = &TestCluster> {
        self.members.iter().map(|(_, c)| c)
    }

    /// The simulator of cluster `name`, if it has nodes.
    pub fn simulator(&self, name: &str) -> Option<&NodeSimulator> {
        self.members
            .iter()
            .find(|(_, c)| c.name() == name)
            .and_then(|(s, _)| s.as_ref())
    }

    /// Kubeconfig written for cluster `name`.
    pub fn kubeconfig(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.kubeconfig"))
    }

    /// The one line printed when the bed is ready.
    pub fn ready_line(&self) -> String {
        let list: Vec<String> = self
            .clusters()
            .map(|c| format!("{}={}", c.name(), self.kubeconfig(c.name()).display()))
            .collect();
        format!("testbed ready: {} (Ctrl-C to stop)", list.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_specs_parse() {
        let s = ClusterSpec::parse("lower-a:nodes=3,cpu=8,memory=16Gi").unwrap();
        assert_eq!(
            (s.name.as_str(), s.nodes, s.cpu.as_str(), s.memory.as_str()),
            ("lower-a", 3, "8", "16Gi")
        );
        assert_eq!(s.node_configs()[2].name, "lower-a-node-2");
        assert_eq!(ClusterSpec::parse("upper").unwrap().nodes, 0);
        assert_eq!(ClusterSpec::parse("upper").unwrap().version, None);
        for v in ["1.33", "v1.36.3", "oldest", "newest"] {
            let s = ClusterSpec::parse(&format!("lower-b:version={v}")).unwrap();
            assert_eq!(s.version.as_deref(), Some(v));
        }
        for (bad, needle) in [
            ("Upper", "lowercase"),
            ("", "lowercase"),
            ("a:nodes=x", "not a count"),
            ("a:cpu=lots", "quantity"),
            ("a:gpu=1", "unknown key"),
            ("a:nodes", "key=value"),
            ("a:version=latest", "not newest"),
            ("a:version=2.1", "not newest"),
            ("a:version=1.x", "not newest"),
        ] {
            let err = ClusterSpec::parse(bad).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }
}
