//! A view whose every pod is cut (all weights 0): fail open rather than refuse everything. One
//! pod chosen evenly (the sooner of two even draws under `twoChoices`) among those cut for
//! load only, else among all, its fallbacks following it in slot order.

use rand::RngCore;

use super::decide::Request;
use super::pod::PodRt;
use super::view::View;
use super::{Decision, FallbackReason, Ranked};
use crate::config::{BreakerConfig, FilterConfig, PickStrategy};
use crate::counters::Counters;
use crate::score::CutReason;

/// Fails open in `view` ([`Decision::FailOpen`]): fills `ranked` with the chosen pod and its
/// fallbacks and counts the pick. Without any pod for the view: a fallback.
pub(super) fn fail_open(
    pods: &mut [PodRt],
    view: &View,
    cfg: &FilterConfig,
    req: &Request<'_>,
    mut ranked: Ranked,
    rng: &mut (impl RngCore + ?Sized),
    counters: &mut Counters,
) -> Decision {
    let n = view.slots.len();
    if n == 0 {
        counters.fallback_no_agent_data += 1;
        return Decision::Fallback(FallbackReason::NoAgentData);
    }
    let alive = Survivors::of(pods, view, &cfg.breaker);
    let start = alive.first_pick(cfg.pick_strategy, req, rng);
    for k in (0..n)
        .map(|k| (start + k) % n)
        .filter(|&k| alive.ok(k))
        .take(cfg.fallback_endpoints + 1)
    {
        if let Some(id) = view.slots.get(k) {
            ranked.push(*id);
        }
    }
    if let Some(pod) = ranked.first().and_then(|id| pods.get_mut(id.0 as usize)) {
        pod.picks += 1;
    }
    counters.fail_open += 1;
    Decision::FailOpen { ranked }
}

/// The slots a failing-open view may choose from. Every pod is cut; those cut only for load
/// (GPU hard limit, queue full) can still serve, so when any is left only they are eligible; a
/// pod cut for its health (breaker, stale or faulty) gets a request only when no other is left.
struct Survivors<'a> {
    pods: &'a [PodRt],
    view: &'a View,
    breaker: &'a BreakerConfig,
    /// Only the slots cut for load only are eligible.
    load_only: bool,
    /// How many slots are eligible.
    m: usize,
}

impl<'a> Survivors<'a> {
    fn of(pods: &'a [PodRt], view: &'a View, breaker: &'a BreakerConfig) -> Self {
        let n = view.slots.len();
        let mut s = Self {
            pods,
            view,
            breaker,
            load_only: false,
            m: n,
        };
        let eligible = (0..n).filter(|&k| s.cut_for_load_only(k)).count();
        if eligible > 0 {
            s.load_only = true;
            s.m = eligible;
        }
        s
    }

    /// The pod of `slot` is cut (if at all) only for load, and its breakers admit it.
    fn cut_for_load_only(&self, slot: usize) -> bool {
        self.view
            .slots
            .get(slot)
            .and_then(|id| self.pods.get(*id as usize))
            .is_some_and(|r| {
                matches!(
                    r.cut,
                    None | Some(CutReason::GpuHardLimit | CutReason::QueueFull)
                ) && r.breaker.takes_requests(self.breaker)
                    && r.model_breaker(self.view.model.as_deref())
                        .is_none_or(|b| b.admits(self.breaker))
            })
    }

    /// Whether `slot` is eligible.
    fn ok(&self, slot: usize) -> bool {
        !self.load_only || self.cut_for_load_only(slot)
    }

    /// The `r`-th slot (0-based) that is eligible.
    fn nth(&self, r: usize) -> usize {
        (0..self.view.slots.len())
            .filter(|&k| self.ok(k))
            .nth(r)
            .unwrap_or(0)
    }

    /// The slot chosen evenly among the eligible; under `twoChoices`, of two even draws the
    /// one that can take the request sooner, as least_request would.
    fn first_pick(
        &self,
        strategy: PickStrategy,
        req: &Request<'_>,
        rng: &mut (impl RngCore + ?Sized),
    ) -> usize {
        let m = self.m;
        let first = usize::try_from(rng.next_u64() % m as u64).unwrap_or(0);
        let mut start = self.nth(first);
        if strategy == PickStrategy::TwoChoices && m > 1 {
            let other = self.nth(
                (first + 1 + usize::try_from(rng.next_u64() % (m as u64 - 1)).unwrap_or(0)) % m,
            );
            if self.key(other, req) < self.key(start, req) {
                start = other;
            }
        }
        start
    }

    /// [`PodRt::pick_key`] of the pod of `slot` (worst for an empty slot).
    fn key(&self, slot: usize, req: &Request<'_>) -> (u8, f64, f64) {
        self.view
            .slots
            .get(slot)
            .and_then(|id| self.pods.get(*id as usize))
            .map_or((u8::MAX, f64::INFINITY, f64::INFINITY), |r| {
                r.pick_key(req.size.kv_tokens, req.big, req.headroom, req.now_ms)
            })
    }
}
