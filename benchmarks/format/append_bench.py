"""Append throughput (issue U, item 5): a producer appending generations of frames
with ``forebay.append`` against writing the same frames as one dataset with
``forebay.write_dataset`` (the rate a generation-at-a-time producer gives up), in
interleaved rounds, with the page cache written back (``os.sync``) inside each timing.

    python benchmarks/format/append_bench.py --out /tmp/appendb --frames 400 \\
        --frame-kb 64 --generations 10 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine  # noqa: E402

import forebay  # noqa: E402


def frames(start: int, n: int, nbytes: int):
    rng = np.random.default_rng(start)
    block = rng.integers(0, 255, nbytes, dtype=np.uint8)
    for k in range(start, start + n):
        yield {"x": np.roll(block, k), "k": np.int64(k)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-appendb"))
    p.add_argument("--frames", type=int, default=400, help="frames per generation")
    p.add_argument("--frame-kb", type=int, default=64)
    p.add_argument("--generations", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    nb, g, n = a.frame_kb * 1024, a.generations, a.frames
    total = g * n * nb
    res: dict[str, list[float]] = {"write_dataset, all at once": [],
                                   "append, one generation at a time": []}
    for r in range(a.rounds):
        for name in (list(res) if r % 2 == 0 else list(res)[::-1]):
            path = a.out / "ds"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            if name.startswith("write"):
                forebay.write_dataset(path, (s for j in range(g)
                                             for s in frames(j * n, n, nb)))
            else:
                forebay.write_dataset(path, frames(0, n, nb))
                for j in range(1, g):
                    forebay.append(path, frames(j * n, n, nb))
            os.sync()
            res[name].append(time.perf_counter() - t0)
            ds = forebay.open_dataset(path)
            assert len(ds) == g * n and int(ds[len(ds) - 1]["k"]) == g * n - 1
    shutil.rmtree(a.out / "ds", ignore_errors=True)
    print(f"machine: {machine()}; {g} generations of {n} frames of {a.frame_kb} KiB "
          f"({total / 1e6:.0f} MB), {a.rounds} interleaved rounds, written back to {a.out}")
    print("| writer | MB/s, median (max) | frames/s, median | vs all at once |")
    print("|---|---:|---:|---:|")
    base = statistics.median(res["write_dataset, all at once"])
    for name, ts in res.items():
        m = statistics.median(ts)
        print(f"| {name} | {total / m / 1e6:,.0f} ({total / min(ts) / 1e6:,.0f}) | "
              f"{g * n / m:,.0f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
