"""A CPU-bound pipeline (issue J): real JPEGs decoded, random-resized-cropped to 224 and
flipped (forebay.torch.DecodeCropFlip, Pillow) by the same transform in every
contender, side by side in one run:

* torch DataLoader over the ImageFolder tree (one file read per sample), shuffled,
  ``num_workers=W``, persistent workers, prefetch factor 4;
* forebay preload (the packed dataset in memory) and direct (read from the packed
  shards), ``workers=W``;
* mosaicml-streaming (``StreamingDataset`` over local MDS shards) and litdata
  (``StreamingDataset`` over ``optimize`` chunks, ``StreamingDataLoader``), the same
  transform in their ``__getitem__``, ``num_workers=W``, when importable (see
  ``peers_bench.py`` for how to install them beside the pinned torch);
* the decode ceiling: the transform alone over every image in one process, divided by
  W (perfect parallel scaling, no loading at all).

With ``--device cuda`` every batch goes on to the GPU (``pin_memory=True``,
``non_blocking=True`` copies; an epoch ends when the device is done with it); "forebay
direct unpinned" runs the CPU pipeline with ``pin_memory=False`` (batches copied from
pageable memory: what pinning the workers' output costs); and three contenders decode
on the GPU instead (nvjpeg through ``torchvision.io.decode_jpeg``, one call per batch):

* torch DataLoader + nvjpeg: W workers read the files' bytes (pinned); the training
  process decodes the batch and crops and flips each image with torchvision's
  ``v2.RandomResizedCrop(224)`` and ``v2.RandomHorizontalFlip``, as a user would write it;
* forebay preload / direct + nvjpeg: ``views=True`` and
  ``batch_transform=BatchDecodeCropFlip(224, device="cuda")`` in the loader's prefetch
  thread (the samples' bytes copied once, into a pinned staging buffer).

NVIDIA DALI, the usual GPU decode pipeline, is not compared: it is not installed where
this ran (no package index reachable from the GPU machine).

One process, images per second over an epoch (those really processed: forebay fills its
last batch with repeats) after a warm-up epoch, files in the page cache, contenders in
rotating order, repeated.  W above the core count oversubscribes.

    python benchmarks/loader/decode_bench.py --out /tmp/decode --samples 1000 --workers 2,4
    python benchmarks/loader/decode_bench.py --out /tmp/decode --samples 4096 --workers 8 --device cuda

A slow shared file system (root only): ``--throttle MBPS[,IOPS]`` caps this process's
and its workers' reads from the data's disk (a block-I/O cgroup), and
``--evict-each-epoch`` empties the page cache of the contender's files before every
epoch, so each epoch reads them from the capped disk (pages a process keeps mapped stay:
forebay direct's workers map the packed shards).  Preload's set-up (reading the packed
dataset once, at the loader's creation) is then reported beside the epoch rates, and
the table gives the bytes each contender read from the device per image processed
(the cgroup's count over all its rounds and epochs, its set-up included).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import (ThrottledDevice, evict, files_under, jpeg_dataset, machine,  # noqa: E402
                     throttled)

import forebay  # noqa: E402
from forebay.torch import BatchDecodeCropFlip, DataLoader, DecodeCropFlip, Pipeline  # noqa: E402

T = DecodeCropFlip(224)


class Folder(torch.utils.data.Dataset):
    """torchvision's ImageFolder in spirit: one file read per sample, then the transform."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return T({"image": path.read_bytes(), "label": label})


class FolderBytes(Folder):
    """One file read per sample, its bytes as a uint8 tensor (decoded on the GPU)."""

    def __getitem__(self, i):
        path, label = self.items[i]
        return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), label


def bytes_collate(samples):
    return [s[0] for s in samples], torch.tensor([s[1] for s in samples])


def _torch_nvjpeg(device):
    """The training process's step for torch DataLoader + nvjpeg: decode the batch in
    one call, then torchvision's crop and flip per image."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms import v2

    aug = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])

    def step(batch):
        data, labels = batch
        images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        return {"image": torch.stack([aug(im) for im in images]),
                "label": labels.to(device, non_blocking=True)}
    return step


def _on_device(it, device):
    """Batches of a CPU pipeline copied to the device as a training loop would."""
    for b in it:
        yield {k: v.to(device, non_blocking=True) for k, v in b.items()}


def _peer_classes():
    """The peers' datasets with the transform, as module-level classes (spawned workers
    unpickle them by name); None for a peer that is not installed."""
    import importlib.util
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ts = tl = None
    if importlib.util.find_spec("streaming") is not None:
        from peers_bench import _streaming

        class TStreaming(_streaming().StreamingDataset):
            def __getitem__(self, i):
                s = super().__getitem__(i)
                return T({"image": s["image"], "label": s["label"]})
        ts = TStreaming
    if importlib.util.find_spec("litdata") is not None:
        import litdata

        class TLit(litdata.StreamingDataset):
            def __getitem__(self, i):
                return T(super().__getitem__(i))
        tl = TLit
    return ts, tl


TStreaming, TLit = _peer_classes()
for _c in (TStreaming, TLit):
    if _c is not None:
        _c.__qualname__ = _c.__name__        # importable by name from this module


def _peer_datasets(src: Path, out: Path, items) -> dict:
    """The JPEGs as MDS shards and litdata chunks, and a factory of each peer's dataset
    with the transform; {} for a peer that is not installed."""
    made: dict = {}
    if TStreaming is not None:
        from peers_bench import _streaming
        mds = out / f"{src.name}-mds"
        if not mds.exists():
            with _streaming().MDSWriter(out=str(mds), columns={"image": "bytes",
                                                               "label": "int"},
                                        size_limit=64 << 20) as w:
                for f, label in items:
                    w.write({"image": f.read_bytes(), "label": label})
        made["mosaicml-streaming"] = lambda bs: TStreaming(local=str(mds), shuffle=True,
                                                           shuffle_seed=0, batch_size=bs)
    if TLit is not None:
        import litdata
        lit = out / f"{src.name}-litdata"
        if not lit.exists():
            litdata.optimize(fn=_lit_jpeg, inputs=[(str(f), label) for f, label in items],
                             output_dir=str(lit), chunk_bytes="64MB", num_workers=1)
        made["litdata"] = lambda bs: TLit(str(lit), shuffle=True, seed=0)
    return made


def _lit_jpeg(arg):
    path, label = arg
    return {"image": Path(path).read_bytes(), "label": label}


def epoch_rate(make, epochs: int, cold: "list[Path] | None" = None,
               device: "ThrottledDevice | None" = None,
               gpu: bool = False) -> "tuple[float, int, int]":
    """Images per second over an epoch (the images really processed: forebay's last
    batch is filled with repeats, torch's is short), median after a warm-up; ``cold``:
    files evicted from the page cache before every epoch.  Also the images processed
    and the bytes read from the throttled ``device`` over all the epochs (0 without)."""
    rates = []
    before = device.read_bytes() if device is not None else 0
    total = 0
    for e in range(epochs):
        if cold:
            evict(cold)
        t0 = time.perf_counter()
        n = sum(int(b["label"].shape[0]) for b in make(e))
        if gpu:
            torch.cuda.synchronize()      # the epoch ends when the device is done
        rates.append(n / (time.perf_counter() - t0))
        total += n
    read = device.read_bytes() - before if device is not None else 0
    return statistics.median(rates[1:]), total, read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-decode"))
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3, help="the first is a warm-up")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--throttle", metavar="MBPS[,IOPS]",
                   help="cap reads from the data's disk (block-I/O cgroup; root)")
    p.add_argument("--evict-each-epoch", action="store_true",
                   help="empty the page cache of the contender's files before every epoch")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: batches go on to the GPU, and GPU-decode contenders run")
    p.add_argument("--only", default="",
                   help="comma-separated names of the contenders to run (torch "
                        "DataLoader always runs)")
    a = p.parse_args()
    with throttled(a.out if a.out.exists() else a.out.parent, a.throttle) as throttle:
        run(a, throttle)


def run(a, throttle) -> None:
    src, packed = jpeg_dataset(a.out, a.samples)
    items = [(f, i % 10) for i, f in enumerate(sorted(src.rglob("*.JPEG")))]
    peers = _peer_datasets(src, a.out, items)
    files = {"torch DataLoader": [f for f, _ in items], "forebay preload": [],
             "forebay direct": files_under(packed), "forebay direct unpinned": files_under(packed),
             "mosaicml-streaming": files_under(a.out / f"{src.name}-mds"),
             "litdata": files_under(a.out / f"{src.name}-litdata")}
    if throttle is not None:
        throttle.join()             # this process and the workers it starts from now on
    setup: dict = {}
    per_sample: dict = {}         # [bytes read from the device, images processed]
    # the decode ceiling: the transform alone, one process
    ds = forebay.open_dataset(packed)
    t0 = time.perf_counter()
    for i in range(len(ds)):
        T(ds[i])
    decode_s = time.perf_counter() - t0
    del ds              # its maps would keep the packed file's pages from being evicted
    gc.collect()
    res: dict = {}
    gpu = a.device == "cuda"
    for wi, w in enumerate(int(x) for x in a.workers.split(",")):
        peer = torch.utils.data.DataLoader(
            Folder(items), batch_size=a.batch, shuffle=True,
            generator=torch.Generator().manual_seed(0), num_workers=w,
            persistent_workers=True, prefetch_factor=4, pin_memory=gpu)

        def torch_dl(e, peer=peer):         # workers kept across epochs, as users do
            return iter(peer)

        # (name, mode, loader keywords); the GPU-decode ones once, beside the first W
        made = [(f"forebay {mode}", mode, dict(workers=w, transform=T, pin_memory=gpu))
                for mode in ("preload", "direct")]
        if gpu:       # what pinning the workers' output costs
            made.append(("forebay direct unpinned", "direct",
                         dict(workers=w, transform=T, pin_memory=False)))
        if gpu and wi == 0:
            made += [(f"forebay {mode} + nvjpeg", mode,
                      dict(views=True, batch_transform=BatchDecodeCropFlip(224, device="cuda")))
                     for mode in ("preload", "direct")]
        if a.only:
            made = [m for m in made if m[0] in a.only.split(",")]
        loaders = {}
        for name, mode, kw in made:
            if a.evict_each_epoch:
                evict(files_under(packed))
            t0 = time.perf_counter()
            b0 = throttle.read_bytes() if throttle is not None else 0
            loaders[name] = DataLoader(packed, a.batch, comm=None, seed=0,
                                       epochs=a.epochs * a.reps, progress=False, store=mode,
                                       pipeline=Pipeline(**kw))
            setup[(w, name)] = (time.perf_counter() - t0,
                                throttle.read_bytes() - b0 if throttle else 0)
        counter = {name: 0 for name in loaders}

        def fb(name, loaders=loaders, counter=counter):
            def make(e):
                dl = loaders[name]
                dl.set_epoch(counter[name])
                counter[name] += 1
                return iter(dl)
            return make

        names = ["torch DataLoader", *loaders]
        makes = {"torch DataLoader": torch_dl, **{name: fb(name) for name in loaders}}
        for pname, make_ds in peers.items():
            if a.only and pname not in a.only.split(","):
                continue
            if pname == "litdata":
                import litdata
                pl = litdata.StreamingDataLoader(make_ds(a.batch), batch_size=a.batch,
                                                 num_workers=w)
            else:
                pl = torch.utils.data.DataLoader(make_ds(a.batch), batch_size=a.batch,
                                                 num_workers=w, persistent_workers=True,
                                                 prefetch_factor=4, pin_memory=gpu)
            names.append(pname)
            makes[pname] = lambda e, pl=pl: iter(pl)
        if gpu:       # the CPU pipelines' batches go on to the device
            for name in list(makes):
                if "nvjpeg" not in name:
                    makes[name] = lambda e, make=makes[name]: _on_device(make(e), "cuda")
        if gpu and wi == 0 and (not a.only or "torch DataLoader + nvjpeg" in a.only.split(",")):
            nv = torch.utils.data.DataLoader(
                FolderBytes(items), batch_size=a.batch, shuffle=True,
                generator=torch.Generator().manual_seed(0), num_workers=w,
                persistent_workers=True, prefetch_factor=4, pin_memory=True,
                collate_fn=bytes_collate)
            step = _torch_nvjpeg("cuda")
            names.insert(1, "torch DataLoader + nvjpeg")
            makes["torch DataLoader + nvjpeg"] = lambda e, nv=nv, step=step: map(step, iter(nv))
        k = len(names)
        for rep in range(a.reps):
            for name in names[rep % k:] + names[:rep % k]:
                r, n, read = epoch_rate(makes[name], a.epochs,
                                        files[name.removesuffix(" + nvjpeg")]
                                        if a.evict_each_epoch else None, throttle, gpu)
                res.setdefault((w, name), []).append(r)
                got = per_sample.setdefault((w, name), [0, 0])
                got[0] += read
                got[1] += n
                print(f"W={w} rep {rep} {name:<18} {r:,.0f} images/s", flush=True)
        for dl in loaders.values():
            dl.close()
    gpu_name = f", GPU {torch.cuda.get_device_name()}" if gpu else ""
    print(f"\nmachine: {machine()}{gpu_name}; {a.samples} JPEGs (~{sum(f.stat().st_size for f, _ in items) / a.samples / 1e3:.0f} KB, "
          f"~450x400), batch {a.batch}, one process; decode alone: {decode_s:.2f} s for all "
          f"({a.samples / decode_s:,.0f} images/s on one core)"
          + (f"; {throttle.describe()}" if throttle is not None else "")
          + ("; files evicted before every epoch" if a.evict_each_epoch else ""))
    for (w, name), (t, nb) in setup.items():
        print(f"W={w} {name}: set-up {t:.2f} s" + (f", {nb:,} bytes read from the device "
                                                  f"({nb / a.samples:,.0f} per image)"
                                                  if throttle is not None else ""))
    dev = throttle is not None
    nv = ("torch DataLoader + nvjpeg" if gpu else None)
    print("\n| workers | contender | images/s, median (max) | vs torch DataLoader "
          "| vs decode ceiling | vs the round's best peer, min / median |"
          + (" vs torch DataLoader + nvjpeg |" if nv else "")
          + (" device bytes read per image over the run (set-up included) |" if dev else "")
          + "\n|---:|---|---:|---:|---:|---:|" + ("---:|" if nv else "") + ("---:|" if dev else ""))
    for (w, name), rs in res.items():
        base = statistics.median(res[(w, "torch DataLoader")])
        ceiling = w * a.samples / decode_s
        med = statistics.median(rs)
        # each round against the fastest non-forebay contender of that round
        best = [max(res[(w2, n2)][r] for (w2, n2) in res if w2 == w
                    and not n2.startswith("forebay")) for r in range(len(rs))]
        ratios = [x / b for x, b in zip(rs, best)]
        extra = f" {min(ratios):.2f} / {statistics.median(ratios):.2f} |"
        if nv:
            nv_rs = res.get((w, nv))
            extra += f" {med / statistics.median(nv_rs):.2f}x |" if nv_rs else " |"
        if dev:
            nb, n = per_sample[(w, name)]
            extra += f" {(nb + setup.get((w, name), (0, 0))[1]) / n:,.0f} |"
        print(f"| {w} | {name} | {med:,.0f} ({max(rs):,.0f}) | {med / base:.2f}x | "
              f"{med / ceiling:.2f} |{extra}")


if __name__ == "__main__":
    main()
