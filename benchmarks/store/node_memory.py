"""Node memory of a loader against the bytes its store holds (issue O, item 2).

Under ``mpiexec -n R`` on one node: each rank reads its proportional set size
(``/proc/self/smaps_rollup``: Pss, and its anonymous, shared-memory and file-mapped
parts; Pss splits a shared page between the processes that map it, so the ranks' sum
is the node's memory) before building the loader and after ``--epochs`` epochs with
room for the whole dataset in RAM; rank 0 prints the growth summed over ranks against
the dataset's bytes (what a store that holds every sample once must hold)::

    mpiexec -n 2 python benchmarks/store/node_memory.py /tmp/peers-run/imagenet-10240.fb
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def pss() -> dict[str, int]:
    """This process's Pss and its parts, bytes."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
            out[k] = int(v.split()[0]) * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--modes", default="preload,preload-overlap,clairvoyant",
                    help="loader modes, comma-separated; clairvoyant:copy and "
                    "clairvoyant:pages name the RAM tier (ram_tier), preload:shm and "
                    "preload:pages the preload's transport")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    from mpi4py import MPI

    import forebay
    from forebay.torch import DataLoader, Pipeline, store_settings

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(a.dataset)
    held = int(ds.sample_nbytes.sum())
    if comm.rank == 0:
        print(f"{a.dataset}: {len(ds):,} samples, {held / 2**20:,.0f} MiB of samples; "
              f"{comm.size} ranks on one node; {time.strftime('%Y-%m-%d')}", flush=True)
        print("| mode | node Pss growth | of the samples' bytes | anon | shmem | file-mapped "
              "| seconds (set-up and epochs, slowest rank) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in a.modes.split(","):
        comm.Barrier()
        before = pss()
        t0 = time.perf_counter()
        overlap = mode == "preload-overlap"       # overlap_preload=True
        base, _, tier = mode.partition(":")       # clairvoyant:copy, clairvoyant:pages
        kw = {} if not tier else {"transport": tier} if base.startswith("preload") \
            else {"ram_tier": tier}                 # preload:shm, preload:pages
        dl = DataLoader(a.dataset, a.batch, comm=comm, seed=0, epochs=a.epochs, progress=False,
                        store=store_settings("preload" if overlap else base, overlap=overlap,
                                             ram_bytes=2 * held, **kw),
                        pipeline=Pipeline(collate_fn=lambda b: len(b.ids)))
        for e in range(a.epochs):
            dl.set_epoch(e)
            for _ in dl:
                pass
        dl.store.wait_filled()                   # an overlapped load has finished
        after = pss()
        sec = comm.reduce(time.perf_counter() - t0, op=MPI.MAX, root=0)
        grow = {k: after[k] - before.get(k, 0) for k in after}
        tot = comm.reduce(grow, op=lambda x, y: {k: x[k] + y[k] for k in x}, root=0)
        dl.close()
        if comm.rank == 0:
            mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
            print(f"| {mode} | {mib(tot['Pss'])} | {tot['Pss'] / held:.2f}x | "
                  f"{mib(tot.get('Pss_Anon', 0))} | {mib(tot.get('Pss_Shmem', 0))} | "
                  f"{mib(tot.get('Pss_File', 0))} | {sec:.2f} |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
