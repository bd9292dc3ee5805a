//! Decides whether both data paths, the proxy-wasm filter and the native module (an Envoy
//! dynamic module over the same core), do the same thing in a real Envoy: one table of
//! scenarios, each run against both builds (parity is a test, not a promise). Each reads the
//! agents' metrics, keeps a pod above the GPU hard limit out of 300 requests whose model it
//! reads from the JSON body (a client-sent routing header naming that pod is dropped), does not
//! steer a model no pod serves, serves the status page, counts picks and failures per pod and
//! sets the per-pod gauges (score, breaker state, metrics age) under the same stat names, and
//! keeps them current with no traffic; falls back to least_request when no agent answers
//! (counted); shares a breaker one worker opened with every worker (Envoy with 4 workers);
//! closes a healed pod's breaker at its probes' first tokens. Large bodies:
//! `filter_large_body.rs` (both paths). Rows for one path only: the native module refusing a
//! config that fails validation, and its `overrideHost` steering mode.
//! Admission: each tenant's token bucket answers 429 once its quota is spent; under
//! saturation a sheddable request is shed, a standard one held until a pod cools or answered
//! 503 at its deadline; a big request waits in the sidecar until a pod has room, goes after
//! `maxHoldMs`, and is forgotten when its client leaves (both paths). Guard mode runs on both
//! paths in `admission_guard.rs`.
//! Needs both builds (scripts/test.sh builds them).

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn body(model: &str) -> String {
    json!({"model": model, "prompt": "hello there", "max_tokens": 4}).to_string()
}

#[test]
fn a_hot_pod_is_kept_out_and_the_model_read_from_the_body() {
    for path in BOTH {
        eprintln!("== {path:?}");
        a_hot_pod_is_kept_out_and_the_model_read_from_the_body_on(path);
    }
}

fn a_hot_pod_is_kept_out_and_the_model_read_from_the_body_on(path: Path) {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"sm_occupancy":0.97}"#).unwrap();
    let filter = config(json!({"modelHeader": "x-ai-lb-model"}));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &pool.agent_addrs)).unwrap();
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
            || (path.stat(&envoy, "ailb.steered") >= n as u64).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}: steered {}", path.stat(&envoy, "ailb.steered")));
    // Per pod: every steered request counted for the pod it went to (label `ailb_endpoint`), none
    // for the hot pod; Prometheus shows the pod as a label. Each worker adds its counts at
    // most once a second, on a request's event: requests no pod is picked for, on fresh
    // connections (any worker), bring the 300 in and pick nothing themselves, so the sum
    // reaches 300 only once every worker has added the 300's picks.
    let picks = || path.per_pod(&envoy, &pool, "picks");
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
    let (p, steered) = (picks(), path.stat(&envoy, "ailb.steered"));
    assert!(
        p[0] == 0
            && p[1] > 0
            && p[2] > 0
            && p.iter().sum::<u64>() == n as u64
            && steered >= n as u64,
        "picks per pod {p:?}, steered {steered}"
    );
    // Per-pod gauges (set once a second or faster, traffic or not: the row below): the cool
    // pods score above 0, the hot one (cut) 0; every pod has a metrics age.
    let scores = || path.per_pod(&envoy, &pool, "score");
    envoy
        .poll(
            Duration::from_secs(5),
            "the cool pods' score gauges",
            || {
                let s = scores();
                (s[1] > 0 && s[2] > 0).then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}: scores x1000 per pod {:?}", scores()));
    assert_eq!(scores()[0], 0, "the hot pod's score gauge {:?}", scores());
    // The agents' events are counted where they are applied (the wasm filter's subscribing
    // VM, the native module's feed thread), and the core's worker-local breaker counts are not
    // exported beside the shared ones.
    assert!(
        path.stat(&envoy, "ailb.pool_events") > 0,
        "ailb.pool_events"
    );
    let stats = envoy.stats().unwrap();
    assert!(
        !stats
            .keys()
            .any(|k| k.starts_with(&format!("{}ailb.breaker.", path.prefix()))),
        "a second family of breaker stats (ailb.breaker.*) is exported"
    );
    let stats = envoy.stats().unwrap();
    for a in &pool.pod_addrs {
        let age = path.pod_stat_name("metrics_age_ms", &a.to_string());
        assert!(stats.contains_key(&age), "no {age}");
    }
    let prom = envoy.prometheus().unwrap();
    let label = path.prometheus_picks(&pool.pod_addrs[1].to_string());
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
    let before = path.stat(&envoy, "ailb.fallback.no_model");
    let r = client
        .post_json("/v1/completions", &[], &body("other-model"))
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    envoy
        .poll(Duration::from_secs(5), "fallback counted", || {
            (path.stat(&envoy, "ailb.fallback.no_model") > before).then_some(())
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
    for path in BOTH {
        eprintln!("== {path:?}");
        with_no_agent_answering_every_request_still_succeeds_by_least_request_and_is_counted_on(
            path,
        );
    }
}

fn with_no_agent_answering_every_request_still_succeeds_by_least_request_and_is_counted_on(
    path: Path,
) {
    let pool = PodPool::start(2, 0.01).unwrap();
    // An address nothing listens on: the feed keeps reconnecting, the filter steers nothing.
    let nobody = std::net::SocketAddr::from(([127, 0, 0, 1], envoy::free_port().unwrap()));
    let filter = config(json!({}));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &[nobody])).unwrap();
    let served = count_served(&envoy, 50, &[]);
    assert_eq!(served.values().sum::<usize>(), 50);
    envoy
        .poll(
            Duration::from_secs(5),
            "fallbacks and stream errors counted",
            || {
                // The wasm filter's stream goes through an Envoy cluster, which takes the call
                // and then closes it; the native module's connect fails.
                (path.stat(&envoy, "ailb.fallback.no_agent_data") >= 50
                    && path.stat(&envoy, "ailb.stream.failures")
                        + path.stat(&envoy, "ailb.stream.closes")
                        > 0)
                .then_some(())
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e}: fallback {}, stream failures {}, closes {}",
                path.stat(&envoy, "ailb.fallback.no_agent_data"),
                path.stat(&envoy, "ailb.stream.failures"),
                path.stat(&envoy, "ailb.stream.closes")
            )
        });
    assert_eq!(path.stat(&envoy, "ailb.steered"), 0);
}

#[test]
fn the_per_pod_gauges_follow_the_agents_with_no_traffic() {
    for path in BOTH {
        eprintln!("== {path:?}");
        the_per_pod_gauges_follow_the_agents_with_no_traffic_on(path);
    }
}

/// An operator's dashboard and alerts read the per-pod gauges: they must move when the pods
/// do, not only when a request passes (the wasm filter sets them on its root tick, the native
/// module on its main thread's tick). No request is sent in this row.
fn the_per_pod_gauges_follow_the_agents_with_no_traffic_on(path: Path) {
    let mut pool = PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let envoy = path.start(&pool, &config(json!({})));
    let gauges = |pool: &PodPool, metric: &str| path.per_pod(&envoy, pool, metric);
    envoy
        .poll(Duration::from_secs(10), "every pod scored", || {
            gauges(&pool, "score").iter().all(|&s| s > 0).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: scores x1000 per pod {:?}", gauges(&pool, "score")));
    // A pod over the GPU hard limit is cut: its score gauge falls to 0.
    pool.control(1, r#"{"sm_occupancy":0.97}"#).unwrap();
    envoy
        .poll(Duration::from_secs(10), "the hot pod's score at 0", || {
            let s = gauges(&pool, "score");
            (s[1] == 0 && s[0] > 0 && s[2] > 0).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: scores x1000 per pod {:?}", gauges(&pool, "score")));
    // With the agents gone, every pod's metrics age grows.
    pool.kill_agents();
    envoy
        .poll(
            Duration::from_secs(15),
            "every metrics age over 3 s",
            || {
                gauges(&pool, "metrics_age_ms")
                    .iter()
                    .all(|&a| a >= 3000)
                    .then_some(())
            },
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e}: metrics age (ms) per pod {:?}",
                gauges(&pool, "metrics_age_ms")
            )
        });
    assert_eq!(
        path.stat(&envoy, "ailb.steered"),
        0,
        "a request was steered"
    );
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

/// Native only: Envoy refuses a module config that fails validation, and its log names the
/// field (the wasm filter's row is in filter_config.rs).
#[test]
fn envoy_refuses_a_native_config_that_fails_validation() {
    let pool = PodPool::start(1, 0.01).unwrap();
    for (filter, field) in [
        (config(json!({"mode": "gaurd"})), "mode"),
        (config(json!({"minPods": 0})), "minPods"),
    ] {
        let opts = Path::Native.opts(&pool, &filter, &pool.agent_addrs);
        let out = envoy::run_until_exit(&opts, Duration::from_secs(30)).unwrap();
        assert!(!out.status.success(), "Envoy accepted a bad config");
        assert!(
            out.log.contains(field),
            "the log does not name `{field}`:\n{}",
            out.log
        );
    }
}

/// The per-tenant stat `what` (`admitted`, `rate_limited`, ...) of `tenant` in `class`, as
/// `/stats` names it: the wasm filter puts tenant and class in the name, the native module
/// gives them as the labels `ailb_tenant` and `ailb_class`.
fn tenant_stat(path: Path, envoy: &Envoy, tenant: &str, class: &str, what: &str) -> u64 {
    let name = match path {
        Path::Wasm => format!("wasmcustom.ailb.admission.tenant.{tenant}.{class}.{what}"),
        Path::Native => format!(
            "dynamicmodulescustom.ailb.admission.tenant.{what}.ailb_tenant.{tenant}.ailb_class.{class}"
        ),
    };
    envoy.stat(&name).unwrap_or(0)
}

/// The token limiter: each tenant's bucket (its own quota, or the default one) admits
/// requests until its burst is spent, then answers 429 with `retry-after`, `x-ratelimit-*`
/// and the OpenAI error body, while another tenant is still admitted; an admitted answer
/// carries `x-ratelimit-remaining` and its usage is settled (the reservation beyond it is
/// refunded or the rest charged). Counted under the same names on both paths, per tenant and globally.
#[test]
fn each_tenants_bucket_answers_429_once_its_quota_is_spent() {
    for path in BOTH {
        eprintln!("== {path:?}");
        each_tenants_bucket_answers_429_once_its_quota_is_spent_on(path);
    }
}

fn each_tenants_bucket_answers_429_once_its_quota_is_spent_on(path: Path) {
    let pool = PodPool::start(2, 0.01).unwrap();
    // A request costs its prompt (a few tokens) + max_tokens 100: "small" (burst 250) takes
    // two, "big" (burst 2500) takes twenty, refilling 1 token a second.
    let filter = config(json!({
        "admission": {
            "tenantKey": ["header:x-tenant-id"],
            "trustedHeaders": ["x-tenant-id"],
            "tenants": {
                "default": {"tokensPerSecond": 1, "burst": 250},
                "big": {"tokensPerSecond": 1, "burst": 2500}
            }
        }
    }));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    let mut client = HttpClient::new(envoy.listener);
    let req = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 100}).to_string();
    let mut send = |tenant: &str| {
        client
            .post_json("/v1/completions", &[("x-tenant-id", tenant)], &req)
            .unwrap()
    };
    let statuses =
        |tenant: &str, n: usize, send: &mut dyn FnMut(&str) -> ai_lb_e2e::envoy::Response| {
            (0..n).map(|_| send(tenant)).collect::<Vec<_>>()
        };
    let small = statuses("small", 3, &mut send);
    let codes: Vec<u16> = small.iter().map(|r| r.status).collect();
    assert_eq!(&codes[..2], &[200, 200], "{codes:?}");
    let limited = &small[2];
    assert_eq!(limited.status, 429, "{}", limited.text());
    for h in [
        "retry-after",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ] {
        assert!(limited.header(h).is_some(), "the 429 has no {h}");
    }
    assert!(limited.text().contains("rate_limit"), "{}", limited.text());
    assert!(
        small[0].header("x-ratelimit-remaining").is_some(),
        "an admitted answer carries x-ratelimit-remaining"
    );
    // Another tenant, with its own quota, is still admitted.
    let big = statuses("big", 5, &mut send);
    assert!(
        big.iter().all(|r| r.status == 200),
        "{:?}",
        big.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    envoy
        .poll(Duration::from_secs(5), "the admission stats", || {
            (tenant_stat(path, &envoy, "small", "standard", "admitted") == 2
                && tenant_stat(path, &envoy, "small", "standard", "rate_limited") == 1
                && tenant_stat(path, &envoy, "big", "standard", "admitted") == 5
                && path.stat(&envoy, "ailb.admission.rate_limited") == 1
                && path.stat(&envoy, "ailb.admission.settled") == 7)
                .then_some(())
        })
        .unwrap_or_else(|e| {
            let stats = envoy.stats().unwrap();
            let adm: Vec<_> = stats
                .iter()
                .filter(|(k, _)| k.contains("admission"))
                .collect();
            panic!("{e}: {adm:#?}")
        });
    // Prometheus: the wasm filter's name carries tenant and class (envoy.yaml tags none of
    // them), the native module's counter carries them as labels.
    let prom = envoy.prometheus().unwrap();
    let line = match path {
        Path::Wasm => "ailb_admission_tenant_small_standard_admitted{} 2".to_string(),
        Path::Native => "envoy_dynamicmodulescustom_ailb_admission_tenant_admitted{\
             ailb_tenant=\"small\",ailb_class=\"standard\"} 2"
            .to_string(),
    };
    assert!(
        prom.lines().any(|l| l == line),
        "no `{line}` in /stats/prometheus:\n{}",
        prom.lines()
            .filter(|l| l.contains("admission_tenant"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The fake pod reports usage: every reservation was settled against it.
    assert!(path.stat(&envoy, "ailb.admission.tokens_actual") > 0);
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

/// Priority classes under saturation (both pods over the GPU hard limit): a sheddable request
/// is shed at once (429, `shed_under_saturation`), a standard one is held in the worker's queue
/// and answered 503 (`saturated`, `retry-after`) once it waited `maxWaitStandardMs`, and a held
/// standard request is released, and served by that pod, as soon as a pod cools. The wasm
/// filter's root ticks release and expire it; the native module's held requests wake on their
/// own stream through the ABI's scheduler. Counted under the same names on both paths.
#[test]
fn under_saturation_sheddable_is_shed_and_standard_held_until_capacity_or_its_deadline() {
    for path in BOTH {
        eprintln!("== {path:?}");
        under_saturation_sheddable_is_shed_and_standard_held_on(path);
    }
}

fn under_saturation_sheddable_is_shed_and_standard_held_on(path: Path) {
    const MAX_WAIT_MS: u64 = 1_500;
    let pool = PodPool::start(2, 0.01).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.97}"#).unwrap();
    }
    let filter = config(json!({
        "admission": {
            "trustedHeaders": ["x-ai-lb-priority"],
            "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}},
            "saturation": {"softThreshold": 0.85, "maxWaitStandardMs": MAX_WAIT_MS, "retryAfterSeconds": 3}
        }
    }));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    wait_scoreboard(&envoy, "both pods cut (saturated)", 30, |sb| {
        all_fresh(sb, &pool)
            && pool
                .pod_addrs
                .iter()
                .all(|a| row(sb, &a.to_string()).is_some_and(|r| r["cut"] == "gpu_hard_limit"))
    });
    let send = |class: &str| {
        let t = Instant::now();
        let r = HttpClient::new(envoy.listener)
            .post_json(
                "/v1/completions",
                &[("x-ai-lb-priority", class), ("connection", "close")],
                &body(MODEL),
            )
            .unwrap();
        (r, t.elapsed())
    };
    let (r, _) = send("sheddable");
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.text().contains("shed_under_saturation"), "{}", r.text());

    let (r, took) = send("standard");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("3"));
    assert!(r.text().contains("\"saturated\""), "{}", r.text());
    assert!(
        took >= Duration::from_millis(MAX_WAIT_MS - 100),
        "503 after {took:?}, before the maximum wait"
    );

    let held_before = path.stat(&envoy, "ailb.admission.held");
    let addr = envoy.listener;
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        let r = HttpClient::new(addr)
            .post_json(
                "/v1/completions",
                &[("x-ai-lb-priority", "standard"), ("connection", "close")],
                &body(MODEL),
            )
            .unwrap();
        (r, t.elapsed())
    });
    envoy
        .poll(Duration::from_secs(5), "the request is held", || {
            (path.stat(&envoy, "ailb.admission.held") > held_before).then_some(())
        })
        .unwrap();
    pool.control(1, r#"{"sm_occupancy":0.3}"#).unwrap();
    let (r, took) = waiter.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-fake-pod"),
        Some("pod1"),
        "steered to the cool pod"
    );
    assert!(
        took < Duration::from_millis(MAX_WAIT_MS),
        "released after {took:?}"
    );
    envoy
        .poll(Duration::from_secs(5), "the priority stats", || {
            (path.stat(&envoy, "ailb.admission.shed") == 1
                && path.stat(&envoy, "ailb.admission.held_expired") == 1
                && path.stat(&envoy, "ailb.admission.held_released") == 1
                && tenant_stat(path, &envoy, "default", "sheddable", "shed") == 1)
                .then_some(())
        })
        .unwrap_or_else(|e| {
            let stats = envoy.stats().unwrap();
            let adm: Vec<_> = stats
                .iter()
                .filter(|(k, _)| k.contains("admission"))
                .collect();
            panic!("{e}: {adm:#?}")
        });
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

/// Derived priority (`admission.derivedPriority`, issue 30 part 5) through a real Envoy, no
/// priority header: with only the temperature term weighted, a request at temperature 0 scores
/// 0.9 and is Ultra (counted `critical`), one without a temperature scores 0 and is Standard.
/// Both pods saturated: the Ultra request is held at most its `maxHeldMs` and then routed
/// anyway (200), the Standard one is answered 503 after `maxWaitStandardMs`. Counted under the
/// same names on both paths.
#[test]
fn a_derived_ultra_request_is_held_at_most_its_bound_while_a_standard_one_times_out() {
    for path in BOTH {
        eprintln!("== {path:?}");
        a_derived_ultra_request_is_held_at_most_its_bound_on(path);
    }
}

fn a_derived_ultra_request_is_held_at_most_its_bound_on(path: Path) {
    const ULTRA_HOLD_MS: u64 = 400;
    const MAX_WAIT_MS: u64 = 1_500;
    let pool = PodPool::start(2, 0.01).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.97}"#).unwrap();
    }
    let filter = config(json!({
        "admission": {
            "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}},
            "saturation": {"softThreshold": 0.85, "maxWaitStandardMs": MAX_WAIT_MS},
            "derivedPriority": {
                "weights": {"complexity": 0.0, "outputLength": 0.0, "temperature": 1.0},
                "ultra": {"minScore": 0.85, "maxHeldMs": ULTRA_HOLD_MS}
            }
        }
    }));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    wait_scoreboard(&envoy, "both pods cut (saturated)", 30, |sb| {
        all_fresh(sb, &pool)
            && pool
                .pod_addrs
                .iter()
                .all(|a| row(sb, &a.to_string()).is_some_and(|r| r["cut"] == "gpu_hard_limit"))
    });
    let send = |temperature: Option<f64>| {
        let mut b = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4});
        if let Some(t) = temperature {
            b["temperature"] = json!(t);
        }
        let t = Instant::now();
        let r = HttpClient::new(envoy.listener)
            .post_json(
                "/v1/completions",
                &[("connection", "close")],
                &b.to_string(),
            )
            .unwrap();
        (r, t.elapsed())
    };
    let (r, took) = send(Some(0.0));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took >= Duration::from_millis(ULTRA_HOLD_MS - 100)
            && took < Duration::from_millis(MAX_WAIT_MS),
        "the Ultra request was held {took:?}, not about {ULTRA_HOLD_MS} ms"
    );
    let (r, took) = send(None);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        took >= Duration::from_millis(MAX_WAIT_MS - 100),
        "503 after {took:?}, before the maximum wait"
    );
    envoy
        .poll(Duration::from_secs(5), "the derived priority stats", || {
            (path.stat(&envoy, "ailb.admission.derived.ultra") == 1
                && path.stat(&envoy, "ailb.admission.derived.standard") == 1
                && path.stat(&envoy, "ailb.admission.derived.deadline_proceed") == 1
                && path.stat(&envoy, "ailb.admission.held_expired") == 1
                && tenant_stat(path, &envoy, "default", "critical", "admitted") == 1
                && tenant_stat(path, &envoy, "default", "standard", "held_rejected") == 1)
                .then_some(())
        })
        .unwrap_or_else(|e| {
            let stats = envoy.stats().unwrap();
            let adm: Vec<_> = stats
                .iter()
                .filter(|(k, _)| k.contains("admission"))
                .collect();
            panic!("{e}: {adm:#?}")
        });
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

/// The big-request hold (`bigRequestHold`), through the real agents: two pods with a 10 000
/// token KV cache each half filled by a direct 5 000-token prompt; a 4 000-token prompt (big
/// next to the warm-up's short ones) waits in the sidecar while no pod has room for it with
/// the KV headroom to spare, and is routed once a pod has room (`released`); a held request is
/// routed anyway after `maxHoldMs` (`expired`) and forgotten when its client leaves (`left`).
/// The wasm filter's root tick releases them; the native module's held requests wake on their
/// own stream. One Envoy worker: each worker learns the mean request from its own traffic.
#[test]
fn a_big_request_waits_for_room_goes_after_max_hold_ms_and_is_forgotten_when_its_client_leaves() {
    for path in BOTH {
        eprintln!("== {path:?}");
        big_requests_wait_for_room_on(path);
        big_requests_expire_or_leave_on(path);
    }
}

/// Two pods (10 000 KV tokens, 8 seats) behind `path` with the hold `hold`, fresh KV readings
/// and a trained mean request.
fn big_hold_setup(path: Path, hold: serde_json::Value) -> (PodPool, Envoy) {
    let pool = kv_pool(|_| 10_000);
    let filter = config(json!({
        "cutoffs": {"stalenessMs": 5000, "maxQueue": 8},
        "modelHeader": "x-ai-lb-model",
        "bigRequestHold": hold,
    }));
    let mut opts = path.opts(&pool, &filter, &pool.agent_addrs);
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    wait_scoreboard(&envoy, "every pod fresh with a KV reading", 30, |sb| {
        all_fresh(sb, &pool)
            && addrs
                .iter()
                .all(|a| row(sb, a).is_some_and(|r| r["kv"].is_number()))
    });
    short_requests(&envoy, 30);
    (pool, envoy)
}

/// A direct 5 000-token prompt answering `tokens` on each pod, once both show KV use ≥ 0.5.
fn half_fill(
    pool: &PodPool,
    envoy: &Envoy,
    tokens: u32,
) -> Vec<std::thread::JoinHandle<(u16, Instant)>> {
    let bg: Vec<_> = pool
        .pod_addrs
        .iter()
        .map(|a| direct(*a, filter_common::body(5000, tokens)))
        .collect();
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    wait_scoreboard(envoy, "both pods half full of KV", 20, |sb| {
        addrs.iter().all(|a| {
            row(sb, a)
                .and_then(|r| r["kv"].as_f64())
                .is_some_and(|kv| kv >= 0.5)
        })
    });
    bg
}

/// A big request through Envoy on a thread, the client giving up after `timeout`: its
/// status (0: gave up).
fn big_via(envoy: &Envoy, timeout: Duration) -> std::thread::JoinHandle<u16> {
    let listener = envoy.listener;
    std::thread::spawn(move || {
        HttpClient::new(listener)
            .with_timeout(timeout)
            .post_json(
                "/v1/completions",
                &[("connection", "close")],
                &filter_common::body(4000, 10),
            )
            .map_or(0, |r| r.status)
    })
}

fn big_requests_wait_for_room_on(path: Path) {
    let (pool, envoy) = big_hold_setup(path, json!({"maxHoldMs": 30000}));
    let hold = |what: &str| path.stat(&envoy, &format!("ailb.big_hold.{what}"));
    // ~1 000 output tokens at ~5 ms: each direct request runs about 5 s.
    let bg = half_fill(&pool, &envoy, 1000);
    let big = big_via(&envoy, Duration::from_secs(40));
    envoy
        .poll(Duration::from_secs(5), "the big request held", || {
            (hold("held") == 1).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", decision_stats(&envoy)));
    // Short requests pass meanwhile.
    short_requests(&envoy, 10);
    assert!(
        bg.iter().all(|h| !h.is_finished()) && !big.is_finished(),
        "the direct requests ended before the checks; the run is inconclusive"
    );
    for h in bg {
        assert_eq!(h.join().unwrap().0, 200);
    }
    assert_eq!(big.join().unwrap(), 200, "{}", decision_stats(&envoy));
    envoy
        .poll(Duration::from_secs(5), "released, none expired", || {
            (hold("released") == 1 && hold("expired") == 0 && hold("depth") == 0).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", decision_stats(&envoy)));
}

fn big_requests_expire_or_leave_on(path: Path) {
    let (pool, envoy) = big_hold_setup(path, json!({"maxHoldMs": 1500}));
    let hold = |what: &str| path.stat(&envoy, &format!("ailb.big_hold.{what}"));
    // ~3 000 output tokens: the pods stay full for the whole test.
    let bg = half_fill(&pool, &envoy, 3000);
    // Gives up after 500 ms, while held.
    assert_eq!(
        big_via(&envoy, Duration::from_millis(500)).join().unwrap(),
        0
    );
    envoy
        .poll(
            Duration::from_secs(5),
            "the one that left forgotten",
            || (hold("left") == 1 && hold("depth") == 0).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", decision_stats(&envoy)));
    // Waits 1.5 s in the sidecar, then goes to a pod as if the hold were off.
    let sent = Instant::now();
    let expired = big_via(&envoy, Duration::from_secs(4));
    envoy
        .poll(Duration::from_secs(5), "the held one expired", || {
            (hold("expired") == 1).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", decision_stats(&envoy)));
    assert!(sent.elapsed() >= Duration::from_millis(1500));
    let _ = expired.join();
    assert_eq!(hold("released"), 0, "{}", decision_stats(&envoy));
    assert!(bg.iter().all(|h| !h.is_finished()), "inconclusive");
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
    drop(envoy);
    drop(pool);
    for h in bg {
        let _ = h.join();
    }
}

const OPENED: &str = "ailb.breaker_opened.server_errors";
const CLOSED: &str = "ailb.breaker_closed";

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
fn open_pod0(path: Path, envoy: &Envoy, pool: &PodPool) {
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut sent = 0;
    while path.stat(envoy, OPENED) == 0 {
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
    for path in BOTH {
        eprintln!("== {path:?}");
        a_breaker_one_worker_opens_is_open_on_every_worker_on(path);
    }
}

fn a_breaker_one_worker_opens_is_open_on_every_worker_on(path: Path) {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 60000, "halfOpenProbes": 2,
                    "agentErrorRate": 0}
    }));
    let mut opts = path.opts(&pool, &filter, &pool.agent_addrs);
    opts.concurrency = 4;
    let envoy = Envoy::start(&opts).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let bad = pool.pod_addrs[0].to_string();
    open_pod0(path, &envoy, &pool);

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
    assert_eq!(path.stat(&envoy, OPENED), 1, "the open is counted once");
    // pod0's failures are counted for it (at least the three that opened the breaker, added
    // within a second on a later request), and none for the healthy pods.
    let failures = || path.per_pod(&envoy, &pool, "failures");
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
    let states = || path.per_pod(&envoy, &pool, "breaker_state");
    envoy
        .poll(Duration::from_secs(5), "pod0's breaker gauge open", || {
            fresh_complete(&envoy);
            (states()[0] == 2).then_some(())
        })
        .unwrap();
    assert_eq!(states()[1..], [0, 0]);
    let states = envoy.stats().unwrap();
    assert!(
        states.contains_key(&path.pod_stat_name("breaker_state", &pool.pod_addrs[1].to_string())),
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
    for path in BOTH {
        eprintln!("== {path:?}");
        half_open_probes_pass_at_their_first_token_on(path);
    }
}

fn half_open_probes_pass_at_their_first_token_on(path: Path) {
    let pool = PodPool::start(2, 1.0).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1000, "halfOpenProbes": 2,
                    "agentErrorRate": 0}
    }));
    let envoy = Envoy::start(&path.opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    open_pod0(path, &envoy, &pool);
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    let recovered = Instant::now();

    let mut streams = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let closed_at = loop {
        streams.push(long_stream(envoy.listener, 600));
        // Paces the streams (the scenario's load); the breaker is polled at this pace, to the
        // deadline below.
        std::thread::sleep(Duration::from_millis(250));
        if path.stat(&envoy, CLOSED) > 0 {
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
    assert!(path.stat(&envoy, "ailb.breaker_half_opened") >= 1);
}

/// `"steering": "overrideHost"` on a cluster left on Envoy's least_request: the module hands
/// its pick to Envoy as the stream's upstream override host (no routing header, no
/// override_host policy), and the 97 % GPU pod, which least_request alone would give a third
/// of the requests, serves none of 150.
/// Native only: the `steering` mode the wasm filter does not have.
#[test]
fn steering_by_upstream_override_host_keeps_the_hot_pod_out_on_a_least_request_cluster() {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"sm_occupancy":0.97}"#).unwrap();
    let filter = config(json!({}));
    let mut opts = Path::Native.opts(&pool, &filter, &pool.agent_addrs);
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
    assert!(Path::Native.stat(&envoy, "ailb.steered") >= 150);
}
