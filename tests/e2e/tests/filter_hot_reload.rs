//! Decides whether a plugin config change reaches a running Envoy without losing a request,
//! on both data paths (the wasm filter and the native module): Envoy reads its listener from
//! an LDS file and the pods from EDS files (`ai_lb_e2e::xds_files`), a client sends requests
//! all along, each on a fresh connection (so no client retry can hide a failure), and:
//! - a new config (its status page moved from `/ai-lb/status-a` to `/ai-lb/status-b`) is
//!   accepted through LDS and takes effect: the new path answers the filter's scoreboard, the
//!   old one reaches the pod, and requests are steered by score again under the new config;
//! - a config the filter refuses (an unknown field) is rejected by Envoy
//!   (`listener_manager.lds.update_rejected`) and the accepted one keeps serving;
//! - every request sent meanwhile was answered 200 by a pod.

mod filter_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use ai_lb_e2e::envoy::{self, HttpClient, PodPool};
use ai_lb_e2e::require::or_skip;
use ai_lb_e2e::xds_files::{Applied, XdsEnvoy};
use filter_common::{config, Path, BOTH};
use serde_json::{json, Value};

/// The plugin config with its status page at `path`.
fn filter_with_status(path: &str) -> String {
    config(json!({"statusPath": path}))
}

/// GET `path` on a fresh connection: (status, body as JSON if it is).
fn get(x: &XdsEnvoy, path: &str) -> (u16, Option<Value>) {
    let r = HttpClient::new(x.envoy.listener)
        .get(path, &[("connection", "close")])
        .unwrap();
    (r.status, serde_json::from_slice(&r.body).ok())
}

/// True when `path` answers the filter's scoreboard (a JSON document with `pools`).
fn scoreboard_at(x: &XdsEnvoy, path: &str) -> bool {
    let (status, v) = get(x, path);
    status == 200 && v.is_some_and(|v| v.get("pools").is_some())
}

/// Requests on fresh connections until stopped: (answered 200 by a pod, every other outcome).
fn traffic(x: &XdsEnvoy, stop: Arc<AtomicBool>) -> thread::JoinHandle<(u64, Vec<String>)> {
    let addr = x.envoy.listener;
    thread::spawn(move || {
        let (mut ok, mut failed) = (0u64, Vec::new());
        while !stop.load(Ordering::Relaxed) {
            let r = HttpClient::new(addr)
                .with_timeout(Duration::from_secs(10))
                .post_json(
                    "/v1/completions",
                    &[("connection", "close")],
                    r#"{"prompt":"hello there","max_tokens":4}"#,
                );
            match r {
                Ok(r) if r.status == 200 && r.header("x-fake-pod").is_some() => ok += 1,
                Ok(r) => failed.push(format!("{} {}", r.status, r.text())),
                Err(e) => failed.push(e),
            }
        }
        (ok, failed)
    })
}

#[test]
fn a_config_change_through_lds_takes_effect_without_losing_a_request_on_both_paths() {
    let test = "a_config_change_through_lds_takes_effect_without_losing_a_request_on_both_paths";
    if or_skip(test, "the wasm filter", envoy::wasm_path()).is_none()
        || or_skip(test, "the native module", envoy::native_module_path()).is_none()
    {
        return;
    }
    for path in BOTH {
        eprintln!("== {path:?}");
        hot_reload_on(path);
    }
}

fn hot_reload_on(path: Path) {
    let pool = PodPool::start(2, 0.01).unwrap();
    let a = filter_with_status("/ai-lb/status-a");
    let b = filter_with_status("/ai-lb/status-b");
    // Longer than any request here: a replaced listener closes its connections when its
    // drain ends, with whatever is in flight on them.
    let drain = ["--drain-time-s".to_string(), "10".to_string()];
    let mut x = XdsEnvoy::start(&path.opts(&pool, &a, &pool.agent_addrs), &drain).unwrap();
    let steered = format!("{}ailb.steered", path.prefix());
    let envoy_poll = |x: &XdsEnvoy, what: &str, f: &mut dyn FnMut() -> bool| {
        x.envoy
            .poll(Duration::from_secs(30), what, || f().then_some(()))
            .unwrap();
    };
    envoy_poll(&x, "config A's status page", &mut || {
        scoreboard_at(&x, "/ai-lb/status-a")
    });

    let stop = Arc::new(AtomicBool::new(false));
    let client = traffic(&x, stop.clone());
    envoy_poll(&x, "requests steered under config A", &mut || {
        x.envoy.stat(&steered).unwrap_or(0) >= 10
    });

    // Config B through LDS.
    assert_eq!(
        x.set_filter_config(&path.carried(&b, &pool.agent_addrs))
            .unwrap(),
        Applied::Accepted,
        "config B: {}",
        x.envoy.log_tail(30)
    );
    envoy_poll(&x, "config B's status page", &mut || {
        scoreboard_at(&x, "/ai-lb/status-b")
    });
    // Config A's path is an ordinary request now: the pod answers it (404: no such route).
    let (status, _) = get(&x, "/ai-lb/status-a");
    assert_eq!(status, 404, "config A's status path after the reload");
    let at_b = x.envoy.stat(&steered).unwrap();
    envoy_poll(&x, "requests steered under config B", &mut || {
        x.envoy.stat(&steered).unwrap_or(0) >= at_b + 20
    });

    // A config the filter refuses: Envoy rejects the listener and B keeps serving.
    let mut bad: Value = serde_json::from_str(&b).unwrap();
    bad["noSuchField"] = json!(1);
    let (_, rejected_before) = x.lds_counts().unwrap();
    assert_eq!(
        x.set_filter_config(&path.carried(&bad.to_string(), &pool.agent_addrs))
            .unwrap(),
        Applied::Rejected,
        "a config with an unknown field was accepted"
    );
    assert_eq!(x.lds_counts().unwrap().1, rejected_before + 1);
    // The log is flushed every 200 ms.
    envoy_poll(&x, "a log line naming the refused field", &mut || {
        x.envoy.log().contains("noSuchField")
    });
    assert!(
        scoreboard_at(&x, "/ai-lb/status-b"),
        "config B stopped serving"
    );
    let at_bad = x.envoy.stat(&steered).unwrap();
    envoy_poll(&x, "requests still steered after the refusal", &mut || {
        x.envoy.stat(&steered).unwrap_or(0) >= at_bad + 20
    });

    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = client.join().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across the reloads: {:?}",
        failed.len(),
        ok + failed.len() as u64,
        &failed[..failed.len().min(5)]
    );
    assert!(ok >= 50, "only {ok} requests answered");
    assert!(!x.envoy.wasm_failed(), "{}", x.envoy.log_tail(40));
}
