"""forebay.torch.DataLoader under mpiexec: same global batches at any world size, resume."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from forebay import AccessPlan
from conftest import (assert_ranks_ok, run_ranks, say, say_global_batches, SeenBatches,
                      skip_without)

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi

GLOBAL_BATCH = 16


def rank_global_batches(path: str, width: str, resume: str) -> None:
    """One rank: iterate 2 epochs (or resume at a state), rank 0 prints the global batches."""
    from mpi4py import MPI

    from forebay.torch import DataLoader, Pipeline, Preload

    comm = MPI.COMM_WORLD
    bs = GLOBAL_BATCH // comm.size
    dl = DataLoader(path, bs, comm=comm, seed=5, epochs=2,
                    store=Preload(width=int(width) or None),
                    pipeline=Pipeline(collate_fn=lambda b: (b.ids.copy(), b["label"].copy())))
    steps = comm.allgather(len(dl))
    assert len(set(steps)) == 1, steps
    if resume != "-":
        dl.load_state_dict(json.loads(resume))
    out, state = [], None
    for epoch in range(dl.epoch, 2):
        dl.set_epoch(epoch)
        for k, (ids, labels) in enumerate(dl):
            assert (ids == labels).all()  # the sample is the one asked for
            out.append([epoch] + ids.tolist())
            if resume == "-" and epoch == 0 and k == 2:
                state = dl.state_dict()
    every = comm.gather(out, root=0)
    if comm.rank == 0:
        say_global_batches(every, state)
    dl.close()


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    import forebay

    path = tmp_path_factory.mktemp("lab") / "lab.fb"
    forebay.write_dataset(path, ({"label": np.int64(i), "v": np.full(i % 7, i, np.float32)}
                                 for i in range(101)), shard_bytes=4096)
    return path


def _run(ranks, path, width=0, resume="-"):
    p = run_ranks(ranks, rank_global_batches, path, width, resume)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    return json.loads(lines["GLOBAL"]), json.loads(lines["STATE"]) if "STATE" in lines else None


@pytest.mark.parametrize("ranks, width", [(2, 0), (2, 1), (4, 0), (4, 2)])
def test_global_batches_match_the_plan_at_any_world_size(labelled, ranks, width):
    got, _ = _run(ranks, labelled, width)
    plan = AccessPlan(101, 1, GLOBAL_BATCH, 2, seed=5)
    want = [[e] + g.tolist() for e in range(2) for g in plan.global_batches(e)]
    assert got == want
    for e in range(2):  # every sample each epoch; padding completes the last batch
        ids = [i for row in got if row[0] == e for i in row[1:]]
        assert set(ids) == set(range(101)) and len(ids) == 101 + plan.padding


def test_resume_on_a_different_world_size(labelled):
    full, state = _run(2, labelled)
    assert state == {**state, "epoch": 0, "step": 3, "global_batch": GLOBAL_BATCH}
    rest, _ = _run(4, labelled, 2, json.dumps(state))
    assert rest == full[3:]


def rank_numpy_batches(path: str) -> None:
    """Every store mode with a collate_fn that makes no tensors: the rank never loads
    torch (about 2 seconds of import a process, for nothing)."""
    import sys

    from forebay.torch import Auto, Clairvoyant, DataLoader, Direct, Pipeline, Preload

    for store in (Preload(), Clairvoyant(ram_bytes=1 << 20), Direct(), Auto()):
        dl = DataLoader(path, 8, seed=1, epochs=1, store=store,
                        pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
        assert sum(len(ids) for ids in dl) == len(dl) * 8
        dl.close()
    assert "torch" not in sys.modules, "a loader of numpy batches imported torch"


def test_a_loader_of_numpy_batches_never_imports_torch(labelled):
    assert_ranks_ok(run_ranks(2, rank_numpy_batches, labelled), 2)


def rank_fetch_ahead(path: str) -> None:
    """For a preload and a clairvoyant store: epoch 0, then (without asking) epoch 1's
    first batch is fetched while the loop is between epochs, and epoch 1 is the plan's;
    the program then ends without closing the second loader and without its epoch 2,
    which its prefetch thread has gone on into."""
    from mpi4py import MPI

    from forebay.torch import Clairvoyant, DataLoader, Pipeline, Preload

    comm = MPI.COMM_WORLD
    plan = AccessPlan(101, comm.size, 8, 3, seed=3)
    want = [[tuple(b.tolist()) for b in plan.batches(comm.rank, e)] for e in range(3)]
    for kind, store in (("preload", Preload()), ("clairvoyant", Clairvoyant(ram_bytes=1 << 20))):
        ids = SeenBatches()
        dl = DataLoader(path, 8, comm=comm, seed=3, epochs=3, store=store,
                        pipeline=Pipeline(prefetch=2, collate_fn=ids))
        assert [tuple(b.tolist()) for b in dl] == want[0]
        assert ids.wait_for(want[1][0]), f"{kind}: epoch 1 was not fetched between epochs"
        dl.set_epoch(1)
        assert [tuple(b.tolist()) for b in dl] == want[1]
        if kind == "preload":
            dl.close()
        comm.Barrier()
        say(f"AHEAD {kind} {comm.rank} ok")


def test_mpi_stores_fetch_the_next_epoch_between_epochs(labelled):
    """Stores the ranks share (over MPI windows or shared memory) go on into the next
    epoch while the loop is between epochs, as a rank's own store does; a job that ends
    without closing its loader, the prefetch thread inside an epoch the loop never asked
    for, still ends cleanly (the thread is stopped before MPI finalizes)."""
    p = run_ranks(2, rank_fetch_ahead, labelled)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(re.findall(r"AHEAD \w+ \d ok", p.stdout)) == [
        "AHEAD clairvoyant 0 ok", "AHEAD clairvoyant 1 ok", "AHEAD preload 0 ok",
        "AHEAD preload 1 ok"]
