"""The same loader under mpiexec and torchrun, side by side (issue I).

Contenders, each a fresh job, interleaved in rotating order and repeated:

* ``mpiexec shm`` / ``mpiexec rma``: forebay's preloaded store over MPI;
* ``torchrun shm``: the same store under torchrun, the node's ranks sharing one
  /dev/shm segment;
* ``torchrun exchange``: under torchrun with the collective exchange forced (what a
  job across nodes uses; here on one node);
* ``torchrun torch DataLoader``: torch's DataLoader + DistributedSampler,
  ``num_workers=2`` per rank, over one file per sample (PFF pickles for graphs, an
  ImageFolder tree of blobs for images), what a user has without forebay.

Per-epoch time is the slowest rank's, after a first (warm-up) epoch; files are in the
page cache (no eviction): this measures the data plane, not the disk.  Reported as
ratios to ``mpiexec shm`` (min and median over repetitions).

    python benchmarks/launch/launchers_bench.py --out /tmp/launch --ranks 2,4 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import machine  # noqa: E402
from _baselines import (image_collate, image_folder_dataset, list_collate,  # noqa: E402
                        pff_dataset)

BIN = Path(sys.executable).parent
CONTENDERS = ("mpiexec shm", "mpiexec rma", "torchrun shm", "torchrun exchange",
              "torchrun torch DataLoader")


def worker(a) -> None:
    import torch

    images = a.kind == "imagenet"
    key = "label" if images else "y"
    if a.contender == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ds, _ = image_folder_dataset(Path(a.pff)) if images else pff_dataset(Path(a.pff))
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank,
                                                      shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=a.batch_size, sampler=sampler, num_workers=2,
            persistent_workers=True, prefetch_factor=4,
            collate_fn=image_collate if images else list_collate)

        def epoch(e: int) -> int:
            sampler.set_epoch(e)
            return sum(int(b[key].shape[0]) for b in loader)

        def slowest(dt: float) -> float:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)
        setup, transport = 0.0, "-"
        barrier = dist.barrier
    else:
        from forebay.torch import DataLoader, Preload
        from forebay.world import resolve_comm

        comm = resolve_comm()
        rank, world = comm.Get_rank(), comm.Get_size()
        t0 = time.perf_counter()
        dl = DataLoader(a.packed, a.batch_size, comm=comm, seed=0, epochs=a.epochs,
                        progress=False, store=Preload(transport=a.transport))
        setup = max(comm.allgather(time.perf_counter() - t0))
        transport = dl.store.stats()["transport"]

        def epoch(e: int) -> int:
            dl.set_epoch(e)
            return sum(int(b[key].shape[0]) for b in dl)

        def slowest(dt: float) -> float:
            return max(comm.allgather(dt))
        barrier = comm.Barrier
    times, count = [], 0
    for e in range(a.epochs):
        barrier()
        t0 = time.perf_counter()
        count = epoch(e)
        times.append(slowest(time.perf_counter() - t0))
    if rank == 0:
        print("RESULT " + json.dumps({"epoch_s": times, "setup_s": setup, "world": world,
                                      "transport": transport, "per_rank": count}), flush=True)


def command(contender: str, ranks: int, a, pff: Path, packed: Path) -> list[str]:
    launcher, what = contender.split(" ", 1)
    if launcher == "mpiexec":
        head = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable]
    else:
        head = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks)]
    kind = "torch" if what == "torch DataLoader" else "forebay"
    return head + [__file__, "--worker", "--contender", kind, "--transport",
                   what if kind == "forebay" else "auto", "--kind", a.kind, "--pff", str(pff),
                   "--packed", str(packed), "--batch-size", str(a.batch_size),
                   "--epochs", str(a.epochs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-launch"))
    p.add_argument("--kind", default="ising", choices=["ising", "imagenet"])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="the first is a warm-up")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--pff", help=argparse.SUPPRESS)
    p.add_argument("--packed", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    a.out.mkdir(parents=True, exist_ok=True)
    pff, packed = a.out / f"{a.kind}-{a.samples}-pff", a.out / f"{a.kind}-{a.samples}.fb"
    if not pff.exists():
        synthesize(a.kind, pff, a.samples, 0, progress=True)
    if not packed.exists():
        src = get_source("imagefolder", pff) if a.kind == "imagenet" else \
            get_source("pickle", pff, trust_pickle=True)
        ingest(src, packed, progress=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: dict[tuple[int, str], list[dict]] = {}
    for ranks in [int(r) for r in a.ranks.split(",")]:
        for rep in range(a.reps):
            order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[:rep % len(CONTENDERS)]
            for c in order:
                proc = subprocess.run(command(c, ranks, a, pff, packed), capture_output=True,
                                      text=True, timeout=1800, env=env)
                if proc.returncode != 0:
                    sys.exit(f"{c} with {ranks} ranks failed:\n{proc.stderr[-3000:]}")
                r = json.loads(next(line for line in proc.stdout.splitlines()
                                    if line.startswith("RESULT "))[7:])
                r["epoch"] = float(np.median(r["epoch_s"][1:]))
                runs.setdefault((ranks, c), []).append(r)
                print(f"{ranks} ranks rep {rep} {c:<26} epoch {r['epoch']:.3f} s "
                      f"({r['transport']}, setup {r['setup_s']:.2f} s)", flush=True)
    print(f"\nmachine: {machine()}; {a.kind}, {a.samples} samples, per-rank batch "
          f"{a.batch_size}, {a.epochs - 1} timed epochs after a warm-up, {a.reps} "
          f"repetitions interleaved")
    print("\n| ranks | contender | transport | epoch s, min / median | vs mpiexec shm, min "
          "| vs mpiexec shm, median |\n|---|---|---|---:|---:|---:|")
    for ranks in sorted({k[0] for k in runs}):
        base = [r["epoch"] for r in runs[(ranks, "mpiexec shm")]]
        for c in CONTENDERS:
            t = [r["epoch"] for r in runs[(ranks, c)]]
            print(f"| {ranks} | {c} | {runs[(ranks, c)][0]['transport']} | {min(t):.3f} / "
                  f"{statistics.median(t):.3f} | {min(t) / min(base):.2f} | "
                  f"{statistics.median(t) / statistics.median(base):.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "kind": a.kind,
                                      "runs": {f"{k[0]} {k[1]}": v for k, v in runs.items()}},
                                     indent=1))


if __name__ == "__main__":
    main()
