//! Decides windowed latency quantiles and request/error rates from cumulative scrapes: the
//! DIFFERENCE between the newest scrape and the oldest scrape still inside the sliding window,
//! never lifetime totals. Quantiles interpolate linearly inside the bucket, as Prometheus'
//! `histogram_quantile` does (promql/quantile.go `bucketQuantile`). A count that goes down
//! (engine restart) or a change of bucket layout resets the window. Time is passed in.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Default sliding window.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);
/// Default window of request and error rates (the agent's `--rate-window`).
pub const DEFAULT_RATE_WINDOW: Duration = Duration::from_secs(5);
/// Default window of the recent inter-token latency (3 scrapes at the 50 ms default).
pub const DEFAULT_RECENT_WINDOW: Duration = Duration::from_millis(150);

/// At most this many scrapes are kept per window, whatever the scrape interval.
const MAX_SCRAPES: usize = 4096;

/// One scrape of a cumulative histogram: finite upper bounds ascending, then `+Inf`, with the
/// cumulative count of each bucket (non-decreasing).
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Upper bounds, ascending; the last one is `f64::INFINITY`.
    pub bounds: Vec<f64>,
    /// Cumulative counts, one per bound.
    pub counts: Vec<f64>,
    /// The cumulative sum of the observations (`_sum`), when the page has it.
    pub sum: Option<f64>,
}

impl HistogramSnapshot {
    /// Builds a snapshot from `(upper bound, cumulative count)` pairs in any order. Refuses
    /// (with the reason) a histogram without a `+Inf` bucket, with duplicate bounds, with
    /// decreasing cumulative counts, or with non-finite / negative counts.
    pub fn from_buckets(mut buckets: Vec<(f64, f64)>) -> Result<Self, String> {
        if buckets.iter().any(|(le, _)| le.is_nan()) {
            return Err("bucket bound le is NaN".into());
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if buckets.last().map(|b| b.0) != Some(f64::INFINITY) {
            return Err("no +Inf bucket".into());
        }
        let mut prev: Option<(f64, f64)> = None;
        for &(le, c) in &buckets {
            if !c.is_finite() || c < 0.0 {
                return Err(format!("bucket le={le} has count {c}"));
            }
            if let Some((ple, pc)) = prev {
                if ple == le {
                    return Err(format!("duplicate bucket le={le}"));
                }
                if c < pc {
                    return Err(format!(
                        "cumulative count decreases from {pc} (le={ple}) to {c} (le={le})"
                    ));
                }
            }
            prev = Some((le, c));
        }
        let (bounds, counts) = buckets.into_iter().unzip();
        Ok(Self {
            bounds,
            counts,
            sum: None,
        })
    }

    /// The same histogram with its cumulative `_sum` (a sum that is not finite and ≥ 0 is
    /// left out: the mean is then absent, the quantiles stay).
    pub fn with_sum(mut self, sum: Option<f64>) -> Self {
        self.sum = sum.filter(|s| s.is_finite() && *s >= 0.0);
        self
    }

    /// Total observations (the `+Inf` bucket).
    pub fn total(&self) -> f64 {
        self.counts.last().copied().unwrap_or(0.0)
    }

    /// Multiplies every bound by `factor` (unit conversion, e.g. seconds → ms).
    pub fn scaled(mut self, factor: f64) -> Self {
        for b in &mut self.bounds {
            *b *= factor;
        }
        self.sum = self.sum.map(|s| s * factor);
        self
    }

    /// Adds another histogram with the same layout (several models on one page).
    pub fn add(&mut self, other: &Self) -> Result<(), String> {
        if self.bounds != other.bounds {
            return Err("bucket layouts differ between series".into());
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += *b;
        }
        self.sum = match (self.sum, other.sum) {
            (Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
        Ok(())
    }

    /// `self - older`, or `None` when the layouts differ or any count went down (reset).
    fn delta(&self, older: &Self) -> Option<Vec<f64>> {
        if self.bounds != older.bounds {
            return None;
        }
        let mut d = Vec::with_capacity(self.counts.len());
        for (n, o) in self.counts.iter().zip(&older.counts) {
            if n < o {
                return None;
            }
            d.push(n - o);
        }
        Some(d)
    }
}

/// The `q`-quantile (0..=1) of a histogram given as upper bounds and cumulative counts, by
/// linear interpolation within the bucket, like Prometheus' `histogram_quantile`: the first
/// bucket starts at 0 (or at its bound if that is ≤ 0); a rank in the `+Inf` bucket answers the
/// highest finite bound. `None` when there are no observations.
pub fn bucket_quantile(q: f64, bounds: &[f64], cumulative: &[f64]) -> Option<f64> {
    let total = *cumulative.last()?;
    if total <= 0.0 || bounds.len() != cumulative.len() || q.is_nan() {
        return None;
    }
    let q = q.clamp(0.0, 1.0);
    let rank = q * total;
    // First bucket whose cumulative count reaches the rank.
    let b = cumulative
        .iter()
        .position(|&c| c >= rank)
        .unwrap_or(cumulative.len() - 1);
    if bounds[b] == f64::INFINITY {
        // Prometheus answers the highest finite bound; with only a +Inf bucket there is none.
        return if b == 0 { None } else { Some(bounds[b - 1]) };
    }
    if b == 0 && bounds[0] <= 0.0 {
        return Some(bounds[0]);
    }
    let (start, below) = if b == 0 {
        (0.0, 0.0)
    } else {
        (bounds[b - 1], cumulative[b - 1])
    };
    let end = bounds[b];
    let in_bucket = cumulative[b] - below;
    if in_bucket <= 0.0 {
        return Some(end);
    }
    Some(start + (end - start) * (rank - below) / in_bucket)
}

/// Windowed quantiles of one histogram.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WindowedQuantiles {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// Observations inside the window; 0 → quantiles absent.
    pub samples: u64,
    /// Their mean (the `_sum` delta over the count delta), when both scrapes carry a sum.
    pub mean: Option<f64>,
}

/// A ring of timestamped scrapes pruned to a sliding window.
#[derive(Debug, Clone)]
struct Ring<T> {
    window: Duration,
    scrapes: VecDeque<(Instant, T)>,
}

impl<T> Ring<T> {
    fn new(window: Duration) -> Self {
        Self {
            window,
            scrapes: VecDeque::new(),
        }
    }

    fn push(&mut self, now: Instant, value: T) {
        self.scrapes.push_back((now, value));
        while self.scrapes.len() > MAX_SCRAPES {
            self.scrapes.pop_front();
        }
        while let Some((t, _)) = self.scrapes.front() {
            if now.saturating_duration_since(*t) > self.window {
                self.scrapes.pop_front();
            } else {
                break;
            }
        }
    }

    fn reset_to(&mut self, now: Instant, value: T) {
        self.scrapes.clear();
        self.scrapes.push_back((now, value));
    }

    /// The oldest and the newest scrape.
    #[allow(clippy::type_complexity)]
    fn ends(&self) -> Option<(&(Instant, T), &(Instant, T))> {
        Some((self.scrapes.front()?, self.scrapes.back()?))
    }

    fn span(&self) -> Duration {
        self.ends()
            .map(|(o, n)| n.0.saturating_duration_since(o.0))
            .unwrap_or_default()
    }
}

/// Sliding-window quantiles over cumulative histogram scrapes.
#[derive(Debug, Clone)]
pub struct HistogramWindow {
    ring: Ring<HistogramSnapshot>,
}

impl HistogramWindow {
    pub fn new(window: Duration) -> Self {
        Self {
            ring: Ring::new(window),
        }
    }

    /// Records a scrape taken at `now`. A count lower than in the previous scrape (engine
    /// restart) or a different bucket layout starts the window afresh from this scrape.
    pub fn observe(&mut self, now: Instant, snap: HistogramSnapshot) {
        let reset = match self.ring.scrapes.back() {
            Some((_, prev)) => snap.delta(prev).is_none(),
            None => false,
        };
        if reset {
            self.ring.reset_to(now, snap);
        } else {
            self.ring.push(now, snap);
        }
    }

    /// Forgets every scrape (the histogram disappeared from the page).
    pub fn clear(&mut self) {
        self.ring.scrapes.clear();
    }

    /// P50/P99 of the observations between the oldest and the newest scrape in the window.
    pub fn quantiles(&self) -> WindowedQuantiles {
        let Some(((_, old), (_, new))) = self.ring.ends() else {
            return WindowedQuantiles::default();
        };
        let Some(delta) = new.delta(old) else {
            return WindowedQuantiles::default();
        };
        let total = delta.last().copied().unwrap_or(0.0);
        if total < 1.0 {
            return WindowedQuantiles::default();
        }
        let mean = match (new.sum, old.sum) {
            (Some(n), Some(o)) if n >= o => Some((n - o) / total),
            _ => None,
        };
        WindowedQuantiles {
            p50: bucket_quantile(0.5, &new.bounds, &delta),
            p99: bucket_quantile(0.99, &new.bounds, &delta),
            samples: total.round() as u64,
            mean,
        }
    }

    /// Time between the oldest and newest scrape in the window.
    pub fn span(&self) -> Duration {
        self.ring.span()
    }
}

/// Sliding-window rates of a few counters scraped together (e.g. finished and failed
/// requests), so their deltas cover the same interval.
#[derive(Debug, Clone)]
pub struct CounterWindow {
    ring: Ring<Vec<f64>>,
}

impl CounterWindow {
    pub fn new(window: Duration) -> Self {
        Self {
            ring: Ring::new(window),
        }
    }

    /// Records the counters' values at `now`. Any counter going down, or a change in the number
    /// of counters, resets the window.
    pub fn observe(&mut self, now: Instant, values: Vec<f64>) {
        let reset = match self.ring.scrapes.back() {
            Some((_, prev)) => {
                prev.len() != values.len() || values.iter().zip(prev).any(|(n, o)| n < o)
            }
            None => false,
        };
        if reset {
            self.ring.reset_to(now, values);
        } else {
            self.ring.push(now, values);
        }
    }

    pub fn clear(&mut self) {
        self.ring.scrapes.clear();
    }

    /// Increase of counter `i` over the window and the window's length, or `None` with fewer
    /// than two scrapes.
    pub fn delta(&self, i: usize) -> Option<(f64, Duration)> {
        let ((t0, old), (t1, new)) = self.ring.ends()?;
        let span = t1.saturating_duration_since(*t0);
        if span.is_zero() {
            return None;
        }
        Some((new.get(i)? - old.get(i)?, span))
    }

    /// Increase of counter `i` per second over the window.
    pub fn rate(&self, i: usize) -> Option<f64> {
        let (d, span) = self.delta(i)?;
        Some(d / span.as_secs_f64())
    }

    /// Increase of counter `num` divided by the increase of counter `den`; `None` when `den`
    /// did not move (no finished requests → no error rate).
    pub fn ratio(&self, num: usize, den: usize) -> Option<f64> {
        let (n, _) = self.delta(num)?;
        let (d, _) = self.delta(den)?;
        (d > 0.0).then(|| (n / d).clamp(0.0, 1.0))
    }

    pub fn span(&self) -> Duration {
        self.ring.span()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(bounds: &[f64], counts: &[f64]) -> HistogramSnapshot {
        HistogramSnapshot::from_buckets(
            bounds.iter().copied().zip(counts.iter().copied()).collect(),
        )
        .unwrap()
    }

    const B: [f64; 4] = [10.0, 20.0, 40.0, f64::INFINITY];

    #[test]
    fn quantile_interpolates_within_bucket() {
        // 10 observations in (10, 20]: the median is halfway.
        let q = bucket_quantile(0.5, &B, &[0.0, 10.0, 10.0, 10.0]).unwrap();
        assert!((q - 15.0).abs() < 1e-9, "{q}");
        // First bucket starts at 0.
        let q = bucket_quantile(0.5, &B, &[4.0, 4.0, 4.0, 4.0]).unwrap();
        assert!((q - 5.0).abs() < 1e-9, "{q}");
        // Rank in +Inf bucket: highest finite bound.
        assert_eq!(
            bucket_quantile(0.99, &B, &[0.0, 0.0, 1.0, 100.0]),
            Some(40.0)
        );
        assert_eq!(bucket_quantile(0.5, &B, &[0.0; 4]), None);
    }

    #[test]
    fn window_uses_deltas_not_lifetime_totals() {
        let t0 = Instant::now();
        let mut w = HistogramWindow::new(Duration::from_secs(10));
        // Lifetime: 1000 slow observations in (20, 40].
        w.observe(t0, snap(&B, &[0.0, 0.0, 1000.0, 1000.0]));
        assert_eq!(
            w.quantiles().samples,
            0,
            "one scrape: nothing in the window"
        );
        // Next second: 100 fast ones in (0, 10].
        w.observe(
            t0 + Duration::from_secs(1),
            snap(&B, &[100.0, 100.0, 1100.0, 1100.0]),
        );
        let q = w.quantiles();
        assert_eq!(q.samples, 100);
        assert!((q.p50.unwrap() - 5.0).abs() < 1e-9);
        assert!((q.p99.unwrap() - 9.9).abs() < 1e-9);
    }

    #[test]
    fn mean_comes_from_the_sum_delta_where_buckets_cannot_tell() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // Two pods whose tokens all fall in the first bucket (0, 10]: 4.8 and 8 ms each. The
        // median interpolates to 5 for both; the mean tells them apart.
        for ms in [4.8, 8.0] {
            let mut w = HistogramWindow::new(s(10));
            w.observe(t0, snap(&B, &[100.0; 4]).with_sum(Some(100.0 * ms)));
            w.observe(t0 + s(1), snap(&B, &[300.0; 4]).with_sum(Some(300.0 * ms)));
            let q = w.quantiles();
            assert!((q.p50.unwrap() - 5.0).abs() < 1e-9);
            assert!((q.mean.unwrap() - ms).abs() < 1e-9, "{q:?}");
        }
        // No _sum, or one that went down without the counts: no mean, quantiles as before.
        let mut w = HistogramWindow::new(s(10));
        w.observe(t0, snap(&B, &[100.0; 4]));
        w.observe(t0 + s(1), snap(&B, &[300.0; 4]));
        assert_eq!(w.quantiles().mean, None);
        assert_eq!(w.quantiles().samples, 200);
        let mut w = HistogramWindow::new(s(10));
        w.observe(t0, snap(&B, &[100.0; 4]).with_sum(Some(900.0)));
        w.observe(t0 + s(1), snap(&B, &[300.0; 4]).with_sum(Some(800.0)));
        assert_eq!(w.quantiles().mean, None);
        // Nonsense sums are left out; scaling and adding carry the sum.
        assert_eq!(snap(&B, &[1.0; 4]).with_sum(Some(f64::NAN)).sum, None);
        assert_eq!(snap(&B, &[1.0; 4]).with_sum(Some(-1.0)).sum, None);
        let mut a = snap(&B, &[1.0; 4]).with_sum(Some(0.5)).scaled(1000.0);
        assert_eq!(a.sum, Some(500.0));
        a.add(&snap(&[10_000.0, 20_000.0, 40_000.0, f64::INFINITY], &[1.0; 4]).with_sum(Some(2.0)))
            .unwrap();
        assert_eq!(a.sum, Some(502.0));
        a.add(&snap(
            &[10_000.0, 20_000.0, 40_000.0, f64::INFINITY],
            &[1.0; 4],
        ))
        .unwrap();
        assert_eq!(a.sum, None);
    }

    #[test]
    fn old_scrapes_slide_out() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = HistogramWindow::new(s(10));
        w.observe(t0, snap(&B, &[0.0, 0.0, 0.0, 0.0]));
        w.observe(t0 + s(1), snap(&B, &[0.0, 0.0, 50.0, 50.0])); // 50 slow
        w.observe(t0 + s(5), snap(&B, &[0.0, 0.0, 50.0, 50.0]));
        assert_eq!(w.quantiles().samples, 50);
        // At t0+12 the window starts at t0+2: the slow burst (between t0 and t0+1) is gone.
        w.observe(t0 + s(12), snap(&B, &[10.0, 10.0, 60.0, 60.0]));
        let q = w.quantiles();
        assert_eq!(q.samples, 10);
        assert!(q.p99.unwrap() <= 10.0);
        // Idle until everything but the newest scrape has slid out: empty window.
        w.observe(t0 + s(30), snap(&B, &[10.0, 10.0, 60.0, 60.0]));
        assert_eq!(w.quantiles(), WindowedQuantiles::default());
    }

    #[test]
    fn counter_reset_restarts_the_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = HistogramWindow::new(s(10));
        w.observe(t0, snap(&B, &[0.0, 0.0, 500.0, 500.0]));
        w.observe(t0 + s(1), snap(&B, &[0.0, 0.0, 600.0, 600.0]));
        assert_eq!(w.quantiles().samples, 100);
        // Engine restarted: counts start from a small number again.
        w.observe(t0 + s(2), snap(&B, &[3.0, 3.0, 3.0, 3.0]));
        assert_eq!(
            w.quantiles().samples,
            0,
            "no negative deltas, no stale data"
        );
        w.observe(t0 + s(3), snap(&B, &[8.0, 8.0, 8.0, 8.0]));
        let q = w.quantiles();
        assert_eq!(q.samples, 5);
        assert!(q.p50.unwrap() <= 10.0);
    }

    #[test]
    fn layout_change_resets() {
        let t0 = Instant::now();
        let mut w = HistogramWindow::new(Duration::from_secs(10));
        w.observe(t0, snap(&B, &[0.0, 0.0, 0.0, 0.0]));
        w.observe(
            t0 + Duration::from_secs(1),
            snap(&[5.0, f64::INFINITY], &[10.0, 10.0]),
        );
        assert_eq!(w.quantiles().samples, 0);
    }

    #[test]
    fn snapshot_validation() {
        assert!(HistogramSnapshot::from_buckets(vec![(1.0, 1.0)]).is_err());
        assert!(HistogramSnapshot::from_buckets(vec![(1.0, 5.0), (f64::INFINITY, 4.0)]).is_err());
        assert!(HistogramSnapshot::from_buckets(vec![(1.0, -1.0), (f64::INFINITY, 4.0)]).is_err());
        let s = HistogramSnapshot::from_buckets(vec![(f64::INFINITY, 4.0), (1.0, 2.0)]).unwrap();
        assert_eq!(s.bounds, vec![1.0, f64::INFINITY]);
        assert_eq!(s.scaled(1000.0).bounds, vec![1000.0, f64::INFINITY]);
    }

    #[test]
    fn rates_and_error_ratio() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = CounterWindow::new(s(10));
        w.observe(t0, vec![100.0, 10.0]);
        assert_eq!(w.rate(0), None);
        w.observe(t0 + s(2), vec![120.0, 15.0]);
        assert_eq!(w.rate(0), Some(10.0));
        assert_eq!(w.ratio(1, 0), Some(0.25));
        // No finished requests in the window: rate 0, error rate absent.
        let mut idle = CounterWindow::new(s(10));
        idle.observe(t0, vec![5.0, 1.0]);
        idle.observe(t0 + s(1), vec![5.0, 1.0]);
        assert_eq!(idle.rate(0), Some(0.0));
        assert_eq!(idle.ratio(1, 0), None);
        // Reset.
        w.observe(t0 + s(3), vec![1.0, 0.0]);
        assert_eq!(w.rate(0), None);
        w.observe(t0 + s(4), vec![3.0, 0.0]);
        assert_eq!(w.rate(0), Some(2.0));
        assert_eq!(w.ratio(1, 0), Some(0.0));
    }
}
