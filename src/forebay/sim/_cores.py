"""A node's cores shared by its loader's threads (docs/sim.md, "A node's cores"): the
threads cycle between waits of their own (reads) and the node's cores, as a closed
queueing network solved exactly by mean value analysis.  The cores are a processor
shared by the threads present, at most one core each, so the network's answer holds
whatever the spread of the spans (product form: a delay and a processor-sharing
station are insensitive to it)."""

from __future__ import annotations

import numpy as np

__all__ = ["delivery_s"]

#: damped passes, at most, of the training process's share of the cores (a fixed point)
PASSES = 12


def _throughput(z: np.ndarray, d: np.ndarray, threads: int, cores: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Batches a second of ``threads`` threads each spending ``z`` seconds of its own and
    ``d`` CPU-seconds (on one core) a batch on ``cores`` shared cores, and the mean
    number of threads at the cores: exact MVA with a load-dependent station, service
    rate min(j, cores) / d with j threads present."""
    if (cores >= threads).all():     # a core for every thread: a delay, in closed form
        x = np.divide(threads, z + d, out=np.full_like(d, np.inf), where=z + d > 0)
        return x, np.where(np.isfinite(x), x * d, 0.0)
    p = [np.ones_like(d)]            # p[j]: P(j threads at the cores | n - 1 threads)
    x = np.zeros_like(d)
    for n in range(1, threads + 1):
        per = [d / np.minimum(j, cores) for j in range(1, n + 1)]   # 1 / mu(j)
        r = sum(j * per[j - 1] * p[j - 1] for j in range(1, n + 1))
        x = np.divide(n, z + r, out=np.full_like(d, np.inf), where=z + r > 0)
        q = [x * per[j - 1] * p[j - 1] for j in range(1, n + 1)]
        p = [np.clip(1.0 - sum(q), 0.0, 1.0), *q]
    busy = np.zeros_like(d)
    for j in range(1, threads + 1):
        busy += j * p[j]
    return x, busy


def delivery_s(z: np.ndarray, d: np.ndarray, main: np.ndarray, threads: int,
               cpus: float) -> tuple[np.ndarray, np.ndarray]:
    """Seconds between a node's deliveries: ``threads`` threads, each batch ``z`` seconds
    of its own (reads, waits) and ``d`` CPU-seconds on the node's ``cpus`` cores, which
    the training process shares, spending ``main`` CPU-seconds a batch (the hand-back).
    The training process takes its mean share, ``main`` x throughput, off the cores the
    threads see (a fixed point, damped).  With cores for every thread this is the
    threads' cycle over their number, (z + d) / threads.  Also returns the mean number
    of threads at the cores, with whom the training process shares them."""
    z, d, main = (np.asarray(a, dtype=np.float64) for a in (z, d, main))
    floor = 1e-3 * cpus
    x, busy = _throughput(z, d, threads, np.full(d.shape, float(cpus)))
    for _ in range(PASSES if main.any() else 0):
        cores = np.maximum(cpus - np.where(np.isfinite(x), x, 0.0) * main, floor)
        got, busy = _throughput(z, d, threads, cores)
        new = 0.5 * (x + got)
        finite = np.isfinite(new) & (new > 0)
        done = np.allclose(new[finite], x[finite], rtol=1e-9, atol=0.0)
        x = new
        if done:
            break
    return np.divide(1.0, x, out=np.zeros_like(x), where=x > 0), busy
