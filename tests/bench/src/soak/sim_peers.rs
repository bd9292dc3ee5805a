//! Simulated pods for the many-pods soak, each as its agent looks from outside: one gRPC
//! `MetricsService` per pod (its own port, the real `Watch` contract: a snapshot at once, then
//! one whenever its load changes, every `change_every` with a per-pod offset) and one HTTP
//! port that answers every request at once with a one-chunk SSE stream (`x-fake-pod`). One
//! tokio runtime carries them all, so 1,000 pods cost one process. A real agent watches them
//! as peers and streams the pool to the real Envoys; only the pods are simulated.

use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ai_lb_proto::v1::metrics_service_server::{MetricsService, MetricsServiceServer};
use ai_lb_proto::v1::{
    watch_event, PodSnapshot, PoolEvent, SnapshotRequest, WatchEvent, WatchPoolRequest,
    WatchRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::{Request, Response, Status};

type EventStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// Ports bound before the pods serve (a real agent is started naming them as peers first).
pub struct Ports {
    pub grpc: Vec<TcpListener>,
    pub http: Vec<TcpListener>,
}

impl Ports {
    pub fn bind(n: usize) -> Result<Ports, String> {
        let b = || TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"));
        Ok(Ports {
            grpc: (0..n).map(|_| b()).collect::<Result<_, _>>()?,
            http: (0..n).map(|_| b()).collect::<Result<_, _>>()?,
        })
    }

    pub fn grpc_addrs(&self) -> Vec<SocketAddr> {
        self.grpc
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    pub fn http_addrs(&self) -> Vec<SocketAddr> {
        self.http
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }
}

#[derive(Clone)]
struct Pod {
    index: u64,
    template: PodSnapshot,
    serving: SocketAddr,
    change_every: Duration,
}

impl Pod {
    /// The pod's snapshot at its `seq`-th change: the template with this pod's address and
    /// instance, and a load that moves (queue, KV cache, GPU).
    fn snapshot(&self, seq: u64) -> PodSnapshot {
        let mut s = self.template.clone();
        let x = self.index.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ seq.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let frac = |k: u64| ((x >> k) % 1000) as f64 / 1000.0;
        if let Some(id) = s.identity.as_mut() {
            id.address = self.serving.to_string();
            id.pod_name = format!("sim{}", self.index);
        }
        if let Some(inf) = s.inference.as_mut() {
            inf.waiting = Some(((x >> 3) % 6) as u32);
            inf.kv_cache_usage = Some(frac(11) * 0.9);
        }
        for g in &mut s.gpus {
            g.utilization = Some(0.2 + 0.6 * frac(17));
            if g.sm_occupancy.is_some() {
                g.sm_occupancy = Some(0.1 + 0.6 * frac(23));
            }
        }
        s.sequence = seq + 1;
        s.agent_instance = format!("sim-{:016x}", self.index);
        s.age_ms = 0;
        s.sample_time_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        s
    }
}

#[tonic::async_trait]
impl MetricsService for Pod {
    async fn snapshot(&self, _: Request<SnapshotRequest>) -> Result<Response<PodSnapshot>, Status> {
        Ok(Response::new(self.snapshot(0)))
    }

    type WatchStream = EventStream<WatchEvent>;

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let pod = self.clone();
        tokio::spawn(async move {
            // Spread the pods' changes over the interval.
            let offset = pod.change_every.mul_f64((pod.index % 97) as f64 / 97.0);
            let mut seq = 0;
            loop {
                let ev = WatchEvent {
                    event: Some(watch_event::Event::Snapshot(pod.snapshot(seq))),
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
                let wait = if seq == 0 { offset } else { pod.change_every };
                tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
                seq += 1;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    type WatchPoolStream = EventStream<PoolEvent>;

    async fn watch_pool(
        &self,
        _: Request<WatchPoolRequest>,
    ) -> Result<Response<Self::WatchPoolStream>, Status> {
        Err(Status::unimplemented("a simulated pod serves Watch only"))
    }
}

/// Answers HTTP/1.1 requests on one connection: each gets a one-chunk SSE answer at once.
async fn serve_http(mut s: tokio::net::TcpStream, me: SocketAddr) {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        // Read one request: headers, then `content-length` bytes of body.
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            }
        };
        let head =
            String::from_utf8_lossy(buf.get(..head_end).unwrap_or_default()).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            }
        }
        buf.drain(..head_end + len);
        let body = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\ndata: [DONE]\n\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-fake-pod: {me}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The simulated pods, serving until dropped.
pub struct SimPods {
    pub grpc: Vec<SocketAddr>,
    pub serving: Vec<SocketAddr>,
    runtime: tokio::runtime::Runtime,
}

impl SimPods {
    /// Serves `ports` as pods with snapshots shaped like `template`, each changing every
    /// `change_every`.
    pub fn start(
        ports: Ports,
        template: PodSnapshot,
        change_every: Duration,
    ) -> Result<SimPods, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let grpc = ports.grpc_addrs();
        let serving = ports.http_addrs();
        let _guard = runtime.enter();
        for (i, (g, h)) in ports.grpc.into_iter().zip(ports.http).enumerate() {
            g.set_nonblocking(true).map_err(|e| e.to_string())?;
            h.set_nonblocking(true).map_err(|e| e.to_string())?;
            let g = tokio::net::TcpListener::from_std(g).map_err(|e| e.to_string())?;
            let h = tokio::net::TcpListener::from_std(h).map_err(|e| e.to_string())?;
            let me = serving.get(i).copied().ok_or("port count")?;
            let pod = Pod {
                index: i as u64 + 1,
                template: template.clone(),
                serving: me,
                change_every,
            };
            runtime.spawn(async move {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(g);
                let _ = tonic::transport::Server::builder()
                    .add_service(MetricsServiceServer::new(pod))
                    .serve_with_incoming(incoming)
                    .await;
            });
            runtime.spawn(async move {
                while let Ok((s, _)) = h.accept().await {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(serve_http(s, me));
                }
            });
        }
        drop(_guard);
        Ok(SimPods {
            grpc,
            serving,
            runtime,
        })
    }

    /// The runtime, for clients of the soak (the hub's `WatchPool`).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }
}
