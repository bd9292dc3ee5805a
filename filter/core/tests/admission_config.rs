//! The admission config round-trips: any valid config written back as plugin JSON (as a
//! `serde_json::Value` and as text) parses to an equal config.

use ai_lb_filter_core::admission::config::{
    AdmissionConfig, BucketParams, MalformedJsonPolicy, RouteClass, TenantKeySource,
};
use ai_lb_filter_core::admission::PriorityClass;
use proptest::prelude::*;

fn class() -> impl Strategy<Value = PriorityClass> {
    prop_oneof![
        Just(PriorityClass::Critical),
        Just(PriorityClass::Standard),
        Just(PriorityClass::Sheddable)
    ]
}

/// Decimal grid values, exact through JSON text.
fn grid(lo: u32, hi: u32, scale: f64) -> impl Strategy<Value = f64> {
    (lo..=hi).prop_map(move |k| f64::from(k) / scale)
}

fn config() -> impl Strategy<Value = AdmissionConfig> {
    (
        (
            grid(1, 100_000, 1000.0),
            grid(0, 100_000, 1000.0),
            grid(0, 100_000, 1000.0),
            0u32..100_000,
            1u64..(64 << 20),
        ),
        (
            0u32..100_000,
            grid(0, 3_600_000, 1000.0),
            grid(1, 1_000_000, 1000.0),
            grid(500, 64_000, 1000.0),
            1u64..1_000_000,
            any::<bool>(),
        ),
        proptest::sample::subsequence(
            vec![
                TenantKeySource::Header("x-tenant".into()),
                TenantKeySource::ApiKeyHash,
                TenantKeySource::PeerPrincipal,
            ],
            0..=3,
        ),
        (
            (1u64..1_000_000, 1u64..1_000_000_000),
            proptest::collection::btree_map(
                "[a-z][a-z0-9-]{0,12}",
                (1u64..1_000_000, 1u64..1_000_000),
                0..4,
            ),
        ),
        (
            "[a-z][a-z-]{0,10}",
            class(),
            proptest::collection::vec(("/[a-z/]{0,10}", class()), 0..4),
        ),
        (
            grid(1, 1000, 1000.0),
            0u64..300_000,
            0usize..100_000,
            1u32..3600,
        ),
        (
            any::<bool>(),
            grid(1, 1000, 1000.0),
            grid(1, 100_000, 1000.0),
            1u32..3600,
            1u64..600_000,
        ),
    )
        .prop_map(|(w, c, keys, t, p, s, g)| {
            let mut cfg = AdmissionConfig::default();
            cfg.cost.weights.text = w.0;
            cfg.cost.weights.image_patch = w.1;
            cfg.cost.weights.audio_frame = w.2;
            cfg.cost.default_output_tokens = w.3;
            cfg.cost.max_body_bytes = w.4;
            cfg.cost.default_image_patches = c.0;
            cfg.cost.default_audio_seconds = c.1;
            cfg.cost.audio_frames_per_second = c.2;
            cfg.cost.content_length_bytes_per_token = c.3;
            cfg.cost.content_length_cost_cap = c.4;
            cfg.cost.malformed_json = if c.5 {
                MalformedJsonPolicy::Reject
            } else {
                MalformedJsonPolicy::PassUncosted
            };
            cfg.tenant_key = keys;
            cfg.tenants.default = BucketParams {
                tokens_per_second: t.0 .0,
                burst: t.0 .1,
            };
            cfg.tenants.named =
                t.1.into_iter()
                    .filter(|(k, _)| k != "default")
                    .map(|(k, (r, b))| {
                        (
                            k,
                            BucketParams {
                                tokens_per_second: r,
                                burst: b,
                            },
                        )
                    })
                    .collect();
            cfg.priority.header = p.0;
            cfg.priority.default_class = p.1;
            cfg.priority.routes =
                p.2.into_iter()
                    .map(|(path_prefix, class)| RouteClass { path_prefix, class })
                    .collect();
            cfg.saturation.soft_threshold = s.0;
            cfg.saturation.max_wait_standard_ms = s.1;
            cfg.saturation.max_held = s.2;
            cfg.saturation.retry_after_seconds = s.3;
            cfg.guard.enabled = g.0;
            cfg.guard.gpu_util_cutoff = g.1;
            cfg.guard.queue_full_ratio = g.2;
            cfg.guard.retry_after_seconds = g.3;
            cfg.guard.max_staleness_ms = g.4;
            cfg
        })
}

proptest! {
    #[test]
    fn config_round_trips(cfg in config()) {
        let v = cfg.to_value();
        prop_assert_eq!(AdmissionConfig::from_value(&v), Ok(cfg.clone()));
        let text = v.to_string();
        let reparsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(AdmissionConfig::from_value(&reparsed), Ok(cfg));
    }
}

#[test]
fn documented_example_parses() {
    let v: serde_json::Value = serde_json::from_str(
        r#"{
          "cost": {"weights": {"text": 1.0, "imagePatch": 3.2, "audioFrame": 4.8},
                   "defaultOutputTokens": 256, "maxBodyBytes": 1048576, "malformedJson": "reject"},
          "tenantKey": ["header:x-tenant-id", "apiKeyHash", "peerPrincipal"],
          "tenants": {"default": {"tokensPerSecond": 2000, "burst": 64000},
                      "batch-team": {"tokensPerSecond": 500, "burst": 8000}},
          "priority": {"header": "x-ai-lb-priority", "defaultClass": "standard",
                       "routes": [{"pathPrefix": "/v1/batch", "class": "sheddable"}]},
          "saturation": {"softThreshold": 0.85, "maxWaitStandardMs": 2000},
          "guard": {"gpuUtilCutoff": 0.9, "queueFullRatio": 1.0, "retryAfterSeconds": 1}
        }"#,
    )
    .unwrap();
    let c = AdmissionConfig::from_value(&v).unwrap();
    assert_eq!(
        c.tenants.params_for("batch-team"),
        BucketParams {
            tokens_per_second: 500,
            burst: 8000
        }
    );
    assert_eq!(c.priority.routes[0].class, PriorityClass::Sheddable);
}
