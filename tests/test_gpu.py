"""The CUDA paths, on a machine with a GPU (skipped without one: CI has none).

Run there with ``pytest tests/test_gpu.py``: nvjpeg decode from the pinned staging
buffer (``BatchDecodeCropFlip``), batches in pinned memory (``pin_memory=True``) copied
to the device with ``non_blocking=True`` while the device is busy, in every mode, after
a transform and from transform workers, and gradient reduction over NCCL under real
torchrun.  "Busy": ``torch.cuda._sleep`` queues a kernel that spins, a stand-in for the
model's kernels, so a copy runs long after the loop has dropped its batch and the
loader has gathered the next ones: a host buffer handed on too early shows as wrong
samples on the device whatever the timing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import forebay  # noqa: E402
from forebay.torch import BatchDecodeCropFlip, DataLoader, Pipeline, store_settings  # noqa: E402
from conftest import run_torchrun, say  # noqa: E402
from test_workers import _epoch, _jpeg_dataset  # noqa: E402

ROWS, ROW = 96, 1 << 18          # 96 samples of 1 MiB: each row filled with its id
BUSY = 50_000_000                # device cycles spun before each copy (~25 ms)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("pin") / "rows.fb"
    # the label first: in a gathered batch it lies at the buffer's start, the rows after
    forebay.write_dataset(path, ({"label": np.int64(i), "x": np.full(ROW, i, np.float32)}
                                 for i in range(ROWS)))
    return path


# ------------------------------------------------------------------------------ decode

def test_the_batched_imagenet_transform_on_a_gpu(tmp_path):
    """The CUDA path (nvjpeg through torchvision, pinned staging): the CPU path's crops
    and flips, the same tensors from samples lent by the store (views=True)."""
    pytest.importorskip("torchvision")
    path = _jpeg_dataset(tmp_path)
    cpu = _epoch(path, batch_transform=BatchDecodeCropFlip(224, device="cpu"))
    gpu = _epoch(path, batch_transform=BatchDecodeCropFlip(224, device="cuda"),
                 pin_memory=True)
    lent = _epoch(path, batch_transform=BatchDecodeCropFlip(224, device="cuda"), views=True)
    assert len(cpu) == len(gpu) == len(lent) == 3
    for a, b, c in zip(cpu, gpu, lent):
        assert b["image"].is_cuda and b["image"].shape == (4, 3, 224, 224)
        assert b["image"].dtype == torch.uint8 and b["label"].is_cuda
        assert torch.equal(a["label"], b["label"].cpu())
        assert torch.equal(b["image"], c["image"]) and torch.equal(b["label"], c["label"])
        want, got = a["image"].float(), b["image"].cpu().float()
        diff = (want - got).abs().mean((1, 2, 3))   # up to 2.03 levels on an H100
        assert (diff < 4.0).all(), f"nvjpeg against Pillow, mean levels per image: {diff}"
        assert ((want.flip(-1) - got).abs().mean((1, 2, 3)) > 10.0).all()


class FreshStaging:
    """BatchDecodeCropFlip with a new pinned staging buffer for every batch."""

    def __call__(self, batch):
        return BatchDecodeCropFlip(224, device="cuda")(batch)


def _busy_epochs(path, transform, epochs: int = 3) -> list:
    dl = DataLoader(path, 4, comm=None, seed=1, epochs=epochs, store="preload",
                    pipeline=Pipeline(views=True, batch_transform=transform, prefetch=2))
    out = []
    for epoch in range(epochs):
        dl.set_epoch(epoch)
        for b in dl:
            torch.cuda._sleep(BUSY)
            out.append(b)
    dl.close()
    torch.cuda.synchronize()
    return out


def test_the_gpu_decode_refills_its_staging_only_after_the_device_read_it(tmp_path):
    """The staging buffer is reused across steps (batches decoded ahead, the device
    busy after each): every batch is the one a fresh buffer gives, bit for bit."""
    pytest.importorskip("torchvision")
    path = _jpeg_dataset(tmp_path)
    reused = _busy_epochs(path, BatchDecodeCropFlip(224, device="cuda"))
    fresh = [_busy_epochs(path, FreshStaging()) for _ in range(2)]
    assert len(reused) == 9
    for k, (a, b, c) in enumerate(zip(reused, *fresh)):
        assert torch.equal(b["image"], c["image"]), f"batch {k}: nvjpeg is not deterministic"
        worst = (a["image"].int() - b["image"].int()).abs().max()
        assert torch.equal(a["image"], b["image"]), f"batch {k}: off by up to {worst} levels"
        assert torch.equal(a["label"], b["label"])


# ------------------------------------------------------------------------ pinned batches

def _labels(path, mode: str, **kw) -> list:
    dl = DataLoader(path, 8, comm=None, seed=0, store=store_settings(mode, ram_bytes=200 << 20),
                    **kw)
    out = [b["label"].clone() for b in dl]
    dl.close()
    return out


def _copied_while_busy(dl) -> "tuple[list, list]":
    """Every batch's rows copied to the device (``non_blocking=True``) behind a spinning
    kernel, its labels kept on the host (a copy: the batch itself is dropped, as a
    training loop drops it); and whether each batch's host tensors were pinned."""
    on_device, pinned = [], []
    for b in dl:
        pinned.append(all(b[k].is_pinned() for k in ("x", "label")))
        torch.cuda._sleep(BUSY)
        on_device.append({"x": b["x"].to("cuda", non_blocking=True),
                          "label": b["label"].clone()})
    torch.cuda.synchronize()
    return on_device, pinned


def _assert_intact(got: list, want: list) -> None:
    assert len(got) == len(want) == ROWS // 8
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g["label"], w), f"batch {k}: {g['label'].tolist()}"
        rows = g["x"][:, ::4096].cpu()
        assert torch.equal(rows, w.float()[:, None].expand_as(rows)), \
            f"batch {k}: rows hold {rows[:, 0].tolist()}, not {w.tolist()}"
        assert torch.equal(g["x"], g["x"][:, :1].expand_as(g["x"]))


@pytest.mark.parametrize("mode", ["preload", "direct", "clairvoyant"])
def test_pinned_batches_reach_a_busy_device_intact(rows, mode):
    """``pin_memory=True``: batches gathered into pinned memory, copied without waiting;
    the loader never gathers a later batch into memory a queued copy has yet to read."""
    want = _labels(rows, mode)
    dl = DataLoader(rows, 8, comm=None, seed=0, store=store_settings(mode, ram_bytes=200 << 20),
                    pipeline=Pipeline(pin_memory=True, prefetch=3))
    got, pinned = _copied_while_busy(dl)
    dl.close()
    assert all(pinned)
    _assert_intact(got, want)


def halve(s):
    """A per-sample transform (module level: spawned workers import it)."""
    return {"x": torch.from_numpy(np.array(s["x"])) * 0.5 * 2, "label": int(s["label"])}


def as_tensors(batch):
    """A collate_fn over the whole batch."""
    return {"x": torch.from_numpy(batch.field("x").stacked().copy()),
            "label": torch.from_numpy(batch.field("label").stacked().copy())}


@pytest.mark.parametrize("kw", [dict(transform=halve), dict(transform=halve, workers=2),
                                dict(collate_fn=as_tensors)],
                         ids=["transform", "workers", "collate_fn"])
def test_pin_memory_pins_what_transforms_workers_and_collate_fn_return(rows, kw):
    want = _labels(rows, "direct")
    dl = DataLoader(rows, 8, comm=None, seed=0, store="direct",
                    pipeline=Pipeline(pin_memory=True, **kw))
    got, pinned = _copied_while_busy(dl)
    dl.close()
    assert all(pinned)
    _assert_intact(got, want)


# ------------------------------------------------------------------------------- NCCL

def rank_nccl(path: str) -> None:
    """A loader and a DistributedOptimizer on the GPU: NCCL for the gradients (the
    backend forebay.reduce picks where CUDA is present), gloo for the loader's
    agreement; the model the one plain SGD trains (a world of one: the average is the
    rank's own gradient)."""
    import torch.distributed as dist

    import forebay.reduce as fr

    rank, world = fr.init_process_group()
    assert dist.get_backend() == "nccl", dist.get_backend()
    dl = DataLoader(path, 8, seed=0, pipeline=Pipeline(pin_memory=True))
    torch.manual_seed(0)
    ours = torch.nn.Linear(ROW, 4).cuda()
    ref = copy.deepcopy(ours)
    start = ours.weight.detach().clone()
    opt = fr.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                  ours.named_parameters())
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = 0
    for b in dl:
        x = b["x"].to("cuda", non_blocking=True) / ROWS
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            model(x).pow(2).mean().backward()
        opt.step()
        ropt.step()
        steps += 1
    same = all(torch.allclose(p, q, rtol=0, atol=1e-6)
               for p, q in zip(ours.parameters(), ref.parameters()))
    moved = not torch.equal(start, ours.weight.detach())
    say(f"RES rank={rank} world={world} steps={steps} same={same} moved={moved}")
    opt.close()
    dl.close()


def test_gradients_over_nccl_under_torchrun(rows):
    p = run_torchrun(1, rank_nccl, rows, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    res = [line for line in p.stdout.splitlines() if line.startswith("RES ")]
    assert res == [f"RES rank=0 world=1 steps={ROWS // 8} same=True moved=True"], \
        p.stdout[-3000:] + p.stderr[-3000:]


# --------------------------------------------------------------------- model repository

def _net_on_gpu(seed: int):
    """Float32 weights, a bfloat16 buffer and a bool buffer (the paths that copy
    through a staging buffer), on the GPU."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    m.register_buffer("scale", torch.randn(64).to(torch.bfloat16))
    m.register_buffer("mask", torch.rand(33) > 0.5)
    return m.cuda()


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _round_trip(repo) -> None:
    model = _net_on_gpu(0)
    repo.save("net", model)
    fresh = _net_on_gpu(1)
    assert not _same(model, fresh)
    repo.load("net", into=fresh)                     # in place, into GPU tensors
    assert _same(model, fresh) and all(t.is_cuda for t in fresh.state_dict().values())
    sd = repo.load("net", device="cuda")
    want = model.state_dict()
    assert sd.keys() == want.keys()
    assert all(t.is_cuda and t.dtype == want[k].dtype and torch.equal(t, want[k])
               for k, t in sd.items())


def test_a_gpu_model_saves_and_loads_bit_exact_in_a_local_repository(tmp_path):
    pytest.importorskip("lmdb")
    pytest.importorskip("msgpack")
    import forebay.models as fm

    repo = fm.open_repository(f"file://{tmp_path / 'repo'}")
    _round_trip(repo)
    repo.close()


def test_a_gpu_model_loads_bit_exact_from_a_provider(tmp_path):
    """Over TCP on 127.0.0.1: each tensor bound for the GPU is received into the
    pinned staging buffer, verified, then copied, the buffer reused for the next."""
    pytest.importorskip("lmdb")
    pytest.importorskip("msgpack")
    import forebay.models as fm
    from test_models_remote import TOKEN, _serve, _stop

    p, url = _serve(tmp_path, f"file://{tmp_path / 'store'}")
    try:
        repo = fm.open_repository(url, token=TOKEN)
        _round_trip(repo)
        repo.close()
    finally:
        _stop(p)


# ----------------------------------------------------------------- training checkpoints

def _busy_step(model, opt) -> None:
    """One Adam step behind a spinning kernel: the update lands long after the call."""
    x = torch.randn(32, 256, device="cuda")
    torch.cuda._sleep(BUSY)
    loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _optim_tensors(opt) -> list:
    return [t for st in opt.state_dict()["state"].values() for t in st.values()
            if isinstance(t, torch.Tensor)]


def test_a_checkpoint_of_a_gpu_model_is_the_state_at_save_while_training_goes_on(tmp_path):
    """``Checkpoint.save()`` returns once the state is staged; the steps queued on the
    device right after it update the weights and Adam's moments in place while the save
    is written.  The version restored is the state at ``save()``, bit for bit, on the GPU,
    the CUDA generator's position included."""
    pytest.importorskip("lmdb")
    pytest.importorskip("msgpack")
    from forebay.torch import Checkpoint

    repo = f"file://{tmp_path / 'ck'}"
    model = _net_on_gpu(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        _busy_step(model, opt)
    ckpt = Checkpoint(repo, model=model, optimizer=opt)
    ckpt.step()
    ckpt.step()
    _busy_step(model, opt)           # queued behind the spin when save() stages
    ckpt.save()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want_opt = [t.clone() for t in _optim_tensors(opt)]
    next_draw = torch.randn(8, device="cuda")
    for _ in range(3):
        _busy_step(model, opt)       # in place, while the save is written
    ckpt.close()
    assert not _same_as(model, want)

    fresh = _net_on_gpu(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    again = Checkpoint(repo, model=fresh, optimizer=fresh_opt)
    assert again.restore() == 2
    assert _same_as(fresh, want)
    got_opt = _optim_tensors(fresh_opt)
    assert len(got_opt) == len(want_opt) > 0
    assert all(g.device == w.device and torch.equal(g, w) for g, w in zip(got_opt, want_opt))
    assert all(t.is_cuda for t in fresh.state_dict().values())
    assert torch.equal(torch.randn(8, device="cuda"), next_draw)
    again.close()


def _same_as(model, want: dict) -> bool:
    sd = model.state_dict()
    return sd.keys() == want.keys() and all(
        sd[k].is_cuda and torch.equal(sd[k], want[k]) for k in sd)


def rank_ddp_checkpoint(path: str, repo: str, out: str, stop: str) -> None:
    """DDP over NCCL with a Checkpoint every 3 steps (its own gloo group): ``stop_at``
    > 0 trains from scratch and dies after that step; 0 restores and trains to the end.
    Writes the labels of each step run and the final weights to ``out``."""
    import torch.distributed as dist

    import forebay.reduce as fr
    from forebay.torch import Checkpoint

    stop_at = int(stop)
    fr.init_process_group()
    assert dist.get_backend() == "nccl", dist.get_backend()
    torch.manual_seed(0)
    net = torch.nn.Linear(ROW, 4).cuda()
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dl = DataLoader(path, 8, seed=0, epochs=2, pipeline=Pipeline(pin_memory=True))
    ckpt = Checkpoint(repo, loader=dl, model=model, optimizer=opt, every_steps=3)
    ckpt.restore()
    seen = []
    for epoch in range(dl.epoch, 2):
        dl.set_epoch(epoch)
        for b in dl:
            x = b["x"].to("cuda", non_blocking=True) / ROWS
            opt.zero_grad()
            (model(x).pow(2).mean() + 0.01 * torch.randn((), device="cuda")).backward()
            opt.step()
            seen.append(b["label"].tolist())
            ckpt.step()
            if stop_at and ckpt.step_count == stop_at:
                ckpt.wait()
                break
        else:
            continue
        break
    ckpt.close()
    torch.save({"seen": seen, "w": net.weight.detach().cpu(), "steps": ckpt.step_count}, out)
    say(f"RES steps={ckpt.step_count}")
    dl.close()
    dist.destroy_process_group()


def test_a_ddp_job_over_nccl_resumes_from_its_checkpoint_under_torchrun(rows, tmp_path):
    """The job dies after step 16 (saved at 15); the resubmitted job restores and ends
    with the uninterrupted job's weights, the batches after step 15 the same."""
    pytest.importorskip("lmdb")
    pytest.importorskip("msgpack")
    runs = {}
    for name, repo, stop in (("whole", "a", 0), ("died", "b", 16), ("resumed", "b", 0)):
        out = tmp_path / f"{name}.pt"
        p = run_torchrun(1, rank_ddp_checkpoint, rows, f"file://{tmp_path / repo}",
                         str(out), stop, timeout=240,
                         env={"RANK_MAIN_EXIT_AT_ONCE": "1"})
        assert p.returncode == 0, name + ": " + p.stdout[-3000:] + p.stderr[-4000:]
        runs[name] = torch.load(out)
    steps = 2 * ROWS // 8
    assert runs["whole"]["steps"] == runs["resumed"]["steps"] == steps
    assert runs["died"]["seen"] == runs["whole"]["seen"][:16]
    assert runs["resumed"]["seen"] == runs["whole"]["seen"][15:]
    assert torch.equal(runs["resumed"]["w"], runs["whole"]["w"])
