//! A pod's files on this host: the ConfigMaps and Secrets it names (waited for until they
//! exist), its volumes written under its folder, and its ServiceAccount credentials.
//!
//! Volumes: `configMap`, `secret`, `emptyDir`, and `projected` (what the ServiceAccount
//! admission adds as `kube-api-access-*`: the token, the cluster CA from `kube-root-ca.crt`,
//! the namespace). A mounted ConfigMap's bind addresses get the pod's host ports
//! ([`PortMap::rewrite`]). Anything else makes the pod fail to start, named.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::ResourceExt;
use serde_json::json;
use tokio::sync::watch;

use super::container::{field_value, volume_dir, Lookups, PortMap};
use super::pod::{Kubelet, Stop};

/// How long a pod waits for the ConfigMaps and Secrets it names to exist.
const LOOKUP_PATIENCE: Duration = Duration::from_secs(60);
/// How often a missing one is looked for again.
const RETRY: Duration = Duration::from_secs(1);

/// One pod's files, under its folder `dir`.
pub struct PodFiles<'a> {
    pub kubelet: &'a Kubelet,
    pub pod: &'a Pod,
    pub dir: &'a Path,
    /// Set once the pod is to stop: waiting for a missing object ends.
    pub stopped: &'a watch::Receiver<Option<Stop>>,
}

impl PodFiles<'_> {
    /// Writes the pod's volumes; returns each volume's local folder by name.
    pub fn write_volumes(
        &self,
        lookups: &Lookups,
        ports: &PortMap,
        token: Option<&str>,
    ) -> Result<BTreeMap<String, PathBuf>, String> {
        let spec = self.pod.spec.as_ref().ok_or("no spec")?;
        let mut volumes = BTreeMap::new();
        for v in spec.volumes.iter().flatten() {
            let dir = volume_dir(self.dir, &v.name);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let files = if let Some(cm) = &v.config_map {
                let data = lookups
                    .config_maps
                    .get(&cm.name)
                    .cloned()
                    .unwrap_or_default();
                // A mounted ConfigMap is where a bind address is configured: its ports mapped.
                let data = data
                    .into_iter()
                    .map(|(k, v)| match String::from_utf8(v) {
                        Ok(text) => (k, ports.rewrite(&text).into_bytes()),
                        Err(raw) => (k, raw.into_bytes()),
                    })
                    .collect();
                items(data, cm.items.as_deref())
            } else if let Some(secret) = &v.secret {
                let name = secret.secret_name.clone().unwrap_or_default();
                let data = lookups.secrets.get(&name).cloned().unwrap_or_default();
                items(data, secret.items.as_deref())
            } else if v.empty_dir.is_some() {
                Vec::new()
            } else if let Some(projected) = &v.projected {
                // What the ServiceAccount admission adds (kube-api-access-*): the token, the
                // cluster's CA (ConfigMap kube-root-ca.crt) and the namespace.
                let mut files = Vec::new();
                for source in projected.sources.iter().flatten() {
                    if let Some(t) = &source.service_account_token {
                        let token = token.ok_or("a projected token, but no ServiceAccount")?;
                        files.push((t.path.clone(), token.as_bytes().to_vec()));
                    } else if let Some(cm) = &source.config_map {
                        let data = lookups
                            .config_maps
                            .get(&cm.name)
                            .cloned()
                            .unwrap_or_default();
                        files.extend(items(data, cm.items.as_deref()));
                    } else if let Some(secret) = &source.secret {
                        let data = lookups
                            .secrets
                            .get(&secret.name)
                            .cloned()
                            .unwrap_or_default();
                        files.extend(items(data, secret.items.as_deref()));
                    } else if let Some(d) = &source.downward_api {
                        for item in d.items.iter().flatten() {
                            let field = item
                                .field_ref
                                .as_ref()
                                .ok_or("downwardAPI: only fieldRef")?;
                            let value = field_value(self.pod, &field.field_path)?;
                            files.push((item.path.clone(), value.into_bytes()));
                        }
                    } else {
                        return Err(format!("volume {:?}: unsupported projected source", v.name));
                    }
                }
                files
            } else {
                return Err(format!(
                    "volume {:?}: only configMap, secret, emptyDir and projected",
                    v.name
                ));
            };
            for (path, bytes) in files {
                write_file(&dir.join(path), &bytes)?;
            }
            volumes.insert(v.name.clone(), dir);
        }
        Ok(volumes)
    }

    /// The pod's ServiceAccount credentials, unless the pod opts out
    /// (`automountServiceAccountToken: false`): a token bound to this pod (TokenRequest, as
    /// the kubelet's projected volume gets it), written into a kubeconfig in the pod's folder
    /// that `KUBECONFIG` names. A real pod finds the token at
    /// /var/run/secrets/kubernetes.io/serviceaccount, which a local process cannot have;
    /// clients that look for a kubeconfig first (kube-rs, client-go) then use it the same way.
    /// The token is not renewed: it is valid for a day, longer than any test or demo.
    pub async fn service_account_token(&self) -> Result<Option<String>, String> {
        let spec = self.pod.spec.as_ref().ok_or("no spec")?;
        if spec.automount_service_account_token == Some(false) {
            return Ok(None);
        }
        let account = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let ns = self.pod.namespace().unwrap_or_default();
        let accounts: Api<ServiceAccount> = Api::namespaced(self.kubelet.client.clone(), &ns);
        let request: TokenRequest = serde_json::from_value(json!({
            "spec": {
                "audiences": [],
                "expirationSeconds": 86400,
                "boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod",
                    "name": self.pod.name_any(), "uid": self.pod.uid(),
                },
            },
        }))
        .map_err(|e| e.to_string())?;
        let token = accounts
            .create_token_request(&account, &PostParams::default(), &request)
            .await
            .map_err(|e| format!("a token of ServiceAccount {account}: {e}"))?
            .status
            .ok_or("TokenRequest: no status")?
            .token;
        Ok(Some(token))
    }

    /// The kubeconfig of [`Self::service_account_token`]'s token, in the pod's folder.
    pub fn write_kubeconfig(&self, token: &str) -> Result<PathBuf, String> {
        let spec = self.pod.spec.as_ref().ok_or("no spec")?;
        let account = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let ns = self.pod.namespace().unwrap_or_default();
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "cluster", "cluster": {
                "server": self.kubelet.server,
                "certificate-authority-data": self.kubelet.ca_data,
            }}],
            "users": [{ "name": account, "user": { "token": token } }],
            "contexts": [{ "name": "pod", "context": {
                "cluster": "cluster", "user": account, "namespace": ns,
            }}],
            "current-context": "pod",
        });
        let path = self.dir.join("serviceaccount.kubeconfig");
        write_file(&path, kubeconfig.to_string().as_bytes())?;
        Ok(path)
    }

    /// Every ConfigMap and Secret the pod names (volumes, env, envFrom), waited for when it does
    /// not exist yet (unless optional).
    pub async fn lookups(&self) -> Result<Lookups, String> {
        let spec = self.pod.spec.as_ref().ok_or("no spec")?;
        let mut config_maps = Vec::new();
        let mut secrets = Vec::new();
        for v in spec.volumes.iter().flatten() {
            if let Some(cm) = &v.config_map {
                config_maps.push((cm.name.clone(), cm.optional == Some(true)));
            }
            if let Some(s) = &v.secret {
                let name = s.secret_name.clone().unwrap_or_default();
                secrets.push((name, s.optional == Some(true)));
            }
        }
        for source in spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.projected.as_ref())
            .flat_map(|p| p.sources.iter().flatten())
        {
            if let Some(cm) = &source.config_map {
                config_maps.push((cm.name.clone(), cm.optional == Some(true)));
            }
            if let Some(s) = &source.secret {
                secrets.push((s.name.clone(), s.optional == Some(true)));
            }
        }
        for c in &spec.containers {
            for e in c.env.iter().flatten().filter_map(|e| e.value_from.as_ref()) {
                if let Some(r) = &e.config_map_key_ref {
                    config_maps.push((r.name.clone(), r.optional == Some(true)));
                }
                if let Some(r) = &e.secret_key_ref {
                    secrets.push((r.name.clone(), r.optional == Some(true)));
                }
            }
            for from in c.env_from.iter().flatten() {
                if let Some(r) = &from.config_map_ref {
                    config_maps.push((r.name.clone(), r.optional == Some(true)));
                }
                if let Some(r) = &from.secret_ref {
                    secrets.push((r.name.clone(), r.optional == Some(true)));
                }
            }
        }
        let ns = self.pod.namespace().unwrap_or_default();
        let cms: Api<ConfigMap> = Api::namespaced(self.kubelet.client.clone(), &ns);
        let sec: Api<Secret> = Api::namespaced(self.kubelet.client.clone(), &ns);
        let mut lookups = Lookups::default();
        let deadline = Instant::now() + LOOKUP_PATIENCE;
        for (name, optional) in config_maps {
            let found = self
                .wait_for(&name, optional, deadline, || cms.get_opt(&name))
                .await?;
            if let Some(cm) = found {
                let mut data: BTreeMap<String, Vec<u8>> = cm
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                data.extend(
                    cm.binary_data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0)),
                );
                lookups.config_maps.insert(name, data);
            }
        }
        for (name, optional) in secrets {
            let found = self
                .wait_for(&name, optional, deadline, || sec.get_opt(&name))
                .await?;
            if let Some(s) = found {
                let mut data: BTreeMap<String, Vec<u8>> = s
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect();
                data.extend(
                    s.string_data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.into_bytes())),
                );
                lookups.secrets.insert(name, data);
            }
        }
        Ok(lookups)
    }

    async fn wait_for<T, F, Fut>(
        &self,
        name: &str,
        optional: bool,
        deadline: Instant,
        mut get: F,
    ) -> Result<Option<T>, String>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = kube::Result<Option<T>>>,
    {
        loop {
            match get().await {
                Ok(Some(found)) => return Ok(Some(found)),
                Ok(None) if optional => return Ok(None),
                Ok(None) => {}
                Err(e) => eprintln!("test-kubelet: reading {name}: {e}"),
            }
            if Instant::now() > deadline || self.stopped.borrow().is_some() {
                return Err(format!("{name} not found"));
            }
            tokio::time::sleep(RETRY).await;
        }
    }
}

/// A volume's files: every key, or only the listed `items` at their paths.
fn items(
    data: BTreeMap<String, Vec<u8>>,
    items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>,
) -> Vec<(String, Vec<u8>)> {
    match items {
        Some(items) if !items.is_empty() => items
            .iter()
            .filter_map(|i| Some((i.path.clone(), data.get(&i.key)?.clone())))
            .collect(),
        _ => data.into_iter().collect(),
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}
