"""KvgateConnector: vLLM's KV connector of the user's choice, with every block it moves verified.

    --kv-transfer-config '{"kv_connector": "KvgateConnector",
                           "kv_connector_module_path": "kvgate_vllm.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {
                               "inner": {"kv_connector": "NixlConnector"},
                               "secret_file": "/etc/kvgate/handoff-secret/key",
                               "role": "prefill"}}'

Prefill: after the forward pass that completes a prompt, the worker digests each of its blocks (every
layer's K and V, `digest.py`) on the blocks' device, hands the digests to the scheduler
(`KVConnectorWorkerMetadata`), which adds them under `kvgate` to the parameters the inner
connector returns for decode.

Decode: when the inner connector reports a request's blocks received, the worker digests them
again, bound to decode's own prompt and to the request they were read from, before the
scheduler may schedule the request. A block that does not verify, a transfer past prefill's
lease, or a handoff without digests puts the request in `failed_recving`: under vLLM's
`kv_load_failure_policy` "fail" the request ends with an error and no token; under "recompute"
decode computes the prompt itself. Either way nothing is decoded from the bad blocks.

Everything else is the inner connector's: each hook this class does not define is handed to it
(`_delegate`), so it moves the KV exactly as it would alone.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from . import digest, faults, handoff
from .metrics import KvgatePromMetrics, KvgateStats, empty_counts

# Under vLLM's "vllm" logger, so the lines carry its format and level settings.
log = init_logger(f"vllm.{__name__}")


@dataclass
class SealJob:
    """Prefill: digest these blocks (positions 0..) once this step has computed them."""

    block_ids: list[int]
    token_ids: list[int]
    binding: str


@dataclass
class VerifyJob:
    """Decode: verify these received blocks (positions `first_position`..) when they arrive."""

    block_ids: list[int]
    first_position: int
    token_ids: list[int]
    binding: str
    sealed: handoff.Sealed | None


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata
    seal: dict[str, SealJob] = field(default_factory=dict)
    verify: dict[str, VerifyJob] = field(default_factory=dict)


@dataclass
class KvgateWorkerMetadata(KVConnectorWorkerMetadata):
    inner: KVConnectorWorkerMetadata | None
    # request id -> TP rank -> digests, position 0 first
    sealed: dict[str, dict[int, list[bytes]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvgateWorkerMetadata)
        for req_id, ranks in other.sealed.items():
            self.sealed.setdefault(req_id, {}).update(ranks)
        if self.inner is None:
            self.inner = other.inner
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        return self


def _inner_transfer_config(outer: KVTransferConfig) -> KVTransferConfig:
    inner = dict(outer.kv_connector_extra_config.get("inner") or {})
    if "kv_connector" not in inner:
        raise ValueError('kv_connector_extra_config.inner.kv_connector: name the connector KvgateConnector wraps, e.g. {"kv_connector": "NixlConnector"}')
    fields = {k: getattr(outer, k) for k in ("kv_role", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_load_failure_policy") if hasattr(outer, k)}
    fields.update(inner)
    return KVTransferConfig(**fields)


def _inner_config(vllm_config):
    config = copy.copy(vllm_config)
    config.kv_transfer_config = _inner_transfer_config(vllm_config.kv_transfer_config)
    return config


def _role(ktc: KVTransferConfig) -> str:
    named = ktc.kv_connector_extra_config.get("role")
    return named or {"kv_producer": "prefill", "kv_consumer": "decode"}.get(ktc.kv_role, "both")


class KvgateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = ktc.kv_connector_extra_config
        secret_file = extra.get("secret_file")
        if not secret_file:
            raise ValueError("kv_connector_extra_config.secret_file: the path of the deployment's handoff secret (the operator mounts it)")
        self._keys = digest.Keys.from_file(secret_file)
        inner_config = _inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config)
        self._inner: KVConnectorBase_V1 = inner_cls(inner_config, role, kv_cache_config)
        self._inner_class = inner_cls.__name__
        self._engine_id = ktc.engine_id
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self._lease_seconds = float(inner_config.kv_transfer_config.kv_connector_extra_config.get("kv_lease_duration", 30))
        self._role_label = _role(ktc)
        self._faults = faults.Faults.from_env()
        self._record = os.environ.get("KVGATE_VLLM_RECORD")
        self._counts = empty_counts()
        # Scheduler side.
        self._kv_cache_manager = None
        self._sealing: dict[str, Any] = {}  # prefill request id -> Request, until its prompt is computed
        self._new_verify: dict[str, VerifyJob] = {}
        self._sealed: dict[str, dict[int, list[bytes]]] = {}  # digests the workers made, not yet sent
        # request id -> (params returned, tokens, lease end), until the workers' digests arrive
        self._finished_params: dict[str, tuple[dict[str, Any], int, float]] = {}
        # Worker side.
        self._layers: list = []
        self._block_dims: list[int] = []
        self._block_bytes = 0
        self._rank = 0
        self._step_seal: dict[str, SealJob] = {}
        self._verify: dict[str, VerifyJob] = {}
        self._out_sealed: dict[str, dict[int, list[bytes]]] = {}
        log.info("KvgateConnector (%s) verifying %s for %s", role.name.lower(), self._inner_class, self._role_label)

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._inner.register_kv_caches(kv_caches)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._rank = get_tensor_model_parallel_rank()
        self._layers = [kv_caches[name] for name in sorted(kv_caches)]
        self._block_dims = [_block_dim(t, self._num_blocks) for t in self._layers]
        self._block_bytes = sum(t.numel() * t.element_size() // t.shape[d] for t, d in zip(self._layers, self._block_dims))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KvgateMetadata)
        self._inner.bind_connector_metadata(connector_metadata.inner)
        self._step_seal = connector_metadata.seal
        self._verify.update(connector_metadata.verify)
        if self._faults:
            self._faults.before_load(self, connector_metadata.verify)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def _seal(self):
        """Digest the blocks of the prompts this step completed. Called after the forward pass
        (before any deferred wait_for_save), on the blocks' device and stream."""
        for req_id, job in self._step_seal.items():
            lanes = digest.block_lanes_torch(self._keys, self._layers, self._block_dims, job.block_ids)
            digests = digest.block_digests(self._keys, job.binding, 0, self._block_size, job.token_ids, lanes)
            self._out_sealed[req_id] = {self._rank: digests}
            if self._record:
                faults.record(self._record, req_id, job, self._layers, self._block_dims, digests, self._block_size)
            self._counts["sealed"] += len(job.block_ids)
        self._step_seal = {}

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._seal()
        results = self._inner.get_transfer_results(finished_req_ids)
        if self._faults:
            self._faults.hold(self, results)
        for req_id in results.finished_recving:
            job = self._verify.pop(req_id, None)
            if req_id in results.failed_recving:
                self._refuse(req_id, handoff.TIMEOUT, results)
            elif job is not None:
                if self._faults:
                    self._faults.after_load(self, req_id, job)
                reason = self._check(job)
                if reason is None:
                    self._counts["verified"] += len(job.block_ids)
                    self._counts["bytes"] += len(job.block_ids) * self._block_bytes
                else:
                    self._refuse(req_id, reason, results)
        return results

    def _check(self, job: VerifyJob) -> str | None:
        sealed = job.sealed
        received = handoff.Received(self._rank, self._block_size, job.first_position, len(job.token_ids))
        if sealed is None or not job.block_ids:
            return handoff.verdict(sealed, received, [], time.time())
        lanes = digest.block_lanes_torch(self._keys, self._layers, self._block_dims, job.block_ids)
        tokens = job.token_ids[: sealed.tokens]
        computed = digest.block_digests(self._keys, job.binding, job.first_position, self._block_size, tokens, lanes)
        return handoff.verdict(sealed, received, computed, time.time())

    def _refuse(self, req_id: str, reason: str, results: KVConnectorTransferResults):
        results.failed_recving.add(req_id)
        self._counts["mismatch"][reason] = self._counts["mismatch"].get(reason, 0) + 1
        log.error("kvgate: refused the KV handoff of request %s: %s; no token is decoded from it", req_id, reason)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self._inner.build_connector_worker_meta()
        if inner is None and not self._out_sealed:
            return None
        meta, self._out_sealed = KvgateWorkerMetadata(inner=inner, sealed=self._out_sealed), {}
        return meta

    def get_kv_connector_stats(self):
        """Both sides: the counts since the last call, with the inner connector's stats."""
        inner = self._inner.get_kv_connector_stats()
        counts, self._counts = self._counts, empty_counts()
        stats = KvgateStats(data={"kvgate": counts, "inner": inner, "inner_class": self._inner_class})
        return None if stats.is_empty() else stats

    # ---- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._inner.bind_kv_cache_manager(kv_cache_manager)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._sealing[request.request_id] = request
        elif params.get("do_remote_prefill") and num_external_tokens > 0:
            # The inner connector reads the blocks its prefix cache did not hold: the unhashed
            # tail, from position `first` on (what NixlConnector reads, `pull_scheduler.py`).
            group = blocks.blocks[0]
            first = sum(b.block_hash is not None and not b.is_null for b in group)
            block_ids = list(blocks.get_unhashed_block_ids_all_groups()[0])
            self._new_verify[request.request_id] = VerifyJob(block_ids, first, list(request.prompt_token_ids or []), handoff.binding(params), handoff.Sealed.from_params(params))
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvgateMetadata:
        seal = {}
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._sealing.get(req_id)
            if request is None or request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            del self._sealing[req_id]
            count = -(-request.num_prompt_tokens // self._block_size)
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0][:count])
            seal[req_id] = SealJob(block_ids, list(request.prompt_token_ids), f"{self._engine_id}/{req_id}")
        meta = KvgateMetadata(self._inner.build_connector_meta(scheduler_output), seal, self._new_verify)
        self._new_verify = {}
        return meta

    def update_connector_output(self, connector_output):
        mine = connector_output.kv_connector_worker_meta
        if isinstance(mine, KvgateWorkerMetadata):
            for req_id, ranks in mine.sealed.items():
                self._sealed.setdefault(req_id, {}).update(ranks)
                self._attach(req_id)
            connector_output.kv_connector_worker_meta = mine.inner
        try:
            self._inner.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = mine

    def request_finished(self, request, block_ids):
        delay_free, params = self._inner.request_finished(request, block_ids)
        req_id = request.request_id
        self._sealing.pop(req_id, None)
        if params is not None and params.get("do_remote_prefill"):
            tokens = params.get("remote_num_tokens") or request.num_computed_tokens
            self._finished_params[req_id] = (params, tokens, time.time() + self._lease_seconds)
            if self._faults:
                self._faults.on_params(self, request, params)
            self._attach(req_id)
        else:
            self._sealed.pop(req_id, None)
        return delay_free, params

    def _attach(self, req_id: str):
        """Put the workers' digests into the parameters decode will get, once both exist (the
        scheduler asks for the parameters before it reads the step's worker metadata)."""
        finished, ranks = self._finished_params.get(req_id), self._sealed.get(req_id)
        if finished is None or ranks is None:
            return
        del self._finished_params[req_id], self._sealed[req_id]
        params, tokens, expires_at = finished
        params[handoff.KEY] = handoff.Sealed(self._block_size, tokens, expires_at, [ranks[r] for r in sorted(ranks)]).to_params()

    # ---- both -------------------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        inner_config = _inner_config(vllm_config)
        return KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config).get_required_kvcache_layout(inner_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        inner = dict(extra_config.get("inner") or {})
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**inner))
        return inner_cls.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config", {}))

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        if data is None:
            return KvgateStats()
        inner = data.get("inner")
        name = data.get("inner_class")
        if isinstance(inner, dict) and name:
            inner = KVConnectorFactory.get_connector_class_by_name(name).build_kv_connector_stats(data=inner)
        return KvgateStats(data={"kvgate": data.get("kvgate") or empty_counts(), "inner": inner, "inner_class": name})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        inner_config = _inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner_config.kv_transfer_config)
        inner = inner_cls.build_prom_metrics(inner_config, metric_types, labelnames, per_engine_labelvalues)
        return KvgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, _role(vllm_config.kv_transfer_config), inner)

    def shutdown(self):
        return self._inner.shutdown()


def _block_dim(tensor, num_blocks: int | None) -> int:
    """The axis of a layer's KV tensor that indexes blocks: the one as long as the pool (the
    first such among the leading two, where backends put it)."""
    for dim in range(min(2, tensor.dim())):
        if num_blocks is not None and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"KvgateConnector: no axis of a KV tensor of shape {tuple(tensor.shape)} holds the pool's {num_blocks} blocks")


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _delegate_property(name: str):
    return property(lambda self: getattr(self._inner, name))


# Every other hook of the base class goes to the inner connector as it is, so a hook a later
# vLLM adds is handed on rather than answered with the base class's default.
for _name, _value in vars(KVConnectorBase_V1).items():
    if _name.startswith("_") or _name in vars(KvgateConnector) or _name == "role":
        continue
    if isinstance(_value, property):
        setattr(KvgateConnector, _name, _delegate_property(_name))
    elif callable(_value) and not isinstance(_value, (classmethod, staticmethod)):
        setattr(KvgateConnector, _name, _delegate(_name))
# The abstract hooks are delegated above; the class was judged abstract before they were.
KvgateConnector.__abstractmethods__ = frozenset()
