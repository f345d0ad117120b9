"""Preload set-up against the device: reading the same bytes with large sequential reads
(issue O).

Under ``mpiexec -n R``, each round (files evicted from the page cache before each
contender, contenders in alternating order):

* ``sequential read``: each rank reads its share of the dataset's shard files (the
  bytes split evenly, contiguous) with 64 MiB ``preadv`` calls into a fresh buffer:
  the device's bandwidth as a user program gets it, page faults included;
* ``DistributedStore``: the preloaded store's whole set-up (agreement, layout,
  shared-memory window, reads, barrier), 4 reads of 16 MiB in flight per rank (the
  default), and with 1 (one sequential stream, as before);
* ``DistributedStore, verify_on_read``: the same with every record checked once.

Reported: seconds (slowest rank), the aggregate bandwidth, and the store's ratio to
the sequential read, min and median over rounds.

    mpiexec -n 2 python benchmarks/store/preload_bench.py /tmp/peers-run/imagenet-10240.fb
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import evict, files_under, machine  # noqa: E402

BLOCK = 64 << 20


def sequential(files: list[Path], rank: int, world: int) -> int:
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buf = np.empty(hi - lo, dtype=np.uint8)
    pos, done = 0, 0
    for p, n in zip(files, sizes):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                off = a - pos
                while off < b - pos:
                    k = min(BLOCK, b - pos - off)
                    got = os.preadv(fd, [buf[done:done + k].data], off)
                    if got <= 0:
                        raise OSError(f"{p}: short read")
                    off += got
                    done += got
            finally:
                os.close(fd)
        pos += n
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from mpi4py import MPI

    import forebay
    from forebay.store import DistributedStore

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    data = forebay.open_dataset(args.dataset)
    files = [Path(data.shard_path(k)) for k in range(len(data.manifest.shards))]
    nbytes = sum(p.stat().st_size for p in files)

    def cold() -> None:
        if rank == 0:
            evict(files_under(args.dataset))
        comm.Barrier()

    def run(name: str):
        cold()
        t0 = time.perf_counter()
        if name == "sequential read":
            sequential(files, rank, world)
        else:
            ds = forebay.open_dataset(args.dataset, verify_on_read="verify" in name)
            st = DistributedStore(ds, comm, progress=False,
                                  read_threads=1 if "1 read thread" in name else 4)
        comm.Barrier()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if name != "sequential read":
            st.close()
        return dt

    names = ["sequential read", "DistributedStore", "DistributedStore, 1 read thread",
             "DistributedStore, verify_on_read"]
    res: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            res[n].append(run(n))
    if rank == 0:
        print(f"# preload_bench: {args.dataset} ({nbytes / 2**20:.0f} MiB in {len(files)} "
              f"shard file(s)), {world} ranks, {args.rounds} rounds; {machine()}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        base = res["sequential read"]
        print("| contender | s, min / median | MiB/s, median | vs sequential read, min / "
              "median |\n|---|---:|---:|---:|")
        for n in names:
            v = res[n]
            ratios = [a / b for a, b in zip(v, base)]
            print(f"| {n} | {min(v):.2f} / {np.median(v):.2f} | "
                  f"{nbytes / np.median(v) / 2**20:,.0f} | {min(ratios):.2f} / "
                  f"{np.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
