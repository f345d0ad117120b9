"""Side-by-side A/B of two source trees' loaders on one dataset, warm page cache, one
process: an epoch of ``DataLoader`` in each mode (direct, preload, clairvoyant) with
the batch handed straight back (no collation: the store's path alone), alternating
which tree goes first.  Use it to check that a change moved nothing
(``git worktree add /tmp/old REV``, copy the built ``_native*.so`` into its src/forebay):

    python benchmarks/loader/loader_ab.py --old-src /tmp/old/src --new-src src DATASET
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SNIPPET = r"""
import json, sys, time
import forebay
from forebay.torch import DataLoader
path, mode, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
kw = {"ram_bytes": 1 << 34} if mode == "clairvoyant" else {}
dl = DataLoader(path, batch, mode=mode, prefetch=0, comm=None, collate_fn=lambda b: b.ids,
                progress=False, **kw)
if mode == "clairvoyant":
    dl.store.wait_filled()
n = 0
t = time.perf_counter()
for ids in dl:
    n += len(ids)
dt = time.perf_counter() - t
dl.close()
print(json.dumps({"seconds": dt, "samples": n, "code": forebay.__file__}))
"""


def run(src: str, path: str, mode: str, batch: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    out = subprocess.run([sys.executable, "-c", SNIPPET, path, mode, str(batch)], env=env,
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert Path(r["code"]).resolve().is_relative_to(Path(src).resolve()), r["code"]
    return r["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--old-src", required=True)
    ap.add_argument("--new-src", default="src")
    ap.add_argument("--modes", default="direct,preload,clairvoyant")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    trees = {"old": a.old_src, "new": a.new_src}
    print("| mode | old min / median s | new min / median s | new/old min | new/old median |")
    print("|---|---:|---:|---:|---:|")
    for mode in a.modes.split(","):
        times: dict[str, list[float]] = {"old": [], "new": []}
        for rep in range(a.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                times[name].append(run(trees[name], a.dataset, mode, a.batch))
        o, n = times["old"], times["new"]
        print(f"| {mode} | {min(o):.3f} / {statistics.median(o):.3f} | {min(n):.3f} / "
              f"{statistics.median(n):.3f} | {min(n) / min(o):.2f} | "
              f"{statistics.median(n) / statistics.median(o):.2f} |", flush=True)


if __name__ == "__main__":
    main()
