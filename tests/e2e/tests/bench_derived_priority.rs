//! Measures (ignored by default; a benchmark, not a check) what `admission.derivedPriority`
//! changes at overload with no priority header, through a real Envoy (wasm filter) in front of
//! two fake pods with 4 seats each: the same seeded open-loop trace is sent twice, with the
//! derived priority off then on. 20 % of the requests are "important" by the formula
//! (a ~2,100-token prompt, `max_tokens` 256, temperature 0: Ultra) and 80 % are "batch" (a
//! 200-token prompt, `max_tokens` 256, temperature 1: Standard). Both runs also have
//! `admission.latencyAwareQuota` on, so its counters give the table of how costs scaled.
//!
//! Writes `summary.json`, `table.md` and `requests.csv` under `$DERIVED_BENCH_OUT` (default
//! `bench-results/derived-priority`). Knobs: `DERIVED_BENCH_SECS` (default 40), `DERIVED_BENCH_RPS`
//! (default 5). Run:
//!   ENVOY_BIN=... REQUIRE_ENVOY=1 cargo test -p ai-lb-e2e --test bench_derived_priority -- --ignored --nocapture

mod filter_common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, PodPool};
use filter_common::*;
use serde_json::{json, Value};

const SEATS: &str = "4";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Important,
    Batch,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Important => "important",
            Kind::Batch => "batch",
        }
    }

    fn body(self) -> String {
        let (tokens, temperature) = match self {
            Kind::Important => (2_100, 0.0),
            Kind::Batch => (200, 1.0),
        };
        json!({
            "prompt": "abc ".repeat(tokens),
            "max_tokens": 256,
            "temperature": temperature,
            "stream": true,
            "stream_options": {"include_usage": true}
        })
        .to_string()
    }
}

/// One request's outcome as the client saw it.
#[derive(Debug, Clone)]
struct Rec {
    kind: Kind,
    at_ms: u64,
    status: u16,
    ttft_ms: Option<f64>,
    e2e_ms: f64,
}

/// A small xorshift for the seeded trace (no dependency, same trace for both runs).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The seeded trace: (send offset ms, kind), Poisson arrivals at `rps`.
fn trace(secs: u64, rps: f64) -> Vec<(u64, Kind)> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        t += -(1.0 - rng.next()).ln() / rps * 1000.0;
        if t >= (secs * 1000) as f64 {
            return out;
        }
        let kind = if rng.next() < 0.2 {
            Kind::Important
        } else {
            Kind::Batch
        };
        out.push((t as u64, kind));
    }
}

/// Sends one streamed completion over a raw connection: its status, the time to the first SSE
/// `data:` event (TTFT) and to the end of the answer.
fn send(addr: SocketAddr, body: &str) -> (u16, Option<f64>, f64) {
    let t = Instant::now();
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, None, 0.0);
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_err() {
        return (0, None, 0.0);
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut ttft = None;
    let mut head_end = None;
    loop {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if head_end.is_none() {
            head_end = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
        }
        if let (None, Some(h)) = (ttft, head_end) {
            if buf[h..].windows(6).any(|w| w == b"data: ") {
                ttft = Some(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    let status = std::str::from_utf8(&buf[..buf.len().min(12)])
        .ok()
        .and_then(|l| l.get(9..12))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, ttft, t.elapsed().as_secs_f64() * 1000.0)
}

fn run(pool: &PodPool, derived: bool, plan: &[(u64, Kind)]) -> (Vec<Rec>, Value) {
    let mut admission = json!({
        "tenants": {"default": {"tokensPerSecond": 100000000, "burst": 100000000}},
        "saturation": {"softThreshold": 0.85, "maxWaitStandardMs": 2000, "maxHeld": 256},
        "latencyAwareQuota": {"sloMs": 4000}
    });
    if derived {
        // The weights and thresholds; the log scale and the output normalisation sized
        // to this trace (a 2,048-token prompt and 256 output tokens count as "full").
        admission["derivedPriority"] = json!({"promptTokensMax": 2048, "outputTokensFull": 256});
    }
    let filter = config(json!({
        // Scored on the model servers' queues alone, a queue of 2 counting as full: the pool is
        // saturated once every pod has requests waiting, and the sidecar holds instead.
        "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents",
                   "weights": {"queue": 1.0}}],
        "cutoffs": {"stalenessMs": 5000, "maxQueue": 2},
        "admission": admission
    }));
    let envoy: Envoy = envoy_for(pool, filter);
    wait_scoreboard(&envoy, "fresh metrics", 30, |sb| all_fresh(sb, pool));
    let addr = envoy.listener;
    let start = Instant::now();
    let mut handles = Vec::new();
    for &(at, kind) in plan {
        let due = Duration::from_millis(at);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        handles.push(std::thread::spawn(move || {
            let (status, ttft_ms, e2e_ms) = send(addr, &kind.body());
            Rec {
                kind,
                at_ms: at,
                status,
                ttft_ms,
                e2e_ms,
            }
        }));
    }
    let recs: Vec<Rec> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
    // Let the last settlements land.
    std::thread::sleep(Duration::from_millis(500));
    let stats = envoy.stats().unwrap();
    let adm: serde_json::Map<String, Value> = stats
        .iter()
        .filter(|(k, _)| k.starts_with("wasmcustom.ailb.admission."))
        .map(|(k, v)| (k.trim_start_matches("wasmcustom.").to_string(), json!(v)))
        .collect();
    (recs, Value::Object(adm))
}

fn pct(mut v: Vec<f64>, p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v.get(i).copied()
}

fn summarise(recs: &[Rec], kind: Kind) -> Value {
    let of: Vec<&Rec> = recs.iter().filter(|r| r.kind == kind).collect();
    let ok: Vec<&&Rec> = of.iter().filter(|r| r.status == 200).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    let n = of.len().max(1) as f64;
    let count = |s: u16| of.iter().filter(|r| r.status == s).count();
    json!({
        "requests": of.len(),
        "ok": ok.len(),
        "503": count(503),
        "429": count(429),
        "other": of.len() - ok.len() - count(503) - count(429),
        "share_503": count(503) as f64 / n,
        "ttft_p50_ms": pct(ttft.clone(), 50.0),
        "ttft_p99_ms": pct(ttft, 99.0),
        "e2e_p50_ms": pct(e2e.clone(), 50.0),
        "e2e_p99_ms": pct(e2e, 99.0),
    })
}

fn f(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.0}"))
}

fn ratio(on: &Value, off: &Value) -> String {
    match (on.as_f64(), off.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "–".into(),
    }
}

#[test]
#[ignore = "a benchmark: run with --ignored"]
fn derived_priority_at_overload_off_vs_on() {
    let secs: u64 = std::env::var("DERIVED_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let rps: f64 = std::env::var("DERIVED_BENCH_RPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5.0);
    let out = std::path::PathBuf::from(
        std::env::var("DERIVED_BENCH_OUT")
            .unwrap_or_else(|_| "bench-results/derived-priority".into()),
    );
    let out = if out.is_absolute() {
        out
    } else {
        ai_lb_e2e::envoy::workspace_root().join(out)
    };
    std::fs::create_dir_all(&out).unwrap();
    let plan = trace(secs, rps);
    let mut runs = serde_json::Map::new();
    let mut csv = String::from("run,kind,at_ms,status,ttft_ms,e2e_ms\n");
    for (name, derived) in [("off", false), ("on", true)] {
        // A fresh pool per run: no queue or KV state carried over.
        let pool = PodPool::start_with(2, 1.0, |_| {
            vec!["--max-num-seqs".to_string(), SEATS.to_string()]
        })
        .unwrap();
        eprintln!(
            "== derivedPriority {name}: {} requests over {secs} s",
            plan.len()
        );
        let (recs, adm) = run(&pool, derived, &plan);
        for r in &recs {
            csv.push_str(&format!(
                "{name},{},{},{},{},{:.1}\n",
                r.kind.name(),
                r.at_ms,
                r.status,
                r.ttft_ms.map_or(String::new(), |t| format!("{t:.1}")),
                r.e2e_ms
            ));
        }
        runs.insert(
            name.into(),
            json!({
                "important": summarise(&recs, Kind::Important),
                "batch": summarise(&recs, Kind::Batch),
                "filter": adm,
            }),
        );
    }
    let summary = json!({
        "secs": secs, "rps": rps, "requests": plan.len(),
        "pods": 2, "seats_per_pod": SEATS, "runs": runs,
        "machine": "2 shared cores (other sessions building at the same time)",
    });
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary).unwrap(),
    )
    .unwrap();
    std::fs::write(out.join("requests.csv"), csv).unwrap();

    let r = &summary["runs"];
    let mut t = String::from(
        "| requests | metric | derived off | derived on | on / off |\n|---|---|---|---|---|\n",
    );
    for k in ["important", "batch"] {
        for m in ["ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms", "503", "ok"] {
            let (a, b) = (&r["off"][k][m], &r["on"][k][m]);
            t.push_str(&format!(
                "| {k} | {m} | {} | {} | {} |\n",
                f(a),
                f(b),
                ratio(b, a)
            ));
        }
    }
    t.push_str("\n| filter counter | derived off | derived on |\n|---|---|---|\n");
    let names = [
        "ailb.admission.derived.ultra",
        "ailb.admission.derived.high",
        "ailb.admission.derived.standard",
        "ailb.admission.derived.deadline_proceed",
        "ailb.admission.held",
        "ailb.admission.held_released",
        "ailb.admission.held_expired",
        "ailb.admission.tenant.default.critical.admitted",
        "ailb.admission.tenant.default.critical.held",
        "ailb.admission.tenant.default.standard.admitted",
        "ailb.admission.tenant.default.standard.held",
        "ailb.admission.tenant.default.standard.held_rejected",
        "ailb.admission.quota.scaled_up",
        "ailb.admission.quota.scaled_down",
        "ailb.admission.quota.unchanged",
        "ailb.admission.quota.clamped_min",
        "ailb.admission.quota.clamped_max",
        "ailb.admission.quota.no_prediction",
        "ailb.admission.quota.tokens_base",
        "ailb.admission.quota.tokens_quota",
        "ailb.admission.tokens_actual",
    ];
    for n in names {
        let c = |run: &str| r[run]["filter"][n].as_u64().unwrap_or(0);
        t.push_str(&format!("| `{n}` | {} | {} |\n", c("off"), c("on")));
    }
    std::fs::write(out.join("table.md"), &t).unwrap();
    eprintln!("{t}");
}
