//! Adaptive breaker thresholds (`breaker.adaptiveThresholds`): the failure-rate thresholds
//! (`failureRate`, `agentErrorRate`) and the TTFT SLO (`ttftSloMs`) of each pod move within
//! `base · (1 ± maxAdjust)` with what the rest of its pool shows, so a pool whose healthy pods
//! all fail a background share of requests (or all have a long TTFT tail) does not see its
//! pods cut on noise, and a quiet pool cuts a pod that starts failing sooner.
//!
//! The pool's background is the median, over the *other* pods of the pool with fresh agent
//! metrics (a window of at least `minRequests` requests for the error rate), of the agent's
//! error rate and of its TTFT p99. Leaving the pod out means a pod that is itself the outlier
//! cannot raise its own threshold; the median means one other sick pod cannot raise it either.
//! With fewer than `minPods` such other pods the static thresholds apply (counted as
//! `breaker_thresholds_static`).
//!
//! The factor is linear in the background relative to the base threshold, `r = background /
//! base`: `1 − maxAdjust` for a pool showing nothing (r = 0), `1 + maxAdjust` once `r` reaches
//! `noisyAt` (`errorNoisyAt` for the rates, `latencyNoisyAt` for the TTFT p99 against the
//! SLO), the base half-way. Both rates take one factor, judged against the lower of them in use
//! (`agentErrorRate`, unless it is 0): one worker's failure window sees fewer outcomes than the
//! agent, so it is at least as noisy. For that rate the factor reads `threshold = (1 − m)·base +
//! (2m / noisyAt)·background` up to the cap: with the defaults (m 0.3, errorNoisyAt 0.4), 1.5
//! times the background above 0.7 of the base, so the threshold never falls below the pool's
//! own background. Deterministic: the same pool state gives every worker and every sidecar the
//! same thresholds, so nothing more is stored in the shared breaker.
//!
//! `errorEvidence` adds a second judge of the agent's counts, a sequential test (CUSUM, Page
//! 1954) of each pod's outcomes ([`Evidence`]): from the increase of the model server's own
//! counters between snapshots, every finished request adds `ln(p1/p0)` if it failed and
//! `ln((1 − p1)/(1 − p0))` if not, the sum never below 0; the pod's breaker opens (reason
//! `agent_error_rate`) when it reaches `errorEvidence`. `p0` is two thirds of the pod's adapted
//! `agentErrorRate` (the rate its pool's noise makes ordinary), `p1` twice the base one (a pod
//! failing that much is cut within a few failures). Only outcomes since a change add evidence,
//! where the windowed rate dilutes a fault's first seconds with the successes before it; so a
//! raised threshold keeps a pool's noise out while a real fault is still cut about as soon as
//! the static threshold cut it in simulation (`bench-results/fault-noisy/`, its simulation and
//! runs; off by default: in the bench runs it opened more breakers on noise). Each worker keeps
//! its own sum from the snapshots it installs.

use serde::Deserialize;

use crate::config::BreakerConfig;
use crate::error::ConfigError;

/// `errorEvidence`'s default: off. In simulation of `fault-noisy`'s statistics (8 %
/// background, 20 % bursts, a 50 % fault; `bench-results/fault-noisy/detectors_sim.py`) the
/// test at 3 beside the raised windowed threshold made 0.39x the false trips of the static
/// threshold and cut the fault in 0.95x its time; in three bench runs it cut the fault sooner
/// (0.47x where measurable) but opened breakers on the noise more often than the windowed
/// threshold alone (1.23x, 1.27x, 0.15x the static threshold's openings, against 1.47x, 0.54x,
/// 0.33x without it), so it is not on until runs show the false trips fall.
pub const DEFAULT_ERROR_EVIDENCE: f64 = 0.0;

/// The validated `breaker.adaptiveThresholds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveThresholds {
    /// Most a threshold moves from its base, as a share of it (0 < m < 1).
    pub max_adjust: f64,
    /// Background error rate, as a share of the base rate threshold, at which the threshold is
    /// raised the whole `max_adjust`.
    pub error_noisy_at: f64,
    /// Background TTFT p99, as a share of `ttftSloMs`, at which the SLO is raised the whole
    /// `max_adjust`.
    pub latency_noisy_at: f64,
    /// Other pods with fresh readings needed for a background (fewer: the static thresholds).
    pub min_pods: u32,
    /// Requests a pod's agent window must hold for its error rate to count in the background.
    pub min_requests: u32,
    /// Evidence (nats) a pod's outcomes must build against its adapted error rate before its
    /// breaker opens ([`Evidence`]); 0: off.
    pub error_evidence: f64,
}

impl Default for AdaptiveThresholds {
    fn default() -> Self {
        Self {
            max_adjust: 0.3,
            error_noisy_at: 0.4,
            latency_noisy_at: 1.0,
            min_pods: 2,
            min_requests: 20,
            error_evidence: DEFAULT_ERROR_EVIDENCE,
        }
    }
}

impl AdaptiveThresholds {
    /// The factor for a threshold whose base is `base` in a pool showing `background` (same
    /// unit), at `noisy_at`: within `1 ± max_adjust`. A non-finite or negative background, or a
    /// base that is not positive, gives 1 (the static threshold).
    pub fn factor(&self, background: f64, base: f64, noisy_at: f64) -> f64 {
        if !(background.is_finite() && background >= 0.0 && base > 0.0 && noisy_at > 0.0) {
            return 1.0;
        }
        let r = (background / (base * noisy_at)).min(1.0);
        let m = self.max_adjust;
        (1.0 - m + 2.0 * m * r).clamp(1.0 - m, 1.0 + m)
    }

    /// The thresholds for a pod whose pool's background (the other pods) is `errors` (their
    /// median error rate) and `ttft_p99_ms` (their median TTFT p99); None of either: that
    /// threshold stays static.
    pub fn effective(
        &self,
        base: &BreakerConfig,
        errors: Option<f64>,
        ttft_p99_ms: Option<f64>,
    ) -> Effective {
        // One factor for both rates, judged against the lower one in use (`agentErrorRate`
        // unless it is off): the per-worker window sees fewer outcomes than the agent, so it is
        // at least as noisy, and a background that is noise for one is noise for the other.
        let judged = if base.agent_error_rate > 0.0 {
            base.agent_error_rate.min(base.failure_rate)
        } else {
            base.failure_rate
        };
        let error_factor = errors.map_or(1.0, |e| self.factor(e, judged, self.error_noisy_at));
        let rate = |b: f64| (b * error_factor).min(1.0);
        let ttft_factor = match (ttft_p99_ms, base.ttft_slo_ms) {
            (Some(p), Some(slo)) => self.factor(p, slo as f64, self.latency_noisy_at),
            _ => 1.0,
        };
        Effective {
            failure_rate: rate(base.failure_rate),
            agent_error_rate: rate(base.agent_error_rate),
            ttft_slo_ms: base
                .ttft_slo_ms
                .map(|slo| ((slo as f64 * ttft_factor).round() as u64).max(1)),
            error_factor,
            ttft_factor,
            error_background: errors,
            ttft_background_ms: ttft_p99_ms,
            error_evidence: self.error_evidence,
        }
    }

    /// Validates the raw section; errors name `breaker.adaptiveThresholds.<field>` and the
    /// value.
    pub fn from_raw(raw: &RawAdaptiveThresholds) -> Result<Self, ConfigError> {
        let d = Self::default();
        let share = |field: &str, v: Option<f64>, def: f64, lo: f64, hi: f64, why: &str| match v {
            None => Ok(def),
            Some(x) if x.is_finite() && x > lo && x <= hi => Ok(x),
            Some(x) => Err(ConfigError::new(
                format!("breaker.adaptiveThresholds.{field}"),
                x,
                why.to_string(),
            )),
        };
        let count = |field: &str, v: Option<u64>, def: u32, lo: u64, hi: u64| match v {
            None => Ok(def),
            Some(x) if (lo..=hi).contains(&x) => Ok(x as u32),
            Some(x) => Err(ConfigError::new(
                format!("breaker.adaptiveThresholds.{field}"),
                x,
                format!("must be within {lo}..={hi}"),
            )),
        };
        Ok(Self {
            max_adjust: share(
                "maxAdjust",
                raw.max_adjust,
                d.max_adjust,
                0.0,
                0.9,
                "must be within (0, 0.9]: the share of its base a threshold may move",
            )?,
            error_noisy_at: share(
                "errorNoisyAt",
                raw.error_noisy_at,
                d.error_noisy_at,
                0.0,
                1.0,
                "must be within (0, 1]: the background error rate, as a share of the base threshold, that raises it fully",
            )?,
            latency_noisy_at: share(
                "latencyNoisyAt",
                raw.latency_noisy_at,
                d.latency_noisy_at,
                0.0,
                10.0,
                "must be within (0, 10]: the background TTFT p99, as a share of ttftSloMs, that raises it fully",
            )?,
            min_pods: count("minPods", raw.min_pods, d.min_pods, 1, 10_000)?,
            min_requests: count("minRequests", raw.min_requests, d.min_requests, 1, 1_000_000)?,
            error_evidence: match raw.error_evidence {
                None => d.error_evidence,
                Some(x) if x.is_finite() && (0.0..=100.0).contains(&x) => x,
                Some(x) => {
                    return Err(ConfigError::new(
                        "breaker.adaptiveThresholds.errorEvidence",
                        x,
                        "must be within [0, 100]: the evidence (nats) a pod's failures build before its breaker opens; 0 turns the test off".to_string(),
                    ))
                }
            },
        })
    }
}

/// A pod's thresholds as adapted to its pool, and the factors that made them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Effective {
    pub failure_rate: f64,
    pub agent_error_rate: f64,
    pub ttft_slo_ms: Option<u64>,
    /// The factor on `failureRate` and `agentErrorRate` (1: static).
    pub error_factor: f64,
    /// The factor on `ttftSloMs` (1: static).
    pub ttft_factor: f64,
    /// The pool's background the factors came from (None: too few other pods reported it,
    /// the static threshold applies).
    pub error_background: Option<f64>,
    pub ttft_background_ms: Option<f64>,
    /// `errorEvidence` (0: off).
    pub error_evidence: f64,
}

impl Effective {
    /// No background for either threshold: the static ones apply.
    pub fn is_static(&self) -> bool {
        self.error_background.is_none() && self.ttft_background_ms.is_none()
    }

    /// `base` with these thresholds in place of its own.
    pub fn apply(&self, base: &BreakerConfig) -> BreakerConfig {
        BreakerConfig {
            failure_rate: self.failure_rate,
            agent_error_rate: if base.agent_error_rate > 0.0 {
                self.agent_error_rate
            } else {
                0.0
            },
            ttft_slo_ms: self.ttft_slo_ms,
            ..*base
        }
    }
}

/// A pod's evidence that it fails more than its pool's noise explains (`errorEvidence`): a
/// CUSUM over its model server's outcomes, fed from the counters' increase between the
/// snapshots this worker installs (so a skipped snapshot loses nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Evidence {
    /// The counters (finished, failed) at the last snapshot observed.
    last: Option<(f64, f64)>,
    score: f64,
}

impl Evidence {
    /// The test's two failure rates for a pod whose adapted `agentErrorRate` is `threshold` and
    /// base one `base`: `p0` = 2/3 of `threshold`, `p1` = 2 × `base` (at most 0.95); None when
    /// `p0` is not below `p1` or is 0.
    pub fn rates(threshold: f64, base: f64) -> Option<(f64, f64)> {
        let p1 = (2.0 * base).min(0.95);
        let p0 = threshold * 2.0 / 3.0;
        (p0 > 0.0 && p0 < p1).then_some((p0, p1))
    }

    /// Adds the outcomes counted since the last observed `totals` (finished, failed) and
    /// answers the evidence. A snapshot without counts (its model server unread this time)
    /// changes nothing: the next counts' increase covers the gap. The first counts, or counts
    /// that went back (the server restarted) or failures that grew more than the finished,
    /// start it again from 0.
    pub fn observe(&mut self, totals: Option<(f64, f64)>, (p0, p1): (f64, f64)) -> f64 {
        let Some((f, e)) = totals else {
            return self.score;
        };
        match self.last.replace((f, e)) {
            Some((f0, e0)) if f >= f0 && e >= e0 && e - e0 <= f - f0 => {
                let (n, k) = (f - f0, e - e0);
                let step = k * (p1 / p0).ln() + (n - k) * ((1.0 - p1) / (1.0 - p0)).ln();
                let score = (self.score + step).max(0.0);
                self.score = if score.is_finite() { score } else { 0.0 };
            }
            _ => self.score = 0.0,
        }
        self.score
    }

    /// Forgets the evidence (the breaker opened, or is not closed); the counters stay.
    pub fn clear(&mut self) {
        self.score = 0.0;
    }

    pub fn score(&self) -> f64 {
        self.score
    }
}

/// The median of `sorted` (ascending) without its element at `skip` (None: all of it); None
/// when fewer than `min` values remain.
pub fn median_without(sorted: &[f64], skip: Option<usize>, min: usize) -> Option<f64> {
    let skip = skip.filter(|&i| i < sorted.len());
    let n = sorted.len() - usize::from(skip.is_some());
    if n == 0 || n < min {
        return None;
    }
    let at = |k: usize| {
        let i = match skip {
            Some(s) if k >= s => k + 1,
            _ => k,
        };
        sorted.get(i).copied()
    };
    let hi = at(n / 2)?;
    let lo = at((n - 1) / 2)?;
    Some((lo + hi) / 2.0)
}

/// `breaker.adaptiveThresholds` as written; present (an object, even `{}`) turns it on.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "AdaptiveThresholds")
)]
pub struct RawAdaptiveThresholds {
    /// Most a threshold moves from its configured base, as a share of it: each stays within
    /// `base · (1 ± maxAdjust)`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.3, "exclusiveMinimum" = 0, "maximum" = 0.9))
    )]
    pub max_adjust: Option<f64>,
    /// The pool's background error rate (the median of the other pods' agent error rates), as
    /// a share of the lower rate threshold in use (`agentErrorRate`, or `failureRate` when that
    /// is 0), at which both rate thresholds are raised the whole `maxAdjust`; a pool failing
    /// nothing lowers them the whole `maxAdjust`, linearly in between (the base at half of it).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.4, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    pub error_noisy_at: Option<f64>,
    /// The pool's background TTFT p99 (the median of the other pods' TTFT p99 as their agents
    /// report it; an agent reporting only the end-to-end p99 gives none), as a share of
    /// `ttftSloMs`, at which the SLO is raised the whole `maxAdjust`; a p99 near 0 lowers it the
    /// whole `maxAdjust`, linearly in between.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 1.0, "exclusiveMinimum" = 0, "maximum" = 10))
    )]
    pub latency_noisy_at: Option<f64>,
    /// Other pods of the pool with fresh agent readings needed before a pod's thresholds move;
    /// fewer: its static thresholds (counted as `breaker_thresholds_static`).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2, "minimum" = 1, "maximum" = 10_000))
    )]
    pub min_pods: Option<u64>,
    /// Requests a pod's agent window must hold for its error rate to count in the background.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 20, "minimum" = 1, "maximum" = 1_000_000))
    )]
    pub min_requests: Option<u64>,
    /// Evidence (in nats) a pod's own outcomes must build before its breaker opens, in a
    /// sequential test (CUSUM) of its model server's counts beside the windowed rate: each
    /// failure adds `ln(p1/p0)`, each success `ln((1 − p1)/(1 − p0))` (negative), the sum kept
    /// at 0 or more, with `p0` two thirds of the pod's adapted `agentErrorRate` and `p1` twice
    /// the base one. At 3, with `agentErrorRate` 0.25 in a pool at an 8 % background, a pod
    /// failing half its requests opens after about 13 of them (the windowed rate needs its
    /// window to fill with them first); one failing 20 % drifts back to 0. Measured in
    /// `fault-noisy` it cut the fault sooner but opened more breakers on the pool's noise than
    /// the raised window alone (`bench-results/fault-noisy/README.md`), hence off by default:
    /// for pools where cutting a failing pod fast matters more than a few more cuts on noise.
    /// Needs agents that send the model server's counts (`finished_total`, `errors_total`);
    /// without them only the windowed rate judges. 0: off.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.0, "minimum" = 0, "maximum" = 100))
    )]
    pub error_evidence: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_leaves_out_the_skipped_value() {
        let s = [0.0, 0.1, 0.2, 0.9];
        assert_eq!(median_without(&s, None, 1), Some(0.15000000000000002));
        assert_eq!(median_without(&s, Some(3), 1), Some(0.1));
        assert_eq!(median_without(&s, Some(0), 1), Some(0.2));
        assert_eq!(median_without(&s, Some(0), 4), None);
        assert_eq!(median_without(&[0.5], Some(0), 1), None);
        assert_eq!(median_without(&[], None, 1), None);
    }

    #[test]
    fn the_factor_is_clamped_and_monotone() {
        let a = AdaptiveThresholds::default();
        let near = |x: f64, y: f64| (x - y).abs() < 1e-9;
        assert!(near(a.factor(0.0, 0.25, 0.4), 0.7));
        assert!(near(a.factor(0.05, 0.25, 0.4), 1.0));
        assert!(near(a.factor(0.1, 0.25, 0.4), 1.3));
        assert!(near(a.factor(0.9, 0.25, 0.4), 1.3));
        assert_eq!(a.factor(f64::NAN, 0.25, 0.4), 1.0);
        assert_eq!(a.factor(-1.0, 0.25, 0.4), 1.0);
        let mut last = 0.0;
        for i in 0..100 {
            let f = a.factor(f64::from(i) / 100.0, 0.25, 0.4);
            assert!(f >= last && (0.7..=1.3).contains(&f));
            last = f;
        }
    }
}
