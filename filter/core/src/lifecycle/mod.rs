//! One request's life, for both data paths: what the filter does at each event of an HTTP
//! exchange (request headers, the buffered body, response headers, response chunks, the end),
//! as one state machine ([`Exchange`]) that reaches the proxy only through [`Host`] and the
//! worker's routing state only through [`Worker`]. The proxy-wasm glue and the native module
//! each translate their callbacks into these events and do nothing else of the request's life;
//! the core's tests drive it with a mock host and no Envoy (`filter/core/tests/lifecycle.rs`).
//!
//! The steps, in order:
//! 1. request headers: drop a client-sent routing header (and an untrusted priority header);
//!    answer the status path; find the pool by the routed cluster; read the model header and
//!    the debug header (which goes no further); decide whether the body must be read (the
//!    model is only in the body, or a pod of the pool reports its prefix cache); let the
//!    [`Gate`] (admission, when the glue has one) start.
//! 2. the whole body (when asked for): the model, the output reservation, the prompt's key
//!    blocks; the gate costs it.
//! 3. the gate may reply or hold the request; else it is routed ([`steer`]): the ranked list is
//!    handed to Envoy, the pick counted in flight, a half-open pod's probe budget spent.
//! 4. response headers: the attempt count, a probe's status, the debug header.
//! 5. the first response chunk: the time to first byte; a probe that started well passes.
//! 6. the end: the in-flight count is closed however the request ended, and the outcome of
//!    every attempt feeds the pods' breakers ([`feedback`]).

pub mod admission;
pub(crate) mod feedback;
pub mod guard;
pub mod hold;
mod steer;

use std::borrow::Cow;

use rand::RngCore;

use crate::breaker::{Breaker, Transition};
use crate::picker::{RequestSize, Router};
use crate::prefix::PromptKeys;
use crate::status::{debug_header_value, scoreboard};

pub use steer::{reject_reply, steer, steer_checked, Rejected, Steered};

/// What the core may ask of the proxy for the current request, nothing more. Each data path
/// implements it over its own host calls (proxy-wasm hostcalls; the dynamic module's ABI).
pub trait Host {
    /// The proxy's clock, in ms.
    fn now_ms(&self) -> u64;
    fn request_header(&self, name: &str) -> Option<Cow<'_, str>>;
    /// Sets (`Some`) or removes (`None`) a request header; false when the proxy refused.
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool;
    fn response_header(&self, name: &str) -> Option<Cow<'_, str>>;
    fn set_response_header(&mut self, name: &str, value: &str);
    /// Answers the request locally (the request goes no further).
    fn send_local_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]);
    /// The routed cluster's name.
    fn cluster_name(&self) -> Option<Cow<'_, str>>;
    /// The final upstream host (`ip:port`), once one was chosen.
    fn upstream_address(&self) -> Option<Cow<'_, str>>;
    /// The final response status (0 or absent: none was sent).
    fn response_code(&self) -> Option<u16>;
    /// Envoy's response-flag bits, where the proxy exposes them (else 0: the details say it).
    fn response_flags(&self) -> u64;
    fn response_code_details(&self) -> Option<Cow<'_, str>>;
    /// Hands the ranked list (`chosen,next,...`) to Envoy's balancer: the routing header for
    /// override_host, or the data path's own way. False when nothing was handed over.
    fn steer(&mut self, routing_header: &str, ranked: &str) -> bool;
    /// A warning in the proxy's log.
    fn warn(&mut self, msg: &str);
    /// Whether Envoy's retries go down the ranked list (override_host with the list), so the
    /// pod that answered says how many attempts there were. False where Envoy's own balancer
    /// serves retries (the native module's `steering: overrideHost`): the attempt count is
    /// then read from `x-envoy-attempt-count`.
    fn retries_follow_ranked(&self) -> bool {
        true
    }
    /// The downstream peer's identity (its certificate's URI SAN, or what the proxy knows of
    /// it), for the `peerPrincipal` tenant key. None where the proxy cannot say.
    fn peer_principal(&self) -> Option<Cow<'_, str>> {
        None
    }
    /// Sets the filter state `envoy.ratelimit.hits_addend` to `n` (the cost Envoy's rate
    /// limit filter sends); false when the proxy refused or cannot.
    fn set_hits_addend(&mut self, _n: u64) -> bool {
        false
    }
    /// The bytes of the response chunk being delivered (`size` of them, as the event said);
    /// None where none can be read.
    fn response_chunk(&self, _size: usize) -> Option<Vec<u8>> {
        None
    }
}

/// Counts of the request path that only the glue can export (Envoy stats).
pub trait Stats {
    /// A request was steered to `pod`.
    fn picked(&mut self, pod: &str);
    /// A failure was attributed to `pod`.
    fn failed(&mut self, pod: &str);
    /// Transitions of `pod`'s shared breaker written by this worker (each counted once for
    /// the process: only the writer sees them).
    fn transitions(&mut self, pod: &str, ts: &[Transition]);
}

/// The circuit breakers every worker of the proxy shares (the wasm filter: Envoy's shared data
/// with CAS; the native module: process memory). Per-model breakers stay per worker.
pub trait BreakerStore {
    /// Installs the other workers' changes of `pool`'s breakers into `router`.
    fn sync(&mut self, router: &mut Router, pool: usize, now: u64);
    /// Polls then applies `update` to `pod`'s shared breaker, stores it when it changed and
    /// installs it in `router`. The transitions, or None when it could not be written.
    fn update(
        &mut self,
        router: &mut Router,
        pool: usize,
        pod: &str,
        now: u64,
        update: &mut dyn FnMut(&mut Breaker) -> Option<Transition>,
    ) -> Option<Vec<Transition>>;
}

/// The routing state of one worker (a wasm VM; a native worker thread), split into the parts
/// a step borrows together.
pub struct Parts<'a> {
    pub router: &'a mut Router,
    pub rng: &'a mut dyn RngCore,
    /// Reused buffer for the ranked list.
    pub scratch: &'a mut String,
    /// Reused buffers for keying prompts (`prefixAffinity`).
    pub prompt_ids: &'a mut Vec<u32>,
    pub key_scratch: &'a mut Vec<u64>,
    pub breakers: &'a mut dyn BreakerStore,
    pub stats: &'a mut dyn Stats,
}

/// A worker's routing state, as the lifecycle uses it.
pub trait Worker {
    /// Brings `pool`'s view up to date before a decision: a newer pool state published by the
    /// agent feed, and the other workers' breaker changes.
    fn refresh(&mut self, pool: usize, now: u64);
    fn parts(&mut self) -> Parts<'_>;
    /// The router, to read (its config, its view).
    fn router(&self) -> &Router;
    /// Which worker this is, for the status page (each worker answers from its own view).
    fn ordinal(&self) -> u64;
}

/// What the admission step (a [`Gate`]) says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateStep {
    /// Go on.
    Proceed,
    /// Cost it from the whole body (only from [`Gate::begin`]).
    NeedBody,
    /// The gate answered the request itself (a 429 or 503 was sent).
    Replied,
    /// The gate keeps the request waiting; the glue resumes it later (its root context
    /// routes it with [`steer`] and continues the stream).
    Held,
}

/// Admission control and holds, where the glue has them: asked at fixed points of the
/// lifecycle. Each method receives the worker, so the gate's runtime may live there.
/// [`NoGate`] lets everything through.
pub trait Gate<W: ?Sized> {
    /// The headers were read and the pool is known: start (tenant, class, cost plan).
    fn begin<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        _worker: &mut W,
        _end_of_stream: bool,
        _now: u64,
    ) -> GateStep {
        GateStep::Proceed
    }
    /// The body arrived (after [`GateStep::NeedBody`]): cost it. `complete` is false when
    /// only its first `maxBodyReadBytes` were held back (cost it by its length then).
    fn body<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        _worker: &mut W,
        _body: &[u8],
        _complete: bool,
        _now: u64,
    ) -> GateStep {
        GateStep::Proceed
    }
    /// Just before routing: shed, hold or let through.
    fn before_route<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        _worker: &mut W,
        _pool: usize,
        _model: Option<&str>,
        _size: RequestSize,
        _now: u64,
    ) -> GateStep {
        GateStep::Proceed
    }
    /// The request was routed (at once, or on its release from a hold) to `steered`'s pod.
    fn routed(&mut self, _worker: &mut W, _pool: usize, _steered: &Steered, _now: u64) {}
    /// A held request came back: what its release steered (None: nothing, or answered).
    fn take_resumed(&mut self, _worker: &mut W) -> Option<Steered> {
        None
    }
    fn on_response_headers<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        _worker: &mut W,
        _end_of_stream: bool,
    ) {
    }
    /// A response chunk of `size` bytes (its bytes: [`Host::response_chunk`]).
    fn on_response_body<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        _worker: &mut W,
        _size: usize,
        _end_of_stream: bool,
    ) {
    }
    /// The request is over (before the breakers are fed).
    fn on_end<H: Host + ?Sized>(&mut self, _host: &mut H, _worker: &mut W, _now: u64) {}
}

/// The gate of a data path without admission.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoGate;

impl<W: ?Sized> Gate<W> for NoGate {}

/// What a request-phase event tells the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Continue,
    /// Buffer the body and call again when it is whole.
    StopForBody,
    /// Stop: the request was answered locally, or is held (the glue resumes it).
    Stop,
}

/// One HTTP exchange through the filter.
#[derive(Debug)]
pub struct Exchange {
    /// The pool of the routed cluster; None: not ours, the filter stays out of the way.
    pool: Option<usize>,
    model: Option<String>,
    /// The body's `model` is still needed.
    model_from_body: bool,
    /// The body's prompt is keyed for prefix affinity.
    prompt_from_body: bool,
    prompt: Option<PromptKeys>,
    /// The body is awaited (by routing or by the gate).
    waiting_body: bool,
    /// The gate costs the body when it is whole.
    gate_body: bool,
    /// Most body bytes held back (`maxBodyReadBytes`).
    body_cap: usize,
    /// The body's declared length (`content-length`), when the body is awaited.
    declared_len: Option<usize>,
    /// Body size: the buffered body's, else `content-length`.
    body_bytes: Option<usize>,
    /// The body's output reservation (`max_completion_tokens` or `max_tokens`, times `n`).
    max_output_tokens: Option<u64>,
    /// What this request counts in the router's in-flight estimates (start and end alike).
    size: RequestSize,
    /// The held request may come back routed (see [`Gate::take_resumed`]).
    held: bool,
    steered: Option<Steered>,
    started_ms: u64,
    ttft_ms: Option<u64>,
    /// The response's status, read with its headers.
    status: Option<u16>,
    /// The pod that answered (`ip:port`), read with the response headers (the final attempt's).
    upstream: Option<String>,
    /// The whole response went through (its end of stream was seen).
    response_complete: bool,
    /// `x-envoy-attempt-count`, read only where retries do not follow the ranked list.
    attempts: Option<u32>,
    /// The client asked for the debug response header.
    debug: bool,
    /// The probe's success was recorded at its first byte (not again at its end).
    probe_passed: bool,
    /// The chosen pod's answer as it streams, read when `breaker.truncation` is on or a
    /// probe is judged by `breaker.wellFormedProbes` ([`crate::triggers`]).
    answer: Option<Box<crate::triggers::AnswerScanner>>,
    /// The end was handled (the in-flight count closed, the breakers fed).
    ended: bool,
}

impl Default for Exchange {
    fn default() -> Self {
        Self::new()
    }
}

impl Exchange {
    pub fn new() -> Self {
        Self {
            pool: None,
            model: None,
            model_from_body: false,
            prompt_from_body: false,
            prompt: None,
            waiting_body: false,
            gate_body: false,
            body_cap: crate::config::DEFAULT_MAX_BODY_READ_BYTES as usize,
            declared_len: None,
            body_bytes: None,
            max_output_tokens: None,
            size: RequestSize::UNIT,
            held: false,
            steered: None,
            started_ms: 0,
            ttft_ms: None,
            status: None,
            upstream: None,
            response_complete: false,
            attempts: None,
            debug: false,
            probe_passed: false,
            answer: None,
            ended: false,
        }
    }

    /// The pool this request routes in (None: the filter leaves it alone).
    pub fn pool(&self) -> Option<usize> {
        self.pool
    }

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The ranked list handed to Envoy (empty: nothing was steered).
    pub fn ranked(&self) -> &str {
        self.steered.as_ref().map_or("", |s| s.ranked.as_str())
    }

    /// The pod this request was steered to.
    pub fn chosen(&self) -> Option<&str> {
        self.ranked().split(',').next().filter(|c| !c.is_empty())
    }

    /// What this request counts in flight.
    pub fn size(&self) -> RequestSize {
        self.size
    }

    /// Whether the request waits on its body.
    pub fn waiting_body(&self) -> bool {
        self.waiting_body
    }

    /// How many body bytes to hold back at most: once this many are buffered, the glue hands
    /// them to [`Exchange::on_request_body`] as an incomplete body and lets the rest stream
    /// (so Envoy never buffers past its limit and answers 413).
    pub fn body_read_limit(&self) -> usize {
        self.body_cap
    }

    /// Whether to hold back more of the body after `buffered` bytes (the glue buffers and
    /// waits) rather than read what is there now. `flow_controlled`: the proxy pauses the client
    /// at its buffer limit instead of failing (the native module buffers with
    /// StopIterationAndWatermark). Without it (proxy-wasm buffers with StopIterationAndBuffer,
    /// and one read can be as large as Envoy's 1 MiB limit), a body declared larger than the
    /// read limit is not held at all: its first read is what is read, since any bytes held
    /// plus one more read could pass the limit and get the request a 413.
    pub fn wants_more_body(&self, buffered: usize, flow_controlled: bool) -> bool {
        if buffered >= self.body_cap {
            return false;
        }
        flow_controlled || self.declared_len.is_none_or(|n| n <= self.body_cap)
    }

    /// Whether the end was handled (the in-flight count closed).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Request headers arrived (`end_of_stream`: there is no body).
    pub fn on_request_headers<H, W, G>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        gate: &mut G,
        end_of_stream: bool,
    ) -> Next
    where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        let now = host.now_ms();
        self.started_ms = now;
        let cfg = worker.router().config();
        let routing_header = cfg.routing_header.clone();
        let status_path = cfg.status_path.clone();
        let model_header = cfg.model_header.clone();
        let debug_header = cfg.debug_header.clone();
        let pools = cfg.pools.len();
        self.body_cap = cfg.max_body_read_bytes as usize;
        // Clients cannot steer, nor claim a priority class no trusted filter gave them: the
        // routing header, and the priority header unless `admission.trustedHeaders` lists it,
        // are dropped before anything reads them (issue 31).
        let untrusted = cfg
            .admission
            .as_ref()
            .filter(|a| a.enabled)
            .and_then(|a| a.untrusted_priority_header())
            .map(str::to_string);
        for h in std::iter::once(routing_header.as_str()).chain(untrusted.as_deref()) {
            if !host.set_request_header(h, None) {
                host.warn(&format!("ai-lb: cannot remove `{h}`"));
            }
        }
        if let Some(path) = status_path.as_deref() {
            let asked = host
                .request_header(":path")
                .is_some_and(|p| p.split('?').next() == Some(path));
            if asked {
                let body = status_page(worker, pools, now);
                host.send_local_reply(
                    200,
                    &[("content-type", "application/json")],
                    body.as_bytes(),
                );
                return Next::Stop;
            }
        }
        self.pool = {
            let cluster = host.cluster_name();
            match cluster.as_deref() {
                Some(c) => worker.router().config().pool_by_cluster(c),
                None if pools == 1 => Some(0),
                None => None,
            }
        };
        let Some(pool) = self.pool else {
            return Next::Continue;
        };
        self.debug = debug_header
            .as_deref()
            .is_some_and(|h| host.request_header(h).is_some());
        // It asks this filter for the debug header; the model server has no use for it.
        if let Some(h) = debug_header.as_deref().filter(|_| self.debug) {
            host.set_request_header(h, None);
        }
        if let Some(h) = model_header.as_deref() {
            self.model = host
                .request_header(h)
                .filter(|m| !m.is_empty())
                .map(Cow::into_owned);
            self.model_from_body = self.model.is_none() && !end_of_stream;
        }
        // Prefix affinity reads the prompt, when some pod of the pool reports its cache.
        if !end_of_stream {
            worker.refresh(pool, now);
            self.prompt_from_body = worker.router().prefix_space(pool).is_some();
        }
        match gate.begin(host, worker, end_of_stream, now) {
            GateStep::Replied | GateStep::Held => return Next::Stop,
            GateStep::NeedBody => self.gate_body = true,
            GateStep::Proceed => {}
        }
        if self.model_from_body || self.prompt_from_body || self.gate_body {
            self.waiting_body = true;
            self.declared_len = host
                .request_header("content-length")
                .and_then(|v| v.trim().parse().ok());
            return Next::StopForBody;
        }
        // The body is not read: its declared length still sizes the prompt.
        if !end_of_stream {
            self.body_bytes = host
                .request_header("content-length")
                .and_then(|v| v.trim().parse().ok());
        }
        self.gate_and_route(host, worker, gate, now)
    }

    /// The request body is here (only after [`Next::StopForBody`]): whole (`complete`), or its
    /// first [`Exchange::body_read_limit`] bytes of a larger body, whose rest then streams.
    pub fn on_request_body<H, W, G>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        gate: &mut G,
        body: &[u8],
        complete: bool,
    ) -> Next
    where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        if !self.waiting_body {
            return Next::Continue;
        }
        self.waiting_body = false;
        let now = host.now_ms();
        let fields = if complete {
            self.body_bytes = Some(body.len());
            crate::body::routing_fields(body)
        } else {
            worker.parts().router.counters_mut().body_truncated += 1;
            // The declared length sizes the prompt; without one, what was read is a floor.
            self.body_bytes = host
                .request_header("content-length")
                .and_then(|v| v.trim().parse().ok())
                .or(Some(body.len()));
            crate::body::routing_fields_prefix(body)
        };
        self.max_output_tokens = fields.max_output_tokens;
        if self.model_from_body {
            self.model = fields.model;
        }
        if let Some(pool) = self.pool.filter(|_| self.prompt_from_body && complete) {
            let p = worker.parts();
            self.prompt = p.router.key_prompt(pool, body, p.prompt_ids, p.key_scratch);
        }
        if std::mem::take(&mut self.gate_body) {
            match gate.body(host, worker, body, complete, now) {
                GateStep::Replied | GateStep::Held => return Next::Stop,
                GateStep::Proceed | GateStep::NeedBody => {}
            }
        }
        self.gate_and_route(host, worker, gate, now)
    }

    /// Sizes the request, lets the gate shed or hold it, and routes it.
    fn gate_and_route<H, W, G>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        gate: &mut G,
        now: u64,
    ) -> Next
    where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        let Some(pool) = self.pool else {
            return Next::Continue;
        };
        self.size = worker
            .parts()
            .router
            .request_size(self.body_bytes, self.max_output_tokens);
        match gate.before_route(host, worker, pool, self.model.as_deref(), self.size, now) {
            GateStep::Replied => return Next::Stop,
            GateStep::Held => {
                self.held = true;
                return Next::Stop;
            }
            GateStep::Proceed | GateStep::NeedBody => {}
        }
        self.steered = match steer_checked(
            host,
            worker,
            pool,
            self.model.as_deref(),
            now,
            self.size,
            self.prompt.as_ref(),
        ) {
            Ok(s) => s,
            Err(r) => {
                reject_reply(host, &r);
                return Next::Stop;
            }
        };
        if let Some(st) = &self.steered {
            gate.routed(worker, pool, st, now);
        }
        Next::Continue
    }

    /// Takes what a held request's release steered (once).
    fn take_resumed<W, G>(&mut self, worker: &mut W, gate: &mut G)
    where
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        if std::mem::take(&mut self.held) {
            if let Some(st) = gate.take_resumed(worker) {
                if let Some(pool) = self.pool {
                    gate.routed(worker, pool, &st, st.sent_ms);
                }
                self.steered = Some(st);
            }
        }
    }

    /// Response headers arrived.
    pub fn on_response_headers<H, W, G>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        gate: &mut G,
        end_of_stream: bool,
    ) where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        if self.pool.is_none() {
            return;
        }
        self.take_resumed(worker, gate);
        gate.on_response_headers(host, worker, end_of_stream);
        // The two reads of the response every routed request makes: with them a clean end
        // needs no log-phase read, and the retries are read off the ranked list
        // ([`feedback::finish`]).
        self.status = host.response_header(":status").and_then(|v| v.parse().ok());
        self.upstream = host.upstream_address().map(Cow::into_owned);
        self.response_complete = end_of_stream;
        if !host.retries_follow_ranked() {
            self.attempts = host
                .response_header("x-envoy-attempt-count")
                .and_then(|v| v.parse().ok());
        }
        if end_of_stream && self.ttft_ms.is_none() {
            self.ttft_ms = Some(host.now_ms().saturating_sub(self.started_ms));
        }
        let bcfg = &worker.router().config().breaker;
        let probe = self.steered.as_ref().is_some_and(|s| s.probe);
        if bcfg.truncation.is_some() || (probe && bcfg.well_formed_probes.is_some()) {
            self.answer = Some(Box::new(crate::triggers::AnswerScanner::new(self.status)));
        }
        if self.debug {
            if let Some(h) = worker.router().config().debug_header.clone() {
                let score = self.steered.as_ref().map_or(0.0, |s| s.score);
                let value = debug_header_value(self.chosen(), score, self.ranked());
                host.set_response_header(&h, &value);
            }
        }
    }

    /// A response chunk of `size` bytes arrived: the first is the time to first byte, and
    /// passes a probe whose answer started well (the rest of a long stream need not keep the
    /// pod half-open).
    pub fn on_response_body<H, W, G>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        gate: &mut G,
        size: usize,
        end_of_stream: bool,
    ) where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        if self.pool.is_none() {
            return;
        }
        if self.ttft_ms.is_none() {
            let now = host.now_ms();
            let ttft = now.saturating_sub(self.started_ms);
            self.ttft_ms = Some(ttft);
            if self.steered.as_ref().is_some_and(|s| s.probe) && !end_of_stream {
                feedback::pass_probe(self, host, worker, ttft, now);
            }
        }
        if end_of_stream {
            self.response_complete = true;
        }
        if let Some(a) = self.answer.as_mut() {
            if let Some(chunk) = host.response_chunk(size) {
                a.feed(&chunk);
            }
        }
        gate.on_response_body(host, worker, size, end_of_stream);
    }

    /// The request is over (Envoy's log phase / stream end): closes its in-flight count and
    /// feeds the outcome of every attempt to the breakers. Runs once; later calls do nothing.
    pub fn on_end<H, W, G>(&mut self, host: &mut H, worker: &mut W, gate: &mut G)
    where
        H: Host + ?Sized,
        W: Worker + ?Sized,
        G: Gate<W> + ?Sized,
    {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let now = host.now_ms();
        self.take_resumed(worker, gate);
        gate.on_end(host, worker, now);
        if self.pool.is_some() {
            feedback::finish(self, host, worker, now);
        }
    }
}

/// Carries the breaker trips the agents' snapshots caused in this worker's router (a hardware
/// fault, the pod's own error rate) into the shared breakers: counted and logged once for the
/// process, and while the agent keeps reporting the pod failing its cooldown restarts, so no
/// worker hands out probes. Call it after the worker may have installed a new pool state.
pub fn carry_signal_trips<H, W>(host: &mut H, worker: &mut W, now: u64)
where
    H: Host + ?Sized,
    W: Worker + ?Sized,
{
    let p = worker.parts();
    let trips = p.router.take_signal_trips();
    let cfg = p.router.config().breaker;
    for t in trips {
        let name = p
            .router
            .config()
            .pools
            .get(t.pool_idx)
            .map_or_else(String::new, |c| c.name.clone());
        let trip = &mut |b: &mut Breaker| b.trip(t.reason, now, &cfg);
        if let Some(ts) = p.breakers.update(p.router, t.pool_idx, &t.pod, now, trip) {
            feedback::record_transitions(host, p.stats, &name, &t.pod, &ts);
        }
    }
}

/// The status page: the scoreboard of every pool as this worker sees it, with the worker's
/// ordinal (each worker answers from its own view; the breakers are shared).
fn status_page<W: Worker + ?Sized>(worker: &mut W, pools: usize, now: u64) -> String {
    for i in 0..pools {
        worker.refresh(i, now);
    }
    let ordinal = worker.ordinal();
    let mut sb = scoreboard(worker.router(), now);
    if let Some(o) = sb.as_object_mut() {
        o.insert("worker".into(), ordinal.into());
    }
    sb.to_string()
}
