"""The simulator next to a measured run (issue G, items 4 and 6): predicted vs measured
time of the training run that ``benchmarks/loader/train_gnn.py --json`` recorded.

What is measured here, on this machine, and fed to the model (nothing is fitted to the
times under test except the compute rate c):
  * c, the training step's MB/s per worker: from the forebay run's time not stalled
    (the one figure taken from the run itself; the prediction under test for that
    run is its stall);
  * the preprocessing rate beta of each loader path, timed on warm data: forebay's
    ``get_many`` + ``default_collate``; for the torch baseline, ``Dataset.__getitem__``
    (open, read, unpickle) + the per-sample collate;
  * the "PFS": the demo's files sit in the page cache, so reads run at the RAM copy
    bandwidth (``forebay calibrate``'s [ram] table).
The torch DataLoader with ``num_workers=0`` is the model's *naive* policy (no
prefetching: fetch, decode, compute in turn); forebay's loader is
*forebay-clairvoyant* (or *forebay-preload*) with one prefetch thread.

    mpiexec -n 2 python benchmarks/loader/train_gnn.py ... --mode clairvoyant --json run.json
    python benchmarks/sim/sim_validate.py --train-json run.json

Second mode, ``--loader-json``: the runs of ``benchmarks/loader/loader_bench.py --pfs
--clairvoyant --compute-ms MS --json J`` on the emulated parallel file system (NoPFS
§6.1's t(gamma), one reader per rank, files evicted before every epoch): torch
DataLoader over PFF pickles (naive), forebay preload (forebay-preload) and clairvoyant
with RAM (and SSD) tiers (forebay-clairvoyant), with c from the emulated compute per
step and the file system's rate per reader the slower of the emulation and this disk's
cold reads (measured here, after eviction, for the packed shards and for the pickles).

    python benchmarks/loader/loader_bench.py --out .demo/loader --ranks 2 --pfs --clairvoyant \
        --compute-ms 2 --open-latency-ms 0 --epochs 3 --json loader.json
    python benchmarks/sim/sim_validate.py --loader-json loader.json --data .demo/loader
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _baselines import LASSEN_MBPS, list_collate, pff_dataset  # noqa: E402
from _common import evict, files_under, machine  # noqa: E402


def _rate(fn, batches, nbytes) -> float:
    """MB/s of fn over the batches (best of two passes: warm data)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def _cold_MBps(make_read, files, ids, nbytes, readers=(1, 2)) -> dict:
    """Aggregate MB/s of k threads each doing ``read(their share of ids)`` right after
    the files left the page cache, per reader count k (the "PFS" table t(k) of this
    disk, as forebay calibrate measures it).  ``make_read()`` is called after each
    eviction: pages an open memory map still holds cannot be evicted."""
    import gc
    import threading

    out = {}
    for k in readers:
        evict(files)
        read = make_read()
        parts = np.array_split(ids, k)
        ts = [threading.Thread(target=read, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out[k] = nbytes(ids) / (time.perf_counter() - t0) / 1e6
        del read, ts                # unmap before the next eviction
        gc.collect()
    return out


def _print_rows(rows, note: str) -> list:
    if note:
        print(note)
    print("| loader (measured) | simulated policy | measured s | predicted s | error | "
          "measured stall s | predicted stall s |\n|---|---|---:|---:|---:|---:|---:|")
    out = []
    for name, pol, mt, ms, pt, ps in rows:
        err = (pt - mt) / mt
        out.append({"loader": name, "policy": pol, "measured_s": mt, "predicted_s": pt,
                    "error": err, "measured_stall_s": ms, "predicted_stall_s": ps})
        print(f"| {name} | {pol} | {mt:.2f} | {pt:.2f} | {100 * err:+.0f}% | "
              + (f"{ms:.2f}" if ms is not None else "-") + f" | {ps:.2f} |")
    return out


def _fmt(table: dict) -> str:
    return ", ".join(f"{k}: {v:.0f}" for k, v in table.items())


def loader_mode(a) -> None:
    """Predicted vs measured for loader_bench's emulated-PFS runs."""
    import forebay
    from forebay.plan import AccessPlan
    from forebay.sim import System, Workload, simulate_policy
    from forebay.store import calibrate, tier_nbytes
    from forebay.torch import default_collate

    doc = json.loads(a.loader_json.read_text())
    kind = next(p.name[:-3] for p in a.data.glob("*.fb"))
    packed, pffdir = a.data / f"{kind}.fb", a.data / f"{kind}-pff"
    ds = forebay.open_dataset(packed)
    sizes = np.asarray(ds.sample_nbytes, dtype=np.int64)
    pds, files = pff_dataset(pffdir)
    psizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
    rng = np.random.default_rng(0)
    bs = doc["results"][0]["batch_size"]
    picks = [rng.choice(len(ds), bs, replace=False) for _ in range(a.batches)]
    beta_fb = _rate(lambda b: default_collate(ds.get_many(b)), picks,
                    sum(int(sizes[b].sum()) for b in picks))
    beta_pff = _rate(lambda b: list_collate([pds[int(i)] for i in b]), picks,
                     sum(int(psizes[b].sum()) for b in picks))
    # this disk's cold reads, one reader: packed batches and pickles one by one
    cold = rng.choice(len(ds), min(2000, len(ds)), replace=False)
    shards = files_under(packed)

    def packed_reader():
        fresh = forebay.open_dataset(packed)
        return lambda ids: [fresh.get_many(ids[k:k + bs]) for k in range(0, len(ids), bs)]
    disk_fb = _cold_MBps(packed_reader, shards, cold, lambda ids: int(sizes[ids].sum()))
    disk_pff = _cold_MBps(lambda: lambda ids: [files[int(i)].read_bytes() for i in ids], files,
                          cold, lambda ids: int(psizes[ids].sum()))
    mem = calibrate(threads=[1, 2], ram_bytes=64 << 20)["ram"]["copy_MBps"]
    prof = calibrate(threads=[1], ssd_dir=a.data, ssd_bytes=128 << 20, ram_bytes=8 << 20)
    ssd_r, ssd_w = prof["ssd"]["read_MBps"], prof["ssd"]["write_MBps"]
    need = int(tier_nbytes(ds).sum())
    rows = []
    for r in doc["results"]:
        if not r["pfs"] and r["contender"] != "no-io":
            continue
        n, epochs = r["ranks"], len(r["epoch_s"])
        plan = AccessPlan(len(ds), n, bs, epochs, seed=0)

        def system(disk, beta, sz, r=r, **kw) -> System:
            # the emulation's t(k), unless this disk is slower with k readers
            from forebay.store._model import interpolate

            pfs = {k: min(v, interpolate(disk, k)) for k, v in LASSEN_MBPS.items()}
            c = bs * sz.mean() / 1e6 / (r["compute_ms"] / 1e3) if r["compute_ms"] else 1e9
            return System(compute_MBps=c, preprocess_MBps=beta, network_MBps=max(mem.values()),
                          pfs_MBps=pfs, mem_MBps=mem, ssd_read_MBps=ssd_r,
                          ssd_write_MBps=ssd_w, staging_bytes=5 * bs * int(sz.mean()),
                          staging_threads=1, ram_threads=1, ssd_threads=1, **kw)
        measured = sum(r["epoch_s"]) + r.get("preload_s", 0.0)
        name = r["contender"]
        if name == "pff":
            wl = Workload(psizes, AccessPlan(len(psizes), n, bs, epochs, seed=0),
                          system(disk_pff, beta_pff, psizes))
            res, pol = simulate_policy("naive", wl), "naive"
        elif name == "no-io":
            wl = Workload(sizes, plan, system(disk_fb, beta_fb, sizes))
            res, pol = simulate_policy("perfect", wl), "perfect"
        elif name == "forebay":
            wl = Workload(sizes, plan, system(disk_fb, beta_fb, sizes, ram_bytes=need))
            res = simulate_policy("forebay-preload", wl)
            pol = f"forebay-preload (width {res.get('width')})"
        elif name.startswith("forebay-cv"):
            shares = [float(x) for x in name.split(":")[1:]]
            ssd = int(need * shares[1] / n) if len(shares) > 1 else 0
            wl = Workload(sizes, plan, system(disk_fb, beta_fb, sizes,
                                              ram_bytes=int(need * shares[0] / n),
                                              ssd_bytes=ssd))
            res, pol = simulate_policy("forebay-clairvoyant", wl), "forebay-clairvoyant"
        else:
            continue
        label = f"{name}, {n} ranks" + (", emulated PFS" if r["pfs"] else ", no I/O")
        rows.append((label, pol, measured, r.get("stall_s"), res["total_s"], res["stall_s"]))
    print(f"machine: {machine()}")
    out = _print_rows(rows, f"loader_bench runs ({doc['machine']}); beta forebay {beta_fb:.0f} "
                      f"MB/s, torch/PFF {beta_pff:.0f} MB/s; cold disk by readers: packed "
                      f"{_fmt(disk_fb)}, pickles {_fmt(disk_pff)} MB/s")
    errs = [abs(o["error"]) for o in out]
    print(f"mean |error| {100 * np.mean(errs):.0f}%, max {100 * max(errs):.0f}%")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "beta_forebay_MBps": beta_fb,
                                      "beta_pff_MBps": beta_pff, "disk_packed_MBps": disk_fb,
                                      "disk_pff_MBps": disk_pff, "rows": out}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-json", type=Path)
    p.add_argument("--loader-json", type=Path)
    p.add_argument("--data", type=Path, help="loader_bench's --out directory")
    p.add_argument("--batches", type=int, default=20, help="batches timed per loader path")
    p.add_argument("--json", type=Path, help="write predictions and errors")
    a = p.parse_args()
    if a.loader_json:
        if not a.data:
            raise SystemExit("--loader-json needs --data (loader_bench's --out directory)")
        loader_mode(a)
        return
    if not a.train_json:
        raise SystemExit("give --train-json or --loader-json")

    import forebay
    from forebay.plan import AccessPlan
    from forebay.sim import System, Workload, simulate_policy
    from forebay.store import calibrate
    from forebay.torch import default_collate

    run = json.loads(a.train_json.read_text())
    ranks, bs, epochs = run["ranks"], run["batch_size"], run["epochs"]
    ds = forebay.open_dataset(run["packed"])
    sizes = np.asarray(ds.sample_nbytes, dtype=np.int64)
    rng = np.random.default_rng(0)
    picks = [rng.choice(len(ds), bs, replace=False) for _ in range(a.batches)]

    # c: the forebay run's per-worker MB/s while not stalled
    fb_rows = run["runs"][run["forebay"]]
    plan = AccessPlan(len(ds), ranks, bs, epochs, seed=0)
    per_worker_mb = plan.steps_per_epoch * bs * sizes.mean() * epochs / 1e6
    compute_s = sum(r["seconds"] - r["stall_s"] for r in fb_rows)
    c = per_worker_mb / compute_s
    beta_fb = _rate(lambda b: default_collate(ds.get_many(b)), picks,
                    sum(int(sizes[b].sum()) for b in picks))
    mem = calibrate(threads=[1, 2], ram_bytes=64 << 20)["ram"]["copy_MBps"]
    base = System(compute_MBps=c, preprocess_MBps=beta_fb, network_MBps=max(mem.values()),
                  pfs_MBps=mem, mem_MBps=mem, staging_bytes=4 * bs * int(sizes.mean()),
                  ram_bytes=int(run.get("ram_bytes") or 0), ssd_bytes=0, staging_threads=1,
                  ram_threads=1, ssd_threads=1, name="this machine (warm page cache)")
    policy = "forebay-clairvoyant" if run["mode"] == "clairvoyant" else "forebay-preload"
    rows = []
    fb = simulate_policy(policy, Workload(sizes, plan, base))
    rows.append((run["forebay"], policy, sum(r["seconds"] for r in fb_rows),
                 sum(r["stall_s"] for r in fb_rows), fb["total_s"], fb["stall_s"]))

    baseline = next((k for k in run["runs"] if k.startswith("torch")), None)
    beta_pff = None
    if baseline and run.get("pff"):
        pds, files = pff_dataset(Path(run["pff"]))
        psizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
        beta_pff = _rate(lambda b: list_collate([pds[int(i)] for i in b]), picks,
                         sum(int(psizes[b].sum()) for b in picks))
        # the same compute per sample, expressed in the pickles' bytes
        sysp = replace(base, compute_MBps=c * psizes.mean() / sizes.mean(),
                       preprocess_MBps=beta_pff)
        nv = simulate_policy("naive", Workload(psizes, AccessPlan(len(psizes), ranks, bs,
                                                                  epochs, seed=0), sysp))
        rows.append((baseline, "naive", sum(r["seconds"] for r in run["runs"][baseline]),
                     sum(r["stall_s"] for r in run["runs"][baseline]), nv["total_s"],
                     nv["stall_s"]))
    print(f"machine: {machine()}")
    print(f"workload: {len(ds):,} samples ({sizes.sum() / 1e6:.1f} MB packed), {ranks} ranks x "
          f"batch {bs}, {epochs} epochs; c = {c:.2f} MB/s per worker (from the forebay run), "
          f"beta forebay {beta_fb:.0f} MB/s"
          + (f", beta torch/PFF {beta_pff:.1f} MB/s" if beta_pff else ""))
    out = _print_rows(rows, "")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "compute_MBps": c,
                                      "beta_forebay_MBps": beta_fb, "beta_pff_MBps": beta_pff,
                                      "rows": out}, indent=1))


if __name__ == "__main__":
    main()
