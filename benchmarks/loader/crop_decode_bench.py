"""One image's random-resized crop, in one thread: DecodeCropFlip's region decoder
(``forebay._jpeg``: libjpeg-turbo decodes only the rows and columns the resize reads,
the resize in the same call) against the same transform on Pillow (the whole image
decoded, then resized: what torchvision's ``RandomResizedCrop`` on a PIL image does),
and where Pillow's time goes (its decode alone, its resize alone).  Real JPEGs
(``forebay synth imagenet --encode jpeg``, as pipeline_bench makes them), read into
memory first; contenders interleaved over rounds; ms per image, min / median over
rounds.  (The two transforms give the same bytes for the same draws:
tests/test_transforms.py; outside a loader each call draws its own crop here, of the
same distribution.)

    python benchmarks/loader/crop_decode_bench.py --out /tmp/pipe --samples 3000 \\
        --images 600 --rounds 7
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import jpeg_dataset, machine  # noqa: E402

from forebay.torch import DecodeCropFlip  # noqa: E402


def main() -> None:
    from PIL import Image

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-pipe"))
    p.add_argument("--samples", type=int, default=3000, help="the dataset's size")
    p.add_argument("--images", type=int, default=600, help="images timed")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    src, _ = jpeg_dataset(a.out, a.samples)
    datas = [f.read_bytes() for f in sorted(src.rglob("*.JPEG"))[:a.images]]
    region, pillow = DecodeCropFlip(224), DecodeCropFlip(224, decoder="pillow")
    if region.decoder != "libjpeg-turbo region":
        raise SystemExit("forebay._jpeg is not built here: nothing to compare")
    decoded = []
    for d in datas:
        with Image.open(io.BytesIO(d)) as f:
            f.load()
            decoded.append(f.copy())
    boxes = [pillow.crop_box(*im.size, np.random.default_rng(i))
             for i, im in enumerate(decoded)]

    def transform(t: DecodeCropFlip) -> None:
        for i, d in enumerate(datas):
            t({"image": d, "label": i})

    def pillow_decode() -> None:
        for d in datas:
            with Image.open(io.BytesIO(d)) as f:
                f.load()

    def pillow_resize() -> None:
        for im, box in zip(decoded, boxes):
            im.resize((224, 224), Image.Resampling.BILINEAR, box=box)

    contenders = {"DecodeCropFlip, region decoder": lambda: transform(region),
                  "DecodeCropFlip, Pillow": lambda: transform(pillow),
                  "Pillow's decode alone": pillow_decode,
                  "Pillow's resize alone": pillow_resize}
    region({"image": datas[0], "label": 0})    # torch's import (the transform's first call)
    pillow({"image": datas[0], "label": 0})
    ms: dict = {n: [] for n in contenders}
    names = list(contenders)
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            contenders[n]()
            ms[n].append((time.perf_counter() - t0) / len(datas) * 1e3)
    print(f"# {machine()}; {len(datas)} JPEGs of {a.out / f'jpeg-{a.samples}'} "
          f"(mean {np.mean([len(d) for d in datas]) / 1e3:.0f} KB), one thread, "
          f"{a.rounds} rounds interleaved")
    base = ms["DecodeCropFlip, Pillow"]
    print("| contender | ms per image, min / median | Pillow's transform's time / this one's, "
          "min / median |")
    print("|---|---:|---:|")
    for n in names:
        ratios = [b / x for b, x in zip(base, ms[n])]
        print(f"| {n} | {min(ms[n]):.3f} / {statistics.median(ms[n]):.3f} | "
              f"{min(ratios):.2f} / {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
