//! `breaker.syntheticProbe` (issue 30, part 3): a half-open pod is probed with a request of the
//! filter's own instead of a client's. Off unless configured.
//!
//! Without it, a half-open pod's probes are client requests: the picker sends the pod the next
//! request it can take, and a pod that still fails fails that client. With it, no client request
//! goes to a half-open pod (it is cut like an open one, see [`Breaker::takes_requests`]); the glue
//! asks [`due`] on its timer which pods to probe, sends each the configured request (`POST path`
//! with `body`, steered to the pod by the routing header), and hands the answer to [`answered`].
//! The probe spends the same half-open budget a client probe would, in the breaker every worker
//! shares, so one probe is in flight per pod whichever worker sent it; the next goes
//! `intervalMs` after it. A probe passes when it answered a status below 500 within `timeoutMs`
//! (and `ttftSloMs`, when set) with well-formed OpenAI JSON (an object with a `choices` array, as
//! [`AnswerScanner::well_formed`] judges it); anything else (a 4xx too: the probe is the
//! filter's own, so an error answer means the pod or the probe's body is wrong, never a client)
//! re-opens the pod. `halfOpenProbes` (or `wellFormedProbes`) passes in a row close it.
//!
//! A probe the proxy could not send, or whose answer never came back, is forgotten by the
//! breaker after `baseCooldownMs` (as a lost client probe is), so `timeoutMs` may not exceed it.
//! Per-model breakers and version domains are still probed by client requests.

use serde::Deserialize;

use crate::breaker::{Breaker, BreakerState, Outcome};
use crate::error::ConfigError;
use crate::lifecycle::feedback::count_transitions;
use crate::lifecycle::Worker;
use crate::triggers::AnswerScanner;

/// `x-ai-lb-probe: 1` marks every synthetic probe (the model server's access log can tell them).
pub const PROBE_HEADER: &str = "x-ai-lb-probe";

/// The request the filter sends a half-open pod as its probe, instead of a client's (off when
/// absent). Example: `{"path": "/v1/completions", "body": "{\"model\": \"<model>\",
/// \"prompt\": \"ping\", \"max_tokens\": 1}"}`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "SyntheticProbe")
)]
pub struct RawSyntheticProbe {
    /// Path of the probe request (`POST`), absolute.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "/v1/completions", "minLength" = 1, "maxLength" = 1024))
    )]
    pub path: Option<String>,
    /// JSON body of the probe request: it must name a model every pod of the pool serves and
    /// ask for little (`max_tokens` 1), so a probe costs the pod one short prefill.
    #[cfg_attr(feature = "schema", schemars(extend("maxLength" = 16384)))]
    pub body: String,
    /// `:authority` of the probe request.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "ai-lb-probe", "minLength" = 1, "maxLength" = 255))
    )]
    pub authority: Option<String>,
    /// Least time between two probes of one half-open pod (ms), from any worker: the first
    /// goes at once, each next one this long after the last (a failed one re-opens the pod),
    /// so a healed pod is back after `halfOpenProbes - 1` intervals. A one-token probe costs
    /// the pod little; a long interval only keeps a healed pod out longer (1 s measured
    /// 1.09x `ai_lb`'s p99 TTFT in `fault-flap`).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 250, "minimum" = 100, "maximum" = 600_000))
    )]
    pub interval_ms: Option<u64>,
    /// A probe not answered within this (ms) fails (a timeout); at most `breaker.baseCooldownMs`
    /// (absent: 2000, or `baseCooldownMs` when that is shorter).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2000, "minimum" = 1))
    )]
    pub timeout_ms: Option<u64>,
}

/// The validated `breaker.syntheticProbe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticProbe {
    pub path: String,
    pub body: String,
    pub authority: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

fn header_value_ok(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| (0x21..0x7f).contains(&b))
}

impl SyntheticProbe {
    /// Validates `raw`; `base_cooldown_ms` bounds `timeoutMs` (see the module doc).
    pub fn from_raw(
        raw: &RawSyntheticProbe,
        base_cooldown_ms: u64,
    ) -> Result<SyntheticProbe, ConfigError> {
        let path = raw.path.clone().unwrap_or_else(|| "/v1/completions".into());
        if !path.starts_with('/') || path.len() > 1024 || !header_value_ok(&path) {
            return Err(ConfigError::new(
                "breaker.syntheticProbe.path",
                &path,
                "must be an absolute path (starting with /) of at most 1024 visible ASCII characters",
            ));
        }
        let authority = raw
            .authority
            .clone()
            .unwrap_or_else(|| "ai-lb-probe".into());
        if authority.len() > 255 || !header_value_ok(&authority) {
            return Err(ConfigError::new(
                "breaker.syntheticProbe.authority",
                &authority,
                "must be 1 to 255 visible ASCII characters",
            ));
        }
        if raw.body.len() > 16 * 1024 {
            return Err(ConfigError::new(
                "breaker.syntheticProbe.body",
                format!("{} bytes", raw.body.len()),
                "must be at most 16384 bytes",
            ));
        }
        match serde_json::from_str::<serde_json::Value>(&raw.body) {
            Ok(v) if v.is_object() => {}
            _ => {
                return Err(ConfigError::new(
                    "breaker.syntheticProbe.body",
                    &raw.body,
                    "must be a JSON object (the request an OpenAI-compatible server answers)",
                ))
            }
        }
        let interval_ms = match raw.interval_ms {
            None => 250,
            Some(x) if (100..=600_000).contains(&x) => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "breaker.syntheticProbe.intervalMs",
                    x,
                    "must be within 100..=600000",
                ))
            }
        };
        let timeout_ms = match raw.timeout_ms {
            None => 2000.min(base_cooldown_ms).max(1),
            Some(x) if x >= 1 && x <= base_cooldown_ms => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "breaker.syntheticProbe.timeoutMs",
                    x,
                    format!(
                        "must be at least 1 and at most breaker.baseCooldownMs \
                         ({base_cooldown_ms}): a probe unanswered by then is forgotten"
                    ),
                ))
            }
        };
        Ok(SyntheticProbe {
            path,
            body: raw.body.clone(),
            authority,
            interval_ms,
            timeout_ms,
        })
    }
}

/// One probe to send (from [`due`]): `POST` to the pool's inference cluster with `headers` and
/// `body`, answered or given up within `timeout_ms`; the routing header in `headers` steers it
/// to `pod`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeCall {
    pub pool: usize,
    /// Serving address `IP:PORT` of the probed pod.
    pub pod: String,
    pub cluster: String,
    /// `:method`, `:path`, `:authority`, `content-type`, the routing header and [`PROBE_HEADER`].
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub timeout_ms: u64,
    /// When it was handed out (the proxy's clock, ms).
    pub sent_ms: u64,
}

/// How a probe ended, as the proxy reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeAnswer {
    /// A response with this status and body.
    Response { status: u16, body: Vec<u8> },
    /// No response: timed out, or the connection failed or was reset.
    Failed { timeout: bool },
}

/// The probes to send now (call it on the glue's timer): for every pool, each pod whose shared
/// breaker is half-open with a probe slot free and no probe for `intervalMs` gets one, its slot
/// spent in the shared breaker (so no other worker sends it too). Nothing when the option is
/// off. Transitions met on the way (a cooldown that ended: Open → HalfOpen) are counted, and
/// opens logged through `log`.
pub fn due<W: Worker + ?Sized>(
    worker: &mut W,
    now: u64,
    log: &mut dyn FnMut(&str),
) -> Vec<ProbeCall> {
    let Some(sp) = worker.router().config().synthetic_probe.clone() else {
        return Vec::new();
    };
    let mut calls = Vec::new();
    for pool in 0..worker.router().pool_count() {
        worker.refresh(pool, now);
        // This worker's copy says which pods may be due; the shared breaker decides.
        let maybe: Vec<String> = {
            let r = worker.router();
            r.pod_addresses(pool)
                .filter(|a| {
                    r.breaker(pool, a, None).is_some_and(|b| match b.state() {
                        BreakerState::HalfOpen => true,
                        BreakerState::Open => now >= b.open_until_ms(),
                        BreakerState::Closed => false,
                    })
                })
                .map(str::to_string)
                .collect()
        };
        if maybe.is_empty() {
            continue;
        }
        let (cluster, name, routing_header) = {
            let c = worker.router().config();
            let Some(p) = c.pools.get(pool) else { continue };
            (p.cluster.clone(), p.name.clone(), c.routing_header.clone())
        };
        for pod in maybe {
            let cfg = worker.router().breaker_config_for(pool, &pod);
            let p = worker.parts();
            let mut spent = false;
            let take = &mut |b: &mut Breaker| {
                spent = b.take_synthetic_probe(now, &cfg, sp.interval_ms);
                None
            };
            if let Some(ts) = p.breakers.update(p.router, pool, &pod, now, take) {
                count_transitions(p.stats, log, &name, &pod, &ts);
            } else {
                spent = false;
            }
            if !spent {
                continue;
            }
            p.router.counters_mut().probe_sent += 1;
            calls.push(ProbeCall {
                pool,
                headers: vec![
                    (":method".into(), "POST".into()),
                    (":path".into(), sp.path.clone()),
                    (":authority".into(), sp.authority.clone()),
                    ("content-type".into(), "application/json".into()),
                    (routing_header.clone(), pod.clone()),
                    (PROBE_HEADER.into(), "1".into()),
                ],
                pod,
                cluster: cluster.clone(),
                body: sp.body.clone(),
                timeout_ms: sp.timeout_ms,
                sent_ms: now,
            });
        }
    }
    calls
}

/// The proxy refused to send `call` (counted; the breaker forgets its probe after
/// `baseCooldownMs`, as a lost one).
pub fn not_sent<W: Worker + ?Sized>(worker: &mut W, call: &ProbeCall, log: &mut dyn FnMut(&str)) {
    let p = worker.parts();
    p.router.counters_mut().probe_not_sent += 1;
    log(&format!(
        "ai-lb: synthetic probe of {} on cluster `{}` could not be sent",
        call.pod, call.cluster
    ));
}

/// The outcome `answer` stands for, judged as the module doc says (`elapsed_ms`: since the
/// probe was sent).
pub fn outcome_of(answer: &ProbeAnswer, elapsed_ms: u64) -> Outcome {
    match answer {
        ProbeAnswer::Response { status, body } => {
            let mut scanner = AnswerScanner::new(Some(*status));
            scanner.feed(body);
            Outcome {
                status: Some(*status),
                ttft_ms: Some(elapsed_ms),
                total_ms: Some(elapsed_ms),
                malformed: !scanner.well_formed(),
                ..Outcome::default()
            }
        }
        ProbeAnswer::Failed { timeout } => Outcome {
            timeout: *timeout,
            reset: !*timeout,
            total_ms: Some(elapsed_ms),
            ..Outcome::default()
        },
    }
}

/// Records a probe's answer in the pod's shared breaker: a pass counts toward closing it, a
/// failure re-opens it. An answer arriving when the pod is no longer half-open (reopened by
/// its agent's report meanwhile) changes nothing. Returns whether the probe passed.
pub fn answered<W: Worker + ?Sized>(
    worker: &mut W,
    call: &ProbeCall,
    answer: &ProbeAnswer,
    now: u64,
    log: &mut dyn FnMut(&str),
) -> bool {
    let cfg = worker.router().breaker_config_for(call.pool, &call.pod);
    let failure = outcome_of(answer, now.saturating_sub(call.sent_ms)).failure(&cfg);
    let name = worker
        .router()
        .config()
        .pools
        .get(call.pool)
        .map_or_else(String::new, |p| p.name.clone());
    let p = worker.parts();
    if failure.is_some() {
        p.router.counters_mut().probe_failed += 1;
        p.stats.failed(&call.pod);
    } else {
        p.router.counters_mut().probe_passed += 1;
    }
    let record = &mut |b: &mut Breaker| {
        if b.state() == BreakerState::HalfOpen {
            b.record(failure, now, &cfg)
        } else {
            None
        }
    };
    if let Some(ts) = p
        .breakers
        .update(p.router, call.pool, &call.pod, now, record)
    {
        count_transitions(p.stats, log, &name, &call.pod, &ts);
    }
    failure.is_none()
}
