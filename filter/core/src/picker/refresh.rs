//! Re-weighs a pool's pods when its state changed, a breaker moved, or a deadline passed (a
//! snapshot going stale, a cooldown ending): their scores and cuts, the agents' breaker
//! signals, their decode speed relative to the pool, their draw weights, and every view.

use super::breakers::{judge_breakers, BreakerSinks};
use super::pod::{PodRt, MAX_REL_SPEED, MIN_REL_SPEED};
use super::view::{build_view, View};
use super::{PoolRt, Router};
use crate::breaker::{BreakerEvent, BreakerState};
use crate::config::{FilterConfig, PickStrategy};
use crate::pool::PoolState;
use crate::score::{score_in_pool, CutReason};

/// Fewest pods reporting a recent inter-token latency for the pool's median to judge one
/// slow: with two, either could be the odd one.
pub(super) const MIN_ITL_PODS: usize = 3;

/// What a refresh reads from the whole pool before it judges each pod.
struct PoolReadings {
    /// More than half of the pool's pods fail at the agent threshold: a pool-wide problem,
    /// not a pod to cut (cutting them all would only fail open).
    wide_errors: bool,
    /// The pool's median recent inter-token latency ([`median_recent_itl`]); with it, the
    /// pods' own readings by GPU kind are in `PoolRt::itl_kinds`.
    itl_median: Option<f64>,
    /// The pool's mean GPU reading, for the pods that lack it (see `score_in_pool`).
    gpu_fill: Option<f64>,
}

impl PoolReadings {
    fn of(p: &mut PoolRt, cfg: &FilterConfig, now_ms: u64) -> Self {
        Self {
            wide_errors: pool_wide_errors(&p.state, cfg),
            itl_median: median_recent_itl(p, cfg, now_ms),
            gpu_fill: gpu_fill(&p.state, cfg, now_ms),
        }
    }
}

/// Whether more than half of the pool's pods fail at `breaker.agentErrorRate` (false when it is
/// off).
fn pool_wide_errors(state: &PoolState, cfg: &FilterConfig) -> bool {
    cfg.breaker.agent_error_rate > 0.0 && {
        let (mut pods, mut failing) = (0u32, 0u32);
        for sig in state.peers().iter().filter_map(|e| e.signals.as_ref()) {
            pods += 1;
            if sig.failing(
                cfg.breaker.agent_error_rate,
                cfg.breaker.failure_rate_min_requests,
            ) {
                failing += 1;
            }
        }
        2 * failing > pods
    }
}

/// A pod's readings that count in its pool's background for `breaker.adaptiveThresholds`:
/// (error rate over at least `minRequests`, TTFT p99), each None when it does not count (no
/// fresh metrics, the model server down, a non-finite value).
fn background_readings(
    sig: &crate::signals::PodSignals,
    a: &crate::adaptive::AdaptiveThresholds,
    cfg: &FilterConfig,
    now_ms: u64,
) -> (Option<f64>, Option<f64>) {
    if !sig.has_metrics || sig.model_server_down || sig.is_stale(now_ms, cfg.cutoffs.staleness_ms) {
        return (None, None);
    }
    let errors = sig
        .error_rate
        .filter(|e| e.is_finite() && (0.0..=1.0).contains(e))
        .filter(|_| sig.window_requests.unwrap_or(0) >= u64::from(a.min_requests));
    // The TTFT p99 alone: an e2e p99 (an agent without TTFT) is no background for a TTFT SLO.
    let p99 = sig.ttft_p99_ms.filter(|p| p.is_finite() && *p >= 0.0);
    (errors, p99)
}

/// Each pod's breaker thresholds as adapted to the rest of its pool
/// (`breaker.adaptiveThresholds`, [`crate::adaptive`]): the median, over the other pods with
/// fresh readings, of their error rate and TTFT p99. None for every pod when that is off.
fn adapt_thresholds(p: &mut PoolRt, cfg: &FilterConfig, now_ms: u64) {
    let Some(a) = cfg.breaker.adaptive_thresholds else {
        for pod in p.pods.iter_mut() {
            pod.thresholds = None;
        }
        return;
    };
    let peers = p.state.peers();
    let mut errors = Vec::with_capacity(peers.len());
    let mut p99s = Vec::with_capacity(peers.len());
    for sig in peers.iter().filter_map(|e| e.signals.as_ref()) {
        let (e, t) = background_readings(sig, &a, cfg, now_ms);
        errors.extend(e);
        p99s.extend(t);
    }
    errors.sort_unstable_by(f64::total_cmp);
    p99s.sort_unstable_by(f64::total_cmp);
    let min = a.min_pods as usize;
    // Its own reading's place in the sorted list (any equal value will do), left out.
    let skip = |sorted: &[f64], own: Option<f64>| {
        own.map(|v| sorted.partition_point(|x| x.total_cmp(&v).is_lt()))
    };
    for pod in p.pods.iter_mut() {
        let own = peers
            .get(pod.peer_idx)
            .and_then(|e| e.signals.as_ref())
            .map_or((None, None), |sig| {
                background_readings(sig, &a, cfg, now_ms)
            });
        let e = crate::adaptive::median_without(&errors, skip(&errors, own.0), min);
        let t = crate::adaptive::median_without(&p99s, skip(&p99s, own.1), min);
        pod.thresholds = Some(a.effective(&cfg.breaker, e, t));
    }
}

/// How often a counting-down pod's share is recomputed (ms): its share falls with time, and
/// its cut is due at a time of its own.
const PRE_OOM_REFRESH_MS: u64 = 250;

/// Applies `preOom` ([`crate::pre_oom`]) to a pod's score: its penalty lowered while its agent
/// counts down, cut from `cutBeforeMs` before the projected OOM. Only a pod not already cut
/// (a stale one is cut as stale). Counts each episode's start and cut once. Returns when the
/// pool must be refreshed again for it (None: not counting down).
fn degrade_before_oom(
    pod: &mut PodRt,
    sig: &crate::signals::PodSignals,
    s: &mut crate::score::Score,
    cfg: &FilterConfig,
    now_ms: u64,
    counters: &mut crate::counters::Counters,
) -> Option<u64> {
    use crate::pre_oom::{judge, Phase, Verdict};
    let judged = match (cfg.pre_oom.as_ref(), sig.pre_oom.as_ref()) {
        (Some(c), Some(p)) if s.cut.is_none() && sig.has_metrics => Some(judge(p, c, now_ms)),
        _ => None,
    };
    let mut due = now_ms.saturating_add(PRE_OOM_REFRESH_MS);
    let phase = match judged {
        // The state cleared (the agent stopped reporting it): the share comes back over
        // `recoverMs`.
        None => match (cfg.pre_oom.as_ref(), pod.pre_oom) {
            (Some(c), Phase::Degraded | Phase::Cut) if s.cut.is_none() && c.recover_ms > 0 => {
                s.penalty *= c.min_share;
                s.value *= c.min_share;
                pod.pre_oom = Phase::Recovering(now_ms);
                return Some(due);
            }
            (Some(c), Phase::Recovering(at)) if s.cut.is_none() => {
                let share = c.recovering(now_ms.saturating_sub(at));
                if share >= 1.0 {
                    pod.pre_oom = Phase::Normal;
                    return None;
                }
                s.penalty *= share;
                s.value *= share;
                return Some(due);
            }
            _ => Phase::Normal,
        },
        Some(Verdict::Cut) => {
            s.cut = Some(CutReason::PreOom);
            s.value = 0.0;
            Phase::Cut
        }
        Some(Verdict::Degrade(share)) => {
            s.penalty *= share;
            s.value *= share;
            // Refreshed again no later than its cut is due.
            if let (Some(c), Some(p)) = (cfg.pre_oom.as_ref(), sig.pre_oom.as_ref()) {
                let to_cut = p.time_to_oom_ms(now_ms).saturating_sub(c.cut_before_ms);
                due = due.min(now_ms.saturating_add(to_cut.max(1)));
            }
            Phase::Degraded
        }
    };
    if matches!(pod.pre_oom, Phase::Normal | Phase::Recovering(_)) && phase != Phase::Normal {
        counters.pre_oom_degraded += 1;
    }
    if pod.pre_oom != Phase::Cut && phase == Phase::Cut {
        counters.pre_oom_cut += 1;
    }
    pod.pre_oom = phase;
    judged.map(|_| due)
}

/// The mean GPU reading (`cutoffs.gpuSignal`, clamped to 0..=1) of the pool's pods with fresh
/// metrics that report one; None when none does.
fn gpu_fill(state: &PoolState, cfg: &FilterConfig, now_ms: u64) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0u32);
    for sig in state.peers().iter().filter_map(|e| e.signals.as_ref()) {
        if !sig.has_metrics || sig.is_stale(now_ms, cfg.cutoffs.staleness_ms) {
            continue;
        }
        if let Some((_, g)) = sig.gpu_load(cfg.cutoffs.gpu_signal) {
            if g.is_finite() {
                sum += g.clamp(0.0, 1.0);
                n += 1;
            }
        }
    }
    (n > 0).then(|| sum / f64::from(n))
}

impl Router {
    /// Recomputes scores, breaker polls and every view's tree.
    pub(super) fn refresh(&mut self, pool_idx: usize, now_ms: u64) {
        let cfg = &self.cfg;
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let Some(pool_cfg) = cfg.pools.get(pool_idx) else {
            return;
        };
        let pool = PoolReadings::of(p, cfg, now_ms);
        adapt_thresholds(p, cfg, now_ms);
        let mut sinks = BreakerSinks {
            pool_idx,
            counters: &mut self.counters,
            events: &mut self.events,
            signal_trips: &mut self.signal_trips,
        };
        // `learnedWeights`: the model moves before the pods are scored with it.
        let mut next = super::learned::update_model(p, sinks.counters, now_ms);
        super::learned::set_rel_ttfts(p, now_ms);
        let mut mean_sum = 0.0;
        let mut mean_n = 0u32;
        for pod in p.pods.iter_mut() {
            pod.start_window.roll(now_ms);
            let Some(entry) = p.state.peers().get(pod.peer_idx) else {
                continue;
            };
            let Some(sig) = entry.signals.as_ref() else {
                continue;
            };
            let weights = pool_cfg.weights_for(&pod.address);
            let mut s = score_in_pool(sig, weights, &cfg.cutoffs, now_ms, pool.gpu_fill);
            super::learned::score_pod(pod, p.learned.as_ref(), sig, pool.gpu_fill, cfg, &mut s);
            if let Some(due) = degrade_before_oom(pod, sig, &mut s, cfg, now_ms, sinks.counters) {
                next = next.min(due);
            }
            let decode_ref = pool.itl_median.map(|m| DecodeRef {
                pool: m,
                kin: sig
                    .itl_recent_ms
                    .and_then(|own| kin_median(&p.itl_kinds, sig.gpu_kind, own)),
            });
            if pod.judge_decode_speed(sig, decode_ref, &cfg.cutoffs, now_ms, &mut s) {
                sinks.counters.slow_decode += 1;
            }
            let key = (entry.received_at_ms, sig.sequence);
            let fresh = pod.take_snapshot(key, sig, &s, cfg.ema_alpha, now_ms);
            let due = judge_breakers(
                pod,
                sig,
                fresh,
                pool.wide_errors,
                &cfg.breaker,
                now_ms,
                &mut sinks,
            );
            next = next.min(due);
            // A pod cut for load (GPU hard limit, queue full) is still an overflow candidate,
            // so its going stale must be noticed on time too.
            if s.cut != Some(CutReason::Stale) && !sig.peer_stale {
                next = next.min(sig.stale_at_ms(cfg.cutoffs.staleness_ms));
            }
            pod.settle(s, sig, cfg);
            if pod.cut.is_none() && !pod.cold {
                let e = pod.ema.unwrap_or(0.0);
                mean_sum += e;
                mean_n += 1;
            }
        }
        let mean = if mean_n > 0 {
            mean_sum / f64::from(mean_n)
        } else {
            0.0
        };
        p.mean = mean;
        set_rel_speeds(p, now_ms);
        for pod in p.pods.iter_mut() {
            weigh(pod, mean, mean_n, cfg);
        }
        p.next_refresh_ms = next;
        p.dirty = false;
        // Rebuild existing views in place (buffers keep their capacity).
        let mut views = std::mem::take(&mut p.views);
        for v in views.iter_mut() {
            build_view(v, p, cfg);
        }
        p.views = views;
    }

    /// Refreshes pool `pool_idx` when due and returns the index of its view for `model`
    /// (built on first use). None when there is no such pool.
    pub(super) fn fresh_view(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        version: Option<&str>,
        now_ms: u64,
    ) -> Option<usize> {
        let p = self.pools.get(pool_idx)?;
        if p.dirty || now_ms >= p.next_refresh_ms {
            self.refresh(pool_idx, now_ms);
        }
        let cfg = &self.cfg;
        let p = self.pools.get_mut(pool_idx)?;
        if let Some(i) = p
            .views
            .iter()
            .position(|v| v.model.as_deref() == model && v.version.as_deref() == version)
        {
            return Some(i);
        }
        let mut v = View::new(model, version);
        build_view(&mut v, p, cfg);
        p.views.push(v);
        Some(p.views.len() - 1)
    }

    /// Advances time without a request (e.g. from the glue's tick): polls breakers and
    /// staleness. Returns transitions that happened.
    pub fn tick(&mut self, now_ms: u64) -> Vec<BreakerEvent> {
        let before = self.events.len();
        for i in 0..self.pools.len() {
            let due = self
                .pools
                .get(i)
                .is_some_and(|p| p.dirty || now_ms >= p.next_refresh_ms);
            if due {
                self.refresh(i, now_ms);
            }
        }
        self.events.split_off(before)
    }
}

/// The median recent inter-token latency over the pool's pods that report one and are neither
/// stale nor without a model server; None with fewer than [`MIN_ITL_PODS`] such pods, or when
/// `cutoffs.slowItlRatio` is 0. Leaves those pods' readings, with their GPU kind, in
/// `p.itl_kinds` for [`kin_median`].
fn median_recent_itl(p: &mut PoolRt, cfg: &FilterConfig, now_ms: u64) -> Option<f64> {
    p.itl_kinds.clear();
    if cfg.cutoffs.slow_itl_ratio <= 0.0 {
        return None;
    }
    p.itl_kinds.extend(
        p.state
            .peers()
            .iter()
            .filter_map(|e| e.signals.as_ref())
            .filter(|s| {
                s.has_metrics
                    && !s.model_server_down
                    && !s.is_stale(now_ms, cfg.cutoffs.staleness_ms)
            })
            .filter_map(|s| s.itl_recent_ms.map(|itl| (s.gpu_kind, itl))),
    );
    p.itl_scratch.clear();
    p.itl_scratch
        .extend(p.itl_kinds.iter().map(|&(_, itl)| itl));
    let m = median(&mut p.itl_scratch, MIN_ITL_PODS);
    p.itl_kinds
        .sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    m
}

/// The median recent inter-token latency of the other pods of GPU kind `kind` in `kinds`
/// (sorted by kind, then latency; the pod's own reading `own` is left out once); None when no
/// other pod of its kind reports one.
fn kin_median(kinds: &[(u64, f64)], kind: u64, own: f64) -> Option<f64> {
    let lo = kinds.partition_point(|&(k, _)| k < kind);
    let hi = kinds.partition_point(|&(k, _)| k <= kind);
    let kin = kinds.get(lo..hi)?;
    // Found by bisection, as the kind's slice is: a pool of a thousand pods of one kind
    // refreshes each pod's judgement without a walk over the others.
    let first_not_below = kin.partition_point(|&(_, v)| v.total_cmp(&own).is_lt());
    let own_at = kin
        .get(first_not_below)
        .is_some_and(|&(_, v)| v == own)
        .then_some(first_not_below);
    let n = kin.len() - usize::from(own_at.is_some());
    if n == 0 {
        return None;
    }
    // The j-th of the others: past the pod's own reading, one further on.
    let at = |j: usize| {
        let j = match own_at {
            Some(o) if j >= o => j + 1,
            _ => j,
        };
        kin.get(j).map(|&(_, v)| v)
    };
    Some((at((n - 1) / 2)? + at(n / 2)?) / 2.0)
}

/// What a pod's recent inter-token latency is judged against (`cutoffs.slowItlRatio`): the
/// pool's median and, where other pods share its GPU kind, their median.
#[derive(Clone, Copy, Debug)]
pub(super) struct DecodeRef {
    pub(super) pool: f64,
    pub(super) kin: Option<f64>,
}

impl DecodeRef {
    /// The speed the pod is held to: the slower of the pool's median and its kind's. A pod of
    /// a slower GPU generation is judged against its own kind, not the faster pods around it;
    /// a faster kind's pods stay judged against the pool, as before kinds were known.
    pub(super) fn reference(self) -> f64 {
        self.kin.map_or(self.pool, |k| k.max(self.pool))
    }
}

/// The median of `values` (sorted in place), or None with fewer than `min` of them.
pub(super) fn median(values: &mut [f64], min: usize) -> Option<f64> {
    if values.is_empty() || values.len() < min {
        return None;
    }
    values.sort_unstable_by(f64::total_cmp);
    let n = values.len();
    let hi = values.get(n / 2).copied()?;
    let lo = values.get((n - 1) / 2).copied().unwrap_or(hi);
    Some((lo + hi) / 2.0)
}

/// Each pod's decode speed relative to the pool: its smoothed inter-token latency over
/// the median of the pods with a recent one.
fn set_rel_speeds(p: &mut PoolRt, now_ms: u64) {
    p.itl_scratch.clear();
    p.itl_scratch
        .extend(p.pods.iter().filter_map(|r| r.decode_ms(now_ms)));
    let median = median(&mut p.itl_scratch, MIN_ITL_PODS).filter(|m| *m > 0.0);
    for pod in p.pods.iter_mut() {
        pod.rel_speed = match (median, pod.decode_ms(now_ms)) {
            (Some(m), Some(d)) => (d / m).clamp(MIN_REL_SPEED, MAX_REL_SPEED),
            _ => 1.0,
        };
    }
}

/// The pod's draw weight: its smoothed score (a cold pod: the pool `mean` of the `mean_n`
/// pods with metrics that are not cut) times its penalty, at least `floorWeight`; 0 when cut,
/// or cold with no mean. Also its scoreboard score, and whether it is an overflow candidate.
fn weigh(pod: &mut PodRt, mean: f64, mean_n: u32, cfg: &FilterConfig) {
    let value = if pod.cold {
        mean
    } else {
        pod.ema.unwrap_or(0.0)
    } * pod.score.penalty;
    pod.shown = if pod.cut.is_some() { 0.0 } else { value };
    // Cut by the GPU hard limit alone: an overflow candidate under twoChoices.
    pod.hot = cfg.pick_strategy == PickStrategy::TwoChoices
        && pod.cut == Some(CutReason::GpuHardLimit)
        && !pod.cold
        && pod.breaker.takes_requests(&cfg.breaker)
        && pod.breaker.state() == BreakerState::Closed;
    pod.base = if pod.cut.is_some() || (pod.cold && mean_n == 0) {
        0.0
    } else {
        // The floor keeps a healthy pod drawn; a ramp after its breaker closed scales that.
        value.max(cfg.floor_weight).clamp(0.0, 1.0) * pod.ramp
    };
}
