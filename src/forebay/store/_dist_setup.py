"""A distributed store's set-up: its replica groups, the transport each group can use,
the memory check, the allocation of the members' memory (MPI windows, a node segment,
or the files' locked pages) and the preload of each member's chunk with large
parallel reads, checked once."""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any, Optional

import numpy as np

from ..dataset import ALIGNMENT, PinnedPages, can_lock
from ..errors import ChecksumError, TruncatedShardError
from ..progress import Progress
from ..comm import (SHM_DIR, NodeSegment, all_true, is_mpi, node_ranks, ordered_shared_memory,
                    shm_room, shm_usable)
from .._fs import network_fs
from ._agreement import agree, node_size
from ._base import StoreError
from ._layout import align_up
from ._pread import in_pieces, read_parallel
from ._windows import shared_segment
from ._memory import MEMORY_HEADROOM, available_memory
from .. import trace as _trace
from ._dist_state import _HEADER, StoreState

__all__ = ["StoreSetup"]


class StoreSetup(StoreState):
    """The set-up half of :class:`~forebay.store.DistributedStore`."""

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
        #: members of this rank's group on its node (collective over the group)
        self._local_members = 1 if single else node_size(self.group_comm)
        one_node = single or self._local_members == self.width
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
        # a node's shared segment lives in /dev/shm, and so (MPICH) do the MPI windows
        # of a group's members on one node: what they need must fit there, else auto
        # takes the exchange (plain memory) and an explicit transport says why not
        head = self._head_bytes(overlap)
        in_shm = everywhere or (mpi and self._local_members > 1)
        room = shm_room(self.comm, int(self.layout.nbytes[self.member]) + ALIGNMENT + head
                        if in_shm else 0)
        if asked in ("shm", "rma") and (everywhere or asked == "rma"):
            where = " (MPI keeps the windows of a node's ranks there)" if asked == "rma" else ""
            agree(self.comm, None if room is None else
                  f"transport={asked!r} is not possible: {room}{where}; enlarge it, or use "
                  f"transport='exchange'")
        if asked == "auto" and not all_true(self.comm, room is None):
            return "exchange"
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
        return _HEADER + (int(align_up(b[self.member + 1] - b[self.member])) if overlap else 0)

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
        old = self._grown_from
        kept = old is not None and self._pages is None and old._pages is None
        if kept:          # what the old store held: its chunk's bytes, copied below
            mine = mine[runs["segment"][mine] == len(self.layout.segments) - 1]
            self._from_files[:old.layout.segments[-1]] = False   # (the old samples)
        total = int(runs["len"][mine].sum())
        prog.start(total, desc=f"preload (rank {self.rank})", unit="B")
        err: Optional[Exception] = None
        try:
            if self._pages is not None:
                self._pin_runs(mine, prog)
            else:
                self._read_runs(mine, prog, old if kept else None)
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

    def _use_node_cache(self, cache: Any, prog: Progress) -> None:
        """Make this rank's chunk present in the node cache (``Preload(node_cache=)``,
        issue U: records an earlier job on this node kept are checked on their first
        use, the others read from the files, checked, and kept), then preload from the
        cache's copy instead of the files: when every rank's chunk is there (a cap
        that leaves some out: every rank reads the files, as without a cache).
        Collective."""
        mine = np.flatnonzero(self._mine)
        if self._grown_from is not None:   # what the old store held is copied from it
            mine = mine[mine >= self._grown_from.layout.segments[-1]]
        prog.start(int(self.ds.record_nbytes[mine].sum()),
                   desc=f"node cache (rank {self.rank})", unit="B")
        err: Optional[Exception] = None
        ok = False
        try:
            ok = cache.ensure_all(mine, prog)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            err = e
        finally:
            prog.close()
        failed = self._failure(err, "node cache")
        if failed is not None:
            raise failed
        if all_true(self.comm, ok):
            self.ds = cache.dataset.reopened(verify_on_read=self.ds.verify_on_read)
            self._chunk_cached = True

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

    def _read_runs(self, mine: np.ndarray, prog: Progress, old: Any = None) -> None:
        """Read this rank's runs ``mine`` into its chunk's memory; first, from ``old``
        (the store this one grows from), the chunk it held: the first bytes of this
        one's (:class:`StoreLayout`'s segments)."""
        runs = self.layout.runs
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock(self.member, MPI.LOCK_EXCLUSIVE)
        try:
            if old is not None:
                held = int(self.layout.held_before[self.member])
                if held != int(old.layout.nbytes[self.member]):
                    raise StoreError(f"the grown layout does not begin with the old "
                                     f"chunk ({held} B against {old.layout.nbytes[self.member]})")
                t0 = time.perf_counter()
                self._buf[:held] = old._buf[:held]
                rec = _trace.active()
                if rec is not None:
                    rec.span("memstore", "kept", t0, time.perf_counter(),
                             count=int((old.layout.member == self.member).sum()), nbytes=held)
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
