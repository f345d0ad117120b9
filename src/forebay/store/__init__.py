"""Where samples live: the distributed in-memory store (DDStore) and its layout."""

from ._clairvoyant import ClairvoyantStore, tier_nbytes
from ._distributed import DistributedStore, StoreError, StoreLayout, default_comm
from ._memory import available_memory
from ._placement import Placement, compute_placement
from ._profile import ProfileError, calibrate, dump_profile, load_profile

__all__ = ["ClairvoyantStore", "DistributedStore", "Placement", "ProfileError", "StoreError",
           "StoreLayout", "available_memory", "calibrate", "compute_placement", "default_comm",
           "dump_profile", "load_profile", "tier_nbytes"]
