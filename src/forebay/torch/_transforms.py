"""A reference ImageNet training transform: JPEG decode, random-resized crop, flip.

Decoding uses Pillow (libjpeg-turbo in its wheels; the library torchvision's own
``ImageFolder`` pipeline uses); the crop follows torchvision's ``RandomResizedCrop``
(scale 0.08-1, aspect 3/4-4/3, ten tries then a centre crop) and is done with the
resize in one call.  Random choices come from :func:`forebay.torch.sample_rng`, so the
same run gives the same tensors whatever the number of workers.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ._workers import sample_rng

__all__ = ["DecodeCropFlip"]


class DecodeCropFlip:
    """``{"image": JPEG bytes, "label": int}`` -> ``{"image": uint8 (3, size, size)
    tensor, "label": int}``.  A class (not a closure) so that spawned transform
    workers can receive it."""

    def __init__(self, size: int = 224, image: str = "image", label: str = "label",
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.image, self.label = size, image, label
        self.scale, self.ratio = scale, ratio

    def crop_box(self, width: int, height: int, rng: np.random.Generator
                 ) -> tuple[int, int, int, int]:
        area = width * height
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(lo, hi))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = int(rng.integers(0, height - h + 1))
                j = int(rng.integers(0, width - w + 1))
                return j, i, j + w, i + h
        side = min(width, height)             # centre crop
        j, i = (width - side) // 2, (height - side) // 2
        return j, i, j + side, i + side

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import torch
        from PIL import Image

        try:
            rng = sample_rng()
        except InvalidArgumentError:    # outside forebay's loader (torch's, say)
            rng = np.random.default_rng()
        raw = sample[self.image]
        with Image.open(io.BytesIO(raw.tobytes() if hasattr(raw, "tobytes") else raw)) as f:
            rgb = f.convert("RGB")
        box = self.crop_box(rgb.width, rgb.height, rng)
        out = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        arr = np.asarray(out)
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        return {"image": torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))),
                "label": int(sample[self.label])}
