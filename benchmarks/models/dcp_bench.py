"""torch.distributed.checkpoint with its FileSystemWriter/Reader against DCP on a forebay
repository (issue L), side by side in one run, one process.

A model of ``--mib`` MiB in ``--layers`` equal layers; ten checkpoints, each after one
layer changed (a fine-tuning or a frozen-backbone run).  Measured per contender, in
rotating order over ``--reps`` rounds:

* blocked: the time ``dcp.save`` (sync) or ``dcp.async_save`` (async, until it
  returns) holds the training loop, per checkpoint (min and median over the ten;
  async: the previous save is let finish first, as when training between checkpoints
  outlasts a save);
* bytes written for the ten checkpoints (files on disk; the repository's new bytes);
* load: the latest checkpoint into preallocated tensors, page cache warm.

    python benchmarks/models/dcp_bench.py --dir /tmp/dcp-bench --mib 1024 --reps 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import machine  # noqa: E402

from forebay.models import open_repository  # noqa: E402
from forebay.models.dcp import Reader, Writer  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def run(kind: str, mode: str, root: Path, mib: int, layers: int, checkpoints: int) -> dict:
    n = mib * (1 << 20) // 4 // layers
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i:03d}.weight": torch.randn(n, generator=g) for i in range(layers)}
    out = root / f"{kind}-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    blocked, pending = [], None
    for c in range(checkpoints):
        if c:
            sd[f"layer{c % layers:03d}.weight"] += 1.0       # one layer changed
        if kind == "dcp":
            target: dict = {"checkpoint_id": str(out / f"step{c}")}
        else:
            target = {"storage_writer": Writer(f"file://{out / 'repo'}", "run")}
        if pending is not None:
            # training between checkpoints outlasts a save: the previous one is done
            pending.result()
        t0 = time.perf_counter()
        if mode == "async":
            pending = dcp.async_save(sd, no_dist=True, **target)
        else:
            dcp.save(sd, no_dist=True, **target)
        blocked.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    os.sync()
    written = dir_bytes(out)
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    if kind == "dcp":
        dcp.load(into, checkpoint_id=str(out / f"step{checkpoints - 1}"), no_dist=True)
    else:
        dcp.load(into, storage_reader=Reader(f"file://{out / 'repo'}", "run"), no_dist=True)
    load = time.perf_counter() - t0
    assert all(torch.equal(into[k], sd[k]) for k in sd)
    if kind == "forebay":
        repo = open_repository(f"file://{out / 'repo'}")
        stored = sum(repo.manifest("run", v)["new_bytes"] for v in repo.versions("run"))
        repo.close()
    else:
        stored = written
    shutil.rmtree(out, ignore_errors=True)
    return {"blocked": blocked, "written": written, "stored": stored, "load": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/dcp-bench"))
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--checkpoints", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    names = [("dcp", "sync"), ("forebay", "sync"), ("dcp", "async"), ("forebay", "async")]
    res: dict = {k: [] for k in names}
    for rep in range(a.reps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            r = run(*k, a.dir, a.mib, a.layers, a.checkpoints)
            res[k].append(r)
            print(f"rep {rep} {k[0]:<8} {k[1]:<5} blocked median "
                  f"{statistics.median(r['blocked']):.3f} s (first {r['blocked'][0]:.3f}), "
                  f"written {r['written'] / 2**30:.2f} GiB, load {r['load']:.3f} s", flush=True)
    base = a.mib / 1024 / a.layers
    print(f"\nmachine: {machine()}; model {a.mib} MiB in {a.layers} layers; {a.checkpoints} "
          f"checkpoints, one layer changed before each; one process; {a.reps} rounds")
    print(f"ideal bytes for the run: base + {a.checkpoints - 1} layers = "
          f"{(a.mib / 1024 + (a.checkpoints - 1) * base):.2f} GiB\n")
    print(f"| contender | blocked per checkpoint s, median (min) | bytes on disk, "
          f"{a.checkpoints} checkpoints | vs ideal | load latest s, median |"
          f"\n|---|---:|---:|---:|---:|")
    ideal = (a.mib + (a.checkpoints - 1) * a.mib / a.layers) * (1 << 20)
    for k in names:
        rs = res[k]
        bl = [statistics.median(r["blocked"][1:]) for r in rs]
        mn = [min(r["blocked"][1:]) for r in rs]
        wr = statistics.median(r["written"] for r in rs)
        print(f"| DCP {'FileSystemWriter' if k[0] == 'dcp' else 'on forebay'} {k[1]} | "
              f"{statistics.median(bl):.3f} ({min(mn):.3f}) | {wr / 2**30:.2f} GiB | "
              f"{wr / ideal:.2f}x | {statistics.median(r['load'] for r in rs):.3f} |")


if __name__ == "__main__":
    main()
