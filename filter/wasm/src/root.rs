//! The root context of one VM: validates the plugin config, and on every tick renews or
//! follows the pool subscription lease, runs the single `WatchPool` stream when it holds the
//! lease (publishing the pool state to shared data), refreshes the worker's copy of the pool
//! and breaker state from shared data, and exports stats. Decisions are the core's; the lease
//! and reconnect timing are [`crate::lease`] and the core's `feed`.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use ai_lb_filter_core::admission::config::GuardConfig;
use ai_lb_filter_core::admission::AdmissionConfig;
use ai_lb_filter_core::config::{FilterConfig, Mode};
use ai_lb_filter_core::lifecycle::{self, admission};
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::probe::{self, ProbeAnswer, ProbeCall};
use ai_lb_proto::WatchPoolRequest;

use crate::admission::AdmissionSection;
use crate::breakers::Breakers;
use crate::guard::{self, Guard};
use crate::http::{PassThrough, Request};
use crate::metrics::Metrics;
use crate::state::{self, refresh_view, PoolView, State};
use crate::{grpc_service, host, shared};
use ai_lb_filter_core::feed::{Backoff, Subscription};
use ai_lb_filter_core::lifecycle::admission::AdmissionRt;
use ai_lb_filter_core::lifecycle::hold::{self, BigHold};
use ai_lb_filter_core::GpuSignal;

const SERVICE: &str = "ai_lb.v1.MetricsService";
const METHOD: &str = "WatchPool";
/// Guard mode watches the local agent's own pod only (same request fields as WatchPool).
const GUARD_METHOD: &str = "Watch";
const GAUGE_EVERY_MS: u64 = 500;
const COUNTERS_EVERY_MS: u64 = 200;
const LOG_EVERY_MS: u64 = 10_000;
/// The tick of a VM that carries no requests (see [`tick_period_ms`]).
pub const IDLE_TICK_MS: u64 = 100;
/// A VM counts as idle this long after it last saw a request.
pub const IDLE_AFTER_MS: u64 = 1_000;

/// The tick period a VM wants: `refresh_ms` (clamped to 10..100) while it carries requests
/// (one seen in the last [`IDLE_AFTER_MS`]) or holds any; [`IDLE_TICK_MS`] otherwise. Every VM
/// ticks, main-thread ones included, which never see a request; at 20 ms an idle Envoy spent
/// 16-17 ms of CPU a second on ticks against 4 at 100 ms. An idle VM's view of the pool is
/// refreshed before its next pick instead ([`refresh_view`]), and the holder's comes from the
/// agent's stream, not from ticks.
pub fn tick_period_ms(refresh_ms: u64, now: u64, last_request_ms: Option<u64>, held: bool) -> u64 {
    let busy = held || last_request_ms.is_some_and(|t| now.saturating_sub(t) < IDLE_AFTER_MS);
    let fast = refresh_ms.clamp(10, 100);
    if busy {
        fast
    } else {
        fast.max(IDLE_TICK_MS)
    }
}

/// On each tick: releases, oldest first, every big request held in this VM that waited
/// `maxHoldMs` or for which a pod now has room (each release counts in the router's estimate
/// before the next is judged, so one free pod takes one big request). Each is routed on its
/// own context, then resumed, outside the state's borrow (resuming may run its later callbacks
/// at once).
fn big_hold_tick(state: &Rc<RefCell<State>>, now: u64) {
    let mut i = 0usize;
    loop {
        {
            let Ok(mut guard) = state::lock(state) else {
                return;
            };
            let s = &mut *guard;
            let Some(max_hold_ms) = s.router.config().big_request_hold.map(|c| c.max_hold_ms)
            else {
                return;
            };
            let State {
                router,
                big_hold,
                metrics,
                ..
            } = s;
            let room =
                |h: &hold::Held| !router.should_hold(h.pool, h.model.as_deref(), h.size, now);
            let Some(h) = hold::next_release(big_hold, metrics, &mut i, now, max_hold_ms, room)
            else {
                return;
            };
            if hostcalls::set_effective_context(h.id).is_err() {
                // Gone without a log callback reaching us: nothing to resume.
                continue;
            }
            // The routing header is written on the held request's context.
            let model = h.model.as_deref();
            if let Some(r) =
                lifecycle::steer(&mut host::WasmHost, s, h.pool, model, now, h.size, None)
            {
                s.big_hold.resumed.insert(h.id, r);
            }
        }
        let _ = host::resume_request();
    }
}

/// Per-pool bookkeeping of the root context.
struct PoolRt {
    name: String,
    cluster: String,
    /// Serialized GrpcService (see [`grpc_service`]); valid UTF-8 (checked at configure).
    upstream: String,
    sub: Subscription,
    holder: bool,
}

pub struct Root {
    vm: u64,
    /// Guard mode: the inbound sidecar of one inference pod.
    guard: Option<GuardConfig>,
    /// `cutoffs.gpuSignal`: the GPU reading the guard compares with its cut-off.
    gpu_signal: GpuSignal,
    state: Option<Rc<RefCell<State>>>,
    pools: Vec<PoolRt>,
    tokens: HashMap<u32, usize>,
    watch_request: Vec<u8>,
    lease_ttl_ms: u64,
    refresh_ms: u64,
    next_refresh_ms: u64,
    next_counters_ms: u64,
    next_gauges_ms: u64,
    unsteered: u64,
    last_unsteered_log_ms: u64,
    last_stream_log_ms: u64,
    /// HTTP contexts created so far (counted in `create_http_context`, which only gets
    /// `&self`), and the count and time at the tick that last saw it move.
    contexts: std::cell::Cell<u64>,
    contexts_seen: u64,
    last_request_ms: Option<u64>,
    /// The tick period set now.
    tick_ms: u64,
    /// `breaker.syntheticProbe`: the probes this VM sent, by their HTTP call's token.
    probes: HashMap<u32, ProbeCall>,
}

impl Default for Root {
    fn default() -> Self {
        Self::new()
    }
}

impl Root {
    pub fn new() -> Self {
        Self {
            vm: shared::vm_id(),
            guard: None,
            gpu_signal: GpuSignal::Auto,
            state: None,
            pools: Vec::new(),
            tokens: HashMap::new(),
            watch_request: Vec::new(),
            lease_ttl_ms: 1_000,
            refresh_ms: 20,
            next_refresh_ms: 0,
            next_counters_ms: 0,
            next_gauges_ms: 0,
            unsteered: 0,
            last_unsteered_log_ms: 0,
            last_stream_log_ms: 0,
            contexts: std::cell::Cell::new(0),
            contexts_seen: 0,
            last_request_ms: None,
            tick_ms: 0,
            probes: HashMap::new(),
        }
    }

    fn configure(&mut self, bytes: &[u8]) -> Result<(), String> {
        let cfg = FilterConfig::from_json(bytes).map_err(|e| e.to_string())?;
        let admission = cfg
            .admission
            .admission_config()
            .map_err(|e| e.to_string())?;
        self.gpu_signal = cfg.cutoffs.gpu_signal;
        self.guard = (cfg.mode == Mode::Guard).then(|| {
            admission
                .as_ref()
                .map(|a| a.guard)
                .unwrap_or_else(|| AdmissionConfig::default().guard)
        });
        let w = cfg.watch;
        let backoff = Backoff::from_watch(&w);
        let mut pools = Vec::new();
        for (i, p) in cfg.pools.iter().enumerate() {
            let bytes = grpc_service::encode(&p.agent_cluster, Some(&p.agent_authority));
            let upstream = String::from_utf8(bytes).map_err(|_| {
                format!(
                    "ai-lb plugin config: field `pools[{i}].agentCluster`: value {:?}: \
                     cluster name plus authority must be under 100 bytes",
                    p.agent_cluster
                )
            })?;
            pools.push(PoolRt {
                name: p.name.clone(),
                cluster: p.cluster.clone(),
                upstream,
                sub: Subscription::new(backoff),
                holder: false,
            });
        }
        self.watch_request = WatchPoolRequest {
            min_interval_ms: w.min_interval_ms,
            heartbeat_ms: w.heartbeat_ms,
        }
        .encode_to_vec();
        self.refresh_ms = w.refresh_ms.max(1);
        let tick_ms = self.refresh_ms.clamp(10, 100);
        self.lease_ttl_ms = (tick_ms * 10).max(1_000);
        let seed = self.vm ^ host::now_ms();
        self.pools = pools;
        let mut rng = SmallRng::seed_from_u64(seed);
        let breakers = Breakers::new(cfg.pools.iter().map(|p| p.name.as_str()), rng.random());
        let views = vec![PoolView::default(); cfg.pools.len()];
        let pool_names = cfg.pools.iter().map(|p| p.name.clone()).collect();
        self.state = Some(Rc::new(RefCell::new(State {
            router: Router::new(cfg),
            metrics: Metrics::default(),
            rng,
            scratch: String::with_capacity(256),
            prompt_ids: Vec::new(),
            key_scratch: Vec::new(),
            admission: admission.map(AdmissionRt::new),
            breakers,
            big_hold: BigHold::default(),
            views,
            pool_names,
            refresh_ms: self.refresh_ms,
            vm: self.vm,
        })));
        if hostcalls::set_tick_period(Duration::from_millis(tick_ms)).is_err() {
            return Err("ai-lb: the host refused the tick period".to_string());
        }
        self.tick_ms = tick_ms;
        Ok(())
    }

    fn rand01(&self) -> f64 {
        self.state
            .as_ref()
            .and_then(|s| state::lock(s).ok().map(|mut s| s.rng.random::<f64>()))
            .unwrap_or(0.5)
    }

    fn open_stream(&mut self, i: usize, now: u64) {
        let r = self.rand01();
        let Some(p) = self.pools.get_mut(i) else {
            return;
        };
        let method = if self.guard.is_some() {
            GUARD_METHOD
        } else {
            METHOD
        };
        match hostcalls::open_grpc_stream(&p.upstream, SERVICE, method, Vec::new()) {
            Ok(token) => {
                if hostcalls::send_grpc_stream_message(token, Some(&self.watch_request), true)
                    .is_err()
                {
                    let _ = hostcalls::cancel_grpc_stream(token);
                    p.sub.failed(now, r);
                    return;
                }
                p.sub.opened(token, now);
                self.tokens.insert(token, i);
                self.inc("ailb.stream.opens");
            }
            Err(status) => {
                p.sub.failed(now, r);
                let msg = format!(
                    "ai-lb: pool `{}`: cannot open {method} stream ({status:?}); retrying",
                    p.name
                );
                self.inc("ailb.stream.failures");
                self.log_limited(now, &msg);
            }
        }
    }

    fn inc(&self, name: &str) {
        if let Some(s) = &self.state {
            if let Ok(mut s) = state::lock(s) {
                s.metrics.inc(name, 1);
            }
        }
    }

    fn log_limited(&mut self, now: u64, msg: &str) {
        if now.saturating_sub(self.last_stream_log_ms) >= LOG_EVERY_MS
            || self.last_stream_log_ms == 0
        {
            self.last_stream_log_ms = now;
            host::log(LogLevel::Warn, msg);
        }
    }

    /// Installs the shared pool state when its version changed.
    fn refresh_pool(&mut self, i: usize, now: u64) {
        let Some(state) = self.state.clone() else {
            return;
        };
        if let Ok(mut s) = state::lock(&state) {
            refresh_view(&mut s, i, now);
        };
    }

    /// Installs other VMs' breaker changes for every pod of pool `i`.
    fn refresh_breakers(&mut self, i: usize, now: u64) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let Ok(mut s) = state::lock(&state) else {
            return;
        };
        let State {
            router, breakers, ..
        } = &mut *s;
        breakers.sync(router, i, now);
    }

    fn export(&mut self, now: u64) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let Ok(mut s) = state::lock(&state) else {
            return;
        };
        crate::http::finish_deferred(&mut s);
        let State {
            router, metrics, ..
        } = &mut *s;
        metrics.inc("ailb.state_busy", state::take_busy());
        let counters = router.counters().iter();
        self.unsteered += metrics.export_core(&counters);
        if router.config().versions.is_some() {
            metrics.export_versions(&router.version_totals());
        }
        metrics.declare_event_counters();
        if self.unsteered > 0 && now.saturating_sub(self.last_unsteered_log_ms) >= LOG_EVERY_MS {
            self.last_unsteered_log_ms = now;
            let live = self.pools.iter().any(|p| p.sub.live());
            host::log(
                LogLevel::Warn,
                &format!(
                    "ai-lb: {} requests not steered by score since the last report \
                     (totals in this VM: fallback {}, fail-open {}; agent stream {}); Envoy's fallback policy balanced the fallbacks",
                    self.unsteered,
                    fallback_total(&counters),
                    counters.iter().find(|(k, _)| *k == "fail_open").map_or(0, |(_, v)| *v),
                    if live {
                        "live"
                    } else {
                        "down or held by another VM"
                    }
                ),
            );
            self.unsteered = 0;
        }
    }

    fn gauges(&mut self, now: u64) {
        let Some(state) = self.state.clone() else {
            return;
        };
        let Ok(mut s) = state::lock(&state) else {
            return;
        };
        let State {
            router, metrics, ..
        } = &mut *s;
        metrics.vm_memory();
        // Pods that left every pool: their metric ids go (a pool whose pods churn grew the
        // cache for the VM's life). Envoy keeps the stats themselves.
        let pods: usize = (0..router.pool_count())
            .map(|i| router.pod_addresses(i).count())
            .sum();
        if metrics.pod_count() > pods {
            let live: HashSet<&str> = (0..router.pool_count())
                .flat_map(|i| router.pod_addresses(i))
                .collect();
            metrics.forget_pods_except(&live);
        }
        for (i, p) in self.pools.iter().enumerate() {
            // `learnedWeights`: this VM's model's weights (1_000_000 + 1000·w), from every VM
            // whose model has trained (one that steers; the VM holding the stream may steer
            // nothing, e.g. Envoy's main-thread VM). With several, the last to write shows.
            if let Some(m) = router.learned_model(i).filter(|m| m.updates() > 0) {
                for (name, v) in m.gauges() {
                    metrics.set(&format!("ailb.pool.{}.learned.{name}", p.name), v);
                }
            }
            if !p.holder {
                continue;
            }
            metrics.set(
                &format!("ailb.pool.{}.stream_live", p.name),
                u64::from(p.sub.live()),
            );
            // Per-pod entries held for the pool (its pool state's peers): bounded by what the
            // agent lists, departed pods pruned (the churn soak watches it).
            let held = router.pool_state(i).map_or(0, |s| s.peers().len());
            metrics.set(
                &format!("ailb.pool.{}.pods", p.name),
                u64::try_from(held).unwrap_or(u64::MAX),
            );
            // `breaker.adaptiveThresholds`: the thresholds in force (the pods' median).
            if let Some(t) = router.pool_thresholds(i) {
                for (name, v) in t.gauges() {
                    metrics.set(&format!("ailb.pool.{}.thresholds.{name}", p.name), v);
                }
            }
            for row in router.pod_status(i, now) {
                let m = metrics.pod(row.address);
                if let Some(id) = m.score {
                    host::record_metric(id, row.score_gauge_value());
                }
                if let Some(id) = m.breaker_state {
                    host::record_metric(id, row.breaker.gauge_value());
                }
                if let (Some(id), Some(age)) = (m.metrics_age_ms, row.metrics_age_ms) {
                    host::record_metric(id, age);
                }
                if let Some(id) = m.inflight {
                    host::record_metric(id, u64::from(row.inflight));
                }
                if let Some(id) = m.gpu_signal {
                    host::record_metric(id, row.gpu_signal_gauge_value());
                }
            }
        }
    }

    fn tick(&mut self, now: u64) {
        let refresh = now >= self.next_refresh_ms;
        if refresh {
            self.next_refresh_ms = now + self.refresh_ms;
        }
        for i in 0..self.pools.len() {
            let Some(p) = self.pools.get_mut(i) else {
                continue;
            };
            let holds =
                shared::hold_lease(&shared::lease_key(&p.name), self.vm, now, self.lease_ttl_ms);
            if holds && !p.holder {
                p.holder = true;
                host::log(
                    LogLevel::Info,
                    &format!(
                        "ai-lb: pool `{}` (cluster `{}`): this VM subscribes to WatchPool",
                        p.name, p.cluster
                    ),
                );
                // Start from what the previous holder published.
                if let Some(st) = &self.state {
                    if let Ok(mut st) = state::lock(st) {
                        if let Some(v) = st.views.get_mut(i) {
                            v.seen_version = u64::MAX;
                        }
                    }
                }
                self.refresh_pool(i, now);
            } else if !holds && p.holder {
                p.holder = false;
                if let Some(t) = p.sub.stop(now) {
                    self.tokens.remove(&t);
                    let _ = hostcalls::cancel_grpc_stream(t);
                }
            }
            let r = self.rand01();
            let Some(p) = self.pools.get_mut(i) else {
                continue;
            };
            if p.holder {
                if let Some(t) = p.sub.silent(now) {
                    self.tokens.remove(&t);
                    let _ = hostcalls::cancel_grpc_stream(t);
                    p.sub.failed(now, r);
                    let msg = format!(
                        "ai-lb: pool `{}`: WatchPool stream silent; reconnecting",
                        p.name
                    );
                    self.log_limited(now, &msg);
                }
                if self.pools.get(i).is_some_and(|p| p.sub.due(now)) {
                    self.open_stream(i, now);
                }
            } else if refresh {
                self.refresh_pool(i, now);
            }
            if refresh {
                self.refresh_breakers(i, now);
            }
        }
        if let Some(state) = self.state.clone() {
            if let Ok(mut s) = state::lock(&state) {
                let _ = s.router.tick(now);
                // This VM's own transitions are not counted (the shared breakers' are); take
                // them so they do not pile up.
                let _ = s.router.take_breaker_events();
                lifecycle::carry_signal_trips(&mut host::WasmHost, &mut *s, now);
            }
            held_tick(&state, now);
            big_hold_tick(&state, now);
            self.probe_tick(&state, now);
        }
        if now >= self.next_counters_ms {
            self.next_counters_ms = now + COUNTERS_EVERY_MS;
            self.export(now);
        }
        if now >= self.next_gauges_ms {
            self.next_gauges_ms = now + GAUGE_EVERY_MS;
            self.gauges(now);
        }
        let held = self.state.as_ref().is_some_and(|st| {
            state::read(st).is_ok_and(|s| {
                s.big_hold.depth() > 0 || s.admission.as_ref().is_some_and(|a| a.held.depth() > 0)
            })
        });
        let contexts = self.contexts.get();
        if contexts != self.contexts_seen {
            self.contexts_seen = contexts;
            self.last_request_ms = Some(now);
        }
        let want = tick_period_ms(self.refresh_ms, now, self.last_request_ms, held);
        if want != self.tick_ms && hostcalls::set_tick_period(Duration::from_millis(want)).is_ok() {
            self.tick_ms = want;
        }
    }

    /// `breaker.syntheticProbe`: sends the probes the core says are due ([`probe::due`]) as HTTP
    /// calls on the pool's inference cluster (the routing header in them steers each to its
    /// pod through `override_host`); the answers come to [`Context::on_http_call_response`].
    fn probe_tick(&mut self, state: &Rc<RefCell<State>>, now: u64) {
        let warn = &mut |m: &str| host::log(LogLevel::Warn, m);
        let calls = match state::lock(state) {
            Ok(mut s) => probe::due(&mut *s, now, warn),
            Err(_) => return,
        };
        for call in calls {
            let headers: Vec<(&str, &str)> = call
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let sent = self.dispatch_http_call(
                &call.cluster,
                headers,
                Some(call.body.as_bytes()),
                Vec::new(),
                Duration::from_millis(call.timeout_ms),
            );
            match sent {
                Ok(token) => {
                    self.probes.insert(token, call);
                }
                Err(_) => {
                    if let Ok(mut s) = state::lock(state) {
                        probe::not_sent(&mut *s, &call, warn);
                    }
                }
            }
        }
    }

    /// Takes the message's bytes: they go as soon as the event is applied, before the state
    /// is encoded (at 1024 pods each copy of the pool held at once stays in the VM's linear
    /// memory for good).
    fn on_event(&mut self, i: usize, bytes: Vec<u8>, now: u64) {
        if self.guard.is_some() {
            let Some(name) = self.pools.get(i).map(|p| p.name.clone()) else {
                return;
            };
            if let Err(e) = guard::on_watch_bytes(&name, &bytes, now, self.gpu_signal) {
                self.inc("ailb.stream.decode_errors");
                self.log_limited(now, &format!("ai-lb: guard: pool `{name}`: {e}"));
            }
            return;
        }
        let Some(state) = self.state.clone() else {
            return;
        };
        let (applied, encoded) = {
            let Ok(mut s) = state::lock(&state) else {
                return;
            };
            let applied = s.router.apply_pool_event_bytes(i, &bytes, now);
            drop(bytes);
            (applied, s.router.pool_state(i).map(|st| st.encode()))
        };
        if let Err(e) = applied {
            // The peers before the one that did not decode are applied (see the core).
            self.inc("ailb.stream.decode_errors");
            self.log_limited(now, &format!("ai-lb: undecodable PoolEvent: {e}"));
        }
        let Some(p) = self.pools.get_mut(i) else {
            return;
        };
        if let Some(bytes) = encoded {
            match shared::publish_state(&p.name, &bytes) {
                Ok(v) => {
                    if let Ok(mut s) = state::lock(&state) {
                        if let Some(view) = s.views.get_mut(i) {
                            view.seen_version = v;
                            view.checked_ms = now;
                        }
                    }
                }
                Err(e) => host::log(
                    LogLevel::Warn,
                    &format!("ai-lb: pool `{}`: cannot publish state: {e:?}", p.name),
                ),
            }
        }
    }
}

impl Context for Root {
    /// A synthetic probe's answer ([`Root::probe_tick`]). Envoy reports a call that got no
    /// response (its timeout, a failed connection, a reset) with no headers; it counts as a
    /// timeout once the call's timeout has passed, else as a reset.
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(call) = self.probes.remove(&token_id) else {
            return;
        };
        let now = host::now_ms();
        let status = (num_headers > 0)
            .then(|| self.get_http_call_response_header(":status"))
            .flatten()
            .and_then(|s| s.parse::<u16>().ok());
        let answer = match status {
            Some(status) => ProbeAnswer::Response {
                status,
                body: self
                    .get_http_call_response_body(0, body_size)
                    .unwrap_or_default(),
            },
            None => ProbeAnswer::Failed {
                timeout: now.saturating_sub(call.sent_ms) >= call.timeout_ms,
            },
        };
        let Some(state) = self.state.clone() else {
            return;
        };
        if let Ok(mut s) = state::lock(&state) {
            probe::answered(&mut *s, &call, &answer, now, &mut |m| {
                host::log(LogLevel::Warn, m)
            });
        };
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let Some(&i) = self.tokens.get(&token_id) else {
            return;
        };
        let now = host::now_ms();
        let current = self
            .pools
            .get_mut(i)
            .is_some_and(|p| p.sub.message(token_id, now));
        if !current {
            return;
        }
        let Some(bytes) = host::grpc_message(message_size) else {
            return;
        };
        self.on_event(i, bytes, now);
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let Some(i) = self.tokens.remove(&token_id) else {
            return;
        };
        let now = host::now_ms();
        let r = self.rand01();
        let Some(p) = self.pools.get_mut(i) else {
            return;
        };
        let was_live = p.sub.live();
        if p.sub.closed(token_id, now, r) {
            let msg = format!(
                "ai-lb: pool `{}`: WatchPool stream on cluster closed (grpc status {status_code}{}); \
                 reconnecting with backoff",
                p.name,
                if was_live { "" } else { ", before any event" }
            );
            self.inc("ailb.stream.closes");
            self.log_limited(now, &msg);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        match self.configure(&bytes) {
            Ok(()) => true,
            Err(msg) => {
                // Envoy refuses the plugin (exit 1 at startup, LDS update rejected later).
                host::log(LogLevel::Critical, &msg);
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let now = host::now_ms();
        self.tick(now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The tick speeds up on its next run (see `tick_period_ms`).
        self.contexts.set(self.contexts.get().wrapping_add(1));
        if let (Some(cfg), Some(state), Some(p)) = (self.guard, &self.state, self.pools.first()) {
            return Some(Box::new(Guard::new(state.clone(), &p.name, cfg)));
        }
        let route = self
            .state
            .as_ref()
            .filter(|s| state::read(s).is_ok_and(|s| s.router.config().mode == Mode::Route));
        match route {
            Some(s) => Some(Box::new(Request::new(s.clone(), context_id))),
            None => Some(Box::new(PassThrough)),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The worker's held queue on each tick (the core's [`admission::held_tick`]): requests past
/// their deadline get 503 (refunded by their own `on_log`), and as many as there are
/// unsaturated pods are routed on their own context and resumed, most important class first.
fn held_tick(state: &Rc<RefCell<State>>, now: u64) {
    let tick = {
        let Ok(mut s) = state::lock(state) else {
            return;
        };
        let State {
            router,
            admission,
            metrics,
            ..
        } = &mut *s;
        let Some(rt) = admission.as_mut() else {
            return;
        };
        admission::held_tick(rt, router, metrics, now)
    };
    for id in tick.expired {
        if hostcalls::set_effective_context(id).is_ok() {
            admission::overloaded_reply(&mut host::WasmHost, tick.retry_after_s);
        }
    }
    for (id, h) in tick.released {
        if hostcalls::set_effective_context(id).is_err() {
            continue;
        }
        // The routing header is written on the held request's context, then it resumes.
        if let Ok(mut s) = state::lock(state) {
            let model = h.model.as_deref();
            if let Some(r) = lifecycle::steer(
                &mut host::WasmHost,
                &mut *s,
                h.pool,
                model,
                now,
                h.size,
                None,
            ) {
                if let Some(rt) = s.admission.as_mut() {
                    rt.resumed.insert(id, r);
                }
            }
        }
        let _ = host::resume_request();
    }
}

/// Total fallbacks so far (every reason) in the core's counters.
fn fallback_total(counters: &[(&'static str, u64)]) -> u64 {
    counters
        .iter()
        .filter(|(k, _)| k.starts_with("fallback."))
        .map(|(_, v)| v)
        .sum()
}

#[cfg(test)]
mod tick_tests {
    use super::{tick_period_ms, IDLE_AFTER_MS, IDLE_TICK_MS};

    #[test]
    fn a_vm_ticks_fast_while_it_carries_or_holds_requests_and_slowly_when_idle() {
        let now = 50_000;
        // Never saw a request (a main-thread VM): slow.
        assert_eq!(tick_period_ms(20, now, None, false), IDLE_TICK_MS);
        // A request within the last second: refreshMs.
        assert_eq!(tick_period_ms(20, now, Some(now - 10), false), 20);
        assert_eq!(
            tick_period_ms(20, now, Some(now - IDLE_AFTER_MS + 1), false),
            20
        );
        // A second without one: slow again.
        assert_eq!(
            tick_period_ms(20, now, Some(now - IDLE_AFTER_MS), false),
            IDLE_TICK_MS
        );
        // Something held (its release runs on the tick): fast however long ago.
        assert_eq!(tick_period_ms(20, now, None, true), 20);
        // refreshMs is clamped to 10..100 as before; idle never ticks faster than busy.
        assert_eq!(tick_period_ms(5, now, Some(now), false), 10);
        assert_eq!(tick_period_ms(500, now, Some(now), false), 100);
        assert_eq!(tick_period_ms(500, now, None, false), 100);
    }
}
