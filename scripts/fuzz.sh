#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ (docs/fuzzing.md): each for a few seconds from its
# committed seeds (fuzz/corpus/<target>/seed-*), so CI proves every target builds, reads its
# seeds and survives a short run. New inputs go to fuzz/work/<target>/ (not committed); a
# crash fails the run with the input under fuzz/artifacts/<target>/ and the command that
# replays it. Installs cargo-fuzz (crates.io) when it is missing; uses the nightly toolchain
# when rustup has one, else the default toolchain with RUSTC_BOOTSTRAP=1 (libFuzzer needs
# nightly flags). Runs at nice 19, one job per target.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 20 s, every target)
#        FUZZ_RUNS=10000000 scripts/fuzz.sh 3600 pool_state  (a long run: stops at either)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"

secs="${1:-20}"
[ $# -gt 0 ] && shift

log() { printf '[fuzz] %s\n' "$*" >&2; }

toolchain=()
if command -v rustup >/dev/null 2>&1 && rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  toolchain=(+nightly)
else
  export RUSTC_BOOTSTRAP=1
fi
if ! cargo "${toolchain[@]}" fuzz --version >/dev/null 2>&1; then
  log "installing cargo-fuzz from crates.io"
  nice -n 19 cargo install --locked cargo-fuzz >&2
fi

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
fi

# -a: debug assertions (integer overflow panics, as in the debug builds the tests run).
fuzz=(cargo "${toolchain[@]}" fuzz)
log "building ${#targets[@]} targets"
nice -n 19 "${fuzz[@]}" build -a >&2

runs=()
[ -n "${FUZZ_RUNS:-}" ] && runs=("-runs=$FUZZ_RUNS")
failed=()
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "corpus/$t"
  log "$t: ${secs} s"
  start=$(date +%s)
  if nice -n 19 "${fuzz[@]}" run -a "$t" "work/$t" "corpus/$t" -- \
      -max_total_time="$secs" -print_final_stats=1 "${runs[@]}" \
      >"work/$t.log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "work/$t.log" | tail -n 1)
    log "$t: ${execs:-?} executions in $(( $(date +%s) - start )) s, no crash"
  else
    tail -n 40 "work/$t.log" >&2
    log "$t: FAILED (log: fuzz/work/$t.log; replay: cd fuzz && cargo ${toolchain[*]} fuzz run -a $t artifacts/$t/<file>)"
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  log "failed: ${failed[*]}"
  exit 1
fi
log "all ${#targets[@]} targets ran without a crash"
