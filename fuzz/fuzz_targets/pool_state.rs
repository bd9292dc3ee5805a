//! The pool state the filter reads from outside bytes, both hand-written protobuf readers in
//! `filter/core/src/pool.rs`: the shared bytes a worker installs (`PoolState::decode`,
//! `encoded_version`, `Router::set_pool_state_bytes`) and a `WatchPool` event the subscriber
//! applies one peer at a time (`PoolState::apply_event_bytes`, `Router::apply_pool_event_bytes`),
//! then a pick over whatever pods came out. Properties: never panics; decoded state re-encodes
//! to bytes that decode to the same state (byte-stable: the encoder's exact sizes agree with
//! what it writes); `encoded_version` agrees with `decode`; the event reader agrees with
//! prost's `PoolEvent` decoding (same state) or rejects what prost rejects.
#![no_main]

use ai_lb_filter_core::pool::PoolState;
use ai_lb_filter_core::{Counters, FilterConfig, RequestSize, Router};
use ai_lb_proto::PoolEvent;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use rand::rngs::SmallRng;
use rand::SeedableRng;

const CONFIG: &[u8] = br#"{"pools":[{"name":"p","cluster":"c"}],"minPods":1,"prefixAffinity":{}}"#;

/// `s` re-encodes to bytes that decode to a state encoding the same bytes.
fn round_trip(s: &PoolState) {
    let bytes = s.encode();
    let back = PoolState::decode(&bytes).expect("encoded state decodes");
    assert_eq!(back.encode(), bytes, "re-encoding is byte-stable");
    assert_eq!(back.version(), s.version());
    assert_eq!(back.last_event_ms(), s.last_event_ms());
    assert_eq!(back.agent_instance(), s.agent_instance());
    assert_eq!(back.peers().len(), s.peers().len());
}

fuzz_target!(|data: &[u8]| {
    // Worker path: the bytes as shared state.
    if let Ok(s) = PoolState::decode(data) {
        assert_eq!(
            PoolState::encoded_version(data),
            Ok((s.version(), s.last_event_ms()))
        );
        round_trip(&s);
    }

    // Subscriber path: the bytes as a WatchPool event, applied twice (new peers, then updates).
    let mut counters = Counters::default();
    let mut by_bytes = PoolState::new();
    let first = by_bytes.apply_event_bytes(data, 1_000, &mut counters);
    let second = by_bytes.apply_event_bytes(data, 2_000, &mut counters);
    assert_eq!(first.is_ok(), second.is_ok());
    round_trip(&by_bytes);
    match PoolEvent::decode(data) {
        Ok(ev) => {
            if first.is_ok() {
                let mut by_prost = PoolState::new();
                by_prost.apply_event(&ev, 1_000, &mut counters);
                by_prost.apply_event(&ev, 2_000, &mut counters);
                assert_eq!(
                    by_prost.encode(),
                    by_bytes.encode(),
                    "event read as prost reads it"
                );
            }
        }
        Err(_) => assert!(first.is_err(), "event accepted that prost rejects"),
    }

    // Both paths into a router, then picks over the pods they produced.
    let Ok(cfg) = FilterConfig::from_json(CONFIG) else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(7);
    let mut router = Router::new(cfg);
    let _ = router.apply_pool_event_bytes(0, data, 1_000);
    let _ = router.decide_for(0, None, RequestSize::UNIT, 1_010, &mut rng);
    let shared = router.pool_state(0).map(PoolState::encode);
    let mut worker = Router::new(router.config().clone());
    if let Some(bytes) = shared {
        worker
            .set_pool_state_bytes(0, &bytes, 1_020)
            .expect("the subscriber's state installs");
    }
    let _ = worker.set_pool_state_bytes(0, data, 1_030);
    let size = RequestSize {
        weight: 2.0,
        kv_tokens: 4_000.0,
        output_tokens: 512.0,
    };
    let _ = worker.decide_for(0, Some("m"), size, 1_040, &mut rng);
});
