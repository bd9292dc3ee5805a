//! What any peer that can reach the agent's ports may hold there, decided in one place:
//! connections per peer IP and in total (each port), `Watch`/`WatchPool` subscriptions per peer
//! IP and in total, a deadline for a connection's first request, how long a subscriber may
//! leave an event untaken before it is dropped, and the HTTP/2 settings that bound what one
//! connection can make the agent buffer. Every refusal is counted by port and [`Reason`] for
//! `/metrics`.
//!
//! Both listeners are served here (hyper, one task per connection) rather than by tonic's and
//! axum's own accept loops, so that the caps apply before a connection costs anything and a
//! connection that breaks the protocol (garbage bytes, an oversized frame) is counted too.

use crate::sampler::stopped;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tonic::codegen::Service;

/// Defaults of the caps (documented with the flags in `config.rs` and the README).
pub mod defaults {
    use std::time::Duration;
    pub const GRPC_MAX_CONNECTIONS: usize = 1024;
    pub const GRPC_MAX_CONNECTIONS_PER_PEER: usize = 64;
    pub const GRPC_MAX_STREAMS: usize = 512;
    pub const GRPC_MAX_STREAMS_PER_PEER: usize = 32;
    pub const GRPC_MAX_STREAMS_PER_CONNECTION: u32 = 32;
    pub const GRPC_MAX_REQUEST_BYTES: usize = 16 * 1024;
    pub const GRPC_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
    pub const STREAM_SEND_TIMEOUT: Duration = Duration::from_secs(10);
    pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
    pub const HTTP_MAX_CONNECTIONS: usize = 64;
    pub const HTTP_MAX_CONNECTIONS_PER_PEER: usize = 16;
}

/// What the HTTP/2 layer may buffer for one gRPC response stream before it stops taking the
/// stream's events (hyper's default is 400 KiB). With the stream caps it bounds what
/// subscribers that stop reading can make the agent hold: `--grpc-max-streams` × this.
pub const H2_SEND_BUFFER: usize = 64 * 1024;
/// Each gRPC stream's flow-control window for what peers send (requests are a few bytes).
pub const H2_STREAM_WINDOW: u32 = 64 * 1024;
/// Each gRPC connection's flow-control window for what the peer sends.
pub const H2_CONNECTION_WINDOW: u32 = 256 * 1024;
/// Largest header block a peer may send (HTTP/2 and HTTP/1).
pub const MAX_HEADER_BYTES: u32 = 16 * 1024;
/// HTTP/2 keep-alive pings find a peer that went away without closing its connections.
pub const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
pub const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams a peer may reset before being served (the "rapid reset" attack, CVE-2023-44487).
pub const H2_MAX_PENDING_RESETS: usize = 20;

/// The caps on the agent's ports (validated from flags in `config.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct PortLimits {
    /// Open gRPC connections, all peers together (`--grpc-max-connections`).
    pub grpc_max_connections: usize,
    /// Open gRPC connections from one peer IP (`--grpc-max-connections-per-peer`).
    pub grpc_max_connections_per_peer: usize,
    /// Open `Watch` + `WatchPool` streams, all peers together (`--grpc-max-streams`).
    pub grpc_max_streams: usize,
    /// Open `Watch` + `WatchPool` streams from one peer IP (`--grpc-max-streams-per-peer`).
    pub grpc_max_streams_per_peer: usize,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`: RPCs of any kind in flight on one
    /// connection (`--grpc-max-streams-per-connection`).
    pub grpc_max_streams_per_connection: u32,
    /// Largest request message the agent decodes (`--grpc-max-request-bytes`).
    pub grpc_max_request_bytes: usize,
    /// Largest message the agent sends, and the largest it accepts from its peers' `Watch`
    /// (`--grpc-max-message-bytes`).
    pub grpc_max_message_bytes: usize,
    /// A subscriber that leaves an event untaken this long is dropped (`--stream-send-timeout`).
    pub stream_send_timeout: Duration,
    /// A connection that sends no request this long after it opened is closed
    /// (`--first-request-timeout`; also the HTTP/1 header read timeout).
    pub first_request_timeout: Duration,
    /// Open `/metrics` (HTTP) connections, all peers together (`--http-max-connections`).
    pub http_max_connections: usize,
    /// Open HTTP connections from one peer IP (`--http-max-connections-per-peer`).
    pub http_max_connections_per_peer: usize,
}

impl Default for PortLimits {
    fn default() -> PortLimits {
        use defaults::*;
        PortLimits {
            grpc_max_connections: GRPC_MAX_CONNECTIONS,
            grpc_max_connections_per_peer: GRPC_MAX_CONNECTIONS_PER_PEER,
            grpc_max_streams: GRPC_MAX_STREAMS,
            grpc_max_streams_per_peer: GRPC_MAX_STREAMS_PER_PEER,
            grpc_max_streams_per_connection: GRPC_MAX_STREAMS_PER_CONNECTION,
            grpc_max_request_bytes: GRPC_MAX_REQUEST_BYTES,
            grpc_max_message_bytes: GRPC_MAX_MESSAGE_BYTES,
            stream_send_timeout: STREAM_SEND_TIMEOUT,
            first_request_timeout: FIRST_REQUEST_TIMEOUT,
            http_max_connections: HTTP_MAX_CONNECTIONS,
            http_max_connections_per_peer: HTTP_MAX_CONNECTIONS_PER_PEER,
        }
    }
}

/// Which of the agent's ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    Grpc,
    Http,
}

impl Port {
    pub const ALL: [Port; 2] = [Port::Grpc, Port::Http];

    pub fn label(self) -> &'static str {
        match self {
            Port::Grpc => "grpc",
            Port::Http => "http",
        }
    }
}

/// Why the agent refused or dropped something a peer sent or held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A connection over the per-peer cap, closed at once.
    ConnectionsPerPeer,
    /// A connection over the total cap, closed at once.
    ConnectionsTotal,
    /// A `Watch`/`WatchPool` over the per-peer cap: `RESOURCE_EXHAUSTED`.
    StreamsPerPeer,
    /// A `Watch`/`WatchPool` over the total cap: `RESOURCE_EXHAUSTED`.
    StreamsTotal,
    /// A connection closed because a subscriber on it left an event untaken for
    /// `--stream-send-timeout` (counted once per connection): closing it frees what HTTP/2
    /// buffered for the subscriber.
    SlowReader,
    /// A connection that sent no request within `--first-request-timeout`.
    FirstRequestTimeout,
    /// A connection that broke HTTP/2 or HTTP/1 (garbage bytes, an oversized frame or header
    /// block, a rapid-reset flood), closed by the protocol layer.
    ProtocolError,
    /// A request message over `--grpc-max-request-bytes`: `OUT_OF_RANGE`, never buffered.
    MessageTooLarge,
    /// A request message that is not the RPC's protobuf: `INTERNAL`.
    MalformedMessage,
}

impl Reason {
    pub const ALL: [Reason; 9] = [
        Reason::ConnectionsPerPeer,
        Reason::ConnectionsTotal,
        Reason::StreamsPerPeer,
        Reason::StreamsTotal,
        Reason::SlowReader,
        Reason::FirstRequestTimeout,
        Reason::ProtocolError,
        Reason::MessageTooLarge,
        Reason::MalformedMessage,
    ];

    /// The `reason` label on `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Reason::ConnectionsPerPeer => "connections_per_peer",
            Reason::ConnectionsTotal => "connections_total",
            Reason::StreamsPerPeer => "streams_per_peer",
            Reason::StreamsTotal => "streams_total",
            Reason::SlowReader => "slow_reader",
            Reason::FirstRequestTimeout => "first_request_timeout",
            Reason::ProtocolError => "protocol_error",
            Reason::MessageTooLarge => "message_too_large",
            Reason::MalformedMessage => "malformed_message",
        }
    }

    /// Whether this reason can happen on `port` (the others are not shown for it).
    pub fn applies_to(self, port: Port) -> bool {
        match self {
            Reason::ConnectionsPerPeer
            | Reason::ConnectionsTotal
            | Reason::FirstRequestTimeout
            | Reason::ProtocolError => true,
            _ => port == Port::Grpc,
        }
    }
}

/// Refusals and open connections per port, for `/metrics`.
#[derive(Debug, Default)]
pub struct PortStats {
    rejections: [[AtomicU64; Reason::ALL.len()]; Port::ALL.len()],
    open: [AtomicU64; Port::ALL.len()],
}

impl PortStats {
    pub fn count(&self, port: Port, reason: Reason) {
        self.rejections[port as usize][reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn rejections(&self, port: Port, reason: Reason) -> u64 {
        self.rejections[port as usize][reason as usize].load(Ordering::Relaxed)
    }

    /// Connections open now on `port`.
    pub fn open_connections(&self, port: Port) -> u64 {
        self.open[port as usize].load(Ordering::Relaxed)
    }
}

/// Which cap a [`Gate`] refused on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    PerPeer,
    Total,
}

/// Places counted per peer IP and in total; a [`Slot`] gives its place back when dropped.
#[derive(Debug)]
pub struct Gate {
    max_total: usize,
    max_per_peer: usize,
    held: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

impl Gate {
    pub fn new(max_total: usize, max_per_peer: usize) -> Arc<Gate> {
        Arc::new(Gate {
            max_total,
            max_per_peer,
            held: Mutex::new((0, HashMap::new())),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, HashMap<IpAddr, usize>)> {
        match self.held.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// A place for `peer`, or which cap is full (the per-peer cap is checked first).
    pub fn try_enter(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, Full> {
        let mut g = self.lock();
        let (total, per_peer) = &mut *g;
        let mine = per_peer.get(&peer).copied().unwrap_or(0);
        if mine >= self.max_per_peer {
            return Err(Full::PerPeer);
        }
        if *total >= self.max_total {
            return Err(Full::Total);
        }
        *total += 1;
        per_peer.insert(peer, mine + 1);
        Ok(Slot {
            gate: self.clone(),
            peer,
        })
    }

    /// Places held now: (all peers, `peer`).
    pub fn held(&self, peer: IpAddr) -> (usize, usize) {
        let g = self.lock();
        (g.0, g.1.get(&peer).copied().unwrap_or(0))
    }
}

/// One place in a [`Gate`], given back on drop.
#[derive(Debug)]
pub struct Slot {
    gate: Arc<Gate>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = self.gate.lock();
        let (total, per_peer) = &mut *g;
        *total = total.saturating_sub(1);
        if let Some(n) = per_peer.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_peer.remove(&self.peer);
            }
        }
    }
}

/// One connection's handle, in each of its requests' extensions: the stream code closes the
/// connection of a subscriber that stopped reading (the only way to free what HTTP/2 holds
/// for a stream whose peer does not take it).
#[derive(Debug, Clone, Default)]
pub struct ConnHandle {
    close: Arc<Notify>,
    closing: Arc<std::sync::atomic::AtomicBool>,
}

impl ConnHandle {
    /// Closes the connection (at once, not gracefully); `true` for the call that asked
    /// first, so a connection with several stuck streams is counted once.
    pub fn close(&self) -> bool {
        let first = !self.closing.swap(true, Ordering::AcqRel);
        self.close.notify_one();
        first
    }
}

/// The peer IP of a request served by [`serve`] (0.0.0.0 when unknown, e.g. in a test that
/// calls a handler directly).
pub fn peer_ip<T>(req: &tonic::Request<T>) -> IpAddr {
    req.remote_addr()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The connection builder of the gRPC port: HTTP/2 only, with the caps above.
pub fn grpc_builder(limits: &PortLimits) -> Builder<TokioExecutor> {
    let mut b = Builder::new(TokioExecutor::new()).http2_only();
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.grpc_max_streams_per_connection)
        .max_send_buf_size(H2_SEND_BUFFER)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_header_list_size(MAX_HEADER_BYTES)
        .max_pending_accept_reset_streams(H2_MAX_PENDING_RESETS)
        .keep_alive_interval(H2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT);
    b
}

/// The connection builder of the HTTP port (`/metrics`, probes): HTTP/1 or HTTP/2, headers
/// read within the first-request timeout.
pub fn http_builder(limits: &PortLimits) -> Builder<TokioExecutor> {
    let mut b = Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.first_request_timeout)
        .max_buf_size((MAX_HEADER_BYTES as usize).max(8192));
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(8)
        .max_send_buf_size(H2_SEND_BUFFER)
        .max_header_list_size(MAX_HEADER_BYTES)
        .max_pending_accept_reset_streams(H2_MAX_PENDING_RESETS);
    b
}

/// How [`serve`] admits and serves the connections of one port.
pub struct ServeArgs {
    pub port: Port,
    /// Connection places per peer and in total.
    pub gate: Arc<Gate>,
    pub builder: Builder<TokioExecutor>,
    pub first_request_timeout: Duration,
    pub stats: Arc<PortStats>,
}

/// Serves `svc` on `listener` until `shutdown` turns true: a connection over a cap is closed
/// at once (counted), each other one is served on its own task; on shutdown the listener is
/// closed, every connection is shut down gracefully (open streams end on their own first),
/// and this returns once all are done.
pub async fn serve<S, B>(
    listener: TcpListener,
    svc: S,
    args: ServeArgs,
    mut shutdown: watch::Receiver<bool>,
) where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let args = Arc::new(args);
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stopped(&mut shutdown) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, most likely: give the others time to close.
                tracing::warn!(port = args.port.label(), error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match args.gate.try_enter(peer.ip()) {
            Ok(s) => s,
            Err(full) => {
                let reason = match full {
                    Full::PerPeer => Reason::ConnectionsPerPeer,
                    Full::Total => Reason::ConnectionsTotal,
                };
                args.stats.count(args.port, reason);
                tracing::debug!(port = args.port.label(), peer = %peer, reason = reason.label(), "connection refused");
                drop(stream);
                continue;
            }
        };
        let local = stream.local_addr().ok();
        conns.spawn(connection(
            stream,
            peer,
            local,
            svc.clone(),
            args.clone(),
            shutdown.clone(),
            slot,
        ));
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// Counts the connection open while it lives.
struct OpenGuard<'a>(&'a AtomicU64);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection<S, B>(
    stream: TcpStream,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    svc: S,
    args: Arc<ServeArgs>,
    mut shutdown: watch::Receiver<bool>,
    _slot: Slot,
) where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let port = args.port;
    let open = &args.stats.open[port as usize];
    open.fetch_add(1, Ordering::Relaxed);
    let _open = OpenGuard(open);
    let _ = stream.set_nodelay(true);
    let handle = ConnHandle::default();
    let requests = Arc::new(AtomicU64::new(0));
    let hyper_svc = {
        let (handle, requests) = (handle.clone(), requests.clone());
        hyper::service::service_fn(move |mut req: Request<Incoming>| {
            requests.fetch_add(1, Ordering::Relaxed);
            req.extensions_mut()
                .insert(tonic::transport::server::TcpConnectInfo {
                    local_addr: local,
                    remote_addr: Some(peer),
                });
            req.extensions_mut().insert(handle.clone());
            let mut svc = svc.clone();
            async move {
                std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
                svc.call(req).await
            }
        })
    };
    let conn = args
        .builder
        .serve_connection(TokioIo::new(stream), hyper_svc);
    tokio::pin!(conn);
    let first = tokio::time::sleep(args.first_request_timeout);
    tokio::pin!(first);
    let (mut first_checked, mut draining) = (false, false);
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    if let Some(reason) = classify(&*e) {
                        args.stats.count(port, reason);
                        tracing::debug!(port = port.label(), peer = %peer, error = %e, "connection closed: {}", reason.label());
                    }
                }
                return;
            }
            _ = &mut first, if !first_checked => {
                first_checked = true;
                if requests.load(Ordering::Relaxed) == 0 {
                    args.stats.count(port, Reason::FirstRequestTimeout);
                    tracing::debug!(port = port.label(), peer = %peer, "no request within {:?}: closing", args.first_request_timeout);
                    return;
                }
            }
            _ = handle.close.notified() => return,
            _ = stopped(&mut shutdown), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Which refusal a failed connection counts as; `None` for a peer that simply went away.
fn classify(e: &(dyn std::error::Error + 'static)) -> Option<Reason> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(
                io.kind(),
                ConnectionReset | BrokenPipe | ConnectionAborted | UnexpectedEof
            ) {
                return None;
            }
        }
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() || h.is_closed() {
                return None;
            }
            if h.is_timeout() {
                return Some(Reason::FirstRequestTimeout);
            }
        }
        cur = err.source();
    }
    Some(Reason::ProtocolError)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_caps_each_peer_and_the_total_and_frees_places_on_drop() {
        let g = Gate::new(3, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        let a1 = g.try_enter(a).unwrap();
        let _a2 = g.try_enter(a).unwrap();
        assert_eq!(g.try_enter(a).unwrap_err(), Full::PerPeer);
        let _b1 = g.try_enter(b).unwrap();
        assert_eq!(g.try_enter(c).unwrap_err(), Full::Total);
        assert_eq!(g.held(a), (3, 2));
        drop(a1);
        assert_eq!(g.held(a), (2, 1));
        let _c1 = g.try_enter(c).unwrap();
        assert_eq!(g.try_enter(b).unwrap_err(), Full::Total);
    }

    #[test]
    fn a_peer_that_goes_away_is_not_a_rejection() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(classify(&reset), None);
        let other = std::io::Error::other("frame size error");
        assert_eq!(classify(&other), Some(Reason::ProtocolError));
    }

    #[test]
    fn every_reason_has_its_own_label() {
        let mut labels: Vec<&str> = Reason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Reason::ALL.len());
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "ALL is in declaration order");
        }
    }
}
