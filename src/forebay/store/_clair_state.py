"""The state a :class:`~forebay.store.ClairvoyantStore` keeps, declared once for the
files that implement its concerns (set-up and tiers, the fill threads and presence, the
exchange, the reads): each rank's window layout, the attributes, and the methods one
concern calls on another."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..comm import NodeSegment
from ..dataset import ALIGNMENT, PackedDataset, PinnedPages
from ..plan import AccessPlan
from ..vocab import FillState
from ._base import Lender, WarmUp
from ._placement import Placement

__all__ = ["ClairState", "tier_nbytes"]

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


class ClairState:
    """What every part of the clairvoyant store reads and writes (set in
    ``ClairvoyantStore.__init__`` and its set-up)."""

    comm: Any
    ds: PackedDataset
    rank: int
    world: int
    plan: AccessPlan
    transport: str
    placement: Placement
    fill_order: np.ndarray
    cov_off: np.ndarray
    local_off: np.ndarray
    local_pos: np.ndarray
    nbytes: int
    ssd_nbytes: int
    ssd_dir: Optional[Path]
    ram_tier: str
    model: Any
    peer_wait: float
    on_pfs_read: Optional[Callable[[int, int, float], None]]
    pfs_reads: int
    pfs_bytes: int
    _win: Any
    _node_seg: Optional[NodeSegment]
    _segment: Any
    _seg_base: Any
    _closed: bool
    _lender: Lender
    _stop: threading.Event
    _threads: list[threading.Thread]
    _fill_error: Optional[BaseException]
    _warm: Optional[WarmUp]
    _lock: threading.Lock
    _done_cv: threading.Condition
    _need_front: int
    _publish_lock: threading.Lock
    _cursor: dict[str, int]
    _stats: dict[str, int]
    _fill_from_peers: int
    _exchange_sent: int
    _exchange_rounds: int
    _exchange_ended: bool
    _covers_plan: Optional[bool]
    _pin_warned: bool
    _model_pfs: int
    _peer_via_pfs: bool
    _sizes: np.ndarray
    _pages: Optional[PinnedPages]
    _ram_order: np.ndarray
    _R: int
    _is_extra: np.ndarray
    _bounds: np.ndarray
    _R_all: np.ndarray
    _ssd_all: np.ndarray
    _peer_dirs: list[Path]
    _fill_all: np.ndarray
    _steady: Optional[np.ndarray]
    _in_pages: Any
    _state_len: int
    _raw: np.ndarray
    _counter: np.ndarray
    _filled: int
    _state: np.ndarray
    _buf: np.ndarray
    _known: np.ndarray
    _ssd: np.ndarray
    _ssd_maps: dict[int, Any]
    _ssd_file: Optional[Path]
    _ssd_token: str
    _ssd_live: Any
    _base: np.ndarray
    _progress: Any
    _node_ranks: int

    cache: Any

    if TYPE_CHECKING:    # what one concern calls on another
        def _dest(self, pos: np.ndarray) -> Any: ...
        def _peer_ssd(self, rank: int) -> np.ndarray: ...
        def _record_parts(self, ids: np.ndarray, rows: np.ndarray, populate: bool = False,
                          advise: Optional[np.ndarray] = None) -> Any: ...
        def _done_at(self, lpos: np.ndarray) -> np.ndarray: ...
        def _paged(self, ids: np.ndarray) -> Optional[np.ndarray]: ...
        def _lent(self, key: str) -> np.ndarray: ...
