"""Access plans: every rank's access stream, for every epoch, from the seed alone.

The shuffle is a pure function of ``(seed, epoch)``: a keyed Feistel bijection of the
positions, computed with integer arithmetic in numpy (no dependence on a random-number
library's stream, O(F) per epoch, invertible per sample), so every rank of every
job on every machine derives the same epochs without communication.  This is what
makes placement, prefetching and caching *clairvoyant* (NoPFS): any rank knows what
any rank will read, and when.

Batches.  ``batch_size`` is the per-rank batch; the *global batch* is
``batch_size * world_size``.  Epoch e's permutation is cut into consecutive global
batches; rank r takes slice ``[r*batch_size, (r+1)*batch_size)`` of each.  The
sequence of global batches depends only on ``(seed, epoch, num_samples, global batch
size)``, so a run resumed with a different world size but the same global batch sees
the same global batches.

Epoch ends.  Every rank gets the same number of steps (no collective can hang).  With
``drop_last=True`` the ``num_samples % global_batch`` samples left over at the end of
the permutation are skipped that epoch (different ones each epoch).  With
``drop_last=False`` (default) the last global batch is completed with the first
samples of the same epoch's permutation: every sample is read at least once per epoch
and exactly ``plan.padding`` of them (fewer than one global batch) twice.  Unlike
``DistributedSampler``, which pads only to a multiple of the world size and leaves the
last batch smaller, every batch is full.

Mixtures.  A plan over several datasets (:class:`forebay.Mixture`) carries an
:class:`EpochOrder`: an epoch is then ``epoch_length`` positions, each mapped to a
sample of one source by the mixture's rule; the cutting into global batches, the
padding and every stream above are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
from .errors import InvalidArgumentError

__all__ = ["AccessPlan", "EpochOrder", "frequency_tail", "frequency_tail_monte_carlo",
           "permutation", "positions", "read_counts"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a bijection of uint64, vectorized (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _epoch_key(seed: int, epoch: int) -> np.uint64:
    k = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    k = _splitmix64(k ^ np.array([epoch & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return k[0]


_ROUNDS = 4
_MIX = np.uint64(0x9E3779B97F4A7C15)
_S29 = np.uint64(29)


class _Feistel:
    """A keyed bijection of ``range(n)``: a balanced Feistel network on the smallest
    even number of bits covering n, with cycle walking for values >= n.  Vectorized,
    O(n) for a whole epoch, and invertible, so one sample's position is O(1)."""

    def __init__(self, n: int, key: np.uint64) -> None:
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        with np.errstate(over="ignore"):
            self.keys = _splitmix64(np.arange(_ROUNDS, dtype=np.uint64) + key)

    def _round(self, r: np.ndarray, k: np.uint64) -> np.ndarray:
        # multiply-xorshift of the keyed half: cheap, and mixes every input bit upward
        with np.errstate(over="ignore"):
            h = (r ^ k) * _MIX
        h ^= h >> _S29
        return (h >> np.uint64(16)) & self.mask

    def _enc(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ self._round(right, k)
        return (left << self.half) | right

    def _dec(self, y: np.ndarray) -> np.ndarray:
        left, right = y >> self.half, y & self.mask
        for k in self.keys[::-1]:
            left, right = right ^ self._round(left, k), left
        return (left << self.half) | right

    def _walk(self, x: np.ndarray, step) -> np.ndarray:
        y = step(x.astype(np.uint64))
        out = y >= self.n
        while out.any():
            y[out] = step(y[out])
            out = y >= self.n
        return y.astype(np.int64)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self._walk(np.asarray(x), self._enc)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        return self._walk(np.asarray(y), self._dec)


def _feistel(num_samples: int, seed: int, epoch: int) -> _Feistel:
    return _Feistel(num_samples, _epoch_key(seed, epoch))


def permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's shuffle of ``range(num_samples)``: entry p is the sample read at
    position p.  A keyed Feistel bijection of the positions, so the whole epoch costs
    O(F) and identical integer arithmetic on every platform."""
    return _feistel(num_samples, seed, epoch).forward(np.arange(num_samples, dtype=np.uint64))


def positions(num_samples: int, seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """Inverse of :func:`permutation` for some ids: where each is read in the epoch."""
    return _feistel(num_samples, seed, epoch).inverse(np.asarray(ids, dtype=np.uint64))


class EpochOrder:
    """What an epoch's positions read when it is not one shuffle of the whole dataset
    (a :class:`forebay.Mixture`'s rule).  Pure functions of their arguments, as the
    plan's own shuffle: every rank derives the same epochs without communication."""

    #: the ids' range (the sum of the sources' sizes)
    num_samples: int
    #: positions in an epoch before the padding to whole global batches
    epoch_length: int

    def ids_at(self, seed: int, epoch: int, pos: np.ndarray, shuffle: bool) -> np.ndarray:
        """Sample ids read at positions ``pos`` (``0 <= pos < epoch_length``)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What ranks and a resumed run must agree on (JSON-able)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AccessPlan:
    """Who reads which sample when, for a whole run.

    Args:
        num_samples: dataset size F.
        world_size: number of data-parallel ranks N.
        batch_size: per-rank batch size.
        epochs: number of epochs E.
        seed: shuffle seed.
        drop_last: skip the incomplete last global batch instead of padding it.
        shuffle: False reads samples in index order every epoch (evaluation).
        order: an :class:`EpochOrder` (a mixture's), None for one shuffle of the
            dataset per epoch.
    """

    num_samples: int
    world_size: int
    batch_size: int
    epochs: int
    seed: int = 0
    drop_last: bool = False
    shuffle: bool = True
    order: Optional[EpochOrder] = None

    def __post_init__(self) -> None:
        for name in ("num_samples", "world_size", "batch_size", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
        if self.order is not None and self.order.num_samples != self.num_samples:
            raise InvalidArgumentError(f"the epoch order covers {self.order.num_samples} "
                                       f"samples, the plan {self.num_samples}")
        what = "the dataset" if self.order is None else "an epoch of the mixture"
        if self.batch_size > self.epoch_length:
            raise InvalidArgumentError(f"batch_size {self.batch_size} is larger than {what} "
                                       f"({self.epoch_length} samples)")
        if self.drop_last and self.global_batch > self.epoch_length:
            raise InvalidArgumentError(
                f"the global batch ({self.batch_size} x {self.world_size} ranks = "
                f"{self.global_batch}) is larger than {what} "
                f"({self.epoch_length} samples): with drop_last no step is left")

    # -- shape of an epoch ------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def epoch_length(self) -> int:
        """Positions in an epoch before padding: the dataset's size, or a mixture's
        epoch."""
        return self.num_samples if self.order is None else self.order.epoch_length

    @property
    def steps_per_epoch(self) -> int:
        q, r = divmod(self.epoch_length, self.global_batch)
        return q if (self.drop_last or r == 0) else q + 1

    @property
    def padding(self) -> int:
        """Positions read twice per epoch to complete the last global batch."""
        return 0 if self.drop_last else self.steps_per_epoch * self.global_batch - \
            self.epoch_length

    def _check(self, rank: Optional[int], epoch: int) -> None:
        if rank is not None and not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"rank {rank} out of range for world size {self.world_size}")
        if not 0 <= epoch < self.epochs:
            raise InvalidArgumentError(f"epoch {epoch} out of range for {self.epochs} epochs")

    # -- streams --------------------------------------------------------------------
    def _ids_at(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """Sample ids read at positions ``pos`` of the epoch (positions past the
        epoch wrap around: the padding repeats the epoch's first samples)."""
        pos = np.asarray(pos, dtype=np.int64) % self.epoch_length
        if self.order is not None:
            return self.order.ids_at(self.seed, epoch, pos, self.shuffle)
        if not self.shuffle:
            return pos
        return _feistel(self.num_samples, self.seed, epoch).forward(pos)

    def position(self, epoch: int, ids: "np.ndarray | list[int]") -> np.ndarray:
        """Where each sample is first read in the epoch's order (``-1``: dropped)."""
        self._check(None, epoch)
        ids = np.asarray(ids, dtype=np.int64)
        if self.order is not None:       # a mixture's epoch: no inverse, one pass
            read, at = np.unique(self.epoch_order(epoch), return_index=True)
            first = np.full(self.num_samples, -1, dtype=np.int64)
            first[read] = at
            return first[ids]
        pos = positions(self.num_samples, self.seed, epoch, ids) if self.shuffle else ids.copy()
        pos[pos >= self.steps_per_epoch * self.global_batch] = -1
        return pos

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's full order of sample ids (the permutation, padded or truncated
        to whole global batches)."""
        self._check(None, epoch)
        return self._ids_at(epoch, np.arange(self.steps_per_epoch * self.global_batch))

    def global_batches(self, epoch: int) -> np.ndarray:
        """``int64[steps, global_batch]``: the global batches of the epoch."""
        return self.epoch_order(epoch).reshape(self.steps_per_epoch, self.global_batch)

    def batches(self, rank: int, epoch: int) -> np.ndarray:
        """``int64[steps, batch_size]``: rank's batches in the epoch, in order.  Costs
        O(steps * batch_size): only this rank's positions are computed."""
        self._check(rank, epoch)
        pos = (np.arange(self.steps_per_epoch, dtype=np.int64)[:, None] * self.global_batch
               + rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64))
        return self._ids_at(epoch, pos)

    def stream(self, rank: int, epoch: int) -> np.ndarray:
        """Rank's sample ids in the order it reads them in the epoch."""
        return self.batches(rank, epoch).reshape(-1)

    def iter_epochs(self, rank: int) -> Iterator[np.ndarray]:
        for e in range(self.epochs):
            yield self.stream(rank, e)

    def frequencies(self, rank: int) -> np.ndarray:
        """``int64[num_samples]``: how often rank reads each sample over all epochs."""
        self._check(rank, 0)
        counts = np.zeros(self.num_samples, dtype=np.int64)
        for s in self.iter_epochs(rank):
            counts += np.bincount(s, minlength=self.num_samples)
        return counts

    def first_access(self, rank: int) -> np.ndarray:
        """``int64[num_samples]``: position in rank's whole-run stream at which each
        sample is first read (``-1`` if never)."""
        first = np.full(self.num_samples, -1, dtype=np.int64)
        offset = 0
        for s in self.iter_epochs(rank):
            pos = np.arange(offset, offset + len(s), dtype=np.int64)
            new = first[s] < 0
            # the earliest position of each new id within this epoch
            ids, idx = np.unique(s[new], return_index=True)
            first[ids] = pos[new][idx]
            offset += len(s)
        return first

    def to_dict(self) -> dict:
        return dict(num_samples=self.num_samples, world_size=self.world_size,
                    batch_size=self.batch_size, epochs=self.epochs, seed=self.seed,
                    drop_last=self.drop_last, shuffle=self.shuffle,
                    **({} if self.order is None else {"order": self.order.describe()}))


def frequency_tail(num_samples: int, world_size: int, epochs: int, delta: float) -> float:
    """Expected number of samples a worker reads more than ``(1+delta) E/N`` times
    (NoPFS Sec. 3.1): ``F * P(X >= ceil((1+delta) E/N))`` with ``X ~ Binomial(E, 1/N)``.

    ImageNet-1k (F=1,281,167, N=16, E=90, delta=0.8) gives about 31,635.
    """
    if world_size <= 0 or epochs <= 0 or num_samples < 0:
        raise InvalidArgumentError("num_samples, world_size and epochs must be positive")
    p = 1.0 / world_size
    k0 = math.ceil((1 + delta) * epochs / world_size)
    tail = 0.0
    for k in range(max(k0, 0), epochs + 1):
        # log-space binomial terms stay finite for large E
        logt = (math.lgamma(epochs + 1) - math.lgamma(k + 1) - math.lgamma(epochs - k + 1)
                + k * math.log(p) + ((epochs - k) * math.log1p(-p) if p < 1 else 0.0))
        tail += math.exp(logt)
    return num_samples * min(tail, 1.0)


def frequency_tail_monte_carlo(plan: AccessPlan, delta: float, progress=None) -> float:
    """The same quantity measured on a real plan: the mean over ranks of the number of
    samples a rank reads at least ``ceil((1+delta) E/N)`` times over the run."""
    k0 = math.ceil((1 + delta) * plan.epochs / plan.world_size)
    return float((read_counts(plan, progress) >= k0).sum(axis=1).mean())


def read_counts(plan: AccessPlan, progress=None) -> np.ndarray:
    """``int32[ranks, samples]``: how often each rank reads each sample over the run.
    One vectorized pass per epoch counts every (rank, sample) pair at once."""
    from .progress import as_progress

    from ._memory import available_memory
    from ._units import human_bytes

    n, f = plan.world_size, plan.num_samples
    span = plan.steps_per_epoch * plan.global_batch
    need = n * f * 16 + span * 24      # the counts, one epoch's bincount, its order
    avail = available_memory()
    if avail is not None and need > avail:
        raise InvalidArgumentError(
            f"the Monte Carlo count of {f:,} samples on {n:,} ranks needs about "
            f"{human_bytes(need)} of memory, {human_bytes(avail)} available: use the "
            f"analytic tail (no --monte-carlo) or fewer samples")
    counts = np.zeros(n * f, dtype=np.int32)
    owner = (np.arange(span) % plan.global_batch) // plan.batch_size
    key_base = owner.astype(np.int64) * f
    prog = as_progress(progress)
    prog.start(plan.epochs, desc="monte carlo", unit="epoch")
    for e in range(plan.epochs):
        counts += np.bincount(key_base + plan.epoch_order(e), minlength=n * f).astype(np.int32)
        prog.update(1)
    prog.close()
    return counts.reshape(n, f)
