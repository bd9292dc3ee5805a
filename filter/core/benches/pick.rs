//! Cost of one pick (`Router::decide`) among 64, 256 and 1024 pods, steady state (no pool
//! update between picks). Target: ≤ 1 µs natively for 1024 pods.
//! Run: `cargo bench -p ai-lb-filter-core --bench pick`.

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, Router};
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::hint::black_box;

fn router(n: usize) -> Router {
    let cfg = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"minPods":3,"fallbackEndpoints":2}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let peers = (0..n)
        .map(|i| PeerState {
            peer: format!("agent-{i}:9090"),
            status: PeerStatus::Live as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
                    ..Default::default()
                }),
                gpus: vec![GpuStats {
                    utilization: Some((i % 97) as f64 / 100.0),
                    ..Default::default()
                }],
                inference: Some(InferenceStats {
                    waiting: Some((i % 13) as u32),
                    kv_cache_usage: Some((i % 7) as f64 / 10.0),
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
    r
}

fn bench_pick(c: &mut Criterion) {
    let mut g = c.benchmark_group("pick");
    for n in [64usize, 256, 1024] {
        let mut r = router(n);
        let mut rng = SmallRng::seed_from_u64(42);
        // Warm the per-model view once (first pick builds it).
        assert!(matches!(
            r.decide(0, None, 1000, &mut rng),
            Decision::Steer { .. }
        ));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(r.decide(0, None, black_box(1000), &mut rng)))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_pick);
criterion_main!(benches);
