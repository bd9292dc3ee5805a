//! `learnedWeights` in the picker ([`crate::learned`]): the pool's model is updated when due
//! at a refresh, corrects the static raw score of the pods past their cold start, and takes a
//! sample from each outcome of a pod with features (which also moves the pod's observed TTFT,
//! its `ttft` feature).

use crate::counters::Counters;
use crate::learned;
use crate::score::{terms, Score};
use crate::signals::PodSignals;

use super::pod::PodRt;
use super::PoolRt;
use crate::config::FilterConfig;

/// How long a pod's observed TTFT counts after its latest outcome (ms): a pod the pool has
/// stopped sending to is not judged for ever on what it did then.
pub(super) const TTFT_HOLD_MS: u64 = 30_000;
/// The weight of a new outcome in a pod's observed TTFT.
const TTFT_ALPHA: f64 = 0.2;
/// Pods with a recent observed TTFT needed for a pool median (fewer: no `ttft` feature).
const MIN_TTFT_PODS: usize = 3;

/// Each pod's observed TTFT relative to the pool's median of those (pods with an outcome in
/// the last [`TTFT_HOLD_MS`], at least [`MIN_TTFT_PODS`]), when the model is on.
pub(super) fn set_rel_ttfts(p: &mut PoolRt, now_ms: u64) {
    if p.learned.is_none() {
        return;
    }
    let recent = |r: &PodRt| {
        r.seen_ttft_ms
            .filter(|_| now_ms.saturating_sub(r.seen_ttft_at_ms) <= TTFT_HOLD_MS)
    };
    // The pool's ITL scratch is free here (the ITL median is taken before, the speeds after).
    let mut seen = std::mem::take(&mut p.itl_scratch);
    seen.clear();
    seen.extend(p.pods.iter().filter_map(recent));
    let median = super::refresh::median(&mut seen, MIN_TTFT_PODS).filter(|m| *m > 0.0);
    p.itl_scratch = seen;
    for pod in p.pods.iter_mut() {
        pod.rel_ttft = match (median, recent(pod)) {
            (Some(m), Some(t)) => Some(t.max(1.0) / m),
            _ => None,
        };
    }
}

/// Trains the pool's model when an update is due (on the features of its pods that are not
/// cut as of the last refresh), counting the update and any fallback. Returns when the next
/// update is due (u64::MAX when the model is off).
pub(super) fn update_model(p: &mut PoolRt, counters: &mut Counters, now_ms: u64) -> u64 {
    let Some(m) = p.learned.as_mut() else {
        return u64::MAX;
    };
    if m.due(now_ms) {
        let pool: Vec<learned::Features> = p
            .pods
            .iter()
            .filter(|r| r.cut.is_none())
            .filter_map(|r| r.features)
            .collect();
        let r = m.update(now_ms, &pool);
        if r.trained > 0 {
            counters.learned_updates += 1;
            if let Some(f) = r.fallback {
                counters.count_learned_fallback(f);
            }
        }
    }
    m.next_update_ms().unwrap_or(now_ms)
}

/// Sets the pod's features and the model's score for them, and puts that score in place of
/// the static raw score when the pod is past its cold start and the model is sound. Cuts stay
/// as the static scoring judged them.
pub(super) fn score_pod(
    pod: &mut PodRt,
    model: Option<&learned::LearnedModel>,
    sig: &PodSignals,
    gpu_fill: Option<f64>,
    cfg: &FilterConfig,
    s: &mut Score,
) {
    let Some(m) = model else {
        pod.features = None;
        pod.learned = None;
        return;
    };
    if !sig.has_metrics || !s.has_terms {
        pod.features = None;
        pod.learned = None;
        return;
    }
    let t = terms(sig, &cfg.cutoffs, gpu_fill);
    // Its decode speed relative to the pool (1, the median's, when unknown).
    let x = learned::features(&t, sig.error_rate, Some(pod.rel_speed), pod.rel_ttft, s.raw);
    pod.features = Some(x);
    pod.learned = m.predict(&x);
    if pod.learned_samples < m.config().cold_start_samples {
        return;
    }
    if let Some(v) = pod.learned {
        s.raw = v;
        s.value = if s.cut.is_some() { 0.0 } else { v * s.penalty };
    }
}

/// Takes a sample from an outcome of `pod` (`failed`: as its breaker judged it), paired with
/// the features its pick saw (`picked`), else its latest; and moves the pod's observed TTFT.
#[allow(clippy::too_many_arguments)]
pub(super) fn sample(
    model: Option<&mut learned::LearnedModel>,
    rt: &mut PodRt,
    picked: Option<learned::Features>,
    failed: bool,
    ttft_ms: Option<u64>,
    total_ms: Option<u64>,
    counters: &mut Counters,
    now_ms: u64,
) {
    let Some(m) = model else {
        return;
    };
    if let Some(t) = ttft_ms.filter(|_| !failed) {
        let t = t as f64;
        let fresh = now_ms.saturating_sub(rt.seen_ttft_at_ms) <= TTFT_HOLD_MS;
        rt.seen_ttft_ms = Some(match rt.seen_ttft_ms.filter(|_| fresh) {
            Some(e) => TTFT_ALPHA * t + (1.0 - TTFT_ALPHA) * e,
            None => t,
        });
        rt.seen_ttft_at_ms = now_ms;
    }
    let Some(x) = picked.or(rt.features) else {
        return;
    };
    let Some(y) = m.target(failed, ttft_ms, total_ms) else {
        return;
    };
    counters.learned_samples += 1;
    if !m.push(x, y) {
        counters.learned_samples_dropped += 1;
    }
    rt.learned_samples = rt.learned_samples.saturating_add(1);
}

impl super::Router {
    /// The `learnedWeights` features of `pod` in pool `pool_idx` as of its latest snapshot
    /// (None: that is off, or the pod has none): what a request picked now would be trained
    /// on when it ends ([`super::Router::on_outcome_picked`]).
    pub fn learned_features(&self, pool_idx: usize, pod: &str) -> Option<learned::Features> {
        let p = self.pools.get(pool_idx)?;
        p.learned.as_ref()?;
        let id = *p.by_addr.get(pod)?;
        p.pods.get(id as usize)?.features
    }
}
