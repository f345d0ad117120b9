"""Clairvoyant caching (NoPFS), with exact presence instead of guesses.

Every rank computes the same :class:`~forebay.store.Placement` from the access plan and
the ranks' RAM capacities.  Each rank's RAM tier is an MPI window filled by a
background thread in the placement's fill order (its coverage copies by first need,
then the samples it reads most often), straight from the packed dataset (the parallel
file system).  After each chunk the thread makes its stores visible (``MPI_Win_sync``)
and then atomically publishes an 8-byte fill counter at the start of its window.  A
reader knows a sample at position p of its owner's fill order is fully there iff the
counter is > p: it reads the counter atomically (``MPI_Fetch_and_op`` with
``MPI_NO_OP``), keeps the value, and asks again only when it no longer suffices.
Samples not (yet) cached anywhere are read from the dataset itself.

Under torch.distributed (no MPI) the ranks of one node share one
:class:`~forebay.comm.NodeSegment` laid out the same way: the counter is a plain
8-byte store after a full memory barrier (:func:`forebay.comm.fence`), read with a
barrier after it.  Across nodes (transport ``exchange``, also forcible under MPI) each
batch is a collective: every rank knows every rank's request (from the access plan,
:meth:`ClairvoyantStore.get_step`), so for each sample one rank asks another for, the
owner says whether it holds it now and the requester whether it still wants it (its
own tiers may hold an extra copy): one byte each way, one small all-to-all; then the
owners send the records both said yes to (one all-to-all); the receiver reads the rest
from the dataset files, so nothing waits on a fill.

This file holds the store's public face (construction, reads, statistics, close); its
set-up and tiers, fill threads and presence, and exchange transport are in
``_clair_setup.py``, ``_clair_fill.py`` and ``_clair_exchange.py``, the state they share
in ``_clair_state.py``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .._liveness import join as join_liveness
from ..dataset import PackedDataset, PinnedPages, SampleBatch, SampleViews, open_dataset
from ..dataset import IndexLayout, assemble_batch, assemble_views
from ..comm import NodeSegment
from ..world import abort_on_uncaught, resolve_comm
from ..errors import InvalidArgumentError
from ..plan import AccessPlan
from ._agreement import agree, check_agreement
from ._base import Lender, SampleStore, StoreError, WarmUp, warm_enabled
from ._placement import RAM, compute_placement
from ._windows import free_window, target_progress
from ._clair_setup import ClairSetup
from ._clair_fill import ClairFill
from ._clair_exchange import ClairExchange
from ._clair_state import _FILES, _FILE_TAGS, _HERE, _PEER, tier_nbytes
from .. import trace as _trace
from . import _tracing as _hooks

__all__ = ["ClairvoyantStore", "tier_nbytes"]


class ClairvoyantStore(ClairSetup, ClairFill, ClairExchange, SampleStore):
    """A RAM tier per rank, filled ahead of need in the order the access plan dictates.

    Args:
        dataset: a :class:`~forebay.dataset.PackedDataset` or its path (the PFS tier).
        plan: the run's :class:`~forebay.AccessPlan` (world size = the communicator's).
        comm: mpi4py communicator (default: :func:`forebay.world.resolve_comm`;
            :data:`forebay.world.LOCAL`: this rank alone).
        ram_bytes: this rank's RAM tier capacity (ranks may differ; exchanged at setup).
        ssd_dir, ssd_bytes: a node-local directory and the capacity of this rank's SSD
            tier (a file there, removed at close).  If the directory is missing, not
            writable or short of space, a warning is given and the tier is skipped.
            Peers on the same node read it too (shared memory transport); across
            nodes, samples held only in a peer's SSD tier are read from the files.
        transport: ``"auto"``, ``"shm"``, ``"rma"`` or ``"exchange"``, as for the
            DistributedStore (under torch.distributed: ``"shm"`` when every rank is on
            one node, else ``"exchange"``, whose ``get_many`` is a collective every
            rank calls in step, as the loader does).
        fill: start the background fill threads (False: nothing is cached until
            :meth:`fill_now`; for tests and benchmarks).
        ram_threads, ssd_threads: fill threads per tier (NoPFS's p_1, p_2; default 1
            each).  Threads take chunks of the tier's fill order in turn; the published
            fill counter only ever covers a complete prefix of the order.
        peer_wait: seconds the fill may wait for an owner to publish a sample this rank
            also caches, before reading it from the PFS instead.
        on_pfs_read: called after every read from the dataset files with (bytes,
            samples, seconds): an instrumentation hook (tracing, PFS emulation).
        warm_files: on one node (transports ``shm`` and local), also read the
            dataset's extents that the node's tiers will hold (90% or more of their
            bytes) into the page cache with large sequential reads, in a background
            thread per rank, when they fit in the node's available memory beside the
            tiers: the fill's and the reader's per-sample reads are then memory copies
            instead of one small request each (:meth:`PackedDataset.warm`).  ``"auto"``
            (default): when the records are small (``PackedDataset.small_records``);
            larger ones read one request each already move most of a device's
            bandwidth, and the warm-up's copies would only take CPU from the fill.
            Off with ``on_pfs_read`` (an emulated file system charges every read).
        ram_tier: where the RAM tier keeps its samples.  ``"copy"``: a buffer of its
            own (an MPI window or the node's shared segment), each sample copied in
            from the files once; what peers on other nodes read by RMA.  ``"pages"``:
            the files' own pages in the page cache, locked there (maps of the shards
            of its own, locked on fault, :class:`~forebay.dataset.PinnedPages`): the
            fill maps each sample in ahead of need, a batch reads it through the
            dataset's maps as direct reads do, so nothing is copied twice and the node
            holds each byte once (not over ``rma``; over the ``exchange`` an owner
            sends from its files' pages).  ``"auto"`` (default): ``"pages"`` where it
            can be (not over ``rma``; the dataset on a local file system, not one whose
            client may drop cached pages itself; no ``on_pfs_read``; this process may
            lock the shards holding its RAM samples: ``RLIMIT_MEMLOCK``,
            :func:`~forebay.dataset.can_lock`), else ``"copy"``.
            Every rank makes the same choice (docs/store.md).

    Setup and :meth:`close` are collective.  ``get_many`` is bit-exact to the dataset's.
    """

    capabilities = frozenset({"shared", "background_fill"})
    def __init__(self, dataset: "PackedDataset | str | os.PathLike[str]", plan: AccessPlan,
                 comm: Any = None, *, ram_bytes: int, transport: str = "auto",
                 ssd_dir: "str | os.PathLike[str] | None" = None, ssd_bytes: int = 0,
                 fill: bool = True, peer_wait: float = 1.0,
                 on_pfs_read: Optional[Callable[[int, int, float], None]] = None,
                 model: Any = None, ram_threads: int = 1, ssd_threads: int = 1,
                 warm_files: "bool | str" = "auto", ram_tier: str = "auto",
                 node_cache: Any = None,
                 grown_from: "Optional[ClairvoyantStore]" = None) -> None:
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)   # a rank that raises ends the job, not a hang
        join_liveness(self.comm)       # a peer gone mid-wait ends the job, not a hang
        self.ds = dataset if isinstance(dataset, PackedDataset) else open_dataset(dataset)
        self.rank = self.comm.Get_rank() if self.comm is not None else 0
        self.world = self.comm.Get_size() if self.comm is not None else 1
        self.plan = plan
        self._win: Any = None        # the MPI window (None: one rank, no MPI)
        self._node_seg: Optional[NodeSegment] = None   # shm under torch.distributed
        self._segment: Any = None    # the group's shared segment (shm transport)
        self._closed = False
        self._lender = Lender()      # the memory get_views lends
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fill_error: Optional[BaseException] = None
        self._warm: Optional[WarmUp] = None
        self._lock = threading.Lock()
        #: notified whenever positions of this rank's tiers become done (the fill
        #: threads and the reader wait on each other's writes through it, not by polling)
        self._done_cv = threading.Condition(self._lock)
        #: the furthest fill position a batch has needed so far: the fill threads keep
        #: ahead of it instead of working on what the reader is loading itself
        self._need_front = -1
        self._publish_lock = threading.Lock()
        self._cursor: dict[str, int] = {}
        self._stats = {"local": 0, "peer": 0, "pfs": 0}
        #: the node-local cache the dataset's records are read through (issue U: what
        #: one job read from the shared file system, the next reads from the node)
        self.cache = node_cache
        ram_tier, warm_files = self._with_cache(ram_tier, warm_files)
        self.pfs_reads = 0
        self.pfs_bytes = 0
        self._fill_from_peers = 0
        self._exchange_sent = 0
        #: exchange: collective rounds run, and whether they ended (every rank's tiers
        #: hold all it will read: no round is needed again, see _self_sufficient)
        self._exchange_rounds = 0
        self._exchange_ended = False
        self._covers_plan: Optional[bool] = None
        self._pin_warned = False
        self.peer_wait = peer_wait
        self.on_pfs_read = on_pfs_read
        # NoPFS's performance model (a FetchModel): when it predicts the file system is
        # faster than a peer's memory, present peer samples are read from the dataset
        self.model = model
        self._model_pfs = 0
        # both predictions scale with the bytes, so for a given world size the model's
        # choice is one decision, taken here rather than per batch
        self._peer_via_pfs = model is not None and model.prefer_pfs(1.0, self.world,
                                                                    self.world)
        self._check_grown_from(grown_from)
        check_agreement(self.comm, "ClairvoyantStore's arguments", self.ds, {
            "plan": (f"{plan.num_samples} samples, world {plan.world_size}, batch "
                     f"{plan.batch_size}, {plan.epochs} epochs, seed {plan.seed}, "
                     f"drop_last {plan.drop_last}, shuffle {plan.shuffle}"),
            "transport": transport, "verify_on_read": self.ds.verify_on_read,
            "ram_tier": ram_tier,
            "grown_from": None if grown_from is None else len(grown_from.ds)})
        problems = []
        if plan.world_size != self.world:
            problems.append(f"the plan is for {plan.world_size} ranks, the world has {self.world}")
        if plan.num_samples != len(self.ds):
            problems.append(f"the plan covers {plan.num_samples} samples, {self.ds.path} has "
                            f"{len(self.ds)}")
        if ram_bytes < 0:
            problems.append(f"ram_bytes must be >= 0, got {ram_bytes}")
        for name, v in (("ram_threads", ram_threads), ("ssd_threads", ssd_threads)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        agree(self.comm, "; ".join(problems) or None)
        ssd_bytes = self._check_ssd(ssd_dir, int(ssd_bytes))
        self.ssd_dir = Path(ssd_dir) if ssd_bytes and ssd_dir is not None else None
        if self.comm is not None:
            rams = np.array(self.comm.allgather(int(ram_bytes)), dtype=np.int64)
            ssds = np.array(self.comm.allgather(ssd_bytes), dtype=np.int64)
        else:
            rams = np.array([int(ram_bytes)], dtype=np.int64)
            ssds = np.array([ssd_bytes], dtype=np.int64)
        self._sizes = tier_nbytes(self.ds)
        self._choose_transport(transport)
        self._pages: Optional[PinnedPages] = None
        # on one node every rank reads every tier as its own memory: an extra copy of a
        # sample another rank of the node holds would only double memory and copies
        shared = np.arange(self.world) if self.transport == "shm" else None
        self.placement = compute_placement(plan, self._sizes, rams, ssds, self.rank,
                                           shares_memory_with=shared)
        self._layout_offsets()
        self._choose_ram_tier(ram_tier, on_pfs_read)
        mine = (len(self._ram_order), self.ssd_nbytes, str(self.ssd_dir or ""),
                len(self.fill_order))
        every = self.comm.allgather(mine) if self.comm is not None else [mine]
        self._R_all = np.array([r for r, _, _, _ in every], dtype=np.int64)
        self._ssd_all = np.array([b for _, b, _, _ in every], dtype=np.int64)
        self._peer_dirs = [Path(d) for _, _, d, _ in every]
        #: each rank's fill positions (its counter's value when its tiers are full)
        self._fill_all = np.array([n for _, _, _, n in every], dtype=np.int64)
        self._steady: Optional[np.ndarray] = None
        self._allocate()
        #: samples copied from the store this one grew from (not read again)
        self.kept = self._keep_from(grown_from)
        #: rma across nodes: peers' gets from this rank complete while it is busy
        #: outside MPI (see TargetProgress)
        self._progress = target_progress(
            self.comm, self.transport == "rma" and self._node_ranks < self.world)
        # a tier position is written once: views of it never change (not the exchange's
        # records, which arrive in a fresh buffer every batch)
        self.capabilities = frozenset({"shared", "background_fill"} |
                                      ({"views"} if self.transport != "exchange" else set()))
        # (not under on_pfs_read: an emulated file system charges every sample read)
        if fill and on_pfs_read is None and warm_enabled(warm_files, self.ds) and \
                self.transport in ("local", "shm"):
            self._start_warm()
        if fill:
            n = len(self.fill_order)
            for tier, lo, hi, k in (("ram", 0, self._R, ram_threads),
                                    ("ssd", self._R, n, ssd_threads)):
                self._cursor[tier] = lo
                for j in range(int(k) if hi > lo else 0):
                    t = threading.Thread(target=self._fill_loop, args=(tier, hi),
                                         name=f"forebay-fill-{tier}-{j}", daemon=True)
                    self._threads.append(t)
            for t in self._threads:
                t.start()

    def get_step(self, requests: "Sequence[np.ndarray]", *, alloc=None) -> SampleBatch:
        """This rank's batch when every rank knows what each rank asks for in this call
        (``requests[r]``: rank r's ids, as from the access plan): the ``exchange``
        transport then skips its all-gather of the ids.  Other transports:
        ``get_many(requests[rank])``."""
        if len(requests) != self.world:
            raise InvalidArgumentError(f"get_step needs one request per rank ({self.world}), "
                                       f"got {len(requests)}")
        if self.transport != "exchange":
            return self.get_many(requests[self.rank], alloc=alloc)
        reqs = [self.ds.normalize_ids(r) for r in requests]
        return self.get_many(reqs[self.rank], alloc=alloc, requests=reqs)

    def get_many(self, ids: "Sequence[int] | np.ndarray", *, alloc=None,
                 requests: "Optional[list[np.ndarray]]" = None) -> SampleBatch:
        """Samples ``ids``: from this rank's tier, a peer's, or the dataset, whichever
        holds them now; bit-exact to the dataset's ``get_many``.  With the ``exchange``
        transport a collective every rank calls in step."""
        return self._read(ids, requests, False,
                          lambda got, rows, parts, timings: assemble_batch(
                              got, rows, self.ds.schema, self.ds.layout, parts, alloc,
                              timings=timings))

    def get_views(self, ids: "Sequence[int] | np.ndarray") -> SampleViews:
        """Samples ``ids`` as read-only views of where they are (no copy): a tier
        position is written once and never reused, the files do not change, and a
        peer's records fetched by RMA land in a buffer the views then own.  The tiers
        stay mapped while a view of them lives, after :meth:`close` too.  With the
        ``exchange`` transport: views of a copy (``get_many``)."""
        if self.transport == "exchange":
            return super().get_views(ids)
        return self._read(ids, None, True,
                          lambda got, rows, parts, timings: assemble_views(
                              got, rows, self.ds.schema, self.ds.layout, parts, timings))

    def _read(self, ids: "Sequence[int] | np.ndarray",
              requests: "Optional[list[np.ndarray]]", lend: bool, build: Callable) -> Any:
        """A batch: ``build(ids, rows, parts, timings)`` over where the samples are now
        (``_sources``), counted and traced."""
        got, rows, parts, src, pin_after = self._sources(ids, requests, lend)
        tracer = _trace.active()
        timings: Optional[list[Any]] = [] if tracer is not None else None
        t0 = time.perf_counter()
        try:
            out = build(got, rows, parts, timings)
        finally:
            if pin_after is not None:
                # just read (their pages are cached now): pinning them maps them into the
                # tier's locked maps without a read, then they are the tier's
                pids, ppos, prows = pin_after
                self._load(pids, ppos, 0.0, rows=prows, mapped=True)
        self._account(got, rows, parts, src, timings, t0)
        return out

    def _lent(self, key: str) -> np.ndarray:
        """This rank's RAM tier, SSD tier or the node's segment, read-only."""
        if key == "ram":
            return self._lender.lend(key, self._buf, (self._win, self._node_seg))
        if key == "ssd":
            return self._lender.lend(key, self._ssd)
        return self._lender.lend(key, self._segment, (self._win, self._node_seg))

    def _sources(self, ids: "Sequence[int] | np.ndarray",
                 requests: "Optional[list[np.ndarray]]", lend: bool
                 ) -> "tuple[np.ndarray, np.ndarray, list[Any], tuple, Optional[tuple]]":
        """Where each of ``ids`` is read from now (assemble_batch parts: this rank's
        tiers, peers', the files; ``lend``: read-only sources for views).  Returns
        (ids, rows, parts, (tags, local, peer, pfs, seconds fetching from peers), the
        (ids, positions) of this rank's page-cache tier that the batch claimed and
        reads first, to pin once it is built, or None)."""
        if self._closed:
            raise StoreError("the store is closed")
        self._raise_fill_error()
        ids = self.ds.normalize_ids(ids)
        rows = self.ds.rows(ids)
        paged = self._paged(ids)
        if self._steady is None:
            self._check_steady()
        exchanged: Optional[list] = None
        t_exchange = 0.0
        pin_after: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        ahead: Optional[np.ndarray] = None      # claimed by this batch, read, pinned after
        if self._steady is not None:    # every tier full: where a sample is is fixed
            where = self._steady[ids]
            mine = local = where == _HERE
            peer = where == _PEER
        else:
            lpos = self.local_pos[ids]
            mine = lpos >= 0
            local = mine & ((lpos < self._filled) | self._done_at(lpos))
            # a sample of this rank's tier that is needed before the fill got to it: read
            # it now and keep it (the fill will skip it), so the PFS serves it only once
            need = np.flatnonzero(mine & ~local)
            if len(need):
                front = int(lpos[need].max())
                if front > self._need_front:
                    self._need_front = front
                u, first, inv = np.unique(lpos[need], return_index=True,
                                          return_inverse=True)
                got = self._claim(u)
                # a copying tier is written before the batch reads it; a RAM tier in the
                # page cache is read first, as direct reads read (their reads in flight
                # while the batch copies: pinning them first waited for every read before
                # the first copy, 0.83x direct reads' cold epoch of small records), and
                # pinned after (_read)
                first_pin = (u < self._R) & got if self._pages is not None else \
                    np.zeros(len(u), dtype=bool)
                load = got & ~first_pin
                if load.any():
                    self._load(ids[need[first[load]]], u[load], wait=0.0)
                if first_pin.any():
                    at = need[first[first_pin]]
                    pin_after = (ids[at], u[first_pin], rows[at])
                # being read into the page cache by the fill (the RAM tier in the files'
                # pages): the batch reads the same pages without waiting for the
                # fill's whole chunk (waiting kept a reader on a fast disk in step
                # with the fill, in nearly every batch of a cold epoch); they count as
                # the fill's read.  Being copied into a tier's own memory (the SSD tier,
                # a copying RAM tier): not there yet, wait for it rather than read twice
                paging = ~got & (u < self._R) if self._pages is not None else \
                    np.zeros(len(u), dtype=bool)
                if (~got & ~paging).any():
                    self._wait_done(u[~got & ~paging], timeout=self.peer_wait)
                writing = np.zeros(len(ids), dtype=bool)
                writing[need] = (paging | first_pin)[inv]
                if first_pin.any():
                    ahead = np.zeros(len(ids), dtype=bool)
                    ahead[need] = first_pin[inv]
                local = writing | (mine & ((lpos < self._filled) | self._done_at(lpos)))
            if self.transport == "exchange":
                t0 = time.perf_counter()
                peer, exchanged = self._exchange(ids, ~local, requests)
                t_exchange = time.perf_counter() - t0
            else:
                peer = ~local & self._present(ids)
        if self._peer_via_pfs and peer.any():
            with self._lock:
                self._model_pfs += int(peer.sum())
            peer[:] = False
        pfs = ~local & ~peer
        if paged is not None and self.transport == "exchange":
            # a peer's tier is its node's page cache, not this one's: its samples come
            # over the exchange (or from the files if it did not hold them yet)
            paged = paged & mine
        files = pfs if paged is None else pfs | paged     # read from the files' maps
        parts: list[Any] = []
        tags: list[tuple[str, Optional[str]]] = []  # (source, tier) of each part, for tracing
        if local.any():
            lp = self.local_pos[ids]
            for buf, tier_mask, tier in ((self._buf, lp < self._R, "ram"),
                                         (self._ssd, lp >= self._R, "ssd")):
                m = local & tier_mask & ~files
                if m.any():
                    parts.append((self._lent(tier) if lend else buf, self.local_off[ids][m], m))
                    tags.append(("local", tier))
        t_peer = t_exchange
        if (peer & ~files).any():
            t0 = time.perf_counter()
            peer_parts = exchanged if exchanged is not None else \
                self._peer_parts(ids, rows, peer & ~files, lend)
            t_peer += time.perf_counter() - t0
            parts.extend(peer_parts)
            tags.extend([("peer", None)] * len(peer_parts))
        # the RAM tiers in the page cache (this rank's and its peers', locked through
        # maps of their own) and the samples no tier holds: read through the dataset's
        # maps, as direct reads read them (own samples read through the locked maps
        # instead left the dataset's unmapped, and the first warm epoch faulted on each
        # peer's page there: Ising 0.044 s against direct reads' 0.031 s)
        cold = None if paged is None else ~(local | peer)
        if ahead is not None and cold is not None:
            cold |= ahead           # not in memory yet: asked for (WILLNEED) as the others
        want = files
        traced = _trace.active() is not None
        if want.any():
            fidx = np.flatnonzero(want)
            files_ds = self._files_for(ids[fidx])     # (the node cache's, with one)
            if files_ds.verify_on_read:   # (the files' pages may change under a tier)
                files_ds.check_records(ids[fidx])
            kind = np.where(local[fidx], 0, np.where(peer[fidx], 1, 2))
            # pages a tier locked are in memory: only the others are advised
            for src, rec, sel in files_ds.record_parts(
                    ids[fidx], rows[fidx], populate=lend,
                    advise=None if cold is None else cold[fidx]):
                at, k = fidx[sel], kind[sel]
                if not traced:
                    mask = np.zeros(len(ids), dtype=bool)
                    mask[at] = True
                    parts.append((src, rec, mask))
                    continue
                # traced: one part per shard and source (this rank's tier, a peer's, none)
                for j, tag in enumerate(_FILE_TAGS):
                    m = k == j
                    if m.any():
                        mask = np.zeros(len(ids), dtype=bool)
                        mask[at[m]] = True
                        parts.append((src, rec[m], mask))
                        tags.append(tag)
        return ids, rows, parts, (tags, local, peer, pfs, t_peer), pin_after

    def _check_steady(self) -> None:
        """Once this rank's tiers and every peer's it reads are full, fix where each
        sample is read from (``_steady``: _HERE, _PEER or _FILES per sample): batches
        then skip the presence checks.  Over the exchange, whose batches are a
        collective every rank calls in step, only once it ended (every rank's tiers
        hold all it reads: no peer is read again, a sample outside the plan comes
        from the files)."""
        if (self.transport == "exchange" and not self._exchange_ended) or \
                self._filled < len(self.fill_order):
            return
        p = self.placement
        owner = p.owner.astype(np.int64)
        readable = (owner >= 0) & (owner != self.rank) & (self.transport != "exchange") & \
            ((p.tier == RAM) | (self.transport == "shm"))
        for o in np.unique(owner[readable]).tolist():
            if self._known[o] < self._fill_all[o]:
                self._known[o] = self._peer_counter(o)
                if self._known[o] < self._fill_all[o]:
                    return
        where = np.full(len(owner), _FILES, dtype=np.int8)
        where[readable] = _PEER
        where[self.local_pos >= 0] = _HERE
        self._steady = where

    def _paged(self, ids: np.ndarray) -> Optional[np.ndarray]:
        """Which of ``ids`` some rank's RAM tier holds in the files' pages (None: the
        RAM tiers are copies)."""
        return None if self._pages is None else self._in_pages[ids]

    def _account(self, ids: np.ndarray, rows: np.ndarray, parts: list, src: tuple,
                 timings: Optional[list], t0: float) -> None:
        """Count (and trace) a batch read from ``parts`` (``_sources``' result)."""
        tags, local, peer, pfs, t_peer = src
        n_pfs = int(pfs.sum())
        if n_pfs and self.on_pfs_read is not None:
            self.on_pfs_read(int(rows[pfs, IndexLayout.REC_LEN].sum()), n_pfs,
                             time.perf_counter() - t0)
        tracer = _trace.active()
        if tracer is not None:
            self._trace_fetch(tracer, ids, rows, parts, tags, timings or [], t_peer)
        with self._lock:
            self._stats["local"] += int(local.sum())
            self._stats["peer"] += int(peer.sum())
            self._stats["pfs"] += n_pfs
            self.pfs_reads += n_pfs
            self.pfs_bytes += int(rows[pfs, IndexLayout.REC_LEN].sum())

    def _trace_fetch(self, rec: Any, ids: np.ndarray, rows: np.ndarray, parts: list,
                     tags: list, timings: list, t_peer: float) -> None:
        """One ``data/item`` event per sample with its source, tier and owner; peers'
        parts include the RMA staging time; PFS parts also as file reads."""
        sizes = rows[:, IndexLayout.REC_LEN]
        npeer = sum(1 for s, _ in tags if s == "peer")
        if npeer:
            p = self.placement
            peer_tier = np.where(p.tier[ids] == RAM, _hooks.TIER["ram"], _hooks.TIER["ssd"])
            peer_owner = p.owner[ids]
        tagged = []
        pfs_sel = []
        for (_, _, sel), (source, tier), (t0, t1) in zip(parts, tags, timings):
            owner: Any = self.rank
            if source == "peer":
                tier, owner = peer_tier, peer_owner
                t0 -= t_peer / npeer
            elif source == "pfs":
                owner = -1
                pfs_sel.append((sel, t0, t1))
            tagged.append((sel, t0, t1, source, tier, owner))
        _hooks.record_parts(rec, ids, sizes, tagged)
        if pfs_sel:
            m = pfs_sel[0][0] if len(pfs_sel) == 1 else np.logical_or.reduce(
                [q[0] for q in pfs_sel])
            _hooks.record_pfs(rec, self.ds, ids[m], rows[m], pfs_sel[0][1], pfs_sel[-1][2])

    def stats(self) -> dict[str, Any]:
        """Reads by source since setup: ``fetches_by_source`` (local tier, peer tier,
        PFS), ``pfs_reads``/``pfs_bytes`` (fills included), fill progress,
        ``pfs_by_model`` (peer-held samples read from the PFS because the performance
        model predicted it faster), ``ram_tier`` (``"copy"`` or ``"pages"``),
        ``buffer_bytes`` (the RAM tier's own buffer: none with ``"pages"``),
        ``locked_bytes`` (the pages it locked in the page cache); over the exchange
        ``exchange_sent`` (records this rank sent), ``exchange_rounds`` (collective
        rounds) and ``exchange_ended`` (every rank's tiers hold all its plan reads:
        batches need no collective any more)."""
        with self._lock:
            return {"fetches_by_source": dict(self._stats), "pfs_reads": self.pfs_reads,
                    "pfs_bytes": self.pfs_bytes, "filled": self._filled,
                    "filled_from_peers": self._fill_from_peers,
                    "fill_total": len(self.fill_order), "tier_bytes": self.nbytes,
                    "ssd_bytes": self.ssd_nbytes, "pfs_by_model": self._model_pfs,
                    "transport": self.transport, "exchange_sent": self._exchange_sent,
                    "exchange_rounds": self._exchange_rounds,
                    "exchange_ended": self._exchange_ended,
                    "warmed_bytes": int(self.warmed.get("bytes", 0)),
                    "ram_tier": self.ram_tier, "buffer_bytes": len(self._buf),
                    "locked_bytes": self._pages.nbytes if self._pages is not None else 0,
                    "kept_from_old_store": self.kept,
                    **({} if self.cache is None else {
                        # through the node cache: what it read from the shared files
                        "pfs_reads": self.cache.misses, "pfs_bytes": self.cache.miss_bytes,
                        **self.cache.stats()})}

    def abandon(self) -> None:
        if self.comm is None:
            self.close()
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join()

    def close(self) -> None:
        """Stop filling and free the window (collective)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join()
        if self.comm is not None:
            self.comm.Barrier()  # nobody reads our tiers any more
        if self._pages is not None:
            self._pages.close()          # unlocked: the page cache may drop them now
        self._ssd = np.zeros(0, dtype=np.uint8)
        for mm in self._ssd_maps.values():
            try:
                mm.close()
            except BufferError:  # a batch still views it; the OS unmaps at exit
                pass
        self._ssd_maps = {}
        if self._ssd_file is not None:
            self._ssd_file.unlink(missing_ok=True)
            self._ssd_live.release(unlink=False)
        if self.cache is not None:
            self.cache.close()
        lent = self._lender.release()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._win is not None:
            self._segment = None
            free_window(self._win, self.comm, lent)
            self._win = None
        if self._node_seg is not None:
            self._segment = None
            self._buf = self._raw = np.zeros(0, dtype=np.uint8)
            self._node_seg.close()
            self._node_seg = None
