"""Transform workers (DataLoader(workers=N)): the same tensors whatever N is (random
augmentations included), plan order, resume, and a transform that raises or a worker
that dies fails the batch with an error naming it, without a hang."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forebay  # noqa: E402
from forebay import AccessPlan  # noqa: E402
from forebay.errors import InvalidArgumentError  # noqa: E402
from forebay.torch import (DataLoader, Pipeline, TransformError, releases_gil,  # noqa: E402
                           sample_rng)
from forebay.torch._start import choose_start, fork_hazards, gil_enabled  # noqa: E402

N, BATCH = 60, 8


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "img.fb"
    rng = np.random.default_rng(0)
    forebay.write_dataset(path, ({"img": rng.integers(0, 255, (6, 5 + i % 3, 3), np.uint8),
                                  "label": np.int64(i)} for i in range(N)))
    return path


# transforms live at module level: spawned workers import them by name
def augment(s):
    """A random crop and flip with torch's and NumPy's global generators and the
    sample's own generator, as a torchvision pipeline would."""
    img = torch.from_numpy(np.array(s["img"])).permute(2, 0, 1).float()
    top = int(torch.randint(0, img.shape[1] - 3, ()))
    crop = img[:, top:top + 4, :4]
    if np.random.rand() < 0.5:
        crop = crop.flip(2)
    return {"img": crop + float(sample_rng().normal()), "label": int(s["label"])}


def whole_batch(batch):
    return torch.from_numpy(batch["label"].copy()) * 2


def fails_on_17(s):
    if int(s["label"]) == 17:
        raise ValueError("cannot decode this image")
    return {"label": int(s["label"])}


def dies_on_17(s):
    if int(s["label"]) == 17:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"label": int(s["label"])}


#: set when a test is done with a hung transform (a hung thread of the test's own
#: process would otherwise be left waiting for ever)
RELEASE = threading.Event()


def hangs_on_17(s):
    if int(s["label"]) == 17:
        RELEASE.wait()                       # a deadlocked transform: never returns
    return {"label": int(s["label"])}


def stops_at_once(s):
    # every worker stops on its first sample, before it has sent any result: a
    # worker stopped while a result of its was being received (torch hands a shared
    # tensor over through the sender's own thread) blocks that receive, which no
    # timeout of the loader's covers yet
    os.kill(os.getpid(), signal.SIGSTOP)
    return {"label": int(s["label"])}


def _epochs(path, workers, epochs=2, **kw):
    dl = DataLoader(path, BATCH, epochs=epochs, seed=4, comm=None, store="direct",
                    pipeline=Pipeline(workers=workers, **kw))
    out = []
    try:
        for e in range(epochs):
            dl.set_epoch(e)
            out.append(list(dl))
    finally:
        dl.close()
    return out


def own_rng_only(s):
    """Randomness drawn from the sample's own generator only."""
    img = torch.from_numpy(np.array(s["img"][:, :5])).float()       # 6 x 5 x 3 each
    return {"img": img * float(sample_rng().uniform(0.5, 1.5)), "label": int(s["label"])}


@releases_gil
def own_rng_marked(s):
    """own_rng_only, marked as releasing the GIL (so "auto" runs it on threads)."""
    return own_rng_only(s)


def test_sample_rng_augmentations_are_the_same_in_the_loaders_thread_and_in_workers(images):
    import random

    torch.manual_seed(123)
    random.seed(5)
    before = (torch.get_rng_state(), random.getstate())
    ref = _epochs(images, 0, transform=own_rng_only)
    # the training process's own generators are left alone
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    got = _epochs(images, 2, transform=own_rng_only)
    for a, b in zip(sum(ref, []), sum(got, [])):
        assert torch.equal(a["img"], b["img"]) and torch.equal(a["label"], b["label"])


def test_random_augmentations_give_the_same_tensors_whatever_the_workers(images):
    ref = _epochs(images, 1, transform=augment)
    plan = AccessPlan(N, 1, BATCH, 2, seed=4)
    for e, batches in enumerate(ref):                  # plan order, every batch
        assert [b["label"].tolist() for b in batches] == \
            [x.tolist() for x in plan.batches(0, e)]
    assert not torch.equal(ref[0][0]["img"], ref[1][0]["img"])   # epochs differ
    for workers in (2, 3):
        got = _epochs(images, workers, transform=augment)
        for a, b in zip(sum(ref, []), sum(got, [])):
            assert torch.equal(a["img"], b["img"]) and torch.equal(a["label"], b["label"])


def test_batch_transform_and_resume(images):
    dl = DataLoader(images, BATCH, epochs=1, seed=4, comm=None, store="direct",
                    pipeline=Pipeline(workers=2, batch_transform=whole_batch))
    it = iter(dl)
    first = [next(it) for _ in range(3)]
    state = dl.state_dict()
    it.close()
    dl.close()
    plan = AccessPlan(N, 1, BATCH, 1, seed=4)
    assert [b.tolist() for b in first] == [(x * 2).tolist() for x in plan.batches(0, 0)[:3]]
    again = DataLoader(images, BATCH, epochs=1, seed=4, comm=None, store="direct",
                       pipeline=Pipeline(workers=2, batch_transform=whole_batch))
    again.load_state_dict(state)
    rest = list(again)
    again.close()
    assert [b.tolist() for b in rest] == [(x * 2).tolist() for x in plan.batches(0, 0)[3:]]


@pytest.mark.parametrize("how", ["thread", "forkserver", "spawn"])
def test_every_way_of_running_workers_gives_the_tensors_of_the_loaders_thread(images, how):
    """W items 1-2: threads, processes from a fork server and spawned ones hand out the
    batches of workers=0, in plan order, epoch after epoch."""
    ref = _epochs(images, 0, transform=own_rng_only)
    dl = DataLoader(images, BATCH, epochs=2, seed=4, comm=None, store="preload",
                    pipeline=Pipeline(workers=2, transform=own_rng_only, worker_start=how))
    try:
        assert dl.stats()["worker_start"] == how
        got = []
        for e in range(2):
            dl.set_epoch(e)
            got.append(list(dl))
        if how != "thread":   # the batches' shared-memory buffers are reused, not made anew
            made = dl.stats()["worker_buffers"]
            assert made["allocated"] <= 6 * 2 + 2 and made["reused"] >= 2 * len(dl) - made[
                "allocated"], made
            # and a buffer a worker holds goes by its id: handed over once to each worker
            assert made["by_id"] >= 2 * len(dl) - 2 * made["allocated"], made
    finally:
        dl.close()
    for a, b in zip(sum(ref, []), sum(got, []), strict=True):
        assert torch.equal(a["img"], b["img"]) and torch.equal(a["label"], b["label"])


class MeetOnTheFirstBatch:
    """Each thread that transforms a sample of the first batch waits there until a
    second thread has done so too: a batch made by one thread alone never gets past
    its first sample (the barrier breaks after its timeout)."""

    def __init__(self, first: np.ndarray) -> None:
        self.first = set(first.tolist())
        self.barrier = threading.Barrier(2, timeout=30)
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, s):
        if int(s["label"]) in self.first:
            me = threading.current_thread().name
            with self.lock:
                new = me not in self.seen
                self.seen.add(me)
            if new:
                self.barrier.wait()
        return {"label": int(s["label"])}


def test_threads_share_each_batch_so_the_first_comes_at_their_joint_pace(images):
    """W item 1: on threads, a batch is made in parts, one a thread, and collated in
    its order: the epoch's first batch (the pipeline empty) is ready when the threads
    together have made it, not after one thread made all of it."""
    plan = AccessPlan(N, 1, 6, 1, seed=4)       # 6 divides N: no padded repeats
    meet = MeetOnTheFirstBatch(plan.batches(0, 0)[0])
    dl = DataLoader(images, 6, epochs=1, seed=4, comm=None, store="direct",
                    pipeline=Pipeline(workers=2, transform=meet, worker_start="thread"))
    try:
        got = [b["label"].tolist() for b in dl]
    finally:
        dl.close()
    assert len(meet.seen) == 2
    assert got == [b.tolist() for b in plan.batches(0, 0)]


def test_a_batch_dropped_when_the_threads_close_fails_instead_of_hanging(images):
    """A batch whose parts were still queued when the transform threads closed raises
    naming it, where a wait for it would never end; batches already running finish."""
    from forebay.torch._threads import ThreadWorkers

    started, gate = threading.Semaphore(0), threading.Event()

    def held(s):
        started.release()
        gate.wait(30)
        return {"label": int(s["label"])}

    ds = forebay.open_dataset(images)
    pool = ThreadWorkers(2, held, None, None, seed=0)
    try:
        first = pool.submit(0, 0, ds.get_many(np.arange(8)))
        queued = pool.submit(0, 1, ds.get_many(np.arange(8, 16)))
        assert started.acquire(timeout=30) and started.acquire(timeout=30)  # both running
        pool.close()
        with pytest.raises(TransformError, match="epoch 0 step 1 was dropped before it was "
                                                 "made: the transform workers were closed"):
            queued.result()
    finally:
        gate.set()
    assert first.result()["label"].tolist() == list(range(8))


def sizes_of_results(s):
    """Results of every size: a label, a small float array, a large byte array, a
    bfloat16 value (a dtype NumPy lacks)."""
    i = int(s["label"])
    return {"label": i, "small": torch.full((2, 3), i / 7, dtype=torch.float32),
            "big": torch.full((10_000,), i % 251, dtype=torch.uint8),
            "half": torch.tensor([i / 3], dtype=torch.bfloat16)}


def test_small_results_cross_in_the_message_and_large_ones_in_shared_memory(images):
    """Each tensor a worker hands over as shared memory costs a file, a descriptor
    passed through a socket and a map: labels and other small tensors cross pickled
    (not shared in the training process), large ones in shared memory, every one with
    the values, dtype and shape the loader's own thread gives."""
    ref = _epochs(images, 0, epochs=1, transform=sizes_of_results)[0]
    dl = DataLoader(images, BATCH, epochs=1, seed=4, comm=None, store="preload",
                    pipeline=Pipeline(workers=2, transform=sizes_of_results,
                                      worker_start="forkserver"))
    try:
        got = list(dl)
    finally:
        dl.close()
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        for k in a:
            assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            assert torch.equal(a[k], b[k]), k
        assert not b["label"].is_shared() and not b["small"].is_shared()
        assert b["big"].is_shared()          # 80 KB a batch: mapped, not copied


def test_a_worker_named_a_buffer_it_does_not_hold_says_so_instead_of_reading_another():
    """The loader sends a buffer a worker holds by its id alone, keeping a copy of the
    worker's record; were the two ever to differ, the worker fails the batch naming
    it, never reading some other buffer."""
    from forebay.torch._handover import HeldBuffers
    from forebay.torch._workers import _input_buffer

    rng = np.random.default_rng(0)
    loader, worker = HeldBuffers(3), HeldBuffers(3)
    for bid in rng.integers(1, 7, 200).tolist():        # the same steps, in order
        buf = torch.full((4,), bid, dtype=torch.uint8)
        msg = {"buffer_id": bid} if loader.see(bid) else {"buffer_id": bid, "buffer": buf}
        assert torch.equal(_input_buffer(msg, worker, 0), buf)
    with pytest.raises(TransformError, match="sent buffer 4 by its id, which it does not hold"):
        _input_buffer({"buffer_id": 4}, HeldBuffers(3), 0)
    fresh = HeldBuffers(3)
    _input_buffer({"buffer_id": 9, "buffer": torch.zeros(1)}, fresh, 0)
    with pytest.raises(TransformError, match="which it holds already"):
        _input_buffer({"buffer_id": 9, "buffer": torch.zeros(1)}, fresh, 0)


def test_auto_runs_marked_transforms_on_threads_and_forks_only_a_process_without_threads(
        images):
    """W items 1-2, the stated rule: a transform marked as releasing the GIL runs on
    threads; otherwise processes, forked unless another Python thread runs (then from a
    fork server), and forked anyway when the transform cannot be pickled."""
    def start(transform):
        dl = DataLoader(images, BATCH, comm=None, store="direct",
                        pipeline=Pipeline(workers=1, transform=transform))
        try:
            assert sum(len(b["label"]) for b in dl) == len(dl) * BATCH
            return dl.stats()["worker_start"], dl.worker_start_reason
        finally:
            dl.close()

    assert start(own_rng_marked) == ("thread", "the transform releases the GIL")
    stop = threading.Event()
    user = threading.Thread(target=stop.wait, name="users-own-thread")
    user.start()
    try:
        kind, why = start(own_rng_only)
        assert kind == "forkserver" and "users-own-thread" in why, why
        kind, why = start(lambda s: own_rng_only(s))
        assert kind == "fork" and "cannot be pickled" in why and "users-own-thread" in why
    finally:
        stop.set()
        user.join()
    assert "users-own-thread" not in " ".join(fork_hazards())
    with pytest.raises(InvalidArgumentError, match="cannot mark"):
        releases_gil(len)


def test_without_the_gil_auto_runs_every_transform_on_threads():
    """W item 2: on a free-threaded CPython threads run Python in parallel, so "auto"
    picks them for a GIL-bound transform too; with the GIL the rule above holds."""
    import sysconfig

    assert choose_start("auto", own_rng_only, None, None, gil=False) == (
        "thread", "this Python runs without the GIL (free-threaded)")
    assert choose_start("auto", own_rng_only, None, None, gil=True)[0] in ("fork",
                                                                          "forkserver")
    assert choose_start("fork", own_rng_only, None, None, gil=False) == ("fork", "asked for")
    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        assert gil_enabled()           # a standard build always runs with the GIL


def test_a_free_threaded_python_runs_a_python_transform_on_threads(images):
    import sysconfig

    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("this Python has the GIL (needs a free-threaded build, 3.13t or later)")
    want = choose_start("auto", own_rng_only, None, None)[0]
    assert want == ("thread" if not gil_enabled() else want)
    dl = DataLoader(images, BATCH, comm=None, store="direct",
                    pipeline=Pipeline(workers=2, transform=own_rng_only))
    try:
        assert sum(len(b["label"]) for b in dl) == len(dl) * BATCH
        assert dl.stats()["worker_start"] == want
    finally:
        dl.close()


@pytest.mark.parametrize("how", ["auto", "thread"])
def test_a_transform_that_raises_names_the_sample(images, how):
    with pytest.raises(TransformError, match=r"sample 17 .*ValueError: cannot decode"):
        _epochs(images, 2, epochs=1, transform=fails_on_17, worker_start=how)


def test_a_worker_that_dies_fails_the_batch_instead_of_hanging(images):
    # the batch it held is named when the death is seen while waiting for it; when
    # seen through a result it could not finish sending, the worker is named
    with pytest.raises(TransformError, match=r"transform worker \d \(pid \d+\) died with "
                                             r"exit code -9"):
        _epochs(images, 2, epochs=1, transform=dies_on_17)


def test_a_worker_that_hangs_or_stops_fails_its_batch_after_the_timeout(images):
    """As torch's DataLoader timeout=: a transform that never returns, or a worker that
    is stopped (SIGSTOP), raises naming the worker, its state and the batch."""
    with pytest.raises(TransformError, match=r"transform worker \d \(pid \d+, sleeping\) "
                                             r"returned nothing for 1 s on the batch of epoch "
                                             r"0 step \d+ \(samples .*17"):
        _epochs(images, 2, epochs=1, transform=hangs_on_17, worker_timeout=1,
                worker_start="fork")
    with pytest.raises(TransformError, match=r"\(pid \d+, stopped\) returned nothing"):
        _epochs(images, 2, epochs=1, transform=stops_at_once, worker_timeout=1,
                worker_start="fork")
    # a thread cannot be stopped: it is named and left; the test then lets it go
    RELEASE.clear()
    try:
        with pytest.raises(TransformError, match=r"transform thread forebay-transform_\d "
                                                 r"returned nothing for 1 s on the batch of "
                                                 r"epoch 0 step \d+ \(samples .*17"):
            _epochs(images, 2, epochs=1, transform=hangs_on_17, worker_timeout=1,
                    worker_start="thread")
    finally:
        RELEASE.set()


def test_unpicklable_transforms_and_bad_arguments_are_refused_at_once(images):
    for how in ("spawn", "forkserver"):
        with pytest.raises(InvalidArgumentError, match=f"must be picklable .* by '{how}'"):
            DataLoader(images, BATCH, comm=None,
                       pipeline=Pipeline(workers=2, transform=lambda s: s, worker_start=how))
    with pytest.raises(InvalidArgumentError, match=r"Pipeline\(worker_start=\) must be"):
        Pipeline(workers=2, transform=augment, worker_start="threads")
    with pytest.raises(InvalidArgumentError, match="run a transform"):
        DataLoader(images, BATCH, comm=None, pipeline=Pipeline(workers=2))
    with pytest.raises(InvalidArgumentError, match=r"Pipeline\(workers=\) must be a non-neg"):
        DataLoader(images, BATCH, comm=None, pipeline=Pipeline(workers=-1, transform=augment))
    for bad in (0, -1, float("nan"), "soon", True):
        with pytest.raises(InvalidArgumentError, match="worker_timeout must be"):
            DataLoader(images, BATCH, comm=None,
                       pipeline=Pipeline(workers=1, transform=augment, worker_timeout=bad))


def test_the_reference_imagenet_transform_on_real_jpegs(tmp_path):
    """forebay synth imagenet --encode jpeg -> ingest -> DecodeCropFlip in 2 workers:
    224 x 224 uint8 CHW images, the same tensors as in the loader's own thread."""
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize
    from forebay.torch import DecodeCropFlip

    synthesize("imagenet", tmp_path / "jpg", 12, seed=1, classes=2, encode="jpeg")
    ingest(get_source("imagefolder", tmp_path / "jpg"), tmp_path / "img.fb")
    runs = []
    for workers in (0, 2):
        dl = DataLoader(tmp_path / "img.fb", 4, comm=None, seed=1, store="direct",
                        pipeline=Pipeline(workers=workers, transform=DecodeCropFlip(224)))
        runs.append(list(dl))
        dl.close()
    for a, b in zip(*runs):
        assert a["image"].shape == (4, 3, 224, 224) and a["image"].dtype == torch.uint8
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def _jpeg_dataset(tmp_path):
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    synthesize("imagenet", tmp_path / "jpg", 12, seed=1, classes=2, encode="jpeg")
    ingest(get_source("imagefolder", tmp_path / "jpg"), tmp_path / "img.fb")
    return tmp_path / "img.fb"


def _epoch(path, **kw):
    dl = DataLoader(path, 4, comm=None, seed=1, store="direct", pipeline=Pipeline(**kw))
    out = list(dl)
    dl.close()
    return out


def test_the_batched_imagenet_transform_makes_the_per_sample_crops_and_flips(tmp_path):
    """BatchDecodeCropFlip (here on the CPU: Pillow decodes) as a batch_transform: the
    crops and flips DecodeCropFlip makes per sample (the pixels differ by the
    resampling: a fraction of a level on average, against tens for the mirror image),
    the labels, and the same tensors in the loader's thread, in 2 workers, and from
    samples lent by the store (views=True)."""
    from forebay.torch import BatchDecodeCropFlip, DecodeCropFlip

    path = _jpeg_dataset(tmp_path)
    per_sample = _epoch(path, transform=DecodeCropFlip(224))
    runs = [_epoch(path, batch_transform=BatchDecodeCropFlip(224, device="cpu"),
                   workers=w) for w in (0, 2)]
    runs.append(_epoch(path, batch_transform=BatchDecodeCropFlip(224, device="cpu"),
                       views=True))
    for want, got, *others in zip(per_sample, *runs):
        assert got["image"].shape == (4, 3, 224, 224) and got["image"].dtype == torch.uint8
        for other in others:
            assert torch.equal(got["image"], other["image"])
            assert torch.equal(got["label"], other["label"])
        assert torch.equal(got["label"], want["label"]) and got["label"].dtype == torch.int64
        a, b = want["image"].float(), got["image"].float()
        assert ((a - b).abs().mean((1, 2, 3)) < 1.0).all()
        assert ((a.flip(-1) - b).abs().mean((1, 2, 3)) > 10.0).all()


def test_a_script_without_a_main_guard_works_or_is_told_why_its_workers_die(tmp_path):
    """X item 13 / W item 4: a script that builds the loader at its top level works
    with the default start (forked workers import nothing); with spawned workers, or
    ones from a fork server, which import the main script, each worker dies while
    starting, and the error said only "died with exit code 1"."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np, forebay
        from forebay.torch import DataLoader, Pipeline

        def double(s):
            return {"x": s["x"] * 2}

        forebay.write_dataset("d.fb", ({"x": np.arange(3) + i} for i in range(16)),
                              overwrite=True)
        dl = DataLoader("d.fb", 4, comm=None,
                        pipeline=Pipeline(transform=double, workers=1,
                                          worker_start=sys.argv[1]))
        print(sum(int(b["x"].sum()) for b in dl), dl.stats()["worker_start"])
    """))

    def run(how):
        return subprocess.run([sys.executable, str(script), how], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    p = run("auto")
    assert p.returncode == 0 and p.stdout.split() == [str(2 * (16 * 3 * 15 // 2 + 16 * 3)),
                                                      "fork"], p.stderr
    for how, what in (("spawn", "a fresh Python"), ("forkserver", "forked from a fork server")):
        p = run(how)
        assert p.returncode == 1
        last = p.stderr.strip().splitlines()[-1]
        assert "died with exit code 1 while starting, before it took a batch" in last, last
        assert f"{what}, first imports your script {script}" in last, last
        assert '__name__ == "__main__"' in last, last
