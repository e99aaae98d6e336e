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
