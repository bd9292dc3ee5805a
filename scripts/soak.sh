#!/usr/bin/env bash
# Runs the soaks of issue 31 (ai-lb-bench soak-*): real Envoy 1.40 with the filter, real agents
# and fake pods on loopback, each soak checked against its bounds (fails on a violation):
#   scripts/soak.sh churn      # 10 min: pods join/leave (EDS + DNS), agents restart, config
#                              # reloads through LDS every 10 s, under steady traffic
#   scripts/soak.sh overload   # 10 min at 2x the pool's capacity in bursts, admission on
#   scripts/soak.sh pods       # 100 and 1,000 pods behind one real agent, 8 sidecars
#   scripts/soak.sh all [--short]
# --short: about a minute each, same checks (scripts/test.sh runs it); reports go under
# /tmp/ai-lb-soak/short/<soak>. Full runs write bench-results/soak/<soak>/report.{md,json} and
# <soak>.png. Other flags go to ai-lb-bench (`--secs N`, `--data-path native` for churn).
# Builds the binaries and both filter modules first (BENCH_NO_BUILD=1 skips that).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
log() { printf '[soak.sh] %s\n' "$*" >&2; }

[ $# -ge 1 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
which="$1"; shift
case "$which" in
  churn|overload|pods) soaks=("$which") ;;
  all) soaks=(churn overload pods) ;;
  *) log "unknown soak '$which': churn, overload, pods or all"; exit 2 ;;
esac
short=0
for a in "$@"; do [ "$a" = "--short" ] && short=1; done

if [ "${BENCH_NO_BUILD:-0}" != "1" ]; then
  export ENVOY_BIN="${ENVOY_BIN:-$(scripts/setup.sh | tail -n 1)}"
  log "building (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  cargo build --bins --locked
  cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release --locked
  cargo build -p ai-lb-filter-native --locked
fi
export ENVOY_BIN="${ENVOY_BIN:-$root/.venv/bin/envoy}"
bench="$CARGO_TARGET_DIR/debug/ai-lb-bench"
case "$CARGO_TARGET_DIR" in /*) ;; *) bench="$root/$bench" ;; esac

py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
status=0
for s in "${soaks[@]}"; do
  log "soak $s $*"
  run="$bench"
  if [ "$s" = pods ] && [ "$short" = 0 ]; then
    # The pool state's decode and the pick are timed in the driver's own process: a release
    # build, or the figures say nothing about the filter.
    if [ "${BENCH_NO_BUILD:-0}" != "1" ]; then cargo build --release --locked -p ai-lb-bench; fi
    run="${bench%/debug/ai-lb-bench}/release/ai-lb-bench"
  fi
  if ! "$run" "soak-$s" "$@"; then status=1; fi
  if [ "$short" = 0 ]; then
    dir="bench-results/soak/$s"
    prev=
    for a in "$@"; do
      case "$a" in --out=*) dir="${a#--out=}" ;; esac
      [ "$prev" = --out ] && dir="$a"
      prev="$a"
    done
    if ! "$py" -c 'import matplotlib' 2>/dev/null; then
      "$py" -m pip install --quiet --disable-pip-version-check matplotlib >&2 || true
    fi
    if [ -f "$dir/report.json" ] && "$py" -c 'import matplotlib' 2>/dev/null; then
      "$py" tests/bench/plot_soak.py "$dir" || log "plot failed for $s"
    fi
  fi
done
exit "$status"
