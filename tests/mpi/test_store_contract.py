"""The SampleStore contract: one suite, every store and transport.

Each ``Test*`` class names a store configuration; the contract's checks run in this
process (one rank) and, for distributed configurations, on every rank of real
``mpiexec -n 2`` and of real ``torchrun --nproc-per-node 2`` (torch.distributed's
gloo, no MPI) where the transport exists there.  A new store passes by adding its
factory to ``FACTORIES`` and a subclass of :class:`StoreContract`."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

import forebay
from forebay.errors import SampleIndexError
from forebay.store import (STATS_KEYS, ClairvoyantStore, DirectStore, DistributedStore,
                           SampleStore, StoreError)
from forebay.world import LOCAL
from conftest import assert_ranks_ok, run_ranks, run_torchrun

pytestmark = pytest.mark.mpi


def _plan(ds, comm):
    world = comm.Get_size() if comm not in (None, LOCAL) else 1
    return forebay.AccessPlan(len(ds), world, 8, 2, seed=3)


def _ssd_dir() -> str:
    return tempfile.mkdtemp(prefix="forebay-ssd-")


FACTORIES = {
    "direct": lambda ds, comm: DirectStore(ds),
    "preload-shm": lambda ds, comm: DistributedStore(ds, comm, transport="shm",
                                                     progress=False),
    "preload-rma": lambda ds, comm: DistributedStore(ds, comm, transport="rma",
                                                     progress=False),
    "preload-exchange": lambda ds, comm: DistributedStore(ds, comm, transport="exchange",
                                                          progress=False),
    "clairvoyant-ram": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=1 << 20),
    "clairvoyant-rma": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=1 << 20, transport="rma"),
    # RAM for a third of the dataset per rank: most batches need the peer's samples
    "clairvoyant-exchange": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 3),
        transport="exchange"),
    # a small RAM tier: most samples go to the SSD tier or stay in the files
    "clairvoyant-ssd": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=4096, ssd_dir=_ssd_dir(),
                                                         ssd_bytes=1 << 20),
}


def check_contract(store: SampleStore, ds, seed: int = 0) -> None:
    """What every SampleStore does, on one rank."""
    assert isinstance(store, SampleStore) and isinstance(store.capabilities, frozenset)
    assert len(store) == len(ds)
    rng = np.random.default_rng(seed)
    asked = 0
    for k in range(12):
        n = int(rng.integers(0, 40)) if k else 0
        ids = rng.integers(-len(ds), len(ds), size=n)          # negatives and repeats
        assert store.get_many(ids).equals(ds.get_many(ids)), ids
        asked += n
    every = np.arange(len(ds))
    assert store.get_many(every).equals(ds.get_many(every))
    asked += len(ds)
    with pytest.raises(SampleIndexError):
        store.get_many([len(ds)])
    assert store.wait_filled(timeout=120) in (True, False)
    st = store.stats()
    assert set(STATS_KEYS) <= set(st)
    assert sum(st["fetches_by_source"].values()) == asked
    assert set(st["fetches_by_source"]) <= {"local", "peer", "pfs"}
    assert isinstance(st["pfs_reads"], int) and isinstance(st["pfs_bytes"], int)
    assert 0 <= st["pfs_bytes"] and (st["pfs_reads"] == 0) == (st["pfs_bytes"] == 0)
    store.close()
    store.close()                                               # idempotent
    with pytest.raises(StoreError, match="closed"):
        store.get_many([0])


def rank_contract(path: str, kind: str, want_transport: str = "") -> None:
    """The contract on every rank of the job's own communicator (MPI's COMM_WORLD under
    mpiexec, forebay's gloo group under torchrun)."""
    from forebay.world import resolve_comm

    comm = resolve_comm()
    ds = forebay.open_dataset(path)
    store = FACTORIES[kind](ds, comm)
    if want_transport:
        assert store.stats()["transport"] == want_transport, store.stats()
    check_contract(store, ds, seed=comm.Get_rank())


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract") / "ds"
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"x": rng.normal(size=(int(rng.integers(0, 9)), 3)),
                                  "b": rng.bytes(int(rng.integers(0, 90))),
                                  "y": np.int64(i)} for i in range(150)),
                          shard_bytes=6 << 10)
    return path


class StoreContract:
    kind = ""

    def test_contract_one_rank(self, dataset):
        ds = forebay.open_dataset(dataset)
        check_contract(FACTORIES[self.kind](ds, LOCAL), ds)


class DistributedStoreContract(StoreContract):
    #: the transport stats() reports under torchrun ("" : not available there)
    under_torchrun = ""

    def test_contract_two_ranks(self, dataset):
        assert_ranks_ok(run_ranks(2, rank_contract, dataset, self.kind), 2)

    def test_contract_two_ranks_torchrun(self, dataset):
        if not self.under_torchrun:
            pytest.skip(f"{self.kind} needs MPI")
        assert_ranks_ok(run_torchrun(2, rank_contract, dataset, self.kind,
                                     self.under_torchrun), 2)


class TestDirect(StoreContract):
    kind = "direct"


class TestPreloadShm(DistributedStoreContract):
    kind = "preload-shm"
    under_torchrun = "shm"


class TestPreloadExchange(DistributedStoreContract):
    kind = "preload-exchange"
    under_torchrun = "exchange"


class TestPreloadRma(DistributedStoreContract):
    kind = "preload-rma"


class TestClairvoyantRam(DistributedStoreContract):
    kind = "clairvoyant-ram"
    under_torchrun = "shm"


class TestClairvoyantRma(DistributedStoreContract):
    kind = "clairvoyant-rma"


class TestClairvoyantExchange(DistributedStoreContract):
    kind = "clairvoyant-exchange"
    under_torchrun = "exchange"


class TestClairvoyantSsd(DistributedStoreContract):
    kind = "clairvoyant-ssd"
    under_torchrun = "shm"


def test_the_same_reads_count_the_same_bytes_in_every_mode(dataset):
    """Reading every sample once: direct, preload and a clairvoyant store holding it all
    report the same pfs_bytes, the records' bytes (direct counted payload before)."""
    ds = forebay.open_dataset(dataset)
    every = np.arange(len(ds))
    want = int(ds.record_nbytes.sum())
    for kind in ("direct", "preload-rma", "clairvoyant-ram"):
        with FACTORIES[kind](ds, LOCAL) as st:
            st.get_many(every)
            assert st.wait_filled(timeout=120)
            assert st.stats()["pfs_bytes"] == want, kind
            assert st.stats()["pfs_reads"] == len(ds), kind


def test_a_dead_fill_thread_is_reported(dataset):
    """wait_filled() used to return True after the fill thread died (filled 0)."""
    ds = forebay.open_dataset(dataset)

    def broken(nbytes, samples, seconds):
        raise OSError("injected: the file system went away")

    st = ClairvoyantStore(ds, _plan(ds, None), LOCAL, ram_bytes=1 << 20, on_pfs_read=broken)
    with pytest.raises(StoreError, match="fill thread failed after filling 0 of .*injected"):
        st.wait_filled(timeout=60)
    with pytest.raises(StoreError, match="injected"):
        st.get_many([0])
    st.close()
