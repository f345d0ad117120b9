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
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .._fs import LiveLock, abandoned, create_private, network_fs
from ..dataset import PackedDataset, PinnedPages, SampleBatch, SampleViews, can_lock, open_dataset
from ..dataset import ALIGNMENT, IndexLayout, assemble_batch, assemble_views, gather_ranges
from ..vocab import Backoff, FillState
from ..comm import (NodeSegment, all_true, allgather_array, alltoall_bytes, fence, is_mpi,
                    ordered_shared_memory, shm_usable)
from ..world import abort_on_uncaught, resolve_comm
from .._intervals import positions_in_runs
from ..errors import InvalidArgumentError
from ..plan import AccessPlan
from ._agreement import agree, check_agreement, node_size
from ._base import Lender, SampleStore, StoreError, WarmUp, raise_background_error, warm_enabled
from ._memory import MEMORY_HEADROOM, available_memory
from ._placement import RAM, compute_placement
from ._windows import free_window, rma_get, shared_segment
from .. import trace as _trace
from . import _tracing as _hooks

__all__ = ["ClairvoyantStore", "tier_nbytes"]

# Each rank's window: the fill counter (8 bytes, in a 64-byte header), one state byte
# per position of its fill order (empty / being written / done), then the tier's data.
_HEADER = ALIGNMENT
_CHUNK_SAMPLES = 64
# per-slot state of this rank's own tier (forebay.vocab.FillState), one byte each
_EMPTY, _WRITING, _DONE = int(FillState.EMPTY), int(FillState.WRITING), int(FillState.DONE)
_CHUNK_BYTES = 8 << 20
# the RAM tier in the page cache: a chunk only maps pages in (no copy, and batches never
# wait for it), so chunks are larger: the fill's Python per chunk, holding the GIL,
# slowed the reader's batches in a cold epoch of small records (64-sample chunks: 0.13 s
# of CPU per 20,480 samples)
_PAGES_CHUNK_SAMPLES = 1024
_PAGES_CHUNK_BYTES = 32 << 20
#: the (source, tier) a part of a batch read from the files' maps is traced as: a
#: sample of this rank's RAM tier held there, a peer's, or one no tier holds
_FILE_TAGS = (("local", "ram"), ("peer", None), ("pfs", "pfs"))
#: where a sample is read from once every tier is full (ClairvoyantStore._steady)
_HERE, _PEER, _FILES = 0, 1, 2


def _align(n):
    return n + (-n) % ALIGNMENT


def tier_nbytes(ds: PackedDataset) -> np.ndarray:
    """Bytes each sample takes in a tier (its record, 64-byte aligned); their sum is
    what the ranks' tiers need together to hold the whole dataset."""
    return _align(ds.record_nbytes)


class ClairvoyantStore(SampleStore):
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
                 warm_files: "bool | str" = "auto", ram_tier: str = "auto") -> None:
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)   # a rank that raises ends the job, not a hang
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
        check_agreement(self.comm, "ClairvoyantStore's arguments", self.ds, {
            "plan": (f"{plan.num_samples} samples, world {plan.world_size}, batch "
                     f"{plan.batch_size}, {plan.epochs} epochs, seed {plan.seed}, "
                     f"drop_last {plan.drop_last}, shuffle {plan.shuffle}"),
            "transport": transport, "verify_on_read": self.ds.verify_on_read,
            "ram_tier": ram_tier})
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

    # -- setup ----------------------------------------------------------------------------
    def _check_ssd(self, ssd_dir: Any, ssd_bytes: int) -> int:
        """The SSD capacity this rank can really use (0, with a warning, if none)."""
        if ssd_bytes <= 0:
            return 0
        problem = None
        if ssd_dir is None:
            problem = "no ssd_dir given"
        else:
            d = Path(ssd_dir)
            if not d.is_dir():
                problem = f"{d} is not a directory"
            elif not os.access(d, os.W_OK):
                problem = f"{d} is not writable"
            else:
                st = os.statvfs(d)
                free = st.f_bavail * st.f_frsize
                if free < ssd_bytes:
                    problem = f"{d} has {free} bytes free, {ssd_bytes} asked"
        if problem:
            warnings.warn(f"rank {self.rank}: SSD tier skipped: {problem}; its samples go "
                          f"to the other tiers or the files", RuntimeWarning, stacklevel=3)
            return 0
        fs = network_fs(d)
        if fs is not None:
            warnings.warn(f"rank {self.rank}: the SSD tier {d} is on {fs}, a file system "
                          f"shared between nodes: its reads go over the network, where the "
                          f"tier is meant to be a node-local disk (a burst buffer such as "
                          f"BeeOND may still be fast)", RuntimeWarning, stacklevel=3)
        return ssd_bytes

    def _layout_offsets(self) -> None:
        """Byte offset of every coverage copy in its owner's tier (RAM buffer or SSD
        file), and of this rank's extra copies after its coverage copies; one fill
        position per sample this rank holds: its RAM order, then its SSD order."""
        p, f = self.placement, len(self.ds)
        self.cov_off = np.full(f, -1, dtype=np.int64)
        held = np.flatnonzero(p.owner >= 0)
        key = p.owner[held].astype(np.int64) * 2 + p.tier[held]
        o = held[np.lexsort((p.slot[held], key))]
        k = p.owner[o].astype(np.int64) * 2 + p.tier[o]
        cum = np.cumsum(self._sizes[o])
        if len(o):
            starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
            base = np.repeat(cum[starts] - self._sizes[o][starts], np.diff(np.r_[starts, len(o)]))
            self.cov_off[o] = cum - self._sizes[o] - base
        self._ram_order = p.ram_order()
        ssd_order = p.ssd_order()
        order = np.concatenate([self._ram_order, ssd_order])
        self.fill_order = order
        r = len(self._ram_order)
        self._R = r
        n = len(order)
        self._is_extra = np.zeros(n, dtype=bool)
        self._is_extra[len(p.own_ram):r] = True
        self._is_extra[r + len(p.own_ssd):] = True
        self._bounds = np.array(sorted({len(p.own_ram), r, r + len(p.own_ssd), n}))
        self.local_off = np.full(f, -1, dtype=np.int64)
        self.local_pos = np.full(f, -1, dtype=np.int64)
        for own, extra, used in ((p.own_ram, p.extra_ram, p.ram_used),
                                 (p.own_ssd, p.extra_ssd, p.ssd_used)):
            self.local_off[own] = self.cov_off[own]
            self.local_off[extra] = int(used[self.rank]) + np.cumsum(self._sizes[extra]) - \
                self._sizes[extra]
        self.local_pos[order] = np.arange(n)
        self.nbytes = int(p.ram_used[self.rank] + self._sizes[p.extra_ram].sum())
        self.ssd_nbytes = int(p.ssd_used[self.rank] + self._sizes[p.extra_ssd].sum())

    def _choose_transport(self, asked: str) -> None:
        if asked not in ("auto", "shm", "rma", "exchange"):
            hint = (" (the clairvoyant store holds its RAM tier in the page cache with "
                    "ram_tier='pages'; transport='pages' is the preload's)"
                    if asked == "pages" else "")
            raise InvalidArgumentError(f"transport must be 'auto', 'shm', 'rma' or 'exchange', "
                                       f"got {asked!r}{hint}")
        if self.comm is None or self.world == 1:
            self.transport = "local"
            return
        one_node = node_size(self.comm) == self.world  # the same answer on every rank
        if asked == "shm" and not one_node:
            raise StoreError("transport='shm' needs every rank on one node")
        if asked == "exchange":
            self.transport = "exchange"
            return
        if is_mpi(self.comm):
            self.transport = ("shm" if one_node else "rma") if asked == "auto" else asked
            return
        if asked == "rma":
            raise StoreError("transport='rma' needs MPI (one-sided gets); this job's "
                             "communicator is torch.distributed: use 'shm' or 'auto'")
        if one_node and not (ordered_shared_memory() and shm_usable(self.comm)):
            if asked == "shm":
                raise StoreError("transport='shm' under torch.distributed needs a writable "
                                 "/dev/shm and, on this CPU, forebay's C kernel (its memory "
                                 "barrier); use transport='auto'")
            one_node = False
        self.transport = "shm" if one_node else "exchange"

    def _choose_ram_tier(self, asked: str, on_pfs_read: Any) -> None:
        """``ram_tier``: "pages" where every rank can hold its RAM tier in the page
        cache, else "copy" (explicit "pages" that cannot be: an error on every rank)."""
        if asked not in ("auto", "copy", "pages"):
            raise InvalidArgumentError(f"ram_tier must be 'auto', 'copy' or 'pages', got "
                                       f"{asked!r}")
        why = None
        shards = self.ds.manifest.shards
        locked = sum(int(shards[k].data_nbytes)      # RLIMIT_MEMLOCK counts maps whole
                     for k in np.unique(self.ds.shard_of[self._ram_order]).tolist())
        fs = network_fs(self.ds.path)
        if self.transport == "rma":
            why = "transport 'rma' serves peers on other nodes from the tier's own memory"
        elif not can_lock(locked):
            why = (f"this process may not lock {locked} bytes in memory (the shards its RAM "
                   f"tier's samples are in: RLIMIT_MEMLOCK, `ulimit -l`), or forebay's C "
                   f"kernel is not built")
        elif asked == "auto" and fs is not None:
            why = f"{self.ds.path} is on {fs}, whose client may drop cached pages itself"
        elif asked == "auto" and on_pfs_read is not None:
            why = "on_pfs_read is given (an emulated file system)"
        if asked == "pages":
            agree(self.comm, f"ram_tier='pages' is not possible here: {why}" if why else None)
        elif asked == "auto":
            asked = "pages" if all_true(self.comm, why is None) else "copy"
        if asked == "pages":
            self._pages = PinnedPages(self.ds)
            p = self.placement
            #: which samples some rank's RAM tier holds (in the files' pages): owners'
            #: RAM copies, and this rank's extra RAM copies (of samples an owner may
            #: hold in its SSD tier: read through the pages too, never from a buffer)
            self._in_pages = (p.owner >= 0) & (p.tier == RAM)
            self._in_pages[self._ram_order] = True
            # its shards' maps, locked from now on (what is mapped in through them)
            self._pages.lock(np.unique(self.ds.shard_of[self._ram_order]))
        self.ram_tier = asked

    def _allocate(self) -> None:
        n_state = len(self.fill_order)
        self._state_len = _align(n_state)
        held = 0 if self._pages is not None else self.nbytes   # the pages: the files'
        size = _HEADER + self._state_len + ALIGNMENT + held
        if self.transport in ("local", "exchange"):
            self._raw = np.zeros(size, dtype=np.uint8)
        elif not is_mpi(self.comm):     # shm under torch.distributed
            self._node_seg = NodeSegment(self.comm, size)
            self._raw = self._node_seg.region()
            self._raw[:8] = 0
        else:
            from mpi4py import MPI

            alloc = MPI.Win.Allocate_shared if self.transport == "shm" else MPI.Win.Allocate
            self._win = alloc(size, 1, comm=self.comm)
            self._raw = np.frombuffer(memoryview(self._win.tomemory()), dtype=np.uint8)
            self._raw[:8] = 0
        data0 = _HEADER + self._state_len
        shift = data0 + (-(self._raw.ctypes.data + data0)) % ALIGNMENT
        self._buf = self._raw[shift:shift + held]
        self._counter = self._raw[:8].view(np.int64)
        self._filled = 0
        self._state = self._raw[_HEADER:_HEADER + n_state].view(np.int8)
        self._state[:] = _EMPTY
        self._known = np.zeros(self.world, dtype=np.int64)  # cached peer counters
        self._ssd = np.zeros(0, dtype=np.uint8)
        self._ssd_maps: dict[int, Any] = {}
        self._ssd_file: Optional[Path] = None
        token = uuid.uuid4().hex[:12]
        token = self.comm.bcast(token, root=0) if self.comm is not None else token
        self._ssd_token = token
        if self.ssd_nbytes:
            self._ssd_file = self._ssd_path(self.rank)
            self._remove_stale_tiers(self._ssd_file.parent, token)
            create_private(self._ssd_file)     # 0600: other users of the node never read it
            self._ssd_live = LiveLock(self._ssd_file)   # held while this rank lives
            with open(self._ssd_file, "rb+") as fh:
                fh.truncate(self.ssd_nbytes)
                mm = mmap.mmap(fh.fileno(), self.ssd_nbytes, access=mmap.ACCESS_WRITE)
            self._ssd_maps[self.rank] = mm
            self._ssd = np.frombuffer(mm, dtype=np.uint8)
        if self._node_seg is not None:
            self._base = np.array(self.comm.allgather(int(shift)), dtype=np.int64)
            fence()
            self.comm.Barrier()          # every counter and state byte is initialised
            self._segment, self._seg_base = self._node_seg.view, self._node_seg.starts
            return
        if self._win is None:
            self._base = np.array([shift], dtype=np.int64)
            return
        from mpi4py import MPI

        self._base = np.array(self.comm.allgather(shift), dtype=np.int64)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._win.Sync()
        self.comm.Barrier()
        self._segment = None
        if self.transport == "shm":
            mapped = shared_segment(self._win, self.comm)
            if mapped is None:
                self.transport = "rma"
            else:
                self._segment, self._seg_base = mapped

    def _start_warm(self) -> None:
        """Start this rank's share of the node's page-cache warm-up: the extents its
        tiers (all ranks of the node) cover, if they fit in memory beside the tiers."""
        extents = self.ds.warm_extents(np.flatnonzero(self.placement.owner >= 0))
        need = sum(n for _, _, n in extents)
        avail = available_memory()
        tiers = int(self.placement.ram_used.sum())
        if not extents or avail is None or need + tiers > MEMORY_HEADROOM * avail:
            return
        self._warm = WarmUp(self.ds, extents, self.rank, self.world, self._stop)
        self._threads.append(self._warm)        # started, and joined, with the fills

    @property
    def warmed(self) -> dict[str, Any]:
        """What the page-cache warm-up read (``PackedDataset.warm``), once it is done."""
        return self._warm.result if self._warm is not None else {}

    @staticmethod
    def _remove_stale_tiers(directory: Path, token: str) -> None:
        """Delete tier files of other jobs whose rank died without closing (kill -9):
        no live process holds their lock."""
        for p in directory.glob(".forebay-*-r*.tier"):
            if f".forebay-{token}-" not in p.name and abandoned(p, p.stat().st_mtime):
                p.unlink(missing_ok=True)

    def _ssd_path(self, rank: int) -> Path:
        """A rank's SSD tier file (each rank's own directory, exchanged at setup)."""
        return self._peer_dirs[rank] / f".forebay-{self._ssd_token}-r{rank}.tier"

    def _peer_ssd(self, rank: int) -> np.ndarray:
        """A peer's SSD tier, mapped read-only (same node: the same file)."""
        with self._lock:
            mm = self._ssd_maps.get(rank)
            if mm is None:
                with open(self._ssd_path(rank), "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), int(self._ssd_all[rank]),
                                   access=mmap.ACCESS_READ)
                self._ssd_maps[rank] = mm
        return np.frombuffer(mm, dtype=np.uint8)

    def _dest(self, pos: np.ndarray):
        """(buffer, selector) pairs: where positions ``pos`` of this rank's tiers live
        (buffer None: the RAM tier is the files' pages)."""
        ram = pos < self._R
        out: list[tuple[Optional[np.ndarray], np.ndarray]] = []
        if ram.any():
            out.append((None if self._pages is not None else self._buf, ram))
        if (~ram).any():
            out.append((self._ssd, ~ram))
        return out

    # -- filling ----------------------------------------------------------------------------
    def _record_parts(self, ids: np.ndarray, rows: np.ndarray, populate: bool = False,
                      advise: Optional[np.ndarray] = None):
        """Parts for assemble_batch / gathers that read records from the dataset."""
        return self.ds.record_parts(ids, rows, populate=populate, advise=advise)

    def _done_at(self, lpos: np.ndarray) -> np.ndarray:
        if len(self._state) == 0:
            return np.zeros(len(lpos), dtype=bool)
        return (lpos >= 0) & (self._state[np.maximum(lpos, 0)] == _DONE)

    def _claim(self, pos: np.ndarray) -> np.ndarray:
        """Claim tier positions for writing; returns which ones this caller got."""
        with self._lock:
            free = self._state[pos] == _EMPTY
            self._state[pos[free]] = _WRITING
        return free

    def _read_into_tier(self, ids: np.ndarray, rows: np.ndarray, pos: np.ndarray,
                        mapped: bool = False) -> None:
        """Copy records from the dataset files to positions ``pos`` of this rank's
        tiers, or read them into the page cache and lock them there (a PFS read)."""
        t0 = time.perf_counter()
        dst = self.local_off[ids]
        for buf, tsel in self._dest(pos):
            if buf is None:
                self._pin(ids[tsel], rows[tsel], mapped)
                continue
            # pread: the kernel copies from its page cache into the tier; mapping the
            # files instead cost a page fault per 64 KiB read and an unmap after (so the
            # node did not hold each filled sample twice): 2-3x the CPU of the copy
            self.ds.read_records(ids[tsel], rows[tsel], buf, dst[tsel])
            if self.ds.verify_on_read:   # checked once, as it enters the tier
                self.ds.check_records(ids[tsel], buf, dst[tsel],
                                      where=f"(read into rank {self.rank}'s tier)")
        nbytes = int(rows[:, IndexLayout.REC_LEN].sum())
        t1 = time.perf_counter()
        if self.on_pfs_read is not None and len(ids):
            self.on_pfs_read(nbytes, len(ids), t1 - t0)
        rec = _trace.active()
        if rec is not None:
            _hooks.record_pfs(rec, self.ds, ids, rows, t0, t1)
        with self._lock:
            self.pfs_reads += len(ids)
            self.pfs_bytes += nbytes

    def _pin(self, ids: np.ndarray, rows: np.ndarray, mapped: bool = False) -> None:
        """Read samples ``ids`` into the page cache and lock them there (the RAM tier
        held in the files' pages).  Pages that cannot be locked stay cached unlocked,
        with one warning: the data is the files' either way, only its presence in
        memory is no longer certain."""
        assert self._pages is not None
        self._pages.pin(ids, rows, advise=np.zeros(len(ids), dtype=bool) if mapped else None)
        if self._pages.error and not self._pin_warned:
            self._pin_warned = True
            warnings.warn(f"rank {self.rank}: the RAM tier's pages could not be locked in "
                          f"memory ({os.strerror(self._pages.error)}): they stay in the page "
                          f"cache unlocked, where the kernel may drop them and a later read "
                          f"goes to the files again (raise `ulimit -l`, or "
                          f"ram_tier='copy')", RuntimeWarning, stacklevel=2)

    def _load(self, ids: np.ndarray, pos: np.ndarray, wait: float,
              rows: Optional[np.ndarray] = None, mapped: bool = False) -> None:
        """Write claimed positions ``pos`` (samples ``ids``, index rows ``rows``) of this
        rank's tiers, then mark them done.  Extra copies come from their owner's tier
        when it has them (waiting up to ``wait`` s for an owner still filling), so the
        PFS serves each sample once; everything else is read from the dataset files.
        ``mapped``: a batch has just read them (cached: not asked for again)."""
        rows = self.ds.rows(ids) if rows is None else rows
        extra = self._is_extra[pos]
        paged = self._paged(ids)
        if paged is not None:   # (a peer's RAM tier is the files' pages: read from them)
            extra &= ~paged
        from_peer = np.zeros(len(ids), dtype=bool)
        if extra.any():
            from_peer[extra] = self._present(ids[extra], wait=wait)
        if from_peer.any():
            dst = self.local_off[ids]
            for src, rec, sel in self._peer_parts(ids, rows, from_peer):
                for buf, tsel in self._dest(pos[sel]):
                    idx = np.flatnonzero(sel)[tsel]
                    gather_ranges(src, rec[tsel], rows[idx, IndexLayout.REC_LEN], buf, dst[idx])
        rest = ~from_peer
        self._read_into_tier(ids[rest], rows[rest], pos[rest], mapped)
        self._sync()  # the data is visible before its state says done
        with self._done_cv:
            self._state[pos] = _DONE
            self._fill_from_peers += int(from_peer.sum())
            self._done_cv.notify_all()

    def _next_chunk(self, key: str, hi: int) -> Optional[tuple[int, int]]:
        """The next chunk [a, b) of the fill order below ``hi`` for cursor ``key``
        (``_chunk_end``)."""
        with self._lock:
            a = self._cursor[key]
            # a reader that caught up loads what it needs itself: the fill jumps ahead
            # of it (two batches) rather than race it for the same chunk; whatever it
            # jumped over that no reader took is filled at the end (_fill_holes)
            ahead = self._need_front + 2 * self.plan.batch_size
            if key != "now" and a <= self._need_front < hi:
                a = min(hi, max(a, ahead))
            if a >= hi:
                self._cursor[key] = a
                return None
            b = self._cursor[key] = self._chunk_end(a, hi)
        return a, b

    def _chunk_limits(self, a: int) -> tuple[int, int]:
        """(samples, bytes) a fill chunk starting at fill position ``a`` holds at most."""
        if self._pages is not None and a < self._R:
            return _PAGES_CHUNK_SAMPLES, _PAGES_CHUNK_BYTES
        return _CHUNK_SAMPLES, _CHUNK_BYTES

    def _chunk_end(self, a: int, hi: int) -> int:
        """Where a chunk of the fill order starting at ``a`` ends (below ``hi``, within
        ``_chunk_limits``, never mixing tiers or coverage and extra copies)."""
        most, nbytes = self._chunk_limits(a)
        b = min(hi, a + most)
        cum = np.cumsum(self._sizes[self.fill_order[a:b]])
        b = a + max(1, int(np.searchsorted(cum, nbytes, side="right")))
        return min(b, int(self._bounds[np.searchsorted(self._bounds, a, side="right")]))

    def _fill_chunks(self, key: str, hi: int) -> None:
        """Fill chunks from cursor ``key`` until ``hi`` (one of possibly several
        threads on the same cursor)."""
        order = self.fill_order
        while not self._stop.is_set():
            chunk = self._next_chunk(key, hi)
            if chunk is None:
                return
            a, b = chunk
            self._read_ahead(b, hi)
            t0 = time.perf_counter()
            peers0 = self._fill_from_peers
            got = self._fill_positions(np.arange(a, b))
            if got is None:
                return
            rec = _trace.active()
            if rec is not None:
                rec.span("cache", "fill", t0, time.perf_counter(), count=int(got.sum()),
                         nbytes=int(self._sizes[order[a:b][got]].sum()),
                         args={"tier": "ram" if a < self._R else "ssd",
                               "from_peers": self._fill_from_peers - peers0, "filled": b})

    def _read_ahead(self, b: int, hi: int) -> None:
        """Ask the kernel for the records of the chunk after this one now (WILLNEED),
        so the files' reads stay in flight while this chunk is read and written: a fill
        thread otherwise left the device idle between its chunks (a cold epoch 0.85-0.9x
        of direct reads', which keep their next batch's reads in flight).  Extra copies
        (read from their owner's tier) are not asked for; a chunk a batch takes instead
        is read either way."""
        if b >= hi or self._is_extra[b]:
            return
        ids = self.fill_order[b:self._chunk_end(b, hi)]
        self.ds.record_parts(ids, self.ds.rows(ids))

    def _wait_done(self, pos: np.ndarray, timeout: Optional[float] = None) -> bool:
        """Wait until positions ``pos`` of this rank's tiers are done (written by this
        rank's reader or fill threads); False if the store stops or ``timeout`` passes."""
        with self._done_cv:
            return self._done_cv.wait_for(
                lambda: self._stop.is_set() or bool((self._state[pos] == _DONE).all()),
                timeout) and not self._stop.is_set()

    def _fill_positions(self, pos: np.ndarray) -> Optional[np.ndarray]:
        """Load the fill positions ``pos`` nobody claimed yet, wait for those a reader
        is writing, publish the prefix; which ones this thread loaded (None: the store
        stopped)."""
        got = self._claim(pos)
        self._load(self.fill_order[pos[got]], pos[got], wait=self.peer_wait)
        if not self._wait_done(pos):
            return None
        self._advance()
        return got

    def _fill_holes(self, lo: int, hi: int) -> None:
        """Fill positions in [lo, hi) the fill jumped over and no reader took, wait
        for those a reader is still writing, and publish the whole prefix."""
        while not self._stop.is_set():
            with self._lock:
                holes = np.flatnonzero(self._state[lo:hi] != _DONE) + lo
            if not len(holes):
                self._advance()
                return
            if self._fill_positions(holes[:self._chunk_limits(int(holes[0]))[0]]) is None:
                return

    def _advance(self) -> None:
        """Publish the longest complete prefix of the fill order (chunks finish out of
        order when several threads fill)."""
        with self._publish_lock:
            a = count = self._filled
            n = len(self._state)
            while count < n:  # in windows: each call costs the new prefix plus 4 KiB
                todo = self._state[count:count + 4096] != _DONE
                if todo.any():
                    count += int(np.argmax(todo))
                    break
                count += len(todo)
            if count > a:
                self._publish(count)

    def fill_now(self, limit: Optional[int] = None) -> int:
        """Fill (more of) this rank's tiers in the calling thread; returns samples filled.

        Positions a reader already cached (it needed them first) are skipped; positions
        a reader is writing are waited for, so the published counter never covers a
        sample that is not fully written."""
        start = self._filled
        end = len(self.fill_order) if limit is None else min(len(self.fill_order),
                                                               start + limit)
        with self._lock:
            self._cursor["now"] = start
        self._fill_chunks("now", end)
        return self._filled - start

    def _sync(self) -> None:
        if self._win is not None:
            self._win.Sync()
        elif self._node_seg is not None:
            fence()

    def _publish(self, count: int) -> None:
        """Make the filled bytes visible, then move the counter (never the reverse)."""
        if self._win is not None:
            from mpi4py import MPI

            self._win.Sync()
            self._win.Accumulate([np.array([count], dtype=np.int64), MPI.INT64_T], self.rank,
                                 [0, 1, MPI.INT64_T], MPI.REPLACE)
            self._win.Flush(self.rank)
        else:
            fence()     # the data is visible before the counter that announces it
            self._counter[0] = count
        self._filled = count

    def _fill_loop(self, tier: str, hi: int) -> None:
        try:
            if tier == "ram" and self._pages is not None and self._warm is not None:
                # the batches read from the files either way: the fill's reads wait for
                # the warm-up's sequential ones instead of competing with them, one
                # small request per sample, on a file system bound by requests per second
                self._warm.join()
            self._fill_chunks(tier, hi)
            self._fill_holes(0 if tier == "ram" else self._R, hi)
        except BaseException as e:  # surfaced by the next get_many
            self._fill_error = e

    @property
    def filled(self) -> int:
        """Samples of this rank's fill order already in its tier."""
        return self._filled

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's tiers are full (True) or ``timeout`` passes (False);
        a fill thread that died raises :class:`StoreError` naming its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_fill_error()
        if any(t.is_alive() for t in self._threads):
            return False
        return self._filled == len(self.fill_order) or bool(self._threads)

    def _raise_fill_error(self) -> None:
        if self._warm is not None:
            self._warm.check()
        raise_background_error(self._fill_error, f"the fill thread (after filling "
                               f"{self._filled} of {len(self.fill_order)} samples)")

    def _peer_parts(self, ids: np.ndarray, rows: np.ndarray, sel: np.ndarray,
                    lend: bool = False):
        """[(src, record starts, mask)]: where the selected samples' records are in
        their owners' tiers: RAM through the mapped shared segment or staged with
        MPI_Get, SSD through the owner's file mapped here."""
        p = self.placement
        parts = []
        ram = sel & (p.tier[ids] == RAM)
        if ram.any():
            o = p.owner[ids[ram]].astype(np.int64)
            disp = self._base[o] + self.cov_off[ids[ram]]
            if self.transport == "shm" and self._segment is not None:
                seg = self._lent("segment") if lend else self._segment
                parts.append((seg, self._seg_base[o] + disp, ram))
            else:
                ln = rows[ram, IndexLayout.REC_LEN]
                srt = np.argsort(o, kind="stable")
                pos = np.empty(len(o), dtype=np.int64)
                pos[srt] = np.cumsum(ln[srt]) - ln[srt]
                stage = np.empty(int(ln.sum()), dtype=np.uint8)
                t0 = time.perf_counter()
                rma_get(self._win, stage, o[srt], disp[srt], ln[srt], pos[srt])
                rec = _trace.active()
                if rec is not None:
                    rec.span("memstore", "get", t0, time.perf_counter(), count=len(o),
                             nbytes=len(stage), args={"owners": len(np.unique(o))})
                stage.flags.writeable = not lend        # views own it
                parts.append((stage, pos, ram))
        ssd = sel & ~ram
        for o in np.unique(p.owner[ids[ssd]]).tolist():
            m = ssd & (p.owner[ids] == o)
            parts.append((self._peer_ssd(o), self.cov_off[ids[m]], m))
        return parts

    def _present(self, ids: np.ndarray, wait: float = 0.0) -> np.ndarray:
        """Which ids are complete in their owner's tier (owner != this rank), refreshing
        a cached counter only when it no longer suffices; polls up to ``wait`` s."""
        if self._win is None and self._node_seg is None:
            return np.zeros(len(ids), dtype=bool)
        p = self.placement
        owner, tier = p.owner[ids], p.tier[ids]
        # position in the owner's fill order: its RAM order, then its SSD order
        slots = p.slot[ids] + np.where(tier == RAM, 0, self._R_all[np.maximum(owner, 0)])
        # a peer's SSD tier is readable only on its node (the file, mapped here)
        cand = (owner >= 0) & (owner != self.rank) & ((tier == RAM) | (self.transport == "shm"))
        if not cand.any():
            return np.zeros(len(ids), dtype=bool)
        deadline = time.perf_counter() + wait
        poll = Backoff(first=0.001, cap=0.004)
        while True:
            for o in np.unique(owner[cand]).tolist():
                sel = cand & (owner == o)
                if self._known[o] <= slots[sel].max():
                    self._known[o] = self._peer_counter(o)
            ok = cand & (slots < self._known[np.maximum(owner, 0)])
            late = cand & ~ok
            if late.any() and self._segment is not None:
                # shm: an owner's reader may have cached it ahead of the fill; its state
                # byte says so (set only after the data was written and synced)
                o = owner[late].astype(np.int64)
                flags = self._segment[self._seg_base[o] + _HEADER + slots[late]]
                ok[np.flatnonzero(late)[flags == _DONE]] = True
                self._sync()
            if ok.sum() == cand.sum() or time.perf_counter() >= deadline or self._stop.is_set():
                return ok
            poll.sleep()

    def _peer_counter(self, rank: int) -> int:
        if self._node_seg is not None:
            at = int(self._seg_base[rank])
            count = int(self._segment[at:at + 8].view(np.int64)[0])
            fence()     # later loads of the peer's data see what preceded the counter
            return count
        from mpi4py import MPI

        result = np.zeros(1, dtype=np.int64)
        self._win.Fetch_and_op([np.zeros(1, dtype=np.int64), MPI.INT64_T],
                               [result, MPI.INT64_T], rank, 0, MPI.NO_OP)
        self._win.Flush(rank)
        self._win.Sync()  # later loads of the peer's data see what preceded the counter
        return int(result[0])

    # -- reading ------------------------------------------------------------------------------
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

    def _exchange(self, ids: np.ndarray, want: np.ndarray,
                  requests: "Optional[list[np.ndarray]]") -> tuple[np.ndarray, list]:
        """The ``exchange`` transport's collective (every rank, every call).  First one
        small all-to-all both ways: an owner tells each requester which of the samples
        it asked for (and the owner holds) its tiers hold now, and a requester tells
        each owner which of them it still wants (not those its own tiers hold as extra
        copies); then the owners send the records both said yes to (one all-to-all).
        Returns which of ``ids`` arrived, and the assemble_batch part holding them."""
        comm, world, p = self.comm, self.world, self.placement
        reclen = self.ds.record_nbytes
        if requests is None:
            requests = allgather_array(comm, ids)
        cat = np.concatenate(requests)
        by = np.repeat(np.arange(world), [len(r) for r in requests])
        if len(cat) and (cat.min() < 0 or cat.max() >= len(self.ds)):
            raise StoreError("a peer asked for a sample id outside the dataset")
        # asked of this rank (grouped by requester, as ``cat`` is)
        mine = (p.owner[cat] == self.rank) & (by != self.rank)
        sids, to = cat[mine], by[mine]
        lp = self.local_pos[sids]
        have = (lp >= 0) & ((lp < self._filled) | self._done_at(lp))
        # asked by this rank, grouped by owner, in request order
        owner = p.owner[ids].astype(np.int64)
        ask = np.flatnonzero((owner >= 0) & (owner != self.rank))
        ask = ask[np.argsort(owner[ask], kind="stable")]
        n_to = np.bincount(to, minlength=world)             # peers' asks of this rank
        n_ask = np.bincount(owner[ask], minlength=world)    # this rank's asks of each
        # to rank r: whether this rank is self-sufficient, r's asks' presence bytes,
        # then this rank's want bytes for its asks of r; from r: the same, reversed
        peers = np.flatnonzero(np.arange(world) != self.rank)
        count = n_to + n_ask
        count[peers] += 1
        start = np.cumsum(count) - count
        # where each ask of this rank's and each ask of a peer's is, in either message
        to_at = start[to] + 1 + positions_in_runs(n_to)
        oa = owner[ask]
        ask_at = start[oa] + 1 + positions_in_runs(n_ask)
        flags = np.empty(int(count.sum()), dtype=np.uint8)
        alone = self._self_sufficient()
        flags[start[peers]] = alone
        flags[to_at] = have
        wanted = want[ask]
        flags[ask_at + n_to[oa]] = wanted
        back = alltoall_bytes(comm, flags, count, count)
        held = back[ask_at].astype(bool)
        sent = have & back[to_at + n_ask[to]].astype(bool)
        # the records both sides said yes to, in the same order
        send_ids, send_lp = sids[sent], lp[sent]
        slen = reclen[send_ids]
        send = np.empty(int(slen.sum()), dtype=np.uint8)
        dst = np.cumsum(slen) - slen
        off = self.local_off[send_ids]
        ram = send_lp < self._R
        tiers = [(self._ssd, ~ram)]
        if self._pages is None:
            tiers.append((self._buf, ram))
        elif ram.any():
            # the RAM tier is the files' pages (locked): sent from the dataset's maps
            at = np.flatnonzero(ram)
            for src, rec, sel in self._record_parts(send_ids[at], self.ds.rows(send_ids[at]),
                                                    advise=np.zeros(len(at), dtype=bool)):
                gather_ranges(src, rec, slen[at][sel], send, dst[at][sel])
        for buf, tier in tiers:
            if tier.any():
                gather_ranges(buf, off[tier], slen[tier], send, dst[tier])
        got = ask[held & wanted]
        glen = reclen[ids[got]]
        stage = alltoall_bytes(comm, send,
                               np.bincount(to[sent], weights=slen, minlength=world),
                               np.bincount(owner[got], weights=glen, minlength=world))
        pos = np.full(len(ids), -1, dtype=np.int64)
        pos[got] = np.cumsum(glen) - glen
        use = pos >= 0
        with self._lock:
            self._exchange_sent += int(len(send_ids))
            self._exchange_rounds += 1
            # every rank said so in this same round: none calls the exchange again
            self._exchange_ended = alone and bool(back[start[peers]].all())
        return use, ([(stage, pos[use], use)] if use.any() else [])

    def _self_sufficient(self) -> bool:
        """Whether this rank's tiers are full and hold every sample its plan reads (it
        will never want a peer's record again)."""
        if self._filled < len(self.fill_order):
            return False
        if self._covers_plan is None:
            reads = np.flatnonzero(self.plan.frequencies(self.rank) > 0)
            self._covers_plan = bool((self.local_pos[reads] >= 0).all())
        return self._covers_plan

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
            if self.ds.verify_on_read:   # (the files' pages may change under a tier)
                self.ds.check_records(ids[fidx])
            kind = np.where(local[fidx], 0, np.where(peer[fidx], 1, 2))
            # pages a tier locked are in memory: only the others are advised
            for src, rec, sel in self._record_parts(
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
                    "locked_bytes": self._pages.nbytes if self._pages is not None else 0}

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
        lent = self._lender.release()
        if self._win is not None:
            self._segment = None
            free_window(self._win, self.comm, lent)
            self._win = None
        if self._node_seg is not None:
            self._segment = None
            self._buf = self._raw = np.zeros(0, dtype=np.uint8)
            self._node_seg.close()
            self._node_seg = None

