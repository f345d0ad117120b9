"""A dataset that grows, read by ranks under mpiexec (issue U, item 2): ranks that opened
different generations agree on the samples all of them see, and a loader following the
appends gives every rank its part of the same global batches at each epoch fence."""

from __future__ import annotations

import numpy as np
import pytest

import forebay
from conftest import assert_ranks_ok, run_ranks

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi


def _grow(path, start, n):
    forebay.append(path, ({"y": np.int64(i)} for i in range(start, start + n)))


def rank_grow(path: str) -> None:
    from mpi4py import MPI

    from forebay.store import agree_on_prefix
    from forebay.torch import DataLoader, Pipeline

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path) if comm.rank == 0 else None
    comm.Barrier()
    if comm.rank == 1:                 # a producer appends between the two opens
        _grow(path, 40, 24)
        ds = forebay.open_dataset(path)
    comm.Barrier()
    assert len(ds) == (40 if comm.rank == 0 else 64)
    assert agree_on_prefix(comm, ds) == 40
    dl = DataLoader(path, 4, epochs=2, seed=2, comm=comm, store="direct",
                    follow_appends=True, pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    for epoch, n in ((0, 64), (1, 80)):
        if epoch == 1:
            if comm.rank == 0:
                _grow(path, 64, 16)
            comm.Barrier()
        dl.set_epoch(epoch)
        got = np.concatenate(list(dl))
        want = forebay.AccessPlan(n, 2, 4, 2, seed=2).batches(comm.rank, epoch).ravel()
        assert np.array_equal(got, want), (epoch, comm.rank)
    dl.close()


def test_ranks_agree_on_a_growing_dataset_and_follow_it(tmp_path):
    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    assert_ranks_ok(run_ranks(2, rank_grow, path), 2)
