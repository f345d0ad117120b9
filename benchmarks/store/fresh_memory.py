"""What a preload's set-up pays for on this machine: fresh memory against the page cache
(issue O, item 3).

One process, one file of ``--gib`` GiB (random bytes, made once under ``--work``),
contenders interleaved round by round, the file evicted from the page cache before
each cold read:

* ``fresh memory``: ``preadv`` of 16 MiB pieces into a fresh anonymous map (what the
  ``shm`` transport's window costs: every page faulted in and zeroed, then written);
* ``page cache``: ``MADV_POPULATE_READ`` over a read-only map of the file locked with
  ``mlock2(MLOCK_ONFAULT)`` (what the ``pages`` transport does; forebay's C kernel);
* ``map cached``: ``MADV_POPULATE_READ`` over a fresh, unlocked map of the file once
  it is cached (what every rank's mapping of the whole dataset costs after set-up).

Seconds per contender, cold (evicted first) and again with the file cached::

    python benchmarks/store/fresh_memory.py --work /tmp/fresh-memory --rounds 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import evict, machine  # noqa: E402

PIECE = 16 << 20


def _fresh(path: Path) -> object:
    size = path.stat().st_size
    dst = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        while at < size:
            at += os.preadv(fd, [dst[at:at + PIECE].data], at)
    finally:
        os.close(fd)
    return dst


def _map(path: Path, lock: bool) -> object:
    from forebay import _native

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    if lock:
        _native.lock_on_fault(mm)
    _native.populate(arr, np.array([0], dtype=np.int64), np.array([len(arr)], dtype=np.int64))
    return arr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/fresh-memory"))
    ap.add_argument("--gib", type=float, default=1.1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    path = a.work / f"blob-{a.gib}g.bin"
    size = int(a.gib * 2**30) // PIECE * PIECE
    if not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as f:
            for _ in range(size // PIECE):
                f.write(os.urandom(PIECE))
    contenders = {"fresh memory": lambda: _fresh(path),
                  "page cache": lambda: _map(path, lock=True),
                  "map cached": lambda: _map(path, lock=False)}
    print(f"# fresh_memory: {size / 2**30:.2f} GiB, {a.rounds} rounds; {machine()}")
    print("| round | contender | cold s | cached s |")
    print("|---:|---|---:|---:|")
    for rnd in range(a.rounds):
        names = list(contenders)
        names = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in names:
            evict([path])
            t0 = time.perf_counter()
            held = contenders[name]()
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = contenders[name]()
            cached = time.perf_counter() - t0
            del held, again
            print(f"| {rnd} | {name} | {cold:.2f} | {cached:.2f} |", flush=True)


if __name__ == "__main__":
    main()
