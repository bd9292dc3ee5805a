//! Decides what the real Envoy does with a native module built for another Envoy version,
//! the rule filter/native/README.md ("Envoy versions") states. Envoy 1.40 itself only WARNS
//! when a module reports another dynamic-module ABI version ("Dynamic module ABI version .. is
//! deprecated") and loads it, though a changed signature would then be undefined behaviour; so
//! the module checks the running Envoy's version in its program init
//! (`filter/native/src/abi.rs`, `program_init`) and refuses anything outside Envoy's
//! documented window (built for X.Y: X.Y and X.(Y+1)), naming both versions in Envoy's log.
//!
//! Without a second build of the module, each case is a tiny dynamic module compiled here
//! with rustc: either only a program init reporting a foreign ABI string (Envoy's own
//! behaviour), or the module's own `abi.rs` (included by path, so the code under test is the
//! shipped check) with a chosen "built for" version. The probes export no filter hooks, so a
//! probe that gets past the version check fails afterwards on the first missing hook; which
//! of the two stopped it is what each test reads from Envoy's output.

mod deploy_support;

use std::path::Path;

use deploy_support::*;
use serde_yaml::Value;

/// A bootstrap whose only HTTP filter is the dynamic module `name` (found in the search path).
fn module_bootstrap(name: &str) -> Value {
    yaml(&format!(
        r#"
static_resources:
  listeners:
  - name: probe
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: probe
          route_config:
            virtual_hosts: [{{name: probe, domains: ["*"], routes: [{{match: {{prefix: /}}, route: {{cluster: probe}}}}]}}]
          http_filters:
          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{name: {name}, do_not_close: true}}
              filter_name: probe
              filter_config: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: "{{}}"}}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: probe
    type: STATIC
    load_assignment:
      cluster_name: probe
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 9}}}}}}}}]}}]
"#
    ))
}

/// Compiles `source` as module `name` into a fresh directory and has Envoy validate a config
/// that loads it (at info level, so the module's own lines show).
fn load_probe(envoy: &Path, name: &str, source: &str) -> Validation {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    compile_dynamic_module(dir.path(), name, source);
    envoy_validate_with(
        envoy,
        &module_bootstrap(name),
        "info",
        &[("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir.path())],
    )
}

/// A module that is the shipped `abi.rs` version check, built for Envoy `built_for`.
fn version_check_probe(built_for: (u32, u32)) -> String {
    let abi = repo_root().join("filter/native/src/abi.rs");
    format!(
        "#[path = {:?}]\nmod abi;\n\
         #[no_mangle]\n\
         pub extern \"C\" fn envoy_dynamic_module_on_program_init() -> *const std::os::raw::c_char {{\n    \
         abi::program_init(({}, {}))\n}}\n",
        abi.display().to_string(),
        built_for.0,
        built_for.1
    )
}

/// What Envoy says when a probe passed the program init and stopped at the first hook.
const MISSING_HOOK: &str =
    "Failed to resolve symbol envoy_dynamic_module_on_http_filter_config_new";
/// What Envoy says when the program init returned null.
const INIT_REFUSED: &str = "Failed to initialize dynamic module";

/// Pins Envoy's own behaviour, the reason the module checks versions itself: a module
/// reporting another ABI version gets a warning and is loaded anyway (it gets as far as the
/// hook lookup).
#[test]
fn envoy_itself_only_warns_when_a_module_reports_another_abi_version() {
    let Some(envoy) =
        envoy_or_skip("envoy_itself_only_warns_when_a_module_reports_another_abi_version")
    else {
        return;
    };
    let v = load_probe(
        &envoy,
        "ai_lb_probe_foreign_abi",
        "#[no_mangle]\n\
         pub extern \"C\" fn envoy_dynamic_module_on_program_init() -> *const std::os::raw::c_char {\n    \
         b\"v0.0.0-ai-lb-probe\\0\".as_ptr().cast()\n}\n",
    );
    assert!(
        !v.ok,
        "a module without hooks cannot be valid:\n{}",
        v.output
    );
    assert!(
        v.output
            .contains("Dynamic module ABI version v0.0.0-ai-lb-probe is deprecated"),
        "no warning about the foreign ABI version:\n{}",
        v.output
    );
    assert!(
        v.output.contains(MISSING_HOOK) && !v.output.contains(INIT_REFUSED),
        "Envoy should have loaded the module despite the ABI version and stopped at its hooks:\n{}",
        v.output
    );
}

/// The module, built for an Envoy two minors older than this one, refuses to load: Envoy's log
/// has the module's line naming both versions, and Envoy's own refusal of the module.
#[test]
fn a_module_built_for_an_older_envoy_is_refused_naming_both_versions() {
    let Some(envoy) =
        envoy_or_skip("a_module_built_for_an_older_envoy_is_refused_naming_both_versions")
    else {
        return;
    };
    let ((major, minor), version) = envoy_version(&envoy);
    let built = (major, minor.saturating_sub(2));
    let v = load_probe(&envoy, "ai_lb_probe_older", &version_check_probe(built));
    assert!(
        !v.ok,
        "Envoy accepted a module outside its version window:\n{}",
        v.output
    );
    for want in [
        "ai-lb native: refusing to load".to_string(),
        format!("built for Envoy {}.{}", built.0, built.1),
        format!(
            "runs only in Envoy {}.{}.x or {}.{}.x",
            built.0,
            built.1,
            built.0,
            built.1 + 1
        ),
        format!("this Envoy is {version}"),
        INIT_REFUSED.to_string(),
    ] {
        assert!(v.output.contains(&want), "no {want:?} in:\n{}", v.output);
    }
    assert!(
        !v.output.contains(MISSING_HOOK),
        "refused too late:\n{}",
        v.output
    );
}

/// A module built for the previous minor is inside Envoy's window (X.Y runs in X.(Y+1)): the
/// check lets it in (it then stops at the probe's missing hooks, not at the version), and one
/// built for a NEWER Envoy than this one is refused.
#[test]
fn the_window_is_the_built_minor_and_the_next_one() {
    let Some(envoy) = envoy_or_skip("the_window_is_the_built_minor_and_the_next_one") else {
        return;
    };
    let ((major, minor), version) = envoy_version(&envoy);
    let previous = (major, minor.saturating_sub(1));
    let v = load_probe(
        &envoy,
        "ai_lb_probe_previous",
        &version_check_probe(previous),
    );
    let supported = format!(
        "built for Envoy {}.{} (dynamic-module ABI v0.2.0), loaded into Envoy {version}: supported",
        previous.0, previous.1
    );
    assert!(
        v.output.contains(&supported),
        "no {supported:?} in:\n{}",
        v.output
    );
    assert!(
        v.output.contains(MISSING_HOOK) && !v.output.contains(INIT_REFUSED),
        "the version check should have let it in:\n{}",
        v.output
    );

    let newer = (major, minor + 1);
    let v = load_probe(&envoy, "ai_lb_probe_newer", &version_check_probe(newer));
    assert!(
        !v.ok
            && v.output.contains("ai-lb native: refusing to load")
            && v.output.contains(&format!("this Envoy is {version}"))
            && v.output.contains(INIT_REFUSED),
        "a module built for a newer Envoy must be refused:\n{}",
        v.output
    );
}
