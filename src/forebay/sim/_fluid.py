"""The fluid model's shared resource: threads holding a resource over spans of time,
each given ``speed(G)`` when G threads in all are on it (docs/sim.md, "conserving")."""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["Fluid"]


class Fluid:
    """Spans [a, b) each holding ``load`` threads on a shared resource; the resource
    gives each thread ``speed(G)`` when G threads in all are on it.  Answers, for any
    spans, the mean of speed(G(t)) and of G(t) over them (prefix integrals of the
    piecewise-constant load, O((n + q) log n))."""

    def __init__(self, a: np.ndarray, b: np.ndarray, load: np.ndarray,
                 speed: Callable[[np.ndarray], np.ndarray]) -> None:
        keep = (load > 0) & (b > a)
        t = np.concatenate([a[keep], b[keep]])
        d = np.concatenate([load[keep], -load[keep]])
        order = np.argsort(t, kind="stable")
        self.t = t[order]
        g = np.maximum(np.cumsum(d[order]), 0.0)          # load on [t_k, t_k+1)
        self.g = g
        self.f = speed(g)                                  # speed(max(G, 1))
        seg = np.diff(self.t, append=self.t[-1] if len(self.t) else 0.0)
        self.If = np.concatenate([[0.0], np.cumsum(self.f * seg)])
        self.Ig = np.concatenate([[0.0], np.cumsum(g * seg)])
        self.f0 = float(speed(np.zeros(1))[0])             # nobody reading: a lone reader

    def _integral(self, x: np.ndarray, vals: np.ndarray, cum: np.ndarray,
                  outside: float) -> np.ndarray:
        if not len(self.t):
            return x * outside
        k = np.searchsorted(self.t, x, side="right") - 1
        inside = k >= 0
        kk = np.clip(k, 0, len(self.t) - 1)
        v = cum[kk] + vals[kk] * (x - self.t[kk])
        v = np.where(x >= self.t[-1], cum[-1] + outside * (x - self.t[-1]), v)
        return np.where(inside, v, outside * (x - self.t[0]))

    def _mean(self, a: np.ndarray, b: np.ndarray, vals: np.ndarray, cum: np.ndarray,
              outside: float) -> np.ndarray:
        lo, hi = self._integral(a, vals, cum, outside), self._integral(b, vals, cum, outside)
        if not len(self.t):
            return np.full(len(a), outside)
        k = np.clip(np.searchsorted(self.t, a, side="right") - 1, 0, len(self.t) - 1)
        at = np.where((a >= self.t[0]) & (a < self.t[-1]), vals[k], outside)
        width = b - a
        return np.where(width > 0, (hi - lo) / np.where(width > 0, width, 1.0), at)

    def mean_rate(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._mean(a, b, self.f, self.If, self.f0)

    def mean_load(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._mean(a, b, self.g, self.Ig, 0.0)
