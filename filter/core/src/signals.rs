//! Decides what an agent snapshot says about a pod: validates and normalises the protobuf
//! readings once, on entry (NaN, negative and out-of-range values are dropped or clamped and
//! each one is reported as a [`SignalIssue`]), so scoring never re-checks them.
//!
//! Derivations:
//! - GPU readings: the MAX over the pod's GPUs of each reading (the busiest GPU bounds a
//!   tensor-parallel model's speed): NVML's time-fraction utilisation (`gpu`), and the activity
//!   readings where the GPU has them (GPM on Hopper and later, DCGM, the simulated GPU): SM
//!   occupancy, SM utilisation, tensor-pipe and DRAM activity. Which one scores the pod is the
//!   config's choice ([`PodSignals::gpu_load`]): the time fraction saturates at batch 1, so by
//!   default a pod without activity readings is scored without a GPU term.
//! - Memory signal: KV-cache use when the model server reports it, else the MAX GPU memory
//!   ratio (vLLM preallocates, so the NVML ratio sits near 0.9 and is a weak signal).
//! - p99 signal: TTFT p99 when its window has samples (it reflects queueing, which steering
//!   changes), else end-to-end p99.
//! - Error rate: the model server's share of failed requests over the agent's rate window, with
//!   the number of requests it covers (`request_rate` × `rate_window_ms`, or `window_ms` from an
//!   older agent), so a rate over 2 requests is not taken for a failing pod.
//! - Hardware fault: Xid or uncorrected-ECC totals INCREASED since the previous snapshot of the
//!   same agent instance ([`PodSignals::detect_fault_since`]).
//! - Sources: if every reported source is FAILING, the pod has no metrics (`has_metrics`
//!   false) even if stale numbers are present.
//! - Model server down: the agent's `model-server` source is FAILING after it has answered at
//!   least once (`last_success_age_ms` present). A frozen or crashed vLLM stops answering its
//!   metrics endpoint while NVML still reads the GPU, so the pod would otherwise look idle. A
//!   source that never answered (a misconfigured or just-started agent) is missing metrics,
//!   not a down pod.

use std::net::SocketAddr;

use ai_lb_proto::{PodSnapshot, SourceState};

/// One rejected or clamped reading.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalIssue {
    /// Field path inside the snapshot, e.g. `gpus[1].utilization`.
    pub field: String,
    /// The offending value as text.
    pub value: String,
    /// What was done: e.g. `not finite: dropped`, `above 1: clamped`.
    pub action: &'static str,
}

/// A model served by the pod (name plus LoRA adapters).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServedModel {
    pub name: String,
    pub adapters: Vec<String>,
    /// The model's version as the agent reports it (`--model-version`; "" when none).
    pub version: String,
}

/// NVML clocks-event (throttle) reasons that mean the GPU is slowed by hardware or heat, not
/// by its normal power management: HW slowdown (0x8), SW thermal slowdown (0x20), HW thermal
/// slowdown (0x40) and HW power brake (0x80). Idle (0x1), application clocks (0x2), the SW
/// power cap (0x4, routine under load), sync boost (0x10) and display clocks (0x100) are not.
pub const SLOWDOWN_REASONS: u64 = 0x8 | 0x20 | 0x40 | 0x80;

/// The agent's name for the source that reads the model server (queue, KV cache, latency).
pub const MODEL_SERVER_SOURCE: &str = "model-server";

/// Fewest tokens in the agent's recent window for its inter-token latency to count: fewer is a
/// pod that barely decodes, whose median says little.
pub const MIN_RECENT_ITL_SAMPLES: u64 = 8;

/// A GPU reading that can score a pod (see [`PodSignals::gpu_load`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuReading {
    /// NVML `utilization.gpu`: share of time any kernel ran (about 1 under any load).
    Utilization,
    /// Active warps over the maximum (GPM `SM_OCCUPANCY`, DCGM `PROF_SM_OCCUPANCY`).
    SmOccupancy,
    /// Share of time SMs had a warp (GPM `SM_UTIL`, DCGM `PROF_SM_ACTIVE`).
    SmUtilization,
    /// Share of time a tensor pipe was active (GPM `ANY_TENSOR_UTIL`).
    TensorActivity,
    /// Share of peak DRAM bandwidth used (GPM `DRAM_BW_UTIL`).
    DramActivity,
}

impl GpuReading {
    /// The config and status name.
    pub fn as_str(&self) -> &'static str {
        match self {
            GpuReading::Utilization => "utilization",
            GpuReading::SmOccupancy => "smOccupancy",
            GpuReading::SmUtilization => "smUtilization",
            GpuReading::TensorActivity => "tensorActivity",
            GpuReading::DramActivity => "dramActivity",
        }
    }

    /// The per-pod `gpu_signal` gauge: 0 none (no GPU term), 1 utilization, 2 smOccupancy,
    /// 3 smUtilization, 4 tensorActivity, 5 dramActivity.
    pub fn gauge_value(reading: Option<GpuReading>) -> u64 {
        match reading {
            None => 0,
            Some(GpuReading::Utilization) => 1,
            Some(GpuReading::SmOccupancy) => 2,
            Some(GpuReading::SmUtilization) => 3,
            Some(GpuReading::TensorActivity) => 4,
            Some(GpuReading::DramActivity) => 5,
        }
    }
}

/// Which GPU reading scores a pod (`cutoffs.gpuSignal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuSignal {
    /// SM occupancy where the pod reports it; otherwise no GPU term and no GPU cut-off: the
    /// time fraction reads about 1 on every busy GPU and would only mislead.
    #[default]
    Auto,
    /// Always this reading; a pod without it has no GPU term.
    Only(GpuReading),
}

impl GpuSignal {
    pub fn as_str(&self) -> &'static str {
        match self {
            GpuSignal::Auto => "auto",
            GpuSignal::Only(r) => r.as_str(),
        }
    }
}

/// GPU activity readings, each the max over the pod's GPUs that report it, 0..=1.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GpuActivity {
    pub sm_occupancy: Option<f64>,
    pub sm_utilization: Option<f64>,
    pub tensor: Option<f64>,
    pub dram: Option<f64>,
}

/// Validated, normalised signals of one pod from one snapshot.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodSignals {
    /// Serving address `IP:PORT` (validated).
    pub address: String,
    pub pod_name: String,
    pub agent_instance: String,
    pub sequence: u64,
    pub models: Vec<ServedModel>,
    /// Max NVML (time-fraction) GPU utilisation over the pod's GPUs, 0..=1.
    pub gpu: Option<f64>,
    /// Max GPU activity readings over the pod's GPUs (absent where no GPU reports them).
    pub activity: GpuActivity,
    /// KV-cache use, else GPU memory ratio, 0..=1.
    pub memory: Option<f64>,
    /// Requests waiting in the model server's queue.
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    /// Max concurrently running sequences, when known (> 0).
    pub queue_capacity: Option<u32>,
    /// KV-cache use 0..=1 as the model server reports it (not the GPU memory fallback).
    pub kv_usage: Option<f64>,
    /// KV-cache capacity in tokens, when known (> 0).
    pub kv_capacity_tokens: Option<u64>,
    /// TTFT p99 (else e2e p99), ms, ≥ 0.
    pub p99_ms: Option<f64>,
    /// TTFT p99 alone (None when the agent reports only the e2e p99), ms, ≥ 0: what
    /// `breaker.adaptiveThresholds` compares with `ttftSloMs`.
    pub ttft_p99_ms: Option<f64>,
    /// Median inter-token latency over the agent's recent window (a few hundred ms), ms > 0;
    /// None with fewer than [`MIN_RECENT_ITL_SAMPLES`] tokens in it.
    pub itl_recent_ms: Option<f64>,
    /// Mean inter-token latency over the same window, ms > 0 (the histogram's sum over its
    /// count, exact where the median is limited to its bucket); None as above, or without a
    /// `_sum` on the model server's page.
    pub itl_recent_mean_ms: Option<f64>,
    /// Share of the model server's requests that failed over the agent's window, 0..=1.
    pub error_rate: Option<f64>,
    /// Requests that finished over that window (`request_rate` × `window_ms`, rounded).
    pub window_requests: Option<u64>,
    /// The model server's cumulative counts of finished requests and of failed ones, as its
    /// agent last read them (finite, ≥ 0, failures at most the finished; else both None):
    /// their increase between snapshots is every outcome since ([`crate::adaptive::Evidence`]).
    pub outcome_totals: Option<(f64, f64)>,
    /// Sum of Xid error counts over GPUs (for fault detection).
    pub xid_total: Option<u64>,
    /// Sum of uncorrected ECC errors over GPUs (for fault detection).
    pub ecc_total: Option<u64>,
    /// Xid/ECC increased since the previous snapshot of the same agent instance.
    pub hardware_fault: bool,
    /// A GPU reports a hardware slowdown among its NVML throttle reasons
    /// ([`SLOWDOWN_REASONS`]): it runs at reduced clocks, so every request there runs slower.
    pub slowdown: bool,
    /// False when every source is failing or no usable reading exists.
    pub has_metrics: bool,
    /// The model server answered its agent before and now does not (see the module docs).
    pub model_server_down: bool,
    /// The peer was reported STALE by the pool agent.
    pub peer_stale: bool,
    /// Monotonic host time (ms) the metrics were last confirmed: the snapshot's receive time,
    /// moved forward when a live stream confirms the peer unchanged.
    pub confirmed_at_ms: u64,
    /// Age of the metrics at `confirmed_at_ms` (the snapshot's `age_ms` at send time; 0 after a
    /// confirmation). Age at `now` = this + (now − confirmed_at), no clock comparison.
    pub age_at_confirm_ms: u64,
    /// When (monotonic host ms) the model server's reading in this snapshot (running, waiting,
    /// KV cache) was taken: the receive time less that source's age at send time (the
    /// snapshot's own age when the agent does not report the source). Requests this VM sent
    /// after it are not in those figures.
    pub engine_sampled_at_ms: u64,
    /// What the pod's prefix cache holds, as its agent reads the model server's KV events
    /// (None: the agent reads none).
    pub prefix: Option<crate::prefix::PrefixSet>,
    /// The model server's prefix-cache hit rate (prompt tokens) over the agent's window, 0..=1.
    pub prefix_hit_rate: Option<f64>,
    /// The agent's pre-OOM state of the pod's GPU nearest to running out of memory (see
    /// [`crate::pre_oom`]); None when no GPU reports one.
    pub pre_oom: Option<crate::pre_oom::PreOomSignal>,
    /// The pod's kind of GPU: a hash of its GPUs' names, in order, and their number (0: the
    /// snapshot lists no GPU). Pods with the same GPUs share it; `cutoffs.slowItlRatio`
    /// compares a pod's decode speed with pods of its kind as well as with the pool.
    pub gpu_kind: u64,
}

/// A pod's reported prefix-cache contents, validated: a block size in
/// 1..=[`crate::prefix::keys::MAX_BLOCK_TOKENS`] and a model name (else dropped, said); keys
/// sorted and deduplicated (sorted here when the agent did not, said), at most
/// [`crate::prefix::keys::MAX_POD_KEYS`] (the rest dropped and the set marked truncated, said).
fn prefix_set(
    p: &ai_lb_proto::PrefixCacheSummary,
    issues: &mut Vec<SignalIssue>,
) -> Option<crate::prefix::PrefixSet> {
    use crate::prefix::keys::{seed_of, MAX_BLOCK_TOKENS, MAX_POD_KEYS};
    if p.block_tokens == 0 || p.block_tokens > MAX_BLOCK_TOKENS {
        issues.push(SignalIssue {
            field: "prefix_cache.block_tokens".into(),
            value: p.block_tokens.to_string(),
            action: "not within 1..=65536: prefix cache ignored",
        });
        return None;
    }
    if p.model.trim().is_empty() {
        issues.push(SignalIssue {
            field: "prefix_cache.model".into(),
            value: format!("{:?}", p.model),
            action: "empty: prefix cache ignored",
        });
        return None;
    }
    let mut keys = p.keys.clone();
    let mut truncated = p.truncated;
    if !keys.windows(2).all(|w| w.first() < w.get(1)) {
        issues.push(SignalIssue {
            field: "prefix_cache.keys".into(),
            value: format!("{} keys", keys.len()),
            action: "not sorted ascending without duplicates: sorted",
        });
        keys.sort_unstable();
        keys.dedup();
    }
    if keys.len() > MAX_POD_KEYS {
        issues.push(SignalIssue {
            field: "prefix_cache.keys".into(),
            value: format!("{} keys", keys.len()),
            action: "more than 65536: the rest dropped",
        });
        keys.truncate(MAX_POD_KEYS);
        truncated = true;
    }
    keys.shrink_to_fit();
    Some(crate::prefix::PrefixSet {
        block_tokens: p.block_tokens,
        model_seed: seed_of(p.model.trim()),
        keys,
        truncated,
    })
}

/// The kind of GPU a pod runs on, from its snapshot's GPUs: FNV-1a over each GPU's name
/// (trimmed) and a separator, so the same names in the same order and number give the same
/// kind (a pod on two H100s is not a pod on one); 0 when there is none.
fn gpu_kind(gpus: &[ai_lb_proto::GpuStats]) -> u64 {
    use crate::prefix::own::{fnv1a, FNV_OFFSET};
    if gpus.is_empty() {
        return 0;
    }
    let h = gpus.iter().fold(FNV_OFFSET, |h, g| {
        fnv1a(h, g.name.trim().bytes().chain(std::iter::once(0xff)))
    });
    // 0 stands for no GPU.
    h.max(1)
}

impl PodSignals {
    /// Validates one snapshot received at `received_at_ms` (monotonic host ms). Returns None
    /// (with an issue) when the snapshot has no valid serving address: it cannot be steered to.
    pub fn from_proto(
        snap: &PodSnapshot,
        received_at_ms: u64,
    ) -> (Option<PodSignals>, Vec<SignalIssue>) {
        let mut issues = Vec::new();
        let identity = snap.identity.as_ref();
        let address = identity.map(|i| i.address.as_str()).unwrap_or("");
        if address.parse::<SocketAddr>().is_err() {
            issues.push(SignalIssue {
                field: "identity.address".into(),
                value: format!("{address:?}"),
                action: "not IP:PORT: snapshot ignored",
            });
            return (None, issues);
        }
        let models = identity
            .map(|i| {
                i.models
                    .iter()
                    .map(|m| ServedModel {
                        name: m.name.clone(),
                        adapters: m.adapters.clone(),
                        version: m.version.trim().to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default();

        let mut gpu: Option<f64> = None;
        let mut activity = GpuActivity::default();
        let mut mem_ratio: Option<f64> = None;
        let mut xid_total: Option<u64> = None;
        let mut ecc_total: Option<u64> = None;
        let mut slowdown = false;
        let mut pre_oom: Option<crate::pre_oom::PreOomSignal> = None;
        let sampled_at_ms = received_at_ms.saturating_sub(snap.age_ms);
        for (i, g) in snap.gpus.iter().enumerate() {
            if let Some(p) = crate::pre_oom::from_gpu(i, g, sampled_at_ms, &mut issues) {
                pre_oom = Some(pre_oom.map_or(p, |q| q.earlier(p)));
            }
            if let Some(r) = g.memory_growth_bytes_per_s.filter(|r| !r.is_finite()) {
                issues.push(SignalIssue {
                    field: format!("gpus[{i}].memory_growth_bytes_per_s"),
                    value: r.to_string(),
                    action: "not finite: dropped",
                });
            }
            slowdown |= g
                .throttle_reasons
                .is_some_and(|m| m & SLOWDOWN_REASONS != 0);
            if let Some(u) = ratio(
                &format!("gpus[{i}].utilization"),
                g.utilization,
                &mut issues,
            ) {
                gpu = Some(gpu.map_or(u, |m: f64| m.max(u)));
            }
            let mut take_max = |name: &str, v: Option<f64>, into: &mut Option<f64>| {
                if let Some(x) = ratio(&format!("gpus[{i}].{name}"), v, &mut issues) {
                    *into = Some(into.map_or(x, |m: f64| m.max(x)));
                }
            };
            take_max("sm_occupancy", g.sm_occupancy, &mut activity.sm_occupancy);
            take_max(
                "sm_utilization",
                g.sm_utilization,
                &mut activity.sm_utilization,
            );
            take_max("tensor_activity", g.tensor_activity, &mut activity.tensor);
            take_max("dram_activity", g.dram_activity, &mut activity.dram);
            if let (Some(used), Some(total)) = (g.memory_used_bytes, g.memory_total_bytes) {
                if total == 0 {
                    issues.push(SignalIssue {
                        field: format!("gpus[{i}].memory_total_bytes"),
                        value: "0".into(),
                        action: "zero total: memory ratio dropped",
                    });
                } else {
                    let mut r = used as f64 / total as f64;
                    if r > 1.0 {
                        issues.push(SignalIssue {
                            field: format!("gpus[{i}].memory_used_bytes"),
                            value: used.to_string(),
                            action: "above total: clamped",
                        });
                        r = 1.0;
                    }
                    mem_ratio = Some(mem_ratio.map_or(r, |m: f64| m.max(r)));
                }
            }
            if let Some(x) = g.xid_errors {
                xid_total = Some(xid_total.unwrap_or(0).saturating_add(x));
            }
            if let Some(e) = g.ecc_uncorrected_errors {
                ecc_total = Some(ecc_total.unwrap_or(0).saturating_add(e));
            }
        }

        let inf = snap.inference.as_ref();
        let kv = inf.and_then(|s| ratio("inference.kv_cache_usage", s.kv_cache_usage, &mut issues));
        let memory = kv.or(mem_ratio);
        let waiting = inf.and_then(|s| s.waiting);
        let running = inf.and_then(|s| s.running);
        let queue_capacity = match inf.and_then(|s| s.queue_capacity) {
            Some(0) => {
                issues.push(SignalIssue {
                    field: "inference.queue_capacity".into(),
                    value: "0".into(),
                    action: "zero: dropped",
                });
                None
            }
            other => other,
        };
        let kv_capacity_tokens = match inf.and_then(|s| s.kv_capacity_tokens) {
            Some(0) => {
                issues.push(SignalIssue {
                    field: "inference.kv_capacity_tokens".into(),
                    value: "0".into(),
                    action: "zero: dropped",
                });
                None
            }
            other => other,
        };
        let ttft = inf
            .and_then(|s| s.ttft.as_ref())
            .filter(|q| q.samples > 0)
            .and_then(|q| millis("inference.ttft.p99_ms", q.p99_ms, &mut issues));
        let e2e = inf
            .and_then(|s| s.e2e.as_ref())
            .filter(|q| q.samples > 0)
            .and_then(|q| millis("inference.e2e.p99_ms", q.p99_ms, &mut issues));
        let p99_ms = ttft.or(e2e);
        let ttft_p99_ms = ttft;
        let recent = inf
            .and_then(|s| s.inter_token_recent.as_ref())
            .filter(|q| q.samples >= MIN_RECENT_ITL_SAMPLES);
        let itl_recent_ms = recent
            .and_then(|q| millis("inference.inter_token_recent.p50_ms", q.p50_ms, &mut issues))
            .filter(|&v| v > 0.0);
        let itl_recent_mean_ms = recent
            .and_then(|q| {
                millis(
                    "inference.inter_token_recent.mean_ms",
                    q.mean_ms,
                    &mut issues,
                )
            })
            .filter(|&v| v > 0.0);
        let error_rate = inf.and_then(|s| ratio("inference.error_rate", s.error_rate, &mut issues));
        let window_requests = inf.and_then(|s| {
            let r = s.request_rate?;
            if !r.is_finite() || r < 0.0 {
                issues.push(SignalIssue {
                    field: "inference.request_rate".into(),
                    value: r.to_string(),
                    action: "not a finite rate >= 0: dropped",
                });
                return None;
            }
            // The rates' own window; an older agent's rates cover the whole window.
            let span = if s.rate_window_ms > 0 {
                s.rate_window_ms
            } else {
                s.window_ms
            };
            // Saturating float-to-int conversion: huge rates cannot wrap.
            Some((r * f64::from(span) / 1000.0).round() as u64)
        });

        let outcome_totals = inf.and_then(|s| {
            let (f, e) = (s.finished_total?, s.errors_total?);
            if f.is_finite() && e.is_finite() && f >= 0.0 && (0.0..=f).contains(&e) {
                Some((f, e))
            } else {
                issues.push(SignalIssue {
                    field: "inference.finished_total".into(),
                    value: format!("{f} (errors_total {e})"),
                    action: "not finite counts >= 0 with errors <= finished: dropped",
                });
                None
            }
        });

        let all_failing = !snap.sources.is_empty()
            && snap
                .sources
                .iter()
                .all(|s| s.state == SourceState::Failing as i32);
        let any_reading = gpu.is_some()
            || activity.sm_occupancy.is_some()
            || memory.is_some()
            || waiting.is_some()
            || p99_ms.is_some();
        let has_metrics = any_reading && !all_failing;
        let model_server_down = snap.sources.iter().any(|s| {
            s.name == MODEL_SERVER_SOURCE
                && s.state == SourceState::Failing as i32
                && s.last_success_age_ms.is_some()
        });

        // The model server is read less often than the GPU: its figures can be older than the
        // snapshot (whose age is that of its newest reading).
        let engine_age_ms = snap
            .sources
            .iter()
            .find(|s| s.name == MODEL_SERVER_SOURCE)
            .and_then(|s| s.last_success_age_ms)
            .unwrap_or(snap.age_ms)
            .max(snap.age_ms);

        let prefix = snap
            .prefix_cache
            .as_ref()
            .and_then(|p| prefix_set(p, &mut issues));
        let prefix_hit_rate = inf.and_then(|s| {
            ratio(
                "inference.prefix_cache_hit_rate",
                s.prefix_cache_hit_rate,
                &mut issues,
            )
        });
        let signals = PodSignals {
            address: address.to_string(),
            pod_name: identity.map(|i| i.pod_name.clone()).unwrap_or_default(),
            agent_instance: snap.agent_instance.clone(),
            sequence: snap.sequence,
            models,
            gpu,
            activity,
            memory,
            waiting,
            running,
            queue_capacity,
            kv_usage: kv,
            kv_capacity_tokens,
            p99_ms,
            ttft_p99_ms,
            itl_recent_ms,
            itl_recent_mean_ms,
            error_rate,
            window_requests,
            outcome_totals,
            xid_total,
            ecc_total,
            hardware_fault: false,
            slowdown,
            has_metrics,
            model_server_down,
            peer_stale: false,
            confirmed_at_ms: received_at_ms,
            age_at_confirm_ms: snap.age_ms,
            engine_sampled_at_ms: received_at_ms.saturating_sub(engine_age_ms),
            prefix,
            prefix_hit_rate,
            pre_oom,
            gpu_kind: gpu_kind(&snap.gpus),
        };
        (Some(signals), issues)
    }

    /// The GPU reading that scores the pod under `signal`, with its value; None: the pod has
    /// no GPU term (and no GPU cut-off).
    pub fn gpu_load(&self, signal: GpuSignal) -> Option<(GpuReading, f64)> {
        let a = &self.activity;
        let (reading, value) = match signal {
            GpuSignal::Auto => (GpuReading::SmOccupancy, a.sm_occupancy),
            GpuSignal::Only(r) => (
                r,
                match r {
                    GpuReading::Utilization => self.gpu,
                    GpuReading::SmOccupancy => a.sm_occupancy,
                    GpuReading::SmUtilization => a.sm_utilization,
                    GpuReading::TensorActivity => a.tensor,
                    GpuReading::DramActivity => a.dram,
                },
            ),
        };
        value.map(|v| (reading, v))
    }

    /// Sets `hardware_fault` when Xid or ECC totals grew since `prev`, a snapshot of the same
    /// agent instance. A different instance (agent restart) resets the counters: no fault.
    pub fn detect_fault_since(&mut self, prev: &PodSignals) {
        if prev.agent_instance != self.agent_instance {
            return;
        }
        let grew = |now: Option<u64>, before: Option<u64>| matches!((now, before), (Some(n), Some(b)) if n > b);
        if grew(self.xid_total, prev.xid_total) || grew(self.ecc_total, prev.ecc_total) {
            self.hardware_fault = true;
        }
        // A same-sequence resend keeps the verdict of the snapshot it repeats.
        if prev.sequence == self.sequence && prev.hardware_fault {
            self.hardware_fault = true;
        }
    }

    /// Whether the agent's own count says the pod fails at least `rate` of its requests, over at
    /// least `min_requests` of them (every client's, not one sidecar's).
    pub fn failing(&self, rate: f64, min_requests: u32) -> bool {
        matches!(
            (self.error_rate, self.window_requests),
            (Some(e), Some(n)) if e >= rate && n >= u64::from(min_requests)
        )
    }

    /// Age of the metrics at `now_ms` (0 if the host clock went backwards).
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        self.age_at_confirm_ms
            .saturating_add(now_ms.saturating_sub(self.confirmed_at_ms))
    }

    /// Whether the pod counts as stale at `now_ms`: its agent's stream went stale, or the
    /// metrics are older than `staleness_ms`.
    pub fn is_stale(&self, now_ms: u64, staleness_ms: u64) -> bool {
        self.peer_stale || self.age_ms(now_ms) > staleness_ms
    }

    /// The first `now_ms` at which the metrics are older than `staleness_ms`.
    pub fn stale_at_ms(&self, staleness_ms: u64) -> u64 {
        let left = staleness_ms.saturating_sub(self.age_at_confirm_ms);
        self.confirmed_at_ms.saturating_add(left).saturating_add(1)
    }

    /// A live stream confirmed the metrics unchanged at `now_ms`.
    pub fn confirm(&mut self, now_ms: u64) {
        if now_ms >= self.confirmed_at_ms {
            self.confirmed_at_ms = now_ms;
            self.age_at_confirm_ms = 0;
        }
    }

    /// The pod's model version: the first non-empty version of its models, else
    /// [`crate::versions::UNVERSIONED`] ("").
    pub fn version(&self) -> &str {
        self.models
            .iter()
            .map(|m| m.version.as_str())
            .find(|v| !v.is_empty())
            .unwrap_or(crate::versions::UNVERSIONED)
    }

    /// True when the pod serves `model` as a base model or a LoRA adapter.
    pub fn serves(&self, model: &str) -> bool {
        self.models
            .iter()
            .any(|m| m.name == model || m.adapters.iter().any(|a| a == model))
    }
}

fn ratio(field: &str, v: Option<f64>, issues: &mut Vec<SignalIssue>) -> Option<f64> {
    let v = v?;
    if !v.is_finite() {
        issues.push(SignalIssue {
            field: field.into(),
            value: v.to_string(),
            action: "not finite: dropped",
        });
        return None;
    }
    if v < 0.0 {
        issues.push(SignalIssue {
            field: field.into(),
            value: v.to_string(),
            action: "below 0: clamped",
        });
        return Some(0.0);
    }
    if v > 1.0 {
        issues.push(SignalIssue {
            field: field.into(),
            value: v.to_string(),
            action: "above 1: clamped",
        });
        return Some(1.0);
    }
    Some(v)
}

fn millis(field: &str, v: Option<f64>, issues: &mut Vec<SignalIssue>) -> Option<f64> {
    let v = v?;
    if !v.is_finite() || v < 0.0 {
        issues.push(SignalIssue {
            field: field.into(),
            value: v.to_string(),
            action: "not a finite value ≥ 0: dropped",
        });
        return None;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::{GpuStats, InferenceStats, LatencyQuantiles, PodIdentity, SourceStatus};

    pub(crate) fn snap(addr: &str) -> PodSnapshot {
        PodSnapshot {
            identity: Some(PodIdentity {
                address: addr.into(),
                ..Default::default()
            }),
            gpus: vec![
                GpuStats {
                    utilization: Some(0.2),
                    memory_used_bytes: Some(90),
                    memory_total_bytes: Some(100),
                    ..Default::default()
                },
                GpuStats {
                    utilization: Some(0.6),
                    ..Default::default()
                },
            ],
            inference: Some(InferenceStats {
                waiting: Some(3),
                ttft: Some(LatencyQuantiles {
                    p99_ms: Some(120.0),
                    samples: 10,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            age_ms: 30,
            agent_instance: "a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn derives_max_gpu_memory_fallback_and_ttft() {
        let (s, issues) = PodSignals::from_proto(&snap("10.0.0.1:8000"), 1000);
        let s = s.unwrap();
        assert!(issues.is_empty());
        assert_eq!(s.gpu, Some(0.6));
        assert_eq!(s.memory, Some(0.9));
        assert_eq!(s.p99_ms, Some(120.0));
        assert_eq!(s.age_ms(1000), 30);
        assert_eq!(s.age_ms(1100), 130);
        assert_eq!(s.stale_at_ms(100), 1071);
        assert!(s.has_metrics);
    }

    #[test]
    fn recent_itl_needs_enough_tokens_and_a_sane_value() {
        let with = |p50: Option<f64>, samples: u64| {
            let mut p = snap("10.0.0.1:8000");
            if let Some(i) = p.inference.as_mut() {
                i.inter_token_recent = Some(LatencyQuantiles {
                    p50_ms: p50,
                    p99_ms: None,
                    samples,
                    mean_ms: p50.map(|v| v * 0.9),
                });
            }
            let (s, issues) = PodSignals::from_proto(&p, 0);
            let s = s.unwrap();
            // The mean goes with the median: same token minimum, same checks.
            assert_eq!(s.itl_recent_mean_ms, s.itl_recent_ms.map(|v| v * 0.9));
            (s.itl_recent_ms, issues)
        };
        assert_eq!(with(Some(12.5), 8), (Some(12.5), vec![]));
        // Too few tokens to judge: no reading, no issue.
        assert_eq!(with(Some(12.5), 7), (None, vec![]));
        assert_eq!(with(Some(0.0), 100).0, None);
        let (v, issues) = with(Some(f64::NAN), 100);
        assert_eq!(v, None);
        assert_eq!(issues[0].field, "inference.inter_token_recent.p50_ms");
        assert_eq!(issues[0].value, "NaN");
        assert_eq!(issues[1].field, "inference.inter_token_recent.mean_ms");
        // Without a mean (no `_sum` on the page), the median alone.
        let mut p = snap("10.0.0.1:8000");
        if let Some(i) = p.inference.as_mut() {
            i.inter_token_recent = Some(LatencyQuantiles {
                p50_ms: Some(5.0),
                samples: 100,
                ..Default::default()
            });
        }
        let s = PodSignals::from_proto(&p, 0).0.unwrap();
        assert_eq!((s.itl_recent_ms, s.itl_recent_mean_ms), (Some(5.0), None));
    }

    #[test]
    fn kv_cache_preferred_over_gpu_memory() {
        let mut p = snap("10.0.0.1:8000");
        if let Some(i) = p.inference.as_mut() {
            i.kv_cache_usage = Some(0.3);
        }
        let (s, _) = PodSignals::from_proto(&p, 0);
        let s = s.unwrap();
        assert_eq!(s.memory, Some(0.3));
        assert_eq!(s.kv_usage, Some(0.3));
    }

    #[test]
    fn kv_capacity_is_kept_and_zero_is_dropped_with_an_issue() {
        let mut p = snap("10.0.0.1:8000");
        if let Some(i) = p.inference.as_mut() {
            i.kv_capacity_tokens = Some(12_496);
        }
        let (s, issues) = PodSignals::from_proto(&p, 0);
        let s = s.unwrap();
        assert!(issues.is_empty());
        assert_eq!(s.kv_capacity_tokens, Some(12_496));
        // GPU memory is a memory signal but not KV use.
        assert_eq!(s.kv_usage, None);
        if let Some(i) = p.inference.as_mut() {
            i.kv_capacity_tokens = Some(0);
        }
        let (s, issues) = PodSignals::from_proto(&p, 0);
        assert_eq!(s.unwrap().kv_capacity_tokens, None);
        assert_eq!(issues[0].field, "inference.kv_capacity_tokens");
        assert_eq!(issues[0].value, "0");
    }

    #[test]
    fn error_rate_counts_the_requests_it_covers() {
        let mut p = snap("10.0.0.1:8000");
        if let Some(i) = p.inference.as_mut() {
            i.error_rate = Some(0.5);
            i.request_rate = Some(1.25);
            i.window_ms = 10_000;
        }
        let (s, issues) = PodSignals::from_proto(&p, 0);
        let s = s.unwrap();
        assert!(issues.is_empty());
        assert_eq!((s.error_rate, s.window_requests), (Some(0.5), Some(13)));
        assert!(s.failing(0.5, 10));
        assert!(!s.failing(0.6, 10), "rate below the threshold");
        assert!(!s.failing(0.5, 14), "too few requests");
        // The rates' own (shorter) window, when the agent states it.
        if let Some(i) = p.inference.as_mut() {
            i.rate_window_ms = 4_000;
        }
        let (s, _) = PodSignals::from_proto(&p, 0);
        assert_eq!(s.unwrap().window_requests, Some(5));
        // Nonsense is dropped with an issue naming the field, and never reads as failing.
        if let Some(i) = p.inference.as_mut() {
            i.error_rate = Some(f64::NAN);
            i.request_rate = Some(-3.0);
        }
        let (s, issues) = PodSignals::from_proto(&p, 0);
        let s = s.unwrap();
        assert_eq!((s.error_rate, s.window_requests), (None, None));
        let fields: Vec<_> = issues.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(fields, ["inference.error_rate", "inference.request_rate"]);
        assert!(!s.failing(0.0, 0));
    }

    #[test]
    fn outcome_counts_are_kept_only_when_they_make_sense() {
        let mut p = snap("10.0.0.1:8000");
        let totals = |p: &PodSnapshot| PodSignals::from_proto(p, 0);
        let set = |p: &mut PodSnapshot, f: Option<f64>, e: Option<f64>| {
            if let Some(i) = p.inference.as_mut() {
                i.finished_total = f;
                i.errors_total = e;
            }
        };
        set(&mut p, Some(120.0), Some(7.0));
        let (s, issues) = totals(&p);
        assert_eq!(s.unwrap().outcome_totals, Some((120.0, 7.0)));
        assert!(issues.is_empty());
        // One of the two missing: no counts, and nothing wrong with that.
        set(&mut p, Some(120.0), None);
        let (s, issues) = totals(&p);
        assert_eq!(s.unwrap().outcome_totals, None);
        assert!(issues.is_empty());
        // More failures than requests, a negative or a NaN count: dropped, naming the field.
        for (f, e) in [(5.0, 7.0), (-1.0, 0.0), (f64::NAN, 1.0)] {
            set(&mut p, Some(f), Some(e));
            let (s, issues) = totals(&p);
            assert_eq!(s.unwrap().outcome_totals, None, "{f} {e}");
            assert_eq!(issues[0].field, "inference.finished_total", "{f} {e}");
        }
    }

    #[test]
    fn nan_and_out_of_range_are_counted() {
        let mut p = snap("10.0.0.1:8000");
        p.gpus[0].utilization = Some(f64::NAN);
        p.gpus[1].utilization = Some(1.7);
        let (s, issues) = PodSignals::from_proto(&p, 0);
        assert_eq!(s.unwrap().gpu, Some(1.0));
        assert_eq!(issues.len(), 2);
        assert_eq!(issues[0].field, "gpus[0].utilization");
    }

    #[test]
    fn bad_address_rejects_snapshot() {
        let (s, issues) = PodSignals::from_proto(&snap("pod-a"), 0);
        assert!(s.is_none());
        assert_eq!(issues[0].field, "identity.address");
    }

    #[test]
    fn all_sources_failing_means_no_metrics() {
        let mut p = snap("10.0.0.1:8000");
        p.sources = vec![SourceStatus {
            name: "nvml".into(),
            state: SourceState::Failing as i32,
            ..Default::default()
        }];
        let (s, _) = PodSignals::from_proto(&p, 0);
        assert!(!s.unwrap().has_metrics);
    }

    #[test]
    fn a_model_server_that_stops_answering_is_down_but_one_that_never_answered_is_not() {
        let status =
            |name: &str, state: SourceState, last_success_age_ms: Option<u64>| SourceStatus {
                name: name.into(),
                state: state as i32,
                last_success_age_ms,
                ..Default::default()
            };
        let down = |sources: Vec<SourceStatus>| {
            let mut p = snap("10.0.0.1:8000");
            p.sources = sources;
            PodSignals::from_proto(&p, 0).0.unwrap().model_server_down
        };
        let nvml = status("nvml", SourceState::Fresh, Some(3));
        assert!(down(vec![
            nvml.clone(),
            status(MODEL_SERVER_SOURCE, SourceState::Failing, Some(180)),
        ]));
        // Never answered: a misconfigured or just-started agent, so missing metrics only.
        assert!(!down(vec![
            nvml.clone(),
            status(MODEL_SERVER_SOURCE, SourceState::Failing, None),
        ]));
        assert!(!down(vec![
            nvml.clone(),
            status(MODEL_SERVER_SOURCE, SourceState::Fresh, Some(0)),
        ]));
        // Another source failing, or no model-server source at all, is not this.
        assert!(!down(vec![status("nvml", SourceState::Failing, Some(900))]));
        assert!(!down(vec![
            nvml,
            status(MODEL_SERVER_SOURCE, SourceState::Absent, None),
        ]));
    }

    #[test]
    fn xid_increase_is_a_fault_only_within_one_instance() {
        let mut p = snap("10.0.0.1:8000");
        p.gpus[0].xid_errors = Some(1);
        let (a, _) = PodSignals::from_proto(&p, 0);
        p.gpus[0].xid_errors = Some(2);
        p.sequence = 1;
        let (b, _) = PodSignals::from_proto(&p, 0);
        let mut b = b.unwrap();
        b.detect_fault_since(a.as_ref().unwrap());
        assert!(b.hardware_fault);
        p.agent_instance = "restarted".into();
        let (c, _) = PodSignals::from_proto(&p, 0);
        let mut c = c.unwrap();
        c.detect_fault_since(a.as_ref().unwrap());
        assert!(!c.hardware_fault);
    }

    #[test]
    fn gpu_kind_is_shared_by_the_same_gpus_in_the_same_number() {
        let named = |names: &[&str]| {
            names
                .iter()
                .map(|n| GpuStats {
                    name: (*n).into(),
                    ..Default::default()
                })
                .collect::<Vec<_>>()
        };
        let h100 = gpu_kind(&named(&["NVIDIA H100 80GB HBM3"]));
        assert_eq!(h100, gpu_kind(&named(&[" NVIDIA H100 80GB HBM3 "])));
        assert_ne!(h100, gpu_kind(&named(&["NVIDIA L40S"])));
        assert_ne!(
            h100,
            gpu_kind(&named(&["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]))
        );
        assert_eq!(gpu_kind(&[]), 0);
        assert_ne!(gpu_kind(&named(&[""])), 0);
        let (s, _) = PodSignals::from_proto(&snap("10.0.0.1:8000"), 0);
        assert_eq!(s.unwrap().gpu_kind, gpu_kind(&snap("10.0.0.1:8000").gpus));
    }
}
