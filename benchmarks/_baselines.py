"""Baselines a user has without forebay: torch Datasets over PFF pickles and HDF5, a
per-sample graph collate, and an emulated parallel file system to read them through."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

#: NoPFS Sec. 6.1 (Lassen): aggregate PFS read bandwidth with n concurrent readers, MB/s
LASSEN_MBPS = {1: 330, 2: 730, 4: 1540, 8: 2870}


# -- emulated parallel file system ----------------------------------------------------------
class EmulatedPFS:
    """Adds ``open_latency`` per open and caps each reader at ``t(n)/n`` bytes/s, n = the
    number of concurrent readers (ranks), by sleeping the difference after real reads."""

    def __init__(self, readers: int, open_latency: float) -> None:
        n = max(k for k in LASSEN_MBPS if k <= max(readers, 1))
        self.rate = LASSEN_MBPS[n] * 1e6 * (readers / n if readers > n else 1) / readers
        self.open_latency = open_latency

    def charge(self, nbytes: int, opens: int, elapsed: float) -> None:
        need = opens * self.open_latency + nbytes / self.rate
        if need > elapsed:
            time.sleep(need - elapsed)


PFS: "EmulatedPFS | None" = None


def _read_file(path: Path) -> bytes:
    t0 = time.perf_counter()
    data = path.read_bytes()
    if PFS is not None:
        PFS.charge(len(data), 1, time.perf_counter() - t0)
    return data


# -- baselines: torch Dataset + DistributedSampler -------------------------------------------
def list_collate(samples):
    """What a user does without forebay (PyG Batch.from_data_list in spirit): a
    per-sample loop concatenating node and edge fields, shifting edge indices."""
    import torch

    xs, pos, ei, ea, ys, batch = [], [], [], [], [], []
    off = 0
    for k, s in enumerate(samples):
        n = s["x"].shape[0]
        xs.append(torch.as_tensor(s["x"]))
        pos.append(torch.as_tensor(s["pos"]))
        ei.append(torch.as_tensor(s["edge_index"]) + off)
        ea.append(torch.as_tensor(s["edge_attr"]))
        ys.append(torch.as_tensor(s["y"]))
        batch.append(torch.full((n,), k, dtype=torch.int64))
        off += n
    return {"x": torch.cat(xs), "pos": torch.cat(pos), "edge_index": torch.cat(ei, 1),
            "edge_attr": torch.cat(ea), "y": torch.stack(ys), "batch": torch.cat(batch)}


def pff_dataset(root: Path):
    """Map-style dataset: one pickle file per sample (DDStore's PFF)."""
    import torch

    files = sorted(root.glob("*.pkl"))

    class PFF(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            return pickle.loads(_read_file(files[i]))
    return PFF(), files


def hdf5_dataset(path: Path):
    import h5py
    import torch

    class CFF(torch.utils.data.Dataset):
        def __init__(self):
            self.f = None  # opened lazily in the reading process, never before a fork

        def _open(self):
            self.f = h5py.File(path, "r")
            self.names = [n for n in self.f if not n.endswith("_offsets")]
            self.offs = {n: self.f[n + "_offsets"][:] for n in self.names
                         if n + "_offsets" in self.f}
            self.axes = {n: int(self.f[n + "_offsets"].attrs.get("axis", 0)) for n in self.offs}
            self.rows = self.f[self.names[0]].shape[0] if self.names[0] not in self.offs else \
                len(self.offs[self.names[0]]) - 1
            self.dsets = {n: self.f[n] for n in self.names}  # name lookups cost ~100 us

        def __len__(self):
            if self.f is None:
                self._open()
            return self.rows

        def close(self):
            if self.f is not None:
                self.f.close()
                self.f = None

        def __getitem__(self, i):
            if self.f is None:
                self._open()
            t0 = time.perf_counter()
            out, nbytes = {}, 0
            for n, d in self.dsets.items():
                if n in self.offs:
                    a, b = self.offs[n][i], self.offs[n][i + 1]
                    out[n] = d[:, a:b] if self.axes[n] == 1 else d[a:b]
                else:
                    out[n] = d[i]
                nbytes += out[n].nbytes
            if PFS is not None:
                PFS.charge(nbytes, 0, time.perf_counter() - t0)
            return out
    return CFF(), [path]


# -- ImageNet-like samples: an ImageFolder tree, one file per image ---------------------------
def _image_items(root: Path) -> list:
    """(path, label) in ImageFolderSource's order (classes sorted, files sorted), so
    index i is the same sample in the folder, the HDF5 file and the packed dataset."""
    from forebay.dataset.sources._imagefolder import IMAGE_EXTENSIONS

    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(p, label) for label, c in enumerate(classes)
            for p in sorted((root / c).rglob("*"))
            if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]


def image_folder_dataset(root: Path):
    """torchvision ImageFolder without the decode (the synthetic blobs are not real
    JPEGs; decoding would cost every loader the same): one file read per sample."""
    import numpy as np
    import torch

    items = _image_items(root)

    class Folder(torch.utils.data.Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            path, label = items[i]
            return {"image": np.frombuffer(_read_file(path), dtype=np.uint8),
                    "label": np.int64(label)}
    return Folder(), [p for p, _ in items]


def write_image_cff(root: Path, out: Path) -> Path:
    """The images in one HDF5 file, DDStore-CFF style: all bytes in one uint8 dataset
    with an ``image_offsets`` index, labels alongside (read by :func:`hdf5_dataset`)."""
    import h5py
    import numpy as np

    items = _image_items(root)
    sizes = np.array([p.stat().st_size for p, _ in items], dtype=np.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(out, "w") as f:
        img = f.create_dataset("image", (int(sizes.sum()),), dtype=np.uint8)
        pos = 0
        for (p, _), n in zip(items, sizes):
            img[pos:pos + n] = np.frombuffer(p.read_bytes(), dtype=np.uint8)
            pos += int(n)
        f["image_offsets"] = np.concatenate([[0], np.cumsum(sizes)])
        f["label"] = np.array([label for _, label in items], dtype=np.int64)
    return out


def image_collate(samples):
    """What torchvision's DataLoader hands a decode-free pipeline: per-sample uint8
    tensors and a label tensor."""
    import torch

    return {"image": [torch.from_numpy(s["image"]) for s in samples],
            "label": torch.as_tensor([int(s["label"]) for s in samples])}
