//! Cost of costing a request: the token estimator alone and the whole body path (JSON parse +
//! walk + estimate) on a typical ~1 KB chat body and a large ~200 KB one, built from the
//! estimator's fixture corpus. Run: `cargo bench -p ai-lb-filter-core --bench cost`.

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
