"""A preload overlapped with training (``DistributedStore(overlap=True)``, the loader's
``overlap_preload``): batches are bit-exact while the chunks load, what has not arrived
is read from the files, a failed load fails every rank, and the loader's batches are
the same as a preloaded one's.  Each ``rank_*`` function runs on every rank of real
mpiexec or torchrun; a load is held at a point by its ``on_pfs_read`` hook (called
before each piece is announced), never by timing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import forebay
from forebay.errors import ChecksumError
from forebay.store import DistributedStore, StoreError, StoreLayout
from forebay.dataset import can_lock
from forebay.world import LOCAL
from conftest import assert_ranks_ok, assert_step_ok, damaged_copy, run_ranks, run_steps

pytestmark = pytest.mark.mpi
#: whether the chunks can be held in the page cache here (RLIMIT_MEMLOCK)
CAN_LOCK = can_lock(64 << 20)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("overlap") / "ds"
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"x": rng.normal(size=(int(rng.integers(1, 9)), 3)),
                                  "b": rng.bytes(int(rng.integers(0, 90))),
                                  "y": np.int64(i)} for i in range(120)), shard_bytes=4 << 10)
    return path


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """Records of ~80 KiB: the background load yields to batches reading the files."""
    path = tmp_path_factory.mktemp("overlap-large") / "ds"
    rng = np.random.default_rng(1)
    forebay.write_dataset(path, ({"b": rng.bytes(int(rng.integers(70_000, 95_000))),
                                  "y": np.int64(i)} for i in range(40)), shard_bytes=1 << 20)
    assert not forebay.open_dataset(path).small_records
    return path


@pytest.fixture(scope="module")
def large_run(tmp_path_factory):
    """One shard of ~21 MB: a run of five 4 MiB pieces, more than the threaded read
    path keeps in flight (4)."""
    path = tmp_path_factory.mktemp("overlap-run") / "ds"
    rng = np.random.default_rng(2)
    forebay.write_dataset(path, ({"b": rng.bytes(int(rng.integers(70_000, 95_000))),
                                  "y": np.int64(i)} for i in range(250)), shard_bytes=64 << 20)
    return path


DAMAGED = 100      # the sample whose record the damaged copies break


@pytest.fixture(scope="module")
def torchrun_steps(dataset, large, tmp_path_factory):
    """This module's torchrun cases, in turn, in one real ``torchrun --nproc-per-node 2``
    job (its CompletedProcess; each test checks its step)."""
    damaged = damaged_copy(dataset, tmp_path_factory.mktemp("overlap-damaged") / "ds",
                           DAMAGED)
    owner = int(StoreLayout(forebay.open_dataset(damaged), 2).member[DAMAGED])
    steps: dict = {
        "auto": (rank_auto_overlap_agrees, dataset),
        "held-shm": (rank_held_member, dataset, 0),
        "loader-exchange": (rank_loader_batches, dataset, "exchange"),
        "exchange-dataset": (rank_exchange_held, dataset, 1),
        "exchange-large": (rank_exchange_held, large, 1),
        "damaged-exchange": (rank_damage_fails_every_rank, damaged, owner, DAMAGED,
                             "exchange"),
    }
    if CAN_LOCK:
        steps["held-pages-large"] = (rank_held_member, large, 1, "pages")
        steps["damaged-pages"] = (rank_damage_fails_every_rank, damaged, owner, DAMAGED,
                                  "pages")
    return run_steps(2, steps)


def _check_all(store, ds) -> None:
    every = np.arange(len(ds))
    assert store.get_many(every).equals(ds.get_many(every))
    ids = np.random.default_rng(1).integers(-len(ds), len(ds), size=64)
    assert store.get_many(ids).equals(ds.get_many(ids))


def test_auto_overlaps_on_a_network_or_emulated_file_system(dataset, tmp_path):
    """``overlap="auto"``: the loader's default.  On a network file system (a mounts
    table in /proc/mounts' format) or with an on_pfs_read hook the load overlaps
    training; on this local disk it does not; anything else is refused by name."""
    from forebay.errors import InvalidArgumentError
    from forebay.store._distributed import overlap_by_default
    from forebay.torch import DataLoader

    table = (f"/dev/sda1 / ext4 rw 0 0\n10.0.0.1@o2ib:/scratch {tmp_path} lustre rw 0 0\n"
             f"srv:/home {tmp_path / 'home'} nfs4 rw 0 0\n")
    assert overlap_by_default(tmp_path / "ds", mounts=table)
    assert overlap_by_default(tmp_path / "home" / "ds", mounts=table)
    assert not overlap_by_default("/data/ds", mounts=table)
    assert overlap_by_default("/data/ds", lambda *a: None, mounts=table)
    ds = forebay.open_dataset(dataset)
    local = not overlap_by_default(dataset)     # this test's own tmp directory
    with DistributedStore(ds, LOCAL, overlap="auto") as st:
        assert st.overlap == (not local)
    with DistributedStore(ds, LOCAL, overlap="auto", on_pfs_read=lambda *a: None) as st:
        assert st.overlap and "background_fill" in st.capabilities
        _check_all(st, ds)
    with DataLoader(dataset, 8, comm=LOCAL, store="preload") as dl:
        assert dl.stats()["overlap"] == (not local)
    with pytest.raises(InvalidArgumentError, match="overlap must be True, False or 'auto'"):
        DistributedStore(ds, LOCAL, overlap="yes")


def test_a_file_system_declared_shared_is_treated_as_one(dataset, tmp_path, monkeypatch):
    """FOREBAY_NETWORK_FS names more file system types shared between hosts (one forebay
    does not list, or a local one, to emulate a parallel file system): a dataset there
    gets what a network file system gets: an overlapped preload by default, no
    transport or RAM tier in the page cache, and the model repository's LMDB refused."""
    from forebay._fs import filesystem_type, network_fs
    from forebay.errors import ModelRepositoryError
    from forebay.models._backend import check_local_fs
    from forebay.plan import AccessPlan
    from forebay.store import ClairvoyantStore
    from forebay.store._distributed import overlap_by_default

    fs = filesystem_type(dataset)
    assert fs is not None and network_fs(dataset) is None
    table = f"/dev/sda1 / ext4 rw 0 0\nsrv:/x {tmp_path} fuse.dfuse rw 0 0\n"
    assert network_fs(tmp_path / "d", table) is None
    monkeypatch.setenv("FOREBAY_NETWORK_FS", f"fuse.dfuse, {fs}")
    assert network_fs(tmp_path / "d", table) == "fuse.dfuse"
    assert network_fs(dataset) == fs and overlap_by_default(dataset)
    ds = forebay.open_dataset(dataset)
    with DistributedStore(ds, LOCAL, overlap="auto") as st:
        assert st.overlap and st.transport != "pages"
        _check_all(st, ds)
    st = ClairvoyantStore(ds, AccessPlan(len(ds), 1, 8, 1, 0), LOCAL, ram_bytes=1 << 20)
    assert st.stats()["ram_tier"] == "copy"
    st.close()
    with pytest.raises(ModelRepositoryError, match=f"is on {fs}"):
        check_local_fs(tmp_path / "models")


def rank_auto_overlap_agrees(path: str) -> None:
    """Only rank 0's files are 'slow' (its on_pfs_read hook): every rank overlaps, and
    the batches are bit-exact."""
    from forebay.world import resolve_comm

    comm = resolve_comm()
    ds = forebay.open_dataset(path)
    hook = (lambda *a: None) if comm.Get_rank() == 0 else None
    with DistributedStore(ds, comm, overlap="auto", on_pfs_read=hook, progress=False) as st:
        assert st.overlap
        _check_all(st, ds)


def test_auto_overlap_is_one_decision_for_every_rank(dataset):
    assert_ranks_ok(run_ranks(2, rank_auto_overlap_agrees, dataset), 2)


def test_auto_overlap_is_one_decision_for_every_rank_torchrun(torchrun_steps):
    assert_step_ok(torchrun_steps, "auto", 2)


@pytest.mark.parametrize("kind", ["dataset", "large", "large_run"])
def test_one_process_reads_the_files_until_the_chunk_arrives(request, kind):
    ds = forebay.open_dataset(request.getfixturevalue(kind))
    gate, pieces = threading.Event(), []

    def hold(nbytes, samples, seconds):
        pieces.append(samples)
        assert gate.wait(timeout=60)

    st = DistributedStore(ds, LOCAL, overlap=True, on_pfs_read=hold)
    assert st.overlap and "background_fill" in st.capabilities
    assert st.yields == kind.startswith("large")
    assert st.stats()["preload_seconds"] is None
    _check_all(st, ds)                       # nothing announced yet: all from the files
    asked = len(ds) + 64
    # large records: the batch that read them kept them, the next found them there
    kept = st.yields
    files = len(ds) if kept else asked
    assert st.stats()["fetches_by_source"] == {"local": asked - files, "peer": 0,
                                               "pfs": files}
    assert not st.wait_filled(timeout=0)
    gate.set()
    assert st.wait_filled(timeout=60)
    assert sum(pieces) == len(ds)            # every record checked in, once
    # the load read its first piece (a run, or 4 MiB of one; with a longer run up to 4
    # pieces were queued before the hold), then found every later one kept; or, where
    # its thread started after the batch had kept everything, read nothing at all
    chunk, first = int(st.layout.runs["len"].sum()), int(st.layout.runs["len"][0])
    skipped = st.stats()["preload_skipped_bytes"]
    if not kept:
        assert skipped == 0
    elif first <= 4 << 20:
        assert skipped in (chunk - first, chunk)
    else:
        assert chunk - 4 * (4 << 20) <= skipped <= chunk and skipped > 0
    _check_all(st, ds)
    s = st.stats()
    assert s["fetches_by_source"] == {"local": 2 * asked - files, "peer": 0, "pfs": files}
    assert s["pfs_reads"] == len(ds) + files and s["preload_seconds"] > 0
    st.close()
    with pytest.raises(StoreError, match="closed"):
        st.get_many([0])


def test_closing_stops_the_load(dataset):
    ds = forebay.open_dataset(dataset)
    calls = []
    runs = int((StoreLayout(ds, 1).runs["member"] == 0).sum())
    assert runs > 3                          # several pieces to stop between

    made, store = threading.Event(), []

    def close_at_first(nbytes, samples, seconds):
        calls.append(samples)
        assert made.wait(timeout=60)
        store[0].abandon()                   # from the loading thread itself

    st = DistributedStore(ds, LOCAL, overlap=True, on_pfs_read=close_at_first)
    store.append(st)
    made.set()
    assert st.wait_filled(timeout=60)
    assert len(calls) == 1
    with pytest.raises(StoreError, match="closed"):
        st.get_many([0])


def _held_store(path: str, held: int, transport: str):
    """An overlapped store over the job's ranks whose member ``held`` announces
    nothing until ``gate`` is set: (comm, ds, store, gate)."""
    from forebay.world import resolve_comm

    comm = resolve_comm()
    rank = comm.Get_rank()
    ds = forebay.open_dataset(path)
    gate = threading.Event()

    def hold(nbytes, samples, seconds):
        if rank == held:
            assert gate.wait(timeout=60)

    st = DistributedStore(ds, comm, overlap=True, on_pfs_read=hold, progress=False,
                          transport=transport)
    assert st.overlap and st.transport == transport, st.stats()
    return comm, ds, st, gate


def rank_held_member(path: str, held_: str, transport: str = "shm") -> None:
    """Member ``held`` announces nothing until the others have read everything."""
    held = int(held_)
    comm, ds, st, gate = _held_store(path, held, transport)
    rank = comm.Get_rank()
    if rank != held:
        assert st.wait_filled(timeout=60)
    comm.Barrier()                           # every other member has loaded its chunk
    for turn in range(comm.Get_size()):      # one rank at a time: what each finds kept
        if turn == rank:
            _check_all(st, ds)
        comm.Barrier()
    owned = st.layout.member[np.arange(len(ds))]
    ids = np.random.default_rng(1).integers(-len(ds), len(ds), size=64) % len(ds)
    read_twice = int((owned == held).sum() + (owned[ids] == held).sum())
    if not st.yields:                        # small records: read, not kept
        from_files = read_twice
    elif transport == "rma":   # large: a batch keeps only its own member's records
        from_files = int((owned == held).sum()) if rank == held else read_twice
    else:   # large: rank 0 reads the held chunk and keeps it (copied into the chunk, or
        # locked in the page cache); later reads find it there
        assert held != 0
        from_files = int((owned == held).sum()) if rank == 0 else 0
    assert st.stats()["fetches_by_source"].get("pfs", 0) == from_files, st.stats()
    comm.Barrier()
    _release(comm, ds, st, gate, from_files)


def _release(comm, ds, st, gate, from_files: int) -> None:
    """Let the held member load; once every chunk is in, batches read no file."""
    gate.set()
    assert st.wait_filled(timeout=60)
    comm.Barrier()                           # every member has loaded its chunk
    _check_all(st, ds)
    assert st.stats()["fetches_by_source"].get("pfs", 0) == from_files   # none since
    st.close()


@pytest.mark.parametrize("ranks,kind", [(2, "dataset"), (3, "dataset"), (2, "large")])
def test_what_has_not_arrived_is_read_from_the_files(request, ranks, kind):
    path = request.getfixturevalue(kind)
    assert_ranks_ok(run_ranks(ranks, rank_held_member, path, 1), ranks)


@pytest.mark.parametrize("kind", ["dataset", "large"])
def test_what_has_not_arrived_is_read_from_the_files_rma(request, kind):
    """Over MPI RMA (across nodes; forced here): the owners' headers are fetched with
    MPI atomics, what has arrived with MPI_Get, the rest read from the files."""
    path = request.getfixturevalue(kind)
    assert_ranks_ok(run_ranks(2, rank_held_member, path, 1, "rma"), 2)


def test_what_has_not_arrived_is_read_from_the_files_torchrun(torchrun_steps):
    assert_step_ok(torchrun_steps, "held-shm", 2)


@pytest.mark.skipif(not CAN_LOCK, reason="this process may not lock memory (RLIMIT_MEMLOCK)")
@pytest.mark.parametrize("launcher,kind", [("mpiexec", "dataset"), ("mpiexec", "large"),
                                           ("torchrun", "large")])
def test_what_has_not_arrived_is_read_from_the_files_pages(request, launcher, kind):
    """Over the files' pages (transport "pages"): every batch reads the files' maps;
    the members' headers, in a node segment, say what to count as loaded."""
    if launcher == "torchrun":
        assert_step_ok(request.getfixturevalue("torchrun_steps"), "held-pages-large", 2)
        return
    path = request.getfixturevalue(kind)
    assert_ranks_ok(run_ranks(2, rank_held_member, path, 1, "pages"), 2)


def rank_damage_fails_every_rank(path: str, owner_: str, sample_: str,
                                 transport: str = "auto") -> None:
    from forebay.world import resolve_comm

    owner, sample = int(owner_), int(sample_)
    comm = resolve_comm()
    ds = forebay.open_dataset(path, verify_on_read=True)
    st = DistributedStore(ds, comm, overlap=True, progress=False, transport=transport)
    assert st.overlap
    mine = np.flatnonzero(st.layout.member == st.member)
    if comm.Get_rank() == owner:
        with pytest.raises(ChecksumError, match=f"sample {sample} fails"):
            st.wait_filled(timeout=60)
    comm.Barrier()                           # the owner's load has failed
    want = (ChecksumError, f"sample {sample} fails") if comm.Get_rank() == owner else \
        (StoreError, f"rank {owner}'s background preload .*failed: ChecksumError: .*"
                     f"sample {sample} fails")
    with pytest.raises(want[0], match=want[1]):
        # even a batch of this rank's own samples; over the exchange, a collective
        # that no rank is left waiting in
        st.get_many(mine[:1])
    st.close()


@pytest.mark.parametrize("launcher,transport", [
    ("mpiexec", "shm"), ("mpiexec", "rma"), ("mpiexec", "exchange"), ("torchrun", "exchange")] +
    ([("mpiexec", "pages"), ("torchrun", "pages")] if CAN_LOCK else []))
def test_a_damaged_record_fails_the_load_on_every_rank(request, dataset, tmp_path, launcher,
                                                       transport):
    if launcher == "torchrun":
        assert_step_ok(request.getfixturevalue("torchrun_steps"), f"damaged-{transport}", 2)
        return
    path = damaged_copy(dataset, tmp_path / "ds", DAMAGED)
    owner = int(StoreLayout(forebay.open_dataset(path), 2).member[DAMAGED])
    assert_ranks_ok(run_ranks(2, rank_damage_fails_every_rank, path, owner, DAMAGED,
                              transport), 2)


def rank_loader_batches(path: str, transport: str = "auto") -> None:
    """The same batches with and without overlap, epoch after epoch."""
    from forebay.torch import DataLoader, Preload

    got = {}
    for overlap in (False, True):
        with DataLoader(path, 8, epochs=2, seed=5,
                        store=Preload(overlap=overlap, transport=transport)) as dl:
            assert dl.stats()["overlap"] == overlap
            got[overlap] = []
            for epoch in range(2):
                dl.set_epoch(epoch)
                got[overlap].append([b["y"].tolist() for b in dl])
    assert got[False] == got[True]


def test_loader_batches_are_the_same_with_overlap(dataset):
    assert_ranks_ok(run_ranks(2, rank_loader_batches, dataset), 2)


def test_loader_batches_are_the_same_with_overlap_over_the_exchange(torchrun_steps):
    assert_step_ok(torchrun_steps, "loader-exchange", 2)


# ------------------------------------------------------------------ the exchange transport
# Across nodes under torchrun (forced here on one node): each member serves its own
# records, from memory once loaded, from the files before; no header is read remotely.

def rank_exchange_held(path: str, held_: str) -> None:
    """Member ``held`` announces nothing until the others have read everything; every
    batch is a collective, and the held member serves its records from the files."""
    held = int(held_)
    comm, ds, st, gate = _held_store(path, held, "exchange")
    rank = comm.Get_rank()
    assert st.yields == (not ds.small_records)
    if rank != held:
        assert st.wait_filled(timeout=60)
    comm.Barrier()
    _check_all(st, ds)                       # collective: every rank, in step
    owned = st.layout.member[np.arange(len(ds))]
    ids = np.random.default_rng(1).integers(-len(ds), len(ds), size=64) % len(ds)
    # the held member read its own samples from the files, and served the others' asks
    # of its samples from the files too; the others from memory.  Large records: what
    # it read for the first batch it kept in its chunk, and served later ones from there
    mine = int((owned == rank).sum())
    if not st.yields:
        mine += int((owned[ids] == rank).sum())
    s = st.stats()
    want_files = mine if rank == held else 0
    assert s["fetches_by_source"].get("pfs", 0) == want_files, s
    asked_of_me = (comm.Get_size() - 1) * mine if rank == held else 0
    assert s["pfs_reads"] == int((owned == rank).sum()) + want_files + asked_of_me, s
    _release(comm, ds, st, gate, want_files)


@pytest.mark.parametrize("launcher,kind", [("mpiexec", "dataset"), ("torchrun", "dataset"),
                                           ("torchrun", "large")])
def test_over_the_exchange_the_owner_serves_what_has_not_arrived(request, launcher, kind):
    if launcher == "torchrun":
        assert_step_ok(request.getfixturevalue("torchrun_steps"), f"exchange-{kind}", 2)
        return
    assert_ranks_ok(run_ranks(2, rank_exchange_held, request.getfixturevalue(kind), 1), 2)
