//! Properties of the windowed quantiles and rates: quantiles stay inside the bucket range and grow
//! with q, windows never report negative counts or rates whatever the scrape sequence (restarts
//! included), and the parser never panics on arbitrary text.

use ai_lb_agent::prometheus;
use ai_lb_agent::window::{bucket_quantile, CounterWindow, HistogramSnapshot, HistogramWindow};
use proptest::prelude::*;
use std::time::{Duration, Instant};

const BOUNDS: [f64; 5] = [1.0, 5.0, 10.0, 50.0, f64::INFINITY];

/// Cumulative counts from per-bucket increments.
fn cumulate(per_bucket: &[u32]) -> Vec<f64> {
    let mut acc = 0.0;
    per_bucket
        .iter()
        .map(|c| {
            acc += f64::from(*c);
            acc
        })
        .collect()
}

proptest! {
    #[test]
    fn quantiles_are_bounded_and_monotonic(per in prop::collection::vec(0u32..1000, 5), q1 in 0.0f64..=1.0, q2 in 0.0f64..=1.0) {
        let cum = cumulate(&per);
        let (lo, hi) = if q1 <= q2 { (q1, q2) } else { (q2, q1) };
        match (bucket_quantile(lo, &BOUNDS, &cum), bucket_quantile(hi, &BOUNDS, &cum)) {
            (Some(a), Some(b)) => {
                prop_assert!((0.0..=50.0).contains(&a) && (0.0..=50.0).contains(&b), "{a} {b}");
                prop_assert!(a <= b + 1e-9, "q{lo}={a} > q{hi}={b}");
            }
            (None, None) => prop_assert_eq!(cum[4], 0.0),
            other => prop_assert!(false, "inconsistent: {:?}", other),
        }
    }

    #[test]
    fn windows_never_go_negative(
        steps in prop::collection::vec((0u64..4000, prop::collection::vec(0u32..50, 5), any::<bool>()), 1..40)
    ) {
        let t0 = Instant::now();
        let mut t = t0;
        let mut hist = HistogramWindow::new(Duration::from_secs(10));
        let mut ctr = CounterWindow::new(Duration::from_secs(10));
        let mut per = [0u32; 5];
        for (dt_ms, inc, restart) in steps {
            t += Duration::from_millis(dt_ms);
            if restart {
                per = [0; 5];
            }
            for (p, i) in per.iter_mut().zip(&inc) {
                *p += i;
            }
            let cum = cumulate(&per);
            let total = cum[4];
            let snap = HistogramSnapshot::from_buckets(BOUNDS.iter().copied().zip(cum).collect()).unwrap();
            hist.observe(t, snap);
            ctr.observe(t, vec![total, f64::from(per[4])]);
            let q = hist.quantiles();
            prop_assert!(q.samples as f64 <= total);
            prop_assert_eq!(q.samples == 0, q.p50.is_none());
            if let Some(r) = ctr.rate(0) {
                prop_assert!(r >= 0.0);
            }
            if let Some(e) = ctr.ratio(1, 0) {
                prop_assert!((0.0..=1.0).contains(&e));
            }
        }
    }

    #[test]
    fn parser_never_panics(text in "(?s).{0,400}") {
        let _ = prometheus::parse(&text);
    }

    #[test]
    fn parser_never_panics_on_near_valid_lines(
        name in "[a-z_:]{1,12}",
        lv in "[^\\n]{0,12}",
        value in "(NaN|[+-]?Inf|-?[0-9]{1,4}(\\.[0-9]{1,3})?|x)",
        ts in "( [0-9]{1,13})?( #.*)?"
    ) {
        let line = format!("{name}{{l=\"{lv}\"}} {value}{ts}\n");
        let _ = prometheus::parse(&line);
    }
}
