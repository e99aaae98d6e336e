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
//! answers, changes or drops anything: it is a wire with a valve, not a broker. Other kinds of
//! request can be held the same way (the group coordinator's offset requests: a coordinator
//! that stops answering; a transaction coordinator's `EndTxn`: an abort that waits).
//!
//! Clients reach it as the node's advertised address (`scripts/kafka.sh start --proxied`
//! advertises port P+3 for the node on P).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

/// Kafka's API keys of the requests tests hold.
pub const PRODUCE: i16 = 0;
pub const OFFSET_COMMIT: i16 = 8;
pub const OFFSET_FETCH: i16 = 9;
pub const END_TXN: i16 = 26;

/// The relay: forwards every connection made to its address to the node's; stopped when dropped.
pub struct Relay {
    /// The API keys of the requests held now.
    holding: watch::Sender<HashSet<i16>>,
    produce_seen: Arc<AtomicUsize>,
    /// How many requests of each API key clients have sent (held or not).
    seen_by_key: Arc<Mutex<HashMap<i16, usize>>>,
    /// How many produce requests were forwarded: the n-th (from 0) waits until n were.
    forwarded: watch::Sender<usize>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

/// A broker of its own behind a relay: `scripts/kafka.sh start --proxied` on `port` … `port +
/// 3`, which advertises `port + 3`, where the relay listens. The relay starts first: the script
/// reaches the broker at its advertised address to see it ready. From a multi-thread runtime
/// (the script blocks while the broker starts).
pub async fn broker_behind_relay(port: u16) -> (Relay, crate::ScriptCluster) {
    let relay = Relay::start(
        &format!("127.0.0.1:{}", port + 3),
        &format!("127.0.0.1:{port}"),
    )
    .await;
    let cluster = tokio::task::block_in_place(|| crate::ScriptCluster::start(port, &["--proxied"]));
    (relay, cluster)
}

impl Relay {
    /// Listens on `listen` and forwards to `node` (both `host:port`).
    pub async fn start(listen: &str, node: &str) -> Self {
        let listener = TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("the relay cannot listen on {listen}: {e}"));
        let (holding, _) = watch::channel(HashSet::new());
        let (forwarded, _) = watch::channel(0);
        let relay = Self {
            holding,
            produce_seen: Arc::default(),
            seen_by_key: Arc::default(),
            forwarded,
            tasks: Arc::default(),
        };
        let (node, holding, seen, by_key, forwarded, tasks) = (
            node.to_string(),
            relay.holding.clone(),
            relay.produce_seen.clone(),
            relay.seen_by_key.clone(),
            relay.forwarded.clone(),
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
                    seen: seen.clone(),
                    by_key: by_key.clone(),
                    forwarded: forwarded.clone(),
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

    /// Forwards what is held of these API keys, and holds them no more. The produce requests go
    /// on in the order the clients sent them, over all connections.
    pub fn release(&self, api_keys: &[i16]) {
        self.holding
            .send_modify(|held| held.retain(|k| !api_keys.contains(k)));
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
    /// Produce requests read so far: each one's number.
    seen: Arc<AtomicUsize>,
    /// Requests read so far, by API key.
    by_key: Arc<Mutex<HashMap<i16, usize>>>,
    forwarded: watch::Sender<usize>,
}

/// Relays one connection: the client's frames are read as they come (so that every request it
/// has sent is counted) and written to the node in order, each when the relay does not hold its
/// kind, and a produce request only once every earlier one is forwarded; the node's bytes go
/// back as they are.
fn connect(client: TcpStream, upstream: TcpStream, order: Order) -> [AbortHandle; 3] {
    let Order {
        mut holding,
        seen,
        by_key,
        forwarded,
    } = order;
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_node, mut to_node) = upstream.into_split();
    // Each frame with its number among the produce requests, if it is one.
    let (frames, mut queued) = mpsc::unbounded_channel::<(Vec<u8>, Option<usize>)>();
    let read = tokio::spawn(async move {
        loop {
            let mut size = [0u8; 4];
            if from_client.read_exact(&mut size).await.is_err() {
                return; // closed: what was read is still forwarded, as bytes on a wire are
            }
            let mut frame = size.to_vec();
            frame.resize(4 + i32::from_be_bytes(size).max(0) as usize, 0);
            if from_client.read_exact(&mut frame[4..]).await.is_err() {
                return;
            }
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
    let write = tokio::spawn(async move {
        let mut turn = forwarded.subscribe();
        // Once the node's side is broken, the frames still queued are dropped, as a broken
        // connection drops them; the produce requests among them still take their turn, so
        // that the other connections' later ones go on.
        let mut broken = false;
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
            broken = broken || to_node.write_all(&frame).await.is_err();
            if number.is_some() {
                forwarded.send_modify(|done| *done += 1);
            }
        }
        // The client closed: the node's side stays open until the node closes it, so that
        // what was forwarded last is still read and answered.
        std::future::pending::<()>().await;
    });
    let back = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_node, &mut to_client).await;
    });
    [
        read.abort_handle(),
        write.abort_handle(),
        back.abort_handle(),
    ]
}

/// The API key of a request frame (its first two bytes after the length).
fn api_key(frame: &[u8]) -> Option<i16> {
    frame.get(4..6).map(|k| i16::from_be_bytes([k[0], k[1]]))
}
