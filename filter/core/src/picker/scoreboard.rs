//! A pool's rows on the scoreboard (status page, debug header, per-pod gauges): each pod's
//! score, cut, breaker, load and readings as the picker sees them now.

use super::Router;
use crate::breaker::BreakerState;
use crate::score::CutReason;

/// A pod's row on the scoreboard.
#[derive(Debug, Clone, PartialEq)]
pub struct PodStatus<'a> {
    pub address: &'a str,
    pub peer: &'a str,
    /// Smoothed score (0 when cut); for a cold pod the pool mean it was given.
    pub score: f64,
    /// The latest unsmoothed formula value.
    pub raw: f64,
    pub cut: Option<CutReason>,
    pub cold: bool,
    pub breaker: BreakerState,
    /// The share of its weight it gets while its traffic ramps back after its breaker closed
    /// (`breaker.recoveryRamp`); 1 otherwise.
    pub ramp: f64,
    /// Its breaker thresholds as adapted to its pool (`breaker.adaptiveThresholds`), with the
    /// pool background they came from; None when that is off.
    pub thresholds: Option<crate::adaptive::Effective>,
    /// Its evidence of failing (`adaptiveThresholds.errorEvidence` on; the breaker opens at
    /// that bound).
    pub evidence: Option<f64>,
    /// `learnedWeights`: the model's score for its features (None: off, no features, or the
    /// model falls back) and the samples this VM trained on from its outcomes.
    pub learned: Option<f64>,
    pub learned_samples: u32,
    pub picks: u64,
    pub inflight: u32,
    /// Estimated occupancy over capacity, as `twoChoices` compares it (see the module docs).
    pub load: f64,
    /// Whether a new request would queue there, as `twoChoices` judges it.
    pub queued: bool,
    /// Estimated KV-cache use 0..1 (the snapshot's, moved by this VM's requests since), when
    /// the pod reports its KV capacity.
    pub kv: Option<f64>,
    /// The pod's error rate over its agent's window and the requests it covers, as reported.
    pub error_rate: Option<f64>,
    pub window_requests: Option<u64>,
    /// Metrics age at the status time (None when no snapshot).
    pub metrics_age_ms: Option<u64>,
    /// A GPU reports a hardware slowdown (the score is scaled by `cutoffs.slowdownFactor`).
    pub slowdown: bool,
    /// The pod decodes at least `cutoffs.slowItlRatio` times slower than the pool's median
    /// (its weight is scaled by its speed relative to the pool, at most `slowdownFactor`).
    pub slow_decode: bool,
    /// Its smoothed recent inter-token latency (ms), as `longOutputTokens` compares it; None
    /// without a reading in the last 5 s.
    pub decode_ms: Option<f64>,
    /// TTFT p99 (ms) as its agent reports it (e2e p99 where the model server gives no TTFT).
    pub ttft_p99_ms: Option<f64>,
    /// The GPU reading its score's GPU term used (`cutoffs.gpuSignal`); None: no GPU term.
    pub gpu_signal: Option<crate::signals::GpuReading>,
    /// That reading's value, 0..=1.
    pub gpu: Option<f64>,
    /// Key blocks its prefix cache holds, as its agent reports them (None: not reported).
    pub prefix_keys: Option<usize>,
    /// Its model server's prefix-cache hit rate (prompt tokens) over the agent's window.
    pub prefix_hit_rate: Option<f64>,
}

/// A pool's thresholds in force ([`Router::pool_thresholds`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolThresholds {
    pub failure_rate: f64,
    pub agent_error_rate: f64,
    pub ttft_slo_ms: Option<u64>,
}

impl PoolThresholds {
    /// `(gauge suffix, value)`: the rates x1000, the SLO in ms (absent when off).
    pub fn gauges(&self) -> impl Iterator<Item = (&'static str, u64)> {
        let permille = |x: f64| (x.clamp(0.0, 1.0) * 1000.0).round() as u64;
        [
            Some(("failure_rate_permille", permille(self.failure_rate))),
            Some(("agent_error_rate_permille", permille(self.agent_error_rate))),
            self.ttft_slo_ms.map(|s| ("ttft_slo_ms", s)),
        ]
        .into_iter()
        .flatten()
    }
}

impl PodStatus<'_> {
    /// The value of the per-pod `score` gauges: the smoothed score x1000, 0..=1000.
    pub fn score_gauge_value(&self) -> u64 {
        (self.score.clamp(0.0, 1.0) * 1000.0).round() as u64
    }

    /// The value of the per-pod `gpu_signal` gauges
    /// ([`crate::signals::GpuReading::gauge_value`]).
    pub fn gpu_signal_gauge_value(&self) -> u64 {
        crate::signals::GpuReading::gauge_value(self.gpu_signal)
    }
}

impl Router {
    /// The pool's model (`learnedWeights`; None when that is off or no such pool).
    pub fn learned_model(&self, pool_idx: usize) -> Option<&crate::learned::LearnedModel> {
        self.pools.get(pool_idx)?.learned.as_ref()
    }

    /// The pool's breaker thresholds in force with `breaker.adaptiveThresholds` on: for each of
    /// `failureRate`, `agentErrorRate` and `ttftSloMs`, the median over its pods (each pod's own
    /// comes from the other pods' readings). None when that is off or the pool has no pods.
    pub fn pool_thresholds(&self, pool_idx: usize) -> Option<PoolThresholds> {
        let p = self.pools.get(pool_idx)?;
        let mut fr = Vec::new();
        let mut ar = Vec::new();
        let mut slo = Vec::new();
        for t in p.pods.iter().filter_map(|r| r.thresholds) {
            fr.push(t.failure_rate);
            ar.push(t.agent_error_rate);
            slo.extend(t.ttft_slo_ms.map(|s| s as f64));
        }
        let median = |mut v: Vec<f64>| {
            v.sort_unstable_by(f64::total_cmp);
            crate::adaptive::median_without(&v, None, 1)
        };
        Some(PoolThresholds {
            failure_rate: median(fr)?,
            agent_error_rate: median(ar)?,
            ttft_slo_ms: median(slo).map(|s| s.round() as u64),
        })
    }

    /// Scoreboard rows of one pool at `now_ms`.
    pub fn pod_status(&self, pool_idx: usize, now_ms: u64) -> Vec<PodStatus<'_>> {
        let Some(p) = self.pools.get(pool_idx) else {
            return Vec::new();
        };
        p.pods
            .iter()
            .map(|r| {
                let entry = p.state.peers().get(r.peer_idx);
                let sig = entry.and_then(|e| e.signals.as_ref());
                PodStatus {
                    address: &r.address,
                    peer: entry.map_or("", |e| e.peer.as_str()),
                    score: r.shown,
                    raw: r.score.raw,
                    cut: r.cut,
                    cold: r.cold,
                    breaker: r.breaker.state(),
                    ramp: self
                        .cfg
                        .breaker
                        .recovery_ramp
                        .and_then(|ramp| ramp.at(&r.breaker, now_ms))
                        .map_or(1.0, |s| s.share),
                    thresholds: r.thresholds,
                    evidence: r
                        .thresholds
                        .filter(|t| t.error_evidence > 0.0)
                        .map(|_| r.evidence.score()),
                    learned: r.learned,
                    learned_samples: r.learned_samples,
                    picks: r.picks,
                    inflight: r.inflight,
                    load: r.load(),
                    queued: r.pick_key(0.0, false, None, now_ms).0 > 0,
                    kv: r.kv_used().zip(r.kv_cap).map(|(u, c)| u / c),
                    error_rate: sig.and_then(|s| s.error_rate),
                    window_requests: sig.and_then(|s| s.window_requests),
                    metrics_age_ms: sig.map(|s| s.age_ms(now_ms)),
                    slowdown: sig.is_some_and(|s| s.slowdown),
                    slow_decode: r.slow_decode,
                    decode_ms: r.decode_ms(now_ms),
                    ttft_p99_ms: sig.and_then(|s| s.p99_ms),
                    gpu_signal: r.score.gpu_reading,
                    gpu: r.score.gpu_value,
                    prefix_keys: sig.and_then(|s| s.prefix.as_ref()).map(|p| p.keys.len()),
                    prefix_hit_rate: sig.and_then(|s| s.prefix_hit_rate),
                }
            })
            .collect()
    }
}
