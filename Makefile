# kvgate developer entry points. `make test` is what CI runs (.ci/run).

CARGO ?= cargo

.PHONY: run test lint bench

## Serve the tiny model on http://127.0.0.1:8080 (OpenAI-compatible API).
run:
	$(CARGO) run --release -p kvgate-worker -- local

## Every test of the workspace: unit, model, and HTTP tests against real worker processes.
test:
	$(CARGO) test --workspace --locked

lint:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## Benchmarks (printed as a Markdown table; numbers in the README come from here).
bench:
	$(CARGO) bench -p kvgate-worker --bench engine
	$(CARGO) bench -p kvgate-worker --bench handoff
