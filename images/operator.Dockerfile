# kvgate-operator. docker build -f images/operator.Dockerfile -t ghcr.io/kvgate/kvgate-operator:0.1.0 .
FROM rust:1.90-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvgate-operator /kvgate-operator
USER 65532:65532
ENTRYPOINT ["/kvgate-operator"]
