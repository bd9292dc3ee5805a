//! Decides when requests leave and where results go: an open-loop dispatcher that sends each
//! trace entry at its scheduled offset regardless of responses (only a large in-flight safety
//! cap, whose hits are counted), and a collector that gathers records and draws `--live`.
//! A multi-turn session starts at its offset like any entry; its later turns are closed loop
//! (each leaves its think time after the previous answer ended), and a turn that fails, times
//! out or meets the cap ends the session, its remaining turns recorded as not sent.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::{Client, Session};
use crate::live::{self, Tally};
use crate::stats::{Outcome, Record};
use crate::workload::{EntryKind, TraceEntry};

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
    let expected = trace.iter().map(TraceEntry::requests).sum();
    let (tx, collector) = start_collector(start, &in_flight, opts.live, expected);
    let session_cap_hits = Arc::new(AtomicU64::new(0));

    let mut cap_hits = 0u64;
    for i in 0..trace.len() {
        let e = &trace[i];
        let due = start + Duration::from_micros(e.at_us);
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
        }
        if e.kind() == EntryKind::Session {
            let gate = Gate {
                in_flight: in_flight.clone(),
                peak: peak.clone(),
                cap_hits: session_cap_hits.clone(),
                max: opts.max_in_flight,
            };
            let (client, trace, tx) = (client.clone(), trace.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(e) = trace.get(i) {
                    run_session(&client, e, start, opts.timeout, &gate, &tx).await;
                }
            });
            continue;
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
        in_flight_cap_hits: cap_hits + session_cap_hits.load(Ordering::Relaxed),
        peak_in_flight: peak.load(Ordering::Relaxed) as u64,
    }
}

/// The in-flight accounting a session's turns go through.
#[derive(Debug, Clone)]
struct Gate {
    in_flight: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    cap_hits: Arc<AtomicU64>,
    /// The cap; usize::MAX in closed loop (the workers bound concurrency).
    max: usize,
}

/// Runs the turns of session `e`: the first at its offset (already reached), each later one
/// its think time after the previous answer ended. Sends one record per turn, the turns after
/// a failed, timed-out or capped one as [`Outcome::SessionEnded`].
async fn run_session(
    client: &Client,
    e: &TraceEntry,
    start: Instant,
    timeout: Duration,
    gate: &Gate,
    tx: &mpsc::UnboundedSender<Record>,
) {
    let mut session = Session::new(client, e);
    let mut due = start + Duration::from_micros(e.at_us);
    let mut ended = false;
    for (k, turn) in e.turns.iter().enumerate() {
        if ended {
            let mut r = Record::new(
                e.id + k as u64,
                e.tag,
                0,
                turn.max_tokens,
                start.elapsed().as_micros() as u64,
            );
            r.outcome = Outcome::SessionEnded;
            r.group = e.group;
            r.session = e.session;
            r.turn = Some(k as u32 + 1);
            let _ = tx.send(r);
            continue;
        }
        if k > 0 {
            due += Duration::from_micros(turn.think_us);
            tokio::time::sleep_until(due).await;
        }
        let scheduled_us = due.duration_since(start).as_micros() as u64;
        if gate.in_flight.load(Ordering::Relaxed) >= gate.max {
            gate.cap_hits.fetch_add(1, Ordering::Relaxed);
            let mut r = Record::new(e.id + k as u64, e.tag, 0, turn.max_tokens, scheduled_us);
            r.sent_us = start.elapsed().as_micros() as u64;
            r.outcome = Outcome::SkippedInFlightCap;
            r.error = Some("in-flight cap reached".into());
            r.group = e.group;
            r.session = e.session;
            r.turn = Some(k as u32 + 1);
            let _ = tx.send(r);
            ended = true;
            continue;
        }
        let n = gate.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        gate.peak.fetch_max(n, Ordering::Relaxed);
        let rec = session.turn(k, scheduled_us, start, timeout).await;
        gate.in_flight.fetch_sub(1, Ordering::Relaxed);
        due = Instant::now();
        ended = rec.outcome != Outcome::Ok;
        let _ = tx.send(rec);
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
    let expected = trace.iter().map(TraceEntry::requests).sum();
    let (tx, collector) = start_collector(start, &in_flight, opts.live, expected);
    let gate = Gate {
        in_flight: in_flight.clone(),
        peak: Arc::new(AtomicUsize::new(0)),
        cap_hits: Arc::new(AtomicU64::new(0)),
        max: usize::MAX,
    };
    let mut tasks = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (client, trace, tx, next, in_flight, gate) = (
            client.clone(),
            trace.clone(),
            tx.clone(),
            next.clone(),
            in_flight.clone(),
            gate.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while start.elapsed() < span {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = trace.get(i) else { break };
                if e.kind() == EntryKind::Session {
                    // Think times still separate its turns; the worker waits them out.
                    run_session(&client, e, start, opts.timeout, &gate, &tx).await;
                    continue;
                }
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
    let mut r = Record::new(e.id, e.tag, e.prompt_tokens, e.max_tokens, e.at_us);
    r.sent_us = start.elapsed().as_micros() as u64;
    r.outcome = Outcome::SkippedInFlightCap;
    r.error = Some("in-flight cap reached".into());
    r.group = e.group;
    r.user = e.user;
    r.prefix_tokens = e
        .question
        .map(|_| crate::workload::system_prefix_tokens(e.system));
    r
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
                    if r.was_sent() {
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
