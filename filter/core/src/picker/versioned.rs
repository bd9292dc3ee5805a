//! Which model version a request goes to (`versions`, see [`crate::versions`]): the version the
//! request pins, else one drawn by the configured weights among the versions with an available
//! pod whose breaker domain admits; and what each version's domain learns from the outcomes.

use std::sync::Arc;

use rand::RngCore;

use super::view::Verdict;
use super::Router;
use crate::breaker::{BreakerState, Transition};
use crate::versions::{draw_version, RejectReason, VersionCounts};

/// Longest version name a request may pin (longer: no pod reports it).
const MAX_VERSION_LEN: usize = 128;

/// Where [`Router::route_version`] sends a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionRoute {
    /// `versions` is off: every pod competes.
    Off,
    /// No weighted version is available: every pod competes (counted `versions.unsplit`).
    Unsplit,
    /// Only pods of `version` compete (`pinned`: the request named it).
    Version { version: String, pinned: bool },
    /// The pinned version cannot be served: answer locally.
    Rejected {
        version: String,
        reason: RejectReason,
    },
}

/// One version's row for the status page and the stats.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionRow {
    pub version: String,
    /// Its configured split weight (0: pinned requests only).
    pub weight: f64,
    pub state: BreakerState,
    /// Pods of the pool reporting it.
    pub pods: usize,
    pub counts: VersionCounts,
}

impl Router {
    /// Whether some pod of pool `pool_idx` reports `version`.
    fn reported(&self, pool_idx: usize, version: &str) -> bool {
        self.pools.get(pool_idx).is_some_and(|p| {
            p.state
                .peers()
                .iter()
                .filter_map(|e| e.signals.as_ref())
                .any(|s| s.version() == version)
        })
    }

    /// Whether the pods of `version` (None: the pool's) serving `model` can take a request:
    /// their view picks and some pod has weight.
    fn available(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        version: Option<&str>,
        now_ms: u64,
    ) -> bool {
        let Some(vi) = self.fresh_view(pool_idx, model, version, now_ms) else {
            return false;
        };
        self.pools
            .get(pool_idx)
            .and_then(|p| p.views.get(vi))
            .is_some_and(|v| v.verdict == Verdict::Pick && v.total() > 1e-12)
    }

    /// A request pinned to `version` that the filter could not steer (the pool fell back to
    /// Envoy's balancing, or the proxy refused the steer): it is answered 503, counted as
    /// refused for want of an available pod of its version.
    pub fn on_pinned_unsteered(&mut self, pool_idx: usize, version: &str) {
        if let Some(p) = self.pools.get_mut(pool_idx) {
            p.domains.on_reject(version, RejectReason::NoPod);
        }
    }

    /// Decides the model version of a request to pool `pool_idx` for `model` that pinned
    /// `pinned` (the `versions.header` value, None when absent or empty), at `now_ms`. Counts
    /// a pick in the version's domain (and spends a half-open domain's request) when it
    /// returns [`VersionRoute::Version`]; call [`Router::decide_in`] with that version next.
    pub fn route_version(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        pinned: Option<&str>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> VersionRoute {
        let Some(vc) = self.cfg.versions.as_ref().map(Arc::clone) else {
            return VersionRoute::Off;
        };
        if let Some(p) = self.pools.get_mut(pool_idx) {
            p.domains.poll(now_ms, &vc);
        }
        if let Some(v) = pinned {
            let known = v.len() <= MAX_VERSION_LEN
                && (self.reported(pool_idx, v) || vc.weights.iter().any(|(n, _)| n == v));
            let reason = if !known || !self.available(pool_idx, model, Some(v), now_ms) {
                Some(RejectReason::NoPod)
            } else if !self
                .pools
                .get(pool_idx)
                .is_some_and(|p| p.domains.admits(v, &vc))
            {
                Some(RejectReason::DomainOpen)
            } else {
                None
            };
            if let Some(reason) = reason {
                // Only versions a pod reports or the config names get a domain: a client's
                // header cannot make the filter keep state for names it invents.
                match self.pools.get_mut(pool_idx).filter(|_| known) {
                    Some(p) => p.domains.on_reject(v, reason),
                    None => self.counters.versions_rejected_unknown += 1,
                }
                return VersionRoute::Rejected {
                    version: v.to_string(),
                    reason,
                };
            }
            if let Some(p) = self.pools.get_mut(pool_idx) {
                p.domains.on_pick(v, true, now_ms);
            }
            return VersionRoute::Version {
                version: v.to_string(),
                pinned: true,
            };
        }
        // The split: weighted versions with an available pod whose domain admits.
        // Which weighted versions may take it, by index (no allocation up to 16 versions).
        let mut eligible = [false; 16];
        let mut eligible_more = Vec::new();
        for (i, (name, _)) in vc.weights.iter().enumerate() {
            let ok = self.available(pool_idx, model, Some(name), now_ms)
                && self
                    .pools
                    .get(pool_idx)
                    .is_some_and(|p| p.domains.admits(name, &vc));
            match eligible.get_mut(i) {
                Some(e) => *e = ok,
                None => eligible_more.push(ok),
            }
        }
        let is_eligible = |i: usize| match eligible.get(i) {
            Some(e) => *e,
            None => eligible_more
                .get(i.saturating_sub(eligible.len()))
                .copied()
                .unwrap_or(false),
        };
        match draw_version(&vc.weights, is_eligible, rng) {
            Some(v) => {
                if let Some(p) = self.pools.get_mut(pool_idx) {
                    p.domains.on_pick(v, false, now_ms);
                }
                VersionRoute::Version {
                    version: v.to_string(),
                    pinned: false,
                }
            }
            None => {
                self.counters.versions_unsplit += 1;
                VersionRoute::Unsplit
            }
        }
    }

    /// The outcome of a request routed to `version` in pool `pool_idx` (`failed` as the pod
    /// breaker judged the chosen pod's answer): the transition of its domain, if any.
    pub fn on_version_outcome(
        &mut self,
        pool_idx: usize,
        version: &str,
        failed: bool,
        now_ms: u64,
    ) -> Option<Transition> {
        let vc = self.cfg.versions.as_ref().map(Arc::clone)?;
        self.pools
            .get_mut(pool_idx)?
            .domains
            .record(version, failed, now_ms, &vc)
    }

    /// The versions of pool `pool_idx`: the configured ones, then those its pods report, each
    /// with its domain's state and counts as this worker sees them. Empty when `versions` is
    /// off.
    pub fn version_rows(&self, pool_idx: usize) -> Vec<VersionRow> {
        let (Some(vc), Some(p)) = (self.cfg.versions.as_ref(), self.pools.get(pool_idx)) else {
            return Vec::new();
        };
        let mut names: Vec<&str> = vc.weights.iter().map(|(n, _)| n.as_str()).collect();
        let reported = p.state.peers().iter().filter_map(|e| e.signals.as_ref());
        for s in reported {
            if !names.contains(&s.version()) {
                names.push(s.version());
            }
        }
        for d in p.domains.iter() {
            if !names.contains(&d.name.as_str()) {
                names.push(d.name.as_str());
            }
        }
        names
            .into_iter()
            .map(|n| VersionRow {
                version: n.to_string(),
                weight: vc
                    .weights
                    .iter()
                    .find(|(w, _)| w == n)
                    .map_or(0.0, |(_, w)| *w),
                state: p.domains.state(n),
                pods: p
                    .state
                    .peers()
                    .iter()
                    .filter_map(|e| e.signals.as_ref())
                    .filter(|s| s.version() == n)
                    .count(),
                counts: p.domains.get(n).map(|d| d.counts).unwrap_or_default(),
            })
            .collect()
    }
}

impl Router {
    /// Every pool's versions summed by name (the stats label them by version alone): their
    /// counts, and the most open domain state among the pools. Empty when `versions` is off.
    pub fn version_totals(&self) -> Vec<(String, VersionCounts, BreakerState)> {
        let mut out: Vec<(String, VersionCounts, BreakerState)> = Vec::new();
        for p in &self.pools {
            for d in p.domains.iter() {
                let c = d.counts;
                let s = d.breaker.state();
                match out.iter_mut().find(|(n, _, _)| *n == d.name) {
                    Some((_, t, st)) => {
                        t.add(&c);
                        if s.gauge_value() > st.gauge_value() {
                            *st = s;
                        }
                    }
                    None => out.push((d.name.clone(), c, s)),
                }
            }
        }
        out
    }
}

/// A version name as a stat name segment: characters other than ASCII letters, digits, `-`
/// and `_` become `_` (a `.` would split the name where the `stats_tags` regex expects one
/// segment); the unversioned group is `_none`.
pub fn version_stat_segment(version: &str) -> String {
    if version.is_empty() {
        return "_none".into();
    }
    version
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}
