//! Decides whether the token limiter's tenant is something a client cannot claim (issue 31),
//! through a real Envoy with the wasm filter: two clients, one sending the other's tenant id in
//! every header a naive config would trust (`x-tenant-id`, `x-ai-lb-tenant`), are each charged
//! to their own tenant. Client A spends exactly its own bucket, is refused (429) once it is
//! empty whatever tenant it claims, and client B still has every token of its own bucket.
//! Observed through the per-tenant stats `ailb.admission.tenant.<tenant>.standard.*` and the
//! statuses.
//!
//! - `peer_principal_*`: the Istio shape. The tenant is the mTLS peer's SPIFFE id
//!   (`tenantKey: ["peerPrincipal"]`, the default). Each client reaches the filter's listener
//!   through its own "sidecar" listener, which originates mTLS with that client's workload
//!   certificate (URI SAN `spiffe://ai-lb.test/ns/e2e/sa/team-a`, test-only certificates in
//!   `tests/e2e/fixtures/mtls`), as a client sidecar does in the mesh; the filter's listener
//!   requires and verifies client certificates.
//! - `jwt_claim_*`: the compose / gateway shape, `envoy-config/tenant-from-jwt.yaml` spliced in
//!   front of the wasm filter as it is: header_mutation drops the client's `x-ai-lb-tenant`,
//!   jwt_authn sets it from the verified token's `tenant` claim (test-only HS256 key), and the
//!   filter reads `header:x-ai-lb-tenant`, listed in `admission.trustedHeaders`.
//! - `naive_*`: the control. `tenantKey: ["header:x-tenant-id"]` with nothing in front: the same
//!   claim spends the other tenant's bucket. It shows that what the two tests above observe
//!   would catch a forged tenant.
//!
//! The bodies are costed by the filter's own estimate and the stub upstream reports no usage,
//! so each admitted request keeps exactly its reservation: a bucket of `PER_TENANT` requests
//! with a refill of 1 weighted token per second admits `PER_TENANT` and no more during a test.

use std::collections::BTreeMap;
use std::time::Duration;

use ai_lb_e2e::envoy::{
    self, free_port, workspace_root, yaml_quote, Envoy, EnvoyOptions, HttpClient, Response,
    StubUpstream,
};
use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{cost_from_body, Endpoint};
use serde_json::{json, Value};

const BODY: &str = r#"{"prompt":"hello there, how are you today?","max_tokens":48}"#;
/// Requests each tenant's bucket admits.
const PER_TENANT: u64 = 4;
const SPIFFE_A: &str = "spiffe://ai-lb.test/ns/e2e/sa/team-a";
const SPIFFE_B: &str = "spiffe://ai-lb.test/ns/e2e/sa/team-b";

/// Test-only HS256 key (base64url of "ai-lb-e2e-test-only-hs256-key-not-a-secret") and tokens
/// it signed: `{"iss":"ai-lb-e2e","sub":T,"tenant":T}` for team-a and team-b, and
/// `{"iss":"ai-lb-e2e","sub":"svc-c"}` (valid, no `tenant` claim); no expiry. Minted with
/// Python's `hmac` (header `{"alg":"HS256","typ":"JWT","kid":"e2e"}`).
const JWKS: &str = r#"{"keys":[{"kty":"oct","alg":"HS256","kid":"e2e","k":"YWktbGItZTJlLXRlc3Qtb25seS1oczI1Ni1rZXktbm90LWEtc2VjcmV0"}]}"#;
const JWT_ISSUER: &str = "ai-lb-e2e";
const JWT_A: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6ImUyZSJ9.eyJpc3MiOiJhaS1sYi1lMmUiLCJzdWIiOiJ0ZWFtLWEiLCJ0ZW5hbnQiOiJ0ZWFtLWEifQ.vdCejlQbMzWi6iEp5JB2YyQv6bBcCSGBY1rQ7DWMyzg";
const JWT_B: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6ImUyZSJ9.eyJpc3MiOiJhaS1sYi1lMmUiLCJzdWIiOiJ0ZWFtLWIiLCJ0ZW5hbnQiOiJ0ZWFtLWIifQ.rCdZ6SKJOiJw-nn1FbH7Xk-uPQsZPlFVdWf-eJRsaWQ";
const JWT_NO_CLAIM: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6ImUyZSJ9.eyJpc3MiOiJhaS1sYi1lMmUiLCJzdWIiOiJzdmMtYyJ9.86QQyWcXSXkVG3NkBTtJkvdURCchH4Gor49dm9okdTc";

/// The weighted cost the filter reserves for [`BODY`] (its own estimator, default weights).
fn cost() -> u64 {
    cost_from_body(
        &CostConfig::default(),
        Endpoint::Completions,
        BODY.as_bytes(),
    )
    .unwrap()
    .weighted
}

/// The plugin config: one pool (no agents: the stub upstream is balanced by Envoy), admission
/// with `admission` merged in, and a bucket of [`PER_TENANT`] requests for each of `tenants`.
/// Every other tenant's bucket (`default`) holds less than one request.
fn plugin_config(mut admission: Value, tenants: &[&str]) -> String {
    let bucket = json!({"tokensPerSecond": 1, "burst": PER_TENANT * cost()});
    let mut t = serde_json::Map::new();
    t.insert(
        "default".into(),
        json!({"tokensPerSecond": 1, "burst": cost() - 1}),
    );
    for name in tenants {
        t.insert((*name).to_string(), bucket.clone());
    }
    admission["tenants"] = Value::Object(t);
    json!({
        "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "minPods": 1,
        "admission": admission,
    })
    .to_string()
}

/// The admission stats (`wasmcustom.ailb.admission.` stripped).
fn admission_stats(envoy: &Envoy) -> BTreeMap<String, u64> {
    envoy
        .stats()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("wasmcustom.ailb.admission.")
                .map(|k| (k.to_string(), v))
        })
        .collect()
}

/// Waits until each `tenant.<t>.standard.<what>` stat has its value (the filter exports every
/// 200 ms), and that no other tenant was admitted or refused.
fn expect_tenant_stats(envoy: &Envoy, expected: &[(&str, &str, u64)]) {
    let want: BTreeMap<String, u64> = expected
        .iter()
        .filter(|(_, _, v)| *v > 0)
        .map(|(t, what, v)| (format!("tenant.{t}.standard.{what}"), *v))
        .collect();
    let mut last = BTreeMap::new();
    let got = envoy.poll(Duration::from_secs(5), "the per-tenant stats", || {
        last = admission_stats(envoy)
            .into_iter()
            .filter(|(k, v)| {
                k.starts_with("tenant.")
                    && (k.ends_with(".admitted") || k.ends_with(".rate_limited"))
                    && *v > 0
            })
            .collect::<BTreeMap<_, _>>();
        (last == want).then_some(())
    });
    if let Err(e) = got {
        panic!("per-tenant stats: want {want:#?}\ngot {last:#?}\n{e}");
    }
}

/// Headers a client sends to claim tenant `t` in every header a naive config would read.
fn claiming(t: &str) -> Vec<(&'static str, String)> {
    vec![
        ("x-tenant-id", t.to_string()),
        ("x-ai-lb-tenant", t.to_string()),
    ]
}

/// Sends [`BODY`] on `client` with `headers`.
fn send(client: &mut HttpClient, headers: &[(&str, String)]) -> Response {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    client.post_json("/v1/completions", &h, BODY).unwrap()
}

/// The identity test proper, for any way of sending as client A or B (`send_as(is_a,
/// headers)`), with `ta`/`tb` the tenants the filter should charge them to.
fn two_clients_are_each_charged_to_their_own_tenant(
    envoy: &Envoy,
    ta: &str,
    tb: &str,
    also_expected: &[(&str, &str, u64)],
    mut send_as: impl FnMut(bool, &[(&str, String)]) -> Response,
) {
    // A claims B's tenant: admitted, charged to A, until A's own bucket is empty.
    for i in 0..PER_TENANT {
        let r = send_as(true, &claiming(tb));
        assert_eq!(
            r.status,
            200,
            "A's request {i} (claiming {tb}): {}",
            r.text()
        );
    }
    // A cannot escape its empty bucket by claiming B, `default`, or a fresh name.
    for claim in [tb, "default", "fresh-tenant-7"] {
        let r = send_as(true, &claiming(claim));
        assert_eq!(
            r.status,
            429,
            "A claiming {claim} after spending its bucket: {}",
            r.text()
        );
    }
    // B has every token of its own bucket.
    for i in 0..PER_TENANT {
        let r = send_as(false, &[]);
        assert_eq!(r.status, 200, "B's request {i}: {}", r.text());
    }
    let r = send_as(false, &[]);
    assert_eq!(r.status, 429, "B past its bucket: {}", r.text());
    let mut expected = vec![
        (ta, "admitted", PER_TENANT),
        (ta, "rate_limited", 3),
        (tb, "admitted", PER_TENANT),
        (tb, "rate_limited", 1),
    ];
    expected.extend_from_slice(also_expected);
    expect_tenant_stats(envoy, &expected);
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}

/// Envoy with the filter behind mutual TLS: `inference` (the filter's listener, on `server`)
/// requires a client certificate signed by the test CA; `sidecar_a` / `sidecar_b` (on the
/// given ports) forward plain HTTP to it over mTLS with team-a's / team-b's certificate.
fn mtls_template(server: u16, sidecar_a: u16, sidecar_b: u16) -> String {
    let dir = workspace_root().join("tests/e2e/fixtures/mtls");
    let f = |name: &str| dir.join(name).display().to_string();
    let sidecar_listener = |name: &str, port: u16| {
        format!(
            r#"
  - name: sidecar_{name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: sidecar_{name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: as_{name}, timeout: 30s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#
        )
    };
    let sidecar_cluster = |name: &str, cert: &str| {
        format!(
            r#"
  - name: as_{name}
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: as_{name}
      endpoints:
      - lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {server}}}}}}}}}]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: inference.ai-lb.test
        common_tls_context:
          tls_certificates:
          - certificate_chain: {{filename: "{chain}"}}
            private_key: {{filename: "{key}"}}
          validation_context:
            trusted_ca: {{filename: "{ca}"}}"#,
            chain = f(&format!("{cert}.pem")),
            key = f(&format!("{cert}.key")),
            ca = f("ca.pem"),
        )
    };
    format!(
        r#"admin:
  address:
    socket_address: {{address: "${{ADMIN_ADDRESS}}", port_value: ${{ADMIN_PORT}}}}
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {server}}}}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{filename: "{server_chain}"}}
              private_key: {{filename: "{server_key}"}}
            validation_context:
              trusted_ca: {{filename: "{ca}"}}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: inference, timeout: 30s}}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: ai_lb
                root_id: ai_lb
                allow_on_headers_stop_iteration: true
                failure_policy: FAIL_OPEN
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: ${{FILTER_CONFIG}}
                vm_config:
                  vm_id: ai_lb
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local: {{filename: "${{WASM_PATH}}"}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router{sidecar_a}{sidecar_b}
  clusters:
  - name: inference
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: inference
      endpoints:
      - lb_endpoints: ${{INFERENCE_ENDPOINTS}}
  - name: ai_lb_agents
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: ai_lb_agents
      endpoints:
      - lb_endpoints: ${{AGENT_ENDPOINTS}}{cluster_a}{cluster_b}
"#,
        server_chain = f("server.pem"),
        server_key = f("server.key"),
        ca = f("ca.pem"),
        sidecar_a = sidecar_listener("a", sidecar_a),
        sidecar_b = sidecar_listener("b", sidecar_b),
        cluster_a = sidecar_cluster("a", "team-a"),
        cluster_b = sidecar_cluster("b", "team-b"),
    )
}

#[test]
fn peer_principal_tenant_cannot_be_claimed_with_a_header() {
    let pod = StubUpstream::start().unwrap();
    let (server, port_a, port_b) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    // The default tenant key: the mTLS peer principal.
    let mut opts = EnvoyOptions::new(plugin_config(json!({}), &[SPIFFE_A, SPIFFE_B]));
    opts.template = Some(mtls_template(server, port_a, port_b));
    opts.inference = vec![pod.addr];
    let envoy = Envoy::start(&opts).unwrap();
    let mut a = HttpClient::new(([127, 0, 0, 1], port_a).into());
    let mut b = HttpClient::new(([127, 0, 0, 1], port_b).into());
    // A client without a certificate never reaches the filter.
    let plain = HttpClient::new(envoy.listener)
        .with_timeout(Duration::from_secs(5))
        .get("/v1/models", &[("connection", "close")]);
    assert!(plain.is_err(), "plain HTTP to the mTLS listener: {plain:?}");

    two_clients_are_each_charged_to_their_own_tenant(&envoy, SPIFFE_A, SPIFFE_B, &[], |is_a, h| {
        send(if is_a { &mut a } else { &mut b }, h)
    });
    // The claim went on to the model server untouched (only ai-lb's own reading ignored it).
    let seen = pod.seen.lock().unwrap();
    assert!(
        seen.iter()
            .any(|hs| hs.iter().any(|(k, v)| k == "x-tenant-id" && v == SPIFFE_B)),
        "the stub never saw a claim: was the claim sent at all?"
    );
}

/// `envoy-config/envoy.yaml` with `envoy-config/tenant-from-jwt.yaml` (rendered) inserted
/// before the wasm filter, each line indented into `http_filters`.
fn jwt_template(fragment: &str) -> String {
    let base = envoy::template().unwrap();
    let anchor = "          - name: envoy.filters.http.wasm\n";
    assert!(base.contains(anchor), "envoy.yaml: no wasm filter entry");
    let rendered = fragment
        .replace("${TENANT_JWT_ISSUER}", &yaml_quote(JWT_ISSUER))
        .replace("${TENANT_JWKS}", &yaml_quote(JWKS));
    let indented: String = rendered
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(|l| format!("          {l}\n"))
        .collect();
    base.replacen(anchor, &format!("{indented}{anchor}"), 1)
}

fn jwt_fragment() -> String {
    std::fs::read_to_string(workspace_root().join("envoy-config/tenant-from-jwt.yaml")).unwrap()
}

#[test]
fn jwt_claim_tenant_cannot_be_claimed_with_a_header() {
    let pod = StubUpstream::start().unwrap();
    let admission = json!({
        "tenantKey": ["header:x-ai-lb-tenant"],
        "trustedHeaders": ["x-ai-lb-tenant"],
    });
    let mut opts = EnvoyOptions::new(plugin_config(admission, &["team-a", "team-b"]));
    opts.template = Some(jwt_template(&jwt_fragment()));
    opts.inference = vec![pod.addr];
    let envoy = Envoy::start(&opts).unwrap();
    let mut client = HttpClient::new(envoy.listener);

    // No token, or a token the issuer did not sign: 401 from jwt_authn, never a bucket.
    let forged = format!("{}x", &JWT_B[..JWT_B.len() - 1]);
    for auth in [None, Some(forged.as_str())] {
        let mut h = claiming("team-b");
        if let Some(t) = auth {
            h.push(("authorization", format!("Bearer {t}")));
        }
        let r = send(&mut client, &h);
        assert_eq!(r.status, 401, "token {auth:?}: {}", r.text());
    }

    // A valid token without a `tenant` claim: jwt_authn sets no header, and header_mutation
    // already dropped the client's, so the request is tenant `default` (whose bucket holds
    // less than one request here), not the team-b it claims.
    let mut h = claiming("team-b");
    h.push(("authorization", format!("Bearer {JWT_NO_CLAIM}")));
    let r = send(&mut client, &h);
    assert_eq!(
        r.status,
        429,
        "a token without the claim, claiming team-b: {}",
        r.text()
    );

    let no_claim = [("default", "rate_limited", 1)];
    two_clients_are_each_charged_to_their_own_tenant(
        &envoy,
        "team-a",
        "team-b",
        &no_claim,
        |is_a, h| {
            let mut h = h.to_vec();
            let token = if is_a { JWT_A } else { JWT_B };
            h.push(("authorization", format!("Bearer {token}")));
            send(&mut client, &h)
        },
    );
    // What the model server saw: the claim of the token, once, and no token.
    let seen = pod.seen.lock().unwrap();
    for hs in seen.iter() {
        let tenants: Vec<&str> = hs
            .iter()
            .filter(|(k, _)| k == "x-ai-lb-tenant")
            .map(|(_, v)| v.as_str())
            .collect();
        assert!(
            tenants == ["team-a"] || tenants == ["team-b"],
            "upstream saw x-ai-lb-tenant {tenants:?}"
        );
        assert!(!hs.iter().any(|(k, _)| k == "authorization"), "{hs:?}");
    }
}

/// The control: with the tenant taken from a header nothing in front sets, the same claim
/// spends the other tenant's bucket. This is what the two tests above would see if the
/// trusted source were not in place.
#[test]
fn naive_header_tenant_is_claimable_control() {
    let pod = StubUpstream::start().unwrap();
    let admission = json!({"tenantKey": ["header:x-tenant-id"]});
    let mut opts = EnvoyOptions::new(plugin_config(admission, &["team-a", "team-b"]));
    opts.inference = vec![pod.addr];
    let envoy = Envoy::start(&opts).unwrap();
    let mut client = HttpClient::new(envoy.listener);
    for i in 0..PER_TENANT {
        let r = send(&mut client, &claiming("team-b"));
        assert_eq!(r.status, 200, "A's request {i}: {}", r.text());
    }
    let r = send(&mut client, &[("x-tenant-id", "team-b".to_string())]);
    assert_eq!(r.status, 429, "B's own first request: {}", r.text());
    expect_tenant_stats(
        &envoy,
        &[
            ("team-b", "admitted", PER_TENANT),
            ("team-b", "rate_limited", 1),
        ],
    );
}
