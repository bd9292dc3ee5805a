//! Decides what the picker holds about the pool between requests: the pods (fixed by
//! `--pods`, standing in for the InferencePool's ready pods), their latest metrics and scrape
//! outcomes, the scheduler with its prefix index and RNG, and the counters. Scrapes are applied
//! here and requests are routed here (the [`Router`] of the ext_proc exchange). The metrics are
//! behind a read-write lock the scrapers write and the picks read; the scheduler is behind one
//! mutex, so picks and their index updates are serialised (llm-d updates its index in a
//! goroutine after the pick; here the update is part of the pick).

use std::net::SocketAddr;
use std::sync::{Mutex, RwLock};

use rand::Rng;
use serde_json::{json, Value};

use crate::exchange::{Routed, Router};
use crate::podmetrics::PodMetrics;
use crate::prom;
use crate::scheduler::{SchedRequest, ScheduleError, Scheduler};
use crate::stats::Stats;

/// One pod: its address, latest metrics and scrape record.
#[derive(Debug, Clone)]
pub struct PodState {
    pub addr: SocketAddr,
    pub metrics: PodMetrics,
    pub scrapes_ok: u64,
    /// Scrapes that failed (connection, status, timeout, unparsable page).
    pub scrape_errors: u64,
    /// Metrics missing or unreadable on pages that parsed.
    pub metric_errors: u64,
    /// When the last page was applied, ms on the pool's clock.
    pub last_ok_ms: Option<u64>,
    pub last_error: Option<String>,
}

/// The pool and the picker's state.
#[derive(Debug)]
pub struct Pool<R> {
    pods: RwLock<Vec<PodState>>,
    scheduler: Mutex<Scheduler<R>>,
    pub stats: Stats,
}

/// A lock that a panicking holder poisoned still holds consistent data here (every write is a
/// whole-field assignment), so it is used as is.
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<R: Rng> Pool<R> {
    pub fn new(addrs: &[SocketAddr], scheduler: Scheduler<R>) -> Self {
        Pool {
            pods: RwLock::new(
                addrs
                    .iter()
                    .map(|a| PodState {
                        addr: *a,
                        metrics: PodMetrics::default(),
                        scrapes_ok: 0,
                        scrape_errors: 0,
                        metric_errors: 0,
                        last_ok_ms: None,
                        last_error: None,
                    })
                    .collect(),
            ),
            scheduler: Mutex::new(scheduler),
            stats: Stats::new(addrs.len()),
        }
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        read(&self.pods).iter().map(|p| p.addr).collect()
    }

    /// A copy of pod `i`'s state.
    pub fn pod(&self, i: usize) -> Option<PodState> {
        read(&self.pods).get(i).cloned()
    }

    /// Applies the outcome of one scrape of pod `i` at `now_ms`: a page's text, or why there
    /// is none. Returns the page's parse error or the metric errors, for the caller's log.
    pub fn record_scrape(
        &self,
        i: usize,
        now_ms: u64,
        outcome: Result<&str, String>,
    ) -> Vec<String> {
        let page = outcome.and_then(|text| prom::parse(text).map_err(|e| e.to_string()));
        let mut pods = write(&self.pods);
        let Some(p) = pods.get_mut(i) else {
            return vec![format!("no pod {i}")];
        };
        match page {
            Err(e) => {
                p.scrape_errors += 1;
                p.last_error = Some(e.clone());
                vec![e]
            }
            Ok(page) => {
                let errs = p.metrics.apply(&page);
                p.scrapes_ok += 1;
                p.last_ok_ms = Some(now_ms);
                p.metric_errors += errs.len() as u64;
                let errs: Vec<String> = errs.iter().map(ToString::to_string).collect();
                p.last_error = errs.first().cloned();
                errs
            }
        }
    }

    /// Whether every pod has had a page applied at least once.
    pub fn all_scraped(&self) -> bool {
        read(&self.pods).iter().all(|p| p.last_ok_ms.is_some())
    }

    /// The admin page: pods, metrics, scrape record, picks, index size, totals.
    pub fn snapshot(&self, now_ms: u64) -> Value {
        let blocks = lock(&self.scheduler).indexer().pod_block_counts();
        let pods: Vec<Value> = read(&self.pods)
            .iter()
            .enumerate()
            .map(|(i, p)| {
                json!({
                    "addr": p.addr.to_string(),
                    "waiting": p.metrics.waiting,
                    "running": p.metrics.running,
                    "kv_usage": p.metrics.kv_usage,
                    "block_size": p.metrics.block_size,
                    "num_gpu_blocks": p.metrics.num_gpu_blocks,
                    "scraped": p.last_ok_ms.is_some(),
                    "metrics_age_ms": p.last_ok_ms.map(|t| now_ms.saturating_sub(t)),
                    "scrapes_ok": p.scrapes_ok,
                    "scrape_errors": p.scrape_errors,
                    "metric_errors": p.metric_errors,
                    "last_error": p.last_error,
                    "picks": self.stats.picks.get(i).map_or(0, |c| c.get()),
                    "random_picks": self.stats.random_picks.get(i).map_or(0, |c| c.get()),
                    "prefix_index_blocks": blocks.get(&i).copied().unwrap_or(0),
                })
            })
            .collect();
        let scrape_errors: u64 = read(&self.pods).iter().map(|p| p.scrape_errors).sum();
        let mut totals = self.stats.totals();
        totals["scrape_errors"] = json!(scrape_errors);
        json!({"pods": pods, "totals": totals})
    }
}

impl<R: Rng> Router for Pool<R> {
    fn route(&self, req: &SchedRequest<'_>) -> Result<Routed, ScheduleError> {
        let (addrs, metrics): (Vec<SocketAddr>, Vec<PodMetrics>) =
            read(&self.pods).iter().map(|p| (p.addr, p.metrics)).unzip();
        let pick = lock(&self.scheduler).schedule(req, &metrics)?;
        let s = &self.stats;
        if let Some(c) = s.picks.get(pick.pod) {
            c.inc();
        }
        if pick.total_blocks == 0 {
            s.no_prompt_blocks.inc();
        }
        if pick.matched_blocks > 0 {
            s.prefix_hits.inc();
        }
        s.prefix_matched_blocks.add(pick.matched_blocks as u64);
        s.prefix_request_blocks.add(pick.total_blocks as u64);
        let addr = addrs.get(pick.pod).ok_or(ScheduleError::NoCandidates)?;
        Ok(Routed {
            endpoint: addr.to_string(),
        })
    }

    fn random_endpoint(&self) -> Option<String> {
        let addrs = self.addrs();
        let i = lock(&self.scheduler).random_pod(addrs.len())?;
        if let Some(c) = self.stats.random_picks.get(i) {
            c.inc();
        }
        addrs.get(i).map(ToString::to_string)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{PrefixSettings, Weights};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn pool(n: u16) -> Pool<ChaCha8Rng> {
        let addrs: Vec<SocketAddr> = (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 8000 + i)))
            .collect();
        Pool::new(
            &addrs,
            Scheduler::new(
                Weights::default(),
                PrefixSettings::default(),
                ChaCha8Rng::seed_from_u64(1),
            ),
        )
    }

    const PAGE: &str = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 40\n\
        # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n\
        # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n\
        # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n";

    #[test]
    fn scrapes_update_metrics_and_failures_are_counted() {
        let p = pool(2);
        assert!(!p.all_scraped());
        assert!(p.record_scrape(0, 10, Ok(PAGE)).is_empty());
        let errs = p.record_scrape(1, 10, Err("connect refused".into()));
        assert_eq!(errs, vec!["connect refused".to_string()]);
        let errs = p.record_scrape(1, 11, Ok("garbage here\n"));
        assert!(errs[0].contains("line 1"), "{errs:?}");
        assert_eq!(p.pod(0).unwrap().metrics.waiting, 40);
        assert_eq!(p.pod(1).unwrap().scrape_errors, 2);
        assert!(!p.all_scraped());
        let errs = p.record_scrape(1, 12, Ok("# TYPE x gauge\nx 1\n"));
        assert_eq!(errs.len(), 4, "four vLLM metrics missing: {errs:?}");
        assert!(p.all_scraped());
        let snap = p.snapshot(20);
        assert_eq!(snap["pods"][0]["waiting"], 40);
        assert_eq!(snap["pods"][0]["metrics_age_ms"], 10);
        assert_eq!(snap["pods"][1]["metric_errors"], 4);
        assert_eq!(snap["totals"]["scrape_errors"], 2);
    }

    #[test]
    fn routing_avoids_the_queued_pod_and_counts_picks() {
        let p = pool(3);
        p.record_scrape(1, 0, Ok(PAGE));
        for i in 0..30u32 {
            let prompts = vec![vec![i; 10]];
            let r = p
                .route(&SchedRequest {
                    model: "m",
                    cache_salt: "",
                    prompts: &prompts,
                })
                .unwrap();
            assert_ne!(r.endpoint, "127.0.0.1:8001");
        }
        let snap = p.snapshot(0);
        assert_eq!(snap["pods"][1]["picks"], 0);
        assert_eq!(snap["totals"]["picks"], 30);
    }

    #[test]
    fn an_empty_pool_routes_nowhere() {
        let p = pool(0);
        let r = p.route(&SchedRequest {
            model: "m",
            cache_salt: "",
            prompts: &[],
        });
        assert_eq!(r, Err(ScheduleError::NoCandidates));
        assert_eq!(p.random_endpoint(), None);
    }
}
