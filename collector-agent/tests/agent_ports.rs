//! Issue 31: what a misbehaving peer can do to the agent's ports. A thousand idle streams from
//! one peer get the per-peer cap and no more, and another peer is still served; a subscriber
//! that never takes an event is dropped (its connection closed) while the others keep their
//! updates; garbage, an oversized frame and oversized or malformed messages are refused and
//! the agent carries on; connection caps and the first-request deadline hold. Every refusal
//! is read back from the agent's `/metrics`.
//!
//! The memory checks run the agent binary as its own process and read its RSS from
//! `/proc/<pid>/status`. Each test is several peers at once: 127.0.0.x are all this host.

mod agent_support;

use agent_support::raw_h2::{self, Ended};
use agent_support::{eventually, start_agent, test_config, within, Knob};
use ai_lb_agent::grpc::RunningAgent;
use ai_lb_fake_pod::config::{Cli, PodConfig};
use ai_lb_fake_pod::server::{serve, AppState};
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{watch_event, PodSnapshot, SnapshotRequest, WatchEvent, WatchRequest};
use bytes::{Buf, BufMut};
use clap::Parser;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// The peer that misbehaves, the one that behaves, and the one that scrapes `/metrics`.
const BAD: &str = "127.0.0.1";
const GOOD: &str = "127.0.0.2";
const SCRAPER: &str = "127.0.0.9";

async fn channel_from(from: IpAddr, to: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{to}"))
        .unwrap()
        .local_address(Some(from))
        .connect()
        .await
        .unwrap()
}

async fn client_from(from: IpAddr, to: SocketAddr) -> MetricsServiceClient<Channel> {
    MetricsServiceClient::new(channel_from(from, to).await)
}

async fn metrics(http: SocketAddr) -> String {
    reqwest::Client::builder()
        .local_address(ip(SCRAPER))
        .build()
        .unwrap()
        .get(format!("http://{http}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one series (`name{labels}`) on a `/metrics` page.
fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} on /metrics:\n{page}"))
        .parse()
        .unwrap()
}

fn rejections(page: &str, port: &str, reason: &str) -> f64 {
    metric(
        page,
        &format!("ai_lb_agent_port_rejections_total{{port=\"{port}\",reason=\"{reason}\"}}"),
    )
}

/// Waits until `series` on the agent's `/metrics` reaches `want`.
async fn until_metric(http: SocketAddr, series: &str, want: f64) {
    eventually(20, &format!("{series} >= {want}"), || async move {
        metric(&metrics(http).await, series) >= want
    })
    .await;
}

/// A fake pod (its `/sim/gpu` is the agent's GPU source) on 127.0.0.1:0.
async fn fake_pod() -> (SocketAddr, oneshot::Sender<()>) {
    let cli = Cli::try_parse_from(["ai-lb-fake-pod", "--pod-name", "pod-ports"]).unwrap();
    let state = AppState::new(PodConfig::from_cli(cli, None)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(serve(state, listener, async move {
        let _ = stopped.await;
    }));
    (addr, stop)
}

async fn set_gpu(pod: SocketAddr, util: f64) {
    let r = reqwest::Client::new()
        .post(format!("http://{pod}/control"))
        .body(format!(r#"{{"gpu_utilization": {util}}}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The agent binary, in its own process so its memory can be read.
struct AgentProcess {
    child: tokio::process::Child,
    grpc: SocketAddr,
    http: SocketAddr,
}

impl AgentProcess {
    async fn start(pod: SocketAddr, extra: &[&str]) -> AgentProcess {
        let sim = format!("http://{pod}");
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ai-lb-agent"))
            .args([
                "--serving-address",
                "10.0.0.1:8000",
                "--gpu-source",
                "sim",
                "--sim-url",
                &sim,
                "--grpc-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--watch-min-interval",
                "20ms",
            ])
            .args(extra)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut grpc, mut http) = (None, None);
        within(30, "the agent's LISTENING lines", async {
            while grpc.is_none() || http.is_none() {
                let line = lines.next_line().await.unwrap().expect("agent exited");
                let mut w = line.split_whitespace().skip(1);
                match (w.next(), w.next()) {
                    (Some("grpc"), Some(a)) => grpc = Some(a.parse().unwrap()),
                    (Some("http"), Some(a)) => http = Some(a.parse().unwrap()),
                    _ => {}
                }
            }
        })
        .await;
        let agent = AgentProcess {
            child,
            grpc: grpc.unwrap(),
            http: http.unwrap(),
        };
        let g = agent.grpc;
        eventually(20, "the agent's first snapshot", || async move {
            let mut c = client_from(ip(SCRAPER), g).await;
            c.snapshot(SnapshotRequest {}).await.is_ok()
        })
        .await;
        agent
    }

    /// The agent's resident memory, KiB.
    fn rss_kib(&self) -> u64 {
        let pid = self.child.id().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

fn util(s: &PodSnapshot) -> Option<f64> {
    s.gpus.first().and_then(|g| g.utilization)
}

/// Reads `stream` until a snapshot with GPU utilisation `want` arrives.
async fn until_util(stream: &mut Streaming<WatchEvent>, want: f64) {
    within(10, &format!("a snapshot with utilisation {want}"), async {
        loop {
            let ev = stream.message().await.unwrap().expect("stream ended");
            if let Some(watch_event::Event::Snapshot(s)) = ev.event {
                if util(&s) == Some(want) {
                    return;
                }
            }
        }
    })
    .await;
}

/// 1 000 `Watch` streams from one peer, over 50 connections: 32 (`--grpc-max-streams-per-peer`)
/// are served, 968 get `RESOURCE_EXHAUSTED` and are counted, the agent's memory barely moves,
/// and another peer still subscribes and gets its updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_streams_from_one_peer_get_the_cap_and_others_are_still_served() {
    let (pod, _stop) = fake_pod().await;
    let agent = AgentProcess::start(pod, &[]).await;
    let rss_before = agent.rss_kib();

    let mut channels = Vec::new();
    for _ in 0..50 {
        channels.push(channel_from(ip(BAD), agent.grpc).await);
    }
    let calls = channels.iter().flat_map(|ch| {
        (0..20).map(move |_| {
            let mut c = MetricsServiceClient::new(ch.clone());
            async move {
                c.watch(WatchRequest::default())
                    .await
                    .map(|r| r.into_inner())
            }
        })
    });
    let results = within(60, "1 000 Watch calls", futures::future::join_all(calls)).await;
    let (held, refused): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    assert_eq!(held.len(), 32, "the per-peer cap");
    for r in &refused {
        let s = r.as_ref().unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("--grpc-max-streams-per-peer"), "{s:?}");
    }
    let rss_held = agent.rss_kib();

    // Another peer is served as usual.
    let mut good = client_from(ip(GOOD), agent.grpc).await;
    let mut stream = good
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    set_gpu(pod, 0.91).await;
    until_util(&mut stream, 0.91).await;
    // And the crowded peer still gets unary answers.
    let mut bad = client_from(ip(BAD), agent.grpc).await;
    bad.snapshot(SnapshotRequest {}).await.unwrap();

    let page = metrics(agent.http).await;
    assert_eq!(rejections(&page, "grpc", "streams_per_peer"), 968.0);
    assert_eq!(rejections(&page, "grpc", "streams_total"), 0.0);
    assert_eq!(
        metric(&page, "ai_lb_agent_streams_open{rpc=\"Watch\"}"),
        33.0
    );
    eprintln!(
        "agent RSS: {rss_before} KiB before, {rss_held} KiB holding 32 streams after 1000 \
         Watch calls from one peer (+{} KiB)",
        rss_held.saturating_sub(rss_before)
    );
    assert!(
        rss_held < rss_before + 32 * 1024,
        "RSS grew from {rss_before} KiB to {rss_held} KiB"
    );

    // The places come back when the crowd leaves.
    drop(held);
    drop(channels);
    eventually(20, "the crowd's streams to close", || async move {
        metric(
            &metrics(agent.http).await,
            "ai_lb_agent_streams_open{rpc=\"Watch\"}",
        ) == 1.0
    })
    .await;
    let mut again = client_from(ip(BAD), agent.grpc).await;
    again.watch(WatchRequest::default()).await.unwrap();
}

/// Subscribers that never take an event (HTTP/2 window 0) fill their one-event queue; after
/// `--stream-send-timeout` each one's connection is closed and counted as a slow reader. The
/// agent buffers nothing for them meanwhile, and a subscriber that reads keeps getting every
/// change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_that_never_read_are_dropped_and_the_others_keep_their_updates() {
    let (pod, _stop) = fake_pod().await;
    let agent = AgentProcess::start(pod, &["--stream-send-timeout", "2s"]).await;
    let mut good = client_from(ip(GOOD), agent.grpc).await;
    let mut stream = good
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    let rss_before = agent.rss_kib();

    // 8 connections × 4 streams (the per-peer cap), heartbeats asked every 10 ms.
    let mut stalled = Vec::new();
    for _ in 0..8 {
        stalled.push(raw_h2::stalled_watches(ip(BAD), agent.grpc, 4, 10).await);
    }
    until_metric(agent.http, "ai_lb_agent_streams_open{rpc=\"Watch\"}", 33.0).await;
    for u in [0.2, 0.6, 0.95] {
        set_gpu(pod, u).await;
        until_util(&mut stream, u).await;
    }
    let rss_stalled = agent.rss_kib();

    until_metric(
        agent.http,
        "ai_lb_agent_port_rejections_total{port=\"grpc\",reason=\"slow_reader\"}",
        8.0,
    )
    .await;
    for c in &mut stalled {
        assert!(
            matches!(
                raw_h2::read_to_close(c, Duration::from_secs(10)).await,
                Ended::Closed { .. }
            ),
            "the agent closes a slow reader's connection"
        );
    }
    let page = metrics(agent.http).await;
    assert_eq!(
        rejections(&page, "grpc", "slow_reader"),
        8.0,
        "one per connection closed; the reader that reads is never dropped"
    );
    eventually(10, "the dropped streams to close", || async move {
        metric(
            &metrics(agent.http).await,
            "ai_lb_agent_streams_open{rpc=\"Watch\"}",
        ) == 1.0
    })
    .await;
    set_gpu(pod, 0.33).await;
    until_util(&mut stream, 0.33).await;
    let rss_after = agent.rss_kib();
    eprintln!(
        "agent RSS: {rss_before} KiB before, {rss_stalled} KiB with 32 stalled subscribers, \
         {rss_after} KiB after they were dropped"
    );
    assert!(
        rss_stalled < rss_before + 16 * 1024,
        "RSS grew from {rss_before} KiB to {rss_stalled} KiB"
    );
}

/// A gRPC codec that sends and receives raw bytes, to send what no generated client would.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let v = src.chunk().to_vec();
        src.advance(v.len());
        Ok(Some(v))
    }
}

/// Calls `Watch` with `body` as the request message; the status it ends with.
async fn raw_watch(addr: SocketAddr, body: Vec<u8>) -> Status {
    let mut grpc = tonic::client::Grpc::new(channel_from(ip(BAD), addr).await);
    grpc.ready().await.unwrap();
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/ai_lb.v1.MetricsService/Watch");
    match grpc
        .server_streaming(tonic::Request::new(body), path, RawCodec)
        .await
    {
        Ok(_) => panic!("the agent accepted a bad request message"),
        Err(s) => s,
    }
}

fn assert_closed(e: Ended, what: &str) {
    assert!(matches!(e, Ended::Closed { .. }), "{what}: {e:?}");
}

/// Garbage, an oversized HTTP/2 frame, an oversized and a malformed request message on the
/// gRPC port, garbage on the HTTP port: each refused, counted, and the agent still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_oversized_input_is_refused_counted_and_survived() {
    let knob = Knob::default();
    knob.set(|k| k.util = 0.4);
    let agent = start_agent(&knob).await;
    agent.hub.first_sample().await;
    let (g, h) = (agent.grpc_addr, agent.http_addr);
    let wait = Duration::from_secs(10);

    // Not HTTP/2 at all.
    let mut c = raw_h2::connect_from(ip(BAD), g).await;
    c.write_all(b"GET / HTTP/1.1\r\nHost: agent\r\n\r\n")
        .await
        .unwrap();
    assert_closed(raw_h2::read_to_close(&mut c, wait).await, "HTTP/1 on gRPC");
    let mut c = raw_h2::connect_from(ip(BAD), g).await;
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    c.write_all(&noise).await.unwrap();
    assert_closed(raw_h2::read_to_close(&mut c, wait).await, "random bytes");
    // A frame announcing 16 MiB, past the 16 KiB SETTINGS_MAX_FRAME_SIZE.
    let mut c = raw_h2::connect_from(ip(BAD), g).await;
    let mut out = raw_h2::PREFACE.to_vec();
    out.extend(raw_h2::settings(&[]));
    out.extend([0xff, 0xff, 0xff, raw_h2::DATA, 0, 0, 0, 0, 1]);
    out.extend(vec![0u8; 64 * 1024]);
    let _ = c.write_all(&out).await;
    assert_closed(raw_h2::read_to_close(&mut c, wait).await, "oversized frame");
    until_metric(
        h,
        "ai_lb_agent_port_rejections_total{port=\"grpc\",reason=\"protocol_error\"}",
        3.0,
    )
    .await;

    // A request message of 1 MiB, over --grpc-max-request-bytes (16 KiB).
    let s = raw_watch(g, vec![0u8; 1 << 20]).await;
    assert_eq!(s.code(), Code::OutOfRange, "{s:?}");
    // A request that is not a WatchRequest.
    let s = raw_watch(g, vec![0xff; 12]).await;
    assert_eq!(s.code(), Code::Internal, "{s:?}");

    // Garbage on the HTTP port.
    let mut c = raw_h2::connect_from(ip(BAD), h).await;
    c.write_all(b"\x00\x01\x02 not http at all\r\n\r\n")
        .await
        .unwrap();
    assert_closed(raw_h2::read_to_close(&mut c, wait).await, "garbage on HTTP");

    let page = metrics(h).await;
    assert_eq!(rejections(&page, "grpc", "protocol_error"), 3.0);
    assert_eq!(rejections(&page, "grpc", "message_too_large"), 1.0);
    assert_eq!(rejections(&page, "grpc", "malformed_message"), 1.0);
    assert_eq!(rejections(&page, "http", "protocol_error"), 1.0);
    // Still serving.
    let mut c = client_from(ip(GOOD), g).await;
    let s = c.snapshot(SnapshotRequest {}).await.unwrap().into_inner();
    assert_eq!(util(&s), Some(0.4));
    agent.shutdown(Duration::from_secs(5)).await;
}

async fn small_caps_agent(
    knob: &Knob,
    f: impl FnOnce(&mut ai_lb_agent::ports::PortLimits),
) -> RunningAgent {
    let mut cfg = test_config("10.0.0.1:8000", vec![]);
    f(&mut cfg.limits);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let agent = agent_support::start_on(&cfg, knob, l).await;
    agent.hub.first_sample().await;
    agent
}

/// Connections over the per-peer or the total cap are closed at once and counted, on both
/// ports; the places come back when connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_caps_hold_per_peer_and_in_total() {
    let knob = Knob::default();
    let agent = small_caps_agent(&knob, |l| {
        l.grpc_max_connections = 6;
        l.grpc_max_connections_per_peer = 4;
        // Room for the scraper's connections (another peer) besides the two held below.
        l.http_max_connections = 4;
        l.http_max_connections_per_peer = 2;
    })
    .await;
    let (g, h) = (agent.grpc_addr, agent.http_addr);

    let mut held = Vec::new();
    let mut refused = 0;
    for from in [BAD; 10].iter().chain(&[GOOD; 3]) {
        let mut c = raw_h2::connect_from(ip(from), g).await;
        if raw_h2::handshake_answered(&mut c).await {
            held.push(c);
        } else {
            refused += 1;
        }
    }
    assert_eq!(
        (held.len(), refused),
        (6, 7),
        "4 from one peer, 2 from the other"
    );
    let page = metrics(h).await;
    assert_eq!(rejections(&page, "grpc", "connections_per_peer"), 6.0);
    assert_eq!(rejections(&page, "grpc", "connections_total"), 1.0);
    assert_eq!(
        metric(&page, "ai_lb_agent_connections_open{port=\"grpc\"}"),
        6.0
    );

    // The HTTP port: 2 per peer.
    let mut http_held = Vec::new();
    let mut http_refused = 0;
    for _ in 0..3 {
        let mut c = raw_h2::connect_from(ip(BAD), h).await;
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
            .await
            .unwrap();
        let mut b = [0u8; 12];
        match tokio::io::AsyncReadExt::read(&mut c, &mut b).await {
            Ok(n) if n > 0 => http_held.push(c),
            _ => http_refused += 1,
        }
    }
    assert_eq!((http_held.len(), http_refused), (2, 1));
    assert_eq!(
        rejections(&metrics(h).await, "http", "connections_per_peer"),
        1.0
    );

    // Closing frees the places.
    held.clear();
    eventually(10, "a new connection to be served", || async move {
        let mut c = raw_h2::connect_from(ip(BAD), g).await;
        raw_h2::handshake_answered(&mut c).await
    })
    .await;
    agent.shutdown(Duration::from_secs(5)).await;
}

/// A connection that sends nothing (or only the HTTP/2 preface) is closed after
/// `--first-request-timeout`, on either port, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_first_request_timeout() {
    let knob = Knob::default();
    let agent = small_caps_agent(&knob, |l| {
        l.first_request_timeout = Duration::from_millis(300);
    })
    .await;
    let (g, h) = (agent.grpc_addr, agent.http_addr);
    let wait = Duration::from_secs(10);
    let mut silent = raw_h2::connect_from(ip(BAD), g).await;
    let mut preface_only = raw_h2::connect_from(ip(BAD), g).await;
    let mut out = raw_h2::PREFACE.to_vec();
    out.extend(raw_h2::settings(&[]));
    preface_only.write_all(&out).await.unwrap();
    let mut http_silent = raw_h2::connect_from(ip(BAD), h).await;
    assert_closed(
        raw_h2::read_to_close(&mut silent, wait).await,
        "silent gRPC",
    );
    assert_closed(
        raw_h2::read_to_close(&mut preface_only, wait).await,
        "preface only",
    );
    assert_closed(
        raw_h2::read_to_close(&mut http_silent, wait).await,
        "silent HTTP",
    );
    let page = metrics(h).await;
    assert_eq!(rejections(&page, "grpc", "first_request_timeout"), 2.0);
    assert_eq!(rejections(&page, "http", "first_request_timeout"), 1.0);
    // A connection that asks in time is served, for longer than the deadline.
    let mut c = client_from(ip(GOOD), g).await;
    let mut stream = c
        .watch(WatchRequest {
            min_interval_ms: 0,
            heartbeat_ms: 50,
        })
        .await
        .unwrap()
        .into_inner();
    within(10, "heartbeats past the deadline", async {
        for _ in 0..12 {
            stream.message().await.unwrap().expect("stream ended");
        }
    })
    .await;
    agent.shutdown(Duration::from_secs(5)).await;
}
