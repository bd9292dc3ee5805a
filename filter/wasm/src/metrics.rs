//! Decides nothing: names and caches the filter's Envoy metrics. Per-pod metrics carry the pod
//! in the name (`ailb.endpoint.<ip:port>.<metric>`) and envoy.yaml's `stats_tags` turns it into
//! a label. Ids are defined once per VM and cached, so the request path does not allocate names.
//! `ailb.vm_memory_bytes` is the wasm linear memory of the VM that last wrote it (every VM
//! writes it on its gauge tick, so it is "one VM's size", sampled; all VMs run the same code).

use std::collections::{HashMap, HashSet};

use proxy_wasm::types::MetricType;

use crate::host;

/// The per-pod metric ids.
#[derive(Debug, Clone, Copy)]
pub struct PodMetrics {
    pub picks: Option<u32>,
    pub failures: Option<u32>,
    pub score: Option<u32>,
    pub breaker_state: Option<u32>,
    pub metrics_age_ms: Option<u32>,
    pub inflight: Option<u32>,
    pub gpu_signal: Option<u32>,
}

/// Metric id cache of one VM.
#[derive(Debug, Default)]
pub struct Metrics {
    named: HashMap<String, u32>,
    pods: HashMap<String, PodMetrics>,
    /// Last exported values of the core's counters (exported as deltas).
    last_core: HashMap<&'static str, u64>,
    /// `declare_event_counters` has run.
    events_declared: bool,
    /// Last exported per-version counts (`versions`), by version.
    last_versions: HashMap<String, ai_lb_filter_core::versions::VersionCounts>,
}

/// Counters the glue itself counts, of events that may not have happened yet.
const STREAM_COUNTERS: [&str; 4] = [
    "ailb.stream.opens",
    "ailb.stream.failures",
    "ailb.stream.decode_errors",
    "ailb.stream.closes",
];

impl Metrics {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.named.get(name) {
            return Some(*id);
        }
        let id = host::define_metric(kind, name)?;
        self.named.insert(name.to_string(), id);
        Some(id)
    }

    /// Adds `by` to counter `name` (defined on first use).
    pub fn inc(&mut self, name: &str, by: u64) {
        if by == 0 {
            return;
        }
        if let Some(id) = self.id(MetricType::Counter, name) {
            host::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }

    /// Defines counter `name` at 0 if it is not defined yet, so that a count of events that
    /// have not happened reads 0 in Envoy's stats (and a dashboard shows 0, not "no data").
    pub fn declare(&mut self, name: &str) {
        let _ = self.id(MetricType::Counter, name);
    }

    /// Defines, once per VM, the glue's own event counters at 0: the agent stream's and the
    /// breaker transitions (`ailb.breaker_opened.<reason>` for every reason).
    pub fn declare_event_counters(&mut self) {
        if self.events_declared {
            return;
        }
        self.events_declared = true;
        for name in STREAM_COUNTERS {
            self.declare(name);
        }
        self.declare("ailb.state_busy");
        self.declare("ailb.breaker_half_opened");
        self.declare("ailb.breaker_closed");
        for r in ai_lb_filter_core::breaker::TripReason::ALL {
            self.declare(&format!("ailb.breaker_opened.{}", r.as_str()));
        }
    }

    /// Sets gauge `name`.
    pub fn set(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            host::record_metric(id, value);
        }
    }

    /// Sets `ailb.vm_memory_bytes` to this VM's wasm linear memory size (no-op off wasm).
    pub fn vm_memory(&mut self) {
        if let Some(bytes) = vm_memory_bytes() {
            self.set("ailb.vm_memory_bytes", bytes);
        }
    }

    /// Records `value` in histogram `name` (defined on first use).
    pub fn record(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            host::record_metric(id, value);
        }
    }

    /// The metric ids of `pod`, defined on first use.
    pub fn pod(&mut self, pod: &str) -> PodMetrics {
        if let Some(m) = self.pods.get(pod) {
            return *m;
        }
        let name = |m: &str| format!("ailb.endpoint.{pod}.{m}");
        let m = PodMetrics {
            picks: host::define_metric(MetricType::Counter, &name("picks")),
            failures: host::define_metric(MetricType::Counter, &name("failures")),
            score: host::define_metric(MetricType::Gauge, &name("score")),
            breaker_state: host::define_metric(MetricType::Gauge, &name("breaker_state")),
            metrics_age_ms: host::define_metric(MetricType::Gauge, &name("metrics_age_ms")),
            inflight: host::define_metric(MetricType::Gauge, &name("inflight")),
            gpu_signal: host::define_metric(MetricType::Gauge, &name("gpu_signal")),
        };
        self.pods.insert(pod.to_string(), m);
        m
    }

    /// How many pods have cached metric ids.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Drops the cached metric ids of every pod not in `live` (they are defined again if the
    /// pod comes back; Envoy keeps the stats).
    pub fn forget_pods_except(&mut self, live: &HashSet<&str>) {
        self.pods.retain(|p, _| live.contains(p.as_str()));
    }

    /// Counts a pick of `pod`.
    pub fn pick(&mut self, pod: &str) {
        if let Some(id) = self.pod(pod).picks {
            host::increment_metric(id, 1);
        }
    }

    /// Counts a failed outcome of `pod`.
    pub fn failure(&mut self, pod: &str) {
        if let Some(id) = self.pod(pod).failures {
            host::increment_metric(id, 1);
        }
    }

    /// Counts breaker transitions that happened on the shared breaker state (each once for
    /// the process: only the VM that wrote it sees them).
    pub fn transitions(&mut self, transitions: &[ai_lb_filter_core::breaker::Transition]) {
        use ai_lb_filter_core::breaker::BreakerState;
        for t in transitions {
            match t.to {
                BreakerState::Open => {
                    let reason = t.reason.map_or("unknown", |r| r.as_str());
                    self.inc(&format!("ailb.breaker_opened.{reason}"), 1);
                }
                BreakerState::HalfOpen => self.inc("ailb.breaker_half_opened", 1),
                BreakerState::Closed => self.inc("ailb.breaker_closed", 1),
            }
        }
    }

    /// Exports the per-version counts (`versions`) as `ailb.version.<version>.<name>` deltas
    /// since the last call, and each version's domain state as the gauge
    /// `ailb.version.<version>.domain_state` (0 closed, 1 half-open, 2 open).
    pub fn export_versions(
        &mut self,
        totals: &[(
            String,
            ai_lb_filter_core::versions::VersionCounts,
            ai_lb_filter_core::breaker::BreakerState,
        )],
    ) {
        for (version, counts, state) in totals {
            let seg = ai_lb_filter_core::picker::version_stat_segment(version);
            let last = self.last_versions.get(version).copied();
            let before = last.unwrap_or_default().iter();
            for ((name, v), (_, old)) in counts.iter().iter().zip(before.iter()) {
                let stat = format!("ailb.version.{seg}.{name}");
                if last.is_none() {
                    self.declare(&stat);
                }
                self.inc(&stat, v.saturating_sub(*old));
            }
            self.last_versions.insert(version.clone(), *counts);
            self.set(
                &format!("ailb.version.{seg}.domain_state"),
                state.gauge_value(),
            );
        }
    }

    /// Exports the core's monotonic counters as `ailb.<name>` deltas since the last call;
    /// returns the requests not steered by score (fallbacks and fail-opens) in this call.
    pub fn export_core(&mut self, counters: &[(&'static str, u64)]) -> u64 {
        let mut fallbacks = 0;
        for (name, value) in counters {
            if !ai_lb_filter_core::Counters::exported(name) {
                continue;
            }
            let Some(last) = self.last_core.insert(name, *value) else {
                // First export: every core counter exists from here on, 0 or not.
                let stat = format!("ailb.{name}");
                self.declare(&stat);
                self.inc(&stat, *value);
                if name.starts_with("fallback.") || *name == "fail_open" {
                    fallbacks += value;
                }
                continue;
            };
            let delta = value.saturating_sub(last);
            if delta > 0 {
                if name.starts_with("fallback.") || *name == "fail_open" {
                    fallbacks += delta;
                }
                self.inc(&format!("ailb.{name}"), delta);
            }
        }
        fallbacks
    }
}

/// This VM's wasm linear memory in bytes (pages x 64 KiB); it only grows, so it is the peak.
#[cfg(target_arch = "wasm32")]
fn vm_memory_bytes() -> Option<u64> {
    Some((core::arch::wasm32::memory_size(0) as u64).saturating_mul(65536))
}

/// No linear memory off wasm (native unit tests).
#[cfg(not(target_arch = "wasm32"))]
fn vm_memory_bytes() -> Option<u64> {
    None
}

/// The big-request hold's stats (`ailb.big_hold.*`).
impl ai_lb_filter_core::lifecycle::hold::HoldStats for Metrics {
    fn count(&mut self, what: &str) {
        self.inc(&format!("ailb.big_hold.{what}"), 1);
    }
    fn depth(&mut self, depth: u64) {
        self.set("ailb.big_hold.depth", depth);
    }
    fn waited(&mut self, ms: u64) {
        self.record("ailb.big_hold.wait_ms", ms);
    }
}

impl ai_lb_filter_core::lifecycle::Stats for Metrics {
    fn picked(&mut self, pod: &str) {
        self.pick(pod);
    }
    fn failed(&mut self, pod: &str) {
        self.failure(pod);
    }
    fn transitions(&mut self, _pod: &str, ts: &[ai_lb_filter_core::breaker::Transition]) {
        Metrics::transitions(self, ts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_ids_of_pods_that_left_are_forgotten() {
        let mut m = Metrics::default();
        let none = PodMetrics {
            picks: None,
            failures: None,
            score: None,
            breaker_state: None,
            metrics_age_ms: None,
            inflight: None,
            gpu_signal: None,
        };
        for p in ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"] {
            m.pods.insert(p.to_string(), none);
        }
        assert_eq!(m.pod_count(), 3);
        let live: HashSet<&str> = ["10.0.0.2:8000"].into_iter().collect();
        m.forget_pods_except(&live);
        assert_eq!(m.pod_count(), 1);
        assert!(m.pods.contains_key("10.0.0.2:8000"));
    }
}
