//! `versions` (issue 30 part 3): requests pinned by `x-model-version` go only to that version's
//! pods or are refused; the others split between versions by weight; each version's breaker
//! domain trips on its own window (failures > minFailures and ratio > failureRatio), stays
//! open `openMs`, admits `halfOpenRequests` half-open, and a tripped canary leaves stable's
//! share, domain and pod breakers untouched. Time and randomness are injected (seeded).

mod support;

use ai_lb_filter_core::breaker::BreakerState;
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::lifecycle::{steer_checked, Rejected};
use ai_lb_filter_core::picker::{Decision, RequestSize, Router, VersionRoute};
use ai_lb_filter_core::versions::{DomainConfig, Domains, RejectReason, VersionsConfig};
use ai_lb_proto::{
    GpuStats, InferenceStats, ModelInfo, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{MockHost, NoStats, SyncWorker};

const MODEL: &str = "m";
const T0: u64 = 1_000;

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

/// Pods with these versions ("" = none reported), all equally loaded.
fn event(versions: &[&str], seq: u64) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: versions
            .iter()
            .enumerate()
            .map(|(i, v)| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: addr(i),
                        pod_name: format!("pod-{i}"),
                        models: vec![ModelInfo {
                            name: MODEL.into(),
                            version: (*v).into(),
                            adapters: Vec::new(),
                        }],
                        ..Default::default()
                    }),
                    gpus: vec![GpuStats {
                        utilization: Some(0.3),
                        ..Default::default()
                    }],
                    inference: Some(InferenceStats {
                        waiting: Some(0),
                        running: Some(1),
                        queue_capacity: Some(8),
                        ..Default::default()
                    }),
                    sequence: seq,
                    agent_instance: format!("agent-{i}"),
                    ..Default::default()
                }),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn config(versions: &str) -> FilterConfig {
    FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1{}}}"#,
            if versions.is_empty() {
                String::new()
            } else {
                format!(r#","versions":{versions}"#)
            }
        )
        .as_bytes(),
    )
    .unwrap()
}

/// Stable v1 on pods 0-3, canary v2 on pod 4.
const POOL: [&str; 5] = ["v1", "v1", "v1", "v1", "v2"];
const SPLIT: &str = r#"{"weights":{"v1":95,"v2":5}}"#;

fn router(versions: &str) -> Router {
    let mut r = Router::new(config(versions));
    r.apply_pool_event(0, &event(&POOL, 1), T0);
    r
}

/// Routes one request (version, then pod) and returns the route and the chosen pod.
fn route(
    r: &mut Router,
    pinned: Option<&str>,
    now: u64,
    rng: &mut ChaCha8Rng,
) -> (VersionRoute, Option<String>) {
    let vr = r.route_version(0, Some(MODEL), pinned, now, rng);
    let version = match &vr {
        VersionRoute::Version { version, .. } => Some(version.clone()),
        VersionRoute::Rejected { .. } => return (vr, None),
        _ => None,
    };
    let d = r.decide_in(
        0,
        Some(MODEL),
        version.as_deref(),
        RequestSize::UNIT,
        None,
        now,
        rng,
    );
    let pod = match d {
        Decision::Steer { ranked, .. } | Decision::FailOpen { ranked } => {
            let mut s = String::new();
            assert!(r.write_ranked(0, &ranked, &mut s));
            s.split(',').next().map(str::to_string)
        }
        Decision::Fallback(_) => None,
    };
    (vr, pod)
}

fn version_of(pod: &str) -> &'static str {
    let i = (0..POOL.len()).find(|i| addr(*i) == pod).unwrap();
    POOL[i]
}

#[test]
fn without_versions_nothing_changes() {
    let mut r = router("");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (vr, pod) = route(&mut r, Some("v2"), T0, &mut rng);
    assert_eq!(vr, VersionRoute::Off);
    assert!(pod.is_some());
    assert!(r.version_rows(0).is_empty());
    // The same picks as decide_with on a router without versions, seed for seed.
    let mut a = router("");
    let mut b = router("");
    let (mut ra, mut rb) = (ChaCha8Rng::seed_from_u64(7), ChaCha8Rng::seed_from_u64(7));
    for i in 0..200 {
        let now = T0 + i;
        let x = a.decide_with(0, Some(MODEL), RequestSize::UNIT, None, now, &mut ra);
        let (_, y) = route(&mut b, None, now, &mut rb);
        let Decision::Steer { ranked, .. } = x else {
            panic!("steers")
        };
        let mut s = String::new();
        a.write_ranked(0, &ranked, &mut s);
        assert_eq!(s.split(',').next().map(str::to_string), y);
    }
}

#[test]
fn a_pinned_request_goes_only_to_its_version() {
    let mut r = router(SPLIT);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for i in 0..500 {
        let (vr, pod) = route(&mut r, Some("v2"), T0 + i, &mut rng);
        assert_eq!(
            vr,
            VersionRoute::Version {
                version: "v2".into(),
                pinned: true
            }
        );
        assert_eq!(version_of(&pod.unwrap()), "v2");
        let (_, pod) = route(&mut r, Some("v1"), T0 + i, &mut rng);
        assert_eq!(version_of(&pod.unwrap()), "v1");
    }
    let v2 = r
        .version_rows(0)
        .into_iter()
        .find(|v| v.version == "v2")
        .unwrap();
    assert_eq!((v2.counts.picks, v2.counts.pinned), (500, 500));
}

#[test]
fn a_pinned_version_no_pod_serves_is_refused_not_rerouted() {
    let mut r = router(SPLIT);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (vr, pod) = route(&mut r, Some("v9"), T0, &mut rng);
    assert_eq!(
        vr,
        VersionRoute::Rejected {
            version: "v9".into(),
            reason: RejectReason::NoPod
        }
    );
    assert!(pod.is_none());
    assert_eq!(r.counters().versions_rejected_unknown, 1);
    // Invented names get no domain (no per-version state or stats).
    assert!(r.version_rows(0).iter().all(|v| v.version != "v9"));
    // A configured version whose pods are all gone is refused too, and counted under it.
    r.apply_pool_event(0, &event(&["v1", "v1"], 2), T0 + 10);
    let (vr, _) = route(&mut r, Some("v2"), T0 + 10, &mut rng);
    assert!(matches!(
        vr,
        VersionRoute::Rejected {
            reason: RejectReason::NoPod,
            ..
        }
    ));
    let v2 = r
        .version_rows(0)
        .into_iter()
        .find(|v| v.version == "v2")
        .unwrap();
    assert_eq!((v2.counts.rejected_no_pod, v2.pods), (1, 0));
    // Unpinned requests go to v1 only (the split renormalises over available versions).
    for i in 0..200 {
        let (_, pod) = route(&mut r, None, T0 + 20 + i, &mut rng);
        assert_eq!(version_of(&pod.unwrap()), "v1");
    }
}

#[test]
fn the_split_follows_the_weights() {
    let mut r = router(SPLIT);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let n = 20_000;
    let mut canary = 0;
    for i in 0..n {
        let (vr, pod) = route(&mut r, None, T0 + i / 10, &mut rng);
        let VersionRoute::Version { version, pinned } = vr else {
            panic!("split: {vr:?}")
        };
        assert!(!pinned);
        assert_eq!(version_of(&pod.unwrap()), version);
        canary += u64::from(version == "v2");
    }
    let share = canary as f64 / n as f64;
    // Binomial sd at p = 0.05, n = 20 000: 0.0015; ±4 sd.
    assert!((0.044..=0.056).contains(&share), "canary share {share}");
}

#[test]
fn unversioned_pods_get_the_whole_pool_when_no_weighted_version_is_live() {
    let mut r = Router::new(config(SPLIT));
    r.apply_pool_event(0, &event(&["", "", ""], 1), T0);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (vr, pod) = route(&mut r, None, T0, &mut rng);
    assert_eq!(vr, VersionRoute::Unsplit);
    assert!(pod.is_some());
    assert_eq!(r.counters().versions_unsplit, 1);
}

#[test]
fn the_domain_trips_only_past_both_thresholds() {
    let d = DomainConfig::default();
    assert_eq!(
        (
            d.min_failures,
            d.failure_ratio,
            d.open_ms,
            d.half_open_requests
        ),
        (20, 0.3, 30_000, 100)
    );
    // Failures must exceed 20, and their share 30 %.
    assert!(!d.trips(20, 20));
    assert!(!d.trips(21, 70)); // exactly 30 %
    assert!(d.trips(21, 69));
    assert!(!d.trips(30, 100)); // exactly 30 %
    assert!(d.trips(31, 100));

    // Through the window: 49 successes then 21 failures (21/70 = 30 %): stays closed; one more
    // failure (22/71 > 30 %) opens it.
    let vc = VersionsConfig::try_from_json(r#"{"weights":{"v1":1}}"#);
    let mut ds = Domains::default();
    let mut now = T0;
    for _ in 0..49 {
        assert!(ds.record("v1", false, now, &vc).is_none());
        now += 10;
    }
    for _ in 0..21 {
        assert!(ds.record("v1", true, now, &vc).is_none());
        now += 10;
    }
    assert_eq!(ds.state("v1"), BreakerState::Closed);
    let t = ds.record("v1", true, now, &vc).expect("opens");
    assert_eq!(t.to, BreakerState::Open);
    assert_eq!(ds.get("v1").unwrap().counts.opened, 1);

    // Failures older than the window do not count: 21 failures spread over 30 s never trip
    // a 10 s window.
    let mut ds = Domains::default();
    for i in 0..21 {
        assert!(ds.record("v1", true, T0 + i * 1_500, &vc).is_none());
    }
    assert_eq!(ds.state("v1"), BreakerState::Closed);
}

/// Opens `v` at `now` with 21 failures in a row.
fn trip(ds: &mut Domains, v: &str, now: u64, vc: &VersionsConfig) {
    for _ in 0..21 {
        ds.record(v, true, now, vc);
    }
    assert_eq!(ds.state(v), BreakerState::Open);
}

#[test]
fn open_lasts_open_ms_then_half_open_admits_its_requests() {
    let vc = VersionsConfig::try_from_json(r#"{"weights":{"v1":1}}"#);
    let mut ds = Domains::default();
    trip(&mut ds, "v1", T0, &vc);
    assert!(ds.poll(T0 + 29_999, &vc).is_empty());
    assert!(!ds.admits("v1", &vc));
    let ts = ds.poll(T0 + 30_000, &vc);
    assert_eq!(ts.len(), 1);
    assert_eq!(ds.state("v1"), BreakerState::HalfOpen);
    // The first request alone, then the rest of the 100 once it succeeded.
    let now = T0 + 30_000;
    assert!(ds.admits("v1", &vc));
    ds.on_pick("v1", false, now);
    assert!(!ds.admits("v1", &vc));
    ds.record("v1", false, now + 1, &vc);
    for i in 1..100 {
        assert!(ds.admits("v1", &vc), "request {i}");
        ds.on_pick("v1", false, now + 1);
    }
    assert!(!ds.admits("v1", &vc), "100 requests admitted, no more");
    for i in 1..99 {
        assert!(
            ds.record("v1", false, now + 2, &vc).is_none(),
            "success {i}"
        );
    }
    let t = ds.record("v1", false, now + 2, &vc).expect("closes");
    assert_eq!(t.to, BreakerState::Closed);
    assert!(ds.admits("v1", &vc));
    let c = ds.get("v1").unwrap().counts;
    assert_eq!((c.opened, c.half_opened, c.closed), (1, 1, 1));

    // A failure half-open re-opens it for another 30 s.
    trip(&mut ds, "v1", now + 10, &vc);
    ds.poll(now + 30_010, &vc);
    ds.on_pick("v1", false, now + 30_010);
    let t = ds.record("v1", true, now + 30_020, &vc).expect("re-opens");
    assert_eq!(t.to, BreakerState::Open);
    assert!(ds.poll(now + 60_019, &vc).is_empty());
    assert_eq!(ds.poll(now + 60_020, &vc).len(), 1);
}

#[test]
fn a_tripped_canary_moves_its_share_to_stable_and_leaves_stable_alone() {
    let mut r = router(SPLIT);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    // Pinned canary traffic fails: 21 failures open v2's domain.
    let mut now = T0;
    for _ in 0..21 {
        let (_, pod) = route(&mut r, Some("v2"), now, &mut rng);
        assert_eq!(version_of(&pod.unwrap()), "v2");
        r.on_version_outcome(0, "v2", true, now);
        now += 5;
    }
    let rows = r.version_rows(0);
    let state = |v: &str| rows.iter().find(|x| x.version == v).unwrap().state;
    assert_eq!(state("v2"), BreakerState::Open);
    assert_eq!(state("v1"), BreakerState::Closed);
    // Every unpinned request goes to stable now; pinned canary requests are refused.
    for i in 0..1_000 {
        let (vr, pod) = route(&mut r, None, now + i, &mut rng);
        assert_eq!(
            vr,
            VersionRoute::Version {
                version: "v1".into(),
                pinned: false
            }
        );
        assert_eq!(version_of(&pod.unwrap()), "v1");
    }
    let (vr, _) = route(&mut r, Some("v2"), now, &mut rng);
    assert_eq!(
        vr,
        VersionRoute::Rejected {
            version: "v2".into(),
            reason: RejectReason::DomainOpen
        }
    );
    // Stable's pods keep closed breakers and their shares within v1 stay even.
    for i in 0..4 {
        let b = r.breaker(0, &addr(i), None).map(|b| b.state());
        assert!(b.is_none_or(|s| s == BreakerState::Closed));
    }
    // 30 s later the canary is half-open and gets its share back request by request.
    let later = T0 + 30_200;
    r.apply_pool_event(0, &event(&POOL, 2), later);
    let mut canary = 0;
    for i in 0..6_000 {
        let now = later + i / 10;
        let (vr, _) = route(&mut r, None, now, &mut rng);
        if vr
            == (VersionRoute::Version {
                version: "v2".into(),
                pinned: false,
            })
        {
            canary += 1;
            r.on_version_outcome(0, "v2", false, now);
        }
    }
    let rows = r.version_rows(0);
    let v2 = rows.iter().find(|x| x.version == "v2").unwrap();
    assert_eq!(
        v2.state,
        BreakerState::Closed,
        "{v2:?} after {canary} canary picks"
    );
    // Closed after its 100 half-open requests succeeded, then its 5 % share again.
    assert!((200..=400).contains(&canary), "canary got {canary}");
}

#[test]
fn per_version_domain_settings_override_the_default() {
    let vc = VersionsConfig::try_from_json(
        r#"{"weights":{"v1":95,"v2":5},"domains":{"default":{"minFailures":5},"v2":{"openMs":1000}}}"#,
    );
    assert_eq!(vc.domain("v1").min_failures, 5);
    assert_eq!(vc.domain("v1").open_ms, 30_000);
    assert_eq!(vc.domain("v2").min_failures, 5);
    assert_eq!(vc.domain("v2").open_ms, 1000);
    assert_eq!(vc.header, "x-model-version");
}

#[test]
fn bad_versions_configs_are_refused_with_the_field_named() {
    let cases = [
        (r#"{"weights":{"v1":-1,"v2":5}}"#, "versions.weights.v1"),
        (r#"{"weights":{"v1":0}}"#, "versions.weights"),
        (r#"{"weights":{"":1}}"#, "versions.weights"),
        (
            r#"{"header":"X Bad","weights":{"v1":1}}"#,
            "versions.header",
        ),
        (
            r#"{"weights":{"v1":1},"domains":{"default":{"failureRatio":0}}}"#,
            "versions.domains.default.failureRatio",
        ),
        (
            r#"{"weights":{"v1":1},"domains":{"v1":{"halfOpenRequests":0}}}"#,
            "versions.domains.v1.halfOpenRequests",
        ),
        (
            r#"{"weights":{"v1":1},"domains":{"v1":{"windowMs":5}}}"#,
            "versions.domains.v1.windowMs",
        ),
        (r#"{"weights":{"v1":1},"bogus":1}"#, "versions.bogus"),
    ];
    for (json, field) in cases {
        let e = FilterConfig::from_json(
            format!(r#"{{"pools":[{{"name":"p","cluster":"c"}}],"versions":{json}}}"#).as_bytes(),
        )
        .expect_err(json);
        assert!(
            e.to_string().contains(field),
            "{json}: error {e} should name {field}"
        );
    }
}

/// `VersionsConfig` from the JSON of a `versions` block, through the plugin config.
trait FromJson {
    fn try_from_json(json: &str) -> VersionsConfig;
}

impl FromJson for VersionsConfig {
    fn try_from_json(json: &str) -> VersionsConfig {
        let c = config(json);
        (**c.versions.as_ref().unwrap()).clone()
    }
}

/// A pinned request the filter cannot steer (the proxy refuses the steer, or the pool falls
/// back to Envoy's balancing) is refused: Envoy's own balancing would pick a pod of any
/// version. An unpinned one is left to Envoy, as always.
#[test]
fn a_pinned_request_the_filter_cannot_steer_is_refused_not_left_to_envoy() {
    let mut w = SyncWorker::new(router(SPLIT), NoStats, 5, 0);
    let mut h = MockHost::at(T0);
    h.req.insert("x-model-version".into(), "v2".into());
    h.refuse_steer = true;
    let out = steer_checked(&mut h, &mut w, 0, Some(MODEL), T0, RequestSize::UNIT, None);
    assert_eq!(
        out.map(|s| s.map(|s| s.ranked)),
        Err(Rejected {
            version: "v2".into(),
            reason: RejectReason::NoPod
        })
    );
    assert_eq!(w.router.counters().steer_failed, 1);
    let v2 = w
        .router
        .version_rows(0)
        .into_iter()
        .find(|v| v.version == "v2")
        .unwrap();
    assert_eq!(v2.counts.rejected_no_pod, 1);
    // Unpinned: left to Envoy's balancing.
    let mut h = MockHost::at(T0);
    h.refuse_steer = true;
    let out = steer_checked(&mut h, &mut w, 0, Some(MODEL), T0, RequestSize::UNIT, None);
    assert_eq!(out.map(|s| s.is_none()), Ok(true));
    assert_eq!(w.router.counters().steer_failed, 2);
    // Steered when the proxy takes it: only v2's pod.
    let mut h = MockHost::at(T0);
    h.req.insert("x-model-version".into(), "v2".into());
    let s = steer_checked(&mut h, &mut w, 0, Some(MODEL), T0, RequestSize::UNIT, None)
        .unwrap()
        .unwrap();
    assert_eq!(version_of(s.ranked.split(',').next().unwrap()), "v2");
}
