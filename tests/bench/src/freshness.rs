//! Decides how fresh the filter's view of the pool is, and what freshness buys: for each point
//! of the sweep (the shipped agent defaults first, then every agent sample interval of
//! [`SWEEP_MS`] with the GPU sample at the same interval), a fresh pool with its agents so
//! configured, then
//! - reaction: with no traffic, pod 0 gets one of two changes, measured separately with the same
//!   number of toggles: GPU (forced to 99 %, over the filter's 0.95 hard limit; read by the
//!   agent at its GPU sample interval) and queue (`vllm:num_requests_waiting` forced to the
//!   filter's `cutoffs.maxQueue`, 64 by default; read at the model-server scrape, the sample
//!   interval). Every ai-lb sidecar's status page is polled until it shows the pod cut for that
//!   reason (`gpu_hard_limit`, `queue_full`); the time from the change call to that view, per
//!   sidecar and toggle, is the "change → routing change" latency (every decision after it
//!   avoids the pod). The change is then reset and the next toggle waits until every sidecar
//!   sees the pod back (readmitted). Before each change the run sleeps a delay drawn uniformly
//!   from [0, sample interval) (splitmix64 seeded from `--seed` and the point): started right
//!   after the previous readmission, toggles would be phase-locked to the agents' sample clock
//!   and the latency biased;
//! - routing quality: ai-lb on the sharegpt-poisson-80 trace, against least_request on the same
//!   trace in the same run (measured once, on the first point's pool: least_request does not
//!   read the agents);
//! - under load: during a second least_request replay on the first point's pool (not the
//!   baseline: the watchers' 1 ms status polling loads the machine), a thread measures the same
//!   reaction (both changes, same toggles) through its own ai-lb sidecars that carry no traffic. The
//!   forced values do not move least_request's routing (nor the pods' serving: the fake pod only
//!   reports them), while the pods and agents are genuinely loaded, so the agents' push
//!   coalescing is exercised.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use ai_lb_e2e::envoy::{self, Envoy};

use crate::analysis::{self, Pcts};
use crate::scenario::{self, Env};
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// The sweep of agent sample intervals, ms (the issue asks for 10 ms to 5 s); the GPU sample
/// follows the same interval at each point.
pub const SWEEP_MS: [u64; 6] = [10, 50, 100, 500, 1000, 5000];

/// The agent's default `--sample-interval`, ms.
pub const DEFAULT_SAMPLE_MS: u64 = 50;
/// The agent's default `--gpu-sample-interval` cap, ms (the default is min(this, sample)).
pub const DEFAULT_GPU_SAMPLE_MS: u64 = 20;

/// The filter's `cutoffs.maxQueue` default (filter/core/src/config.rs), when the filter config
/// in use does not set it.
const DEFAULT_MAX_QUEUE: u64 = 64;

/// One point of the sweep: how the agents sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    pub sample_interval_ms: u64,
    /// None: the agent's default (the flag is not passed).
    pub gpu_sample_interval_ms: Option<u64>,
}

impl Point {
    /// The shipped agent defaults.
    pub const DEFAULTS: Point = Point {
        sample_interval_ms: DEFAULT_SAMPLE_MS,
        gpu_sample_interval_ms: None,
    };

    /// Both samples at `ms`.
    pub fn both(ms: u64) -> Point {
        Point {
            sample_interval_ms: ms,
            gpu_sample_interval_ms: Some(ms),
        }
    }

    /// The GPU sample interval the agent runs at, ms.
    pub fn gpu_ms(self) -> u64 {
        self.gpu_sample_interval_ms
            .unwrap_or(DEFAULT_GPU_SAMPLE_MS.min(self.sample_interval_ms))
    }

    /// The table's name for the point.
    pub fn label(self) -> String {
        let s = self.sample_interval_ms;
        match self.gpu_sample_interval_ms {
            None if self == Point::DEFAULTS => {
                format!("{s} ms, GPU {} ms (defaults)", self.gpu_ms())
            }
            None => format!("{s} ms, GPU {} ms (agent default)", self.gpu_ms()),
            Some(g) if g == s => format!("{s} ms"),
            Some(g) => format!("{s} ms, GPU {g} ms"),
        }
    }

    /// Its work-dir name.
    fn dir(self) -> String {
        match self.gpu_sample_interval_ms {
            None => format!("{}ms-gpu-default", self.sample_interval_ms),
            Some(g) => format!("{}ms-gpu{g}ms", self.sample_interval_ms),
        }
    }
}

/// The full sweep in run order: the defaults first (its pool also carries the least_request
/// baseline and the under-load reaction), then [`SWEEP_MS`] with both samples together.
pub fn sweep() -> Vec<Point> {
    std::iter::once(Point::DEFAULTS)
        .chain(SWEEP_MS.iter().map(|&ms| Point::both(ms)))
        .collect()
}

/// splitmix64: the random phase before each change (no RNG crate in this package).
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, `ms`) ms.
    fn delay(&mut self, ms: u64) -> Duration {
        Duration::from_secs_f64(self.next_f64() * ms as f64 / 1000.0)
    }
}

/// The RNG of one reaction run: `seed`, the point and whether it runs under load.
fn rng_for(seed: u64, point: Point, under_load: bool) -> SplitMix64 {
    let mut r = SplitMix64(seed);
    let salt = point
        .sample_interval_ms
        .wrapping_mul(1_000_003)
        .wrapping_add(point.gpu_sample_interval_ms.map_or(0, |g| g + 1))
        .wrapping_mul(2)
        .wrapping_add(u64::from(under_load));
    SplitMix64(r.next_u64() ^ salt)
}

/// A change forced on pod 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Gpu,
    /// Waiting requests forced to this.
    Queue(u64),
}

impl Change {
    fn key(self) -> &'static str {
        match self {
            Change::Gpu => "gpu",
            Change::Queue(_) => "queue",
        }
    }

    fn body(self) -> String {
        match self {
            Change::Gpu => r#"{"sm_occupancy":0.99}"#.into(),
            Change::Queue(n) => format!(r#"{{"queue":{n}}}"#),
        }
    }

    /// The cut reason the status page shows for it.
    fn reason(self) -> &'static str {
        match self {
            Change::Gpu => "gpu_hard_limit",
            Change::Queue(_) => "queue_full",
        }
    }
}

/// The filter's `cutoffs.maxQueue` in the config the sidecars load.
fn max_queue() -> Result<u64, Error> {
    let text = topology::ailb_filter_config()?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| format!("parsing the filter config: {e}"))?;
    Ok(v["cutoffs"]["maxQueue"]
        .as_u64()
        .unwrap_or(DEFAULT_MAX_QUEUE))
}

/// What a reaction run needs of the pool; owns no part of it, so a thread can run it while the
/// pool replays a trace.
#[derive(Debug, Clone)]
struct Target {
    pods: Vec<SocketAddr>,
    agents: Vec<SocketAddr>,
    /// Pod 0, the one changed.
    addr: SocketAddr,
    name: String,
}

impl Target {
    fn of(pool: &Pool) -> Result<Target, Error> {
        let pod = pool.pods.first().ok_or("the pool has no pod")?;
        Ok(Target {
            pods: pool.addrs(),
            agents: pool.agent_addrs(),
            addr: pod.addr,
            name: pod.name.clone(),
        })
    }

    fn control(&self, json: &str) -> Result<(), Error> {
        topology::control(self.addr, &self.name, json)
    }

    /// Requests running over the pool (what the queue change does not force).
    fn running(&self) -> Result<f64, Error> {
        let mut total = 0.0;
        for a in &self.pods {
            let text = envoy::http_get(*a, "/metrics")?.text();
            total += topology::gauge(&text, "vllm:num_requests_running");
        }
        Ok(total)
    }
}

/// `n` ai-lb sidecars on `t`'s pool, and whether each listed every pod in time.
fn start_watchers(t: &Target, n: usize) -> Result<(Vec<Envoy>, bool), Error> {
    let mut sidecars = Vec::new();
    for _ in 0..n {
        sidecars.push(topology::start_sidecar(
            Policy::AiLb,
            &t.pods,
            &t.agents,
            1,
        )?);
    }
    let ready = sidecars
        .iter()
        .all(|s| topology::wait_ailb_ready(s, &t.pods, Duration::from_secs(15)));
    Ok((sidecars, ready))
}

/// `sidecar`'s view of the pod at `addr`: Some(cut reason, None when in rotation); None when
/// it did not answer or does not list the pod.
fn view(sidecar: &Envoy, addr: &str) -> Option<Option<String>> {
    let r = envoy::http_get(sidecar.listener, "/ai-lb/status").ok()?;
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    let pods = v["pools"][0]["pods"].as_array()?;
    let pod = pods.iter().find(|p| p["address"].as_str() == Some(addr))?;
    Some(pod["cut"].as_str().map(str::to_string))
}

/// Polls the sidecars not `skip`ped until each shows `want` (a cut reason, or None: in
/// rotation) for `addr`; returns each one's wait since `t0`, ms (None for a sidecar that did not
/// within `deadline`, or was skipped).
fn wait_view(
    sidecars: &[Envoy],
    skip: &[bool],
    addr: &str,
    want: Option<&str>,
    t0: Instant,
    deadline: Duration,
) -> Vec<Option<f64>> {
    let mut seen: Vec<Option<f64>> = vec![None; sidecars.len()];
    let pending = |seen: &[Option<f64>]| {
        seen.iter()
            .zip(skip)
            .any(|(s, &skipped)| s.is_none() && !skipped)
    };
    while pending(&seen) && t0.elapsed() < deadline {
        for ((s, slot), &skipped) in sidecars.iter().zip(seen.iter_mut()).zip(skip) {
            if !skipped && slot.is_none() && view(s, addr).is_some_and(|v| v.as_deref() == want) {
                *slot = Some(t0.elapsed().as_secs_f64() * 1000.0);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    seen
}

/// Latencies of one change.
#[derive(Debug, Default)]
struct Tally {
    cut_ms: Vec<f64>,
    back_ms: Vec<f64>,
    missed: usize,
    /// Sidecar views that already showed the cut when the change was made (left out).
    already_cut: usize,
    /// Changes made while requests were running on the pool (under load only).
    with_running: usize,
}

impl Tally {
    fn json(self, change: Change) -> Value {
        json!({
            "change": change.body().parse::<Value>().unwrap_or(Value::Null),
            "cut_reason": change.reason(),
            "cut_ms": Pcts::of(self.cut_ms),
            "readmitted_ms": Pcts::of(self.back_ms),
            "not_seen_within_deadline": self.missed,
            "already_cut_at_change": self.already_cut,
        })
    }
}

/// Change → routing-change latencies of both changes over `toggles` each (alternating), seen
/// through `sidecars`; `under_load` also counts the changes made while the pool ran requests.
#[allow(clippy::too_many_arguments)]
fn reaction(
    sidecars: &[Envoy],
    ready: bool,
    t: &Target,
    point: Point,
    toggles: usize,
    queue_n: u64,
    mut rng: SplitMix64,
    under_load: bool,
) -> Result<Value, Error> {
    let addr = t.addr.to_string();
    let interval_ms = point.sample_interval_ms.max(point.gpu_ms());
    // Generous: a few sample intervals plus the heartbeat and the filter's refresh.
    let deadline = Duration::from_millis(interval_ms * 4 + 5_000);
    let changes = [Change::Gpu, Change::Queue(queue_n)];
    let mut tallies: Vec<Tally> = changes.iter().map(|_| Tally::default()).collect();
    for _ in 0..toggles {
        for (&change, tally) in changes.iter().zip(tallies.iter_mut()) {
            // Random phase against the agents' sample clocks.
            std::thread::sleep(rng.delay(interval_ms));
            if under_load && t.running()? > 0.0 {
                tally.with_running += 1;
            }
            let skip: Vec<bool> = sidecars
                .iter()
                .map(|s| view(s, &addr).flatten().as_deref() == Some(change.reason()))
                .collect();
            tally.already_cut += skip.iter().filter(|&&b| b).count();
            let t0 = Instant::now();
            t.control(&change.body())?;
            let cut = wait_view(sidecars, &skip, &addr, Some(change.reason()), t0, deadline);
            let t1 = Instant::now();
            t.control(r#"{"reset":true}"#)?;
            let none = vec![false; sidecars.len()];
            let back = wait_view(sidecars, &none, &addr, None, t1, deadline);
            for (c, &skipped) in cut.iter().zip(&skip) {
                match c {
                    Some(ms) => tally.cut_ms.push(*ms),
                    None if !skipped => tally.missed += 1,
                    None => {}
                }
            }
            for b in back {
                match b {
                    Some(ms) => tally.back_ms.push(ms),
                    None => tally.missed += 1,
                }
            }
        }
    }
    let with_running: Vec<usize> = tallies.iter().map(|t| t.with_running).collect();
    let mut v = json!({
        "ailb_ready": ready,
        "toggles": toggles,
        "sidecars": sidecars.len(),
        "deadline_ms": deadline.as_millis() as u64,
        "random_phase_ms": [0, interval_ms],
    });
    for (change, tally) in changes.into_iter().zip(tallies) {
        v[change.key()] = tally.json(change);
    }
    if under_load {
        v["changes_while_requests_ran"] = json!({
            "gpu": with_running.first(),
            "queue": with_running.get(1),
        });
    }
    Ok(v)
}

/// A least_request replay on `pool` (after the baseline's, and not used as one), with the
/// under-load reaction (its own `env.sidecars` ai-lb sidecars, started before the replay) on a
/// thread that waits until requests run, then toggles. Returns the replay's summary and the
/// reaction.
#[allow(clippy::too_many_arguments)]
fn replay_with_reaction(
    env: &Env,
    load: &scenario::Load,
    pool: &mut Pool,
    point: Point,
    toggles: usize,
    queue_n: u64,
    trace: &std::path::Path,
    dir: &std::path::Path,
) -> Result<(analysis::Summary, Value), Error> {
    let target = Target::of(pool)?;
    let (sidecars, ready) = start_watchers(&target, env.sidecars)?;
    let rng = rng_for(env.seed, point, true);
    let replay_done = AtomicBool::new(false);
    let (replay, react) = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            // Wait for the replay's first requests (or its end, e.g. when it failed).
            let end = Instant::now() + Duration::from_secs(120);
            loop {
                if target.running()? > 0.0 {
                    break;
                }
                if replay_done.load(Ordering::Relaxed) || Instant::now() > end {
                    return Err(
                        "under load: the least_request replay ended before requests ran"
                            .to_string(),
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            reaction(
                &sidecars, ready, &target, point, toggles, queue_n, rng, true,
            )
        });
        let replay = scenario::run_policy(Policy::LeastRequest, load, env, pool, trace, dir);
        replay_done.store(true, Ordering::Relaxed);
        let react = watcher
            .join()
            .unwrap_or_else(|_| Err("under load: the reaction thread panicked".to_string()));
        (replay, react)
    });
    drop(sidecars);
    let (_, r) = replay?;
    Ok((r.all, react?))
}

/// Runs the sweep over `points` (the first one also carries the least_request baseline and,
/// with `under_load`, a second least_request replay with the reaction under its traffic);
/// returns the summary (written by the caller).
pub fn freshness(
    env: &Env,
    shape: &PodShape,
    points: &[Point],
    toggles: usize,
    under_load: bool,
    cmd: &str,
) -> Result<Value, Error> {
    let load = scenario::parse_load("sharegpt-poisson-80")?;
    let dir = env.work.join("freshness");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let trace = dir.join("trace.jsonl");
    let rate = scenario::make_trace(&load, env, &trace)?;
    let queue_n = max_queue()?;
    let mut baseline: Option<analysis::Summary> = None;
    let mut loaded: Option<Value> = None;
    let mut out = Vec::new();
    for &point in points {
        eprintln!("[bench] freshness: agents sampling at {}", point.label());
        let mut shape = shape.clone();
        shape.sample_interval_ms = point.sample_interval_ms;
        shape.gpu_sample_interval_ms = point.gpu_sample_interval_ms;
        let mut pool = Pool::start(&shape, true)?;
        let pdir = dir.join(point.dir());
        std::fs::create_dir_all(&pdir).map_err(|e| e.to_string())?;
        if baseline.is_none() {
            let (_, r) =
                scenario::run_policy(Policy::LeastRequest, &load, env, &mut pool, &trace, &pdir)?;
            baseline = Some(r.all);
            if under_load {
                // A second least_request replay, not the baseline: the watchers' status polling
                // loads the machine, and must not slow the run every ratio is computed against.
                eprintln!("[bench] freshness: least_request replay with the reaction under load");
                let ldir = pdir.join("under-load");
                std::fs::create_dir_all(&ldir).map_err(|e| e.to_string())?;
                let (_, react) = replay_with_reaction(
                    env, &load, &mut pool, point, toggles, queue_n, &trace, &ldir,
                )?;
                loaded = Some(json!({
                    "label": format!(
                        "under load (least_request traffic at {:.0} %), {}",
                        load.load * 100.0,
                        if point == Point::DEFAULTS { "defaults".to_string() } else { point.label() }
                    ),
                    "sample_interval_ms": point.sample_interval_ms,
                    "gpu_sample_interval_ms": point.gpu_sample_interval_ms,
                    "traffic": Policy::LeastRequest.name(),
                    "reaction": react,
                }));
            }
        }
        let target = Target::of(&pool)?;
        let (sidecars, ready) = start_watchers(&target, env.sidecars)?;
        let react = reaction(
            &sidecars,
            ready,
            &target,
            point,
            toggles,
            queue_n,
            rng_for(env.seed, point, false),
            false,
        )?;
        drop(sidecars);
        let (_, r) = scenario::run_policy(Policy::AiLb, &load, env, &mut pool, &trace, &pdir)?;
        let ratios = baseline.as_ref().map(|b| analysis::ratios(&r.all, b));
        out.push(json!({
            "label": point.label(),
            "sample_interval_ms": point.sample_interval_ms,
            "gpu_sample_interval_ms": point.gpu_sample_interval_ms,
            "reaction": react,
            "ai_lb": r.all,
            "ailb_ready": r.ailb_ready,
            "over_least_request": ratios,
        }));
    }
    Ok(json!({
        "scenario": "freshness",
        "command": cmd,
        "trace": load.name,
        "rate_rps": rate,
        "capacity_rps": env.capacity_rps,
        "duration_s": env.duration_s,
        "client_timeout_s": env.timeout_s,
        "sidecars": env.sidecars,
        "seed": env.seed,
        "queue_forced": queue_n,
        "least_request": baseline,
        "under_load": loaded,
        "points": out,
    }))
}

fn f0(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.0}"))
}

fn f2(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.2}"))
}

/// `p50 / p99 / max (n)` of one change's cut latencies, with what was not seen.
fn cut_cell(c: &Value) -> String {
    let mut notes = Vec::new();
    if let Some(n) = c["not_seen_within_deadline"].as_u64().filter(|&n| n > 0) {
        notes.push(format!("{n} not seen"));
    }
    if let Some(n) = c["already_cut_at_change"].as_u64().filter(|&n| n > 0) {
        notes.push(format!("{n} already cut"));
    }
    format!(
        "{} / {} / {} ({}{})",
        f0(&c["cut_ms"]["p50"]),
        f0(&c["cut_ms"]["p99"]),
        f0(&c["cut_ms"]["max"]),
        c["cut_ms"]["count"],
        notes.iter().map(|n| format!(", {n}")).collect::<String>(),
    )
}

/// `gpu / queue` readmission p99.
fn back_cell(r: &Value) -> String {
    format!(
        "{} / {}",
        f0(&r["gpu"]["readmitted_ms"]["p99"]),
        f0(&r["queue"]["readmitted_ms"]["p99"])
    )
}

/// The markdown table of the sweep.
pub fn table(v: &Value) -> String {
    let mut t = format!(
        "### freshness (agent sample interval sweep; {} ai-lb sidecars; trace {} at {:.1} req/s, {} s, seed {})\n\n`{}`\n\n\
         Change → routing change: pod 0 forced to 99 % GPU (GPU) or {} waiting requests (queue), until every ai-lb sidecar \
         shows it cut; a random delay in [0, sample interval) precedes each change. \
         least_request on the same trace: TTFT p99 {} ms, e2e p99 {} ms.\n\n\
         | agent sample interval | GPU change → routing p50 / p99 / max, ms (n) | queue change → routing p50 / p99 / max, ms (n) | readmitted p99 GPU / queue, ms | ai_lb TTFT p50 / p99, ms | ai_lb e2e p99, ms | p99 TTFT / least_request | p99 e2e / least_request |\n\
         |---|---|---|---|---|---|---|---|\n",
        v["sidecars"],
        v["trace"].as_str().unwrap_or(""),
        v["rate_rps"].as_f64().unwrap_or(0.0),
        v["duration_s"],
        v["seed"],
        v["command"].as_str().unwrap_or(""),
        v["queue_forced"],
        f0(&v["least_request"]["ttft_ms"]["p99"]),
        f0(&v["least_request"]["e2e_ms"]["p99"]),
    );
    for p in v["points"].as_array().into_iter().flatten() {
        let r = &p["reaction"];
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} / {} | {} | {} | {} |\n",
            p["label"].as_str().unwrap_or(""),
            cut_cell(&r["gpu"]),
            cut_cell(&r["queue"]),
            back_cell(r),
            f0(&p["ai_lb"]["ttft_ms"]["p50"]),
            f0(&p["ai_lb"]["ttft_ms"]["p99"]),
            f0(&p["ai_lb"]["e2e_ms"]["p99"]),
            f2(&p["over_least_request"]["ttft_p99"]),
            f2(&p["over_least_request"]["e2e_p99"]),
        ));
    }
    let u = &v["under_load"];
    if u.is_object() {
        let r = &u["reaction"];
        t.push_str(&format!(
            "| {} | {} | {} | {} | – | – | – | – |\n",
            u["label"].as_str().unwrap_or(""),
            cut_cell(&r["gpu"]),
            cut_cell(&r["queue"]),
            back_cell(r),
        ));
        t.push_str(&format!(
            "\nUnder load: {} ai-lb sidecars without traffic watch the pool while least_request replays the trace; \
             changes made while requests ran: GPU {}, queue {} (of {} each).\n",
            r["sidecars"],
            r["changes_while_requests_ran"]["gpu"],
            r["changes_while_requests_ran"]["queue"],
            r["toggles"],
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_starts_with_the_defaults_and_moves_both_samples() {
        let s = sweep();
        assert_eq!(s[0], Point::DEFAULTS);
        assert_eq!(s[0].label(), "50 ms, GPU 20 ms (defaults)");
        assert_eq!(s.len(), SWEEP_MS.len() + 1);
        for (p, ms) in s[1..].iter().zip(SWEEP_MS) {
            assert_eq!(p.sample_interval_ms, ms);
            assert_eq!(p.gpu_sample_interval_ms, Some(ms));
            assert_eq!(p.label(), format!("{ms} ms"));
        }
        let short = Point {
            sample_interval_ms: 10,
            gpu_sample_interval_ms: None,
        };
        assert_eq!(short.gpu_ms(), 10);
        assert_ne!(short.dir(), Point::both(10).dir());
    }

    #[test]
    fn random_phase_is_seeded_and_within_the_interval() {
        let draw = |seed, under_load| {
            let mut r = rng_for(seed, Point::DEFAULTS, under_load);
            (0..200).map(|_| r.delay(100)).collect::<Vec<_>>()
        };
        let a = draw(42, false);
        assert_eq!(a, draw(42, false));
        assert_ne!(a, draw(43, false));
        assert_ne!(a, draw(42, true));
        assert!(a.iter().all(|d| *d < Duration::from_millis(100)));
        let mean = a.iter().map(Duration::as_secs_f64).sum::<f64>() / a.len() as f64;
        assert!((0.035..0.065).contains(&mean), "mean {mean}");
    }

    #[test]
    fn changes_name_their_cut() {
        assert_eq!(Change::Queue(64).body(), r#"{"queue":64}"#);
        assert_eq!(Change::Queue(64).reason(), "queue_full");
        assert_eq!(Change::Gpu.reason(), "gpu_hard_limit");
        let t = Tally {
            cut_ms: vec![10.0, 30.0],
            ..Tally::default()
        };
        let v = t.json(Change::Gpu);
        assert_eq!(v["change"]["sm_occupancy"], 0.99);
        assert_eq!(v["cut_ms"]["count"], 2);
    }

    #[test]
    fn table_shows_both_changes_and_the_loaded_row() {
        let kind = |p50: f64| {
            json!({
                "cut_ms": {"count": 8, "p50": p50, "p99": p50 * 2.0, "max": p50 * 3.0},
                "readmitted_ms": {"count": 8, "p50": 5.0, "p99": 7.0, "max": 9.0},
                "not_seen_within_deadline": 0,
                "already_cut_at_change": 1,
            })
        };
        let reaction = json!({"gpu": kind(11.0), "queue": kind(101.0), "toggles": 2, "sidecars": 4,
            "changes_while_requests_ran": {"gpu": 2, "queue": 1}});
        let v = json!({
            "sidecars": 4, "trace": "sharegpt-poisson-80", "rate_rps": 10.0, "duration_s": 60,
            "seed": 42, "command": "x", "queue_forced": 64,
            "least_request": {"ttft_ms": {"p99": 500.0}, "e2e_ms": {"p99": 900.0}},
            "points": [{
                "label": Point::DEFAULTS.label(), "reaction": reaction,
                "ai_lb": {"ttft_ms": {"p50": 50.0, "p99": 400.0}, "e2e_ms": {"p99": 800.0}},
                "over_least_request": {"ttft_p99": 0.8, "e2e_p99": 0.89},
            }],
            "under_load": {"label": "under load (least_request traffic at 80 %), defaults",
                "reaction": reaction},
        });
        let t = table(&v);
        assert!(
            t.contains("| 50 ms, GPU 20 ms (defaults) | 11 / 22 / 33 (8, 1 already cut) | 101 / 202 / 303 (8, 1 already cut) | 7 / 7 | 50 / 400 | 800 | 0.80 | 0.89 |"),
            "{t}"
        );
        assert!(t.contains("| under load (least_request traffic at 80 %), defaults | 11 / 22 / 33"));
        assert!(t.contains("GPU 2, queue 1 (of 2 each)"));
        assert_eq!(
            t.lines().filter(|l| l.starts_with('|')).count(),
            4,
            "header, rule, point, loaded"
        );
    }
}
