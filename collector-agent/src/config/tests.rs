use super::*;

#[test]
fn port_caps_default_and_are_validated_by_name() {
    let base = ["--serving-address", "10.0.0.1:8000"];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        cfg(&a)
    };
    assert_eq!(with(&[]).unwrap().limits, PortLimits::default());
    let l = PortLimits::default();
    assert_eq!(
        (l.grpc_max_connections, l.grpc_max_connections_per_peer),
        (1024, 64)
    );
    assert_eq!((l.grpc_max_streams, l.grpc_max_streams_per_peer), (512, 32));
    assert_eq!(l.grpc_max_streams_per_connection, 32);
    assert_eq!(
        (l.grpc_max_request_bytes, l.grpc_max_message_bytes),
        (16 << 10, 16 << 20)
    );
    assert_eq!(l.stream_send_timeout, Duration::from_secs(10));
    assert_eq!(l.first_request_timeout, Duration::from_secs(10));
    assert_eq!(
        (l.http_max_connections, l.http_max_connections_per_peer),
        (64, 16)
    );
    let c = with(&[
        "--grpc-max-streams",
        "8",
        "--grpc-max-streams-per-peer",
        "2",
        "--stream-send-timeout",
        "500ms",
    ])
    .unwrap()
    .limits;
    assert_eq!((c.grpc_max_streams, c.grpc_max_streams_per_peer), (8, 2));
    assert_eq!(c.stream_send_timeout, Duration::from_millis(500));
    // A lower total pulls the per-peer default down with it.
    let c = with(&["--grpc-max-streams", "8"]).unwrap().limits;
    assert_eq!(c.grpc_max_streams_per_peer, 8);
    let e = with(&["--grpc-max-streams-per-peer", "0"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "0" for --grpc-max-streams-per-peer: expected an integer between 1 and 65536"#
    );
    let e = with(&[
        "--grpc-max-streams",
        "8",
        "--grpc-max-streams-per-peer",
        "9",
    ])
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "9" for --grpc-max-streams-per-peer: expected at most --grpc-max-streams (8)"#
    );
    let e = with(&["--grpc-max-request-bytes", "16k"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "16k" for --grpc-max-request-bytes: expected an integer between 1024 and 67108864"#
    );
    for (args, flag) in [
        (["--grpc-max-connections", "0"], "--grpc-max-connections"),
        (
            ["--grpc-max-connections-per-peer", "many"],
            "--grpc-max-connections-per-peer",
        ),
        (
            ["--grpc-max-streams-per-connection", "5000"],
            "--grpc-max-streams-per-connection",
        ),
        (
            ["--grpc-max-message-bytes", "1000"],
            "--grpc-max-message-bytes",
        ),
        (["--stream-send-timeout", "10"], "--stream-send-timeout"),
        (
            ["--first-request-timeout", "1ms"],
            "--first-request-timeout",
        ),
        (["--http-max-connections", "-1"], "--http-max-connections"),
        (
            ["--http-max-connections-per-peer", "100"],
            "--http-max-connections-per-peer",
        ),
    ] {
        let e = with(&args).expect_err(flag);
        assert!(e.to_string().contains(flag), "{args:?} -> {e}");
    }
}

fn cfg(args: &[&str]) -> Result<AgentConfig, ConfigError> {
    let raw = RawArgs::try_parse_from(std::iter::once("ai-lb-agent").chain(args.iter().copied()))
        .expect("clap parses");
    AgentConfig::try_from(raw)
}

#[test]
fn defaults_apply() {
    let c = cfg(&["--serving-address", "10.0.0.1:8000"]).unwrap();
    assert_eq!(c.grpc_listen, "0.0.0.0:9090".parse().unwrap());
    assert_eq!(c.http_listen, "0.0.0.0:9091".parse().unwrap());
    assert_eq!(c.gpu_source, GpuSource::Nvml);
    assert!(!c.gpu_source_explicit);
    assert_eq!(c.sample_interval, Duration::from_millis(50));
    assert_eq!(c.gpu_sample_interval, Duration::from_millis(20));
    assert_eq!(c.gpm_interval, Duration::from_millis(100));
    assert_eq!(c.window, Duration::from_secs(10));
    assert_eq!(c.rate_window, Duration::from_secs(5));
    assert_eq!(c.watch_min_interval, Duration::from_millis(50));
    assert_eq!(c.heartbeat, Duration::from_secs(1));
    assert_eq!(c.peers_refresh, Duration::from_secs(5));
    assert_eq!(c.peer_stale_after, Duration::from_secs(3));
    assert_eq!(c.engine, EngineChoice::Auto);
    assert_eq!(c.kv_events, None);
}

#[test]
fn kv_events_flags_build_the_subscription() {
    let c = cfg(&[
        "--serving-address",
        "10.0.0.1:8000",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:5557",
        "--prefix-max-keys",
        "100",
    ])
    .unwrap();
    assert_eq!(
        c.kv_events,
        Some(KvEventsConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            block_tokens: 64,
            max_keys: 100,
        })
    );
    let e = cfg(&[
        "--serving-address",
        "10.0.0.1:8000",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:5557",
        "--prefix-block-tokens",
        "-64",
    ])
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "-64" for --prefix-block-tokens: expected a positive integer up to 65536"#
    );
}

#[test]
fn oom_watermark_flags_are_validated() {
    let base = ["--serving-address", "10.0.0.1:8000"];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        cfg(&a)
    };
    assert_eq!(
        with(&[]).unwrap().oom,
        Some(crate::watermark::WatermarkConfig::default())
    );
    assert_eq!(with(&["--oom-watermark", "off"]).unwrap().oom, None);
    let c = with(&["--oom-countdown", "10s", "--oom-consecutive", "2"])
        .unwrap()
        .oom
        .unwrap();
    assert_eq!((c.countdown_ms, c.consecutive), (10_000, 2));
    let e = with(&["--oom-rate-interval", "5ms"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--oom-rate-interval"), "{e}");
    let e = with(&["--oom-watermark", "1.2"]).unwrap_err().to_string();
    assert_eq!(
        e,
        r#"invalid value "1.2" for --oom-watermark: expected a share of GPU memory in (0, 1], or off"#
    );
}

#[test]
fn bad_duration_names_flag_and_value() {
    let e = cfg(&[
        "--serving-address",
        "10.0.0.1:8000",
        "--sample-interval",
        "abc",
    ])
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "abc" for --sample-interval: expected a duration like 100ms or 2s"#
    );
}

#[test]
fn gpu_sample_interval_defaults_to_the_shorter_and_never_exceeds_the_sample() {
    let base = ["--serving-address", "10.0.0.1:8000"];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        cfg(&a)
    };
    let fast = with(&["--sample-interval", "10ms"]).unwrap();
    assert_eq!(fast.gpu_sample_interval, Duration::from_millis(10));
    let same = with(&["--gpu-sample-interval", "50ms"]).unwrap();
    assert_eq!(same.gpu_sample_interval, Duration::from_millis(50));
    let e = with(&["--gpu-sample-interval", "150ms"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "150ms" for --gpu-sample-interval: expected a duration no longer than --sample-interval (50ms)"#
    );
}

#[test]
fn source_stall_after_is_optional_and_validated() {
    let base = ["--serving-address", "10.0.0.1:8000"];
    assert_eq!(cfg(&base).unwrap().source_stall_after, None);
    let mut a = base.to_vec();
    a.extend_from_slice(&["--source-stall-after", "400ms"]);
    assert_eq!(
        cfg(&a).unwrap().source_stall_after,
        Some(Duration::from_millis(400))
    );
    let mut a = base.to_vec();
    a.extend_from_slice(&["--source-stall-after", "0s"]);
    let e = cfg(&a).unwrap_err().to_string();
    assert!(e.contains(r#""0s" for --source-stall-after"#), "{e}");
}

#[test]
fn recent_window_follows_the_sample_interval_and_spans_two_samples() {
    let base = ["--serving-address", "10.0.0.1:8000"];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        cfg(&a)
    };
    assert_eq!(with(&[]).unwrap().recent_window, Duration::from_millis(150));
    assert_eq!(
        with(&["--sample-interval", "200ms"]).unwrap().recent_window,
        Duration::from_millis(600)
    );
    assert_eq!(
        with(&["--recent-window", "100ms"]).unwrap().recent_window,
        Duration::from_millis(100)
    );
    let e = with(&["--recent-window", "80ms"]).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "80ms" for --recent-window: expected a duration at least 2 × --sample-interval (100ms)"#
    );
}

#[test]
fn missing_serving_address_is_named() {
    let e = cfg(&[]).unwrap_err();
    assert!(e.to_string().contains("--serving-address"), "{e}");
}

#[test]
fn each_flag_error_names_its_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--serving-address", "nope"], "--serving-address"),
        (&["--grpc-listen", "x:y"], "--grpc-listen"),
        (&["--http-listen", "9091"], "--http-listen"),
        (&["--gpu-source", "cuda"], "--gpu-source"),
        (&["--gpu-source", "sim"], "--sim-url"),
        (
            &["--gpu-source", "sim", "--sim-url", "ftp://x"],
            "--sim-url",
        ),
        (
            &["--model-server-url", "localhost:8000"],
            "--model-server-url",
        ),
        (&["--engine", "llama.cpp"], "--engine"),
        (&["--queue-capacity", "-3"], "--queue-capacity"),
        (&["--kv-capacity-tokens", "0"], "--kv-capacity-tokens"),
        (&["--window", "10"], "--window"),
        (&["--window", "10ms", "--sample-interval", "1s"], "--window"),
        (&["--rate-window", "5"], "--rate-window"),
        (&["--gpu-sample-interval", "0"], "--gpu-sample-interval"),
        (&["--gpm-interval", "5ms"], "--gpm-interval"),
        (&["--gpm-interval", "often"], "--gpm-interval"),
        (
            &[
                "--gpu-sample-interval",
                "200ms",
                "--sample-interval",
                "100ms",
            ],
            "--gpu-sample-interval",
        ),
        (
            &["--rate-window", "200ms", "--sample-interval", "1s"],
            "--rate-window",
        ),
        (&["--heartbeat", "0"], "--heartbeat"),
        (&["--peers", "a:1,b"], "--peers"),
        (&["--peers-dns", "agents"], "--peers-dns"),
        (
            &["--peers", "a:1", "--peer-stale-after", "500ms"],
            "--peer-stale-after",
        ),
        (
            &["--kv-events-endpoint", "localhost:5557"],
            "--kv-events-endpoint",
        ),
        (
            &["--kv-events-endpoint", "tcp://*:5557"],
            "--kv-events-endpoint",
        ),
        (
            &["--kv-events-replay-endpoint", "tcp://h:5558"],
            "--kv-events-replay-endpoint",
        ),
        (
            &[
                "--kv-events-endpoint",
                "tcp://h:5557",
                "--kv-events-replay-endpoint",
                "h:5558",
            ],
            "--kv-events-replay-endpoint",
        ),
        (&["--prefix-block-tokens", "0"], "--prefix-block-tokens"),
        (&["--prefix-max-keys", "lots"], "--prefix-max-keys"),
        (&["--model-version", "  "], "model-version"),
    ];
    for (args, flag) in cases {
        let mut full: Vec<&str> = if args.contains(&"--serving-address") {
            vec![]
        } else {
            vec!["--serving-address", "10.0.0.1:8000"]
        };
        full.extend_from_slice(args);
        let e = cfg(&full).expect_err(&format!("{args:?} must be rejected"));
        assert!(e.to_string().contains(flag), "{args:?} -> {e}");
    }
}

#[test]
fn kv_capacity_tokens_must_be_a_positive_integer() {
    let ok = cfg(&[
        "--serving-address",
        "10.0.0.1:8000",
        "--kv-capacity-tokens",
        "400000",
    ])
    .unwrap();
    assert_eq!(ok.kv_capacity_tokens, Some(400_000));
    let unset = cfg(&["--serving-address", "10.0.0.1:8000"]).unwrap();
    assert_eq!(unset.kv_capacity_tokens, None);
    for bad in ["0", "-3", "abc", "1.5", ""] {
        let e = cfg(&[
            "--serving-address",
            "10.0.0.1:8000",
            "--kv-capacity-tokens",
            bad,
        ])
        .expect_err(bad);
        assert_eq!(
            e.to_string(),
            format!("invalid value {bad:?} for --kv-capacity-tokens: expected a positive integer")
        );
    }
}

#[test]
fn durations_parse() {
    let d = |s| parse_duration("x", s);
    assert_eq!(d("100ms").unwrap(), Duration::from_millis(100));
    assert_eq!(d("2s").unwrap(), Duration::from_secs(2));
    assert_eq!(d("1.5s").unwrap(), Duration::from_millis(1500));
    assert_eq!(d("1m").unwrap(), Duration::from_secs(60));
    assert_eq!(d("0").unwrap(), Duration::ZERO);
    for bad in ["", "ms", "10", "-1s", "1x", "NaNs"] {
        assert!(d(bad).is_err(), "{bad}");
    }
}

#[test]
fn file_fills_and_flags_override() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.yaml");
    std::fs::write(
        &path,
        "serving-address: 10.0.0.2:8000\nsample-interval: 250ms\ngpu-sample-interval: 50ms\nheartbeat: 2s\npeers: [a:1, b:2]\nqueue-capacity: 64\nkv-capacity-tokens: 400000\nmodel-version: v2\n",
    )
    .unwrap();
    let c = AgentConfig::from_args([
        "ai-lb-agent",
        "--config",
        path.to_str().unwrap(),
        "--heartbeat",
        "500ms",
        "--gpu-source",
        "none",
    ])
    .unwrap();
    assert_eq!(c.serving_address, "10.0.0.2:8000".parse().unwrap());
    assert_eq!(c.sample_interval, Duration::from_millis(250));
    assert_eq!(c.gpu_sample_interval, Duration::from_millis(50));
    assert_eq!(c.heartbeat, Duration::from_millis(500));
    assert_eq!(c.peers, vec!["a:1".to_string(), "b:2".to_string()]);
    assert_eq!(c.queue_capacity, Some(64));
    assert_eq!(c.kv_capacity_tokens, Some(400_000));
    assert_eq!(c.model_version.as_deref(), Some("v2"));

    let toml_path = dir.path().join("agent.toml");
    std::fs::write(
        &toml_path,
        "serving-address = \"10.0.0.3:8000\"\nwindow = \"5s\"\n",
    )
    .unwrap();
    let c =
        AgentConfig::from_args(["ai-lb-agent", "--config", toml_path.to_str().unwrap()]).unwrap();
    assert_eq!(c.window, Duration::from_secs(5));

    std::fs::write(
        &path,
        "serving-address: 10.0.0.2:8000\ngpu-source: none\nkv-capacity-tokens: 0\n",
    )
    .unwrap();
    let e =
        AgentConfig::from_args(["ai-lb-agent", "--config", path.to_str().unwrap()]).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid value "0" for --kv-capacity-tokens: expected a positive integer"#
    );

    std::fs::write(&path, "serving-adress: 10.0.0.2:8000\n").unwrap();
    let e =
        AgentConfig::from_args(["ai-lb-agent", "--config", path.to_str().unwrap()]).unwrap_err();
    assert!(e.to_string().contains("serving-adress"), "{e}");
}
