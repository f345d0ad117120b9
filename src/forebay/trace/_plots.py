"""Plots of an analysed trace (matplotlib, PNG) and a self-contained HTML report."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from ._analyze import classify
from ._read import Events
from ..errors import MissingDependencyError

__all__ = ["plot_all", "write_html"]

_COLORS = {"local": "#2a9d8f", "peer": "#e9c46a", "pfs": "#e76f51", "compute": "#457b9d",
           "io": "#e76f51", "stall": "#d62828", "app_io": "#f4a261", "setup": "#9e9e9e"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the plots extra
        raise MissingDependencyError("plots need matplotlib: pip install 'forebay[plots]'") from e
    return plt


def plot_all(ev: Events, a: dict[str, Any], out: "str | Path") -> list[Path]:
    """Latency CDF per source, fetch locations per rank, per-rank timeline -> PNGs."""
    plt = _plt()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    item = (ev.cat == "data") & (ev.name == "item")
    rank = ev.rank

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in a["fetch_sources"]:
        d = np.sort(ev.dur[item & (ev.source == s)])
        if len(d):
            ax.plot(np.maximum(d, 0.1), np.arange(1, len(d) + 1) / len(d), label=s,
                    color=_COLORS.get(s))
    ax.set_xscale("log")
    ax.set_xlabel("fetch latency per sample (µs)")
    ax.set_ylabel("fraction of fetches")
    ax.set_title("Sample fetch latency by source")
    ax.grid(alpha=0.3)
    _legend(ax)
    paths.append(_save(fig, out / "latency_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    by_rank = a["fetch_sources_by_rank"]
    ranks = sorted(by_rank)
    bottom = np.zeros(len(ranks))
    for s in a["fetch_sources"]:
        v = np.array([by_rank[r].get(s, 0) for r in ranks], dtype=float)
        tot = np.array([max(sum(by_rank[r].values()), 1) for r in ranks], dtype=float)
        ax.bar([str(r) for r in ranks], v / tot, bottom=bottom, label=s, color=_COLORS.get(s))
        bottom += v / tot
    ax.set_xlabel("rank")
    ax.set_ylabel("share of sample fetches")
    ax.set_title("Where samples came from")
    _legend(ax)
    paths.append(_save(fig, out / "fetch_sources.png", plt))

    nr = max(len(set(rank.tolist())), 1)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.7 * nr))
    cls = classify(ev)
    lanes = [("compute", cls["compute"]), ("app-level I/O", cls["app_io"] & ~cls["stall"]),
             ("I/O", cls["io"]), ("stall", cls["stall"]),
             ("set-up (your `setup` regions)", ev.cat == "setup")]
    colors = [_COLORS["compute"], _COLORS["app_io"], _COLORS["io"], _COLORS["stall"],
              _COLORS["setup"]]
    for i, r in enumerate(sorted(set(rank.tolist()))):
        m = rank == r
        t0 = ev.ts[m & (ev.cat != "ai_root")].min()
        for k, ((lane, sel), color) in enumerate(zip(lanes, colors)):
            s = m & sel
            if s.any():
                ax.broken_barh(list(zip((ev.ts[s] - t0) / 1e6, ev.dur[s] / 1e6)),
                               (i + k * 0.17, 0.15), facecolors=color,
                               label=lane if i == 0 else None)
    ax.set_yticks([i + 0.4 for i in range(nr)])
    ax.set_yticklabels([f"rank {r}" for r in sorted(set(rank.tolist()))])
    ax.set_xlabel("seconds since the rank's first event")
    ax.set_title("Timeline: set-up, compute, I/O, data stalls")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    paths.append(_save(fig, out / "timeline.png", plt))
    return paths


def _legend(ax: Any, **kw: Any) -> None:
    """A legend where something was drawn with a label (matplotlib warns otherwise:
    a trace without forebay's fetch events, such as a plain DFTracer one)."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(**kw)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_html(a: dict[str, Any], summary: str, pngs: list[Path], path: "str | Path") -> Path:
    """One HTML file with the summary, the plots inlined and the JSON."""
    imgs = "".join(
        f'<img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"/>' for p in pngs)
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>forebay trace analysis"
           f"</title><style>body{{font-family:sans-serif;margin:2em}}img{{max-width:48%;"
           f"margin:.5em}}pre{{background:#f4f4f4;padding:1em;overflow:auto}}</style></head>"
           f"<body><h1>forebay trace analysis</h1><pre>{html.escape(summary)}</pre>{imgs}"
           f"<details><summary>JSON</summary><pre>{html.escape(json.dumps(a, indent=1))}"
           f"</pre></details></body></html>")
    path = Path(path)
    path.write_text(doc, encoding="utf-8")
    return path
