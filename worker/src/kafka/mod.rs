//! Reaching the cluster: one client-settings builder, and the topics.
//!
//! Every client the engine and its tools make (consumer, producer, admin, lag reader) starts from
//! [`client_settings`], so that a TLS or SASL setting given once reaches all of them;
//! [`topics`] creates and deletes topics with the partition counts a stage asks for.

pub mod client_settings;
pub mod topics;
