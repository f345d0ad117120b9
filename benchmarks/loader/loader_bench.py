"""Data-loading benchmark after DDStore Sec. 4: PFF / HDF5 through torch DataLoader +
DistributedSampler, against forebay's preloaded DistributedStore, under real mpiexec.

Per-sample loading latency (DDStore Table 2) and epoch throughput (Table 3) with 2 and 4
ranks, the source files evicted from the page cache before every epoch; optionally an
emulated parallel file system (per-open latency, per-reader and aggregate bandwidth caps
from NoPFS Sec. 6.1, Lassen).  The no-I/O bound runs the same loop on batches already in
memory.

    python benchmarks/loader/loader_bench.py --out .demo/loader --ranks 2,4 --samples 20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import evict, files_under, machine  # noqa: E402
import _baselines  # noqa: E402
from _baselines import (EmulatedPFS, hdf5_dataset, image_collate,  # noqa: E402
                        image_folder_dataset, list_collate, pff_dataset, write_image_cff)

# -- one rank's work ---------------------------------------------------------------------------
def worker(a) -> None:
    import torch
    from mpi4py import MPI

    import forebay
    from forebay.torch import DataLoader, default_collate, Pipeline, store_settings

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    if a.pfs:
        _baselines.PFS = EmulatedPFS(world, a.open_latency_ms / 1e3)
    bs, epochs = a.batch_size, a.epochs
    rng = np.random.default_rng(100 + rank)
    res = {"contender": a.contender, "ranks": world, "batch_size": bs, "pfs": a.pfs,
           "compute_ms": a.compute_ms}
    n = len(forebay.open_dataset(a.packed))
    lat_ids = rng.choice(n, a.latency_samples, replace=False)

    def evict_all(files):
        if rank == 0:
            evict(files)
        comm.Barrier()

    def timed_epochs(make_iter, files):
        times, count = [], 0
        for e in range(epochs):
            if files:
                evict_all(files)
            comm.Barrier()
            t0 = time.perf_counter()
            k = 0
            for b in make_iter(e):
                k += int(b[label_key].shape[0])
                if a.compute_ms:  # the accelerator's step: the host thread waits
                    time.sleep(a.compute_ms / 1e3)
            dt = time.perf_counter() - t0
            times.append(comm.allreduce(dt, op=MPI.MAX))
            count = comm.allreduce(k)
        return times, count

    images = a.kind == "imagenet"
    label_key = "label" if images else "y"
    if a.contender in ("pff", "hdf5"):
        if a.contender == "pff":
            ds, files = image_folder_dataset(Path(a.pff)) if images else pff_dataset(Path(a.pff))
        else:
            ds, files = hdf5_dataset(Path(a.hdf5))
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank,
                                                      shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=0,
                                             collate_fn=image_collate if images else list_collate)

        def it(e):
            sampler.set_epoch(e)
            return iter(loader)
        evict_all(files)
        lat = []
        for i in lat_ids.tolist():
            t0 = time.perf_counter()
            ds[i]
            lat.append(time.perf_counter() - t0)
        times, count = timed_epochs(it, files)
        res["preload_s"] = 0.0
    elif a.contender.startswith("forebay"):
        width = None if a.width == 0 else a.width
        transport = "rma" if a.contender == "forebay-rma" else "auto"
        evict_all(files_under(Path(a.packed)))
        comm.Barrier()
        t0 = time.perf_counter()
        hook = None
        if _baselines.PFS is not None:  # the store's reads of the files pay the same PFS
            hook = lambda nbytes, n, dt: _baselines.PFS.charge(nbytes, 0, dt)  # noqa: E731
        mode, ram, ssd, ssd_dir = "preload", None, 0, None
        if a.contender.startswith("forebay-cv"):  # clairvoyant, tiers sized by share
            from forebay.store import tier_nbytes

            shares = [float(x) for x in a.contender.split(":")[1:]]
            share = shares[0]
            mode = "clairvoyant"
            need = tier_nbytes(forebay.open_dataset(a.packed)).sum()
            ram = int(need * share / world)
            if len(shares) > 1:  # an SSD tier in a directory on the local disk
                ssd = int(need * shares[1] / world)
                ssd_dir = str(Path(a.packed).parent / "ssd-tier")
                os.makedirs(ssd_dir, exist_ok=True)
            transport = "auto"
        # "rma" forces the cross-node path (MPI_Get) on this single node
        dl = DataLoader(a.packed, bs, comm=comm, seed=0, epochs=epochs, progress=False,
                        store=store_settings(mode, width=width, transport=transport,
                                             ram_bytes=ram, ssd_dir=ssd_dir, ssd_bytes=ssd,
                                             on_pfs_read=hook),
                        pipeline=Pipeline(prefetch=a.prefetch))
        res["preload_s"] = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        res["transport"] = dl.store.transport
        if mode == "preload":
            res["width"] = dl.store.width
            # DDStore Table 2: one sample at a time, from a peer's memory when width > 1
            owners = dl.store.owner(np.arange(n))
            pool = np.flatnonzero(owners != rank) if dl.store.width > 1 else np.arange(n)
            lat = []
            for i in rng.choice(pool, a.latency_samples, replace=False).tolist():
                t0 = time.perf_counter()
                dl.store.get_many([i])
                lat.append(time.perf_counter() - t0)
            res["latency_of"] = "remote samples" if dl.store.width > 1 else "local samples"
        else:
            res["ram_share"] = share
            res["ssd_share"] = ssd and shares[1]
            lat = [0.0]  # the run starts cold: single-sample latency is not its figure

        def it(e):
            dl.set_epoch(e)
            return iter(dl)
        times, count = timed_epochs(it, None)
        st = dl.stats()
        res["stall_s"] = comm.allreduce(st["stall_seconds"], op=MPI.MAX)
        res["pfs_reads"] = comm.allreduce(st["pfs_reads"])
        src = st["fetches_by_source"]
        res["fetches_by_source"] = {k: comm.allreduce(src.get(k, 0))
                                    for k in ("local", "peer", "pfs")}
        dl.close()
    elif a.contender == "no-io":
        # The same loader loop (prefetch thread, collation) with the fetch replaced by a
        # lookup of batches gathered into memory beforehand: no storage, no network.
        ds = forebay.open_dataset(a.packed)
        plan = forebay.AccessPlan(n, world, bs, epochs, 0)
        cached = {b.tobytes(): ds.get_many(b) for e in range(epochs)
                  for b in plan.batches(rank, e)}

        class InMemory(DataLoader):
            def _fetch(self, ids, *_):
                return default_collate(cached[ids.tobytes()])

        dl = InMemory(a.packed, bs, comm=comm, seed=0, epochs=epochs, mode="direct",
                      prefetch=a.prefetch)
        lat = [0.0]

        def it(e):
            dl.set_epoch(e)
            return iter(dl)
        times, count = timed_epochs(it, None)
        res["preload_s"] = 0.0
    else:
        raise SystemExit(f"unknown contender {a.contender}")
    every = comm.gather(lat, root=0)
    if rank == 0:
        lat = np.concatenate(every) * 1e3
        res.update({"lat_p50_ms": float(np.percentile(lat, 50)),
                    "lat_p95_ms": float(np.percentile(lat, 95)),
                    "lat_p99_ms": float(np.percentile(lat, 99)),
                    "epoch_s": times, "samples_per_epoch": count,
                    "samples_per_s": float(count / np.median(times))})
        print("RESULT " + json.dumps(res), flush=True)


# -- driver ----------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(".demo/loader"))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--kind", default="ising", choices=["ising", "molecules", "imagenet"],
                   help="imagenet: ~110 KB JPEG-sized blobs in an ImageFolder tree (PFF: one "
                   "file per image), HDF5 with all bytes in one dataset, no decoding anywhere")
    p.add_argument("--batch-size", type=int, default=128, help="per-rank batch (DDStore: 128)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--latency-samples", type=int, default=300)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--pfs", action="store_true", help="also run with the emulated PFS")
    p.add_argument("--open-latency-ms", type=float, default=0.5,
                   help="emulated PFS: cost of one open (an assumption, not from the papers)")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="emulated accelerator compute per step (the host sleeps, as it waits "
                   "on a GPU); 0 measures the loading pipeline alone")
    p.add_argument("--clairvoyant", action="store_true",
                   help="issue C set: preload vs clairvoyant with tiers of 1.2x and 0.5x the "
                   "dataset (per-epoch times, PFS reads, fetch sources)")
    p.add_argument("--json", type=Path)
    # worker mode (under mpiexec)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pff", help=argparse.SUPPRESS)
    p.add_argument("--hdf5", help=argparse.SUPPRESS)
    p.add_argument("--packed", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return

    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    pff, cff, packed = out / f"{a.kind}-pff", out / f"{a.kind}-cff", out / f"{a.kind}.fb"
    if not pff.exists():
        synthesize(a.kind, pff, a.samples, 0, progress=True)
    if not cff.exists():
        if a.kind == "imagenet":
            write_image_cff(pff, cff / f"{a.kind}.h5")
        else:
            synthesize(a.kind, cff, a.samples, 0, format="cff", progress=True)
    if not packed.exists():
        src = get_source("imagefolder", pff) if a.kind == "imagenet" else \
            get_source("pickle", pff, trust_pickle=True)
        ingest(src, packed, progress=True)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    print(f"machine: {machine()}\n{a.kind}: {a.samples} samples, per-rank batch {a.batch_size}, "
          f"{a.epochs} epochs, page cache evicted before every epoch, emulated compute "
          f"{a.compute_ms} ms/step", flush=True)
    results = []
    for ranks in [int(r) for r in a.ranks.split(",")]:
        contenders = [("pff", 0), ("hdf5", 0), ("forebay", 0), ("forebay-rma", 0)]
        if a.clairvoyant:
            contenders = [("pff", 0), ("hdf5", 0), ("forebay", 0),
                          ("forebay-cv:1.2", 0), ("forebay-cv:0.5", 0),
                          ("forebay-cv:0.3:1.0", 0)]
        if not a.clairvoyant:
            contenders.append(("forebay", 2) if ranks > 2 else ("forebay", 1))
        contenders.append(("no-io", 0))
        for pfs in ([False, True] if a.pfs else [False]):
            for name, width in contenders:
                if pfs and name == "no-io":
                    continue
                cmd = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker",
                       "--kind", a.kind, "--contender", name, "--width", str(width), "--pff", str(pff),
                       "--hdf5", str(cff / f"{a.kind}.h5"), "--packed", str(packed),
                       "--batch-size", str(a.batch_size), "--epochs", str(a.epochs),
                       "--latency-samples", str(a.latency_samples),
                       "--prefetch", str(a.prefetch), "--open-latency-ms", str(a.open_latency_ms),
                       "--compute-ms", str(a.compute_ms)]
                if pfs:
                    cmd.append("--pfs")
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if p.returncode != 0:
                    print(p.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{name} with {ranks} ranks failed")
                r = json.loads(next(line for line in p.stdout.splitlines()
                                    if line.startswith("RESULT "))[7:])
                results.append(r)
                label = name + (f" width={r.get('width')}" if name.startswith("forebay") else "")
                print(f"  {ranks} ranks {'PFS ' if pfs else ''}{label:<18} latency p50 "
                      f"{r['lat_p50_ms']:.3f} ms p99 {r['lat_p99_ms']:.3f} ms   epoch "
                      f"{r['samples_per_s']:,.0f} samples/s"
                      + (f" (preload {r['preload_s']:.1f} s)" if name.startswith("forebay") else ""),
                      flush=True)
    print("\n| ranks | storage | loader | sample latency p50 / p95 / p99 ms | epoch samples/s "
          "| vs PFF | vs HDF5 | vs no-I/O bound | preload s |\n|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        same = [x for x in results if x["ranks"] == r["ranks"] and x["pfs"] == r["pfs"]]
        base = {x["contender"]: x["samples_per_s"] for x in same}
        bound = next((x["samples_per_s"] for x in results if x["ranks"] == r["ranks"]
                      and x["contender"] == "no-io"), None)
        name = {"pff": "torch DataLoader, " + ("ImageFolder files" if a.kind == "imagenet"
                                               else "PFF pickles"),
                "hdf5": "torch DataLoader, HDF5",
                "no-io": "no-I/O bound (batches in memory)"}.get(
            r["contender"], f"forebay preload, width {r.get('width')}, {r.get('transport')}")
        if r["contender"].startswith("forebay-cv"):
            name = f"forebay clairvoyant, RAM {r['ram_share']}x dataset, {r['transport']}"
            if r.get("ssd_share"):
                name = (f"forebay clairvoyant, RAM {r['ram_share']}x + SSD "
                        f"{r['ssd_share']}x dataset, {r['transport']}")
        print(f"| {r['ranks']} | {'emulated PFS' if r['pfs'] else 'local disk, cold'} | {name} | "
              f"{r['lat_p50_ms']:.3f} / {r['lat_p95_ms']:.3f} / {r['lat_p99_ms']:.3f} | "
              f"{r['samples_per_s']:,.0f} | {r['samples_per_s'] / base['pff']:.1f}x | "
              f"{r['samples_per_s'] / base['hdf5']:.1f}x | "
              f"{r['samples_per_s'] / bound:.2f} | {r['preload_s']:.1f} |")
    print("\n| ranks | storage | loader | epoch 1 s | later epochs s (median) | stall s | "
          "PFS reads per sample, whole run | fetches local / peer / PFS |\n|---|---|---|---:|---:|---:|---:|---|")
    for r in results:
        t = r["epoch_s"]
        later = float(np.median(t[1:])) if len(t) > 1 else float("nan")
        reads = r.get("pfs_reads")
        per = f"{reads / a.samples:.2f}" if reads is not None else "1 per read"
        src = r.get("fetches_by_source")
        srcs = " / ".join(f"{src[k]:,}" for k in ("local", "peer", "pfs")) if src else "-"
        print(f"| {r['ranks']} | {'emulated PFS' if r['pfs'] else 'local disk, cold'} | "
              f"{r['contender']} | {t[0]:.2f} | {later:.2f} | {r.get('stall_s', float('nan')):.2f} | "
              f"{per} | {srcs} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
