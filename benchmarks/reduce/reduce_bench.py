"""Gradient coordination benchmarks (issue F): bitvector vs master-worker control traffic,
step time against torch DDP, the effect of groups on fused messages, and an analytic model
that extrapolates coordination cost to Summit scale.

    python benchmarks/reduce/reduce_bench.py control --ranks 2,4,8 --tensors 16,64,256,1024
    python benchmarks/reduce/reduce_bench.py step --ranks 2,4 --steps 40
    python benchmarks/reduce/reduce_bench.py groups --ranks 4
    python benchmarks/reduce/reduce_bench.py model

Every multi-rank case runs real gloo process groups under ``mpiexec`` on this machine
(8 ranks on 2 cores are oversubscribed: step times there are not meaningful, traffic is).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import machine  # noqa: E402


def _mpi(ranks: int, *args: str, timeout: int = 1800) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    p = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker",
                        *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"worker {args} on {ranks} ranks failed")
    return [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


def _header(*cols: str, text: set = frozenset()) -> None:
    """A markdown table header; columns not in ``text`` are right-aligned numbers."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if c in text else "---:" for c in cols) + "|")


# --------------------------------------------------------------------------------- workers

def _emit(d: dict) -> None:
    import os
    os.write(1, ("RESULT " + json.dumps(d) + "\n").encode())


def worker_control(a) -> None:
    """n tensors per step, submitted in a rank-dependent order over ~a.spread_ms, S steps;
    counters over the steps after the first (the cache is warm)."""
    import random

    import torch
    import forebay.reduce as fr
    rank, world = fr.init_process_group("gloo")
    coord = fr.Coordinator(coordination=a.mode, cycle_time_ms=a.cycle_ms,
                           cache_capacity=max(1024, a.n))
    names = [f"layer{i:04d}.weight" for i in range(a.n)]
    data = [torch.ones(4) for _ in names]
    rng = random.Random(rank)
    base = None
    for step in range(a.steps):
        if step == 1:
            base = coord.snapshot()[0]
            t0 = time.perf_counter()
        order = list(range(a.n))
        rng.shuffle(order)
        hs = []
        gap = a.spread_ms / 1000 / a.n
        for i in order:
            hs.append(coord.submit(names[i], data[i], "sum"))
            time.sleep(gap)
        for h in hs:
            h.wait(300)
    elapsed = time.perf_counter() - t0
    end = coord.snapshot()[0]
    coord.close()
    d = {k: end[k] - base[k] for k in end}
    cycles = max(d["cycles"], 1)
    steps = a.steps - 1
    _emit(dict(rank=rank, world=world, mode=a.mode, n=a.n, cycles_per_step=cycles / steps,
               bytes_sent_per_cycle=d["control_bytes_sent"] / cycles,
               bytes_received_per_cycle=d["control_bytes_received"] / cycles,
               messages_per_cycle=d["control_messages"] / cycles,
               collectives_per_cycle=d["control_collectives"] / cycles,
               bytes_sent_per_step=d["control_bytes_sent"] / steps,
               bytes_received_per_step=d["control_bytes_received"] / steps,
               data_collectives_per_step=d["data_collectives"] / steps,
               cycle_s=elapsed / cycles))


def _models():
    import torch.nn as nn

    def cnn():
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))

    def mlp():       # 110 Linear layers: 220 parameter tensors
        layers = [nn.Linear(64, 128), nn.ReLU()]
        for _ in range(108):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(128, 10))

    return {"cnn": (cnn, (32, 3, 32, 32)), "mlp": (mlp, (64, 64))}


def worker_step(a) -> None:
    """Ours and DDP side by side in one process: two copies of the model, blocks of steps
    alternated ABBA, median step time of each."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import forebay.reduce as fr
    torch.set_num_threads(1)
    rank, world = fr.init_process_group("gloo")
    make, shape = _models()[a.model]
    torch.manual_seed(0)
    ours, ref = make(), make()
    ref.load_state_dict(ours.state_dict())
    groups = None if a.groups == 0 else a.groups
    opt = fr.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01),
                                  ours.named_parameters(), coordination=a.mode, groups=groups,
                                  cycle_time_ms=a.cycle_ms,
                                  fusion_threshold_bytes=a.fusion_mb << 20)
    ddp = DDP(ref)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (shape[0],), generator=g)

    def step(model, o):
        o.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        o.step()

    times = {"forebay": [], "ddp": []}
    contenders = {"forebay": (ours, opt), "ddp": (ddp, dopt)}
    for _ in range(3):                               # warm-up, caches filled
        for m, o in contenders.values():
            step(m, o)
    opt.stats()
    mark = opt._fb_coord.snapshot()[0]
    block = 5
    order = ["forebay", "ddp", "ddp", "forebay"]
    for b in range(a.steps // block):
        name = order[b % 4]
        m, o = contenders[name]
        for _ in range(block):
            t0 = time.perf_counter()
            step(m, o)
            times[name].append(time.perf_counter() - t0)
    end = opt._fb_coord.snapshot()[0]
    last = opt.stats()["last_step"]
    opt.close()
    n = len(times["forebay"])
    _emit(dict(rank=rank, world=world, model=a.model, mode=a.mode, groups=a.groups,
               tensors=len(list(ours.parameters())),
               params=sum(p.numel() for p in ours.parameters()),
               forebay_s=statistics.median(times["forebay"]),
               ddp_s=statistics.median(times["ddp"]),
               data_collectives_per_step=(end["data_collectives"] - mark["data_collectives"]) / n,
               cycles_per_step=(end["cycles"] - mark["cycles"]) / n,
               fused_sizes_last_step=last["fused_sizes"]))


# --------------------------------------------------------------------------------- analytic

SUMMIT = dict(
    alpha_s=2.0e-6,            # per message: MPI latency over EDR InfiniBand, incl. software
    beta_Bps=23e9,             # per-node injection bandwidth (dual-rail EDR, 2 x 12.5 GB/s)
    request_bytes=64,          # one serialized request or response (name, shape, dtype, op)
    process_s=0.2e-6,          # rank 0's work per received request (table update, checks)
)


def coordination_cost(P: int, tensors: int, cycles: int, cache_bits: int = 1024,
                      alpha_s: float = SUMMIT["alpha_s"], beta_Bps: float = SUMMIT["beta_Bps"],
                      request_bytes: int = SUMMIT["request_bytes"],
                      process_s: float = SUMMIT["process_s"]) -> dict:
    """Coordination time per training step (latency-bandwidth model).

    bitvector: ``cycles`` all-reduces of B = 8 (1 + ceil(bits/64)) bytes by recursive
    doubling: log2 P (alpha + B / beta) each.
    master-worker: per cycle a gather to rank 0 (binomial tree: log2 P latencies, and rank 0
    receives every rank's requests: (P-1) k r / beta) plus rank 0's processing of them
    (P k process_s), then a broadcast of the responses (log2 P (alpha + k r / beta)); k =
    requests per rank per cycle = tensors / cycles.
    """
    lg = math.ceil(math.log2(max(P, 2)))
    B = 8 * (1 + math.ceil(cache_bits / 64))
    bit = cycles * lg * (alpha_s + B / beta_Bps)
    k = tensors / cycles
    gather = lg * alpha_s + (P - 1) * k * request_bytes / beta_Bps + P * k * process_s
    bcast = lg * (alpha_s + k * request_bytes / beta_Bps)
    master = cycles * (gather + bcast)
    return {"ranks": P, "bitvector_s": bit, "master_s": master, "ratio": master / bit,
            "bitvector_bytes_per_rank": cycles * B,
            "master_bytes_at_root": cycles * ((P - 1) * k * request_bytes + k * request_bytes)}


def model(a) -> None:
    print(f"# analytic coordination cost per step, FC-DenseNet-sized model "
          f"({a.params / 1e6:.0f} M parameters in {a.tensors} gradient tensors), "
          f"{a.cycles} cycles per step, cache {a.bits} bits")
    print(f"# assumptions: {json.dumps(SUMMIT)}")
    gpus = [6, 96, 768, 6144, 27600]
    step_s = a.step_ms / 1000
    print(f"# compute per step {a.step_ms} ms; allreduce of the gradients "
          f"(ring, 2 (P-1)/P N/beta with N = {a.params * 2 / 1e6:.0f} MB fp16) added to both")
    _header("ranks (GPUs)", "bitvector ms/step", "master-worker ms/step", "ratio",
            "efficiency bitvector", "efficiency master")
    rows = []
    for P in gpus:
        c = coordination_cost(P, a.tensors, a.cycles, a.bits)
        # bandwidth term only: NCCL pipelines the ring, hiding its per-step latencies
        ring = 2 * (P - 1) / P * (a.params * 2) / SUMMIT["beta_Bps"]
        eff_b = step_s / (step_s + ring + c["bitvector_s"])
        eff_m = step_s / (step_s + ring + c["master_s"])
        rows.append(dict(c, eff_bitvector=eff_b, eff_master=eff_m))
        print(f"| {P} | {c['bitvector_s'] * 1e3:.3f} | {c['master_s'] * 1e3:.2f} | "
              f"{c['ratio']:.0f}x | {eff_b:.3f} | {eff_m:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


# --------------------------------------------------------------------------------- drivers

def control(a) -> None:
    print(f"machine: {machine()}\ncontrol traffic per cycle (gloo, cycle {a.cycle_ms} ms, "
          f"{a.steps - 1} steps after a warm-up step, tensors submitted over "
          f"{a.spread_ms} ms in a per-rank random order)")
    _header("ranks", "tensors", "mode", "cycles/step", "bytes sent/cycle (rank 1)",
            "bytes received/cycle (rank 0)", "messages at rank 0/cycle", "collectives/cycle",
            "control bytes at rank 0/step", "cycle time ms", text={"mode"})
    rows = []
    for P in [int(x) for x in a.ranks.split(",")]:
        for n in [int(x) for x in a.tensors.split(",")]:
            for mode in ("bitvector", "master"):
                res = _mpi(P, "control", "--mode", mode, "--n", str(n), "--steps",
                           str(a.steps), "--cycle-ms", str(a.cycle_ms), "--spread-ms",
                           str(a.spread_ms))
                r0 = next(r for r in res if r["rank"] == 0)
                r1 = next(r for r in res if r["rank"] == 1)
                rows.append(dict(ranks=P, tensors=n, mode=mode, root=r0, worker=r1))
                print(f"| {P} | {n} | {mode} | {r0['cycles_per_step']:.1f} | "
                      f"{r1['bytes_sent_per_cycle']:.0f} | {r0['bytes_received_per_cycle']:.0f} | "
                      f"{r0['messages_per_cycle']:.1f} | {r0['collectives_per_cycle']:.2f} | "
                      f"{r0['bytes_sent_per_step'] + r0['bytes_received_per_step']:.0f} | "
                      f"{r0['cycle_s'] * 1e3:.2f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def step(a) -> None:
    print(f"machine: {machine()}\nstep time, forebay DistributedOptimizer vs torch DDP "
          f"(gloo, 1 intra-op thread per rank, side by side: two model copies per process, "
          f"blocks of 5 steps alternated ABBA, medians over {a.steps} steps each)")
    _header("model", "tensors", "ranks", "coordination", "groups", "forebay ms", "DDP ms",
            "ratio", "collectives/step", "mean fused KiB", "cycles/step",
            text={"model", "coordination"})
    rows = []
    for P in [int(x) for x in a.ranks.split(",")]:
        for m in a.models.split(","):
            for mode in a.modes.split(","):
                for groups in [int(g) for g in a.groups.split(",")]:
                    res = _mpi(P, "step", "--model", m, "--mode", mode, "--steps",
                               str(a.steps * 2), "--cycle-ms", str(a.cycle_ms),
                               "--groups", str(groups), "--fusion-mb", str(a.fusion_mb))
                    ours = max(r["forebay_s"] for r in res)
                    ddp = max(r["ddp_s"] for r in res)
                    r0 = res[0]
                    rows.append(dict(model=m, ranks=P, mode=mode, groups=groups, ours_s=ours,
                                     ddp_s=ddp, per_rank=res))
                    print(f"| {m} | {r0['tensors']} | {P} | {mode} | {groups or '-'} | "
                          f"{ours * 1e3:.2f} | {ddp * 1e3:.2f} | {ours / ddp:.3f} | "
                          f"{r0['data_collectives_per_step']:.1f} | "
                          f"{statistics.mean(r0['fused_sizes_last_step']) / 1024:.0f} | "
                          f"{r0['cycles_per_step']:.1f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["control", "step", "model"])
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--tensors", default="16,64,256,1024")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cycle-ms", type=float, default=1.0)
    p.add_argument("--spread-ms", type=float, default=20.0)
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--modes", default="bitvector,master")
    p.add_argument("--groups", default="0")
    p.add_argument("--fusion-mb", type=int, default=64)
    p.add_argument("--json")
    # analytic model
    p.add_argument("--params", type=float, default=220e6)
    p.add_argument("--tensors-model", dest="tensors_model", type=int, default=500)
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--bits", type=int, default=1024)
    p.add_argument("--step-ms", type=float, default=1000.0)
    # worker
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="bitvector", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        if a.what == "control":
            worker_control(a)
        else:
            a.groups = int(a.groups)
            worker_step(a)
        return
    if a.what == "model":
        a.tensors = a.tensors_model
        model(a)
    else:
        {"control": control, "step": step}[a.what](a)


if __name__ == "__main__":
    main()
