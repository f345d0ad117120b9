"""What the stores and the loader call to record fetches and file reads in the active
trace (batch-granular; the trace package itself knows nothing of datasets).

A batch is gathered in a few parts (own memory, a peer's, each dataset file); each part's
time is measured and shared among its samples in proportion to their bytes, so every
sample gets a ``data/item`` event whose duration is its share of the time its source took.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dataset import IndexLayout
from ..trace import SOURCES, TIERS, Recorder

__all__ = ["amortize", "record_parts", "record_pfs", "SRC", "TIER"]

SRC = {s: k for k, s in enumerate(SOURCES)}
TIER = {s: k for k, s in enumerate(TIERS)}


def amortize(t0: float, t1: float, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Back-to-back start times and durations inside ``[t0, t1]``, shares by bytes."""
    tot = float(sizes.sum())
    if tot > 0:
        dur = sizes * ((t1 - t0) / tot)
    else:
        dur = np.full(len(sizes), (t1 - t0) / max(len(sizes), 1))
    end = np.cumsum(dur)
    return t0 + end - dur, dur


def record_parts(rec: Recorder, ids: np.ndarray, sizes: np.ndarray,
                 tagged: Sequence[tuple[Any, float, float, Any, Any, Any]]) -> None:
    """``tagged``: ``(selector, t0, t1, source, tier, owner)`` per part; source and tier
    by name or as per-sample code arrays, owner a rank or per-sample ranks.  One
    vectorized append for the whole batch."""
    n = len(ids)
    if n == 0:
        return
    if len(tagged) == 1:  # the common case: one part (it covers the whole batch)
        _, t0, t1, source, tier, owner = tagged[0]
        starts, dur = amortize(t0, t1, sizes)
        rec.items(ids, sizes, starts, dur, _code(SRC, source), _code(TIER, tier), owner)
        return
    part = np.empty(n, dtype=np.int64)
    src = np.empty(n, dtype=np.int64)
    tr = np.empty(n, dtype=np.int64)
    own = np.empty(n, dtype=np.int64)
    t0s = np.empty(len(tagged))
    rate = np.empty(len(tagged))  # seconds per byte of each part
    for k, (sel, t0, t1, source, tier, owner) in enumerate(tagged):
        part[sel] = k
        src[sel] = _part(_code(SRC, source), sel)
        tr[sel] = _part(_code(TIER, tier), sel)
        own[sel] = _part(owner, sel)
        t0s[k] = t0
        b = float(sizes[sel].sum())
        rate[k] = (t1 - t0) / b if b > 0 else 0.0
    dur = sizes * rate[part]
    # back to back inside each part: cumulative time in part order
    order = np.argsort(part, kind="stable")
    cum = np.cumsum(dur[order])
    first = np.searchsorted(part[order], np.arange(len(tagged)))
    base = np.concatenate([[0.0], cum])[first]  # time before each part's first sample
    starts = np.empty(n)
    starts[order] = t0s[part[order]] + cum - dur[order] - base[part[order]]
    rec.items(ids, sizes, starts, dur, src, tr, own)


def _code(table: dict, v: Any) -> Any:
    return table[v] if isinstance(v, str) else v


def _part(v: Any, sel: Any) -> Any:
    return v[sel] if isinstance(v, np.ndarray) else v


def record_pfs(rec: Recorder, ds: Any, ids: np.ndarray, rows: np.ndarray, t0: float,
               t1: float) -> None:
    """Reads of dataset records ``ids`` (index ``rows``) that took ``[t0, t1]``: one
    ``reader/read`` event per record, grouped by shard file."""
    if not len(ids):
        return
    sizes = rows[:, IndexLayout.REC_LEN]
    starts, dur = amortize(t0, t1, sizes)
    shard = ds.shard_of[ids]
    lo, hi = int(shard.min()), int(shard.max())
    for s in ([lo] if lo == hi else np.unique(shard).tolist()):
        m = slice(None) if lo == hi else shard == s
        rec.file_reads(ds.shard_path(s), rows[m, IndexLayout.REC_OFF], sizes[m], starts[m],
                       dur[m])
