//! Metrics sources behind one trait. Each source reports its own health: the sampler turns a
//! `SourceError` into `SOURCE_STATE_FAILING` with the error's text as the reason, and a source
//! that is not configured is reported `SOURCE_STATE_ABSENT`.
//!
//! A source never invents a reading: what it cannot read is `None` / an unset proto field.

use ai_lb_proto::v1::{Engine, GpuStats, InferenceStats, ModelInfo};
use std::time::Instant;

/// What one successful sample of a source contributes to the pod snapshot.
/// Fields a source does not cover stay `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    /// Every GPU visible to the pod (GPU sources only).
    pub gpus: Option<Vec<GpuStats>>,
    /// The model server's load and windowed latencies (model-server source only).
    pub inference: Option<InferenceStats>,
    /// The engine detected or configured (model-server source only).
    pub engine: Option<Engine>,
    /// The models (and adapters) served (model-server source only).
    pub models: Option<Vec<ModelInfo>>,
    /// Values dropped in this sample because they were NaN, negative, out of range or
    /// malformed. Each is counted in the agent's `/metrics` and never forwarded as a signal.
    pub rejected: Vec<Rejected>,
}

/// One value a source refused to forward, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    /// The metric or field name, e.g. `vllm:num_requests_waiting`.
    pub field: String,
    /// The offending value as text, e.g. `NaN`.
    pub value: String,
    pub reason: String,
}

/// Why a sample failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{source_name}: cannot connect to {target}: {detail}")]
    Connect {
        source_name: &'static str,
        target: String,
        detail: String,
    },
    #[error("{source_name}: HTTP {status} from {target}")]
    HttpStatus {
        source_name: &'static str,
        target: String,
        status: u16,
    },
    #[error("{source_name}: malformed data at line {line}: {detail}")]
    Malformed {
        source_name: &'static str,
        line: usize,
        detail: String,
    },
    #[error("{source_name}: {detail}")]
    Other {
        source_name: &'static str,
        detail: String,
    },
}

/// A metrics source. `sample` is called by the sampler at the source's interval with the current
/// monotonic time, which windowed computations (histogram deltas, rates) must use instead of
/// reading the clock themselves, so tests can drive time explicitly.
#[async_trait::async_trait]
pub trait Source: Send {
    /// Stable short name: `nvml`, `model-server`, `sim`.
    fn name(&self) -> &'static str;
    /// A cheap read of local hardware (NVML, or the simulated GPU standing in for it): read
    /// every `--gpu-sample-interval` (the others every `--sample-interval`), each source on its
    /// own task, so a GPU change is seen without scraping the model server more often, and a
    /// model server that does not answer does not delay it.
    fn local(&self) -> bool {
        false
    }
    async fn sample(&mut self, now: Instant) -> Result<Reading, SourceError>;
}

pub mod model_server;
pub mod nvml;
pub mod sim;
