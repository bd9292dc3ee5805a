//! Decides whether `breaker.syntheticProbe` (issue 30, part 3) works in a real Envoy on both
//! data paths: of three real fake pods, pod0 answers every request with a 500 and its breaker
//! opens. While it keeps failing, client requests never reach it (its picks stay put) and the
//! filter's own probes, steered to it through `override_host`, keep failing, so it never
//! closes: a probe answered by another pod would pass and close it. Once it heals, its probes
//! pass and it closes with no client request at all.

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

fn probes_judge_the_half_open_pod_on(path: Path) {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 2, "failureRate": 1.0, "agentErrorRate": 0,
                    "baseCooldownMs": 500, "maxCooldownMs": 500, "halfOpenProbes": 3,
                    "syntheticProbe": {"body": "{\"prompt\":\"probe\",\"max_tokens\":1}",
                                       "intervalMs": 100, "timeoutMs": 500}}
    }));
    let envoy = path.start(&pool, &filter);
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let mut client = HttpClient::new(envoy.listener);
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while path.stat(&envoy, "ailb.breaker_opened.server_errors") == 0 {
        let _ = complete(&mut client);
        assert!(Instant::now() < deadline, "{path:?}: pod0 never cut");
    }
    // Still failing: three seconds of client traffic (six cooldowns) never picks it, and its
    // probes fail. The per-pod picks are read after traffic that lets every worker export
    // what it counted (the native module adds them once a second, on a request).
    let traffic = |client: &mut HttpClient, ms: u64| {
        let until = Instant::now() + Duration::from_millis(ms);
        let mut sent = 0;
        while Instant::now() < until {
            let (status, _) = complete(client);
            assert_eq!(status, 200, "{path:?}: a client request failed");
            sent += 1;
        }
        sent
    };
    traffic(&mut client, 1_500);
    let picks_before = path.per_pod(&envoy, &pool, "picks")[0];
    let failed_before = path.stat(&envoy, "ailb.probe.failed");
    let sent = traffic(&mut client, 3_000);
    traffic(&mut client, 1_500);
    let picks = path.per_pod(&envoy, &pool, "picks")[0];
    assert_eq!(
        picks,
        picks_before,
        "{path:?}: {sent} client requests while pod0 failed; it was picked {} times",
        picks - picks_before
    );
    wait_stat(
        &envoy,
        &format!("{}ailb.probe.failed", path.prefix()),
        |v| v >= failed_before + 2,
    );
    assert_eq!(
        path.stat(&envoy, "ailb.breaker_closed"),
        0,
        "{path:?}: probes of a failing pod must fail (a probe answered by another pod would pass)"
    );
    assert_eq!(path.stat(&envoy, "ailb.probe.passed"), 0);

    // Healed, with no client traffic: its probes close it.
    pool.control(0, r#"{"error_rate":0}"#).unwrap();
    let pod0 = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "pod0 closes on its probes alone", 20, |sb| {
        row(sb, &pod0).is_some_and(|r| r["breaker"] == "closed")
    });
    assert_eq!(path.per_pod(&envoy, &pool, "picks")[0], picks);
    let passed = wait_stat(
        &envoy,
        &format!("{}ailb.probe.passed", path.prefix()),
        |v| v >= 3,
    );
    let sent_probes = path.stat(&envoy, "ailb.probe.sent");
    assert!(
        sent_probes >= passed,
        "{path:?}: sent {sent_probes}, passed {passed}"
    );
    assert_eq!(path.stat(&envoy, "ailb.probe.not_sent"), 0);
    // Closed, it takes client requests again.
    let until = Instant::now() + Duration::from_secs(20);
    while path.per_pod(&envoy, &pool, "picks")[0] == picks {
        let _ = complete(&mut client);
        assert!(Instant::now() < until, "{path:?}: pod0 never picked again");
    }
    eprintln!("{path:?}: probes sent {sent_probes}, passed {passed}");
}

#[test]
fn a_half_open_pod_is_judged_by_synthetic_probes_and_takes_no_client_request() {
    for path in BOTH {
        probes_judge_the_half_open_pod_on(path);
    }
}
