//! Building a [`kube::Client`] from an explicit kubeconfig file.
//!
//! A missing or broken kubeconfig is an error that names the file; there is no silent
//! fallback to another configuration source.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubeconfig {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path}: not usable: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path}: cannot build a client: {source}")]
    Client {
        path: PathBuf,
        #[source]
        source: kube::Error,
    },
}

/// Client settings applied on top of what the kubeconfig says.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    /// The context to use instead of the kubeconfig's current one.
    pub context: Option<String>,
    /// Per-request read timeout; `None` keeps kube's default.
    pub read_timeout: Option<std::time::Duration>,
}

/// Loads `path` and returns the [`kube::Config`] it describes.
pub async fn config_from_file(path: &Path, options: &ClientOptions) -> Result<kube::Config, Error> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })?;
    let opts = KubeConfigOptions {
        context: options.context.clone(),
        ..Default::default()
    };
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &opts)
        .await
        .map_err(|source| Error::Invalid {
            path: path.to_owned(),
            source,
        })?;
    if let Some(timeout) = options.read_timeout {
        config.read_timeout = Some(timeout);
    }
    Ok(config)
}

/// Loads `path` and builds a client for it.
pub async fn client_from_file(path: &Path, options: &ClientOptions) -> Result<kube::Client, Error> {
    let config = config_from_file(path, options).await?;
    kube::Client::try_from(config).map_err(|source| Error::Client {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_kubeconfig_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.kubeconfig");
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        let msg = err.to_string();
        assert!(msg.contains("nope.kubeconfig"), "{msg}");
        assert!(msg.contains("cannot read"), "{msg}");
    }

    #[tokio::test]
    async fn a_malformed_kubeconfig_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.kubeconfig");
        std::fs::write(&path, "clusters: [this is not: a kubeconfig").unwrap();
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        assert!(err.to_string().contains("bad.kubeconfig"), "{err}");
    }

    #[tokio::test]
    async fn a_kubeconfig_without_a_context_is_not_usable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.kubeconfig");
        std::fs::write(&path, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        let msg = err.to_string();
        assert!(
            msg.contains("empty.kubeconfig") && msg.contains("not usable"),
            "{msg}"
        );
    }
}
