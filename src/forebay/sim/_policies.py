"""I/O policies simulated over a run's real AccessPlan (NoPFS §6), each reduced to: for
every worker and step, which samples it reads and where each one comes from, plus
any set-up phase.  The timeline (:mod:`._engine`) turns that into time.

forebay's own policies call the runtime's code: ``forebay-clairvoyant`` takes its
owners, tiers and extra copies from :func:`forebay.store._placement.compute_placement`
and decides peer-or-PFS with the same per-byte comparison as the loader's FetchModel;
``forebay-preload`` stripes the dataset with the store's
:func:`~forebay.store._distributed.chunk_members`.
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
    """Per-worker, per-step delivery/compute/bytes and per-source fetch accounting."""

    def __init__(self, w: Workload, threads: int, readers: int) -> None:
        sysm, self.w, self.threads = w.system, w, threads
        s = w.steps * w.plan.epochs
        self.read = np.zeros((w.n, s))
        self.nbytes = np.zeros((w.n, s))
        ssd = sysm.local_s_per_MB("ssd") if sysm.ssd_read_MBps else np.inf
        pssd = sysm.peer_s_per_MB("ssd") if sysm.ssd_read_MBps else np.inf
        self.coef = np.array([sysm.pfs_s_per_MB(readers), sysm.local_s_per_MB("ram"), ssd,
                              sysm.peer_s_per_MB("ram"), pssd])
        self.wcoef = sysm.write_s_per_MB(threads)
        self.src_s = np.zeros(len(SOURCES))
        self.src_n = np.zeros(len(SOURCES), dtype=np.int64)
        self.setup_s = 0.0

    def peer_or_pfs(self, peer_src: np.ndarray) -> np.ndarray:
        """The faster of a peer's copy and the file system, per sample (NoPFS §4)."""
        return np.where(self.coef[peer_src] < self.coef[F_PFS], peer_src, F_PFS)

    def add(self, rank: int, epoch: int, ids: np.ndarray, src: np.ndarray) -> None:
        """Worker ``rank`` reads ``ids[h, :]`` at step h of ``epoch`` from ``src``."""
        w = self.w
        sl = slice(epoch * w.steps, (epoch + 1) * w.steps)
        mb = w.mb[ids]
        fetch = mb * self.coef[src] + np.where(src == F_PFS, w.open_s, 0.0)
        self.read[rank, sl] = (fetch + mb * self.wcoef).sum(axis=1) / self.threads
        self.nbytes[rank, sl] = w.sizes[ids].sum(axis=1)
        self.src_s += np.bincount(src.ravel(), fetch.ravel(), len(SOURCES)) / self.threads
        self.src_n += np.bincount(src.ravel(), minlength=len(SOURCES))

    def finish(self, staging_bytes: Optional[int] = None) -> dict[str, Any]:
        w = self.w
        cap = w.system.staging_bytes if staging_bytes is None else staging_bytes
        tl = timeline(self.read, w.step_compute_s()[None, :], self.nbytes, cap, self.setup_s)
        return _report(w, tl, by_source={k: float(v) / w.n for k, v in
                                         zip(SOURCES, self.src_s)},
                       fetches={k: int(v) for k, v in zip(SOURCES, self.src_n)})


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
            "steady_epoch_s": float(np.mean(epoch_s[1:])) if len(epoch_s) > 1 else None,
            # DLIO's accelerator utilisation: compute over the whole run
            "accelerator_utilization": tl.compute_s / tl.total_s if tl.total_s else None,
            "failed": None}


def _failed(reason: str) -> dict[str, Any]:
    return {"total_s": None, "stall_s": None, "compute_s": None, "setup_s": None,
            "by_source": {}, "fetches": {}, "pfs_reads": None,
            "accelerator_utilization": None, "failed": reason}


def _prefetching(w: Workload) -> _Run:
    """A run with p_0 prefetch threads on every worker, all of which may read the PFS."""
    p0 = w.system.staging_threads
    return _Run(w, p0, w.n * p0)


def _local(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_RAM, F_SSD)


def _peer(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_PEER_RAM, F_PEER_SSD)


# -- the policies -------------------------------------------------------------------

def perfect(w: Workload) -> dict[str, Any]:
    """No stalls: compute only (the lower bound)."""
    comp = w.step_compute_s()[None, :]
    tl = timeline(np.zeros_like(comp), comp, np.zeros_like(comp), 1 << 62)
    return _report(w, tl, by_source={k: 0.0 for k in SOURCES}, fetches={k: 0 for k in SOURCES})


def naive(w: Workload) -> dict[str, Any]:
    """Every sample from the PFS when needed: one reader per worker, no prefetching."""
    run = _Run(w, 1, w.n)
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


def deepio(w: Workload) -> dict[str, Any]:
    """DeepIO, ordered mode: worker k % N caches sample k in RAM (a static partition,
    in id order, as far as its RAM allows) while epoch 0 reads everything from the
    PFS; later epochs read cached samples from their worker's memory (RDMA for
    peers) and the rest from the PFS.  Access frequency plays no part."""
    run = _prefetching(w)
    f = w.plan.num_samples
    owner = np.arange(f) % w.n
    tier = np.full(f, NONE, dtype=np.int8)
    for r in range(w.n):
        mine = np.flatnonzero(owner == r)
        tier[mine] = fill_tiers(mine, w.sizes, w.system.ram_bytes, 0)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            if e == 0:
                src = np.full(ids.shape, F_PFS)
            else:
                t, o = tier[ids], owner[ids]
                src = np.where(t == NONE, F_PFS, np.where(o == i, F_RAM, run.peer_or_pfs(
                    np.full(ids.shape, F_PEER_RAM))))
            run.add(i, e, ids, src)
    return run.finish()


def parallel_staging(w: Workload) -> dict[str, Any]:
    """Data sharding: before training each worker copies its contiguous shard from the
    PFS into its RAM, then SSD; every epoch it reads only its own shard, shuffled
    locally (the global access order changes); shard bytes that fit nowhere stay on
    the PFS."""
    from ..store import chunk_members

    run = _prefetching(w)
    sysm = w.system
    bounds, _ = chunk_members(w.sizes, w.n)
    b = w.plan.batch_size
    setup = []
    for i in range(w.n):
        shard = np.arange(bounds[i], bounds[i + 1])
        if len(shard) == 0:
            shard = np.arange(w.plan.num_samples)  # more workers than samples: share
        tier = fill_tiers(shard, w.sizes, sysm.ram_bytes, sysm.ssd_bytes)
        where = np.full(w.plan.num_samples, NONE, dtype=np.int8)
        where[shard] = tier
        mb_ram = w.mb[shard[tier == Tier.RAM]].sum()
        mb_ssd = w.mb[shard[tier == Tier.SSD]].sum()
        setup.append((mb_ram * (run.coef[F_PFS] + sysm.tier_write_s_per_MB("ram"))
                      + mb_ssd * (run.coef[F_PFS] + (sysm.tier_write_s_per_MB("ssd")
                                                   if mb_ssd else 0))
                      + int((tier != NONE).sum()) * w.open_s) / run.threads)
        for e in range(w.plan.epochs):
            order = shard[permutation(len(shard), w.plan.seed + 7919 * (i + 1), e)]
            need = w.steps * b
            ids = np.resize(order, need).reshape(w.steps, b)
            t = where[ids]
            run.add(i, e, ids, np.where(t == NONE, F_PFS, _local(t)))
    run.setup_s = float(max(setup))
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


def _first_reader_tiers(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Each sample cached by the worker that reads it in epoch 0, RAM then SSD, in its
    read order: ``(holder int64[F] or -1, tier int8[F])``."""
    f = w.plan.num_samples
    holder = np.full(f, -1, dtype=np.int64)
    tier = np.full(f, NONE, dtype=np.int8)
    for i in range(w.n):
        s = w.batches(i, 0).reshape(-1)
        _, first = np.unique(s, return_index=True)
        s = s[np.sort(first)]
        s = s[holder[s] < 0]
        t = fill_tiers(s, w.sizes, w.system.ram_bytes, w.system.ssd_bytes)
        keep = t != NONE
        holder[s[keep]] = i
        tier[s[keep]] = t[keep]
    return holder, tier


def locality_aware(w: Workload) -> dict[str, Any]:
    """Yang and Cong's locality-aware loading: epoch 0 reads from the PFS and caches at
    the reader (RAM, then SSD); later epochs keep the global batches but reassign their
    samples so each worker takes the ones it holds (up to its batch size); the rest go
    to the workers with room and come from the holder's memory or the PFS."""
    run = _prefetching(w)
    holder, tier = _first_reader_tiers(w)
    n, b, h = w.n, w.plan.batch_size, w.steps
    for e in range(w.plan.epochs):
        if e == 0:
            for i in range(n):
                ids = w.batches(i, 0)
                run.add(i, 0, ids, np.full(ids.shape, F_PFS))
            continue
        gb = w.plan.global_batches(e)                      # [h, n*b]
        row = np.repeat(np.arange(h), n * b)
        flat = gb.reshape(-1)
        hold = holder[flat]
        key = row * (n + 1) + np.where(hold >= 0, hold, n)
        order = np.argsort(key, kind="stable")
        k_sorted = key[order]
        starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]])
        rank_in = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
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
    nowhere); presence is guessed, so epoch 0 reads from the PFS; later epochs read
    from the own tiers, else the fastest of a peer holding the sample and the PFS."""
    run = _prefetching(w)
    f = w.plan.num_samples

    def held_by(i: int) -> np.ndarray:
        freq = w.plan.frequencies(i)
        first = w.plan.first_access(i)
        cand = np.flatnonzero(freq > 0)
        cand = cand[np.lexsort((cand, first[cand], -freq[cand]))]
        held = np.full(f, NONE, dtype=np.int8)
        held[cand] = fill_tiers(cand, w.sizes, w.system.ram_bytes, w.system.ssd_bytes)
        return held

    # two passes (copies per sample, then each worker's reads): O(F) memory, not O(N F)
    ram_cnt = np.zeros(f, dtype=np.int32)
    ssd_cnt = np.zeros(f, dtype=np.int32)
    for i in range(w.n):
        held = held_by(i)
        ram_cnt += held == Tier.RAM
        ssd_cnt += held == Tier.SSD
    for i in range(w.n):
        held = held_by(i)
        for e in range(w.plan.epochs):
            ids = w.batches(i, e)
            if e == 0:
                run.add(i, e, ids, np.full(ids.shape, F_PFS))
                continue
            mine = held[ids]
            peer_ram = ram_cnt[ids] - (mine == Tier.RAM) > 0
            peer_ssd = ssd_cnt[ids] - (mine == Tier.SSD) > 0
            remote = np.where(peer_ram, run.peer_or_pfs(np.full(ids.shape, F_PEER_RAM)),
                              np.where(peer_ssd, run.peer_or_pfs(np.full(ids.shape, F_PEER_SSD)),
                                       F_PFS))
            run.add(i, e, ids, np.where(mine != NONE, _local(mine), remote))
    return run.finish()


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
    chunk_s = chunk_mb * (sysm.pfs_s_per_MB(w.n * run.threads)
                          + sysm.tier_write_s_per_MB("ram")) + np.diff(bounds) * w.open_s
    run.setup_s = float(chunk_s.max() / run.threads)
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
    "parallel-staging": parallel_staging, "lbann": lbann, "locality-aware": locality_aware,
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
