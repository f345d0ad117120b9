"""Held-out scenarios (issue R, item 3): forebay's simulator, in its default conserving
model and in the thesis model, next to the HDMLP thesis' own simulator on cases neither
was matched to, with the same sample sizes, workers, epochs and batch.

    # the thesis' simulator: the sim/ directory of github.com/alchemy315/NoPFS (f3901e9),
    # outside this repository, with a Python that has numpy, scipy, seaborn, pandas, tqdm
    python benchmarks/sim/sim_heldout.py --original /tmp/orig/sim \\
        --original-python /tmp/origvenv/bin/python > benchmarks/results/sim_heldout.txt

Without ``--original`` only forebay's two models run.  ``least``: the least time the
conserving run's reads allow whatever the schedule (each epoch at least its largest need:
compute, the PFS's bytes at the table's top rate, its requests, links, tiers); an
original time below it (marked ``*``) draws more from the file system than it has, for
the policies that read the same bytes in both (naive, staging, deepio, lbann).  The scenarios (``--cases``):

* ``thesis-c400``: Table 5.1's system and dataset (4 workers, 10,000 samples of
  normal(0.027, 0.01) MB, 10 epochs, batch 25) with compute at 400 MB/s per worker;
* ``8nodes``: the thesis' system at 8 workers, compute 300 MB/s, a 2 GB dataset (20,000
  samples of normal(0.1, 0.03) MB), 200 MB of RAM and 400 MB of SSD per worker, 5 epochs,
  t(8) = t(4) (the thesis' table stops at 4 readers);
* ``lassen16``: NoPFS §6.1's Lassen node at 16 workers with a current accelerator's
  compute (1,000 MB/s), 40,000 samples of normal(0.1077, 0.1) MB (ImageNet's sizes),
  100 MB of RAM and 200 MB of SSD per worker, 3 epochs, batch 32, t(16) = 4,787 MB/s
  (the original's own table).

The same script is the driver of the original (``--run-original CASE.json``, run by the
other Python): it imports only numpy and the original's modules.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: forebay's policy names -> the thesis' simulator's
ORIGINAL_NAMES = {
    "perfect": "Lower Bound", "naive": "Naive", "staging": "Staging Buffer",
    "deepio": "DeepIO (Ord.)", "deepio-opportunistic": "DeepIO (Opp.)",
    "parallel-staging": "Parallel Staging", "lbann": "LBANN (Dynamic)",
    "lbann-preload": "LBANN (Preloading)", "locality-aware": "Locality-Aware",
    "nopfs": "HDMLP",
}

#: name -> (preset, overrides of the System, dataset spec, workers, epochs, batch)
CASES = {
    "thesis-c400": ("hdmlp-thesis", {"compute_MBps": 400.0},
                    "normal:0.027,0.01,10000", 4, 10, 25),
    "8nodes": ("hdmlp-thesis", {"compute_MBps": 300.0, "ram_bytes": 200 * 10**6,
                                "ssd_bytes": 400 * 10**6,
                                # the thesis' table stops at 4 readers (the original
                                # fails above its largest entry): flat beyond
                                "pfs_MBps": {1: 66.0, 2: 86.0, 3: 129.0, 4: 146.0,
                                             8: 146.0}},
               "normal:0.1,0.03,20000", 8, 5, 25),
    "lassen16": ("lassen", {"compute_MBps": 1000.0, "ram_bytes": 100 * 10**6,
                            "ssd_bytes": 200 * 10**6,
                            # t(16) from the original's run_perfsim.py
                            "pfs_MBps": {1: 330.0, 2: 730.0, 4: 1540.0, 8: 2870.0,
                                         16: 4787.0}},
                 "normal:0.1077,0.1,40000", 16, 3, 32),
}


def _system(case: str, model: str):
    from dataclasses import replace

    from forebay.sim import load_system

    preset, over, *_ = CASES[case]
    sysm = replace(load_system(preset), **over)
    if model == "conserving":        # what a user gets with their own system file
        sysm = replace(sysm, model="conserving", tier_reads="shared")
    else:
        sysm = replace(sysm, model="thesis", tier_reads="per-read")
    return sysm


def _original_spec(case: str, sizes_path: str, seed: int) -> dict:
    """The original's PolicyExecutor arguments for the case, in its units (MB, MB/s)."""
    sysm = _system(case, "thesis")
    _, _, _, workers, epochs, batch = CASES[case]
    mem = {int(k): float(v) for k, v in sysm.mem_MBps.items()}
    ssd = {int(k): float(v) for k, v in sysm.ssd_read_MBps.items()} or {1: 1.0}
    link = sysm.pfs_client_MBps
    return {"sizes": sizes_path, "N": workers, "E": epochs, "B": batch * workers, "seed": seed,
            "storage_classes": {0: mem, 1: mem, 2: ssd},
            "p": {0: sysm.staging_threads, 1: sysm.ram_threads, 2: sysm.ssd_threads},
            "t": {int(k): float(v) for k, v in sysm.pfs_MBps.items()},
            "d": {0: sysm.staging_bytes / 1e6, 1: sysm.ram_bytes / 1e6,
                  2: sysm.ssd_bytes / 1e6},
            "b_fs": link if np.isfinite(link) else 1e12, "b_c": sysm.network_MBps,
            "beta": sysm.preprocess_MBps, "c": sysm.compute_MBps}


def run_original(spec_path: str) -> None:
    """In the original's Python: run every policy, print {name: runtime s} as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, os.getcwd())                         # the original's sim/
    from dataset.Dataset import Dataset                     # the original's modules
    from policies.BasePolicy import BasePolicy
    from policies.DeepIOPolicy import DeepIOPolicy
    from policies.FrequencyPrefetcher import FrequencyPrefetcher
    from policies.LBANNInMemoryStore import LBANNInMemoryStorePolicy
    from policies.LocalityAwareDataLoading import LocalityAwareDataLoadingPolicy
    from policies.ParallelDataStaging import ParallelStagingPolicy
    from policies.PerfectPrefetcher import PerfectPrefetcher
    from policies.PolicyExecutor import PolicyExecutor
    from policies.StagingPoolPrefetcher import StagingPoolPrefetcher

    policies = {
        "Naive": {"class": BasePolicy, "opts": {}},
        "Staging Buffer": {"class": StagingPoolPrefetcher, "opts": {}},
        "DeepIO (Ord.)": {"class": DeepIOPolicy, "opts": {"opportunistic_reordering": False}},
        "DeepIO (Opp.)": {"class": DeepIOPolicy, "opts": {"opportunistic_reordering": True}},
        "Parallel Staging": {"class": ParallelStagingPolicy, "opts": {}},
        "LBANN (Dynamic)": {"class": LBANNInMemoryStorePolicy, "opts": {"preloading": False}},
        "LBANN (Preloading)": {"class": LBANNInMemoryStorePolicy,
                               "opts": {"preloading": True}},
        "Locality-Aware": {"class": LocalityAwareDataLoadingPolicy, "opts": {}},
        "HDMLP": {"class": FrequencyPrefetcher, "opts": {"in_order": True}},
        "Lower Bound": {"class": PerfectPrefetcher, "opts": {}},
    }
    sizes = np.load(spec["sizes"]).tolist()
    config = {"synthetic": True, "synthetic_params": {
        "distribution": None, "loc": None, "scale": None, "samples": len(sizes),
        "min": 1.0, "max": 1.0}}
    ds = Dataset(config, spec["E"], spec["B"], spec["N"], "uniform", True, spec["seed"])
    ds.file_sizes = sizes
    ints = {k: {int(a): b for a, b in v.items()} for k, v in spec["storage_classes"].items()}
    ex = PolicyExecutor(policies, ds, spec["N"], {int(k): v for k, v in ints.items()},
                        {int(k): v for k, v in spec["p"].items()},
                        {int(k): v for k, v in spec["t"].items()},
                        {int(k): v for k, v in spec["d"].items()},
                        spec["b_fs"], spec["b_c"], spec["beta"], spec["c"], True)
    stats = ex.run()
    print(json.dumps({k: (v.get_run_time() if v is not None else None)
                      for k, v in stats.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--original", help="the thesis' simulator's sim/ directory")
    p.add_argument("--original-python", default=sys.executable)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--run-original", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run_original:
        run_original(a.run_original)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
    from _common import machine

    from forebay.sim import simulate
    from forebay.sim._datasets import dataset_sizes

    print(f"machine: {machine()}")
    for case in a.cases.split(","):
        _, _, dataset, workers, epochs, batch = CASES[case]
        print(f"\n{case}: {dataset} MB, {workers} workers, {epochs} epochs, batch {batch}, "
              f"system {_system(case, 'conserving')}")
        res = {}
        for model in ("conserving", "thesis"):
            t0 = time.perf_counter()
            res[model] = simulate(_system(case, model), dataset, workers=workers,
                                  epochs=epochs, batch=batch, seed=a.seed)["policies"]
            print(f"  forebay {model}: {time.perf_counter() - t0:.1f} s")
        orig: dict = {}
        if a.original:
            sizes, _ = dataset_sizes(dataset, seed=a.seed)
            with tempfile.TemporaryDirectory() as tmp:
                np.save(f"{tmp}/sizes.npy", sizes / 1e6)
                spec = _original_spec(case, f"{tmp}/sizes.npy", a.seed)
                Path(f"{tmp}/case.json").write_text(json.dumps(spec))
                t0 = time.perf_counter()
                out = subprocess.run(
                    [a.original_python, os.path.abspath(__file__), "--run-original",
                     f"{tmp}/case.json"], cwd=a.original, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"the original simulator failed:\n{out.stderr[-3000:]}")
                orig = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"  original: {time.perf_counter() - t0:.1f} s")
        print(f"  {'policy':22s} {'original':>9s} {'thesis':>9s} {'conserving':>10s} "
              f"{'thesis/orig':>11s} {'cons/orig':>9s} {'least':>6s} {'bound':>14s}")
        for pol in res["conserving"]:
            c, t = res["conserving"][pol], res["thesis"][pol]
            o = orig.get(ORIGINAL_NAMES.get(pol, ""))

            def cell(x, w=9):
                return f"{x:{w}.2f}" if x is not None else f"{'fails':>{w}s}"

            def ratio(x, o=o):
                return f"{100 * (x / o - 1):+.1f}%" if x is not None and o else ""

            # the least time the conserving run's reads allow: each epoch at least its
            # largest need (compute, PFS bytes at the table's top rate, ...)
            least = c["compute_s"] / c["au_bound"] if c.get("au_bound") else None
            below = "*" if o is not None and least is not None and o < least * 0.999 else " "
            print(f"  {pol:22s} {cell(o)}{below}{cell(t['total_s'])} {cell(c['total_s'], 10)} "
                  f"{ratio(t['total_s']):>11s} {ratio(c['total_s']):>9s} "
                  f"{'' if least is None else f'{least:6.2f}':>6s} "
                  f"{c.get('binding') or '':>14s}")
        print("  * below the least time the file system's table allows for the same reads")


if __name__ == "__main__":
    main()
