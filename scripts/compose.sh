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
# bench-results/compose), AI_LB_COMPOSE_SMOKE=1 (check with shorter fault windows),
# AI_LB_COMPOSE_BINARIES=source|host (default source: the images compile the workspace, as
# `docker compose up --build` does; host: they take the release binaries built on this Debian
# bookworm host instead, which scripts/test.sh uses so the test run compiles them once).
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
case "${AI_LB_COMPOSE_BINARIES:-source}" in
  source) ;;
  host)
    # The release binaries built here (the bench's commands: a no-op after scripts/bench.sh in the
    # same target dir), laid into /out of a builder image, so the Dockerfile's build stage copies
    # them instead of compiling the workspace again (BINARIES=prebuilt). This host is Debian
    # bookworm like the runtime image, so its glibc is the one they link against.
    [ "$(. /etc/os-release && echo "$ID-$VERSION_CODENAME")" = debian-bookworm ] \
      || { echo "[compose] error: AI_LB_COMPOSE_BINARIES=host needs a Debian bookworm host (the runtime image's glibc)" >&2; exit 1; }
    target_dir="${CARGO_TARGET_DIR:-$root/target}"
    log "building the release binaries on the host (CARGO_TARGET_DIR=$target_dir)"
    CARGO_TARGET_DIR="$target_dir" cargo build --release --bins --locked
    CARGO_TARGET_DIR="$target_dir" cargo build --release --locked -p ai-lb-filter-native
    CARGO_TARGET_DIR="$target_dir" cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release --locked
    ctx="$(mktemp -d /var/tmp/ai-lb-binaries.XXXXXX)"
    trap 'rm -rf "$ctx"' EXIT
    cp "$target_dir"/release/{ai-lb-agent,ai-lb-fake-pod,ai-lb-loadgen,libai_lb_filter_native.so} \
       "$target_dir/wasm32-wasip1/release/ai_lb_filter_wasm.wasm" "$ctx/"
    printf 'FROM %s\nCOPY . /out/\n' "$AI_LB_RUST_IMAGE" >"$ctx/Dockerfile"
    docker build -q -t ai-lb-local/rust-binaries:dev "$ctx" >/dev/null
    export AI_LB_RUST_IMAGE=ai-lb-local/rust-binaries:dev AI_LB_BINARIES=prebuilt
    ;;
  *) echo "[compose] error: AI_LB_COMPOSE_BINARIES=${AI_LB_COMPOSE_BINARIES}: expected source or host" >&2; exit 1 ;;
esac
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
