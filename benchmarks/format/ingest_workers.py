"""``forebay ingest --workers 1`` against ``--workers 2``, side by side: each source
ingested with both, alternating which goes first, warm page cache (the sources stay in
memory after the first read), output to the same disk.

    python benchmarks/format/ingest_workers.py --out /tmp/iw --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import ab_table, machine  # noqa: E402

from forebay.dataset.sources import get_source, ingest  # noqa: E402
from forebay.synth import synthesize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/iw"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    src = {
        "npz (20 files of 1,000 MuMMI samples)": ("npz", "mummi", 20000, {"per_file": 1000}, {}),
        "hdf5 (one file, 20,000 Ising graphs)": ("hdf5", "ising", 20000, {"format": "cff"}, {}),
        "pickle (10,000 files)": ("pickle", "ising", 10000, {}, {"trust_pickle": True}),
    }
    # "old" = one worker, "new" = two: ab_table's columns
    times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for label, (kind, synth, n, sopt, gopt) in src.items():
        root = a.out / synth / kind
        if not root.exists():
            synthesize(synth, root, n, **sopt)
        for rep in range(a.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                dest = a.out / "ds"
                shutil.rmtree(dest, ignore_errors=True)
                t = time.perf_counter()
                ingest(get_source(kind, root, **gopt), dest, workers=1 if name == "old" else 2)
                times[name].setdefault(label, []).append(time.perf_counter() - t)
    print(machine())
    print("old = --workers 1, new = --workers 2")
    print(ab_table("source", times))


if __name__ == "__main__":
    main()
