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

from typing import Any, Callable, Optional

import numpy as np

from ..plan import permutation
from ..store import NONE, compute_coverage, compute_placement, fill_tiers
from ..vocab import Tier
from ._engine import F_PEER_RAM, F_PEER_SSD, F_PFS, F_RAM, F_SSD, SOURCES, Timeline, timeline
from ._run import Run, Workload, failed, prefetching, report
from .._intervals import positions_in_runs
from ..errors import InvalidArgumentError

__all__ = ["POLICIES", "Workload", "simulate_policy"]


def _local(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_RAM, F_SSD)


def _peer(tier: np.ndarray) -> np.ndarray:
    return np.where(tier == Tier.RAM, F_PEER_RAM, F_PEER_SSD)


# -- the policies -------------------------------------------------------------------

def perfect(w: Workload) -> dict[str, Any]:
    """No stalls: compute only (the lower bound)."""
    tl = _compute_only(w)
    return report(w, tl, by_source={k: 0.0 for k in SOURCES}, fetches={k: 0 for k in SOURCES})


def _compute_only(w: Workload) -> Timeline:
    comp = w.step_compute_s()[None, :]
    return timeline(np.zeros_like(comp), comp, np.zeros_like(comp), 1 << 62)


def naive(w: Workload) -> dict[str, Any]:
    """Every sample from the PFS when needed: one reader per worker, no prefetching."""
    run = Run(w, 1)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            run.add(i, e, ids, np.full(ids.shape, F_PFS))
    return run.finish(staging_bytes=0)


def staging(w: Workload) -> dict[str, Any]:
    """Prefetch from the PFS in access order into the staging buffer, drop after use
    (double buffering, tf.data)."""
    run = prefetching(w)
    for e in range(w.plan.epochs):
        for i in range(w.n):
            ids = w.batches(i, e)
            run.add(i, e, ids, np.full(ids.shape, F_PFS))
    return run.finish()


def _setup_s(w: Workload, run: Run, pfs_mb: np.ndarray, pfs_n: np.ndarray, threads: int,
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
                write_s_per_MB: float, stream: bool = False) -> np.ndarray:
    """When each worker is done loading ``mb[i]`` MB (``n[i]`` reads) from the PFS with
    ``threads`` threads (fetch, then write), every worker starting at 0.  Conserving:
    while k workers load, each thread reads at f(k * threads) (at most b_fs over the
    worker's threads), and a worker that is done leaves the PFS to the others
    (processor sharing, solved in order of size).  Thesis: every read at t(N)/N.
    ``stream``: the loads are large sequential reads (the PFS's stream table)."""
    sysm = w.system
    if not sysm.conserving:
        return (mb * (sysm.pfs_setup_s_per_MB(w.n, threads, stream) + write_s_per_MB)
                + n * w.open_s) / threads
    order = np.argsort(mb, kind="stable")
    done = np.zeros(len(mb))
    t, prev = 0.0, 0.0
    for j, left in enumerate(mb[order].tolist()):
        k = len(order) - j
        speed = min(float(sysm.pfs_thread_MBps(k * threads, stream)),
                    sysm.pfs_client_MBps / threads)
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
    run = prefetching(w)
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

    run = prefetching(w)
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
        return failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB)")
    run = prefetching(w)
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
        return failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB)")
    run = prefetching(w)
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
    run = prefetching(w)
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
        run = prefetching(w)
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
    run = prefetching(w)
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
        return failed(f"the dataset ({w.total_bytes / 1e9:.1f} GB) exceeds the workers' "
                       f"aggregate RAM ({w.n * sysm.ram_bytes / 1e9:.1f} GB): "
                       f"use forebay-clairvoyant")
    run = prefetching(w)
    bounds, member = chunk_members(w.sizes, width)
    chunk_mb = np.diff(np.r_[0.0, np.cumsum(w.mb)][bounds])
    # every worker loads its chunk at once: in a packed dataset one contiguous range
    # read in large requests (the stream table), in files one file per sample
    run.setup_s = float(_load_times(w, chunk_mb, np.diff(bounds).astype(float), run.threads,
                                    sysm.tier_write_s_per_MB("ram"),
                                    stream=not w.per_file).max())
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
