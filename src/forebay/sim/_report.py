"""Text tables and plots of simulator results."""

from __future__ import annotations

from typing import Any

from .._units import human_bytes
from ._engine import SOURCES


def _secs(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def format_table(res: dict[str, Any]) -> str:
    wl = res["workload"]
    lines = [f"{wl['dataset']}: {wl['samples']:,} samples, {human_bytes(wl['bytes'])}, "
             f"{wl['workers']} workers x batch {wl['batch']}, {wl['epochs']} epochs, "
             f"system {res['system']['name']}"
             + (f" (scale {wl['scale']})" if wl["scale"] != 1 else "")
             + (f", a file per sample, {res['system']['pfs_open_ms']:g} ms per open"
                if wl.get("layout") == "files" and res["system"].get("pfs_open_ms") else "")]
    best = min((v["total_s"] for n, v in res["policies"].items()
                if not v["failed"] and n != "perfect"), default=None)
    lines.append(f"{'policy':<20} {'total':>10} {'vs best':>8} {'stall':>10} {'setup':>9} "
                 f"{'AU':>6} {'PFS/sample':>10}  fetch time by source")
    for name, v in res["policies"].items():
        if v["failed"]:
            lines.append(f"{name:<20} {'failed':>10}  {v['failed']}")
            continue
        src = v["by_source"]
        tot = sum(src.values()) or 1.0
        share = ", ".join(f"{k} {100 * src[k] / tot:.0f}%" for k in SOURCES if src.get(k))
        rel = f"{v['total_s'] / best:.2f}x" if best else "-"
        au = v.get("accelerator_utilization")
        lines.append(f"{name:<20} {_secs(v['total_s']):>10} {rel:>8} {_secs(v['stall_s']):>10} "
                     f"{_secs(v['setup_s']):>9} {'-' if au is None else f'{100 * au:.0f}%':>6} "
                     f"{v['pfs_reads_per_sample']:>10.2f}  {share}")
    lines.append("AU: accelerator utilisation, compute / total time (DLIO's metric; MLPerf "
                 "Storage asks >= 90% for UNet3D and ResNet-50, >= 70% for CosmoFlow)")
    return "\n".join(lines)


def format_sweep(res: dict[str, Any]) -> str:
    head = f"{res['policy']}: total time, rows RAM, columns SSD (per worker)"
    cols = "".join(f"{human_bytes(s):>12}" for s in res["ssd_bytes"])
    lines = [head, f"{'':>12}{cols}"]
    for r, row in zip(res["ram_bytes"], res["total_s"]):
        cells = "".join(f"{(_secs(t) if t is not None else 'failed'):>12}" for t in row)
        lines.append(f"{human_bytes(r):>12}{cells}")
    return "\n".join(lines)


def plot_policies(res: dict[str, Any], path: str) -> None:
    """NoPFS Fig. 8 style: total time per policy, split into compute and stall, with
    the fetch time by source stacked beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, v in res["policies"].items() if not v["failed"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    comp = [res["policies"][n]["compute_s"] for n in names]
    stall = [res["policies"][n]["stall_s"] for n in names]
    ax1.barh(names, comp, label="compute")
    ax1.barh(names, stall, left=comp, label="stall (incl. set-up)")
    ax1.set_xlabel("seconds")
    ax1.set_title("run time")
    ax1.legend(fontsize=8)
    ax1.invert_yaxis()
    left = [0.0] * len(names)
    for k in SOURCES:
        vals = [res["policies"][n]["by_source"].get(k, 0.0) for n in names]
        if any(vals):
            ax2.barh(names, vals, left=left, label=k)
            left = [a + b for a, b in zip(left, vals)]
    ax2.set_xlabel("prefetch-thread seconds per worker")
    ax2.set_title("fetch time by source")
    ax2.legend(fontsize=8)
    ax2.invert_yaxis()
    wl = res["workload"]
    fig.suptitle(f"{wl['dataset']}, {wl['workers']} workers, {wl['epochs']} epochs, "
                 f"system {res['system']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(res: dict[str, Any], path: str) -> None:
    """NoPFS Fig. 9 style heat map of total time over RAM x SSD capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array([[np.nan if t is None else t for t in row] for row in res["total_s"]])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    im = ax.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(res["ssd_bytes"])), [human_bytes(s) for s in res["ssd_bytes"]])
    ax.set_yticks(range(len(res["ram_bytes"])), [human_bytes(r) for r in res["ram_bytes"]])
    ax.set_xlabel("SSD per worker")
    ax.set_ylabel("RAM per worker")
    for (r, c), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(c, r, _secs(v), ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, label="total seconds")
    ax.set_title(f"{res['policy']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
