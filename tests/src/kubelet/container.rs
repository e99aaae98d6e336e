//! A pod's container as a local process: which program, with which arguments, environment and
//! readiness probe. Pure: what the API server holds (ConfigMaps, Secrets) comes in already
//! fetched ([`Lookups`]), so the whole mapping reads in one place.
//!
//! A real kubelet gives each pod a network namespace and each container a filesystem; here all
//! pods share the host. So the test kubelet maps, and says how:
//! - **the image** to a local binary: the image's name (registry, path and tag dropped:
//!   `ghcr.io/sessionflow/sessionflow-worker:0.1.0` → `sessionflow-worker`) is looked up in
//!   [`Entrypoints`]; a container's `command[0]` is looked up the same way, else run as given;
//! - **mount paths** to local folders: every argument and environment value that starts with a
//!   volume's `mountPath` gets the local folder of that volume instead
//!   (`/etc/sessionflow/stage.yaml` → `<pod dir>/volumes/config/stage.yaml`);
//! - **container ports** to host ports: each declared `containerPort` P gets a free port H of
//!   its own, and the bind address `0.0.0.0:P` in arguments, environment values and mounted
//!   ConfigMap files becomes `127.0.0.1:H` (the worker reads `metricsAddr: 0.0.0.0:9090` from
//!   its ConfigMap); probes of P (by number or by name) go to H. Two pods of one stage on one
//!   host therefore never collide.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Image (or command) name → the local binary that stands for it.
#[derive(Debug, Clone, Default)]
pub struct Entrypoints(pub BTreeMap<String, PathBuf>);

impl Entrypoints {
    /// The binary for `image`, by the image's bare name.
    pub fn of_image(&self, image: &str) -> Option<&PathBuf> {
        self.0.get(bare_name(image))
    }
}

/// `registry/path/name:tag@digest` → `name`.
pub fn bare_name(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    last.split(':').next().unwrap_or(last)
}

/// The ConfigMaps and Secrets a pod refers to, by name: key → bytes.
#[derive(Debug, Clone, Default)]
pub struct Lookups {
    pub config_maps: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    pub secrets: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
}

/// The host-side rewrites of one pod: its ports, and per container its mounts.
#[derive(Debug, Clone, Default)]
pub struct PortMap {
    /// (container port, host port, port name).
    pub ports: Vec<(i32, u16, Option<String>)>,
}

impl PortMap {
    /// `0.0.0.0:P` → `127.0.0.1:H` for every mapped port.
    pub fn rewrite(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (container, host, _) in &self.ports {
            out = out.replace(
                &format!("0.0.0.0:{container}"),
                &format!("127.0.0.1:{host}"),
            );
        }
        out
    }

    fn host_port(&self, port: &IntOrString) -> Option<u16> {
        self.ports
            .iter()
            .find(|(c, _, name)| match port {
                IntOrString::Int(p) => c == p,
                IntOrString::String(n) => name.as_deref() == Some(n.as_str()),
            })
            .map(|(_, h, _)| *h)
    }
}

/// One container, ready to spawn.
#[derive(Debug, Clone)]
pub struct LocalContainer {
    pub name: String,
    pub image: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// `httpGet` readiness probe: (host port, path). `None`: ready while running.
    pub readiness: Option<(u16, String)>,
}

impl LocalContainer {
    /// Maps `container` of `pod`; `volumes` are the local folders of the pod's volumes by name.
    /// An error names what cannot be mapped (the pod is then reported as failing to start).
    pub fn new(
        pod: &Pod,
        container: &Container,
        volumes: &BTreeMap<String, PathBuf>,
        ports: &PortMap,
        entrypoints: &Entrypoints,
        lookups: &Lookups,
    ) -> Result<Self, String> {
        let image = container.image.clone().unwrap_or_default();
        // Mount path → local folder, longest first so that nested mounts win.
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for m in container.volume_mounts.iter().flatten() {
            let local = volumes
                .get(&m.name)
                .ok_or_else(|| format!("volumeMount {:?}: no such volume", m.name))?;
            let local = match &m.sub_path {
                Some(sub) if !sub.is_empty() => local.join(sub),
                _ => local.clone(),
            };
            mounts.push((m.mount_path.trim_end_matches('/').to_string(), local));
        }
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        let rewrite = |text: &str| ports.rewrite(&rewrite_paths(text, &mounts));

        let command = container.command.clone().unwrap_or_default();
        let (program, mut args) = match command.split_first() {
            Some((first, rest)) => (
                entrypoints
                    .of_image(first)
                    .cloned()
                    .unwrap_or_else(|| PathBuf::from(rewrite(first))),
                rest.to_vec(),
            ),
            None => (
                entrypoints.of_image(&image).cloned().ok_or_else(|| {
                    format!(
                        "image {image:?}: no local binary for {:?} (--entrypoint NAME=PATH)",
                        bare_name(&image)
                    )
                })?,
                Vec::new(),
            ),
        };
        args.extend(container.args.iter().flatten().cloned());
        let args = args.iter().map(|a| rewrite(a)).collect();

        let mut env = Vec::new();
        for from in container.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            let source = if let Some(r) = &from.config_map_ref {
                lookups.config_maps.get(&r.name)
            } else if let Some(r) = &from.secret_ref {
                lookups.secrets.get(&r.name)
            } else {
                None
            };
            for (k, v) in source.into_iter().flatten() {
                env.push((
                    format!("{prefix}{k}"),
                    String::from_utf8_lossy(v).into_owned(),
                ));
            }
        }
        for e in container.env.iter().flatten() {
            let value = match &e.value_from {
                None => e.value.clone().unwrap_or_default(),
                Some(from) => env_source(pod, from, lookups)
                    .map_err(|why| format!("env {:?}: {why}", e.name))?,
            };
            env.push((e.name.clone(), rewrite(&value)));
        }

        let readiness = match container.readiness_probe.as_ref() {
            Some(probe) => match &probe.http_get {
                Some(get) => Some((
                    ports.host_port(&get.port).ok_or_else(|| {
                        format!("readinessProbe: port {:?} is not declared", get.port)
                    })?,
                    get.path.clone().unwrap_or_else(|| "/".into()),
                )),
                None => return Err("readinessProbe: only httpGet is supported".into()),
            },
            None => None,
        };
        Ok(LocalContainer {
            name: container.name.clone(),
            image,
            program,
            args,
            env,
            readiness,
        })
    }
}

/// Every occurrence of a mount path at the start of `text` (or after `=`, as in
/// `--config=/etc/...`) replaced by the mount's local folder.
fn rewrite_paths(text: &str, mounts: &[(String, PathBuf)]) -> String {
    let (head, path) = match text.split_once('=') {
        Some((flag, value)) if flag.starts_with('-') => (format!("{flag}="), value),
        _ => (String::new(), text),
    };
    for (mount, local) in mounts {
        if path == mount {
            return format!("{head}{}", local.display());
        }
        if let Some(rest) = path.strip_prefix(&format!("{mount}/")) {
            return format!("{head}{}", local.join(rest).display());
        }
    }
    text.to_string()
}

fn env_source(
    pod: &Pod,
    from: &k8s_openapi::api::core::v1::EnvVarSource,
    lookups: &Lookups,
) -> Result<String, String> {
    let key_of = |maps: &BTreeMap<String, BTreeMap<String, Vec<u8>>>,
                  name: &str,
                  key: &str,
                  optional: Option<bool>| {
        match maps.get(name).and_then(|m| m.get(key)) {
            Some(v) => Ok(String::from_utf8_lossy(v).into_owned()),
            None if optional == Some(true) => Ok(String::new()),
            None => Err(format!("{name}/{key} not found")),
        }
    };
    if let Some(f) = &from.field_ref {
        return field_value(pod, &f.field_path);
    }
    if let Some(r) = &from.config_map_key_ref {
        return key_of(&lookups.config_maps, &r.name, &r.key, r.optional);
    }
    if let Some(r) = &from.secret_key_ref {
        return key_of(&lookups.secrets, &r.name, &r.key, r.optional);
    }
    Err("only fieldRef, configMapKeyRef and secretKeyRef are supported".into())
}

/// A pod field as the downward API gives it (env `fieldRef`, downwardAPI volumes).
pub fn field_value(pod: &Pod, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.hostIP" => "127.0.0.1".into(),
        other => {
            let label = |prefix: &str, map: &Option<BTreeMap<String, String>>| {
                let key = other.strip_prefix(prefix)?.strip_suffix("']")?;
                Some(map.as_ref()?.get(key).cloned().unwrap_or_default())
            };
            label("metadata.labels['", &meta.labels)
                .or_else(|| label("metadata.annotations['", &meta.annotations))
                .ok_or_else(|| format!("fieldRef {other} is not supported"))?
        }
    })
}

/// The local folder of volume `name` under a pod's folder.
pub fn volume_dir(pod_dir: &Path, name: &str) -> PathBuf {
    pod_dir.join("volumes").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_are_bare() {
        assert_eq!(
            bare_name("ghcr.io/sessionflow/sessionflow-worker:0.1.0"),
            "sessionflow-worker"
        );
        assert_eq!(
            bare_name("sessionflow-worker@sha256:ab"),
            "sessionflow-worker"
        );
        assert_eq!(bare_name("localhost:5000/x/y"), "y");
    }

    #[test]
    fn mount_paths_and_bind_addresses_are_rewritten() {
        let mounts = vec![(
            "/etc/sessionflow".to_string(),
            PathBuf::from("/tmp/p/config"),
        )];
        assert_eq!(
            rewrite_paths("/etc/sessionflow/stage.yaml", &mounts),
            "/tmp/p/config/stage.yaml"
        );
        assert_eq!(
            rewrite_paths("--config=/etc/sessionflow/stage.yaml", &mounts),
            "--config=/tmp/p/config/stage.yaml"
        );
        assert_eq!(
            rewrite_paths("/etc/sessionflowx", &mounts),
            "/etc/sessionflowx"
        );
        let ports = PortMap {
            ports: vec![(9090, 41000, Some("metrics".into()))],
        };
        assert_eq!(
            ports.rewrite("metricsAddr: 0.0.0.0:9090\n"),
            "metricsAddr: 127.0.0.1:41000\n"
        );
        assert_eq!(
            ports.host_port(&IntOrString::String("metrics".into())),
            Some(41000)
        );
        assert_eq!(ports.host_port(&IntOrString::Int(9090)), Some(41000));
    }
}
