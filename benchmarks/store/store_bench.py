"""forebay's stores against the original DDStore and MPI's own floor (issue O).

Run under ``mpiexec -n 2`` (every rank reads rows the other rank holds, at the same
time, as training ranks do).  Contenders, interleaved round by round:

* ``mpi floor``: raw mpi4py on a window made by ``Win_allocate``, locked once
  (``Lock_all``): one ``MPI_Get`` + ``Flush`` per row: what any store over RMA costs
  at least from Python;
* ``DDStore``: ORNL/DDStore's ``PyDDStore.get`` (``MPI_Win_lock`` / ``MPI_Get`` /
  ``MPI_Win_unlock`` per call); a batch is one ``get`` per row, as its
  ``DistDataset`` does;
* ``forebay array rma`` / ``array shm``: ``DistributedStore.from_arrays`` (the same
  rows, no ingest): ``get(name, start)`` for one row, ``get_rows(name, ids)`` for a
  batch (one ``MPI_Get`` per owner, or one gather over the node's shared memory);
* ``forebay dataset rma`` / ``dataset shm`` / ``dataset pages``: the packed-dataset
  store (``DistributedStore``) over the same rows ingested as one field, ``get_many``;
  ``dataset shm views``: the same store's ``get_views`` (the rows lent, not copied);
  ``dataset rma [i]`` / ``shm [i]`` / ``pages [i]``: the store's one-sample
  ``store[i]`` (a dict of arrays over one copy of the record, no batch).

Reported: per-call latency p50 (median over rounds of each round's median) and the
best round, for one remote row, one local row and a batch of 128 random rows; set-up
seconds and the RSS each store adds.  The machine is shared: read ratios, not times.

DDStore is built outside this repository (never committed), from its public
repository, against the venv's MPICH and mpi4py::

    git clone https://github.com/ORNL/DDStore /tmp/ddstore && cd /tmp/ddstore
    pip install --target /tmp/ddstore/cy "cython<3.1"
    V=/path/to/forebay/.venv   # its MPICH ships libfabric.so.1; headers: libfabric-dev
    PYTHONPATH=cy $V/bin/python -m cython -3 --cplus -I $(mpi4py include) \\
        src/pyddstore.pyx -o pyddstore.cpp
    mpicxx -O2 -std=c++11 -shared -fPIC -I include -I <python include> \\
        -I <numpy include> -I <mpi4py include> -I <libfabric include> \\
        pyddstore.cpp src/ddstore.cxx src/common.cxx -L $V/lib/mpich \\
        -l:libfabric.so.1 -Wl,-rpath,$V/lib/mpich -o pyddstore$(python3-config --extension-suffix)

    PYTHONPATH=/tmp/ddstore mpiexec -n 2 python benchmarks/store/store_bench.py \\
        --work /tmp/storebench --rounds 7

Across emulated nodes (root; one rank per node, the reads cross a node boundary; the
node-local transports are left out)::

    PYTHONPATH=/tmp/ddstore python scripts/cluster.py --nodes 2 --ppn 1 mpiexec -- \\
        .venv/bin/python benchmarks/store/store_bench.py --work /tmp/sbx --rounds 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine, rss_bytes  # noqa: E402


def _lat(fn, args_list) -> np.ndarray:
    clock = time.perf_counter
    out = np.empty(len(args_list))
    for k, a in enumerate(args_list):
        t0 = clock()
        fn(a)
        out[k] = clock() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/storebench"))
    ap.add_argument("--rows", type=int, default=20000, help="rows per rank")
    ap.add_argument("--row-bytes", type=int, default=500,
                    help="bytes per row (an Ising sample: 125 float32)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per contender per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()

    from mpi4py import MPI

    import forebay
    from forebay.store import DistributedStore, node_size

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    peer = (rank + 1) % world
    n, rb = args.rows, args.row_bytes
    rng = np.random.default_rng(rank)
    local = rng.integers(0, 255, size=(n, rb), dtype=np.uint8)
    setup: dict[str, list[float]] = {}
    mem: dict[str, int] = {}

    def timed_setup(name, make):
        comm.Barrier()
        r0 = rss_bytes()
        t0 = time.perf_counter()
        obj = make()
        comm.Barrier()
        setup.setdefault(name, []).append(time.perf_counter() - t0)
        mem[name] = rss_bytes() - r0
        return obj

    # the packed dataset of the same rows (all ranks' rows, one field), for get_many
    ds_path = args.work / f"rows-{n}x{rb}-w{world}"
    if rank == 0 and not (ds_path / "manifest.json").exists():
        every = [np.random.default_rng(r).integers(0, 255, size=(n, rb), dtype=np.uint8)
                 for r in range(world)]
        forebay.write_dataset(ds_path, ({"row": every[r][i]} for r in range(world)
                                        for i in range(n)), overwrite=True)
    comm.Barrier()
    ds = forebay.open_dataset(ds_path)

    try:
        import pyddstore
    except ImportError:
        pyddstore = None
        if rank == 0:
            print("# pyddstore not importable: DDStore rows skipped (see the docstring)")

    # contenders ------------------------------------------------------------------------
    win = MPI.Win.Allocate(n * rb, 1, comm=comm)
    np.frombuffer(win.tomemory(), dtype=np.uint8)[:] = local.reshape(-1)
    win.Lock_all(MPI.MODE_NOCHECK)
    win.Sync()
    comm.Barrier()
    one = np.empty(rb, dtype=np.uint8)

    def floor_get(i):
        win.Get([one, rb, MPI.BYTE], peer, [i * rb, rb, MPI.BYTE])
        win.Flush(peer)

    stores = {}
    if pyddstore is not None:
        dd = timed_setup("DDStore", lambda: _dd(pyddstore, comm, local))
        stores["DDStore"] = dd
    arr_rma = timed_setup("forebay array rma", lambda: DistributedStore.from_arrays(
        {"row": local}, comm, transport="rma"))
    ds_rma = timed_setup("forebay dataset rma", lambda: DistributedStore(
        ds, comm, transport="rma", progress=False))
    # the node-local transports where every rank is on one node; across nodes (under
    # scripts/cluster.py) the rows are read over RMA only
    per_node = node_size(comm)          # collective: once, on every rank
    one_node = per_node == world
    if one_node:
        arr_shm = timed_setup("forebay array shm", lambda: DistributedStore.from_arrays(
            {"row": local}, comm, transport="shm"))
        ds_shm = timed_setup("forebay dataset shm", lambda: DistributedStore(
            ds, comm, transport="shm", progress=False))
        ds_pages = timed_setup("forebay dataset pages", lambda: DistributedStore(
            ds, comm, transport="pages", progress=False))
    elif rank == 0:
        print(f"# ranks on {world // per_node} nodes: the node-local transports "
              f"(shm, pages) are left out")
    base = peer * n        # the peer's first global row
    mine0 = rank * n
    ddbuf = np.empty((1, rb), dtype=np.uint8)
    ddbatch = np.empty((args.batch, rb), dtype=np.uint8)

    def dd_get(i):
        stores["DDStore"].get("row", ddbuf, i)

    def dd_batch(ids):
        for k, i in enumerate(ids.tolist()):
            stores["DDStore"].get("row", ddbatch[k:k + 1], i)

    single = {
        "mpi floor": (floor_get, 0),
        "forebay array rma": (lambda i: arr_rma.get("row", i), base),
        "forebay array shm": (lambda i: arr_shm.get("row", i), base),
        "forebay dataset rma": (lambda i: ds_rma.get_many(np.array([i])), base),
        "forebay dataset shm": (lambda i: ds_shm.get_many(np.array([i])), base),
        "forebay dataset pages": (lambda i: ds_pages.get_many(np.array([i])), base),
        "forebay dataset shm views": (lambda i: ds_shm.get_views(np.array([i])), base),
        "forebay dataset rma [i]": (lambda i: ds_rma[i], base),
        "forebay dataset shm [i]": (lambda i: ds_shm[i], base),
        "forebay dataset pages [i]": (lambda i: ds_pages[i], base),
    }
    if pyddstore is not None:
        single["DDStore"] = (dd_get, base)
    local_one = {
        "forebay array rma": (lambda i: arr_rma.get("row", i), mine0),
        "forebay array shm": (lambda i: arr_shm.get("row", i), mine0),
        "forebay dataset rma": (lambda i: ds_rma.get_many(np.array([i])), mine0),
        "forebay dataset shm": (lambda i: ds_shm.get_many(np.array([i])), mine0),
        "forebay dataset pages": (lambda i: ds_pages.get_many(np.array([i])), mine0),
        "forebay dataset shm views": (lambda i: ds_shm.get_views(np.array([i])), mine0),
        "forebay dataset rma [i]": (lambda i: ds_rma[i], mine0),
        "forebay dataset shm [i]": (lambda i: ds_shm[i], mine0),
        "forebay dataset pages [i]": (lambda i: ds_pages[i], mine0),
    }
    if pyddstore is not None:
        local_one["DDStore"] = (dd_get, mine0)
    batch = {
        "forebay array rma": lambda ids: arr_rma.get_rows("row", ids),
        "forebay array shm": lambda ids: arr_shm.get_rows("row", ids),
        "forebay dataset rma": lambda ids: ds_rma.get_many(ids),
        "forebay dataset shm": lambda ids: ds_shm.get_many(ids),
        "forebay dataset pages": lambda ids: ds_pages.get_many(ids),
        "forebay dataset shm views": lambda ids: ds_shm.get_views(ids),
    }
    if pyddstore is not None:
        batch["DDStore"] = dd_batch
    if not one_node:
        for table in (single, local_one, batch):
            for name in [k for k in table if " shm" in k or " pages" in k]:
                del table[name]
    # check every contender returns the right bytes before timing anything
    want = np.random.default_rng(peer).integers(0, 255, size=(n, rb), dtype=np.uint8)
    floor_get(7)
    assert np.array_equal(one, want[7])
    if pyddstore is not None:
        dd_get(base + 7)
        assert np.array_equal(ddbuf[0], want[7])
    assert np.array_equal(arr_rma.get("row", base + 7)[0], want[7])
    assert np.array_equal(ds_rma.get_many([base + 7])["row"][0], want[7])
    assert np.array_equal(ds_rma[base + 7]["row"], want[7])
    if one_node:
        assert np.array_equal(arr_shm.get("row", base + 7)[0], want[7])
        assert np.array_equal(ds_shm.get_views([base + 7])["row"][0], want[7])
        assert np.array_equal(ds_pages.get_many([base + 7])["row"][0], want[7])
        for st in (ds_shm, ds_pages):
            assert np.array_equal(st[base + 7]["row"], want[7])

    results: dict[str, dict[str, list[float]]] = {"remote": {}, "local": {}, "batch": {}}
    for rnd in range(args.rounds):
        r = np.random.default_rng(1000 * rnd + rank)
        rows = r.integers(0, n, size=args.calls)
        order = list(single)
        r.shuffle(order)        # rotating order: no contender always first
        for name in order:
            fn, off = single[name]
            comm.Barrier()
            lat = _lat(fn, (rows + off).tolist())
            results["remote"].setdefault(name, []).append(float(np.median(lat)))
        for name in list(local_one):
            fn, off = local_one[name]
            comm.Barrier()
            lat = _lat(fn, (rows + off).tolist())
            results["local"].setdefault(name, []).append(float(np.median(lat)))
        batches = [r.integers(0, n * world, size=args.batch) for _ in range(args.calls // 20)]
        order = list(batch)
        r.shuffle(order)
        for name in order:
            comm.Barrier()
            lat = _lat(batch[name], batches)
            results["batch"].setdefault(name, []).append(float(np.median(lat)))
    comm.Barrier()
    if rank == 0:
        print(f"# store_bench: {world} ranks, {n} rows x {rb} B per rank, {args.calls} "
              f"calls x {args.rounds} rounds; {machine()}; {time.strftime('%Y-%m-%d')}")
        for what, res in results.items():
            unit = "per batch of %d" % args.batch if what == "batch" else "per call"
            print(f"\n## {what} ({unit}): p50 us (median over rounds), best round")
            ref = res.get("DDStore")
            fl = res.get("mpi floor")
            for name, v in res.items():
                med, best = float(np.median(v)) * 1e6, float(np.min(v)) * 1e6
                extra = ""
                if ref:
                    extra += f"  {med / (np.median(ref) * 1e6):6.2f}x DDStore"
                if fl:
                    extra += f"  {med / (np.median(fl) * 1e6):6.2f}x floor"
                print(f"{name:26s} {med:9.1f} {best:9.1f}{extra}")
        print("\n## set-up (s) and RSS added on rank 0 (MiB)")
        for name, v in setup.items():
            print(f"{name:26s} {np.median(v):8.3f} {mem[name] / 2**20:9.1f}")
    for s in (arr_rma, ds_rma, *((arr_shm, ds_shm, ds_pages) if one_node else ())):
        s.close()
    if pyddstore is not None:
        stores["DDStore"].free()
    win.Unlock_all()
    win.Free()


def _dd(pyddstore, comm, local):
    s = pyddstore.PyDDStore(comm)
    s.add("row", local)
    return s


if __name__ == "__main__":
    main()
