//! Decides nothing: renders the scoreboard (per pod: address, score, cut reason, breaker
//! state, picks, load, KV use, the agent's error rate, metrics age, the GPU reading scored, the prefix-cache blocks reported and hit rate) as JSON for the status path and the debug header.

use serde_json::{json, Value};

use crate::picker::Router;

/// The scoreboard of every pool at `now_ms`, as a JSON value.
pub fn scoreboard(router: &Router, now_ms: u64) -> Value {
    let pools: Vec<Value> = (0..router.pool_count())
        .map(|i| {
            let cfg = router.config().pools.get(i);
            let state = router.pool_state(i);
            let pods: Vec<Value> = router
                .pod_status(i, now_ms)
                .iter()
                .map(|s| {
                    json!({
                        "address": s.address,
                        "peer": s.peer,
                        "score": s.score,
                        "raw": s.raw,
                        "cut": s.cut.map(|c| c.as_str()),
                        "cold": s.cold,
                        "breaker": s.breaker.as_str(),
                        "ramp": s.ramp,
                        "thresholds": s.thresholds.map(|t| json!({
                            "failureRate": t.failure_rate,
                            "agentErrorRate": t.agent_error_rate,
                            "ttftSloMs": t.ttft_slo_ms,
                            "errorBackground": t.error_background,
                            "ttftBackgroundMs": t.ttft_background_ms,
                            "errorEvidence": s.evidence,
                        })),
                        "learned": s.learned,
                        "learnedSamples": router.learned_model(i).map(|_| s.learned_samples),
                        "picks": s.picks,
                        "inflight": s.inflight,
                        "load": s.load,
                        "queued": s.queued,
                        "kv": s.kv,
                        "errorRate": s.error_rate,
                        "windowRequests": s.window_requests,
                        "metricsAgeMs": s.metrics_age_ms,
                        "slowdown": s.slowdown,
                        "slowDecode": s.slow_decode,
                        "decodeMs": s.decode_ms,
                        "gpuSignal": s.gpu_signal.map(|g| g.as_str()),
                        "gpu": s.gpu,
                        "prefixKeys": s.prefix_keys,
                        "prefixHitRate": s.prefix_hit_rate,
                    })
                })
                .collect();
            // `versions`: each model version's split weight, pods and breaker domain (this
            // worker's) with its counts.
            let versions: Vec<Value> = router
                .version_rows(i)
                .iter()
                .map(|r| {
                    let counts: serde_json::Map<String, Value> = r
                        .counts
                        .iter()
                        .iter()
                        .map(|(k, v)| ((*k).to_string(), json!(v)))
                        .collect();
                    json!({
                        "version": r.version,
                        "weight": r.weight,
                        "pods": r.pods,
                        "domain": r.state.as_str(),
                        "counts": counts,
                    })
                })
                .collect();
            json!({
                "name": cfg.map(|c| c.name.as_str()),
                "modelVersions": versions,
                "cluster": cfg.map(|c| c.cluster.as_str()),
                "version": state.map(|s| s.version()),
                "lastEventAgeMs": state.and_then(|s| s.last_event_ms()).map(|t| now_ms.saturating_sub(t)),
                "learned": router.learned_model(i).map(learned_json),
                "pods": pods,
            })
        })
        .collect();
    let counters: serde_json::Map<String, Value> = router
        .counters()
        .iter()
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    json!({ "pools": pools, "counters": counters })
}

/// A pool's `learnedWeights` model: the weights that score (by feature, and the bias), the
/// weights as trained, whether it falls back to the static score and why, its updates, the
/// last batch's mean squared error and the samples pending.
fn learned_json(m: &crate::learned::LearnedModel) -> Value {
    let named = |w: [f64; crate::learned::DIM]| {
        crate::learned::WEIGHT_NAMES
            .iter()
            .zip(w)
            .map(|(n, w)| ((*n).to_string(), json!(w)))
            .collect::<serde_json::Map<String, Value>>()
    };
    json!({
        "weights": named(m.weights()),
        "trained": named(m.trained()),
        "fallback": m.fallback().map(|f| f.as_str()),
        "updates": m.updates(),
        "lastMse": m.last_mse(),
        "pending": m.pending(),
    })
}

/// [`scoreboard`] as compact JSON text (fits a response header when the pool is small).
pub fn scoreboard_json(router: &Router, now_ms: u64) -> String {
    scoreboard(router, now_ms).to_string()
}

/// The debug response header's value for one request: the chosen pod, its score and the
/// ranked list written for override_host, or `pod=none; fallback` when nothing was steered.
pub fn debug_header_value(chosen: Option<&str>, score: f64, ranked: &str) -> String {
    match chosen {
        Some(pod) => format!("pod={pod}; score={score:.3}; ranked={ranked}"),
        None => "pod=none; fallback".to_string(),
    }
}
