//! Writing a stage's results.
//!
//! [`producer`] writes output records and dead letters and reports the broker's answer; [`dlq`]
//! says what a dead letter carries; in `atLeastOnce` its writes go through a producer that a
//! refused write has replaced ([`producer_slot`]). When a record counts as done is the session's business
//! (`session::settle`), not the producer's. In `exactlyOnce` every write goes through the
//! transactional producer of its record's input partition ([`transactions`]), once
//! [`transaction_probe`] has found that the brokers take them; one fenced by another producer
//! with its transactional id is reported per partition ([`fenced`]).

pub mod dlq;
pub mod fenced;
pub mod producer;
pub mod producer_slot;
pub mod transaction_probe;
pub mod transactions;
