//! `learnedWeights` in the picker ([`crate::learned`]): the pool's model is updated when due
//! at a refresh, scores the pods past their cold start in place of the static raw score, and
//! takes a sample from each outcome of a pod with features.

use crate::counters::Counters;
use crate::learned;
use crate::score::{terms, Score};
use crate::signals::PodSignals;

use super::pod::PodRt;
use super::PoolRt;
use crate::config::FilterConfig;

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
    let x = learned::features(&t, sig.error_rate, Some(pod.rel_speed));
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
/// the features its pick saw (`picked`), else its latest.
pub(super) fn sample(
    model: Option<&mut learned::LearnedModel>,
    rt: &mut PodRt,
    picked: Option<learned::Features>,
    failed: bool,
    ttft_ms: Option<u64>,
    total_ms: Option<u64>,
    counters: &mut Counters,
) {
    let Some(m) = model else {
        return;
    };
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
