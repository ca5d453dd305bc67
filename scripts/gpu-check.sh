#!/usr/bin/env bash
# Device check for the `cuda` feature: measures free device memory with nvidia-smi, sizes pools
# on the GPU, and compares greedy output of a device-pool worker with a host-pool worker (split
# and colocated, f32 and f16 KV, the tiny model and a Q4_K_M GGUF). Run on a CUDA machine with a
# worker built by `cargo build --release -p kvgate-worker --features cuda`; exits non-zero when
# a probe fails to refuse or any answer differs.
set -u
DEV=${DEV:-cuda} # DEV=cpu checks this script's serving comparison on a machine without a GPU
BIN=${BIN:-target/gpu/kvgate-worker}
GGUF=${GGUF:-target/gpu/llama-q4km.gguf}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
failed=0
nvidia-smi --query-gpu=name,memory.total,memory.free,memory.used --format=csv | tee "$OUT/nvidia-smi-before.csv"

echo "== 64 GiB pool (bf16)"
RUST_LOG=info $BIN probe --device cuda --kv-dtype bf16 --kv-pool-bytes 68719476736 --context-window 1048576 --json 2>&1 | tee "$OUT/probe-64g.txt"
echo "== 90% of free device memory (bf16)"
RUST_LOG=info $BIN probe --device cuda --kv-dtype bf16 --kv-memory-fraction 0.9 --context-window 1048576 --json 2>&1 | tee "$OUT/probe-frac.txt"
echo "== more than the device has (must fail)"
$BIN probe --device cuda --kv-pool-bytes 1099511627776 --context-window 16 > "$OUT/probe-too-big.txt" 2>&1 && failed=1
tail -1 "$OUT/probe-too-big.txt"
echo "== the incident pool on the GPU (must be refused)"
$BIN probe --device cuda --kv-dtype bf16 --kv-pool-tokens 681280 --context-window 1048576 > "$OUT/probe-incident.txt" 2>&1 && failed=1
tail -1 "$OUT/probe-incident.txt"

text() { python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])' 2>/dev/null; }

# compare NAME PORT ARGS...: one worker with its pool on the device, one on the host, the same
# greedy prompts to both.
compare() {
  local name=$1 port=$2; shift 2
  $BIN local --listen 127.0.0.1:$port --device $DEV "$@" > "$OUT/$name-cuda.log" 2>&1 &
  local gpu=$!
  $BIN local --listen 127.0.0.1:$((port + 1)) "$@" > "$OUT/$name-cpu.log" 2>&1 &
  local cpu=$!
  for _ in $(seq 60); do
    curl -sf localhost:$port/readyz > /dev/null && curl -sf localhost:$((port + 1))/readyz > /dev/null && break
    sleep 0.5
  done
  # Token ids, so that every model (the GGUF fixture's tokenizer has no space) reads them; the
  # last spans three 16-token pages.
  for p in "[1, 15, 42, 7]" "[100, 3, 99, 5, 8, 13, 21, 34]" "[$(seq -s ', ' 60 100)]"; do
    body="{\"prompt\":$p,\"max_tokens\":32,\"temperature\":0}"
    a=$(curl -s localhost:$port/v1/completions -d "$body" | text)
    b=$(curl -s localhost:$((port + 1))/v1/completions -d "$body" | text)
    if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "same ($name): $p"; else echo "DIFFERENT ($name): $p: cuda=$a cpu=$b"; fi
  done | tee "$OUT/compare-$name.txt"
  grep -q DIFFERENT "$OUT/compare-$name.txt" && failed=1
  curl -s localhost:$port/v1/kv-pool > "$OUT/kv-pool-$name.json"; cat "$OUT/kv-pool-$name.json"; echo
  if [ "$DEV" = cuda ] && ! grep -q '"device":"cuda' "$OUT/kv-pool-$name.json"; then echo "pool not on the device ($name)"; failed=1; fi
  kill $gpu $cpu; wait $gpu $cpu 2>/dev/null
}
echo "== serving from a device pool vs a host pool"
compare split 18090
compare colocated 18092 --colocated
compare split-f16 18094 --kv-dtype f16
[ -f "$GGUF" ] && compare gguf-q4km 18096 --model "$GGUF"
[ -f "$GGUF" ] || { echo "no $GGUF"; failed=1; }
nvidia-smi --query-gpu=memory.used --format=csv | tee "$OUT/nvidia-smi-after.csv"
echo "gpu-check: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
