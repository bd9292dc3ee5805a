//! Decides what the filter costs per request: one Envoy (1 worker) in front of one fast
//! upstream (the loadgen `sink` example answering 2 tokens at once), with the filter (ai-lb's
//! shipped `envoy-config/filter-config.json`; an agent announces the sink as its pod, reading
//! metrics from an idle fake pod, so the filter has pool data and really picks) and without
//! (the same Envoy with plain least_request).
//!
//! Both Envoys run side by side for the whole measurement and the two are measured in
//! alternating rounds (the order flips every round), so slow drift of a shared machine hits
//! both alike; every figure is the median over rounds:
//! - maximum throughput: a closed loop of `workers` keep-alive clients for `secs` against each;
//!   also the Envoy process's CPU time (user + system, `/proc/<pid>/stat`) per answered
//!   request over that loop. On a shared 2-core machine a closed loop's maximum depends on
//!   how much CPU the load generator and the other processes leave Envoy; CPU per request
//!   does not so much;
//! - at 50 % load: an open loop at half of the filter's own measured maximum (the lower of the
//!   two), `secs` each, the same trace for both, and straight to the sink for the floor of
//!   the loop itself: CPU per request (the steadiest measure of what the filter costs per
//!   request) and the latency the filter adds at a load its Envoy keeps up with;
//! - the same at half of plain Envoy's maximum, where the filter's Envoy is near
//!   its own maximum when the filter halves it (kept for comparison with earlier reports);
//! - with no traffic at all: each Envoy's own CPU per second (the filter's ticks and agent
//!   stream), which every sidecar pays however few requests it carries.
//!
//! `--overhead-chunks N --overhead-chunk-gap-ms G` makes the sink stream N chunks G ms apart,
//! each its own write, so every chunk is a response-body callback of the filter, as with a
//! model server streaming tokens (the default answers 2 chunks in one write).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::analysis::{self, Summary};
use ai_lb_loadgen::stats::{Outcome, Record};

use crate::calibrate::{fixed_trace, ok_rps, replay};
use crate::scenario::Env;
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/<pid>/stat`
/// (fields 14 and 15, in clock ticks of 1/100 s: Linux's USER_HZ). None off Linux or when
/// the process is gone.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// One measured replay: the loadgen's summary and records, the Envoy process's CPU seconds over
/// it, and its CPU microseconds per answered request.
struct Measured {
    summary: Summary,
    records: Vec<Record>,
    cpu_s: Option<f64>,
    cpu_us_per_ok: Option<f64>,
}

/// Replays `trace` against `url` (args passed to the loadgen), reading Envoy `pid`'s CPU time
/// before and after.
fn measured_replay(
    env: &Env,
    url: &str,
    trace: &Path,
    out: &Path,
    args: &[&str],
    pid: u32,
) -> Result<Measured, Error> {
    let before = cpu_secs(pid);
    let (summary, records) = replay(env, url, trace, &out.to_path_buf(), args)?;
    let cpu_s = cpu_secs(pid).zip(before).map(|(a, b)| a - b);
    let ok = records.iter().filter(|r| r.outcome == Outcome::Ok).count();
    let cpu_us_per_ok = cpu_s.filter(|_| ok > 0).map(|c| c * 1e6 / ok as f64);
    Ok(Measured {
        summary,
        records,
        cpu_s,
        cpu_us_per_ok,
    })
}

/// Median of `v` (None when empty).
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => v.get(n / 2).copied(),
        _ => Some((v.get(n / 2 - 1)? + v.get(n / 2)?) / 2.0),
    }
}

fn lat(s: &Summary) -> Value {
    json!({"e2e_ms": s.e2e_ms, "ttft_ms": s.ttft_ms, "ok": s.ok, "errors": s.errors, "timeouts": s.timeouts})
}

/// What every open-loop phase of [`overhead`] shares.
struct Ctx<'a> {
    env: &'a Env,
    dir: &'a Path,
    secs: f64,
    rounds: usize,
    sink: std::net::SocketAddr,
    url: &'a dyn Fn(Policy) -> String,
    pid: &'a dyn Fn(Policy) -> u32,
    order: &'a dyn Fn(usize) -> [Policy; 2],
}

/// One open loop at `rate` for `secs`, `rounds` times: the trace straight to the sink (the
/// loop's own floor), then each Envoy (order flipped each round), with its CPU per answered
/// request and e2e latency. Medians over rounds; "added" = ai_lb − plain within a round.
fn open_loop_phase(c: &Ctx, name: &str, rate: f64) -> Result<Value, Error> {
    let trace = c.dir.join(format!("{name}.jsonl"));
    fixed_trace(c.env, rate, c.secs, &trace)?;
    let (mut cpu_plain, mut cpu_ailb, mut cpu_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut p99_plain, mut p99_ailb, mut p99_direct, mut added) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut p50_plain, mut p50_ailb) = (Vec::new(), Vec::new());
    let mut rounds: Vec<Value> = Vec::new();
    for round in 0..c.rounds {
        let mut row = serde_json::Map::new();
        let (direct, _) = replay(
            c.env,
            &format!("http://{}", c.sink),
            &trace,
            &c.dir.join(format!("direct.{name}.{round}.jsonl")),
            &[],
        )?;
        p99_direct.push(direct.e2e_ms.p99.unwrap_or(f64::NAN));
        row.insert("direct_to_sink".into(), lat(&direct));
        for p in (c.order)(round) {
            let m = measured_replay(
                c.env,
                &(c.url)(p),
                &trace,
                &c.dir.join(format!("{}.{name}.{round}.jsonl", p.name())),
                &[],
                (c.pid)(p),
            )?;
            let cpu_us = m.cpu_us_per_ok.unwrap_or(f64::NAN);
            let (p50, p99) = (
                m.summary.e2e_ms.p50.unwrap_or(f64::NAN),
                m.summary.e2e_ms.p99.unwrap_or(f64::NAN),
            );
            let mut v = lat(&m.summary);
            v["envoy_cpu_s"] = json!(m.cpu_s);
            v["envoy_cpu_us_per_request"] = json!(m.cpu_us_per_ok);
            row.insert(p.name().into(), v);
            let (cpu, p50s, p99s) = match p {
                Policy::AiLb => (&mut cpu_ailb, &mut p50_ailb, &mut p99_ailb),
                _ => (&mut cpu_plain, &mut p50_plain, &mut p99_plain),
            };
            cpu.push(cpu_us);
            p50s.push(p50);
            p99s.push(p99);
        }
        if let (Some(a), Some(b)) = (cpu_ailb.last(), cpu_plain.last()) {
            cpu_ratios.push(b / a);
        }
        if let (Some(a), Some(b)) = (p99_ailb.last(), p99_plain.last()) {
            added.push(a - b);
        }
        rounds.push(Value::Object(row));
    }
    let us = |v: Option<f64>| v.map(|ms| (ms * 1000.0).round());
    Ok(json!({
        "rate_rps": rate,
        "p99_ms_median": {"least_request": median(p99_plain.clone()), "ai_lb": median(p99_ailb.clone()), "direct_to_sink": median(p99_direct)},
        "p50_ms_median": {"least_request": median(p50_plain.clone()), "ai_lb": median(p50_ailb.clone())},
        "added_p99_us_median_of_rounds": us(median(added.clone())),
        "added_p99_us_per_round": added.iter().map(|d| us(Some(*d))).collect::<Vec<_>>(),
        "added_p50_us": us(median(p50_ailb).zip(median(p50_plain)).map(|(a, b)| a - b)),
        "least_request_us_median": median(cpu_plain.clone()),
        "ai_lb_us_median": median(cpu_ailb.clone()),
        "added_us_median": median(cpu_ailb.clone()).zip(median(cpu_plain.clone())).map(|(a, b)| a - b),
        "ratio_of_medians": analysis::ratio(median(cpu_plain), median(cpu_ailb)),
        "ratio_per_round": cpu_ratios,
        "rounds": rounds,
    }))
}

/// What the sink answers: `chunks` content chunks, all in one write (`gap_ms` 0, the default
/// run) or streamed one by one `gap_ms` apart, as a model server streams tokens (each chunk
/// then reaches the filter as its own response-body callback).
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub chunks: u32,
    pub gap_ms: u64,
}

/// Runs the overhead scenario; returns its summary (written by the caller).
pub fn overhead(
    env: &Env,
    secs: f64,
    rounds: usize,
    workers: usize,
    answer: Answer,
) -> Result<Value, Error> {
    let dir = env.work.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let shape = PodShape {
        h100: 1,
        a100: 0,
        time_scale: 1.0,
        max_num_seqs: 256,
        kv_cache_tokens: 400_000,
        sample_interval_ms: 100,
        gpu_sample_interval_ms: None,
    };
    let metrics_pod = Pool::start(&shape, false)?;
    let (_sink, sink) = topology::spawn_sink(answer.chunks, answer.gap_ms)?;
    let grpc = std::net::SocketAddr::from(([127, 0, 0, 1], ai_lb_e2e::envoy::free_port()?));
    let _agent = topology::spawn_agent(
        "sink",
        grpc,
        metrics_pod.pods[0].addr,
        sink,
        &[],
        256,
        100,
        None,
    )?;
    let upstreams = [sink];
    let agents = [grpc];
    let plain = topology::start_sidecar(Policy::LeastRequest, &upstreams, &agents, 1)?;
    let ailb = topology::start_sidecar(Policy::AiLb, &upstreams, &agents, 1)?;
    let ready = topology::wait_ailb_ready(&ailb, &upstreams, Duration::from_secs(15));
    // With no traffic: what each Envoy spends on its own (the filter's ticks, its agent stream,
    // stats), in CPU ms per second. Every sidecar pays it, and at low request rates it is a
    // large part of the CPU per request below.
    let idle = {
        let before = (cpu_secs(plain.pid()), cpu_secs(ailb.pid()));
        let t0 = std::time::Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        let el = t0.elapsed().as_secs_f64();
        let after = (cpu_secs(plain.pid()), cpu_secs(ailb.pid()));
        let ms_per_s = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| (a - b) * 1e3 / el);
        json!({
            "least_request_cpu_ms_per_s": ms_per_s(after.0, before.0),
            "ai_lb_cpu_ms_per_s": ms_per_s(after.1, before.1),
            "secs": el,
            "what": "Envoy process CPU (user + system) with no traffic, ms per second, over one period of secs_per_measurement after the filter was ready",
        })
    };
    let url = |p: Policy| match p {
        Policy::AiLb => format!("http://{}", ailb.listener),
        _ => format!("http://{}", plain.listener),
    };
    let order = |round: usize| {
        if round % 2 == 0 {
            [Policy::LeastRequest, Policy::AiLb]
        } else {
            [Policy::AiLb, Policy::LeastRequest]
        }
    };
    // Enough entries that no closed loop runs out (the loop stops at the trace's span).
    let closed_trace = dir.join("closed.jsonl");
    fixed_trace(env, 20_000.0, secs, &closed_trace)?;
    let workers_arg = workers.to_string();
    let closed_args = ["--closed-loop", workers_arg.as_str(), "--threads", "2"];
    let mut max_rounds: Vec<Value> = Vec::new();
    let (mut plain_rps, mut ailb_rps, mut rps_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut plain_cpu, mut ailb_cpu, mut cpu_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let pid = |p: Policy| match p {
        Policy::AiLb => ailb.pid(),
        _ => plain.pid(),
    };
    for round in 0..rounds {
        let mut row = serde_json::Map::new();
        for p in order(round) {
            let m = measured_replay(
                env,
                &url(p),
                &closed_trace,
                &dir.join(format!("{}.closed.{round}.jsonl", p.name())),
                &closed_args,
                pid(p),
            )?;
            let (s, cpu_us) = (&m.summary, m.cpu_us_per_ok);
            let rps = ok_rps(&m.records);
            row.insert(
                p.name().into(),
                json!({"ok_rps": rps, "errors": s.errors, "timeouts": s.timeouts, "e2e_ms": s.e2e_ms,
                       "envoy_cpu_s": m.cpu_s, "envoy_cpu_us_per_request": cpu_us}),
            );
            match p {
                Policy::AiLb => {
                    ailb_rps.push(rps);
                    ailb_cpu.push(cpu_us.unwrap_or(f64::NAN));
                }
                _ => {
                    plain_rps.push(rps);
                    plain_cpu.push(cpu_us.unwrap_or(f64::NAN));
                }
            }
        }
        if let (Some(a), Some(b)) = (ailb_rps.last(), plain_rps.last()) {
            rps_ratios.push(a / b);
        }
        if let (Some(a), Some(b)) = (ailb_cpu.last(), plain_cpu.last()) {
            cpu_ratios.push(b / a);
        }
        max_rounds.push(Value::Object(row));
    }
    let plain_max = median(plain_rps.clone()).ok_or("no throughput measured")?;
    let ailb_max = median(ailb_rps.clone()).unwrap_or(plain_max);
    // CPU per request and latency at a rate both Envoys keep up with (half of the filter's
    // own maximum, so the filter's Envoy runs at 50 % load): a closed loop's CPU per request
    // falls as throughput rises (more requests per wake-up), so at saturation it also
    // depends on how much CPU the machine leaves each Envoy; and at half of plain Envoy's
    // maximum the filter's Envoy is near its own, where it queues.
    let fh_rate = (ailb_max.min(plain_max) / 2.0).max(1.0);
    let ctx = Ctx {
        env,
        dir: &dir,
        secs,
        rounds,
        sink,
        url: &url,
        pid: &pid,
        order: &order,
    };
    let mut filter_half = open_loop_phase(&ctx, "filter-half", fh_rate)?;
    filter_half["what"] = json!("open loop at half of the filter's (or plain's, if lower) maximum: Envoy process CPU per answered request, microseconds (ratio = plain / ai_lb), and e2e latency");
    let half = open_loop_phase(&ctx, "half", (plain_max / 2.0).max(1.0))?;
    Ok(json!({
        "upstream": if answer.gap_ms == 0 {
            format!("loadgen example sink answering {} tokens at once (SSE); 16-token prompts; one Envoy, 1 worker, per configuration; ai-lb with envoy-config/filter-config.json and an agent announcing the sink (metrics from an idle fake pod)", answer.chunks)
        } else {
            format!("loadgen example sink streaming {} tokens {} ms apart, each its own write (SSE); 16-token prompts; one Envoy, 1 worker, per configuration; ai-lb with envoy-config/filter-config.json and an agent announcing the sink (metrics from an idle fake pod)", answer.chunks, answer.gap_ms)
        },
        "answer_chunks": answer.chunks,
        "answer_gap_ms": answer.gap_ms,
        "ailb_ready": ready,
        "secs_per_measurement": secs,
        "rounds": rounds,
        "closed_loop_workers": workers,
        "max_rps": {
            "least_request_median": plain_max,
            "ai_lb_median": median(ailb_rps.clone()),
            "ratio_of_medians": analysis::ratio(median(ailb_rps), Some(plain_max)),
            "ratio_per_round": rps_ratios,
            "rounds": max_rounds,
        },
        "cpu_per_request": {
            "what": "Envoy process CPU (user + system) per answered request over each closed loop, microseconds; ratio = plain / ai_lb, the req/s each would reach on a core of its own",
            "least_request_us_median": median(plain_cpu.clone()),
            "ai_lb_us_median": median(ailb_cpu.clone()),
            "ratio_of_medians": analysis::ratio(median(plain_cpu), median(ailb_cpu)),
            "ratio_per_round": cpu_ratios,
        },
        "filter_half_load": filter_half,
        "half_load": half,
        "idle": idle,
    }))
}

/// Writes `summary.json` and a short `table.md` for the overhead scenario under `out`.
pub fn write(out: &Path, v: &Value) -> Result<(), Error> {
    let dir = out.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
    let f = |x: &Value| x.as_f64().map_or("–".to_string(), |v| format!("{v:.2}"));
    let h = &v["half_load"];
    let fh = &v["filter_half_load"];
    // The e2e p50 and p99 rows of one open-loop phase ([`open_loop_phase`]).
    let latency = |ph: &Value, rate: &str| {
        format!(
            "| e2e p50 at {rate}, ms | {} | {} | {} µs |\n\
             | e2e p99 at that rate, ms | {} | {} | {} µs (per round: {}) |\n",
            f(&ph["p50_ms_median"]["least_request"]),
            f(&ph["p50_ms_median"]["ai_lb"]),
            ph["added_p50_us"],
            f(&ph["p99_ms_median"]["least_request"]),
            f(&ph["p99_ms_median"]["ai_lb"]),
            ph["added_p99_us_median_of_rounds"],
            ph["added_p99_us_per_round"],
        )
    };
    let table = format!(
        "### overhead (1 Envoy worker, fast upstream, {} rounds of {} s, medians)\n\n`{}`\n\n\
         | measure | least_request | ai_lb | ratio / difference |\n|---|---|---|---|\n\
         | max req/s (closed loop, {} clients) | {} | {} | {} |\n\
         | Envoy CPU per request over that loop, µs | {} | {} | {} (req/s per CPU; per round: {}) |\n\
         | Envoy CPU per request at {} req/s (half of the filter's max), µs | {} | {} | {} (+{} µs; per round: {}) |\n\
         {}{}\n\
         Straight to the sink (no Envoy), p99: {} ms at half of the filter's max, {} ms at half of plain's.\n\n\
         With no traffic, Envoy CPU: {} ms/s plain, {} ms/s with the filter.\n",
        v["rounds"],
        v["secs_per_measurement"],
        v["command"].as_str().unwrap_or(""),
        v["closed_loop_workers"],
        f(&v["max_rps"]["least_request_median"]),
        f(&v["max_rps"]["ai_lb_median"]),
        f(&v["max_rps"]["ratio_of_medians"]),
        f(&v["cpu_per_request"]["least_request_us_median"]),
        f(&v["cpu_per_request"]["ai_lb_us_median"]),
        f(&v["cpu_per_request"]["ratio_of_medians"]),
        v["cpu_per_request"]["ratio_per_round"],
        f(&fh["rate_rps"]),
        f(&fh["least_request_us_median"]),
        f(&fh["ai_lb_us_median"]),
        f(&fh["ratio_of_medians"]),
        f(&fh["added_us_median"]),
        fh["ratio_per_round"],
        latency(fh, "that rate"),
        latency(h, &format!("{} req/s (half of plain's max)", f(&h["rate_rps"]))),
        f(&fh["p99_ms_median"]["direct_to_sink"]),
        f(&h["p99_ms_median"]["direct_to_sink"]),
        f(&v["idle"]["least_request_cpu_ms_per_s"]),
        f(&v["idle"]["ai_lb_cpu_ms_per_s"]),
    );
    std::fs::write(dir.join("table.md"), table).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{cpu_secs, median};

    #[test]
    fn cpu_secs_reads_this_process_and_grows_with_work() {
        let pid = std::process::id();
        let start = cpu_secs(pid).expect("/proc/<pid>/stat of this process");
        // Spin until the kernel has charged 50 ms more (a tick is 10 ms); a parse of the wrong
        // fields would stay put or be None and time out here.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut x = 0u64;
        loop {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            let now = cpu_secs(pid).expect("still readable");
            if now - start >= 0.05 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "CPU time never grew ({x})"
            );
        }
        assert_eq!(cpu_secs(u32::MAX), None, "no such process");
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
        assert_eq!(median(vec![]), None);
    }
}
