# The load generator for the compose stack (tests/loadgen, binary ai-lb-loadgen).
# Built from the repository root: `build: {context: .., dockerfile: envoy-config/compose/loadgen.Dockerfile}`.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target-docker \
    CARGO_TARGET_DIR=/src/target-docker cargo build --release --locked -p ai-lb-loadgen \
 && cp /src/target-docker/release/ai-lb-loadgen /usr/local/bin/ai-lb-loadgen

FROM debian:bookworm-slim
COPY --from=build /usr/local/bin/ai-lb-loadgen /usr/local/bin/ai-lb-loadgen
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ai-lb-loadgen"]
