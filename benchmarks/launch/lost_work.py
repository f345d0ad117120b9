"""What failures cost a long run (issue T, item 3): measured on the emulated cluster,
extrapolated to 1,024 nodes with the simulator's file-system model.

A run of ``--hours`` hours of training (steps of ``step_s``), a node lost every F
minutes, a :class:`forebay.torch.Checkpoint` every I steps.  Each failure costs the
time from the loss to the first step after the restart (detection, the launcher's
start and rendezvous, the store's set-up, the restore) plus the steps replayed (I / 2
on average); each save holds the loop ``save_s``.  The lost share of the run is

    lost = (recovery + I / 2 * step_s) / F  +  save_s / (I * step_s)

and the interval that minimises it is Young's, I * step_s = sqrt(2 * save_s * F)
(the replayed half interval against the saves' cost), bounded below by one step.

* **Measured** (``--measured``, recovery_bench.py's raw JSON lines: 3 emulated nodes
  under mpiexec, node2's processes killed or its link cut): every component as
  measured, medians over rounds; ``save_s`` from ``--save-ms``.
* **At N nodes** (``--nodes``, default 1,024, on a simulator system, default ``lassen``,
  and a dataset scenario, default ``imagenet-1k``): the store's set-up is the preload
  of the whole dataset by every node at once from the parallel file system, and the
  restore is, with ``--restore-from one`` (``Checkpoint``'s default for a replicated
  state), one rank reading the state alone and broadcasting it down a binomial tree
  (log2(N) hops of the whole state over the system's link), or with ``every`` every
  node reading the state once (forebay's DCP reader reads each item once per node);
  the file system's parts timed by the simulator's conserving model
  (:meth:`forebay.sim.System.pfs_setup_s_per_MB`: N readers share the file system's
  t(N), its table clamped past its largest reader count); a step is the worker's
  compute on a batch (``batch x mean sample / c``); detection of a killed node stays
  as measured (its kernel closes the connections), a silent one takes the liveness
  deadline (30 s by default) plus one probe (3 s); the launcher's start and
  rendezvous is not modelled: the measured 3-node figure is used, a floor (at 1,024
  nodes srun and Python's imports from a shared file system take longer).
* ``--preload-cache`` (``Preload(node_cache=)``: each node keeps the chunk it read):
  ``same-nodes``, the job requeued on the survivors plus a spare node (the same world
  size, so the same chunks): only the spare reads its chunk from the file system,
  alone; ``survivors``, the job re-formed on the N-1 left: forebay's contiguous chunks
  move, each survivor reads from the file system the part of its new chunk its cache
  lacks (exact for each lost node, averaged over 64 of them), every survivor at once,
  a fluid share of the file system among those still reading; then each node preloads
  its chunk from its node-local storage (the SSD table).

    python benchmarks/launch/lost_work.py \\
        --measured benchmarks/results/recovery_2026-11-27.txt --hours 24
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: seconds a silent peer is given before the liveness probe (FOREBAY_PEER_TIMEOUT's
#: default) and what one probe may wait
DEADLINE_S, PROBE_S = 30.0, 3.0


def measured(path: Path) -> dict:
    """Medians of recovery_bench's components per fault kind."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    out = {}
    for fault in sorted({r["fault"] for r in rows}):
        mine = [r for r in rows if r["fault"] == fault]
        out[fault] = {k: statistics.median(r[k] for r in mine)
                      for k in ("detect_s", "start_s", "store_s", "restore_s", "first_step_s",
                                "step_s")}
    return out


def lost_share(recovery_s: float, step_s: float, save_s: float, every_s: float,
               interval_steps: "int | None" = None) -> tuple[float, int]:
    """(the lost share of the run, the checkpoint interval in steps): Young's interval
    unless ``interval_steps`` is given."""
    if interval_steps is None:
        interval_steps = max(1, round(math.sqrt(2 * save_s * every_s) / step_s))
    replay = interval_steps / 2 * step_s
    return (recovery_s + replay) / every_s + save_s / (interval_steps * step_s), \
        interval_steps


def cache_misses(nodes: int, lost: int) -> np.ndarray:
    """Each survivor's share of the dataset (fractions) that its node cache lacks when a
    store of ``nodes`` contiguous chunks re-forms on the ``nodes - 1`` left after node
    ``lost`` is gone (forebay's layout: chunks balanced by bytes, in rank order)."""
    old = np.arange(nodes + 1) / nodes
    survivors = np.delete(np.arange(nodes), lost)
    new = np.arange(nodes) / (nodes - 1)
    overlap = np.clip(np.minimum(new[1:], old[survivors + 1]) -
                      np.maximum(new[:-1], old[survivors]), 0.0, None)
    return (new[1:] - new[:-1]) - overlap


def fluid_read_s(amounts_mb: np.ndarray, threads: int, sysm: Any) -> float:
    """Seconds until every node has read its ``amounts_mb`` from the file system, all
    starting at once: the nodes still reading share it (the conserving model's rate for
    that many readers), the smallest amounts finish first."""
    t, done = 0.0, 0.0
    left = np.sort(amounts_mb[amounts_mb > 0])
    for i, m in enumerate(left.tolist()):
        active = len(left) - i
        t += (m - done) / (threads / sysm.pfs_setup_s_per_MB(active, threads))
        done = m
    return t


def at_scale(nodes: int, system: str, dataset: str, batch: int, state_gb: float,
             base: dict, restore_from: str = "one", preload_cache: str = "none") -> dict:
    """The components at ``nodes`` nodes (see the module's docstring)."""
    from forebay.sim import SCENARIOS, load_system

    sysm = load_system(system)
    spec = SCENARIOS[dataset]
    data_mb = spec.samples * spec.mean_MB
    threads = sysm.staging_threads
    per_mb = sysm.pfs_setup_s_per_MB(nodes, threads)      # one thread's MB, all at once
    setup_s = data_mb / nodes / threads * per_mb             # each node its share
    if preload_cache != "none":
        tier = "ssd" if sysm.ssd_read_MBps else "ram"   # each node its chunk, locally
        local_s = data_mb / nodes / threads * sysm.local_s_per_MB(tier)
        if preload_cache == "same-nodes":    # the spare alone reads its chunk
            setup_s = fluid_read_s(np.array([data_mb / nodes]), threads, sysm) + local_s
        else:
            lost = np.linspace(0, nodes - 1, 64).round().astype(int)
            setup_s = float(np.mean([fluid_read_s(cache_misses(nodes, d) * data_mb,
                                                  threads, sysm) for d in lost])) + local_s
    if restore_from == "every":                              # each node the whole state
        restore_s = state_gb * 1000 / threads * per_mb
    else:               # one reader alone, then log2(N) hops of a broadcast tree
        restore_s = state_gb * 1000 / threads * sysm.pfs_setup_s_per_MB(1, threads) + \
            math.ceil(math.log2(max(nodes, 2))) * state_gb * 1000 / sysm.network_MBps
    step_s = batch * spec.mean_MB / sysm.compute_MBps
    out = {}
    for fault, m in base.items():
        detect = m["detect_s"] if fault == "kill" else DEADLINE_S + PROBE_S
        out[fault] = {"detect_s": detect, "start_s": m["start_s"], "store_s": setup_s,
                      "restore_s": restore_s, "first_step_s": step_s, "step_s": step_s}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path,
                   default=Path(__file__).resolve().parents[1] / "results" /
                   "recovery_2026-11-27.txt")
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--every-min", default="30,75,240",
                   help="minutes between failures (75: a Frontier study's long jobs)")
    p.add_argument("--save-ms", type=float, default=4.9,
                   help="how long a save holds the loop (recovery_bench --blocking: 4.9 "
                        "ms for the 8.4 MB state on the CPU)")
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--system", default="lassen")
    p.add_argument("--dataset", default="imagenet-1k")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--state-gb", type=float, default=0.2,
                   help="model and optimizer state at scale (ResNet-50 with momentum: 0.2)")
    p.add_argument("--save-ms-at-scale", type=float, default=12.9,
                   help="a save's hold at scale (537 MB from one H200: 12.9 ms)")
    p.add_argument("--preload-cache", choices=["none", "same-nodes", "survivors"],
                   default="none", help="at scale: each node's preload chunk kept in its "
                   "node cache, the job requeued on the same nodes (a spare for the lost "
                   "one) or re-formed on the survivors")
    p.add_argument("--restore-from", choices=["one", "every"], default="one",
                   help="at scale: the state read once and broadcast (Checkpoint's "
                        "default for a replicated state), or by every node")
    a = p.parse_args()
    base = measured(a.measured)
    scale = at_scale(a.nodes, a.system, a.dataset, a.batch, a.state_gb, base,
                     a.restore_from, a.preload_cache)
    print(f"# a {a.hours:g} h run; measured: {a.measured.name} (3 emulated nodes); "
          f"{a.nodes} nodes: {a.system} file system, {a.dataset}, batch {a.batch} a "
          f"worker, {a.state_gb:g} GB of state, restored from {a.restore_from}, preload "
          f"node cache: {a.preload_cache}; Young's checkpoint interval")
    print("\n| nodes | node lost | every | detection s | start s | store set-up s | "
          "restore s | loss to first step s | interval (steps) | replayed s | "
          "saves' hold | lost share of the run | lost hours |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, comps, save_s in ((3, base, a.save_ms / 1e3),
                                 (a.nodes, scale, a.save_ms_at_scale / 1e3)):
        for fault, c in comps.items():
            recovery = sum(c[k] for k in ("detect_s", "start_s", "store_s", "restore_s",
                                          "first_step_s"))
            for every in (float(x) for x in a.every_min.split(",")):
                share, steps = lost_share(recovery, c["step_s"], save_s, every * 60)
                replay = steps / 2 * c["step_s"]
                hold = save_s / (steps * c["step_s"])
                print(f"| {label:,} | {'killed' if fault == 'kill' else 'link cut'} | "
                      f"{every:g} min | {c['detect_s']:.1f} | {c['start_s']:.1f} | "
                      f"{c['store_s']:.1f} | {c['restore_s']:.1f} | {recovery:.1f} | "
                      f"{steps:,} | {replay:.1f} | {hold:.2%} | {share:.2%} | "
                      f"{share * a.hours:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
