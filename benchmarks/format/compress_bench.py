"""Compressed fields (issue S, item 2): size on disk and random-read throughput of the
same samples stored as they are and with zstd, in forebay, in mosaic's MDS and in
litdata's chunks, each with its own compression.

Samples: ``forebay synth ising`` graphs (HydraGNN's Ising data: node features,
positions, edges; ~12 KB each). Contenders, each a fresh process with its files
evicted from the page cache (epoch 1 cold), then a second epoch (warm), in rotating
order, repeated:

* ``forebay`` / ``forebay zstd``: ``PackedDataset.get_many`` of batches of 64 ids in a
  shuffled order (what every forebay store does per batch), plain or
  ``compress="zstd"`` (level 3, a frame per value);
* ``forebay zstd, decompressed copy``: the zstd dataset given to the stores as the
  node's decompressed copy (``forebay.decompressed(path, into=)``), made in epoch 1
  (removed before each job: the first job on a node), read plain after;
* ``mds zstd``: mosaicml-streaming's ``StreamingDataset(local=, shuffle=True)``
  iterated, over ``MDSWriter(compression="zstd")`` shards (its shards are decompressed
  whole into the directory on first use: removed before each job);
* ``litdata zstd``: litdata's ``StreamingDataset(shuffle=True)`` iterated, over
  ``optimize(compression="zstd")`` chunks (its default layout: frames of rows).

    PYTHONPATH=/tmp/peerlib python benchmarks/format/compress_bench.py --out /tmp/cb \\
        --samples 20000 --rounds 3

(the peers installed as benchmarks/loader/peers_bench.py says; each left out when not
importable.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loader"))
from _common import evict, files_under, machine  # noqa: E402

BATCH = 64


def _rows(packed: Path, k: int):
    import forebay

    ds = forebay.open_dataset(packed)
    return {n: np.array(v) for n, v in ds[k].items()}


_DS: dict = {}


def _lit_row(arg):
    path, k = arg
    if path not in _DS:
        import forebay

        _DS[path] = forebay.open_dataset(path)
    return {n: np.array(v) for n, v in _DS[path][k].items()}


def prepare(a) -> dict[str, Path]:
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    a.out.mkdir(parents=True, exist_ok=True)
    pff, raw, z = a.out / "pff", a.out / "plain.fb", a.out / "zstd.fb"
    if not pff.exists():
        synthesize("ising", pff, a.samples, 0, progress=True)
    if not raw.exists():
        ingest(get_source("pickle", pff, trust_pickle=True), raw)
    if not z.exists():
        ingest(get_source("pickle", pff, trust_pickle=True), z, compress="zstd")
    paths = {"forebay": raw, "forebay zstd": z, "forebay zstd, decompressed copy": z}
    if importlib.util.find_spec("streaming") is not None:
        from peers_bench import _streaming

        mds = a.out / "mds-zstd"
        if not mds.exists():
            sb = _streaming()
            cols = {n: "ndarray" for n in _rows(raw, 0)}
            with sb.MDSWriter(out=str(mds), columns=cols, compression="zstd",
                              size_limit=64 << 20) as w:
                for k in range(a.samples):
                    w.write(_rows(raw, k) if k == 0 else _lit_row((str(raw), k)))
        paths["mds zstd"] = mds
    if importlib.util.find_spec("litdata") is not None:
        lit = a.out / "litdata-zstd"
        if not lit.exists():
            import litdata

            litdata.optimize(fn=_lit_row, inputs=[(str(raw), k) for k in range(a.samples)],
                             output_dir=str(lit), chunk_bytes="64MB", num_workers=1,
                             compression="zstd")
        paths["litdata zstd"] = lit
    return paths


def worker(a) -> None:
    c, path = a.contender, Path(a.path)
    times, n = [], 0
    for epoch in range(2):
        t0 = time.perf_counter()
        n = 0
        if c.startswith("forebay"):
            import forebay

            if epoch == 0 and c.endswith("copy"):
                ds = forebay.decompressed(path, into=path.parent / "local")
            elif epoch == 0:
                ds = forebay.open_dataset(path)
            order = np.random.default_rng(epoch).permutation(len(ds))
            for s in range(0, len(order), BATCH):
                b = ds.get_many(order[s:s + BATCH])
                n += len(b)
        elif c == "mds zstd":
            if epoch == 0:
                from peers_bench import _streaming

                sb = _streaming()
                ds = sb.StreamingDataset(local=str(path), shuffle=True, shuffle_seed=0,
                                         batch_size=BATCH)
            for _ in ds:
                n += 1
        else:
            if epoch == 0:
                import litdata

                ds = litdata.StreamingDataset(str(path), shuffle=True, seed=0)
            ds.set_epoch(epoch + 1)
            for _ in ds:
                n += 1
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"epoch_s": times, "samples": n}), flush=True)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in files_under(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-compress"))
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    paths = prepare(a)
    sizes = {c: _size(path) for c, path in paths.items()}
    sizes["forebay zstd, decompressed copy"] += sizes["forebay"]      # both on the node
    names = list(paths)
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for r in range(a.rounds):
        k = r % len(names)
        for c in names[k:] + names[:k]:
            if c == "mds zstd":     # its shards decompressed by an earlier job
                for f in paths[c].glob("*.mds"):
                    f.unlink()
            shutil.rmtree(a.out / "local", ignore_errors=True)
            evict(files_under(paths[c]))
            proc = subprocess.run([sys.executable, __file__, "--worker", "--contender", c,
                                   "--path", str(paths[c])], capture_output=True, text=True,
                                  timeout=3600, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if proc.returncode != 0:
                sys.exit(f"{c} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(next(line for line in proc.stdout.splitlines()
                                  if line.startswith("RESULT "))[7:])
            res["rep"] = r
            runs[c].append(res)
            print(f"round {r} {c:<14} epochs {', '.join(f'{t:.2f}' for t in res['epoch_s'])} s "
                  f"({res['samples']} samples)", flush=True)
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.samples:,} Ising graphs, one process, batches of {BATCH} (forebay), "
          f"{a.rounds} rounds in rotating order, files evicted before each job")
    print("| contender | on disk | vs forebay plain | cold samples/s, median | vs forebay "
          "plain, min / median | warm samples/s, median | vs forebay plain, min / median |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in names:
        row = [f"{sizes[c] / 2**20:,.1f} MiB", f"{sizes[c] / sizes['forebay']:.2f}"]
        for e in (0, 1):
            rate = [x["samples"] / x["epoch_s"][e] for x in runs[c]]
            base = {x["rep"]: x["samples"] / x["epoch_s"][e] for x in runs["forebay"]}
            ratio = [x["samples"] / x["epoch_s"][e] / base[x["rep"]] for x in runs[c]]
            row += [f"{statistics.median(rate):,.0f}",
                    f"{min(ratio):.2f} / {statistics.median(ratio):.2f}"]
        print(f"| {c} | {' | '.join(row)} |")
    for c in ("mds zstd",):
        if c in paths:
            for f in paths[c].glob("*.mds"):
                f.unlink()
    shutil.rmtree(a.out / "pff", ignore_errors=True)


if __name__ == "__main__":
    main()
