"""A second job on the same node (issue U, item 5): its first epoch with forebay's
node-local cache, against its own warm epoch and against a cold start.

The dataset lies on a disk read-capped by a block-I/O cgroup (the slow shared file
system; root); the node cache on a tmpfs (the node-local device, not capped).  Each
job is a fresh process, in the cgroup, with the dataset's pages evicted first; it
reads two epochs (one process; ``--store direct`` or ``preload``) and touches every
byte; epoch 1 counts the loader's set-up (a preload's read).  Interleaved rounds: a
job without the cache (cold, then warm from the page cache), a first job with an
empty cache (it fills it), a second job with the cache filled.

    sudo .venv/bin/python benchmarks/loader/node_cache_bench.py --out /tmp/ncb \\
        --cache /dev/shm/forebay-ncb --samples 2000 --throttle 100 --rounds 3 \\
        [--store preload|clairvoyant]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import evict, files_under, imagenet_dataset, machine, throttled  # noqa: E402


def job(a: argparse.Namespace) -> None:
    """One job: two epochs; prints their seconds and the loader's stats as JSON."""
    import numpy as np

    from forebay.torch import Clairvoyant, DataLoader, Direct, Pipeline, Preload

    t0 = time.perf_counter()
    cache = a.cache or None
    store = {"direct": lambda: Direct(warm_files=False, node_cache=cache),
             "preload": lambda: Preload(overlap=False, node_cache=cache),
             # tiers that hold it all: the first epoch fills them (from the cache)
             "clairvoyant": lambda: Clairvoyant(ram_bytes=1 << 30, warm_files=False,
                                                node_cache=cache)}[a.store]()
    dl = DataLoader(a.data, 64, comm=None, seed=a.seed, epochs=2, store=store,
                    pipeline=Pipeline(collate_fn=lambda b: int(b.field("image").values.sum(dtype=np.uint64))))
    times = []
    for epoch in range(2):
        dl.set_epoch(epoch)
        if epoch:
            t0 = time.perf_counter()
        for _ in dl:
            pass
        times.append(time.perf_counter() - t0)
    st = dl.stats()
    dl.close()
    print("RESULT " + json.dumps({"epochs": times, "pfs_bytes": st["pfs_bytes"],
                                  "hits": st.get("node_cache_hits", 0)}))


def run_job(a: argparse.Namespace, dev, cache: str, seed: int, cold: bool = True) -> dict:
    if cold:
        evict(files_under(a.out / "data.fb"))
    cmd = [sys.executable, __file__, "--worker", "--data", str(a.out / "data.fb"),
           "--cache", cache, "--seed", str(seed), "--store", a.store]
    cmd = dev.wrap(cmd) if dev is not None else cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-ncb"))
    p.add_argument("--cache", default="/dev/shm/forebay-ncb")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--throttle", default="100", help="MBPS[,IOPS] of the dataset's disk")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--store", choices=("direct", "preload", "clairvoyant"), default="direct")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.worker:
        job(a)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    imagenet_dataset(a.out / "data.fb", a.samples)
    size = sum(f.stat().st_size for f in files_under(a.out / "data.fb"))
    rows: dict[str, list[float]] = {k: [] for k in (
        "cold start, epoch 1", "warm epoch (page cache)",
        "new job, every file in the page cache, epoch 1", "first job with the cache, epoch 1",
        "second job with the cache, epoch 1", "second job with the cache, epoch 2")}
    with throttled(a.out, a.throttle) as dev:
        for r in range(a.rounds):
            shutil.rmtree(a.cache, ignore_errors=True)
            # "memory": a new job whose files are all in the page cache already (the
            # job just before read them): the best a new process's first epoch gets
            for kind in ("none", "memory", "fill", "reuse"):   # "reuse" after "fill"
                res = run_job(a, dev, "" if kind in ("none", "memory") else a.cache, seed=r,
                              cold=kind != "memory")
                if kind == "none":
                    rows["cold start, epoch 1"].append(res["epochs"][0])
                    rows["warm epoch (page cache)"].append(res["epochs"][1])
                elif kind == "memory":
                    rows["new job, every file in the page cache, epoch 1"].append(
                        res["epochs"][0])
                elif kind == "fill":
                    rows["first job with the cache, epoch 1"].append(res["epochs"][0])
                else:
                    assert res["pfs_bytes"] == 0, res
                    rows["second job with the cache, epoch 1"].append(res["epochs"][0])
                    rows["second job with the cache, epoch 2"].append(res["epochs"][1])
                print(f"round {r} {kind}: {res}", flush=True)
    shutil.rmtree(a.cache, ignore_errors=True)
    warm = statistics.median(rows["warm epoch (page cache)"])
    print(f"\nmachine: {machine()}; store {a.store}; {a.samples:,} ImageNet-sized blobs, "
          f"{size / 1e6:.0f} MB; "
          f"{dev.describe() if dev else 'no throttle'}; cache on {a.cache}; "
          f"{a.rounds} rounds, each job a fresh process with the dataset evicted")
    print("| epoch | seconds, median (min) | speed vs the warm epoch, median |")
    print("|---|---:|---:|")
    for k, v in rows.items():
        print(f"| {k} | {statistics.median(v):.2f} ({min(v):.2f}) | "
              f"{warm / statistics.median(v):.2f}x |")


if __name__ == "__main__":
    main()
