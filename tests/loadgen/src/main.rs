//! Decides the order of a run: parse flags, build or read the trace, replay it, report.
//! Exit status: 0 done, 1 runtime failure (I/O), 2 invalid flags or trace.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

use ai_lb_loadgen::client::Client;
use ai_lb_loadgen::config::Cli;
use ai_lb_loadgen::report;
use ai_lb_loadgen::run::{run, run_closed, RunOptions};
use ai_lb_loadgen::stats::summarize;
use ai_lb_loadgen::workload::{self, EntryKind, Tag, TraceEntry};

enum Failure {
    Usage(String),
    Runtime(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Runtime(e)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse(); // exits 2 naming flag and value on bad input
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(e)) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn load_trace(cli: &Cli) -> Result<Vec<TraceEntry>, Failure> {
    if let Some(p) = &cli.trace_in {
        let f = File::open(p).map_err(|e| {
            Failure::Usage(format!(
                "invalid value '{}' for '--trace-in': {e}",
                p.display()
            ))
        })?;
        return workload::read_trace(BufReader::new(f)).map_err(|e| {
            Failure::Usage(format!(
                "invalid value '{}' for '--trace-in': {e}",
                p.display()
            ))
        });
    }
    let trace = workload::generate(
        cli.seed,
        cli.rate,
        cli.arrival(),
        cli.bounds(),
        &cli.workload(),
    )
    .map_err(|e| Failure::Usage(e.to_string()))?;
    if trace.is_empty() {
        return Err(Failure::Usage(format!(
            "the schedule is empty: '--rate' {} with '--duration' {:?} yields no request",
            cli.rate, cli.duration
        )));
    }
    if let Some(p) = &cli.trace_out {
        let f = File::create(p).with_context(|| format!("creating --trace-out {}", p.display()))?;
        workload::write_trace(BufWriter::new(f), &trace)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(trace)
}

fn describe(trace: &[TraceEntry]) -> String {
    let n = trace.len();
    let long = trace.iter().filter(|e| e.tag == Tag::Long).count();
    let span = trace.last().map_or(0.0, |e| e.at_us as f64 / 1e6);
    let p: u64 = trace.iter().map(|e| u64::from(e.prompt_tokens)).sum();
    let o: u64 = trace.iter().map(|e| u64::from(e.max_tokens)).sum();
    let sessions = trace
        .iter()
        .filter(|e| e.kind() == EntryKind::Session)
        .count();
    if sessions > 0 {
        let turns: usize = trace.iter().map(TraceEntry::requests).sum();
        let answers: u64 = trace
            .iter()
            .flat_map(TraceEntry::all_max_tokens)
            .map(u64::from)
            .sum();
        let groups: BTreeSet<u32> = trace.iter().filter_map(|e| e.group).collect();
        return format!(
            "trace: {sessions} sessions ({turns} turns, {:.2} per session, {} groups) starting over {span:.2} s; mean first prompt {:.0} tokens, mean max_tokens {:.1}",
            turns as f64 / sessions as f64,
            groups.len(),
            p as f64 / n.max(1) as f64,
            answers as f64 / turns.max(1) as f64
        );
    }
    let groups: BTreeSet<u32> = trace.iter().filter_map(|e| e.group).collect();
    let chat = if groups.is_empty() {
        String::new()
    } else {
        format!(" in {} groups", groups.len())
    };
    format!(
        "trace: {n} requests ({long} long){chat} over {span:.2} s; mean prompt {:.0} tokens, mean max_tokens {:.0}",
        p as f64 / n.max(1) as f64,
        o as f64 / n.max(1) as f64
    )
}

/// Every request in flight holds a socket: lift the soft open-file limit (often 1024) toward
/// `--max-in-flight`, and warn when the hard limit is lower.
fn raise_fd_limit(max_in_flight: usize) {
    let want = max_in_flight as u64 + 256;
    match rlimit::increase_nofile_limit(want) {
        Ok(got) if got < want => eprintln!(
            "warning: open-file limit is {got}; more than ~{} requests in flight will fail to connect (lower '--max-in-flight' or raise 'ulimit -n')",
            got.saturating_sub(256)
        ),
        Ok(_) => {}
        Err(e) => eprintln!("warning: could not raise the open-file limit: {e}"),
    }
}

fn real_main(cli: Cli) -> Result<(), Failure> {
    let trace = load_trace(&cli)?;
    println!("{}", describe(&trace));
    if cli.dry_run {
        return Ok(());
    }
    raise_fd_limit(cli.max_in_flight);
    let max_prompt = trace.iter().map(|e| e.prompt_tokens).max().unwrap_or(1);
    let client = Client::new(cli.target(), max_prompt).prepare(&trace);
    let opts = RunOptions {
        timeout: cli.timeout,
        max_in_flight: cli.max_in_flight,
        live: cli.live,
    };
    let rt = if cli.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(cli.threads))
            .enable_all()
            .build()
    }
    .context("starting the async runtime")?;
    let trace = Arc::new(trace);
    // Taken just before the run's own start instant (microseconds apart).
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let result = match cli.closed_loop {
        Some(workers) => rt.block_on(run_closed(client, trace, workers, opts)),
        None => rt.block_on(run(client, trace, opts)),
    };
    let mut summary = summarize(
        &result.records,
        result.wall_s,
        result.in_flight_cap_hits,
        result.peak_in_flight,
    );
    summary.started_unix_ms = Some(started_unix_ms);
    print!("{}", report::render(&summary));
    if let Some(p) = &cli.json {
        let f = File::create(p).with_context(|| format!("creating --json {}", p.display()))?;
        let mut w = BufWriter::new(f);
        serde_json::to_writer_pretty(&mut w, &summary).context("writing --json")?;
        w.write_all(b"\n")
            .and_then(|()| w.flush())
            .context("writing --json")?;
    }
    if let Some(p) = &cli.records {
        let f = File::create(p).with_context(|| format!("creating --records {}", p.display()))?;
        let mut w = BufWriter::new(f);
        for r in &result.records {
            serde_json::to_writer(&mut w, r).context("writing --records")?;
            w.write_all(b"\n").context("writing --records")?;
        }
        w.flush().context("writing --records")?;
    }
    Ok(())
}
