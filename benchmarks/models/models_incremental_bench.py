"""Incremental checkpoints (issue E): a new version of a 1 GB model in which one of 100
layers changed, saved into a repository whose files were evicted from the page cache
(a checkpoint store on disk, not in memory), against writing the whole state dict with
torch.save (+ fsync), side by side, alternating.

    python benchmarks/models/models_incremental_bench.py --out /tmp/incr --versions 5
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import evict, files_under, machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/incr"))
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--layer-mb", type=int, default=10)
    p.add_argument("--versions", type=int, default=5)
    a = p.parse_args()

    import forebay.models as fm

    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    n = a.layer_mb * (1 << 20) // 4
    sd = {f"layer{i}.weight": torch.randn(n) for i in range(a.layers)}
    total = sum(t.numel() * 4 for t in sd.values())
    repo_path = a.out / "repo"
    repo = fm.open_repository(str(repo_path))
    repo.save("model", sd)
    repo.close()
    del repo
    fb, ts = [], []
    for v in range(a.versions):
        sd[f"layer{v % a.layers}.weight"] = torch.randn(n)
        evict(files_under(repo_path))
        gc.collect()
        repo = fm.open_repository(str(repo_path))
        t0 = time.perf_counter()
        repo.save("model", sd)
        fb.append(time.perf_counter() - t0)
        repo.close()
        del repo
        gc.collect()
        f = a.out / f"ckpt-{v}.pt"
        t0 = time.perf_counter()
        torch.save(sd, f)
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        ts.append(time.perf_counter() - t0)
        f.unlink()
    repo = fm.open_repository(str(repo_path))
    st = repo.stats()
    repo.close()
    print(f"machine: {machine()}")
    print(f"{a.layers} layers x {a.layer_mb} MB ({total / 1e9:.2f} GB), one layer changed per "
          f"version, {a.versions} versions; repository files evicted before each save")
    print("| | median s | min s | max s |\n|---|---:|---:|---:|")
    for name, xs in (("forebay save (new version, store cold)", fb),
                     ("torch.save of the whole state dict + fsync", ts)):
        print(f"| {name} | {np.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
    print(f"forebay / torch.save: {np.median(ts) / np.median(fb):.1f}x faster; stored "
          f"{st['stored_bytes'] / 1e9:.2f} GB for {st['logical_bytes'] / 1e9:.2f} GB of versions")


if __name__ == "__main__":
    main()
