//! Feeds a finished request back: closes its in-flight count however it ended, and tells the
//! breakers how every attempt went (the chosen pod's outcome, and the earlier ranked pods an
//! Envoy retry left; see [`crate::outcome`]). The worker's own breaker records first (its
//! failure-rate window may open the pod); the shared breaker is authoritative, so a rate trip
//! is carried there. A success on a breaker with nothing to forget writes nothing shared. A
//! half-open pod's probe passes at its first byte when that already counts as a success.

use crate::breaker::{Breaker, BreakerState, Outcome, Transition, TripReason};
use crate::outcome::{attribute, Observed};

use super::{Exchange, Host, Stats, Worker};

/// Counts `pod`'s shared-breaker transitions and logs each open.
pub(super) fn record_transitions<H: Host + ?Sized>(
    host: &mut H,
    stats: &mut dyn Stats,
    pool_name: &str,
    pod: &str,
    ts: &[Transition],
) {
    count_transitions(stats, &mut |m| host.warn(m), pool_name, pod, ts);
}

/// [`record_transitions`] with the log line handed to `warn` (no request's host at hand: the
/// synthetic probes, [`crate::probe`]).
pub(crate) fn count_transitions(
    stats: &mut dyn Stats,
    warn: &mut dyn FnMut(&str),
    pool_name: &str,
    pod: &str,
    ts: &[Transition],
) {
    if ts.is_empty() {
        return;
    }
    stats.transitions(pod, ts);
    for t in ts.iter().filter(|t| t.to == BreakerState::Open) {
        let reason = t.reason.map_or("unknown", |r| r.as_str());
        warn(&format!(
            "ai-lb: pool `{pool_name}`: breaker of {pod} opened ({reason})"
        ));
    }
}

/// Records a probe's success at its first byte when it already counts as one
/// ([`Outcome::probe_passed_at_first_byte`]) and came from the probed pod (not a retry
/// elsewhere); its end then records only a failure.
pub(super) fn pass_probe<H, W>(
    ex: &mut Exchange,
    host: &mut H,
    worker: &mut W,
    ttft_ms: u64,
    now: u64,
) where
    H: Host + ?Sized,
    W: Worker + ?Sized,
{
    let Some(pool) = ex.pool else { return };
    let Some(chosen) = ex.chosen().map(str::to_string) else {
        return;
    };
    // The pod's thresholds (its TTFT SLO may adapt to its pool, `breaker.adaptiveThresholds`).
    let cfg = worker.router().breaker_config_for(pool, &chosen);
    if !Outcome::probe_passed_at_first_byte(ex.status, ttft_ms, &cfg) {
        return;
    }
    if ex.upstream.as_deref() != Some(chosen.as_str()) {
        return;
    }
    ex.probe_passed = true;
    let p = worker.parts();
    let name = pool_name(p.router, pool);
    let record = &mut |b: &mut Breaker| b.record(None, now, &cfg);
    if let Some(ts) = p.breakers.update(p.router, pool, &chosen, now, record) {
        record_transitions(host, p.stats, &name, &chosen, &ts);
    }
}

fn pool_name(router: &crate::picker::Router, pool: usize) -> String {
    router
        .config()
        .pools
        .get(pool)
        .map_or_else(String::new, |p| p.name.clone())
}

/// The request is over: see the module doc.
pub(super) fn finish<H, W>(ex: &Exchange, host: &mut H, worker: &mut W, now: u64)
where
    H: Host + ?Sized,
    W: Worker + ?Sized,
{
    let Some(pool) = ex.pool else { return };
    // A clean end (the whole response went through with a status under 500, from a pod) is
    // known from what the response headers said: no log-phase read (each costs the wasm
    // filter a copy into the VM). Anything else reads the final status, flags and details.
    let clean = ex.response_complete && ex.status.is_some_and(|c| c < 500) && ex.upstream.is_some();
    let (status, flags, details, upstream) = if clean {
        (ex.status, 0, String::new(), ex.upstream.clone())
    } else {
        let status = host.response_code().filter(|c| *c > 0);
        let flags = host.response_flags();
        // Details only refine failures; an answer under 500 with no flag needs none.
        let details = if flags == 0 && status.is_some_and(|c| c < 500) {
            String::new()
        } else {
            host.response_code_details()
                .map(|d| d.into_owned())
                .unwrap_or_default()
        };
        let upstream = host
            .upstream_address()
            .map(|u| u.into_owned())
            .or_else(|| ex.upstream.clone());
        (status, flags, details, upstream)
    };
    let observed = Observed {
        ranked: ex.ranked(),
        upstream: upstream.as_deref(),
        status,
        flags,
        details: &details,
        attempts: if host.retries_follow_ranked() {
            attempts_from_ranked(ex.ranked(), upstream.as_deref())
        } else {
            ex.attempts
        },
        ttft_ms: ex.ttft_ms,
        total_ms: Some(now.saturating_sub(ex.started_ms)),
    };
    let mut pairs = attribute(&observed);
    let chosen = ex.chosen();
    let p = worker.parts();
    let name = pool_name(p.router, pool);
    // `breaker.truncation` / `breaker.wellFormedProbes`: how the answering pod's answer ended.
    let answered = upstream.as_deref();
    let truncated_trip = judge_answer(ex, p.router, pool, answered, &mut pairs, now);
    // Whether the chosen pod's breaker had nothing to forget (Closed, no failure counted, as
    // of this worker's last copy of the shared breakers): a success then leaves the shared
    // breaker as it is, so it is not read and rewritten.
    let clean_before = chosen.is_some_and(|c| {
        p.router
            .breaker(pool, c, None)
            .is_some_and(|b| b.state() == BreakerState::Closed && b.consecutive_failures() == 0)
    });
    // The chosen pod was counted in flight: close that however the request ended, then let
    // this worker's breaker record. A cancelled request teaches the breaker nothing.
    let mut rate_tripped = false;
    if let (Some(c), Some(st)) = (chosen, ex.steered.as_ref()) {
        p.router.on_request_end(pool, c, ex.size, st.sent_ms);
        // The version's breaker domain learns whether its chosen pod failed the request.
        if let Some(v) = st.version.as_deref() {
            let cfg = p.router.breaker_config_for(pool, c);
            let failed = pairs
                .iter()
                .find(|(pod, _)| *pod == c)
                .is_some_and(|(_, o)| o.failure(&cfg).is_some());
            if let Some(t) = p.router.on_version_outcome(pool, v, failed, now) {
                host.warn(&format!(
                    "ai-lb: pool {name}: model version '{v}' domain {} -> {}",
                    t.from.as_str(),
                    t.to.as_str()
                ));
            }
        }
        if let Some((_, o)) = pairs.iter().find(|(pod, _)| *pod == c) {
            rate_tripped = p
                .router
                .on_outcome_picked(pool, c, ex.model.as_deref(), o, now, st.features)
                .iter()
                .any(|e| e.to == BreakerState::Open && e.reason == Some(TripReason::FailureRate));
        }
    }
    for (pod, o) in &pairs {
        // Each pod's own thresholds (adapted to its pool when `breaker.adaptiveThresholds`
        // is on), as its worker breaker judged the outcome above.
        let cfg = p.router.breaker_config_for(pool, pod);
        let failure = o.failure(&cfg);
        let is_chosen = chosen == Some(*pod);
        if failure.is_some() {
            p.stats.failed(pod);
        } else if is_chosen
            && !rate_tripped
            && clean_before
            && !(truncated_trip && answered == Some(*pod))
        {
            continue;
        }
        let trip_rate = rate_tripped && is_chosen;
        let trip_truncated = truncated_trip && answered == Some(*pod);
        // A probe whose success was recorded at its first byte is not recorded again; the
        // shared breaker is still read back, over what this worker counted above.
        let on_record =
            is_chosen && ex.probe_passed && failure.is_none() && !trip_rate && !trip_truncated;
        let update = &mut |b: &mut Breaker| {
            if on_record {
                return None;
            }
            let t = b.record(failure, now, &cfg);
            if t.is_none() && trip_rate && b.state() == BreakerState::Closed {
                b.trip(TripReason::FailureRate, now, &cfg)
            } else if t.is_none() && trip_truncated && b.state() == BreakerState::Closed {
                b.trip(TripReason::Truncated, now, &cfg)
            } else {
                t
            }
        };
        if let Some(ts) = p.breakers.update(p.router, pool, pod, now, update) {
            record_transitions(host, p.stats, &name, pod, &ts);
        }
    }
}

/// Judges the answer the pod `answered` gave ([`crate::triggers`]): under
/// `breaker.wellFormedProbes` a probe that passed otherwise but answered malformed JSON is
/// marked a failure in `pairs`; under `breaker.truncation` the answer feeds the pod's
/// truncation run and memory-error rate. Returns whether that opened the pod's breaker.
fn judge_answer(
    ex: &Exchange,
    router: &mut crate::picker::Router,
    pool: usize,
    answered: Option<&str>,
    pairs: &mut [(&str, Outcome)],
    now: u64,
) -> bool {
    let (Some(scanner), Some(pod)) = (ex.answer.as_deref(), answered) else {
        return false;
    };
    let cfg = router.config().breaker;
    let probe = ex.steered.as_ref().is_some_and(|s| s.probe);
    if probe && cfg.well_formed_probes.is_some() && ex.chosen() == Some(pod) {
        if let Some((_, o)) = pairs.iter_mut().find(|(p, _)| *p == pod) {
            // Only a probe the rest judged a success: a failure keeps its own reason.
            if o.failure(&cfg).is_none() && !scanner.well_formed() {
                o.malformed = true;
            }
        }
    }
    // An answer that did not go through whole (a reset, a timeout) is judged by its failure,
    // not as a truncated generation.
    if cfg.truncation.is_none() || !ex.response_complete || !pairs.iter().any(|(p, _)| *p == pod) {
        return false;
    }
    let answer = scanner.classify(ex.max_output_tokens);
    router.on_answer(pool, pod, answer, now)
}

/// Envoy's override_host sends attempt i to the i-th member of the ranked list, so the pod that
/// answered says how many attempts there were (no `x-envoy-attempt-count` read, which also
/// needs the route to ask for it). A listed pod Envoy skipped (not a member of the cluster) is
/// counted as tried and failed, which only steers away from a pod Envoy would not use. None
/// when the pod is not in the list (Envoy's fallback balancer served it): then only the chosen
/// pod is known to have been tried before.
pub(super) fn attempts_from_ranked(ranked: &str, upstream: Option<&str>) -> Option<u32> {
    let upstream = upstream?;
    ranked
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .position(|p| p == upstream)
        .and_then(|i| u32::try_from(i + 1).ok())
}
