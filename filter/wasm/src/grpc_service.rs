//! Decides how the filter names its gRPC upstream: always as a serialized
//! `envoy.config.core.v3.GrpcService`, never as a bare cluster name.
//!
//! Envoy first parses the `upstream` argument of `open_grpc_stream`/`dispatch_grpc_call` as a
//! serialized GrpcService; a bare cluster name that happens to parse aborts the whole process
//! ("panic: unset oneof", see ENVOY_FACTS). Field numbers are from
//! envoy/config/core/v3/grpc_service.proto and base.proto (HeaderValue).

use prost::Message;

/// `envoy.config.core.v3.GrpcService` (the fields the filter sets).
#[derive(Clone, PartialEq, Message)]
pub struct GrpcService {
    #[prost(message, optional, tag = "1")]
    pub envoy_grpc: Option<EnvoyGrpc>,
    #[prost(message, repeated, tag = "5")]
    pub initial_metadata: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.GrpcService.EnvoyGrpc`.
#[derive(Clone, PartialEq, Message)]
pub struct EnvoyGrpc {
    #[prost(string, tag = "1")]
    pub cluster_name: String,
    #[prost(string, tag = "2")]
    pub authority: String,
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// The bytes to pass as `upstream` for a call to `cluster` (with an optional `:authority`).
pub fn encode(cluster: &str, authority: Option<&str>) -> Vec<u8> {
    GrpcService {
        envoy_grpc: Some(EnvoyGrpc {
            cluster_name: cluster.to_owned(),
            authority: authority.unwrap_or_default().to_owned(),
        }),
        initial_metadata: Vec::new(),
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_envoy_grpc_cluster_name_as_field_1_of_field_1() {
        let bytes = encode("ai_lb_agents", None);
        // field 1 (envoy_grpc), length-delimited; inside: field 1 (cluster_name), length 12.
        let mut want = vec![0x0a, 14, 0x0a, 12];
        want.extend_from_slice(b"ai_lb_agents");
        assert_eq!(bytes, want);
    }

    #[test]
    fn authority_is_field_2_of_envoy_grpc() {
        let bytes = encode("c", Some("agents.local"));
        let decoded = GrpcService::decode(bytes.as_slice()).unwrap();
        let envoy = decoded.envoy_grpc.unwrap();
        assert_eq!(envoy.cluster_name, "c");
        assert_eq!(envoy.authority, "agents.local");
        assert_eq!(bytes[2], 0x0a);
    }
}
