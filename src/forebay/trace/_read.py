"""Read traces: forebay's and DFTracer's ``.pfw``/``.pfw.gz`` JSON lines (2.x with integer
``ph``, and the legacy bracketed format with Chrome's letters), and Chrome/Perfetto JSON.

Whatever cannot be read is skipped and reported, never fatal: a truncated gzip stream
(the lines before the cut are kept), a garbled line, an event without ``ts`` or ``dur``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

__all__ = ["Columns", "Events", "Scanner", "Strings", "read_traces", "trace_files"]

#: phases: DFTracer 2.x writes integers, Chrome JSON and legacy DFTracer letters
_COMPLETE = {1, "X"}
_METADATA = {4, "M"}
_COUNTER = {2, "C"}
_NUM_ARGS = ("image_idx", "image_size", "epoch", "step", "owner_rank", "hit", "count", "ret",
             "size", "offset", "samples")
_PATTERNS = ("*.pfw", "*.pfw.gz", "*.json", "*.json.gz")

#: ranks at or above this are no job's (a crafted 10**19 overflowed the int64 table)
MAX_RANK = 1 << 31


class Strings:
    """Every distinct string of a trace, numbered in order of first appearance: the
    string columns hold these numbers (a trace repeats a few names millions of times)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.values: list[str] = []

    def code(self, s: str) -> int:
        c = self.index.get(s)
        if c is None:
            c = self.index[s] = len(self.values)
            self.values.append(s)
        return c

    def decode(self, codes: np.ndarray) -> np.ndarray:
        table = np.empty(len(self.values), dtype=object)
        table[:] = self.values
        return table[codes] if len(codes) else np.zeros(0, dtype=object)


@dataclass
class Columns:
    """Complete events as columns; strings as numbers into a :class:`Strings` table."""

    proc: np.ndarray                     # index into the processes (int64)
    cat_code: np.ndarray                 # lower-case category (int32 codes)
    name_code: np.ndarray
    source_code: np.ndarray              # args.source or ""
    tier_code: np.ndarray                # args.tier or ""
    fname_code: np.ndarray               # file name (from fname or an FH record) or ""
    ts: np.ndarray                       # microseconds (float64)
    dur: np.ndarray
    tid: np.ndarray
    num: dict[str, np.ndarray]           # numeric args, NaN when absent

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class Events(Columns):
    """Complete events of every process in a trace directory, as columns."""

    strings: Strings = field(default_factory=Strings)
    procs: list[dict[str, Any]] = field(default_factory=list)  # rank, pid, host, files
    meta: list[dict[str, Any]] = field(default_factory=list)  # metadata records' args
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    # the string columns as object arrays of str
    cat = property(lambda self: self.strings.decode(self.cat_code))
    name = property(lambda self: self.strings.decode(self.name_code))
    source = property(lambda self: self.strings.decode(self.source_code))
    tier = property(lambda self: self.strings.decode(self.tier_code))
    fname = property(lambda self: self.strings.decode(self.fname_code))

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


def _open_text(path: Path) -> Any:
    opener = gzip.open if path.name.endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8", errors="replace")


def _lines(path: Path, skipped: list[str]) -> Iterator[tuple[int, str]]:
    n = long = 0
    try:
        with _open_text(path) as f:
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
    try:
        with _open_text(path) as f:
            head = f.read(4096).lstrip()
    except (EOFError, OSError, zlib.error):
        head = ""
    if head.startswith("{") and '"traceEvents"' in head:
        # a Chrome/Perfetto JSON object (on one line or many): its events one at a time
        if skip_exports and _is_export(path):
            skipped.append(f"{path.name}: an export of the traces beside it, not read twice")
            return
        yield from _chrome_events(path, skipped)
        return
    for n, line in _lines(path, skipped):
        s = line.strip()
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


def _is_export(path: Path) -> bool:
    """Whether a Chrome JSON file is a ``forebay trace export`` (its ``otherData``
    comes last: the tail is read; a gzip is decompressed to its end to get there)."""
    tail = ""
    try:
        if path.name.endswith(".gz"):
            with _open_text(path) as f:
                while chunk := f.read(1 << 20):
                    tail = (tail + chunk)[-4096:]
        else:
            with open(path, "rb") as fb:
                fb.seek(max(0, path.stat().st_size - 4096))
                tail = fb.read().decode("utf-8", errors="replace")
    except (EOFError, OSError, zlib.error):
        return False
    return re.search(r'"producer"\s*:\s*"forebay trace export"', tail) is not None


def _chrome_events(path: Path, skipped: list[str]) -> Iterator[dict]:
    """The objects of a Chrome JSON document's ``traceEvents`` array, decoded one at a
    time from a buffer read in pieces: memory holds one event (at most MAX_LINE
    characters), never the document."""
    dec = json.JSONDecoder()
    buf, pos, n, done = "", 0, 0, False
    try:
        with _open_text(path) as f:
            def more() -> bool:
                nonlocal buf, pos
                chunk = f.read(1 << 20)
                buf, pos = buf[pos:] + chunk, 0
                return bool(chunk)

            while '"traceEvents"' not in buf and more():
                pass
            key = buf.find('"traceEvents"')
            pos = key + len('"traceEvents"')
            while True:                   # the ':' and the '[' after the key
                while pos < len(buf) and buf[pos] in " \t\r\n:":
                    pos += 1
                if pos < len(buf) or not more():
                    break
            if key < 0 or pos >= len(buf) or buf[pos] != "[":
                skipped.append(f"{path.name}: traceEvents is not a list of events")
                return
            pos += 1
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos >= len(buf):
                    if not more():
                        break
                    continue
                if buf[pos] == "]":
                    done = True
                    break
                try:
                    e, end = dec.raw_decode(buf, pos)
                except (ValueError, RecursionError):
                    if len(buf) - pos < MAX_LINE and more():
                        continue          # the event goes on in the next piece
                    break
                pos = end
                n += 1
                if isinstance(e, dict):
                    yield e
    except (EOFError, OSError, zlib.error) as err:
        skipped.append(f"{path.name}: unreadable after {n} events ({type(err).__name__}: "
                       f"{err}); the {n} events before were kept")
        return
    if not done:
        skipped.append(f"{path.name}: not valid JSON after {n} events; the {n} events "
                       f"before were kept")


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


#: events per chunk of columns (a few MiB): the reader never holds more as Python objects
CHUNK = 1 << 16
_STR_COLS = ("cat_code", "name_code", "source_code", "tier_code", "fname_code")
_FH = "\x00fh:"   # a file hash whose FH record may come later: resolved in finish()


class Scanner:
    """Reads the trace files under a directory as a stream of :class:`Columns` chunks.

    ``chunks()`` yields them; after it is exhausted ``finish()`` assigns ranks to the
    processes and resolves file hashes, and ``procs``, ``rank_of``, ``fname_map``,
    ``meta`` and ``skipped`` describe the whole trace.  Memory: one chunk, the distinct
    strings, one record per process; a Chrome JSON document is the exception (read
    whole, as its format requires).
    """

    def __init__(self, directory: "str | Path", chunk: int = CHUNK,
                 progress: Any = None) -> None:
        self.directory = directory
        self.files = trace_files(directory)
        self.chunk = chunk
        self.progress = progress
        self.strings = Strings()
        self.procs: list[dict[str, Any]] = []
        self.meta: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.events = 0
        self.rank_of = np.zeros(0, dtype=np.int64)
        self.fname_map = np.zeros(0, dtype=np.int32)
        self._fh: dict[str, str] = {}        # file hash -> name, from FH records

    def chunks(self) -> Iterator[Columns]:
        code = self.strings.code
        procs, skipped, meta, fh = self.procs, self.skipped, self.meta, self._fh
        if not self.files:
            skipped.append(f"{self.directory}: no trace files (*.pfw, *.pfw.gz, *.json, "
                           f"*.json.gz)")
        proc_of: dict[tuple, int] = {}
        new = self._new_buffers
        cols, nums = new()
        no_dur = no_ts = bad_events = 0
        empty = code("")
        for path in self.files:
            for e in _records(path, skipped, skip_exports=len(self.files) > 1):
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
                cat = str(e.get("cat", "")).lower()
                if name == "start" and cat == "dftracer":
                    rank = args.get("rank")
                    if isinstance(rank, str) and rank.isdigit():   # as some tools write it
                        rank = int(rank)
                    if isinstance(rank, int) and not isinstance(rank, bool) and \
                            0 <= rank < MAX_RANK:
                        procs[p]["rank"] = rank
                    elif rank is not None:
                        bad_events += 1               # a rank that is no rank (or 10**19)
                    procs[p]["tool"] = args.get("tool", "dftracer")
                    continue
                if name == "end" and cat == "dftracer":
                    continue
                if ph not in _COMPLETE:
                    continue
                ts, dur = _num(e.get("ts")), _num(e.get("dur"))
                if ts != ts:                          # NaN
                    no_ts += 1
                    continue
                if dur != dur:
                    no_dur += 1
                    continue
                cols["proc"].append(p)
                cols["cat_code"].append(code(cat))
                cols["name_code"].append(code(name))
                cols["ts"].append(ts)
                cols["dur"].append(dur)
                cols["tid"].append(_num(e.get("tid", 0)))
                src, tier = args.get("source"), args.get("tier")
                cols["source_code"].append(empty if src is None else code(str(src)))
                cols["tier_code"].append(empty if tier is None else code(str(tier)))
                fn = args.get("fname")
                if fn is None and "fhash" in args:
                    fn = _FH + str(args["fhash"])
                cols["fname_code"].append(code(str(fn)) if fn else empty)
                for k in _NUM_ARGS:
                    v = args.get(k)
                    nums[k].append(float("nan") if v is None else _num(v))
                if len(cols["ts"]) >= self.chunk:
                    yield self._columns(cols, nums)
                    cols, nums = new()
        if len(cols["ts"]):
            yield self._columns(cols, nums)
        if bad_events:
            skipped.append(f"{bad_events} malformed event(s) skipped (ph, pid or rank of the "
                           f"wrong type)")
        if no_dur:
            skipped.append(f"{no_dur} complete event(s) without dur ignored")
        if no_ts:
            skipped.append(f"{no_ts} complete event(s) without ts ignored")

    @staticmethod
    def _new_buffers() -> tuple[dict[str, array], dict[str, array]]:
        cols: dict[str, array] = {k: array("q" if k == "proc" else "i")
                                  for k in ("proc", *_STR_COLS)}
        cols.update({k: array("d") for k in ("ts", "dur", "tid")})
        return cols, {k: array("d") for k in _NUM_ARGS}

    def _columns(self, cols: dict[str, array], nums: dict[str, array]) -> Columns:
        a = {k: np.frombuffer(v, dtype=np.int64 if v.typecode == "q" else
                              np.int32 if v.typecode == "i" else np.float64).copy()
             for k, v in cols.items()}
        self.events += len(a["ts"])
        if self.progress is not None:
            self.progress.update(len(a["ts"]))
        return Columns(num={k: np.frombuffer(v, dtype=np.float64).copy()
                            for k, v in nums.items()}, **a)

    def finish(self) -> None:
        """After the last chunk: ranks of the processes, file hashes to names."""
        for q in self.procs:
            q["files"] = sorted(q["files"])
        _assign_ranks(self.procs)
        self.rank_of = np.array([q["rank"] for q in self.procs], dtype=np.int64)
        values = self.strings.values
        self.fname_map = np.arange(len(values), dtype=np.int32)
        for c, s in enumerate(list(values)):
            if s.startswith(_FH):
                h = s[len(_FH):]
                self.fname_map[c] = self.strings.code(self._fh.get(h, h))


def read_traces(directory: "str | Path", progress: Any = None) -> Events:
    """Every event of every trace file under ``directory``, in memory (compact columns:
    about 150 bytes per event).  :func:`forebay.trace.analyze` does not need this: it
    reads a trace as a stream."""
    sc = Scanner(directory, progress=progress)
    parts = list(sc.chunks())
    sc.finish()
    if parts:
        cols = {k: np.concatenate([getattr(c, k) for c in parts])
                for k in ("proc", *_STR_COLS, "ts", "dur", "tid")}
        num = {k: np.concatenate([c.num[k] for c in parts]) for k in _NUM_ARGS}
    else:
        cols = {k: np.zeros(0, dtype=np.int64 if k == "proc" else
                            np.int32 if k in _STR_COLS else np.float64)
                for k in ("proc", *_STR_COLS, "ts", "dur", "tid")}
        num = {k: np.zeros(0) for k in _NUM_ARGS}
    cols["fname_code"] = sc.fname_map[cols["fname_code"]] if len(parts) else \
        cols["fname_code"]
    return Events(num=num, strings=sc.strings, procs=sc.procs, meta=sc.meta,
                  skipped=sc.skipped, files=[str(f) for f in sc.files], **cols)


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
