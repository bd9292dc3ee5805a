//! The fake inference pod: a simulated vLLM-like GPU server for tests, demos and benchmarks.
//! `model` is the pure continuous-batching engine; `server` wires it to HTTP.

pub mod config;
pub mod faults;
pub mod fit;
pub mod gpu;
pub mod kv_cache;
pub mod kv_events;
pub mod metrics;
pub mod model;
pub mod oom;
pub mod openai;
pub mod server;
