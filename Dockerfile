# Tally's image (issue 17): `make image` builds it as tally:<version>; deploy/k8s runs it.
#
# Stage 1 compiles in the official Rust image. Dependencies are built first, against the
# manifests and placeholder sources, in a layer of their own: editing Tally's code reuses
# it and recompiles only Tally. Stage 2 is distroless: glibc and libgcc (what the binary
# links), CA certificates, no shell, no package manager, running as uid 65532 (nonroot).

FROM rust:1.95-slim-bookworm AS builder
WORKDIR /build

# The dependency layer: the manifests, the workspace's other members (the device CLI and
# the load tool: Cargo loads every member's manifest), and empty stand-ins for every target
# the root Cargo.toml names (the library, the binary and each bench), so `cargo build`
# compiles only the server's dependencies here.
COPY Cargo.toml Cargo.lock ./
COPY crates crates
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN mkdir -p src/bin benches \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && grep -A1 '^\[\[bench\]\]' Cargo.toml | sed -n 's/^name = "\(.*\)"/\1/p' \
        | while read -r b; do echo 'fn main() {}' > "benches/$b.rs"; done \
    && cargo build --release --locked -p tally --bin tally \
    && rm -rf src benches

# Tally itself. docs/ is compiled in (GET /openapi.json serves docs/openapi.json).
COPY src src
COPY benches benches
COPY docs docs
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked -p tally --bin tally \
    && cp target/release/tally /tally

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /tally /usr/local/bin/tally
# Inside a container Tally listens on every interface; the binary's default is loopback.
ENV TALLY_LISTEN=0.0.0.0:8080
# The API; and the admin address (probes, /metrics) when TALLY_ADMIN_LISTEN sets it, as
# deploy/k8s does (0.0.0.0:9091).
EXPOSE 8080 9091
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tally"]
