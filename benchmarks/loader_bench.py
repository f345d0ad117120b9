"""Data-loading benchmark after DDStore Sec. 4: PFF / HDF5 through torch DataLoader +
DistributedSampler, against forebay's preloaded DistributedStore, under real mpiexec.

Per-sample loading latency (DDStore Table 2) and epoch throughput (Table 3) with 2 and 4
ranks, the source files evicted from the page cache before every epoch; optionally an
emulated parallel file system (per-open latency, per-reader and aggregate bandwidth caps
from NoPFS Sec. 6.1, Lassen).  The no-I/O bound runs the same loop on batches already in
memory.

    python benchmarks/loader_bench.py --out .demo/loader --ranks 2,4 --samples 20000
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import evict, files_under, machine  # noqa: E402

#: NoPFS Sec. 6.1 (Lassen): aggregate PFS read bandwidth with n concurrent readers, MB/s
LASSEN_MBPS = {1: 330, 2: 730, 4: 1540, 8: 2870}


# -- emulated parallel file system ----------------------------------------------------------
class EmulatedPFS:
    """Adds ``open_latency`` per open and caps each reader at ``t(n)/n`` bytes/s, n = the
    number of concurrent readers (ranks), by sleeping the difference after real reads."""

    def __init__(self, readers: int, open_latency: float) -> None:
        n = max(k for k in LASSEN_MBPS if k <= max(readers, 1))
        self.rate = LASSEN_MBPS[n] * 1e6 * (readers / n if readers > n else 1) / readers
        self.open_latency = open_latency

    def charge(self, nbytes: int, opens: int, elapsed: float) -> None:
        need = opens * self.open_latency + nbytes / self.rate
        if need > elapsed:
            time.sleep(need - elapsed)


PFS: "EmulatedPFS | None" = None


def _read_file(path: Path) -> bytes:
    t0 = time.perf_counter()
    data = path.read_bytes()
    if PFS is not None:
        PFS.charge(len(data), 1, time.perf_counter() - t0)
    return data


# -- baselines: torch Dataset + DistributedSampler -------------------------------------------
def list_collate(samples):
    """What a user does without forebay (PyG Batch.from_data_list in spirit): a
    per-sample loop concatenating node and edge fields, shifting edge indices."""
    import torch

    xs, pos, ei, ea, ys, batch = [], [], [], [], [], []
    off = 0
    for k, s in enumerate(samples):
        n = s["x"].shape[0]
        xs.append(torch.as_tensor(s["x"]))
        pos.append(torch.as_tensor(s["pos"]))
        ei.append(torch.as_tensor(s["edge_index"]) + off)
        ea.append(torch.as_tensor(s["edge_attr"]))
        ys.append(torch.as_tensor(s["y"]))
        batch.append(torch.full((n,), k, dtype=torch.int64))
        off += n
    return {"x": torch.cat(xs), "pos": torch.cat(pos), "edge_index": torch.cat(ei, 1),
            "edge_attr": torch.cat(ea), "y": torch.stack(ys), "batch": torch.cat(batch)}


def pff_dataset(root: Path):
    import torch

    files = sorted(root.glob("*.pkl"))

    class PFF(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            return pickle.loads(_read_file(files[i]))
    return PFF(), files


def hdf5_dataset(path: Path):
    import h5py
    import torch

    class CFF(torch.utils.data.Dataset):
        def __init__(self):
            self.f = None  # opened lazily in the reading process, never before a fork

        def _open(self):
            self.f = h5py.File(path, "r")
            self.names = [n for n in self.f if not n.endswith("_offsets")]
            self.offs = {n: self.f[n + "_offsets"][:] for n in self.names
                         if n + "_offsets" in self.f}
            self.axes = {n: int(self.f[n + "_offsets"].attrs.get("axis", 0)) for n in self.offs}
            self.rows = self.f[self.names[0]].shape[0] if self.names[0] not in self.offs else \
                len(self.offs[self.names[0]]) - 1

        def __len__(self):
            if self.f is None:
                self._open()
            return self.rows

        def __getitem__(self, i):
            if self.f is None:
                self._open()
            t0 = time.perf_counter()
            out, nbytes = {}, 0
            for n in self.names:
                d = self.f[n]
                if n in self.offs:
                    a, b = self.offs[n][i], self.offs[n][i + 1]
                    out[n] = d[:, a:b] if self.axes[n] == 1 else d[a:b]
                else:
                    out[n] = d[i]
                nbytes += out[n].nbytes
            if PFS is not None:
                PFS.charge(nbytes, 0, time.perf_counter() - t0)
            return out
    return CFF(), [path]


# -- one rank's work ---------------------------------------------------------------------------
def worker(a) -> None:
    global PFS
    import torch
    from mpi4py import MPI

    import forebay
    from forebay.torch import DataLoader, default_collate

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    if a.pfs:
        PFS = EmulatedPFS(world, a.open_latency_ms / 1e3)
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
                k += int(b["y"].shape[0])
                if a.compute_ms:  # the accelerator's step: the host thread waits
                    time.sleep(a.compute_ms / 1e3)
            dt = time.perf_counter() - t0
            times.append(comm.allreduce(dt, op=MPI.MAX))
            count = comm.allreduce(k)
        return times, count

    if a.contender in ("pff", "hdf5"):
        ds, files = (pff_dataset(Path(a.pff)) if a.contender == "pff" else
                     hdf5_dataset(Path(a.hdf5)))
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank,
                                                      shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=sampler,
                                             num_workers=0, collate_fn=list_collate)

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
        evict_all(files_under(Path(a.packed)))
        comm.Barrier()
        t0 = time.perf_counter()
        dl = DataLoader(a.packed, bs, comm=comm, seed=0, epochs=epochs, width=width,
                        prefetch=a.prefetch, progress=False)
        res["preload_s"] = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        res["width"] = dl.store.width
        lat, remote = [], 0
        owners = dl.store.owner(lat_ids)
        for i in lat_ids.tolist():
            t0 = time.perf_counter()
            dl.store.get_many([i])
            lat.append(time.perf_counter() - t0)
        res["remote_fraction"] = float((owners != rank).mean())

        def it(e):
            dl.set_epoch(e)
            return iter(dl)
        times, count = timed_epochs(it, None)
        dl.close()
    elif a.contender == "no-io":
        # The same loader loop (prefetch thread, collation) with the fetch replaced by a
        # lookup of batches gathered into memory beforehand: no storage, no network.
        ds = forebay.open_dataset(a.packed)
        plan = forebay.AccessPlan(n, world, bs, epochs, 0)
        cached = {b.tobytes(): ds.get_many(b) for e in range(epochs)
                  for b in plan.batches(rank, e)}

        class InMemory(DataLoader):
            def _fetch(self, ids):
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
    p.add_argument("--kind", default="ising", choices=["ising", "molecules"])
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
        synthesize(a.kind, cff, a.samples, 0, format="cff", progress=True)
    if not packed.exists():
        ingest(get_source("pickle", pff, trust_pickle=True), packed, progress=True)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    print(f"machine: {machine()}\n{a.kind}: {a.samples} samples, per-rank batch {a.batch_size}, "
          f"{a.epochs} epochs, page cache evicted before every epoch, emulated compute "
          f"{a.compute_ms} ms/step", flush=True)
    results = []
    for ranks in [int(r) for r in a.ranks.split(",")]:
        contenders = [("pff", 0), ("hdf5", 0), ("forebay", 0)]
        if ranks > 2:
            contenders.append(("forebay", 2))
        else:
            contenders.append(("forebay", 1))
        contenders.append(("no-io", 0))
        for pfs in ([False, True] if a.pfs else [False]):
            for name, width in contenders:
                if pfs and name == "no-io":
                    continue
                cmd = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker",
                       "--contender", name, "--width", str(width), "--pff", str(pff),
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
                label = name + (f" width={r.get('width')}" if name == "forebay" else "")
                print(f"  {ranks} ranks {'PFS ' if pfs else ''}{label:<18} latency p50 "
                      f"{r['lat_p50_ms']:.3f} ms p99 {r['lat_p99_ms']:.3f} ms   epoch "
                      f"{r['samples_per_s']:,.0f} samples/s"
                      + (f" (preload {r['preload_s']:.1f} s)" if name == "forebay" else ""),
                      flush=True)
    print("\n| ranks | storage | loader | sample latency p50 / p95 / p99 ms | epoch samples/s "
          "| vs PFF | vs HDF5 | vs no-I/O bound | preload s |\n|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        same = [x for x in results if x["ranks"] == r["ranks"] and x["pfs"] == r["pfs"]]
        base = {x["contender"]: x["samples_per_s"] for x in same if x["contender"] != "forebay"}
        bound = next((x["samples_per_s"] for x in results if x["ranks"] == r["ranks"]
                      and x["contender"] == "no-io"), None)
        name = {"pff": "torch DataLoader, PFF pickles", "hdf5": "torch DataLoader, HDF5",
                "no-io": "no-I/O bound (batches in memory)"}.get(
            r["contender"], f"forebay preload, width {r.get('width')}")
        print(f"| {r['ranks']} | {'emulated PFS' if r['pfs'] else 'local disk, cold'} | {name} | "
              f"{r['lat_p50_ms']:.3f} / {r['lat_p95_ms']:.3f} / {r['lat_p99_ms']:.3f} | "
              f"{r['samples_per_s']:,.0f} | {r['samples_per_s'] / base['pff']:.1f}x | "
              f"{r['samples_per_s'] / base['hdf5']:.1f}x | "
              f"{r['samples_per_s'] / bound:.2f} | {r['preload_s']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
