//! Admission counters for the glue to publish as Envoy stats: decides nothing, records what was
//! decided (per tenant and class, tokens reserved/charged/refunded, estimation error, held queue
//! depth and waits, guard outcomes). Tenants are capped so a flood of keys cannot grow it.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, BTreeSet};

use super::bucket::{Admission, RejectReason, Settlement};
use super::guard::{FailOpen, GuardDecision, GuardReason};
use super::priority::{Left, PriorityClass};

/// Distinct tenants tracked; later ones are counted under [`OTHER_TENANT`].
pub const MAX_TENANTS: usize = 256;
pub const OTHER_TENANT: &str = "_other";

/// A fixed-bucket histogram (`counts[i]` = values <= `bounds[i]`, last = overflow).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            count: 0,
            sum: 0.0,
        }
    }

    pub fn record(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.count += 1;
        self.sum += v;
    }
}

/// Signed estimation error in percent: (estimated - actual) / actual.
pub const ESTIMATE_ERROR_BOUNDS: &[f64] =
    &[-50.0, -25.0, -10.0, -5.0, 0.0, 5.0, 10.0, 25.0, 50.0, 100.0];
/// Held-queue waits in ms.
pub const WAIT_BOUNDS_MS: &[f64] = &[
    10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
];

/// Outcomes of one tenant in one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClassCounts {
    pub admitted: u64,
    /// 429 from the token bucket.
    pub rate_limited: u64,
    /// 429 because sheddable under saturation.
    pub shed: u64,
    /// 503 after waiting the maximum in the held queue, or because it was full.
    pub held_rejected: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// Tenants with their own counters (at most [`MAX_TENANTS`]).
    pub tenants: BTreeSet<String>,
    pub per_tenant: BTreeMap<(String, PriorityClass), ClassCounts>,
    pub tokens_reserved: u64,
    pub tokens_charged: u64,
    pub tokens_refunded: u64,
    /// Requests that ended without usage and kept their whole reservation.
    pub reservations_kept: u64,
    pub rejected_cost_exceeds_burst: u64,
    /// Admissions let through uncharged because the shared store stayed contended.
    pub store_contended: u64,
    pub cas_retries: u64,
    pub malformed_bodies: u64,
    pub uncosted: u64,
    pub costed_by_length: u64,
    pub invalid_priority_header: u64,
    pub estimate_error_pct: Histogram,
    pub held_depth: u64,
    pub held_depth_max: u64,
    pub held_released: u64,
    pub held_expired: u64,
    pub held_wait_ms: Histogram,
    pub guard_rejected_queue_full: u64,
    pub guard_rejected_gpu: u64,
    pub guard_fail_open_missing: u64,
    pub guard_fail_open_stale: u64,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            tenants: BTreeSet::new(),
            per_tenant: BTreeMap::new(),
            tokens_reserved: 0,
            tokens_charged: 0,
            tokens_refunded: 0,
            reservations_kept: 0,
            rejected_cost_exceeds_burst: 0,
            store_contended: 0,
            cas_retries: 0,
            malformed_bodies: 0,
            uncosted: 0,
            costed_by_length: 0,
            invalid_priority_header: 0,
            estimate_error_pct: Histogram::new(ESTIMATE_ERROR_BOUNDS),
            held_depth: 0,
            held_depth_max: 0,
            held_released: 0,
            held_expired: 0,
            held_wait_ms: Histogram::new(WAIT_BOUNDS_MS),
            guard_rejected_queue_full: 0,
            guard_rejected_gpu: 0,
            guard_fail_open_missing: 0,
            guard_fail_open_stale: 0,
        }
    }
}

impl Stats {
    pub fn new() -> Self {
        Self::default()
    }

    /// The counters of `tenant` in `class` (or of [`OTHER_TENANT`] once the cap is reached).
    pub fn class_counts(&mut self, tenant: &str, class: PriorityClass) -> &mut ClassCounts {
        let tracked = self.tenants.contains(tenant) || self.tenants.len() < MAX_TENANTS;
        let name = if tracked { tenant } else { OTHER_TENANT };
        if tracked && !self.tenants.contains(name) {
            self.tenants.insert(name.to_string());
        }
        self.per_tenant
            .entry((name.to_string(), class))
            .or_default()
    }

    pub fn record_admission(&mut self, tenant: &str, class: PriorityClass, a: &Admission) {
        match a {
            Admission::Admitted { grant, cas_retries } => {
                self.class_counts(tenant, class).admitted += 1;
                self.tokens_reserved += grant.reserved;
                self.cas_retries += u64::from(*cas_retries);
            }
            Admission::Rejected {
                limited,
                cas_retries,
            } => {
                self.class_counts(tenant, class).rate_limited += 1;
                if limited.reason == RejectReason::CostExceedsBurst {
                    self.rejected_cost_exceeds_burst += 1;
                }
                self.cas_retries += u64::from(*cas_retries);
            }
            Admission::Contended => {
                self.class_counts(tenant, class).admitted += 1;
                self.store_contended += 1;
            }
        }
    }

    pub fn record_settlement(&mut self, s: &Settlement) {
        self.tokens_charged += s.charged;
        self.tokens_refunded += s.refunded;
        self.cas_retries += u64::from(s.cas_retries);
    }

    pub fn record_kept_reservation(&mut self) {
        self.reservations_kept += 1;
    }

    /// Estimated vs actual prompt tokens of one request (skipped when actual is 0).
    pub fn record_estimate(&mut self, estimated: u64, actual: u64) {
        if actual > 0 {
            self.estimate_error_pct
                .record((estimated as f64 - actual as f64) / actual as f64 * 100.0);
        }
    }

    pub fn set_held_depth(&mut self, depth: usize) {
        self.held_depth = depth as u64;
        self.held_depth_max = self.held_depth_max.max(self.held_depth);
    }

    pub fn record_released(&mut self, l: &Left) {
        self.held_released += 1;
        self.held_wait_ms.record(l.waited_ms as f64);
    }

    pub fn record_expired(&mut self, tenant: &str, l: &Left) {
        self.held_expired += 1;
        self.held_wait_ms.record(l.waited_ms as f64);
        self.class_counts(tenant, l.class).held_rejected += 1;
    }

    pub fn record_guard(&mut self, d: &GuardDecision) {
        match d {
            GuardDecision::Admit {
                fail_open: Some(FailOpen::Missing),
            } => self.guard_fail_open_missing += 1,
            GuardDecision::Admit {
                fail_open: Some(FailOpen::Stale),
            } => self.guard_fail_open_stale += 1,
            GuardDecision::Admit { fail_open: None } => {}
            GuardDecision::Reject {
                reason: GuardReason::QueueFull,
                ..
            } => self.guard_rejected_queue_full += 1,
            GuardDecision::Reject {
                reason: GuardReason::GpuSaturated,
                ..
            } => self.guard_rejected_gpu += 1,
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::new(ESTIMATE_ERROR_BOUNDS);
        for v in [-60.0, -50.0, 0.0, 3.0, 1000.0, f64::NAN] {
            h.record(v);
        }
        assert_eq!(h.count, 5);
        assert_eq!(h.counts[0], 2);
        assert_eq!(h.counts[4], 1);
        assert_eq!(h.counts[5], 1);
        assert_eq!(h.counts[10], 1);
    }

    #[test]
    fn tenant_cardinality_is_capped() {
        let mut s = Stats::new();
        for i in 0..(MAX_TENANTS + 10) {
            s.class_counts(&format!("t{i}"), PriorityClass::Standard)
                .admitted += 1;
        }
        for c in PriorityClass::ALL {
            s.class_counts("late", c).admitted += 1;
        }
        assert_eq!(s.tenants.len(), MAX_TENANTS);
        assert_eq!(
            s.per_tenant
                .get(&(OTHER_TENANT.to_string(), PriorityClass::Standard))
                .map(|c| c.admitted),
            Some(11),
            "10 late tenants + \"late\""
        );
        assert_eq!(
            s.per_tenant
                .get(&(OTHER_TENANT.to_string(), PriorityClass::Critical))
                .map(|c| c.admitted),
            Some(1)
        );
        s.record_estimate(90, 100);
        assert_eq!(s.estimate_error_pct.counts[2], 1);
    }

    #[test]
    fn held_queue_and_settlement_counters() {
        use crate::admission::bucket::{try_admit, MemoryStore};
        use crate::admission::config::BucketParams;
        use crate::admission::priority::HeldQueue;
        let mut s = Stats::new();
        let mut q = HeldQueue::new(4);
        q.push(1, PriorityClass::Standard, 0, 100).unwrap();
        q.push(2, PriorityClass::Standard, 10, 110).unwrap();
        s.set_held_depth(q.depth());
        for l in q.release(1, 40) {
            s.record_released(&l);
        }
        for l in q.expire(200) {
            s.record_expired("t", &l);
        }
        s.set_held_depth(q.depth());
        assert_eq!(
            (
                s.held_depth,
                s.held_depth_max,
                s.held_released,
                s.held_expired
            ),
            (0, 2, 1, 1)
        );
        assert_eq!(s.held_wait_ms.count, 2);
        assert_eq!(s.held_wait_ms.sum, 40.0 + 190.0);
        assert_eq!(
            s.per_tenant[&("t".to_string(), PriorityClass::Standard)].held_rejected,
            1
        );

        let store = MemoryStore::new();
        let p = BucketParams {
            tokens_per_second: 1,
            burst: 10,
        };
        s.record_admission(
            "t",
            PriorityClass::Critical,
            &try_admit(&store, "t", &p, 8, 0),
        );
        s.record_admission(
            "t",
            PriorityClass::Critical,
            &try_admit(&store, "t", &p, 8, 0),
        );
        s.record_admission(
            "t",
            PriorityClass::Critical,
            &try_admit(&store, "t", &p, 11, 0),
        );
        let c = s.per_tenant[&("t".to_string(), PriorityClass::Critical)];
        assert_eq!(
            (
                c.admitted,
                c.rate_limited,
                s.tokens_reserved,
                s.rejected_cost_exceeds_burst
            ),
            (1, 2, 8, 1)
        );
        s.record_settlement(&crate::admission::bucket::Settlement {
            charged: 3,
            refunded: 0,
            cas_retries: 1,
        });
        s.record_kept_reservation();
        assert_eq!(
            (s.tokens_charged, s.cas_retries, s.reservations_kept),
            (3, 1, 1)
        );
    }
}
