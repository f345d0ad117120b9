"""Read traces: forebay's and DFTracer's ``.pfw``/``.pfw.gz`` JSON lines (2.x with integer
``ph``, and the legacy bracketed format with Chrome's letters), and Chrome/Perfetto JSON.

Whatever cannot be read is skipped and reported, never fatal: a truncated gzip stream
(the lines before the cut are kept), a garbled line, an event without ``ts`` or ``dur``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

__all__ = ["Events", "read_traces", "trace_files"]

#: phases: DFTracer 2.x writes integers, Chrome JSON and legacy DFTracer letters
_COMPLETE = {1, "X"}
_METADATA = {4, "M"}
_COUNTER = {2, "C"}
_NUM_ARGS = ("image_idx", "image_size", "epoch", "step", "owner_rank", "hit", "count", "ret",
             "size", "offset", "samples")
_PATTERNS = ("*.pfw", "*.pfw.gz", "*.json", "*.json.gz")


@dataclass
class Events:
    """Complete events of every process in a trace directory, as columns."""

    proc: np.ndarray                     # index into ``procs``
    cat: np.ndarray                      # lower-case category (object array)
    name: np.ndarray
    ts: np.ndarray                       # microseconds (float64)
    dur: np.ndarray
    tid: np.ndarray
    num: dict[str, np.ndarray]           # numeric args, NaN when absent
    source: np.ndarray                   # args.source / args.tier or ""
    tier: np.ndarray
    fname: np.ndarray                    # file name (from fname or an FH record) or ""
    procs: list[dict[str, Any]]          # per process: rank, pid, host, files
    meta: list[dict[str, Any]] = field(default_factory=list)  # metadata records' args
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def rank(self) -> np.ndarray:
        """Each event's rank (its process's)."""
        rank_of = np.array([q["rank"] for q in self.procs], dtype=np.int64)
        return rank_of[self.proc] if len(self) else np.zeros(0, dtype=np.int64)


def trace_files(directory: "str | Path") -> list[Path]:
    """Trace files under ``directory`` (or the file itself)."""
    p = Path(directory)
    if p.is_file():
        return [p]
    out: set[Path] = set()
    for pat in _PATTERNS:
        out.update(p.glob(pat))
        out.update(p.glob(f"*/{pat}"))
    return sorted(q for q in out if not q.name.startswith("."))


#: a longer line (a gzip bomb expanding to one 1 GiB line...) is skipped, read in pieces
MAX_LINE = 16 << 20


def _lines(path: Path, skipped: list[str]) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    n = long = 0
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            while True:
                line = f.readline(MAX_LINE)
                if not line:
                    break
                n += 1
                if len(line) >= MAX_LINE and not line.endswith("\n"):
                    long += 1
                    while line and not line.endswith("\n"):   # the rest, never held whole
                        line = f.readline(MAX_LINE)
                    continue
                yield n, line
    except (EOFError, OSError, zlib.error) as e:
        skipped.append(f"{path.name}: unreadable after line {n} ({type(e).__name__}: {e}); "
                       f"the {n} lines before were kept")
    if long:
        skipped.append(f"{path.name}: {long} line(s) longer than {MAX_LINE} characters "
                       f"skipped")


def _records(path: Path, skipped: list[str], skip_exports: bool = False) -> Iterator[dict]:
    """Event objects of one file in any of the accepted layouts (``skip_exports``: not
    from a ``forebay trace export`` of traces that are read too)."""
    garbled: list[int] = []
    first = True
    for n, line in _lines(path, skipped):
        s = line.strip()
        if first and s.startswith("{") and '"traceEvents"' in s[:4096]:
            # a Chrome/Perfetto JSON object: read it whole
            text = "".join(ln for _, ln in _lines(path, skipped))
            try:
                doc = json.loads(text)
            except ValueError as err:
                skipped.append(f"{path.name}: not valid JSON ({err})")
                return
            other = doc.get("otherData") if isinstance(doc, dict) else None
            if skip_exports and isinstance(other, dict) and \
                    other.get("producer") == "forebay trace export":
                skipped.append(f"{path.name}: an export of the traces beside it, not read "
                               f"twice")
                return
            events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
            if not isinstance(events, list):
                skipped.append(f"{path.name}: traceEvents is not a list of events")
                return
            yield from (e for e in events if isinstance(e, dict))
            return
        first = False
        if not s or s in ("[", "]"):
            continue
        if s.startswith("[") and s != "[":
            s = s[1:].strip()
        if s.endswith(","):
            s = s[:-1]
        if s.endswith("]") and not s.endswith("}]"):
            s = s[:-1]
        try:
            e = json.loads(s)
        except (ValueError, RecursionError):     # RecursionError: absurdly deep nesting
            garbled.append(n)
            continue
        if isinstance(e, dict):
            yield e
        elif isinstance(e, list):  # a whole JSON array on one line
            yield from (x for x in e if isinstance(x, dict))
        else:
            garbled.append(n)
    if garbled:
        skipped.append(f"{path.name}: {len(garbled)} garbled line(s) skipped (first at line "
                       f"{garbled[0]})")


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def read_traces(directory: "str | Path") -> Events:
    """Every event of every trace file under ``directory``."""
    files = trace_files(directory)
    skipped: list[str] = []
    if not files:
        skipped.append(f"{directory}: no trace files (*.pfw, *.pfw.gz, *.json, *.json.gz)")
    cols: dict[str, list] = {k: [] for k in ("proc", "cat", "name", "ts", "dur", "tid",
                                            "source", "tier", "fname")}
    nums: dict[str, list] = {k: [] for k in _NUM_ARGS}
    procs: list[dict[str, Any]] = []
    proc_of: dict[tuple, int] = {}
    fh: dict[str, str] = {}  # file hash -> name, from FH records
    meta: list[dict[str, Any]] = []
    no_dur = no_ts = bad_events = 0
    for path in files:
        for e in _records(path, skipped, skip_exports=len(files) > 1):
            raw_args = e.get("args")
            args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
            ph, pid = e.get("ph"), e.get("pid")
            if not isinstance(ph, (str, int, type(None))) or \
                    not isinstance(pid, (str, int, type(None))):
                bad_events += 1                   # a list or a map where a scalar goes
                continue
            key = (str(args.get("hhash", "")), pid)
            p = proc_of.get(key)
            if p is None:
                p = proc_of[key] = len(procs)
                procs.append({"pid": e.get("pid"), "hhash": key[0], "rank": None,
                              "files": set(), "tool": None})
            procs[p]["files"].add(path.name)
            name = str(e.get("name", ""))
            if ph in _METADATA:
                if name == "FH" and "value" in args:
                    fh[str(args["value"])] = str(args.get("name", ""))
                elif name == "HH":
                    procs[p]["host"] = args.get("name")
                elif name not in ("thread_name", "process_name", "CM", "SH"):
                    meta.append({"name": name, "proc": p, **args})
                continue
            if name == "start" and str(e.get("cat", "")).lower() == "dftracer":
                rank = args.get("rank")
                if isinstance(rank, str) and rank.isdigit():   # as some tools write it
                    rank = int(rank)
                if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
                    procs[p]["rank"] = rank
                elif rank is not None:
                    bad_events += 1               # a rank that is no rank: ignored
                procs[p]["tool"] = args.get("tool", "dftracer")
                continue
            if name == "end" and str(e.get("cat", "")).lower() == "dftracer":
                continue
            if ph not in _COMPLETE:
                continue
            ts, dur = _num(e.get("ts")), _num(e.get("dur"))
            if np.isnan(ts):
                no_ts += 1
                continue
            if np.isnan(dur):
                no_dur += 1
                continue
            cols["proc"].append(p)
            cols["cat"].append(str(e.get("cat", "")).lower())
            cols["name"].append(name)
            cols["ts"].append(ts)
            cols["dur"].append(dur)
            cols["tid"].append(e.get("tid", 0))
            cols["source"].append(str(args.get("source", "")))
            cols["tier"].append(str(args.get("tier", "")))
            fn = args.get("fname")
            if fn is None and "fhash" in args:
                fn = ("#", str(args["fhash"]))  # resolved once every FH is known
            cols["fname"].append(fn or "")
            for k in _NUM_ARGS:
                nums[k].append(_num(args.get(k)))
    if bad_events:
        skipped.append(f"{bad_events} malformed event(s) skipped (ph, pid or rank of the "
                       f"wrong type)")
    if no_dur:
        skipped.append(f"{no_dur} complete event(s) without dur ignored")
    if no_ts:
        skipped.append(f"{no_ts} complete event(s) without ts ignored")
    fnames = [fh.get(f[1], f[1]) if isinstance(f, tuple) else f for f in cols["fname"]]
    for q in procs:
        q["files"] = sorted(q["files"])
    _assign_ranks(procs)
    obj = lambda xs: np.array(xs, dtype=object) if xs else np.zeros(0, dtype=object)  # noqa: E731
    return Events(proc=np.array(cols["proc"], dtype=np.int64),
                  cat=obj(cols["cat"]), name=obj(cols["name"]),
                  ts=np.array(cols["ts"], dtype=np.float64),
                  dur=np.array(cols["dur"], dtype=np.float64),
                  tid=np.array([_num(t) for t in cols["tid"]], dtype=np.float64),
                  num={k: np.array(v, dtype=np.float64) for k, v in nums.items()},
                  source=obj(cols["source"]), tier=obj(cols["tier"]), fname=obj(fnames),
                  procs=procs, meta=meta, skipped=skipped, files=[str(f) for f in files])


def _assign_ranks(procs: list[dict[str, Any]]) -> None:
    """Processes that recorded no rank (a DFTracer file of its own) take the rank of a
    forebay file from the same host and pid: its events land beside ours.  The rest get
    numbers after the known ranks."""
    known = {(q.get("host"), q["pid"]): q["rank"] for q in procs if q["rank"] is not None}
    nxt = max(known.values(), default=-1) + 1
    for q in procs:
        if q["rank"] is None:
            r: Optional[int] = known.get((q.get("host"), q["pid"]))
            if r is None:
                r, nxt = nxt, nxt + 1
                known[(q.get("host"), q["pid"])] = r
            q["rank"] = r
