//! Decides how the pod talks HTTP: the axum routes (OpenAI API, /metrics, /sim/gpu, /control),
//! the single engine task that advances the pure model in wall-clock time (sleeping until the
//! next iteration ends, never busy-looping), and how tokens reach each client.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{mpsc, watch, Notify};

use crate::config::PodConfig;
use crate::faults::Faults;
use crate::gpu;
use crate::kv_cache::KvEvent;
use crate::kv_events::{EventSink, PublisherStats};
use crate::metrics::{FinishReason, Gauges, Metrics};
use crate::model::{Engine, NewRequest, TokenEvent};
use crate::openai::{self, ApiError, GenRequest, Kind, ResponseMeta, TextGen, Usage};
use crate::openai::{token_text, tokens_text};

/// Shared state of one pod.
#[derive(Debug)]
pub struct AppState {
    cfg: PodConfig,
    pod_header: HeaderValue,
    start: Instant,
    created: u64,
    inner: Mutex<Inner>,
    wake: Notify,
    hang: watch::Sender<bool>,
    /// The `frontend_ms` fault's one-at-a-time front end.
    frontend: tokio::sync::Mutex<()>,
    /// The `freeze` fault: every route but `/sim/gpu` and `/control` waits while it is set.
    freeze: watch::Sender<bool>,
    /// Requests the `freeze` fault holds now (`GET /control` shows it as `held_by_freeze`).
    held_by_freeze: AtomicU64,
    shutdown: watch::Sender<bool>,
}

#[derive(Debug)]
struct Inner {
    engine: Engine,
    streams: HashMap<u64, StreamEntry>,
    metrics: Metrics,
    faults: Faults,
    error_rng: ChaCha8Rng,
    next_id: u64,
    hung: u64,
    events: Vec<TokenEvent>,
    /// Where KV-cache events go, when published.
    kv_sink: Option<EventSink>,
    kv_events: Vec<KvEvent>,
    /// GPU memory past the preallocation, and OOM crashes (the `memory_growth` fault).
    oom: crate::oom::OomModel,
    /// Bytes between vLLM's preallocation and the GPU's total.
    oom_headroom: f64,
}

#[derive(Debug)]
struct StreamEntry {
    tx: mpsc::UnboundedSender<TokenEvent>,
    prompt_tokens: u32,
    /// Streaming clients get every token; others only the last one (fewer task wake-ups).
    every_token: bool,
}

/// The pod name is not usable as an HTTP header value.
#[derive(Debug, thiserror::Error)]
#[error("invalid --pod-name {0:?}: not a valid HTTP header value")]
pub struct BadPodName(String);

impl AppState {
    pub fn new(cfg: PodConfig) -> Result<Arc<Self>, BadPodName> {
        let pod_header =
            HeaderValue::from_str(&cfg.pod_name).map_err(|_| BadPodName(cfg.pod_name.clone()))?;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let inner = Inner {
            engine: Engine::new(cfg.engine.clone()),
            streams: HashMap::new(),
            metrics: Metrics::new(),
            faults: Faults::default(),
            error_rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            next_id: 0,
            hung: 0,
            events: Vec::new(),
            kv_sink: None,
            kv_events: Vec::new(),
            oom: crate::oom::OomModel::default(),
            oom_headroom: cfg.spec.memory_total_bytes as f64 * (1.0 - gpu::MEMORY_USED_FRACTION),
        };
        Ok(Arc::new(Self {
            cfg,
            pod_header,
            start: Instant::now(),
            created,
            inner: Mutex::new(inner),
            wake: Notify::new(),
            hang: watch::Sender::new(false),
            frontend: tokio::sync::Mutex::new(()),
            freeze: watch::Sender::new(false),
            held_by_freeze: AtomicU64::new(0),
            shutdown: watch::Sender::new(false),
        }))
    }

    pub fn config(&self) -> &PodConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Seconds since start: the engine model's clock.
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Publishes the engine's KV-cache events through `sink` from now on (one batch per
    /// engine step that changed the cache).
    pub fn attach_kv_events(&self, sink: EventSink) {
        let mut g = self.lock();
        g.engine.enable_kv_events();
        g.kv_sink = Some(sink);
    }

    /// Releases hung requests (answered 503) before a graceful shutdown.
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
    }
}

impl Inner {
    /// Advances the `memory_growth` fault's memory to `now`; at an OOM crash every request in
    /// flight fails (its stream ends without its last token: a 503 or a reset stream) and the
    /// engine's cache is emptied, as when vLLM's process dies.
    fn check_oom(&mut self, now: f64) {
        let running = self.engine.stats().running;
        let crashed = self.oom.advance(
            now,
            running,
            self.faults.memory_growth.as_ref(),
            self.oom_headroom,
        );
        if crashed {
            let ids: Vec<u64> = self.streams.keys().copied().collect();
            self.oom.failed_in_flight += ids.len() as u64;
            tracing::warn!(in_flight = ids.len(), "OOM crash (memory_growth fault)");
            for id in ids {
                self.abort(id);
            }
            self.engine.reset_prefix_cache();
            self.flush_kv_events();
        }
    }

    /// Whether the pod is down after an OOM crash.
    fn oom_down(&mut self, now: f64) -> bool {
        self.check_oom(now);
        self.oom.down(now)
    }

    /// Advances the model to `now` and delivers the produced tokens.
    fn step(&mut self, now: f64) {
        self.check_oom(now);
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.engine.advance_to(now, &mut events);
        for ev in &events {
            let Some(s) = self.streams.get(&ev.id) else {
                continue;
            };
            if ev.index == 0 {
                self.metrics.ttft.observe(ev.since_arrival);
                self.metrics.add_prompt_tokens(u64::from(s.prompt_tokens));
            } else {
                self.metrics.itl.observe(ev.since_prev);
            }
            self.metrics.add_generation_tokens(1);
            if ev.last {
                self.metrics.e2e.observe(ev.since_arrival);
                self.metrics.finished(FinishReason::Length);
            }
            let gone = (s.every_token || ev.last) && s.tx.send(*ev).is_err();
            if ev.last {
                self.streams.remove(&ev.id);
            } else if gone {
                self.abort(ev.id);
            }
        }
        self.events = events;
        self.flush_kv_events();
    }

    /// Hands the KV-cache events of the steps just run to the publisher as one batch.
    fn flush_kv_events(&mut self) {
        let Some(sink) = self.kv_sink.as_mut() else {
            return;
        };
        self.engine.take_kv_events(&mut self.kv_events);
        if !self.kv_events.is_empty() {
            sink.send(std::mem::take(&mut self.kv_events));
        }
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block; refused while a request holds
    /// blocks. The `AllBlocksCleared` event goes out with the next batch.
    fn reset_prefix_cache(&mut self) -> bool {
        let ok = self.engine.reset_prefix_cache();
        self.flush_kv_events();
        ok
    }

    fn abort(&mut self, id: u64) {
        self.streams.remove(&id);
        if self.engine.abort(id) {
            self.metrics.finished(FinishReason::Abort);
        }
        self.flush_kv_events();
    }
}

/// Spawns the engine task: one task advances the model, sleeping until the running iteration
/// ends or a request arrives. If it wakes late, `advance_to` runs all due iterations at once.
pub fn spawn_engine(state: Arc<AppState>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let next = {
                let mut g = state.lock();
                g.step(state.now());
                g.engine.next_wake()
            };
            match next {
                Some(t) => {
                    let at = state.start + Duration::from_secs_f64(t.max(0.0));
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = state.wake.notified() => {}
                    }
                }
                None => state.wake.notified().await,
            }
        }
    })
}

/// The largest request body accepted (64 MiB).
pub const MAX_REQUEST_BODY_BYTES: usize = 64 << 20;

/// The HTTP routes, every response tagged with `x-fake-pod`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/health", get(healthz))
        .route("/metrics", get(metrics))
        .route("/sim/gpu", get(sim_gpu))
        .route("/sim/cache", get(sim_cache))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/control", get(get_control).post(post_control))
        // A model server takes multimodal bodies of many MB (base64 images); axum's default
        // cap (2 MB) would answer 413 where vLLM does not.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), tag_pod))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then drains open requests.
pub async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let engine = spawn_engine(state.clone());
    let st = state.clone();
    // TCP_NODELAY: each SSE chunk is a small write; without it Nagle + delayed ACKs add tens of
    // ms to every TTFT (seen in the benchmarks' latency floor).
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set TCP_NODELAY: {e}");
        }
    });
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            st.begin_shutdown();
        })
        .await;
    engine.abort();
    result
}

async fn tag_pod(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !path.starts_with("/sim/") && path != "/control" {
        if let Err(res) = wait_while_frozen(&st).await {
            return res;
        }
    }
    let mut res = next.run(req).await;
    res.headers_mut()
        .insert("x-fake-pod", st.pod_header.clone());
    res
}

fn json_response(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(body),
    )
        .into_response()
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, e.body())
}

async fn chat(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(st, Kind::Chat, body).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(st, Kind::Completion, body).await
}

/// Aborts the request in the engine if the client goes away before the last token.
struct RequestGuard {
    state: Arc<AppState>,
    id: u64,
    done: bool,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.done {
            self.state.lock().abort(self.id);
        }
    }
}

/// The `frontend_ms` fault: the request waits its turn at the one-at-a-time front end, then
/// takes `frontend_ms` there, before the engine sees it (no metric counts it).
async fn frontend(st: &AppState) {
    if st.lock().faults.frontend_ms == 0 {
        return;
    }
    let _turn = st.frontend.lock().await;
    // Read again at its turn: a cleared fault lets the queue through at once.
    let ms = st.lock().faults.frontend_ms;
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Counts a request held by the `hang` fault in `num_requests_waiting`.
struct HungGuard(Arc<AppState>);

impl Drop for HungGuard {
    fn drop(&mut self) {
        let mut g = self.0.lock();
        g.hung = g.hung.saturating_sub(1);
    }
}

async fn generate(st: Arc<AppState>, kind: Kind, body: Bytes) -> Response {
    let req = match openai::parse(kind, &body) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    if let Some(m) = &req.model {
        if *m != st.cfg.model {
            return error_response(&ApiError::not_found_model(m));
        }
    }
    frontend(&st).await;
    if !st.cfg.engine.fits(req.prompt_tokens, req.max_tokens) {
        return error_response(&ApiError::bad_request(
            format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the KV cache capacity of {} tokens ({} blocks of {})",
                req.prompt_tokens,
                req.max_tokens,
                st.cfg.engine.capacity_tokens(),
                st.cfg.engine.num_blocks(),
                st.cfg.engine.cache.block_size
            ),
            Some("max_tokens"),
        ));
    }
    {
        let mut g = st.lock();
        if g.oom_down(st.now()) {
            return error_response(&ApiError::unavailable(
                "engine restarting after an OOM crash",
            ));
        }
        let roll: f64 = g.error_rng.random();
        if roll < g.faults.error_rate {
            g.metrics.finished(FinishReason::Error);
            return error_response(&ApiError::injected());
        }
        // Drawn only when set, so the other faults' draws stay as they were.
        if g.faults.malformed_rate > 0.0 {
            let roll: f64 = g.error_rng.random();
            if roll < g.faults.malformed_rate {
                return (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "text/plain")],
                    "upstream engine error",
                )
                    .into_response();
            }
        }
        if g.faults.memory_error_rate > 0.0 {
            let roll: f64 = g.error_rng.random();
            if roll < g.faults.memory_error_rate {
                g.metrics.finished(FinishReason::Error);
                return error_response(&ApiError::out_of_memory());
            }
        }
    }
    let cut_at = {
        let mut g = st.lock();
        if g.faults.truncate_rate > 0.0 {
            let roll: f64 = g.error_rng.random();
            (roll < g.faults.truncate_rate).then_some(req.max_tokens / 2)
        } else {
            None
        }
    };
    if let Err(resp) = wait_while_hung(&st).await {
        return resp;
    }
    // The whole output is drawn up front (seeded by the request, so the same whatever the
    // timing): the engine needs its token ids to cache the answer's KV blocks.
    let output = TextGen::new(st.cfg.seed, &req).ids(req.max_tokens);
    let mut token_ids = Vec::with_capacity(req.prompt_ids.len() + output.len());
    token_ids.extend_from_slice(&req.prompt_ids);
    token_ids.extend_from_slice(&output);
    let (tx, rx) = mpsc::unbounded_channel();
    let id = {
        let mut g = st.lock();
        let id = g.next_id;
        g.next_id += 1;
        let now = st.now();
        let submitted = g.engine.submit(
            NewRequest {
                id,
                prompt_tokens: req.prompt_tokens,
                max_tokens: req.max_tokens,
                token_ids,
            },
            now,
        );
        if let Err(e) = submitted {
            return error_response(&ApiError::bad_request(e.to_string(), Some("max_tokens")));
        }
        g.streams.insert(
            id,
            StreamEntry {
                tx,
                prompt_tokens: req.prompt_tokens,
                every_token: req.stream,
            },
        );
        id
    };
    st.wake.notify_one();
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let meta = ResponseMeta::new(
        kind,
        format!("{prefix}-{}-{id}", st.cfg.pod_name),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        st.cfg.model.clone(),
    );
    let guard = RequestGuard {
        state: st.clone(),
        id,
        done: false,
    };
    if req.stream {
        stream_response(req, meta, output, rx, guard, cut_at)
    } else {
        full_response(req, meta, output, rx, guard, cut_at).await
    }
}

/// Holds the request while the `freeze` fault is set; 503 if the pod shuts down meanwhile.
async fn wait_while_frozen(st: &Arc<AppState>) -> Result<(), Response> {
    let mut freeze = st.freeze.subscribe();
    let mut shutdown = st.shutdown.subscribe();
    let _held = (*freeze.borrow()).then(|| HeldByFreeze::new(st));
    while *freeze.borrow_and_update() {
        if *shutdown.borrow_and_update() {
            return Err(error_response(&ApiError::unavailable("pod shutting down")));
        }
        tokio::select! {
            r = freeze.changed() => {
                if r.is_err() {
                    return Ok(());
                }
            }
            _ = shutdown.changed() => {}
        }
    }
    Ok(())
}

/// Counts a request held by the `freeze` fault in `held_by_freeze` while it lives (it may be
/// dropped mid-wait: the client went away).
struct HeldByFreeze<'a>(&'a AppState);

impl<'a> HeldByFreeze<'a> {
    fn new(st: &'a AppState) -> Self {
        st.held_by_freeze.fetch_add(1, Ordering::Relaxed);
        HeldByFreeze(st)
    }
}

impl Drop for HeldByFreeze<'_> {
    fn drop(&mut self) {
        self.0.held_by_freeze.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds the request while the `hang` fault is set; 503 if the pod shuts down meanwhile.
async fn wait_while_hung(st: &Arc<AppState>) -> Result<(), Response> {
    let mut hang = st.hang.subscribe();
    if !*hang.borrow_and_update() {
        return Ok(());
    }
    st.lock().hung += 1;
    let _hung = HungGuard(st.clone());
    let mut shutdown = st.shutdown.subscribe();
    loop {
        if *shutdown.borrow_and_update() {
            return Err(error_response(&ApiError::unavailable("pod shutting down")));
        }
        tokio::select! {
            r = hang.changed() => {
                if r.is_err() || !*hang.borrow_and_update() {
                    return Ok(());
                }
            }
            _ = shutdown.changed() => {}
        }
    }
}

async fn full_response(
    req: GenRequest,
    meta: ResponseMeta,
    output: Vec<u32>,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    mut guard: RequestGuard,
    cut_at: Option<u32>,
) -> Response {
    // Only the last token is delivered for non-streaming requests.
    while let Some(ev) = rx.recv().await {
        if ev.last {
            guard.done = true;
            break;
        }
    }
    if !guard.done {
        return error_response(&ApiError::unavailable("engine stopped"));
    }
    if let Some(n) = cut_at {
        // Cut off (the `truncate_rate` fault): half the answer, no finish reason. Answered when
        // the whole would have been (only the last token reaches a non-streaming request).
        let text = tokens_text(output.get(..n as usize).unwrap_or(&output));
        return json_response(
            StatusCode::OK,
            meta.full_with(&text, Usage::new(req.prompt_tokens, n), false),
        );
    }
    let produced = req.max_tokens;
    let text = tokens_text(&output);
    json_response(
        StatusCode::OK,
        meta.full(&text, Usage::new(req.prompt_tokens, produced)),
    )
}

enum Phase {
    Tokens,
    Usage,
    Done,
    End,
}

struct StreamCtx {
    req: GenRequest,
    meta: ResponseMeta,
    output: Vec<u32>,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    guard: RequestGuard,
    phase: Phase,
    produced: u32,
    /// `truncate_rate`: the stream ends cleanly after this many tokens, with no finish reason,
    /// usage or `[DONE]` (the guard aborts the rest in the engine).
    cut_at: Option<u32>,
}

fn sse(data: &str) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(format!("data: {data}\n\n")))
}

fn stream_response(
    req: GenRequest,
    meta: ResponseMeta,
    output: Vec<u32>,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    guard: RequestGuard,
    cut_at: Option<u32>,
) -> Response {
    let ctx = StreamCtx {
        req,
        meta,
        output,
        rx,
        guard,
        phase: Phase::Tokens,
        produced: 0,
        cut_at,
    };
    let stream = futures::stream::unfold(ctx, |mut c| async move {
        match c.phase {
            Phase::Tokens => {
                if c.cut_at.is_some_and(|n| c.produced >= n) {
                    return None;
                }
                let Some(ev) = c.rx.recv().await else {
                    // The engine dropped the request (an OOM crash): the stream breaks off, as
                    // a dead vLLM's connection does, instead of ending cleanly.
                    c.phase = Phase::End;
                    return Some((Err(std::io::Error::other("engine died")), c));
                };
                let id = c.output.get(ev.index as usize).copied().unwrap_or(0);
                let tok = token_text(id);
                c.produced += 1;
                let data = c.meta.chunk(&tok, ev.index == 0, ev.last);
                if ev.last {
                    c.guard.done = true;
                    c.phase = if c.req.include_usage {
                        Phase::Usage
                    } else {
                        Phase::Done
                    };
                }
                Some((sse(&data), c))
            }
            Phase::Usage => {
                c.phase = Phase::Done;
                let data = c
                    .meta
                    .usage_chunk(Usage::new(c.req.prompt_tokens, c.produced));
                Some((sse(&data), c))
            }
            Phase::Done => {
                c.phase = Phase::End;
                Some((sse("[DONE]"), c))
            }
            Phase::End => None,
        }
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let body = serde_json::json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model,
            "object": "model",
            "created": st.created,
            "owned_by": "fake-pod",
            "root": st.cfg.model,
            "parent": null,
        }]
    });
    json_response(StatusCode::OK, body.to_string())
}

async fn healthz() -> &'static str {
    "ok"
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = {
        let mut g = st.lock();
        if g.oom_down(st.now()) {
            return error_response(&ApiError::unavailable(
                "engine restarting after an OOM crash",
            ));
        }
        let s = g.engine.stats();
        let waiting = s.waiting as u64 + g.hung;
        let waiting = match g.faults.queue {
            Some(q) => waiting.max(u64::from(q)),
            None => waiting,
        };
        g.metrics.render(
            &st.cfg.model,
            Gauges {
                waiting,
                running: s.running as u64,
                kv_cache_usage: s.kv_usage,
                block_size: st.cfg.engine.cache.block_size,
                num_gpu_blocks: s.num_blocks,
                prefix_caching: st.cfg.engine.cache.prefix_caching,
                prefix_cache: s.cache,
            },
        )
    };
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn sim_gpu(State(st): State<Arc<AppState>>) -> Response {
    let report = {
        let mut g = st.lock();
        let now = st.now();
        g.check_oom(now);
        let signals = gpu::WindowSignals::of(&mut g.engine, now);
        let mut r = gpu::report(
            &st.cfg.spec,
            &st.cfg.pod_name,
            st.cfg.num_gpus,
            &signals,
            st.cfg.gpu_util_model,
            &g.faults,
        );
        for gpu in r.gpus.iter_mut() {
            gpu.memory_used_bytes =
                g.oom
                    .used_bytes(gpu.memory_used_bytes, gpu.memory_total_bytes, now);
        }
        r
    };
    match serde_json::to_string(&report) {
        Ok(body) => json_response(StatusCode::OK, body),
        Err(e) => error_response(&ApiError::unavailable(e.to_string())),
    }
}

/// `/sim/cache`: the prefix cache's blocks and counters, and the KV-event publisher's.
/// `POST /reset_prefix_cache` (vLLM's development endpoint): empties the prefix cache; 409
/// while a running request holds blocks (vLLM refuses then too), so a benchmark can start each
/// policy from a cold cache.
async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    let ok = st.lock().reset_prefix_cache();
    if ok {
        json_response(StatusCode::OK, r#"{"reset":true}"#.to_string())
    } else {
        json_response(
            StatusCode::CONFLICT,
            r#"{"reset":false,"reason":"a running request holds KV blocks"}"#.to_string(),
        )
    }
}

async fn sim_cache(State(st): State<Arc<AppState>>) -> Response {
    let body = {
        let g = st.lock();
        let s = g.engine.stats();
        let publisher = g.kv_sink.as_ref().map(|k| publisher_json(k.stats()));
        serde_json::json!({
            "block_size": st.cfg.engine.cache.block_size,
            "prefix_caching": st.cfg.engine.cache.prefix_caching,
            "num_blocks": s.num_blocks,
            "blocks_used": s.kv_blocks_used,
            "blocks_cached": s.kv_blocks_cached,
            "blocks_evictable": s.kv_blocks_evictable,
            "prefix_cache_queries_tokens": s.cache.queries,
            "prefix_cache_hits_tokens": s.cache.hits,
            "evictions": s.cache.evictions,
            "kv_events": publisher,
        })
    };
    json_response(StatusCode::OK, body.to_string())
}

fn publisher_json(p: &PublisherStats) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    serde_json::json!({
        "batches_published": p.batches_published.load(Relaxed),
        "batches_dropped": p.batches_dropped.load(Relaxed),
        "events_published": p.events_published.load(Relaxed),
        "replay_requests": p.replay_requests.load(Relaxed),
    })
}

fn faults_body(f: &Faults) -> String {
    serde_json::to_string(f).unwrap_or_else(|_| "{}".to_string())
}

/// `GET /control`: the faults in force, and `held_by_freeze`, how many requests the `freeze`
/// fault holds now (so a test can see them held rather than sleep and hope they arrived).
async fn get_control(State(st): State<Arc<AppState>>) -> Response {
    let (mut body, oom) = {
        let mut g = st.lock();
        let now = st.now();
        let down = g.oom_down(now);
        let mut oom = serde_json::to_value(&g.oom).unwrap_or_default();
        if let Some(o) = oom.as_object_mut() {
            o.insert("down".to_string(), down.into());
        }
        (serde_json::to_value(&g.faults).unwrap_or_default(), oom)
    };
    if let Some(m) = body.as_object_mut() {
        let held = st.held_by_freeze.load(Ordering::Relaxed);
        m.insert("held_by_freeze".to_string(), held.into());
        // The `memory_growth` fault's state: extra bytes, crashes, requests they failed.
        m.insert("oom".to_string(), oom);
    }
    json_response(StatusCode::OK, body.to_string())
}

async fn post_control(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(&ApiError::bad_request(
                format!("invalid JSON control body: {e}"),
                None,
            ))
        }
    };
    let faults = {
        let mut g = st.lock();
        match g.faults.apply(&value, st.cfg.spec.gpm) {
            Ok(f) => {
                g.engine.set_slowdown(f.slowdown);
                g.faults = f.clone();
                f
            }
            Err(e) => return error_response(&ApiError::bad_request(e.to_string(), None)),
        }
    };
    st.hang.send_replace(faults.hang);
    st.freeze.send_replace(faults.freeze);
    tracing::info!(?faults, "faults updated");
    json_response(StatusCode::OK, faults_body(&faults))
}
