//! Differential test of the filter's hand-written protobuf readers (`filter/core/src/pool.rs`:
//! `PoolState::decode` / `encoded_version` for the shared state, `PoolState::apply_event_bytes`
//! for a `WatchPool` event) against prost, on generated messages encoded by prost and on
//! mutations of them (unknown fields of every wire type, known fields with a wrong wire type,
//! truncation, flipped and inserted bytes). Where both accept they must agree field by field;
//! the hand-written reader may reject what prost accepts (it refuses groups), never accept
//! what prost rejects.

use ai_lb_filter_core::pool::{PeerLiveness, PoolState};
use ai_lb_filter_core::Counters;
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, ModelInfo, PeerState, PeerStatus, PodIdentity,
    PodSnapshot, PoolEvent, PrefixCacheSummary, SourceStatus,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use prost::encoding::{encode_key, encode_varint, WireType};
use prost::Message;

/// The shared state's wire format, as `pool.rs` documents it (`EncodedPool`).
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

fn opt_f64() -> impl Strategy<Value = Option<f64>> {
    prop_oneof![
        Just(None),
        (0.0f64..1.0).prop_map(Some),
        (0.0f64..1e6).prop_map(Some),
        any::<f64>().prop_map(Some),
    ]
}

fn latency() -> impl Strategy<Value = Option<LatencyQuantiles>> {
    proptest::option::of((opt_f64(), opt_f64(), any::<u64>(), opt_f64()).prop_map(
        |(p50_ms, p99_ms, samples, mean_ms)| LatencyQuantiles {
            p50_ms,
            p99_ms,
            samples,
            mean_ms,
        },
    ))
}

fn gpu() -> impl Strategy<Value = GpuStats> {
    (
        any::<u32>(),
        "[a-z0-9-]{0,12}",
        opt_f64(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        opt_f64(),
        proptest::option::of(0u64..4),
        proptest::option::of(any::<u64>()),
        opt_f64(),
    )
        .prop_map(
            |(index, uuid, utilization, used, total, temp, ecc, xid, sm)| GpuStats {
                index,
                uuid,
                utilization,
                memory_used_bytes: used,
                memory_total_bytes: total,
                temperature_celsius: temp,
                ecc_uncorrected_errors: ecc,
                xid_errors: xid,
                sm_occupancy: sm,
                ..GpuStats::default()
            },
        )
}

fn inference() -> impl Strategy<Value = Option<InferenceStats>> {
    proptest::option::of(
        (
            proptest::option::of(0u32..64),
            proptest::option::of(0u32..64),
            opt_f64(),
            latency(),
            latency(),
            opt_f64(),
            any::<u32>(),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(
                |(waiting, running, kv, ttft, itl, rate, window_ms, kv_cap)| InferenceStats {
                    waiting,
                    running,
                    kv_cache_usage: kv,
                    ttft,
                    inter_token: itl,
                    request_rate: rate,
                    window_ms,
                    kv_capacity_tokens: kv_cap,
                    ..InferenceStats::default()
                },
            ),
    )
}

fn snapshot() -> impl Strategy<Value = PodSnapshot> {
    (
        "(10\\.0\\.0\\.[0-9]{1,2}:8000|[a-z:0-9.]{0,10})",
        proptest::collection::vec("[a-z0-9/-]{1,8}", 0..3),
        proptest::collection::vec(gpu(), 0..3),
        inference(),
        proptest::collection::vec(("[a-z-]{1,8}", 0i32..5), 0..3),
        any::<u64>(),
        "[a-z0-9]{0,6}",
        0u64..100_000,
        proptest::option::of((
            0u32..128,
            proptest::collection::vec(any::<u32>(), 0..6),
            any::<bool>(),
        )),
    )
        .prop_map(
            |(address, models, gpus, inference, sources, seq, instance, age_ms, prefix)| {
                PodSnapshot {
                    identity: Some(PodIdentity {
                        pod_name: "pod".into(),
                        namespace: "ns".into(),
                        address,
                        engine: 2,
                        models: models
                            .into_iter()
                            .map(|name| ModelInfo {
                                name,
                                ..ModelInfo::default()
                            })
                            .collect(),
                    }),
                    gpus,
                    inference,
                    sources: sources
                        .into_iter()
                        .map(|(name, state)| SourceStatus {
                            name,
                            state,
                            ..SourceStatus::default()
                        })
                        .collect(),
                    sample_time_unix_ms: 1_700_000_000_000,
                    sequence: seq,
                    agent_instance: instance,
                    age_ms,
                    prefix_cache: prefix.map(|(block_tokens, keys, truncated)| {
                        PrefixCacheSummary {
                            block_tokens,
                            keys,
                            truncated,
                            model: "m".into(),
                        }
                    }),
                }
            },
        )
}

fn peer_state() -> impl Strategy<Value = PeerState> {
    (
        "[a-z0-9.:]{0,12}",
        // Every status, and values no PeerStatus names.
        prop_oneof![0i32..5, any::<i32>()],
        proptest::option::of(snapshot()),
        "[a-z ]{0,10}",
    )
        .prop_map(|(peer, status, snapshot, reason)| PeerState {
            peer,
            status,
            snapshot,
            reason,
        })
}

fn encoded_pool() -> impl Strategy<Value = EncodedPool> {
    (
        proptest::collection::vec(
            (
                // The hand-written reader refuses a peer without its state.
                prop_oneof![9 => peer_state().prop_map(Some), 1 => Just(None)],
                any::<u64>(),
                any::<u64>(),
                any::<bool>(),
                any::<u64>(),
            )
                .prop_map(|(state, received, confirmed, fault, age)| EncodedPeer {
                    state,
                    received_at_ms: received,
                    confirmed_at_ms: confirmed,
                    hardware_fault: fault,
                    age_at_confirm_ms: age,
                }),
            0..4,
        ),
        any::<u64>(),
        proptest::option::of(any::<u64>()),
        "[a-z0-9]{0,8}",
    )
        .prop_map(
            |(peers, version, last_event_ms, agent_instance)| EncodedPool {
                peers,
                version,
                last_event_ms,
                agent_instance,
            },
        )
}

fn pool_event() -> impl Strategy<Value = PoolEvent> {
    (
        any::<bool>(),
        proptest::collection::vec(peer_state(), 0..4),
        any::<u64>(),
        "[a-z0-9]{0,8}",
    )
        .prop_map(|(full, peers, time_unix_ms, agent_instance)| PoolEvent {
            full,
            peers,
            time_unix_ms,
            agent_instance,
        })
}

/// A change to valid bytes.
#[derive(Debug, Clone)]
enum Mutation {
    None,
    /// A field of this tag and wire type (0 varint, 1 fixed64, 2 bytes, 3 group, 5 fixed32),
    /// with a well-formed payload, before (`true`) or after the message.
    Field(u32, u8, bool, Vec<u8>),
    /// Cut to this fraction of the length (per mille).
    Truncate(u16),
    /// XOR one byte (position per mille of the length).
    Flip(u16, u8),
    /// Insert bytes (position per mille of the length).
    Insert(u16, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => Just(Mutation::None),
        // Known tags (any wire type, so also wrong ones) and unknown ones.
        3 => (
            prop_oneof![1u32..=5, 6u32..=40, 536_870_000u32..=536_870_911],
            prop_oneof![Just(0u8), Just(1), Just(2), Just(3), Just(5)],
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..12),
        )
            .prop_map(|(t, w, front, p)| Mutation::Field(t, w, front, p)),
        2 => (0u16..1000).prop_map(Mutation::Truncate),
        2 => ((0u16..1000), 1u8..=255).prop_map(|(at, x)| Mutation::Flip(at, x)),
        1 => ((0u16..1000), proptest::collection::vec(any::<u8>(), 1..6))
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
    ]
}

fn at(len: usize, per_mille: u16) -> usize {
    len * usize::from(per_mille) / 1000
}

fn apply(m: &Mutation, mut bytes: Vec<u8>) -> Vec<u8> {
    match m {
        Mutation::None => {}
        Mutation::Field(tag, wire, front, payload) => {
            let mut f = Vec::new();
            let wt = match wire {
                0 => WireType::Varint,
                1 => WireType::SixtyFourBit,
                2 => WireType::LengthDelimited,
                3 => WireType::StartGroup,
                _ => WireType::ThirtyTwoBit,
            };
            encode_key(*tag, wt, &mut f);
            match wt {
                WireType::Varint => encode_varint(
                    payload.iter().fold(0u64, |a, b| a << 8 | u64::from(*b)),
                    &mut f,
                ),
                WireType::SixtyFourBit => f.extend((0..8).map(|i| *payload.get(i).unwrap_or(&0))),
                WireType::ThirtyTwoBit => f.extend((0..4).map(|i| *payload.get(i).unwrap_or(&0))),
                WireType::LengthDelimited => {
                    encode_varint(payload.len() as u64, &mut f);
                    f.extend(payload);
                }
                // An empty group.
                _ => encode_key(*tag, WireType::EndGroup, &mut f),
            }
            if *front {
                f.extend(bytes);
                bytes = f;
            } else {
                bytes.extend(f);
            }
        }
        Mutation::Truncate(p) => bytes.truncate(at(bytes.len(), *p)),
        Mutation::Flip(p, x) => {
            if !bytes.is_empty() {
                let i = at(bytes.len() - 1, *p);
                bytes[i] ^= x;
            }
        }
        Mutation::Insert(p, b) => {
            let i = at(bytes.len(), *p);
            bytes.splice(i..i, b.iter().copied());
        }
    }
    bytes
}

fn liveness(status: i32) -> PeerLiveness {
    match PeerStatus::try_from(status) {
        Ok(PeerStatus::Live) => PeerLiveness::Live,
        Ok(PeerStatus::Connecting) => PeerLiveness::Connecting,
        _ => PeerLiveness::Stale,
    }
}

/// Both readers on the shared-state bytes: they agree, or the hand-written one rejects.
fn check_state(bytes: &[u8]) -> Result<(), TestCaseError> {
    let by_prost = EncodedPool::decode(bytes);
    let by_hand = PoolState::decode(bytes);
    let (h, p) = match (by_hand, by_prost) {
        (Ok(h), Ok(p)) => (h, p),
        (Ok(_), Err(e)) => {
            return Err(TestCaseError::fail(format!(
                "hand-written reader accepted bytes prost rejects ({e}): {bytes:02x?}"
            )))
        }
        (Err(_), _) => return Ok(()),
    };
    prop_assert_eq!(
        PoolState::encoded_version(bytes),
        Ok((p.version, p.last_event_ms))
    );
    prop_assert_eq!(h.version(), p.version);
    prop_assert_eq!(h.last_event_ms(), p.last_event_ms);
    prop_assert_eq!(h.agent_instance(), p.agent_instance.as_str());
    prop_assert_eq!(h.peers().len(), p.peers.len());
    for (entry, ep) in h.peers().iter().zip(&p.peers) {
        let Some(st) = &ep.state else {
            return Err(TestCaseError::fail("a peer without state was accepted"));
        };
        prop_assert_eq!(&entry.peer, &st.peer);
        prop_assert_eq!(&entry.reason, &st.reason);
        prop_assert_eq!(entry.status, liveness(st.status));
        prop_assert_eq!(entry.received_at_ms, ep.received_at_ms);
        // Compared encoded: a snapshot may hold NaN, which is not equal to itself.
        prop_assert_eq!(
            entry.snapshot.as_ref().map(Message::encode_to_vec),
            st.snapshot.as_ref().map(Message::encode_to_vec)
        );
        if let Some(sig) = &entry.signals {
            prop_assert!(st.snapshot.is_some());
            prop_assert_eq!(sig.confirmed_at_ms, ep.confirmed_at_ms);
            prop_assert_eq!(sig.age_at_confirm_ms, ep.age_at_confirm_ms);
            prop_assert_eq!(sig.hardware_fault, ep.hardware_fault);
            prop_assert_eq!(sig.peer_stale, entry.status == PeerLiveness::Stale);
        }
    }
    Ok(())
}

/// Both readers on a `WatchPool` event, applied to a state holding `before`: the same state
/// results, or the hand-written reader rejects.
fn check_event(before: &PoolEvent, bytes: &[u8]) -> Result<(), TestCaseError> {
    let mut counters = Counters::default();
    let mut by_hand = PoolState::new();
    by_hand.apply_event(before, 1_000, &mut counters);
    let mut by_prost = by_hand.clone();
    let read = by_hand.apply_event_bytes(bytes, 2_000, &mut counters);
    match (read, PoolEvent::decode(bytes)) {
        (Ok(()), Ok(ev)) => {
            by_prost.apply_event(&ev, 2_000, &mut counters);
            prop_assert_eq!(by_hand.encode(), by_prost.encode());
        }
        (Ok(()), Err(e)) => {
            return Err(TestCaseError::fail(format!(
                "hand-written event reader accepted bytes prost rejects ({e}): {bytes:02x?}"
            )))
        }
        (Err(_), _) => {}
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn shared_state_reader_agrees_with_prost(pool in encoded_pool(), m in mutation()) {
        let bytes = apply(&m, pool.encode_to_vec());
        check_state(&bytes)?;
    }

    #[test]
    fn shared_state_reader_agrees_with_prost_on_its_own_encoding(pool in encoded_pool(), m in mutation()) {
        // What the subscriber really publishes: the hand-written encoder's bytes.
        let Ok(state) = PoolState::decode(&pool.encode_to_vec()) else {
            return Ok(());
        };
        let bytes = apply(&m, state.encode());
        check_state(&bytes)?;
    }

    #[test]
    fn event_reader_agrees_with_prost(before in pool_event(), ev in pool_event(), m in mutation()) {
        let bytes = apply(&m, ev.encode_to_vec());
        check_event(&before, &bytes)?;
    }
}

#[test]
fn unmutated_messages_are_accepted_by_both() {
    // The generators produce messages both readers accept (a reader that rejects everything
    // would pass the properties above).
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut accepted = 0;
    for _ in 0..200 {
        let pool = encoded_pool()
            .new_tree(&mut runner)
            .expect("a value")
            .current();
        let bytes = pool.encode_to_vec();
        if pool.peers.iter().all(|p| p.state.is_some()) {
            assert!(PoolState::decode(&bytes).is_ok(), "{pool:?}");
            accepted += 1;
        }
    }
    assert!(
        accepted > 100,
        "only {accepted} of 200 generated states were whole"
    );
}
