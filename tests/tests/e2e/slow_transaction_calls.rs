//! One partition's transaction call waiting on the broker must not stop the others' writes.
//!
//! In `exactlyOnce` each input partition has its own transactional producer, kept in one map
//! that every write looks its producer up in (`Transactions::producer`). A call that goes to the
//! broker — a partition's abort as it leaves, the destruction of its client — takes as long as
//! the broker does (up to the call's 30 s timeout, or a connection's), so it must not run under
//! that map's lock: until 6 Dec the close of a leaving partition did, and every write of the
//! stage, on every partition it kept, waited for the leaving one's abort.
//!
//! The test's broker sits behind a relay (`sessionflow_tests::relay`) that holds the
//! transaction coordinator's `EndTxn`: partition 0's abort is on the wire and unanswered for as
//! long as the test likes, and partition 1's writes must go on meanwhile; and when a revocation
//! closes both partitions, their aborts wait together, not one after the other.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::client::DefaultClientContext;
use rdkafka::producer::FutureRecord;
use sessionflow_tests::relay::{broker_behind_relay, END_TXN};
use sessionflow_tests::{unique, wait_until};
use sessionflow_worker::output::producer::transactional_producer_config;
use sessionflow_worker::output::transactions::Transactions;

/// Ports of this test's broker: 19560 … 19563, the relay on 19563 (see `late_writes.rs` for
/// the other tests' ports; that one's are 19530 … 19553).
const PORT: u16 = 19560;
/// How long the test waits for what must happen (a failure, not a speed, if it runs out).
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_abort_waiting_on_the_broker_holds_up_no_other_partition() {
    let (relay, cluster) = broker_behind_relay(PORT).await;
    let (input, output, group) = (
        unique("slow-calls-in"),
        unique("slow-calls-out"),
        unique("slow-calls"),
    );
    cluster.create_topics(&[(&input, 2), (&output, 2)]).await;
    let config = transactional_producer_config(&cluster.bootstrap, &[]);
    let transactions = Arc::new(Transactions::new(
        config,
        &group,
        &input,
        DefaultClientContext,
    ));
    tokio::task::block_in_place(|| {
        transactions.open(0).expect("open partition 0's producer");
        transactions.open(1).expect("open partition 1's producer");
    });
    // Partition 0's transaction has a write, so that its abort goes to the broker (an empty
    // one is ended by the client alone).
    write(&transactions, 0, &output).await;

    relay.hold(&[END_TXN]);
    let leaving = transactions.clone();
    let close = tokio::task::spawn_blocking(move || leaving.abort_and_close(0));
    wait_until(WAIT, || relay.requests_seen(END_TXN) == 1)
        .await
        .expect("partition 0's abort reaches the wire");

    // Partition 0's abort waits for its answer, or for its own timeout (30 s), whichever
    // comes first; partition 1's write must not wait for either.
    write(&transactions, 1, &output).await;
    let written_while_closing = !close.is_finished();
    relay.release(&[END_TXN]);
    close
        .await
        .expect("the close returns once the abort is answered");
    tokio::task::block_in_place(|| transactions.abort_all());
    assert!(
        written_while_closing,
        "partition 1's write waited until partition 0's close had returned"
    );
    assert!(
        transactions.producer(0).is_none(),
        "partition 0's producer is closed"
    );

    // A revocation (or a stop) closes its partitions together: both aborts are on the wire
    // at once. One after another, the second would be sent only once the first is answered,
    // or has timed out (30 s, longer than this wait).
    tokio::task::block_in_place(|| transactions.open(0)).expect("open partition 0 again");
    tokio::task::block_in_place(|| transactions.open(1)).expect("open partition 1 again");
    write(&transactions, 0, &output).await;
    write(&transactions, 1, &output).await;
    relay.hold(&[END_TXN]);
    let seen = relay.requests_seen(END_TXN);
    let leaving = transactions.clone();
    let close = tokio::task::spawn_blocking(move || leaving.close_each(vec![0, 1]));
    let together = wait_until(Duration::from_secs(20), || {
        relay.requests_seen(END_TXN) == seen + 2
    })
    .await;
    relay.release(&[END_TXN]);
    close
        .await
        .expect("the closes return once the aborts are answered");
    assert!(
        together.is_ok(),
        "the two partitions' aborts were not on the wire at the same time"
    );
}

/// Writes a record to `output`'s `partition` with `partition`'s producer; returns once it is
/// stored. The producer is looked up as every write looks it up, off the runtime's workers
/// (the lookup may block on the map's lock).
async fn write(
    transactions: &Arc<Transactions<DefaultClientContext>>,
    partition: i32,
    output: &str,
) {
    let lookup = transactions.clone();
    let producer = tokio::task::spawn_blocking(move || lookup.producer(partition))
        .await
        .expect("the lookup returns")
        .expect("the partition's producer is open");
    let record = FutureRecord::<(), str>::to(output)
        .partition(partition)
        .payload("a result");
    producer
        .send(record, WAIT)
        .await
        .map_err(|(e, _)| e)
        .expect("the write is stored");
}
