//! Admission control of one request, for both data paths: the [`Gate`] the glues hand to the
//! lifecycle when the plugin config enables `admission`. It resolves the tenant and class from
//! request headers and the peer principal, costs the request (buffered JSON body or length),
//! takes the cost from the tenant's token bucket in the proxy's shared store (proxy-wasm shared
//! data with CAS; process memory in the native module), answers 429 / 400 locally, sheds or
//! holds by class under saturation, scans the response for `usage` and settles the reservation
//! at the end. It reaches the proxy only through [`Host`], the shared buckets through
//! [`SharedStore`] and Envoy's stats through [`AdmissionStats`], so both glues export the same
//! names (`ailb.admission.*`, listed in [`COUNTERS`], [`TENANT_COUNTERS`], [`HISTOGRAMS`],
//! [`GAUGES`]).
//!
//! A held request (the worker's [`HeldQueue`]) is released or expired by the glue's timer with
//! [`held_tick`]; the glue routes each released one on its own stream with
//! [`steer`](super::steer) and records it in [`AdmissionRt::resumed`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crate::admission::bucket::{self, Grant, SharedStore};
use crate::admission::config::{BucketParams, TenantKeySource};
use crate::admission::cost::{self, BodyPlan, CostBasis, Endpoint, RequestCost};
use crate::admission::derived::{ScoreInputs, Tier};
use crate::admission::priority::{self, ClassSource, HeldQueue, Lane, PodLoad, PriorityClass};
use crate::admission::priority::{Left, PriorityDecision};
use crate::admission::stats::{MAX_TENANTS, OTHER_TENANT};
use crate::admission::{tenant, AdmissionConfig, UsageScanner};
use crate::breaker::BreakerState;
use crate::picker::{RequestSize, Router};
use crate::score::CutReason;

use super::{Gate, GateStep, Host, Steered, Worker};

/// The admission counters `ailb.admission.<name>` (each glue defines or names them so).
pub const COUNTERS: [&str; 37] = [
    "invalid_priority_header",
    "malformed_bodies",
    "costed_by_length",
    "uncosted",
    "cas_retries",
    "tokens_reserved",
    "tokens_charged",
    "tokens_refunded",
    "tokens_actual",
    "rate_limited",
    "rejected_cost_exceeds_burst",
    "store_contended",
    "hits_addend_errors",
    "reservations_kept",
    "settled",
    "settle_contended",
    "estimate_over",
    "estimate_under",
    "estimate_exact",
    "shed",
    "held",
    "held_rejected",
    "held_released",
    "held_expired",
    "derived.ultra",
    "derived.high",
    "derived.standard",
    "derived.unparsed",
    "derived.deadline_proceed",
    "quota.scaled_up",
    "quota.scaled_down",
    "quota.unchanged",
    "quota.clamped_min",
    "quota.clamped_max",
    "quota.no_prediction",
    "quota.tokens_base",
    "quota.tokens_quota",
];

/// The per-tenant counters `ailb.admission.tenant.<tenant>.<class>.<name>`.
pub const TENANT_COUNTERS: [&str; 11] = [
    "admitted",
    "rate_limited",
    "shed",
    "held",
    "held_rejected",
    "saturated_proceed",
    "malformed",
    "tokens_reserved",
    "tokens_charged",
    "tokens_refunded",
    "reservations_kept",
];

/// The admission histograms `ailb.admission.<name>`.
pub const HISTOGRAMS: [&str; 3] = ["estimate_abs_error_pct", "held_wait_ms", "quota_scale_pct"];

/// The admission gauges `ailb.admission.<name>`.
pub const GAUGES: [&str; 1] = ["held_depth"];

/// Where the admission stats go: Envoy's stats, through the glue. `what` is one of the names
/// above; the glue names the stat (`ailb.admission.<what>`, or per tenant and class).
pub trait AdmissionStats {
    /// Adds `by` to counter `ailb.admission.<what>` ([`COUNTERS`]).
    fn count(&mut self, what: &str, by: u64);
    /// Adds `by` to `ailb.admission.tenant.<tenant>.<class>.<what>` ([`TENANT_COUNTERS`]).
    fn count_tenant(&mut self, tenant: &str, class: PriorityClass, what: &str, by: u64);
    /// Records `value` in histogram `ailb.admission.<what>` ([`HISTOGRAMS`]).
    fn record(&mut self, what: &str, value: u64);
    /// Sets gauge `ailb.admission.<what>` ([`GAUGES`]).
    fn set(&mut self, what: &str, value: u64);
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

/// Admission state of one worker: the config, the tenants that have their own stats, and the
/// worker's held queue (a paused request can only be resumed on its own worker).
#[derive(Debug)]
pub struct AdmissionRt {
    pub cfg: Arc<AdmissionConfig>,
    tenants: BTreeSet<String>,
    pub held: HeldQueue,
    pub held_reqs: HashMap<u32, HeldReq>,
    /// Released requests and the ranked list their release wrote.
    pub resumed: HashMap<u32, Steered>,
    /// Held requests answered 503 after their wait: their reservation is refunded.
    pub expired: HashSet<u32>,
    /// Released requests not yet routed, for a glue whose held requests wake on their own
    /// stream ([`wake_held`]).
    pub released: HashMap<u32, HeldReq>,
    /// When [`wake_held`] next runs the held queue's tick (ms).
    pub next_tick_ms: u64,
}

impl AdmissionRt {
    pub fn new(cfg: AdmissionConfig) -> Self {
        let held = HeldQueue::new(cfg.saturation.max_held);
        Self {
            cfg: Arc::new(cfg),
            tenants: BTreeSet::new(),
            held,
            held_reqs: HashMap::new(),
            resumed: HashMap::new(),
            expired: HashSet::new(),
            released: HashMap::new(),
            next_tick_ms: 0,
        }
    }

    /// The tenant's name in stats (at most [`MAX_TENANTS`] per worker, later ones `_other`).
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

/// What the admission gate borrows from the worker at once.
pub struct AdmissionParts<'a> {
    pub rt: &'a mut AdmissionRt,
    pub router: &'a mut Router,
    pub stats: &'a mut dyn AdmissionStats,
    /// The tenants' token buckets, shared by every worker of the proxy.
    pub store: &'a dyn SharedStore,
}

/// A worker that carries admission state (None: admission is off).
pub trait AdmissionWorker: Worker {
    fn admission(&mut self) -> Option<AdmissionParts<'_>>;
}

/// Request headers admission reads, fetched once in the request-headers phase.
#[derive(Debug, Default)]
pub struct Headers {
    pairs: Vec<(String, String)>,
}

impl Headers {
    /// Fetches each header `cfg` needs that is present.
    pub fn fetch<H: Host + ?Sized>(host: &H, cfg: &AdmissionConfig) -> Self {
        let mut pairs: Vec<(String, String)> = Vec::new();
        for n in header_names(cfg) {
            if pairs.iter().any(|(k, _)| k == n) {
                continue;
            }
            if let Some(v) = host.request_header(n) {
                pairs.push((n.to_string(), v.into_owned()));
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

/// The header names admission needs for `cfg`.
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
        if let TenantKeySource::Header(h) = s {
            names.push(h.as_str());
        }
    }
    names
}

/// The admission side of one request.
#[derive(Debug)]
pub struct AdmReq {
    pub cfg: Arc<AdmissionConfig>,
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
    /// No route or valid header named the class: `derivedPriority` may choose it.
    pub class_unnamed: bool,
    /// The tier `derivedPriority` gave the request.
    pub tier: Option<Tier>,
    /// A derived Ultra / High request's bounded hold (ms).
    pub bounded_hold_ms: Option<u64>,
    /// The output reservation (tokens), for the latency prediction.
    pub output_tokens: u64,
    /// The pool it is routed in.
    pub pool: Option<usize>,
    /// `latencyAwareQuota`'s scale, read when the request was routed (None: plain cost).
    pub quota_scale: Option<f64>,
}

/// Starts admission for a request: tenant, class and the body plan.
pub fn begin(
    rt: &mut AdmissionRt,
    h: &Headers,
    peer_principal: Option<&str>,
    stats: &mut dyn AdmissionStats,
) -> (AdmReq, BodyPlan) {
    let cfg = rt.cfg.clone();
    let path = h.get(":path").unwrap_or("/");
    let tenant = tenant::resolve(&cfg.tenant_key, |n| h.get(n), peer_principal);
    let claimed = cfg.priority_header().and_then(|n| h.get(n));
    let (class, source) = priority::classify(&cfg.priority, path, claimed);
    if source == ClassSource::InvalidHeader {
        stats.count("invalid_priority_header", 1);
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
            class_unnamed: matches!(source, ClassSource::Default | ClassSource::InvalidHeader),
            tier: None,
            bounded_hold_ms: None,
            output_tokens: 0,
            pool: None,
            quota_scale: None,
        },
        plan,
    )
}

/// What one admission step asks of the glue's I/O: the host (replies, headers, filter
/// state), the shared buckets and the stats.
pub struct Io<'a, H: Host + ?Sized> {
    pub host: &'a mut H,
    pub store: &'a dyn SharedStore,
    pub stats: &'a mut dyn AdmissionStats,
}

impl AdmReq {
    pub fn count(&self, stats: &mut dyn AdmissionStats, what: &str, by: u64) {
        stats.count_tenant(&self.stat_tenant, self.class, what, by);
    }

    /// Costs a fully buffered body and admits it. `Replied` after a 400 or a 429.
    pub fn admit_body<H: Host + ?Sized>(
        &mut self,
        io: Io<'_, H>,
        body: &[u8],
        now_ms: u64,
    ) -> GateStep {
        match cost::cost_and_temperature(&self.cfg.cost, self.endpoint, body) {
            Ok((c, temperature)) => {
                self.derive(io.stats, &c, temperature);
                self.admit(io, c, now_ms)
            }
            Err(e) => {
                io.stats.count("malformed_bodies", 1);
                self.count(io.stats, "malformed", 1);
                let body = e.error_body();
                reply(io.host, 400, &[("content-type", "application/json")], &body);
                GateStep::Replied
            }
        }
    }

    /// Costs a body from its length and admits it.
    pub fn admit_length<H: Host + ?Sized>(
        &mut self,
        io: Io<'_, H>,
        bytes: u64,
        now_ms: u64,
    ) -> GateStep {
        let c = cost::cost_from_length(&self.cfg.cost, self.endpoint, bytes);
        self.derive(io.stats, &c, None);
        self.admit(io, c, now_ms)
    }

    /// `derivedPriority`: the tier of a request that names no class, from its parsed body. A
    /// body that was not parsed (costed by length, malformed and let through) keeps the
    /// default class, counted `derived.unparsed`.
    pub fn derive(
        &mut self,
        stats: &mut dyn AdmissionStats,
        c: &RequestCost,
        temperature: Option<f64>,
    ) {
        self.output_tokens = c.output_tokens;
        let Some(d) = self.cfg.derived_priority.filter(|_| self.class_unnamed) else {
            return;
        };
        if c.basis != CostBasis::Parsed {
            stats.count("derived.unparsed", 1);
            return;
        }
        let x = ScoreInputs {
            prompt_units: c
                .text_tokens
                .saturating_add(c.image_patches)
                .saturating_add(c.audio_frames),
            output_tokens: c.output_tokens,
            temperature,
        };
        let tier = d.tier(d.score(&x));
        let (class, hold) = d.class_of(tier, self.cfg.priority.default_class);
        self.tier = Some(tier);
        self.class = class;
        self.bounded_hold_ms = hold;
        stats.count(derived_stat(tier), 1);
    }

    /// The weighted cost charged for `actual` (the plain cost, or `latencyAwareQuota`'s).
    pub fn charge_for(&self, actual: u64) -> u64 {
        match (self.cfg.latency_quota, self.quota_scale) {
            (Some(q), Some(scale)) => q.quota(actual, scale).0,
            _ => actual,
        }
    }

    /// Records the scale `latencyAwareQuota` gives this request on the pod it was routed to
    /// (`ttft_ms`, `decode_ms` its readings then); no prediction leaves the plain cost, counted
    /// at settlement (with the requests the filter did not route: Envoy's fallback).
    pub fn routed(
        &mut self,
        stats: &mut dyn AdmissionStats,
        ttft_ms: Option<f64>,
        decode_ms: Option<f64>,
    ) {
        let Some(q) = self.cfg.latency_quota else {
            return;
        };
        if self.grant.is_none() || self.quota_scale.is_some() {
            return;
        }
        let scale = crate::admission::quota::LatencyQuota::predict_ms(
            ttft_ms,
            decode_ms,
            self.output_tokens,
        )
        .and_then(|p| q.scale(p));
        if let Some(s) = scale {
            stats.record("quota_scale_pct", (s * 100.0).round().min(1e9) as u64);
            self.quota_scale = Some(s);
        }
    }

    /// Takes `c` from the tenant's bucket, or answers 429.
    pub fn admit<H: Host + ?Sized>(
        &mut self,
        io: Io<'_, H>,
        c: RequestCost,
        now_ms: u64,
    ) -> GateStep {
        let Io { host, store, stats } = io;
        match c.basis {
            CostBasis::Parsed => {}
            CostBasis::ContentLength => stats.count("costed_by_length", 1),
            CostBasis::Uncosted => {
                stats.count("uncosted", 1);
                self.count(stats, "admitted", 1);
                return GateStep::Proceed;
            }
        }
        self.estimated_prompt = c
            .text_tokens
            .saturating_add(c.image_patches)
            .saturating_add(c.audio_frames);
        if c.weighted == 0 {
            self.count(stats, "admitted", 1);
            return GateStep::Proceed;
        }
        match bucket::try_admit(store, &self.tenant, &self.params, c.weighted, now_ms) {
            bucket::Admission::Admitted { grant, cas_retries } => {
                stats.count("cas_retries", u64::from(cas_retries));
                stats.count("tokens_reserved", grant.reserved);
                self.count(stats, "admitted", 1);
                self.count(stats, "tokens_reserved", grant.reserved);
                // Global limits: Envoy's rate limit filter (after this one) sends the cost as
                // `hits_addend` for request-time descriptors.
                publish_hits(host, stats, grant.reserved);
                self.grant = Some(grant);
                GateStep::Proceed
            }
            bucket::Admission::Rejected {
                limited,
                cas_retries,
            } => {
                stats.count("cas_retries", u64::from(cas_retries));
                stats.count("rate_limited", 1);
                if limited.reason == bucket::RejectReason::CostExceedsBurst {
                    stats.count("rejected_cost_exceeds_burst", 1);
                }
                self.count(stats, "rate_limited", 1);
                let extra = limited.headers();
                let mut headers = vec![("content-type", "application/json")];
                headers.extend(extra.iter().map(|(k, v)| (*k, v.as_str())));
                let body = limited.error_body();
                let status = u16::try_from(bucket::RateLimited::STATUS).unwrap_or(429);
                reply(host, status, &headers, &body);
                GateStep::Replied
            }
            bucket::Admission::Contended => {
                stats.count("store_contended", 1);
                self.count(stats, "admitted", 1);
                GateStep::Proceed
            }
        }
    }

    /// Response headers: the `x-ratelimit-*` of the grant, and start scanning for usage.
    pub fn on_response_headers<H: Host + ?Sized>(&mut self, host: &mut H) {
        if let Some(g) = &self.grant {
            for (k, v) in g.headers() {
                host.set_response_header(k, &v);
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
    pub fn on_response_end<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        stats: &mut dyn AdmissionStats,
    ) {
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
            .map(|u| self.charge_for(u.weighted(&self.cfg.cost.weights)));
        let extra = actual.map_or(0, |a| a.saturating_sub(g.reserved));
        publish_hits(host, stats, extra);
    }

    /// Settles the reservation with the response's usage (once); no usage keeps it.
    pub fn settle<H: Host + ?Sized>(&mut self, io: Io<'_, H>, now_ms: u64) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let Some(grant) = self.grant.take() else {
            return;
        };
        let Io { host, store, stats } = io;
        let usage = if self.refund_all {
            Some(Default::default())
        } else {
            self.scanner.as_ref().and_then(UsageScanner::usage)
        };
        let Some(usage) = usage else {
            stats.count("reservations_kept", 1);
            self.count(stats, "reservations_kept", 1);
            return;
        };
        let plain = usage.weighted(&self.cfg.cost.weights);
        let actual = if self.refund_all {
            plain
        } else {
            record_estimate(stats, self.estimated_prompt, usage.prompt_tokens);
            match (self.cfg.latency_quota, self.quota_scale) {
                (Some(q), Some(scale)) => {
                    let (charged, effect) = q.quota(plain, scale);
                    stats.count(effect.stat(), 1);
                    stats.count("quota.tokens_base", plain);
                    stats.count("quota.tokens_quota", charged);
                    charged
                }
                (Some(_), None) => {
                    stats.count("quota.no_prediction", 1);
                    plain
                }
                (None, _) => plain,
            }
        };
        let t = &grant.tenant;
        match bucket::reconcile(store, t, &self.params, grant.reserved, actual, now_ms) {
            Ok(s) => {
                stats.count("cas_retries", u64::from(s.cas_retries));
                stats.count("tokens_charged", s.charged);
                stats.count("tokens_refunded", s.refunded);
                stats.count("tokens_actual", plain);
                stats.count("settled", 1);
                self.count(stats, "tokens_charged", s.charged);
                self.count(stats, "tokens_refunded", s.refunded);
            }
            Err(_) => {
                stats.count("settle_contended", 1);
                host.warn(&format!(
                    "ai-lb: admission: tenant `{t}`: shared bucket stayed contended; \
                     reservation of {} kept instead of {actual}",
                    grant.reserved
                ));
            }
        }
    }
}

/// Sets `envoy.ratelimit.hits_addend`; failures are counted (no rate limit filter is fine).
fn publish_hits<H: Host + ?Sized>(host: &mut H, stats: &mut dyn AdmissionStats, n: u64) {
    if !host.set_hits_addend(n) {
        stats.count("hits_addend_errors", 1);
    }
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
pub fn shed_reply<H: Host + ?Sized>(host: &mut H, retry_after_s: u32) {
    let body = crate::admission::response::openai_error_body(
        "The service is saturated and this request's priority class (sheddable) is shed. Please retry later.",
        "server_error",
        Some("shed_under_saturation"),
    );
    let retry = retry_after_s.to_string();
    let headers = [
        ("content-type", "application/json"),
        ("retry-after", &retry),
    ];
    reply(host, 429, &headers, &body);
}

/// The 503 of a standard request that waited the maximum (or found the held queue full).
pub fn overloaded_reply<H: Host + ?Sized>(host: &mut H, retry_after_s: u32) {
    let body = crate::admission::response::openai_error_body(
        "The service is saturated; this request waited the maximum time for capacity. Please retry later.",
        "server_error",
        Some("saturated"),
    );
    let retry = retry_after_s.to_string();
    let headers = [
        ("content-type", "application/json"),
        ("retry-after", &retry),
    ];
    reply(host, 503, &headers, &body);
}

/// Records the signed prompt estimation error: |error| in percent in a histogram, its sign in
/// three counters. Skipped when the server reported no prompt tokens.
fn record_estimate(stats: &mut dyn AdmissionStats, estimated: u64, actual: u64) {
    let Some(pct) = estimate_error_pct(estimated, actual) else {
        return;
    };
    stats.record("estimate_abs_error_pct", pct.unsigned_abs());
    let sign = if pct > 0 {
        "estimate_over"
    } else if pct < 0 {
        "estimate_under"
    } else {
        "estimate_exact"
    };
    stats.count(sign, 1);
}

/// `(estimated - actual) / actual` in whole percent, rounded; None when `actual` is 0.
pub fn estimate_error_pct(estimated: u64, actual: u64) -> Option<i64> {
    if actual == 0 {
        return None;
    }
    let pct = (estimated as f64 - actual as f64) / actual as f64 * 100.0;
    Some(pct.round() as i64)
}

fn reply<H: Host + ?Sized>(host: &mut H, status: u16, headers: &[(&str, &str)], body: &str) {
    host.send_local_reply(status, headers, body.as_bytes());
}

/// What one tick of a worker's held queue decided: requests to answer 503 (their stream
/// replies with [`overloaded_reply`]) and requests to route now, most important class first.
#[derive(Debug, Default)]
pub struct HeldTick {
    pub expired: Vec<u32>,
    pub released: Vec<(u32, HeldReq)>,
    /// `saturation.retryAfterSeconds`, for the 503s.
    pub retry_after_s: u32,
}

/// The worker's held queue at `now`: requests past their deadline expire (recorded in
/// [`AdmissionRt::expired`]: refunded at their end), and as many as there are unsaturated pods
/// are released. The glue routes each released request on its own stream (with
/// [`steer`](super::steer)), records it in [`AdmissionRt::resumed`] and resumes it.
pub fn held_tick(
    rt: &mut AdmissionRt,
    router: &Router,
    stats: &mut dyn AdmissionStats,
    now: u64,
) -> HeldTick {
    let mut out = HeldTick {
        retry_after_s: rt.cfg.saturation.retry_after_seconds,
        ..HeldTick::default()
    };
    if rt.held.depth() == 0 {
        return out;
    }
    // Bounded holds (derived Ultra / High) at their deadline are routed, not answered.
    for l in rt.held.due(now) {
        if let Some(h) = rt.held_reqs.remove(&l.id) {
            stats.count("derived.deadline_proceed", 1);
            stats.record("held_wait_ms", l.waited_ms);
            out.released.push((l.id, h));
        }
    }
    for l in rt.held.expire(now) {
        rt.expired.insert(l.id);
        if let Some(h) = rt.held_reqs.remove(&l.id) {
            stats.count_tenant(&h.stat_tenant, l.class, "held_rejected", 1);
        }
        stats.count("held_expired", 1);
        stats.count("held_rejected", 1);
        stats.record("held_wait_ms", l.waited_ms);
        out.expired.push(l.id);
    }
    let soft = rt.cfg.saturation.soft_threshold;
    let pools: BTreeSet<usize> = rt.held_reqs.values().map(|h| h.pool).collect();
    let mut free = 0usize;
    for p in pools {
        let (saturated, f) = saturation(router, p, now, soft);
        if !saturated {
            free = free.saturating_add(f);
        }
    }
    for l in rt.held.release(free, now) {
        if let Some(h) = rt.held_reqs.remove(&l.id) {
            released(stats, &l);
            out.released.push((l.id, h));
        }
    }
    stats.set("held_depth", rt.held.depth() as u64);
    out
}

/// What became of a held request that woke on its own stream ([`wake_held`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// Still held.
    Waiting,
    /// Answered 503 (it waited the maximum): the stream goes no further.
    Answered,
    /// Routed ([`AdmissionRt::resumed`] has its pick, or Envoy's fallback takes it): resume
    /// the stream.
    Released,
}

/// For a glue whose held requests wake on their own stream from a timer (the native module:
/// a scheduler event per held request every `tick_ms`): runs the worker's [`held_tick`] at
/// most once per `tick_ms` (so one free pod takes one request before the next is judged),
/// then says what became of request `id`: answered 503 here, or routed here on its own stream
/// with the lifecycle's [`steer`](super::steer).
pub fn wake_held<H, W>(host: &mut H, worker: &mut W, id: u32, now: u64, tick_ms: u64) -> Woken
where
    H: Host + ?Sized,
    W: AdmissionWorker + ?Sized,
{
    let Some(p) = worker.admission() else {
        return Woken::Released;
    };
    // The pools of the held requests, when the tick is due: judged on a fresh view (a worker
    // installs the agents' latest pool state only when asked).
    let due = (now >= p.rt.next_tick_ms).then(|| {
        p.rt.next_tick_ms = now.saturating_add(tick_ms);
        p.rt.held_reqs
            .values()
            .map(|h| h.pool)
            .collect::<BTreeSet<usize>>()
    });
    if let Some(pools) = due {
        for pool in pools {
            worker.refresh(pool, now);
        }
        if let Some(AdmissionParts {
            rt, router, stats, ..
        }) = worker.admission()
        {
            let t = held_tick(rt, router, stats, now);
            rt.released.extend(t.released);
        }
    }
    let Some(AdmissionParts { rt, .. }) = worker.admission() else {
        return Woken::Released;
    };
    if rt.expired.contains(&id) {
        overloaded_reply(host, rt.cfg.saturation.retry_after_seconds);
        return Woken::Answered;
    }
    let Some(h) = rt.released.remove(&id) else {
        return Woken::Waiting;
    };
    let steered = super::steer(host, worker, h.pool, h.model.as_deref(), now, h.size, None);
    if let (Some(st), Some(p)) = (steered, worker.admission()) {
        p.rt.resumed.insert(id, st);
    }
    Woken::Released
}

/// The counter of a derived tier.
pub fn derived_stat(t: Tier) -> &'static str {
    match t {
        Tier::Ultra => "derived.ultra",
        Tier::High => "derived.high",
        Tier::Standard => "derived.standard",
    }
}

fn released(stats: &mut dyn AdmissionStats, l: &Left) {
    stats.count("held_released", 1);
    stats.record("held_wait_ms", l.waited_ms);
}

/// The admission gate of one request (`id`: its handle in the worker's held queue).
#[derive(Debug)]
pub struct AdmissionGate {
    pub id: u32,
    pub adm: Option<AdmReq>,
    /// Held in the worker's priority queue, not yet taken back ([`Gate::take_resumed`]).
    held: bool,
}

impl AdmissionGate {
    pub fn new(id: u32) -> Self {
        Self {
            id,
            adm: None,
            held: false,
        }
    }

    /// Whether the gate held this request (and it has not come back yet).
    pub fn held(&self) -> bool {
        self.held
    }

    /// Whether this request waits in the worker's held queue.
    pub fn is_held<W: AdmissionWorker + ?Sized>(&self, worker: &mut W) -> bool {
        worker
            .admission()
            .is_some_and(|p| p.rt.held_reqs.contains_key(&self.id))
    }

    /// The class policy under saturation: proceed, shed (429), reject (503) or hold in the
    /// worker's priority queue until the glue's tick releases it.
    fn priority_gate<H, W>(&mut self, host: &mut H, worker: &mut W, p: Route<'_>) -> GateStep
    where
        H: Host + ?Sized,
        W: AdmissionWorker + ?Sized,
    {
        let Some(a) = self.adm.as_mut() else {
            return GateStep::Proceed;
        };
        // As for a pick: judge saturation on an up-to-date view of the pool.
        worker.refresh(p.pool, p.now);
        let Some(AdmissionParts {
            rt, router, stats, ..
        }) = worker.admission()
        else {
            return GateStep::Proceed;
        };
        let sat = rt.cfg.saturation;
        let (saturated, _) = saturation(router, p.pool, p.now, sat.soft_threshold);
        let reject = |a: &mut AdmReq, stats: &mut dyn AdmissionStats, what: &str| {
            a.count(stats, what, 1);
            stats.count(what, 1);
            a.refund_all = true;
        };
        a.pool = Some(p.pool);
        let decision = match a.bounded_hold_ms {
            Some(ms) => priority::decide_bounded(saturated, rt.held.has_room(), ms, p.now),
            None => priority::decide(&sat, a.class, saturated, rt.held.has_room(), p.now),
        };
        match decision {
            PriorityDecision::Proceed => {
                if saturated {
                    a.count(stats, "saturated_proceed", 1);
                }
                GateStep::Proceed
            }
            PriorityDecision::Shed { retry_after_s } => {
                reject(a, stats, "shed");
                shed_reply(host, retry_after_s);
                GateStep::Replied
            }
            PriorityDecision::Reject { retry_after_s } => {
                reject(a, stats, "held_rejected");
                overloaded_reply(host, retry_after_s);
                GateStep::Replied
            }
            PriorityDecision::Hold { deadline_ms } => {
                let pushed = match a.tier.filter(|_| a.bounded_hold_ms.is_some()) {
                    Some(t) => {
                        let lane = if t == Tier::Ultra {
                            Lane::Ultra
                        } else {
                            Lane::High
                        };
                        rt.held
                            .push_bounded(self.id, a.class, lane, p.now, deadline_ms)
                    }
                    None => rt.held.push(self.id, a.class, p.now, deadline_ms),
                };
                if pushed.is_err() && a.bounded_hold_ms.is_some() {
                    // A bounded hold is never answered 503: no room, it goes now.
                    a.count(stats, "saturated_proceed", 1);
                    return GateStep::Proceed;
                }
                if pushed.is_err() {
                    reject(a, stats, "held_rejected");
                    overloaded_reply(host, sat.retry_after_seconds);
                    return GateStep::Replied;
                }
                let held = HeldReq {
                    pool: p.pool,
                    model: p.model.map(str::to_string),
                    stat_tenant: a.stat_tenant.clone(),
                    size: p.size,
                };
                rt.held_reqs.insert(self.id, held);
                self.held = true;
                a.count(stats, "held", 1);
                stats.count("held", 1);
                stats.set("held_depth", rt.held.depth() as u64);
                GateStep::Held
            }
        }
    }
}

/// Where a request is about to be routed.
#[derive(Debug, Clone, Copy)]
struct Route<'a> {
    pool: usize,
    model: Option<&'a str>,
    size: RequestSize,
    now: u64,
}

impl<W: AdmissionWorker + ?Sized> Gate<W> for AdmissionGate {
    /// Starts admission control (tenant, class, body plan). A request without a body, or
    /// one costed by its length, is admitted here; a JSON body is costed when it arrives.
    fn begin<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        end_of_stream: bool,
        now: u64,
    ) -> GateStep {
        let Some(AdmissionParts {
            rt, stats, store, ..
        }) = worker.admission()
        else {
            return GateStep::Proceed;
        };
        let headers = Headers::fetch(&*host, &rt.cfg);
        let peer = if rt.cfg.tenant_key.contains(&TenantKeySource::PeerPrincipal) {
            host.peer_principal().map(|p| p.into_owned())
        } else {
            None
        };
        let (mut adm, plan) = begin(rt, &headers, peer.as_deref(), stats);
        let step = match plan {
            // No body at all: nothing to cost.
            _ if end_of_stream => GateStep::Proceed,
            BodyPlan::ByLength(n) => adm.admit_length(Io { host, store, stats }, n, now),
            BodyPlan::Buffer => GateStep::NeedBody,
        };
        self.adm = Some(adm);
        step
    }

    /// Costs the whole body (an empty or unreadable one, e.g. after trailers, by its length;
    /// one larger than `maxBodyReadBytes` by its declared length, else what was read).
    fn body<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        body: &[u8],
        complete: bool,
        now: u64,
    ) -> GateStep {
        let Some(a) = self.adm.as_mut() else {
            return GateStep::Proceed;
        };
        let length = (!complete).then(|| {
            host.request_header("content-length")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(body.len() as u64)
        });
        let Some(AdmissionParts { stats, store, .. }) = worker.admission() else {
            return GateStep::Proceed;
        };
        let io = Io { host, store, stats };
        match length {
            Some(n) => a.admit_length(io, n, now),
            None if body.is_empty() => a.admit_length(io, 0, now),
            None => a.admit_body(io, body, now),
        }
    }

    fn before_route<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        pool: usize,
        model: Option<&str>,
        size: RequestSize,
        now: u64,
    ) -> GateStep {
        let route = Route {
            pool,
            model,
            size,
            now,
        };
        self.priority_gate(host, worker, route)
    }

    /// Routed to `steered`'s pod: `latencyAwareQuota` reads that pod's latency prediction.
    fn routed(&mut self, worker: &mut W, pool: usize, steered: &Steered, now: u64) {
        let Some(a) = self.adm.as_mut() else {
            return;
        };
        if a.cfg.latency_quota.is_none() || a.grant.is_none() {
            return;
        }
        let Some(AdmissionParts { router, stats, .. }) = worker.admission() else {
            return;
        };
        let chosen = steered.chosen();
        let pods = router.pod_status(pool, now);
        let pod = pods.iter().find(|r| r.address == chosen);
        a.routed(
            stats,
            pod.and_then(|r| r.ttft_p99_ms),
            pod.and_then(|r| r.decode_ms),
        );
    }

    /// What the glue's tick recorded when it released this request from the held queue (the
    /// ranked list it wrote), or that it answered it 503 (the charge is refunded).
    fn take_resumed(&mut self, worker: &mut W) -> Option<Steered> {
        self.held = false;
        let AdmissionParts { rt, .. } = worker.admission()?;
        let resumed = rt.resumed.remove(&self.id);
        let expired = rt.expired.remove(&self.id);
        // A client that left while held (or released and not routed yet).
        if rt.held.remove(self.id) {
            rt.held_reqs.remove(&self.id);
        }
        rt.released.remove(&self.id);
        if expired {
            if let Some(a) = self.adm.as_mut() {
                a.refund_all = true;
            }
        }
        resumed
    }

    fn on_response_headers<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        end_of_stream: bool,
    ) {
        if let Some(a) = self.adm.as_mut().filter(|a| !a.refund_all) {
            a.on_response_headers(host);
            if end_of_stream {
                if let Some(p) = worker.admission() {
                    a.on_response_end(host, p.stats);
                }
            }
        }
    }

    /// Feeds the answer's usage scanner (the charge is reconciled with the actual tokens).
    fn on_response_body<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        size: usize,
        end_of_stream: bool,
    ) {
        let Some(a) = self.adm.as_mut().filter(|a| a.scanner.is_some()) else {
            return;
        };
        if let Some(chunk) = host.response_chunk(size) {
            a.on_response_body(&chunk);
        }
        if end_of_stream {
            if let Some(p) = worker.admission() {
                a.on_response_end(host, p.stats);
            }
        }
    }

    fn on_end<H: Host + ?Sized>(&mut self, host: &mut H, worker: &mut W, now: u64) {
        let Some(mut a) = self.adm.take() else {
            return;
        };
        if let Some(AdmissionParts { stats, store, .. }) = worker.admission() {
            a.settle(Io { host, store, stats }, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_error_is_signed_and_skips_zero() {
        assert_eq!(estimate_error_pct(110, 100), Some(10));
        assert_eq!(estimate_error_pct(90, 100), Some(-10));
        assert_eq!(estimate_error_pct(5, 0), None);
    }

    #[test]
    fn header_names_cover_tenant_and_priority_sources() {
        use serde_json::json;
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
