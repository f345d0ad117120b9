"""DecodeCropFlip's region decode (forebay._jpeg): libjpeg-turbo decodes only the rows and
columns the crop's resize reads, and the crop comes out byte for byte as Pillow's whole
decode and BILINEAR resize give it; JPEGs it leaves (CMYK, cut short, corrupt, too big)
go to Pillow, which gives the image or its error as before."""

from __future__ import annotations

import io

import numpy as np
import pytest
from mutate import mutate

from forebay.errors import InvalidArgumentError
from forebay.torch import DecodeCropFlip
from forebay.torch import _transforms as tr

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

needs_region = pytest.mark.skipif(
    tr.jpeg_module() is None, reason="forebay._jpeg not built (libjpeg-turbo's headers were "
                             "missing at install: Debian's libjpeg-dev)")


def _jpeg(rng, w, h, gray=False, **save):
    """A smooth random image with noise (like a photograph, unlike flat colour) as JPEG."""
    base = Image.fromarray(rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3),
                                        dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    noisy = np.asarray(base).astype(np.int16) + rng.integers(-20, 21, (h, w, 3))
    img = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
    if gray:
        img = img.convert("L")
    buf = io.BytesIO()
    img.save(buf, "JPEG", **save)
    return buf.getvalue()


def _pillow(data, box, size, flip):
    return tr._pillow_crop(data, size, box, flip, None, np.random.default_rng())


def _crop(data, out, x0, y0, x1, y1, ow, oh, flip):
    return tr.jpeg_module().crop(data, out, x0, y0, x1, y1, ow, oh, flip, tr._pass_order())


def _region(data, box, size, flip):
    out = np.empty((3, size, size), np.uint8)
    assert tr.region_crop(data, out, box, size, flip)
    return out


@needs_region
def test_the_region_decode_gives_pillows_bytes_for_every_kind_of_jpeg_and_box():
    """4:4:4, 4:2:2, 4:2:0 and 4:1:1 chroma, grayscale, progressive, restart markers,
    sizes from 1x1 to odd ones not a multiple of the iMCU; boxes drawn as the transform
    draws them, and arbitrary ones: one column or row wide, at each edge, the whole image;
    downscaled, upscaled, mirrored or not; tall images, which Pillow 13 filters vertically
    first.  (The crop's first and last columns as libjpeg-turbo decodes them with fancy
    upsampling differ from the whole image's: a decode without the margin forebay takes
    gives other bytes here, and so does the other order of the two passes.)"""
    rng = np.random.default_rng(7)
    t = DecodeCropFlip(64)
    kinds = [dict(subsampling=0), dict(subsampling=1), dict(subsampling=2),
             dict(subsampling="4:1:1"), dict(gray=True), dict(subsampling=2, progressive=True),
             dict(subsampling=1, restart_marker_blocks=3), dict(subsampling=2, quality=40),
             dict(subsampling=0, progressive=True, quality=97)]
    checked = 0
    for kind in kinds:
        for w, h in [(1, 1), (7, 5), (33, 17), (211, 149), (320, 241), (64, 400)]:
            data = _jpeg(rng, w, h, **{"quality": 88, **kind})
            assert tr.jpeg_module().info(data) == (w, h)
            boxes = [t.crop_box(w, h, rng) for _ in range(4)]
            boxes += [(0, 0, w, h), (w - 1, 0, w, h), (0, h - 1, w, h),
                      (w // 2, h // 3, w // 2 + 1, h), (0, 0, max(1, w // 3), max(1, h // 2))]
            for box in boxes:
                for size in (16, 64, 224):
                    flip = bool(rng.integers(0, 2))
                    want = _pillow(data, box, size, flip)
                    got = _region(data, box, size, flip)
                    assert np.array_equal(got, want), (kind, w, h, box, size, flip)
                    checked += 1
    assert checked == len(kinds) * 6 * 9 * 3


@needs_region
def test_the_loader_gives_the_same_tensors_with_the_region_decoder_as_with_pillow(tmp_path):
    """Real JPEGs (forebay synth imagenet --encode jpeg, ingested): an epoch through the
    loader with DecodeCropFlip (the region decoder; on 2 threads, and from samples lent
    by the store) gives the tensors DecodeCropFlip(decoder="pillow") gives (the whole
    image by Pillow, as before the region decoder), with the same draws."""
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize
    from forebay.torch import DataLoader, Pipeline

    synthesize("imagenet", tmp_path / "jpg", 16, seed=2, classes=2, encode="jpeg")
    ingest(get_source("imagefolder", tmp_path / "jpg"), tmp_path / "img.fb")

    def epoch(transform, **kw):
        dl = DataLoader(tmp_path / "img.fb", 4, comm=None, seed=3, store="direct",
                        pipeline=Pipeline(transform=transform, **kw))
        out = list(dl)
        dl.close()
        return out

    t = DecodeCropFlip(112)
    assert t.decoder == DecodeCropFlip(112, decoder="region").decoder == "libjpeg-turbo region"
    pillow = DecodeCropFlip(112, decoder="pillow")
    assert pillow.decoder == "Pillow"
    want = epoch(pillow)
    for got in (epoch(t), epoch(t, workers=2), epoch(t, views=True)):
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            assert a["image"].shape == (4, 3, 112, 112)
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


@needs_region
def test_jpegs_the_region_decoder_leaves_go_to_pillow_and_fail_or_decode_as_before():
    """A file cut short (no end-of-image marker): the region decoder declines it, even
    where the cut lies below the crop (it would never read those rows), and the
    transform raises Pillow's error; so does one with a marker libjpeg rejects after the
    image data (Pillow reads that far, the region decoder does not); a cut file closed
    with an end marker decodes with libjpeg's grey fill as Pillow's does; CMYK goes to
    Pillow; garbage after a JPEG's start, and a header claiming 60000 x 60000 pixels
    (Pillow's decompression-bomb check still applies), never reach a decode."""
    rng = np.random.default_rng(5)
    t = DecodeCropFlip(32)
    data = _jpeg(rng, 240, 320, quality=90, subsampling=2)
    cut = data[: len(data) * 2 // 3]
    out = np.empty((3, 32, 32), np.uint8)
    assert not _crop(cut, out, 0, 0, 20, 20, 32, 32, False)   # top rows only
    with pytest.raises(OSError, match="truncated"):
        t({"image": cut, "label": 0})
    closed = cut + b"\xff\xd9"
    for box in [(0, 0, 240, 320), (10, 200, 200, 320), (0, 0, 30, 30)]:
        assert np.array_equal(_region(closed, box, 32, False), _pillow(closed, box, 32, False))

    # a reserved marker after the image data: Pillow (reading the whole file) refuses it;
    # the region decoder, which stops at the crop's last row, leaves it to Pillow
    marked = data[:-2] + b"\xff\x02\xff\xd9"
    assert not _crop(marked, out, 0, 0, 20, 20, 32, 32, False)
    with pytest.raises(OSError, match="broken data stream"):
        t({"image": marked, "label": 0})
    # tables and comments between the data and the end are what libjpeg accepts there
    commented = data[:-2] + b"\xff\xfe\x00\x05abc\xff\xd9"
    assert _crop(commented, out, 0, 0, 20, 20, 32, 32, False)

    cmyk = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).convert(
        "CMYK").save(cmyk, "JPEG")
    assert tr.jpeg_module().info(cmyk.getvalue()) is None
    assert not _crop(cmyk.getvalue(), out, 0, 0, 10, 10, 32, 32, False)
    assert t({"image": cmyk.getvalue(), "label": 0})["image"].shape == (3, 32, 32)

    junk = data[:2] + bytes(rng.integers(0, 256, 500, dtype=np.uint8)) + b"\xff\xd9"
    assert tr.jpeg_module().info(junk) is None
    assert not _crop(junk, out, 0, 0, 10, 10, 32, 32, False)
    with pytest.raises(OSError):
        t({"image": junk, "label": 0})

    # SOF0's height and width fields set to 60000: a bomb by its header
    sof = data.index(b"\xff\xc0")
    bomb = data[:sof + 5] + (60000).to_bytes(2, "big") * 2 + data[sof + 9:]
    assert tr.jpeg_module().info(bomb) == (60000, 60000)
    with pytest.raises(Image.DecompressionBombError):
        t({"image": bomb, "label": 0})


@needs_region
def test_bad_arguments_to_the_region_decoder_are_errors_not_crashes():
    rng = np.random.default_rng(1)
    data = _jpeg(rng, 50, 40, quality=90)
    out = np.empty((3, 8, 8), np.uint8)
    with pytest.raises(ValueError, match="not inside"):
        _crop(data, out, 0, 0, 51, 40, 8, 8, False)
    with pytest.raises(ValueError, match="not inside"):
        _crop(data, out, 10, 10, 10, 20, 8, 8, False)
    with pytest.raises(ValueError, match="bytes"):
        _crop(data, np.empty((3, 8, 7), np.uint8), 0, 0, 50, 40, 8, 8, False)
    with pytest.raises(TypeError):
        _crop(data, b"read-only" * 22, 0, 0, 50, 40, 8, 8, False)


def test_an_unknown_decoder_is_an_error_that_names_the_choices():
    with pytest.raises(InvalidArgumentError, match="'auto', 'region', 'pillow'"):
        DecodeCropFlip(224, decoder="turbo")


@needs_region
def test_mutated_jpegs_never_crash_the_region_decoder_or_write_outside_its_buffer():
    """3,000 JPEGs with bytes flipped, replaced, inserted or deleted (every kind of
    chroma, progressive, restart markers), random boxes: each is declined (False) or
    decoded into the output buffer, whose guard bytes on both sides stay untouched; none
    crashes the process.  (benchmarks/robustness/jpeg_fuzz.py: 674,205 in 2 x 60 s, no
    crash.)"""
    rng = np.random.default_rng(11)
    seeds = [_jpeg(rng, int(rng.integers(20, 150)), int(rng.integers(20, 150)), quality=85,
                   **kind) for kind in (dict(subsampling=0), dict(subsampling=1),
                                        dict(subsampling=2), dict(progressive=True),
                                        dict(subsampling=1, restart_marker_blocks=2),
                                        dict(gray=True))]
    guard = 64
    decoded = declined = 0
    for _ in range(3000):
        d = mutate(seeds[int(rng.integers(len(seeds)))], rng)
        data = d if rng.random() < 0.3 else d + b"\xff\xd9"
        wh = tr.jpeg_module().info(data)
        w, h = wh if wh is not None and wh[0] * wh[1] <= 4_000_000 else (50, 50)
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = (x0, y0, int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1)))
        size = int(rng.choice([8, 33]))
        buf = np.full(3 * size * size + 2 * guard, 0xA5, np.uint8)
        try:
            ok = _crop(data, buf[guard:-guard], *box, size, size, bool(rng.integers(2)))
        except ValueError:      # a box outside what the mutated header now says
            ok = None
        assert (buf[:guard] == 0xA5).all() and (buf[-guard:] == 0xA5).all()
        decoded += ok is True
        declined += ok is False
    assert decoded > 300 and declined > 100, (decoded, declined)
