"""``forebay plan``, ``simulate`` and ``calibrate``: the access plan's analysis, the
simulator of I/O policies, and the measured profile both use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, UsageError
from ..world import detect
from ._args import (add_mix_args, count_int, fraction, mixture_of, nonneg_float,
                    positive_float, positive_int, progress, sizes_list)

__all__ = ["register"]


def cmd_plan(a: argparse.Namespace) -> int:
    from ..plan import AccessPlan, frequency_tail, frequency_tail_monte_carlo

    mix = mixture_of(a)
    if mix is not None:
        return _plan_mixture(a, mix)
    if a.samples is None:
        raise UsageError("forebay plan needs --samples F, or a mixture (--mix SOURCE=WEIGHT)")
    mean = a.epochs / a.world
    k0 = int(np.ceil((1 + a.delta) * mean))
    analytic = frequency_tail(a.samples, a.world, a.epochs, a.delta)
    print(f"F={a.samples:,} samples, N={a.world} workers, E={a.epochs} epochs, delta={a.delta}")
    print(f"each worker reads a sample {mean:.2f} times on average; samples read at least "
          f"{k0} times by a given worker:")
    print(f"  analytic (binomial):  {analytic:,.1f}")
    if a.monte_carlo:
        plan = AccessPlan(a.samples, a.world, a.batch_size, a.epochs, a.seed)
        mc = frequency_tail_monte_carlo(plan, a.delta, progress=progress())
        print(f"  Monte Carlo (seed {a.seed}, mean over workers): {mc:,.1f}")
    return 0

def _plan_mixture(a: argparse.Namespace, mix: Any) -> int:
    """Each source's share of the epochs and how often a worker reads its samples."""
    from ..plan import AccessPlan, read_counts
    from ..sim import dataset_sizes

    sizes = [len(dataset_sizes(p, seed=a.seed + i)[0]) for i, p in enumerate(mix.paths)]
    order = mix.order(sizes)
    plan = AccessPlan(sum(sizes), a.world, a.batch_size, a.epochs, a.seed, order=order)
    shares = np.array([order.counts(e) for e in range(a.epochs)])   # [epochs, sources]
    print(f"mixture of {len(sizes)} sources, policy {mix.policy}: {plan.epoch_length:,} "
          f"positions per epoch ({plan.steps_per_epoch:,} steps of {plan.global_batch}), "
          f"N={a.world} workers, E={a.epochs} epochs")
    if a.monte_carlo:
        counts = read_counts(plan, progress=progress())
    name_w = max(len("source"), *(len(p) for p in mix.paths))
    head = f"{'source':<{name_w}} {'samples':>10} {'weight':>7} {'per epoch':>10} " \
           f"{'reads/sample':>13}"
    if a.monte_carlo:
        head += f" {'hot (>= k0 by a worker)':>24}"
    print(head)
    start = 0
    for i, p in enumerate(mix.paths):
        n = sizes[i]
        reads = shares[:, i].sum() / n          # over the run, all workers together
        row = f"{p:<{name_w}} {n:>10,} {order.weights_at(0)[i]:>7.3f} " \
              f"{shares[0, i]:>10,} {reads:>13.2f}"
        if a.monte_carlo:
            k0 = int(np.ceil((1 + a.delta) * reads / a.world))
            hot = (counts[:, start:start + n] >= max(k0, 1)).sum(axis=1).mean()
            row += f" {hot:>14,.1f} (k0={k0})"
        print(row)
        start += n
    if len(mix.schedule) > 1:
        print("weights change at epochs " + ", ".join(str(e) for e, _ in mix.schedule[1:]))
    print("reads/sample: how often each of the source's samples is read over the run "
          "(all workers; 'sample' draws them, these are the expected shares)")
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from pathlib import Path

    from ..sim import POLICIES, PRESETS, load_system, simulate, sweep
    from ..sim import format_sweep, format_table, plot_policies, plot_sweep

    if a.target_au is not None and a.mode != "plan":
        raise InvalidArgumentError(f"--target-au is for 'simulate plan' (this is 'simulate "
                                   f"{a.mode}'): forebay simulate plan --target-au "
                                   f"{a.target_au:g} ...")
    names = [p for p in (a.policies or "").split(",") if p.strip()]
    if a.mode in ("plan", "sweep") and len(names) > 1:
        raise InvalidArgumentError(f"simulate {a.mode} takes one policy, got "
                                   f"{len(names)} ({a.policies})")
    if a.system not in PRESETS and not Path(a.system).exists():
        raise InvalidArgumentError(f"--system {a.system!r} is neither a preset "
                                   f"({', '.join(PRESETS)}) nor a system file")
    sysm = load_system(a.system, compute_MBps=a.compute_MBps,
                       preprocess_MBps=a.preprocess_MBps, network_MBps=a.network_MBps,
                       pfs_open_ms=a.pfs_open_ms)
    if a.cpus is not None:
        from dataclasses import replace

        sysm = replace(sysm, cpus=a.cpus)
    kw = dict(workers=a.workers, epochs=a.epochs, batch=a.batch, scale=a.scale, seed=a.seed,
              layout=a.layout)
    mix = mixture_of(a)
    if (mix is None) == (a.dataset is None):
        raise UsageError("simulate needs --dataset, or a mixture (--mix SOURCE=WEIGHT ...), "
                         "not both")
    dataset = a.dataset if mix is None else mix
    if a.mode == "plan":
        from ..sim import format_plan, plan_capacity

        if a.target_au is None:
            raise InvalidArgumentError("simulate plan needs --target-au, e.g. 0.9")
        policy = (a.policies or "forebay-clairvoyant").split(",")[0]
        res = plan_capacity(sysm, dataset, target_au=a.target_au, policy=policy,
                            progress=progress(), **kw)
        print(format_plan(res))
    elif a.mode == "sweep":
        if not a.ram or not a.ssd:
            raise InvalidArgumentError("simulate sweep needs --ram and --ssd lists, e.g. "
                             "--ram 0,60GB,120GB --ssd 0,450GB,900GB")
        policy = (a.policies or "forebay-clairvoyant").split(",")[0]
        res = sweep(sysm, dataset, ram_bytes=_capacity(a.ram, "ram"),
                    ssd_bytes=_capacity(a.ssd, "ssd"),
                    policy=policy, **kw)
        print(format_sweep(res))
        if a.plot:
            plot_sweep(res, a.plot)
            print(f"wrote {a.plot}")
    else:
        sysm = _capacities(a, sysm)
        names = a.policies.split(",") if a.policies else list(POLICIES)
        res = simulate(sysm, dataset, policies=names, progress=progress(), **kw)
        print(format_table(res))
        if a.plot:
            plot_policies(res, a.plot)
            print(f"wrote {a.plot}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0

def _capacity(text: str, flag: str) -> list[int]:
    """Sizes for --ram/--ssd: each with its unit (60GB, 60GiB), or 0.  A bare number
    is refused: "--ram 60" meant 60 bytes, and the caching policies then failed."""
    for t in text.split(","):
        t = t.strip()
        if t.replace(".", "", 1).isdigit() and float(t) != 0:
            raise InvalidArgumentError(f"--{flag} {t}: give a unit ({t}GB, {t}GiB, {t}MB); "
                                       f"a bare number would be {t} bytes")
    return sizes_list(text)


def _capacities(a: argparse.Namespace, sysm: Any) -> Any:
    """``--ram``/``--ssd`` (one size each) override the system's tier capacities; a
    system file without ``[tiers]`` (as `forebay calibrate` writes it) and neither flag
    is said, not silently simulated with nothing to cache in."""
    import dataclasses

    from ..errors import InvalidArgumentError
    from ..sim import PRESETS
    from ..store import load_profile

    over: dict[str, int] = {}
    for flag, field in (("ram", "ram_bytes"), ("ssd", "ssd_bytes")):
        v = getattr(a, flag)
        if v:
            sizes = _capacity(v, flag)
            if len(sizes) != 1:
                raise InvalidArgumentError(f"--{flag} takes one size here (a list is for "
                                           f"'simulate sweep')")
            over[field] = sizes[0]
    path = Path(a.system)
    if not over and a.system not in PRESETS:
        if "tiers" not in load_profile(path):     # read and checked by load_system already
            print(f"note: {path} has no [tiers]: the caching policies get 0 B of RAM and "
                  f"SSD per worker; add [tiers] ram_bytes = ..., ssd_bytes = ... or pass "
                  f"--ram SIZE --ssd SIZE", file=sys.stderr)
    return dataclasses.replace(sysm, **over) if over else sysm

def cmd_calibrate(a: argparse.Namespace) -> int:
    from ..store import calibrate, dump_profile, load_profile

    comm = None
    if detect().is_mpi:
        from mpi4py import MPI   # under mpiexec: also measure gets from a peer's memory

        comm = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() >= 2 else None
    prof = calibrate(ssd_dir=a.ssd_dir, dataset=a.dataset, comm=comm, progress=progress())
    if comm is not None and comm.Get_rank() != 0:
        return 0                 # rank 0 writes and prints the profile
    text = dump_profile(prof)
    if a.out:
        from pathlib import Path

        Path(a.out).write_text(text)
        load_profile(a.out)  # what we write must read back
        print(f"wrote {a.out}")
    print(text, end="")
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``forebay`` parser."""
    pl = sub.add_parser("plan", help="access-frequency analysis of a shuffled run (NoPFS 3.1)")
    pl.add_argument("--samples", "-F", type=positive_int, default=None,
                    help="dataset size (or --mix)")
    pl.add_argument("--world", "-N", type=positive_int, required=True)
    pl.add_argument("--epochs", "-E", type=positive_int, required=True)
    pl.add_argument("--delta", type=positive_float, default=0.8,
                    help="NoPFS's delta > 0: count the samples a worker reads at least "
                         "(1 + delta) x the mean number of times (default 0.8)")
    pl.add_argument("--monte-carlo", action="store_true",
                    help="also count on a real AccessPlan (vectorized; ~30 s for ImageNet-1k)")
    pl.add_argument("--batch-size", type=positive_int, default=32,
                    help="per-rank batch (Monte Carlo)")
    pl.add_argument("--seed", type=count_int, default=0)
    add_mix_args(pl, "a dataset directory, scenario or normal:MEAN_MB,SD_MB,COUNT")
    pl.set_defaults(func=cmd_plan)

    sm = sub.add_parser("simulate", help="simulate I/O policies for a workload (NoPFS's model)",
                        description="Simulate training I/O policies with NoPFS's performance "
                        "model, using forebay's own placement code. 'simulate sweep' varies "
                        "RAM and SSD capacity (NoPFS Fig. 9).")
    sm.add_argument("mode", nargs="?", choices=["run", "sweep", "plan"], default="run",
                    help="run: the policies side by side; sweep: a RAM x SSD grid; plan: "
                    "the smallest RAM or SSD per worker reaching --target-au")
    sm.add_argument("--target-au", dest="target_au", type=fraction, default=None,
                    help="plan: the accelerator utilisation to reach, e.g. 0.9")
    sm.add_argument("--system", default="lassen",
                    help="preset (lassen, hdmlp-thesis) or a TOML profile from forebay "
                    "calibrate")
    sm.add_argument("--dataset", default=None,
                    help="scenario (mnist, imagenet-1k, openimages, imagenet-22k, cosmoflow, "
                         "cosmoflow-512), normal:MEAN_MB,SD_MB,COUNT (sizes drawn from a "
                         "normal distribution) or a packed dataset directory")
    sm.add_argument("--workers", type=positive_int, required=True)
    sm.add_argument("--epochs", type=positive_int, required=True)
    sm.add_argument("--batch", type=positive_int, default=None,
                    help="per-worker batch (default: the scenario's, or 32)")
    sm.add_argument("--policies", default=None, help="comma-separated (default: all)")
    sm.add_argument("--scale", type=fraction, default=1.0, help="simulate this fraction of the "
                    "samples, RAM and SSD scaled alike (default 1)")
    sm.add_argument("--seed", type=count_int, default=0)
    sm.add_argument("--compute-MBps", dest="compute_MBps", type=positive_float, default=None,
                    help="training throughput c per worker (overrides the system)")
    sm.add_argument("--preprocess-MBps", dest="preprocess_MBps", type=positive_float,
                    default=None)
    sm.add_argument("--network-MBps", dest="network_MBps", type=positive_float, default=None)
    sm.add_argument("--cpus", type=positive_float, default=None,
                    help="cores per node, shared by its prefetch threads (overrides "
                    "[compute] cpus; default: a core per thread)")
    sm.add_argument("--pfs-open-ms", dest="pfs_open_ms", type=nonneg_float, default=None,
                    help="latency of opening one file on the PFS (overrides [pfs] open_ms; "
                    "paid per sample read with --layout files)")
    sm.add_argument("--layout", choices=["files", "packed"], default=None,
                    help="samples as a file each on the PFS, or one packed dataset (default: "
                    "files for a scenario, packed for a dataset directory)")
    sm.add_argument("--ram", help="RAM per worker for caching, overriding the system's "
                    "(sweep: a list, e.g. 0,60GB,120GB)")
    sm.add_argument("--ssd", help="SSD per worker for caching, overriding the system's "
                    "(sweep: a list, e.g. 0,450GB,900GB)")
    add_mix_args(sm, "each a scenario, normal:MEAN_MB,SD_MB,COUNT or a packed dataset; "
                     "instead of --dataset")
    sm.add_argument("--json", help="write the results as JSON")
    sm.add_argument("--plot", help="write a PNG (stacked bars; heat map for sweep)")
    sm.set_defaults(func=cmd_simulate)

    c = sub.add_parser("calibrate", help="measure tier and file-system bandwidths (and, under "
                       "mpiexec -n 2, one-sided gets from a peer), write a TOML profile")
    c.add_argument("--out", help="profile file to write (TOML)")
    c.add_argument("--ssd-dir", help="node-local directory to measure as the SSD tier")
    c.add_argument("--dataset", help="packed dataset on the parallel file system to measure")
    c.set_defaults(func=cmd_calibrate)
