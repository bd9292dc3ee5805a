//! Decides what the filter currently knows about one pool: applies `WatchPool` events (a
//! `full` event replaces the peer set, a delta updates the listed peers, REMOVED forgets a
//! peer) and tracks each pod's freshness without comparing clocks: a snapshot was current at
//! `receive time − snapshot.age_ms` on the host's monotonic clock.
//!
//! Freshness rule: any event on a live stream confirms that LIVE peers it does not list are
//! unchanged, so their metrics count as current at the event's receive time (the agent only
//! re-sends a snapshot on a meaningful change, with heartbeats in between). When the stream
//! stops, ages grow and `cutoffs.stalenessMs` cuts the pods.
//!
//! The state is encoded compactly (prost) so ONE subscriber VM can publish it in proxy-wasm
//! shared data and every worker VM can decode it.

use ai_lb_proto::{PeerState, PeerStatus, PodSnapshot, PoolEvent};
use prost::Message;

use crate::counters::Counters;
use crate::signals::PodSignals;

/// A peer's status as the pool agent reports it (REMOVED peers are dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerLiveness {
    Live,
    Stale,
    Connecting,
}

impl PeerLiveness {
    pub fn as_str(&self) -> &'static str {
        match self {
            PeerLiveness::Live => "live",
            PeerLiveness::Stale => "stale",
            PeerLiveness::Connecting => "connecting",
        }
    }
}

/// One peer of the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerEntry {
    /// The peer agent's gRPC address.
    pub peer: String,
    pub status: PeerLiveness,
    /// Why the peer is stale or connecting.
    pub reason: String,
    /// Latest snapshot (kept for re-encoding).
    pub snapshot: Option<PodSnapshot>,
    /// Host monotonic ms when the latest snapshot arrived.
    pub received_at_ms: u64,
    /// Validated signals of `snapshot`; None while connecting or when the snapshot was rejected.
    pub signals: Option<PodSignals>,
}

/// Everything known about one pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolState {
    peers: Vec<PeerEntry>,
    version: u64,
    last_event_ms: Option<u64>,
    agent_instance: String,
}

/// The shared bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool state does not decode: {0}")]
pub struct DecodeError(String);

#[derive(Clone, PartialEq, Message)]
struct EncodedPool {
    #[prost(message, repeated, tag = "1")]
    peers: Vec<EncodedPeer>,
    #[prost(uint64, tag = "2")]
    version: u64,
    #[prost(uint64, optional, tag = "3")]
    last_event_ms: Option<u64>,
    #[prost(string, tag = "4")]
    agent_instance: String,
}

#[derive(Clone, PartialEq, Message)]
struct EncodedPeer {
    #[prost(message, optional, tag = "1")]
    state: Option<PeerState>,
    #[prost(uint64, tag = "2")]
    received_at_ms: u64,
    #[prost(uint64, tag = "3")]
    confirmed_at_ms: u64,
    #[prost(bool, tag = "4")]
    hardware_fault: bool,
    #[prost(uint64, tag = "5")]
    age_at_confirm_ms: u64,
}

impl PoolState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Peers in arrival order.
    pub fn peers(&self) -> &[PeerEntry] {
        &self.peers
    }

    /// Incremented on every applied event; workers skip re-reading an unchanged state.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Host ms of the last event (None: never heard from the agent).
    pub fn last_event_ms(&self) -> Option<u64> {
        self.last_event_ms
    }

    /// Applies one `WatchPool` event received at `now_ms`.
    pub fn apply_event(&mut self, ev: &PoolEvent, now_ms: u64, counters: &mut Counters) {
        counters.pool_events += 1;
        self.version = self.version.wrapping_add(1);
        self.last_event_ms = Some(now_ms);
        self.agent_instance.clone_from(&ev.agent_instance);

        let mut seen = vec![false; self.peers.len()];
        for ps in &ev.peers {
            let status = PeerStatus::try_from(ps.status).unwrap_or(PeerStatus::Unspecified);
            let idx = self.peers.iter().position(|p| p.peer == ps.peer);
            if status == PeerStatus::Removed {
                if let Some(i) = idx {
                    self.peers.remove(i);
                    if i < seen.len() {
                        seen.remove(i);
                    }
                }
                continue;
            }
            let liveness = match status {
                PeerStatus::Live => PeerLiveness::Live,
                PeerStatus::Stale => PeerLiveness::Stale,
                PeerStatus::Connecting => PeerLiveness::Connecting,
                // Unknown status: do not trust the numbers.
                PeerStatus::Unspecified | PeerStatus::Removed => {
                    counters.signal_issues += 1;
                    PeerLiveness::Stale
                }
            };
            let i = match idx {
                Some(i) => {
                    if let Some(s) = seen.get_mut(i) {
                        *s = true;
                    }
                    i
                }
                None => {
                    self.peers.push(PeerEntry {
                        peer: ps.peer.clone(),
                        status: liveness,
                        reason: String::new(),
                        snapshot: None,
                        received_at_ms: now_ms,
                        signals: None,
                    });
                    seen.push(true);
                    self.peers.len() - 1
                }
            };
            let Some(entry) = self.peers.get_mut(i) else {
                continue;
            };
            entry.status = liveness;
            entry.reason.clone_from(&ps.reason);
            if let Some(snap) = &ps.snapshot {
                let (sig, issues) = PodSignals::from_proto(snap, now_ms);
                counters.signal_issues += issues.len() as u64;
                match sig {
                    Some(mut s) => {
                        if let Some(prev) = &entry.signals {
                            s.detect_fault_since(prev);
                            if s.hardware_fault && !prev.hardware_fault {
                                counters.hardware_faults += 1;
                            }
                        }
                        let was_down = entry.signals.as_ref().is_some_and(|p| p.model_server_down);
                        if s.model_server_down && !was_down {
                            counters.model_server_down += 1;
                        }
                        entry.signals = Some(s);
                        entry.snapshot = Some(snap.clone());
                        entry.received_at_ms = now_ms;
                    }
                    None => {
                        counters.snapshots_rejected += 1;
                        entry.signals = None;
                        entry.snapshot = None;
                    }
                }
            } else if liveness == PeerLiveness::Connecting {
                entry.signals = None;
                entry.snapshot = None;
            }
            if let Some(s) = entry.signals.as_mut() {
                s.peer_stale = liveness == PeerLiveness::Stale;
            }
        }

        if ev.full {
            let mut i = 0;
            self.peers.retain(|_| {
                let keep = seen.get(i).copied().unwrap_or(true);
                i += 1;
                keep
            });
            seen.retain(|s| *s);
        }

        // LIVE peers this event did not list are confirmed unchanged as of now.
        for (entry, listed) in self.peers.iter_mut().zip(seen.iter()) {
            if !listed && entry.status == PeerLiveness::Live {
                if let Some(s) = entry.signals.as_mut() {
                    s.confirm(now_ms);
                }
            }
        }
    }

    /// Compact bytes for proxy-wasm shared data (a prost message holding each peer's last
    /// `PeerState` plus receive time, freshness and fault verdict).
    pub fn encode(&self) -> Vec<u8> {
        let msg = EncodedPool {
            peers: self
                .peers
                .iter()
                .map(|p| EncodedPeer {
                    state: Some(PeerState {
                        peer: p.peer.clone(),
                        status: match p.status {
                            PeerLiveness::Live => PeerStatus::Live,
                            PeerLiveness::Stale => PeerStatus::Stale,
                            PeerLiveness::Connecting => PeerStatus::Connecting,
                        } as i32,
                        snapshot: p.snapshot.clone(),
                        reason: p.reason.clone(),
                    }),
                    received_at_ms: p.received_at_ms,
                    confirmed_at_ms: p.signals.as_ref().map_or(0, |s| s.confirmed_at_ms),
                    age_at_confirm_ms: p.signals.as_ref().map_or(0, |s| s.age_at_confirm_ms),
                    hardware_fault: p.signals.as_ref().is_some_and(|s| s.hardware_fault),
                })
                .collect(),
            version: self.version,
            last_event_ms: self.last_event_ms,
            agent_instance: self.agent_instance.clone(),
        };
        msg.encode_to_vec()
    }

    /// Inverse of [`PoolState::encode`].
    pub fn decode(bytes: &[u8]) -> Result<PoolState, DecodeError> {
        let msg = EncodedPool::decode(bytes).map_err(|e| DecodeError(e.to_string()))?;
        let mut peers = Vec::with_capacity(msg.peers.len());
        for ep in msg.peers {
            let Some(st) = ep.state else {
                return Err(DecodeError("peer without state".into()));
            };
            let status = match PeerStatus::try_from(st.status) {
                Ok(PeerStatus::Live) => PeerLiveness::Live,
                Ok(PeerStatus::Connecting) => PeerLiveness::Connecting,
                _ => PeerLiveness::Stale,
            };
            let signals = st.snapshot.as_ref().and_then(|snap| {
                let (s, _) = PodSignals::from_proto(snap, ep.received_at_ms);
                s.map(|mut s| {
                    s.confirmed_at_ms = ep.confirmed_at_ms;
                    s.age_at_confirm_ms = ep.age_at_confirm_ms;
                    s.hardware_fault = ep.hardware_fault;
                    s.peer_stale = status == PeerLiveness::Stale;
                    s
                })
            });
            peers.push(PeerEntry {
                peer: st.peer,
                status,
                reason: st.reason,
                snapshot: st.snapshot,
                received_at_ms: ep.received_at_ms,
                signals,
            });
        }
        Ok(PoolState {
            peers,
            version: msg.version,
            last_event_ms: msg.last_event_ms,
            agent_instance: msg.agent_instance,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::{GpuStats, PodIdentity};

    fn peer(name: &str, addr: &str, status: PeerStatus, age: u64) -> PeerState {
        PeerState {
            peer: name.into(),
            status: status as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: addr.into(),
                    ..Default::default()
                }),
                gpus: vec![GpuStats {
                    utilization: Some(0.5),
                    ..Default::default()
                }],
                age_ms: age,
                agent_instance: "i".into(),
                ..Default::default()
            }),
            reason: String::new(),
        }
    }

    #[test]
    fn full_replaces_delta_updates_removed_forgets() {
        let mut c = Counters::default();
        let mut p = PoolState::new();
        p.apply_event(
            &PoolEvent {
                full: true,
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 5),
                    peer("b", "10.0.0.2:1", PeerStatus::Live, 5),
                ],
                ..Default::default()
            },
            100,
            &mut c,
        );
        assert_eq!(p.peers().len(), 2);
        assert_eq!(p.peers()[0].signals.as_ref().unwrap().age_ms(100), 5);
        p.apply_event(
            &PoolEvent {
                peers: vec![peer("c", "10.0.0.3:1", PeerStatus::Live, 0)],
                ..Default::default()
            },
            200,
            &mut c,
        );
        assert_eq!(p.peers().len(), 3);
        // Unlisted live peers are confirmed current.
        assert_eq!(p.peers()[0].signals.as_ref().unwrap().age_ms(200), 0);
        p.apply_event(
            &PoolEvent {
                peers: vec![PeerState {
                    peer: "a".into(),
                    status: PeerStatus::Removed as i32,
                    ..Default::default()
                }],
                ..Default::default()
            },
            300,
            &mut c,
        );
        assert_eq!(p.peers().len(), 2);
        p.apply_event(
            &PoolEvent {
                full: true,
                peers: vec![peer("b", "10.0.0.2:1", PeerStatus::Stale, 900)],
                ..Default::default()
            },
            400,
            &mut c,
        );
        assert_eq!(p.peers().len(), 1);
        let s = p.peers()[0].signals.as_ref().unwrap();
        assert!(s.peer_stale);
        assert_eq!(c.pool_events, 4);
    }

    #[test]
    fn encode_decode_round_trips() {
        let mut c = Counters::default();
        let mut p = PoolState::new();
        p.apply_event(
            &PoolEvent {
                full: true,
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 5),
                    peer("b", "10.0.0.2:1", PeerStatus::Stale, 5),
                ],
                agent_instance: "x".into(),
                ..Default::default()
            },
            100,
            &mut c,
        );
        let d = PoolState::decode(&p.encode()).unwrap();
        assert_eq!(d, p);
        assert!(PoolState::decode(b"\xff\xff").is_err());
    }
}
