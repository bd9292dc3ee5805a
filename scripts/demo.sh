#!/usr/bin/env bash
# The ai-lb demo in one command: installs what is needed (scripts/setup.sh), builds the agent,
# the fake GPU pod, the load generator and the wasm filter, then runs a real Envoy 1.40 with the
# filter in front of four simulated GPU pods (two H100-like, two A100-like) with their agents,
# sends traffic, and prints every second where requests go and why (score, cut-offs, breakers).
# A scripted timeline makes a pod hot, makes another fail, and heals them.
#   scripts/demo.sh                       # 60 s scripted run
#   scripts/demo.sh --duration 0          # run until Ctrl-C; inject faults with the printed curl lines
#   scripts/demo.sh --rate 40 --pods 6    # more traffic, more pods
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
ENVOY_BIN="$(scripts/setup.sh | tail -n 1)"
export ENVOY_BIN
echo "[demo] building (first run takes a few minutes)..." >&2
cargo build --quiet --bins -p ai-lb-agent -p ai-lb-fake-pod -p ai-lb-loadgen -p ai-lb-e2e
cargo build --quiet -p ai-lb-filter-wasm --target wasm32-wasip1 --release
exec "${CARGO_TARGET_DIR:-$root/target}/debug/ai-lb-demo" "$@"
