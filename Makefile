# kvgate developer entry points. `make test` is what CI runs (.ci/run).

CARGO ?= cargo

.PHONY: soak run demo test test-deps test-vllm test-vllm-deps lint generate bench fuzz controlplane tools images images-docker push dev-cluster

## Serve the tiny model on http://127.0.0.1:8080 (OpenAI-compatible API).
run:
	$(CARGO) run --release -p kvgate-worker -- local

## One command, a fresh machine: the local control plane and node agent, the CRDs and the chart,
## the tiny example (Available, answering) and the incident example (refused); up until Ctrl-C.
demo:
	bash scripts/demo.sh

## Every test of the workspace: unit, model, HTTP tests against real worker processes, and the
## control-plane tests (real etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl).
test: test-deps controlplane tools
	$(CARGO) test --workspace --locked

## Debian packages the tests need (installed with apt-get when missing and run as root).
test-deps:
	bash scripts/test-deps.sh

## vLLM behind the gate, against vLLM's real CPU build: its image is several GB (pinned wheels,
## images/vllm/requirements.txt), so these tests are not in `make test`. One test at a time: each
## vLLM process takes about 3 GB and, idle, busy-polls close to half a core. docs/engines.md "vLLM" has the last result.
## Then the cost of kvgate's connector: time to first token through a real pair with and without
## it (engines/vllm/bench/ttft.py, in target/vllm-venv; kept in bench/results/vllm-ttft.json, shown in
## docs/benchmarks.md).
test-vllm: test-vllm-deps controlplane tools
	$(CARGO) build --workspace --locked
	bash scripts/images.sh --profile debug --no-archives --offline --out target/images-debug vllm
	$(CARGO) test -p kvgate-operator --features vllm-tests --test vllm --locked -- --test-threads=1
	bash scripts/vllm-venv.sh
	bash tests/engines/models.sh hf target/vllm-bench-model
	$(CARGO) xtask bench vllm-ttft -- target/vllm-venv/bin/python engines/vllm/bench/ttft.py --model target/vllm-bench-model
	$(CARGO) xtask generate

## The vLLM image's pinned wheels (about 3 GB) and packages, downloaded once.
test-vllm-deps: test-deps
	bash scripts/images.sh --fetch-vllm

## Formatting (rustfmt.toml), clippy with warnings as errors, the worker as released (without the
## `testing` feature: it cannot name a fault, so any fault code outside the gated modules fails
## here), and no circle among the modules of a crate (xtask/tests/module_circles.rs); .ci/run
## runs it before the tests.
lint:
	@$(CARGO) fmt --version >/dev/null 2>&1 || { echo "cargo fmt not found: rustup component add rustfmt"; exit 1; }
	@$(CARGO) clippy --version >/dev/null 2>&1 || { echo "cargo clippy not found: rustup component add clippy"; exit 1; }
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) clippy -p kvgate-worker --bin kvgate-worker --locked -- -D warnings
	$(CARGO) test -q -p xtask --test module_circles --locked

## Every generated file: the CRD YAML (crds/ and the chart's copy), the dashboards and the chart's
## copies of them and of the alert rules, the refusal-reason table of docs/handoff-protocol.md.
## `make test` fails when one is stale (xtask/tests/generated.rs).
generate:
	$(CARGO) xtask generate

## Benchmarks: each runs through `cargo xtask bench NAME -- COMMAND`, which passes its tables
## through and keeps them, with the run's commit, date, CPU and load, in bench/results/NAME.json;
## the last step regenerates docs/benchmarks.md from them (commit both).
BENCH = $(CARGO) xtask bench
bench:
	$(BENCH) engine -- $(CARGO) bench -p kvgate-worker --bench engine
	$(BENCH) handoff -- $(CARGO) bench -p kvgate-worker --bench handoff
	$(BENCH) contention -- $(CARGO) bench -p kvgate-worker --bench contention
	# The same GGUF file in kvgate and llama.cpp (the xllamacpp wheel of `make test-deps`).
	$(BENCH) gguf -- $(CARGO) bench -p kvgate-worker --bench gguf
	# Traces on vs off: a real Jaeger (`make tools`).
	$(BENCH) tracing -- $(CARGO) bench -p kvgate-worker --bench tracing
	bench/venv.sh bench/plot.py
	$(CARGO) build --release -p kvgate-worker
	$(BENCH) peer -- bench/venv.sh bench/peer.py --worker target/release/kvgate-worker
	$(BENCH) load -- bench/venv.sh bench/load.py --worker target/release/kvgate-worker
	# The test images run these debug binaries: the operator, the node agent and the worker with
	# its test faults (a bench revision goes bad after its 20th handoff).
	$(CARGO) build -p kvgate-worker --features testing -p kvgate-testenv -p kvgate-operator
	$(BENCH) operator -- $(CARGO) bench -p kvgate-operator --bench operator
	$(CARGO) xtask generate

## The soaks, long: the mixed-abuse soak of one worker (worker/tests/abuse.rs) for ten minutes, and
## the cluster soak on two nodes (operator/tests/nodes.rs: load through a rollout, a rollback and a
## node lost, per round) for five rounds. `make test` runs them for 8 s and one round.
SOAK_SECS ?= 600
SOAK_ROUNDS ?= 5
soak: test-deps controlplane tools
	KVGATE_SOAK_SECS=$(SOAK_SECS) $(CARGO) test -p kvgate-worker --test abuse -- --nocapture a_mixed_abuse_soak
	KVGATE_CLUSTER_SOAK_ROUNDS=$(SOAK_ROUNDS) $(CARGO) test -p kvgate-operator --test nodes -- --nocapture a_soak

## The fuzz targets (frame decoder; JSON bodies of /v1/* and /internal/*) with a long budget;
## `make test` runs them with a small fixed one.
FUZZ_CASES ?= 100000
fuzz:
	KVGATE_FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test --release -p kvgate-proto --test fuzz_frames
	KVGATE_FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test --release -p kvgate-worker --test fuzz_bodies

## Build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd from the official Go modules
## into target/controlplane/bin/ (first build about 30 minutes on 2 cores; seconds afterwards).
controlplane:
	bash tests/controlplane/build.sh

## The helm client and chart linters the chart tests use, Jaeger and Alertmanager (the trace and
## alert backends of the observability tests; target/tools/bin/), and the CNI reference plugins
## the node agent wires pods with (target/cni/bin/), built from their Go modules.
tools:
	bash tests/tools/build.sh
	bash tests/cni/build.sh

## Container images without a container engine: pinned Debian packages and the release binaries,
## packed with umoci into OCI layouts and exported with skopeo (target/images/; scripts/images.sh).
images:
	$(CARGO) build --release --locked -p kvgate-worker -p kvgate-operator
	bash scripts/images.sh $(if $(filter 0,$(IMAGE_ARCHIVES)),--no-archives)

## Pushes the images (make images) and the chart (an OCI artifact, charts/kvgate) to your registry:
## make push REGISTRY=registry.example.com/kvgate [INSECURE=1 for plain HTTP]; scripts/push.sh.
push: images
	@test -n "$(REGISTRY)" || { echo "make push needs REGISTRY=host[:port]/path, e.g. make push REGISTRY=registry.example.com/kvgate"; exit 2; }
	bash scripts/push.sh $(REGISTRY) $(if $(filter 1,$(INSECURE)),--insecure)

## The same images from images/*.Dockerfile where docker or podman exists (and the -cuda worker).
ENGINE ?= $(shell command -v docker || command -v podman)
VERSION ?= 0.1.0
images-docker:
	@test -n "$(ENGINE)" || { echo "no docker or podman here: make images builds the images without one"; exit 1; }
	$(ENGINE) build -f images/operator.Dockerfile -t ghcr.io/kvgate/kvgate-operator:$(VERSION) .
	$(ENGINE) build -f images/worker.Dockerfile -t ghcr.io/kvgate/kvgate-worker:$(VERSION) .
	$(ENGINE) build -f images/worker-cuda.Dockerfile -t ghcr.io/kvgate/kvgate-worker:$(VERSION)-cuda .

## A control plane and two nodes in the foreground (`--nodes N` for another count); kubeconfig in
## target/dev-cluster/.
dev-cluster: controlplane
	$(CARGO) build -p kvgate-worker -p kvgate-operator -p kvgate-testenv
	$(CARGO) run -q -p kvgate-testenv --bin kvgate-dev-cluster
