"""Text tables and plots of simulator results."""

from __future__ import annotations

from typing import Any

from .._units import si_bytes
from ._engine import SOURCES


def _secs(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def format_table(res: dict[str, Any]) -> str:
    wl = res["workload"]
    lines = [f"{wl['dataset']}: {wl['samples']:,} samples, {si_bytes(wl['bytes'])}, "
             f"{wl['workers']} workers x batch {wl['batch']}, {wl['epochs']} epochs, "
             f"system {res['system']['name']}"
             + (f" (scale {wl['scale']})" if wl["scale"] != 1 else "")
             + (f", a file per sample, {res['system']['pfs_open_ms']:g} ms per open"
                if wl.get("layout") == "files" and res["system"].get("pfs_open_ms") else "")]
    if res["system"].get("model") == "thesis":
        lines.append("model: thesis (the HDMLP thesis' rule: every read of a worker's threads "
                     "gets t(gamma)/gamma; it does NOT conserve the file system's bandwidth, "
                     "see docs/sim.md)")
    best = min((v["total_s"] for n, v in res["policies"].items()
                if not v["failed"] and n != "perfect"), default=None)
    lines.append(f"{'policy':<20} {'total':>10} {'vs best':>8} {'stall':>10} {'setup':>9} "
                 f"{'1st batch':>10} {'AU':>6} {'PFS/sample':>10} {'bound':>14}  "
                 f"fetch time by source")
    for name, v in res["policies"].items():
        if v["failed"]:
            lines.append(f"{name:<20} {'failed':>10}  {v['failed']}")
            continue
        src = v["by_source"]
        tot = sum(src.values()) or 1.0
        share = ", ".join(f"{k} {100 * src[k] / tot:.0f}%" for k in SOURCES if src.get(k))
        rel = f"{v['total_s'] / best:.2f}x" if best else "-"
        au = v.get("accelerator_utilization")
        first = v.get("first_batch_s")
        lines.append(f"{name:<20} {_secs(v['total_s']):>10} {rel:>8} {_secs(v['stall_s']):>10} "
                     f"{_secs(v['setup_s']):>9} {'-' if first is None else _secs(first):>10} "
                     f"{'-' if au is None else f'{100 * au:.0f}%':>6} "
                     f"{v['pfs_reads_per_sample']:>10.2f} {v.get('binding') or '-':>14}  "
                     f"{share}")
    lines.append("bound: the resource that keeps AU lowest whatever the schedule (epoch by "
                 "epoch: PFS bandwidth or requests, network link, preprocessing, node CPU, "
                 "hand-back, compute)")
    lines.append("1st batch: time until the first batch is delivered (set-up included). "
                 "AU: accelerator utilisation, compute / total time (DLIO's metric; MLPerf "
                 "Storage asks >= 90% for UNet3D and ResNet-50, >= 70% for CosmoFlow)")
    return "\n".join(lines)


def format_sweep(res: dict[str, Any]) -> str:
    head = (f"{res['policy']}: total time, rows RAM, columns SSD (per worker"
            + (f", at full scale; simulated at scale {res['scale']:g})"
               if res.get("scale", 1) != 1 else ")"))
    cols = "".join(f"{si_bytes(s):>12}" for s in res["ssd_bytes"])
    lines = [head, f"{'':>12}{cols}"]
    for r, row in zip(res["ram_bytes"], res["total_s"]):
        cells = "".join(f"{(_secs(t) if t is not None else 'failed'):>12}" for t in row)
        lines.append(f"{si_bytes(r):>12}{cells}")
    return "\n".join(lines)


def format_plan(res: dict[str, Any]) -> str:
    """The answer of :func:`plan_capacity` as text."""
    scale = res.get("scale", 1.0)
    lines = [f"{res['policy']}: the smallest capacity per worker reaching AU >= "
             f"{res['target_au']:.0%} (dataset {si_bytes(res['dataset_bytes'])}, "
             f"{res['workers']} workers, {res['epochs']} epochs; {res['runs']} simulated runs"
             + (f" at scale {scale:g}, capacities given at full scale" if scale != 1 else "")
             + ")"]
    for o in res["options"]:
        other = "SSD 0" if o["tier"] == "ram" else "RAM 0"
        au = o["accelerator_utilization"]
        got = "-" if au is None else f"{au:.1%}"
        if o["reached"]:
            lines.append(f"  {o['tier'].upper():<4} {si_bytes(o['bytes']):>10} per worker "
                         f"({other}): AU {got}, total {o['total_s']:.1f} s")
        else:
            lines.append(f"  {o['tier'].upper():<4} not reachable: AU {got} even with the whole "
                         f"dataset per worker ({other})"
                         + (f"; {o['failed']}" if o["failed"] else _binding(o)))
    return "\n".join(lines)


def _binding(o: dict[str, Any]) -> str:
    """Why a target is out of reach: the resource whose least time bounds the AU."""
    need, what = o.get("need_s") or {}, o.get("binding")
    if not what or what not in need:
        return ""
    detail = ""
    if what == "PFS bandwidth":
        detail = (f" ({o['pfs_MB'] / 1e3:,.1f} GB from the file system at most "
                  f"{o['pfs_MBps_max']:,.0f} MB/s, its table's largest rate)")
    elif what == "node CPU" and o.get("node_cpus"):
        detail = (f" ({need[what] * o['node_cpus']:,.1f} CPU-seconds of preprocessing a "
                  f"node, on "
                  f"{o['node_cpus']:g} core{'s' if o['node_cpus'] != 1 else ''})")
    n = o.get("binding_epochs") or 0
    return (f": bound by {what}{detail}, which outlasts compute in {n} of {o['epochs']} "
            f"epoch{'s' if o['epochs'] != 1 else ''}; no schedule gets AU above "
            f"{o['au_bound']:.1%}")


_UNIT_WORD = {"s": "seconds", "min": "minutes", "h": "hours"}


def _unit(top: float) -> tuple[str, float]:
    """The unit :func:`_secs` would print ``top`` in, and its seconds."""
    return ("h", 3600.0) if top >= 3600 else ("min", 60.0) if top >= 60 else ("s", 1.0)


def _title(res: dict[str, Any]) -> str:
    wl, sysm = res["workload"], res["system"]
    scale = f" at scale {wl['scale']:g}" if wl.get("scale", 1) != 1 else ""
    comp = f", compute {sysm['compute_MBps']:g} MB/s per worker" \
        if sysm.get("compute_MBps") else ""
    return (f"{wl['dataset']}{scale} ({wl['samples']:,} samples, {si_bytes(wl['bytes'])}), "
            f"{wl['workers']} workers, {wl['epochs']} epochs, system {sysm['name']}{comp}")


def plot_policies(res: dict[str, Any], path: str) -> None:
    """NoPFS Fig. 8 style: total time per policy, split into compute and stall, with
    the fetch time by source stacked beside it.  Each bar carries its value (a fetch
    time of milliseconds beside one of seconds stays readable); a failed policy keeps
    its row, marked with why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = res["policies"]
    names = list(pol)
    ok = [not pol[n]["failed"] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.9 + 0.33 * len(names)))
    comp = [pol[n]["compute_s"] if k else 0.0 for n, k in zip(names, ok)]
    stall = [pol[n]["stall_s"] if k else 0.0 for n, k in zip(names, ok)]
    top = max([c + st for c, st in zip(comp, stall)], default=1.0) or 1.0
    unit, div = _unit(top)                       # the axis in the table's unit
    # greys here, colours for the sources beside: no colour means two things
    ax1.barh(names, [c / div for c in comp], label="compute", color="0.35")
    ax1.barh(names, [st / div for st in stall], left=[c / div for c in comp],
             label="stall (incl. set-up)", color="0.75")
    for i, n in enumerate(names):
        text = _secs(comp[i] + stall[i]) if ok[i] else f"failed: {str(pol[n]['failed'])[:90]}"
        ax1.text((comp[i] + stall[i] + 0.01 * top) / div, i, text, va="center", fontsize=7)
    ax1.set_xlim(0, top * 1.25 / div)
    ax1.set_xlabel(_UNIT_WORD[unit])
    ax1.set_title("run time")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.invert_yaxis()
    left = [0.0] * len(names)
    # the set-up phase's loading (wall seconds) first, then the steps' fetches by source
    setup = [pol[n]["setup_s"] or 0.0 if okk else 0.0 for n, okk in zip(names, ok)]
    top2 = max((sum(pol[n]["by_source"].values()) + su for n, okk, su in
                zip(names, ok, setup) if okk), default=1.0) or 1.0
    unit2, div2 = _unit(top2)
    series = [("set-up load", setup, "0.55")] + [
        (k, [pol[n]["by_source"].get(k, 0.0) if okk else 0.0 for n, okk in zip(names, ok)],
         f"C{j}") for j, k in enumerate(SOURCES)]
    for k, vals, color in series:
        if any(vals):
            ax2.barh(names, [v / div2 for v in vals], left=[x / div2 for x in left], label=k,
                     color=color)
            left = [a + b for a, b in zip(left, vals)]
    for i in range(len(names)):
        if ok[i]:
            t = left[i]
            ax2.text((t + 0.01 * top2) / div2, i, "0" if t == 0 else _secs(t) if t >= 0.01
                     else f"{t * 1e3:.2f} ms", va="center", fontsize=7)
    ax2.set_xlim(0, top2 * 1.25 / div2)
    ax2.set_xlabel(f"{_UNIT_WORD[unit2]} per worker (set-up: wall; sources: prefetch-thread)")
    ax2.set_title("fetch time: set-up load, then by source")
    ax2.legend(fontsize=8, loc="lower right")
    ax2.invert_yaxis()
    fig.suptitle(_title(res), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(res: dict[str, Any], path: str) -> None:
    """NoPFS Fig. 9 style heat map of total time over RAM x SSD capacity: cells and
    colour bar in one unit (s, min or h, from the largest cell), a logarithmic colour
    scale when the cells span more than 10x, failed cells marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FormatStrFormatter

    grid = np.array([[np.nan if t is None else t for t in row] for row in res["total_s"]],
                    dtype=np.float64)
    top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
    unit, div = _unit(float(top))
    g = grid / div
    fin = g[np.isfinite(g)]
    norm = LogNorm(vmin=fin.min(), vmax=fin.max()) \
        if len(fin) and fin.min() > 0 and fin.max() > 10 * fin.min() else None
    # colours span at least 10% of the largest cell: a 0.5% spread is not drawn as the
    # whole colour map, and its cells get a digit more
    lo = min(fin.min(), fin.max() / 1.1) if len(fin) and norm is None else None
    digits = 3 if not len(fin) or fin.min() <= 0 or fin.max() >= 1.1 * fin.min() else 4
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    im = ax.imshow(g, origin="lower", cmap="viridis_r", aspect="auto", norm=norm,
                   vmin=lo, vmax=fin.max() if lo is not None else None)
    ax.set_xticks(range(len(res["ssd_bytes"])), [si_bytes(s) for s in res["ssd_bytes"]])
    ax.set_yticks(range(len(res["ram_bytes"])), [si_bytes(r) for r in res["ram_bytes"]])
    ax.set_xlabel("SSD per worker")
    ax.set_ylabel("RAM per worker")
    rgba = np.asarray(im.cmap(np.ma.masked_invalid(im.norm(g))))
    light = rgba[..., :3] @ np.array([0.299, 0.587, 0.114])
    for (r, c), v in np.ndenumerate(g):
        # white on the dark end of the map, black on the light one and on failed cells
        color = "w" if np.isfinite(v) and light[r, c] < 0.5 else "k"
        ax.text(c, r, f"{v:.{digits}g}" if np.isfinite(v) else "failed", ha="center",
                va="center", fontsize=7, color=color)
    bar = fig.colorbar(im, label=f"total time ({unit}{', log scale' if norm else ''})")
    fmt = FormatStrFormatter("%.3g")
    bar.ax.yaxis.set_major_formatter(fmt)
    bar.ax.yaxis.set_minor_formatter(fmt)
    scale = res.get("scale", 1.0)
    ax.set_title(f"{res['policy']}: total time in {unit}" +
                 (" (all cells equal)" if len(fin) and fin.min() == fin.max() else "") +
                 (f"\ntimes of the run simulated at scale {scale:g}; capacities at full scale"
                  if scale != 1 else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
