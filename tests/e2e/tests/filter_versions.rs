//! Decides whether model-version routing and per-version breaker domains (`versions`, issue 30
//! part 3) work in a real Envoy on both data paths, with real agents reporting each pod's
//! version (`--model-version`) and real fake pods: `x-model-version` pins a request to its
//! version's pods, a version no pod serves is answered 503 with `x-ai-lb-version-rejected`,
//! unpinned requests split by weight; the canary pod made to fail (the fake pod's `error_rate`
//! fault) opens its version's domain, its traffic moves to stable, pinned canary requests get
//! a 503 naming the open domain, and stable's pods keep their breakers closed. The thresholds'
//! exact boundaries (20 failures, 30 %, 30 s, 100 half-open requests) are checked in the core's
//! tests/version_domains.rs; here the domain opens on a smaller `minFailures` to keep it short.

mod filter_common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

/// Pods 0-2 serve stable `v1`, pod 3 the canary `v2`.
const VERSIONS: [&str; 4] = ["v1", "v1", "v1", "v2"];

/// A small completion (pinned to `version` when given): its status, serving pod and the
/// rejection header.
fn send(envoy: &Envoy, version: Option<&str>) -> (u16, String, Option<String>) {
    let mut headers = vec![("connection", "close")];
    if let Some(v) = version {
        headers.push(("x-model-version", v));
    }
    let r = HttpClient::new(envoy.listener)
        .post_json(
            "/v1/completions",
            &headers,
            r#"{"prompt":"hello there","max_tokens":4}"#,
        )
        .unwrap();
    (
        r.status,
        r.header("x-fake-pod").unwrap_or("none").to_string(),
        r.header("x-ai-lb-version-rejected").map(str::to_string),
    )
}

/// The pool's `modelVersions` row of `version` on the status page.
fn version_row(envoy: &Envoy, version: &str) -> Option<Value> {
    scoreboard(envoy)["pools"][0]["modelVersions"]
        .as_array()?
        .iter()
        .find(|r| r["version"] == version)
        .cloned()
}

/// The per-version stat `metric` of `version` as `/stats` names it on `path`.
fn version_stat(path: Path, envoy: &Envoy, version: &str, metric: &str) -> u64 {
    let name = match path {
        Path::Wasm => format!("wasmcustom.ailb.version.{version}.{metric}"),
        Path::Native => {
            format!("dynamicmodulescustom.ailb.version.{metric}.ailb_version.{version}")
        }
    };
    envoy.stat(&name).unwrap_or(0)
}

fn versions_on(path: Path) {
    let pool = PodPool::start_with_agents(
        4,
        0.01,
        |_| Vec::new(),
        |i| vec!["--model-version".into(), VERSIONS[i].into()],
    )
    .unwrap();
    for i in 0..4 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    // Pod breakers out of the way (the domain is what this test watches): no consecutive or
    // rate trip, no agent-rate trip.
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 1000, "failureRate": 1.0,
                    "failureRateMinRequests": 100000, "agentErrorRate": 0.0},
        "versions": {
            "weights": {"v1": 95, "v2": 5},
            "domains": {"default": {"minFailures": 5, "openMs": 60000}}
        }
    }));
    let mut opts = path.opts(&pool, &filter, &pool.agent_addrs);
    // One worker: the domains are per worker, so one sees every outcome.
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    envoy
        .poll(Duration::from_secs(10), "versions reported", || {
            let v1 = version_row(&envoy, "v1")?;
            let v2 = version_row(&envoy, "v2")?;
            (v1["pods"] == 3 && v2["pods"] == 1).then_some(())
        })
        .unwrap_or_else(|e| panic!("{path:?}: {e}: {}", scoreboard(&envoy)));

    // Pinned: only the version's pods serve.
    let mut canary_pods = BTreeSet::new();
    let mut stable_pods = BTreeSet::new();
    for _ in 0..20 {
        let (s, pod, _) = send(&envoy, Some("v2"));
        assert_eq!(s, 200, "{path:?}: pinned v2");
        canary_pods.insert(pod);
        let (s, pod, _) = send(&envoy, Some("v1"));
        assert_eq!(s, 200, "{path:?}: pinned v1");
        stable_pods.insert(pod);
    }
    assert_eq!(
        canary_pods,
        BTreeSet::from([pool.names[3].clone()]),
        "{path:?}"
    );
    assert!(
        !stable_pods.contains(&pool.names[3]),
        "{path:?}: {stable_pods:?}"
    );

    // A version no pod serves: 503 naming it, never routed elsewhere.
    let (s, pod, rejected) = send(&envoy, Some("v9"));
    assert_eq!(
        (s, pod.as_str(), rejected.as_deref()),
        (503, "none", Some("v9; no_available_pod")),
        "{path:?}"
    );

    // Unpinned: split 95/5 (some canary picks in 400 requests: P(none) = 0.95^400 ~ 1e-9).
    let mut canary = 0;
    for _ in 0..400 {
        let (s, pod, _) = send(&envoy, None);
        assert_eq!(s, 200, "{path:?}: unpinned");
        canary += usize::from(pod == pool.names[3]);
    }
    assert!(
        (1..=60).contains(&canary),
        "{path:?}: canary served {canary} of 400"
    );

    // The canary fails every request: pinned traffic opens its domain.
    pool.control(3, r#"{"error_rate":1.0}"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let opened_at = loop {
        let (s, _, rejected) = send(&envoy, Some("v2"));
        if s == 503 && rejected.as_deref() == Some("v2; domain_open") {
            break Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "{path:?}: v2's domain did not open; {}",
            scoreboard(&envoy)
        );
    };
    let _ = opened_at;
    let v2 = version_row(&envoy, "v2").unwrap();
    assert_eq!(v2["domain"], "open", "{path:?}: {v2}");
    assert_eq!(version_row(&envoy, "v1").unwrap()["domain"], "closed");

    // Its traffic moves to stable: every unpinned request is served by a v1 pod, 200.
    for _ in 0..200 {
        let (s, pod, _) = send(&envoy, None);
        assert_eq!(s, 200, "{path:?}: unpinned after the canary tripped");
        assert_ne!(pod, pool.names[3], "{path:?}: canary still served");
    }
    // Stable's pods' breakers are untouched.
    let sb = scoreboard(&envoy);
    for i in 0..3 {
        let r = row(&sb, &pool.pod_addrs[i].to_string()).unwrap();
        assert_eq!(r["breaker"], "closed", "{path:?}: pod{i}: {r}");
    }

    // The stats, with the version as a label (wasm: in the name), once exported. The native
    // module adds a worker's counts at most once a second, when it handles a request: the
    // poll keeps one coming, or the last second's (the domain's opening) waits for traffic.
    envoy
        .poll(Duration::from_secs(5), "per-version stats", || {
            let _ = send(&envoy, None);
            (version_stat(path, &envoy, "v2", "domain_opened") >= 1
                && version_stat(path, &envoy, "v2", "rejected_open") >= 1
                && version_stat(path, &envoy, "v2", "domain_state") == 2
                && version_stat(path, &envoy, "v1", "picks") >= 400
                && version_stat(path, &envoy, "v2", "pinned") >= 20
                && version_stat(path, &envoy, "v2", "failures") >= 5)
                .then_some(())
        })
        .unwrap_or_else(|e| panic!("{path:?}: {e}: {}", decision_stats(&envoy)));
    assert_eq!(path.stat(&envoy, "ailb.versions.rejected_unknown"), 1);
}

#[test]
fn versions_pin_split_and_trip_their_domain() {
    for path in BOTH {
        versions_on(path);
    }
}
