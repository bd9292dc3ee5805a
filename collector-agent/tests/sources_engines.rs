//! Each engine's fixture pair (a scrape, then the same server one second later; written by
//! `tests/fixtures/gen_fixtures.py` with each project's documented metric names) through the
//! model-server source's pure path → the expected `InferenceStats`; malformed pages and bad
//! values rejected and counted, never forwarded.

use ai_lb_agent::engines::EngineKind;
use ai_lb_agent::sources::model_server::{ModelServerOptions, ModelServerSource};
use ai_lb_agent::sources::{Reading, SourceError};
use ai_lb_proto::v1::{Engine, InferenceStats, LatencyQuantiles};
use std::time::{Duration, Instant};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn source(engine: Option<EngineKind>) -> ModelServerSource {
    let mut o = ModelServerOptions::new("http://127.0.0.1:1");
    o.engine = engine;
    ModelServerSource::new(o).unwrap()
}

/// Scrapes `<name>.prom` at t0 and `<name>_next.prom` at t0 + 1 s; returns both readings.
fn two_scrapes(name: &str, engine: Option<EngineKind>) -> (Reading, Reading) {
    let mut s = source(engine);
    let t0 = Instant::now();
    let first = s
        .sample_page(t0, &fixture(&format!("{name}.prom")))
        .unwrap();
    let second = s
        .sample_page(
            t0 + Duration::from_secs(1),
            &fixture(&format!("{name}_next.prom")),
        )
        .unwrap();
    (first, second)
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() <= 1e-6 * b.abs().max(1.0))
}

#[track_caller]
fn assert_q(q: &Option<LatencyQuantiles>, samples: u64, p50: f64, p99: f64) {
    let q = q.as_ref().expect("quantiles message present");
    assert_eq!(q.samples, samples, "{q:?}");
    assert!(close(q.p50_ms, p50), "p50 {:?} != {p50}", q.p50_ms);
    assert!(close(q.p99_ms, p99), "p99 {:?} != {p99}", q.p99_ms);
}

#[track_caller]
fn assert_absent(q: &Option<LatencyQuantiles>) {
    let q = q.as_ref().expect("quantiles message present");
    assert_eq!(
        (q.samples, q.p50_ms, q.p99_ms),
        (0, None, None),
        "expected an empty window: {q:?}"
    );
}

fn stats(r: &Reading) -> &InferenceStats {
    r.inference.as_ref().expect("inference stats")
}

#[test]
fn first_scrape_has_gauges_but_no_windowed_values() {
    let mut s = source(None);
    let r = s
        .sample_page(Instant::now(), &fixture("vllm.prom"))
        .unwrap();
    let st = stats(&r);
    assert_eq!(st.waiting, Some(5));
    assert_absent(&st.ttft);
    assert_absent(&st.e2e);
    assert_eq!(
        st.request_rate, None,
        "one scrape: no rate, never lifetime totals"
    );
    assert_eq!(st.error_rate, None);
}

#[test]
fn vllm_current_names() {
    let (_, r) = two_scrapes("vllm", None);
    assert_eq!(r.engine, Some(Engine::Vllm));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let st = stats(&r);
    assert_eq!(st.waiting, Some(5));
    assert_eq!(st.running, Some(12));
    assert_eq!(st.queue_capacity, None);
    assert_eq!(st.kv_cache_usage, Some(0.42));
    assert_eq!(
        st.kv_capacity_tokens,
        Some(448_000),
        "cache_config_info: num_gpu_blocks 28000 x block_size 16"
    );
    assert_q(&st.ttft, 100, 50.0, 59.8);
    assert_q(&st.inter_token, 1000, 17.5, 24.85);
    assert_q(&st.e2e, 100, 800.0, 996.0);
    assert!(close(st.request_rate, 100.0), "{:?}", st.request_rate);
    // abort (3) + error (2) out of 100 finished.
    assert!(close(st.error_rate, 0.05), "{:?}", st.error_rate);
    assert_eq!(st.window_ms, 1000);
    let models = r.models.expect("models from labels");
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].name, "meta-llama/Llama-3.1-8B-Instruct");
}

#[test]
fn vllm_older_names_and_two_models_summed() {
    let (_, r) = two_scrapes("vllm_old", Some(EngineKind::Vllm));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let st = stats(&r);
    assert_eq!(st.waiting, Some(5), "3 + 2 over two model_name series");
    assert_eq!(st.running, Some(10));
    assert_eq!(
        st.kv_cache_usage,
        Some(0.55),
        "ratios: the highest, not the sum"
    );
    assert_eq!(
        st.kv_capacity_tokens, None,
        "no cache_config_info on the page"
    );
    assert_q(&st.ttft, 100, 50.0, 59.8);
    assert_q(&st.inter_token, 1000, 17.5, 24.85);
    assert_q(&st.e2e, 100, 800.0, 996.0);
    assert!(close(st.request_rate, 50.0), "{:?}", st.request_rate);
    assert!(close(st.error_rate, 0.08), "{:?}", st.error_rate);
    let names: Vec<_> = r.models.unwrap().into_iter().map(|m| m.name).collect();
    assert_eq!(names, vec!["model-a", "model-b"]);
}

#[test]
fn sglang() {
    let (_, r) = two_scrapes("sglang", None);
    assert_eq!(r.engine, Some(Engine::Sglang));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let st = stats(&r);
    assert_eq!((st.waiting, st.running), (Some(2), Some(9)));
    assert_eq!(st.kv_cache_usage, Some(0.28));
    assert_eq!(st.kv_capacity_tokens, Some(471_258));
    assert_eq!(
        st.queue_capacity, None,
        "SGLang exports no running-request cap"
    );
    assert_q(&st.ttft, 100, 50.0, 59.8);
    assert_q(&st.inter_token, 1000, 17.5, 24.85);
    assert_q(&st.e2e, 100, 800.0, 996.0);
    assert!(close(st.request_rate, 50.0));
    assert!(close(st.error_rate, 0.1), "{:?}", st.error_rate);
    assert_eq!(r.models.unwrap()[0].name, "Qwen/Qwen3-8B");
}

#[test]
fn tgi() {
    let (_, r) = two_scrapes("tgi", None);
    assert_eq!(r.engine, Some(Engine::Tgi));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let st = stats(&r);
    assert_eq!((st.waiting, st.running), (Some(6), Some(16)));
    assert_eq!(st.kv_cache_usage, None, "TGI has no KV-cache gauge");
    assert_eq!(st.kv_capacity_tokens, None);
    assert_absent(&st.ttft);
    assert_q(&st.e2e, 20, 1024.0, 2027.52);
    assert_q(&st.inter_token, 20, 24.0, 31.84);
    assert!(close(st.request_rate, 20.0));
    assert!(close(st.error_rate, 0.05));
    assert_eq!(r.models, None, "TGI labels no model");
}

#[test]
fn triton_trtllm() {
    let (_, r) = two_scrapes("triton", None);
    assert_eq!(r.engine, Some(Engine::Triton));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let st = stats(&r);
    assert_eq!((st.waiting, st.running), (Some(3), Some(7)));
    assert_eq!(st.queue_capacity, Some(256), "from request_type=\"max\"");
    assert_eq!(st.kv_cache_usage, Some(0.25));
    assert_eq!(st.kv_capacity_tokens, None, "not read for Triton");
    assert_q(&st.ttft, 40, 175.0, 248.5);
    assert_absent(&st.e2e); // nv_inference_request_duration_us is a counter, not a histogram
    assert_absent(&st.inter_token);
    // One request counted in the ensemble and in each composing model: busiest model only.
    assert!(close(st.request_rate, 40.0), "{:?}", st.request_rate);
    assert!(close(st.error_rate, 0.25), "{:?}", st.error_rate);
    let models = r.models.unwrap();
    assert!(models
        .iter()
        .any(|m| m.name == "tensorrt_llm" && m.version == "1"));
}

#[test]
fn configured_queue_capacity_wins() {
    let mut o = ModelServerOptions::new("http://127.0.0.1:1");
    o.queue_capacity = Some(64);
    let mut s = ModelServerSource::new(o).unwrap();
    let r = s
        .sample_page(Instant::now(), &fixture("triton.prom"))
        .unwrap();
    assert_eq!(stats(&r).queue_capacity, Some(64));
}

#[test]
fn configured_kv_capacity_wins_over_the_page() {
    let mut o = ModelServerOptions::new("http://127.0.0.1:1");
    o.kv_capacity_tokens = Some(100_000);
    let mut s = ModelServerSource::new(o).unwrap();
    let r = s
        .sample_page(Instant::now(), &fixture("vllm.prom"))
        .unwrap();
    assert_eq!(
        stats(&r).kv_capacity_tokens,
        Some(100_000),
        "not the page's 448 000"
    );
    // And it fills in for an engine that states none.
    let r = s.sample_page(Instant::now(), &fixture("tgi.prom")).unwrap();
    assert_eq!(stats(&r).kv_capacity_tokens, Some(100_000));
}

#[test]
fn configured_engine_missing_from_page_is_an_error() {
    let mut s = source(Some(EngineKind::Sglang));
    let e = s
        .sample_page(Instant::now(), &fixture("vllm.prom"))
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("no sglang metrics") && msg.contains("detected: vllm"),
        "{msg}"
    );
}

#[test]
fn engine_restart_resets_the_window() {
    let mut s = source(None);
    let t0 = Instant::now();
    let sec = Duration::from_secs;
    s.sample_page(t0, &fixture("vllm.prom")).unwrap();
    s.sample_page(t0 + sec(1), &fixture("vllm_next.prom"))
        .unwrap();
    // Restart: counters back near zero (the t0 page scaled down is enough: every count drops).
    let restarted = "# TYPE vllm:time_to_first_token_seconds histogram\n\
        vllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 1\n\
        vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n\
        # TYPE vllm:request_success_total counter\n\
        vllm:request_success_total{finished_reason=\"stop\"} 1\n";
    let r = s.sample_page(t0 + sec(2), restarted).unwrap();
    let st = stats(&r);
    assert_absent(&st.ttft);
    assert_eq!(st.request_rate, None, "no negative rate across a restart");
}

#[test]
fn nan_and_negative_values_are_rejected_and_counted() {
    let page = "# TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{model_name=\"m\"} NaN\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\"} -3\n\
        # TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} +Inf\n\
        # TYPE vllm:request_success_total counter\n\
        vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} -5\n\
        # TYPE vllm:e2e_request_latency_seconds histogram\n\
        vllm:e2e_request_latency_seconds_bucket{le=\"1.0\",model_name=\"m\"} 4\n\
        vllm:e2e_request_latency_seconds_bucket{le=\"+Inf\",model_name=\"m\"} NaN\n";
    let mut s = source(None);
    let r = s.sample_page(Instant::now(), page).unwrap();
    let st = stats(&r);
    assert_eq!(st.waiting, None);
    assert_eq!(st.running, None);
    assert_eq!(st.kv_cache_usage, None);
    assert_eq!(st.request_rate, None);
    assert_absent(&st.e2e);
    let fields: Vec<&str> = r.rejected.iter().map(|r| r.field.as_str()).collect();
    assert_eq!(
        fields,
        vec![
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:request_success_total",
            "vllm:e2e_request_latency_seconds_bucket",
            "vllm:num_requests_running",
            "vllm:e2e_request_latency_seconds",
        ]
    );
    assert_eq!(r.rejected[0].value, "NaN");
    assert!(
        r.rejected[0].reason.contains("line 2"),
        "{:?}",
        r.rejected[0]
    );
}

#[test]
fn decreasing_buckets_are_rejected() {
    let page = "# TYPE vllm:time_to_first_token_seconds histogram\n\
        vllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 9\n\
        vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n";
    let r = source(None).sample_page(Instant::now(), page).unwrap();
    assert_eq!(r.rejected.len(), 1, "{:?}", r.rejected);
    assert!(r.rejected[0].reason.contains("decreases"));
}

#[test]
fn malformed_page_fails_the_sample_with_its_line() {
    let mut page = fixture("vllm.prom");
    page.push_str("vllm:num_requests_waiting{model_name=\"m\" 3\n");
    let lines = page.lines().count();
    match source(None).sample_page(Instant::now(), &page) {
        Err(SourceError::Malformed { line, .. }) => assert_eq!(line, lines),
        other => panic!("expected Malformed, got {other:?}"),
    }
}
