//! Routes one request: asks the router for the ranked list, hands it to Envoy, counts the pick
//! in flight and, when the chosen pod is half-open, spends one of its probes (a budget every
//! worker shares). Used by [`super::Exchange`] and by a glue releasing a held request.

use crate::breaker::BreakerState;
use crate::picker::{Decision, RequestSize, VersionRoute};
use crate::prefix::PromptKeys;
use crate::versions::{RejectReason, REJECT_HEADER};

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
    /// The model version the request was routed to (`versions`; None: every pod competed).
    pub version: Option<String>,
    /// The chosen pod's `learnedWeights` features when it was picked (None: that is off, or
    /// the pod had none): its outcome trains the model on the state the pick saw.
    pub features: Option<crate::learned::Features>,
}

/// A request pinned to a model version that cannot be served (see [`crate::versions`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub version: String,
    pub reason: RejectReason,
}

/// Answers a [`Rejected`] request: 503, `x-ai-lb-version-rejected: <version>; <reason>`, and
/// an OpenAI-shaped error body naming both.
pub fn reject_reply<H: Host + ?Sized>(host: &mut H, r: &Rejected) {
    let message = match r.reason {
        RejectReason::NoPod => format!("no available pod serves model version '{}'", r.version),
        RejectReason::DomainOpen => format!(
            "model version '{}' is failing: its circuit breaker is open",
            r.version
        ),
    };
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": "model_version_unavailable",
            "code": r.reason.as_str(),
            "version": r.version,
        }
    })
    .to_string();
    let header = format!("{}; {}", r.version, r.reason.as_str());
    host.send_local_reply(
        503,
        &[
            ("content-type", "application/json"),
            (REJECT_HEADER, header.as_str()),
        ],
        body.as_bytes(),
    );
}

impl Steered {
    /// The pod the request was steered to.
    pub fn chosen(&self) -> &str {
        self.ranked.split(',').next().unwrap_or("")
    }
}

/// Picks for `pool` (and `model`) and hands the ranked list to Envoy through `host`. None when
/// nothing was steered (Envoy's own balancing takes the request; the reason is counted), or
/// when the request was pinned to a model version that cannot be served: then it was answered
/// ([`reject_reply`]).
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
    match steer_checked(host, worker, pool, model, now, size, prompt) {
        Ok(s) => s,
        Err(r) => {
            reject_reply(host, &r);
            None
        }
    }
}

/// [`steer`], leaving the answer to a request pinned to a version that cannot be served to the
/// caller.
pub fn steer_checked<H, W>(
    host: &mut H,
    worker: &mut W,
    pool: usize,
    model: Option<&str>,
    now: u64,
    size: RequestSize,
    prompt: Option<&PromptKeys>,
) -> Result<Option<Steered>, Rejected>
where
    H: Host + ?Sized,
    W: Worker + ?Sized,
{
    // Another worker may have just opened a breaker, or the agent published a newer state.
    worker.refresh(pool, now);
    let p = worker.parts();
    let pinned = p.router.config().versions.as_ref().and_then(|vc| {
        host.request_header(&vc.header)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    });
    let version = match p
        .router
        .route_version(pool, model, pinned.as_deref(), now, p.rng)
    {
        VersionRoute::Off | VersionRoute::Unsplit => None,
        VersionRoute::Version { version, .. } => Some(version),
        VersionRoute::Rejected { version, reason } => return Err(Rejected { version, reason }),
    };
    let decision = p
        .router
        .decide_in(pool, model, version.as_deref(), size, prompt, now, p.rng);
    // A pinned request the filter cannot steer is refused: Envoy's own balancing would send it
    // to a pod of any version.
    let unsteered = |router: &mut crate::picker::Router| match (&pinned, &version) {
        (Some(_), Some(v)) => {
            router.on_pinned_unsteered(pool, v);
            Err(Rejected {
                version: v.clone(),
                reason: RejectReason::NoPod,
            })
        }
        _ => Ok(None),
    };
    let (ranked, score) = match decision {
        Decision::Steer {
            ranked,
            chosen_score,
        } => (ranked, chosen_score),
        Decision::FailOpen { ranked } => (ranked, 0.0),
        Decision::Fallback(_) => return unsteered(p.router),
    };
    let written = p.router.write_ranked(pool, &ranked, p.scratch)
        && host.steer(&p.router.config().routing_header, p.scratch);
    if !written {
        p.router.counters_mut().steer_failed += 1;
        return unsteered(p.router);
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
    let features = p.router.learned_features(pool, chosen);
    Ok(Some(Steered {
        ranked: p.scratch.clone(),
        score,
        sent_ms: now,
        probe,
        version,
        features,
    }))
}
