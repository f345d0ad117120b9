"""A rank that raises ends the whole job within seconds (issue M.2): the uncaught
exception aborts MPI instead of leaving the other ranks in a collective forever.
Each run has a timeout: a hang fails the test."""

from __future__ import annotations

import numpy as np
import pytest

import forebay
from conftest import run_ranks, skip_without

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


def rank_raises_while_others_train(path: str, mode: str) -> None:
    from forebay.torch import DataLoader, store_settings

    loader = DataLoader(path, 4, epochs=2, store=store_settings(mode, ram_bytes=1 << 20))
    if _rank() == 1:
        raise ValueError("boom on rank 1")
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    loader.close()          # collective: waits for rank 1 unless the job was aborted


def rank_raises_inside_with(path: str) -> None:
    from forebay.torch import DataLoader

    with DataLoader(path, 4, store="preload") as loader:
        for step, _ in enumerate(loader):
            if _rank() == 1 and step == 2:
                raise ValueError("boom on rank 1")
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()


def rank_dataset_missing_on_one_rank(path: str) -> None:
    from forebay.torch import DataLoader

    DataLoader(path if _rank() == 0 else path + "-missing", 4, store="preload")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("fail") / "ds"
    forebay.write_dataset(path, ({"x": np.full(5, i)} for i in range(64)))
    return str(path)


def _aborted(p, word: str) -> None:
    assert p.returncode != 0
    assert word in p.stderr and "aborting the MPI job" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("mode", ["preload", "clairvoyant"])
def test_a_raising_rank_ends_the_job(dataset, mode):
    _aborted(run_ranks(2, rank_raises_while_others_train, dataset, mode, timeout=90),
             "boom on rank 1")


def test_a_raising_rank_inside_with_ends_the_job(dataset):
    _aborted(run_ranks(2, rank_raises_inside_with, dataset, timeout=90), "boom on rank 1")


def test_a_path_missing_on_one_rank_ends_the_job(dataset):
    _aborted(run_ranks(2, rank_dataset_missing_on_one_rank, dataset, timeout=90),
             "DatasetNotFoundError")
