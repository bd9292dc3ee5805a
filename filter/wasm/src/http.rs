//! One HTTP request: translates the proxy-wasm callbacks into the core's request lifecycle
//! ([`Exchange`], the same one the native module drives), with this VM's [`State`] as the
//! worker and [`FilterGate`] as the admission gate (the token limiter, priority classes, the
//! held queue, from the core) and the big-request hold.
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

use ai_lb_filter_core::lifecycle::hold::FilterGate;
use ai_lb_filter_core::lifecycle::{Exchange, Next};

use crate::host::{self, WasmHost};
use crate::state::{self, State};

/// A context that does nothing (filter not configured for routing).
pub struct PassThrough;

impl Context for PassThrough {}
impl HttpContext for PassThrough {}

thread_local! {
    /// Requests whose end found the state borrowed: finished at the next chance.
    static DEFERRED: RefCell<Vec<(Exchange, FilterGate)>> = const { RefCell::new(Vec::new()) };
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
    gate: FilterGate,
}

impl Request {
    pub fn new(state: Rc<RefCell<State>>, id: u32) -> Self {
        Self {
            state,
            ex: Exchange::new(),
            gate: FilterGate::new(id),
        }
    }

    /// Runs one lifecycle event with the VM's state; None (counted) when it is busy.
    fn event<R>(
        &mut self,
        f: impl FnOnce(&mut Exchange, &mut State, &mut FilterGate) -> R,
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
            let id = self.gate.id();
            let gate = std::mem::replace(&mut self.gate, FilterGate::new(id));
            DEFERRED.with(|d| {
                if let Ok(mut d) = d.try_borrow_mut() {
                    d.push((ex, gate));
                }
            });
        }
    }
}
