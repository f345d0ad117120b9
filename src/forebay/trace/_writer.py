"""Recorded events -> one gzip-compressed JSON-lines file in DFTracer's format.

Each line is one event object: integer ``ph`` (1 complete, 4 metadata) and ``type``
(1 DFTracer's own records, 6 Python-level events), ``ts``/``dur`` in microseconds,
``args.hhash`` naming the host.  ``HH`` and ``FH`` metadata records map the host and file
hashes to names; they carry ``ts`` and ``dur: 0`` so every line has a time.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import xxhash

from .._fs import create_private
from ._events import EVENT, K_FILE, K_ITEM, K_META, K_SPAN, SOURCES, TIERS

if TYPE_CHECKING:
    from ._recorder import Recorder

__all__ = ["write_pfw", "name_hash"]

PH_COMPLETE, PH_METADATA = 1, 4
TYPE_DFTRACER, TYPE_PYTHON = 1, 6


def name_hash(s: str) -> str:
    """16 hex digits, as DFTracer's host and file hashes."""
    return xxhash.xxh3_64_hexdigest(s.encode())


def _lines(rec: "Recorder", events: np.ndarray, end: float) -> Iterator[str]:
    from .._version import __version__

    hh = name_hash(rec.host)
    pid, t_start = rec.pid, rec.start_us
    q = json.dumps

    def meta(name: str, key: str, value: str, tid: int = pid) -> str:
        return (f'{{"name":"{name}","cat":"dftracer","type":{TYPE_DFTRACER},'
                f'"pid":{pid},"tid":{tid},"ts":{t_start},"dur":0,"ph":{PH_METADATA},'
                f'"args":{{"hhash":"{hh}","name":{q(key)},"value":{q(value)}}}}}')

    yield meta("HH", rec.host, hh)
    for tid, tname in sorted(rec._threads.items()):
        yield meta("thread_name", tname, "thread_name", tid)
    yield meta("CM", "time_metric", "US")
    fh = [name_hash(p) for p in rec._file_list]
    for p, h in zip(rec._file_list, fh):
        yield meta("FH", p, h)
    eid = 1
    start_args = {"hhash": hh, "rank": rec.rank, "world": rec.world, "pid": pid,
                  "tool": "forebay", "version": __version__, "cwd": os.getcwd(),
                  "date": datetime.datetime.fromtimestamp(t_start / 1e6).isoformat(" ")}
    yield (f'{{"id":{eid},"name":"start","cat":"dftracer","type":{TYPE_DFTRACER},"pid":{pid},'
           f'"tid":{pid},"ts":{t_start},"dur":0,"ph":{PH_COMPLETE},"args":{q(start_args)}}}')
    names = [q(s) for s in rec._string_list]
    src_names = [q(s) for s in SOURCES]
    tier_names = [q(s) for s in TIERS]
    file_names = [q(p) for p in rec._file_list]
    ts_us, dur_us = rec.times_us(events)
    rows = np.column_stack([events[:, :4], ts_us, dur_us, events[:, 6:]]).tolist() \
        if len(events) else []
    for kind, name, cat, tid, ts, dur, *a in rows:
        eid += 1
        head = (f'{{"id":{eid},"name":{names[name]},"cat":{names[cat]},"type":{TYPE_PYTHON},'
                f'"pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur},')
        if kind == K_ITEM:
            idx, size, epoch, step, owner, code = a
            ep = f',"epoch":{epoch},"step":{step}' if epoch >= 0 else ""
            yield (f'{head}"ph":{PH_COMPLETE},"args":{{"hhash":"{hh}","image_idx":{idx},'
                   f'"image_size":{size}{ep},"source":{src_names[code & 15]},'
                   f'"tier":{tier_names[(code >> 4) & 15]},"owner_rank":{owner},'
                   f'"hit":{(code >> 8) & 1}}}}}')
        elif kind == K_FILE:
            f, off, size, epoch, step, nrec = a
            ep = f',"epoch":{epoch},"step":{step}' if epoch >= 0 else ""
            yield (f'{head}"ph":{PH_COMPLETE},"args":{{"hhash":"{hh}","fhash":"{fh[f]}",'
                   f'"fname":{file_names[f]},"offset":{off},"count":{size},"ret":{size}{ep},'
                   f'"samples":{nrec},"tier":"pfs"}}}}')
        elif kind == K_SPAN:
            ai, epoch, step, count, nbytes, _ = a
            args: dict[str, Any] = {"hhash": hh}
            if epoch >= 0:
                args["epoch"] = epoch
            if step >= 0:
                args["step"] = step
            if count >= 0:
                args["count"] = count
            if nbytes >= 0:
                args["size"] = nbytes
            if ai >= 0:
                args.update(rec._args[ai])
            yield f'{head}"ph":{PH_COMPLETE},"args":{q(args, default=str)}}}'
        elif kind == K_META:
            args = {"hhash": hh, **rec._args[a[0]]}
            yield (f'{{"id":{eid},"name":{names[name]},"cat":{names[cat]},'
                   f'"type":{TYPE_DFTRACER},"pid":{pid},"tid":{tid},"ts":{ts},"dur":0,'
                   f'"ph":{PH_METADATA},"args":{q(args, default=str)}}}')
    t_end = rec.us(end)
    eid += 1
    yield (f'{{"id":{eid},"name":"ai_root","cat":"ai_root","type":{TYPE_PYTHON},"pid":{pid},'
           f'"tid":{pid},"ts":{t_start},"dur":{max(0, t_end - t_start)},"ph":{PH_COMPLETE},'
           f'"args":{{"hhash":"{hh}"}}}}')
    eid += 1
    yield (f'{{"id":{eid},"name":"end","cat":"dftracer","type":{TYPE_DFTRACER},"pid":{pid},'
           f'"tid":{pid},"ts":{t_end},"dur":0,"ph":{PH_COMPLETE},'
           f'"args":{{"hhash":"{hh}","num_events":{eid - 2}}}}}')


def write_pfw(rec: "Recorder", events: np.ndarray, end: float) -> None:
    """Write ``rec``'s trace atomically (a temporary name, then rename)."""
    assert events.dtype == EVENT and events.ndim == 2
    tmp = rec.path.with_name(f".{rec.path.name}.tmp")
    create_private(tmp)                    # 0600: a trace names the job's files
    with gzip.open(tmp, "wt", compresslevel=6, encoding="utf-8") as f:
        batch: list[str] = []
        for line in _lines(rec, events, end):
            batch.append(line)
            if len(batch) >= 8192:
                f.write("\n".join(batch) + "\n")
                batch.clear()
        if batch:
            f.write("\n".join(batch) + "\n")
    os.replace(tmp, rec.path)
