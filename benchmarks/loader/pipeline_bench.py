"""The preprocessing pipeline from the first batch (issue W): each contender a fresh
job (a new Python process, the data's pages evicted first when run as root), timed
from building its loader: the first batch, epoch 1 with the start-up, and the warm
epochs, side by side with the pipelines a user would pick instead:

* torch DataLoader over the ImageFolder tree (one file read per sample), shuffled,
  ``num_workers=W``, persistent workers, prefetch factor 4, started by fork (Linux's
  default) and by spawn;
* SPDL 0.8 (Meta's thread-based pipeline): the file read and the transform in one
  stage with ``concurrency=W`` on a thread pool, then batching and collation (a new
  pipeline each epoch, over the epoch's shuffled order);
* torchdata.nodes 0.11: the same stage on a ``ParallelMapper`` of W threads or of W
  forked processes, then ``Batcher``, collation and a ``Prefetcher``;
* NVIDIA DALI 2.4 on the CPU (decode only): its file reader, its fused decode and
  random crop (only the crop's region decoded), resize and flip, on W threads;
* forebay direct and preload (and clairvoyant, "auto" only) with ``workers=W`` and the
  default ``worker_start="auto"``
  (and, for comparison, ``"spawn"``, the default before, and ``"thread"`` on the
  Python workload, where threads are the wrong choice).

Two workloads over the same real JPEGs (``forebay synth imagenet --encode jpeg``, ~78 KB):

* ``decode``: JPEG decode, random-resized crop to 224, flip
  (``forebay.torch.DecodeCropFlip``): the time is in C code that releases the GIL.
  forebay's contenders decode only the crop's rows and columns (``forebay._jpeg``,
  where built); the peers decode the whole image with Pillow
  (``DecodeCropFlip(decoder="pillow")``, the bytes torchvision's ``ImageFolder`` and
  ``RandomResizedCrop`` on Pillow give, and the same bytes as forebay's); "torch
  DataLoader (fork) + forebay's decode" (not a peer) is torch's loader with forebay's
  transform, to tell the pipeline's share from the decoder's;
* ``python``: a GIL-bound transform (a Python loop over 16,384 bytes of each file).

Rates count distinct samples only (forebay fills its last batch with repeats; torch's
is short): an epoch is ``samples / seconds`` for everyone.  CPU per image counts the
job's process and its live descendants (workers, a fork server's children), read from
/proc at each epoch's end; epoch 1's includes the loader's start-up.  Rounds interleave the
contenders in rotating order; ratios are to the best peer of the same round (min and
median over rounds).

    PYTHONPATH=/tmp/peerlib python benchmarks/loader/pipeline_bench.py \\
        --out /tmp/pipe --samples 3000 --workers 2 --rounds 3

Peers left out when they are not importable: SPDL and torchdata.nodes (``pip install
--no-deps --target /tmp/peerlib spdl==0.8.0 spdl-core==0.8.0 spdl-io==0.8.0
torchdata==0.11.0``), DALI on the CPU, the decode workload only (``pip install --target
/tmp/dalilib nvidia-dali-cuda120==2.4.0``, then that folder's numpy removed, and
``PYTHONPATH=/tmp/peerlib:/tmp/dalilib``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import evict, files_under, jpeg_dataset, machine, tree_cpu_s  # noqa: E402

from forebay.torch import DecodeCropFlip  # noqa: E402

PEERS = ("torch DataLoader (fork)", "torch DataLoader (spawn)", "SPDL (threads)",
         "torchdata.nodes (threads)", "torchdata.nodes (fork)", "DALI (CPU)")
#: what each peer needs importable (left out where it is not)
NEEDS = {"SPDL (threads)": "spdl.pipeline", "torchdata.nodes (threads)": "torchdata.nodes",
         "torchdata.nodes (fork)": "torchdata.nodes", "DALI (CPU)": "nvidia.dali"}


class PyWork:
    """A GIL-bound transform: a Python loop over the first 16,384 bytes of the file
    (a checksum and a 16-bin histogram), ~1 ms a sample."""

    def __call__(self, sample: dict) -> dict:
        raw = sample["image"]
        data = raw.tobytes()[:16384] if hasattr(raw, "tobytes") else raw[:16384]
        hist = [0] * 16
        acc = 0
        for b in data:
            hist[b >> 4] += 1
            acc = (acc * 31 + b) & 0xFFFFFFFF
        hist[0] ^= acc & 0xFF
        return {"image": torch.tensor(hist, dtype=torch.int32), "label": int(sample["label"])}


#: forebay's transforms; the peers decode with Pillow, as torchvision's ImageFolder and
#: RandomResizedCrop do (the same bytes: DecodeCropFlip checks it)
TRANSFORMS = {"decode": DecodeCropFlip(224), "python": PyWork()}
PEER_TRANSFORMS = {"decode": DecodeCropFlip(224, decoder="pillow"), "python": PyWork()}
#: not a peer: torch's DataLoader with forebay's transform (the pipeline's share apart)
REGION_IN_TORCH = "torch DataLoader (fork) + forebay's decode"


def transform_for(name: str, workload: str):
    return (PEER_TRANSFORMS if name in PEERS else TRANSFORMS)[workload]


class Folder(torch.utils.data.Dataset):
    """torchvision's ImageFolder in spirit: one file read per sample, then the
    transform."""

    def __init__(self, items: list, transform) -> None:
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        path, label = self.items[i]
        return self.transform({"image": Path(path).read_bytes(), "label": label})


def _items(src: Path) -> list:
    return [(str(f), i % 10) for i, f in enumerate(sorted(src.rglob("*.JPEG")))]


def _timed(batches_of_epoch, epochs: int, t0: float, c0: float) -> dict:
    """First batch and epoch times from ``t0`` (the loader's construction began), and
    the CPU seconds of each epoch (this process and its workers) from ``c0`` (the CPU
    seconds at ``t0``: epoch 1's include the loader's start-up)."""
    first = None
    times, cpu = [], []
    start = t0
    for e in range(epochs):
        for _ in batches_of_epoch(e):
            if first is None:
                first = time.perf_counter() - t0
        now, c = time.perf_counter(), tree_cpu_s()
        times.append(now - start)
        cpu.append(c - c0)
        start, c0 = now, c
    return {"first_batch": first, "epochs": times, "cpu": cpu}


def job(a: argparse.Namespace) -> dict:
    """One contender in this (fresh) process."""
    src, packed = a.out / f"jpeg-{a.samples}", a.out / f"jpeg-{a.samples}.fb"
    name, T, w = a.job, transform_for(a.job, a.workload), a.workers
    c0 = tree_cpu_s()
    if name.startswith("torch DataLoader"):
        ctx = "spawn" if "spawn" in name else "fork"
        t0 = time.perf_counter()
        dl = torch.utils.data.DataLoader(
            Folder(_items(src), T), batch_size=a.batch, shuffle=True,
            generator=torch.Generator().manual_seed(0), num_workers=w,
            persistent_workers=True, prefetch_factor=4, multiprocessing_context=ctx)
        return _timed(lambda e: dl, a.epochs, t0, c0)
    if name.startswith("SPDL"):
        from spdl.pipeline import PipelineBuilder

        t0 = time.perf_counter()
        items = _items(src)
        rng = np.random.default_rng(0)

        def load(i: int) -> dict:
            path, label = items[i]
            return T({"image": Path(path).read_bytes(), "label": label})

        def epoch(e: int):
            p = (PipelineBuilder().add_source(rng.permutation(len(items)).tolist())
                 .pipe(load, concurrency=w).aggregate(a.batch)
                 .pipe(torch.utils.data.default_collate).add_sink(4).build(num_threads=w))
            with p.auto_stop():
                yield from p
        return _timed(epoch, a.epochs, t0, c0)
    if name.startswith("torchdata"):
        return _torchdata_nodes(a, "process" if "fork" in name else "thread", c0)
    if name.startswith("DALI"):
        return _dali(a, c0)
    from forebay.torch import DataLoader, Pipeline, store_settings

    mode, start = name.split()[1], name.split("(")[1].rstrip(")")
    # "preload-overlap": training starts while the preload loads (a local disk's
    # default is to load first)
    store = store_settings("preload", overlap=True) if mode == "preload-overlap" else mode
    t0 = time.perf_counter()
    dl = DataLoader(packed, a.batch, comm=None, seed=0, epochs=a.epochs, progress=False,
                    store=store, pipeline=Pipeline(transform=T, workers=w, worker_start=start))

    def fb_epoch(e: int):
        dl.set_epoch(e)
        return iter(dl)
    out = _timed(fb_epoch, a.epochs, t0, c0)
    out["worker_start"] = dl.stats()["worker_start"]
    dl.close()
    return out


def _torchdata_nodes(a: argparse.Namespace, method: str, c0: float) -> dict:
    """torchdata.nodes: the file read and the transform on a ``ParallelMapper`` of
    ``W`` threads or forked processes, then batching, collation and a prefetcher of 4
    batches; the ``Loader`` re-iterated each epoch over a new shuffle."""
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, Prefetcher, SamplerWrapper

    t0 = time.perf_counter()
    folder = Folder(_items(a.out / f"jpeg-{a.samples}"), transform_for(
        f"torchdata.nodes ({'fork' if method == 'process' else 'threads'})", a.workload))
    sampler = torch.utils.data.RandomSampler(folder, generator=torch.Generator().manual_seed(0))
    node = ParallelMapper(SamplerWrapper(sampler), folder.__getitem__, num_workers=a.workers,
                          method=method,
                          multiprocessing_context="fork" if method == "process" else None)
    node = Prefetcher(Mapper(Batcher(node, a.batch, drop_last=False),
                             torch.utils.data.default_collate), 4)
    loader = Loader(node)
    return _timed(lambda e: loader, a.epochs, t0, c0)


def _dali(a: argparse.Namespace, c0: float) -> dict:
    """NVIDIA DALI's pipeline on the CPU (no GPU here): its file reader (shuffled),
    its fused decode and random crop (``decoders.image_random_crop``: only the crop's
    region is decoded), resize to the size, random flip, on ``W`` threads; the
    decode workload only (a Python transform is not what DALI runs)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    t0 = time.perf_counter()
    items = _items(a.out / f"jpeg-{a.samples}")

    @pipeline_def(batch_size=a.batch, num_threads=a.workers, device_id=None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(files=[f for f, _ in items],
                                        labels=[c for _, c in items], random_shuffle=True,
                                        name="files")
        img = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        img = fn.resize(img, resize_x=224, resize_y=224)
        img = fn.flip(img, horizontal=fn.random.coin_flip())
        return img, labels
    it = DALIGenericIterator([pipe()], ["image", "label"], reader_name="files",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
    return _timed(lambda e: it, a.epochs, t0, c0)


def contenders(workload: str) -> list[str]:
    import importlib.util

    out = [n for n in PEERS if not (n == "DALI (CPU)" and workload != "decode")]
    for name, module in NEEDS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found and name in out:
            out.remove(name)
    for mode in ("direct", "preload"):
        out += [f"forebay {mode} (auto)", f"forebay {mode} (spawn)"]
    out += [f"forebay {mode} ({'thread' if workload == 'python' else 'fork'})"
            for mode in ("direct", "preload")]
    out += [f"forebay {mode} (forkserver)" for mode in ("direct", "preload")]
    out.append("forebay preload-overlap (auto)")
    out.append("forebay clairvoyant (auto)")
    if workload == "decode":
        out.append(REGION_IN_TORCH)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-pipe"))
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3, help="the first includes the start-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="decode,python")
    p.add_argument("--only", default="", help="comma-separated contenders (peers always run)")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job:
        print("RESULT " + json.dumps(job(a)))
        return
    src, packed = jpeg_dataset(a.out, a.samples)
    files = [Path(f) for f, _ in _items(src)] + files_under(packed)
    root = os.geteuid() == 0
    print(f"# {machine()}; {a.samples} JPEGs, batch {a.batch}, {a.workers} workers, "
          f"{a.epochs} epochs a job, {a.rounds} rounds, "
          f"{'pages evicted before each job' if root else 'page cache warm (not root)'}")
    for workload in a.workloads.split(","):
        names = contenders(workload)
        if a.only:
            names = [n for n in names if n in PEERS or n in a.only.split(",")]
        res: dict = {}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if root:
                    evict(files)
                cmd = [sys.executable, __file__, "--job", name, "--workload", workload,
                       "--out", str(a.out), "--samples", str(a.samples), "--workers",
                       str(a.workers), "--batch", str(a.batch), "--epochs", str(a.epochs)]
                p_ = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                line = [x for x in p_.stdout.splitlines() if x.startswith("RESULT ")]
                if p_.returncode or not line:
                    raise SystemExit(f"{name} failed:\n{p_.stderr[-3000:]}")
                res.setdefault(name, []).append(json.loads(line[0][7:]))
        report(workload, names, res, a)


def report(workload: str, names: list[str], res: dict, a: argparse.Namespace) -> None:
    def metric(r: dict, what: str) -> float:
        if what == "first":
            return r["first_batch"]
        if what == "epoch1":
            return r["epochs"][0]
        return statistics.median(r["epochs"][1:])

    print(f"\n## {workload}: seconds (median over rounds) and the best peer's time / "
          f"this one's (min / median over rounds; > 1: faster)")
    print("| contender | first batch | epoch 1 (with start-up) | warm epoch | warm images/s "
          "| vs best peer: first batch | epoch 1 | warm | CPU ms per image: epoch 1 | "
          "warm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    peers = [n for n in names if n in PEERS]
    for name in names:
        cells = []
        for what in ("first", "epoch1", "warm"):
            cells.append(f"{statistics.median(metric(r, what) for r in res[name]):.2f}")
        warm = statistics.median(metric(r, "warm") for r in res[name])
        cells.append(f"{a.samples / warm:,.0f}")
        for what in ("first", "epoch1", "warm"):
            ratios = [min(metric(res[p][k], what) for p in peers) / metric(res[name][k], what)
                      for k in range(len(res[name]))]
            cells.append(f"{min(ratios):.2f} / {statistics.median(ratios):.2f}")
        for first in (True, False):      # CPU of epoch 1 (start-up in it), of warm epochs
            ms = [1e3 * (r["cpu"][0] if first else statistics.median(r["cpu"][1:]))
                  / a.samples for r in res[name]]
            cells.append(f"{statistics.median(ms):.2f}")
        how = res[name][0].get("worker_start")
        label = f"{name} -> {how}" if how and "auto" in name else name
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nPer round (rounds in the order run), seconds: first batch / epoch 1 / warm epoch")
    for name in names:
        print(f"- {name}: " + "; ".join(
            " / ".join(f"{metric(r, w):.3f}" for w in ("first", "epoch1", "warm"))
            for r in res[name]))


if __name__ == "__main__":
    main()
