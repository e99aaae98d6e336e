//! One place that says how to reach the Kafka cluster: the bootstrap list and the client
//! properties (TLS, SASL, timeouts) every client of a stage or a tool shares.
//!
//! A cluster behind SASL_SSL needs the same half-dozen properties in each of its clients: the
//! stage's consumer and producer, its lag reporter, the operator's lag reader, and the tools
//! (`verify`, `lag`, `dlq-replay`, `loadgen`). Built in each place by hand, one of them is
//! forgotten and that client cannot connect; so each client starts from
//! [`ClientSettings::base`] and adds only what is its own (group id, delivery settings). The
//! tools read the same settings from `--kafka-config FILE` (librdkafka's `key=value`
//! properties format) and `-X key=value`, and from the environment's SASL credentials as the
//! worker does.

use std::collections::BTreeMap;
use std::path::Path;

use rdkafka::config::ClientConfig;

use crate::config::{SASL_PASSWORD_ENV, SASL_USERNAME_ENV};

/// The bootstrap list and the shared client properties of one cluster.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct ClientSettings {
    brokers: String,
    properties: BTreeMap<String, String>,
}

impl std::fmt::Debug for ClientSettings {
    /// The bootstrap list and the property names: never a value (passwords are among them).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSettings")
            .field("brokers", &self.brokers)
            .field("properties", &self.properties.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ClientSettings {
    /// Settings for `brokers` with no extra property (a plaintext cluster).
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            properties: BTreeMap::new(),
        }
    }

    /// Settings for `brokers` with `properties` (later keys win).
    pub fn with_properties<K: Into<String>, V: Into<String>>(
        brokers: impl Into<String>,
        properties: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let mut s = Self::new(brokers);
        for (k, v) in properties {
            s.properties.insert(k.into(), v.into());
        }
        s
    }

    /// The tools' settings: `--brokers`, then the properties of `--kafka-config` (if given),
    /// then each `-X key=value`, then SASL credentials from the environment where neither
    /// named them. A malformed line or pair is an error naming it.
    pub fn for_tool(
        brokers: &str,
        file: Option<&Path>,
        pairs: &[String],
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Self> {
        let mut s = Self::new(brokers);
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--kafka-config {}: {e}", path.display()))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let (k, v) = split_pair(line).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--kafka-config {} line {}: expected key=value, got {line:?}",
                        path.display(),
                        n + 1
                    )
                })?;
                s.properties.insert(k, v);
            }
        }
        for pair in pairs {
            let (k, v) = split_pair(pair)
                .ok_or_else(|| anyhow::anyhow!("-X {pair:?}: expected key=value"))?;
            s.properties.insert(k, v);
        }
        for (var, key) in [
            (SASL_USERNAME_ENV, "sasl.username"),
            (SASL_PASSWORD_ENV, "sasl.password"),
        ] {
            if !s.properties.contains_key(key) {
                if let Some(value) = env(var) {
                    s.properties.insert(key.into(), value);
                }
            }
        }
        Ok(s)
    }

    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The shared properties, in key order.
    pub fn properties(&self) -> impl Iterator<Item = (&str, &str)> {
        self.properties
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// A client configuration with the bootstrap list and every shared property: what each
    /// client starts from before it sets its own keys.
    pub fn base(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.brokers);
        c
    }
}

/// What holds a connection's settings (the operator's `Connection`) hands them to the readers
/// keyed by them (`commit::lag::LagReaders`).
impl AsRef<ClientSettings> for ClientSettings {
    fn as_ref(&self) -> &ClientSettings {
        self
    }
}

/// A plaintext cluster's bootstrap list: lets the tools' functions take `&str` as before.
impl From<&str> for ClientSettings {
    fn from(brokers: &str) -> Self {
        Self::new(brokers)
    }
}

impl From<&String> for ClientSettings {
    fn from(brokers: &String) -> Self {
        Self::new(brokers.as_str())
    }
}

impl From<&ClientSettings> for ClientSettings {
    fn from(settings: &ClientSettings) -> Self {
        settings.clone()
    }
}

fn split_pair(s: &str) -> Option<(String, String)> {
    let (k, v) = s.split_once('=')?;
    let k = k.trim();
    (!k.is_empty()).then(|| (k.to_string(), v.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_takes_the_file_then_the_pairs_then_the_environment() {
        let dir = std::env::temp_dir().join(format!("client-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("client.properties");
        std::fs::write(
            &file,
            "# a cluster behind SASL_SSL\nsecurity.protocol=SASL_SSL\nsasl.mechanism = SCRAM-SHA-512\nsasl.username=from-file\nssl.ca.location=/ca.pem\n",
        )
        .unwrap();
        let s = ClientSettings::for_tool(
            "b:9092",
            Some(&file),
            &["sasl.mechanism=PLAIN".into()],
            |var| (var == SASL_PASSWORD_ENV).then(|| "pw".to_string()),
        )
        .unwrap();
        let props: BTreeMap<_, _> = s.properties().collect();
        assert_eq!(props["security.protocol"], "SASL_SSL");
        assert_eq!(props["sasl.mechanism"], "PLAIN");
        assert_eq!(props["sasl.username"], "from-file");
        assert_eq!(props["sasl.password"], "pw");
        assert_eq!(props["ssl.ca.location"], "/ca.pem");
        let base = s.base();
        assert_eq!(base.get("bootstrap.servers"), Some("b:9092"));
        assert_eq!(base.get("security.protocol"), Some("SASL_SSL"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn malformed_settings_are_named() {
        let err = ClientSettings::for_tool("b", None, &["nokey".into()], |_| None).unwrap_err();
        assert!(err.to_string().contains("nokey"), "{err}");
        let missing = Path::new("/nonexistent/client.properties");
        let err = ClientSettings::for_tool("b", Some(missing), &[], |_| None).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/client.properties"),
            "{err}"
        );
    }
}
