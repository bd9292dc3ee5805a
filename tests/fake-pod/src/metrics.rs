//! Decides what `/metrics` says: Prometheus text exposition with the vLLM V1 metric names and
//! bucket bounds (vllm/v1/metrics/loggers.py), labelled `model_name`, so the agent's vLLM
//! reader works unchanged against the fake pod. The KV-cache capacity is stated the way vLLM
//! states it: the info gauge `vllm:cache_config_info` (value 1) whose labels are the cache
//! config, `num_gpu_blocks` blocks of `block_size` tokens.

use std::fmt::Write;

use crate::kv_cache::CacheStats;

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (`vllm:e2e_request_latency_seconds`).
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative Prometheus histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let v = v.max(0.0);
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{}\"}} {}",
                float(*b),
                float(cum as f64)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}",
            float(self.count as f64)
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", float(self.sum));
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", float(self.count as f64));
    }
}

/// Formats like Python's `repr(float)` for the values we print (`1.0`, `0.25`).
fn float(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Gauges read from the engine when rendering.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gauges {
    pub waiting: u64,
    pub running: u64,
    pub kv_cache_usage: f64,
    /// Tokens per block (`--block-size`).
    pub block_size: u32,
    /// Blocks in the cache (`--kv-cache-tokens / --block-size`, floor).
    pub num_gpu_blocks: u32,
    /// `--prefix-caching`.
    pub prefix_caching: bool,
    /// Prefix-cache counters, in tokens.
    pub prefix_cache: CacheStats,
}

/// Why a request finished, as vLLM labels `finished_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens` (every completed request here, like vLLM with `ignore_eos`).
    Length,
    /// Client went away before the end.
    Abort,
    /// Injected failure (`error_rate`); not a vLLM reason, documented in README.md.
    Error,
}

/// Counters and histograms of one pod.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    finished_length: u64,
    finished_abort: u64,
    finished_error: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            finished_length: 0,
            finished_abort: 0,
            finished_error: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
        }
    }

    pub fn finished(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Length => self.finished_length += 1,
            FinishReason::Abort => self.finished_abort += 1,
            FinishReason::Error => self.finished_error += 1,
        }
    }

    pub fn add_prompt_tokens(&mut self, n: u64) {
        self.prompt_tokens += n;
    }

    pub fn add_generation_tokens(&mut self, n: u64) {
        self.generation_tokens += n;
    }

    /// Renders the exposition text.
    pub fn render(&self, model: &str, g: Gauges) -> String {
        let labels = format!("model_name=\"{}\"", escape(model));
        let mut o = String::with_capacity(8192);
        // vLLM's labels are the CacheConfig fields (str() of each, sorted as prometheus_client
        // prints them); no model_name. Memory used is 0.9 of total in /sim/gpu, hence 0.9.
        let cache_config = format!(
            "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",\
             gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",\
             num_gpu_blocks_override=\"None\",sliding_window=\"None\"",
            g.block_size,
            if g.prefix_caching { "True" } else { "False" },
            g.num_gpu_blocks
        );
        gauge(
            &mut o,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            &cache_config,
            1.0,
        );
        gauge(
            &mut o,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &labels,
            g.running as f64,
        );
        gauge(
            &mut o,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &labels,
            g.waiting as f64,
        );
        gauge(
            &mut o,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &labels,
            g.kv_cache_usage,
        );
        gauge(
            &mut o,
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            &labels,
            g.kv_cache_usage,
        );
        counter(
            &mut o,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            &[(labels.clone(), g.prefix_cache.queries)],
        );
        counter(
            &mut o,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            &[(labels.clone(), g.prefix_cache.hits)],
        );
        counter(
            &mut o,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            &[(labels.clone(), self.prompt_tokens)],
        );
        counter(
            &mut o,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            &[(labels.clone(), self.generation_tokens)],
        );
        let reasons = [
            ("stop", 0),
            ("length", self.finished_length),
            ("abort", self.finished_abort),
            ("error", self.finished_error),
        ];
        let rows: Vec<(String, u64)> = reasons
            .iter()
            .map(|(r, v)| (format!("finished_reason=\"{r}\",{labels}"), *v))
            .collect();
        counter(
            &mut o,
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            &rows,
        );
        self.ttft.render(
            &mut o,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.itl.render(
            &mut o,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &labels,
        );
        self.e2e.render(
            &mut o,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        o
    }
}

fn gauge(o: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} gauge");
    let _ = writeln!(o, "{name}{{{labels}}} {}", float(v));
}

fn counter(o: &mut String, name: &str, help: &str, rows: &[(String, u64)]) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} counter");
    for (labels, v) in rows {
        let _ = writeln!(o, "{name}{{{labels}}} {}", float(*v as f64));
    }
}

/// Escapes a label value per the exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 3.0, f64::NAN] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "h", "m=\"a\"");
        assert!(s.contains("x_bucket{m=\"a\",le=\"0.1\"} 2.0\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"1.0\"} 3.0\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"+Inf\"} 4.0\n"), "{s}");
        assert!(s.contains("x_sum{m=\"a\"} 3.65\n"), "{s}");
        assert_eq!(h.count(), 4);
    }

    #[test]
    fn render_uses_vllm_names_and_labels() {
        let mut m = Metrics::new();
        m.finished(FinishReason::Error);
        m.add_prompt_tokens(10);
        let text = m.render(
            "meta-llama/Llama-3.1-8B-Instruct",
            Gauges {
                waiting: 3,
                running: 2,
                kv_cache_usage: 0.5,
                block_size: 16,
                num_gpu_blocks: 62,
                prefix_caching: true,
                prefix_cache: CacheStats {
                    queries: 300,
                    hits: 288,
                    evictions: 0,
                },
            },
        );
        let l = "model_name=\"meta-llama/Llama-3.1-8B-Instruct\"";
        for line in [
            format!("vllm:num_requests_waiting{{{l}}} 3.0"),
            format!("vllm:num_requests_running{{{l}}} 2.0"),
            format!("vllm:kv_cache_usage_perc{{{l}}} 0.5"),
            format!("vllm:gpu_cache_usage_perc{{{l}}} 0.5"),
            format!("vllm:prefix_cache_queries_total{{{l}}} 300.0"),
            format!("vllm:prefix_cache_hits_total{{{l}}} 288.0"),
            "# TYPE vllm:prefix_cache_hits_total counter".to_string(),
            format!("vllm:prompt_tokens_total{{{l}}} 10.0"),
            format!("vllm:request_success_total{{finished_reason=\"error\",{l}}} 1.0"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 0.0"),
            format!("vllm:inter_token_latency_seconds_bucket{{{l},le=\"0.01\"}} 0.0"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{l},le=\"+Inf\"}} 0.0"),
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line}\n{text}");
        }
    }

    #[test]
    fn kv_capacity_is_vllm_cache_config_info_in_whole_blocks() {
        let text = Metrics::new().render(
            "m",
            Gauges {
                waiting: 0,
                running: 0,
                kv_cache_usage: 0.0,
                block_size: 16,
                num_gpu_blocks: 62,
                prefix_caching: false,
                prefix_cache: CacheStats::default(),
            },
        );
        let info: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("vllm:cache_config_info"))
            .collect();
        assert_eq!(
            info,
            vec![
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",\
                 enable_prefix_caching=\"False\",gpu_memory_utilization=\"0.9\",\
                 num_cpu_blocks=\"None\",num_gpu_blocks=\"62\",num_gpu_blocks_override=\"None\",\
                 sliding_window=\"None\"} 1.0",
            ]
        );
        assert!(
            !info[2].contains("model_name"),
            "vLLM's info metric has no model_name"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
