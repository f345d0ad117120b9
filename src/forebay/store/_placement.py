"""Clairvoyant placement: which rank caches which sample in which tier, in which order.

Every rank computes the same placement from the AccessPlan, the samples' sizes and the
ranks' tier capacities (exchanged once), so any rank knows where any sample will be
and at which position of its owner's fill order, without asking anyone.

1. *Coverage first*: each sample gets one owner (the rank that reads it first in the
   run; RAM before SSD, in order of first need), so the whole run reads it from the
   parallel file system once.  When that rank is full, the sample goes to the next
   free space in rank order (RAM of every rank, then SSD), still in order of first
   need.  Samples that fit nowhere have no owner: they stream from the PFS.
2. Each rank then fills what is left of its RAM, then SSD, with the samples *it* reads
   most often over the run (NoPFS Sec. 5.1) among those it does not own.
3. Inside a tier, samples are filled in the order they are first needed: by any rank
   for owned (coverage) copies, by the rank itself for its extra copies.

Cost on each rank: O(F) memory (a few int64 arrays of F entries, never F x ranks) and
O(F log F + E F / N) time: epoch 0's positions and one sort for coverage, then the
rank's own stream over E epochs for its frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import AccessPlan
from .._intervals import positions_in_runs
from ..errors import InvalidArgumentError
from ..vocab import Tier

__all__ = ["Coverage", "Placement", "compute_coverage", "compute_placement", "fill_tiers",
           "RAM", "SSD", "NONE"]

# the tiers of a placement (forebay.vocab.Tier; IntEnum members compare equal to the
# integers stored in the placement's arrays)
RAM, SSD, NONE = Tier.RAM, Tier.SSD, Tier.NONE


@dataclass(frozen=True)
class Placement:
    """The placement of one run, as seen by ``rank``.

    Attributes:
        owner: ``int32[F]`` rank holding each sample's coverage copy, -1 if none.
        tier: ``int8[F]`` tier of that copy (RAM 0, SSD 1, none -1).
        slot: ``int64[F]`` position of the sample in its owner's fill order of that tier.
        first_need: ``int64[F]`` global position (step * global batch + offset) at which
            the run first reads each sample; -1 if never.
        extra_ram, extra_ssd: ids this rank also caches for itself, in fill order.
        own_ram, own_ssd: ids whose coverage copy this rank holds, in fill order.
    """

    rank: int
    owner: np.ndarray
    tier: np.ndarray
    slot: np.ndarray
    first_need: np.ndarray
    own_ram: np.ndarray
    own_ssd: np.ndarray
    extra_ram: np.ndarray
    extra_ssd: np.ndarray
    ram_used: np.ndarray  # bytes of coverage copies per rank
    ssd_used: np.ndarray

    @property
    def covered(self) -> float:
        """Fraction of the samples that have a coverage copy."""
        return float((self.owner >= 0).mean()) if len(self.owner) else 1.0

    def ram_order(self) -> np.ndarray:
        """This rank's RAM fill order: its coverage copies, then its extra copies."""
        return np.concatenate([self.own_ram, self.extra_ram])

    def ssd_order(self) -> np.ndarray:
        return np.concatenate([self.own_ssd, self.extra_ssd])


def _first_need(plan: AccessPlan) -> tuple[np.ndarray, np.ndarray]:
    """Global first position and first reader of every sample (-1 if never read)."""
    f = plan.num_samples
    ids = np.arange(f, dtype=np.int64)
    first = np.full(f, -1, dtype=np.int64)
    span = plan.steps_per_epoch * plan.global_batch
    todo = ids
    for e in range(plan.epochs):
        pos = plan.position(e, todo)
        hit = pos >= 0
        first[todo[hit]] = e * span + pos[hit]
        todo = todo[~hit]
        if len(todo) == 0:
            break
    reader = np.where(first >= 0, (first % plan.global_batch) // plan.batch_size, -1)
    return first, reader


def fill_tiers(order: np.ndarray, sizes: np.ndarray, ram: int, ssd: int) -> np.ndarray:
    """``int8`` tier (RAM, SSD or NONE) of each id of ``order``: RAM takes the longest
    prefix of ``order`` that fits ``ram`` bytes, SSD the longest prefix of the rest that
    fits ``ssd`` (shared by the placement and the simulator's policies)."""
    cum = np.cumsum(sizes[order])
    tier = np.full(len(order), NONE, dtype=np.int8)
    in_ram = cum <= ram
    tier[in_ram] = RAM
    rest = ~in_ram
    tier[rest] = np.where(np.cumsum(sizes[order[rest]]) <= ssd, SSD, NONE)
    return tier


def _group_cumsum(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``values`` restarting at each change of ``groups``
    (``groups`` sorted)."""
    cum = np.cumsum(values)
    if len(values) == 0:
        return cum
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    base = np.repeat(cum[starts] - values[starts], np.diff(np.r_[starts, len(values)]))
    return cum - base


@dataclass(frozen=True)
class Coverage:
    """The part of a placement every rank shares (steps 1 and 3 of the module's
    description): coverage owners and tiers, fill slots, first needs, bytes used per
    rank, and each held sample's (owner, tier) key in fill order."""

    owner: np.ndarray
    tier: np.ndarray
    slot: np.ndarray
    first_need: np.ndarray
    ram_used: np.ndarray
    ssd_used: np.ndarray
    fill: np.ndarray       # held ids, by (owner, tier), then first need
    fill_key: np.ndarray   # owner * 2 + tier of each id in ``fill``


def compute_coverage(plan: AccessPlan, sizes: np.ndarray, ram_bytes: "np.ndarray | list[int]",
                     ssd_bytes: "np.ndarray | list[int]") -> Coverage:
    """The coverage of a run, the same on every rank (see :func:`compute_placement`,
    which adds one rank's extra copies; a simulator of many ranks computes this once)."""
    n_ranks, f = plan.world_size, plan.num_samples
    sizes = np.asarray(sizes, dtype=np.int64)
    ram = np.asarray(ram_bytes, dtype=np.int64)
    ssd = np.asarray(ssd_bytes, dtype=np.int64)
    if len(sizes) != f or len(ram) != n_ranks or len(ssd) != n_ranks:
        raise InvalidArgumentError("sizes must have one entry per sample, capacities one per rank")
    if (ram < 0).any() or (ssd < 0).any() or (sizes < 0).any():
        raise InvalidArgumentError("sizes and capacities must be non-negative")
    first, reader = _first_need(plan)
    owner = np.full(f, -1, dtype=np.int32)
    tier = np.full(f, NONE, dtype=np.int8)

    # 1a. each sample to its first reader, RAM then SSD, in order of first need
    read = np.flatnonzero(first >= 0)
    order = read[np.lexsort((first[read], reader[read]))]
    grp = reader[order]
    cum = _group_cumsum(sizes[order], grp)
    in_ram = cum <= ram[grp]
    owner[order[in_ram]] = grp[in_ram]
    tier[order[in_ram]] = RAM
    rest = order[~in_ram]
    cum2 = _group_cumsum(sizes[rest], reader[rest])
    in_ssd = cum2 <= ssd[reader[rest]]
    owner[rest[in_ssd]] = reader[rest[in_ssd]]
    tier[rest[in_ssd]] = SSD
    spill = rest[~in_ssd]

    # 1b. spilled samples into the space left, RAM of every rank then SSD, by first need
    ram_used = np.bincount(owner[tier == RAM], weights=sizes[tier == RAM],
                           minlength=n_ranks).astype(np.int64)
    ssd_used = np.bincount(owner[tier == SSD], weights=sizes[tier == SSD],
                           minlength=n_ranks).astype(np.int64)
    if len(spill):
        spill = spill[np.argsort(first[spill], kind="stable")]
        cap = np.concatenate([ram - ram_used, ssd - ssd_used])
        cap_end = np.cumsum(cap)
        ends = np.cumsum(sizes[spill])
        bins = np.searchsorted(cap_end, ends, side="left")
        ok = bins < len(cap)
        ok[ok] &= (ends[ok] - sizes[spill[ok]]) >= cap_end[bins[ok]] - cap[bins[ok]]
        owner[spill[ok]] = bins[ok] % n_ranks
        tier[spill[ok]] = np.where(bins[ok] < n_ranks, RAM, SSD)
        left = cap - np.bincount(bins[ok], weights=sizes[spill[ok]], minlength=len(cap))
        for i in spill[~ok].tolist():  # straddlers of bin edges: at most one per bin
            b = int(np.argmax(left >= sizes[i]))
            if left[b] >= sizes[i]:
                owner[i], tier[i] = b % n_ranks, RAM if b < n_ranks else SSD
                left[b] -= sizes[i]
        ram_used = ram - left[:n_ranks]
        ssd_used = ssd - left[n_ranks:]

    # 3. fill order inside each (owner, tier): by first need
    slot = np.full(f, -1, dtype=np.int64)
    held = np.flatnonzero(owner >= 0)
    o = held[np.lexsort((first[held], owner[held].astype(np.int64) * 2 + tier[held]))]
    k = owner[o].astype(np.int64) * 2 + tier[o]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(o) else np.zeros(0, np.int64)
    slot[o] = positions_in_runs(np.diff(np.r_[starts, len(o)]))
    return Coverage(owner=owner, tier=tier, slot=slot, first_need=first, ram_used=ram_used,
                    ssd_used=ssd_used, fill=o, fill_key=k)


def compute_placement(plan: AccessPlan, sizes: np.ndarray, ram_bytes: "np.ndarray | list[int]",
                      ssd_bytes: "np.ndarray | list[int]", rank: int,
                      coverage: "Coverage | None" = None,
                      shares_memory_with: "np.ndarray | list[int] | None" = None
                      ) -> Placement:
    """Placement of a run for ``rank`` (identical coverage on every rank).

    Args:
        plan: the run's access plan.
        sizes: ``int64[F]`` bytes each sample occupies in a tier.
        ram_bytes, ssd_bytes: capacity of each rank's RAM and SSD tier (length N).
        rank: whose extra copies to compute.
        coverage: :func:`compute_coverage` of the same arguments, when already known
            (a simulator placing every rank computes it once).
        shares_memory_with: ranks whose tiers ``rank`` reads as its own memory (the
            ranks of its node, with the shm transport): no extra copy is made of a
            sample one of them holds (it would cost memory and a copy, and save
            nothing).
    """
    cov = coverage if coverage is not None else \
        compute_coverage(plan, sizes, ram_bytes, ssd_bytes)
    sizes = np.asarray(sizes, dtype=np.int64)
    ram = np.asarray(ram_bytes, dtype=np.int64)
    ssd = np.asarray(ssd_bytes, dtype=np.int64)
    mine_ram = cov.fill[cov.fill_key == rank * 2 + RAM]
    mine_ssd = cov.fill[cov.fill_key == rank * 2 + SSD]

    # 2. this rank's extra copies: what it reads most often, among what it does not own
    freq = plan.frequencies(rank)
    own_first = plan.first_access(rank)
    cand = np.flatnonzero((freq > 0) & (cov.owner != rank))
    if shares_memory_with is not None and len(shares_memory_with):
        cand = cand[~np.isin(cov.owner[cand], np.asarray(shares_memory_with))]
    cand = cand[np.lexsort((cand, own_first[cand], -freq[cand]))]
    where = fill_tiers(cand, sizes, int(ram[rank] - cov.ram_used[rank]),
                       int(ssd[rank] - cov.ssd_used[rank]))
    extra_ram = cand[where == RAM]
    extra_ssd = cand[where == SSD]
    extra_ram = extra_ram[np.argsort(own_first[extra_ram], kind="stable")]
    extra_ssd = extra_ssd[np.argsort(own_first[extra_ssd], kind="stable")]
    return Placement(rank=rank, owner=cov.owner, tier=cov.tier, slot=cov.slot,
                     first_need=cov.first_need, own_ram=mine_ram, own_ssd=mine_ssd,
                     extra_ram=extra_ram, extra_ssd=extra_ssd, ram_used=cov.ram_used,
                     ssd_used=cov.ssd_used)
