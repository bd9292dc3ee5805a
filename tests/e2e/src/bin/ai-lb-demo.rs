//! The local demo: a real Envoy 1.40 with the ai-lb filter in front of simulated GPU pods (two
//! H100-like, two A100-like), each with its collector agent, and open-loop traffic from the load
//! generator. Every second it prints where requests go (per-pod share), each pod's GPU, score,
//! cut reason and breaker state, read from the filter's status path. A scripted timeline makes
//! a pod hot, makes another fail, then heals both, so traffic visibly moves away and back.
//! The pods publish vLLM's KV-cache events and the agents push what each pod caches, so with the
//! default shared-prefix traffic (a few applications, each with its own long system prompt) the
//! table also shows each pod's cached prefix blocks, its hit rate, and how often the filter sent
//! a request to a pod holding its prefix.
//!
//! Run it through `scripts/demo.sh` (which installs and builds everything first), or directly:
//! `target/debug/ai-lb-demo [--duration SECS] [--rate REQ_PER_S] [--pods N] [--time-scale X]
//! [--workload shared-prefix|multi-turn|sharegpt]`.
//! `--duration 0` runs until Ctrl-C with no scripted faults, so you can inject your own.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{workspace_bin, Envoy, EnvoyOptions, HttpClient, PodPool};
use serde_json::Value;

const STATUS_PATH: &str = "/ai-lb/status";

struct Args {
    duration_s: u64,
    rate: f64,
    pods: usize,
    time_scale: f64,
    workload: &'static str,
}

/// The load generator's workloads the demo runs, with the flags that shape them.
const WORKLOADS: &[(&str, &[&str])] = &[
    (
        "shared-prefix",
        &[
            "--groups",
            "6",
            "--system-tokens",
            "1500",
            "--question-tokens",
            "150",
            "--answer-tokens",
            "120",
        ],
    ),
    (
        "multi-turn",
        &[
            "--groups",
            "6",
            "--question-tokens",
            "150",
            "--answer-tokens",
            "120",
        ],
    ),
    ("sharegpt", &[]),
];

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        duration_s: 60,
        rate: 15.0,
        pods: 4,
        time_scale: 1.0,
        workload: "shared-prefix",
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!(
                "usage: ai-lb-demo [--duration SECS (60; 0 = until Ctrl-C)] [--rate REQ_PER_S (15)] \
                 [--pods N (4, 3..=8)] [--time-scale X (1.0)] \
                 [--workload shared-prefix|multi-turn|sharegpt (shared-prefix)]"
            );
            std::process::exit(0);
        }
        let value = it
            .next()
            .ok_or_else(|| format!("missing value for {flag}"))?;
        let bad = |what: &str| format!("invalid value {value:?} for {flag}: expected {what}");
        match flag.as_str() {
            "--duration" => a.duration_s = value.parse().map_err(|_| bad("whole seconds"))?,
            "--rate" => {
                a.rate = value
                    .parse()
                    .ok()
                    .filter(|r: &f64| r.is_finite() && *r > 0.0 && *r <= 2000.0)
                    .ok_or_else(|| bad("requests per second in (0, 2000]"))?
            }
            "--pods" => {
                a.pods = value
                    .parse()
                    .ok()
                    .filter(|n| (3..=8).contains(n))
                    .ok_or_else(|| bad("a pod count in 3..=8"))?
            }
            "--time-scale" => {
                a.time_scale = value
                    .parse()
                    .ok()
                    .filter(|x: &f64| x.is_finite() && *x > 0.0 && *x <= 10.0)
                    .ok_or_else(|| bad("a factor in (0, 10]"))?
            }
            "--workload" => {
                a.workload = WORKLOADS
                    .iter()
                    .map(|(w, _)| *w)
                    .find(|w| *w == value)
                    .ok_or_else(|| bad("shared-prefix, multi-turn or sharegpt"))?
            }
            _ => return Err(format!("unknown flag {flag} (try --help)")),
        }
    }
    Ok(a)
}

fn preset(i: usize) -> &'static str {
    if i % 2 == 0 {
        "h100-8b"
    } else {
        "a100-8b"
    }
}

/// One step of the scripted timeline: at `at_s`, apply `faults` (pod index, /control JSON).
struct Step {
    at_s: u64,
    say: &'static str,
    faults: &'static [(usize, &'static str)],
}

const TIMELINE: &[Step] = &[
    Step {
        at_s: 0,
        say: "baseline: all pods healthy, traffic follows the scores",
        faults: &[],
    },
    Step {
        at_s: 12,
        say: "pod0's GPU forced to 97% SM occupancy: above the 95% hard limit, it is cut off (score 0)",
        faults: &[(0, r#"{"sm_occupancy":0.97}"#)],
    },
    Step {
        at_s: 24,
        say: "pod0 healed; pod2 now answers every request with 500: its breaker opens",
        faults: &[(0, r#"{"reset":true}"#), (2, r#"{"error_rate":1.0}"#)],
    },
    Step {
        at_s: 38,
        say: "pod2 healed: after the cooldown, half-open probes close its breaker",
        faults: &[(2, r#"{"reset":true}"#)],
    },
    Step {
        at_s: 50,
        say: "pod1's queue forced to 40 waiting requests: its queue term drops",
        faults: &[(1, r#"{"queue":40}"#)],
    },
];

fn main() {
    if let Err(e) = run() {
        eprintln!("ai-lb-demo: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ai-lb-demo: {e}");
            std::process::exit(2);
        }
    };
    let root = ai_lb_e2e::envoy::workspace_root();
    let filter_config = std::fs::read_to_string(root.join("envoy-config/filter-config.json"))
        .map_err(|e| format!("read envoy-config/filter-config.json: {e}"))?;

    println!(
        "starting {} simulated GPU pods with their agents (time scale {})...",
        args.pods, args.time_scale
    );
    // Each pod publishes its KV-cache events; its agent reads them and reports the cache.
    let pool = PodPool::start_with_kv_events(args.pods, args.time_scale, |i| {
        vec!["--preset".to_string(), preset(i).to_string()]
    })?;
    println!("starting Envoy 1.40 with the ai-lb filter (envoy-config/envoy.yaml + filter-config.json)...");
    let mut opts = EnvoyOptions::new(filter_config);
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    let envoy = Envoy::start(&opts)?;
    wait_until_fresh(&envoy, &pool)?;

    println!(
        "\nEnvoy listener: http://{}  (admin: http://{})",
        envoy.listener, envoy.admin
    );
    println!(
        "scoreboard:     curl -s http://{}{STATUS_PATH}",
        envoy.listener
    );
    for (i, a) in pool.pod_addrs.iter().enumerate() {
        // A100s have no GPM, so no SM occupancy to force: fill their queue instead.
        let (what, body) = if preset(i) == "h100-8b" {
            ("make it hot", r#"{"sm_occupancy":0.97}"#)
        } else {
            ("fill its queue", r#"{"queue":64}"#)
        };
        println!(
            "pod{i} ({}): {what:<14} curl -s -XPOST http://{a}/control -d '{body}'",
            preset(i)
        );
    }
    println!("heal a pod with                 curl -s -XPOST http://ADDR/control -d '{{\"reset\":true}}'\n");

    let results = std::env::temp_dir().join(format!("ai-lb-demo-{}.json", std::process::id()));
    let duration = if args.duration_s == 0 {
        86_400
    } else {
        args.duration_s
    };
    println!("traffic: {} at {} req/s", args.workload, args.rate);
    let mut loadgen = spawn_loadgen(envoy.listener, args.rate, duration, args.workload, &results)?;

    let scripted = args.duration_s >= 55;
    let tty = std::io::stdout().is_terminal();
    let start = Instant::now();
    let mut last_picks: BTreeMap<String, u64> = BTreeMap::new();
    let mut total_picks: BTreeMap<String, u64> = BTreeMap::new();
    let mut first_picks: Option<BTreeMap<String, u64>> = None;
    let mut phase = "traffic running; inject faults with the curl commands above";
    let mut next_step = 0;
    let mut next_tick = start;
    while start.elapsed() < Duration::from_secs(duration) {
        let t = start.elapsed().as_secs();
        if scripted {
            while let Some(step) = TIMELINE.get(next_step).filter(|s| s.at_s <= t) {
                for (pod, json) in step.faults {
                    if *pod < pool.pod_addrs.len() {
                        pool.control(*pod, json)?;
                    }
                }
                phase = step.say;
                next_step += 1;
            }
        }
        let board = scoreboard(&envoy).unwrap_or(Value::Null);
        let picks = picks_by_addr(&envoy, &pool);
        let base = first_picks.get_or_insert_with(|| picks.clone());
        for (a, p) in &picks {
            total_picks.insert(a.clone(), p.saturating_sub(*base.get(a).unwrap_or(&0)));
        }
        print_table(
            &pool,
            &prefix_stats(&envoy),
            &board,
            &picks,
            &last_picks,
            &total_picks,
            t,
            phase,
            tty,
        );
        last_picks = picks;
        if let Ok(Some(status)) = loadgen.try_wait() {
            println!("load generator exited early: {status}");
            break;
        }
        next_tick += Duration::from_secs(1);
        if let Some(wait) = next_tick.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }

    println!("\nwaiting for the load generator's summary...");
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = loadgen.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = loadgen.kill();
    if let Ok(text) = std::fs::read_to_string(&results) {
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            print_summary(&v);
        }
    }
    let counters = scoreboard(&envoy)
        .map(|b| b["counters"].clone())
        .unwrap_or(Value::Null);
    println!("filter counters: {counters}");
    println!(
        "\ndone. Envoy stats: curl -s http://{}/stats | grep ailb  (while it runs)",
        envoy.admin
    );
    Ok(())
}

fn spawn_loadgen(
    listener: SocketAddr,
    rate: f64,
    duration_s: u64,
    workload: &str,
    json: &std::path::Path,
) -> Result<Child, String> {
    let bin = workspace_bin("ai-lb-loadgen")?;
    let shape = WORKLOADS
        .iter()
        .find(|(w, _)| *w == workload)
        .map_or(&[][..], |(_, f)| *f);
    Command::new(&bin)
        .args(shape)
        .args([
            "--url".to_string(),
            format!("http://{listener}"),
            "--rate".into(),
            rate.to_string(),
            "--duration".into(),
            format!("{duration_s}s"),
            "--workload".into(),
            workload.to_string(),
            "--seed".into(),
            "7".into(),
            "--timeout".into(),
            "30s".into(),
            "--json".into(),
            json.display().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", bin.display()))
}

/// Monitoring calls must not stall the table: a slow answer is shown as "-".
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

fn scoreboard(envoy: &Envoy) -> Result<Value, String> {
    let r = HttpClient::new(envoy.listener)
        .with_timeout(PROBE_TIMEOUT)
        .get(STATUS_PATH, &[("connection", "close")])?;
    serde_json::from_slice(&r.body).map_err(|e| format!("status JSON: {e}"))
}

fn pods(board: &Value) -> Vec<Value> {
    board["pools"][0]["pods"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Requests steered to each pod, from Envoy's counters `ailb.endpoint.<addr>.picks` (summed
/// over every worker thread; the scoreboard's own `picks` is one worker's view).
fn picks_by_addr(envoy: &Envoy, pool: &PodPool) -> BTreeMap<String, u64> {
    let stats = envoy.stats().unwrap_or_default();
    pool.pod_addrs
        .iter()
        .map(|a| {
            let key = format!("wasmcustom.ailb.endpoint.{a}.picks");
            (a.to_string(), stats.get(&key).copied().unwrap_or(0))
        })
        .collect()
}

fn wait_until_fresh(envoy: &Envoy, pool: &PodPool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let board = scoreboard(envoy).unwrap_or(Value::Null);
        let fresh = pods(&board)
            .iter()
            .filter(|p| p["metricsAgeMs"].as_u64().is_some_and(|a| a < 2000))
            .count();
        if fresh >= pool.pod_addrs.len() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the filter did not receive metrics for every pod within 30 s; scoreboard: {board}"
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The GPU column: the reading the filter scored the pod on and its value, from the filter's
/// own status (`gpuSignal`, `gpu`), e.g. ` 32% smOccupancy`; `-  none` when the pod reports
/// no reading the filter uses (NVML's time fraction alone is not one, see `cutoffs.gpuSignal`).
fn gpu_cell(row: Option<&Value>) -> String {
    let signal = row.and_then(|r| r["gpuSignal"].as_str());
    let value = row.and_then(|r| r["gpu"].as_f64());
    match (signal, value) {
        (Some(s), Some(v)) => format!("{:>3.0}% {s:<12}", v * 100.0),
        _ => format!("  -  {:<12}", "none"),
    }
}

/// The filter's prefix-affinity counters, summed over every worker (Envoy's stats).
#[derive(Default)]
struct PrefixStats {
    keyed: u64,
    hit: u64,
    spill: u64,
    rendezvous: u64,
    blocks: u64,
    blocks_held: u64,
}

fn prefix_stats(envoy: &Envoy) -> PrefixStats {
    let stats = envoy.stats().unwrap_or_default();
    let get = |k: &str| {
        stats
            .get(&format!("wasmcustom.ailb.prefix.{k}"))
            .copied()
            .unwrap_or(0)
    };
    PrefixStats {
        keyed: get("keyed"),
        hit: get("hit"),
        spill: get("spill"),
        rendezvous: get("rendezvous"),
        blocks: get("blocks"),
        blocks_held: get("blocks_held"),
    }
}

#[allow(clippy::too_many_arguments)]
fn print_table(
    pool: &PodPool,
    prefix: &PrefixStats,
    board: &Value,
    picks: &BTreeMap<String, u64>,
    last: &BTreeMap<String, u64>,
    total: &BTreeMap<String, u64>,
    t: u64,
    phase: &str,
    tty: bool,
) {
    let delta: BTreeMap<&String, u64> = picks
        .iter()
        .map(|(a, p)| (a, p.saturating_sub(*last.get(a).unwrap_or(p))))
        .collect();
    let sum_delta: u64 = delta.values().sum();
    let sum_total: u64 = total.values().sum();
    let pct = |n: u64, d: u64| {
        if d == 0 {
            "   -".to_string()
        } else {
            format!("{:>3.0}%", 100.0 * n as f64 / d as f64)
        }
    };
    let rows = pods(board);
    let mut out = String::new();
    if tty {
        out.push_str("\x1b[2J\x1b[H");
    }
    out.push_str(&format!("t={t:>3}s  {phase}\n"));
    out.push_str(
        "pod   preset   address              gpu (signal)       score  cut            breaker    share(1s) share(all)  cache blk  hit%  metrics age\n",
    );
    for (i, addr) in pool.pod_addrs.iter().enumerate() {
        let a = addr.to_string();
        let row = rows.iter().find(|r| r["address"] == a.as_str());
        let field = |k: &str| row.map(|r| r[k].clone()).unwrap_or(Value::Null);
        let score = field("score")
            .as_f64()
            .map(|s| format!("{s:.2}"))
            .unwrap_or_else(|| "-".into());
        let cut = field("cut").as_str().unwrap_or("-").to_string();
        let breaker = field("breaker").as_str().unwrap_or("-").to_string();
        let age = field("metricsAgeMs")
            .as_u64()
            .map(|a| format!("{a} ms"))
            .unwrap_or_else(|| "-".into());
        let gpu = gpu_cell(row);
        // Key blocks (64 tokens) its agent reports cached, and its model server's hit rate.
        let blocks = field("prefixKeys")
            .as_u64()
            .map_or("-".to_string(), |k| k.to_string());
        let hit = field("prefixHitRate")
            .as_f64()
            .map_or("  -".to_string(), |h| format!("{:>3.0}", h * 100.0));
        out.push_str(&format!(
            "pod{i}  {:<8} {:<20} {gpu}  {score:>5}  {cut:<14} {breaker:<10} {:>9} {:>10}  {blocks:>9}  {hit:>4}  {age}\n",
            preset(i),
            a,
            pct(*delta.get(&a).unwrap_or(&0), sum_delta),
            pct(*total.get(&a).unwrap_or(&0), sum_total),
        ));
    }
    out.push_str(&format!(
        "requests steered by ai-lb in the last second: {sum_delta}, since the start: {sum_total}\n"
    ));
    if prefix.keyed > 0 {
        out.push_str(&format!(
            "prefix affinity since the start: {} prompts keyed; {} sent to a pod caching their prefix, {} spilled (that pod would queue them), {} new prefixes to their rendezvous pod; {:.0}% of prompt blocks expected cached\n",
            prefix.keyed,
            prefix.hit,
            prefix.spill,
            prefix.rendezvous,
            100.0 * prefix.blocks_held as f64 / prefix.blocks.max(1) as f64,
        ));
    }
    if !tty {
        out.push('\n');
    }
    print!("{out}");
    let _ = std::io::stdout().flush();
}

fn print_summary(v: &Value) {
    let ms = |k: &str, q: &str| {
        v[k][q]
            .as_f64()
            .map_or("-".to_string(), |x| format!("{x:.0} ms"))
    };
    println!(
        "load generator: {} sent, {} ok, timeout rate {}, TTFT p50 {} p99 {}, end-to-end p50 {} p99 {}, {} output tokens/s",
        v["counts"]["sent"],
        v["counts"]["ok"],
        v["timeout_rate"],
        ms("ttft_ms", "p50"),
        ms("ttft_ms", "p99"),
        ms("e2e_ms", "p50"),
        ms("e2e_ms", "p99"),
        v["output_tokens_per_s"].as_f64().map_or("-".to_string(), |x| format!("{x:.0}")),
    );
    if let Some(shares) = v["pod_share"].as_object() {
        let parts: Vec<String> = shares
            .iter()
            .map(|(pod, s)| format!("{pod} {:.0}%", 100.0 * s["share"].as_f64().unwrap_or(0.0)))
            .collect();
        println!("request share over the whole run: {}", parts.join(", "));
    }
}
