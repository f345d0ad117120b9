"""``forebay analyze`` and ``forebay trace export``: I/O traces summarised, plotted and
exported."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ._args import progress

__all__ = ["register"]


def _trace_input(path: str) -> None:
    """A trace directory or file that exists and holds trace files (checked before any
    work or output)."""
    from ..errors import PathNotFoundError
    from ..trace._read import trace_files

    if not Path(path).exists():
        raise PathNotFoundError(f"no trace directory or file at {path}")
    if not trace_files(path):
        raise InvalidArgumentError(f"{path}: no trace files (*.pfw, *.pfw.gz, *.json, "
                                   f"*.json.gz) in it or in its sub-directories")

def cmd_analyze(a: argparse.Namespace) -> int:
    from ..trace import analyze, format_summary, plot_all, read_traces, write_html

    _trace_input(a.trace_dir)
    prog = progress()
    prog.start(None, "reading the trace", unit="event")
    with prog:
        if a.plots or a.html:   # the plots draw every event: only then are they all held
            ev = read_traces(a.trace_dir, progress=prog)
            res = analyze(a.trace_dir, events=ev)
        else:                   # a stream: memory does not grow with the trace
            ev, res = None, analyze(a.trace_dir, progress=prog)
    if not res["events"] and res["skipped"]:
        raise InvalidArgumentError(
            f"{a.trace_dir}: nothing in it could be read as a trace ("
            + "; ".join(res["skipped"][:3])
            + (f"; +{len(res['skipped']) - 3} more" if len(res["skipped"]) > 3 else "") + ")")
    summary = format_summary(res)
    print(summary)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    if ev is not None:
        pngs = plot_all(ev, res, a.plots or Path(a.html).with_suffix("").as_posix() + "_plots")
        print("wrote " + ", ".join(str(p) for p in pngs))
        if a.html:
            write_html(res, summary, pngs, a.html)
            print(f"wrote {a.html}")
    return 0 if res["events"] else 1

def cmd_trace_export(a: argparse.Namespace) -> int:
    from ..trace import export_chrome

    _trace_input(a.trace_dir)
    r = export_chrome(a.trace_dir, a.out)
    for s in r["skipped"]:
        print(f"skipped: {s}", file=sys.stderr)
    print(f"wrote {a.out}: {r['events']:,} events of {r['ranks']} rank(s), for Perfetto "
          f"(ui.perfetto.dev) or chrome://tracing")
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``forebay`` parser."""
    an = sub.add_parser("analyze", help="summarize I/O traces (forebay's and DFTracer's)",
                        description="Summarize every .pfw/.pfw.gz/.json trace in a directory: "
                        "time split (compute, app-level I/O, I/O, overlapped or not), data "
                        "stalls, fetch latency per source, where samples came from, bytes "
                        "read from the dataset files, per-event statistics, imbalance.")
    an.add_argument("trace_dir")
    an.add_argument("--json", metavar="OUT", help="write the full analysis as JSON")
    an.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    an.add_argument("--html", metavar="OUT", help="write a self-contained HTML report")
    an.set_defaults(func=cmd_analyze)

    tr = sub.add_parser("trace", help="trace files: export for Perfetto")
    trs = tr.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    te = trs.add_parser("export", help="write one Chrome-format JSON for Perfetto / "
                        "chrome://tracing")
    te.add_argument("trace_dir")
    te.add_argument("out", help="output file (.json or .json.gz)")
    te.set_defaults(func=cmd_trace_export)
