"""forebay's shared vocabulary: one spelling and one encoding of each concept that the
stores, the simulator, tracing and stats all speak of (a leaf module).

Units: byte counts are ``*_bytes`` (``nbytes`` for one object); sizes a user types
take binary suffixes (``GiB`` = 2**30, ``GB`` = 10**9, see ``forebay._units``);
bandwidths are ``MBps``, decimal megabytes per second, as the papers give them.
"""

from __future__ import annotations

import time
from enum import Enum, IntEnum

__all__ = ["Tier", "Source", "FetchPath", "FillState", "Backoff", "MB", "MiB", "GiB"]

MB = 10 ** 6          #: bandwidths (MBps) and the papers' dataset sizes
MiB = 1 << 20
GiB = 1 << 30


class Tier(IntEnum):
    """Where a rank keeps a cached copy (the values placement arrays hold)."""

    NONE = -1   #: not cached: read from the dataset files
    RAM = 0
    SSD = 1


class Source(str, Enum):
    """Where a fetched sample came from: the keys of ``stats()["fetches_by_source"]``
    and the ``source`` of trace events."""

    LOCAL = "local"   #: this rank's memory or SSD tier
    PEER = "peer"     #: another rank's tier
    PFS = "pfs"       #: the dataset files


class FetchPath(IntEnum):
    """A source and tier together, as the simulator times them (the order of its
    per-path arrays); ``label`` is the name reports use."""

    PFS = 0
    RAM = 1        #: this rank's RAM tier
    SSD = 2        #: this rank's SSD tier
    PEER_RAM = 3
    PEER_SSD = 4

    @property
    def label(self) -> str:
        return self.name.lower()


class FillState(IntEnum):
    """The state of one slot of a clairvoyant tier (one byte per slot, published to
    peers after the data)."""

    EMPTY = 0
    WRITING = 1
    DONE = 2


class Backoff:
    """Sleeps for polling loops: ``first`` seconds, doubling up to ``cap``.  One helper
    for every wait on another thread or rank (cf. mpi4py's ``util.sync``)."""

    def __init__(self, first: float = 0.0002, cap: float = 0.002) -> None:
        self.delay, self.cap = first, cap

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.cap, self.delay * 2)
