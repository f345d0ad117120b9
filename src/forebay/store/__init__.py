"""Where samples live: the distributed in-memory store (DDStore) and its layout, the
clairvoyant store (NoPFS), and named arrays shared by ranks (``ArrayStore``)."""

from ._arrays import ArrayStore
from ._base import STATS_KEYS, DirectStore, SampleStore, warm_enabled
from ._clairvoyant import ClairvoyantStore, tier_nbytes
from ._agreement import agree_on_prefix, check_agreement, node_size, prefixes
from ._base import StoreError
from ._distributed import DistributedStore, default_comm
from ._layout import StoreLayout, chunk_members
from ._memory import MEMORY_HEADROOM, available_memory
from ._model import FetchModel, interpolate
from ._modes import choose_mode, default_ram_bytes
from ._node_cache import (NODE_CACHE_BYTES_ENV, NODE_CACHE_ENV, NodeCache, cache_entries,
                          clear_cache, node_cache_key, node_cache_root)
from ._placement import NONE, RAM, SSD, Placement, compute_coverage, compute_placement, fill_tiers
from ._profile import ProfileError, calibrate, dump_profile, load_profile

__all__ = ["ArrayStore", "SampleStore", "DirectStore", "STATS_KEYS", "ClairvoyantStore",
           "NodeCache", "cache_entries", "node_cache_key", "clear_cache", "node_cache_root",
           "NODE_CACHE_ENV",
           "NODE_CACHE_BYTES_ENV", "choose_mode", "default_ram_bytes",
           "DistributedStore",
           "FetchModel", "Placement", "ProfileError", "StoreError", "StoreLayout",
           "MEMORY_HEADROOM", "NONE", "RAM", "SSD", "available_memory", "calibrate",
           "agree_on_prefix", "check_agreement", "chunk_members", "compute_coverage",
           "compute_placement", "prefixes",
           "default_comm", "dump_profile", "fill_tiers", "interpolate", "load_profile", "node_size",
           "tier_nbytes", "warm_enabled"]
