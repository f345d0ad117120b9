"""Fill threads per tier (issue C, item 1; NoPFS's p_j): how fast one rank's RAM tier is
filled from cold files with 1, 2 and 4 fill threads, side by side, alternating, on this
disk and on the emulated parallel file system (each thread a reader capped at
t(n)/n, n = the threads, NoPFS §6.1's t).

    python benchmarks/loader/fill_threads_bench.py --data /tmp/lbim/imagenet.fb --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _baselines import EmulatedPFS  # noqa: E402
from _common import evict, files_under, machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="a packed dataset")
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import forebay
    from forebay.store import ClairvoyantStore, tier_nbytes

    need = int(tier_nbytes(forebay.open_dataset(a.data)).sum())
    plan = forebay.AccessPlan(len(forebay.open_dataset(a.data)), 1, 128, 1)
    counts = [int(k) for k in a.threads.split(",")]
    print(f"machine: {machine()}\n{a.data}: {need / 1e6:.0f} MB into one rank's RAM tier, "
          f"files evicted before every fill; median of {a.repeats}, alternating")
    times: dict = {}
    for _ in range(a.repeats):
        for storage in ("local disk, cold", "emulated PFS"):
            for k in counts:
                hook = None
                if storage == "emulated PFS":
                    pfs = EmulatedPFS(k, 0.0)
                    hook = lambda nbytes, n, dt, pfs=pfs: pfs.charge(nbytes, 0, dt)  # noqa: E731
                evict(files_under(a.data))
                t0 = time.perf_counter()
                st = ClairvoyantStore(a.data, plan, None, ram_bytes=need, ram_threads=k,
                                      on_pfs_read=hook)
                assert st.wait_filled(600)
                times.setdefault((storage, k), []).append(time.perf_counter() - t0)
                st.close()
                del st
                gc.collect()  # unmap before the next eviction
    print("\n| storage | fill threads | fill s (median) | MB/s | vs 1 thread |\n|---|---:|---:|---:|---:|")
    for (storage, k), ts in times.items():
        med = float(np.median(ts))
        base = float(np.median(times[(storage, counts[0])]))
        print(f"| {storage} | {k} | {med:.2f} | {need / 1e6 / med:,.0f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
