//! Decides what the fake pod's KV-cache event stream looks like on the wire and how it is
//! published: vLLM's ZeroMQ protocol (vllm-project/vllm `vllm/distributed/kv_events.py`,
//! `ZmqEventPublisher`, b4e69e0 and later; `examples/online_serving/kv_events_subscriber.py`
//! at 0ef0f42), written here from that description.
//!
//! - A PUB socket sends one multipart message per batch: the topic (UTF-8, vLLM's default
//!   empty), the batch's sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher),
//!   and the msgpack payload.
//! - The payload is msgspec's encoding of `KVEventBatch(ts, events, data_parallel_rank)` with
//!   `array_like=True, omit_defaults=True`: `[ts: float64, [event...], 0]`.
//! - Events are a tagged union. [`WireFormat::Array`] (vLLM up to v0.23, `array_like=True`,
//!   the tag first): `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
//!   [`WireFormat::Map`] (vLLM PR #42892, `array_like` dropped from the event structs; the
//!   batch stays an array as vLLM 0.26 sends it): `{"type": "BlockStored", "block_hashes": ...,
//!   "parent_block_hash": ..., "token_ids": ..., "block_size": ..., "lora_id": nil, "medium":
//!   "GPU", "lora_name": nil}` and likewise. Block hashes are msgpack unsigned integers (the
//!   pod's 64-bit block keys), `lora_id` nil, `medium` `"GPU"`.
//! - An optional ROUTER socket answers replay requests: a request frame holding a start
//!   sequence (8 bytes big-endian) gets every buffered batch from there as
//!   `[identity, "", seq, payload]`, then the end marker `[identity, "", -1 (8 bytes), ""]`.
//!   The last [`REPLAY_BUFFER`] batches are kept (vLLM's `buffer_steps` default).
//!
//! The engine hands batches over a bounded channel and never waits: a batch that does not fit
//! is dropped after taking its sequence number, so subscribers see the gap.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::ValueEnum;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv_cache::KvEvent;

/// Batches kept for replay requests (vLLM `KVEventsConfig.buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;
/// Batches waiting for the publisher task before new ones are dropped.
pub const QUEUE_BATCHES: usize = 4096;
/// vLLM's `medium` for GPU blocks.
pub const MEDIUM_GPU: &str = "GPU";

/// How each event is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WireFormat {
    /// msgspec `array_like=True`: positional arrays, the tag first (vLLM up to v0.23).
    Array,
    /// Tagged maps, the tag under `"type"` (vLLM after PR #42892).
    Map,
}

/// Where and how to publish (validated by `config.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsConfig {
    /// `tcp://HOST:PORT` of the PUB socket.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub format: WireFormat,
}

/// Ignores the result of a write into a `Vec<u8>`, which cannot fail.
fn w<T, E>(_: Result<T, E>) {}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    w(rmp::encode::write_array_len(out, hashes.len() as u32));
    for h in hashes {
        w(rmp::encode::write_uint(out, *h));
    }
}

fn write_event(out: &mut Vec<u8>, ev: &KvEvent, format: WireFormat) {
    let key = |out: &mut Vec<u8>, k: &str| {
        if format == WireFormat::Map {
            w(rmp::encode::write_str(out, k));
        }
    };
    let head = |out: &mut Vec<u8>, tag: &str, fields: u32| {
        match format {
            WireFormat::Array => w(rmp::encode::write_array_len(out, fields + 1)),
            WireFormat::Map => {
                w(rmp::encode::write_map_len(out, fields + 1));
                w(rmp::encode::write_str(out, "type"));
            }
        }
        w(rmp::encode::write_str(out, tag));
    };
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            let fields = if format == WireFormat::Map { 7 } else { 6 };
            head(out, "BlockStored", fields);
            key(out, "block_hashes");
            write_hashes(out, block_hashes);
            key(out, "parent_block_hash");
            match parent_block_hash {
                Some(p) => w(rmp::encode::write_uint(out, *p)),
                None => w(rmp::encode::write_nil(out)),
            }
            key(out, "token_ids");
            w(rmp::encode::write_array_len(out, token_ids.len() as u32));
            for t in token_ids {
                w(rmp::encode::write_uint(out, u64::from(*t)));
            }
            key(out, "block_size");
            w(rmp::encode::write_uint(out, u64::from(*block_size)));
            key(out, "lora_id");
            w(rmp::encode::write_nil(out));
            key(out, "medium");
            w(rmp::encode::write_str(out, MEDIUM_GPU));
            if format == WireFormat::Map {
                key(out, "lora_name");
                w(rmp::encode::write_nil(out));
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            head(out, "BlockRemoved", 2);
            key(out, "block_hashes");
            write_hashes(out, block_hashes);
            key(out, "medium");
            w(rmp::encode::write_str(out, MEDIUM_GPU));
        }
        KvEvent::AllBlocksCleared => head(out, "AllBlocksCleared", 0),
    }
}

/// The msgpack payload of one batch: `[ts, [events], data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, format: WireFormat) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 96);
    w(rmp::encode::write_array_len(&mut out, 3));
    w(rmp::encode::write_f64(&mut out, ts));
    w(rmp::encode::write_array_len(&mut out, events.len() as u32));
    for ev in events {
        write_event(&mut out, ev, format);
    }
    w(rmp::encode::write_uint(&mut out, u64::from(dp_rank)));
    out
}

/// The three frames of one published batch.
pub fn frames(topic: &str, seq: u64, payload: Vec<u8>) -> Vec<Bytes> {
    vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ]
}

/// What the publisher has done, for `/sim/cache`.
#[derive(Debug, Default)]
pub struct PublisherStats {
    pub batches_published: AtomicU64,
    pub batches_dropped: AtomicU64,
    pub events_published: AtomicU64,
    pub replay_requests: AtomicU64,
}

/// One batch on its way to the publisher task.
#[derive(Debug)]
struct Outgoing {
    seq: u64,
    ts: f64,
    events: Vec<KvEvent>,
}

/// The engine's side of the stream: numbers batches and hands them over without waiting.
#[derive(Debug)]
pub struct EventSink {
    tx: mpsc::Sender<Outgoing>,
    next_seq: u64,
    stats: Arc<PublisherStats>,
}

impl EventSink {
    /// Queues one batch (the events of one engine step). A full queue drops it; its sequence
    /// number is used all the same, so subscribers see a gap.
    pub fn send(&mut self, events: Vec<KvEvent>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if self.tx.try_send(Outgoing { seq, ts, events }).is_err() {
            self.stats.batches_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn stats(&self) -> &Arc<PublisherStats> {
        &self.stats
    }
}

/// Addresses the sockets were bound to (port 0 resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind --kv-events-endpoint {endpoint}: {detail}")]
    Bind { endpoint: String, detail: String },
    #[error("cannot bind --kv-events-replay-endpoint {endpoint}: {detail}")]
    BindReplay { endpoint: String, detail: String },
}

/// Binds the sockets and spawns the publisher task; the sink goes to the engine.
pub async fn spawn(cfg: &EventsConfig) -> Result<(EventSink, Bound), StartError> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind(&cfg.endpoint)
        .await
        .map_err(|e| StartError::Bind {
            endpoint: cfg.endpoint.clone(),
            detail: e.to_string(),
        })?
        .to_string();
    let mut replay = None;
    let mut replay_endpoint = None;
    if let Some(r) = &cfg.replay_endpoint {
        let mut router = zeromq::RouterSocket::new();
        let bound = router.bind(r).await.map_err(|e| StartError::BindReplay {
            endpoint: r.clone(),
            detail: e.to_string(),
        })?;
        replay_endpoint = Some(bound.to_string());
        replay = Some(router);
    }
    let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
    let stats = Arc::new(PublisherStats::default());
    tokio::spawn(publish_loop(
        publisher,
        replay,
        rx,
        cfg.topic.clone(),
        cfg.format,
        stats.clone(),
    ));
    Ok((
        EventSink {
            tx,
            next_seq: 0,
            stats,
        },
        Bound {
            endpoint,
            replay_endpoint,
        },
    ))
}

/// Sends queued batches and answers replay requests until the sink is dropped.
async fn publish_loop(
    mut publisher: zeromq::PubSocket,
    mut replay: Option<zeromq::RouterSocket>,
    mut rx: mpsc::Receiver<Outgoing>,
    topic: String,
    format: WireFormat,
    stats: Arc<PublisherStats>,
) {
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    loop {
        let request = async {
            match replay.as_mut() {
                Some(r) => r.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            batch = rx.recv() => {
                let Some(b) = batch else { return };
                let payload = Bytes::from(encode_batch(b.ts, &b.events, 0, format));
                let msg = frames(&topic, b.seq, payload.to_vec());
                let Ok(msg) = ZmqMessage::try_from(msg) else { continue };
                if let Err(e) = publisher.send(msg).await {
                    tracing::warn!(error = %e, seq = b.seq, "KV-event batch not published");
                    stats.batches_dropped.fetch_add(1, Ordering::Relaxed);
                } else {
                    stats.batches_published.fetch_add(1, Ordering::Relaxed);
                    stats.events_published.fetch_add(b.events.len() as u64, Ordering::Relaxed);
                }
                buffer.push_back((b.seq, payload));
                if buffer.len() > REPLAY_BUFFER {
                    buffer.pop_front();
                }
            }
            req = request => {
                match req {
                    Ok(m) => {
                        stats.replay_requests.fetch_add(1, Ordering::Relaxed);
                        if let Some(r) = replay.as_mut() {
                            serve_replay(r, m, &buffer).await;
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "replay socket"),
                }
            }
        }
    }
}

/// Answers one replay request `[identity, "", start_seq]` (a REQ client's envelope; a
/// DEALER sends the empty frame itself).
async fn serve_replay(
    router: &mut zeromq::RouterSocket,
    request: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let frames = request.into_vec();
    let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
        tracing::warn!(
            frames = frames.len(),
            "invalid replay request: start sequence is not 8 bytes"
        );
        return;
    };
    let start = u64::from_be_bytes(start);
    let reply = |seq: Bytes, payload: Bytes| {
        ZmqMessage::try_from(vec![id.clone(), Bytes::new(), seq, payload]).ok()
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if let Some(m) = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()) {
            if router.send(m).await.is_err() {
                return;
            }
        }
    }
    if let Some(m) = reply(Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()) {
        let _ = router.send(m).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![1, u64::MAX],
            parent_block_hash: None,
            token_ids: vec![5, 300],
            block_size: 1,
        }
    }

    /// Byte-exact against msgspec's encoding of the same batch, written out by hand from the
    /// msgpack spec (fixarray 0x9N, fixstr 0xaN, float64 0xcb, uint16 0xcd, uint64 0xcf,
    /// nil 0xc0), as `msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[...],
    /// data_parallel_rank=0))` writes it with vLLM's array_like structs.
    #[test]
    fn array_batch_is_msgspecs_bytes() {
        let got = encode_batch(
            1.5,
            &[
                stored(),
                KvEvent::BlockRemoved {
                    block_hashes: vec![7],
                },
                KvEvent::AllBlocksCleared,
            ],
            0,
            WireFormat::Array,
        );
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        // ["BlockStored", [1, 2^64-1], nil, [5, 300], 1, nil, "GPU"]
        want.push(0x97);
        want.push(0xab);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0x01, 0xcf]);
        want.extend_from_slice(&u64::MAX.to_be_bytes());
        want.extend_from_slice(&[0xc0, 0x92, 0x05, 0xcd, 0x01, 0x2c, 0x01, 0xc0, 0xa3]);
        want.extend_from_slice(b"GPU");
        // ["BlockRemoved", [7], "GPU"]
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xa3]);
        want.extend_from_slice(b"GPU");
        // ["AllBlocksCleared"]
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        // data_parallel_rank
        want.push(0x00);
        assert_eq!(got, want);
    }

    #[test]
    fn map_events_carry_the_tag_under_type() {
        let got = encode_batch(
            0.0,
            &[KvEvent::BlockRemoved {
                block_hashes: vec![7],
            }],
            0,
            WireFormat::Map,
        );
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&0.0f64.to_be_bytes());
        want.extend_from_slice(&[0x91, 0x83, 0xa4]);
        want.extend_from_slice(b"type");
        want.push(0xac);
        want.extend_from_slice(b"BlockRemoved");
        want.push(0xac);
        want.extend_from_slice(b"block_hashes");
        want.extend_from_slice(&[0x91, 0x07, 0xa6]);
        want.extend_from_slice(b"medium");
        want.push(0xa3);
        want.extend_from_slice(b"GPU");
        want.push(0x00);
        assert_eq!(got, want);
        let stored = encode_batch(0.0, &[stored()], 0, WireFormat::Map);
        assert_eq!(stored[11], 0x88, "BlockStored map: type + 7 fields");
    }

    #[test]
    fn frames_are_topic_sequence_payload() {
        let f = frames("kv", 258, vec![1]);
        assert_eq!(f[0].as_ref(), b"kv");
        assert_eq!(f[1].as_ref(), &[0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(f[2].as_ref(), &[1]);
    }
}
