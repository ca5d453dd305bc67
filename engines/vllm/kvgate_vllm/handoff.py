"""What prefill promises about a handoff, as it travels in `kv_transfer_params`, and decode's
verdict on the blocks it received.

Prefill adds one key, `kvgate`, to the parameters its engine returns; the router copies them
into the request it sends decode, as it does for the inner connector's own keys:

    "kvgate": {"v": 1, "block_size": 16, "tokens": 1530, "expires_at": 1796000000.5,
               "digests": ["<base64 of 16 bytes per block, position 0 first>", ...one per TP rank]}

Everything decode checks comes from here, from its own copy of the prompt and from the ids the
inner connector reads the blocks by (`remote_engine_id`, `remote_request_id`: the digests'
binding); the digests are keyed with the deployment's secret, so altering this dict, or pointing
the read at another request's blocks, can only make verification fail.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Sequence

from .digest import DIGEST_BYTES

KEY = "kvgate"
VERSION = 1

# Reasons, with the meaning they have for kvgate's own workers (proto/src/refusal.rs).
CHECKSUM = "checksum"  # a block's bytes are not the bytes prefill digested
PAGE_SET = "page_set"  # a received block lies past the blocks prefill digested
TOKEN_COUNT = "token_count"  # prefill computed KV for more tokens than decode's prompt has
AUTH = "auth"  # the handoff carries no digests at all: its prefill did not seal it
FINGERPRINT = "fingerprint"  # prefill's KV layout is not decode's (block size, TP ranks)
TIMEOUT = "timeout"  # the transfer failed or ended after prefill's lease on the blocks ran out
REASONS = (CHECKSUM, PAGE_SET, TOKEN_COUNT, AUTH, FINGERPRINT, TIMEOUT)


@dataclass
class Sealed:
    """The `kvgate` entry of one handoff's parameters: the prompt tokens prefill computed KV
    for, the wall-clock end of its lease on the blocks, and every block's digest."""

    block_size: int
    tokens: int
    expires_at: float
    digests: list[list[bytes]]  # per TP rank, per block position

    def to_params(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "block_size": self.block_size,
            "tokens": self.tokens,
            "expires_at": self.expires_at,
            "digests": [base64.b64encode(b"".join(rank)).decode() for rank in self.digests],
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> "Sealed | None":
        """The sealed entry, or None when there is none or it cannot be read (both refused as
        `auth`: decode never takes unsealed KV)."""
        entry = (params or {}).get(KEY)
        if not isinstance(entry, dict) or entry.get("v") != VERSION:
            return None
        try:
            digests = []
            for rank in entry["digests"]:
                raw = base64.b64decode(rank, validate=True)
                if len(raw) % DIGEST_BYTES:
                    return None
                digests.append([raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)])
            return cls(int(entry["block_size"]), int(entry["tokens"]), float(entry["expires_at"]), digests)
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Received:
    """What decode received for one request on one TP rank: the blocks' positions in the prompt
    (consecutive from `first_position`) and the length of decode's own prompt."""

    rank: int
    block_size: int
    first_position: int
    tokens: int


def verdict(sealed: Sealed | None, received: Received, computed: Sequence[bytes], now: float) -> str | None:
    """None when every received block verifies; otherwise the first reason it does not.

    `computed` are decode's digests of the blocks it received, bound to its own prompt."""
    if sealed is None:
        return AUTH
    if sealed.block_size != received.block_size or received.rank >= len(sealed.digests):
        return FINGERPRINT
    if now > sealed.expires_at:
        return TIMEOUT
    if sealed.tokens > received.tokens:
        return TOKEN_COUNT
    expected = sealed.digests[received.rank]
    if received.first_position + len(computed) > len(expected):
        return PAGE_SET
    for i, got in enumerate(computed):
        if expected[received.first_position + i] != got:
            return CHECKSUM
    return None


def binding(params: dict[str, Any]) -> str:
    """What a handoff's digests are bound to: the engine and request the blocks are read from."""
    return f"{params.get('remote_engine_id')}/{params.get('remote_request_id')}"
