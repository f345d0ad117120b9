"""NoPFS Fig. 8 with forebay's simulator: the §6.1 scenarios on the Lassen-like system
(4 workers), every policy, at the paper's compute rate c = 64 MB/s and at a faster
accelerator's (c = 1,000 MB/s, where the file system starts to matter).

    python benchmarks/sim/sim_fig8.py --epochs 5 --json benchmarks/results/sim_fig8.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default="mnist,imagenet-1k,openimages,imagenet-22k,cosmoflow,"
                   "cosmoflow-512")
    p.add_argument("--compute", default="64,1000", help="c values, MB/s per worker")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--plots", type=Path, help="directory for one PNG per run")
    a = p.parse_args()

    from forebay.sim import POLICIES, lassen, simulate
    from forebay.sim._report import plot_policies
    from dataclasses import replace

    print(f"machine: {machine()}")
    runs = []
    for c in [float(x) for x in a.compute.split(",")]:
        sysm = replace(lassen(), compute_MBps=c)
        for ds in a.datasets.split(","):
            t0 = time.perf_counter()
            rep = simulate(sysm, ds, workers=a.workers, epochs=a.epochs, scale=a.scale)
            rep["wall_s"] = time.perf_counter() - t0
            runs.append(rep)
            if a.plots:
                a.plots.mkdir(parents=True, exist_ok=True)
                plot_policies(rep, str(a.plots / f"fig8-{ds}-c{int(c)}.png"))
            print(f"simulated {ds} c={c:g} in {rep['wall_s']:.1f} s", flush=True)
    names = list(POLICIES)
    print(f"\ntotal time relative to Perfect ({a.workers} workers, {a.epochs} epochs, lassen; "
          f"'-' = fails: dataset > aggregate RAM)\n")
    print("| c MB/s | dataset | " + " | ".join(n for n in names if n != "perfect")
          + " | Perfect |\n|---|---|" + "---:|" * len(names))
    for rep in runs:
        pol = rep["policies"]
        lo = pol["perfect"]["total_s"]
        cells = ["-" if pol[n]["failed"] else f"{pol[n]['total_s'] / lo:.2f}"
                 for n in names if n != "perfect"]
        hours = lo / 3600
        print(f"| {rep['system']['compute_MBps']:g} | {rep['workload']['dataset']} | "
              + " | ".join(cells) + f" | {hours:.2f} h |")
    print("\nPFS reads per sample over the run\n")
    print("| c MB/s | dataset | " + " | ".join(n for n in names if n != "perfect")
          + " |\n|---|---|" + "---:|" * (len(names) - 1))
    for rep in runs:
        pol = rep["policies"]
        cells = ["-" if pol[n]["failed"] else f"{pol[n]['pfs_reads_per_sample']:.2f}"
                 for n in names if n != "perfect"]
        print(f"| {rep['system']['compute_MBps']:g} | {rep['workload']['dataset']} | "
              + " | ".join(cells) + " |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
