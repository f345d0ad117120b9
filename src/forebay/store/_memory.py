"""Memory budget checks: fail with the numbers before allocating, never swap or OOM."""

from __future__ import annotations

from .._memory import available_memory

__all__ = ["available_memory", "MEMORY_HEADROOM"]

#: fraction of available memory a store may take on a node
MEMORY_HEADROOM = 0.9
