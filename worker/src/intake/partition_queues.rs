//! One librdkafka queue per assigned partition, so that partitions wait independently.
//!
//! By default librdkafka hands out every partition's fetched records through the consumer's
//! single queue, in the order the fetch responses came: thousands of one partition's records,
//! then thousands of the next one's. When one partition must wait (its sessions are behind and
//! its in-flight limit is reached), every record queued behind its own waits too, whatever its
//! partition. Splitting each assigned partition into its own queue removes that head-of-line
//! blocking: the consumer loop takes records from the partitions that may take them and leaves
//! the others alone, and librdkafka stops fetching a partition once its queue is full
//! (`queued.max.messages.kbytes`, per partition once split).
//!
//! The consumer's main queue then carries only events (rebalances, errors). A partition's
//! queue is detached from the main queue in the rebalance callback *before* the partition is
//! assigned ([`detach_before_assign`]): librdkafka keeps an application-set forward when it
//! starts fetching, so not one record of the partition goes through the main queue. Should one
//! ever do (a partition not detached), it is older than anything in the partition's own queue,
//! so the loop drains the main queue after every split before it reads a partition queue;
//! [`PartitionQueues::sync`] reports a split for that.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::bindings::{rd_kafka_queue_destroy, rd_kafka_queue_get_partition, rd_kafka_queue_t};
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::message::BorrowedMessage;

use crate::commit::offsets::Partition;
use crate::intake::fetched::{self, FetchedMessage};
use crate::ops::signal::Doorbell;

/// Detaches `partition`'s fetch queue from the consumer's main queue, so that its records stay
/// in its own queue from the first fetch on. For the rebalance callback, before the partition
/// is assigned: it has the consumer only by reference, not the `Arc` that
/// [`PartitionQueues::sync`] needs to hand out a queue. False when librdkafka knows no such
/// partition.
pub fn detach_before_assign<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: Partition,
) -> bool {
    let Ok(topic) = CString::new(topic) else {
        return false;
    };
    use rdkafka::bindings::{
        rd_kafka_queue_destroy, rd_kafka_queue_forward, rd_kafka_queue_get_partition,
    };
    // SAFETY: the client pointer is valid while `consumer` is borrowed. The queue handle is
    // our own reference to the partition's fetch queue, released right after use; forwarding
    // it to nothing is what rdkafka's own `split_partition_queue` does.
    unsafe {
        let queue =
            rd_kafka_queue_get_partition(consumer.client().native_ptr(), topic.as_ptr(), partition);
        if queue.is_null() {
            return false;
        }
        rd_kafka_queue_forward(queue, std::ptr::null_mut());
        rd_kafka_queue_destroy(queue);
    }
    true
}

/// Serves everything waiting in the consumer's main queue — events and any stray record —
/// up to `burst` of them, handing records to `take`.
///
/// `BaseConsumer::poll` serves one event (a rebalance, a log line, a commit answer) per call
/// and then returns `None`, exactly as it does for an empty queue. A loop that stops at the
/// first `None` serves one event per turn, and a burst of log events then holds a rebalance
/// back by one turn each — with debug logging on, for longer than the group waits for a member
/// to rejoin: it goes on without the member while the member still writes. So this asks the
/// queue how much is left instead.
pub fn serve_main_queue<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    burst: usize,
    mut take: impl FnMut(&BorrowedMessage<'_>),
) {
    for _ in 0..burst {
        match consumer.poll(Duration::ZERO) {
            Some(Ok(message)) => take(&message),
            Some(Err(e)) => tracing::warn!(error = %e, "consume error"),
            // An event was served, or the queue is empty.
            None if main_queue_len(consumer) == 0 => return,
            None => {}
        }
    }
}

/// Events (and stray records) waiting in the consumer's main queue.
pub fn main_queue_len<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> usize {
    use rdkafka::bindings::{
        rd_kafka_queue_destroy, rd_kafka_queue_get_main, rd_kafka_queue_length,
    };
    // SAFETY: the client pointer is valid while `consumer` is borrowed; the queue handle is our
    // own reference, released right after use.
    unsafe {
        let queue = rd_kafka_queue_get_main(consumer.client().native_ptr());
        if queue.is_null() {
            return 0;
        }
        let waiting = rd_kafka_queue_length(queue);
        rd_kafka_queue_destroy(queue);
        waiting
    }
}

/// The split-off queues of the partitions currently assigned.
pub struct PartitionQueues<C: ConsumerContext + 'static> {
    consumer: Arc<BaseConsumer<C>>,
    topic: String,
    /// The topic for librdkafka's C API (our queue handles).
    topic_c: CString,
    /// rdkafka's handle rings the doorbell; our own handle on the same queue takes records in
    /// batches (see `fetched`).
    queues: BTreeMap<Partition, (PartitionQueue<C>, QueueHandle)>,
    doorbell: Arc<Doorbell>,
}

/// A reference of our own to a partition's fetch queue, released when dropped.
struct QueueHandle(NonNull<rd_kafka_queue_t>);

// SAFETY: librdkafka's queue handles may be used and released from any thread.
unsafe impl Send for QueueHandle {}

impl QueueHandle {
    fn of<C: ConsumerContext>(
        consumer: &BaseConsumer<C>,
        topic: &CStr,
        p: Partition,
    ) -> Option<Self> {
        // SAFETY: the client pointer is valid while `consumer` is borrowed, the topic is
        // NUL-terminated; the handle is a new reference, released in `drop`.
        let queue = unsafe {
            rd_kafka_queue_get_partition(consumer.client().native_ptr(), topic.as_ptr(), p)
        };
        NonNull::new(queue).map(Self)
    }
}

impl Drop for QueueHandle {
    fn drop(&mut self) {
        // SAFETY: our own reference, released once.
        unsafe { rd_kafka_queue_destroy(self.0.as_ptr()) }
    }
}

impl<C: ConsumerContext + 'static> PartitionQueues<C> {
    /// The queues ring `doorbell` when they get records.
    pub fn new(consumer: Arc<BaseConsumer<C>>, topic: &str, doorbell: Arc<Doorbell>) -> Self {
        Self {
            consumer,
            topic: topic.to_owned(),
            topic_c: CString::new(topic).unwrap_or_default(),
            queues: BTreeMap::new(),
            doorbell,
        }
    }

    /// Splits off the queues of newly `assigned` partitions and forgets those of partitions no
    /// longer assigned. True when a queue was split off: drain the main queue before reading
    /// any partition queue.
    pub fn sync(&mut self, assigned: &[Partition]) -> bool {
        self.queues.retain(|p, _| assigned.contains(p));
        let mut split = false;
        for &p in assigned {
            if self.queues.contains_key(&p) {
                continue;
            }
            let split_off = self.consumer.split_partition_queue(&self.topic, p);
            let handle = QueueHandle::of(&self.consumer, &self.topic_c, p);
            match split_off.zip(handle) {
                Some((mut queue, handle)) => {
                    let bell = self.doorbell.clone();
                    queue.set_nonempty_callback(move || bell.ring());
                    self.queues.insert(p, (queue, handle));
                    split = true;
                }
                // Only for an invalid topic name or partition; its records (if any) keep
                // arriving through the main queue, which the loop reads anyway.
                None => tracing::error!(partition = p, "could not split off the partition's queue"),
            }
        }
        if split {
            // Records that arrived before the split may have rung nobody.
            self.doorbell.ring();
        }
        split
    }

    /// Records waiting in the partitions' queues (fetched ahead, not taken yet).
    pub fn waiting(&self) -> usize {
        use rdkafka::bindings::rd_kafka_queue_length;
        self.queues
            .values()
            // SAFETY: the handle is live while it is in `queues`.
            .map(|(_, handle)| unsafe { rd_kafka_queue_length(handle.0.as_ptr()) })
            .sum()
    }

    /// The partitions with a queue, ascending.
    pub fn partitions(&self) -> impl Iterator<Item = Partition> + '_ {
        self.queues.keys().copied()
    }

    /// Takes up to `max` records waiting in `partition`'s queue now (at most
    /// [`fetched::AT_ONCE`]), handing each to `each` in offset order. Returns how many.
    pub fn take(
        &self,
        partition: Partition,
        max: usize,
        each: impl FnMut(KafkaResult<&FetchedMessage<'_>>),
    ) -> usize {
        let Some((_, handle)) = self.queues.get(&partition) else {
            return 0;
        };
        // SAFETY: the handle is live while it is in `queues`, and the consumer outlives `self`.
        unsafe { fetched::take(handle.0, max, each) }
    }

    /// Waits until the doorbell rings (a partition queue got records, a commit was answered), or
    /// `timeout`.
    pub fn wait(&self, timeout: Duration) {
        self.doorbell.wait(timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_before_the_wait_is_kept_and_used_up_once() {
        let bell = Doorbell::default();
        assert!(!bell.wait(Duration::ZERO), "nobody rang");
        bell.ring();
        bell.ring();
        assert!(bell.wait(Duration::from_secs(60)));
        assert!(
            !bell.wait(Duration::from_millis(1)),
            "two rings wake one wait"
        );
    }

    /// librdkafka's log lines are events on the main queue (rust-rdkafka sets `log.queue`), so
    /// a consumer logging everything fills it: one serving empties it, rather than taking one
    /// event and stopping at the `None` that `poll` returns for it.
    #[test]
    fn serving_the_main_queue_serves_every_waiting_event_not_one() {
        use rdkafka::config::RDKafkaLogLevel;
        use rdkafka::mocking::MockCluster;
        use rdkafka::ClientConfig;

        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic("in", 2, 1).expect("topic");
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .set("group.id", "main-queue-test")
            .set("debug", "all")
            .set_log_level(RDKafkaLogLevel::Debug)
            .create()
            .expect("consumer");
        consumer.subscribe(&["in"]).expect("subscribe");
        let mut waiting = 0;
        for _ in 0..3_000 {
            waiting = main_queue_len(&consumer);
            if waiting >= 40 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(waiting >= 40, "librdkafka queued {waiting} events");
        serve_main_queue(&consumer, usize::MAX, |_| {});
        let left = main_queue_len(&consumer);
        assert!(
            left <= waiting / 4,
            "{left} of {waiting} events still waiting after one serving"
        );
    }

    #[test]
    fn a_ring_from_another_thread_wakes_the_waiter() {
        let bell = Arc::new(Doorbell::default());
        let ringer = {
            let bell = bell.clone();
            std::thread::spawn(move || bell.ring())
        };
        assert!(bell.wait(Duration::from_secs(60)));
        ringer.join().unwrap();
    }
}
