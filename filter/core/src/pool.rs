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

/// The wire format of the encoded state (written and read field by field: see
/// [`PoolState::encode`] and [`PoolState::install`]; the derived codec serves the tests).
#[cfg(test)]
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

    /// The pool agent's instance id from its last event ("" before any).
    pub fn agent_instance(&self) -> &str {
        &self.agent_instance
    }

    /// Applies one `WatchPool` event received at `now_ms` (a copy of it: see
    /// [`PoolState::apply_event_bytes`]).
    pub fn apply_event(&mut self, ev: &PoolEvent, now_ms: u64, counters: &mut Counters) {
        let ev = ev.clone();
        let mut run = self.begin_event(now_ms, counters);
        self.agent_instance = ev.agent_instance;
        for ps in ev.peers {
            self.apply_peer(ps, &mut run, now_ms, counters);
        }
        self.end_event(run, ev.full, now_ms);
    }

    /// Applies one encoded `WatchPool` event received at `now_ms`, decoding one peer at a
    /// time into the state: at 1024 pods the decoded event is about as large as the state,
    /// and wasm linear memory keeps its high-water mark for good.
    ///
    /// A peer that does not decode ends the event there with the error: the peers before it
    /// are applied (each stands alone), and neither a `full` event's removals nor the
    /// confirmation of unlisted peers happen, since the event's peer list was not read whole.
    pub fn apply_event_bytes(
        &mut self,
        bytes: &[u8],
        now_ms: u64,
        counters: &mut Counters,
    ) -> Result<(), DecodeError> {
        let mut run = self.begin_event(now_ms, counters);
        let mut full = false;
        self.agent_instance.clear();
        walk(bytes, |tag, field| {
            match (tag, field) {
                (1, Field::Varint(v)) => full = v != 0,
                (2, Field::Bytes(b)) => {
                    let ps = PeerState::decode(b)
                        .map_err(|e| DecodeError(format!("PoolEvent.peers: {e}")))?;
                    self.apply_peer(ps, &mut run, now_ms, counters);
                }
                (4, Field::Bytes(b)) => {
                    self.agent_instance = utf8("PoolEvent.agent_instance", b)?;
                }
                // `time_unix_ms` is not used, but checked as prost checks it: the event is
                // read as the contract's decoder reads it, or refused.
                (3, Field::Varint(_)) => {}
                (1..=4, _) => return Err(wire_type("PoolEvent", tag)),
                _ => {}
            }
            Ok(())
        })?;
        self.end_event(run, full, now_ms);
        Ok(())
    }

    fn begin_event(&mut self, now_ms: u64, counters: &mut Counters) -> EventRun {
        counters.pool_events += 1;
        self.version = self.version.wrapping_add(1);
        self.last_event_ms = Some(now_ms);
        EventRun {
            seen: vec![false; self.peers.len()],
            hint: 0,
        }
    }

    /// Applies one listed peer.
    fn apply_peer(
        &mut self,
        ps: PeerState,
        run: &mut EventRun,
        now_ms: u64,
        counters: &mut Counters,
    ) {
        let seen = &mut run.seen;
        let status = PeerStatus::try_from(ps.status).unwrap_or(PeerStatus::Unspecified);
        let idx = if self.peers.get(run.hint).is_some_and(|p| p.peer == ps.peer) {
            Some(run.hint)
        } else {
            self.peers.iter().position(|p| p.peer == ps.peer)
        };
        run.hint = idx.map_or(run.hint, |i| i + 1);
        if status == PeerStatus::Removed {
            if let Some(i) = idx {
                self.peers.remove(i);
                if i < seen.len() {
                    seen.remove(i);
                }
            }
            return;
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
                    peer: ps.peer,
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
            return;
        };
        entry.status = liveness;
        entry.reason = ps.reason;
        if let Some(snap) = ps.snapshot {
            let (sig, issues) = PodSignals::from_proto(&snap, now_ms);
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
                    entry.snapshot = Some(compact(snap));
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

    /// A `full` event forgets the peers it did not list; LIVE peers it did not list are
    /// confirmed unchanged as of now.
    fn end_event(&mut self, run: EventRun, full: bool, now_ms: u64) {
        let mut seen = run.seen;
        if full {
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
    /// `PeerState` plus receive time, freshness and fault verdict: the wire format of
    /// `EncodedPool`). Written field by field from the state, into a buffer of the exact
    /// size: building an `EncodedPool` would copy every snapshot, and at 1024 pods that copy
    /// is about as large as the state.
    pub fn encode(&self) -> Vec<u8> {
        use prost::encoding::{encode_key, encoded_len_varint, key_len, uint64, WireType};
        let last_event_len = self.last_event_ms.map_or(0, |v| uint64::encoded_len(3, &v));
        let total = self
            .peers
            .iter()
            .map(|p| {
                let len = encoded_peer_len(p);
                key_len(1) + encoded_len_varint(len as u64) + len
            })
            .sum::<usize>()
            + scalar_len(2, self.version)
            + last_event_len
            + string_len(4, &self.agent_instance);
        let mut buf = Vec::with_capacity(total);
        for p in &self.peers {
            encode_key(1, WireType::LengthDelimited, &mut buf);
            encode_peer(p, &mut buf);
        }
        if self.version != 0 {
            uint64::encode(2, &self.version, &mut buf);
        }
        if let Some(v) = self.last_event_ms {
            uint64::encode(3, &v, &mut buf);
        }
        if !self.agent_instance.is_empty() {
            prost::encoding::string::encode(4, &self.agent_instance, &mut buf);
        }
        buf
    }

    /// Inverse of [`PoolState::encode`].
    pub fn decode(bytes: &[u8]) -> Result<PoolState, DecodeError> {
        let mut state = PoolState::default();
        state.install(bytes)?;
        Ok(state)
    }

    /// The version and last event time of encoded state, read without building its peers
    /// (a worker installs only a state it does not have).
    pub fn encoded_version(bytes: &[u8]) -> Result<(u64, Option<u64>), DecodeError> {
        let (mut version, mut last) = (0, None);
        walk(bytes, |tag, field| {
            match (tag, field) {
                (2, Field::Varint(v)) => version = v,
                (3, Field::Varint(v)) => last = Some(v),
                (1 | 4, Field::Bytes(_)) => {}
                (1..=4, _) => return Err(wire_type("EncodedPool", tag)),
                _ => {}
            }
            Ok(())
        })?;
        Ok((version, last))
    }

    /// Replaces the state with encoded state ([`PoolState::encode`]), decoding one peer at a
    /// time: the old peers go first (their vector is reused), so the pool is never held
    /// twice. Bytes that do not decode leave the state empty, with the error: the pool then
    /// has no pods to score and requests take Envoy's fallback load balancing, until the next
    /// state decodes.
    pub fn install(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        self.peers.clear();
        self.version = 0;
        self.last_event_ms = None;
        self.agent_instance.clear();
        let peers = &mut self.peers;
        let (mut version, mut last, mut instance) = (0, None, String::new());
        let read = walk(bytes, |tag, field| {
            match (tag, field) {
                (1, Field::Bytes(b)) => {
                    let ep = EncodedPeer::decode(b).map_err(|e| DecodeError(e.to_string()))?;
                    peers.push(installed_peer(ep)?);
                }
                (2, Field::Varint(v)) => version = v,
                (3, Field::Varint(v)) => last = Some(v),
                (4, Field::Bytes(b)) => instance = utf8("EncodedPool.agent_instance", b)?,
                (1..=4, _) => return Err(wire_type("EncodedPool", tag)),
                _ => {}
            }
            Ok(())
        });
        if let Err(e) = read {
            self.peers.clear();
            return Err(e);
        }
        self.version = version;
        self.last_event_ms = last;
        self.agent_instance = instance;
        Ok(())
    }
}

/// One peer of encoded state, as the state holds it.
fn installed_peer(ep: EncodedPeer) -> Result<PeerEntry, DecodeError> {
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
    Ok(PeerEntry {
        peer: st.peer,
        status,
        reason: st.reason,
        snapshot: st.snapshot.map(compact),
        received_at_ms: ep.received_at_ms,
        signals,
    })
}

/// Where an event's listed peers stand while it is applied.
struct EventRun {
    /// Per peer of the state: listed by the event.
    seen: Vec<bool>,
    /// Where the next listed peer is looked up first: the agent lists peers in the same
    /// order every time, so the lookup is one comparison instead of a scan of the pool.
    hint: usize,
}

/// One top-level field of a protobuf message.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// Calls `f` with each top-level field of the protobuf message `buf`, in order, without
/// decoding the length-delimited ones.
fn walk<'a>(
    mut buf: &'a [u8],
    mut f: impl FnMut(u32, Field<'a>) -> Result<(), DecodeError>,
) -> Result<(), DecodeError> {
    use prost::encoding::{decode_key, decode_varint, WireType};
    let err = |e: prost::DecodeError| DecodeError(e.to_string());
    let short = || DecodeError("buffer underflow".into());
    while !buf.is_empty() {
        let (tag, wt) = decode_key(&mut buf).map_err(err)?;
        let skip = |buf: &mut &'a [u8], n: usize| -> Result<&'a [u8], DecodeError> {
            let (head, rest) = (
                buf.get(..n).ok_or_else(short)?,
                buf.get(n..).ok_or_else(short)?,
            );
            *buf = rest;
            Ok(head)
        };
        let field = match wt {
            WireType::Varint => Field::Varint(decode_varint(&mut buf).map_err(err)?),
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(err)?;
                let len = usize::try_from(len).map_err(|_| short())?;
                Field::Bytes(skip(&mut buf, len)?)
            }
            WireType::SixtyFourBit => {
                skip(&mut buf, 8)?;
                Field::Fixed
            }
            WireType::ThirtyTwoBit => {
                skip(&mut buf, 4)?;
                Field::Fixed
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err(DecodeError(format!("field {tag}: groups are not used")))
            }
        };
        f(tag, field)?;
    }
    Ok(())
}

fn utf8(field: &str, b: &[u8]) -> Result<String, DecodeError> {
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| DecodeError(format!("{field}: invalid UTF-8")))
}

fn wire_type(message: &str, tag: u32) -> DecodeError {
    DecodeError(format!("{message} field {tag}: wrong wire type"))
}

/// A decoded snapshot with its lists cut to their length: prost grows a repeated field by
/// pushing, so a pod's one GPU holds room for four, and the state keeps snapshots for good.
fn compact(mut snap: PodSnapshot) -> PodSnapshot {
    snap.gpus.shrink_to_fit();
    for g in &mut snap.gpus {
        g.throttle_reason_names.shrink_to_fit();
    }
    snap.sources.shrink_to_fit();
    if let Some(id) = snap.identity.as_mut() {
        id.models.shrink_to_fit();
        for m in &mut id.models {
            m.adapters.shrink_to_fit();
        }
    }
    snap
}

/// `PeerState.status` of a peer.
fn status_proto(p: &PeerEntry) -> i32 {
    let status = match p.status {
        PeerLiveness::Live => PeerStatus::Live,
        PeerLiveness::Stale => PeerStatus::Stale,
        PeerLiveness::Connecting => PeerStatus::Connecting,
    };
    status as i32
}

/// Bytes of a proto3 `uint64` field (absent when 0).
fn scalar_len(tag: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        prost::encoding::uint64::encoded_len(tag, &v)
    }
}

/// Bytes of a proto3 `string` field (absent when empty).
fn string_len(tag: u32, v: &str) -> usize {
    if v.is_empty() {
        0
    } else {
        prost::encoding::key_len(tag)
            + prost::encoding::encoded_len_varint(v.len() as u64)
            + v.len()
    }
}

/// The body of the peer's `PeerState` (fields 1-4), in bytes.
fn peer_state_len(p: &PeerEntry) -> usize {
    let status = status_proto(p);
    string_len(1, &p.peer)
        + if status == 0 {
            0
        } else {
            prost::encoding::int32::encoded_len(2, &status)
        }
        + p.snapshot
            .as_ref()
            .map_or(0, |s| prost::encoding::message::encoded_len(3, s))
        + string_len(4, &p.reason)
}

/// `EncodedPeer`'s fields 2-5 of a peer.
fn peer_extras(p: &PeerEntry) -> (u64, u64, bool, u64) {
    let sig = p.signals.as_ref();
    (
        p.received_at_ms,
        sig.map_or(0, |s| s.confirmed_at_ms),
        sig.is_some_and(|s| s.hardware_fault),
        sig.map_or(0, |s| s.age_at_confirm_ms),
    )
}

/// The body of the peer's `EncodedPeer`, in bytes.
fn encoded_peer_len(p: &PeerEntry) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let state = peer_state_len(p);
    let (received, confirmed, fault, age) = peer_extras(p);
    key_len(1)
        + encoded_len_varint(state as u64)
        + state
        + scalar_len(2, received)
        + scalar_len(3, confirmed)
        + if fault { key_len(4) + 1 } else { 0 }
        + scalar_len(5, age)
}

/// Writes the peer as a length-delimited `EncodedPeer` (its key already written).
fn encode_peer(p: &PeerEntry, buf: &mut Vec<u8>) {
    use prost::encoding::{bool as pbool, encode_key, encode_varint, int32, message, string};
    use prost::encoding::{uint64, WireType};
    encode_varint(encoded_peer_len(p) as u64, buf);
    encode_key(1, WireType::LengthDelimited, buf);
    encode_varint(peer_state_len(p) as u64, buf);
    if !p.peer.is_empty() {
        string::encode(1, &p.peer, buf);
    }
    let status = status_proto(p);
    if status != 0 {
        int32::encode(2, &status, buf);
    }
    if let Some(snap) = &p.snapshot {
        message::encode(3, snap, buf);
    }
    if !p.reason.is_empty() {
        string::encode(4, &p.reason, buf);
    }
    let (received, confirmed, fault, age) = peer_extras(p);
    for (tag, v) in [(2, received), (3, confirmed)] {
        if v != 0 {
            uint64::encode(tag, &v, buf);
        }
    }
    if fault {
        pbool::encode(4, &fault, buf);
    }
    if age != 0 {
        uint64::encode(5, &age, buf);
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

    /// Applies the event the way the subscriber does, from its bytes.
    fn take(p: &mut PoolState, ev: PoolEvent, now_ms: u64, c: &mut Counters) {
        p.apply_event_bytes(&ev.encode_to_vec(), now_ms, c).unwrap();
    }

    /// The state as a prost-derived `EncodedPool`, the way `encode` used to build it (a copy
    /// of every snapshot).
    fn encode_by_copy(p: &PoolState) -> Vec<u8> {
        EncodedPool {
            peers: p
                .peers
                .iter()
                .map(|e| {
                    let (received_at_ms, confirmed_at_ms, hardware_fault, age_at_confirm_ms) =
                        peer_extras(e);
                    EncodedPeer {
                        state: Some(PeerState {
                            peer: e.peer.clone(),
                            status: status_proto(e),
                            snapshot: e.snapshot.clone(),
                            reason: e.reason.clone(),
                        }),
                        received_at_ms,
                        confirmed_at_ms,
                        hardware_fault,
                        age_at_confirm_ms,
                    }
                })
                .collect(),
            version: p.version,
            last_event_ms: p.last_event_ms,
            agent_instance: p.agent_instance.clone(),
        }
        .encode_to_vec()
    }

    #[test]
    fn encode_writes_the_bytes_prost_writes_for_every_field_set_or_default() {
        // Never heard from the agent: no peers, version 0, no last event, no instance.
        let empty = PoolState::new();
        assert_eq!(empty.encode(), encode_by_copy(&empty));
        assert!(empty.encode().is_empty());

        let mut c = Counters::default();
        let mut p = PoolState::new();
        let xids = |n: u64| {
            let mut d = peer("d", "10.0.0.4:1", PeerStatus::Live, 0);
            if let Some(snap) = d.snapshot.as_mut() {
                snap.gpus[0].xid_errors = Some(n);
                snap.sequence = n + 1;
            }
            d
        };
        let faulty = xids(1);
        take(
            &mut p,
            PoolEvent {
                full: true,
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 5),
                    PeerState {
                        reason: "connection refused".into(),
                        ..peer("b", "10.0.0.2:1", PeerStatus::Stale, 700)
                    },
                    PeerState {
                        peer: "c".into(),
                        status: PeerStatus::Connecting as i32,
                        snapshot: None,
                        reason: "dialing".into(),
                    },
                    xids(0),
                    // No address: the snapshot is rejected, the peer kept without signals.
                    peer("e", "", PeerStatus::Live, 0),
                ],
                agent_instance: "pool-agent".into(),
                ..Default::default()
            },
            100,
            &mut c,
        );
        // `d` reports a new Xid: a hardware fault; `a` is confirmed unchanged at 250.
        take(
            &mut p,
            PoolEvent {
                peers: vec![faulty],
                ..Default::default()
            },
            250,
            &mut c,
        );
        assert!(p.peers()[3].signals.as_ref().unwrap().hardware_fault);
        assert!(p.peers()[4].signals.is_none());
        let bytes = p.encode();
        assert_eq!(bytes, encode_by_copy(&p));
        assert_eq!(bytes.len(), bytes.capacity(), "the buffer is sized exactly");
        assert_eq!(PoolState::decode(&bytes).unwrap(), p);
    }

    #[test]
    fn peers_listed_in_a_new_order_are_each_found() {
        let mut c = Counters::default();
        let mut p = PoolState::new();
        let names = ["a", "b", "c", "d"];
        let addr = |i: usize| format!("10.0.0.{}:1", i + 1);
        take(
            &mut p,
            PoolEvent {
                full: true,
                peers: (0..4)
                    .map(|i| peer(names[i], &addr(i), PeerStatus::Live, 0))
                    .collect(),
                ..Default::default()
            },
            100,
            &mut c,
        );
        // Reversed, and `b` left out of a full event: `b` is forgotten, the others updated in
        // place (the lookup hint misses on every one of them).
        take(
            &mut p,
            PoolEvent {
                full: true,
                peers: [3, 2, 0]
                    .into_iter()
                    .map(|i| peer(names[i], &addr(i), PeerStatus::Stale, 0))
                    .collect(),
                ..Default::default()
            },
            200,
            &mut c,
        );
        let left: Vec<_> = p
            .peers()
            .iter()
            .map(|e| (e.peer.as_str(), e.status))
            .collect();
        assert_eq!(
            left,
            vec![
                ("a", PeerLiveness::Stale),
                ("c", PeerLiveness::Stale),
                ("d", PeerLiveness::Stale)
            ]
        );
    }

    #[test]
    fn a_peer_that_does_not_decode_ends_the_event_with_the_peers_before_it_applied() {
        let mut c = Counters::default();
        let mut p = PoolState::new();
        take(
            &mut p,
            PoolEvent {
                full: true,
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 0),
                    peer("b", "10.0.0.2:1", PeerStatus::Live, 0),
                ],
                ..Default::default()
            },
            100,
            &mut c,
        );
        // A full event listing `a` (now stale) and then a peer whose bytes are cut short:
        // `a` is applied; `b` is neither forgotten (full) nor confirmed (unlisted).
        let mut bytes = PoolEvent {
            full: true,
            peers: vec![peer("a", "10.0.0.1:1", PeerStatus::Stale, 0)],
            ..Default::default()
        }
        .encode_to_vec();
        let broken = peer("c", "10.0.0.3:1", PeerStatus::Live, 0).encode_to_vec();
        prost::encoding::encode_key(2, prost::encoding::WireType::LengthDelimited, &mut bytes);
        prost::encoding::encode_varint(broken.len() as u64 - 3, &mut bytes);
        bytes.extend_from_slice(&broken[..broken.len() - 3]);
        let err = p.apply_event_bytes(&bytes, 500, &mut c).unwrap_err();
        assert!(err.to_string().contains("PoolEvent.peers"), "{err}");
        let peers: Vec<_> = p
            .peers()
            .iter()
            .map(|e| (e.peer.as_str(), e.status))
            .collect();
        assert_eq!(
            peers,
            vec![("a", PeerLiveness::Stale), ("b", PeerLiveness::Live)]
        );
        assert_eq!(p.peers()[1].signals.as_ref().unwrap().age_ms(500), 400);
        assert_eq!(c.pool_events, 2);
    }

    #[test]
    fn unknown_fields_are_skipped_whatever_their_wire_type() {
        let mut bytes = PoolEvent {
            peers: vec![peer("a", "10.0.0.1:1", PeerStatus::Live, 0)],
            agent_instance: "x".into(),
            ..Default::default()
        }
        .encode_to_vec();
        // A newer agent's fields 9 (varint), 10 (bytes), 11 (fixed64) and 12 (fixed32).
        use prost::encoding::{encode_key, encode_varint, WireType};
        encode_key(9, WireType::Varint, &mut bytes);
        encode_varint(300, &mut bytes);
        encode_key(10, WireType::LengthDelimited, &mut bytes);
        encode_varint(2, &mut bytes);
        bytes.extend_from_slice(b"hi");
        encode_key(11, WireType::SixtyFourBit, &mut bytes);
        bytes.extend_from_slice(&[0; 8]);
        encode_key(12, WireType::ThirtyTwoBit, &mut bytes);
        bytes.extend_from_slice(&[0; 4]);
        let mut c = Counters::default();
        let mut p = PoolState::new();
        p.apply_event_bytes(&bytes, 100, &mut c).unwrap();
        assert_eq!(p.peers().len(), 1);
        assert_eq!(p.agent_instance, "x");
        // Cut inside the fixed64: an error, not a panic.
        assert!(p
            .apply_event_bytes(&bytes[..bytes.len() - 8], 200, &mut c)
            .is_err());
    }

    #[test]
    fn event_time_of_the_wrong_wire_type_is_refused_as_prost_refuses_it() {
        // Found by fuzz/fuzz_targets/pool_state.rs: field 3 (`time_unix_ms`, a varint) sent
        // length-delimited was skipped as if unknown, so the event applied where prost fails.
        use prost::encoding::{encode_key, encode_varint, WireType};
        let mut bytes = PoolEvent {
            peers: vec![peer("a", "10.0.0.1:1", PeerStatus::Live, 0)],
            ..Default::default()
        }
        .encode_to_vec();
        encode_key(3, WireType::LengthDelimited, &mut bytes);
        encode_varint(2, &mut bytes);
        bytes.extend_from_slice(b"hi");
        assert!(PoolEvent::decode(bytes.as_slice()).is_err());
        let mut c = Counters::default();
        let mut p = PoolState::new();
        let err = p.apply_event_bytes(&bytes, 100, &mut c).unwrap_err();
        assert!(err.to_string().contains("PoolEvent field 3"), "{err}");
    }

    #[test]
    fn encoded_state_that_does_not_decode_installs_an_empty_pool() {
        let mut c = Counters::default();
        let mut p = PoolState::new();
        take(
            &mut p,
            PoolEvent {
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 0),
                    peer("b", "10.0.0.2:1", PeerStatus::Live, 0),
                ],
                ..Default::default()
            },
            100,
            &mut c,
        );
        let good = p.encode();
        assert_eq!(
            PoolState::encoded_version(&good).unwrap(),
            (p.version(), p.last_event_ms())
        );
        let mut worker = PoolState::decode(&good).unwrap();
        assert_eq!(worker, p);
        // The second peer cut short.
        let err = worker.install(&good[..good.len() - 20]).unwrap_err();
        assert!(!err.to_string().is_empty());
        assert_eq!(worker, PoolState::default());
        // A peer without its state.
        let mut no_state = Vec::new();
        prost::encoding::message::encode(1, &EncodedPeer::default(), &mut no_state);
        let err = worker.install(&no_state).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pool state does not decode: peer without state"
        );
        assert!(worker.peers().is_empty());
        worker.install(&good).unwrap();
        assert_eq!(worker, p);
    }

    proptest::proptest! {
        /// Whatever the bytes (the pool agent's stream, or another VM's shared data), decoding
        /// returns; it never panics (a panic traps the VM: 503s for every later request).
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let mut c = Counters::default();
            let mut p = PoolState::new();
            let _ = p.apply_event_bytes(&bytes, 1, &mut c);
            let _ = PoolState::encoded_version(&bytes);
            let _ = p.install(&bytes);
            let _ = p.encode();
        }

        /// The same for a valid event and state with bytes changed and cut, which reach the
        /// nested decoders.
        #[test]
        fn damaged_encodings_never_panic(
            flips in proptest::collection::vec((0usize..2000, proptest::prelude::any::<u8>()), 1..6),
            cut in 0usize..2000,
        ) {
            let ev = PoolEvent {
                full: true,
                peers: vec![
                    peer("a", "10.0.0.1:1", PeerStatus::Live, 5),
                    peer("b", "10.0.0.2:1", PeerStatus::Stale, 5),
                ],
                agent_instance: "x".into(),
                ..Default::default()
            };
            let mut c = Counters::default();
            let mut p = PoolState::new();
            p.apply_event(&ev, 1, &mut c);
            for mut bytes in [ev.encode_to_vec(), p.encode()] {
                for (at, v) in &flips {
                    let n = bytes.len();
                    if let Some(b) = bytes.get_mut(at % n) {
                        *b = *v;
                    }
                }
                bytes.truncate(cut.max(1));
                let mut q = p.clone();
                let _ = q.apply_event_bytes(&bytes, 2, &mut c);
                let _ = PoolState::encoded_version(&bytes);
                let _ = q.install(&bytes);
                let _ = q.encode();
            }
        }
    }
}
