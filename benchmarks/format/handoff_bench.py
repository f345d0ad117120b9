"""Producer-to-consumer latency of new samples (issue U, item 5): how long after a
producer publishes a generation of frames a consumer in another process has read them.

* ``forebay``: the producer ``forebay.append``s each generation; the consumer
  ``forebay.dataset.wait_for``s it (polling the manifest every ``--poll`` seconds),
  opens the dataset again and reads the new frames with one ``get_many``;
* ``forebay serve + mirror`` (DYAD's path, issue U item 3): the producer appends to a
  dataset in its own (node-local) directory and serves it (``forebay.dataset.serve_dataset``);
  the consumer ``mirror``s it into its own directory, waiting on the server (which looks
  at its manifest every 5 ms), and reads the new frames there; nothing goes through a
  shared directory (here both ends are on one machine: loopback, no link);
* ``npy files`` (what a workflow without forebay does, MuMMI's first version on GPFS):
  the producer writes each frame as an ``.npy`` file (written under a temporary name,
  then renamed), the consumer lists the directory every ``--poll`` seconds and loads
  the files it has not seen.

The producer publishes a generation every ``--interval`` seconds and stamps the time it
published (``time.time()``, the same clock in both processes); per generation, latency
= the consumer's time when it holds every frame of it minus that stamp. Rounds in
alternating order; each round's files are fresh (page cache warm: the same machine).

    python benchmarks/format/handoff_bench.py --out /tmp/handoff --generations 20 \\
        --frames 64 --frame-kb 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine  # noqa: E402


def _frames(g: int, n: int, nbytes: int) -> list[dict]:
    rng = np.random.default_rng(g)
    return [{"x": rng.integers(0, 255, nbytes, dtype=np.uint8), "k": np.int64(g * n + k)}
            for k in range(n)]


TOKEN = "handoff-bench"


def produce(kind: str, out: Path, a: argparse.Namespace, stamps: "multiprocessing.Queue",
            done: Any = None):
    import forebay
    from forebay.dataset import serve_dataset

    server = None
    for g in range(a.generations):
        t_next = time.time() + a.interval
        frames = _frames(g, a.frames, a.frame_kb << 10)
        if kind != "npy files":
            where = out / "producer.fb" if kind.startswith("forebay serve") else out
            if g == 0:
                forebay.write_dataset(where, frames)
                if kind.startswith("forebay serve"):
                    server = serve_dataset(where, f"127.0.0.1:{a.port}", token=TOKEN)
            else:
                forebay.append(where, frames)
        else:
            out.mkdir(exist_ok=True)
            for f in frames:
                tmp = out / f".{int(f['k']):08d}.npy"
                np.save(tmp, f["x"])
                os.rename(tmp, out / f"{int(f['k']):08d}.npy")
        stamps.put((g, time.time()))
        time.sleep(max(0.0, t_next - time.time()))
    if server is not None:
        done.wait(300)               # serve until the consumer has the last generation
        server.close()


def consume(kind: str, out: Path, a: argparse.Namespace, seen: "multiprocessing.Queue",
            done: Any = None):
    import forebay
    from forebay.dataset import mirror, wait_for
    from forebay.errors import DatasetServerError

    have: set[str] = set()
    for g in range(a.generations):
        want = (g + 1) * a.frames
        if kind.startswith("forebay serve"):
            while True:
                try:
                    ds = mirror(f"http://127.0.0.1:{a.port}", out / "consumer.fb",
                                samples=want, timeout=300, token=TOKEN)
                    break
                except DatasetServerError:         # the producer is not serving yet
                    if g:
                        raise
                    time.sleep(a.poll)
            batch = ds.get_many(np.arange(g * a.frames, want))
            assert len(batch) == a.frames
        elif kind == "forebay":
            wait_for(out, want, timeout=300, poll=a.poll)
            ds = forebay.open_dataset(out)
            batch = ds.get_many(np.arange(g * a.frames, want))
            assert len(batch) == a.frames
        else:
            while True:
                names = {e.name for e in os.scandir(out) if not e.name.startswith(".")} \
                    if out.exists() else set()
                new = sorted(names - have)
                if len(have) + len(new) >= want:
                    break
                time.sleep(a.poll)
            for name in new:
                np.load(out / name)
            have |= set(new)
        seen.put((g, time.time()))
    if done is not None:
        done.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-handoff"))
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--frames", type=int, default=64, help="frames per generation")
    p.add_argument("--frame-kb", type=int, default=64)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between generations")
    p.add_argument("--poll", type=float, default=0.05, help="the consumers' poll interval")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    lat: dict[str, list[float]] = {"forebay": [], "forebay serve + mirror": [],
                                   "npy files": []}
    with socket.socket() as sock:            # a free port for the producer's server
        sock.bind(("127.0.0.1", 0))
        a.port = sock.getsockname()[1]
    for r in range(a.rounds):
        k = r % len(lat)
        for kind in list(lat)[k:] + list(lat)[:k]:
            out = a.out / f"{kind.replace(' ', '-')}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            stamps, seen, done = ctx.Queue(), ctx.Queue(), ctx.Event()
            if kind.startswith("forebay serve"):
                out.mkdir(parents=True)
            procs = [ctx.Process(target=consume, args=(kind, out, a, seen, done)),
                     ctx.Process(target=produce, args=(kind, out, a, stamps, done))]
            for q in procs:
                q.start()
            for q in procs:
                q.join()
                if q.exitcode != 0:
                    sys.exit(f"{kind}: a process failed ({q.exitcode})")
            made = dict(stamps.get() for _ in range(a.generations))
            got = dict(seen.get() for _ in range(a.generations))
            lat[kind] += [got[g] - made[g] for g in range(a.generations)]
            shutil.rmtree(out, ignore_errors=True)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.generations} generations of {a.frames} frames of {a.frame_kb} KiB, one every "
          f"{a.interval:g} s, consumers polling every {a.poll:g} s, {a.rounds} rounds")
    print("| hand-off | latency ms, median | p90 | max |")
    print("|---|---:|---:|---:|")
    for kind, xs in lat.items():
        xs = sorted(x * 1e3 for x in xs)
        print(f"| {kind} | {statistics.median(xs):.1f} | {xs[int(0.9 * (len(xs) - 1))]:.1f} | "
              f"{xs[-1]:.1f} |")
    print("RAW " + json.dumps({k: [round(x, 5) for x in v] for k, v in lat.items()}))


if __name__ == "__main__":
    main()
