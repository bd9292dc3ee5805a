//! `ai-lb-bench`: runs the benchmark scenarios (round_robin vs least_request vs ai-lb on the
//! same seeded traces, faults, filter overhead) and writes `bench-results/`. `--smoke` runs a
//! tiny version that only checks the suite still works (it asserts no numbers).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use serde_json::{json, Value};

use ai_lb_bench::overhead_figures::{self, Figure};
use ai_lb_bench::scenario::{self, Env};
use ai_lb_bench::topology::{self, PodShape, Pool};
use ai_lb_bench::{calibrate, freshness, overhead};

/// Scenario names that are not `<workload>-<arrival>-<pct>` / `fault-*` loads.
const SPECIAL: [&str; 6] = [
    "calibrate",
    "overhead",
    "overhead-stream",
    "overhead-epp",
    "overhead-rps",
    "freshness",
];

#[derive(Debug, Parser)]
#[command(name = "ai-lb-bench", about)]
struct Cli {
    /// Scenarios: calibrate, overhead, overhead-stream (CPU per streamed LLM answer, plain vs
    /// native vs wasm), overhead-epp (added latency and CPU against the ext_proc endpoint
    /// picker), overhead-rps (trivial upstream req/s with a spread over rounds), freshness,
    /// <sharegpt|hol|prefix|multiturn>-<poisson|bursty>-<pct>,
    /// fault-<slowdown|slowdown-silent|errors|sigstop|flap|noisy|oom>, misleading-<slow|frontend>. Default: sharegpt-poisson-80. `prefix`
    /// and `multiturn` are loaded against their own measured capacity (saved per workload,
    /// measured again with `calibrate`; docs/benchmark-workloads.md).
    scenarios: Vec<String>,
    /// Short run on a tiny pool, results under the work dir; checks that the suite works.
    #[arg(long)]
    smoke: bool,
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    #[arg(long, default_value = "/tmp/ai-lb-bench")]
    work: PathBuf,
    /// The pool: comma-separated KIND:COUNT, KIND `h100`, `a100` or `l40s` (fake-pod presets
    /// `h100-8b`, `a100-8b`, `l40s-8b`), e.g. `h100:2,a100:6` (fast pods a minority) or
    /// `h100:2,a100:4,l40s:2` (three kinds).
    #[arg(long, default_value = "h100:4,a100:4")]
    pool: String,
    /// Pods publish vLLM's KV-cache events and agents read them (what ai-lb's prefix affinity
    /// uses); `false` runs the pool as before prefix caching was reported.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    kv_events: bool,
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 8)]
    max_num_seqs: u32,
    #[arg(long, default_value_t = 12_500)]
    kv_cache_tokens: u64,
    /// The agents' `--sample-interval`, ms, in every scenario but freshness (which sweeps it);
    /// the default is the agent's own.
    #[arg(long, default_value_t = ai_lb_bench::freshness::DEFAULT_SAMPLE_MS)]
    sample_interval_ms: u64,
    #[arg(long, default_value_t = 4)]
    sidecars: usize,
    /// Seconds of trace per policy.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Client timeout, seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Pool capacity in req/s; default: read `<out>/calibrate/summary.json`, else calibrate.
    #[arg(long)]
    capacity: Option<f64>,
    /// Overload rate per probed pod during calibration, req/s.
    #[arg(long, default_value_t = 30.0)]
    cal_rate: f64,
    #[arg(long, default_value_t = 20.0)]
    cal_secs: f64,
    /// Overhead scenarios: closed-loop clients of the maximum-throughput probe (default 16;
    /// overhead-stream and overhead-epp 256, as a streamed answer lasts chunks × gap).
    #[arg(long)]
    overhead_workers: Option<usize>,
    /// Overhead scenarios: alternating rounds (the order rotated each round); figures are
    /// medians over rounds (default 3; overhead-stream 14 open-loop rounds, overhead-epp 10,
    /// overhead-rps 12).
    #[arg(long)]
    overhead_rounds: Option<usize>,
    /// Overhead scenarios: content chunks in each answer of the fast upstream (default 2;
    /// overhead-stream and overhead-epp 64).
    #[arg(long)]
    overhead_chunks: Option<u32>,
    /// Overhead scenarios: stream the answer's chunks this many ms apart, one write each (0: all
    /// in one write; default 0, overhead-stream and overhead-epp 2). Shows the filter's cost
    /// per streamed chunk.
    #[arg(long)]
    overhead_chunk_gap_ms: Option<u64>,
    /// overhead-stream, overhead-epp and overhead-rps: seconds of each measurement (one side, one
    /// round; default 5, with 14, 10 and 12 rounds).
    #[arg(long)]
    overhead_secs: Option<f64>,
    /// overhead-stream and overhead-epp: sinks, each a pod with its own agent.
    #[arg(long, default_value_t = 4)]
    overhead_pods: usize,
    /// Overhead scenarios: which sides run against plain Envoy, side by side: `wasm`
    /// (shipped), `native` (the dynamic module, filter/native; built by scripts/bench.sh when
    /// named), `wasm-b` / `native-b` (a second build, `$AI_LB_WASM_B` / `$AI_LB_NATIVE_B`,
    /// and/or plugin config, `$AI_LB_BENCH_FILTER_CONFIG_B`, to compare a change in the same
    /// run), `empty-wasm` (a proxy-wasm filter that does nothing, the floor of any wasm filter;
    /// tests/bench/empty-wasm), `empty-native` (a dynamic module that does nothing, in the
    /// native module's place: the floor of any module; tests/bench/empty-native), `epp` (the
    /// endpoint picker behind ext_proc; overhead-epp
    /// only), comma-separated: `wasm,native`. Default: `wasm` for overhead, `native,wasm` for
    /// overhead-stream and overhead-rps, `native,wasm,epp` for overhead-epp.
    #[arg(long)]
    overhead_filter: Option<String>,
    #[arg(long, default_value_t = 16)]
    hol_count: u32,
    /// Policies to compare, comma-separated (for quick iterations; the report's tables and
    /// ratios need all three). Also `epp`: the llm-d endpoint picker's default scheduling
    /// (`ai-lb-epp` behind Envoy's ext_proc, docs/epp-baseline.md), not run by default.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_request,ai_lb"
    )]
    policies: Vec<String>,
    /// Runs each load scenario this many times on its trace, the policies' order reversed
    /// every other time; each repeat's table goes to `<out>/<scenario>/repeat-<k>/`, and
    /// `<out>/<scenario>/repeats.md` gives every repeat's p99s and the median ratios to the
    /// first policy named.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    repeats: u32,
}

fn main() -> ExitCode {
    // The soaks (scripts/soak.sh) take their own flags: `ai-lb-bench soak-churn --short`.
    if std::env::args()
        .nth(1)
        .is_some_and(|a| a.starts_with("soak-"))
    {
        return match ai_lb_bench::soak::main_from_args(std::env::args()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ai-lb-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut cli = Cli::parse();
    let cmdline = format!(
        "scripts/bench.sh {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    if cli.smoke {
        cli.pool = "h100:1,a100:1".into();
        cli.sidecars = 2;
        cli.duration = 4.0;
        cli.timeout = 10.0;
        cli.cal_secs = 4.0;
        cli.cal_rate = 20.0;
        // The overhead figures (overhead-stream, -epp, -rps) take their own smoke settings.
        // The empty proxy-wasm filter too (tests/bench/empty-wasm), so the overhead run's
        // baseline fixture keeps loading in this Envoy; unless other builds were asked for.
        cli.hol_count = 2;
        // Its own work dir, so a smoke run never mixes with the records of a real run.
        cli.work = cli.work.join("smoke");
        cli.out = cli.work.join("results");
        if cli.scenarios.is_empty() {
            cli.scenarios = vec![
                "calibrate".into(),
                "hol-poisson-80".into(),
                // One short run of each prefix-cache workload (calibrated for it first).
                "prefix-poisson-80".into(),
                "multiturn-poisson-80".into(),
                "fault-slowdown".into(),
                "overhead".into(),
                "overhead-stream".into(),
                "overhead-epp".into(),
                "overhead-rps".into(),
                "freshness".into(),
            ];
        }
    }
    if cli.scenarios.is_empty() {
        cli.scenarios = vec!["sharegpt-poisson-80".into()];
    }
    match run(&cli, &cmdline) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ai-lb-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli, cmdline: &str) -> Result<(), String> {
    // Validate every scenario name before starting anything.
    for s in &cli.scenarios {
        if !SPECIAL.contains(&s.as_str()) {
            scenario::parse_load(s)?;
        }
    }
    for (flag, v) in [
        ("--time-scale", cli.time_scale),
        ("--duration", cli.duration),
        ("--timeout", cli.timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("invalid value '{v}' for '{flag}': must be > 0"));
        }
    }
    if cli.sidecars == 0 {
        return Err("invalid value '0' for '--sidecars': must be > 0".into());
    }
    let kinds = topology::parse_pool(&cli.pool)?;
    if !(1..=60_000).contains(&cli.sample_interval_ms) {
        return Err(format!(
            "invalid value '{}' for '--sample-interval-ms': must be within 1..=60000",
            cli.sample_interval_ms
        ));
    }
    std::fs::create_dir_all(&cli.work)
        .map_err(|e| format!("creating {}: {e}", cli.work.display()))?;
    std::fs::create_dir_all(&cli.out)
        .map_err(|e| format!("creating {}: {e}", cli.out.display()))?;
    let shape = PodShape {
        kinds,
        kv_events: cli.kv_events,
        time_scale: cli.time_scale,
        max_num_seqs: cli.max_num_seqs,
        kv_cache_tokens: cli.kv_cache_tokens,
        sample_interval_ms: cli.sample_interval_ms,
        gpu_sample_interval_ms: None,
    };
    let mut env = Env {
        loadgen: topology::release_bin("ai-lb-loadgen")?,
        work: cli.work.clone(),
        out: cli.out.clone(),
        sidecars: cli.sidecars,
        duration_s: cli.duration,
        timeout_s: cli.timeout,
        seed: cli.seed,
        capacity_rps: 0.0,
        time_scale: cli.time_scale,
        max_num_seqs: cli.max_num_seqs,
        kv_cache_tokens: cli.kv_cache_tokens,
        cal_rate: cli.cal_rate,
        cal_secs: cli.cal_secs,
        recalibrate: cli.scenarios.iter().any(|s| s == "calibrate"),
        hol_count: cli.hol_count,
        hol_at_s: cli.duration / 3.0,
        policies: cli
            .policies
            .iter()
            .map(|p| topology::Policy::parse(p))
            .collect::<Result<_, _>>()?,
    };
    if cli.smoke && cli.repeats > 1 {
        return Err(format!(
            "--repeats {}: the smoke run checks one run of each scenario; leave --repeats out",
            cli.repeats
        ));
    }
    let loads: Vec<&String> = cli
        .scenarios
        .iter()
        .filter(|s| !SPECIAL.contains(&s.as_str()))
        .collect();
    let want_cal = cli.scenarios.iter().any(|s| s == "calibrate");
    let want_fresh = cli.scenarios.iter().any(|s| s == "freshness");
    let mut checks = Vec::new();
    // Overhead first: short, and independent of the pool.
    if cli.overhead_rounds == Some(0) || cli.overhead_workers == Some(0) || cli.overhead_pods == 0 {
        return Err("--overhead-rounds, --overhead-workers and --overhead-pods must be > 0".into());
    }
    if cli.scenarios.iter().any(|s| s == "overhead") {
        eprintln!("[bench] overhead");
        let filter = match &cli.overhead_filter {
            Some(f) => f.clone(),
            None if cli.smoke => "wasm,empty-wasm".into(),
            None => "wasm".into(),
        };
        let builds = overhead::Side::parse_builds(&filter)?;
        let mut o = overhead::overhead(
            &env,
            if cli.smoke { 2.0 } else { 10.0 },
            cli.overhead_rounds.unwrap_or(if cli.smoke { 1 } else { 3 }),
            cli.overhead_workers
                .unwrap_or(if cli.smoke { 4 } else { 16 }),
            overhead::Answer {
                chunks: cli.overhead_chunks.unwrap_or(2),
                gap_ms: cli.overhead_chunk_gap_ms.unwrap_or(0),
            },
            &builds,
        )?;
        o["command"] = json!(cmdline);
        overhead::write(&cli.out, &o)?;
        if cli.smoke {
            // Every Envoy of the overhead run answered in its closed loop.
            for side in o["sides"].as_array().cloned().unwrap_or_default() {
                let k = side.as_str().unwrap_or("");
                if o["max_rps"]["median"][k].as_f64().unwrap_or(0.0) <= 0.0 {
                    return Err(format!("smoke: overhead/{k} answered nothing"));
                }
            }
        }
        println!(
            "overhead: {}",
            serde_json::to_string_pretty(&o).unwrap_or_default()
        );
    }
    for f in Figure::ALL {
        if !cli.scenarios.iter().any(|s| s == f.scenario()) {
            continue;
        }
        eprintln!("[bench] {}", f.scenario());
        let mut s = overhead_figures::Settings::defaults(f, cli.smoke);
        if let Some(r) = cli.overhead_rounds {
            s.rounds = r;
        }
        if let Some(x) = cli.overhead_secs {
            if !(x.is_finite() && x > 0.0) {
                return Err(format!(
                    "invalid value '{x}' for '--overhead-secs': must be > 0"
                ));
            }
            s.secs = x;
        }
        if let Some(w) = cli.overhead_workers {
            s.workers = w;
        }
        if let Some(c) = cli.overhead_chunks {
            s.chunks = c;
        }
        if let Some(g) = cli.overhead_chunk_gap_ms {
            s.gap_ms = g;
        }
        if f != Figure::Rps && !cli.smoke {
            s.pods = cli.overhead_pods;
        }
        if let Some(b) = &cli.overhead_filter {
            s.builds = overhead::Side::parse_builds(b)?;
        }
        if f != Figure::Epp && s.builds.contains(&overhead::Side::Epp) {
            return Err(format!(
                "--overhead-filter epp: only overhead-epp runs the picker, not {}",
                f.scenario()
            ));
        }
        let mut v = overhead_figures::run(&env, f, &s)?;
        v["command"] = json!(cmdline);
        overhead_figures::write(&cli.out, f, &v)?;
        if cli.smoke {
            overhead_figures::check(&v)?;
        }
        let table =
            std::fs::read_to_string(cli.out.join("overhead").join(f.dir()).join("table.md"))
                .unwrap_or_default();
        println!("{table}");
    }
    if want_cal || want_fresh || !loads.is_empty() {
        eprintln!(
            "[bench] starting {} fake pods with agents{}",
            shape.describe(),
            if shape.kv_events {
                " (KV events on)"
            } else {
                ""
            }
        );
        let mut pool = Pool::start(&shape, true)?;
        let cal_path = cli.out.join("calibrate/summary.json");
        env.capacity_rps = match cli.capacity {
            Some(c) if !want_cal => c,
            _ => {
                let saved = std::fs::read_to_string(&cal_path)
                    .ok()
                    .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                    .and_then(|v| calibrate::pool_capacity(&v, &shape));
                match saved {
                    Some(c) if !want_cal => c,
                    _ => {
                        eprintln!("[bench] calibrating pool capacity");
                        let mut cal =
                            calibrate::calibrate(&env, &pool, &shape, cli.cal_rate, cli.cal_secs)?;
                        cal["pods"] = json!(shape.describe());
                        // Keep the presets this pool lacks from the previous calibration (same
                        // pod settings), so one file serves every mix measured so far.
                        let old = std::fs::read_to_string(&cal_path)
                            .ok()
                            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                            .filter(|o| o["pod_settings"] == cal["pod_settings"]);
                        if let (Some(old), Some(per)) = (old, cal["per_preset"].as_object_mut()) {
                            for (k, v) in old["per_preset"].as_object().into_iter().flatten() {
                                per.entry(k.clone()).or_insert(v.clone());
                            }
                        }
                        cal["command"] = json!(cmdline);
                        let dir = cli.out.join("calibrate");
                        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                        let text = serde_json::to_string_pretty(&cal).map_err(|e| e.to_string())?;
                        std::fs::write(&cal_path, text).map_err(|e| e.to_string())?;
                        eprintln!("[bench] calibration: {cal}");
                        cal["capacity_rps"]
                            .as_f64()
                            .ok_or("calibration gave no capacity")?
                    }
                }
            }
        };
        if !(env.capacity_rps.is_finite() && env.capacity_rps > 0.0) {
            return Err(format!(
                "measured capacity {} req/s is not usable",
                env.capacity_rps
            ));
        }
        for name in loads {
            let load = scenario::parse_load(name)?;
            let (summary, table) = if cli.repeats > 1 {
                let s = ai_lb_bench::repeats::run(
                    &load,
                    &env,
                    &mut pool,
                    cmdline,
                    cli.repeats as usize,
                )?;
                (s, cli.out.join(name).join("repeats.md"))
            } else {
                let s = scenario::run_load(&load, &env, &mut pool, cmdline)?;
                (s, cli.out.join(name).join("table.md"))
            };
            let table = std::fs::read_to_string(table).unwrap_or_default();
            println!("{table}");
            checks.push((name.clone(), summary));
        }
        if want_fresh {
            // Its pools are started per sample interval.
            drop(pool);
            // Smoke: the defaults point only (with the short under-load reaction), 2 toggles.
            let (points, toggles) = if cli.smoke {
                (vec![freshness::Point::DEFAULTS], 2)
            } else {
                (freshness::sweep(), 10)
            };
            let v = freshness::freshness(&env, &shape, &points, toggles, true, cmdline)?;
            let dir = cli.out.join("freshness");
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
            std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
            let table = freshness::table(&v);
            std::fs::write(dir.join("table.md"), &table).map_err(|e| e.to_string())?;
            println!("{table}");
            if cli.smoke {
                let p = &v["points"][0];
                let seen =
                    |r: &Value, kind: &str| r[kind]["cut_ms"]["count"].as_u64().unwrap_or(0) > 0;
                let (r, u) = (&p["reaction"], &v["under_load"]["reaction"]);
                if p["ai_lb"]["ok"].as_u64().unwrap_or(0) == 0
                    || !["gpu", "queue"].iter().all(|k| seen(r, k) && seen(u, k))
                {
                    return Err(format!(
                        "smoke: freshness measured nothing: {p}; under load: {}",
                        v["under_load"]
                    ));
                }
            }
        }
    }
    if cli.smoke {
        // The suite works if every policy of every scenario answered something. No numbers.
        for (name, s) in &checks {
            let policies = s["policies"].as_array().cloned().unwrap_or_default();
            if policies.len() != 3 {
                return Err(format!(
                    "smoke: {name} has {} policy results",
                    policies.len()
                ));
            }
            for p in policies {
                if p["all"]["ok"].as_u64().unwrap_or(0) == 0 {
                    return Err(format!(
                        "smoke: {name}/{} had no successful request",
                        p["policy"]
                    ));
                }
            }
        }
        eprintln!("[bench] smoke OK ({} scenarios)", checks.len());
    }
    Ok(())
}
