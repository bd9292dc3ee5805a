//! The per-pod collector agent: samples its sources, keeps the latest pod snapshot and streams it
//! (and its peers' snapshots) to the filters over gRPC.

pub mod sources;
