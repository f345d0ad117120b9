"""Tracing a multi-rank run: one DFTracer file per rank whose fetch counts equal the
loader's own stats, and an analysis over all of them."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from conftest import run_ranks, skip_without
from forebay.trace._analyze import analyze

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi

def rank_script(*args: str) -> None:
    """One rank of the script test (run by run_ranks)."""
    argv = ["rank", *args]
    import json
    import time
    from mpi4py import MPI
    import forebay.trace as trace
    from forebay.torch import DataLoader, store_settings
    from conftest import say
    comm = MPI.COMM_WORLD
    path, mode, transport = argv[1], argv[2], argv[3]
    kw = {"ram_bytes": 6000} if mode == "clairvoyant" else {}
    dl = DataLoader(path, 8, comm=comm, epochs=2, progress=False,
                    store=store_settings(mode, transport=transport, **kw))
    for e in range(2):
        dl.set_epoch(e)
        for _ in dl:
            with trace.region("compute"):
                time.sleep(0.0005)
    stats = dl.stats()
    dl.close()
    trace.disable()
    comm.Barrier()
    say("STATS %d %s" % (comm.rank, json.dumps(stats["fetches_by_source"])))
    say("PFS %d %d" % (comm.rank, stats["pfs_reads"]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import forebay

    path = tmp_path_factory.mktemp("tr") / "d.fb"
    forebay.write_dataset(path, ({"v": np.full(i % 9 + 1, i, np.float32), "y": np.int64(i)}
                                 for i in range(203)), shard_bytes=2048)
    return path


@pytest.mark.parametrize("mode, transport", [("preload", "shm"), ("preload", "rma"),
                                             ("clairvoyant", "auto")])
def test_each_rank_writes_a_trace_matching_its_stats(tmp_path, data, mode, transport):
    d = tmp_path / "trace"
    p = run_ranks(2, rank_script, data, mode, transport, env={"FOREBAY_TRACE": str(d)})
    assert p.returncode == 0, p.stderr[-3000:]
    stats, pfs = {}, {}
    for line in p.stdout.splitlines():
        if line.startswith("STATS "):
            _, r, js = line.split(" ", 2)
            stats[int(r)] = {k: v for k, v in json.loads(js).items() if v}
        elif line.startswith("PFS "):
            _, r, n = line.split()
            pfs[int(r)] = int(n)
    files = sorted(d.glob("*.pfw.gz"))
    assert len(files) == 2
    for f in files:
        ev = [json.loads(x) for x in gzip.open(f, "rt")]  # every line is JSON
        rank = next(e["args"]["rank"] for e in ev if e["name"] == "start")
        assert f.name.startswith(f"forebay-{rank}-")
        got: dict[str, int] = {}
        for e in ev:
            if (e["cat"], e["name"]) == ("data", "item"):
                got[e["args"]["source"]] = got.get(e["args"]["source"], 0) + 1
        assert got == stats[rank]
        reads = sum((e["cat"], e["name"]) == ("reader", "read") for e in ev)
        if mode == "clairvoyant":
            assert reads == pfs[rank]  # one file event per record read
        else:
            assert reads >= 1  # the preload's large reads
        if transport == "rma":
            assert any((e["cat"], e["name"]) == ("memstore", "get") for e in ev)
    a = analyze(d)
    assert a["ranks"] == 2 and not a["skipped"]
    total = {}
    for s in stats.values():
        for k, v in s.items():
            total[k] = total.get(k, 0) + v
    assert {k: v["count"] for k, v in a["fetch_sources"].items()} == total
    assert a["pfs_reads_per_sample"] == pytest.approx(sum(pfs.values()) / 203)
    if mode == "preload":  # the dataset's files read once over both ranks, in large reads
        assert a["pfs_reads_per_sample"] == 1.0
        assert a["pfs_read_amplification"] == pytest.approx(1.0, abs=0.01)
        assert a["pfs_reads"] < 203
    else:  # tiers smaller than the dataset: the rest streams from the files
        assert 1.0 < a["pfs_reads_per_sample"] <= 3.0
