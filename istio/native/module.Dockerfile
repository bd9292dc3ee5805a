# The native module as the image client-patch.yaml's init container copies it from:
# /ai-lb/modules/libai_lb_filter_native.so on a small Debian (for `cp`). Build from the
# repository root:
#
#   docker build -f istio/native/module.Dockerfile -t ghcr.io/ai-lb/ai-lb-native-module:0.1.0 .
#
# The module links glibc dynamically: it is built on Debian 12 (glibc 2.36) so that it loads in
# proxy images with that glibc or newer. It is built for Envoy 1.40's dynamic-module ABI and
# loads only into Envoy 1.40.x or 1.41.x (filter/native/README.md, "Envoy versions").
ARG RUST_IMAGE=rust:1-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY proto proto
COPY collector-agent collector-agent
COPY filter filter
COPY prefix prefix
COPY tests tests
COPY tools tools
RUN cargo build --release --locked -p ai-lb-filter-native \
 && mkdir -p /out && cp target/release/libai_lb_filter_native.so /out/ && rm -rf target

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/libai_lb_filter_native.so /ai-lb/modules/libai_lb_filter_native.so
USER 65532:65532
