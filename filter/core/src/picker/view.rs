//! The draw weights of one pool for one requested model (a view): which pods compete, each
//! one's weight in a Fenwick tree (a draw costs O(log n), no allocation), the fallback order,
//! and whether the view picks at all or falls back (and why).

use rand::RngCore;

use super::pod::PodRt;
use super::{FallbackReason, PoolRt, NONE};
use crate::breaker::BreakerState;
use crate::config::{FilterConfig, PickStrategy};
use crate::score::CutReason;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Verdict {
    Pick,
    Fallback(FallbackReason),
}

#[derive(Debug, Clone)]
pub(super) struct View {
    pub(super) model: Option<String>,
    /// Only pods of this model version (`versions`; None: every pod).
    pub(super) version: Option<String>,
    pub(super) slots: Vec<u32>,
    pub(super) slot_of: Vec<u32>,
    pub(super) w: Vec<f64>,
    pub(super) tree: Vec<f64>,
    pub(super) order: Vec<u32>,
    /// Pods cut only by the GPU hard limit ([`PodRt::hot`]): `twoChoices` overflow candidates.
    pub(super) hot: Vec<u32>,
    /// Slots of the half-open pods (their breaker, or the model's) that had probe budget when
    /// the view was laid out: see [`View::probe_due`].
    pub(super) probing: Vec<u32>,
    pub(super) verdict: Verdict,
}

impl View {
    pub(super) fn new(model: Option<&str>, version: Option<&str>) -> Self {
        Self {
            model: model.map(str::to_string),
            version: version.map(str::to_string),
            slots: Vec::new(),
            slot_of: Vec::new(),
            w: Vec::new(),
            tree: Vec::new(),
            order: Vec::new(),
            hot: Vec::new(),
            probing: Vec::new(),
            verdict: Verdict::Fallback(FallbackReason::NoAgentData),
        }
    }

    /// The half-open pod owed a probe now: the first of [`View::probing`] whose probe budget is
    /// not spent (a probe sent since the layout zeroed its weight, [`update_pod`]). Every
    /// decision that can use it sends it the request ahead of the draw (see the [`super`]
    /// docs), so a healed pod is never left half-open for want of traffic.
    pub(super) fn probe_due(&self) -> Option<u32> {
        self.probing.iter().find_map(|&s| {
            let s = s as usize;
            (self.w.get(s).copied().unwrap_or(0.0) > 0.0)
                .then(|| self.slots.get(s).copied())
                .flatten()
        })
    }

    fn add(&mut self, slot: usize, delta: f64) {
        let mut i = slot + 1;
        while let Some(t) = self.tree.get_mut(i) {
            *t += delta;
            i += i & i.wrapping_neg();
        }
    }

    pub(super) fn total(&self) -> f64 {
        let mut i = self.slots.len();
        let mut s = 0.0;
        while i > 0 {
            s += self.tree.get(i).copied().unwrap_or(0.0);
            i &= i - 1;
        }
        s
    }

    /// Smallest slot whose prefix sum exceeds `u`.
    pub(super) fn find(&self, mut u: f64) -> usize {
        let n = self.slots.len();
        let mut pos = 0usize;
        let mut step = if n == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - n.leading_zeros())
        };
        while step > 0 {
            let next = pos + step;
            if next <= n {
                let t = self.tree.get(next).copied().unwrap_or(0.0);
                if t <= u {
                    pos = next;
                    u -= t;
                }
            }
            step >>= 1;
        }
        pos.min(n.saturating_sub(1))
    }

    pub(super) fn set(&mut self, slot: usize, value: f64) {
        let old = self.w.get(slot).copied().unwrap_or(0.0);
        if let Some(w) = self.w.get_mut(slot) {
            *w = value;
        }
        self.add(slot, value - old);
    }

    /// Builds the Fenwick tree of the slots' weights in O(n).
    fn build_tree(&mut self) {
        let n = self.slots.len();
        self.tree.clear();
        self.tree.resize(n + 1, 0.0);
        for i in 1..=n {
            let w = self.w.get(i - 1).copied().unwrap_or(0.0);
            if let Some(t) = self.tree.get_mut(i) {
                *t += w;
            }
            let j = i + (i & i.wrapping_neg());
            if j <= n {
                let ti = self.tree.get(i).copied().unwrap_or(0.0);
                if let Some(t) = self.tree.get_mut(j) {
                    *t += ti;
                }
            }
        }
    }
}

fn uniform01(rng: &mut (impl RngCore + ?Sized)) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// One slot drawn in proportion to the view's weights (`total` > 0).
pub(super) fn draw(view: &View, total: f64, rng: &mut (impl RngCore + ?Sized)) -> usize {
    let u = uniform01(rng) * total;
    let slot = view.find(u);
    if view.w.get(slot).copied().unwrap_or(0.0) > 0.0 {
        return slot;
    }
    // Rounding landed on a zero-weight slot: take the nearest positive one.
    let n = view.w.len();
    (0..n)
        .map(|k| (slot + k) % n)
        .find(|s| view.w.get(*s).copied().unwrap_or(0.0) > 0.0)
        .unwrap_or(slot)
}

fn effective(pod: &PodRt, model: Option<&str>, cfg: &FilterConfig) -> f64 {
    if pod.base <= 0.0 {
        return 0.0;
    }
    if let Some(b) = pod.model_breaker(model) {
        if !b.admits(&cfg.breaker) {
            return 0.0;
        }
    }
    match cfg.pick_strategy {
        PickStrategy::TwoChoices => pod.base,
        PickStrategy::Proportional => {
            pod.base / (1.0 + pod.delta_since_snapshot().max(0.0) / pod.capacity)
        }
    }
}

/// Re-weighs pod `id` in every view of the pool.
pub(super) fn update_pod(p: &mut PoolRt, id: u32, cfg: &FilterConfig) {
    let Some(pod) = p.pods.get(id as usize) else {
        return;
    };
    for v in p.views.iter_mut() {
        let slot = v.slot_of.get(id as usize).copied().unwrap_or(NONE);
        if slot == NONE {
            continue;
        }
        let w = effective(pod, v.model.as_deref(), cfg);
        v.set(slot as usize, w);
    }
}

/// Lays view `v` out anew for the pool's pods: its slots and weights, its tree, its fallback
/// order and its verdict.
pub(super) fn build_view(v: &mut View, p: &PoolRt, cfg: &FilterConfig) {
    v.slots.clear();
    v.w.clear();
    v.order.clear();
    v.hot.clear();
    v.probing.clear();
    v.slot_of.clear();
    v.slot_of.resize(p.pods.len(), NONE);
    let (fresh, stale) = fill_slots(v, p, cfg);
    v.build_tree();
    order_fallbacks(v, &p.pods, cfg.fallback_endpoints);
    // A version's pods are judged by the pool-wide view's `minPods` (the request is routed by
    // version only when that view picks); a canary of one pod is still a version.
    let min_pods = if v.version.is_some() { 1 } else { cfg.min_pods };
    v.verdict = verdict(p, v, fresh, stale, min_pods);
}

/// Gives every pod that serves the view's model a slot with its draw weight, and lists the hot
/// ones (overflow candidates) and the half-open ones with probe budget. Returns how many of them have metrics that are fresh, and stale.
fn fill_slots(v: &mut View, p: &PoolRt, cfg: &FilterConfig) -> (usize, usize) {
    let mut fresh = 0usize;
    let mut stale = 0usize;
    let model = v.model.as_deref();
    for (i, pod) in p.pods.iter().enumerate() {
        let Some(sig) = p
            .state
            .peers()
            .get(pod.peer_idx)
            .and_then(|e| e.signals.as_ref())
        else {
            continue;
        };
        if let Some(m) = model {
            if !sig.serves(m) {
                continue;
            }
        }
        if v.version.as_deref().is_some_and(|ver| sig.version() != ver) {
            continue;
        }
        let slot = v.slots.len();
        if let Some(s) = v.slot_of.get_mut(i) {
            *s = u32::try_from(slot).unwrap_or(NONE);
        }
        v.slots.push(u32::try_from(i).unwrap_or(NONE));
        let w = effective(pod, model, cfg);
        v.w.push(w);
        // Weighed, so not cut and admitted by its breakers: a half-open one has budget.
        if w > 0.0 && pod.half_open(model) {
            v.probing.push(u32::try_from(slot).unwrap_or(NONE));
        }
        if pod.hot
            && pod
                .model_breaker(model)
                .is_none_or(|b| b.state() == BreakerState::Closed)
        {
            v.hot.push(u32::try_from(i).unwrap_or(NONE));
        }
        if pod.score.has_terms {
            if pod.score.cut == Some(CutReason::Stale) {
                stale += 1;
            } else {
                fresh += 1;
            }
        }
    }
    (fresh, stale)
}

/// Fallback order: eligible, not half-open, by base weight descending; the first
/// `fallback_endpoints` + 1 kept.
fn order_fallbacks(v: &mut View, pods: &[PodRt], fallback_endpoints: usize) {
    let model = v.model.as_deref();
    for (slot, &id) in v.slots.iter().enumerate() {
        let Some(pod) = pods.get(id as usize) else {
            continue;
        };
        if v.w.get(slot).copied().unwrap_or(0.0) > 0.0 && !pod.half_open(model) {
            v.order.push(u32::try_from(slot).unwrap_or(NONE));
        }
    }
    let slots = &v.slots;
    let base_of = |s: &u32| {
        slots
            .get(*s as usize)
            .and_then(|id| pods.get(*id as usize))
            .map_or(0.0, |r| r.base)
    };
    v.order
        .sort_unstable_by(|a, b| base_of(b).total_cmp(&base_of(a)));
    v.order.truncate(fallback_endpoints + 1);
}

/// Whether the view picks or falls back, and why: no agent data yet, no pod for its model,
/// every pod's metrics stale, or fewer than `min_pods` with fresh ones.
fn verdict(p: &PoolRt, v: &View, fresh: usize, stale: usize, min_pods: usize) -> Verdict {
    if p.state.last_event_ms().is_none() || p.pods.is_empty() {
        Verdict::Fallback(FallbackReason::NoAgentData)
    } else if v.slots.is_empty() {
        Verdict::Fallback(if v.model.is_some() {
            FallbackReason::NoModel
        } else {
            FallbackReason::NoAgentData
        })
    } else if fresh == 0 && stale > 0 {
        Verdict::Fallback(FallbackReason::AllStale)
    } else if fresh < min_pods {
        Verdict::Fallback(FallbackReason::TooFewPods)
    } else {
        Verdict::Pick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(weights: &[f64]) -> View {
        let mut v = View::new(None, None);
        v.slots = (0..weights.len() as u32).collect();
        v.w = vec![0.0; weights.len()];
        v.tree = vec![0.0; weights.len() + 1];
        for (i, w) in weights.iter().enumerate() {
            v.set(i, *w);
        }
        v
    }

    #[test]
    fn fenwick_find_matches_a_linear_scan() {
        let weights = [0.0, 0.5, 0.0, 0.25, 1.0, 0.0, 0.125];
        let v = view(&weights);
        assert!((v.total() - 1.875).abs() < 1e-12);
        for k in 0..1875 {
            let u = k as f64 / 1000.0;
            let mut acc = 0.0;
            let want = weights
                .iter()
                .position(|w| {
                    acc += w;
                    acc > u
                })
                .unwrap();
            assert_eq!(v.find(u), want, "u={u}");
            assert!(weights[v.find(u)] > 0.0);
        }
    }

    #[test]
    fn fenwick_updates_move_the_total() {
        let mut v = view(&[1.0, 1.0, 1.0]);
        v.set(1, 0.0);
        assert!((v.total() - 2.0).abs() < 1e-12);
        assert_eq!(v.find(0.99), 0);
        assert_eq!(v.find(1.0), 2);
    }
}
