//! The plugin config's raw serde layer (whose doc comments and `schemars` attributes are the
//! JSON Schema, feature `schema`) and its validation into [`super::FilterConfig`]: steps one and
//! two of three; the domain types and the parse entry live in `super`. Every error names the
//! JSON path, the value and the accepted range.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;

use serde::Deserialize;
use serde_json::Value;

use super::*;
use crate::adaptive::{AdaptiveThresholds, RawAdaptiveThresholds};
use crate::admission::AdmissionConfig;
use crate::error::ConfigError;
use crate::recovery::{RawRecoveryRamp, RecoveryRamp};

/// `longOutputTokens` when absent (the schema's `default` says the same).
const DEFAULT_LONG_OUTPUT_TOKENS: u64 = 512;

/// `longOutputSeatShare` when absent (the schema's `default` says the same).
const DEFAULT_LONG_OUTPUT_SEAT_SHARE: f64 = 0.5;

// ---------------------------------------------------------------------------------------------
// Raw serde layer. Its doc comments and `schemars` attributes are the JSON Schema of the plugin
// config (feature `schema`): keep defaults and ranges here in step with the validation below
// (the schema tests in tests/schema_drift.rs check a sample of them against the parser).
// ---------------------------------------------------------------------------------------------

/// The ai-lb proxy-wasm filter's plugin configuration (Envoy `configuration` / Istio
/// `pluginConfig`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "PluginConfig")
)]
pub(super) struct RawConfig {
    /// What this filter instance does: `route` (client sidecar: score pods and steer requests)
    /// or `guard` (inbound guard in front of one model server, admission control).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "route", "enum" = ["route", "guard", null]))
    )]
    mode: Option<String>,
    /// The pools of pods (one Envoy cluster each) this filter steers. At least one in route
    /// mode; names and clusters must be unique.
    pools: Vec<RawPool>,
    /// Named scoring weights that pools select with `modelType` (e.g. `llm`, `vision`,
    /// `speech`). Names must not be empty.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    weight_templates: BTreeMap<String, RawWeights>,
    /// Hard limits that zero a pod's score, and the scales of the queue and p99 terms.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    cutoffs: RawCutoffs,
    /// Per-pod circuit breaker on passive failures (5xx, resets, TTFT over the SLO).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    breaker: RawBreaker,
    /// EMA smoothing factor of pod signals; 1 = no smoothing.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.3, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    ema_alpha: Option<f64>,
    /// Fewer candidate pods with fresh metrics than this: steer nothing, Envoy's fallback
    /// policy balances.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 3, "minimum" = 1, "maximum" = 100_000))
    )]
    min_pods: Option<u64>,
    /// Least pick weight of a pod that is not cut, so every live pod keeps seeing some traffic.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.05, "minimum" = 0, "exclusiveMaximum" = 1))
    )]
    floor_weight: Option<f64>,
    /// How a pod is chosen among those not cut: `twoChoices` (two draws in proportion to
    /// score; a pod with a free seat beats one where the request would queue, which beats one
    /// whose estimated free KV cache the prompt does not fit, or whose queue's head waits for
    /// KV cache when the prompt and `max_tokens` are four times the mean request's or more;
    /// queued pods are compared by the service rounds the request would wait (the requests
    /// ahead of it plus itself, over those running; while the queue's head waits for KV,
    /// every waiting request is ahead); then the lower load wins, the fuller of seats (the
    /// snapshot's running + waiting moved by this sidecar's own starts since the model server
    /// was read for it and ends since it arrived) and KV cache (the snapshot's KV use plus
    /// this sidecar's prompts and `max_tokens` since that reading; pods whose agent reports
    /// KV capacity); a prompt that fits neither
    /// candidate draws up to four more; a pod over the GPU hard limit takes overflow once the
    /// drawn pods would queue; idle pods tie and the first draw wins, so an idle pool gets
    /// score-proportional shares) or `proportional` (one draw in proportion to score, divided
    /// by `1 + inflight/capacity` of this sidecar's requests since the pod's last snapshot;
    /// cut pods get nothing).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "twoChoices", "enum" = ["twoChoices", "proportional", null]))
    )]
    pick_strategy: Option<String>,
    /// With `twoChoices`: a request reserving at least this many output tokens (its body's
    /// `max_tokens` or `max_completion_tokens`, times `n`; read only when the router reads the
    /// body, i.e. `modelHeader` is set and the request lacks it, or admission needs it) spends
    /// most of its time decoding. It draws two more candidates and goes where it would finish
    /// at least 10 % sooner: its wait (service rounds, each a mean output reservation at the
    /// pool's median inter-token latency) plus its own output at the pod's inter-token latency
    /// (the mean over the agent's recent window, i.e. the histogram's sum over its count, else
    /// its median; smoothed; a reading older than 5 s does not count). Where that cannot be
    /// told (it would wait for KV cache, or a request just failed there), a pod judged slow (a
    /// GPU slowdown, or `slowItlRatio`) loses to one that is not; otherwise it is compared like
    /// any request. In a pool that mixes GPU generations this keeps the longest answers, which
    /// set the p99 of end-to-end latency, off the slower GPUs, and off a pod that decodes much
    /// slower than it should even when it has free seats. Each long answer holds a fast pod's
    /// seat for its whole decode: `longOutputSeatShare` leaves the fast pods seats for short
    /// requests. 0 turns it off.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 512, "minimum" = 0, "maximum" = 10_000_000))
    )]
    long_output_tokens: Option<u64>,
    /// The share of a pod's seats long answers may hold for one more to go there because it
    /// would finish there first (`longOutputTokens`): this share for an answer reserving
    /// `longOutputTokens`, in proportion for a longer one (twice as long, twice the share), so
    /// the longest answers, which set the p99 of end-to-end latency, keep the fast pods and
    /// the merely long ones take them only while seats are left. Past its share, a long
    /// answer is compared there as any request is (its wait, then the load at the pod's
    /// speed). Each long answer holds a seat for its whole decode: where the fast pods are a
    /// minority, finish time alone sends them most long answers, and short requests queue
    /// behind them. A sidecar sees only its own requests: it takes a pod's long answers as
    /// its own long answers in flight there over all its requests in flight there, times the
    /// pod's running + waiting. 1 = no limit. Measured (BENCHMARKS.md, pool mixes, "Long
    /// answers"): on 2 H100 + 6 A100 at 90 % load, 0.5 gave ai_lb a p99 TTFT of 1 129–1 203 ms
    /// in three runs against 1 372–1 482 ms with no limit, and 0.54–0.71x least_request's; on
    /// 4 H100 + 4 A100 at 80 %, the same p99s as with no limit.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.5, "minimum" = 0.0, "maximum" = 1.0))
    )]
    long_output_seat_share: Option<f64>,
    /// Request header carrying `IP:PORT[,IP:PORT...]` to Envoy's `override_host` policy. A
    /// lowercase HTTP header name.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "x-gateway-destination-endpoint"))
    )]
    routing_header: Option<String>,
    /// Extra ranked endpoints after the chosen one in the routing header, for retries.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2, "minimum" = 0, "maximum" = 15))
    )]
    fallback_endpoints: Option<u64>,
    /// Request header naming the model (lowercase HTTP header name). Absent: every pod in the
    /// pool serves every request.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    model_header: Option<String>,
    /// Request header that asks for the scoreboard in a response header (lowercase HTTP header
    /// name). Absent: off.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    debug_header: Option<String>,
    /// Path answered locally with the scoreboard JSON; starts with `/`, no whitespace.
    /// Absent: off.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    status_path: Option<String>,
    /// Most request-body bytes held back while the filter reads the model, the output
    /// reservation and the prompt from the body (and admission costs it). A larger body (a
    /// multimodal request with base64 images, say) is read only up to here: the fields that lie
    /// complete in that prefix are used, admission costs it by its length, and the rest streams
    /// to the pod untouched. Keep it below Envoy's buffer limit
    /// (`per_connection_buffer_limit_bytes`, 1 MiB by default): a filter that waits for a body
    /// past that limit gets the request answered `413`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 524_288, "minimum" = 1024, "maximum" = 67_108_864))
    )]
    max_body_read_bytes: Option<u64>,
    /// The pool subscription to the agents' `WatchPool` stream.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    watch: RawWatch,
    /// Big requests (prompt and `max_tokens` four times the mean request's KV-cache tokens or
    /// more, as this Envoy worker has seen them, and `minKvShare` of the largest pod's KV
    /// cache or more) wait in the sidecar while no pod of the pool would start them at once
    /// (a free seat, nothing waiting, not over the GPU hard limit, and room in its estimated
    /// free KV cache with `kvHeadroom` to spare), instead of
    /// taking the seats and KV cache the short requests behind them need, or waiting at the
    /// head of a pod's queue, where every request behind them waits too (head-of-line
    /// blocking). Judged only when every pod not cut reports its KV cache and the pool is
    /// steered (never in fallback). Released on the filter's tick (every `watch.refreshMs`,
    /// 10..100 ms) as soon as a pod would start one, oldest first, and routed to such a pod;
    /// after `maxHoldMs` routed as if the hold were off. Absent or null: off; `{}`: on with
    /// every default.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    big_request_hold: Option<RawBigRequestHold>,
    /// Prefix-cache affinity: a request goes to a pod whose KV cache already holds its prompt's prefix (as the pods' agents report it from the model server's KV events: agent flag `--kv-events-endpoint`), unless that pod would make it wait longer (a pod that would start it at once beats a holder that would queue it, so a hot prefix spills). Needs the request body (the prompt): the filter reads it when this is on (Envoy's `allow_on_headers_stop_iteration`). Never overrides a cut or a breaker. Absent or null: off; `{}`: on with every default.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    prefix_affinity: Option<crate::prefix::config::RawPrefixAffinity>,
    /// Model-version routing (issue 30 part 3): a request naming a version in `header` goes only to pods of that version (their agent's `--model-version`); the others are split between versions by `weights`, then by score within the version; each version has a breaker domain (`domains`) that takes it out of the split while its requests fail. Absent or null: off (every pod competes, as without versions).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    versions: Option<crate::versions::RawVersions>,
    /// Admission control (token buckets per tenant, priority classes, inbound guard). Absent
    /// or null: admission off; `{}`: on with every default.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "Option<crate::admission::config::RawAdmission>",
            extend("default" = null)
        )
    )]
    admission: Option<Value>,
    /// Learned weights (online SGD): a linear correction of the static score per pool,
    /// logistic regression with the static score's logit as its offset, over each pod's
    /// features (the static formula's GPU, queue, p99 and memory terms, `1 − error rate`,
    /// decode speed relative to the pool, and the TTFT this sidecar observed from the pod
    /// relative to the pool, which no metric shows), trained on the outcomes of the pool's
    /// requests (a failure 0, else `0.5·clamp(1 − TTFT/ttftSloMs) + 0.5·clamp(1 − e2e/e2eSloMs)`).
    /// Its weights start at 0, so untrained it is the static formula; a pod with at least
    /// `coldStartSamples` samples is scored `sigmoid(logit(static) + Σ w·x)` (the bias is
    /// trained, not scored) while the model is sound (it falls back to the static score,
    /// counted, on a weight or loss that is not finite, an output under 0.001 for every pod,
    /// or a loss that stays diverging). Cut-offs and breakers apply as before. Each Envoy
    /// worker (wasm VM, native worker thread) learns on its own requests. Absent or null: off;
    /// `{}`: on with every default.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = null)))]
    learned_weights: Option<crate::learned::RawLearnedWeights>,
    /// Degrade before OOM: while a pod's agent reports one of its GPUs about to run out of
    /// memory (memory at 92 % or more and growing fast: agent flags `--oom-*`), the pod's share
    /// falls linearly to `minShare`, and from `cutBeforeMs` before the projected OOM it gets no
    /// new request, so none is in flight there when it would crash; restored as soon as the
    /// agent stops reporting it. Absent: on with the defaults (it acts only on a state an agent
    /// reports); `{"enabled": false}`: off.
    #[serde(default)]
    pre_oom: Option<crate::pre_oom::RawPreOom>,
}

/// One pool of pods (one Envoy cluster) this filter steers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Pool")
)]
struct RawPool {
    /// Pool name, unique and not empty.
    name: String,
    /// The Envoy cluster serving inference (the one with the `override_host` policy); unique
    /// across pools, not empty.
    cluster: String,
    /// The Envoy cluster reaching the agents' gRPC `WatchPool`. Absent: `cluster`.
    #[serde(default)]
    agent_cluster: Option<String>,
    /// `:authority` of the agent calls.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = "ai-lb-agent")))]
    agent_authority: Option<String>,
    /// Key into `weightTemplates`; an unknown key means the default weights.
    #[serde(default)]
    model_type: Option<String>,
    /// The pool's weights; beat the `modelType` template. Absent: the template, else defaults.
    #[serde(default)]
    weights: Option<RawWeights>,
    /// Per-pod weights keyed by the pod's serving address `IP:PORT` (e.g. `10.0.0.1:8000`);
    /// beat the pool's weights.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    pod_weights: BTreeMap<String, RawWeights>,
}

/// Scoring weights of the four terms. A missing key is 0 (no inheritance from a less specific
/// level); values are finite and ≥ 0 with a positive sum, and are divided by their sum. Absent
/// everywhere: gpu 0.35, queue 0.25, p99 0.25, memory 0.15.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "ScoreWeights")
)]
struct RawWeights {
    /// Weight of GPU utilisation headroom.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0, "minimum" = 0)))]
    gpu: f64,
    /// Weight of the waiting-queue term (scaled by `cutoffs.maxQueue`).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0, "minimum" = 0)))]
    queue: f64,
    /// Weight of the p99 latency term (scaled by `cutoffs.p99TimeoutMs`).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0, "minimum" = 0)))]
    p99: f64,
    /// Weight of free GPU memory (KV cache headroom).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0, "minimum" = 0)))]
    memory: f64,
}

/// Hard limits that zero a pod's score.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Cutoffs")
)]
struct RawCutoffs {
    /// The GPU reading chosen by `gpuSignal` above this cuts the pod; with `pickStrategy: twoChoices` such a pod still takes a request when the other drawn pod would queue too and it is the less loaded.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.95, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    gpu_hard_limit: Option<f64>,
    /// Which GPU reading the score's GPU term and `gpuHardLimit` use. `auto`: SM occupancy (active warps over the maximum: NVML GPM on Hopper and later, DCGM, or the simulated GPU) where the pod reports it; a pod with only NVML's `utilization` (the share of time any kernel ran, about 100 % on every busy GPU, batch 1 or 200) is never cut for its GPU, and its GPU term takes the mean reading of the pool's pods that have one (so an A100 beside H100s scores on the same terms), or, where none has, is left out (scored on queue, p99 and memory). `utilization`: NVML's time fraction (right for an engine or simulator whose utilisation is graded). `smOccupancy`, `smUtilization`, `tensorActivity`, `dramActivity`: that activity reading only. A pod without the chosen reading has no GPU term. The per-pod `gpu_signal` gauge and the status page say which reading each pod used.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = "auto", "enum" = ["auto", "utilization", "smOccupancy", "smUtilization", "tensorActivity", "dramActivity", null]))
    )]
    gpu_signal: Option<String>,
    /// Waiting requests at or above this cut the pod; also the queue term's scale.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 64, "minimum" = 1, "maximum" = 1_000_000))
    )]
    max_queue: Option<u64>,
    /// The p99 term's scale in ms: a p99 at or above it scores 0 on that term (not a cut).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5000, "minimum" = 1))
    )]
    p99_timeout_ms: Option<u64>,
    /// Metrics older than this (ms) cut the pod as stale.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2000, "minimum" = 1))
    )]
    staleness_ms: Option<u64>,
    /// Multiplies the draw weight of a pod one of whose GPUs reports a hardware slowdown (NVML throttle reasons HW slowdown, SW or HW thermal slowdown, HW power brake: reduced clocks, so every request there runs slower); 1 ignores the signal. Not a cut: the pod still serves when the others are full.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.25, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    slowdown_factor: Option<f64>,
    /// Cut a pod whose model server stopped answering its agent: the agent's `model-server` source is failing (no answer within its stall time, an HTTP error, or unreadable metrics) after it had answered at least once. A frozen or crashed vLLM stops answering while its GPU still reads, so it would look idle. A source that never answered (a misconfigured agent) is treated as missing metrics instead. `false` leaves such a pod to the breaker and to twoChoices' in-flight counts.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = true)))]
    cut_model_server_down: Option<bool>,
    /// A pod decoding this many times slower than the pool's median, and than the median of the other pods of its GPU kind (the GPU names its agent reports, and their number), is drawn as if its GPU reported a slowdown: its weight times its speed relative to the slower of those two medians (that median / its own), at most `slowdownFactor`, so a pod 5x slower gets a fifth, whatever the cause: a noisy neighbour, a co-located job, clocks the GPU does not report. So a slower GPU generation is judged against its own kind, not as a slow pod beside faster ones (L40S pods beside H100s and A100s keep their share); a pod whose kind no other pod shares, or whose agent reports no GPU, is judged against the pool alone. Speed is the median inter-token latency over the agent's `--recent-window` (150 ms by default), so a slowed pod shows within about one window (about 150 ms measured in the bench), long before its p99 moves. Pools with fewer than 3 pods reporting it are not judged anew, and a pod with fewer than 8 tokens in that window (a slow pod running one request) is not either: a pod judged slow keeps that judgement until it can be judged again, for at most 30 s (a pod back at speed shows it with one request; a slowed one often runs too few to show anything). Pools that mix models of very different speeds, or hold a lone pod of a much slower GPU, should raise it. 0 turns it off; otherwise at least 1.5.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 3.0, "minimum" = 0, "maximum" = 1000))
    )]
    slow_itl_ratio: Option<f64>,
}

/// Per-pod circuit breaker on passive failures.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Breaker")
)]
struct RawBreaker {
    /// Consecutive passive failures that open the breaker.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5, "minimum" = 1, "maximum" = 10_000))
    )]
    consecutive_failures: Option<u64>,
    /// First cooldown (ms); doubles on every re-open until the breaker has stayed closed for
    /// `maxCooldownMs`. Each sidecar lengthens every cooldown (this one and the doubled ones,
    /// cap included) by its own random 0-100 %, so sidecars probe a failing pod one after
    /// another rather than all at once.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5000, "minimum" = 1))
    )]
    base_cooldown_ms: Option<u64>,
    /// Cap of the doubling cooldown (ms); must be ≥ `baseCooldownMs`. Absent: 60000, or
    /// `baseCooldownMs` if that is larger.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 60_000, "minimum" = 1))
    )]
    max_cooldown_ms: Option<u64>,
    /// Probes admitted while half-open, the first alone and the rest once it has succeeded (a pod that still fails costs one request per cooldown); that many successes close the breaker. A probe succeeds at its first response byte (status below 500, first token within `ttftSloMs`), so long streamed answers do not keep a recovered pod half-open; a later reset still counts as a failure. `wellFormedProbes`, when set, replaces it (and judges each probe at its answer's end).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 3, "minimum" = 1, "maximum" = 250))
    )]
    half_open_probes: Option<u64>,
    /// A response whose time to first token exceeds this (ms) counts as a failure. Absent or
    /// null: off.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = null, "minimum" = 1))
    )]
    ttft_slo_ms: Option<u64>,
    /// Share of failed requests over `failureRateWindowMs` that opens the breaker (once
    /// `failureRateMinRequests` were seen by one Envoy worker); 1 = only when all failed.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.5, "exclusiveMinimum" = 0, "maximum" = 1))
    )]
    failure_rate: Option<f64>,
    /// Sliding window of the failure rate (ms).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10_000, "minimum" = 100, "maximum" = 3_600_000))
    )]
    failure_rate_window_ms: Option<u64>,
    /// Outcomes a worker must have seen in the window before the failure rate can open the
    /// breaker.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10, "minimum" = 1, "maximum" = 100_000))
    )]
    failure_rate_min_requests: Option<u64>,
    /// Share of the pod's requests that failed, as its agent counts them over its window (every
    /// client's requests, so all sidecars cut the pod on the same evidence), that opens the
    /// breaker once the window holds at least `failureRateMinRequests` (a single request while
    /// the pod is on probation: its breaker not closed, or closed less than `maxCooldownMs`
    /// after an open), and keeps it open while reported. Not applied while more
    /// than half of the pool's pods are at or above it too: a pool-wide problem (the
    /// model server counts client disconnects as errors) is not one pod's fault. 0: off.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.25, "minimum" = 0, "maximum" = 1))
    )]
    agent_error_rate: Option<f64>,
    /// After a pod's breaker closes (its half-open probes passed), its share of requests ramps
    /// back through these steps instead of returning whole at once, and a failure during the
    /// ramp re-opens it. Absent: off. `{}`: the default ramp (0.1, 0.3, 0.5 of its weight,
    /// 5 s each).
    #[serde(default)]
    recovery_ramp: Option<RawRecoveryRamp>,
    /// Each pod's `failureRate`, `agentErrorRate` and `ttftSloMs` move within ±`maxAdjust` of
    /// their configured value with what the rest of its pool shows (the median, over the other
    /// pods, of the agents' error rate and TTFT p99): raised in a pool whose healthy pods all
    /// fail a background share or have a long TTFT tail, so noise does not cut them; lowered
    /// in a quiet pool, so a pod that starts failing is cut sooner. A pod's own readings never
    /// move its own thresholds. `consecutiveFailures` is not adapted. Absent: off (the static
    /// thresholds). `{}`: on with the defaults.
    #[serde(default)]
    adaptive_thresholds: Option<RawAdaptiveThresholds>,
    /// Truncated answers open the breaker while the pod answers GPU out-of-memory errors:
    /// `consecutiveTruncated` answers in a row that ended with no finish reason (and fewer
    /// tokens than the request's `max_tokens` when known), while the pod's GPU memory-error
    /// rate (the share of its answers this Envoy worker saw over `failureRateWindowMs` that
    /// were a 5xx naming CUDA out-of-memory) is above `memoryErrorRate`. The chosen pod's
    /// answers are read as they stream. Absent: off. `{}`: on with the defaults.
    #[serde(default)]
    truncation: Option<crate::triggers::RawTruncation>,
    /// A half-open pod closes only after this many probes in a row that passed and answered
    /// well-formed OpenAI JSON (non-streamed: an object with a `choices` array; streamed: every
    /// `data:` line such an object and a final `[DONE]`); a malformed probe answer counts as a
    /// failure and re-opens it. Replaces `halfOpenProbes`; a probe is then judged at its
    /// answer's end, not at its first byte. Absent: off.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = null, "minimum" = 1, "maximum" = 250))
    )]
    well_formed_probes: Option<u64>,
    /// Half-open pods are probed with a request of the filter's own instead of a client's: no
    /// client request goes to a half-open pod; each worker's timer sends it `POST path` with
    /// `body` (steered to it by the routing header), one probe in flight per pod, the next
    /// `intervalMs` later. A probe passes on a status below 500 within `timeoutMs` (and
    /// `ttftSloMs`) with well-formed OpenAI JSON (an object with a `choices` array); anything
    /// else, a 4xx too, re-opens the pod. `halfOpenProbes` (or `wellFormedProbes`) passes in a
    /// row close it. Per-model breakers and version domains are still probed by client
    /// requests. The pool's cluster must route by the routing header (override_host): the
    /// native module refuses it with `steering: "overrideHost"`. Absent: off.
    #[serde(default)]
    synthetic_probe: Option<crate::probe::RawSyntheticProbe>,
}

/// `bigRequestHold`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "BigRequestHold")
)]
struct RawBigRequestHold {
    /// Share of a pod's KV cache a big request must leave free to start there; the rest is
    /// kept for the short requests that keep arriving. A big request larger than the pod's
    /// cache less this share needs only to fit. 0: held only while it fits no pod at all.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.2, "minimum" = 0, "exclusiveMaximum" = 1))
    )]
    kv_headroom: Option<f64>,
    /// Longest wait in the sidecar, ms; after it the request is routed as if the hold were
    /// off (never refused). Keep it well under the clients' timeout.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10_000, "minimum" = 1, "maximum" = 600_000))
    )]
    max_hold_ms: Option<u64>,
    /// Most requests held at once per Envoy worker; one more is routed at once.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 256, "minimum" = 1, "maximum" = 100_000))
    )]
    max_held: Option<u64>,
    /// Only a request holding at least this share of the largest KV cache among the pool's
    /// pods (and four times the mean request's KV tokens) is held; 0: every request four
    /// times the mean. With the default a 4 000-token prompt with 1 000 output tokens on
    /// 12 500-token caches is held, ShareGPT's long tail (about 1.6 % of requests at four
    /// times its mean of ~450 tokens, 0.2 % at a quarter of such a cache) is not.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.25, "minimum" = 0, "maximum" = 1))
    )]
    min_kv_share: Option<f64>,
}

/// The pool subscription (`WatchPool` stream to the agents).
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Watch")
)]
struct RawWatch {
    /// `WatchPoolRequest.min_interval_ms`: least interval between updates; 0 = the agent's
    /// default.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0, "minimum" = 0, "maximum" = 3_600_000))
    )]
    min_interval_ms: Option<u64>,
    /// `WatchPoolRequest.heartbeat_ms`: interval of keep-alive updates; 0 = the agent's default.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0, "minimum" = 0, "maximum" = 3_600_000))
    )]
    heartbeat_ms: Option<u64>,
    /// First reconnect delay (ms) after the stream closes; doubles per failed attempt.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 250, "minimum" = 1))
    )]
    reconnect_base_ms: Option<u64>,
    /// Cap of the doubling reconnect delay (ms); must be ≥ `reconnectBaseMs`. Absent: 10000, or
    /// `reconnectBaseMs` if that is larger.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10_000, "minimum" = 1))
    )]
    reconnect_max_ms: Option<u64>,
    /// How often (ms) worker VMs re-read the shared pool state (breakers changed by another
    /// worker are read before each pick, whatever this says). It is also the filter's tick
    /// (clamped to 10..100 ms) in a VM that carried a request in the last second or holds one;
    /// a VM without requests (main-thread VMs always) ticks every 100 ms and re-reads the pool
    /// state before its next pick instead. An idle Envoy (1 worker) spends 6 ms of CPU a second
    /// with the filter (15-16 ms when every VM ticked at 20 ms; plain Envoy 2-3 ms).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 20, "minimum" = 1))
    )]
    refresh_ms: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// `cutoffs.gpuSignal`.
fn gpu_signal(v: Option<&str>) -> Result<crate::signals::GpuSignal, ConfigError> {
    use crate::signals::{GpuReading, GpuSignal};
    Ok(match v {
        None | Some("auto") => GpuSignal::Auto,
        Some("utilization") => GpuSignal::Only(GpuReading::Utilization),
        Some("smOccupancy") => GpuSignal::Only(GpuReading::SmOccupancy),
        Some("smUtilization") => GpuSignal::Only(GpuReading::SmUtilization),
        Some("tensorActivity") => GpuSignal::Only(GpuReading::TensorActivity),
        Some("dramActivity") => GpuSignal::Only(GpuReading::DramActivity),
        Some(other) => {
            return Err(ConfigError::new(
                "cutoffs.gpuSignal",
                json_str(other),
                "must be \"auto\", \"utilization\", \"smOccupancy\", \"smUtilization\", \"tensorActivity\" or \"dramActivity\"",
            ))
        }
    })
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| s.to_string())
}

fn weights(path: &str, raw: &RawWeights) -> Result<Weights, ConfigError> {
    let fields = [
        ("gpu", raw.gpu),
        ("queue", raw.queue),
        ("p99", raw.p99),
        ("memory", raw.memory),
    ];
    for (name, v) in fields {
        if !v.is_finite() || v < 0.0 {
            return Err(ConfigError::new(
                format!("{path}.{name}"),
                v,
                "must be a finite number ≥ 0",
            ));
        }
    }
    let sum = raw.gpu + raw.queue + raw.p99 + raw.memory;
    if sum <= 0.0 || !sum.is_finite() {
        return Err(ConfigError::new(
            path,
            format!(
                "{{\"gpu\":{},\"queue\":{},\"p99\":{},\"memory\":{}}}",
                raw.gpu, raw.queue, raw.p99, raw.memory
            ),
            "weights must have a positive, finite sum (they are normalised to sum 1)",
        ));
    }
    Ok(Weights {
        gpu: raw.gpu / sum,
        queue: raw.queue / sum,
        p99: raw.p99 / sum,
        memory: raw.memory / sum,
    })
}

/// A lowercase HTTP header name: RFC 9110 token characters, no uppercase, not empty,
/// not a pseudo-header.
fn header_name(path: &str, v: &str) -> Result<String, ConfigError> {
    let ok = !v.is_empty()
        && v.bytes().all(|b| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        });
    if ok {
        Ok(v.to_string())
    } else {
        Err(ConfigError::new(
            path,
            json_str(v),
            "must be a non-empty lowercase HTTP header name (token characters, no uppercase)",
        ))
    }
}

fn non_empty(path: &str, v: &str) -> Result<String, ConfigError> {
    if v.trim().is_empty() {
        Err(ConfigError::new(path, json_str(v), "must not be empty"))
    } else {
        Ok(v.to_string())
    }
}

fn positive_ms(path: &str, v: Option<u64>, default: u64) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        Some(0) => Err(ConfigError::new(path, 0, "must be > 0 (milliseconds)")),
        Some(x) => Ok(x),
    }
}

fn ratio_limit(path: &str, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x > 0.0 && x <= 1.0 => Ok(x),
        Some(x) => Err(ConfigError::new(path, x, "must be within (0, 1]")),
    }
}

/// An optional share within [0, 1]; `hint` follows the range in the error (e.g. " (0 turns it
/// off)").
fn share(path: &str, v: Option<f64>, default: f64, hint: &str) -> Result<f64, ConfigError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (0.0..=1.0).contains(&x) => Ok(x),
        Some(x) => Err(ConfigError::new(
            path,
            x,
            format!("must be within [0, 1]{hint}"),
        )),
    }
}

fn u32_in(
    path: &str,
    v: Option<u64>,
    default: u32,
    min: u64,
    max: u64,
) -> Result<u32, ConfigError> {
    match v {
        None => Ok(default),
        Some(x) if x >= min && x <= max => u32::try_from(x)
            .map_err(|_| ConfigError::new(path, x, format!("must be within {min}..={max}"))),
        Some(x) => Err(ConfigError::new(
            path,
            x,
            format!("must be within {min}..={max}"),
        )),
    }
}

impl TryFrom<RawConfig> for FilterConfig {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        let mode = match raw.mode.as_deref() {
            None | Some("route") => Mode::Route,
            Some("guard") => Mode::Guard,
            Some(other) => {
                return Err(ConfigError::new(
                    "mode",
                    json_str(other),
                    "must be \"route\" or \"guard\"",
                ))
            }
        };

        let mut weight_templates = BTreeMap::new();
        for (k, w) in &raw.weight_templates {
            let path = format!("weightTemplates.{k}");
            if k.is_empty() {
                return Err(ConfigError::new(
                    path,
                    "\"\"",
                    "template name must not be empty",
                ));
            }
            weight_templates.insert(k.clone(), weights(&path, w)?);
        }

        if raw.pools.is_empty() && mode == Mode::Route {
            return Err(ConfigError::new(
                "pools",
                "[]",
                "at least one pool is required in route mode",
            ));
        }
        let mut names = HashSet::new();
        let mut clusters = HashSet::new();
        let mut pools = Vec::with_capacity(raw.pools.len());
        for (i, p) in raw.pools.iter().enumerate() {
            let base = format!("pools[{i}]");
            let name = non_empty(&format!("{base}.name"), &p.name)?;
            if !names.insert(name.clone()) {
                return Err(ConfigError::new(
                    format!("{base}.name"),
                    json_str(&name),
                    "duplicate pool name",
                ));
            }
            let cluster = non_empty(&format!("{base}.cluster"), &p.cluster)?;
            if !clusters.insert(cluster.clone()) {
                return Err(ConfigError::new(
                    format!("{base}.cluster"),
                    json_str(&cluster),
                    "duplicate cluster: each pool needs its own cluster",
                ));
            }
            let agent_cluster = match &p.agent_cluster {
                Some(c) => non_empty(&format!("{base}.agentCluster"), c)?,
                None => cluster.clone(),
            };
            let agent_authority = match &p.agent_authority {
                Some(a) => non_empty(&format!("{base}.agentAuthority"), a)?,
                None => "ai-lb-agent".to_string(),
            };
            let model_type = match &p.model_type {
                Some(t) => Some(non_empty(&format!("{base}.modelType"), t)?),
                None => None,
            };
            let pool_weights = match (&p.weights, &model_type) {
                (Some(w), _) => weights(&format!("{base}.weights"), w)?,
                (None, Some(t)) => weight_templates.get(t).copied().unwrap_or_default(),
                (None, None) => Weights::default(),
            };
            let mut pod_weights = BTreeMap::new();
            for (addr, w) in &p.pod_weights {
                let path = format!("{base}.podWeights.{addr}");
                if addr.parse::<SocketAddr>().is_err() {
                    return Err(ConfigError::new(
                        format!("{base}.podWeights"),
                        json_str(addr),
                        "keys must be pod serving addresses IP:PORT (e.g. 10.0.0.1:8000)",
                    ));
                }
                pod_weights.insert(addr.clone(), weights(&path, w)?);
            }
            pools.push(PoolConfig {
                name,
                cluster,
                agent_cluster,
                agent_authority,
                model_type,
                weights: pool_weights,
                pod_weights,
            });
        }

        let d = Cutoffs::default();
        let cutoffs = Cutoffs {
            gpu_hard_limit: ratio_limit(
                "cutoffs.gpuHardLimit",
                raw.cutoffs.gpu_hard_limit,
                d.gpu_hard_limit,
            )?,
            gpu_signal: gpu_signal(raw.cutoffs.gpu_signal.as_deref())?,
            max_queue: u32_in(
                "cutoffs.maxQueue",
                raw.cutoffs.max_queue,
                d.max_queue,
                1,
                1_000_000,
            )?,
            p99_timeout_ms: positive_ms(
                "cutoffs.p99TimeoutMs",
                raw.cutoffs.p99_timeout_ms,
                d.p99_timeout_ms,
            )?,
            staleness_ms: positive_ms(
                "cutoffs.stalenessMs",
                raw.cutoffs.staleness_ms,
                d.staleness_ms,
            )?,
            slowdown_factor: ratio_limit(
                "cutoffs.slowdownFactor",
                raw.cutoffs.slowdown_factor,
                d.slowdown_factor,
            )?,
            cut_model_server_down: raw
                .cutoffs
                .cut_model_server_down
                .unwrap_or(d.cut_model_server_down),
            slow_itl_ratio: match raw.cutoffs.slow_itl_ratio {
                None => d.slow_itl_ratio,
                Some(x) if x == 0.0 || (x.is_finite() && (1.5..=1000.0).contains(&x)) => x,
                Some(x) => {
                    return Err(ConfigError::new(
                        "cutoffs.slowItlRatio",
                        x,
                        "must be 0 (off) or within [1.5, 1000]",
                    ))
                }
            },
        };

        let d = BreakerConfig::default();
        let base_cooldown_ms = positive_ms(
            "breaker.baseCooldownMs",
            raw.breaker.base_cooldown_ms,
            d.base_cooldown_ms,
        )?;
        let max_cooldown_ms = positive_ms(
            "breaker.maxCooldownMs",
            raw.breaker.max_cooldown_ms,
            d.max_cooldown_ms.max(base_cooldown_ms),
        )?;
        if max_cooldown_ms < base_cooldown_ms {
            return Err(ConfigError::new(
                "breaker.maxCooldownMs",
                max_cooldown_ms,
                format!("must be ≥ breaker.baseCooldownMs ({base_cooldown_ms})"),
            ));
        }
        let ttft_slo_ms = match raw.breaker.ttft_slo_ms {
            None => None,
            Some(0) => {
                return Err(ConfigError::new(
                    "breaker.ttftSloMs",
                    0,
                    "must be > 0 (milliseconds) or null",
                ))
            }
            Some(x) => Some(x),
        };
        let breaker = BreakerConfig {
            consecutive_failures: u32_in(
                "breaker.consecutiveFailures",
                raw.breaker.consecutive_failures,
                d.consecutive_failures,
                1,
                10_000,
            )?,
            base_cooldown_ms,
            max_cooldown_ms,
            half_open_probes: u32_in(
                "breaker.halfOpenProbes",
                raw.breaker.half_open_probes,
                d.half_open_probes,
                1,
                250,
            )?,
            ttft_slo_ms,
            failure_rate: ratio_limit(
                "breaker.failureRate",
                raw.breaker.failure_rate,
                d.failure_rate,
            )?,
            failure_rate_window_ms: u64::from(u32_in(
                "breaker.failureRateWindowMs",
                raw.breaker.failure_rate_window_ms,
                10_000,
                100,
                3_600_000,
            )?),
            failure_rate_min_requests: u32_in(
                "breaker.failureRateMinRequests",
                raw.breaker.failure_rate_min_requests,
                d.failure_rate_min_requests,
                1,
                100_000,
            )?,
            agent_error_rate: share(
                "breaker.agentErrorRate",
                raw.breaker.agent_error_rate,
                d.agent_error_rate,
                " (0 turns it off)",
            )?,
            recovery_ramp: raw
                .breaker
                .recovery_ramp
                .as_ref()
                .map(RecoveryRamp::from_raw)
                .transpose()?,
            adaptive_thresholds: raw
                .breaker
                .adaptive_thresholds
                .as_ref()
                .map(AdaptiveThresholds::from_raw)
                .transpose()?,
            truncation: raw
                .breaker
                .truncation
                .as_ref()
                .map(crate::triggers::Truncation::from_raw)
                .transpose()?,
            well_formed_probes: crate::triggers::well_formed_probes_from_raw(
                raw.breaker.well_formed_probes,
            )?,
            synthetic_probes: raw.breaker.synthetic_probe.is_some(),
        };
        let synthetic_probe = raw
            .breaker
            .synthetic_probe
            .as_ref()
            .map(|p| crate::probe::SyntheticProbe::from_raw(p, breaker.base_cooldown_ms))
            .transpose()?;

        let ema_alpha = match raw.ema_alpha {
            None => 0.3,
            Some(a) if a.is_finite() && a > 0.0 && a <= 1.0 => a,
            Some(a) => return Err(ConfigError::new("emaAlpha", a, "must be within (0, 1]")),
        };
        let min_pods = match raw.min_pods {
            None => 3,
            Some(n) if (1..=100_000).contains(&n) => usize::try_from(n).unwrap_or(3),
            Some(n) => return Err(ConfigError::new("minPods", n, "must be within 1..=100000")),
        };
        let floor_weight = match raw.floor_weight {
            None => 0.05,
            Some(f) if f.is_finite() && (0.0..1.0).contains(&f) => f,
            Some(f) => return Err(ConfigError::new("floorWeight", f, "must be within [0, 1)")),
        };
        let pick_strategy = match raw.pick_strategy.as_deref() {
            None | Some("twoChoices") => PickStrategy::TwoChoices,
            Some("proportional") => PickStrategy::Proportional,
            Some(other) => {
                return Err(ConfigError::new(
                    "pickStrategy",
                    json_str(other),
                    "must be \"twoChoices\" or \"proportional\"",
                ))
            }
        };
        let long_output_tokens = match raw.long_output_tokens {
            None => DEFAULT_LONG_OUTPUT_TOKENS,
            Some(n) if n <= 10_000_000 => n,
            Some(n) => {
                return Err(ConfigError::new(
                    "longOutputTokens",
                    n,
                    "must be within 0..=10000000 (0 turns it off)",
                ))
            }
        };
        let long_output_seat_share = match raw.long_output_seat_share {
            None => DEFAULT_LONG_OUTPUT_SEAT_SHARE,
            Some(v) if (0.0..=1.0).contains(&v) => v,
            Some(v) => {
                return Err(ConfigError::new(
                    "longOutputSeatShare",
                    v,
                    "must be within 0..=1 (1 = no limit)",
                ))
            }
        };
        let routing_header = header_name(
            "routingHeader",
            raw.routing_header
                .as_deref()
                .unwrap_or("x-gateway-destination-endpoint"),
        )?;
        let fallback_endpoints = match raw.fallback_endpoints {
            None => 2,
            Some(n) if n <= MAX_FALLBACK_ENDPOINTS as u64 => usize::try_from(n).unwrap_or(2),
            Some(n) => {
                return Err(ConfigError::new(
                    "fallbackEndpoints",
                    n,
                    format!("must be within 0..={MAX_FALLBACK_ENDPOINTS}"),
                ))
            }
        };
        let model_header = raw
            .model_header
            .as_deref()
            .map(|h| header_name("modelHeader", h))
            .transpose()?;
        let debug_header = raw
            .debug_header
            .as_deref()
            .map(|h| header_name("debugHeader", h))
            .transpose()?;
        let status_path = match raw.status_path {
            None => None,
            Some(p) if p.starts_with('/') && !p.contains(char::is_whitespace) => Some(p),
            Some(p) => {
                return Err(ConfigError::new(
                    "statusPath",
                    json_str(&p),
                    "must be a path starting with '/' without whitespace",
                ))
            }
        };

        let max_body_read_bytes = u32_in(
            "maxBodyReadBytes",
            raw.max_body_read_bytes,
            DEFAULT_MAX_BODY_READ_BYTES,
            1024,
            64 << 20,
        )?;

        let d = WatchConfig::default();
        let reconnect_base_ms = positive_ms(
            "watch.reconnectBaseMs",
            raw.watch.reconnect_base_ms,
            d.reconnect_base_ms,
        )?;
        let reconnect_max_ms = positive_ms(
            "watch.reconnectMaxMs",
            raw.watch.reconnect_max_ms,
            d.reconnect_max_ms.max(reconnect_base_ms),
        )?;
        if reconnect_max_ms < reconnect_base_ms {
            return Err(ConfigError::new(
                "watch.reconnectMaxMs",
                reconnect_max_ms,
                format!("must be ≥ watch.reconnectBaseMs ({reconnect_base_ms})"),
            ));
        }
        let watch = WatchConfig {
            min_interval_ms: u32_in(
                "watch.minIntervalMs",
                raw.watch.min_interval_ms,
                0,
                0,
                3_600_000,
            )?,
            heartbeat_ms: u32_in("watch.heartbeatMs", raw.watch.heartbeat_ms, 0, 0, 3_600_000)?,
            reconnect_base_ms,
            reconnect_max_ms,
            refresh_ms: positive_ms("watch.refreshMs", raw.watch.refresh_ms, d.refresh_ms)?,
        };

        let big_request_hold = match &raw.big_request_hold {
            None => None,
            Some(h) => {
                let d = BigRequestHold::default();
                let kv_headroom = match h.kv_headroom {
                    None => d.kv_headroom,
                    Some(x) if x.is_finite() && (0.0..1.0).contains(&x) => x,
                    Some(x) => {
                        return Err(ConfigError::new(
                            "bigRequestHold.kvHeadroom",
                            x,
                            "must be within [0, 1)",
                        ))
                    }
                };
                let max_hold_ms = u64::from(u32_in(
                    "bigRequestHold.maxHoldMs",
                    h.max_hold_ms,
                    u32::try_from(d.max_hold_ms).unwrap_or(u32::MAX),
                    1,
                    600_000,
                )?);
                let max_held = u32_in(
                    "bigRequestHold.maxHeld",
                    h.max_held,
                    d.max_held as u32,
                    1,
                    100_000,
                )? as usize;
                let min_kv_share = share(
                    "bigRequestHold.minKvShare",
                    h.min_kv_share,
                    d.min_kv_share,
                    "",
                )?;
                Some(BigRequestHold {
                    kv_headroom,
                    max_hold_ms,
                    max_held,
                    min_kv_share,
                })
            }
        };

        Ok(FilterConfig {
            mode,
            pools,
            weight_templates,
            cutoffs,
            breaker,
            ema_alpha,
            min_pods,
            floor_weight,
            pick_strategy,
            long_output_tokens,
            long_output_seat_share,
            routing_header,
            fallback_endpoints,
            model_header,
            debug_header,
            status_path,
            max_body_read_bytes,
            watch,
            big_request_hold,
            prefix_affinity: raw
                .prefix_affinity
                .as_ref()
                .map(crate::prefix::PrefixAffinity::try_from)
                .transpose()?,
            admission: raw
                .admission
                .as_ref()
                .map(AdmissionConfig::from_value)
                .transpose()?,
            versions: raw
                .versions
                .as_ref()
                .map(crate::versions::VersionsConfig::try_from)
                .transpose()?
                .map(std::sync::Arc::new),
            learned_weights: raw
                .learned_weights
                .as_ref()
                .map(crate::learned::LearnedWeights::from_raw)
                .transpose()?,
            pre_oom: raw.pre_oom.unwrap_or_default().validate()?,
            synthetic_probe,
        })
    }
}
