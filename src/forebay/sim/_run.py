"""A simulated run: the workload (sizes, plan, system), and every worker's per-step
reads by source, solved into a timeline by :class:`Run` under the system's model
(conserving: a fixed point of the PFS's shared fluid; thesis: the published rule).
The policies (:mod:`._policies`) fill a Run; :mod:`._engine` turns it into time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..plan import AccessPlan
from . import _cores as cores
from ._engine import F_PEER_RAM, F_PEER_SSD, F_PFS, SOURCES, Timeline, timeline
from ._fluid import Fluid
from ._system import System
from ..errors import InvalidArgumentError

__all__ = ["Run", "Workload", "failed", "prefetching", "report"]


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


class Run:
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

    def handback_s(self, busy: "np.ndarray | float" = 0.0) -> np.ndarray:
        """``[N, S]``: the training process's seconds taking each step's batch back
        from the loader's worker processes (``System.handback_MBps``), in series with
        the step like a read it makes itself (0 without).  On a node of
        ``System.cpus`` cores it shares them with the ``busy`` threads there (on
        average, from :meth:`delivery_s`): min(1, cpus / (1 + busy)) of a core."""
        sysm = self.w.system
        alone = self.nbytes / 1e6 * sysm.handback_s_per_MB()
        if sysm.cpus is None:
            return alone
        return alone * sysm.core_share / np.minimum(1.0, sysm.cpus / (1.0 + busy))

    def cpu_s(self) -> np.ndarray:
        """``[N, S]``: the CPU seconds (on one core) of each step's batch on its worker:
        its preprocessing, prefetched or not, and its hand-back."""
        sysm = self.w.system
        hand = 0.0 if sysm.handback_MBps is None else self.nbytes / 1e6 / sysm.handback_MBps
        return (self.write_mb + self.sync_mb) / sysm.preprocess_MBps + hand

    def record_cost(self) -> np.ndarray:
        """``[N, S]``: the PFS seconds per MB of each step's record reads relative to
        the read table's, by the share of the dataset's records the worker reads from
        the PFS in that epoch (``System.pfs_record_cost``: a record's request brings in
        parts of its neighbours, wasted unless the worker reads them too); 1 where
        samples are files of their own, or without the system's dense table."""
        w = self.w
        e_, st = w.plan.epochs, w.steps
        reads = (self.pfs_n + self.sync_n).reshape(w.n, e_, st).sum(axis=2)
        return np.repeat(self._cost_of(reads), st, axis=1)

    def fill_cost(self) -> np.ndarray:
        """The same for each background fill (its reads' share of the records)."""
        return self._cost_of(np.array([f[2] for f in self.fills], dtype=np.float64))

    def _cost_of(self, reads: np.ndarray) -> np.ndarray:
        if self.w.per_file:                     # a file of its own has no neighbours
            return np.ones(reads.shape)
        return self.w.system.pfs_record_cost(reads / self.w.plan.num_samples)

    def cpu_floor_s(self) -> "np.ndarray | float":
        """The least time a delivery takes on a node of ``System.cpus`` cores: its
        batch's CPU seconds over the cores, however many threads share them (0 when
        the system gives every thread a core)."""
        cpus = self.w.system.cpus
        return 0.0 if cpus is None else self.cpu_s() / cpus

    def delivery_s(self, pfs_s: np.ndarray, floor: "np.ndarray | float"
                   ) -> tuple[np.ndarray, "np.ndarray | float"]:
        """``[N, S]``: each delivery's time, its threads' PFS seconds ``pfs_s``, tier and
        peer reads and writes over the threads, at least the node's CPU ``floor``.  On
        a node of ``System.cpus`` cores the threads queue for them: each batch's
        preprocessing is CPU on the shared cores, the rest of its span the thread's
        own, and the training process's CPU (hand-back, its own reads' preprocessing)
        takes its share of the cores (:func:`._cores.delivery_s`).  Also the mean
        number of threads at the cores (0 without ``cpus``)."""
        sysm = self.w.system
        span = pfs_s + self.other_s + self.write_mb * self.wcoef
        if sysm.cpus is None:
            return np.maximum(span / self.threads, floor), 0.0
        prep = self.write_mb / sysm.preprocess_MBps              # CPU-seconds, one core
        own = np.maximum(span - prep / sysm.core_share, 0.0)
        each, busy = cores.delivery_s(own, prep, self.cpu_s() - prep, self.threads,
                                      sysm.cpus)
        return np.maximum(each, floor), busy

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
        own_write = self.sync_mb * sysm.write_s_per_MB(self.threads)
        floor = self.cpu_floor_s()
        cost = self.record_cost()
        gamma = np.full(self.pfs_mb.shape, float(w.n))
        for _ in range(40):
            coef = sysm.pfs_s_per_MB(gamma) * cost
            pfs_s = self.pfs_mb * coef + self.pfs_n * w.open_s
            sync_s = self.sync_mb * coef + self.sync_n * w.open_s
            read, busy = self.delivery_s(pfs_s, floor)
            sync_write = own_write + self.handback_s(busy)
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
        own_write = self.sync_mb * sysm.write_s_per_MB(self.threads)
        floor = self.cpu_floor_s()
        own_cap = sysm.pfs_client_MBps
        cost, fcost = self.record_cost(), self.fill_cost()
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
        fluid: Optional[Fluid] = None
        pfs_s = sync_s = np.zeros(self.pfs_mb.shape)
        last, damp = np.inf, 0.0
        for _ in range(80):
            pfs_s = self.pfs_mb * cost / rate + self.pfs_n * w.open_s
            sync_s = self.sync_mb * cost / srate + self.sync_n * w.open_s
            read, busy = self.delivery_s(pfs_s, floor)
            sync_write = own_write + self.handback_s(busy)
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
            fpfs = fmb * fcost / frate + fn * w.open_s         # a fill's thread-seconds
            fend = (fpfs + fmb * fwr) / np.maximum(fthr, 1.0)
            fg = fthr * np.divide(fpfs, fpfs + fmb * fwr, out=np.zeros_like(fpfs),
                                  where=fpfs > 0)
            fluid = Fluid(np.concatenate([d0.ravel(), s0.ravel(), np.zeros(len(fend))]),
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
            secs = np.concatenate([(self.pfs_mb * cost / rate).ravel(),
                                   (self.sync_mb * cost / srate).ravel(), fmb * fcost / frate])
            diff = np.concatenate([(self.pfs_mb * cost / new).ravel(),
                                   (self.sync_mb * cost / snew).ravel(),
                                   fmb * fcost / fnew]) - secs
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
        self.fill_MBps = frate / fcost
        fpfs = fmb * fcost / frate + fn * w.open_s
        fend = (fpfs + fmb * fwr) / np.maximum(fthr, 1.0)
        upto = np.minimum(fend, tl.total_s)
        part = np.divide(upto, fend, out=np.ones_like(upto), where=fend > 0)
        if fluid is None:                            # pfs_readers = "all": even speed
            got = fmb * part
        else:
            fg = fthr * np.divide(fpfs, fpfs + fmb * fwr, out=np.zeros_like(fpfs),
                                  where=fpfs > 0)
            got = fg * upto * fluid.mean_rate(np.zeros(len(fend)), upto) / fcost
        self.fill_read = (got, fn * part)
        self.gamma = gseen
        return tl, pfs_s + sync_s * self.threads

    def finish(self, staging_bytes: Optional[int] = None) -> dict[str, Any]:
        w = self.w
        tl, pfs_s = self.solve(staging_bytes)
        self.timeline = tl
        src_s = self.src_s.copy()
        src_s[F_PFS] = pfs_s.sum() / self.threads
        res = report(w, tl, by_source={k: float(v) / w.n for k, v in zip(SOURCES, src_s)},
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
        largest need, and the run at least its whole PFS bytes at the top rate
        (background fills belong to no epoch: they read while the epochs run);
        ``au_bound`` is the compute over the larger of those, and ``binding`` the
        resource that adds most beyond compute."""
        w, sysm = self.w, self.w.system
        # outside the steps' deliveries: set-up phases (before epoch 0's first step),
        # and what background fills read while the epochs run
        fill_mb = fill_n = 0.0
        if self.fill_read is not None:                 # the conserving model's account
            fill_mb, fill_n = float(self.fill_read[0].sum()), float(self.fill_read[1].sum())
        elif self.fills:                               # thesis: a fill's bytes even in time
            part = np.minimum(1.0, tl.total_s / np.maximum([f[5] for f in self.fills], 1e-12))
            fill_mb = float((np.array([f[1] for f in self.fills]) * part).sum())
            fill_n = float((np.array([f[2] for f in self.fills]) * part).sum())
        top = sysm.pfs_top_MBps
        # per epoch: what each resource needs at least (set-up in epoch 0)
        e_, st = w.plan.epochs, w.steps
        per = lambda a: a.reshape(w.n, e_, st).sum(axis=2)       # noqa: E731  [N, E]

        def worker(a: np.ndarray) -> np.ndarray:
            """``[E]``: a worker's own resource by epoch, of the worker that needs the
            most over the run (the largest of each epoch, summed, would pass what any
            one worker needs when the largest is a different worker's epoch by epoch)."""
            by = per(a)
            return by[int(by.sum(axis=1).argmax())]
        pfs_e = per(self.pfs_mb + self.sync_mb).sum(axis=0)
        n_e = per(self.pfs_n + self.sync_n).sum(axis=0)
        pfs_e[0] += self.extra_pfs_mb
        n_e[0] += self.extra_pfs_n
        pfs_mb = float(pfs_e.sum()) + fill_mb
        comp_e = w.step_compute_s().reshape(e_, st).sum(axis=1)
        prep_e = worker(self.write_mb) * self.wcoef / self.threads
        prep_e[0] += self.setup_write_s
        each = {"compute": comp_e, "PFS bandwidth": pfs_e / top,
                "PFS requests": n_e * w.open_s / (w.n * self.threads),
                "network link": worker(self.peer_mb) / sysm.network_MBps,
                "tier and peer reads": worker(self.other_s) / self.threads,
                "preprocessing": prep_e}
        if sysm.handback_MBps is not None:     # the training process's chain: in series
            each["hand-back"] = comp_e + worker(self.handback_s())      # the core alone
        if sysm.cpus is not None:
            each["node CPU"] = worker(self.cpu_s()) / sysm.cpus
        names = list(each)
        table = np.stack([each[k] for k in names])               # [resources, E]
        worst = table.max(axis=0)
        over = {k: float(np.where(table.argmax(axis=0) == j, worst - comp_e, 0.0).sum())
                for j, k in enumerate(names)}
        binding = max(over, key=lambda k: over[k]) if max(over.values()) > 0 else "compute"
        bound = float(worst.sum())
        need = {k: float(v.sum()) for k, v in each.items()}
        need["PFS bandwidth"] = pfs_mb / top
        need["PFS requests"] += fill_n * w.open_s / (w.n * self.threads)
        whole = max(need["PFS bandwidth"], need["PFS requests"])
        if whole > bound:              # the fills' bytes: the run as a whole is PFS-bound
            bound = whole
            binding = max(("PFS bandwidth", "PFS requests"), key=lambda k: need[k])
        j = names.index(binding)
        return {"pfs_MB": pfs_mb, "pfs_MBps_mean": pfs_mb / tl.total_s if tl.total_s else 0.0,
                "pfs_MBps_max": top, "node_cpus": sysm.cpus,
                "need_s": need,
                "binding": binding, "au_bound": tl.compute_s / bound if bound else 1.0,
                # epochs in which the binding resource needs longer than compute
                "binding_epochs": int(((table.argmax(axis=0) == j) & (worst > comp_e)).sum())}


def report(w: Workload, tl: Timeline, *, by_source: dict, fetches: dict) -> dict[str, Any]:
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


def failed(reason: str) -> dict[str, Any]:
    return {"total_s": None, "stall_s": None, "compute_s": None, "setup_s": None,
            "by_source": {}, "fetches": {}, "pfs_reads": None,
            "accelerator_utilization": None, "failed": reason}


def prefetching(w: Workload) -> Run:
    """A run with p_0 prefetch threads on every worker."""
    return Run(w, w.system.staging_threads)
