//! Generates the ai_lb.v1 types with a vendored protoc, so no system protoc is needed.
//! With the `grpc` feature it also generates tonic client/server code and a file descriptor set
//! for server reflection; without it (wasm), prost messages only.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY-free: build scripts are single-threaded.
    std::env::set_var("PROTOC", protoc);
    let proto = "proto/ai_lb/v1/metrics.proto";
    println!("cargo:rerun-if-changed={proto}");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);

    #[cfg(feature = "grpc")]
    {
        tonic_prost_build::configure()
            .file_descriptor_set_path(out.join("ai_lb_v1_descriptor.bin"))
            .compile_protos(&[proto], &["proto"])?;
    }
    #[cfg(not(feature = "grpc"))]
    {
        let _ = &out;
        prost_build::Config::new().compile_protos(&[proto], &["proto"])?;
    }
    Ok(())
}
