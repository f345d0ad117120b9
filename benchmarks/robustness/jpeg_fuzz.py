"""Mutated JPEGs against DecodeCropFlip's region decoder (``forebay._jpeg``), counted.

Seed JPEGs of every chroma subsampling, progressive and with restart markers get 1-5
mutations each (a bit flipped, a byte replaced, bytes inserted or deleted), most then
closed with an end-of-image marker so that the region decoder tries them; each is
cropped from a random box by the region decoder and, where it decodes, by Pillow (the
whole file decoded, then resized): both decoded and the same bytes, both and different
bytes, the region decoder only (Pillow refused the file), declined (left to Pillow).
Each worker is a process of its own, so a crash shows as its exit status::

    python benchmarks/robustness/jpeg_fuzz.py --workers 2 --seconds 60

The figure to look for is zero crashed workers.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # mutate
from mutate import mutate  # noqa: E402


def worker(seed: int, seconds: float) -> dict:
    from PIL import Image

    from forebay.torch import _transforms as tr

    warnings.simplefilter("ignore")      # Pillow's corrupt-data and bomb warnings
    jpeg = tr.jpeg_module()
    rng = np.random.default_rng(seed)
    seeds = []
    for kw in (dict(subsampling=0), dict(subsampling=1), dict(subsampling=2),
               dict(subsampling=2, progressive=True), dict(subsampling=1, restart_marker_blocks=2)):
        img = Image.fromarray(rng.integers(0, 256, (12, 14, 3), dtype=np.uint8)).resize(
            (int(rng.integers(40, 200)), int(rng.integers(40, 200))), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=85, **kw)
        seeds.append(buf.getvalue())
    n = dict(trials=0, header_declined=0, declined=0, same=0, different=0, pillow_refused=0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = mutate(seeds[int(rng.integers(len(seeds)))], rng)
        if not data.endswith(b"\xff\xd9") and rng.random() < 0.7:
            data += b"\xff\xd9"
        n["trials"] += 1
        wh = jpeg.info(data)
        if wh is None or wh[0] * wh[1] > 4_000_000:
            n["header_declined"] += 1
            continue
        w, h = wh
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = (x0, y0, int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1)))
        size, flip = int(rng.choice([8, 32, 64])), bool(rng.integers(2))
        out = np.empty((3, size, size), np.uint8)
        if not tr.region_crop(data, out, box, size, flip):
            n["declined"] += 1
            continue
        try:
            want = tr._pillow_crop(data, size, box, flip, None, rng)
        except Exception:        # Pillow's OSError, SyntaxError, ...: it refused the file
            n["pillow_refused"] += 1
            continue
        n["same" if np.array_equal(out, want) else "different"] += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        print("RESULT " + json.dumps(worker(a.worker, a.seconds)))
        return
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), "--seconds",
                               str(a.seconds)], stdout=subprocess.PIPE, text=True)
             for k in range(a.workers)]
    total: dict = {}
    crashed = 0
    for pr in procs:
        out, _ = pr.communicate()
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if pr.returncode or not line:
            crashed += 1
            print(f"worker crashed: exit status {pr.returncode}")
            continue
        for k, v in json.loads(line[0][7:]).items():
            total[k] = total.get(k, 0) + v
    print(f"# {a.workers} workers x {a.seconds:g} s; crashed workers: {crashed}")
    for k, v in total.items():
        print(f"{k}: {v:,}")


if __name__ == "__main__":
    main()
