"""DDStore-style distributed in-memory store: node shared memory, MPI one-sided RMA,
or a collective exchange.

Ranks form replica groups of ``width`` consecutive ranks; each group holds one full
replica of the dataset, striped over its members in contiguous chunks balanced by
bytes.  Every rank computes, from the dataset index alone, which member owns any
sample and at which byte offset of that member's memory it lies: no registry, no
lookup traffic.  This file holds the store's public face (construction, reads,
statistics, close); its set-up, background load and exchange transport are in
``_dist_setup.py``, ``_dist_load.py`` and ``_dist_exchange.py``, the state they share in
``_dist_state.py``, the layout in ``_layout.py``.  Transports: ``shm`` (the group on
one node: one shared segment, a batch is one gather), ``rma`` (MPI: one ``MPI_Get`` per
owner, an hindexed datatype covering all of that owner's records, inside one
passive-target access epoch opened at setup) and ``exchange`` (any communicator,
torch.distributed included: each batch is one collective in which every member sends
the records the others asked for).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .._liveness import join as join_liveness
from ..dataset import PackedDataset, PinnedPages, SampleBatch, SampleViews, open_dataset
from ..dataset import prefix_fingerprint
from ..dataset import IndexLayout, assemble_batch, assemble_views
from ..errors import InvalidArgumentError
from ..progress import Progress, TqdmProgress, as_progress
from ..comm import NodeSegment, all_true, mpi_thread_multiple, ordered_shared_memory
from .._fs import network_fs
from ..world import abort_on_uncaught, resolve_comm
from ._agreement import check_agreement
from ._base import Lender, SampleStore, StoreError
from ._layout import StoreLayout
from ._windows import TargetProgress, free_window, rma_get, rma_get_one, target_progress
from ._dist_exchange import ExchangeTransport
from ._dist_load import BackgroundLoad
from ._dist_setup import StoreSetup
from .. import trace as _trace
from . import _tracing as _hooks

if TYPE_CHECKING:
    from ._arrays import ArrayStore

__all__ = ["DistributedStore", "default_comm", "overlap_by_default", "TRANSPORTS"]


def default_comm() -> Any:
    """The communicator of the job (:func:`forebay.world.resolve_comm`): MPI's
    COMM_WORLD under an MPI launcher (or once mpi4py is initialised), else None (one
    process).  A launcher reporting ranks MPI cannot see raises
    :class:`~forebay.errors.LaunchError`."""
    return resolve_comm(None)


def overlap_by_default(path: "str | os.PathLike[str]", on_pfs_read: Any = None,
                       mounts: Optional[str] = None) -> bool:
    """What ``overlap="auto"`` picks on this rank for a dataset at ``path``: True on a
    network file system (:func:`forebay._fs.network_fs`, from ``/proc/mounts`` or the
    table ``mounts``) or an emulated one (an ``on_pfs_read`` hook)."""
    return on_pfs_read is not None or network_fs(os.fspath(path), mounts) is not None


TRANSPORTS = ("auto", "pages", "shm", "rma", "exchange")


class DistributedStore(ExchangeTransport, BackgroundLoad, StoreSetup, SampleStore):
    """The dataset striped over ranks' memory, read through MPI windows (shared memory
    within a node, one-sided RMA across nodes).

    Args:
        dataset: a :class:`~forebay.dataset.PackedDataset` or its path.
        comm: an mpi4py communicator; default :func:`default_comm` (COMM_WORLD under
            an MPI launcher, else a single-process local store).
        width: ranks per replica group (default: all ranks, one replica); must divide
            the world size.  ``world // width`` replicas exist; every read stays inside
            the reader's group.
        node_aware: make each node one replica group (``COMM_TYPE_SHARED``), so every
            read is intra-node; every node must run the same number of ranks.
        transport: how a rank reads its group's memory.  ``"pages"``: the group
            shares one node and the chunks are held in the files' own pages in the
            page cache, each member locking its chunk's (:class:`PinnedPages`); every
            rank reads any sample through its maps of the files (no copy of the
            store's own: the node holds each byte once; needs the right to lock
            them, :func:`~forebay.dataset.can_lock`); ``"shm"``: the group shares
            one node, so the members' chunks live in one shared-memory segment (an MPI
            shared window, or a file in /dev/shm under torch.distributed) and peers
            read it with plain memory copies (no communication per batch);
            ``"rma"``: MPI_Get on a passive-target window (MPI only, any network);
            ``"exchange"``: each ``get_many`` is a collective of the replica group
            (an all-gather of the requested ids, then one all-to-all of the records),
            so every member must call it in step, as the loader does;
            ``"auto"`` (default): pages when every group is on one node, the
            dataset on a local file system, no ``on_pfs_read``, and every rank may
            lock its shards; else shm when the whole group is on one node, else rma
            under MPI and exchange under torch.distributed.
        progress: preload progress (default: a bar on rank 0 when it has a terminal).
        on_pfs_read: called after each preload read from the dataset files with
            (bytes, samples, seconds): an instrumentation hook (tracing, PFS emulation).
        read_threads: preload reads in flight at once per rank (pieces of 16 MiB).
        overlap: return as soon as the memory is allocated and load in a background
            thread (every transport; ``rma`` needs MPI_THREAD_MULTIPLE, else it loads
            before returning).  While it runs, a sample whose bytes have not arrived
            in its owner's memory is read from the dataset files instead (each rank
            loads its chunk in order and announces how far it has got in a header of
            its memory, read through MPI atomics over ``rma``; over ``exchange`` the
            owner itself reads from the files what it has not loaded yet and sends
            it), so training starts at once; :meth:`wait_filled` waits for the end.
            ``"auto"``: overlapped where the dataset is on a network file system
            (NFS, Lustre, GPFS, ...: :data:`forebay._fs.NETWORK_FS`, and the types
            named in ``FOREBAY_NETWORK_FS``) on any rank, or
            ``on_pfs_read`` is given (an emulated one): there the load is bound by
            the file system and would hold every step back; plain on a local disk,
            whose load is short and whose batches then run without the load's
            bookkeeping (the loader's default; this constructor's is False).
            For records of 64 KiB and more the load yields to batches reading the
            files (:attr:`yields`: it queues a piece only when none has for 10 ms;
            over ``exchange`` and ``rma``, when its own member's batches have not);
            smaller records, bound by requests, load alongside.
            A load that fails (a damaged record with ``verify_on_read``, a short
            file) fails the next ``get_many`` of every rank of the group, naming the
            cause.  The files must stay readable until the load ends (see
            docs/store.md).

    Setup is collective: every rank of ``comm`` constructs the store with the same
    arguments; every check that fails (width, dataset fingerprints, memory) raises
    :class:`StoreError` on every rank.  :meth:`close` is collective too.
    """

    capabilities = frozenset({"shared"})
    def __init__(self, dataset: "PackedDataset | str | os.PathLike[str]", comm: Any = None,
                 width: Optional[int] = None, *, node_aware: bool = False,
                 transport: str = "auto", progress: "Progress | bool | None" = None,
                 on_pfs_read: Optional[Callable[[int, int, float], None]] = None,
                 read_threads: int = 4, overlap: "bool | str" = False,
                 node_cache: Any = None,
                 grown_from: "Optional[DistributedStore]" = None) -> None:
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)   # a rank that raises ends the job, not a hang
        join_liveness(self.comm)       # a peer gone mid-wait ends the job, not a hang
        if transport not in TRANSPORTS:
            raise InvalidArgumentError(
                f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got "
                f"{transport!r}")
        self.ds = dataset if isinstance(dataset, PackedDataset) else open_dataset(dataset)
        self.rank = self.comm.Get_rank() if self.comm is not None else 0
        self.world = self.comm.Get_size() if self.comm is not None else 1
        self._win: Any = None        # the MPI window (rma, or shm under MPI)
        self._node_seg: Optional[NodeSegment] = None   # shm under torch.distributed
        self._segment: Any = None    # the group's shared segment (shm transport)
        self._lender = Lender()      # the memory get_views lends
        self._closed = False
        self.cache: Any = None       # the node-local cache of Preload(node_cache=)
        self._chunk_cached = False   # this rank's chunk read from it, not the files
        self._fetches = {"local": 0, "peer": 0, "pfs": 0}
        self._file_bytes = 0         # read from the files for batches (overlap)
        self.on_pfs_read = on_pfs_read
        self._stop = threading.Event()
        self._loader: Optional[threading.Thread] = None
        self._load_error: Optional[BaseException] = None
        self.preload_seconds: Optional[float] = None
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or \
                read_threads < 1:
            raise InvalidArgumentError(f"read_threads must be a positive integer, got "
                                       f"{read_threads!r}")
        self.read_threads = read_threads
        if not isinstance(overlap, bool) and overlap != "auto":
            raise InvalidArgumentError(f"overlap must be True, False or 'auto', got "
                                       f"{overlap!r}")
        segments = self._grown_segments(grown_from, width)
        check_agreement(self.comm, "DistributedStore's arguments", self.ds, {
            "width": width, "node_aware": node_aware, "transport": transport,
            "verify_on_read": self.ds.verify_on_read, "overlap": overlap,
            "segments": segments})
        if node_cache is not None or grown_from is not None:
            overlap = False     # the chunk comes from the cache (or the old store) first
        if overlap == "auto":   # any rank's files on a network file system: all overlap
            overlap = not all_true(self.comm, not overlap_by_default(self.ds.path,
                                                                    on_pfs_read))
        self._setup_groups(width, node_aware)
        if grown_from is not None and (grown_from.width, grown_from.member) != \
                (self.width, self.member):
            raise InvalidArgumentError(f"grown_from holds member {grown_from.member} of "
                                       f"{grown_from.width}, this store {self.member} of "
                                       f"{self.width}: grow with the same replica groups")
        self.layout = StoreLayout(self.ds, self.width, segments)
        self._mine = self.layout.member == self.member     # which samples this member holds
        #: the old store whose chunk this one's begins with (a dataset that grew)
        self._grown_from = grown_from
        #: which samples this rank read from the files (its chunk, or the part of it
        #: neither the node cache nor the old store had)
        self._from_files = self._mine.copy()
        #: transport "pages": this rank's chunk held in the files' pages, locked
        self._pages: Optional[PinnedPages] = None
        self._mapped = False         # pages: the whole dataset mapped into this process
        self._map_lock = threading.Lock()
        self.transport = self._choose_transport(transport, on_pfs_read, bool(overlap))
        #: bytes of each member's chunk known to be loaded (all of it once preloaded)
        self._known = self.layout.nbytes.copy()
        self._check_memory()
        if progress is None:
            progress = TqdmProgress() if self.rank == 0 else None
        self._t0 = time.perf_counter()
        if node_cache is not None:
            self.cache = node_cache       # closed with the store
            try:
                self._use_node_cache(node_cache, as_progress(progress))
            except BaseException:
                node_cache.close()
                self.cache = None
                raise
        self._allocate(bool(overlap))
        if self.transport == "shm":
            self._map_peers()        # may find the MPI's layout unusable: then rma
        #: rma across nodes: a thread that lets peers' gets from this rank complete
        #: while it is busy outside MPI (see TargetProgress)
        self._progress: Optional[TargetProgress] = target_progress(
            self.group_comm, self.transport == "rma" and self._local_members < self.width)
        #: loading in the background: shm, pages and local (a reader reads the owner's
        #: header), rma (through MPI: the load publishes from its thread, which needs
        #: MPI_THREAD_MULTIPLE), exchange (the owner serves what it has not loaded from
        #: the files)
        self.overlap = bool(overlap) and (
            self.transport in ("local", "exchange", "pages") or
            (self.transport == "shm" and ordered_shared_memory()) or
            (self.transport == "rma" and mpi_thread_multiple()))
        #: the background load yields to batches reading the files: for large records,
        #: whose random reads cost about what sequential ones do (small ones are bound
        #: by requests: the sequential load then serves the batches sooner); over the
        #: exchange and rma each member's load yields to its own batches' reads (no
        #: remote header), and a batch keeps only its own member's records (a peer's
        #: would be an MPI_Put)
        self.yields = self.overlap and not self.ds.small_records
        #: exchange + overlap: every member's chunk is known loaded (agreed in a batch)
        self._group_loaded = not self.overlap
        self._served_from_files = [0, 0]    # records, bytes: sent to peers from the files
        self._yielding = self.yields
        self._kept_skipped = 0       # bytes the load did not read: batches had kept them
        # the exchange's records arrive in a fresh buffer every batch: nothing to lend
        self.capabilities = frozenset({"shared"} | ({"views"} if self.transport != "exchange"
                                                    else set()))
        if self.overlap:
            self.capabilities |= {"background_fill"}
            self._start_load()
            return
        try:
            self._preload(as_progress(progress))
            self._verify_chunk()
        except BaseException:
            self.close()
            raise
        self.preload_seconds = time.perf_counter() - self._t0

    def _grown_segments(self, old: "Optional[DistributedStore]", width: Optional[int]
                        ) -> "tuple[int, ...] | None":
        """The layout's segments of a store that grows from ``old`` (the same job's
        store over the first generations of this dataset): its segments and this
        dataset's size; None for a store of its own."""
        if old is None:
            return None
        k = len(old.ds.manifest.shards)
        if old._closed or old.preload_seconds is None or len(old.ds) >= len(self.ds) or \
                old.world != self.world or (width is not None and width != old.width) or \
                prefix_fingerprint(old.ds.manifest.shards) != \
                prefix_fingerprint(self.ds.manifest.shards[:k]):
            raise InvalidArgumentError(
                f"grown_from must be an open, loaded store over the first generations of "
                f"{self.ds.path} on the same ranks and width ({old!r})")
        return old.layout.segments + (len(self.ds),)

    @staticmethod
    def from_arrays(arrays: "Mapping[str, np.ndarray]", comm: Any = None, *,
                    transport: str = "auto", mutable: bool = False) -> "ArrayStore":
        """A store of named arrays from memory, no dataset and no ingest (DDStore's
        ``add``): every rank passes the rows it has of each variable (same names,
        dtypes and row shapes on every rank; row counts may differ), and any rank reads
        any global row.  Collective.  See :class:`~forebay.store.ArrayStore`."""
        from ._arrays import ArrayStore

        return ArrayStore(arrays, comm, transport=transport, mutable=mutable)

    @property
    def replicas(self) -> int:
        return self.world // self.width

    @property
    def nbytes(self) -> int:
        """Bytes of dataset held by this rank."""
        return int(self.layout.nbytes[self.member])

    def owner(self, ids: "Sequence[int] | np.ndarray") -> np.ndarray:
        """World rank that serves each id to this rank (a member of this rank's group)."""
        return self.group_ranks[self.layout.member[self.ds.normalize_ids(ids)]]

    def get_step(self, requests: "Sequence[np.ndarray]", *, alloc=None) -> SampleBatch:
        """This rank's batch when every member of its replica group knows what each
        member asks for in this call (``requests[m]``: member m's ids, as from the
        access plan): the ``exchange`` transport then skips its all-gather of the
        ids, one collective per batch.  Other transports: ``get_many(requests[member])``."""
        if len(requests) != self.width:
            raise InvalidArgumentError(f"get_step needs one request per member of the "
                                       f"replica group ({self.width}), got {len(requests)}")
        if self.transport != "exchange":
            return self.get_many(requests[self.member], alloc=alloc)
        reqs = [self.ds.normalize_ids(r) for r in requests]
        return self.get_many(reqs[self.member], alloc=alloc, requests=reqs)

    def get_many(self, ids: "Sequence[int] | np.ndarray", *, alloc=None,
                 requests: "Optional[list[np.ndarray]]" = None) -> SampleBatch:
        """Samples ``ids`` as a :class:`SampleBatch`, bit-exact to the dataset's own
        ``get_many``: local ones copied from memory, remote ones from the peers' memory
        (shared segment, one RMA get per owning rank, or the group's exchange: then a
        collective every member calls in step)."""
        if self._closed:
            raise StoreError("the store is closed")
        ids = self.ds.normalize_ids(ids)
        rows = self.ds.rows(ids)
        member = self.layout.member[ids]
        local = self._mine[ids]
        if self._loader is not None and self.transport != "exchange" and \
                not self._loaded_all():
            return self._get_loading(ids, rows, local, member, alloc)
        return self._read(ids, rows, member, local, requests, False,
                          lambda parts, timings: assemble_batch(
                              ids, rows, self.ds.schema, self.ds.layout, parts, alloc,
                              timings=timings))

    def get_views(self, ids: "Sequence[int] | np.ndarray") -> SampleViews:
        """Samples ``ids`` as read-only views of the group's memory (no copy; remote
        records under ``rma`` are fetched into a buffer the views then own).  The
        memory stays mapped while a view of it lives, after :meth:`close` too.  While
        an overlapped preload is still loading, and with the ``exchange`` transport,
        the views are of a copy (``get_many``)."""
        if self._closed:
            raise StoreError("the store is closed")
        if self.transport == "exchange" or (self._loader is not None and
                                             not self._loaded_all()):
            return super().get_views(ids)
        ids = self.ds.normalize_ids(ids)
        rows = self.ds.rows(ids)
        member = self.layout.member[ids]
        return self._read(ids, rows, member, self._mine[ids], None, True,
                          lambda parts, timings: assemble_views(
                              ids, rows, self.ds.schema, self.ds.layout, parts, timings))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i`` as a dict of writable arrays over one copy of its record,
        bit-exact to ``ds[i]``: DDStore's one-sample ``get``, without a batch's objects
        (a record copied from the segment, the chunk or a peer's window with one
        ``MPI_Get``).  Collective, as :meth:`get_many`, with the ``exchange``
        transport."""
        if self._closed:
            raise StoreError("the store is closed")
        j = self.ds.normalize_index(i)
        if self.transport == "exchange" or _trace.active() is not None or (
                self._loader is not None and not self._loaded_all()):
            return super().__getitem__(j)        # the batch path: collective, traced
        mine = bool(self._mine[j])
        self._fetches["local" if mine else "peer"] += 1
        if self._pages is not None:              # the files' pages, locked by their owners
            if not self._mapped:
                self._map_dataset()
            return self.ds.sample(j, copy=True, advise=False)
        if self.transport == "shm":
            return self.ds.sample_from(j, self._segment, int(self._seg_pos[j]))
        if mine:
            return self.ds.sample_from(j, self._buf, int(self.layout.offset[j]))
        t = int(self.layout.member[j])
        stage = np.empty(int(self.ds.record_nbytes[j]), dtype=np.uint8)
        rma_get_one(self._win, stage, t, int(self.layout.offset[j]) + int(self._shift[t]))
        return self.ds.sample_from(j, stage, copy=False)

    def _read(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
              local: np.ndarray, requests: "Optional[list[np.ndarray]]", lend: bool,
              build: Callable[[list, Optional[list]], Any]) -> Any:
        """A batch (``build`` of its parts and timings) once the chunks are loaded."""
        rec = _trace.active()
        parts, t_stage, files = self._memory_parts(ids, rows, member, local, rec,
                                                   requests, lend)
        timings: Optional[list[Any]] = [] if rec is not None else None
        out = build(parts, timings)
        if rec is not None:
            self._trace_memory(rec, ids, rows, member, local, parts, timings, t_stage,
                               files)
        return out

    def _lent(self) -> np.ndarray:
        """The memory batches are viewed in, read-only: the group's segment (shm),
        this rank's chunk otherwise."""
        if self.transport == "shm":
            return self._lender.lend("segment", self._segment, (self._win, self._node_seg))
        return self._lender.lend("chunk", self._buf, self._win)

    def _memory_parts(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                      local: np.ndarray, rec: Any, requests: "Optional[list[np.ndarray]]",
                      lend: bool) -> "tuple[list[Any], float, Optional[np.ndarray]]":
        """Where the records of ``ids`` are (assemble_batch parts), once the chunks are
        loaded: the shared segment, this rank's chunk, records fetched from peers
        (``rma``; ``exchange``: the collective); ``lend``: read-only sources for views.
        Also counts the fetches; returns the parts, the seconds spent fetching, and
        which samples came from the files (an overlapped exchange; else None)."""
        nlocal = local.tolist().count(True) if len(local) <= 16 else \
            int(np.count_nonzero(local))
        self._fetches["local"] += nlocal
        self._fetches["peer"] += len(ids) - nlocal
        t_stage = 0.0
        if self._pages is not None:      # the files' pages, locked by their owners
            if not self._mapped:
                self._map_dataset()
            if self.ds.verify_on_read:
                self.ds.check_records(ids)
            return self.ds.record_parts(ids, rows, advise=np.zeros(len(ids), dtype=bool)), \
                t_stage, None
        if self.transport == "shm":
            src = self._lent() if lend else self._segment
            seg = self._seg_pos[ids]
            if rec is None:  # one gather over the node's segment, local and peers alike
                return [(src, seg, slice(None))], t_stage, None
            # traced: local and peer parts timed apart
            return [(src, seg[m], m) for m in (local, ~local) if m.any()], t_stage, None
        if self.transport == "exchange":
            t0 = time.perf_counter()
            parts, files = self._exchange(ids, rows, member, local, requests)
            if rec is not None:
                t1 = time.perf_counter()
                t_stage = t1 - t0
                rec.span("memstore", "exchange", t0, t1, count=int((~local).sum()),
                         args={"members": self.width})
            return parts, t_stage, files
        mem = self._lent() if lend else self._buf
        offset = self.layout.offset[ids]
        if nlocal == len(ids):
            return [(mem, offset, slice(None))], t_stage, None
        parts = [(mem, offset[local], local)] if nlocal else []
        t0 = time.perf_counter()
        stage, stage_pos, remote = self._staged(ids, rows, member, ~local)
        if rec is not None:
            t1 = time.perf_counter()
            t_stage = t1 - t0
            rec.span("memstore", "get", t0, t1, count=int(remote.sum()), nbytes=len(stage),
                     args={"owners": len(np.unique(member[remote]))})
        if lend:
            stage.flags.writeable = False        # the views own it
        parts.append((stage, stage_pos, remote))
        return parts, t_stage, None

    def _staged(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                sel: np.ndarray) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
        """Peers' records ``ids[sel]`` fetched into a fresh buffer, contiguous and
        grouped by owner (one MPI_Get per owner): an assemble_batch part."""
        # one record (a one-sample read: no numpy reduction either): Python scalars, one get
        one = 0 if len(ids) == 1 else (int(np.argmax(sel)) if np.count_nonzero(sel) == 1
                                       else -1)
        if one >= 0:
            t = int(member[one])
            stage = np.empty(int(rows[one, IndexLayout.REC_LEN]), dtype=np.uint8)
            rma_get_one(self._win, stage, t, int(self.layout.offset[ids[one]]) +
                        int(self._shift[t]))
            return stage, np.zeros(1, dtype=np.int64), sel
        rlen, rmember = rows[sel, IndexLayout.REC_LEN], member[sel]
        order = np.argsort(rmember, kind="stable")
        stage_pos = np.empty(len(rlen), dtype=np.int64)
        stage_pos[order] = np.cumsum(rlen[order]) - rlen[order]
        stage = np.empty(int(rlen.sum()), dtype=np.uint8)
        rma_get(self._win, stage, rmember[order],
                self.layout.offset[ids[sel]][order] + self._shift[rmember[order]],
                rlen[order], stage_pos[order])
        return stage, stage_pos, sel

    def _trace_memory(self, rec: Any, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                      local: np.ndarray, parts: list, timings: Any, t_stage: float,
                      files: Optional[np.ndarray]) -> None:
        """One data/item per sample; a peer part's time includes its MPI_Get; this
        rank's samples an overlapped exchange read from the files (``files``) are PFS
        reads."""
        src = np.where(local, _hooks.SRC["local"], _hooks.SRC["peer"])
        owner = self.group_ranks[member]
        tier: Any = "memory"
        if files is not None and files.any():
            src[files] = _hooks.SRC["pfs"]
            tier = np.where(files, _hooks.TIER["pfs"], _hooks.TIER["memory"])
            owner = np.where(files, -1, owner)
        tagged = [(sel, t0 - (0.0 if local[sel].any() else t_stage), t1, src, tier,
                   owner) for (_, _, sel), (t0, t1) in zip(parts, timings or [])]
        _hooks.record_parts(rec, ids, rows[:, IndexLayout.REC_LEN], tagged)

    def stats(self) -> dict[str, Any]:
        """``fetches_by_source`` (local memory, a peer's memory, and with ``overlap``
        the files, for samples not yet loaded), and ``pfs_reads`` / ``pfs_bytes``: what
        this rank read from the dataset files (its preload, those samples, and over
        the exchange the records of its chunk it sent to peers from the files);
        ``transport``: how peers' memory is read; ``preload_seconds``: from setup to
        this rank's chunk loaded (None while an overlapped load runs);
        ``preload_skipped_bytes``: what the overlapped load did not read because
        batches had read and kept it."""
        # the chunk's reads from the dataset files: all of it, or what the node cache
        # (or the store this one grew from) did not have
        files = self._from_files
        chunk = (int(files.sum()), int(self.ds.record_nbytes[files].sum()))
        if self.cache is not None:      # (and a chunk past its cap: read again)
            chunk = (self.cache.misses + (0 if self._chunk_cached else chunk[0]),
                     self.cache.miss_bytes + (0 if self._chunk_cached else chunk[1]))
        return {"fetches_by_source": {k: v for k, v in self._fetches.items()
                                      if v or k != "pfs"},
                "pfs_reads": chunk[0] + self._fetches["pfs"] + self._served_from_files[0],
                "pfs_bytes": chunk[1] + self._file_bytes + self._served_from_files[1],
                "preload_seconds": self.preload_seconds, "transport": self.transport,
                "overlap": self.overlap, "preload_skipped_bytes": self._kept_skipped,
                **(self.cache.stats() if self.cache is not None else {})}

    def abandon(self) -> None:
        self._stop_loading()
        if self.comm is None:
            self.close()
        self._closed = True

    def close(self) -> None:
        """Release the window (collective over the replica group)."""
        if self._closed:
            return
        self._closed = True
        self._stop_loading()         # nothing writes the memory once it is released
        if self._pages is not None:
            self._pages.close()      # unlocked (the page cache may keep them)
        lent = self._lender.release()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._win is not None:
            self._segment = None
            self._buf = self._raw = np.zeros(0, dtype=np.uint8)
            free_window(self._win, self.group_comm, lent)
            self._win = None
        if self._node_seg is not None:
            if self.group_comm is not None:
                self.group_comm.Barrier()    # nobody reads our chunk any more
            self._segment = None
            self._buf = self._raw = np.zeros(0, dtype=np.uint8)
            self._node_seg.close()
            self._node_seg = None
        if self.group_comm is not None:
            self.group_comm.Free()
            self.group_comm = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def __repr__(self) -> str:
        return (f"DistributedStore({self.ds.path}, rank={self.rank}/{self.world}, "
                f"width={self.width}, replicas={self.replicas}, transport={self.transport}, "
                f"holds={self.nbytes} B)")
