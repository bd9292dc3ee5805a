//! Glue: Envoy's `envoy.service.ext_proc.v3.ExternalProcessor/Process` over tonic. Each stream
//! (one HTTP request) gets its own [`Exchange`]; messages are handed to it as they arrive and
//! its answers are sent in order. The answers are produced inside the response stream itself
//! (no task or channel in between: a message read is one wake-up, not two). Nothing is decided
//! here.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use rand::Rng;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::exchange::Exchange;
use crate::pool::Pool;

/// The ext_proc service over a pool.
#[derive(Debug)]
pub struct ExtProc<R> {
    pool: Arc<Pool<R>>,
}

impl<R> ExtProc<R> {
    pub fn new(pool: Arc<Pool<R>>) -> Self {
        ExtProc { pool }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// One stream's state while its answers are produced.
struct Conversation<R> {
    inbound: Streaming<ProcessingRequest>,
    exchange: Exchange,
    pool: Arc<Pool<R>>,
    ready: VecDeque<ProcessingResponse>,
    closing: bool,
}

impl<R: Rng> Conversation<R> {
    /// The next answer, reading messages until there is one; None when the stream is over.
    async fn next(&mut self) -> Option<ProcessingResponse> {
        loop {
            if let Some(a) = self.ready.pop_front() {
                return Some(a);
            }
            if self.closing {
                return None;
            }
            match self.inbound.message().await {
                Ok(Some(msg)) => {
                    let step = self
                        .exchange
                        .on_message(msg, self.pool.as_ref(), &self.pool.stats);
                    self.ready.extend(step.send);
                    self.closing = step.close;
                }
                Ok(None) => return None,
                Err(_) if self.exchange.response_complete() => {
                    // Envoy resets the stream once the request is over.
                    self.pool.stats.streams_reset_after_response.inc();
                    return None;
                }
                Err(status) if status.code() == Code::Cancelled => {
                    self.pool.stats.streams_cancelled.inc();
                    return None;
                }
                Err(status) => {
                    self.pool.stats.stream_errors.inc();
                    tracing::debug!(%status, "ext_proc stream failed");
                    return None;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl<R: Rng + Send + 'static> ExternalProcessor for ExtProc<R> {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        self.pool.stats.streams.inc();
        let conversation = Conversation {
            inbound: request.into_inner(),
            exchange: Exchange::new(),
            pool: self.pool.clone(),
            ready: VecDeque::new(),
            closing: false,
        };
        let answers = futures::stream::unfold(conversation, |mut c| async move {
            let a = c.next().await?;
            Some((Ok(a), c))
        });
        Ok(Response::new(Box::pin(answers)))
    }
}
