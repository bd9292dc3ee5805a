//! Cost of prefix affinity per request (`prefixAffinity`): keying a chat body's prompt
//! (`Router::key_prompt`: JSON parse, the ai-lb-prefix tokenizer and chat template, one chained
//! key per 64-token block) at 2 000 and 8 192 prompt tokens, and one pick with a keyed prompt
//! (`Router::decide_with`) among 8, 64 and 1024 pods that each report 200 cached blocks, next to
//! the same pick without a prompt. Run: `cargo bench -p ai-lb-filter-core --bench prefix`.

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{RequestSize, Router};
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
    PrefixCacheSummary,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::hint::black_box;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn body(tokens: usize) -> Vec<u8> {
    let system: String = (0..tokens.saturating_sub(40))
        .map(|i| format!("w{:03}", i % 1000))
        .collect();
    serde_json::json!({"model": MODEL, "max_tokens": 200, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "what does the document above say about caching and routing?"}]})
    .to_string()
    .into_bytes()
}

fn router(n: usize, held_from: &[u32]) -> Router {
    let cfg = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"minPods":1,"prefixAffinity":{}}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let peers = (0..n)
        .map(|i| {
            // Each pod: 200 blocks of other prefixes; pod 3 also the benchmarked prompt's.
            let mut keys: Vec<u32> = (0..200u32)
                .map(|k| k.wrapping_mul(2_654_435_761) ^ i as u32)
                .collect();
            if i == 3 {
                keys.extend_from_slice(held_from);
            }
            keys.sort_unstable();
            keys.dedup();
            PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
                        ..Default::default()
                    }),
                    gpus: vec![GpuStats {
                        utilization: Some(1.0),
                        sm_occupancy: Some((i % 47) as f64 / 100.0),
                        ..Default::default()
                    }],
                    inference: Some(InferenceStats {
                        waiting: Some((i % 3) as u32),
                        running: Some(4),
                        queue_capacity: Some(8),
                        kv_cache_usage: Some((i % 7) as f64 / 10.0),
                        kv_capacity_tokens: Some(400_000),
                        ..Default::default()
                    }),
                    prefix_cache: Some(PrefixCacheSummary {
                        block_tokens: 64,
                        keys,
                        truncated: false,
                        model: MODEL.into(),
                    }),
                    ..Default::default()
                }),
                reason: String::new(),
            }
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

fn bench_prefix(c: &mut Criterion) {
    let mut g = c.benchmark_group("key_prompt");
    let r = router(8, &[]);
    let (mut ids, mut scratch) = (Vec::new(), Vec::new());
    for tokens in [2_000usize, 8_192] {
        let b = body(tokens);
        g.bench_with_input(BenchmarkId::from_parameter(tokens), &tokens, |bn, _| {
            bn.iter(|| black_box(r.key_prompt(0, black_box(&b), &mut ids, &mut scratch)))
        });
    }
    g.finish();

    let probe = router(8, &[]);
    let b = body(2_000);
    let q = probe
        .key_prompt(0, &b, &mut ids, &mut scratch)
        .unwrap_or_else(|| panic!("no prompt keyed"));
    let size = RequestSize {
        weight: 1.0,
        kv_tokens: 2_200.0,
        output_tokens: 200.0,
    };
    let mut g = c.benchmark_group("decide");
    for n in [8usize, 64, 1024] {
        let mut r = router(n, &q.keys);
        let mut rng = SmallRng::seed_from_u64(42);
        r.decide_for(0, None, size, 1000, &mut rng);
        g.bench_with_input(BenchmarkId::new("with_prompt", n), &n, |bn, _| {
            bn.iter(|| black_box(r.decide_with(0, None, size, Some(&q), black_box(1000), &mut rng)))
        });
        let mut r = router(n, &q.keys);
        r.decide_for(0, None, size, 1000, &mut rng);
        g.bench_with_input(BenchmarkId::new("without", n), &n, |bn, _| {
            bn.iter(|| black_box(r.decide_for(0, None, size, black_box(1000), &mut rng)))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_prefix);
criterion_main!(benches);
