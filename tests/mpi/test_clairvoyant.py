"""ClairvoyantStore under mpiexec: bit-exact through every source, exact presence, one PFS
read per sample when the tiers hold the dataset."""

from __future__ import annotations

import itertools

import pytest

import forebay
from forebay.dataset import can_lock
from forebay.errors import InvalidArgumentError
from forebay.store import ClairvoyantStore, StoreError
from conftest import run_ranks

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi

def rank_partial(*args: str) -> None:
    """One rank of the partial test (run by run_ranks)."""
    argv = ["rank", *args]
    import threading
    import time
    import numpy as np
    from mpi4py import MPI
    import forebay
    from forebay.store import ClairvoyantStore, tier_nbytes
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    plan = forebay.AccessPlan(len(ds), comm.size, 8, 3, seed=1)
    for transport in ("shm", "rma"):
        for share in (0.9, 0.3):  # tiers hold most / a third of the dataset
            ram = int(tier_nbytes(ds).sum() * share / comm.size)
            st = ClairvoyantStore(ds, plan, comm, ram_bytes=ram, transport=transport,
                                  fill=False)
            assert st.transport == transport
            # a slow fill races the reads: a sample is served from a tier only once the
            # owner's counter says it is complete, so every batch stays bit-exact
            def slow(st=st):
                while st.fill_now(limit=3):
                    time.sleep(0.002)
            t = threading.Thread(target=slow)
            t.start()
            checked = 0
            for e in range(3):
                for ids in plan.batches(comm.rank, e):
                    assert st.get_many(ids).equals(ds.get_many(ids)), (transport, share, e)
                    checked += 1
            t.join()
            comm.Barrier()
            for ids in plan.batches(comm.rank, 2):  # all filled now
                assert st.get_many(ids).equals(ds.get_many(ids))
            s = st.stats()
            src = comm.allreduce(np.array([s["fetches_by_source"][k] for k in
                                           ("local", "peer", "pfs")]))
            say(f"rank {comm.rank} {transport} {share} ok {checked} sources {src.tolist()}")
            st.close()

def rank_exact(*args: str) -> None:
    """One rank of the exact test (run by run_ranks)."""
    argv = ["rank", *args]
    from mpi4py import MPI
    import forebay
    from forebay.store import tier_nbytes
    from forebay.torch import Clairvoyant, DataLoader, Pipeline
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    need = int(tier_nbytes(ds).sum())
    dl = DataLoader(ds, 8, comm=comm, seed=3, epochs=3,
                    store=Clairvoyant(ram_bytes=int(need * 1.2 / comm.size)),
                    pipeline=Pipeline(collate_fn=lambda b: b))
    assert dl.store.placement.covered == 1.0
    assert dl.store.wait_filled(timeout=60)
    comm.Barrier()  # fills finished before use
    for e in range(3):
        dl.set_epoch(e)
        for step, batch in enumerate(dl):
            ids = dl.plan.batches(comm.rank, e)[step]
            assert batch.equals(ds.get_many(ids))
    s = dl.stats()
    total = comm.allreduce(s["pfs_reads"])
    say(f"rank {comm.rank} pfs_reads_total {total} samples {len(ds)} "
        f"sources {s['fetches_by_source']} stall {s['stall_seconds'] >= 0}")
    dl.close()


@pytest.mark.parametrize("ranks", [2, 3])
def test_bit_exact_while_filling(packed, ranks):
    p = run_ranks(ranks, rank_partial, packed[0], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    ok = [line for line in p.stdout.splitlines() if " ok " in line]
    assert len(ok) == 4 * ranks
    # every source was exercised: local tier, a peer's tier and the PFS
    for line in ok:
        local, peer, pfs = eval(line.split("sources ")[1])
        assert local > 0 and peer > 0 and pfs > 0, line


def test_one_pfs_read_per_sample_when_tiers_hold_the_dataset(packed):
    p = run_ranks(2, rank_exact, packed[0], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if "pfs_reads_total" in line]
    assert len(lines) == 2
    n = len(packed[1])
    assert all(f"pfs_reads_total {n} samples {n}" in line for line in lines), lines
    assert all("'pfs': 0" in line for line in lines)


def test_single_process_and_bad_arguments(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), 1, 16, 2, seed=0)
    from forebay.store import tier_nbytes

    seen = []
    with ClairvoyantStore(ds, plan, comm=None, ram_bytes=int(tier_nbytes(ds).sum()) // 3,
                          on_pfs_read=lambda nbytes, n, dt: seen.append((nbytes, n))) as st:
        assert st.transport == "local" and 0 < st.placement.covered < 1
        assert st.wait_filled(timeout=30)
        for e in range(2):
            for ids in plan.batches(0, e):
                assert st.get_many(ids).equals(ds.get_many(ids))
        s = st.stats()
        assert s["fetches_by_source"]["local"] > 0 and s["fetches_by_source"]["pfs"] > 0
        assert s["pfs_reads"] == s["filled"] + s["fetches_by_source"]["pfs"]
        assert sum(n for _, n in seen) == s["pfs_reads"]  # the hook sees every PFS read
        assert sum(b for b, _ in seen) == s["pfs_bytes"]
    with pytest.raises(StoreError, match="the plan is for 2 ranks"):
        ClairvoyantStore(ds, forebay.AccessPlan(len(ds), 2, 4, 1), comm=None, ram_bytes=10)
    with pytest.raises(StoreError, match="ram_bytes must be >= 0"):
        ClairvoyantStore(ds, plan, comm=None, ram_bytes=-1)
    with pytest.raises(StoreError, match="covers 10 samples"):
        ClairvoyantStore(ds, forebay.AccessPlan(10, 1, 4, 1), comm=None, ram_bytes=10)
    zero = ClairvoyantStore(ds, plan, comm=None, ram_bytes=0)
    assert zero.get_many([1, 2]).equals(ds.get_many([1, 2]))
    assert zero.stats()["fetches_by_source"]["pfs"] == 2
    zero.close()


def rank_dies(*args: str) -> None:
    """One rank of the dies test (run by run_ranks)."""
    argv = ["rank", *args]
    import os
    from mpi4py import MPI
    import forebay
    from forebay.torch import DataLoader, Pipeline, store_settings
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    dl = DataLoader(ds, 8, comm=comm, epochs=50,
                    store=store_settings(argv[2], ram_bytes=ds.nbytes),
                    pipeline=Pipeline(collate_fn=lambda b: b))
    if comm.rank == 1:
        os._exit(3)  # dies without a word, holding part of the data
    for e in range(50):
        dl.set_epoch(e)
        for _ in dl:
            pass
        comm.Barrier()  # the next collective cannot complete


@pytest.mark.parametrize("mode", ["preload", "clairvoyant"])
def test_a_rank_that_dies_ends_the_job_instead_of_hanging(packed, mode):
    import time

    t0 = time.monotonic()
    p = run_ranks(2, rank_dies, packed[0], mode, timeout=90)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 90


def rank_ssd(*args: str) -> None:
    """One rank of the ssd test (run by run_ranks)."""
    argv = ["rank", *args]
    import os
    from mpi4py import MPI
    import forebay
    from forebay.store import ClairvoyantStore, tier_nbytes
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    ssd_dir = argv[2]
    plan = forebay.AccessPlan(len(ds), comm.size, 8, 3, seed=5)
    need = int(tier_nbytes(ds).sum())
    # RAM for a quarter of the dataset, SSD for the rest and some: coverage is complete
    st = ClairvoyantStore(ds, plan, comm, ram_bytes=need // (4 * comm.size),
                          ssd_dir=ssd_dir, ssd_bytes=need // comm.size, transport=argv[3])
    p = st.placement
    assert p.covered == 1.0 and len(p.own_ssd) > 0
    files = len([f for f in os.listdir(ssd_dir) if f.endswith(".tier")])
    assert st.wait_filled(timeout=60)
    comm.Barrier()
    for e in range(3):
        for ids in plan.batches(comm.rank, e):
            assert st.get_many(ids).equals(ds.get_many(ids))
    s = st.stats()
    total = comm.allreduce(s["pfs_reads"])
    st.close()
    comm.Barrier()
    left = len([f for f in os.listdir(ssd_dir) if f.endswith(".tier")])
    say(f"rank {comm.rank} files {files} left {left} pfs_total {total} n {len(ds)} "
        f"pfs_fetches {s['fetches_by_source']['pfs']}")


@pytest.mark.parametrize("transport", ["shm", "rma"])
def test_ssd_tier_holds_what_ram_cannot(packed, tmp_path, transport):
    p = run_ranks(2, rank_ssd, packed[0], tmp_path, transport, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if "files" in line]
    assert len(lines) == 2
    n = len(packed[1])
    for line in lines:
        assert "files 2 left 0" in line  # one tier file per rank, removed at close
        if transport == "shm":  # peers read each other's SSD tier on the node
            assert f"pfs_total {n} n {n} pfs_fetches 0" in line, line


def test_unusable_ssd_dir_warns_and_falls_back(packed, tmp_path):
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 16, 1, seed=0)
    with pytest.warns(RuntimeWarning, match="SSD tier skipped: .* is not a directory"):
        st = ClairvoyantStore(ds, plan, comm=None, ram_bytes=1000,
                              ssd_dir=tmp_path / "missing", ssd_bytes=10**6)
    assert st.ssd_nbytes == 0
    assert st.get_many(range(20)).equals(ds.get_many(range(20)))
    st.close()
    with pytest.warns(RuntimeWarning, match="bytes free"):
        st = ClairvoyantStore(ds, plan, comm=None, ram_bytes=1000, ssd_dir=tmp_path,
                              ssd_bytes=10**18)
    st.close()
    # one process: RAM then SSD, file removed at close
    from forebay.store import tier_nbytes

    need = int(tier_nbytes(ds).sum())
    with ClairvoyantStore(ds, plan, comm=None, ram_bytes=need // 3, ssd_dir=tmp_path,
                          ssd_bytes=need) as st:
        assert st.placement.covered == 1.0 and len(st.placement.own_ssd) > 0
        assert len(list(tmp_path.glob("*.tier"))) == 1
        st.wait_filled(timeout=30)
        assert st.get_many(plan.batches(0, 0).reshape(-1)).equals(
            ds.get_many(plan.batches(0, 0).reshape(-1)))
        assert st.stats()["pfs_reads"] == len(ds)
    assert list(tmp_path.glob("*.tier")) == []


def rank_model(*args: str) -> None:
    """One rank of the model test (run by run_ranks)."""
    argv = ["rank", *args]
    from mpi4py import MPI
    import forebay
    from forebay.store import tier_nbytes
    from forebay.torch import Clairvoyant, DataLoader, Pipeline
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    need = int(tier_nbytes(ds).sum())
    dl = DataLoader(ds, 8, comm=comm, seed=3, epochs=2, system=argv[2],
                    store=Clairvoyant(ram_bytes=int(need * 1.2 / comm.size)),
                    pipeline=Pipeline(collate_fn=lambda b: b))
    assert dl.store.wait_filled(timeout=60)
    comm.Barrier()
    for e in range(2):
        dl.set_epoch(e)
        for step, batch in enumerate(dl):
            assert batch.equals(ds.get_many(dl.plan.batches(comm.rank, e)[step]))
    s = dl.stats()
    say(f"rank {comm.rank} peer {s['fetches_by_source']['peer']} "
        f"by_model {s['pfs_by_model']}")
    dl.close()


@pytest.mark.parametrize("pfs_MBps,rma_MBps,expect_peer", [(1e6, 1.0, False),
                                                           (10.0, 1e5, True)])
def test_performance_model_picks_the_file_system_when_it_is_faster(packed, tmp_path,
                                                                   pfs_MBps, rma_MBps,
                                                                   expect_peer):
    """NoPFS §4: with a system file saying the file system outruns peers' memory, samples
    a peer holds are read from the dataset instead (still bit-exact); otherwise from the
    peer."""
    path, _ = packed
    system = tmp_path / "system.toml"
    system.write_text(f'[pfs]\nread_MBps = {{ "1" = {pfs_MBps}, "2" = {pfs_MBps} }}\n'
                      f'[rma]\nget_MBps = {{ "2" = {rma_MBps} }}\n')
    p = run_ranks(2, rank_model, path, system, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2
    for ln in lines:
        peer, by_model = int(ln[3]), int(ln[5])
        if expect_peer:
            assert peer > 0 and by_model == 0
        else:
            assert peer == 0 and by_model > 0


def rank_threads(*args: str) -> None:
    """One rank of the threads test (run by run_ranks)."""
    argv = ["rank", *args]
    import time
    from mpi4py import MPI
    import forebay
    from forebay.store import ClairvoyantStore, tier_nbytes
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    plan = forebay.AccessPlan(len(ds), comm.size, 8, 3, seed=7)
    need = int(tier_nbytes(ds).sum())
    # slow file reads: the fill threads' chunks finish out of order and race the reads
    st = ClairvoyantStore(ds, plan, comm, ram_bytes=need // (3 * comm.size),
                          ssd_dir=argv[2], ssd_bytes=need // comm.size,
                          ram_threads=3, ssd_threads=2,
                          on_pfs_read=lambda nbytes, n, dt: time.sleep(0.003))
    names = sorted(t.name for t in st._threads)
    for e in range(3):
        for ids in plan.batches(comm.rank, e):
            assert st.get_many(ids).equals(ds.get_many(ids))
    assert st.wait_filled(timeout=60)
    s = st.stats()
    comm.Barrier()
    for ids in plan.batches(comm.rank, 0):      # everything from the tiers now
        assert st.get_many(ids).equals(ds.get_many(ids))
    end = st.stats()
    total = comm.allreduce(end["pfs_reads"])
    batch = comm.allreduce(end["fetches_by_source"]["pfs"])    # the batches' own reads
    before = comm.allreduce(s["fetches_by_source"]["pfs"])     # ... before the last pass
    st.close()
    say(f"rank {comm.rank} threads {names} filled {s['filled']} of {s['fill_total']} "
        f"pfs_total {total} batch {batch} before {before} n {len(ds)}")


def test_several_fill_threads_per_tier(packed, tmp_path):
    p = run_ranks(2, rank_threads, packed[0], tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if "threads" in line]
    assert len(lines) == 2
    for line in lines:
        assert ("['forebay-fill-ram-0', 'forebay-fill-ram-1', 'forebay-fill-ram-2', "
                "'forebay-fill-ssd-0', 'forebay-fill-ssd-1']") in line, line
        filled, total = line.split("filled ")[1].split(" pfs_total")[0].split(" of ")
        assert filled == total, line            # the counter covers the whole order
        pfs, n = int(line.split("pfs_total ")[1].split()[0]), int(line.split(" n ")[1])
        batch = int(line.split(" batch ")[1].split()[0])
        # the fills read every sample from the files once, whichever thread's chunk
        # finished first; a batch that needed a sample before its owner's counter
        # covered it read it too (how many depends on the race: not asserted here)
        assert pfs - batch == n, line
        # once filled, every read comes from the tiers
        assert batch == int(line.split(" before ")[1].split()[0]), line


def test_fill_thread_counts_are_checked(packed):
    plan = forebay.AccessPlan(len(packed[1]), 1, 4, 1)
    with pytest.raises(StoreError, match="ram_threads must be a positive integer"):
        ClairvoyantStore(packed[0], plan, None, ram_bytes=1 << 20, ram_threads=0)


def rank_no_copies_of_node_peers(*args: str) -> None:
    """With room for the whole dataset on every rank: over shm (ranks of one node read
    each other's tiers as their own memory) a rank holds only what it covers; over rma
    (as across nodes) it also makes extra copies of what it reads most."""
    from mpi4py import MPI
    import forebay
    from forebay.store import tier_nbytes
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(args[0])
    plan = forebay.AccessPlan(len(ds), comm.size, 8, 2, seed=2)
    sizes = tier_nbytes(ds)
    held = {}
    for transport in ("shm", "rma"):
        st = ClairvoyantStore(ds, plan, comm, ram_bytes=int(sizes.sum()), transport=transport)
        assert st.wait_filled(timeout=60)
        comm.Barrier()
        for e in range(2):
            for ids in plan.batches(comm.rank, e):
                assert st.get_many(ids).equals(ds.get_many(ids))
        p = st.placement
        held[transport] = (len(p.extra_ram), int(st.nbytes),
                           int(sizes[p.owner == comm.rank].sum()))
        st.close()
    extra, nbytes, covered = held["shm"]
    assert extra == 0 and nbytes == covered, held
    assert held["rma"][0] > 0 and held["rma"][1] > covered, held
    # peers reading the tier by RMA read its own memory: it cannot be the page cache
    with pytest.raises(StoreError, match="ram_tier='pages' is not possible here: transport "
                       "'rma'"):
        ClairvoyantStore(ds, plan, comm, ram_bytes=1 << 20, transport="rma",
                         ram_tier="pages")
    say(f"rank {comm.rank} held ok")


def test_ranks_of_a_node_keep_no_copies_of_each_others_samples(packed):
    """Each rank used to copy nearly the whole dataset into its RAM tier when it had room
    (3.3 GB of memory on the node for a 1.1 GB dataset), though over shm a peer's tier
    is read as fast as its own."""
    p = run_ranks(2, rank_no_copies_of_node_peers, packed[0], timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("held ok") == 2


def test_a_reader_racing_the_fill_leaves_no_hole_and_reads_each_sample_once(packed):
    """The fill jumps ahead of a reader that caught up with it (instead of both working
    on the same chunk, the reader sleeping); whatever it jumps over is loaded by the
    reader or filled at the end: however the two interleave, the tier ends complete,
    its prefix published, and each sample was read from the files once (with the tier
    in the page cache, a sample a batch read first is locked without a second read)."""
    import numpy as np

    from forebay.store import tier_nbytes
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 4, 2, seed=5)
    tiers = ("copy", "pages") if can_lock(4 * int(tier_nbytes(ds).sum())) else ("copy",)
    for threads, tier in itertools.product((1, 3), tiers):
        st = ClairvoyantStore(ds, plan, None, ram_bytes=int(tier_nbytes(ds).sum()),
                              ram_threads=threads, ram_tier=tier)
        for e in range(2):
            for ids in plan.batches(0, e):
                assert st.get_many(ids).equals(ds.get_many(ids))
        assert st.wait_filled(timeout=60)
        s = st.stats()
        assert s["filled"] == s["fill_total"] == len(ds)
        assert s["pfs_reads"] == len(ds), s
        assert np.all(st.local_pos >= 0)
        st.close()


def test_a_batch_never_reads_a_tier_position_still_being_written(packed, tmp_path):
    """A sample a fill thread is writing when a batch needs it: from an SSD tier (or a
    copying RAM tier) the batch waits for it, then reads the files; from the RAM tier
    in the page cache it reads the files' pages at once.  Either way the bytes are the
    dataset's (the pages tier once read an SSD position before the fill wrote it:
    zeros, silently)."""
    import numpy as np

    from forebay.store import tier_nbytes
    from forebay.store._placement import RAM, SSD
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 8, 1, seed=1)
    sizes = tier_nbytes(ds)
    tiers = ("copy", "pages") if can_lock(4 * int(sizes.sum())) else ("copy",)
    for tier in tiers:
        st = ClairvoyantStore(ds, plan, None, ram_bytes=int(sizes.sum() // 3), fill=False,
                              ssd_dir=tmp_path, ssd_bytes=int(sizes.sum()), ram_tier=tier,
                              peer_wait=0.01)
        for t in (RAM, SSD):
            sample = int(np.flatnonzero(st.placement.tier == t)[0])
            # a fill thread mid-write, frozen: its position claimed, nothing written yet
            assert st._claim(st.local_pos[[sample]]).all()
            ids = np.array([sample, sample, (sample + 1) % len(ds)])
            assert st.get_many(ids).equals(ds.get_many(ids)), (tier, t)
            assert st.get_views(ids).equals(ds.get_many(ids)), (tier, t)
        st.close()


def rank_warm(*args: str) -> None:
    """One rank of the warm-up test (run by run_ranks)."""
    argv = ["rank", *args]
    import numpy as np
    from mpi4py import MPI
    import forebay
    from forebay.store import tier_nbytes
    from forebay.torch import DataLoader, Pipeline, store_settings
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(argv[1])
    assert ds.small_records
    for mode in ("direct", "clairvoyant"):
        kw = {"ram_bytes": int(tier_nbytes(ds).sum())} if mode == "clairvoyant" else {}
        dl = DataLoader(ds, 8, comm=comm, seed=2, epochs=2,
                        store=store_settings(mode, warm_files=True, **kw),
                        pipeline=Pipeline(collate_fn=lambda b: b))
        for e in range(2):
            dl.set_epoch(e)
            for step, batch in enumerate(dl):
                assert batch.equals(ds.get_many(dl.plan.batches(comm.rank, e)[step]))
        store = dl.store
        dl.close()                      # joins the warm-up thread
        w = store.warmed or {"extents": 0, "cached": 0, "bytes": 0}
        handled = comm.allreduce(w["extents"] + w["cached"])
        every = len(ds.warm_extents(np.arange(len(ds))))
        say(f"rank {comm.rank} {mode} warm {handled} of {every} "
            f"bytes {w['bytes']} stats {store.stats()['warmed_bytes']}")


def test_ranks_split_the_page_cache_warm_up_and_batches_stay_exact(packed):
    """Small records in random order cost a file-system request each; the loader reads
    the files' extents sequentially ahead (each rank a share), in direct and
    clairvoyant mode: every extent once over the ranks, batches unchanged."""
    p = run_ranks(2, rank_warm, packed[0], timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if " warm " in line]
    assert len(lines) == 4
    for line in lines:
        handled, every = line.split(" warm ")[1].split(" bytes")[0].split(" of ")
        assert handled == every and int(every) > 0, line
        got, stats = line.split(" bytes ")[1].split(" stats ")
        assert got == stats, line


def test_warm_files_is_checked(packed):
    from forebay.errors import InvalidArgumentError
    from forebay.torch import DataLoader, Direct
    with pytest.raises(InvalidArgumentError, match="warm_files"):
        DataLoader(packed[0], 8, comm=forebay.world.LOCAL, store=Direct(warm_files="yes"))


def _locked_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmLck:")).split()[1])


@pytest.mark.skipif(not can_lock(64 << 20), reason="this process may not lock memory "
                    "(RLIMIT_MEMLOCK)")
def test_the_ram_tier_in_the_page_cache_locks_the_files_pages_and_copies_nothing(packed):
    """ram_tier="pages": the fill locks the samples' pages of the files (the process's
    locked memory grows by at least the records' bytes), the tier allocates no buffer
    of its own, batches are bit-exact and read from the files' maps (views included),
    and close unlocks everything."""

    from forebay.store import tier_nbytes
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 8, 2, seed=1)
    before = _locked_kib()
    st = ClairvoyantStore(ds, plan, None, ram_bytes=int(tier_nbytes(ds).sum()),
                          ram_tier="pages")
    assert st.ram_tier == "pages" and st.stats()["ram_tier"] == "pages"
    assert st.wait_filled(timeout=60)
    records = int(ds.record_nbytes.sum())
    assert (_locked_kib() - before) * 1024 >= records
    assert st.stats()["locked_bytes"] >= records
    assert st.stats()["buffer_bytes"] == 0       # no buffer of its own
    asked = 0
    for e in range(2):
        for ids in plan.batches(0, e):
            assert st.get_many(ids).equals(ds.get_many(ids))
            assert st.get_views(ids).equals(ds.get_many(ids))
            asked += 2 * len(ids)
    s = st.stats()
    assert s["fetches_by_source"] == {"local": asked, "peer": 0, "pfs": 0}, s
    assert s["pfs_reads"] == len(ds)
    st.close()
    assert _locked_kib() == before


@pytest.mark.skipif(not can_lock(64 << 20), reason="this process may not lock memory "
                    "(RLIMIT_MEMLOCK)")
def test_a_batch_ahead_of_the_page_cache_fill_pins_what_it_reads(packed):
    """A batch needing samples the fill has not reached reads them through the tier's
    locked maps and pins them after: they are the tier's from then on (locked, counted
    as one read from the files each), and the fill does not read them again."""
    from forebay.store import tier_nbytes
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 8, 1, seed=2)
    with ClairvoyantStore(ds, plan, None, ram_bytes=int(tier_nbytes(ds).sum()),
                          ram_tier="pages", fill=False) as st:
        ids = plan.batches(0, 0)[0]
        assert st.get_many(ids).equals(ds.get_many(ids))
        s = st.stats()
        assert s["locked_bytes"] == int(ds.record_nbytes[ids].sum())
        assert s["pfs_reads"] == len(ids) and s["fetches_by_source"]["local"] == len(ids)
        assert st.get_many(ids).equals(ds.get_many(ids))       # now from the tier
        st.fill_now()
        s = st.stats()
        assert s["filled"] == len(ds) and s["pfs_reads"] == len(ds), s


def _exchange_epochs(st, ds, plan, comm) -> None:
    """Once the tiers are full, every batch of the plan's epochs over the exchange
    (each rank's request known to all) is bit-exact."""
    assert st.wait_filled(timeout=60)
    comm.Barrier()
    for e in range(plan.epochs):
        every = [plan.batches(r, e) for r in range(comm.size)]
        for k, ids in enumerate(every[comm.rank]):
            assert st.get_step([b[k] for b in every]).equals(ds.get_many(ids))


def rank_exchange_pages(path: str) -> None:
    """Over the exchange (as across nodes) with the RAM tiers in the page cache: batches
    bit-exact, a peer's samples sent by their owner from its files' pages (no tier
    buffer anywhere); the files are read only by the fills and for samples no tier
    holds."""
    from mpi4py import MPI
    from forebay.store import tier_nbytes
    from conftest import say
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), comm.size, 8, 2, seed=4)
    # RAM for a third of the dataset per rank: most batches need the peer's samples
    st = ClairvoyantStore(ds, plan, comm, ram_bytes=int(tier_nbytes(ds).sum() // 3),
                          transport="exchange", ram_tier="pages")
    assert st.ram_tier == "pages" and st.stats()["buffer_bytes"] == 0
    _exchange_epochs(st, ds, plan, comm)
    s = st.stats()
    assert s["fetches_by_source"]["peer"] > 0 and s["exchange_sent"] > 0, s
    steps = sum(len(plan.batches(comm.rank, e)) for e in range(plan.epochs))
    assert not s["exchange_ended"] and s["exchange_rounds"] == steps, s
    assert s["pfs_reads"] == s["fill_total"] + s["fetches_by_source"]["pfs"], s
    st.close()
    # uneven RAM and SSD tiers: rank 0's first reads overflow to its SSD tier, rank 1
    # keeps extra RAM copies of some of them (read through the pages: once read from
    # the tier's buffer, which the pages tier does not have, ValueError)
    import tempfile
    from forebay.store._placement import SSD
    sizes = tier_nbytes(ds)
    with tempfile.TemporaryDirectory() as ssd:
        st = ClairvoyantStore(ds, plan, comm, transport="exchange", ram_tier="pages",
                              ram_bytes=int(sizes.sum() // 20 if comm.rank == 0 else
                                            sizes.sum()),
                              ssd_dir=ssd, ssd_bytes=int(sizes.sum()))
        p = st.placement
        if comm.rank == 1:
            assert (p.tier[p.extra_ram] == SSD).any()
        _exchange_epochs(st, ds, plan, comm)
        st.close()
    # room for the whole dataset on every rank: each holds its peer's samples as extra
    # copies, so once filled no record crosses the exchange (an owner sent every
    # sample it was asked for, the requester's own copies notwithstanding), and once
    # every rank said so in one round, batches need no collective at all
    st = ClairvoyantStore(ds, plan, comm, ram_bytes=int(sizes.sum()),
                          transport="exchange", ram_tier="pages")
    assert len(st.placement.extra_ram) > 0
    _exchange_epochs(st, ds, plan, comm)
    s = st.stats()
    assert s["exchange_sent"] == 0 and s["fetches_by_source"]["peer"] == 0, s
    assert s["exchange_ended"] and s["exchange_rounds"] == 1, s
    st.close()
    # room for all on rank 0 only: rank 1 still needs rank 0's records, every round
    st = ClairvoyantStore(ds, plan, comm, transport="exchange", ram_tier="pages",
                          ram_bytes=int(sizes.sum() if comm.rank == 0 else sizes.sum() // 3))
    _exchange_epochs(st, ds, plan, comm)
    s = st.stats()
    assert not s["exchange_ended"] and s["exchange_rounds"] == steps, s
    assert (s["exchange_sent"] > 0) == (comm.rank == 0), s
    assert (s["fetches_by_source"]["peer"] > 0) == (comm.rank == 1), s
    st.close()
    say(f"rank {comm.rank} exchange ok")


@pytest.mark.skipif(not can_lock(64 << 20), reason="this process may not lock memory "
                    "(RLIMIT_MEMLOCK)")
def test_the_page_cache_tier_over_the_exchange_sends_from_the_files_pages(packed):
    p = run_ranks(2, rank_exchange_pages, packed[0], timeout=120)
    assert p.returncode == 0 and p.stdout.count("exchange ok") == 2, \
        p.stdout[-2000:] + p.stderr[-3000:]


def test_ram_tier_choices(packed, tmp_path):
    """"auto" copies where the page cache cannot serve as the tier (an emulated file
    system's hook given); an unknown choice is refused; "pages" where it cannot be is
    an error naming why (two ranks: tests/mpi/test_agreement.py, the exchange below)."""
    ds = forebay.open_dataset(packed[0])
    plan = forebay.AccessPlan(len(ds), 1, 8, 1, seed=1)
    with ClairvoyantStore(ds, plan, None, ram_bytes=1 << 20,
                          on_pfs_read=lambda *a: None) as st:
        assert st.ram_tier == "copy"
    with pytest.raises(InvalidArgumentError, match="ram_tier must be"):
        ClairvoyantStore(ds, plan, None, ram_bytes=1 << 20, ram_tier="page")
    if can_lock(64 << 20):
        with ClairvoyantStore(ds, plan, None, ram_bytes=1 << 20) as st:
            assert st.ram_tier == "pages"      # a local file system, locking allowed
