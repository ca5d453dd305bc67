"""Test aids, off unless their variables are set: faults (what a broken transport would do to a
handoff, so the tests can prove decode catches each one on a real pair) and the recording of
sealed blocks (engines/vllm/tests/recorded/: the CI checks its arithmetic against the engine's).

    KVGATE_VLLM_FAULT=corrupt   decode: one byte of one received block changed in flight
    KVGATE_VLLM_FAULT=foreign   prefill: decode is told to read one block of another request
    KVGATE_VLLM_FAULT=late      decode: the transfer reported done only after prefill's lease ran out
    KVGATE_VLLM_FAULT=unsent    decode: one block never arrives (it keeps what it held before)
    KVGATE_VLLM_FAULT_AFTER=N   the first N handoffs are left alone (a revision that goes bad)
    KVGATE_VLLM_RECORD=DIR      prefill: each sealed request's blocks, tokens and digests to DIR
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

NAMES = ("corrupt", "foreign", "late", "unsent")


@dataclass
class Faults:
    name: str
    after: int
    seen: set = field(default_factory=set)
    held: dict = field(default_factory=dict)  # late: request id -> when to report it
    saved: dict = field(default_factory=dict)  # unsent: request id -> the block's bytes before the load

    @classmethod
    def from_env(cls) -> "Faults | None":
        name = os.environ.get("KVGATE_VLLM_FAULT")
        if not name:
            return None
        if name not in NAMES:
            raise ValueError(f"KVGATE_VLLM_FAULT={name}: one of {', '.join(NAMES)}")
        return cls(name, int(os.environ.get("KVGATE_VLLM_FAULT_AFTER", "0")))

    def _due(self, req_id: str) -> bool:
        """Whether this handoff is one the fault hits (every one after the first `after`)."""
        self.seen.add(req_id)
        return len(self.seen) > self.after

    def on_params(self, connector, request, params):
        """Prefill's scheduler: point decode's read of the last block at a block of the pool that
        is not this request's (what a transport that mixed up descriptors would deliver)."""
        if self.name != "foreign" or not self._due(request.request_id):
            return
        groups = list(params.get("remote_block_ids") or [])
        if groups and groups[0]:
            mine = set(groups[0])
            other = next(b for b in range(1, connector._num_blocks) if b not in mine)
            groups[0] = list(groups[0][:-1]) + [other]
            params["remote_block_ids"] = tuple(groups)

    def before_load(self, connector, verify_jobs):
        if self.name != "unsent":
            return
        for req_id, job in verify_jobs.items():
            if job.block_ids and self._due(req_id):
                block = job.block_ids[0]
                self.saved[req_id] = [t.select(d, block).clone() for t, d in zip(connector._layers, connector._block_dims)]

    def hold(self, connector, results):
        """late: keep a finished transfer back until prefill's lease on its blocks has run out."""
        if self.name != "late":
            return
        now = time.time()
        for req_id in list(results.finished_recving):
            job = connector._verify.get(req_id)
            if job is not None and job.sealed is not None and req_id not in self.held and self._due(req_id):
                self.held[req_id] = job.sealed.expires_at + 1.0
            if req_id in self.held and now < self.held[req_id]:
                results.finished_recving.discard(req_id)
        for req_id, when in list(self.held.items()):
            if now >= when:
                results.finished_recving.add(req_id)
                del self.held[req_id]

    def after_load(self, connector, req_id, job):
        if self.name == "corrupt" and job.block_ids and self._due(req_id):
            import torch

            t, d = connector._layers[0], connector._block_dims[0]
            block = t.select(d, job.block_ids[0])
            flat = block.reshape(-1).view(torch.uint8)
            flat[0] ^= 1
            block.copy_(flat.view(block.dtype).reshape(block.shape))
        elif self.name == "unsent" and req_id in self.saved:
            for (t, d), before in zip(zip(connector._layers, connector._block_dims), self.saved.pop(req_id)):
                t.select(d, job.block_ids[0]).copy_(before)


def record(directory: str, req_id: str, job, layers, dims, digests: list[bytes], block_size: int):
    """One sealed request as numpy arrays: every layer's blocks (block first), raw 16-bit words."""
    import numpy as np
    import torch

    os.makedirs(directory, exist_ok=True)
    index = torch.tensor(job.block_ids)
    arrays = {f"layer{i}": t.index_select(d, index.to(t.device)).movedim(d, 0).contiguous().cpu().view(torch.int16).numpy() for i, (t, d) in enumerate(zip(layers, dims))}
    np.savez_compressed(
        os.path.join(directory, f"{req_id}.npz"),
        tokens=np.array(job.token_ids, dtype=np.int64),
        binding=np.array(job.binding),
        block_size=np.array(block_size),
        digests=np.frombuffer(b"".join(digests), dtype=np.uint8),
        **arrays,
    )
