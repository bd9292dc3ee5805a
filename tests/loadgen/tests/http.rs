//! Integration: the load generator against a tiny in-test SSE server on 127.0.0.1:0 that
//! alternates `x-fake-pod` between two pods, reports usage, and can hang or fail on request.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ai_lb_loadgen::client::{Client, Target};
use ai_lb_loadgen::config::parse_url;
use ai_lb_loadgen::run::{run, run_closed, RunOptions};
use ai_lb_loadgen::stats::{summarize, Outcome, NO_POD};
use ai_lb_loadgen::workload::{Tag, TraceEntry};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Response, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;

/// max_tokens values that select server behaviour.
const NO_USAGE: u32 = 3;
const HANG: u32 = 999;
const FAIL: u32 = 500;
/// Content chunks sent when usage is reported (usage then says max_tokens).
const CHUNKS_WITH_USAGE: u32 = 5;

async fn chat(
    State(n): State<Arc<AtomicU64>>,
    Json(req): Json<serde_json::Value>,
) -> Response<Body> {
    let max = req["max_tokens"].as_u64().unwrap_or(0) as u32;
    assert_eq!(req["stream"], true);
    assert_eq!(req["stream_options"]["include_usage"], true);
    if max == FAIL {
        return Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from("no healthy upstream"))
            .unwrap();
    }
    let pod = if n.fetch_add(1, Ordering::SeqCst) % 2 == 0 {
        "pod-a"
    } else {
        "pod-b"
    };
    let chunk = |i: u32| {
        Bytes::from(format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}],\"usage\":null}}\n\n"))
    };
    let mut parts: Vec<Bytes> = Vec::new();
    let body = match max {
        HANG => {
            let first = futures::stream::iter(vec![Ok::<_, Infallible>(chunk(0))]);
            Body::from_stream(first.chain(futures::stream::pending()))
        }
        NO_USAGE => {
            parts.extend((0..NO_USAGE).map(chunk));
            parts.push(Bytes::from_static(b"data: [DONE]\n\n"));
            Body::from_stream(futures::stream::iter(
                parts.into_iter().map(Ok::<_, Infallible>),
            ))
        }
        _ => {
            parts.extend((0..CHUNKS_WITH_USAGE).map(chunk));
            parts.push(Bytes::from(format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{max},\"total_tokens\":{}}}}}\n\n",
                max + 1
            )));
            parts.push(Bytes::from_static(b"data: [DONE]\n\n"));
            Body::from_stream(futures::stream::iter(
                parts.into_iter().map(Ok::<_, Infallible>),
            ))
        }
    };
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-fake-pod", pod)
        .body(body)
        .unwrap()
}

async fn serve() -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(Arc::new(AtomicU64::new(0)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn client(url: &str) -> Client {
    Client::new(
        Target {
            uri: parse_url(url).unwrap(),
            model: "m".into(),
            headers: vec![],
            ignore_eos: true,
        },
        100,
    )
}

fn entry(id: u64, at_ms: u64, tag: Tag, max_tokens: u32) -> TraceEntry {
    TraceEntry {
        id,
        at_us: at_ms * 1000,
        tag,
        prompt_tokens: 20,
        max_tokens,
        ..TraceEntry::default()
    }
}

#[tokio::test]
async fn counts_shares_tokens_and_timeouts() {
    let url = serve().await;
    let mut trace = Vec::new();
    for i in 0..40 {
        trace.push(entry(
            i,
            i * 3,
            if i % 4 == 0 { Tag::Long } else { Tag::Short },
            10,
        ));
    }
    for (i, max) in [
        NO_USAGE, NO_USAGE, NO_USAGE, NO_USAGE, HANG, HANG, FAIL, FAIL,
    ]
    .into_iter()
    .enumerate()
    {
        trace.push(entry(40 + i as u64, 120 + i as u64, Tag::Short, max));
    }
    let opts = RunOptions {
        timeout: Duration::from_millis(1500),
        max_in_flight: 10_000,
        live: false,
    };
    let res = run(client(&url), Arc::new(trace), opts).await;
    assert_eq!(res.records.len(), 48);
    assert!(
        res.records
            .iter()
            .enumerate()
            .all(|(i, r)| r.id == i as u64),
        "sorted by id"
    );

    let s = summarize(
        &res.records,
        res.wall_s,
        res.in_flight_cap_hits,
        res.peak_in_flight,
    );
    let c = &s.overall.counts;
    assert_eq!(
        (
            c.scheduled,
            c.sent,
            c.ok,
            c.timeouts,
            c.http_errors,
            c.transport_errors
        ),
        (48, 48, 44, 2, 2, 0)
    );
    assert_eq!(s.overall.status_codes["200"], 46);
    assert_eq!(s.overall.status_codes["503"], 2);
    assert!((s.overall.timeout_rate - 2.0 / 48.0).abs() < 1e-12);

    // Usage wins over the chunk count; without usage the chunks are counted.
    assert_eq!(s.overall.output_tokens, 40 * 10 + 4 * u64::from(NO_USAGE));
    let usage = res
        .records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok && r.tokens_from_usage)
        .count();
    assert_eq!(usage, 40);

    // The server alternates pods over the 46 requests it answered with a pod.
    assert_eq!(s.overall.pod_share["pod-a"].requests, 23);
    assert_eq!(s.overall.pod_share["pod-b"].requests, 23);
    assert_eq!(s.overall.pod_share[NO_POD].requests, 2);
    assert!((s.overall.pod_share["pod-a"].share - 23.0 / 48.0).abs() < 1e-12);

    // Per tag split.
    assert_eq!(s.by_tag["long"].counts.ok, 10);
    assert_eq!(s.by_tag["short"].counts.timeouts, 2);
    assert_eq!(s.by_tag["long"].ttft_ms.count, 10);

    // Hung requests saw their first chunk (TTFT) but timed out.
    for r in res.records.iter().filter(|r| r.max_tokens == HANG) {
        assert_eq!(r.outcome, Outcome::Timeout);
        assert!(r.ttft_ms.is_some() && r.pod.is_some());
        assert!(r.e2e_ms.unwrap() >= 1500.0);
    }
    for r in res.records.iter().filter(|r| r.outcome == Outcome::Ok) {
        assert!(r.ttft_ms.unwrap() <= r.e2e_ms.unwrap());
    }
}

#[tokio::test]
async fn in_flight_cap_skips_and_counts() {
    let url = serve().await;
    let trace = vec![
        entry(0, 0, Tag::Long, HANG),
        entry(1, 30, Tag::Short, 10),
        entry(2, 60, Tag::Short, 10),
    ];
    let opts = RunOptions {
        timeout: Duration::from_millis(800),
        max_in_flight: 1,
        live: false,
    };
    let res = run(client(&url), Arc::new(trace), opts).await;
    assert_eq!(res.in_flight_cap_hits, 2);
    assert_eq!(res.peak_in_flight, 1);
    let s = summarize(
        &res.records,
        res.wall_s,
        res.in_flight_cap_hits,
        res.peak_in_flight,
    );
    assert_eq!(
        (
            s.overall.counts.sent,
            s.overall.counts.skipped_in_flight_cap,
            s.overall.counts.timeouts
        ),
        (1, 2, 1)
    );
}

#[tokio::test]
async fn unreachable_endpoint_is_a_transport_error() {
    // Bind then drop a listener to get a port with nothing behind it.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let opts = RunOptions {
        timeout: Duration::from_secs(5),
        max_in_flight: 10,
        live: false,
    };
    let res = run(
        client(&url),
        Arc::new(vec![entry(0, 0, Tag::Short, 10)]),
        opts,
    )
    .await;
    assert_eq!(res.records[0].outcome, Outcome::TransportError);
    assert!(res.records[0].error.is_some());
}

#[tokio::test]
async fn closed_loop_keeps_n_in_flight_until_the_span_and_ignores_arrival_times() {
    let url = serve().await;
    // 20 000 entries all due at once except the last, which sets a 300 ms span; 2 workers.
    let mut trace: Vec<TraceEntry> = (0..19_999).map(|i| entry(i, 0, Tag::Short, 10)).collect();
    trace.push(entry(19_999, 300, Tag::Short, 10));
    let opts = RunOptions {
        timeout: Duration::from_secs(5),
        max_in_flight: 10_000,
        live: false,
    };
    let res = run_closed(client(&url), Arc::new(trace), 2, opts).await;
    let n = res.records.len();
    // It stopped at the span, not at the end of the trace, and every request was answered.
    assert!(n > 2 && n < 20_000, "{n} records");
    assert!(res.records.iter().all(|r| r.outcome == Outcome::Ok));
    // Entries are taken in order: ids 0..n, each once.
    let ids: Vec<u64> = res.records.iter().map(|r| r.id).collect();
    assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
    assert!(res.wall_s >= 0.3 && res.wall_s < 5.0, "{}", res.wall_s);
    assert_eq!(res.peak_in_flight, 2);
}

/// Bodies received by [`recording_chat`], in arrival order.
type Seen = Arc<std::sync::Mutex<Vec<serde_json::Value>>>;

/// Streams `"ab "` pieces (max_tokens of them) as content, or 503 when max_tokens is FAIL;
/// keeps every request body.
async fn recording_chat(
    State(seen): State<Seen>,
    Json(req): Json<serde_json::Value>,
) -> Response<Body> {
    let max = req["max_tokens"].as_u64().unwrap_or(0) as u32;
    seen.lock().unwrap().push(req);
    if max == FAIL {
        return Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from("no healthy upstream"))
            .unwrap();
    }
    let mut parts: Vec<Bytes> = (0..max)
        .map(|i| {
            let role = if i == 0 { "\"role\":\"assistant\"," } else { "" };
            Bytes::from(format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{{role}\"content\":\" ab\"}}}}]}}\n\n"
            ))
        })
        .collect();
    parts.push(Bytes::from(format!(
        "data: {{\"choices\":[],\"usage\":{{\"completion_tokens\":{max}}}}}\n\ndata: [DONE]\n\n"
    )));
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-fake-pod", "pod-a")
        .body(Body::from_stream(futures::stream::iter(
            parts.into_iter().map(Ok::<_, Infallible>),
        )))
        .unwrap()
}

#[tokio::test]
async fn sessions_resend_the_conversation_and_a_failed_turn_ends_them() {
    use ai_lb_loadgen::text::{chat_prompt_tokens, tokens};
    use ai_lb_loadgen::workload::{TextSpec, Turn};
    let seen: Seen = Arc::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(recording_chat))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let turn = |seed, max_tokens, think_ms: u64| Turn {
        question: TextSpec { seed, tokens: 12 },
        max_tokens,
        think_us: think_ms * 1000,
    };
    let system = Some(TextSpec {
        seed: 3,
        tokens: 40,
    });
    let session = |id, s, turns: Vec<Turn>| TraceEntry {
        id,
        at_us: 1000,
        prompt_tokens: 40 + 12 + 3,
        max_tokens: turns[0].max_tokens,
        group: Some(0),
        session: Some(s),
        system,
        turns,
        ..TraceEntry::default()
    };
    let trace = vec![
        session(0, 0, vec![turn(1, 4, 0), turn(2, 3, 20), turn(3, 2, 5)]),
        session(
            3,
            1,
            vec![
                turn(4, 2, 0),
                turn(5, FAIL, 1),
                turn(6, 2, 1),
                turn(7, 2, 1),
            ],
        ),
    ];
    let c = client(&url).prepare(&trace);
    let opts = RunOptions {
        timeout: Duration::from_secs(10),
        max_in_flight: 100,
        live: false,
    };
    let r = run(c, Arc::new(trace), opts).await;
    let outcomes: Vec<Outcome> = r.records.iter().map(|x| x.outcome).collect();
    use Outcome::*;
    assert_eq!(
        outcomes,
        vec![Ok, Ok, Ok, Ok, HttpError, SessionEnded, SessionEnded]
    );
    let s = summarize(&r.records, r.wall_s, r.in_flight_cap_hits, r.peak_in_flight);
    let sessions = s.sessions.unwrap();
    assert_eq!(
        (sessions.sessions, sessions.completed, sessions.ended_early),
        (2, 1, 1)
    );
    assert_eq!(
        (sessions.turns_not_sent, s.overall.counts.session_ended),
        (2, 2)
    );

    // Session 0's third request carries everything so far, answers as streamed.
    let bodies = seen.lock().unwrap().clone();
    assert_eq!(bodies.len(), 5, "the turns after the failure were not sent");
    let msgs = |b: &serde_json::Value| -> Vec<(String, String)> {
        b["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().into(),
                    m["content"].as_str().unwrap().into(),
                )
            })
            .collect()
    };
    let all: Vec<Vec<(String, String)>> = bodies.iter().map(msgs).collect();
    let third = all
        .iter()
        .find(|m| m.len() == 6 && m[1].1.starts_with("s0 t1"))
        .expect("session 0 turn 3");
    let roles: Vec<&str> = third.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "user", "assistant", "user"]
    );
    assert_eq!(third[2].1, " ab ab ab ab", "turn 1's answer as received");
    assert_eq!(third[4].1, " ab ab ab");
    assert!(third[5].1.starts_with("s0 t3: "));
    let first = all
        .iter()
        .find(|m| m.len() == 2 && m[1].1.starts_with("s0 t1"))
        .unwrap();
    assert_eq!(first[0], third[0], "the system prompt is resent unchanged");
    assert_eq!(first[1], third[1]);

    // Records: exact template counts, and the previous prompt + answer as the cached prefix.
    let rec = |id: u64| r.records.iter().find(|x| x.id == id).unwrap();
    let m: Vec<(&str, &str)> = third
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    assert_eq!(rec(2).prompt_tokens, chat_prompt_tokens(&m));
    assert_eq!(rec(0).prompt_tokens, 55);
    assert_eq!(
        rec(0).prefix_tokens,
        Some(42),
        "system + its role + the user role"
    );
    assert_eq!(
        rec(1).prefix_tokens,
        Some(rec(0).prompt_tokens + tokens(" ab ab ab ab"))
    );
    assert_eq!(
        rec(2).prefix_tokens,
        Some(rec(1).prompt_tokens + tokens(" ab ab ab"))
    );
    assert_eq!(
        (rec(2).session, rec(2).turn, rec(2).group),
        (Some(0), Some(3), Some(0))
    );
    // A turn leaves its think time after the previous answer ended (never earlier).
    let end1 = rec(0).sent_us as f64 / 1000.0 + rec(0).e2e_ms.unwrap();
    assert!(rec(1).sent_us as f64 / 1000.0 + 1.0 >= end1 + 20.0);
    assert!(rec(1).scheduled_us <= rec(1).sent_us);
}
