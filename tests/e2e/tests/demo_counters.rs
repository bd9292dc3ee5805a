//! Decides whether the demo's counts add up, on both data paths (issue 31: the end-of-run
//! summary said `steered: 519` while the live table said 861, and `breaker.closed: 0` after a
//! breaker had opened and closed, because the summary read the status page, which answers from
//! one Envoy worker's counters). A short demo-like run (the demo's pods, agents, filter config
//! and load generator, through `ai_lb_e2e::demo`, the functions the demo binary uses) with one
//! pod made to fail until its breaker opens, then healed until it closes; after the traffic
//! stops and the counters settle, the summary's steered total must equal the per-pod counts of
//! the live table added up and Envoy's `ailb.steered` (read here from `/stats` under names
//! written out by hand), and the summary's breaker opens and closes (at least one each) must
//! equal Envoy's. The run is only a test if the status page would have given other numbers:
//! it checks that at least two workers steered requests, each fewer than all of them.
//! Needs the wasm filter and the native module built (scripts/test.sh builds both).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ai_lb_e2e::demo::{self, Counts, DataPath, Shares, Summary};
use ai_lb_e2e::envoy::{self, Envoy, HttpClient, PodPool};
use serde_json::Value;

const STATUS_PATH: &str = "/ai-lb/status";
/// The pod made to fail (an H100-like one, as in the demo's timeline).
const BAD: usize = 2;

/// The demo's filter config, with a 1 s breaker cooldown so that the healed pod's breaker
/// closes within the run.
fn demo_config() -> String {
    let text =
        std::fs::read_to_string(envoy::workspace_root().join("envoy-config/filter-config.json"))
            .unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["statusPath"], STATUS_PATH, "the demo's status path moved");
    v["breaker"]["baseCooldownMs"] = 1000.into();
    v.to_string()
}

/// Envoy's stat `name` from `/stats` (text), 0 when absent.
fn stat(all: &BTreeMap<String, u64>, name: &str) -> u64 {
    all.get(name).copied().unwrap_or(0)
}

/// The sum of every stat whose name starts with `head`.
fn family(all: &BTreeMap<String, u64>, head: &str) -> u64 {
    all.iter()
        .filter(|(k, _)| k.starts_with(head))
        .map(|(_, v)| v)
        .sum()
}

/// Pod `addr`'s pick counter as each data path names it in `/stats`, written out here rather
/// than taken from the code under test.
fn picks_name(path: DataPath, addr: &str) -> String {
    match path {
        DataPath::Wasm => format!("wasmcustom.ailb.endpoint.{addr}.picks"),
        DataPath::Native => {
            format!("dynamicmodulescustom.ailb.endpoint.picks.ailb_endpoint.{addr}")
        }
    }
}

fn prefix(path: DataPath) -> &'static str {
    match path {
        DataPath::Wasm => "wasmcustom.ailb.",
        DataPath::Native => "dynamicmodulescustom.ailb.",
    }
}

/// The status page on a connection of its own (any worker may answer).
fn status_page(envoy: &Envoy) -> Value {
    let r = HttpClient::new(envoy.listener)
        .get(STATUS_PATH, &[("connection", "close")])
        .unwrap();
    assert_eq!(r.status, 200, "status page: {}", r.text());
    serde_json::from_slice(&r.body).unwrap()
}

/// Each worker's own `steered` counter, from status pages on fresh connections (the kernel
/// spreads them over the workers).
fn steered_per_worker(envoy: &Envoy, workers: u32) -> BTreeMap<u64, u64> {
    let mut seen = BTreeMap::new();
    let got = envoy.poll(
        Duration::from_secs(10),
        "a status page from every worker",
        || {
            let sb = status_page(envoy);
            if let (Some(w), Some(s)) = (sb["worker"].as_u64(), sb["counters"]["steered"].as_u64())
            {
                seen.insert(w, s);
            }
            (seen.len() >= workers as usize).then_some(())
        },
    );
    got.unwrap_or_else(|e| panic!("{e}: seen {seen:?}"));
    seen
}

/// Kills the load generator when the test ends, however it ends.
struct Loadgen(std::process::Child);

impl Drop for Loadgen {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn counts_add_up(path: DataPath) {
    let test = format!("demo_counters ({path:?})");
    let module = match path {
        DataPath::Wasm => envoy::wasm_path(),
        DataPath::Native => envoy::native_module_path(),
    };
    if ai_lb_e2e::require::or_skip(&test, "the filter module", module).is_none() {
        return;
    }
    let pool = PodPool::start_with_kv_events(4, 0.1, |i| {
        let preset = if i % 2 == 0 { "h100-8b" } else { "a100-8b" };
        vec!["--preset".to_string(), preset.to_string()]
    })
    .unwrap();
    let (opts, notes) =
        demo::envoy_options(path, &demo_config(), &pool.pod_addrs, &pool.agent_addrs).unwrap();
    assert!(
        notes.is_empty(),
        "the demo config needs nothing dropped: {notes:?}"
    );
    let workers = opts.concurrency;
    assert!(workers >= 2, "one worker cannot show the bug");
    let envoy = Envoy::start(&opts).unwrap();
    let pods: &[SocketAddr] = &pool.pod_addrs;
    envoy
        .poll(Duration::from_secs(30), "metrics for every pod", || {
            let sb = status_page(&envoy);
            let fresh = sb["pools"][0]["pods"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["metricsAgeMs"].as_u64().is_some_and(|a| a < 2000))
                .count();
            (fresh == pods.len()).then_some(())
        })
        .unwrap();
    let start = Counts::read(&envoy, path, pods).unwrap();
    assert_eq!(start.steered, 0, "steered before the traffic: {start:?}");

    let results = envoy::scratch_dir("demo-counters")
        .unwrap()
        .join("loadgen.json");
    // Long enough for the breaker to open and close; stopped below once it has. The demo's
    // `sharegpt` workload: every prompt its own, so new prefixes reach every pod. (Under
    // `shared-prefix` the few prefixes stay with the pods caching them, and a healed pod can
    // wait half-open for a probe far longer than this test should.)
    let mut loadgen =
        Loadgen(demo::spawn_loadgen(envoy.listener, 30.0, 120, "sharegpt", &results).unwrap());
    let t0 = Instant::now();
    let p = prefix(path);
    let opened_name = format!("{p}breaker_opened.");
    let closed_name = format!("{p}breaker_closed");
    let wait_for = |what: &str, ok: &dyn Fn(&BTreeMap<String, u64>) -> bool| {
        let mut last = BTreeMap::new();
        let got = envoy.poll(Duration::from_secs(40), what, || {
            last = envoy.stats().unwrap_or_default();
            ok(&last).then_some(())
        });
        got.unwrap_or_else(|e| {
            panic!(
                "{e}: {:?}",
                last.iter()
                    .filter(|(k, _)| k.starts_with(p))
                    .collect::<Vec<_>>()
            )
        });
    };
    wait_for("traffic steered", &|s| stat(s, &format!("{p}steered")) > 0);
    pool.control(BAD, r#"{"error_rate":1.0}"#).unwrap();
    wait_for("the failing pod's breaker opened", &|s| {
        family(s, &opened_name) >= 1
    });
    pool.control(BAD, r#"{"reset":true}"#).unwrap();
    wait_for("the healed pod's breaker closed", &|s| {
        stat(s, &closed_name) >= 1
    });
    // A few seconds of traffic in all, then stop it: the counts are compared at rest.
    while t0.elapsed() < Duration::from_secs(4) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        loadgen.0.try_wait().unwrap().is_none(),
        "the load generator stopped early"
    );
    drop(loadgen);

    let summary = Summary::after_traffic(
        &envoy,
        path,
        pods,
        STATUS_PATH,
        &start,
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(summary.settled, "the counts did not settle: {summary:?}");
    // The live table at the end: the share columns over the whole run.
    let now = Counts::read(&envoy, path, pods).unwrap();
    let table = Shares::new(&now, &now, &start);
    // Envoy's own numbers, under names written out here.
    let stats = envoy.stats().unwrap();
    let steered = stat(&stats, &format!("{p}steered"));
    let per_pod: BTreeMap<String, u64> = pods
        .iter()
        .map(|a| {
            (
                a.to_string(),
                stat(&stats, &picks_name(path, &a.to_string())),
            )
        })
        .collect();
    let opened = family(&stats, &opened_name);
    let closed = stat(&stats, &closed_name);
    let lines = summary.lines(|a| pool.name_of(a).unwrap_or(a).to_string());
    eprintln!(
        "{path:?}: Envoy steered {steered}, per pod {per_pod:?}, opened {opened}, closed {closed}; \
         summary:\n  {}",
        lines.join("\n  ")
    );

    assert_eq!(
        (
            stat(&stats, &format!("{p}fail_open")),
            stat(&stats, &format!("{p}steer_failed"))
        ),
        (0, 0),
        "every steered request should have been picked for one pod"
    );
    assert!(steered >= 30, "too little traffic to tell: {steered}");
    assert_eq!(
        summary.counts.steered, steered,
        "the summary's steered total is not Envoy's {p}steered"
    );
    let table_total: u64 = table.per_pod.values().map(|(_, total)| total).sum();
    assert_eq!(
        (table.sum_total, table_total),
        (steered, steered),
        "the table's per-pod counts ({:?}) do not add up to the requests steered",
        table.per_pod
    );
    let table_pods: BTreeMap<String, u64> = table
        .per_pod
        .iter()
        .map(|(a, (_, total))| (a.clone(), *total))
        .collect();
    assert_eq!(
        table_pods, per_pod,
        "the table's per-pod counts are not Envoy's"
    );
    assert_eq!(
        summary.counts.picks, per_pod,
        "the summary's per-pod counts are not Envoy's"
    );
    assert!(
        opened >= 1 && closed >= 1,
        "opened {opened}, closed {closed}"
    );
    assert_eq!(
        (summary.counts.opened_total(), summary.counts.closed),
        (opened, closed),
        "the summary's breaker transitions are not Envoy's"
    );
    assert!(
        lines[0].starts_with(&format!("steered by ai-lb: {steered} requests"))
            && lines
                .iter()
                .any(|l| l.starts_with(&format!("breakers: opened {opened}"))
                    && l.ends_with(&format!("closed {closed}"))),
        "the printed summary: {lines:#?}"
    );

    // One worker's counters (the status page's) are not the total: both workers steered.
    let by_worker = steered_per_worker(&envoy, workers);
    eprintln!("{path:?}: steered per worker (status page) {by_worker:?}");
    assert!(
        by_worker.values().all(|s| *s > 0 && *s < steered),
        "a status page alone would have shown the total ({by_worker:?} of {steered}): the test \
         cannot tell per-worker counts from Envoy's"
    );
    assert_eq!(by_worker.values().sum::<u64>(), steered);
}

#[test]
fn the_wasm_demo_summary_adds_up_to_envoys_stats() {
    counts_add_up(DataPath::Wasm);
}

#[test]
fn the_native_demo_summary_adds_up_to_envoys_stats() {
    counts_add_up(DataPath::Native);
}
