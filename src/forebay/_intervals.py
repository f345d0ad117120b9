"""Unions of half-open intervals and positions inside runs, vectorised (trace
analysis, page ranges, placement slots, per-peer message layouts)."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_intervals", "positions_in_runs"]


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[start, end)`` (any order, may overlap or touch) as
    sorted disjoint segments ``(starts, ends)``."""
    if len(start) == 0:
        return np.zeros(0, dtype=np.asarray(start).dtype), np.zeros(0, dtype=np.asarray(end).dtype)
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    reach = np.maximum.accumulate(e)
    # a new segment starts where an interval begins after everything before it ended
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    last = np.ones(len(s), dtype=bool)
    last[:-1] = new[1:]
    return s[new], reach[last]


def positions_in_runs(counts: np.ndarray) -> np.ndarray:
    """For elements laid out in consecutive runs of ``counts[k]`` elements each (a
    sorted key, say): each element's position inside its run, ``0..counts[k]-1``."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                    counts)
