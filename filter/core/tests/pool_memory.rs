//! Peak heap of the pool-state paths at 1024 pods, under a tracking global allocator: the
//! subscriber's (decode a `PoolEvent`, apply it, encode the state for the other VMs) and a
//! worker's (decode the shared state, install it). Wasm linear memory never shrinks, so the
//! filter VM's size at 1024 pods is set by the highest of these peaks, not by the state at
//! rest: a path that holds two copies of the pool at once costs a VM a copy of the pool for
//! good. Each test bounds a path's peak above the state at rest, as a multiple of the state's
//! own size (a ratio, so the same on 64-bit hosts and wasm32).

// A tracking global allocator cannot be written without `unsafe` (the `GlobalAlloc` contract);
// it only forwards to `System`. Test code only.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::Router;
use ai_lb_proto::{
    Engine, GpuStats, InferenceStats, LatencyQuantiles, ModelInfo, PeerState, PeerStatus,
    PodIdentity, PodSnapshot, PoolEvent, SourceState, SourceStatus,
};
use prost::Message;

struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: forwards the caller's layout contract to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// The allocator's counts are process-wide: one measurement at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const PODS: usize = 1024;

/// Live bytes now, and the peak since the last call (reset to now).
fn live_and_reset_peak() -> (usize, usize) {
    let live = LIVE.load(Ordering::Relaxed);
    (live, PEAK.swap(live, Ordering::Relaxed))
}

/// A snapshot shaped like an agent's (one GPU, every inference field, two sources).
fn snapshot(i: usize, t: u64) -> PodSnapshot {
    let w = |salt: u64| ((i as u64 * 7919 + t * 104_729 + salt * 13) % 1000) as f64 / 1000.0;
    let util = 0.2 + 0.5 * w(1);
    let q = |p50: f64| LatencyQuantiles {
        p50_ms: Some(p50),
        p99_ms: Some(p50 * 3.0),
        samples: 40,
        mean_ms: Some(p50 * 1.2),
    };
    let fresh = |name: &str| SourceStatus {
        name: name.into(),
        state: SourceState::Fresh as i32,
        reason: String::new(),
        last_success_age_ms: Some(50),
        consecutive_failures: 0,
    };
    PodSnapshot {
        identity: Some(PodIdentity {
            pod_name: format!("vllm-{i:04}"),
            namespace: "inference".into(),
            address: format!("10.0.{}.{}:8000", i / 256, i % 256),
            engine: Engine::Vllm as i32,
            models: vec![ModelInfo {
                name: "llama-3-8b".into(),
                version: "v1".into(),
                adapters: Vec::new(),
            }],
        }),
        gpus: vec![GpuStats {
            index: 0,
            uuid: format!("GPU-{i:08x}-5b2c-4e3a-9d1f-000000000000"),
            name: "NVIDIA H100 80GB HBM3".into(),
            utilization: Some(util),
            memory_used_bytes: Some(72_000_000_000),
            memory_total_bytes: Some(80_000_000_000),
            temperature_celsius: Some(60.0),
            power_watts: Some(400.0),
            power_limit_watts: Some(700.0),
            throttle_reasons: Some(0),
            throttle_reason_names: Vec::new(),
            ecc_uncorrected_errors: Some(0),
            xid_errors: Some(0),
            last_xid: None,
            // Hopper reports GPM activity too.
            sm_occupancy: Some(util * 0.5),
            sm_utilization: Some(util),
            tensor_activity: Some(util * 0.3),
            dram_activity: Some(util * 0.7),
            activity_source: ai_lb_proto::GpuActivitySource::Gpm as i32,
            memory_growth_bytes_per_s: None,
            pre_oom: None,
        }],
        inference: Some(InferenceStats {
            waiting: Some((w(2) * 4.0) as u32),
            running: Some(4 + (w(3) * 28.0) as u32),
            queue_capacity: Some(256),
            kv_cache_usage: Some(0.1 + 0.5 * w(4)),
            ttft: Some(q(80.0 + 100.0 * util)),
            e2e: Some(q(900.0 + 1000.0 * util)),
            inter_token: Some(q(12.0 + 10.0 * util)),
            request_rate: Some(4.0),
            error_rate: Some(0.0),
            window_ms: 10_000,
            kv_capacity_tokens: Some(400_000),
            rate_window_ms: 5_000,
            inter_token_recent: Some(q(12.0 + 12.0 * util)),
            recent_window_ms: 150,
            prefix_cache_hit_rate: Some(0.5),
            finished_total: Some(40_000.0),
            errors_total: Some(12.0),
        }),
        sources: vec![fresh("nvml"), fresh("model-server")],
        sample_time_unix_ms: 1_700_000_000_000 + t * 100,
        sequence: t + 1,
        agent_instance: format!("agent-{i:04}"),
        age_ms: 20,
        prefix_cache: None,
    }
}

/// Update `t` of every pod, as the pool agent streams it (the first is full).
fn event_bytes(t: u64) -> Vec<u8> {
    PoolEvent {
        full: t == 0,
        peers: (0..PODS)
            .map(|i| PeerState {
                peer: format!("agent-{i:04}.inference:9100"),
                status: PeerStatus::Live as i32,
                snapshot: Some(snapshot(i, t)),
                reason: String::new(),
            })
            .collect(),
        time_unix_ms: 1_700_000_000_000 + t * 100,
        agent_instance: "pool-agent".into(),
    }
    .encode_to_vec()
}

fn router() -> Router {
    let cfg = FilterConfig::from_json(br#"{"pools":[{"name":"p","cluster":"c"}]}"#).unwrap();
    Router::new(cfg)
}

/// What the glue does with one stream message: decode, apply, encode for the workers.
fn subscriber_step(r: &mut Router, bytes: Vec<u8>, now: u64) -> Vec<u8> {
    r.apply_pool_event_bytes(0, &bytes, now).unwrap();
    drop(bytes);
    r.pool_state(0).unwrap().encode()
}

#[test]
fn a_pool_event_at_1024_pods_never_holds_two_copies_of_the_pool() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (empty, _) = live_and_reset_peak();
    let mut r = router();
    for t in 0..2 {
        let shared = subscriber_step(&mut r, event_bytes(t), t * 100);
        drop(shared);
    }
    let (rest, _) = live_and_reset_peak();
    let state = rest - empty;

    let bytes = event_bytes(2);
    let raw = bytes.len();
    let (before, _) = live_and_reset_peak();
    let shared = subscriber_step(&mut r, bytes, 200);
    let (_, peak) = live_and_reset_peak();
    let over = peak - before;
    eprintln!(
        "subscriber: state at rest {} KiB, event {} KiB on the wire, shared {} KiB, peak over the state and the message {} KiB ({:.2}x the state)",
        state / 1024,
        raw / 1024,
        shared.len() / 1024,
        over / 1024,
        over as f64 / state as f64
    );
    assert!(
        over as f64 <= 0.25 * state as f64,
        "the subscriber path peaked {over} bytes above the state at rest ({state} bytes)"
    );
}

#[test]
fn installing_the_shared_state_at_1024_pods_never_holds_two_copies_of_the_pool() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut publisher = router();
    let first = subscriber_step(&mut publisher, event_bytes(0), 0);
    let second = subscriber_step(&mut publisher, event_bytes(1), 100);
    drop(publisher);

    let (empty, _) = live_and_reset_peak();
    let mut w = router();
    w.set_pool_state_bytes(0, &first, 0).unwrap();
    let (rest, _) = live_and_reset_peak();
    let state = rest - empty;
    drop(first);

    let raw = second.len();
    let (before, _) = live_and_reset_peak();
    w.set_pool_state_bytes(0, &second, 100).unwrap();
    drop(second);
    let (_, peak) = live_and_reset_peak();
    let over = peak - before;
    eprintln!(
        "worker: state at rest {} KiB, shared {} KiB, peak over the state and the shared bytes {} KiB ({:.2}x the state)",
        state / 1024,
        raw / 1024,
        over / 1024,
        over as f64 / state as f64
    );
    assert!(
        over as f64 <= 0.25 * state as f64,
        "the worker path peaked {over} bytes above the state at rest ({state} bytes)"
    );
}
