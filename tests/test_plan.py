"""AccessPlan: deterministic, complete, balanced, elastic; NoPFS frequency analysis."""

from __future__ import annotations

import numpy as np
import pytest

from forebay import AccessPlan
from forebay.plan import frequency_tail, frequency_tail_monte_carlo, permutation, positions


def test_permutation_is_fixed_across_platforms_and_versions():
    # Golden values: the shuffle must never change, or resumed runs and caches break.
    assert permutation(1000, 42, 3)[:10].tolist() == [334, 891, 923, 451, 587, 122, 81, 343,
                                                      203, 581]
    p = permutation(5000, 7, 0)
    assert sorted(p.tolist()) == list(range(5000))
    assert not np.array_equal(p, permutation(5000, 7, 1))
    assert not np.array_equal(p, permutation(5000, 8, 0))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_with_an_inverse(n):
    p = permutation(n, 3, 1)
    assert sorted(p.tolist()) == list(range(n))
    np.testing.assert_array_equal(positions(n, 3, 1, p), np.arange(n))
    some = np.array([0, n - 1, n // 2])
    np.testing.assert_array_equal(p[positions(n, 3, 1, some)], some)


def test_shuffles_look_random():
    p, q = permutation(100_000, 0, 0), permutation(100_000, 0, 1)
    assert abs(np.corrcoef(np.arange(100_000), p)[0, 1]) < 0.02
    assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.02
    assert abs(np.corrcoef(p, q)[0, 1]) < 0.02
    # where sample 0 lands is uniform over positions (chi-square, 10 bins, 4000 seeds)
    pos = np.array([int(positions(10, s, 0, [0])[0]) for s in range(4000)])
    counts = np.bincount(pos, minlength=10)
    assert ((counts - 400) ** 2 / 400).sum() < 30  # 9 dof: p < 0.001


def test_same_arguments_same_plan():
    a = AccessPlan(1000, 4, 16, 3, seed=5)
    b = AccessPlan(1000, 4, 16, 3, seed=5)
    for e in range(3):
        for r in range(4):
            np.testing.assert_array_equal(a.batches(r, e), b.batches(r, e))
    assert not np.array_equal(a.stream(0, 0), AccessPlan(1000, 4, 16, 3, seed=6).stream(0, 0))


@pytest.mark.parametrize("n, world, batch", [(1000, 4, 16), (1024, 4, 16), (37, 3, 5),
                                             (10, 4, 8), (10, 4, 10)])
def test_every_sample_each_epoch_with_documented_padding(n, world, batch):
    plan = AccessPlan(n, world, batch, epochs=2, seed=1)
    for e in range(2):
        streams = [plan.stream(r, e) for r in range(world)]
        assert len({len(s) for s in streams}) == 1  # equal step counts on every rank
        assert all(plan.batches(r, e).shape == (plan.steps_per_epoch, batch) for r in range(world))
        counts = np.bincount(np.concatenate(streams), minlength=n)
        assert counts.min() >= 1  # every sample read
        assert counts.sum() == n + plan.padding
        assert plan.padding == plan.steps_per_epoch * plan.global_batch - n
        if plan.padding == 0:
            assert (counts == 1).all()


def test_drop_last_skips_the_tail_only():
    plan = AccessPlan(1000, 4, 16, epochs=2, seed=1, drop_last=True)
    assert plan.steps_per_epoch == 15 and plan.padding == 0
    for e in range(2):
        counts = np.bincount(np.concatenate([plan.stream(r, e) for r in range(4)]), minlength=1000)
        assert counts.max() == 1 and counts.sum() == 960


def test_same_global_batches_at_different_world_sizes():
    two = AccessPlan(1000, 2, 8, epochs=2, seed=3)
    four = AccessPlan(1000, 4, 4, epochs=2, seed=3)
    for e in range(2):
        np.testing.assert_array_equal(two.global_batches(e), four.global_batches(e))
        step = 5
        g = np.concatenate([two.batches(r, e)[step] for r in range(2)])
        np.testing.assert_array_equal(g, np.concatenate([four.batches(r, e)[step]
                                                         for r in range(4)]))


def test_frequencies_and_first_access_match_the_streams():
    plan = AccessPlan(200, 3, 7, epochs=4, seed=2)
    for r in range(3):
        whole = np.concatenate(list(plan.iter_epochs(r)))
        np.testing.assert_array_equal(plan.frequencies(r), np.bincount(whole, minlength=200))
        first = plan.first_access(r)
        for i in range(200):
            hits = np.flatnonzero(whole == i)
            assert first[i] == (hits[0] if len(hits) else -1)
    total = sum(plan.frequencies(r) for r in range(3))
    assert total.sum() == 4 * (200 + plan.padding)


def test_no_shuffle_reads_in_order():
    plan = AccessPlan(10, 2, 2, epochs=1, shuffle=False)
    assert plan.global_batches(0)[:2].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_frequency_tail_matches_nopfs_imagenet_example():
    assert frequency_tail(1_281_167, 16, 90, 0.8) == pytest.approx(31_635, abs=1)


def test_monte_carlo_agrees_with_the_binomial():
    plan = AccessPlan(20_000, 8, 25, epochs=24, seed=0)
    analytic = frequency_tail(20_000, 8, 24, 0.8)
    mc = frequency_tail_monte_carlo(plan, 0.8)
    assert analytic > 500
    assert mc == pytest.approx(analytic, rel=0.05)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_samples=10, world_size=2, batch_size=8, epochs=1, drop_last=True), "larger than"),
    (dict(num_samples=10, world_size=1, batch_size=11, epochs=1), "batch_size 11 is larger"),
    (dict(num_samples=10, world_size=0, batch_size=8, epochs=1), "world_size"),
    (dict(num_samples=0, world_size=1, batch_size=8, epochs=1), "num_samples"),
    (dict(num_samples=10, world_size=1, batch_size=-1, epochs=1), "batch_size"),
])
def test_bad_plans(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AccessPlan(**kwargs)


def test_rank_and_epoch_out_of_range():
    plan = AccessPlan(10, 2, 2, epochs=1)
    with pytest.raises(ValueError, match="rank 2"):
        plan.stream(2, 0)
    with pytest.raises(ValueError, match="epoch 1"):
        plan.stream(0, 1)


def test_cli_plan(cli):
    code, out, _ = cli("plan", "--samples", "1281167", "--world", "16", "--epochs", "90",
                       "--delta", "0.8")
    assert code == 0 and "31,634.7" in out


def test_a_monte_carlo_count_beyond_memory_is_refused(cli, monkeypatch):
    """Issue X item 11: 10^12 samples on 4 ranks went on to a 14.6 TiB allocation and an
    ArrayMemoryError traceback."""
    monkeypatch.setenv("FOREBAY_MEMORY_LIMIT", str(1 << 30))
    code, out, err = cli("plan", "--samples", "1000000000000", "--world", "4", "--epochs",
                         "2", "--monte-carlo")
    assert code == 2 and "Traceback" not in err, err
    assert "needs about 80.0 TiB" in err and "no --monte-carlo" in err, err
