//! Decides whether a GPU is about to run out of memory (issue 30 part 2, "degrade before
//! OOM"): a pure state machine fed one memory reading at a time, each with its explicit time.
//!
//! Every `rate_interval` (500 ms by default) the growth rate of `memory_used_bytes` is taken
//! over the readings that close the interval: `(used_now − used_then) / (t_now − t_then)`.
//! The GPUs are read every `--gpu-sample-interval` (20 ms by default), so the rate needs no
//! read of its own: the cost is a subtraction and a division per GPU per read, and one more
//! per interval. A GPU at or above `watermark` of its total memory whose rate exceeded
//! `growth_bytes_per_s` for `consecutive` intervals in a row enters the pre-OOM state, and a
//! countdown of `countdown_ms` starts. The state clears as soon as one interval's rate is at
//! or below the threshold, or the memory falls below the watermark. While in it the state
//! carries the countdown left and the time to OOM projected at the last rate.
//!
//! Garbage in is not a signal: a zero total, used above total, or a time that goes backwards
//! restarts the measurement (the state clears), and is said in the return value so the caller
//! can count it.

use ai_lb_proto::v1::{GpuStats, PreOom};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The agent's thresholds (flags `--oom-watermark`, `--oom-growth-bytes-per-s`,
/// `--oom-consecutive`, `--oom-countdown`, `--oom-rate-interval`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatermarkConfig {
    /// Share of total memory used at or above which growth counts (0 < w ≤ 1).
    pub watermark: f64,
    /// Growth rate above which an interval counts (bytes/s, > 0).
    pub growth_bytes_per_s: f64,
    /// Intervals in a row above the rate that start the countdown (≥ 1).
    pub consecutive: u32,
    /// The countdown's length (ms, > 0).
    pub countdown_ms: u64,
    /// The interval the rate is taken over (ms, > 0).
    pub rate_interval_ms: u64,
}

impl Default for WatermarkConfig {
    fn default() -> Self {
        Self {
            watermark: 0.92,
            growth_bytes_per_s: 800e6,
            consecutive: 3,
            countdown_ms: 15_000,
            rate_interval_ms: 500,
        }
    }
}

impl WatermarkConfig {
    /// Validates the flags (None: the default). `Err((flag, value, expected))`.
    pub fn from_flags(
        watermark: Option<&str>,
        growth: Option<&str>,
        consecutive: Option<&str>,
        countdown: Option<Duration>,
        rate_interval: Option<Duration>,
    ) -> Result<Option<Self>, (&'static str, String, &'static str)> {
        let d = Self::default();
        let watermark = match watermark.map(str::trim) {
            None => d.watermark,
            Some("off") => return Ok(None),
            Some(v) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 && x <= 1.0 => x,
                _ => {
                    return Err((
                        "oom-watermark",
                        v.to_string(),
                        "a share of GPU memory in (0, 1], or off",
                    ))
                }
            },
        };
        let growth_bytes_per_s = match growth.map(str::trim) {
            None => d.growth_bytes_per_s,
            Some(v) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => x,
                _ => {
                    return Err((
                        "oom-growth-bytes-per-s",
                        v.to_string(),
                        "a growth rate in bytes per second > 0",
                    ))
                }
            },
        };
        let consecutive = match consecutive.map(str::trim) {
            None => d.consecutive,
            Some(v) => match v.parse::<u32>() {
                Ok(n) if (1..=1000).contains(&n) => n,
                _ => {
                    return Err((
                        "oom-consecutive",
                        v.to_string(),
                        "a count of intervals in 1..=1000",
                    ))
                }
            },
        };
        let countdown_ms = countdown.map_or(d.countdown_ms, |c| c.as_millis() as u64);
        let rate_interval_ms = rate_interval.map_or(d.rate_interval_ms, |c| c.as_millis() as u64);
        Ok(Some(Self {
            watermark,
            growth_bytes_per_s,
            consecutive,
            countdown_ms,
            rate_interval_ms,
        }))
    }
}

/// What the watermark says about one GPU now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OomState {
    Normal,
    PreOom {
        /// Countdown left (ms), 0 once it ran out.
        countdown_ms: u64,
        /// Memory left over the last rate (ms); None when the rate is not positive.
        projected_oom_in_ms: Option<u64>,
        rate_bytes_per_s: f64,
    },
}

/// What one reading did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// Taken (it may or may not have closed an interval).
    Taken,
    /// Refused (zero total, used above total, time backwards): the measurement restarts.
    Garbage,
}

/// One GPU's watermark.
#[derive(Debug, Clone, PartialEq)]
pub struct Watermark {
    cfg: WatermarkConfig,
    /// The reading that opened the current interval: (t_ms, used).
    start: Option<(u64, u64)>,
    /// The latest reading: (t_ms, used, total).
    last: Option<(u64, u64, u64)>,
    /// The rate over the last closed interval (bytes/s).
    rate: Option<f64>,
    /// Closed intervals in a row above the watermark and the rate.
    above: u32,
    /// When the countdown started (ms).
    since: Option<u64>,
}

impl Watermark {
    pub fn new(cfg: WatermarkConfig) -> Self {
        Self {
            cfg,
            start: None,
            last: None,
            rate: None,
            above: 0,
            since: None,
        }
    }

    /// Takes the reading `used` of `total` bytes at `t_ms`.
    pub fn observe(&mut self, t_ms: u64, used: u64, total: u64) -> Observed {
        let backwards = self.last.is_some_and(|(t, _, _)| t_ms < t);
        if total == 0 || used > total || backwards {
            *self = Self::new(self.cfg);
            return Observed::Garbage;
        }
        self.last = Some((t_ms, used, total));
        let Some((t0, u0)) = self.start else {
            self.start = Some((t_ms, used));
            return Observed::Taken;
        };
        let dt = t_ms - t0;
        if dt < self.cfg.rate_interval_ms {
            return Observed::Taken;
        }
        let rate = (used as f64 - u0 as f64) * 1000.0 / dt as f64;
        self.start = Some((t_ms, used));
        self.rate = Some(rate);
        let high = used as f64 >= self.cfg.watermark * total as f64;
        if high && rate > self.cfg.growth_bytes_per_s {
            self.above = self.above.saturating_add(1);
            if self.above >= self.cfg.consecutive && self.since.is_none() {
                self.since = Some(t_ms);
            }
        } else {
            self.above = 0;
            self.since = None;
        }
        Observed::Taken
    }

    /// The growth rate over the last closed interval (bytes/s).
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The state at `t_ms` (not before the latest reading).
    pub fn state(&self, t_ms: u64) -> OomState {
        let (Some(since), Some((_, used, total)), Some(rate)) = (self.since, self.last, self.rate)
        else {
            return OomState::Normal;
        };
        let elapsed = t_ms.saturating_sub(since);
        let projected_oom_in_ms = (rate > 0.0).then(|| {
            let left = total.saturating_sub(used) as f64;
            (left / rate * 1000.0).min(u64::MAX as f64) as u64
        });
        OomState::PreOom {
            countdown_ms: self.cfg.countdown_ms.saturating_sub(elapsed),
            projected_oom_in_ms,
            rate_bytes_per_s: rate,
        }
    }
}

/// The watermarks of a pod's GPUs, by GPU index, on the sampler's clock.
#[derive(Debug, Clone)]
pub struct GpuWatermarks {
    cfg: WatermarkConfig,
    epoch: Option<Instant>,
    by_gpu: BTreeMap<u32, Watermark>,
}

impl GpuWatermarks {
    pub fn new(cfg: WatermarkConfig) -> Self {
        Self {
            cfg,
            epoch: None,
            by_gpu: BTreeMap::new(),
        }
    }

    fn ms(&mut self, at: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(at);
        at.saturating_duration_since(epoch).as_millis() as u64
    }

    /// Takes one GPU reading taken at `at`; returns the indexes of the GPUs whose memory
    /// reading was refused (see [`Observed::Garbage`]). A GPU without both memory readings is
    /// left out (its watermark keeps its state until the next reading).
    pub fn observe(&mut self, gpus: &[GpuStats], at: Instant) -> Vec<u32> {
        let t = self.ms(at);
        let mut garbage = Vec::new();
        for g in gpus {
            let (Some(used), Some(total)) = (g.memory_used_bytes, g.memory_total_bytes) else {
                continue;
            };
            let w = self
                .by_gpu
                .entry(g.index)
                .or_insert_with(|| Watermark::new(self.cfg));
            if w.observe(t, used, total) == Observed::Garbage {
                garbage.push(g.index);
            }
        }
        garbage
    }

    /// Writes each GPU's growth rate and pre-OOM state as of `at` into a snapshot's GPUs.
    pub fn annotate(&mut self, gpus: &mut [GpuStats], at: Instant) {
        let t = self.ms(at);
        for g in gpus.iter_mut() {
            let Some(w) = self.by_gpu.get(&g.index) else {
                continue;
            };
            g.memory_growth_bytes_per_s = w.rate();
            g.pre_oom = match w.state(t) {
                OomState::Normal => None,
                OomState::PreOom {
                    countdown_ms,
                    projected_oom_in_ms,
                    ..
                } => Some(PreOom {
                    countdown_ms,
                    countdown_total_ms: self.cfg.countdown_ms,
                    projected_oom_in_ms,
                }),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;
    const TOTAL: u64 = 80 * GB;

    /// Feeds readings every 100 ms from `t0` at `rate` bytes/s starting at `used`, for `ms`;
    /// returns the last time and used.
    fn grow(w: &mut Watermark, t0: u64, used: u64, rate: f64, ms: u64) -> (u64, u64) {
        let mut t = t0;
        let mut u = used;
        while t <= t0 + ms {
            u = used + ((t - t0) as f64 * rate / 1000.0) as u64;
            assert_eq!(w.observe(t, u.min(TOTAL), TOTAL), Observed::Taken);
            t += 100;
        }
        (t - 100, u)
    }

    #[test]
    fn below_the_watermark_growth_is_no_state() {
        let mut w = Watermark::new(WatermarkConfig::default());
        // 50 GB growing at 2 GB/s for 3 s: far below 92 % of 80 GB (73.6 GB) all along.
        let (t, _) = grow(&mut w, 0, 50 * GB, 2e9, 3000);
        assert!(w.rate().unwrap() > 1.9e9);
        assert_eq!(w.state(t), OomState::Normal);
    }

    #[test]
    fn three_intervals_above_the_rate_start_the_countdown_two_do_not() {
        let mut w = Watermark::new(WatermarkConfig::default());
        // From 74 GB at 1 GB/s: intervals close at 500, 1000, 1500 ms.
        let (t, _) = grow(&mut w, 0, 74 * GB, 1e9, 1000);
        assert_eq!(t, 1000);
        assert_eq!(w.state(t), OomState::Normal, "two intervals are not enough");
        let (t, u) = grow(&mut w, 1100, 75_100_000_000, 1e9, 400);
        assert_eq!(t, 1500);
        match w.state(t) {
            OomState::PreOom {
                countdown_ms,
                projected_oom_in_ms,
                rate_bytes_per_s,
            } => {
                assert_eq!(countdown_ms, 15_000);
                assert!((rate_bytes_per_s - 1e9).abs() < 1e7, "{rate_bytes_per_s}");
                let want = (TOTAL - u) as f64 / 1e9 * 1000.0;
                let got = projected_oom_in_ms.unwrap() as f64;
                assert!((got - want).abs() < 100.0, "{got} vs {want}");
            }
            s => panic!("{s:?}"),
        }
        // The countdown runs with time.
        match w.state(t + 4000) {
            OomState::PreOom { countdown_ms, .. } => assert_eq!(countdown_ms, 11_000),
            s => panic!("{s:?}"),
        }
        match w.state(t + 40_000) {
            OomState::PreOom { countdown_ms, .. } => assert_eq!(countdown_ms, 0),
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn the_rate_falling_clears_the_state() {
        let mut w = Watermark::new(WatermarkConfig::default());
        let (t, u) = grow(&mut w, 0, 74 * GB, 1e9, 1500);
        assert!(matches!(w.state(t), OomState::PreOom { .. }));
        // Flat for one interval: cleared at its close.
        let (t, _) = grow(&mut w, t + 100, u, 0.0, 500);
        assert_eq!(w.state(t), OomState::Normal);
        assert_eq!(w.rate(), Some(0.0));
        // A slower growth (below 800 MB/s) does not start it again.
        let (t, _) = grow(&mut w, t + 100, u, 5e8, 3000);
        assert_eq!(w.state(t), OomState::Normal);
    }

    #[test]
    fn a_gap_in_the_run_restarts_the_count() {
        let cfg = WatermarkConfig::default();
        let mut w = Watermark::new(cfg);
        // Two fast intervals, one slow, two fast: never three in a row.
        let (t, u) = grow(&mut w, 0, 74 * GB, 1e9, 1000);
        let (t, u) = grow(&mut w, t + 100, u, 1e8, 400);
        let (t, _) = grow(&mut w, t + 100, u, 1e9, 900);
        assert_eq!(w.state(t), OomState::Normal);
    }

    #[test]
    fn garbage_readings_restart_the_measurement() {
        let mut w = Watermark::new(WatermarkConfig::default());
        let (t, u) = grow(&mut w, 0, 74 * GB, 1e9, 1500);
        assert!(matches!(w.state(t), OomState::PreOom { .. }));
        assert_eq!(w.observe(t + 100, u, 0), Observed::Garbage);
        assert_eq!(w.state(t + 100), OomState::Normal);
        assert_eq!(w.rate(), None);
        assert_eq!(w.observe(t + 200, TOTAL + 1, TOTAL), Observed::Garbage);
        assert_eq!(w.observe(t + 300, u, TOTAL), Observed::Taken);
        assert_eq!(
            w.observe(t + 200, u, TOTAL),
            Observed::Garbage,
            "time backwards"
        );
        assert_eq!(w.state(t + 300), OomState::Normal);
    }

    #[test]
    fn thresholds_come_from_the_flags_and_bad_ones_are_refused() {
        let c = WatermarkConfig::from_flags(
            Some("0.9"),
            Some("5e8"),
            Some("2"),
            Some(Duration::from_secs(10)),
            Some(Duration::from_millis(250)),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.watermark, 0.9);
        assert_eq!(c.growth_bytes_per_s, 5e8);
        assert_eq!(c.consecutive, 2);
        assert_eq!(c.countdown_ms, 10_000);
        assert_eq!(c.rate_interval_ms, 250);
        assert_eq!(
            WatermarkConfig::from_flags(None, None, None, None, None).unwrap(),
            Some(WatermarkConfig::default())
        );
        assert_eq!(
            WatermarkConfig::from_flags(Some("off"), None, None, None, None).unwrap(),
            None
        );
        for (w, g, n) in [
            (Some("1.5"), None, None),
            (Some("0"), None, None),
            (Some("NaN"), None, None),
            (None, Some("-1"), None),
            (None, Some("fast"), None),
            (None, None, Some("0")),
        ] {
            assert!(WatermarkConfig::from_flags(w, g, n, None, None).is_err());
        }
    }
}
