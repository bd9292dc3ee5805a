//! The pool view for `WatchPool`: which peer agents exist (a static list and/or a DNS name
//! re-resolved periodically) and what each one last said. One client task per peer keeps a
//! `Watch` stream open (reconnecting with exponential backoff and jitter); a peer that stops
//! answering is STALE with its last snapshot, never dropped; a peer gone from discovery is
//! REMOVED; a peer that never answered is CONNECTING with the last error as its reason.

use crate::sampler::{urgent_change, Published};
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{watch_event, PeerState, PeerStatus, PodSnapshot, WatchRequest};
use futures::future::BoxFuture;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the agent knows about one peer.
#[derive(Debug, Clone)]
pub struct PeerEntry {
    pub status: PeerStatus,
    /// The last snapshot as received, stamped with the local receipt time.
    pub last: Option<Published>,
    pub reason: String,
    /// Pool version at this entry's last change (for change-only events).
    pub version: u64,
    pub removed_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    peers: BTreeMap<String, PeerEntry>,
    version: u64,
    /// Addresses found to be this agent itself (by `agent_instance`); never watched again.
    self_aliases: BTreeSet<String>,
}

/// The shared pool state: written by discovery and peer tasks, read by `WatchPool` streams.
#[derive(Debug)]
pub struct PoolView {
    inner: Mutex<Inner>,
    changes: watch::Sender<u64>,
    /// Bumped on every urgent change: a peer's status changed, or its snapshot jumped
    /// ([`urgent_change`]); `WatchPool` streams push it without waiting out their coalescing.
    urgent: watch::Sender<u64>,
}

impl PoolView {
    pub fn new() -> Arc<PoolView> {
        Arc::new(PoolView {
            inner: Mutex::new(Inner::default()),
            changes: watch::channel(0).0,
            urgent: watch::channel(0).0,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Wakes on every change of any peer.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Wakes on every urgent change of any peer.
    pub fn subscribe_urgent(&self) -> watch::Receiver<u64> {
        self.urgent.subscribe()
    }

    /// Applies `f` to `peer`'s entry (created CONNECTING if new) and, if it reports a change,
    /// bumps the pool version and wakes the streams.
    pub fn update(&self, peer: &str, f: impl FnOnce(&mut PeerEntry) -> bool) {
        self.update_urgency(peer, |e| (f(e), false));
    }

    /// As [`PoolView::update`], with `f` also saying whether the change is urgent.
    fn update_urgency(&self, peer: &str, f: impl FnOnce(&mut PeerEntry) -> (bool, bool)) {
        let (version, urgent) = {
            let mut g = self.lock();
            let next = g.version + 1;
            let e = g
                .peers
                .entry(peer.to_string())
                .or_insert_with(|| PeerEntry {
                    status: PeerStatus::Connecting,
                    last: None,
                    reason: "not connected yet".into(),
                    version: next,
                    removed_at: None,
                });
            let (changed, is_urgent) = f(e);
            if !changed {
                return;
            }
            e.version = next;
            g.version = next;
            (next, is_urgent)
        };
        if urgent {
            self.urgent.send_modify(|v| *v += 1);
        }
        self.changes.send_replace(version);
    }

    /// A peer answered with a snapshot: LIVE.
    pub fn set_live(&self, peer: &str, snapshot: PodSnapshot, now: Instant) {
        self.update_urgency(peer, |e| {
            // A watcher aborted by discovery may still finish one step: REMOVED stays removed.
            if e.status == PeerStatus::Removed {
                return (false, false);
            }
            let urgent = e.status != PeerStatus::Live
                || e.last
                    .as_ref()
                    .is_none_or(|p| urgent_change(&p.snapshot, &snapshot));
            e.status = PeerStatus::Live;
            e.reason.clear();
            e.removed_at = None;
            e.last = Some(Published {
                snapshot,
                taken: now,
            });
            (true, urgent)
        });
    }

    /// A peer failed: STALE if it ever answered, else CONNECTING; `reason` says why.
    pub fn set_failed(&self, peer: &str, reason: String) {
        self.update_urgency(peer, |e| {
            if e.status == PeerStatus::Removed {
                return (false, false);
            }
            let status = if e.last.is_some() {
                PeerStatus::Stale
            } else {
                PeerStatus::Connecting
            };
            let urgent = e.status != status;
            let changed = urgent || e.reason != reason;
            e.status = status;
            e.reason = reason;
            (changed, urgent)
        });
    }

    fn set_removed(&self, peer: &str, now: Instant) {
        self.update_urgency(peer, |e| {
            e.status = PeerStatus::Removed;
            e.reason = "no longer discovered".into();
            e.removed_at = Some(now);
            (true, true)
        });
    }

    /// `peer` turned out to be this agent: forget it and never watch it again.
    pub fn mark_self(&self, peer: &str) {
        let version = {
            let mut g = self.lock();
            g.self_aliases.insert(peer.to_string());
            g.peers.remove(peer);
            g.version += 1;
            g.version
        };
        self.changes.send_replace(version);
    }

    pub fn is_self_alias(&self, peer: &str) -> bool {
        self.lock().self_aliases.contains(peer)
    }

    fn prune_removed(&self, older_than: Instant) {
        self.lock()
            .peers
            .retain(|_, e| e.removed_at.is_none_or(|t| t > older_than));
    }

    /// The current version and the peers changed after `since` (all peers when `None`),
    /// rendered at `now` (ages grown).
    pub fn render(&self, now: Instant, since: Option<u64>) -> (u64, Vec<PeerState>) {
        let g = self.lock();
        let peers = g
            .peers
            .iter()
            .filter(|(_, e)| since.is_none_or(|v| e.version > v))
            .map(|(name, e)| peer_state(name, e, now))
            .collect();
        (g.version, peers)
    }

    /// Number of peers in each status.
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for s in ["live", "stale", "connecting", "removed"] {
            m.insert(s, 0);
        }
        for e in self.lock().peers.values() {
            *m.entry(status_label(e.status)).or_insert(0) += 1;
        }
        m
    }
}

/// Lower-case status name for metrics and logs.
pub fn status_label(s: PeerStatus) -> &'static str {
    match s {
        PeerStatus::Live => "live",
        PeerStatus::Stale => "stale",
        PeerStatus::Connecting => "connecting",
        PeerStatus::Removed => "removed",
        PeerStatus::Unspecified => "unspecified",
    }
}

/// One peer as sent on the wire at `now`.
pub fn peer_state(peer: &str, e: &PeerEntry, now: Instant) -> PeerState {
    PeerState {
        peer: peer.to_string(),
        status: e.status as i32,
        snapshot: e.last.as_ref().map(|p| p.render(now)),
        reason: e.reason.clone(),
    }
}

/// Resolves the peer DNS name (`name:port`) to addresses; injected so tests can change the answer.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (`tokio::net::lookup_host`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DnsResolver;

impl Resolve for DnsResolver {
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let name = name.to_string();
        Box::pin(async move { Ok(tokio::net::lookup_host(name).await?.collect()) })
    }
}

/// How the pool is discovered and watched.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub static_peers: Vec<String>,
    pub dns: Option<String>,
    pub refresh: Duration,
    pub stale_after: Duration,
    /// Asked of peers' `Watch`.
    pub min_interval: Duration,
    pub heartbeat: Duration,
    /// Addresses that are certainly this agent (its own gRPC address forms).
    pub self_addresses: Vec<String>,
    pub self_instance: String,
    /// Largest snapshot accepted from a peer (`--grpc-max-message-bytes`).
    pub max_message_bytes: usize,
}

/// Runs discovery until `shutdown`, starting and stopping one watcher task per peer.
pub async fn run_pool(
    cfg: PoolConfig,
    view: Arc<PoolView>,
    resolver: Arc<dyn Resolve>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tasks: HashMap<String, JoinHandle<()>> = HashMap::new();
    let mut dns_peers: BTreeSet<String> = BTreeSet::new();
    let mut ticker = tokio::time::interval(cfg.refresh);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = crate::sampler::stopped(&mut shutdown) => break,
        }
        if let Some(name) = &cfg.dns {
            match resolver.resolve(name).await {
                Ok(addrs) => dns_peers = addrs.iter().map(|a| a.to_string()).collect(),
                // Keep the last answer: a resolver hiccup must not remove the whole pool.
                Err(e) => tracing::warn!(dns = %name, error = %e, "peer DNS lookup failed"),
            }
        }
        let desired: BTreeSet<String> = cfg
            .static_peers
            .iter()
            .cloned()
            .chain(dns_peers.iter().cloned())
            .filter(|p| !cfg.self_addresses.contains(p) && !view.is_self_alias(p))
            .collect();
        tasks.retain(|peer, task| {
            if desired.contains(peer) {
                return true;
            }
            task.abort();
            if !view.is_self_alias(peer) {
                view.set_removed(peer, Instant::now());
            }
            false
        });
        for peer in &desired {
            if !tasks.contains_key(peer) {
                view.update(peer, |e| {
                    let was_removed = e.status == PeerStatus::Removed;
                    if was_removed {
                        e.status = if e.last.is_some() {
                            PeerStatus::Stale
                        } else {
                            PeerStatus::Connecting
                        };
                        e.removed_at = None;
                    }
                    true
                });
                tasks.insert(
                    peer.clone(),
                    tokio::spawn(watch_peer(peer.clone(), cfg.clone(), view.clone())),
                );
            }
        }
        let keep_removed = Duration::from_secs(60).min(cfg.refresh * 12);
        if let Some(cutoff) = Instant::now().checked_sub(keep_removed) {
            view.prune_removed(cutoff);
        }
    }
    for (_, t) in tasks {
        t.abort();
    }
}

enum WatchEnd {
    IsSelf,
    Failed { reason: String, got_events: bool },
}

/// Keeps a `Watch` stream to `peer` open forever, reconnecting with backoff + jitter.
async fn watch_peer(peer: String, cfg: PoolConfig, view: Arc<PoolView>) {
    let base = Duration::from_millis(100);
    let max = Duration::from_secs(5).min(cfg.stale_after.max(base));
    let mut backoff = base;
    loop {
        match watch_once(&peer, &cfg, &view).await {
            WatchEnd::IsSelf => {
                tracing::info!(peer = %peer, "peer is this agent itself; ignoring it");
                view.mark_self(&peer);
                return;
            }
            WatchEnd::Failed { reason, got_events } => {
                tracing::debug!(peer = %peer, reason = %reason, "peer watch ended");
                view.set_failed(&peer, reason);
                if got_events {
                    backoff = base;
                }
            }
        }
        let jitter = backoff.mul_f64(rand::random::<f64>() * 0.5);
        tokio::time::sleep(backoff + jitter).await;
        backoff = (backoff * 2).min(max);
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

async fn watch_once(peer: &str, cfg: &PoolConfig, view: &PoolView) -> WatchEnd {
    let failed = |reason: String, got_events: bool| WatchEnd::Failed { reason, got_events };
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{peer}")) {
        Ok(e) => e.connect_timeout(cfg.stale_after).tcp_nodelay(true),
        Err(e) => return failed(format!("invalid peer address: {}", error_chain(&e)), false),
    };
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => return failed(format!("connect: {}", error_chain(&e)), false),
    };
    let mut client =
        MetricsServiceClient::new(channel).max_decoding_message_size(cfg.max_message_bytes);
    let req = WatchRequest {
        // 0 on the wire means "the peer's default" (50 ms), not "no coalescing": a hub
        // configured with 0 asks its peers for 1 ms so it really gets every change.
        min_interval_ms: cfg.min_interval.as_millis().clamp(1, u32::MAX as u128) as u32,
        heartbeat_ms: cfg.heartbeat.as_millis().min(u32::MAX as u128) as u32,
    };
    let mut stream = match tokio::time::timeout(cfg.stale_after, client.watch(req)).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => return failed(format!("watch: {:?}: {}", s.code(), s.message()), false),
        Err(_) => {
            return failed(
                format!("watch: no answer within {:?}", cfg.stale_after),
                false,
            )
        }
    };
    let mut got_events = false;
    loop {
        match tokio::time::timeout(cfg.stale_after, stream.message()).await {
            Err(_) => return failed(format!("no event within {:?}", cfg.stale_after), got_events),
            Ok(Err(s)) => {
                return failed(
                    format!("stream: {:?}: {}", s.code(), s.message()),
                    got_events,
                )
            }
            Ok(Ok(None)) => return failed("stream ended".into(), got_events),
            Ok(Ok(Some(ev))) => {
                got_events = true;
                match ev.event {
                    Some(watch_event::Event::Snapshot(s)) => {
                        if s.agent_instance == cfg.self_instance {
                            return WatchEnd::IsSelf;
                        }
                        view.set_live(peer, s, Instant::now());
                    }
                    Some(watch_event::Event::Heartbeat(_)) | None => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_keeps_snapshot_and_ages_it() {
        let v = PoolView::new();
        let t0 = Instant::now();
        v.set_failed("a:1", "connect: refused".into());
        let (_, peers) = v.render(t0, None);
        assert_eq!(peers[0].status, PeerStatus::Connecting as i32);
        assert!(peers[0].snapshot.is_none());
        assert_eq!(peers[0].reason, "connect: refused");

        let s = PodSnapshot {
            age_ms: 5,
            sequence: 3,
            ..Default::default()
        };
        v.set_live("a:1", s, t0);
        let (ver, peers) = v.render(t0, None);
        assert_eq!(peers[0].status, PeerStatus::Live as i32);
        v.set_failed("a:1", "stream: Unavailable: agent shutting down".into());
        let (_, changed) = v.render(t0 + Duration::from_millis(100), Some(ver));
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].status, PeerStatus::Stale as i32);
        let s1 = changed[0].snapshot.as_ref().unwrap();
        assert_eq!(s1.age_ms, 105);
        assert_eq!(s1.sequence, 3);
        let (_, later) = v.render(t0 + Duration::from_millis(900), None);
        assert_eq!(later[0].snapshot.as_ref().unwrap().age_ms, 905);
    }

    #[test]
    fn unchanged_failures_do_not_bump_version() {
        let v = PoolView::new();
        v.set_failed("a:1", "x".into());
        let (ver, _) = v.render(Instant::now(), None);
        v.set_failed("a:1", "x".into());
        let (ver2, changed) = v.render(Instant::now(), Some(ver));
        assert_eq!(ver, ver2);
        assert!(changed.is_empty());
    }

    #[test]
    fn removed_peer_ignores_late_watcher_updates() {
        let v = PoolView::new();
        let t0 = Instant::now();
        v.set_live("a:1", PodSnapshot::default(), t0);
        v.set_removed("a:1", t0);
        v.set_live("a:1", PodSnapshot::default(), t0);
        v.set_failed("a:1", "late".into());
        let (_, peers) = v.render(t0, None);
        assert_eq!(peers[0].status, PeerStatus::Removed as i32);
    }

    #[test]
    fn self_alias_is_forgotten() {
        let v = PoolView::new();
        v.set_failed("me:1", "x".into());
        v.mark_self("me:1");
        assert!(v.is_self_alias("me:1"));
        assert!(v.render(Instant::now(), None).1.is_empty());
    }
}
