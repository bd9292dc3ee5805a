//! Cost of costing a request: the token estimator alone and the whole body path (JSON parse +
//! walk + estimate) on a typical ~1 KB chat body and a large ~200 KB one, built from the
//! estimator's fixture corpus, against a baseline of parsing the same body with serde_json.
//! Run: `cargo bench -p ai-lb-filter-core --bench cost`.
//!
//! One run (2-core dev box at load average ~10, so absolute numbers are low; compare ratios):
//!
//! | body            | serde_json parse | estimate_text_tokens | cost_from_body (parse+walk+estimate) |
//! |-----------------|------------------|----------------------|--------------------------------------|
//! | typical (~1 KB) | 6.7 us, 146 MiB/s | 6.7 us, 145 MiB/s (1.0x parse) | 10.3 us, 95 MiB/s (1.5x parse) |
//! | large (~200 KB) | 0.64 ms, 309 MiB/s | 1.6 ms, 123 MiB/s (2.5x parse) | 3.0 ms, 67 MiB/s (4.6x parse) |

use std::hint::black_box;
use std::path::PathBuf;

use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{cost_from_body, estimate_text_tokens, Endpoint};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn corpus_text() -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect::<Vec<_>>()
        .join("\n")
}

fn chat_body(prompt: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "llama-3.1-8b-instruct",
        "max_tokens": 512,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Answer concisely."},
            {"role": "user", "content": prompt}
        ]
    })
    .to_string()
    .into_bytes()
}

fn body_of_size(corpus: &str, target: usize) -> Vec<u8> {
    let mut prompt = String::new();
    while prompt.len() < target {
        let take = corpus.len().min(target - prompt.len());
        // Cut on a char boundary.
        let mut end = take;
        while !corpus.is_char_boundary(end) {
            end -= 1;
        }
        prompt.push_str(&corpus[..end]);
        if end == 0 {
            break;
        }
    }
    chat_body(&prompt)
}

fn bench(c: &mut Criterion) {
    let corpus = corpus_text();
    let cfg = CostConfig::default();
    for (name, size) in [("typical_1k", 850usize), ("large_200k", 200_000)] {
        let body = body_of_size(&corpus, size);
        let text = String::from_utf8_lossy(&body).into_owned();
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Bytes(body.len() as u64));
        // Baseline in the same run: parsing the body with serde_json alone.
        g.bench_function("baseline_serde_json_parse", |b| {
            b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(&body)).is_ok())
        });
        g.bench_function("estimate_text_tokens", |b| {
            b.iter(|| estimate_text_tokens(black_box(&text)))
        });
        g.bench_function("cost_from_body", |b| {
            b.iter(|| {
                cost_from_body(black_box(&cfg), Endpoint::Chat, black_box(&body))
                    .map(|c| c.weighted)
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
