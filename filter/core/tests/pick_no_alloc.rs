//! Decides whether a pick allocates: `Router::decide` plus the in-flight bookkeeping around it
//! (`on_request_start` / `on_request_end`) run 10 000 times over 1024 pods under a counting
//! global allocator, after one warm-up pick (which builds the per-model view). The issue asks
//! for no allocation per pick; the pick benchmark (`benches/pick.rs`) measures its time.

// A counting global allocator cannot be written without `unsafe` (the `GlobalAlloc` contract);
// it only forwards to `System`. Test code only.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, PeerState, PeerStatus, PodIdentity, PodSnapshot,
    PoolEvent,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwards the caller's layout contract to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn router(n: usize) -> (Router, Vec<String>) {
    let cfg = FilterConfig::from_json(br#"{"pools":[{"name":"p","cluster":"c"}]}"#).unwrap();
    let addrs: Vec<String> = (0..n)
        .map(|i| format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256))
        .collect();
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| PeerState {
            peer: format!("agent-{i}:9090"),
            status: PeerStatus::Live as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: a.clone(),
                    ..Default::default()
                }),
                gpus: vec![GpuStats {
                    utilization: Some((i % 90) as f64 / 100.0),
                    ..Default::default()
                }],
                inference: Some(InferenceStats {
                    waiting: Some((i % 3) as u32),
                    running: Some((i % 9) as u32),
                    queue_capacity: Some(8),
                    kv_cache_usage: Some((i % 7) as f64 / 10.0),
                    // Half the pods report their KV capacity (the KV-aware path), half not.
                    kv_capacity_tokens: (i % 2 == 0).then_some(12_500),
                    // Decode speeds for long answers (`longOutputTokens`).
                    inter_token_recent: Some(LatencyQuantiles {
                        p50_ms: Some(5.0),
                        samples: 100,
                        mean_ms: Some(4.0 + (i % 5) as f64),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            reason: String::new(),
        })
        .collect();
    let mut r = Router::new(cfg);
    r.apply_pool_event(
        0,
        &PoolEvent {
            full: true,
            peers,
            ..Default::default()
        },
        1000,
    );
    (r, addrs)
}

#[test]
fn a_pick_with_its_start_and_end_allocates_nothing() {
    let (mut r, addrs) = router(1024);
    let mut rng = SmallRng::seed_from_u64(7);
    assert!(matches!(
        r.decide(0, None, 1000, &mut rng),
        Decision::Steer { .. }
    ));
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut steered = 0;
    for k in 0..10_000usize {
        // Every fifth request is a long prompt that fits few KV caches (extra draws), every
        // seventh a long answer (decode-speed comparison, extra draws).
        let size = RequestSize {
            weight: 1.0,
            kv_tokens: if k % 5 == 0 { 9_000.0 } else { 400.0 },
            output_tokens: if k % 7 == 0 { 2_000.0 } else { 100.0 },
        };
        if let Decision::Steer { ranked, .. } = r.decide_for(0, None, size, 1000, &mut rng) {
            steered += 1;
            // The glue passes the chosen pod's address (written into the routing header).
            let a = &addrs[k % addrs.len()];
            let _ = ranked.first();
            r.on_request_start(0, a, size, 1000);
            r.on_request_end(0, a, size, 1000);
        }
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    assert_eq!(steered, 10_000);
    assert_eq!(after - before, 0, "allocations during 10 000 picks");
}
