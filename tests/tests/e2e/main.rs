//! End-to-end tests of the worker against a real Kafka-protocol broker (`make test` starts
//! one). One test binary, one module per guarantee; tests run in parallel, each on its own
//! topics and group.

mod backpressure;
mod commit_outage;
mod dead_letters;
mod exactly_once;
mod exactly_once_cluster;
mod fatal;
mod faults;
mod fenced;
mod handover;
mod http_handler;
mod isolation;
mod late_writes;
mod logs;
mod membership;
mod offset_map;
mod order;
mod otlp;
mod prefetch;
mod protocols;
mod purges;
mod rebalance;
mod replays;
mod restart;
mod secured;
mod shutdown;
mod slow_transaction_calls;
mod stuck;
mod trace_context;
mod transaction_probe;
mod truncation;

use sessionflow_tests::{brokers, Topics};
use sessionflow_tools::loadgen::{self, LoadgenOptions, SessionChoice};

/// Produces `per_session` numbered records for each of `sessions` sessions, interleaved.
pub async fn produce_round_robin(topics: &Topics, sessions: u64, per_session: u64) {
    let opts = LoadgenOptions {
        choice: SessionChoice::RoundRobin,
        ..LoadgenOptions::new(&brokers(), &topics.input, sessions * per_session, sessions)
    };
    loadgen::run(&opts).await.expect("loadgen");
}
