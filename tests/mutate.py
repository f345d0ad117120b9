"""Random damage to a file's bytes, for tests/test_transforms.py and
benchmarks/robustness/jpeg_fuzz.py."""

from __future__ import annotations

import numpy as np


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """``data`` with 1-5 mutations, each a bit flipped, a byte replaced, 1-7 random
    bytes inserted or 1-7 bytes deleted, at a random place."""
    d = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        i, op = int(rng.integers(0, len(d))), int(rng.integers(4))
        if op == 0:
            d[i] ^= 1 << int(rng.integers(8))
        elif op == 1:
            d[i] = int(rng.integers(256))
        elif op == 2:
            d[i:i] = bytes(rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8))
        else:
            del d[i:i + int(rng.integers(1, 8))]
    return bytes(d)
