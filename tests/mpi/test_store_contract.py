"""The SampleStore contract: one suite, every store and transport.

Each ``Test*`` class names a store configuration; the contract's checks run in this
process (one rank) and, for distributed configurations, on every rank of real
``mpiexec -n 2`` and of real ``torchrun --nproc-per-node 2`` (torch.distributed's
gloo, no MPI) where the transport exists there.  A new store passes by adding its
factory to ``FACTORIES`` and a subclass of :class:`StoreContract`."""

from __future__ import annotations

import atexit
import shutil
import tempfile

import numpy as np
import pytest

import forebay
from forebay.errors import (ArgumentTypeError, InvalidArgumentError, RankMismatchError,
                            SampleIndexError)
from forebay.store import (STATS_KEYS, ArrayStore, ClairvoyantStore, DirectStore, DistributedStore,
                           NodeCache, SampleStore, StoreError)
from forebay.dataset import can_lock
from forebay.world import LOCAL
from conftest import assert_ranks_ok, assert_sample_equal, run_ranks, run_torchrun, say

pytestmark = pytest.mark.mpi
#: whether the RAM tier can be held in the page cache here (RLIMIT_MEMLOCK)
CAN_LOCK = can_lock(2 << 20)


def _plan(ds, comm):
    world = comm.Get_size() if comm not in (None, LOCAL) else 1
    return forebay.AccessPlan(len(ds), world, 8, 2, seed=3)


def _ssd_dir() -> str:
    d = tempfile.mkdtemp(prefix="forebay-ssd-")
    atexit.register(shutil.rmtree, d, True)        # left empty in /tmp before
    return d


def _node_cache(ds, filled: bool = False, cap: "int | None" = None) -> NodeCache:
    """A node cache of ``ds`` in a fresh directory; ``filled``: as the next job finds
    it (a first job read everything); ``cap``: bytes it may hold."""
    d = _ssd_dir()
    if filled:
        first = NodeCache(d, ds)
        assert first.ensure(np.arange(len(ds)))
        first.close()
    return NodeCache(d, ds, cap_bytes=cap)


def _grown(ds, comm, kind: str = "preload") -> SampleStore:
    """A store that grew (issue U): ``ds``'s samples written as a dataset of 100 and a
    generation appended, a store over the first generation, then one over both that
    keeps what it held (one rank: copied from the old store's memory)."""
    from forebay.dataset import PrefixDataset

    d = tempfile.mkdtemp(prefix="forebay-grown-")
    atexit.register(shutil.rmtree, d, True)
    every = [ds.sample(i, copy=True) for i in range(len(ds))]
    coded = {f.name: "zstd" for f in ds.schema.fields if f.codec} or None
    forebay.write_dataset(f"{d}/g", every[:100], shard_bytes=6 << 10, compress=coded)
    forebay.append(f"{d}/g", every[100:], shard_bytes=4 << 10)
    first, both = PrefixDataset(f"{d}/g", 100), forebay.open_dataset(f"{d}/g")
    if kind == "clairvoyant":
        ram = int(both.record_nbytes.sum() // 2)
        old: SampleStore = ClairvoyantStore(first, _plan(first, comm), comm, ram_bytes=ram,
                                            ram_tier="copy")
        old.wait_filled()
        grown: SampleStore = ClairvoyantStore(both, _plan(both, comm), comm, ram_bytes=ram,
                                              ram_tier="copy", grown_from=old)
        old.close()
        assert grown.stats()["kept_from_old_store"] > 0
        return grown
    old = DistributedStore(first, comm, transport="exchange", progress=False)
    grown = DistributedStore(both, comm, transport="exchange", progress=False,
                             grown_from=old)
    old.close()
    assert grown.layout.segments == (100, len(ds)) and \
        grown.stats()["pfs_reads"] == len(ds) - 100
    return grown


FACTORIES = {
    "direct": lambda ds, comm: DirectStore(ds),
    # records read kept in a node-local cache; the next job's; one whose cap is reached
    "direct-node-cache": lambda ds, comm: DirectStore(ds, node_cache=_node_cache(ds)),
    "direct-node-cache-reused": lambda ds, comm: DirectStore(
        ds, node_cache=_node_cache(ds, filled=True)),
    "direct-node-cache-full": lambda ds, comm: DirectStore(
        ds, node_cache=_node_cache(ds, cap=int(ds.record_nbytes.sum() // 2))),
    "preload-node-cache": lambda ds, comm: DistributedStore(
        ds, comm, progress=False, node_cache=_node_cache(ds)),
    "preload-node-cache-reused": lambda ds, comm: DistributedStore(
        ds, comm, progress=False, node_cache=_node_cache(ds, filled=True)),
    "preload-grown": _grown,
    "clairvoyant-grown": lambda ds, comm: _grown(ds, comm, "clairvoyant"),
    "clairvoyant-node-cache": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 3),
        node_cache=_node_cache(ds)),
    "clairvoyant-node-cache-reused": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 3),
        node_cache=_node_cache(ds, filled=True)),
    "preload-shm": lambda ds, comm: DistributedStore(ds, comm, transport="shm",
                                                     progress=False),
    "preload-rma": lambda ds, comm: DistributedStore(ds, comm, transport="rma",
                                                     progress=False),
    # the chunks held in the files' pages, locked in the page cache (auto on one node)
    "preload-pages": lambda ds, comm: DistributedStore(ds, comm, transport="pages",
                                                       progress=False),
    "preload-overlap": lambda ds, comm: DistributedStore(ds, comm, overlap=True,
                                                         progress=False),
    "preload-overlap-shm": lambda ds, comm: DistributedStore(ds, comm, overlap=True,
                                                             transport="shm", progress=False),
    "preload-exchange": lambda ds, comm: DistributedStore(ds, comm, transport="exchange",
                                                          progress=False),
    "preload-overlap-exchange": lambda ds, comm: DistributedStore(
        ds, comm, transport="exchange", overlap=True, progress=False),
    "preload-overlap-rma": lambda ds, comm: DistributedStore(
        ds, comm, transport="rma", overlap=True, progress=False),
    "clairvoyant-ram": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=1 << 20, ram_tier="copy"),
    # the RAM tier in the files' pages, locked in the page cache
    "clairvoyant-pages": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                           ram_bytes=1 << 20, ram_tier="pages"),
    "clairvoyant-rma": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=1 << 20, transport="rma"),
    # RAM for a third of the dataset per rank: most batches need the peer's samples
    "clairvoyant-exchange": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 3),
        transport="exchange"),
    # the same over the exchange with the RAM tiers in the page cache: owners send
    # their samples from the files' pages
    "clairvoyant-exchange-pages": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 3),
        transport="exchange", ram_tier="pages"),
    # a small RAM tier: most samples go to the SSD tier or stay in the files
    "clairvoyant-ssd": lambda ds, comm: ClairvoyantStore(ds, _plan(ds, comm), comm,
                                                         ram_bytes=4096, ssd_dir=_ssd_dir(),
                                                         ssd_bytes=1 << 20, ram_tier="copy"),
    # both tiers, the RAM one in the page cache (a batch once read an SSD position the
    # fill had claimed but not written: zeros)
    "clairvoyant-pages-ssd": lambda ds, comm: ClairvoyantStore(
        ds, _plan(ds, comm), comm, ram_bytes=int(ds.record_nbytes.sum() // 4),
        ssd_dir=_ssd_dir(), ssd_bytes=1 << 20, ram_tier="pages"),
}


def check_views(store: SampleStore, ds, rng, alone: bool) -> tuple:
    """get_views: bit-exact to the dataset, read-only; a store that lends its memory
    (``"views"``) gives the same memory twice once filled (one rank: no peer's records
    staged per call).  Returns (views of every sample, the dataset's batch, ids asked)."""
    asked = 0
    for k in range(4):
        ids = rng.integers(-len(ds), len(ds), size=int(rng.integers(0, 40)) if k else 0)
        assert store.get_views(ids).equals(ds.get_many(ids)), ids
        asked += len(ids)
    every = np.arange(len(ds))
    kept = store.get_views(every)
    asked += len(ds)
    assert kept.equals(ds.get_many(every))
    written = 0
    for vs in kept.fields.values():
        for v in vs:
            assert not v.flags.writeable
            if v.size and written < 5:
                with pytest.raises(ValueError, match="read-only"):
                    v.reshape(-1)[0] = 0
                written += 1
    # (compressed fields are lent from a decompressed copy: not the same memory twice)
    if alone and "views" in store.capabilities and not ds.schema.coded and \
            store.wait_filled(timeout=120):
        a, b = store.get_views(every), store.get_views(every)
        asked += 2 * len(ds)
        assert all(v.ctypes.data == w.ctypes.data for vs, ws in
                   zip(a.fields.values(), b.fields.values()) for v, w in zip(vs, ws))
    return kept, ds.get_many(every), asked


def check_one_sample(store: SampleStore, ds, rng) -> int:
    """``store[i]``: sample i bit-exact to ``ds[i]`` (negative ids too, empty fields
    among them), writable, a copy of its own; bad indexes named.  Returns the reads
    made."""
    ids = [0, len(ds) - 1, -1, -len(ds)] + rng.integers(-len(ds), len(ds), size=12).tolist()
    for i in ids:
        got = store[i]
        assert list(got) == list(ds.schema.names)
        assert_sample_equal(got, ds[i])
        assert all(a.flags.writeable for a in got.values()), i
    i = next(k for k in range(len(ds)) if ds[k]["x"].size)
    got = store[i]
    got["x"][...] = -1.0                      # the caller's copy; the store's is intact
    assert_sample_equal(store[np.int64(i)], ds[i])
    with pytest.raises(SampleIndexError, match="out of range"):
        store[len(ds)]
    with pytest.raises(ArgumentTypeError, match="integer"):
        store[1.5]                            # type: ignore[index]
    return len(ids) + 2


def check_contract(store: SampleStore, ds, seed: int = 0, alone: bool = True) -> None:
    """What every SampleStore does, on one rank (``alone``: the only one)."""
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
    for i in rng.integers(0, len(ds), size=6).tolist():  # one sample (a fast path)
        assert store.get_many([i]).equals(ds.get_many([i])), i
        asked += 1
    assert store.get_many(every).equals(ds.get_many(every))
    asked += len(ds)
    asked += check_one_sample(store, ds, rng)
    with pytest.raises(SampleIndexError):
        store.get_many([len(ds)])
    with pytest.raises(SampleIndexError):
        store.get_views([len(ds)])
    kept, want, n = check_views(store, ds, rng, alone)
    asked += n
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
    with pytest.raises(StoreError, match="closed"):
        store.get_views([0])
    with pytest.raises(StoreError, match="closed"):
        store[0]
    assert kept.equals(want)             # views outlive the store, unchanged


def rank_contract(path: str, kind: str, want_transport: str = "") -> None:
    """The contract on every rank of the job's own communicator (MPI's COMM_WORLD under
    mpiexec, forebay's gloo group under torchrun)."""
    from forebay.world import resolve_comm

    comm = resolve_comm()
    ds = open_contract_dataset(path)
    store = FACTORIES[kind](ds, comm)
    if want_transport:
        assert store.stats()["transport"] == want_transport, store.stats()
    check_contract(store, ds, seed=comm.Get_rank(), alone=comm.Get_size() == 1)


def rank_contracts(path: str, kinds: str) -> None:
    """The contract of each of ``kinds`` ("kind=transport,..."; kind "arrays": the
    from_arrays store's) in turn, in one job: one torchrun launch costs more than a
    contract.  Each rank says "contract KIND ok" after each."""
    from forebay.world import resolve_comm

    for item in kinds.split(","):
        kind, want = item.split("=")
        if kind == "arrays":
            check_array_contract(resolve_comm(), want)
        else:
            rank_contract(path, kind, want)
        say(f"contract {kind} ok")


@pytest.fixture(scope="module")
def torchrun_contracts(dataset):
    """Every contract that runs under torch.distributed, under one real ``torchrun
    --nproc-per-node 2`` job (its CompletedProcess)."""
    kinds = [f"{c.kind}={c.under_torchrun}" for c in DistributedStoreContract.__subclasses__()
             if c.under_torchrun and ("pages" not in c.kind or CAN_LOCK)]
    return run_torchrun(2, rank_contracts, dataset, ",".join(kinds + ["arrays=shm"]),
                        timeout=300)


def check_torchrun_contract(p, kind: str) -> None:
    """Both ranks of the torchrun job passed ``kind``'s contract (an earlier kind that
    failed stops the job: its error is in the output shown)."""
    assert p.stdout.count(f"contract {kind} ok") == 2, \
        f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"


def write_contract_dataset(path):
    """The contract's dataset: 150 samples of ragged floats, bytes and a label, in
    shards of 6 KiB."""
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"x": rng.normal(size=(int(rng.integers(0, 9)), 3)),
                                  "b": rng.bytes(int(rng.integers(0, 90))),
                                  "y": np.int64(i)} for i in range(150)),
                          shard_bytes=6 << 10)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_contract_dataset(tmp_path_factory.mktemp("contract") / "ds")


def open_contract_dataset(path: str):
    """The contract's dataset at ``path``, or a mixture's sources joined by
    ``os.pathsep`` (read as one ConcatDataset)."""
    import os

    from forebay.dataset import ConcatDataset

    path = str(path)
    return ConcatDataset(path.split(os.pathsep)) if os.pathsep in path else \
        forebay.open_dataset(path)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """The contract's dataset compressed (issue S: compression passes the suite), and
    split in two sources read as one (a Mixture's ConcatDataset)."""
    import os

    pytest.importorskip("zstandard")
    d = tmp_path_factory.mktemp("contract-variants")
    plain = forebay.open_dataset(write_contract_dataset(d / "plain"))
    every = [plain.sample(i, copy=True) for i in range(len(plain))]
    forebay.write_dataset(d / "zstd", every, shard_bytes=6 << 10,
                          compress={"x": "zstd", "b": "zstd:9"})
    forebay.write_dataset(d / "a", every[:100], shard_bytes=6 << 10)
    forebay.write_dataset(d / "b", every[100:], shard_bytes=4 << 10)
    return {"zstd": str(d / "zstd"), "mixture": os.pathsep.join([str(d / "a"), str(d / "b")])}


#: the kinds a mixture's sources are not served by (the node cache keeps one dataset)
NOT_FOR_MIXTURES = {k for k in FACTORIES if "node-cache" in k}


@pytest.mark.parametrize("variant", ["zstd", "mixture"])
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_contract_one_rank_compressed_and_mixed(variants, variant, kind):
    if "pages" in kind and not CAN_LOCK:
        pytest.skip("the page-cache tier needs RLIMIT_MEMLOCK")
    ds = open_contract_dataset(variants[variant])
    if variant == "mixture" and kind in NOT_FOR_MIXTURES:
        with pytest.raises(InvalidArgumentError, match="node cache keeps one dataset"):
            FACTORIES[kind](ds, LOCAL)
        return
    check_contract(FACTORIES[kind](ds, LOCAL), ds)


@pytest.mark.parametrize("variant", ["zstd", "mixture"])
def test_contract_two_ranks_compressed_and_mixed(variants, variant):
    """Every distributed kind's contract on both ranks of one mpiexec job."""
    kinds = [c.kind for c in DistributedStoreContract.__subclasses__()
             if "pages" not in c.kind or CAN_LOCK]
    p = run_ranks(2, rank_contracts, variants[variant], ",".join(f"{k}=" for k in kinds),
                  timeout=300)
    for kind in kinds:
        check_torchrun_contract(p, kind)


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

    def test_contract_two_ranks_torchrun(self, torchrun_contracts):
        if not self.under_torchrun:
            pytest.skip(f"{self.kind} needs MPI")
        check_torchrun_contract(torchrun_contracts, self.kind)


class TestDirect(StoreContract):
    kind = "direct"


class TestDirectNodeCache(StoreContract):
    kind = "direct-node-cache"


class TestDirectNodeCacheReused(StoreContract):
    kind = "direct-node-cache-reused"


class TestDirectNodeCacheFull(StoreContract):
    kind = "direct-node-cache-full"


class TestPreloadNodeCache(StoreContract):
    kind = "preload-node-cache"


class TestPreloadNodeCacheReused(StoreContract):
    kind = "preload-node-cache-reused"


class TestClairvoyantNodeCache(StoreContract):
    kind = "clairvoyant-node-cache"


class TestClairvoyantNodeCacheReused(StoreContract):
    kind = "clairvoyant-node-cache-reused"


class TestPreloadGrown(StoreContract):
    kind = "preload-grown"


class TestClairvoyantGrown(StoreContract):
    kind = "clairvoyant-grown"


class TestPreloadShm(DistributedStoreContract):
    kind = "preload-shm"
    under_torchrun = "shm"


@pytest.mark.skipif(not CAN_LOCK, reason="this process may not lock 2 MiB "
                    "(RLIMIT_MEMLOCK): the chunks cannot be held in the page cache")
class TestPreloadPages(DistributedStoreContract):
    kind = "preload-pages"
    under_torchrun = "pages"


class TestPreloadOverlap(DistributedStoreContract):
    kind = "preload-overlap"
    under_torchrun = "pages" if CAN_LOCK else "shm"


class TestPreloadOverlapShm(DistributedStoreContract):
    kind = "preload-overlap-shm"
    under_torchrun = "shm"


class TestPreloadExchange(DistributedStoreContract):
    kind = "preload-exchange"
    under_torchrun = "exchange"


class TestPreloadOverlapExchange(DistributedStoreContract):
    kind = "preload-overlap-exchange"
    under_torchrun = "exchange"


class TestPreloadOverlapRma(DistributedStoreContract):
    kind = "preload-overlap-rma"


class TestPreloadRma(DistributedStoreContract):
    kind = "preload-rma"


class TestClairvoyantRam(DistributedStoreContract):
    kind = "clairvoyant-ram"
    under_torchrun = "shm"


@pytest.mark.skipif(not CAN_LOCK, reason="this process may not lock 2 MiB "
                    "(RLIMIT_MEMLOCK): the RAM tier cannot be held in the page cache")
class TestClairvoyantPages(DistributedStoreContract):
    kind = "clairvoyant-pages"
    under_torchrun = "shm"


class TestClairvoyantRma(DistributedStoreContract):
    kind = "clairvoyant-rma"


class TestClairvoyantExchange(DistributedStoreContract):
    kind = "clairvoyant-exchange"
    under_torchrun = "exchange"


@pytest.mark.skipif(not CAN_LOCK, reason="this process may not lock 2 MiB (RLIMIT_MEMLOCK): "
                    "the RAM tier cannot be held in the page cache")
class TestClairvoyantExchangePages(DistributedStoreContract):
    kind = "clairvoyant-exchange-pages"
    under_torchrun = "exchange"


class TestClairvoyantSsd(DistributedStoreContract):
    kind = "clairvoyant-ssd"
    under_torchrun = "shm"


@pytest.mark.skipif(not CAN_LOCK, reason="this process may not lock 2 MiB (RLIMIT_MEMLOCK): "
                    "the RAM tier cannot be held in the page cache")
class TestClairvoyantPagesSsd(DistributedStoreContract):
    kind = "clairvoyant-pages-ssd"
    under_torchrun = "shm"


def test_the_same_reads_count_the_same_bytes_in_every_mode(dataset):
    """Reading every sample once: direct, preload and a clairvoyant store holding it all
    report the same pfs_bytes, the records' bytes (direct counted payload before)."""
    ds = forebay.open_dataset(dataset)
    every = np.arange(len(ds))
    want = int(ds.record_nbytes.sum())
    for kind in ("direct", "preload-rma", "clairvoyant-ram") + \
            (("clairvoyant-pages",) if CAN_LOCK else ()):
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
    with pytest.raises(StoreError,
                       match=r"fill thread \(after filling 0 of .*\) failed: .*injected"):
        st.wait_filled(timeout=60)
    with pytest.raises(StoreError, match="injected"):
        st.get_many([0])
    st.close()


# ----------------------------------------------------------------------------- ArrayStore
# The store of named in-memory arrays (DDStore's add/get/update/epochs): the same checks
# in one process, on every rank of mpiexec -n 2 and -n 3 (shm and rma) and of torchrun.

def _rank_arrays(rank: int) -> dict[str, np.ndarray]:
    """What rank ``rank`` contributes: row counts differ by rank and by variable (rank
    0 has no rows of "b")."""
    rng = np.random.default_rng(100 + rank)
    n = 5 + 3 * rank
    return {"x": rng.normal(size=(n, 3, 2)).astype(np.float32),
            "y": np.arange(n, dtype=np.int64) + 1000 * rank,
            "b": rng.integers(0, 255, size=(2 * rank, 7), dtype=np.uint8)}


def _global(world: int) -> dict[str, np.ndarray]:
    parts = [_rank_arrays(r) for r in range(world)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def check_array_contract(comm, transport: str = "auto") -> None:
    """What every ArrayStore does, on one rank of ``comm``."""
    rank = comm.Get_rank() if comm not in (None, LOCAL) else 0
    world = comm.Get_size() if comm not in (None, LOCAL) else 1
    ref = _global(world)
    store = DistributedStore.from_arrays(_rank_arrays(rank), comm, transport=transport)
    assert isinstance(store, ArrayStore)
    if transport != "auto":
        assert store.stats()["transport"] == transport
    rng = np.random.default_rng(rank)
    read = 0
    for name, want in ref.items():
        n = len(want)
        assert store.rows(name) == n
        for start in range(n + 1):                    # every range start, spans included
            for count in {0, min(1, n - start), min(3, n - start), n - start}:
                got = store.get(name, start, count)
                assert got.dtype == want.dtype and np.array_equal(got, want[start:start + count])
                read += count
        out = np.empty_like(want)
        assert store.get(name, 0, n, out=out) is out and np.array_equal(out, want)
        read += n
        ids = rng.integers(-n, n, size=40) if n else np.zeros(0, dtype=np.int64)
        assert np.array_equal(store.get_rows(name, ids), want[ids])
        read += len(ids)
        with pytest.raises(SampleIndexError):
            store.get(name, n, 1)
        with pytest.raises(SampleIndexError):
            store.get_rows(name, [n])
    with pytest.raises(InvalidArgumentError, match="out must be"):
        store.get("x", 0, 2, out=np.empty((2, 3, 2), dtype=np.float64))
    with pytest.raises(KeyError, match="no variable 'z'"):
        store.get("z", 0)
    st = store.stats()
    assert sum(st["rows_by_source"].values()) == read
    assert (st["rows_by_source"]["peer"] > 0) == (world > 1)
    with store.epoch():                               # read-only: epochs are free, allowed
        store.get("y", 0)
    with pytest.raises(StoreError, match="read-only"):
        store.update("y", 0, ref["y"][:1])
    store.close()
    store.close()                                     # idempotent
    with pytest.raises(StoreError, match="closed"):
        store.get("y", 0)

    # mutable: each rank updates its own rows between epochs; all see all after a fence
    mine = _rank_arrays(rank)
    lo = sum(len(_rank_arrays(r)["y"]) for r in range(rank))
    with DistributedStore.from_arrays(mine, comm, transport=transport, mutable=True) as m:
        with pytest.raises(StoreError, match="inside an epoch"):
            m.get("y", 0)
        for round_ in range(3):
            new = mine["y"] + 10_000 * (round_ + 1)
            m.update("y", lo, new)
            with pytest.raises(StoreError, match="within them"):
                m.update("y", lo + 1, new)            # runs past this rank's rows
            with m.epoch():
                want = ref["y"] + 10_000 * (round_ + 1)
                assert np.array_equal(m.get("y", 0, len(want)), want)
                assert np.array_equal(m.get_rows("y", np.arange(len(want))[::-1]), want[::-1])
                with pytest.raises(StoreError, match="inside an epoch"):
                    m.update("y", lo, new)
        with pytest.raises(InvalidArgumentError, match="must be int64"):
            m.update("y", lo, new.astype(np.int32))


def rank_array_contract(transport: str) -> None:
    from forebay.world import resolve_comm

    check_array_contract(resolve_comm(), transport)


def rank_array_mismatch() -> None:
    """Rank 1 passes "x" as float64: every rank raises, naming the variable."""
    from forebay.world import resolve_comm

    comm = resolve_comm()
    arrays = _rank_arrays(comm.Get_rank())
    if comm.Get_rank() == 1:
        arrays["x"] = arrays["x"].astype(np.float64)
    with pytest.raises(RankMismatchError, match="variable 'x' '<f4 rows of shape "
                                                r"\(3, 2\)' on rank 0, '<f8"):
        DistributedStore.from_arrays(arrays, comm)
    if comm.Get_rank() == 0:
        del arrays["b"]
    with pytest.raises(RankMismatchError, match="variable 'b' None on rank 0"):
        DistributedStore.from_arrays(arrays, comm)


class TestArrayStore:
    def test_one_process(self):
        check_array_contract(LOCAL)

    def test_bad_arrays_are_refused(self):
        for bad, match in (({}, "non-empty mapping"), ({"x": [1, 2]}, "not a numpy array"),
                           ({"x": np.array(1.0)}, "scalar"),
                           ({"x": np.array([None, 1])}, "Python objects")):
            with pytest.raises(InvalidArgumentError, match=match):
                DistributedStore.from_arrays(bad, LOCAL)

    @pytest.mark.parametrize("ranks,transport", [(2, "shm"), (2, "rma"), (3, "rma"),
                                                 (3, "shm")])
    def test_mpiexec(self, ranks, transport):
        assert_ranks_ok(run_ranks(ranks, rank_array_contract, transport), ranks)

    def test_torchrun(self, torchrun_contracts):
        check_torchrun_contract(torchrun_contracts, "arrays")

    def test_ranks_that_disagree_fail_on_every_rank(self):
        assert_ranks_ok(run_ranks(2, rank_array_mismatch), 2)
