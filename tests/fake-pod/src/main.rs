//! Decides the process lifecycle of `ai-lb-fake-pod`: parse flags, bind, announce
//! `LISTENING http ADDR` on stdout, serve until SIGTERM/SIGINT, then drain.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use ai_lb_fake_pod::config::{hostname, Cli, PodConfig};
use ai_lb_fake_pod::kv_events;
use ai_lb_fake_pod::server::{self, AppState};

/// How long open requests may drain after a shutdown signal.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let cfg = PodConfig::from_cli(cli, hostname());
    let listen = cfg.listen;
    let state = AppState::new(cfg)?;
    let signals = Signals::install()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot bind --listen {listen}"))?;
    let addr = listener.local_addr()?;
    // KV events first: when the http line is out, everything is bound.
    if let Some(ev) = state.config().kv_events.clone() {
        let (sink, bound) = kv_events::spawn(&ev).await?;
        state.attach_kv_events(sink);
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTENING kv-events {}", bound.endpoint)?;
        if let Some(r) = &bound.replay_endpoint {
            writeln!(out, "LISTENING kv-events-replay {r}")?;
        }
        out.flush()?;
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTENING http {addr}")?;
        out.flush()?;
    }
    let c = state.config();
    tracing::info!(
        pod = %c.pod_name, preset = c.preset.name(), model = %c.model,
        time_scale = c.engine.time_scale, "fake pod serving on {addr}"
    );
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        signals.wait().await;
        let _ = stop_tx.send(true);
    });
    let mut stop_rx2 = stop_rx.clone();
    let graceful = async move {
        let _ = stop_rx2.wait_for(|s| *s).await;
    };
    let serve = server::serve(state, listener, graceful);
    tokio::select! {
        r = serve => r.context("server failed")?,
        _ = async {
            let _ = stop_rx.wait_for(|s| *s).await;
            tokio::time::sleep(DRAIN_LIMIT).await;
        } => tracing::warn!("drain limit reached, exiting with requests still open"),
    }
    Ok(())
}

/// Signal handlers, installed before `LISTENING` is printed so no early SIGTERM is missed.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                term: signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?,
                int: signal(SignalKind::interrupt()).context("cannot install SIGINT handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    async fn wait(mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
        #[cfg(not(unix))]
        {
            let _ = &mut self;
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown signal received, draining");
    }
}
