//! Decides whether the "Stats" tables of `docs/operations.md` describe what a running Envoy
//! exports, read from the doc itself so that the doc stays the source of truth: (a) every
//! `ailb.*` stat Envoy shows (prefix stripped, the native module's `ailb_endpoint` label put
//! back in the name as the wasm filter has it) matches a row documented for that data path,
//! with its type; (b) every stat documented for a data path shows up, unless listed below as
//! not exercised here, with the reason.
//!
//! Traffic: the wasm filter in route mode (one worker, admission and the big-request hold on)
//! steers, falls back on an unknown model, reads and truncates bodies, opens and closes a
//! failing pod's breaker, holds big requests (held, left, full, expired, released), answers
//! 429 (a tenant's bucket, and shedding under saturation), 400 and 503, and holds a standard
//! request until a pod cools; both data paths in guard mode reject (queue full, GPU
//! saturated), admit, and fail open (stale signals, and a guard with no agent at all); the
//! native module steers, falls back, truncates, opens and closes a breaker, and runs the same
//! admission and saturation traffic (429, 400, settlement; shed, held, released).
//!
//! Needs both builds and the binaries: `cargo build -p ai-lb-filter-wasm --target
//! wasm32-wasip1 --release`, `cargo build -p ai-lb-filter-native`, `cargo build --bins`.
//! `-- --nocapture` prints, per data path, the documented stats that stayed at 0.

mod filter_common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, http_get, workspace_root, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

const DOC: &str = "docs/operations.md";
const HEADER: &str = "| stat | type | labels | data paths | when it moves |";

/// Documented stats this test does not make appear, per data path, and why. Each must be a
/// documented pattern of that path that this run does not export (a stale entry fails).
const NOT_EXERCISED_WASM: &[(&str, &str)] = &[
    (
        "ailb.admission.uncosted",
        "needs `cost.malformedJson: passUncosted`, which turns this run's malformed-body 400 into it",
    ),
    (
        "ailb.admission.cas_retries",
        "needs two workers racing on one bucket; this Envoy runs one worker",
    ),
    (
        "ailb.admission.store_contended",
        "needs two workers racing on one bucket; this Envoy runs one worker",
    ),
    (
        "ailb.admission.settle_contended",
        "needs two workers racing on one bucket; this Envoy runs one worker",
    ),
    (
        "ailb.admission.hits_addend_errors",
        "moves only on a proxy that refuses the `envoy.ratelimit.hits_addend` filter state; this Envoy takes it",
    ),
    (
        "ailb.admission.derived.ultra",
        "needs `admission.derivedPriority`, off here (parity.rs's derived-priority row moves it on both paths)",
    ),
    (
        "ailb.admission.derived.high",
        "needs `admission.derivedPriority`, off here (parity.rs's derived-priority row moves it on both paths)",
    ),
    (
        "ailb.admission.derived.standard",
        "needs `admission.derivedPriority`, off here (parity.rs's derived-priority row moves it on both paths)",
    ),
    (
        "ailb.admission.derived.unparsed",
        "needs `admission.derivedPriority`, off here",
    ),
    (
        "ailb.admission.derived.deadline_proceed",
        "needs `admission.derivedPriority`, off here (parity.rs's derived-priority row moves it on both paths)",
    ),
    (
        "ailb.admission.quota.scaled_up",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.scaled_down",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.unchanged",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.clamped_min",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.clamped_max",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.tokens_base",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.tokens_quota",
        "needs `admission.latencyAwareQuota`, off here (bench_derived_priority moves it)",
    ),
    (
        "ailb.admission.quota.no_prediction",
        "needs `admission.latencyAwareQuota`, off here",
    ),
    (
        "ailb.admission.quota_scale_pct",
        "needs `admission.latencyAwareQuota`, off here",
    ),
    (
        "ailb.pool.<pool>.thresholds.failure_rate_permille",
        "needs `breaker.adaptiveThresholds` on, which this run leaves off (tests/filter_adaptive_thresholds.rs reads the status page with it on)",
    ),
    (
        "ailb.pool.<pool>.thresholds.agent_error_rate_permille",
        "needs `breaker.adaptiveThresholds` on, which this run leaves off (tests/filter_adaptive_thresholds.rs reads the status page with it on)",
    ),
    (
        "ailb.pool.<pool>.thresholds.ttft_slo_ms",
        "needs `breaker.adaptiveThresholds` on, which this run leaves off (tests/filter_adaptive_thresholds.rs reads the status page with it on)",
    ),
];
/// Stats of sections this run leaves off, on both data paths (the native module defines the
/// gauges of `learnedWeights` only with it on, and the per-version stats carry a label, so they
/// appear only once counted).
const NOT_EXERCISED_BOTH: &[(&str, &str)] = &[
    (
        "ailb.pool.<pool>.learned.gpu",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.queue",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.p99",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.memory",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.errors",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.speed",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.ttft",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.pool.<pool>.learned.bias",
        "needs `learnedWeights` on, which this run leaves off (tests/filter_learned_weights.rs reads these gauges with it on)",
    ),
    (
        "ailb.version.<version>.picks",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.pinned",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.rejected_no_pod",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.rejected_open",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.failures",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.domain_opened",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.domain_half_opened",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.domain_closed",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
    (
        "ailb.version.<version>.domain_state",
        "needs `versions`, off here (tests/filter_versions.rs moves them on both data paths)",
    ),
];
/// None of its own: the native module defines every stat without a label (admission's among
/// them) with its config, so each shows up at 0 before it moves (the exceptions, sections this
/// run leaves off, are in [`NOT_EXERCISED_BOTH`]).
const NOT_EXERCISED_NATIVE: &[(&str, &str)] = &[];

/// Stats that must have moved (a counter above 0, a histogram with samples): the faults and
/// the traffic above happened, not only the stats' definitions.
const MUST_MOVE_WASM: &[&str] = &[
    "ailb.steered",
    "ailb.fallback.no_model",
    "ailb.fail_open",
    "ailb.body_truncated",
    "ailb.breaker_opened.server_errors",
    "ailb.breaker_closed",
    "ailb.endpoint.<ip:port>.failures",
    "ailb.big_hold.held",
    "ailb.big_hold.wait_ms",
    "ailb.admission.rate_limited",
    "ailb.admission.shed",
    "ailb.admission.held_released",
    "ailb.admission.held_wait_ms",
    "ailb.guard.rejected.queue_full",
    "ailb.guard.fail_open.stale",
];
const MUST_MOVE_NATIVE: &[&str] = &[
    "ailb.steered",
    "ailb.fallback.no_model",
    "ailb.body_truncated",
    "ailb.breaker_opened.server_errors",
    "ailb.breaker_closed",
    "ailb.endpoint.<ip:port>.picks",
    "ailb.endpoint.<ip:port>.failures",
    "ailb.admission.rate_limited",
    "ailb.admission.settled",
    "ailb.admission.shed",
    "ailb.admission.held_released",
    "ailb.admission.held_wait_ms",
    "ailb.guard.rejected.queue_full",
    "ailb.guard.fail_open.stale",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn parse(s: &str) -> Option<Kind> {
        match s {
            "counter" => Some(Kind::Counter),
            "gauge" => Some(Kind::Gauge),
            "histogram" => Some(Kind::Histogram),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataPath {
    Wasm,
    Native,
}

impl DataPath {
    fn as_str(self) -> &'static str {
        match self {
            DataPath::Wasm => "wasm",
            DataPath::Native => "native",
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            DataPath::Wasm => "wasmcustom.",
            DataPath::Native => "dynamicmodulescustom.",
        }
    }
}

/// One documented stat: a first-column pattern with its `{a,b}` alternatives expanded; a
/// `<placeholder>` left in it matches any non-empty text.
#[derive(Debug)]
struct Documented {
    pattern: String,
    kind: Kind,
    paths: Vec<DataPath>,
}

/// The rows of every table under `## Stats` in the doc.
fn documented() -> Vec<Documented> {
    let path = workspace_root().join(DOC);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut in_stats = false;
    let mut tables = 0;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = format!("{DOC}:{}", i + 1);
        if line.starts_with("## ") {
            in_stats = line == "## Stats";
            continue;
        }
        if !in_stats {
            continue;
        }
        if line.trim_end() == HEADER {
            tables += 1;
            continue;
        }
        if line.starts_with("| stat ") {
            panic!("{at}: a stats table's header must be `{HEADER}`: {line}");
        }
        if !line.starts_with("| `") {
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let [_, stat, kind, _labels, paths, _when, _] = cells[..] else {
            panic!("{at}: a stats row has 5 cells: {line}");
        };
        let pattern = stat
            .strip_prefix('`')
            .and_then(|s| s.strip_suffix('`'))
            .filter(|s| !s.contains('`'))
            .unwrap_or_else(|| panic!("{at}: the stat cell is one `name pattern`: {stat}"));
        let kind = Kind::parse(kind)
            .unwrap_or_else(|| panic!("{at}: type `{kind}` is not counter, gauge or histogram"));
        let paths = match paths {
            "both" => vec![DataPath::Wasm, DataPath::Native],
            "wasm" => vec![DataPath::Wasm],
            "native" => vec![DataPath::Native],
            other => panic!("{at}: data paths `{other}` is not both, wasm or native"),
        };
        for p in expand(pattern) {
            assert!(
                !rows.iter().any(|r: &Documented| r.pattern == p),
                "{at}: {p} documented twice"
            );
            rows.push(Documented {
                pattern: p,
                kind,
                paths: paths.clone(),
            });
        }
    }
    assert!(tables > 0, "{DOC}: no `{HEADER}` table under `## Stats`");
    rows
}

/// `a.{b,c}.d` -> `a.b.d`, `a.c.d` (every group, left to right).
fn expand(pattern: &str) -> Vec<String> {
    let Some(open) = pattern.find('{') else {
        return vec![pattern.to_string()];
    };
    let close = pattern[open..]
        .find('}')
        .map(|j| open + j)
        .unwrap_or_else(|| panic!("unclosed {{ in {pattern}"));
    let (head, tail) = (&pattern[..open], &pattern[close + 1..]);
    pattern[open + 1..close]
        .split(',')
        .flat_map(|alt| expand(&format!("{head}{alt}{tail}")))
        .collect()
}

/// Whether `name` matches `pattern`, where each `<placeholder>` stands for non-empty text.
fn matches(pattern: &str, name: &str) -> bool {
    let Some(open) = pattern.find('<') else {
        return pattern == name;
    };
    let Some(rest) = name.strip_prefix(&pattern[..open]) else {
        return false;
    };
    let after = pattern[open..]
        .find('>')
        .map_or("", |j| &pattern[open + j + 1..]);
    (1..=rest.len())
        .filter(|&k| rest.is_char_boundary(k))
        .any(|k| matches(after, &rest[k..]))
}

/// One `ailb.*` stat as Envoy exports it.
#[derive(Debug, Clone)]
struct Exported {
    /// Without the prefix; the native module's per-pod label put back into the name.
    name: String,
    /// As `/stats` shows it.
    raw: String,
    kind: Kind,
    /// A counter or gauge above 0, a histogram with samples.
    moved: bool,
}

/// `name` as the doc writes it: the data path's prefix stripped, and the native module's
/// `ailb.endpoint.<metric>.ailb_endpoint.<ip:port>` turned into `ailb.endpoint.<ip:port>.<metric>`
/// and `ailb.admission.tenant.<what>.ailb_tenant.<tenant>.ailb_class.<class>` into
/// `ailb.admission.tenant.<tenant>.<class>.<what>`.
fn normalise(path: DataPath, raw: &str) -> Option<String> {
    let name = raw.strip_prefix(path.prefix())?;
    if !name.starts_with("ailb.") {
        return None;
    }
    if path == DataPath::Native {
        if let Some((base, pod)) = name.split_once(".ailb_endpoint.") {
            if let Some(metric) = base.strip_prefix("ailb.endpoint.") {
                return Some(format!("ailb.endpoint.{pod}.{metric}"));
            }
        }
        if let Some((base, version)) = name.split_once(".ailb_version.") {
            let metric = base.strip_prefix("ailb.version.")?;
            return Some(format!("ailb.version.{version}.{metric}"));
        }
        if let Some((base, labels)) = name.split_once(".ailb_tenant.") {
            let what = base.strip_prefix("ailb.admission.tenant.")?;
            let (tenant, class) = labels.rsplit_once(".ailb_class.")?;
            return Some(format!("ailb.admission.tenant.{tenant}.{class}.{what}"));
        }
    }
    Some(name.to_string())
}

/// Every `ailb.*` stat of `envoy`, from `/stats?format=json` by type.
fn exported(envoy: &Envoy, path: DataPath) -> Vec<Exported> {
    let mut out = Vec::new();
    for (kind, ty) in [
        (Kind::Counter, "Counters"),
        (Kind::Gauge, "Gauges"),
        (Kind::Histogram, "Histograms"),
    ] {
        let r = http_get(envoy.admin, &format!("/stats?format=json&type={ty}"))
            .unwrap_or_else(|e| panic!("admin /stats: {e}"));
        let v: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("/stats?format=json&type={ty}: {e}: {}", r.text()));
        for entry in v["stats"].as_array().into_iter().flatten() {
            let found: Vec<(&str, bool)> = match kind {
                Kind::Histogram => entry["histograms"]["computed_quantiles"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| {
                        let moved = h["values"]
                            .as_array()
                            .is_some_and(|vs| vs.iter().any(|q| !q["cumulative"].is_null()));
                        Some((h["name"].as_str()?, moved))
                    })
                    .collect(),
                _ => entry["name"]
                    .as_str()
                    .map(|n| (n, entry["value"].as_u64().unwrap_or(0) > 0))
                    .into_iter()
                    .collect(),
            };
            for (raw, moved) in found {
                if let Some(name) = normalise(path, raw) {
                    out.push(Exported {
                        name,
                        raw: raw.to_string(),
                        kind,
                        moved,
                    });
                }
            }
        }
    }
    out
}

/// What one data path's Envoys must show.
struct Expect {
    path: DataPath,
    /// Its own list and [`NOT_EXERCISED_BOTH`].
    not_exercised: Vec<(&'static str, &'static str)>,
    must_move: &'static [&'static str],
}

impl Expect {
    fn of(path: DataPath) -> Expect {
        match path {
            DataPath::Wasm => Expect {
                path,
                not_exercised: [NOT_EXERCISED_WASM, NOT_EXERCISED_BOTH].concat(),
                must_move: MUST_MOVE_WASM,
            },
            DataPath::Native => Expect {
                path,
                not_exercised: [NOT_EXERCISED_NATIVE, NOT_EXERCISED_BOTH].concat(),
                must_move: MUST_MOVE_NATIVE,
            },
        }
    }

    /// Everything wrong with `stats` against the doc, one sentence each.
    fn problems(&self, docs: &[Documented], stats: &[Exported]) -> Vec<String> {
        let p = self.path.as_str();
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        for s in stats {
            if !seen.insert(&s.raw) {
                continue;
            }
            let rows: Vec<&Documented> = docs
                .iter()
                .filter(|d| matches(&d.pattern, &s.name))
                .collect();
            if rows.is_empty() {
                out.push(format!(
                    "{p}: `{}` ({}, `{}` in /stats) is not documented in {DOC} (Stats)",
                    s.name,
                    s.kind.as_str(),
                    s.raw
                ));
            } else if !rows.iter().any(|d| d.paths.contains(&self.path)) {
                out.push(format!(
                    "{p}: `{}` is exported, but {DOC} documents `{}` for the other data path only",
                    s.name, rows[0].pattern
                ));
            } else if let Some(d) = rows.iter().find(|d| d.kind != s.kind) {
                out.push(format!(
                    "{p}: `{}` is a {} in Envoy, documented as a {} (`{}`)",
                    s.name,
                    s.kind.as_str(),
                    d.kind.as_str(),
                    d.pattern
                ));
            }
        }
        for d in docs.iter().filter(|d| d.paths.contains(&self.path)) {
            let listed = self.not_exercised.iter().any(|(n, _)| *n == d.pattern);
            let shown = stats.iter().any(|s| matches(&d.pattern, &s.name));
            if !shown && !listed {
                out.push(format!(
                    "{p}: `{}` is documented for {p} but Envoy does not export it here \
                     (exercise it, or list it in NOT_EXERCISED_{} or _BOTH with the reason)",
                    d.pattern,
                    p.to_uppercase()
                ));
            }
        }
        for (n, why) in &self.not_exercised {
            if !docs
                .iter()
                .any(|d| d.pattern == *n && d.paths.contains(&self.path))
            {
                out.push(format!(
                    "{p}: NOT_EXERCISED lists `{n}` ({why}), which {DOC} does not document for {p}"
                ));
            } else if stats.iter().any(|s| matches(n, &s.name)) {
                out.push(format!(
                    "{p}: NOT_EXERCISED lists `{n}` ({why}), but this run exports it: drop it from the list"
                ));
            }
        }
        for n in self.must_move {
            if !stats.iter().any(|s| s.moved && matches(n, &s.name)) {
                out.push(format!(
                    "{p}: `{n}` never moved, so the scenario that drives it did not happen"
                ));
            }
        }
        out
    }

    /// Polls `envoys` until nothing is wrong or 20 s have passed (the wasm filter exports its
    /// counters every 200 ms and its gauges every 500 ms; Envoy merges histograms at its 5 s
    /// stats flush), then fails naming every problem left.
    fn check(&self, docs: &[Documented], envoys: &[&Envoy]) {
        let collect =
            || -> Vec<Exported> { envoys.iter().flat_map(|e| exported(e, self.path)).collect() };
        let mut last = Vec::new();
        let ok = ai_lb_e2e::wait::poll(
            Instant::now() + Duration::from_secs(20),
            Duration::from_millis(250),
            "the exported stats to match the doc",
            || {
                let stats = collect();
                last = self.problems(docs, &stats);
                Ok(last.is_empty().then_some(stats))
            },
        );
        let stats = ok.unwrap_or_else(|e| {
            panic!(
                "{} problem(s) with {DOC}'s Stats tables ({e}):\n{}",
                last.len(),
                last.join("\n")
            )
        });
        let idle: BTreeSet<&str> = docs
            .iter()
            .filter(|d| d.paths.contains(&self.path))
            .filter(|d| {
                !stats
                    .iter()
                    .any(|s| s.moved && matches(&d.pattern, &s.name))
            })
            .map(|d| d.pattern.as_str())
            .collect();
        let names: BTreeSet<&str> = stats.iter().map(|s| s.raw.as_str()).collect();
        eprintln!(
            "{}: {} stats exported, all documented; {} documented for it; stayed at 0 or \
             absent: {idle:?}",
            self.path.as_str(),
            names.len(),
            docs.iter().filter(|d| d.paths.contains(&self.path)).count()
        );
    }
}

// ---- traffic ----

const MODEL_HEADER: &str = "x-ai-lb-model";

/// Two fake pods with a 10 000-token KV cache and 8 seats, GPU at 30 %, with their agents
/// (which report the 8 seats: the guard's queue-full test needs them).
fn pool() -> PodPool {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let pool = PodPool::start_with_agents(
        2,
        1.0,
        |_| args(&["--kv-cache-tokens", "10000", "--max-num-seqs", "8"]),
        |_| args(&["--queue-capacity", "8"]),
    )
    .unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool
}

/// Sends `body` to `listener` with `headers` on a thread with client timeout `timeout`: the
/// status, 0 when the client gave up.
fn send(
    listener: std::net::SocketAddr,
    headers: &[(&'static str, &'static str)],
    body: String,
    timeout: Duration,
) -> JoinHandle<u16> {
    let headers = headers.to_vec();
    thread::spawn(move || {
        let mut h = vec![("connection", "close")];
        h.extend(headers);
        HttpClient::new(listener)
            .with_timeout(timeout)
            .post_json("/v1/completions", &h, &body)
            .map_or(0, |r| r.status)
    })
}

/// Posts `body` on a fresh connection; the status.
fn post(envoy: &Envoy, headers: &[(&str, &str)], body: &str) -> u16 {
    let mut h = vec![("connection", "close")];
    h.extend_from_slice(headers);
    HttpClient::new(envoy.listener)
        .post_json("/v1/completions", &h, body)
        .unwrap()
        .status
}

/// Stat `name` (without the data path's prefix), 0 when absent.
fn stat(envoy: &Envoy, path: DataPath, name: &str) -> u64 {
    envoy.stat(&format!("{}{name}", path.prefix())).unwrap_or(0)
}

/// Waits until stat `name` is at least `at_least`.
fn wait_for(envoy: &Envoy, path: DataPath, name: &str, at_least: u64) {
    let full = format!("{}{name}", path.prefix());
    wait_stat(envoy, &full, |v| v >= at_least);
}

/// A completion whose body is over `maxBodyReadBytes` (65 536 here): a short prompt first,
/// then a long field the router does not read.
fn long_body() -> String {
    json!({"prompt": "hello there", "max_tokens": 4, "user": "x".repeat(70_000)}).to_string()
}

/// Pod 0 answers 500 until its breaker opens, then heals until the breaker has closed.
fn break_and_heal(envoy: &Envoy, pool: &PodPool, path: DataPath) {
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let mut client = HttpClient::new(envoy.listener);
    envoy
        .poll(Duration::from_secs(30), "pod0's breaker open", || {
            complete(&mut client);
            (stat(envoy, path, "ailb.breaker_opened.server_errors") > 0).then_some(())
        })
        .unwrap();
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    envoy
        .poll(Duration::from_secs(30), "pod0's breaker closed", || {
            complete(&mut client);
            (stat(envoy, path, "ailb.breaker_closed") > 0).then_some(())
        })
        .unwrap();
}

/// Steered requests, an unknown model (fallback), a truncated body, a breaker opened and closed.
fn routing(envoy: &Envoy, pool: &PodPool, path: DataPath) {
    short_requests(envoy, 20);
    assert_eq!(
        post(envoy, &[(MODEL_HEADER, "no-such-model")], &body(2, 4)),
        200
    );
    assert_eq!(post(envoy, &[], &long_body()), 200);
    break_and_heal(envoy, pool, path);
}

/// Route mode with everything on: the model read from bodies (with a 64 KiB read limit), a
/// breaker that opens after 3 failures and closes after one probe, the big-request hold (one
/// held at a time, for 1 s), admission with the tenant and the priority from trusted headers
/// (the priority header is read only when trusted), a tenant whose bucket admits nothing, one
/// reserved output token by default, a held standard request waiting 1 s.
fn route_config() -> String {
    let admission = route_admission();
    config(json!({
        "modelHeader": MODEL_HEADER,
        "maxBodyReadBytes": 65536,
        "cutoffs": {"stalenessMs": 5000, "maxQueue": 8},
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1000, "halfOpenProbes": 1, "agentErrorRate": 0},
        "bigRequestHold": {"maxHoldMs": 1000, "maxHeld": 1},
        "admission": admission
    }))
}

/// Admission as both data paths run it here: [`limiter`], and a held standard request
/// waiting 1 s.
fn route_admission() -> Value {
    let mut admission = limiter();
    admission["saturation"] =
        json!({"softThreshold": 0.85, "maxWaitStandardMs": 1000, "retryAfterSeconds": 1});
    admission
}

/// Admission's token limiter: the tenant and the priority from trusted headers (the priority
/// header is read only when trusted), a tenant whose bucket admits nothing, one reserved
/// output token by default.
fn limiter() -> Value {
    json!({
        "tenantKey": ["header:x-tenant-id"],
        "trustedHeaders": ["x-tenant-id", "x-ai-lb-priority"],
        "tenants": {
            "default": {"tokensPerSecond": 1_000_000, "burst": 1_000_000},
            "tiny": {"tokensPerSecond": 1, "burst": 1}
        },
        "cost": {"defaultOutputTokens": 1}
    })
}

/// Admission without saturation: usage settled (a response without `max_tokens`, charged past
/// its one reserved output token), a stream without usage (kept), a malformed body (400), a
/// body costed by its length, an unknown priority, a tenant whose bucket is too small (429).
fn admission(envoy: &Envoy) {
    assert_eq!(post(envoy, &[], r#"{"prompt":"abc abc abc"}"#), 200);
    let stream = json!({"prompt": "hello there", "max_tokens": 4, "stream": true}).to_string();
    assert_eq!(post(envoy, &[], &stream), 200);
    assert_eq!(post(envoy, &[], "{\"prompt\": "), 400);
    let r = HttpClient::new(envoy.listener)
        .request(
            "POST",
            "/v1/completions",
            &[("content-type", "text/plain"), ("connection", "close")],
            b"hello there",
        )
        .unwrap();
    assert_ne!(r.status, 429, "{}", r.text());
    assert_eq!(
        post(envoy, &[("x-ai-lb-priority", "urgent-please")], &body(2, 4)),
        200
    );
    assert_eq!(post(envoy, &[("x-tenant-id", "tiny")], &body(2, 4)), 429);
}

/// Big requests (3 000 prompt tokens: over a quarter of a pod's KV cache and four times the
/// mean) while both pods report a queue: one whose client leaves while held, one held until
/// `maxHoldMs` while a third finds the queue full, one released when the queues clear.
fn big_hold(envoy: &Envoy, pool: &PodPool) {
    let w = DataPath::Wasm;
    let big = || body(3000, 10);
    for i in 0..2 {
        pool.control(i, r#"{"queue":2}"#).unwrap();
    }
    wait_scoreboard(envoy, "both pods queued", 10, |sb| {
        pool.pod_addrs
            .iter()
            .all(|a| row(sb, &a.to_string()).is_some_and(|r| r["queued"] == true))
    });
    let left = send(envoy.listener, &[], big(), Duration::from_millis(300));
    assert_eq!(left.join().unwrap(), 0, "answered while it should be held");
    wait_for(envoy, w, "ailb.big_hold.left", 1);
    let expires = send(envoy.listener, &[], big(), Duration::from_secs(20));
    wait_for(envoy, w, "ailb.big_hold.held", 2);
    assert_eq!(
        post(envoy, &[], &big()),
        200,
        "routed at once: the hold is full"
    );
    wait_for(envoy, w, "ailb.big_hold.full", 1);
    assert_eq!(expires.join().unwrap(), 200);
    wait_for(envoy, w, "ailb.big_hold.expired", 1);
    let released = send(envoy.listener, &[], big(), Duration::from_secs(20));
    wait_for(envoy, w, "ailb.big_hold.held", 3);
    for i in 0..2 {
        pool.control(i, r#"{"queue":0}"#).unwrap();
    }
    assert_eq!(released.join().unwrap(), 200);
    wait_for(envoy, w, "ailb.big_hold.released", 1);
}

/// Both pods over the GPU hard limit (saturated): a sheddable request shed (429), a critical
/// one let through (fail-open), a standard one held until its 503, another released when pod 1
/// cools.
fn saturation(envoy: &Envoy, pool: &PodPool, w: DataPath) {
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.97}"#).unwrap();
    }
    wait_scoreboard(envoy, "both pods cut (saturated)", 10, |sb| {
        pool.pod_addrs
            .iter()
            .all(|a| row(sb, &a.to_string()).is_some_and(|r| r["cut"] == "gpu_hard_limit"))
    });
    let class = |c: &'static str| [("x-ai-lb-priority", c)];
    assert_eq!(post(envoy, &class("sheddable"), &body(2, 4)), 429);
    assert_eq!(post(envoy, &class("critical"), &body(2, 4)), 200);
    assert_eq!(post(envoy, &class("standard"), &body(2, 4)), 503);
    let held = stat(envoy, w, "ailb.admission.held");
    let waiter = send(
        envoy.listener,
        &class("standard"),
        body(2, 4),
        Duration::from_secs(20),
    );
    wait_for(envoy, w, "ailb.admission.held", held + 1);
    pool.control(1, r#"{"sm_occupancy":0.3}"#).unwrap();
    assert_eq!(waiter.join().unwrap(), 200);
    pool.control(0, r#"{"sm_occupancy":0.3}"#).unwrap();
}

/// Guard mode on `w` in front of `inference`, watching `agents`; signals older than 1 s stale.
fn guard_opts(w: DataPath, inference: SocketAddr, agents: &[SocketAddr]) -> EnvoyOptions {
    let cfg = json!({
        "mode": "guard",
        "pools": [{"name": "local", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "watch": {"refreshMs": 20, "minIntervalMs": 50, "heartbeatMs": 300, "reconnectBaseMs": 100, "reconnectMaxMs": 1000},
        "admission": {"guard": {"gpuUtilCutoff": 0.9, "maxStalenessMs": 1000}}
    })
    .to_string();
    let mut opts = match w {
        DataPath::Wasm => EnvoyOptions::new(cfg),
        DataPath::Native => {
            let mut o = EnvoyOptions::new(envoy::native_filter_config(&cfg, agents).unwrap());
            o.template = Some(envoy::native_template().unwrap());
            o
        }
    };
    opts.inference = vec![inference];
    opts.agents = agents.to_vec();
    opts
}

/// The guard of one pod: queue full, GPU saturated, admitted, then its agent stopped (stale
/// signals admit); and a guard with no agent at all (missing signals admit).
fn run_guard(pool: &mut PodPool, w: DataPath) -> (Envoy, Envoy) {
    let g = Envoy::start(&guard_opts(w, pool.pod_addrs[0], &[pool.agent_addrs[0]])).unwrap();
    let until = |status: u16, what: &str| {
        g.poll(Duration::from_secs(15), what, || {
            (post(&g, &[], &body(2, 4)) == status).then_some(())
        })
        .unwrap();
    };
    pool.control(0, r#"{"queue":8}"#).unwrap();
    until(503, "the guard rejects a full queue");
    pool.control(0, r#"{"queue":1,"sm_occupancy":0.97}"#)
        .unwrap();
    g.poll(
        Duration::from_secs(15),
        "the guard rejects a saturated GPU",
        || {
            post(&g, &[], &body(2, 4));
            (stat(&g, w, "ailb.guard.rejected.gpu_saturated") > 0).then_some(())
        },
    )
    .unwrap();
    pool.control(0, r#"{"queue":0,"sm_occupancy":0.3}"#)
        .unwrap();
    until(200, "the guard admits a cool pod");
    let agent = pool.agents[0].as_mut().unwrap();
    agent.signal("STOP").unwrap();
    let stale = g.poll(Duration::from_secs(15), "stale signals admit", || {
        post(&g, &[], &body(2, 4));
        (stat(&g, w, "ailb.guard.fail_open.stale") > 0).then_some(())
    });
    agent.signal("CONT").unwrap();
    stale.unwrap();

    // No agent: the wasm filter's agent cluster has no endpoint; the native module's agent
    // address has nothing listening (it needs one address per pool).
    let nobody: Vec<SocketAddr> = match w {
        DataPath::Wasm => Vec::new(),
        DataPath::Native => vec![closed_port()],
    };
    let lone = Envoy::start(&guard_opts(w, pool.pod_addrs[0], &nobody)).unwrap();
    assert_eq!(post(&lone, &[], &body(2, 4)), 200);
    wait_for(&lone, w, "ailb.guard.fail_open.missing", 1);
    (g, lone)
}

fn wait_fresh(envoy: &Envoy, pool: &PodPool) {
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    wait_scoreboard(envoy, "every pod fresh with a KV reading", 30, |sb| {
        all_fresh(sb, pool)
            && addrs
                .iter()
                .all(|a| row(sb, a).is_some_and(|r| r["kv"].is_number()))
    });
}

#[test]
fn every_exported_stat_is_documented_and_every_documented_stat_is_exported() {
    let docs = documented();

    // The wasm filter: route mode with admission and the big-request hold, one worker (the
    // hold learns the mean request per worker; admission holds per worker).
    let mut pool = pool();
    let mut opts = EnvoyOptions::new(route_config());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    opts.concurrency = 1;
    let route = Envoy::start(&opts).unwrap();
    wait_fresh(&route, &pool);
    routing(&route, &pool, DataPath::Wasm);
    admission(&route);
    big_hold(&route, &pool);
    saturation(&route, &pool, DataPath::Wasm);
    let (guard, lone) = run_guard(&mut pool, DataPath::Wasm);
    Expect::of(DataPath::Wasm).check(&docs, &[&route, &guard, &lone]);
    assert!(
        !route.wasm_failed() && !guard.wasm_failed() && !lone.wasm_failed(),
        "wasm trapped:\n{}",
        route.log_tail(40)
    );
    drop((route, guard, lone));

    // The native module: admission and the big-request hold, then guard mode.
    let filter = config(json!({
        "modelHeader": MODEL_HEADER,
        "maxBodyReadBytes": 65536,
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1000, "halfOpenProbes": 1, "agentErrorRate": 0},
        "bigRequestHold": {"maxHoldMs": 1000, "maxHeld": 1},
        "admission": route_admission()
    }));
    let mut opts =
        EnvoyOptions::new(envoy::native_filter_config(&filter, &pool.agent_addrs).unwrap());
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    let native = Envoy::start(&opts).unwrap();
    wait_fresh(&native, &pool);
    routing(&native, &pool, DataPath::Native);
    admission(&native);
    saturation(&native, &pool, DataPath::Native);
    // Per-pod picks and failures are added once a second per worker, on a request.
    native
        .poll(Duration::from_secs(5), "per-pod failures exported", || {
            post(&native, &[(MODEL_HEADER, "no-such-model")], &body(2, 4));
            exported(&native, DataPath::Native)
                .iter()
                .any(|s| s.moved && s.name.ends_with(".failures"))
                .then_some(())
        })
        .unwrap();
    let (native_guard, native_lone) = run_guard(&mut pool, DataPath::Native);
    Expect::of(DataPath::Native).check(&docs, &[&native, &native_guard, &native_lone]);
}

#[test]
fn patterns_expand_and_match() {
    assert_eq!(expand("a.{b,c}.d"), ["a.b.d", "a.c.d"]);
    assert_eq!(expand("a.{b,c}.{d,e}").len(), 4);
    assert!(matches(
        "ailb.endpoint.<ip:port>.picks",
        "ailb.endpoint.127.0.0.1:8000.picks"
    ));
    assert!(!matches(
        "ailb.endpoint.<ip:port>.picks",
        "ailb.endpoint..picks"
    ));
    assert!(matches(
        "ailb.admission.tenant.<tenant>.<class>.admitted",
        "ailb.admission.tenant.team.a.standard.admitted"
    ));
    assert!(!matches("ailb.steered", "ailb.steered_x"));
    assert_eq!(
        normalise(
            DataPath::Native,
            "dynamicmodulescustom.ailb.endpoint.picks.ailb_endpoint.10.0.0.1:80"
        )
        .as_deref(),
        Some("ailb.endpoint.10.0.0.1:80.picks")
    );
    assert_eq!(
        normalise(
            DataPath::Native,
            "dynamicmodulescustom.ailb.admission.tenant.admitted.ailb_tenant.a.b.ailb_class.standard"
        )
        .as_deref(),
        Some("ailb.admission.tenant.a.b.standard.admitted")
    );
    assert_eq!(
        normalise(DataPath::Wasm, "cluster.inference.upstream_rq"),
        None
    );
}

/// An address on this host where nothing listens (a port bound, then released).
fn closed_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}
