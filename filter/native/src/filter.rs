//! Per-request glue: the same steps as the wasm filter's routing path (drop a client-sent
//! routing header, find the pool by cluster, the model from a header or the body, pick, write
//! the ranked list for override_host, answer the debug header, and feed the breakers from the
//! outcome, a half-open probe at its first byte), against a router owned by the Envoy worker
//! thread (no locks on the pick) and breakers shared by every worker ([`crate::breakers`]).
//!
//! Not here (refused at config time or stated in filter/native/README.md): admission, big
//! request hold, the guard mode, the per-pod in-flight gauge.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ai_lb_filter_core::body::routing_fields;
use ai_lb_filter_core::breaker::{BreakerState, Outcome, TripReason};
use ai_lb_filter_core::outcome::{attribute, Observed};
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_filter_core::prefix::PromptKeys;
use ai_lb_filter_core::status::scoreboard;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::breakers::SharedBreakers;
use crate::config::NativeConfig;
use crate::feed::{self, now_ms, Feed, Shared};
use crate::host::{self, ConfigHandle, LabeledCounter, LabeledGauge, Level, Map, Stream};

/// Counter ids (0 = not defined; never counted).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    steered: usize,
    fallback: usize,
    fail_open: usize,
    stream_errors: usize,
    /// Per [`TripReason`], in [`TripReason::ALL`] order: one counter per reason
    /// (`ailb.native.breaker_opened.<reason>`, as the wasm filter's `ailb.breaker_opened.<reason>`).
    breaker_opened: [usize; TripReason::ALL.len()],
    breaker_half_opened: usize,
    breaker_closed: usize,
    /// Per pod (label `endpoint`, `ip:port`): requests steered there, and the failures
    /// attributed to it (as the wasm filter's `ailb.endpoint.<ip:port>.picks` / `.failures`),
    /// added once a second per worker ([`flush_counts`]).
    picks: LabeledCounter,
    failures: LabeledCounter,
    /// Per pod (label `endpoint`), set once a second by one worker ([`export_gauges`]): its
    /// score x1000, breaker (0 closed, 1 half-open, 2 open) and metrics age (ms).
    score: LabeledGauge,
    breaker_state: LabeledGauge,
    gpu_signal: LabeledGauge,
    metrics_age_ms: LabeledGauge,
}

impl Counters {
    /// Counts breaker transitions (each once for the process: only the worker that wrote the
    /// shared breaker sees them) and logs each open.
    fn transitions(&self, s: &Stream, pod: &str, ts: &[ai_lb_filter_core::breaker::Transition]) {
        for t in ts {
            let id = match t.to {
                BreakerState::Open => {
                    let reason = t.reason.map_or("unknown", |r| r.as_str());
                    host::log(
                        Level::Warn,
                        &format!("ai-lb native: breaker of {pod} opened ({reason})"),
                    );
                    TripReason::ALL
                        .iter()
                        .position(|r| Some(*r) == t.reason)
                        .and_then(|i| self.breaker_opened.get(i).copied())
                        .unwrap_or(0)
                }
                BreakerState::HalfOpen => self.breaker_half_opened,
                BreakerState::Closed => self.breaker_closed,
            };
            s.inc(id, 1);
        }
    }
}

/// One filter config: what Envoy's config object points to. Lives until every stream of it
/// is gone (Envoy holds it for them).
#[derive(Debug)]
pub struct ConfigRt {
    pub id: u64,
    pub cfg: NativeConfig,
    pub shared: Arc<Shared>,
    /// Circuit breakers shared by every worker.
    pub breakers: SharedBreakers,
    pub counters: Counters,
    /// When the per-pod gauges are next due (ms; [`export_gauges`]).
    gauges_due_ms: AtomicU64,
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
            breaker_opened: TripReason::ALL.map(|r| {
                handle.define_counter(&format!("ailb.native.breaker_opened.{}", r.as_str()))
            }),
            breaker_half_opened: handle.define_counter("ailb.native.breaker_half_opened"),
            breaker_closed: handle.define_counter("ailb.native.breaker_closed"),
            picks: handle.define_labeled_counter("ailb.native.picks", "endpoint"),
            failures: handle.define_labeled_counter("ailb.native.failures", "endpoint"),
            score: handle.define_labeled_gauge("ailb.native.score", "endpoint"),
            breaker_state: handle.define_labeled_gauge("ailb.native.breaker_state", "endpoint"),
            gpu_signal: handle.define_labeled_gauge("ailb.native.gpu_signal", "endpoint"),
            metrics_age_ms: handle.define_labeled_gauge("ailb.native.metrics_age_ms", "endpoint"),
        };
        let feed = feed::start(&cfg.filter, &cfg.agents, Arc::clone(&shared))?;
        Ok(ConfigRt {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            breakers: SharedBreakers::new(cfg.filter.pools.len()),
            cfg,
            shared,
            counters,
            gauges_due_ms: AtomicU64::new(0),
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
    /// Per pool: the shared breakers' epoch copied here (0: copy at the next refresh).
    breakers_seen: Vec<u64>,
    /// Cooldown jitter of the shared breakers this worker creates (see
    /// `Breaker::with_jitter`): random, so sidecars that open a pod's breaker on the same
    /// agent snapshot probe it at different moments.
    jitter: u8,
    scratch: String,
    /// Reused buffers for keying prompts (`prefixAffinity`).
    prompt_ids: Vec<u32>,
    key_scratch: Vec<u64>,
    next_tick_ms: u64,
    /// This worker's number in the process (the status page says which worker answered).
    ordinal: u64,
    /// Per pod: picks and failures not yet added to Envoy's labelled counters. A labelled
    /// increment has Envoy encode the label into its symbol table (a lock and an allocation),
    /// so the request path only counts here and [`flush_counts`] adds them once a second.
    pending: HashMap<String, [u64; 2]>,
    /// When this worker next adds `pending` to Envoy's counters (ms).
    flush_due_ms: u64,
}

impl Worker {
    /// Counts `n` on `pod`'s pending picks (`which` 0) or failures (1).
    fn count(&mut self, pod: &str, which: usize, n: u64) {
        if let Some(c) = self.pending.get_mut(pod) {
            c[which] += n;
        } else {
            let mut c = [0; 2];
            c[which] = n;
            self.pending.insert(pod.to_string(), c);
        }
    }
}

/// Numbers the workers of the process, in order of their first request.
static ORDINALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
                let jitter = (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8;
                ws.push(Worker {
                    config_id: rt.id,
                    alive: Arc::downgrade(&rt.alive),
                    router: Router::new(rt.cfg.filter.clone()),
                    rng: SmallRng::seed_from_u64(seed),
                    seen: vec![0; rt.cfg.filter.pools.len()],
                    breakers_seen: vec![0; rt.cfg.filter.pools.len()],
                    jitter,
                    scratch: String::with_capacity(256),
                    prompt_ids: Vec::new(),
                    key_scratch: Vec::new(),
                    next_tick_ms: 0,
                    ordinal: ORDINALS.fetch_add(1, Ordering::Relaxed),
                    pending: HashMap::new(),
                    flush_due_ms: 0,
                });
                ws.len() - 1
            }
        };
        ws.get_mut(i).map(f)
    })
}

impl Worker {
    /// Installs pool `i`'s published state when its version moved, then the other workers'
    /// breaker changes; polls breakers and staleness every 100 ms of requests.
    fn refresh(&mut self, rt: &ConfigRt, i: usize, now: u64) {
        let Some(bseen) = self.breakers_seen.get_mut(i) else {
            return;
        };
        if let (Some(slot), Some(seen)) = (rt.shared.pools.get(i), self.seen.get_mut(i)) {
            if slot.version.load(Ordering::Acquire) != *seen {
                let (v, bytes) = slot.read();
                *seen = v;
                if self.router.set_pool_state_bytes(i, &bytes, now).is_err() {
                    rt.shared.decode_errors.fetch_add(1, Ordering::Relaxed);
                }
                // Pods new to this worker get their shared breakers too.
                *bseen = 0;
            }
        }
        rt.breakers.sync(&mut self.router, i, bseen);
        if now >= self.next_tick_ms {
            self.next_tick_ms = now + 100;
            self.router.tick(now);
        }
    }
}

/// Sets the per-pod gauges from this worker's router, at most once a second for the whole
/// process: the first request routed after the second is up does it, on whichever worker
/// (scores and metrics ages are alike on every worker, breakers are shared). Pods that left
/// keep their last values (Envoy keeps the stats), as with the wasm filter.
fn export_gauges(rt: &ConfigRt, s: &Stream, now: u64) {
    let due = rt.gauges_due_ms.load(Ordering::Relaxed);
    if now < due
        || rt
            .gauges_due_ms
            .compare_exchange(due, now + 1000, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    let rows = with_worker(rt, |w| {
        (0..w.router.pool_count())
            .flat_map(|i| w.router.pod_status(i, now))
            .map(|r| {
                (
                    r.address.to_string(),
                    r.score_gauge_value(),
                    r.breaker.gauge_value(),
                    r.metrics_age_ms,
                    r.gpu_signal_gauge_value(),
                )
            })
            .collect::<Vec<_>>()
    })
    .unwrap_or_default();
    let c = &rt.counters;
    for (pod, score, breaker, age, gpu_signal) in &rows {
        s.set_labeled(c.score, pod, *score);
        s.set_labeled(c.breaker_state, pod, *breaker);
        s.set_labeled(c.gpu_signal, pod, *gpu_signal);
        if let Some(age) = age {
            s.set_labeled(c.metrics_age_ms, pod, *age);
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
    /// The body's prompt is keyed for prefix affinity (`prefixAffinity`).
    prompt_from_body: bool,
    prompt: Option<PromptKeys>,
    waiting_body: bool,
    body_bytes: Option<usize>,
    max_output_tokens: Option<u64>,
    size: RequestSize,
    ranked: String,
    sent_ms: u64,
    started_ms: u64,
    ttft_ms: Option<u64>,
    attempts: Option<u32>,
    /// The client asked for the debug response header.
    debug: bool,
    chosen_score: f64,
    /// Sent to a half-open pod as one of its probes.
    probe: bool,
    /// The probe's response status (probes only).
    probe_status: Option<u16>,
    /// The probe's success was recorded at its first byte (not again at its end).
    probe_passed: bool,
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
            prompt_from_body: false,
            prompt: None,
            waiting_body: false,
            body_bytes: None,
            max_output_tokens: None,
            size: RequestSize::UNIT,
            ranked: String::new(),
            sent_ms: 0,
            started_ms: 0,
            ttft_ms: None,
            attempts: None,
            debug: false,
            chosen_score: 0.0,
            probe: false,
            probe_status: None,
            probe_passed: false,
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
                    // Which worker answered: the breakers are shared, the rest is per worker.
                    let mut sb = scoreboard(&w.router, now);
                    if let Some(o) = sb.as_object_mut() {
                        o.insert("worker".into(), w.ordinal.into());
                    }
                    sb.to_string()
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
        self.debug = c
            .debug_header
            .as_deref()
            .is_some_and(|h| s.header(Map::Request, h).is_some());
        if let Some(h) = c.model_header.as_deref() {
            self.model = s
                .header_str(Map::Request, h)
                .filter(|m| !m.is_empty())
                .map(str::to_string);
            self.model_from_body = self.model.is_none() && !end_of_stream;
        }
        // Prefix affinity reads the prompt, when some pod of the pool reports its cache.
        if let Some(pool) = self.pool.filter(|_| !end_of_stream) {
            self.prompt_from_body = with_worker(rt, |w| {
                w.refresh(rt, pool, now);
                w.router.prefix_space(pool).is_some()
            })
            .unwrap_or(false);
        }
        if self.model_from_body || self.prompt_from_body {
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
        if let Some(pool) = self.pool.filter(|_| self.prompt_from_body) {
            self.prompt = with_worker(rt, |w| {
                let Worker {
                    router,
                    prompt_ids,
                    key_scratch,
                    ..
                } = w;
                router.key_prompt(pool, &body, prompt_ids, key_scratch)
            })
            .flatten();
        }
        self.route(rt, s, now_ms());
    }

    fn route(&mut self, rt: &ConfigRt, s: &Stream, now: u64) {
        let Some(pool) = self.pool else { return };
        let (body_bytes, max_out) = (self.body_bytes, self.max_output_tokens);
        let model = self.model.as_deref();
        let prompt = self.prompt.as_ref();
        let picked = with_worker(rt, |w| {
            w.refresh(rt, pool, now);
            let size = w.router.request_size(body_bytes, max_out);
            let (ranked, open, score) = match w
                .router
                .decide_with(pool, model, size, prompt, now, &mut w.rng)
            {
                Decision::Steer {
                    ranked,
                    chosen_score,
                } => (ranked, false, chosen_score),
                Decision::FailOpen { ranked } => (ranked, true, 0.0),
                Decision::Fallback(_) => return None,
            };
            if !w.router.write_ranked(pool, &ranked, &mut w.scratch) {
                return None;
            }
            let Worker {
                router,
                scratch,
                jitter,
                ..
            } = w;
            let chosen = scratch.split(',').next()?;
            router.on_request_start(pool, chosen, size, now);
            // A half-open pod's probe budget is spent once for every worker.
            let probe = router
                .breaker(pool, chosen, None)
                .is_some_and(|b| b.state() == BreakerState::HalfOpen);
            let mut transitions = Vec::new();
            if probe {
                if let Some(wr) = rt.breakers.update(router, pool, chosen, now, *jitter, |b| {
                    b.on_request(now);
                    None
                }) {
                    transitions = wr.transitions;
                }
            }
            Some((scratch.clone(), size, open, score, probe, transitions))
        })
        .flatten();
        // After the pick, so this worker's router holds the pool state it just installed.
        export_gauges(rt, s, now);
        let Some((ranked, size, open, score, probe, transitions)) = picked else {
            s.inc(rt.counters.fallback, 1);
            return;
        };
        if let Some(c) = ranked.split(',').next() {
            rt.counters.transitions(s, c, &transitions);
        }
        let steering = rt.cfg.steering;
        let chosen = ranked.split(',').next().unwrap_or("");
        let steered = if steering.header() {
            let ok = s.set_header(Map::Request, &rt.cfg.filter.routing_header, Some(&ranked));
            // With both, the header steers whatever the override call says.
            if ok && steering.override_host() {
                s.set_upstream_override_host(chosen);
            }
            ok
        } else {
            s.set_upstream_override_host(chosen)
        };
        if !steered {
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
        flush_counts(rt, s, now, Some(chosen));
        self.ranked = ranked;
        self.size = size;
        self.sent_ms = now;
        self.chosen_score = score;
        self.probe = probe;
    }

    /// The pod this request was steered to.
    fn chosen(&self) -> Option<&str> {
        self.ranked.split(',').next().filter(|c| !c.is_empty())
    }

    pub fn on_response_headers(&mut self, s: &Stream, end_of_stream: bool) {
        if self.pool.is_none() {
            return;
        }
        self.attempts = s
            .header_str(Map::Response, "x-envoy-attempt-count")
            .and_then(|v| v.parse().ok());
        if self.probe {
            self.probe_status = s
                .header_str(Map::Response, ":status")
                .and_then(|v| v.parse().ok());
        }
        if end_of_stream && self.ttft_ms.is_none() {
            self.ttft_ms = Some(now_ms().saturating_sub(self.started_ms));
        }
        if self.debug {
            let header = self
                .rt()
                .and_then(|rt| rt.cfg.filter.debug_header.as_deref());
            if let Some(h) = header {
                let value = ai_lb_filter_core::status::debug_header_value(
                    self.chosen(),
                    self.chosen_score,
                    &self.ranked,
                );
                s.set_header(Map::Response, h, Some(&value));
            }
        }
    }

    /// A response-body chunk: the first one is the time to first byte, and passes a probe
    /// whose answer started well (the rest of a long stream need not keep the pod half-open).
    pub fn on_response_body(&mut self, s: &Stream, end_of_stream: bool) {
        if self.ttft_ms.is_none() && self.pool.is_some() {
            let now = now_ms();
            let ttft = now.saturating_sub(self.started_ms);
            self.ttft_ms = Some(ttft);
            if self.probe && !end_of_stream {
                self.pass_probe(s, ttft, now);
            }
        }
    }

    /// Records a probe's success at its first byte when it already counts as one
    /// ([`Outcome::probe_passed_at_first_byte`]) and came from the probed pod (not a retry
    /// elsewhere); its end then records only a failure.
    fn pass_probe(&mut self, s: &Stream, ttft_ms: u64, now: u64) {
        let (Some(rt), Some(pool)) = (self.rt(), self.pool) else {
            return;
        };
        let cfg = rt.cfg.filter.breaker;
        if !Outcome::probe_passed_at_first_byte(self.probe_status, ttft_ms, &cfg) {
            return;
        }
        if s.upstream_address().is_none() || s.upstream_address() != self.chosen() {
            return;
        }
        self.probe_passed = true;
        let Some(chosen) = self.chosen() else { return };
        let transitions = with_worker(rt, |w| {
            rt.breakers
                .update(&mut w.router, pool, chosen, now, w.jitter, |b| {
                    b.record(None, now, &cfg)
                })
                .map(|wr| wr.transitions)
        })
        .flatten()
        .unwrap_or_default();
        rt.counters.transitions(s, chosen, &transitions);
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
        let chosen = self.chosen();
        let model = self.model.as_deref();
        let (size, sent, probe_passed) = (self.size, self.sent_ms, self.probe_passed);
        let cfg = rt.cfg.filter.breaker;
        let mut transitions = Vec::new();
        with_worker(rt, |w| {
            for (pod, o) in &pairs {
                if o.failure(&cfg).is_some() {
                    w.count(pod, 1, 1);
                }
            }
            // Whether the chosen pod's breaker had nothing to forget (Closed, no failure
            // counted, as of this worker's last copy): a success then leaves the shared
            // breaker as it is, so it is not locked and rewritten.
            let clean_before = chosen.is_some_and(|c| {
                w.router.breaker(pool, c, None).is_some_and(|b| {
                    b.state() == BreakerState::Closed && b.consecutive_failures() == 0
                })
            });
            // The chosen pod was counted in flight: close that however the request ended,
            // then let this worker's breaker record (the shared breaker below is
            // authoritative). A cancelled request teaches the breaker nothing.
            let mut rate_tripped = false;
            if let Some(c) = chosen {
                w.router.on_request_end(pool, c, size, sent);
                if let Some((_, o)) = pairs.iter().find(|(p, _)| *p == c) {
                    // This worker's failure-rate window can open the pod's breaker; the trip
                    // is carried to the shared breaker.
                    rate_tripped = w.router.on_outcome(pool, c, model, o, now).iter().any(|e| {
                        e.to == BreakerState::Open && e.reason == Some(TripReason::FailureRate)
                    });
                }
            }
            for (pod, o) in &pairs {
                let failure = o.failure(&cfg);
                let is_chosen = chosen == Some(*pod);
                if failure.is_none() && is_chosen && !rate_tripped && clean_before {
                    continue;
                }
                let trip_rate = rate_tripped && is_chosen;
                // A probe whose success was recorded at its first byte is not recorded again;
                // the shared breaker is still read back, over what this worker counted above.
                let on_record = is_chosen && probe_passed && failure.is_none() && !trip_rate;
                let written = rt
                    .breakers
                    .update(&mut w.router, pool, pod, now, w.jitter, |b| {
                        if on_record {
                            return None;
                        }
                        let t = b.record(failure, now, &cfg);
                        if t.is_none() && trip_rate && b.state() == BreakerState::Closed {
                            b.trip(TripReason::FailureRate, now, &cfg)
                        } else {
                            t
                        }
                    });
                if let Some(wr) = written {
                    transitions.push((pod.to_string(), wr.transitions));
                }
            }
        });
        for (pod, ts) in &transitions {
            rt.counters.transitions(s, pod, ts);
        }
        flush_counts(rt, s, now, None);
    }
}

/// Counts a pick of `picked` (if any) on this worker, then adds the worker's pending
/// per-pod picks and failures to Envoy's labelled counters, at most once a second (called as
/// requests are routed and end, so the counters lag by up to a second of this worker's
/// traffic).
fn flush_counts(rt: &ConfigRt, s: &Stream, now: u64, picked: Option<&str>) {
    let due = with_worker(rt, |w| {
        if let Some(pod) = picked {
            w.count(pod, 0, 1);
        }
        if now < w.flush_due_ms || w.pending.is_empty() {
            return Vec::new();
        }
        w.flush_due_ms = now + 1000;
        w.pending.drain().collect()
    })
    .unwrap_or_default();
    for (pod, [picks, failures]) in &due {
        s.inc_labeled(rt.counters.picks, pod, *picks);
        s.inc_labeled(rt.counters.failures, pod, *failures);
    }
}
