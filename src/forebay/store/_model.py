"""NoPFS's performance model (Dryden et al., SC'21, §4) for choosing where a sample comes
from: the time to fetch ``n`` bytes from a local tier, a peer's memory (RMA) or the
parallel file system, from a machine profile (``forebay calibrate``, or a system file).

Bandwidth tables map a thread or reader count to MB/s; between measured counts the model
interpolates linearly, outside them it clamps to the nearest measured count (an empty
table is an error, not a crash: NoPFS's public simulator failed above its largest PFS
client count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from ._profile import ProfileError

MB = 1e6


def interpolate(table: Mapping[int, float], count: float) -> float:
    """MB/s at ``count`` threads or readers: linear between measured counts, clamped at
    the ends."""
    if not table:
        raise ProfileError("an empty bandwidth table")
    ks = np.array(sorted(table), dtype=np.float64)
    vs = np.array([table[int(k)] for k in ks], dtype=np.float64)
    return float(np.interp(count, ks, vs))      # np.interp clamps outside [ks[0], ks[-1]]


@dataclass(frozen=True)
class FetchModel:
    """Per-source fetch times in seconds (NoPFS §4): a PFS read gets its share of the
    aggregate random-read throughput t(γ) of γ concurrent readers; a peer read runs at
    the measured RMA get bandwidth; a local tier at its read bandwidth with p threads."""

    pfs_MBps: Mapping[int, float]                  # t(γ): readers -> aggregate MB/s
    rma_MBps: Optional[Mapping[int, float]] = None  # ranks -> MB/s of one reader's gets
    ram_MBps: Optional[Mapping[int, float]] = None  # threads -> aggregate copy MB/s
    ssd_MBps: Optional[Mapping[int, float]] = None  # threads -> aggregate read MB/s

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any]) -> "Optional[FetchModel]":
        """The model of a loaded profile, or None when it lacks the PFS figures."""
        pfs = profile.get("pfs", {}).get("read_MBps")
        if not pfs:
            return None
        return cls(pfs_MBps=pfs, rma_MBps=profile.get("rma", {}).get("get_MBps"),
                   ram_MBps=profile.get("ram", {}).get("copy_MBps"),
                   ssd_MBps=profile.get("ssd", {}).get("read_MBps"))

    def pfs_s(self, nbytes: float, readers: int = 1) -> float:
        """One reader's time for ``nbytes`` while ``readers`` read at once."""
        readers = max(int(readers), 1)
        return nbytes / (interpolate(self.pfs_MBps, readers) * MB / readers)

    def peer_s(self, nbytes: float, ranks: int = 2) -> float:
        if not self.rma_MBps:
            return 0.0                              # unmeasured: a peer is assumed fastest
        return nbytes / (interpolate(self.rma_MBps, ranks) * MB)

    def local_s(self, nbytes: float, tier: str = "ram", threads: int = 1) -> float:
        table = self.ram_MBps if tier == "ram" else self.ssd_MBps
        return 0.0 if not table else nbytes / (interpolate(table, threads) * MB / threads)

    def prefer_pfs(self, nbytes: float, readers: int, ranks: int) -> bool:
        """Whether the file system beats a peer's memory for these bytes right now."""
        return self.pfs_s(nbytes, readers) < self.peer_s(nbytes, ranks)
