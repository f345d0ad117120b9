"""A preload that follows appends (issue U, item 2): the epoch fence where a generation
joins, with the store grown from the last one (each rank copies the chunk it held and
reads its share of the new generation) against a store built again over the grown
dataset (everything read again).

The dataset lies on a disk read-capped by a block-I/O cgroup (the shared file system;
root).  Each job is a fresh ``mpiexec -n RANKS`` in the cgroup: it preloads the first
generations, then a producer's generation is appended and the files' pages evicted
(the file system's cache does not hold them), then the fence is timed, one way or the
other; interleaved rounds.

    sudo .venv/bin/python benchmarks/loader/grow_bench.py --out /tmp/growb \\
        --samples 2000 --grow 200 --throttle 100 --ranks 2 --rounds 3
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
    """One job's fence (under mpiexec): prints the slowest rank's seconds as JSON."""
    import numpy as np
    from mpi4py import MPI

    import forebay
    from forebay.dataset import PrefixDataset
    from forebay.store import DistributedStore

    comm = MPI.COMM_WORLD
    data = Path(a.data)
    first = forebay.open_dataset(data)
    old = DistributedStore(PrefixDataset(data, len(first)), comm, transport=a.transport,
                           progress=False)
    if comm.rank == 0:          # a producer's generation arrives; nothing of it cached
        rng = np.random.default_rng(a.seed)
        forebay.append(data, ({"image": rng.bytes(110_000), "label": np.int64(i)}
                              for i in range(a.grow)))
        evict(files_under(data))
    comm.Barrier()
    t0 = time.perf_counter()
    grown = forebay.open_dataset(data)
    if a.kind == "grow":
        new = DistributedStore(grown, comm, transport=a.transport, progress=False,
                               grown_from=old)
        old.close()
    else:
        old.close()
        new = DistributedStore(grown, comm, transport=a.transport, progress=False)
    took = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    read = comm.allreduce(new.stats()["pfs_bytes"])
    new.close()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"seconds": took, "pfs_bytes": read}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-growb"))
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--grow", type=int, default=200, help="samples of the new generation")
    p.add_argument("--throttle", default="100", help="MBPS[,IOPS] of the dataset's disk")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--transport", default="shm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.worker:
        job(a)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    base = imagenet_dataset(a.out / "base.fb", a.samples)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    runs: dict[str, list[dict]] = {"grow": [], "rebuild": []}
    with throttled(a.out, a.throttle) as dev:
        for r in range(a.rounds):
            for kind in (("grow", "rebuild") if r % 2 == 0 else ("rebuild", "grow")):
                data = a.out / "data.fb"
                shutil.rmtree(data, ignore_errors=True)
                shutil.copytree(base, data)
                cmd = [mpiexec, "-n", str(a.ranks), sys.executable, __file__, "--worker",
                       "--data", str(data), "--kind", kind, "--seed", str(r),
                       "--grow", str(a.grow), "--transport", a.transport]
                cmd = dev.wrap(cmd) if dev is not None else cmd
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                res = json.loads(next(x for x in proc.stdout.splitlines()
                                      if x.startswith("RESULT "))[7:])
                res["round"] = r
                runs[kind].append(res)
                print(f"round {r} {kind}: {res}", flush=True)
    size = sum(f.stat().st_size for f in files_under(base))
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.samples:,} ImageNet-sized blobs ({size / 1e6:.0f} MB) + a generation of "
          f"{a.grow}; mpiexec -n {a.ranks}, transport {a.transport}; "
          f"{dev.describe() if dev else 'no throttle'}; {a.rounds} rounds, files evicted "
          f"before each fence")
    print("| the fence | seconds, median (min) | read from the files | vs rebuilt, min / median |")
    print("|---|---:|---:|---:|")
    rebuilt = {x["round"]: x["seconds"] for x in runs["rebuild"]}
    for kind, label in (("rebuild", "a store built again over the grown dataset"),
                        ("grow", "the store grown from the last one")):
        secs = [x["seconds"] for x in runs[kind]]
        ratio = [rebuilt[x["round"]] / x["seconds"] for x in runs[kind]]
        mb = statistics.median(x["pfs_bytes"] for x in runs[kind]) / 1e6
        print(f"| {label} | {statistics.median(secs):.2f} ({min(secs):.2f}) | {mb:.0f} MB | "
              f"{min(ratio):.2f} / {statistics.median(ratio):.2f} |")


if __name__ == "__main__":
    main()
