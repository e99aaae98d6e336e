//! sessionflow-tools: the commands around the engine, not in it — the demo, load generation,
//! verification of a pipeline's output, dead-letter replay (and, in the `sessionflow` binary,
//! lag and topic creation).
//!
//! They live apart from the engine (`sessionflow_worker`) so that what a stage runs carries
//! none of their weight (progress bars, random laws, a mock broker's orchestration) and so that
//! the engine's own heap choices (its allocator) are not forced on them: a stage is
//! `sessionflow-worker run`, everything else is `sessionflow <tool>`. The tests and the bench
//! use [`loadgen`] and [`verify`] as a library.

pub mod demo;
pub mod loadgen;
pub mod replay;
pub mod verify;
