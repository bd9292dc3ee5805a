//! The pods' breakers as the picker drives them: tripped by what the agents report (a hardware
//! fault, their error rate), fed by this VM's outcomes, polled for time-driven transitions,
//! and shared with the other VMs.

use super::pod::PodRt;
use super::view::update_pod;
use super::Router;
use crate::breaker::{Breaker, BreakerEvent, BreakerState, Outcome, Transition, TripReason};
use crate::config::BreakerConfig;
use crate::counters::Counters;
use crate::signals::PodSignals;

/// A pod's breaker tripped by what its agent reported (a hardware fault, its error rate), for
/// the glue to carry into the breaker shared by every worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalTrip {
    pub pool_idx: usize,
    /// Serving address `IP:PORT`.
    pub pod: String,
    pub reason: TripReason,
}

/// Requests the agent's window must hold before its error rate can open the pod's breaker:
/// `failureRateMinRequests`, or a single one for a pod on probation (it failed recently: after
/// a cooldown the first sidecar's probes are the only traffic it gets, and a pod failing half
/// its requests passes one sidecar's probes one time in 2^probes, so the first failed probe
/// that its agent counts re-opens it on every sidecar).
fn agent_min_requests(b: &Breaker, now_ms: u64, cfg: &BreakerConfig) -> u32 {
    if b.on_probation(now_ms, cfg) {
        1
    } else {
        cfg.failure_rate_min_requests
    }
}

fn counters_transition(counters: &mut Counters, t: Transition) {
    counters.count_transition(t.to);
}

fn push_event(
    events: &mut Vec<BreakerEvent>,
    counters: &mut Counters,
    pod: &str,
    model: Option<&str>,
    t: Transition,
) {
    counters.count_transition(t.to);
    events.push(BreakerEvent {
        pod: pod.to_string(),
        model: model.map(str::to_string),
        from: t.from,
        to: t.to,
        reason: t.reason,
    });
}

/// Where a pool's refresh reports what its pods' breakers did: the counters, the transitions,
/// and the agent-signal trips for the glue ([`Router::take_signal_trips`]).
pub(super) struct BreakerSinks<'a> {
    pub(super) pool_idx: usize,
    pub(super) counters: &'a mut Counters,
    pub(super) events: &'a mut Vec<BreakerEvent>,
    pub(super) signal_trips: &'a mut Vec<SignalTrip>,
}

/// A refreshed pod's breakers, on its latest snapshot `sig` (`fresh`: not seen before): what
/// the agent reports may trip the pod's breaker ([`signal_trip`]), then every breaker of the
/// pod is polled. Returns the earliest time one of them is due to move again (`u64::MAX`:
/// none).
pub(super) fn judge_breakers(
    pod: &mut PodRt,
    sig: &PodSignals,
    fresh: bool,
    pool_wide_errors: bool,
    base: &BreakerConfig,
    now_ms: u64,
    sinks: &mut BreakerSinks<'_>,
) -> u64 {
    // The pod's own thresholds when they adapt to its pool (`breaker.adaptiveThresholds`).
    let adapted = pod.thresholds.map(|t| t.apply(base));
    let cfg = adapted.as_ref().unwrap_or(base);
    if fresh && adapted.is_some() {
        count_agent_rate_judgement(pod, sig, base, cfg, now_ms, sinks.counters);
    }
    let mut reason = signal_trip(
        pod,
        sig,
        fresh,
        pool_wide_errors,
        cfg,
        now_ms,
        sinks.counters,
    );
    if fresh && evidence_trips(pod, sig, base, cfg) && reason.is_none() && !pool_wide_errors {
        sinks.counters.breaker_thresholds_evidence += 1;
        reason = Some(TripReason::AgentErrorRate);
    }
    if reason.is_some() {
        pod.evidence.clear();
    }
    if let Some(reason) = reason {
        trip_on_signal(pod, reason, cfg, now_ms, sinks);
    }
    poll_breakers(pod, cfg, now_ms, sinks)
}

/// `breaker.adaptiveThresholds.errorEvidence`: adds a new snapshot's outcomes to the pod's
/// evidence ([`crate::adaptive::Evidence`], against its adapted `agentErrorRate` in `cfg`) and
/// answers whether it reached the bound with the pod's breaker closed. The evidence restarts
/// from 0 while the breaker is not closed, so a pod that closed is judged on what it does
/// since.
fn evidence_trips(
    pod: &mut PodRt,
    sig: &PodSignals,
    base: &BreakerConfig,
    cfg: &BreakerConfig,
) -> bool {
    let Some(bound) = pod
        .thresholds
        .map(|t| t.error_evidence)
        .filter(|&h| h > 0.0)
    else {
        return false;
    };
    let Some(rates) = crate::adaptive::Evidence::rates(cfg.agent_error_rate, base.agent_error_rate)
    else {
        return false;
    };
    let score = pod.evidence.observe(sig.outcome_totals, rates);
    if pod.breaker.state() != BreakerState::Closed {
        pod.evidence.clear();
        return false;
    }
    score >= bound
}

/// Counts a new snapshot whose agent error rate the pod's adapted `agentErrorRate` judges
/// otherwise than the static one would (see [`crate::counters::Counters`]), and one that left
/// the pod's thresholds static for want of a background.
fn count_agent_rate_judgement(
    pod: &PodRt,
    sig: &PodSignals,
    base: &BreakerConfig,
    adapted: &BreakerConfig,
    now_ms: u64,
    counters: &mut Counters,
) {
    if pod.thresholds.is_some_and(|t| t.is_static()) {
        counters.breaker_thresholds_static += 1;
        return;
    }
    if base.agent_error_rate <= 0.0 || pod.breaker.state() != BreakerState::Closed {
        return;
    }
    let n = agent_min_requests(&pod.breaker, now_ms, base);
    let (s, a) = (
        sig.failing(base.agent_error_rate, n),
        sig.failing(adapted.agent_error_rate, n),
    );
    if a && !s {
        counters.breaker_thresholds_stricter += 1;
    } else if s && !a {
        counters.breaker_thresholds_laxer += 1;
    }
}

/// Why the agent's latest snapshot opens the pod's breaker, if it does: a hardware fault in a
/// new snapshot, or the agent's error rate unless more than half the pool fails too
/// (`pool_wide_errors`: counted, once per snapshot, as `agent_errors_pool_wide`).
fn signal_trip(
    pod: &PodRt,
    sig: &PodSignals,
    fresh: bool,
    pool_wide_errors: bool,
    cfg: &BreakerConfig,
    now_ms: u64,
    counters: &mut Counters,
) -> Option<TripReason> {
    // The agent's error rate is judged on each new snapshot, and again whenever the
    // breaker is due to half-open (or already is): while the latest snapshot still
    // shows the pod failing, probing it would only confirm that, so the breaker stays
    // open for another, doubled, cooldown.
    let due = match pod.breaker.state() {
        BreakerState::Open => now_ms >= pod.breaker.open_until_ms(),
        BreakerState::HalfOpen => true,
        BreakerState::Closed => false,
    };
    if fresh && sig.hardware_fault {
        Some(TripReason::HardwareFault)
    } else if (fresh || due)
        && cfg.agent_error_rate > 0.0
        && sig.failing(
            cfg.agent_error_rate,
            agent_min_requests(&pod.breaker, now_ms, cfg),
        )
    {
        if pool_wide_errors {
            if fresh {
                counters.agent_errors_pool_wide += 1;
            }
            None
        } else {
            Some(TripReason::AgentErrorRate)
        }
    } else {
        None
    }
}

/// Trips the pod's breaker for `reason` and notes the trip for the glue (one entry per pool and
/// pod, the latest reason).
fn trip_on_signal(
    pod: &mut PodRt,
    reason: TripReason,
    cfg: &BreakerConfig,
    now_ms: u64,
    sinks: &mut BreakerSinks<'_>,
) {
    if let Some(t) = pod.breaker.trip(reason, now_ms, cfg) {
        push_event(sinks.events, sinks.counters, &pod.address, None, t);
    }
    let pool_idx = sinks.pool_idx;
    let known = sinks
        .signal_trips
        .iter_mut()
        .find(|s| s.pool_idx == pool_idx && s.pod == pod.address);
    match known {
        Some(s) => s.reason = reason,
        None => sinks.signal_trips.push(SignalTrip {
            pool_idx,
            pod: pod.address.clone(),
            reason,
        }),
    }
}

/// Polls the pod's breaker and its per-model breakers for time-driven transitions. Returns the
/// earliest time one of them is due to move again: an Open one's cooldown end, a HalfOpen
/// one's next cooldown (`u64::MAX`: none).
fn poll_breakers(
    pod: &mut PodRt,
    cfg: &BreakerConfig,
    now_ms: u64,
    sinks: &mut BreakerSinks<'_>,
) -> u64 {
    let mut next = u64::MAX;
    if let Some(t) = pod.breaker.poll(now_ms, cfg) {
        push_event(sinks.events, sinks.counters, &pod.address, None, t);
    }
    for (m, b) in pod.model_breakers.iter_mut() {
        if let Some(t) = b.poll(now_ms, cfg) {
            push_event(sinks.events, sinks.counters, &pod.address, Some(m), t);
        }
        if b.state() == BreakerState::Open {
            next = next.min(b.open_until_ms());
        } else if b.state() == BreakerState::HalfOpen {
            next = next.min(now_ms.saturating_add(cfg.base_cooldown_ms));
        }
    }
    match pod.breaker.state() {
        BreakerState::Open => next = next.min(pod.breaker.open_until_ms()),
        BreakerState::HalfOpen => next = next.min(now_ms.saturating_add(cfg.base_cooldown_ms)),
        BreakerState::Closed => {}
    }
    // Ramping back after a close: its weight moves at each step's end.
    let step = cfg.recovery_ramp.and_then(|r| r.at(&pod.breaker, now_ms));
    pod.ramp = step.map_or(1.0, |s| s.share);
    if let Some(s) = step {
        next = next.min(s.ends_ms);
    }
    next
}

impl Router {
    /// Records how a request to `pod` ended; feeds the pod's breaker (the pod+model breaker
    /// when the pod serves several models and `model` is given). Returns the transitions.
    /// `learnedWeights` trains on the pod's latest features; [`Router::on_outcome_picked`]
    /// passes those the pick saw.
    pub fn on_outcome(
        &mut self,
        pool_idx: usize,
        pod: &str,
        model: Option<&str>,
        outcome: &Outcome,
        now_ms: u64,
    ) -> Vec<BreakerEvent> {
        self.on_outcome_picked(pool_idx, pod, model, outcome, now_ms, None)
    }

    /// [`Router::on_outcome`] for a request whose pick saw the pod's `learnedWeights`
    /// features `picked` ([`Router::learned_features`] at the pick; None: the pod's latest).
    pub fn on_outcome_picked(
        &mut self,
        pool_idx: usize,
        pod: &str,
        model: Option<&str>,
        outcome: &Outcome,
        now_ms: u64,
        picked: Option<crate::learned::Features>,
    ) -> Vec<BreakerEvent> {
        let cfg = &self.cfg;
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Vec::new();
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return Vec::new();
        };
        let Some(rt) = p.pods.get_mut(id as usize) else {
            return Vec::new();
        };
        // The pod's thresholds (adapted to its pool when `breaker.adaptiveThresholds` is on).
        let bcfg = rt.thresholds.map_or(cfg.breaker, |t| t.apply(&cfg.breaker));
        let failure = outcome.failure(&bcfg);
        if rt.thresholds.is_some() {
            match (failure.is_some(), outcome.failure(&cfg.breaker).is_some()) {
                (true, false) => self.counters.breaker_thresholds_stricter += 1,
                (false, true) => self.counters.breaker_thresholds_laxer += 1,
                _ => {}
            }
        }
        let mut out = Vec::new();
        let admitted = rt.breaker.admits(&cfg.breaker);
        // `learnedWeights`: the outcome is a training sample for the pool's model.
        super::learned::sample(
            p.learned.as_mut(),
            rt,
            picked,
            failure.is_some(),
            outcome.ttft_ms,
            outcome.total_ms,
            &mut self.counters,
            now_ms,
        );
        let per_model = model.filter(|_| rt.serves_several);
        let t = match per_model {
            Some(m) => {
                let idx = match rt.model_breakers.iter().position(|(n, _)| n == m) {
                    Some(i) => i,
                    None => {
                        rt.model_breakers.push((m.to_string(), Breaker::default()));
                        rt.model_breakers.len() - 1
                    }
                };
                rt.model_breakers
                    .get_mut(idx)
                    .and_then(|(_, b)| b.record(failure, now_ms, &bcfg))
            }
            None => {
                if failure.is_some() {
                    rt.last_failure_ms = Some(now_ms);
                    let ramping = cfg
                        .breaker
                        .recovery_ramp
                        .is_some_and(|r| r.at(&rt.breaker, now_ms).is_some());
                    if ramping {
                        self.counters.breaker_ramp_failures += 1;
                    }
                }
                let t = rt.breaker.record(failure, now_ms, &bcfg);
                // The failure rate, over this VM's outcomes while Closed: a pod failing half
                // its requests rarely fails `consecutiveFailures` in a row.
                let closed = rt.breaker.state() == BreakerState::Closed;
                let (rate_trip, static_trip) = if t.is_none() && closed {
                    rt.window.record_judged(
                        failure.is_some(),
                        now_ms,
                        &bcfg,
                        cfg.breaker.failure_rate,
                    )
                } else {
                    (false, false)
                };
                if rt.thresholds.is_some() {
                    match (rate_trip, static_trip) {
                        (true, false) => self.counters.breaker_thresholds_stricter += 1,
                        (false, true) => self.counters.breaker_thresholds_laxer += 1,
                        _ => {}
                    }
                }
                if rate_trip {
                    rt.breaker.trip(TripReason::FailureRate, now_ms, &bcfg)
                } else {
                    t
                }
            }
        };
        if let Some(t) = t {
            push_event(&mut out, &mut self.counters, &rt.address, per_model, t);
            p.dirty = true;
        } else if rt.breaker.admits(&cfg.breaker) != admitted {
            // A half-open pod's first probe succeeded: the rest of its probes may go.
            p.dirty = true;
        } else {
            update_pod(p, id, cfg);
        }
        out
    }

    /// `breaker.truncation`: records how the chosen pod's answer ended ([`crate::triggers`]) and
    /// opens its breaker (`Truncated`) when its run of truncated answers reaches
    /// `consecutiveTruncated` while its memory-error rate is above `memoryErrorRate`. Returns
    /// whether it tripped (the glue carries that into the shared breaker). Off: nothing.
    pub fn on_answer(
        &mut self,
        pool_idx: usize,
        pod: &str,
        answer: crate::triggers::Answer,
        now_ms: u64,
    ) -> bool {
        use crate::triggers::Answer;
        let Some(tcfg) = self.cfg.breaker.truncation else {
            return false;
        };
        let bcfg = self.breaker_config_for(pool_idx, pod);
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return false;
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return false;
        };
        let Some(rt) = p.pods.get_mut(id as usize) else {
            return false;
        };
        match answer {
            Answer::Truncated => self.counters.answers_truncated += 1,
            Answer::MemoryError => self.counters.answers_memory_errors += 1,
            Answer::Unjudged => self.counters.answers_unjudged += 1,
            _ => {}
        }
        let step = rt
            .truncation
            .record(answer, now_ms, bcfg.failure_rate_window_ms, &tcfg);
        if step.ignored {
            self.counters.answers_truncated_ignored += 1;
        }
        if !step.trip {
            return false;
        }
        if let Some(t) = rt.breaker.trip(TripReason::Truncated, now_ms, &bcfg) {
            counters_transition(&mut self.counters, t);
            p.dirty = true;
        }
        true
    }

    /// The breaker settings `pod` is judged by: the configured ones, with its thresholds as
    /// adapted to its pool when `breaker.adaptiveThresholds` is on ([`crate::adaptive`]).
    pub fn breaker_config_for(&self, pool_idx: usize, pod: &str) -> BreakerConfig {
        let base = self.cfg.breaker;
        self.pools
            .get(pool_idx)
            .and_then(|p| p.pods.get(*p.by_addr.get(pod)? as usize))
            .and_then(|rt| rt.thresholds)
            .map_or(base, |t| t.apply(&base))
    }

    /// The pod's breaker (pod-level when `model` is None), for sharing between VMs.
    pub fn breaker(&self, pool_idx: usize, pod: &str, model: Option<&str>) -> Option<&Breaker> {
        let p = self.pools.get(pool_idx)?;
        let rt = p.pods.get(*p.by_addr.get(pod)? as usize)?;
        match model {
            None => Some(&rt.breaker),
            Some(_) => rt.model_breaker(model),
        }
    }

    /// Installs a breaker state read from shared data (another VM's view).
    ///
    /// One exception keeps a local verdict: a pod-level breaker this router opened for a
    /// hardware fault (seen in the pool state, which every VM reads) stays Open until its own
    /// cooldown ends, unless `breaker` is Open too; the shared breaker may not know the fault.
    pub fn set_breaker(
        &mut self,
        pool_idx: usize,
        pod: &str,
        model: Option<&str>,
        breaker: Breaker,
    ) {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return;
        };
        let Some(rt) = p.pods.get_mut(id as usize) else {
            return;
        };
        let cfg = &self.cfg.breaker;
        // Whether the pick weights can change: a state or admission change (a failure count
        // moving inside Closed does not), so the common success path costs no re-layout.
        let moved = |old: &Breaker| {
            old.state() != breaker.state()
                || old.admits(cfg) != breaker.admits(cfg)
                || old.open_until_ms() != breaker.open_until_ms()
        };
        let changed = match model {
            None => {
                // An agent's signal opened this VM's breaker: another VM's older view of the
                // shared breaker does not reopen the pod before its cooldown.
                let keep_fault = rt.breaker.state() == BreakerState::Open
                    && matches!(
                        rt.breaker.reason(),
                        Some(TripReason::HardwareFault | TripReason::AgentErrorRate)
                    )
                    && breaker.state() != BreakerState::Open;
                let changed = !keep_fault && moved(&rt.breaker);
                if !keep_fault {
                    rt.breaker = breaker;
                }
                changed
            }
            Some(m) => match rt.model_breakers.iter_mut().find(|(n, _)| n == m) {
                Some((_, b)) => {
                    let changed = moved(b);
                    *b = breaker;
                    changed
                }
                None => {
                    rt.model_breakers.push((m.to_string(), breaker));
                    true
                }
            },
        };
        if changed {
            p.dirty = true;
        }
    }
}
