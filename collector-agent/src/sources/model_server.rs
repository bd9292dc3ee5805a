//! The `model-server` source: scrapes the engine's Prometheus page, detects (or is told) the
//! engine, and decides the pod's `InferenceStats`: current gauges as read, latency quantiles and
//! request/error rates over a sliding window of scrape deltas (see `window`). The served models
//! come from the server's OpenAI `GET /v1/models` when it answers (cached, refreshed rarely),
//! else from the configured names, else from the page's `model_name` labels.

use super::{Reading, Rejected, Source, SourceError};
use crate::engines::{self, EngineKind, Extracted};
use crate::prometheus;
use crate::window::{
    CounterWindow, HistogramSnapshot, HistogramWindow, WindowedQuantiles, DEFAULT_RECENT_WINDOW,
};
use ai_lb_proto::v1::{InferenceStats, LatencyQuantiles, ModelInfo};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const NAME: &str = "model-server";

/// Pages larger than this are refused (a vLLM page is ~200 KB).
pub const MAX_PAGE_BYTES: usize = 16 * 1024 * 1024;

/// How to reach and read the model server.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelServerOptions {
    /// Full URL of the Prometheus page, e.g. `http://127.0.0.1:8000/metrics`.
    pub metrics_url: String,
    /// Full URL of the OpenAI models list, e.g. `http://127.0.0.1:8000/v1/models`; `None` to
    /// never ask.
    pub models_url: Option<String>,
    /// The engine, or `None` to detect it from the page's metric names.
    pub engine: Option<EngineKind>,
    /// Sliding window of the quantiles.
    pub window: Duration,
    /// Sliding window of the request and error rates.
    pub rate_window: Duration,
    /// Sliding window of the recent inter-token latency (a few scrapes).
    pub recent_window: Duration,
    /// Maximum concurrently running sequences, when the operator knows it (vLLM max_num_seqs).
    pub queue_capacity: Option<u32>,
    /// KV-cache capacity in tokens, when the operator knows it; wins over the page's.
    pub kv_capacity_tokens: Option<u64>,
    /// Timeout of each HTTP request.
    pub timeout: Duration,
    /// Model names to report when `/v1/models` does not answer.
    pub model_names: Vec<String>,
    /// How often to re-read `/v1/models`.
    pub models_refresh: Duration,
}

impl ModelServerOptions {
    /// Defaults for a server at `base_url` (e.g. `http://127.0.0.1:8000`): `/metrics` and
    /// `/v1/models` on it, engine detected, 10 s window, 2 s timeout, models re-read every 60 s.
    /// A URL that already ends in `/metrics` is taken as the page itself.
    pub fn new(base_url: &str) -> Self {
        let trimmed = base_url.trim_end_matches('/');
        let (base, metrics_url) = match trimmed.strip_suffix("/metrics") {
            Some(base) => (base, trimmed.to_string()),
            None => (trimmed, format!("{trimmed}/metrics")),
        };
        Self {
            metrics_url,
            models_url: Some(format!("{base}/v1/models")),
            engine: None,
            window: crate::window::DEFAULT_WINDOW,
            rate_window: crate::window::DEFAULT_RATE_WINDOW,
            recent_window: crate::window::DEFAULT_RECENT_WINDOW,
            queue_capacity: None,
            kv_capacity_tokens: None,
            timeout: Duration::from_secs(2),
            model_names: Vec::new(),
            models_refresh: Duration::from_secs(60),
        }
    }
}

/// The windowed state for one engine.
#[derive(Debug)]
struct Windows {
    ttft: HistogramWindow,
    e2e: HistogramWindow,
    inter_token: HistogramWindow,
    /// The same histogram over the recent window only.
    inter_token_recent: HistogramWindow,
    /// [finished, errors] when both known, [finished] otherwise.
    requests: CounterWindow,
    /// [prefix-cache queries, hits], in prompt tokens.
    prefix: CounterWindow,
}

impl Windows {
    fn new(window: Duration, rate_window: Duration, recent_window: Duration) -> Self {
        Self {
            ttft: HistogramWindow::new(window),
            e2e: HistogramWindow::new(window),
            inter_token: HistogramWindow::new(window),
            inter_token_recent: HistogramWindow::new(recent_window),
            requests: CounterWindow::new(rate_window),
            prefix: CounterWindow::new(rate_window),
        }
    }
}

/// Turns successive extractions into `InferenceStats` (pure: time passed in).
#[derive(Debug)]
pub struct InferenceTracker {
    window: Duration,
    rate_window: Duration,
    recent_window: Duration,
    queue_capacity: Option<u32>,
    kv_capacity_tokens: Option<u64>,
    windows: Windows,
}

impl InferenceTracker {
    /// `queue_capacity` and `kv_capacity_tokens` are the operator's figures: when set they win
    /// over the page's.
    pub fn new(
        window: Duration,
        rate_window: Duration,
        queue_capacity: Option<u32>,
        kv_capacity_tokens: Option<u64>,
    ) -> Self {
        Self {
            window,
            rate_window,
            recent_window: DEFAULT_RECENT_WINDOW,
            queue_capacity,
            kv_capacity_tokens,
            windows: Windows::new(window, rate_window, DEFAULT_RECENT_WINDOW),
        }
    }

    /// Sets the window of the recent inter-token latency (forgets what it held).
    pub fn with_recent_window(mut self, recent_window: Duration) -> Self {
        self.recent_window = recent_window;
        self.windows.inter_token_recent = HistogramWindow::new(recent_window);
        self
    }

    /// Forgets the windows (the engine changed).
    pub fn reset(&mut self) {
        self.windows = Windows::new(self.window, self.rate_window, self.recent_window);
    }

    /// Records one page's values taken at `now` and answers the stats over the window.
    pub fn update(&mut self, now: Instant, x: &Extracted) -> InferenceStats {
        let w = &mut self.windows;
        let q = |win: &mut HistogramWindow, h: &Option<HistogramSnapshot>| match h {
            Some(h) => {
                win.observe(now, h.clone());
                to_proto(win.quantiles())
            }
            None => {
                win.clear();
                LatencyQuantiles::default()
            }
        };
        let ttft = q(&mut w.ttft, &x.ttft);
        let e2e = q(&mut w.e2e, &x.e2e);
        let inter_token = q(&mut w.inter_token, &x.inter_token);
        let inter_token_recent = q(&mut w.inter_token_recent, &x.inter_token);
        let (request_rate, error_rate) = match (x.finished_total, x.errors_total) {
            (Some(f), Some(e)) => {
                w.requests.observe(now, vec![f, e]);
                (w.requests.rate(0), w.requests.ratio(1, 0))
            }
            (Some(f), None) => {
                w.requests.observe(now, vec![f]);
                (w.requests.rate(0), None)
            }
            _ => {
                w.requests.clear();
                (None, None)
            }
        };
        // Hits / queries of the counters' increase over the rate window; absent without the
        // counters or without queries in the window.
        let prefix_cache_hit_rate = match (x.prefix_queries_total, x.prefix_hits_total) {
            (Some(q), Some(h)) => {
                w.prefix.observe(now, vec![q, h]);
                w.prefix.ratio(1, 0)
            }
            _ => {
                w.prefix.clear();
                None
            }
        };
        let span = [
            w.ttft.span(),
            w.e2e.span(),
            w.inter_token.span(),
            w.requests.span(),
        ]
        .into_iter()
        .max()
        .unwrap_or_default();
        InferenceStats {
            waiting: x.waiting,
            running: x.running,
            queue_capacity: self.queue_capacity.or(x.queue_capacity),
            kv_cache_usage: x.kv_cache_usage,
            ttft: Some(ttft),
            e2e: Some(e2e),
            inter_token: Some(inter_token),
            request_rate,
            error_rate,
            window_ms: u32::try_from(span.as_millis()).unwrap_or(u32::MAX),
            kv_capacity_tokens: self.kv_capacity_tokens.or(x.kv_capacity_tokens),
            rate_window_ms: u32::try_from(w.requests.span().as_millis()).unwrap_or(u32::MAX),
            inter_token_recent: Some(inter_token_recent),
            recent_window_ms: u32::try_from(w.inter_token_recent.span().as_millis())
                .unwrap_or(u32::MAX),
            prefix_cache_hit_rate,
            finished_total: x.finished_total,
            errors_total: x.finished_total.and(x.errors_total),
        }
    }
}

fn to_proto(q: WindowedQuantiles) -> LatencyQuantiles {
    LatencyQuantiles {
        p50_ms: q.p50,
        p99_ms: q.p99,
        samples: q.samples,
        mean_ms: q.mean,
    }
}

/// Models from an OpenAI `/v1/models` body: entries with a `parent` (vLLM LoRA adapters) become
/// adapters of their parent; others are models. `None` if the body is not such a list.
pub fn parse_models(body: &[u8]) -> Option<Vec<ModelInfo>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    let mut models: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut adapters: Vec<(String, String)> = Vec::new();
    for m in data {
        let Some(id) = m.get("id").and_then(|i| i.as_str()) else {
            continue;
        };
        match m.get("parent").and_then(|p| p.as_str()) {
            Some(parent) if parent != id => adapters.push((parent.to_string(), id.to_string())),
            _ => {
                models.entry(id.to_string()).or_default();
            }
        }
    }
    for (parent, id) in adapters {
        models.entry(parent).or_default().push(id);
    }
    Some(
        models
            .into_iter()
            .map(|(name, adapters)| ModelInfo {
                name,
                version: String::new(),
                adapters,
            })
            .collect(),
    )
}

/// The `model-server` source.
#[derive(Debug)]
pub struct ModelServerSource {
    opts: ModelServerOptions,
    client: reqwest::Client,
    tracker: InferenceTracker,
    last_engine: Option<EngineKind>,
    models_cache: Option<Vec<ModelInfo>>,
    models_checked: Option<Instant>,
}

impl ModelServerSource {
    /// Builds the source; fails only if the HTTP client cannot be built or an URL is invalid.
    pub fn new(opts: ModelServerOptions) -> Result<Self, SourceError> {
        for (field, url) in [
            ("metrics_url", Some(&opts.metrics_url)),
            ("models_url", opts.models_url.as_ref()),
        ] {
            if let Some(u) = url {
                if reqwest::Url::parse(u).is_err() {
                    return Err(SourceError::Other {
                        source_name: NAME,
                        detail: format!("{field}: invalid URL {u:?}"),
                    });
                }
            }
        }
        let client = reqwest::Client::builder()
            .timeout(opts.timeout)
            .connect_timeout(opts.timeout)
            .build()
            .map_err(|e| SourceError::Other {
                source_name: NAME,
                detail: format!("HTTP client: {e}"),
            })?;
        Ok(Self {
            tracker: InferenceTracker::new(
                opts.window,
                opts.rate_window,
                opts.queue_capacity,
                opts.kv_capacity_tokens,
            )
            .with_recent_window(opts.recent_window),
            opts,
            client,
            last_engine: None,
            models_cache: None,
            models_checked: None,
        })
    }

    async fn fetch(&self, url: &str) -> Result<Vec<u8>, SourceError> {
        fetch(&self.client, NAME, url).await
    }

    async fn refresh_models(&mut self, now: Instant) {
        let Some(url) = self.opts.models_url.clone() else {
            return;
        };
        let due = match self.models_checked {
            None => true,
            Some(t) => now.saturating_duration_since(t) >= self.opts.models_refresh,
        };
        if !due {
            return;
        }
        self.models_checked = Some(now);
        // A failure keeps the cached list: the model list rarely changes, and a server that
        // serves metrics but not /v1/models (Triton's metrics port) must not fail the sample.
        if let Ok(body) = self.fetch(&url).await {
            if let Some(models) = parse_models(&body).filter(|m| !m.is_empty()) {
                self.models_cache = Some(models);
            }
        }
    }

    /// The models to report: `/v1/models`, else the configured names, else the page's labels.
    fn models(&self, x: &Extracted) -> Option<Vec<ModelInfo>> {
        if let Some(m) = &self.models_cache {
            return Some(m.clone());
        }
        if !self.opts.model_names.is_empty() {
            return Some(
                self.opts
                    .model_names
                    .iter()
                    .map(|n| ModelInfo {
                        name: n.clone(),
                        ..Default::default()
                    })
                    .collect(),
            );
        }
        if x.models.is_empty() {
            return None;
        }
        Some(
            x.models
                .iter()
                .map(|(name, version)| ModelInfo {
                    name: name.clone(),
                    version: version.clone(),
                    adapters: Vec::new(),
                })
                .collect(),
        )
    }

    /// One sample from a page's text, at `now` (the pure part of `sample`).
    pub fn sample_page(&mut self, now: Instant, text: &str) -> Result<Reading, SourceError> {
        let page = prometheus::parse(text).map_err(|e| SourceError::Malformed {
            source_name: NAME,
            line: e.line,
            detail: e.detail,
        })?;
        let kind = match self.opts.engine {
            Some(k) => k,
            None => engines::detect(&page).ok_or_else(|| SourceError::Other {
                source_name: NAME,
                detail: format!(
                    "cannot detect the engine at {}: no metric named vllm:*, sglang:*, tgi_* or nv_* \
                     (set the engine explicitly)",
                    self.opts.metrics_url
                ),
            })?,
        };
        if self.last_engine != Some(kind) {
            self.tracker.reset();
            self.last_engine = Some(kind);
        }
        let x = engines::extract(kind, &page);
        if !x.found_any {
            return Err(SourceError::Other {
                source_name: NAME,
                detail: format!(
                    "no {kind} metrics at {} (detected: {})",
                    self.opts.metrics_url,
                    engines::detect(&page).map_or("none".to_string(), |k| k.to_string())
                ),
            });
        }
        let inference = self.tracker.update(now, &x);
        let mut rejected: Vec<Rejected> = page
            .issues
            .iter()
            .map(|i| Rejected {
                field: i.metric.clone(),
                value: i.value.clone(),
                reason: format!("line {}: {}", i.line, i.reason),
            })
            .collect();
        rejected.extend(x.rejected.iter().cloned());
        Ok(Reading {
            gpus: None,
            inference: Some(inference),
            engine: Some(kind.proto()),
            models: self.models(&x),
            rejected,
        })
    }
}

/// GET `url`, mapping failures to `SourceError` (connect/timeout, HTTP status, oversize body).
pub(crate) async fn fetch(
    client: &reqwest::Client,
    source_name: &'static str,
    url: &str,
) -> Result<Vec<u8>, SourceError> {
    let connect = |e: reqwest::Error| SourceError::Connect {
        source_name,
        target: url.to_string(),
        detail: error_chain(&e),
    };
    let mut resp = client.get(url).send().await.map_err(connect)?;
    let status = resp.status();
    if !status.is_success() {
        return Err(SourceError::HttpStatus {
            source_name,
            target: url.to_string(),
            status: status.as_u16(),
        });
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(connect)? {
        if body.len() + chunk.len() > MAX_PAGE_BYTES {
            return Err(SourceError::Other {
                source_name,
                detail: format!("{url}: response larger than {MAX_PAGE_BYTES} bytes"),
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let cs = c.to_string();
        if !s.contains(&cs) {
            s.push_str(": ");
            s.push_str(&cs);
        }
        cur = c.source();
    }
    s
}

#[async_trait::async_trait]
impl Source for ModelServerSource {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn sample(&mut self, now: Instant) -> Result<Reading, SourceError> {
        let url = self.opts.metrics_url.clone();
        let body = self.fetch(&url).await?;
        let text = std::str::from_utf8(&body).map_err(|e| SourceError::Malformed {
            source_name: NAME,
            line: 1 + body[..e.valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count(),
            detail: "page is not UTF-8".into(),
        })?;
        self.refresh_models(now).await;
        self.sample_page(now, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_cover_the_rate_window_not_the_quantile_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = InferenceTracker::new(s(10), s(2), None, None);
        let page = |finished: f64, errors: f64| Extracted {
            finished_total: Some(finished),
            errors_total: Some(errors),
            ..Extracted::default()
        };
        t.update(t0, &page(100.0, 0.0));
        t.update(t0 + s(4), &page(140.0, 0.0));
        // 4 s of successes, then one second in which 10 finished and 5 failed: over the 2 s
        // rate window that is 50 % errors, where the 10 s window would show 5 of 50.
        let st = t.update(t0 + s(5), &page(150.0, 5.0));
        assert_eq!(st.error_rate, Some(0.5));
        assert_eq!(st.request_rate, Some(10.0));
        assert_eq!(st.rate_window_ms, 1000);
        // The counters themselves travel too (the filter's evidence test takes their increase).
        assert_eq!(
            (st.finished_total, st.errors_total),
            (Some(150.0), Some(5.0))
        );
        // Failures without a count of finished requests are no count.
        let lone = t.update(
            t0 + s(6),
            &Extracted {
                errors_total: Some(6.0),
                ..Extracted::default()
            },
        );
        assert_eq!((lone.finished_total, lone.errors_total), (None, None));
    }

    #[test]
    fn prefix_hit_rate_is_the_counters_delta_over_the_rate_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = InferenceTracker::new(s(10), s(2), None, None);
        let page = |queries: f64, hits: f64| Extracted {
            prefix_queries_total: Some(queries),
            prefix_hits_total: Some(hits),
            ..Extracted::default()
        };
        assert_eq!(t.update(t0, &page(1000.0, 0.0)).prefix_cache_hit_rate, None);
        // 300 queried, 0 hit; then a repeated prompt: 300 queried, 288 hit.
        let r = t
            .update(t0 + s(1), &page(1300.0, 0.0))
            .prefix_cache_hit_rate;
        assert_eq!(r, Some(0.0));
        let r = t
            .update(t0 + s(2), &page(1600.0, 288.0))
            .prefix_cache_hit_rate;
        assert_eq!(r, Some(288.0 / 600.0));
        // Lifetime totals do not count: 2 s later only the last window's delta.
        let r = t
            .update(t0 + s(4), &page(1900.0, 576.0))
            .prefix_cache_hit_rate;
        assert_eq!(r, Some(576.0 / 600.0));
        // No queries in the window: absent, not 0.
        let r = t
            .update(t0 + s(7), &page(1900.0, 576.0))
            .prefix_cache_hit_rate;
        assert_eq!(r, None);
        // A server without the counters: absent.
        let r = t
            .update(t0 + s(8), &Extracted::default())
            .prefix_cache_hit_rate;
        assert_eq!(r, None);
    }

    #[test]
    fn recent_inter_token_latency_shows_a_slowdown_the_long_window_hides() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut t =
            InferenceTracker::new(Duration::from_secs(10), Duration::from_secs(5), None, None)
                .with_recent_window(ms(250));
        // Buckets 10 ms, 50 ms, +Inf (in ms, as the engines' extraction gives them);
        // cumulative counts.
        let page = |fast: f64, slow: f64| Extracted {
            inter_token: Some(
                HistogramSnapshot::from_buckets(vec![
                    (10.0, fast),
                    (50.0, fast + slow),
                    (f64::INFINITY, fast + slow),
                ])
                .unwrap(),
            ),
            ..Extracted::default()
        };
        // 10 s of 1 000 fast tokens a second, scraped every 50 ms, then 300 ms of slow ones
        // at a fifth of the rate.
        let mut fast = 0.0;
        let mut st = InferenceStats::default();
        for i in 0..=200u64 {
            st = t.update(t0 + ms(50 * i), &page(fast, 0.0));
            fast += 50.0;
        }
        let before = st.inter_token_recent.unwrap();
        assert!(before.p50_ms.unwrap() <= 10.0, "{before:?}");
        let mut slow = 0.0;
        for i in 1..=6u64 {
            slow += 10.0;
            st = t.update(t0 + ms(10_000 + 50 * i), &page(fast, slow));
        }
        let recent = st.inter_token_recent.unwrap();
        assert!(recent.p50_ms.unwrap() > 10.0, "{recent:?}");
        assert_eq!(recent.samples, 50);
        assert_eq!(st.recent_window_ms, 250);
        let long = st.inter_token.unwrap();
        assert!(long.p50_ms.unwrap() <= 10.0, "{long:?}");
    }

    #[test]
    fn models_list_groups_adapters_under_parent() {
        let body = br#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B","object":"model","parent":null},
            {"id":"sql-lora","object":"model","parent":"meta-llama/Llama-3.1-8B"}]}"#;
        let m = parse_models(body).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].name, "meta-llama/Llama-3.1-8B");
        assert_eq!(m[0].adapters, vec!["sql-lora".to_string()]);
        assert_eq!(parse_models(b"not json"), None);
    }

    #[test]
    fn options_accept_a_base_or_the_metrics_url() {
        for url in ["http://h:8000", "http://h:8000/", "http://h:8000/metrics"] {
            let o = ModelServerOptions::new(url);
            assert_eq!(o.metrics_url, "http://h:8000/metrics", "{url}");
            assert_eq!(
                o.models_url.as_deref(),
                Some("http://h:8000/v1/models"),
                "{url}"
            );
        }
    }

    #[test]
    fn undetectable_page_is_an_error() {
        let mut s = ModelServerSource::new(ModelServerOptions::new("http://127.0.0.1:1")).unwrap();
        let e = s.sample_page(Instant::now(), "up 1\n").unwrap_err();
        assert!(e.to_string().contains("cannot detect the engine"), "{e}");
        let e = s.sample_page(Instant::now(), "up{ 1\n").unwrap_err();
        assert!(matches!(e, SourceError::Malformed { line: 1, .. }), "{e}");
    }
}
