"""Decode's verdict for every reason, and the sealed entry as it travels in kv_transfer_params."""

import json
import unittest

from kvgate_vllm import handoff

D = [bytes([i]) * 16 for i in range(4)]


def sealed(**kw):
    args = dict(block_size=16, tokens=60, expires_at=1000.0, digests=[list(D)])
    args.update(kw)
    return handoff.Sealed(**args)


def received(**kw):
    args = dict(rank=0, block_size=16, first_position=0, tokens=60)
    args.update(kw)
    return handoff.Received(**args)


class Verdicts(unittest.TestCase):
    def test_every_block_verifying_is_accepted(self):
        self.assertIsNone(handoff.verdict(sealed(), received(), D, now=999.0))
        self.assertIsNone(handoff.verdict(sealed(), received(first_position=2), D[2:], now=999.0), "a local prefix hit: only the tail moved")

    def test_each_fault_has_its_reason(self):
        cases = [
            ("no digests at all", None, received(), D, handoff.AUTH),
            ("another block size", sealed(block_size=32), received(), D, handoff.FINGERPRINT),
            ("a TP rank prefill did not seal", sealed(), received(rank=1), D, handoff.FINGERPRINT),
            ("past the lease", sealed(expires_at=998.0), received(), D, handoff.TIMEOUT),
            ("prefill computed a longer prompt", sealed(tokens=61), received(), D, handoff.TOKEN_COUNT),
            ("a block past the sealed ones", sealed(), received(first_position=1), D, handoff.PAGE_SET),
            ("one block's bytes differ", sealed(), received(), D[:3] + [b"\xff" * 16], handoff.CHECKSUM),
            ("blocks out of order", sealed(), received(), [D[1], D[0]] + D[2:], handoff.CHECKSUM),
        ]
        for name, s, r, computed, reason in cases:
            with self.subTest(name):
                self.assertEqual(handoff.verdict(s, r, computed, now=999.0), reason)
        self.assertEqual(set(r for *_, r in cases), set(handoff.REASONS))


class Params(unittest.TestCase):
    def test_the_sealed_entry_survives_json(self):
        s = sealed(digests=[list(D), list(reversed(D))])
        params = json.loads(json.dumps({"remote_request_id": "r", handoff.KEY: s.to_params()}))
        self.assertEqual(handoff.Sealed.from_params(params), s)

    def test_a_malformed_entry_reads_as_unsealed(self):
        good = sealed().to_params()
        broken = [
            None,
            {},
            {handoff.KEY: "x"},
            {handoff.KEY: dict(good, v=2)},
            {handoff.KEY: dict(good, digests=["not base64!"])},
            {handoff.KEY: dict(good, digests=["AAAA"])},
            {handoff.KEY: {k: v for k, v in good.items() if k != "tokens"}},
            {handoff.KEY: dict(good, tokens="many")},
        ]
        for params in broken:
            with self.subTest(params=params):
                self.assertIsNone(handoff.Sealed.from_params(params))

    def test_the_binding_is_the_read_source(self):
        self.assertEqual(handoff.binding({"remote_engine_id": "e1", "remote_request_id": "r9"}), "e1/r9")


if __name__ == "__main__":
    unittest.main()
