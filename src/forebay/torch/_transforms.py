"""A reference ImageNet training transform: JPEG decode, random-resized crop, flip.

The crop follows torchvision's ``RandomResizedCrop`` (scale 0.08-1, aspect 3/4-4/3, ten
tries then a centre crop) and is resized with Pillow's ``BILINEAR`` filter.  Where
forebay's C extension ``forebay._jpeg`` was built (libjpeg-turbo's headers present at
install), libjpeg-turbo decodes only the rows and columns the crop's resize reads and
the resize runs in the same call, to the bytes Pillow gives (checked once per process
before first use, and by the test suite); elsewhere Pillow decodes the whole image.
Random choices come from :func:`forebay.torch.sample_rng`, so the same run gives the
same tensors whatever the number of workers.
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from typing import Any

import numpy as np

from ..dataset import SampleViews
from ..errors import InvalidArgumentError, MissingDependencyError
from ._workers import sample_rng

__all__ = ["DecodeCropFlip", "BatchDecodeCropFlip"]


def _pillow_crop(data: Any, size: int, box: "tuple[int, int, int, int] | None",
                 flip: "bool | None", crop_box: Any, rng: np.random.Generator
                 ) -> np.ndarray:
    """The crop by Pillow: the whole image decoded, the box resized (drawn from the
    image's size if not given), mirrored; (3, size, size) uint8."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as f:
        f.load()
        rgb = f if f.mode == "RGB" else f.convert("RGB")  # (convert copies an RGB one)
        if box is None:
            box = crop_box(rgb.width, rgb.height, rng)
        out = rgb.resize((size, size), Image.Resampling.BILINEAR, box=box)
    arr = np.asarray(out)
    if (rng.random() < 0.5) if flip is None else flip:
        arr = arr[:, ::-1]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


@functools.cache
def jpeg_module() -> Any:
    """``forebay._jpeg``, imported (and libjpeg-turbo loaded) at first use, not with
    ``forebay.torch``; None where it was not built (libjpeg-turbo's headers missing at
    install: Pillow decodes)."""
    try:
        from .. import _jpeg  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return None
    return _jpeg


@functools.cache
def _pass_order() -> int:
    """Which axis Pillow's resize filters first: 1 for Pillow 13's rule (vertically first
    where the height shrinks more than twice as much as the width), 0 for older Pillow's
    (always horizontally first)."""
    import PIL

    return 1 if int(PIL.__version__.split(".")[0]) >= 13 else 0


def _max_pixels() -> "int | None":
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS


def region_crop(data: Any, out: np.ndarray, box: "tuple[int, int, int, int]", size: int,
                flip: bool) -> bool:
    """The crop by the region decoder into ``out`` ((3, size, size) uint8); False, with
    nothing written, for a JPEG it leaves to Pillow."""
    return bool(jpeg_module().crop(data, out, *box, size, size, flip, _pass_order()))


@functools.cache
def region_decoder() -> Any:
    """``forebay._jpeg`` if it is built and gives Pillow's bytes here, else None.

    Checked once per process on two 4:2:0 JPEGs made here (one wide, one tall: Pillow
    13 changed the order of the resize's passes for the second kind): boxes downscaled,
    upscaled, whole and at the edges, each mirrored and not, against Pillow's own decode
    and resize.  A difference (another Pillow resampler, a libjpeg that decodes
    otherwise) is a RuntimeWarning, and Pillow decodes from then on."""
    if jpeg_module() is None:
        return None
    from PIL import Image

    rng = np.random.default_rng(2026)
    cases = {(203, 141): [((0, 0, 203, 141), 64), ((37, 21, 180, 120), 224),
                          ((101, 3, 140, 40), 17), ((0, 90, 31, 141), 50),
                          ((150, 0, 203, 141), 96), ((0, 0, 203, 141), 203)],
             (48, 260): [((0, 0, 48, 260), 32), ((5, 40, 45, 250), 20), ((0, 0, 48, 90), 64)]}
    for (w, h), boxes in cases.items():
        img = Image.fromarray(rng.integers(0, 256, (h // 12, w // 12, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.resize((w, h), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90,
                                                          subsampling=2)
        data = buf.getvalue()
        for box, size in boxes:
            for flip in (False, True):
                want = _pillow_crop(data, size, box, flip, None, rng)
                got = np.empty((3, size, size), np.uint8)
                if not (region_crop(data, got, box, size, flip) and np.array_equal(got, want)):
                    warnings.warn(f"forebay._jpeg's crop of {box} of a {w} x {h} JPEG to "
                                  f"{size} x {size} differs from Pillow's here: "
                                  f"DecodeCropFlip decodes with Pillow", RuntimeWarning,
                                  stacklevel=2)
                    return None
    return jpeg_module()


class DecodeCropFlip:
    """``{"image": JPEG bytes, "label": int}`` -> ``{"image": uint8 (3, size, size)
    tensor, "label": int}``.  A class (not a closure) so that spawned transform
    workers can receive it.  Its time goes to the decode and resize, which release the
    GIL: the loader's ``worker_start="auto"`` runs it on threads.

    ``decoder``: ``"auto"`` (the region decoder where it is built and gives Pillow's
    bytes here, else Pillow), ``"region"`` (the region decoder, a MissingDependencyError
    where it cannot be used) or ``"pillow"`` (the whole image by Pillow, as before the
    region decoder; the same tensors, slower).  The ``decoder`` attribute then says
    which decodes: ``"libjpeg-turbo region"`` (only the rows and columns the crop reads;
    see the module's docstring) or ``"Pillow"``.  A JPEG the region decoder leaves
    (CMYK, 12-bit, no end-of-image marker, data libjpeg fails on, over Pillow's
    decompression-bomb limit) goes to Pillow, which gives the image or its error."""

    #: see :func:`forebay.torch.releases_gil`
    releases_gil = True

    def __init__(self, size: int = 224, image: str = "image", label: str = "label",
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), decoder: str = "auto") -> None:
        if decoder not in ("auto", "region", "pillow"):
            raise InvalidArgumentError(f"decoder={decoder!r}: one of 'auto', 'region', "
                                       f"'pillow'")
        self.size, self.image, self.label = size, image, label
        self.scale, self.ratio = scale, ratio
        # Pillow's import now, not in the first batch (where its first import, with the
        # collection of the training process's objects it can set off, took 82-84 ms of
        # a 2-core machine's first batch)
        try:
            from PIL import Image
        except ImportError as e:
            raise MissingDependencyError(f"DecodeCropFlip decodes with Pillow, which is not "
                                         f"importable here ({e}); pip install Pillow") from e
        Image.preinit()
        region = decoder != "pillow" and region_decoder() is not None
        if decoder == "region" and not region:
            raise MissingDependencyError(
                "DecodeCropFlip(decoder='region'): forebay._jpeg is " + (
                    "not built here (libjpeg-turbo's headers were missing when forebay "
                    "was installed: install Debian's libjpeg-dev or Fedora's "
                    "libjpeg-turbo-devel, then reinstall forebay)" if jpeg_module() is None else
                    "built but gave other bytes than Pillow here (see the warning)"))
        self.decoder = "libjpeg-turbo region" if region else "Pillow"

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

        try:
            rng = sample_rng()
        except InvalidArgumentError:    # outside forebay's loader (torch's, say)
            rng = np.random.default_rng()
        raw = sample[self.image]
        data = raw if isinstance(raw, bytes) else np.ascontiguousarray(raw)
        label = int(sample[self.label])
        box = flip = None
        region = region_decoder() if self.decoder != "Pillow" else None
        wh = region.info(data) if region is not None else None
        if wh is not None and wh[0] * wh[1] > (_max_pixels() or wh[0] * wh[1]):
            wh = None           # Pillow's decompression-bomb check: its warning or error
        if wh is not None:
            box = self.crop_box(wh[0], wh[1], rng)
            flip = rng.random() < 0.5
            out = torch.empty((3, self.size, self.size), dtype=torch.uint8)
            if region_crop(data, out.numpy(), box, self.size, flip):
                return {"image": out, "label": label}
        arr = _pillow_crop(data if isinstance(data, bytes) else data.tobytes(), self.size,
                           box, flip, self.crop_box, rng)
        return {"image": torch.from_numpy(arr), "label": label}


def _pillow_decode(data: "list[Any]", device: Any) -> "list[Any]":
    """JPEG bytes (1-D uint8 tensors) -> RGB (3, H, W) uint8 tensors, with Pillow."""
    import torch
    from PIL import Image

    out = []
    for t in data:
        with Image.open(io.BytesIO(t.numpy().tobytes())) as f:
            arr = np.asarray(f.convert("RGB"))
        out.append(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))).to(device))
    return out


def _torchvision_decode(data: "list[Any]", device: Any) -> "list[Any]":
    """The batch decoded by torchvision (nvjpeg on a CUDA device; one call per batch)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))


class BatchDecodeCropFlip(DecodeCropFlip):
    """:class:`DecodeCropFlip` for a whole batch on a device: the loader's
    ``batch_transform`` (or ``collate_fn``), run where the batch lands.

    ``{"image": JPEG bytes, "label": int}`` samples -> ``{"image": uint8 (B, 3, size,
    size) tensor on device, "label": int64 (B,) tensor}``.  On a CUDA device the batch
    is decoded in one call by ``torchvision.io.decode_jpeg(device="cuda")`` (nvjpeg),
    from a pinned host buffer reused across steps (grown when a batch needs more);
    elsewhere by Pillow.  Crops and flips are drawn per sample from
    :func:`forebay.torch.sample_rngs` in :class:`DecodeCropFlip`'s order, so they are
    the crops and flips the per-sample transform makes; the pixels differ from it by
    the resampling (torch's antialiased bilinear instead of Pillow's).  ``decode``: a
    callable ``(list of 1-D uint8 CPU tensors, device) -> list of (3, H, W) uint8
    tensors`` to use instead.  With the loader's ``Pipeline(views=True)`` the store's
    memory is copied once, straight into the pinned buffer (no batch buffer in between).

    Checked on CPU (Pillow decode) by the test suite, and on CUDA (nvjpeg, the staging
    buffer reused while the device is busy) by ``tests/test_gpu.py`` on a GPU machine.
    """

    def __init__(self, size: int = 224, image: str = "image", label: str = "label",
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), device: Any = "cuda",
                 decode: Any = None) -> None:
        # its decode is whole images (torchvision's or Pillow's, below), not the region's
        super().__init__(size, image, label, scale, ratio, decoder="pillow")
        self.decoder = ("custom" if decode is not None else
                        "nvjpeg" if str(device).startswith("cuda") else "Pillow")
        self.device = device
        self.decode = decode
        self._staging: Any = None       # pinned host buffer, reused across steps
        self._copied: Any = None        # CUDA event: the last batch has left it

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_staging"] = state["_copied"] = None   # pinned memory stays in its process
        return state

    def _host(self, parts: "list[np.ndarray]", cuda: bool) -> "list[Any]":
        """The batch's JPEG bytes (one array per sample) gathered into one host tensor
        (pinned on CUDA, reused), as per-sample 1-D uint8 tensors: a batch lent by the
        store (``views=True``) is copied once, straight into the pinned buffer."""
        import torch

        sizes = [p.nbytes for p in parts]
        ends = np.cumsum(sizes).tolist()
        total = ends[-1] if ends else 0
        if cuda:
            if self._copied is not None:
                self._copied.synchronize()  # the previous batch's copies from it are done
            if self._staging is None or self._staging.numel() < total:
                self._staging = torch.empty(max(total, 1) * 5 // 4, dtype=torch.uint8,
                                            pin_memory=True)
            host = self._staging
        else:
            host = torch.empty(total, dtype=torch.uint8)
        buf = host.numpy()
        for p, a, b in zip(parts, [0] + ends[:-1], ends):
            buf[a:b] = p.reshape(-1).view(np.uint8)
        return [host[a:b] for a, b in zip([0] + ends[:-1], ends)]

    def __call__(self, batch: Any) -> dict[str, Any]:
        import torch
        import torch.nn.functional as F

        from ._workers import sample_rngs

        device = torch.device(self.device)
        cuda = device.type == "cuda"
        n = batch.num_samples
        try:
            rngs = sample_rngs(batch.ids)
        except InvalidArgumentError:    # outside forebay's loader
            rngs = [np.random.default_rng() for _ in range(n)]
        if isinstance(batch, SampleViews):
            data = self._host(batch[self.image], cuda)
            label_values = np.asarray(batch.stacked(self.label))
        else:
            fb = batch.field(self.image)
            data = self._host([fb[k] for k in range(n)], cuda)
            label_values = batch.field(self.label).values
        decode = self.decode or (_torchvision_decode if cuda else _pillow_decode)
        images = decode(data, device)
        out = torch.empty((n, 3, self.size, self.size), dtype=torch.uint8, device=device)
        for k, img in enumerate(images):
            _, height, width = img.shape
            x0, y0, x1, y1 = self.crop_box(width, height, rngs[k])
            crop = img[:, y0:y1, x0:x1].unsqueeze(0).float()
            res = F.interpolate(crop, size=(self.size, self.size), mode="bilinear",
                                align_corners=False, antialias=True)[0]
            if rngs[k].random() < 0.5:
                res = res.flip(-1)
            out[k] = res.round_().clamp_(0, 255).to(torch.uint8)
        labels = torch.as_tensor(label_values.astype(np.int64).reshape(n), device=device)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return {"image": out, "label": labels}
