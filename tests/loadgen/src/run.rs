//! Decides when requests leave and where results go: an open-loop dispatcher that sends each
//! trace entry at its scheduled offset regardless of responses (only a large in-flight safety
//! cap, whose hits are counted), and a collector that gathers records and draws `--live`.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::Client;
use crate::live::{self, Tally};
use crate::stats::{Outcome, Record};
use crate::workload::TraceEntry;

#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    pub timeout: Duration,
    pub max_in_flight: usize,
    /// Print the live table every second to stdout.
    pub live: bool,
}

#[derive(Debug)]
pub struct RunResult {
    /// Sorted by id.
    pub records: Vec<Record>,
    /// Run start to the end of the last request, seconds.
    pub wall_s: f64,
    pub in_flight_cap_hits: u64,
    pub peak_in_flight: u64,
}

/// Replays `trace` against `client`. Ends after the last entry is sent and every request has
/// finished, which the client timeout bounds.
pub async fn run(client: Client, trace: Arc<Vec<TraceEntry>>, opts: RunOptions) -> RunResult {
    let start = Instant::now();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (tx, collector) = start_collector(start, &in_flight, opts.live, trace.len());

    let mut cap_hits = 0u64;
    for i in 0..trace.len() {
        let e = &trace[i];
        let due = start + Duration::from_micros(e.at_us);
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
        }
        let now_in_flight = in_flight.load(Ordering::Relaxed);
        if now_in_flight >= opts.max_in_flight {
            cap_hits += 1;
            let _ = tx.send(skipped(e, start));
            continue;
        }
        let n = in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        peak.fetch_max(n, Ordering::Relaxed);
        let (client, trace, tx, in_flight) =
            (client.clone(), trace.clone(), tx.clone(), in_flight.clone());
        tokio::spawn(async move {
            let rec = client.send(&trace[i], start, opts.timeout).await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            let _ = tx.send(rec);
        });
    }
    drop(tx);
    let (mut records, end) = collector.await.unwrap_or_default();
    records.sort_by_key(|r| r.id);
    RunResult {
        records,
        wall_s: end.map_or(0.0, |e| e.duration_since(start).as_secs_f64()),
        in_flight_cap_hits: cap_hits,
        peak_in_flight: peak.load(Ordering::Relaxed) as u64,
    }
}

/// Replays `trace` in a closed loop: `workers` tasks each send the next unsent entry as soon
/// as their previous request ended (arrival times ignored), until the trace's span (its last
/// arrival offset) has passed or every entry was sent. Records keep the entries' ids.
pub async fn run_closed(
    client: Client,
    trace: Arc<Vec<TraceEntry>>,
    workers: usize,
    opts: RunOptions,
) -> RunResult {
    let start = Instant::now();
    let span = Duration::from_micros(trace.last().map_or(0, |e| e.at_us));
    let next = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (tx, collector) = start_collector(start, &in_flight, opts.live, trace.len());
    let mut tasks = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (client, trace, tx, next, in_flight) = (
            client.clone(),
            trace.clone(),
            tx.clone(),
            next.clone(),
            in_flight.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while start.elapsed() < span {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = trace.get(i) else { break };
                in_flight.fetch_add(1, Ordering::Relaxed);
                let rec = client.send(e, start, opts.timeout).await;
                in_flight.fetch_sub(1, Ordering::Relaxed);
                let _ = tx.send(rec);
            }
        }));
    }
    drop(tx);
    for t in tasks {
        let _ = t.await;
    }
    let (mut records, end) = collector.await.unwrap_or_default();
    records.sort_by_key(|r| r.id);
    RunResult {
        records,
        wall_s: end.map_or(0.0, |e| e.duration_since(start).as_secs_f64()),
        in_flight_cap_hits: 0,
        peak_in_flight: workers as u64,
    }
}

type Collected = (Vec<Record>, Option<Instant>);

/// Spawns the task that gathers records (and draws `--live`); send records into the returned
/// sender, drop it when done, then await the handle.
fn start_collector(
    start: Instant,
    in_flight: &Arc<AtomicUsize>,
    live: bool,
    expected: usize,
) -> (
    mpsc::UnboundedSender<Record>,
    tokio::task::JoinHandle<Collected>,
) {
    let (tx, rx) = mpsc::unbounded_channel::<Record>();
    let handle = tokio::spawn(collect(rx, start, in_flight.clone(), live, expected));
    (tx, handle)
}

fn skipped(e: &TraceEntry, start: Instant) -> Record {
    Record {
        id: e.id,
        tag: e.tag,
        prompt_tokens: e.prompt_tokens,
        max_tokens: e.max_tokens,
        scheduled_us: e.at_us,
        sent_us: start.elapsed().as_micros() as u64,
        outcome: Outcome::SkippedInFlightCap,
        status: None,
        pod: None,
        ttft_ms: None,
        e2e_ms: None,
        output_tokens: 0,
        tokens_from_usage: false,
        error: Some("in-flight cap reached".into()),
    }
}

async fn collect(
    mut rx: mpsc::UnboundedReceiver<Record>,
    start: Instant,
    in_flight: Arc<AtomicUsize>,
    live: bool,
    expected: usize,
) -> Collected {
    let mut records = Vec::with_capacity(expected);
    let mut end = None;
    let mut last = Tally::default();
    let mut cum = Tally::default();
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let tty = std::io::stdout().is_terminal();
    loop {
        tokio::select! {
            r = rx.recv() => match r {
                Some(r) => {
                    if live {
                        last.add(&r);
                        cum.add(&r);
                    }
                    if r.outcome != Outcome::SkippedInFlightCap {
                        end = Some(Instant::now());
                    }
                    records.push(r);
                }
                None => break,
            },
            _ = tick.tick(), if live => {
                let frame = live::render(start.elapsed().as_secs_f64(), in_flight.load(Ordering::Relaxed), &mut last, &mut cum);
                let mut out = std::io::stdout().lock();
                let _ = if tty { write!(out, "\x1b[2J\x1b[H{frame}") } else { writeln!(out, "{frame}") };
                let _ = out.flush();
                last = Tally::default();
            }
        }
    }
    (records, end)
}
