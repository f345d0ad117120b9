"""The simulator next to a measured run (issue G, items 4 and 6): predicted vs measured
time of the training run that ``benchmarks/train_gnn.py --json`` recorded.

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

    mpiexec -n 2 python benchmarks/train_gnn.py ... --mode clairvoyant --json run.json
    python benchmarks/sim_validate.py --train-json run.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baselines import list_collate, pff_dataset  # noqa: E402
from _common import machine  # noqa: E402


def _rate(fn, batches, nbytes) -> float:
    """MB/s of fn over the batches (best of two passes: warm data)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-json", type=Path, required=True)
    p.add_argument("--batches", type=int, default=20, help="batches timed per loader path")
    p.add_argument("--json", type=Path, help="write predictions and errors")
    a = p.parse_args()

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
    print("| loader (measured) | simulated policy | measured s | predicted s | error | "
          "measured stall s | predicted stall s |\n|---|---|---:|---:|---:|---:|---:|")
    out = []
    for name, pol, mt, ms, pt, ps in rows:
        err = (pt - mt) / mt
        out.append({"loader": name, "policy": pol, "measured_s": mt, "predicted_s": pt,
                    "error": err, "measured_stall_s": ms, "predicted_stall_s": ps})
        print(f"| {name} | {pol} | {mt:.2f} | {pt:.2f} | {100 * err:+.0f}% | {ms:.2f} | "
              f"{ps:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "compute_MBps": c,
                                      "beta_forebay_MBps": beta_fb, "beta_pff_MBps": beta_pff,
                                      "rows": out}, indent=1))


if __name__ == "__main__":
    main()
