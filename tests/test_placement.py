"""Clairvoyant placement: identical on every rank, within capacity, coverage first."""

from __future__ import annotations

import numpy as np
import pytest

from forebay import AccessPlan
from forebay.store import compute_placement
from forebay.store._placement import NONE, RAM, SSD, compute_coverage


def _sizes(n, seed=0):
    return np.random.default_rng(seed).integers(1, 50, n) * 64


def _held_bytes(p, sizes, rank, tier):
    own = p.own_ram if tier == RAM else p.own_ssd
    extra = p.extra_ram if tier == RAM else p.extra_ssd
    return int(sizes[own].sum() + sizes[extra].sum())


@pytest.mark.parametrize("drop_last", [False, True])
def test_coverage_is_identical_on_every_rank_and_within_capacity(drop_last):
    plan = AccessPlan(3000, 4, 16, epochs=5, seed=1, drop_last=drop_last)
    sizes = _sizes(3000)
    ram = np.array([20_000, 60_000, 0, 40_000]) * 10
    ssd = np.array([30_000, 0, 50_000, 10_000]) * 10
    ps = [compute_placement(plan, sizes, ram, ssd, r) for r in range(4)]
    for p in ps[1:]:
        np.testing.assert_array_equal(p.owner, ps[0].owner)
        np.testing.assert_array_equal(p.tier, ps[0].tier)
        np.testing.assert_array_equal(p.slot, ps[0].slot)
    for r, p in enumerate(ps):
        assert _held_bytes(p, sizes, r, RAM) <= ram[r]
        assert _held_bytes(p, sizes, r, SSD) <= ssd[r]
        # own coverage copies are exactly those with owner r, in slot order
        for tier, own in ((RAM, p.own_ram), (SSD, p.own_ssd)):
            want = np.flatnonzero((p.owner == r) & (p.tier == tier))
            assert sorted(own.tolist()) == want.tolist()
            np.testing.assert_array_equal(p.slot[own], np.arange(len(own)))
            assert (np.diff(p.first_need[own]) > 0).all()  # filled in order of first need
        assert not np.isin(p.extra_ram, np.flatnonzero(p.owner == r)).any()
        assert len(np.intersect1d(p.extra_ram, p.extra_ssd)) == 0
    # the shared coverage computed once (as the simulator does) gives the same placements
    cov = compute_coverage(plan, sizes, ram, ssd)
    for r, p in enumerate(ps):
        q = compute_placement(plan, sizes, ram, ssd, r, coverage=cov)
        for name in ("owner", "tier", "slot", "first_need", "own_ram", "own_ssd",
                     "extra_ram", "extra_ssd", "ram_used", "ssd_used"):
            np.testing.assert_array_equal(getattr(q, name), getattr(p, name))


def test_everything_covered_when_capacity_allows_and_owner_reads_first():
    plan = AccessPlan(2000, 4, 8, epochs=3, seed=2)
    sizes = _sizes(2000, 1)
    total = sizes.sum()
    ram = np.full(4, total // 4 + 5_000)  # ample: every first reader has room
    p = compute_placement(plan, sizes, ram, np.zeros(4, np.int64), 0)
    assert p.covered == 1.0 and (p.tier == RAM).all()
    first_reader = (p.first_need % plan.global_batch) // plan.batch_size
    assert (p.owner == first_reader).mean() > 0.95  # first readers, bar a few spilled
    # aggregate capacity just above the dataset: still complete, spilling across ranks
    tight = np.array([total * 0.7, total * 0.1, total * 0.1, total * 0.11]).astype(np.int64)
    p = compute_placement(plan, sizes, tight, np.zeros(4, np.int64), 1)
    assert p.covered == 1.0
    assert all(p.ram_used[r] <= tight[r] for r in range(4))


def test_more_data_than_tiers_streams_the_rest():
    plan = AccessPlan(1000, 2, 10, epochs=2, seed=3)
    sizes = np.full(1000, 640)
    p = compute_placement(plan, sizes, [64_000, 64_000], [0, 0], 0)
    assert (p.owner >= 0).sum() == 200 and (p.tier[p.owner < 0] == NONE).all()
    assert len(p.extra_ram) == 0  # coverage used every byte
    z = compute_placement(plan, sizes, [0, 0], [0, 0], 1)
    assert z.covered == 0.0 and len(z.extra_ram) == len(z.extra_ssd) == 0


def test_extras_are_the_ranks_most_frequent_samples():
    plan = AccessPlan(500, 4, 5, epochs=12, seed=4)
    sizes = np.full(500, 64)
    ram = np.full(4, 64 * 200)  # coverage takes ~125 per rank, ~75 slots left for extras
    p = compute_placement(plan, sizes, ram, np.zeros(4, np.int64), 1)
    assert p.covered == 1.0
    assert len(p.own_ram) + len(p.extra_ram) == 200 and len(p.extra_ram) > 50
    freq = plan.frequencies(1)
    held = np.concatenate([p.own_ram, p.extra_ram])
    others = np.setdiff1d(np.flatnonzero(freq > 0), held)
    assert freq[p.extra_ram].min() >= freq[others].max()
    own_first = plan.first_access(1)
    assert (np.diff(own_first[p.extra_ram]) > 0).all()  # filled in the order it needs them


def test_bad_capacities():
    plan = AccessPlan(10, 2, 2, epochs=1)
    with pytest.raises(ValueError, match="one per rank"):
        compute_placement(plan, np.ones(10), [1], [1, 1], 0)
    with pytest.raises(ValueError, match="non-negative"):
        compute_placement(plan, np.ones(10), [-1, 1], [1, 1], 0)
