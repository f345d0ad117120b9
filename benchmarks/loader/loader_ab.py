"""Side-by-side A/B of two source trees' loaders on one dataset, warm page cache, one
process: an epoch of ``DataLoader`` in each mode (direct, preload, clairvoyant) with
the batch handed straight back (no collation: the store's path alone), alternating
which tree goes first.  Use it to check that a change moved nothing
(``git worktree add /tmp/old REV``, copy the built ``_native*.so`` into its src/forebay):

    python benchmarks/loader/loader_ab.py --old-src /tmp/old/src --new-src src DATASET
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import ab_table, run_in_tree  # noqa: E402

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
    times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for mode in a.modes.split(","):
        for rep in range(a.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                r = run_in_tree(trees[name], SNIPPET, a.dataset, mode, a.batch)
                times[name].setdefault(mode, []).append(r["seconds"])
    print(ab_table("mode", times))


if __name__ == "__main__":
    main()
