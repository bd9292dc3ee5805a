//! The per-pod collector agent: samples its sources, keeps the latest pod snapshot and streams it
//! (and its peers' snapshots) to the filters over gRPC.

pub mod config;
pub mod engines;
pub mod grpc;
pub mod http;
pub mod kv_events;
pub mod pool;
pub mod ports;
pub mod prometheus;
pub mod sampler;
pub mod sources;
pub mod watermark;
pub mod window;
