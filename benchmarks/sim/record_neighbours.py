"""What a record read costs by the share of the records read (issue R; docs/sim.md,
"Neighbours"): a packed dataset served by the paced FUSE file system
(tests/cluster_pfs.py), read cold one batch of 64 records at a time by one reader, a
random share of its records each time (in random order); for each share, the records'
MB/s, the bytes the file system served per byte of records and its requests per record.

    sudo .venv/bin/python benchmarks/sim/record_neighbours.py --data /tmp/cb \\
        --dataset /tmp/cb/imagenet-6000.fb --throttle 75,750 --rounds 2

(``--data``: the directory served, as peers_bench's ``--out``; ``--dataset`` a packed
dataset under it.)  ``forebay calibrate`` measures two of these points (a random
subset and every record of a range); the simulator interpolates between them.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # _common
from _common import evict, machine, paced  # noqa: E402

SHARES = (0.25, 0.39, 0.5, 1.0)


def main() -> None:
    import forebay

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--throttle", default="75,750", help="MBPS,IOPS of the paced file system")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}")
    with paced(a.data, a.throttle) as fs:
        print(f"# {fs.describe()}")
        path = fs.path(a.dataset)
        ds = forebay.open_dataset(path)
        files = [path / s.data for s in ds.manifest.shards]
        rng = np.random.default_rng(0)
        print("| round | share of the records | records | records' MB/s | served / records' "
              "bytes | requests per record |\n|---:|---:|---:|---:|---:|---:|")
        for r in range(a.rounds):
            for share in SHARES[r % 2::1] + SHARES[:r % 2]:      # the order turned each round
                evict(files)
                ids = rng.permutation(len(ds))[:int(round(share * len(ds)))]
                nbytes = int(ds.sample_nbytes[ids].sum())
                fresh = forebay.open_dataset(path)
                b0, q0 = fs.served_bytes, fs.requests
                t0 = time.perf_counter()
                for k in range(0, len(ids), 64):
                    fresh.get_many(ids[k:k + 64])
                dt = time.perf_counter() - t0
                served, reqs = fs.served_bytes - b0, fs.requests - q0
                print(f"| {r} | {share:.2f} | {len(ids)} | {nbytes / dt / 1e6:.1f} | "
                      f"{served / nbytes:.3f} | {reqs / len(ids):.2f} |", flush=True)
                del fresh
                gc.collect()


if __name__ == "__main__":
    main()
