"""Synthetic *source* data shaped like the papers' datasets, so nothing needs downloading.

Each generator writes files in the layout the papers start from (what users have
before ``forebay ingest``):

=========== ================================================================================
ising       DDStore's Ising set: 125 atoms on a jittered 5x5x5 lattice, random spins,
            nearest-neighbour Ising energy, edges within a cutoff.  ``pff``: one pickle
            per sample; ``cff``: one HDF5 file, ragged fields flat + ``NAME_offsets``.
molecules   AISD HOMO-LUMO-like graphs of 5-71 heavy atoms (ragged nodes and edges);
            ``pff`` or ``cff`` as for ising.
mummi       MuMMI's NPZ files, many samples of 8,691 float64 stacked in array ``x``.
imagenet    An ImageFolder tree of JPEG-sized random byte blobs (about 110 KB).
cosmoflow   One ``.npz`` per sample: ``x`` int16 volume (4, S, S, S), ``y`` 4 float32.
=========== ================================================================================

Everything is a pure function of ``seed``; the output directory appears atomically.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
# numpy imports numpy.random on first use; a Ctrl-C or SIGTERM that lands inside its
# extension modules' initialisation is lost (the command wrote on to the end), so it is
# imported here, before a synth has anything half written
import numpy.random  # noqa: F401, E402

from ._fs import check_target, commit_dir, new_tmp_dir
from .progress import Progress, as_progress
from .errors import InvalidArgumentError

__all__ = ["KINDS", "synthesize", "ising_samples", "molecule_samples", "ISING_RAGGED",
           "MOLECULE_RAGGED", "MUMMI_FEATURES"]

MUMMI_FEATURES = 8691
#: fields stored flat + offsets in the CFF (HDF5) layout, with the axis they grow along
ISING_RAGGED = {"edge_index": 1, "edge_attr": 0}
MOLECULE_RAGGED = {"x": 0, "pos": 0, "edge_index": 1, "edge_attr": 0}


def _radius_graph(pos: np.ndarray, cutoff: float) -> tuple[np.ndarray, np.ndarray]:
    d = np.sqrt(((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(d, np.inf)
    src, dst = np.nonzero(d < cutoff)
    return np.stack([src, dst]).astype(np.int64), d[src, dst].astype(np.float32)[:, None]


def ising_samples(n: int, seed: int = 0, side: int = 5, cutoff: float = 1.1,
                  jitter: float = 0.05) -> Iterator[dict[str, np.ndarray]]:
    """DDStore-style Ising configurations (``side**3`` atoms)."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    idx = np.arange(side ** 3).reshape(side, side, side)
    # lattice nearest-neighbour pairs (open boundaries) for the Hamiltonian
    pairs = np.concatenate([
        np.stack([idx[:-1].ravel(), idx[1:].ravel()], 1),
        np.stack([idx[:, :-1].ravel(), idx[:, 1:].ravel()], 1),
        np.stack([idx[:, :, :-1].ravel(), idx[:, :, 1:].ravel()], 1)])
    for _ in range(n):
        spins = rng.choice(np.array([-1.0, 1.0]), size=side ** 3)
        pos = (grid + rng.normal(0.0, jitter, size=grid.shape)).astype(np.float32)
        edge_index, edge_attr = _radius_graph(pos, cutoff)
        energy = -float((spins[pairs[:, 0]] * spins[pairs[:, 1]]).sum())
        yield {"x": spins.astype(np.float32)[:, None], "pos": pos, "edge_index": edge_index,
               "edge_attr": edge_attr, "y": np.array([energy], dtype=np.float64)}


def molecule_samples(n: int, seed: int = 0, min_atoms: int = 5, max_atoms: int = 71,
                     cutoff: float = 1.8) -> Iterator[dict[str, np.ndarray]]:
    """Ragged molecule-like graphs: a random-walk backbone with 1.5 A bonds."""
    rng = np.random.default_rng(seed)
    elements = np.array([6, 7, 8, 9, 16], dtype=np.float32)
    weights = np.array([0.7, 0.12, 0.12, 0.03, 0.03])
    for _ in range(n):
        k = int(np.clip(rng.normal(25, 12), min_atoms, max_atoms))
        steps = rng.normal(size=(k, 3))
        steps *= 1.5 / np.linalg.norm(steps, axis=1, keepdims=True)
        pos = np.cumsum(steps, axis=0).astype(np.float32)
        edge_index, edge_attr = _radius_graph(pos, cutoff)
        z = rng.choice(elements, size=k, p=weights)
        gap = rng.normal(5.0, 1.5) - 0.02 * k
        yield {"x": z[:, None], "pos": pos, "edge_index": edge_index, "edge_attr": edge_attr,
               "y": np.array([gap], dtype=np.float64)}


def _write_pff(out: Path, prefix: str, samples: Iterator[dict], n: int, prog: Progress) -> None:
    width = max(7, len(str(n - 1)))
    for k, s in enumerate(samples):
        with open(out / f"{prefix}-{k:0{width}d}.pkl", "wb") as f:
            pickle.dump(s, f, protocol=5)
        prog.update(1)


def _write_cff(out: Path, name: str, samples: Iterator[dict], n: int, ragged: dict[str, int],
               prog: Progress, chunk: int = 4096) -> None:
    import h5py

    with h5py.File(out / f"{name}.h5", "w") as f:
        done = 0
        while done < n:
            batch = [s for _, s in zip(range(min(chunk, n - done)), samples)]
            for key in batch[0]:
                arrs = [s[key] for s in batch]
                if key in ragged:
                    ax = ragged[key]
                    data = np.concatenate(arrs, axis=ax)
                    counts = np.array([a.shape[ax] for a in arrs], dtype=np.int64)
                    if key not in f:
                        maxshape = list(data.shape)
                        maxshape[ax] = None
                        shape0 = list(data.shape)
                        shape0[ax] = 0
                        f.create_dataset(key, shape=shape0, maxshape=maxshape, dtype=data.dtype,
                                         chunks=True)
                        o = f.create_dataset(key + "_offsets", data=np.zeros(1, np.int64),
                                             maxshape=(None,), chunks=True)
                        o.attrs["axis"] = ax
                    d, o = f[key], f[key + "_offsets"]
                    start = d.shape[ax]
                    d.resize(start + data.shape[ax], axis=ax)
                    sl = [slice(None)] * d.ndim
                    sl[ax] = slice(start, start + data.shape[ax])
                    d[tuple(sl)] = data
                    o0 = len(o)
                    o.resize(o0 + len(counts), axis=0)
                    o[o0:] = start + np.cumsum(counts)
                else:
                    data = np.stack(arrs)
                    if key not in f:
                        f.create_dataset(key, shape=(0,) + data.shape[1:],
                                         maxshape=(None,) + data.shape[1:], dtype=data.dtype,
                                         chunks=True)
                    d = f[key]
                    d.resize(d.shape[0] + len(data), axis=0)
                    d[-len(data):] = data
            done += len(batch)
            prog.update(len(batch))


def _graph_writer(gen: Callable[..., Iterator[dict]], prefix: str, ragged: dict[str, int]):
    def write(out: Path, n: int, seed: int, prog: Progress, format: str = "pff",
              **unused: Any) -> None:
        samples = gen(n, seed)
        if format == "pff":
            _write_pff(out, prefix, samples, n, prog)
        elif format == "cff":
            _write_cff(out, prefix, samples, n, ragged, prog)
        else:
            raise InvalidArgumentError(
                f"format must be 'pff' (pickle per sample) or 'cff' (one HDF5), "
                f"got {format!r}")
    return write


def _mummi(out: Path, n: int, seed: int, prog: Progress, per_file: int = 256,
           **unused: Any) -> None:
    rng = np.random.default_rng(seed)
    nfiles = -(-n // per_file)
    width = max(4, len(str(nfiles - 1)))
    for k, a in enumerate(range(0, n, per_file)):
        m = min(per_file, n - a)
        np.savez(out / f"mummi-{k:0{width}d}.npz", x=rng.normal(size=(m, MUMMI_FEATURES)))
        prog.update(m)


def _jpeg(rng: np.random.Generator) -> bytes:
    """A real JPEG of ImageNet's typical size (about 500 x 375, quality 90, ~110 KB):
    smooth random colour fields plus fine noise, so it compresses like a photograph."""
    import io

    from PIL import Image

    h, w = int(rng.integers(300, 451)), int(rng.integers(350, 501))
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.normal(0, 18, size=(h, w, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _imagenet(out: Path, n: int, seed: int, prog: Progress, classes: int = 10,
              mean_bytes: int = 110_000, encode: str = "blob", **unused: Any) -> None:
    rng = np.random.default_rng(seed)
    dirs = [out / f"n{c:08d}" for c in range(classes)]
    for d in dirs:
        d.mkdir()
    if encode == "jpeg":
        for k in range(n):
            (dirs[k % classes] / f"img-{k:08d}.JPEG").write_bytes(_jpeg(rng))
            prog.update(1)
        return
    if encode != "blob":
        raise InvalidArgumentError(f"encode must be 'blob' or 'jpeg', got {encode!r}")
    sizes = np.clip(rng.lognormal(np.log(mean_bytes) - 0.125, 0.5, size=n), 1024, 16 * mean_bytes)
    for k, size in enumerate(sizes.astype(np.int64)):
        blob = bytearray(rng.integers(0, 256, size=int(size), dtype=np.uint8).tobytes())
        blob[:4] = b"\xff\xd8\xff\xe0"   # JPEG start-of-image + APP0
        blob[-2:] = b"\xff\xd9"          # end-of-image
        (dirs[k % classes] / f"img-{k:08d}.JPEG").write_bytes(blob)
        prog.update(1)


def _cosmoflow(out: Path, n: int, seed: int, prog: Progress, size: int = 32,
               **unused: Any) -> None:
    rng = np.random.default_rng(seed)
    for k in range(n):
        x = rng.poisson(3.0, size=(4, size, size, size)).astype(np.int16)
        y = rng.uniform(-1, 1, size=4).astype(np.float32)
        np.savez(out / f"cosmo-{k:06d}.npz", x=x, y=y)
        prog.update(1)


#: kind -> (writer, how to ingest it, one line of description)
KINDS: dict[str, tuple[Callable[..., None], str, str]] = {
    "ising": (_graph_writer(ising_samples, "ising", ISING_RAGGED),
              "--from pickle --trust-pickle (pff) | --from hdf5 (cff)",
              "125-atom Ising lattices (DDStore)"),
    "molecules": (_graph_writer(molecule_samples, "molecules", MOLECULE_RAGGED),
                  "--from pickle --trust-pickle (pff) | --from hdf5 (cff)",
                  "ragged 5-71 atom graphs (AISD HOMO-LUMO)"),
    "mummi": (_mummi, "--from npz", "NPZ files of stacked 8,691-float64 samples (MuMMI)"),
    "imagenet": (_imagenet, "--from imagefolder",
                 "ImageFolder of ~110 KB JPEG-sized blobs, or real JPEGs (--encode jpeg)"),
    "cosmoflow": (_cosmoflow, "--from npz --layout per-file", "int16 4xSxSxS volumes"),
}


#: written into every synth output: what ``overwrite`` may replace
MARKER = ".forebay-synth.json"


def _replace_problem(path: Path) -> "str | None":
    """Why ``overwrite`` must not replace ``path`` (None: forebay synth wrote it and
    nothing was added since)."""
    try:
        files = int(json.loads((path / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"forebay synth did not write it (no {MARKER})"
    have = sum(1 for p in path.rglob("*") if p.is_file() and p.name != MARKER)
    if have != files:
        return f"it holds {have} files, forebay synth wrote {files} there"
    return None


def _least_bytes(kind: str, options: dict) -> int:
    """A lower bound of one sample's bytes on disk (never more than it takes)."""
    if kind == "mummi":
        return 8_691 * 8
    if kind == "imagenet":
        return int(options.get("mean_bytes") or 110_000) // 2
    if kind == "cosmoflow":
        return 4 * int(options.get("size") or 32) ** 3 * 2
    return 125 * 4 if kind == "ising" else 5 * 4


def _check_space(kind: str, samples: int, out: Path, options: dict) -> None:
    """Refuse at once what cannot fit where it would go (it ran on for hours, or until
    the disk was full), saying how much it needs and how much is free."""
    import shutil

    from ._units import human_bytes

    where = out.parent if str(out.parent) else Path(".")
    while not where.exists() and where != where.parent:
        where = where.parent
    need = samples * _least_bytes(kind, options)
    free = shutil.disk_usage(where).free
    if need > free:
        raise InvalidArgumentError(
            f"{samples:,} {kind} samples need at least {human_bytes(need)}; "
            f"{human_bytes(free)} free in {where}")


def synthesize(kind: str, out: "str | os.PathLike[str]", samples: int, seed: int = 0, *,
               overwrite: bool = False, progress: "Progress | bool | None" = None,
               **options: Any) -> Path:
    """Write ``samples`` synthetic samples of ``kind`` as source files under ``out``.

    Options by kind: ``format`` ("pff" | "cff") for ising and molecules;
    ``per_file`` for mummi; ``classes``, ``mean_bytes`` and ``encode`` ("blob":
    random bytes of JPEG sizes, fast; "jpeg": real decodable JPEGs, via Pillow) for
    imagenet; ``size`` for cosmoflow.  Returns ``out``.  ``overwrite`` replaces only an
    earlier synth output to which nothing was added (it carries a :data:`MARKER` file),
    or an empty directory.
    """
    if kind not in KINDS:
        raise InvalidArgumentError(
            f"unknown synthetic kind {kind!r}; choose one of {', '.join(KINDS)}")
    if samples <= 0:
        raise InvalidArgumentError(f"samples must be positive, got {samples}")
    out = Path(out)
    check_target(out, overwrite, _replace_problem)
    _check_space(kind, samples, out, options)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, live = new_tmp_dir(out)
    prog = as_progress(progress)
    prog.start(samples, desc=f"synth {kind}", unit="sample")
    try:
        KINDS[kind][0](tmp, samples, seed, prog, **{k: v for k, v in options.items()
                                                    if v is not None})
        live.release()
        files = sum(1 for p in tmp.rglob("*") if p.is_file())
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "samples": samples, "seed": seed,
                                              "files": files}) + "\n")
        commit_dir(tmp, out, overwrite, _replace_problem)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        live.release()
        raise
    finally:
        prog.close()
    return out
