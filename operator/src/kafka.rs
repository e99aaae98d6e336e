//! The operator's own Kafka clients: topic creation and lag reading, with the pipeline's
//! credentials.
//!
//! Workers get credentials as environment variables and mounted files; the operator reads the
//! same Secrets through the API — only those labelled [`CREDENTIALS_LABEL`]`: "true"` — and hands the values to librdkafka directly (`sasl.*`,
//! `ssl.*.pem`). Lag is read without joining the stage's group (committed offsets and
//! watermarks only), so paused, stalled or absent workers do not change what is measured.
//! Lag readers are kept between autoscaling passes ([`LagReaders`], the engine's
//! `commit::lag` readers, which the tools use too): a librdkafka client costs threads and
//! broker connections, too much to create for every stage on every pass. librdkafka calls
//! block, so they run on the blocking pool; a read the autoscaler stopped waiting for (its
//! deadline passed) still holds its reader until librdkafka gives up, and the reader refuses to
//! start a second read meanwhile, so an unreachable cluster costs one blocking thread per stage,
//! not one more every pass.

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use sessionflow_worker::commit::lag::PartitionLag;
pub use sessionflow_worker::commit::lag::{LagReader, LagReaders};
use sessionflow_worker::kafka::client_settings::ClientSettings;
use sessionflow_worker::kafka::topics::{self, TopicRequest};

use crate::crd::{KafkaSpec, TopicsSpec};

/// Everything a client of one pipeline needs: bootstrap servers, properties, secrets (the
/// worker's [`ClientSettings`], which never prints a value).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Connection {
    settings: ClientSettings,
}

/// A Secret or one of its entries is missing.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("secret {secret}: {source}")]
    Read {
        secret: String,
        #[source]
        source: kube::Error,
    },
    #[error("secret {secret} has no entry {key:?}")]
    MissingKey { secret: String, key: String },
    #[error(
        "secret {secret} is not labelled {CREDENTIALS_LABEL}: \"true\"; the operator reads only \
         Secrets that opt in (kubectl label secret {secret} {CREDENTIALS_LABEL}=true)"
    )]
    NotOptedIn { secret: String },
    #[error(
        "SASL PLAIN without TLS sends the password in clear text: add kafka.tls, or set \
         kafka.sasl.allowPlainWithoutTls: true"
    )]
    PlainWithoutTls,
}

/// The label a Secret must carry (value `"true"`) for the operator to read it. Without it, the
/// permission to create a SessionPipeline would be a way to make the operator read any Secret
/// of the namespace and send it to a broker of the creator's choosing.
pub const CREDENTIALS_LABEL: &str = "sessionflow.io/credentials";

/// The Secrets `kafka` refers to (SASL first, then TLS), read from `namespace`: each must opt
/// in with [`CREDENTIALS_LABEL`]; SASL PLAIN without TLS is refused unless the spec allows it.
pub async fn credential_secrets(
    client: &Client,
    namespace: &str,
    kafka: &KafkaSpec,
) -> Result<Vec<Secret>, CredentialError> {
    if kafka.insecure_plain() {
        return Err(CredentialError::PlainWithoutTls);
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut out = Vec::new();
    let names = [
        kafka.sasl.as_ref().map(|s| &s.secret_name),
        kafka.tls.as_ref().map(|t| &t.secret_name),
    ];
    for name in names.into_iter().flatten() {
        let secret = read(&secrets, name).await?;
        let opted_in = secret
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(CREDENTIALS_LABEL));
        if opted_in.map(String::as_str) != Some("true") {
            return Err(CredentialError::NotOptedIn {
                secret: name.clone(),
            });
        }
        out.push(secret);
    }
    Ok(out)
}

impl Connection {
    /// Reads the Secrets `kafka` refers to in `namespace` ([`credential_secrets`]) and builds
    /// the connection.
    pub async fn resolve(
        client: &Client,
        namespace: &str,
        kafka: &KafkaSpec,
    ) -> Result<Self, CredentialError> {
        let mut secrets = credential_secrets(client, namespace, kafka)
            .await?
            .into_iter();
        let mut properties = kafka.security_properties();
        if let Some(sasl) = &kafka.sasl {
            let secret = secrets.next().expect("one Secret per reference");
            properties.insert("sasl.username".into(), entry(&secret, &sasl.username_key)?);
            properties.insert("sasl.password".into(), entry(&secret, &sasl.password_key)?);
        }
        if let Some(tls) = &kafka.tls {
            let secret = secrets.next().expect("one Secret per reference");
            properties.insert("ssl.ca.pem".into(), entry(&secret, &tls.ca_key)?);
            if let (Some(cert), Some(key)) = (&tls.cert_key, &tls.key_key) {
                properties.insert("ssl.certificate.pem".into(), entry(&secret, cert)?);
                properties.insert("ssl.key.pem".into(), entry(&secret, key)?);
            }
        }
        Ok(Self {
            settings: ClientSettings::with_properties(kafka.bootstrap_servers.clone(), properties),
        })
    }

    /// A plain connection to `bootstrap` (no credentials), e.g. for tests and local runs.
    pub fn plain(bootstrap: &str) -> Self {
        Self::with(ClientSettings::new(bootstrap))
    }

    /// A connection with these settings (e.g. a test's SASL_SSL cluster).
    pub fn with(settings: ClientSettings) -> Self {
        Self { settings }
    }

    fn config(&self) -> ClientConfig {
        self.settings.base()
    }

    /// Creates the declared topics that are missing; returns the ones created.
    pub async fn ensure_topics(&self, topics: &TopicsSpec) -> anyhow::Result<Vec<String>> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let requests: Vec<TopicRequest> = topics
            .declared
            .iter()
            .map(|t| TopicRequest {
                name: t.name.clone(),
                partitions: t.partitions,
                replication: t.replication_factor.unwrap_or(-1),
            })
            .collect();
        topics::create_missing(&admin, &requests).await
    }

    /// Lag of `group` on every partition of `topic`, with a client made for this one read.
    pub async fn read_lag(&self, group: &str, topic: &str) -> anyhow::Result<Vec<PartitionLag>> {
        self.lag_reader(group)?.read(topic).await
    }

    /// A client that reads `group`'s lag without joining the group.
    pub fn lag_reader(&self, group: &str) -> anyhow::Result<LagReader> {
        LagReader::new(&self.settings, group)
    }
}

/// The key of a connection's lag readers ([`LagReaders::get`]): its settings.
impl AsRef<ClientSettings> for Connection {
    fn as_ref(&self) -> &ClientSettings {
        &self.settings
    }
}

async fn read(secrets: &Api<Secret>, name: &str) -> Result<Secret, CredentialError> {
    secrets
        .get(name)
        .await
        .map_err(|source| CredentialError::Read {
            secret: name.to_string(),
            source,
        })
}

fn entry(secret: &Secret, key: &str) -> Result<String, CredentialError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .cloned()
        })
        .ok_or(CredentialError::MissingKey {
            secret: name,
            key: key.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_are_kept_per_connection_and_group_and_dropped_when_unused() {
        // Nothing listens there: making a client does not need a broker.
        let a = Connection::plain("127.0.0.1:1");
        let b = Connection::plain("127.0.0.1:2");
        let mut readers = LagReaders::default();
        readers.get(&a, "g1").unwrap();
        readers.get(&a, "g1").unwrap();
        readers.get(&a, "g2").unwrap();
        readers.get(&b, "g1").unwrap();
        assert_eq!((readers.kept(), readers.created()), (3, 3));
        readers.forget_unused();
        assert_eq!(readers.kept(), 3, "all three were used in that pass");
        readers.get(&a, "g1").unwrap();
        readers.forget_unused();
        assert_eq!(readers.kept(), 1, "only a/g1 was used in the last pass");
        readers.get(&a, "g1").unwrap();
        assert_eq!(readers.created(), 3, "a kept reader is not made again");
    }
}
