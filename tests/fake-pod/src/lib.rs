//! The fake inference pod: a simulated vLLM-like GPU server for tests, demos and benchmarks.
//! `model` is the pure continuous-batching engine; the other modules wire it to HTTP.

pub mod config;
pub mod fit;
pub mod model;
