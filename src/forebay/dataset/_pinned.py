"""A packed dataset's pages held in the page cache and locked there (:class:`PinnedPages`),
and whether this process may lock them (:func:`can_lock`)."""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..errors import InvalidArgumentError
from ._batch import _native
from ._format import IndexLayout
from ._files import map_file, populate_ranges

if TYPE_CHECKING:
    from ._reader import PackedDataset

__all__ = ["PinnedPages", "can_lock"]

_EMPTY = np.zeros(0, dtype=np.uint8)
_EMPTY.flags.writeable = False       # as the shards' maps: views of it are read-only


class PinnedPages:
    """The pages of a packed dataset's records held in memory: read-only maps of its
    shard files of its own, each locked as its pages are mapped in (``mlock2`` with
    ``MLOCK_ONFAULT``, one call per map: an ``mlock`` per record would split a map into
    a mapping per range); :meth:`pin` maps records in (``MADV_POPULATE_READ``).  The
    page cache keeps one copy per node, shared by every process that maps the files,
    as long as one process locks it.  What :class:`~forebay.store.ClairvoyantStore`
    holds its RAM tier in with ``ram_tier="pages"``: these maps only lock; batches read
    every sample through the dataset's own maps, straight into the batch, never copied
    into a tier (reading a rank's own samples through these left the dataset's maps
    unmapped, and the first warm epoch faulted on each of a peer's pages there).
    :meth:`close` unmaps these maps, which unlocks them.  Needs forebay's C kernel and
    the right to lock the shards' bytes (``RLIMIT_MEMLOCK`` counts each locked map
    whole, or ``CAP_IPC_LOCK``; :func:`can_lock`)."""

    def __init__(self, ds: "PackedDataset") -> None:
        if _native is None or not hasattr(_native, "lock_on_fault"):
            raise InvalidArgumentError("holding samples in the page cache needs forebay's C "
                                       "kernel (forebay._native), which this install lacks")
        self._ds = ds
        self._maps: dict[int, mmap.mmap] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        #: bytes of the records pinned so far (a record pinned twice counts twice)
        self.nbytes = 0
        #: the errno of the first map that could not be locked (0: none)
        self.error = 0

    def _array(self, k: int) -> np.ndarray:
        """Shard ``k``'s locked map as a read-only uint8 array (mapped once)."""
        arr = self._arrays.get(k)
        if arr is not None:
            return arr
        with self._lock:
            arr = self._arrays.get(k)
            if arr is None:
                want = self._ds.manifest.shards[k].data_nbytes
                if not want:
                    arr = _EMPTY
                else:
                    mm = map_file(self._ds.shard_path(k), want)
                    self.error = self.error or _native.lock_on_fault(mm)
                    self._maps[k] = mm
                    arr = np.frombuffer(mm, dtype=np.uint8)
                self._arrays[k] = arr
            return arr

    def lock(self, shards: np.ndarray) -> None:
        """Map and lock these shards now (their pages as they are mapped in)."""
        for k in shards.tolist():
            self._array(k)

    def _read_in(self, k: int, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Map byte ranges [starts, ends) of shard ``k`` in now, reading what is not
        cached (and so lock them)."""
        arr = self._array(k)
        if len(arr):
            populate_ranges(arr, self._ds.shard_path(k), starts, ends)

    def pin_range(self, k: int, start: int, end: int) -> None:
        """Read bytes ``[start, end)`` of shard ``k`` into memory, if they are not there,
        and lock their pages (whole pages); a range the file cannot give raises
        :class:`~forebay.errors.TruncatedShardError`.  For a caller that holds a
        contiguous run of records (a preload's chunk), read in pieces."""
        self._read_in(k, np.zeros(0, dtype=np.int64), np.array([start], dtype=np.int64),
                      np.array([end], dtype=np.int64))
        with self._lock:
            self.nbytes += max(0, end - start)

    def pin(self, ids: np.ndarray, rows: np.ndarray, *,
            advise: Optional[np.ndarray] = None) -> None:
        """Read the records of samples ``ids`` (index rows ``rows``) into memory, if
        they are not there, and lock their pages (whole pages: one a neighbour shares is
        locked too).  A record that cannot be read (a shard shorter than its map, an I/O
        error) raises :class:`~forebay.errors.TruncatedShardError`; where a map could
        not be locked, :attr:`error` says why and its pages stay cached unlocked.
        ``advise``: which of them to ask the kernel for first (WILLNEED; default all;
        none for records just read)."""
        self._ds._parts(ids, rows, advise, self._array, self._read_in)
        with self._lock:
            self.nbytes += int(rows[:, IndexLayout.REC_LEN].sum())

    def close(self) -> None:
        """Unmap, and so unlock, every map this object locked."""
        with self._lock:
            maps, self._maps, self._arrays = self._maps, {}, {}
        for mm in maps.values():
            try:
                mm.close()
            except BufferError:
                pass


def can_lock(nbytes: int) -> bool:
    """Whether this process may lock ``nbytes`` more bytes of a dataset's pages in memory
    (:class:`PinnedPages`): forebay's C kernel is built, and the process holds
    ``CAP_IPC_LOCK`` (root, usually) or ``RLIMIT_MEMLOCK`` leaves room for them beside
    what it has locked already."""
    if _native is None or not hasattr(_native, "lock_on_fault"):
        return False
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        cap = int(status.get("CapEff", "0").strip(), 16)
        locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
    except (OSError, ValueError):
        return False
    if cap & (1 << 14):             # CAP_IPC_LOCK
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or locked + nbytes <= soft
