"""Side-by-side A/B of two source trees' model repositories (LMDB store on local disk,
warm): a save of a fresh model, a full load into new tensors, a load in place and a 25%
partial load (its first call, and the best of the next two), each tree in its own
process, alternating which goes first.  Use it to check that a change moved nothing (``git worktree add /tmp/old REV``, copy the built
``_native*.so`` into its src/forebay):

    python benchmarks/models/models_ab.py --old-src /tmp/old/src --new-src src --mib 512
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import ab_table, run_in_tree  # noqa: E402

SNIPPET = r"""
import json, sys, time, torch
import forebay, forebay.models as fm
store, mib, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(seed)
n = mib * (1 << 20) // 4 // 40
sd = {f"layer{i:02d}.weight": torch.randn(n) for i in range(40)}
out = {"code": forebay.__file__}
with fm.open_repository(store) as r:
    t = time.perf_counter(); r.save("m", sd); out["save"] = time.perf_counter() - t
    t = time.perf_counter(); r.load("m"); out["load_new"] = time.perf_counter() - t
    t = time.perf_counter(); r.load("m", into=sd); out["load_in_place"] = time.perf_counter() - t
    part = []
    for _ in range(3):
        t = time.perf_counter(); r.load("m", include="layer0*"); part.append(time.perf_counter() - t)
    out["load_25pct_first"], out["load_25pct"] = part[0], min(part[1:])
print(json.dumps(out))
"""
OPS = ("save", "load_new", "load_in_place", "load_25pct_first", "load_25pct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", required=True)
    ap.add_argument("--new-src", default="src")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    trees = {"old": a.old_src, "new": a.new_src}
    times: dict[str, dict[str, list[float]]] = {t: {op: [] for op in OPS} for t in trees}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for rep in range(a.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                store = os.path.join(tmp, f"{name}-{rep}")
                r = run_in_tree(trees[name], SNIPPET, store, a.mib, rep)
                for op in OPS:
                    times[name][op].append(r[op])
    print(ab_table("operation", times))


if __name__ == "__main__":
    main()
