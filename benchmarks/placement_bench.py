"""Cost of the clairvoyant placement on one rank: O(F) memory, O(F log F + E F / N) time.

    python benchmarks/placement_bench.py --samples 1281167 --ranks 64 --epochs 90
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

from forebay import AccessPlan  # noqa: E402
from forebay.store import compute_placement  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1_281_167)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ram-fraction", type=float, default=1.5,
                   help="aggregate RAM as a multiple of the dataset")
    a = p.parse_args()
    sizes = np.random.default_rng(0).lognormal(np.log(110_000), 0.5, a.samples).astype(np.int64)
    plan = AccessPlan(a.samples, a.ranks, a.batch_size, a.epochs, seed=0)
    ram = np.full(a.ranks, int(sizes.sum() * a.ram_fraction / a.ranks))
    ssd = np.zeros(a.ranks, dtype=np.int64)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    pl = compute_placement(plan, sizes, ram, ssd, rank=a.ranks // 2)
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"machine: {machine()}")
    print(f"F={a.samples:,} samples, N={a.ranks} ranks, E={a.epochs} epochs, aggregate RAM "
          f"{a.ram_fraction}x the dataset")
    print(f"placement for one rank: {dt:.2f} s, peak RSS grew {(rss - rss0) / 1024:.0f} MiB "
          f"({(rss - rss0) * 1024 / a.samples:.0f} bytes per sample); covered "
          f"{pl.covered:.1%}, this rank owns {len(pl.own_ram):,} and adds "
          f"{len(pl.extra_ram):,} extra copies")


if __name__ == "__main__":
    main()
