#!/usr/bin/env bash
# The ai-lb demo in one command: installs what is needed (scripts/setup.sh), builds the agent,
# the fake GPU pod, the load generator and the wasm filter (with --native: the native module),
# then runs a real Envoy 1.40 with it in front of four simulated GPU pods (two H100-like, two
# A100-like) with their agents, sends traffic, and prints every second where requests go and
# why (score, cut-offs, breakers); the counts are Envoy's own stats, summed over its workers.
# A scripted timeline makes a pod hot, makes another fail, and heals them.
#   scripts/demo.sh                       # 60 s scripted run
#   scripts/demo.sh --native              # the same demo on the native module (filter/native)
#   scripts/demo.sh --duration 0          # run until Ctrl-C; inject faults with the printed curl lines
#   scripts/demo.sh --rate 40 --pods 6    # more traffic, more pods
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
native=0
for a in "$@"; do
  if [[ $a == --native ]]; then native=1; fi
done
ENVOY_BIN="$(scripts/setup.sh | tail -n 1)"
export ENVOY_BIN
target_dir="${CARGO_TARGET_DIR:-$root/target}"
case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
echo "[demo] building (first run takes a few minutes)..." >&2
cargo build --quiet --bins -p ai-lb-agent -p ai-lb-fake-pod -p ai-lb-loadgen -p ai-lb-e2e
# Only the data path this run uses, and named explicitly: the demo's lookup would otherwise
# prefer target/release/libai_lb_filter_native.so, which may be an older build than this one.
if ((native)); then
  cargo build --quiet -p ai-lb-filter-native
  export AI_LB_NATIVE="$target_dir/debug/libai_lb_filter_native.so"
else
  cargo build --quiet -p ai-lb-filter-wasm --target wasm32-wasip1 --release
  export AI_LB_WASM="$target_dir/wasm32-wasip1/release/ai_lb_filter_wasm.wasm"
fi
exec "$target_dir/debug/ai-lb-demo" "$@"
