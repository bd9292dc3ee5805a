//! Prefix-cache affinity end to end (`prefixAffinity`): real Envoy with the wasm filter, fake
//! pods with vLLM's prefix cache publishing KV events over ZeroMQ, agents reading them and
//! pushing each pod's cached blocks to the filter. Requests sharing a long system prompt go
//! to the pod that caches it (its prefix-cache hit counter climbs), different prompts meet on
//! different pods, and when that pod's queue forms the prefix spills to a free pod. The same
//! scenario runs against the native dynamic module (same core; it exports no prefix stats).

mod filter_common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A chat body: group `g`'s system prompt (about 1 500 tokens, the same for every request of
/// the group) and question `q`.
/// The two tests run one after the other: each starts four pods publishing KV events, four
/// agents and an Envoy, and both at once on two cores left three agents' updates 15 s late in one
/// run (the native test timed out waiting for the cache report; noted for investigation).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn chat(g: u32, q: u32) -> String {
    let system: String = (0..1500).map(|i| format!("s{g:02}{}", i % 10)).collect();
    json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("question {q} of group {g}: summarise the above")}]})
    .to_string()
}

fn served_by(client: &mut HttpClient, body: &str) -> String {
    let r = client.post_json("/v1/chat/completions", &[], body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.header("x-fake-pod").unwrap_or_default().to_string()
}

/// A pod's prefix-cache hit and query counters (tokens), from its /metrics page.
fn pod_prefix_hits(pool: &PodPool, i: usize) -> (f64, f64) {
    let r = HttpClient::new(pool.pod_addrs[i])
        .get("/metrics", &[("connection", "close")])
        .unwrap();
    let text = r.text();
    let read = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        read("vllm:prefix_cache_hits_total"),
        read("vllm:prefix_cache_queries_total"),
    )
}

fn prefix_keys(sb: &Value, addr: &str) -> Option<u64> {
    row(sb, addr).and_then(|r| r["prefixKeys"].as_u64())
}

#[test]
fn a_shared_prefix_stays_on_the_pod_that_caches_it_and_spills_when_it_queues() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pool = PodPool::start_with_kv_events(4, 0.01, |_| Vec::new()).unwrap();
    let envoy = envoy_for(&pool, config(json!({"prefixAffinity": {}})));
    scenario(&envoy, &pool, true);
}

#[test]
fn the_native_module_keeps_a_shared_prefix_on_its_pod_too() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pool = PodPool::start_with_kv_events(4, 0.01, |_| Vec::new()).unwrap();
    let filter = config(json!({"prefixAffinity": {}}));
    let mut opts =
        EnvoyOptions::new(envoy::native_filter_config(&filter, &pool.agent_addrs).unwrap());
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    let envoy = Envoy::start(&opts).unwrap();
    scenario(&envoy, &pool, false);
}

fn scenario(envoy: &Envoy, pool: &PodPool, wasm: bool) {
    wait_scoreboard(envoy, "every pod fresh, reporting its cache", 30, |sb| {
        all_fresh(sb, pool)
            && pool
                .pod_addrs
                .iter()
                .all(|a| prefix_keys(sb, &a.to_string()).is_some())
    });
    let mut client = HttpClient::new(envoy.listener);

    // The first request of a group: no pod holds it yet (its rendezvous pod takes it).
    let first = served_by(&mut client, &chat(1, 0));
    let i = pool.names.iter().position(|n| *n == first).unwrap();
    let addr = pool.pod_addrs[i].to_string();
    // Its agent reports the cached system prompt (~23 key blocks of 64 tokens).
    wait_scoreboard(envoy, "the pod's cache reported", 15, |sb| {
        prefix_keys(sb, &addr).is_some_and(|k| k >= 20)
    });
    let (hits0, _) = pod_prefix_hits(pool, i);
    for q in 1..=30 {
        assert_eq!(served_by(&mut client, &chat(1, q)), first, "question {q}");
    }
    let (hits1, queries1) = pod_prefix_hits(pool, i);
    // Each of the 30 hit the ~1 500-token system prompt on that pod.
    assert!(
        hits1 - hits0 >= 30.0 * 1400.0,
        "{hits0} -> {hits1} of {queries1}"
    );
    if wasm {
        wait_stat(envoy, "wasmcustom.ailb.prefix.hit", |v| v >= 30);
    }

    // Other groups' prompts are spread by their rendezvous pods, not all sent to one pod.
    let mut by_pod: BTreeMap<String, u32> = BTreeMap::new();
    for g in 10..26 {
        *by_pod
            .entry(served_by(&mut client, &chat(g, 0)))
            .or_default() += 1;
    }
    assert!(by_pod.len() >= 3, "{by_pod:?}");

    // The caching pod's queue forms: group 1 spills to pods that would start it at once.
    pool.control(i, r#"{"queue":40}"#).unwrap();
    wait_scoreboard(envoy, "the caching pod queued", 15, |sb| {
        row(sb, &addr).is_some_and(|r| r["queued"] == true)
    });
    // The status page answers from the view it has just refreshed; the wasm worker that
    // carries the client's connection re-reads the shared pool state before a pick only when
    // its view is older than `watch.refreshMs` (20 ms), so its next pick may still see the
    // queue empty (seen once in a full run: question 100 went to the queued pod). Let that
    // view age past it.
    std::thread::sleep(Duration::from_millis(100));
    let spill0 = envoy.stat("wasmcustom.ailb.prefix.spill").unwrap_or(0);
    for q in 100..120 {
        assert_ne!(served_by(&mut client, &chat(1, q)), first, "question {q}");
    }
    if wasm {
        wait_stat(envoy, "wasmcustom.ailb.prefix.spill", |v| v > spill0);
        assert!(
            !envoy.wasm_failed(),
            "wasm trapped:\n{}",
            envoy.log_tail(40)
        );
    }
}
