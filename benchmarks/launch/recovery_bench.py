"""What a lost node costs (issue T, item 3): a DDP job on 3 emulated nodes with a
``forebay.torch.Checkpoint`` loses node2 mid-interval; the same command on the 2 nodes
left restores and goes on.  Timed from the kill: detection (the job ends on the
survivors), then the resubmitted job's start and rendezvous, its loader's store set-up
(the preload, from the file system: the data is evicted first), the restore, and the
first step; plus the steps replayed (those after the last save).  Root, the emulated
cluster of tests/cluster.py.

    python benchmarks/launch/recovery_bench.py --out /tmp/recovery --samples 2000,20000 \\
        --every 10,40 --reps 2 [--launcher torchrun]

``--launcher torchrun``: the agents restart the workers in place (``--nnodes 2:3
--max-restarts 3``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); detection is then when
node0's agent saw its worker fail, and "start" runs from there to the new
attempt's process group (the agents' rendezvous, the workers' start).

``--blocking``: the time a save holds the loop, ``Checkpoint.save()`` against DCP's own
``async_save`` with its ``FileSystemWriter``, on the same model (one process,
interleaved, ``--reps`` rounds of 10 saves; ``--width 2048``: a 134 MB model and
momentum; ``--device cuda``: the model on the GPU, each save staged to host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))                    # _common
sys.path.insert(0, str(HERE.parents[2] / "tests"))          # cluster
from _common import evict, files_under, machine  # noqa: E402

GLOBAL_BATCH = 12
#: the model: 4 x Linear(512, 512), about 4 MB of weights and 4 MB of momentum
WIDTH, DEPTH = 512, 4


def _model(width: int = WIDTH):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(DEPTH)])


def worker(a) -> None:
    """One rank: DDP steps of ``--compute-ms`` with a Checkpoint every ``--every`` steps;
    prints wall times (rank 0): PG, LOADER, RESTORED step, STEP k (each step)."""
    import torch

    import forebay.reduce as fr
    from forebay.torch import Checkpoint, DataLoader, Pipeline, Preload

    def say(*words: object) -> None:
        if rank == 0:
            print(*words, time.time(), flush=True)

    rank, world = fr.init_process_group("gloo")
    say("PG")
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    loader = DataLoader(a.data, GLOBAL_BATCH // world, seed=1, epochs=1000,
                        store=Preload(overlap=False),
                        pipeline=Pipeline(collate_fn=lambda b: len(b.ids)))
    say("LOADER")
    ckpt = Checkpoint(a.repo, loader=loader, model=model, optimizer=opt, every_steps=a.every)
    start = ckpt.restore()
    say("RESTORED", start)
    ran, x = 0, torch.ones(2, WIDTH)
    for epoch in range(loader.epoch, 1000):
        loader.set_epoch(epoch)
        for _ in loader:
            model(x).sum().backward()
            opt.step()
            time.sleep(a.compute_ms / 1e3)
            t0 = time.perf_counter()
            saved = ckpt.step()
            if saved:
                say("SAVE_BLOCK", time.perf_counter() - t0)
            say("STEP", ckpt.step_count)
            ran += 1
            if (a.steps and ran >= a.steps) or (a.stop_at and ckpt.step_count >= a.stop_at):
                ckpt.close()
                loader.close()
                return


def _write_data(path: Path, n: int) -> None:
    import forebay

    if path.exists():
        return
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"x": rng.integers(0, 255, 10_000, dtype=np.uint8)}
                                 for _ in range(n)))


def _lines(proc: subprocess.Popen, want: str, until: "float | None" = None) -> dict:
    """Read rank 0's timed lines until one starting with ``want`` (and, for STEP, a step
    at least ``until``); returns {word: (value, wall)} of what it read."""
    got: dict = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        w = line.split()
        if not w or w[0] not in ("PG", "LOADER", "RESTORED", "STEP", "SAVE_BLOCK"):
            continue
        val = float(w[1]) if len(w) == 3 else None
        got.setdefault(w[0], []).append((val, float(w[-1])))
        if w[0] == want and (until is None or (val is not None and val >= until)):
            return got
    raise SystemExit(f"the job ended before {want}:\n{proc.stderr.read()[-3000:]}")


def _job_files(a, samples: int, every: int) -> tuple[Path, Path, int]:
    """The dataset (written once), a fresh repository, and the step to lose node2 at:
    mid-interval, so that half an interval is replayed."""
    data = a.out / f"data-{samples}.fb"
    _write_data(data, samples)
    return (data, a.out / f"repo-{samples}-{every}-{time.monotonic_ns()}",
            2 * every + every // 2)


def _result(samples: int, every: int, fault: str, before: dict, got: dict,
            t_kill: float, t_detect: float, t_start: float) -> dict:
    """One row from rank 0's timed lines before the loss (``before``) and of the
    restarted attempt (``got``); "start" runs from ``t_start`` to its process group."""
    pg, loader = got["PG"][-1][1], got["LOADER"][-1][1]
    restored, t_restored = got["RESTORED"][-1]
    first_step = got["STEP"][0][1]
    return {"samples": samples, "every": every, "fault": fault,
            "detect_s": t_detect - t_kill, "start_s": pg - t_start,
            "store_s": loader - pg, "restore_s": t_restored - loader,
            "first_step_s": first_step - t_restored, "total_s": first_step - t_kill,
            "replayed_steps": before["STEP"][-1][0] - restored,
            "step_s": float(np.median(np.diff([t for _, t in before["STEP"]]))),
            "save_block_s": [b for b, _ in before.get("SAVE_BLOCK", [])]}


def recovery(a, cluster, samples: int, every: int, fault: str) -> dict:
    data, repo, kill_at = _job_files(a, samples, every)
    env = cluster.env(dict(os.environ, OMP_NUM_THREADS="1",
                           FOREBAY_PEER_TIMEOUT=str(a.peer_timeout)))

    def launch(nodes: int, steps: int) -> subprocess.Popen:
        argv = cluster.mpiexec_argv([sys.executable, str(HERE), "--worker", "--data",
                                     str(data), "--repo", str(repo), "--every", str(every),
                                     "--compute-ms", str(a.compute_ms), "--steps",
                                     str(steps)], nodes=nodes, ppn=1)
        return cluster.popen(0, argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    first = launch(3, 0)
    before = _lines(first, "STEP", kill_at)
    t_kill = time.time()
    if fault == "kill":
        cluster.kill_node(2)                   # its kernel closes the processes' sockets
    else:
        cluster.cut_link(2)                    # a node that stops answering
    try:
        first.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        first.kill()
        first.communicate()
    t_detect = time.time()
    if fault == "cut":
        cluster.kill_node(2)
        cluster.restore_link(2)
    cluster.kill_node(1)                       # what the dead job left on node1, if any
    evict(files_under(data))
    t_launch = time.time()
    second = launch(2, 3)
    got = _lines(second, "STEP")
    second.communicate(timeout=120)
    return _result(samples, every, fault, before, got, t_kill, t_detect, t_launch)


def _agent_time(line: str) -> float:
    """The wall time of a torch elastic log line (``I1128 20:09:00.102000 ...``, local
    time, today)."""
    hms = line.split()[1]
    day = time.localtime()
    t = time.mktime(time.strptime(f"{day.tm_year}-{day.tm_mon}-{day.tm_mday} "
                                  f"{hms.split('.')[0]}", "%Y-%m-%d %H:%M:%S"))
    return t + float("0." + hms.split(".")[1])


def recovery_torchrun(a, cluster, samples: int, every: int, fault: str, rep: int) -> dict:
    """As :func:`recovery`, with torchrun's elastic restart in place: 3 agents
    (``--nnodes 2:3 --max-restarts 3``), node2 lost; the agents left restart the
    workers on 2 nodes.  Detection is when node0's agent decided to restart them (its
    worker failed, or node1's agent was waiting for a new round)."""
    import threading

    data, repo, kill_at = _job_files(a, samples, every)
    env = cluster.env(dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO",
                           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                           FOREBAY_PEER_TIMEOUT=str(a.peer_timeout)))
    argv = cluster.torchrun_argv(
        [str(HERE), "--worker", "--data", str(data), "--repo", str(repo), "--every",
         str(every), "--compute-ms", str(a.compute_ms), "--stop-at", str(kill_at + every)],
        nodes="2:3", restarts=3, port=29600 + rep % 200)
    agents = [cluster.popen(k, argv, env=env, stdout=subprocess.PIPE if k == 0 else
                            subprocess.DEVNULL, stderr=subprocess.PIPE if k == 0 else
                            subprocess.DEVNULL, text=True) for k in range(3)]
    err: list[str] = []
    pump = threading.Thread(target=lambda: err.extend(agents[0].stderr), daemon=True)
    pump.start()
    try:
        before = _lines(agents[0], "STEP", kill_at)
        t_kill = time.time()
        if fault == "cut":
            cluster.cut_link(2)                # silent: nothing it does reaches the others
        cluster.kill_node(2)
        evict(files_under(data))           # the restarted preload reads the file system
        got = _lines(agents[0], "RESTORED")
        got.update(_lines(agents[0], "STEP"))
        agents[0].wait(timeout=120)
        agents[1].wait(timeout=120)
    finally:
        for ag in agents:
            ag.kill()
            ag.wait()
        pump.join(timeout=10)
        if fault == "cut":
            cluster.restore_link(2)
    # its worker failed, or it saw node1's agent waiting for a new round first
    failed = [_agent_time(x) for x in err if "will restart worker group" in x]
    t_detect = failed[0] if failed else float("nan")
    return _result(samples, every, fault, before, got, t_kill, t_detect, t_detect)


def blocking(a) -> None:
    """Checkpoint.save() against dcp.async_save(FileSystemWriter): blocked seconds."""
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    from forebay.torch import Checkpoint

    model = _model(a.width).to(a.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.ones(2, a.width, device=a.device)).sum().backward()
    opt.step()
    times: dict[str, list[float]] = {"forebay Checkpoint.save": [], "DCP async_save": []}
    stager = None
    if a.device == "cuda" and a.dcp_pinned:
        # DCP's own pinned staging, kept across saves, as a user could configure it
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=False,
                                              use_non_blocking_copy=True))
        times["DCP async_save, pinned DefaultStager"] = []
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        ck = Checkpoint(f"file://{tmp}/repo", model=model, optimizer=opt, keep=2)
        pending = None
        for rep in range(a.reps * 10):
            for name in (list(times) if rep % 2 == 0 else list(times)[::-1]):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)           # every save has new weights
                if a.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name.startswith("forebay"):
                    ck.save()
                else:
                    if pending is not None:
                        pending.result()
                    pending = dcp.async_save(
                        {"model": dict(model.state_dict()), "optim": opt.state_dict()},
                        storage_writer=dcp.FileSystemWriter(f"{tmp}/dcp-{rep}"), no_dist=True,
                        async_stager=stager if name.endswith("DefaultStager") else None)
                times[name].append(time.perf_counter() - t0)
                ck.wait() if name.startswith("forebay") else pending.result()
        ck.close()
        if stager is not None:
            stager.close()
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 2
    gpu = f", on {torch.cuda.get_device_name()}" if a.device == "cuda" else ""
    print(f"\nmachine: {machine()}; model {nbytes / 1e6:.1f} MB with its momentum{gpu}; "
          f"{a.reps * 10} saves each, interleaved, each finished before the next")
    print("| save | blocked s, median | min |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.4f} | {min(ts):.4f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-recovery"))
    p.add_argument("--samples", default="2000,20000")
    p.add_argument("--every", default="10,40")
    p.add_argument("--compute-ms", type=float, default=50.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--faults", default="kill,cut",
                   help="kill: node2's processes killed (the node's kernel closes their "
                        "connections); cut: node2's link cut (it stops answering)")
    p.add_argument("--peer-timeout", type=float, default=5.0,
                   help="FOREBAY_PEER_TIMEOUT of the jobs (s)")
    p.add_argument("--blocking", action="store_true")
    p.add_argument("--width", type=int, default=WIDTH,
                   help="--blocking: the model's layers are width x width (4 of them)")
    p.add_argument("--device", default="cpu", help="--blocking: where the model lives")
    p.add_argument("--dcp-pinned", action="store_true",
                   help="--blocking --device cuda: add DCP's pinned DefaultStager (fails "
                        "in torch 2.11: KeyError <class 'type'> in its deep copy)")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--repo", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop-at", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=["mpiexec", "torchrun"], default="mpiexec",
                   help="mpiexec: the same command resubmitted on the 2 nodes left; "
                        "torchrun: --nnodes 2:3 --max-restarts 3, restarted in place")
    a = p.parse_args()
    if a.worker:
        a.every = int(a.every)
        worker(a)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    if a.blocking:
        blocking(a)
        return
    from cluster import Cluster, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"the emulated cluster: {why}")
    rows = []
    with Cluster(3, a.out / "cluster", shm_bytes=1 << 30) as cluster:
        for rep in range(a.reps):
            for fault in a.faults.split(","):
                for n in (int(x) for x in a.samples.split(",")):
                    for every in (int(x) for x in a.every.split(",")):
                        r = (recovery(a, cluster, n, every, fault)
                             if a.launcher == "mpiexec" else
                             recovery_torchrun(a, cluster, n, every, fault, len(rows)))
                        r["rep"], r["launcher"] = rep, a.launcher
                        rows.append(r)
                        print(json.dumps(r), flush=True)
    how = ("the same command on the 2 left" if a.launcher == "mpiexec" else
           "torchrun --nnodes 2:3 --max-restarts 3 restarting in place (start: from the "
           "agent's detection)")
    print(f"\nmachine: {machine()}; 3 emulated nodes, node2 lost mid-interval, {how}; "
          f"{a.compute_ms:g} ms of compute per step, "
          f"FOREBAY_PEER_TIMEOUT={a.peer_timeout:g}; medians of {a.reps} rounds")
    print("| fault | samples (10 KB) | every | detection s | start + rendezvous s | "
          "store set-up s | restore s | first step s | death to first step s | "
          "steps replayed | replayed s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fault in a.faults.split(","):
        for n in (int(x) for x in a.samples.split(",")):
            for every in (int(x) for x in a.every.split(",")):
                rs = [r for r in rows if r["samples"] == n and r["every"] == every
                      and r["fault"] == fault]
                _row(fault, n, every, rs)
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


def _row(fault: str, n: int, every: int, rs: list[dict]) -> None:
    def med(k: str) -> float:
        return statistics.median(r[k] for r in rs)
    print(f"| {fault} | {n:,} | {every} | {med('detect_s'):.1f} | {med('start_s'):.1f} | "
          f"{med('store_s'):.1f} | {med('restore_s'):.2f} | {med('first_step_s'):.2f} | "
          f"{med('total_s'):.1f} | {med('replayed_steps'):.0f} | "
          f"{med('replayed_steps') * med('step_s'):.1f} |")


if __name__ == "__main__":
    main()
