//! Decides nothing: what the core's admission gate (`ai_lb_filter_core::lifecycle::admission`)
//! needs from the native module: the tenants' token buckets in process memory shared by every
//! worker (the core's [`MemoryStore`]: a mutex over a map, a version number as the CAS token,
//! so one sidecar's limit is exact across workers as with the wasm filter's shared data), and
//! Envoy stats under the wasm filter's names, defined when the config is created (the ABI
//! allows no later definition): `ailb.admission.<name>` plain, and the per-tenant counters as
//! `ailb.admission.tenant.<name>` with the labels `ailb_tenant` and `ailb_class` (the wasm
//! filter puts both in the name; docs/operations.md gives both forms).
//!
//! The request path only adds to a per-worker tally ([`AdmTally`]); the worker adds it to
//! Envoy's stats after each event, as it does the core's counters.

use std::collections::HashMap;

use ai_lb_filter_core::admission::priority::PriorityClass;
use ai_lb_filter_core::lifecycle::admission::{
    AdmissionStats, COUNTERS, GAUGES, HISTOGRAMS, TENANT_COUNTERS,
};
use ai_lb_filter_core::lifecycle::hold::{self, HoldStats};

use crate::host::{ConfigHandle, LabeledCounter2, Stream};

/// Label names of the per-tenant counters.
pub const TENANT_LABELS: [&str; 2] = ["ailb_tenant", "ailb_class"];

/// The admission stats' ids, defined with the config.
#[derive(Debug, Clone)]
pub struct AdmissionIds {
    counters: [usize; COUNTERS.len()],
    tenant: [LabeledCounter2; TENANT_COUNTERS.len()],
    histograms: [usize; HISTOGRAMS.len()],
    gauges: [usize; GAUGES.len()],
}

impl AdmissionIds {
    pub fn define(handle: &ConfigHandle) -> Self {
        Self {
            counters: COUNTERS.map(|n| handle.define_counter(&format!("ailb.admission.{n}"))),
            tenant: TENANT_COUNTERS.map(|n| {
                handle.define_labeled_counter2(&format!("ailb.admission.tenant.{n}"), TENANT_LABELS)
            }),
            histograms: HISTOGRAMS.map(|n| handle.define_histogram(&format!("ailb.admission.{n}"))),
            gauges: GAUGES.map(|n| handle.define_gauge(&format!("ailb.admission.{n}"))),
        }
    }
}

/// What a worker's admission counted and Envoy's stats do not have yet.
#[derive(Debug)]
pub struct AdmTally {
    counts: [u64; COUNTERS.len()],
    /// (tenant, class, index in TENANT_COUNTERS) -> count.
    tenant: HashMap<(String, PriorityClass, usize), u64>,
    recorded: Vec<(usize, u64)>,
    gauges: [Option<u64>; GAUGES.len()],
}

// By hand: `Default` is not derived for arrays longer than 32.
impl Default for AdmTally {
    fn default() -> Self {
        Self {
            counts: [0; COUNTERS.len()],
            tenant: HashMap::new(),
            recorded: Vec::new(),
            gauges: [None; GAUGES.len()],
        }
    }
}

fn index(names: &[&str], what: &str) -> Option<usize> {
    names.iter().position(|n| *n == what)
}

impl AdmissionStats for AdmTally {
    fn count(&mut self, what: &str, by: u64) {
        if let Some(c) = index(&COUNTERS, what).and_then(|i| self.counts.get_mut(i)) {
            *c = c.saturating_add(by);
        }
    }
    fn count_tenant(&mut self, tenant: &str, class: PriorityClass, what: &str, by: u64) {
        if by == 0 {
            return;
        }
        if let Some(i) = index(&TENANT_COUNTERS, what) {
            let c = self
                .tenant
                .entry((tenant.to_string(), class, i))
                .or_default();
            *c = c.saturating_add(by);
        }
    }
    fn record(&mut self, what: &str, value: u64) {
        if let Some(i) = index(&HISTOGRAMS, what) {
            self.recorded.push((i, value));
        }
    }
    fn set(&mut self, what: &str, value: u64) {
        if let Some(g) = index(&GAUGES, what).and_then(|i| self.gauges.get_mut(i)) {
            *g = Some(value);
        }
    }
}

impl AdmTally {
    /// Adds everything tallied to Envoy's stats, through the stream of the current hook.
    pub fn flush(&mut self, ids: &AdmissionIds, s: &Stream) {
        for (c, id) in self.counts.iter_mut().zip(ids.counters) {
            if *c > 0 {
                s.inc(id, std::mem::take(c));
            }
        }
        for ((tenant, class, i), n) in self.tenant.drain() {
            if let Some(id) = ids.tenant.get(i) {
                s.inc_labeled2(*id, [&tenant, class.as_str()], n);
            }
        }
        for (i, v) in self.recorded.drain(..) {
            if let Some(id) = ids.histograms.get(i) {
                s.record(*id, v);
            }
        }
        for (g, id) in self.gauges.iter_mut().zip(ids.gauges) {
            if let Some(v) = g.take() {
                s.set_gauge(id, v);
            }
        }
    }
}

/// The big-request hold's stats (`ailb.big_hold.*`, the wasm filter's names), defined with
/// the config when `bigRequestHold` is on.
#[derive(Debug, Clone)]
pub struct HoldIds {
    counters: [usize; hold::COUNTERS.len()],
    depth: usize,
    wait_ms: usize,
}

impl HoldIds {
    pub fn define(handle: &ConfigHandle) -> Self {
        Self {
            counters: hold::COUNTERS.map(|n| handle.define_counter(&format!("ailb.big_hold.{n}"))),
            depth: handle.define_gauge("ailb.big_hold.depth"),
            wait_ms: handle.define_histogram("ailb.big_hold.wait_ms"),
        }
    }
}

/// What a worker's big-request hold counted and Envoy's stats do not have yet.
#[derive(Debug, Default)]
pub struct HoldTally {
    counts: [u64; hold::COUNTERS.len()],
    depth: Option<u64>,
    waits: Vec<u64>,
}

impl HoldStats for HoldTally {
    fn count(&mut self, what: &str) {
        if let Some(c) = index(&hold::COUNTERS, what).and_then(|i| self.counts.get_mut(i)) {
            *c += 1;
        }
    }
    fn depth(&mut self, depth: u64) {
        self.depth = Some(depth);
    }
    fn waited(&mut self, ms: u64) {
        self.waits.push(ms);
    }
}

impl HoldTally {
    /// Adds everything tallied to Envoy's stats, through the stream of the current hook.
    pub fn flush(&mut self, ids: &HoldIds, s: &Stream) {
        for (c, id) in self.counts.iter_mut().zip(ids.counters) {
            if *c > 0 {
                s.inc(id, std::mem::take(c));
            }
        }
        if let Some(d) = self.depth.take() {
            s.set_gauge(ids.depth, d);
        }
        for ms in self.waits.drain(..) {
            s.record(ids.wait_ms, ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_keeps_only_the_names_the_config_defined() {
        let mut t = AdmTally::default();
        t.count("rate_limited", 2);
        t.count("no_such_stat", 5);
        t.count_tenant("a", PriorityClass::Standard, "admitted", 1);
        t.count_tenant("a", PriorityClass::Standard, "admitted", 1);
        t.count_tenant("a", PriorityClass::Standard, "nothing", 1);
        t.record("held_wait_ms", 7);
        t.set("held_depth", 3);
        let i = index(&COUNTERS, "rate_limited").unwrap();
        assert_eq!(t.counts[i], 2);
        assert_eq!(t.counts.iter().sum::<u64>(), 2);
        assert_eq!(t.tenant.len(), 1);
        assert_eq!(t.tenant.values().sum::<u64>(), 2);
        assert_eq!(t.recorded, vec![(1, 7)]);
        assert_eq!(t.gauges, [Some(3)]);
    }
}
