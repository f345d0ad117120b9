"""A dataset that grows (issue U, item 2): generations appended whole or not at all,
while readers are open; producers take turns; a producer killed mid-append leaves
nothing half-visible."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset import generations
from forebay.errors import DatasetNotFoundError, SchemaError
from conftest import leftovers


def frames(start: int, n: int):
    """Simulation frames: sample k is the vector of k's, of a length that varies."""
    return ({"x": np.full(3 + k % 5, k, np.float32), "k": np.int64(k)}
            for k in range(start, start + n))


def _ks(ds) -> list[int]:
    return [int(ds[i]["k"]) for i in range(len(ds))]


def test_generations_appear_whole_and_open_readers_keep_their_view(tmp_path):
    path = tmp_path / "frames.fb"
    forebay.write_dataset(path, frames(0, 10))
    old = forebay.open_dataset(path)
    m = forebay.append(path, frames(10, 7), shard_bytes=64)      # several shards
    assert m.num_samples == 17 and len(m.shards) > 2
    assert len(old) == 10 and _ks(old) == list(range(10))        # the view it opened
    new = forebay.open_dataset(path)
    assert _ks(new) == list(range(17)) and generations(new.manifest) == [10, 17]
    forebay.append(path, frames(17, 3))
    assert generations(forebay.open_dataset(path).manifest) == [10, 17, 20]
    assert forebay.open_dataset(path).verify().ok
    assert new.fingerprint != forebay.open_dataset(path).fingerprint   # caches tell


def test_an_append_that_does_not_fit_the_schema_changes_nothing(tmp_path):
    path = tmp_path / "frames.fb"
    forebay.write_dataset(path, frames(0, 5))
    before = forebay.open_dataset(path).fingerprint
    with pytest.raises(SchemaError, match="differ from the dataset's"):
        forebay.append(path, ({"x": np.zeros(3, np.float64), "k": np.int64(0)},))
    with pytest.raises(DatasetNotFoundError):
        forebay.append(tmp_path / "nothing.fb", frames(0, 1))
    assert forebay.open_dataset(path).fingerprint == before
    assert leftovers(tmp_path) == []


def rank_producer(path: str, start: str, n: str, die_after: str) -> None:
    """A producer appending frames; ``die_after`` >= 0: killed (SIGKILL, by itself)
    once that many frames were handed over, mid-append."""
    import os

    def gen():
        for k, s in enumerate(frames(int(start), int(n))):
            if k == int(die_after):
                os.kill(os.getpid(), signal.SIGKILL)
            yield s

    forebay.append(path, gen(), shard_bytes=256)


def _producer(path: Path, start: int, n: int, die_after: int = -1) -> subprocess.Popen:
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_append as t; "
            "t.rank_producer({path!r}, {start!r}, {n!r}, {die!r})").format(
        tests=str(Path(__file__).parent), path=str(path), start=str(start), n=str(n),
        die=str(die_after))
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)


def test_a_producer_killed_mid_append_leaves_nothing_half_visible(tmp_path):
    path = tmp_path / "frames.fb"
    forebay.write_dataset(path, frames(0, 10))
    p = _producer(path, 10, 50, die_after=30)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err
    ds = forebay.open_dataset(path)
    assert _ks(ds) == list(range(10)) and ds.verify().ok
    forebay.append(path, frames(10, 5))                    # the next producer goes on
    assert _ks(forebay.open_dataset(path)) == list(range(15))
    assert leftovers(tmp_path) == []                       # and clears what it left
    assert sorted(q.name for q in path.iterdir() if not q.name.startswith("shard-")) == \
        ["manifest.json"]


def test_producers_take_turns(tmp_path):
    path = tmp_path / "frames.fb"
    forebay.write_dataset(path, frames(0, 4))
    ps = [_producer(path, 100 * (j + 1), 40) for j in range(3)]
    for p in ps:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    ds = forebay.open_dataset(path)
    got = _ks(ds)
    assert len(got) == 4 + 3 * 40 and sorted(got) == sorted(
        list(range(4)) + [k for j in range(3) for k in range(100 * (j + 1), 100 * (j + 1) + 40)])
    gens = generations(ds.manifest)
    assert gens[0] == 4 and len(gens) == 4
    for a, b in zip(gens, gens[1:]):          # each generation one producer's frames, whole
        block = got[a:b]
        assert block == list(range(block[0], block[0] + 40))
    assert ds.verify().ok


# -- a loader over a dataset that grows (issue U, item 2) ------------------------------

def _labels(loader, epoch):
    loader.set_epoch(epoch)
    return [b["y"].tolist() for b in loader]


def _plan_labels(n, epoch, world=1, rank=0, batch=8):
    plan = forebay.AccessPlan(n, world, batch, 3, seed=2)
    return plan.batches(rank, epoch).tolist()


def grow(path, start, n):
    forebay.append(path, ({"y": np.int64(i)} for i in range(start, start + n)))


@pytest.mark.parametrize("store", ["direct", "preload", "clairvoyant"])
def test_a_loader_follows_appends_at_epoch_fences_and_resumes_exactly(tmp_path, store):
    from forebay.torch import DataLoader, Pipeline

    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    pipe = Pipeline(collate_fn=lambda b: {"y": b["y"].copy()})
    with DataLoader(path, 8, epochs=3, seed=2, store=store, follow_appends=True,
                    pipeline=pipe) as loader:
        assert [[int(x) for x in b] for b in _labels(loader, 0)] == _plan_labels(40, 0)
        grow(path, 40, 24)                           # a producer appends a generation
        assert _labels(loader, 1) == _plan_labels(64, 1)     # it joins at the fence
        loader.set_epoch(1)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
    assert state["num_samples"] == 64
    grow(path, 64, 16)                               # more while the job was down
    with DataLoader(path, 8, epochs=3, seed=2, store=store, follow_appends=True,
                    pipeline=pipe) as again:
        again.load_state_dict(state)                 # epoch 1 as it was: 64 samples
        assert _labels(again, 1) == _plan_labels(64, 1)[2:]
        assert _labels(again, 2) == _plan_labels(80, 2)


def label_of(sample):
    return {"y": sample["y"]}


@pytest.mark.parametrize("store", ["direct", "preload"])
def test_transform_workers_read_the_new_generations(tmp_path, store):
    from forebay.torch import DataLoader, Pipeline

    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    with DataLoader(path, 8, epochs=2, seed=2, store=store, follow_appends=True,
                    pipeline=Pipeline(workers=2, transform=label_of)) as loader:
        _labels(loader, 0)
        grow(path, 40, 40)
        assert _labels(loader, 1) == _plan_labels(80, 1)


def test_follow_appends_refuses_what_cannot_follow(tmp_path):
    from forebay.errors import InvalidArgumentError
    from forebay.torch import DataLoader

    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    with pytest.raises(InvalidArgumentError, match="store='direct', 'preload' or"):
        DataLoader(path, 8, follow_appends=True, store="auto")
    with pytest.raises(InvalidArgumentError, match="store='direct', 'preload' or"):
        DataLoader(forebay.Mixture({str(path): 1.0}), 8, follow_appends=True,
                   store="direct")


def test_resuming_on_a_replaced_dataset_is_refused(tmp_path):
    from forebay.errors import InvalidArgumentError
    from forebay.torch import DataLoader

    path = tmp_path / "g.fb"
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    with DataLoader(path, 8, epochs=2, store="direct", follow_appends=True) as loader:
        next(iter(loader))
        state = loader.state_dict()
    forebay.write_dataset(path, ({"y": np.int64(-i)} for i in range(48)), overwrite=True)
    with DataLoader(path, 8, epochs=2, store="direct", follow_appends=True) as again:
        with pytest.raises(InvalidArgumentError, match="replaced, not appended"):
            again.load_state_dict(state)


def rank_produce(path: str) -> None:
    """A producer process: a dataset of 40, then three generations of 8."""
    forebay.write_dataset(path, ({"y": np.int64(i)} for i in range(40)))
    for g in range(3):
        forebay.append(path, ({"y": np.int64(i)} for i in range(40 + 8 * g, 48 + 8 * g)))


def test_a_consumer_waits_for_samples_a_producer_has_not_published(tmp_path):
    from forebay.dataset import wait_for
    from forebay.errors import WaitTimeoutError

    path = tmp_path / "w.fb"
    with pytest.raises(WaitTimeoutError, match="0 samples after 0.1 s, waiting for 1"):
        wait_for(path, 1, timeout=0.1)                     # not even created yet
    from conftest import rank_command

    cmd, env = rank_command(rank_produce, [path])
    producer = subprocess.Popen([sys.executable, *cmd], env=env)
    try:
        m = wait_for(path, 64, timeout=120)                # the third generation's
        assert m.num_samples == 64 and generations(m)[-1] == 64
    finally:
        producer.wait(timeout=120)
    assert forebay.open_dataset(path)[63]["y"] == 63
    with pytest.raises(WaitTimeoutError, match="64 samples after"):
        wait_for(path, 65, timeout=0.1)
