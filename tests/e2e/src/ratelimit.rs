//! A small global rate limit service speaking Envoy's real
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` gRPC API: it records every
//! call (domain, descriptors, `hits_addend`) and answers OK, or OVER_LIMIT once the hits of a
//! domain exceed an optional budget. Runs on its own tokio runtime thread, stopped on drop.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread;

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// Generated from `proto/envoy/service/ratelimit/v3/rls.proto` (build.rs).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("envoy.service.ratelimit.v3");
}

use pb::rate_limit_response::Code;
use pb::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use pb::{RateLimitRequest, RateLimitResponse};

use crate::envoy::Error;

/// One `ShouldRateLimit` call as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub domain: String,
    /// Each descriptor's entries as (key, value).
    pub descriptors: Vec<Vec<(String, String)>>,
    /// As sent: 0 means "not set" (the service counts 1).
    pub hits_addend: u32,
}

#[derive(Debug, Default)]
struct Shared {
    calls: Vec<Call>,
    hits: u64,
}

#[derive(Debug, Clone)]
struct Svc {
    shared: Arc<Mutex<Shared>>,
    budget: Option<u64>,
}

#[tonic::async_trait]
impl RateLimitService for Svc {
    async fn should_rate_limit(
        &self,
        req: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let r = req.into_inner();
        let call = Call {
            domain: r.domain,
            descriptors: r
                .descriptors
                .into_iter()
                .map(|d| d.entries.into_iter().map(|e| (e.key, e.value)).collect())
                .collect(),
            hits_addend: r.hits_addend,
        };
        let mut s = self
            .shared
            .lock()
            .map_err(|_| Status::internal("state poisoned"))?;
        s.hits += u64::from(call.hits_addend.max(1));
        let over = self.budget.is_some_and(|b| s.hits > b);
        s.calls.push(call);
        let code = if over { Code::OverLimit } else { Code::Ok };
        Ok(Response::new(RateLimitResponse {
            overall_code: code as i32,
        }))
    }
}

/// The running service; stopped when dropped.
#[derive(Debug)]
pub struct RateLimitServer {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl RateLimitServer {
    /// Starts on 127.0.0.1 (port chosen by the OS). With `budget`, calls answer OVER_LIMIT once
    /// the total hits exceed it.
    pub fn start(budget: Option<u64>) -> Result<RateLimitServer, Error> {
        let shared: Arc<Mutex<Shared>> = Arc::default();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(|e| format!("rate limit service: bind: {e}"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| format!("rate limit service: nonblocking: {e}"))?;
        let addr = std_listener
            .local_addr()
            .map_err(|e| format!("rate limit service: local_addr: {e}"))?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let svc = Svc {
            shared: shared.clone(),
            budget,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("rate limit service: runtime: {e}"))?;
        let thread = thread::spawn(move || {
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
                    return;
                };
                let incoming =
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
                let _ = tonic::transport::Server::builder()
                    .add_service(RateLimitServiceServer::new(svc))
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stop_rx.await;
                    })
                    .await;
            });
        });
        Ok(RateLimitServer {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.shared
            .lock()
            .map(|s| s.calls.clone())
            .unwrap_or_default()
    }
}

impl Drop for RateLimitServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
