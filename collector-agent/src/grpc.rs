//! The gRPC face of the agent: `MetricsService` (`Snapshot`, `Watch`, `WatchPool`) plus
//! `grpc.health.v1` and server reflection, and the wiring that starts sampler, pool, gRPC and
//! HTTP servers together and stops them gracefully (open streams end with `UNAVAILABLE
//! "agent shutting down"` in trailers, never a connection reset). The caps on what a peer may
//! hold (connections, subscriptions, message sizes, slow readers) are decided in
//! [`crate::ports`]; this module applies the subscription caps and drops slow subscribers.

use crate::config::AgentConfig;
use crate::pool::{run_pool, DnsResolver, PoolConfig, PoolView, Resolve};
use crate::ports::{self, ConnHandle, Full, Gate, Port, PortStats, Reason, ServeArgs, Slot};
use crate::sampler::{stopped, Clock, Hub, IdentityConfig, Sampler};
use crate::sources::Source;
use ai_lb_proto::v1::metrics_service_server::{MetricsService, MetricsServiceServer};
use ai_lb_proto::v1::{
    watch_event, Heartbeat, PeerState, PeerStatus, PodSnapshot, PoolEvent, SnapshotRequest,
    WatchEvent, WatchPoolRequest, WatchRequest,
};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// A full pool event is sent every this many heartbeat periods.
pub const FULL_EVERY_HEARTBEATS: u32 = 10;

/// What a subscription (`Watch`, `WatchPool`) may hold, and the counters it feeds.
#[derive(Debug)]
pub struct StreamCaps {
    /// Subscription places per peer IP and in total.
    pub gate: Arc<Gate>,
    /// A subscriber that leaves an event untaken this long is dropped.
    pub send_timeout: Duration,
    pub stats: Arc<PortStats>,
}

impl StreamCaps {
    /// A subscription place for the peer of `req`, or `RESOURCE_EXHAUSTED` naming the cap
    /// (counted).
    fn admit<T>(&self, req: &Request<T>, rpc: &str) -> Result<Slot, Status> {
        let peer = ports::peer_ip(req);
        self.gate.try_enter(peer).map_err(|full| {
            let (reason, what) = match full {
                Full::PerPeer => (
                    Reason::StreamsPerPeer,
                    format!("from {peer} (--grpc-max-streams-per-peer)"),
                ),
                Full::Total => (
                    Reason::StreamsTotal,
                    "in total (--grpc-max-streams)".to_string(),
                ),
            };
            self.stats.count(Port::Grpc, reason);
            tracing::debug!(peer = %peer, rpc, reason = reason.label(), "stream refused");
            Status::resource_exhausted(format!("too many Watch/WatchPool streams {what}"))
        })
    }
}

/// A response stream that holds its subscription place until hyper drops it (the stream is
/// done on the wire, not merely when its task ends).
struct Held<S> {
    inner: S,
    _slot: Slot,
}

impl<S: tokio_stream::Stream + Unpin> tokio_stream::Stream for Held<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Events queued per stream beyond the one HTTP/2 is sending: a subscriber that reads slowly
/// gets the latest snapshot when it catches up, never a backlog.
const STREAM_QUEUE: usize = 1;

/// Stream and event counters for `/metrics`.
#[derive(Debug, Default)]
pub struct StreamStats {
    pub watch_open: AtomicU64,
    pub pool_open: AtomicU64,
    pub watch_events: AtomicU64,
    pub pool_events: AtomicU64,
}

struct OpenGuard<'a>(&'a AtomicU64);
impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The `MetricsService` implementation over a [`Hub`] and a [`PoolView`].
#[derive(Clone)]
pub struct MetricsSvc {
    pub hub: Arc<Hub>,
    pub pool: Arc<PoolView>,
    /// How this agent names itself in pool events (its gRPC `host:port`).
    pub self_peer: String,
    pub min_interval: Duration,
    pub heartbeat: Duration,
    pub shutdown: watch::Receiver<bool>,
    pub stats: Arc<StreamStats>,
    pub clock: Arc<dyn Clock>,
    pub caps: Arc<StreamCaps>,
}

fn shutting_down() -> Status {
    Status::unavailable("agent shutting down")
}

fn ms_or(v: u32, default: Duration) -> Duration {
    if v == 0 {
        default
    } else {
        Duration::from_millis(u64::from(v))
    }
}

/// The shortest gap between two pushes on one stream when an urgent change is pending.
pub const URGENT_MIN_GAP: Duration = Duration::from_millis(5);

/// Waits until a stream may push again: `last_push + min`, or `last_push + URGENT_MIN_GAP`
/// (when `min` is longer) as soon as an urgent change is pending on `urgent` or `also`, which
/// are marked seen on return. `false` if shutdown came first.
async fn wait_push(
    last_push: Instant,
    min: Duration,
    urgent: &mut watch::Receiver<u64>,
    mut also: Option<&mut watch::Receiver<u64>>,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let soon = last_push + min.min(URGENT_MIN_GAP);
    let late = last_push + min;
    let mut pending = urgent.has_changed().unwrap_or(false)
        || also
            .as_ref()
            .is_some_and(|r| r.has_changed().unwrap_or(false));
    // A receiver whose sender is gone stops being listened to.
    let (mut a_live, mut b_live) = (true, also.is_some());
    loop {
        if *shutdown.borrow() {
            return false;
        }
        let deadline = if pending { soon } else { late };
        if Instant::now() >= deadline {
            break;
        }
        let b_changed = async {
            match also.as_mut() {
                Some(r) => r.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            _ = stopped(shutdown) => return false,
            r = urgent.changed(), if a_live && !pending => match r {
                Ok(()) => pending = true,
                Err(_) => a_live = false,
            },
            r = b_changed, if b_live && !pending => match r {
                Ok(()) => pending = true,
                Err(_) => b_live = false,
            },
        }
    }
    urgent.borrow_and_update();
    if let Some(r) = also {
        r.borrow_and_update();
    }
    true
}

impl MetricsSvc {
    /// A stream's push interval and heartbeat from its request: 0 means the agent's configured
    /// default; heartbeats no faster than every 10 ms. Shared by `Watch` and `WatchPool`.
    fn stream_intervals(&self, min_interval_ms: u32, heartbeat_ms: u32) -> (Duration, Duration) {
        (
            ms_or(min_interval_ms, self.min_interval),
            ms_or(heartbeat_ms, self.heartbeat).max(Duration::from_millis(10)),
        )
    }

    /// Hands `ev` to a stream's queue: `false` if the subscriber is gone, or left the queue
    /// full for the send timeout. Such a slow reader's connection is closed (counted), which
    /// frees what HTTP/2 buffered for it; until then it only ever gets the latest.
    async fn push<T>(
        &self,
        tx: &mpsc::Sender<Result<T, Status>>,
        ev: Result<T, Status>,
        conn: Option<&ConnHandle>,
        rpc: &str,
    ) -> bool {
        match tokio::time::timeout(self.caps.send_timeout, tx.send(ev)).await {
            Ok(r) => r.is_ok(),
            Err(_) => {
                // Counted once per connection closed; without a connection (a handler called
                // directly), once per stream.
                if conn.is_none_or(|c| c.close()) {
                    self.caps.stats.count(Port::Grpc, Reason::SlowReader);
                    tracing::warn!(rpc, timeout = ?self.caps.send_timeout, "subscriber took no event within the send timeout: dropping it and closing its connection");
                }
                false
            }
        }
    }

    fn self_state(&self, now: std::time::Instant) -> PeerState {
        match self.hub.latest() {
            Some(p) => PeerState {
                peer: self.self_peer.clone(),
                status: PeerStatus::Live as i32,
                snapshot: Some(p.render(now)),
                reason: String::new(),
            },
            None => PeerState {
                peer: self.self_peer.clone(),
                status: PeerStatus::Connecting as i32,
                snapshot: None,
                reason: "no sample taken yet".into(),
            },
        }
    }

    fn pool_event(&self, full: bool, peers: Vec<PeerState>) -> PoolEvent {
        PoolEvent {
            full,
            peers,
            time_unix_ms: self.clock.unix_ms(),
            agent_instance: self.hub.agent_instance().to_string(),
        }
    }

    async fn run_watch(
        self,
        tx: mpsc::Sender<Result<WatchEvent, Status>>,
        min: Duration,
        hb: Duration,
        conn: Option<ConnHandle>,
    ) {
        let conn = conn.as_ref();
        let _open = OpenGuard(&self.stats.watch_open);
        let mut shutdown = self.shutdown.clone();
        let mut stop = self.shutdown.clone();
        let mut changes = self.hub.subscribe();
        changes.borrow_and_update();
        let mut urgent = self.hub.subscribe_urgent();
        urgent.borrow_and_update();
        let send = |ev: watch_event::Event| {
            self.stats.watch_events.fetch_add(1, Ordering::Relaxed);
            self.push(&tx, Ok(WatchEvent { event: Some(ev) }), conn, "Watch")
        };
        // The first event is the full current snapshot (waiting for the first sample).
        let first = loop {
            if let Some(p) = self.hub.latest() {
                break p;
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                _ = stopped(&mut shutdown) => { self.push(&tx, Err(shutting_down()), conn, "Watch").await; return }
                _ = tx.closed() => return,
            }
        };
        if !send(watch_event::Event::Snapshot(first.render(self.clock.now()))).await {
            return;
        }
        let mut last_push = Instant::now();
        let mut last_send = last_push;
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut stop) => break,
                _ = tx.closed() => return,
                r = changes.changed() => {
                    if r.is_err() { return }
                    if !wait_push(last_push, min, &mut urgent, None, &mut shutdown).await { break }
                    changes.borrow_and_update();
                    let Some(p) = self.hub.latest() else { continue };
                    if !send(watch_event::Event::Snapshot(p.render(self.clock.now()))).await { return }
                    last_push = Instant::now();
                    last_send = last_push;
                }
                _ = tokio::time::sleep_until(last_send + hb) => {
                    let sequence = self.hub.latest().map(|p| p.snapshot.sequence).unwrap_or(0);
                    let beat = Heartbeat { time_unix_ms: self.clock.unix_ms(), sequence };
                    if !send(watch_event::Event::Heartbeat(beat)).await { return }
                    last_send = Instant::now();
                }
            }
        }
        self.push(&tx, Err(shutting_down()), conn, "Watch").await;
    }

    async fn run_pool_stream(
        self,
        tx: mpsc::Sender<Result<PoolEvent, Status>>,
        min: Duration,
        hb: Duration,
        conn: Option<ConnHandle>,
    ) {
        let conn = conn.as_ref();
        let _open = OpenGuard(&self.stats.pool_open);
        let mut shutdown = self.shutdown.clone();
        let mut stop = self.shutdown.clone();
        let mut pool_rx = self.pool.subscribe();
        let mut hub_rx = self.hub.subscribe();
        pool_rx.borrow_and_update();
        hub_rx.borrow_and_update();
        let mut pool_urgent = self.pool.subscribe_urgent();
        let mut hub_urgent = self.hub.subscribe_urgent();
        pool_urgent.borrow_and_update();
        hub_urgent.borrow_and_update();
        let full_every = hb * FULL_EVERY_HEARTBEATS;
        let send = |ev: PoolEvent| {
            self.stats.pool_events.fetch_add(1, Ordering::Relaxed);
            self.push(&tx, Ok(ev), conn, "WatchPool")
        };
        let full = |svc: &MetricsSvc| {
            let now = svc.clock.now();
            let (version, peers) = svc.pool.render(now, None);
            let mut all = vec![svc.self_state(now)];
            all.extend(peers);
            (version, svc.pool_event(true, all))
        };
        let (mut seen_version, first) = full(&self);
        if !send(first).await {
            return;
        }
        let mut last_push = Instant::now();
        let mut last_send = last_push;
        let mut last_full = last_push;
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut stop) => break,
                _ = tx.closed() => return,
                r = pool_rx.changed() => {
                    if r.is_err() { return }
                    if !wait_push(last_push, min, &mut pool_urgent, Some(&mut hub_urgent), &mut shutdown).await { break }
                    pool_rx.borrow_and_update();
                    let self_changed = hub_rx.has_changed().unwrap_or(false);
                    hub_rx.borrow_and_update();
                    let now = self.clock.now();
                    let (version, mut peers) = self.pool.render(now, Some(seen_version));
                    seen_version = version;
                    if self_changed { peers.insert(0, self.self_state(now)); }
                    if peers.is_empty() { continue }
                    if !send(self.pool_event(false, peers)).await { return }
                    last_push = Instant::now();
                    last_send = last_push;
                }
                r = hub_rx.changed() => {
                    if r.is_err() { return }
                    if !wait_push(last_push, min, &mut hub_urgent, Some(&mut pool_urgent), &mut shutdown).await { break }
                    hub_rx.borrow_and_update();
                    let pool_changed = pool_rx.has_changed().unwrap_or(false);
                    pool_rx.borrow_and_update();
                    let now = self.clock.now();
                    let mut peers = vec![self.self_state(now)];
                    if pool_changed {
                        let (version, changed) = self.pool.render(now, Some(seen_version));
                        seen_version = version;
                        peers.extend(changed);
                    }
                    if !send(self.pool_event(false, peers)).await { return }
                    last_push = Instant::now();
                    last_send = last_push;
                }
                _ = tokio::time::sleep_until(last_full + full_every) => {
                    pool_rx.borrow_and_update();
                    hub_rx.borrow_and_update();
                    let (version, ev) = full(&self);
                    seen_version = version;
                    if !send(ev).await { return }
                    last_full = Instant::now();
                    last_send = last_full;
                }
                _ = tokio::time::sleep_until(last_send + hb) => {
                    if !send(self.pool_event(false, Vec::new())).await { return }
                    last_send = Instant::now();
                }
            }
        }
        self.push(&tx, Err(shutting_down()), conn, "WatchPool")
            .await;
    }
}

type EventStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl MetricsService for MetricsSvc {
    async fn snapshot(
        &self,
        _req: Request<SnapshotRequest>,
    ) -> Result<Response<PodSnapshot>, Status> {
        match self.hub.latest() {
            Some(p) => Ok(Response::new(p.render(self.clock.now()))),
            None => Err(Status::unavailable("no sample taken yet")),
        }
    }

    type WatchStream = EventStream<WatchEvent>;

    async fn watch(
        &self,
        req: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        if *self.shutdown.borrow() {
            return Err(shutting_down());
        }
        let slot = self.caps.admit(&req, "Watch")?;
        let conn = req.extensions().get::<ConnHandle>().cloned();
        let r = req.into_inner();
        let (min, hb) = self.stream_intervals(r.min_interval_ms, r.heartbeat_ms);
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        self.stats.watch_open.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(self.clone().run_watch(tx, min, hb, conn));
        Ok(Response::new(Box::pin(Held {
            inner: ReceiverStream::new(rx),
            _slot: slot,
        })))
    }

    type WatchPoolStream = EventStream<PoolEvent>;

    async fn watch_pool(
        &self,
        req: Request<WatchPoolRequest>,
    ) -> Result<Response<Self::WatchPoolStream>, Status> {
        if *self.shutdown.borrow() {
            return Err(shutting_down());
        }
        let slot = self.caps.admit(&req, "WatchPool")?;
        let conn = req.extensions().get::<ConnHandle>().cloned();
        let r = req.into_inner();
        let (min, hb) = self.stream_intervals(r.min_interval_ms, r.heartbeat_ms);
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        self.stats.pool_open.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(self.clone().run_pool_stream(tx, min, hb, conn));
        Ok(Response::new(Box::pin(Held {
            inner: ReceiverStream::new(rx),
            _slot: slot,
        })))
    }
}

/// Counts the requests tonic refuses before a handler sees them: a message over
/// `--grpc-max-request-bytes` (`OUT_OF_RANGE`, refused from its length prefix, never buffered)
/// and one that does not decode (`INTERNAL`). Both come back as trailers-only responses, so
/// their status is in the response headers. No handler of the agent answers with either code.
#[derive(Clone)]
struct CountRefusedMessages<S> {
    inner: S,
    stats: Arc<PortStats>,
}

impl<S, B, RB> tonic::codegen::Service<tonic::codegen::http::Request<B>> for CountRefusedMessages<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<RB>,
        > + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let stats = self.stats.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await?;
            let code = res
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map(tonic::Code::from_i32);
            match code {
                Some(tonic::Code::OutOfRange) => stats.count(Port::Grpc, Reason::MessageTooLarge),
                Some(tonic::Code::Internal) => stats.count(Port::Grpc, Reason::MalformedMessage),
                _ => {}
            }
            Ok(res)
        })
    }
}

/// How this agent names itself in pool events: its gRPC address, with an unspecified bind IP
/// replaced by the serving IP (the pod's IP).
pub fn self_peer_name(grpc_bound: SocketAddr, serving: SocketAddr) -> String {
    if grpc_bound.ip().is_unspecified() {
        SocketAddr::new(serving.ip(), grpc_bound.port()).to_string()
    } else {
        grpc_bound.to_string()
    }
}

/// A running agent: sampler, pool discovery, gRPC and HTTP servers.
pub struct RunningAgent {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub hub: Arc<Hub>,
    pub pool: Arc<PoolView>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RunningAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningAgent")
            .field("grpc_addr", &self.grpc_addr)
            .field("http_addr", &self.http_addr)
            .finish()
    }
}

impl RunningAgent {
    /// Ends every open stream with `UNAVAILABLE "agent shutting down"`, stops accepting and
    /// waits (at most `grace`) for the servers to finish.
    pub async fn shutdown(mut self, grace: Duration) {
        self.shutdown.send_replace(true);
        let all = futures::future::join_all(std::mem::take(&mut self.tasks));
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!("servers did not stop within {grace:?}");
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// What `start` needs besides the config.
pub struct StartArgs {
    pub sources: Vec<Box<dyn Source>>,
    /// Source names not configured (reported ABSENT).
    pub absent: Vec<&'static str>,
    pub grpc_listener: TcpListener,
    pub http_listener: TcpListener,
    pub clock: Arc<dyn Clock>,
    pub agent_instance: String,
    /// Resolves `--peers-dns`; `None` = the system resolver.
    pub resolver: Option<Arc<dyn Resolve>>,
}

/// Starts every part of the agent on already-bound listeners (so port 0 works and the caller
/// can print the bound addresses first).
pub fn start(cfg: &AgentConfig, args: StartArgs) -> std::io::Result<RunningAgent> {
    let grpc_addr = args.grpc_listener.local_addr()?;
    let http_addr = args.http_listener.local_addr()?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let hub = Hub::new(args.agent_instance.clone());
    let pool = PoolView::new();
    let stats = Arc::new(StreamStats::default());
    let self_peer = self_peer_name(grpc_addr, cfg.serving_address);
    let mut tasks = Vec::new();

    let identity = IdentityConfig {
        pod_name: cfg.pod_name.clone(),
        namespace: cfg.namespace.clone(),
        address: cfg.serving_address.to_string(),
        engine: cfg.engine.to_proto(),
        models: cfg.models.clone(),
        model_version: cfg.model_version.clone(),
        queue_capacity: cfg.queue_capacity,
        kv_capacity_tokens: cfg.kv_capacity_tokens,
    };
    let mut sampler = Sampler::new(
        args.sources,
        args.absent,
        identity,
        hub.clone(),
        args.clock.clone(),
        cfg.sample_interval,
    );
    if let Some(stall) = cfg.source_stall_after {
        sampler = sampler.with_stall_after(stall);
    }
    if let Some(oom) = cfg.oom {
        sampler = sampler.with_oom_watermark(oom);
    }
    let kv_feed = cfg.kv_events.clone().map(crate::kv_events::KvFeed::new);
    if let Some(feed) = &kv_feed {
        sampler = sampler.with_prefix_feed(feed.clone());
        tasks.push(tokio::spawn(crate::kv_events::run(
            feed.clone(),
            shutdown_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn(sampler.run(
        cfg.sample_interval,
        cfg.gpu_sample_interval,
        shutdown_rx.clone(),
    )));

    if !cfg.peers.is_empty() || cfg.peers_dns.is_some() {
        let mut self_addresses = vec![self_peer.clone(), grpc_addr.to_string()];
        if grpc_addr.ip().is_unspecified() || grpc_addr.ip().is_loopback() {
            self_addresses.push(format!("localhost:{}", grpc_addr.port()));
            self_addresses.push(format!("127.0.0.1:{}", grpc_addr.port()));
        }
        let pcfg = PoolConfig {
            static_peers: cfg.peers.clone(),
            dns: cfg.peers_dns.clone(),
            refresh: cfg.peers_refresh,
            stale_after: cfg.peer_stale_after,
            min_interval: cfg.watch_min_interval,
            heartbeat: cfg.heartbeat,
            self_addresses,
            self_instance: args.agent_instance.clone(),
            max_message_bytes: cfg.limits.grpc_max_message_bytes,
        };
        let resolver = args.resolver.unwrap_or_else(|| Arc::new(DnsResolver));
        tasks.push(tokio::spawn(run_pool(
            pcfg,
            pool.clone(),
            resolver,
            shutdown_rx.clone(),
        )));
    }

    let (health, health_svc) = tonic_health::server::health_reporter();
    {
        let hub = hub.clone();
        let health = health.clone();
        let mut shutdown = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            health
                .set_not_serving::<MetricsServiceServer<MetricsSvc>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            tokio::select! {
                _ = hub.first_sample() => {}
                _ = stopped(&mut shutdown) => return,
            }
            health
                .set_serving::<MetricsServiceServer<MetricsSvc>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::Serving)
                .await;
            stopped(&mut shutdown).await;
            health
                .set_not_serving::<MetricsServiceServer<MetricsSvc>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
        }));
    }
    let limits = &cfg.limits;
    let port_stats = Arc::new(PortStats::default());
    let (req_max, msg_max) = (limits.grpc_max_request_bytes, limits.grpc_max_message_bytes);
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ai_lb_proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(std::io::Error::other)?
        .max_decoding_message_size(req_max)
        .max_encoding_message_size(msg_max);
    let svc = MetricsSvc {
        hub: hub.clone(),
        pool: pool.clone(),
        self_peer,
        min_interval: cfg.watch_min_interval,
        heartbeat: cfg.heartbeat,
        shutdown: shutdown_rx.clone(),
        stats: stats.clone(),
        clock: args.clock.clone(),
        caps: Arc::new(StreamCaps {
            gate: Gate::new(limits.grpc_max_streams, limits.grpc_max_streams_per_peer),
            send_timeout: limits.stream_send_timeout,
            stats: port_stats.clone(),
        }),
    };
    let routes = tonic::service::Routes::new(
        health_svc
            .max_decoding_message_size(req_max)
            .max_encoding_message_size(msg_max),
    )
    .add_service(reflection)
    .add_service(
        MetricsServiceServer::new(svc)
            .max_decoding_message_size(req_max)
            .max_encoding_message_size(msg_max),
    )
    .prepare();
    tasks.push(tokio::spawn(ports::serve(
        args.grpc_listener,
        CountRefusedMessages {
            inner: routes,
            stats: port_stats.clone(),
        },
        ServeArgs {
            port: Port::Grpc,
            gate: Gate::new(
                limits.grpc_max_connections,
                limits.grpc_max_connections_per_peer,
            ),
            builder: ports::grpc_builder(limits),
            first_request_timeout: limits.first_request_timeout,
            stats: port_stats.clone(),
        },
        shutdown_rx.clone(),
    )));
    let http_state = crate::http::HttpState {
        hub: hub.clone(),
        pool: pool.clone(),
        stats,
        clock: args.clock,
        kv: kv_feed,
        ports: port_stats.clone(),
    };
    tasks.push(tokio::spawn(ports::serve(
        args.http_listener,
        crate::http::router(http_state),
        ServeArgs {
            port: Port::Http,
            gate: Gate::new(
                limits.http_max_connections,
                limits.http_max_connections_per_peer,
            ),
            builder: ports::http_builder(limits),
            first_request_timeout: limits.first_request_timeout,
            stats: port_stats,
        },
        shutdown_rx,
    )));
    Ok(RunningAgent {
        grpc_addr,
        http_addr,
        hub,
        pool,
        shutdown: shutdown_tx,
        tasks,
    })
}
