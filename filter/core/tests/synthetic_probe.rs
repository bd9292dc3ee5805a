//! `breaker.syntheticProbe` ([`probe`]): a half-open pod takes no client request and is probed
//! with the filter's own request instead; one probe in flight per pod, the next `intervalMs`
//! later; `halfOpenProbes` well-formed passes in a row close it, anything else (5xx, 4xx,
//! malformed JSON, a timeout, a slow answer) re-opens it; off, nothing changes. Driven through
//! the core's worker interfaces with a mock worker and the shared breakers in a map (no Envoy),
//! as `breaker_triggers.rs` does.

mod support;

use ai_lb_filter_core::breaker::{Breaker, BreakerState, TripReason};
use ai_lb_filter_core::config::{BreakerConfig, FilterConfig};
use ai_lb_filter_core::lifecycle::{Exchange, NoGate};
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::probe::{self, ProbeAnswer, ProbeCall, PROBE_HEADER};
use support::{pods_event, MockHost, NoStats, SyncWorker};

const PODS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
const SICK: &str = "10.0.0.1:8000";
const BODY: &str = r#"{"model":"m","prompt":"ping","max_tokens":1}"#;
const OK: &str = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"!","finish_reason":"length"}]}"#;

type W = SyncWorker<NoStats>;

fn config(breaker_extra: &str) -> Result<FilterConfig, ai_lb_filter_core::ConfigError> {
    FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"default","cluster":"inference"}}],"minPods":1,
            "breaker":{{"baseCooldownMs":1000,"halfOpenProbes":3{breaker_extra}}}}}"#
        )
        .as_bytes(),
    )
}

fn probe_cfg(members: &str) -> String {
    format!(
        r#","syntheticProbe":{{"body":{}{members}}}"#,
        serde_json::json!(BODY)
    )
}

/// A worker whose pool's three pods are idle and whose `SICK` pod's shared breaker was opened
/// at 1 000 ms (cooldown 1 s, no jitter: half-open from 2 000 ms).
fn worker(breaker_extra: &str) -> W {
    let cfg = config(breaker_extra).unwrap();
    let bcfg = cfg.breaker;
    let mut router = Router::new(cfg);
    router.apply_pool_event(0, &pods_event(&PODS, |_| 0), 1_000);
    let mut w = SyncWorker::new(router, NoStats, 3, 0);
    let mut b = Breaker::default();
    b.trip(TripReason::ServerErrors, 1_000, &bcfg);
    w.store.by_pod.insert(SICK.into(), b);
    w
}

fn state(w: &W) -> BreakerState {
    w.store
        .by_pod
        .get(SICK)
        .map_or(BreakerState::Closed, |b| b.state())
}

/// Where a client request at `now` is steered.
fn client_pick(w: &mut W, now: u64) -> String {
    w.router.apply_pool_event(0, &pods_event(&PODS, |_| 0), now);
    let mut h = MockHost::at(now);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, w, &mut NoGate, true);
    let pod = ex.chosen().expect("steered").to_string();
    h.upstream = Some(pod.clone());
    h.code = Some(200);
    h.resp.insert(":status".into(), "200".into());
    ex.on_response_headers(&mut h, w, &mut NoGate, false);
    h.chunk = Some(OK.as_bytes().to_vec());
    ex.on_response_body(&mut h, w, &mut NoGate, OK.len(), true);
    ex.on_end(&mut h, w, &mut NoGate);
    pod
}

fn due(w: &mut W, now: u64) -> Vec<ProbeCall> {
    probe::due(w, now, &mut |_| {})
}

fn answer(w: &mut W, call: &ProbeCall, a: &ProbeAnswer, now: u64) -> bool {
    probe::answered(w, call, a, now, &mut |_| {})
}

fn ok() -> ProbeAnswer {
    ProbeAnswer::Response {
        status: 200,
        body: OK.as_bytes().to_vec(),
    }
}

fn header<'a>(call: &'a ProbeCall, name: &str) -> Option<&'a str> {
    call.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn the_config_is_validated_with_the_field_named() {
    let c = config(&probe_cfg("")).unwrap();
    let p = c.synthetic_probe.clone().expect("on");
    assert_eq!(
        (
            p.path.as_str(),
            p.authority.as_str(),
            p.interval_ms,
            p.timeout_ms,
            p.body.as_str()
        ),
        ("/v1/completions", "ai-lb-probe", 250, 1000, BODY),
        "timeoutMs defaults to 2000 ms, capped at baseCooldownMs"
    );
    assert!(c.breaker.synthetic_probes);
    let off = config("").unwrap();
    assert_eq!(
        (off.synthetic_probe, off.breaker.synthetic_probes),
        (None, false)
    );

    for (members, field) in [
        (r#","path":"v1/completions""#, "breaker.syntheticProbe.path"),
        (r#","path":"/a b""#, "breaker.syntheticProbe.path"),
        (r#","authority":"""#, "breaker.syntheticProbe.authority"),
        (r#","intervalMs":50"#, "breaker.syntheticProbe.intervalMs"),
        (r#","timeoutMs":1500"#, "breaker.syntheticProbe.timeoutMs"),
        (r#","timeoutMs":0"#, "breaker.syntheticProbe.timeoutMs"),
        (r#","extra":1"#, "breaker.syntheticProbe"),
    ] {
        let e = config(&probe_cfg(members)).expect_err(members).to_string();
        assert!(e.contains(field), "{members}: {e}");
    }
    for body in [r#""not json""#, r#""[1,2]""#] {
        let e = config(&format!(r#","syntheticProbe":{{"body":{body}}}"#))
            .expect_err(body)
            .to_string();
        assert!(e.contains("breaker.syntheticProbe.body"), "{body}: {e}");
    }
    let e = config(r#","syntheticProbe":{}"#)
        .expect_err("no body")
        .to_string();
    assert!(e.contains("body"), "{e}");
}

#[test]
fn a_half_open_breaker_hands_out_one_synthetic_probe_at_a_time_spaced_by_the_interval() {
    let cfg = BreakerConfig {
        synthetic_probes: true,
        base_cooldown_ms: 1000,
        half_open_probes: 3,
        ..BreakerConfig::default()
    };
    let mut b = Breaker::default();
    assert!(!b.take_synthetic_probe(0, &cfg, 500), "closed: no probe");
    assert!(b.takes_requests(&cfg));
    b.trip(TripReason::Resets, 0, &cfg);
    assert!(!b.take_synthetic_probe(500, &cfg, 500), "open: no probe");
    b.poll(1_000, &cfg);
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert!(!b.takes_requests(&cfg), "half-open takes no client request");
    assert!(b.admits(&cfg), "but a probe may go");
    assert!(
        b.take_synthetic_probe(1_000, &cfg, 500),
        "the first at once"
    );
    assert!(!b.take_synthetic_probe(2_000, &cfg, 500), "one in flight");
    b.record(None, 1_100, &cfg);
    assert!(
        !b.take_synthetic_probe(1_400, &cfg, 500),
        "within the interval"
    );
    assert!(b.take_synthetic_probe(1_500, &cfg, 500));
    // Without the option a half-open pod takes client requests (its probes) as before.
    let plain = BreakerConfig {
        synthetic_probes: false,
        ..cfg
    };
    assert!(b.takes_requests(&plain) || !b.admits(&plain));
}

#[test]
fn client_requests_avoid_a_half_open_pod_and_probes_close_it() {
    let mut w = worker(&probe_cfg(
        r#","intervalMs":200,"path":"/v1/chat/completions""#,
    ));
    assert!(due(&mut w, 1_500).is_empty(), "open: nothing due");
    // From half-open to closed, no client request reaches the sick pod.
    let mut now = 2_000;
    let mut sent = 0;
    while state(&w) != BreakerState::Closed && now < 10_000 {
        for _ in 0..3 {
            assert_ne!(
                client_pick(&mut w, now),
                SICK,
                "client request on a half-open pod at {now}"
            );
        }
        let calls = due(&mut w, now);
        assert!(calls.len() <= 1, "one probe at a time: {calls:?}");
        if let Some(call) = calls.first() {
            sent += 1;
            assert_eq!(call.pod, SICK);
            assert_eq!(call.cluster, "inference");
            assert_eq!(call.body, BODY);
            assert_eq!(header(call, ":path"), Some("/v1/chat/completions"));
            assert_eq!(header(call, ":method"), Some("POST"));
            assert_eq!(header(call, ":authority"), Some("ai-lb-probe"));
            assert_eq!(header(call, "x-gateway-destination-endpoint"), Some(SICK));
            assert_eq!(header(call, PROBE_HEADER), Some("1"));
            assert!(
                due(&mut w, now + 10).is_empty(),
                "the slot is spent while it flies"
            );
            assert!(answer(&mut w, call, &ok(), now + 20));
        }
        now += 50;
    }
    assert_eq!(state(&w), BreakerState::Closed);
    assert_eq!(sent, 3, "halfOpenProbes passes close it");
    // 200 ms apart: the first at 2 000, the third no earlier than 2 400.
    assert!((2_400..2_600).contains(&now), "closed at {now}");
    let c = w.router.counters();
    assert_eq!((c.probe_sent, c.probe_passed, c.probe_failed), (3, 3, 0));
    // Closed, it takes client requests again.
    let picks: Vec<String> = (0..60)
        .map(|i| client_pick(&mut w, now + 100 + i))
        .collect();
    assert!(picks.iter().any(|p| p == SICK), "{picks:?}");
    assert!(due(&mut w, now + 200).is_empty());
}

#[test]
fn any_answer_but_well_formed_json_under_500_in_time_reopens_the_pod() {
    let answers = [
        (
            "5xx",
            ProbeAnswer::Response {
                status: 503,
                body: b"overloaded".to_vec(),
            },
        ),
        (
            "4xx (the probe's own request is wrong)",
            ProbeAnswer::Response {
                status: 404,
                body: br#"{"error":{"message":"model m not found"}}"#.to_vec(),
            },
        ),
        (
            "malformed 200",
            ProbeAnswer::Response {
                status: 200,
                body: b"<html>".to_vec(),
            },
        ),
        (
            "JSON without choices",
            ProbeAnswer::Response {
                status: 200,
                body: br#"{"id":"x"}"#.to_vec(),
            },
        ),
        ("timeout", ProbeAnswer::Failed { timeout: true }),
        ("reset", ProbeAnswer::Failed { timeout: false }),
    ];
    for (what, a) in answers {
        let mut w = worker(&probe_cfg(""));
        let calls = due(&mut w, 2_000);
        assert_eq!(calls.len(), 1, "{what}");
        assert!(!answer(&mut w, &calls[0], &a, 2_050), "{what}");
        assert_eq!(state(&w), BreakerState::Open, "{what}");
        assert_eq!(w.router.counters().probe_failed, 1, "{what}");
        assert!(
            due(&mut w, 2_100).is_empty(),
            "{what}: open again, nothing due"
        );
    }
    // A well-formed answer slower than ttftSloMs fails too.
    let mut w = worker(&format!(r#","ttftSloMs":300{}"#, probe_cfg("")));
    let calls = due(&mut w, 2_000);
    assert!(!answer(&mut w, &calls[0], &ok(), 2_400));
    assert_eq!(state(&w), BreakerState::Open);
    // A streamed well-formed answer passes.
    let mut w = worker(&probe_cfg(""));
    let calls = due(&mut w, 2_000);
    let sse = format!("data: {OK}\n\ndata: [DONE]\n\n");
    let a = ProbeAnswer::Response {
        status: 200,
        body: sse.into_bytes(),
    };
    assert!(answer(&mut w, &calls[0], &a, 2_050));
}

#[test]
fn a_lost_probe_is_forgotten_after_the_base_cooldown_and_a_late_answer_changes_nothing() {
    let mut w = worker(&probe_cfg(""));
    let first = due(&mut w, 2_000);
    assert_eq!(first.len(), 1);
    probe::not_sent(&mut w, &first[0], &mut |_| {});
    assert_eq!(w.router.counters().probe_not_sent, 1);
    assert!(due(&mut w, 2_900).is_empty(), "still counted in flight");
    let second = due(&mut w, 3_000);
    assert_eq!(second.len(), 1, "forgotten after baseCooldownMs (1 s)");
    // Reopened meanwhile (its agent reported it failing): the answer changes nothing.
    let cfg = w.router.config().breaker;
    let b = w.store.by_pod.get_mut(SICK).unwrap();
    b.trip(TripReason::AgentErrorRate, 3_010, &cfg);
    assert!(answer(&mut w, &second[0], &ok(), 3_050));
    assert_eq!(state(&w), BreakerState::Open);
}

#[test]
fn off_a_half_open_pod_gets_client_requests_as_probes_and_nothing_is_due() {
    let mut w = worker("");
    assert!(due(&mut w, 2_000).is_empty());
    let picks: Vec<String> = (0..5)
        .map(|i| client_pick(&mut w, 2_000 + i * 50))
        .collect();
    assert_eq!(picks.first().map(String::as_str), Some(SICK), "{picks:?}");
    assert_eq!(w.router.counters().probe_sent, 0);
}
