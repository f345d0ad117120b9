"""Writes the Hugging Face ``datasets`` test directory here with the library's own
``save_to_disk`` (issue S: a source is tested on files its library made).  Not run by
the tests, which read what it wrote; run it again only to remake it (``datasets`` is
not a dependency of forebay):

    pip install --no-deps --target /tmp/hf2 "datasets==3.6.0" "dill<0.3.9" \
        "multiprocess<0.70.17" "huggingface_hub<1" "fsspec<=2025.3.0" pandas \
        python-dateutil pytz tzdata filelock requests urllib3 idna certifi \
        charset-normalizer pyyaml packaging
    PYTHONPATH=/tmp/hf2 .venv/bin/python tests/data/hf/make.py

(datasets 3.6 writes with the dev environment's pyarrow; 5.x with pyarrow 26 fails in
dill.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
N = 50


def rows() -> dict:
    """The columns written (and expected back), deterministic."""
    return {"id": list(range(N)), "text": [f"sample {i} \u00e9" for i in range(N)],
            "tokens": [list(range(i % 7)) for i in range(N)],
            "score": [i / 4 for i in range(N)],
            "blob": [bytes([i % 256]) * (i % 5) for i in range(N)]}


def main() -> None:
    import datasets

    out = HERE / "saved"
    shutil.rmtree(out, ignore_errors=True)
    datasets.Dataset.from_dict(rows()).save_to_disk(str(out), num_shards=2)
    print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
