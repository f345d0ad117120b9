"""I/O tracing in DFTracer's format, and its analysis.

Turn it on for a run::

    import forebay.trace
    forebay.trace.enable("traces/")         # or FOREBAY_TRACE=traces/ in the environment
    for batch in loader:                    # fetches, stalls, PFS reads recorded by forebay
        with forebay.trace.region("compute"):
            train_step(batch)
    forebay.trace.disable()                 # writes traces/forebay-<rank>-<pid>.pfw.gz

then ``forebay analyze traces/``.  Events are kept in numpy buffers during the run and
written as JSON lines when tracing is disabled or the process exits.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

from ._analyze import analyze, format_summary
from ._export import export_chrome
from ._plots import plot_all, write_html
from ._read import read_traces
from ._events import SOURCES, TIERS
from ._recorder import Recorder, Region

__all__ = ["enable", "disable", "active", "region", "Recorder", "SOURCES", "TIERS", "analyze",
           "format_summary", "export_chrome", "plot_all", "write_html", "read_traces"]

_active: Optional[Recorder] = None
_env_checked = False
_lock = threading.Lock()
#: one start of a recorder at a time (enable, or the first active() with FOREBAY_TRACE):
#: a thread asking while another starts one waits for it, instead of getting None
_starting = threading.RLock()


def enable(directory: "str | os.PathLike[str]", *, prefix: str = "forebay",
           rank: Optional[int] = None) -> Recorder:
    """Record this process's events into ``directory`` (created if needed); the file is
    ``<prefix>-<rank>-<pid>.pfw.gz``.  A recorder already active is closed first."""
    global _active, _env_checked
    with _starting:
        with _lock:
            old, _active = _active, None
        if old is not None:
            old.close()
        rec = Recorder(directory, prefix=prefix, rank=rank)
        with _lock:
            _active = rec
            _env_checked = True
        return rec


def disable() -> Optional[Path]:
    """Stop recording and write the trace; returns its path (None if tracing was off)."""
    global _active
    with _lock:
        rec, _active = _active, None
    return rec.close() if rec is not None else None


def active() -> Optional[Recorder]:
    """The recorder in use, or None.  The first call starts one if ``FOREBAY_TRACE`` names
    a directory (threads calling at once all get it: a store's fill threads and the
    loader's thread count the same reads the trace records)."""
    global _env_checked
    if _active is not None or _env_checked:
        return _active
    with _starting:
        if _active is None and not _env_checked:
            d = os.environ.get("FOREBAY_TRACE")
            if d:
                return enable(d)
            _env_checked = True
    return _active


def region(name: str, cat: Optional[str] = None, **args: Any) -> Region:
    """Mark a phase of your own: ``with region("compute"):`` or as a decorator.
    ``"cat/name"`` (``"pipeline/train"``, ``"checkpoint/capture"``) sets DFTracer's
    category and name; a bare name is used for both.  Free when tracing is off."""
    return Region(name, cat, **args)
