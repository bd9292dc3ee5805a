//! Decides whether degrade-before-OOM (`preOom`, issue 30 part 2) works with real parts on
//! both data paths: fake pods, real agents reading the pods' simulated GPU memory (the sim
//! source, with the agent's default watermark: 92 %, 800 MB/s, 3 intervals of 500 ms, a 15 s
//! countdown) and a real Envoy with the wasm filter or the native module.
//!
//! Pod 0 gets the fake pod's `memory_growth` fault: its memory grows 1 GB/s for each running
//! sequence over four (and falls as fast for each under), so under an even share of 12
//! concurrent clients (about 5 running) it grows about 1.2 GB/s and would reach its total (an
//! OOM crash: every request in flight fails) in about 7 s. With the degrade on it is cut at
//! about 4 GB past its preallocation (of 8.6), its share comes back over `recoverMs`, and the
//! cycle repeats without a crash (set `PRE_OOM_TRACE=1` to print pod 0's memory and cut). With `preOom` on (the default) the agent reports the pre-OOM state, the filter cuts
//! the pod before its projected OOM, its load and memory fall, and no request is lost. With
//! `preOom: {enabled: false}` the same load crashes it with requests in flight.

mod filter_common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy)]
enum Path {
    Wasm,
    Native,
}

impl Path {
    fn start(self, pool: &PodPool, filter: &str) -> Envoy {
        let mut o = match self {
            Path::Wasm => EnvoyOptions::new(filter.to_string()),
            Path::Native => {
                let mut o = EnvoyOptions::new(
                    envoy::native_filter_config(filter, &pool.agent_addrs).unwrap(),
                );
                o.template = Some(envoy::native_template().unwrap());
                o
            }
        };
        o.inference = pool.pod_addrs.clone();
        o.agents = pool.agent_addrs.clone();
        Envoy::start(&o).unwrap()
    }

    fn stat(self, envoy: &Envoy, name: &str) -> u64 {
        let prefix = match self {
            Path::Wasm => "wasmcustom.",
            Path::Native => "dynamicmodulescustom.",
        };
        envoy.stat(&format!("{prefix}{name}")).unwrap_or(0)
    }
}

const GROWTH: &str =
    r#"{"memory_growth":{"bytes_per_s_per_seq":1e9,"sustained_seqs":4,"restart_ms":3000}}"#;

/// Pod `i`'s `GET /control` body.
fn control(pool: &PodPool, i: usize) -> Value {
    let r = HttpClient::new(pool.pod_addrs[i])
        .get("/control", &[("connection", "close")])
        .unwrap();
    serde_json::from_slice(&r.body).unwrap()
}

/// What a load run saw.
#[derive(Debug)]
struct Run {
    ok: u64,
    failed: u64,
    crashes: u64,
    failed_in_flight: u64,
}

/// Keeps 12 requests of 64 tokens in flight through Envoy for `secs`, then reads pod 0's OOM
/// state.
fn load(envoy: &Envoy, pool: &PodPool, secs: u64) -> Run {
    let ok = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let end = Instant::now() + Duration::from_secs(secs);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        if std::env::var_os("PRE_OOM_TRACE").is_some() {
            s.spawn(|| {
                while Instant::now() < end {
                    let c = control(pool, 0);
                    let row = row(&scoreboard(envoy), &pool.pod_addrs[0].to_string());
                    eprintln!(
                        "{:>6} ms extra {:.2} GB crashes {} | cut {} score {}",
                        t0.elapsed().as_millis(),
                        c["oom"]["extra_bytes"].as_f64().unwrap_or(0.0) / 1e9,
                        c["oom"]["crashes"],
                        row.as_ref().map_or(Value::Null, |r| r["cut"].clone()),
                        row.as_ref().map_or(Value::Null, |r| r["score"].clone()),
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
            });
        }
        for _ in 0..12 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    let r = HttpClient::new(envoy.listener).post_json(
                        "/v1/completions",
                        &[("connection", "close")],
                        r#"{"prompt":"hello there","max_tokens":64}"#,
                    );
                    match r {
                        Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
    });
    stop.store(true, Ordering::Relaxed);
    let c = control(pool, 0);
    Run {
        ok: ok.into_inner(),
        failed: failed.into_inner(),
        crashes: c["oom"]["crashes"].as_u64().unwrap_or(0),
        failed_in_flight: c["oom"]["failed_in_flight"].as_u64().unwrap_or(0),
    }
}

fn start(path: Path, pre_oom: Value) -> (PodPool, Envoy) {
    let pool = PodPool::start(2, 1.0).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, GROWTH).unwrap();
    // No retries and no breaker in the way: what the crash fails reaches the client, and the
    // only thing that keeps requests off pod 0 is preOom.
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 10000, "failureRate": 1.0, "agentErrorRate": 0},
        "preOom": pre_oom,
    }));
    let envoy = path.start(&pool, &filter);
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    (pool, envoy)
}

#[test]
fn a_pod_counting_down_to_oom_is_cut_before_it_and_loses_nothing() {
    for path in [Path::Wasm, Path::Native] {
        let (pool, envoy) = start(path, json!({}));
        let run = load(&envoy, &pool, 20);
        let cut = path.stat(&envoy, "ailb.pre_oom.cut");
        assert!(
            path.stat(&envoy, "ailb.pre_oom.degraded") >= 1 && cut >= 1,
            "{path:?}: the pod was never counted down and cut: {run:?}\nstatus: {}\nlog:\n{}",
            scoreboard(&envoy),
            envoy.log_tail(30)
        );
        assert_eq!(
            (run.crashes, run.failed_in_flight, run.failed),
            (0, 0, 0),
            "{path:?}: the pod crashed or requests failed with preOom on: {run:?}"
        );
        assert!(
            run.ok > 100,
            "{path:?}: too little load to mean much: {run:?}"
        );
    }
}

#[test]
fn with_pre_oom_off_the_same_load_crashes_the_pod_with_requests_in_flight() {
    let (pool, envoy) = start(Path::Wasm, json!({"enabled": false}));
    let run = load(&envoy, &pool, 15);
    assert!(
        run.crashes >= 1 && run.failed_in_flight >= 1 && run.failed >= 1,
        "the growth fault did not crash the pod with requests in flight: {run:?}"
    );
    assert_eq!(Path::Wasm.stat(&envoy, "ailb.pre_oom.cut"), 0);
}
