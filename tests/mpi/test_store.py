"""DistributedStore under real mpiexec: bit-exact for every width, clear errors on every rank."""

from __future__ import annotations

import os

import numpy as np
import pytest

import forebay
from forebay.store import DistributedStore, StoreError, StoreLayout
from forebay.dataset import can_lock
from conftest import assert_ranks_ok, run_ranks

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi
#: the transports on one node: the chunks in shared memory, read by RMA, and (where
#: this process may lock memory) held in the files' pages
TRANSPORTS = ("shm", "rma") + (("pages",) if can_lock(64 << 20) else ())

def rank_bit_exact(*args: str) -> None:
    """One rank of the bit_exact test (run by run_ranks)."""
    argv = ["rank", *args]
    import numpy as np
    from mpi4py import MPI
    from conftest import say
    import forebay
    from forebay.store import DistributedStore
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    widths = [w for w in range(1, comm.size + 1) if comm.size % w == 0]
    for w, transport in [(w, t) for w in widths for t in TRANSPORTS]:
        with DistributedStore(ds, comm, width=w, transport=transport, progress=False) as st:
            assert st.transport == (transport if w > 1 or transport == "pages" else "local")
            assert st.replicas == comm.size // w
            rng = np.random.default_rng(comm.rank * 100 + w)
            for _ in range(25):
                ids = rng.integers(-len(ds), len(ds), size=int(rng.integers(0, 70)))
                assert st.get_many(ids).equals(ds.get_many(ids)), (w, ids)
            every = np.arange(len(ds))
            assert st.get_many(every).equals(ds.get_many(every))
            owners = st.owner(every)
            assert set(owners.tolist()) == set(range(st.group * w, st.group * w + w))
            held = comm.allreduce(st.nbytes)
        say(f"rank {comm.rank} width {w} {transport} ok held {held}")


def rank_torch_dataset_over_the_store(path: str) -> None:
    """torch's DataLoader over ``forebay.torch.Dataset(store)`` (DDStore's DistDataset):
    the plan's batches, every sample bit-exact, half of them served by the peer."""
    import torch

    from forebay.torch import Dataset, PlanSampler
    from forebay.world import resolve_comm

    comm = resolve_comm()
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), comm.Get_size(), 6, 1, seed=3)
    with DistributedStore(ds, comm, progress=False) as st:
        loader = torch.utils.data.DataLoader(Dataset(st), batch_size=6,
                                             sampler=PlanSampler(plan, comm.Get_rank()),
                                             collate_fn=lambda xs: xs)
        seen = []
        for batch, want in zip(loader, plan.batches(comm.Get_rank(), 0)):
            assert len(batch) == len(want)
            for sample, i in zip(batch, want.tolist()):
                assert list(sample) == list(ds.schema.names)
                for k, v in ds[i].items():
                    assert sample[k].numpy().tobytes() == v.tobytes() and \
                        tuple(sample[k].shape) == v.shape, (i, k)
                seen.append(i)
        assert seen == plan.stream(comm.Get_rank(), 0).tolist()
        fetched = st.stats()["fetches_by_source"]
        assert fetched.get("peer", 0) > 0 and sum(fetched.values()) == len(seen), fetched


def test_torch_dataloader_over_the_store(packed):
    path, _ = packed
    assert_ranks_ok(run_ranks(2, rank_torch_dataset_over_the_store, path), 2)


@pytest.mark.parametrize("ranks", [2, 4])
def test_bit_exact_for_every_width(packed, ranks):
    path, _ = packed
    p = run_ranks(ranks, rank_bit_exact, path)
    assert p.returncode == 0, p.stderr[-3000:]
    widths = [w for w in range(1, ranks + 1) if ranks % w == 0]
    for w in widths:
        for t in TRANSPORTS:
            assert sum(f"width {w} {t} ok" in line for line in p.stdout.splitlines()) == ranks


def rank_node_aware(path: str) -> None:
    """One rank: node_aware groups make one replica per node (one node here)."""
    from mpi4py import MPI

    from forebay.store import DistributedStore

    ds = forebay.open_dataset(path)
    with DistributedStore(ds, MPI.COMM_WORLD, node_aware=True, progress=False) as st:
        assert st.width == 2 and st.replicas == 1  # one node here
        assert st.get_many(range(len(ds))).equals(ds.get_many(range(len(ds))))


def test_node_aware_groups(packed):
    assert_ranks_ok(run_ranks(2, rank_node_aware, packed[0]), 2)


def rank_errors(*args: str) -> None:
    """One rank of the errors test (run by run_ranks)."""
    argv = ["rank", *args]
    from mpi4py import MPI
    from conftest import say
    from forebay.store import DistributedStore, StoreError
    from forebay.errors import SampleIndexError
    comm = MPI.COMM_WORLD
    case = argv[1]
    try:
        if case == "width":
            DistributedStore(argv[2], comm, width=3, progress=False)
        elif case == "dataset":
            DistributedStore(argv[2 + comm.rank % 2], comm, progress=False)
        elif case == "memory":
            DistributedStore(argv[2], comm, width=1, progress=False)
        elif case == "index":
            with DistributedStore(argv[2], comm, progress=False) as st:
                try:
                    st.get_many([0, 10**6])
                except SampleIndexError as e:
                    say(f"rank {comm.rank} IndexError {e}")
                comm.Barrier()
            return
    except StoreError as e:
        say(f"rank {comm.rank} StoreError {e}")
        return
    say(f"rank {comm.rank} no error")


def _per_rank(p, word):
    return [line for line in p.stdout.splitlines() if word in line]


def test_width_not_dividing_world_fails_on_every_rank(packed):
    p = run_ranks(4, rank_errors, "width", packed[0], timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = _per_rank(p, "StoreError")
    assert len(lines) == 4 and all("width 3 must divide the world size 4" in s for s in lines)


def test_different_datasets_detected_on_every_rank(tmp_path, packed, ragged):
    other = tmp_path / "other"
    forebay.write_dataset(other, ragged[:100])
    p = run_ranks(2, rank_errors, "dataset", packed[0], other, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = _per_rank(p, "StoreError")
    assert len(lines) == 2 and all("different datasets" in s and "other" in s for s in lines)


def test_memory_budget_checked_before_allocating(packed):
    p = run_ranks(2, rank_errors, "memory", packed[0], timeout=60,
                env={"FOREBAY_MEMORY_LIMIT": "50000"})
    assert p.returncode == 0, p.stderr[-2000:]
    lines = _per_rank(p, "StoreError")
    assert len(lines) == 2 and all("GiB is available" in s and "2 replicas" in s for s in lines)


def test_bad_ids_name_the_id(packed):
    p = run_ranks(2, rank_errors, "index", packed[0], timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = _per_rank(p, "IndexError")
    assert len(lines) == 2 and all("1000000 out of range" in s for s in lines)


def test_single_process_store_without_mpi(packed):
    path, _ = packed
    ds = forebay.open_dataset(path)
    seen = []
    st = DistributedStore(ds, comm=None, progress=False,
                          on_pfs_read=lambda nbytes, n, dt: seen.append(n))
    assert st.world == 1 and st.width == 1
    assert sum(seen) == len(ds) == st.stats()["pfs_reads"]  # preload read each sample once
    ids = np.array([5, 3, 299, 5, -1])
    assert st.get_many(ids).equals(ds.get_many(ids))
    with pytest.raises(StoreError, match="needs MPI"):
        DistributedStore(ds, comm=None, width=2)
    st.close()
    with pytest.raises(StoreError, match="closed"):
        st.get_many([0])


@pytest.mark.parametrize("width", [1, 2, 3, 5])
def test_layout_covers_every_record_once(packed, width):
    ds = forebay.open_dataset(packed[0])
    lay = StoreLayout(ds, width)
    assert lay.bounds[0] == 0 and lay.bounds[-1] == len(ds)
    assert (np.diff(lay.bounds) >= 0).all()
    assert (lay.offset % 64 == 0).all()  # records keep their alignment
    rec_len = ds._index[:, 1]
    for m in range(width):
        sel = lay.member == m
        spans = sorted(zip(lay.offset[sel].tolist(), (lay.offset[sel] + rec_len[sel]).tolist()))
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # no overlap
        assert all(e <= lay.nbytes[m] for _, e in spans)
    # chunks balanced by bytes: no member holds more than its share plus one record
    assert lay.nbytes.max() <= lay.nbytes.sum() / width + 2 * (rec_len.max() + 64)


def test_parallel_preload_reads_every_byte_and_names_a_short_file(tmp_path):
    """Preload reads 16 MiB pieces, several at once: every byte lands where it belongs
    for any piece count, offset and thread count, and a file shorter than its index
    says raises StoreError naming the file and byte."""
    import os

    from forebay.progress import as_progress
    from forebay.store._pread import read_parallel

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(40 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, n, threads in ((0, len(data), 4), (7, len(data) - 7, 3),
                                   (100, 5000, 4), (0, len(data), 1)):
            out = np.zeros(n, dtype=np.uint8)
            read_parallel(fd, out, offset, path, as_progress(None), threads)
            assert np.array_equal(out, data[offset:offset + n]), (offset, n, threads)
        with pytest.raises(StoreError, match=f"{path}: unexpected end of file at byte"):
            read_parallel(fd, np.zeros(len(data), dtype=np.uint8), 20 << 20, path,
                          as_progress(None), 4)
    finally:
        os.close(fd)
    with pytest.raises(forebay.errors.InvalidArgumentError, match="read_threads"):
        DistributedStore(forebay.open_dataset(_tiny(tmp_path)), comm=None, read_threads=0)


def _tiny(tmp_path):
    p = tmp_path / "tiny"
    forebay.write_dataset(p, ({"x": np.arange(3) + i} for i in range(5)))
    return p


def rank_preload_of_a_short_shard(path: str, transport: str) -> None:
    """A shard of rank 1's chunk cut short after every rank opened the dataset: the
    set-up fails on both ranks, naming it (rank 0 waited for rank 1 before)."""
    from mpi4py import MPI

    from forebay.errors import TruncatedShardError
    from conftest import say

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    last = ds.shard_path(len(ds.manifest.shards) - 1)
    comm.Barrier()
    if comm.rank == 1:
        os.truncate(last, 100)
    comm.Barrier()
    with pytest.raises((TruncatedShardError, StoreError), match=os.path.basename(last)):
        DistributedStore(ds, comm, transport=transport, progress=False)
    say(f"rank {comm.rank} failed together")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_short_shard_fails_the_preload_on_every_rank(tmp_path, transport):
    path = tmp_path / "ds"
    forebay.write_dataset(path, ({"x": np.full(500, i, dtype=np.int64)} for i in range(64)),
                          shard_bytes=64 << 10)
    p = run_ranks(2, rank_preload_of_a_short_shard, path, transport)
    assert_ranks_ok(p, 2)
    assert p.stdout.count("failed together") == 2


def _locked_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck"))


def rank_pages_lock_the_chunk(path: str) -> None:
    """Transport "pages": each rank locks the shards of its own chunk in memory (the
    node holds each byte once, in the page cache; no segment of the store's own) and
    unlocks them at close."""
    from mpi4py import MPI

    from conftest import say

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    before = _locked_bytes()
    with DistributedStore(ds, comm, progress=False) as st:
        assert st.transport == "pages"       # auto, on one node
        mine = np.unique(ds.shard_of[st.layout.member == st.member]).tolist()
        page = 4096
        want = sum(-(-ds.manifest.shards[k].data_nbytes // page) * page for k in mine)
        assert _locked_bytes() - before == want
        every = np.arange(len(ds))
        assert st.get_many(every).equals(ds.get_many(every))
    assert _locked_bytes() == before
    say(f"rank {comm.rank} locked its chunk")


@pytest.mark.skipif(not can_lock(64 << 20) or not os.path.exists("/proc/self/status"),
                    reason="this process may not lock memory (RLIMIT_MEMLOCK)")
def test_pages_preload_locks_each_rank_s_shards_until_close(tmp_path):
    path = tmp_path / "ds"
    forebay.write_dataset(path, ({"x": np.full(700, i, dtype=np.int64)} for i in range(96)),
                          shard_bytes=64 << 10)
    p = run_ranks(2, rank_pages_lock_the_chunk, path)
    assert_ranks_ok(p, 2)
    assert p.stdout.count("locked its chunk") == 2


def test_transport_pages_named_where_it_applies(tmp_path):
    """'pages' is a preload transport; the clairvoyant store, asked for it, says its
    own word for the same thing."""
    from forebay.errors import InvalidArgumentError
    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    ds = forebay.open_dataset(_tiny(tmp_path))
    with pytest.raises(InvalidArgumentError, match="'auto', 'pages', 'shm', 'rma', 'exchange'"):
        DistributedStore(ds, LOCAL, transport="page", progress=False)
    with pytest.raises(InvalidArgumentError, match="ram_tier='pages'"):
        ClairvoyantStore(ds, forebay.AccessPlan(len(ds), 1, 2, 1), LOCAL, ram_bytes=1 << 20,
                         transport="pages")
