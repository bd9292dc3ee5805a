#!/usr/bin/env bash
# Runs the ai-lb benchmark suite: round_robin vs least_request vs ai-lb on the same seeded
# traces through independent Envoy sidecars in front of a heterogeneous fake-GPU pool.
#   scripts/bench.sh                       # calibrate + sharegpt-poisson-80 (the headline run)
#   scripts/bench.sh sharegpt-bursty-80 hol-poisson-80 fault-slowdown overhead
#   scripts/bench.sh prefix-poisson-80 multiturn-poisson-80   # prefix-cache workloads
#                                          # (docs/benchmark-workloads.md)
#   scripts/bench.sh overhead-stream overhead-epp overhead-rps   # the three overhead figures
#                                          # (bench-results/overhead/figures.md, figures.png)
#   scripts/bench.sh --smoke               # short run that only proves the suite works (CI);
#                                          # includes one shared-prefix and one multi-turn run
#                                          # and a short run of each overhead figure
# Any other flag goes to ai-lb-bench (see `ai-lb-bench --help`). Builds release binaries and
# the wasm filter first, installs matplotlib into .venv for the plots, writes bench-results/
# (work files: /tmp/ai-lb-bench). Set BENCH_NO_BUILD=1 to skip the builds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/bench}"
log() { printf '[bench.sh] %s\n' "$*" >&2; }

smoke=0
args=()
# The plots read the run's records (--work) and go beside its tables (--out).
out=bench-results
work=/tmp/ai-lb-bench
prev=
for a in "$@"; do
  [ "$a" = "--smoke" ] && smoke=1
  case "$prev" in
    --out) out="$a" ;;
    --work) work="$a" ;;
  esac
  case "$a" in
    --out=*) out="${a#--out=}" ;;
    --work=*) work="${a#--work=}" ;;
  esac
  prev="$a"
  args+=("$a")
done
if [ "${#args[@]}" -eq 0 ]; then args=(calibrate sharegpt-poisson-80); fi

if [ "${BENCH_NO_BUILD:-0}" != "1" ]; then
  export ENVOY_BIN="${ENVOY_BIN:-$(scripts/setup.sh | tail -n 1)}"
  log "building release binaries and the wasm filter (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  cargo build --release --bins --locked
  cargo build --release --locked -p ai-lb-loadgen --example sink   # the overhead run's fast upstream
  cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release --locked
  case " ${args[*]} " in
    *" --overhead-filter "*native*|*" --overhead-filter="*native*|*" --smoke "*|*" overhead-stream "*|*" overhead-epp "*|*" overhead-rps "*)
      cargo build --release --locked -p ai-lb-filter-native ;;   # the native module (the overhead figures run it)
  esac
  case " ${args[*]} " in
    *" --smoke "*|*" --overhead-filter "*empty-wasm*|*" --overhead-filter="*empty-wasm*)
      cargo build --target wasm32-wasip1 --release --locked -p ai-lb-bench-empty-wasm ;;   # the floor of any wasm filter
  esac
  case " ${args[*]} " in
    *" --overhead-filter "*empty-native*|*" --overhead-filter="*empty-native*)
      cargo build --release --locked -p ai-lb-bench-empty-native ;;   # the floor of any dynamic module
  esac
fi
export ENVOY_BIN="${ENVOY_BIN:-$root/.venv/bin/envoy}"

"$CARGO_TARGET_DIR/release/ai-lb-bench" "${args[@]}"

# Plots (skipped in smoke mode and when matplotlib cannot be installed).
if [ "$smoke" = "0" ]; then
  py="$root/.venv/bin/python"
  [ -x "$py" ] || py="$(command -v python3)"
  if ! "$py" -c 'import matplotlib' 2>/dev/null; then
    "$py" -m pip install --quiet --disable-pip-version-check matplotlib >&2 || true
  fi
  if "$py" -c 'import matplotlib' 2>/dev/null; then
    "$py" tests/bench/plot.py "$work" "$out"
  else
    log "matplotlib unavailable: no plots"
  fi
fi
