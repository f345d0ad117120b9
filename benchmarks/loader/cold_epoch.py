"""One cold epoch of forebay's direct and clairvoyant modes, with the page-cache
warm-up on and off (issue O): seconds and each rank's CPU time and page faults.

Every configuration is a fresh ``mpiexec -n R`` job (``--launcher torchrun``: a
``torchrun --standalone --nproc-per-node R`` job, forebay over torch.distributed) over
the same packed dataset, in rotating order, repeated; the dataset's files are evicted from the page cache before
each job; the clairvoyant RAM tiers hold the whole dataset.  Per job: the first
(cold) and second epoch of the slowest rank, and rank 0's user and system CPU seconds
and minor page faults over the first epoch (getrusage); with direct reads among the
modes, each other mode's cold and second epochs against direct reads' of the same
round (>= 1: not slower), min / median over rounds.  ``--throttle MBPS[,IOPS]``
runs every job in a block-I/O cgroup capping the disk's reads (root only, see
``_common.ThrottledDevice``).  ``--perf DIR``: rank 0 of every job samples all its
ranks with ``perf record -F 1999 -g`` (Linux perf, on PATH) from before the loader is
made to the end of the cold epoch, into ``DIR/perf-<mode>-<warm>-<round>.data``
(then e.g. ``perf report -i FILE --no-children --sort pid,sym``).

    python benchmarks/loader/cold_epoch.py /tmp/peers-run/ising-20480.fb --throttle 300,3000
    python benchmarks/loader/cold_epoch.py /tmp/peers-run/imagenet-10240.fb
    python benchmarks/loader/cold_epoch.py /tmp/peers-run/imagenet-10240.fb --warm off \
        --modes direct,clairvoyant:copy,clairvoyant:pages [--launcher torchrun]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import evict, files_under, machine, throttled  # noqa: E402

WARM = {"auto": "auto", "on": True, "off": False}


def worker(a) -> None:
    from forebay import open_dataset
    from forebay.torch import DataLoader, store_settings
    from forebay.world import resolve_comm

    comm = resolve_comm()       # MPI's COMM_WORLD, or torch.distributed under torchrun
    mode, _, tier = a.mode.partition(":")
    kw = {"ram_bytes": int(open_dataset(a.dataset).nbytes) + (64 << 20),
          "ram_tier": tier or "auto"} if mode == "clairvoyant" else {}
    perf = None
    if a.perf:
        pids = comm.allgather(os.getpid())
        if comm.Get_rank() == 0:
            perf = subprocess.Popen(["perf", "record", "-q", "-F", "1999", "-g", "-o",
                                     a.perf, "-p", ",".join(map(str, pids))])
            time.sleep(1.0)         # perf attached before the loader starts
        comm.Barrier()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    loader = DataLoader(a.dataset, a.batch_size, seed=0, epochs=2, progress=False,
                        store=store_settings(mode, warm_files=WARM[a.warm], **kw))
    times, cpu = [], None
    for e in range(2):
        loader.set_epoch(e)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in loader:
            pass
        times.append(max(comm.allgather(time.perf_counter() - t0)))
        if e == 0:
            r = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (r.ru_utime - r0.ru_utime, r.ru_stime - r0.ru_stime,
                   r.ru_minflt - r0.ru_minflt)
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
    loader.close()
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"epoch_s": times, "cpu": cpu}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", type=Path)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--modes", default="direct,clairvoyant",
                   help="direct, clairvoyant, clairvoyant:copy, clairvoyant:pages (its RAM "
                   "tier's ram_tier), comma-separated")
    p.add_argument("--warm", default="off,on", help="warm_files settings: auto, on, off")
    p.add_argument("--throttle", metavar="MBPS[,IOPS]")
    p.add_argument("--launcher", default="mpiexec", choices=["mpiexec", "torchrun"])
    p.add_argument("--perf", metavar="DIR", type=Path,
                   help="sample every job's ranks with perf record into DIR")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    configs = [(m, w) for m in a.modes.split(",") for w in a.warm.split(",")]
    runs: dict = {}
    bindir = Path(sys.executable).parent
    launch = [str(bindir / "mpiexec"), "-n", str(a.ranks), sys.executable] \
        if a.launcher == "mpiexec" else \
        [str(bindir / "torchrun"), "--standalone", "--nproc-per-node", str(a.ranks)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with throttled(a.dataset, a.throttle) as device:
        for rnd in range(a.rounds):
            k = rnd % len(configs)
            for mode, warm in configs[k:] + configs[:k]:
                evict(files_under(a.dataset))
                cmd = [*launch, __file__, str(a.dataset),
                       "--worker", "--mode", mode, "--warm", warm,
                       "--batch-size", str(a.batch_size)]
                if a.perf:
                    a.perf.mkdir(parents=True, exist_ok=True)
                    cmd += ["--perf", str(a.perf / f"perf-{mode.replace(':', '-')}-"
                                                   f"{warm}-{rnd}.data")]
                if device is not None:
                    cmd = device.wrap(cmd)
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                     env=env)
                if out.returncode != 0:
                    sys.exit(f"{mode} warm={warm} failed:\n{out.stderr[-3000:]}")
                r = json.loads(next(x for x in out.stdout.splitlines()
                                    if x.startswith("RESULT "))[7:])
                runs.setdefault((mode, warm), []).append(r | {"round": rnd})
                print(f"round {rnd} {mode:<12} warm={warm:<4} epochs "
                      f"{r['epoch_s'][0]:.2f}, {r['epoch_s'][1]:.2f} s; rank 0 epoch 1: "
                      f"user {r['cpu'][0]:.2f} s, sys {r['cpu'][1]:.2f} s, "
                      f"{r['cpu'][2]:,} minor faults", flush=True)
        what = device.describe() if device is not None else "no throttle"
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.dataset}, {a.ranks} ranks under {a.launcher}, batch {a.batch_size}; {what}; "
          f"{a.rounds} rounds")
    print("\n| mode | warm_files | cold epoch s, min / median | second epoch s, median | "
          "rank 0 CPU s (user + sys), median | minor faults, median | vs direct reads "
          "of the round, cold: min / median | second epoch: min / median |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (mode, warm), rs in runs.items():
        cold = [r["epoch_s"][0] for r in rs]
        ratios = ""
        direct = {r["round"]: r["epoch_s"] for r in runs.get(("direct", warm), [])}
        if mode != "direct" and direct:
            for e in (0, 1):
                x = [direct[r["round"]][e] / r["epoch_s"][e] for r in rs if r["round"] in direct]
                ratios += f" {min(x):.2f} / {statistics.median(x):.2f} |"
        print(f"| {mode} | {warm} | {min(cold):.2f} / {statistics.median(cold):.2f} | "
              f"{statistics.median(r['epoch_s'][1] for r in rs):.2f} | "
              f"{statistics.median(r['cpu'][0] + r['cpu'][1] for r in rs):.2f} | "
              f"{statistics.median(r['cpu'][2] for r in rs):,.0f} |{ratios or ' | |'}")


if __name__ == "__main__":
    main()
