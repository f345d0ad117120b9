"""Memory available on this node: what every layer checks before a large allocation."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["available_memory"]


def available_memory() -> Optional[int]:
    """Bytes of memory available to new allocations on this node (``MemAvailable``),
    or ``FOREBAY_MEMORY_LIMIT`` (bytes) when set; None if unknown."""
    env = os.environ.get("FOREBAY_MEMORY_LIMIT")
    if env:
        return int(float(env))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
