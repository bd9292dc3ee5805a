//! The pool feed: one background thread per filter config (not an Envoy worker) holds one
//! `WatchPool` stream per pool to its agents over gRPC (tonic), applies each event to a
//! router of its own and publishes the encoded pool state; workers install a new state when
//! its version moved (one atomic load per pick otherwise). The same split as the wasm filter's
//! subscriber VM and shared data, with a thread and a mutex instead of shared data.
//!
//! Guard mode (the inference pod's own inbound sidecar) holds one `Watch` stream to the local
//! agent instead (the first pool's agents: that pod only) and keeps the pod's signals for the
//! request hooks ([`Shared::local`]), as the core's [`LocalSignals::after_event`] reads them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ai_lb_filter_core::admission::guard::LocalSignals;
use ai_lb_filter_core::config::{FilterConfig, Mode};
use ai_lb_filter_core::feed::{Backoff, Subscription};
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::Counters as CoreCounters;
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{WatchPoolRequest, WatchRequest};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::host::{self, Level};

/// Milliseconds since the Unix epoch (the clock the agents stamp snapshots with).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// One pool's published state.
#[derive(Debug, Default)]
pub struct Slot {
    /// Bumped after every publish; 0 = nothing published yet.
    pub version: AtomicU64,
    bytes: Mutex<Arc<Vec<u8>>>,
}

impl Slot {
    fn publish(&self, bytes: Vec<u8>) {
        if let Ok(mut b) = self.bytes.lock() {
            *b = Arc::new(bytes);
        }
        self.version.fetch_add(1, Ordering::Release);
    }

    /// The latest encoded state and its version.
    pub fn read(&self) -> (u64, Arc<Vec<u8>>) {
        let v = self.version.load(Ordering::Acquire);
        let b = self
            .bytes
            .lock()
            .map(|b| Arc::clone(&b))
            .unwrap_or_default();
        (v, b)
    }
}

/// What the feed thread shares with the workers.
#[derive(Debug)]
pub struct Shared {
    pub pools: Vec<Slot>,
    /// `WatchPool` streams opened (`ailb.stream.opens`), that could not be opened (the agent
    /// unreachable or refusing: `ailb.stream.failures`), and that ended or fell silent after
    /// opening (`ailb.stream.closes`); each failure or close is followed by a reconnect. The
    /// wasm filter's names; its streams go through an Envoy cluster, so an unreachable agent
    /// shows there as a close rather than a failure to open.
    pub stream_opens: Tally,
    pub stream_failures: Tally,
    pub stream_closes: Tally,
    /// The feed routers' own counters (the core's, in `Counters::iter` order), added as they
    /// apply events; the workers add them to Envoy's `ailb.<name>`.
    pub feed_counters: [Tally; CoreCounters::COUNT],
    /// Hooks that found their worker's routing state in use (a re-entered hook) and left
    /// the request to Envoy's balancing (`ailb.state_busy`).
    pub busy: Tally,
    /// Guard mode: the local pod's signals as last received (None: nothing yet).
    pub local: Mutex<Option<LocalSignals>>,
}

// By hand: `Default` is derived for arrays of at most 32 elements, and the core has more
// counters than that.
impl Default for Shared {
    fn default() -> Self {
        Self {
            pools: Vec::new(),
            stream_opens: Tally::default(),
            stream_failures: Tally::default(),
            stream_closes: Tally::default(),
            feed_counters: std::array::from_fn(|_| Tally::default()),
            busy: Tally::default(),
            local: Mutex::new(None),
        }
    }
}

impl Shared {
    /// Guard mode: the local pod's signals for a request hook (None: nothing received yet, or
    /// the lock poisoned, which the guard treats as missing signals: it admits, counted).
    pub fn local_signals(&self) -> Option<LocalSignals> {
        self.local.lock().ok().and_then(|l| *l)
    }
}

/// A count the feed thread or any worker adds to, and the part of it already added to Envoy's
/// counter (by whichever worker exported last).
#[derive(Debug, Default)]
pub struct Tally {
    total: AtomicU64,
    exported: AtomicU64,
}

impl Tally {
    pub fn add(&self, n: u64) {
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    /// What was added since the last call (by any thread), now counted as exported. Two plain
    /// loads when nothing was added.
    pub fn take_new(&self) -> u64 {
        let total = self.total.load(Ordering::Relaxed);
        if total <= self.exported.load(Ordering::Relaxed) {
            return 0;
        }
        let before = self.exported.fetch_max(total, Ordering::Relaxed);
        total.saturating_sub(before)
    }
}

/// The running feed; dropping it stops the thread (within one reconnect or heartbeat wait).
#[derive(Debug)]
pub struct Feed {
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the feed thread for `cfg`'s pools.
pub fn start(
    cfg: &FilterConfig,
    agents: &[Vec<SocketAddr>],
    shared: Arc<Shared>,
) -> Result<Feed, String> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let cfg = cfg.clone();
    let agents = agents.to_vec();
    let thread = std::thread::Builder::new()
        .name("ai-lb-feed".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    host::log(Level::Error, &format!("ai-lb native: no runtime: {e}"));
                    return;
                }
            };
            rt.block_on(async move {
                let mut tasks = Vec::new();
                if cfg.mode == Mode::Guard {
                    // One pod: the first pool's agents (the config's only pool in guard mode).
                    if let Some(addrs) = agents.into_iter().next() {
                        watch(0, cfg, addrs, shared, rx).await;
                    }
                    return;
                }
                for (i, addrs) in agents.into_iter().enumerate() {
                    tasks.push(tokio::spawn(watch(
                        i,
                        cfg.clone(),
                        addrs,
                        Arc::clone(&shared),
                        rx.clone(),
                    )));
                }
                for t in tasks {
                    let _ = t.await;
                }
            });
        })
        .map_err(|e| format!("ai-lb native: cannot start the feed thread: {e}"))?;
    Ok(Feed {
        stop: Some(tx),
        thread: Some(thread),
    })
}

/// Keeps pool `i` subscribed until stopped: connects to its agents in turn, applies every
/// event, publishes the state. When to reconnect is the core's [`Subscription`] (the wasm
/// filter's too): exponential backoff with jitter after streams that delivered nothing, the
/// base delay after one that did, and a stream silent for three heartbeats is given up.
async fn watch(
    i: usize,
    cfg: FilterConfig,
    addrs: Vec<SocketAddr>,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let w = cfg.watch;
    let guard = cfg.mode == Mode::Guard;
    let gpu_signal = cfg.cutoffs.gpu_signal;
    let name = cfg.pools.get(i).map(|p| p.name.clone()).unwrap_or_default();
    let mut sub = Subscription::new(Backoff::from_watch(&w));
    let idle = Duration::from_millis(sub.idle_timeout_ms());
    let mut rng = SmallRng::seed_from_u64(now_ms() ^ (i as u64).wrapping_mul(0x9e37_79b9));
    let mut router = Router::new(cfg);
    // The router's counters as last added to `shared.feed_counters`.
    let mut seen = [0u64; CoreCounters::COUNT];
    let mut turn = 0usize;
    let mut token = 0u32;
    loop {
        if *stop.borrow() {
            return;
        }
        let wait = sub.wait_ms(now_ms()).unwrap_or(0);
        if wait > 0 {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait)) => {},
                _ = stop.changed() => return,
            }
        }
        let Some(addr) = addrs.get(turn % addrs.len().max(1)).copied() else {
            return;
        };
        turn += 1;
        token = token.wrapping_add(1);
        sub.opened(token, now_ms());
        let ended = if guard {
            let run = guard_stream_once(
                addr,
                &shared,
                idle,
                gpu_signal,
                WatchRequest {
                    min_interval_ms: w.min_interval_ms,
                    heartbeat_ms: w.heartbeat_ms,
                },
            );
            tokio::select! {
                r = run => r,
                _ = stop.changed() => return,
            }
        } else {
            let run = stream_once(
                i,
                &mut router,
                addr,
                &shared,
                &mut seen,
                idle,
                WatchPoolRequest {
                    min_interval_ms: w.min_interval_ms,
                    heartbeat_ms: w.heartbeat_ms,
                },
            );
            tokio::select! {
                r = run => r,
                _ = stop.changed() => return,
            }
        };
        let now = now_ms();
        match ended {
            Ended::NotOpened => shared.stream_failures.add(1),
            Ended::Closed { events } => {
                shared.stream_closes.add(1);
                if events {
                    sub.message(token, now);
                }
            }
        }
        sub.closed(token, now, rng.random::<f64>());
        host::log(
            Level::Warn,
            &format!(
                "ai-lb native: pool `{name}`: stream to {addr} ended; reconnecting in {} ms",
                sub.wait_ms(now).unwrap_or(0)
            ),
        );
    }
}

/// How one stream ended.
enum Ended {
    /// It could not be opened (no connection, or the agent refused the call).
    NotOpened,
    /// It was open and ended or fell silent; `events`: it delivered some.
    Closed { events: bool },
}

/// Reads an open stream until it ends or stays silent for `idle`, handing each event to
/// `apply`, which ends it early by returning false.
async fn read_events<T>(
    mut s: tonic::Streaming<T>,
    idle: Duration,
    mut apply: impl FnMut(T) -> bool,
) -> Ended {
    let mut any = false;
    loop {
        let ev = match tokio::time::timeout(idle, s.message()).await {
            Ok(Ok(Some(ev))) => ev,
            _ => return Ended::Closed { events: any },
        };
        any = true;
        if !apply(ev) {
            return Ended::Closed { events: any };
        }
    }
}

/// A client of the agent at `addr` (None: no connection).
async fn client(addr: SocketAddr) -> Option<MetricsServiceClient<tonic::transport::Channel>> {
    MetricsServiceClient::connect(format!("http://{addr}"))
        .await
        .ok()
}

/// One stream's life.
async fn stream_once(
    i: usize,
    router: &mut Router,
    addr: SocketAddr,
    shared: &Shared,
    seen: &mut [u64; CoreCounters::COUNT],
    idle: Duration,
    req: WatchPoolRequest,
) -> Ended {
    let Some(mut client) = client(addr).await else {
        return Ended::NotOpened;
    };
    let Ok(resp) = client.watch_pool(req).await else {
        return Ended::NotOpened;
    };
    shared.stream_opens.add(1);
    read_events(resp.into_inner(), idle, |ev| {
        router.apply_pool_event(i, &ev, now_ms());
        let encoded = router.pool_state(i).map(|st| st.encode());
        if encoded.is_none() {
            router.counters_mut().pool_decode_errors += 1;
        }
        for ((_, v), (tally, last)) in router
            .counters()
            .iter()
            .iter()
            .zip(shared.feed_counters.iter().zip(seen.iter_mut()))
        {
            if *v > *last {
                tally.add(*v - *last);
                *last = *v;
            }
        }
        if let (Some(bytes), Some(slot)) = (encoded, shared.pools.get(i)) {
            slot.publish(bytes);
        }
        true
    })
    .await
}

/// Guard mode: one `Watch` stream's life. Each event updates the local pod's signals (a
/// snapshot replaces them, a heartbeat confirms them as of now); an event that does not apply
/// leaves them as they were, to go stale if nothing better comes.
async fn guard_stream_once(
    addr: SocketAddr,
    shared: &Shared,
    idle: Duration,
    gpu_signal: ai_lb_filter_core::GpuSignal,
    req: WatchRequest,
) -> Ended {
    let Some(mut client) = client(addr).await else {
        return Ended::NotOpened;
    };
    let Ok(resp) = client.watch(req).await else {
        return Ended::NotOpened;
    };
    shared.stream_opens.add(1);
    read_events(resp.into_inner(), idle, |ev| {
        let Ok(mut local) = shared.local.lock() else {
            return false;
        };
        if let Some(next) = LocalSignals::after_event(&ev, *local, now_ms(), gpu_signal) {
            *local = Some(next);
        }
        true
    })
    .await
}
