"""forebay.torch.Checkpoint (issue T, item 1): the loop's state saved every N steps into a
model repository and restored, so that a job that dies goes on with exactly the samples
and the weights it would have had."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import forebay
from forebay.errors import InvalidArgumentError, UsageError
from forebay.models import open_repository
from forebay.torch import Checkpoint, DataLoader

EPOCHS, BATCH, SAMPLES = 3, 4, 64


@pytest.fixture
def dense(tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"x": rng.normal(size=8).astype(np.float32), "label": np.int64(i)}
               for i in range(SAMPLES)]
    forebay.write_dataset(tmp_path / "ds", samples)
    return tmp_path / "ds"


def train_step(model, opt, batch, noise) -> None:
    """One SGD step on a batch of the dense dataset, ``noise`` (a draw from the random
    generators) in the loss."""
    loss = (model(batch["x"]).squeeze(1) - batch["label"].float() / 64).pow(2).mean()
    opt.zero_grad()
    (loss + 0.01 * noise).backward()
    opt.step()


def train(path, repo, *, every=5, stop_at=None, keep=2):
    """The README's loop with a Checkpoint; ``stop_at``: the job dies after that step.
    Returns (labels of each step run, final weights, the checkpoint)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(path, BATCH, epochs=EPOCHS, seed=1, comm=None)
    ckpt = Checkpoint(repo, loader=loader, model=model, optimizer=opt, every_steps=every,
                      keep=keep)
    ckpt.restore()
    torch.manual_seed(1234) if ckpt.step_count == 0 else None   # fresh runs: one seed
    seen = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            train_step(model, opt, batch, torch.randn(1) + float(np.random.rand()))
            seen.append(batch["label"].tolist())
            ckpt.step()
            if stop_at is not None and ckpt.step_count == stop_at:
                ckpt.wait()          # what was in flight lands; the rest of the job dies
                return seen, model.weight.detach().clone(), ckpt
    ckpt.close()
    return seen, model.weight.detach().clone(), ckpt


def test_a_job_that_dies_goes_on_with_the_same_samples_and_weights(dense, tmp_path):
    np.random.seed(7)
    whole, w_whole, _ = train(dense, f"file://{tmp_path}/a")
    np.random.seed(7)
    first, _, died = train(dense, f"file://{tmp_path}/b", stop_at=13)
    assert died.step_count == 13 and died.saved_version is not None
    rest, w_rest, again = train(dense, f"file://{tmp_path}/b")
    steps = len(whole)
    assert steps == EPOCHS * SAMPLES // BATCH
    # restored at step 10 (the last save): steps 11-13 are replayed once, then the run
    # is the uninterrupted one, batch for batch
    assert first == whole[:13]
    assert rest == whole[10:]
    assert torch.equal(w_rest, w_whole)                 # bit-exact, RNG draws included
    assert again.step_count == steps


def test_nothing_saved_is_a_fresh_start(dense, tmp_path):
    model = torch.nn.Linear(8, 1)
    before = model.weight.detach().clone()
    ckpt = Checkpoint(f"file://{tmp_path}/r", model=model, every_steps=2)
    assert ckpt.restore() == 0 and ckpt.saved_version is None
    assert torch.equal(model.weight, before)


def test_versions_beyond_keep_are_pruned_once_a_newer_one_is_whole(dense, tmp_path):
    url = f"file://{tmp_path}/r"
    _, _, ckpt = train(dense, url, every=4, keep=2)
    repo = open_repository(url)
    try:
        versions = repo.versions("checkpoint")
        assert len(versions) == 2 and max(versions) == ckpt.saved_version
        # each version holds the step it was saved at
        steps = sorted(repo.manifest("checkpoint", v)["metadata"]["step"] for v in versions)
        assert steps == [44, 48]
    finally:
        repo.close()


def test_a_restore_checks_what_was_saved(dense, tmp_path):
    url = f"file://{tmp_path}/r"
    model = torch.nn.Linear(8, 1)
    ckpt = Checkpoint(url, model=model)
    ckpt.save(wait=True)
    loader = DataLoader(dense, BATCH, epochs=EPOCHS, seed=1, comm=None)
    with pytest.raises(UsageError, match="holds no loader position"):
        Checkpoint(url, model=model, loader=loader).restore()
    with pytest.raises(UsageError, match="holds no optim state"):
        Checkpoint(url, model=model,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).restore()


def test_bad_arguments_are_refused_with_their_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match="every_steps"):
        Checkpoint(tmp_path, every_steps=-1)
    with pytest.raises(InvalidArgumentError, match="keep"):
        Checkpoint(tmp_path, keep=0)
    with pytest.raises(UsageError, match="needs its model"):
        Checkpoint(tmp_path, optimizer=object())
    ckpt = Checkpoint(f"file://{tmp_path}/r", model=torch.nn.Linear(2, 2))
    ckpt.close()
    with pytest.raises(UsageError, match="closed"):
        ckpt.step()


@pytest.mark.parametrize("shared, restarts, warned", [("True", "3", True),
                                                      ("False", "3", False),
                                                      ("True", "0", False)])
def test_torchrun_restarts_over_a_shared_store_are_warned_of(tmp_path, monkeypatch, shared,
                                                             restarts, warned):
    """torchrun's agent keeps one rendezvous store for every attempt (torch's default):
    a restarted job can read the dead attempt's addresses. The rank-0 worker of a job
    that can restart says so, with the environment variable that avoids it."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Checkpoint(f"file://{tmp_path}/r", model=torch.nn.Linear(2, 2)).close()
    said = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert bool(said) == warned, said
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in m and "--max-restarts 3" in m
               for m in said)
