"""Memory-mapped, fork- and thread-safe reader of packed datasets: the index, sample and
record access.  System calls on the files are in ``_files.py``, locked pages in
``_pinned.py``, checksum checks in ``_verify.py``.

Over 600 lines on purpose: :class:`PackedDataset` is one object whose index, record
access and page-cache hints (warm, advise, release) share the mapped shards and the
fork-safety state; split across files they would reach into each other's privates."""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import (ArgumentTypeError, ChecksumError, CorruptDatasetError, DatasetNotFoundError,
                      InvalidArgumentError, SampleIndexError, TruncatedShardError)
from .._intervals import merge_intervals
from ..progress import Progress
from ._batch import SampleBatch, SampleViews, _native, assemble_batch, assemble_views
from ._codec import inflate_one
from ._format import ALIGNMENT, IndexLayout, Manifest, checksum, load_index
from ._files import close_all, map_file, open_checked, populate_ranges, pread_ranges, resident
from ._verify import VerifyReport, bad_records, verify_files

__all__ = ["PackedDataset", "open_dataset"]

_EMPTY = np.zeros(0, dtype=np.uint8)
_EMPTY.flags.writeable = False       # as the shards' maps: views of it are read-only
_INT64 = np.dtype(np.int64)   # (dtypes of builtin types are singletons: `is` tests)
_PAGE = mmap.PAGESIZE
_HAVE_MADVISE = hasattr(mmap, "MADV_WILLNEED")
#: Linux maps the cached pages around a faulting one, in aligned windows of this size
_FAULT_AROUND = max(_PAGE, 64 << 10)
READAHEAD = ("record", "os")
#: bytes of one sequential read of :meth:`PackedDataset.warm`
WARM_EXTENT = 16 << 20
#: records under this size on average are read one request each in random order at a
#: fraction of a device's bandwidth: what ``warm_files="auto"`` warms
WARM_RECORD_MAX = 64 << 10
_live: "weakref.WeakSet[PackedDataset]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    # A lock held by another thread at fork time would stay held in the child.
    for ds in list(_live):
        ds._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class PackedDataset:
    """A packed dataset opened for random access.

    ``ds[i]`` returns a dict of read-only numpy views over the shard's memory map
    (no copy); ``ds.get_many(ids)`` gathers a batch into one buffer per field.  The
    index lives in one flat int64 array (no per-sample Python objects), shards are
    mapped lazily, and the object can be shared by threads, forked into workers, or
    pickled to spawned workers (which map the shards again).

    Args:
        path: the dataset directory.
        verify_on_read: check each sample's checksum whenever it is read.
        readahead: ``"record"`` (default): before reading a sample (or a batch), ask
            the kernel for exactly its pages (madvise WILLNEED; a batch's records are
            then read in parallel), so a page fault never triggers the kernel's
            read-around, which pulls megabytes of neighbours on nodes with a large
            ``read_ahead_kb``.  ``"os"``: leave it to the kernel's read-around, better
            for scans in index order.
    """

    def __init__(self, path: "str | os.PathLike[str]", *, verify_on_read: bool = False,
                 readahead: str = "record") -> None:
        self.path = Path(path)
        self._open(Manifest.read(self.path), verify_on_read, readahead)

    def _open(self, manifest: Manifest, verify_on_read: bool, readahead: str) -> None:
        """Set up the index and the lazy maps of ``manifest``'s shards (file names
        relative to :attr:`path`, or absolute: a mixture's)."""
        if readahead not in READAHEAD:
            raise InvalidArgumentError(f"readahead must be one of {READAHEAD}, got {readahead!r}")
        self.verify_on_read = verify_on_read
        self.readahead = readahead
        self.manifest = manifest
        self.schema = self.manifest.schema
        self._layout = IndexLayout(self.schema)
        lay = self._layout
        #: (name, dtype, offset col, nbytes col, first shape col, end shape col) per field
        self._field_cols = [(f.name, f.dtype, lay.off[f.name], lay.nbytes[f.name],
                             lay.shape[f.name].start, lay.shape[f.name].stop)
                            for f in self.schema.fields]
        self._coded = {f.name for f in self.schema.fields if f.codec}
        self._load_index()
        self._maps: list[Optional[np.ndarray]] = [None] * len(self.manifest.shards)
        self._mmaps: list[Optional[mmap.mmap]] = [None] * len(self.manifest.shards)
        #: shards opened for read_records (descriptors, closed with this object)
        self._files: dict[int, int] = {}
        weakref.finalize(self, close_all, self._files)
        self._lock = threading.Lock()
        self._mapped_in: Optional[np.ndarray] = None    # samples get_views mapped in
        _live.add(self)

    # -- index ----------------------------------------------------------------
    def _load_index(self) -> None:
        parts = []
        for s in self.manifest.shards:
            dpath, ipath = self.path / s.data, self.path / s.index
            for p, want in ((dpath, s.data_nbytes), (ipath, s.index_nbytes)):
                if not p.is_file():
                    raise DatasetNotFoundError(f"{p}: shard file listed in the manifest is missing")
                got = p.stat().st_size
                if got != want:
                    raise TruncatedShardError(f"{p}: {got} bytes on disk, the manifest records "
                                              f"{want} (truncated or overwritten)")
            raw = ipath.read_bytes()
            if checksum(raw) != s.index_checksum:
                raise ChecksumError(f"{ipath}: index checksum mismatch")
            parts.append(load_index(raw, ipath, (s.num_samples, self._layout.ncols)))
        self._index = np.ascontiguousarray(np.concatenate(parts)) if parts else \
            np.zeros((0, self._layout.ncols), np.int64)
        counts = np.array([s.num_samples for s in self.manifest.shards], dtype=np.int64)
        #: first global sample id of each shard
        self._shard_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._shard_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self._check_rows()
        self.sample_nbytes: np.ndarray = self._index[:, self._layout.nbytes_cols].sum(axis=1)
        self.sample_nbytes.setflags(write=False)
        self._index.setflags(write=False)
        self._shard_of.setflags(write=False)
        self._shard_paths = [str(self.path / s.data) for s in self.manifest.shards]

    # -- the record API: what stores, tracing and tools read (docs/format.md) -------------
    @property
    def layout(self) -> IndexLayout:
        """Columns of the index rows (:class:`~forebay.dataset.IndexLayout`)."""
        return self._layout

    @property
    def index(self) -> np.ndarray:
        """Every sample's index row (read-only int64, ``len(ds)`` x ``layout.ncols``):
        record offset, length and checksum in its shard, then each field's offset,
        byte count and shape."""
        return self._index

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Index rows of samples ``ids`` (a copy; ``take``: a quarter of a fancy index's
        fixed cost, which a one-sample get pays)."""
        return self._index.take(ids, axis=0)

    @property
    def record_nbytes(self) -> np.ndarray:
        """Bytes of each sample's record in its shard (fields and the padding between
        them: what a store copies), read-only."""
        return self._index[:, IndexLayout.REC_LEN]

    @property
    def shard_of(self) -> np.ndarray:
        """The shard holding each sample (read-only int32)."""
        return self._shard_of

    def shard_path(self, k: int) -> str:
        """Path of shard ``k``'s data file."""
        return self._shard_paths[k]

    def shard_buffer(self, k: int) -> np.ndarray:
        """Shard ``k``'s data file as a read-only uint8 array (memory-mapped once)."""
        return self._map(k)

    def cached(self, k: int, start: int, length: int) -> bool:
        """Whether bytes ``[start, start + length)`` of shard ``k`` are all in the page
        cache (mincore; False where that cannot be known)."""
        at = start - start % _PAGE
        end = min(start + length, int(self.manifest.shards[k].data_nbytes))
        return resident(self._map(k), at, end - at)

    def advise(self, k: int, starts: np.ndarray, ends: np.ndarray) -> None:
        """Ask the kernel to read byte ranges ``[starts, ends)`` of shard ``k`` now, in
        parallel (madvise WILLNEED), before a copy faults on them page by page; a no-op
        with ``readahead="os"`` or where madvise is missing."""
        if self.readahead == "record" and _HAVE_MADVISE:
            self._map(k)
            self._prefetch(k, starts, ends)

    @property
    def small_records(self) -> bool:
        """Whether the records average under 64 KiB (``WARM_RECORD_MAX``): random reads
        of one record each are then bound by the file system's requests per second,
        not its bandwidth (what the loaders' ``warm_files="auto"`` warms)."""
        return len(self) > 0 and float(self.record_nbytes.mean()) < WARM_RECORD_MAX

    def warm_extents(self, ids: "np.ndarray | None" = None, *, min_fraction: float = 0.9,
                     extent: int = WARM_EXTENT) -> list[tuple[int, int, int]]:
        """``(shard, offset, length)`` of the shard extents (``extent`` bytes, aligned)
        whose bytes are at least ``min_fraction`` records of samples ``ids`` (default:
        every sample), in file order: what :meth:`warm` reads."""
        want = np.ones(len(self), dtype=bool)
        if ids is not None:
            want[:] = False
            want[np.asarray(ids, dtype=np.int64)] = True
        off, ln = self._index[:, IndexLayout.REC_OFF], self._index[:, IndexLayout.REC_LEN]
        ln = ln + (-ln) % ALIGNMENT          # with the padding to the next record
        out = []
        for k, sh in enumerate(self.manifest.shards):
            lo = int(self._shard_start[k])
            sel = want[lo:lo + sh.num_samples]
            if sh.data_nbytes == 0 or not sel.any():
                continue
            n = -(-sh.data_nbytes // extent)
            got = np.bincount(off[lo:lo + sh.num_samples][sel] // extent,
                              weights=ln[lo:lo + sh.num_samples][sel], minlength=n)[:n]
            length = np.minimum(extent, sh.data_nbytes - np.arange(n, dtype=np.int64) * extent)
            for j in np.flatnonzero(got >= min_fraction * length).tolist():
                out.append((k, j * extent, int(length[j])))
        return out

    def warm(self, ids: "np.ndarray | None" = None, *, part: int = 0, parts: int = 1,
             stop: "threading.Event | None" = None, min_fraction: float = 0.9,
             extent: int = WARM_EXTENT,
             extents: "list[tuple[int, int, int]] | None" = None) -> dict[str, Any]:
        """Read the extents of :meth:`warm_extents` into the page cache with large
        sequential reads (``preadv`` of ``extent`` bytes), so that later random reads
        of those samples are memory copies instead of one small request each: on a
        file system that serves few requests per second (a parallel file system, a
        throttled disk) small samples read in random order are request-bound, a
        sequential read is bandwidth-bound.  Reads every ``parts``-th extent from the
        ``part``-th (ranks split the work); skips extents already cached (mincore) and
        stops early when ``stop`` is set.  ``extents``: the list :meth:`warm_extents`
        gave, when the caller has it already.  Returns ``{"bytes", "extents",
        "cached", "seconds"}``.  Nothing is verified or kept here: the page cache holds
        the bytes, the usual reads check them."""
        t_start = time.perf_counter()
        if extents is None:
            extents = self.warm_extents(ids, min_fraction=min_fraction, extent=extent)
        todo = extents[part::parts]
        buf = bytearray(max((n for _, _, n in todo), default=0))
        done = cached = nbytes = 0
        fds: dict[int, int] = {}
        from .. import trace as _trace
        try:
            for k, at, n in todo:
                if stop is not None and stop.is_set():
                    break
                if resident(self._map(k), at, n):
                    cached += 1
                    continue
                if k not in fds:
                    fds[k] = os.open(self._shard_paths[k], os.O_RDONLY)
                t0 = time.perf_counter()
                got = 0
                while got < n:
                    r = os.preadv(fds[k], [memoryview(buf)[got:n]], at + got)
                    if r <= 0:
                        raise TruncatedShardError(f"{self._shard_paths[k]}: ends at "
                                                  f"{at + got} bytes, the manifest records "
                                                  f"{self.manifest.shards[k].data_nbytes}")
                    got += r
                rec = _trace.active()
                if rec is not None:
                    # a span, not a reader/read: the samples' own reads (from the page
                    # cache now) are those, one per sample, as without the warm-up
                    rec.span("reader", "read_ahead", t0, time.perf_counter(), nbytes=n,
                             args={"fname": self._shard_paths[k], "offset": at})
                done += 1
                nbytes += n
        finally:
            for fd in fds.values():
                os.close(fd)
        return {"bytes": nbytes, "extents": done, "cached": cached,
                "seconds": time.perf_counter() - t_start}

    def release(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Unmap the pages of samples ``ids`` (rows ``rows``) from this process
        (madvise DONTNEED on the read-only shared map): for a caller that has copied
        them elsewhere (a tier), so the node does not hold them twice.  The page cache
        keeps them; a later read of the same bytes faults them back in, unchanged.  The
        ranges are widened to the kernel's fault-around window (64 KiB, aligned): a
        fault maps the cached pages around it, which would otherwise stay mapped."""
        if not _HAVE_MADVISE or not len(ids):
            return
        shard = self._shard_of[ids]
        rec = rows[:, IndexLayout.REC_OFF]
        end = rec + rows[:, IndexLayout.REC_LEN]
        for s in np.unique(shard).tolist():
            mm = self._mmaps[s]
            if mm is None:
                continue
            sel = shard == s
            # ranges that touch or overlap are one call
            a, b = merge_intervals((rec[sel] // _FAULT_AROUND) * _FAULT_AROUND,
                                   np.minimum(-(-end[sel] // _FAULT_AROUND) * _FAULT_AROUND,
                                              len(mm)))
            for x, y in zip(a.tolist(), b.tolist()):
                if y > x:
                    mm.madvise(mmap.MADV_DONTNEED, x, y - x)

    def read_records(self, ids: np.ndarray, rows: np.ndarray, out: np.ndarray,
                     dst: np.ndarray) -> None:
        """Copy the records of samples ``ids`` (index rows ``rows``) from the shard
        files into ``out`` (uint8) at ``dst`` (one offset per id) with ``pread``: the
        kernel copies from its page cache, and nothing is mapped into this process (no
        page faults, nothing left to unmap): what a store that keeps its own copy of
        the records uses.  A record the file cannot give (it shrank after it was
        opened, or the device failed) raises :class:`TruncatedShardError`."""
        if not len(ids):
            return
        shard = self._shard_of[ids]
        rec = rows[:, IndexLayout.REC_OFF]
        ln = rows[:, IndexLayout.REC_LEN]
        one = len(shard) == 1 or shard.min() == shard.max()
        for s in ([int(shard[0])] if one else np.unique(shard).tolist()):
            sel: Any = slice(None) if one else shard == s
            fd = self._file(s)
            o, n, d = (np.ascontiguousarray(x[sel], dtype=np.int64) for x in (rec, ln, dst))
            try:
                done = pread_ranges(fd, o, n, out, d)
            except OSError as e:
                raise TruncatedShardError(f"{self.shard_path(s)}: its records could not be "
                                          f"read ({e})") from e
            if done < len(o):
                raise TruncatedShardError(
                    f"{self.shard_path(s)}: sample {int(ids[sel][done])}'s record (bytes "
                    f"{int(o[done])} to {int(o[done] + n[done])}) is past the end of the "
                    f"file ({os.fstat(fd).st_size} bytes): it changed after it was opened")

    def _file(self, k: int) -> int:
        """Shard ``k``'s data file, opened once (read_records): a descriptor."""
        fd = self._files.get(k)
        if fd is None:
            with self._lock:
                fd = self._files.get(k)
                if fd is None:
                    s = self.manifest.shards[k]
                    fd = self._files[k] = open_checked(str(self.path / s.data),
                                                        s.data_nbytes)
        return fd

    def record_parts(self, ids: np.ndarray, rows: np.ndarray, *, populate: bool = False,
                     advise: Optional[np.ndarray] = None
                     ) -> list[tuple[np.ndarray, np.ndarray, Any]]:
        """``(shard buffer, record starts, selector)`` per shard among samples ``ids``
        (rows ``rows``), advised for reading: the parts :func:`assemble_batch` and
        :func:`gather_ranges` take to read those records from the files.  ``populate``:
        also read them into this process's map now (for views, which are read later by
        someone else); a record the file cannot give (an I/O error, a shard that shrank
        after it was mapped) raises :class:`TruncatedShardError` here instead of
        SIGBUS at its first read.  ``advise``: which of them to advise (default all;
        a caller that knows some are in memory, locked, skips their system calls)."""
        return self._parts(ids, rows, advise, self._map,
                           self._populate if populate else None)

    def _parts(self, ids: np.ndarray, rows: np.ndarray, advise: Optional[np.ndarray],
               array: Callable[[int], np.ndarray],
               populate: Optional[Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]]
               ) -> list[tuple[np.ndarray, np.ndarray, Any]]:
        """:meth:`record_parts` over the maps ``array(shard)`` gives (the dataset's, or
        :class:`PinnedPages`'), mapping the records in with ``populate(shard, ids,
        starts, ends)`` when given."""
        shard = self._shard_of[ids]
        rec = rows[:, IndexLayout.REC_OFF]
        quiet = advise is not None and not (              # nothing to advise
            True in advise.tolist() if len(advise) <= 16 else advise.any())
        if quiet and populate is None and len(shard) and \
                (len(shard) == 1 or shard.min() == shard.max()):
            return [(array(int(shard[0])), rec, slice(None))]    # one part, no numpy work
        end = rec + rows[:, IndexLayout.REC_LEN]
        shards = np.unique(shard)
        parts = []
        for s in shards.tolist():
            sel: Any = shard == s if len(shards) > 1 else slice(None)
            a: Any = slice(None) if advise is None or quiet else advise[sel]
            if not quiet and (advise is None or a.any()):
                self.advise(s, rec[sel][a], end[sel][a])
            if populate is not None:
                populate(s, ids[sel], rec[sel], end[sel])
            parts.append((array(s), rec[sel], sel))
        return parts

    def _populate(self, shard: int, ids: np.ndarray, starts: np.ndarray,
                  ends: np.ndarray) -> None:
        """Map the records of samples ``ids`` (byte ranges [starts, ends) of a shard) in
        now (MADV_POPULATE_READ), those this process has not mapped in before (a
        page-table walk per record costs a few microseconds: once per sample and
        process; pages the kernel later reclaims are read again at their next read)."""
        m = self._map(shard)
        if _native is None or not hasattr(_native, "populate") or not len(m):
            return            # (without the C kernel: read at the views' first read)
        if self._mapped_in is None:
            self._mapped_in = np.zeros(len(self), dtype=bool)
        fresh = ~self._mapped_in[ids]
        if not fresh.any():
            return
        populate_ranges(m, self.shard_path(shard), starts[fresh], ends[fresh])
        self._mapped_in[ids[fresh]] = True

    def _check_rows(self) -> None:
        """Every index row, once, vectorised (the index is untrusted input): the record
        lies inside its shard, each field inside its record, and each field's byte
        count is its shape's product times its itemsize.  A row that fails would make
        a read return bytes outside the record, or fault; it is named instead."""
        idx, lay = self._index, self._layout
        if not len(idx):
            return
        sizes = np.array([s.data_nbytes for s in self.manifest.shards], dtype=np.int64)
        off, ln = idx[:, IndexLayout.REC_OFF], idx[:, IndexLayout.REC_LEN]
        room = sizes[self._shard_of]
        # compared without sums that could overflow int64 on crafted values
        bad = (off < 0) | (ln < 0) | (off > room) | (ln > room - np.minimum(off, room))
        what = "record outside its shard"
        for f in self.schema.fields:
            if bad.any():
                break
            foff, fnb = idx[:, lay.off[f.name]], idx[:, lay.nbytes[f.name]]
            shape = idx[:, lay.shape[f.name]]
            field_bad = (foff < 0) | (fnb < 0) | (foff > ln) | (fnb > ln - np.minimum(foff, ln))
            field_bad |= (shape < 0).any(axis=1)
            # the product in float64 is exact below 2**53, and a valid one is below the
            # shard size; above, the row is wrong anyway
            prod = np.prod(shape.astype(np.float64), axis=1) * f.dtype.itemsize
            if f.codec:     # a frame holds at most 2**15 bytes a byte (zstd's RLE blocks)
                field_bad |= prod > (fnb.astype(np.float64) + 64) * 2.0 ** 15
            else:
                field_bad |= prod != fnb.astype(np.float64)
            # an empty array's other dimensions: numpy refuses a shape whose non-zero
            # dimensions overflow its index type ("array is too big") even at size 0
            span = np.prod(np.maximum(shape, 1).astype(np.float64), axis=1)
            field_bad |= span * max(f.dtype.itemsize, 1) >= 2.0 ** 62
            if field_bad.any():
                bad, what = field_bad, (f"field {f.name!r} outside its record or its byte "
                                        f"count not its shape's")
        if bad.any():
            i = int(np.argmax(bad))
            raise CorruptDatasetError(
                f"{self.path}: sample {i} ({self.manifest.shards[self._shard_of[i]].index}, "
                f"row {i - int(self._shard_start[self._shard_of[i]])}): {what} "
                f"({int(bad.sum())} bad rows)")

    # -- mapping ----------------------------------------------------------------
    def _map(self, k: int) -> np.ndarray:
        m = self._maps[k]
        if m is None:
            with self._lock:
                m = self._maps[k]
                if m is None:
                    m = self._open_map(k)
                    self._maps[k] = m
        return m

    def _open_map(self, k: int) -> np.ndarray:
        s = self.manifest.shards[k]
        if s.data_nbytes == 0:
            return _EMPTY
        mm = map_file(str(self.path / s.data), s.data_nbytes)
        self._mmaps[k] = mm
        return np.frombuffer(mm, dtype=np.uint8)

    def _prefetch(self, shard: int, starts: np.ndarray, ends: np.ndarray) -> None:
        """madvise(WILLNEED) byte ranges [starts, ends) of one shard, so the kernel reads
        them all (in parallel) before the copy faults on them one page at a time."""
        mm = self._mmaps[shard]
        if mm is None:
            return
        if _native is not None:
            _native.willneed(self._maps[shard], np.ascontiguousarray(starts, dtype=np.int64),
                             np.ascontiguousarray(ends, dtype=np.int64))
            return
        for a, b in zip(((starts // _PAGE) * _PAGE).tolist(), np.minimum(ends, len(mm)).tolist()):
            if b > a:
                mm.madvise(mmap.MADV_WILLNEED, a, b - a)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self._maps)
        state["_mmaps"] = [None] * len(self._maps)
        state["_mapped_in"] = None
        del state["_files"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._files = {}
        weakref.finalize(self, close_all, self._files)
        self._lock = threading.Lock()
        _live.add(self)

    @property
    def locator(self) -> Any:
        """What another process opens this dataset from
        (:func:`~forebay.dataset.open_locator`): its directory (a
        :class:`~forebay.dataset.ConcatDataset`: its sources' directories)."""
        return str(self.path)

    def reopened(self, *, verify_on_read: bool) -> "PackedDataset":
        """The same dataset opened again with another ``verify_on_read``."""
        return PackedDataset(self.path, verify_on_read=verify_on_read,
                             readahead=self.readahead)

    # -- access -----------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest.num_samples

    @property
    def nbytes(self) -> int:
        """Total bytes of field data over all samples (padding excluded)."""
        return self.manifest.payload_nbytes

    @property
    def disk_nbytes(self) -> int:
        return sum(s.data_nbytes + s.index_nbytes for s in self.manifest.shards)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    @property
    def fingerprint(self) -> str:
        """Checksum of the manifest: equal fingerprints mean the same dataset."""
        return self.manifest.fingerprint

    def normalize_index(self, i: Any) -> int:
        """Sample index ``i`` checked and made non-negative; raises
        :class:`ArgumentTypeError` for a non-integer and :class:`SampleIndexError` out
        of range."""
        if type(i) is int and 0 <= i < len(self._index):   # the common case, first
            return i
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise ArgumentTypeError(f"sample index must be an integer, got {type(i).__name__}")
        n = len(self)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise SampleIndexError(f"sample index {int(i)} out of range for {n} samples "
                                   f"in {self.path}")
        return j

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i`` as a dict of read-only numpy views (no copy)."""
        return self.sample(i)

    def sample(self, i: int, *, copy: bool = False,
               advise: bool = True) -> dict[str, np.ndarray]:
        """Sample ``i`` as a dict of arrays: read-only views of the mapped shard, or
        with ``copy`` views of one writable copy of its record (one copy per sample,
        not per field), bit-exact to ``get_many([i]).sample(0)``.  ``advise=False``
        skips the read-ahead advice (a caller that knows the record is in memory)."""
        i = self.normalize_index(i)
        row = self._index[i].tolist()
        shard = int(self._shard_of[i])
        buf = self._maps[shard]
        if buf is None:
            buf = self._map(shard)
        base, rec_len = row[IndexLayout.REC_OFF], row[IndexLayout.REC_LEN]
        if advise and self.readahead == "record" and rec_len and _HAVE_MADVISE:
            mm = self._mmaps[shard]
            if mm is not None:
                a = base - base % _PAGE
                mm.madvise(mmap.MADV_WILLNEED, a, min(base + rec_len, len(mm)) - a)
        if self.verify_on_read:
            self.check_records(np.array([i]))
        if copy:
            return self._fields_of(row, buf[base:base + rec_len].copy(), 0, True)
        return self._fields_of(row, buf, base, False)

    def sample_from(self, i: int, src: np.ndarray, start: int = 0, *,
                    copy: bool = True) -> dict[str, np.ndarray]:
        """Sample ``i`` from a uint8 buffer that holds its record, as laid out in its
        shard, at byte ``start`` (a store's memory, a record fetched from a peer): a
        dict of arrays viewing one copy of the record (``copy``, writable) or ``src``
        itself.  Raises :class:`InvalidArgumentError` when the record does not fit in
        ``src``; the record's bytes are not verified here."""
        i = self.normalize_index(i)
        row = self._index[i].tolist()
        rec_len = row[IndexLayout.REC_LEN]
        if not (isinstance(src, np.ndarray) and src.dtype == np.uint8 and src.ndim == 1):
            raise ArgumentTypeError("src must be a 1-D uint8 array")
        if type(start) is not int:
            if isinstance(start, (bool, np.bool_)) or not isinstance(start, np.integer):
                raise ArgumentTypeError(f"start must be an integer, got {type(start).__name__}")
            start = int(start)
        if start < 0 or start > len(src) - rec_len:
            raise InvalidArgumentError(
                f"sample {i}'s record ({rec_len} bytes at {start}) is not inside the "
                f"buffer of {len(src)} bytes")
        if copy:
            return self._fields_of(row, src[start:start + rec_len].copy(), 0, True)
        return self._fields_of(row, src, start, None)

    def _fields_of(self, row: list, buf: Any, base: int,
                   writable: Optional[bool]) -> dict[str, np.ndarray]:
        """A sample's fields as arrays over ``buf``, its record at ``base`` (``row``: its
        index row, checked at open to lie inside the record); an empty field's array
        is ``writable`` (None: as ``buf``)."""
        out = {}
        for name, dtype, c_off, c_nb, c_shape, c_end in self._field_cols:
            if name in self._coded:        # a value of its own, decompressed
                at = base + row[c_off]
                raw = int(np.prod(row[c_shape:c_end])) * dtype.itemsize
                a = inflate_one(buf[at:at + row[c_nb]], raw,
                                f"{self.path}: field {name!r}").view(dtype).reshape(
                                    row[c_shape:c_end])
                if writable is False or (writable is None and not buf.flags.writeable):
                    a.setflags(write=False)
            elif row[c_nb] == 0:
                a = np.empty(row[c_shape:c_end], dtype=dtype)
                if writable is None:
                    writable = bool(buf.flags.writeable)
                if not writable:
                    a.setflags(write=False)
            else:           # a slice's view: half the cost of np.ndarray(buffer=...)
                at = base + row[c_off]
                a = buf[at:at + row[c_nb]].view(dtype).reshape(row[c_shape:c_end])
            out[name] = a
        return out

    def normalize_ids(self, ids: "Sequence[int] | np.ndarray") -> np.ndarray:
        """``ids`` as a flat int64 array with negative ids resolved; raises
        :class:`SampleIndexError` naming the first id out of range."""
        n = len(self)
        if type(ids) is np.ndarray and ids.dtype is _INT64 and ids.ndim == 1 and len(ids):
            # already as asked (the batch owns a copy); a few ids: checked in Python,
            # cheaper than two numpy reductions (a one-sample get's fixed cost)
            if len(ids) <= 16:
                lst = ids.tolist()
                if 0 <= min(lst) and max(lst) < n:
                    return ids.copy()
            elif 0 <= ids.min() and ids.max() < n:
                return ids.copy()
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu" and not (ids.size == 0):
            raise ArgumentTypeError(f"sample ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        ids = np.where(ids < 0, ids + n, ids)
        bad = (ids < 0) | (ids >= n)
        if bad.any():
            first = int(ids[np.argmax(bad)])
            first = first - n if first < 0 else first
            raise SampleIndexError(f"sample id {first} out of range for "
                                   f"{n} samples in {self.path} ({int(bad.sum())} bad ids)")
        return ids

    def get_many(self, ids: "Sequence[int] | np.ndarray", *, alloc=None) -> SampleBatch:
        """Gather samples ``ids`` (any order, repeats allowed) into a :class:`SampleBatch`.

        Vectorized over the batch: one gather per field and shard, no per-sample
        Python objects.  The result owns its memory (writable, independent of the maps);
        ``alloc(nbytes) -> uint8 array`` supplies it if given (a :class:`BufferPool`
        reuses the buffers of batches nothing references any more).
        """
        ids = self.normalize_ids(ids)
        if self.verify_on_read:
            self.check_records(ids)
        rows = self._index.take(ids, axis=0)
        return assemble_batch(ids, rows, self.schema, self._layout,
                              self.record_parts(ids, rows), alloc)

    def get_views(self, ids: "Sequence[int] | np.ndarray") -> SampleViews:
        """Samples ``ids`` as read-only views of the memory-mapped shards (no copy): a
        :class:`SampleViews`, bit-exact to :meth:`get_many`.  The records are read
        into this process's map here, the first time it lends each sample (so a cold
        read happens in the calling thread, and a shard cut short raises
        :class:`TruncatedShardError`); with ``verify_on_read`` they are checked here,
        before they are handed out.  The views keep their shard mapped while they
        live."""
        ids = self.normalize_ids(ids)
        if self.verify_on_read:
            self.check_records(ids)
        rows = self._index.take(ids, axis=0)
        return assemble_views(ids, rows, self.schema, self._layout,
                              self.record_parts(ids, rows, populate=True))

    # -- integrity ----------------------------------------------------------------
    def check_records(self, ids: np.ndarray, buf: Optional[np.ndarray] = None,
                      offsets: Optional[np.ndarray] = None, where: str = "") -> None:
        """Raise :class:`ChecksumError` naming the first of samples ``ids`` whose record
        fails its checksum: in the dataset's files, or in ``buf`` at ``offsets`` where
        a store copied the records (``where`` names that copy in the message)."""
        bad = self.bad_records(ids, buf, offsets)
        if bad:
            i = bad[0]
            shard = self.manifest.shards[int(self._shard_of[i])]
            raise ChecksumError(f"{self.path / shard.data}: sample {i} fails its checksum"
                                f"{' ' + where if where else ''} ({len(bad)} of {len(ids)} "
                                f"checked samples damaged)")

    def bad_records(self, ids: np.ndarray, buf: Optional[np.ndarray] = None,
                    offsets: Optional[np.ndarray] = None) -> list[int]:
        """Those of samples ``ids`` whose record bytes fail their checksum: read from
        the dataset's files, or from ``buf`` (uint8) at ``offsets`` (one per id)."""
        return bad_records(self, ids, buf, offsets)

    def verify(self, *, progress: "Progress | bool | None" = None,
               raise_on_error: bool = True) -> VerifyReport:
        """Check every checksum: index files, whole shards, and the samples of bad shards.

        Raises :class:`ChecksumError` listing what is damaged (or returns the report
        with ``raise_on_error=False``).
        """
        return verify_files(self, progress=progress, raise_on_error=raise_on_error)

    def __repr__(self) -> str:
        return (f"PackedDataset({str(self.path)!r}, samples={len(self)}, "
                f"shards={len(self.manifest.shards)}, fields=[{self.schema.describe()}])")


def open_dataset(path: "str | os.PathLike[str]", *, verify_on_read: bool = False,
                 readahead: str = "record") -> PackedDataset:
    """Open the packed dataset at ``path`` for random access.

    Checks the manifest, the shard sizes and the index checksums (cheap); call
    :meth:`PackedDataset.verify` to check every byte.
    """
    return PackedDataset(path, verify_on_read=verify_on_read, readahead=readahead)

