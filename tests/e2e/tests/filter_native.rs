//! Decides whether the native module (filter/native, an Envoy dynamic module)
//! routes like the wasm filter in a real Envoy: it reads the agents' metrics over its own gRPC
//! stream, keeps a pod above the GPU hard limit out of 300 requests whose model it reads from
//! the JSON body, does not steer a model no pod serves, serves the status page, falls back to
//! least_request when no agent answers (counted), and makes Envoy refuse a config it cannot
//! honour; shares a breaker one worker opened with every worker (Envoy with 4 workers), and
//! closes a healed pod's breaker at its probes' first tokens; counts picks and failures per
//! pod (`ailb.endpoint.picks` / `.failures`, label `ailb_endpoint`) and sets the per-pod gauges
//! (score, breaker state, metrics age). Needs
//! `cargo build -p ai-lb-filter-native` (scripts/test.sh builds it).

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
// The wasm filter's stat names (Envoy prefixes a dynamic module's stats with
// `dynamicmodulescustom.`, a wasm filter's with `wasmcustom.`).
const STEERED: &str = "dynamicmodulescustom.ailb.steered";
const NO_MODEL: &str = "dynamicmodulescustom.ailb.fallback.no_model";
const NO_AGENT_DATA: &str = "dynamicmodulescustom.ailb.fallback.no_agent_data";
const PICKS: &str = "dynamicmodulescustom.ailb.endpoint.picks";
const FAILURES: &str = "dynamicmodulescustom.ailb.endpoint.failures";
const SCORE: &str = "dynamicmodulescustom.ailb.endpoint.score";
const BREAKER_STATE: &str = "dynamicmodulescustom.ailb.endpoint.breaker_state";
const METRICS_AGE: &str = "dynamicmodulescustom.ailb.endpoint.metrics_age_ms";

fn native_opts(pool: &PodPool, filter: &str, agents: &[std::net::SocketAddr]) -> EnvoyOptions {
    let mut opts = EnvoyOptions::new(envoy::native_filter_config(filter, agents).unwrap());
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = agents.to_vec();
    opts
}

fn body(model: &str) -> String {
    json!({"model": model, "prompt": "hello there", "max_tokens": 4}).to_string()
}

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).unwrap_or(0)
}

/// The per-pod stat `name` (label `endpoint`) of every pod of `pool`, in pod order.
fn per_pod(envoy: &Envoy, pool: &PodPool, name: &str) -> Vec<u64> {
    pool.pod_addrs
        .iter()
        .map(|a| stat(envoy, &format!("{name}.ailb_endpoint.{a}")))
        .collect()
}

#[test]
fn the_native_module_keeps_a_hot_pod_out_and_reads_the_model_from_the_body() {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"sm_occupancy":0.97}"#).unwrap();
    let filter = config(json!({"modelHeader": "x-ai-lb-model"}));
    let envoy = Envoy::start(&native_opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    let hot = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh and the hot pod cut", 30, |sb| {
        all_fresh(sb, &pool) && row(sb, &hot).is_some_and(|r| r["cut"] == "gpu_hard_limit")
    });

    let mut client = HttpClient::new(envoy.listener);
    let mut served = std::collections::BTreeMap::new();
    let n = 300;
    for i in 0..n {
        // A client-sent routing header naming the hot pod is dropped first.
        let r = client
            .post_json(
                "/v1/completions",
                &[("x-gateway-destination-endpoint", hot.as_str())],
                &body(MODEL),
            )
            .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        *served
            .entry(r.header("x-fake-pod").unwrap_or("none").to_string())
            .or_insert(0usize) += 1;
    }
    assert_eq!(
        served.get("pod0"),
        None,
        "the 97% GPU pod served: {served:?}"
    );
    assert_eq!(served.len(), 2, "both cool pods should serve: {served:?}");
    envoy
        .poll(
            Duration::from_secs(5),
            "every request counted as steered",
            || (stat(&envoy, STEERED) >= n as u64).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}: steered {}", stat(&envoy, STEERED)));
    // Per pod: every steered request counted for the pod it went to (label `ailb_endpoint`), none
    // for the hot pod; Prometheus shows the pod as a label. Each worker adds its counts at
    // most once a second, on a request's event: requests no pod is picked for, on fresh
    // connections (any worker), bring the 300 in and pick nothing themselves, so the sum
    // reaches 300 only once every worker has added the 300's picks.
    let picks = || per_pod(&envoy, &pool, PICKS);
    envoy
        .poll(
            Duration::from_secs(5),
            "the 300 picks counted per pod",
            || {
                assert_eq!(fresh_unpicked(&envoy), 404);
                (picks().iter().sum::<u64>() >= n as u64).then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}: picks per pod {:?}", picks()));
    let (p, steered) = (picks(), stat(&envoy, STEERED));
    assert!(
        p[0] == 0
            && p[1] > 0
            && p[2] > 0
            && p.iter().sum::<u64>() == n as u64
            && steered >= n as u64,
        "picks per pod {p:?}, steered {steered}"
    );
    // Per-pod gauges (set at most once a second, by the request that finds them due): the
    // cool pods score above 0, the hot one (cut) 0; every pod has a metrics age.
    let scores = || per_pod(&envoy, &pool, SCORE);
    envoy
        .poll(
            Duration::from_secs(5),
            "the cool pods' score gauges",
            || {
                client
                    .post_json("/v1/completions", &[], &body(MODEL))
                    .unwrap();
                let s = scores();
                (s[1] > 0 && s[2] > 0).then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}: scores x1000 per pod {:?}", scores()));
    assert_eq!(scores()[0], 0, "the hot pod's score gauge {:?}", scores());
    let stats = envoy.stats().unwrap();
    for a in &pool.pod_addrs {
        let age = format!("{METRICS_AGE}.ailb_endpoint.{a}");
        assert!(stats.contains_key(&age), "no {age}");
    }
    let prom = envoy.prometheus().unwrap();
    let label = format!(
        "envoy_dynamicmodulescustom_ailb_endpoint_picks{{ailb_endpoint=\"{}\"}}",
        pool.pod_addrs[1]
    );
    assert!(
        prom.lines().any(|l| l.starts_with(&label)),
        "no {label} in /stats/prometheus:\n{}",
        prom.lines()
            .filter(|l| l.contains("ailb_endpoint"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // A model no pod serves, read from the body, is not steered (so the body was read): the
    // pod least_request picks answers 404, and the fallback is counted.
    let before = stat(&envoy, NO_MODEL);
    let r = client
        .post_json("/v1/completions", &[], &body("other-model"))
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    envoy
        .poll(Duration::from_secs(5), "fallback counted", || {
            (stat(&envoy, NO_MODEL) > before).then_some(())
        })
        .unwrap();
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

#[test]
fn with_no_agent_answering_every_request_still_succeeds_by_least_request_and_is_counted() {
    let pool = PodPool::start(2, 0.01).unwrap();
    // An address nothing listens on: the feed keeps reconnecting, the filter steers nothing.
    let nobody = std::net::SocketAddr::from(([127, 0, 0, 1], envoy::free_port().unwrap()));
    let filter = config(json!({}));
    let envoy = Envoy::start(&native_opts(&pool, &filter, &[nobody])).unwrap();
    let served = count_served(&envoy, 50, &[]);
    assert_eq!(served.values().sum::<usize>(), 50);
    envoy
        .poll(
            Duration::from_secs(5),
            "fallbacks and stream errors counted",
            || {
                (stat(&envoy, NO_AGENT_DATA) >= 50
                    && stat(&envoy, "dynamicmodulescustom.ailb.stream.failures") > 0)
                    .then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}: fallback {}", stat(&envoy, NO_AGENT_DATA)));
    assert_eq!(stat(&envoy, STEERED), 0);
}

#[test]
fn envoy_refuses_a_native_config_the_module_cannot_honour() {
    let pool = PodPool::start(1, 0.01).unwrap();
    for (filter, field) in [
        (
            config(json!({"bigRequestHold": {}})),
            "filter.bigRequestHold",
        ),
        (config(json!({"minPods": 0})), "minPods"),
    ] {
        let opts = native_opts(&pool, &filter, &pool.agent_addrs);
        let out = envoy::run_until_exit(&opts, Duration::from_secs(30)).unwrap();
        assert!(!out.status.success(), "Envoy accepted a bad config");
        assert!(
            out.log.contains(field),
            "the log does not name `{field}`:\n{}",
            out.log
        );
    }
}

const OPENED: &str = "dynamicmodulescustom.ailb.breaker_opened.server_errors";
const CLOSED: &str = "dynamicmodulescustom.ailb.breaker_closed";

/// One small completion on a connection of its own (so that the kernel spreads them over
/// Envoy's workers): status, serving pod, the debug header.
fn fresh_complete(envoy: &Envoy) -> (u16, String, String) {
    let r = HttpClient::new(envoy.listener)
        .post_json(
            "/v1/completions",
            &[("connection", "close"), ("x-ai-lb-debug", "1")],
            r#"{"prompt":"hello there","max_tokens":4}"#,
        )
        .unwrap();
    (
        r.status,
        r.header("x-fake-pod").unwrap_or("none").to_string(),
        r.header("x-ai-lb-debug").unwrap_or("").to_string(),
    )
}

/// A request for a model no pod serves (answered 404), on a connection of its own: no pod is
/// picked for it, and its events let its worker add the per-pod counts it holds.
fn fresh_unpicked(envoy: &Envoy) -> u16 {
    HttpClient::new(envoy.listener)
        .post_json(
            "/v1/completions",
            &[("connection", "close")],
            &body("other-model"),
        )
        .unwrap()
        .status
}

/// Sends requests on fresh connections until pod0 (answering 500 to everything) has its
/// breaker opened; a retry hides each 500 from the client.
fn open_pod0(envoy: &Envoy, pool: &PodPool) {
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut sent = 0;
    while stat(envoy, OPENED) == 0 {
        let (status, _, _) = fresh_complete(envoy);
        assert_eq!(status, 200, "a retry should have hidden pod0's 500");
        sent += 1;
        assert!(
            Instant::now() < deadline,
            "pod0's breaker never opened ({sent} requests); log:\n{}",
            envoy.log_tail(30)
        );
    }
}

/// A breaker one worker opens is open on every worker: the status page, answered by whichever
/// worker got the connection, shows pod0 open on each worker it came from; the open is counted
/// once for the process; no request is steered to pod0 afterwards (read from the debug
/// header). With per-worker breakers each worker would need its own three failures.
#[test]
fn a_breaker_one_worker_opens_is_open_on_every_worker() {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 60000, "halfOpenProbes": 2,
                    "agentErrorRate": 0}
    }));
    let mut opts = native_opts(&pool, &filter, &pool.agent_addrs);
    opts.concurrency = 4;
    let envoy = Envoy::start(&opts).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let bad = pool.pod_addrs[0].to_string();
    open_pod0(&envoy, &pool);

    let mut states = std::collections::BTreeMap::new();
    for _ in 0..40 {
        let sb = scoreboard(&envoy);
        let worker = sb["worker"]
            .as_u64()
            .expect("the status page names its worker");
        let state = row(&sb, &bad).map(|r| r["breaker"].to_string());
        states
            .entry(worker)
            .or_insert_with(std::collections::BTreeSet::new)
            .insert(state.unwrap_or_default());
    }
    eprintln!("pod0's breaker per worker: {states:?}");
    assert!(
        states.len() >= 2,
        "40 fresh connections all reached one worker ({states:?}): the test cannot tell shared \
         breakers from per-worker ones"
    );
    for (w, st) in &states {
        assert_eq!(
            st.iter().map(String::as_str).collect::<Vec<_>>(),
            ["\"open\""],
            "worker {w} does not show pod0 open: {states:?}"
        );
    }
    for i in 0..40 {
        let (status, pod, debug) = fresh_complete(&envoy);
        assert_eq!(status, 200);
        assert_ne!(pod, "pod0", "request {i} served by the cut pod");
        assert!(
            debug.starts_with("pod=") && !debug.contains(&format!("pod={bad};")),
            "request {i}: debug header {debug:?}"
        );
    }
    assert_eq!(stat(&envoy, OPENED), 1, "the open is counted once");
    // pod0's failures are counted for it (at least the three that opened the breaker, added
    // within a second on a later request), and none for the healthy pods.
    let failures = || per_pod(&envoy, &pool, FAILURES);
    envoy
        .poll(Duration::from_secs(5), "pod0's failures counted", || {
            fresh_complete(&envoy);
            (failures()[0] >= 3).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: failures per pod {:?}", failures()));
    let f = failures();
    assert!(f[1] == 0 && f[2] == 0, "failures per pod {f:?}");
    // The breaker gauge shows pod0 open (2) within the next second's export, the others
    // closed (0).
    let states = || per_pod(&envoy, &pool, BREAKER_STATE);
    envoy
        .poll(Duration::from_secs(5), "pod0's breaker gauge open", || {
            fresh_complete(&envoy);
            (states()[0] == 2).then_some(())
        })
        .unwrap();
    assert_eq!(states()[1..], [0, 0]);
    let states = envoy.stats().unwrap();
    assert!(
        states.contains_key(&format!(
            "{BREAKER_STATE}.ailb_endpoint.{}",
            pool.pod_addrs[1]
        )),
        "no breaker gauge for pod1"
    );
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

/// A healed pod whose half-open probes are long streams (about 4 s each) is readmitted at
/// their first tokens: the breaker closes while the first probe is still streaming.
#[test]
fn half_open_probes_pass_at_their_first_token() {
    let pool = PodPool::start(2, 1.0).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1000, "halfOpenProbes": 2,
                    "agentErrorRate": 0}
    }));
    let envoy = Envoy::start(&native_opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    open_pod0(&envoy, &pool);
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    let recovered = Instant::now();

    let mut streams = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let closed_at = loop {
        streams.push(long_stream(envoy.listener, 600));
        // Paces the streams (the scenario's load); the breaker is polled at this pace, to the
        // deadline below.
        std::thread::sleep(Duration::from_millis(250));
        if stat(&envoy, CLOSED) > 0 {
            break Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "pod0's breaker never closed; log:\n{}",
            envoy.log_tail(30)
        );
    };
    let ends: Vec<(String, Instant)> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    let first_end = ends
        .iter()
        .filter(|(pod, _)| pod == "pod0")
        .map(|(_, end)| *end)
        .min()
        .expect("a probe went to pod0");
    eprintln!(
        "after pod0 recovered: breaker closed at {} ms, its first probe ended at {} ms",
        (closed_at - recovered).as_millis(),
        (first_end - recovered).as_millis()
    );
    assert!(
        closed_at < first_end,
        "the breaker closed {:?} after pod0's first probe ended: probes judged at their end",
        closed_at - first_end
    );
    assert!(stat(&envoy, "dynamicmodulescustom.ailb.breaker_half_opened") >= 1);
}

/// `"steering": "overrideHost"` on a cluster left on Envoy's least_request: the module hands
/// its pick to Envoy as the stream's upstream override host (no routing header, no
/// override_host policy), and the 97 % GPU pod, which least_request alone would give a third
/// of the requests, serves none of 150.
#[test]
fn steering_by_upstream_override_host_keeps_the_hot_pod_out_on_a_least_request_cluster() {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"sm_occupancy":0.97}"#).unwrap();
    let filter = config(json!({}));
    let mut opts = native_opts(&pool, &filter, &pool.agent_addrs);
    opts.filter_config = envoy::native_with_steering(&opts.filter_config, "overrideHost").unwrap();
    opts.template = Some(envoy::native_template_least_request().unwrap());
    assert!(
        !opts
            .template
            .as_deref()
            .unwrap()
            .contains("envoy.load_balancing_policies.override_host"),
        "the cluster should be on least_request"
    );
    let envoy = Envoy::start(&opts).unwrap();
    let hot = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh and the hot pod cut", 30, |sb| {
        all_fresh(sb, &pool) && row(sb, &hot).is_some_and(|r| r["cut"] == "gpu_hard_limit")
    });
    let mut client = HttpClient::new(envoy.listener);
    let mut served = std::collections::BTreeMap::new();
    for i in 0..150 {
        let r = client
            .post_json("/v1/completions", &[], &body(MODEL))
            .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        *served
            .entry(r.header("x-fake-pod").unwrap_or("none").to_string())
            .or_insert(0usize) += 1;
    }
    assert_eq!(served.get("pod0"), None, "the hot pod served: {served:?}");
    assert_eq!(served.len(), 2, "both cool pods should serve: {served:?}");
    assert!(stat(&envoy, STEERED) >= 150);
}
