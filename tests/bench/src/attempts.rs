//! Decides what reached the pods during a fault run, seen from the pods and the sidecars rather
//! than the clients: Envoy retries hide a failed attempt from the client, so the client
//! records cannot tell how many requests a failing pod still received. A background thread
//! samples every 250 ms each pod's own count of finished requests (`vllm:request_success_total`,
//! summed over `finished_reason`, injected errors included) and, per sidecar (ai-lb only), its
//! breaker-opening counters (`wasmcustom.ailb.breaker_opened.<reason>`, summed), its picks of the faulty pod and
//! all its steered requests. The pod-side share after the first opening (any sidecar's) is the
//! strict measure; the per-sidecar one, picks of the pod after that sidecar's own breaker first
//! opened, is what one breaker lets through (first attempts only: Envoy's retries are not
//! picks). [`CutWatch`] records when each sidecar's routing first showed the pod cut.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::http_get;
use serde_json::{json, Value};

/// How often the probe samples.
const EVERY: Duration = Duration::from_millis(250);

/// One sample: ms since the run started, finished requests per pod (None: unreadable), breaker
/// openings summed over the sidecars, and each sidecar's counters.
#[derive(Debug, Clone)]
struct Sample {
    t_ms: f64,
    finished: Vec<Option<f64>>,
    opened: u64,
    sidecars: Vec<SidecarStats>,
}

/// One sidecar's counters at a sample (0 when absent or unreadable).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct SidecarStats {
    opened: u64,
    /// Picks of the faulty pod.
    picks: u64,
    steered: u64,
    /// Pods whose breaker this sidecar shows open (`ailb.endpoint.<pod>.breaker_state` 2).
    open_pods: u64,
}

/// The running probe; [`Probe::finish`] stops it and returns what it saw.
pub struct Probe {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Sample>>,
}

/// Requests the pod at `addr` finished so far, by its own metrics.
fn finished(addr: SocketAddr) -> Option<f64> {
    let r = http_get(addr, "/metrics").ok()?;
    let text = r.text();
    let sum = text
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Some(sum)
}

/// The counters of the sidecar with admin address `admin`, `faulty` being the pod's address.
fn sidecar_stats(admin: SocketAddr, faulty: &str) -> SidecarStats {
    let Ok(r) = http_get(admin, "/stats") else {
        return SidecarStats::default();
    };
    parse_sidecar_stats(&r.text(), faulty)
}

/// [`sidecar_stats`] from the text of Envoy's `/stats`.
fn parse_sidecar_stats(text: &str, faulty: &str) -> SidecarStats {
    let picks_key = format!("wasmcustom.ailb.endpoint.{faulty}.picks: ");
    let mut st = SidecarStats::default();
    for l in text.lines() {
        let value = |prefix: &str| l.strip_prefix(prefix).and_then(|v| v.trim().parse().ok());
        if let Some(v) = l
            .strip_prefix("wasmcustom.ailb.breaker_opened.")
            .and_then(|rest| rest.split_once(": "))
            .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        {
            // One counter per trip reason (the shared-state breaker's; the core's
            // `breaker.opened` is not exported since 02d49fd).
            st.opened += v;
        } else if let Some(v) = value("wasmcustom.ailb.steered: ") {
            st.steered = v;
        } else if let Some(v) = value(&picks_key) {
            st.picks = v;
        } else if l
            .strip_prefix("wasmcustom.ailb.endpoint.")
            .and_then(|rest| rest.split_once(".breaker_state: "))
            .is_some_and(|(_, v)| v.trim() == "2")
        {
            st.open_pods += 1;
        }
    }
    st
}

impl Probe {
    /// Starts sampling `pods` (the faulty one at index `faulty`) and the sidecars' admin
    /// addresses, times relative to `started`.
    pub fn start(
        pods: Vec<SocketAddr>,
        faulty: usize,
        admins: Vec<SocketAddr>,
        started: Instant,
    ) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let faulty_addr = pods.get(faulty).map(|a| a.to_string()).unwrap_or_default();
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let t_ms = started.elapsed().as_secs_f64() * 1000.0;
                let sidecars: Vec<SidecarStats> = admins
                    .iter()
                    .map(|a| sidecar_stats(*a, &faulty_addr))
                    .collect();
                samples.push(Sample {
                    t_ms,
                    finished: pods.iter().map(|a| finished(*a)).collect(),
                    opened: sidecars.iter().map(|s| s.opened).sum(),
                    sidecars,
                });
                std::thread::sleep(EVERY);
            }
            samples
        });
        Probe { stop, handle }
    }

    /// Stops the probe; summarises what reached pod `faulty` (index) after `fault_at_ms` and
    /// after the first breaker opening that followed it, up to `end_ms` (the end of the load).
    pub fn finish(self, faulty: usize, fault_at_ms: f64, end_ms: f64) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.handle.join().unwrap_or_default();
        summarize(&samples, faulty, fault_at_ms, end_ms)
    }
}

/// How often [`CutWatch`] reads each sidecar's status page.
const CUT_EVERY: Duration = Duration::from_millis(25);

/// When each ai-lb sidecar's routing first showed the faulty pod cut: a thread reads every
/// sidecar's status page (`/ai-lb/status`, served by the VM that routes its requests) every
/// 25 ms from the fault on, until each shows the pod with a `cut` reason or `window` passes.
/// Requests a sidecar sent before its own cut could not have been kept off the pod by it;
/// those sent after could.
pub struct CutWatch {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Option<f64>>>,
}

/// Whether the status page `body` shows the pod serving at `pod` cut for its health (stale,
/// model server down, hardware fault, breaker), not for load (GPU hard limit, queue full: a
/// loaded pod is cut and uncut all through a run).
fn shows_cut(body: &str, pod: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(body) else {
        return false;
    };
    v["pools"].as_array().into_iter().flatten().any(|pool| {
        pool["pods"].as_array().into_iter().flatten().any(|row| {
            row["address"] == pod
                && row["cut"]
                    .as_str()
                    .is_some_and(|c| c != "gpu_hard_limit" && c != "queue_full")
        })
    })
}

impl CutWatch {
    /// Starts watching the sidecars listening at `listeners` for pod `pod` (its serving
    /// address); times are ms since `started`.
    pub fn start(
        listeners: Vec<SocketAddr>,
        pod: String,
        started: Instant,
        window: Duration,
    ) -> CutWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let end = Instant::now() + window;
            let mut cut: Vec<Option<f64>> = vec![None; listeners.len()];
            while !flag.load(Ordering::Relaxed)
                && Instant::now() < end
                && cut.iter().any(Option::is_none)
            {
                for (at, l) in cut.iter_mut().zip(&listeners) {
                    if at.is_some() {
                        continue;
                    }
                    let t_ms = started.elapsed().as_secs_f64() * 1000.0;
                    if http_get(*l, "/ai-lb/status").is_ok_and(|r| shows_cut(&r.text(), &pod)) {
                        *at = Some(t_ms);
                    }
                }
                std::thread::sleep(CUT_EVERY);
            }
            cut
        });
        CutWatch { stop, handle }
    }

    /// Stops watching; per sidecar, ms since the start when its page first showed the pod
    /// cut (the time the read was sent, so at most 25 ms plus one read late), None if never.
    pub fn finish(self) -> Vec<Option<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// The last sample at or before `t` and the first at or after `u`.
fn bracket(samples: &[Sample], t: f64, u: f64) -> Option<(&Sample, &Sample)> {
    let a = samples.iter().rev().find(|s| s.t_ms <= t)?;
    let b = samples
        .iter()
        .find(|s| s.t_ms >= u)
        .or_else(|| samples.last())?;
    (b.t_ms > a.t_ms).then_some((a, b))
}

/// Share of the requests finished by all pods between two samples that pod `i` finished.
fn share(a: &Sample, b: &Sample, i: usize) -> Option<(f64, f64)> {
    let mut all = 0.0;
    let mut mine = 0.0;
    for (k, (x, y)) in a.finished.iter().zip(&b.finished).enumerate() {
        let d = (y.as_ref()? - x.as_ref()?).max(0.0);
        all += d;
        if k == i {
            mine = d;
        }
    }
    (all > 0.0).then_some((mine, all))
}

fn summarize(samples: &[Sample], faulty: usize, fault_at_ms: f64, end_ms: f64) -> Value {
    let before = bracket(samples, fault_at_ms - 10_000.0, fault_at_ms)
        .and_then(|(a, b)| share(a, b, faulty));
    let after = bracket(samples, fault_at_ms, end_ms).and_then(|(a, b)| share(a, b, faulty));
    let base_opened = samples
        .iter()
        .rev()
        .find(|s| s.t_ms <= fault_at_ms)
        .map_or(0, |s| s.opened);
    let first_open = samples
        .iter()
        .find(|s| s.t_ms > fault_at_ms && s.opened > base_opened);
    let after_open = first_open
        .and_then(|o| bracket(samples, o.t_ms, end_ms))
        .and_then(|(a, b)| share(a, b, faulty));
    let openings = samples
        .iter()
        .rev()
        .find(|s| s.t_ms <= end_ms)
        .map(|s| s.opened.saturating_sub(base_opened));
    // Openings from the first sample to the fault (a healthy pool's are false trips).
    let openings_before = samples
        .first()
        .map(|s| base_opened.saturating_sub(s.opened));
    // What those trips cost: seconds a pod was held open, summed over pods and sidecars (an
    // opening count misses a pod held open across doubled cooldowns, which opens once).
    let open_pod_s_before = open_pod_seconds(samples, fault_at_ms);
    let frac = |x: Option<(f64, f64)>| x.map(|(m, a)| m / a);
    let own = after_own_opening(samples, fault_at_ms, end_ms);
    json!({
        "samples": samples.len(),
        "pod_share_of_attempts_10s_before": frac(before),
        "pod_share_of_attempts_after_fault": frac(after),
        "attempts_at_pod_after_fault": after.map(|x| x.0),
        "first_breaker_open_ms_after_fault": first_open.map(|o| o.t_ms - fault_at_ms),
        "pod_share_of_attempts_after_first_open": frac(after_open),
        "attempts_at_pod_after_first_open": after_open.map(|x| x.0),
        "attempts_all_pods_after_first_open": after_open.map(|x| x.1),
        "breaker_openings_after_fault": openings,
        "breaker_openings_before_fault": openings_before,
        "breaker_open_pod_seconds_before_fault": open_pod_s_before,
        // Breaker openings summed over the sidecars since the first sample, once a second
        // (for the plot of when they happened): [seconds since the start, openings].
        "openings_over_time": samples
            .iter()
            .step_by(4)
            .map(|s| json!([
                (s.t_ms / 100.0).round() / 10.0,
                s.opened.saturating_sub(samples.first().map_or(0, |f| f.opened)),
            ]))
            .collect::<Vec<_>>(),
        "sidecars_opened": own.opened_ms.len(),
        "sidecar_first_open_ms_after_fault": own.opened_ms,
        "sidecar_picks_of_pod_after_own_open": own.picks,
        "sidecar_steered_after_own_open": own.steered,
        "sidecar_share_after_own_open": (own.steered > 0).then(|| own.picks as f64 / own.steered as f64),
    })
}

/// Pod-seconds of open breakers from the first sample to `until_ms`, summed over the sidecars:
/// each interval between two samples counts the pods its first sample showed open. None with
/// fewer than two samples in that span.
fn open_pod_seconds(samples: &[Sample], until_ms: f64) -> Option<f64> {
    let span: Vec<&Sample> = samples.iter().filter(|s| s.t_ms <= until_ms).collect();
    (span.len() >= 2).then(|| {
        span.windows(2)
            .map(|w| {
                let open: u64 = w[0].sidecars.iter().map(|s| s.open_pods).sum();
                open as f64 * (w[1].t_ms - w[0].t_ms) / 1000.0
            })
            .sum()
    })
}

/// Per sidecar, from its own first breaker opening after the fault to the end: picks of the
/// faulty pod and all steered requests, summed over the sidecars that opened.
#[derive(Debug, Default)]
struct OwnOpening {
    opened_ms: Vec<f64>,
    picks: u64,
    steered: u64,
}

fn after_own_opening(samples: &[Sample], fault_at_ms: f64, end_ms: f64) -> OwnOpening {
    let mut out = OwnOpening::default();
    let n = samples.first().map_or(0, |s| s.sidecars.len());
    let last = samples.iter().rev().find(|s| s.t_ms <= end_ms);
    for i in 0..n {
        let at = |s: &Sample| s.sidecars.get(i).copied().unwrap_or_default();
        let base = samples
            .iter()
            .rev()
            .find(|s| s.t_ms <= fault_at_ms)
            .map_or(0, |s| at(s).opened);
        let Some(open) = samples
            .iter()
            .find(|s| s.t_ms > fault_at_ms && s.t_ms <= end_ms && at(s).opened > base)
        else {
            continue;
        };
        let Some(last) = last else { continue };
        out.opened_ms.push(open.t_ms - fault_at_ms);
        out.picks += at(last).picks.saturating_sub(at(open).picks);
        out.steered += at(last).steered.saturating_sub(at(open).steered);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t_ms: f64, finished: &[f64], opened: u64) -> Sample {
        Sample {
            t_ms,
            finished: finished.iter().map(|f| Some(*f)).collect(),
            opened,
            sidecars: Vec::new(),
        }
    }

    #[test]
    fn sidecar_stats_sum_breaker_openings_over_reasons() {
        let text = "wasmcustom.ailb.breaker_opened.server_errors: 2\n\
                    wasmcustom.ailb.breaker_opened.connect_failures: 1\n\
                    wasmcustom.ailb.breaker_opened.timeouts: 0\n\
                    wasmcustom.ailb.breaker_half_opened: 5\n\
                    wasmcustom.ailb.steered: 40\n\
                    wasmcustom.ailb.endpoint.10.0.0.1:8000.picks: 7\n\
                    wasmcustom.ailb.endpoint.10.0.0.2:8000.picks: 9\n";
        let st = parse_sidecar_stats(text, "10.0.0.1:8000");
        assert_eq!((st.opened, st.picks, st.steered), (3, 7, 40));
    }

    fn sc(opened: u64, picks: u64, steered: u64) -> SidecarStats {
        SidecarStats {
            opened,
            picks,
            steered,
            open_pods: 0,
        }
    }

    #[test]
    fn sidecar_stats_count_pods_shown_open_not_half_open() {
        let text = "wasmcustom.ailb.endpoint.10.0.0.1:8000.breaker_state: 2\n\
                    wasmcustom.ailb.endpoint.10.0.0.2:8000.breaker_state: 1\n\
                    wasmcustom.ailb.endpoint.10.0.0.3:8000.breaker_state: 0\n\
                    wasmcustom.ailb.endpoint.10.0.0.4:8000.breaker_state: 2\n\
                    wasmcustom.ailb.endpoint.10.0.0.4:8000.score: 2\n";
        assert_eq!(parse_sidecar_stats(text, "10.0.0.1:8000").open_pods, 2);
    }

    #[test]
    fn open_pod_seconds_add_up_pods_held_open_over_sidecars_until_the_fault() {
        let open = |a: u64, b: u64| {
            [a, b]
                .map(|open_pods| SidecarStats {
                    open_pods,
                    ..Default::default()
                })
                .to_vec()
        };
        let mut samples = vec![
            s(0.0, &[0.0], 0),
            s(1_000.0, &[0.0], 1),
            s(3_000.0, &[0.0], 1),
            s(3_500.0, &[0.0], 1),
            s(10_000.0, &[0.0], 1),
        ];
        // One pod open on sidecar 0 from 1 s to 3 s, then two pods (one per sidecar) for
        // 0.5 s; what follows 3.5 s is after the fault at 3.5 s.
        for (x, o) in samples
            .iter_mut()
            .zip([(0, 0), (1, 0), (1, 1), (4, 4), (0, 0)])
        {
            x.sidecars = open(o.0, o.1);
        }
        let v = summarize(&samples, 0, 3_500.0, 10_000.0);
        let got = v["breaker_open_pod_seconds_before_fault"].as_f64().unwrap();
        assert!((got - (2.0 + 1.0)).abs() < 1e-9, "{got}");
        assert_eq!(open_pod_seconds(&samples[..1], 3_500.0), None);
    }

    #[test]
    fn per_sidecar_counts_start_at_each_ones_own_opening() {
        let mut samples = vec![
            s(0.0, &[0.0], 0),
            s(10_000.0, &[0.0], 0),
            s(11_000.0, &[0.0], 1),
            s(12_000.0, &[0.0], 2),
            s(20_000.0, &[0.0], 2),
        ];
        // Sidecar 0 opens at 11 s, sidecar 1 at 12 s, sidecar 2 never.
        let per = [
            [sc(0, 0, 0), sc(0, 0, 0), sc(0, 0, 0)],
            [sc(0, 10, 100), sc(0, 10, 100), sc(0, 10, 100)],
            [sc(1, 14, 110), sc(0, 13, 110), sc(0, 13, 110)],
            [sc(1, 14, 120), sc(1, 15, 120), sc(0, 14, 120)],
            [sc(1, 15, 200), sc(1, 16, 200), sc(0, 30, 200)],
        ];
        for (x, p) in samples.iter_mut().zip(per) {
            x.sidecars = p.to_vec();
        }
        let v = summarize(&samples, 0, 10_000.0, 20_000.0);
        assert_eq!(v["sidecars_opened"], 2);
        assert_eq!(v["sidecar_picks_of_pod_after_own_open"], 1 + 1);
        assert_eq!(v["sidecar_steered_after_own_open"], 90 + 80);
        assert_eq!(
            v["sidecar_first_open_ms_after_fault"],
            serde_json::json!([1000.0, 2000.0])
        );
    }

    #[test]
    fn shares_count_attempts_between_samples_and_after_the_first_opening() {
        let samples = vec![
            s(0.0, &[0.0, 0.0], 0),
            s(10_000.0, &[100.0, 100.0], 0),
            // Fault at 10 s; the breaker opens in the sample at 11 s.
            s(11_000.0, &[150.0, 110.0], 1),
            s(20_000.0, &[152.0, 500.0], 3),
        ];
        let v = summarize(&samples, 0, 10_000.0, 20_000.0);
        assert_eq!(v["pod_share_of_attempts_10s_before"], 0.5);
        assert_eq!(v["first_breaker_open_ms_after_fault"], 1000.0);
        assert_eq!(v["attempts_at_pod_after_first_open"], 2.0);
        assert_eq!(v["attempts_all_pods_after_first_open"], 392.0);
        assert_eq!(v["breaker_openings_after_fault"], 3);
        let after = v["pod_share_of_attempts_after_fault"].as_f64().unwrap();
        assert!((after - 52.0 / 452.0).abs() < 1e-12);
    }

    #[test]
    fn a_pod_shows_cut_only_for_its_health_on_its_own_row() {
        let page = r#"{"pools":[{"pods":[
            {"address":"127.0.0.1:1","cut":null},
            {"address":"127.0.0.1:2","cut":"model_server_down"},
            {"address":"127.0.0.1:4","cut":"gpu_hard_limit"},
            {"address":"127.0.0.1:5","cut":"queue_full"}]}]}"#;
        assert!(shows_cut(page, "127.0.0.1:2"));
        assert!(!shows_cut(page, "127.0.0.1:4"));
        assert!(!shows_cut(page, "127.0.0.1:5"));
        assert!(!shows_cut(page, "127.0.0.1:1"));
        assert!(!shows_cut(page, "127.0.0.1:3"));
        assert!(!shows_cut("not json", "127.0.0.1:2"));
    }

    #[test]
    fn no_opening_or_unreadable_pods_give_nulls_not_numbers() {
        let mut samples = vec![s(0.0, &[0.0, 0.0], 0), s(20_000.0, &[10.0, 10.0], 0)];
        let v = summarize(&samples, 0, 10_000.0, 20_000.0);
        assert!(v["first_breaker_open_ms_after_fault"].is_null());
        assert!(v["pod_share_of_attempts_after_first_open"].is_null());
        samples[1].finished[1] = None;
        let v = summarize(&samples, 0, 0.0, 20_000.0);
        assert!(v["pod_share_of_attempts_after_fault"].is_null());
    }
}
