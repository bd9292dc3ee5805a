//! Generates the tonic server of the e2e rate limit service (`src/ratelimit.rs`) from the
//! minimal `proto/envoy/service/ratelimit/v3/rls.proto`, with a vendored protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Build scripts are single-threaded.
    std::env::set_var("PROTOC", protoc);
    let proto = "proto/envoy/service/ratelimit/v3/rls.proto";
    println!("cargo:rerun-if-changed={proto}");
    tonic_prost_build::configure()
        .build_client(false)
        .compile_protos(&[proto], &["proto"])?;
    Ok(())
}
