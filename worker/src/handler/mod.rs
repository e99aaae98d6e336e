//! What a stage does with one record.
//!
//! The engine owns ordering, retries, output and offsets; a [`Handler`] only turns one record
//! into zero or one output payload, or says why it could not. The split of failures into
//! *transient* (retry the same record in place) and *poison* (straight to the DLQ) is the whole
//! error model: there is no retry state machine beyond the session task's loop.
//!
//! Two handlers ship with the worker image — [`http::HttpHandler`] and
//! [`builtin::BuiltinHandler`] — and Rust users implement [`Handler`] and call
//! [`crate::stage::run`] from their own binary.

pub mod builtin;
pub mod http;

use std::future::Future;

use crate::config::HandlerConfig;
use crate::record::InputRecord;

/// Why a record could not be processed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying: a timeout, an overloaded dependency.
    #[error("transient: {0}")]
    Transient(String),
    /// Never worth retrying: the record itself is bad.
    #[error("poison: {0}")]
    Poison(String),
}

/// The payload of the output record, or `None` for no output.
pub type HandlerResult = Result<Option<Vec<u8>>, HandlerError>;

/// Processes one record. Called once per attempt, never concurrently for one session.
pub trait Handler: Send + Sync + 'static {
    /// `attempt` starts at 1 and grows with each transient failure of the same record.
    fn handle(
        &self,
        record: &InputRecord,
        attempt: u32,
    ) -> impl Future<Output = HandlerResult> + Send;
}

/// The handlers a worker can run from its config alone.
pub enum ConfiguredHandler {
    Http(http::HttpHandler),
    Builtin(builtin::BuiltinHandler),
}

impl ConfiguredHandler {
    pub fn from_config(config: &HandlerConfig) -> anyhow::Result<Self> {
        Ok(match config {
            HandlerConfig::Http(c) => Self::Http(http::HttpHandler::new(c)?),
            HandlerConfig::Builtin(c) => Self::Builtin(builtin::BuiltinHandler::new(c.clone())),
        })
    }
}

impl Handler for ConfiguredHandler {
    async fn handle(&self, record: &InputRecord, attempt: u32) -> HandlerResult {
        match self {
            Self::Http(h) => h.handle(record, attempt).await,
            Self::Builtin(h) => h.handle(record, attempt).await,
        }
    }
}
