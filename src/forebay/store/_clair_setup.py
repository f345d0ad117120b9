"""A clairvoyant store's set-up and tiers: the SSD tier's directory checked, every
sample's place in this rank's tiers from the placement, the transport, whether the RAM
tier is a copy or the files' locked pages, the windows and files allocated, and the
warm-up of the dataset's pages."""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._fs import LiveLock, abandoned, create_private, network_fs
from ..dataset import PinnedPages, can_lock
from ..dataset import ALIGNMENT
from ..comm import (NodeSegment, all_true, fence, is_mpi, ordered_shared_memory, shm_room,
                    shm_usable)
from ..errors import InvalidArgumentError
from ._agreement import agree, node_size
from ._base import StoreError, WarmUp
from ._memory import MEMORY_HEADROOM, available_memory
from ._placement import RAM
from ._windows import shared_segment
from ._clair_state import ClairState, _EMPTY, _HEADER, _align

__all__ = ["ClairSetup"]


class ClairSetup(ClairState):
    """The set-up half of :class:`~forebay.store.ClairvoyantStore`."""

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
        #: ranks of the job on this rank's node (collective)
        self._node_ranks = 1 if self.comm is None else node_size(self.comm)
        if self.comm is None or self.world == 1:
            self.transport = "local"
            return
        one_node = self._node_ranks == self.world  # the same answer on every rank
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
        # the node's RAM tiers are one /dev/shm segment (shm), and MPICH keeps the RMA
        # windows of a node's ranks there too
        if self.transport == "shm" or (self.transport == "rma" and self._node_ranks > 1):
            room = shm_room(self.comm, size)
            agree(self.comm, None if room is None else
                  f"the RAM tiers do not fit in shared memory: {room}; give a smaller "
                  f"ram_bytes, enlarge it, or use transport='exchange'")
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
