//! The agent's configuration: what the operator may set (flags, `AI_LB_AGENT_*` env, an optional
//! YAML/TOML file; flags and env override the file), and the one place where those raw strings
//! are validated into an [`AgentConfig`]. Every error names the flag and the offending value.

use crate::kv_events::{KvEventsConfig, DEFAULT_BLOCK_TOKENS, DEFAULT_MAX_KEYS};
use crate::ports::{defaults as port_defaults, PortLimits};
use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a configuration was refused. The text is what the operator reads, so it names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid value {value:?} for --{flag}: expected {expected}")]
    InvalidValue {
        flag: &'static str,
        value: String,
        expected: String,
    },
    #[error("missing --{flag}: {why}")]
    Missing { flag: &'static str, why: String },
    #[error("{0}")]
    Args(String),
    #[error("cannot read --config {path}: {detail}")]
    File { path: String, detail: String },
}

/// Raw command line / environment. Every field is optional here so that the config file can
/// fill what the command line leaves out; defaults are applied during validation.
#[derive(Debug, Default, Clone, Parser)]
#[command(
    name = "ai-lb-agent",
    version,
    allow_negative_numbers = true,
    about = "ai-lb collector agent: GPU + model-server metrics streamed over gRPC"
)]
pub struct RawArgs {
    /// Optional YAML (.yaml/.yml) or TOML (.toml) file with the same keys as the flags
    /// (e.g. `sample-interval: 100ms`); flags and env override it.
    #[arg(long, env = "AI_LB_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:9090].
    #[arg(long, env = "AI_LB_AGENT_GRPC_LISTEN")]
    pub grpc_listen: Option<String>,
    /// HTTP (/metrics, /healthz, /readyz) listen address [default: 0.0.0.0:9091].
    #[arg(long, env = "AI_LB_AGENT_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    #[arg(long, env = "AI_LB_AGENT_POD_NAME")]
    pub pod_name: Option<String>,
    #[arg(long, env = "AI_LB_AGENT_NAMESPACE")]
    pub namespace: Option<String>,
    /// IP:PORT of the model server as Envoy routes to it (required).
    #[arg(long, env = "AI_LB_AGENT_SERVING_ADDRESS")]
    pub serving_address: Option<String>,
    /// nvml | sim | none [default: nvml].
    #[arg(long, env = "AI_LB_AGENT_GPU_SOURCE")]
    pub gpu_source: Option<String>,
    /// Base URL of the simulated GPU endpoint (`GET <url>/sim/gpu`), for --gpu-source sim.
    #[arg(long, env = "AI_LB_AGENT_SIM_URL")]
    pub sim_url: Option<String>,
    /// Base URL of the model server's metrics (`<url>/metrics`); no model-server source if unset.
    #[arg(long, env = "AI_LB_AGENT_MODEL_SERVER_URL")]
    pub model_server_url: Option<String>,
    /// auto | vllm | sglang | tgi | triton [default: auto].
    #[arg(long, env = "AI_LB_AGENT_ENGINE")]
    pub engine: Option<String>,
    /// Model served (repeatable), used when the model server does not say.
    #[arg(long = "model", env = "AI_LB_AGENT_MODEL", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Model version this pod serves (e.g. `v2` for a canary): reported as the version of
    /// every model, so the filter's `versions` routing can pin and split by it.
    #[arg(long, env = "AI_LB_AGENT_MODEL_VERSION")]
    pub model_version: Option<String>,
    /// Maximum concurrently running sequences, when the model server does not say.
    #[arg(long, env = "AI_LB_AGENT_QUEUE_CAPACITY")]
    pub queue_capacity: Option<String>,
    /// KV-cache capacity in tokens; wins over the model server's own figure.
    #[arg(long, env = "AI_LB_AGENT_KV_CAPACITY_TOKENS")]
    pub kv_capacity_tokens: Option<String>,
    /// How often the model server's metrics (every source but the GPUs) are read [default:
    /// 50ms, the rate the Gateway API Inference Extension's endpoint picker scrapes vLLM at].
    #[arg(long, env = "AI_LB_AGENT_SAMPLE_INTERVAL")]
    pub sample_interval: Option<String>,
    /// How often the GPUs (NVML, or the sim source) are read, on their own clock: a frozen
    /// model server does not delay them; at most --sample-interval [default: 20ms, or
    /// --sample-interval when shorter].
    #[arg(long, env = "AI_LB_AGENT_GPU_SAMPLE_INTERVAL")]
    pub gpu_sample_interval: Option<String>,
    /// How often NVML GPM activity (SM occupancy, SM, tensor and DRAM activity; Hopper and
    /// later) is computed from two samples; between them the last values are reported
    /// [default: 100ms].
    #[arg(long, env = "AI_LB_AGENT_GPM_INTERVAL")]
    pub gpm_interval: Option<String>,
    /// A read that has waited this long on the model server reports it failing, and keeps
    /// waiting up to the source timeout (500ms, or --sample-interval when longer). Filters cut
    /// a pod whose model server fails after it has answered once. A GPU read fails after this
    /// long [default: 3 × --sample-interval, at least 150ms].
    #[arg(long, env = "AI_LB_AGENT_SOURCE_STALL_AFTER")]
    pub source_stall_after: Option<String>,
    /// Window for latency quantiles [default: 10s].
    #[arg(long, env = "AI_LB_AGENT_WINDOW")]
    pub window: Option<String>,
    /// Window for request and error rates [default: 5s].
    #[arg(long, env = "AI_LB_AGENT_RATE_WINDOW")]
    pub rate_window: Option<String>,
    /// Window of the recent inter-token latency, how fast the pod decodes right now (filters
    /// compare it across the pool to see a pod slowed without its GPU saying so); at least 2
    /// × --sample-interval [default: 3 × --sample-interval, at least 150ms].
    #[arg(long, env = "AI_LB_AGENT_RECENT_WINDOW")]
    pub recent_window: Option<String>,
    /// Minimum interval between Watch pushes [default: 50ms].
    #[arg(long, env = "AI_LB_AGENT_WATCH_MIN_INTERVAL")]
    pub watch_min_interval: Option<String>,
    /// Heartbeat interval on idle streams [default: 1s].
    #[arg(long, env = "AI_LB_AGENT_HEARTBEAT")]
    pub heartbeat: Option<String>,
    /// Static peer agents, `host:port,host:port`.
    #[arg(long, env = "AI_LB_AGENT_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// DNS name (e.g. a headless Service) resolving to peer agents, `name:port`.
    #[arg(long, env = "AI_LB_AGENT_PEERS_DNS")]
    pub peers_dns: Option<String>,
    /// How often the peer DNS name is re-resolved [default: 5s].
    #[arg(long, env = "AI_LB_AGENT_PEERS_REFRESH")]
    pub peers_refresh: Option<String>,
    /// A peer with no event for this long is STALE [default: 3s].
    #[arg(long, env = "AI_LB_AGENT_PEER_STALE_AFTER")]
    pub peer_stale_after: Option<String>,
    /// The model server's KV-event PUB socket, `tcp://HOST:PORT` (vLLM
    /// `--kv-events-config` endpoint); no prefix-cache summary if unset.
    #[arg(long, env = "AI_LB_AGENT_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// Its replay socket, `tcp://HOST:PORT` (vLLM `replay_endpoint`), to fill sequence gaps.
    #[arg(long, env = "AI_LB_AGENT_KV_EVENTS_REPLAY_ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic to subscribe to [default: empty, vLLM's default topic].
    #[arg(long, env = "AI_LB_AGENT_KV_EVENTS_TOPIC")]
    pub kv_events_topic: Option<String>,
    /// Tokens per key block of the pushed summary; a multiple of the pod's KV block size
    /// [default: 64].
    #[arg(long, env = "AI_LB_AGENT_PREFIX_BLOCK_TOKENS")]
    pub prefix_block_tokens: Option<String>,
    /// Most keys in one summary; past it the most recently stored are kept [default: 4096].
    #[arg(long, env = "AI_LB_AGENT_PREFIX_MAX_KEYS")]
    pub prefix_max_keys: Option<String>,
    /// Open gRPC connections, all peers together; one over it is closed at once [default:
    /// 1024].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_CONNECTIONS")]
    pub grpc_max_connections: Option<String>,
    /// Open gRPC connections from one peer IP [default: 64].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_CONNECTIONS_PER_PEER")]
    pub grpc_max_connections_per_peer: Option<String>,
    /// Open Watch + WatchPool streams, all peers together; one over it gets
    /// RESOURCE_EXHAUSTED [default: 512].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_STREAMS")]
    pub grpc_max_streams: Option<String>,
    /// Open Watch + WatchPool streams from one peer IP [default: 32].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_STREAMS_PER_PEER")]
    pub grpc_max_streams_per_peer: Option<String>,
    /// RPCs of any kind in flight on one gRPC connection (HTTP/2
    /// SETTINGS_MAX_CONCURRENT_STREAMS) [default: 32].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_STREAMS_PER_CONNECTION")]
    pub grpc_max_streams_per_connection: Option<String>,
    /// Largest request message decoded, in bytes; a larger one is refused from its length
    /// prefix with OUT_OF_RANGE [default: 16384].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_REQUEST_BYTES")]
    pub grpc_max_request_bytes: Option<String>,
    /// Largest message sent, and accepted from peers' Watch, in bytes [default: 16777216].
    #[arg(long, env = "AI_LB_AGENT_GRPC_MAX_MESSAGE_BYTES")]
    pub grpc_max_message_bytes: Option<String>,
    /// A Watch/WatchPool subscriber that leaves an event untaken this long is dropped and its
    /// connection closed [default: 10s].
    #[arg(long, env = "AI_LB_AGENT_STREAM_SEND_TIMEOUT")]
    pub stream_send_timeout: Option<String>,
    /// A connection (either port) that sends no request this long after opening is closed
    /// [default: 10s].
    #[arg(long, env = "AI_LB_AGENT_FIRST_REQUEST_TIMEOUT")]
    pub first_request_timeout: Option<String>,
    /// Open HTTP (/metrics, probes) connections, all peers together [default: 64].
    #[arg(long, env = "AI_LB_AGENT_HTTP_MAX_CONNECTIONS")]
    pub http_max_connections: Option<String>,
    /// Open HTTP connections from one peer IP [default: 16].
    #[arg(long, env = "AI_LB_AGENT_HTTP_MAX_CONNECTIONS_PER_PEER")]
    pub http_max_connections_per_peer: Option<String>,
    /// GPU-memory watermark (pre-OOM): share of a GPU's memory at or above which fast growth
    /// starts a pre-OOM countdown, reported to the filters; `off` reports none [default: 0.92].
    #[arg(long, env = "AI_LB_AGENT_OOM_WATERMARK")]
    pub oom_watermark: Option<String>,
    /// Growth of used GPU memory, in bytes per second, above which an interval counts
    /// [default: 800000000].
    #[arg(long, env = "AI_LB_AGENT_OOM_GROWTH_BYTES_PER_S")]
    pub oom_growth_bytes_per_s: Option<String>,
    /// Intervals in a row above the watermark and the growth rate that start the countdown
    /// [default: 3].
    #[arg(long, env = "AI_LB_AGENT_OOM_CONSECUTIVE")]
    pub oom_consecutive: Option<String>,
    /// Length of the pre-OOM countdown [default: 15s].
    #[arg(long, env = "AI_LB_AGENT_OOM_COUNTDOWN")]
    pub oom_countdown: Option<String>,
    /// The interval the memory growth rate is taken over; at least --gpu-sample-interval
    /// [default: 500ms].
    #[arg(long, env = "AI_LB_AGENT_OOM_RATE_INTERVAL")]
    pub oom_rate_interval: Option<String>,
}

/// The same keys in a config file (kebab-case, as the flags), all optional.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileArgs {
    pub grpc_listen: Option<String>,
    pub http_listen: Option<String>,
    pub pod_name: Option<String>,
    pub namespace: Option<String>,
    pub serving_address: Option<String>,
    pub gpu_source: Option<String>,
    pub sim_url: Option<String>,
    pub model_server_url: Option<String>,
    pub engine: Option<String>,
    #[serde(default, alias = "model")]
    pub models: Vec<String>,
    pub model_version: Option<String>,
    pub queue_capacity: Option<serde_yaml::Value>,
    pub kv_capacity_tokens: Option<serde_yaml::Value>,
    pub sample_interval: Option<String>,
    pub gpu_sample_interval: Option<String>,
    pub gpm_interval: Option<String>,
    pub source_stall_after: Option<String>,
    pub oom_watermark: Option<serde_yaml::Value>,
    pub oom_growth_bytes_per_s: Option<serde_yaml::Value>,
    pub oom_consecutive: Option<serde_yaml::Value>,
    pub oom_countdown: Option<String>,
    pub oom_rate_interval: Option<String>,
    pub window: Option<String>,
    pub rate_window: Option<String>,
    pub recent_window: Option<String>,
    pub watch_min_interval: Option<String>,
    pub heartbeat: Option<String>,
    #[serde(default)]
    pub peers: Vec<String>,
    pub peers_dns: Option<String>,
    pub peers_refresh: Option<String>,
    pub peer_stale_after: Option<String>,
    pub kv_events_endpoint: Option<String>,
    pub kv_events_replay_endpoint: Option<String>,
    pub kv_events_topic: Option<String>,
    pub prefix_block_tokens: Option<serde_yaml::Value>,
    pub prefix_max_keys: Option<serde_yaml::Value>,
    pub grpc_max_connections: Option<serde_yaml::Value>,
    pub grpc_max_connections_per_peer: Option<serde_yaml::Value>,
    pub grpc_max_streams: Option<serde_yaml::Value>,
    pub grpc_max_streams_per_peer: Option<serde_yaml::Value>,
    pub grpc_max_streams_per_connection: Option<serde_yaml::Value>,
    pub grpc_max_request_bytes: Option<serde_yaml::Value>,
    pub grpc_max_message_bytes: Option<serde_yaml::Value>,
    pub stream_send_timeout: Option<String>,
    pub first_request_timeout: Option<String>,
    pub http_max_connections: Option<serde_yaml::Value>,
    pub http_max_connections_per_peer: Option<serde_yaml::Value>,
}

impl RawArgs {
    /// Reads `--config` (if any) and fills every field the command line left unset.
    pub fn merge_file(self) -> Result<RawArgs, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path).map_err(|e| ConfigError::File {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        let file = parse_file(&path, &text)?;
        Ok(self.merge(file))
    }

    /// Fills every field the command line left unset from a parsed config file (what
    /// [`RawArgs::merge_file`] does once the file is read).
    pub fn merge(mut self, file: FileArgs) -> RawArgs {
        fn fill(slot: &mut Option<String>, v: Option<String>) {
            if slot.is_none() {
                *slot = v;
            }
        }
        fill(&mut self.grpc_listen, file.grpc_listen);
        fill(&mut self.http_listen, file.http_listen);
        fill(&mut self.pod_name, file.pod_name);
        fill(&mut self.namespace, file.namespace);
        fill(&mut self.serving_address, file.serving_address);
        fill(&mut self.gpu_source, file.gpu_source);
        fill(&mut self.sim_url, file.sim_url);
        fill(&mut self.model_server_url, file.model_server_url);
        fill(&mut self.engine, file.engine);
        if self.models.is_empty() {
            self.models = file.models;
        }
        fill(&mut self.model_version, file.model_version);
        // Numbers in the file (`queue-capacity: 64`) keep their text, so validation reports
        // them as written.
        let text = |v: serde_yaml::Value| match v {
            serde_yaml::Value::String(s) => s,
            other => serde_yaml::to_string(&other)
                .unwrap_or_default()
                .trim()
                .to_string(),
        };
        fill(&mut self.queue_capacity, file.queue_capacity.map(text));
        fill(
            &mut self.kv_capacity_tokens,
            file.kv_capacity_tokens.map(text),
        );
        fill(&mut self.sample_interval, file.sample_interval);
        fill(&mut self.gpu_sample_interval, file.gpu_sample_interval);
        fill(&mut self.gpm_interval, file.gpm_interval);
        fill(&mut self.source_stall_after, file.source_stall_after);
        fill(&mut self.oom_watermark, file.oom_watermark.map(text));
        fill(
            &mut self.oom_growth_bytes_per_s,
            file.oom_growth_bytes_per_s.map(text),
        );
        fill(&mut self.oom_consecutive, file.oom_consecutive.map(text));
        fill(&mut self.oom_countdown, file.oom_countdown);
        fill(&mut self.oom_rate_interval, file.oom_rate_interval);
        fill(&mut self.window, file.window);
        fill(&mut self.rate_window, file.rate_window);
        fill(&mut self.recent_window, file.recent_window);
        fill(&mut self.watch_min_interval, file.watch_min_interval);
        fill(&mut self.heartbeat, file.heartbeat);
        if self.peers.is_empty() {
            self.peers = file.peers;
        }
        fill(&mut self.peers_dns, file.peers_dns);
        fill(&mut self.peers_refresh, file.peers_refresh);
        fill(&mut self.peer_stale_after, file.peer_stale_after);
        fill(&mut self.kv_events_endpoint, file.kv_events_endpoint);
        fill(
            &mut self.kv_events_replay_endpoint,
            file.kv_events_replay_endpoint,
        );
        fill(&mut self.kv_events_topic, file.kv_events_topic);
        fill(
            &mut self.prefix_block_tokens,
            file.prefix_block_tokens.map(text),
        );
        fill(&mut self.prefix_max_keys, file.prefix_max_keys.map(text));
        fill(
            &mut self.grpc_max_connections,
            file.grpc_max_connections.map(text),
        );
        fill(
            &mut self.grpc_max_connections_per_peer,
            file.grpc_max_connections_per_peer.map(text),
        );
        fill(&mut self.grpc_max_streams, file.grpc_max_streams.map(text));
        fill(
            &mut self.grpc_max_streams_per_peer,
            file.grpc_max_streams_per_peer.map(text),
        );
        fill(
            &mut self.grpc_max_streams_per_connection,
            file.grpc_max_streams_per_connection.map(text),
        );
        fill(
            &mut self.grpc_max_request_bytes,
            file.grpc_max_request_bytes.map(text),
        );
        fill(
            &mut self.grpc_max_message_bytes,
            file.grpc_max_message_bytes.map(text),
        );
        fill(&mut self.stream_send_timeout, file.stream_send_timeout);
        fill(&mut self.first_request_timeout, file.first_request_timeout);
        fill(
            &mut self.http_max_connections,
            file.http_max_connections.map(text),
        );
        fill(
            &mut self.http_max_connections_per_peer,
            file.http_max_connections_per_peer.map(text),
        );
        self
    }
}

/// The entry of the config file parser: reads `text` as the file `path` names it (`.yaml`,
/// `.yml` or `.toml`; only the extension of `path` is read, never the file).
pub fn parse_file(path: &Path, text: &str) -> Result<FileArgs, ConfigError> {
    let err = |detail: String| ConfigError::File {
        path: path.display().to_string(),
        detail,
    };
    match path.extension().and_then(|e| e.to_str()) {
        Some("toml") => toml::from_str(text).map_err(|e| err(e.to_string())),
        Some("yaml") | Some("yml") => serde_yaml::from_str(text).map_err(|e| err(e.to_string())),
        other => Err(err(format!(
            "unknown extension {:?}: expected .yaml, .yml or .toml",
            other.unwrap_or("")
        ))),
    }
}

/// Where GPU readings come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSource {
    Nvml,
    /// The fake pod's `GET <url>/sim/gpu`.
    Sim {
        url: String,
    },
    None,
}

/// Which engine's metric names to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    Vllm,
    Sglang,
    Tgi,
    Triton,
}

impl EngineChoice {
    /// The configured engine as the proto enum; `Unspecified` for auto-detection.
    pub fn to_proto(self) -> ai_lb_proto::v1::Engine {
        use ai_lb_proto::v1::Engine;
        match self {
            EngineChoice::Auto => Engine::Unspecified,
            EngineChoice::Vllm => Engine::Vllm,
            EngineChoice::Sglang => Engine::Sglang,
            EngineChoice::Tgi => Engine::Tgi,
            EngineChoice::Triton => Engine::Triton,
        }
    }
}

/// A validated configuration: every value parsed and checked, defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    pub grpc_listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub pod_name: String,
    pub namespace: String,
    pub serving_address: SocketAddr,
    pub gpu_source: GpuSource,
    /// The operator chose `--gpu-source` explicitly (nvml's absence then is the operator's call).
    pub gpu_source_explicit: bool,
    pub model_server_url: Option<String>,
    pub engine: EngineChoice,
    pub models: Vec<String>,
    /// `--model-version`: the version reported for every model (None: the model server's).
    pub model_version: Option<String>,
    pub queue_capacity: Option<u32>,
    /// KV-cache capacity in tokens; wins over the model server's when set.
    pub kv_capacity_tokens: Option<u64>,
    pub sample_interval: Duration,
    /// How often the local (GPU) sources are read; never longer than `sample_interval`.
    pub gpu_sample_interval: Duration,
    /// How often GPM activity is recomputed from two samples (`--gpm-interval`).
    pub gpm_interval: Duration,
    /// `--source-stall-after`; None: the sampler's default for the sample interval.
    pub source_stall_after: Option<Duration>,
    pub window: Duration,
    /// Window of the request and error rates.
    pub rate_window: Duration,
    /// Window of the recent inter-token latency (`--recent-window`).
    pub recent_window: Duration,
    pub watch_min_interval: Duration,
    pub heartbeat: Duration,
    /// `host:port` of each static peer.
    pub peers: Vec<String>,
    /// `name:port` to resolve for peers.
    pub peers_dns: Option<String>,
    pub peers_refresh: Duration,
    pub peer_stale_after: Duration,
    /// The KV-event subscription; `None`: no prefix-cache summary.
    pub kv_events: Option<KvEventsConfig>,
    /// The caps on what peers may hold on the agent's ports.
    pub limits: PortLimits,
    /// The GPU-memory watermark (`--oom-*`); None: `--oom-watermark off`.
    pub oom: Option<crate::watermark::WatermarkConfig>,
}

impl AgentConfig {
    /// Parses the process's flags/env/file; `Err` carries the operator-facing message.
    pub fn from_args<I, T>(args: I) -> Result<AgentConfig, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let raw = RawArgs::try_parse_from(args).map_err(|e| ConfigError::Args(e.to_string()))?;
        AgentConfig::try_from(raw.merge_file()?)
    }

    /// A config for tests and embedding: the given serving address, everything else default,
    /// no GPU source.
    pub fn for_tests(serving_address: SocketAddr) -> AgentConfig {
        let raw = RawArgs {
            serving_address: Some(serving_address.to_string()),
            gpu_source: Some("none".into()),
            grpc_listen: Some("127.0.0.1:0".into()),
            http_listen: Some("127.0.0.1:0".into()),
            ..RawArgs::default()
        };
        match AgentConfig::try_from(raw) {
            Ok(c) => c,
            // Unreachable: the raw values above are valid by construction.
            Err(e) => unreachable!("default test config is invalid: {e}"),
        }
    }
}

fn invalid(flag: &'static str, value: &str, expected: &str) -> ConfigError {
    ConfigError::InvalidValue {
        flag,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Parses `100ms`, `2s`, `1m`, `500us`; `0` alone is zero.
pub fn parse_duration(flag: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let err = || invalid(flag, value, "a duration like 100ms or 2s");
    let v = value.trim();
    if v == "0" {
        return Ok(Duration::ZERO);
    }
    let split = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .ok_or_else(err)?;
    let (num, unit) = v.split_at(split);
    let n: f64 = num.parse().map_err(|_| err())?;
    let scale_ms = match unit {
        "us" | "µs" => 0.001,
        "ms" => 1.0,
        "s" => 1000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        _ => return Err(err()),
    };
    let ms = n * scale_ms;
    if !ms.is_finite() || !(0.0..=1e12).contains(&ms) {
        return Err(err());
    }
    Ok(Duration::from_micros((ms * 1000.0).round() as u64))
}

fn duration_in(
    flag: &'static str,
    value: Option<&str>,
    default: &str,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let v = value.unwrap_or(default);
    let d = parse_duration(flag, v)?;
    if d < min || d > max {
        return Err(invalid(
            flag,
            v,
            &format!("a duration between {min:?} and {max:?}"),
        ));
    }
    Ok(d)
}

fn socket_addr(
    flag: &'static str,
    value: Option<&str>,
    default: &str,
) -> Result<SocketAddr, ConfigError> {
    let v = value.unwrap_or(default);
    v.trim()
        .parse()
        .map_err(|_| invalid(flag, v, "an address like 0.0.0.0:9090 (IP:PORT)"))
}

/// `host:port` with a non-empty host and a numeric port.
fn host_port(flag: &'static str, value: &str) -> Result<String, ConfigError> {
    let v = value.trim();
    let err = || invalid(flag, value, "host:port, e.g. agent-0.agents:9090");
    let (host, port) = v.rsplit_once(':').ok_or_else(err)?;
    let port: u16 = port.parse().map_err(|_| err())?;
    if host.is_empty() || port == 0 || host.contains('/') || host.contains(char::is_whitespace) {
        return Err(err());
    }
    Ok(v.to_string())
}

/// `tcp://HOST:PORT` with a non-empty host and a non-zero port (what a ZeroMQ subscriber
/// connects to).
fn zmq_tcp(flag: &'static str, value: &str) -> Result<String, ConfigError> {
    let v = value.trim();
    let err = || invalid(flag, value, "tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557");
    let rest = v.strip_prefix("tcp://").ok_or_else(err)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(err)?;
    let port: u16 = port.parse().map_err(|_| err())?;
    if host.is_empty() || host == "*" || port == 0 || host.contains(['/', ' ']) {
        return Err(err());
    }
    Ok(v.to_string())
}

/// A positive integer no larger than `max`.
fn positive(
    flag: &'static str,
    value: Option<&str>,
    default: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    match value {
        None => Ok(default),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 && n <= max => Ok(n),
            _ => Err(invalid(flag, v, &format!("a positive integer up to {max}"))),
        },
    }
}

fn http_url(flag: &'static str, value: &str) -> Result<String, ConfigError> {
    let v = value.trim().trim_end_matches('/');
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"));
    match rest {
        Some(r) if !r.is_empty() && !r.contains(char::is_whitespace) => Ok(v.to_string()),
        _ => Err(invalid(flag, value, "a URL like http://127.0.0.1:8000")),
    }
}

impl TryFrom<RawArgs> for AgentConfig {
    type Error = ConfigError;

    fn try_from(raw: RawArgs) -> Result<AgentConfig, ConfigError> {
        let grpc_listen = socket_addr("grpc-listen", raw.grpc_listen.as_deref(), "0.0.0.0:9090")?;
        let http_listen = socket_addr("http-listen", raw.http_listen.as_deref(), "0.0.0.0:9091")?;
        let serving = raw.serving_address.as_deref().ok_or(ConfigError::Missing {
            flag: "serving-address",
            why: "the IP:PORT Envoy routes to for this pod (the key the filter writes)".into(),
        })?;
        let serving_address: SocketAddr = serving
            .trim()
            .parse()
            .map_err(|_| invalid("serving-address", serving, "IP:PORT, e.g. 10.0.3.7:8000"))?;
        if serving_address.port() == 0 || serving_address.ip().is_unspecified() {
            return Err(invalid(
                "serving-address",
                serving,
                "a routable IP:PORT (not 0.0.0.0 or port 0)",
            ));
        }

        let sim_url = raw
            .sim_url
            .as_deref()
            .map(|u| http_url("sim-url", u))
            .transpose()?;
        let gpu_source_explicit = raw.gpu_source.is_some();
        let gpu_source = match raw.gpu_source.as_deref().map(str::trim).unwrap_or("nvml") {
            "nvml" => GpuSource::Nvml,
            "none" => GpuSource::None,
            "sim" => GpuSource::Sim {
                url: sim_url.ok_or(ConfigError::Missing {
                    flag: "sim-url",
                    why: "--gpu-source sim reads GET <sim-url>/sim/gpu".into(),
                })?,
            },
            other => return Err(invalid("gpu-source", other, "one of nvml, sim, none")),
        };
        let model_server_url = raw
            .model_server_url
            .as_deref()
            .map(|u| http_url("model-server-url", u))
            .transpose()?;
        let engine = match raw.engine.as_deref().map(str::trim).unwrap_or("auto") {
            "auto" => EngineChoice::Auto,
            "vllm" => EngineChoice::Vllm,
            "sglang" => EngineChoice::Sglang,
            "tgi" => EngineChoice::Tgi,
            "triton" => EngineChoice::Triton,
            other => {
                return Err(invalid(
                    "engine",
                    other,
                    "one of auto, vllm, sglang, tgi, triton",
                ))
            }
        };
        let mut models = Vec::new();
        for m in &raw.models {
            let m = m.trim();
            if m.is_empty() {
                return Err(invalid("model", m, "a non-empty model name"));
            }
            models.push(m.to_string());
        }
        let model_version = match raw.model_version.as_deref().map(str::trim) {
            None => None,
            Some(v) if !v.is_empty() && v.len() <= 128 && !v.chars().any(char::is_control) => {
                Some(v.to_string())
            }
            Some(v) => {
                return Err(invalid(
                    "model-version",
                    v,
                    "a non-empty version of at most 128 printable characters",
                ))
            }
        };
        let queue_capacity = match raw.queue_capacity.as_deref() {
            None => None,
            Some(v) => match v.trim().parse::<u32>() {
                Ok(n) if n > 0 => Some(n),
                _ => return Err(invalid("queue-capacity", v, "a positive integer")),
            },
        };
        let kv_capacity_tokens = match raw.kv_capacity_tokens.as_deref() {
            None => None,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n > 0 => Some(n),
                _ => return Err(invalid("kv-capacity-tokens", v, "a positive integer")),
            },
        };
        let ms = Duration::from_millis;
        let sample_interval = duration_in(
            "sample-interval",
            raw.sample_interval.as_deref(),
            "50ms",
            ms(1),
            ms(60_000),
        )?;
        let gpu_sample_interval = match raw.gpu_sample_interval.as_deref() {
            None => ms(20).min(sample_interval),
            Some(v) => {
                let d = duration_in("gpu-sample-interval", Some(v), "20ms", ms(1), ms(60_000))?;
                if d > sample_interval {
                    return Err(invalid(
                        "gpu-sample-interval",
                        v,
                        &format!(
                            "a duration no longer than --sample-interval ({sample_interval:?})"
                        ),
                    ));
                }
                d
            }
        };
        let gpm_interval = duration_in(
            "gpm-interval",
            raw.gpm_interval.as_deref(),
            "100ms",
            ms(10),
            ms(60_000),
        )?;
        let source_stall_after = match raw.source_stall_after.as_deref() {
            None => None,
            Some(v) => Some(duration_in(
                "source-stall-after",
                Some(v),
                "150ms",
                ms(1),
                ms(60_000),
            )?),
        };
        // A window (of quantiles or of rates): 100 ms to 1 h, and at least one sample long.
        let window_in = |flag: &'static str, v: Option<&str>, default: &str| {
            let w = duration_in(flag, v, default, ms(100), ms(3_600_000))?;
            if w < sample_interval {
                return Err(invalid(
                    flag,
                    v.unwrap_or(default),
                    "a duration at least as long as --sample-interval",
                ));
            }
            Ok(w)
        };
        let window = window_in("window", raw.window.as_deref(), "10s")?;
        let rate_window = window_in("rate-window", raw.rate_window.as_deref(), "5s")?;
        // Two scrapes at least, so the window always holds a delta.
        let recent_window = match raw.recent_window.as_deref() {
            None => (sample_interval * 3).max(ms(150)),
            Some(v) => {
                let w = duration_in("recent-window", Some(v), "250ms", ms(20), ms(60_000))?;
                if w < sample_interval * 2 {
                    return Err(invalid(
                        "recent-window",
                        v,
                        &format!(
                            "a duration at least 2 × --sample-interval ({:?})",
                            sample_interval * 2
                        ),
                    ));
                }
                w
            }
        };
        let watch_min_interval = duration_in(
            "watch-min-interval",
            raw.watch_min_interval.as_deref(),
            "50ms",
            Duration::ZERO,
            ms(60_000),
        )?;
        let heartbeat = duration_in(
            "heartbeat",
            raw.heartbeat.as_deref(),
            "1s",
            ms(10),
            ms(3_600_000),
        )?;
        let mut peers = Vec::new();
        for p in raw.peers.iter().map(|p| p.trim()).filter(|p| !p.is_empty()) {
            peers.push(host_port("peers", p)?);
        }
        let peers_dns = raw
            .peers_dns
            .as_deref()
            .map(|p| host_port("peers-dns", p))
            .transpose()?;
        let peers_refresh = duration_in(
            "peers-refresh",
            raw.peers_refresh.as_deref(),
            "5s",
            ms(10),
            ms(3_600_000),
        )?;
        let peer_stale_after = duration_in(
            "peer-stale-after",
            raw.peer_stale_after.as_deref(),
            "3s",
            ms(10),
            ms(3_600_000),
        )?;
        if peer_stale_after <= heartbeat && (!peers.is_empty() || peers_dns.is_some()) {
            return Err(invalid(
                "peer-stale-after",
                raw.peer_stale_after.as_deref().unwrap_or("3s"),
                &format!(
                    "a duration longer than --heartbeat ({heartbeat:?}), or live peers look stale"
                ),
            ));
        }
        let prefix_block_tokens = positive(
            "prefix-block-tokens",
            raw.prefix_block_tokens.as_deref(),
            u64::from(DEFAULT_BLOCK_TOKENS),
            1 << 16,
        )? as u32;
        let prefix_max_keys = positive(
            "prefix-max-keys",
            raw.prefix_max_keys.as_deref(),
            DEFAULT_MAX_KEYS as u64,
            1 << 20,
        )? as usize;
        let kv_events = match raw.kv_events_endpoint.as_deref() {
            None => {
                if let Some(r) = raw.kv_events_replay_endpoint.as_deref() {
                    return Err(invalid(
                        "kv-events-replay-endpoint",
                        r,
                        "--kv-events-endpoint as well (the replay socket fills gaps of that stream)",
                    ));
                }
                None
            }
            Some(ep) => Some(KvEventsConfig {
                endpoint: zmq_tcp("kv-events-endpoint", ep)?,
                replay_endpoint: raw
                    .kv_events_replay_endpoint
                    .as_deref()
                    .map(|r| zmq_tcp("kv-events-replay-endpoint", r))
                    .transpose()?,
                topic: raw.kv_events_topic.clone().unwrap_or_default(),
                block_tokens: prefix_block_tokens,
                max_keys: prefix_max_keys,
            }),
        };
        let limits = port_limits(&raw)?;
        let oom = oom_watermark(&raw, gpu_sample_interval)?;
        Ok(AgentConfig {
            grpc_listen,
            http_listen,
            pod_name: raw.pod_name.unwrap_or_default().trim().to_string(),
            namespace: raw.namespace.unwrap_or_default().trim().to_string(),
            serving_address,
            gpu_source,
            gpu_source_explicit,
            model_server_url,
            engine,
            models,
            model_version,
            queue_capacity,
            kv_capacity_tokens,
            sample_interval,
            gpu_sample_interval,
            gpm_interval,
            source_stall_after,
            window,
            rate_window,
            recent_window,
            watch_min_interval,
            heartbeat,
            peers,
            peers_dns,
            peers_refresh,
            peer_stale_after,
            kv_events,
            limits,
            oom,
        })
    }
}

/// The `--oom-*` flags (see [`crate::watermark`]).
fn oom_watermark(
    raw: &RawArgs,
    gpu_sample_interval: Duration,
) -> Result<Option<crate::watermark::WatermarkConfig>, ConfigError> {
    let ms = Duration::from_millis;
    let countdown = raw
        .oom_countdown
        .as_deref()
        .map(|v| duration_in("oom-countdown", Some(v), "15s", ms(1), ms(3_600_000)))
        .transpose()?;
    let interval = match raw.oom_rate_interval.as_deref() {
        None => None,
        Some(v) => {
            let d = duration_in("oom-rate-interval", Some(v), "500ms", ms(1), ms(60_000))?;
            if d < gpu_sample_interval {
                return Err(invalid(
                    "oom-rate-interval",
                    v,
                    &format!("a duration no shorter than --gpu-sample-interval ({gpu_sample_interval:?})"),
                ));
            }
            Some(d)
        }
    };
    crate::watermark::WatermarkConfig::from_flags(
        raw.oom_watermark.as_deref(),
        raw.oom_growth_bytes_per_s.as_deref(),
        raw.oom_consecutive.as_deref(),
        countdown,
        interval,
    )
    .map_err(|(flag, value, expected)| invalid(flag, &value, expected))
}

/// An integer in `min..=max` (`default` when unset).
fn integer_in(
    flag: &'static str,
    value: Option<&str>,
    default: usize,
    min: usize,
    max: usize,
) -> Result<usize, ConfigError> {
    match value {
        None => Ok(default),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            _ => Err(invalid(
                flag,
                v,
                &format!("an integer between {min} and {max}"),
            )),
        },
    }
}

/// A per-peer cap, no larger than the total cap it belongs to.
fn per_peer_cap(
    flag: &'static str,
    value: Option<&str>,
    default: usize,
    total_flag: &str,
    total: usize,
) -> Result<usize, ConfigError> {
    let n = integer_in(flag, value, default.min(total), 1, 65_536)?;
    if n > total {
        return Err(invalid(
            flag,
            value.unwrap_or_default(),
            &format!("at most --{total_flag} ({total})"),
        ));
    }
    Ok(n)
}

/// The caps on the agent's ports (see `ports.rs` for what each one bounds).
fn port_limits(raw: &RawArgs) -> Result<PortLimits, ConfigError> {
    use port_defaults::*;
    let ms = Duration::from_millis;
    let grpc_max_connections = integer_in(
        "grpc-max-connections",
        raw.grpc_max_connections.as_deref(),
        GRPC_MAX_CONNECTIONS,
        1,
        65_536,
    )?;
    let grpc_max_streams = integer_in(
        "grpc-max-streams",
        raw.grpc_max_streams.as_deref(),
        GRPC_MAX_STREAMS,
        1,
        65_536,
    )?;
    let http_max_connections = integer_in(
        "http-max-connections",
        raw.http_max_connections.as_deref(),
        HTTP_MAX_CONNECTIONS,
        1,
        65_536,
    )?;
    Ok(PortLimits {
        grpc_max_connections,
        grpc_max_connections_per_peer: per_peer_cap(
            "grpc-max-connections-per-peer",
            raw.grpc_max_connections_per_peer.as_deref(),
            GRPC_MAX_CONNECTIONS_PER_PEER,
            "grpc-max-connections",
            grpc_max_connections,
        )?,
        grpc_max_streams,
        grpc_max_streams_per_peer: per_peer_cap(
            "grpc-max-streams-per-peer",
            raw.grpc_max_streams_per_peer.as_deref(),
            GRPC_MAX_STREAMS_PER_PEER,
            "grpc-max-streams",
            grpc_max_streams,
        )?,
        grpc_max_streams_per_connection: integer_in(
            "grpc-max-streams-per-connection",
            raw.grpc_max_streams_per_connection.as_deref(),
            GRPC_MAX_STREAMS_PER_CONNECTION as usize,
            1,
            4096,
        )? as u32,
        grpc_max_request_bytes: integer_in(
            "grpc-max-request-bytes",
            raw.grpc_max_request_bytes.as_deref(),
            GRPC_MAX_REQUEST_BYTES,
            1024,
            64 << 20,
        )?,
        grpc_max_message_bytes: integer_in(
            "grpc-max-message-bytes",
            raw.grpc_max_message_bytes.as_deref(),
            GRPC_MAX_MESSAGE_BYTES,
            64 << 10,
            1 << 30,
        )?,
        stream_send_timeout: duration_in(
            "stream-send-timeout",
            raw.stream_send_timeout.as_deref(),
            "10s",
            ms(100),
            ms(600_000),
        )?,
        first_request_timeout: duration_in(
            "first-request-timeout",
            raw.first_request_timeout.as_deref(),
            "10s",
            ms(100),
            ms(600_000),
        )?,
        http_max_connections,
        http_max_connections_per_peer: per_peer_cap(
            "http-max-connections-per-peer",
            raw.http_max_connections_per_peer.as_deref(),
            HTTP_MAX_CONNECTIONS_PER_PEER,
            "http-max-connections",
            http_max_connections,
        )?,
    })
}

#[cfg(test)]
mod tests;
