//! Decides whether a plugin configuration is acceptable and resolves it into validated types:
//! raw serde structs (unknown fields rejected with their path), then `TryFrom<Raw>` checks every
//! range and resolves scoring weights (pod override > pool override > model-type template >
//! defaults). Every error names the JSON path, the value and the accepted range.

use std::collections::BTreeMap;

#[cfg(feature = "schema")]
use serde_json::Value;

use crate::adaptive::AdaptiveThresholds;
use crate::admission::AdmissionConfig;
use crate::error::ConfigError;
use crate::recovery::RecoveryRamp;

mod raw;
use raw::RawConfig;

/// Upper bound for `fallbackEndpoints` (the ranked list has at most this many + 1 entries).
pub const MAX_FALLBACK_ENDPOINTS: usize = 15;

/// What the filter instance does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Client sidecar: scores pods and steers requests (`x-gateway-destination-endpoint`).
    #[default]
    Route,
    /// Inbound guard in front of one model server (admission control).
    Guard,
}

/// How the picker chooses among pods that are not cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PickStrategy {
    /// Draw two candidates, each in proportion to its smoothed score; a pod with a free seat
    /// beats one where the request would queue, then the lower estimated occupancy (snapshot
    /// running + waiting, moved by this sidecar's own starts and ends since, over the pod's
    /// capacity) wins. Equal keys (idle pods): the first draw, so an idle pool gets exactly
    /// the score-proportional shares.
    #[default]
    TwoChoices,
    /// One draw in proportion to the smoothed score divided by `1 + inflight / capacity`
    /// (this sidecar's requests started since the pod's last snapshot).
    Proportional,
}

impl PickStrategy {
    pub fn as_str(&self) -> &'static str {
        match self {
            PickStrategy::TwoChoices => "twoChoices",
            PickStrategy::Proportional => "proportional",
        }
    }
}

/// Scoring weights of the four terms, normalised so they sum to 1.
///
/// In JSON each weights object is complete on its own: a missing key means 0 (it does NOT
/// inherit from a less specific level). Values must be ≥ 0 and finite with a positive sum;
/// they are divided by their sum, so `{"gpu":2,"queue":2}` equals `{"gpu":0.5,"queue":0.5}`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub gpu: f64,
    pub queue: f64,
    pub p99: f64,
    pub memory: f64,
}

impl Default for Weights {
    /// gpu 0.35, queue 0.25, p99 0.25, memory 0.15.
    fn default() -> Self {
        Self {
            gpu: 0.35,
            queue: 0.25,
            p99: 0.25,
            memory: 0.15,
        }
    }
}

/// Hard limits that zero a pod's score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cutoffs {
    /// The GPU reading (see `gpu_signal`) above this (0..=1] cuts the pod (under `twoChoices`
    /// it still takes a request when the other drawn pod would queue too and it is the less
    /// loaded).
    pub gpu_hard_limit: f64,
    /// Which GPU reading the GPU term and the GPU cut-off use.
    pub gpu_signal: crate::signals::GpuSignal,
    /// Waiting requests at or above this cut the pod; also the queue term's scale.
    pub max_queue: u32,
    /// The p99 term's scale: p99 at or above it scores 0 on that term (not a cut).
    pub p99_timeout_ms: u64,
    /// Metrics older than this (ms) cut the pod as stale.
    pub staleness_ms: u64,
    /// Multiplies the draw weight of a pod whose GPU reports a hardware slowdown
    /// ([`crate::signals::SLOWDOWN_REASONS`]); 1 ignores it. Not a cut: a slowed pod still
    /// serves when the others are full.
    pub slowdown_factor: f64,
    /// Cut a pod whose model server stopped answering its agent
    /// ([`crate::signals::PodSignals::model_server_down`]).
    pub cut_model_server_down: bool,
    /// A pod whose recent inter-token latency is at least this many times the pool's median
    /// gets the `slowdown_factor` penalty too, as if its GPU reported a slowdown; 0 = off.
    pub slow_itl_ratio: f64,
}

impl Default for Cutoffs {
    fn default() -> Self {
        Self {
            gpu_hard_limit: 0.95,
            gpu_signal: crate::signals::GpuSignal::Auto,
            max_queue: 64,
            p99_timeout_ms: 5000,
            staleness_ms: 2000,
            slowdown_factor: 0.25,
            cut_model_server_down: true,
            slow_itl_ratio: 3.0,
        }
    }
}

/// Circuit breaker settings (see [`crate::breaker`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive passive failures that open the breaker.
    pub consecutive_failures: u32,
    /// First cooldown; doubles on every re-open until the breaker has stayed closed for
    /// `max_cooldown_ms`. Lengthened per sidecar by 0-100 % (see `Breaker::with_jitter`).
    pub base_cooldown_ms: u64,
    /// Cap of the doubling cooldown (≥ base).
    pub max_cooldown_ms: u64,
    /// Probes admitted while half-open, the first alone and the rest once it has succeeded (a pod that still fails costs one request per cooldown); that many successes close the breaker. A probe succeeds at its first response byte (status below 500, first token within `ttftSloMs`), so long streamed answers do not keep a recovered pod half-open; a later reset still counts as a failure. `wellFormedProbes`, when set, replaces it (and judges each probe at its answer's end).
    pub half_open_probes: u32,
    /// A response whose time to first token exceeds this counts as a failure. None = off.
    pub ttft_slo_ms: Option<u64>,
    /// Failure share over the last `failure_rate_window_ms` that opens the breaker, once at
    /// least `failure_rate_min_requests` outcomes were seen (a pod failing half its requests
    /// rarely fails `consecutive_failures` in a row).
    pub failure_rate: f64,
    pub failure_rate_window_ms: u64,
    pub failure_rate_min_requests: u32,
    /// Open on the pod's error rate as its agent reports it (all clients' requests over the
    /// agent's window) once it reaches this share, over at least `failure_rate_min_requests`
    /// requests (1 on probation, see [`Breaker::on_probation`]), unless more
    /// than half the pool's pods do too. 0 = off.
    ///
    /// [`Breaker::on_probation`]: crate::breaker::Breaker::on_probation
    pub agent_error_rate: f64,
    /// `recoveryRamp`: after a close, the pod's weight ramps back in steps ([`crate::recovery`]).
    /// None = off (the whole share at once).
    pub recovery_ramp: Option<RecoveryRamp>,
    /// `adaptiveThresholds`: each pod's `failure_rate`, `agent_error_rate` and `ttft_slo_ms`
    /// move within ±`maxAdjust` of these with its pool's background ([`crate::adaptive`]).
    /// None = off (the static thresholds).
    pub adaptive_thresholds: Option<AdaptiveThresholds>,
    /// `truncation`: truncated answers while the pod answers GPU out-of-memory errors open its
    /// breaker ([`crate::triggers`]). None = off.
    pub truncation: Option<crate::triggers::Truncation>,
    /// `wellFormedProbes`: a half-open pod closes after this many probes in a row that passed
    /// and answered well-formed OpenAI JSON ([`crate::triggers`]); it replaces
    /// `half_open_probes`. None = off.
    pub well_formed_probes: Option<u32>,
    /// `syntheticProbe` is configured ([`FilterConfig::synthetic_probe`] holds it): half-open
    /// pods take only the filter's own probes, no client request ([`crate::probe`]).
    pub synthetic_probes: bool,
}

impl BreakerConfig {
    /// Successful probes that close a half-open breaker (and probes admitted while half-open).
    pub fn probes_to_close(&self) -> u32 {
        self.well_formed_probes.unwrap_or(self.half_open_probes)
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_cooldown_ms: 5000,
            max_cooldown_ms: 60_000,
            half_open_probes: 3,
            ttft_slo_ms: None,
            failure_rate: 0.5,
            failure_rate_window_ms: 10_000,
            failure_rate_min_requests: 10,
            agent_error_rate: 0.25,
            recovery_ramp: None,
            adaptive_thresholds: None,
            truncation: None,
            well_formed_probes: None,
            synthetic_probes: false,
        }
    }
}

/// Settings of the pool subscription (used by the glue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchConfig {
    /// `WatchPoolRequest.min_interval_ms`; 0 = the agent's default.
    pub min_interval_ms: u32,
    /// `WatchPoolRequest.heartbeat_ms`; 0 = the agent's default.
    pub heartbeat_ms: u32,
    /// First reconnect delay after the stream closes (> 0).
    pub reconnect_base_ms: u64,
    /// Cap of the doubling reconnect delay (≥ base).
    pub reconnect_max_ms: u64,
    /// How often worker VMs re-read the shared pool state (> 0).
    pub refresh_ms: u64,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            min_interval_ms: 0,
            heartbeat_ms: 0,
            reconnect_base_ms: 250,
            reconnect_max_ms: 10_000,
            refresh_ms: 20,
        }
    }
}

/// Holding big requests in the sidecar (`bigRequestHold`): a request holding at least four
/// times the mean request's KV-cache tokens waits in the sidecar while no pod of its pool
/// would start it at once with `kvHeadroom` of its KV cache to spare (see
/// [`crate::picker::Router::should_hold`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BigRequestHold {
    /// Share of a pod's KV cache a big request must leave free, in [0, 1).
    pub kv_headroom: f64,
    /// Longest wait in the sidecar (ms, > 0); then it is routed as if the hold were off.
    pub max_hold_ms: u64,
    /// Most requests held per worker (≥ 1); one more is routed at once.
    pub max_held: usize,
    /// Held only if it holds at least this share of the largest KV cache among the pool's
    /// pods, in [0, 1]: a request that needs a large part of a pod's cache waits there for
    /// many requests to end, and everything behind it waits too; the long tail of ordinary
    /// traffic (four times the mean, a few per cent of the cache) does not.
    pub min_kv_share: f64,
}

impl Default for BigRequestHold {
    fn default() -> Self {
        Self {
            kv_headroom: 0.2,
            max_hold_ms: 10_000,
            max_held: 256,
            min_kv_share: 0.25,
        }
    }
}

/// One pool of pods (one Envoy cluster) this filter steers.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    pub name: String,
    /// The Envoy cluster serving inference (the one with `override_host`).
    pub cluster: String,
    /// The Envoy cluster reaching the agents' gRPC `WatchPool`. Defaults to `cluster`.
    pub agent_cluster: String,
    /// `:authority` for agent calls. Defaults to `ai-lb-agent`.
    pub agent_authority: String,
    /// Key into `weightTemplates` (e.g. `llm`, `vision`, `speech`).
    pub model_type: Option<String>,
    /// Pool-level weights after resolution (pool override > template > defaults).
    pub weights: Weights,
    /// Per-pod overrides keyed by the serving address `IP:PORT`.
    pub pod_weights: BTreeMap<String, Weights>,
}

impl PoolConfig {
    /// The weights for one pod: its override if any, else the pool's.
    pub fn weights_for(&self, address: &str) -> &Weights {
        self.pod_weights.get(address).unwrap_or(&self.weights)
    }
}

/// The validated plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterConfig {
    pub mode: Mode,
    pub pools: Vec<PoolConfig>,
    pub weight_templates: BTreeMap<String, Weights>,
    pub cutoffs: Cutoffs,
    pub breaker: BreakerConfig,
    /// EMA smoothing factor in (0, 1]; 1 = no smoothing.
    pub ema_alpha: f64,
    /// Fewer candidate pods with fresh metrics than this ⇒ steer nothing (≥ 1).
    pub min_pods: usize,
    /// Least pick weight of a pod that is not cut, in [0, 1).
    pub floor_weight: f64,
    /// How a pod is chosen among those not cut.
    pub pick_strategy: PickStrategy,
    /// Requests reserving at least this many output tokens prefer the faster-decoding pod
    /// (`twoChoices`; see [`crate::picker`]); 0 = off.
    pub long_output_tokens: u64,
    /// The share of a pod's seats long answers may hold (as this VM estimates them) for the
    /// finish-time comparison to send it one of `long_output_tokens`, in proportion for a
    /// longer one (0..=1; 1 = no limit).
    pub long_output_seat_share: f64,
    /// Header carrying `IP:PORT[,IP:PORT...]` to Envoy's `override_host` policy.
    pub routing_header: String,
    /// Extra ranked endpoints after the chosen one (0..=15), for retries.
    pub fallback_endpoints: usize,
    /// Request header naming the model; None = every pod in the pool serves every request.
    pub model_header: Option<String>,
    /// Request header that asks for the scoreboard in a response header.
    pub debug_header: Option<String>,
    /// Path answered locally with the scoreboard JSON.
    pub status_path: Option<String>,
    /// Most request-body bytes the filter holds back to read the model, the output
    /// reservation and the prompt (and admission to cost it); the rest streams untouched.
    pub max_body_read_bytes: u32,
    pub watch: WatchConfig,
    /// Holding big requests in the sidecar while no pod has room for them (None = off).
    pub big_request_hold: Option<BigRequestHold>,
    /// Prefix-cache affinity (None = off; see [`crate::prefix`]).
    pub prefix_affinity: Option<crate::prefix::PrefixAffinity>,
    /// Admission control, validated by [`AdmissionConfig::from_value`] (error paths start with
    /// `admission.`). None (absent or null in the JSON) = admission off.
    pub admission: Option<AdmissionConfig>,
    /// Model-version routing and breaker domains ([`crate::versions`]; None = off).
    pub versions: Option<std::sync::Arc<crate::versions::VersionsConfig>>,
    /// Learned weights: a per-pool model trained on outcomes scores the pods it has seen
    /// enough of (None = off; see [`crate::learned`]).
    pub learned_weights: Option<crate::learned::LearnedWeights>,
    /// Degrade before OOM ([`crate::pre_oom`]); None: `preOom.enabled` false.
    pub pre_oom: Option<crate::pre_oom::PreOomConfig>,
    /// `breaker.syntheticProbe`: half-open pods are probed with this request of the filter's
    /// own (None = off: client requests are the probes; see [`crate::probe`]).
    pub synthetic_probe: Option<crate::probe::SyntheticProbe>,
}

/// `maxBodyReadBytes` when unset: half of Envoy's default buffer limit (1 MiB).
pub const DEFAULT_MAX_BODY_READ_BYTES: u32 = 512 * 1024;

impl FilterConfig {
    /// Parses and validates the plugin configuration JSON.
    pub fn from_json(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(serde_error)?;
        de.end()
            .map_err(|e| ConfigError::new("", "", format!("trailing data: {e}")))?;
        FilterConfig::try_from(raw)
    }

    /// Whether a request of `size` is a long answer (`longOutputTokens`).
    pub fn is_long_answer(&self, size: &crate::picker::RequestSize) -> bool {
        self.long_output_tokens > 0 && size.output_tokens >= self.long_output_tokens as f64
    }

    /// Index of the pool with this name.
    pub fn pool_by_name(&self, name: &str) -> Option<usize> {
        self.pools.iter().position(|p| p.name == name)
    }

    /// Index of the pool whose inference cluster is `cluster`.
    pub fn pool_by_cluster(&self, cluster: &str) -> Option<usize> {
        self.pools.iter().position(|p| p.cluster == cluster)
    }
}

/// The JSON Schema (draft 2020-12) of the plugin configuration, generated from the raw serde
/// types the parser uses. Committed as `filter/core/plugin-config.schema.json`.
#[cfg(feature = "schema")]
pub fn plugin_config_schema() -> Value {
    let mut schema = serde_json::to_value(schemars::schema_for!(RawConfig)).unwrap_or(Value::Null);
    if let Some(obj) = schema.as_object_mut() {
        obj.insert(
            "$id".to_string(),
            Value::String(
                "https://github.com/ai-lb/ai-lb/filter/core/plugin-config.schema.json".to_string(),
            ),
        );
    }
    schema
}

fn serde_error(e: serde_path_to_error::Error<serde_json::Error>) -> ConfigError {
    let mut path = e.path().to_string();
    // `.` is the root; `?` is where serde_path_to_error lost track (e.g. at end of input).
    if path == "." || path == "?" {
        path.clear();
    }
    let syntax = matches!(
        e.inner().classify(),
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof
    );
    let msg = e.inner().to_string();
    // `unknown field `foo`, expected one of ...`: put the field itself in the path.
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        if let Some(end) = rest.find('`') {
            let field = rest.get(..end).unwrap_or(rest);
            // serde_path_to_error already ends the path with the field; older versions do not.
            let full = if path.is_empty() {
                field.to_string()
            } else if path == field || path.ends_with(&format!(".{field}")) {
                path.clone()
            } else {
                format!("{path}.{field}")
            };
            return ConfigError::new(full, "", "unknown field");
        }
    }
    // `invalid type: string "yes", expected a boolean`: the offending value goes in the value.
    let value = ["invalid type: ", "invalid value: "]
        .iter()
        .find_map(|p| msg.strip_prefix(p))
        .and_then(|rest| rest.split_once(", expected").map(|(v, _)| v.to_string()))
        .unwrap_or_default();
    // Strip serde_json's " at line X column Y" into the reason: keep it, it helps.
    let reason = if path.is_empty() || syntax {
        format!("invalid JSON: {msg}")
    } else {
        msg
    };
    ConfigError::new(path, value, reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = FilterConfig::from_json(br#"{"pools":[{"name":"llm","cluster":"inference"}]}"#)
            .unwrap();
        assert_eq!(c.mode, Mode::Route);
        assert_eq!(c.pools[0].agent_cluster, "inference");
        assert_eq!(c.pools[0].weights, Weights::default());
        assert_eq!(c.cutoffs, Cutoffs::default());
        assert_eq!(c.min_pods, 3);
        assert_eq!(c.routing_header, "x-gateway-destination-endpoint");
    }

    #[test]
    fn weights_resolve_pod_over_pool_over_template_over_default() {
        let c = FilterConfig::from_json(
            br#"{"pools":[
                {"name":"a","cluster":"ca","modelType":"vision",
                 "podWeights":{"10.0.0.1:8000":{"gpu":1}}},
                {"name":"b","cluster":"cb","modelType":"vision","weights":{"queue":3,"p99":1}},
                {"name":"c","cluster":"cc","modelType":"speech"}],
              "weightTemplates":{"vision":{"gpu":0.5,"memory":0.5}}}"#,
        )
        .unwrap();
        let a = &c.pools[0];
        assert_eq!(a.weights_for("10.0.0.1:8000").gpu, 1.0);
        assert_eq!(a.weights_for("10.0.0.2:8000").memory, 0.5);
        assert_eq!(c.pools[1].weights.queue, 0.75);
        assert_eq!(c.pools[2].weights, Weights::default());
    }

    #[test]
    fn negative_weight_names_path_and_value() {
        let e = FilterConfig::from_json(
            br#"{"pools":[{"name":"llm","cluster":"x","weights":{"gpu":-0.1}}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.path, "pools[0].weights.gpu");
        assert_eq!(e.value, "-0.1");
        assert!(e.to_string().contains("must be a finite number ≥ 0"));
    }

    #[test]
    fn unknown_field_is_named() {
        let e = FilterConfig::from_json(br#"{"pools":[{"name":"a","cluster":"b","bogus":1}]}"#)
            .unwrap_err();
        assert_eq!(e.path, "pools[0].bogus");
    }
}
