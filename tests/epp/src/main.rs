//! `ai-lb-epp`: parses and validates the flags (exit 2 naming the flag and the value), binds
//! the ext_proc gRPC listener and the admin page (printing `LISTENING grpc ADDR` and
//! `LISTENING admin ADDR` on stdout), scrapes the pods, serves until SIGTERM/SIGINT, then stops
//! accepting streams, lets open ones finish (at most 5 s) and exits 0.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ai_lb_epp::config::{Config, RawArgs};
use ai_lb_epp::pool::Pool;
use ai_lb_epp::scheduler::Scheduler;
use ai_lb_epp::scrape::{self, Clock, ScrapeOptions, SystemClock};
use ai_lb_epp::server::ExtProc;
use anyhow::Context;
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessorServer, SERVICE_NAME,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cfg = match Config::try_from(RawArgs::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ai-lb-epp: {e}");
            std::process::exit(2);
        }
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(w) = cfg.workers {
        rt.worker_threads(w);
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ai-lb-epp: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(run(cfg)) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("ai-lb-epp: {e:#}");
            std::process::exit(1);
        }
    }
}

fn announce(kind: &str, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "LISTENING {kind} {addr}")?;
    out.flush()?;
    Ok(())
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    // Before anything is announced: a SIGTERM right after the LISTENING lines must stop us
    // gracefully, not kill us.
    let stop_signal = stop_signal()?;
    let seed = cfg.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let clock: Arc<dyn Clock> = Arc::new(SystemClock(Instant::now()));
    let pool = Arc::new(Pool::new(
        &cfg.pods,
        Scheduler::new(cfg.weights, cfg.prefix, ChaCha8Rng::seed_from_u64(seed)),
    ));
    if cfg.pods.is_empty() {
        tracing::warn!("--pods is empty: every request will be answered 503");
    }
    let grpc = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("--listen {}: cannot bind", cfg.listen))?;
    let admin = tokio::net::TcpListener::bind(cfg.admin_listen)
        .await
        .with_context(|| format!("--admin-listen {}: cannot bind", cfg.admin_listen))?;
    let grpc_addr = grpc.local_addr()?;
    let admin_addr = admin.local_addr()?;
    tracing::info!(
        pods = ?cfg.pods, seed, refresh = ?cfg.refresh, weights = ?cfg.weights, prefix = ?cfg.prefix,
        "ai-lb-epp starting"
    );
    let scrapers = scrape::spawn(
        pool.clone(),
        ScrapeOptions {
            every: cfg.refresh,
            timeout: cfg.scrape_timeout,
            path: cfg.metrics_path.clone(),
        },
        clock.clone(),
    )
    .context("building the metrics client")?;

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(SERVICE_NAME, tonic_health::ServingStatus::Serving)
        .await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut grpc_stop = stop_rx.clone();
    let grpc_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(ExternalProcessorServer::new(ExtProc::new(pool.clone())))
            .serve_with_incoming_shutdown(
                // TCP_NODELAY on every accepted stream, as Go's net package sets by default
                // (llm-d's EPP is a Go gRPC server): with Nagle's algorithm on, the picker's
                // small ext_proc replies wait for Envoy's delayed ACKs (tens of ms).
                tokio_stream::StreamExt::map(
                    tokio_stream::wrappers::TcpListenerStream::new(grpc),
                    |s| {
                        if let Ok(s) = &s {
                            let _ = s.set_nodelay(true);
                        }
                        s
                    },
                ),
                async move {
                    let _ = grpc_stop.wait_for(|s| *s).await;
                },
            ),
    );
    let mut admin_stop = stop_rx.clone();
    let admin_app = ai_lb_epp::admin::router(pool.clone(), clock.clone());
    let admin_task = tokio::spawn(async move {
        axum::serve(admin, admin_app)
            .with_graceful_shutdown(async move {
                let _ = admin_stop.wait_for(|s| *s).await;
            })
            .await
    });
    announce("grpc", grpc_addr)?;
    announce("admin", admin_addr)?;

    stop_signal.await;
    tracing::info!("shutting down: no new streams, open ones may finish (5 s)");
    for s in &scrapers {
        s.abort();
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = grpc_task.await;
        let _ = admin_task.await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("streams still open after 5 s; exiting anyway");
    }
    tracing::info!(stats = %pool.snapshot(clock.now_ms())["totals"], "ai-lb-epp stopped");
    Ok(())
}

/// Resolves on the first SIGTERM or SIGINT (handlers installed when called).
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
