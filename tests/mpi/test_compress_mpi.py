"""Compressed fields across ranks: every distributed store and transport holds the
compressed records and serves batches and single samples bit-exact to the same samples
stored plain (under real mpiexec -n 2)."""

from __future__ import annotations

import numpy as np
import pytest

import forebay
from conftest import assert_ranks_ok, run_ranks

pytest.importorskip("mpi4py")
pytest.importorskip("zstandard")
pytestmark = pytest.mark.mpi

KINDS = ("preload-shm", "preload-rma", "preload-exchange", "clairvoyant-exchange",
         "clairvoyant-rma")


def _samples():
    rng = np.random.default_rng(5)
    for i in range(90):
        yield {"x": np.repeat(rng.normal(size=(int(rng.integers(0, 7)), 1)), 3, axis=1),
               "b": bytes([i % 5]) * int(rng.integers(0, 60)), "y": np.int64(i)}


def rank_compressed(root: str) -> None:
    from mpi4py import MPI

    from forebay.store import ClairvoyantStore, DistributedStore

    comm = MPI.COMM_WORLD
    plain = forebay.open_dataset(f"{root}/plain.fb")
    z = forebay.open_dataset(f"{root}/z.fb")
    plan = forebay.AccessPlan(len(z), comm.size, 8, 1, seed=1)
    for kind in KINDS:
        mode, transport = kind.split("-")
        if mode == "preload":
            store = DistributedStore(z, comm, transport=transport, progress=False)
        else:
            store = ClairvoyantStore(z, plan, comm, transport=transport,
                                     ram_bytes=int(z.record_nbytes.sum() // 3))
        rng = np.random.default_rng(comm.rank)
        for _ in range(5):
            ids = rng.integers(0, len(z), 23)
            got, want = store.get_many(ids), plain.get_many(ids)
            for name in ("x", "b", "y"):
                assert got.field(name).equals(want.field(name)), (kind, name)
        for i in (0, 45, 89):
            one, ref = store[i], plain[i]
            assert all(one[k].tobytes() == ref[k].tobytes() for k in ref), (kind, i)
        store.close()
        comm.Barrier()
    # every rank asks for the node's decompressed copy at once: one makes it, the
    # others wait and open it; a preload store over it holds the values, bit-exact
    copy = forebay.decompressed(z, f"{root}/local")
    assert len(set(comm.allgather((str(copy.path), copy.fingerprint)))) == 1
    assert len(list((copy.path.parent).glob("decompressed-*"))) == 1
    store = DistributedStore(copy, comm, progress=False)
    assert comm.allreduce(store.nbytes) >= int(forebay.dataset.value_nbytes(z).sum())
    ids = np.random.default_rng(7).integers(0, len(z), 40)
    assert store.get_many(ids).equals(plain.get_many(ids))
    store.close()


def test_every_distributed_store_serves_compressed_fields(tmp_path):
    forebay.write_dataset(tmp_path / "plain.fb", _samples(), shard_bytes=2048)
    forebay.write_dataset(tmp_path / "z.fb", _samples(), shard_bytes=2048,
                          compress={"x": "zstd", "b": "zstd"})
    assert_ranks_ok(run_ranks(2, rank_compressed, tmp_path), 2)
