"""Peak memory and time of ``forebay analyze`` on a large trace (issue M, item 12).

Writes a trace of ``--steps`` training steps per rank with forebay's own recorder (per
step: a stall, ``--batch`` sample fetches, a dataset-file read, a compute region), then
runs ``forebay analyze`` on it in a child process ``--repeat`` times and reports the
child's peak RSS (``VmHWM``: ``ru_maxrss`` would count the parent's image before
``exec``) and wall time, with the trace's size.  Each rank is written by a process of
its own, as in a job::

    python benchmarks/trace/analyze_memory.py --steps 40000 --batch 64 --ranks 2

The events are laid out as a 2-rank loader's would be; their times are synthetic (the
analysis does not care where they came from).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_trace(directory: Path, rank: int, steps: int, batch: int, seed: int) -> Path:
    from forebay.trace import Recorder

    rng = np.random.default_rng(seed + rank)
    rec = Recorder(directory, rank=rank)
    t = 1000.0
    block = 2000                      # steps recorded per vectorised call
    for s0 in range(0, steps, block):
        k = min(block, steps - s0)
        n = k * batch
        stall = rng.exponential(0.002, k)
        comp = 0.01 + rng.exponential(0.001, k)
        start = t + np.concatenate([[0.0], np.cumsum(stall + comp)[:-1]])
        t = float(start[-1] + stall[-1] + comp[-1])
        item_t0 = np.repeat(start, batch) + rng.uniform(0, 1, n) * np.repeat(stall, batch)
        item_dur = rng.exponential(20e-6, n)
        ids = rng.integers(0, 1 << 20, n)
        src = rng.integers(0, 3, n)
        rec.items(ids, rng.integers(1000, 200000, n), item_t0, item_dur, src, 0,
                  rng.integers(0, 2, n))
        rec.file_reads("/data/train.fb/shard-0000.bin", rng.integers(0, 1 << 30, k),
                       np.full(k, 1 << 20), start, stall / 2, samples=batch)
        for i in range(k):
            rec.span("dataloader", "fetch.iter", start[i], start[i] + stall[i],
                     epoch=0, step=s0 + i)
            rec.span("compute", "compute", start[i] + stall[i],
                     start[i] + stall[i] + comp[i])
    path = rec.close()
    assert path is not None
    return path


def measure(trace: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of ``forebay analyze`` in a fresh process."""
    code = ("import re, sys, time\n"
            "from forebay.cli import main\n"
            "t = time.perf_counter()\n"
            "rc = main(['analyze', sys.argv[1]])\n"
            "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())\n"
            "print('RESULT', int(hwm.group(1)) / 1024, time.perf_counter() - t, rc, "
            "flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True,
                         text=True, check=True).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1].split()
    return float(line[1]), float(line[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="reuse or keep the trace here")
    ap.add_argument("--write-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write_rank is not None:
        write_trace(Path(a.dir), a.write_rank, a.steps, a.batch, seed=0)
        return
    d = Path(a.dir or tempfile.mkdtemp(prefix="forebay-bigtrace-"))
    d.mkdir(parents=True, exist_ok=True)
    if not list(d.glob("*.pfw.gz")):
        t = time.perf_counter()
        for r in range(a.ranks):
            subprocess.run([sys.executable, __file__, "--write-rank", str(r), "--dir", str(d),
                            "--steps", str(a.steps), "--batch", str(a.batch)], check=True)
        print(f"wrote the trace in {time.perf_counter() - t:.1f} s", flush=True)
    gz = sum(p.stat().st_size for p in d.glob("*.pfw.gz"))
    events = a.ranks * a.steps * (a.batch + 3)
    print(f"trace: {d}, {gz / 2**20:.1f} MiB gzip, about {events:,} events "
          f"({a.ranks} ranks x {a.steps:,} steps x {a.batch} samples)")
    for i in range(a.repeat):
        rss, sec = measure(d)
        print(f"run {i}: peak RSS {rss:,.0f} MiB, {sec:.1f} s", flush=True)
    if a.dir is None:
        import shutil
        shutil.rmtree(d)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
