//! Learned weights (`learnedWeights`): a linear correction of the static formula per pool,
//! trained online by stochastic gradient descent on the outcomes of the pool's requests.
//!
//! The model is logistic regression with the static score as its offset:
//! `health = sigmoid(logit(static) + Σ wᵢ·xᵢ + b)`. Its weights start at 0 (a seeded jitter of
//! at most ±0.01; the `ttft` weight's only upwards), so an untrained model is the static
//! formula, and training can only move a pod away from its static score where the outcomes say
//! the formula is wrong. What scores a pod is
//! `sigmoid(logit(static) + Σ wᵢ·xᵢ)`, floored at `floor` so no healthy pod starves: the bias
//! is trained (it absorbs how far the static scale sits from the outcomes' scale) but does not
//! score, because the picker shares traffic in proportion to the scores and a shift common to
//! every pod would only squeeze or stretch the static ratios (the first design, which replaced
//! the static score with a model from even weights, flattened them: p99 TTFT 1.83x static's
//! with no fault, bench-results/misleading-slow/README.md).
//!
//! Features (0 for a reading a pod does not have): the static formula's four terms
//! ([`crate::score::terms`]: GPU, queue, p99, memory) and `1 − error rate` (the agent's window),
//! each centred to `x − 0.5`; the decode speed relative to the pool (`min(1, pool median ITL /
//! own ITL)`, centred); and `ttft`, what this sidecar saw and no metric shows: the log of the
//! pool median over the pod's own smoothed TTFT of its recent requests as this worker saw them
//! (`min(0, ln(median / own))`, down to −3, 0 for a pod at or under the median or without recent
//! outcomes). A pod whose answers come late for a reason its metrics do not show (a CPU-starved
//! API server, a slow network path) is told apart by that feature alone. Its weight is held at
//! 0 or above: a pod must never score higher for being seen slower. Unbounded, it learned
//! about −0.2 with no fault (ShareGPT at 60–95 %: p99 TTFT 1.09–1.48x static's), because the
//! static formula itself moves traffic off a pod seen slow, so that pod's next requests find it
//! emptier and end well: the outcomes credit the slowness with what the formula did.
//!
//! The target of one request (a sample pairs it with the chosen pod's features and static score
//! as its pick saw them, carried with the request, so a long request teaches the state it was
//! sent into): 0 for a failure (as the breaker judges it), else `0.5·clamp(1 − TTFT/ttftSloMs,
//! 0, 1) + 0.5·clamp(1 − e2e/e2eSloMs, 0, 1)`, the e2e term alone when no TTFT was seen.
//!
//! Safeguards: samples wait in a bounded ring per pool (the oldest dropped, counted) and are
//! trained on every `updateIntervalMs`, one SGD step each on the log loss
//! (`w ← w − lr·((p − y)·x + l2·w)`), each weight clipped to `±clip`. The weights that score
//! are an EMA (`emaAlpha`) of the trained ones, taken at each update. A pod with fewer than
//! `coldStartSamples` samples keeps the static score. The model falls back to the static score
//! for the whole pool (counted by reason) when an update leaves a weight or the loss not finite
//! (the weights restart from their initial values), when it scores under 0.001 every pod of
//! the pool (all-zero output), or when the batch's mean squared error stays above 0.25 (worse
//! than any constant guess of 0.5 could be) for 3 updates in a row (diverging); the next sound
//! update lifts the fallback. Cut-offs and breakers are applied outside the model, as before: a
//! pod cut or refused by its breaker gets nothing whatever the model says.

use std::collections::VecDeque;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::score::Terms;

/// The features, in weight order (the bias last).
pub const FEATURES: [&str; 7] = ["gpu", "queue", "p99", "memory", "errors", "speed", "ttft"];
/// The index of the `ttft` feature, whose weight never goes below 0 ([module docs](self)).
pub const TTFT: usize = 6;
/// Weights: one per feature and the bias.
pub const DIM: usize = FEATURES.len() + 1;
/// The weights' names, for stats and the status page.
pub const WEIGHT_NAMES: [&str; DIM] = [
    "gpu", "queue", "p99", "memory", "errors", "speed", "ttft", "bias",
];

/// The static score is clamped to `[STATIC_EPS, 1 − STATIC_EPS]` before its logit.
pub const STATIC_EPS: f64 = 1e-3;
/// The `ttft` feature's lowest value (a pod e^3 ≈ 20 times slower than the median).
pub const TTFT_FEATURE_MIN: f64 = -3.0;
/// A prediction under this for every pod is an all-zero output.
pub const ALL_ZERO: f64 = 1e-3;
/// A batch's mean squared error over this is a diverging update.
pub const DIVERGE_MSE: f64 = 0.25;
/// Diverging updates in a row that make the model fall back.
pub const DIVERGE_UPDATES: u32 = 3;
/// The offset of the weight gauges: a gauge reads `1_000_000 + round(1000·w)`.
pub const GAUGE_OFFSET: i64 = 1_000_000;

/// The validated `learnedWeights`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LearnedWeights {
    pub learning_rate: f64,
    pub l2: f64,
    pub clip: f64,
    pub update_interval_ms: u64,
    pub cold_start_samples: u32,
    pub ema_alpha: f64,
    pub floor: f64,
    pub seed: u64,
    pub ttft_slo_ms: u64,
    pub e2e_slo_ms: u64,
    pub max_pending: usize,
}

impl Default for LearnedWeights {
    fn default() -> Self {
        Self {
            learning_rate: 0.01,
            l2: 0.001,
            clip: 5.0,
            update_interval_ms: 15_000,
            cold_start_samples: 30,
            ema_alpha: 0.3,
            floor: 0.01,
            seed: 0,
            ttft_slo_ms: 2_000,
            e2e_slo_ms: 30_000,
            max_pending: 4_096,
        }
    }
}

/// Why the model fell back to the static score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// A weight or the loss was not finite.
    NotFinite,
    /// It predicted under [`ALL_ZERO`] for every pod of the pool.
    AllZero,
    /// The batch error stayed over [`DIVERGE_MSE`] for [`DIVERGE_UPDATES`] updates.
    Diverging,
}

impl Fallback {
    pub fn as_str(&self) -> &'static str {
        match self {
            Fallback::NotFinite => "not_finite",
            Fallback::AllZero => "all_zero",
            Fallback::Diverging => "diverging",
        }
    }
}

/// One pod's model input at one moment: its features (a reading it does not have is 0) and
/// the logit of its static score, the model's offset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Features {
    pub x: [f64; FEATURES.len()],
    pub offset: f64,
}

/// The offset of a static score: its logit, the score clamped to `[STATIC_EPS, 1 −
/// STATIC_EPS]` (a score that is not finite counts as 0.5, an offset of 0).
pub fn offset_of(static_raw: f64) -> f64 {
    let s = if static_raw.is_finite() {
        static_raw.clamp(STATIC_EPS, 1.0 - STATIC_EPS)
    } else {
        0.5
    };
    (s / (1.0 - s)).ln()
}

/// A pod's features from its static terms, its agent's error rate, its decode speed relative
/// to the pool (its ITL over the pool median; None: unknown), its observed TTFT relative to the
/// pool (its smoothed TTFT over the pool median; None: unknown) and its static raw score.
pub fn features(
    terms: &Terms,
    error_rate: Option<f64>,
    rel_speed: Option<f64>,
    rel_ttft: Option<f64>,
    static_raw: f64,
) -> Features {
    let c = |v: Option<f64>| {
        v.filter(|x| x.is_finite())
            .map_or(0.0, |x| x.clamp(0.0, 1.0) - 0.5)
    };
    let ttft = rel_ttft
        .filter(|r| r.is_finite() && *r > 0.0)
        .map_or(0.0, |r| (-r.ln()).clamp(TTFT_FEATURE_MIN, 0.0));
    Features {
        x: [
            c(terms.gpu),
            c(terms.queue),
            c(terms.p99),
            c(terms.memory),
            c(error_rate.map(|e| 1.0 - e)),
            c(rel_speed.filter(|r| *r > 0.0).map(|r| (1.0 / r).min(1.0))),
            ttft,
        ],
        offset: offset_of(static_raw),
    }
}

/// What an update did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UpdateReport {
    /// Samples trained on (0: nothing pending, the weights untouched).
    pub trained: usize,
    /// The batch's mean squared error.
    pub mse: Option<f64>,
    /// Set when this update made (or kept) the model fall back.
    pub fallback: Option<Fallback>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    f: Features,
    y: f64,
}

/// One pool's model.
#[derive(Debug, Clone)]
pub struct LearnedModel {
    cfg: LearnedWeights,
    init: [f64; DIM],
    trained: [f64; DIM],
    smoothed: [f64; DIM],
    pending: VecDeque<Sample>,
    next_update_ms: Option<u64>,
    fallback: Option<Fallback>,
    diverging: u32,
    last_mse: Option<f64>,
    updates: u64,
}

/// SplitMix64: the seeded jitter of the initial weights.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// The correction `Σ wᵢ·xᵢ` (no bias).
fn correction(w: &[f64; DIM], f: &Features) -> f64 {
    w.iter().zip(f.x.iter()).map(|(w, x)| w * x).sum::<f64>()
}

/// The model's logit for `f`: offset, correction and bias.
fn logit(w: &[f64; DIM], f: &Features) -> f64 {
    let bias = w.last().copied().unwrap_or(0.0);
    f.offset + correction(w, f) + bias
}

impl LearnedModel {
    /// A model whose initial weights are 0 (the static formula) jittered by at most ±0.01
    /// from `cfg.seed` (`salt` separates pools).
    pub fn new(cfg: LearnedWeights, salt: u64) -> Self {
        let mut state = cfg.seed ^ salt.wrapping_mul(0xd6e8_feb8_6659_fd93);
        let mut init = [0.0; DIM];
        for (i, w) in init.iter_mut().enumerate() {
            let u = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let j = (u - 0.5) * 0.02;
            *w = if i == TTFT { j.abs() } else { j };
        }
        Self {
            cfg,
            init,
            trained: init,
            smoothed: init,
            pending: VecDeque::new(),
            next_update_ms: None,
            fallback: None,
            diverging: 0,
            last_mse: None,
            updates: 0,
        }
    }

    pub fn config(&self) -> &LearnedWeights {
        &self.cfg
    }

    /// The weights that score (the EMA of the trained ones), in [`WEIGHT_NAMES`] order.
    pub fn weights(&self) -> [f64; DIM] {
        self.smoothed
    }

    /// The weights as trained (before the EMA).
    pub fn trained(&self) -> [f64; DIM] {
        self.trained
    }

    /// Why the model falls back to the static score now, if it does.
    pub fn fallback(&self) -> Option<Fallback> {
        self.fallback
    }

    pub fn last_mse(&self) -> Option<f64> {
        self.last_mse
    }

    /// Updates that trained on at least one sample.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The target of one request ([module docs](self)).
    pub fn target(&self, failed: bool, ttft_ms: Option<u64>, total_ms: Option<u64>) -> Option<f64> {
        if failed {
            return Some(0.0);
        }
        let part = |ms: u64, slo: u64| (1.0 - ms as f64 / slo.max(1) as f64).clamp(0.0, 1.0);
        let e2e = total_ms.map(|t| part(t, self.cfg.e2e_slo_ms));
        match (ttft_ms.map(|t| part(t, self.cfg.ttft_slo_ms)), e2e) {
            (Some(t), Some(e)) => Some(0.5 * t + 0.5 * e),
            (Some(t), None) => Some(t),
            (None, e) => e,
        }
    }

    /// Queues a sample for the next update. False when the ring was full and its oldest
    /// sample was dropped.
    pub fn push(&mut self, f: Features, y: f64) -> bool {
        let mut kept = true;
        while self.pending.len() >= self.cfg.max_pending.max(1) {
            self.pending.pop_front();
            kept = false;
        }
        self.pending.push_back(Sample {
            f,
            y: if y.is_finite() {
                y.clamp(0.0, 1.0)
            } else {
                0.0
            },
        });
        kept
    }

    /// When the next update is due: None before the first update, which is due at once
    /// (with nothing pending it only starts the clock).
    pub fn next_update_ms(&self) -> Option<u64> {
        self.next_update_ms
    }

    /// Whether an update is due at `now_ms`.
    pub fn due(&self, now_ms: u64) -> bool {
        self.next_update_ms.is_none_or(|n| now_ms >= n)
    }

    /// The score of a pod with features `f`: its static score corrected by the weights that
    /// score, `sigmoid(offset + Σ wᵢ·xᵢ)` (no bias: [module docs](self)), floored at `floor`;
    /// None while the model falls back.
    pub fn predict(&self, f: &Features) -> Option<f64> {
        if self.fallback.is_some() {
            return None;
        }
        let p = sigmoid(f.offset + correction(&self.smoothed, f));
        p.is_finite().then(|| p.max(self.cfg.floor).min(1.0))
    }

    /// The health the model predicts for `f`, bias included (what it is trained to match).
    pub fn health(&self, f: &Features) -> f64 {
        sigmoid(logit(&self.smoothed, f))
    }

    /// Trains on the pending samples when due (one SGD step each), takes the EMA, and judges
    /// the result against `pool` (the features of the pool's pods that are scored now).
    pub fn update(&mut self, now_ms: u64, pool: &[Features]) -> UpdateReport {
        if !self.due(now_ms) {
            return UpdateReport::default();
        }
        self.next_update_ms = Some(now_ms.saturating_add(self.cfg.update_interval_ms));
        let n = self.pending.len();
        if n == 0 {
            return UpdateReport {
                fallback: self.fallback,
                ..Default::default()
            };
        }
        let (lr, l2, clip) = (self.cfg.learning_rate, self.cfg.l2, self.cfg.clip);
        let mut sq = 0.0;
        for s in self.pending.drain(..) {
            let p = sigmoid(logit(&self.trained, &s.f));
            let err = p - s.y;
            sq += err * err;
            for (i, w) in self.trained.iter_mut().enumerate() {
                let x = s.f.x.get(i).copied().unwrap_or(1.0);
                let g = err * x + l2 * *w;
                // `clamp` keeps a NaN: the check below catches it.
                let lo = if i == TTFT { 0.0 } else { -clip };
                *w = (*w - lr * g).clamp(lo, clip);
            }
        }
        self.updates += 1;
        let mse = sq / n as f64;
        self.last_mse = Some(mse);
        let a = self.cfg.ema_alpha;
        for (s, t) in self.smoothed.iter_mut().zip(self.trained.iter()) {
            *s = a * t + (1.0 - a) * *s;
        }
        let finite = mse.is_finite()
            && self.trained.iter().all(|w| w.is_finite())
            && self.smoothed.iter().all(|w| w.is_finite());
        self.fallback = if !finite {
            self.trained = self.init;
            self.smoothed = self.init;
            self.diverging = 0;
            Some(Fallback::NotFinite)
        } else {
            self.diverging = if mse > DIVERGE_MSE {
                self.diverging.saturating_add(1)
            } else {
                0
            };
            let all_zero = !pool.is_empty()
                && pool
                    .iter()
                    .all(|f| sigmoid(f.offset + correction(&self.smoothed, f)) < ALL_ZERO);
            if all_zero {
                Some(Fallback::AllZero)
            } else if self.diverging >= DIVERGE_UPDATES {
                Some(Fallback::Diverging)
            } else {
                None
            }
        };
        UpdateReport {
            trained: n,
            mse: Some(mse),
            fallback: self.fallback,
        }
    }

    /// `(name, gauge value)` of each scoring weight: `1_000_000 + round(1000·w)` (Envoy gauges
    /// are unsigned; the weights are within ±`clip` ≤ 100).
    pub fn gauges(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        WEIGHT_NAMES
            .iter()
            .zip(self.smoothed.iter())
            .map(|(n, w)| (*n, gauge_value(*w)))
    }
}

/// A weight as its gauge reads it ([`LearnedModel::gauges`]).
pub fn gauge_value(w: f64) -> u64 {
    let milli = if w.is_finite() {
        (w * 1000.0).round().clamp(-1e6, 1e6) as i64
    } else {
        0
    };
    u64::try_from(GAUGE_OFFSET + milli).unwrap_or(0)
}

impl LearnedWeights {
    /// Validates the raw section; errors name `learnedWeights.<field>` and the value.
    pub fn from_raw(raw: &RawLearnedWeights) -> Result<Self, ConfigError> {
        let d = Self::default();
        let err = |field: &str, v: String, why: &str| {
            ConfigError::new(format!("learnedWeights.{field}"), v, why.to_string())
        };
        let real =
            |field: &str, v: Option<f64>, def: f64, ok: &dyn Fn(f64) -> bool, why: &str| match v {
                None => Ok(def),
                Some(x) if x.is_finite() && ok(x) => Ok(x),
                Some(x) => Err(err(field, x.to_string(), why)),
            };
        let int = |field: &str, v: Option<u64>, def: u64, lo: u64, hi: u64| match v {
            None => Ok(def),
            Some(x) if (lo..=hi).contains(&x) => Ok(x),
            Some(x) => Err(err(
                field,
                x.to_string(),
                &format!("must be within {lo}..={hi}"),
            )),
        };
        Ok(Self {
            learning_rate: real(
                "learningRate",
                raw.learning_rate,
                d.learning_rate,
                &|x| x > 0.0 && x <= 1.0,
                "must be within (0, 1]",
            )?,
            l2: real(
                "l2",
                raw.l2,
                d.l2,
                &|x| (0.0..1.0).contains(&x),
                "must be within [0, 1)",
            )?,
            clip: real(
                "clip",
                raw.clip,
                d.clip,
                &|x| x > 0.0 && x <= 100.0,
                "must be within (0, 100]: the largest magnitude of a weight",
            )?,
            update_interval_ms: int(
                "updateIntervalMs",
                raw.update_interval_ms,
                d.update_interval_ms,
                1_000,
                3_600_000,
            )?,
            cold_start_samples: int(
                "coldStartSamples",
                raw.cold_start_samples,
                u64::from(d.cold_start_samples),
                0,
                1_000_000,
            )? as u32,
            ema_alpha: real(
                "emaAlpha",
                raw.ema_alpha,
                d.ema_alpha,
                &|x| x > 0.0 && x <= 1.0,
                "must be within (0, 1]",
            )?,
            floor: real(
                "floor",
                raw.floor,
                d.floor,
                &|x| (0.0..=0.5).contains(&x),
                "must be within [0, 0.5]",
            )?,
            seed: raw.seed.unwrap_or(d.seed),
            ttft_slo_ms: int("ttftSloMs", raw.ttft_slo_ms, d.ttft_slo_ms, 1, 3_600_000)?,
            e2e_slo_ms: int("e2eSloMs", raw.e2e_slo_ms, d.e2e_slo_ms, 1, 3_600_000)?,
            max_pending: int(
                "maxPendingSamples",
                raw.max_pending_samples,
                d.max_pending as u64,
                16,
                65_536,
            )? as usize,
        })
    }
}

/// `learnedWeights` as written; present (an object, even `{}`) turns it on.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "LearnedWeights")
)]
pub struct RawLearnedWeights {
    /// SGD step size.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.01, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    pub learning_rate: Option<f64>,
    /// L2 penalty on the weights (weight decay per step, times the learning rate).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.001, "minimum" = 0, "exclusiveMaximum" = 1))
    )]
    pub l2: Option<f64>,
    /// Each weight is clipped to `±clip`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5.0, "exclusiveMinimum" = 0, "maximum" = 100))
    )]
    pub clip: Option<f64>,
    /// How often the pending samples are trained on and the weights move, ms.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 15_000, "minimum" = 1_000, "maximum" = 3_600_000))
    )]
    pub update_interval_ms: Option<u64>,
    /// Samples a pod needs before the model scores it; until then its static score.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 30, "minimum" = 0, "maximum" = 1_000_000))
    )]
    pub cold_start_samples: Option<u64>,
    /// EMA factor of the weights that score over the trained ones, at each update.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.3, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    pub ema_alpha: Option<f64>,
    /// Least learned score of a pod (so no healthy pod starves).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.01, "minimum" = 0, "maximum" = 0.5))
    )]
    pub floor: Option<f64>,
    /// Seed of the initial weights' jitter (the same seed and inputs give the same weights).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0)))]
    pub seed: Option<u64>,
    /// The TTFT a request's target is judged against: `clamp(1 − TTFT/ttftSloMs, 0, 1)`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2_000, "minimum" = 1, "maximum" = 3_600_000))
    )]
    pub ttft_slo_ms: Option<u64>,
    /// The end-to-end time a request's target is judged against:
    /// `clamp(1 − e2e/e2eSloMs, 0, 1)`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 30_000, "minimum" = 1, "maximum" = 3_600_000))
    )]
    pub e2e_slo_ms: Option<u64>,
    /// Most samples a pool holds between updates (each Envoy worker its own); the oldest is
    /// dropped past it (counted as `learned.samples_dropped`).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 4_096, "minimum" = 16, "maximum" = 65_536))
    )]
    pub max_pending_samples: Option<u64>,
}
