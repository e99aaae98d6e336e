//! A TCP relay in front of one Kafka node that can hold the clients' produce requests on the
//! way: a write that the client has sent — on the wire, in flight for librdkafka — but that
//! the broker has not yet read.
//!
//! That is the moment an in-flight purge gives a write up while the broker may still store it,
//! and a real network makes it last as long as it likes (a slow link, a full socket buffer, a
//! broker busy with the connection's earlier requests). toxiproxy can slow a whole proxy, but
//! not hold one request kind while the transaction coordinator's requests go through, so this
//! relay reads the client's bytes as Kafka frames (a 4-byte length, then the request, whose
//! first two bytes are its API key) and only ever forwards them whole and in order. It never
//! changes or drops a request it forwards. Other kinds of request can be held the same way
//! (the group coordinator's offset requests: a coordinator that stops answering; a transaction
//! coordinator's `EndTxn`: an abort that waits); the node's answers can be delayed (a slow link
//! or a slow broker: every round trip longer); and four kinds of request can be refused — the
//! relay answers them with an error code itself, and the node never sees them: an
//! `OffsetCommit` (a coordinator loading, moving or rebalancing the group: [`offset_commit`]),
//! an `OffsetFetch` (a coordinator that cannot serve the group's offsets now: [`offset_fetch`]),
//! a `Produce` to a chosen topic (a leader short of replicas, a batch too large, a topic the
//! client may not write: [`produce`]) and a `Heartbeat` (a coordinator that forgot the member:
//! [`heartbeat`]). Their layouts on the wire are read in [`wire`].
//!
//! Clients reach it as the node's advertised address (`scripts/kafka.sh start --proxied`
//! advertises port P+3 for the node on P).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;

mod heartbeat;
mod offset_commit;
mod offset_fetch;
mod produce;
mod wire;

/// Kafka's API keys of the requests tests hold.
pub const PRODUCE: i16 = 0;
pub const OFFSET_COMMIT: i16 = 8;
pub const OFFSET_FETCH: i16 = 9;
pub const HEARTBEAT: i16 = 12;
pub const SYNC_GROUP: i16 = 14;
pub const END_TXN: i16 = 26;

/// The relay: forwards every connection made to its address to the node's; stopped when dropped.
pub struct Relay {
    /// The API keys of the requests held now.
    holding: watch::Sender<HashSet<i16>>,
    /// Held from the first request of an API key on ([`Relay::hold_from`]).
    armed: Arc<Mutex<Option<Armed>>>,
    produce_seen: Arc<AtomicUsize>,
    /// How many requests of each API key clients have sent (held or not).
    seen_by_key: Arc<Mutex<HashMap<i16, usize>>>,
    /// How many produce requests were forwarded (or refused): the n-th (from 0) waits until n
    /// were.
    forwarded: watch::Sender<usize>,
    /// How much later than it came each answer of the node goes back to its client.
    delay: watch::Sender<Duration>,
    refusals: Arc<Mutex<Refusals>>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

/// Requests to hold from the moment a client sends one of another kind.
struct Armed {
    trigger: i16,
    api_keys: Vec<i16>,
}

/// The requests to answer with an error code instead of forwarding.
#[derive(Default)]
struct Refusals {
    /// `OffsetCommit`, `OffsetFetch` and `Heartbeat`, by API key: the error code, and how many
    /// more requests get it.
    by_key: HashMap<i16, (i16, usize)>,
    /// `Produce` requests that write to the topic: the error codes for the next ones, in turn.
    produce: Option<(String, VecDeque<i16>)>,
    /// How many requests were refused so far, by API key.
    refused: HashMap<i16, usize>,
}

impl Refusals {
    /// The relay's answer to `frame`, if it is a request to refuse (counted as refused).
    fn answer(&mut self, frame: &[u8]) -> Option<Vec<u8>> {
        let key = api_key(frame)?;
        let answer = if key == PRODUCE {
            let (topic, codes) = self.produce.as_mut()?;
            let produce = produce::Produce::read(frame).filter(|p| p.writes(topic))?;
            let code = codes.pop_front()?;
            if codes.is_empty() {
                self.produce = None;
            }
            produce.refusal(code)
        } else {
            let (code, left) = self.by_key.get_mut(&key)?;
            let answer = match key {
                OFFSET_COMMIT => offset_commit::Commit::read(frame)?.refusal(*code),
                OFFSET_FETCH => offset_fetch::Fetch::read(frame)?.refusal(*code),
                HEARTBEAT => heartbeat::Heartbeat::read(frame)?.refusal(*code),
                _ => return None,
            };
            *left -= 1;
            if *left == 0 {
                self.by_key.remove(&key);
            }
            answer
        };
        *self.refused.entry(key).or_default() += 1;
        Some(answer)
    }
}

/// A broker of its own behind a relay: `scripts/kafka.sh start --proxied` on `port` … `port +
/// 3`, which advertises `port + 3`, where the relay listens. The relay starts first: the script
/// reaches the broker at its advertised address to see it ready. From a multi-thread runtime
/// (the script blocks while the broker starts).
///
/// The e2e tests' relayed nodes take four ports each from: 19530, 19540, 19550 (`late_writes`),
/// 19560 (`slow_transaction_calls`), 19570 (`membership`), 19580 … 19596 (`commit_outage`) and
/// 19600 … 19636 (`faults`), 19640 and 19644 (`purges`), 19648 (`membership`), 19652
/// (`exactly_once`).
pub async fn broker_behind_relay(port: u16) -> (Relay, crate::ScriptCluster) {
    let relay = Relay::start(
        &format!("127.0.0.1:{}", port + 3),
        &format!("127.0.0.1:{port}"),
    )
    .await;
    let cluster = tokio::task::block_in_place(|| crate::ScriptCluster::start(port, &["--proxied"]));
    (relay, cluster)
}

/// A node of the test's own behind a relay ([`broker_behind_relay`]) with a stage's topics
/// (`ScriptCluster::create_stage_topics`: input and output of `partitions` partitions, a DLQ of
/// one). It must outlive the test's workers.
pub struct RelayedNode {
    pub relay: Relay,
    pub node: crate::ScriptCluster,
    /// The node's bootstrap address, which clients reach through the relay.
    pub brokers: String,
    pub topics: crate::Topics,
}

impl RelayedNode {
    /// From a multi-thread runtime, as [`broker_behind_relay`].
    pub async fn start(port: u16, name: &str, partitions: i32) -> Self {
        let (relay, node) = broker_behind_relay(port).await;
        let topics = node.create_stage_topics(name, partitions).await;
        Self {
            relay,
            brokers: node.bootstrap.clone(),
            node,
            topics,
        }
    }
}

impl Relay {
    /// Listens on `listen` and forwards to `node` (both `host:port`).
    pub async fn start(listen: &str, node: &str) -> Self {
        let listener = TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("the relay cannot listen on {listen}: {e}"));
        let (holding, _) = watch::channel(HashSet::new());
        let (forwarded, _) = watch::channel(0);
        let (delay, _) = watch::channel(Duration::ZERO);
        let relay = Self {
            holding,
            armed: Arc::default(),
            produce_seen: Arc::default(),
            seen_by_key: Arc::default(),
            forwarded,
            delay,
            refusals: Arc::default(),
            tasks: Arc::default(),
        };
        let (node, holding, armed, seen, by_key, forwarded, delay, refusals, tasks) = (
            node.to_string(),
            relay.holding.clone(),
            relay.armed.clone(),
            relay.produce_seen.clone(),
            relay.seen_by_key.clone(),
            relay.forwarded.clone(),
            relay.delay.clone(),
            relay.refusals.clone(),
            relay.tasks.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = TcpStream::connect(&node).await else {
                    continue; // the client sees its connection close, as with a node that is down
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let order = Order {
                    holding: holding.subscribe(),
                    hold: holding.clone(),
                    armed: armed.clone(),
                    seen: seen.clone(),
                    by_key: by_key.clone(),
                    forwarded: forwarded.clone(),
                    delay: delay.subscribe(),
                    refusals: refusals.clone(),
                };
                for handle in connect(client, upstream, order) {
                    tasks.lock().unwrap().push(handle);
                }
            }
        });
        relay.tasks.lock().unwrap().push(accept.abort_handle());
        relay
    }

    /// From now on, a request with one of these API keys is held before it reaches the node
    /// (and so is whatever its connection sends after it), until [`Relay::release`].
    pub fn hold(&self, api_keys: &[i16]) {
        self.holding.send_modify(|held| held.extend(api_keys));
    }

    /// Holds requests with these API keys (as [`Relay::hold`]) from the moment a client sends a
    /// request with `trigger`, which itself goes through: a hold that starts at a step of the
    /// clients' protocol, however long they take to reach it (a group member's `SYNC_GROUP`:
    /// its assignment's offset reads are held, the join before it is not).
    pub fn hold_from(&self, trigger: i16, api_keys: &[i16]) {
        *self.armed.lock().unwrap() = Some(Armed {
            trigger,
            api_keys: api_keys.to_vec(),
        });
    }

    /// Forwards what is held of these API keys, and holds them no more. The produce requests go
    /// on in the order the clients sent them, over all connections.
    pub fn release(&self, api_keys: &[i16]) {
        self.holding
            .send_modify(|held| held.retain(|k| !api_keys.contains(k)));
    }

    /// From now on, each answer of the node reaches its client `by` later than it left the
    /// node (`Duration::ZERO`: as it comes). Answers keep their order.
    pub fn delay_answers(&self, by: Duration) {
        self.delay.send_replace(by);
    }

    /// The next `times` requests with `api_key` — `OFFSET_COMMIT`, `OFFSET_FETCH` or
    /// `HEARTBEAT` —, from any client, are answered by the relay with `error_code` (for every
    /// partition or group they name), and never reach the node: after the answers to what their
    /// connection sent before them, as a broker answers in order. Replaces what was left of an
    /// earlier call for the key.
    pub fn refuse(&self, api_key: i16, error_code: i16, times: usize) {
        assert!(
            [OFFSET_COMMIT, OFFSET_FETCH, HEARTBEAT].contains(&api_key),
            "the relay cannot answer API key {api_key} itself"
        );
        let mut refusals = self.refusals.lock().unwrap();
        if times > 0 {
            refusals.by_key.insert(api_key, (error_code, times));
        } else {
            refusals.by_key.remove(&api_key);
        }
    }

    /// The next `Produce` requests that write to `topic`, from any client, are answered by the
    /// relay with `error_codes` in turn (one a request, for every partition it writes), and
    /// never reach the node. Requests to other topics go through. Replaces what was left of
    /// an earlier call.
    pub fn refuse_produce(&self, topic: &str, error_codes: &[i16]) {
        self.refusals.lock().unwrap().produce = (!error_codes.is_empty())
            .then(|| (topic.to_string(), error_codes.iter().copied().collect()));
    }

    /// Forwards requests with `api_key` again, however many refusals were left.
    pub fn accept(&self, api_key: i16) {
        let mut refusals = self.refusals.lock().unwrap();
        if api_key == PRODUCE {
            refusals.produce = None;
        } else {
            refusals.by_key.remove(&api_key);
        }
    }

    /// How many requests with `api_key` the relay has refused so far.
    pub fn refused(&self, api_key: i16) -> usize {
        self.refusals
            .lock()
            .unwrap()
            .refused
            .get(&api_key)
            .copied()
            .unwrap_or(0)
    }

    /// How many produce requests clients have sent through the relay so far (held or not).
    pub fn produce_requests_seen(&self) -> usize {
        self.produce_seen.load(Ordering::SeqCst)
    }

    /// How many requests with `api_key` clients have sent through the relay so far (held or
    /// not).
    pub fn requests_seen(&self, api_key: i16) -> usize {
        self.seen_by_key
            .lock()
            .unwrap()
            .get(&api_key)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// What orders the produce requests of every connection.
struct Order {
    holding: watch::Receiver<HashSet<i16>>,
    /// To start holding when an armed trigger is read.
    hold: watch::Sender<HashSet<i16>>,
    armed: Arc<Mutex<Option<Armed>>>,
    /// Produce requests read so far: each one's number.
    seen: Arc<AtomicUsize>,
    /// Requests read so far, by API key.
    by_key: Arc<Mutex<HashMap<i16, usize>>>,
    forwarded: watch::Sender<usize>,
    delay: watch::Receiver<Duration>,
    refusals: Arc<Mutex<Refusals>>,
}

/// Relays one connection: the client's frames are read as they come (so that every request it
/// has sent is counted) and written to the node in order, each when the relay does not hold its
/// kind, and a produce request only once every earlier one is forwarded — or, for a request
/// the relay is told to refuse, answered here once the node has answered what was forwarded
/// before it. The node's answers go back whole and in order, each when the
/// relay's delay has passed since it came.
///
/// Every request forwarded is taken to be answered (no producer with `acks=0` goes through the
/// relay): a refusal waits for the node's answers to all of them.
fn connect(client: TcpStream, upstream: TcpStream, order: Order) -> [AbortHandle; 4] {
    let Order {
        mut holding,
        hold,
        armed,
        seen,
        by_key,
        forwarded,
        delay,
        refusals,
    } = order;
    let (mut from_client, to_client) = client.into_split();
    let (mut from_node, mut to_node) = upstream.into_split();
    let to_client = Arc::new(tokio::sync::Mutex::new(to_client));
    // How many of the node's answers went back to the client.
    let (answered, mut answered_so_far) = watch::channel(0usize);
    // Each frame with its number among the produce requests, if it is one.
    let (frames, mut queued) = mpsc::unbounded_channel::<(Vec<u8>, Option<usize>)>();
    let read = tokio::spawn(async move {
        // Once closed, what was read is still forwarded, as bytes on a wire are.
        while let Some(frame) = read_frame(&mut from_client).await {
            let key = api_key(&frame);
            if let Some(k) = key {
                *by_key.lock().unwrap().entry(k).or_default() += 1;
            }
            let number = (key == Some(PRODUCE)).then(|| seen.fetch_add(1, Ordering::SeqCst));
            if frames.send((frame, number)).is_err() {
                return;
            }
        }
    });
    let refuse_to = to_client.clone();
    let write = tokio::spawn(async move {
        let mut turn = forwarded.subscribe();
        // Once the node's side is broken, the frames still queued are dropped, as a broken
        // connection drops them; the produce requests among them still take their turn, so
        // that the other connections' later ones go on.
        let mut broken = false;
        // Requests forwarded to the node on this connection.
        let mut sent = 0usize;
        while let Some((frame, number)) = queued.recv().await {
            let key = api_key(&frame);
            if holding
                .wait_for(|held| key.is_none_or(|k| !held.contains(&k)))
                .await
                .is_err()
            {
                return; // the relay is gone
            }
            if let Some(n) = number {
                if turn.wait_for(|done| *done == n).await.is_err() {
                    return;
                }
            }
            // Armed here, not when read: what the connection sent before the trigger is not
            // held by it.
            if let Some(k) = key {
                let mut armed = armed.lock().unwrap();
                if armed.as_ref().is_some_and(|a| a.trigger == k) {
                    let keys = armed.take().map(|a| a.api_keys).unwrap_or_default();
                    hold.send_modify(|held| held.extend(keys));
                }
            }
            let refusal = refusals.lock().unwrap().answer(&frame);
            match refusal {
                Some(answer) => {
                    if answered_so_far.wait_for(|n| *n >= sent).await.is_err() {
                        return; // the node closed: so does the client's connection
                    }
                    let _ = refuse_to.lock().await.write_all(&answer).await;
                }
                None => {
                    broken = broken || to_node.write_all(&frame).await.is_err();
                    sent += 1;
                }
            }
            // A refused produce request has had its turn too.
            if number.is_some() {
                forwarded.send_modify(|done| *done += 1);
            }
        }
        // The client closed: the node's side stays open until the node closes it, so that
        // what was forwarded last is still read and answered.
        std::future::pending::<()>().await;
    });
    // The node's answers, each with the moment it came.
    let (answers, mut to_deliver) = mpsc::unbounded_channel::<(Vec<u8>, Instant)>();
    let back = tokio::spawn(async move {
        while let Some(frame) = read_frame(&mut from_node).await {
            if answers.send((frame, Instant::now())).is_err() {
                return;
            }
        }
    });
    let deliver = tokio::spawn(async move {
        while let Some((frame, came)) = to_deliver.recv().await {
            let by = *delay.borrow();
            tokio::time::sleep_until(came + by).await;
            if to_client.lock().await.write_all(&frame).await.is_err() {
                break;
            }
            answered.send_modify(|n| *n += 1);
        }
        // The node closed its side: so does the relay, towards the client.
        let _ = to_client.lock().await.shutdown().await;
    });
    [
        read.abort_handle(),
        write.abort_handle(),
        back.abort_handle(),
        deliver.abort_handle(),
    ]
}

/// One Kafka frame (a 4-byte length, then that many bytes), length included; `None` once the
/// stream has closed or broken.
async fn read_frame(from: &mut (impl AsyncRead + Unpin)) -> Option<Vec<u8>> {
    let mut size = [0u8; 4];
    from.read_exact(&mut size).await.ok()?;
    let mut frame = size.to_vec();
    frame.resize(4 + i32::from_be_bytes(size).max(0) as usize, 0);
    from.read_exact(&mut frame[4..]).await.ok()?;
    Some(frame)
}

/// The API key of a request frame (its first two bytes after the length).
fn api_key(frame: &[u8]) -> Option<i16> {
    frame.get(4..6).map(|k| i16::from_be_bytes([k[0], k[1]]))
}
