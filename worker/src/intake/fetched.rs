//! Records taken from a partition's queue a batch at a time, read in place.
//!
//! rdkafka's `PartitionQueue::poll` returns one record per call, and each call pays for a
//! whole poll: a clock read and a loop in rdkafka, then librdkafka's poll bookkeeping (the
//! `max.poll.interval.ms` clock and a locked statistics histogram), an event around the record
//! and its release. At a million records a second that was a fifth of the consumer loop's
//! thread, which is the engine's one serial stage. `rd_kafka_consume_batch_queue` takes up to
//! a burst of records in one call and pays those costs once; librdkafka still drops records of
//! an outdated fetch and moves the application's position past what it returns, as the poll
//! does.
//!
//! rdkafka has no public view of a record it did not hand out itself, so [`FetchedMessage`] is
//! one: the C record read in place through rdkafka's `Message` and `Headers` traits (which is
//! all `InputRecord::from_message` needs), destroyed when the batch is done with.

use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr::NonNull;

use rdkafka::bindings::{
    rd_kafka_consume_batch_queue, rd_kafka_header_cnt, rd_kafka_header_get_all, rd_kafka_headers_t,
    rd_kafka_message_destroy, rd_kafka_message_headers, rd_kafka_message_t,
    rd_kafka_message_timestamp, rd_kafka_queue_t, rd_kafka_resp_err_t, rd_kafka_timestamp_type_t,
    rd_kafka_topic_name,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, Timestamp};

/// Records taken in one call, at most.
pub const AT_ONCE: usize = 256;

/// Takes up to `max` (at most [`AT_ONCE`]) records waiting in `queue`, without waiting, and
/// hands each to `each` in offset order: the record, or the error librdkafka put in its place.
/// Every record is destroyed before this returns, whatever `each` does. Returns how many
/// were taken.
///
/// # Safety
/// `queue` must be a live queue handle of a consumer that outlives the call.
pub unsafe fn take(
    queue: NonNull<rd_kafka_queue_t>,
    max: usize,
    mut each: impl FnMut(Result<&FetchedMessage<'_>, KafkaError>),
) -> usize {
    let mut slots = [std::ptr::null_mut::<rd_kafka_message_t>(); AT_ONCE];
    let max = max.min(AT_ONCE);
    // SAFETY: the queue is live (the caller's promise) and `slots` has room for `max`.
    let n = unsafe { rd_kafka_consume_batch_queue(queue.as_ptr(), 0, slots.as_mut_ptr(), max) };
    let Ok(n) = usize::try_from(n) else {
        return 0; // -1: not a queue librdkafka can read this way; nothing was taken
    };
    let taken = Taken(&slots[..n]);
    for &ptr in taken.0 {
        // SAFETY: librdkafka returned `n` valid records, alive until `taken` is dropped.
        let message = unsafe { FetchedMessage::new(ptr) };
        match message.error() {
            None => each(Ok(&message)),
            Some(e) => each(Err(e)),
        }
    }
    n
}

/// Destroys the records of a batch, also when a record's handling unwinds.
struct Taken<'a>(&'a [*mut rd_kafka_message_t]);

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        for &ptr in self.0 {
            // SAFETY: each pointer is a record librdkafka handed out, destroyed once, here.
            unsafe { rd_kafka_message_destroy(ptr) };
        }
    }
}

/// One record of a batch, read in place; it cannot outlive the batch.
pub struct FetchedMessage<'a> {
    raw: &'a rd_kafka_message_t,
    headers: Option<FetchedHeaders<'a>>,
}

impl FetchedMessage<'_> {
    /// # Safety
    /// `ptr` is a record librdkafka handed out and not yet destroyed, for the view's lifetime.
    unsafe fn new(ptr: *mut rd_kafka_message_t) -> Self {
        // SAFETY: the caller's promise.
        let raw = unsafe { &*ptr };
        let mut headers = std::ptr::null_mut();
        // SAFETY: `ptr` is live; librdkafka parses the headers once and keeps them with it.
        let found = unsafe { rd_kafka_message_headers(ptr, &mut headers) };
        let headers = (found == rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR)
            .then(|| NonNull::new(headers))
            .flatten()
            .map(|ptr| FetchedHeaders {
                ptr,
                record: PhantomData,
            });
        Self { raw, headers }
    }

    /// The C record, for what rdkafka's traits do not read (see `kafka_epoch`).
    pub(crate) fn raw(&self) -> &rd_kafka_message_t {
        self.raw
    }

    fn error(&self) -> Option<KafkaError> {
        (self.raw.err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR)
            .then(|| KafkaError::MessageConsumption(RDKafkaErrorCode::from(self.raw.err)))
    }
}

/// `len` bytes at `ptr`, or `None` for a null pointer.
///
/// # Safety
/// A non-null `ptr` points at `len` bytes alive for `'a`.
unsafe fn bytes<'a>(ptr: *const std::ffi::c_void, len: usize) -> Option<&'a [u8]> {
    // SAFETY: the caller's promise.
    (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) })
}

impl<'a> Message for FetchedMessage<'a> {
    type Headers = FetchedHeaders<'a>;

    fn key(&self) -> Option<&[u8]> {
        // SAFETY: key and key_len describe the record's key, alive with the record.
        unsafe { bytes(self.raw.key, self.raw.key_len) }
    }

    fn payload(&self) -> Option<&[u8]> {
        // SAFETY: payload and len describe the record's value, alive with the record.
        unsafe { bytes(self.raw.payload, self.raw.len) }
    }

    unsafe fn payload_mut(&mut self) -> Option<&mut [u8]> {
        // A view shares the record; nothing here writes to it.
        None
    }

    fn topic(&self) -> &str {
        // SAFETY: a fetched record's topic handle lives as long as the record.
        let name = unsafe { CStr::from_ptr(rd_kafka_topic_name(self.raw.rkt)) };
        name.to_str().unwrap_or_default()
    }

    fn partition(&self) -> i32 {
        self.raw.partition
    }

    fn offset(&self) -> i64 {
        self.raw.offset
    }

    fn timestamp(&self) -> Timestamp {
        use rd_kafka_timestamp_type_t::*;
        let mut kind = RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: the record is live; librdkafka only reads it.
        let at = unsafe { rd_kafka_message_timestamp(self.raw, &mut kind) };
        match kind {
            _ if at == -1 => Timestamp::NotAvailable,
            RD_KAFKA_TIMESTAMP_CREATE_TIME => Timestamp::CreateTime(at),
            RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME => Timestamp::LogAppendTime(at),
            RD_KAFKA_TIMESTAMP_NOT_AVAILABLE => Timestamp::NotAvailable,
        }
    }

    fn headers(&self) -> Option<&FetchedHeaders<'a>> {
        self.headers.as_ref()
    }
}

/// A fetched record's headers, read in place.
pub struct FetchedHeaders<'a> {
    ptr: NonNull<rd_kafka_headers_t>,
    record: PhantomData<&'a rd_kafka_message_t>,
}

/// The name given to a header whose name is not UTF-8 (rdkafka's own view panics on one).
const UNREADABLE_NAME: &str = "\u{fffd}";

impl Headers for FetchedHeaders<'_> {
    fn count(&self) -> usize {
        // SAFETY: the headers live with their record.
        unsafe { rd_kafka_header_cnt(self.ptr.as_ptr()) }
    }

    fn try_get(&self, idx: usize) -> Option<Header<'_, &[u8]>> {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0);
        // SAFETY: the headers live with their record; librdkafka fills the three out-pointers.
        let err = unsafe {
            rd_kafka_header_get_all(self.ptr.as_ptr(), idx, &mut name, &mut value, &mut size)
        };
        if err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            return None;
        }
        // SAFETY: a header's name is NUL-terminated, and it and its value live with the record.
        let key = unsafe { CStr::from_ptr(name) }
            .to_str()
            .unwrap_or(UNREADABLE_NAME);
        // SAFETY: as above.
        Some(Header {
            key,
            value: unsafe { bytes(value, size) },
        })
    }
}

#[cfg(test)]
mod tests {
    //! Against librdkafka's mock cluster (in-process, librdkafka's own): what a burst hands
    //! out is what was produced, piece by piece, in offset order, never more than asked for,
    //! and an error librdkafka puts in a partition's queue reaches `each` as an error.

    use std::ffi::CString;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use rdkafka::bindings::{
        rd_kafka_header_add, rd_kafka_queue_destroy, rd_kafka_queue_get_partition,
    };
    use rdkafka::consumer::base_consumer::PartitionQueue;
    use rdkafka::consumer::{BaseConsumer, Consumer, DefaultConsumerContext};
    use rdkafka::message::{BorrowedHeaders, Header, OwnedHeaders};
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    use super::*;

    const TOPIC: &str = "fetched";
    /// More than one call's worth.
    const RECORDS: usize = AT_ONCE + 44;
    /// Not UTF-8.
    const ODD_NAME: &[u8] = b"\xffname";

    /// A header as produced: its name (any bytes) and value.
    type RawHeader = (Vec<u8>, Option<Vec<u8>>);

    /// What record `i` is produced with: key, value, and headers.
    fn produced(i: usize) -> (Option<Vec<u8>>, Option<Vec<u8>>, Vec<RawHeader>) {
        let key = (i % 5 != 0).then(|| format!("session-{}", i % 7).into_bytes());
        let value = (i % 11 != 0).then(|| format!("value {i}").into_bytes());
        let mut headers = vec![(b"seq".to_vec(), Some(i.to_string().into_bytes()))];
        if i % 3 == 0 {
            headers.push((b"empty".to_vec(), None));
        }
        if i % 4 == 0 {
            headers.push((ODD_NAME.to_vec(), Some(b"odd".to_vec())));
        }
        (key, value, headers)
    }

    /// The headers of record `i` as a reader sees them (a name that is not UTF-8 reads "�").
    fn read_as(i: usize) -> Vec<(String, Option<Vec<u8>>)> {
        produced(i)
            .2
            .into_iter()
            .map(|(name, value)| {
                let name = String::from_utf8(name).unwrap_or_else(|_| UNREADABLE_NAME.into());
                (name, value)
            })
            .collect()
    }

    fn produce(cluster: &MockCluster<'_, rdkafka::producer::DefaultProducerContext>) {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .create()
            .expect("producer");
        for i in 0..RECORDS {
            let (key, value, headers) = produced(i);
            let mut owned = OwnedHeaders::new();
            for (name, value) in &headers {
                match std::str::from_utf8(name) {
                    Ok(name) => {
                        owned = owned.insert(Header {
                            key: name,
                            value: value.as_deref(),
                        })
                    }
                    Err(_) => {
                        // rdkafka takes only UTF-8 names; librdkafka takes any bytes.
                        let native = owned.as_borrowed() as *const BorrowedHeaders
                            as *mut rd_kafka_headers_t;
                        let value = value.as_deref().unwrap_or_default();
                        // SAFETY: `native` is `owned`'s live header list; the name and value
                        // are copied by librdkafka.
                        let err = unsafe {
                            rd_kafka_header_add(
                                native,
                                name.as_ptr().cast(),
                                name.len() as isize,
                                value.as_ptr().cast(),
                                value.len() as isize,
                            )
                        };
                        assert_eq!(err, rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
                    }
                }
            }
            let mut record = BaseRecord::<[u8], [u8]>::to(TOPIC)
                .partition(0)
                .headers(owned);
            if let Some(key) = key.as_deref() {
                record = record.key(key);
            }
            if let Some(value) = value.as_deref() {
                record = record.payload(value);
            }
            producer.send(record).map_err(|(e, _)| e).expect("send");
        }
        producer.flush(Duration::from_secs(30)).expect("flush");
    }

    /// A consumer of partition 0 from `offset`, its queue split off, and our own handle to it.
    struct Reader {
        consumer: Arc<BaseConsumer>,
        queue: NonNull<rd_kafka_queue_t>,
        _split: PartitionQueue<DefaultConsumerContext>,
    }

    impl Reader {
        fn new(servers: &str, offset: Offset, reset: &str) -> Self {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", servers)
                .set("group.id", "fetched-test")
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", reset)
                .create()
                .expect("consumer");
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(TOPIC, 0, offset).unwrap();
            consumer.assign(&tpl).expect("assign");
            let consumer = Arc::new(consumer);
            // Records go to the partition's own queue, as in the consumer loop.
            let split = consumer
                .split_partition_queue(TOPIC, 0)
                .expect("split queue");
            let topic = CString::new(TOPIC).unwrap();
            // SAFETY: the client is live; the handle is released in `drop`.
            let queue = unsafe {
                rd_kafka_queue_get_partition(consumer.client().native_ptr(), topic.as_ptr(), 0)
            };
            Self {
                consumer,
                queue: NonNull::new(queue).expect("queue handle"),
                _split: split,
            }
        }

        /// Bursts of at most `max` until `until` says enough, or a minute has passed.
        fn read(
            &self,
            max: usize,
            mut each: impl FnMut(Result<&FetchedMessage<'_>, KafkaError>),
            until: impl Fn() -> bool,
        ) -> Vec<usize> {
            let mut bursts = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(60);
            while !until() && Instant::now() < deadline {
                let _ = self.consumer.poll(Duration::from_millis(10));
                // SAFETY: our handle to a queue of the live consumer.
                let n = unsafe { take(self.queue, max, &mut each) };
                if n > 0 {
                    bursts.push(n);
                }
            }
            bursts
        }
    }

    impl Drop for Reader {
        fn drop(&mut self) {
            // SAFETY: our own reference, released once.
            unsafe { rd_kafka_queue_destroy(self.queue.as_ptr()) }
        }
    }

    #[test]
    fn every_record_reads_back_as_produced_in_offset_order_a_burst_at_a_time() {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic(TOPIC, 1, 1).expect("topic");
        produce(&cluster);
        let reader = Reader::new(&cluster.bootstrap_servers(), Offset::Beginning, "earliest");
        let seen = std::cell::RefCell::new(Vec::new());
        let bursts = reader.read(
            100,
            |m| {
                let m = m.expect("no error records");
                let headers = m.headers().map_or_else(Vec::new, |h| {
                    h.iter()
                        .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                        .collect()
                });
                assert_eq!(m.topic(), TOPIC);
                assert_eq!(m.partition(), 0);
                assert!(matches!(m.timestamp(), Timestamp::CreateTime(t) if t > 0));
                seen.borrow_mut().push((
                    m.offset(),
                    m.key().map(<[u8]>::to_vec),
                    m.payload().map(<[u8]>::to_vec),
                    headers,
                ));
            },
            || seen.borrow().len() >= RECORDS,
        );
        let seen = seen.into_inner();
        assert_eq!(seen.len(), RECORDS, "every record, once");
        assert!(
            bursts.iter().all(|&n| n <= 100),
            "bursts {bursts:?} within 100"
        );
        for (i, (offset, key, value, headers)) in seen.into_iter().enumerate() {
            let (want_key, want_value, _) = produced(i);
            assert_eq!(offset, i as i64, "offset order");
            assert_eq!(key, want_key, "key of {i}");
            assert_eq!(value, want_value, "value of {i}");
            assert_eq!(headers, read_as(i), "headers of {i}");
        }
    }

    #[test]
    fn an_error_in_the_queue_reaches_each_as_an_error() {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic(TOPIC, 1, 1).expect("topic");
        produce(&cluster);
        // Past the end with no reset allowed: librdkafka reports it in the partition's queue.
        let reader = Reader::new(
            &cluster.bootstrap_servers(),
            Offset::Offset(RECORDS as i64 + 1_000),
            "error",
        );
        let errors = std::cell::RefCell::new(Vec::new());
        reader.read(
            AT_ONCE,
            |m| match m {
                Ok(m) => panic!("a record at {} past the end", m.offset()),
                Err(e) => errors.borrow_mut().push(e),
            },
            || !errors.borrow().is_empty(),
        );
        let errors = errors.into_inner();
        assert!(
            matches!(
                errors.first(),
                Some(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::AutoOffsetReset
                ))
            ),
            "{errors:?}"
        );
    }
}
