"""Compressed fields (``codec="zstd"``): each sample's value is one zstd frame of its
own, so a sample is read at random without decompressing its neighbours.  The index
keeps the value's shape (its decompressed size is the shape's product times the
itemsize) and the frame's stored size; the record checksum covers the stored bytes.
A batch's frames are decompressed by one call (python-zstandard's
``multi_decompress_to_buffer``, which releases the GIL), then copied into the
batch's buffer (a field's values are one region of it: one copy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptDatasetError, InvalidArgumentError, UsageError

__all__ = ["Compressor", "inflate", "inflate_one", "parse_compress"]

#: zstd's default level; 1 (fastest) to 22 (smallest)
DEFAULT_LEVEL = 3


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise UsageError("compressed fields need the zstandard package: pip install "
                         "zstandard (forebay's 'sources' extra)") from None
    return zstandard


def parse_compress(spec: Any, names: "list[str] | tuple[str, ...]") -> dict[str, int]:
    """``compress=`` of a writer as ``{field: level}``: ``"zstd"`` or ``"zstd:LEVEL"``
    (every field), or a mapping ``{field: "zstd[:LEVEL]"}``; None or ``{}``: none."""
    if spec is None:
        return {}

    def level_of(text: Any, field: str) -> int:
        if not isinstance(text, str) or text.split(":")[0] != "zstd" or text.count(":") > 1:
            raise InvalidArgumentError(f"compress {field}: give 'zstd' or 'zstd:LEVEL', "
                                       f"got {text!r}")
        if ":" not in text:
            return DEFAULT_LEVEL
        try:
            level = int(text.split(":")[1])
        except ValueError:
            level = 0
        if not 1 <= level <= 22:
            raise InvalidArgumentError(f"compress {field}: the zstd level must be 1 to 22, "
                                       f"got {text!r}")
        return level

    if isinstance(spec, str):
        return {n: level_of(spec, "every field") for n in names}
    if not hasattr(spec, "items"):
        raise InvalidArgumentError(f"compress must be 'zstd[:LEVEL]' or {{field: "
                                   f"'zstd[:LEVEL]'}}, got {spec!r}")
    unknown = sorted(set(spec) - set(names))
    if unknown:
        raise InvalidArgumentError(f"compress names {unknown[0]!r}, not a field of the "
                                   f"samples ({', '.join(names)})")
    return {n: level_of(v, repr(n)) for n, v in spec.items()}


class Compressor:
    """Compresses one value at a time (a writer's, for its compressed fields)."""

    def __init__(self, level: int) -> None:
        self._c = _zstd().ZstdCompressor(level=level, write_content_size=True)

    def __call__(self, value: np.ndarray) -> np.ndarray:
        return np.frombuffer(self._c.compress(value.reshape(-1).view(np.uint8).data),
                             dtype=np.uint8)


def inflate_one(frame: np.ndarray, raw: int, where: str) -> np.ndarray:
    """One value's frame decompressed: ``raw`` bytes (uint8, writable)."""
    if raw == 0:
        return np.empty(0, dtype=np.uint8)
    try:
        got = _zstd().ZstdDecompressor().decompress(frame.data, max_output_size=raw)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the codec's error on damaged data
        raise CorruptDatasetError(f"{where}: its zstd frame does not decompress ({e})") \
            from None
    if len(got) != raw:
        raise CorruptDatasetError(f"{where}: its zstd frame holds {len(got)} bytes, its "
                                  f"shape says {raw}")
    return np.frombuffer(bytearray(got), dtype=np.uint8)


def inflate(src: np.ndarray, starts: np.ndarray, lens: np.ndarray, raw: np.ndarray,
            out: np.ndarray, dst: np.ndarray, name: Any) -> None:
    """Decompress frame k (``src[starts[k]:starts[k]+lens[k]]``) into
    ``out[dst[k]:dst[k]+raw[k]]`` for every k, the places one region (a field's values
    one after another), the frames in one call and one copy.  ``name(k)`` says which
    sample and field frame k is, for an error."""
    zstd = _zstd()
    todo = np.flatnonzero(raw > 0)
    if not len(todo):
        return
    sizes, first = raw[todo], int(dst[todo[0]])
    if (starts < 0).any() or (starts + lens > len(src)).any() or \
            first < 0 or first + int(sizes.sum()) > len(out):
        raise InvalidArgumentError("inflate: a frame or its place is out of bounds")
    if (dst[todo] != first + np.cumsum(sizes) - sizes).any():
        raise InvalidArgumentError("inflate: the values' places are not one region")
    seg = np.stack([starts[todo], lens[todo]], axis=1).astype(np.uint64)
    try:
        got = zstd.ZstdDecompressor().multi_decompress_to_buffer(
            zstd.BufferWithSegments(src, seg.tobytes()),
            decompressed_sizes=raw[todo].astype(np.uint64).tobytes())
        ok = got.size() == int(raw[todo].sum())
    except Exception:  # noqa: BLE001 - some frame is damaged: find and name it
        ok = False
    if not ok:
        for k in todo.tolist():
            inflate_one(src[starts[k]:starts[k] + lens[k]], int(raw[k]), name(k))
        raise CorruptDatasetError(f"{name(int(todo[0]))}: a zstd frame of the batch does "
                                  f"not decompress to its shape's size")
    out[first:first + int(sizes.sum())] = np.frombuffer(b"".join(got), dtype=np.uint8)
