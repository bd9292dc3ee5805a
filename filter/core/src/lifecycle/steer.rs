//! Routes one request: asks the router for the ranked list, hands it to Envoy, counts the pick
//! in flight and, when the chosen pod is half-open, spends one of its probes (a budget every
//! worker shares). Used by [`super::Exchange`] and by a glue releasing a held request.

use crate::breaker::BreakerState;
use crate::picker::{Decision, RequestSize};
use crate::prefix::PromptKeys;

use super::{Host, Worker};

/// What [`steer`] handed to Envoy for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Steered {
    /// The ranked list (chosen pod first).
    pub ranked: String,
    /// The chosen pod's score (0 on a fail-open draw).
    pub score: f64,
    /// When it was counted in flight (passed back to `on_request_end`).
    pub sent_ms: u64,
    /// The chosen pod was half-open: this request is one of its probes.
    pub probe: bool,
}

impl Steered {
    /// The pod the request was steered to.
    pub fn chosen(&self) -> &str {
        self.ranked.split(',').next().unwrap_or("")
    }
}

/// Picks for `pool` (and `model`) and hands the ranked list to Envoy through `host`. None when
/// nothing was steered (Envoy's own balancing takes the request; the reason is counted).
pub fn steer<H, W>(
    host: &mut H,
    worker: &mut W,
    pool: usize,
    model: Option<&str>,
    now: u64,
    size: RequestSize,
    prompt: Option<&PromptKeys>,
) -> Option<Steered>
where
    H: Host + ?Sized,
    W: Worker + ?Sized,
{
    // Another worker may have just opened a breaker, or the agent published a newer state.
    worker.refresh(pool, now);
    let p = worker.parts();
    let (ranked, score) = match p.router.decide_with(pool, model, size, prompt, now, p.rng) {
        Decision::Steer {
            ranked,
            chosen_score,
        } => (ranked, chosen_score),
        Decision::FailOpen { ranked } => (ranked, 0.0),
        Decision::Fallback(_) => return None,
    };
    let written = p.router.write_ranked(pool, &ranked, p.scratch)
        && host.steer(&p.router.config().routing_header, p.scratch);
    if !written {
        p.router.counters_mut().steer_failed += 1;
        return None;
    }
    let chosen = p.scratch.split(',').next().unwrap_or("");
    p.router.on_request_start(pool, chosen, size, now);
    p.stats.picked(chosen);
    let probe = p
        .router
        .breaker(pool, chosen, None)
        .is_some_and(|b| b.state() == BreakerState::HalfOpen);
    if probe {
        let spend = &mut |b: &mut crate::breaker::Breaker| {
            b.on_request(now);
            None
        };
        if let Some(ts) = p.breakers.update(p.router, pool, chosen, now, spend) {
            let name = p
                .router
                .config()
                .pools
                .get(pool)
                .map_or("", |c| c.name.as_str());
            super::feedback::record_transitions(host, p.stats, name, chosen, &ts);
        }
    }
    Some(Steered {
        ranked: p.scratch.clone(),
        score,
        sent_ms: now,
        probe,
    })
}
