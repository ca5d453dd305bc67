# kvgate-worker with the CUDA KV pool (`--device cuda`). The driver comes from the node
# (NVIDIA container toolkit); cudarc loads it at run time.
FROM rust:1.90-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-worker --features cuda

FROM nvidia/cuda:13.0.0-base-ubuntu24.04
COPY --from=build /src/target/release/kvgate-worker /kvgate-worker
USER 65532:65532
ENTRYPOINT ["/kvgate-worker"]
