"""The data plane under real ``torchrun`` (torch.distributed's gloo, no MPI): every
rank sees its own samples, the batches are those of mpiexec, a dead rank ends the job,
and no shared segment outlives it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay import AccessPlan
from forebay.comm import SHM_DIR
from forebay.dataset import can_lock
from conftest import assert_ranks_ok, run_ranks, run_torchrun, skip_without

skip_without("torch")
pytestmark = pytest.mark.mpi

N, BATCH, EPOCHS, SEED = 96, 4, 2, 5


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    path = tmp_path_factory.mktemp("tr") / "lab.fb"
    forebay.write_dataset(path, ({"label": np.int64(i), "v": np.full(i % 7, i, np.float32)}
                                 for i in range(N)), shard_bytes=2048)
    return path


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(".forebay-seg-*")} if SHM_DIR.is_dir() else set()


def _ids_labels(b):
    """(ids, labels) of a batch, or of views (``views=True``)."""
    labels = b.stacked("label") if isinstance(b, forebay.dataset.SampleViews) else b["label"]
    return b.ids.copy(), labels.copy()


def rank_epochs(path: str, out: str, mode: str, transport: str, prefetch: str,
                views: str = "0") -> None:
    """Two epochs of the README's loader (``views``: "1" lends the samples); this
    rank's batches (sample ids, checked against the labels) and the store's stats go
    to ``out/rank-R.json``."""
    from forebay.store import tier_nbytes
    from forebay.torch import DataLoader, Pipeline, store_settings

    # clairvoyant: RAM for 60% of the dataset per rank, so each rank needs its peer's
    ram = int(tier_nbytes(forebay.open_dataset(path)).sum() * 0.6)
    dl = DataLoader(path, BATCH, seed=SEED, epochs=EPOCHS,
                    store=store_settings(mode, transport=transport, ram_bytes=ram),
                    pipeline=Pipeline(prefetch=int(prefetch), views=views == "1",
                                      collate_fn=_ids_labels))
    batches = []
    for epoch in range(EPOCHS):
        dl.set_epoch(epoch)
        for ids, labels in dl:
            assert (ids == labels).all()          # the sample is the one asked for
            batches.append(ids.tolist())
    if mode == "clairvoyant":
        assert dl.store.wait_filled(timeout=120)
        for epoch_ids in dl.plan.batches(dl.rank, 0):   # all cached now: peers serve
            dl.store.get_many(epoch_ids)
    st = dl.store.stats()
    Path(out, f"rank-{dl.rank}.json").write_text(json.dumps(
        {"batches": batches, "world": dl.world, "comm": type(dl.comm).__name__,
         "transport": st.get("transport"), "fetches": st["fetches_by_source"]}))
    dl.close()


def _read(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


#: what preload's "auto" picks on one node: the chunks held in the files' pages where
#: this process may lock them (RLIMIT_MEMLOCK), else a shared segment
PRELOAD_AUTO = "pages" if can_lock(2 << 20) else "shm"
#: (mode, transport, the transport stats() must report under torchrun, views)
CASES = [("preload", "auto", PRELOAD_AUTO, 0), ("preload", "shm", "shm", 0),
         ("preload", "exchange", "exchange", 0),
         ("clairvoyant", "auto", "shm", 0), ("clairvoyant", "exchange", "exchange", 0),
         ("direct", "auto", None, 0),
         ("preload", "auto", PRELOAD_AUTO, 1), ("preload", "exchange", "exchange", 1),
         ("clairvoyant", "auto", "shm", 1), ("direct", "auto", None, 1)]


def rank_cases(path: str, out: str) -> None:
    """Every case of CASES in turn, in one job (one launch costs more than a case);
    case k's files go to ``out/k``."""
    for k, (mode, transport, _, views) in enumerate(CASES):
        Path(out, str(k)).mkdir(exist_ok=True)
        rank_epochs(path, str(Path(out, str(k))), mode, transport, "2", str(views))


@pytest.fixture(scope="module")
def launched(labelled, tmp_path_factory):
    """Every case under real torchrun, then under real mpiexec: the output directory
    of each launcher, and the node's shared segments before and after both jobs."""
    out = tmp_path_factory.mktemp("cases")
    before = _segments()
    for launcher, run in (("torchrun", run_torchrun), ("mpiexec", run_ranks)):
        (out / launcher).mkdir()
        assert_ranks_ok(run(2, rank_cases, labelled, out / launcher), 2)
    return out, before, _segments()


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=["-".join(map(str, c)) for c in CASES])
def test_torchrun_ranks_see_disjoint_samples_and_mpiexec_batches(launched, case):
    mode, _, want, _ = CASES[case]
    out, before, after = launched
    tr, mp = _read(out / "torchrun" / str(case), 2), _read(out / "mpiexec" / str(case), 2)
    assert {r["comm"] for r in tr} == {"TorchComm"}
    assert {r["comm"] for r in mp} == {"Intracomm"}
    assert {r["transport"] for r in tr} == {want}
    plan = AccessPlan(N, 2, BATCH, EPOCHS, SEED)
    for r in range(2):
        want_batches = [b.tolist() for e in range(EPOCHS) for b in plan.batches(r, e)]
        assert tr[r]["batches"] == want_batches == mp[r]["batches"]
    steps = len(tr[0]["batches"]) // EPOCHS
    for e in range(EPOCHS):       # each epoch: every sample once, over both ranks
        seen = sum((b for r in tr for b in r["batches"][e * steps:(e + 1) * steps]), [])
        assert sorted(seen) == list(range(N))
    # preload holds every sample before the first batch, so half come from the peer; in
    # clairvoyant mode over shared memory the mix depends on how far the fill got when
    # the reader asked (no peer fetch at all once, under a loaded fresh-clone run)
    if want == "exchange" or (want in ("shm", "pages") and mode == "preload"):
        assert all(r["fetches"]["peer"] > 0 for r in tr), tr
    assert after <= before          # no shared segment outlives the jobs


def rank_dies_mid_epoch(path: str) -> None:
    """Rank 1 dies at step 3 of an epoch whose batches are exchanged collectively."""
    from forebay.torch import DataLoader, Pipeline, Preload

    dl = DataLoader(path, BATCH, seed=SEED, store=Preload(transport="exchange"),
                    pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    for step, _ in enumerate(dl):
        if step == 3 and dl.rank == 1:
            os._exit(3)
    dl.close()


def test_a_rank_that_dies_ends_the_torchrun_job(labelled):
    before = _segments()
    p = run_torchrun(2, rank_dies_mid_epoch, labelled, timeout=120)
    assert p.returncode != 0
    assert "rank-main: rank 1 ok" not in p.stdout
    assert _segments() <= before


def rank_with_user_collectives(path: str) -> None:
    """The program initialised torch.distributed itself and all-reduces every step
    while forebay's prefetch thread exchanges batches on its own group."""
    import torch
    import torch.distributed as dist

    from forebay.torch import DataLoader, Pipeline, Preload

    dist.init_process_group("gloo")
    dl = DataLoader(path, BATCH, seed=SEED, store=Preload(transport="exchange"),
                    pipeline=Pipeline(prefetch=4, collate_fn=lambda b: b.ids.copy()))
    assert dl.comm.group is not dist.group.WORLD
    plan = dl.plan
    for step, ids in enumerate(dl):
        t = torch.tensor([int(ids.sum())])
        dist.all_reduce(t)
        assert int(t) == sum(int(plan.batches(r, 0)[step].sum()) for r in range(dl.world))
    dl.close()
    dist.destroy_process_group()


def test_the_programs_own_collectives_do_not_interleave_with_the_exchange(labelled):
    assert_ranks_ok(run_torchrun(3, rank_with_user_collectives, labelled), 3)


def rank_two_loaders_with_mpi4py_loaded(path: str) -> None:
    """mpi4py imported by the program (or a library) under torchrun: MPI runs as a
    singleton, and every loader still meets the other ranks over torch.distributed."""
    from mpi4py import MPI

    from forebay.torch import DataLoader, Pipeline, Preload

    assert MPI.COMM_WORLD.Get_size() == 1
    for _ in range(2):                   # a training and a validation loader
        dl = DataLoader(path, BATCH, seed=SEED, store=Preload(transport="exchange"),
                        pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
        assert dl.world == 2 and type(dl.comm).__name__ == "TorchComm"
        dl.close()


def test_loaders_meet_over_torch_under_torchrun_with_mpi4py_loaded(labelled):
    assert_ranks_ok(run_torchrun(2, rank_two_loaders_with_mpi4py_loaded, labelled), 2)


def test_srun_without_mpi_meets_through_slurms_variables(labelled, tmp_path):
    """srun with no MPI plug-in: rank, size and the rendezvous (first node of the
    step, a port from the job id) come from Slurm's variables alone.  Plain processes
    with the variables srun sets stand in for srun here; real srun across emulated
    nodes: tests/test_cluster.py."""
    import socket
    import subprocess
    import sys

    from conftest import rank_command
    rng = np.random.default_rng()
    for port in rng.permutation(np.arange(20000, 40000))[:200].tolist():
        with socket.socket() as s:      # a free port in the range srun jobs derive
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
    job = (port - 20000) * pow(131, -1, 20000) % 20000
    cmd, env = rank_command(rank_epochs, (labelled, tmp_path, "preload", "auto", 2))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(SLURM_NTASKS="2", SLURM_STEP_NODELIST="127.0.0.1", SLURM_JOB_ID=str(job),
               SLURM_STEP_ID="0")
    procs = [subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
             for r in range(2)]
    outs = [q.communicate(timeout=120) for q in procs]
    assert [q.returncode for q in procs] == [0, 0], outs
    got = _read(tmp_path, 2)
    assert {r["comm"] for r in got} == {"TorchComm"}
    assert {r["transport"] for r in got} == {PRELOAD_AUTO}
    plan = AccessPlan(N, 2, BATCH, EPOCHS, SEED)
    for r in range(2):
        assert got[r]["batches"] == [b.tolist() for e in range(EPOCHS)
                                     for b in plan.batches(r, e)]


def rank_resume(path: str, out: str, state: str) -> None:
    """Epoch 0 from its start (``state`` "-": the state after 3 steps goes to
    ``out/state.json``) or resumed from ``state``; batches to ``out/rank-R.json``."""
    from forebay.torch import DataLoader, Pipeline

    dl = DataLoader(path, BATCH, seed=SEED, epochs=EPOCHS,
                    pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    if state != "-":
        dl.load_state_dict(json.loads(Path(state).read_text()))
    batches = []
    for ids in dl:
        batches.append(ids.tolist())
        if state == "-" and len(batches) == 3 and dl.rank == 0:
            Path(out, "state.json").write_text(json.dumps(dl.state_dict()))
    Path(out, f"rank-{dl.rank}.json").write_text(json.dumps({"batches": batches}))
    dl.close()


def test_a_run_saved_under_mpiexec_resumes_under_torchrun(labelled, tmp_path):
    first, second = tmp_path / "mpiexec", tmp_path / "torchrun"
    first.mkdir()
    second.mkdir()
    assert_ranks_ok(run_ranks(2, rank_resume, labelled, first, "-"), 2)
    assert_ranks_ok(run_torchrun(2, rank_resume, labelled, second, first / "state.json"), 2)
    for r in range(2):
        whole = _read(first, 2)[r]["batches"]
        assert len(whole) == N // (2 * BATCH)
        assert _read(second, 2)[r]["batches"] == whole[3:]
