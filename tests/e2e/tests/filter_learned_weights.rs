//! Decides whether learned weights (`learnedWeights`, issue 30 part 1) move traffic in a real
//! Envoy on both data paths (the wasm filter and the native module share the core's model):
//! pod0 reads an idle GPU (SM occupancy 0.05, the others 0.5) while every step of its engine
//! runs 2.5x slower (the fake pod's `slowdown` fault, with no GPU throttle reason, and below
//! the 3x `slowItlRatio` the static penalty needs). The static formula (this pool weighs the
//! GPU alone) sends it the most traffic; with the model on, the slow outcomes of pod0's
//! requests teach it to score pod0 lower, so pod0's share falls below its static share in the
//! same test. The model's weights show on the status page and as the pool's gauges.

mod filter_common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

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
        // One worker: one model, the one the status page shows (each worker learns alone).
        o.concurrency = 1;
        o.inference = pool.pod_addrs.clone();
        o.agents = pool.agent_addrs.clone();
        Envoy::start(&o).unwrap()
    }

    fn stat(self, envoy: &Envoy, name: &str) -> Option<u64> {
        let prefix = match self {
            Path::Wasm => "wasmcustom.",
            Path::Native => "dynamicmodulescustom.",
        };
        envoy.stat(&format!("{prefix}{name}")).ok()
    }
}

/// Sends completions for `secs` seconds and counts the pods that answered them.
fn drive(envoy: &Envoy, secs: u64) -> BTreeMap<String, usize> {
    let mut served = BTreeMap::new();
    let mut client = HttpClient::new(envoy.listener);
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if let Ok(r) = client.post_json(
            "/v1/completions",
            &[],
            r#"{"prompt":"hello there, how are you","max_tokens":16}"#,
        ) {
            *served
                .entry(r.header("x-fake-pod").unwrap_or("none").to_string())
                .or_insert(0) += 1;
        }
    }
    served
}

fn share(served: &BTreeMap<String, usize>, pod: &str) -> f64 {
    let total: usize = served.values().sum();
    served.get(pod).copied().unwrap_or(0) as f64 / total.max(1) as f64
}

/// pod0's share of the requests of the last `measure` seconds after `warm` seconds, with
/// `learned` as the `learnedWeights` section (None: static).
fn pod0_share(path: Path, learned: Option<serde_json::Value>) -> (f64, Envoy, PodPool) {
    let pool = PodPool::start(3, 0.1).unwrap();
    pool.control(
        0,
        r#"{"sm_occupancy":0.05,"slowdown":2.5,"throttle":false}"#,
    )
    .unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.5}"#).unwrap();
    }
    let mut extra = json!({"pickStrategy": "proportional"});
    if let Some(l) = learned {
        extra["learnedWeights"] = l;
    }
    let envoy = path.start(&pool, &config(extra));
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    drive(&envoy, 15);
    let served = drive(&envoy, 10);
    eprintln!("{path:?}: served in the measured window {served:?}");
    (share(&served, "pod0"), envoy, pool)
}

fn learned_moves_traffic_on(path: Path) {
    let (static_share, envoy, pool) = pod0_share(path, None);
    drop((envoy, pool));
    let (learned_share, envoy, _pool) = pod0_share(
        path,
        Some(json!({
            "updateIntervalMs": 1000,
            "learningRate": 0.1,
            "ttftSloMs": 20,
            "e2eSloMs": 150,
            "seed": 7
        })),
    );
    let sb = scoreboard(&envoy);
    let l = &sb["pools"][0]["learned"];
    eprintln!("{path:?}: static share {static_share:.3}, learned {learned_share:.3}; model {l}");
    assert!(
        static_share > 0.4,
        "{path:?}: the static formula favours the idle-looking pod0 ({static_share:.3})"
    );
    assert!(
        learned_share < 0.7 * static_share,
        "{path:?}: pod0's share with the model {learned_share:.3} vs static {static_share:.3}; status {sb}"
    );
    assert!(l["fallback"].is_null(), "{path:?}: {l}");
    assert!(
        l["updates"].as_u64().is_some_and(|u| u >= 5),
        "{path:?}: {l}"
    );
    assert!(l["weights"]["p99"].is_number() && l["weights"]["bias"].is_number());
    // The counters and the pool's weight gauges (1_000_000 + 1000·w).
    let samples = wait_stat_on(path, &envoy, "ailb.learned.samples");
    assert!(samples >= 30, "{path:?}: {samples} samples");
    let bias = wait_stat_on(path, &envoy, "ailb.pool.default.learned.bias");
    assert!(
        (900_000..=1_100_000).contains(&bias),
        "{path:?}: bias gauge {bias}"
    );
    // The GPU weight starts at 1 (±0.01); the model learns it down here (pod0's idle GPU goes
    // with slow answers), and the gauge shows the learned value, not the initial one.
    let gpu = wait_stat_on(path, &envoy, "ailb.pool.default.learned.gpu");
    let status_gpu = l["weights"]["gpu"].as_f64().unwrap_or(f64::NAN);
    assert!(
        status_gpu < 0.5 && gpu < 1_000_500,
        "{path:?}: gpu weight {status_gpu} on the status page, gauge {gpu}"
    );
}

/// The stat once it is above 0 (gauges and counters are exported every 0.5-1 s).
fn wait_stat_on(path: Path, envoy: &Envoy, name: &str) -> u64 {
    envoy
        .poll(Duration::from_secs(5), name, || {
            path.stat(envoy, name).filter(|v| *v > 0)
        })
        .unwrap_or_else(|e| panic!("{path:?}: {name}: {e}"))
}

#[test]
fn the_learned_model_moves_traffic_off_a_pod_slow_with_no_gpu_signal() {
    for path in [Path::Wasm, Path::Native] {
        learned_moves_traffic_on(path);
    }
}
