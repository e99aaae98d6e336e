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
//! answer comes back over a channel the loop drains every turn.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::TopicPartitionList;

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
    pub fn spawn<C: ConsumerContext + 'static>(
        consumer: Arc<BaseConsumer<C>>,
        name: &str,
    ) -> std::io::Result<Self> {
        let (requests, incoming) = mpsc::channel::<TopicPartitionList>();
        let (reply, answers) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("commit-{name}"))
            .spawn(move || {
                for offsets in incoming {
                    let result = consumer.commit(&offsets, CommitMode::Sync);
                    if reply.send(Answer { offsets, result }).is_err() {
                        return;
                    }
                }
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

impl Drop for Committer {
    fn drop(&mut self) {
        self.finish();
    }
}
