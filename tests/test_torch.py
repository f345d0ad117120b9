"""forebay.torch in one process: plan-driven batches, collation, resume, prefetch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forebay  # noqa: E402
from forebay import AccessPlan  # noqa: E402
from forebay.synth import molecule_samples  # noqa: E402
from forebay.errors import UsageError  # noqa: E402
from conftest import SeenBatches  # noqa: E402
from forebay.torch import (Auto, Clairvoyant, DataLoader, Dataset, Pipeline,  # noqa: E402
                           PlanSampler, collate_graphs, store_settings)


@pytest.fixture(scope="module")
def molecules(tmp_path_factory):
    path = tmp_path_factory.mktemp("mol") / "mol.fb"
    samples = list(molecule_samples(203, seed=2))
    forebay.write_dataset(path, samples, shard_bytes=32 << 10)
    return path, samples


@pytest.mark.parametrize("mode, prefetch", [("preload", 4), ("direct", 0), ("direct", 2)])
def test_batches_follow_the_plan(molecules, mode, prefetch):
    path, samples = molecules
    dl = DataLoader(path, 16, epochs=2, seed=7, comm=None, store=mode,
                    pipeline=Pipeline(prefetch=prefetch))
    plan = AccessPlan(len(samples), 1, 16, 2, seed=7)
    assert len(dl) == plan.steps_per_epoch == 13
    for epoch in range(2):
        dl.set_epoch(epoch)
        got = list(dl)
        assert len(got) == 13
        for step, b in enumerate(got):
            ids = plan.batches(0, epoch)[step]
            assert b["num_graphs"] == 16
            np.testing.assert_array_equal(b["y"].numpy()[:, 0], [samples[i]["y"][0] for i in ids])
            want_x = np.concatenate([samples[i]["x"] for i in ids])
            np.testing.assert_array_equal(b["x"].numpy(), want_x)
    assert dl.state_dict()["epoch"] == 1


@pytest.mark.parametrize("store, workers", [("direct", 0), ("direct", 2), ("preload", 0)])
def test_the_next_epoch_is_fetched_while_the_loop_is_between_epochs(molecules, store,
                                                                    workers):
    """The plan knows the next epoch: once an epoch's batches are all fetched, the
    prefetch thread goes on with the next one's first batches, which the loop then gets
    without fetching them again; a loop that goes elsewhere (an epoch read again) gets
    that epoch's batches, not what was fetched ahead.  A store in one process outside
    MPI too (preload)."""
    import collections

    path, samples = molecules
    ids = SeenBatches()

    dl = DataLoader(path, 16, epochs=3, seed=7, comm=None, store=store,
                    pipeline=Pipeline(prefetch=2, workers=workers,
                                      **({"worker_start": "thread", "batch_transform": ids}
                                         if workers else {"collate_fn": ids})))
    plan = AccessPlan(len(samples), 1, 16, 3, seed=7)
    want = [[tuple(b.tolist()) for b in plan.batches(0, e)] for e in range(3)]
    assert [tuple(b.tolist()) for b in dl] == want[0]
    assert ids.wait_for(want[1][0])             # before the loop asked for epoch 1
    dl.set_epoch(1)
    assert [tuple(b.tolist()) for b in dl] == want[1]
    assert ids.wait_for(want[2][0])
    count = collections.Counter(ids.seen)
    assert all(count[b] == 1 for b in want[0] + want[1])     # each batch fetched once
    dl.set_epoch(1)                             # read again: what was ahead is dropped
    assert [tuple(b.tolist()) for b in dl] == want[1]
    dl.set_epoch(2)
    assert [tuple(b.tolist()) for b in dl] == want[2]
    dl.close()
    assert ids.seen.count(want[2][0]) == 2      # ahead of the re-read, and after it


def test_a_paused_iteration_that_was_superseded_or_closed_says_so(molecules):
    """One prefetch thread serves the loop: an iteration paused while another began
    (or while the loader closed) raises when resumed, instead of sharing the other's
    batches or waiting forever; the newer one gets its epoch's batches."""
    path, samples = molecules
    dl = DataLoader(path, 16, epochs=2, seed=7, comm=None, store="direct",
                    pipeline=Pipeline(prefetch=2, collate_fn=lambda b: b.ids.copy()))
    plan = AccessPlan(len(samples), 1, 16, 2, seed=7)
    first = iter(dl)
    np.testing.assert_array_equal(next(first), plan.batches(0, 0)[0])
    dl.set_epoch(0)                               # the epoch again, from its start
    again = [b.tolist() for b in dl]
    assert again == plan.batches(0, 0).tolist()
    with pytest.raises(UsageError, match="another iteration of this loader began"):
        next(first)
    dl.set_epoch(1)
    paused = iter(dl)
    np.testing.assert_array_equal(next(paused), plan.batches(0, 1)[0])
    dl.close()
    with pytest.raises(UsageError, match="closed while this iteration was paused"):
        next(paused)


def test_a_plan_that_fails_in_the_prefetch_thread_reaches_the_loop():
    """Going on into the next epoch, the prefetch thread asks the plan for its batches:
    an error there reaches the loop with that epoch's first batch (no thread dying
    alone, no loop waiting forever)."""
    from forebay.torch._prefetch import Prefetcher

    def batches_of(epoch):
        if epoch == 1:
            raise ValueError("no batches for epoch 1")
        return np.arange(8).reshape(4, 2)

    pf = Prefetcher(lambda ids, epoch, step: int(ids.sum()), batches_of,
                    np.ones(8, dtype=np.int64), steps=4, epoch=0, start=0, last_epoch=1,
                    depth=2, budget=None)
    try:
        assert [pf.take() for _ in range(4)] == [(0, k, 4 * k + 1, None) for k in range(4)]
        assert pf.next_key() == (1, 0)
        epoch, step, out, err = pf.take()
        assert (epoch, step, out) == (1, 0, None)
        assert isinstance(err, ValueError) and "epoch 1" in str(err)
    finally:
        pf.stop()


def test_graph_collation_offsets_edges_and_builds_batch_vector(molecules):
    path, samples = molecules
    ds = forebay.open_dataset(path)
    ids = [5, 0, 77]
    out = collate_graphs(ds.get_many(ids))
    nodes = [samples[i]["x"].shape[0] for i in ids]
    offsets = np.concatenate([[0], np.cumsum(nodes)[:-1]])
    want = np.concatenate([samples[i]["edge_index"] + o for i, o in zip(ids, offsets)], axis=1)
    np.testing.assert_array_equal(out["edge_index"].numpy(), want)
    np.testing.assert_array_equal(out["batch"].numpy(), np.repeat(np.arange(3), nodes))
    np.testing.assert_array_equal(out["ptr"].numpy(), np.concatenate([[0], np.cumsum(nodes)]))
    np.testing.assert_array_equal(out["edge_attr"].numpy(),
                                  np.concatenate([samples[i]["edge_attr"] for i in ids]))
    np.testing.assert_array_equal(out["pos"].numpy(),
                                  np.concatenate([samples[i]["pos"] for i in ids]))
    assert out["y"].shape == (3, 1)
    assert int(out["edge_index"].max()) < sum(nodes)


def test_dense_collation_stacks_without_copy(tmp_path):
    samples = [{"img": np.full((2, 3), i, np.float32), "label": np.int64(i)} for i in range(10)]
    forebay.write_dataset(tmp_path / "d", samples)
    dl = DataLoader(tmp_path / "d", 4, shuffle=False, drop_last=True, comm=None, store="direct")
    b = next(iter(dl))
    assert b["img"].shape == (4, 2, 3) and b["label"].tolist() == [0, 1, 2, 3]
    assert len(dl) == 2


def test_resume_mid_epoch_gives_the_remaining_batches(molecules):
    path, _ = molecules
    ref = [b["y"].clone() for b in DataLoader(path, 8, epochs=1, seed=3, comm=None)]
    dl = DataLoader(path, 8, epochs=1, seed=3, comm=None)
    it = iter(dl)
    for _ in range(5):
        next(it)
    state = dl.state_dict()
    assert state["step"] == 5
    it.close()  # stops the prefetch thread
    fresh = DataLoader(path, 8, epochs=1, seed=3, comm=None)
    fresh.load_state_dict(state)
    rest = [b["y"] for b in fresh]
    assert len(rest) == len(ref) - 5
    for a, b in zip(rest, ref[5:]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="global_batch"):
        DataLoader(path, 4, epochs=1, seed=3, comm=None).load_state_dict(state)


def test_set_epoch_restarts_the_epoch_and_a_finished_epoch_never_jumps(molecules):
    """set_epoch(e) starts e from its first batch even mid-epoch (it resumed at the
    step reached); iterating a finished epoch without set_epoch is an error (it
    silently ran the next epoch)."""
    path, samples = molecules
    plan = AccessPlan(len(samples), 1, 8, 3, seed=3)
    dl = DataLoader(path, 8, epochs=3, seed=3, comm=None,
                    pipeline=Pipeline(prefetch=0, collate_fn=lambda b: b.ids.tolist()))
    want = [[b.tolist() for b in plan.batches(0, e)] for e in range(3)]
    it = iter(dl)
    assert [next(it), next(it)] == want[0][:2]
    it.close()
    dl.set_epoch(0)                                    # the same epoch: from its start
    assert list(dl) == want[0]
    with pytest.raises(UsageError, match=r"epoch 0 is finished: call loader.set_epoch\(1\)"):
        list(dl)
    assert dl.state_dict()["epoch"] == 1 and dl.state_dict()["step"] == 0
    dl.set_epoch(0)                                    # read it again, on purpose
    assert list(dl) == want[0]
    dl.set_epoch(2)
    assert list(dl) == want[2]
    with pytest.raises(UsageError, match="the plan's last"):
        list(dl)
    # resume: set_epoch for the saved epoch keeps the saved step, another epoch resets
    fresh = DataLoader(path, 8, epochs=3, seed=3, comm=None,
                       pipeline=Pipeline(prefetch=0, collate_fn=lambda b: b.ids.tolist()))
    fresh.load_state_dict({**dl.state_dict(), "epoch": 1, "step": 4})
    fresh.set_epoch(1)
    assert list(fresh) == want[1][4:]
    fresh.load_state_dict({**dl.state_dict(), "epoch": 1, "step": 4})
    fresh.set_epoch(2)
    assert list(fresh) == want[2]
    assert fresh.stats()["padding_per_epoch"] == plan.padding > 0


def test_transform_and_custom_collate(tmp_path):
    samples = [{"v": np.arange(3, dtype=np.float64) + i} for i in range(6)]
    forebay.write_dataset(tmp_path / "d", samples)
    dl = DataLoader(tmp_path / "d", 3, shuffle=False, comm=None, store="direct",
                    pipeline=Pipeline(transform=lambda s: {"v": torch.as_tensor(s["v"]) * 2}))
    b = next(iter(dl))
    assert b["v"][1].tolist() == [2.0, 4.0, 6.0]
    dl = DataLoader(tmp_path / "d", 3, shuffle=False, comm=None, store="direct",
                    pipeline=Pipeline(collate_fn=lambda batch: batch.ids.tolist()))
    assert list(dl) == [[0, 1, 2], [3, 4, 5]]


def test_errors_in_the_prefetch_thread_reach_the_caller(tmp_path):
    samples = [{"v": np.zeros(2)} for _ in range(40)]
    forebay.write_dataset(tmp_path / "d", samples)

    def broken(batch):
        raise RuntimeError("collate failed")

    dl = DataLoader(tmp_path / "d", 4, comm=None,
                    pipeline=Pipeline(collate_fn=broken, prefetch=2))
    with pytest.raises(RuntimeError, match="collate failed"):
        list(dl)


def test_map_style_dataset_with_plan_sampler(molecules):
    path, samples = molecules
    plan = AccessPlan(len(samples), 1, 10, 1, seed=4, drop_last=True)
    sampler = PlanSampler(plan, rank=0)
    loader = torch.utils.data.DataLoader(Dataset(path), batch_size=10, sampler=sampler,
                                         collate_fn=lambda xs: [float(x["y"][0]) for x in xs])
    got = list(loader)
    assert len(got) == plan.steps_per_epoch
    assert got[3] == [float(samples[i]["y"][0]) for i in plan.batches(0, 0)[3]]


def test_dataset_over_a_store_reads_the_store_and_refuses_workers(molecules):
    from forebay.store import DirectStore, DistributedStore

    path, samples = molecules
    with DistributedStore(path, None, progress=False) as st:
        data = Dataset(st)
        assert len(data) == len(samples)
        for i in (0, 5, -1):
            got = data[i]
            for k, v in samples[i].items():
                assert got[k].numpy().tobytes() == np.asarray(v).tobytes(), (i, k)
        assert st.stats()["fetches_by_source"]["local"] == 3
        # torch's worker processes would read a shared store outside the process that
        # made it: refused by name instead
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1,
                                             collate_fn=lambda xs: xs)
        with pytest.raises(UsageError, match="num_workers=0"):
            next(iter(loader))
    with DirectStore(path) as direct:              # files: workers may read them
        loader = torch.utils.data.DataLoader(Dataset(direct), batch_size=4, num_workers=1,
                                             collate_fn=lambda xs: [int(x["y"][0]) for x in xs])
        assert next(iter(loader)) == [int(np.asarray(samples[i]["y"])[0]) for i in range(4)]


def test_pin_memory_without_cuda_warns_and_falls_back(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    forebay.write_dataset(tmp_path / "d", [{"v": np.zeros(2)}] * 4)
    with pytest.warns(RuntimeWarning, match="no CUDA"):
        dl = DataLoader(tmp_path / "d", 2, comm=None, pipeline=Pipeline(pin_memory=True))
    assert not dl.pin_memory and len(list(dl)) == 2


def test_bad_loader_arguments(molecules):
    path, _ = molecules
    with pytest.raises(ValueError, match="store must be one of"):
        DataLoader(path, 4, comm=None, store="lazy")
    with pytest.raises(ValueError, match="larger than the dataset"):
        DataLoader(path, 1000, comm=None, drop_last=True)
    dl = DataLoader(path, 4, comm=None, epochs=1)
    with pytest.raises(ValueError, match="epoch 3"):
        dl.set_epoch(3)


def test_auto_mode_preloads_what_fits_and_streams_what_does_not(molecules, monkeypatch):
    path, samples = molecules
    dl = DataLoader(path, 16, comm=None, store="auto")
    assert dl.mode == "preload"
    monkeypatch.setenv("FOREBAY_MEMORY_LIMIT", "20000")  # far less than the dataset
    dl = DataLoader(path, 16, comm=None, seed=2,
                    store=Auto(clairvoyant=Clairvoyant(ram_bytes=8000, ssd_dir=str(path.parent),
                                                       ssd_bytes=30000)))
    assert dl.mode == "clairvoyant"
    plan = AccessPlan(len(samples), 1, 16, 1, seed=2)
    for step, b in enumerate(dl):
        ids = plan.batches(0, 0)[step]
        np.testing.assert_array_equal(b["y"].numpy()[:, 0], [samples[i]["y"][0] for i in ids])
    s = dl.stats()
    assert {"pfs_reads", "pfs_bytes", "fetches_by_source", "stall_seconds"} <= set(s)
    assert s["fetches_by_source"]["pfs"] > 0 and s["mode"] == "clairvoyant"
    assert s["ssd_bytes"] > 0 and list(path.parent.glob("*.tier"))
    dl.close()
    assert not list(path.parent.glob("*.tier"))


def test_staging_area_bounded_in_bytes(molecules):
    path, samples = molecules
    ds = forebay.open_dataset(path)
    plan = AccessPlan(len(samples), 1, 8, 1, seed=6)
    biggest = max(int(ds.sample_nbytes[b].sum()) for b in plan.batches(0, 0))
    budget = biggest + 100  # room for about one batch at a time
    dl = DataLoader(path, 8, comm=None, seed=6,
                    pipeline=Pipeline(prefetch=8, staging_bytes=budget,
                                      collate_fn=lambda b: b.ids.copy()))
    got = list(dl)
    np.testing.assert_array_equal(np.stack(got), plan.batches(0, 0))
    assert 0 < dl.stats()["staging_peak_bytes"] <= budget
    unbounded = DataLoader(path, 8, comm=None, seed=6,
                           pipeline=Pipeline(prefetch=8, collate_fn=lambda b: (
                               __import__("time").sleep(0.001), b.ids)[1]))
    it = iter(unbounded)
    next(it)
    __import__("time").sleep(0.2)  # let the thread run ahead
    assert unbounded.stats()["staging_peak_bytes"] > budget
    it.close()
    with pytest.raises(ValueError, match="staging_bytes"):
        DataLoader(path, 8, comm=None, pipeline=Pipeline(staging_bytes=0))


def _flip_a_sample_byte(path, sample):
    """Damage one byte of sample ``sample``'s ``pos`` field in its shard file, in place;
    returns what ``verify`` then finds damaged."""
    ds = forebay.open_dataset(path)
    want = ds[sample]["pos"].tobytes()
    for shard in ds.manifest.shards:
        raw = bytearray((path / shard.data).read_bytes())
        at = raw.find(want)
        if at >= 0:
            assert raw.find(want, at + 1) < 0
            raw[at + 3] ^= 0xFF
            (path / shard.data).write_bytes(bytes(raw))
            break
    return forebay.open_dataset(path).verify(raise_on_error=False).bad_samples


@pytest.mark.parametrize("mode", ["preload", "clairvoyant", "direct"])
def test_verify_on_read_is_honoured_in_every_mode(tmp_path, molecules, mode):
    """A damaged sample is never delivered when verify_on_read is set (preload and
    clairvoyant used to read records around the check and deliver it)."""
    import shutil

    path = tmp_path / "mol.fb"
    shutil.copytree(molecules[0], path)
    assert _flip_a_sample_byte(path, 57) == [57]
    kw = dict(epochs=1, seed=3, store=store_settings(mode, ram_bytes=1 << 20),
              pipeline=Pipeline(prefetch=0), comm=None)
    # without the check the damaged sample goes out: the test sees the difference
    assert sum(1 for _ in DataLoader(path, 16, **kw)) == 13
    for loader in (lambda: DataLoader(path, 16, verify_on_read=True, **kw),
                   lambda: DataLoader(forebay.open_dataset(path, verify_on_read=True), 16,
                                      **kw)):
        with pytest.raises(forebay.errors.ChecksumError, match="sample 57"):
            for _ in loader():
                pass


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    path = tmp_path_factory.mktemp("blobs") / "blobs.fb"
    rng = np.random.default_rng(4)
    samples = [{"image": rng.bytes(int(rng.integers(0, 3000))), "label": np.int64(i),
                "box": rng.normal(size=(int(rng.integers(0, 4)), 4)).astype(np.float32)}
               for i in range(90)]
    forebay.write_dataset(path, samples, shard_bytes=40 << 10)
    return path, samples


@pytest.mark.parametrize("mode", ["direct", "preload", "clairvoyant"])
def test_views_lend_the_same_samples_read_only(blobs, mode):
    """views=True: the bytes and ragged fields come as read-only numpy arrays over the
    store's memory, the same samples as the copies; labels stacked into a tensor."""
    path, samples = blobs
    plan = AccessPlan(len(samples), 1, 16, 2, seed=1)
    dl = DataLoader(path, 16, epochs=2, seed=1, comm=None, progress=False, store=mode,
                    pipeline=Pipeline(views=True))
    kept = []
    for epoch in range(2):
        dl.set_epoch(epoch)
        for step, b in enumerate(dl):
            ids = plan.batches(0, epoch)[step]
            assert isinstance(b["label"], torch.Tensor)
            assert b["label"].tolist() == ids.tolist()
            for k, i in enumerate(ids.tolist()):
                img, box = b["image"][k], b["box"][k]
                assert isinstance(img, np.ndarray) and not img.flags.writeable
                assert img.tobytes() == samples[i]["image"]
                np.testing.assert_array_equal(box, samples[i]["box"])
            kept.append((ids, b))
    last = kept[-1][1]["image"][0]
    with pytest.raises(ValueError, match="read-only"):
        last[:1] = 0
    dl.close()
    for ids, b in kept:                  # the views outlive the loader, unchanged
        assert [v.tobytes() for v in b["image"]] == [samples[i]["image"] for i in ids]


def test_views_reach_the_transform_read_only(blobs):
    path, samples = blobs
    seen = []

    def transform(s):
        seen.append(s["image"].flags.writeable)
        return {"n": torch.tensor(len(s["image"]))}

    dl = DataLoader(path, 8, comm=None, store="direct",
                    pipeline=Pipeline(views=True, transform=transform))
    out = next(iter(dl))
    ids = dl.plan.batches(0, 0)[0]
    assert out["n"].tolist() == [len(samples[i]["image"]) for i in ids]
    assert seen and not any(seen)
    dl.close()


def test_views_with_graph_batches_need_a_collate_fn(molecules):
    from forebay.errors import InvalidArgumentError

    path, _ = molecules
    with pytest.raises(InvalidArgumentError, match="graph batches"):
        DataLoader(path, 4, comm=None, store="direct", pipeline=Pipeline(views=True))
    dl = DataLoader(path, 4, comm=None, store="direct",
                    pipeline=Pipeline(views=True, collate_fn=lambda v: v.stacked("y")))
    assert next(iter(dl)).shape == (4, 1)
    dl.close()


@pytest.fixture(scope="module")
def large_blobs(tmp_path_factory):
    """Samples large enough that a batch of 16 is gathered into a pooled buffer."""
    path = tmp_path_factory.mktemp("large") / "large.fb"
    rng = np.random.default_rng(3)
    samples = [{"image": rng.integers(0, 255, 80_000 + 17 * i, dtype=np.uint8),
                "y": np.array([i], dtype=np.int64)} for i in range(120)]
    forebay.write_dataset(path, samples)
    return path, samples


@pytest.mark.parametrize("mode", ["direct", "preload", "clairvoyant"])
def test_batch_buffers_are_reused_only_once_a_batch_is_dropped(large_blobs, mode):
    """The loader gathers batches into recycled buffers: a batch the training loop
    keeps (whole or a slice of one tensor) stays bit-exact while later batches are
    gathered, and buffers of dropped batches are reused."""
    path, samples = large_blobs
    prefetch = 2
    dl = DataLoader(path, 16, epochs=2, seed=7, comm=None,
                    store=store_settings(mode, ram_bytes=1 << 25),
                    pipeline=Pipeline(prefetch=prefetch))
    plan = AccessPlan(len(samples), 1, 16, 2, seed=7)
    held = {}
    for epoch in range(2):
        dl.set_epoch(epoch)
        for step, b in enumerate(dl):
            if step % 3 == 0:       # tensors over the batch's buffer, kept
                held[(epoch, step)] = (b["image"][1][5:], b["y"])
    for (epoch, step), (image, y) in held.items():
        ids = plan.batches(0, epoch)[step]
        np.testing.assert_array_equal(image.numpy(), samples[ids[1]]["image"][5:])
        np.testing.assert_array_equal(y.numpy()[:, 0], ids)
    s = dl.stats()["batch_buffers"]
    # live at once: the held batches, the staging area, the one being built and the
    # loop's current and previous
    assert s["reused"] > 0 and s["allocated"] <= len(held) + prefetch + 4, s
    dl.close()
