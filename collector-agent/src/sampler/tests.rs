use super::*;
use ai_lb_proto::v1::LatencyQuantiles;
use std::sync::atomic::AtomicBool;

fn snap(util: f64, waiting: u32) -> PodSnapshot {
    PodSnapshot {
        identity: Some(PodIdentity {
            address: "10.0.0.1:8000".into(),
            ..Default::default()
        }),
        gpus: vec![GpuStats {
            index: 0,
            utilization: Some(util),
            ..Default::default()
        }],
        inference: Some(InferenceStats {
            waiting: Some(waiting),
            kv_cache_usage: Some(0.5),
            ttft: Some(LatencyQuantiles {
                p99_ms: Some(100.0),
                ..Default::default()
            }),
            ..Default::default()
        }),
        sources: vec![SourceStatus {
            name: "sim".into(),
            state: SourceState::Fresh as i32,
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn small_moves_are_not_meaningful() {
    let th = Thresholds::default();
    let a = snap(0.50, 10);
    let mut b = snap(0.51, 10);
    b.sequence = 7;
    b.sample_time_unix_ms = 123;
    assert!(!meaningful_change(&a, &b, &th));
}

#[test]
fn signal_moves_are_meaningful() {
    let th = Thresholds::default();
    let a = snap(0.50, 10);
    assert!(meaningful_change(&a, &snap(0.60, 10), &th));
    assert!(meaningful_change(&a, &snap(0.50, 11), &th));
    let mut kv = snap(0.50, 10);
    kv.inference.as_mut().unwrap().kv_cache_usage = Some(0.9);
    assert!(meaningful_change(&a, &kv, &th));
    let mut p99 = snap(0.50, 10);
    p99.inference
        .as_mut()
        .unwrap()
        .ttft
        .as_mut()
        .unwrap()
        .p99_ms = Some(150.0);
    assert!(meaningful_change(&a, &p99, &th));
    let mut gone = snap(0.50, 10);
    gone.gpus[0].utilization = None;
    assert!(meaningful_change(&a, &gone, &th));
    // A saturated time-fraction hides the batch; SM occupancy moving is a change.
    let mut busy = snap(1.0, 10);
    busy.gpus[0].sm_occupancy = Some(0.2);
    let mut fuller = busy.clone();
    fuller.gpus[0].sm_occupancy = Some(0.4);
    assert!(meaningful_change(&busy, &fuller, &th));
    assert!(!meaningful_change(&busy, &busy.clone(), &th));
}

#[test]
fn only_jumps_and_state_changes_are_urgent() {
    let a = snap(0.50, 10);
    assert!(!urgent_change(&a, &snap(0.55, 10)), "drift is coalesced");
    assert!(!urgent_change(&a, &snap(0.59, 12)));
    assert!(urgent_change(&a, &snap(0.60, 10)), "a 0.10 jump");
    assert!(urgent_change(&a, &snap(0.99, 10)));
    assert!(urgent_change(&a, &snap(0.50, 20)), "queue doubled");
    let mut idle = snap(0.5, 0);
    assert!(
        !urgent_change(&idle, &snap(0.5, 3)),
        "a few queued requests"
    );
    assert!(urgent_change(&idle, &snap(0.5, 4)));
    let mut full = snap(0.5, 31);
    full.inference.as_mut().unwrap().queue_capacity = Some(32);
    let mut fuller = full.clone();
    fuller.inference.as_mut().unwrap().waiting = Some(32);
    assert!(urgent_change(&full, &fuller), "the queue filled up");
    assert!(urgent_change(&fuller, &full), "and drained from full");
    idle.inference.as_mut().unwrap().kv_cache_usage = Some(0.62);
    assert!(urgent_change(&snap(0.5, 0), &idle), "a KV-cache jump");
    let mut failing = snap(0.5, 10);
    failing.sources[0].state = SourceState::Failing as i32;
    assert!(urgent_change(&a, &failing));
    let mut reason = failing.clone();
    reason.sources[0].reason = "another error text".into();
    assert!(!urgent_change(&failing, &reason), "only the state counts");
    let mut xid = snap(0.5, 10);
    xid.gpus[0].last_xid = Some(79);
    assert!(urgent_change(&a, &xid));
    let mut restarted = snap(0.5, 10);
    restarted.agent_instance = "new".into();
    assert!(urgent_change(&a, &restarted));
    let mut p99 = snap(0.50, 10);
    p99.inference
        .as_mut()
        .unwrap()
        .ttft
        .as_mut()
        .unwrap()
        .p99_ms = Some(900.0);
    assert!(!urgent_change(&a, &p99), "windowed latencies drift");
    assert!(meaningful_change(&a, &p99, &Thresholds::default()));
}

/// A source that counts its samples; `local` says which cadence it is on.
struct Counting {
    name: &'static str,
    local: bool,
    calls: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl Source for Counting {
    fn name(&self) -> &'static str {
        self.name
    }
    fn local(&self) -> bool {
        self.local
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(if self.local {
            Reading {
                gpus: Some(vec![GpuStats {
                    utilization: Some((n % 2) as f64),
                    ..Default::default()
                }]),
                ..Default::default()
            }
        } else {
            Reading {
                inference: Some(InferenceStats {
                    waiting: Some(n as u32),
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
    }
}

/// A sampler (100 ms samples) over counting sources named and marked local as given,
/// its hub, and each source's call counter.
fn counting_sampler(spec: &[(&'static str, bool)]) -> (Sampler, Arc<Hub>, Vec<Arc<AtomicU64>>) {
    let calls: Vec<Arc<AtomicU64>> = spec.iter().map(|_| Arc::new(AtomicU64::new(0))).collect();
    let sources: Vec<Box<dyn Source>> = spec
        .iter()
        .zip(&calls)
        .map(|(&(name, local), c)| {
            Box::new(Counting {
                name,
                local,
                calls: c.clone(),
            }) as Box<dyn Source>
        })
        .collect();
    let (sampler, hub) = test_sampler(sources, Duration::from_millis(100));
    (sampler, hub, calls)
}

/// A sampler over `sources` at `interval`, with a default identity, and its hub.
fn test_sampler(sources: Vec<Box<dyn Source>>, interval: Duration) -> (Sampler, Arc<Hub>) {
    let hub = Hub::new("x".into());
    let sampler = Sampler::new(
        sources,
        vec![],
        IdentityConfig::default(),
        hub.clone(),
        Arc::new(SystemClock),
        interval,
    );
    (sampler, hub)
}

/// Runs `sampler` (model server every 100 ms, GPUs every 20 ms) for `ms` of paused time.
async fn run_for(sampler: Sampler, ms: u64) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let task = tokio::spawn(sampler.run(
        Duration::from_millis(100),
        Duration::from_millis(20),
        stop_rx,
    ));
    tokio::time::sleep(Duration::from_millis(ms)).await;
    stop_tx.send_replace(true);
    task.await.unwrap();
}

async fn run_one_second(sampler: Sampler) {
    run_for(sampler, 1_010).await;
}

#[tokio::test(start_paused = true)]
async fn each_source_keeps_its_own_cadence_and_the_others_last_reading() {
    let (mut sampler, hub, calls) = counting_sampler(&[("sim", true), ("model-server", false)]);
    let (gpu, server) = (calls[0].clone(), calls[1].clone());
    sampler.step().await;
    let local = sampler.step_source(0).await.unwrap();
    assert_eq!(
        server.load(Ordering::Relaxed),
        1,
        "a GPU read skips the model server"
    );
    assert_eq!(gpu.load(Ordering::Relaxed), 2);
    let inf = local.snapshot.inference.unwrap();
    assert_eq!(
        inf.waiting,
        Some(1),
        "the model server's last reading is kept"
    );
    assert_eq!(local.snapshot.sources[1].state, SourceState::Fresh as i32);
    assert!(hub.urgent_changes() >= 1, "utilisation 1 -> 0 is urgent");
    assert!(sampler.step_source(2).await.is_none());

    let (g0, s0) = (gpu.load(Ordering::Relaxed), server.load(Ordering::Relaxed));
    run_one_second(sampler).await;
    let full = server.load(Ordering::Relaxed) - s0;
    let all = gpu.load(Ordering::Relaxed) - g0;
    assert!(
        (10..=12).contains(&full),
        "model-server reads in 1 s at 100 ms: {full}"
    );
    assert!((50..=52).contains(&all), "GPU reads in 1 s at 20 ms: {all}");
    assert_eq!(
        hub.source_reads(),
        vec![
            ("model-server".to_string(), full + s0, 0),
            ("sim".to_string(), all + g0, 0)
        ]
    );
}

/// A model-server source that answers after `delay` (the test's paused clock), or never
/// once `frozen` is set; counts its answers.
struct Freezable {
    delay: Duration,
    frozen: Arc<AtomicBool>,
    answers: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl Source for Freezable {
    fn name(&self) -> &'static str {
        "model-server"
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
        if self.frozen.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.delay).await;
        self.answers.fetch_add(1, Ordering::Relaxed);
        Ok(Reading {
            inference: Some(InferenceStats {
                waiting: Some(2),
                ..Default::default()
            }),
            ..Default::default()
        })
    }
}

/// A local GPU source whose reading never changes; counts its reads.
struct SteadyGpu(Arc<AtomicU64>);

#[async_trait::async_trait]
impl Source for SteadyGpu {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn local(&self) -> bool {
        true
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(Reading {
            gpus: Some(vec![GpuStats {
                utilization: Some(0.5),
                ..Default::default()
            }]),
            ..Default::default()
        })
    }
}

/// What a [`freezable_sampler`] test holds on to.
struct Frozen {
    hub: Arc<Hub>,
    frozen: Arc<AtomicBool>,
    gpu_reads: Arc<AtomicU64>,
    answers: Arc<AtomicU64>,
}

/// A sampler at the 50 ms default over a steady local GPU source and a [`Freezable`]
/// model server answering after `delay`.
fn freezable_sampler(delay: Duration) -> (Sampler, Frozen) {
    let f = Frozen {
        hub: Hub::new("x".into()),
        frozen: Arc::new(AtomicBool::new(false)),
        gpu_reads: Arc::new(AtomicU64::new(0)),
        answers: Arc::new(AtomicU64::new(0)),
    };
    let sources: Vec<Box<dyn Source>> = vec![
        Box::new(SteadyGpu(f.gpu_reads.clone())),
        Box::new(Freezable {
            delay,
            frozen: f.frozen.clone(),
            answers: f.answers.clone(),
        }),
    ];
    let sampler = Sampler::new(
        sources,
        vec![],
        IdentityConfig::default(),
        f.hub.clone(),
        Arc::new(SystemClock),
        Duration::from_millis(50),
    );
    (sampler, f)
}

fn model_server_status(hub: &Hub) -> SourceStatus {
    hub.latest().unwrap().snapshot.sources[1].clone()
}

#[tokio::test(start_paused = true)]
async fn a_frozen_model_server_is_reported_failing_after_the_stall_time_not_the_timeout() {
    let (mut sampler, f) = freezable_sampler(Duration::ZERO);
    let hub = f.hub.clone();
    assert_eq!(sampler.stall_after, Duration::from_millis(150));
    assert_eq!(sampler.source_timeout, Duration::from_millis(500));
    sampler.step().await;
    assert_eq!(model_server_status(&hub).state, SourceState::Fresh as i32);
    f.frozen.store(true, Ordering::Relaxed);
    let mut urgent = hub.subscribe_urgent();
    urgent.borrow_and_update();
    let t0 = tokio::time::Instant::now();
    let task = tokio::spawn(async move { sampler.step().await });
    urgent.changed().await.unwrap();
    assert_eq!(
        t0.elapsed(),
        Duration::from_millis(150),
        "pushed at the stall time"
    );
    let interim = hub.latest().unwrap().snapshot.clone();
    let ms = &interim.sources[1];
    assert_eq!(ms.state, SourceState::Failing as i32);
    assert!(ms.reason.contains("no answer for 150ms"), "{}", ms.reason);
    assert!(ms.last_success_age_ms.is_some(), "it answered before");
    assert_eq!(
        interim.inference, None,
        "a stalled source's reading is dropped"
    );
    assert_eq!(
        interim.sources[0].state,
        SourceState::Fresh as i32,
        "the GPU answered"
    );
    assert!(!interim.gpus.is_empty());
    // The read itself still ends at the timeout, and records it.
    let done = task.await.unwrap();
    assert_eq!(t0.elapsed(), Duration::from_millis(500));
    let ms = &done.snapshot.sources[1];
    assert_eq!(ms.state, SourceState::Failing as i32);
    assert_eq!(
        ms.consecutive_failures, 1,
        "the interim report is not a second failure"
    );
    assert!(
        ms.reason.contains("no answer within 500ms"),
        "{}",
        ms.reason
    );
}

/// Issue 31, at the sampler: while the model server is frozen the GPU keeps its 20 ms
/// cadence (it used to be read once per 500 ms timeout), and every snapshot the GPU
/// publishes meanwhile still shows the model server failing, without its reading.
#[tokio::test(start_paused = true)]
async fn a_frozen_model_server_does_not_hold_up_the_gpu_reads() {
    let (mut sampler, f) = freezable_sampler(Duration::ZERO);
    sampler.step().await;
    f.frozen.store(true, Ordering::Relaxed);
    let (g0, a0) = (
        f.gpu_reads.load(Ordering::Relaxed),
        f.answers.load(Ordering::Relaxed),
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let task = tokio::spawn(sampler.run(
        Duration::from_millis(50),
        Duration::from_millis(20),
        stop_rx,
    ));
    let mut last_seq = 0;
    for step in 1..=10u64 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = f.hub.latest().unwrap().render(Instant::now());
        assert!(s.sequence > last_seq, "published since the last look");
        last_seq = s.sequence;
        if step >= 2 {
            let ms = &s.sources[1];
            assert_eq!(ms.state, SourceState::Failing as i32, "at {step}00 ms");
            assert!(ms.last_success_age_ms.is_some());
            assert_eq!(s.inference, None, "at {step}00 ms");
        }
        assert_eq!(s.sources[0].state, SourceState::Fresh as i32);
    }
    // Past the second timeout (1000 ms) before stopping: stopping at the very instant it
    // is due left it to the scheduler's order whether it was counted.
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop_tx.send_replace(true);
    task.await.unwrap();
    let gpu = f.gpu_reads.load(Ordering::Relaxed) - g0;
    assert!(
        (52..=55).contains(&gpu),
        "GPU reads in 1.05 s at 20 ms: {gpu}"
    );
    assert_eq!(f.answers.load(Ordering::Relaxed), a0, "still frozen");
    let failed = f
        .hub
        .source_reads()
        .into_iter()
        .find(|(n, _, _)| n == "model-server")
        .map(|(_, _, bad)| bad);
    assert_eq!(failed, Some(2), "timed out at 500 ms and 1000 ms");
}

#[tokio::test(start_paused = true)]
async fn a_slow_model_server_is_failing_between_the_stall_time_and_its_answer() {
    let (mut sampler, _f) = freezable_sampler(Duration::from_millis(300));
    // Each read reports it failing at 150 ms and fresh again on its answer at 300 ms.
    let first = sampler.step_source(1).await.unwrap();
    assert_eq!(first.snapshot.sources[1].state, SourceState::Fresh as i32);
    let seq = first.snapshot.sequence;
    let done = sampler.step_source(1).await.unwrap();
    assert_eq!(done.snapshot.sources[1].state, SourceState::Fresh as i32);
    assert_eq!(done.snapshot.inference.unwrap().waiting, Some(2));
    assert_eq!(
        done.snapshot.sequence,
        seq + 2,
        "one interim snapshot in between"
    );
    // A stall time at or past the timeout publishes no interim snapshot.
    let (sampler, _f) = freezable_sampler(Duration::from_millis(300));
    let mut sampler = sampler.with_stall_after(Duration::from_millis(500));
    let a = sampler.step_source(1).await.unwrap().snapshot.sequence;
    assert_eq!(
        sampler.step_source(1).await.unwrap().snapshot.sequence,
        a + 1
    );
}

/// A local (GPU) source that never answers.
struct HungGpu;

#[async_trait::async_trait]
impl Source for HungGpu {
    fn name(&self) -> &'static str {
        "nvml"
    }
    fn local(&self) -> bool {
        true
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
        std::future::pending().await
    }
}

#[tokio::test(start_paused = true)]
async fn a_hung_gpu_read_fails_at_the_stall_time() {
    let (mut sampler, _hub) = test_sampler(vec![Box::new(HungGpu)], Duration::from_millis(50));
    let t0 = tokio::time::Instant::now();
    let p = sampler.step_source(0).await.unwrap();
    assert_eq!(t0.elapsed(), Duration::from_millis(150));
    let gpu = &p.snapshot.sources[0];
    assert_eq!(gpu.state, SourceState::Failing as i32);
    assert!(
        gpu.reason.contains("no answer within 150ms"),
        "{}",
        gpu.reason
    );
}

/// The other way round: a hung GPU read does not hold up the model server's reads.
#[tokio::test(start_paused = true)]
async fn a_hung_gpu_read_does_not_hold_up_the_model_server() {
    let answers = Arc::new(AtomicU64::new(0));
    let sources: Vec<Box<dyn Source>> = vec![
        Box::new(HungGpu),
        Box::new(Freezable {
            delay: Duration::ZERO,
            frozen: Arc::new(AtomicBool::new(false)),
            answers: answers.clone(),
        }),
    ];
    let (sampler, hub) = test_sampler(sources, Duration::from_millis(100));
    run_one_second(sampler).await;
    let n = answers.load(Ordering::Relaxed);
    assert!((10..=12).contains(&n), "model-server reads in 1 s: {n}");
    let s = hub.latest().unwrap().snapshot.clone();
    assert_eq!(s.sources[0].state, SourceState::Failing as i32);
    assert_eq!(s.sources[1].state, SourceState::Fresh as i32);
}

#[test]
fn stall_time_is_three_intervals_at_least_150_ms_within_the_timeout() {
    let ms = Duration::from_millis;
    let t = Sampler::default_stall_after;
    assert_eq!(t(ms(50), ms(500)), ms(150));
    assert_eq!(t(ms(10), ms(500)), ms(150));
    assert_eq!(t(ms(100), ms(500)), ms(300));
    assert_eq!(t(ms(1000), ms(1000)), ms(1000));
}

#[tokio::test(start_paused = true)]
async fn without_local_sources_only_model_server_reads_run() {
    let (sampler, _hub, calls) = counting_sampler(&[("model-server", false)]);
    run_one_second(sampler).await;
    let n = calls[0].load(Ordering::Relaxed);
    assert!((10..=12).contains(&n), "{n}");
}

/// With no source configured the snapshot (identity, absent sources) is still published
/// every interval, so receivers do not see it age.
#[tokio::test(start_paused = true)]
async fn without_any_source_the_snapshot_is_still_renewed() {
    let hub = Hub::new("x".into());
    let sampler = Sampler::new(
        vec![],
        vec!["nvml", "model-server"],
        IdentityConfig::default(),
        hub.clone(),
        Arc::new(SystemClock),
        Duration::from_millis(100),
    );
    run_one_second(sampler).await;
    let n = hub.samples_taken();
    assert!((10..=12).contains(&n), "{n}");
    let s = hub.latest().unwrap().snapshot.clone();
    assert!(s
        .sources
        .iter()
        .all(|x| x.state == SourceState::Absent as i32));
}

#[test]
fn a_prefix_cache_change_is_meaningful_not_urgent() {
    use ai_lb_proto::v1::PrefixCacheSummary;
    let th = Thresholds::default();
    let mut a = snap(0.5, 10);
    a.prefix_cache = Some(PrefixCacheSummary {
        block_tokens: 64,
        keys: vec![1, 2],
        truncated: false,
        model: "m".into(),
    });
    assert!(!meaningful_change(&a, &a.clone(), &th));
    let mut b = a.clone();
    b.prefix_cache.as_mut().unwrap().keys.push(3);
    assert!(meaningful_change(&a, &b, &th));
    assert!(!urgent_change(&a, &b));
    let mut none = a.clone();
    none.prefix_cache = None;
    assert!(meaningful_change(&a, &none, &th));
    assert!(!urgent_change(&a, &none));
    // So is a hit rate that moved (or appeared).
    let mut hit = a.clone();
    hit.inference.as_mut().unwrap().prefix_cache_hit_rate = Some(0.5);
    assert!(meaningful_change(&a, &hit, &th));
    assert!(!urgent_change(&a, &hit));
}

#[test]
fn kv_capacity_change_is_meaningful() {
    let th = Thresholds::default();
    let mut a = snap(0.50, 10);
    a.inference.as_mut().unwrap().kv_capacity_tokens = Some(400_000);
    let same = a.clone();
    assert!(!meaningful_change(&a, &same, &th));
    let mut grown = a.clone();
    grown.inference.as_mut().unwrap().kv_capacity_tokens = Some(400_016);
    assert!(meaningful_change(&a, &grown, &th), "any change is pushed");
    let mut lost = a.clone();
    lost.inference.as_mut().unwrap().kv_capacity_tokens = None;
    assert!(meaningful_change(&a, &lost, &th));
}

#[test]
fn configured_capacities_win_over_the_model_server() {
    let t0 = Instant::now();
    let mut track = SourceTrack::new("model-server");
    let reading = Ok(Reading {
        inference: Some(InferenceStats {
            queue_capacity: Some(8),
            kv_capacity_tokens: Some(32_768),
            ..Default::default()
        }),
        ..Default::default()
    });
    track.record(&reading, t0);
    let tracks = [track];
    let outcomes = [reading];
    let merged = |id: &IdentityConfig| {
        merge(id, &tracks, &outcomes, &[], t0, 0, 1, "x")
            .inference
            .unwrap()
    };
    let engine_says = merged(&IdentityConfig::default());
    assert_eq!(engine_says.kv_capacity_tokens, Some(32_768));
    assert_eq!(engine_says.queue_capacity, Some(8));
    let operator_says = merged(&IdentityConfig {
        queue_capacity: Some(64),
        kv_capacity_tokens: Some(400_000),
        ..Default::default()
    });
    assert_eq!(operator_says.kv_capacity_tokens, Some(400_000));
    assert_eq!(operator_says.queue_capacity, Some(64));
}

#[test]
fn the_configured_model_version_is_every_model_s_version() {
    let t0 = Instant::now();
    let id = IdentityConfig {
        address: "10.0.0.1:8000".into(),
        models: vec!["m".into(), "n".into()],
        model_version: Some("v2".into()),
        ..Default::default()
    };
    let s = merge(&id, &[], &[], &[], t0, 0, 1, "x");
    let models = &s.identity.as_ref().unwrap().models;
    assert_eq!(models.len(), 2);
    assert!(models.iter().all(|m| m.version == "v2"));
    let none = merge(&IdentityConfig::default(), &[], &[], &[], t0, 0, 1, "x");
    assert!(none
        .identity
        .unwrap()
        .models
        .iter()
        .all(|m| m.version.is_empty()));
}

#[test]
fn source_state_and_errors_are_meaningful() {
    let th = Thresholds::default();
    let a = snap(0.5, 1);
    let mut b = snap(0.5, 1);
    b.sources[0].state = SourceState::Failing as i32;
    b.sources[0].reason = "sim: HTTP 500".into();
    assert!(meaningful_change(&a, &b, &th));
    let mut c = b.clone();
    c.sources[0].reason = "sim: cannot connect".into();
    assert!(meaningful_change(&b, &c, &th));
    let mut x = snap(0.5, 1);
    x.gpus[0].xid_errors = Some(1);
    assert!(meaningful_change(&a, &x, &th));
    let mut m = snap(0.5, 1);
    m.identity.as_mut().unwrap().models = vec![ModelInfo {
        name: "llama".into(),
        ..Default::default()
    }];
    assert!(meaningful_change(&a, &m, &th));
}

#[test]
fn merge_reports_health_and_drops_failed_data() {
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_millis(300);
    let mut ok = SourceTrack::new("sim");
    let mut bad = SourceTrack::new("model-server");
    let good = Ok(Reading {
        gpus: Some(vec![GpuStats {
            utilization: Some(0.4),
            ..Default::default()
        }]),
        ..Default::default()
    });
    ok.record(&good, t0);
    ok.record(&good, t1);
    bad.record(&Ok(Reading::default()), t0);
    let err = Err("model-server: HTTP 503 from x".to_string());
    bad.record(&err, t1);
    let id = IdentityConfig {
        address: "10.0.0.1:8000".into(),
        models: vec!["m".into()],
        queue_capacity: Some(32),
        ..Default::default()
    };
    let s = merge(&id, &[ok, bad], &[good, err], &["nvml"], t1, 5, 9, "abc");
    assert_eq!(s.gpus.len(), 1);
    assert!(s.inference.is_none());
    assert_eq!(s.sequence, 9);
    assert_eq!(s.agent_instance, "abc");
    assert_eq!(s.identity.as_ref().unwrap().models[0].name, "m");
    assert_eq!(s.sources[0].state, SourceState::Fresh as i32);
    assert_eq!(s.sources[0].last_success_age_ms, Some(0));
    assert_eq!(s.sources[1].state, SourceState::Failing as i32);
    assert_eq!(s.sources[1].consecutive_failures, 1);
    assert_eq!(s.sources[1].last_success_age_ms, Some(300));
    assert!(s.sources[1].reason.contains("503"));
    assert_eq!(s.sources[2].state, SourceState::Absent as i32);
}

#[test]
fn render_grows_ages() {
    let t0 = Instant::now();
    let mut s = snap(0.5, 1);
    s.sources[0].last_success_age_ms = Some(20);
    let p = Published {
        snapshot: s,
        taken: t0,
    };
    let r = p.render(t0 + Duration::from_millis(250));
    assert_eq!(r.age_ms, 250);
    assert_eq!(r.sources[0].last_success_age_ms, Some(270));
}
