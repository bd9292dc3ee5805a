//! `ai-lb-agent`: parses and validates the configuration (exit 2 on bad input), builds the
//! sources, binds the listeners (printing `LISTENING grpc|http ADDR`), runs until SIGTERM/SIGINT
//! and then shuts down gracefully (exit 0).

use ai_lb_agent::config::{AgentConfig, EngineChoice, GpuSource, RawArgs};
use ai_lb_agent::engines::EngineKind;
use ai_lb_agent::grpc::{start, StartArgs};
use ai_lb_agent::sampler::{new_agent_instance, SystemClock};
use ai_lb_agent::sources::model_server::{ModelServerOptions, ModelServerSource};
use ai_lb_agent::sources::Source;
use anyhow::Context;
use clap::Parser;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cfg = match RawArgs::parse()
        .merge_file()
        .and_then(AgentConfig::try_from)
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ai-lb-agent: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ai-lb-agent: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(run(cfg)) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("ai-lb-agent: {e:#}");
            std::process::exit(1);
        }
    }
}

/// The configured sources, and the names of those not configured.
type Sources = (Vec<Box<dyn Source>>, Vec<&'static str>);

fn build_sources(cfg: &AgentConfig) -> anyhow::Result<Sources> {
    let mut sources: Vec<Box<dyn Source>> = Vec::new();
    let mut absent: Vec<&'static str> = Vec::new();
    match &cfg.gpu_source {
        GpuSource::None => absent.push("nvml"),
        GpuSource::Sim { url } => sources.push(gpu_sources::sim(url)?),
        GpuSource::Nvml => sources.push(gpu_sources::nvml(cfg.gpm_interval).with_context(|| {
            let how = if cfg.gpu_source_explicit {
                "--gpu-source nvml"
            } else {
                "--gpu-source nvml (the default)"
            };
            format!("{how}: cannot load NVML; on a host without NVIDIA drivers pass --gpu-source sim or --gpu-source none")
        })?),
    }
    match &cfg.model_server_url {
        None => absent.push("model-server"),
        Some(url) => {
            let mut opts = ModelServerOptions::new(url);
            opts.engine = match cfg.engine {
                EngineChoice::Auto => None,
                EngineChoice::Vllm => Some(EngineKind::Vllm),
                EngineChoice::Sglang => Some(EngineKind::Sglang),
                EngineChoice::Tgi => Some(EngineKind::Tgi),
                EngineChoice::Triton => Some(EngineKind::Triton),
            };
            opts.window = cfg.window;
            opts.rate_window = cfg.rate_window;
            opts.recent_window = cfg.recent_window;
            opts.queue_capacity = cfg.queue_capacity;
            opts.kv_capacity_tokens = cfg.kv_capacity_tokens;
            opts.model_names = cfg.models.clone();
            let src = ModelServerSource::new(opts)
                .map_err(|e| anyhow::anyhow!("--model-server-url {url}: {e}"))?;
            sources.push(Box::new(src));
        }
    }
    Ok((sources, absent))
}

/// GPU source constructors (kept apart so their signatures are in one place).
mod gpu_sources {
    use ai_lb_agent::sources::nvml::{NvmlSource, VisibleEnv};
    use ai_lb_agent::sources::sim::{SimOptions, SimSource};
    use ai_lb_agent::sources::Source;
    use std::time::Duration;

    pub fn sim(url: &str) -> anyhow::Result<Box<dyn Source>> {
        let s = SimSource::new(SimOptions {
            url: url.to_string(),
            timeout: Duration::from_secs(1),
        })
        .map_err(|e| anyhow::anyhow!("--sim-url {url}: {e}"))?;
        Ok(Box::new(s))
    }

    pub fn nvml(gpm_interval: Duration) -> anyhow::Result<Box<dyn Source>> {
        let s = NvmlSource::open(&VisibleEnv::from_process_env(), gpm_interval)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Box::new(s))
    }
}

fn announce(kind: &str, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "LISTENING {kind} {addr}")?;
    out.flush()?;
    Ok(())
}

async fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    let (sources, absent) = build_sources(&cfg)?;
    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen {}: cannot bind", cfg.grpc_listen))?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_listen)
        .await
        .with_context(|| format!("--http-listen {}: cannot bind", cfg.http_listen))?;
    announce("grpc", grpc_listener.local_addr()?)?;
    announce("http", http_listener.local_addr()?)?;
    let instance = new_agent_instance();
    tracing::info!(agent_instance = %instance, serving_address = %cfg.serving_address, "agent starting");
    let agent = start(
        &cfg,
        StartArgs {
            sources,
            absent,
            grpc_listener,
            http_listener,
            clock: Arc::new(SystemClock),
            agent_instance: instance,
            resolver: None,
        },
    )?;
    wait_for_signal().await?;
    tracing::info!("shutting down: ending streams");
    agent.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
