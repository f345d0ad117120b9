"""I/O policies simulated over a run's real AccessPlan (NoPFS §6), each reduced to: for
every worker and step, which samples it reads and where each one comes from, plus
any set-up phase.  The timeline (:mod:`._engine`) turns that into time.

forebay's own policies call the runtime's code: ``forebay-clairvoyant`` takes its
owners, tiers and extra copies from :func:`forebay.store._placement.compute_placement`
and decides peer-or-PFS with the same per-byte comparison as the loader's FetchModel;
``forebay-preload`` stripes the dataset with the store's
:func:`~forebay.store.chunk_members`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..plan import AccessPlan, permutation
from ..store import NONE, compute_coverage, compute_placement, fill_tiers
from ..vocab import Tier
from ._engine import F_PEER_RAM, F_PEER_SSD, F_PFS, F_RAM, F_SSD, SOURCES, Timeline, timeline
from ._system import System
from .._intervals import positions_in_runs
from ..errors import InvalidArgumentError

__all__ = ["POLICIES", "Workload", "simulate_policy"]


@dataclass
class Workload:
    """A run to simulate: sample sizes (bytes), its access plan, the system, and
    whether every sample is a file of its own on the PFS (``per_file``: each PFS read
    also pays the system's ``pfs_open_ms``) or lives in a packed dataset (opened once)."""

    sizes: np.ndarray
    plan: AccessPlan
    system: System
    per_file: bool = False
    _streams: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        if len(self.sizes) != self.plan.num_samples:
            raise InvalidArgumentError("one size per sample of the plan")
        self.mb = self.sizes / 1e6
        self.open_s = self.system.pfs_open_ms / 1e3 if self.per_file else 0.0

    @property
    def n(self) -> int:
        return self.plan.world_size

    @property
    def steps(self) -> int:
        return self.plan.steps_per_epoch

    def batches(self, rank: int, epoch: int) -> np.ndarray:
        key = (rank, epoch)
        if key not in self._streams:
            self._streams[key] = self.plan.batches(rank, epoch)
        return self._streams[key]

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def step_compute_s(self) -> np.ndarray:
        """``float64[E * steps]``: each step's compute time, the slowest worker's
        ``bytes / c`` over the plan's batches (a synchronous data-parallel step).  Every
        policy is charged these, also those that reassign or substitute samples, so
        Perfect is a lower bound for all of them."""
        if "compute" not in self._streams:
            c = np.zeros((self.n, self.steps * self.plan.epochs))
            for e in range(self.plan.epochs):
                for i in range(self.n):
                    c[i, e * self.steps:(e + 1) * self.steps] = \
                        self.mb[self.batches(i, e)].sum(axis=1) / self.system.compute_MBps
            self._streams["compute"] = c.max(axis=0)
        return self._streams["compute"]


class _Run:
    """Per-worker, per-step reads by source, solved into a timeline by :meth:`finish`.

    PFS reads are kept as bytes and counts, not seconds: their speed depends on gamma,
    the number of workers reading the PFS at the same time, which :meth:`finish` finds
    from the timeline itself (``System.pfs_readers``)."""

    def __init__(self, w: Workload, threads: int) -> None:
        sysm, self.w, self.threads = w.system, w, threads
        s = w.steps * w.plan.epochs
        shape = (w.n, s)
        self.pfs_mb, self.pfs_n = np.zeros(shape), np.zeros(shape)
        self.other_s, self.write_mb = np.zeros(shape), np.zeros(shape)
        self.sync_mb, self.sync_n = np.zeros(shape), np.zeros(shape)
        self.nbytes = np.zeros(shape)
        ssd = sysm.local_s_per_MB("ssd") if sysm.ssd_read_MBps else np.inf
        pssd = sysm.peer_s_per_MB("ssd") if sysm.ssd_read_MBps else np.inf
        # source decisions assume every worker reads the PFS (gamma = N; conserving,
        # every thread of every worker), as NoPFS's implementation does: never more PFS
        # reads than a model knowing gamma exactly
        self.coef = np.array([sysm.pfs_setup_s_per_MB(w.n, threads),
                              sysm.local_s_per_MB("ram"), ssd, sysm.peer_s_per_MB("ram"), pssd])
        self.wcoef = sysm.write_s_per_MB(threads)
        self.src_s = np.zeros(len(SOURCES))
        self.src_n = np.zeros(len(SOURCES), dtype=np.int64)
        self.setup_s = 0.0
        self.timeline: Optional[Timeline] = None
        self.gamma = np.full(shape, float(w.n))   # PFS readers per read, set by solve()
        #: seconds from time 0 during which each worker's background fill threads read
        #: the PFS: it counts as a reader then, whatever its demand reads
        self.fill_until = np.zeros(w.n)
        #: (worker, MB, reads, threads, write s/MB, end) of each background fill
        #: reading the PFS from time 0 (NoPFS's tier fills); conserving, solve() finds
        #: each fill thread's mean PFS speed over its span (``fill_MBps``) and its end
        self.fills: list[tuple[int, float, float, int, float, float]] = []
        self.fill_MBps = np.zeros(0)
        #: PFS MB and reads outside the steps' deliveries (set-up phases, fills)
        self.extra_pfs_mb = 0.0
        self.extra_pfs_n = 0.0
        self.setup_write_s = 0.0         # the slowest worker's set-up preprocessing
        self.fill_read: Optional[tuple[np.ndarray, np.ndarray]] = None
        self.peer_mb = np.zeros(shape)

    def peer_or_pfs(self, peer_src: np.ndarray) -> np.ndarray:
        """The faster of a peer's copy and the file system, per sample (NoPFS §4)."""
        return np.where(self.coef[peer_src] < self.coef[F_PFS], peer_src, F_PFS)

    def add(self, rank: int, epoch: int, ids: np.ndarray, src: np.ndarray,
            sync: Optional[np.ndarray] = None) -> None:
        """Worker ``rank`` reads ``ids[h, :]`` at step h of ``epoch`` from ``src``;
        ``sync`` marks PFS reads the worker makes itself when it needs the sample (not
        prefetched)."""
        w = self.w
        sl = slice(epoch * w.steps, (epoch + 1) * w.steps)
        mb = w.mb[ids]
        pfs = src == F_PFS
        sy = np.zeros(ids.shape, dtype=bool) if sync is None else (sync & pfs)
        pre = pfs & ~sy
        self.pfs_mb[rank, sl] = np.where(pre, mb, 0.0).sum(axis=1)
        self.pfs_n[rank, sl] = pre.sum(axis=1)
        self.sync_mb[rank, sl] = np.where(sy, mb, 0.0).sum(axis=1)
        self.sync_n[rank, sl] = sy.sum(axis=1)
        other = np.where(pfs, 0.0, mb * self.coef[src])
        self.other_s[rank, sl] = other.sum(axis=1)
        self.write_mb[rank, sl] = np.where(sy, 0.0, mb).sum(axis=1)
        self.peer_mb[rank, sl] = np.where((src == F_PEER_RAM) | (src == F_PEER_SSD), mb,
                                          0.0).sum(axis=1)
        self.nbytes[rank, sl] = w.sizes[ids].sum(axis=1)
        self.src_s += np.bincount(src.ravel(), other.ravel(), len(SOURCES)) / self.threads
        self.src_n += np.bincount(src.ravel(), minlength=len(SOURCES))

    def solve(self, staging_bytes: Optional[int] = None) -> tuple[Timeline, np.ndarray]:
        """The timeline and the PFS thread-seconds per worker and step (a demand
        read counted once per prefetch thread, so that / threads is the worker's
        time).  gamma starts at N; with ``pfs_readers = "active"`` it is then each
        step's mean-field count of workers reading: 1 + the other workers' fraction
        of the step spent with a PFS read in flight (prefetch threads averaged, a
        worker's own demand reads in full; all of it while the worker's fill threads
        read, ``fill_until``), iterated to a fixed point."""
        if self.w.system.conserving:
            return self._solve_conserving(staging_bytes)
        w, sysm = self.w, self.w.system
        cap = sysm.staging_bytes if staging_bytes is None else staging_bytes
        comp = w.step_compute_s()[None, :]
        sync_write = self.sync_mb * sysm.write_s_per_MB(self.threads)
        gamma = np.full(self.pfs_mb.shape, float(w.n))
        for _ in range(40):
            coef = sysm.pfs_s_per_MB(gamma)
            pfs_s = self.pfs_mb * coef + self.pfs_n * w.open_s
            sync_s = self.sync_mb * coef + self.sync_n * w.open_s
            read = (pfs_s + self.other_s + self.write_mb * self.wcoef) / self.threads
            tl = timeline(read, comp, self.nbytes, cap, self.setup_s, sync_s + sync_write)
            if sysm.pfs_readers == "all" or w.n == 1:
                break
            lo = np.r_[self.setup_s, tl.end[:-1]]
            win = np.maximum(tl.end - lo, 1e-12)
            u = np.minimum(1.0, (pfs_s / self.threads + sync_s) / win[None, :])
            if self.fill_until.any():
                filling = np.clip((self.fill_until[:, None] - lo[None, :]) / win[None, :],
                                  0.0, 1.0)
                u = np.maximum(u, filling)
            new = 1.0 + u.sum(axis=0)[None, :] - u
            if np.abs(new - gamma).max() < 1e-4:
                break
            gamma = 0.5 * (gamma + new)
        self.gamma = gamma
        return tl, pfs_s + sync_s * self.threads

    def _solve_conserving(self, staging_bytes: Optional[int]
                          ) -> tuple[Timeline, np.ndarray]:
        """The conserving model's timeline: the PFS shared as a fluid by the threads
        reading it at each moment.  A delivery (worker i, step h) spans [issue, issue +
        R] with G_k = its PFS thread-seconds / R threads on the PFS; a demand read
        spans the S seconds before its step with one thread; a background fill spans
        [0, end] with its threads.  G(t) is the sum over the spans in flight, and a
        thread reads at f(G(t)) = t(G) / G, so the threads together get t(G(t)) at
        every moment, never more; each span's speed is the mean of f(G(t)) over it
        (and at most b_fs over the worker's threads), iterated to a fixed point."""
        w, sysm = self.w, self.w.system
        cap = sysm.staging_bytes if staging_bytes is None else staging_bytes
        comp = w.step_compute_s()[None, :]
        sync_write = self.sync_mb * sysm.write_s_per_MB(self.threads)
        own_cap = sysm.pfs_client_MBps
        every = float(w.n * self.threads + sum(f[3] for f in self.fills))
        rate = np.full(self.pfs_mb.shape, float(sysm.pfs_thread_MBps(every)))
        srate = rate.copy()
        fmb = np.array([f[1] for f in self.fills], dtype=np.float64)
        fn = np.array([f[2] for f in self.fills], dtype=np.float64)
        fthr = np.array([f[3] for f in self.fills], dtype=np.float64)
        fwr = np.array([f[4] for f in self.fills], dtype=np.float64)
        frate = np.minimum(np.full(len(fmb), float(sysm.pfs_thread_MBps(every))),
                           own_cap / np.maximum(fthr, 1.0))
        gseen = np.full(self.pfs_mb.shape, every)
        tl: Optional[Timeline] = None
        fluid: Optional[_Fluid] = None
        pfs_s = sync_s = np.zeros(self.pfs_mb.shape)
        last, damp = np.inf, 0.0
        for _ in range(80):
            pfs_s = self.pfs_mb / rate + self.pfs_n * w.open_s
            sync_s = self.sync_mb / srate + self.sync_n * w.open_s
            read = (pfs_s + self.other_s + self.write_mb * self.wcoef) / self.threads
            tl = timeline(read, comp, self.nbytes, cap, self.setup_s, sync_s + sync_write)
            if sysm.pfs_readers == "all":
                break
            assert tl.issue is not None
            d0, d1 = tl.issue, tl.issue + read
            dg = np.divide(pfs_s, read, out=np.zeros_like(read), where=read > 0)
            s1 = np.broadcast_to(tl.start[None, :], read.shape)
            s0 = s1 - (sync_s + sync_write)
            sg = np.divide(sync_s, sync_s + sync_write, out=np.zeros_like(sync_s),
                           where=sync_s > 0)
            fpfs = fmb / frate + fn * w.open_s                 # a fill's thread-seconds
            fend = (fpfs + fmb * fwr) / np.maximum(fthr, 1.0)
            fg = fthr * np.divide(fpfs, fpfs + fmb * fwr, out=np.zeros_like(fpfs),
                                  where=fpfs > 0)
            fluid = _Fluid(np.concatenate([d0.ravel(), s0.ravel(), np.zeros(len(fend))]),
                           np.concatenate([d1.ravel(), s1.ravel(), fend]),
                           np.concatenate([dg.ravel(), sg.ravel(), fg]),
                           sysm.pfs_thread_MBps)
            new = fluid.mean_rate(d0.ravel(), d1.ravel()).reshape(read.shape)
            new = np.minimum(new, own_cap / np.maximum(dg, 1.0))
            snew = np.minimum(fluid.mean_rate(s0.ravel(), s1.ravel()).reshape(read.shape),
                              own_cap)
            gseen = np.maximum(fluid.mean_load(d0.ravel(), d1.ravel()).reshape(read.shape),
                               1.0)
            fnew = np.minimum(fluid.mean_rate(np.zeros(len(fend)), fend),
                              own_cap / np.maximum(fthr, 1.0))
            # the change in PFS thread-seconds the new speeds give, over all of them
            # (a span that reads little may swing without moving the timeline)
            secs = np.concatenate([self.pfs_mb.ravel() / rate.ravel(),
                                   self.sync_mb.ravel() / srate.ravel(), fmb / frate])
            diff = np.concatenate([self.pfs_mb.ravel() / new.ravel(),
                                   self.sync_mb.ravel() / snew.ravel(), fmb / fnew]) - secs
            change = float(np.abs(diff).sum() / max(secs.sum(), 1e-300))
            if change <= 1e-6:
                break
            # straight to the new speeds while that converges, halfway once it swings
            if change >= 0.9 * last:     # swings or stalls: smaller steps
                damp = min(0.9, 0.5 + damp / 2)
            last = change
            rate = damp * rate + (1 - damp) * new
            srate = damp * srate + (1 - damp) * snew
            frate = damp * frate + (1 - damp) * fnew
        assert tl is not None
        # what the fills read during the run (the rest comes after its end)
        self.fill_MBps = frate
        fpfs = fmb / frate + fn * w.open_s
        fend = (fpfs + fmb * fwr) / np.maximum(fthr, 1.0)
        upto = np.minimum(fend, tl.total_s)
        part = np.divide(upto, fend, out=np.ones_like(upto), where=fend > 0)
        if fluid is None:                            # pfs_readers = "all": even speed
            got = fmb * part
        else:
            fg = fthr * np.divide(fpfs, fpfs + fmb * fwr, out=np.zeros_like(fpfs),
                                  where=fpfs > 0)
            got = fg * upto * fluid.mean_rate(np.zeros(len(fend)), upto)
        self.fill_read = (got, fn * part)
        self.gamma = gseen
        return tl, pfs_s + sync_s * self.threads

    def finish(self, staging_bytes: Optional[int] = None) -> dict[str, Any]:
        w = self.w
        tl, pfs_s = self.solve(staging_bytes)
        self.timeline = tl
        src_s = self.src_s.copy()
        src_s[F_PFS] = pfs_s.sum() / self.threads
        res = _report(w, tl, by_source={k: float(v) / w.n for k, v in zip(SOURCES, src_s)},
                      fetches={k: int(v) for k, v in zip(SOURCES, self.src_n)})
        has_pfs = (self.pfs_mb + self.sync_mb) > 0
        res["mean_pfs_readers"] = float(self.gamma[has_pfs].mean()) if has_pfs.any() else 0.0
        res.update(self.bounds(tl))
        return res

    def bounds(self, tl: Timeline) -> dict[str, Any]:
        """What the run draws from each resource, and the least time each needs for it
        whatever the schedule: the PFS's bytes at the table's largest rate, its reads
        at the open latency over every thread, a worker's peer bytes over its link,
        its preprocessing, and compute, epoch by epoch.  An epoch lasts at least its
        largest need; ``au_bound`` is the compute over the sum of those, and
        ``binding`` the resource that adds most beyond compute."""
        w, sysm = self.w, self.w.system
        # outside the steps' deliveries: set-up phases, and what fills read in the run
        extra_mb, extra_n = self.extra_pfs_mb, self.extra_pfs_n
        if self.fill_read is not None:                 # the conserving model's account
            extra_mb += float(self.fill_read[0].sum())
            extra_n += float(self.fill_read[1].sum())
        elif self.fills:                               # thesis: a fill's bytes even in time
            part = np.minimum(1.0, tl.total_s / np.maximum([f[5] for f in self.fills], 1e-12))
            extra_mb += float((np.array([f[1] for f in self.fills]) * part).sum())
            extra_n += float((np.array([f[2] for f in self.fills]) * part).sum())
        top = max(sysm.pfs_MBps.values())
        # per epoch: what each resource needs at least (set-up and fills in epoch 0)
        e_, st = w.plan.epochs, w.steps
        per = lambda a: a.reshape(w.n, e_, st).sum(axis=2)       # noqa: E731  [N, E]
        pfs_e = per(self.pfs_mb + self.sync_mb).sum(axis=0)
        n_e = per(self.pfs_n + self.sync_n).sum(axis=0)
        pfs_e[0] += extra_mb
        n_e[0] += extra_n
        pfs_mb = float(pfs_e.sum())
        comp_e = w.step_compute_s().reshape(e_, st).sum(axis=1)
        prep_e = (per(self.write_mb) * self.wcoef).max(axis=0) / self.threads
        prep_e[0] += self.setup_write_s
        each = {"compute": comp_e, "PFS bandwidth": pfs_e / top,
                "PFS requests": n_e * w.open_s / (w.n * self.threads),
                "network link": per(self.peer_mb).max(axis=0) / sysm.network_MBps,
                "tier and peer reads": per(self.other_s).max(axis=0) / self.threads,
                "preprocessing": prep_e}
        names = list(each)
        table = np.stack([each[k] for k in names])               # [resources, E]
        worst = table.max(axis=0)
        over = {k: float(np.where(table.argmax(axis=0) == j, worst - comp_e, 0.0).sum())
                for j, k in enumerate(names)}
        binding = max(over, key=lambda k: over[k]) if max(over.values()) > 0 else "compute"
        j = names.index(binding)
        bound = float(worst.sum())
        return {"pfs_MB": pfs_mb, "pfs_MBps_mean": pfs_mb / tl.total_s if tl.total_s else 0.0,
                "pfs_MBps_max": top,
                "need_s": {k: float(v.sum()) for k, v in each.items()},
                "binding": binding, "au_bound": tl.compute_s / bound if bound else 1.0,
                # epochs in which the binding resource needs longer than compute
                "binding_epochs": int(((table.argmax(axis=0) == j) & (worst > comp_e)).sum())}


class _Fluid:
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


def _report(w: Workload, tl: Timeline, *, by_source: dict, fetches: dict) -> dict[str, Any]:
    ends = tl.end[w.steps - 1::w.steps] if len(tl.end) else np.zeros(0)
    epoch_s = np.diff(np.r_[0.0, ends]).tolist()
    n_reads = sum(fetches.values())
    return {"total_s": tl.total_s, "stall_s": tl.stall_s, "compute_s": tl.compute_s,
            "setup_s": tl.setup_s, "by_source": by_source, "fetches": fetches,
            "pfs_reads": fetches.get("pfs", 0),
            "pfs_reads_per_sample": fetches.get("pfs", 0) / w.plan.num_samples,
            "reads": n_reads, "epoch_s": epoch_s,
            "first_epoch_s": epoch_s[0] if epoch_s else 0.0,
            # when the first step starts: set-up and the first batch's delivery
            "first_batch_s": float(tl.start[0]) if len(tl.start) else tl.setup_s,
            "steady_epoch_s": float(np.mean(epoch_s[1:])) if len(epoch_s) > 1 else None,
            # DLIO's accelerator utilisation: compute over the whole run
            "accelerator_utilization": tl.compute_s / tl.total_s if tl.total_s else None,
            "failed": None}


def _failed(reason: str) -> dict[str, Any]:
    return {"total_s": None, "stall_s": None, "compute_s": None, "setup_s": None,
            "by_source": {}, "fetches": {}, "pfs_reads": None,
            "accelerator_utilization": None, "failed": reason}


def _prefetching(w: Workload) -> _Run:
    """A run with p_0 prefetch threads on every worker."""
    return _Run(w, w.system.staging_threads)


def _local(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_RAM, F_SSD)


def _peer(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_PEER_RAM, F_PEER_SSD)


# -- the policies -------------------------------------------------------------------

def perfect(w: Workload) -> dict[str, Any]:
    """No stalls: compute only (the lower bound)."""
    tl = _compute_only(w)
    return _report(w, tl, by_source={k: 0.0 for k in SOURCES}, fetches={k: 0 for k in SOURCES})


def _compute_only(w: Workload) -> Timeline:
    comp = w.step_compute_s()[None, :]
    return timeline(np.zeros_like(comp), comp, np.zeros_like(comp), 1 << 62)


def naive(w: Workload) -> dict[str, Any]:
    """Every sample from the PFS when needed: one reader per worker, no prefetching."""
    run = _Run(w, 1)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            run.add(i, e, ids, np.full(ids.shape, F_PFS))
    return run.finish(staging_bytes=0)


def staging(w: Workload) -> dict[str, Any]:
    """Prefetch from the PFS in access order into the staging buffer, drop after use
    (double buffering, tf.data)."""
    run = _prefetching(w)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            run.add(i, e, ids, np.full(ids.shape, F_PFS))
    return run.finish()


def _setup_s(w: Workload, run: _Run, pfs_mb: np.ndarray, pfs_n: np.ndarray, threads: int,
             peer_mb: Optional[np.ndarray] = None, peer_s_per_MB: float = 0.0) -> float:
    """A set-up phase before training: worker i loads ``pfs_mb[i]`` MB (``pfs_n[i]``
    samples) from the PFS, every worker at once, and copies ``peer_mb[i]`` from its
    peers, with ``threads`` threads; the slowest worker's seconds."""
    pfs_mb = np.asarray(pfs_mb, dtype=np.float64)
    run.extra_pfs_mb += float(pfs_mb.sum())
    run.extra_pfs_n += float(np.sum(pfs_n))
    t = _load_times(w, pfs_mb, np.asarray(pfs_n, dtype=np.float64), threads, run.wcoef)
    writes = pfs_mb * run.wcoef
    if peer_mb is not None:
        t = t + peer_mb * (peer_s_per_MB + run.wcoef) / threads
        writes = writes + peer_mb * run.wcoef
    run.setup_write_s = float(np.max(writes) / threads) if len(writes) else 0.0
    return float(np.max(t)) if len(t) else 0.0


def _load_times(w: Workload, mb: np.ndarray, n: np.ndarray, threads: int,
                write_s_per_MB: float) -> np.ndarray:
    """When each worker is done loading ``mb[i]`` MB (``n[i]`` reads) from the PFS with
    ``threads`` threads (fetch, then write), every worker starting at 0.  Conserving:
    while k workers load, each thread reads at f(k * threads) (at most b_fs over the
    worker's threads), and a worker that is done leaves the PFS to the others
    (processor sharing, solved in order of size).  Thesis: every read at t(N)/N."""
    sysm = w.system
    if not sysm.conserving:
        return (mb * (sysm.pfs_setup_s_per_MB(w.n, threads) + write_s_per_MB)
                + n * w.open_s) / threads
    order = np.argsort(mb, kind="stable")
    done = np.zeros(len(mb))
    t, prev = 0.0, 0.0
    for j, left in enumerate(mb[order].tolist()):
        k = len(order) - j
        speed = min(float(sysm.pfs_thread_MBps(k * threads)), sysm.pfs_client_MBps / threads)
        t += (left - prev) * (1.0 / speed + write_s_per_MB) / threads
        prev = left
        done[order[j]] = t
    return done + n * w.open_s / threads


def _buckets(w: Workload) -> np.ndarray:
    """Worker i's contiguous bucket of ids: F // N each, the last takes the rest."""
    f = w.plan.num_samples
    return np.minimum(np.arange(f) // max(f // w.n, 1), w.n - 1)


def _loaded(w: Workload, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(MB, samples) each worker holds under ``owner``."""
    held = owner >= 0
    mb = np.bincount(owner[held], w.mb[held], minlength=w.n)
    return mb, np.bincount(owner[held], minlength=w.n).astype(np.float64)


def _deepio(w: Workload, opportunistic: bool) -> dict[str, Any]:
    run = _prefetching(w)
    f, sysm = w.plan.num_samples, w.system
    if w.total_bytes <= w.n * sysm.ram_bytes:
        owner = _buckets(w)                   # the dataset partitioned over the RAMs
    else:                                     # each RAM filled with the next ids in turn
        owner = np.full(f, -1, dtype=np.int64)
        cum = np.cumsum(w.sizes)
        start = 0
        for i in range(w.n):
            base = cum[start - 1] if start else 0
            end = int(np.searchsorted(cum, base + sysm.ram_bytes, side="right"))
            owner[start:end] = i
            start = end
    mb, cnt = _loaded(w, owner)
    run.setup_s = _setup_s(w, run, mb, cnt, sysm.ram_threads)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            o = owner[ids]
            src = np.where(o == i, F_RAM, np.where(o >= 0, F_PEER_RAM, F_PFS))
            if opportunistic:
                src = np.where(o < 0, F_RAM, src)
            run.add(i, e, ids, src, sync=src == F_PFS)
    return run.finish()


def deepio(w: Workload) -> dict[str, Any]:
    """DeepIO, ordered mode: before training the workers load the dataset into their
    RAM, partitioned by id (contiguous buckets; when it does not fit, each RAM filled
    with the next ids in turn); every epoch follows the global order, cached samples
    prefetched from the own or a peer's memory (RDMA), uncached ones read from the PFS
    when needed (not prefetched).  Access frequency plays no part."""
    return _deepio(w, opportunistic=False)


def deepio_opportunistic(w: Workload) -> dict[str, Any]:
    """DeepIO with entropy-aware opportunistic ordering: as ordered mode, but a sample
    cached nowhere is replaced by one the worker holds (the access order changes, which
    may cost accuracy; every step is still charged the plan's compute)."""
    return _deepio(w, opportunistic=True)


def parallel_staging(w: Workload) -> dict[str, Any]:
    """Parallel data staging to node-local storage (the SSD; RAM when there is none):
    before training each worker loads its contiguous shard from the PFS (as much of it
    as fits), then copies the other workers' shards from them as far as its storage
    allows.  A worker that holds the whole dataset follows the global order from its
    own storage; otherwise it trains on what it staged, shuffled locally each epoch
    (the access order changes and samples no worker staged are never read; as in the
    thesis, whose workers draw their samples from what they hold)."""
    from ..store import chunk_members

    run = _prefetching(w)
    sysm = w.system
    use_ssd = sysm.ssd_bytes > 0 and bool(sysm.ssd_read_MBps)
    cap, tier_src = (sysm.ssd_bytes, F_SSD) if use_ssd else (sysm.ram_bytes, F_RAM)
    threads = sysm.ssd_threads if use_ssd else sysm.ram_threads
    peer_coef = run.coef[F_PEER_SSD if use_ssd else F_PEER_RAM]
    bounds, _ = chunk_members(w.sizes, w.n)
    b = w.plan.batch_size
    pfs_mb, pfs_n, peer_mb = np.zeros(w.n), np.zeros(w.n), np.zeros(w.n)
    for i in range(w.n):
        shard = np.arange(bounds[i], bounds[i + 1])
        if len(shard) == 0:
            shard = np.arange(w.plan.num_samples)  # more workers than samples: share
        order = np.r_[shard, np.setdiff1d(np.arange(w.plan.num_samples), shard)]
        fits = np.cumsum(w.sizes[order]) <= cap
        held = np.zeros(w.plan.num_samples, dtype=bool)
        held[order[fits]] = True
        own = held[shard]
        pfs_mb[i], pfs_n[i] = w.mb[shard[own]].sum(), own.sum()
        peer_mb[i] = w.mb[held].sum() - pfs_mb[i]
        everything = bool(held.all())
        for e in range(w.plan.epochs):
            if everything:
                ids = w.batches(i, e)
            else:
                pool = np.flatnonzero(held) if held.any() else shard
                order_e = pool[permutation(len(pool), w.plan.seed + 7919 * (i + 1), e)]
                ids = np.resize(order_e, w.steps * b).reshape(w.steps, b)
            run.add(i, e, ids, np.where(held[ids], tier_src, F_PFS))
    run.setup_s = _setup_s(w, run, pfs_mb, pfs_n, threads, peer_mb, peer_coef)
    return run.finish()


def lbann(w: Workload) -> dict[str, Any]:
    """LBANN's data store, dynamic mode: epoch 0 reads from the PFS and each worker keeps
    what it read in RAM; later epochs read from the owner's memory.  Fails when the
    dataset exceeds the workers' aggregate RAM (it caches in memory only)."""
    sysm = w.system
    if w.total_bytes > w.n * sysm.ram_bytes:
        return _failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB)")
    run = _prefetching(w)
    pos = w.plan.position(0, np.arange(w.plan.num_samples))
    owner = np.where(pos >= 0, (pos % w.plan.global_batch) // w.plan.batch_size, -1)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            o = owner[ids]
            src = np.full(ids.shape, F_PFS) if e == 0 else np.where(
                o == i, F_RAM, np.where(o >= 0, run.peer_or_pfs(np.full(ids.shape, F_PEER_RAM)),
                                      F_PFS))
            run.add(i, e, ids, src)
    return run.finish()


def lbann_preload(w: Workload) -> dict[str, Any]:
    """LBANN's data store, preloading mode: before training each worker loads a
    contiguous bucket of the dataset into its RAM; every epoch reads from the own or the
    owner's memory.  Fails when the dataset exceeds the workers' aggregate RAM."""
    sysm = w.system
    if w.total_bytes > w.n * sysm.ram_bytes:
        return _failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB)")
    run = _prefetching(w)
    owner = _buckets(w)
    mb, cnt = _loaded(w, owner)
    run.setup_s = _setup_s(w, run, mb, cnt, sysm.ram_threads)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            run.add(i, e, ids, np.where(owner[ids] == i, F_RAM, F_PEER_RAM))
    return run.finish()


def locality_aware(w: Workload) -> dict[str, Any]:
    """Yang and Cong's locality-aware loading: before training each worker loads a
    contiguous bucket of the dataset into its RAM, then SSD; every epoch keeps the
    global batches but reassigns their samples so each worker takes the ones it holds
    (up to its batch size); the rest go to the workers with room and come from the
    holder's storage or the PFS."""
    run = _prefetching(w)
    sysm = w.system
    owner = _buckets(w)
    holder = np.full(w.plan.num_samples, -1, dtype=np.int64)
    tier = np.full(w.plan.num_samples, NONE, dtype=np.int8)
    for i in range(w.n):
        mine = np.flatnonzero(owner == i)
        t = fill_tiers(mine, w.sizes, sysm.ram_bytes, sysm.ssd_bytes)
        holder[mine[t != NONE]] = i
        tier[mine] = t
    mb, cnt = _loaded(w, holder)
    run.setup_s = _setup_s(w, run, mb, cnt, sysm.ram_threads)
    n, b, h = w.n, w.plan.batch_size, w.steps
    for e in range(w.plan.epochs):
        gb = w.plan.global_batches(e)                      # [h, n*b]
        row = np.repeat(np.arange(h), n * b)
        flat = gb.reshape(-1)
        hold = holder[flat]
        key = row * (n + 1) + np.where(hold >= 0, hold, n)
        order = np.argsort(key, kind="stable")
        k_sorted = key[order]
        starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]])
        rank_in = positions_in_runs(np.diff(np.r_[starts, len(order)]))
        local = np.zeros(len(flat), dtype=bool)
        local[order] = (hold[order] >= 0) & (rank_in < b)
        worker = np.full(len(flat), -1, dtype=np.int64)
        worker[local] = hold[local]
        taken = np.bincount(row[local] * n + hold[local], minlength=h * n)
        free = b - taken                                   # slots left per (row, worker)
        rest = np.flatnonzero(~local)                      # in row order
        worker[rest] = np.repeat(np.tile(np.arange(n), h), free)
        t = tier[flat]
        src = np.where(local, _local(t), np.where(hold >= 0, run.peer_or_pfs(_peer(t)), F_PFS))
        by = np.lexsort((np.arange(len(flat)), worker, row))   # row, then worker
        flat_s, src_s, w_s = flat[by], src[by], worker[by]
        for i in range(n):
            m = w_s == i
            run.add(i, e, flat_s[m].reshape(h, b), src_s[m].reshape(h, b))
    return run.finish()


def nopfs(w: Workload) -> dict[str, Any]:
    """NoPFS (§5): each worker fills its RAM, then SSD, with the samples it reads most
    often (no coverage: popular samples sit on several workers while others are cached
    nowhere).  The fills run from time 0 on the tiers' own threads (p_1, p_2), each
    tier in the order of first access, alongside training; a sample is read from the
    own tier once filled there, else (from epoch 1, presence being guessed) the faster
    of a peer holding it and the PFS, else the PFS."""
    sysm, f = w.system, w.plan.num_samples
    write = sysm.write_s_per_MB(sysm.staging_threads)
    tier_threads = {int(Tier.RAM): sysm.ram_threads, int(Tier.SSD): sysm.ssd_threads}

    def held_by(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The samples worker i fills, their tiers, and the MB and samples its tier's
        fill has read up to and including each (in order of first access)."""
        freq = w.plan.frequencies(i)
        first = w.plan.first_access(i)
        cand = np.flatnonzero(freq > 0)
        cand = cand[np.lexsort((cand, first[cand], -freq[cand]))]
        held = np.full(f, NONE, dtype=np.int8)
        held[cand] = fill_tiers(cand, w.sizes, sysm.ram_bytes, sysm.ssd_bytes)
        cmb, cn = np.zeros(f), np.zeros(f)
        for t in (Tier.RAM, Tier.SSD):
            ids = np.flatnonzero(held == t)
            ids = ids[np.argsort(first[ids], kind="stable")]
            cmb[ids] = np.cumsum(w.mb[ids])
            cn[ids] = np.arange(1, len(ids) + 1)
        ids = np.flatnonzero(held != NONE)
        return (ids.astype(np.int32) if f < 2**31 else ids), held[ids], cmb[ids], cn[ids]

    # copies per sample first, then each worker's reads.  Each worker's placement is
    # built once (its plan walks are most of the cost) and kept as the samples it
    # holds, their tiers and fill positions: at most its stream's length, as the
    # workload's cached batches, never N x F
    ram_cnt = np.zeros(f, dtype=np.int32)
    ssd_cnt = np.zeros(f, dtype=np.int32)
    kept: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for i in range(w.n):
        ids_i, tier_i, cmb_i, cn_i = held_by(i)
        np.add.at(ram_cnt, ids_i[tier_i == Tier.RAM], 1)
        np.add.at(ssd_cnt, ids_i[tier_i == Tier.SSD], 1)
        kept.append((ids_i, tier_i, cmb_i, cn_i))
    # each (worker, tier) fill's PFS speed per thread: the thesis' t(N)/N; conserving,
    # every fill and prefetch thread reading at first, then what the timeline gives
    fill_threads = sum(tier_threads[int(t)] for t in (Tier.RAM, Tier.SSD)
                       if (sysm.ram_bytes if t == Tier.RAM else sysm.ssd_bytes) > 0)
    first_guess = (1.0 / sysm.pfs_s_per_MB(w.n) if not sysm.conserving else
                   float(sysm.pfs_thread_MBps(w.n * (sysm.staging_threads + fill_threads))))
    fill_rate: dict[tuple[int, int], float] = {
        (i, int(t)): float(first_guess) for i in range(w.n) for t in (Tier.RAM, Tier.SSD)}

    def ready_of(i: int) -> np.ndarray:
        ids_i, tier_i, cmb_i, cn_i = kept[i]
        out = np.empty(len(ids_i))
        for t, thr in tier_threads.items():
            m = tier_i == t
            rate = min(fill_rate[(i, t)], sysm.pfs_client_MBps / thr) if sysm.conserving \
                else fill_rate[(i, t)]
            out[m] = (cmb_i[m] * (1.0 / rate + write) + cn_i[m] * w.open_s) / thr
        return out

    held = np.full(f, NONE, dtype=np.int8)      # one worker's at a time, reset after
    ready = np.full(f, np.inf)
    # when each step's delivery begins decides whether a fill is done: start from the
    # compute-only timeline, then the run's own, until the sources (and, conserving,
    # the fills' speeds) stop changing
    issue = np.broadcast_to(_compute_only(w).start, (w.n, w.steps * w.plan.epochs))
    res: dict[str, Any] = {}
    for _ in range(6):
        run = _prefetching(w)
        readies = [ready_of(i) for i in range(w.n)]
        fill_until = np.array([r.max() if len(r) else 0.0 for r in readies])
        run.fill_until = fill_until      # the thesis counts a filling node as a reader
        keys = []
        for i in range(w.n):
            for t, thr in tier_threads.items():
                m = kept[i][1] == t
                if m.any():
                    run.fills.append((i, float(w.mb[kept[i][0][m]].sum()), float(m.sum()),
                                      thr, write, float(readies[i][m].max())))
                    keys.append((i, t))
        for i in range(w.n):
            ids_i, tier_i = kept[i][0], kept[i][1]
            held[ids_i], ready[ids_i] = tier_i, readies[i]
            for e in range(w.plan.epochs):
                ids = w.batches(i, e)
                sl = slice(e * w.steps, (e + 1) * w.steps)
                mine = np.where(ready[ids] <= issue[i, sl][:, None], held[ids], NONE)
                if e == 0:
                    remote = np.full(ids.shape, F_PFS)
                else:
                    peer_ram = ram_cnt[ids] - (held[ids] == Tier.RAM) > 0
                    peer_ssd = ssd_cnt[ids] - (held[ids] == Tier.SSD) > 0
                    remote = np.where(peer_ram, run.peer_or_pfs(np.full(ids.shape, F_PEER_RAM)),
                                      np.where(peer_ssd,
                                               run.peer_or_pfs(np.full(ids.shape, F_PEER_SSD)),
                                               F_PFS))
                run.add(i, e, ids, np.where(mine != NONE, _local(mine), remote))
            held[ids_i], ready[ids_i] = NONE, np.inf
        res = run.finish()
        assert run.timeline is not None and run.timeline.issue is not None
        stable = bool(np.allclose(run.timeline.issue, issue, rtol=1e-3, atol=1e-6))
        if sysm.conserving and len(run.fill_MBps):
            for key, r in zip(keys, run.fill_MBps.tolist()):
                stable = stable and abs(fill_rate[key] - float(r)) <= 1e-3 * float(r)
                fill_rate[key] = 0.5 * (fill_rate[key] + r)     # sources swing: halfway
        if stable:
            break
        issue = run.timeline.issue
    return res


def forebay_clairvoyant(w: Workload) -> dict[str, Any]:
    """forebay's clairvoyant loader, with the runtime's placement: every sample has a
    coverage owner when capacity allows (read from the PFS once, at its first need),
    then each worker's extra copies of what it reads most; presence is exact, so a
    sample is read from its owner as soon as the step that first needed it is over."""
    run = _prefetching(w)
    sysm, plan = w.system, w.plan
    ram = [sysm.ram_bytes] * w.n
    ssd = [sysm.ssd_bytes] * w.n
    span, gbatch, b = plan.steps_per_epoch * plan.global_batch, plan.global_batch, \
        plan.batch_size
    placement = None
    cov = compute_coverage(plan, w.sizes, ram, ssd)      # the same for every worker
    for i in range(w.n):
        placement = compute_placement(plan, w.sizes, ram, ssd, i, coverage=cov)
        owner, tier, first_need = placement.owner, placement.tier, placement.first_need
        extra = np.full(plan.num_samples, NONE, dtype=np.int8)
        extra[placement.extra_ram] = Tier.RAM
        extra[placement.extra_ssd] = Tier.SSD
        own_first = plan.first_access(i)
        first_step = np.where(first_need >= 0, first_need // gbatch, -1)
        for e in range(plan.epochs):
            ids = w.batches(i, e)
            h = np.arange(w.steps)[:, None]
            gpos = e * span + h * gbatch + i * b + np.arange(b)[None, :]
            qpos = (e * w.steps + h) * b + np.arange(b)[None, :]    # in i's own stream
            o, t, x = owner[ids], tier[ids], extra[ids]
            step = e * w.steps + h
            src = np.full(ids.shape, F_PFS)
            from_peer = (o >= 0) & (o != i) & (first_step[ids] < step)
            src = np.where(from_peer, run.peer_or_pfs(_peer(t)), src)
            src = np.where((x != NONE) & (own_first[ids] < qpos), _local(x), src)
            src = np.where((o == i) & (first_need[ids] != gpos), _local(t), src)
            run.add(i, e, ids, src)
    res = run.finish()
    if placement is not None:
        res["covered"] = placement.covered
    return res


def forebay_preload(w: Workload) -> dict[str, Any]:
    """forebay's preload mode (DDStore) at the loader's default width: before training
    the dataset is loaded into the workers' RAM as one replica striped in contiguous
    chunks over all of them; every read is from the own memory or a peer's over RMA.
    Fails when the dataset exceeds the workers' aggregate RAM."""
    from ..store import chunk_members

    sysm = w.system
    width = w.n
    if w.total_bytes > width * sysm.ram_bytes:
        return _failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB): "
                       f"use forebay-clairvoyant")
    run = _prefetching(w)
    bounds, member = chunk_members(w.sizes, width)
    chunk_mb = np.diff(np.r_[0.0, np.cumsum(w.mb)][bounds])
    # every worker loads its chunk at once
    run.setup_s = float(_load_times(w, chunk_mb, np.diff(bounds).astype(float), run.threads,
                                    sysm.tier_write_s_per_MB("ram")).max())
    run.extra_pfs_mb, run.extra_pfs_n = float(w.mb.sum()), float(w.plan.num_samples)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            local = member[ids] == i % width
            run.add(i, e, ids, np.where(local, F_RAM, F_PEER_RAM))
    res = run.finish()
    res["width"] = width
    return res


POLICIES: dict[str, Callable[[Workload], dict[str, Any]]] = {
    "perfect": perfect, "naive": naive, "staging": staging, "deepio": deepio,
    "deepio-opportunistic": deepio_opportunistic,
    "parallel-staging": parallel_staging, "lbann": lbann, "lbann-preload": lbann_preload,
    "locality-aware": locality_aware,
    "nopfs": nopfs, "forebay-preload": forebay_preload,
    "forebay-clairvoyant": forebay_clairvoyant,
}


def simulate_policy(name: str, w: Workload) -> dict[str, Any]:
    try:
        fn = POLICIES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
    return fn(w)
