//! Model-version routing and per-version breaker domains (`versions`, issue 30 part 3).
//!
//! Pods carry a model version: their agent's `--model-version` (the `version` of each
//! `ModelInfo` in its snapshots; the first non-empty one is the pod's). Pods with none form the
//! unversioned group `""`. With `versions` configured:
//! - a request naming a version in the `versions.header` request header (`x-model-version` by
//!   default) goes only to pods of that version. A version no pod reports, or whose pods are
//!   all unavailable (cut, breakers open, stale), or whose domain is open, is answered locally
//!   with a 503 naming the version and the reason (header `x-ai-lb-version-rejected`): it is
//!   never routed to another version.
//! - a request without the header is sent to a version drawn by `versions.weights` (e.g.
//!   `{"v1": 95, "v2": 5}`), among the weighted versions that have an available pod and whose
//!   domain admits (weights renormalised over them), then by score within the version as
//!   usual. When none does (no pod reports a weighted version, every such domain is open), the
//!   request is routed over the whole pool as without `versions`, counted as
//!   `versions.unsplit`: never worse than today.
//! - each version has a breaker domain (`versions.domains.default`, overridden per version
//!   under its name) fed by the outcome of the requests this worker sent it: over the last
//!   `windowMs` (two half-window buckets, like the pod breaker's failure window), when the
//!   failures exceed `minFailures` and their share of the outcomes exceeds `failureRatio`, the
//!   domain opens for `openMs`; then it is half-open and admits up to `halfOpenRequests`
//!   requests (the first alone, the rest once it succeeded), closing when that many succeed
//!   and re-opening on a failure. The state machine is the pod breaker's ([`Breaker`], with a
//!   fixed cooldown and no consecutive-failure trip). An open domain takes its version out of
//!   the split; the other versions' shares, pods and pod breakers are untouched.
//!
//! Domains are kept per worker (each wasm VM, each native worker thread), like the per-model
//! breakers: each counts the outcomes it saw, so with several workers a failing version trips
//! in each once that worker's share of its failures passes the threshold.
//!
//! Without `versions`, none of this runs: the pool is routed exactly as before.

use std::collections::BTreeMap;

use rand::RngCore;
use serde::Deserialize;

use crate::breaker::{Breaker, BreakerState, Transition, TripReason};
use crate::config::BreakerConfig;
use crate::error::ConfigError;

/// The name of the unversioned group (pods whose agent reports no version).
pub const UNVERSIONED: &str = "";

/// Response header of a local reply to a request whose version cannot be served.
pub const REJECT_HEADER: &str = "x-ai-lb-version-rejected";

/// One version's breaker domain settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DomainConfig {
    /// Window the failures and outcomes are counted over, ms.
    pub window_ms: u64,
    /// The domain opens when the window's failures exceed this...
    pub min_failures: u32,
    /// ...and their share of the window's outcomes exceeds this (0 < r ≤ 1).
    pub failure_ratio: f64,
    /// How long the domain stays open, ms.
    pub open_ms: u64,
    /// Requests a half-open domain admits; that many successes close it.
    pub half_open_requests: u32,
}

impl Default for DomainConfig {
    fn default() -> Self {
        Self {
            window_ms: 10_000,
            min_failures: 20,
            failure_ratio: 0.3,
            open_ms: 30_000,
            half_open_requests: 100,
        }
    }
}

impl DomainConfig {
    /// The pod breaker's settings that make its state machine this domain's: a fixed cooldown
    /// of `open_ms`, `half_open_requests` probes, and no trip but [`Domains::record`]'s.
    pub fn breaker(&self) -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: u32::MAX,
            base_cooldown_ms: self.open_ms,
            max_cooldown_ms: self.open_ms,
            half_open_probes: self.half_open_requests,
            ttft_slo_ms: None,
            recovery_ramp: None,
            adaptive_thresholds: None,
            ..BreakerConfig::default()
        }
    }

    /// Whether `failures` out of `total` outcomes open the domain: strictly more than
    /// `min_failures` and a share strictly over `failure_ratio`.
    pub fn trips(&self, failures: u64, total: u64) -> bool {
        total > 0
            && failures > u64::from(self.min_failures)
            && failures as f64 > self.failure_ratio * total as f64
    }
}

/// The validated `versions` block.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionsConfig {
    /// Request header that pins a request to a version (lower case).
    pub header: String,
    /// Split weights by version name (> 0 each: zero weights are dropped), sorted by name.
    pub weights: Vec<(String, f64)>,
    /// Domain settings of every version not named in `domains`.
    pub default_domain: DomainConfig,
    /// Per-version domain settings, sorted by name.
    pub domains: Vec<(String, DomainConfig)>,
}

impl VersionsConfig {
    /// The domain settings of `version`.
    pub fn domain(&self, version: &str) -> &DomainConfig {
        self.domains
            .iter()
            .find(|(n, _)| n == version)
            .map_or(&self.default_domain, |(_, d)| d)
    }
}

/// Model-version routing and per-version breaker domains; present (an object, even `{}`) turns it on.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Versions")
)]
pub(crate) struct RawVersions {
    /// Request header naming the model version a request must go to. A version no available pod serves, or whose domain is open, is answered with a local 503 (header `x-ai-lb-version-rejected: <version>; <reason>`), never routed to another version.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = "x-model-version")))]
    header: Option<String>,
    /// Share of the requests without the header that each version gets (relative weights, e.g. `{"v1": 95, "v2": 5}`), renormalised over the versions with an available pod whose domain is closed or half-open. Versions (as the pods' agents report them with `--model-version`) not listed get only pinned requests. Names non-empty, weights finite and ≥ 0, at least one > 0 when any is given. Absent or empty: no split (requests without the header go to every pod, as without `versions`; pinning and the domains still apply).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    weights: BTreeMap<String, f64>,
    /// Breaker domain settings: `default` for every version, and per version under its name (unset fields from `default`).
    #[serde(default)]
    domains: BTreeMap<String, RawDomain>,
}

/// One version's breaker domain (`default`: every version's; a version's name: its own, unset fields from `default`).
#[derive(Debug, Deserialize, Default, Clone, Copy)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "VersionDomain")
)]
pub(crate) struct RawDomain {
    /// Window over which the version's failures and outcomes are counted, ms.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10000, "minimum" = 100, "maximum" = 3_600_000))
    )]
    window_ms: Option<u64>,
    /// The domain opens when its failures in the window exceed this and their share exceeds `failureRatio`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 20, "minimum" = 0, "maximum" = 1_000_000))
    )]
    min_failures: Option<u64>,
    /// Failure share of the window's outcomes that must be exceeded (with `minFailures`) to open the domain.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.3, "exclusiveMinimum" = 0.0, "maximum" = 1.0))
    )]
    failure_ratio: Option<f64>,
    /// How long an opened domain stays open, ms (then half-open).
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 30000, "minimum" = 1, "maximum" = 3_600_000))
    )]
    open_ms: Option<u64>,
    /// Requests a half-open domain admits (the first alone); that many successes close it, one failure re-opens it.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 100, "minimum" = 1, "maximum" = 1_000_000))
    )]
    half_open_requests: Option<u64>,
}

fn domain_from(
    raw: &RawDomain,
    base: &DomainConfig,
    path: &str,
) -> Result<DomainConfig, ConfigError> {
    let field = |f: &str| format!("{path}.{f}");
    let window_ms = match raw.window_ms {
        None => base.window_ms,
        Some(v) if (100..=3_600_000).contains(&v) => v,
        Some(v) => {
            return Err(ConfigError::new(
                field("windowMs"),
                v,
                "must be within 100..=3600000",
            ))
        }
    };
    let min_failures = match raw.min_failures {
        None => base.min_failures,
        Some(v) if v <= 1_000_000 => u32::try_from(v).unwrap_or(base.min_failures),
        Some(v) => {
            return Err(ConfigError::new(
                field("minFailures"),
                v,
                "must be within 0..=1000000",
            ))
        }
    };
    let failure_ratio = match raw.failure_ratio {
        None => base.failure_ratio,
        Some(v) if v.is_finite() && v > 0.0 && v <= 1.0 => v,
        Some(v) => {
            return Err(ConfigError::new(
                field("failureRatio"),
                v,
                "must be within (0, 1]",
            ))
        }
    };
    let open_ms = match raw.open_ms {
        None => base.open_ms,
        Some(v) if (1..=3_600_000).contains(&v) => v,
        Some(v) => {
            return Err(ConfigError::new(
                field("openMs"),
                v,
                "must be within 1..=3600000",
            ))
        }
    };
    let half_open_requests = match raw.half_open_requests {
        None => base.half_open_requests,
        Some(v) if (1..=1_000_000).contains(&v) => u32::try_from(v).unwrap_or(1),
        Some(v) => {
            return Err(ConfigError::new(
                field("halfOpenRequests"),
                v,
                "must be within 1..=1000000",
            ))
        }
    };
    Ok(DomainConfig {
        window_ms,
        min_failures,
        failure_ratio,
        open_ms,
        half_open_requests,
    })
}

impl TryFrom<&RawVersions> for VersionsConfig {
    type Error = ConfigError;

    fn try_from(raw: &RawVersions) -> Result<Self, ConfigError> {
        let header = raw
            .header
            .clone()
            .unwrap_or_else(|| "x-model-version".into());
        let valid_header = !header.is_empty()
            && header
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !valid_header {
            return Err(ConfigError::new(
                "versions.header",
                &header,
                "must be a non-empty lower-case header name (a-z, 0-9, '-', '_')",
            ));
        }
        let mut weights = Vec::new();
        let mut sum = 0.0;
        for (name, &w) in &raw.weights {
            if name.trim().is_empty() {
                return Err(ConfigError::new(
                    "versions.weights",
                    name,
                    "version names must be non-empty",
                ));
            }
            if !(w.is_finite() && w >= 0.0) {
                return Err(ConfigError::new(
                    format!("versions.weights.{name}"),
                    w,
                    "must be a finite number ≥ 0",
                ));
            }
            sum += w;
            if w > 0.0 {
                weights.push((name.clone(), w));
            }
        }
        if sum <= 0.0 && !raw.weights.is_empty() {
            return Err(ConfigError::new(
                "versions.weights",
                format!("{:?}", raw.weights),
                "must give at least one version a weight > 0",
            ));
        }
        let default_domain = match raw.domains.get("default") {
            Some(d) => domain_from(d, &DomainConfig::default(), "versions.domains.default")?,
            None => DomainConfig::default(),
        };
        let mut domains = Vec::new();
        for (name, d) in &raw.domains {
            if name == "default" {
                continue;
            }
            if name.trim().is_empty() {
                return Err(ConfigError::new(
                    "versions.domains",
                    name,
                    "version names must be non-empty",
                ));
            }
            let path = format!("versions.domains.{name}");
            domains.push((name.clone(), domain_from(d, &default_domain, &path)?));
        }
        Ok(VersionsConfig {
            header,
            weights,
            default_domain,
            domains,
        })
    }
}

/// Why a request for a version was answered locally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// No pod of the pool reports the version, or none of its pods is available.
    NoPod,
    /// The version's domain is open (or half-open with its requests spent).
    DomainOpen,
}

impl RejectReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            RejectReason::NoPod => "no_available_pod",
            RejectReason::DomainOpen => "domain_open",
        }
    }
}

/// The per-version counts (monotonic; the glues export their deltas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VersionCounts {
    /// Requests routed to the version (pinned or drawn).
    pub picks: u64,
    /// Of them, requests pinned by the header.
    pub pinned: u64,
    /// Pinned requests answered 503: no available pod of the version.
    pub rejected_no_pod: u64,
    /// Pinned requests answered 503: the version's domain is open.
    pub rejected_open: u64,
    /// Outcomes counted as failures in the domain.
    pub failures: u64,
    /// Domain transitions.
    pub opened: u64,
    pub half_opened: u64,
    pub closed: u64,
}

impl VersionCounts {
    /// How many counters [`VersionCounts::iter`] lists.
    pub const COUNT: usize = 8;

    /// `(stat name, value)` pairs.
    pub fn iter(&self) -> [(&'static str, u64); Self::COUNT] {
        [
            ("picks", self.picks),
            ("pinned", self.pinned),
            ("rejected_no_pod", self.rejected_no_pod),
            ("rejected_open", self.rejected_open),
            ("failures", self.failures),
            ("domain_opened", self.opened),
            ("domain_half_opened", self.half_opened),
            ("domain_closed", self.closed),
        ]
    }

    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &VersionCounts) {
        self.picks += o.picks;
        self.pinned += o.pinned;
        self.rejected_no_pod += o.rejected_no_pod;
        self.rejected_open += o.rejected_open;
        self.failures += o.failures;
        self.opened += o.opened;
        self.half_opened += o.half_opened;
        self.closed += o.closed;
    }

    fn count(&mut self, t: &Transition) {
        match t.to {
            BreakerState::Open => self.opened += 1,
            BreakerState::HalfOpen => self.half_opened += 1,
            BreakerState::Closed => self.closed += 1,
        }
    }
}

/// Failures and outcomes over a window, in two half-window buckets (the older dropped whole
/// when the window moves on): the counts cover between half a window and a whole one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Window {
    start_ms: u64,
    /// (outcomes, failures) of the current and the previous half-window.
    cur: (u64, u64),
    prev: (u64, u64),
}

impl Window {
    fn record(&mut self, failed: bool, now_ms: u64, window_ms: u64) -> (u64, u64) {
        let half = (window_ms / 2).max(1);
        let since = now_ms.saturating_sub(self.start_ms);
        if since >= 2 * half {
            *self = Window {
                start_ms: now_ms,
                ..Window::default()
            };
        } else if since >= half {
            self.prev = self.cur;
            self.cur = (0, 0);
            self.start_ms = self.start_ms.saturating_add(half);
        }
        self.cur.0 += 1;
        if failed {
            self.cur.1 += 1;
        }
        (self.cur.0 + self.prev.0, self.cur.1 + self.prev.1)
    }
}

/// One version's domain in one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Domain {
    pub name: String,
    pub breaker: Breaker,
    window: Window,
    pub counts: VersionCounts,
}

/// The domains of one pool's versions in one worker (created as versions are seen).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Domains {
    list: Vec<Domain>,
}

impl Domains {
    /// Every domain, in order of creation.
    pub fn iter(&self) -> impl Iterator<Item = &Domain> {
        self.list.iter()
    }

    pub fn get(&self, version: &str) -> Option<&Domain> {
        self.list.iter().find(|d| d.name == version)
    }

    /// The domain of `version`, created closed on first use.
    pub fn entry(&mut self, version: &str) -> Option<&mut Domain> {
        if !self.list.iter().any(|d| d.name == version) {
            self.list.push(Domain {
                name: version.to_string(),
                breaker: Breaker::default(),
                window: Window::default(),
                counts: VersionCounts::default(),
            });
        }
        self.list.iter_mut().find(|d| d.name == version)
    }

    /// Time-driven transitions (Open → HalfOpen) of every domain at `now_ms`; counted.
    pub fn poll(&mut self, now_ms: u64, cfg: &VersionsConfig) -> Vec<(String, Transition)> {
        let mut out = Vec::new();
        for d in self.list.iter_mut() {
            let bc = cfg.domain(&d.name).breaker();
            if let Some(t) = d.breaker.poll(now_ms, &bc) {
                d.counts.count(&t);
                out.push((d.name.clone(), t));
            }
        }
        out
    }

    /// Whether `version`'s domain admits a request now (poll first): closed, or half-open
    /// with requests left. A version with no domain yet is closed.
    pub fn admits(&self, version: &str, cfg: &VersionsConfig) -> bool {
        self.get(version)
            .is_none_or(|d| d.breaker.admits(&cfg.domain(version).breaker()))
    }

    /// The domain state of `version` (closed when it has none yet).
    pub fn state(&self, version: &str) -> BreakerState {
        self.get(version)
            .map_or(BreakerState::Closed, |d| d.breaker.state())
    }

    /// A request was routed to `version` (`pinned`: by the header): counted, and a half-open
    /// domain's request spent.
    pub fn on_pick(&mut self, version: &str, pinned: bool, now_ms: u64) {
        let Some(d) = self.entry(version) else {
            return;
        };
        d.counts.picks += 1;
        if pinned {
            d.counts.pinned += 1;
        }
        d.breaker.on_request(now_ms);
    }

    /// A pinned request for `version` was answered locally.
    pub fn on_reject(&mut self, version: &str, reason: RejectReason) {
        let Some(d) = self.entry(version) else {
            return;
        };
        match reason {
            RejectReason::NoPod => d.counts.rejected_no_pod += 1,
            RejectReason::DomainOpen => d.counts.rejected_open += 1,
        }
    }

    /// The outcome of a request routed to `version`: counted in its window; a closed domain
    /// opens when the window's failures exceed `minFailures` and their share `failureRatio`;
    /// a half-open one closes after `halfOpenRequests` successes and re-opens on a failure.
    pub fn record(
        &mut self,
        version: &str,
        failed: bool,
        now_ms: u64,
        cfg: &VersionsConfig,
    ) -> Option<Transition> {
        let dc = *cfg.domain(version);
        let bc = dc.breaker();
        let d = self.entry(version)?;
        if failed {
            d.counts.failures += 1;
        }
        let polled = d.breaker.poll(now_ms, &bc);
        if let Some(t) = &polled {
            d.counts.count(t);
        }
        let t = match d.breaker.state() {
            BreakerState::Closed => {
                let (total, fails) = d.window.record(failed, now_ms, dc.window_ms);
                if dc.trips(fails, total) {
                    d.window = Window {
                        start_ms: now_ms,
                        ..Window::default()
                    };
                    d.breaker.trip(TripReason::FailureRate, now_ms, &bc)
                } else {
                    None
                }
            }
            BreakerState::HalfOpen => {
                let failure = failed.then_some(TripReason::FailureRate);
                let t = d.breaker.record(failure, now_ms, &bc);
                if t.as_ref().is_some_and(|t| t.to == BreakerState::Closed) {
                    d.window = Window {
                        start_ms: now_ms,
                        ..Window::default()
                    };
                }
                t
            }
            // Late answers of requests sent before the open change nothing.
            BreakerState::Open => None,
        };
        if let Some(t) = &t {
            d.counts.count(t);
        }
        t.or(polled)
    }
}

/// Draws a version for a request without the header: in proportion to `weights` among the
/// versions whose index `eligible` holds for (weights renormalised over them). None when none
/// is.
pub fn draw_version<'a>(
    weights: &'a [(String, f64)],
    eligible: impl Fn(usize) -> bool,
    rng: &mut (impl RngCore + ?Sized),
) -> Option<&'a str> {
    let total: f64 = weights
        .iter()
        .enumerate()
        .filter(|(i, _)| eligible(*i))
        .map(|(_, (_, w))| *w)
        .sum();
    if total <= 0.0 {
        return None;
    }
    let mut u = ((rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)) * total;
    let mut last = None;
    for (_, (n, w)) in weights.iter().enumerate().filter(|(i, _)| eligible(*i)) {
        last = Some(n.as_str());
        if u < *w {
            return last;
        }
        u -= w;
    }
    last
}
