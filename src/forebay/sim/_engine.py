"""The simulator's timeline: NoPFS's model (§4) solved batch by batch.

Each worker has ``p_0`` prefetch threads that fill its staging buffer in consumption
order; with load-balanced threads a batch's delivery takes the sum of its samples'
``fetch + write`` times divided by ``p_0``.  Training is data-parallel and
synchronous: step h starts when every worker has batch h and step h-1 has ended, and
lasts as long as the slowest worker's ``bytes / c``.  A batch may start being fetched
only when the staging buffer has room for it: the batches before it that would not fit
together with it must have been consumed (a buffer too small for one batch still
holds one, so capacity 0 means no prefetching at all).

For worker i and step h (``R`` delivery time, ``rel`` the step-end that frees room):

    P[i,h] = max(P[i,h-1], rel[i,h]) + R[i,h]                  (delivery)
    T[h]   = max(max_i P[i,h], T[h-1] + C[h-1])                (step start)

Both recurrences are max-plus prefix scans, so a run of steps whose ``rel`` are all
known (steps whose room is freed by steps before the run) is solved with two
``np.maximum.accumulate`` calls; the buffer's lookahead sets the run length (a 5 GB
buffer of 3 MB batches: ~1,500 steps per run).  Cost O(N * steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..vocab import FetchPath

__all__ = ["SOURCES", "Timeline", "timeline"]

#: fetch paths (forebay.vocab.FetchPath), in the order of the per-path arrays
SOURCES = tuple(p.label for p in FetchPath)
F_PFS, F_RAM, F_SSD, F_PEER_RAM, F_PEER_SSD = (int(p) for p in FetchPath)


@dataclass(frozen=True)
class Timeline:
    start: np.ndarray   # float64[steps]: when each step starts
    end: np.ndarray     # float64[steps]: when it ends
    compute_s: float
    setup_s: float
    issue: Optional[np.ndarray] = None   # float64[N, steps]: when each delivery began

    @property
    def total_s(self) -> float:
        return float(self.end[-1]) if len(self.end) else self.setup_s

    @property
    def stall_s(self) -> float:
        """Time not spent computing: waiting for data, set-up phases included."""
        return max(self.total_s - self.compute_s, 0.0)


def _release_steps(nbytes: np.ndarray, capacity: int) -> np.ndarray:
    """``int64[N, S]``: for each worker and step h, the last step g that must have
    ended before batch h may enter the buffer (-1: none), i.e. the smallest g with
    bytes(g+1 .. h) <= capacity, at most h-1.

    One ``searchsorted`` for every worker: each worker's running sums are shifted past
    the previous worker's, so the rows lie in one sorted array.  Whole byte counts keep
    the shifted sums exact below 2**53; other inputs are searched row by row."""
    n, s = nbytes.shape
    cum = np.concatenate([np.zeros((n, 1)), np.cumsum(nbytes, axis=1)], axis=1)
    top = float(cum[:, -1].max()) if n else 0.0
    cap = min(float(capacity), top)       # a larger capacity holds every row whole
    width = top + cap + 1.0
    if n * width < 2.0 ** 53 and bool(np.all(cum == np.round(cum))):
        shift = (np.arange(n) * width)[:, None]
        at = np.searchsorted((cum + shift).ravel(), (cum[:, 1:] - cap + shift).ravel(),
                             side="left")
        g = at.reshape(n, s) - (np.arange(n) * (s + 1))[:, None] - 1
    else:
        g = np.empty((n, s), dtype=np.int64)
        for i in range(n):
            g[i] = np.searchsorted(cum[i], cum[i, 1:] - cap, side="left") - 1
    return np.minimum(g, np.arange(s, dtype=np.int64) - 1)


def timeline(read_s: np.ndarray, comp_s: np.ndarray, nbytes: np.ndarray,
             staging_bytes: int, setup_s: float = 0.0,
             sync_s: Optional[np.ndarray] = None) -> Timeline:
    """Solve the pipeline for ``[N, S]`` per-worker, per-step delivery times, compute
    times and batch bytes.  ``sync_s[N, S]``: reads the worker does itself when the
    step's batch is consumed (not prefetched: DeepIO's uncached samples), after both
    its prefetched part and the previous step."""
    read_s = np.asarray(read_s, dtype=np.float64)
    n, s = read_s.shape
    cmax = np.asarray(comp_s, dtype=np.float64).max(axis=0) if s else np.zeros(0)
    start = np.empty(s)
    end = np.empty(s)
    issue = np.empty((n, s))
    if s == 0:
        return Timeline(start, end, 0.0, setup_s, issue)
    sync = np.zeros((n, s)) if sync_s is None else np.asarray(sync_s, dtype=np.float64)
    smax = sync.max(axis=0)
    g = _release_steps(np.asarray(nbytes, dtype=np.float64), staging_bytes)
    gmax = g.max(axis=0)             # nondecreasing in h
    p_prev = np.full(n, float(setup_s))
    e_prev = float(setup_s)          # end of the previous step
    a = 0
    while a < s:
        # the run [a, b): every step's room is freed by a step before a
        b = max(int(np.searchsorted(gmax, a, side="left")), a + 1)
        rel = np.where(g[:, a:b] >= 0, end[np.maximum(g[:, a:b], 0)], 0.0)
        d = np.cumsum(read_s[:, a:b], axis=1)
        d_before = d - read_s[:, a:b]
        p = d + np.maximum(p_prev[:, None], np.maximum.accumulate(rel - d_before, axis=1))
        issue[:, a:b] = p - read_s[:, a:b]
        # T[h] = max(max_i P[i,h] + S[i,h], T[h-1] + C[h-1] + max_i S[i,h])
        m = (p + sync[:, a:b]).max(axis=0)
        c = cmax[a:b]
        dstep = c.copy()
        dstep[:-1] += smax[a + 1:b]
        gc = np.cumsum(dstep) - dstep    # time added between a and each step of the run
        t = gc + np.maximum(e_prev + smax[a], np.maximum.accumulate(m - gc))
        start[a:b] = t
        end[a:b] = t + c
        p_prev = p[:, -1]
        e_prev = float(end[b - 1])
        a = b
    return Timeline(start, end, float(cmax.sum()), float(setup_s), issue)
