//! One HTTP request: translates the proxy-wasm callbacks into the core's request lifecycle
//! ([`Exchange`], the same one the native module drives), with this VM's [`State`] as the
//! worker and [`WasmGate`] as the admission gate (the token limiter, priority classes, the
//! held queue and the big-request hold, which the native module does not have yet).
//!
//! Each callback borrows the VM's state once; a borrow that fails (a re-entered callback) is
//! counted (`ailb.state_busy`), and an end that finds the state busy is finished at the next
//! callback or tick instead ([`finish_deferred`]), so no request's in-flight count leaks.
//! Request headers are only touched in the request phase (they are gone afterwards and the
//! SDK's helpers would trap); everything later comes from properties and response headers.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use ai_lb_filter_core::admission::config::TenantKeySource;
use ai_lb_filter_core::admission::cost::BodyPlan;
use ai_lb_filter_core::admission::priority::{self, PriorityDecision};
use ai_lb_filter_core::lifecycle::{Exchange, Gate, GateStep, Next, Steered};
use ai_lb_filter_core::picker::RequestSize;

use crate::admission::{self, AdmReq, Headers, HeldReq, Step};
use crate::hold::{self, Held};
use crate::host::{self, WasmHost};
use crate::state::{self, refresh_view_if_old, State};

/// A context that does nothing (filter not configured for routing).
pub struct PassThrough;

impl Context for PassThrough {}
impl HttpContext for PassThrough {}

thread_local! {
    /// Requests whose end found the state borrowed: finished at the next chance.
    static DEFERRED: RefCell<Vec<(Exchange, WasmGate)>> = const { RefCell::new(Vec::new()) };
}

/// Finishes the requests whose end found the state busy (called with the state borrowed).
pub fn finish_deferred(s: &mut State) {
    let pending = DEFERRED.with(|d| d.try_borrow_mut().map(|mut d| std::mem::take(&mut *d)));
    for (mut ex, mut gate) in pending.unwrap_or_default() {
        ex.on_end(&mut WasmHost, s, &mut gate);
    }
}

pub struct Request {
    state: Rc<RefCell<State>>,
    ex: Exchange,
    gate: WasmGate,
}

impl Request {
    pub fn new(state: Rc<RefCell<State>>, id: u32) -> Self {
        Self {
            state,
            ex: Exchange::new(),
            gate: WasmGate {
                id,
                adm: None,
                big_held: false,
            },
        }
    }

    /// Runs one lifecycle event with the VM's state; None (counted) when it is busy.
    fn event<R>(
        &mut self,
        f: impl FnOnce(&mut Exchange, &mut State, &mut WasmGate) -> R,
    ) -> Option<R> {
        let Ok(mut s) = state::lock(&self.state) else {
            return None;
        };
        finish_deferred(&mut s);
        Some(f(&mut self.ex, &mut s, &mut self.gate))
    }
}

impl Request {
    /// Hands the buffered body (at most `maxBodyReadBytes` of it) to the lifecycle.
    fn body_read(&mut self, size: usize, ended: bool) -> Action {
        let cap = self.ex.body_read_limit();
        let mut b = host::request_body(size.min(cap.saturating_add(1))).unwrap_or_default();
        let complete = ended && b.len() <= cap;
        b.truncate(cap);
        self.event(|ex, s, g| ex.on_request_body(&mut WasmHost, s, g, &b, complete))
            .map_or(Action::Continue, action)
    }
}

fn action(next: Next) -> Action {
    match next {
        Next::Continue => Action::Continue,
        Next::StopForBody | Next::Stop => Action::Pause,
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.event(|ex, s, g| ex.on_request_headers(&mut WasmHost, s, g, end_of_stream))
            .map_or(Action::Continue, action)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.ex.waiting_body() {
            return Action::Continue;
        }
        // Hold the body back only while the core says so (up to `maxBodyReadBytes`, and not
        // at all for a body declared larger, since Pause buffers without flow control): then
        // read what is there and let the rest stream (waiting for the end would make Envoy
        // answer 413 at its buffer limit).
        if !end_of_stream && self.ex.wants_more_body(body_size, false) {
            return Action::Pause;
        }
        let cap = self.ex.body_read_limit();
        self.body_read(body_size, end_of_stream && body_size <= cap)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !self.ex.waiting_body() {
            return Action::Continue;
        }
        // The body ended without end_of_stream: it is all buffered now.
        self.body_read(usize::MAX, true)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.ex.pool().is_some() {
            self.event(|ex, s, g| ex.on_response_headers(&mut WasmHost, s, g, end_of_stream));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.ex.pool().is_some() {
            self.event(|ex, s, g| {
                ex.on_response_body(&mut WasmHost, s, g, body_size, end_of_stream)
            });
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self
            .event(|ex, s, g| ex.on_end(&mut WasmHost, s, g))
            .is_none()
        {
            // The end must run: its in-flight count and the admission charge are settled at
            // the next callback or tick that gets the state.
            let ex = std::mem::take(&mut self.ex);
            let id = self.gate.id;
            let gate = std::mem::replace(
                &mut self.gate,
                WasmGate {
                    id,
                    adm: None,
                    big_held: false,
                },
            );
            DEFERRED.with(|d| {
                if let Ok(mut d) = d.try_borrow_mut() {
                    d.push((ex, gate));
                }
            });
        }
    }
}

/// Admission control and holds of one request (when the plugin config enables them).
pub struct WasmGate {
    /// The proxy-wasm context id (the held queues' handle).
    id: u32,
    adm: Option<AdmReq>,
    /// Queued in the worker's big-request hold.
    big_held: bool,
}

impl Gate<State> for WasmGate {
    /// Starts admission control (tenant, class, body plan). A request without a body, or
    /// one costed by its length, is admitted here; a JSON body is costed when it arrives.
    fn begin(&mut self, s: &mut State, end_of_stream: bool, now: u64) -> GateStep {
        let State {
            admission, metrics, ..
        } = s;
        let Some(rt) = admission.as_mut() else {
            return GateStep::Proceed;
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
            _ if end_of_stream => GateStep::Proceed,
            BodyPlan::ByLength(n) => step(adm.admit_length(n, now, metrics)),
            BodyPlan::Buffer => GateStep::NeedBody,
        };
        self.adm = Some(adm);
        step
    }

    /// Costs the whole body (an empty or unreadable one, e.g. after trailers, by its length;
    /// one larger than `maxBodyReadBytes` by its declared length, else what was read).
    fn body(&mut self, s: &mut State, body: &[u8], complete: bool, now: u64) -> GateStep {
        let Some(a) = self.adm.as_mut() else {
            return GateStep::Proceed;
        };
        if !complete {
            let length = host::request_header("content-length")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(body.len() as u64);
            step(a.admit_length(length, now, &mut s.metrics))
        } else if body.is_empty() {
            step(a.admit_length(0, now, &mut s.metrics))
        } else {
            step(a.admit_body(body, now, &mut s.metrics))
        }
    }

    /// Sheds, holds or lets through by class when the pool is saturated; then a big request
    /// no pod has room for waits in the worker's hold (`bigRequestHold`).
    fn before_route(
        &mut self,
        s: &mut State,
        pool: usize,
        model: Option<&str>,
        size: RequestSize,
        now: u64,
    ) -> GateStep {
        match self.priority_gate(s, pool, model, size, now) {
            GateStep::Proceed => {}
            other => return other,
        }
        if !s.router.should_hold(pool, model, size, now) {
            return GateStep::Proceed;
        }
        let held = Held {
            id: self.id,
            pool,
            model: model.map(str::to_string),
            size,
            since_ms: now,
        };
        let max = s.router.config().big_request_hold.map_or(0, |c| c.max_held);
        self.big_held = hold::hold(&mut s.big_hold, &mut s.metrics, held, max);
        if self.big_held {
            GateStep::Held
        } else {
            GateStep::Proceed
        }
    }

    /// What the root recorded when it released this request from a held queue (the ranked
    /// list it wrote), or that it answered it 503 (the charge is refunded).
    fn take_resumed(&mut self, s: &mut State) -> Option<Steered> {
        let big = if std::mem::take(&mut self.big_held) {
            hold::take(&mut s.big_hold, &mut s.metrics, self.id)
        } else {
            None
        };
        let Some(rt) = s.admission.as_mut() else {
            return big;
        };
        let resumed = rt.resumed.remove(&self.id);
        let expired = rt.expired.remove(&self.id);
        // A client that left while held.
        if rt.held.remove(self.id) {
            rt.held_reqs.remove(&self.id);
        }
        if expired {
            if let Some(a) = self.adm.as_mut() {
                a.refund_all = true;
            }
        }
        resumed.or(big)
    }

    fn on_response_headers(&mut self, s: &mut State, end_of_stream: bool) {
        if let Some(a) = self.adm.as_mut().filter(|a| !a.refund_all) {
            a.on_response_headers();
            if end_of_stream {
                a.on_response_end(&mut s.metrics);
            }
        }
    }

    /// Feeds the answer's usage scanner (the charge is reconciled with the actual tokens).
    fn on_response_body(&mut self, s: &mut State, size: usize, end_of_stream: bool) {
        let Some(a) = self.adm.as_mut().filter(|a| a.scanner.is_some()) else {
            return;
        };
        if size > 0 {
            if let Some(chunk) = host::response_body(size) {
                a.on_response_body(&chunk);
            }
        }
        if end_of_stream {
            a.on_response_end(&mut s.metrics);
        }
    }

    fn on_end(&mut self, s: &mut State, now: u64) {
        if let Some(mut a) = self.adm.take() {
            a.settle(now, &mut s.metrics);
        }
    }
}

fn step(s: Step) -> GateStep {
    match s {
        Step::Proceed => GateStep::Proceed,
        Step::Replied => GateStep::Replied,
    }
}

impl WasmGate {
    /// The class policy under saturation (admission on): proceed, shed (429), reject (503)
    /// or hold in the priority queue until the root releases it.
    fn priority_gate(
        &mut self,
        s: &mut State,
        pool: usize,
        model: Option<&str>,
        size: RequestSize,
        now: u64,
    ) -> GateStep {
        let Some(a) = self.adm.as_mut() else {
            return GateStep::Proceed;
        };
        // As for a pick: an idle VM's view may be older than refreshMs (it ticks slowly), and
        // judging saturation on it shed or let through by a pool state up to a tick old.
        refresh_view_if_old(s, pool, now);
        let State {
            router,
            admission,
            metrics,
            ..
        } = s;
        let Some(rt) = admission.as_mut() else {
            return GateStep::Proceed;
        };
        let sat = rt.cfg.saturation;
        let (saturated, _) = admission::saturation(router, pool, now, sat.soft_threshold);
        let reject = |a: &mut AdmReq, metrics: &mut crate::metrics::Metrics, what: &str| {
            a.count(metrics, what, 1);
            admission::count(metrics, what, 1);
            a.refund_all = true;
        };
        match priority::decide(&sat, a.class, saturated, rt.held.has_room(), now) {
            PriorityDecision::Proceed => {
                if saturated {
                    a.count(metrics, "saturated_proceed", 1);
                }
                GateStep::Proceed
            }
            PriorityDecision::Shed { retry_after_s } => {
                reject(a, metrics, "shed");
                admission::shed_reply(retry_after_s);
                GateStep::Replied
            }
            PriorityDecision::Reject { retry_after_s } => {
                reject(a, metrics, "held_rejected");
                admission::overloaded_reply(retry_after_s);
                GateStep::Replied
            }
            PriorityDecision::Hold { deadline_ms } => {
                if rt.held.push(self.id, a.class, now, deadline_ms).is_err() {
                    reject(a, metrics, "held_rejected");
                    admission::overloaded_reply(sat.retry_after_seconds);
                    return GateStep::Replied;
                }
                rt.held_reqs.insert(
                    self.id,
                    HeldReq {
                        pool,
                        model: model.map(str::to_string),
                        stat_tenant: a.stat_tenant.clone(),
                        size,
                    },
                );
                a.count(metrics, "held", 1);
                admission::count(metrics, "held", 1);
                metrics.set("ailb.admission.held_depth", rt.held.depth() as u64);
                GateStep::Held
            }
        }
    }
}
