"""forebay.torch.Checkpoint under real torchrun (issue T, item 1): a 2-rank DDP job's
save of step 10, restored at 1 rank, goes on with exactly the plan's global batches to
the weights of the uninterrupted 2-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import forebay
from conftest import assert_ranks_ok, run_torchrun

pytestmark = pytest.mark.mpi

EPOCHS, GLOBAL_BATCH, SAMPLES = 2, 8, 64


def rank_train(path: str, repo: str, out: str, snapshot: str = "") -> None:
    """DDP training with a Checkpoint every 5 steps, to the end; ``snapshot``: once step
    10's save is whole, the repository is copied there (what a job that died after
    steps 11-14 would find).  Writes ``out/rank-R.json``: the ids of each step."""
    import shutil

    import torch
    import torch.distributed as dist

    from forebay.torch import Checkpoint, DataLoader
    from test_checkpoint import train_step

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(path, GLOBAL_BATCH // world, epochs=EPOCHS, seed=1)
    ckpt = Checkpoint(repo, loader=loader, model=model, optimizer=opt, every_steps=5)
    if ckpt.restore() == 0:
        torch.manual_seed(1234 + rank)
    seen = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            train_step(model, opt, batch, torch.randn(1))
            seen.append(batch["label"].tolist())
            ckpt.step()
            if snapshot and ckpt.step_count == 10:
                ckpt.wait()
                dist.barrier()
                if rank == 0:
                    shutil.copytree(repo.removeprefix("file://"), snapshot)
                dist.barrier()
    ckpt.close()
    w = model.module.weight.detach().numpy().tolist()
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"seen": seen, "weight": w,
                                                          "step": ckpt.step_count}))
    loader.close()
    dist.destroy_process_group()


def _global(out: Path, world: int) -> tuple[list, list, int]:
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    steps = [sorted(sum((r["seen"][k] for r in ranks), [])) for k in range(len(ranks[0]["seen"]))]
    return steps, ranks[0]["weight"], ranks[0]["step"]


def test_a_ddp_job_restored_at_one_rank_ends_with_the_uninterrupted_weights(tmp_path):
    rng = np.random.default_rng(0)
    forebay.write_dataset(tmp_path / "ds", [
        {"x": rng.normal(size=8).astype(np.float32), "label": np.int64(i)}
        for i in range(SAMPLES)])
    ds = str(tmp_path / "ds")
    runs = {k: tmp_path / k for k in ("whole", "one")}
    for d in runs.values():
        d.mkdir()
    # the uninterrupted run at 2 ranks, its repository as of step 10 kept aside
    assert_ranks_ok(run_torchrun(2, rank_train, ds, f"file://{tmp_path}/b", runs["whole"],
                                 tmp_path / "c", timeout=180), 2)
    # a job that died after step 10's save, resubmitted at 1 rank
    assert_ranks_ok(run_torchrun(1, rank_train, ds, f"file://{tmp_path}/c", runs["one"],
                                 timeout=180), 1)
    plan = forebay.AccessPlan(SAMPLES, 1, GLOBAL_BATCH, EPOCHS, seed=1)
    whole = [sorted(g.tolist()) for e in range(EPOCHS) for g in plan.global_batches(e)]
    two, w_two, n_two = _global(runs["whole"], 2)
    one, w_one, n_one = _global(runs["one"], 1)
    assert n_two == n_one == len(whole) == EPOCHS * SAMPLES // GLOBAL_BATCH
    assert two == whole
    assert one == whole[10:]                      # from the save of step 10, the rest
    # the restored run trains to the uninterrupted run's weights (up to summation
    # order at another world size; bit-exact at one world size: tests/test_checkpoint.py)
    np.testing.assert_allclose(w_one, w_two, rtol=1e-5)


def rank_restore_from(repo: str, out: str) -> None:
    """Save a DDP model and Adam after a few steps, then restore them twice into
    changed weights: once read by rank 0 and broadcast, once read by every rank."""
    import torch
    import torch.distributed as dist

    from forebay.torch import Checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for k in range(3):
        torch.manual_seed(10 * k + rank)
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    avg = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    ckpt = Checkpoint(repo, model=model, optimizer=opt)
    ckpt.save(wait=True)
    report = {}
    for how in ("one", "every"):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
                opt.state[p]["exp_avg"].zero_()
        again = Checkpoint(repo, model=model, optimizer=opt, restore_from=how)
        again.restore()
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters()), how
        assert all(torch.equal(opt.state[p]["exp_avg"], avg[n])
                   for n, p in model.named_parameters()), how
        assert opt.param_groups[0]["lr"] == 0.01
        report[how] = again.restore_stats
        again.close()
    ckpt.close()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_restore_reads_a_replicated_state_once_and_broadcasts_it(tmp_path):
    """restore_from="one": the state's bytes come from the file system once per job (rank
    0), the same values on every rank as when every rank reads them."""
    repo = f"file://{tmp_path / 'repo'}"
    assert_ranks_ok(run_torchrun(2, rank_restore_from, repo, tmp_path, timeout=240), 2)
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    state = (512 * 256 + 256) * 4 * 3           # weights, exp_avg, exp_avg_sq (float32)
    assert r0["one"]["from"] == "one" and r0["one"]["bytes_read"] >= state
    assert r1["one"]["bytes_read"] < state // 20    # its own small items (random states)
    assert r0["every"]["bytes_read"] >= state and r1["every"]["bytes_read"] >= state
