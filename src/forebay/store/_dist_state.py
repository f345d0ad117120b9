"""The state a :class:`~forebay.store.DistributedStore` keeps, declared once for the
files that implement its concerns (set-up, the background load, the exchange, the
reads): the attributes, the header every member keeps before its chunk, and the
methods one concern calls on another."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from ..comm import NodeSegment
from ..dataset import PackedDataset, PinnedPages
from ._base import Lender
from ._layout import StoreLayout

__all__ = ["StoreState", "mask_of"]

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
#: a background preload that yields to batches waits until none has read the files for
#: this long; it reads pieces of _YIELD_BLOCK then (a short queue ahead of a batch)
_QUIET_NS = 10_000_000
_YIELD_BLOCK = 4 << 20


def mask_of(n: int, where: np.ndarray) -> np.ndarray:
    """A boolean mask of length ``n``, True at positions ``where``."""
    m = np.zeros(n, dtype=bool)
    m[where] = True
    return m


class StoreState:
    """What every part of the distributed store reads and writes (set in
    ``DistributedStore.__init__`` and its set-up)."""

    comm: Any
    ds: PackedDataset
    rank: int
    world: int
    width: int
    group: int
    member: int
    group_comm: Any
    group_ranks: np.ndarray
    layout: StoreLayout
    transport: str
    overlap: bool
    yields: bool
    read_threads: int
    on_pfs_read: Optional[Callable[[int, int, float], None]]
    preload_seconds: Optional[float]
    _win: Any
    _node_seg: Optional[NodeSegment]
    _segment: Any
    _seg_hdr: Any
    _seg_pos: Any
    _lender: Lender
    _closed: bool
    _fetches: dict[str, int]
    _file_bytes: int
    _stop: threading.Event
    _loader: Optional[threading.Thread]
    _load_error: Optional[BaseException]
    _mine: np.ndarray
    _pages: Optional[PinnedPages]
    cache: Any
    _chunk_cached: bool
    _grown_from: Any
    _from_files: np.ndarray
    _mapped: bool
    _map_lock: Any
    _known: np.ndarray
    _t0: float
    _raw: np.ndarray
    _hdr: np.ndarray
    _buf: np.ndarray
    _shift: np.ndarray
    _group_loaded: bool
    _served_from_files: list[int]
    _yielding: bool
    _kept_skipped: int
    _local_members: int

    @property
    def replicas(self) -> int:
        return self.world // self.width

    if TYPE_CHECKING:    # what one concern calls on another
        def _map_dataset(self) -> None: ...
        def _check_held(self, ids: np.ndarray) -> None: ...
        def _pin_piece(self, shard: int, start: int, a: int, k: int) -> None: ...
        def _staged(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                    sel: np.ndarray) -> "tuple[np.ndarray, np.ndarray, np.ndarray]": ...
        def _raise_load_error(self) -> None: ...
        def _own_ready(self, want: np.ndarray) -> np.ndarray: ...
        def _reading(self, active: bool, nbytes: int) -> Any: ...
        def _file_reads(self, want: np.ndarray) -> Iterator[Any]: ...
        def _keep(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                  dst: np.ndarray, pos: np.ndarray, files: list) -> None: ...
        def _exchange_loading(self, ids: np.ndarray, rows: np.ndarray, local: np.ndarray,
                              sids: np.ndarray, slen: np.ndarray, send: np.ndarray,
                              sent_at: np.ndarray) -> "tuple[list, np.ndarray]": ...
        def _exchange(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                      local: np.ndarray, requests: "Optional[list[np.ndarray]]"
                      ) -> "tuple[list, Optional[np.ndarray]]": ...
