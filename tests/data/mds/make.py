"""Writes the MDS test datasets here with mosaicml-streaming's own MDSWriter (issue S:
a source is tested on files its library made).  Not run by the tests, which read what it
wrote; run it again only to remake them:

    pip install --no-deps --target /tmp/ms mosaicml-streaming==0.13.0
    pip install --target /tmp/ms2 brotli python-snappy "zstd<2" cramjam
    PYTHONPATH=/tmp/ms:/tmp/ms2 .venv/bin/python tests/data/mds/make.py

(streaming's package ``__init__`` imports transformers and torchvision; only its
writer is imported here.)
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: column name -> MDS encoding
COLUMNS = {"image": "jpeg_bytes", "label": "int", "name": "str", "x": "ndarray",
           "y": "ndarray:float32:2,3", "s": "float32", "u": "uint8", "meta": "json",
           "n": "str_int", "raw": "bytes"}
N = 60


def samples() -> list[dict]:
    """The samples written (and expected back), deterministic."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(N):
        shape = tuple(int(k) for k in rng.integers(1, 4, 2))      # a field has one ndim
        dtype = np.int16          # a field has one dtype (the encoding stores it per sample)
        out.append({"image": rng.bytes(int(rng.integers(10, 300))), "label": int(i * 7 - 50),
                    "name": f"sample {i} \u00e9", "x": rng.normal(size=shape).astype(dtype),
                    "y": rng.normal(size=(2, 3)).astype(np.float32),
                    "s": float(np.float32(rng.normal())), "u": int(i % 256),
                    "meta": {"i": i, "tags": ["a", "b"][: i % 3]}, "n": i * 1000,
                    "raw": rng.bytes(int(rng.integers(0, 50)))})
    return out


def mds_writer():
    """mosaicml-streaming's MDSWriter, its package's __init__ skipped; None when the
    library is not importable (benchmarks/format/ingest_sources_bench.py uses it too)."""
    if "streaming.base.format.mds.writer" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            return None
        for name, sub in (("streaming", ""), ("streaming.base", "/base")):
            m = types.ModuleType(name)
            m.__path__ = [spec.submodule_search_locations[0] + sub]
            sys.modules[name] = m
    from streaming.base.format.mds.writer import MDSWriter
    return MDSWriter


def main() -> None:
    MDSWriter = mds_writer()
    columns = {k: ("bytes" if v == "jpeg_bytes" else v) for k, v in COLUMNS.items()}
    for name, kw in (("plain", {"size_limit": 4096, "hashes": ["sha1", "xxh64"]}),
                     ("zstd", {"size_limit": 1 << 20, "compression": "zstd:7"})):
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        with MDSWriter(out=str(out), columns=columns, **kw) as w:
            for s in samples():
                w.write(s)
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
