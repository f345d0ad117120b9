"""Weighted mixtures of packed datasets: several sources trained on as one, in
proportions, with the same guarantees as one dataset's plan.

``Mixture({"web.fb": 0.7, "code.fb": 0.3})`` is given to :class:`forebay.torch.DataLoader`
(or :meth:`Mixture.plan` for an :class:`~forebay.AccessPlan`) in place of a dataset.
The sources are read as one :class:`~forebay.dataset.ConcatDataset` (ids run through
the first source, then the second, ...; nothing is copied), so every store (preload,
clairvoyant, direct) serves a mixture as it serves one dataset; the mixture decides
which of those ids each position of an epoch reads.  Like the plan's shuffle it is a
pure function of ``(seed, epoch)``: every rank derives the same epochs without
communication, the global batches are the same at any world size, and a run resumes
mid-epoch or at another world size exactly.

Policies (what happens when a source's share of an epoch is not its size):

``"cycle"`` (default)
    Each epoch has ``samples_per_epoch`` positions (default: the sources' total) and
    source i gets exactly ``round(w_i * samples_per_epoch)`` of them (largest
    remainders).  Each source is an endless sequence of its own shuffled passes, and
    an epoch takes its share from where the last epoch stopped: a small source repeats
    (cycles), a large one is covered over several epochs, and every sample of a
    source is read once before any is read twice.
``"stop"``
    The epoch ends when the first source is exhausted: ``samples_per_epoch`` defaults
    to ``min_i floor(n_i / w_i)``, each source's share is drawn from a fresh shuffle of
    it every epoch, and no sample is read twice in an epoch (a share larger than a
    source is an error).
``"sample"``
    Each position draws its source by weight and a sample of it uniformly, with
    replacement (``samples_per_epoch`` defaults to the total): the shares are only
    right on average.

``schedule={epoch: weights}`` changes the weights from that epoch on (curricula); the
number of positions per epoch stays the same (``"stop"`` then needs
``samples_per_epoch``).  The shares of the sources in every epoch are in
:meth:`MixtureOrder.counts`; ``forebay plan --mix`` prints them.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import InvalidArgumentError
from .plan import AccessPlan, EpochOrder, _epoch_key, _Feistel, _splitmix64

__all__ = ["Mixture", "MixtureOrder", "POLICIES"]

POLICIES = ("cycle", "stop", "sample")

Weights = Union[Mapping[Any, float], Sequence[tuple[Any, float]]]

#: separates the sources' own shuffles from the plan's interleaving
_SOURCE_SALT = 0x6D69787475726521
_U53 = float(2 ** -53)


def _weights(given: Weights, what: str) -> tuple[list[str], list[float]]:
    items = list(given.items()) if isinstance(given, Mapping) else list(given)
    if not items:
        raise InvalidArgumentError(f"{what}: no sources")
    names, values = [], []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidArgumentError(f"{what}: give {{path: weight}} or [(path, weight)], "
                                       f"got {item!r}")
        path, w = item
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"{what}: a source is a dataset's path, got {path!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(w)) or w < 0:
            raise InvalidArgumentError(f"{what}: the weight of {os.fspath(path)} must be a "
                                       f"finite number >= 0, got {w!r}")
        names.append(os.fspath(path))
        values.append(float(w))
    if sum(values) <= 0:
        raise InvalidArgumentError(f"{what}: every weight is 0")
    return names, values


class Mixture:
    """Several packed datasets with one schema, read in proportions.

    Args:
        sources: ``{path: weight}`` (or a list of ``(path, weight)``); weights are
            relative (normalised to sum to 1), 0 leaves a source out of an epoch.
        policy: ``"cycle"``, ``"stop"`` or ``"sample"`` (module docstring).
        samples_per_epoch: positions per epoch (default by policy: the sources'
            total, or for ``"stop"`` where the first source is exhausted).
        schedule: ``{epoch: weights}``: from that epoch on, these weights (same sources;
            one left out has weight 0).
    """

    def __init__(self, sources: Weights, *, policy: str = "cycle",
                 samples_per_epoch: Optional[int] = None,
                 schedule: Optional[Mapping[int, Weights]] = None) -> None:
        self.paths, base = _weights(sources, "Mixture")
        seen: dict[str, str] = {}
        for p in self.paths:
            real = os.path.realpath(p)
            if real in seen:
                raise InvalidArgumentError(f"Mixture: {p} and {seen[real]} are the same "
                                           f"dataset: give it once, with the sum of weights")
            seen[real] = p
        if policy not in POLICIES:
            raise InvalidArgumentError(f"Mixture: policy must be one of {POLICIES}, "
                                       f"got {policy!r}")
        self.policy = policy
        if samples_per_epoch is not None and (
                isinstance(samples_per_epoch, bool)
                or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch <= 0):
            raise InvalidArgumentError(f"Mixture: samples_per_epoch must be a positive "
                                       f"integer, got {samples_per_epoch!r}")
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        steps: list[tuple[int, tuple[float, ...]]] = [(0, self._normalised(base))]
        for epoch, weights in sorted((schedule or {}).items(), key=lambda kv: kv[0]):
            if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
                raise InvalidArgumentError(f"Mixture: a schedule's keys are epochs (integers "
                                           f">= 0), got {epoch!r}")
            names, values = _weights(weights, f"Mixture schedule at epoch {epoch}")
            unknown = sorted(set(names) - set(self.paths))
            if unknown:
                raise InvalidArgumentError(f"Mixture schedule at epoch {epoch}: {unknown[0]} "
                                           f"is not one of the sources {self.paths}")
            by_name = dict(zip(names, values))
            w = self._normalised([by_name.get(p, 0.0) for p in self.paths])
            steps = [s for s in steps if s[0] != epoch] + [(int(epoch), w)]
        self.schedule = tuple(steps)
        if schedule and policy == "stop" and self.samples_per_epoch is None:
            raise InvalidArgumentError(
                "Mixture: with policy 'stop' and a schedule, give samples_per_epoch (the "
                "steps per epoch must be the same every epoch)")

    @staticmethod
    def _normalised(values: Sequence[float]) -> tuple[float, ...]:
        total = math.fsum(values)
        return tuple(v / total for v in values)

    @property
    def weights(self) -> tuple[float, ...]:
        """The normalised weights of epoch 0, in the sources' order."""
        return self.schedule[0][1]

    def open(self, *, verify_on_read: bool = False) -> Any:
        """The sources as one :class:`~forebay.dataset.ConcatDataset`."""
        from .dataset import ConcatDataset

        return ConcatDataset(self.paths, verify_on_read=verify_on_read)

    def order(self, sizes: Sequence[int]) -> "MixtureOrder":
        """The epoch order over sources of these sizes (the datasets' lengths)."""
        return MixtureOrder(self, [int(n) for n in sizes])

    def plan(self, world_size: int, batch_size: int, epochs: int, seed: int = 0, *,
             drop_last: bool = False, shuffle: bool = True) -> AccessPlan:
        """The :class:`~forebay.AccessPlan` of a run over this mixture (reads the
        sources' manifests for their sizes)."""
        from pathlib import Path

        from .dataset import Manifest

        sizes = [Manifest.read(Path(p)).num_samples for p in self.paths]
        order = self.order(sizes)
        return AccessPlan(sum(sizes), world_size, batch_size, epochs, seed,
                          drop_last=drop_last, shuffle=shuffle, order=order)

    def __repr__(self) -> str:
        parts = ", ".join(f"{p!r}: {w:.4g}" for p, w in zip(self.paths, self.weights))
        return f"Mixture({{{parts}}}, policy={self.policy!r})"


class MixtureOrder(EpochOrder):
    """A :class:`Mixture` over sources of known sizes: which id each position of an
    epoch reads (an :class:`~forebay.plan.EpochOrder` for the plan)."""

    def __init__(self, mixture: Mixture, sizes: Sequence[int]) -> None:
        if len(sizes) != len(mixture.paths):
            raise InvalidArgumentError(f"{len(sizes)} sizes for {len(mixture.paths)} sources")
        for p, n in zip(mixture.paths, sizes):
            if n <= 0:
                raise InvalidArgumentError(f"Mixture: {p} holds no samples")
        self.mixture = mixture
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.num_samples = int(self.sizes.sum())
        self.policy = mixture.policy
        if mixture.samples_per_epoch is not None:
            self.epoch_length = mixture.samples_per_epoch
        elif self.policy == "stop":
            w = np.asarray(mixture.weights)
            live = w > 0
            self.epoch_length = int(np.floor(self.sizes[live] / w[live]).min())
        else:
            self.epoch_length = self.num_samples
        self._counts: dict[int, np.ndarray] = {}
        self._cursor: dict[int, np.ndarray] = {0: np.zeros(len(self.sizes), np.int64)}
        if self.policy == "stop":
            for start, _ in mixture.schedule:
                self._check_stop(start)

    def _check_stop(self, epoch: int) -> None:
        over = np.flatnonzero(self.counts(epoch) > self.sizes)
        if len(over):
            i = int(over[0])
            raise InvalidArgumentError(
                f"Mixture (policy 'stop'): epoch {epoch} needs {int(self.counts(epoch)[i])} "
                f"samples of {self.mixture.paths[i]}, which holds {int(self.sizes[i])}: "
                f"fewer samples_per_epoch, or policy 'cycle'")

    def weights_at(self, epoch: int) -> np.ndarray:
        """The normalised weights in force at ``epoch``."""
        w = self.mixture.schedule[0][1]
        for start, weights in self.mixture.schedule:
            if start <= epoch:
                w = weights
        return np.asarray(w, dtype=np.float64)

    def counts(self, epoch: int) -> np.ndarray:
        """``int64[sources]``: positions of ``epoch`` each source fills (exact for
        "cycle" and "stop": largest remainders of ``w_i * samples_per_epoch``;
        "sample" draws them, these are the expected shares rounded the same way)."""
        got = self._counts.get(epoch)
        if got is None:
            raw = self.weights_at(epoch) * self.epoch_length
            got = np.floor(raw).astype(np.int64)
            left = self.epoch_length - int(got.sum())
            if left > 0:   # the largest fractional parts, ties to the earlier source
                got[np.argsort(-(raw - got), kind="stable")[:left]] += 1
            self._counts[epoch] = got
        return got

    def _cursor_at(self, epoch: int) -> np.ndarray:
        """How far into its endless sequence of passes each source is when ``epoch``
        starts ("cycle")."""
        known = max(e for e in self._cursor if e <= epoch)
        cur = self._cursor[known]
        for e in range(known, epoch):
            cur = cur + self.counts(e)
            self._cursor[e + 1] = cur
        return cur

    def ids_at(self, seed: int, epoch: int, pos: np.ndarray, shuffle: bool) -> np.ndarray:
        pos = np.asarray(pos, dtype=np.int64)
        return self._ids(seed, epoch, pos.reshape(-1), shuffle).reshape(pos.shape)

    def _ids(self, seed: int, epoch: int, pos: np.ndarray, shuffle: bool) -> np.ndarray:
        if self.policy == "sample":
            return self._sampled(seed, epoch, pos, shuffle)
        counts = self.counts(epoch)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        # the epoch is the sources' shares one after the other, then interleaved
        slot = _Feistel(self.epoch_length, _epoch_key(seed, epoch)).forward(pos) \
            if shuffle else pos
        # the source whose share holds the slot (one with no share holds none)
        src = np.searchsorted(np.cumsum(counts), slot, side="right")
        q = slot - starts[src]
        if self.policy == "cycle":
            q = q + self._cursor_at(epoch)[src]
        out = np.empty(len(pos), dtype=np.int64)
        for i in np.unique(src).tolist():
            m = src == i
            out[m] = self.offsets[i] + self._local(seed, epoch, i, q[m], shuffle)
        return out

    def _local(self, seed: int, epoch: int, i: int, q: np.ndarray, shuffle: bool) -> np.ndarray:
        """Source i's samples at places ``q`` of its sequence: pass ``q // n``, each
        pass a shuffle of the source ("stop": one fresh shuffle per epoch)."""
        n = int(self.sizes[i])
        if not shuffle:
            return q % n
        source_seed = int(_splitmix64(np.array([(seed ^ _SOURCE_SALT) + i],
                                               dtype=np.uint64))[0])
        passes = q // n
        local = np.empty(len(q), dtype=np.int64)
        for k in np.unique(passes).tolist():
            m = passes == k
            key = _epoch_key(source_seed, epoch if self.policy == "stop" else k)
            local[m] = _Feistel(n, key).forward(q[m] % n)
        return local

    def _sampled(self, seed: int, epoch: int, pos: np.ndarray, shuffle: bool) -> np.ndarray:
        if not shuffle:
            raise InvalidArgumentError("Mixture policy 'sample' draws at random: it has no "
                                       "order for shuffle=False (use 'cycle')")
        key = _epoch_key(seed ^ _SOURCE_SALT, epoch)
        with np.errstate(over="ignore"):
            h = _splitmix64(pos.astype(np.uint64) + key)
            h2 = _splitmix64(h)
        u = (h >> np.uint64(11)).astype(np.float64) * _U53
        w = self.weights_at(epoch)
        # a source of weight 0 is never drawn (its cumulative step is empty), nor past
        # the last positive one when rounding leaves the sum under 1
        src = np.minimum(np.searchsorted(np.cumsum(w), u, side="right"),
                         int(np.flatnonzero(w > 0)[-1]))
        return self.offsets[src] + (h2 % self.sizes[src].astype(np.uint64)).astype(np.int64)

    def describe(self) -> dict:
        # the sources themselves: the ConcatDataset's fingerprint
        return {"sizes": self.sizes.tolist(),
                "policy": self.policy, "epoch_length": self.epoch_length,
                "schedule": [[e, list(w)] for e, w in self.mixture.schedule]}
