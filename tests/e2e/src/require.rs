//! Decides whether a test whose Envoy binary or filter module (wasm, native) is missing fails or
//! skips. With `REQUIRE_ENVOY=1` (scripts/test.sh sets it) it fails, saying what is missing and
//! how to build or install it: a CI run that silently lost Envoy or a module must not pass.
//! Without it the test says `SKIPPED` and passes, for a quick `cargo test` on a machine with
//! no Envoy. Every test that may lack one of them asks here, so this is the one place that
//! decides.

/// The variable that turns a missing Envoy or filter module into a failure.
pub const REQUIRE_ENVOY: &str = "REQUIRE_ENVOY";

/// Whether a missing Envoy or filter module fails the test (`REQUIRE_ENVOY=1`).
pub fn required() -> bool {
    std::env::var(REQUIRE_ENVOY).is_ok_and(|v| v.trim() == "1")
}

/// `found`, or, when it is missing (`Err` says what was looked for and how to get it): a
/// panic naming `test` and `what` under `REQUIRE_ENVOY=1`, else a `SKIPPED` line and None.
/// `what` names the missing piece, e.g. "Envoy" or "the wasm filter".
pub fn or_skip<T>(test: &str, what: &str, found: Result<T, String>) -> Option<T> {
    match found {
        Ok(v) => Some(v),
        Err(why) => {
            let msg = missing(test, what, &why, required());
            if required() {
                panic!("{msg}");
            }
            eprintln!("{msg}");
            None
        }
    }
}

/// The message for a missing piece: a failure under `REQUIRE_ENVOY=1`, a skip otherwise.
fn missing(test: &str, what: &str, why: &str, required: bool) -> String {
    if required {
        format!(
            "{test}: {what} is missing and {REQUIRE_ENVOY}=1 forbids skipping: {why}. \
             scripts/test.sh installs Envoy (scripts/setup.sh) and builds both filter modules \
             before the tests"
        )
    } else {
        format!("SKIPPED {test}: {what} is missing: {why} (set {REQUIRE_ENVOY}=1 to fail instead)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_piece_is_used() {
        assert_eq!(or_skip("t", "Envoy", Ok::<_, String>(7)), Some(7));
    }

    #[test]
    fn the_failure_says_what_is_missing_and_how_to_get_it() {
        let m = missing(
            "t1",
            "the wasm filter",
            "not built: run `cargo build ...`",
            true,
        );
        assert!(m.starts_with("t1: the wasm filter is missing"), "{m}");
        assert!(m.contains("REQUIRE_ENVOY=1"), "{m}");
        assert!(m.contains("cargo build"), "{m}");
        assert!(m.contains("scripts/setup.sh"), "{m}");
        let m = missing("t1", "Envoy", "no envoy", false);
        assert!(
            m.starts_with("SKIPPED t1: Envoy is missing: no envoy"),
            "{m}"
        );
    }
}
