# kvgate-worker, CPU build. docker build -f images/worker.Dockerfile -t ghcr.io/kvgate/kvgate-worker:0.1.0 .
FROM rust:1.90-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-worker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvgate-worker /kvgate-worker
USER 65532:65532
ENTRYPOINT ["/kvgate-worker"]
