"""forebay.sim: NoPFS's performance model (§4) and an I/O policy simulator (§6) that
shares its placement and fetch-path code with the runtime.

    from forebay.sim import simulate
    report = simulate("lassen", "imagenet-1k", workers=4, epochs=3, batch=32, scale=0.01)
    report["policies"]["forebay-clairvoyant"]["total_s"]
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Optional

import numpy as np

from ..mixture import Mixture
from ..plan import AccessPlan
from ._datasets import SCENARIOS, DatasetSpec, dataset_sizes
from ._engine import SOURCES, timeline
from ._policies import POLICIES, simulate_policy
from ._run import Workload
from ._report import format_plan, format_sweep, format_table, plot_policies, plot_sweep
from ._system import PRESETS, System, hdmlp_thesis, lassen, load_system, system_from_profile
from ..errors import InvalidArgumentError

__all__ = ["simulate", "sweep", "System", "lassen", "hdmlp_thesis", "load_system", "PRESETS",
           "system_from_profile",
           "POLICIES", "SCENARIOS", "SOURCES", "DatasetSpec", "Workload", "dataset_sizes",
           "simulate_policy", "timeline",
           "format_sweep", "format_table", "plot_policies", "plot_sweep", "plan_capacity",
           "format_plan"]


def simulate(system: "System | str | os.PathLike[str]",
             dataset: "str | os.PathLike[str] | Mixture", *,
             workers: int, epochs: int, batch: Optional[int] = None,
             policies: Optional[Iterable[str]] = None, scale: float = 1.0, seed: int = 0,
             layout: Optional[str] = None, progress: Any = None) -> dict[str, Any]:
    """Simulate ``policies`` (default: all) for one workload.

    Args:
        system: a :class:`System`, a preset name (``"lassen"``) or a TOML profile.
        dataset: a scenario name (:data:`SCENARIOS`), ``normal:MEAN_MB,SD_MB,COUNT``,
            a packed dataset directory, or a :class:`~forebay.Mixture` whose sources
            are any of these (its rule decides what each epoch reads).
        workers: data-parallel workers N (one per node, as in NoPFS §4).
        batch: per-worker batch size; default the scenario's (32 when a directory).
        scale: simulate this fraction of the samples with every tier capacity scaled
            by the same factor (the same scenario case, fewer samples).
        layout: ``"files"`` (a file per sample: every PFS read also pays the system's
            ``pfs_open_ms``) or ``"packed"`` (one packed dataset, opened once); default
            files for a scenario, packed for a dataset directory.

    Returns ``{"workload": {...}, "system": {...}, "policies": {name: {total_s, stall_s,
    setup_s, compute_s, by_source, fetches, pfs_reads, epoch_s, failed, ...}}}``.
    """
    from ..progress import as_progress

    sysm = system if isinstance(system, System) else load_system(system)
    order = None
    if isinstance(dataset, Mixture):   # each source's sizes, read by the mixture's rule
        parts = [dataset_sizes(p, scale=scale, seed=seed + i)
                 for i, p in enumerate(dataset.paths)]
        sizes, spec = np.concatenate([sz for sz, _ in parts]), parts[0][1]
        order = dataset.order([len(sz) for sz, _ in parts])
    else:
        sizes, spec = dataset_sizes(dataset, scale=scale, seed=seed)
    if scale < 1:
        sysm = sysm.scaled(scale)
    if batch is not None and batch <= 0:
        raise InvalidArgumentError(f"batch must be a positive integer, got {batch}")
    batch = min(batch or (spec.batch if spec else 32), len(sizes))
    if layout not in (None, "files", "packed"):
        raise InvalidArgumentError(f"layout must be 'files' or 'packed', got {layout!r}")
    layout = layout or ("files" if spec else "packed")
    plan = AccessPlan(num_samples=len(sizes), world_size=workers, batch_size=batch,
                      epochs=epochs, seed=seed, order=order)
    w = Workload(sizes, plan, sysm, per_file=layout == "files")
    if workers * batch > len(sizes):
        raise InvalidArgumentError(
            f"{workers:,} workers x batch {batch} need {workers * batch:,} samples per step; "
            f"the dataset has {len(sizes):,}" + (f" at scale {scale:g}" if scale < 1 else "")
            + ": every step would read samples twice (fewer workers, a smaller --batch or a "
              "larger --scale)")
    if workers * len(sizes) > 2e9:
        import warnings

        warnings.warn(f"{workers} workers x {len(sizes):,} samples: the per-worker policies "
                      f"cost O(workers x samples) here (forebay-clairvoyant computes every "
                      f"worker's extra copies); this may take long. --scale simulates "
                      f"the same case with fewer samples", RuntimeWarning, stacklevel=2)
    names = list(policies) if policies else list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise InvalidArgumentError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    out: dict[str, Any] = {}
    prog = as_progress(progress)
    prog.start(len(names), desc="simulate", unit="policy")
    for name in names:
        t0 = time.perf_counter()
        res = simulate_policy(name, w)
        res["sim_seconds"] = round(time.perf_counter() - t0, 3)
        out[name] = res
        prog.update(1)
    prog.close()
    return {"workload": {"dataset": str(dataset), "samples": len(sizes),
                         "bytes": int(sizes.sum()), "workers": workers, "epochs": epochs,
                         "batch": batch, "scale": scale, "seed": seed, "layout": layout,
                         "scenario": spec.note if spec else None},
            "system": sysm.describe(), "policies": out}


def sweep(system: "System | str | os.PathLike[str]",
          dataset: "str | os.PathLike[str] | Mixture", *,
          ram_bytes: Iterable[int], ssd_bytes: Iterable[int], policy: str = "forebay-clairvoyant",
          **kw: Any) -> dict[str, Any]:
    """Total time of ``policy`` over a grid of RAM and SSD capacities per worker (NoPFS
    Fig. 9).  Capacities are given at full scale (``scale`` shrinks them with the
    dataset).  Returns ``{"ram_bytes": [...], "ssd_bytes": [...], "total_s": [[...]]}``
    with one row per RAM capacity."""
    from dataclasses import replace

    sysm = system if isinstance(system, System) else load_system(system)
    rams, ssds = list(ram_bytes), list(ssd_bytes)
    grid = []
    for r in rams:
        row = []
        for s in ssds:
            rep = simulate(replace(sysm, ram_bytes=int(r), ssd_bytes=int(s)), dataset,
                           policies=[policy], **kw)
            row.append(rep["policies"][policy]["total_s"])
        grid.append(row)
    return {"policy": policy, "ram_bytes": rams, "ssd_bytes": ssds, "total_s": grid,
            "scale": kw.get("scale", 1.0)}


def plan_capacity(system: "System | str | os.PathLike[str]",
                  dataset: "str | os.PathLike[str] | Mixture",
                  *, target_au: float, policy: str = "forebay-clairvoyant",
                  tiers: Iterable[str] = ("ram", "ssd"), rel_tol: float = 0.02,
                  progress: Any = None, **kw: Any) -> dict[str, Any]:
    """The smallest RAM (SSD left at 0), and the smallest SSD (RAM at 0), per worker at
    full scale with which ``policy`` reaches accelerator utilisation ``target_au``:
    what to ask for before queueing.  A bisection between 0 and the whole dataset per
    worker, to ``rel_tol`` of the dataset's bytes (AU grows with capacity for the
    caching policies; each answer is one the simulator ran, never an interpolation).

    Returns ``{"target_au", "policy", "dataset_bytes", "options": [{"tier", "bytes",
    "accelerator_utilization", "total_s", "reached"}], "runs"}``; an option that cannot
    reach the target even with the whole dataset per worker says so, with the AU it
    gets there.
    """
    from dataclasses import replace

    from ..progress import as_progress

    if not 0 < target_au <= 1:
        raise InvalidArgumentError(f"target AU must be in (0, 1], got {target_au}")
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    sysm = system if isinstance(system, System) else load_system(system)
    scale = kw.get("scale", 1.0)
    runs = 0

    def run(ram: int, ssd: int) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        prog.update(1)
        rep = simulate(replace(sysm, ram_bytes=ram, ssd_bytes=ssd), dataset,
                       policies=[policy], **kw)
        r = rep["policies"][policy]
        r["dataset_bytes"] = rep["workload"]["bytes"]
        return r

    def au(r: dict[str, Any]) -> float:
        return -1.0 if r["failed"] or r["accelerator_utilization"] is None \
            else float(r["accelerator_utilization"])

    prog = as_progress(progress)
    prog.start(None, desc="plan", unit="run")
    nothing = run(0, 0)                          # no capacity: the same for every tier
    full = int(nothing["dataset_bytes"] / scale)     # the dataset at full scale
    options = []
    for tier in tiers:
        if tier not in ("ram", "ssd"):
            raise InvalidArgumentError(f"tier must be 'ram' or 'ssd', got {tier!r}")

        def at(b: int, tier: str = tier) -> dict[str, Any]:
            return run(b, 0) if tier == "ram" else run(0, b)

        lo_r, hi_r = nothing, at(full)
        if au(lo_r) >= target_au:
            best, b, reached = lo_r, 0, True
        elif au(hi_r) < target_au:
            best, b, reached = hi_r, full, False
        else:
            lo, hi, best = 0, full, hi_r
            while hi - lo > rel_tol * full:
                mid = (lo + hi) // 2
                r = at(mid)
                if au(r) >= target_au:
                    hi, best = mid, r
                else:
                    lo = mid
            b, reached = hi, True
        options.append({"tier": tier, "bytes": b, "reached": reached,
                        "accelerator_utilization": best["accelerator_utilization"],
                        "total_s": best["total_s"], "failed": best["failed"],
                        "epochs": kw.get("epochs"),
                        **{k: best.get(k) for k in ("binding", "need_s", "au_bound",
                                                    "binding_epochs", "pfs_MB",
                                                    "pfs_MBps_max", "node_cpus")}})
    prog.close()
    return {"target_au": target_au, "policy": policy, "dataset_bytes": full,
            "workers": kw.get("workers"), "epochs": kw.get("epochs"), "scale": scale,
            "options": options, "runs": runs}

