//! A `SessionPipeline` the operator cannot run, with the field at fault.
//!
//! Every check that refuses a spec ([`crate::render`], [`crate::pod`]) returns this one type,
//! so the reconciler reports any of them the same way (`Degraded`, reason `InvalidSpec`, the
//! field first in the message) and `sessionflow-operator render` exits 2 naming the field.

/// A spec the operator cannot run, with the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    pub field: String,
    pub message: String,
}

impl SpecError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}
