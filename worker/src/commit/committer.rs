//! Offset commits on a thread of their own, each one answered.
//!
//! A watermark counts as committed only once the broker has confirmed it. rust-rdkafka's
//! `BaseConsumer` serves librdkafka through its event API and registers no offset-commit
//! callback, and an asynchronous `commit` passes no reply queue, so the broker's answer to an
//! asynchronous commit never reaches the application: librdkafka only logs `COMMITFAIL`. (That
//! is how a partition's committed offset could stay frozen while every probe was green.) So
//! commits are synchronous, whose result is the broker's answer (an error if any partition
//! failed) — and they run here, on a thread of their own, so the consumer loop never waits for
//! a round trip, nor for a coordinator that is away. One commit is outstanding at a time; its
//! answer comes back over a channel the loop drains every turn, and rings the loop's doorbell,
//! so that a loop waiting with a partition held at its in-flight cap (which only a confirmed
//! commit lets take records again) looks at once instead of at its next tick.
//!
//! The thread is also the worker's ear on the coordinator (see `membership`): an answer that
//! shows the coordinator knows this member is recorded on the fence's clock, and when the
//! thread has had nothing to send for a while, or its commits are being refused, it asks the
//! coordinator for a committed offset (read-only) to hear from it.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::TopicPartitionList;

use crate::group::membership::Fence;
use crate::ops::signal::Doorbell;

/// How often an idle commit thread looks whether the coordinator needs asking.
const PROBE_CHECK: Duration = Duration::from_millis(200);
/// Longest wait for the answer to a probe (at most a third of the session timeout): a stop
/// waits for the thread, and the next probe asks again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The broker's answer to one commit.
pub struct Answer {
    pub offsets: TopicPartitionList,
    pub result: KafkaResult<()>,
}

/// The commit thread, as the consumer loop sees it.
pub struct Committer {
    requests: Option<mpsc::Sender<TopicPartitionList>>,
    answers: mpsc::Receiver<Answer>,
    outstanding: bool,
    /// Commit turns the outstanding commit has been waited for.
    busy_turns: u32,
    thread: Option<JoinHandle<()>>,
}

impl Committer {
    /// The thread commits for `consumer`, whose input is `topic`, keeps `fence`'s clock, and
    /// rings `answered` with each answer: a loop waiting with a partition held at its
    /// in-flight cap looks at once, not at its next tick.
    pub fn spawn<C: ConsumerContext + 'static>(
        consumer: Arc<BaseConsumer<C>>,
        topic: &str,
        fence: Arc<Fence>,
        answered: Arc<Doorbell>,
    ) -> std::io::Result<Self> {
        let (requests, incoming) = mpsc::channel::<TopicPartitionList>();
        let (reply, answers) = mpsc::channel();
        let mut probe = TopicPartitionList::new();
        probe.add_partition(topic, 0);
        let thread = std::thread::Builder::new()
            .name(format!("commit-{topic}"))
            .spawn(move || loop {
                let offsets = match incoming.recv_timeout(PROBE_CHECK) {
                    Ok(offsets) => offsets,
                    Err(RecvTimeoutError::Timeout) => {
                        if fence.wants_probe(Instant::now()) {
                            ask_coordinator(&consumer, &probe, &fence);
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                let sent = Instant::now();
                let result = consumer.commit(&offsets, CommitMode::Sync);
                if answered_as_member(&result) {
                    fence.clock.heard(sent);
                } else if fence.wants_probe(Instant::now()) {
                    // Commits refused (a coordinator that moved, a commit outage) are not
                    // silence: whether the coordinator answers at all is asked separately.
                    ask_coordinator(&consumer, &probe, &fence);
                }
                if reply.send(Answer { offsets, result }).is_err() {
                    return;
                }
                answered.ring();
            })?;
        Ok(Self {
            requests: Some(requests),
            answers,
            outstanding: false,
            busy_turns: 0,
            thread: Some(thread),
        })
    }

    /// Whether a commit is on its way and unanswered.
    pub fn busy(&self) -> bool {
        self.outstanding
    }

    /// Sends `offsets` to be committed, unless a commit is already outstanding (then `offsets`
    /// is handed back).
    pub fn send(&mut self, offsets: TopicPartitionList) -> Result<(), TopicPartitionList> {
        if self.outstanding {
            return Err(offsets);
        }
        match self.requests.as_ref().map(|r| r.send(offsets)) {
            Some(Ok(())) => {
                self.outstanding = true;
                self.busy_turns = 0;
                Ok(())
            }
            Some(Err(mpsc::SendError(offsets))) => Err(offsets),
            None => unreachable!("requests are dropped only when the committer finishes"),
        }
    }

    /// A commit turn found the last commit still unanswered; returns for how many turns.
    pub fn note_busy_turn(&mut self) -> u32 {
        self.busy_turns += 1;
        self.busy_turns
    }

    /// The answer that has arrived, if any.
    pub fn answer(&mut self) -> Option<Answer> {
        let answer = self.answers.try_recv().ok()?;
        self.outstanding = false;
        Some(answer)
    }

    /// Waits for the outstanding commit (if any) and ends the thread; returns its answer.
    /// Later calls return `None`.
    pub fn finish(&mut self) -> Option<Answer> {
        self.requests = None;
        let last = if self.outstanding {
            self.outstanding = false;
            self.answers.recv().ok()
        } else {
            None
        };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        last
    }
}

/// Whether a commit's answer came from a coordinator that knows this member: accepted, or
/// refused only because a rebalance is under way or the member's generation has moved on (a
/// cooperative rejoin). Timeouts, transport errors and "not the coordinator" say nothing.
fn answered_as_member(result: &KafkaResult<()>) -> bool {
    match result {
        Ok(()) => true,
        Err(KafkaError::ConsumerCommit(code)) => matches!(
            code,
            RDKafkaErrorCode::RebalanceInProgress | RDKafkaErrorCode::IllegalGeneration
        ),
        Err(_) => false,
    }
}

/// Asks the coordinator for a committed offset (read-only) and records its answer.
fn ask_coordinator<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    probe: &TopicPartitionList,
    fence: &Fence,
) {
    let sent = Instant::now();
    if consumer
        .committed_offsets(probe.clone(), fence.probe_after.min(PROBE_TIMEOUT))
        .is_ok()
    {
        fence.clock.heard(sent);
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: RDKafkaErrorCode) -> KafkaResult<()> {
        Err(KafkaError::ConsumerCommit(code))
    }

    #[test]
    fn only_answers_of_a_coordinator_that_knows_the_member_are_its_word() {
        assert!(answered_as_member(&Ok(())));
        assert!(answered_as_member(&refused(
            RDKafkaErrorCode::RebalanceInProgress
        )));
        assert!(answered_as_member(&refused(
            RDKafkaErrorCode::IllegalGeneration
        )));
        for silent in [
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::OperationTimedOut,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::CoordinatorNotAvailable,
            RDKafkaErrorCode::NotCoordinator,
            RDKafkaErrorCode::UnknownMemberId,
            RDKafkaErrorCode::WaitingForCoordinator,
        ] {
            assert!(!answered_as_member(&refused(silent)), "{silent:?}");
        }
        assert!(!answered_as_member(&Err(KafkaError::Canceled)));
    }

    /// A loop that waits with a partition held at its in-flight cap is woken by the answer
    /// that may release it, not by its next tick.
    #[test]
    fn an_answered_commit_rings_the_loops_doorbell() {
        use rdkafka::mocking::MockCluster;
        use rdkafka::{ClientConfig, Offset};

        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic("in", 1, 1).expect("topic");
        let consumer: Arc<BaseConsumer> = Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", cluster.bootstrap_servers())
                .set("group.id", "committer-doorbell-test")
                .create()
                .expect("consumer"),
        );
        let fence = Arc::new(Fence::new(
            Duration::from_secs(45),
            Arc::default(),
            Instant::now(),
        ));
        let bell = Arc::new(Doorbell::default());
        let mut committer = Committer::spawn(consumer, "in", fence, bell.clone()).expect("thread");
        assert!(!bell.wait(Duration::ZERO), "nothing answered yet");
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset("in", 0, Offset::Offset(7))
            .expect("offset");
        committer.send(offsets).expect("nothing outstanding");
        assert!(
            bell.wait(Duration::from_secs(60)),
            "the answer did not ring"
        );
        let answer = committer
            .answer()
            .expect("the ring comes after the answer is sent");
        assert!(answer.result.is_ok(), "{:?}", answer.result);
        assert!(!committer.busy());
        committer.finish();
    }
}
