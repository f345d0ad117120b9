"""Side-by-side A/B of two source trees' model providers (``forebay models serve`` over a
memory store): one client saves a fresh model of ``--mib`` MiB to each in turn,
alternating which goes first, and prints the save times.  Use it to measure a change
to the provider against the code before it (``git worktree add /tmp/old REV``):

    python benchmarks/models/models_provider_ab.py --old-src /tmp/old/src --new-src src --mib 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import forebay.models as fm


def start(src: str, token_file: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    code = ("import sys, forebay; print('provider code:', forebay.__file__, file=sys.stderr); "
            "from forebay.cli import main; sys.exit(main())")
    p = subprocess.Popen([sys.executable, "-c", code, "models", "serve", "--listen",
                          "127.0.0.1:0", "--store", "memory://", "--token-file",
                          str(token_file)], stdout=subprocess.PIPE, text=True, env=env)
    return p, p.stdout.readline().split()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", required=True, help="the 'src' directory of the old tree")
    ap.add_argument("--new-src", default="src")
    ap.add_argument("--mib", type=int, default=1024, help="model size (50 tensors)")
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "token"
        tok.write_text("ab\n")
        procs = {name: start(src, tok) for name, src in (("old", a.old_src),
                                                        ("new", a.new_src))}
        clients = {name: fm.open_repository(url, token="ab") for name, (_, url) in procs.items()}
        times: dict[str, list[float]] = {"old": [], "new": []}
        try:
            for rep in range(a.reps):
                torch.manual_seed(rep)
                n = a.mib * (1 << 20) // 4 // 50
                sd = {f"l{i}": torch.randn(n) for i in range(50)}
                for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                    t = time.perf_counter()
                    clients[name].save(f"m{rep}", sd)
                    times[name].append(time.perf_counter() - t)
        finally:
            for c in clients.values():
                c.close()
            for p, _ in procs.values():
                p.terminate()
                p.wait()
    for name, ts in times.items():
        print(f"{name}: save of {a.mib} MiB, median {statistics.median(ts):.3f} s, "
              f"min {min(ts):.3f} s; all " + " ".join(f"{t:.2f}" for t in ts))
    print(f"old / new (medians): {statistics.median(times['old']) / statistics.median(times['new']):.2f}x")


if __name__ == "__main__":
    main()
