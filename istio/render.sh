#!/usr/bin/env bash
# Builds the filter, packs it as the OCI image Istio's WasmPlugin pulls (an OCI image layout,
# target/wasm-oci/ai-lb-filter/), and renders the templates of istio/ into target/istio/
# with that image's manifest digest as their module checksum. Then:
#   push the layout:  oras cp --from-oci-layout target/wasm-oci/ai-lb-filter:0.1.0 <registry>/<repo>:0.1.0
#                     (or crane push target/wasm-oci/ai-lb-filter <registry>/<repo>:0.1.0)
#   apply:            kubectl apply -k target/istio/
#   or, for the native data path (the router as the native dynamic module), the overlay of
#   that output:      kubectl apply -k istio/native/   (docs/install-istio.md, "Native data path")
# Arguments go to `ai-lb-wasm-oci render` (tools/wasm-oci): --url oci://<registry>/<repo>:<tag>
# when you push elsewhere than the templates say, --url https://... to serve the bare .wasm
# (its sha256 is then written), --tag, --variant compat, --archive FILE, --out DIR.
# Usage: istio/render.sh [--url URL] [...]   (see docs/install-istio.md)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build -q -p ai-lb-filter-wasm --target wasm32-wasip1 --release
export AI_LB_WASM="${AI_LB_WASM:-${CARGO_TARGET_DIR:-$root/target}/wasm32-wasip1/release/ai_lb_filter_wasm.wasm}"
cargo run -q -p ai-lb-wasm-oci -- render "$@"
