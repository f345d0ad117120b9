"""The HDMLP thesis' simulator tables (Boehringer, ETH 2020, §5.2.2, Tables 5.1-5.4)
with forebay's simulator: published runtime, the thesis' own simulator where it was run
(``--original``), forebay, and each policy's ratio to the lower bound.

    python benchmarks/sim/sim_thesis.py --scale 0.1 > benchmarks/results/sim_thesis.txt

Table 5.1 always runs at full scale (10,000 samples); ``--scale`` shrinks Tables
5.2-5.4 (samples, RAM and SSD alike: the same case).  The thesis' simulator is the
``sim/`` directory of github.com/alchemy315/NoPFS (spcl/NoPFS has none); its Table 5.1
figures below were produced by running it outside this repository (commit f3901e9,
its PolicyExecutor with the thesis' parameters, seed 42): 20 s for Table 5.1, hours
for the larger tables, which is why they are not rerun here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import machine  # noqa: E402

#: (mean MB, sd MB, samples, epochs) and the published runtimes (s)
TABLES = {
    "5.1": ((0.027, 0.01, 10_000, 10), {
        "perfect": 7.30, "naive": 27.78, "nopfs": 7.78, "staging": 10.24, "deepio": 8.41,
        "deepio-opportunistic": 8.40, "parallel-staging": 10.11, "lbann": 7.71,
        "lbann-preload": 8.41, "locality-aware": 8.41}),
    "5.2": ((1.0, 0.1, 150_000, 10), {
        "perfect": 3825.66, "naive": 15130.54, "nopfs": 3836.12, "staging": 4982.27,
        "deepio": 4433.27, "deepio-opportunistic": 4432.90, "parallel-staging": 4972.65,
        "lbann": 4051.12, "lbann-preload": 4433.27, "locality-aware": 4433.27}),
    "5.3": ((2.0, 0.2, 300_000, 5), {
        "perfect": 7655.25, "naive": 30272.96, "nopfs": 7661.26, "staging": 9945.29,
        "deepio": 23948.24, "deepio-opportunistic": 8487.42, "parallel-staging": 9313.58,
        "locality-aware": 9314.33}),
    "5.4": ((3.0, 0.2, 400_000, 5), {
        "perfect": 15204.78, "naive": 60526.36, "nopfs": 16795.17, "staging": 19888.26,
        "deepio": 54122.52, "deepio-opportunistic": 16034.89, "parallel-staging": 16861.82,
        "locality-aware": 19082.99}),
}
#: the thesis' simulator rerun on this machine (Table 5.1 only; see the docstring)
ORIGINAL_5_1 = {"perfect": 7.33, "naive": 27.88, "nopfs": 7.81, "staging": 10.29,
                "deepio": 8.45, "deepio-opportunistic": 8.41, "parallel-staging": 10.16,
                "lbann": 7.72, "lbann-preload": 8.45, "locality-aware": 8.45}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=0.1, help="for Tables 5.2-5.4")
    p.add_argument("--tables", default="5.1,5.2,5.3,5.4")
    p.add_argument("--no-peer-reads", action="store_true",
                   help="what-if: every policy reads from the PFS where it would read a "
                        "peer's copy (as the thesis' simulator's NoPFS does)")
    a = p.parse_args()
    if a.no_peer_reads:
        import numpy as np

        from forebay.sim import _run
        from forebay.sim._engine import F_PFS
        _run.Run.peer_or_pfs = lambda self, src: np.full(np.shape(src), F_PFS)
        print("what-if: no reads from peers' copies (every such read from the PFS)")

    from forebay.sim import simulate

    print(f"machine: {machine()}")
    for name in a.tables.split(","):
        (mean, sd, count, epochs), pub = TABLES[name]
        scale = 1.0 if name == "5.1" else a.scale
        t0 = time.perf_counter()
        rep = simulate("hdmlp-thesis", f"normal:{mean},{sd},{count}", workers=4,
                       epochs=epochs, batch=25, scale=scale, seed=42)["policies"]
        took = time.perf_counter() - t0
        print(f"\nTable {name}: normal({mean}, {sd}) MB x {count:,} samples, {epochs} epochs, "
              f"scale {scale} ({took:.1f} s)")
        print(f"{'policy':22s} {'published':>10s} {'original':>9s} {'forebay':>10s} "
              f"{'error':>7s} {'pub/LB':>7s} {'forebay/LB':>10s}")
        lb_pub = pub["perfect"]
        lb = rep["perfect"]["total_s"]
        for pol, res in rep.items():
            t = res["total_s"]
            p_s = pub.get(pol)
            o = ORIGINAL_5_1.get(pol) if name == "5.1" else None
            if t is None:
                print(f"{pol:22s} {'' if p_s is None else f'{p_s:10.2f}':>10s} "
                      f"{'':>9s} {'fails':>10s}")
                continue
            t_full = t / scale
            err = "" if p_s is None else f"{100 * (t_full / p_s - 1):+.1f}%"
            print(f"{pol:22s} {'' if p_s is None else f'{p_s:10.2f}':>10s} "
                  f"{'' if o is None else f'{100 * (o / p_s - 1):+.1f}%':>9s} "
                  f"{t_full:10.2f} {err:>7s} "
                  f"{'' if p_s is None else f'{p_s / lb_pub:.3f}':>7s} {t / lb:10.3f}")


if __name__ == "__main__":
    main()
