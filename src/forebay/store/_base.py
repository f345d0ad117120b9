"""The SampleStore contract every store implements, and the direct store (no cache)."""

from __future__ import annotations

import abc
import os
import threading
import weakref
from typing import Any, Optional, Sequence, TypeVar

import numpy as np

from ..dataset import PackedDataset, ReadOnly, SampleBatch, SampleViews, open_dataset
from ..errors import ChecksumError, ForebayError, InvalidArgumentError

__all__ = ["SampleStore", "DirectStore", "StoreError", "STATS_KEYS", "WarmUp"]


#: keys every store's stats() has, one meaning each (the same bytes counted the same way
#: in every mode)
STATS_KEYS = {
    "fetches_by_source": "samples served, by where they came from: 'local' (this rank's "
                         "memory or SSD tier), 'peer' (another rank's), 'pfs' (the "
                         "dataset files, read for the batch)",
    "pfs_reads": "records this rank read from the dataset files: for batches, and for "
                 "preloading or filling its tiers",
    "pfs_bytes": "bytes of those records (each record's fields and the padding between "
                 "them, as stored)",
}


class StoreError(ForebayError, RuntimeError):
    """The store cannot be set up as asked (ranks disagree, memory does not fit...), is
    closed, or its background fill failed."""


class Releasable:
    """A with-block that releases what it holds: ``close()`` on a normal exit; on an
    exception (perhaps raised on this rank only) ``abandon()``, which releases only
    what is local, since a collective close would wait for ranks that never come."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    def abandon(self) -> None:
        """Stop using the object without any collective (what leaving a ``with`` block
        by an exception does): background threads stop, later reads raise, memory
        shared with other ranks stays until the process ends.  Default: close()."""
        self.close()


_R = TypeVar("_R", bound=Releasable)


class SampleStore(Releasable, abc.ABC):
    """Where a loader's samples come from.

    ``get_many(ids, alloc=None)`` returns a :class:`~forebay.dataset.SampleBatch`
    bit-exact to ``dataset.get_many(ids)``; ``stats()`` has at least
    :data:`STATS_KEYS`; ``wait_filled()`` reports background filling and raises
    :class:`StoreError` when a filler died; ``close()`` (collective for distributed
    stores) releases everything and later reads raise :class:`StoreError`.  Abilities
    are declared in :attr:`capabilities`: ``"shared"`` (ranks serve each other's
    samples), ``"background_fill"`` (filled while training runs), ``"views"``
    (``get_views`` lends the store's memory instead of copying).  ``get_views(ids)``
    returns a :class:`~forebay.dataset.SampleViews` of read-only per-sample arrays,
    bit-exact to ``get_many``, valid while referenced (after ``close()`` too).

    Every implementation passes ``tests/mpi/test_store_contract.py``.
    """

    capabilities: frozenset[str] = frozenset()
    ds: PackedDataset

    @abc.abstractmethod
    def get_many(self, ids: "Sequence[int] | np.ndarray", *, alloc: Any = None) -> SampleBatch:
        """Samples ``ids`` (any order, repeats and negative ids allowed)."""

    def get_views(self, ids: "Sequence[int] | np.ndarray") -> SampleViews:
        """Samples ``ids`` as read-only per-sample arrays.  Default: views of a copy
        (``get_many``); a store whose memory does not change under a reader (declared
        by ``"views"`` in :attr:`capabilities`) lends it instead."""
        return SampleViews.of_batch(self.get_many(ids))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i`` as a dict of writable arrays (a copy), bit-exact to the
        dataset's ``ds[i]``: the one-sample read of a map-style dataset.  Default: the
        sample of ``get_many([i])``; a store with a cheaper path overrides it."""
        return self.get_many([self.ds.normalize_index(i)]).sample(0)

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters, with at least :data:`STATS_KEYS`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store; idempotent."""

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """Block until background filling is complete (True) or ``timeout`` passes
        (False); raise :class:`StoreError` if a filler failed.  Nothing to fill: True."""
        return True

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def schema(self):
        return self.ds.schema


class Lender:
    """A store's memory lent to ``get_views``: one read-only alias per buffer (made
    once), and whether a view still holds any of it when the store closes (then the
    store must not free what it cannot unmap safely: an MPI window)."""

    def __init__(self) -> None:
        self._aliases: dict[str, np.ndarray] = {}
        self._leases: list[Any] = []

    def lend(self, key: str, src: np.ndarray, keep: Any = None) -> np.ndarray:
        """``src`` (1-D uint8) read-only; ``keep``: what owns its memory."""
        a = self._aliases.get(key)
        if a is None:
            lease = ReadOnly(src, keep)
            a = self._aliases[key] = lease.array()
            self._leases.append(weakref.ref(lease))
        return a

    def release(self) -> bool:
        """Forget the aliases; True when a view still holds memory lent."""
        self._aliases.clear()
        return any(r() is not None for r in self._leases)


def warm_enabled(warm_files: "bool | str", ds: PackedDataset) -> bool:
    """The stores' and loaders' ``warm_files`` argument resolved for dataset ``ds``:
    ``"auto"`` warms datasets of small records (:attr:`PackedDataset.small_records`)."""
    if warm_files == "auto":
        return ds.small_records
    if not isinstance(warm_files, bool):
        raise InvalidArgumentError(f"warm_files must be True, False or 'auto', got "
                                   f"{warm_files!r}")
    return warm_files


def raise_background_error(err: Optional[BaseException], what: str) -> None:
    """Raise, in a reader, the error a store's background thread (``what``: "the fill
    thread", ...) died of: a ChecksumError stays one (damaged data), anything else is
    a StoreError naming the thread; nothing if ``err`` is None."""
    if err is None:
        return
    if isinstance(err, ChecksumError):
        raise ChecksumError(f"{what} found damaged data: {err}") from err
    raise StoreError(f"{what} failed: {type(err).__name__}: {err}") from err


class WarmUp(threading.Thread):
    """A rank's share of a page-cache warm-up (:meth:`PackedDataset.warm` of
    ``extents``, every ``parts``-th from the ``part``-th) in a background thread:
    ``result`` once done; a failure is kept and raised by :meth:`check`, as the next
    batch's error."""

    def __init__(self, ds: PackedDataset, extents: "list[tuple[int, int, int]]", part: int,
                 parts: int, stop: threading.Event) -> None:
        super().__init__(name="forebay-warm", daemon=True)
        self.ds, self.extents, self.part, self.parts, self.stop = ds, extents, part, parts, stop
        self.result: dict[str, Any] = {}
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.result = self.ds.warm(extents=self.extents, part=self.part,
                                       parts=self.parts, stop=self.stop)
        except BaseException as e:  # noqa: BLE001 - raised by check() on the reader
            self.error = e

    def check(self) -> None:
        err = self.error
        if err is not None:
            raise StoreError(f"reading the dataset's files ahead (warm_files) failed: "
                             f"{type(err).__name__}: {err}") from err


class DirectStore(SampleStore):
    """Every batch read from the dataset's memory-mapped shards (no cache, no
    communication): the loader's ``store="direct"``.

    ``warm=(part, parts)`` also reads that share of the whole dataset into the page
    cache with large sequential reads, in a background thread
    (:meth:`PackedDataset.warm`), when the files fit in half the available memory:
    for ranks of one node that will read every sample, so that the batches' random
    reads are memory copies instead of one small request each.  A read error there is
    raised by the next ``get_many``."""

    capabilities = frozenset({"views"})

    def __init__(self, dataset: "PackedDataset | str | os.PathLike[str]", *,
                 warm: "tuple[int, int] | None" = None, node_cache: Any = None) -> None:
        self.ds = dataset if isinstance(dataset, PackedDataset) else open_dataset(dataset)
        #: a :class:`~forebay.store.NodeCache` of this dataset: batches are made present
        #: there (read from the dataset's files once, kept for later jobs) and read there
        self.cache = node_cache
        self._closed = False
        self._lock = threading.Lock()
        self._reads = 0
        self._bytes = 0
        self._stop = threading.Event()
        self._warm: Optional[WarmUp] = None
        if warm is not None:
            from ._memory import available_memory

            extents = self.ds.warm_extents()
            avail = available_memory()
            if extents and avail is not None and sum(n for _, _, n in extents) <= 0.5 * avail:
                self._warm = WarmUp(self.ds, extents, *warm, self._stop)
                self._warm.start()

    @property
    def warmed(self) -> dict[str, Any]:
        """What the warm-up read, once it is done (``PackedDataset.warm``'s result)."""
        return self._warm.result if self._warm is not None else {}

    def get_many(self, ids: "Sequence[int] | np.ndarray", *, alloc: Any = None) -> SampleBatch:
        if self._closed:
            raise StoreError("the store is closed")
        if self._warm is not None:
            self._warm.check()
        if self.cache is not None:
            ids = self.ds.normalize_ids(ids)
            if self.prepare(ids):
                return self.cache.dataset.get_many(ids, alloc=alloc)
        batch = self.ds.get_many(ids, alloc=alloc)          # normalises the ids once
        self.account(batch.ids)
        return batch

    def get_views(self, ids: "Sequence[int] | np.ndarray") -> SampleViews:
        """Views of the memory-mapped shards (:meth:`PackedDataset.get_views`)."""
        if self._closed:
            raise StoreError("the store is closed")
        if self._warm is not None:
            self._warm.check()
        if self.cache is not None:
            ids = self.ds.normalize_ids(ids)
            if self.prepare(ids):
                return self.cache.dataset.get_views(ids)
        views = self.ds.get_views(ids)
        self.account(views.ids)
        return views

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self._closed:
            raise StoreError("the store is closed")
        if self._warm is not None:
            self._warm.check()
        j = self.ds.normalize_index(i)
        if self.cache is not None:
            return self.get_many([j]).sample(0)
        sample = self.ds.sample(j, copy=True)
        self._count(1, int(self.ds.record_nbytes[j]))
        return sample

    @property
    def read_path(self) -> Any:
        """What another process reads this store's batches from (after
        :meth:`prepare`; :func:`~forebay.dataset.open_locator`): the node cache's
        copy, or the dataset itself."""
        return str(self.cache.dir) if self.cache is not None else self.ds.locator

    def prepare(self, ids: np.ndarray) -> bool:
        """Make samples ``ids`` (normalised) readable at :attr:`read_path` (by this
        store's reads, or by another process: the loader's transform workers), counting
        the file-system reads; False when the node cache's cap leaves some out (then
        read the batch from the dataset)."""
        if self.cache is None:
            self.account(ids)
            return True
        misses, nbytes = self.cache.misses, self.cache.miss_bytes
        if not self.cache.ensure(ids):
            return False
        self._count(self.cache.misses - misses, self.cache.miss_bytes - nbytes)
        return True

    def account(self, ids: np.ndarray) -> None:
        """Count reads of ``ids`` done on this store's behalf by another process that
        opened the same dataset (the loader's transform workers in direct mode)."""
        self._count(len(ids), int(self.ds.record_nbytes[ids].sum()))

    def _count(self, reads: int, nbytes: int) -> None:
        with self._lock:
            self._reads += reads
            self._bytes += nbytes

    def stats(self) -> dict[str, Any]:
        with self._lock:
            sources = {"pfs": self._reads} if self._reads else {}
            out: dict[str, Any] = {"fetches_by_source": sources, "pfs_reads": self._reads,
                                   "pfs_bytes": self._bytes,
                                   "warmed_bytes": int(self.warmed.get("bytes", 0))}
        if self.cache is not None:
            if self.cache.hits:
                sources["local"] = self.cache.hits      # node-local storage
            out.update(self.cache.stats())
        return out

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._warm is not None:
            self._warm.join()
        if self.cache is not None:
            self.cache.close()

    def __repr__(self) -> str:
        return f"DirectStore({self.ds.path})"
