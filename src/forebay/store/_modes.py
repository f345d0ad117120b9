"""The loader's defaults that depend on the node: which store fits, and how much RAM a
clairvoyant tier takes."""

from __future__ import annotations

from typing import Any, Optional

from ..comm import all_true
from ..dataset import PackedDataset
from ._agreement import node_size
from ._clairvoyant import tier_nbytes
from ._memory import MEMORY_HEADROOM, available_memory

__all__ = ["choose_mode", "default_ram_bytes"]


def choose_mode(ds: PackedDataset, comm: Any, width: Optional[int]) -> str:
    """``preload`` if every rank's chunk fits its share of the node's memory (decided
    together: all ranks pick the same), else ``clairvoyant``."""
    world = comm.Get_size() if comm is not None else 1
    w = world if width is None else width
    need = int(tier_nbytes(ds).sum()) / max(w, 1)
    avail = available_memory()
    fits = avail is None or need * node_size(comm) <= MEMORY_HEADROOM * avail
    return "preload" if all_true(comm, fits) else "clairvoyant"


def default_ram_bytes(comm: Any) -> int:
    """Half of this node's available memory, shared by the node's ranks."""
    return int((available_memory() or 0) * 0.5 / node_size(comm))
