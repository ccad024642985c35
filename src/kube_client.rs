//! The one way every API-server user here gets its client: the kubeconfig
//! a config key names, else `$KUBECONFIG`, else the in-cluster service
//! account. Errors name the config key, so an operator knows what to fix.

use std::path::Path;

use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("no API server credentials (KUBECONFIG or in-cluster): {0}")]
    NoCredentials(kube::Error),
    #[error("config key `{key}` ({path}): {reason}")]
    Kubeconfig {
        key: &'static str,
        path: String,
        reason: String,
    },
}

/// A client from the kubeconfig at `path` (the value of config key `key`);
/// an empty path means `$KUBECONFIG`, else in-cluster.
pub async fn from_kubeconfig(path: &Path, key: &'static str) -> Result<Client, KubeClientError> {
    if path.as_os_str().is_empty() {
        return Client::try_default()
            .await
            .map_err(KubeClientError::NoCredentials);
    }
    let named = |e: &dyn std::fmt::Display| KubeClientError::Kubeconfig {
        key,
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let file = Kubeconfig::read_from(path).map_err(|e| named(&e))?;
    let config = kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| named(&e))?;
    Client::try_from(config).map_err(|e| named(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn error_of(path: &Path, key: &'static str) -> String {
        match from_kubeconfig(path, key).await {
            Ok(_) => panic!("{} gave a client", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn a_bad_kubeconfig_is_reported_under_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let e = error_of(&missing, "matcher.kubeconfig").await;
        assert!(
            e.starts_with("config key `matcher.kubeconfig` (") && e.contains("missing"),
            "{e}"
        );
        let garbled = dir.path().join("garbled");
        std::fs::write(&garbled, "not: [a kubeconfig").unwrap();
        let e = error_of(&garbled, "extender.kubeconfig").await;
        assert!(e.starts_with("config key `extender.kubeconfig` ("), "{e}");
    }
}
