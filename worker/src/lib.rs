//! sessionflow-worker: a Kafka stage that keeps per-session order while sessions run in
//! parallel.
//!
//! Where each path lives:
//!
//! - **A record**, in the order it meets the engine: the consumer loop ([`intake`], one thread)
//!   takes it in a burst from its partition's queue (`intake::partition_queues`,
//!   `intake::fetched`) into a [`record`], tracks its offset and the leader epoch it was read
//!   at (`commit::offsets`, `commit::leader_epochs`), and hashes its session onto a dispatcher
//!   ([`dispatch`]: `routing`, `handoff`, `dispatcher`, `backpressure`). The session's own task
//!   ([`session`]: `task`, `mailbox`) runs the [`handler`]; the result is written by the
//!   [`output`] producer (or as a dead letter, `output::dlq`) and settled
//!   (`session::settle`); the record comes back done over `commit::completion`.
//! - **A retry**: in place, the same record, in its session's task (`session::retry`,
//!   `session::stuck` for a handler that never returns).
//! - **A commit**: the consumer loop commits each partition's contiguous watermark, with the
//!   completed-offset map in the metadata ([`commit`]: `offsets`, `offset_map`, `committer`).
//!   In `delivery: exactlyOnce`, each partition's transaction commits them with its outputs
//!   (`intake::transactional`, `output::transactions`); a transaction that cannot commit is
//!   aborted and its partition rewound there.
//! - **A rebalance**: `intake::rebalance` (assign, revoke and drain, lost), on the books of
//!   `intake::book`; no write while the coordinator may have given us up ([`group`]).
//! - **A shutdown**: `intake::shutdown` (drain, final commit, leave the group), started by
//!   [`stage`], which wires the pieces together.
//! - **Around them**: the stage's [`config`], the Kafka clients' settings and topics
//!   ([`kafka`]), metrics, health, logs and memory ([`ops`]).
//!
//! The tools around a pipeline (the demo, loadgen, verify, dlq-replay) are another crate,
//! sessionflow-tools (`tools/`), and the allocator is the binary's choice (`ops::memory`).
//!
//! Modules import one way: [`record`] and [`config`] at the bottom, [`stage`] on top
//! (`tests/tests/house.rs` checks that no two modules import each other).

pub mod commit;
pub mod config;
pub mod dispatch;
pub mod group;
pub mod handler;
pub mod intake;
pub mod kafka;
pub mod ops;
pub mod output;
pub mod record;
pub mod session;
pub mod stage;

pub use config::StageConfig;
pub use handler::{Handler, HandlerError, HandlerResult};
pub use record::InputRecord;
pub use stage::{run, start, RunningWorker};
