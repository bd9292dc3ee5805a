//! The agent's HTTP face: `/metrics` (Prometheus text: the agent's own health and the latest
//! snapshot's values with pod labels), `/healthz` (process up) and `/readyz` (first sample taken
//! and at least one source fresh).

use crate::grpc::StreamStats;
use crate::kv_events::KvFeed;
use crate::pool::PoolView;
use crate::ports::{Port, PortStats, Reason};
use crate::sampler::{Clock, Hub};
use ai_lb_proto::v1::{LatencyQuantiles, PodSnapshot, SourceState};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the HTTP handlers read.
#[derive(Clone)]
pub struct HttpState {
    pub hub: Arc<Hub>,
    pub pool: Arc<PoolView>,
    pub stats: Arc<StreamStats>,
    pub clock: Arc<dyn Clock>,
    /// The KV-event feed, when subscribed.
    pub kv: Option<Arc<KvFeed>>,
    /// Refusals on the agent's ports.
    pub ports: Arc<PortStats>,
}

/// The router (exposed for tests).
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Ready = a sample was taken and at least one source is fresh; otherwise the reason.
pub fn readiness(snapshot: Option<&PodSnapshot>) -> Result<(), String> {
    let Some(s) = snapshot else {
        return Err("no sample taken yet".into());
    };
    if s.sources
        .iter()
        .any(|x| x.state == SourceState::Fresh as i32)
    {
        return Ok(());
    }
    let why: Vec<String> = s
        .sources
        .iter()
        .map(|x| format!("{}: {}", x.name, x.reason))
        .collect();
    Err(format!("no source is fresh ({})", why.join("; ")))
}

async fn readyz(State(st): State<HttpState>) -> impl IntoResponse {
    let latest = st.hub.latest();
    match readiness(latest.as_ref().map(|p| &p.snapshot)) {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

async fn metrics(State(st): State<HttpState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render_metrics(&st),
    )
}

/// Escapes a Prometheus label value.
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn state_label(s: i32) -> &'static str {
    match SourceState::try_from(s) {
        Ok(SourceState::Fresh) => "fresh",
        Ok(SourceState::Failing) => "failing",
        Ok(SourceState::Absent) => "absent",
        _ => "unspecified",
    }
}

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn line(&mut self, name: &str, labels: &str, v: f64) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {v}");
        } else {
            let _ = writeln!(self.0, "{name}{{{labels}}} {v}");
        }
    }
}

/// The whole `/metrics` page.
pub fn render_metrics(st: &HttpState) -> String {
    let mut o = Out(String::with_capacity(4096));
    let latest = st.hub.latest();
    let now = st.clock.now();
    let snap = latest.as_ref().map(|p| p.render(now));

    o.head("ai_lb_agent_up", "gauge", "1 while the agent process runs.");
    o.line("ai_lb_agent_up", "", 1.0);
    o.head(
        "ai_lb_agent_samples_total",
        "counter",
        "Snapshots published (one per source read, and one when a read stalls).",
    );
    o.line(
        "ai_lb_agent_samples_total",
        "",
        st.hub.samples_taken() as f64,
    );
    o.head(
        "ai_lb_agent_source_reads_total",
        "counter",
        "Reads of each source by outcome; each source is read on its own clock.",
    );
    for (source, ok, failed) in st.hub.source_reads() {
        let s = escape_label(&source);
        o.line(
            "ai_lb_agent_source_reads_total",
            &format!("source=\"{s}\",outcome=\"ok\""),
            ok as f64,
        );
        o.line(
            "ai_lb_agent_source_reads_total",
            &format!("source=\"{s}\",outcome=\"failed\""),
            failed as f64,
        );
    }

    if let Some(s) = &snap {
        o.head(
            "ai_lb_agent_source_state",
            "gauge",
            "1 for the current state of each source.",
        );
        for src in &s.sources {
            for state in ["fresh", "failing", "absent"] {
                let v = if state_label(src.state) == state {
                    1.0
                } else {
                    0.0
                };
                let l = format!("source=\"{}\",state=\"{state}\"", escape_label(&src.name));
                o.line("ai_lb_agent_source_state", &l, v);
            }
        }
        o.head(
            "ai_lb_agent_source_consecutive_failures",
            "gauge",
            "Failed samples in a row per source.",
        );
        for src in &s.sources {
            let l = format!("source=\"{}\"", escape_label(&src.name));
            o.line(
                "ai_lb_agent_source_consecutive_failures",
                &l,
                src.consecutive_failures as f64,
            );
        }
        o.head(
            "ai_lb_agent_source_last_success_age_seconds",
            "gauge",
            "Age of each source's last successful read.",
        );
        for src in &s.sources {
            if let Some(a) = src.last_success_age_ms {
                let l = format!("source=\"{}\"", escape_label(&src.name));
                o.line(
                    "ai_lb_agent_source_last_success_age_seconds",
                    &l,
                    a as f64 / 1000.0,
                );
            }
        }
    }

    o.head(
        "ai_lb_agent_rejected_values_total",
        "counter",
        "Values dropped as NaN, negative, out of range or malformed, by source and field.",
    );
    for ((source, field), n) in st.hub.rejected_counts() {
        let l = format!(
            "source=\"{}\",field=\"{}\"",
            escape_label(&source),
            escape_label(&field)
        );
        o.line("ai_lb_agent_rejected_values_total", &l, n as f64);
    }

    o.head("ai_lb_agent_peers", "gauge", "Pool peers by status.");
    for (status, n) in st.pool.counts() {
        o.line(
            "ai_lb_agent_peers",
            &format!("status=\"{status}\""),
            n as f64,
        );
    }
    o.head(
        "ai_lb_agent_streams_open",
        "gauge",
        "Open gRPC streams by RPC.",
    );
    o.line(
        "ai_lb_agent_streams_open",
        "rpc=\"Watch\"",
        st.stats.watch_open.load(Ordering::Relaxed) as f64,
    );
    o.line(
        "ai_lb_agent_streams_open",
        "rpc=\"WatchPool\"",
        st.stats.pool_open.load(Ordering::Relaxed) as f64,
    );
    o.head(
        "ai_lb_agent_stream_events_total",
        "counter",
        "Events sent by RPC.",
    );
    o.line(
        "ai_lb_agent_stream_events_total",
        "rpc=\"Watch\"",
        st.stats.watch_events.load(Ordering::Relaxed) as f64,
    );
    o.line(
        "ai_lb_agent_stream_events_total",
        "rpc=\"WatchPool\"",
        st.stats.pool_events.load(Ordering::Relaxed) as f64,
    );

    render_ports(&mut o, &st.ports);
    if let Some(kv) = &st.kv {
        render_kv(&mut o, kv);
    }
    if let Some(s) = &snap {
        render_snapshot(&mut o, s);
    }
    o.0
}

/// What peers were refused on the agent's ports, and the connections open.
fn render_ports(o: &mut Out, p: &PortStats) {
    o.head(
        "ai_lb_agent_port_rejections_total",
        "counter",
        "Connections, streams and messages refused or dropped on the agent's ports, by port \
         and reason (see docs/operations.md, \"The agent's ports\").",
    );
    for port in Port::ALL {
        for reason in Reason::ALL.into_iter().filter(|r| r.applies_to(port)) {
            o.line(
                "ai_lb_agent_port_rejections_total",
                &format!("port=\"{}\",reason=\"{}\"", port.label(), reason.label()),
                p.rejections(port, reason) as f64,
            );
        }
    }
    o.head(
        "ai_lb_agent_connections_open",
        "gauge",
        "Connections open now, by port.",
    );
    for port in Port::ALL {
        o.line(
            "ai_lb_agent_connections_open",
            &format!("port=\"{}\"", port.label()),
            p.open_connections(port) as f64,
        );
    }
}

/// The KV-event feed's counters and the summary's size.
fn render_kv(o: &mut Out, kv: &KvFeed) {
    let k = &kv.stats;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    o.head(
        "ai_lb_agent_kv_events_connected",
        "gauge",
        "1 while subscribed to the model server's KV events.",
    );
    o.line(
        "ai_lb_agent_kv_events_connected",
        "",
        f64::from(u8::from(k.connected.load(Ordering::Relaxed))),
    );
    o.head(
        "ai_lb_agent_kv_event_batches_total",
        "counter",
        "KV-event messages received and decoded.",
    );
    o.line("ai_lb_agent_kv_event_batches_total", "", get(&k.batches));
    o.head(
        "ai_lb_agent_kv_events_total",
        "counter",
        "KV events applied by type; ignored = another medium or a LoRA adapter's blocks.",
    );
    for (t, c) in [
        ("stored", &k.stored),
        ("removed", &k.removed),
        ("cleared", &k.cleared),
        ("ignored", &k.ignored),
    ] {
        o.line(
            "ai_lb_agent_kv_events_total",
            &format!("type=\"{t}\""),
            get(c),
        );
    }
    o.head(
        "ai_lb_agent_kv_event_decode_errors_total",
        "counter",
        "KV-event messages or events skipped as malformed.",
    );
    o.line(
        "ai_lb_agent_kv_event_decode_errors_total",
        "",
        get(&k.decode_errors),
    );
    o.head(
        "ai_lb_agent_kv_event_gaps_total",
        "counter",
        "Sequence gaps: replayed, or lost (the view was cleared).",
    );
    o.line(
        "ai_lb_agent_kv_event_gaps_total",
        "outcome=\"replayed\"",
        get(&k.gaps_replayed),
    );
    o.line(
        "ai_lb_agent_kv_event_gaps_total",
        "outcome=\"lost\"",
        get(&k.gaps_lost),
    );
    o.head(
        "ai_lb_agent_kv_event_publisher_restarts_total",
        "counter",
        "Sequences that went backwards (the view was cleared).",
    );
    o.line(
        "ai_lb_agent_kv_event_publisher_restarts_total",
        "",
        get(&k.restarts),
    );
    o.head(
        "ai_lb_agent_kv_event_connect_failures_total",
        "counter",
        "Failed subscription attempts.",
    );
    o.line(
        "ai_lb_agent_kv_event_connect_failures_total",
        "",
        get(&k.connect_failures),
    );
    o.head(
        "ai_lb_agent_kv_blocks_tracked",
        "gauge",
        "The pod's cached KV blocks known from its events.",
    );
    o.line("ai_lb_agent_kv_blocks_tracked", "", get(&k.blocks_tracked));
    o.head(
        "ai_lb_agent_prefix_summary_keys",
        "gauge",
        "Keys in the last prefix-cache summary.",
    );
    o.line("ai_lb_agent_prefix_summary_keys", "", get(&k.summary_keys));
    o.head(
        "ai_lb_agent_prefix_summary_truncated",
        "gauge",
        "1 when the last summary was cut to --prefix-max-keys.",
    );
    o.line(
        "ai_lb_agent_prefix_summary_truncated",
        "",
        f64::from(u8::from(k.summary_truncated.load(Ordering::Relaxed))),
    );
    o.head(
        "ai_lb_agent_prefix_summary_errors_total",
        "counter",
        "Summaries withheld (key block size not a multiple of the pod's, no model name).",
    );
    o.line(
        "ai_lb_agent_prefix_summary_errors_total",
        "",
        get(&k.summary_errors),
    );
}

fn render_snapshot(o: &mut Out, s: &PodSnapshot) {
    let id = s.identity.clone().unwrap_or_default();
    let pod = format!(
        "pod=\"{}\",namespace=\"{}\",address=\"{}\"",
        escape_label(&id.pod_name),
        escape_label(&id.namespace),
        escape_label(&id.address)
    );
    o.head(
        "ai_lb_agent_snapshot_sequence",
        "counter",
        "Sequence of the latest snapshot.",
    );
    o.line("ai_lb_agent_snapshot_sequence", &pod, s.sequence as f64);
    o.head(
        "ai_lb_agent_snapshot_age_seconds",
        "gauge",
        "Age of the latest snapshot.",
    );
    o.line(
        "ai_lb_agent_snapshot_age_seconds",
        &pod,
        s.age_ms as f64 / 1000.0,
    );

    type GpuField = fn(&ai_lb_proto::v1::GpuStats) -> Option<f64>;
    let gpu_metrics: [(&str, &str, GpuField); 9] = [
        (
            "ai_lb_agent_gpu_utilization_ratio",
            "GPU utilisation 0..1 (NVML: fraction of time any kernel ran).",
            |g| g.utilization,
        ),
        (
            "ai_lb_agent_gpu_sm_occupancy_ratio",
            "Active warps over the maximum, 0..1 (GPM; Hopper and later).",
            |g| g.sm_occupancy,
        ),
        (
            "ai_lb_agent_gpu_sm_utilization_ratio",
            "Share of time SMs had a warp assigned, 0..1 (GPM).",
            |g| g.sm_utilization,
        ),
        (
            "ai_lb_agent_gpu_tensor_activity_ratio",
            "Share of time a tensor pipe was active, 0..1 (GPM).",
            |g| g.tensor_activity,
        ),
        (
            "ai_lb_agent_gpu_dram_activity_ratio",
            "Share of peak DRAM bandwidth used, 0..1 (GPM).",
            |g| g.dram_activity,
        ),
        (
            "ai_lb_agent_gpu_memory_used_bytes",
            "GPU memory used.",
            |g| g.memory_used_bytes.map(|v| v as f64),
        ),
        (
            "ai_lb_agent_gpu_memory_total_bytes",
            "GPU memory total.",
            |g| g.memory_total_bytes.map(|v| v as f64),
        ),
        (
            "ai_lb_agent_gpu_temperature_celsius",
            "GPU temperature.",
            |g| g.temperature_celsius,
        ),
        ("ai_lb_agent_gpu_power_watts", "GPU power draw.", |g| {
            g.power_watts
        }),
    ];
    for (name, help, f) in gpu_metrics {
        if s.gpus.iter().all(|g| f(g).is_none()) {
            continue;
        }
        o.head(name, "gauge", help);
        for g in &s.gpus {
            if let Some(v) = f(g) {
                let l = format!(
                    "{pod},gpu=\"{}\",uuid=\"{}\"",
                    g.index,
                    escape_label(&g.uuid)
                );
                o.line(name, &l, v);
            }
        }
    }

    let Some(inf) = &s.inference else { return };
    let scalars: [(&str, &str, Option<f64>); 8] = [
        (
            "ai_lb_agent_queue_waiting",
            "Requests waiting.",
            inf.waiting.map(f64::from),
        ),
        (
            "ai_lb_agent_queue_running",
            "Requests running.",
            inf.running.map(f64::from),
        ),
        (
            "ai_lb_agent_queue_capacity",
            "Maximum concurrently running sequences.",
            inf.queue_capacity.map(f64::from),
        ),
        (
            "ai_lb_agent_kv_capacity_tokens",
            "KV-cache capacity in tokens.",
            inf.kv_capacity_tokens.map(|t| t as f64),
        ),
        (
            "ai_lb_agent_kv_cache_usage_ratio",
            "KV-cache use 0..1.",
            inf.kv_cache_usage,
        ),
        (
            "ai_lb_agent_request_rate",
            "Requests finished per second.",
            inf.request_rate,
        ),
        (
            "ai_lb_agent_error_ratio",
            "Fraction of finished requests that failed.",
            inf.error_rate,
        ),
        (
            "ai_lb_agent_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache over prompt tokens queried, over the rate window.",
            inf.prefix_cache_hit_rate,
        ),
    ];
    for (name, help, v) in scalars {
        if let Some(v) = v {
            o.head(name, "gauge", help);
            o.line(name, &pod, v);
        }
    }
    let lat: [(&str, &Option<LatencyQuantiles>); 4] = [
        ("ttft", &inf.ttft),
        ("e2e", &inf.e2e),
        ("inter_token", &inf.inter_token),
        ("inter_token_recent", &inf.inter_token_recent),
    ];
    let mut headed = false;
    for (kind, q) in lat {
        let Some(q) = q else { continue };
        for (quantile, v) in [("0.5", q.p50_ms), ("0.99", q.p99_ms)] {
            if let Some(v) = v {
                if !headed {
                    o.head(
                        "ai_lb_agent_latency_ms",
                        "gauge",
                        "Windowed latency quantiles from histogram deltas (inter_token_recent: over --recent-window).",
                    );
                    headed = true;
                }
                let l = format!("{pod},kind=\"{kind}\",quantile=\"{quantile}\"");
                o.line("ai_lb_agent_latency_ms", &l, v);
            }
        }
    }
    let mut headed = false;
    for (kind, q) in lat {
        let Some(v) = q.as_ref().and_then(|q| q.mean_ms) else {
            continue;
        };
        if !headed {
            o.head(
                "ai_lb_agent_latency_mean_ms",
                "gauge",
                "Windowed latency mean (histogram _sum delta over _count delta), where the model server exports _sum.",
            );
            headed = true;
        }
        o.line(
            "ai_lb_agent_latency_mean_ms",
            &format!("{pod},kind=\"{kind}\""),
            v,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::v1::SourceStatus;

    #[test]
    fn capacities_are_exported_next_to_each_other() {
        let s = PodSnapshot {
            inference: Some(ai_lb_proto::v1::InferenceStats {
                queue_capacity: Some(256),
                kv_capacity_tokens: Some(400_000),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut o = Out(String::new());
        render_snapshot(&mut o, &s);
        let l = "pod=\"\",namespace=\"\",address=\"\"";
        for line in [
            format!("ai_lb_agent_queue_capacity{{{l}}} 256"),
            format!("ai_lb_agent_kv_capacity_tokens{{{l}}} 400000"),
            "# TYPE ai_lb_agent_kv_capacity_tokens gauge".to_string(),
        ] {
            assert!(o.0.lines().any(|x| x == line), "missing {line}\n{}", o.0);
        }
    }

    #[test]
    fn latency_means_are_exported_where_known() {
        let s = PodSnapshot {
            inference: Some(ai_lb_proto::v1::InferenceStats {
                inter_token_recent: Some(LatencyQuantiles {
                    p50_ms: Some(5.0),
                    samples: 40,
                    mean_ms: Some(4.8),
                    ..Default::default()
                }),
                ttft: Some(LatencyQuantiles {
                    p50_ms: Some(20.0),
                    samples: 4,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut o = Out(String::new());
        render_snapshot(&mut o, &s);
        let l = "pod=\"\",namespace=\"\",address=\"\"";
        let want = format!("ai_lb_agent_latency_mean_ms{{{l},kind=\"inter_token_recent\"}} 4.8");
        assert!(o.0.lines().any(|x| x == want), "missing {want}\n{}", o.0);
        assert!(!o.0.contains(
            "ai_lb_agent_latency_mean_ms{pod=\"\",namespace=\"\",address=\"\",kind=\"ttft\"}"
        ));
    }

    #[test]
    fn readiness_needs_a_fresh_source() {
        assert!(readiness(None).unwrap_err().contains("no sample"));
        let mut s = PodSnapshot {
            sources: vec![SourceStatus {
                name: "sim".into(),
                state: SourceState::Failing as i32,
                reason: "sim: HTTP 500".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = readiness(Some(&s)).unwrap_err();
        assert!(e.contains("sim: HTTP 500"), "{e}");
        s.sources[0].state = SourceState::Fresh as i32;
        assert!(readiness(Some(&s)).is_ok());
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
