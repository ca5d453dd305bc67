#!/usr/bin/env python3
"""Draws how cost grows, from the curves `cargo bench -p kvgate-worker --bench handoff` writes to
target/bench/: time to first token against prompt length (colocated and disaggregated) and
handoff time against pages (with the best loopback TCP stream for the same bytes). Writes
docs/bench-ttft.png and docs/bench-handoff.png, which the README links. Run through
`bench/venv.sh bench/plot.py` (`make bench` does)."""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def read(name):
    path = os.path.join(ROOT, "target", "bench", name)
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: run `cargo bench -p kvgate-worker --bench handoff` first")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def figure(path, title, xlabel, x, series):
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for label, y in series:
        ax.plot(x, y, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{int(v)}" for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("milliseconds (log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    # Fixed metadata, so a rerun with the same numbers writes the same bytes.
    fig.savefig(os.path.join(ROOT, path), metadata={"Software": None})
    print(f"wrote {path}")


ttft = read("ttft.csv")
figure("docs/bench-ttft.png", "Time to first token, tiny model (2 cores)", "prompt tokens",
       ttft["prompt_tokens"], [("colocated", ttft["colocated_ms"]), ("disaggregated", ttft["disaggregated_ms"])])
pages = read("handoff_pages.csv")
figure("docs/bench-handoff.png", "KV handoff of 2 MiB pages (Llama-3-8B-shaped)", "pages",
       pages["pages"], [("handoff, every check on", pages["handoff_ms"]), ("best loopback TCP, same bytes", pages["best_tcp_ms"])])
