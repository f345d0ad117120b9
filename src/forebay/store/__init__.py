"""Where samples live: the distributed in-memory store (DDStore) and its layout."""

from ._distributed import DistributedStore, StoreError, StoreLayout, default_comm
from ._memory import available_memory
from ._placement import Placement, compute_placement

__all__ = ["DistributedStore", "Placement", "StoreError", "StoreLayout", "available_memory",
           "compute_placement", "default_comm"]
