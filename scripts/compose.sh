#!/usr/bin/env bash
# The docker-compose stack (envoy-config/docker-compose.yml) on a machine without a container
# registry: builds the local base images (scripts/docker-bases.sh), builds the stack's images from
# the repository's Dockerfile on them, and
#   scripts/compose.sh up      brings the stack up (ends when you stop it: Ctrl-C, or `down`)
#   scripts/compose.sh check   brings it up, runs the checks and the faults (tests/compose/check.py),
#                              writes the fault table, brings it down; non-zero exit on any failure
#   scripts/compose.sh down    takes it down (containers, networks, volumes)
# With a registry, `docker compose -f envoy-config/docker-compose.yml up --build` does the same as
# `up` on the public base images.
#
# Env: AI_LB_COMPOSE_PROJECT (default ai-lb), AI_LB_COMPOSE_OUT (check's output folder, default
# bench-results/compose), AI_LB_COMPOSE_SMOKE=1 (check with shorter fault windows).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { printf '[compose] %s\n' "$*" >&2; }

cmd="${1:-}"
case "$cmd" in up|check|down) ;; *) echo "usage: scripts/compose.sh up|check|down" >&2; exit 2 ;; esac

project="${AI_LB_COMPOSE_PROJECT:-ai-lb}"
file="$root/envoy-config/docker-compose.yml"
if docker compose version >/dev/null 2>&1; then
  dc=(docker compose -p "$project" -f "$file")
elif command -v docker-compose >/dev/null 2>&1; then
  dc=(docker-compose -p "$project" -f "$file")
else
  echo "[compose] error: neither 'docker compose' nor 'docker-compose' is installed" >&2; exit 1
fi
docker info >/dev/null 2>&1 || { echo "[compose] error: docker is not usable (docker info failed)" >&2; exit 1; }

if [ "$cmd" = down ]; then
  "${dc[@]}" down --volumes --remove-orphans
  exit 0
fi

started=$SECONDS
# Base images, then the stack's images on them (the classic builder: no buildx on this engine).
while IFS='=' read -r k v; do export "$k=$v"; done < <(scripts/docker-bases.sh | tail -n 3)
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
log "building images on $AI_LB_RUST_IMAGE / $AI_LB_RUNTIME_IMAGE / $AI_LB_ENVOY_IMAGE"
"${dc[@]}" build >/tmp/ai-lb-compose-build.$$.log 2>&1 || {
  tail -n 40 /tmp/ai-lb-compose-build.$$.log >&2; rm -f /tmp/ai-lb-compose-build.$$.log
  echo "[compose] error: building the images failed (log above)" >&2; exit 1; }
rm -f /tmp/ai-lb-compose-build.$$.log
log "images built in $((SECONDS - started)) s:"
docker image ls --format '  {{.Repository}}:{{.Tag}} {{.Size}}' | grep 'ai-lb/' >&2 || true

if [ "$cmd" = up ]; then
  exec "${dc[@]}" up
fi

# check: random host ports (nothing else on this machine is disturbed); the harness talks to the
# containers' addresses on the compose networks.
export AI_LB_PORT_ENVOY_WASM= AI_LB_PORT_ENVOY_WASM_ADMIN= AI_LB_PORT_ENVOY_NATIVE= \
  AI_LB_PORT_ENVOY_NATIVE_ADMIN= AI_LB_PORT_PROMETHEUS= AI_LB_PORT_GRAFANA=
out="${AI_LB_COMPOSE_OUT:-$root/bench-results/compose}"
mkdir -p "$out"
python3 tests/compose/check.py --project "$project" --out "$out" -- "${dc[@]}"
log "compose check done in $((SECONDS - started)) s"
