//! The `ai-lb-loadgen` binary: bad flags exit 2 naming flag and value; a seeded trace written
//! twice is byte-identical; a replayed trace produces the --json and --records files.

use std::process::Command;

use axum::body::Body;
use axum::http::Response;
use axum::routing::post;
use axum::Router;

const BIN: &str = env!("CARGO_BIN_EXE_ai-lb-loadgen");

fn fails_with_2(args: &[&str], must_mention: &[&str]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    for m in must_mention {
        assert!(err.contains(m), "{args:?}: stderr lacks {m:?}: {err}");
    }
}

#[test]
fn invalid_values_exit_2_naming_flag_and_value() {
    fails_with_2(&["--rate", "-1"], &["--rate", "-1"]);
    fails_with_2(&["--rate", "lots"], &["--rate", "lots"]);
    fails_with_2(&["--arrival", "uniform"], &["--arrival", "uniform"]);
    fails_with_2(&["--workload", "chat"], &["--workload", "chat"]);
    fails_with_2(&["--duration", "0s"], &["--duration", "0s"]);
    fails_with_2(&["--header", "no-colon"], &["--header", "no-colon"]);
    fails_with_2(&["--url", "https://x"], &["--url", "https://x"]);
    fails_with_2(
        &["--prompt-min", "0", "--dry-run"],
        &["--prompt-min", "'0'"],
    );
    fails_with_2(
        &["--prompt-sigma", "-2", "--dry-run"],
        &["--prompt-sigma", "'-2'"],
    );
    fails_with_2(
        &[
            "--workload",
            "hol",
            "--hol-at",
            "20s",
            "--duration",
            "10s",
            "--dry-run",
        ],
        &["--hol-at", "20000ms"],
    );
    fails_with_2(
        &[
            "--workload",
            "shared-prefix",
            "--question-min",
            "4",
            "--dry-run",
        ],
        &["--question-min", "'4'"],
    );
    fails_with_2(&["--turns", "0"], &["--turns", "0"]);
    fails_with_2(
        &[
            "--workload",
            "multi-turn",
            "--think-sigma",
            "9",
            "--dry-run",
        ],
        &["--think-sigma", "'9'"],
    );
    fails_with_2(
        &["--workload", "shared-prefix", "--groups", "0", "--dry-run"],
        &["--groups", "'0'"],
    );
    fails_with_2(
        &["--trace-in", "/nonexistent/trace.jsonl"],
        &["--trace-in", "/nonexistent/trace.jsonl"],
    );
}

#[test]
fn seeded_trace_files_are_identical() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, seed: &str| {
        let p = dir.path().join(name);
        let out = Command::new(BIN)
            .args([
                "--dry-run",
                "--workload",
                "hol",
                "--arrival",
                "gamma",
                "--cv",
                "3",
                "--rate",
                "200",
                "--duration",
                "10s",
                "--seed",
                seed,
                "--trace-out",
            ])
            .arg(&p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(p).unwrap()
    };
    let a = write("a.jsonl", "9");
    let b = write("b.jsonl", "9");
    let c = write("c.jsonl", "10");
    assert!(!a.is_empty());
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(String::from_utf8_lossy(&a).contains("\"tag\":\"long\""));
    assert!(
        !String::from_utf8_lossy(&a).contains("group"),
        "older workloads keep their line format"
    );
}

#[test]
fn seeded_chat_traces_are_identical_and_replayable() {
    let dir = tempfile::tempdir().unwrap();
    for workload in ["shared-prefix", "multi-turn"] {
        let write = |name: &str| {
            let p = dir.path().join(format!("{workload}-{name}"));
            let out = Command::new(BIN)
                .args([
                    "--dry-run",
                    "--workload",
                    workload,
                    "--rate",
                    "50",
                    "--duration",
                    "5s",
                    "--seed",
                    "3",
                    "--trace-out",
                ])
                .arg(&p)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            (p.clone(), std::fs::read(p).unwrap())
        };
        let (pa, a) = write("a");
        let (_, b) = write("b");
        assert_eq!(a, b, "{workload}");
        let back = Command::new(BIN)
            .args(["--dry-run", "--trace-in"])
            .arg(&pa)
            .output()
            .unwrap();
        assert!(
            back.status.success(),
            "{}",
            String::from_utf8_lossy(&back.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_trace_writes_json_and_records() {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            Response::builder()
                .header("content-type", "text/event-stream")
                .header("x-fake-pod", "only-pod")
                .body(Body::from(
                    "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n\
                     data: {\"choices\":[],\"usage\":{\"completion_tokens\":4}}\n\ndata: [DONE]\n\n",
                ))
                .unwrap()
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let json = dir.path().join("s.json");
    let records = dir.path().join("r.jsonl");
    let gen = tokio::process::Command::new(BIN)
        .args([
            "--dry-run",
            "--rate",
            "100",
            "--requests",
            "30",
            "--trace-out",
        ])
        .arg(&trace)
        .output()
        .await
        .unwrap();
    assert!(gen.status.success());
    let out = tokio::process::Command::new(BIN)
        .args(["--url", &url, "--timeout", "10s", "--trace-in"])
        .arg(&trace)
        .arg("--json")
        .arg(&json)
        .arg("--records")
        .arg(&records)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("only-pod 100.0% (30)"), "{stdout}");

    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(s["counts"]["ok"], 30);
    assert_eq!(s["output_tokens"], 120);
    assert_eq!(s["pod_share"]["only-pod"]["share"], 1.0);
    assert!(s["ttft_ms"]["p99"].is_number() && s["e2e_ms"]["p50"].is_number());
    assert_eq!(s["by_tag"]["short"]["counts"]["sent"], 30);
    let lines = std::fs::read_to_string(&records).unwrap();
    assert_eq!(lines.lines().count(), 30);
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["pod"], "only-pod");
    assert_eq!(first["outcome"], "ok");
}
