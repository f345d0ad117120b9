"""Cost of the clairvoyant placement on one rank: O(F) memory, O(F log F + E F / N) time.

    python benchmarks/sim/placement_bench.py --samples 1281167 --ranks 64 --epochs 90
    # issue G, item 5: ImageNet-22k (NoPFS §6.1 sizes) at 1,024 ranks, Lassen-like tiers
    python benchmarks/sim/placement_bench.py --dataset imagenet-22k --ranks 1024 --epochs 90 \\
        --ram 120GB --ssd 900GB
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import machine  # noqa: E402

from forebay import AccessPlan  # noqa: E402
from forebay._units import parse_size  # noqa: E402
from forebay.store import compute_placement  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1_281_167,
                   help="log-normal sizes around 110 KB (without --dataset)")
    p.add_argument("--dataset", help="a simulator scenario instead (e.g. imagenet-22k)")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ram-fraction", type=float, default=1.5,
                   help="aggregate RAM as a multiple of the dataset (without --ram)")
    p.add_argument("--ram", help="RAM tier per rank, e.g. 120GB")
    p.add_argument("--ssd", default="0", help="SSD tier per rank, e.g. 900GB")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.dataset:
        from forebay.sim import dataset_sizes

        sizes, _ = dataset_sizes(a.dataset)
    else:
        sizes = np.random.default_rng(0).lognormal(np.log(110_000), 0.5,
                                                   a.samples).astype(np.int64)
    f = len(sizes)
    plan = AccessPlan(f, a.ranks, a.batch_size, a.epochs, seed=a.seed)
    per_rank = parse_size(a.ram) if a.ram else int(sizes.sum() * a.ram_fraction / a.ranks)
    ram = np.full(a.ranks, per_rank, dtype=np.int64)
    ssd = np.full(a.ranks, 0 if a.ssd in ("0", "0B") else parse_size(a.ssd), dtype=np.int64)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    pl = compute_placement(plan, sizes, ram, ssd, rank=a.ranks // 2)
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"machine: {machine()}")
    print(f"{a.dataset or 'log-normal sizes'}: F={f:,} samples, {sizes.sum() / 1e9:,.1f} GB; "
          f"N={a.ranks} ranks, E={a.epochs} epochs, batch {a.batch_size}/rank; tiers per rank "
          f"{per_rank / 1e9:.1f} GB RAM + {ssd[0] / 1e9:.1f} GB SSD")
    print(f"placement for one rank: {dt:.2f} s, peak RSS {rss / 2**20:.2f} GiB, grew "
          f"{(rss - rss0) / 1024:.0f} MiB ({(rss - rss0) * 1024 / f:.0f} bytes per sample); "
          f"covered {pl.covered:.1%}, this rank owns {len(pl.own_ram):,} (RAM) + "
          f"{len(pl.own_ssd):,} (SSD) and adds {len(pl.extra_ram):,} + {len(pl.extra_ssd):,} "
          f"extra copies")


if __name__ == "__main__":
    main()
