"""Model repository benchmark after DStore Sec. 6, scaled to one 24 GB machine: store, full
load and 25/50/75% partial loads (the first k% of the layers, as when a backbone is
reused) for several model shapes, side by side in one run:

  forebay file:// (LMDB)   the embedded repository, every read verified against its hash
  forebay memory://        the same in process memory
  torch.save / torch.load  one file; partial = load all, keep some
  torch.load(mmap=True)    one file mapped; partial touches only the kept tensors
  h5py                     one dataset per tensor, partial reads by name (DStore's baseline)
  safetensors              save_file; partial with safe_open + get_tensor

File-based contenders (LMDB included) are read cold (their files evicted from the page
cache before each load) and warm.  Also: this machine's memcpy bandwidth, and storage
growth over 10 versions with one layer changed per version.

    python benchmarks/models/models_bench.py --out /tmp/models-bench [--quick]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import evict, files_under, machine  # noqa: E402

import forebay.models as fm  # noqa: E402

MB = 1 << 20


# -- model shapes (state dicts of float32 tensors) -------------------------------------------
def uniform(n: int, total: int) -> list[tuple[str, tuple]]:
    per = total // n // 4
    cols = 1024 if per >= 1024 else per
    return [(f"layers.{k}.weight", (per // cols, cols)) for k in range(n)]


def varying(n: int, total: int, seed: int = 0) -> list[tuple[str, tuple]]:
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.7, 1.3, n)
    sizes = (w / w.sum() * total / 4).astype(int) // 256 * 256
    return [(f"layers.{k}.weight", (int(s) // 256, 256)) for k, s in enumerate(sizes)]


def vgg19() -> list[tuple[str, tuple]]:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
           512, 512, 512, 512, "M"]
    out, c, k = [], 3, 0
    for v in cfg:
        if v == "M":
            continue
        out += [(f"features.{k}.weight", (v, c, 3, 3)), (f"features.{k}.bias", (v,))]
        c, k = v, k + 1
    for j, (o, i) in enumerate([(4096, 512 * 7 * 7), (4096, 4096), (1000, 4096)]):
        out += [(f"classifier.{j}.weight", (o, i)), (f"classifier.{j}.bias", (o,))]
    return out


def bert_large() -> list[tuple[str, tuple]]:
    h, f = 1024, 4096
    out = [("embeddings.word.weight", (30522, h)), ("embeddings.position.weight", (512, h)),
           ("embeddings.type.weight", (2, h)), ("embeddings.norm.weight", (h,)),
           ("embeddings.norm.bias", (h,))]
    for k in range(24):
        p = f"encoder.{k}."
        for n in ("query", "key", "value", "attn_out"):
            out += [(p + n + ".weight", (h, h)), (p + n + ".bias", (h,))]
        out += [(p + "attn_norm.weight", (h,)), (p + "attn_norm.bias", (h,)),
                (p + "ffn_in.weight", (f, h)), (p + "ffn_in.bias", (f,)),
                (p + "ffn_out.weight", (h, f)), (p + "ffn_out.bias", (h,)),
                (p + "ffn_norm.weight", (h,)), (p + "ffn_norm.bias", (h,))]
    return out


def make(shapes: list[tuple[str, tuple]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.empty(s).uniform_(-1, 1, generator=g) for n, s in shapes}


def layer_prefixes(sd: dict) -> list[str]:
    """Layers (module paths) in order."""
    out: list[str] = []
    for k in sd:
        p = k.rpartition(".")[0]
        if p not in out:
            out.append(p)
    return out


def subset(sd: dict, frac: float) -> list[str]:
    layers = layer_prefixes(sd)
    keep = set(layers[:max(1, round(len(layers) * frac))])
    return [k for k in sd if k.rpartition(".")[0] in keep]


# -- contenders ------------------------------------------------------------------------------
class Contender:
    name = ""
    files: Callable[[], list] = staticmethod(lambda: [])

    def store(self, sd): ...

    def load(self, keys): ...


class Forebay(Contender):
    """Loads return a new state dict (as every other contender); ``into=True`` fills
    tensors allocated once before the timing (restoring a checkpoint into a model)."""

    def __init__(self, url: str, name: str, path: Path | None, into: bool = False) -> None:
        self.name, self.path, self.url, self.into = name, path, url, into
        self.repo = fm.open_repository(url)
        self.files = (lambda: files_under(path)) if path else (lambda: [])
        self.dst: dict = {}

    def store(self, sd):
        self.v = self.repo.save("m", sd)
        if self.into:
            self.dst = {k: torch.empty_like(t) for k, t in sd.items()}

    def reopen(self):
        """Unmap the store, so evicting its file makes the next load cold (pages mapped
        by a process are not dropped)."""
        self.repo.close()
        self.repo = fm.open_repository(self.url)

    def load(self, keys, all_keys):
        inc = None if len(keys) == len(all_keys) else keys
        if self.into:
            return self.repo.load("m", self.v, include=inc,
                                  into={k: self.dst[k] for k in keys})
        return self.repo.load("m", self.v, include=inc)


class TorchSave(Contender):
    def __init__(self, path: Path, mmap: bool) -> None:
        self.path, self.mmap = path / "model.pt", mmap
        self.name = "torch.load(mmap=True)" if mmap else "torch.save/load"
        self.files = lambda: [self.path]

    def store(self, sd):
        torch.save(sd, self.path)
        _fsync(self.path)

    def load(self, keys, all_keys):
        sd = torch.load(self.path, mmap=self.mmap, weights_only=True)
        if self.mmap:  # touch the kept tensors: copy them out of the mapping
            return {k: sd[k].clone() for k in keys}
        return {k: sd[k] for k in keys}


class H5(Contender):
    name = "h5py (dataset per tensor)"

    def __init__(self, path: Path) -> None:
        self.path = path / "model.h5"
        self.files = lambda: [self.path]

    def store(self, sd):
        import h5py

        with h5py.File(self.path, "w") as f:
            for k, t in sd.items():
                f.create_dataset(k, data=t.numpy())
        _fsync(self.path)

    def load(self, keys, all_keys):
        import h5py

        with h5py.File(self.path, "r") as f:
            return {k: torch.from_numpy(f[k][()]) for k in keys}


class Safetensors(Contender):
    name = "safetensors"

    def __init__(self, path: Path) -> None:
        self.path = path / "model.safetensors"
        self.files = lambda: [self.path]

    def store(self, sd):
        from safetensors.torch import save_file

        save_file(sd, str(self.path))
        _fsync(self.path)

    def load(self, keys, all_keys):
        from safetensors import safe_open
        from safetensors.torch import load_file

        # safetensors maps the file: tensors come back before their bytes are read.
        # Copy them out, as torch.load(mmap=True) above, so every contender's load ends
        # with the data in memory.
        if len(keys) == len(all_keys):
            return {k: t.clone() for k, t in load_file(str(self.path)).items()}
        with safe_open(str(self.path), framework="pt") as f:
            return {k: f.get_tensor(k).clone() for k in keys}


def _fsync(path: Path) -> None:
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def memcpy_bandwidth(nbytes: int = 1 << 30) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def disk_read_bandwidth(root: Path, nbytes: int) -> float:
    """What "cold" means here: a file evicted from this VM's page cache, read back."""
    import os

    root.mkdir(parents=True, exist_ok=True)
    path = root / "disk-probe.bin"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
    _fsync(path)
    evict([path])
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt


def bench_model(label: str, sd: dict, root: Path, reps: int) -> list[dict]:
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows = []
    work = root / label.replace(" ", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    conts: list = [Forebay(f"file://{work / 'lmdb'}", "forebay file:// (LMDB)", work / "lmdb"),
                   # its own directory: an environment another contender keeps open
                   # stays mapped, and mapped pages cannot be evicted for a cold read
                   Forebay(f"file://{work / 'lmdb2'}", "forebay file://, in place",
                           work / "lmdb2", into=True),
                   Forebay("memory://", "forebay memory://", None),
                   Forebay("memory://", "forebay memory://, in place", None, into=True),
                   TorchSave(work, False), TorchSave(work, True), H5(work), Safetensors(work)]
    keys_all = list(sd)
    for c in conts:
        t0 = time.perf_counter()
        if c.name == "forebay memory://, in place":  # a fresh store: no dedup with the last
            c.repo = fm.open_repository("memory://")
        c.store(sd)
        t_store = time.perf_counter() - t0
        row = {"model": label, "bytes": nbytes, "layers": len(layer_prefixes(sd)),
               "contender": c.name, "store_s": t_store}
        for frac in (1.0, 0.75, 0.5, 0.25):
            keys = keys_all if frac == 1.0 else subset(sd, frac)
            # cold only where the targets need it (full and 25%): a cold 1 GB read takes
            # seconds here; cold runs once, warm is the best of ``reps``
            cold_too = bool(c.files()) and frac in (1.0, 0.25)
            for cold in ((True, False) if cold_too else (False,)):
                best = float("inf")
                for _ in range(1 if cold else reps):
                    if cold:
                        if isinstance(c, Forebay):
                            c.reopen()
                        evict(c.files())
                    gc.collect()
                    t0 = time.perf_counter()
                    out = c.load(keys, keys_all)
                    best = min(best, time.perf_counter() - t0)
                    assert len(out) == len(keys)
                    del out
                row[f"load{int(frac * 100)}_{'cold' if cold else 'warm'}_s"] = best
        rows.append(row)
        print(_fmt(row), flush=True)
    for c in conts:
        if isinstance(c, Forebay):
            c.repo.close()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def _fmt(r: dict) -> str:
    def g(k):
        v = r.get(k)
        return f"{v:8.3f}" if v is not None else "       -"
    return (f"  {r['model']:<22} {r['contender']:<26} store {r['store_s']:7.3f}  "
            f"full cold {g('load100_cold_s')} warm {g('load100_warm_s')}  "
            f"25% cold {g('load25_cold_s')} warm {g('load25_warm_s')}  "
            f"50% warm {g('load50_warm_s')} 75% warm {g('load75_warm_s')}")


def growth(root: Path, layers: int = 20, total: int = 256 * MB) -> dict:
    """10 versions, one layer changed per version: stored vs base + 10 layers."""
    path = root / "growth"
    shutil.rmtree(path, ignore_errors=True)
    repo = fm.open_repository(f"file://{path}")
    sd = make(uniform(layers, total))
    repo.save("g", sd)
    base = repo.stats()["stored_bytes"]
    layer = sd["layers.0.weight"].numel() * 4
    for v in range(10):
        sd[f"layers.{v % layers}.weight"] = sd[f"layers.{v % layers}.weight"] + 1
        repo.save("g", sd)
    st = repo.stats()
    repo.close()
    shutil.rmtree(path, ignore_errors=True)
    ideal = base + 10 * layer
    return {"base": base, "layer": layer, "stored": st["stored_bytes"],
            "logical": st["logical_bytes"], "ideal": ideal,
            "ratio": st["stored_bytes"] / ideal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/models-bench"))
    p.add_argument("--quick", action="store_true", help="small models only (a smoke run)")
    p.add_argument("--reps", type=int, default=2, help="best of this many loads")
    p.add_argument("--only", help="comma-separated model labels")
    p.add_argument("--prefault-gib", type=int, default=10,
                   help="memory to touch once before measuring (see main())")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"model repository benchmark; {machine()}")
    # a VM backs guest memory on first touch (0.3 GB/s here): touch what the run will
    # use once, so no contender pays that for the others
    t0 = time.perf_counter()
    warm = np.ones((1 << 30) * (1 if a.quick else a.prefault_gib), dtype=np.uint8)
    del warm
    print(f"pre-faulted {1 if a.quick else a.prefault_gib} GiB in "
          f"{time.perf_counter() - t0:.1f} s")
    bw = memcpy_bandwidth(256 * MB if a.quick else 1 << 30)
    print(f"memcpy bandwidth (numpy copyto, best of 3): {bw / 1e9:.2f} GB/s")
    disk = disk_read_bandwidth(a.out, 256 * MB if a.quick else 1 << 30)
    print(f"cold sequential read of a file (evicted, 8 MiB reads): {disk / 1e9:.2f} GB/s")
    scale = 16 if a.quick else 1
    models = {
        "10 x 25.6 MB": lambda: uniform(10, 256 * MB // scale),
        "10 x 102 MB": lambda: uniform(10, 1024 * MB // scale),
        "100 layers 1 GB": lambda: uniform(100, 1024 * MB // scale),
        "500 layers 1 GB": lambda: uniform(500, 1024 * MB // scale),
        "1000 layers 1 GB": lambda: uniform(1000, 1024 * MB // scale),
        "100 layers 1 GB +-30%": lambda: varying(100, 1024 * MB // scale),
        "VGG19": vgg19,
        "BERT-large": bert_large,
    }
    if a.quick:
        models = {k: v for k, v in models.items() if k not in ("VGG19", "BERT-large")}
    if a.only:
        models = {k: v for k, v in models.items() if k in a.only.split(",")}
    rows = []
    for label, shapes in models.items():
        sd = make(shapes())
        rows += bench_model(label, sd, a.out, a.reps)
        del sd
        gc.collect()
    g = growth(a.out, total=(256 * MB) // scale)
    print(f"storage growth, 10 versions with one of 20 layers changed each: stored "
          f"{g['stored'] / MB:.1f} MiB for {g['logical'] / MB:.1f} MiB of versions; base + 10 "
          f"layers = {g['ideal'] / MB:.1f} MiB; ratio {g['ratio']:.4f}")
    by = {(r["model"], r["contender"]): r for r in rows}
    print("\nratios (same run):")
    for label in models:
        f = by.get((label, "forebay file:// (LMDB)"))
        if f is None:
            continue
        fi = by[(label, "forebay file://, in place")]
        full = f["load100_warm_s"]
        print(f"  {label:<22} forebay 25% / full load: warm {f['load25_warm_s'] / full:.2f}, "
              f"cold {f['load25_cold_s'] / f['load100_cold_s']:.2f}; full warm "
              f"{f['bytes'] / full / 1e9:.2f} GB/s = {f['bytes'] / full / bw:.2f}x memcpy, in "
              f"place {f['bytes'] / fi['load100_warm_s'] / 1e9:.2f} GB/s = "
              f"{f['bytes'] / fi['load100_warm_s'] / bw:.2f}x memcpy")
        for other in ("h5py (dataset per tensor)", "safetensors", "torch.save/load",
                      "torch.load(mmap=True)"):
            o = by[(label, other)]
            print(f"      vs {other:<26} store {o['store_s'] / f['store_s']:5.2f}x  "
                  f"full cold {o['load100_cold_s'] / f['load100_cold_s']:5.2f}x  "
                  f"25% cold {o['load25_cold_s'] / f['load25_cold_s']:5.2f}x  "
                  f"25% warm {o['load25_warm_s'] / f['load25_warm_s']:5.2f}x  (their time / ours)")


if __name__ == "__main__":
    main()
