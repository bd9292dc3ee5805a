//! Decides when each request is sent: an open-loop arrival schedule computed from the seed
//! before the run, independent of response times (Poisson = exponential gaps; bursty = gamma
//! gaps with shape 1/CV², the usual renewal model for bursty traffic, e.g. Wang et al.,
//! "BurstGPT", 2024).

use rand::Rng;
use rand_distr::{Distribution, Exp, Gamma};

/// How inter-arrival gaps are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Exponential gaps (coefficient of variation 1).
    Poisson,
    /// Gamma gaps with the given coefficient of variation (CV > 1 is burstier than Poisson).
    Gamma { cv: f64 },
}

/// Where the schedule stops: at whichever bound is hit first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Last arrival strictly before this offset (microseconds), if set.
    pub duration_us: Option<u64>,
    /// At most this many arrivals, if set.
    pub max_requests: Option<u64>,
}

/// Errors in schedule parameters, naming the flag and value.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScheduleError {
    #[error("invalid value '{0}' for '--rate': must be a finite number > 0")]
    Rate(f64),
    #[error("invalid value '{0}' for '--cv': must be a finite number > 0")]
    Cv(f64),
    #[error("neither '--duration' nor '--requests' bounds the schedule")]
    Unbounded,
}

/// Arrival offsets in microseconds from the run start, nondecreasing, first gap included
/// (so the first request is not at exactly 0 unless the draw says so).
pub fn arrivals<R: Rng>(
    rng: &mut R,
    rate_per_s: f64,
    arrival: Arrival,
    bounds: Bounds,
) -> Result<Vec<u64>, ScheduleError> {
    if !(rate_per_s.is_finite() && rate_per_s > 0.0) {
        return Err(ScheduleError::Rate(rate_per_s));
    }
    if bounds.duration_us.is_none() && bounds.max_requests.is_none() {
        return Err(ScheduleError::Unbounded);
    }
    let mean_gap_us = 1e6 / rate_per_s;
    let mut gaps = GapSampler::new(arrival, mean_gap_us)?;
    let cap = bounds.max_requests.unwrap_or(u64::MAX);
    let mut out = Vec::new();
    let mut t = 0.0f64;
    while (out.len() as u64) < cap {
        t += gaps.sample(rng);
        let at = t.round() as u64;
        if let Some(d) = bounds.duration_us {
            if at >= d {
                break;
            }
        }
        out.push(at);
    }
    Ok(out)
}

/// Draws gaps (microseconds) with the requested mean and shape.
#[derive(Debug)]
pub enum GapSampler {
    Exp(Exp<f64>),
    Gamma(Gamma<f64>),
}

impl GapSampler {
    pub fn new(arrival: Arrival, mean_gap_us: f64) -> Result<Self, ScheduleError> {
        match arrival {
            Arrival::Poisson => Exp::new(1.0 / mean_gap_us)
                .map(GapSampler::Exp)
                .map_err(|_| ScheduleError::Rate(1e6 / mean_gap_us)),
            Arrival::Gamma { cv } => {
                if !(cv.is_finite() && cv > 0.0) {
                    return Err(ScheduleError::Cv(cv));
                }
                // Gamma(k, θ): mean kθ, CV 1/√k.
                let shape = 1.0 / (cv * cv);
                let scale = mean_gap_us / shape;
                Gamma::new(shape, scale)
                    .map(GapSampler::Gamma)
                    .map_err(|_| ScheduleError::Cv(cv))
            }
        }
    }

    pub fn sample<R: Rng>(&mut self, rng: &mut R) -> f64 {
        let g = match self {
            GapSampler::Exp(d) => d.sample(rng),
            GapSampler::Gamma(d) => d.sample(rng),
        };
        if g.is_finite() && g >= 0.0 {
            g
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn gaps(v: &[u64]) -> Vec<f64> {
        let mut prev = 0u64;
        v.iter()
            .map(|&t| {
                let g = (t - prev) as f64;
                prev = t;
                g
            })
            .collect()
    }

    fn mean_cv(g: &[f64]) -> (f64, f64) {
        let n = g.len() as f64;
        let mean = g.iter().sum::<f64>() / n;
        let var = g.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn same_seed_same_schedule_other_seed_differs() {
        let b = Bounds {
            duration_us: Some(10_000_000),
            max_requests: None,
        };
        let a1 = arrivals(
            &mut ChaCha8Rng::seed_from_u64(7),
            100.0,
            Arrival::Poisson,
            b,
        )
        .unwrap();
        let a2 = arrivals(
            &mut ChaCha8Rng::seed_from_u64(7),
            100.0,
            Arrival::Poisson,
            b,
        )
        .unwrap();
        let a3 = arrivals(
            &mut ChaCha8Rng::seed_from_u64(8),
            100.0,
            Arrival::Poisson,
            b,
        )
        .unwrap();
        assert_eq!(a1, a2);
        assert_ne!(a1, a3);
    }

    #[test]
    fn schedule_is_sorted_and_within_duration() {
        let b = Bounds {
            duration_us: Some(2_000_000),
            max_requests: None,
        };
        let a = arrivals(
            &mut ChaCha8Rng::seed_from_u64(1),
            500.0,
            Arrival::Gamma { cv: 3.0 },
            b,
        )
        .unwrap();
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        assert!(a.iter().all(|&t| t < 2_000_000));
        assert!(!a.is_empty());
    }

    #[test]
    fn request_cap_bounds_count() {
        let b = Bounds {
            duration_us: None,
            max_requests: Some(1234),
        };
        let a = arrivals(&mut ChaCha8Rng::seed_from_u64(1), 50.0, Arrival::Poisson, b).unwrap();
        assert_eq!(a.len(), 1234);
        // Whichever bound hits first: a short duration cuts the count.
        let b = Bounds {
            duration_us: Some(1_000_000),
            max_requests: Some(1234),
        };
        let a = arrivals(&mut ChaCha8Rng::seed_from_u64(1), 50.0, Arrival::Poisson, b).unwrap();
        assert!(a.len() < 200, "got {}", a.len());
    }

    #[test]
    fn poisson_mean_rate_and_cv_one() {
        let b = Bounds {
            duration_us: None,
            max_requests: Some(200_000),
        };
        let a = arrivals(
            &mut ChaCha8Rng::seed_from_u64(3),
            1000.0,
            Arrival::Poisson,
            b,
        )
        .unwrap();
        let (mean, cv) = mean_cv(&gaps(&a));
        assert!((mean - 1000.0).abs() < 10.0, "mean gap {mean}");
        assert!((cv - 1.0).abs() < 0.02, "cv {cv}");
    }

    #[test]
    fn gamma_cv_matches_requested() {
        for want in [0.5, 2.0, 3.0] {
            let b = Bounds {
                duration_us: None,
                max_requests: Some(400_000),
            };
            let a = arrivals(
                &mut ChaCha8Rng::seed_from_u64(11),
                100.0,
                Arrival::Gamma { cv: want },
                b,
            )
            .unwrap();
            // Rounding to whole microseconds perturbs tiny gaps only; mean gap is 10 ms.
            let (mean, cv) = mean_cv(&gaps(&a));
            assert!(
                (mean - 10_000.0).abs() / 10_000.0 < 0.03,
                "cv {want}: mean gap {mean}"
            );
            assert!(
                (cv - want).abs() / want < 0.05,
                "requested cv {want}, got {cv}"
            );
        }
    }

    #[test]
    fn bad_parameters_name_the_flag() {
        let b = Bounds {
            duration_us: Some(1),
            max_requests: None,
        };
        let mut r = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(
            arrivals(&mut r, 0.0, Arrival::Poisson, b),
            Err(ScheduleError::Rate(0.0))
        );
        let e = arrivals(&mut r, 1.0, Arrival::Gamma { cv: -1.0 }, b).unwrap_err();
        assert!(e.to_string().contains("--cv") && e.to_string().contains("-1"));
        let nb = Bounds {
            duration_us: None,
            max_requests: None,
        };
        assert_eq!(
            arrivals(&mut r, 1.0, Arrival::Poisson, nb),
            Err(ScheduleError::Unbounded)
        );
    }
}
