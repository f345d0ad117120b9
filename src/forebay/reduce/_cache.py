"""Response cache and bitvector layout (Horovod's ``ResponseCache`` / ``CacheCoordinator``).

Every rank holds an identical cache: entries are inserted and touched only while
executing responses, and responses are executed in the same order on every rank, so
positions, LRU order and evictions agree everywhere without being communicated.

Bitvector layout, one ``int64`` word per 64 bits:

* word 0 holds the status bits, stored *inverted* so that a bitwise AND over ranks
  yields "set on any rank" (NOT(AND(NOT x)) = OR(x)): ``SHUTDOWN``, ``UNCACHED``
  (a rank has a request the cache does not know), ``INVALID`` (a rank saw a cached
  name with other parameters), ``BUSY`` (a rank has requests in flight: while no rank
  is busy, every rank lengthens its sleep between cycles the same way);
* words 1.. hold one bit per cache position: set when this rank has the request ready.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
from ..errors import InvalidArgumentError, NameNotFoundError

SHUTDOWN, UNCACHED, INVALID, BUSY = 1, 2, 4, 8        # masks of the status word
STATUS_BITS = 4
_STATUS_MASK = (1 << STATUS_BITS) - 1

HIT, MISS, STALE = "hit", "miss", "stale"


class Params(NamedTuple):
    """What must agree on every rank for one collective on a named tensor."""
    shape: tuple
    dtype: str
    op: str
    group: int          # -1: in no group

    def describe(self) -> str:
        g = "" if self.group < 0 else f", group {self.group}"
        return f"shape {list(self.shape)}, {self.dtype}, op {self.op}{g}"


class ResponseCache:
    """Name -> (bit position, params), LRU-evicted, identical on every rank."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise InvalidArgumentError(f"cache capacity must be at least 1, got {capacity}")
        self.capacity = int(capacity)
        self._lru: OrderedDict[str, int] = OrderedDict()   # name -> bit, oldest first
        self._params: list[Params | None] = [None] * self.capacity
        self._names: list[str | None] = [None] * self.capacity
        self._free = list(range(self.capacity))            # a heap: lowest free bit first
        self.evictions = self.invalidations = 0
        self.evicted: list[tuple[str, int]] = []   # (name, bit) evicted by put, for the caller

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def words(self) -> int:
        """Length of the bitvector in int64 words, status word included."""
        return 1 + (self.capacity + 63) // 64

    def lookup(self, name: str, params: Params) -> tuple[str, int]:
        """(HIT, bit), (STALE, bit) when cached with other params, or (MISS, -1)."""
        bit = self._lru.get(name)
        if bit is None:
            return MISS, -1
        if self._params[bit] != params:
            return STALE, bit
        return HIT, bit

    def entry(self, bit: int) -> tuple[str, Params]:
        name = self._names[bit]
        if name is None:
            raise NameNotFoundError(f"cache bit {bit} is empty")
        params = self._params[bit]
        assert params is not None
        return name, params

    def put(self, name: str, params: Params) -> int:
        """Insert (or refresh) ``name``; evicts the least recently used entry when full."""
        bit = self._lru.get(name)
        if bit is not None:
            self._params[bit] = params
            self._lru.move_to_end(name)
            return bit
        if not self._free:
            old, freed = self._lru.popitem(last=False)
            self.evicted.append((old, freed))
            self._names[freed] = self._params[freed] = None
            heapq.heappush(self._free, freed)
            self.evictions += 1
        bit = heapq.heappop(self._free)
        self._lru[name] = bit
        self._names[bit], self._params[bit] = name, params
        return bit

    def touch(self, name: str) -> None:
        self._lru.move_to_end(name)

    def erase(self, bits) -> None:
        for bit in sorted(int(b) for b in bits):
            name = self._names[bit]
            if name is None:
                continue
            del self._lru[name]
            self._names[bit] = self._params[bit] = None
            heapq.heappush(self._free, bit)
            self.invalidations += 1

    def names_in_lru_order(self) -> list[str]:
        return list(self._lru)


# ---------------------------------------------------------------------------------------
# bitvectors

def new_vector(words: int, status: int = 0) -> np.ndarray:
    """A bitvector with no request bits and ``status`` (a mask of status bits) stored inverted."""
    v = np.zeros(words, dtype=np.int64)
    v[0] = ~np.int64(status & _STATUS_MASK)
    return v


def set_bits(vec: np.ndarray, bits) -> None:
    b = np.asarray(bits, dtype=np.int64)
    if b.size:
        np.bitwise_or.at(vec, 1 + b // 64, np.left_shift(np.int64(1), b % 64))


def status_of(vec: np.ndarray) -> int:
    """Status bits set on any rank, from an AND-reduced vector."""
    return int(~vec[0]) & _STATUS_MASK


def bits_of(vec: np.ndarray) -> np.ndarray:
    """Ascending positions of the request bits set in ``vec``."""
    # little-endian words: bit k of word w is request bit 64 w + k
    body = vec[1:].astype("<i8", copy=False).view(np.uint8)
    return np.flatnonzero(np.unpackbits(body, bitorder="little"))


def invert_request_bits(vec: np.ndarray) -> np.ndarray:
    """Request bits stored inverted (for an OR through a BAND reduction)."""
    out = ~vec
    out[0] = vec[0]
    return out
