//! The local demo: a real Envoy 1.40 with ai-lb (the wasm filter, or with `--native` the native
//! module: the same demo on the other data path) in front of simulated GPU pods (two
//! H100-like, two A100-like), each with its collector agent, and open-loop traffic from the load
//! generator. Every second it prints where requests go (per-pod share, from Envoy's stats, i.e.
//! every worker's counts), each pod's GPU, score, cut reason and breaker state (one worker's
//! view, from the filter's status path; breakers are shared by the workers). A scripted
//! timeline makes a pod hot, makes another fail, then heals both, so traffic visibly moves away
//! and back. The end-of-run summary reads Envoy's stats too (see `ai_lb_e2e::demo`).
//! The pods publish vLLM's KV-cache events and the agents push what each pod caches, so with the
//! default shared-prefix traffic (a few applications, each with its own long system prompt) the
//! table also shows each pod's cached prefix blocks, its hit rate, and how often the filter sent
//! a request to a pod holding its prefix.
//!
//! Run it through `scripts/demo.sh` (which installs and builds everything first), or directly:
//! `target/debug/ai-lb-demo [--native] [--duration SECS] [--rate REQ_PER_S] [--pods N]
//! [--time-scale X] [--workload shared-prefix|multi-turn|sharegpt]`.
//! `--duration 0` runs until Ctrl-C with no scripted faults, so you can inject your own.
//! `--native` loads `$AI_LB_NATIVE` (scripts/demo.sh sets it to the module it just built), else
//! the first of `target/{release,debug}/libai_lb_filter_native.so`.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use ai_lb_e2e::demo::{self, Counts, DataPath, Shares, Summary, WORKLOADS};
use ai_lb_e2e::envoy::{Envoy, HttpClient, PodPool};
use serde_json::Value;

/// The status path when the filter config names none.
const STATUS_PATH: &str = "/ai-lb/status";

struct Args {
    path: DataPath,
    duration_s: u64,
    rate: f64,
    pods: usize,
    time_scale: f64,
    workload: &'static str,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        path: DataPath::Wasm,
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
                "usage: ai-lb-demo [--native] [--duration SECS (60; 0 = until Ctrl-C)] \
                 [--rate REQ_PER_S (15)] [--pods N (4, 3..=8)] [--time-scale X (1.0)] \
                 [--workload shared-prefix|multi-turn|sharegpt (shared-prefix)]\n\
                 --native: the native module (filter/native) instead of the wasm filter"
            );
            std::process::exit(0);
        }
        if flag == "--native" {
            a.path = DataPath::Native;
            continue;
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
    let status_path = serde_json::from_str::<Value>(&filter_config)
        .ok()
        .and_then(|v| v["statusPath"].as_str().map(str::to_string))
        .unwrap_or_else(|| STATUS_PATH.to_string());

    println!(
        "starting {} simulated GPU pods with their agents (time scale {})...",
        args.pods, args.time_scale
    );
    // Each pod publishes its KV-cache events; its agent reads them and reports the cache.
    let pool = PodPool::start_with_kv_events(args.pods, args.time_scale, |i| {
        vec!["--preset".to_string(), preset(i).to_string()]
    })?;
    let path = args.path;
    println!(
        "starting Envoy 1.40 with {} + envoy-config/filter-config.json...",
        path.name()
    );
    if path == DataPath::Native {
        println!(
            "native module: {}",
            ai_lb_e2e::envoy::native_module_path()?.display()
        );
    }
    let (opts, notes) =
        demo::envoy_options(path, &filter_config, &pool.pod_addrs, &pool.agent_addrs)?;
    for n in &notes {
        println!("note: {n}");
    }
    let envoy = Envoy::start(&opts)?;
    wait_until_fresh(&envoy, &pool, &status_path)?;

    println!(
        "\nEnvoy listener: http://{}  (admin: http://{})",
        envoy.listener, envoy.admin
    );
    println!(
        "scoreboard:     curl -s http://{}{status_path}   (one worker's view: field \"worker\")",
        envoy.listener
    );
    println!(
        "counters:       curl -s http://{}/stats | grep {}ailb   (every worker's)",
        envoy.admin,
        path.stat_prefix()
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
    if path == DataPath::Native {
        println!("(the native module adds each worker's per-pod counts to Envoy's stats once a second, so share(1s) moves in steps)\n");
    }

    let results = std::env::temp_dir().join(format!("ai-lb-demo-{}.json", std::process::id()));
    let duration = if args.duration_s == 0 {
        86_400
    } else {
        args.duration_s
    };
    // What Envoy counted before the traffic: the table and the summary count from here.
    let start_counts = Counts::read(&envoy, path, &pool.pod_addrs)?;
    println!("traffic: {} at {} req/s", args.workload, args.rate);
    let mut loadgen =
        demo::spawn_loadgen(envoy.listener, args.rate, duration, args.workload, &results)?;

    let scripted = args.duration_s >= 55;
    let tty = std::io::stdout().is_terminal();
    let start = Instant::now();
    let mut last_counts = start_counts.clone();
    // The status page's worker ids (the wasm filter's are large numbers), numbered as seen.
    let mut workers: Vec<u64> = Vec::new();
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
        let board = scoreboard(&envoy, &status_path).unwrap_or(Value::Null);
        let worker = board["worker"].as_u64().map(|w| {
            workers.iter().position(|x| *x == w).unwrap_or_else(|| {
                workers.push(w);
                workers.len() - 1
            })
        });
        // A failed read shows nothing new rather than a jump.
        let counts =
            Counts::read(&envoy, path, &pool.pod_addrs).unwrap_or_else(|_| last_counts.clone());
        let shares = Shares::new(&counts, &last_counts, &start_counts);
        print_table(
            &pool,
            &counts.since(&start_counts),
            &board,
            worker,
            &shares,
            t,
            phase,
            tty,
        );
        last_counts = counts;
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
    let _ = loadgen.wait();
    if let Ok(text) = std::fs::read_to_string(&results) {
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            print_summary(&v);
        }
    }
    let _ = std::fs::remove_file(&results);
    let summary = Summary::after_traffic(
        &envoy,
        path,
        &pool.pod_addrs,
        &status_path,
        &start_counts,
        Duration::from_secs(20),
    )?;
    println!("{} over the run:", path.name());
    for l in summary.lines(|a| pool.name_of(a).unwrap_or(a).to_string()) {
        println!("  {l}");
    }
    println!(
        "\ndone. Envoy stats: curl -s http://{}/stats | grep {}ailb  (while it runs)",
        envoy.admin,
        path.stat_prefix()
    );
    Ok(())
}

/// The status page: the view of whichever Envoy worker took the request (field `worker`).
/// A slow answer is shown as "-" (monitoring calls must not stall the table).
fn scoreboard(envoy: &Envoy, status_path: &str) -> Result<Value, String> {
    let r = HttpClient::new(envoy.listener)
        .with_timeout(demo::PROBE_TIMEOUT)
        .get(status_path, &[("connection", "close")])?;
    serde_json::from_slice(&r.body).map_err(|e| format!("status JSON: {e}"))
}

fn pods(board: &Value) -> Vec<Value> {
    board["pools"][0]["pods"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn wait_until_fresh(envoy: &Envoy, pool: &PodPool, status_path: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let board = scoreboard(envoy, status_path).unwrap_or(Value::Null);
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

/// With `learnedWeights` in the filter config: the first pool's model as the status page's
/// worker learned it (its weights that score, whether it falls back to the static score, its
/// updates). None when the section is off.
fn learned_line(board: &Value) -> Option<String> {
    let l = board["pools"][0].get("learned").filter(|l| l.is_object())?;
    let w = l["weights"].as_object()?;
    let weights: Vec<String> = w
        .iter()
        .map(|(k, v)| format!("{k} {:+.2}", v.as_f64().unwrap_or(f64::NAN)))
        .collect();
    Some(format!(
        "learned weights (that worker's model): {}; fallback: {}; updates {}\n",
        weights.join(", "),
        l["fallback"].as_str().unwrap_or("none"),
        l["updates"].as_u64().unwrap_or(0)
    ))
}

/// One second of the live table. The share columns and the counts under the table are
/// Envoy's stats (every worker's); the columns from the status page (GPU, score, cut,
/// breaker, cache, metrics age) are the view of the worker that answered it, which the table
/// names (breakers are shared, scores are alike on every worker).
#[allow(clippy::too_many_arguments)]
fn print_table(
    pool: &PodPool,
    since_start: &Counts,
    board: &Value,
    worker: Option<usize>,
    shares: &Shares,
    t: u64,
    phase: &str,
    tty: bool,
) {
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
        let (last, total) = shares.per_pod.get(&a).copied().unwrap_or((0, 0));
        out.push_str(&format!(
            "pod{i}  {:<8} {:<20} {gpu}  {score:>5}  {cut:<14} {breaker:<10} {:>9} {:>10}  {blocks:>9}  {hit:>4}  {age}\n",
            preset(i),
            a,
            pct(last, shares.sum_last),
            pct(total, shares.sum_total),
        ));
    }
    let worker = worker.map_or("-".to_string(), |w| format!("#{w}"));
    out.push_str(&format!(
        "gpu, score, cut, breaker, cache, age: one Envoy worker's view ({worker}, status page); shares and counts: every worker's (Envoy's stats)\n"
    ));
    out.push_str(&format!(
        "requests steered by ai-lb in the last second: {}, since the start: {}\n",
        shares.sum_last, shares.sum_total
    ));
    if let Some(line) = learned_line(board) {
        out.push_str(&line);
    }
    let c = since_start;
    if c.opened_total() + c.half_opened + c.closed > 0 {
        out.push_str(&format!(
            "breakers since the start: opened {}, half-opened {}, closed {}\n",
            c.opened_total(),
            c.half_opened,
            c.closed
        ));
    }
    let prefix = &c.prefix;
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
