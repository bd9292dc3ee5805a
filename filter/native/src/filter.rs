//! Per-request glue: the same steps as the wasm filter's routing path (drop a client-sent
//! routing header, find the pool by cluster, the model from a header or the body, pick, write
//! the ranked list for override_host, and feed the breakers from the outcome), against a
//! router owned by the Envoy worker thread (no locks on the request path).
//!
//! Not here (refused at config time or stated in filter/native/README.md): admission, big
//! request hold, the guard mode, breakers shared between workers, the debug response header.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ai_lb_filter_core::body::routing_fields;
use ai_lb_filter_core::outcome::{attribute, Observed};
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_filter_core::status::scoreboard_json;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::config::NativeConfig;
use crate::feed::{self, now_ms, Feed, Shared};
use crate::host::{ConfigHandle, Map, Stream};

/// Counter ids (0 = not defined; never counted).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    steered: usize,
    fallback: usize,
    fail_open: usize,
    stream_errors: usize,
}

/// One filter config: what Envoy's config object points to. Lives until every stream of it
/// is gone (Envoy holds it for them).
#[derive(Debug)]
pub struct ConfigRt {
    pub id: u64,
    pub cfg: NativeConfig,
    pub shared: Arc<Shared>,
    pub counters: Counters,
    /// Workers keep a weak handle: a worker of a config that is gone is dropped when its
    /// thread next makes one (configs come and go with Envoy config updates).
    alive: Arc<()>,
    _feed: Feed,
}

impl ConfigRt {
    pub fn new(handle: &ConfigHandle, bytes: &[u8]) -> Result<ConfigRt, String> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let cfg = crate::config::parse(bytes)?;
        let shared = Arc::new(Shared {
            pools: cfg
                .filter
                .pools
                .iter()
                .map(|_| Default::default())
                .collect(),
            ..Default::default()
        });
        let counters = Counters {
            steered: handle.define_counter("ailb.native.steered"),
            fallback: handle.define_counter("ailb.native.fallback"),
            fail_open: handle.define_counter("ailb.native.fail_open"),
            stream_errors: handle.define_counter("ailb.native.stream_errors"),
        };
        let feed = feed::start(&cfg.filter, &cfg.agents, Arc::clone(&shared))?;
        Ok(ConfigRt {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            cfg,
            shared,
            counters,
            alive: Arc::new(()),
            _feed: feed,
        })
    }
}

/// A worker thread's routing state for one config.
struct Worker {
    config_id: u64,
    alive: std::sync::Weak<()>,
    router: Router,
    rng: SmallRng,
    /// Per pool: the published version installed here.
    seen: Vec<u64>,
    scratch: String,
    next_tick_ms: u64,
}

thread_local! {
    static WORKERS: RefCell<Vec<Worker>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's worker for `rt` (created at the thread's first request).
fn with_worker<R>(rt: &ConfigRt, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
    WORKERS.with(|w| {
        let mut ws = w.try_borrow_mut().ok()?;
        let i = match ws.iter().position(|w| w.config_id == rt.id) {
            Some(i) => i,
            None => {
                ws.retain(|w| w.alive.strong_count() > 0);
                let seed = now_ms() ^ (ws.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                ws.push(Worker {
                    config_id: rt.id,
                    alive: Arc::downgrade(&rt.alive),
                    router: Router::new(rt.cfg.filter.clone()),
                    rng: SmallRng::seed_from_u64(seed),
                    seen: vec![0; rt.cfg.filter.pools.len()],
                    scratch: String::with_capacity(256),
                    next_tick_ms: 0,
                });
                ws.len() - 1
            }
        };
        ws.get_mut(i).map(f)
    })
}

impl Worker {
    /// Installs pool `i`'s published state when its version moved; polls breakers and
    /// staleness every 100 ms of requests.
    fn refresh(&mut self, rt: &ConfigRt, i: usize, now: u64) {
        if let (Some(slot), Some(seen)) = (rt.shared.pools.get(i), self.seen.get_mut(i)) {
            if slot.version.load(Ordering::Acquire) != *seen {
                let (v, bytes) = slot.read();
                *seen = v;
                if self.router.set_pool_state_bytes(i, &bytes, now).is_err() {
                    rt.shared.decode_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if now >= self.next_tick_ms {
            self.next_tick_ms = now + 100;
            self.router.tick(now);
        }
    }
}

/// One request.
#[derive(Debug)]
pub struct Request {
    rt: *const ConfigRt,
    pool: Option<usize>,
    model: Option<String>,
    model_from_body: bool,
    waiting_body: bool,
    body_bytes: Option<usize>,
    max_output_tokens: Option<u64>,
    size: RequestSize,
    ranked: String,
    sent_ms: u64,
    started_ms: u64,
    ttft_ms: Option<u64>,
    attempts: Option<u32>,
}

/// What a headers hook tells Envoy.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Continue,
    /// Wait for the body (buffered by Envoy).
    StopAndBuffer,
    /// A local reply was sent.
    Replied,
}

impl Request {
    pub fn new(rt: *const ConfigRt) -> Self {
        Request {
            rt,
            pool: None,
            model: None,
            model_from_body: false,
            waiting_body: false,
            body_bytes: None,
            max_output_tokens: None,
            size: RequestSize::UNIT,
            ranked: String::new(),
            sent_ms: 0,
            started_ms: 0,
            ttft_ms: None,
            attempts: None,
        }
    }

    /// The config this request belongs to. Envoy keeps a filter's config alive for as long as
    /// any of its streams exists, so the reference does not borrow the request.
    fn rt<'a>(&self) -> Option<&'a ConfigRt> {
        #[allow(unsafe_code)]
        // SAFETY: set from the config pointer Envoy passed to `on_http_filter_new`; Envoy keeps
        // that config until its streams are destroyed.
        unsafe {
            self.rt.as_ref()
        }
    }

    pub fn on_request_headers(&mut self, s: &Stream, end_of_stream: bool) -> Next {
        let Some(rt) = self.rt() else {
            return Next::Continue;
        };
        let now = now_ms();
        self.started_ms = now;
        let c = &rt.cfg.filter;
        // Clients cannot steer: whatever they sent in the routing header is dropped first.
        s.set_header(Map::Request, &c.routing_header, None);
        if let Some(path) = c.status_path.as_deref() {
            let req_path = s.header_str(Map::Request, ":path").unwrap_or("");
            if req_path.split('?').next() == Some(path) {
                let body = with_worker(rt, |w| {
                    for i in 0..c.pools.len() {
                        w.refresh(rt, i, now);
                    }
                    scoreboard_json(&w.router, now)
                })
                .unwrap_or_else(|| "{}".into());
                s.send_response(
                    200,
                    &[("content-type", "application/json")],
                    body.as_bytes(),
                );
                return Next::Replied;
            }
        }
        self.pool = match s.cluster_name() {
            Some(cl) => c.pool_by_cluster(cl),
            None if c.pools.len() == 1 => Some(0),
            None => None,
        };
        if self.pool.is_none() {
            return Next::Continue;
        }
        if let Some(h) = c.model_header.as_deref() {
            self.model = s
                .header_str(Map::Request, h)
                .filter(|m| !m.is_empty())
                .map(str::to_string);
            self.model_from_body = self.model.is_none() && !end_of_stream;
        }
        if self.model_from_body {
            self.waiting_body = true;
            return Next::StopAndBuffer;
        }
        if !end_of_stream {
            self.body_bytes = s
                .header_str(Map::Request, "content-length")
                .and_then(|v| v.trim().parse().ok());
        }
        self.route(rt, s, now);
        Next::Continue
    }

    /// A request-body chunk; true when the filter still waits for more (Envoy buffers).
    pub fn on_request_body(&mut self, s: &Stream, end_of_stream: bool) -> bool {
        if !self.waiting_body {
            return false;
        }
        if !end_of_stream {
            return true;
        }
        self.body_done(s, true);
        false
    }

    /// Trailers: the body ended without end_of_stream.
    pub fn on_request_trailers(&mut self, s: &Stream) {
        if self.waiting_body {
            self.body_done(s, false);
        }
    }

    /// The whole body is here (`in_hook`: the last chunk is the current body hook's).
    fn body_done(&mut self, s: &Stream, in_hook: bool) {
        self.waiting_body = false;
        let Some(rt) = self.rt() else { return };
        let body = s.request_body(in_hook);
        self.body_bytes = Some(body.len());
        let f = routing_fields(&body);
        self.max_output_tokens = f.max_output_tokens;
        if self.model_from_body {
            self.model = f.model;
        }
        self.route(rt, s, now_ms());
    }

    fn route(&mut self, rt: &ConfigRt, s: &Stream, now: u64) {
        let Some(pool) = self.pool else { return };
        let (body_bytes, max_out) = (self.body_bytes, self.max_output_tokens);
        let model = self.model.as_deref();
        let picked = with_worker(rt, |w| {
            w.refresh(rt, pool, now);
            let size = w.router.request_size(body_bytes, max_out);
            let (ranked, open) = match w.router.decide_for(pool, model, size, now, &mut w.rng) {
                Decision::Steer { ranked, .. } => (ranked, false),
                Decision::FailOpen { ranked } => (ranked, true),
                Decision::Fallback(_) => return None,
            };
            if !w.router.write_ranked(pool, &ranked, &mut w.scratch) {
                return None;
            }
            let Worker {
                router, scratch, ..
            } = w;
            router.on_request_start(pool, scratch.split(',').next()?, size, now);
            Some((scratch.clone(), size, open))
        })
        .flatten();
        let Some((ranked, size, open)) = picked else {
            s.inc(rt.counters.fallback, 1);
            return;
        };
        if !s.set_header(Map::Request, &rt.cfg.filter.routing_header, Some(&ranked)) {
            // Nothing was steered: take the pick back.
            with_worker(rt, |w| {
                if let Some(c) = ranked.split(',').next() {
                    w.router.on_request_end(pool, c, size, now);
                }
            });
            s.inc(rt.counters.fallback, 1);
            return;
        }
        s.inc(
            if open {
                rt.counters.fail_open
            } else {
                rt.counters.steered
            },
            1,
        );
        self.ranked = ranked;
        self.size = size;
        self.sent_ms = now;
    }

    pub fn on_response_headers(&mut self, s: &Stream, end_of_stream: bool) {
        if self.pool.is_none() {
            return;
        }
        self.attempts = s
            .header_str(Map::Response, "x-envoy-attempt-count")
            .and_then(|v| v.parse().ok());
        if end_of_stream && self.ttft_ms.is_none() {
            self.ttft_ms = Some(now_ms().saturating_sub(self.started_ms));
        }
    }

    pub fn on_response_body(&mut self) {
        if self.ttft_ms.is_none() && self.pool.is_some() {
            self.ttft_ms = Some(now_ms().saturating_sub(self.started_ms));
        }
    }

    /// The request is over: close the pick and tell the breakers how it went.
    pub fn on_stream_complete(&mut self, s: &Stream) {
        let Some(rt) = self.rt() else { return };
        // The feed's stream errors since they were last counted (by any worker). Two plain
        // loads on the common path; the shared write only when there is something to count.
        let errors = rt.shared.stream_errors.load(Ordering::Relaxed);
        let counted = &rt.shared.stream_errors_counted;
        if errors > counted.load(Ordering::Relaxed) {
            let before = counted.fetch_max(errors, Ordering::Relaxed);
            s.inc(rt.counters.stream_errors, errors.saturating_sub(before));
        }
        let Some(pool) = self.pool else { return };
        let now = now_ms();
        let status = s.response_code();
        let clean = status.is_some_and(|c| c < 500);
        let details = if clean {
            ""
        } else {
            s.response_code_details().unwrap_or("")
        };
        let observed = Observed {
            ranked: &self.ranked,
            upstream: s.upstream_address(),
            status,
            flags: 0,
            details,
            attempts: self.attempts,
            ttft_ms: self.ttft_ms,
            total_ms: Some(now.saturating_sub(self.started_ms)),
        };
        let pairs = attribute(&observed);
        let chosen = self.ranked.split(',').next().filter(|c| !c.is_empty());
        let model = self.model.as_deref();
        let size = self.size;
        let sent = self.sent_ms;
        with_worker(rt, |w| {
            if let Some(c) = chosen {
                w.router.on_request_end(pool, c, size, sent);
            }
            for (pod, o) in &pairs {
                w.router.on_outcome(pool, pod, model, o, now);
            }
        });
    }
}
