#!/usr/bin/env bash
# Device check for the `cuda` feature: measures free device memory with nvidia-smi, sizes pools
# on the GPU, and compares greedy output with a CPU-pool worker. Run on a CUDA machine with a
# worker built by `cargo build --release -p kvgate-worker --features cuda`.
set -u
BIN=${BIN:-target/gpu/kvgate-worker}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.free,memory.used --format=csv | tee "$OUT/nvidia-smi-before.csv"
echo "== 64 GiB pool (bf16)"
RUST_LOG=info $BIN probe --device cuda --kv-dtype bf16 --kv-pool-bytes 68719476736 --context-window 1048576 --json 2>&1 | tee "$OUT/probe-64g.txt"
echo "== 90% of free device memory (bf16)"
RUST_LOG=info $BIN probe --device cuda --kv-dtype bf16 --kv-memory-fraction 0.9 --context-window 1048576 --json 2>&1 | tee "$OUT/probe-frac.txt"
echo "== more than the device has"
$BIN probe --device cuda --kv-pool-bytes 1099511627776 --context-window 16 2>&1 | tail -1 | tee "$OUT/probe-too-big.txt"
echo "== the incident pool on the GPU"
$BIN probe --device cuda --kv-dtype bf16 --kv-pool-tokens 681280 --context-window 1048576 2>&1 | tail -1 | tee "$OUT/probe-incident.txt"
echo "== serving from a device pool vs a host pool"
$BIN local --listen 127.0.0.1:18090 --device cuda > "$OUT/local-cuda.log" 2>&1 &
CUDA_PID=$!
$BIN local --listen 127.0.0.1:18091 > "$OUT/local-cpu.log" 2>&1 &
CPU_PID=$!
sleep 3
for p in "Hello" "The quick brown fox" "kvgate on a GPU"; do
  body="{\"prompt\":\"$p\",\"max_tokens\":32,\"temperature\":0}"
  a=$(curl -s localhost:18090/v1/completions -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
  b=$(curl -s localhost:18091/v1/completions -d "$body" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
  if [ "$a" = "$b" ]; then echo "same: $p"; else echo "DIFFERENT: $p: cuda=$a cpu=$b"; fi
done | tee "$OUT/compare.txt"
curl -s localhost:18090/v1/kv-pool | tee "$OUT/kv-pool-cuda.json"; echo
kill $CUDA_PID $CPU_PID; wait
cp "$OUT"/* "${DEST:-$OUT}/" 2>/dev/null || true
