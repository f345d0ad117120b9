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

from ._read import _records, trace_files

__all__ = ["export_chrome"]

_PH: dict[Any, Any] = {1: "X", 2: "C", 3: "X", 4: "M"}


def export_chrome(directory: "str | Path", out: "str | Path") -> dict[str, Any]:
    """Write every event under ``directory`` to ``out`` (``.json`` or ``.json.gz``);
    returns counts of what was written and skipped."""
    skipped: list[str] = []
    events: list[dict[str, Any]] = []
    ranks: dict[tuple, int] = {}
    names: dict[int, str] = {}
    pending: list[dict[str, Any]] = []
    for path in trace_files(directory):
        if path.resolve() == Path(out).resolve():
            continue
        for e in _records(path, skipped):
            raw_args = e.get("args")
            args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
            raw_ph = e.get("ph")
            # integers -> letters; letters kept; anything else (a list...) is no phase
            ph = _PH.get(raw_ph, raw_ph) if isinstance(raw_ph, (int, str)) else None
            pid = e.get("pid", 0)
            if e.get("name") == "start" and args.get("rank") is not None:
                ranks[(args.get("hhash"), pid)] = int(args["rank"])
            if ph == "M":
                if e.get("name") == "thread_name":
                    pending.append({"name": "thread_name", "ph": "M", "pid": pid,
                                    "tid": e.get("tid", pid),
                                    "args": {"name": str(args.get("name"))},
                                    "_h": args.get("hhash")})
                continue  # DFTracer's HH/FH/CM records have no Chrome meaning
            if ph not in ("X", "C", "i", "I", "B", "E") or "ts" not in e:
                continue
            ev = {"name": str(e.get("name", "")), "cat": str(e.get("cat", "")), "ph": ph,
                  "ts": e["ts"], "pid": pid, "tid": e.get("tid", pid), "args": args,
                  "_h": args.get("hhash")}
            if ph == "X":
                ev["dur"] = e.get("dur", 0)
            events.append(ev)
    for ev in pending + events:  # one track per rank where the rank is known
        r = ranks.get((ev.pop("_h"), ev["pid"]))
        if r is not None:
            names[r] = f"rank {r}"
            ev["args"] = dict(ev["args"], os_pid=ev["pid"]) if ev["ph"] != "M" else ev["args"]
            ev["pid"] = r
    meta = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": n}}
            for r, n in sorted(names.items())]
    doc = {"traceEvents": meta + pending + events, "displayTimeUnit": "ms",
           "otherData": {"producer": "forebay trace export"}}
    out = Path(out)
    opener = gzip.open if out.name.endswith(".gz") else open
    with opener(out, "wt", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    return {"events": len(events), "threads": len(pending), "ranks": len(names),
            "skipped": skipped}
