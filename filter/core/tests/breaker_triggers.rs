//! Decides whether the document's extra breaker triggers (issue 30 part 3, [`triggers`]) do
//! what they promise: answers are classified complete / truncated / memory error (SSE and
//! plain JSON, finish reasons, `max_tokens` edges, garbage, any chunking); the truncation
//! trigger opens only on `consecutiveTruncated` truncated answers in a row while the pod's
//! memory-error rate is strictly above `memoryErrorRate`; a half-open pod under
//! `wellFormedProbes` closes only after that many well-formed probe answers, a malformed one
//! re-opens it; the config is validated. The lifecycle part drives [`Exchange`] with a mock
//! host and worker (no Envoy), as `lifecycle.rs` does.

mod support;

use std::collections::HashMap;

use ai_lb_filter_core::breaker::{Breaker, BreakerState, Outcome, TripReason};
use ai_lb_filter_core::config::{BreakerConfig, FilterConfig};
use ai_lb_filter_core::lifecycle::{BreakerStore, Exchange, NoGate};
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::triggers::{Answer, AnswerScanner, Truncation, TruncationTracker};
use support::{pods_event, MockHost, NoStats, SyncWorker};

// ---- classification ------------------------------------------------------------------

fn sse_chunk(content: &str, finish: Option<&str>) -> String {
    let f = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":{f}}}]}}\n\n"
    )
}

fn sse(tokens: usize, finish: Option<&str>, usage: Option<u64>, done: bool) -> String {
    let mut s = String::new();
    for i in 0..tokens {
        let last = i + 1 == tokens;
        s.push_str(&sse_chunk("tok ", if last { finish } else { None }));
    }
    if let Some(u) = usage {
        s.push_str(&format!(
            "data: {{\"id\":\"c\",\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{u},\"total_tokens\":{}}}}}\n\n",
            u + 5
        ));
    }
    if done {
        s.push_str("data: [DONE]\n\n");
    }
    s
}

fn json(finish: Option<&str>, completion: u64) -> String {
    let f = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
    format!(
        "{{\"id\":\"c\",\"object\":\"chat.completion\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"hi\"}},\"finish_reason\":{f}}}],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{completion},\"total_tokens\":{}}}}}",
        completion + 5
    )
}

fn scan(status: u16, body: &str) -> AnswerScanner {
    let mut s = AnswerScanner::new(Some(status));
    s.feed(body.as_bytes());
    s
}

const OOM: &str = r#"{"error":{"message":"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.","type":"InternalServerError","param":null,"code":500}}"#;

#[test]
fn a_streamed_answer_with_a_finish_reason_is_complete_and_one_cut_off_is_truncated() {
    let m = Some(16);
    assert_eq!(
        scan(200, &sse(16, Some("length"), Some(16), true)).classify(m),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &sse(3, Some("stop"), None, true)).classify(m),
        Answer::Complete,
        "stop before max_tokens"
    );
    assert_eq!(
        scan(200, &sse(8, None, None, false)).classify(m),
        Answer::Truncated,
        "ended with no finish reason"
    );
    assert_eq!(
        scan(200, &sse(8, None, None, true)).classify(m),
        Answer::Truncated,
        "[DONE] without a finish reason"
    );
    assert_eq!(
        scan(200, &sse(8, None, Some(8), true)).classify(m),
        Answer::Truncated
    );
    assert_eq!(scan(200, "").classify(m), Answer::Truncated, "an empty 200");
    assert_eq!(
        scan(200, "data: not json\n\n").classify(m),
        Answer::Truncated,
        "garbage"
    );
}

#[test]
fn an_answer_that_used_all_its_max_tokens_is_complete_even_without_a_finish_reason() {
    // Usage says 16 of 16, or 16 token chunks were seen.
    assert_eq!(
        scan(200, &sse(4, None, Some(16), false)).classify(Some(16)),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &sse(16, None, None, false)).classify(Some(16)),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &sse(15, None, None, false)).classify(Some(16)),
        Answer::Truncated,
        "one short"
    );
    assert_eq!(
        scan(200, &json(None, 16)).classify(Some(16)),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &json(None, 15)).classify(Some(16)),
        Answer::Truncated
    );
    // max_tokens unknown: no finish reason is truncated whatever the count.
    assert_eq!(
        scan(200, &sse(16, None, Some(16), false)).classify(None),
        Answer::Truncated
    );
}

#[test]
fn a_plain_json_answer_is_judged_whole() {
    assert_eq!(
        scan(200, &json(Some("length"), 16)).classify(Some(16)),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &json(Some("stop"), 2)).classify(Some(16)),
        Answer::Complete
    );
    assert_eq!(
        scan(200, &json(None, 8)).classify(Some(16)),
        Answer::Truncated
    );
    let whole = json(Some("stop"), 2);
    let cut = whole.get(..whole.len() / 2).unwrap();
    assert_eq!(
        scan(200, cut).classify(Some(16)),
        Answer::Truncated,
        "a body cut mid-JSON"
    );
    assert_eq!(
        scan(200, "<html>oops</html>").classify(Some(16)),
        Answer::Truncated
    );
}

#[test]
fn errors_are_told_apart_by_what_their_body_names() {
    assert_eq!(scan(500, OOM).classify(None), Answer::MemoryError);
    assert_eq!(
        scan(503, "CUDA error: out of memory").classify(None),
        Answer::MemoryError
    );
    assert_eq!(
        scan(
            500,
            r#"{"error":{"message":"injected failure","type":"InternalServerError"}}"#
        )
        .classify(None),
        Answer::Error
    );
    assert_eq!(
        scan(429, "slow down").classify(None),
        Answer::Unknown,
        "4xx is not judged"
    );
    assert_eq!(AnswerScanner::new(None).classify(None), Answer::Unknown);
}

#[test]
fn any_chunking_gives_the_same_verdicts() {
    for body in [
        sse(6, Some("length"), Some(6), true),
        sse(6, None, None, false),
        sse(3, None, Some(3), true),
        json(Some("stop"), 3),
        json(None, 3),
    ] {
        let whole = scan(200, &body);
        for split in 0..body.len() {
            let mut s = AnswerScanner::new(Some(200));
            s.feed(body.as_bytes().get(..split).unwrap());
            s.feed(body.as_bytes().get(split..).unwrap());
            assert_eq!(
                s.classify(Some(6)),
                whole.classify(Some(6)),
                "split at {split}"
            );
            assert_eq!(s.well_formed(), whole.well_formed(), "split at {split}");
        }
    }
}

#[test]
fn an_answer_too_large_to_judge_is_left_unjudged_and_counts_as_well_formed() {
    let mut s = AnswerScanner::new(Some(200));
    s.feed(b"{\"choices\":[],\"pad\":\"");
    s.feed(&vec![b'x'; ai_lb_filter_core::triggers::MAX_BODY_BYTES]);
    assert_eq!(s.classify(Some(4)), Answer::Unjudged);
    assert!(s.well_formed());
}

#[test]
fn well_formed_means_openai_shaped_json_and_a_final_done_when_streamed() {
    assert!(scan(200, &json(Some("stop"), 3)).well_formed());
    assert!(
        scan(200, &json(None, 3)).well_formed(),
        "shape, not completeness"
    );
    assert!(scan(200, &sse(3, Some("stop"), Some(3), true)).well_formed());
    assert!(
        scan(
            200,
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]"
        )
        .well_formed(),
        "no final newline"
    );
    assert!(
        !scan(200, &sse(3, Some("stop"), None, false)).well_formed(),
        "no [DONE]"
    );
    assert!(
        !scan(200, "data: [DONE]\n\n").well_formed(),
        "no chunk at all"
    );
    let mut bad = sse(2, None, None, false);
    bad.push_str("data: {\"choices\": [\n\ndata: [DONE]\n\n");
    assert!(!scan(200, &bad).well_formed(), "a line that is not JSON");
    let mut bad = sse(2, Some("stop"), None, true);
    bad.push_str(&sse_chunk("late", None));
    assert!(!scan(200, &bad).well_formed(), "data after [DONE]");
    assert!(
        !scan(200, "data: {\"object\":\"x\"}\n\ndata: [DONE]\n\n").well_formed(),
        "no choices"
    );
    assert!(!scan(200, "{\"object\":\"x\"}").well_formed());
    assert!(!scan(200, "[1,2]").well_formed());
    assert!(!scan(200, "hello").well_formed());
    assert!(!scan(200, "").well_formed());
    assert!(!scan(500, OOM).well_formed());
}

// ---- the truncation trigger ----------------------------------------------------------

const T: Truncation = Truncation {
    consecutive_truncated: 3,
    memory_error_rate: 0.15,
};

/// Feeds `answers` at 10 ms steps; the index of the answer that tripped, if one did.
fn run(tr: &mut TruncationTracker, answers: &[Answer]) -> Option<usize> {
    answers
        .iter()
        .enumerate()
        .find_map(|(i, a)| tr.record(*a, 10 * i as u64, 10_000, &T).trip.then_some(i))
}

#[test]
fn three_truncated_in_a_row_open_only_while_the_memory_error_rate_is_above_the_threshold() {
    use Answer::*;
    // 1 memory error of 5 answers so far (0.2), then truncations (the rate drops as they
    // count: 1/6, 1/7, 1/8 = 0.125 at the third).
    let mut tr = TruncationTracker::default();
    assert_eq!(
        run(
            &mut tr,
            &[
                MemoryError,
                Complete,
                Complete,
                Complete,
                Complete,
                Truncated,
                Truncated,
                Truncated
            ]
        ),
        None,
        "the third truncation finds the rate at 1/8, not above 0.15"
    );
    // Above: 2 of 6 answers are memory errors at the third truncation (0.33).
    let mut tr = TruncationTracker::default();
    assert_eq!(
        run(
            &mut tr,
            &[
                MemoryError,
                MemoryError,
                Complete,
                Truncated,
                Truncated,
                Truncated
            ]
        ),
        Some(5)
    );
    // Two in a row do not.
    let mut tr = TruncationTracker::default();
    assert_eq!(run(&mut tr, &[MemoryError, Truncated, Truncated]), None);
    assert_eq!(tr.run(), 2);
    // A complete answer ends the run; errors leave it as it is.
    let mut tr = TruncationTracker::default();
    assert_eq!(
        run(
            &mut tr,
            &[
                MemoryError,
                Truncated,
                Truncated,
                Complete,
                Truncated,
                MemoryError,
                Truncated
            ]
        ),
        None
    );
    assert_eq!(tr.run(), 2, "the error between truncations kept the run");
}

#[test]
fn the_rate_must_exceed_the_threshold_not_reach_it() {
    use Answer::*;
    // Exactly 0.15 at each truncation needs e/n = 0.15: 3 memory errors of 20 answers at the
    // third truncation (17 other answers, 3 of them the truncations).
    let mut answers = vec![MemoryError; 3];
    answers.extend(std::iter::repeat_n(Complete, 14));
    answers.extend([Truncated, Truncated, Truncated]);
    let mut tr = TruncationTracker::default();
    // The first two truncations see 3/18 and 3/19 (above), the third 3/20 = 0.15 (not above):
    // it does not count and the run starts over.
    assert_eq!(run(&mut tr, &answers), None);
    assert_eq!(tr.run(), 0);
    // One more memory error first: 4/21 at the third truncation, above.
    let mut answers = vec![MemoryError; 4];
    answers.extend(std::iter::repeat_n(Complete, 14));
    answers.extend([Truncated, Truncated, Truncated]);
    let mut tr = TruncationTracker::default();
    assert_eq!(run(&mut tr, &answers), Some(20));
}

#[test]
fn memory_errors_age_out_of_the_window() {
    let mut tr = TruncationTracker::default();
    tr.record(Answer::MemoryError, 0, 10_000, &T);
    assert!(tr.memory_error_rate() > 0.99);
    // Two truncations 20 s later: the old error is gone, the rate is 0, nothing counts.
    for t in [20_000, 20_010, 20_020] {
        let step = tr.record(Answer::Truncated, t, 10_000, &T);
        assert!(!step.trip && step.ignored);
    }
    assert_eq!(tr.memory_error_rate(), 0.0);
}

// ---- config --------------------------------------------------------------------------

fn breaker_cfg(breaker: &str) -> Result<BreakerConfig, String> {
    FilterConfig::from_json(
        format!(r#"{{"pools":[{{"name":"p","cluster":"c"}}],"breaker":{breaker}}}"#).as_bytes(),
    )
    .map(|c| c.breaker)
    .map_err(|e| e.to_string())
}

#[test]
fn the_options_are_off_unless_present_and_validated() {
    let c = breaker_cfg("{}").unwrap();
    assert_eq!((c.truncation, c.well_formed_probes), (None, None));
    let c = breaker_cfg(r#"{"truncation":{},"wellFormedProbes":5}"#).unwrap();
    assert_eq!(c.truncation, Some(T));
    assert_eq!((c.well_formed_probes, c.probes_to_close()), (Some(5), 5));
    let c =
        breaker_cfg(r#"{"truncation":{"consecutiveTruncated":1,"memoryErrorRate":0}}"#).unwrap();
    assert_eq!(
        c.truncation
            .map(|t| (t.consecutive_truncated, t.memory_error_rate)),
        Some((1, 0.0))
    );
    for (bad, names) in [
        (
            r#"{"truncation":{"consecutiveTruncated":0}}"#,
            "breaker.truncation.consecutiveTruncated",
        ),
        (
            r#"{"truncation":{"memoryErrorRate":1}}"#,
            "breaker.truncation.memoryErrorRate",
        ),
        (
            r#"{"truncation":{"memoryErrorRate":-0.1}}"#,
            "breaker.truncation.memoryErrorRate",
        ),
        (r#"{"truncation":{"rate":0.2}}"#, "rate"),
        (r#"{"wellFormedProbes":0}"#, "breaker.wellFormedProbes"),
        (r#"{"wellFormedProbes":251}"#, "breaker.wellFormedProbes"),
    ] {
        let e = breaker_cfg(bad).expect_err(bad);
        assert!(e.contains(names), "{bad}: {e}");
    }
}

// ---- the well-formed probe rule on the breaker ---------------------------------------

fn probe_cfg() -> BreakerConfig {
    BreakerConfig {
        consecutive_failures: 1,
        base_cooldown_ms: 1000,
        max_cooldown_ms: 1000,
        half_open_probes: 2,
        well_formed_probes: Some(5),
        ..BreakerConfig::default()
    }
}

fn half_open(cfg: &BreakerConfig) -> Breaker {
    let mut b = Breaker::default();
    b.record(Some(TripReason::ServerErrors), 0, cfg);
    b.poll(5_000, cfg);
    assert_eq!(b.state(), BreakerState::HalfOpen);
    b
}

#[test]
fn a_half_open_pod_closes_after_well_formed_probes_successes_not_half_open_probes() {
    let cfg = probe_cfg();
    let mut b = half_open(&cfg);
    for i in 0..5u64 {
        assert!(b.admits(&cfg), "probe {i} admitted");
        b.on_request(5_000 + i);
        let t = b.record(None, 5_000 + i, &cfg);
        assert_eq!(
            t.is_some(),
            i == 4,
            "closes at the fifth, not at halfOpenProbes (2)"
        );
    }
    assert_eq!(b.state(), BreakerState::Closed);
}

#[test]
fn a_malformed_probe_answer_is_a_failure_that_reopens() {
    let cfg = probe_cfg();
    let malformed = Outcome {
        status: Some(200),
        malformed: true,
        ..Outcome::default()
    };
    assert_eq!(malformed.failure(&cfg), Some(TripReason::MalformedProbe));
    let mut b = half_open(&cfg);
    for i in 0..4u64 {
        b.on_request(5_000 + i);
        assert!(b.record(None, 5_000 + i, &cfg).is_none());
    }
    b.on_request(5_010);
    let t = b.record(malformed.failure(&cfg), 5_010, &cfg).unwrap();
    assert_eq!(
        (t.to, t.reason),
        (BreakerState::Open, Some(TripReason::MalformedProbe))
    );
    // The encoding keeps the new reasons.
    assert_eq!(Breaker::decode(&b.encode()), Some(b));
    // Probes are judged at their answer's end under the option, not at their first byte.
    assert!(!Outcome::probe_passed_at_first_byte(Some(200), 10, &cfg));
    let off = BreakerConfig {
        well_formed_probes: None,
        ..cfg
    };
    assert!(Outcome::probe_passed_at_first_byte(Some(200), 10, &off));
}

// ---- through the lifecycle -----------------------------------------------------------

const PODS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

type MockWorker = SyncWorker<NoStats>;

fn publish(router: &mut Router, now: u64) {
    router.apply_pool_event(0, &pods_event(&PODS, |_| 0), now);
}

fn worker(breaker: &str) -> MockWorker {
    let cfg = FilterConfig::from_json(
        format!(r#"{{"pools":[{{"name":"default","cluster":"inference"}}],"breaker":{breaker}}}"#)
            .as_bytes(),
    )
    .unwrap();
    let mut router = Router::new(cfg);
    publish(&mut router, 1_000);
    SyncWorker::new(router, NoStats, 3, 0)
}

/// One request answered by whichever pod it was steered to: `answer(pod)` gives the status
/// and the body, delivered in two chunks. Returns the pod.
fn request(w: &mut MockWorker, now: u64, answer: &dyn Fn(&str) -> (u16, String)) -> String {
    let mut h = MockHost::at(now);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, w, &mut NoGate, true);
    let pod = ex.chosen().expect("steered").to_string();
    let (code, body) = answer(&pod);
    h.upstream = Some(pod.clone());
    h.code = Some(code);
    h.resp.insert(":status".into(), code.to_string());
    ex.on_response_headers(&mut h, w, &mut NoGate, false);
    let mid = body.len() / 2;
    for (part, end) in [
        (body.get(..mid).unwrap(), false),
        (body.get(mid..).unwrap(), true),
    ] {
        h.now += 5;
        h.chunk = Some(part.as_bytes().to_vec());
        ex.on_response_body(&mut h, w, &mut NoGate, part.len(), end);
    }
    ex.on_end(&mut h, w, &mut NoGate);
    pod
}

#[test]
fn a_pod_truncating_answers_with_memory_errors_is_cut_and_a_healthy_one_is_not() {
    let mut w = worker(r#"{"truncation":{}}"#);
    let sick = PODS[0];
    // The sick pod answers memory errors and truncated streams, one after the other; the
    // healthy one answers complete streams.
    let turn = std::cell::Cell::new(0u32);
    let answer = |pod: &str| {
        if pod == sick {
            turn.set(turn.get() + 1);
            if turn.get() % 2 == 1 {
                (500, OOM.to_string())
            } else {
                (200, sse(4, None, None, false))
            }
        } else {
            (200, sse(8, Some("length"), Some(8), true))
        }
    };
    for i in 0..400 {
        let now = 1_010 + i * 50;
        publish(&mut w.router, now);
        request(&mut w, now, &answer);
        if w.store
            .by_pod
            .get(sick)
            .is_some_and(|b| b.state() == BreakerState::Open)
        {
            break;
        }
    }
    let b = w.store.by_pod.get(sick).copied().unwrap_or_default();
    assert_eq!(
        (b.state(), b.reason()),
        (BreakerState::Open, Some(TripReason::Truncated)),
        "the shared breaker opened for truncation"
    );
    for healthy in &PODS[1..] {
        let b = w.store.by_pod.get(*healthy).copied().unwrap_or_default();
        assert_eq!(b.state(), BreakerState::Closed);
    }
    let c = w.router.counters();
    assert!(
        c.answers_truncated >= 3 && c.answers_memory_errors >= 1,
        "{c:?}"
    );
}

#[test]
fn an_answer_reset_mid_stream_is_a_failure_not_a_truncated_generation() {
    let mut w = worker(r#"{"truncation":{}}"#);
    let mut h = MockHost::at(1_010);
    let mut ex = Exchange::new();
    ex.on_request_headers(&mut h, &mut w, &mut NoGate, true);
    let pod = ex.chosen().expect("steered").to_string();
    h.upstream = Some(pod);
    h.code = Some(200);
    h.resp.insert(":status".into(), "200".into());
    ex.on_response_headers(&mut h, &mut w, &mut NoGate, false);
    h.chunk = Some(sse(2, None, None, false).into_bytes());
    ex.on_response_body(&mut h, &mut w, &mut NoGate, 10, false);
    h.details = Some("upstream_reset_after_response_started{remote_reset}".into());
    ex.on_end(&mut h, &mut w, &mut NoGate);
    assert_eq!(w.router.counters().answers_truncated, 0);
    // The same answer ending cleanly is judged truncated.
    request(&mut w, 1_100, &|_| (200, sse(2, None, None, false)));
    assert_eq!(w.router.counters().answers_truncated, 1);
}

#[test]
fn truncations_without_memory_errors_and_the_option_off_cut_nothing() {
    for breaker in [r#"{"truncation":{}}"#, r#"{}"#] {
        let mut w = worker(breaker);
        for i in 0..40 {
            request(&mut w, 1_010 + i * 10, &|_| {
                (200, sse(4, None, None, false))
            });
        }
        assert!(
            w.store
                .by_pod
                .values()
                .all(|b| b.state() == BreakerState::Closed),
            "{breaker}: nothing opens"
        );
    }
}

#[test]
fn a_probe_answering_malformed_json_reopens_and_well_formed_ones_close_after_the_count() {
    let mut w = worker(
        r#"{"wellFormedProbes":3,"halfOpenProbes":1,"baseCooldownMs":1000,"maxCooldownMs":1000}"#,
    );
    let cfg = w.router.config().breaker;
    for pod in PODS {
        let trip = &mut |b: &mut Breaker| b.trip(TripReason::ServerErrors, 1_000, &cfg);
        w.store.update(&mut w.router, 0, pod, 1_000, trip);
    }
    let mut now = 10_000;
    publish(&mut w.router, now);
    // A malformed probe answer (a 200 whose stream never ends with [DONE]) re-opens its pod.
    let pod = request(&mut w, now, &|_| (200, sse(3, Some("stop"), None, false)));
    let b = w.store.by_pod[&pod];
    assert_eq!(
        (b.state(), b.reason()),
        (BreakerState::Open, Some(TripReason::MalformedProbe))
    );
    // The other pods take well-formed probes: each closes at its third, not at its first.
    let mut probes: HashMap<String, u32> = HashMap::new();
    for _ in 0..20 {
        now += 20;
        let p = request(&mut w, now, &|_| (200, sse(3, Some("stop"), Some(3), true)));
        let n = probes.entry(p.clone()).or_default();
        *n += 1;
        let state = w.store.by_pod[&p].state();
        assert_eq!(
            state == BreakerState::Closed,
            *n >= 3,
            "{p} after {n} well-formed probes"
        );
        if probes.len() == 2 && probes.values().all(|n| *n >= 3) {
            break;
        }
    }
    assert!(
        !probes.contains_key(&pod),
        "the re-opened pod takes no probe"
    );
    assert_eq!(probes.len(), 2);
}
