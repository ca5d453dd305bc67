"""Blocks a real vLLM prefill sealed (KVGATE_VLLM_RECORD, the tiny model of make test-vllm, 130
prompt tokens in two blocks of 128): the arithmetic CI runs here (numpy) gives the digests the
engine computed on its own KV tensors (torch), and decode's verdict holds on them."""

import os
import unittest

import numpy as np

from kvgate_vllm import digest, handoff

HERE = os.path.join(os.path.dirname(__file__), "recorded")


class Recorded(unittest.TestCase):
    def setUp(self):
        self.keys = digest.Keys.from_file(os.path.join(HERE, "secret"))
        z = np.load(os.path.join(HERE, "prefill-130-tokens.npz"))
        self.layers = [z[name] for name in sorted(n for n in z.files if n.startswith("layer"))]
        self.tokens = [int(t) for t in z["tokens"]]
        self.binding = str(z["binding"])
        self.block_size = int(z["block_size"])
        raw = z["digests"].tobytes()
        self.engine_digests = [raw[i : i + digest.DIGEST_BYTES] for i in range(0, len(raw), digest.DIGEST_BYTES)]

    def digests(self, layers):
        ids = list(range(len(layers[0])))
        return digest.block_digests(self.keys, self.binding, 0, self.block_size, self.tokens, digest.block_lanes_numpy(self.keys, layers, ids))

    def test_numpy_gives_the_digests_the_engine_computed(self):
        self.assertEqual(len(self.engine_digests), 2)
        self.assertEqual(self.digests(self.layers), self.engine_digests)

    def test_decode_accepts_them_and_refuses_a_flipped_byte(self):
        sealed = handoff.Sealed(self.block_size, len(self.tokens), expires_at=10.0, digests=[self.engine_digests])
        received = handoff.Received(0, self.block_size, 0, len(self.tokens))
        self.assertIsNone(handoff.verdict(sealed, received, self.digests(self.layers), now=1.0))
        flipped = [layer.copy() for layer in self.layers]
        flipped[1].view(np.uint8).reshape(-1)[12345] ^= 0x10
        self.assertEqual(handoff.verdict(sealed, received, self.digests(flipped), now=1.0), handoff.CHECKSUM)


if __name__ == "__main__":
    unittest.main()
