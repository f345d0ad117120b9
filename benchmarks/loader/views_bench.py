"""The cost of a batch lent (``views=True``) against one copied, in one process.

Every mode of ``forebay.torch.DataLoader`` over one packed dataset (files in the page
cache), with and without ``views``, warm epochs interleaved and repeated; the loop only
counts the samples (``--touch``: also reads every byte of the bytes fields once, xxh3).
Reports seconds per epoch (min / median over rounds) and microseconds per sample: what
a batch costs the loader itself once no byte is copied (the lent path's limit)::

    python benchmarks/loader/views_bench.py /tmp/peers-run/imagenet-10240.fb --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", type=Path)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", default="direct,preload,clairvoyant")
    p.add_argument("--touch", action="store_true")
    a = p.parse_args()
    import forebay
    from forebay.dataset import KIND_BYTES
    from forebay.torch import DataLoader, Pipeline
    from forebay.world import LOCAL

    ds = forebay.open_dataset(a.dataset)
    blobs = [f.name for f in ds.schema.fields if f.kind == KIND_BYTES]
    loaders = {}
    for mode in a.modes.split(","):
        for views in (False, True):
            dl = DataLoader(ds, a.batch_size, comm=LOCAL, seed=0, epochs=a.rounds + 1,
                            progress=False, store=mode, pipeline=Pipeline(views=views))
            if mode == "clairvoyant":
                dl.store.wait_filled()
            loaders[f"{mode}{', views' if views else ''}"] = dl
    times: dict[str, list[float]] = {k: [] for k in loaders}
    for epoch in range(a.rounds + 1):          # epoch 0 warms every loader up
        for name, dl in loaders.items():
            dl.set_epoch(epoch)
            t0 = time.perf_counter()
            for batch in dl:
                if a.touch:
                    for f in blobs:
                        for x in batch[f]:
                            xxhash.xxh3_64_intdigest(x if isinstance(x, np.ndarray)
                                                     else x.numpy())
            if epoch:
                times[name].append(time.perf_counter() - t0)
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.dataset.name}: {len(ds)} samples, batch {a.batch_size}, one process, "
          f"files in the page cache, {a.rounds} warm epochs per loader, interleaved"
          f"{'; the loop reads every byte (--touch)' if a.touch else ''}\n")
    print("| loader | epoch s, min / median | us per sample (median) | vs its copy (median) |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        base = statistics.median(times[name.split(",")[0]])
        print(f"| {name} | {min(ts):.3f} / {med:.3f} | {med / len(ds) * 1e6:.2f} | "
              f"{base / med:.2f}x |")
    for dl in loaders.values():
        dl.close()


if __name__ == "__main__":
    main()
