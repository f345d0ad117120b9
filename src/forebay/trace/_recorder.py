"""Per-process event recorder.

Events go into preallocated numpy chunks (one structured row each, strings interned to
small integers); a full chunk is appended raw to a spill file beside the trace.  Nothing
is formatted as JSON until the recorder closes, so the hot path is a lock and a few
numpy slice assignments per batch.  :mod:`._writer` turns the rows into DFTracer lines.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from contextlib import ContextDecorator
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._fs import create_private
from ..world import detect
from ._events import (A, DUR, EVENT, K_FILE, K_ITEM, K_META, K_SPAN, NCOLS,
                      SOURCES, TS)
from ._writer import write_pfw

__all__ = ["Recorder", "Region"]

CHUNK = 1 << 16  # events per chunk (6 MiB)
_PFS = SOURCES.index("pfs")
_SPAN_BATCH = 4096  # spans kept as tuples before they move into the rows


class _Context(threading.local):
    epoch = -1
    step = -1


class Recorder:
    """Collects this process's events; :meth:`close` writes
    ``<dir>/<prefix>-<rank>-<pid>.pfw.gz``."""

    def __init__(self, directory: "str | os.PathLike[str]", prefix: str = "forebay",
                 rank: Optional[int] = None, chunk: int = CHUNK) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.pid = os.getpid()
        self.rank = _detect_rank() if rank is None else int(rank)
        self.host = socket.gethostname()
        self.path = self.dir / f"{prefix}-{self.rank}-{self.pid}.pfw.gz"
        self._spill_path = self.dir / f".{prefix}-{self.rank}-{self.pid}.spill"
        self._spill: Any = None
        self._spilled = 0
        self._chunk_len = max(16, int(chunk))
        self._buf = np.zeros((self._chunk_len, NCOLS), dtype=EVENT)
        self._n = 0
        self._lock = threading.Lock()
        self._strings: dict[str, int] = {}
        self._string_list: list[str] = []
        self._files: dict[str, int] = {}
        self._file_list: list[str] = []
        self._args: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._spans: list[tuple] = []
        self.context = _Context()
        # timestamps: wall-clock microseconds (as DFTracer), advanced by perf_counter
        self._wall0 = time.time_ns() // 1000
        self._perf0 = time.perf_counter()
        self.start_us = self._wall0
        self.closed = False
        self.world: Optional[int] = None
        atexit.register(self.close)

    # -- interning ------------------------------------------------------------------------
    def _number(self, table: dict[str, int], names: list[str], s: str) -> int:
        """A small integer for ``s`` in ``table`` (thread-safe, first come first served)."""
        i = table.get(s)
        if i is None:
            with self._lock:
                i = table.get(s)
                if i is None:
                    i = table[s] = len(names)
                    names.append(s)
        return i

    def intern(self, s: str) -> int:
        """Event names and categories."""
        return self._number(self._strings, self._string_list, s)

    def file_id(self, path: "str | os.PathLike[str]") -> int:
        """Dataset files (written as FH records)."""
        return self._number(self._files, self._file_list, str(path))

    def times_us(self, events: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows' (ts, dur) in trace microseconds."""
        t = events[:, TS].view(np.float64)
        d = events[:, DUR].view(np.float64)
        return (self._wall0 + np.rint((t - self._perf0) * 1e6).astype(np.int64),
                np.rint(np.maximum(d, 0) * 1e6).astype(np.int64))

    def us(self, t: "float | np.ndarray") -> Any:
        """perf_counter seconds -> trace microseconds."""
        if isinstance(t, np.ndarray):
            return self._wall0 + np.rint((t - self._perf0) * 1e6).astype(np.int64)
        return self._wall0 + int(round((t - self._perf0) * 1e6))

    # -- appending ------------------------------------------------------------------------
    def _reserve(self, k: int) -> np.ndarray:
        """Rows for ``k`` events (caller holds the lock)."""
        if self._n + k > len(self._buf):
            self._flush_chunk()
            if k > len(self._buf):
                self._buf = np.zeros((k, NCOLS), dtype=EVENT)
        rows = self._buf[self._n:self._n + k]
        self._n += k
        return rows

    def _flush_chunk(self) -> None:
        if self._n == 0:
            return
        if self._spill is None:
            create_private(self._spill_path)
            self._spill = open(self._spill_path, "wb")
        self._buf[:self._n].tofile(self._spill)
        self._spilled += self._n
        self._n = 0
        self._buf = np.zeros((self._chunk_len, NCOLS), dtype=EVENT)

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        return tid

    def span(self, cat: str, name: str, t0: float, t1: float, *, epoch: int = -1,
             step: int = -1, count: int = -1, nbytes: int = -1,
             args: Optional[dict[str, Any]] = None) -> None:
        """A complete event from perf_counter ``t0`` to ``t1`` on this thread."""
        if self.closed:
            return
        ai = -1
        if args:
            with self._lock:
                ai = len(self._args)
                self._args.append(dict(args))
        # spans are few (a handful per batch): a list append (atomic under the GIL),
        # moved into the int64 rows in bulk
        self._spans.append((K_SPAN, self.intern(name), self.intern(cat), self._tid(), t0,
                            t1 - t0, ai, epoch, step, count, nbytes, -1))
        if len(self._spans) >= _SPAN_BATCH:
            with self._lock:
                self._move_spans()

    def _move_spans(self) -> None:
        """Pending spans -> rows (caller holds the lock)."""
        if not self._spans:
            return
        pending, self._spans = self._spans, []
        arr = np.array(pending, dtype=np.float64)
        rows = self._reserve(len(arr))
        rows[:] = arr.astype(np.int64)
        rows[:, TS] = arr[:, TS].view(np.int64)
        rows[:, DUR] = arr[:, DUR].view(np.int64)

    def meta(self, name: str, args: dict[str, Any]) -> None:
        """A metadata record (e.g. the dataset a loader reads) written with the events."""
        if self.closed:
            return
        n, c, tid = self.intern(name), self.intern("forebay"), self._tid()
        ts = _bits(time.perf_counter())
        with self._lock:
            ai = len(self._args)
            self._args.append(dict(args))
            self._reserve(1)[0] = (K_META, n, c, tid, ts, _bits(0.0), ai, -1, -1, -1, -1, -1)

    def _many(self, kind: int, cat: str, name: str, t0: np.ndarray, dur: np.ndarray,
              cols: tuple) -> None:
        k = len(t0)
        c, n, tid = self.intern(cat), self.intern(name), self._tid()
        with self._lock:
            # the spans so far first: the file stays in about the order events ended,
            # which lets `forebay analyze` merge busy intervals as it reads
            self._move_spans()
            r = self._reserve(k)
            r[:, :4] = (kind, n, c, tid)
            r[:, TS] = np.asarray(t0, dtype=np.float64).view(np.int64)
            r[:, DUR] = np.asarray(dur, dtype=np.float64).view(np.int64)
            for j, v in enumerate(cols):
                r[:, A + j] = v

    def items(self, ids: np.ndarray, sizes: np.ndarray, t0: np.ndarray, dur: np.ndarray,
              source: "int | np.ndarray", tier: "int | np.ndarray",
              owner: "int | np.ndarray") -> None:
        """Samples fetched: one ``data/item`` event each (vectorized)."""
        if self.closed or len(ids) == 0:
            return
        ctx = self.context
        hit = np.asarray(source) != _PFS
        code = np.asarray(source) | (np.asarray(tier) << 4) | (hit.astype(np.int64) << 8)
        self._many(K_ITEM, "data", "item", t0, dur,
                   (ids, sizes, ctx.epoch, ctx.step, owner, code))

    def file_reads(self, path: "str | os.PathLike[str]", offsets: np.ndarray,
                   sizes: np.ndarray, t0: np.ndarray, dur: np.ndarray,
                   samples: "int | np.ndarray" = 1) -> None:
        """Reads of a dataset file, one ``reader/read`` event each (vectorized); each
        covers ``samples`` records (1 for a record-exact read)."""
        if self.closed or len(offsets) == 0:
            return
        ctx = self.context
        self._many(K_FILE, "reader", "read", t0, dur,
                   (self.file_id(path), offsets, sizes, ctx.epoch, ctx.step, samples))

    # -- reading back -------------------------------------------------------------------
    def events(self) -> np.ndarray:
        """Every event recorded so far (spilled and in memory)."""
        with self._lock:
            self._move_spans()
            parts = []
            if self._spill is not None:
                self._spill.flush()
                parts.append(np.fromfile(self._spill_path, dtype=EVENT).reshape(-1, NCOLS))
            parts.append(self._buf[:self._n].copy())
        return np.concatenate(parts)

    @property
    def num_events(self) -> int:
        return self._spilled + self._n + len(self._spans)

    def close(self) -> Optional[Path]:
        """Write the trace file (idempotent); returns its path.  In a process forked
        from the one that started recording, nothing is written (the parent's events
        are the parent's; the child would overwrite its file)."""
        if self.closed:
            return None
        if os.getpid() != self.pid:
            self.closed = True
            return None
        end = time.perf_counter()
        events = self.events()
        self.closed = True
        atexit.unregister(self.close)
        write_pfw(self, events, end)
        if self._spill is not None:
            self._spill.close()
            self._spill_path.unlink(missing_ok=True)
        self._buf = np.zeros((0, NCOLS), dtype=EVENT)
        return self.path


def _bits(x: float) -> int:
    """A float64's bits as an int64 (how times sit in the int64 rows)."""
    return int(np.float64(x).view(np.int64))


def _detect_rank() -> int:
    """This process's rank: MPI's if mpi4py has initialised it, else the launcher's."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                return mpi.COMM_WORLD.Get_rank()
        except Exception:  # pragma: no cover - an MPI without these calls
            pass
    return detect().rank


class Region(ContextDecorator):
    """``with region("compute"):`` or ``@region("compute")``: a span on the active
    recorder (nothing when tracing is off).  ``"cat/name"`` sets both."""

    def __init__(self, name: str, cat: Optional[str] = None, **args: Any) -> None:
        if cat is None:
            cat, _, rest = name.partition("/")
            name = rest or cat
        self.cat, self.name, self.args = cat, name, args
        self._local = threading.local()  # a start-time stack per thread (recursion, threads)

    def __enter__(self) -> "Region":
        stack = self._local.__dict__.setdefault("t0", [])
        stack.append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        t0 = self._local.t0.pop()
        from . import active

        rec = active()
        if rec is not None:
            ctx = rec.context
            rec.span(self.cat, self.name, t0, time.perf_counter(), epoch=ctx.epoch,
                     step=ctx.step, args=self.args or None)
