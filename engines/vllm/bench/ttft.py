"""What verification costs a disaggregated vLLM: time to first token through a real NIXL pair
with kvgate's connector against the same pair without it, side by side in one run, and the
digest's throughput on this machine's device.

    python engines/vllm/bench/ttft.py --model DIR [--lengths 1024,8192] [--reps 5]

Run with a Python that has vLLM (make test-vllm's wheels; scripts/vllm-venv.sh makes one). For
each setup it starts a prefill and a decode vLLM on loopback (NIXL over UCX/TCP, the layout
make test-vllm uses), then per prompt length sends what vLLM's router sends: the prompt to
prefill with max_tokens 1, then to decode with prefill's kv_transfer_params, streaming, and
times the first token decode streams back. Prompts differ every request (no prefix-cache hit).
Prints Markdown tables; `make test-vllm` keeps them in bench/results/vllm-ttft.json, shown in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)


def post(port: int, body: dict):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def wait_healthy(port: int, proc: subprocess.Popen, log: str):
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the vLLM on port {port} exited: see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    sys.exit(f"the vLLM on port {port} did not answer /health in 600 s: see {log}")


def start(args, role: str, port: int, side_port: int, verified: bool, secret_file: str, workdir: str) -> subprocess.Popen:
    inner = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"num_threads": 1, "kv_lease_duration": 120}}
    config = {"kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_buffer_device": "cpu"}
    if verified:
        config.update(kv_connector="KvgateConnector", kv_connector_module_path="kvgate_vllm.connector", kv_load_failure_policy="fail",
                      kv_connector_extra_config={"inner": inner, "secret_file": secret_file, "role": role})
    else:
        config.update(inner)
    env = dict(os.environ, PYTHONPATH=PACKAGE, UCX_TLS="tcp,self", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", HOME=workdir)
    log = os.path.join(workdir, f"{role}-{'verified' if verified else 'plain'}.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max(args.lengths) + 16),
           "--kv-cache-memory-bytes", str(args.kv_bytes), "--distributed-executor-backend", "uni", "--kv-transfer-config", json.dumps(config)]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def ttft(model: str, prefill: int, decode: int, prompt: list[int]) -> float:
    base = {"model": model, "prompt": prompt, "temperature": 0}
    t0 = time.perf_counter()
    with post(prefill, dict(base, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})) as r:
        params = json.loads(r.read())["kv_transfer_params"]
    with post(decode, dict(base, max_tokens=4, stream=True, kv_transfer_params=params)) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("decode streamed no token")


def pair(args, verified: bool, secret_file: str, workdir: str) -> dict[int, list[float]]:
    procs = [start(args, "prefill", 18710, 15710, verified, secret_file, workdir), start(args, "decode", 18720, 15720, verified, secret_file, workdir)]
    try:
        for p, port in zip(procs, (18710, 18720)):
            wait_healthy(port, p, p.log)
        rng = random.Random(7)
        out = {}
        for n in args.lengths:
            ttft(args.model, 18710, 18720, [rng.randrange(3, 500) for _ in range(n)])  # warm-up at this length
            out[n] = [ttft(args.model, 18710, 18720, [rng.randrange(3, 500) for _ in range(n)]) for _ in range(args.reps)]
            print(f"{'verified' if verified else 'unverified'} {n} tokens: " + ", ".join(f"{t * 1e3:.0f}" for t in out[n]) + " ms", file=sys.stderr)
        return out
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def lanes_seconds(layers, ids, reps: int = 5) -> float:
    """The fastest of `reps` computations of the lanes of blocks `ids` in every layer."""
    from kvgate_vllm import digest

    keys = digest.Keys.from_secret(secrets.token_bytes(32))
    digest.block_lanes_torch(keys, layers, [1] * len(layers), ids)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        digest.block_lanes_torch(keys, layers, [1] * len(layers), ids)
        best = min(best, time.perf_counter() - start)
    return best


def digest_throughput() -> tuple[float, str]:
    """GB/s of block digests over blocks of a Llama-3-8B layout (32 layers of 16-token blocks,
    8 KV heads of 128, K and V, bf16), 256 blocks per call, on the GPU when there is one."""
    import torch

    sys.path.insert(0, PACKAGE)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = [torch.randn(2, 512, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(32)]
    ids = list(range(0, 512, 2))
    size = sum(t.numel() * t.element_size() for t in layers) * len(ids) / 512
    return size / lanes_seconds(layers, ids) / 1e9, device


def prompt_lanes_ms(model: str, tokens: int) -> float:
    """Milliseconds of one side's lanes for a prompt of `tokens` in `model`'s own KV layout
    (its layers and KV heads, vLLM's CPU blocks of 128 tokens, bf16): what the connector
    computes per handoff on prefill and again on decode."""
    import torch

    sys.path.insert(0, PACKAGE)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    blocks = -(-tokens // 128)
    layers = [torch.randn(2, blocks + 1, 128, heads, head_dim, dtype=torch.bfloat16) for _ in range(config["num_hidden_layers"])]
    return lanes_seconds(layers, list(range(1, blocks + 1))) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Llama in transformers' layout (tests/engines/models.sh hf DIR writes the tiny one)")
    parser.add_argument("--lengths", default="1024,8000", help="prompt lengths, comma-separated (the tiny model's window is 8192)")
    parser.add_argument("--reps", type=int, default=11, help="timed requests per length and setup")
    parser.add_argument("--kv-bytes", type=int, default=256 << 20, help="--kv-cache-memory-bytes of each vLLM")
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    workdir = tempfile.mkdtemp(prefix="kvgate-vllm-bench-")
    secret_file = os.path.join(workdir, "secret")
    with open(secret_file, "w") as f:
        f.write(secrets.token_hex(32))
    results = {name: pair(args, verified, secret_file, workdir) for name, verified in (("plain", False), ("verified", True))}
    gbps, device = digest_throughput()
    # Medians and minima: on a loaded machine the engines' own idle polling adds hundreds of ms to
    # some requests of either setup alike (the samples above), which the minimum leaves out.
    print("| prompt tokens | TTFT unverified, median / min (ms) | TTFT verified, median / min (ms) | verified / unverified, median / min |")
    print("| ---: | ---: | ---: | ---: |")
    for n in args.lengths:
        plain, verified = results["plain"][n], results["verified"][n]
        pm, vm, pl, vl = (f(x) * 1e3 for f, x in ((statistics.median, plain), (statistics.median, verified), (min, plain), (min, verified)))
        print(f"| {n} | {pm:.0f} / {pl:.0f} | {vm:.0f} / {vl:.0f} | {vm / pm:.2f}x / {vl / pl:.2f}x |")
    # The connector's arithmetic alone (the engines are stopped by now), per side.
    print()
    print("| the connector's arithmetic | result |")
    print("| --- | --- |")
    print(f"| digest throughput ({device}, Llama-3-8B block layout) | {gbps:.2f} GB/s of KV |")
    for n in args.lengths:
        print(f"| lanes of a {n}-token prompt in the bench model's layout (one side, cpu) | {prompt_lanes_ms(args.model, n):.1f} ms |")


if __name__ == "__main__":
    main()
