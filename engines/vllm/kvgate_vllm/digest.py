"""Keyed digests of KV blocks, computed where the blocks are.

A block's digest covers every layer's K and V of that block, bound to the handoff (the prefill
request that computed it), the block's position in the prompt and the token ids it holds:

    lanes(layer)  = (words(block, layer) @ R) mod Q          on the blocks' device
    digest(block) = BLAKE2b-128(key=mac_key, binding | position | tokens | lanes of every layer)

`words` are the block's bytes read as signed 16-bit words. `R` is a (words x LANES) matrix of
secret coefficients in [1, Q) drawn from the deployment's key, so each lane is a keyed linear
hash mod a prime: a change to any one word changes every lane (Q is prime and larger than any
word difference), and a change to many words survives a lane with probability 1/Q, all LANES
lanes together with 1/Q**LANES (about 2**-80). The lanes never leave the process; only their
keyed BLAKE2b does, so a digest reveals nothing about R.

The lanes are a matrix product in float64, exact because every partial sum stays below 2**53
(|word| <= 2**15, R < 2**20, at most CHUNK = 2**17 words per product): the same integers on a
GPU, on a CPU, in torch or in numpy, whatever order the hardware adds in. That is what lets
prefill on one device and decode on another agree, and CI check the arithmetic with numpy.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

LANES = 4
# The largest prime below 2**20.
Q = 1048573
# Words per product: 2**15 * 2**20 * 2**17 = 2**52 < 2**53, so float64 sums are exact.
CHUNK = 1 << 17
DIGEST_BYTES = 16
_PERSON = b"kvgate-vllm-kv1"


@dataclass
class Keys:
    """The two keys one handoff secret yields: one for the coefficients, one for the MAC."""

    mac: bytes
    coefficients_seed: bytes
    _coefficients: dict[tuple[int, str], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> "Keys":
        if len(secret) < 16:
            raise ValueError(f"the handoff secret must be at least 16 bytes, got {len(secret)}")
        derive = lambda label: hmac.new(secret, b"kvgate vllm kv digest v1 " + label, hashlib.sha256).digest()
        return cls(mac=derive(b"mac"), coefficients_seed=derive(b"coefficients"))

    @classmethod
    def from_file(cls, path: str) -> "Keys":
        with open(path, "rb") as f:
            return cls.from_secret(f.read().strip())

    def coefficients_numpy(self, words: int):
        """R for blocks of `words` 16-bit words, as a float64 numpy array (words x LANES)."""
        import numpy as np

        key = (words, "numpy")
        if key not in self._coefficients:
            stream = hashlib.shake_256(self.coefficients_seed + struct.pack("<Q", words)).digest(4 * words * LANES)
            raw = np.frombuffer(stream, dtype="<u4").astype(np.int64)
            self._coefficients[key] = ((raw % (Q - 1)) + 1).astype(np.float64).reshape(words, LANES)
        return self._coefficients[key]

    def coefficients_torch(self, words: int, device):
        """R as a float64 torch tensor on `device`, made once per device."""
        import torch

        key = (words, str(device))
        if key not in self._coefficients:
            self._coefficients[key] = torch.from_numpy(self.coefficients_numpy(words).copy()).to(device)
        return self._coefficients[key]


def lanes(words, coefficients):
    """(blocks x words) int16 words, already float64, times R, mod Q: (blocks x LANES) integers.

    Works on numpy arrays and torch tensors alike (both read `%` as the divisor's sign)."""
    total = None
    for start in range(0, words.shape[1], CHUNK):
        part = (words[:, start : start + CHUNK] @ coefficients[start : start + CHUNK]) % Q
        total = part if total is None else (total + part) % Q
    return total


def block_lanes_torch(keys: Keys, layers: Sequence, dims: Sequence[int], block_ids: Sequence[int]):
    """Lanes of `block_ids` in every layer's KV tensor (its blocks along `dims[i]`): a
    (layers x blocks x LANES) int64 tensor on the CPU. The products run on the tensors' device."""
    import torch

    out = []
    for tensor, dim in zip(layers, dims):
        index = torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)
        blocks = tensor.index_select(dim, index).movedim(dim, 0).contiguous()
        words = blocks.reshape(len(block_ids), -1).view(torch.int16).to(torch.float64)
        out.append(lanes(words, keys.coefficients_torch(words.shape[1], tensor.device)))
    return torch.stack(out).to(torch.int64).cpu()


def block_lanes_numpy(keys: Keys, layers: Sequence, block_ids: Sequence[int]):
    """The same as `block_lanes_torch` for numpy arrays whose first axis is the block
    (the recorded blocks the tests check): (layers x blocks x LANES) int64."""
    import numpy as np

    out = []
    for array in layers:
        blocks = np.ascontiguousarray(array[list(block_ids)])
        words = blocks.reshape(len(block_ids), -1).view(np.int16).astype(np.float64)
        out.append(lanes(words, keys.coefficients_numpy(words.shape[1])))
    return np.stack(out).astype(np.int64)


def digest(keys: Keys, binding: str, position: int, tokens: Sequence[int], layer_lanes) -> bytes:
    """The digest of one block from its lanes in every layer (a LANES-wide row per layer)."""
    h = hashlib.blake2b(key=keys.mac, digest_size=DIGEST_BYTES, person=_PERSON)
    name = binding.encode()
    h.update(struct.pack("<I", len(name)) + name)
    h.update(struct.pack("<QI", position, len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    for row in layer_lanes:
        h.update(struct.pack(f"<{LANES}I", *(int(v) for v in row)))
    return h.digest()


def block_digests(keys: Keys, binding: str, first_position: int, block_size: int, token_ids: Sequence[int], lanes_by_layer) -> list[bytes]:
    """Digests of consecutive blocks starting at `first_position`, from (layers x blocks x LANES)
    lanes. Block p holds tokens [p*block_size, (p+1)*block_size) of `token_ids`, the last one
    fewer when the prompt ends inside it."""
    count = len(lanes_by_layer[0]) if len(lanes_by_layer) else 0
    out = []
    for i in range(count):
        position = first_position + i
        tokens = token_ids[position * block_size : (position + 1) * block_size]
        out.append(digest(keys, binding, position, tokens, [layer[i] for layer in lanes_by_layer]))
    return out
