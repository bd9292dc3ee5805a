//! Decides what the picker knows about each pod from its `/metrics` page, as llm-d's
//! `core-metrics-extractor` does with its built-in vLLM mapping
//! (`pkg/epp/framework/plugins/datalayer/extractor/metrics/{extractor.go,factories.go}` at
//! ebab68792): `vllm:num_requests_waiting` → waiting queue size, `vllm:num_requests_running` →
//! running requests, `vllm:kv_cache_usage_perc` → KV-cache usage, and the labels `block_size`
//! and `num_gpu_blocks` of the info gauge `vllm:cache_config_info` → cache block size and GPU
//! block count. A metric that is missing or unreadable leaves that field as it was (llm-d
//! updates field by field) and is reported as an error; the others are still applied.
//! Counts are truncated toward zero (Go's `int(float64)`); a non-finite value is refused (Go
//! would store an undefined integer).

use crate::prom::Page;

/// vLLM's metric names (llm-d's default engine config `vllm`).
pub const WAITING: &str = "vllm:num_requests_waiting";
pub const RUNNING: &str = "vllm:num_requests_running";
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
pub const CACHE_INFO: &str = "vllm:cache_config_info";
/// `vllm:cache_config_info` labels.
pub const BLOCK_SIZE_LABEL: &str = "block_size";
pub const NUM_GPU_BLOCKS_LABEL: &str = "num_gpu_blocks";

/// What the picker knows about one pod. Zero until the first successful read, as in llm-d.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PodMetrics {
    pub waiting: i64,
    pub running: i64,
    /// `vllm:kv_cache_usage_perc`, 0..1 as vLLM reports it (not clamped here; the scorer
    /// clamps its score).
    pub kv_usage: f64,
    /// Tokens per KV block (0: unknown).
    pub block_size: i64,
    /// GPU KV blocks (0: unknown).
    pub num_gpu_blocks: i64,
    /// Pages applied with at least one field updated.
    pub updates: u64,
}

/// One metric that could not be read from a page.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{metric}: {reason}")]
pub struct ExtractError {
    pub metric: &'static str,
    pub reason: String,
}

fn count(v: f64, metric: &'static str) -> Result<i64, ExtractError> {
    if !v.is_finite() {
        return Err(ExtractError {
            metric,
            reason: format!("value {v} is not a finite number"),
        });
    }
    // Go's int(float64): truncation toward zero (saturating here instead of undefined).
    Ok(v.trunc() as i64)
}

fn label_int(
    v: &str,
    metric: &'static str,
    label: &'static str,
) -> Result<Option<i64>, ExtractError> {
    if v.is_empty() {
        return Ok(None);
    }
    v.parse::<i64>().map(Some).map_err(|_| ExtractError {
        metric,
        reason: format!("label {label}={v:?} is not an integer"),
    })
}

impl PodMetrics {
    /// Applies a page field by field; returns the metrics that could not be read.
    pub fn apply(&mut self, page: &Page) -> Vec<ExtractError> {
        let mut errs = Vec::new();
        let mut updated = false;
        let lookup_err = |metric: &'static str, e: crate::prom::LookupError| ExtractError {
            metric,
            reason: e.to_string(),
        };
        match page.latest(WAITING, &[]) {
            Ok(s) => match count(page.value_of(WAITING, s), WAITING) {
                Ok(v) => {
                    self.waiting = v;
                    updated = true;
                }
                Err(e) => errs.push(e),
            },
            Err(e) => errs.push(lookup_err(WAITING, e)),
        }
        match page.latest(RUNNING, &[]) {
            Ok(s) => match count(page.value_of(RUNNING, s), RUNNING) {
                Ok(v) => {
                    self.running = v;
                    updated = true;
                }
                Err(e) => errs.push(e),
            },
            Err(e) => errs.push(lookup_err(RUNNING, e)),
        }
        match page.latest(KV_USAGE, &[]) {
            Ok(s) => {
                let v = page.value_of(KV_USAGE, s);
                if v.is_finite() {
                    self.kv_usage = v;
                    updated = true;
                } else {
                    errs.push(ExtractError {
                        metric: KV_USAGE,
                        reason: format!("value {v} is not a finite number"),
                    });
                }
            }
            Err(e) => errs.push(lookup_err(KV_USAGE, e)),
        }
        match page.latest(CACHE_INFO, &[]) {
            Ok(s) => {
                // llm-d resets the block size before reading the labels (not the block count).
                self.block_size = 0;
                for (k, v) in &s.labels {
                    match k.as_str() {
                        BLOCK_SIZE_LABEL => match label_int(v, CACHE_INFO, BLOCK_SIZE_LABEL) {
                            Ok(Some(n)) => self.block_size = n,
                            Ok(None) => {}
                            Err(e) => errs.push(e),
                        },
                        NUM_GPU_BLOCKS_LABEL => {
                            match label_int(v, CACHE_INFO, NUM_GPU_BLOCKS_LABEL) {
                                Ok(Some(n)) => self.num_gpu_blocks = n,
                                Ok(None) => {}
                                Err(e) => errs.push(e),
                            }
                        }
                        _ => {}
                    }
                }
                updated = true;
            }
            Err(e) => errs.push(lookup_err(CACHE_INFO, e)),
        }
        if updated {
            self.updates += 1;
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom::parse;

    fn page(text: &str) -> Page {
        parse(text).unwrap()
    }

    const FULL: &str = "\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"781\"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"m\"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"m\"} 40.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25
";

    #[test]
    fn reads_the_four_vllm_metrics() {
        let mut m = PodMetrics::default();
        assert!(m.apply(&page(FULL)).is_empty());
        assert_eq!(
            m,
            PodMetrics {
                waiting: 40,
                running: 2,
                kv_usage: 0.25,
                block_size: 16,
                num_gpu_blocks: 781,
                updates: 1
            }
        );
    }

    #[test]
    fn a_missing_metric_keeps_its_previous_value_and_is_reported() {
        let mut m = PodMetrics::default();
        m.apply(&page(FULL));
        let errs = m.apply(&page(
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1.9\n",
        ));
        assert_eq!(m.waiting, 1, "truncated toward zero");
        assert_eq!(m.running, 2);
        assert_eq!(m.kv_usage, 0.25);
        assert_eq!(m.block_size, 16);
        let names: Vec<_> = errs.iter().map(|e| e.metric).collect();
        assert_eq!(names, vec![RUNNING, KV_USAGE, CACHE_INFO]);
        assert!(errs[0].to_string().contains("not found"), "{}", errs[0]);
    }

    #[test]
    fn cache_info_without_block_size_resets_it_but_keeps_the_block_count() {
        let mut m = PodMetrics::default();
        m.apply(&page(FULL));
        m.apply(&page(
            "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{cache_dtype=\"auto\"} 1\n",
        ));
        assert_eq!(m.block_size, 0);
        assert_eq!(m.num_gpu_blocks, 781);
    }

    #[test]
    fn bad_values_are_refused_and_named() {
        let mut m = PodMetrics::default();
        let errs = m.apply(&page(
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting NaN\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc +Inf\n\
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"x\",num_gpu_blocks=\"None\"} 1\n",
        ));
        assert_eq!(m.waiting, 0);
        assert_eq!(m.kv_usage, 0.0);
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert!(text
            .iter()
            .any(|t| t.contains("vllm:num_requests_waiting: value NaN")));
        assert!(text
            .iter()
            .any(|t| t.contains("vllm:kv_cache_usage_perc: value inf")));
        assert!(text.iter().any(|t| t.contains("block_size=\"x\"")));
        assert!(text.iter().any(|t| t.contains("num_gpu_blocks=\"None\"")));
    }

    #[test]
    fn untyped_metrics_read_as_zero_as_in_llm_d() {
        let mut m = PodMetrics::default();
        m.apply(&page("vllm:num_requests_waiting 9\n"));
        assert_eq!(m.waiting, 0);
        assert_eq!(m.updates, 1);
    }
}
