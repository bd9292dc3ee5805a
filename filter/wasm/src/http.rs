//! One HTTP request: drops any client-supplied routing header, finds the pool and the model
//! (model header, else the JSON body's `model`), asks the core's router, writes the ranked list
//! `a,b,c` into the routing header for override_host, and at the end feeds the outcome (status,
//! resets, connect failures, TTFT, latency) to the shared per-pod breakers.
//!
//! Request headers are only touched in the request phase (they are gone afterwards and the
//! SDK's helpers would trap); everything later comes from properties and response headers.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use ai_lb_filter_core::breaker::{BreakerState, Outcome, TripReason};
use ai_lb_filter_core::picker::{Decision, RequestSize};
use ai_lb_filter_core::prefix::PromptKeys;
use ai_lb_filter_core::status::scoreboard_json;

use ai_lb_filter_core::admission::config::TenantKeySource;
use ai_lb_filter_core::admission::cost::BodyPlan;
use ai_lb_filter_core::admission::priority::{self, PriorityDecision};

use crate::admission::{self, AdmReq, Headers, HeldReq, Step};
use crate::hold::{self, Held};
use crate::host;
use crate::root::{count_transitions, State};
use ai_lb_filter_core::body;
use ai_lb_filter_core::outcome::{self, Observed};

/// Outcome of the class policy for one request.
enum Gate {
    Route,
    Replied,
    Held,
}

/// A context that does nothing (filter not configured for routing).
pub struct PassThrough;

impl Context for PassThrough {}
impl HttpContext for PassThrough {}

pub struct Request {
    state: Rc<RefCell<State>>,
    /// The proxy-wasm context id (the held queue's handle).
    id: u32,
    pool: Option<usize>,
    model: Option<String>,
    /// The routing header value written; empty when nothing was steered.
    ranked: String,
    chosen_score: f64,
    debug: bool,
    waiting_body: bool,
    /// The body's `model` is still needed for routing.
    model_from_body: bool,
    /// The body's prompt is keyed for prefix affinity (`prefixAffinity`).
    prompt_from_body: bool,
    /// The prompt's key blocks, once keyed.
    prompt: Option<PromptKeys>,
    /// Admission control of this request (when configured).
    adm: Option<AdmReq>,
    /// Admission waits for the buffered body to cost it.
    adm_body: bool,
    started_ms: u64,
    /// When the router counted it in flight (see [`Steered::sent_ms`]).
    sent_ms: u64,
    ttft_ms: Option<u64>,
    attempts: Option<u32>,
    /// Body size: the buffered body's, else `content-length` (for the request's size).
    body_bytes: Option<usize>,
    /// The body's output reservation (`max_completion_tokens` or `max_tokens`, times `n`).
    max_output_tokens: Option<u64>,
    /// What this request counts in the router's in-flight estimates (start and end alike).
    size: RequestSize,
    /// Queued in the worker's big-request hold (until [`Request::take_from_root`]).
    big_held: bool,
    /// Sent to a half-open pod as a probe (see [`Steered::probe`]).
    probe: bool,
    /// The probe's response status, read with the response headers (probes only).
    probe_status: Option<u16>,
    /// The probe's success was recorded at its first byte (not again at its end).
    probe_passed: bool,
}

impl Request {
    pub fn new(state: Rc<RefCell<State>>, id: u32) -> Self {
        Self {
            state,
            id,
            pool: None,
            model: None,
            ranked: String::new(),
            chosen_score: 0.0,
            debug: false,
            waiting_body: false,
            model_from_body: false,
            prompt_from_body: false,
            prompt: None,
            adm: None,
            adm_body: false,
            started_ms: 0,
            sent_ms: 0,
            ttft_ms: None,
            attempts: None,
            body_bytes: None,
            max_output_tokens: None,
            size: RequestSize::UNIT,
            big_held: false,
            probe: false,
            probe_status: None,
            probe_passed: false,
        }
    }

    /// Keeps what [`steer`] wrote for this request.
    fn took(&mut self, st: Steered) {
        self.ranked = st.ranked;
        self.chosen_score = st.score;
        self.sent_ms = st.sent_ms;
        self.probe = st.probe;
    }

    fn chosen(&self) -> Option<&str> {
        self.ranked.split(',').next().filter(|s| !s.is_empty())
    }

    /// Asks the router and writes the routing header.
    fn route(&mut self, now: u64) {
        let Some(pool) = self.pool else { return };
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let steered = steer(
            &mut guard,
            pool,
            self.model.as_deref(),
            now,
            self.size,
            self.prompt.as_ref(),
        );
        drop(guard);
        if let Some(st) = steered {
            self.took(st);
        }
    }

    /// Admission passed: the class policy under saturation, then routing. Returns the action
    /// for the current callback.
    fn gate_and_route(&mut self, now: u64) -> Action {
        if let Ok(mut s) = self.state.try_borrow_mut() {
            self.size = s
                .router
                .request_size(self.body_bytes, self.max_output_tokens);
        }
        match self.priority_gate(now) {
            Gate::Route => {
                if self.hold_big(now) {
                    return Action::Pause;
                }
                self.route(now);
                Action::Continue
            }
            Gate::Replied | Gate::Held => Action::Pause,
        }
    }

    /// A big request no pod has room for now waits in the worker's hold (`bigRequestHold`);
    /// true when it was queued (the root's tick routes and resumes it).
    fn hold_big(&mut self, now: u64) -> bool {
        let Some(pool) = self.pool else { return false };
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return false;
        };
        let s = &mut *guard;
        if !s
            .router
            .should_hold(pool, self.model.as_deref(), self.size, now)
        {
            return false;
        }
        let held = Held {
            id: self.id,
            pool,
            model: self.model.clone(),
            size: self.size,
            since_ms: now,
        };
        self.big_held = hold::hold(s, held);
        self.big_held
    }

    /// Sheds, holds or lets through by class when the pool is saturated.
    fn priority_gate(&mut self, now: u64) -> Gate {
        let (Some(pool), Some(a)) = (self.pool, self.adm.as_mut()) else {
            return Gate::Route;
        };
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return Gate::Route;
        };
        // As for a pick: an idle VM's view may be older than refreshMs (it ticks slowly), and
        // judging saturation on it shed or let through by a pool state up to a tick old.
        crate::root::refresh_view_if_old(&mut guard, pool, now);
        let State {
            router,
            admission,
            metrics,
            ..
        } = &mut *guard;
        let Some(rt) = admission.as_mut() else {
            return Gate::Route;
        };
        let sat = rt.cfg.saturation;
        let (saturated, _) = admission::saturation(router, pool, now, sat.soft_threshold);
        match priority::decide(&sat, a.class, saturated, rt.held.has_room(), now) {
            PriorityDecision::Proceed => {
                if saturated {
                    a.count(metrics, "saturated_proceed", 1);
                }
                Gate::Route
            }
            PriorityDecision::Shed { retry_after_s } => {
                a.count(metrics, "shed", 1);
                admission::count(metrics, "shed", 1);
                a.refund_all = true;
                admission::shed_reply(retry_after_s);
                Gate::Replied
            }
            PriorityDecision::Reject { retry_after_s } => {
                a.count(metrics, "held_rejected", 1);
                admission::count(metrics, "held_rejected", 1);
                a.refund_all = true;
                admission::overloaded_reply(retry_after_s);
                Gate::Replied
            }
            PriorityDecision::Hold { deadline_ms } => {
                if rt.held.push(self.id, a.class, now, deadline_ms).is_err() {
                    a.count(metrics, "held_rejected", 1);
                    admission::count(metrics, "held_rejected", 1);
                    a.refund_all = true;
                    admission::overloaded_reply(sat.retry_after_seconds);
                    return Gate::Replied;
                }
                rt.held_reqs.insert(
                    self.id,
                    HeldReq {
                        pool,
                        model: self.model.clone(),
                        stat_tenant: a.stat_tenant.clone(),
                        size: self.size,
                    },
                );
                a.count(metrics, "held", 1);
                admission::count(metrics, "held", 1);
                metrics.set("ailb.admission.held_depth", rt.held.depth() as u64);
                Gate::Held
            }
        }
    }

    /// Takes what the root recorded for this request: the ranked list it wrote when it released
    /// the request from the held queue, or that it answered it 503 (refund).
    fn take_from_root(&mut self) {
        let Ok(mut s) = self.state.try_borrow_mut() else {
            return;
        };
        let big_resumed = if std::mem::take(&mut self.big_held) {
            hold::take(&mut s, self.id)
        } else {
            None
        };
        let Some(rt) = s.admission.as_mut() else {
            drop(s);
            if let Some(st) = big_resumed {
                self.took(st);
            }
            return;
        };
        let resumed = rt.resumed.remove(&self.id);
        let expired = rt.expired.remove(&self.id);
        // A client that left while held.
        if rt.held.remove(self.id) {
            rt.held_reqs.remove(&self.id);
        }
        drop(s);
        if let Some(st) = resumed.or(big_resumed) {
            self.took(st);
        }
        if expired {
            if let Some(a) = self.adm.as_mut() {
                a.refund_all = true;
            }
        }
    }

    /// Starts admission control (tenant, class, body plan). A request without a body, or one
    /// costed by its length, is admitted here; a JSON body is costed when it has arrived.
    fn begin_admission(&mut self, now: u64, end_of_stream: bool) -> Step {
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return Step::Proceed;
        };
        let State {
            admission, metrics, ..
        } = &mut *guard;
        let Some(rt) = admission.as_mut() else {
            return Step::Proceed;
        };
        let headers = Headers::fetch(admission::header_names(&rt.cfg));
        let peer = if rt.cfg.tenant_key.contains(&TenantKeySource::PeerPrincipal) {
            host::property_string(&["connection", "uri_san_peer_certificate"])
                .filter(|p| !p.is_empty())
                .or_else(|| host::property_string(&["source", "principal"]))
        } else {
            None
        };
        let (mut adm, plan) = admission::begin(rt, &headers, peer.as_deref(), metrics);
        let step = match plan {
            // No body at all: nothing to cost.
            _ if end_of_stream => Step::Proceed,
            BodyPlan::ByLength(n) => adm.admit_length(n, now, metrics),
            BodyPlan::Buffer => {
                self.adm_body = true;
                Step::Proceed
            }
        };
        self.adm = Some(adm);
        step
    }

    /// The whole request body is here: model for routing, cost for admission, then route.
    fn body_done(&mut self, body: &[u8]) -> Action {
        let now = host::now_ms();
        self.body_bytes = Some(body.len());
        let fields = body::routing_fields(body);
        self.max_output_tokens = fields.max_output_tokens;
        if self.model_from_body {
            self.model = fields.model;
        }
        if self.prompt_from_body {
            if let (Some(pool), Ok(mut s)) = (self.pool, self.state.try_borrow_mut()) {
                let State {
                    router,
                    prompt_ids,
                    key_scratch,
                    ..
                } = &mut *s;
                self.prompt = router.key_prompt(pool, body, prompt_ids, key_scratch);
            }
        }
        if self.adm_body {
            self.adm_body = false;
            let step = match (self.adm.as_mut(), self.state.try_borrow_mut()) {
                // An empty or unreadable body (e.g. after trailers) is costed by its length.
                (Some(a), Ok(mut s)) if body.is_empty() => a.admit_length(0, now, &mut s.metrics),
                (Some(a), Ok(mut s)) => a.admit_body(body, now, &mut s.metrics),
                _ => Step::Proceed,
            };
            if step == Step::Replied {
                return Action::Pause;
            }
        }
        self.gate_and_route(now)
    }

    /// Records a probe's success at its first byte when it already counts as one
    /// ([`Outcome::probe_passed_at_first_byte`]) and came from the probed pod (not a retry
    /// elsewhere); its end then records only a failure.
    fn pass_probe(&mut self, ttft_ms: u64, now: u64) {
        let Some(pool) = self.pool else { return };
        let Some(chosen) = self.chosen().map(str::to_string) else {
            return;
        };
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let State {
            router,
            metrics,
            breakers,
            ..
        } = &mut *guard;
        let cfg = router.config().breaker;
        if !Outcome::probe_passed_at_first_byte(self.probe_status, ttft_ms, &cfg) {
            return;
        }
        if host::property_string(&["upstream", "address"]).as_deref() != Some(chosen.as_str()) {
            return;
        }
        self.probe_passed = true;
        if let Some(ts) = breakers.update(router, pool, &chosen, now, |b| b.record(None, now, &cfg))
        {
            count_transitions(metrics, &ts);
        }
    }

    fn finish(&mut self) {
        let Some(pool) = self.pool else { return };
        let now = host::now_ms();
        let upstream = host::property_string(&["upstream", "address"]);
        let status = host::property_u64(&["response", "code"])
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| *c > 0);
        let flags = host::property_u64(&["response", "flags"]).unwrap_or(0);
        // Details only refine failures; a clean answer (< 500, no flag) needs none (one host
        // call fewer on the common path).
        let clean_answer = flags == 0 && status.is_some_and(|c| c < 500);
        let details = if clean_answer {
            String::new()
        } else {
            host::property_string(&["response", "code_details"]).unwrap_or_default()
        };
        let observed = Observed {
            ranked: &self.ranked,
            upstream: upstream.as_deref(),
            status,
            flags,
            details: &details,
            attempts: self.attempts,
            ttft_ms: self.ttft_ms,
            total_ms: Some(now.saturating_sub(self.started_ms)),
        };
        let pairs = outcome::attribute(&observed);
        let chosen = self.chosen().map(str::to_string);
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let State {
            router,
            metrics,
            breakers,
            ..
        } = &mut *guard;
        let cfg = router.config().breaker;
        let Some(name) = router.config().pools.get(pool).map(|p| p.name.clone()) else {
            return;
        };
        let model = self.model.as_deref();
        // Whether the chosen pod's breaker had nothing to forget (Closed, no failure counted, as
        // of this VM's last sync with the shared breakers, at this VM's last pick or refresh): a
        // success then leaves the shared breaker as it is, so it is not read and rewritten.
        let clean_before = chosen.as_deref().is_some_and(|c| {
            router
                .breaker(pool, c, None)
                .is_some_and(|b| b.state() == BreakerState::Closed && b.consecutive_failures() == 0)
        });
        // The chosen pod was counted in flight: close that however the request ended, then
        // let its local breaker record (the shared breaker below is authoritative). A
        // cancelled request teaches the breaker nothing.
        let mut rate_tripped = false;
        if let Some(c) = chosen.as_deref() {
            router.on_request_end(pool, c, self.size, self.sent_ms);
            if let Some((_, o)) = pairs.iter().find(|(p, _)| *p == c) {
                // This VM's failure-rate window can open the pod's breaker; the shared breaker
                // below is authoritative, so the trip is carried there.
                rate_tripped = router.on_outcome(pool, c, model, o, now).iter().any(|e| {
                    e.to == BreakerState::Open && e.reason == Some(TripReason::FailureRate)
                });
            }
        }
        for (pod, o) in &pairs {
            let failure = o.failure(&cfg);
            let is_chosen = chosen.as_deref() == Some(*pod);
            if failure.is_some() {
                metrics.failure(pod);
            } else if is_chosen && !rate_tripped && clean_before {
                continue;
            }
            let trip_rate = rate_tripped && is_chosen;
            // A probe whose success was recorded at its first byte is not recorded again; the
            // shared breaker is still read back, over what this VM's own breaker counted above.
            let on_record = is_chosen && self.probe_passed && failure.is_none() && !trip_rate;
            if let Some(ts) = breakers.update(router, pool, pod, now, |b| {
                if on_record {
                    return None;
                }
                let t = b.record(failure, now, &cfg);
                if t.is_none() && trip_rate && b.state() == BreakerState::Closed {
                    b.trip(TripReason::FailureRate, now, &cfg)
                } else {
                    t
                }
            }) {
                count_transitions(metrics, &ts);
                for t in &ts {
                    if t.to == BreakerState::Open {
                        host::log(
                            LogLevel::Warn,
                            &format!(
                                "ai-lb: pool `{name}`: breaker of {pod} opened ({})",
                                t.reason.map_or("unknown", |r| r.as_str())
                            ),
                        );
                    }
                }
            }
        }
    }
}

/// What [`steer`] wrote for one request.
#[derive(Debug)]
pub struct Steered {
    /// The ranked list written (chosen pod first).
    pub ranked: String,
    /// The chosen pod's score.
    pub score: f64,
    /// When it was counted in flight (passed back to `on_request_end`).
    pub sent_ms: u64,
    /// The chosen pod was half-open: this request is one of its probes.
    pub probe: bool,
}

/// Asks the router for `pool` (and `model`), writes the routing header of the request whose
/// context is current, and counts the pick. None when nothing was steered.
pub fn steer(
    state: &mut State,
    pool: usize,
    model: Option<&str>,
    now: u64,
    size: RequestSize,
    prompt: Option<&PromptKeys>,
) -> Option<Steered> {
    // A VM that was idle ticks slowly: its view of the pool may be older than refreshMs.
    crate::root::refresh_view_if_old(state, pool, now);
    let State {
        router,
        metrics,
        rng,
        scratch,
        breakers,
        ..
    } = state;
    // Another worker may have just opened a breaker: see it before picking.
    breakers.sync(router, pool, now);
    let mut chosen_score = 0.0;
    let ranked = match router.decide_with(pool, model, size, prompt, now, rng) {
        Decision::Steer {
            ranked,
            chosen_score: c,
        } => {
            chosen_score = c;
            ranked
        }
        Decision::FailOpen { ranked } => ranked,
        Decision::Fallback(_) => return None,
    };
    if !router.write_ranked(pool, &ranked, scratch) {
        return None;
    }
    let header = router.config().routing_header.clone();
    if let Err(e) = host::set_request_header(&header, Some(scratch)) {
        host::log(
            LogLevel::Warn,
            &format!("ai-lb: cannot set `{header}`: {e:?}"),
        );
        return None;
    }
    let written = scratch.clone();
    let chosen = written.split(',').next()?;
    router.on_request_start(pool, chosen, size, now);
    metrics.pick(chosen);
    // A half-open pod's probe budget is shared by every VM.
    let probe = router
        .breaker(pool, chosen, None)
        .is_some_and(|b| b.state() == BreakerState::HalfOpen);
    if probe {
        if let Some(ts) = breakers.update(router, pool, chosen, now, |b| {
            b.on_request(now);
            None
        }) {
            count_transitions(metrics, &ts);
        }
    }
    Some(Steered {
        ranked: written,
        score: chosen_score,
        sent_ms: now,
        probe,
    })
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let now = host::now_ms();
        self.started_ms = now;
        let (routing_header, model_header, debug_header, status_path, pools) = {
            let Ok(s) = self.state.try_borrow() else {
                return Action::Continue;
            };
            let c = s.router.config();
            (
                c.routing_header.clone(),
                c.model_header.clone(),
                c.debug_header.clone(),
                c.status_path.clone(),
                c.pools.len(),
            )
        };
        // Clients cannot steer: whatever they sent in the routing header is dropped first.
        if let Err(e) = host::set_request_header(&routing_header, None) {
            host::log(
                LogLevel::Warn,
                &format!("ai-lb: cannot remove `{routing_header}`: {e:?}"),
            );
        }
        if let Some(path) = status_path.as_deref() {
            let req_path = host::request_header(":path").unwrap_or_default();
            let bare = req_path.split('?').next().unwrap_or("");
            if bare == path {
                let body = match self.state.try_borrow_mut() {
                    Ok(mut s) => {
                        for i in 0..pools {
                            crate::root::refresh_view_if_old(&mut s, i, now);
                        }
                        scoreboard_json(&s.router, now)
                    }
                    Err(_) => "{}".to_string(),
                };
                let _ = host::send_response(
                    200,
                    vec![("content-type", "application/json")],
                    body.as_bytes(),
                );
                return Action::Pause;
            }
        }
        let cluster = host::property_string(&["xds", "cluster_name"]);
        self.pool = {
            let Ok(s) = self.state.try_borrow() else {
                return Action::Continue;
            };
            match cluster.as_deref() {
                Some(c) => s.router.config().pool_by_cluster(c),
                None if pools == 1 => Some(0),
                None => None,
            }
        };
        if self.pool.is_none() {
            return Action::Continue;
        }
        self.debug = debug_header.is_some_and(|h| host::request_header(&h).is_some());
        if let Some(h) = model_header.as_deref() {
            self.model = host::request_header(h).filter(|m| !m.is_empty());
            // Decide from the body's `model` (needs allow_on_headers_stop_iteration).
            self.model_from_body = self.model.is_none() && !end_of_stream;
        }
        // Prefix affinity reads the prompt (needs allow_on_headers_stop_iteration), when some
        // pod of the pool reports its cache.
        self.prompt_from_body = !end_of_stream
            && self.state.try_borrow().is_ok_and(|s| {
                self.pool
                    .is_some_and(|p| s.router.prefix_space(p).is_some())
            });
        if self.begin_admission(now, end_of_stream) == Step::Replied {
            return Action::Pause;
        }
        if self.model_from_body || self.adm_body || self.prompt_from_body {
            self.waiting_body = true;
            return Action::Pause;
        }
        // The body is not read: its declared length still sizes the prompt.
        if !end_of_stream {
            self.body_bytes =
                host::request_header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
        }
        self.gate_and_route(now)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.waiting_body {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.waiting_body = false;
        let b = host::request_body(body_size).unwrap_or_default();
        self.body_done(&b)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.waiting_body {
            self.waiting_body = false;
            // The body ended without end_of_stream: it is all buffered now.
            let b = host::request_body(usize::MAX).unwrap_or_default();
            return self.body_done(&b);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.pool.is_none() {
            return Action::Continue;
        }
        if self.adm.is_some() || self.big_held {
            self.take_from_root();
        }
        if let Some(a) = self.adm.as_mut().filter(|a| !a.refund_all) {
            a.on_response_headers();
            if end_of_stream {
                if let Ok(mut s) = self.state.try_borrow_mut() {
                    a.on_response_end(&mut s.metrics);
                }
            }
        }
        self.attempts = host::response_header("x-envoy-attempt-count").and_then(|v| v.parse().ok());
        if self.probe {
            self.probe_status = host::response_header(":status").and_then(|v| v.parse().ok());
        }
        if end_of_stream && self.ttft_ms.is_none() {
            self.ttft_ms = Some(host::now_ms().saturating_sub(self.started_ms));
        }
        if self.debug {
            let header = self
                .state
                .try_borrow()
                .ok()
                .and_then(|s| s.router.config().debug_header.clone());
            if let Some(h) = header {
                let value = ai_lb_filter_core::status::debug_header_value(
                    self.chosen(),
                    self.chosen_score,
                    &self.ranked,
                );
                let _ = host::set_response_header(&h, &value);
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.ttft_ms.is_none() && self.pool.is_some() {
            let now = host::now_ms();
            let ttft = now.saturating_sub(self.started_ms);
            self.ttft_ms = Some(ttft);
            // A probe whose answer has started well passes now; the rest of a long stream
            // need not keep the pod half-open.
            if self.probe && !end_of_stream {
                self.pass_probe(ttft, now);
            }
        }
        if let Some(a) = self.adm.as_mut().filter(|a| a.scanner.is_some()) {
            if body_size > 0 {
                if let Some(chunk) = host::response_body(body_size) {
                    a.on_response_body(&chunk);
                }
            }
            if end_of_stream {
                if let Ok(mut s) = self.state.try_borrow_mut() {
                    a.on_response_end(&mut s.metrics);
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.adm.is_some() || self.big_held {
            self.take_from_root();
        }
        if let Some(mut a) = self.adm.take() {
            if let Ok(mut s) = self.state.try_borrow_mut() {
                a.settle(host::now_ms(), &mut s.metrics);
            }
        }
        self.finish();
    }
}
