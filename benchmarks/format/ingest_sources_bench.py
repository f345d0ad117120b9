"""Ingest throughput per source on the same data (issue S, item 4): the same samples (a
4 KiB byte blob, a label, 128 float32s) written by each source's own library (NumPy's
npz, pyarrow's Parquet and Arrow IPC, webdataset's TarWriter, zarr, mosaicml-streaming's
MDSWriter, litdata's optimize), then packed by ``forebay.dataset.sources.ingest`` (one
reader; interleaved rounds; the output written back with ``os.sync`` inside each
timing).  Beside them, what a mosaic or litdata user does instead: the same npz
converted to MDS by ``MDSWriter`` (a sample dict a row, as its docs show) and to
litdata's chunks by ``litdata.optimize`` (with 1 and 2 workers), timed the same way.

    PYTHONPATH=/tmp/peerlib python benchmarks/format/ingest_sources_bench.py \
        --out /tmp/isb --samples 20000 --rounds 3

(mosaicml-streaming and litdata as peers_bench.py's docstring installs them; each left
out when not importable.)
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine  # noqa: E402

from forebay.dataset.sources import get_source, ingest  # noqa: E402


def make(out: Path, n: int) -> dict[str, tuple[Path, dict]]:
    """The same samples in every format; returns kind -> (path, options)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zarr

    rng = np.random.default_rng(0)
    blob = rng.integers(0, 255, (n, 4096), dtype=np.uint8)
    label = np.arange(n, dtype=np.int64) % 1000
    vec = rng.normal(size=(n, 128)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "data.npz", blob=blob, label=label, vec=vec)
    table = pa.table({"blob": pa.array([b.tobytes() for b in blob], type=pa.binary()),
                      "label": label,
                      "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel()), 128)})
    pq.write_table(table, out / "data.parquet", row_group_size=2048)
    with pa.ipc.new_file(out / "data.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=2048)
    (out / "wds").mkdir(exist_ok=True)
    per = 2048
    for s in range(0, n, per):
        with tarfile.open(out / "wds" / f"shard-{s // per:05d}.tar", "w") as t:
            for k in range(s, min(s + per, n)):
                for ext, data in (("bin", blob[k].tobytes()), ("cls", b"%d" % label[k]),
                                  ("npy", _npy(vec[k]))):
                    info = tarfile.TarInfo(f"s{k:08d}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
    g = zarr.open_group(str(out / "data.zarr"), mode="w")
    for name, arr in (("blob", blob), ("label", label), ("vec", vec)):
        g.create_array(name, shape=arr.shape, chunks=(2048, *arr.shape[1:]),
                       dtype=arr.dtype)[:] = arr
    made = {"npz": (out / "data.npz", {}), "parquet": (out / "data.parquet", {}),
            "arrow": (out / "data.arrow", {}), "webdataset": (out / "wds", {}),
            "zarr": (out / "data.zarr", {})}
    if _mds_writer() is not None:
        to_mds(out / "data.npz", out / "mds")
        made["mds"] = (out / "mds", {})
    if importlib.util.find_spec("litdata") is not None:
        to_litdata(out / "data.npz", out / "litdata", 1)
        made["litdata"] = (out / "litdata", {})
    return made


_NPZ: dict = {}


def _lit_row(arg: tuple[str, int]) -> dict:
    """One row of the npz, as a litdata user's ``fn`` returns it (the npz opened once per
    optimize worker)."""
    path, k = arg
    if path not in _NPZ:
        with np.load(path) as z:
            _NPZ[path] = (z["blob"], z["label"], z["vec"])
    blob, label, vec = _NPZ[path]
    return {"blob": blob[k].tobytes(), "label": int(label[k]), "vec": vec[k]}


def to_litdata(npz: Path, out: Path, workers: int) -> None:
    """A litdata user's conversion: ``optimize`` over the npz's rows."""
    import litdata

    shutil.rmtree(out, ignore_errors=True)
    with np.load(npz) as z:
        n = len(z["label"])
    litdata.optimize(fn=_lit_row, inputs=[(str(npz), k) for k in range(n)],
                     output_dir=str(out), chunk_bytes="64MB", num_workers=workers)


def _mds_writer():
    """mosaicml-streaming's MDSWriter (only the writer: the package's __init__ imports
    transformers and torchvision), or None: tests/data/mds/make.py's loader."""
    make = Path(__file__).resolve().parents[2] / "tests" / "data" / "mds" / "make.py"
    spec = importlib.util.spec_from_file_location("mds_make", make)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.mds_writer()


def to_mds(npz: Path, out: Path) -> None:
    """A mosaic user's conversion: the npz's rows written by MDSWriter."""
    MDSWriter = _mds_writer()
    shutil.rmtree(out, ignore_errors=True)
    with np.load(npz) as z:
        blob, label, vec = z["blob"], z["label"], z["vec"]
    with MDSWriter(out=str(out), columns={"blob": "bytes", "label": "int",
                                          "vec": "ndarray:float32:128"},
                   size_limit=64 << 20) as w:
        for k in range(len(label)):
            w.write({"blob": blob[k].tobytes(), "label": int(label[k]), "vec": vec[k]})


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-isb"))
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    sources = make(a.out / "src", a.samples)
    peers = {"MDSWriter (npz -> MDS)": lambda: to_mds(sources["npz"][0],
                                                      a.out / "converted-mds")} \
        if "mds" in sources else {}
    if "litdata" in sources:
        for w in (1, 2):
            peers[f"litdata.optimize, {w} worker(s) (npz -> litdata)"] = \
                lambda w=w: to_litdata(sources["npz"][0], a.out / "converted-lit", w)
    names = list(sources) + list(peers)
    times: dict[str, list[float]] = {k: [] for k in names}
    nbytes = 0
    for r in range(a.rounds):
        for kind in (names if r % 2 == 0 else names[::-1]):
            if kind in peers:
                t0 = time.perf_counter()
                peers[kind]()
                os.sync()
                times[kind].append(time.perf_counter() - t0)
                continue
            path, opts = sources[kind]
            dst = a.out / f"{kind}.fb"
            shutil.rmtree(dst, ignore_errors=True)
            t0 = time.perf_counter()
            m = ingest(get_source(kind, path, **opts), dst)
            os.sync()
            times[kind].append(time.perf_counter() - t0)
            assert m.num_samples == a.samples, kind
            nbytes = m.payload_nbytes
    print(f"machine: {machine()}; {a.samples:,} samples ({nbytes / 1e6:.0f} MB packed: a 4 KiB "
          f"blob, a label, 128 float32s), one reader, {a.rounds} interleaved rounds")
    print("| source | samples/s, median (max) | MB/s, median |")
    print("|---|---:|---:|")
    for kind, ts in times.items():
        m = statistics.median(ts)
        print(f"| {kind} | {a.samples / m:,.0f} ({a.samples / min(ts):,.0f}) | "
              f"{nbytes / m / 1e6:,.0f} |")
    for peer in peers:
        r = [p / f for p, f in zip(times[peer], times["npz"])]
        print(f"\nforebay ingest --from npz against {peer} on the same npz, per round "
              f"(its time / forebay's): min {min(r):.2f}x, median {statistics.median(r):.2f}x")
    shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
