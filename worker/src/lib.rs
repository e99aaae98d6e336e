//! sessionflow-worker: a Kafka stage that keeps per-session order while sessions run in
//! parallel.
//!
//! A record's path: the consumer loop ([`intake`]) takes it in a burst from its partition's
//! queue ([`partition_queues`], [`fetched`]) into a [`record`], tracks its offset
//! ([`offsets`], with the leader epoch it was read at: [`leader_epochs`], [`kafka_epoch`])
//! and hashes its session onto a dispatcher ([`routing`]), to which it hands the
//! turn's records as one batch ([`handoff`], [`dispatcher`]), parking them when the
//! dispatcher is full ([`backpressure`]); the
//! session's own task ([`session`]) runs the [`handler`], retrying in place ([`retry`]); the
//! [`producer`] writes the output or the dead letter ([`dlq`]) and reports the record done
//! ([`completion`]), and the consumer loop commits the contiguous watermark.

pub mod backpressure;
pub mod client_settings;
pub mod committer;
pub mod completion;
pub mod config;
pub mod demo;
pub mod dispatcher;
pub mod dlq;
pub mod fetched;
pub mod handler;
pub mod handoff;
pub mod health;
pub mod intake;
pub mod kafka_epoch;
pub mod lag;
pub mod leader_epochs;
pub mod loadgen;
pub mod mailbox;
pub mod membership;
pub mod memory;
pub mod metrics;
pub mod offset_map;
pub mod offsets;
pub mod partition_queues;
pub mod prefetch;
pub mod producer;
pub mod record;
pub mod replay;
pub mod retry;
pub mod routing;
pub mod session;
pub mod session_id;
pub mod session_timeout;
pub mod settle;
pub mod signal;
pub mod stuck;
pub mod telemetry;
pub mod topic_name;
pub mod topics;
pub mod verify;
pub mod watchdog;
pub mod worker;

pub use config::StageConfig;
pub use handler::{Handler, HandlerError, HandlerResult};
pub use record::InputRecord;
pub use worker::{run, start, RunningWorker};
