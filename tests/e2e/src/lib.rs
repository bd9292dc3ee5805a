//! End-to-end harness: starts real processes (Envoy from PyPI, the agent, fake pods) on loopback
//! ports chosen at run time, and tears them down when dropped.

pub mod demo;
pub mod envoy;
pub mod epp;
pub mod process;
pub mod ratelimit;
pub mod require;
pub mod wait;
pub mod xds_files;
