"""Placement at scale on paper (issue G, item 5): forebay's clairvoyant placement for
ImageNet-22k (14,197,122 samples, NoPFS §6.1 size distribution) at 1,024 ranks, as one
rank computes it at set-up: wall time and peak memory on one core.

    python benchmarks/sim_scale.py --ranks 1024 --epochs 5
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="imagenet-22k")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rank", type=int, default=517, help="whose placement to compute")
    p.add_argument("--ram", default="120GB", help="RAM tier per rank")
    p.add_argument("--ssd", default="900GB", help="SSD tier per rank")
    a = p.parse_args()

    from forebay._units import parse_size
    from forebay.plan import AccessPlan
    from forebay.sim import dataset_sizes
    from forebay.store._placement import compute_placement

    sizes, _ = dataset_sizes(a.dataset)
    plan = AccessPlan(len(sizes), a.ranks, a.batch, a.epochs, seed=1)
    ram = np.full(a.ranks, parse_size(a.ram), dtype=np.int64)
    ssd = np.full(a.ranks, parse_size(a.ssd), dtype=np.int64)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    pl = compute_placement(plan, sizes, ram, ssd, a.rank)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"machine: {machine()}")
    print(f"{a.dataset}: F={len(sizes):,} samples, {sizes.sum() / 1e12:.2f} TB; N={a.ranks} ranks, "
          f"E={a.epochs} epochs, batch {a.batch}/rank; tiers {a.ram} RAM + {a.ssd} SSD per rank")
    print(f"placement for rank {a.rank}: {dt:.1f} s on one core; peak RSS {peak / 2**20:.2f} GiB "
          f"({(peak - base) / 2**20:.2f} GiB above the sizes array); covered "
          f"{pl.covered:.3f}; own RAM {len(pl.own_ram):,} + SSD {len(pl.own_ssd):,}, extra RAM "
          f"{len(pl.extra_ram):,} + SSD {len(pl.extra_ssd):,}")


if __name__ == "__main__":
    main()
