"""The connector's counters, on the engine's own /metrics under kvgate's names.

vLLM carries a connector's statistics from its workers through the scheduler to the API
server, where `build_prom_metrics` turns them into Prometheus series; the wrapped connector's
statistics ride along under `inner` so its own series (`vllm:nixl_*`) keep counting.

    kvgate_handoff_verified_total{engine="vllm",role}        KV blocks decode verified
    kvgate_handoff_bytes_total{engine="vllm",role}           bytes of those blocks
    kvgate_handoff_mismatch_total{engine="vllm",role,reason} handoffs refused, by reason
    kvgate_handoff_sealed_total{engine="vllm",role}          KV blocks prefill digested
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from . import handoff

ENGINE = "vllm"


def empty_counts() -> dict[str, Any]:
    return {"verified": 0, "bytes": 0, "sealed": 0, "mismatch": {}}


@dataclass
class KvgateStats(KVConnectorStats):
    """{"kvgate": counts, "inner": the inner connector's stats (object or dict), "inner_class": name}."""

    def __post_init__(self):
        self.data.setdefault("kvgate", empty_counts())

    @property
    def counts(self) -> dict[str, Any]:
        return self.data["kvgate"]

    def to_dict(self) -> dict[str, Any]:
        inner = self.data.get("inner")
        return {
            "kvgate": self.counts,
            "inner": inner.to_dict() if isinstance(inner, KVConnectorStats) else inner,
            "inner_class": self.data.get("inner_class"),
        }

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KvgateStats)
        mine, theirs = self.counts, other.counts
        for key in ("verified", "bytes", "sealed"):
            mine[key] += theirs[key]
        for reason, n in theirs["mismatch"].items():
            mine["mismatch"][reason] = mine["mismatch"].get(reason, 0) + n
        inner, other_inner = self.data.get("inner"), other.data.get("inner")
        if inner is None:
            self.data["inner"] = other_inner
        elif other_inner is not None:
            self.data["inner"] = inner.aggregate(other_inner)
        self.data["inner_class"] = self.data.get("inner_class") or other.data.get("inner_class")
        return self

    def reset(self):
        self.data["kvgate"] = empty_counts()
        inner = self.data.get("inner")
        if isinstance(inner, KVConnectorStats):
            inner.reset()

    def reduce(self) -> dict[str, int | float]:
        c = self.counts
        out: dict[str, int | float] = {"kvgate_verified_blocks": c["verified"], "kvgate_sealed_blocks": c["sealed"]}
        out.update({f"kvgate_mismatch_{r}": n for r, n in c["mismatch"].items()})
        inner = self.data.get("inner")
        if isinstance(inner, KVConnectorStats) and not inner.is_empty():
            out.update(inner.reduce())
        return out

    def is_empty(self) -> bool:
        c = self.counts
        inner = self.data.get("inner")
        inner_empty = inner is None or (isinstance(inner, KVConnectorStats) and inner.is_empty())
        return not (c["verified"] or c["sealed"] or c["mismatch"]) and inner_empty


class KvgatePromMetrics(KVConnectorPromMetrics):
    """kvgate's series, plus the inner connector's (when it has any)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues, role: str, inner: KVConnectorPromMetrics | None):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner
        counter = self._counter_cls
        labels = ["engine", "role"]
        self._verified = counter(name="kvgate_handoff_verified", documentation="KV blocks decode received and verified against prefill's keyed digests.", labelnames=labels).labels(ENGINE, role)
        self._bytes = counter(name="kvgate_handoff_bytes", documentation="Bytes of the KV blocks decode verified.", labelnames=labels).labels(ENGINE, role)
        self._sealed = counter(name="kvgate_handoff_sealed", documentation="KV blocks prefill digested for decode.", labelnames=labels).labels(ENGINE, role)
        mismatch = counter(name="kvgate_handoff_mismatch", documentation="KV handoffs decode refused, by reason: no block of them is decoded from.", labelnames=labels + ["reason"])
        self._mismatch = {reason: mismatch.labels(ENGINE, role, reason) for reason in handoff.REASONS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        counts = transfer_stats_data.get("kvgate") or empty_counts()
        self._verified.inc(counts["verified"])
        self._bytes.inc(counts["bytes"])
        self._sealed.inc(counts["sealed"])
        for reason, n in counts["mismatch"].items():
            self._mismatch[reason].inc(n)
        inner = transfer_stats_data.get("inner")
        if self._inner is not None and inner:
            self._inner.observe(inner, engine_idx)
