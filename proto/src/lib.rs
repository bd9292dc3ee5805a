//! The `ai_lb.v1` wire contract: prost message types shared by the agent and the wasm filter,
//! plus (feature `grpc`) the tonic `MetricsService` client and server.

/// Generated from `proto/ai_lb/v1/metrics.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/ai_lb.v1.rs"));
}

/// The serialized `FileDescriptorSet` for gRPC server reflection.
#[cfg(feature = "grpc")]
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ai_lb_v1_descriptor.bin"));

pub use v1::*;
