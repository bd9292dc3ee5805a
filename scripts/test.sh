#!/usr/bin/env bash
# Runs every test of ai-lb: formatting, clippy (native and wasm32), unit, property, integration
# and end-to-end tests (a real Envoy 1.40 with the wasm filter, agents and fake GPU pods on
# loopback), the deployment checks, compiles the benchmarks, and runs the benchmark suite's
# smoke mode (numbers are not asserted), then the docker-compose stack for real: images built
# here on local base images, the stack up, its checks and faults (scripts/compose.sh check;
# AI_LB_SKIP_COMPOSE=1 skips it, loudly, on a machine without Docker).
# Installs what it needs first (scripts/setup.sh). Usage: scripts/test.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Each step's wall time goes to the summary printed at the end (CI has 90 minutes on 2 cores:
# the summary says which step to look at when the total grows).
timings=()
step_name=""
step_start=$SECONDS
end_step() {
  [ -n "$step_name" ] && timings+=("$(printf '%6d s  %s' $((SECONDS - step_start)) "$step_name")")
  step_name=""
}
step() {
  end_step
  step_name="$*"
  step_start=$SECONDS
  printf '\n==> %s\n' "$*"
}
print_timings() {
  end_step
  printf '\nstep times (%d s in all):\n' "$SECONDS"
  printf '  %s\n' "${timings[@]}"
}
# Printed on failure too, so a failed run still says where its time went.
trap print_timings EXIT

step "setup"
ENVOY_BIN="$(scripts/setup.sh | tail -n 1)"
export ENVOY_BIN
# A test whose Envoy, wasm filter or native module is missing fails here instead of skipping
# (tests/e2e/src/require.rs); both modules are built before `cargo test` below.
export REQUIRE_ENVOY=1

step "cargo fmt --check"
cargo fmt --all -- --check

step "clippy (native, all targets)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "clippy (wasm32-wasip1: filter core and glue)"
cargo clippy -p ai-lb-filter-core -p ai-lb-filter-wasm --target wasm32-wasip1 --locked -- -D warnings

step "build binaries, the wasm filter and the native module"
cargo build --workspace --bins --locked
cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release --locked
cargo build -p ai-lb-filter-native --locked

step "tests (unit, property, integration, end-to-end with a real Envoy)"
# The native module the tests load is the debug build just made: their lookup prefers a
# release build, which may be a stale one left by scripts/bench.sh.
target_dir="${CARGO_TARGET_DIR:-$root/target}"
case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
AI_LB_NATIVE="$target_dir/debug/libai_lb_filter_native.so" cargo test --workspace --locked

step "criterion benchmarks, each run once (test mode; measure them by hand: BENCHMARKS.md)"
# Criterion runs every benchmark function once when its target runs under `cargo test`: that
# proves the benchmarks build and run, in the debug build the tests above just made (overflow
# checks on), for a few seconds. A release `cargo bench --no-run` took 9-12 minutes on 2 cores
# (its dev-dependency features rebuild most crates) and ran nothing.
cargo test --workspace --bench '*' --locked

step "fuzz smoke (20 s per target)"
# Every cargo-fuzz target in fuzz/ from its committed seeds (docs/fuzzing.md); installs
# cargo-fuzz if missing.
scripts/fuzz.sh 20

step "benchmark suite, smoke run (a tiny pool; proves the suite works, asserts no numbers)"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" scripts/bench.sh --smoke

step "soaks, short mode (churn, overload, many pods; each fails on a broken bound: docs/operations.md)"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" BENCH_NO_BUILD=1 scripts/soak.sh all --short

step "docker-compose stack: images, checks, faults (scripts/compose.sh check)"
if [ "${AI_LB_SKIP_COMPOSE:-0}" = 1 ]; then
  echo "SKIPPED the docker-compose stack (AI_LB_SKIP_COMPOSE=1): not tested on this run"
  compose_skipped=1
else
  # On a Debian bookworm host (the images' base) the images take the release binaries the bench
  # smoke built above instead of compiling the workspace again in their build stage; elsewhere
  # they compile it, as `docker compose up --build` does.
  binaries=source
  [ "$(. /etc/os-release && echo "$ID-$VERSION_CODENAME")" = debian-bookworm ] && binaries=host
  echo "images' binaries: $binaries"
  # The fault table goes to a scratch folder: the committed bench-results/compose/ is the
  # published run's (docs/compose.md quotes it), and a test run must leave the tree clean.
  compose_out="${AI_LB_COMPOSE_OUT:-$(mktemp -d /tmp/ai-lb-compose-check.XXXXXX)}"
  echo "fault table: $compose_out/faults.md"
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" AI_LB_COMPOSE_BINARIES=$binaries \
    AI_LB_COMPOSE_OUT="$compose_out" scripts/compose.sh check
fi

echo
if [ "${compose_skipped:-0}" = 1 ]; then
  echo "all checks passed except the docker-compose stack, which was SKIPPED"
else
  echo "all checks passed"
fi
