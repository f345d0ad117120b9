"""Writes the litdata test datasets here with litdata's own ``optimize`` (issue S: a
source is tested on files its library made).  Not run by the tests, which read what it
wrote; run it again only to remake them (litdata is not a dependency of forebay):

    pip install --no-deps --target /tmp/peerlib litdata==0.2.76 lightning-utilities \\
        "zstd<2" filelock fsspec
    PYTHONPATH=/tmp/peerlib .venv/bin/python tests/data/litdata/make.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
N = 40
#: directory -> optimize's compression settings (zstd's default is "batch": frames of rows)
VARIANTS = {"plain": {}, "zstd": {"compression": "zstd"},
            "zstd-sample": {"compression": "zstd", "compression_level": "sample"},
            "zstd-chunk": {"compression": "zstd", "compression_level": "chunk"}}


def sample(i: int) -> dict:
    """Sample i as written (numpy arrays and tensors as numpy here), deterministic."""
    rng = np.random.default_rng(i)
    return {"label": i * 7 - 50, "score": i / 3, "name": f"sample {i} \u00e9",
            "raw": rng.bytes(int(rng.integers(0, 40))),
            "img": rng.integers(0, 255, (int(rng.integers(1, 4)), 3), dtype=np.uint8),
            "vec": rng.normal(size=int(rng.integers(0, 6))).astype(np.float32),
            "t": np.full((2, 2), i, np.int32), "ok": bool(i % 2),
            "meta": {"id": i + 1000, "pair": (float(i), i % 5)}}


def _item(i: int) -> dict:
    import torch

    s = sample(i)
    s["t"] = torch.from_numpy(s["t"])
    return s


def main() -> None:
    import litdata

    for name, kw in VARIANTS.items():
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        litdata.optimize(fn=_item, inputs=list(range(N)), output_dir=str(out),
                         chunk_bytes="1KB", num_workers=1, **kw)
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
