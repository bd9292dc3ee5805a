//! Where one request goes: the view's verdict (steer, or fall back and why), a half-open pod's
//! probe ahead of the draw, the draw, the ranked list behind the chosen pod, and what a pick
//! spends (its count, a half-open probe).

use rand::RngCore;

use super::candidates::Candidates;
use super::fail_open::fail_open;
use super::view::{draw, update_pod, Verdict, View};
use super::{Decision, FallbackReason, PoolRt, Ranked, RequestSize, Router};
use crate::breaker::{BreakerState, TripReason};
use crate::config::{FilterConfig, PickStrategy};
use crate::counters::Counters;
use crate::prefix::PromptKeys;
use crate::score::CutReason;

/// What one decision knows of its request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request<'a> {
    pub(super) size: RequestSize,
    /// [`Router::kv_is_big`]: it holds `BIG_KV_FACTOR` times the mean request's KV tokens or
    /// more.
    pub(super) big: bool,
    /// `bigRequestHold.kvHeadroom` for a big request under `bigRequestHold`.
    pub(super) headroom: Option<f64>,
    /// Its keyed prompt ([`Router::key_prompt`]), for `prefixAffinity`.
    pub(super) prompt: Option<&'a PromptKeys>,
    pub(super) now_ms: u64,
}

impl Router {
    /// Decides where one request of `model` (None: any) goes, at `now_ms`, not knowing its
    /// size ([`RequestSize::UNIT`]).
    pub fn decide(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        self.decide_for(pool_idx, model, RequestSize::UNIT, now_ms, rng)
    }

    /// Decides where one request of `model` (None: any) and `size` goes, at `now_ms`.
    pub fn decide_for(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        size: RequestSize,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        self.decide_with(pool_idx, model, size, None, now_ms, rng)
    }

    /// [`Router::decide_for`] for a request whose prompt was keyed ([`Router::prefix_space`],
    /// [`crate::prefix::keys::keys_of`]): with `prefixAffinity` on and `twoChoices`, a pod
    /// holding its prefix competes too (see [`crate::prefix`]).
    pub fn decide_with(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        size: RequestSize,
        prompt: Option<&PromptKeys>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        self.decide_in(pool_idx, model, None, size, prompt, now_ms, rng)
    }

    /// [`Router::decide_with`] among the pods of model `version` only (None: every pod; see
    /// [`crate::versions`] and [`Router::route_version`]).
    #[allow(clippy::too_many_arguments)]
    pub fn decide_in(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        version: Option<&str>,
        size: RequestSize,
        prompt: Option<&PromptKeys>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        let Some(vi) = self.fresh_view(pool_idx, model, version, now_ms) else {
            self.counters.fallback_no_agent_data += 1;
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        let big = self.kv_is_big(size.kv_tokens);
        let cfg = &self.cfg;
        let headroom = cfg.big_request_hold.filter(|_| big).map(|h| h.kv_headroom);
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        let Some(view) = p.views.get(vi) else {
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        if let Verdict::Fallback(r) = view.verdict {
            count_fallback(&mut self.counters, r);
            return Decision::Fallback(r);
        }
        let req = Request {
            size,
            big,
            headroom,
            prompt,
            now_ms,
        };
        let total = view.total();
        let mut ranked = Ranked::new(p.generation);
        if total <= 1e-12 {
            return fail_open(
                &mut p.pods,
                view,
                cfg,
                &req,
                ranked,
                rng,
                &mut self.counters,
            );
        }
        // A half-open pod with probe budget takes the request as its probe, ahead of the draw,
        // the two-choice contest and prefix affinity: they would keep a healed pod that holds
        // no prefix, or has a queue, out for as long as the traffic lasts.
        let probe = view.probe_due();
        let chosen = if cfg.pick_strategy == PickStrategy::TwoChoices {
            let mean_output_tokens = self.mean_output_tokens;
            let c = Candidates::new(
                &p.pods,
                &p.state,
                view,
                &p.own,
                cfg,
                req,
                mean_output_tokens,
            );
            let chosen = match probe.filter(|&h| c.may_probe(h)) {
                Some(h) => h,
                None => {
                    let Some((first, a)) = first_draw(view, total, rng) else {
                        self.counters.fallback_no_agent_data += 1;
                        return Decision::Fallback(FallbackReason::NoAgentData);
                    };
                    c.choose(first, a, total, rng, &mut self.counters)
                }
            };
            c.record_prefix(chosen, &mut self.counters, &mut p.own);
            chosen
        } else {
            match probe.or_else(|| first_draw(view, total, rng).map(|(_, a)| a)) {
                Some(a) => a,
                None => {
                    self.counters.fallback_no_agent_data += 1;
                    return Decision::Fallback(FallbackReason::NoAgentData);
                }
            }
        };
        ranked.push(chosen);
        push_fallbacks(&mut ranked, view, cfg.fallback_endpoints);
        let chosen_score = note_pick(p, chosen, model, now_ms, cfg);
        self.counters.steered += 1;
        Decision::Steer {
            ranked,
            chosen_score,
        }
    }
}

/// The first candidate drawn by weight: its slot and pod (`total` > 0).
fn first_draw(view: &View, total: f64, rng: &mut (impl RngCore + ?Sized)) -> Option<(usize, u32)> {
    let first = draw(view, total, rng);
    view.slots.get(first).map(|&a| (first, a))
}

/// Counts a fallback by its reason.
fn count_fallback(c: &mut Counters, r: FallbackReason) {
    match r {
        FallbackReason::NoAgentData => c.fallback_no_agent_data += 1,
        FallbackReason::NoModel => c.fallback_no_model += 1,
        FallbackReason::AllStale => c.fallback_all_stale += 1,
        FallbackReason::TooFewPods => c.fallback_too_few_pods += 1,
    }
}

/// Fills `ranked` behind the chosen pod from the view's fallback order, up to
/// `fallback_endpoints` fallbacks.
fn push_fallbacks(ranked: &mut Ranked, view: &View, fallback_endpoints: usize) {
    for &s in &view.order {
        if ranked.len() > fallback_endpoints {
            break;
        }
        if let Some(&id) = view.slots.get(s as usize) {
            if !ranked.contains(id) {
                ranked.push(id);
            }
        }
    }
}

/// Counts the pick of pod `chosen` and spends a probe of its breakers that are half-open (the
/// pod's, and the `model`'s); once the probe budget is spent the pod is re-weighed everywhere.
/// Returns its shown score.
fn note_pick(
    p: &mut PoolRt,
    chosen: u32,
    model: Option<&str>,
    now_ms: u64,
    cfg: &FilterConfig,
) -> f64 {
    let mut chosen_score = 0.0;
    let mut probe = false;
    if let Some(pod) = p.pods.get_mut(chosen as usize) {
        chosen_score = pod.shown;
        pod.picks += 1;
        if pod.breaker.state() == BreakerState::HalfOpen {
            pod.breaker.on_request(now_ms);
            probe = true;
        }
        if let Some(m) = model {
            if let Some((_, b)) = pod.model_breakers.iter_mut().find(|(n, _)| n == m) {
                if b.state() == BreakerState::HalfOpen {
                    b.on_request(now_ms);
                    probe = true;
                }
            }
        }
    }
    if probe {
        // The probe budget may be spent: re-weigh this pod everywhere.
        if let Some(pod) = p.pods.get_mut(chosen as usize) {
            if !pod.breaker.takes_requests(&cfg.breaker) {
                pod.base = 0.0;
                pod.cut = Some(CutReason::Breaker(
                    pod.breaker.reason().unwrap_or(TripReason::ServerErrors),
                ));
            }
        }
        update_pod(p, chosen, cfg);
    }
    chosen_score
}
