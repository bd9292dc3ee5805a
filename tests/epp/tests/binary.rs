//! Decides whether the `ai-lb-epp` binary behaves as its flags promise, without Envoy: bad
//! flags exit 2 naming the flag and the value; it prints its `LISTENING` lines, scrapes a pod,
//! answers an ext_proc exchange made by a tonic client (the header answer names the pod, the
//! body comes back), counts it on `/stats`, and exits 0 on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
    ProcessingRequest,
};

const BIN: &str = env!("CARGO_BIN_EXE_ai-lb-epp");

/// A one-thread HTTP server answering every request with a vLLM metrics page.
fn metrics_pod() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let page = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n\
                    # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n\
                    # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.2\n\
                    # TYPE vllm:cache_config_info gauge\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"500\"} 1\n";
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 2048];
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    addr
}

struct Running {
    child: Child,
    grpc: SocketAddr,
    admin: SocketAddr,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Running {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut grpc, mut admin) = (None, None);
    while grpc.is_none() || admin.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("no LISTENING lines within 20 s");
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            ["LISTENING", "grpc", a] => grpc = Some(a.parse().unwrap()),
            ["LISTENING", "admin", a] => admin = Some(a.parse().unwrap()),
            _ => {}
        }
    }
    Running {
        child,
        grpc: grpc.unwrap(),
        admin: admin.unwrap(),
    }
}

fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

fn stats(addr: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&get(addr, "/stats")).unwrap()
}

#[test]
fn bad_flags_exit_2_naming_the_flag_and_the_value() {
    for (args, want) in [
        (&["--pods", "not-an-address"][..], "--pods"),
        (&["--pods", "", "--refresh-ms", "0"], "--refresh-ms"),
        (&["--pods", "", "--prefix-weight", "-1"], "--prefix-weight"),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let value = args[args.len() - 1];
        assert!(err.contains(want) && err.contains(value), "{args:?}: {err}");
    }
    // Unknown flags and a missing --pods are clap's own exit 2.
    let out = Command::new(BIN).args(["--nope"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pods"));
}

#[test]
fn answers_an_ext_proc_exchange_and_stops_on_sigterm() {
    let pod = metrics_pod();
    let pods = pod.to_string();
    let mut epp = start(&[
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--pods",
        &pods,
        "--seed",
        "3",
    ]);
    // Scraped: the pod's queue is on the admin page.
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let s = stats(epp.admin);
        if s["pods"][0]["scraped"] == true {
            assert_eq!(s["pods"][0]["waiting"], 3);
            assert_eq!(s["pods"][0]["num_gpu_blocks"], 500);
            break;
        }
        assert!(Instant::now() < end, "never scraped: {s}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = br#"{"model":"m","prompt":"hello"}"#.to_vec();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answers = rt.block_on(async {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.grpc))
            .await
            .unwrap();
        let header = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        let msgs = vec![
            ProcessingRequest {
                request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                    headers: Some(HeaderMap {
                        headers: vec![
                            header(":path", "/v1/completions"),
                            header(":method", "POST"),
                        ],
                    }),
                    ..HttpHeaders::default()
                })),
                ..ProcessingRequest::default()
            },
            ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(HttpBody {
                    body: body.clone(),
                    end_of_stream: true,
                    ..HttpBody::default()
                })),
                ..ProcessingRequest::default()
            },
        ];
        let mut stream = client
            .process(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        let mut answers = Vec::new();
        while answers.len() < 2 {
            match stream.message().await.unwrap() {
                Some(a) => answers.push(a),
                None => break,
            }
        }
        answers
    });
    // The client's connection task lives on this runtime: closing it closes the connection,
    // which graceful shutdown would otherwise wait for.
    drop(rt);
    assert_eq!(answers.len(), 2, "{answers:?}");
    match &answers[0].response {
        Some(processing_response::Response::RequestHeaders(h)) => {
            let set = &h
                .response
                .as_ref()
                .unwrap()
                .header_mutation
                .as_ref()
                .unwrap()
                .set_headers;
            let dest = set[0].header.as_ref().unwrap();
            assert_eq!(dest.key, "x-gateway-destination-endpoint");
            assert_eq!(dest.raw_value, pods.as_bytes());
        }
        other => panic!("{other:?}"),
    }
    match &answers[1].response {
        Some(processing_response::Response::RequestBody(b)) => {
            match b
                .response
                .as_ref()
                .unwrap()
                .body_mutation
                .as_ref()
                .unwrap()
                .mutation
                .as_ref()
            {
                Some(body_mutation::Mutation::StreamedResponse(s)) => {
                    assert_eq!(s.body, body);
                    assert!(s.end_of_stream);
                }
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    }
    let s = stats(epp.admin);
    assert_eq!(s["pods"][0]["picks"], 1, "{s}");
    assert_eq!(s["totals"]["prefix_request_blocks"], 1, "{s}");
    assert_eq!(get(epp.admin, "/healthz"), "ok");
    // SIGTERM: exit 0.
    let st = Command::new("kill")
        .args(["-TERM", &epp.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let end = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(st) = epp.child.try_wait().unwrap() {
            break st.code();
        }
        assert!(Instant::now() < end, "still running 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0));
}
