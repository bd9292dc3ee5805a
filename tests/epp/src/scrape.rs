//! Glue: one task per pod fetches `http://IP:PORT<metrics path>` every refresh interval (a
//! tick that finds the previous scrape still running is skipped, as Go's ticker drops ticks)
//! with a deadline per scrape, and hands the page, or why there is none, to the pool. The
//! clock is injected so the pool's record of when a pod was last read is testable.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::task::JoinHandle;

use crate::pool::Pool;

/// Milliseconds on a monotonic clock.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> u64;
}

/// Milliseconds since the process started.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock(pub Instant);

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// How the pods are scraped.
#[derive(Debug, Clone)]
pub struct ScrapeOptions {
    pub every: Duration,
    pub timeout: Duration,
    pub path: String,
}

async fn fetch(client: &reqwest::Client, url: &str, timeout: Duration) -> Result<String, String> {
    let get = async {
        let resp = client
            .get(url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(format!("GET {url}: status {status}"));
        }
        resp.text()
            .await
            .map_err(|e| format!("GET {url}: reading the body: {e}"))
    };
    match tokio::time::timeout(timeout, get).await {
        Ok(r) => r,
        Err(_) => Err(format!("GET {url}: no answer within {timeout:?}")),
    }
}

/// Starts one scraping task per pod; they run until aborted.
pub fn spawn<R: Rng + Send + 'static>(
    pool: Arc<Pool<R>>,
    opts: ScrapeOptions,
    clock: Arc<dyn Clock>,
) -> Result<Vec<JoinHandle<()>>, reqwest::Error> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()?;
    let mut tasks = Vec::new();
    for (i, addr) in pool.addrs().into_iter().enumerate() {
        let (pool, client, clock, opts) =
            (pool.clone(), client.clone(), clock.clone(), opts.clone());
        let url = format!("http://{addr}{}", opts.path);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(opts.every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut failing = false;
            loop {
                tick.tick().await;
                let outcome = fetch(&client, &url, opts.timeout).await;
                let errs = pool.record_scrape(i, clock.now_ms(), outcome.as_deref().map_err(Clone::clone));
                match (outcome.is_err(), failing) {
                    (true, false) => {
                        tracing::warn!(pod = %addr, error = %errs.join("; "), "scrape failing (keeping the last readings)");
                        failing = true;
                    }
                    (false, true) => {
                        tracing::info!(pod = %addr, "scrape recovered");
                        failing = false;
                    }
                    _ => {}
                }
            }
        }));
    }
    Ok(tasks)
}
