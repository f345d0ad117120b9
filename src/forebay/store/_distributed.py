"""DDStore-style distributed in-memory store: node shared memory, MPI one-sided RMA,
or a collective exchange.

Ranks form replica groups of ``width`` consecutive ranks; each group holds one full
replica of the dataset, striped over its members in contiguous chunks balanced by
bytes.  Every rank computes, from the dataset index alone, which member owns any
sample and at which byte offset of that member's memory it lies: no registry, no
lookup traffic.  Transports: ``shm`` (the group on one node: one shared segment, a
batch is one gather), ``rma`` (MPI: one ``MPI_Get`` per owner, an hindexed datatype
covering all of that owner's records, inside one passive-target access epoch opened at
setup) and ``exchange`` (any communicator, torch.distributed included: each batch is
one collective in which every member sends the records the others asked for).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..dataset import (PackedDataset, PinnedPages, SampleBatch, SampleViews, can_lock,
                       open_dataset)
from ..dataset import ALIGNMENT, IndexLayout, assemble_batch, assemble_views, gather_ranges
from ..errors import (ChecksumError, InvalidArgumentError, RankMismatchError,
                      TruncatedShardError)
from ..progress import Progress, TqdmProgress, as_progress
from ..comm import (SHM_DIR, NodeSegment, all_true, allgather_array, alltoall_bytes,
                    fence, is_mpi, mpi_thread_multiple, node_ranks, ordered_shared_memory,
                    shm_usable)
from .._fs import network_fs
from ..vocab import Backoff
from ..world import abort_on_uncaught, resolve_comm
from ._base import Lender, SampleStore, StoreError, raise_background_error
from ._memory import MEMORY_HEADROOM, available_memory
from .. import trace as _trace
from . import _tracing as _hooks

if TYPE_CHECKING:
    from ._arrays import ArrayStore

__all__ = ["DistributedStore", "StoreLayout", "default_comm", "StoreError", "agree",
           "check_agreement", "node_size"]

#: preload reads: pieces of this size, several in flight (the device works on a queue)
_PAR_BLOCK = 16 << 20

#: bytes before each member's chunk: int64 bytes loaded (a prefix of the chunk), int64
#: state, int64 until when (CLOCK_MONOTONIC ns; max: now) the member's batches read the
#: files, int64 bytes they have read from the files, and from byte 64 the error of a
#: failed background preload (UTF-8); then (overlap) one byte per sample of the chunk,
#: 1 once a batch that read it from the files has copied it into the chunk
_HEADER = 512
#: the header's int64 words
_H_LOADED, _H_STATE, _H_READING, _H_READ_BYTES = 0, 1, 2, 3
_LOADING, _LOADED, _FAILED = 0, 1, 2       # _H_STATE (_LOADING: zeroed header)
_READING = np.iinfo(np.int64).max
#: MPI windows closed while a view (get_views) still held their memory: never freed
_LENT_WINDOWS: list[Any] = []
#: a background preload that yields to batches waits until none has read the files for
#: this long; it reads pieces of _YIELD_BLOCK then (a short queue ahead of a batch)
_QUIET_NS = 10_000_000
_YIELD_BLOCK = 4 << 20


def read_parallel(fd: int, dst: np.ndarray, offset: int, path: Any, prog: Progress,
                  threads: int, on_piece: Optional[Callable[[int, int], None]] = None,
                  stop: Optional[threading.Event] = None,
                  wait_turn: Optional[Callable[[int, int], bool]] = None,
                  block: int = _PAR_BLOCK) -> None:
    """Read ``len(dst)`` bytes of file ``fd`` from ``offset`` into ``dst``: pieces of
    16 MiB by ``threads`` threads at once (``preadv`` releases the GIL), so the device
    has several requests in flight rather than one sequential stream.  The other
    arguments: :func:`in_pieces`."""
    def read(a: int, k: int) -> None:
        done = 0
        while done < k:
            got = os.preadv(fd, [dst[a + done:a + k].data], offset + a + done)
            if got <= 0:
                raise StoreError(f"{path}: unexpected end of file at byte "
                                 f"{offset + a + done} while preloading")
            done += got

    in_pieces(len(dst), read, prog, threads, on_piece, stop, wait_turn, block)


def in_pieces(n: int, read: Callable[[int, int], None], prog: Progress, threads: int,
              on_piece: Optional[Callable[[int, int], None]] = None,
              stop: Optional[threading.Event] = None,
              wait_turn: Optional[Callable[[int, int], bool]] = None,
              block: int = _PAR_BLOCK) -> None:
    """Bytes ``[0, n)`` of something read by ``read(a, k)`` (bytes ``[a, a + k)``;
    a call that releases the GIL) in pieces of ``block`` bytes, ``threads`` at once.
    ``on_piece(a, b)``: called in order as bytes ``[0, b)`` have all arrived (``a``:
    the previous call's ``b``); ``stop``: set, no further piece is started;
    ``wait_turn(a, bytes)``: called before the piece at ``a`` is queued (it may block;
    True: the piece is there already, skip reading it)."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def piece(a: int) -> None:
        k = min(block, n - a)
        read(a, k)
        with lock:
            prog.update(k)

    def landed(a: int) -> None:
        if on_piece is not None:
            on_piece(a, min(a + block, n))

    def there(a: int) -> bool:
        return wait_turn is not None and wait_turn(a, min(block, n - a))

    starts = range(0, n, block)
    if threads <= 1 or n <= block:
        for a in starts:
            skip = there(a)
            if stop is not None and stop.is_set():
                return
            if not skip:
                piece(a)
            landed(a)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="forebay-preload") as ex:
        flight: deque = deque()
        for a in starts:
            skip = there(a)
            if stop is not None and stop.is_set():
                break
            flight.append((a, None if skip else ex.submit(piece, a)))
            if len(flight) >= (threads if wait_turn else 2 * threads):  # a short queue
                a0, f = flight.popleft()
                if f is not None:
                    f.result()
                landed(a0)
        while flight:
            a0, f = flight.popleft()
            if f is not None:
                f.result()
            landed(a0)


def default_comm() -> Any:
    """The communicator of the job (:func:`forebay.world.resolve_comm`): MPI's
    COMM_WORLD under an MPI launcher (or once mpi4py is initialised), else None (one
    process).  A launcher reporting ranks MPI cannot see raises
    :class:`~forebay.errors.LaunchError`."""
    return resolve_comm(None)


def _align(n: np.ndarray | int) -> Any:
    return n + (-n) % ALIGNMENT


def chunk_members(span: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous chunks of samples balanced by bytes: member p of a replica group holds
    samples ``[bounds[p], bounds[p+1])``.  Returns ``(bounds, member of each sample)``.
    Shared by the store and the simulator (forebay-preload)."""
    n = len(span)
    cum = np.concatenate([[0], np.cumsum(span)])
    targets = cum[-1] * np.arange(width + 1) / width
    bounds = np.searchsorted(cum, targets, side="left").astype(np.int64)
    bounds[0], bounds[-1] = 0, n
    bounds = np.maximum.accumulate(bounds)
    member = (np.searchsorted(bounds, np.arange(n), side="right") - 1).astype(np.int64)
    return bounds, member


class StoreLayout:
    """Where every record lives: chunk (group member) and byte offset in its buffer.

    Computed identically on every rank from the dataset index and ``width``.  Records
    keep their 64-byte alignment: the bytes of each run of consecutive samples of one
    shard are copied verbatim (padding included), runs placed at aligned offsets.
    """

    def __init__(self, ds: PackedDataset, width: int) -> None:
        idx = ds.index
        n = len(ds)
        rec_off = idx[:, IndexLayout.REC_OFF]
        rec_len = idx[:, IndexLayout.REC_LEN]
        shard = ds.shard_of.astype(np.int64)
        span = _align(rec_len)
        self.width = width
        self.bounds, self.member = chunk_members(span, width)
        # runs: consecutive samples with the same (member, shard)
        change = np.ones(n, dtype=bool)
        if n > 1:
            change[1:] = (self.member[1:] != self.member[:-1]) | (shard[1:] != shard[:-1])
        run_first = np.flatnonzero(change)
        run_last = np.append(run_first[1:], n) - 1
        run_of = np.cumsum(change) - 1
        run_start = rec_off[run_first]
        run_len = rec_off[run_last] + rec_len[run_last] - run_start
        run_member = self.member[run_first]
        run_span = _align(run_len)
        # base of each run within its member's buffer: exclusive cumsum per member
        base = np.cumsum(run_span) - run_span
        first_run_of_member = np.searchsorted(run_member, run_member, side="left")
        run_base = base - base[first_run_of_member]
        #: byte offset of each record in its owner's buffer
        self.offset = run_base[run_of] + rec_off - run_start[run_of]
        self.nbytes = np.bincount(run_member, weights=run_span, minlength=width).astype(np.int64)
        self.runs = {"member": run_member, "shard": shard[run_first], "start": run_start,
                     "len": run_len, "base": run_base, "count": run_last - run_first + 1}


def agree(comm: Any, message: Optional[str], error: type[Exception] = StoreError) -> None:
    """Raise ``error`` on every rank if any rank has a message: a check that fails on
    one rank fails on all (no rank is left waiting in a collective)."""
    msgs = comm.allgather(message) if comm is not None else [message]
    bad = [(r, m) for r, m in enumerate(msgs) if m]
    if bad:
        text = "; ".join(f"rank {r}: {m}" if comm is not None else m for r, m in bad[:4])
        raise error(text + (f" (+{len(bad) - 4} more ranks)" if len(bad) > 4 else ""))


def _rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [-1]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def overlap_by_default(path: "str | os.PathLike[str]", on_pfs_read: Any = None,
                       mounts: Optional[str] = None) -> bool:
    """What ``overlap="auto"`` picks on this rank for a dataset at ``path``: True on a
    network file system (:func:`forebay._fs.network_fs`, from ``/proc/mounts`` or the
    table ``mounts``) or an emulated one (an ``on_pfs_read`` hook)."""
    return on_pfs_read is not None or network_fs(os.fspath(path), mounts) is not None


def check_agreement(comm: Any, what: str, ds: PackedDataset, params: dict[str, Any]) -> None:
    """Every rank of ``comm`` opened the same dataset (manifest fingerprint and size;
    else :class:`StoreError`) and passed the same ``params`` (everything that shapes the
    plan and the layout; else :class:`RankMismatchError`), raised on every rank naming
    each difference and each rank's value.  One allgather, the first collective of a
    set-up, so ranks that disagree fail before they wait in different collectives."""
    if comm is None:
        return
    from .._version import __version__

    mine = {"forebay version": __version__, **params}
    every = comm.allgather(((ds.fingerprint, len(ds), str(ds.path)), mine))
    sets = [d for d, _ in every]
    if len({(fp, n) for fp, n, _ in sets}) > 1:
        ref = sets[0]
        diff = [f"rank {r} has {p} ({n} samples, fingerprint {fp})"
                for r, (fp, n, p) in enumerate(sets) if (fp, n) != ref[:2]]
        raise StoreError(f"ranks opened different datasets: rank 0 has {ref[2]} "
                         f"({ref[1]} samples, fingerprint {ref[0]}); " + "; ".join(diff[:4]))
    raise_mismatches(what, [p for _, p in every])


def raise_mismatches(what: str, every: "list[dict[str, Any]]") -> None:
    """Raise :class:`RankMismatchError` naming each key of the ranks' dicts ``every``
    (one per rank, in rank order) whose values differ, and each rank's value."""
    diffs = []
    keys = list(dict.fromkeys(k for p in every for k in p))
    for key in keys:
        values = [p.get(key) for p in every]
        if len({repr(v) for v in values}) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            diffs.append(f"{key} " + ", ".join(
                f"{v} on rank{'s' if len(rs) > 1 else ''} {_rank_list(rs)}"
                for v, rs in list(by_value.items())[:4]))
    if diffs:
        raise RankMismatchError(f"ranks disagree on the {what}: " + "; ".join(diffs) +
                                " (every rank must pass the same values)")


def node_size(comm: Any) -> int:
    """Ranks of ``comm`` on this rank's node (1 without a communicator)."""
    return len(node_ranks(comm))


TRANSPORTS = ("auto", "pages", "shm", "rma", "exchange")


def shared_segment(win: Any, comm: Any) -> "Optional[tuple[np.ndarray, np.ndarray]]":
    """View a shared-memory window's whole segment in this process.

    MPI_Win_allocate_shared places the ranks' memory contiguously by default, so one
    uint8 view spans all of it and every byte of every rank has one position in it (a
    batch is then a single gather, whoever owns its samples).  Returns the view and
    where each rank's memory starts in it, or None (on every rank) if some rank's
    memory is not contiguous with the next.  Collective over ``comm``."""
    import ctypes

    from mpi4py import MPI

    bufs = [np.frombuffer(win.Shared_query(m)[0], dtype=np.uint8)
            for m in range(comm.Get_size())]
    addrs = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
    ok = all(addrs[m + 1] == addrs[m] + len(bufs[m]) for m in range(len(bufs) - 1))
    if not comm.allreduce(ok, op=MPI.LAND):
        return None
    total = int(addrs[-1] + len(bufs[-1]) - addrs[0])
    view = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(int(addrs[0])))
    return view, addrs - addrs[0]


def _mask(n: int, where: np.ndarray) -> np.ndarray:
    """A boolean mask of length ``n``, True at positions ``where``."""
    m = np.zeros(n, dtype=bool)
    m[where] = True
    return m


def free_window(win: Any, comm: Any, lent: bool) -> None:
    """End the access epoch and free window ``win`` (collective over ``comm``) unless
    some rank's views still hold its memory (``lent`` on any rank): Free would unmap
    it under them, so the window then stays until MPI_Finalize."""
    from mpi4py import MPI

    win.Unlock_all()
    if comm.allreduce(bool(lent), op=MPI.LOR):
        _LENT_WINDOWS.append(win)
    else:
        win.Free()


_MPI_BYTE: list[Any] = []     # MPI.BYTE, once mpi4py is imported (a one-sample get's cost)


def rma_get_one(win: Any, stage: np.ndarray, target: int, disp: int) -> None:
    """Fetch ``len(stage)`` bytes at ``disp`` of rank ``target``'s window into ``stage``:
    one ``MPI_Get`` and a flush of that target."""
    if not _MPI_BYTE:
        from mpi4py import MPI

        _MPI_BYTE.append(MPI.BYTE)
    nbytes, byte = len(stage), _MPI_BYTE[0]
    if nbytes:
        win.Get([stage, nbytes, byte], target, (disp, nbytes, byte))
        win.Flush(target)


def rma_get(win: Any, stage: np.ndarray, target: np.ndarray, disp: np.ndarray,
            length: np.ndarray, pos: np.ndarray) -> None:
    """Fetch byte ranges of other ranks' windows into ``stage`` with one ``MPI_Get`` per
    target rank (an hindexed datatype covering all its ranges) and one flush.

    ``target``, ``disp``, ``length``, ``pos``: per range, sorted by target: the rank,
    the displacement in its window, the byte count and where it goes in ``stage``
    (each target's ranges are contiguous in ``stage``, in order)."""
    from mpi4py import MPI

    if len(target) == 1:        # one range (a single-sample read): no grouping, no type
        p0, nbytes = int(pos[0]), int(length[0])
        rma_get_one(win, stage[p0:p0 + nbytes], int(target[0]), int(disp[0]))
        return
    owners, first = np.unique(target, return_index=True)
    ends = np.append(first[1:], len(target))
    types = []
    try:
        for t, a, b in zip(owners.tolist(), first.tolist(), ends.tolist()):
            nbytes = int(length[a:b].sum())
            if nbytes == 0:
                continue
            p0 = int(pos[a])
            if b - a == 1:      # one range: a contiguous get, no datatype to build
                win.Get([stage[p0:p0 + nbytes], nbytes, MPI.BYTE], t,
                        (int(disp[a]), nbytes, MPI.BYTE))
                continue
            dtype = MPI.BYTE.Create_hindexed(length[a:b].tolist(), disp[a:b].tolist()).Commit()
            types.append(dtype)
            win.Get([stage[p0:p0 + nbytes], nbytes, MPI.BYTE], t, [0, 1, dtype])
        win.Flush_all()
    finally:
        for dtype in types:
            dtype.Free()


class DistributedStore(SampleStore):
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
                 read_threads: int = 4, overlap: "bool | str" = False) -> None:
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)   # a rank that raises ends the job, not a hang
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
        check_agreement(self.comm, "DistributedStore's arguments", self.ds, {
            "width": width, "node_aware": node_aware, "transport": transport,
            "verify_on_read": self.ds.verify_on_read, "overlap": overlap})
        if overlap == "auto":   # any rank's files on a network file system: all overlap
            overlap = not all_true(self.comm, not overlap_by_default(self.ds.path,
                                                                    on_pfs_read))
        self._setup_groups(width, node_aware)
        self.layout = StoreLayout(self.ds, self.width)
        self._mine = self.layout.member == self.member     # which samples this member holds
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
        self._allocate(bool(overlap))
        if self.transport == "shm":
            self._map_peers()        # may find the MPI's layout unusable: then rma
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

    @staticmethod
    def from_arrays(arrays: "Mapping[str, np.ndarray]", comm: Any = None, *,
                    transport: str = "auto", mutable: bool = False) -> "ArrayStore":
        """A store of named arrays from memory, no dataset and no ingest (DDStore's
        ``add``): every rank passes the rows it has of each variable (same names,
        dtypes and row shapes on every rank; row counts may differ), and any rank reads
        any global row.  Collective.  See :class:`~forebay.store.ArrayStore`."""
        from ._arrays import ArrayStore

        return ArrayStore(arrays, comm, transport=transport, mutable=mutable)

    # -- setup ------------------------------------------------------------------------
    def _setup_groups(self, width: Optional[int], node_aware: bool) -> None:
        if self.comm is None:
            if width not in (None, 1):
                raise StoreError(f"width={width} needs MPI; without it the world is 1 rank")
            self.width, self.group, self.member = 1, 0, 0
            self.group_comm: Any = None
            self.group_ranks = np.zeros(1, dtype=np.int64)
            return
        if node_aware:
            if width is not None:
                raise StoreError("give either width or node_aware, not both")
            node = node_ranks(self.comm)
            every = self.comm.allgather([len(node), node[0]])
            sizes = sorted({n for n, _ in every})
            if len(sizes) != 1:
                raise StoreError(f"node_aware needs the same number of ranks on every node, "
                                 f"got {sizes}")
            self.width = sizes[0]
            self.group = sorted({first for _, first in every}).index(node[0])
            self.group_comm = self.comm.Split(color=self.group, key=self.rank)
        else:
            w = self.world if width is None else int(width)
            if w <= 0 or self.world % w:
                raise StoreError(f"width {width} must divide the world size {self.world} "
                                 f"(replicas = world / width)")
            self.width = w
            self.group = self.rank // w
            self.group_comm = self.comm.Split(color=self.group, key=self.rank)
        self.member = self.group_comm.Get_rank()
        #: world rank of each member of this rank's group
        self.group_ranks = np.array(self.group_comm.allgather(self.rank), dtype=np.int64)

    def _choose_transport(self, asked: str, on_pfs_read: Any, overlap: bool) -> str:
        single = self.group_comm is None or self.width == 1
        mpi = is_mpi(self.comm)
        one_node = single or node_size(self.group_comm) == self.width
        everywhere = all_true(self.comm, one_node)
        if asked in ("auto", "pages"):
            why = self._why_not_pages(asked, everywhere, on_pfs_read, overlap and not single)
            if asked == "pages":
                agree(self.comm, f"transport='pages' is not possible here: {why}"
                      if why else None)
                return "pages"
            if all_true(self.comm, why is None):
                return "pages"
        if single:
            return "local"
        if everywhere and not mpi and not shm_usable(self.comm):
            if asked == "shm":
                raise StoreError(f"transport='shm' under torch.distributed needs a writable "
                                 f"{SHM_DIR} on every rank; use transport='exchange'")
            everywhere = False
        if asked == "shm" and not everywhere:
            raise StoreError("transport='shm' needs every replica group on one node; use "
                             "node_aware=True or a width that fits a node, or transport="
                             + ("'rma' or 'exchange'" if mpi else "'exchange'"))
        if asked == "rma" and not mpi:
            raise StoreError("transport='rma' needs MPI (one-sided gets); this job's "
                             "communicator is torch.distributed: use 'shm' within a node "
                             "or 'exchange'")
        if asked == "auto":
            return "shm" if everywhere else ("rma" if mpi else "exchange")
        return asked

    def _why_not_pages(self, asked: str, everywhere: bool, on_pfs_read: Any,
                       headers: bool) -> Optional[str]:
        """Why this rank cannot hold its chunk in the page cache (None: it can).
        ``everywhere``: every replica group is on one node; ``headers``: the members
        share load counters in a node segment (an overlapped load).  Collective."""
        shared = shm_usable(self.comm) and ordered_shared_memory() if headers else True
        if not everywhere:
            return "a replica group spans nodes (a page cache is one node's)"
        if not shared:
            return (f"an overlapped load shares its progress in {SHM_DIR}, which is not "
                    f"writable on every rank")
        shards = self.ds.manifest.shards
        mine = np.unique(self.ds.shard_of[self._mine]).tolist()
        locked = sum(int(shards[k].data_nbytes) for k in mine)  # RLIMIT_MEMLOCK: maps whole
        if not can_lock(locked):
            return (f"this process may not lock {locked} bytes in memory (the shards of "
                    f"its chunk: RLIMIT_MEMLOCK, `ulimit -l`), or forebay's C kernel is "
                    f"not built")
        fs = network_fs(self.ds.path)
        if asked == "auto" and fs is not None:
            return f"{self.ds.path} is on {fs}, whose client may drop cached pages itself"
        if asked == "auto" and on_pfs_read is not None:
            return "on_pfs_read is given (an emulated file system)"
        return None

    @property
    def replicas(self) -> int:
        return self.world // self.width

    def _check_memory(self) -> None:
        need = int(self.layout.nbytes[self.member]) + ALIGNMENT
        avail = available_memory()
        if self.comm is None:
            node_need = need
        else:
            node = node_ranks(self.comm)
            every = self.comm.allgather([need, -1 if avail is None else int(avail)])
            node_need = sum(every[r][0] for r in node)
            if self.transport == "pages":    # replicas on one node share the pages
                node_need = min(node_need, int(self.layout.nbytes.sum()) + ALIGNMENT)
            least = min(every[r][1] for r in node)
            avail = None if least < 0 else least
        gib = 2.0 ** 30
        msg = None
        if avail is not None and node_need > MEMORY_HEADROOM * avail:
            msg = (f"the store needs {node_need / gib:.2f} GiB on this node ({need / gib:.2f} "
                   f"GiB for this rank's chunk of {self.ds.nbytes / gib:.2f} GiB x "
                   f"{self.replicas} replicas over {self.world} ranks) but "
                   f"{avail / gib:.2f} GiB is available ({MEMORY_HEADROOM:.0%} may be used); "
                   f"use a larger width (fewer replicas) or more nodes")
        agree(self.comm, msg)

    def _allocate(self, overlap: bool) -> None:
        if self.transport == "pages":
            self._allocate_pages(overlap)
            return
        head = self._head_bytes(overlap)
        size = int(self.layout.nbytes[self.member]) + ALIGNMENT + head
        if self.transport in ("local", "exchange"):
            raw = np.empty(size, dtype=np.uint8)
        elif not is_mpi(self.comm):       # shm under torch.distributed
            self._node_seg = NodeSegment(self.group_comm, size)
            raw = self._node_seg.region()
        else:
            from mpi4py import MPI

            if self.transport == "shm":
                self._win = MPI.Win.Allocate_shared(size, 1, comm=self.group_comm)
            else:
                self._win = MPI.Win.Allocate(size, 1, comm=self.group_comm)
            raw = np.frombuffer(self._win.tomemory(), dtype=np.uint8)
        # the header, then the chunk at the next aligned address
        shift = head + (-(raw.ctypes.data + head)) % ALIGNMENT
        raw[:head] = 0
        self._raw = raw
        self._hdr = raw[:32].view(np.int64)          # this member's header words
        self._buf = raw[shift:shift + int(self.layout.nbytes[self.member])]
        self._shift = np.array(self.group_comm.allgather(shift)
                               if self.group_comm is not None else [shift], dtype=np.int64)

    def _head_bytes(self, overlap: bool) -> int:
        """Bytes of this member's header: the words, then (overlap) a kept flag per
        sample of its chunk."""
        b = self.layout.bounds
        return _HEADER + (int(_align(b[self.member + 1] - b[self.member])) if overlap else 0)

    def _allocate_pages(self, overlap: bool) -> None:
        """Transport "pages": no memory of the store's own (the chunk is held in the
        files' pages); with ``overlap`` the members' headers (how far each load has
        got) in one node segment, else this rank's header alone."""
        self._pages = PinnedPages(self.ds)
        head = self._head_bytes(overlap)
        if overlap and self.group_comm is not None and self.width > 1:
            self._node_seg = NodeSegment(self.group_comm, head)
            self._segment, self._seg_hdr = self._node_seg.view, self._node_seg.starts
            raw = self._node_seg.region()
            raw[:] = 0
        else:
            raw = np.zeros(head, dtype=np.uint8)
        self._raw = raw
        self._hdr = raw[:32].view(np.int64)
        self._buf = np.zeros(0, dtype=np.uint8)
        self._shift = np.zeros(self.width, dtype=np.int64)

    def _map_peers(self) -> None:
        """shm transport: one view of the group's shared segment (see
        :func:`shared_segment`); an MPI that lays members out otherwise gets MPI_Get on
        the same window (transport "rma")."""
        if self._node_seg is not None:
            mapped: Any = (self._node_seg.view, self._node_seg.starts)
        else:
            mapped = shared_segment(self._win, self.group_comm)
        if mapped is None:
            self.transport = "rma"
            return
        self._segment, starts = mapped
        self._seg_hdr = starts       # each member's header
        seg_off = starts + self._shift
        self._seg_pos = seg_off[self.layout.member] + self.layout.offset

    def _preload(self, prog: Progress) -> None:
        """Read this rank's chunk with large sequential reads from the shards (into its
        memory, or the page cache, locked there).  A read that fails on one rank fails
        the set-up on every rank (the others do not wait for it)."""
        runs = self.layout.runs
        mine = np.flatnonzero(runs["member"] == self.member)
        total = int(runs["len"][mine].sum())
        prog.start(total, desc=f"preload (rank {self.rank})", unit="B")
        err: Optional[Exception] = None
        try:
            if self._pages is not None:
                self._pin_runs(mine, prog)
            else:
                self._read_runs(mine, prog)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            err = e
        finally:
            prog.close()
        failed = self._failure(err, "preload")
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock_all(MPI.MODE_NOCHECK)   # (close() ends it, failed or not)
            self._win.Sync()  # our stores are visible before peers read them
        if failed is not None:
            raise failed
        if self.group_comm is not None:
            self.group_comm.Barrier()
        if self._win is not None:
            self._win.Sync()
        if self._pages is not None:
            self._map_dataset()

    def _failure(self, err: Optional[Exception], what: str) -> Optional[Exception]:
        """What every rank raises when ``err`` (this rank's) or another rank's error
        ended ``what``: its own error on the rank it happened on, else an error of the
        same kind naming the rank and the cause; None when no rank failed.
        Collective."""
        mine = None if err is None else [type(err).__name__, str(err)]
        every = self.comm.allgather(mine) if self.comm is not None else [mine]
        bad = [(r, m) for r, m in enumerate(every) if m]
        if not bad:
            return None
        if err is not None:
            return err
        r, (kind, msg) = bad[0]
        cls = {"TruncatedShardError": TruncatedShardError,
               "ChecksumError": ChecksumError}.get(kind, StoreError)
        return cls(f"rank {r}'s {what} failed: {kind}: {msg}")

    def _read_runs(self, mine: np.ndarray, prog: Progress) -> None:
        """Read this rank's runs ``mine`` into its chunk's memory."""
        runs = self.layout.runs
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock(self.member, MPI.LOCK_EXCLUSIVE)
        try:
            for shard in np.unique(runs["shard"][mine]).tolist():
                path = self.ds.path / self.ds.manifest.shards[shard].data
                fd = os.open(path, os.O_RDONLY)
                try:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for k in mine[runs["shard"][mine] == shard].tolist():
                        start, length, base = (int(runs["start"][k]), int(runs["len"][k]),
                                               int(runs["base"][k]))
                        t0 = time.perf_counter()
                        read_parallel(fd, self._buf[base:base + length], start, path, prog,
                                      self.read_threads)
                        self._report_read(shard, start, length, int(runs["count"][k]),
                                          t0, time.perf_counter())
                finally:
                    os.close(fd)
        finally:
            if self._win is not None:
                self._win.Unlock(self.member)

    def _pin_runs(self, mine: np.ndarray, prog: Progress) -> None:
        """Transport "pages": read this rank's runs ``mine`` into the page cache and lock
        them there (pieces of 16 MiB, ``read_threads`` at once).  Once every member has,
        :meth:`_map_dataset` maps the whole dataset into this process (cached and
        locked by then: a page-table walk, no I/O), so that no batch faults."""
        runs = self.layout.runs
        for k in mine.tolist():
            shard, start, length = (int(runs["shard"][k]), int(runs["start"][k]),
                                    int(runs["len"][k]))
            t0 = time.perf_counter()
            in_pieces(length, partial(self._pin_piece, shard, start), prog, self.read_threads)
            self._report_read(shard, start, length, int(runs["count"][k]), t0,
                              time.perf_counter())

    def _pin_piece(self, shard: int, start: int, a: int, k: int) -> None:
        assert self._pages is not None
        self._pages.pin_range(shard, start + a, start + a + k)

    def _map_dataset(self) -> None:
        """Map every record into this process's maps of the shards (transport "pages",
        once the group's chunks are all locked in the page cache)."""
        with self._map_lock:
            if self._mapped:
                return
            every = np.arange(len(self.ds))
            self.ds.record_parts(every, self.ds.index, populate=True,
                                 advise=np.zeros(len(every), dtype=bool))
            self._mapped = True

    def _report_read(self, shard: int, start: int, length: int, count: int, t0: float,
                     t1: float) -> None:
        """A preload read of ``length`` bytes from ``start`` of ``shard`` (``count``
        samples), to on_pfs_read and the trace."""
        if self.on_pfs_read is not None:
            self.on_pfs_read(length, count, t1 - t0)
        rec = _trace.active()
        if rec is not None:
            path = self.ds.path / self.ds.manifest.shards[shard].data
            rec.file_reads(path, np.array([start]), np.array([length]), np.array([t0]),
                           np.array([t1 - t0]), samples=count)
            rec.span("memstore", "preload", t0, t1, count=count, nbytes=length)

    # -- background preload (overlap) ---------------------------------------------------
    def _header(self, member: int) -> np.ndarray:
        """Member ``member``'s header (uint8): its own memory, the shared segment, or
        (rma) fetched from the member's window."""
        if member == self.member:
            return self._raw[:_HEADER]
        if self.transport == "rma":
            out = np.zeros(_HEADER, dtype=np.uint8)
            rma_get(self._win, out, np.array([member]), np.zeros(1, dtype=np.int64),
                    np.array([_HEADER]), np.zeros(1, dtype=np.int64))
            return out
        at = int(self._seg_hdr[member])
        return self._segment[at:at + _HEADER]

    def _word(self, member: int, k: int) -> int:
        """Int64 word ``k`` (_H_*) of member ``member``'s header."""
        if self.transport == "rma" and member != self.member:
            from mpi4py import MPI

            out = np.zeros(1, dtype=np.int64)
            self._win.Fetch_and_op([np.zeros(1, dtype=np.int64), MPI.INT64_T],
                                   [out, MPI.INT64_T], member, 8 * k, MPI.NO_OP)
            self._win.Flush(member)
            self._win.Sync()   # later loads of the member's data see what preceded it
            return int(out[0])
        return int(self._header(member)[8 * k:8 * k + 8].view(np.int64)[0])

    def _start_load(self) -> None:
        """Open the memory to readers (every header says 'nothing loaded'), then load
        this rank's chunk in a thread; readers go to the files for what is missing."""
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock_all(MPI.MODE_NOCHECK)
            self._win.Sync()
        fence()
        if self.group_comm is not None:
            self.group_comm.Barrier()    # no member reads a header before it is zeroed
        self._known = np.zeros(self.width, dtype=np.int64)
        self._loader = threading.Thread(target=self._load_loop, daemon=True,
                                        name=f"forebay-preload-r{self.rank}")
        self._loader.start()

    def _load_loop(self) -> None:
        state = _LOADED
        try:
            self._load_chunk()
            if self._stop.is_set():
                return                   # closed: nobody reads this memory any more
            self._publish(int(self.layout.nbytes[self.member]))
        except BaseException as e:       # every member's next get_many raises it
            self._load_error = e
            state = _FAILED
            msg = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:_HEADER - 65]
            self._raw[64:64 + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
        self._set_word(_H_STATE, state)
        self.preload_seconds = time.perf_counter() - self._t0
        if state == _LOADED and self._pages is not None:
            threading.Thread(target=self._map_when_loaded, daemon=True,
                             name=f"forebay-map-r{self.rank}").start()

    def _map_when_loaded(self) -> None:
        """Transport "pages" with an overlapped load: once every member's chunk is
        locked, map the whole dataset into this process here, in the background,
        rather than in the first batch that finds them all loaded (a failed or
        stopped load leaves it to that batch, which raises)."""
        poll = Backoff(first=0.001, cap=0.02)
        while not self._stop.is_set():
            states = [self._word(m, _H_STATE) for m in range(self.width)]
            if _FAILED in states:
                return
            if _LOADING not in states:
                try:
                    self._map_dataset()
                except Exception:  # noqa: BLE001 - a batch maps (and raises) itself
                    pass
                return
            poll.sleep()

    def _publish(self, nbytes: int) -> None:
        """Announce that bytes ``[0, nbytes)`` of this rank's chunk are loaded (and
        checked): the data is visible before the counter that announces it."""
        self._set_word(_H_LOADED, nbytes)

    def _set_word(self, k: int, value: int) -> None:
        """Set this member's header word ``k`` after everything written before it is
        visible (rma: MPI_Win_sync, then an atomic replace readers fetch atomically)."""
        if self.transport != "rma":
            fence()
            self._hdr[k] = value
            return
        from mpi4py import MPI

        self._win.Sync()
        self._win.Accumulate([np.array([value], dtype=np.int64), MPI.INT64_T], self.member,
                             [8 * k, 1, MPI.INT64_T], MPI.REPLACE)
        self._win.Flush(self.member)

    def _load_chunk(self) -> None:
        """Read this rank's chunk in order (pieces of 16 MiB, or 4 MiB when yielding;
        ``read_threads`` in flight), checking the records each piece completes
        (``verify_on_read``) before announcing them."""
        runs = self.layout.runs
        mine = np.flatnonzero(self._mine)
        ends = self.layout.offset[mine] + self.ds.record_nbytes[mine]
        order = np.argsort(ends, kind="stable")
        mine, ends = mine[order], ends[order]
        done = {"checked": 0, "t": 0.0}  # records of ``mine`` announced; piece start
        for k in np.flatnonzero(runs["member"] == self.member).tolist():
            shard, start, length, base = (int(runs["shard"][k]), int(runs["start"][k]),
                                          int(runs["len"][k]), int(runs["base"][k]))
            path = self.ds.path / self.ds.manifest.shards[shard].data
            along = dict(stop=self._stop,
                         on_piece=partial(self._landed, mine, ends, done, path, start, base),
                         wait_turn=partial(self._wait_turn, shard, start, base, mine, ends)
                         if self.yields else None,
                         block=_YIELD_BLOCK if self.yields else _PAR_BLOCK)
            done["t"] = time.perf_counter()
            if self._pages is not None:
                in_pieces(length, partial(self._pin_piece, shard, start), Progress(),
                          self.read_threads, **along)   # type: ignore[arg-type]
            else:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, start, length, os.POSIX_FADV_SEQUENTIAL)
                    read_parallel(fd, self._buf[base:base + length], start, path,
                                  Progress(), self.read_threads,
                                  **along)   # type: ignore[arg-type]
                finally:
                    os.close(fd)
            if self._stop.is_set():
                return

    def _landed(self, mine: np.ndarray, ends: np.ndarray, done: dict, path: Any, start: int,
                base: int, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of the run at ``base`` (file offset ``start``) arrived, and
        all before them: check the records they complete, report, announce."""
        now = time.perf_counter()
        upto = int(np.searchsorted(ends, base + b, side="right"))
        ids = mine[done["checked"]:upto]
        if self.ds.verify_on_read and len(ids):
            self._check_held(ids)
        if self.on_pfs_read is not None:
            self.on_pfs_read(b - a, len(ids), now - done["t"])
        rec = _trace.active()
        if rec is not None:
            rec.file_reads(path, np.array([start + a]), np.array([b - a]),
                           np.array([done["t"]]), np.array([now - done["t"]]),
                           samples=len(ids))
            rec.span("memstore", "preload", done["t"], now, count=len(ids), nbytes=b - a)
        done["checked"] = upto
        self._publish(base + b)
        done["t"] = time.perf_counter()

    def _wait_turn(self, shard: int, start: int, base: int, mine: np.ndarray,
                   ends: np.ndarray, a: int, length: int) -> bool:
        """Yielding, before the piece ``[a, a + length)`` of the run at ``base`` (file
        offset ``start`` of ``shard``): True if batches have kept all its records
        (nothing to read); else wait until no member's batch has read the files for
        _QUIET_NS, unless the piece is in the page cache (a memory copy, nothing taken
        from the batches)."""
        lo = int(np.searchsorted(ends, base + a, side="right"))
        hi = int(np.searchsorted(ends, base + a + length, side="left")) + 1
        ids = mine[lo:hi]
        ids = ids[self.layout.offset[ids] < base + a + length]
        if len(ids) and (self._kept_flags(ids, np.full(len(ids), self.member)) == 1).all():
            self._kept_skipped += length
            return True
        if not self._yielding or self.ds.cached(shard, start + a, length):
            return False
        poll = Backoff(first=0.001, cap=0.005)
        # over the exchange a member sees (and reads for) its own records only
        members = [self.member] if self.transport in ("exchange", "rma") else \
            range(self.width)
        held = int(self.layout.nbytes[members].sum())
        while not self._stop.is_set():
            # once the batches have read as many bytes from the files as the members
            # watched hold, they are reading again what the load would have brought
            # for good (a first epoch is over): the load stops giving way
            if sum(self._word(m, _H_READ_BYTES) for m in members) >= held:
                self._yielding = False
                return False
            quiet = time.monotonic_ns() - _QUIET_NS
            if all(self._word(m, _H_READING) <= quiet for m in members):
                return False
            poll.sleep()
        return False

    def _ready(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray) -> np.ndarray:
        """Which of samples ``ids`` are in their owners' memory now (overlap), from
        what the members' headers said when :meth:`_loaded_all` just read them."""
        ends = self.layout.offset[ids] + rows[:, IndexLayout.REC_LEN]
        ready = ends <= self._known[member]
        if self.yields and not ready.all():     # what batches read and kept
            late = np.flatnonzero(~ready)
            if self.transport == "rma":         # only this member's flags in reach
                late = late[member[late] == self.member]
            ready[late] = self._kept_flags(ids[late], member[late]) == 1
            fence()   # later loads of those records see what preceded their flags
        return ready

    def _kept_at(self, ids: np.ndarray, member: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """(array, positions) of samples ``ids``' kept flags (their owners' headers)."""
        rel = ids - self.layout.bounds[member] + _HEADER
        if self._segment is not None:           # shm, pages: every member's flags
            return self._segment, self._seg_hdr[member] + rel
        return self._raw, rel

    def _kept_flags(self, ids: np.ndarray, member: np.ndarray) -> np.ndarray:
        buf, pos = self._kept_at(ids, member)
        return buf[pos]

    def _keep(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
              dst: np.ndarray, pos: np.ndarray, files: list) -> None:
        """Copy the records a batch read from the files (``files``: its parts, a map,
        record starts and a mask each) to ``dst`` at ``pos``, their owners' chunks (the
        pages are in memory now), and flag them, so the load does not read them again
        and later batches find them there.  Over rma only this member's records: its
        own chunk is ``dst``; a peer's is out of reach (and ``pos`` would be the peer's
        offsets)."""
        kept = []
        for src, rec, m in files:
            if self.transport == "rma":
                own = member[m] == self.member
                rec, m = rec[own], _mask(len(ids), np.flatnonzero(m)[own])
            gather_ranges(src, rec, rows[m, IndexLayout.REC_LEN], dst, pos[m])
            kept.append(m)
        fence()       # the bytes are visible before the flags that announce them
        sub = np.flatnonzero(np.logical_or.reduce(kept))
        buf, at = self._kept_at(ids[sub], member[sub])
        buf[at] = 1

    def _pin_kept(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray) -> None:
        """Transport "pages": lock the records a batch just read from the files (in the
        page cache now) and flag them in their owners' headers, so their loads skip
        them and later batches count them as held: by the end of a first epoch that
        read every sample the loads have nothing left to read."""
        assert self._pages is not None
        self._pages.pin(ids, rows, advise=np.zeros(len(ids), dtype=bool))
        if self._pages.error:   # not lockable here (a peer's shards: RLIMIT_MEMLOCK):
            return              # their owners' loads lock them
        fence()       # (the flags announce pages that are locked)
        buf, at = self._kept_at(ids, member)
        buf[at] = 1

    def _raise_load_error(self) -> None:
        raise_background_error(self._load_error,
                               f"the background preload of rank {self.rank}")

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """With ``overlap``: block until this rank's chunk is loaded (True) or
        ``timeout`` passes (False); a failed load raises its error.  Else True."""
        if self._loader is not None:
            self._loader.join(timeout)
            if self._loader.is_alive():
                return False
        self._raise_load_error()
        return True

    def _verify_chunk(self) -> None:
        """With the dataset's ``verify_on_read``: check every record this rank preloaded
        against its checksum, once (peers read only chunks their owners checked); a
        damaged one fails the store on every rank with :class:`ChecksumError`."""
        msg = None
        if self.ds.verify_on_read:
            try:
                self._check_held(np.flatnonzero(self._mine))
            except ChecksumError as e:
                msg = str(e)
        agree(self.comm, msg, ChecksumError)

    def _check_held(self, ids: np.ndarray) -> None:
        """Check the records of this rank's samples ``ids`` where the store holds them:
        its chunk, or (transport "pages") the files' pages it locked."""
        if self._pages is not None:
            self.ds.check_records(ids, where=f"(preloaded by rank {self.rank})")
        else:
            self.ds.check_records(ids, self._buf, self.layout.offset[ids],
                                  where=f"(preloaded by rank {self.rank})")

    # -- access -----------------------------------------------------------------------
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

    def _loaded_all(self) -> bool:
        """Whether every member's chunk is loaded (overlap), from their headers."""
        if (self._known < self.layout.nbytes).any():
            self._refresh_known()
            if (self._known < self.layout.nbytes).any():
                return False
        self._raise_load_error()
        return True

    def _refresh_known(self) -> None:
        """Read how far the members still loading have got (a failed one fails every
        reader)."""
        if self._load_error is not None:
            self._raise_load_error()
        for m in np.flatnonzero(self._known < self.layout.nbytes).tolist():
            loaded, state = self._word(m, _H_LOADED), self._word(m, _H_STATE)
            fence()   # later loads of the member's data see what preceded its counter
            if state == _FAILED:
                msg = bytes(self._header(m)[64:]).rstrip(b"\0").decode("utf-8", "replace")
                raise StoreError(f"rank {int(self.group_ranks[m])}'s background preload "
                                 f"failed: {msg}")
            self._known[m] = loaded

    def _get_loading(self, ids: np.ndarray, rows: np.ndarray, local: np.ndarray,
                     member: np.ndarray, alloc: Any) -> SampleBatch:
        """get_many while the background preload runs: what has arrived from memory,
        the rest from the dataset files."""
        ready = self._ready(ids, rows, member)
        sub = np.flatnonzero(~ready)
        keep: Callable[[], None]         # what a batch that read the files keeps
        if self._pages is not None:      # every record through the files' maps
            if self.ds.verify_on_read:   # (as a loaded store's batches are)
                self.ds.check_records(ids)
            parts = self.ds.record_parts(ids, rows, advise=~ready)
            keep = partial(self._pin_kept, ids[sub], rows[sub], member[sub])
        else:
            parts, files, src, pos = self._loading_parts(ids, rows, member, local, ready, sub)
            keep = partial(self._keep, ids, rows, member, src, pos, files)
        rec = _trace.active()
        timings: Optional[list[Any]] = [] if rec is not None else None
        reading = self.yields and len(sub) > 0
        nbytes = int(rows[sub, IndexLayout.REC_LEN].sum())
        with self._reading(reading, nbytes):
            batch = assemble_batch(ids, rows, self.ds.schema, self.ds.layout, parts, alloc,
                                   timings=timings)
        if reading:
            keep()
        if len(sub) and self._pages is None:
            # copied out: the map's pages leave this process (the page cache keeps them)
            self.ds.release(ids[sub], rows[sub])
        nlocal = int((local & ready).sum())
        self._fetches["local"] += nlocal
        self._fetches["peer"] += len(ids) - nlocal - len(sub)
        self._fetches["pfs"] += len(sub)
        self._file_bytes += nbytes
        if rec is not None:
            srcs = np.where(local, _hooks.SRC["local"], _hooks.SRC["peer"])
            srcs[sub] = _hooks.SRC["pfs"]
            tiers = np.full(len(ids), _hooks.TIER["memory"])
            tiers[sub] = _hooks.TIER["pfs"]
            owner = np.where(ready, self.group_ranks[member], self.rank)
            tagged = [(sel, t0, t1, srcs, tiers, owner)
                      for (_, _, sel), (t0, t1) in zip(parts, timings or [])]
            _hooks.record_parts(rec, ids, rows[:, IndexLayout.REC_LEN], tagged)
            for (_, _, sel), (t0, t1) in zip(parts, timings or []):
                if not ready[sel].any():          # a part read from the files
                    _hooks.record_pfs(rec, self.ds, ids[sel], rows[sel], t0, t1)
        return batch

    def _loading_parts(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                       local: np.ndarray, ready: np.ndarray, sub: np.ndarray
                       ) -> "tuple[list, list, np.ndarray, np.ndarray]":
        """A batch's parts while the background preload runs (not "pages"): what has
        arrived from the members' memory, ``sub`` (not ready) from the files.  Returns
        the parts, those of them read from the files, and where the records go in
        their owners' memory (source, positions)."""
        if self.transport == "shm":
            src, pos = self._segment, self._seg_pos[ids]
        else:
            src, pos = self._buf, self.layout.offset[ids]
        parts: list = []
        if (local & ready).any():
            parts.append((src, pos[local & ready], local & ready))
        peer = ~local & ready
        if peer.any():       # rma: one MPI_Get per owner; else the memory in reach
            parts.append(self._staged(ids, rows, member, peer) if self.transport == "rma"
                         else (src, pos[peer], peer))
        files = []                       # the parts read from the dataset files
        if len(sub):
            if self.ds.verify_on_read:
                self.ds.check_records(ids[sub])
            for buf, starts, sel in self.ds.record_parts(ids[sub], rows[sub]):
                files.append((buf, starts, _mask(len(ids), sub[sel])))
        return parts + files, files, src, pos

    def _exchange(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                  local: np.ndarray, requests: "Optional[list[np.ndarray]]"
                  ) -> "tuple[list, Optional[np.ndarray]]":
        """The ``exchange`` transport's collective: every member of the replica group
        sends each other member the records of its request that it owns (in the order
        asked), with one all-gather of the ids (skipped when ``requests`` says what
        every member asks) and one all-to-all whose sizes both ends compute from the
        index.  While an overlapped preload runs, a member reads from the files what
        it has not loaded yet (to send, or for itself), and the members agree on how
        the loads stand before sending.  Returns assemble_batch parts and which of
        ``ids`` were read from the files (None: none could be).  ``rows``: the ids'
        index rows."""
        gc = self.group_comm
        reclen = self.ds.record_nbytes
        asked = allgather_array(gc, ids) if requests is None else requests
        cat = np.concatenate(asked)
        by = np.repeat(np.arange(self.width), [len(a) for a in asked])
        if len(cat) and (cat.min() < 0 or cat.max() >= len(self.ds)):
            raise StoreError("a peer asked for a sample id outside the dataset")
        mine = (self.layout.member[cat] == self.member) & (by != self.member)
        sids, to = cat[mine], by[mine]
        slen = reclen[sids]
        send = np.empty(int(slen.sum()), dtype=np.uint8)
        sent_at = np.cumsum(slen) - slen
        parts: list = []
        files = None
        if self._group_loaded:
            gather_ranges(self._buf, self.layout.offset[sids], slen, send, sent_at)
            if local.any():
                parts.append((self._buf, self.layout.offset[ids[local]], local))
        else:
            parts, files = self._exchange_loading(ids, rows, local, sids, slen, send,
                                                  sent_at)
        send_counts = np.bincount(to, weights=slen, minlength=self.width).astype(np.int64)
        remote = ~local
        rlen, rmember = reclen[ids[remote]], member[remote]
        order = np.argsort(rmember, kind="stable")
        stage_pos = np.empty(len(rlen), dtype=np.int64)
        stage_pos[order] = np.cumsum(rlen[order]) - rlen[order]
        recv_counts = np.bincount(rmember, weights=rlen, minlength=self.width).astype(np.int64)
        stage = alltoall_bytes(gc, send, send_counts, recv_counts)
        if remote.any():
            parts.append((stage, stage_pos, remote))
        return parts, files

    def _exchange_loading(self, ids: np.ndarray, rows: np.ndarray, local: np.ndarray,
                          sids: np.ndarray, slen: np.ndarray, send: np.ndarray,
                          sent_at: np.ndarray) -> "tuple[list, np.ndarray]":
        """The exchange's reads while overlapped loads run: this member's records that
        its load has announced from memory, the rest from the files (checked with
        ``verify_on_read``), into ``send`` and the local parts; then one all-gather of
        every member's state, so a failed load (or a failed read) raises on every member
        before anyone waits in the all-to-all, and once every load is done later
        batches skip all this.  Returns the local parts and which of ``ids`` were read
        from the files."""
        err: Optional[BaseException] = None
        parts: list = []
        files_mask = np.zeros(len(ids), dtype=bool)
        try:
            self._raise_load_error()
            off, nb = self.layout.offset, self.ds.record_nbytes
            mine = np.flatnonzero(local)
            ready_s, ready_l = self._own_ready(sids), self._own_ready(ids[mine])
            late_s, late_l = np.flatnonzero(~ready_s), mine[~ready_l]
            gather_ranges(self._buf, off[sids[ready_s]], slen[ready_s], send, sent_at[ready_s])
            if ready_l.any():
                m = _mask(len(ids), mine[ready_l])
                parts.append((self._buf, off[ids[m]], m))
            nbytes_s, nbytes_l = int(slen[late_s].sum()), int(nb[ids[late_l]].sum())
            reading = self.yields and (len(late_s) + len(late_l)) > 0
            with self._reading(reading, nbytes_s + nbytes_l):
                for buf, starts, lens, k in self._file_reads(sids[late_s]):
                    gather_ranges(buf, starts, lens, send, sent_at[late_s[k]])
                files = [(buf, starts, _mask(len(ids), late_l[k]))
                         for buf, starts, _, k in self._file_reads(ids[late_l])]
            if reading:        # kept in this member's chunk: the load skips them
                own = np.full(len(sids), self.member)
                self._keep(sids, self.ds.rows(sids), own, self._buf, off[sids],
                           [(send, sent_at[late_s], _mask(len(sids), late_s))])
                if files:
                    self._keep(ids, rows, np.full(len(ids), self.member), self._buf,
                               off[ids], files)
            parts += files
            files_mask[late_l] = True
            self._served_from_files[0] += len(late_s)
            self._served_from_files[1] += nbytes_s
            self._fetches["local"] -= len(late_l)
            self._fetches["pfs"] += len(late_l)
            self._file_bytes += nbytes_l
        except Exception as e:  # noqa: BLE001 - raised below, on every member
            err = e
        done = err is None and self._loader is not None and not self._loader.is_alive()
        states = self.group_comm.allgather(
            [bool(done), None if err is None else f"{type(err).__name__}: {err}"])
        if err is not None:
            raise err
        failed = [(r, msg) for r, (_, msg) in enumerate(states) if msg]
        if failed:
            r, msg = failed[0]
            raise StoreError(f"rank {int(self.group_ranks[r])}'s background preload (or a "
                             f"read of its records from the files) failed: {msg}")
        self._group_loaded = all(d for d, _ in states)
        return parts, files_mask

    @contextmanager
    def _reading(self, active: bool, nbytes: int) -> Iterator[None]:
        """While a batch of this member reads ``nbytes`` from the files (``active``:
        when the load yields), its header says so: the background load waits."""
        if not active:
            yield
            return
        self._hdr[_H_READING] = _READING
        try:
            yield
        finally:
            self._hdr[_H_READING] = time.monotonic_ns()
        self._hdr[_H_READ_BYTES] += nbytes

    def _own_ready(self, want: np.ndarray) -> np.ndarray:
        """Which of this member's samples ``want`` are in its chunk now (exchange with
        an overlapped load): announced by its load, or kept there by a batch."""
        loaded = int(self._hdr[_H_LOADED])
        fence()                # later loads of the chunk see what preceded the counter
        ready = self.layout.offset[want] + self.ds.record_nbytes[want] <= loaded
        if self.yields and not ready.all():
            late = np.flatnonzero(~ready)
            ready[late] = self._kept_flags(want[late], np.full(len(late), self.member)) == 1
            fence()            # later loads of those records see what preceded their flags
        return ready

    def _file_reads(self, want: np.ndarray):
        """Samples ``want`` read from the dataset files (checked with verify_on_read):
        (source, record starts, lengths, positions in ``want``) per shard."""
        if not len(want):
            return
        if self.ds.verify_on_read:
            self.ds.check_records(want)
        rows = self.ds.rows(want)
        every = np.arange(len(want))
        for buf, starts, sel in self.ds.record_parts(want, rows):
            yield buf, starts, rows[sel, IndexLayout.REC_LEN], every[sel]

    def stats(self) -> dict[str, Any]:
        """``fetches_by_source`` (local memory, a peer's memory, and with ``overlap``
        the files, for samples not yet loaded), and ``pfs_reads`` / ``pfs_bytes``: what
        this rank read from the dataset files (its preload, those samples, and over
        the exchange the records of its chunk it sent to peers from the files);
        ``transport``: how peers' memory is read; ``preload_seconds``: from setup to
        this rank's chunk loaded (None while an overlapped load runs);
        ``preload_skipped_bytes``: what the overlapped load did not read because
        batches had read and kept it."""
        mine = self._mine
        return {"fetches_by_source": {k: v for k, v in self._fetches.items()
                                      if v or k != "pfs"},
                "pfs_reads": int(mine.sum()) + self._fetches["pfs"] +
                self._served_from_files[0],
                "pfs_bytes": int(self.ds.record_nbytes[mine].sum()) + self._file_bytes +
                self._served_from_files[1],
                "preload_seconds": self.preload_seconds, "transport": self.transport,
                "overlap": self.overlap, "preload_skipped_bytes": self._kept_skipped}

    def abandon(self) -> None:
        self._stop_loading()
        if self.comm is None:
            self.close()
        self._closed = True

    def _stop_loading(self) -> None:
        """End the background preload (after the piece it is reading)."""
        self._stop.set()
        if self._loader is not None and self._loader is not threading.current_thread():
            self._loader.join()

    def close(self) -> None:
        """Release the window (collective over the replica group)."""
        if self._closed:
            return
        self._closed = True
        self._stop_loading()         # nothing writes the memory once it is released
        if self._pages is not None:
            self._pages.close()      # unlocked (the page cache may keep them)
        lent = self._lender.release()
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

    def __repr__(self) -> str:
        return (f"DistributedStore({self.ds.path}, rank={self.rank}/{self.world}, "
                f"width={self.width}, replicas={self.replicas}, transport={self.transport}, "
                f"holds={self.nbytes} B)")
