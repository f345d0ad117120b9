"""Where samples live: the distributed in-memory store (DDStore) and its layout."""

from ._distributed import DistributedStore, StoreError, StoreLayout, default_comm
from ._memory import available_memory

__all__ = ["DistributedStore", "StoreError", "StoreLayout", "available_memory", "default_comm"]
