"""Where samples live: the distributed in-memory store (DDStore) and its layout."""

from ._clairvoyant import ClairvoyantStore, tier_nbytes
from ._distributed import DistributedStore, StoreError, StoreLayout, default_comm
from ._memory import available_memory
from ._placement import Placement, compute_placement

__all__ = ["ClairvoyantStore", "DistributedStore", "Placement", "StoreError", "StoreLayout", "available_memory",
           "compute_placement", "default_comm", "tier_nbytes"]
