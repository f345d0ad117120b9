"""Trace files -> one Chrome Trace Event JSON file for Perfetto / chrome://tracing.

DFTracer 2.x writes ``ph`` as an integer (1 complete, 2 counter, 4 metadata); the Chrome
format that Perfetto's JSON importer and chrome://tracing read wants the letters ("X",
"C", "M"), ``ts``/``dur`` in microseconds, and ``pid``/``tid`` integers.  Each rank
becomes one process track named after it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from ._read import _lines, _records, trace_files

__all__ = ["export_chrome"]

_PH: dict[Any, Any] = {1: "X", 2: "C", 3: "X", 4: "M"}


def _ranks(files: list[Path]) -> dict[tuple, int]:
    """(hhash, pid) -> rank, from the files' ``start`` records (a first pass that parses
    only the lines naming ``start``: a rank may be needed before its file is read)."""
    ranks: dict[tuple, int] = {}
    for path in files:
        for _, line in _lines(path, []):
            if '"start"' not in line:
                continue
            try:
                e = json.loads(line.strip().rstrip(",").lstrip("["))
            except (ValueError, RecursionError):
                continue
            args = e.get("args") if isinstance(e, dict) else None
            if isinstance(args, dict) and e.get("name") == "start":
                try:
                    ranks[(args.get("hhash"), e.get("pid", 0))] = int(args["rank"])
                except (KeyError, TypeError, ValueError):
                    continue
    return ranks


def export_chrome(directory: "str | Path", out: "str | Path") -> dict[str, Any]:
    """Write every event under ``directory`` to ``out`` (``.json`` or ``.json.gz``) as it
    reads them (memory does not grow with the trace); returns counts of what was
    written and skipped."""
    skipped: list[str] = []
    out = Path(out)
    files = [f for f in trace_files(directory) if f.resolve() != out.resolve()]
    ranks = _ranks(files)
    names = {r: f"rank {r}" for r in ranks.values()}
    counts = {"events": 0, "threads": 0}
    opener = gzip.open if out.name.endswith(".gz") else open
    with opener(out, "wt", encoding="utf-8") as f:
        f.write('{"traceEvents":[')
        first = True

        def put(ev: dict[str, Any]) -> None:
            nonlocal first
            f.write(("" if first else ",") + json.dumps(ev, separators=(",", ":")))
            first = False

        for rank, label in sorted(names.items()):   # one track per rank where it is known
            put({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                 "args": {"name": label}})
        for path in files:
            for e in _records(path, skipped):
                raw_args = e.get("args")
                args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
                raw_ph = e.get("ph")
                # integers -> letters; letters kept; anything else (a list...) is no phase
                ph = _PH.get(raw_ph, raw_ph) if isinstance(raw_ph, (int, str)) else None
                pid = e.get("pid", 0)
                r = ranks.get((args.get("hhash"), pid)) if isinstance(pid, (int, str)) \
                    else None
                if ph == "M":
                    if e.get("name") == "thread_name":
                        put({"name": "thread_name", "ph": "M", "pid": pid if r is None else r,
                             "tid": e.get("tid", pid), "args": {"name": str(args.get("name"))}})
                        counts["threads"] += 1
                    continue  # DFTracer's HH/FH/CM records have no Chrome meaning
                if ph not in ("X", "C", "i", "I", "B", "E") or "ts" not in e:
                    continue
                ev = {"name": str(e.get("name", "")), "cat": str(e.get("cat", "")), "ph": ph,
                      "ts": e["ts"], "pid": pid, "tid": e.get("tid", pid), "args": args}
                if ph == "X":
                    ev["dur"] = e.get("dur", 0)
                if r is not None:
                    ev["args"] = dict(args, os_pid=pid)
                    ev["pid"] = r
                put(ev)
                counts["events"] += 1
        f.write('],"displayTimeUnit":"ms","otherData":{"producer":"forebay trace export"}}')
    return {"events": counts["events"], "threads": counts["threads"], "ranks": len(names),
            "skipped": skipped}
