//! Decides what reached the pods during a fault run, seen from the pods and the sidecars rather
//! than the clients: Envoy retries hide a failed attempt from the client, so the client
//! records cannot tell how many requests a failing pod still received. A background thread
//! samples every 250 ms each pod's own count of finished requests (`vllm:request_success_total`,
//! summed over `finished_reason`, injected errors included) and the sidecars' breaker-opening
//! counter (`wasmcustom.ailb.breaker.opened`, ai-lb only).

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
/// openings summed over the sidecars.
#[derive(Debug, Clone)]
struct Sample {
    t_ms: f64,
    finished: Vec<Option<f64>>,
    opened: u64,
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

/// Breaker openings counted by the sidecar with admin address `admin` (0 when absent).
fn opened(admin: SocketAddr) -> u64 {
    http_get(admin, "/stats")
        .ok()
        .and_then(|r| {
            r.text().lines().find_map(|l| {
                l.strip_prefix("wasmcustom.ailb.breaker.opened: ")
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

impl Probe {
    /// Starts sampling `pods` and the sidecars' admin addresses, times relative to `started`.
    pub fn start(pods: Vec<SocketAddr>, admins: Vec<SocketAddr>, started: Instant) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let t_ms = started.elapsed().as_secs_f64() * 1000.0;
                samples.push(Sample {
                    t_ms,
                    finished: pods.iter().map(|a| finished(*a)).collect(),
                    opened: admins.iter().map(|a| opened(*a)).sum(),
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
    let frac = |x: Option<(f64, f64)>| x.map(|(m, a)| m / a);
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t_ms: f64, finished: &[f64], opened: u64) -> Sample {
        Sample {
            t_ms,
            finished: finished.iter().map(|f| Some(*f)).collect(),
            opened,
        }
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
