//! The agent's model-server readers: the Prometheus text parser (`prometheus::parse`), engine
//! detection and extraction for every engine (`engines::detect`, `engines::extract`), the
//! windows that turn two scrapes into `InferenceStats` (`InferenceTracker::update`), and the
//! `/v1/models` body (`parse_models`). Input: the first page, then optionally a NUL byte and
//! the second page. Properties: never panics; no sample carries NaN or ±Inf; no counter sample
//! is negative; every sample's line number is on the page; the stats sent to filters hold no
//! NaN or ±Inf.
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ai_lb_agent::engines::{self, EngineKind};
use ai_lb_agent::prometheus::{self, MetricType};
use ai_lb_agent::sources::model_server::{parse_models, InferenceTracker};
use ai_lb_proto::{InferenceStats, LatencyQuantiles};
use libfuzzer_sys::fuzz_target;

fn finite(v: Option<f64>) -> bool {
    v.is_none_or(f64::is_finite)
}

fn finite_q(q: &Option<LatencyQuantiles>) -> bool {
    q.as_ref()
        .is_none_or(|q| finite(q.p50_ms) && finite(q.p99_ms) && finite(q.mean_ms))
}

fn check_stats(s: &InferenceStats) {
    assert!(
        finite(s.kv_cache_usage),
        "kv_cache_usage {:?}",
        s.kv_cache_usage
    );
    assert!(finite(s.request_rate), "request_rate {:?}", s.request_rate);
    assert!(finite(s.error_rate), "error_rate {:?}", s.error_rate);
    assert!(finite(s.prefix_cache_hit_rate));
    for q in [&s.ttft, &s.e2e, &s.inter_token, &s.inter_token_recent] {
        assert!(finite_q(q), "latency {q:?}");
    }
}

/// The line of each family's first `# TYPE <name> ...`, read as the parser reads comments.
fn type_lines(text: &str) -> HashMap<&str, usize> {
    let mut lines = HashMap::new();
    for (i, line) in text.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let Some(rest) = line.trim_start_matches([' ', '\t']).strip_prefix('#') else {
            continue;
        };
        let mut words = rest.split([' ', '\t']).filter(|w| !w.is_empty());
        if let (Some("TYPE"), Some(name)) = (words.next(), words.next()) {
            lines.entry(name).or_insert(i + 1);
        }
    }
    lines
}

fn check_page(text: &str) -> Option<prometheus::Exposition<'_>> {
    let page = prometheus::parse(text).ok()?;
    let lines = text.split('\n').count();
    let declared = type_lines(text);
    for s in &page.samples {
        assert!(s.value.is_finite(), "sample {} = {}", s.name, s.value);
        assert!(s.line >= 1 && s.line <= lines);
        // A counter's sample after its TYPE line (before it, the family is untyped).
        if page.type_of(s.name) == Some(MetricType::Counter)
            && declared.get(s.name).is_some_and(|l| *l < s.line)
        {
            assert!(s.value >= 0.0, "negative counter {} = {}", s.name, s.value);
        }
    }
    Some(page)
}

fuzz_target!(|data: &[u8]| {
    let _ = parse_models(data);
    let text = String::from_utf8_lossy(data);
    let (first, second) = match text.split_once('\0') {
        Some((a, b)) => (a, b),
        None => (&*text, &*text),
    };
    let Some(p1) = check_page(first) else {
        return;
    };
    let p2 = check_page(second);
    let _ = engines::detect(&p1);
    let t0 = Instant::now();
    for kind in EngineKind::ALL {
        let mut tracker =
            InferenceTracker::new(Duration::from_secs(10), Duration::from_secs(10), None, None);
        let x1 = engines::extract(kind, &p1);
        check_stats(&tracker.update(t0, &x1));
        if let Some(p2) = &p2 {
            let x2 = engines::extract(kind, p2);
            check_stats(&tracker.update(t0 + Duration::from_millis(500), &x2));
        }
    }
});
