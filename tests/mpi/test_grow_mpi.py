"""A dataset that grows, read by ranks under mpiexec (issue U, item 2): ranks that opened
different generations agree on the samples all of them see, and a loader following the
appends gives every rank its part of the same global batches at each epoch fence, with
direct reads and with a preload that keeps what it holds and reads only the new
generations (every transport)."""

from __future__ import annotations

import numpy as np
import pytest

import forebay
from conftest import assert_step_ok, run_steps

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


def _ys(b):
    return b["y"].copy()


def rank_grow_preload(path: str) -> None:
    """A preload following appends: each epoch the plan's batches over the samples
    agreed at its fence, the values bit-exact; at each growth every rank reads only its
    share of the new generations from the files (its old chunk copied from memory)."""
    from mpi4py import MPI

    from forebay.dataset import PrefixDataset
    from forebay.store import ClairvoyantStore, DistributedStore
    from forebay.torch import DataLoader, Pipeline, Preload

    comm = MPI.COMM_WORLD
    dl = DataLoader(path, 4, epochs=3, seed=5, comm=comm, follow_appends=True,
                    store=Preload(transport="shm"), pipeline=Pipeline(collate_fn=_ys))
    read = []
    for epoch, n in ((0, 40), (1, 64), (2, 80)):
        if epoch:
            if comm.rank == 0:
                _grow(path, n - (24 if epoch == 1 else 16), 24 if epoch == 1 else 16)
            comm.Barrier()
        dl.set_epoch(epoch)
        got = np.concatenate(list(dl))       # the values: y == the sample's id
        want = forebay.AccessPlan(n, 2, 4, 3, seed=5).batches(comm.rank, epoch).ravel()
        assert np.array_equal(got, want), (epoch, comm.rank)
        read.append(comm.allreduce(dl.stats()["pfs_reads"]))
    assert read == [40, 24, 16], read
    assert dl.store.layout.segments == (40, 64, 80)
    dl.close()
    # the store alone, over every transport: the same through two growths
    full = forebay.open_dataset(path)
    ids = np.random.default_rng(comm.rank).integers(0, 80, 50)
    for transport in ("shm", "rma", "exchange"):     # a clairvoyant store's tiers too
        plans = [forebay.AccessPlan(n, 2, 4, 2, seed=1) for n in (40, 80)]
        a = ClairvoyantStore(PrefixDataset(path, 40), plans[0], comm, transport=transport,
                             ram_bytes=1 << 20, ram_tier="copy")
        a.wait_filled()
        held = a.local_pos >= 0                  # what the old store's tiers hold
        c = ClairvoyantStore(full, plans[1], comm, transport=transport, ram_bytes=1 << 20,
                             ram_tier="copy", grown_from=a)
        a.close()
        c.wait_filled()
        st = c.stats()
        # kept: exactly the new tiers' samples the old tiers held; the rest came from
        # the files (or a peer's tier)
        want = int(held[c.fill_order[c.fill_order < 40]].sum())
        assert st["kept_from_old_store"] == want > 0, (transport, st)
        assert st["pfs_reads"] + st["filled_from_peers"] == len(c.fill_order) - want
        assert c.get_many(ids).equals(full.get_many(ids)), transport
        c.close()
    for transport in ("shm", "rma", "exchange"):
        a = DistributedStore(PrefixDataset(path, 40), comm, transport=transport,
                             progress=False)
        b = DistributedStore(PrefixDataset(path, 64), comm, transport=transport,
                             progress=False, grown_from=a)
        a.close()
        c = DistributedStore(full, comm, transport=transport, progress=False, grown_from=b)
        b.close()
        assert c.get_many(ids).equals(full.get_many(ids)), transport
        assert comm.allreduce(c.stats()["pfs_reads"]) == 16, transport
        c.close()


def test_ranks_agree_on_a_growing_dataset_and_follow_it(tmp_path):
    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    grows = tmp_path / "p.fb"
    forebay.write_dataset(grows, ({"y": np.int64(i)} for i in range(40)))
    p = run_steps(2, {"direct": (rank_grow, path), "preload": (rank_grow_preload, grows)},
                  launcher="mpiexec")
    assert_step_ok(p, "direct", 2)
    assert_step_ok(p, "preload", 2)
