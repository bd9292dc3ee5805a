//! Decides the pod's configuration: command-line flags (each also from `AI_LB_FAKE_POD_<NAME>`),
//! the hardware presets fitted to published vLLM figures (see README.md, "The fit"), and the
//! validated [`PodConfig`] the server runs with.

use std::net::SocketAddr;

use clap::{Parser, ValueEnum};

use crate::gpu::GpuUtilModel;
use crate::kv_cache::CacheParams;
use crate::kv_events::{EventsConfig, WireFormat};
use crate::model::EngineParams;

/// A simulated GPU inference pod (vLLM-like): OpenAI API, vLLM metrics, fault injection.
#[derive(Debug, Clone, Parser)]
#[command(name = "ai-lb-fake-pod", version, about)]
pub struct Cli {
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    #[arg(long, env = "AI_LB_FAKE_POD_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Hardware + model preset.
    #[arg(long, env = "AI_LB_FAKE_POD_PRESET", value_enum, default_value_t = Preset::H100_8b)]
    pub preset: Preset,
    /// Served model name (requests for any other model get 404).
    #[arg(
        long,
        env = "AI_LB_FAKE_POD_MODEL",
        default_value = "meta-llama/Llama-3.1-8B-Instruct",
        value_parser = non_empty
    )]
    pub model: String,
    /// Pod name, reported in `x-fake-pod` and used for GPU UUIDs (default: hostname or `fake-pod`).
    #[arg(long, env = "AI_LB_FAKE_POD_POD_NAME", value_parser = non_empty)]
    pub pod_name: Option<String>,
    /// Seed of the random generators (injected errors, generated text).
    #[arg(long, env = "AI_LB_FAKE_POD_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Multiplies every simulated duration (0.1 runs ten times faster).
    #[arg(
        long,
        env = "AI_LB_FAKE_POD_TIME_SCALE",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_parser = positive_f64
    )]
    pub time_scale: f64,
    /// Maximum running sequences (default from the preset).
    #[arg(long, env = "AI_LB_FAKE_POD_MAX_NUM_SEQS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_seqs: Option<u32>,
    /// KV-cache capacity in tokens (default from the preset).
    #[arg(long, env = "AI_LB_FAKE_POD_KV_CACHE_TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_cache_tokens: Option<u64>,
    /// Chunked-prefill token budget per iteration (default from the preset).
    #[arg(long, env = "AI_LB_FAKE_POD_MAX_BATCHED_TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batched_tokens: Option<u32>,
    /// Number of GPUs reported by /sim/gpu (tensor-parallel group; timing is per pod).
    #[arg(long, env = "AI_LB_FAKE_POD_NUM_GPUS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub num_gpus: u32,
    /// What `/sim/gpu` reports as `utilization`: `nvml` (fraction of the window in which any
    /// batch step ran, as NVML defines it) or `graded` (busy × (0.5 + 0.5 × occupancy)).
    #[arg(long, env = "AI_LB_FAKE_POD_GPU_UTIL_MODEL", value_enum, default_value_t = GpuUtilModel::Nvml)]
    pub gpu_util_model: GpuUtilModel,
    /// Tokens per KV-cache block (vLLM `--block-size`: 1, 8, 16, 32, 64 or 128).
    #[arg(long, env = "AI_LB_FAKE_POD_BLOCK_SIZE", default_value_t = 16, value_parser = block_size)]
    pub block_size: u32,
    /// Automatic prefix caching (`false` = vLLM `--no-enable-prefix-caching`: nothing hits).
    #[arg(long, env = "AI_LB_FAKE_POD_PREFIX_CACHING", default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_caching: bool,
    /// Publish vLLM KV-cache events on a ZeroMQ PUB socket bound here, e.g.
    /// `tcp://127.0.0.1:5557` (port 0 picks one; read the `LISTENING kv-events` line). Off
    /// when unset.
    #[arg(long, env = "AI_LB_FAKE_POD_KV_EVENTS_ENDPOINT", value_parser = tcp_endpoint)]
    pub kv_events_endpoint: Option<String>,
    /// Topic frame of every KV-event message (vLLM's default: empty).
    #[arg(long, env = "AI_LB_FAKE_POD_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// ROUTER socket answering replay requests (vLLM `replay_endpoint`); needs
    /// --kv-events-endpoint.
    #[arg(long, env = "AI_LB_FAKE_POD_KV_EVENTS_REPLAY_ENDPOINT", value_parser = tcp_endpoint, requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Encoding of each event: `array` (msgspec `array_like`, vLLM up to v0.23) or `map`
    /// (tagged maps, vLLM after PR #42892).
    #[arg(long, env = "AI_LB_FAKE_POD_KV_EVENTS_FORMAT", value_enum, default_value_t = WireFormat::Array)]
    pub kv_events_format: WireFormat,
}

fn block_size(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(v @ (1 | 8 | 16 | 32 | 64 | 128)) => Ok(v),
        _ => Err("must be one of 1, 8, 16, 32, 64, 128 (vLLM's block sizes)".to_string()),
    }
}

/// `tcp://HOST:PORT` (what the pure-Rust ZeroMQ transport binds); `*` means every address.
fn tcp_endpoint(s: &str) -> Result<String, String> {
    let err = || "expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557".to_string();
    let rest = s.trim().strip_prefix("tcp://").ok_or_else(err)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(err)?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(err());
    }
    Ok(s.trim().to_string())
}

fn non_empty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be empty".to_string())
    } else {
        Ok(s.to_string())
    }
}

fn positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("not a number: {e}"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err("must be a finite number > 0".to_string())
    }
}

/// Hardware + model presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[allow(non_camel_case_types)]
pub enum Preset {
    /// Llama-3.1-8B (bf16) on one H100 SXM 80GB.
    #[value(name = "h100-8b")]
    H100_8b,
    /// Llama-3.1-8B (bf16) on one A100 SXM4 80GB.
    #[value(name = "a100-8b")]
    A100_8b,
    /// Llama-3.1-8B (bf16) on one L40S 48GB (Ada: no GPM).
    #[value(name = "l40s-8b")]
    L40s_8b,
}

/// Hardware description of a preset.
#[derive(Debug, Clone, PartialEq)]
pub struct PresetSpec {
    pub gpu_name: &'static str,
    /// Whether the GPU has GPM metrics (`nvmlGpmQueryDeviceSupport`: Hopper and later).
    pub gpm: bool,
    pub memory_total_bytes: u64,
    pub power_limit_watts: f64,
    pub idle_power_watts: f64,
    pub a: f64,
    pub b: f64,
    pub p: f64,
    pub overhead: f64,
    pub max_num_seqs: u32,
    pub kv_cache_tokens: u64,
    pub max_batched_tokens: u32,
}

/// H100 step-time constants (seconds), fitted in README.md "The fit".
pub const H100_A: f64 = 0.004_570;
pub const H100_B: f64 = 0.000_027_5;
pub const H100_P: f64 = 0.000_011;
pub const FRONTEND_OVERHEAD: f64 = 0.004;
/// A100 / H100 ratios: decode is memory-bandwidth bound (3.35 / 2.04 TB/s ≈ 1.64); prefill is
/// compute bound (989 / 312 dense bf16 TFLOPS ≈ 3.2 peak, ~2.5 achieved).
pub const A100_DECODE_RATIO: f64 = 1.64;
pub const A100_PREFILL_RATIO: f64 = 2.5;
/// L40S / H100 ratios: decode by bandwidth (3.35 / 0.864 TB/s ≈ 3.88); prefill by dense bf16
/// compute (989 / 362 TFLOPS ≈ 2.73 peak), at the A100's achieved share of its peak ratio
/// (2.5 / 3.2 ≈ 0.78) ≈ 2.1.
pub const L40S_DECODE_RATIO: f64 = 3.88;
pub const L40S_PREFILL_RATIO: f64 = 2.1;

impl Preset {
    pub fn spec(self) -> PresetSpec {
        const GIB: u64 = 1 << 30;
        match self {
            Preset::H100_8b => PresetSpec {
                gpu_name: "NVIDIA H100 80GB HBM3 (simulated)",
                gpm: true,
                memory_total_bytes: 80 * GIB,
                power_limit_watts: 700.0,
                idle_power_watts: 70.0,
                a: H100_A,
                b: H100_B,
                p: H100_P,
                overhead: FRONTEND_OVERHEAD,
                max_num_seqs: 256,
                kv_cache_tokens: 400_000,
                max_batched_tokens: 8192,
            },
            Preset::A100_8b => PresetSpec {
                gpu_name: "NVIDIA A100-SXM4-80GB (simulated)",
                gpm: false,
                memory_total_bytes: 80 * GIB,
                power_limit_watts: 400.0,
                idle_power_watts: 55.0,
                a: H100_A * A100_DECODE_RATIO,
                b: H100_B * A100_DECODE_RATIO,
                p: H100_P * A100_PREFILL_RATIO,
                overhead: FRONTEND_OVERHEAD,
                max_num_seqs: 256,
                kv_cache_tokens: 400_000,
                max_batched_tokens: 8192,
            },
            Preset::L40s_8b => PresetSpec {
                gpu_name: "NVIDIA L40S (simulated)",
                gpm: false,
                memory_total_bytes: 48 * GIB,
                power_limit_watts: 350.0,
                idle_power_watts: 35.0,
                a: H100_A * L40S_DECODE_RATIO,
                b: H100_B * L40S_DECODE_RATIO,
                p: H100_P * L40S_PREFILL_RATIO,
                overhead: FRONTEND_OVERHEAD,
                max_num_seqs: 256,
                kv_cache_tokens: 200_000,
                max_batched_tokens: 8192,
            },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::H100_8b => "h100-8b",
            Preset::A100_8b => "a100-8b",
            Preset::L40s_8b => "l40s-8b",
        }
    }
}

impl PresetSpec {
    /// The engine parameters of this preset at `time_scale`, with no flag overrides.
    pub fn engine(&self, time_scale: f64) -> EngineParams {
        EngineParams {
            a: self.a,
            b: self.b,
            p: self.p,
            overhead: self.overhead,
            max_num_seqs: self.max_num_seqs as usize,
            kv_cache_tokens: self.kv_cache_tokens,
            max_batched_tokens: self.max_batched_tokens,
            time_scale,
            cache: CacheParams::default(),
        }
    }
}

/// Validated configuration of one pod.
#[derive(Debug, Clone)]
pub struct PodConfig {
    pub listen: SocketAddr,
    pub preset: Preset,
    pub spec: PresetSpec,
    pub model: String,
    pub pod_name: String,
    pub seed: u64,
    pub num_gpus: u32,
    pub gpu_util_model: GpuUtilModel,
    pub engine: EngineParams,
    /// Where and how KV-cache events are published; `None` = off.
    pub kv_events: Option<EventsConfig>,
}

impl PodConfig {
    /// Builds the configuration; `hostname` is used when `--pod-name` is absent.
    pub fn from_cli(cli: Cli, hostname: Option<String>) -> Self {
        let spec = cli.preset.spec();
        let engine = EngineParams {
            a: spec.a,
            b: spec.b,
            p: spec.p,
            overhead: spec.overhead,
            max_num_seqs: cli.max_num_seqs.unwrap_or(spec.max_num_seqs) as usize,
            kv_cache_tokens: cli.kv_cache_tokens.unwrap_or(spec.kv_cache_tokens),
            max_batched_tokens: cli.max_batched_tokens.unwrap_or(spec.max_batched_tokens),
            time_scale: cli.time_scale,
            cache: CacheParams {
                block_size: cli.block_size,
                prefix_caching: cli.prefix_caching,
                seed: ai_lb_prefix::model_seed(&cli.model),
            },
        };
        let kv_events = cli.kv_events_endpoint.map(|endpoint| EventsConfig {
            endpoint,
            replay_endpoint: cli.kv_events_replay_endpoint,
            topic: cli.kv_events_topic,
            format: cli.kv_events_format,
        });
        let pod_name = cli
            .pod_name
            .or_else(|| hostname.filter(|h| !h.trim().is_empty()))
            .unwrap_or_else(|| "fake-pod".to_string());
        Self {
            listen: cli.listen,
            preset: cli.preset,
            spec,
            model: cli.model,
            pod_name,
            seed: cli.seed,
            num_gpus: cli.num_gpus,
            gpu_util_model: cli.gpu_util_model,
            engine,
            kv_events,
        }
    }
}

/// The machine's hostname from `HOSTNAME` or `/etc/hostname`, if any.
pub fn hostname() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let mut v = vec!["ai-lb-fake-pod"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
    }

    #[test]
    fn defaults_come_from_the_preset() {
        let cfg = PodConfig::from_cli(parse(&[]).unwrap(), None);
        assert_eq!(cfg.pod_name, "fake-pod");
        assert_eq!(cfg.engine.max_num_seqs, 256);
        assert_eq!(cfg.engine.max_batched_tokens, 8192);
        assert_eq!(cfg.model, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(cfg.gpu_util_model, GpuUtilModel::Nvml);
        let cfg = PodConfig::from_cli(parse(&["--gpu-util-model", "graded"]).unwrap(), None);
        assert_eq!(cfg.gpu_util_model, GpuUtilModel::Graded);
        let cfg = PodConfig::from_cli(
            parse(&["--preset", "a100-8b", "--max-num-seqs", "8"]).unwrap(),
            Some("host-1".into()),
        );
        assert_eq!(cfg.pod_name, "host-1");
        assert_eq!(cfg.engine.max_num_seqs, 8);
        assert!(cfg.engine.a > H100_A);
        assert_eq!(cfg.engine.cache.block_size, 16);
        assert!(cfg.engine.cache.prefix_caching);
        assert_eq!(
            cfg.engine.cache.seed,
            ai_lb_prefix::model_seed("meta-llama/Llama-3.1-8B-Instruct")
        );
        assert!(cfg.kv_events.is_none());
        let cfg = PodConfig::from_cli(
            parse(&[
                "--block-size",
                "32",
                "--prefix-caching",
                "false",
                "--kv-events-endpoint",
                "tcp://127.0.0.1:0",
                "--kv-events-topic",
                "kv",
            ])
            .unwrap(),
            None,
        );
        assert_eq!(cfg.engine.cache.block_size, 32);
        assert!(!cfg.engine.cache.prefix_caching);
        let ev = cfg.kv_events.unwrap();
        assert_eq!(
            (ev.endpoint.as_str(), ev.topic.as_str()),
            ("tcp://127.0.0.1:0", "kv")
        );
        assert_eq!(ev.format, WireFormat::Array);
    }

    #[test]
    fn bad_values_name_flag_and_value() {
        for (args, flag, value) in [
            (&["--time-scale", "0"][..], "--time-scale", "0"),
            (&["--time-scale", "-1"][..], "--time-scale", "-1"),
            (&["--time-scale", "NaN"][..], "--time-scale", "NaN"),
            (&["--preset", "tpu"][..], "--preset", "tpu"),
            (&["--max-num-seqs", "0"][..], "--max-num-seqs", "0"),
            (&["--listen", "nowhere"][..], "--listen", "nowhere"),
            (&["--seed", "x"][..], "--seed", "x"),
            (
                &["--gpu-util-model", "dcgm"][..],
                "--gpu-util-model",
                "dcgm",
            ),
            (&["--block-size", "12"][..], "--block-size", "12"),
            (
                &["--prefix-caching", "maybe"][..],
                "--prefix-caching",
                "maybe",
            ),
            (
                &["--kv-events-endpoint", "ipc:///tmp/x"][..],
                "--kv-events-endpoint",
                "ipc:///tmp/x",
            ),
            (
                &[
                    "--kv-events-endpoint",
                    "tcp://h:1",
                    "--kv-events-format",
                    "json",
                ][..],
                "--kv-events-format",
                "json",
            ),
        ] {
            let err = parse(args).unwrap_err().to_string();
            assert!(err.contains(flag) && err.contains(value), "{err}");
        }
    }
}
