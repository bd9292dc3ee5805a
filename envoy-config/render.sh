#!/usr/bin/env bash
# Renders envoy-config/envoy.yaml (a template) to stdout for a local run.
#   envoy-config/render.sh > /tmp/envoy.yaml && envoy -c /tmp/envoy.yaml
# Every variable has a default; override any of them in the environment:
#   ADMIN_ADDRESS=127.0.0.1 ADMIN_PORT=9901 LISTEN_ADDRESS=127.0.0.1 LISTEN_PORT=10000
#   WASM_PATH=<target>/wasm32-wasip1/release/ai_lb_filter_wasm.wasm
#   FILTER_CONFIG_FILE=envoy-config/filter-config.json (JSON; rendered as FILTER_CONFIG)
#   PODS="127.0.0.1:8001 127.0.0.1:8002"      model servers  -> INFERENCE_ENDPOINTS
#   AGENTS="127.0.0.1:9001 127.0.0.1:9002"    agents (gRPC)  -> AGENT_ENDPOINTS
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
export ADMIN_ADDRESS="${ADMIN_ADDRESS:-127.0.0.1}" ADMIN_PORT="${ADMIN_PORT:-9901}"
export LISTEN_ADDRESS="${LISTEN_ADDRESS:-127.0.0.1}" LISTEN_PORT="${LISTEN_PORT:-10000}"
export WASM_PATH="${WASM_PATH:-${CARGO_TARGET_DIR:-$root/target}/wasm32-wasip1/release/ai_lb_filter_wasm.wasm}"
config_file="${FILTER_CONFIG_FILE:-$here/filter-config.json}"
endpoints() {
  local out="" sep="" a
  for a in $1; do
    out="$out$sep{endpoint: {address: {socket_address: {address: \"${a%:*}\", port_value: ${a##*:}}}}}"
    sep=", "
  done
  printf '[%s]' "$out"
}
export INFERENCE_ENDPOINTS="$(endpoints "${PODS:-127.0.0.1:8001 127.0.0.1:8002 127.0.0.1:8003}")"
export AGENT_ENDPOINTS="$(endpoints "${AGENTS:-127.0.0.1:9001 127.0.0.1:9002 127.0.0.1:9003}")"
# The JSON config as one YAML double-quoted string (JSON string escaping is valid YAML).
export FILTER_CONFIG="$(python3 -c 'import json,sys; print(json.dumps(json.dumps(json.load(open(sys.argv[1])))))' "$config_file")"
envsubst '${ADMIN_ADDRESS} ${ADMIN_PORT} ${LISTEN_ADDRESS} ${LISTEN_PORT} ${WASM_PATH} ${FILTER_CONFIG} ${INFERENCE_ENDPOINTS} ${AGENT_ENDPOINTS}' < "$here/envoy.yaml"
