//! Decides whether hostile values in the headers the filter reads get a clean answer and never
//! a crash (issue 31), through a real Envoy with the wasm filter and with the native module:
//! the model header, the tenant header, the priority header, `content-length` and the debug
//! header, each sent with a raw CR, LF, NUL, DEL or obs-text byte (0xFF) inside its value,
//! with CR/LF percent-encoded, 50 KiB long (within Envoy's 60 KiB header limit), over that
//! limit, and 90 and 101 times.
//!
//! What reaches the filter, as observed with Envoy 1.40's HTTP/1 codec: a NUL or DEL in a value
//! is answered 400, a header section past `max_request_headers_kb` (60 KiB) or
//! `max_headers_count` (100) 431, a repeated or non-numeric `content-length` 400, all before any
//! filter runs. A bare CR inside a value is removed (`a\rb` arrives as `ab`), a folded line
//! (CRLF + space) is joined with a space, a bare LF ends the header line (what follows is a
//! header of its own): so no CR or LF ever reaches a filter or the upstream. (HTTP/2 and HTTP/3
//! forbid CR, LF and NUL in field values, RFC 9113 §8.2.1; the harness speaks HTTP/1.1 only, so
//! that is not run here.) Reaching the filter: percent-encoded `%0D%0A` (plain text: a tenant
//! keeps it, it is no priority class, it names no model), obs-text bytes, which the wasm filter
//! reads with U+FFFD in their place (before, the proxy-wasm SDK's UTF-8 unwrap trapped the VM
//! on the first one: 503s, then every later request unfiltered), a 50 KiB value (a tenant is
//! hashed to `sha256:<16 hex>`), and 90 copies, of which the filter reads the first.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, StubUpstream};
use ai_lb_e2e::require::or_skip;
use ai_lb_filter_core::admission::tenant::api_key_hash;
use serde_json::json;

const BODY: &str = r#"{"prompt":"hi","max_tokens":4}"#;

/// The headers the filter reads, by what the filter uses them for.
const MODEL: &str = "x-ai-lb-model";
const TENANT: &str = "x-tenant-id";
const PRIORITY: &str = "x-ai-lb-priority";
const DEBUG: &str = "x-ai-lb-debug";
const LENGTH: &str = "content-length";

/// The route config every data path runs: model and debug headers on; `admission` (wasm only)
/// reads the tenant and the priority header, both listed as trusted so the filter reads them.
fn filter_config(admission: bool) -> serde_json::Value {
    let mut c = json!({
        "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "minPods": 1,
        "modelHeader": MODEL,
        "debugHeader": DEBUG,
    });
    if admission {
        c["admission"] = json!({
            "tenantKey": [format!("header:{TENANT}")],
            "trustedHeaders": [TENANT, PRIORITY],
            "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}},
        });
    }
    c
}

/// Sends one raw HTTP/1.1 request (`extra` is inserted verbatim among the headers, each line
/// ending in CRLF) and returns the response status, or 0 when Envoy closed the connection
/// without one.
fn raw(addr: SocketAddr, extra: &[u8], content_length: bool) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = Vec::new();
    req.extend_from_slice(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n",
    );
    if content_length {
        req.extend_from_slice(format!("content-length: {}\r\n", BODY.len()).as_bytes());
    }
    req.extend_from_slice(extra);
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(BODY.as_bytes());
    let _ = s.write_all(&req);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// `name: value\r\n`, `n` times.
fn header(name: &str, value: &[u8], n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One hostile request: what it is, the header lines, and the statuses acceptable for it.
struct Case {
    what: String,
    lines: Vec<u8>,
    /// The request's own `content-length` is sent (not when the case is about that header).
    length: bool,
    expect: &'static [u16],
}

fn cases(headers: &[&str]) -> Vec<Case> {
    let big = vec![b'a'; 50 * 1024];
    let too_big = vec![b'a'; 61 * 1024];
    let mut out = Vec::new();
    for &h in headers {
        let is_len = h == LENGTH;
        // `a<junk>b`; for the length, the right length followed by the junk, so only the junk
        // decides.
        let value = |junk: &[u8]| -> Vec<u8> {
            let mut x = if is_len {
                BODY.len().to_string().into_bytes()
            } else {
                b"a".to_vec()
            };
            x.extend_from_slice(junk);
            if !is_len {
                x.push(b'b');
            }
            x
        };
        let mut add = |what: &str, lines: Vec<u8>, expect: &'static [u16]| {
            out.push(Case {
                what: format!("{h}: {what}"),
                lines,
                length: !is_len,
                expect,
            })
        };
        // Refused by Envoy's codec before any filter.
        add("raw NUL", header(h, &value(b"\0"), 1), &[400]);
        add("raw DEL", header(h, &value(b"\x7f"), 1), &[400]);
        add("61 KiB value", header(h, &too_big, 1), &[431]);
        // Envoy removes a bare CR, unfolds a folded line, ends the line at a bare LF: what is
        // left is an ordinary value.
        add("raw CR", header(h, &value(b"\r"), 1), &[200]);
        // (A folded length is `30 z`: no number, 400.)
        let folded: &'static [u16] = if is_len { &[400] } else { &[200] };
        add(
            "CRLF + space (folded)",
            header(h, &value(b"\r\n z"), 1),
            folded,
        );
        add(
            "bare LF + a header",
            header(h, &value(b"\nx-other: 1"), 1),
            &[200],
        );
        if is_len {
            // A length is a number, once.
            add("%0D%0A", header(h, &value(b"%0D%0A"), 1), &[400]);
            add("obs-text byte", header(h, &value(b"\xff"), 1), &[400]);
            add(
                "50 KiB of digits",
                header(h, &vec![b'1'; 50 * 1024], 1),
                &[400],
            );
            add("90 equal copies", header(h, &value(b""), 90), &[400]);
            add("101 copies", header(h, &value(b""), 101), &[400, 431]);
        } else {
            // Reach the filter.
            add("%0D%0A", header(h, &value(b"%0D%0A"), 1), &[200]);
            add("obs-text byte", header(h, &value(b"\xff"), 1), &[200]);
            add("50 KiB value", header(h, &big, 1), &[200]);
            let v: &[u8] = if h == PRIORITY { b"critical" } else { b"d" };
            add("90 copies", header(h, v, 90), &[200]);
            add("101 copies", header(h, v, 101), &[431]);
        }
    }
    out
}

/// Runs every case against `envoy` and checks the answers; then a plain request still works.
fn run_cases(envoy: &Envoy, headers: &[&str], failed: impl Fn(&Envoy) -> bool) {
    let mut wrong = Vec::new();
    for c in cases(headers) {
        let (status, text) = raw(envoy.listener, &c.lines, c.length);
        if !c.expect.contains(&status) {
            let head: String = text.lines().take(1).collect();
            wrong.push(format!(
                "{}: {status} ({head}), want {:?}",
                c.what, c.expect
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "unexpected answers:\n{}\nlog:\n{}",
        wrong.join("\n"),
        envoy.log_tail(30)
    );
    let r = HttpClient::new(envoy.listener)
        .post_json("/v1/completions", &[(DEBUG, "1")], BODY)
        .unwrap();
    assert_eq!(r.status, 200, "after the cases: {}", r.text());
    assert!(
        r.header(DEBUG).is_some_and(|d| d.starts_with("pod=")),
        "the filter no longer answers: {:?}",
        r.headers
    );
    assert!(
        !failed(envoy),
        "the filter trapped:\n{}",
        envoy.log_tail(60)
    );
}

#[test]
fn wasm_filter_answers_hostile_header_values_cleanly() {
    let pod = StubUpstream::start().unwrap();
    let mut opts = EnvoyOptions::new(filter_config(true).to_string());
    opts.inference = vec![pod.addr];
    let envoy = Envoy::start(&opts).unwrap();
    run_cases(&envoy, &[MODEL, TENANT, PRIORITY, DEBUG, LENGTH], |e| {
        e.wasm_failed()
    });

    // What reached the filter, as it used it: the tenants it charged and the classes it gave.
    let tenant =
        |t: &str, class: &str| format!("wasmcustom.ailb.admission.tenant.{t}.{class}.admitted");
    let expected = [
        // A bare CR removed by Envoy; a bare LF ended the value.
        (tenant("ab", "standard"), 1),
        (tenant("a", "standard"), 1),
        // Percent-encoding is text.
        (tenant("a%0D%0Ab", "standard"), 1),
        // Not printable ASCII (obs-text, read as U+FFFD) or too long: hashed.
        (tenant(&api_key_hash("a\u{fffd}b"), "standard"), 1),
        (tenant(&api_key_hash(&"a".repeat(50 * 1024)), "standard"), 1),
        // 90 copies: the first.
        (tenant("d", "standard"), 1),
        // The priority header's 90 copies of `critical`: the first is a class.
        (tenant("default", "critical"), 1),
        // Its other values (CR removed, folded, cut at LF, %0D%0A, obs-text, 50 KiB) are none.
        (
            "wasmcustom.ailb.admission.invalid_priority_header".to_string(),
            6,
        ),
    ];
    let mut stats = Default::default();
    let got = envoy.poll(Duration::from_secs(5), "the admission stats", || {
        stats = envoy.stats().unwrap_or_default();
        expected
            .iter()
            .all(|(k, v)| stats.get(k) == Some(v))
            .then_some(())
    });
    if let Err(e) = got {
        let adm: Vec<String> = stats
            .iter()
            .filter(|(k, _)| k.starts_with("wasmcustom.ailb.admission.") && !k.contains("tokens"))
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        panic!("want {expected:#?}\ngot {adm:#?}\n{e}");
    }
    // No CR, LF or NUL ever reached the model server.
    for hs in pod.seen.lock().unwrap().iter() {
        for (k, v) in hs {
            assert!(!v.contains(['\r', '\n', '\0']), "upstream got {k}: {v:?}");
        }
    }
}

#[test]
fn native_module_answers_hostile_header_values_cleanly() {
    let test = "native_module_answers_hostile_header_values_cleanly";
    if or_skip(test, "the native module", envoy::native_module_path()).is_none() {
        return;
    }
    let pod = StubUpstream::start().unwrap();
    // The module wants an agent address per pool; none answers here (the filter falls back).
    let nobody: std::net::SocketAddr = ([127, 0, 0, 1], 1).into();
    let config = envoy::native_filter_config(&filter_config(false).to_string(), &[nobody]).unwrap();
    let mut opts = EnvoyOptions::new(config);
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = vec![pod.addr];
    let envoy = Envoy::start(&opts).unwrap();
    // No admission in the native module: the model, debug and length headers.
    run_cases(&envoy, &[MODEL, DEBUG, LENGTH], |e| {
        let log = e.log();
        log.contains("panicked at") || log.contains("Caught Segmentation fault")
    });
}
