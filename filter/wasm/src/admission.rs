//! Decides nothing: the glue between one HTTP request and the core's admission control
//! (`ai_lb_filter_core::admission`). It resolves the tenant and class from request headers and
//! properties, costs the request (buffered JSON body or length), takes the cost from the
//! tenant's token bucket in proxy-wasm shared data (CAS, exact across worker VMs), answers 429 /
//! 400 locally, scans the response for `usage` and settles the reservation in `on_log`.
//! Everything is counted as Envoy stats under `ailb.admission.`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::rc::Rc;

use proxy_wasm::types::{LogLevel, Status};
use serde_json::Value;

use ai_lb_filter_core::admission::bucket::{self, CasMismatch, Grant, SharedStore};
use ai_lb_filter_core::admission::config::BucketParams;
use ai_lb_filter_core::admission::cost::{self, BodyPlan, CostBasis, Endpoint, RequestCost};
use ai_lb_filter_core::admission::priority::{
    self, ClassSource, HeldQueue, PodLoad, PriorityClass,
};
use ai_lb_filter_core::admission::stats::{MAX_TENANTS, OTHER_TENANT};
use ai_lb_filter_core::admission::{tenant, AdmissionConfig, UsageScanner};
use ai_lb_filter_core::breaker::BreakerState;
use ai_lb_filter_core::error::ConfigError;
use ai_lb_filter_core::picker::{RequestSize, Router};
use ai_lb_filter_core::score::CutReason;

use crate::host;
use crate::metrics::Metrics;

/// Prefix of every admission stat.
const PREFIX: &str = "ailb.admission";

/// proxy-wasm shared data as the core's [`SharedStore`]. Any host error other than a CAS
/// mismatch is also reported as a mismatch: the core's retry loop is bounded and then fails
/// open (counted).
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match host::shared_get(key) {
            (Some(v), Some(cas)) => Some((v, cas)),
            (Some(v), None) => Some((v, 0)),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        match host::shared_set(key, value, cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) | Err(_) => Err(CasMismatch),
        }
    }
}

/// Reads the `admission` section of the plugin config whichever shape `FilterConfig` gives it
/// (the raw JSON value, or the already validated config).
pub trait AdmissionSection {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError>;
}

impl AdmissionSection for Option<Value> {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError> {
        match self {
            None => Ok(None),
            Some(v) => AdmissionConfig::from_value(v).map(|c| c.enabled.then_some(c)),
        }
    }
}

impl AdmissionSection for Option<AdmissionConfig> {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError> {
        Ok(self.clone().filter(|c| c.enabled))
    }
}

/// A standard request paused while its pool is saturated.
#[derive(Debug, Clone)]
pub struct HeldReq {
    pub pool: usize,
    pub model: Option<String>,
    pub stat_tenant: String,
    /// The request's in-flight size (see `Router::request_size`).
    pub size: RequestSize,
}

/// Admission state of one VM: the config, the tenants that have their own stats, and the
/// worker's held queue (requests paused in this VM can only be resumed from this VM).
#[derive(Debug)]
pub struct AdmissionRt {
    pub cfg: Rc<AdmissionConfig>,
    tenants: BTreeSet<String>,
    pub held: HeldQueue,
    pub held_reqs: HashMap<u32, HeldReq>,
    /// Released requests and the ranked list the root wrote for them.
    pub resumed: HashMap<u32, ai_lb_filter_core::lifecycle::Steered>,
    /// Held requests answered 503 by the root: their reservation is refunded.
    pub expired: HashSet<u32>,
}

impl AdmissionRt {
    pub fn new(cfg: AdmissionConfig) -> Self {
        let held = HeldQueue::new(cfg.saturation.max_held);
        Self {
            cfg: Rc::new(cfg),
            tenants: BTreeSet::new(),
            held,
            held_reqs: HashMap::new(),
            resumed: HashMap::new(),
            expired: HashSet::new(),
        }
    }

    /// The tenant's name in stats (at most [`MAX_TENANTS`] per VM, later ones `_other`).
    pub fn stat_tenant(&mut self, tenant: &str) -> String {
        if self.tenants.contains(tenant) {
            return tenant.to_string();
        }
        if self.tenants.len() < MAX_TENANTS {
            self.tenants.insert(tenant.to_string());
            return tenant.to_string();
        }
        OTHER_TENANT.to_string()
    }
}

/// Request headers the admission glue reads, fetched once in the request-headers phase.
#[derive(Debug, Default)]
pub struct Headers {
    pairs: Vec<(String, String)>,
}

impl Headers {
    /// Fetches each named header that is present.
    pub fn fetch<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut pairs = Vec::new();
        for n in names {
            if pairs.iter().any(|(k, _): &(String, String)| k == n) {
                continue;
            }
            if let Some(v) = host::request_header(n) {
                pairs.push((n.to_string(), v));
            }
        }
        Self { pairs }
    }

    pub fn from_pairs(pairs: Vec<(String, String)>) -> Self {
        Self { pairs }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The header names the admission glue needs for `cfg`.
pub fn header_names(cfg: &AdmissionConfig) -> Vec<&str> {
    let mut names = vec![
        ":path",
        "content-type",
        "content-length",
        "authorization",
        "x-api-key",
    ];
    // An untrusted priority header was removed by the lifecycle and is not read.
    names.extend(cfg.priority_header());
    for s in &cfg.tenant_key {
        if let ai_lb_filter_core::admission::config::TenantKeySource::Header(h) = s {
            names.push(h.as_str());
        }
    }
    names
}

/// The admission side of one request.
#[derive(Debug)]
pub struct AdmReq {
    pub cfg: Rc<AdmissionConfig>,
    pub tenant: String,
    pub stat_tenant: String,
    pub class: PriorityClass,
    pub endpoint: Endpoint,
    pub params: BucketParams,
    /// Estimated prompt units (text tokens + image patches + audio frames).
    pub estimated_prompt: u64,
    pub grant: Option<Grant>,
    pub scanner: Option<UsageScanner>,
    pub settled: bool,
    /// Answered locally after admission (shed, held too long): refund the whole reservation.
    pub refund_all: bool,
    /// The stream-done `hits_addend` was published.
    pub stream_done_published: bool,
}

/// What the glue does after the admission step.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Go on (route and continue).
    Proceed,
    /// A local reply was sent; pause the request.
    Replied,
}

/// Starts admission for a request: tenant, class and the body plan.
pub fn begin(
    rt: &mut AdmissionRt,
    h: &Headers,
    peer_principal: Option<&str>,
    metrics: &mut Metrics,
) -> (AdmReq, BodyPlan) {
    let cfg = rt.cfg.clone();
    let path = h.get(":path").unwrap_or("/");
    let tenant = tenant::resolve(&cfg.tenant_key, |n| h.get(n), peer_principal);
    let claimed = cfg.priority_header().and_then(|n| h.get(n));
    let (class, source) = priority::classify(&cfg.priority, path, claimed);
    if source == ClassSource::InvalidHeader {
        metrics.inc(&format!("{PREFIX}.invalid_priority_header"), 1);
    }
    let plan = cost::plan_body(
        &cfg.cost,
        h.get("content-type"),
        h.get("content-length").and_then(|v| v.trim().parse().ok()),
    );
    let stat_tenant = rt.stat_tenant(&tenant);
    let params = cfg.tenants.params_for(&tenant);
    (
        AdmReq {
            endpoint: Endpoint::from_path(path),
            cfg,
            tenant,
            stat_tenant,
            class,
            params,
            estimated_prompt: 0,
            grant: None,
            scanner: None,
            settled: false,
            refund_all: false,
            stream_done_published: false,
        },
        plan,
    )
}

impl AdmReq {
    pub fn count(&self, metrics: &mut Metrics, what: &str, by: u64) {
        count_class(metrics, &self.stat_tenant, self.class, what, by);
    }

    /// Costs a fully buffered body and admits it. `Replied` after a 400 or a 429.
    pub fn admit_body(&mut self, body: &[u8], now_ms: u64, metrics: &mut Metrics) -> Step {
        match cost::cost_from_body(&self.cfg.cost, self.endpoint, body) {
            Ok(c) => self.admit(c, now_ms, metrics),
            Err(e) => {
                metrics.inc(&format!("{PREFIX}.malformed_bodies"), 1);
                self.count(metrics, "malformed", 1);
                reply(
                    400,
                    &[("content-type", "application/json".to_string())],
                    &e.error_body(),
                );
                Step::Replied
            }
        }
    }

    /// Costs a body from its length and admits it.
    pub fn admit_length(&mut self, bytes: u64, now_ms: u64, metrics: &mut Metrics) -> Step {
        let c = cost::cost_from_length(&self.cfg.cost, self.endpoint, bytes);
        self.admit(c, now_ms, metrics)
    }

    /// Takes `c` from the tenant's bucket, or answers 429.
    pub fn admit(&mut self, c: RequestCost, now_ms: u64, metrics: &mut Metrics) -> Step {
        match c.basis {
            CostBasis::Parsed => {}
            CostBasis::ContentLength => metrics.inc(&format!("{PREFIX}.costed_by_length"), 1),
            CostBasis::Uncosted => {
                metrics.inc(&format!("{PREFIX}.uncosted"), 1);
                self.count(metrics, "admitted", 1);
                return Step::Proceed;
            }
        }
        self.estimated_prompt = c
            .text_tokens
            .saturating_add(c.image_patches)
            .saturating_add(c.audio_frames);
        if c.weighted == 0 {
            self.count(metrics, "admitted", 1);
            return Step::Proceed;
        }
        match bucket::try_admit(&HostStore, &self.tenant, &self.params, c.weighted, now_ms) {
            bucket::Admission::Admitted { grant, cas_retries } => {
                metrics.inc(&format!("{PREFIX}.cas_retries"), u64::from(cas_retries));
                metrics.inc(&format!("{PREFIX}.tokens_reserved"), grant.reserved);
                self.count(metrics, "admitted", 1);
                self.count(metrics, "tokens_reserved", grant.reserved);
                // Global limits: Envoy's rate limit filter (after this one) sends the cost as
                // `hits_addend` for request-time descriptors.
                publish_hits(metrics, grant.reserved);
                self.grant = Some(grant);
                Step::Proceed
            }
            bucket::Admission::Rejected {
                limited,
                cas_retries,
            } => {
                metrics.inc(&format!("{PREFIX}.cas_retries"), u64::from(cas_retries));
                metrics.inc(&format!("{PREFIX}.rate_limited"), 1);
                if limited.reason == bucket::RejectReason::CostExceedsBurst {
                    metrics.inc(&format!("{PREFIX}.rejected_cost_exceeds_burst"), 1);
                }
                self.count(metrics, "rate_limited", 1);
                let mut headers: Vec<(&str, String)> =
                    vec![("content-type", "application/json".to_string())];
                headers.extend(limited.headers());
                reply(bucket::RateLimited::STATUS, &headers, &limited.error_body());
                Step::Replied
            }
            bucket::Admission::Contended => {
                metrics.inc(&format!("{PREFIX}.store_contended"), 1);
                self.count(metrics, "admitted", 1);
                Step::Proceed
            }
        }
    }

    /// Response headers: the `x-ratelimit-*` of the grant, and start scanning for usage.
    pub fn on_response_headers(&mut self) {
        if let Some(g) = &self.grant {
            for (k, v) in g.headers() {
                let _ = host::set_response_header(k, &v);
            }
            self.scanner = Some(UsageScanner::new());
        }
    }

    pub fn on_response_body(&mut self, chunk: &[u8]) {
        if let Some(s) = self.scanner.as_mut() {
            s.feed(chunk);
        }
    }

    /// The response ended: tells `apply_on_stream_done` rate limit descriptors the usage beyond
    /// the reservation (`hits_addend` cannot be negative, so a refund is 0), once. Without
    /// usage the reservation stands and 0 is published too, so the request-time value is not
    /// counted twice.
    pub fn on_response_end(&mut self, metrics: &mut Metrics) {
        if self.stream_done_published || self.refund_all {
            return;
        }
        let Some(g) = &self.grant else {
            return;
        };
        self.stream_done_published = true;
        let actual = self
            .scanner
            .as_ref()
            .and_then(UsageScanner::usage)
            .map(|u| u.weighted(&self.cfg.cost.weights));
        let extra = actual.map_or(0, |a| a.saturating_sub(g.reserved));
        publish_hits(metrics, extra);
    }

    /// Settles the reservation with the response's usage (once); no usage keeps it.
    pub fn settle(&mut self, now_ms: u64, metrics: &mut Metrics) {
        if self.settled {
            return;
        }
        self.settled = true;
        let Some(grant) = self.grant.take() else {
            return;
        };
        let usage = if self.refund_all {
            Some(Default::default())
        } else {
            self.scanner.as_ref().and_then(UsageScanner::usage)
        };
        let Some(usage) = usage else {
            metrics.inc(&format!("{PREFIX}.reservations_kept"), 1);
            self.count(metrics, "reservations_kept", 1);
            return;
        };
        let actual = usage.weighted(&self.cfg.cost.weights);
        if !self.refund_all {
            record_estimate(metrics, self.estimated_prompt, usage.prompt_tokens);
        }
        match bucket::reconcile(
            &HostStore,
            &grant.tenant,
            &self.params,
            grant.reserved,
            actual,
            now_ms,
        ) {
            Ok(s) => {
                metrics.inc(&format!("{PREFIX}.cas_retries"), u64::from(s.cas_retries));
                metrics.inc(&format!("{PREFIX}.tokens_charged"), s.charged);
                metrics.inc(&format!("{PREFIX}.tokens_refunded"), s.refunded);
                metrics.inc(&format!("{PREFIX}.tokens_actual"), actual);
                metrics.inc(&format!("{PREFIX}.settled"), 1);
                self.count(metrics, "tokens_charged", s.charged);
                self.count(metrics, "tokens_refunded", s.refunded);
            }
            Err(_) => {
                metrics.inc(&format!("{PREFIX}.settle_contended"), 1);
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "ai-lb: admission: tenant `{}`: shared bucket stayed contended; \
                         reservation of {} kept instead of {actual}",
                        grant.tenant, grant.reserved
                    ),
                );
            }
        }
    }
}

/// Sets `envoy.ratelimit.hits_addend`; failures are counted (no rate limit filter is fine).
fn publish_hits(metrics: &mut Metrics, n: u64) {
    if host::set_hits_addend(n).is_err() {
        metrics.inc(&format!("{PREFIX}.hits_addend_errors"), 1);
    }
}

/// Counts `what` for a tenant in a class: `ailb.admission.tenant.<tenant>.<class>.<what>`.
pub fn count_class(
    metrics: &mut Metrics,
    stat_tenant: &str,
    class: PriorityClass,
    what: &str,
    by: u64,
) {
    metrics.inc(
        &format!("{PREFIX}.tenant.{stat_tenant}.{}.{what}", class.as_str()),
        by,
    );
}

/// Counts a global admission stat `ailb.admission.<what>`.
pub fn count(metrics: &mut Metrics, what: &str, by: u64) {
    metrics.inc(&format!("{PREFIX}.{what}"), by);
}

/// Records a global admission histogram value `ailb.admission.<what>`.
pub fn record(metrics: &mut Metrics, what: &str, value: u64) {
    metrics.record(&format!("{PREFIX}.{what}"), value);
}

/// The pool's pods as the saturation test sees them: pods without trustworthy metrics are left
/// out (they say nothing about load), a cut pod counts as fully loaded, load = 1 - score.
pub fn pod_loads(router: &Router, pool: usize, now_ms: u64) -> Vec<PodLoad> {
    router
        .pod_status(pool, now_ms)
        .iter()
        .filter(|r| r.metrics_age_ms.is_some() && r.cut != Some(CutReason::Stale))
        .map(|r| PodLoad {
            load: if r.cut.is_some() {
                1.0
            } else {
                (1.0 - r.score).clamp(0.0, 1.0)
            },
            breaker_open: r.breaker == BreakerState::Open
                || matches!(r.cut, Some(CutReason::Breaker(_))),
        })
        .collect()
}

/// Saturated per [`priority::is_saturated`]; a pool with no pod to judge is NOT saturated
/// (no metrics must not shed traffic), and the count of pods below the threshold.
pub fn saturation(router: &Router, pool: usize, now_ms: u64, soft: f64) -> (bool, usize) {
    let loads = pod_loads(router, pool, now_ms);
    if loads.is_empty() {
        return (false, usize::MAX);
    }
    let free = loads
        .iter()
        .filter(|p| !p.breaker_open && p.load <= soft)
        .count();
    (priority::is_saturated(&loads, soft), free)
}

/// The 429 of a sheddable request under saturation.
pub fn shed_reply(retry_after_s: u32) {
    let body = ai_lb_filter_core::admission::response::openai_error_body(
        "The service is saturated and this request's priority class (sheddable) is shed. Please retry later.",
        "server_error",
        Some("shed_under_saturation"),
    );
    reply(
        429,
        &[
            ("content-type", "application/json".to_string()),
            ("retry-after", retry_after_s.to_string()),
        ],
        &body,
    );
}

/// The 503 of a standard request that waited the maximum (or found the held queue full).
pub fn overloaded_reply(retry_after_s: u32) {
    let body = ai_lb_filter_core::admission::response::openai_error_body(
        "The service is saturated; this request waited the maximum time for capacity. Please retry later.",
        "server_error",
        Some("saturated"),
    );
    reply(
        503,
        &[
            ("content-type", "application/json".to_string()),
            ("retry-after", retry_after_s.to_string()),
        ],
        &body,
    );
}

/// Records the signed prompt estimation error: |error| in percent in a histogram, its sign in
/// two counters. Skipped when the server reported no prompt tokens.
fn record_estimate(metrics: &mut Metrics, estimated: u64, actual: u64) {
    let Some(pct) = estimate_error_pct(estimated, actual) else {
        return;
    };
    metrics.record(
        &format!("{PREFIX}.estimate_abs_error_pct"),
        pct.unsigned_abs(),
    );
    let sign = if pct > 0 {
        "estimate_over"
    } else if pct < 0 {
        "estimate_under"
    } else {
        "estimate_exact"
    };
    metrics.inc(&format!("{PREFIX}.{sign}"), 1);
}

/// `(estimated - actual) / actual` in whole percent, rounded; None when `actual` is 0.
pub fn estimate_error_pct(estimated: u64, actual: u64) -> Option<i64> {
    if actual == 0 {
        return None;
    }
    let pct = (estimated as f64 - actual as f64) / actual as f64 * 100.0;
    Some(pct.round() as i64)
}

fn reply(status: u32, headers: &[(&str, String)], body: &str) {
    let hs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Err(e) = host::send_response(status, hs, body.as_bytes()) {
        host::log(
            LogLevel::Warn,
            &format!("ai-lb: admission: cannot send the {status} reply: {e:?}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn estimate_error_is_signed_and_skips_zero() {
        assert_eq!(estimate_error_pct(110, 100), Some(10));
        assert_eq!(estimate_error_pct(90, 100), Some(-10));
        assert_eq!(estimate_error_pct(5, 0), None);
    }

    #[test]
    fn the_section_is_read_from_either_shape() {
        let raw: Option<Value> =
            Some(json!({"tenants": {"default": {"tokensPerSecond": 5, "burst": 9}}}));
        let c = raw.admission_config().unwrap().unwrap();
        assert_eq!(c.tenants.default.burst, 9);
        let off: Option<Value> = Some(json!({"enabled": false}));
        assert!(off.admission_config().unwrap().is_none());
        let none: Option<Value> = None;
        assert!(none.admission_config().unwrap().is_none());
        let bad: Option<Value> =
            Some(json!({"tenants": {"default": {"tokensPerSecond": 0, "burst": 9}}}));
        let e = bad.admission_config().unwrap_err();
        assert_eq!(e.path, "admission.tenants.default.tokensPerSecond");
        let typed: Option<AdmissionConfig> = Some(c.clone());
        assert_eq!(typed.admission_config().unwrap(), Some(c));
    }

    #[test]
    fn header_names_cover_tenant_and_priority_sources() {
        let c = AdmissionConfig::from_value(
            &json!({"tenantKey": ["header:X-Team"], "priority": {"header": "x-prio"}}),
        )
        .unwrap();
        let names = header_names(&c);
        assert!(names.contains(&"x-team"));
        // Not trusted: never read (issue 31).
        assert!(!names.contains(&"x-prio"));
        let trusted = AdmissionConfig::from_value(&json!({
            "priority": {"header": "x-prio"}, "trustedHeaders": ["x-prio"]
        }))
        .unwrap();
        assert!(header_names(&trusted).contains(&"x-prio"));
        let h = Headers::from_pairs(vec![("x-team".into(), "blue".into())]);
        assert_eq!(h.get("x-team"), Some("blue"));
        assert_eq!(h.get("x-prio"), None);
    }
}
