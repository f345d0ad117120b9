"""Ranks that disagree on what shapes the plan or the store fail together, naming the
parameter and every rank's value (issue M.1); a damaged sample fails a preload on
every rank (M.0d).  Each ``rank_*`` function runs on every rank of real mpiexec, all of
them one after the other in one job (``mpiexec_steps``): each launch costs seconds of
imports, and a mismatch leaves nothing behind that the next step could trip on."""

from __future__ import annotations


import numpy as np
import pytest

import forebay
from forebay.errors import ChecksumError, RankMismatchError
from conftest import assert_step_ok, damaged_copy, run_steps, skip_without

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


def _expect_mismatch(make, *words: str) -> None:
    with pytest.raises(RankMismatchError) as e:
        make()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def rank_loader_seed_differs(path: str, mode: str) -> None:
    from forebay.torch import DataLoader, store_settings

    _expect_mismatch(lambda: DataLoader(path, 8, seed=1 + _rank(),
                                        store=store_settings(mode, ram_bytes=1 << 20)),
                     "DataLoader", "seed 1 on rank 0, 2 on rank 1")


def rank_loader_batch_and_drop_last_differ(path: str, mode: str) -> None:
    from forebay.torch import DataLoader, store_settings

    r = _rank()
    _expect_mismatch(lambda: DataLoader(path, 8 * (r + 1), drop_last=bool(r),
                                        store=store_settings(mode, ram_bytes=1 << 20)),
                     "batch_size 8 on rank 0, 16 on rank 1",
                     "drop_last False on rank 0, True on rank 1")


def rank_loader_mode_differs(path: str) -> None:
    from forebay.torch import DataLoader, Preload, store_settings

    _expect_mismatch(lambda: DataLoader(path, 8,
                                        store=store_settings(("preload", "clairvoyant")[_rank()],
                                                             ram_bytes=1 << 20)),
                     "store 'preload' on rank 0, 'clairvoyant' on rank 1")
    # the same kind with another layout: the setting is named
    _expect_mismatch(lambda: DataLoader(path, 8, store=Preload(width=1 + _rank())),
                     "width 1 on rank 0, 2 on rank 1")


def rank_stores_arguments_differ(path: str) -> None:
    from mpi4py import MPI

    from forebay.store import ClairvoyantStore, DistributedStore

    comm, r = MPI.COMM_WORLD, _rank()
    _expect_mismatch(lambda: DistributedStore(path, comm, width=(1, 2)[r], progress=False),
                     "width 1 on rank 0, 2 on rank 1")
    plan = forebay.AccessPlan(len(forebay.open_dataset(path)), comm.size, 4, 2, seed=r)
    _expect_mismatch(lambda: ClairvoyantStore(path, plan, comm, ram_bytes=1 << 20),
                     "ClairvoyantStore", "seed 0", "seed 1")
    plan = forebay.AccessPlan(len(forebay.open_dataset(path)), comm.size, 4, 2, seed=0)
    _expect_mismatch(lambda: ClairvoyantStore(path, plan, comm, ram_bytes=1 << 20,
                                              ram_tier=("copy", "auto")[r]),
                     "ram_tier 'copy' on rank 0, 'auto' on rank 1")
    # and a store the ranks agree on still works afterwards
    with DistributedStore(path, comm, progress=False) as st:
        ids = np.arange(len(st))
        assert st.get_many(ids).equals(forebay.open_dataset(path).get_many(ids))


def rank_preload_finds_damage_on_every_rank(path: str) -> None:
    from forebay.torch import DataLoader

    with pytest.raises(ChecksumError, match="sample 57"):
        DataLoader(path, 8, verify_on_read=True, store="preload")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("agree") / "ds"
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"x": rng.normal(size=(int(rng.integers(1, 9)), 3)),
                                  "y": np.int64(i)} for i in range(120)), shard_bytes=4 << 10)
    return path


MODES = ("preload", "clairvoyant", "direct")


@pytest.fixture(scope="module")
def mpiexec_steps(dataset, tmp_path_factory):
    """Every case of this module, in turn, in one real ``mpiexec -n 2`` job."""
    damaged = damaged_copy(dataset, tmp_path_factory.mktemp("agree-damaged") / "ds", 57)
    steps: dict = {}
    for mode in MODES:
        steps[f"seed-{mode}"] = (rank_loader_seed_differs, dataset, mode)
        steps[f"batch-{mode}"] = (rank_loader_batch_and_drop_last_differ, dataset, mode)
    steps["mode"] = (rank_loader_mode_differs, dataset)
    steps["stores"] = (rank_stores_arguments_differ, dataset)
    steps["damaged"] = (rank_preload_finds_damage_on_every_rank, damaged)
    return run_steps(2, steps, launcher="mpiexec")


@pytest.mark.parametrize("mode", MODES)
def test_loader_ranks_that_disagree_fail_together(mpiexec_steps, mode):
    assert_step_ok(mpiexec_steps, f"seed-{mode}", 2)
    assert_step_ok(mpiexec_steps, f"batch-{mode}", 2)


def test_loader_mode_that_differs_fails_together(mpiexec_steps):
    assert_step_ok(mpiexec_steps, "mode", 2)


def test_store_arguments_that_differ_fail_together(mpiexec_steps):
    assert_step_ok(mpiexec_steps, "stores", 2)


def test_damaged_sample_fails_a_verified_preload_on_every_rank(mpiexec_steps):
    assert_step_ok(mpiexec_steps, "damaged", 2)
