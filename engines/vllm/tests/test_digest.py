"""The digest's arithmetic against plain integers, and what one changed bit or one changed
binding does to it (numpy: the same exact products the torch path runs on the blocks' device)."""

import random
import unittest

import numpy as np

from kvgate_vllm import digest

KEYS = digest.Keys.from_secret(b"0123456789abcdef-deployment-secret")


def blocks(count=3, words=96, seed=7):
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**15), 2**15, size=(count, words), dtype=np.int16)


def python_lanes(keys, row):
    r = keys.coefficients_numpy(len(row)).astype(np.int64)
    return [sum(int(w) * int(r[i, lane]) for i, w in enumerate(row)) % digest.Q for lane in range(digest.LANES)]


class Lanes(unittest.TestCase):
    def test_lanes_are_the_exact_integer_products(self):
        layer = blocks()
        got = digest.block_lanes_numpy(KEYS, [layer], [0, 1, 2])[0]
        for b in range(3):
            self.assertEqual(list(got[b]), python_lanes(KEYS, layer[b]))

    def test_products_past_one_chunk_stay_exact(self):
        words = digest.CHUNK + 5
        row = np.full((1, words), -(2**15), dtype=np.int16)
        got = digest.block_lanes_numpy(KEYS, [row], [0])[0][0]
        self.assertEqual(list(got), python_lanes(KEYS, row[0]))

    def test_coefficients_are_secret_and_never_zero(self):
        other = digest.Keys.from_secret(b"another-deployment-secret-000000")
        a, b = KEYS.coefficients_numpy(64), other.coefficients_numpy(64)
        self.assertFalse(np.array_equal(a, b))
        self.assertTrue(((a >= 1) & (a < digest.Q)).all())

    def test_a_short_secret_is_refused(self):
        with self.assertRaisesRegex(ValueError, "at least 16 bytes, got 5"):
            digest.Keys.from_secret(b"short")


class Digests(unittest.TestCase):
    def setUp(self):
        self.layers = [blocks(seed=1), blocks(seed=2)]
        self.tokens = list(range(100, 140))

    def seal(self, layers=None, binding="prefill-0/req-1", tokens=None, keys=KEYS, first=0, ids=(0, 1, 2)):
        lanes = digest.block_lanes_numpy(keys, layers or self.layers, list(ids))
        return digest.block_digests(keys, binding, first, 16, tokens or self.tokens, lanes)

    def test_the_same_blocks_give_the_same_digests(self):
        self.assertEqual(self.seal(), self.seal())
        self.assertEqual(len(set(self.seal())), 3)

    def test_every_single_bit_flip_is_caught(self):
        honest = self.seal()
        raw = self.layers[1].view(np.uint8)
        for byte in range(raw.shape[1]):
            for bit in range(8):
                flipped = raw.copy()
                flipped[2, byte] ^= 1 << bit
                got = self.seal(layers=[self.layers[0], flipped.view(np.int16)])
                self.assertEqual(got[:2], honest[:2])
                self.assertNotEqual(got[2], honest[2], f"byte {byte} bit {bit}")

    def test_many_changed_words_are_caught(self):
        honest = self.seal()
        rng = random.Random(3)
        for _ in range(200):
            changed = self.layers[0].copy()
            for _ in range(rng.randint(2, 40)):
                changed[0, rng.randrange(changed.shape[1])] = rng.randint(-(2**15), 2**15 - 1)
            if np.array_equal(changed, self.layers[0]):
                continue
            self.assertNotEqual(self.seal(layers=[changed, self.layers[1]])[0], honest[0])

    def test_a_block_of_another_request_or_position_does_not_verify(self):
        honest = self.seal()
        self.assertNotEqual(self.seal(ids=(0, 1, 1))[2], honest[2], "block 1's KV delivered as block 2")
        self.assertNotEqual(self.seal(binding="prefill-0/req-2"), honest, "another request's read")
        self.assertNotEqual(self.seal(first=1)[0], honest[1], "the same KV at another position")
        tokens = list(self.tokens)
        tokens[33] += 1
        self.assertEqual(self.seal(tokens=tokens)[:2], honest[:2])
        self.assertNotEqual(self.seal(tokens=tokens)[2], honest[2], "another prompt's token in block 2")

    def test_layers_swapped_or_another_key_do_not_verify(self):
        honest = self.seal()
        swapped = self.seal(layers=[self.layers[1], self.layers[0]])
        self.assertTrue(all(a != b for a, b in zip(swapped, honest)))
        other = digest.Keys.from_secret(b"another-deployment-secret-000000")
        self.assertTrue(all(a != b for a, b in zip(self.seal(keys=other), honest)))


if __name__ == "__main__":
    unittest.main()
