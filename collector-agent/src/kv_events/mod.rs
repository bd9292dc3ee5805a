//! Decides what the agent knows of its pod's prefix cache: it subscribes to the model
//! server's KV-event stream (vLLM's ZeroMQ PUB protocol, `vllm/distributed/kv_events.py`;
//! [`wire`] reads the messages), keeps the pod's cached blocks ([`view`]) and derives the
//! `PrefixCacheSummary` the sampler puts in every snapshot.
//!
//! The stream is at-most-once (PUB/SUB drops what a disconnected or slow subscriber misses),
//! so the sequence numbers are watched ([`Sequencer`]): a gap is replayed from the server's
//! replay socket when one is configured (vLLM's ROUTER protocol: send the first missing
//! sequence, get `[seq, payload]` frames up to an end marker of −1); a gap that cannot be
//! replayed whole clears the view (counted and logged), since a missed `BlockRemoved` would
//! leave a key listed that the pod no longer holds. A sequence that goes backwards is a
//! restarted publisher: the view is cleared too. The subscriber reconnects with jittered
//! exponential backoff. Garbage is counted and skipped with a log line naming what was wrong.

pub mod view;
pub mod wire;

use crate::sampler::stopped;
use ai_lb_proto::v1::PrefixCacheSummary;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use view::{Applied, PrefixView, Summary, SummaryError};
use wire::{Batch, WireError};
use zeromq::{Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// Default tokens per key block of the summary (`--prefix-block-tokens`).
pub const DEFAULT_BLOCK_TOKENS: u32 = 64;
/// Default budget of keys in the summary (`--prefix-max-keys`).
pub const DEFAULT_MAX_KEYS: usize = 4096;
/// How long a connection attempt may take before the subscriber backs off and retries.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the replay socket may take per frame.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// A summary is derived again at most this often while the view keeps changing: a full
/// cache (25 000 blocks) takes ~13 ms to derive in a release build, and the sampler
/// publishes every 20 ms. Sidecars see a change at most this much later.
pub const SUMMARY_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// Reconnection backoff: first delay and cap (each delay doubles, with ±25 % jitter).
const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What to subscribe to and how to summarise (validated by `config.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// `tcp://HOST:PORT` of the model server's PUB socket.
    pub endpoint: String,
    /// `tcp://HOST:PORT` of its replay (ROUTER) socket, if any.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (vLLM's default topic is empty).
    pub topic: String,
    /// Tokens per key block of the summary; a multiple of the pod's block size.
    pub block_tokens: u32,
    /// Most keys in one summary.
    pub max_keys: usize,
}

/// Counters and gauges for the agent's `/metrics`.
#[derive(Debug, Default)]
pub struct KvStats {
    pub connected: AtomicBool,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub batches: AtomicU64,
    pub stored: AtomicU64,
    pub removed: AtomicU64,
    pub cleared: AtomicU64,
    /// Events about other media or LoRA adapters' blocks.
    pub ignored: AtomicU64,
    /// Messages or events that could not be decoded.
    pub decode_errors: AtomicU64,
    /// Sequence gaps filled from the replay socket.
    pub gaps_replayed: AtomicU64,
    /// Sequence gaps that could not be filled (the view was cleared).
    pub gaps_lost: AtomicU64,
    /// Sequences that went backwards (publisher restarted; the view was cleared).
    pub restarts: AtomicU64,
    /// Batches applied from replays.
    pub replayed_batches: AtomicU64,
    pub blocks_tracked: AtomicU64,
    pub summary_keys: AtomicU64,
    pub summary_truncated: AtomicBool,
    /// Summaries that could not be derived (block size, no model known).
    pub summary_errors: AtomicU64,
}

/// What a sequence number says about the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first message seen (what came before is unknown).
    First,
    /// The next one.
    InOrder,
    /// `missing` batches were lost, starting at `from`.
    Gap { from: u64, missing: u64 },
    /// The sequence went back: the publisher restarted.
    Restart { last: u64 },
}

/// Follows the sequence numbers of one stream (pure).
#[derive(Debug, Clone, Default)]
pub struct Sequencer {
    last: Option<u64>,
}

impl Sequencer {
    pub fn check(&mut self, seq: u64) -> SeqVerdict {
        let verdict = match self.last {
            None => SeqVerdict::First,
            Some(l) if seq == l.wrapping_add(1) => SeqVerdict::InOrder,
            Some(l) if seq > l => SeqVerdict::Gap {
                from: l + 1,
                missing: seq - l - 1,
            },
            Some(l) => SeqVerdict::Restart { last: l },
        };
        self.last = Some(seq);
        verdict
    }

    /// Forgets the stream (a new connection may reach a restarted publisher).
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// The last summary derived, reused until the view or the model changes.
#[derive(Debug)]
struct Cached {
    generation: u64,
    model: String,
    summary: Result<Summary, SummaryError>,
    at: Instant,
}

/// The pod's prefix cache as the KV events tell it, shared by the subscriber task, the sampler
/// and `/metrics`.
#[derive(Debug)]
pub struct KvFeed {
    cfg: KvEventsConfig,
    view: Mutex<PrefixView>,
    cached: Mutex<Option<Cached>>,
    pub stats: KvStats,
    /// The last summary error logged, so each distinct one is logged once.
    logged: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl KvFeed {
    pub fn new(cfg: KvEventsConfig) -> Arc<KvFeed> {
        let view = PrefixView::new(cfg.block_tokens, cfg.max_keys);
        Arc::new(KvFeed {
            cfg,
            view: Mutex::new(view),
            cached: Mutex::new(None),
            stats: KvStats::default(),
            logged: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &KvEventsConfig {
        &self.cfg
    }

    fn log_once(&self, msg: String) {
        let mut l = lock(&self.logged);
        if l.as_deref() != Some(msg.as_str()) {
            tracing::error!("prefix-cache summary withheld: {msg}");
            *l = Some(msg);
        }
    }

    /// The summary for snapshots at `now`, keyed with `model_seed(model)`; `None` without a
    /// model name or when the key block size does not fit the pod's (logged once, counted).
    /// Derived again when the view or the model changed, at most every
    /// [`SUMMARY_MIN_INTERVAL`].
    pub fn summary(&self, model: Option<&str>, now: Instant) -> Option<PrefixCacheSummary> {
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            self.stats.summary_errors.fetch_add(1, Ordering::Relaxed);
            self.log_once(
                "no model name known to seed the keys: pass --model or let the model server \
                 answer GET /v1/models"
                    .into(),
            );
            return None;
        };
        let mut cached = lock(&self.cached);
        let generation = lock(&self.view).generation();
        let reuse = cached.as_ref().is_some_and(|c| {
            c.model == model
                && (c.generation == generation
                    || now.saturating_duration_since(c.at) < SUMMARY_MIN_INTERVAL)
        });
        if !reuse {
            let summary = lock(&self.view).summary(ai_lb_prefix::model_seed(model));
            *cached = Some(Cached {
                generation,
                model: model.to_string(),
                summary,
                at: now,
            });
        }
        let c = cached.as_ref()?;
        match &c.summary {
            Ok(s) => {
                self.stats
                    .summary_keys
                    .store(s.keys.len() as u64, Ordering::Relaxed);
                self.stats
                    .summary_truncated
                    .store(s.truncated, Ordering::Relaxed);
                Some(PrefixCacheSummary {
                    block_tokens: s.block_tokens,
                    keys: s.keys.clone(),
                    truncated: s.truncated,
                    model: model.to_string(),
                })
            }
            Err(e) => {
                self.stats.summary_errors.fetch_add(1, Ordering::Relaxed);
                let msg = e.to_string();
                drop(cached);
                self.log_once(msg);
                None
            }
        }
    }

    /// Applies one batch's events to the view.
    pub fn apply_batch(&self, batch: &Batch) {
        let mut view = lock(&self.view);
        for ev in &batch.events {
            match ev {
                Err(e) => {
                    self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "KV event skipped");
                }
                Ok(ev) => {
                    let counter = match ev {
                        wire::Event::Stored { .. } => &self.stats.stored,
                        wire::Event::Removed { .. } => &self.stats.removed,
                        wire::Event::Cleared => &self.stats.cleared,
                    };
                    match view.apply(ev) {
                        Applied::Ignored => {
                            self.stats.ignored.fetch_add(1, Ordering::Relaxed);
                        }
                        Applied::BlockSizeChanged { from, to } => {
                            counter.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(
                                from,
                                to,
                                "the pod's KV block size changed: view cleared"
                            );
                        }
                        Applied::Changed | Applied::Unchanged => {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        self.stats
            .blocks_tracked
            .store(view.blocks() as u64, Ordering::Relaxed);
    }

    /// Forgets every block, saying why.
    pub fn clear(&self, why: &str) {
        let mut view = lock(&self.view);
        view.clear();
        self.stats.blocks_tracked.store(0, Ordering::Relaxed);
        tracing::warn!("prefix-cache view cleared: {why}");
    }

    fn count_error(&self, e: &WireError) {
        self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "KV-event message skipped");
    }
}

/// Jittered exponential backoff.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Self {
            next: BACKOFF_START,
        }
    }

    fn reset(&mut self) {
        self.next = BACKOFF_START;
    }

    fn delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        d.mul_f64(rand::random_range(0.75..1.25))
    }
}

/// Subscribes until `shutdown`, reconnecting with backoff.
pub async fn run(feed: Arc<KvFeed>, mut shutdown: watch::Receiver<bool>) {
    let mut backoff = Backoff::new();
    let mut seq = Sequencer::default();
    loop {
        if *shutdown.borrow() {
            return;
        }
        let mut opts = SocketOptions::default();
        opts.connect_timeout(CONNECT_TIMEOUT);
        let mut sub = zeromq::SubSocket::with_options(opts);
        let cfg = feed.config().clone();
        let connect = async {
            sub.connect(&cfg.endpoint).await?;
            sub.subscribe(&cfg.topic).await
        };
        let connected = tokio::select! {
            r = connect => r,
            _ = stopped(&mut shutdown) => return,
        };
        if let Err(e) = connected {
            feed.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
            let d = backoff.delay();
            tracing::warn!(endpoint = %cfg.endpoint, error = %e, retry_in = ?d, "cannot subscribe to KV events");
            tokio::select! {
                _ = tokio::time::sleep(d) => continue,
                _ = stopped(&mut shutdown) => return,
            }
        }
        feed.stats.connects.fetch_add(1, Ordering::Relaxed);
        feed.stats.connected.store(true, Ordering::Relaxed);
        tracing::info!(endpoint = %cfg.endpoint, topic = %cfg.topic, "subscribed to KV events");
        loop {
            let msg = tokio::select! {
                m = sub.recv() => m,
                _ = stopped(&mut shutdown) => return,
            };
            match msg {
                Ok(m) => handle(&feed, &mut seq, m.into_vec()).await,
                Err(e) => {
                    tracing::warn!(endpoint = %cfg.endpoint, error = %e, "KV-event stream broken; reconnecting");
                    break;
                }
            }
        }
        feed.stats.connected.store(false, Ordering::Relaxed);
        let d = backoff.delay();
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = stopped(&mut shutdown) => return,
        }
        backoff.reset();
    }
}

/// Handles one received message: decode, check the sequence (replay or clear on a gap),
/// apply.
pub async fn handle<F: AsRef<[u8]>>(feed: &KvFeed, seq: &mut Sequencer, frames: Vec<F>) {
    let msg = match wire::decode_message(&frames) {
        Ok(m) => m,
        Err(e) => {
            feed.count_error(&e);
            return;
        }
    };
    feed.stats.batches.fetch_add(1, Ordering::Relaxed);
    match seq.check(msg.seq) {
        SeqVerdict::InOrder => {}
        SeqVerdict::First => {
            // What the pod cached before this message is unknown; a replay from 0 tells
            // what the server still buffers (best effort: nothing is cleared).
            if msg.seq > 0 {
                if let Some(batches) = replay(feed, 0, msg.seq).await {
                    apply_replayed(feed, &batches);
                }
            }
        }
        SeqVerdict::Restart { last } => {
            feed.stats.restarts.fetch_add(1, Ordering::Relaxed);
            feed.clear(&format!(
                "sequence went back from {last} to {} (publisher restarted)",
                msg.seq
            ));
            if msg.seq > 0 {
                if let Some(batches) = replay(feed, 0, msg.seq).await {
                    apply_replayed(feed, &batches);
                }
            }
        }
        SeqVerdict::Gap { from, missing } => {
            let whole = match replay(feed, from, msg.seq).await {
                Some(b) if b.keys().copied().eq(from..msg.seq) => Some(b),
                _ => None,
            };
            match whole {
                Some(batches) => {
                    feed.stats.gaps_replayed.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(from, missing, "KV-event gap replayed");
                    apply_replayed(feed, &batches);
                }
                None => {
                    feed.stats.gaps_lost.fetch_add(1, Ordering::Relaxed);
                    feed.clear(&format!(
                        "missed {missing} KV-event batches from sequence {from} and could not \
                         replay them"
                    ));
                }
            }
        }
    }
    feed.apply_batch(&msg.batch);
}

fn apply_replayed(feed: &KvFeed, batches: &BTreeMap<u64, Batch>) {
    for b in batches.values() {
        feed.stats.replayed_batches.fetch_add(1, Ordering::Relaxed);
        feed.apply_batch(b);
    }
}

/// Asks the replay socket for batches `from..until`; `None` without a replay socket or when
/// it fails. The batches it has, keyed by sequence.
async fn replay(feed: &KvFeed, from: u64, until: u64) -> Option<BTreeMap<u64, Batch>> {
    let endpoint = feed.config().replay_endpoint.clone()?;
    let mut opts = SocketOptions::default();
    opts.connect_timeout(CONNECT_TIMEOUT);
    let mut dealer = zeromq::DealerSocket::with_options(opts);
    let result = async {
        dealer.connect(&endpoint).await.map_err(|e| e.to_string())?;
        // A DEALER sends the empty delimiter a REQ socket would add.
        let req = ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| e.to_string())?;
        dealer.send(req).await.map_err(|e| e.to_string())?;
        let mut out = BTreeMap::new();
        loop {
            let m = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| format!("no reply within {REPLAY_TIMEOUT:?}"))?
                .map_err(|e| e.to_string())?;
            let frames = m.into_vec();
            // ["", seq, payload]
            let [_, seq, payload] = frames.as_slice() else {
                return Err(format!(
                    "replay reply has {} frames, expected 3",
                    frames.len()
                ));
            };
            let seq = <[u8; 8]>::try_from(seq.as_ref())
                .map_err(|_| format!("replay sequence frame has {} bytes", seq.len()))?;
            let seq = i64::from_be_bytes(seq);
            if seq < 0 {
                return Ok(out);
            }
            let seq = seq as u64;
            if seq >= until {
                continue;
            }
            match wire::decode_batch(payload) {
                Ok(b) => {
                    out.insert(seq, b);
                }
                Err(e) => feed.count_error(&e),
            }
        }
    }
    .await;
    match result {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!(endpoint = %endpoint, from, error = %e, "KV-event replay failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_fake_pod::kv_cache::KvEvent;
    use ai_lb_fake_pod::kv_events::{encode_batch, frames, WireFormat};

    #[test]
    fn sequencer_tells_order_gaps_and_restarts() {
        let mut s = Sequencer::default();
        assert_eq!(s.check(5), SeqVerdict::First);
        assert_eq!(s.check(6), SeqVerdict::InOrder);
        assert_eq!(
            s.check(9),
            SeqVerdict::Gap {
                from: 7,
                missing: 2
            }
        );
        assert_eq!(s.check(0), SeqVerdict::Restart { last: 9 });
        assert_eq!(s.check(1), SeqVerdict::InOrder);
        s.reset();
        assert_eq!(s.check(1), SeqVerdict::First);
    }

    fn cfg() -> KvEventsConfig {
        KvEventsConfig {
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            topic: String::new(),
            block_tokens: 16,
            max_keys: 100,
        }
    }

    fn msg(seq: u64, events: &[KvEvent]) -> Vec<bytes::Bytes> {
        frames("", seq, encode_batch(1.0, events, 0, WireFormat::Array))
    }

    fn stored(h: u64, parent: Option<u64>, t: u32) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![h],
            parent_block_hash: parent,
            token_ids: vec![t; 16],
            block_size: 16,
        }
    }

    /// A time far enough after the last derivation to derive again.
    fn later() -> Instant {
        static T: Mutex<Option<Instant>> = Mutex::new(None);
        let mut t = lock(&T);
        let next = t.map_or_else(Instant::now, |t| t + SUMMARY_MIN_INTERVAL);
        *t = Some(next);
        next
    }

    #[test]
    fn a_changing_view_is_summarised_at_most_every_interval() {
        let feed = KvFeed::new(cfg());
        let t0 = Instant::now();
        let apply = |h, p, t| {
            feed.apply_batch(
                &wire::decode_batch(&encode_batch(1.0, &[stored(h, p, t)], 0, WireFormat::Array))
                    .unwrap(),
            )
        };
        apply(1, None, 1);
        assert_eq!(feed.summary(Some("m"), t0).unwrap().keys.len(), 1);
        apply(2, Some(1), 2);
        let soon = t0 + SUMMARY_MIN_INTERVAL / 2;
        assert_eq!(
            feed.summary(Some("m"), soon).unwrap().keys.len(),
            1,
            "not yet"
        );
        let due = t0 + SUMMARY_MIN_INTERVAL;
        assert_eq!(feed.summary(Some("m"), due).unwrap().keys.len(), 2);
        // Another model is keyed at once.
        let other = feed.summary(Some("n"), due).unwrap();
        assert_eq!(other.model, "n");
    }

    #[tokio::test]
    async fn a_gap_without_replay_clears_the_view_and_says_so() {
        let feed = KvFeed::new(cfg());
        let mut seq = Sequencer::default();
        handle(&feed, &mut seq, msg(3, &[stored(1, None, 1)])).await;
        handle(&feed, &mut seq, msg(4, &[stored(2, Some(1), 2)])).await;
        assert_eq!(feed.summary(Some("m"), later()).unwrap().keys.len(), 2);
        // Batch 5 lost: what it said is unknown, so nothing before is trusted.
        handle(&feed, &mut seq, msg(6, &[stored(3, Some(2), 3)])).await;
        assert_eq!(feed.stats.gaps_lost.load(Ordering::Relaxed), 1);
        assert_eq!(feed.stats.blocks_tracked.load(Ordering::Relaxed), 1);
        assert!(
            feed.summary(Some("m"), later()).unwrap().keys.is_empty(),
            "block 3's chain is unknown"
        );
        // A restarted publisher: cleared too.
        handle(&feed, &mut seq, msg(0, &[stored(9, None, 9)])).await;
        assert_eq!(feed.stats.restarts.load(Ordering::Relaxed), 1);
        assert_eq!(feed.summary(Some("m"), later()).unwrap().keys.len(), 1);
        // Garbage is counted, not applied.
        handle(&feed, &mut seq, vec![bytes::Bytes::from_static(b"x")]).await;
        handle(&feed, &mut seq, frames("", 1, vec![0x92, 0x01])).await;
        assert_eq!(feed.stats.decode_errors.load(Ordering::Relaxed), 2);
        assert_eq!(feed.stats.batches.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn without_a_model_or_with_a_bad_block_size_there_is_no_summary() {
        let feed = KvFeed::new(KvEventsConfig {
            block_tokens: 24,
            ..cfg()
        });
        assert_eq!(feed.summary(None, later()), None);
        feed.apply_batch(
            &wire::decode_batch(&encode_batch(
                1.0,
                &[stored(1, None, 1)],
                0,
                WireFormat::Array,
            ))
            .unwrap(),
        );
        assert_eq!(feed.summary(Some("m"), later()), None);
        assert_eq!(feed.stats.summary_errors.load(Ordering::Relaxed), 2);
    }
}
