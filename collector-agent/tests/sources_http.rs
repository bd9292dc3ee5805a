//! The model-server and sim sources against a tiny axum server on 127.0.0.1:0 serving the
//! fixtures: readings over HTTP, `/v1/models` cached and preferred, HTTP 500, connection refused
//! and garbage pages → `SourceError`.

use ai_lb_agent::sources::model_server::{ModelServerOptions, ModelServerSource};
use ai_lb_agent::sources::sim::{SimOptions, SimSource};
use ai_lb_agent::sources::{Source, SourceError};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[derive(Default)]
struct Fake {
    metrics: Mutex<(u16, String)>,
    models: Mutex<Option<String>>,
    models_hits: AtomicUsize,
    gpu: Mutex<(u16, String)>,
}

type Shared = Arc<Fake>;

async fn metrics(State(f): State<Shared>) -> (StatusCode, String) {
    let (code, body) = f.metrics.lock().unwrap().clone();
    (StatusCode::from_u16(code).unwrap(), body)
}

async fn models(State(f): State<Shared>) -> (StatusCode, String) {
    f.models_hits.fetch_add(1, Ordering::SeqCst);
    match f.models.lock().unwrap().clone() {
        Some(b) => (StatusCode::OK, b),
        None => (StatusCode::NOT_FOUND, "not found".into()),
    }
}

async fn gpu(State(f): State<Shared>) -> (StatusCode, String) {
    let (code, body) = f.gpu.lock().unwrap().clone();
    (StatusCode::from_u16(code).unwrap(), body)
}

async fn serve(f: Shared) -> SocketAddr {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/sim/gpu", get(gpu))
        .with_state(f);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// An address nothing listens on: bind, note the port, close.
async fn refused_addr() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a
}

fn opts(addr: SocketAddr) -> ModelServerOptions {
    let mut o = ModelServerOptions::new(&format!("http://{addr}"));
    o.timeout = Duration::from_secs(5);
    o
}

#[tokio::test]
async fn model_server_over_http_with_models_cache() {
    let f = Shared::default();
    *f.metrics.lock().unwrap() = (200, fixture("vllm.prom"));
    *f.models.lock().unwrap() = Some(
        r#"{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model"},
        {"id":"sql-lora","object":"model","parent":"meta-llama/Llama-3.1-8B-Instruct"}]}"#
            .into(),
    );
    let addr = serve(f.clone()).await;
    let mut o = opts(addr);
    o.models_refresh = Duration::from_secs(60);
    let mut s = ModelServerSource::new(o).unwrap();
    let t0 = Instant::now();
    let r = s.sample(t0).await.unwrap();
    assert_eq!(r.inference.as_ref().unwrap().waiting, Some(5));
    let m = r.models.unwrap();
    assert_eq!(m[0].adapters, vec!["sql-lora".to_string()]);

    *f.metrics.lock().unwrap() = (200, fixture("vllm_next.prom"));
    let r = s.sample(t0 + Duration::from_secs(1)).await.unwrap();
    let st = r.inference.unwrap();
    assert_eq!(st.ttft.unwrap().samples, 100);
    assert_eq!(st.request_rate, Some(100.0));
    assert_eq!(
        f.models_hits.load(Ordering::SeqCst),
        1,
        "models list cached"
    );
    // /v1/models gone: the cached list stays.
    *f.models.lock().unwrap() = None;
    let r = s.sample(t0 + Duration::from_secs(61)).await.unwrap();
    assert_eq!(
        f.models_hits.load(Ordering::SeqCst),
        2,
        "refreshed after 60 s"
    );
    assert_eq!(r.models.unwrap()[0].adapters.len(), 1);
}

#[tokio::test]
async fn configured_names_when_no_models_endpoint() {
    let f = Shared::default();
    *f.metrics.lock().unwrap() = (200, fixture("tgi.prom"));
    let addr = serve(f.clone()).await;
    let mut o = opts(addr);
    o.model_names = vec!["bigscience/bloom".into()];
    let mut s = ModelServerSource::new(o).unwrap();
    let r = s.sample(Instant::now()).await.unwrap();
    assert_eq!(r.models.unwrap()[0].name, "bigscience/bloom");
}

#[tokio::test]
async fn http_500_is_a_source_error() {
    let f = Shared::default();
    *f.metrics.lock().unwrap() = (500, "boom".into());
    let addr = serve(f).await;
    let mut s = ModelServerSource::new(opts(addr)).unwrap();
    match s.sample(Instant::now()).await {
        Err(SourceError::HttpStatus { status: 500, .. }) => {}
        other => panic!("expected HTTP 500, got {other:?}"),
    }
}

#[tokio::test]
async fn garbage_page_is_malformed() {
    let f = Shared::default();
    *f.metrics.lock().unwrap() = (200, "<html>hello</html>\n".into());
    let addr = serve(f).await;
    let mut s = ModelServerSource::new(opts(addr)).unwrap();
    match s.sample(Instant::now()).await {
        Err(SourceError::Malformed { line: 1, .. }) => {}
        other => panic!("expected Malformed at line 1, got {other:?}"),
    }
}

#[tokio::test]
async fn connection_refused_is_a_source_error() {
    let addr = refused_addr().await;
    let mut s = ModelServerSource::new(opts(addr)).unwrap();
    let e = s.sample(Instant::now()).await.unwrap_err();
    assert!(matches!(e, SourceError::Connect { .. }), "{e}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");

    let mut sim = SimSource::new(SimOptions {
        url: format!("http://{addr}"),
        timeout: Duration::from_secs(5),
    })
    .unwrap();
    assert!(matches!(
        sim.sample(Instant::now()).await,
        Err(SourceError::Connect { .. })
    ));
}

#[tokio::test]
async fn sim_source_reads_and_validates() {
    let f = Shared::default();
    *f.gpu.lock().unwrap() = (
        200,
        r#"{"gpus":[{"index":0,"uuid":"GPU-abc","name":"NVIDIA H100 80GB HBM3 (simulated)","utilization":0.42,"memory_used_bytes":123,"memory_total_bytes":456,"temperature_celsius":55.0,"power_watts":300.0,"power_limit_watts":700.0,"throttle_reasons":4,"ecc_uncorrected_errors":0,"xid_errors":0,"last_xid":null},
        {"index":1,"uuid":"GPU-def","utilization":7,"memory_used_bytes":900,"memory_total_bytes":456}]}"#
            .into(),
    );
    let addr = serve(f.clone()).await;
    let mut s = SimSource::new(SimOptions {
        url: format!("http://{addr}/"),
        timeout: Duration::from_secs(5),
    })
    .unwrap();
    let r = s.sample(Instant::now()).await.unwrap();
    let g = r.gpus.unwrap();
    assert_eq!(g.len(), 2);
    assert_eq!(g[0].utilization, Some(0.42));
    assert_eq!(g[0].throttle_reason_names, vec!["SwPowerCap".to_string()]);
    assert_eq!(g[0].last_xid, None);
    assert_eq!(g[1].utilization, None);
    assert_eq!(g[1].memory_used_bytes, None);
    assert_eq!(g[1].temperature_celsius, None);
    assert_eq!(r.rejected.len(), 2, "{:?}", r.rejected);

    *f.gpu.lock().unwrap() = (503, "".into());
    assert!(matches!(
        s.sample(Instant::now()).await,
        Err(SourceError::HttpStatus { status: 503, .. })
    ));
}
