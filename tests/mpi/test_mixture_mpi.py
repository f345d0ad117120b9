"""A Mixture under mpiexec and torchrun: every store gives the plan's global batches at
any world size, bit-exact, and a run resumes at another world size."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_ranks_ok, run_ranks, run_torchrun, say_global_batches, skip_without

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi

GLOBAL_BATCH = 16
SIZES = (61, 9, 30)
WEIGHTS = (0.5, 0.3, 0.2)


def mixture(root: str, policy: str):
    from forebay import Mixture

    return Mixture({f"{root}/s{i}.fb": w for i, w in enumerate(WEIGHTS)}, policy=policy)


def rank_mixed_batches(root: str, configs: str, resume: str) -> None:
    """One rank: 2 epochs of the mixture under each of ``configs`` ("policy:store,...")
    in turn (or the rest from a state); rank 0 prints the global batches as (source,
    sample) labels, tagged "-policy:store"."""
    import os

    from forebay.torch import Clairvoyant, DataLoader, Pipeline

    world = int(os.environ.get("PMI_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    for config in configs.split(","):
        policy, store = config.split(":")
        # "tiers": RAM tiers smaller than a rank's share, the rest read from the files
        spec = Clairvoyant(ram_bytes=600) if store == "tiers" else store
        dl = DataLoader(mixture(root, policy), GLOBAL_BATCH // world, seed=9, epochs=2,
                        store=spec, verify_on_read=True,
                        pipeline=Pipeline(collate_fn=lambda b: (b.ids.copy(),
                                                                b["label"].copy())))
        if resume != "-":
            dl.load_state_dict(json.loads(resume))
        out, state = [], None
        for epoch in range(dl.epoch, 2):
            dl.set_epoch(epoch)
            for k, (_ids, labels) in enumerate(dl):
                out.append([epoch] + labels.tolist())
                if resume == "-" and epoch == 0 and k == 2:
                    state = dl.state_dict()
        assert dl.world == world
        every = dl.comm.allgather(out)
        if dl.rank == 0:
            say_global_batches(every, state, f"-{config}")
        dl.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    import forebay

    d = tmp_path_factory.mktemp("mixmpi")
    for i, n in enumerate(SIZES):
        forebay.write_dataset(d / f"s{i}.fb", ({"label": np.int64(1000 * i + j),
                                                "v": np.full(j % 4, j, np.float32)}
                                               for j in range(n)), shard_bytes=1024)
    return str(d)


def expected(root: str, policy: str) -> list:
    plan = mixture(root, policy).plan(1, GLOBAL_BATCH, 2, seed=9)
    starts = np.cumsum((0,) + SIZES[:-1])
    out = []
    for e in range(2):
        for g in plan.global_batches(e):
            src = np.searchsorted(starts, g, side="right") - 1
            out.append([e] + (1000 * src + g - starts[src]).tolist())
    return out


def _run(launch, ranks, root, configs, resume="-"):
    p = launch(ranks, rank_mixed_batches, root, ",".join(configs), resume)
    assert_ranks_ok(p, ranks)
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    return {c: (json.loads(lines[f"GLOBAL-{c}"]),
                json.loads(lines[f"STATE-{c}"]) if f"STATE-{c}" in lines else None)
            for c in configs}


CONFIGS = ["cycle:preload", "stop:clairvoyant", "sample:direct", "cycle:tiers"]


@pytest.fixture(scope="module")
def two_ranks(root):
    """Every config on both ranks of one mpiexec job (one launch: the suite's time)."""
    return _run(run_ranks, 2, root, CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_store_gives_the_mixed_global_batches(root, two_ranks, config):
    assert two_ranks[config][0] == expected(root, config.split(":")[0])


def test_resume_a_mixture_on_another_world_size(root, two_ranks):
    full, state = two_ranks["cycle:preload"]
    assert state["epoch"] == 0 and state["step"] == 3
    rest, _ = _run(run_ranks, 4, root, ["cycle:preload"], json.dumps(state))["cycle:preload"]
    assert rest == full[3:]


def test_torchrun_gives_the_mixed_global_batches(root):
    got, _ = _run(run_torchrun, 2, root, ["cycle:preload"])["cycle:preload"]
    assert got == expected(root, "cycle")
