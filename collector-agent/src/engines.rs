//! Decides which engine serves the pod and which of its metric names carry each signal (vLLM V1
//! with its older names, SGLang, TGI, Triton/TRT-LLM, as each project documents them; table in
//! ENVOY_FACTS.md "Model servers' own metrics"), and turns one scraped page into unit-normalised
//! values: times in ms, ratios in 0..1. Several `model_name` series are summed for counts and
//! histograms; for ratios (KV-cache use) the highest is kept, because ratios do not add.
//!
//! KV-cache capacity in tokens: vLLM states it in the labels of its info metric
//! `vllm:cache_config_info` (`num_gpu_blocks` × `block_size`; vllm/v1/metrics/loggers.py
//! `log_metrics_info`), SGLang as the gauge `sglang:max_total_num_tokens`
//! (sglang/srt/metrics/collector.py); TGI and Triton are not read for it (the operator's
//! `--kv-capacity-tokens` covers them). One pod runs one engine, so when several series carry
//! the capacity (one per data-parallel `engine` or TP rank) the first valid one in page order
//! is taken, not their sum.

use crate::prometheus::{parse_float, Exposition, Sample};
use crate::sources::Rejected;
use crate::window::HistogramSnapshot;
use ai_lb_proto::v1::Engine;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// An engine whose metric names we know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    Vllm,
    Sglang,
    Tgi,
    Triton,
}

impl EngineKind {
    pub const ALL: [EngineKind; 4] = [Self::Vllm, Self::Sglang, Self::Tgi, Self::Triton];

    pub fn proto(self) -> Engine {
        match self {
            Self::Vllm => Engine::Vllm,
            Self::Sglang => Engine::Sglang,
            Self::Tgi => Engine::Tgi,
            Self::Triton => Engine::Triton,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Tgi => "tgi",
            Self::Triton => "triton",
        }
    }

    /// The metric-name prefix that identifies the engine on a page.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Vllm => "vllm:",
            Self::Sglang => "sglang:",
            Self::Tgi => "tgi_",
            Self::Triton => "nv_",
        }
    }

    fn spec(self) -> &'static EngineSpec {
        match self {
            Self::Vllm => &VLLM,
            Self::Sglang => &SGLANG,
            Self::Tgi => &TGI,
            Self::Triton => &TRITON,
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine name that is not one of `vllm`, `sglang`, `tgi`, `triton`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine: unknown value {0:?} (expected one of vllm, sglang, tgi, triton)")]
pub struct UnknownEngine(pub String);

impl FromStr for EngineKind {
    type Err = UnknownEngine;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "tgi" => Ok(Self::Tgi),
            "triton" | "trtllm" | "trt-llm" | "tensorrt-llm" => Ok(Self::Triton),
            _ => Err(UnknownEngine(s.to_string())),
        }
    }
}

/// Picks the engine from the metric-name prefixes present: the prefix with the most samples
/// wins (a Triton page also carries `nv_gpu_*`, a vLLM page never carries `nv_`); `None` when
/// no known prefix appears.
pub fn detect(page: &Exposition<'_>) -> Option<EngineKind> {
    let mut counts = [0usize; 4];
    for s in &page.samples {
        for (i, k) in EngineKind::ALL.iter().enumerate() {
            if s.name.starts_with(k.prefix()) {
                counts[i] += 1;
            }
        }
    }
    let (i, &n) = counts.iter().enumerate().max_by_key(|(_, n)| **n)?;
    (n > 0).then_some(EngineKind::ALL[i])
}

/// A metric name, optionally restricted to series whose label has one of the given values.
#[derive(Debug)]
struct Sel {
    name: &'static str,
    label: Option<(&'static str, &'static [&'static str])>,
}

impl Sel {
    const fn name(name: &'static str) -> Self {
        Self { name, label: None }
    }
    const fn with(
        name: &'static str,
        label: &'static str,
        values: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            label: Some((label, values)),
        }
    }
    fn matches(&self, s: &Sample<'_>) -> bool {
        s.name == self.name
            && match self.label {
                None => true,
                Some((l, vals)) => s.label(l).is_some_and(|v| vals.contains(&v)),
            }
    }
    fn field(&self) -> String {
        match self.label {
            None => self.name.to_string(),
            Some((l, v)) => format!("{}{{{l}=\"{}\"}}", self.name, v.join("|")),
        }
    }
}

/// Where an engine states its KV-cache capacity in tokens.
#[derive(Debug)]
enum KvCapacity {
    /// Not read from the page.
    Unknown,
    /// A gauge whose value is the capacity in tokens.
    Tokens(&'static str),
    /// An info metric (value 1) whose labels give the number of GPU blocks and the tokens per
    /// block; capacity = blocks × block size.
    BlockLabels {
        name: &'static str,
        blocks: &'static str,
        block_size: &'static str,
    },
}

/// A histogram family and the factor that converts its unit to ms.
#[derive(Debug)]
struct Hist {
    name: &'static str,
    to_ms: f64,
}

#[derive(Debug)]
struct EngineSpec {
    /// Alternatives, current name first: the first with any series on the page is used.
    waiting: &'static [Sel],
    running: &'static [Sel],
    kv_cache: &'static [Sel],
    queue_capacity: &'static [Sel],
    kv_capacity: KvCapacity,
    ttft: &'static [Hist],
    e2e: &'static [Hist],
    inter_token: &'static [Hist],
    /// Series summed into "requests finished".
    finished: &'static [Sel],
    /// Series summed into "requests that failed".
    errors: &'static [Sel],
    /// Whether a missing error series means 0 errors while `finished` is present (the engine
    /// creates the series only on the first failure) rather than "unknown".
    errors_zero_when_missing: bool,
    /// Prefix-cache counters in prompt tokens: (hits, queries), alternatives current name
    /// first (the first with any series is used, never their sum: vLLM exports the deprecated
    /// `gpu_` names beside the current ones with the same values).
    prefix_hits: &'static [Sel],
    prefix_queries: &'static [Sel],
    /// How series of a count (waiting, running) combine: summed over models, or the largest
    /// (Triton repeats a request in the ensemble and in each composing model).
    counts: Combine,
    /// Take finished/error counters from the busiest model only, not their sum (Triton
    /// ensembles count one request once per composing model).
    counters_from_busiest_model: bool,
    /// The label naming the model, and the one naming its version.
    model_label: Option<&'static str>,
    version_label: Option<&'static str>,
}

const S: f64 = 1000.0;

static VLLM: EngineSpec = EngineSpec {
    waiting: &[Sel::name("vllm:num_requests_waiting")],
    running: &[Sel::name("vllm:num_requests_running")],
    kv_cache: &[
        Sel::name("vllm:kv_cache_usage_perc"),
        Sel::name("vllm:gpu_cache_usage_perc"),
    ],
    queue_capacity: &[],
    kv_capacity: KvCapacity::BlockLabels {
        name: "vllm:cache_config_info",
        blocks: "num_gpu_blocks",
        block_size: "block_size",
    },
    ttft: &[Hist {
        name: "vllm:time_to_first_token_seconds",
        to_ms: S,
    }],
    e2e: &[Hist {
        name: "vllm:e2e_request_latency_seconds",
        to_ms: S,
    }],
    inter_token: &[
        Hist {
            name: "vllm:inter_token_latency_seconds",
            to_ms: S,
        },
        Hist {
            name: "vllm:time_per_output_token_seconds",
            to_ms: S,
        },
    ],
    finished: &[Sel::name("vllm:request_success_total")],
    errors: &[Sel::with(
        "vllm:request_success_total",
        "finished_reason",
        &["abort", "error"],
    )],
    errors_zero_when_missing: true,
    // vllm/v1/metrics/loggers.py: counters `vllm:prefix_cache_hits` / `_queries` (tokens),
    // deprecated `vllm:gpu_prefix_cache_*` before 0.10.
    prefix_hits: &[
        Sel::name("vllm:prefix_cache_hits_total"),
        Sel::name("vllm:gpu_prefix_cache_hits_total"),
    ],
    prefix_queries: &[
        Sel::name("vllm:prefix_cache_queries_total"),
        Sel::name("vllm:gpu_prefix_cache_queries_total"),
    ],
    counts: Combine::Sum,
    counters_from_busiest_model: false,
    model_label: Some("model_name"),
    version_label: None,
};

static SGLANG: EngineSpec = EngineSpec {
    waiting: &[Sel::name("sglang:num_queue_reqs")],
    running: &[Sel::name("sglang:num_running_reqs")],
    kv_cache: &[Sel::name("sglang:token_usage")],
    // SGLang exports no hard cap on running requests (its `max_running_requests_under_SLO` is
    // an SLO estimate with no setter in the scheduler); `--queue-capacity` covers it.
    queue_capacity: &[],
    kv_capacity: KvCapacity::Tokens("sglang:max_total_num_tokens"),
    ttft: &[Hist {
        name: "sglang:time_to_first_token_seconds",
        to_ms: S,
    }],
    e2e: &[Hist {
        name: "sglang:e2e_request_latency_seconds",
        to_ms: S,
    }],
    inter_token: &[
        Hist {
            name: "sglang:inter_token_latency_seconds",
            to_ms: S,
        },
        Hist {
            name: "sglang:time_per_output_token_seconds",
            to_ms: S,
        },
    ],
    finished: &[Sel::name("sglang:num_requests_total")],
    errors: &[Sel::name("sglang:num_aborted_requests_total")],
    errors_zero_when_missing: false,
    // SGLang's equivalent: prompt tokens served from its radix cache (every `cache_source`:
    // device, host, storage) over prompt tokens, both counters. Its `sglang:cache_hit_rate`
    // gauge is a ratio over the scheduler's last log interval, not windowable.
    prefix_hits: &[Sel::name("sglang:cached_tokens_total")],
    prefix_queries: &[Sel::name("sglang:prompt_tokens_total")],
    counts: Combine::Sum,
    counters_from_busiest_model: false,
    model_label: Some("model_name"),
    version_label: None,
};

static TGI: EngineSpec = EngineSpec {
    waiting: &[Sel::name("tgi_queue_size")],
    running: &[Sel::name("tgi_batch_current_size")],
    kv_cache: &[],
    queue_capacity: &[],
    kv_capacity: KvCapacity::Unknown,
    ttft: &[],
    e2e: &[Hist {
        name: "tgi_request_duration",
        to_ms: S,
    }],
    inter_token: &[Hist {
        name: "tgi_request_mean_time_per_token_duration",
        to_ms: S,
    }],
    finished: &[
        Sel::name("tgi_request_success"),
        Sel::name("tgi_request_failure"),
    ],
    errors: &[Sel::name("tgi_request_failure")],
    errors_zero_when_missing: true,
    // TGI exports no prefix-cache counter.
    prefix_hits: &[],
    prefix_queries: &[],
    counts: Combine::Sum,
    counters_from_busiest_model: false,
    model_label: None,
    version_label: None,
};

static TRITON: EngineSpec = EngineSpec {
    waiting: &[
        Sel::with("nv_trt_llm_request_metrics", "request_type", &["waiting"]),
        Sel::name("nv_inference_pending_request_count"),
    ],
    running: &[Sel::with(
        "nv_trt_llm_request_metrics",
        "request_type",
        &["scheduled"],
    )],
    kv_cache: &[Sel::with(
        "nv_trt_llm_kv_cache_block_metrics",
        "kv_cache_block_type",
        &["fraction"],
    )],
    queue_capacity: &[Sel::with(
        "nv_trt_llm_request_metrics",
        "request_type",
        &["max"],
    )],
    kv_capacity: KvCapacity::Unknown,
    ttft: &[Hist {
        name: "nv_inference_first_response_histogram_ms",
        to_ms: 1.0,
    }],
    // A counter of total µs by default (no quantiles from it); used only when a build exposes it
    // as a histogram.
    e2e: &[Hist {
        name: "nv_inference_request_duration_us",
        to_ms: 0.001,
    }],
    inter_token: &[],
    finished: &[
        Sel::name("nv_inference_request_success"),
        Sel::name("nv_inference_request_failure"),
    ],
    errors: &[Sel::name("nv_inference_request_failure")],
    errors_zero_when_missing: true,
    // Triton's TensorRT-LLM metrics state KV blocks (used, free, max), no reuse counter.
    prefix_hits: &[],
    prefix_queries: &[],
    counts: Combine::Max,
    counters_from_busiest_model: true,
    model_label: Some("model"),
    version_label: Some("version"),
};

/// One page's values for one engine, in ms and 0..1, with what was refused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Extracted {
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    pub kv_cache_usage: Option<f64>,
    pub queue_capacity: Option<u32>,
    /// KV-cache capacity in tokens, as the engine states it.
    pub kv_capacity_tokens: Option<u64>,
    /// Cumulative histograms with bounds in ms.
    pub ttft: Option<HistogramSnapshot>,
    pub e2e: Option<HistogramSnapshot>,
    pub inter_token: Option<HistogramSnapshot>,
    /// Cumulative count of finished requests (all outcomes).
    pub finished_total: Option<f64>,
    /// Cumulative count of failed requests.
    pub errors_total: Option<f64>,
    /// Cumulative prompt tokens found in the prefix cache.
    pub prefix_hits_total: Option<f64>,
    /// Cumulative prompt tokens looked up in the prefix cache.
    pub prefix_queries_total: Option<f64>,
    /// Served models `(name, version)` from the series' labels, sorted, deduplicated.
    pub models: Vec<(String, String)>,
    pub rejected: Vec<Rejected>,
    /// Whether any of the engine's known signals was on the page.
    pub found_any: bool,
}

/// Reads the engine's signals from a parsed page.
pub fn extract(kind: EngineKind, page: &Exposition<'_>) -> Extracted {
    let spec = kind.spec();
    let mut x = Extracted::default();

    let waiting = sum_gauge(page, spec.waiting, spec.counts);
    let running = sum_gauge(page, spec.running, spec.counts);
    let capacity = sum_gauge(page, spec.queue_capacity, spec.counts);
    let had_counts = waiting.is_some() || running.is_some();
    x.waiting = count_value(waiting, &mut x.rejected);
    x.running = count_value(running, &mut x.rejected);
    x.queue_capacity = count_value(capacity, &mut x.rejected);
    if let Some((field, v)) = sum_gauge(page, spec.kv_cache, Combine::Max) {
        if (0.0..=1.0).contains(&v) {
            x.kv_cache_usage = Some(v);
        } else {
            x.rejected
                .push(reject(field, v, "KV-cache usage outside 0..1"));
        }
    }
    x.kv_capacity_tokens = kv_capacity(page, &spec.kv_capacity, &mut x.rejected);
    x.ttft = histogram(page, spec.ttft, &mut x.rejected);
    x.e2e = histogram(page, spec.e2e, &mut x.rejected);
    x.inter_token = histogram(page, spec.inter_token, &mut x.rejected);

    let busiest = match (spec.counters_from_busiest_model, spec.model_label) {
        (true, Some(ml)) => busiest_model(page, spec.finished, ml),
        _ => None,
    };
    let keep = |s: &Sample<'_>| match (&busiest, spec.model_label) {
        (Some(m), Some(ml)) => s.label(ml) == Some(m.as_str()),
        _ => true,
    };
    x.finished_total = sum_counter(page, spec.finished, &keep);
    x.errors_total = sum_counter(page, spec.errors, &keep);
    if x.errors_total.is_none() && x.finished_total.is_some() && spec.errors_zero_when_missing {
        x.errors_total = Some(0.0);
    }
    x.prefix_hits_total = first_counter(page, spec.prefix_hits, &keep);
    x.prefix_queries_total = first_counter(page, spec.prefix_queries, &keep);

    if let Some(ml) = spec.model_label {
        let mut models: Vec<(String, String)> = page
            .samples
            .iter()
            .filter(|s| s.name.starts_with(kind.prefix()))
            .filter_map(|s| {
                let name = s.label(ml)?;
                let version = spec.version_label.and_then(|vl| s.label(vl)).unwrap_or("");
                Some((name.to_string(), version.to_string()))
            })
            .filter(|(n, _)| !n.is_empty())
            .collect();
        models.sort();
        models.dedup();
        x.models = models;
    }

    x.found_any = had_counts
        || x.kv_cache_usage.is_some()
        || x.kv_capacity_tokens.is_some()
        || x.ttft.is_some()
        || x.e2e.is_some()
        || x.inter_token.is_some()
        || x.finished_total.is_some()
        || !x.rejected.is_empty();
    x
}

fn reject(field: String, v: f64, reason: &str) -> Rejected {
    Rejected {
        field,
        value: v.to_string(),
        reason: reason.to_string(),
    }
}

#[derive(Debug, Clone, Copy)]
enum Combine {
    Sum,
    Max,
}

/// The first alternative with any series on the page, combined over its series.
fn sum_gauge(page: &Exposition<'_>, alts: &[Sel], how: Combine) -> Option<(String, f64)> {
    for sel in alts {
        let mut acc: Option<f64> = None;
        for s in page.samples.iter().filter(|s| sel.matches(s)) {
            acc = Some(match (acc, how) {
                (None, _) => s.value,
                (Some(a), Combine::Sum) => a + s.value,
                (Some(a), Combine::Max) => a.max(s.value),
            });
        }
        if let Some(v) = acc {
            return Some((sel.field(), v));
        }
    }
    None
}

/// A request count: non-negative, fits u32; fractions are rounded.
fn count_value(v: Option<(String, f64)>, rejected: &mut Vec<Rejected>) -> Option<u32> {
    let (field, v) = v?;
    if v < 0.0 {
        rejected.push(reject(field, v, "negative request count"));
        None
    } else if v > f64::from(u32::MAX) {
        rejected.push(reject(field, v, "request count too large"));
        None
    } else {
        Some(v.round() as u32)
    }
}

/// The KV-cache capacity in tokens from the first valid series in page order; every invalid
/// series seen (zero, fractional or unparsable value, missing label) is rejected by name.
fn kv_capacity(
    page: &Exposition<'_>,
    how: &KvCapacity,
    rejected: &mut Vec<Rejected>,
) -> Option<u64> {
    let mut found = None;
    match *how {
        KvCapacity::Unknown => {}
        KvCapacity::Tokens(name) => {
            for s in page.samples_named(name) {
                // Exact in f64 up to 2^53; no KV cache comes near.
                let v = s.value;
                if v >= 1.0 && v.fract() == 0.0 && v <= 9_007_199_254_740_992.0 {
                    found = found.or(Some(v as u64));
                } else {
                    rejected.push(Rejected {
                        field: name.to_string(),
                        value: v.to_string(),
                        reason: format!(
                            "line {}: KV-cache capacity must be a positive whole number of tokens",
                            s.line
                        ),
                    });
                }
            }
        }
        KvCapacity::BlockLabels {
            name,
            blocks,
            block_size,
        } => {
            for s in page.samples_named(name) {
                let n = positive_label(s, name, blocks, rejected);
                let size = positive_label(s, name, block_size, rejected);
                let (Some(n), Some(size)) = (n, size) else {
                    continue;
                };
                match n.checked_mul(size) {
                    Some(tokens) => found = found.or(Some(tokens)),
                    None => rejected.push(Rejected {
                        field: format!("{name}{{{blocks}}}"),
                        value: n.to_string(),
                        reason: format!(
                            "line {}: {blocks} x {block_size} ({size}) overflows u64",
                            s.line
                        ),
                    }),
                }
            }
        }
    }
    found
}

/// Label `label` of `s` as a positive integer, or a rejection naming `metric{label}` and the
/// label's text.
fn positive_label(
    s: &Sample<'_>,
    metric: &str,
    label: &str,
    rejected: &mut Vec<Rejected>,
) -> Option<u64> {
    let text = s.label(label);
    match text.map(|t| t.trim().parse::<u64>()) {
        Some(Ok(n)) if n > 0 => Some(n),
        _ => {
            rejected.push(Rejected {
                field: format!("{metric}{{{label}}}"),
                value: text.unwrap_or("").to_string(),
                reason: match text {
                    None => format!("line {}: label {label} missing", s.line),
                    Some(_) => format!("line {}: {label} must be a positive integer", s.line),
                },
            });
            None
        }
    }
}

/// The model (label `ml`) with the most finished requests; ties go to the first name.
fn busiest_model(page: &Exposition<'_>, finished: &[Sel], ml: &str) -> Option<String> {
    let mut per: BTreeMap<&str, f64> = BTreeMap::new();
    for sel in finished {
        for s in page.samples.iter().filter(|s| sel.matches(s)) {
            if let Some(m) = s.label(ml) {
                *per.entry(m).or_default() += s.value;
            }
        }
    }
    let mut best: Option<(&str, f64)> = None;
    for (m, v) in per {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((m, v));
        }
    }
    best.map(|(m, _)| m.to_string())
}

fn sum_counter(
    page: &Exposition<'_>,
    sels: &[Sel],
    keep: &dyn Fn(&Sample<'_>) -> bool,
) -> Option<f64> {
    let mut acc: Option<f64> = None;
    for sel in sels {
        for s in page.samples.iter().filter(|s| sel.matches(s) && keep(s)) {
            acc = Some(acc.unwrap_or(0.0) + s.value);
        }
    }
    // With a label filter (vLLM's finished_reason), the family being present means the matching
    // sum is 0, not unknown.
    if acc.is_none()
        && sels
            .iter()
            .any(|sel| sel.label.is_some() && page.samples.iter().any(|s| s.name == sel.name))
    {
        acc = Some(0.0);
    }
    acc
}

/// The first alternative with any series on the page, summed over its series.
fn first_counter(
    page: &Exposition<'_>,
    alts: &[Sel],
    keep: &dyn Fn(&Sample<'_>) -> bool,
) -> Option<f64> {
    alts.iter()
        .find(|sel| page.samples.iter().any(|s| sel.matches(s)))
        .and_then(|sel| sum_counter(page, std::slice::from_ref(sel), keep))
}

/// A histogram series' identity: its labels other than `le`, in page order (the `_bucket`
/// samples of one series and its `_sum` share it).
fn series_key(labels: &[(&str, Cow<'_, str>)]) -> String {
    labels
        .iter()
        .filter(|(k, _)| *k != "le")
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The first alternative with `_bucket` series on the page: each series (labels other than `le`)
/// validated, then summed, bounds converted to ms.
fn histogram(
    page: &Exposition<'_>,
    alts: &[Hist],
    rejected: &mut Vec<Rejected>,
) -> Option<HistogramSnapshot> {
    for h in alts {
        let bucket = format!("{}_bucket", h.name);
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        let mut bad_le = false;
        for s in page.samples_named(&bucket) {
            let Some(le) = s.label("le").and_then(parse_float) else {
                rejected.push(Rejected {
                    field: bucket.clone(),
                    value: s.label("le").unwrap_or("").to_string(),
                    reason: format!("line {}: bucket without a numeric le label", s.line),
                });
                bad_le = true;
                continue;
            };
            series
                .entry(series_key(&s.labels))
                .or_default()
                .push((le, s.value));
        }
        // A bucket dropped by the parser (NaN, negative) leaves the histogram incomplete.
        let parser_dropped = page.issues.iter().any(|i| i.metric == bucket);
        if series.is_empty() && !parser_dropped {
            continue;
        }
        if bad_le || parser_dropped {
            rejected.push(Rejected {
                field: h.name.to_string(),
                value: String::new(),
                reason: "histogram has invalid buckets; left out".into(),
            });
            return None;
        }
        // Each series' `_sum` (same labels), for the windowed mean.
        let sum_name = format!("{}_sum", h.name);
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        for s in page.samples_named(&sum_name) {
            sums.insert(series_key(&s.labels), s.value);
        }
        let mut total: Option<HistogramSnapshot> = None;
        for (key, buckets) in series {
            let sum = sums.get(&key).copied();
            let snap = match HistogramSnapshot::from_buckets(buckets) {
                Ok(s) => s.with_sum(sum),
                Err(e) => {
                    rejected.push(Rejected {
                        field: format!("{}{{{key}}}", h.name),
                        value: String::new(),
                        reason: e,
                    });
                    return None;
                }
            };
            match &mut total {
                None => total = Some(snap),
                Some(t) => {
                    if let Err(e) = t.add(&snap) {
                        rejected.push(Rejected {
                            field: h.name.to_string(),
                            value: String::new(),
                            reason: e,
                        });
                        return None;
                    }
                }
            }
        }
        return total.map(|t| t.scaled(h.to_ms));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prometheus::parse;

    #[test]
    fn detects_by_prefix() {
        let p = parse("vllm:num_requests_waiting 1\n").unwrap();
        assert_eq!(detect(&p), Some(EngineKind::Vllm));
        let p = parse("nv_gpu_utilization 1\nnv_inference_count 2\ntgi_queue_size 0\n").unwrap();
        assert_eq!(detect(&p), Some(EngineKind::Triton));
        let p = parse("process_cpu_seconds_total 1\n").unwrap();
        assert_eq!(detect(&p), None);
    }

    #[test]
    fn engine_names_parse_with_clear_error() {
        assert_eq!("vLLM".parse::<EngineKind>(), Ok(EngineKind::Vllm));
        let e = "llama.cpp".parse::<EngineKind>().unwrap_err();
        assert!(e.to_string().contains("\"llama.cpp\""), "{e}");
    }

    #[test]
    fn several_models_are_summed_and_ratios_maxed() {
        let p = parse(
            "vllm:num_requests_waiting{model_name=\"a\"} 2\n\
             vllm:num_requests_waiting{model_name=\"b\"} 3\n\
             vllm:kv_cache_usage_perc{model_name=\"a\"} 0.2\n\
             vllm:kv_cache_usage_perc{model_name=\"b\"} 0.7\n",
        )
        .unwrap();
        let x = extract(EngineKind::Vllm, &p);
        assert_eq!(x.waiting, Some(5));
        assert_eq!(x.kv_cache_usage, Some(0.7));
        assert_eq!(
            x.models,
            vec![("a".into(), "".into()), ("b".into(), "".into())]
        );
    }

    #[test]
    fn prefix_cache_counters_take_the_current_name_not_the_sum() {
        // vLLM exports the deprecated gpu_ names beside the current ones, same values.
        let p = parse(
            "vllm:prefix_cache_queries_total{model_name=\"m\"} 600\n\
             vllm:prefix_cache_hits_total{model_name=\"m\"} 288\n\
             vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 600\n\
             vllm:gpu_prefix_cache_hits_total{model_name=\"m\"} 288\n",
        )
        .unwrap();
        let x = extract(EngineKind::Vllm, &p);
        assert_eq!(
            (x.prefix_queries_total, x.prefix_hits_total),
            (Some(600.0), Some(288.0))
        );
        // An older vLLM with only the gpu_ names.
        let p = parse("vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 10\n").unwrap();
        assert_eq!(
            extract(EngineKind::Vllm, &p).prefix_queries_total,
            Some(10.0)
        );
        assert_eq!(extract(EngineKind::Vllm, &p).prefix_hits_total, None);
        // SGLang: cached tokens of every source over prompt tokens.
        let p = parse(
            "sglang:prompt_tokens_total{model_name=\"m\"} 4096\n\
             sglang:cached_tokens_total{model_name=\"m\",cache_source=\"device\"} 3000\n\
             sglang:cached_tokens_total{model_name=\"m\",cache_source=\"host\"} 168\n",
        )
        .unwrap();
        let x = extract(EngineKind::Sglang, &p);
        assert_eq!(
            (x.prefix_queries_total, x.prefix_hits_total),
            (Some(4096.0), Some(3168.0))
        );
        let p = parse("tgi_queue_size 1\n").unwrap();
        assert_eq!(extract(EngineKind::Tgi, &p).prefix_hits_total, None);
    }

    #[test]
    fn histogram_sums_are_carried_per_series_and_added() {
        let page = |sum_b: &str| {
            format!(
                "vllm:inter_token_latency_seconds_bucket{{model_name=\"a\",le=\"0.01\"}} 10\n\
                 vllm:inter_token_latency_seconds_bucket{{model_name=\"a\",le=\"+Inf\"}} 10\n\
                 vllm:inter_token_latency_seconds_sum{{model_name=\"a\"}} 0.05\n\
                 vllm:inter_token_latency_seconds_count{{model_name=\"a\"}} 10\n\
                 vllm:inter_token_latency_seconds_bucket{{model_name=\"b\",le=\"0.01\"}} 5\n\
                 vllm:inter_token_latency_seconds_bucket{{model_name=\"b\",le=\"+Inf\"}} 5\n\
                 {sum_b}"
            )
        };
        let text = page("vllm:inter_token_latency_seconds_sum{model_name=\"b\"} 0.04\n");
        let p = parse(&text).unwrap();
        let h = extract(EngineKind::Vllm, &p).inter_token.unwrap();
        assert_eq!(h.total(), 15.0);
        // Seconds to ms, both series: 50 + 40 ms.
        assert!((h.sum.unwrap() - 90.0).abs() < 1e-9, "{h:?}");
        // One series without a sum: no sum (a mean over part of the tokens would mislead).
        let text = page("");
        let p = parse(&text).unwrap();
        assert_eq!(extract(EngineKind::Vllm, &p).inter_token.unwrap().sum, None);
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        let p = parse(
            "vllm:num_requests_waiting -1\nvllm:kv_cache_usage_perc 1.5\n\
             vllm:num_requests_running 4\n",
        )
        .unwrap();
        let x = extract(EngineKind::Vllm, &p);
        assert_eq!(x.waiting, None);
        assert_eq!(x.kv_cache_usage, None);
        assert_eq!(x.running, Some(4));
        let fields: Vec<_> = x.rejected.iter().map(|r| r.field.as_str()).collect();
        assert_eq!(
            fields,
            vec!["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
        );
    }

    /// vLLM V1's info metric as prometheus_client prints it (labels sorted, value `1.0`).
    fn vllm_cache_info(block_size: &str, num_gpu_blocks: &str) -> String {
        format!(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{block_size}\",cache_dtype=\"auto\",\
             enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",\
             num_cpu_blocks=\"None\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 1.0\n"
        )
    }

    #[test]
    fn vllm_kv_capacity_is_blocks_times_block_size_from_labels() {
        let text = vllm_cache_info("16", "2048");
        let x = extract(EngineKind::Vllm, &parse(&text).unwrap());
        assert_eq!(x.kv_capacity_tokens, Some(32_768));
        assert!(x.rejected.is_empty(), "{:?}", x.rejected);
    }

    #[test]
    fn vllm_zero_blocks_is_rejected_naming_the_label() {
        let text = vllm_cache_info("16", "0");
        let x = extract(EngineKind::Vllm, &parse(&text).unwrap());
        assert_eq!(x.kv_capacity_tokens, None);
        assert_eq!(x.running, Some(1), "the rest of the page is still read");
        assert_eq!(x.rejected.len(), 1, "{:?}", x.rejected);
        assert_eq!(
            x.rejected[0].field,
            "vllm:cache_config_info{num_gpu_blocks}"
        );
        assert_eq!(x.rejected[0].value, "0");
    }

    #[test]
    fn vllm_unparsable_labels_are_rejected_not_panics() {
        // vLLM prints Python's `None` before the KV cache is profiled.
        for (bs, blocks, field, value) in [
            ("16", "None", "num_gpu_blocks", "None"),
            ("16", "-3", "num_gpu_blocks", "-3"),
            ("16", "2048.5", "num_gpu_blocks", "2048.5"),
            ("sixteen", "2048", "block_size", "sixteen"),
            ("0", "2048", "block_size", "0"),
        ] {
            let text = vllm_cache_info(bs, blocks);
            let x = extract(EngineKind::Vllm, &parse(&text).unwrap());
            assert_eq!(x.kv_capacity_tokens, None, "{bs} {blocks}");
            assert_eq!(x.rejected.len(), 1, "{bs} {blocks}: {:?}", x.rejected);
            let r = &x.rejected[0];
            assert_eq!(r.field, format!("vllm:cache_config_info{{{field}}}"));
            assert_eq!(r.value, value);
            assert!(r.reason.contains(field), "{r:?}");
        }
        let huge = vllm_cache_info("16", &u64::MAX.to_string());
        let x = extract(EngineKind::Vllm, &parse(&huge).unwrap());
        assert_eq!(x.kv_capacity_tokens, None);
        assert!(
            x.rejected[0].reason.contains("overflows"),
            "{:?}",
            x.rejected
        );
        let missing = "vllm:cache_config_info{block_size=\"16\"} 1\n";
        let x = extract(EngineKind::Vllm, &parse(missing).unwrap());
        assert_eq!(x.kv_capacity_tokens, None);
        assert_eq!(x.rejected[0].value, "");
        assert!(x.rejected[0].reason.contains("missing"), "{:?}", x.rejected);
    }

    #[test]
    fn vllm_kv_capacity_missing_is_none() {
        let p = parse("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n").unwrap();
        let x = extract(EngineKind::Vllm, &p);
        assert_eq!(x.kv_capacity_tokens, None);
        assert!(x.rejected.is_empty(), "{:?}", x.rejected);
    }

    #[test]
    fn vllm_several_engines_take_the_first_valid_series() {
        let p = parse(
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"None\"} 1\n\
             vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"100\"} 1\n\
             vllm:cache_config_info{block_size=\"16\",engine=\"2\",num_gpu_blocks=\"200\"} 1\n",
        )
        .unwrap();
        let x = extract(EngineKind::Vllm, &p);
        assert_eq!(x.kv_capacity_tokens, Some(1600), "first valid, not the sum");
        assert_eq!(x.rejected.len(), 1, "{:?}", x.rejected);
        assert!(x.found_any);
    }

    #[test]
    fn sglang_kv_capacity_is_max_total_num_tokens() {
        let p = parse(
            "# TYPE sglang:max_total_num_tokens gauge\n\
             sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"q\",tp_rank=\"0\"} 471258.0\n\
             sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"q\",tp_rank=\"1\"} 471258.0\n",
        )
        .unwrap();
        let x = extract(EngineKind::Sglang, &p);
        assert_eq!(
            x.kv_capacity_tokens,
            Some(471_258),
            "TP ranks share one pool"
        );
        assert_eq!(x.queue_capacity, None);
        assert!(x.rejected.is_empty(), "{:?}", x.rejected);

        for bad in ["0", "-5", "12.5"] {
            let text = format!("sglang:max_total_num_tokens {bad}\n");
            let p = parse(&text).unwrap();
            let x = extract(EngineKind::Sglang, &p);
            assert_eq!(x.kv_capacity_tokens, None, "{bad}");
            assert_eq!(x.rejected.len(), 1, "{bad}: {:?}", x.rejected);
            assert_eq!(x.rejected[0].field, "sglang:max_total_num_tokens");
        }
    }

    #[test]
    fn tgi_and_triton_state_no_kv_capacity() {
        let p = parse(
            "tgi_queue_size 1\nnv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\"} 9\n",
        )
        .unwrap();
        assert_eq!(extract(EngineKind::Tgi, &p).kv_capacity_tokens, None);
        assert_eq!(extract(EngineKind::Triton, &p).kv_capacity_tokens, None);
    }
}
