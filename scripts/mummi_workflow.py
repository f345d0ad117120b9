"""A MuMMI-like workflow (issue U, item 4): simulations produce frames while a model
retrains on what has been produced.

Producers append frames to one shared dataset, a generation at a time
(:func:`forebay.append`: whole or absent, producers taking turns); the trainer, a job
of any number of ranks, retrains every ``--every`` generations: it waits for them
(:func:`forebay.dataset.wait_for`), then reads the grown dataset at its next epoch
fence (``DataLoader(follow_appends=True)``: every rank the same global batches over
the samples all of them see).  After its first round has started, a producer goes on
only once the trainer has begun (a marker file), so production and training overlap
as in MuMMI; with ``FOREBAY_TRACE`` set, both sides' spans land in one trace
(``forebay analyze``: the producers' appends, the trainer's waits and batches).

    python scripts/mummi_workflow.py produce frames.fb --producer 0 --generations 4 &
    python scripts/mummi_workflow.py produce frames.fb --producer 1 --generations 4 &
    mpiexec -n 2 python scripts/mummi_workflow.py train frames.fb --rounds 2 --every 4

On the emulated cluster (``scripts/cluster.py``; tests/test_cluster.py runs it with the
producers on two nodes and the trainer on the other two).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

FRAME = (16, 3)           # a frame: 16 particles' positions


def frames(producer: int, generation: int, n: int) -> list[dict]:
    """A generation's frames, deterministic: ``id`` says who made which frame."""
    rng = np.random.default_rng([producer, generation])
    return [{"id": np.int64(producer * 1_000_000 + generation * 1_000 + k),
             "pos": rng.normal(size=FRAME).astype(np.float32)} for k in range(n)]


def produce(a: argparse.Namespace) -> None:
    import forebay
    from forebay.dataset import wait_for

    path = Path(a.dataset)
    marker = path.with_name(path.name + ".started")
    for g in range(a.generations):
        if g == 1:           # the trainer's first round has begun before the second
            while not marker.exists():
                time.sleep(0.02)
        batch = frames(a.producer, g, a.frames)
        if a.producer == 0 and g == 0:
            forebay.write_dataset(path, batch)      # the first generation makes it
        else:
            wait_for(path, 1, timeout=a.timeout)    # made by producer 0
            forebay.append(path, batch)
        print(f"producer {a.producer}: generation {g} appended", flush=True)


def train(a: argparse.Namespace) -> None:
    import torch

    from forebay.dataset import wait_for
    from forebay.torch import DataLoader, Pipeline

    path = Path(a.dataset)
    loader = None
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for r in range(a.rounds):
        wait_for(path, (r + 1) * a.every * a.frames, timeout=a.timeout)
        if loader is None:
            loader = DataLoader(path, a.batch_size, epochs=a.rounds, seed=0, store="direct",
                                follow_appends=True,
                                pipeline=Pipeline(collate_fn=lambda b: (
                                    torch.from_numpy(b["id"].copy()),
                                    torch.from_numpy(b["pos"].copy()))))
        loader.set_epoch(r)                         # the generations every rank sees
        if loader.rank == 0 and r == 0:
            path.with_name(path.name + ".started").touch()
        seen = []
        for ids, pos in loader:
            loss = model(pos).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += ids.tolist()
        report = {"round": r, "rank": loader.rank, "samples": loader.plan.num_samples,
                  "ids": seen}
        if a.out:                       # one file per rank and round
            Path(a.out, f"round-{r}-rank-{loader.rank}.json").write_text(json.dumps(report))
        print(f"round {r} rank {loader.rank}: {len(seen)} frames of the first "
              f"{loader.plan.num_samples}", flush=True)
    if loader is not None:
        loader.close()


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    pr = sub.add_parser("produce", help="append generations of frames")
    pr.add_argument("dataset")
    pr.add_argument("--producer", type=int, default=0)
    pr.add_argument("--generations", type=int, default=4)
    tr = sub.add_parser("train", help="retrain every --every generations (any launcher)")
    tr.add_argument("dataset")
    tr.add_argument("--rounds", type=int, default=2)
    tr.add_argument("--every", type=int, default=2, help="generations per round")
    tr.add_argument("--batch-size", type=int, default=8, help="per rank")
    tr.add_argument("--out", help="a directory for each rank's frames of each round (JSON)")
    for q in (pr, tr):
        q.add_argument("--frames", type=int, default=32, help="frames per generation")
        q.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait for a producer")
    a = p.parse_args(argv)
    (produce if a.role == "produce" else train)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
