//! Decides whether the admission gate both data paths run (`lifecycle::admission`) does what
//! the filter promises, driven through the request lifecycle by a mock host and a mock worker
//! with no Envoy: a tenant's bucket answers 429 with `x-ratelimit-*` once its burst is spent
//! while another tenant is still admitted; the cost reaches `hits_addend`; the response's usage
//! settles the reservation; malformed JSON is a 400; under saturation a sheddable request is
//! shed (429), a standard one held then released by capacity or answered 503 at its deadline
//! (refunded); every stat it counts is one the glues define.

mod support;

use std::collections::HashMap;

use ai_lb_filter_core::admission::bucket::{self, MemoryStore};
use ai_lb_filter_core::admission::priority::PriorityClass;
use ai_lb_filter_core::breaker::{Breaker, Transition};
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::lifecycle::admission::{
    self, AdmissionGate, AdmissionParts, AdmissionRt, AdmissionStats, AdmissionWorker, Woken,
};
use ai_lb_filter_core::lifecycle::{BreakerStore, Exchange, Next, Parts, Steered, Worker};
use ai_lb_filter_core::picker::Router;
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use support::{MockHost, NoStats};

const PODS: [&str; 2] = ["10.0.0.1:8000", "10.0.0.2:8000"];

#[derive(Default)]
struct NoBreakers;

impl BreakerStore for NoBreakers {
    fn sync(&mut self, _router: &mut Router, _pool: usize, _now: u64) {}
    fn update(
        &mut self,
        _router: &mut Router,
        _pool: usize,
        _pod: &str,
        _now: u64,
        _update: &mut dyn FnMut(&mut Breaker) -> Option<Transition>,
    ) -> Option<Vec<Transition>> {
        None
    }
}

/// Admission stats by full name, as the wasm filter names them; an unknown name fails.
#[derive(Default)]
struct Recorded(HashMap<String, u64>);

impl AdmissionStats for Recorded {
    fn count(&mut self, what: &str, by: u64) {
        assert!(
            admission::COUNTERS.contains(&what),
            "undeclared counter {what}"
        );
        *self.0.entry(format!("ailb.admission.{what}")).or_default() += by;
    }
    fn count_tenant(&mut self, tenant: &str, class: PriorityClass, what: &str, by: u64) {
        assert!(
            admission::TENANT_COUNTERS.contains(&what),
            "undeclared {what}"
        );
        let name = format!("ailb.admission.tenant.{tenant}.{}.{what}", class.as_str());
        *self.0.entry(name).or_default() += by;
    }
    fn record(&mut self, what: &str, _value: u64) {
        assert!(
            admission::HISTOGRAMS.contains(&what),
            "undeclared histogram {what}"
        );
    }
    fn set(&mut self, what: &str, value: u64) {
        assert!(admission::GAUGES.contains(&what), "undeclared gauge {what}");
        self.0.insert(format!("ailb.admission.{what}"), value);
    }
}

impl Recorded {
    fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }
}

struct MockWorker {
    router: Router,
    rng: SmallRng,
    scratch: String,
    ids: Vec<u32>,
    keys: Vec<u64>,
    breakers: NoBreakers,
    stats: NoStats,
    rt: AdmissionRt,
    adm_stats: Recorded,
    store: MemoryStore,
}

impl Worker for MockWorker {
    fn refresh(&mut self, _pool: usize, _now: u64) {}
    fn parts(&mut self) -> Parts<'_> {
        Parts {
            router: &mut self.router,
            rng: &mut self.rng,
            scratch: &mut self.scratch,
            prompt_ids: &mut self.ids,
            key_scratch: &mut self.keys,
            breakers: &mut self.breakers,
            stats: &mut self.stats,
        }
    }
    fn router(&self) -> &Router {
        &self.router
    }
    fn ordinal(&self) -> u64 {
        0
    }
}

impl AdmissionWorker for MockWorker {
    fn admission(&mut self) -> Option<AdmissionParts<'_>> {
        Some(AdmissionParts {
            rt: &mut self.rt,
            router: &mut self.router,
            stats: &mut self.adm_stats,
            store: &self.store,
        })
    }
}

/// Both pods, reported at `now`: busy (`hot`: the GPU past its hard limit, so cut) or idle.
fn publish(router: &mut Router, now: u64, hot: bool) {
    publish_with(router, now, hot, None);
}

/// [`publish`], with a TTFT p99 and an inter-token latency (ms) when `latency` is given.
fn publish_with(router: &mut Router, now: u64, hot: bool, latency: Option<(f64, f64)>) {
    let q = |v: f64| ai_lb_proto::LatencyQuantiles {
        p50_ms: Some(v),
        p99_ms: Some(v),
        samples: 100,
        mean_ms: Some(v),
    };
    let peers = PODS
        .iter()
        .enumerate()
        .map(|(i, a)| PeerState {
            peer: format!("agent-{i}:9090"),
            status: PeerStatus::Live as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: a.to_string(),
                    ..Default::default()
                }),
                gpus: vec![GpuStats {
                    utilization: Some(if hot { 0.99 } else { 0.1 }),
                    sm_occupancy: Some(if hot { 0.99 } else { 0.1 }),
                    ..Default::default()
                }],
                inference: Some(InferenceStats {
                    waiting: Some(0),
                    running: Some(1),
                    queue_capacity: Some(8),
                    ttft: latency.map(|(t, _)| q(t)),
                    inter_token_recent: latency.map(|(_, i)| q(i)),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            reason: String::new(),
        })
        .collect();
    let ev = PoolEvent {
        full: true,
        peers,
        ..Default::default()
    };
    router.apply_pool_event(0, &ev, now);
}

fn worker(admission: &str) -> MockWorker {
    worker_with(admission, "")
}

/// A worker with `extra` top-level plugin fields (each followed by a comma).
fn worker_with(admission: &str, extra: &str) -> MockWorker {
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{{extra}"pools":[{{"name":"default","cluster":"inference"}}],"admission":{admission}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let adm = cfg.admission.clone().unwrap();
    let mut router = Router::new(cfg);
    publish(&mut router, 1_000, false);
    MockWorker {
        router,
        rng: SmallRng::seed_from_u64(1),
        scratch: String::new(),
        ids: Vec::new(),
        keys: Vec::new(),
        breakers: NoBreakers,
        stats: NoStats,
        rt: AdmissionRt::new(adm),
        adm_stats: Recorded::default(),
        store: MemoryStore::new(),
    }
}

fn post(now: u64, tenant: &str, headers: &[(&str, &str)]) -> MockHost {
    let mut h = MockHost {
        code: Some(200),
        hits: Some(Vec::new()),
        chunk: Some(Vec::new()),
        ..MockHost::at(now)
    };
    for (k, v) in [
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
        ("x-tenant", tenant),
    ]
    .iter()
    .chain(headers)
    {
        h.req.insert(k.to_string(), v.to_string());
    }
    h
}

/// Sends one JSON request through the lifecycle up to routing.
fn send(w: &mut MockWorker, g: &mut AdmissionGate, h: &mut MockHost, body: &str) -> Next {
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(h, w, g, false),
        Next::StopForBody,
        "the gate asks for the body"
    );
    ex.on_request_body(h, w, g, body.as_bytes(), true)
}

const LIMITED: &str = r#"{"tenantKey":["header:x-tenant"],
    "tenants":{"default":{"tokensPerSecond":1,"burst":120}},"cost":{"defaultOutputTokens":16}}"#;
const BODY: &str = r#"{"prompt":"hello there","max_tokens":80}"#;

#[test]
fn a_tenants_bucket_answers_429_once_spent_and_other_tenants_still_pass() {
    let mut w = worker(LIMITED);
    let mut first = post(2_000, "a", &[]);
    let mut g = AdmissionGate::new(1);
    assert_eq!(send(&mut w, &mut g, &mut first, BODY), Next::Continue);
    let reserved = w
        .adm_stats
        .get("ailb.admission.tenant.a.standard.tokens_reserved");
    assert!(reserved > 50 && reserved <= 120, "reserved {reserved}");
    assert_eq!(
        first.hits,
        Some(vec![reserved]),
        "the cost reaches hits_addend"
    );
    let mut second = post(2_001, "a", &[]);
    assert_eq!(
        send(&mut w, &mut AdmissionGate::new(2), &mut second, BODY),
        Next::Stop
    );
    let (status, headers, body) = &second.replies[0];
    assert_eq!(*status, 429, "{body}");
    for h in ["retry-after", "x-ratelimit-limit", "x-ratelimit-remaining"] {
        assert!(headers.iter().any(|(k, _)| k == h), "no {h}: {headers:?}");
    }
    assert!(body.contains("rate_limit"), "{body}");
    // Another tenant has its own bucket.
    let mut other = post(2_002, "b", &[]);
    assert_eq!(
        send(&mut w, &mut AdmissionGate::new(3), &mut other, BODY),
        Next::Continue
    );
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.tenant.a.standard.admitted"), 1);
    assert_eq!(s.get("ailb.admission.tenant.a.standard.rate_limited"), 1);
    assert_eq!(s.get("ailb.admission.tenant.b.standard.admitted"), 1);
    assert_eq!(s.get("ailb.admission.rate_limited"), 1);
}

#[test]
fn the_responses_usage_settles_the_reservation_and_refunds_the_rest() {
    let mut w = worker(LIMITED);
    let mut h = post(2_000, "a", &[]);
    let mut g = AdmissionGate::new(1);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, &mut w, &mut g, false);
    ex.on_request_body(&mut h, &mut w, &mut g, BODY.as_bytes(), true);
    ex.on_response_headers(&mut h, &mut w, &mut g, false);
    assert!(h.resp.contains_key("x-ratelimit-remaining"), "{:?}", h.resp);
    let chunk = br#"{"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}"#;
    h.chunk = Some(chunk.to_vec());
    let n = chunk.len();
    ex.on_response_body(&mut h, &mut w, &mut g, n, true);
    ex.on_end(&mut h, &mut w, &mut g);
    let s = &w.adm_stats;
    let reserved = s.get("ailb.admission.tokens_reserved");
    assert_eq!(s.get("ailb.admission.tokens_actual"), 10);
    assert_eq!(s.get("ailb.admission.tokens_refunded"), reserved - 10);
    assert_eq!(s.get("ailb.admission.settled"), 1);
    // The stream-done hits_addend: nothing beyond the reservation.
    assert_eq!(h.hits, Some(vec![reserved, 0]));
    // The bucket holds burst - 10 again (1 token/s refilled over 0 ms).
    let p = w.rt.cfg.tenants.params_for("a");
    let level = bucket::peek(&w.store, "a", &p, 2_000).remaining();
    assert_eq!(level, 110);
}

#[test]
fn malformed_json_is_a_400_before_any_bucket_is_touched() {
    let mut w = worker(LIMITED);
    let mut h = post(2_000, "a", &[]);
    assert_eq!(
        send(&mut w, &mut AdmissionGate::new(1), &mut h, "{\"prompt\": "),
        Next::Stop
    );
    assert_eq!(h.replies[0].0, 400);
    assert_eq!(w.adm_stats.get("ailb.admission.malformed_bodies"), 1);
    assert!(w.store.get_raw_is_empty());
}

trait Empty {
    fn get_raw_is_empty(&self) -> bool;
}

impl Empty for MemoryStore {
    fn get_raw_is_empty(&self) -> bool {
        use ai_lb_filter_core::admission::SharedStore;
        self.get(&bucket::bucket_key("a")).is_none()
    }
}

const PRIORITY: &str = r#"{"tenantKey":["header:x-tenant"],
    "priority":{"header":"x-prio"},"trustedHeaders":["x-prio"],
    "saturation":{"softThreshold":0.5,"maxWaitStandardMs":500,"maxHeld":4}}"#;

#[test]
fn under_saturation_sheddable_is_shed_and_standard_held_then_released_or_expired() {
    let mut w = worker(PRIORITY);
    publish(&mut w.router, 1_000, true);
    let mut shed = post(1_010, "a", &[("x-prio", "sheddable")]);
    let mut g = AdmissionGate::new(1);
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut shed, &mut w, &mut g, true),
        Next::Stop
    );
    assert_eq!(shed.replies[0].0, 429);
    assert!(shed.replies[0].2.contains("shed_under_saturation"));

    // Two standard requests are held.
    let mut held = Vec::new();
    for id in [2, 3] {
        let mut h = post(1_010, "a", &[]);
        let mut g = AdmissionGate::new(id);
        let mut ex = Exchange::new();
        assert_eq!(
            ex.on_request_headers(&mut h, &mut w, &mut g, true),
            Next::Stop
        );
        assert!(h.replies.is_empty() && g.is_held(&mut w));
        held.push((ex, g, h));
    }
    assert_eq!(w.adm_stats.get("ailb.admission.held_depth"), 2);
    // Still saturated: the tick releases nothing.
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_100);
    assert!(t.expired.is_empty() && t.released.is_empty());
    // Capacity frees: one tick releases both (two pods below the threshold); the glue routes
    // each on its own stream and resumes it.
    publish(&mut w.router, 1_150, false);
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_200);
    assert_eq!(t.released.len(), 2);
    let (id, h) = &t.released[0];
    assert_eq!(*id, 2);
    assert_eq!((h.pool, h.stat_tenant.as_str()), (0, "a"));
    // (Routing a release is the lifecycle's `steer`, tested in lifecycle.rs.)
    let r = Steered {
        ranked: PODS[1].into(),
        score: 1.0,
        sent_ms: 1_200,
        probe: false,
        version: None,
        features: None,
    };
    w.rt.resumed.insert(*id, r);
    let (ex, g, h) = &mut held[0];
    ex.on_response_headers(h, &mut w, g, false);
    assert!(ex.chosen().is_some(), "the release's pick is the request's");

    // A third held request waits past its deadline: 503, refunded at its end.
    publish(&mut w.router, 1_300, true);
    let mut h = post(1_300, "a", &[]);
    let mut g = AdmissionGate::new(4);
    let mut ex = Exchange::new();
    assert_eq!(
        ex.on_request_headers(&mut h, &mut w, &mut g, true),
        Next::Stop
    );
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_900);
    assert_eq!(t.expired, vec![4]);
    admission::overloaded_reply(&mut h, t.retry_after_s);
    assert_eq!(h.replies[0].0, 503);
    ex.on_end(&mut h, &mut w, &mut g);
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.shed"), 1);
    assert_eq!(s.get("ailb.admission.held"), 3);
    assert_eq!(s.get("ailb.admission.held_released"), 2);
    assert_eq!(s.get("ailb.admission.held_expired"), 1);
    assert_eq!(s.get("ailb.admission.tenant.a.standard.held_rejected"), 1);
    assert_eq!(s.get("ailb.admission.tenant.a.sheddable.shed"), 1);
}

#[test]
fn the_peer_principal_is_the_tenant_when_configured() {
    let mut w = worker(r#"{"tenantKey":["peerPrincipal"]}"#);
    let mut h = post(2_000, "ignored", &[]);
    h.peer = Some("spiffe://cluster.local/ns/a/sa/b".into());
    assert_eq!(
        send(&mut w, &mut AdmissionGate::new(1), &mut h, BODY),
        Next::Continue
    );
    let name = "ailb.admission.tenant.spiffe://cluster.local/ns/a/sa/b.standard.admitted";
    assert_eq!(w.adm_stats.get(name), 1, "{:?}", w.adm_stats.0);
}

/// The native module's way: each held request wakes on its own stream and asks the core what
/// became of it; the worker's queue is ticked at most once per tick period.
#[test]
fn a_request_woken_on_its_own_stream_waits_is_released_or_answered_at_its_deadline() {
    let mut w = worker(PRIORITY);
    publish(&mut w.router, 1_000, true);
    let hold = |w: &mut MockWorker, id: u32, now: u64| {
        let mut h = post(now, "a", &[]);
        let mut g = AdmissionGate::new(id);
        let mut ex = Exchange::new();
        assert_eq!(ex.on_request_headers(&mut h, w, &mut g, true), Next::Stop);
        assert!(g.held());
        (ex, g, h)
    };
    let (_ex, _g, mut h) = hold(&mut w, 1, 1_010);
    assert_eq!(
        admission::wake_held(&mut h, &mut w, 1, 1_020, 50),
        Woken::Waiting
    );
    // A pod cools: within the same tick period nothing is judged again.
    publish(&mut w.router, 1_030, false);
    assert_eq!(
        admission::wake_held(&mut h, &mut w, 1, 1_040, 50),
        Woken::Waiting
    );
    assert_eq!(
        admission::wake_held(&mut h, &mut w, 1, 1_070, 50),
        Woken::Released
    );
    assert!(w.rt.released.is_empty() && h.replies.is_empty());
    assert_eq!(w.adm_stats.get("ailb.admission.held_released"), 1);
    // Saturated again: the next one waits out its 500 ms and is answered 503 on its stream.
    publish(&mut w.router, 1_100, true);
    let (mut ex, mut g, mut h) = hold(&mut w, 2, 1_100);
    assert_eq!(
        admission::wake_held(&mut h, &mut w, 2, 1_400, 50),
        Woken::Waiting
    );
    assert_eq!(
        admission::wake_held(&mut h, &mut w, 2, 1_650, 50),
        Woken::Answered
    );
    assert_eq!(h.replies[0].0, 503);
    ex.on_end(&mut h, &mut w, &mut g);
    assert!(!g.held() && w.rt.expired.is_empty());
    assert_eq!(w.adm_stats.get("ailb.admission.held_expired"), 1);
}

const DERIVED: &str = r#"{"tenantKey":["header:x-tenant"],
    "priority":{"header":"x-prio"},"trustedHeaders":["x-prio"],
    "saturation":{"softThreshold":0.5,"maxWaitStandardMs":500,"maxHeld":8},
    "tenants":{"default":{"tokensPerSecond":1000,"burst":1000000}},
    "derivedPriority":{}}"#;

/// A body with a prompt of about `words` tokens, `max_tokens` and maybe a temperature.
fn body(words: usize, max_tokens: u64, temperature: Option<f64>) -> String {
    let prompt = "hello world ".repeat(words / 2);
    let t = temperature.map_or(String::new(), |t| format!(",\"temperature\":{t}"));
    format!(r#"{{"prompt":"{prompt}","max_tokens":{max_tokens}{t}}}"#)
}

/// Derived priority (issue 30 part 5): a long, long-output, cold request is Ultra (counted
/// `critical`), the same at the default temperature High; under saturation both are held in
/// lanes released before an earlier standard request, and a bounded hold is routed at its
/// deadline (never 503) while the standard one is answered 503 at its own. A request whose
/// header names a class keeps it.
#[test]
fn derived_tiers_are_released_before_standard_and_routed_at_their_deadline() {
    let mut w = worker(DERIVED);
    publish(&mut w.router, 1_000, true);
    let ultra = body(40_000, 4_096, Some(0.0));
    let high = body(40_000, 4_096, None);
    let short = body(20, 64, Some(0.9));
    let mut held = Vec::new();
    for (id, b) in [(1, &short), (2, &high), (3, &ultra)] {
        let mut h = post(1_010, "a", &[]);
        let mut g = AdmissionGate::new(id);
        assert_eq!(send(&mut w, &mut g, &mut h, b), Next::Stop);
        assert!(h.replies.is_empty() && g.is_held(&mut w), "{id} held");
        held.push((g, h));
    }
    // Named by its header: stays standard, whatever its body.
    let mut named = post(1_010, "a", &[("x-prio", "standard")]);
    let mut g = AdmissionGate::new(4);
    assert_eq!(send(&mut w, &mut g, &mut named, &ultra), Next::Stop);
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.derived.ultra"), 1);
    assert_eq!(s.get("ailb.admission.derived.high"), 1);
    assert_eq!(s.get("ailb.admission.derived.standard"), 1);
    assert_eq!(s.get("ailb.admission.tenant.a.critical.admitted"), 1);
    assert_eq!(s.get("ailb.admission.tenant.a.standard.admitted"), 3);
    assert_eq!(s.get("ailb.admission.held"), 4);
    // Capacity for two: Ultra, then High, before the standard request held first.
    publish(&mut w.router, 1_050, false);
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_100);
    let ids: Vec<u32> = t.released.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![3, 2]);
    // Saturated again; a new Ultra request is held at most 150 ms, then routed anyway; the
    // standard ones are answered 503 at 500 ms.
    publish(&mut w.router, 1_150, true);
    let mut h = post(1_200, "a", &[]);
    let mut g = AdmissionGate::new(5);
    assert_eq!(send(&mut w, &mut g, &mut h, &ultra), Next::Stop);
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_349);
    assert!(t.released.is_empty() && t.expired.is_empty());
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_350);
    assert_eq!(
        t.released.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![5]
    );
    assert!(t.expired.is_empty());
    let t = admission::held_tick(&mut w.rt, &w.router, &mut w.adm_stats, 1_510);
    assert_eq!(t.expired, vec![1, 4]);
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.derived.deadline_proceed"), 1);
    assert_eq!(s.get("ailb.admission.held_released"), 2);
    assert_eq!(s.get("ailb.admission.held_expired"), 2);
}

/// Off, the same bodies are all the default class and nothing is derived; a body costed by its
/// length (not parsed) is counted `derived.unparsed` and keeps the default class.
#[test]
fn derived_priority_is_off_unless_configured_and_unparsed_bodies_stay_default() {
    let mut w = worker(PRIORITY);
    let mut h = post(2_000, "a", &[]);
    let mut g = AdmissionGate::new(1);
    assert_eq!(
        send(&mut w, &mut g, &mut h, &body(40_000, 4_096, Some(0.0))),
        Next::Continue
    );
    assert_eq!(
        w.adm_stats.get("ailb.admission.tenant.a.standard.admitted"),
        1
    );
    assert_eq!(w.adm_stats.get("ailb.admission.derived.ultra"), 0);

    let mut w = worker(DERIVED);
    let mut h = post(
        2_000,
        "a",
        &[("content-type", "text/plain"), ("content-length", "100")],
    );
    let mut g = AdmissionGate::new(1);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, &mut w, &mut g, false);
    assert_eq!(w.adm_stats.get("ailb.admission.derived.unparsed"), 1);
    assert_eq!(
        w.adm_stats.get("ailb.admission.tenant.a.standard.admitted"),
        1
    );
}

/// Both pods idle, with a TTFT p99 and an inter-token latency.
fn publish_latency(router: &mut Router, now: u64, ttft_ms: f64, itl_ms: f64) {
    publish_with(router, now, false, Some((ttft_ms, itl_ms)));
}

/// One request through the whole lifecycle with usage `prompt`/`completion` in its answer.
fn settle_one(w: &mut MockWorker, id: u32, now: u64, b: &str, prompt: u64, completion: u64) {
    let mut h = post(now, "a", &[]);
    let mut g = AdmissionGate::new(id);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, w, &mut g, false);
    assert_eq!(
        ex.on_request_body(&mut h, w, &mut g, b.as_bytes(), true),
        Next::Continue
    );
    ex.on_response_headers(&mut h, w, &mut g, false);
    let chunk = format!(
        r#"{{"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{}}}}}"#,
        prompt + completion
    )
    .into_bytes();
    let n = chunk.len();
    h.chunk = Some(chunk);
    ex.on_response_body(&mut h, w, &mut g, n, true);
    ex.on_end(&mut h, w, &mut g);
}

/// Latency-aware quota: the settled cost is scaled by (τ / predicted)^0.8 with the prediction
/// from the chosen pod's TTFT and decode speed (2× the SLO: 0.574×), clamped to 64..=2048; a
/// pod with no latency readings leaves the plain cost (counted).
#[test]
fn the_latency_aware_quota_scales_the_settled_cost_by_the_chosen_pods_prediction() {
    let cfg = r#"{"tenantKey":["header:x-tenant"],
        "tenants":{"default":{"tokensPerSecond":1,"burst":100000}},
        "latencyAwareQuota":{"sloMs":2000}}"#;
    // Two pods are enough to steer (the default minPods is 3).
    let mut w = worker_with(cfg, r#""minPods":1,"#);
    // Predicted 400 + 90 × 40 = 4000 ms: twice τ.
    publish_latency(&mut w.router, 1_900, 400.0, 40.0);
    settle_one(
        &mut w,
        1,
        2_000,
        r#"{"prompt":"hi","max_tokens":90}"#,
        3,
        500,
    );
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.tokens_actual"), 503);
    assert_eq!(s.get("ailb.admission.quota.scaled_down"), 1);
    assert_eq!(s.get("ailb.admission.quota.tokens_base"), 503);
    let q = (503.0 * 0.5f64.powf(0.8)).round() as u64;
    assert_eq!(s.get("ailb.admission.quota.tokens_quota"), q);
    let p = w.rt.cfg.tenants.params_for("a");
    let level = bucket::peek(&w.store, "a", &p, 2_000).remaining();
    assert_eq!(level, 100_000 - q, "the bucket is charged the quota");
    // A small answer is charged the minimum, a huge one the maximum.
    settle_one(
        &mut w,
        2,
        2_000,
        r#"{"prompt":"hi","max_tokens":90}"#,
        3,
        10,
    );
    settle_one(
        &mut w,
        3,
        2_000,
        r#"{"prompt":"hi","max_tokens":90}"#,
        3,
        9_000,
    );
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.quota.clamped_min"), 1);
    assert_eq!(s.get("ailb.admission.quota.clamped_max"), 1);
    assert_eq!(s.get("ailb.admission.quota.tokens_quota"), q + 64 + 2_048);
    // No latency readings (the harness's plain publish): the plain cost.
    publish(&mut w.router, 2_100, false);
    let quota_before = w.adm_stats.get("ailb.admission.quota.tokens_quota");
    let level_before = bucket::peek(&w.store, "a", &p, 2_200).remaining();
    settle_one(
        &mut w,
        4,
        2_200,
        r#"{"prompt":"hi","max_tokens":90}"#,
        3,
        500,
    );
    let s = &w.adm_stats;
    assert_eq!(s.get("ailb.admission.quota.no_prediction"), 1);
    assert_eq!(s.get("ailb.admission.quota.tokens_quota"), quota_before);
    let level = bucket::peek(&w.store, "a", &p, 2_200).remaining();
    assert_eq!(level_before - level, 503, "the plain cost");
    // Not picked by the filter (two pods under the default minPods of 3: Envoy's fallback):
    // no prediction either, counted.
    let mut fb = worker(cfg);
    publish_latency(&mut fb.router, 1_900, 400.0, 40.0);
    settle_one(
        &mut fb,
        1,
        2_000,
        r#"{"prompt":"hi","max_tokens":90}"#,
        3,
        500,
    );
    assert_eq!(fb.router.counters().fallback_too_few_pods, 1);
    assert_eq!(fb.adm_stats.get("ailb.admission.quota.no_prediction"), 1);
    assert_eq!(fb.adm_stats.get("ailb.admission.quota.tokens_quota"), 0);
}
