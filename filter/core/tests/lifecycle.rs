//! Decides whether one request's life, as both data paths run it ([`Exchange`]), does what the
//! filter promises, driven by a mock host and a mock worker with no Envoy: the client's routing
//! header is dropped, the status page answers, foreign clusters are left alone, the model is
//! read from the body, the ranked list reaches the host, the in-flight count is closed exactly
//! once however the request ends (answered, failed, held then released, refused by the gate,
//! ended twice), failures feed the shared breaker, a half-open probe passes at its first byte.
//! Guard mode: a hot local pod is answered 503 marked for the client sidecar, stale or missing
//! signals admit, each counted.

mod support;

use ai_lb_filter_core::breaker::{Breaker, BreakerState, Transition};
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::lifecycle::{
    carry_signal_trips, steer, BreakerStore, Exchange, Gate, GateStep, Host, Next, NoGate, Stats,
    Steered,
};
use ai_lb_filter_core::picker::{RequestSize, Router};
use ai_lb_proto::{InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent};
use support::{pods_event, MockHost, SyncWorker};

const PODS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

#[derive(Default)]
struct Counted {
    picked: Vec<String>,
    failed: Vec<String>,
    transitions: Vec<(String, BreakerState)>,
}

impl Stats for Counted {
    fn picked(&mut self, pod: &str) {
        self.picked.push(pod.into());
    }
    fn failed(&mut self, pod: &str) {
        self.failed.push(pod.into());
    }
    fn transitions(&mut self, pod: &str, ts: &[Transition]) {
        self.transitions
            .extend(ts.iter().map(|t| (pod.to_string(), t.to)));
    }
}

type MockWorker = SyncWorker<Counted>;

/// The agents' snapshot of the three pods, received at `now`.
fn publish(router: &mut Router, now: u64) {
    router.apply_pool_event(0, &pods_event(&PODS, |i| i as u32), now);
}

fn worker() -> MockWorker {
    let cfg = FilterConfig::from_json(
        br#"{"pools":[{"name":"default","cluster":"inference"},{"name":"other","cluster":"other"}],
             "modelHeader":"x-model","debugHeader":"x-ai-lb-debug","statusPath":"/ai-lb/status",
             "breaker":{"consecutiveFailures":2,"baseCooldownMs":1000}}"#,
    )
    .unwrap();
    let mut router = Router::new(cfg);
    publish(&mut router, 1_000);
    SyncWorker::new(router, Counted::default(), 1, 7)
}

fn host(now: u64) -> MockHost {
    MockHost::at(now)
}

fn inflight(w: &MockWorker, now: u64) -> u32 {
    w.router.pod_status(0, now).iter().map(|p| p.inflight).sum()
}

/// Runs a whole answered request: headers without body, a 200, the end.
fn answered(w: &mut MockWorker, now: u64, code: u16) -> (Exchange, MockHost) {
    let mut h = host(now);
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, w, &mut NoGate, true),
        Next::Continue
    );
    let chosen = ex.chosen().expect("steered").to_string();
    h.upstream = Some(chosen);
    h.code = Some(code);
    h.resp.insert(":status".into(), code.to_string());
    ex.on_response_headers(&mut h, w, &mut NoGate, false);
    h.now += 5;
    ex.on_response_body(&mut h, w, &mut NoGate, 10, true);
    ex.on_end(&mut h, w, &mut NoGate);
    (ex, h)
}

#[test]
fn a_client_sent_routing_header_is_dropped_and_the_ranked_list_reaches_the_host() {
    let mut w = worker();
    let mut h = host(1_010);
    h.req
        .insert("x-gateway-destination-endpoint".into(), "6.6.6.6:1".into());
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, true),
        Next::Continue
    );
    let ranked = h
        .req
        .get("x-gateway-destination-endpoint")
        .cloned()
        .unwrap();
    assert_eq!(h.steered, vec![ranked.clone()]);
    assert!(
        !ranked.contains("6.6.6.6"),
        "the client's value is gone: {ranked}"
    );
    let chosen = ranked.split(',').next().unwrap();
    assert!(PODS.contains(&chosen));
    assert_eq!(w.stats.picked, vec![chosen.to_string()]);
    assert_eq!(inflight(&w, 1_010), 1);
}

#[test]
fn the_in_flight_count_is_closed_once_when_the_request_ends_even_if_ended_twice() {
    let mut w = worker();
    let (mut ex, mut h) = answered(&mut w, 1_010, 200);
    assert_eq!(inflight(&w, 1_020), 0);
    assert!(ex.ended());
    // A second end (e.g. a stream-complete after the log phase) changes nothing.
    ex.on_end(&mut h, &mut w, &mut NoGate);
    assert_eq!(inflight(&w, 1_020), 0);
    // A clean success on a clean breaker writes nothing shared.
    assert_eq!(w.store.writes, 0);
}

#[test]
fn the_status_page_answers_from_this_worker_and_says_which() {
    let mut w = worker();
    let mut h = host(1_010);
    h.req.insert(":path".into(), "/ai-lb/status?x=1".into());
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, true),
        Next::Stop
    );
    let (status, _, body) = h.replies.first().cloned().unwrap();
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["worker"], 7);
    assert_eq!(v["pools"][0]["pods"].as_array().unwrap().len(), 3);
    assert!(h.steered.is_empty());
}

#[test]
fn a_cluster_of_no_pool_is_left_alone() {
    let mut w = worker();
    let mut h = host(1_010);
    h.cluster = Some("payments".into());
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, false),
        Next::Continue
    );
    assert_eq!(ex.pool(), None);
    assert!(h.steered.is_empty());
    ex.on_end(&mut h, &mut w, &mut NoGate);
    assert_eq!(inflight(&w, 1_010), 0);
}

#[test]
fn the_model_is_read_from_the_body_when_no_header_names_it() {
    let mut w = worker();
    let mut h = host(1_010);
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, false),
        Next::StopForBody
    );
    assert!(h.steered.is_empty(), "nothing is steered before the body");
    let body = br#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(
        ex.on_request_body(&mut h, &mut w, &mut NoGate, body, true),
        Next::Continue
    );
    assert_eq!(ex.model(), Some("m"));
    assert_eq!(h.steered.len(), 1);
    // The body's output reservation sizes the request.
    assert!(ex.size() != RequestSize::UNIT, "{:?}", ex.size());
}

#[test]
fn a_model_header_is_used_and_the_debug_header_answers() {
    let mut w = worker();
    let mut h = host(1_010);
    h.req.insert("x-model".into(), "m".into());
    h.req.insert("x-ai-lb-debug".into(), "1".into());
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, false),
        Next::Continue
    );
    assert_eq!(ex.model(), Some("m"));
    // The model header is the client's to send (its own request's model) and goes on; the
    // debug header only asks this filter for the response header and goes no further.
    assert_eq!(h.req.get("x-model").map(String::as_str), Some("m"));
    assert!(!h.req.contains_key("x-ai-lb-debug"), "{:?}", h.req);
    ex.on_response_headers(&mut h, &mut w, &mut NoGate, false);
    let dbg = h.resp.get("x-ai-lb-debug").cloned().unwrap();
    assert!(
        dbg.starts_with(&format!("pod={}", ex.chosen().unwrap())),
        "{dbg}"
    );
}

/// A worker whose config turns admission on with `admission` (JSON).
fn worker_with_admission(admission: &str) -> MockWorker {
    let mut w = worker();
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"default","cluster":"inference"}}],"admission":{admission}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    w.router = Router::new(cfg);
    publish(&mut w.router, 1_000);
    w
}

/// Issue 31: a client cannot claim a priority class. The priority header is dropped before
/// the gate reads it unless `admission.trustedHeaders` says a filter before this one sets it;
/// with admission off the filter reads no priority header and leaves it alone.
#[test]
fn an_untrusted_priority_header_is_dropped_and_a_trusted_one_kept() {
    let cases = [
        (r#"{}"#, false),
        (r#"{"enabled": false}"#, true),
        (r#"{"trustedHeaders": ["x-ai-lb-priority"]}"#, true),
        (
            r#"{"priority": {"header": "x-prio"}, "trustedHeaders": ["x-ai-lb-priority"]}"#,
            true,
        ),
    ];
    for (admission, kept) in cases {
        let mut w = worker_with_admission(admission);
        let mut h = host(1_010);
        h.req.insert("x-ai-lb-priority".into(), "critical".into());
        h.req.insert("x-prio".into(), "critical".into());
        let mut ex = Exchange::new();
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, true);
        assert_eq!(
            h.req.contains_key("x-ai-lb-priority"),
            kept,
            "admission {admission}: {:?}",
            h.req
        );
        // A custom priority header that is not trusted is dropped too.
        let custom = admission.contains("x-prio");
        assert_eq!(
            h.req.contains_key("x-prio"),
            !custom,
            "admission {admission}"
        );
    }
}

#[test]
fn failures_feed_the_shared_breaker_and_an_open_is_logged() {
    let mut w = worker();
    let mut opened_pod = None;
    for i in 0..20 {
        let (ex, h) = answered(&mut w, 1_010 + i, 503);
        let pod = ex.chosen().unwrap().to_string();
        if !h.warnings.is_empty() {
            assert!(h.warnings[0].contains(&pod) && h.warnings[0].contains("opened"));
            opened_pod = Some(pod);
            break;
        }
    }
    let pod = opened_pod.expect("two failures in a row on one pod open its breaker");
    assert!(w.stats.failed.contains(&pod));
    assert!(w
        .stats
        .transitions
        .contains(&(pod.clone(), BreakerState::Open)));
    assert_eq!(w.store.by_pod[&pod].state(), BreakerState::Open);
    assert_eq!(inflight(&w, 2_000), 0);
}

#[test]
fn a_half_open_probe_passes_at_its_first_byte_and_is_not_recorded_again() {
    let mut w = worker();
    let cfg = w.router.config().breaker;
    // Open every pod, then let the cooldown pass: each is half-open at the next poll.
    for pod in PODS {
        let trip = &mut |b: &mut Breaker| {
            b.trip(
                ai_lb_filter_core::breaker::TripReason::ServerErrors,
                1_000,
                &cfg,
            )
        };
        w.store.update(&mut w.router, 0, pod, 1_000, trip);
    }
    let later = 1_000 + 60_000;
    // Fresh metrics at the later time.
    publish(&mut w.router, later);
    let mut h = host(later);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, &mut w, &mut NoGate, true);
    let pod = ex
        .chosen()
        .expect("a half-open pod takes a probe")
        .to_string();
    assert_eq!(w.store.by_pod[&pod].state(), BreakerState::HalfOpen);
    h.upstream = Some(pod.clone());
    h.code = Some(200);
    h.resp.insert(":status".into(), "200".into());
    ex.on_response_headers(&mut h, &mut w, &mut NoGate, false);
    h.now += 10;
    ex.on_response_body(&mut h, &mut w, &mut NoGate, 10, false);
    let writes = w.store.writes;
    ex.on_end(&mut h, &mut w, &mut NoGate);
    assert_eq!(
        w.store.writes, writes,
        "the passed probe is not recorded again"
    );
}

#[test]
fn a_refused_steer_counts_and_leaves_nothing_in_flight() {
    let mut w = worker();
    let mut h = host(1_010);
    h.refuse_steer = true;
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, true),
        Next::Continue
    );
    assert_eq!(ex.chosen(), None);
    assert_eq!(w.router.counters().steer_failed, 1);
    assert_eq!(inflight(&w, 1_010), 0);
    assert!(w.stats.picked.is_empty());
}

/// A gate that answers, or holds then releases through the core's `steer`.
struct TestGate {
    begin: GateStep,
    before_route: GateStep,
    resumed: Option<Steered>,
    ends: usize,
}

impl Gate<MockWorker> for TestGate {
    fn begin<H: Host + ?Sized>(
        &mut self,
        _h: &mut H,
        _w: &mut MockWorker,
        _eos: bool,
        _now: u64,
    ) -> GateStep {
        self.begin
    }
    fn before_route<H: Host + ?Sized>(
        &mut self,
        _h: &mut H,
        _w: &mut MockWorker,
        _pool: usize,
        _model: Option<&str>,
        _size: RequestSize,
        _now: u64,
    ) -> GateStep {
        self.before_route
    }
    fn take_resumed(&mut self, _w: &mut MockWorker) -> Option<Steered> {
        self.resumed.take()
    }
    fn on_end<H: Host + ?Sized>(&mut self, _h: &mut H, _w: &mut MockWorker, _now: u64) {
        self.ends += 1;
    }
}

#[test]
fn a_request_the_gate_answers_is_not_routed() {
    let mut w = worker();
    let mut h = host(1_010);
    let mut g = TestGate {
        begin: GateStep::Replied,
        before_route: GateStep::Proceed,
        resumed: None,
        ends: 0,
    };
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut g, false),
        Next::Stop
    );
    assert!(h.steered.is_empty());
    ex.on_end(&mut h, &mut w, &mut g);
    assert_eq!(g.ends, 1);
    assert_eq!(inflight(&w, 1_010), 0);
}

#[test]
fn a_held_request_released_later_is_closed_in_flight_at_its_end() {
    let mut w = worker();
    let mut h = host(1_010);
    let mut g = TestGate {
        begin: GateStep::NeedBody,
        before_route: GateStep::Held,
        resumed: None,
        ends: 0,
    };
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut g, false),
        Next::StopForBody
    );
    assert_eq!(
        ex.on_request_body(&mut h, &mut w, &mut g, b"{}", true),
        Next::Stop
    );
    assert!(h.steered.is_empty());
    // The glue's root releases it: it routes with the core's steer.
    let mut root_host = host(1_050);
    g.resumed = steer(&mut root_host, &mut w, 0, None, 1_050, ex.size(), None);
    assert!(g.resumed.is_some());
    assert_eq!(inflight(&w, 1_050), 1);
    h.now = 1_100;
    h.code = Some(200);
    ex.on_response_headers(&mut h, &mut w, &mut g, false);
    assert!(ex.chosen().is_some(), "the release's pick is the request's");
    ex.on_end(&mut h, &mut w, &mut g);
    assert_eq!(inflight(&w, 1_100), 0);
}

#[test]
fn a_trip_the_agent_reports_reaches_the_shared_breaker_once() {
    let mut w = worker();
    // Pod 0's agent: 30 % of 12 requests failed in its 10 s window (agentErrorRate 0.25).
    let ev = PoolEvent {
        full: false,
        peers: vec![PeerState {
            peer: "agent-0:9090".into(),
            status: PeerStatus::Live as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: PODS[0].into(),
                    ..Default::default()
                }),
                inference: Some(InferenceStats {
                    waiting: Some(0),
                    running: Some(0),
                    queue_capacity: Some(8),
                    error_rate: Some(0.3),
                    request_rate: Some(1.2),
                    window_ms: 10_000,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            reason: String::new(),
        }],
        ..Default::default()
    };
    w.router.apply_pool_event(0, &ev, 1_100);
    let mut h = host(1_100);
    carry_signal_trips(&mut h, &mut w, 1_100);
    assert_eq!(w.store.by_pod[PODS[0]].state(), BreakerState::Open);
    assert_eq!(
        w.stats.transitions,
        vec![(PODS[0].to_string(), BreakerState::Open)]
    );
    assert!(
        h.warnings[0].contains("agent_error_rate"),
        "{:?}",
        h.warnings
    );
    // Nothing new reported: nothing carried again.
    carry_signal_trips(&mut h, &mut w, 1_200);
    assert_eq!(w.stats.transitions.len(), 1);
}

#[test]
fn a_body_over_the_read_limit_is_routed_on_its_first_bytes() {
    let mut w = worker();
    let mut h = host(1_010);
    h.req.insert("content-length".into(), "5000000".into());
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut NoGate, false),
        Next::StopForBody
    );
    assert_eq!(ex.body_read_limit(), 512 * 1024);
    // Declared larger than the limit: held with flow control up to the limit, not at all
    // without (any bytes held plus one 1 MiB read could pass Envoy's buffer limit).
    assert!(ex.wants_more_body(100_000, true));
    assert!(!ex.wants_more_body(600_000, true));
    assert!(!ex.wants_more_body(100_000, false));
    // The first bytes of a 5 MB multimodal body: the model comes before the images.
    let prefix = br#"{"model":"m","max_tokens":32,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAAAAAA"#;
    assert_eq!(
        ex.on_request_body(&mut h, &mut w, &mut NoGate, prefix, false),
        Next::Continue
    );
    assert_eq!(ex.model(), Some("m"));
    assert_eq!(h.steered.len(), 1);
    assert_eq!(w.router.counters().body_truncated, 1);
    // The declared length sizes it: far more than the prefix read.
    let small = {
        let mut w2 = worker();
        let mut h2 = host(1_010);
        let mut e2 = Exchange::new();
        e2.on_request_headers(&mut h2, &mut w2, &mut NoGate, false);
        e2.on_request_body(&mut h2, &mut w2, &mut NoGate, prefix, true);
        e2.size()
    };
    assert!(ex.size() != small, "{:?} vs {:?}", ex.size(), small);
}

#[test]
fn a_model_beyond_the_read_limit_is_not_seen_and_the_request_is_still_routed() {
    let mut w = worker();
    let mut h = host(1_010);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, &mut w, &mut NoGate, false);
    // No declared length: held up to the limit either way.
    assert!(ex.wants_more_body(100_000, false));
    assert!(!ex.wants_more_body(512 * 1024, false));
    let prefix = br#"{"messages":[{"role":"user","content":"xxxxxxxxxxxxxxxxxxxxxx"#;
    assert_eq!(
        ex.on_request_body(&mut h, &mut w, &mut NoGate, prefix, false),
        Next::Continue
    );
    assert_eq!(ex.model(), None);
    // Every pod serves every request when no model is named: still steered by score.
    assert_eq!(h.steered.len(), 1);
}

/// Runs a request whose answer came from the `served`-th pod of its ranked list (after Envoy's
/// retries down the list), with `code`, the whole answer seen or not.
fn served_by(
    w: &mut MockWorker,
    h: &mut MockHost,
    served: usize,
    code: u16,
    complete: bool,
) -> Exchange {
    let mut ex = Exchange::new();
    ex.on_request_headers(h, w, &mut NoGate, true);
    let ranked: Vec<String> = ex.ranked().split(',').map(str::to_string).collect();
    h.upstream = Some(ranked[served].clone());
    h.code = Some(code);
    h.resp.insert(":status".into(), code.to_string());
    ex.on_response_headers(h, w, &mut NoGate, false);
    h.now += 5;
    ex.on_response_body(h, w, &mut NoGate, 10, complete);
    ex.on_end(h, w, &mut NoGate);
    ex
}

#[test]
fn a_clean_end_reads_nothing_more_at_the_log_phase() {
    let mut w = worker();
    let mut h = host(1_010);
    served_by(&mut w, &mut h, 0, 200, true);
    assert_eq!(h.end_reads.get(), 0, "code, flags and details are not read");
    assert_eq!(
        h.upstream_reads.get(),
        1,
        "the upstream is read once, with the headers"
    );
    assert!(w.stats.failed.is_empty());
    assert_eq!(inflight(&w, 2_000), 0);
}

#[test]
fn an_end_that_is_not_clean_reads_the_final_status() {
    // A 503, and a 200 whose answer broke off (no end of stream): both read what Envoy saw.
    for (code, complete) in [(503, true), (200, false)] {
        let mut w = worker();
        let mut h = host(1_010);
        served_by(&mut w, &mut h, 0, code, complete);
        assert!(h.end_reads.get() >= 2, "{code} complete={complete}");
        assert_eq!(inflight(&w, 2_000), 0);
    }
}

#[test]
fn a_retry_down_the_ranked_list_fails_the_pods_before_the_one_that_answered() {
    let mut w = worker();
    let mut h = host(1_010);
    let ex = served_by(&mut w, &mut h, 2, 200, true);
    let ranked: Vec<&str> = ex.ranked().split(',').collect();
    assert_eq!(
        w.stats.failed,
        vec![ranked[0].to_string(), ranked[1].to_string()],
        "the first two pods were tried and failed, with no attempt-count header"
    );
    assert_eq!(h.end_reads.get(), 0);
    assert_eq!(inflight(&w, 2_000), 0);
}

#[test]
fn where_retries_leave_the_list_the_attempt_count_header_says_how_many() {
    let mut w = worker();
    let mut h = host(1_010);
    h.retries_elsewhere = true;
    // Envoy's balancer served the retry from the third pod after two attempts: only the first
    // (the override host) is known tried; the list's second was not.
    h.resp.insert("x-envoy-attempt-count".into(), "2".into());
    let ex = served_by(&mut w, &mut h, 2, 200, true);
    let ranked: Vec<&str> = ex.ranked().split(',').collect();
    assert_eq!(w.stats.failed, vec![ranked[0].to_string()]);
}

#[test]
fn the_guard_rejects_a_hot_pod_marked_for_retry_and_admits_on_stale_or_missing_signals() {
    use ai_lb_filter_core::admission::config::GuardConfig;
    use ai_lb_filter_core::admission::guard::LocalSignals;
    use ai_lb_filter_core::lifecycle::guard::{guard_request, GuardCount};

    let cfg = GuardConfig {
        retry_after_seconds: 2,
        ..GuardConfig::default()
    };
    let hot = LocalSignals {
        gpu_util: Some(0.97),
        waiting: Some(4),
        capacity: Some(64),
        sampled_at_ms: Some(1_000),
    };
    let mut counted = Vec::new();
    let mut h = host(1_500);
    let next = guard_request(&mut h, &cfg, Some(hot), 1_500, &mut |c| counted.push(c));
    assert_eq!(next, Next::Stop);
    assert_eq!(h.replies.len(), 1);
    assert_eq!(h.replies[0].0, 503);
    assert!(h.replies[0].2.contains("overloaded"), "{}", h.replies[0].2);
    assert_eq!(h.reply_header(0, "x-ai-lb-guard"), Some("rejected"));
    assert_eq!(
        h.reply_header(0, "x-ai-lb-guard-reason"),
        Some("gpu_saturated")
    );
    assert_eq!(h.reply_header(0, "retry-after"), Some("2"));
    assert_eq!(
        counted,
        vec![GuardCount::Rejected(
            ai_lb_filter_core::admission::guard::GuardReason::GpuSaturated
        )]
    );

    // The same signals, older than maxStalenessMs: admitted and counted as fail-open.
    counted.clear();
    let mut h = host(1_000 + cfg.max_staleness_ms + 1);
    let now = h.now;
    assert_eq!(
        guard_request(&mut h, &cfg, Some(hot), now, &mut |c| counted.push(c)),
        Next::Continue
    );
    assert!(h.replies.is_empty());
    assert_eq!(
        counted,
        vec![GuardCount::Admitted, GuardCount::FailOpenStale]
    );

    // Nothing received yet: admitted, counted as missing.
    counted.clear();
    let mut h = host(10);
    assert_eq!(
        guard_request(&mut h, &cfg, None, 10, &mut |c| counted.push(c)),
        Next::Continue
    );
    assert_eq!(
        counted,
        vec![GuardCount::Admitted, GuardCount::FailOpenMissing]
    );

    // A cool pod: admitted, nothing else counted.
    counted.clear();
    let cool = LocalSignals {
        gpu_util: Some(0.3),
        ..hot
    };
    let mut h = host(1_500);
    assert_eq!(
        guard_request(&mut h, &cfg, Some(cool), 1_500, &mut |c| counted.push(c)),
        Next::Continue
    );
    assert_eq!(counted, vec![GuardCount::Admitted]);
}
