//! Decides what the operator may set and validates it once: flags (each also read from an
//! `AI_LB_EPP_*` environment variable) as raw strings, turned into a [`Config`] whose every
//! error names the flag and the offending value. Defaults are llm-d's (ebab68792): ext_proc on
//! port 9002 (`pkg/epp/server/options.go`), metrics refreshed every 50 ms
//! (`MinRefreshMetricsInterval`) with a 1 s deadline per scrape (`datalayer/collector.go`),
//! scorer weights 2/2/3 (`config/loader/defaults.go`), the approximate prefix producer's
//! `blockSizeTokens` 16, `lruCapacityPerServer` 31 250, `maxPrefixTokensToMatch` 131 072 and
//! `autoTune` true (`approximateprefix/types.go`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::scheduler::{PrefixSettings, Weights};

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid value {value:?} for --{flag}: {expected}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub value: String,
    pub expected: String,
}

fn bad(flag: &'static str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// The command line as given.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ai-lb-epp",
    version,
    allow_negative_numbers = true,
    about = "Benchmark baseline: the llm-d endpoint picker's default scheduling behind Envoy's ext_proc"
)]
pub struct RawArgs {
    /// gRPC (Envoy ext_proc) listen address; port 0 picks a free port, printed on stdout as
    /// `LISTENING grpc ADDR`.
    #[arg(long, env = "AI_LB_EPP_LISTEN", default_value = "0.0.0.0:9002")]
    pub listen: String,
    /// Admin HTTP listen address (`GET /stats`, `GET /healthz`), printed as `LISTENING admin ADDR`.
    #[arg(long, env = "AI_LB_EPP_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
    pub admin_listen: String,
    /// The model servers, `IP:PORT,IP:PORT,...` (the pool; their `/metrics` are scraped). An
    /// empty value is an empty pool: every request is answered 503.
    #[arg(long, env = "AI_LB_EPP_PODS")]
    pub pods: String,
    /// How often each pod's metrics are scraped, ms (llm-d's --refresh-metrics-interval).
    #[arg(long, env = "AI_LB_EPP_REFRESH_MS", default_value = "50")]
    pub refresh_ms: String,
    /// Deadline of one scrape, ms.
    #[arg(long, env = "AI_LB_EPP_SCRAPE_TIMEOUT_MS", default_value = "1000")]
    pub scrape_timeout_ms: String,
    /// Path of the pods' metrics page.
    #[arg(long, env = "AI_LB_EPP_METRICS_PATH", default_value = "/metrics")]
    pub metrics_path: String,
    /// Seed of the picker's RNG (ties, body-less requests); default: from the clock (logged).
    #[arg(long, env = "AI_LB_EPP_SEED")]
    pub seed: Option<String>,
    /// The prefix producer's blockSizeTokens: used when --auto-tune is false or no pod reports
    /// vllm:cache_config_info's block_size; raised to 64 either way.
    #[arg(long, env = "AI_LB_EPP_BLOCK_SIZE", default_value = "16")]
    pub block_size: String,
    /// The prefix producer's lruCapacityPerServer: index entries per pod when the pod reports
    /// no num_gpu_blocks (or --auto-tune is false).
    #[arg(long, env = "AI_LB_EPP_LRU_CAPACITY", default_value = "31250")]
    pub lru_capacity: String,
    /// The prefix producer's maxPrefixTokensToMatch (0: no cap).
    #[arg(long, env = "AI_LB_EPP_MAX_PREFIX_TOKENS", default_value = "131072")]
    pub max_prefix_tokens: String,
    /// The prefix producer's autoTune: block size and LRU capacity from the pods' metrics.
    #[arg(long, env = "AI_LB_EPP_AUTO_TUNE", default_value = "true")]
    pub auto_tune: String,
    /// Weight of the queue scorer.
    #[arg(long, env = "AI_LB_EPP_QUEUE_WEIGHT", default_value = "2")]
    pub queue_weight: String,
    /// Weight of the KV-cache utilisation scorer.
    #[arg(long, env = "AI_LB_EPP_KV_CACHE_WEIGHT", default_value = "2")]
    pub kv_cache_weight: String,
    /// Weight of the prefix-cache scorer.
    #[arg(long, env = "AI_LB_EPP_PREFIX_WEIGHT", default_value = "3")]
    pub prefix_weight: String,
    /// Runtime worker threads; default: the CPUs available.
    #[arg(long, env = "AI_LB_EPP_WORKERS")]
    pub workers: Option<String>,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub pods: Vec<SocketAddr>,
    pub refresh: Duration,
    pub scrape_timeout: Duration,
    pub metrics_path: String,
    pub seed: Option<u64>,
    pub weights: Weights,
    pub prefix: PrefixSettings,
    pub workers: Option<usize>,
}

fn addr(flag: &'static str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.trim()
        .parse()
        .map_err(|_| bad(flag, v, "expected IP:PORT, e.g. 127.0.0.1:9002"))
}

fn positive<T: std::str::FromStr + PartialOrd + Default>(
    flag: &'static str,
    v: &str,
    what: &str,
) -> Result<T, ConfigError> {
    match v.trim().parse::<T>() {
        Ok(n) if n > T::default() => Ok(n),
        _ => Err(bad(flag, v, format!("expected {what} greater than 0"))),
    }
}

fn weight(flag: &'static str, v: &str) -> Result<f64, ConfigError> {
    match v.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w >= 0.0 => Ok(w),
        _ => Err(bad(flag, v, "expected a finite number >= 0")),
    }
}

impl TryFrom<RawArgs> for Config {
    type Error = ConfigError;

    fn try_from(a: RawArgs) -> Result<Config, ConfigError> {
        let mut pods = Vec::new();
        for part in a.pods.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let p = addr("pods", part)?;
            if pods.contains(&p) {
                return Err(bad("pods", &a.pods, format!("{p} is listed twice")));
            }
            pods.push(p);
        }
        if !a.metrics_path.starts_with('/') {
            return Err(bad(
                "metrics-path",
                &a.metrics_path,
                "expected a path starting with '/'",
            ));
        }
        let auto_tune = match a.auto_tune.trim() {
            "true" => true,
            "false" => false,
            _ => return Err(bad("auto-tune", &a.auto_tune, "expected true or false")),
        };
        let max_prefix_tokens = a.max_prefix_tokens.trim().parse::<usize>().map_err(|_| {
            bad(
                "max-prefix-tokens",
                &a.max_prefix_tokens,
                "expected a whole number >= 0",
            )
        })?;
        Ok(Config {
            listen: addr("listen", &a.listen)?,
            admin_listen: addr("admin-listen", &a.admin_listen)?,
            pods,
            refresh: Duration::from_millis(positive(
                "refresh-ms",
                &a.refresh_ms,
                "a whole number of ms",
            )?),
            scrape_timeout: Duration::from_millis(positive(
                "scrape-timeout-ms",
                &a.scrape_timeout_ms,
                "a whole number of ms",
            )?),
            metrics_path: a.metrics_path.clone(),
            seed: match &a.seed {
                None => None,
                Some(s) => Some(
                    s.trim()
                        .parse::<u64>()
                        .map_err(|_| bad("seed", s, "expected a whole number >= 0"))?,
                ),
            },
            weights: Weights {
                queue: weight("queue-weight", &a.queue_weight)?,
                kv_cache: weight("kv-cache-weight", &a.kv_cache_weight)?,
                prefix: weight("prefix-weight", &a.prefix_weight)?,
            },
            prefix: PrefixSettings {
                auto_tune,
                block_size_tokens: positive(
                    "block-size",
                    &a.block_size,
                    "a whole number of tokens",
                )?,
                max_prefix_tokens,
                lru_capacity_per_server: positive(
                    "lru-capacity",
                    &a.lru_capacity,
                    "a whole number of entries",
                )?,
            },
            workers: match &a.workers {
                None => None,
                Some(w) => Some(positive("workers", w, "a whole number of threads")?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut v = vec!["ai-lb-epp"];
        v.extend_from_slice(args);
        Config::try_from(RawArgs::try_parse_from(v).unwrap())
    }

    #[test]
    fn defaults_are_llm_ds() {
        let c = parse(&["--pods", "127.0.0.1:8001, 127.0.0.1:8002"]).unwrap();
        assert_eq!(c.listen, "0.0.0.0:9002".parse().unwrap());
        assert_eq!(c.pods.len(), 2);
        assert_eq!(c.refresh, Duration::from_millis(50));
        assert_eq!(c.scrape_timeout, Duration::from_secs(1));
        assert_eq!(c.weights, Weights::default());
        assert_eq!(c.prefix, PrefixSettings::default());
        assert_eq!(c.seed, None);
        assert_eq!(c.workers, None);
    }

    #[test]
    fn an_empty_pod_list_is_an_empty_pool() {
        assert!(parse(&["--pods", ""]).unwrap().pods.is_empty());
    }

    #[test]
    fn errors_name_the_flag_and_the_value() {
        for (args, flag, value) in [
            (&["--pods", "nope"][..], "pods", "nope"),
            (
                &["--pods", "127.0.0.1:1,127.0.0.1:1"],
                "pods",
                "127.0.0.1:1,127.0.0.1:1",
            ),
            (&["--pods", "", "--listen", "x"], "listen", "x"),
            (&["--pods", "", "--refresh-ms", "0"], "refresh-ms", "0"),
            (&["--pods", "", "--refresh-ms", "5s"], "refresh-ms", "5s"),
            (&["--pods", "", "--seed", "-1"], "seed", "-1"),
            (
                &["--pods", "", "--queue-weight", "NaN"],
                "queue-weight",
                "NaN",
            ),
            (
                &["--pods", "", "--prefix-weight", "-3"],
                "prefix-weight",
                "-3",
            ),
            (&["--pods", "", "--block-size", "0"], "block-size", "0"),
            (&["--pods", "", "--lru-capacity", "x"], "lru-capacity", "x"),
            (&["--pods", "", "--auto-tune", "yes"], "auto-tune", "yes"),
            (
                &["--pods", "", "--metrics-path", "metrics"],
                "metrics-path",
                "metrics",
            ),
            (&["--pods", "", "--workers", "0"], "workers", "0"),
            (
                &["--pods", "", "--max-prefix-tokens", "-5"],
                "max-prefix-tokens",
                "-5",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!((e.flag, e.value.as_str()), (flag, value), "{e}");
            let text = e.to_string();
            assert!(
                text.contains(&format!("--{flag}")) && text.contains(value),
                "{text}"
            );
        }
    }

    #[test]
    fn overrides_apply() {
        let c = parse(&[
            "--pods",
            "10.0.0.1:8000",
            "--seed",
            "7",
            "--queue-weight",
            "0",
            "--auto-tune",
            "false",
            "--block-size",
            "128",
            "--max-prefix-tokens",
            "0",
            "--workers",
            "2",
        ])
        .unwrap();
        assert_eq!(c.seed, Some(7));
        assert_eq!(c.weights.queue, 0.0);
        assert!(!c.prefix.auto_tune);
        assert_eq!(c.prefix.block_size_tokens, 128);
        assert_eq!(c.prefix.max_prefix_tokens, 0);
        assert_eq!(c.workers, Some(2));
    }
}
